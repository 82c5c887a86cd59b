"""A target sharded with transformers' tensor parallelism, two ranks on the CPU (gloo), each running the whole loop.

One ``torchrun`` launch (``tests/tensor_parallel_ranks.py``) runs every case on both ranks, and one test reads what
each rank generated: tests sharing a fixture may run in different pytest-xdist workers, each launching the ranks again.
Lossless greedy output is the sharded model's own ``generate`` on both ranks, for an assistant, prompt lookup and the
self-drafter, one prompt and a left-padded batch; tiered mode and sampling give both ranks the same tokens. With a
clock that ticks differently on each rank, and the drafter's fastest form measured differently on each, the ranks
still agree: every decision is rank 0's (``engine.shards``). A hang fails the launch's timeout. The launch plan
``examples/tensor_parallel.py`` prints for a multi-GPU machine (NCCL) is built here without a GPU.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import near_copy, tiny_causal_lm

RANKS = Path(__file__).with_name("tensor_parallel_ranks.py")
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "tensor_parallel.py"
LAUNCH_TIMEOUT_S = 240
LOSSLESS = ["assistant-one", "assistant-batch", "lookup-one", "lookup-batch", "self-one", "self-batch", "slim-batch"]
AGREEING = ["tiered-batch", "sampling-one", "sampling-batch"]  # the same tokens on every rank


def launch(folder: Path) -> list[dict]:
    """What each of the two ranks generated, case by case, a target and its drafter saved in ``folder``."""
    target = tiny_causal_lm("llama")
    target.save_pretrained(folder / "target")
    near_copy(target).save_pretrained(folder / "drafter")
    env = os.environ | {"VIASD_HOME": str(folder / "home"), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": os.pathsep.join([str(RANKS.parent), *sys.path])}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RANKS),
               str(folder)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the ranks did not finish in {LAUNCH_TIMEOUT_S} s (a hang):\n{failures(expired.stderr)}")
    assert done.returncode == 0, failures(done.stderr)
    return [json.loads((folder / f"rank{rank}.json").read_text(encoding="utf-8")) for rank in range(2)]


def failures(stderr: str | bytes | None) -> str:
    """What the ranks raised (each rank's error lines), then the end of what they wrote."""
    text = stderr.decode(errors="replace") if isinstance(stderr, bytes) else stderr or ""
    raised = [line for line in text.splitlines() if "Error" in line or "what()" in line]
    return "\n".join(raised[:20]) + "\n...\n" + text[-3000:]


def test_two_sharded_ranks_decode_as_one(tmp_path):
    ranks = launch(tmp_path)
    assert [rank["sharded"] for rank in ranks] == ["DTensor", "DTensor"]
    assert [rank["kernel_choices"] for rank in ranks] == [0, 0], "no attention kernel is timed"
    for case in LOSSLESS:  # the sharded model's own generate, on every rank
        for number, rank in enumerate(ranks):
            assert rank[case]["viasd"] == rank[case]["reference"], f"{case}, rank {number}"
    for case in LOSSLESS + AGREEING:
        assert ranks[0][case] == ranks[1][case], case
    # each rank's clock ticks by random steps of its own, and each would measure another fastest drafting form: rank
    # 0's seconds and form decide on both, and lossless output is still generate's; sampling seeded apart on each rank
    # draws with rank 0's seed
    own = [rank["rank_own_clock"] for rank in ranks]
    for number, rank in enumerate(own):
        for case in ("one", "batch"):
            assert rank[case]["viasd"] == rank[case]["reference"], f"rank {number}'s own clock, {case}"
    assert own[0] == own[1]
    assert own[0]["drafting_weights"] not in ("Parameter", "Tensor"), "rank 0's int8 copy drafts"


def test_the_gpu_launch_plan_is_built_without_a_gpu(capsys):
    """``examples/tensor_parallel.py --dry-run`` prints what a launch on a multi-GPU machine would run: NCCL, one GPU
    per rank, the target sharded, the drafter whole; nothing is loaded."""
    script = runpy.run_path(str(EXAMPLE))
    assert script["main"](["--backend", "nccl", "--nproc", "4", "--dry-run", "--target", "t.json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["command"][:4] == ["torchrun", "--nproc-per-node", "4", "examples/tensor_parallel.py"]
    assert "--dry-run" not in plan["command"] and plan["command"][plan["command"].index("--target") + 1] == "t.json"
    assert [(rank["device"], rank["drafter"]) for rank in plan["ranks"]] == [(f"cuda:{r}", "whole") for r in range(4)]
    assert plan["backend"] == "nccl" and plan["methods"] == ["greedy", "HF assisted", "VIA-SD"]

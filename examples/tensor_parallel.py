"""VIA-SD on a target sharded with transformers' tensor parallelism: greedy, HF assisted and VIA-SD side by side.

Every rank loads the target sharded (``DistributedConfig(tp_plan="auto")``) and the drafter whole, and runs the whole
decode loop; rank 0 prints each method's tokens per second, whether its output is greedy's own, and whether every rank
generated the same tokens (docs/design.md, "Sharded targets")::

    torchrun --nproc-per-node 2 examples/tensor_parallel.py                      # CPU, gloo: the built-in pair
    torchrun --nproc-per-node 8 examples/tensor_parallel.py --backend nccl       # GPUs, one per rank (cuda:LOCAL_RANK)
    python examples/tensor_parallel.py --backend nccl --nproc 8 --dry-run        # the plan, without CUDA or models

``--target`` and ``--drafter`` take a zoo name, a folder or Hub id, or a ``config.json`` (a model of that shape with
random weights, made by rank 0, e.g. ``bench/gpu_shapes/qwen2.5-coder-1.5b.json``: for a machine with no weights
and no network; its speeds say nothing of a trained pair's, its agreement everything). Exit status 1 where ranks
disagree, or where float32 VIA-SD is not greedy's own. torch and viasd_hf are imported inside the functions that use
them, so ``--dry-run`` runs where neither is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
DTYPES = ("float32", "bfloat16")
RANDOM_PROMPT_TOKENS = 24  # prompts of a random-weight pair, which has no tokenizer


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=DEFAULT_TARGET, help="zoo name, folder, Hub id or config.json")
    parser.add_argument("--drafter", default=DEFAULT_DRAFTER, help="zoo name, folder, Hub id or config.json")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo", help="gloo: CPU; nccl: one GPU a rank")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="both models' (float32: exact identity)")
    parser.add_argument("--prompts", type=int, default=2, help="how many of the demo's four prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2, help="ranks, for the plan (torchrun sets the real count)")
    parser.add_argument("--dry-run", action="store_true", help="print the launch plan as JSON; load nothing")
    args = parser.parse_args(argv)
    if args.prompts < 1 or args.max_new_tokens < 1 or args.nproc < 1:
        parser.error("--prompts, --max-new-tokens and --nproc must be at least 1")
    return args


def launch_plan(args: argparse.Namespace) -> dict[str, Any]:
    """What a launch runs: the command, and each rank's device and share of the models."""
    passed = ["--target", args.target, "--drafter", args.drafter, "--backend", args.backend, "--dtype", args.dtype,
              "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
    devices = [f"cuda:{rank}" if args.backend == "nccl" else "cpu" for rank in range(args.nproc)]
    return {"command": ["torchrun", "--nproc-per-node", str(args.nproc), "examples/tensor_parallel.py", *passed],
            "backend": args.backend,
            "ranks": [{"rank": rank, "device": device, "target": f"1/{args.nproc} of every sharded layer",
                       "drafter": "whole"} for rank, device in enumerate(devices)],
            "methods": ["greedy", "HF assisted", "VIA-SD"], "dtype": args.dtype, "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens}  # fmt: skip


def start(backend: str) -> Any:
    """This rank's process group, and its device: the CPU under gloo, GPU ``LOCAL_RANK`` under NCCL."""
    import torch
    import torch.distributed as dist

    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
    return device


def random_weights(config_path: str, folder: Path) -> str:
    """A model of ``config_path``'s shape with random weights (seed 0), saved by rank 0 into ``folder``, which every
    rank then loads."""
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    saved = folder / Path(config_path).stem
    if dist.get_rank() == 0:
        torch.manual_seed(0)
        config = AutoConfig.for_model(**json.loads(Path(config_path).read_text(encoding="utf-8")))
        AutoModelForCausalLM.from_config(config).save_pretrained(saved)
    dist.barrier()
    return str(saved)


def load(name: str, dtype: str, folder: Path, **kwargs: Any) -> tuple[Any, Any]:
    """A model and its tokenizer (``None`` for a random-weight model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from viasd_hf.models.loading import load_pretrained

    if name.endswith(".json"):
        saved = random_weights(name, folder)
        return AutoModelForCausalLM.from_pretrained(saved, dtype=getattr(torch, dtype), **kwargs).eval(), None
    model, tokenizer = load_pretrained(name, dtype=dtype, **kwargs)
    return model.eval(), tokenizer


def prompts(tokenizer: Any, count: int, vocab_size: int, device: Any) -> dict[str, Any]:
    """The demo's first ``count`` prompts, or, without a tokenizer, as many random ones (seeded: every rank's alike)."""
    import torch

    from viasd_hf.bench.demo import PROMPTS, encode

    kinds = list(PROMPTS)[:count]
    if tokenizer is not None:
        return {kind: encode(tokenizer, PROMPTS[kind]).to(device) for kind in kinds}
    generator = torch.Generator().manual_seed(0)
    shape = (1, RANDOM_PROMPT_TOKENS)
    return {kind: torch.randint(vocab_size, shape, generator=generator).to(device) for kind in kinds}


def run(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from transformers.distributed import DistributedConfig

    from viasd_hf import ViaSDConfig, enable_viasd
    from viasd_hf.bench.demo import demo_methods, run_methods

    device = start(args.backend)
    rank = dist.get_rank()
    with shared_scratch() as folder:
        target, tokenizer = load(args.target, args.dtype, folder, distributed_config=DistributedConfig(tp_plan="auto"))
        drafter = load(args.drafter, args.dtype, folder)[0].to(device)
    enable_viasd(target)
    methods = demo_methods(target, {"HF assisted": {"assistant_model": drafter}}, ViaSDConfig())
    ids = prompts(tokenizer, args.prompts, target.config.get_text_config().vocab_size, device)
    with contextlib.redirect_stderr(io.StringIO()) if rank else contextlib.nullcontext():  # one progress bar
        rows = run_methods(methods, ids, args.max_new_tokens)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {row.method: row.outputs for row in rows})
    agreed = {row.method: all(outputs[row.method] == row.outputs for outputs in everyone) for row in rows}
    if rank == 0:
        report(args, rows, agreed, dist.get_world_size(), str(device))
    dist.destroy_process_group()
    exact = args.dtype == "float32"  # in bf16 a near-tie may flip (README, "Modes and their guarantees")
    viasd = next(row for row in rows if row.method == "VIA-SD")
    return 0 if all(agreed.values()) and (viasd.identical or not exact) else 1


@contextlib.contextmanager
def shared_scratch() -> Iterator[Path]:
    """Rank 0's scratch folder, on every rank (one node: the ranks share its disk); removed once every rank is done."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="viasd-tp-") as own:
        carried = [own]
        dist.broadcast_object_list(carried, src=0)
        yield Path(carried[0])
        dist.barrier()


def report(args: argparse.Namespace, rows: list[Any], agreed: dict[str, bool], ranks: int, device: str) -> None:
    greedy = next(row for row in rows if row.method == "greedy").tokens_per_second
    print(f"\n{args.target} sharded over {ranks} ranks ({args.backend}, rank 0 on {device}), drafter {args.drafter} "
          f"whole on every rank; {args.dtype}, {len(rows[0].outputs)} prompt(s) x {args.max_new_tokens} new tokens")
    print(f"{'method':<14} {'tokens/s':>9} {'x greedy':>9}  identical to greedy  same on every rank")
    for row in rows:
        ratio = row.tokens_per_second / greedy if greedy else float("nan")
        print(f"{row.method:<14} {row.tokens_per_second:>9.2f} {ratio:>9.2f}  {'yes' if row.identical else 'no':<19}  "
              f"{'yes' if agreed[row.method] else 'no'}")
    for kind, stats in next(row for row in rows if row.method == "VIA-SD").stats.items():
        print(f"[VIA-SD, {kind}] {stats.summary()}")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.dry_run:
        print(json.dumps(launch_plan(args), indent=2))
        return 0
    if "LOCAL_RANK" not in os.environ:
        print("launch every rank with torchrun: " + " ".join(launch_plan(args)["command"]), file=sys.stderr)
        return 2
    return run(args)


if __name__ == "__main__":
    sys.exit(main())

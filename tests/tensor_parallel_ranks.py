"""One rank of a tensor-parallel target (``tests/test_tensor_parallel.py`` launches two with ``torchrun``).

Run as ``python -m torch.distributed.run --nproc-per-node 2 tests/tensor_parallel_ranks.py FOLDER``: FOLDER holds the
target and its drafter, saved with ``save_pretrained``. Every rank loads the target sharded
(``DistributedConfig(tp_plan="auto")``, gloo on CPU) and the drafter whole, runs every case, and writes what each case
generated, and the sharded model's own ``generate`` for it, to ``FOLDER/rank<r>.json``.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import viasd_hf
from conftest import left_padded, random_prompts
from viasd_hf import ViaSDConfig
from viasd_hf.drafters import precision
from viasd_hf.engine import clock
from viasd_hf.engine.attention import kernel_choices
from viasd_hf.masks.routing_mask import RoutingMask

NEW_TOKENS = 24


@contextmanager
def rank_own_clock(rank: int) -> Iterator[None]:
    """Every rank's ``time.perf_counter``, as the decode loop's clock reads it, moves by random steps of its own (seeded
    by the rank): read rank by rank, no two ranks would agree on any block's seconds."""
    steps = random.Random(rank)
    reading = [0.0]

    def perf_counter() -> float:
        reading[0] += steps.expovariate(1.0) * 10.0 ** steps.randint(-4, 0)
        return reading[0]

    with mock.patch.object(clock, "time", SimpleNamespace(perf_counter=perf_counter)):
        yield


@contextmanager
def rank_own_drafting_form(rank: int) -> Iterator[None]:
    """Measured rank by rank, the drafter's fastest form would be torchao's int8 on rank 0 and bf16 on every other rank
    (an int8 copy reads through its dequantised twin, from a pass length measured on rank 0 too)."""
    with mock.patch.object(precision, "measured_form",
                           lambda drafter: "torchao-int8-weight-only" if rank == 0 else "bf16"):
        yield


def drafting_weights(drafter: Any) -> str:
    """The kind of weight the drafter's drafting copy multiplies by (``Parameter``: no copy, or an unquantised one)."""
    drafting = precision.drafting_copy(drafter) or drafter
    return type(next(module for module in drafting.modules() if isinstance(module, torch.nn.Linear)).weight).__name__


def cases(target: Any, drafter: Any, rank: int, folder: Path) -> dict[str, Callable[[], dict[str, Any]]]:
    """Each case: what VIA-SD generated, and the sharded model's own ``generate`` where greedy output must equal it."""
    one = torch.randint(2, 96, (1, 12), generator=torch.Generator().manual_seed(3))
    batch, mask = left_padded(random_prompts(5, repeat=True))
    lookup_one = random_prompts(7, lengths=(12,), repeat=True)[0][None]
    skip = [1, 3]

    def greedy(ids: torch.Tensor, attention: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        common = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, attention_mask=attention)
        reference = target.generate(ids, **common)
        return {"viasd": target.generate(ids, **common, **kwargs).tolist(), "reference": reference.tolist()}

    def sampled(seed: int, ids: torch.Tensor, attention: torch.Tensor | None = None, **kwargs: Any) -> dict[str, Any]:
        torch.manual_seed(seed)
        tokens = target.generate(ids, attention_mask=attention, max_new_tokens=NEW_TOKENS, do_sample=True,
                                 temperature=0.8, pad_token_id=0, **kwargs)
        return {"viasd": tokens.tolist()}

    def rank_own_clock_case() -> dict[str, Any]:
        fresh = AutoModelForCausalLM.from_pretrained(folder / "drafter").eval()  # its drafting form not measured yet
        with rank_own_clock(rank), rank_own_drafting_form(rank):
            outputs = {"batch": greedy(batch, mask, assistant_model=fresh, viasd_config=ViaSDConfig()),
                       "one": greedy(one, assistant_model=fresh, viasd_config=ViaSDConfig()),
                       "sampled": sampled(100 + rank, batch, mask, assistant_model=fresh, viasd_config=ViaSDConfig())}
        outputs["drafting_weights"] = drafting_weights(fresh)
        return outputs

    return {
        "assistant-one": lambda: greedy(one, assistant_model=drafter, viasd_config=ViaSDConfig()),
        "assistant-batch": lambda: greedy(batch, mask, assistant_model=drafter, viasd_config=ViaSDConfig()),
        "lookup-one": lambda: greedy(lookup_one, prompt_lookup_num_tokens=3, viasd_config=ViaSDConfig()),
        "lookup-batch": lambda: greedy(batch, mask, prompt_lookup_num_tokens=3, viasd_config=ViaSDConfig()),
        "self-one": lambda: greedy(one, viasd_config=ViaSDConfig(
            self_draft_mask=RoutingMask.from_model(target, skip=skip))),
        "self-batch": lambda: greedy(batch, mask, viasd_config=ViaSDConfig(
            self_draft_mask=RoutingMask.from_model(target, skip=skip))),
        "slim-batch": lambda: greedy(batch, mask, assistant_model=drafter, viasd_config=ViaSDConfig(
            routing_mask=RoutingMask.from_model(target, skip=skip))),
        "tiered-batch": lambda: {"viasd": target.generate(
            batch, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
            assistant_model=drafter, viasd_config=ViaSDConfig(
                mode="tiered", routing_mask=RoutingMask.from_model(target, skip=skip))).tolist()},
        "sampling-one": lambda: sampled(7, one, assistant_model=drafter, viasd_config=ViaSDConfig()),
        "sampling-batch": lambda: sampled(7, batch, mask, assistant_model=drafter, viasd_config=ViaSDConfig()),
        "rank_own_clock": rank_own_clock_case,
    }


def main(folder: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    target = AutoModelForCausalLM.from_pretrained(folder / "target",
                                                  distributed_config=DistributedConfig(tp_plan="auto")).eval()
    drafter = AutoModelForCausalLM.from_pretrained(folder / "drafter").eval()
    viasd_hf.enable_viasd(target)
    results: dict[str, Any] = {"sharded": type(target.model.layers[0].self_attn.q_proj.weight).__name__}
    for name, case in cases(target, drafter, rank, folder).items():
        results[name] = case()
    results["kernel_choices"] = len(kernel_choices())  # no attention kernel was timed
    (folder / f"rank{rank}.json").write_text(json.dumps(results), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

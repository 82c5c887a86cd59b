"""The decoding loop's own seconds on a device: each traced method run there on random-weight models.

A call's time is its passes plus the loop's own work between them (choosing, comparing, cropping
caches, launching small kernels and waiting on them), which runs on the host of the device that
runs the passes. A trace records that work on the machine that recorded it; on another device it
costs what that device and its host make it cost. So each traced method is run on the device on
models built from the traced configs with random weights (:func:`viasd_hf.bench.pass_costs.build`),
its passes traced as the bench traces them, and what is left of the call's seconds is the loop's:
kept per pass of the target's body (prompt, verifying and slim passes), the step the loop takes
once per block. With random weights the drafter is seldom right, so the blocks are short; the loop's
work per block depends little on how many drafted tokens a block keeps.

Needs torch and transformers only (as :mod:`viasd_hf.bench.pass_costs`), and the viasd_hf source
tree, so ``bench/gpu_costs.py --loop`` runs it on a GPU machine with no weights and no network.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from viasd_hf.bench.methods import MethodSettings, MethodTable
from viasd_hf.bench.pass_costs import build
from viasd_hf.bench.traces import TARGET_ROLE, CallTrace, PassRecorder, TraceWriter, read_traces
from viasd_hf.masks.routing_mask import RoutingMask

PROMPT_TOKENS = 64
NEW_TOKENS = 32


def _middle(layers: int, count: int) -> list[int]:
    start = (layers - count) // 2
    return list(range(start, start + count))


def measure_loop(traces: str | Path, device: str, repeats: int = 2, new_tokens: int = NEW_TOKENS,
                 record: str | Path | None = None, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Per traced method: the loop's seconds per target pass on ``device`` (the median over ``repeats`` timed calls
    after one warm-up), with the target and drafter of the traces rebuilt there with random weights. With ``record``,
    the timed calls are written there as a traces folder: replayed on costs measured on the same device, they check
    the replay there as the recording machine's traces check it at home."""
    models, calls = read_traces(traces)
    roles = {described["role"]: described for described in models.values()}
    target = build(roles[TARGET_ROLE], device)
    drafter = build(roles["drafter"], device) if "drafter" in roles else target
    layers = target.config.num_hidden_layers
    traced_key = next(key for key, described in models.items() if described["role"] == TARGET_ROLE)
    ran = [p.layers for call in calls for p in call.passes if p.model == traced_key and p.kind == "body"]
    skipped = max(layers - min(ran, default=layers), 1)  # the routed passes the trace ran, or one layer
    mask = RoutingMask.from_model(target, skip=_middle(layers, skipped))
    self_mask = RoutingMask.from_model(target, skip=_middle(layers, layers // 2))
    names = list(dict.fromkeys(call.method for call in calls))
    methods = MethodTable(target, drafter, mask, self_mask, MethodSettings()).build(names)
    traced = {TARGET_ROLE: target} | ({"drafter": drafter} if drafter is not target else {})
    recorder = PassRecorder(traced)
    writer = TraceWriter(record, traced) if record is not None else None
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(target.config.vocab_size, (1, PROMPT_TOKENS), generator=generator).to(device)
    common = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False,
              "return_dict_in_generate": True, "pad_token_id": 0}
    measured: dict[str, Any] = {}
    with recorder.recording():
        for name, method in methods.items():
            progress(f"the loop of {name} on {device} ...")
            method(ids, common)  # warm-up: first-call setup is no block's work
            per_pass = []
            for repeat in range(repeats):
                recorder.take()
                started = time.perf_counter()
                outcome = method(ids, common)
                seconds = time.perf_counter() - started
                call = CallTrace(name, 0, repeat, seconds, len(outcome.tokens), recorder.take())
                if writer is not None:
                    writer.write(call)
                per_pass.append(call.loop_seconds / max(call.target_passes, 1))
            measured[name] = {"per_target_pass": statistics.median(per_pass), "new_tokens": new_tokens}
    return measured

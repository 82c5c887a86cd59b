"""``viasd bench --batch-size``: lossless VIA-SD on padded batches against what a user can run instead.

For each batch size B the prompts are cut into batches of B in order, each left-padded, and decoded
by batched greedy ``generate`` and by batched lossless VIA-SD, the two taking turns on each batch.
Two references do not depend on B, so they run once, one prompt at a time: HF assisted generation
(what a user must run today, since it refuses batches) and lossless VIA-SD on batch size 1.
Throughput is every row's new tokens, up to and including its first EOS, over the wall time of the
calls (prefill included); a batch's time is the median of ``repeats`` runs. Each batch size reports
how many rows VIA-SD decoded exactly as batched greedy did, and how many of VIA-SD's blocks decoded
plainly because speculation did not pay (its ``viasd_stats``), with the switch's last verdict.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from viasd_hf.config import ViaSDConfig
from viasd_hf.generation import enable_viasd

Decode = Callable[[torch.Tensor, torch.Tensor], tuple[list[list[int]], float, Any]]


@dataclass
class BatchRow:
    """One batch size: tokens/s of each method and VIA-SD's ratios to the others (``None`` when not measured)."""

    batch_size: int
    new_tokens: int
    greedy_tokens_per_s: float
    viasd_tokens_per_s: float
    viasd_over_greedy: float
    viasd_over_hf_one_at_a_time: float | None
    viasd_over_viasd_batch_1: float | None
    rows_identical_to_greedy: int
    rows: int
    viasd_plain_block_share: float | None = None  # VIA-SD's blocks decoded without a draft (first repeat)
    viasd_verdict: str | None = None  # the speculation switch's verdict after the last batch


def left_pad(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, L_i]`` prompts as one left-padded ``[B, max L]`` batch and its attention mask."""
    width = max(ids.shape[1] for ids in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(prompts):
        input_ids[row, width - ids.shape[1] :] = ids[0]
        attention_mask[row, width - ids.shape[1] :] = 1
    return input_ids, attention_mask


def until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    """A row's new tokens up to and including its first EOS (a finished row is padded after it)."""
    end = next((i for i, token in enumerate(tokens) if token in eos), None)
    return tokens if end is None else tokens[: end + 1]


def decoder(target: nn.Module, common: dict[str, Any], eos: set[int], **extra: Any) -> Decode:
    """One ``generate`` call on a batch: each row's new tokens (to its EOS), the call's seconds and its
    ``viasd_stats`` (``None`` for plain ``generate`` and HF's decoders)."""

    def decode(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[list[list[int]], float, Any]:
        started = time.perf_counter()
        out = target.generate(input_ids, attention_mask=attention_mask, **common, **extra)
        seconds = time.perf_counter() - started
        rows = [until_eos(row, eos) for row in out.sequences[:, input_ids.shape[1] :].tolist()]
        return rows, seconds, getattr(out, "viasd_stats", None)

    return decode


def _tokens_per_s(decode: Decode, prompts: list[torch.Tensor], pad_token_id: int, repeats: int,
                  bar: tqdm) -> tuple[float, list[list[int]]]:
    """One method one prompt at a time: total new tokens over the sum of per-prompt median times."""
    tokens, seconds, outputs = 0, 0.0, []
    for ids in prompts:
        runs = [decode(*left_pad([ids], pad_token_id)) for _ in range(repeats)]
        outputs += runs[0][0]
        tokens += len(runs[0][0][0])
        seconds += statistics.median(run[1] for run in runs)
        bar.update(repeats)
    return tokens / seconds, outputs


def run_batch_sweep(
    target: nn.Module,
    drafter: nn.Module,
    config: ViaSDConfig,
    prompts: list[torch.Tensor],
    batch_sizes: list[int],
    max_new_tokens: int,
    pad_token_id: int,
    repeats: int = 1,
    load: AbstractContextManager[object] | None = None,
) -> list[BatchRow]:
    """Batched greedy and batched lossless VIA-SD at each of ``batch_sizes``, and the one-at-a-time references;
    ``load`` held around the timed calls, after the warm-up (as in :func:`viasd_hf.bench.runner.run_methods`)."""
    if not prompts or not batch_sizes or repeats < 1 or any(size < 1 for size in batch_sizes):
        raise ValueError(f"nothing to run: {len(prompts)} prompts, batch sizes {batch_sizes}, {repeats} repeats")
    enable_viasd(target)
    eos = set(torch.as_tensor(target.generation_config.eos_token_id).flatten().tolist())
    common = {"max_new_tokens": max_new_tokens, "do_sample": False, "pad_token_id": pad_token_id,
              "return_dict_in_generate": True}
    greedy = decoder(target, common, eos, viasd_config=None)
    viasd = decoder(target, common, eos, assistant_model=drafter, viasd_config=config)
    hf_assisted = decoder(target, common, eos, assistant_model=drafter, viasd_config=None)
    short = common | {"max_new_tokens": min(8, max_new_tokens)}
    one, several = left_pad(prompts[:1], pad_token_id), left_pad(prompts[: max(batch_sizes)], pad_token_id)
    for warm, extra in ((one, {"assistant_model": drafter, "viasd_config": None}),
                        (one, {"assistant_model": drafter, "viasd_config": config}),
                        (several, {"viasd_config": None}), (several, {"assistant_model": drafter, "viasd_config": config})):
        decoder(target, short, eos, **extra)(*warm)
    batches = sum(-(-len(prompts) // size) for size in batch_sizes)
    with tqdm(total=(2 * batches + 2 * len(prompts)) * repeats, desc="viasd bench (batches)", unit="run") as bar, (
        load or nullcontext()
    ):
        hf_one, _ = _tokens_per_s(hf_assisted, prompts, pad_token_id, repeats, bar)
        viasd_one, _ = _tokens_per_s(viasd, prompts, pad_token_id, repeats, bar)
        rows = [_batch_row(size, greedy, viasd, prompts, pad_token_id, repeats, bar) for size in batch_sizes]
    for row in rows:
        row.viasd_over_hf_one_at_a_time = round(row.viasd_tokens_per_s / hf_one, 3)
        row.viasd_over_viasd_batch_1 = round(row.viasd_tokens_per_s / viasd_one, 3)
    return rows


def _batch_row(size: int, greedy: Decode, viasd: Decode, prompts: list[torch.Tensor], pad_token_id: int,
               repeats: int, bar: tqdm) -> BatchRow:
    """Both batched methods over every batch of ``size``, taking turns on each batch."""
    seconds = {"greedy": 0.0, "viasd": 0.0}
    tokens = {"greedy": 0, "viasd": 0}
    identical, blocks, plain_blocks, verdict = 0, 0, 0, None
    for start in range(0, len(prompts), size):
        batch = left_pad(prompts[start : start + size], pad_token_id)
        outputs: dict[str, list[list[int]]] = {}
        for name, decode in (("greedy", greedy), ("viasd", viasd)) if start // size % 2 == 0 else (("viasd", viasd), ("greedy", greedy)):
            runs = [decode(*batch) for _ in range(repeats)]
            outputs[name] = runs[0][0]
            tokens[name] += sum(map(len, runs[0][0]))
            if name == "viasd":
                stats = runs[0][2]
                blocks, plain_blocks, verdict = blocks + stats.blocks, plain_blocks + stats.plain_blocks, stats.speculation_verdict
            seconds[name] += statistics.median(run[1] for run in runs)
            bar.update(repeats)
        identical += sum(ours == theirs for ours, theirs in zip(outputs["viasd"], outputs["greedy"]))
    greedy_rate, viasd_rate = tokens["greedy"] / seconds["greedy"], tokens["viasd"] / seconds["viasd"]
    return BatchRow(size, tokens["viasd"], round(greedy_rate, 3), round(viasd_rate, 3), round(viasd_rate / greedy_rate, 3),
                    None, None, identical, len(prompts), round(plain_blocks / blocks, 3) if blocks else None, verdict)


def batch_markdown(rows: list[BatchRow]) -> str:
    """The sweep as a table: tokens/s per method and VIA-SD's ratios."""
    header = ("| batch size | greedy tok/s | VIA-SD tok/s | × batched greedy | × HF assisted one at a time | "
              "× VIA-SD batch 1 | rows identical to greedy | VIA-SD blocks plain |")
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(f"| {row.batch_size} | {row.greedy_tokens_per_s:.2f} | {row.viasd_tokens_per_s:.2f} | "
                     f"{row.viasd_over_greedy:.2f} | {row.viasd_over_hf_one_at_a_time:.2f} | "
                     f"{row.viasd_over_viasd_batch_1:.2f} | {row.rows_identical_to_greedy}/{row.rows} | "
                     f"{_share(row.viasd_plain_block_share)} |")
    return "\n".join(lines)


def _share(value: float | None) -> str:
    return "–" if value is None else f"{value:.0%}"


def batch_report(rows: list[BatchRow]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]

"""Run every method on the same prompts in one process and summarise speed, work and quality.

Speed is only comparable within one run (machine load moves absolute tokens/s by more than the effects
measured: docs/design.md, "Benchmarking"), so the methods alternate prompt by prompt (the order rotates, so
none always runs first), after a warm-up of each. Each prompt's time is the median over ``repeats``; a method's
speed-up is the median over prompts of its tokens/s divided by greedy's on the same prompt.

Agreement with greedy's output, position by position, says little in bf16: the first near-tie that flips
with a pass's shape shifts everything after it, so even lossless methods score well below 1 there
(docs/results.md, "Tiered mode"). Full-model agreement judges each generated token on its own, teacher-forced:
one pass of the full model over the prompt and the method's output gives its greedy choice at every position.
A lossless method scores 1.0 up to rounding (greedy's own score is that noise floor); a lossy tier (the slim
verifier, a cascade) scores below it by the share of tokens the full model would not have chosen.
"""

from __future__ import annotations

import ctypes
import gc
import statistics
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

from viasd_hf.bench.methods import Method, Outcome
from viasd_hf.bench.quality import quality
from viasd_hf.bench.traces import CallTracer
from viasd_hf.data.tasks import Example
from viasd_hf.extras import require

psutil = require("psutil", "bench", "viasd bench")

TIERS = ("drafter", "slim", "full")


@dataclass
class MethodRuns:
    """One method's outcome on every prompt (first repeat) and the seconds of every repeat."""

    outcomes: list[Outcome] = field(default_factory=list)
    seconds: list[list[float]] = field(default_factory=list)
    peak_memory_bytes: int = 0

    def tokens_per_s(self, index: int) -> float:
        return len(self.outcomes[index].tokens) / statistics.median(self.seconds[index])


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator peak, else the process RSS sampled every few ms.

    On CPU, freed memory stays in the C allocator's pools and would hide a method's own
    allocations (its KV cache, logits), so the pools are handed back to the OS before each
    measurement where glibc allows it.
    """

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.process = psutil.Process()
        try:
            self._malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            self._malloc_trim = None

    @contextmanager
    def measure(self) -> Iterator[dict[str, int]]:
        result = {"peak_bytes": 0}
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            yield result
            result["peak_bytes"] = torch.cuda.max_memory_allocated() - before
            return
        gc.collect()
        if self._malloc_trim is not None:
            self._malloc_trim(0)
        before = self.process.memory_info().rss
        peak = [before]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(self.interval):
                peak[0] = max(peak[0], self.process.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            yield result
        finally:
            done.set()
            sampler.join()
            peak[0] = max(peak[0], self.process.memory_info().rss)
            result["peak_bytes"] = peak[0] - before


def encode(tokenizer: Any, prompt: str) -> torch.Tensor:
    """The prompt as a chat model sees it: the chat template with the assistant turn opened, when there is one."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def run_methods(
    methods: dict[str, Method],
    tokenizer: Any,
    examples: list[Example],
    max_new_tokens: int,
    repeats: int = 1,
    temperature: float | None = None,
    tracer: CallTracer | None = None,
    load: AbstractContextManager[object] | None = None,
) -> dict[str, MethodRuns]:
    """Decode every example with every method, interleaved; greedy unless ``temperature`` is given (seeded alike);
    with ``tracer``, every timed call's passes are recorded (:mod:`viasd_hf.bench.traces`). ``load`` (a background
    load, :mod:`viasd_hf.bench.load`) is held from the first timed call to the last: what the warm-up measures
    and caches for later runs (kernels, the drafter's form) is not measured under it."""
    if not examples or not methods or repeats < 1:  # refused before the run: a summary of nothing would crash after it
        raise ValueError(
            f"nothing to run: {len(examples)} examples, {len(methods)} methods, {repeats} repeats (each must be >= 1)"
        )
    common: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "do_sample": False,
        "return_dict_in_generate": True,
        "pad_token_id": tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    }
    if temperature is not None:
        common |= {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    encoded = [encode(tokenizer, example.prompt) for example in examples]
    for method in methods.values():
        method(encoded[0], common | {"max_new_tokens": min(8, max_new_tokens)})
    runs = {name: MethodRuns() for name in methods}
    memory = PeakMemory()
    names = list(methods)
    with tqdm(total=len(encoded) * repeats * len(names), desc="viasd bench", unit="run") as bar, (
        tracer.tracing() if tracer else nullcontext()
    ), load or nullcontext():
        for index, ids in enumerate(encoded):
            for name in names:
                runs[name].seconds.append([])
            for repeat in range(repeats):
                shift = (index * repeats + repeat) % len(names)
                for name in names[shift:] + names[:shift]:
                    torch.manual_seed(1000 * index + repeat)
                    if tracer:
                        tracer.start()
                    with memory.measure() as peak:
                        outcome = methods[name](ids, common)
                    if tracer:
                        tracer.record(name, index, repeat, outcome.seconds, len(outcome.tokens))
                    runs[name].peak_memory_bytes = max(runs[name].peak_memory_bytes, peak["peak_bytes"])
                    runs[name].seconds[index].append(outcome.seconds)
                    if repeat == 0:
                        runs[name].outcomes.append(outcome)
                    bar.set_postfix_str(f"{examples[index].task} · {name}")
                    bar.update()
    return runs


def agreement(ours: list[list[int]], greedy: list[list[int]]) -> float:
    """Fraction of greedy's generated tokens that the method reproduced at the same position."""
    same = sum(sum(a == b for a, b in zip(mine, theirs)) for mine, theirs in zip(ours, greedy))
    total = sum(len(theirs) for theirs in greedy)
    return same / total if total else 1.0


@torch.no_grad()
def full_model_choices(model: Any, prompt: torch.Tensor, tokens: list[int]) -> int:
    """How many of ``tokens`` (generated after ``prompt``, shape (1, P)) are the full model's greedy choice there."""
    if not tokens:
        return 0
    generated = prompt.new_tensor([tokens])
    sequence = torch.cat([prompt, generated[:, :-1]], dim=-1).to(model.device)
    logits = model(sequence, logits_to_keep=len(tokens)).logits[0]
    return int((logits.argmax(-1).cpu() == generated[0].cpu()).sum())


def full_model_agreement(model: Any, prompts: list[torch.Tensor], outputs: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """Per method, per prompt: how many generated tokens the full model would have chosen (one pass per distinct output)."""
    if model.config.is_encoder_decoder:
        raise ValueError("full-model agreement is measured for decoder-only targets only")
    judged: dict[tuple[int, tuple[int, ...]], int] = {}
    distinct = {(index, tuple(tokens)) for runs in outputs.values() for index, tokens in enumerate(runs)}
    for index, tokens in tqdm(sorted(distinct), desc="full-model agreement", unit="output"):
        judged[index, tokens] = full_model_choices(model, prompts[index], list(tokens))
    return {name: [judged[index, tuple(tokens)] for index, tokens in enumerate(runs)] for name, runs in outputs.items()}


def _work(outcomes: list[Outcome]) -> dict[str, Any]:
    """Acceptance and forwards, pooled over prompts (token-weighted, as the SD literature reports them)."""
    tokens = sum(len(o.tokens) for o in outcomes)
    forwards = sum(o.full_forwards for o in outcomes)
    drafted = [o.drafted for o in outcomes if o.drafted is not None]
    accepted = sum(o.accepted or 0 for o in outcomes)
    row: dict[str, Any] = {
        "new_tokens": tokens,
        "mean_accepted": tokens / forwards if forwards else None,
        "full_calls_per_token": forwards / tokens if tokens else None,
        "rejection_rate": 1 - accepted / sum(drafted) if drafted and sum(drafted) else None,
        "tier_fractions": {tier: sum(o.tier_tokens[tier] for o in outcomes) / tokens if tokens else 0.0 for tier in TIERS},
    }
    viasd = [o.viasd for o in outcomes if o.viasd is not None]
    if viasd:

        def total(key: str) -> int:
            return sum(stats[key] for stats in viasd)

        blocks = total("slim_on_blocks") + total("slim_off_blocks")
        slim_blocks = total("blocks") - total("catch_up_blocks")
        row |= {
            "slim_committed_fraction": total("slim_committed_tokens") / tokens if tokens else 0.0,
            "escalation_rate": total("escalated_blocks") / slim_blocks if total("slim_forwards") and slim_blocks else None,
            "slim_on_fraction": total("slim_on_blocks") / blocks if blocks else None,
            "slim_shadow_fraction": sum(stats.get("slim_shadow_blocks", 0) for stats in viasd) / blocks if blocks else None,
            "slim_forwards_per_token": total("slim_forwards") / tokens if tokens else None,
            "plain_fraction": total("plain_blocks") / total("blocks") if total("blocks") else None,
            "time_shares": _time_shares(viasd),
        }
    return row


def _task_work(outcomes: list[Outcome]) -> dict[str, Any]:
    """Per task: who produced the tokens and, for VIA-SD, how often the slim tier ran, escalated and agreed with the
    full model, and where its on/off choice stood at the end and why."""
    work = _work(outcomes)
    row = {key: work[key] for key in ("tier_fractions", "slim_on_fraction", "escalation_rate") if key in work}
    viasd = [o.viasd for o in outcomes if o.viasd is not None]
    compared = sum(stats["slim_compared_rows"] for stats in viasd)
    if compared:
        row["slim_agreement"] = sum(stats["slim_agreed_rows"] for stats in viasd) / compared
    verdicts = [stats["slim_tier_verdict"] for stats in viasd if stats.get("slim_tier_verdict")]
    if verdicts:  # the controller's state carries over between prompts: the last one speaks for the task
        row["slim_tier_verdict"] = verdicts[-1]
    return row


def _time_shares(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Where a VIA-SD decode spends its time: drafter, slim and full passes, and the loop's own overhead."""
    seconds = {part: sum(row["seconds"][part] for row in stats) for part in ("drafter", "slim", "full", "total")}
    total = seconds.pop("total")
    if not total:
        return {}
    shares = {part: value / total for part, value in seconds.items()}
    return shares | {"overhead": 1.0 - sum(shares.values())}


def _speed(runs: MethodRuns, greedy: MethodRuns, indexes: list[int]) -> dict[str, float | None]:
    """Medians over prompts; a prompt greedy answered with no token has no speed to compare with (None if all)."""
    ratios = [runs.tokens_per_s(i) / greedy.tokens_per_s(i) for i in indexes if greedy.tokens_per_s(i) > 0]
    return {
        "speedup_vs_greedy": statistics.median(ratios) if ratios else None,
        "tokens_per_s": statistics.median(runs.tokens_per_s(i) for i in indexes),
    }


def _full_model_agreement(runs: MethodRuns, agreed: list[int] | None, indexes: list[int]) -> dict[str, float]:
    """Share of the generated tokens that were the full model's own choice, where it was measured."""
    tokens = sum(len(runs.outcomes[i].tokens) for i in indexes)
    if agreed is None or not tokens:
        return {}
    return {"full_model_agreement": sum(agreed[i] for i in indexes) / tokens}


def _quality(examples: list[Example], runs: MethodRuns, greedy: MethodRuns, indexes: list[int], decode: Any,
             agreed: list[int] | None = None) -> dict:
    scores = quality([examples[i] for i in indexes], [decode(runs.outcomes[i].tokens) for i in indexes])
    ours = [runs.outcomes[i].tokens for i in indexes]
    theirs = [greedy.outcomes[i].tokens for i in indexes]
    return {"greedy_agreement": agreement(ours, theirs)} | _full_model_agreement(runs, agreed, indexes) | scores


def summarise(
    runs: dict[str, MethodRuns], examples: list[Example], decode: Any, weight_bytes: dict[str, int],
    full_agreement: dict[str, list[int]] | None = None,
) -> dict[str, dict[str, Any]]:
    """The JSON contract: per method speed, work, quality (macro-averaged over tasks) and per-task breakdowns.

    ``full_agreement[name][i]``: how many of the method's tokens on prompt ``i`` were the full model's own
    greedy choice (:func:`full_model_agreement`); pooled over tokens, not averaged over tasks.

    ``weight_bytes[name]`` is the bytes of weights the method keeps (target, plus the drafter if it
    uses one); its peak memory is that plus the most it allocated on top while decoding. Effective bandwidth is gpt-fast's figure: tokens/s × bytes of the target's weights.
    """
    greedy = runs["greedy"]
    everything = list(range(len(examples)))
    by_task: dict[str, list[int]] = defaultdict(list)
    for index, example in enumerate(examples):
        by_task[example.task].append(index)
    target_bytes = weight_bytes["greedy"]
    summary = {}
    for name, method_runs in runs.items():
        agreed = (full_agreement or {}).get(name)
        per_task = {
            task: _speed(method_runs, greedy, indexes)
            | {"quality": _quality(examples, method_runs, greedy, indexes, decode, agreed)}
            | _task_work([method_runs.outcomes[i] for i in indexes])
            for task, indexes in by_task.items()
        }
        row = _speed(method_runs, greedy, everything) | _work(method_runs.outcomes)
        metrics: dict[str, list[float]] = defaultdict(list)
        for task_row in per_task.values():
            for metric, value in task_row["quality"].items():
                if metric not in ("greedy_agreement", "full_model_agreement"):
                    metrics[metric].append(value)
        row["quality"] = {"greedy_agreement": agreement([o.tokens for o in method_runs.outcomes],
                                                        [o.tokens for o in greedy.outcomes])}
        row["quality"] |= _full_model_agreement(method_runs, agreed, everything)
        row["quality"] |= {metric: statistics.mean(values) for metric, values in metrics.items()}
        row["peak_memory_mib"] = (weight_bytes[name] + method_runs.peak_memory_bytes) / 2**20
        row["weights_mib"] = weight_bytes[name] / 2**20
        row["transient_memory_mib"] = method_runs.peak_memory_bytes / 2**20
        row["effective_bandwidth_gb_s"] = row["tokens_per_s"] * target_bytes / 1e9
        row["per_task"] = per_task
        summary[name] = row
    return summary


def machine_bandwidth_gb_s(megabytes: int = 256, repeats: int = 5) -> float:
    """Copy bandwidth of this machine's memory (reads + writes), best of ``repeats``: the ceiling for decoding."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() * 4 / best / 1e9

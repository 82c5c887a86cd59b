"""``viasd demo``: is VIA-SD faster than what you have? Greedy, HF assisted generation and VIA-SD, side by side.

Every method decodes the same few short prompts of different kinds with the same target, each
warmed up first, the methods taking turns on each prompt so that a change of machine load falls on
all of them alike. The prompts run in rounds (every method on one prompt) until a time budget is
spent, two rounds at least, so that a first run on a slow machine still ends within minutes. HF
assisted generation runs twice: with the drafter as loaded (what a user has) and with the drafter in
the form VIA-SD picks for this machine, so the comparison is fair both ways.
VIA-SD runs with the default ``ViaSDConfig()`` (lossless: its output must be greedy's own). Where the target
runs in bf16 that the CPU emulates (no AVX512-BF16 or AMX), VIA-SD also runs with the target in float32, which
verifies drafts natively: on such a CPU that may be VIA-SD's fastest exact configuration, and the table says
whether it beats bf16 greedy.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from viasd_hf.bench.report import environment
from viasd_hf.config import ViaSDConfig
from viasd_hf.control.fallback_advice import fallback_advice
from viasd_hf.drafters.precision import fastest_form
from viasd_hf.generation import enable_viasd
from viasd_hf.models.loading import load_pretrained
from viasd_hf.models.machine import emulated_bf16
from viasd_hf.models.quantization import resolve_dtype
from viasd_hf.models.quantization.choice import resolve_drafting_form
from viasd_hf.models.quantization.schemes import UNQUANTIZED

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
SMALL_TARGET = "smollm2-135m-instruct"
PROMPT_LOOKUP_TOKENS = 5
DTYPES = ("auto", "float32", "bfloat16")
MAX_NEW_TOKENS = 40
BUDGET_SECONDS = 150.0  # for the timed rounds; a round that would end past it is not started
MIN_ROUNDS = 2  # prompts of two kinds at least, whatever the budget
WARM_UP_PROMPT_TOKENS, WARM_UP_NEW_TOKENS = 16, 12  # every method's code runs, VIA-SD probes speculation once
FLOAT32_ROW = "VIA-SD (float32 target)"  # where bf16 is emulated: VIA-SD's best exact configuration may be float32

PROMPTS = {  # short prompts of different kinds, in the order they run: speculation pays differently on each
    "code": "Write a Python function that checks whether a string is a palindrome.",
    "explain": "Explain in three sentences what a hash table is.",
    "edit": "Fix the bug in this function and return the corrected code:\n\ndef mean(xs):\n    return sum(xs) / len(xs) + 1",
    "rewrite": "Rewrite in plain words: The committee has resolved to defer its decision pending further consultation.",
}


@dataclass
class Row:
    """One method's run over every prompt."""

    method: str
    tokens: int = 0
    seconds: float = 0.0
    identical: bool = True  # every prompt's output token-identical to greedy's
    first_difference: dict[str, int] = field(default_factory=dict)  # prompt -> first new token that differs
    outputs: dict[str, list[int]] = field(default_factory=dict)
    stats: dict[str, object] = field(default_factory=dict)  # VIA-SD's ``viasd_stats`` per prompt

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class DemoReport:
    target: str
    drafter: str
    precision: dict[str, str]  # role -> the form it ran in and why
    rows: list[Row]
    max_new_tokens: int
    threads: int
    prompts: list[str]  # the kinds timed: the first ones of PROMPTS, as many as the budget allowed
    budget: float | None = None
    why_plain: str | None = None  # where VIA-SD decoded mostly plainly: why, from the target's measured pass costs
    environment: dict = field(default_factory=environment)  # versions, commit, CPU: the machine the table is of

    def ratio(self, method: str, baseline: str) -> float:
        rates = {row.method: row.tokens_per_second for row in self.rows}
        return rates[method] / rates[baseline] if rates.get(baseline) else float("nan")

    def baselines(self) -> list[str]:
        return [row.method for row in self.rows if not row.method.startswith("VIA-SD")]

    def ours(self) -> list[str]:
        return [row.method for row in self.rows if row.method.startswith("VIA-SD")]

    def table(self) -> str:
        baselines = self.baselines()
        header = f"{'method':<34} {'tokens/s':>9} " + " ".join(f"{'vs ' + b:>{max(9, len(b) + 3)}}" for b in baselines)
        lines = [header + "  identical to greedy", "-" * (len(header) + 21)]
        for row in self.rows:
            ratios = " ".join(f"{self.ratio(row.method, b):>{max(9, len(b) + 3)}.2f}" for b in baselines)
            lines.append(f"{row.method:<34} {row.tokens_per_second:>9.2f} {ratios}  {identity(row)}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        methods = {}
        for row in self.rows:
            methods[row.method] = {
                "tokens": row.tokens, "seconds": row.seconds, "tokens_per_second": row.tokens_per_second,
                "identical_to_greedy": row.identical, "first_difference": row.first_difference,
                "ratio": {baseline: self.ratio(row.method, baseline) for baseline in self.baselines()},
            }  # fmt: skip
        return {"target": self.target, "drafter": self.drafter, "precision": self.precision,
                "max_new_tokens": self.max_new_tokens, "threads": self.threads, "prompts": self.prompts,
                "budget_seconds": self.budget,
                "methods": methods, "why_plain": self.why_plain, "environment": self.environment}  # fmt: skip


def identity(row: Row) -> str:
    if row.identical:
        return "yes"
    return "no: " + ", ".join(f"{kind} from token {position}" for kind, position in row.first_difference.items())


def check_arguments(max_new_tokens: int, dtype: str | None, json_path: str | None, budget: float | None) -> None:
    """Refuse bad arguments before anything loads, rather than after minutes of decoding."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if budget is not None and not budget > 0:
        raise ValueError(f"budget must be a positive number of seconds (or None: every prompt), got {budget}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if json_path is not None and not Path(json_path).resolve().parent.is_dir():
        raise ValueError(f"cannot write {json_path}: its folder does not exist")


def encode(tokenizer, prompt: str) -> torch.Tensor:
    messages = [{"role": "user", "content": prompt}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]  # fmt: skip


def timed(generate, ids: torch.Tensor, clock=time.perf_counter) -> tuple[object, float]:
    started = clock()
    with torch.no_grad():
        output = generate(ids)
    return output, clock() - started


def run_methods(methods: dict[str, object], prompts: dict[str, torch.Tensor], max_new_tokens: int,
                budget: float | None = None, clock=time.perf_counter) -> list[Row]:  # fmt: skip
    """Warm every method up, then time each on the prompts, the methods taking turns prompt by prompt (a round).
    With a ``budget`` (seconds), a round that would end past it, judged by the mean round so far, is not started
    once ``MIN_ROUNDS`` have run; the rows then cover the first prompts only."""
    warm_up = next(iter(prompts.values()))[:, :WARM_UP_PROMPT_TOKENS]
    for generate in tqdm(methods.values(), desc="warm-up", leave=False):
        timed(lambda ids: generate(ids, min(WARM_UP_NEW_TOKENS, max_new_tokens)), warm_up)
    rows = {name: Row(name) for name in methods}
    spent, rounds = 0.0, 0
    with tqdm(total=len(prompts) * len(methods), desc="timing") as progress:
        for kind, ids in prompts.items():
            if budget is not None and rounds >= MIN_ROUNDS and spent * (rounds + 1) / rounds > budget:
                break
            rounds += 1
            for name, generate in methods.items():
                progress.set_postfix_str(f"{kind}: {name}")
                output, seconds = timed(lambda ids: generate(ids, max_new_tokens), ids, clock)
                spent += seconds
                tokens = output.sequences[0, ids.shape[1] :].tolist()
                rows[name].tokens += len(tokens)
                rows[name].seconds += seconds
                rows[name].outputs[kind] = tokens
                if getattr(output, "viasd_stats", None) is not None:
                    rows[name].stats[kind] = output.viasd_stats
                progress.update()
    greedy = rows["greedy"].outputs
    for row in rows.values():
        for kind in greedy:
            position = first_difference(row.outputs[kind], greedy[kind])
            if position is not None:
                row.first_difference[kind] = position
        row.identical = not row.first_difference
    return list(rows.values())


def first_difference(tokens: list[int], reference: list[int]) -> int | None:
    if tokens == reference:
        return None
    return next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))


def demo_methods(target: nn.Module, drafting: dict[str, dict], config: ViaSDConfig) -> dict[str, object]:
    """``name -> generate(ids, max_new_tokens)``: greedy, each HF assisted form in ``drafting``, and VIA-SD with the
    first of them (as the user loaded it: VIA-SD picks the drafter's form itself)."""
    common = {"do_sample": False, "pad_token_id": pad_token(target), "return_dict_in_generate": True}

    def method(**extra):
        return lambda ids, tokens: target.generate(ids, max_new_tokens=tokens, **common, **extra)

    methods = {"greedy": method()}
    methods.update({name: method(**kwargs) for name, kwargs in drafting.items()})
    methods["VIA-SD"] = method(viasd_config=config, **next(iter(drafting.values())))
    return methods


def pad_token(model: nn.Module) -> int | None:
    """The model's pad token, else its (first) end token, so ``generate`` has nothing to warn about."""
    config = model.generation_config
    if config.pad_token_id is not None:
        return config.pad_token_id
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, list) else eos


def run_demo(
    small: bool = False,
    target_name: str | None = None,
    drafter_name: str | None = None,
    max_new_tokens: int = MAX_NEW_TOKENS,
    dtype: str | None = None,
    json_path: str | None = None,
    budget: float | None = BUDGET_SECONDS,
) -> DemoReport:
    check_arguments(max_new_tokens, dtype, json_path, budget)
    target_name = target_name or (SMALL_TARGET if small else DEFAULT_TARGET)
    drafter_name = drafter_name or (None if small else DEFAULT_DRAFTER)
    dtype = dtype or "auto"
    print(f"loading {target_name} (dtype {dtype}) ...", flush=True)
    target, tokenizer = load_pretrained(target_name, dtype=dtype)
    enable_viasd(target)
    measured = resolve_dtype(target_name) if dtype == "auto" else None  # load_pretrained measured it: now cached
    why = measured.reason if measured else "as asked with --dtype"
    precision = {"target": f"{dtype_name(target)}: {why}"}
    if drafter_name:
        print(f"loading drafter {drafter_name} ({dtype_name(target)}, as the target) ...", flush=True)
        drafter = load_pretrained(drafter_name, dtype=target.dtype)[0]
        print("finding the drafter's fastest form on this machine ...", flush=True)
        fast = fastest_form(drafter, now=True)  # made before the timed calls: the demo compares steady states
        chosen = resolve_drafting_form(drafter)
        precision["drafter"] = f"loaded in {dtype_name(drafter)}, VIA-SD drafts in {chosen.scheme.name}: {chosen.reason}"
        drafting = {"HF assisted (drafter as loaded)": {"assistant_model": drafter}}
        if fast is not drafter:
            drafting["HF assisted (VIA-SD's drafter form)"] = {"assistant_model": fast}
    else:
        drafting = {"HF prompt lookup": {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}}
    methods = demo_methods(target, drafting, ViaSDConfig())
    if dtype == "auto" and emulated_bf16(target):
        print(f"loading {target_name} in float32 as well: this CPU emulates bf16 ...", flush=True)
        float32_target = enable_viasd(load_pretrained(target_name, dtype=torch.float32)[0])
        methods[FLOAT32_ROW] = demo_methods(float32_target, drafting, ViaSDConfig())["VIA-SD"]
        precision[FLOAT32_ROW] = ("float32: this CPU has no native bf16, so a bf16 pass over the k tokens of a draft "
                                  "costs about k one-token passes; a float32 target verifies them natively, though its "
                                  "one-token passes are slower")  # fmt: skip
    prompts = {kind: encode(tokenizer, text) for kind, text in PROMPTS.items()}
    rows = run_methods(methods, prompts, max_new_tokens, budget)
    report = DemoReport(target_name, drafter_name or "prompt lookup", precision, rows, max_new_tokens,
                        torch.get_num_threads(), list(rows[0].outputs), budget,
                        why_plain(target, rows, measured.measurements if measured else ()))  # fmt: skip
    print_report(report, tokenizer)
    if json_path:
        Path(json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
        print(f"[json] {json_path}")
    return report


def why_plain(target: nn.Module, rows: list[Row], measurements) -> str | None:
    """Where VIA-SD decoded most of its blocks plainly, why: the fallback advice with the target's measured cost of a
    6-token pass against a one-token pass, in its dtype and in the other unquantised ones measured here."""
    stats = list(next(row for row in rows if row.method == "VIA-SD").stats.values())
    blocks, plain = sum(s.blocks for s in stats), sum(s.plain_blocks for s in stats)
    if not blocks or plain < blocks / 2:
        return None
    timed = [m for m in measurements if m.scheme in UNQUANTIZED and m.decode_ms and m.verify_ms]
    ours = next((m for m in timed if UNQUANTIZED[m.scheme].dtype == target.dtype), None)
    reason = fallback_advice(ours.verify_ms / ours.decode_ms if ours else None, emulated_bf16(target))
    others = [f"in {m.scheme} a one-token pass takes {m.decode_ms:.0f} ms ({m.decode_ratio:.2f}x bf16's) and a 6-token "
              f"pass {m.verify_ms / m.decode_ms:.1f}x that" for m in timed if m is not ours]
    return f"VIA-SD decoded {plain} of its {blocks} blocks plainly: {reason}" + "".join(f"; {o}" for o in others)


def dtype_name(model: nn.Module) -> str:
    return str(model.dtype).removeprefix("torch.")


def print_report(report: DemoReport, tokenizer) -> None:
    viasd = next(row for row in report.rows if row.method == "VIA-SD")
    print(f"\n[{next(iter(PROMPTS))}] {tokenizer.decode(viasd.outputs[next(iter(PROMPTS))], skip_special_tokens=True)}\n")
    for role, form in report.precision.items():
        print(f"[precision] {role}: {form}")
    cut = "" if len(report.prompts) == len(PROMPTS) else (
        f" of {len(PROMPTS)} (the rest would not have fitted the timing budget of {report.budget:.0f} s: --budget)")
    print(f"[setup] {len(report.prompts)} prompts{cut} ({', '.join(report.prompts)}) x {report.max_new_tokens} new "
          f"tokens, greedy, {report.threads} threads on {report.environment['cpu']}; every method warmed up, "
          "methods taking turns per prompt\n")  # fmt: skip
    print(report.table())
    differ = [row.method for row in report.rows if not row.identical]
    if set(differ) - {FLOAT32_ROW} and report.precision["target"].startswith("bfloat16"):
        print("(in bf16 a pass over several tokens rounds differently from a one-token pass: where greedy's two best "
              "tokens lie within a rounding step, an exact method may take the other one, and the text runs on from "
              "there; in float32 lossless VIA-SD is token-identical to greedy)")  # fmt: skip
    if FLOAT32_ROW in differ:
        print("(the float32 target is the same model in another precision: where float32 and bf16 round a near-tie "
              "differently, its output, its own greedy one, differs from bf16 greedy's)")  # fmt: skip
    for row in report.rows:
        for kind, stats in row.stats.items():
            print(f"[{row.method}, {kind}] {stats.summary()}; {stats.speculation_verdict or ''}")
    rate = {row.method: row.tokens_per_second for row in report.rows}
    best, ours = max(report.baselines(), key=rate.get), max(report.ours(), key=rate.get)
    verdict = "faster" if report.ratio(ours, best) > 1 else "not faster"
    versus_greedy = "" if best == "greedy" else f", {report.ratio(ours, 'greedy'):.2f}x greedy"
    print(f"\n[verdict] {ours} is {verdict} than the best alternative here ({best}): "
          f"{report.ratio(ours, best):.2f}x{versus_greedy}")  # fmt: skip
    if report.why_plain:
        print(f"[why] {report.why_plain}")

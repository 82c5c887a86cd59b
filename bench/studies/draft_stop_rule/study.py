"""Replay draft-length stop rules on recorded traces: every rule on the same tokens, with the same pass costs.

``collect`` records, for each prompt, the target's greedy continuation and, for each drafter format, the
drafter teacher-forced on it: at every position, whether its argmax is the target's token and how sure it
was. It also times a drafter pass and target passes over 1 and 33 tokens on this machine.

``replay`` walks each trace block by block: a block at position ``i`` drafts ``k`` tokens (the rule
sees their confidences one by one), keeps the leading matches ``m ≤ k``, commits ``m + 1`` tokens and
costs ``k·d + a + b·(k + 1)``. Confidences after the first mismatch are the teacher-forced ones, an
approximation every rule shares. Throughput is tokens per one-token target pass.

    python bench/studies/draft_stop_rule/study.py collect traces.json
    python bench/studies/draft_stop_rule/study.py replay traces.json [--tokens 24]
    python bench/studies/draft_stop_rule/study.py rows    # the verify pass's seconds by tokens fed
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import dataclass

import torch

from viasd_hf.control.draft_planner import DraftPlanner, FadedMean

TARGET, DRAFTER = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DATASETS = (("humaneval", 12), ("spec_bench", 2), ("xsum", 4))
FORMATS = {"bf16": {"dtype": "bfloat16"}, "bnb-4bit": {"quantization": "bnb-4bit"}}


def collect(path: str) -> None:
    from viasd_hf.bench.runner import encode
    from viasd_hf.data.tasks import load_examples
    from viasd_hf.models.loading import load_pretrained

    torch.set_num_threads(1)
    target, tokenizer = load_pretrained(TARGET, dtype="bfloat16")
    drafters = {name: load_pretrained(DRAFTER, **kwargs)[0] for name, kwargs in FORMATS.items()}
    traces = []
    with torch.no_grad():
        for dataset, limit in DATASETS:
            for example in load_examples(dataset, limit):
                ids = encode(tokenizer, example.prompt)
                full = target.generate(ids, max_new_tokens=128, do_sample=False)
                new = full[0, ids.shape[1]:]
                trace = {"dataset": dataset, "task": example.task, "drafters": {}}
                for name, drafter in drafters.items():
                    confidence, argmax = drafter(full).logits[0, ids.shape[1] - 1 : -1].float().softmax(-1).max(-1)
                    trace["drafters"][name] = {"match": (argmax == new).tolist(), "confidence": confidence.tolist()}
                traces.append(trace)
        context = torch.randint(100, 20000, (1, 300))
        costs = {"target_1": _pass_seconds(target, context, 1), "target_33": _pass_seconds(target, context, 33)}
        costs |= {f"drafter_{name}": _pass_seconds(drafter, context, 1) for name, drafter in drafters.items()}
    with open(path, "w") as file:
        json.dump({"costs": costs, "traces": traces}, file)


def _pass_seconds(model: torch.nn.Module, ids: torch.Tensor, tokens: int, repeats: int = 7) -> float:
    """Median seconds of a pass over ``tokens`` tokens after the rest of ``ids`` is cached."""
    cache = model(ids[:, :-tokens], use_cache=True).past_key_values
    seconds = []
    for _ in range(repeats):
        fresh = copy.deepcopy(cache)
        started = time.perf_counter()
        model(ids[:, -tokens:], past_key_values=fresh, use_cache=True)
        seconds.append(time.perf_counter() - started)
    return sorted(seconds)[repeats // 2]


def rows() -> None:
    """Median seconds of a bf16 target pass over 1–32 tokens after 400 cached ones: is ``a + b·tokens`` linear?"""
    from viasd_hf.models.loading import load_pretrained

    torch.set_num_threads(1)
    target, _ = load_pretrained(TARGET, dtype="bfloat16")
    with torch.no_grad():
        for tokens in (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32):
            context = torch.randint(100, 20000, (1, 400 + tokens), generator=torch.Generator().manual_seed(0))
            print(f"{tokens:2d} tokens: {_pass_seconds(target, context, tokens, repeats=5) * 1000:.1f} ms")


@dataclass
class Costs:
    """In one-token target passes: a drafter pass ``d``; a verifying pass ``a + b·tokens``."""

    d: float
    a: float
    b: float

    def drafter_pass(self) -> float:
        return self.d

    def verify_base(self) -> float:
        return self.a

    def verify_per_token(self) -> float:
        return self.b


class Shipped:
    """``viasd_hf.control.draft_planner.DraftPlanner`` as it is: the next draft foretold by the last one's confidence."""

    def __init__(self, costs: Costs, longest: int = 32) -> None:
        self.planner = DraftPlanner(costs, longest=longest)

    def keep(self, confidences: list[float]) -> bool:
        return self.planner.keep_drafting_rows([confidences], [True])

    def observe(self, confidences: list[float], drafted: int, kept: int) -> None:
        if drafted:
            self.planner.acceptance.observe(confidences, drafted, kept)

    def _worth_it(self, confidences: list[float], next_kept: float) -> bool:
        """The shipped stop rule with another estimate of the next draft's acceptance."""
        acceptance, costs, drafted = self.planner.acceptance, self.planner.costs, len(confidences)
        all_kept, expected = 1.0, 1.0
        for confidence in confidences:
            all_kept *= acceptance.kept(confidence)
            expected += all_kept
        block = drafted * costs.d + costs.a + costs.b * (drafted + 1)
        return all_kept * next_kept * block > expected * (costs.d + costs.b)


class PositionMean(Shipped):
    """The rule before: the next draft foretold by the mean acceptance measured at its position."""

    def __init__(self, costs: Costs, longest: int = 32) -> None:
        super().__init__(costs, longest)
        self.by_position: list[FadedMean] = []
        self.overall = FadedMean()

    def keep(self, confidences: list[float]) -> bool:
        drafted = len(confidences)
        if drafted in (0, self.planner.longest):
            return drafted == 0
        prior = self.planner.acceptance.prior_weight
        overall = self.overall.mean(0.5, prior)
        at = self.by_position[drafted].mean(overall, prior) if drafted < len(self.by_position) else overall
        return self._worth_it(confidences, at)

    def observe(self, confidences: list[float], drafted: int, kept: int) -> None:
        super().observe(confidences, drafted, kept)
        for position in range(min(drafted, kept + 1)):
            while len(self.by_position) <= position:
                self.by_position.append(FadedMean())
            outcome = float(position < kept)
            self.by_position[position].observe(outcome, self.planner.acceptance.decay)
            self.overall.observe(outcome, self.planner.acceptance.decay)


class FollowsConfidence(Shipped):
    """The next draft's acceptance learned per bin of the last draft's confidence (a Markov chain of bins)."""

    def __init__(self, costs: Costs, longest: int = 32) -> None:
        super().__init__(costs, longest)
        self.after = [FadedMean() for _ in range(len(self.planner.acceptance.edges) + 1)]

    def keep(self, confidences: list[float]) -> bool:
        drafted = len(confidences)
        if drafted in (0, self.planner.longest):
            return drafted == 0
        acceptance = self.planner.acceptance
        last = confidences[-1]
        return self._worth_it(confidences, self.after[acceptance._bin(last)].mean(acceptance.kept(last), acceptance.prior_weight))

    def observe(self, confidences: list[float], drafted: int, kept: int) -> None:
        super().observe(confidences, drafted, kept)
        for position in range(1, min(drafted, kept + 1)):
            bin_ = self.planner.acceptance._bin(confidences[position - 1])
            self.after[bin_].observe(float(position < kept), self.planner.acceptance.decay)


class HFConfidence:
    """HF assisted generation's defaults: up to 20 drafts, ending after one the drafter gives below 0.4."""

    def __init__(self, costs: Costs, longest: int = 20, threshold: float = 0.4) -> None:
        self.longest, self.threshold = longest, threshold

    def keep(self, confidences: list[float]) -> bool:
        return len(confidences) < self.longest and (not confidences or confidences[-1] >= self.threshold)

    def observe(self, confidences: list[float], drafted: int, kept: int) -> None:
        pass


RULES = {"shipped (last confidence)": Shipped, "before (position mean)": PositionMean,
         "markov (learned per last bin)": FollowsConfidence, "hf (0.4, 20)": HFConfidence}


def leading_matches(match: list[bool], start: int, most: int) -> int:
    count = 0
    while count < most and start + count < len(match) and match[start + count]:
        count += 1
    return count


def replay_trace(match: list[bool], confidence: list[float], costs: Costs, rule_type=None, fixed: int | None = None,
                 oracle: bool = False) -> tuple[int, float, int]:
    """Tokens committed, cost and blocks of one trace under the rule ``rule_type(costs)`` makes (a new one: a generate
    call that plans afresh), a fixed draft length, or the oracle (drafts exactly the tokens the target will keep)."""
    rule = rule_type(costs) if rule_type is not None else None
    position, tokens, cost, blocks = 0, 0, 0.0, 0
    while position < len(match):
        room = len(match) - 1 - position
        if oracle:
            drafted = leading_matches(match, position, min(32, room))
        elif fixed is not None:
            drafted = min(fixed, room)
        else:
            drafted = 0
            while drafted < room and rule.keep(confidence[position : position + drafted]):
                drafted += 1
        kept = leading_matches(match, position, drafted)
        if rule is not None:
            rule.observe(confidence[position : position + drafted], drafted, kept)
        committed = min(kept + 1, len(match) - position)
        tokens, cost, blocks = tokens + committed, cost + drafted * costs.d + costs.a + costs.b * (drafted + 1), blocks + 1
        position += committed
    return tokens, cost, blocks


def replay(path: str, tokens: int | None = None) -> None:
    """Every rule on every trace, or on each trace's first ``tokens`` tokens (a short generation)."""
    with open(path) as file:
        data = json.load(file)
    measured = data["costs"]
    per_token = (measured["target_33"] - measured["target_1"]) / 32
    for scheme in FORMATS:
        costs = Costs(d=measured[f"drafter_{scheme}"] / measured["target_1"],
                      a=(measured["target_1"] - per_token) / measured["target_1"], b=per_token / measured["target_1"])
        print(f"\n{scheme} drafter: d = {costs.d:.3f}, a = {costs.a:.3f}, b = {costs.b:.4f} (one-token target pass = 1)")
        print("| dataset | " + " | ".join(RULES) + " | shipped, remembered across prompts | best fixed length | oracle |")
        print("|---" * (len(RULES) + 4) + "|")
        for dataset, _ in DATASETS:
            traces = [trace["drafters"][scheme] for trace in data["traces"] if trace["dataset"] == dataset]

            def total(**how) -> tuple[float, float]:
                runs = [replay_trace(t["match"][:tokens], t["confidence"][:tokens], costs, **how) for t in traces]
                return sum(r[0] for r in runs) / sum(r[1] for r in runs), sum(r[0] for r in runs) / sum(r[2] for r in runs)

            cells = []
            for rule_type in RULES.values():
                throughput, per_block = total(rule_type=rule_type)
                cells.append(f"{throughput:.3f} ({per_block:.1f}/block)")
            shared = Shipped(costs)  # one planner for every prompt, as tier_memory keeps it between calls
            throughput, per_block = total(rule_type=lambda _: shared)
            cells.append(f"{throughput:.3f} ({per_block:.1f}/block)")
            fixed = {length: total(fixed=length)[0] for length in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)}
            best = max(fixed, key=fixed.get)
            cells += [f"{fixed[best]:.3f} (k = {best})", f"{total(oracle=True)[0]:.3f}"]
            print(f"| {dataset} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["collect", "replay", "rows"])
    parser.add_argument("traces", nargs="?", default="traces.json")
    parser.add_argument("--tokens", type=int, help="replay: only each trace's first TOKENS tokens")
    arguments = parser.parse_args()
    {"collect": lambda: collect(arguments.traces), "replay": lambda: replay(arguments.traces, arguments.tokens),
     "rows": rows}[arguments.action]()

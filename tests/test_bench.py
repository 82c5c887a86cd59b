"""``viasd bench``: the methods, the counts they report, the summary's arithmetic and the CLI contract."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask
from viasd_hf.bench.methods import METHODS, MethodName, MethodTable, Outcome
from viasd_hf.bench.report import environment, source_revision, time_markdown
from viasd_hf.bench.runner import MethodRuns, agreement, run_methods, summarise
from viasd_hf.bench.traces import CallTracer, read_traces
from viasd_hf.cli import main
from viasd_hf.data.tasks import Example
from viasd_hf.engine.stats import ViaSDStats

REPO = Path(__file__).resolve().parents[1]
CONTRACT = ("speedup_vs_greedy", "tokens_per_s", "mean_accepted", "rejection_rate", "full_calls_per_token")


class DigitTokenizer:
    """Enough of a tokenizer for the runner: one token per character code, no chat template."""

    chat_template = None
    pad_token_id = None
    eos_token_id = 0

    def __call__(self, text: str, return_tensors: str = "pt") -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([[1 + ord(c) % 90 for c in text]])}

    def decode(self, tokens: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(str(t) for t in tokens)


@pytest.fixture(scope="module")
def table():
    target = tiny_causal_lm("llama", seed=0)
    drafter = tiny_causal_lm("llama", seed=0)  # the same weights: every draft is right
    mask = RoutingMask.from_model(target, skip=[2])
    return MethodTable(target, drafter, mask, RoutingMask.from_model(target, skip=[1, 2, 3]))


pytestmark = pytest.mark.usefixtures("single_thread")


def outcome(tokens: list[int], seconds: float, forwards: int, drafted=None, accepted=None, slim=0) -> Outcome:
    kept = accepted or 0
    return Outcome(tokens, seconds, forwards, drafted, accepted, {"drafter": kept, "slim": slim, "full": len(tokens) - kept - slim})


def test_summary_arithmetic_is_exact():
    examples = [Example("qa", "q1", ["paris"]), Example("qa", "q2", ["rome"]), Example("custom", "x")]
    greedy = MethodRuns([outcome([1, 2, 3, 4], 4.0, 4), outcome([5, 6], 1.0, 2), outcome([7, 8], 2.0, 2)],
                        [[4.0], [1.0], [2.0, 4.0]])
    fast = MethodRuns([outcome([1, 2, 3, 4], 1.0, 2, drafted=4, accepted=2),
                       outcome([5, 9], 0.5, 1, drafted=2, accepted=1, slim=1),
                       outcome([7, 8], 1.0, 1, drafted=2, accepted=1)],
                      [[1.0, 3.0], [0.5], [1.0]])
    decode = {(1, 2, 3, 4): "paris", (5, 6): "rome", (5, 9): "milan", (7, 8): "x"}
    summary = summarise({"greedy": greedy, "fast": fast}, examples, lambda t: decode[tuple(t)],
                        {"greedy": 2**20, "fast": 3 * 2**20})
    row = summary["fast"]
    # per-prompt tokens/s: greedy 1, 2, 2/3 (median of 2 s and 4 s); fast 2 (median of 1 s and 3 s), 4, 2
    assert row["speedup_vs_greedy"] == pytest.approx(2.0)  # median of the ratios 2, 2, 3
    assert row["tokens_per_s"] == pytest.approx(2.0)
    assert row["mean_accepted"] == pytest.approx(8 / 4)
    assert row["full_calls_per_token"] == pytest.approx(4 / 8)
    assert row["rejection_rate"] == pytest.approx(1 - 4 / 8)
    assert row["tier_fractions"] == pytest.approx({"drafter": 4 / 8, "slim": 1 / 8, "full": 3 / 8})
    assert row["quality"]["greedy_agreement"] == pytest.approx(7 / 8)
    assert row["quality"]["exact_match"] == pytest.approx(50.0)
    assert summary["greedy"]["quality"]["exact_match"] == pytest.approx(100.0)
    assert row["per_task"]["qa"]["speedup_vs_greedy"] == pytest.approx(2.0)
    assert row["per_task"]["custom"]["quality"] == {"greedy_agreement": 1.0}
    assert row["weights_mib"] == pytest.approx(3.0)
    assert summary["greedy"]["rejection_rate"] is None


def test_the_summary_says_how_many_of_our_blocks_decoded_plainly():
    def ours(blocks: int, plain: int) -> Outcome:
        seconds = {"drafter": 1.0, "slim": 0.0, "full": 3.0, "total": 4.0}
        stats = ViaSDStats(blocks=blocks, plain_blocks=plain, seconds=seconds)
        return Outcome([1, 2], 4.0, blocks, 2, 1, {"drafter": 1, "slim": 0, "full": 1}, viasd=stats.to_dict())

    examples = [Example("qa", "q1"), Example("qa", "q2")]
    greedy = MethodRuns([outcome([1, 2], 2.0, 2), outcome([1, 2], 2.0, 2)], [[2.0], [2.0]])
    viasd = MethodRuns([ours(4, 1), ours(6, 0)], [[1.0], [1.0]])
    summary = summarise({"greedy": greedy, "viasd_lossless": viasd}, examples, str, {"greedy": 1, "viasd_lossless": 1})
    assert summary["viasd_lossless"]["plain_fraction"] == pytest.approx(1 / 10)  # blocks pooled over the prompts
    assert "plain_fraction" not in summary["greedy"]
    assert time_markdown(summary).splitlines()[-1].endswith("| 0.10 |")


def test_agreement_counts_positions_of_the_greedy_output():
    assert agreement([[1, 2, 3]], [[1, 2, 3]]) == 1.0
    assert agreement([[1, 9, 3, 4]], [[1, 2, 3]]) == pytest.approx(2 / 3)
    assert agreement([[1]], [[1, 2]]) == pytest.approx(1 / 2)


def test_method_table_refuses_what_it_cannot_compare(table):
    with pytest.raises(ValueError, match="unknown bench methods"):
        table.build(["greedy", "beam"])
    with pytest.raises(ValueError, match="first method must be 'greedy'"):
        table.build(["viasd", "greedy"])
    no_self = MethodTable(table.target, table.drafter, table.mask, None)
    with pytest.raises(ValueError, match="self-drafting mask"):
        no_self.build(["greedy", "self_spec"])


def test_every_method_runs_and_reports_what_it_did(table):
    mechanics = ["two_tier_reproducible", "two_tier_hybrid_reproducible", "viasd_reproducible"]  # every block speculates
    methods = table.build(list(METHODS) + mechanics)
    ids = torch.tensor([[3, 17, 5, 3, 17, 5, 3, 17]])
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    outcomes = {name: method(ids, common) for name, method in methods.items()}
    greedy = outcomes["greedy"]
    assert greedy.full_forwards == len(greedy.tokens) == 12
    assert greedy.drafted is None and greedy.tier_tokens == {"drafter": 0, "slim": 0, "full": 12}
    lossless = ("hf_assisted", "hf_prompt_lookup", "self_spec", "two_tier", "viasd_lossless", "cascade",
                "two_tier_hybrid", "viasd_lossless_hybrid")
    for name in lossless:
        assert outcomes[name].tokens == greedy.tokens, f"{name} must reproduce greedy here"
    hybrid = outcomes["two_tier_hybrid_reproducible"]
    assert hybrid.drafted > hybrid.viasd["drafter_forwards"], "the repeating prompt lets prompt lookup draft for free"
    two_tier = outcomes["two_tier"]
    assert two_tier.drafted == two_tier.viasd["drafter_forwards"], "a pass per model draft"
    for name, result in outcomes.items():
        assert sum(result.tier_tokens.values()) == len(result.tokens), name
        assert result.accepted is None or 0 <= result.accepted <= result.drafted, name
    assert outcomes["hf_assisted"].accepted == outcomes["hf_assisted"].drafted > 0  # an identical drafter is never wrong
    assert outcomes["hf_assisted"].full_forwards < 12
    assert outcomes["viasd_reproducible"].viasd["slim_forwards"] > 0


def test_method_names_read_as_base_hybrid_and_ablated_levers():
    assert MethodName.parse("viasd_lossless_hybrid_fullvocab_nocost") == MethodName(
        "viasd_lossless", hybrid=True, ablations=("_fullvocab", "_nocost"))
    assert MethodName.parse("two_tier_hybrid") == MethodName("two_tier", hybrid=True)
    assert MethodName.parse("hf_assisted_bf16") == MethodName("hf_assisted_bf16")
    for wrong in ("hf_assisted_fullvocab", "greedy_hybrid", "viasd_fullvocab_fullvocab", "viasd_hybrid_hybrid", "fast"):
        assert MethodName.parse(wrong) is None, wrong
    with pytest.raises(ValueError, match="_nocost"):
        MethodTable(None, None, None, None).build(["greedy", "hf_assisted_nocost"])


def test_a_float32_method_decodes_with_the_targets_float32_copy(table):
    """``viasd_lossless_fp32``: VIA-SD on the target's float32 copy (a bf16 target beside it), its passes counted on the
    copy; refused without one."""
    with pytest.raises(ValueError, match="need the target in float32"):
        table.build(["greedy", "viasd_lossless_fp32"])
    target = tiny_causal_lm("llama", seed=0, dtype=torch.bfloat16)
    float32 = tiny_causal_lm("llama", seed=0)
    passes = {"bf16": 0, "fp32": 0}
    for name, model in (("bf16", target), ("fp32", float32)):
        model.register_forward_pre_hook(lambda *_, name=name: passes.__setitem__(name, passes[name] + 1))
    methods = MethodTable(target, table.drafter, table.mask, None, float32_target=float32).build(
        ["greedy", "viasd_lossless_fp32"])
    ids = torch.tensor([[3, 17, 5, 3, 17, 5, 3, 17]])
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    outcome = methods["viasd_lossless_fp32"](ids, common)
    assert passes["bf16"] == 0 and passes["fp32"] > 0
    assert outcome.tokens == float32.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)[0, 8:].tolist()


def test_ablated_methods_switch_off_their_lever_and_stay_lossless(table):
    methods = table.build(["greedy", "viasd_lossless_nocost", "viasd_lossless_hybrid_fullvocab_nocost",
                           "viasd_fullvocab_nocost", "viasd_nocost"])
    ids = torch.tensor([[3, 17, 5, 3, 17, 5, 3, 17]])
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    outcomes = {name: method(ids, common) for name, method in methods.items()}
    for name in ("viasd_lossless_nocost", "viasd_lossless_hybrid_fullvocab_nocost"):
        assert outcomes[name].tokens == outcomes["greedy"].tokens, name
        # without the cost model the slim tier is never switched off
        assert outcomes[name].viasd["slim_off_blocks"] == 0 and outcomes[name].viasd["slim_forwards"] > 0, name
    assert outcomes["viasd_fullvocab_nocost"].viasd["slim_forwards"] > 0
    assert outcomes["viasd_nocost"].viasd["slim_off_blocks"] == 0


def test_a_reproducible_method_drafts_with_the_drafter_as_given(table, monkeypatch):
    import viasd_hf.drafters.precision as precision

    def no_faster_form(drafter, shards=None):
        raise AssertionError("asked for the drafter's fastest form")

    monkeypatch.setattr(precision, "fastest_form", no_faster_form)
    methods = table.build(["greedy", "two_tier_reproducible", "two_tier"])
    ids = torch.tensor([[3, 17, 5, 3, 17, 5, 3, 17]])
    common = {"max_new_tokens": 12, "do_sample": False, "return_dict_in_generate": True, "pad_token_id": 0}
    outcome = methods["two_tier_reproducible"](ids, common)
    assert outcome.tokens == methods["greedy"](ids, common).tokens and outcome.viasd["drafter_forwards"] > 0
    with pytest.raises(AssertionError, match="fastest form"):  # the default asks for it
        methods["two_tier"](ids, common)


def test_run_methods_interleaves_and_keeps_every_repeat(table):
    methods = table.build(["greedy", "two_tier", "viasd"])
    examples = [Example("custom", "hello there"), Example("custom", "general kenobi")]
    runs = run_methods(methods, DigitTokenizer(), examples, max_new_tokens=6, repeats=2)
    for name, method_runs in runs.items():
        assert len(method_runs.outcomes) == 2 and all(len(s) == 2 for s in method_runs.seconds), name
    assert runs["two_tier"].outcomes[1].tokens == runs["greedy"].outcomes[1].tokens


def test_a_traced_run_records_each_timed_call_with_its_own_passes(table, tmp_path):
    """One line per timed call (no warm-up), each holding the passes its method ran: greedy one target body pass
    per token, two-tier as many drafter and target passes as its own statistics count."""
    methods = table.build(["greedy", "two_tier"])
    examples = [Example("custom", "hello there"), Example("custom", "general kenobi")]
    tracer = CallTracer(tmp_path / "traces", lambda: {"target": table.target, "drafter": table.drafter})
    runs = run_methods(methods, DigitTokenizer(), examples, max_new_tokens=6, repeats=2, tracer=tracer)
    _, calls = read_traces(tmp_path / "traces")
    assert sorted((c.method, c.prompt, c.repeat) for c in calls) == sorted(
        (m, i, r) for m in ("greedy", "two_tier") for i in range(2) for r in range(2))
    for call in calls:
        assert call.seconds == runs[call.method].seconds[call.prompt][call.repeat]
        bodies = [p for p in call.passes if p.kind == "body"]
        if call.method == "greedy":
            assert len(bodies) == call.new_tokens and {p.model.split()[0] for p in bodies} == {"target"}
        elif call.repeat == 0:
            stats = runs[call.method].outcomes[call.prompt].viasd
            assert sum(p.model.startswith("drafter") for p in bodies) == stats["drafter_forwards"]
            assert sum(p.model.startswith("target") for p in bodies) == stats["full_forwards"] + stats["slim_forwards"]


def git(folder: Path, *args: str) -> str:
    command = ["git", "-C", str(folder), "-c", "user.name=bench", "-c", "user.email=bench@example.com",
               "-c", "commit.gpgsign=false", *args]
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_environment_names_the_commit_measured_and_whether_it_had_changes(tmp_path):
    package = tmp_path / "viasd_hf"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert source_revision(package) == {"commit": None, "dirty": None}, "not a git checkout"
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "viasd_hf/__init__.py")
    git(tmp_path, "commit", "-q", "-m", "first")
    assert source_revision(package) == {"commit": git(tmp_path, "rev-parse", "HEAD"), "dirty": False}
    (package / "__init__.py").write_text("changed = True\n")
    assert source_revision(package) == {"commit": git(tmp_path, "rev-parse", "HEAD"), "dirty": True}
    installed = tmp_path / "site-packages" / "viasd_hf"  # a copy the checkout does not track: not its commit
    shutil.copytree(package, installed)
    assert source_revision(installed) == {"commit": None, "dirty": None}


def test_the_environment_has_no_commit_without_git(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git to run
    assert source_revision() == {"commit": None, "dirty": None}
    recorded = environment(1.0)
    assert recorded["commit"] is None and recorded["dirty"] is None and recorded["viasd_hf"]


# One short prompt per Spec-Bench task (its long summarisation and RAG prompts would make prefill the test's cost)
SHORT_SPEC_BENCH = [
    {"task": "mt_bench", "prompt": "Write a haiku about autumn leaves."},
    {"task": "translation", "prompt": "Translate German to English: Das Haus ist groß.", "reference": "The house is big."},
    {"task": "summarization", "prompt": "Summarize in one sentence: The city council met on Monday and, after a long "
     "debate, approved the budget for a new park by the river.", "reference": "The council approved a park budget."},
    {"task": "qa", "prompt": "Who wrote the play Hamlet?", "reference": ["William Shakespeare", "Shakespeare"]},
    {"task": "math_reasoning", "prompt": "Tom has 12 apples and buys 30 more. How many apples does he have?",
     "reference": "42"},
    {"task": "rag", "prompt": "Context: Paris is the capital of France.\nQuestion: What is the capital of France?",
     "reference": ["Paris"]},
]


@pytest.mark.integration
def test_bench_cli_runs_every_method_on_spec_bench_tasks(tmp_path, capsys):
    """What CI runs: every method, one short prompt per Spec-Bench task, on the small model (no timing asserted)."""
    report, pictures, prompts = tmp_path / "bench.json", tmp_path / "plots", tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(record) + "\n" for record in SHORT_SPEC_BENCH))
    assert main(["bench", "--target", "smollm2-135m-instruct", "--drafter", "smollm2-135m-instruct",
                 "--mask", str(REPO / "hub_masks" / "smollm2-135m-instruct" / "model-free"), "--dtype", "float32",
                 "--prompts", str(prompts), "--max-new-tokens", "8", "--json", str(report), "--plots", str(pictures)]) == 0
    data = json.loads(report.read_text())
    assert list(data["methods"]) == list(METHODS)
    assert data["tasks"] == {task: 1 for task in ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")}
    for name, row in data["methods"].items():
        assert all(key in row for key in CONTRACT), name
        assert "greedy_agreement" in row["quality"] and "rougeL" in row["quality"] and "bleu" in row["quality"], name
        assert set(row["per_task"]) == set(data["tasks"]), name
    assert data["methods"]["greedy"]["speedup_vs_greedy"] == 1.0
    assert data["methods"]["viasd_lossless"]["quality"]["greedy_agreement"] >= 0.9  # exactness: test_decoding*
    for name in ("greedy", "viasd_lossless", "hf_assisted"):  # fp32: the two pass shapes round alike but for rare ties
        assert data["methods"][name]["quality"]["full_model_agreement"] >= 0.99, name
    assert 0 <= data["methods"]["viasd"]["quality"]["full_model_agreement"] <= 1
    assert data["environment"]["machine_bandwidth_gb_s"] > 0
    assert data["environment"]["commit"] == source_revision()["commit"] and "dirty" in data["environment"]
    assert len(data["outputs"]["viasd"]) == 6
    assert {p.name for p in pictures.iterdir()} == {"speedup_vs_quality.png", "tier_fractions.png"}
    assert sum(data["methods"]["viasd"]["time_shares"].values()) == pytest.approx(1.0)
    assert all("slim_on_fraction" in row for row in data["methods"]["viasd"]["per_task"].values())
    out = capsys.readouterr().out
    assert "| viasd |" in out and "Speed-up over greedy per task" in out and "Where the time goes" in out

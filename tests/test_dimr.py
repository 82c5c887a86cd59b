"""DIMR routing-mask search: objectives, search-loop guarantees, budget sweep, calibration cache, Δ, CLI."""

from __future__ import annotations

import argparse
import json
import math
import warnings

import numpy as np
import pytest
import torch

from conftest import VOCAB, tiny_causal_lm
from viasd_hf import RoutingMask, dimr
from viasd_hf.calibration import windows as calibration_module
from viasd_hf.calibration.windows import (
    Prompt,
    TeacherForcedReference,
    Window,
    build_calibration,
    greedy_continuation,
    split_prompts,
)
from viasd_hf.cli.search import add_search_command, search_command_line
from viasd_hf.dimr import (
    baseline_table,
    budget,
    compare_with_baselines,
    early_exit_mask,
    evaluate_mask,
    insertion_criterion,
    kl_divergence,
    random_masks,
    search,
    to_json_safe,
    top1_agreement,
    via_cost,
)
from viasd_hf.masks.architectures import protected_layers

FAST = dict(iterations=10, bo_every=2, patience=None, progress=False, objective="kl")


class ByteTokenizer:
    """Just enough tokenizer for calibration on a tiny random model: one id per printable character."""

    chat_template = None
    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + [2 + (ord(c) - 32) % (VOCAB - 2) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(32 + i - 2) for i in ids)


def make_windows(model, count: int = 5, prompt_tokens: int = 10, window: int = 6, seed: int = 0) -> list[Window]:
    generator = torch.Generator().manual_seed(seed)
    windows = []
    for i in range(count):
        prompt = torch.randint(2, VOCAB, (prompt_tokens,), generator=generator).tolist()
        tokens = prompt + greedy_continuation(model, prompt, window, set())
        windows.append(Window(str(i), torch.tensor([tokens]), start=prompt_tokens - 1))
    return windows


def sharpened(model):
    """A tiny random model with peaked next-token distributions, so the VIA cost is not zero everywhere."""
    with torch.no_grad():
        model.lm_head.weight.mul_(40)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return sharpened(tiny_causal_lm("llama", num_hidden_layers=12))


@pytest.fixture(scope="module")
def reference(model):
    return TeacherForcedReference(model, make_windows(model), progress=False)


# --------------------------------------------------------------------------- objectives


def test_objectives_on_a_hand_example():
    q, r = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.3, 0.5])
    log_q, log_r = q.log(), r.log()
    expected_kl = sum(qi * math.log(qi / ri) for qi, ri in zip(q.tolist(), r.tolist()))
    # z1 = log(0.5) + log(r/q) > 0 only where r > 2q (last token); z2 = log(0.3) + log(r/q) > 0 only where r > q/0.3
    expected_via = 0.5 * (math.log(0.5) + math.log(0.5 / 0.2)) + 0.0
    assert kl_divergence(log_q, log_r).item() == pytest.approx(expected_kl, rel=1e-6)
    assert top1_agreement(log_q, log_r).item() == 0.0
    assert via_cost(log_q, log_r, 0.5, 0.3).item() == pytest.approx(expected_via, rel=1e-6)
    assert via_cost(log_q, log_q).item() == 0.0
    sharp = torch.tensor([0.9, 0.05, 0.05]).log()  # r = 0.05 vs q = 0.001: both margins exceeded
    tiny_q = torch.tensor([0.998, 0.001, 0.001]).log()
    z1, z2 = math.log(0.5) + math.log(50), math.log(0.3) + math.log(50)
    assert via_cost(tiny_q, sharp).item() == pytest.approx(2 * (0.05 * z1 + 0.001 * z2), rel=1e-5)


def test_full_mask_scores_zero_kl_and_full_agreement(model, reference):
    keep_all = RoutingMask.from_model(model, skip=[])
    scores = evaluate_mask(model, keep_all, reference)
    assert scores["kl"] == 0.0 and scores["via"] == 0.0 and scores["top1"] == 1.0
    assert scores["positions"] == sum(w.positions for w in reference.windows) == 5 * 6
    skipping = evaluate_mask(model, RoutingMask.from_model(model, skip=[3, 4]), reference.windows)
    assert skipping["kl"] > 0


# --------------------------------------------------------------------------- the search loop


@pytest.mark.parametrize("kind", ["llama", "gemma3_text"])
def test_search_skips_exactly_k_and_never_a_protected_layer(kind):
    model = tiny_causal_lm(kind) if kind == "gemma3_text" else tiny_causal_lm(kind, num_hidden_layers=12)
    mask = search(model, calibration=make_windows(model, count=3), skip_ratio=0.34, **FAST)
    k = math.floor(0.34 * mask.num_layers + 0.5)
    assert len(mask.skipped_layers) == k
    assert not set(mask.skipped_layers) & set(protected_layers(model))
    mask.validate_for(model)


def test_search_never_evaluates_a_mask_twice(model, reference, monkeypatch):
    evaluated = []
    real = dimr.score_mask

    def counting(ref, mask, *args):
        evaluated.append(tuple(mask.skipped_layers))
        return real(ref, mask, *args)

    monkeypatch.setattr(budget, "score_mask", counting)  # what search_budget calls
    result = dimr.search_budget(model, reference, 0.25, "kl", iterations=16, bo_every=1, patience=None, progress=False)
    assert len(evaluated) == len(set(evaluated)) == result.evaluated == 16
    assert all(len(skip) == 3 and not {0, 11} & set(skip) for skip in evaluated)


def test_search_is_deterministic_under_a_seed(model):
    windows = make_windows(model, count=3)
    first = search(model, calibration=windows, skip_ratio=0.25, seed=7, **FAST)
    second = search(model, calibration=windows, skip_ratio=0.25, seed=7, **FAST)
    assert first.skipped_layers == second.skipped_layers
    assert first.objective_value == second.objective_value


def test_patience_and_time_budget_stop_the_search(model, reference):
    patient = dimr.search_budget(model, reference, 0.25, "kl", iterations=50, patience=2, progress=False)
    assert patient.stop_reason == "patience" and patient.evaluated < 50
    hurried = dimr.search_budget(model, reference, 0.25, "kl", iterations=50, deadline=0.0, progress=False)
    assert hurried.stop_reason == "time_budget" and hurried.evaluated == 1
    tiny_space = dimr.search_budget(model, reference, 0.09, "kl", iterations=50, patience=None, progress=False)
    assert tiny_space.stop_reason == "exhausted" and tiny_space.evaluated == 10  # C(10, 1)


def test_search_writes_mask_log_and_progress(model, tmp_path, capsys):
    mask = search(model, calibration=make_windows(model, count=3), skip_ratio=0.25, out_dir=tmp_path,
                  search_command="viasd search --target tiny", **FAST | {"progress": True})  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "search_log.jsonl").read_text().splitlines()]
    assert len(rows) == mask.metadata["masks_evaluated"] == 10
    assert {"skipped", "objective", "kl", "top1", "via", "seconds", "proposal"} <= set(rows[0])
    assert min(row["objective"] for row in rows) == mask.objective_value
    saved = RoutingMask.from_pretrained(tmp_path)
    assert saved.skipped_layers == mask.skipped_layers
    assert saved.metadata["search_command"] == "viasd search --target tiny"
    assert saved.objective == "kl" and saved.drafter_id == "self" and saved.search_time_s is not None
    assert "best=" in capsys.readouterr().err


def test_budget_sweep_records_every_budget_and_picks_the_best_prediction(model):
    windows = make_windows(model, count=3)
    mask = search(model, calibration=windows, skip_ratio=[0.17, 0.34], cost_context=24, cost_repeats=1, **FAST)
    sweep = mask.metadata["sweep"]
    assert [row["skip_ratio"] for row in sweep] == [0.17, 0.34]
    assert all({"slim_cost_block", "predicted_speedup", "skipped", "masks_evaluated"} <= set(row) for row in sweep)
    best = max(sweep, key=lambda row: row["predicted_speedup"])
    assert mask.skipped_layers == best["skipped"]
    assert mask.metadata["masks_evaluated"] == sum(row["masks_evaluated"] for row in sweep)
    json.dumps(mask.to_dict())


# --------------------------------------------------------------------------- calibration


def test_calibration_cache_is_reused_without_generating_again(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    calls = []
    real = calibration_module.greedy_continuation
    monkeypatch.setattr(calibration_module, "greedy_continuation", lambda *a: calls.append(1) or real(*a))
    prompts = [Prompt(str(i), f"prompt number {i} about topic {i * 7}", f"cat{i % 2}") for i in range(6)]
    build = dict(prompts=prompts, num_prompts=3, num_heldout=2, window=4, progress=False)
    first = build_calibration(model, ByteTokenizer(), **build)
    assert len(calls) == 5 and len(list((tmp_path / "calibration").glob("*.pt"))) == 2
    second = build_calibration(model, ByteTokenizer(), **build)
    assert len(calls) == 5
    assert all(torch.equal(a.tokens, b.tokens) for a, b in zip(first.windows + first.heldout, second.windows + second.heldout))
    build_calibration(model, ByteTokenizer(), **build | {"window": 5})  # other parameters: a new cache entry
    assert len(calls) == 10


def test_calibration_and_heldout_prompts_are_disjoint_and_deterministic():
    prompts = [Prompt(str(i), f"p{i}", ["math", "qa", "code"][i % 3]) for i in range(30)]
    calibration, heldout = split_prompts(prompts, 12, 6, seed=0)
    assert len(calibration) == 12 and len(heldout) == 6
    assert not {p.id for p in calibration} & {p.id for p in heldout}
    assert {p.category for p in calibration} == {"math", "qa", "code"}
    assert split_prompts(prompts, 12, 6, seed=0) == (calibration, heldout)
    with pytest.raises(ValueError):
        split_prompts(prompts, 25, 6)


def test_prompt_files(tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("first prompt\n\nsecond prompt\n")
    assert [p.text for p in calibration_module.read_prompts(text)] == ["first prompt", "second prompt"]
    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text('{"prompt": "a"}\n{"prompt": "b", "id": "x7"}\n')
    assert [(p.id, p.text) for p in calibration_module.read_prompts(jsonl)] == [("0", "a"), ("x7", "b")]


# --------------------------------------------------------------------------- JSON, Δ, baselines, CLI


def test_numpy_and_torch_scalars_serialise_to_json(model, tmp_path):
    value = {"a": np.float32(1.5), "b": np.int64(3), "c": (np.float64(2.0), torch.tensor(4)), "d": np.array([1, 2])}
    assert json.loads(json.dumps(to_json_safe(value))) == {"a": 1.5, "b": 3, "c": [2.0, 4], "d": [1, 2]}
    mask = RoutingMask.from_model(model, skip=[2], metadata=to_json_safe({"kl": np.float32(0.25)}))
    assert RoutingMask.from_pretrained(mask.save_pretrained(tmp_path)).metadata == {"kl": 0.25}


def test_insertion_criterion_and_warning(model, reference):
    slim = RoutingMask.from_model(model, skip=[3, 4, 5])
    drafter = sharpened(tiny_causal_lm("llama", seed=1, num_hidden_layers=2))
    parts = insertion_criterion(reference, drafter, {"m": slim})["m"]
    assert parts["delta"] == pytest.approx(parts["C(q||p)"] - parts["C(q'||p)"] - parts["C(q||q')"])
    same = insertion_criterion(reference, model, {"m": slim})["m"]  # p = q: inserting anything cannot help
    assert same["C(q||p)"] == 0.0 and same["C(q||q')"] > 0 and same["delta"] < 0
    with pytest.warns(UserWarning, match="differs"):
        insertion_criterion(reference, tiny_causal_lm("llama", vocab_size=VOCAB + 16, num_hidden_layers=2), {"m": slim})
    with pytest.warns(UserWarning, match="Δ"):
        mask = search(model, drafter=model, calibration=reference.windows, skip_ratio=0.25, **FAST | {"iterations": 3})
    assert mask.metadata["insertion"]["delta"] < 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        search(model, calibration=reference.windows, skip_ratio=0.25, **FAST | {"iterations": 3})  # no drafter, no Δ


def test_baselines(model, reference):
    early = early_exit_mask(model, 3)
    assert early.skipped_layers == [8, 9, 10]
    randoms = random_masks(model, 3, 5, seed=0)
    assert len({tuple(m.skipped_layers) for m in randoms}) == 5
    assert all(len(m.skipped_layers) == 3 and not {0, 11} & set(m.skipped_layers) for m in randoms)
    comparison = compare_with_baselines(model, RoutingMask.from_model(model, skip=[2, 4, 6]), reference, n_random=5)
    assert comparison["random_median"]["n"] == 5 and comparison["early_exit"]["skipped"] == [8, 9, 10]
    table = baseline_table(comparison)
    assert "| DIMR searched | [2, 4, 6] |" in table and "early exit" in table


def test_search_command_end_to_end(model, tmp_path, monkeypatch):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))
    monkeypatch.setattr("viasd_hf.models.loading.load_pretrained", lambda name, dtype=None: (model, ByteTokenizer()))
    monkeypatch.setattr("viasd_hf.cli.search.check_model", lambda name, flag: None)  # "tiny" is no zoo name or folder
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"write function number {i}" for i in range(8)))
    parser = argparse.ArgumentParser(prog="viasd")
    add_search_command(parser.add_subparsers(dest="command"))
    argv = ["search", "--target", "tiny", "--skip-ratio", "0.25", "--objective", "kl", "--iterations", "4",
            "--prompts", str(prompts), "--num-prompts", "4", "--num-heldout", "2", "--window", "4",
            "--dtype", "float32", "--out", str(tmp_path / "out")]  # fmt: skip
    args = parser.parse_args(argv)
    assert args.handler(args) == 0
    mask = RoutingMask.from_pretrained(tmp_path / "out")
    assert mask.metadata["search_command"] == search_command_line(args)
    assert mask.metadata["search_command"].startswith("viasd search --target tiny --skip-ratio 0.25 --objective kl")
    assert set(mask.metadata["heldout_prompt_ids"]).isdisjoint(mask.metadata["calibration_prompt_ids"])
    assert len(mask.metadata["heldout_prompt_ids"]) == 2 and mask.metadata["heldout"]["positions"] == 8
    assert parser.parse_args([*argv[:3], "--skip-ratio", "0.1,0.2"]).skip_ratio == [0.1, 0.2]

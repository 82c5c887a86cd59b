"""The ``viasd`` command: its arguments are checked before any model loads (fast), and it runs end to end on the
small zoo model (integration; functional only: no timing is asserted)."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from huggingface_hub import constants

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask
from viasd_hf.bench import demo
from viasd_hf.bench.methods import Outcome
from viasd_hf.bench.runner import MethodRuns, run_methods, summarise
from viasd_hf.cli import args as cli_args
from viasd_hf.cli import build_parser, main
from viasd_hf.data.tasks import Example
from viasd_hf.models import loading as models

SMALL = "smollm2-135m-instruct"


class ModelLoaded(BaseException):  # not an Exception: the command turns those into one line
    """Raised by every model loader in these tests: reaching one means the arguments passed their checks."""


@pytest.fixture
def no_models(monkeypatch):
    def refuse(*args, **kwargs):
        raise ModelLoaded(args)

    monkeypatch.setattr(models, "load_pretrained", refuse)
    monkeypatch.setattr(models, "resolve_zoo_model", refuse)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", staticmethod(refuse))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", staticmethod(refuse))


def run_cli(argv: list[str]) -> tuple[int, str]:
    """``viasd ARGV`` in this process: its exit status and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    return code, err.getvalue()


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    """Prompt files good and bad, a file where a folder is wanted, and a model folder (config only)."""
    paths = {name: tmp_path / name for name in ("prompts.jsonl", "empty.jsonl", "broken.jsonl", "no-prompt.jsonl",
                                                "prompts.txt", "empty.txt", "a-file", "model")}
    paths["prompts.jsonl"].write_text("".join(json.dumps({"prompt": f"Say {n}."}) + "\n" for n in range(3)))
    paths["empty.jsonl"].write_text("\n")
    paths["broken.jsonl"].write_text('{"prompt": "a"\n')
    paths["no-prompt.jsonl"].write_text(json.dumps({"text": "a"}) + "\n")
    paths["prompts.txt"].write_text("one\ntwo\nthree\n")
    paths["empty.txt"].write_text("")
    paths["a-file"].write_text("")
    tiny_causal_lm("llama").config.save_pretrained(paths["model"])
    return paths


def assert_refused(argv: list[str], message: str, code: int = 2) -> None:
    """One line on stderr that starts with ``message``, the exit status, and no model loaded (no_models raises)."""
    got, err = run_cli(argv)
    assert (got, len(err.splitlines())) == (code, 1), (argv, err)
    assert err.startswith(message), (argv, err)


def test_bench_checks_its_arguments_before_loading_models(no_models, files, tmp_path, monkeypatch):
    # offline, as the suite runs, whatever this shell exports: a Hub id missing from the cache is then refused up
    # front; online it is the Hub's to answer, when the model loads (huggingface_hub reads the variable at import)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ok = ["bench", "--target", SMALL, "--drafter", SMALL, "--methods", "greedy,hf_assisted"]
    prompts = ["--prompts", str(files["prompts.jsonl"])]
    error = "viasd bench: error: "
    for argv, message in [
        (["--target", "qwen2.5-coder-1.5b-instuct"], "--target qwen2.5-coder-1.5b-instuct: unknown model; did you mean "
                                                     "the zoo model qwen2.5-coder-1.5b-instruct?"),
        (["--drafter", "./no-such-model"], "--drafter ./no-such-model: no such folder"),
        (["--drafter", "Org/not-cached-model"], "--drafter Org/not-cached-model: not a zoo name"),
        (["--drafter", str(files["a-file"])], f"--drafter {files['a-file']}: is a file"),
        (["--drafter", str(tmp_path)], f"--drafter {tmp_path}: the folder has no config.json"),
        (["--methods", "greedy,viasdd"], "--methods: unknown method(s) 'viasdd'; choose from greedy,"),
        (["--methods", "viasd,greedy"], "--methods: the first method must be greedy"),
        (["--dataset", "spec-bench"], "argument --dataset: invalid choice: 'spec-bench'"),
        (["--prompts", str(tmp_path / "missing.jsonl")], f"--prompts {tmp_path / 'missing.jsonl'}: "),
        (["--prompts", str(files["empty.jsonl"])], f"--prompts {files['empty.jsonl']}: no prompts in the file"),
        (["--prompts", str(files["broken.jsonl"])], f"--prompts {files['broken.jsonl']}: {files['broken.jsonl']}, line 1: "
                                                    "not valid JSON"),
        ([*prompts, "--limit", "0"], "argument --limit: expected a whole number >= 1, got 0"),
        ([*prompts, "--repeats", "0"], "argument --repeats: expected a whole number >= 1, got 0"),
        ([*prompts, "--max-new-tokens", "ten"], "argument --max-new-tokens: expected a whole number >= 1, got 'ten'"),
        ([*prompts, "--temperature", "0"], "argument --temperature: expected a number > 0, got 0"),
        ([*prompts, "--draft-threshold", "1.5"], "argument --draft-threshold: expected a number from 0 to 1, got 1.5"),
        ([*prompts, "--dtype", "bf16"], "argument --dtype: invalid choice: 'bf16'"),
        ([*prompts, "--quantize", "target=int3"], "argument --quantize: unknown scheme 'int3' for the target; choose from"),
        ([*prompts, "--quantize", "draftr=4bit"], "argument --quantize: expected drafter=SCHEME,target=SCHEME, got"),
        ([*prompts, "--quantize", "target=4bit,target=int8"], "argument --quantize: the target is named twice"),
        ([*prompts, "--methods", "greedy,hf_assisted_bf16"], "--methods: hf_assisted_bf16 compares with a quantised pair"),
        ([*prompts, "--load", "heavy"], "argument --load: invalid choice: 'heavy'"),
        ([*prompts, "--load-workers", "0"], "argument --load-workers: expected a whole number >= 1, got 0"),
        ([*prompts, "--load-workers", "2"], "--load-workers: give the load they run, --load steady or --load bursty"),
        ([*prompts, "--json", str(files["a-file"] / "out.json")], f"--json {files['a-file'] / 'out.json'}: "
                                                                  f"{files['a-file']} is a file"),
        ([*prompts, "--json", str(tmp_path)], f"--json {tmp_path}: is a folder; give a file name"),
        ([*prompts, "--plots", str(files["a-file"])], f"--plots {files['a-file']}: exists and is not a folder"),
        ([*prompts, "--traces", str(files["a-file"])], f"--traces {files['a-file']}: exists and is not a folder"),
        ([*prompts, "--methods", "greedy,self_spec", "--target", str(files["model"])], "self_spec needs a self-drafting mask"),
        ([*prompts, "--methods", "greedy,viasd", "--target", str(files["model"])], "no routing mask is known for ("),
    ]:
        assert_refused([*ok, *argv], error + message)
    code, err = run_cli([*ok, *prompts, "--mask", str(tmp_path / "no-mask")])
    assert code == 2 and err.startswith(f"{error}--mask {tmp_path / 'no-mask'}: no routing mask at ")
    deeper, gemma = tmp_path / "deeper-mask", tmp_path / "gemma-mask"
    RoutingMask.from_model(tiny_causal_lm("llama", num_hidden_layers=8), skip=[3]).save_pretrained(deeper)
    RoutingMask([0, 17], 18, "gemma3-270m", "0123456789abcdef").save_pretrained(gemma)
    for argv, message in [  # a mask for another model, told from the target's config or zoo name
        (["--target", str(files["model"]), "--mask", str(deeper)],
         f"--mask {deeper}: this routing mask is for a 8-layer model (tiny-random-llama), but --target {files['model']} "
         "has 6 decoder layers"),
        (["--self-draft-mask", str(gemma)], f"--self-draft-mask {gemma}: this routing mask is for gemma3-270m, not "
                                            f"--target {SMALL}"),
    ]:
        assert_refused([*ok, *prompts, *argv], error + message)
    with pytest.raises(ModelLoaded):  # and valid arguments get as far as loading the models
        run_cli([*ok, *prompts, "--limit", "1", "--json", str(tmp_path / "new" / "out.json"), "--plots", str(tmp_path / "p"),
                 "--load", "bursty", "--load-workers", "2"])


def test_profile_checks_its_arguments_before_loading_models(no_models):
    ok = ["profile", "--target", SMALL]
    error = "viasd profile: error: "
    for argv, message in [
        (["--target", "smollm2-135m-instrct"], "--target smollm2-135m-instrct: unknown model; did you mean the zoo model "
                                               "smollm2-135m-instruct?"),
        (["--skip-ratios", "0.2,abc"], "argument --skip-ratios: expected a fraction of layers between 0 and 1, got 'abc'"),
        (["--skip-ratios", "0.2,1.5"], "argument --skip-ratios: expected a fraction of layers between 0 and 1, got 1.5"),
        (["--skip-ratios", "0.2,"], "argument --skip-ratios: expected a comma-separated list of fractions"),
        (["--blocks", "1,0"], "argument --blocks: expected a whole number >= 1, got 0"),
        (["--context", "-5"], "argument --context: expected a whole number >= 1, got -5"),
        (["--repeats", "0"], "argument --repeats: expected a whole number >= 1, got 0"),
        (["--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
    ]:
        assert_refused([*ok, *argv], error + message)
    with pytest.raises(ModelLoaded):
        run_cli([*ok, "--skip-ratios", "0.1,0.3", "--blocks", "1,4", "--repeats", "2"])


def test_search_checks_its_arguments_before_loading_models(no_models, files, tmp_path):
    ok = ["search", "--target", SMALL, "--prompts", str(files["prompts.txt"]), "--num-prompts", "2", "--num-heldout", "1",
          "--out", str(tmp_path / "mask")]
    error = "viasd search: error: "
    for argv, message in [
        (["--target", "gemma3-270"], "--target gemma3-270: unknown model; did you mean the zoo model gemma3-270m?"),
        (["--drafter", "./nope"], "--drafter ./nope: no such folder"),
        (["--skip-ratio", "0"], "argument --skip-ratio: expected a fraction of layers between 0 and 1, got 0"),
        (["--skip-ratio", "0.1,x"], "argument --skip-ratio: expected a fraction of layers between 0 and 1, got 'x'"),
        (["--bo-every", "0"], "argument --bo-every: expected a whole number >= 1, got 0"),
        (["--iterations", "0"], "argument --iterations: expected a whole number >= 1, got 0"),
        (["--time-budget", "-1"], "argument --time-budget: expected a number > 0, got -1"),
        (["--num-heldout", "-1"], "argument --num-heldout: expected a whole number >= 0, got -1"),
        (["--objective", "speed"], "argument --objective: invalid choice: 'speed'"),
        (["--dtype", "half"], "argument --dtype: invalid choice: 'half'"),
        (["--num-prompts", "3"], f"--prompts {files['prompts.txt']}: 3 prompts, fewer than --num-prompts 3 + --num-heldout 1"),
        (["--prompts", str(tmp_path / "missing.txt")], f"--prompts {tmp_path / 'missing.txt'}: no such file"),
        (["--prompts", str(files["empty.txt"])], f"--prompts {files['empty.txt']}: 0 prompts, fewer than"),
        (["--prompts", str(files["empty.jsonl"])], f"--prompts {files['empty.jsonl']}: no prompts in the file"),
        (["--prompts", str(files["no-prompt.jsonl"])], f"--prompts {files['no-prompt.jsonl']}: a record has no 'prompt' field"),
        (["--out", str(files["a-file"])], f"--out {files['a-file']}: exists and is not a folder"),
    ]:
        assert_refused([*ok, *argv], error + message)
    with pytest.raises(ModelLoaded):
        run_cli([*ok, "--drafter", "self", "--skip-ratio", "0.2,0.3"])


def test_vocab_checks_its_output_folder_before_loading_models(no_models, files, tmp_path):
    ok = ["vocab", "--target", SMALL]
    error = "viasd vocab: error: "
    for out, message in [
        (files["a-file"], f"--out {files['a-file']}: exists and is not a folder"),
        (files["a-file"] / "vocabularies", f"--out {files['a-file'] / 'vocabularies'}: {files['a-file']} is a file"),
    ]:
        assert_refused([*ok, "--out", str(out)], error + message)
    with pytest.raises(ModelLoaded):
        run_cli([*ok, "--out", str(tmp_path / "new")])


def test_the_cli_dtypes_are_those_the_loader_accepts():
    assert set(cli_args.DTYPES) == {*models._DTYPES, "auto"}


def test_an_unknown_command_or_a_missing_argument_is_one_line():
    assert run_cli(["speed"])[0] == 2 and len(run_cli(["speed"])[1].splitlines()) == 1
    code, err = run_cli(["pull", "--out", "x"])
    assert code == 2 and err == "viasd pull: error: the following arguments are required: --target (see viasd pull --help)\n"


def test_an_empty_run_is_refused_before_it_starts_and_a_silent_greedy_prompt_does_not_crash_the_summary():
    example = Example(task="custom", prompt="hi")
    for examples, repeats in (([], 1), ([example], 0)):
        with pytest.raises(ValueError, match="nothing to run"):
            run_methods({"greedy": lambda ids, common: None}, None, examples, 8, repeats)

    def runs(tokens: list[list[int]]) -> MethodRuns:
        outcomes = [Outcome(t, 0.1, max(1, len(t)), None, None, {"drafter": 0, "slim": 0, "full": len(t)}) for t in tokens]
        return MethodRuns(outcomes=outcomes, seconds=[[0.1] for _ in tokens])

    examples = [example, example]
    summary = summarise({"greedy": runs([[], [1, 2]]), "other": runs([[3], [1, 2]])}, examples, str, {"greedy": 1, "other": 1})
    assert summary["other"]["speedup_vs_greedy"] == 1.0  # the prompt greedy answered with nothing is left out
    summary = summarise({"greedy": runs([[], []]), "other": runs([[3], [4]])}, examples, str, {"greedy": 1, "other": 1})
    assert summary["other"]["speedup_vs_greedy"] is None and summary["other"]["tokens_per_s"] == 10.0


@pytest.mark.integration
def test_demo_small_prints_the_table_side_by_side_and_writes_it_as_json(capsys, tmp_path):
    report = tmp_path / "demo.json"
    assert main(["demo", "--small", "--dtype", "float32", "--max-new-tokens", "12", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    for row in ("greedy", "HF prompt lookup", "VIA-SD"):
        assert f"\n{row} " in out, row
    assert "vs greedy" in out and "vs HF prompt lookup" in out and "[verdict]" in out
    assert "[precision] target: float32: as asked with --dtype" in out
    data = json.loads(report.read_text())
    viasd = data["methods"]["VIA-SD"]
    assert viasd["identical_to_greedy"] is True, "lossless by default"
    assert viasd["tokens"] == 12 * len(data["prompts"]) and viasd["tokens_per_second"] > 0
    assert set(viasd["ratio"]) == {"greedy", "HF prompt lookup"}
    assert data["precision"]["target"].startswith("float32")
    assert data["environment"]["cpu"] in out and data["environment"]["torch_threads"] == data["threads"]
    assert {"commit", "torch", "transformers"} <= set(data["environment"]), "the table names its machine and source"


@pytest.mark.integration
def test_demo_runs_viasd_with_a_float32_target_too_where_bf16_is_emulated(capsys, tmp_path, monkeypatch):
    """Where the target runs in bf16 that the CPU emulates, VIA-SD's fastest exact configuration may be a float32
    target: the demo times that row as well, and the verdict weighs the better of VIA-SD's rows."""
    monkeypatch.setattr("viasd_hf.bench.demo.emulated_bf16", lambda model: True)
    report = tmp_path / "demo.json"
    assert main(["demo", "--small", "--max-new-tokens", "8", "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "\nVIA-SD (float32 target) " in out and "[precision] VIA-SD (float32 target): float32: this CPU" in out
    data = json.loads(report.read_text())
    row = data["methods"]["VIA-SD (float32 target)"]
    assert row["tokens"] == 8 * len(data["prompts"]) and set(row["ratio"]) == {"greedy", "HF prompt lookup"}
    assert "VIA-SD" in data["methods"] and "VIA-SD" not in data["methods"]["VIA-SD"]["ratio"], "ours are no baseline"
    best = max(("VIA-SD", "VIA-SD (float32 target)"), key=lambda name: data["methods"][name]["tokens_per_second"])
    assert f"[verdict] {best} is " in out


@pytest.mark.parametrize("budget, kinds", [(70.0, 2), (100.0, 3), (None, 4)])
def test_demo_times_rounds_of_prompts_until_its_budget_is_spent(budget, kinds):
    """Each of three methods takes 10 s a call: a round of one prompt costs 30 s. A round that would end past the
    budget (judged by the mean round so far) is not started, two rounds at least; warm-up calls are not counted."""
    now, calls = [0.0], []

    def method(ids, tokens):
        now[0] += 10.0
        calls.append((ids.shape[1], tokens))
        return SimpleNamespace(sequences=torch.cat([ids, torch.arange(tokens)[None]], dim=1))

    prompts = {kind: torch.arange(40 + i)[None] for i, kind in enumerate(demo.PROMPTS)}
    tokens = demo.WARM_UP_NEW_TOKENS + 4
    rows = demo.run_methods({"greedy": method, "a": method, "b": method}, prompts, tokens, budget, clock=lambda: now[0])
    assert calls[:3] == [(demo.WARM_UP_PROMPT_TOKENS, demo.WARM_UP_NEW_TOKENS)] * 3
    assert len(calls) == 3 + 3 * kinds and kinds >= demo.MIN_ROUNDS
    for row in rows:
        assert list(row.outputs) == list(demo.PROMPTS)[:kinds] and row.tokens == tokens * kinds
        assert row.seconds == 10.0 * kinds and row.identical


@pytest.mark.parametrize("arguments, problem", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--dtype", "float64"], "--dtype"),
    (["--json", "/no/such/folder/demo.json"], "its folder does not exist"),
    (["--budget", "-5"], "--budget"),
    (["--budget", "nan"], "--budget"),
])
def test_demo_checks_its_arguments_before_loading_models(arguments, problem, capsys, monkeypatch):
    monkeypatch.setattr("viasd_hf.bench.demo.load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["demo", "--small", *arguments]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1


@pytest.mark.integration
def test_profile_reports_slim_and_full_costs(capsys):
    assert main(["profile", "--target", "smollm2-135m-instruct", "--dtype", "float32", "--repeats", "1",
                 "--context", "32"]) == 0
    out = capsys.readouterr().out
    assert "| full | 1.00" in out and "| slim 45%" in out


def test_version_prints_the_version(capsys):
    from viasd_hf import __version__

    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"viasd {__version__}\n"


@pytest.mark.parametrize("arguments, problem", [
    (["--target", "nobody/nothing"], "--target nobody/nothing"),
    (["--drafter", "./no-such-folder"], "--drafter ./no-such-folder: no such folder"),
])
def test_demo_refuses_a_model_it_cannot_find_in_one_line(arguments, problem, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("viasd_hf.bench.demo.load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["demo", *arguments]) == 2
    err = capsys.readouterr().err
    assert problem in err and len(err.strip().splitlines()) == 1


def test_demo_refuses_a_folder_for_its_json_file_before_it_runs(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("viasd_hf.bench.demo.load_pretrained", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["demo", "--small", "--json", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is a folder; give a file name" in err and len(err.strip().splitlines()) == 1


def test_a_failure_during_a_run_is_one_line_unless_debug(capsys, monkeypatch):
    def fails(*args, **kwargs):
        raise RuntimeError("the model would not load\nwith a long second line")

    monkeypatch.setattr("viasd_hf.cli.demo.run_demo", fails)
    assert main(["demo", "--small"]) == 1
    err = capsys.readouterr().err
    assert err == "viasd demo: error: the model would not load (--debug shows where)\n"
    with pytest.raises(RuntimeError, match="would not load"):
        main(["--debug", "demo", "--small"])


def test_replay_push_and_pull_check_their_arguments_in_one_line(no_models, files, tmp_path, monkeypatch):
    """Garbage for every argument: a missing path, an empty folder, a file for a folder, a folder for a file, numbers
    out of range. Mistakes are one line and exit 2; a pull that finds no mask fails in one line with exit 1."""
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    empty, a_file, missing = tmp_path / "empty", files["a-file"], tmp_path / "missing"
    empty.mkdir()
    for argv, message in [
        (["replay", str(missing), "--costs", str(a_file)], f"viasd replay: error: {missing}: "),
        (["replay", str(empty), "--costs", str(a_file)], f"viasd replay: error: {empty}: {empty} holds no models.json"),
        (["replay", str(a_file), "--costs", str(a_file)], f"viasd replay: error: {a_file}: "),
        (["replay", str(empty)], "viasd replay: error: give either --costs FILE"),
        (["replay", str(empty), "--costs", "x", "--measure-costs", "y"], "viasd replay: error: give either --costs FILE"),
        (["replay", str(empty), "--costs", "x", "--loop"], "viasd replay: error: --loop is measured with --measure-costs"),
        (["replay", str(empty), "--costs", "x", "--repeats", "-1"], "viasd replay: error: argument --repeats: expected a "
                                                                    "whole number >= 1, got -1"),
        (["replay", str(empty), "--costs", "x", "--repeats", "9" * 20], "viasd replay: error: argument --repeats: expected "
                                                                       "a whole number <= 2147483647"),
        (["push", str(missing), "--repo-id", "a/b"], f"viasd push: error: MASK_DIR {missing}: no such folder or file"),
        (["push", str(empty), "--repo-id", "a/b"], f"viasd push: error: MASK_DIR {empty}: not a valid routing mask: no "
                                                   "routing mask at"),
        (["push", str(a_file), "--repo-id", "a/b"], f"viasd push: error: MASK_DIR {a_file}: not a valid routing mask: "),
        (["push", str(empty), "--repo-id", "not a repo"], "viasd push: error: --repo-id not a repo: not a Hub repo id"),
        (["push", str(empty), "--repo-id", "a/b", "--endpoint", "nope"], "viasd push: error: --endpoint nope: not an "
                                                                          "http(s) URL"),
        (["pull", "--target", " ", "--out", str(tmp_path / "o")], "viasd pull: error: --target must name a model"),
        (["pull", "--target", SMALL, "--drafter", "", "--out", str(tmp_path / "o")], "viasd pull: error: --drafter must "
                                                                                      "name a model"),
        (["pull", "--target", SMALL, "--out", str(a_file)], f"viasd pull: error: --out {a_file}: exists and is not a folder"),
        (["pull", "--target", SMALL, "--out", str(a_file / "o")], f"viasd pull: error: --out {a_file / 'o'}: {a_file} is "
                                                                   "a file"),
        (["pull", "--target", SMALL, "--repo-id", "a b", "--out", str(tmp_path / "o")], "viasd pull: error: --repo-id a b:"),
        (["profile", "--target", str(empty)], f"viasd profile: error: --target {empty}: the folder has no config.json"),
        (["profile", "--target", str(a_file)], f"viasd profile: error: --target {a_file}: is a file"),
        (["profile", "--target", SMALL, "--context", "9" * 21], "viasd profile: error: argument --context: expected a "
                                                                 "whole number <= 2147483647"),
        (["search", "--target", str(missing), "--out", str(tmp_path / "m")], f"viasd search: error: --target {missing}: "
                                                                              "no such folder"),
        (["search", "--target", SMALL, "--iterations", "9" * 12, "--out", str(tmp_path / "m")],
         "viasd search: error: argument --iterations: expected a whole number <= 2147483647"),
        (["bench", "--target", SMALL, "--max-new-tokens", "-3"], "viasd bench: error: argument --max-new-tokens: expected "
                                                                 "a whole number >= 1, got -3"),
    ]:
        assert_refused(argv, message)
    assert_refused(["pull", "--target", "nobody/nothing", "--out", str(tmp_path / "o")],
                   "viasd pull: error: no routing mask for target 'nobody/nothing' with drafter 'self' (looked in", code=1)
    assert not (tmp_path / "o").exists()

"""Pass traces and their replay: a trace holds every pass a decode ran, and a replay prices exactly those passes.

Tiny random models: what is asserted is bookkeeping (which passes, how wide, after how much
context, through how many layers) and arithmetic (the price of a trace), never a speed.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import VOCAB, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
from viasd_hf.bench.replay import ModelCosts, replay, self_check
from viasd_hf.bench.traces import CallTrace, Pass, PassRecorder, TraceWriter, form_of, model_key, read_traces
from viasd_hf.cli import main
from viasd_hf.vocabulary import DraftVocabulary
from viasd_hf.vocabulary.store import config_fingerprint

pytestmark = pytest.mark.usefixtures("single_thread")

REPO = Path(__file__).resolve().parents[1]
EVEN = list(range(0, VOCAB, 2))


def test_plain_generate_traces_a_prefill_then_one_token_per_pass(prompt_ids):
    target = tiny_causal_lm("qwen2")
    recorder = PassRecorder({"target": target})
    with recorder.recording():
        target.generate(prompt_ids, max_new_tokens=6, do_sample=False)
    passes = recorder.take()
    bodies = [p for p in passes if p.kind == "body"]
    heads = [p for p in passes if p.kind == "head"]
    width = prompt_ids.shape[1]
    assert [(p.width, p.context) for p in bodies] == [(width, 0)] + [(1, width + k) for k in range(5)]
    assert all(p.layers == 6 and p.model == "target (float32)" for p in bodies)
    assert [(p.width, p.vocab) for p in heads] == [(1, VOCAB)] * 6  # generate keeps one row of logits per pass
    assert all(p.seconds > 0 for p in passes)


def test_a_viasd_trace_holds_every_pass_its_stats_count_and_how_many_layers_each_ran(prompt_ids):
    """Tiered VIA-SD with the slim tier always on and a draft vocabulary: the target's passes split into full
    (6 layers) and slim (4 layers: the mask skips 2) exactly as ``viasd_stats`` counts them; the drafter's passes
    are its forwards; slim and drafter heads are the vocabulary's slice, the full model's head is whole."""
    target = enable_viasd(tiny_causal_lm("qwen2"))
    drafter = tiny_causal_lm("qwen2", seed=3)
    vocabulary = DraftVocabulary(token_ids=EVEN, vocab_size=VOCAB, target_id=target.config._name_or_path,
                                 target_fingerprint=config_fingerprint(target))
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[1, 4]), mode="tiered", adaptive=False,
                         tau_accept=0.3, tau_escalate=0.1, vocabulary=vocabulary)
    recorder = PassRecorder({"target": target, "drafter": drafter})
    with recorder.recording():
        out = target.generate(prompt_ids, max_new_tokens=20, do_sample=False, assistant_model=drafter,
                              viasd_config=config, return_dict_in_generate=True)
    stats = out.viasd_stats
    passes = recorder.take()
    target_bodies = [p for p in passes if p.kind == "body" and p.model.startswith("target")]
    assert sum(p.layers == 6 for p in target_bodies) == stats.full_forwards
    assert sum(p.layers == 4 for p in target_bodies) == stats.slim_forwards > 0
    assert len(target_bodies) == stats.full_forwards + stats.slim_forwards
    drafter_bodies = [p for p in passes if p.kind == "body" and p.model.startswith("drafter")]
    assert len(drafter_bodies) == stats.drafter_forwards
    head_vocabularies = {(p.model.split()[0], p.vocab) for p in passes if p.kind == "head"}
    assert head_vocabularies == {("target", VOCAB), ("drafter", len(EVEN))}, "only the drafter's head is cut"
    full = [p for p in target_bodies if p.layers == 6]
    assert full[0].context == 0 and all(a.context < b.context for a, b in zip(full, full[1:]))


COSTS = {
    "device": "test",
    "models": {
        "target (float32)": {
            "body": [  # a prompt's passes (no context), then passes over 50 and 150 cached tokens
                {"width": 16, "context": 0, "full": 4.0, "per_layer": None, "layers": 6},
                {"width": 64, "context": 0, "full": 10.0, "per_layer": None, "layers": 6},
                {"width": 1, "context": 50, "full": 1.0, "per_layer": 0.1, "layers": 6},
                {"width": 5, "context": 50, "full": 2.0, "per_layer": 0.3, "layers": 6},
                {"width": 1, "context": 150, "full": 2.0, "per_layer": 0.2, "layers": 6},
                {"width": 5, "context": 150, "full": 3.0, "per_layer": 0.4, "layers": 6},
            ],
            "head": [{"rows": 1, "vocab": 96, "seconds": 0.5}, {"rows": 5, "vocab": 96, "seconds": 0.9},
                     {"rows": 1, "vocab": 48, "seconds": 0.25}],
        }
    },
}


def test_a_pass_is_priced_by_interpolating_the_grid_and_a_routed_pass_by_its_layers():
    costs = ModelCosts("target (float32)", COSTS["models"]["target (float32)"])
    assert costs.price(Pass("target (float32)", "body", 1, context=50, layers=6)) == pytest.approx(1.0)
    assert costs.price(Pass("target (float32)", "body", 3, context=100, layers=6)) == pytest.approx(2.0)
    assert costs.price(Pass("target (float32)", "body", 1, context=150, layers=4)) == pytest.approx(2.0 - 2 * 0.2)
    assert costs.price(Pass("target (float32)", "body", 40, context=0, layers=6)) == pytest.approx(7.0)
    assert costs.price(Pass("target (float32)", "head", 3, vocab=96)) == pytest.approx(0.7)
    assert costs.price(Pass("target (float32)", "head", 1, vocab=48)) == pytest.approx(0.25)
    with pytest.raises(KeyError, match="no head .* 12 rows of vocabulary"):
        costs.price(Pass("target (float32)", "head", 1, vocab=12))
    with pytest.raises(KeyError, match="no routed passes"):  # measured without skipping: no trace asked for it
        costs.price(Pass("target (float32)", "body", 40, context=0, layers=4))


def test_a_replay_sums_the_priced_passes_and_keeps_the_loop_seconds_as_recorded():
    passes = [Pass("target (float32)", "body", 5, context=50, layers=6, seconds=1.5),
              Pass("target (float32)", "head", 1, vocab=96, seconds=0.5)]
    calls = [CallTrace("greedy", 0, 0, seconds=3.0, new_tokens=4, passes=passes),
             CallTrace("greedy", 1, 0, seconds=3.0, new_tokens=4, passes=passes)]
    [method] = replay(calls, COSTS).values()
    assert method.loop == pytest.approx(2 * 1.0)
    assert method.projected == pytest.approx(2 * (1.0 + 2.0 + 0.5))
    assert method.projected_tokens_per_s == pytest.approx(8 / 7.0)
    assert method.error == pytest.approx(6.0 / 7.0 - 1)
    assert self_check({"greedy": method}) and not self_check({"greedy": method}, tolerance=0.2)
    with pytest.raises(KeyError, match="no costs for drafter"):
        replay([CallTrace("x", 0, 0, 1.0, 1, [Pass("drafter (float32)", "body", 1)])], COSTS)


@pytest.fixture
def traces(tmp_path, prompt_ids) -> Path:
    """A traces folder as ``viasd bench --traces`` writes it: greedy and lossless VIA-SD on a tiny pair."""
    target = enable_viasd(tiny_causal_lm("qwen2"))
    drafter = tiny_causal_lm("qwen2", seed=3)
    models = {"target": target, "drafter": drafter}
    config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]))
    writer = TraceWriter(tmp_path / "traces", models)
    recorder = PassRecorder(models)
    with recorder.recording():
        for method, extra in (("greedy", {}), ("viasd_lossless", {"assistant_model": drafter, "viasd_config": config})):
            started = time.perf_counter()
            out = target.generate(prompt_ids, max_new_tokens=12, do_sample=False, **extra)
            seconds = time.perf_counter() - started
            writer.write(CallTrace(method, 0, 0, seconds, out.shape[1] - prompt_ids.shape[1], recorder.take()))
    return tmp_path / "traces"


def test_costs_measured_here_price_every_traced_pass_and_the_command_prints_each_method(traces, tmp_path, capsys):
    costs_file = tmp_path / "costs.json"
    assert main(["replay", str(traces), "--measure-costs", str(costs_file), "--repeats", "1"]) == 0
    costs = json.loads(costs_file.read_text())
    assert set(costs["models"]) == {"target (float32)", "drafter (float32)"}
    models, calls = read_traces(traces)
    projected = replay(calls, costs)
    assert list(projected) == ["greedy", "viasd_lossless"] and all(m.projected > 0 for m in projected.values())
    capsys.readouterr()
    assert main(["replay", str(traces), "--costs", str(costs_file)]) == 0
    table = capsys.readouterr().out
    assert "| greedy |" in table and "| viasd_lossless |" in table and "target (float32) body" in table


def test_replay_refuses_a_folder_without_traces_and_asks_for_one_of_its_two_modes(tmp_path, capsys):
    assert main(["replay", str(tmp_path)]) == 2
    assert "either --costs FILE" in capsys.readouterr().err
    assert main(["replay", str(tmp_path), "--costs", "x.json"]) == 2
    assert "viasd bench ... --traces" in capsys.readouterr().err


def test_the_gpu_script_measures_on_cpu_without_importing_viasd_hf(traces, tmp_path):
    """bench/gpu_costs.py must run where only torch and transformers are installed: here, in a fresh interpreter,
    nothing of viasd_hf may be imported, and its costs must price the traces."""
    out = tmp_path / "cpu.json"
    check = (
        "import runpy, sys; "
        f"sys.argv = ['gpu_costs.py', {str(traces)!r}, '--device', 'cpu', '--out', {str(out)!r}, '--repeats', '1']; "
        f"runpy.run_path({str(REPO / 'bench' / 'gpu_costs.py')!r}, run_name='__main__')"
    )
    script = f"import sys\ntry:\n    {check}\nexcept SystemExit as e:\n    assert not e.code\n" \
             "assert not [m for m in sys.modules if m.startswith('viasd_hf')], 'viasd_hf was imported'\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    _, calls = read_traces(traces)
    assert replay(calls, json.loads(out.read_text()))["greedy"].projected > 0


def test_a_loaded_trace_is_the_trace_written(traces):
    models, calls = read_traces(traces)
    assert {m["role"] for m in models.values()} == {"target", "drafter"}
    assert models["target (float32)"]["config"]["num_hidden_layers"] == 6
    lines = (traces / "runs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [json.loads(call.to_json()) for call in calls]


def test_a_models_form_is_its_dtype_or_the_quantisation_transformers_loaded_it_with():
    model = tiny_causal_lm("qwen2", dtype=torch.bfloat16)
    assert form_of(model) == "bfloat16"
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    assert form_of(model) == "bnb-4bit"
    model.config.quantization_config = {"quant_method": "torchao", "quant_type": "int4_weight_only"}
    assert form_of(model) == "torchao" and model_key("drafting copy", model) == "drafting copy (torchao)"


def test_a_replay_takes_the_loop_per_target_pass_where_the_costs_measured_it():
    passes = [Pass("target (float32)", "body", 5, context=50, layers=6, seconds=1.5),
              Pass("target (float32)", "head", 1, vocab=96, seconds=0.5),
              Pass("drafter (float32)", "body", 1, context=50, layers=6, seconds=0.0)]
    costs = COSTS | {"models": COSTS["models"] | {"drafter (float32)": COSTS["models"]["target (float32)"]},
                     "loop": {"viasd_lossless": {"per_target_pass": 0.25}}}
    calls = [CallTrace("greedy", 0, 0, seconds=3.0, new_tokens=4, passes=passes[:2]),
             CallTrace("viasd_lossless", 0, 0, seconds=3.0, new_tokens=4, passes=passes + passes[:1])]
    methods = replay(calls, costs)
    assert calls[1].target_passes == 2  # the drafter's body is no step of the target
    assert methods["greedy"].projected_loop == pytest.approx(1.0)  # not measured there: as recorded
    assert methods["viasd_lossless"].projected_loop == pytest.approx(2 * 0.25)
    assert methods["viasd_lossless"].loop == pytest.approx(3.0 - 3.5)


def test_the_loop_is_measured_per_traced_method_on_random_weights(traces, tmp_path):
    from viasd_hf.bench.loop_costs import measure_loop

    measured = measure_loop(traces, "cpu", repeats=1, new_tokens=6, record=tmp_path / "here", progress=lambda _: None)
    assert list(measured) == ["greedy", "viasd_lossless"]
    assert all(m["per_target_pass"] > 0 for m in measured.values())
    _, calls = read_traces(tmp_path / "here")  # the timed calls, as traces: a replay on this device's costs checks them
    assert [(c.method, c.new_tokens) for c in calls] == [("greedy", 6), ("viasd_lossless", 6)]
    for call in calls:
        assert measured[call.method]["per_target_pass"] == pytest.approx(call.loop_seconds / call.target_passes)
    costs_file = tmp_path / "costs.json"
    assert main(["replay", str(traces), "--measure-costs", str(costs_file), "--repeats", "1", "--loop"]) == 0
    costs = json.loads(costs_file.read_text())
    assert set(costs["loop"]) == {"greedy", "viasd_lossless"}
    assert main(["replay", str(traces), "--costs", str(costs_file), "--loop"]) == 2


def test_the_gpu_script_measures_slim_passes_of_configs_without_traces(tmp_path):
    config = tiny_causal_lm("qwen2").config.to_dict()
    config["num_hidden_layers"] = 8
    config.pop("layer_types", None)
    (tmp_path / "tiny.json").write_text(json.dumps(config))
    out = tmp_path / "curves.json"
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_costs.py"), "--shapes", str(tmp_path / "tiny.json"),
                           "--device", "cpu", "--dtype", "float32", "--out", str(out), "--repeats", "1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(out.read_text())["slim_curves"]["tiny"]
    assert [(row["budget"], row["width"]) for row in rows] == [(b, w) for w in (1, 6) for b in (0.15, 0.25, 0.35, 0.45)]
    assert [row["skipped"] for row in rows[:4]] == [1, 2, 3, 4] and all(row["c"] > 0 for row in rows)


@pytest.mark.parametrize("keyword", ["past_key_values", "none"])
def test_costs_hand_a_body_its_cache_under_its_own_keyword_and_refuse_one_that_ignores_it(keyword):
    from viasd_hf.bench import pass_costs

    model = tiny_causal_lm("qwen2")
    body = model.get_decoder()
    original = type(body).forward

    def forward(self, input_ids=None, past_key_values=None, **kwargs):  # transformers before 5.24 named it so
        cache = {"cache": past_key_values} if keyword == "past_key_values" else {}
        return original(self, input_ids=input_ids, **cache, **kwargs)

    body.__class__ = type("OldBody", (type(body),), {"forward": forward})
    timer = pass_costs.Timer("cpu", 1)
    if keyword == "none":
        with pytest.raises(RuntimeError, match="did not write its KV cache"):
            pass_costs.body_costs(model, [1], [4], timer, "cpu", routed=False)
    else:
        [row] = pass_costs.body_costs(model, [1], [4], timer, "cpu", routed=False)
        assert row["context"] == 4 and row["full"] > 0


def test_a_slow_first_call_is_timed_again_and_the_second_time_kept():
    from viasd_hf.bench import pass_costs

    timer = pass_costs.Timer("cpu", repeats=5, long=0.05)
    calls = []

    def run():  # a first call with a setup no later call pays, as a GPU's first pass of a new shape
        calls.append(None)
        time.sleep(0.2 if len(calls) == 1 else 0.0)

    assert timer(run) < 0.05 and len(calls) == 2
    calls.clear()
    assert timer(lambda: (calls.append(None), time.sleep(0.06))) >= 0.06 and len(calls) == 2  # truly slow: once more only

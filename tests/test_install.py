"""A lean install: ``pip install viasd_hf`` alone runs ``generate`` and ``viasd --help``, a feature that needs an
optional package names the extra that installs it, and nothing prints what a library says on its own as it is
imported or as it deprecates: only results and progress.

"Not installed" is played in a subprocess whose import system cannot find the optional packages (neither to import
them nor for transformers' checks of what is installed), as in an environment without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from conftest import tiny_causal_lm
from viasd_hf.extras import MissingExtraError, quietly, require
from viasd_hf.models.quantization import MeasureOptions, cached_measure

ROOT = Path(__file__).resolve().parents[1]
# by module name, what the extras bring that viasd_hf or transformers would import: none is in a lean install
OPTIONAL = ("torchao", "bitsandbytes", "accelerate", "peft", "skopt", "sklearn", "scipy", "threadpoolctl",
            "sacrebleu", "rouge_score", "nltk", "matplotlib", "psutil", "gguf")  # fmt: skip
UNINSTALLED = """
import importlib.machinery, sys
class _Uninstalled(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        return None if name.partition(".")[0] in {hidden!r} else super().find_spec(name, path, target)
sys.meta_path[:] = [_Uninstalled if finder is importlib.machinery.PathFinder else finder for finder in sys.meta_path]
"""


def python(code: str, tmp_path: Path, hidden: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``python -c code`` from the repository root (this checkout's viasd_hf), offline, caches under ``tmp_path``."""
    prelude = UNINSTALLED.format(hidden=set(hidden)) if hidden else ""
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VIASD_HOME": str(tmp_path / "home"),
                        "VIASD_MASKS_DIR": str(tmp_path / "masks"), "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


def test_the_api_and_the_command_line_import_without_any_optional_package(tmp_path):
    done = python(f"""
        import sys
        import viasd_hf, viasd_hf.generation, viasd_hf.cli
        from viasd_hf.cli import main
        assert main(["--help"]) == 0
        print(sorted(m for m in sys.modules if m.partition(".")[0] in {set(OPTIONAL)!r}))
    """, tmp_path, hidden=OPTIONAL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == "" and "usage: viasd" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]", "no optional package imported"


def test_a_feature_without_its_optional_package_names_the_extra_that_installs_it(tmp_path):
    done = python("""
        import json, tempfile
        from viasd_hf.cli import main
        from viasd_hf.extras import MissingExtraError

        def message(call):
            try:
                call()
            except MissingExtraError as error:
                return str(error)
            return "no error"

        def quantised():
            from viasd_hf.models.loading import load_pretrained
            load_pretrained("unused", quantization="bnb-4bit")

        def search():
            from viasd_hf.dimr.proposals import Proposals
            Proposals([1, 2, 3], k=1, seed=0)

        def bench():
            import viasd_hf.bench.runner

        def plots():
            from viasd_hf.bench.report import plots
            plots({}, tempfile.mkdtemp())

        def zoo():
            from viasd_hf.models.zoo import resolve_zoo_model
            resolve_zoo_model("smollm2-135m-instruct")  # not built yet: missing, said before any download

        features = {"quant": quantised, "search": search, "bench": bench, "plots": plots, "zoo": zoo}
        print(json.dumps({name: message(call) for name, call in features.items()}))
        print("exit", main(["bench", "--target", "smollm2-135m-instruct", "--methods", "greedy"]))
    """, tmp_path, hidden=OPTIONAL)  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    messages = json.loads(lines[0])
    assert messages == {
        "quant": "quantization scheme 'bnb-4bit' needs the optional package bitsandbytes: "
                 "pip install 'viasd_hf[quant]'",
        "search": "DIMR's Bayesian optimisation (viasd search) needs the optional package scikit-optimize: "
                  "pip install 'viasd_hf[search]'",
        "bench": "viasd bench needs the optional package sacrebleu: pip install 'viasd_hf[bench]'",
        "plots": "viasd bench --plots needs the optional package matplotlib: pip install 'viasd_hf[bench]'",
        "zoo": "converting the built-in model 'smollm2-135m-instruct' needs the optional package gguf: "
               "pip install 'viasd_hf[zoo]'",
    }  # fmt: skip
    # a subcommand says it in one line, not a traceback
    assert lines[1] == "exit 1"
    assert done.stderr == f"viasd bench: error: {messages['bench']}\n"


def test_import_and_help_print_nothing_of_the_libraries(tmp_path):
    """With every extra installed (this environment): torchao, imported by transformers' models where it is
    installed, logs the kernels it cannot load, and torch's pytree logs torchao's deprecated registrations."""
    done = python("""
        import viasd_hf
        from viasd_hf.cli import main
        main(["--help"])
    """, tmp_path)  # fmt: skip
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("usage: viasd")


def test_a_first_generate_prints_its_result_only(tmp_path):
    """A user's first call: the drafter's fastest form is measured on this machine (every installed quantisation
    library imported, its copies made and timed); then HF assisted generation as the ``viasd`` commands run it."""
    done = python("""
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM
        from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd
        from viasd_hf.extras import hide_assisted_generation_deprecation

        def tiny(layers, seed):
            torch.manual_seed(seed)
            config = AutoConfig.for_model("llama", vocab_size=96, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                          pad_token_id=0, bos_token_id=1, eos_token_id=2)
            return AutoModelForCausalLM.from_config(config).eval()

        target, drafter = enable_viasd(tiny(6, 0)), tiny(2, 1)
        ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
        from viasd_hf.control.speculation_switch import SpeculationSwitch
        SpeculationSwitch.clearly_loses = lambda self: False  # tiny models on a busy CPU: no advice to give here
        config = ViaSDConfig(routing_mask=RoutingMask.from_model(target, skip=[2]))
        ours = target.generate(ids, assistant_model=drafter, viasd_config=config, max_new_tokens=8, do_sample=False)
        hide_assisted_generation_deprecation()
        theirs = target.generate(ids, assistant_model=drafter, viasd_config=None, max_new_tokens=8, do_sample=False)
        print(ours.tolist() == theirs.tolist())
    """, tmp_path)  # fmt: skip
    assert (done.returncode, done.stderr, done.stdout) == (0, "", "True\n")
    assert list((tmp_path / "home" / "quantization").glob("*architecture*.json")), "the drafter's forms were measured"


def test_measuring_a_model_shows_progress_and_no_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    options = MeasureOptions(prompts=2, prompt_tokens=16, context=16, repeats=2, threads=1)
    cached_measure(tiny_causal_lm("llama"), ["fp32"], options)
    captured = capsys.readouterr()
    assert captured.out == "" and "| fp32 |" not in captured.err


def test_quietly_holds_back_warnings_and_library_logs_and_keeps_the_filters_an_import_adds(caplog):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quietly():
            warnings.warn("held back")
            warnings.filterwarnings("ignore", message="a filter a library adds as it is imported")
            import logging

            logging.getLogger("torchao").warning("Failed to load a kernel library")
        warnings.warn("a user's own warning")
        assert any(f[1] is not None and f[1].pattern == "a filter a library adds as it is imported"
                   for f in warnings.filters)  # fmt: skip
    assert [str(w.message) for w in shown] == ["a user's own warning"]
    assert "Failed to load" not in caplog.text


def test_require_returns_the_module_or_names_the_extra():
    assert require("json", "none", "a test") is json
    with pytest.raises(MissingExtraError, match=r"^a test needs the optional package viasd_no_such_module: "
                                                r"pip install 'viasd_hf\[search\]'$"):  # fmt: skip
        require("viasd_no_such_module.part", "search", "a test")

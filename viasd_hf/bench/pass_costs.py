"""What each kind of pass a trace holds costs on a device, measured on models built from their configs.

A dense model's pass costs what its shapes cost, whatever its weights hold, so the models are
built from the traced configs (``models.json`` of a traces folder, :mod:`viasd_hf.bench.traces`)
with random weights: no weights, no network. Measured per traced model, in its traced form (fp32,
bf16, fp16, or the quantisation transformers loaded it with, bitsandbytes or torchao, where that
library runs):

- the decoder body over ``width`` new tokens after ``context`` cached ones, with every layer and
  with half of them skipped (a routed pass's cost is linear in the layers it runs);
- the LM head over ``rows`` rows for ``vocab`` logits (a draft vocabulary's head is a slice).

This module needs only torch and transformers, so that ``bench/gpu_costs.py`` can load it by
path on a machine where nothing else of viasd_hf is installed.
"""

from __future__ import annotations

import inspect
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

WIDTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
UNQUANTIZED = ("float32", "bfloat16", "float16")
PREFILL_POINTS = 3  # grid widths inside the range of a trace's prompt passes


def traced_needs(folder: str | Path) -> tuple[dict[str, dict], dict[str, dict[str, list]]]:
    """``(models, needs)`` of a traces folder (:mod:`viasd_hf.bench.traces`: ``models.json`` and ``runs.jsonl``, read
    as plain JSON): each traced model's config and form, and what its passes had, which the costs must cover: the
    widths (tokens × rows) of passes over an empty cache (a prompt) and of the others with their cache lengths, the
    layers run and the head shapes (rows, vocabulary)."""
    folder = Path(folder)
    models = json.loads((folder / "models.json").read_text())
    wanted: dict[str, dict[str, set]] = {}
    calls = [json.loads(line) for line in (folder / "runs.jsonl").read_text().splitlines() if line.strip()]
    for p in (p for call in calls for p in call["passes"]):
        want = wanted.setdefault(p["model"], {"prefills": set(), "widths": set(), "contexts": set(), "heads": set(),
                                              "layers": set()})
        if p["kind"] == "body" and p["context"] == 0:
            want["prefills"].add(p["width"] * p["batch"])
            want["layers"].add(p["layers"])
        elif p["kind"] == "body":
            want["widths"].add(p["width"] * p["batch"])
            want["contexts"].add(p["context"])
            want["layers"].add(p["layers"])
        else:
            want["heads"].add((p["width"], p["vocab"]))
    return models, {key: {name: sorted(values) for name, values in want.items()} for key, want in wanted.items()}


def grid_widths(widths: Iterable[int], points: int | None = None) -> list[int]:
    """The grid points that bracket every width a trace fed (interpolation needs one on each side); with ``points``,
    at most that many inside (a prompt's pass costs about linearly in its width, and a wide one takes seconds)."""
    widths = sorted(set(widths))
    if not widths:
        return []
    inside = [w for w in WIDTHS if widths[0] <= w <= widths[-1]]
    if points is not None and len(inside) > points:
        inside = [inside[round(k * (len(inside) - 1) / (points - 1))] for k in range(points)]
    chosen = set(inside)
    chosen |= {max([w for w in WIDTHS if w <= widths[0]], default=WIDTHS[0])}
    chosen |= {min([w for w in WIDTHS if w >= widths[-1]], default=widths[-1])}
    return sorted(chosen)


def grid_contexts(contexts: Iterable[int], points: int = 3) -> list[int]:
    """``points`` cache lengths spread over those a trace ran after (its shortest and longest included)."""
    contexts = sorted(set(contexts))
    if not contexts:
        return []
    low, high = contexts[0], contexts[-1]
    if high - low < points:
        return sorted({low, high})
    return sorted({round(low + (high - low) * k / (points - 1)) for k in range(points)})


def build(described: dict[str, Any], device: str) -> nn.Module:
    """A causal LM shaped by ``described["config"]`` with random weights, in ``described["form"]``, on ``device``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(described["config"])
    quantization = config_dict.pop("quantization_config", None)
    config = AutoConfig.for_model(**config_dict)
    form = described["form"]
    if form in UNQUANTIZED:
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it runs: a 32B model's random weights take seconds on a GPU
            return AutoModelForCausalLM.from_config(config, dtype=getattr(torch, form)).eval()
    if quantization is None:
        raise ValueError(f"cannot build a model in form {form!r} without its quantization_config in the traced config")
    from transformers.quantizers.auto import AutoQuantizationConfig

    dtype = getattr(torch, str(quantization.get("bnb_4bit_compute_dtype", described.get("dtype", "bfloat16")))
                    .removeprefix("torch."))
    torch.manual_seed(0)
    dense = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with tempfile.TemporaryDirectory(prefix="viasd-costs-") as folder:  # transformers quantises while loading
        dense.save_pretrained(folder)
        del dense
        model = AutoModelForCausalLM.from_pretrained(
            folder, quantization_config=AutoQuantizationConfig.from_dict(quantization), dtype=dtype, device_map=device
        )
    return model.eval()


class Timer:
    """Seconds of a callable on ``device``: synchronised on CUDA, the median of ``repeats`` after one warm-up; a call
    whose warm-up took over ``long`` seconds is timed once more, and that second time kept (a prompt's pass with
    emulated bf16 takes a minute; a GPU's first pass of a new shape can take a second of kernel setup, which no
    later pass pays)."""

    def __init__(self, device: str, repeats: int, long: float = 1.0) -> None:
        self.cuda = device.startswith("cuda")
        self.repeats = repeats
        self.long = long

    def once(self, run: Callable[[], Any], after: Callable[[], Any] = lambda: None) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        run()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        after()
        return seconds

    def __call__(self, run: Callable[[], Any], after: Callable[[], Any] = lambda: None) -> float:
        if self.once(run, after) > self.long:
            return self.once(run, after)
        return statistics.median(self.once(run, after) for _ in range(self.repeats))


def _filled(body: nn.Module, cache: Any, ids: torch.Tensor) -> torch.Tensor:
    """Run ``body`` over ``ids`` on ``cache`` and check the cache took them: bodies of transformers before 5.24 take
    it as ``past_key_values``, and one handed a keyword it does not know would run without a cache, timing passes
    that attend to nothing before them."""
    before = cache.get_seq_length()
    keyword = "cache" if "cache" in inspect.signature(type(body).forward).parameters else "past_key_values"
    hidden = body(input_ids=ids, use_cache=True, **{keyword: cache}).last_hidden_state
    if cache.get_seq_length() != before + ids.shape[1]:
        raise RuntimeError(f"{type(body).__name__} did not write its KV cache: these costs would be of passes "
                           "without context")
    return hidden


@contextmanager
def _skipping(layers: nn.ModuleList, count: int) -> Iterator[None]:
    """Within this block the middle ``count`` layers are the identity (as a routed pass skips them)."""
    start = (len(layers) - count) // 2
    chosen = list(layers)[start : start + count]
    for layer in chosen:
        layer.forward = lambda hidden_states, *args, **kwargs: hidden_states
    try:
        yield
    finally:
        for layer in chosen:
            del layer.forward


def _crop(cache: Any, length: int) -> None:
    """Every layer of a DynamicCache back to ``length`` tokens (a skipped layer holds fewer already)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


@torch.inference_mode()
def body_costs(model: nn.Module, widths: list[int], contexts: list[int], timer: Timer, device: str,
               routed: bool = True) -> list[dict]:
    """Per (width, context): the body's seconds with every layer (``full``) and per layer run (``per_layer``, timed
    with half the layers skipped where ``routed``: some traced pass ran fewer than all; else ``None``)."""
    from transformers import DynamicCache

    body = model.get_decoder()
    layers = body.layers
    half = len(layers) // 2
    vocab = model.config.vocab_size
    rows = []
    for context in contexts:
        cache = DynamicCache(config=model.config)
        if context:
            _filled(body, cache, torch.randint(vocab, (1, context), device=device))
        for width in widths:
            ids = torch.randint(vocab, (1, width), device=device)

            def run() -> None:
                _filled(body, cache, ids)

            def crop() -> None:
                _crop(cache, context)

            full = timer(run, crop)
            per_layer = None
            if routed:
                with _skipping(layers, half):
                    slim = timer(run, crop)
                per_layer = max(full - slim, 0.0) / half
            rows.append({"width": width, "context": context, "full": full, "per_layer": per_layer,
                         "layers": len(layers)})
    return rows


@torch.inference_mode()
def head_costs(model: nn.Module, shapes: Iterable[tuple[int, int]], timer: Timer, device: str) -> list[dict]:
    """Per (rows, vocab): the LM head's seconds over ``rows`` hidden states for the first ``vocab`` of its rows."""
    head = model.get_output_embeddings()
    hidden_size = head.weight.shape[1]
    rows = []
    for count, vocab in sorted(set(shapes)):
        weight = head.weight[:vocab].contiguous()
        hidden = torch.randn(count, hidden_size, device=device, dtype=weight.dtype)
        seconds = timer(lambda: F.linear(hidden, weight).float())
        rows.append({"rows": count, "vocab": vocab, "seconds": seconds})
    return rows


@torch.inference_mode()
def slim_curve(model: nn.Module, budgets: Iterable[float], widths: Iterable[int], context: int, timer: Timer,
               device: str) -> list[dict]:
    """The cost ``c`` of a slim pass relative to a full one (the body with ``budget`` of its layers skipped, then the
    head over every row), per skip budget and width, after ``context`` cached tokens: full and slim passes timed in
    turn, ``c`` the median of their ratios (a drifting clock moves both alike)."""
    from transformers import DynamicCache

    body, head = model.get_decoder(), model.get_output_embeddings()
    layers = body.layers
    vocab = model.config.vocab_size
    cache = DynamicCache(config=model.config)
    _filled(body, cache, torch.randint(vocab, (1, context), device=device))
    rows = []
    for width in widths:
        ids = torch.randint(vocab, (1, width), device=device)

        def run() -> None:
            head(_filled(body, cache, ids))

        def crop() -> None:
            _crop(cache, context)

        def slim(count: int) -> float:
            with _skipping(layers, count):
                return timer.once(run, crop)

        for budget in budgets:
            count = round(budget * len(layers))
            slim(count), timer.once(run, crop)  # warm-up
            pairs = [(timer.once(run, crop), slim(count)) for _ in range(timer.repeats)]
            rows.append({"budget": budget, "skipped": count, "layers": len(layers), "width": width, "context": context,
                         "full": statistics.median(f for f, _ in pairs), "slim": statistics.median(s for _, s in pairs),
                         "c": statistics.median(s / f for f, s in pairs)})
    return rows


def measure_costs(models: dict[str, dict], needs: dict[str, dict[str, list]], device: str, repeats: int = 3,
                  progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Costs of every traced model: ``needs[key]`` lists the body widths and contexts and the head (rows, vocab)
    shapes to measure (:func:`traced_needs`)."""
    timer = Timer(device, repeats)
    costs: dict[str, Any] = {"device": device_name(device), "torch": torch.__version__, "models": {}}
    for key, described in models.items():
        if key not in needs:
            continue
        progress(f"measuring {key} on {device} ...")
        model = build(described, device)
        want = needs[key]
        routed = min(want["layers"], default=0) < model.config.num_hidden_layers
        grids = [(grid_widths(want["prefills"], PREFILL_POINTS), [0])] if want["prefills"] else []
        grids += [(grid_widths(want["widths"]), grid_contexts(want["contexts"]))] if want["widths"] else []
        costs["models"][key] = {
            "body": [row for widths, contexts in grids for row in body_costs(model, widths, contexts, timer, device, routed)],
            "head": head_costs(model, [tuple(shape) for shape in want["heads"]], timer, device),
        }
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return costs


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {torch.get_num_threads()} threads"
    except OSError:
        pass
    return f"cpu, {torch.get_num_threads()} threads"


def write_costs(costs: dict[str, Any], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(costs, indent=1) + "\n")

"""Pass traces: every forward pass a decode made, so that its speed can be replayed on other pass costs.

A decoder's speed is the sum of its passes (who ran, over how many new tokens, after how much
context, through how many layers, with which head) plus the loop's own work between them. A trace
records exactly that for one timed call, from the outside, for every method alike: a forward hook
on each model's decoder body and on its LM head (and a wrapper on ``SubsetHead.spread``, the
draft-vocabulary head, which runs no module). ``viasd replay`` (:mod:`viasd_hf.bench.replay`)
then prices the same passes with costs measured elsewhere, a GPU included
(:mod:`viasd_hf.bench.pass_costs`), and keeps the loop's own seconds as recorded.

A run's file holds one JSON line per call (method, prompt, repeat, wall seconds, new tokens, passes);
``models.json`` beside it holds each traced model's config and form, which is all the cost
measurement needs: it builds the same shapes with random weights.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from viasd_hf.drafters.precision import drafting_copy, prompt_reader
from viasd_hf.masks.architectures import base_model, decoder_layers
from viasd_hf.masks.layer_skipping import skipped_layers_here
from viasd_hf.vocabulary.head import SubsetHead

RUNS_FILE = "runs.jsonl"
MODELS_FILE = "models.json"
TARGET_ROLE = "target"


@dataclass(frozen=True)
class Pass:
    """One forward pass of a decoder body (``kind="body"``) or of an LM head (``kind="head"``).

    A body pass fed ``width`` tokens in each of ``batch`` rows after ``context`` cached ones and ran
    ``layers`` decoder layers (fewer than the model has in a routed pass); a head pass turned
    ``width`` rows (all of the batch) into ``vocab`` logits each."""

    model: str  # a key of models.json: the role and the form, e.g. "drafter (bnb-4bit)"
    kind: str
    width: int
    batch: int = 1
    context: int = 0
    layers: int = 0
    vocab: int = 0
    seconds: float = 0.0


@dataclass
class CallTrace:
    """One timed call of one method on one prompt."""

    method: str
    prompt: int
    repeat: int
    seconds: float
    new_tokens: int
    passes: list[Pass] = field(default_factory=list)

    @property
    def loop_seconds(self) -> float:
        """The call's seconds outside every traced pass: the decoding loop's own work (and untraced small ops)."""
        return self.seconds - sum(p.seconds for p in self.passes)

    @property
    def target_passes(self) -> int:
        """The passes of the target's body (the prompt's, and each full or slim verification): the loop's steps."""
        return sum(1 for p in self.passes if p.kind == "body" and p.model.startswith(f"{TARGET_ROLE} ("))

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CallTrace:
        passes = [Pass(**p) for p in data.pop("passes")]
        return cls(**data, passes=passes)


def form_of(model: nn.Module) -> str:
    """The form a model's weights are in: the quantisation transformers loaded it with (bitsandbytes 4/8-bit, torchao),
    else its floating-point dtype."""
    quantization = getattr(base_model(model).config, "quantization_config", None)
    if quantization is None:
        return _dtype_of(model)
    settings = quantization if isinstance(quantization, dict) else quantization.to_dict()
    method = str(settings.get("quant_method", "quantized")).removeprefix("QuantizationMethod.").lower()
    if method == "bitsandbytes":
        return "bnb-4bit" if settings.get("load_in_4bit") else "bnb-8bit"
    return method


def _dtype_of(model: nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def model_key(role: str, model: nn.Module) -> str:
    return f"{role} ({form_of(model)})"


def _cache_length(kwargs: dict[str, Any]) -> int:
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return int(cache.get_seq_length()) if hasattr(cache, "get_seq_length") else 0


def _tokens_shape(args: tuple, kwargs: dict[str, Any]) -> tuple[int, int]:
    tokens = kwargs.get("input_ids", args[0] if args else None)
    if tokens is None:
        tokens = kwargs["inputs_embeds"]
    return int(tokens.shape[0]), int(tokens.shape[1])


class PassRecorder:
    """Hooks on the given models (``{role: model}``) that append every pass they run to ``passes``.

    A model reached under two roles (a drafter's copy shares modules with its twin) is traced once,
    under the first role. On CUDA each pass is timed between two synchronisations."""

    def __init__(self, models: dict[str, nn.Module]) -> None:
        self.models = {model_key(role, model): model for role, model in models.items()}
        self.passes: list[Pass] = []
        self._started: dict[int, tuple[float, int]] = {}
        self._sync = any(p.is_cuda for model in models.values() for p in model.parameters())

    def _now(self) -> float:
        if self._sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    @contextmanager
    def recording(self) -> Iterator[PassRecorder]:
        with ExitStack() as stack:
            heads: dict[int, str] = {}
            traced: set[int] = set()
            for key, model in self.models.items():
                body = base_model(model).get_decoder()
                head = base_model(model).get_output_embeddings()
                if id(body) not in traced:
                    traced.add(id(body))
                    stack.callback(body.register_forward_pre_hook(self._body_started(), with_kwargs=True).remove)
                    stack.callback(body.register_forward_hook(self._body_done(key, model), with_kwargs=True).remove)
                if head is not None and id(head) not in heads:
                    heads[id(head)] = key
                    stack.callback(head.register_forward_pre_hook(self._head_started()).remove)
                    stack.callback(head.register_forward_hook(self._head_done(key, head.weight.shape[0])).remove)
            stack.enter_context(self._subset_heads(heads))
            yield self

    def take(self) -> list[Pass]:
        """The passes recorded since the last ``take``."""
        passes, self.passes = self.passes, []
        return passes

    def _body_started(self):
        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
            self._started[id(module)] = (self._now(), _cache_length(kwargs))

        return hook

    def _body_done(self, key: str, model: nn.Module):
        layers = len(decoder_layers(model))

        def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
            started, context = self._started.pop(id(module))
            batch, width = _tokens_shape(args, kwargs)
            ran = layers - len(skipped_layers_here(model))
            self.passes.append(Pass(key, "body", width, batch, context, ran, 0, self._now() - started))

        return hook

    def _head_started(self):
        def hook(module: nn.Module, args: tuple) -> None:
            self._started[id(module)] = (self._now(), 0)

        return hook

    def _head_done(self, key: str, vocab: int):
        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            seconds = self._now() - self._started.pop(id(module))[0]
            rows = args[0].numel() // args[0].shape[-1]
            self.passes.append(Pass(key, "head", rows, vocab=vocab, seconds=seconds))

        return hook

    @contextmanager
    def _subset_heads(self, heads: dict[int, str]) -> Iterator[None]:
        """Time ``SubsetHead.spread`` (a draft vocabulary's head: a slice of the LM head, run without a module)."""
        original = SubsetHead.spread
        recorder = self

        def spread(head: SubsetHead, hidden: torch.Tensor) -> torch.Tensor:
            started = recorder._now()
            logits = original(head, hidden)
            key = heads.get(id(head.head))
            if key is not None:
                rows = hidden.numel() // hidden.shape[-1]
                recorder.passes.append(Pass(key, "head", rows, vocab=len(head.ids), seconds=recorder._now() - started))
            return logits

        SubsetHead.spread = spread
        try:
            yield
        finally:
            SubsetHead.spread = original


class TraceWriter:
    """A traces folder: the traced models' configs and forms, then one line per timed call."""

    def __init__(self, folder: str | Path, models: dict[str, nn.Module]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        described = {
            model_key(role, model): {"role": role, "form": form_of(model), "dtype": _dtype_of(model),
                                     "config": base_model(model).config.to_dict()}
            for role, model in models.items()
        }
        (self.folder / MODELS_FILE).write_text(json.dumps(described, indent=1, default=str) + "\n")
        (self.folder / RUNS_FILE).write_text("")

    def write(self, call: CallTrace) -> None:
        with open(self.folder / RUNS_FILE, "a") as handle:
            handle.write(call.to_json() + "\n")


def read_traces(folder: str | Path) -> tuple[dict[str, dict], list[CallTrace]]:
    """``(models, calls)`` of a traces folder written by :class:`TraceWriter`."""
    folder = Path(folder)
    for name in (MODELS_FILE, RUNS_FILE):
        if not (folder / name).is_file():
            raise FileNotFoundError(f"{folder} holds no {name}: record traces with `viasd bench ... --traces {folder}`")
    models = json.loads((folder / MODELS_FILE).read_text())
    lines = (folder / RUNS_FILE).read_text().splitlines()
    return models, [CallTrace.from_dict(json.loads(line)) for line in lines if line.strip()]


class CallTracer:
    """Records the passes of every timed call of a bench run into a traces folder (``viasd bench --traces``).

    ``models`` is asked for the models to trace when tracing starts, after the warm-up: a drafter's
    machine-chosen copy exists only once a first call made it."""

    def __init__(self, folder: str | Path, models: Callable[[], dict[str, nn.Module]]) -> None:
        self.folder = folder
        self.models = models
        self._writer: TraceWriter | None = None
        self._recorder: PassRecorder | None = None

    @contextmanager
    def tracing(self) -> Iterator[CallTracer]:
        models = self.models()
        self._writer = TraceWriter(self.folder, models)
        self._recorder = PassRecorder(models)
        with self._recorder.recording():
            yield self

    def start(self) -> None:
        """Forget passes run since the last call (none are expected; a call's trace holds its own only)."""
        self._recorder.take()

    def record(self, method: str, prompt: int, repeat: int, seconds: float, new_tokens: int) -> None:
        self._writer.write(CallTrace(method, prompt, repeat, seconds, new_tokens, self._recorder.take()))


def decoding_models(target: nn.Module, drafter: nn.Module) -> dict[str, nn.Module]:
    """The models a bench run decodes with: the pair, and the drafter's machine-chosen copy and its prompt reader
    where VIA-SD made them (:mod:`viasd_hf.drafters.precision`)."""
    models = {TARGET_ROLE: target, "drafter": drafter}
    copy = drafting_copy(drafter)
    if copy is not None:
        models["drafting copy"] = copy
        reader = prompt_reader(copy)
        if reader is not None:
            models["prompt reader"] = reader
    return models

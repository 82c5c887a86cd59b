"""One model serving several threads at once: VIA-SD (tiered and lossless, one prompt or a batch), plain greedy
``generate`` and HF assisted generation on the same model objects give their single-threaded outputs, and neither a
finished nor a failed call leaves anything on the model."""

from __future__ import annotations

import sys
import threading

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from conftest import VOCAB, near_copy, tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig, enable_viasd, routed
from viasd_hf.masks.architectures import decoder_layers

GREEDY = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=16)
THREADS, CALLS = 4, 6


@pytest.fixture(autouse=True)
def _one_thread_each(single_thread):
    """One intra-op thread per call, and frequent GIL hand-overs so that the calls interleave finely."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


@pytest.fixture(scope="module")
def models():
    target = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return enable_viasd(target), near_copy(target)


def prompt(seed: int) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 10), generator=torch.Generator().manual_seed(seed))


class FailingStreamer(BaseStreamer):
    """Raises on its third ``put``: a client that went away mid-decode."""

    def __init__(self) -> None:
        self.puts = 0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 3:
            raise ConnectionError("client went away")

    def end(self) -> None:
        pass


def batch_of_three(ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Three rows cut from ``ids`` (all of it, all but 3 tokens, all but 5), left-padded, with their attention mask."""
    rows = [ids[0], ids[0, 3:], ids[0, 5:]]
    padded = torch.zeros((len(rows), ids.shape[1]), dtype=torch.long)
    mask = torch.zeros_like(padded)
    for i, row in enumerate(rows):
        padded[i, ids.shape[1] - len(row) :], mask[i, ids.shape[1] - len(row) :] = row, 1
    return {"input_ids": padded, "attention_mask": mask}


def jobs(target, assistant):
    """Each kind of call, as a function of the prompt; its result or the exception it raised."""
    slim = RoutingMask.from_model(target, skip=[2])
    heavy = RoutingMask.from_model(target, skip=[1, 2, 3])
    tiered = ViaSDConfig.paper(routing_mask=slim, mode="tiered", adaptive=False)
    tiered_self = ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, mode="tiered", adaptive=False)
    lossless = ViaSDConfig.paper(routing_mask=slim, self_draft_mask=heavy, mode="lossless", adaptive=False)
    calls = {
        "viasd tiered, assistant": lambda ids: target.generate(ids, assistant_model=assistant, viasd_config=tiered,
                                                               **GREEDY),
        "viasd tiered, self-drafter": lambda ids: target.generate(ids, viasd_config=tiered_self, **GREEDY),
        "viasd lossless, self-drafter": lambda ids: target.generate(ids, viasd_config=lossless, **GREEDY),
        "viasd lossless, failing streamer": lambda ids: target.generate(ids, viasd_config=lossless,
                                                                        streamer=FailingStreamer(), **GREEDY),
        "viasd batch lossless, assistant": lambda ids: target.generate(
            **batch_of_three(ids), assistant_model=assistant, viasd_config=lossless, **GREEDY),
        "viasd batch tiered, self-drafter": lambda ids: target.generate(
            **batch_of_three(ids), viasd_config=tiered_self, **GREEDY),
        "plain greedy": lambda ids: target.generate(ids, **GREEDY),
        "hf assisted": lambda ids: target.generate(ids, assistant_model=assistant, **GREEDY),
    }

    def outcome(kind, ids):
        try:
            return calls[kind](ids)
        except ConnectionError as error:
            return repr(error)

    return list(calls), outcome


def assert_pristine(model, probe: torch.Tensor, logits: torch.Tensor) -> None:
    assert all("forward" not in vars(layer) for layer in decoder_layers(model))
    assert model.config._attn_implementation == "sdpa", "a steered call's attention switched back"
    with torch.no_grad():
        assert torch.equal(model(probe).logits, logits)


def test_threads_sharing_one_model_get_their_single_threaded_outputs(models):
    target, assistant = models
    probe = prompt(99)
    with torch.no_grad():
        logits = target(probe).logits
    kinds, outcome = jobs(target, assistant)
    plan = [[(kinds[(thread + call) % len(kinds)], call) for call in range(CALLS)] for thread in range(THREADS)]
    references = {(kind, seed): outcome(kind, prompt(seed)) for calls in plan for kind, seed in calls}
    assert sum(isinstance(result, str) for result in references.values()) > 0  # the failing calls fail
    results: dict[tuple[int, int], object] = {}
    start = threading.Barrier(THREADS)

    def serve(thread: int) -> None:
        start.wait()
        for index, (kind, seed) in enumerate(plan[thread]):
            results[thread, index] = outcome(kind, prompt(seed))

    workers = [threading.Thread(target=serve, args=(thread,)) for thread in range(THREADS)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    wrong = []
    for thread, calls in enumerate(plan):
        for index, (kind, seed) in enumerate(calls):
            got, expected = results.get((thread, index)), references[kind, seed]
            if isinstance(expected, str):
                same = got == expected
            else:
                same = isinstance(got, torch.Tensor) and torch.equal(got, expected)
            if not same:
                wrong.append(f"thread {thread} call {index} ({kind}, prompt {seed})")
    assert not wrong, f"{len(wrong)} of {THREADS * CALLS} calls differ from their single-threaded output: {wrong}"
    assert_pristine(target, probe, logits)


def test_plain_forward_in_another_thread_is_not_routed(models):
    target, _ = models
    probe = prompt(98)
    with torch.no_grad():
        full = target(probe).logits
        inside, outside = threading.Event(), threading.Event()
        seen = {}

        def plain() -> None:
            inside.wait()
            seen["logits"] = target(probe).logits
            outside.set()

        worker = threading.Thread(target=plain)
        worker.start()
        with routed(target, RoutingMask.from_model(target, skip=[1, 2, 3])):
            inside.set()
            outside.wait()
            slim = target(probe).logits
        worker.join()
    assert torch.equal(seen["logits"], full)
    assert not torch.equal(slim, full)
    assert_pristine(target, probe, full)


class Interrupt(StoppingCriteria):
    """Raises ``KeyboardInterrupt`` on the given call (a user pressing Ctrl-C mid-decode)."""

    def __init__(self, on_call: int) -> None:
        self.calls, self.on_call = 0, on_call

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.on_call:
            raise KeyboardInterrupt
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def interrupt_inside_a_routed_pass(model, on_call: int):
    """Hooks that raise ``KeyboardInterrupt`` in layer 3 of the ``on_call``-th pass that skips layer 2."""
    layers, state = decoder_layers(model), {"layer 2 ran": False, "routed passes": 0}

    def entering_layer_2(*_):
        state["layer 2 ran"] = False

    def layer_2_runs(*_):
        state["layer 2 ran"] = True

    def entering_layer_3(*_):
        if not state["layer 2 ran"]:
            state["routed passes"] += 1
            if state["routed passes"] == on_call:
                raise KeyboardInterrupt

    return [
        layers[2].register_forward_pre_hook(entering_layer_2),
        layers[2].mlp.register_forward_pre_hook(layer_2_runs),
        layers[3].register_forward_pre_hook(entering_layer_3),
    ]


@pytest.mark.parametrize("where", ["stopping criterion", "routed pass"])
def test_an_interrupt_mid_decode_leaves_the_model_pristine(models, where):
    target, assistant = models
    probe = prompt(97)
    with torch.no_grad():
        logits = target(probe).logits
    config = ViaSDConfig.paper(routing_mask=RoutingMask.from_model(target, skip=[2]),
                         self_draft_mask=RoutingMask.from_model(target, skip=[1, 2, 3]), mode="tiered", adaptive=False)
    expected = target.generate(prompt(5), viasd_config=config, **GREEDY)
    hooks = interrupt_inside_a_routed_pass(target, on_call=4) if where == "routed pass" else []
    criteria = StoppingCriteriaList([Interrupt(on_call=3)] if where == "stopping criterion" else [])
    try:
        with pytest.raises(KeyboardInterrupt):
            target.generate(prompt(5), viasd_config=config, stopping_criteria=criteria, **GREEDY)
    finally:
        for hook in hooks:
            hook.remove()
    assert_pristine(target, probe, logits)
    assert torch.equal(target.generate(prompt(5), viasd_config=config, **GREEDY), expected)

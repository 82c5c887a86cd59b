"""What a pair's calls learned is kept on disk per machine and read by a new process's first call, so it starts in the
regime that measured faster: a short answer does not spend its first blocks deciding."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import PassClock, tiny_causal_lm
from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.control import verdicts
from viasd_hf.control.speculation_switch import SpeculationSwitch

CONFIG = ViaSDConfig(use_slim=False)


@pytest.fixture
def pair(single_thread):
    target = enable_viasd(tiny_causal_lm("llama", seed=0))
    return target, tiny_causal_lm("llama", seed=0)  # the same weights: every draft is accepted


def call(pair, clock, max_new_tokens=12):
    target, drafter = pair
    ids = torch.randint(2, 96, (1, 10), generator=torch.Generator().manual_seed(0))
    out = target.generate(ids, assistant_model=drafter, viasd_config=CONFIG, max_new_tokens=max_new_tokens,
                          do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, viasd_config=None, max_new_tokens=max_new_tokens,
                                                      do_sample=False))
    return out.viasd_stats


def new_process(target) -> None:
    """What a new process has of the model: nothing kept on the object."""
    target.viasd_tier_memory.reset()


@pytest.mark.parametrize("drafter_cost, regime", [(0.001, "speculating"), (0.05, "plain decoding")])
def test_a_new_processs_first_call_starts_in_the_regime_measured_faster(pair, monkeypatch, drafter_cost, regime):
    target, drafter = pair
    with PassClock() as clock:
        clock.install(monkeypatch)
        clock.charge(target, 0.01).charge(drafter, drafter_cost)
        first = call(pair, clock, max_new_tokens=80)
        assert first.speculation_verdict.startswith(regime) and first.plain_blocks >= 2, "it began plainly, learning"
        assert len(list(verdicts.verdicts_home().glob("*.json"))) == 1
        new_process(target)
        short = call(pair, clock)
    if regime == "speculating":  # the short answer's blocks all speculate, the prompt's pass carrying a draft
        assert short.plain_blocks == 0 and short.drafted_tokens > 0
    else:  # no probe of speculation in a short answer: the drafter never runs
        assert short.plain_blocks == short.blocks and short.drafter_forwards == 0


def test_an_unreadable_verdict_is_ignored_and_replaced(pair, monkeypatch):
    target, drafter = pair
    with PassClock() as clock:
        clock.install(monkeypatch)
        clock.charge(target, 0.01).charge(drafter, 0.001)
        call(pair, clock, max_new_tokens=80)
        [path] = verdicts.verdicts_home().glob("*.json")
        for broken in ("{not json", json.dumps({"speculating": True, "pairs": ["x"]}), json.dumps([1, 2])):
            path.write_text(broken)
            new_process(target)
            stats = call(pair, clock)
            assert stats.plain_blocks >= 2, "it began plainly, as with nothing remembered"
            assert json.loads(path.read_text())["pairs"], "and kept what it learned"


def test_a_switch_resumes_what_it_made_durable():
    switch = SpeculationSwitch()
    for _ in range(40):
        speculated = switch.speculates()
        switch.observe(speculated, 3 if speculated else 1, 0.2 if speculated else 0.1)
    resumed = SpeculationSwitch()
    resumed.resume(json.loads(json.dumps(switch.durable())))
    assert resumed.speculating and resumed.speculates()
    assert resumed.speedup() == pytest.approx(switch.speedup())
    assert resumed.schedule.due_at == resumed.schedule.every, "the other regime is probed after a while, not at once"


def test_a_verdict_remembered_from_a_busy_hour_gives_way_to_what_this_process_measures(pair, monkeypatch, caplog):
    """An earlier process measured speculation at half plain decoding's speed beside a neighbour now gone: the new
    process starts plainly as told, then its own first pairs decide, and the user is not told it does not pay."""
    target, drafter = pair
    stale = SpeculationSwitch()
    stale.resume({"speculating": False, "pairs": [1.7, 3.0, 3.1, 2.1, 3.4], "tokens_speculative": 1.5,
                  "tokens_plain": 1.0, "reading": 0.4, "speculative": 0.6, "plain": 3.4})
    assert not stale.clearly_loses() and "remembered" in stale.describe()
    with PassClock() as clock:
        clock.install(monkeypatch)
        clock.charge(target, 0.01).charge(drafter, 0.001)
        call(pair, clock, max_new_tokens=12)  # learns the path; then the record is replaced by the stale one
        [path] = verdicts.verdicts_home().glob("*.json")
        path.write_text(json.dumps(stale.durable()))
        new_process(target)
        with caplog.at_level("WARNING", logger="viasd_hf"):
            stats = call(pair, clock, max_new_tokens=120)
    assert stats.speculation_verdict.startswith("speculating"), stats.speculation_switches
    assert stats.plain_blocks <= stale.schedule.every + 1, "the first probe's own pairs overturned the stale verdict"
    assert "does not pay" not in caplog.text
    assert json.loads(path.read_text())["speculating"]


def test_a_drafters_quantised_copy_keeps_its_verdict_apart_from_the_drafters():
    """The drafter as given and its 4-bit copy draft at different paces under one name, architecture and dtype: a
    process that drafted as given (before making the copy paid) must not leave its verdict to the copy, nor the copy
    to the drafter; the same drafter in a new process (another object) finds its own."""
    target = tiny_causal_lm("llama", seed=0)
    store = verdicts.VerdictStore(lambda: {"cpu": "test"})

    def path(drafter):
        return store.path(target, drafter, ("assistant", id(drafter), None, None, None))

    drafter, later, copy = (tiny_causal_lm("llama", seed=1) for _ in range(3))
    copy.config.quantization_config = {"quant_method": "torchao"}  # as a quantised model's config holds it
    assert path(drafter) == path(later) != path(copy)

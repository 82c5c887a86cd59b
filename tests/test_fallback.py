"""The floor under speculation: plain one-token decoding whenever speculating is measured slower.

The switch is tested on synthetic timings, and the decoder on tiny models whose passes are priced by a
``PassClock`` (a drafter's pass ten times the target's, say), so no decision depends on the machine or on
how busy it is.
"""

from __future__ import annotations

import random
import re

import pytest
import torch

from conftest import PassBursts, PassClock, assert_stats_consistent, tiny_causal_lm
from viasd_hf import ViaSDConfig, enable_viasd
from viasd_hf.control.backoff import ProbeSchedule
from viasd_hf.control.draft_planner import MeasuredCosts, StaticCosts
from viasd_hf.control.drafter_read import DrafterRead
from viasd_hf.control.faded import FadedMean, FadedSpread
from viasd_hf.control.fallback_advice import fallback_advice
from viasd_hf.control.speculation_switch import SOLID_COUNTS, SOLID_PAIRS, SpeculationSwitch
from viasd_hf.models.machine import emulated_bf16


def run(switch: SpeculationSwitch, blocks: int, speculative_rate: float, plain_rate: float) -> list[bool]:
    """Feed ``blocks`` blocks: a speculative block commits 3 tokens, a plain one 1, at the given tokens/s."""
    regimes = []
    for _ in range(blocks):
        speculated = switch.speculates()
        tokens = 3 if speculated else 1
        switch.observe(speculated, tokens, tokens / (speculative_rate if speculated else plain_rate))
        regimes.append(speculated)
    return regimes


def measured(switch: SpeculationSwitch, ratios: list[float]) -> None:
    """Pairs of ``ratios`` (a speculative block's seconds / a nearby plain block's), each of two blocks of its own,
    beside the tokens of ``SOLID_COUNTS`` speculative blocks, three each."""
    switch.pairs = list(ratios)
    switch.paired = [(2 * index, 2 * index + 1) for index in range(len(ratios))]
    for _ in range(SOLID_COUNTS):
        switch.tokens[True].observe(3, switch.count_decay)


def test_a_switch_starts_plain_and_stays_there_where_speculation_is_slower_probing_ever_more_rarely():
    switch = SpeculationSwitch()
    regimes = run(switch, 400, speculative_rate=8.0, plain_rate=10.0)
    assert not switch.speculating and not switch.switches
    assert regimes[:4] == [False, False, True, True], "plain decoding runs first, then a probe of speculation"
    late, early = regimes[200:], regimes[2:100]
    assert sum(late) / len(late) < sum(early) / len(early), "probes of speculation back off while they confirm"
    assert sum(regimes) < 0.1 * len(regimes)
    assert "10.00 tokens/s" in switch.verdict()


def test_a_switch_speculates_while_it_pays():
    switch = SpeculationSwitch()
    regimes = run(switch, 300, speculative_rate=12.0, plain_rate=10.0)
    assert switch.speculating
    assert [change["regime"] for change in switch.switches] == ["speculating"] and switch.switches[0]["block"] == 4
    assert sum(not regime for regime in regimes[4:]) <= 2 * 6, "only probes of plain decoding, backing off"


def test_a_switch_resumes_speculation_when_it_starts_paying():
    switch = SpeculationSwitch()
    run(switch, 50, speculative_rate=8.0, plain_rate=10.0)
    assert not switch.speculating
    run(switch, 200, speculative_rate=20.0, plain_rate=10.0)
    assert switch.speculating
    run(switch, 300, speculative_rate=5.0, plain_rate=10.0)
    assert [change["regime"] for change in switch.switches] == ["speculating", "plain"]


def test_plain_decoding_that_slows_below_what_speculation_measured_is_probed_early():
    """Between probes, plain decoding that slows below speculation's last measure (a burst of load, or a lasting
    change of costs) brings the next probe forward; a lasting change is confirmed by the probes' pairs of nearby
    blocks, and the switch speculates long before the backed-off schedule would have probed."""
    switch = SpeculationSwitch()
    run(switch, 80, speculative_rate=8.0, plain_rate=10.0)  # the verdict settles on four probes, then backs off
    next_probe = switch.schedule.due_at
    assert not switch.speculating and next_probe > 120
    run(switch, 60, speculative_rate=8.0, plain_rate=4.0)
    assert switch.speculating and switch.switches[0]["block"] < next_probe


@pytest.mark.parametrize("speculative_rate", [2.5, 5.0, 9.0])
def test_probing_a_losing_speculation_costs_at_most_the_budget(speculative_rate):
    """Where speculation loses (by 2.4x, as with emulated bf16, or by 10 %), probes still cost at most ``budget`` of the
    time plain decoding alone would take, the first probes aside: those that measure the ``SOLID_COUNTS`` speculative
    blocks a settled verdict rests on."""
    switch = SpeculationSwitch()
    regimes = run(switch, 3000, speculative_rate=speculative_rate, plain_rate=6.0)
    tokens = sum(3 if speculated else 1 for speculated in regimes)
    seconds = sum(3 / speculative_rate if speculated else 1 / 6.0 for speculated in regimes)
    first_probes_loss = SOLID_COUNTS * 3 * (1 / speculative_rate - 1 / 6.0)
    assert seconds - first_probes_loss <= (1 + switch.budget) * tokens / 6.0


def test_a_one_off_cost_makes_probes_rarer_without_counting_as_throughput():
    """The drafter reading the prompt before its first draft is paid once: it is no block's throughput, but a probe
    that must pay it again is a dearer probe."""
    cheap, dear = SpeculationSwitch(), SpeculationSwitch()
    for switch, one_off in ((cheap, 0.0), (dear, 2.0)):
        for block in range(4):
            speculated = switch.speculates()
            switch.observe(speculated, 3 if speculated else 1, 0.5 if speculated else 0.1,
                           one_off=one_off if speculated and block == 2 else 0.0)  # fmt: skip
    assert cheap.speculative.mean() == dear.speculative.mean() == pytest.approx(6.0)
    assert not cheap.speculating and not dear.speculating
    assert dear.schedule.due_at > cheap.schedule.due_at


def test_a_probe_of_speculation_counts_the_drafters_read_in_full_in_what_it_is_expected_to_lose():
    """Speculation a little slower than plain decoding (its blocks 5 % short) but a read of 2 s before the probe's
    first draft, in a call whose drafter has not read (no ``DrafterRead`` says it has): the probe costs the read
    whatever the rates, so the next one waits as long as the schedule allows
    (2 s is 2 % of 100 s, a thousand plain blocks of 0.1 s); without the read it comes after the doubled interval."""
    switches = {}
    for read in (0.0, 2.0):
        switch = SpeculationSwitch()
        for block in range(4):
            speculated = switch.speculates()
            switch.observe(speculated, 3 if speculated else 1, 3 / 9.5 if speculated else 0.1,
                           one_off=read if speculated and block == 2 else 0.0)  # fmt: skip
        switches[read] = switch
    assert not switches[2.0].speculating and switches[2.0].probe_loss() == pytest.approx(
        2 * (3 / 9.5) * (1 - 9.5 / 10) + 2.0)
    assert switches[2.0].schedule.interval == switches[2.0].schedule.longest
    assert switches[0.0].schedule.interval == switches[0.0].schedule.every, "one probe's verdict: checked again soon"


def test_a_block_the_length_limit_cut_short_counts_but_measures_nothing():
    """The last blocks of a call draft only what room is left: their pace is no measure of speculation's."""
    switch = SpeculationSwitch(speculating=True)
    switch.observe(True, 1, 1.0, cut_short=True)
    assert switch.block == 1 and switch.speculative.mean() is None and switch.speculating
    switch.observe(True, 1, 1.0)
    assert switch.speculative.mean() == pytest.approx(1.0)


def test_a_read_pays_only_where_speculating_over_the_tokens_left_saves_more_than_it_costs():
    switch = SpeculationSwitch()
    assert switch.reading_pays(None, 10) and switch.reading_cost(0.01, 100) is None, "nothing measured: read and learn"
    measured(switch, [1.0] * SOLID_PAIRS)  # evidence no single burst makes
    switch.speculative.add(20.0, 1.0)  # 20 tokens/s
    switch.plain.add(10.0, 1.0)  # 10 tokens/s: speculating saves 0.05 s a token
    switch.observe_reading(0.004, 0.01)  # the drafter reads a token in 0.4 of the target's prefill time for one
    read = switch.reading_cost(0.01, 250)
    assert read == pytest.approx(1.0)
    assert switch.reading_pays(read, 21) and not switch.reading_pays(read, 19)
    switch.observe_tail(0.5)  # a speculating batch's rows, finishing apart, lost half a second once per call
    assert switch.tail_cost() == pytest.approx(0.5)
    assert switch.reading_pays(read, 31) and not switch.reading_pays(read, 29)
    switch.speculative = FadedMean(5.0, 1.0)  # speculation slower than plain decoding: no read pays
    assert not switch.reading_pays(0.0, 1000)


def test_a_read_is_priced_at_the_speedup_the_switch_decides_on_not_at_throughputs_a_burst_moved():
    """Speculation runs 1.5x plain decoding; then a burst makes four speculative blocks five times slower. The switch
    goes on speculating (the pairs' median stands), and a read that speculating over the tokens left earns back at
    1.5x still pays. Priced at the throughputs, the speculative one dragged below the plain one by the burst, every
    read would be refused, however many tokens were left."""
    switch = SpeculationSwitch()
    run(switch, 40, speculative_rate=15.0, plain_rate=10.0)
    for _ in range(6):
        speculated = switch.speculates()
        tokens = 3 if speculated else 1
        switch.observe(speculated, tokens, tokens / (15.0 if speculated else 10.0) * (5 if speculated else 1))
    assert switch.speculating and switch.speedup() == pytest.approx(1.5)
    assert switch.speculative.mean() < switch.plain.mean(), "the throughputs say speculation loses"
    assert switch.plain_token_seconds() == pytest.approx(0.1)
    # a plain token costs 0.1 s and speculating saves a third of it: a 1 s read pays over 31 tokens, not over 29
    assert switch.reading_pays(1.0, 31) and not switch.reading_pays(1.0, 29)


def test_a_plain_verdict_on_thin_evidence_does_not_refuse_a_call_its_read():
    """Speculation measured slower on one pair, as a burst during a probe can make it: a call whose drafter must read
    first still reads and probes (a call that never read would never check); on solid evidence it does not."""
    switch = SpeculationSwitch()
    switch.speculative.add(5.0, 1.0)
    switch.plain.add(10.0, 1.0)
    measured(switch, [3.0])
    assert not switch.speculating and switch.reading_pays(1.0, 10)
    measured(switch, [3.0] * SOLID_PAIRS)
    assert not switch.reading_pays(1.0, 10_000)


def test_once_the_drafter_has_read_a_verdict_on_thin_evidence_is_checked_again_soon():
    """The first probe of speculation reads the prompts (2 s: twenty plain blocks) and a burst makes its blocks slow,
    so it decides on one pair that plain decoding is faster. A later probe in the same call feeds the drafter only the
    tokens decoded plainly since, so it comes after ``schedule.every`` blocks, not once the read would be earned back
    (``longest``); a call whose drafter has not read still waits for that."""
    intervals = {}
    for has_read in (True, False):
        switch = SpeculationSwitch()
        read = DrafterRead(switch)
        for block in range(4):
            speculated = switch.speculates()
            if speculated and not read.done and has_read:
                read.observe_read(2.0, 600)
            switch.observe(speculated, 3 if speculated else 1, 1.0 if speculated else 0.1,
                           one_off=2.0 if speculated and block == 2 else 0.0)  # fmt: skip
        assert not switch.speculating and len(switch.pairs) < SOLID_PAIRS
        intervals[has_read] = switch.schedule.interval
    assert intervals == {True: switch.schedule.every, False: switch.schedule.longest}


def test_a_burst_during_the_probe_that_read_the_prompt_does_not_keep_the_call_plain(pair, prompt_ids, clock):
    """The drafter's read of the prompt costs fifty target passes, and the first probe's two verifying passes run
    twenty times slower (a burst): plain decoding wins that probe on one pair. Every draft is accepted and a drafter
    pass costs a tenth of the target's, so the next probes, which read nothing, bring speculation back within the
    call; the output is greedy's."""
    target, drafter = pair
    wide = []  # the target's passes over more than one token: the prompt's, then the verifying ones

    def target_pass(tokens):
        if tokens > 1:
            wide.append(tokens)
        return 0.2 if tokens > 1 and len(wide) in (2, 3) else 0.01  # the first probe's two verifying passes

    clock.charge(target, target_pass).charge(drafter, lambda tokens: 0.5 if tokens > 4 else 0.001)
    out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=ViaSDConfig(use_slim=False),
                          max_new_tokens=160, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(prompt_ids, max_new_tokens=160, do_sample=False))
    stats = out.viasd_stats
    assert stats.speculation_switches[0]["block"] > 4, "the burst kept the first probe's verdict plain"
    assert stats.speculation_verdict.startswith("speculating"), stats.speculation_switches
    assert stats.plain_blocks <= 0.2 * stats.new_tokens, "plain blocks committed a few of the tokens"


def test_a_plain_verdict_a_burst_made_is_probed_early_in_the_next_process_before_its_rows_leave(clock):
    """A batch of three: during a process's call a burst makes every verifying pass twenty times dearer, so its probe
    gives a plain verdict on two pairs, kept for the next process. The burst is over. The next process resumes from
    that verdict, which would probe speculation only after sixteen blocks; its call's first row ends at its fifth
    token, and a batch stops probing once a row has left. The call probes within its first blocks all the same (each
    such call adds evidence), and decodes as greedy does."""
    burst = [True]
    ids = torch.randint(2, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    common = {"attention_mask": torch.ones_like(ids), "do_sample": False, "pad_token_id": 0}

    def call(max_new_tokens, eos_token_id=None):  # in a process of its own: a new target and drafter
        target, drafter = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)  # every draft accepted
        enable_viasd(target)
        clock.charge(target, lambda columns: 0.2 if burst[0] and columns > 1 else 0.01).charge(drafter, 0.001)
        out = target.generate(ids, assistant_model=drafter, viasd_config=ViaSDConfig(use_slim=False),
                              max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, return_dict_in_generate=True,
                              **common)
        expected = target.generate(ids, max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, viasd_config=None,
                                   **common)
        assert torch.equal(out.sequences, expected)
        return out.viasd_stats, expected[:, 12:]

    first, free = call(8)
    assert first.drafted_tokens and first.speculation_verdict.startswith("plain decoding"), "the burst's verdict"
    assert not re.search(rf"from ([{SOLID_PAIRS}-9]|\d\d+) adjacent pairs", first.speculation_verdict), "few pairs"
    burst[0] = False
    eos = int(free[0, 4])
    assert eos not in free[1:].flatten().tolist(), "the other rows decode on"
    second, _ = call(30, eos)
    assert min(entry["block"] for entry in second.rows_left) <= 6, "the first row left within the call's first blocks"
    assert second.drafted_tokens > 0, "the thin plain verdict was probed before the first row left"


@pytest.mark.parametrize("rows, first_call, unread, left", [(3, 24, 180, 24), (1, 80, 60, 8)])
def test_a_call_decodes_plainly_where_the_drafters_read_of_the_prompts_would_not_pay(clock, rows, first_call,
                                                                                     unread, left):
    """A call whose drafter must read long prompts at great cost, once the switch speculates: with few tokens left the
    read cannot be earned back, so the call decodes plainly without it (the drafter runs no pass) and says why; with
    many tokens left the same read pays and the call speculates. Output is greedy's either way. Whether to read is
    asked before the target's first pass (which could carry the first draft), so the read is priced against earlier
    calls' prefills (the first call begins plainly and a probe reads)."""
    target, drafter = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)  # every draft is accepted
    enable_viasd(target)
    clock.charge(target, 0.01)  # a pass of the target costs what drafting ten tokens does: speculation pays
    clock.charge(drafter, lambda tokens: 0.3 if tokens > 48 else 0.001)  # reading a 60-token prompt: 30 target passes
    ids = torch.randint(2, 96, (rows, 60), generator=torch.Generator().manual_seed(0))
    config = ViaSDConfig(use_slim=False)

    def call(max_new_tokens):
        out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, viasd_config=config,
                              max_new_tokens=max_new_tokens, do_sample=False, return_dict_in_generate=True)
        expected = target.generate(ids, attention_mask=torch.ones_like(ids), viasd_config=None,
                                   max_new_tokens=max_new_tokens, do_sample=False)
        assert torch.equal(out.sequences, expected)
        return out.viasd_stats

    learned = call(first_call)  # the drafter reads, and the switch learns what reading and blocks cost
    assert learned.drafter_forwards > 0 and learned.speculation_verdict.startswith("speculating")
    short = call(8)
    assert short.drafter_forwards == 0 and short.plain_blocks == short.blocks
    assert re.match(rf"plain decoding: the drafter would first read {unread} tokens \(about [\d.]+ s\), more than "
                    rf"speculating can save over the {left} tokens left \(speculative blocks", short.speculation_verdict)
    long = call(150)
    assert long.drafter_forwards > 0 and long.speculation_verdict.startswith("speculating")


def batch_with_a_row_ending_early(clock, max_new_tokens: int, ending_at: int):
    """A batch of three whose first row stops at its ``ending_at``-th token (its EOS), drafted by a copy of the target
    (every draft accepted), a target pass costing 0.01 s: the call's ``viasd_stats``."""
    target, drafter = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=0)
    enable_viasd(target)
    clock.charge(target, 0.01)
    ids = torch.randint(2, 96, (3, 12), generator=torch.Generator().manual_seed(0))
    free = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, viasd_config=None,
                           eos_token_id=None, do_sample=False)[:, ids.shape[1] :]
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                          max_new_tokens=max_new_tokens, eos_token_id=int(free[0, ending_at]), pad_token_id=0,
                          viasd_config=ViaSDConfig(use_slim=False), do_sample=False, return_dict_in_generate=True)
    return out.viasd_stats


def test_a_batchs_switch_measures_only_blocks_of_the_full_batch(clock, monkeypatch):
    """Rows leave a batch as they finish, so a block commits fewer tokens later in a call whichever regime runs it:
    the switch, remembered for this batch size, learns from the blocks every row took part in; once a row has
    left the regime it chose goes on without probes, and what those blocks lost is priced once, at the call's end."""
    observed = []
    observe = SpeculationSwitch.observe
    monkeypatch.setattr(SpeculationSwitch, "observe", lambda switch, *args, **kwargs: (
        observed.append(args), observe(switch, *args, **kwargs)))
    tails = []
    monkeypatch.setattr(SpeculationSwitch, "observe_tail", lambda switch, seconds: tails.append(seconds))
    stats = batch_with_a_row_ending_early(clock, max_new_tokens=40, ending_at=15)
    first_left = min(entry["block"] for entry in stats.rows_left)
    assert 0 < first_left < stats.blocks, "a row left before the call ended"
    assert len(observed) == first_left - 1, "every block after the first (the prompts' pass) until a row left"
    assert len(tails) == 1, "the speculative blocks after a row left priced what the call's end lost, once"


def test_a_batchs_planner_measures_pass_costs_only_while_every_row_decodes(clock, monkeypatch):
    """Once a row has left, a pass is fed fewer rows' tokens and costs less for them, the drafter's and the target's
    unalike: the costs the planner plans the full batch's drafts by are measured on the full batch's passes only."""
    measured = {"verifying": [], "drafting": []}
    for kind in measured:
        observe = getattr(MeasuredCosts, f"observe_{kind}")
        monkeypatch.setattr(MeasuredCosts, f"observe_{kind}", lambda costs, *args, kind=kind, observe=observe: (
            measured[kind].append(args), observe(costs, *args)))
    stats = batch_with_a_row_ending_early(clock, max_new_tokens=40, ending_at=15)
    first_left = min(entry["block"] for entry in stats.rows_left)
    assert 0 < first_left < stats.blocks - 2, "blocks ran after a row left"
    assert len(measured["verifying"]) == first_left - 1 and 0 < len(measured["drafting"]) <= first_left - 1, measured


def test_a_batchs_end_is_priced_per_row_so_rows_that_stopped_cost_nothing():
    """Two of a batch of four rows are left: a block of theirs that keeps the full batch's pace per row loses
    nothing, though it commits half a full block's tokens; one at half that pace loses half its time."""
    from types import SimpleNamespace

    from viasd_hf.engine.batch.learning import Learners

    def end_of_call(seconds, tokens):
        switch = SpeculationSwitch(speculating=True)
        switch.speculative.add(40.0, 1.0)  # the full batch committed 40 tokens/s: 10 a row
        call = SimpleNamespace(switch=switch, batch_size=4, tail=[0.0, 0.0])
        Learners.add_to_tail(call, seconds, tokens, rows=2)
        Learners.observe_tail(call)
        return switch.tail_cost()

    assert end_of_call(0.5, 10) == pytest.approx(0.0), "two rows, 10 tokens/s each: the full batch's pace per row"
    assert end_of_call(0.5, 5) == pytest.approx(0.25), "the rows left last kept fewer drafts: the end came later"


@pytest.mark.parametrize("speculated_first", [False, True])
def test_plain_blocks_at_a_batchs_end_lose_nothing(clock, monkeypatch, speculated_first):
    """Plain decoding advances every row alike, so a call's plain blocks after rows stopped (at their EOS, or apart
    after some speculative blocks) end it no later than plain decoding from the start would have: whether the call
    was plain throughout or went plain after speculating, its end prices nothing."""
    monkeypatch.setattr(SpeculationSwitch, "speculates", lambda switch: speculated_first and switch.block < 1)
    monkeypatch.setattr(SpeculationSwitch, "_other_is_faster", lambda switch: False)
    tails = []
    monkeypatch.setattr(SpeculationSwitch, "observe_tail", lambda switch, seconds: tails.append(seconds))
    stats = batch_with_a_row_ending_early(clock, max_new_tokens=40, ending_at=30)
    assert min(entry["block"] for entry in stats.rows_left) < stats.blocks, "a row left before the call ended"
    if speculated_first:
        assert stats.drafted_tokens and 0 < stats.plain_blocks < stats.blocks, "it speculated, then decoded plainly"
    else:
        assert stats.plain_blocks == stats.blocks
    assert tails == []


def test_the_user_is_told_speculation_does_not_pay_only_where_it_measured_clearly_slower():
    switch = SpeculationSwitch()
    assert not switch.clearly_loses(), "nothing measured"
    switch.plain.add(2.79, 1.0)
    switch.speculative.add(2.76, 1.0)  # a near tie, as a first short call measured it
    assert not switch.clearly_loses()
    switch.speculative = FadedMean(2.0, 1.0)
    assert switch.clearly_loses()


def test_the_user_is_not_told_speculation_does_not_pay_on_the_evidence_of_one_burst():
    """Speculation pays (1.5x) but the first probe's second block runs twenty times slower: pairs resting on that block
    say speculation runs at a tenth of plain decoding's pace, which a probe soon reverses. That is no reason to tell the
    user that speculation does not pay here; pairs on as many blocks as a solid verdict needs are."""
    switch = SpeculationSwitch()
    run_bursty(switch, [1.0, 1.0, 1.0, 20.0] + [1.0] * 4, speculative_rate=15.0, plain_rate=10.0)
    assert switch.speedup() < 0.2 and switch.blocks_paired() < SOLID_PAIRS
    assert not switch.clearly_loses()
    slower = SpeculationSwitch()
    run(slower, 200, speculative_rate=6.0, plain_rate=10.0)
    assert slower.blocks_paired() >= SOLID_PAIRS and slower.clearly_loses()


def test_a_probe_schedule_doubles_while_probes_confirm_and_resets_on_a_switch():
    schedule = ProbeSchedule(first=2, every=4, longest=16)
    assert not schedule.due(1) and schedule.due(2)
    schedule.confirmed(10)
    assert schedule.interval == 8 and schedule.due_at == 18
    schedule.confirmed(18)
    schedule.confirmed(34)
    assert schedule.interval == 16
    schedule.switched(40)
    assert schedule.interval == 4 and schedule.due_at == 44


@pytest.fixture
def clock(monkeypatch, single_thread):
    """A ``PassClock`` the decoding loops read; nothing charged, nothing costs. Tiny models run on one thread."""
    with PassClock() as clock:
        yield clock.install(monkeypatch)


@pytest.fixture
def pair():
    target = tiny_causal_lm("llama", seed=0)
    drafter = tiny_causal_lm("llama", seed=0)  # the same weights: every draft is accepted
    enable_viasd(target)
    return target, drafter


def test_a_drafter_too_slow_to_pay_gives_way_to_plain_decoding_with_the_same_output(pair, prompt_ids, clock, caplog):
    target, drafter = pair
    clock.charge(target, 0.005).charge(drafter, 0.05)
    expected = target.generate(prompt_ids, max_new_tokens=120, do_sample=False)
    with caplog.at_level("WARNING", logger="viasd_hf"):
        out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=ViaSDConfig(mode="lossless", use_slim=False),
                              max_new_tokens=120, do_sample=False, return_dict_in_generate=True)  # fmt: skip
    stats = out.viasd_stats
    assert torch.equal(out.sequences, expected)
    assert stats.plain_blocks > stats.blocks / 2
    assert not stats.speculation_switches, "decoding began plainly and a probe of speculation kept it there"
    assert stats.drafter_forwards > 0 and stats.speculation_verdict.startswith("plain decoding")
    assert any("speculation does not pay" in message for message in caplog.messages)
    assert_stats_consistent(stats, 120, "lossless")


def test_the_verify_cost_is_measured_from_plain_blocks_too(pair, prompt_ids, clock, monkeypatch):
    """The advice quotes the measured cost of a 6-token pass against a one-token pass. Where verifying costs grow with
    the tokens fed (20 ms a token, as where bf16 is emulated), pairs of plain blocks and a few probes' nearby blocks
    say so (about 6x), not the weight-byte guess (about 1x); and plain blocks (but the first, which reads the prompt)
    do feed it."""
    costs = MeasuredCosts(StaticCosts(drafter=0.5, per_token=0.03))
    for block in range(20):  # every third block a probe's, one draft: widths spread little, yet enough to fit
        costs.observe_verifying(*((0.042, 2) if block % 3 == 0 else (0.022, 1)))
    assert 5.0 < costs.verify_ratio() < 6.0  # (2 + 6 · 20) / (2 + 20) ms
    target, drafter = pair
    clock.charge(target, 0.005).charge(drafter, 0.05)
    widths = []
    observe = MeasuredCosts.observe_verifying
    monkeypatch.setattr(MeasuredCosts, "observe_verifying",
                        lambda self, seconds, tokens: widths.append(tokens) or observe(self, seconds, tokens))
    out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=ViaSDConfig(use_slim=False),
                          max_new_tokens=30, do_sample=False, return_dict_in_generate=True)  # fmt: skip
    assert out.viasd_stats.plain_blocks > 1 and widths.count(1) >= out.viasd_stats.plain_blocks - 1  # all but the first


def test_a_probe_of_plain_decoding_while_speculation_pays_gives_no_fallback_advice(pair, prompt_ids, clock,
                                                                                   monkeypatch, caplog):
    target, drafter = pair
    clock.charge(target, 0.01).charge(drafter, 0.001)  # a plain token costs a pass; so does a block of accepted drafts
    monkeypatch.setattr(SpeculationSwitch, "_blocks_to_earn_back", lambda self: 0)  # probes as often as scheduled
    with caplog.at_level("WARNING", logger="viasd_hf"):
        out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=ViaSDConfig(mode="lossless", use_slim=False),
                              max_new_tokens=300, do_sample=False, return_dict_in_generate=True)  # fmt: skip
    stats = out.viasd_stats
    assert stats.plain_blocks > 2, "after the first two plain blocks, plain decoding was probed while speculating"
    assert stats.speculation_verdict.startswith("speculating")
    assert not any("speculation does not pay" in message for message in caplog.messages)


@pytest.mark.parametrize("rows", [1, 3])
def test_only_the_blocks_the_length_limit_cut_short_are_kept_from_the_switch(pair, prompt_ids, single_thread, monkeypatch,
                                                                            rows):
    """The drafter (the target's twin) never stops on its own here, so every draft runs to the planner's bound or to
    the room left: blocks of the second kind, and only they, reach the switch as cut short."""
    target, drafter = pair
    observed = []
    observe = SpeculationSwitch.observe

    def spy(switch, speculated, tokens, seconds, one_off=0.0, cut_short=False):
        observed.append((speculated, tokens, cut_short))
        observe(switch, speculated, tokens, seconds, one_off, cut_short)

    monkeypatch.setattr(SpeculationSwitch, "observe", spy)
    monkeypatch.setattr(SpeculationSwitch, "speculates", lambda switch: True)
    ids = prompt_ids.repeat(rows, 1)
    config = ViaSDConfig.paper(mode="lossless", use_slim=False, num_draft_tokens=4, adaptive=True)
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, viasd_config=config,
                          max_new_tokens=40, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(ids, attention_mask=torch.ones_like(ids), viasd_config=None,
                                                      max_new_tokens=40, do_sample=False))
    speculative = [(tokens, cut_short) for speculated, tokens, cut_short in observed if speculated]
    assert speculative[-1][1] and not speculative[0][1], "the last block was cut short, the first was not"
    assert all(cut_short == (index == len(speculative) - 1) for index, (_, cut_short) in enumerate(speculative))


def test_a_reproducible_call_never_falls_back(pair, prompt_ids, clock):
    """Where timings may not steer a call (``reproducible=True``), every block drafts, however slow the drafter."""
    target, drafter = pair
    clock.charge(target, 0.001).charge(drafter, 0.01)
    config = ViaSDConfig(mode="lossless", use_slim=False, reproducible=True)
    out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=config, max_new_tokens=20, do_sample=False,
                          return_dict_in_generate=True)  # fmt: skip
    assert out.viasd_stats.plain_blocks == 0 and out.viasd_stats.speculation_verdict is None


def test_the_switch_is_remembered_so_the_next_call_starts_plain(pair, prompt_ids, clock):
    """A remembered fallback also skips the drafter's prefill: the drafter reads nothing until a probe needs it."""
    target, drafter = pair
    clock.charge(target, 0.005).charge(drafter, 0.05)
    config = ViaSDConfig(mode="lossless", use_slim=False)
    target.generate(prompt_ids, assistant_model=drafter, viasd_config=config, max_new_tokens=100, do_sample=False)
    out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=config, max_new_tokens=8, do_sample=False,
                          return_dict_in_generate=True)  # fmt: skip
    assert out.viasd_stats.plain_blocks == out.viasd_stats.blocks == 8
    assert out.viasd_stats.drafter_forwards == 0


def test_the_advice_names_emulated_bf16_only_for_a_bf16_model():
    model = tiny_causal_lm("llama", seed=0)
    assert "float32" not in fallback_advice(4.6, emulated_bf16(model))
    assert "4.6x a one-token pass" in fallback_advice(4.6, emulated_bf16(model))


def test_the_advice_says_what_to_do_where_bf16_is_emulated(monkeypatch):
    model = tiny_causal_lm("llama", seed=0, dtype=torch.bfloat16)
    monkeypatch.setattr("viasd_hf.models.machine.native_bf16", lambda: False)
    for ratio in (4.6, None):
        advice = fallback_advice(ratio, emulated_bf16(model))
        assert "a float32 target verifies several tokens" in advice and "viasd profile" in advice
    cheap_verify = fallback_advice(1.1, emulated_bf16(model))  # verifying costs little: the drafter, not bf16, is the trouble
    assert "emulated" not in cheap_verify and "1.1x a one-token pass" in cheap_verify and "drafter" in cheap_verify


def test_the_demo_says_why_where_viasd_decoded_mostly_plainly(monkeypatch):
    """From the target's measured passes: the cost of verifying in its own dtype, and the other dtypes' figures."""
    from types import SimpleNamespace

    from viasd_hf.bench.demo import Row, why_plain
    from viasd_hf.engine.stats import ViaSDStats

    monkeypatch.setattr("viasd_hf.models.machine.native_bf16", lambda: False)
    target = tiny_causal_lm("llama", seed=0, dtype=torch.bfloat16)
    measurements = [SimpleNamespace(scheme="bf16", decode_ms=240.0, verify_ms=991.0, decode_ratio=1.0),
                    SimpleNamespace(scheme="fp32", decode_ms=389.0, verify_ms=1118.0, decode_ratio=1.62)]
    rows = [Row("greedy"), Row("VIA-SD", stats={"code": ViaSDStats(blocks=54, plain_blocks=50),
                                                 "edit": ViaSDStats(blocks=63, plain_blocks=63)})]
    why = why_plain(target, rows, measurements)
    assert why.startswith("VIA-SD decoded 113 of its 117 blocks plainly")
    assert "4.1x a one-token pass" in why and "emulated" in why
    assert "in fp32 a one-token pass takes 389 ms (1.62x bf16's) and a 6-token pass 2.9x that" in why
    rows[1].stats["code"].plain_blocks = 0
    rows[1].stats["edit"].plain_blocks = 40
    assert why_plain(target, rows, measurements) is None  # most blocks speculated: nothing to explain


def bursts(blocks: int, seed: int) -> list[float]:
    """How much slower each block runs: 1, but in bursts of 1 to 8 blocks (about a fifth of all blocks) 5 to 20
    times, as when short-lived processes share the CPU."""
    generator, factors = random.Random(seed), []
    while len(factors) < blocks:
        if generator.random() < 0.06:
            factors += [generator.uniform(5, 20)] * generator.randint(1, 8)
        else:
            factors.append(1.0)
    return factors[:blocks]


def run_bursty(switch: SpeculationSwitch, factors: list[float], speculative_rate: float, plain_rate: float) -> list[bool]:
    """``run``, each block's seconds multiplied by its burst factor."""
    regimes = []
    for factor in factors:
        speculated = switch.speculates()
        tokens = 3 if speculated else 1
        switch.observe(speculated, tokens, factor * tokens / (speculative_rate if speculated else plain_rate))
        regimes.append(speculated)
    return regimes


@pytest.mark.parametrize("speculation_pays", [True, False])
def test_bursts_of_load_do_not_flip_the_switch(speculation_pays):
    """Blocks 5-20x slower for a while, at any moment (a probe included), over 20 runs of 600 blocks: the switch keeps
    the regime that counts and nearby blocks' costs say is faster for nearly all blocks, whichever regime that is. (A
    switch comparing throughputs measured apart, as this one did before, kept it for a median 79 % of blocks.)"""
    shares = []
    for seed in range(20):
        switch = SpeculationSwitch()
        regimes = run_bursty(switch, bursts(600, seed), speculative_rate=15.0 if speculation_pays else 7.0,
                             plain_rate=10.0)
        shares.append(sum(regime == speculation_pays for regime in regimes[8:]) / len(regimes[8:]))
        assert switch.speculating == speculation_pays
    assert sorted(shares)[10] >= 0.95 and min(shares) >= 0.8, sorted(shares)


def test_a_faded_spread_knows_how_many_counts_its_mean_rests_on_and_how_sure_it_is():
    spread = FadedSpread()
    assert spread.relative_error() is None and spread.blocks() == 0
    for count in (1, 3, 5, 3):
        spread.observe(count, decay=1.0)
    assert spread.mean() == 3 and spread.blocks() == pytest.approx(4)
    assert spread.relative_error() == pytest.approx((2 / 4) ** 0.5 / 3)  # the counts' variance is 2
    faded = FadedSpread()
    for _ in range(20):
        faded.observe(3, decay=0.5)
    assert faded.blocks() == pytest.approx(3, abs=1e-3) and faded.relative_error() == 0  # (1 + d) / (1 - d) at most


def chance_drafted(blocks: int, speedup: float, seed: int) -> list[tuple[int, float]]:
    """Speculative blocks as a 5-token chain draft makes them, each draft token accepted with chance 0.7: 1 to 6 tokens a
    block, 2.94 on average, at seconds that make speculation ``speedup`` times plain decoding's 0.2 s a token; each
    block's seconds 10 % above or below, as a real pass's are."""
    generator, blocks_made = random.Random(seed), []
    for _ in range(blocks):
        tokens = drafted_tokens(generator, kept=0.7)
        blocks_made.append((tokens, 2.94 * 0.2 / speedup * generator.uniform(0.9, 1.1)))
    return blocks_made


def drafted_tokens(generator: random.Random, kept: float) -> int:
    """The tokens a block of a 5-token chain draft commits, each draft token accepted with chance ``kept``."""
    accepted = 0
    while accepted < 5 and generator.random() < kept:
        accepted += 1
    return accepted + 1


@pytest.mark.parametrize("speedup, typical, worst", [(1.2, 0.7, 0.4), (1.5, 0.9, 0.8)])
def test_runs_of_badly_drafted_blocks_do_not_turn_speculation_off(speedup, typical, worst):
    """Speculation pays 1.2x or 1.5x on average, but a block commits 1 to 6 tokens as drafts happen to be accepted. A
    run of bad blocks brings the mean down now and then by chance; a switch that left speculation there kept it off
    until the regime's next probe, which came ever later: it speculated for a median 16 % and 78 % of blocks, 1 % at
    worst, over 20 seeds. Only a probe's evidence changes regime, on counts that fade slowly, and a verdict few counts
    or a near tie leave unsettled is checked again soon."""
    shares = []
    for seed in range(20):
        switch, drafted, regimes = SpeculationSwitch(), iter(chance_drafted(600, speedup, seed)), []
        timing = random.Random(-seed)
        for _ in range(600):
            speculated = switch.speculates()
            tokens, seconds = next(drafted) if speculated else (1, timing.uniform(0.18, 0.22))
            switch.observe(speculated, tokens, seconds)
            regimes.append(speculated)
        shares.append(sum(regimes[8:]) / len(regimes[8:]))
    assert sorted(shares)[10] >= typical and min(shares) >= worst, sorted(shares)


def test_a_lasting_drop_in_acceptance_is_followed_within_a_few_dozen_blocks():
    """Drafts kept 80 % of the time make speculation pay 1.6x (a block: one full pass and five drafter passes, 0.45 s
    against 0.2 s for a plain token); then the text changes and 30 % are kept: speculating costs 1.6x plain decoding.
    Counts that fade slowly follow such a change later than fast ones would (seven blocks at 0.85 a block, about
    twenty-five at 0.95), but the switch then decodes plainly, and stays so."""
    lags, shares = [], []
    for seed in range(20):
        switch, generator, regimes = SpeculationSwitch(), random.Random(seed), []
        for kept, blocks in ((0.8, 200), (0.3, 300)):
            for _ in range(blocks):
                speculated = switch.speculates()
                tokens = drafted_tokens(generator, kept) if speculated else 1
                seconds = (0.45 if speculated else 0.2) * generator.uniform(0.9, 1.1)
                switch.observe(speculated, tokens, seconds)
                regimes.append(speculated)
        after = regimes[200:]
        lags.append(next(block for block in range(len(after)) if not any(after[block : block + 5])))
        shares.append(sum(after) / len(after))
    assert sorted(lags)[10] <= 30 and max(lags) <= 45 and max(shares) <= 0.2, (sorted(lags), sorted(shares))


def test_a_verdict_counts_each_block_its_pairs_rest_on_once_so_one_burst_leaves_it_open():
    """Speculation pays (1.5x), but the first probe's second block runs twenty times slower. That block pairs with the
    plain block before the probe and with the two after it, so three of four pairs say plain decoding is faster, on
    the evidence of one burst: two speculative blocks. Such a verdict is no solid one: the call probes again soon and
    brings speculation back, and a new process resuming from it probes within its first blocks."""
    switch = SpeculationSwitch()
    regimes = run_bursty(switch, [1.0, 1.0, 1.0, 20.0] + [1.0] * 4, speculative_rate=15.0, plain_rate=10.0)
    assert regimes == [False, False, True, True] + [False] * 4, "the burst made a plain verdict"
    assert len(switch.pairs) > SOLID_PAIRS and switch.blocks_paired() == 2 < SOLID_PAIRS
    later = SpeculationSwitch()
    later.resume(switch.durable())
    later.call_begins()
    assert later.schedule.due_at == later.schedule.first, "the next process probes within its first blocks"
    regimes = run_bursty(switch, [1.0] * 40, speculative_rate=15.0, plain_rate=10.0)
    assert switch.speculating and sum(regimes[-16:]) >= 14, "the call's next probe brought speculation back"


def test_a_remembered_verdict_counts_the_blocks_its_pairs_rest_on():
    """A verdict another process wrote rests on as many blocks as it says, at most its pairs; an older record, which
    does not say, on its pairs."""
    for record, blocks in (({"blocks": 2}, 2), ({"blocks": 9}, 4), ({}, 4)):
        switch = SpeculationSwitch()
        switch.resume({"speculating": False, "pairs": [2.0] * 4, "tokens_speculative": 3.0, "tokens_plain": 1.0,
                       "reading": None, "speculative": 12.0, "plain": 10.0} | record)
        assert switch.solidity() == blocks


def test_a_burst_during_the_first_probe_is_reversed_by_the_next_probes():
    """The worst moment: the first probe of speculation runs 20x slower. Speculation is back within a few probes."""
    switch = SpeculationSwitch()
    factors = [1.0, 1.0, 20.0, 20.0] + [1.0] * 200
    regimes = run_bursty(switch, factors, speculative_rate=15.0, plain_rate=10.0)
    assert regimes[-1] and sum(regimes[100:]) >= 95


class BurstyPassClock(PassClock):
    """A ``PassClock`` whose passes run dearer while a burst of load lasts (``PassBursts``)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.bursts = PassBursts(seed)

    def charge(self, module, price) -> PassClock:
        def dearer(tokens):
            return (price(tokens) if callable(price) else price) * self.bursts.next()

        return super().charge(module, dearer)


@pytest.mark.parametrize("seed", range(2))
def test_a_call_keeps_speculating_through_bursts_of_load_where_counts_say_it_pays(pair, prompt_ids, monkeypatch,
                                                                                   single_thread, seed):
    """Every draft is accepted and a drafter pass costs a tenth of the target's: speculation pays whatever the load.
    Bursts of load at seeded moments leave the call speculating for most blocks (the switch's own tests measure how
    many over long runs), and the output is greedy's."""
    target, drafter = pair
    with BurstyPassClock(seed) as clock:
        clock.install(monkeypatch)
        clock.charge(target, 0.01).charge(drafter, 0.001)
        out = target.generate(prompt_ids, assistant_model=drafter, viasd_config=ViaSDConfig(use_slim=False),
                              max_new_tokens=200, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(out.sequences, target.generate(prompt_ids, max_new_tokens=200, do_sample=False))
    stats = out.viasd_stats
    assert stats.speculation_verdict.startswith("speculating"), stats.speculation_switches
    assert stats.plain_blocks <= 0.2 * stats.blocks, (stats.plain_blocks, stats.blocks, stats.speculation_switches)

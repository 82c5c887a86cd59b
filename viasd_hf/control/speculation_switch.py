"""The floor under every drafter: plain one-token decoding, whenever speculation does not pay.

Speculation pays when a block's tokens cost less time than as many one-token passes. That fails
on machines where verifying ``k`` tokens costs about ``k`` one-token passes (bf16 matrix products
emulated on a CPU without native bf16: a pass over 6 new tokens costs several one-token passes; docs/results.md,
"AVX2-only hardware"), with
a drafter that is slow for its acceptance, or on text the drafter cannot predict. None of that can
be known before decoding on the user's machine, so the decoder measures both regimes and uses the
faster (``SpeculationSwitch``):

- **speculating**: blocks as the paper has them (draft, verify, commit), their throughput measured
  block by block, drafting and the loop's own work included;
- **plain**: blocks without a draft, one full pass and one token each, as ``generate`` decodes.

Decoding starts plainly, at ``generate``'s own speed, and probes speculation after two blocks: a
machine where speculation cannot pay loses one short probe, not the blocks it takes to learn. The
regime not in use is probed now and then (``backoff.ProbeSchedule``), so a change of text is
noticed; while probes confirm the choice they grow rare, and a probe that loses much waits long
enough that probing costs at most 2 % of the decoding time.

A CPU is rarely quiet: a neighbour's burst of load slows a few blocks five- or twentyfold, and a
verdict taken from throughputs measured minutes apart would let a burst during a probe decide
the whole call. So the switch compares the regimes by evidence a burst cannot fake for long
(``speedup``): the tokens a block of each regime commits are counts, and what a speculative block
costs in plain blocks is measured in pairs of blocks at most ``PAIR_DISTANCE`` apart (a burst
slows both halves of a pair, or spoils one of the ``PAIRS_KEPT`` pairs whose median is taken).
The tokens a speculative block commits vary from one to the whole draft as drafts happen to be accepted, so their
mean fades slowly (``count_decay``), and the regime changes only where a probe's evidence completes (its end, and the
``PAIR_DISTANCE`` blocks after it that pair with its last): checked after every block, the mean dipped below the tie
now and then by chance, and the regime left kept the dip until its next probe. Between probes, the regime in use
running slow, or the other measuring faster, only brings the next probe forward. A verdict one chance could make is
checked again soon, at ``schedule.every``, whatever it says: pairs resting on fewer than ``SOLID_PAIRS`` blocks of
either regime (the two blocks of a probe pair with one block of the regime in use, so three pairs can rest on two
blocks, one of them slowed by a burst), tokens counted on fewer than ``SOLID_COUNTS`` speculative blocks, or a speedup
within two standard errors of those counts from a tie. Simulated (``bench/studies/switch_noise/study.py``), where
speculation pays 1.1-1.5x the switch keeps 98-99 % of the better regime's throughput, against 90-94 % when it
switched on any block. The price: where a change of text makes speculation lose, the slow counts show it about
twenty-five blocks later, not seven. Plain blocks give the
full model's own token, so in lossless greedy decoding the output is the same whichever regime runs; elsewhere the
regime changes which tokens are drafted and drawn, so the switch runs exactly where measured
timings may steer a call (``tier_controller.measures_wall_clock``), remembered with the draft planner.

Before its first draft the drafter must read what it has not read: the prompts, B of them in a batch.
That read is paid once per call, so it can cost more than speculation saves over the tokens the call
has left: at B = 8, a 0.5B drafter reading eight 160-token prompts took longer than speculating then saved over
48 tokens a row (docs/results.md, "Batches on a Zen4"; ``bench/studies/batch_read/study.py``). So a call whose
drafter has not read decodes plainly when the read, priced from what earlier reads cost against the
target's prefill, would not be earned back (``SpeculationSwitch.reading_pays``). So does a single
sequence whose switch is speculating: on an AVX2-only Zen3, where a bf16 pass over a draft costs about
what decoding its tokens plainly does, HumanEval calls speculated at parity yet paid the drafter's read
of the prompt, ending below greedy (docs/results.md, "AVX2-only hardware"). A probe of speculation in a call whose
drafter has not read pays that read, so its expected loss counts the read in full: where speculation loses, such
probes come seldom. Once the drafter has read, a probe feeds it only the tokens decoded plainly since, and a verdict
resting on few pairs is checked again soon; nor does a plain verdict on few pairs refuse the next call its read, or
a burst during one probe would keep later calls plain: beside a bursty neighbour, calls of four rows decoded plainly
throughout on two pairs' evidence, though speculative blocks ran 1.40x plain ones (docs/results.md, "Batches on an
AMX Xeon"). Such a verdict is probed early in every call (``call_begins``), for a batch probes only while all its
rows decode, and Spec-Bench's short answers leave within a call's first twenty blocks.

A speculating batch pays a second cost once per call: its rows accept different numbers of drafts, so
they finish apart, and the call ends with its slowest rows, later than the full batch's speculative
pace promised: speculative blocks of the full batch can run faster than plain ones while the call runs
slower than batched greedy, the read and that end costing more than the blocks saved (docs/results.md,
"Batches on an AMX Xeon"). What a call's end lost is measured (``observe_tail``) and priced with the read. It is measured
per row: a block of the rows left commits fewer tokens than a full batch's, in either regime, so only
the rows' shortfall against the full batch's pace per row counts. Rows that stop early at their EOS
cost nothing there (counted as speculation's loss, Spec-Bench's short answers kept batches plain where
speculating paid), nor do a plain call's last rows:
plain decoding advances every row alike, so its call ends with its longest row, whenever rows stop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from viasd_hf.control.backoff import ProbeSchedule
from viasd_hf.control.faded import FadedMean, FadedSpread

PAIRS_KEPT = 5  # cost ratios of nearby blocks the switch takes the median of
PAIR_DISTANCE = 2  # blocks apart, at most, for two blocks to be measured close together
RECENT_BLOCKS = 9  # blocks per regime whose median seconds price a probe
SOLID_PAIRS = 3  # paired blocks of each regime below which a verdict is reconsidered soon, whatever it says
SOLID_COUNTS = 8  # speculative blocks whose tokens, at least, a verdict that is not reconsidered soon rests on


@dataclass
class SpeculationSwitch:
    """Whether the next block speculates or decodes one token plainly; both regimes' throughput, measured.

    Decoding starts plainly, which costs what ``generate`` costs, and probes speculation from block
    ``schedule.first``. A probe of the other regime lasts ``probe_blocks`` blocks; it switches when
    the other regime was faster (speculation must win by ``margin``: plain decoding is the safe
    choice). Between probes, the regime in use measuring below the other, by its throughput or by ``speedup``,
    brings the next probe forward (a change of load or text shows there first); the probe's end decides.

    A probe of the slower regime costs time, so probes are spaced to cost at most ``budget`` of the
    decoding time: the next one waits at least as many blocks as its expected loss (``probe_loss``)
    takes ``budget`` times to earn back, and the doubling of ``ProbeSchedule`` applies on top.
    """

    speculating: bool = False
    schedule: ProbeSchedule = field(default_factory=lambda: ProbeSchedule(first=2, every=16, longest=512))
    probe_blocks: int = 2
    decay: float = 0.85  # per block of the regime measured
    count_decay: float = 0.95  # per block, for the tokens a block commits (``tokens``): counts vary block to block
    margin: float = 0.03
    budget: float = 0.02  # the share of decoding time probes may cost
    speculative: FadedMean = field(default_factory=FadedMean)  # tokens per second
    plain: FadedMean = field(default_factory=FadedMean)
    block_seconds: dict[bool, list[float]] = field(default_factory=lambda: {True: [], False: []})  # the latest blocks
    block: int = 0
    probed: int = 0  # blocks of the probe under way
    switches: list[dict] = field(default_factory=list)
    advised: bool = False  # whether the user was told why decoding fell back (``fallback_advice``)
    reading: FadedMean = field(default_factory=FadedMean)  # the drafter's seconds to read a token / the target's
    reads: FadedMean = field(default_factory=FadedMean)  # seconds a probe of speculation spent first reading (one-off)
    prefill: FadedMean = field(default_factory=FadedMean)  # the target's seconds per prompt token, over calls
    tail: FadedMean = field(default_factory=FadedMean)  # seconds a speculating batch's call lost at its end, per call
    advice_gap: float = 0.1  # how much slower speculation must measure before the user is told it does not pay
    tokens: dict[bool, FadedSpread] = field(default_factory=lambda: {True: FadedSpread(), False: FadedSpread()})
    pairs: list[float] = field(default_factory=list)  # a speculative block's seconds / a nearby plain block's
    paired: list[tuple[int, int]] = field(default_factory=list)  # each of ``pairs``: its speculative and plain block
    remembered: list[float] = field(default_factory=list)  # ``pairs`` an earlier process measured (``resume``)
    remembered_blocks: int = 0  # the blocks of each regime ``remembered`` rests on, at least (``blocks_paired``)
    probe_ended: int = 0  # the block at which the latest probe ended
    latest: dict[bool, tuple[int, float]] = field(default_factory=dict)  # per regime: its latest block, seconds
    drafter_has_read: bool = False  # whether this call's drafter has read its prompts (``DrafterRead``)

    def speculates(self) -> bool:
        """Whether the next block drafts."""
        return self.speculating != self.schedule.due(self.block)

    def call_begins(self) -> None:
        """A call starts. A plain verdict resting on fewer than ``SOLID_PAIRS`` blocks of either regime (this process's
        pairs, else those an earlier one measured: ``solidity``) is probed within the call's first blocks, as a first
        call probes: once a batch's first row leaves, the call probes no more, and short answers leave before a probe
        the schedule set further off comes, so a verdict one burst made would keep call after call plain."""
        if not self.speculating and self.solidity() < SOLID_PAIRS:
            self.schedule.due_at = min(self.schedule.due_at, self.block + self.schedule.first)

    def observe(self, speculated: bool, tokens: int, seconds: float, one_off: float = 0.0,
                cut_short: bool = False) -> None:
        """A finished block of either regime: what it committed and the seconds it took, drafting included.

        ``one_off``: seconds the block spent once per call, not per block (the drafter reading the prompt before its
        first draft): they count in what a probe costs, not in the regime's throughput. ``cut_short``: the call's
        length limit, not the drafter, ended its draft (the last blocks of a call): it says nothing of what
        speculating gives, so it counts as a block but its throughput is not measured."""
        if cut_short:
            self.block += 1
            return
        probing = self.schedule.due(self.block)
        (self.speculative if speculated else self.plain).observe(tokens, self.decay, weight=seconds)
        self.block_seconds[speculated] = [*self.block_seconds[speculated], seconds][-RECENT_BLOCKS:]
        self.tokens[speculated].observe(tokens, self.count_decay)
        if one_off == 0:  # a block after a read drafted partly in the read: no measure of a block's cost
            self._pair(speculated, seconds)
        if one_off > 0:
            self.reads.observe(one_off, self.decay)
        self.block += 1
        if not probing:
            other_is_faster = self._other_is_faster()
            if other_is_faster and self.block - self.probe_ended <= PAIR_DISTANCE:
                self._switch()  # the blocks just after a probe pair with its last one: they complete its evidence
            elif self.block >= self.probe_ended + self.schedule.every and (other_is_faster or self._looks_slower()):
                # a change of text, of costs or of load, or a run of blocks that drafted badly by chance: the next
                # blocks measure which (at most every ``every`` blocks), and the probe's end decides
                self.schedule.due_at = self.block
                self.latest.pop(speculated, None)  # a block that set off a probe is no fair half of a pair: picked slow
            return
        self.probed += 1
        if self.probed < self.probe_blocks:
            return
        self.probed = 0
        self.probe_ended = self.block
        if self._other_is_faster():
            self._switch()
        elif self._thin_evidence():  # a burst may have made this verdict: probe again soon, reads allowing
            self.schedule.switched(self.block, at_least=self._blocks_to_earn_back())
        else:
            self.schedule.confirmed(self.block, at_least=self._blocks_to_earn_back())

    def durable(self) -> dict[str, Any]:
        """What this switch learned that holds beyond the process (``control.verdicts``): the regime, the pairs'
        cost ratios and how many blocks of each regime they rest on (``blocks_paired``), tokens per block of each
        regime, the drafter's read and the target's prefill, both relative."""
        means = {"tokens_speculative": self.tokens[True].mean(), "tokens_plain": self.tokens[False].mean(),
                 "reading": self.reading.mean(), "speculative": self.speculative.mean(), "plain": self.plain.mean()}
        return {"speculating": self.speculating, "pairs": list(self.evidence()), "blocks": self.solidity()} | means

    def resume(self, record: dict[str, Any]) -> None:
        """Start from what an earlier process learned (``durable``), each mean weighing as one block: the first block
        decodes in the regime it chose, and the other is probed after ``schedule.every`` blocks, not at block
        ``schedule.first``. Its pairs were measured at another time, perhaps beside a neighbour long gone, so they
        decide only until this process has measured a pair of its own (``evidence``), and they never make a verdict
        solid. A record that does not read as one is ignored: the switch measures afresh."""
        try:
            speculating, pairs = bool(record["speculating"]), [float(pair) for pair in record["pairs"]][-PAIRS_KEPT:]
            blocks = min(int(record.get("blocks", len(pairs))), len(pairs))
            means = {name: record[name] for name in ("tokens_speculative", "tokens_plain", "reading", "speculative",
                                                     "plain")}
            if any(value is not None and not float(value) > 0 for value in means.values()):
                return
        except (KeyError, TypeError, ValueError):
            return
        self.speculating, self.remembered, self.remembered_blocks = speculating, pairs, blocks
        for mean, name in ((self.tokens[True], "tokens_speculative"), (self.tokens[False], "tokens_plain"),
                           (self.reading, "reading"), (self.speculative, "speculative"), (self.plain, "plain")):
            if means[name] is not None:
                mean.add(float(means[name]))
        self.schedule.due_at = self.schedule.every

    def observe_reading(self, seconds_per_token: float, prefill_seconds_per_token: float) -> None:
        """A read of the drafter (seconds per token it read) beside the target's prefill of the same call."""
        if seconds_per_token > 0 and prefill_seconds_per_token > 0:
            self.reading.observe(seconds_per_token, self.decay, weight=prefill_seconds_per_token)

    def observe_prefill(self, seconds_per_token: float) -> None:
        """The target's prefill of a call, per prompt token: what prices the drafter's read before the target has read
        the prompt (where the first block carries the prompts, the drafter reads before the target's first pass)."""
        self.prefill.observe(seconds_per_token, self.decay)

    def reading_cost(self, prefill_seconds_per_token: float, tokens: int) -> float | None:
        """The seconds the drafter is expected to take to read ``tokens``, priced against the target's prefill."""
        ratio = self.reading.mean()
        return None if ratio is None else ratio * prefill_seconds_per_token * tokens

    def observe_tail(self, seconds: float) -> None:
        """A speculating batch's end: the ``seconds`` its last blocks (once rows had left, or where the length limit
        cut drafts short) took beyond what their rows' tokens take at the full batch's speculative pace per row."""
        self.tail.observe(max(seconds, 0.0), self.decay)

    def tail_cost(self) -> float:
        """What speculating is expected to lose once per call at its end (``observe_tail``); 0 while unmeasured."""
        return self.tail.mean() or 0.0

    def reading_pays(self, read_seconds: float | None, tokens_left: int) -> bool:
        """Whether speculating over at most ``tokens_left`` more tokens saves more than it costs once per call: the
        ``read_seconds`` the drafter needs before it drafts and, for a batch, what its end is expected to lose
        (``tail_cost``). A token saves what plain decoding costs it (``plain_token_seconds``) times ``1 - 1 /
        speedup``, the speedup the switch decides on: throughputs measured apart would let a burst during a few
        speculative blocks price every read out. Yes while either is unknown, or known only from an earlier process
        (``resume``), or while decoding plainly on thin evidence (``_thin_evidence``: a burst of load can make
        speculation look slower for a probe or two; a call that never read would never check): a probe learns it."""
        speedup, token_seconds = self.speedup(), self.plain_token_seconds()
        if read_seconds is None or not speedup or token_seconds is None or self._only_remembered():
            return True
        if not self.speculating and self._thin_evidence():
            return True
        return tokens_left * token_seconds * max(1 - 1 / speedup, 0.0) > read_seconds + self.tail_cost()

    def plain_token_seconds(self) -> float | None:
        """What plain decoding costs a token: the median seconds of its latest blocks over the tokens such a block
        commits (a burst inflates a mean for long, not a median); before a plain block is timed in this process, the
        faded throughput's (``resume``)."""
        block, tokens = self.typical_block(False), self.tokens[False].mean()
        if block is not None and tokens:
            return block / tokens
        plain = self.plain.mean()
        return 1 / plain if plain else None

    def probe_loss(self) -> float:
        """The seconds a probe of the regime not in use is expected to lose against the one in use, as measured: its
        blocks' shortfall, and for a probe of speculation the whole of the drafter's read before its first draft
        (the context decoded plainly since it last drafted), which no speed of speculation earns back within a probe."""
        probed = not self.speculating
        speedup, block = self.speedup(), self.typical_block(probed)
        if speedup is None or block is None:
            return 0.0
        ratio = speedup if probed else 1 / speedup  # the probed regime's throughput over the one in use
        return self.probe_blocks * block * max(1 - ratio, 0.0) + self.probe_read()

    def typical_block(self, speculated: bool) -> float | None:
        """The median seconds of the regime's latest blocks: a burst of load inflates a mean for long, not a median."""
        latest = self.block_seconds[speculated]
        return median(latest) if latest else None

    def probe_read(self) -> float:
        """The seconds a probe pays once before its first block: the drafter's read, for a probe of speculation in a
        call whose drafter has not read its prompts. Once it has, a probe's first draft pass feeds only what was
        decoded plainly since, a few tokens a block: that costs in proportion to the blocks waited, so no interval
        earns it back, and a verdict a burst made is checked again soon within the call."""
        return (self.reads.mean() or 0.0) if not self.speculating and not self.drafter_has_read else 0.0

    def clearly_loses(self) -> bool:
        """Whether speculation measured slower than plain decoding by ``advice_gap``: a near tie, as a call's first
        blocks can show while new pass shapes are first run, is no reason to tell the user it does not pay; nor is
        what an earlier process measured (``resume``) before this one has measured a pair, nor a verdict a single
        burst or a few badly drafted blocks could have made (``_thin_evidence``)."""
        if self._only_remembered() or (self.pairs and self._thin_evidence()):
            return False
        speedup = self.speedup()
        return speedup is not None and speedup < 1 - self.advice_gap

    def verdict(self) -> str:
        """Where the switch stands and why, in words: what ``viasd_stats.speculation_verdict`` reports."""
        state = "speculating" if self.speculating else "plain decoding"
        return f"{state}: {self.describe()}"

    def describe(self) -> str:
        speculative, plain, speedup = self.speculative.mean(), self.plain.mean(), self.speedup()
        if speculative is None or plain is None or speedup is None:
            return "not yet compared"
        pairs = self.evidence()
        earlier = " remembered from an earlier process" if pairs is self.remembered else ""
        paired = f", {speedup:.2f}x from {len(pairs)} adjacent pair{'s' * (len(pairs) != 1)}{earlier}" if pairs else ""
        return f"speculative blocks {speculative:.2f} tokens/s, plain decoding {plain:.2f} tokens/s{paired}"

    def speedup(self) -> float | None:
        """Speculation's throughput over plain decoding's, from evidence a burst of load cannot fake for long: the
        tokens a block of each regime commits (counts, faded) over what a speculative block costs in plain blocks,
        measured in pairs of adjacent blocks (a burst slows both, or the pair is one of ``PAIRS_KEPT`` whose median
        is taken). Before any pair, the ratio of the two regimes' faded throughputs."""
        spec_tokens, plain_tokens, pairs = self.tokens[True].mean(), self.tokens[False].mean(), self.evidence()
        if pairs and spec_tokens and plain_tokens:
            return spec_tokens / plain_tokens / median(pairs)
        speculative, plain = self.speculative.mean(), self.plain.mean()
        return speculative / plain if speculative is not None and plain else None

    def evidence(self) -> list[float]:
        """The pairs ``speedup`` takes the median of: this process's, else those an earlier one measured (``resume``)."""
        return self.pairs or self.remembered

    def blocks_paired(self) -> int:
        """How many blocks of each regime, at least, this process's pairs rest on: both blocks of a probe pair with the
        block just before it, and the blocks just after a probe with the probe's last, so one block can weigh in
        three pairs, and a burst that slows it spoils them all."""
        return min(len({speculative for speculative, _ in self.paired}), len({plain for _, plain in self.paired}))

    def solidity(self) -> int:
        """``blocks_paired`` of the pairs ``speedup`` rests on: this process's, else those an earlier one measured."""
        return self.blocks_paired() if self.pairs else self.remembered_blocks

    def _only_remembered(self) -> bool:
        """Whether the pairs ``speedup`` rests on are an earlier process's, this one having measured none yet."""
        return bool(self.remembered) and not self.pairs

    def _pair(self, speculated: bool, seconds: float) -> None:
        """A block near one of the other regime (at most ``PAIR_DISTANCE`` blocks before): what the speculative one
        cost in plain ones, measured close together. One block can weigh in several pairs (both blocks of a probe
        pair with the block before it), which ``blocks_paired`` counts once."""
        other = self.latest.get(not speculated)
        if other is not None and self.block - other[0] <= PAIR_DISTANCE and seconds > 0 and other[1] > 0:
            spec, plain = (seconds, other[1]) if speculated else (other[1], seconds)
            self.pairs = [*self.pairs, spec / plain][-PAIRS_KEPT:]
            blocks = (self.block, other[0]) if speculated else (other[0], self.block)
            self.paired = [*self.paired, blocks][-PAIRS_KEPT:]
        self.latest[speculated] = (self.block, seconds)

    def _thin_evidence(self) -> bool:
        """Whether the verdict is one chance could make: this process's pairs rest on fewer than ``SOLID_PAIRS`` blocks
        of either regime (``blocks_paired``: one burst could make it, or it was remembered from another time), or the
        tokens per speculative block on fewer than ``SOLID_COUNTS`` blocks, or the speedup lies within two standard
        errors of those counts from a tie. A block commits one token to the whole draft as drafts happen to be
        accepted: two blocks of one token each, one time in eleven where 70 % of drafts are kept and speculation pays
        1.2x, say it loses 2.4x."""
        counts = self.tokens[True]
        if self.blocks_paired() < SOLID_PAIRS or round(counts.blocks()) < SOLID_COUNTS:
            return True
        speedup, error = self.speedup(), counts.relative_error()
        return speedup is not None and error is not None and abs(speedup - 1) < 2 * speedup * error

    def _blocks_to_earn_back(self) -> int:
        """Blocks of the regime in use over which the next probe's expected loss is ``budget`` of the time (none while
        the drafter's read, while the evidence is thin: a verdict one burst could make is checked again soon)."""
        block = self.typical_block(self.speculating)
        if not block:
            return 0
        loss = self.probe_read() if self._thin_evidence() else self.probe_loss()
        return math.ceil(loss / (self.budget * block))

    def _looks_slower(self) -> bool:
        """Whether the regime in use now runs below the other's throughput as last measured: a burst of load (which
        slows both, so a probe's pairs will show it changes nothing) or a change of costs (which a probe's pairs
        measure). Either way it is cause for a probe, not for a switch."""
        speculative, plain = self.speculative.mean(), self.plain.mean()
        if speculative is None or plain is None:
            return False
        return speculative < plain if self.speculating else plain < speculative * (1 - self.margin)

    def _other_is_faster(self) -> bool:
        speedup = self.speedup()
        if speedup is None:
            return False
        return speedup < 1 if self.speculating else speedup > 1 + self.margin

    def _switch(self) -> None:
        self.speculating = not self.speculating
        self.schedule.switched(self.block, at_least=self._blocks_to_earn_back())
        self.switches.append({"block": self.block, "regime": "speculating" if self.speculating else "plain",
                              "reason": self.describe()})  # fmt: skip

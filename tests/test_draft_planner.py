"""The draft-length cost model on synthetic costs and acceptances: no model, no clock."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask, ViaSDConfig
from viasd_hf.control.draft_planner import (
    CONFIDENCE_EDGES,
    AcceptanceModel,
    DraftPlanner,
    MeasuredCosts,
    StaticCosts,
    weight_bytes,
)
from viasd_hf.engine.accept import Draft
from viasd_hf.engine.processors import RowProcessors


def drafted(planner: DraftPlanner, confidence: float, limit: int = 50) -> int:
    """How many tokens the planner drafts when every draft comes with ``confidence``."""
    confidences: list[float] = []
    while len(confidences) < limit and planner.keep_drafting_rows([confidences], [True]):
        confidences.append(confidence)
    return len(confidences)


def test_a_cheap_drafter_drafts_longer():
    cheap = DraftPlanner(StaticCosts(drafter=0.05), longest=15)
    dear = DraftPlanner(StaticCosts(drafter=0.5), longest=15)
    assert drafted(cheap, 0.9) > drafted(dear, 0.9) >= 1


def test_confident_drafts_run_longer_and_an_unsure_one_ends_the_block():
    planner = DraftPlanner(StaticCosts(drafter=0.2), longest=15)
    assert drafted(planner, 0.95) > drafted(planner, 0.6)
    assert not planner.keep_drafting_rows([[0.9, 0.9, 0.1]], [True]), "a draft the drafter doubts makes the next one worthless"
    assert planner.keep_drafting_rows([[]], [True]), "the first token is always drafted, so calibration keeps learning"


def test_the_draft_is_capped():
    assert drafted(DraftPlanner(StaticCosts(drafter=0.0), longest=7), 0.99) == 7


def drafted_rows(planner: DraftPlanner, confidences: list[float], going_on: list[bool], limit: int = 50) -> int:
    """How many columns a batch drafts when row ``r`` drafts with ``confidences[r]`` (``going_on[r]``: it may go on
    past the first column; a row that may not stops there, as at an end token)."""
    rows: list[list[float]] = [[] for _ in confidences]
    drafting = [True] * len(rows)
    while len(rows[0]) < limit and planner.keep_drafting_rows(rows, drafting):
        for row, confidence, may in zip(rows, confidences, going_on):
            if not rows[0] or may:
                row.append(confidence)
        drafting = list(going_on)
    return max(len(row) for row in rows)


def test_a_batch_of_like_rows_drafts_as_one_row_and_rows_that_stopped_cut_the_block_short():
    """Rows alike: the batch's rule is the single sequence's. One confident row among rows that stopped: every row
    pays for each column, one gains, so the batch stops sooner than that row alone would."""
    planner = DraftPlanner(StaticCosts(drafter=0.1), longest=15)
    alone = drafted(planner, 0.95)
    assert drafted_rows(planner, [0.95] * 4, [True] * 4) == alone
    assert drafted_rows(planner, [0.95] * 4, [True, False, False, False]) < alone


def test_an_overconfident_drafter_is_calibrated_down():
    """A drafter that says 0.95 but sees half its drafts rejected soon drafts less than one taken at its word."""
    naive = DraftPlanner(StaticCosts(drafter=0.2), longest=15)
    calibrated = DraftPlanner(StaticCosts(drafter=0.2), longest=15)
    for _ in range(60):
        # judged 3 drafts, kept the first only: position 0 kept, position 1 rejected
        calibrated.observe(Draft([1, 2, 3], [one_hot_ish(0.95)] * 3).confidences, judged=3, kept=1)
    assert calibrated.acceptance.kept(0.95) < 0.6
    assert drafted(calibrated, 0.95) < drafted(naive, 0.95)


def one_hot_ish(mass: float) -> torch.Tensor:
    """A drafter distribution over 4 tokens with ``mass`` on every drafted token's id (1, 2, 3 share it)."""
    return torch.tensor([1 - mass, mass, mass, mass])


def test_copied_drafts_do_not_calibrate_the_drafter():
    """The decoder feeds the planner only drafts a model drew: a copied one says nothing of its confidence."""
    assert not Draft([1, 2], [None, None]).drawn and not Draft([], []).drawn
    assert Draft([1], [one_hot_ish(0.9)]).drawn


def test_drafts_after_the_first_rejection_teach_nothing():
    model = AcceptanceModel()
    model.observe([0.85, 0.95, 0.95, 0.95], judged=4, kept=1)
    bins = model.by_confidence
    assert (bins[model._bin(0.85)].total, bins[model._bin(0.85)].weight) == (1.0, 1.0), "kept"
    assert (bins[model._bin(0.95)].total, bins[model._bin(0.95)].weight) == (0.0, 1.0), "rejected, once"


def test_a_confident_streak_is_not_cut_short_by_positions_seldom_reached():
    """Blocks that end at their first, unsure draft teach that drafts are often rejected; they say nothing about a
    streak of near-certain drafts, which the planner lets run on (the next draft is foretold by the last one's
    confidence, not by the mean at a position seldom reached)."""
    planner = DraftPlanner(StaticCosts(drafter=0.2), longest=32)
    for _ in range(30):
        planner.observe(Draft([1, 2], [one_hot_ish(0.5)] * 2).confidences, judged=2, kept=0)
        planner.observe(Draft([1], [one_hot_ish(0.9995)]).confidences, judged=1, kept=1)
    assert drafted(planner, 0.9995) >= 16
    assert drafted(planner, 0.5) == 1


def test_measured_costs_recover_a_linear_verifying_pass():
    costs = MeasuredCosts(StaticCosts(drafter=0.3))
    for tokens in [1, 3, 5, 7, 2, 6, 4, 8] * 4:
        costs.observe_drafting(0.050 * 3, 3)
        costs.observe_verifying(0.100 + 0.004 * tokens, tokens)
    assert costs.verify_per_token() / costs.verify_base() == pytest.approx(0.04, rel=1e-6)
    assert costs.drafter_pass() / costs.verify_base() == pytest.approx(0.5, rel=1e-6)
    assert costs.verify_ratio(6) == pytest.approx(1.24 / 1.04)


def test_measured_costs_start_from_the_static_guess():
    costs = MeasuredCosts(StaticCosts(drafter=0.25, per_token=0.03))
    costs.observe_verifying(0.2, 1)
    one_token_pass = costs.verify_base() + costs.verify_per_token()
    assert costs.drafter_pass() / one_token_pass == pytest.approx(0.25), "a quarter of a one-token target pass"
    assert costs.verify_ratio() is None, "nothing measured of what each token adds"
    costs.observe_drafting(0.5, 1)  # the first block's draft, verified in the pass that read the prompt
    costs.observe_verifying(0.2, 1)  # then a plain block: it drafted nothing, so it prices no drafter pass
    assert costs.drafter_pass() / one_token_pass == pytest.approx(0.25)


def planned_lengths(costs, blocks: list[tuple[int, float]], confidence: float = 0.9) -> list[int]:
    """The draft a planner with these costs plans after each block (``drafted``), the block being (drafter passes,
    burst factor per pass): true costs a = 100 ms, b = 4 ms a token, d = 30 ms, each pass times its burst factor."""
    planner, lengths = DraftPlanner(costs, longest=32), []
    for passes, factors in blocks:
        if passes:
            costs.observe_drafting(sum(0.030 * factor for factor in factors[:-1]), passes)
        costs.observe_verifying((0.100 + 0.004 * (passes + 1)) * factors[-1], passes + 1)
        lengths.append(drafted(planner, confidence))
    return lengths


def bursty_blocks(seed: int, count: int = 400) -> list[tuple[int, list[float]]]:
    """Blocks of 0 (plain) to 8 drafter passes and a verifying pass, each pass slowed by ``PassBursts``."""
    from conftest import PassBursts

    generator, bursts, blocks = __import__("random").Random(seed), PassBursts(seed), []
    for _ in range(count):
        passes = generator.choice([0, 1, 2, 3, 4, 5, 6, 8])
        blocks.append((passes, [bursts.next() for _ in range(passes + 1)]))
    return blocks


def test_bursts_of_load_do_not_change_the_planned_draft():
    """Passes 5-20x dearer in bursts that start and end anywhere (about half of all passes), a drafting or a verifying
    pass alone included: the planner drafts what it would on a quiet machine for nearly every block, over 20 seeded
    runs of 400 blocks (costs kept as running means of seconds, as before, planned it for a median 14 % of blocks)."""
    quiet = planned_lengths(MeasuredCosts(StaticCosts(drafter=0.3)), [(passes, [1.0] * (passes + 1))
                                                                        for passes, _ in bursty_blocks(0)])[-1]
    assert quiet == drafted(DraftPlanner(StaticCosts(drafter=0.3, per_token=0.04), longest=32), 0.9)
    shares = []
    for seed in range(20):
        lengths = planned_lengths(MeasuredCosts(StaticCosts(drafter=0.3)), bursty_blocks(seed))[10:]
        shares.append(sum(length == quiet for length in lengths) / len(lengths))
    assert sorted(shares)[10] >= 0.95 and min(shares) >= 0.85, sorted(shares)


def test_static_costs_follow_the_weights_each_drafter_reads():
    target = tiny_causal_lm("llama", seed=0)
    small = tiny_causal_lm("llama", seed=1, num_hidden_layers=2)
    lighter = StaticCosts.for_drafter(target, None, RoutingMask.from_model(target, skip=[1])).drafter
    heavier = StaticCosts.for_drafter(target, None, RoutingMask.from_model(target, skip=[1, 2])).drafter
    assert 0 < heavier < lighter < 1
    assert StaticCosts.for_drafter(target, target, None).drafter == pytest.approx(1.0)
    assert StaticCosts.for_drafter(target, small, None).drafter == pytest.approx(weight_bytes(small) / weight_bytes(target))
    assert StaticCosts.for_drafter(target, small, None).drafter < 1


def test_very_confident_drafts_are_priced_apart_from_merely_confident_ones():
    """On code a drafter is often 0.999 sure and right: with one bin for [0.9, 1] such drafts would be priced like the
    0.92-sure ones that are kept only about as often, and blocks would end early."""
    fine = DraftPlanner(StaticCosts(drafter=0.2), longest=15)
    coarse = DraftPlanner(StaticCosts(drafter=0.2), longest=15, acceptance=AcceptanceModel(edges=CONFIDENCE_EDGES[:9]))
    for planner in (fine, coarse):
        for block in range(60):
            planner.acceptance.observe([0.9995] * 12, judged=12, kept=12)
            planner.acceptance.observe([0.92] * 4, judged=4, kept=block % 4)
    assert fine.acceptance.kept(0.9995) > 0.99 > coarse.acceptance.kept(0.9995)
    assert 0.5 < fine.acceptance.kept(0.92) < 0.9

    def drafted(planner: DraftPlanner) -> int:
        confidences = [0.9995]
        while planner.keep_drafting_rows([confidences], [True]):
            confidences.append(0.9995)
        return len(confidences)

    assert drafted(fine) > drafted(coarse)


def planner_weight(planner: DraftPlanner) -> float:
    """How much calibration evidence a planner holds."""
    return sum(mean.weight for mean in planner.acceptance.by_confidence)


def test_the_planner_is_remembered_across_calls_where_timings_may_steer_and_nowhere_else(speculating):
    """As HF keeps its assistant's draft length on the assistant, a lossless greedy call starts from what the
    last call on the model learned; a sampling call, whose draws draft lengths change, starts afresh."""
    from conftest import near_copy
    from viasd_hf import ViaSDConfig, enable_viasd
    from viasd_hf.control.memory import tier_memory

    target = enable_viasd(tiny_causal_lm("llama", seed=0))
    drafter = near_copy(target)
    memory = tier_memory(target)

    def generate(config: ViaSDConfig, do_sample: bool = False) -> None:
        torch.manual_seed(0)
        target.generate(torch.tensor([[3, 17, 5, 9]]), assistant_model=drafter, viasd_config=config,
                        max_new_tokens=16, do_sample=do_sample, pad_token_id=0)

    lossless = ViaSDConfig(mode="lossless", use_slim=False)
    generate(lossless)
    (key, first), = memory.planners.items()
    evidence = planner_weight(first)
    assert evidence > 0 and isinstance(first.costs, MeasuredCosts)
    generate(lossless)
    assert memory.planners[key] is not first and planner_weight(memory.planners[key]) > evidence, "built on the last"
    generate(ViaSDConfig(mode="lossless", use_slim=False), do_sample=True)
    generate(ViaSDConfig(mode="lossless", use_slim=False, reproducible=True))
    assert list(memory.planners) == [key], "reproducible calls remember nothing"
    memory.reset()
    assert not memory.planners


def test_each_call_plans_with_its_own_copy_of_the_remembered_planner():
    from viasd_hf.control.memory import TierMemory

    memory = TierMemory()
    remembered = DraftPlanner(StaticCosts(drafter=0.2), longest=15)
    memory.remember_planner("key", remembered)
    copy = memory.planner("key", lambda: DraftPlanner(StaticCosts(drafter=0.9), longest=15))
    assert copy is not remembered and copy.costs.drafter == 0.2
    copy.acceptance.observe([0.95], judged=1, kept=1)
    assert planner_weight(remembered) == 0, "a call never updates the remembered planner while another reads it"


def test_drafters_that_differ_in_model_vocabulary_or_skipped_layers_are_measured_apart():

    from viasd_hf.control.memory import drafter_identity
    from viasd_hf.engine.batch.drafting import BatchAssistant, BatchSelfDrafter
    from viasd_hf.engine.batch.ragged_cache import RaggedCache
    from viasd_hf.vocabulary.head import SubsetHead

    model, other = tiny_causal_lm("llama", seed=0), tiny_causal_lm("llama", seed=1)
    config, cpu = ViaSDConfig(), torch.device("cpu")

    def assistant(drafter, head=None):
        return drafter_identity(BatchAssistant(drafter, RowProcessors(), None, frozenset(), 1, cpu, head=head),
                                drafter, config)

    def self_drafter(skip):
        cache = RaggedCache(model.config, 1, cpu)
        drafting = BatchSelfDrafter(model, RoutingMask.from_model(model, skip=skip), cache, RowProcessors(), None,
                                    frozenset())
        return drafter_identity(drafting, None, config)

    identities = {assistant(model), assistant(other), assistant(model, SubsetHead(model, range(40))),
                  assistant(model, SubsetHead(model, range(50))), self_drafter([1]), self_drafter([1, 2])}
    assert len(identities) == 6
    assert assistant(model) in identities
    assert drafter_identity(BatchAssistant(model, RowProcessors(), None, frozenset(), 1, cpu), model,
                            ViaSDConfig(drafter_context=256)) not in identities, "reading part of the prompt"


def test_second_choices_are_verified_where_their_column_costs_less_than_they_add_and_learned_from_rejections():
    """A second choice beside draft ``j`` adds ``P_{j-1}·(1 - a(c_j))·a2`` tokens for one column of the verifying pass:
    worth it where a column costs little, not where verifying costs a pass per token; ``a2`` is calibrated on
    rejected drafts, whether or not their second choice was fed."""
    confidences, seconds = [0.9, 0.6, 0.4], [0.05, 0.3, 0.4]
    cheap = DraftPlanner(StaticCosts(drafter=0.2, per_token=0.01), longest=15)
    dear = DraftPlanner(StaticCosts(drafter=0.2, per_token=1.0), longest=15)
    assert cheap.second_choices_worth(confidences, seconds) == [True, True, True]
    assert dear.second_choices_worth(confidences, seconds) == [False, False, False]
    assert cheap.second_choices_worth(confidences, [None, 0.3, None]) == [False, True, False]
    never = DraftPlanner(StaticCosts(drafter=0.2, per_token=0.01), longest=15)
    for _ in range(40):  # the full model's token is never the drafter's second choice
        never.observe_second(0.6, 0.3, kept=False)
    assert never.second_choices_worth(confidences, seconds) == [True, False, True]

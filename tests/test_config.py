"""``ViaSDConfig``: eight fields a user sets, the paper's settings in ``PaperKnobs``, configs saved by earlier versions."""

from __future__ import annotations

import json
import logging
from dataclasses import fields

import pytest

from viasd_hf import PaperKnobs, ViaSDConfig


def test_a_user_sets_at_most_eight_fields_and_reaches_the_papers_through_paper():
    assert len(fields(ViaSDConfig)) <= 8
    paper = ViaSDConfig.paper()
    assert paper.mode == "tiered" and (paper.knobs.tau_accept, paper.knobs.tau_escalate) == pytest.approx((0.7, 0.5))
    custom = ViaSDConfig.paper(mode="lossless", num_draft_tokens=4, adaptive=False, reproducible=True)
    assert custom.mode == "lossless" and custom.reproducible is True
    assert (custom.knobs.num_draft_tokens, custom.knobs.adaptive) == (4, False)
    assert ViaSDConfig(knobs=PaperKnobs(num_draft_tokens=4)).knobs.num_draft_tokens == 4
    with pytest.raises(TypeError, match="unexpected keyword argument 'tier_switching'"):
        ViaSDConfig(tier_switching="fixed")


def test_knobs_and_the_timing_switch_are_checked():
    with pytest.raises(ValueError, match="tau_accept .* must be >= tau_escalate"):
        ViaSDConfig.paper(tau_accept=0.2, tau_escalate=0.6)
    with pytest.raises(TypeError, match="reproducible must be True or False or None"):
        ViaSDConfig(reproducible="fixed")
    with pytest.raises(TypeError, match="ViaSDConfig.knobs must be a PaperKnobs"):
        ViaSDConfig(knobs=5)
    with pytest.raises(ValueError, match="cascade_lenience makes verification lossy"):
        ViaSDConfig.paper(mode="lossless", cascade_lenience=0.2)


def test_a_config_round_trips_with_its_knobs(tmp_path):
    config = ViaSDConfig.paper(num_draft_tokens=7, max_slim_backlog=20, reproducible=False, drafter_context=64)
    config.save_pretrained(tmp_path)
    assert ViaSDConfig.from_pretrained(tmp_path) == config
    assert json.loads((tmp_path / "viasd_config.json").read_text())["knobs"]["num_draft_tokens"] == 7


def test_a_config_saved_by_an_earlier_version_loads_and_names_each_field_that_went(tmp_path, caplog):
    old = {"mode": "tiered", "tau_accept": 0.8, "num_draft_tokens": 4, "adaptive": False, "tier_switching": "fixed",
           "attention": "measured", "plain_fallback": True, "drafter_precision": "auto", "runner_up": True,
           "vocabulary_tiers": ["drafter", "slim"]}
    (tmp_path / "viasd_config.json").write_text(json.dumps(old))
    with caplog.at_level(logging.WARNING, logger="viasd_hf"):
        config = ViaSDConfig.from_pretrained(tmp_path)
    assert config.mode == "tiered" and config.reproducible is True, "tier_switching='fixed' is reproducible=True"
    assert (config.knobs.tau_accept, config.knobs.num_draft_tokens, config.knobs.adaptive) == (0.8, 4, False)
    said = [record.getMessage() for record in caplog.records]
    gone = ("tier_switching", "attention", "plain_fallback", "drafter_precision", "runner_up", "vocabulary_tiers")
    assert len(said) == len(gone) and all("\n" not in line for line in said)
    assert all(any(f"field {name}=" in line for line in said) for name in gone)
    with pytest.raises(ValueError, match=r"unknown ViaSDConfig fields \['made_up'\]"):
        ViaSDConfig.from_dict({"made_up": 1})


def test_a_relative_path_in_a_saved_config_is_read_beside_the_config(tmp_path, monkeypatch):
    from conftest import tiny_causal_lm
    from viasd_hf import RoutingMask

    folder = tmp_path / "my-config"
    RoutingMask.from_model(tiny_causal_lm("llama"), skip=[2]).save_pretrained(folder / "slim-mask")
    ViaSDConfig(routing_mask="slim-mask", self_draft_mask="org/hub-masks").save_pretrained(folder)
    monkeypatch.chdir(tmp_path)  # elsewhere: "slim-mask" names nothing here
    config = ViaSDConfig.from_pretrained(folder)
    assert config.routing_mask == str(folder / "slim-mask") and config.self_draft_mask == "org/hub-masks"
    assert config.vocabulary == "auto"

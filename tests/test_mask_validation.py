"""A routing mask file (or dict) with a wrong type or a missing field raises ``RoutingMaskError`` naming
the field; nothing is coerced silently (``"0145"`` never becomes ``[0, 1, 4, 5]``)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_causal_lm
from viasd_hf import RoutingMask, RoutingMaskError
from viasd_hf.masks.routing_mask import MASK_FILENAME


@pytest.fixture(scope="module")
def valid() -> dict:
    model = tiny_causal_lm("llama", seed=0, dtype=torch.float64)
    return RoutingMask.from_model(model, skip=[2, 3], objective="kl", objective_value=0.25, search_time_s=1.5).to_dict()


def write(tmp_path, data) -> None:
    (tmp_path / MASK_FILENAME).write_text(json.dumps(data))


WRONG = [
    ("kept_layers", "0145"),
    ("kept_layers", [0, True, 4, 5]),
    ("kept_layers", [0, 1.0, 4, 5]),
    ("kept_layers", [0, "1", 4, 5]),
    ("kept_layers", {"0": 1}),
    ("kept_layers", None),
    ("num_layers", "6"),
    ("num_layers", 6.0),
    ("num_layers", True),
    ("num_layers", 0),
    ("target_id", 5),
    ("target_fingerprint", None),
    ("drafter_id", ["self"]),
    ("target_revision", 3),
    ("objective", 1.5),
    ("objective_value", "0.25"),
    ("objective_value", True),
    ("alpha1", "0.5"),
    ("alpha2", False),
    ("skip_ratio", "half"),
    ("search_time_s", [1.5]),
    ("calibration", {"texts": 3}),
    ("library_version", 0.1),
    ("schema_version", "1"),
    ("schema_version", 1.0),
    ("metadata", "notes"),
    ("metadata", [1, 2]),
]


@pytest.mark.parametrize(("field", "value"), WRONG, ids=[f"{f}={v!r}" for f, v in WRONG])
def test_a_wrongly_typed_field_in_a_mask_file_is_named(tmp_path, valid, field, value):
    write(tmp_path, valid | {field: value})
    with pytest.raises(RoutingMaskError, match=field):
        RoutingMask.from_pretrained(tmp_path)
    with pytest.raises(RoutingMaskError, match=field):
        RoutingMask(**valid | {field: value})


@pytest.mark.parametrize("field", ["kept_layers", "num_layers", "target_id", "target_fingerprint"])
def test_a_missing_required_field_is_named(tmp_path, valid, field):
    data = dict(valid)
    del data[field]
    write(tmp_path, data)
    with pytest.raises(RoutingMaskError, match=field):
        RoutingMask.from_pretrained(tmp_path)


def test_a_binary_file_is_a_routing_mask_error(tmp_path):
    (tmp_path / MASK_FILENAME).write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe binary")
    with pytest.raises(RoutingMaskError, match="UTF-8"):
        RoutingMask.from_pretrained(tmp_path)


@pytest.mark.parametrize("payload", ["[1, 2, 3]", '"kept_layers"', "null", "{not json"])
def test_a_file_that_is_not_a_json_object_is_a_routing_mask_error(tmp_path, payload):
    (tmp_path / MASK_FILENAME).write_text(payload)
    with pytest.raises(RoutingMaskError):
        RoutingMask.from_pretrained(tmp_path)


def test_a_valid_file_still_loads_and_round_trips(tmp_path, valid):
    write(tmp_path, valid)
    mask = RoutingMask.from_pretrained(tmp_path)
    assert mask.to_dict() == valid
    assert mask.kept_layers == [0, 1, 4, 5]
    assert RoutingMask(**valid | {"kept_layers": (5, 0, 4, 1)}).kept_layers == [0, 1, 4, 5]  # tuples are fine


def test_routed_names_what_it_takes_instead_of_failing_on_an_attribute():
    import pytest
    from torch import nn

    from conftest import tiny_causal_lm
    from viasd_hf import MaskSet, RoutingMask, UnsupportedArchitectureError, routed

    model = tiny_causal_lm("llama")
    masks = MaskSet({"general": RoutingMask.from_model(model, skip=[2])})
    with pytest.raises(TypeError, match=r"routed\(\) takes a RoutingMask, got MaskSet: pass one of its masks"):
        with routed(model, masks):
            pass
    with pytest.raises(UnsupportedArchitectureError, match="Linear is not a transformers model"):
        with routed(nn.Linear(4, 4), masks.default_mask):
            pass


def test_a_mask_sets_schema_version_of_the_wrong_type_is_named_not_blamed_on_the_version():
    import pytest

    from conftest import tiny_causal_lm
    from viasd_hf import MaskSet, RoutingMask, RoutingMaskError

    mask = RoutingMask.from_model(tiny_causal_lm("llama"), skip=[2])
    with pytest.raises(RoutingMaskError, match="schema_version must be an int, got '1' \\(str\\)"):
        MaskSet({"general": mask}, schema_version="1")
    with pytest.raises(RoutingMaskError, match="upgrade viasd_hf"):
        MaskSet({"general": mask}, schema_version=99)

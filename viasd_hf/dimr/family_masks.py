"""``family_masks.json``: per task family, the finalist that won on that family's validation windows.

A searched mask is one compromise over every task family; a deployment that knows its task can
route with the mask that did best on that family instead. The file sits next to the folder's
``routing_mask.json`` (the general winner), at the same budget, and is plain JSON so that any
consumer (a set of named masks, a router by task) can read it without this library:

- ``target_id``, ``target_fingerprint``, ``num_layers``, ``drafter_id``: the general mask's identity;
- ``k``, ``skip_ratio``: the budget every family mask shares; ``objective``, ``alpha1``, ``alpha2``;
- ``general``: the general winner's ``skipped`` / ``kept_layers`` and pooled ``validation`` score;
- ``families``: family -> ``skipped``, ``kept_layers``, ``validation`` (``kl``, ``top1``, ``via``,
  ``positions`` on that family's validation windows), ``validation_objective``,
  ``general_validation_objective`` (the general winner on the same windows), ``same_as_general``,
  ``calibration_rank`` and ``validation_prompt_ids``;
- ``search_command``: how to redo it. :func:`load_family_masks` turns the file back into masks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from viasd_hf.dimr.selection import Selection
from viasd_hf.masks.routing_mask import RoutingMask

FAMILY_MASKS_FILENAME = "family_masks.json"
FORMAT_VERSION = 1


def family_masks_record(
    mask: RoutingMask, selection: Selection, families: Mapping[str, str], validation_ids: Sequence[str]
) -> dict[str, Any]:
    """The contents of ``family_masks.json`` for ``mask`` (the general winner) and its search's ``selection``."""
    name = selection.objective

    def layers(skipped: Sequence[int]) -> dict[str, list[int]]:
        return {"skipped": list(skipped), "kept_layers": [i for i in range(mask.num_layers) if i not in set(skipped)]}

    general = selection.winner
    return {
        "format_version": FORMAT_VERSION,
        "target_id": mask.target_id,
        "target_fingerprint": mask.target_fingerprint,
        "num_layers": mask.num_layers,
        "drafter_id": mask.drafter_id,
        "k": len(general.skipped),
        "skip_ratio": mask.skip_ratio,
        "objective": name,
        "alpha1": mask.alpha1,
        "alpha2": mask.alpha2,
        "general": {**layers(general.skipped), "validation": asdict(general.validation)},
        "families": {
            family: {
                **layers(winner.skipped),
                "validation": asdict(winner.families[family]),
                "validation_objective": winner.families[family].objective(name),
                "general_validation_objective": general.families[family].objective(name),
                "same_as_general": winner.skipped == general.skipped,
                "calibration_rank": winner.calibration_rank,
                "validation_prompt_ids": [i for i in validation_ids if families.get(i) == family],
            }
            for family, winner in selection.family_winners.items()
        },
        "search_command": (mask.metadata or {}).get("search_command"),
    }


def write_family_masks(folder: str | Path, record: Mapping[str, Any]) -> Path:
    """Write ``record`` to ``folder/family_masks.json``."""
    path = Path(folder) / FAMILY_MASKS_FILENAME
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def load_family_masks(folder: str | Path) -> dict[str, RoutingMask]:
    """Family -> ``RoutingMask``, from a mask folder holding ``routing_mask.json`` and ``family_masks.json``.

    Each family mask is the folder's mask with that family's layers, so it carries the same
    target identity and refuses any other model.
    """
    folder = Path(folder)
    path = folder / FAMILY_MASKS_FILENAME
    if not path.is_file():
        raise FileNotFoundError(f"no {FAMILY_MASKS_FILENAME} in {folder}; search with --corpus stratified to write one")
    record = json.loads(path.read_text())
    general = RoutingMask.from_pretrained(folder)
    if record.get("target_fingerprint") != general.target_fingerprint:
        raise ValueError(f"{path} was written for another target ({record.get('target_id')}) than {folder}'s routing mask")
    return {
        family: replace(general, kept_layers=list(entry["kept_layers"]), objective_value=None,
                        metadata={"family": family, "validation": entry["validation"], "general_mask": str(folder)})  # fmt: skip
        for family, entry in record["families"].items()
    }

"""What a pair's calls learned on this machine, kept for the next process: so a first call, and a short answer,
start in the regime that measured faster instead of spending their first blocks deciding.

The speculation switch's durable part (``SpeculationSwitch.durable``: the regime, the cost ratios of nearby blocks,
tokens per block) is written at the end of every call that measured it, as JSON under
``$VIASD_HOME/verdicts``, keyed by the machine (``models.machine.machine_key``: CPU, kernels, threads, library
versions, handed in by ``generation``), the target and drafter (their paths, architectures and dtypes) and how the
call drafts and verifies (``memory.planner_key``). A new process's first call on that key resumes from it
(``SpeculationSwitch.resume``); later calls in the process use the planner kept on the model (``control.memory``).
A record that cannot be read is ignored, and every call measures on, so a stale verdict is corrected by the probes
that follow.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

from torch import nn

from viasd_hf.control.speculation_switch import SpeculationSwitch
from viasd_hf.hub.files import replace_files, viasd_home
from viasd_hf.masks.architectures import config_fingerprint


def verdicts_home() -> Path:
    return viasd_home() / "verdicts"


class VerdictStore:
    """This machine's verdicts, one file per target, drafter and key; ``machine()`` names the machine."""

    def __init__(self, machine: Callable[[], dict[str, Any]]) -> None:
        self.machine = machine

    def path(self, model: nn.Module, drafter_model: nn.Module | None, key: Hashable) -> Path:
        """Where the verdict for ``key`` (``memory.planner_key``, whose drafter is named by ``drafter_model``) lives."""
        identity = {"machine": self.machine(), "target": model_identity(model), "drafter": model_identity(drafter_model),
                    "key": repr(stable(key, id(drafter_model)))}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:24]
        return verdicts_home() / f"{digest}.json"

    @staticmethod
    def recall(path: Path) -> dict[str, Any] | None:
        """The verdict written at ``path`` (``SpeculationSwitch.durable``), if one was and it reads as a JSON object."""
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    @staticmethod
    def remember(switch: SpeculationSwitch, path: Path) -> None:
        """Keep what ``switch`` learned for the next process; a write that fails costs nothing but the memory."""
        try:
            replace_files(path.parent, {path.name: json.dumps(switch.durable(), indent=2) + "\n"})
        except OSError:
            pass


def model_identity(model: nn.Module | None) -> list[str] | None:
    """What names a model across processes: its path (or Hub id), its architecture's fingerprint, its dtype and its
    quantisation (a drafter's 4-bit copy drafts at another pace than the drafter it was made from, under one name)."""
    if model is None:
        return None
    path = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    quantization = getattr(getattr(model, "config", None), "quantization_config", None)
    method = (quantization.get("quant_method") if isinstance(quantization, dict)
              else getattr(quantization, "quant_method", None))
    method = str(getattr(method, "value", method) or "")  # an enum in transformers' configs, a string once saved
    return [path, config_fingerprint(model), str(getattr(model, "dtype", "")), method]


def stable(key: Hashable, drafter_id: int) -> Hashable:
    """``key`` with the drafter model's ``id()`` (which differs between processes) named by a word: the drafter is
    named by ``model_identity`` beside it."""
    if isinstance(key, tuple):
        return tuple(stable(part, drafter_id) for part in key)
    return "drafter model" if key == drafter_id and type(key) is int else key

"""What adaptive decoding remembers about a model between ``generate`` calls, kept where the user can see it.

The tier controllers' measurements persist across calls on the same model, mask, drafter and
thresholds, and so do the draft planner's costs and calibration (as HF keeps its assistant's draft
length and confidence threshold on the assistant), so short generations do not pay the warm-up
every time. They live on the model, as
``model.viasd_tier_memory`` (created by the first call that measures), and
``model.viasd_tier_memory.reset()`` forgets them. A copy or a pickle of the model starts with an
empty memory: the measurements describe this model object on this machine.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from torch import nn

from viasd_hf.config import ViaSDConfig
from viasd_hf.control.draft_planner import DraftPlanner
from viasd_hf.control.tier_controller import FixedChoice, TierController, measures_wall_clock, new_controller
from viasd_hf.masks.routing_mask import RoutingMask

ATTRIBUTE = "viasd_tier_memory"
_CREATING = threading.Lock()  # two first calls on one model must not each create its state
State = TypeVar("State", bound="ModelLocal")


class ModelLocal:
    """State kept on one model object (in its ``__dict__``, beside its attributes, not a submodule; ``kept_on``): a
    copy or a pickle of the model starts without it, since it describes this model object on this machine."""

    def __deepcopy__(self, memo: dict) -> ModelLocal:
        return type(self)()

    def __reduce__(self) -> tuple:
        return type(self), ()


def kept_on(model: nn.Module, attribute: str, new: Callable[[], State]) -> State:
    """``model``'s state under ``attribute``, made by ``new`` on first use, once whichever call comes first."""
    state = model.__dict__.get(attribute)
    if state is None:
        with _CREATING:
            state = model.__dict__.get(attribute)
            if state is None:
                state = model.__dict__[attribute] = new()
    return state


class TierMemory(ModelLocal):
    """The tier controllers that have been measuring one model, one per (mask, drafter, mode, thresholds), and the
    draft planners (``draft_planner``), one per (drafter, config, sampling)."""

    def __init__(self) -> None:
        self._controllers: dict[Hashable, TierController] = {}
        self._planners: dict[Hashable, DraftPlanner] = {}
        self._lock = threading.Lock()  # concurrent generate calls on one model share it

    def controller(self, key: Hashable, mask: RoutingMask, lossless: bool) -> TierController:
        """The controller measuring under ``key``; a new one (``tier_controller.new_controller``) the first time."""
        with self._lock:
            if key not in self._controllers:
                self._controllers[key] = new_controller(mask, lossless)
            return self._controllers[key]

    def planner(self, key: Hashable, new: Callable[[], DraftPlanner]) -> DraftPlanner:
        """A copy of the planner remembered under ``key`` (``new()`` the first time): each call plans with its own
        copy, so calls running at once never update one planner together."""
        with self._lock:
            remembered = self._planners.get(key)
            return copy.deepcopy(remembered) if remembered is not None else new()

    def remember_planner(self, key: Hashable, planner: DraftPlanner) -> None:
        """What a finished call's planner learned; of two calls that ran at once, the one that ends last is kept."""
        with self._lock:
            self._planners[key] = planner

    @property
    def controllers(self) -> dict[Hashable, TierController]:
        """A snapshot of what is remembered, by key."""
        with self._lock:
            return dict(self._controllers)

    @property
    def planners(self) -> dict[Hashable, DraftPlanner]:
        """A snapshot of the draft planners remembered, by key."""
        with self._lock:
            return dict(self._planners)

    def reset(self) -> None:
        """Forget every measurement: the next call starts from each mask's offline prediction and the draft planner's
        static costs and uncalibrated confidences."""
        with self._lock:
            self._controllers.clear()
            self._planners.clear()


def tier_memory(model: nn.Module) -> TierMemory:
    """``model.viasd_tier_memory``, created on first use."""
    return kept_on(model, ATTRIBUTE, TierMemory)


def tier_choice(
    model: nn.Module, mask: RoutingMask, drafter_key: Hashable, config: ViaSDConfig, do_sample: bool
) -> TierController | FixedChoice:
    """What decides, block by block, whether the slim tier runs (``ViaSDConfig.reproducible``)."""
    lossless = config.mode == "lossless"
    if not measures_wall_clock(config.reproducible, lossless, do_sample):
        return FixedChoice.for_mask(mask, lossless)
    key = (tuple(mask.kept_layers), drafter_key, config.mode, config.knobs.tau_accept, config.knobs.tau_escalate)
    return tier_memory(model).controller(key, mask, lossless)


def planner_key(
    drafter_key: Hashable, slim_mask: RoutingMask | None, config: ViaSDConfig, do_sample: bool
) -> Hashable | None:
    """Under which key a call's draft planner is remembered, or ``None`` where it must start afresh.

    Draft lengths never change lossless greedy output, but they change which tokens a sampling call
    draws and what the slim tier commits, so the planner is remembered exactly where the slim tier's
    choice is (where timings steer): a reproducible call depends on nothing before it.
    """
    if not measures_wall_clock(config.reproducible, config.mode == "lossless", do_sample):
        return None
    slim_layers = tuple(slim_mask.kept_layers) if slim_mask is not None else None
    return (drafter_key, slim_layers, config.mode, config.knobs.num_draft_tokens, config.knobs.max_slim_backlog, config.knobs.confidence,
            config.knobs.tau_accept, config.knobs.tau_escalate, config.knobs.cascade_lenience, do_sample)


def draft_planner(model: nn.Module, key: Hashable | None, new: Callable[[], DraftPlanner]) -> DraftPlanner:
    """The planner of a call: a copy of the one remembered under ``key`` (``planner_key``), else ``new()``."""
    return tier_memory(model).planner(key, new) if key is not None else new()


def drafter_identity(drafter: Any, drafter_model: nn.Module | None, config: ViaSDConfig) -> tuple:
    """What tells one drafter's measurements from another's (``drafter``: a batch drafter of ``engine.batch.drafting``):
    its kind, its model, the layers a self-drafter skips, its draft vocabulary and how much of the prompt an assistant
    reads."""
    mask = tuple(drafter.mask.kept_layers) if drafter.mask is not None else None
    vocabulary = drafter.head.key if drafter.head is not None else None
    context = config.drafter_context if drafter_model is not None else None
    return drafter.name, id(drafter_model), mask, vocabulary, context

"""Ranks of a sharded target agree: whatever one rank would decide from its own measurements, rank 0 decides for all.

A target sharded with tensor parallelism (``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``
under ``torchrun``) runs every pass as collectives across its ranks, and each rank runs the whole decode loop, so every
rank must run the same passes: the same drafts, draft lengths, tier and tokens. A choice taken on a measurement (a
block's seconds, the drafter's fastest form) would differ from rank to rank, as timings do; the ranks would then run
passes of different shapes, and the collectives fail (gloo: "Received data size doesn't match expected size") or hang.
So where a call's choice rests on something measured or looked up, rank 0 takes it and a broadcast carries it to the
others (``from_rank_zero``; a block's seconds: ``engine.clock.AgreedClock``). Every rank takes the same path through
a call, so each broadcast is reached in the same order on every rank.

Only a sharded target's ranks agree: ranks that each hold a whole model (data parallelism, each its own prompts) run
calls of their own, which must never wait for one another (docs/design.md, "Sharded targets").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

T = TypeVar("T")


@dataclass(frozen=True)
class Shards:
    """The ranks a model is sharded over: their process group, and the device its collectives carry tensors on (the
    rank's own: the CPU under gloo, its GPU under NCCL)."""

    group: dist.ProcessGroup
    device: torch.device

    @property
    def source(self) -> int:
        """The global rank of the group's rank 0, whose measurements every rank goes by."""
        return dist.get_global_rank(self.group, 0)

    @property
    def decides(self) -> bool:
        """Whether this rank is the group's rank 0."""
        return dist.get_rank() == self.source


def shards_of(model: nn.Module | None) -> Shards | None:
    """The ranks ``model``'s weights are sharded over (``DTensor`` parameters, as transformers' tensor parallelism
    makes them), on the process group of their device mesh; ``None`` for a model each rank holds whole, or outside a
    distributed run. A mesh of several dimensions (tensor parallelism within data-parallel shards) agrees over the
    default process group: its ranks all run the passes together."""
    if model is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.tensor import DTensor  # here: a torch built without distributed support lacks it

    for parameter in model.parameters():
        if isinstance(parameter, DTensor):
            mesh = parameter.device_mesh
            if mesh.size() == 1:
                return None
            group = mesh.get_group() if mesh.ndim == 1 else dist.group.WORLD
            return Shards(group, parameter.device)
    return None


def from_rank_zero(shards: Shards | None, decide: Callable[[], T]) -> T:
    """What ``decide()`` returns on rank 0 of ``shards``, on every rank (only rank 0 calls it); ``decide()`` itself
    for a model that is not sharded. Where rank 0's ``decide`` raises, every rank raises, so none waits for it."""
    if shards is None:
        return decide()
    if not shards.decides:
        carried: list[Any] = [None]
        _broadcast_object(shards, carried)
        value, failure = carried[0]
        if failure is not None:
            raise RuntimeError(f"rank 0 of the sharded model failed: {failure}")
        return value
    try:
        value = decide()
    except Exception as error:
        _broadcast_object(shards, [(None, f"{type(error).__name__}: {error}")])
        raise
    _broadcast_object(shards, [(value, None)])
    return value


def _broadcast_object(shards: Shards, carried: list[Any]) -> None:
    """Rank 0's ``carried[0]`` into ``carried`` on every rank of ``shards``."""
    dist.broadcast_object_list(carried, src=shards.source, group=shards.group, device=shards.device)

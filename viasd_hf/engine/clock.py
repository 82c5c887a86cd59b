"""Where the decode loop's seconds come from: every timing that steers a decision (the speculation switch, the draft
planner, the tier controller) is read from one ``Clock`` per call, so a test can drive those decisions with a fake
clock and the ranks of a sharded target read the same seconds (``AgreedClock``)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

from viasd_hf.engine.shards import Shards, shards_of


class Clock:
    """Seconds as ``time.perf_counter`` counts them."""

    def now(self) -> float:
        return time.perf_counter()

    def since(self, started: float) -> float:
        """The seconds from ``started`` (a reading of ``now``) to now."""
        return self.now() - started


class AgreedClock(Clock):
    """Rank 0 decides, a broadcast carries it: the clock of a call on a sharded target.

    The learners decide deterministically from the seconds they are fed, so ranks that read the same seconds take
    the same decisions and run passes of the same shapes; ranks that each read their own would not (``engine.shards``).
    ``since`` measures on every rank and returns rank 0's measurement, a float64 broadcast over the model's process
    group; every rank reaches each ``since`` in the same order, as every rank takes the same path through the call.
    ``now`` stays local: a reading means nothing until ``since`` measures from it.
    """

    def __init__(self, local: Clock, shards: Shards) -> None:
        self.local = local
        self.shards = shards

    def now(self) -> float:
        return self.local.now()

    def since(self, started: float) -> float:
        seconds = torch.tensor([self.local.since(started)], dtype=torch.float64, device=self.shards.device)
        dist.broadcast(seconds, src=self.shards.source, group=self.shards.group)
        return float(seconds.item())


def call_clock(model: nn.Module) -> Clock:
    """The clock a call on ``model`` reads its seconds from: on a sharded target, rank 0's (``AgreedClock``)."""
    shards = shards_of(model)
    return Clock() if shards is None else AgreedClock(Clock(), shards)

"""A reproducible background CPU load, for ``viasd bench --load steady|bursty``.

Users decode on machines that are doing other things, and the methods need not suffer alike: a method that
wins by running more, smaller passes may lose more to a neighbour than greedy does. The bench therefore can
run its timed calls beside a load it starts itself, the same load on every run.

A load is busy worker processes, each this file run as a script by the bench's own interpreter, spinning a
pure-Python loop. Processes, not threads: threads of the bench would take turns with it on one interpreter
lock and steal only from its Python, not from its torch kernels. A worker imports nothing but the standard
library (starting it costs milliseconds, not the bench's imports) and is switched through its stdin: ``1``
busy, ``0`` idle; it ends when the pipe closes, which is also what happens when the bench dies, and checks
that its parent is still the bench in case another process holds the pipe open.

``steady``: the workers are busy from start to stop. ``bursty``: a thread of the bench switches them on and
off by :data:`BURSTY`, a fixed cycle of three bursts of different lengths at uneven gaps; it starts on.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, BinaryIO, Protocol

LOADS = ("none", "steady", "bursty")
# (busy seconds, idle seconds), repeated every 4.85 s, busy a quarter of the time. One period would line up with
# calls lasting a multiple of it, every call seeing its burst at the same moment; bursts of three lengths at
# three gaps land at varied moments of calls of any length.
BURSTY: tuple[tuple[float, float], ...] = ((0.4, 1.2), (0.25, 0.7), (0.6, 1.7))
SCHEDULES: dict[str, tuple[tuple[float, float], ...]] = {"steady": (), "bursty": BURSTY}  # (): busy throughout


def phase(schedule: Sequence[tuple[float, float]], elapsed: float) -> tuple[bool, float | None]:
    """Whether the load is on ``elapsed`` seconds after it started, and the seconds until that changes (``None``:
    never). A function of the time alone, so that every run sees the same bursts at the same moments."""
    if not schedule:
        return True, None
    moment = elapsed % sum(busy + idle for busy, idle in schedule)
    for busy, idle in schedule:
        if moment < busy:
            return True, busy - moment
        if moment < busy + idle:
            return False, busy + idle - moment
        moment -= busy + idle
    return True, schedule[0][0]  # rounding put the moment on the cycle's end: the next burst starts


class Switchable(Protocol):
    def switch(self, on: bool) -> None: ...


def follow(schedule: Sequence[tuple[float, float]], workers: Sequence[Switchable], wait: Callable[[float | None], bool],
           clock: Callable[[], float] = time.monotonic) -> None:
    """Switch ``workers`` as ``schedule`` says, from now on, until ``wait`` (seconds to wait; ``None``: until
    stopped) returns true: asked to stop. ``wait`` and ``clock`` are injectable so that a test's clock drives it."""
    started, state = clock(), None
    while True:
        on, left = phase(schedule, clock() - started)
        if on != state:
            for worker in workers:
                worker.switch(on)
            state = on
        if wait(left):
            return


class Worker:
    """One busy process: this file run as a script, idle until switched on."""

    def __init__(self) -> None:
        self.process = subprocess.Popen([sys.executable, "-I", __file__], stdin=subprocess.PIPE)

    def switch(self, on: bool) -> None:
        self.process.stdin.write(b"1" if on else b"0")
        self.process.stdin.flush()

    def stop(self) -> None:
        """Close its pipe, which ends it; kill it if it is still there a second later."""
        with suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass(frozen=True)
class Load:
    """The background load of one bench: ``kind`` from :data:`LOADS`, ``workers`` busy processes."""

    kind: str = "none"
    workers: int = 1

    def record(self) -> dict[str, Any]:
        """What the run files keep: the kind, the workers that ran, and the bursty schedule in seconds."""
        schedule = SCHEDULES.get(self.kind)
        return {"kind": self.kind, "workers": 0 if schedule is None else self.workers,
                "schedule": [{"busy_s": busy, "idle_s": idle} for busy, idle in schedule] if schedule else None}

    def __str__(self) -> str:
        if self.kind == "none":
            return "no background load"
        busy = f"{self.workers} busy process{'es' if self.workers > 1 else ''}"
        if not SCHEDULES[self.kind]:
            return f"steady background load ({busy})"
        cycle = ", ".join(f"{on:g} s on / {off:g} s off" for on, off in SCHEDULES[self.kind])
        return f"bursty background load ({busy}: {cycle}, repeating)"

    @contextmanager
    def running(self) -> Iterator[list[Worker]]:
        """The load on for the body and stopped when it ends, however it ends (an error, Ctrl-C)."""
        if self.kind not in LOADS:
            raise ValueError(f"unknown load {self.kind!r}; choose from {', '.join(LOADS)}")
        workers: list[Worker] = []
        stop = threading.Event()
        switcher = threading.Thread(target=follow, args=(SCHEDULES.get(self.kind, ()), workers, stop.wait), daemon=True)
        try:
            if self.kind != "none":
                workers.extend(Worker() for _ in range(self.workers))
                switcher.start()
            yield workers
        finally:
            stop.set()
            if switcher.is_alive():
                switcher.join()
            for worker in workers:
                worker.stop()


# -- the worker process: standard library only ---------------------------------------------------------------


def _listen(commands: BinaryIO, on: threading.Event) -> None:
    """Follow the bench's switches; end the worker when the bench closes the pipe or dies."""
    while command := commands.read(1):
        if command == b"1":
            on.set()
        elif command == b"0":
            on.clear()
    os._exit(0)


def _spin(iterations: int = 20_000) -> int:
    """A few milliseconds of pure-Python work."""
    total = 0
    for i in range(iterations):
        total += i * i
    return total


def _work(commands: BinaryIO) -> None:
    """Spin while switched on, sleep while off, until the bench is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle; it closes the pipe
    on, bench = threading.Event(), os.getppid()
    threading.Thread(target=_listen, args=(commands, on), daemon=True).start()
    while os.getppid() == bench:
        if on.wait(timeout=1.0):
            _spin()


if __name__ == "__main__":
    _work(sys.stdin.buffer)

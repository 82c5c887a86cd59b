"""The background load of ``viasd bench --load`` (:mod:`viasd_hf.bench.load`): its schedule on a fake clock, and
real busy processes, running while the load is on, idle while a burst is off, gone when the load ends, however
it ends. Nothing here times anything: a process's state is read, not its speed."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

import psutil
import pytest
from test_bench import DigitTokenizer, outcome

from viasd_hf.bench import load as load_module
from viasd_hf.bench.load import BURSTY, Load, Worker, follow, phase
from viasd_hf.bench.report import environment
from viasd_hf.bench.runner import run_methods
from viasd_hf.data.tasks import Example

CYCLE = sum(busy + idle for busy, idle in BURSTY)
# The bursty load's switches in its first cycle: on at 0, off at 0.4, on at 1.6, ...
SWITCHES = [(0.0, True), (0.4, False), (1.6, True), (1.85, False), (2.55, True), (3.15, False)]


def eventually(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def status(worker: Worker) -> str:
    return psutil.Process(worker.process.pid).status()


def cpu_seconds(worker: Worker) -> float:
    times = psutil.Process(worker.process.pid).cpu_times()
    return times.user + times.system


@pytest.mark.parametrize("cycle", [0, 1, 40])
def test_the_bursty_schedule_switches_at_the_same_moments_of_every_cycle(cycle):
    assert CYCLE == pytest.approx(4.85)
    for (moment, on), (end, _) in zip(SWITCHES, [*SWITCHES[1:], (CYCLE, True)]):
        for elapsed in (moment + 0.001, (moment + end) / 2, end - 0.001):
            state, left = phase(BURSTY, cycle * CYCLE + elapsed)
            assert state is on and left == pytest.approx(end - elapsed, abs=1e-6), (cycle, elapsed)


def test_a_steady_load_is_on_throughout():
    assert all(phase((), elapsed) == (True, None) for elapsed in (0.0, 0.4, 1.6, 1e6))


class Recorder:
    """A worker that writes down when it was switched, by the fake clock."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock, self.switches = clock, []

    def switch(self, on: bool) -> None:
        self.switches.append((round(self.clock(), 6), on))


def followed(schedule, until: float, late: float = 0.0) -> tuple[list[tuple[float, bool]], list[float | None]]:
    """The switches ``follow`` makes over ``until`` seconds of a fake clock, each wait overshooting by ``late``;
    the clock ticks by a nanosecond at least, as a real one does (a wait rounded to nothing is not a hang)."""
    now, waits = [100.0], []

    def wait(seconds: float | None) -> bool:
        waits.append(seconds)
        if seconds is None or now[0] + seconds > 100.0 + until:
            return True
        now[0] += max(seconds, 1e-9) + late
        return False

    worker = Recorder(lambda: now[0] - 100.0)
    follow(schedule, [worker], wait, clock=lambda: now[0])
    return worker.switches, waits


def test_the_switcher_follows_the_schedule_and_every_run_switches_alike():
    switches, _ = followed(BURSTY, 2 * CYCLE - 0.01)
    expected = SWITCHES + [(moment + CYCLE, on) for moment, on in SWITCHES]
    assert [on for _, on in switches] == [on for _, on in expected]
    assert [moment for moment, _ in switches] == pytest.approx([moment for moment, _ in expected])
    assert followed(BURSTY, 2 * CYCLE - 0.01) == followed(BURSTY, 2 * CYCLE - 0.01), "no randomness"


def test_a_late_wake_up_does_not_shift_the_later_bursts():
    switches, _ = followed(BURSTY, 2 * CYCLE - 0.1, late=0.03)
    expected = SWITCHES + [(moment + CYCLE, on) for moment, on in SWITCHES]
    assert [on for _, on in switches] == [on for _, on in expected]
    assert [moment for moment, _ in switches] == pytest.approx([moment + 0.03 * (i > 0) for i, (moment, _) in
                                                                enumerate(expected)], abs=1e-6)


def test_the_steady_switcher_switches_on_once_and_waits_to_be_stopped():
    switches, waits = followed((), 100.0)
    assert switches == [(0.0, True)] and waits == [None]


def test_a_worker_is_busy_only_while_switched_on():
    worker = Worker()
    try:
        assert eventually(lambda: status(worker) == psutil.STATUS_SLEEPING), "idle until switched on"
        worker.switch(True)
        assert eventually(lambda: status(worker) == psutil.STATUS_RUNNING)
        worker.switch(False)
        assert eventually(lambda: status(worker) == psutil.STATUS_SLEEPING)
    finally:
        worker.stop()
    assert worker.process.poll() is not None


def test_a_steady_load_runs_its_processes_until_it_ends():
    with Load("steady", workers=2).running() as workers:
        assert len(workers) == 2
        assert all(eventually(lambda: status(worker) == psutil.STATUS_RUNNING) for worker in workers)
        spent = [cpu_seconds(worker) for worker in workers]  # and stays busy: its CPU time grows, whatever else runs
        assert all(eventually(lambda: cpu_seconds(worker) > before + 0.1) for worker, before in zip(workers, spent))
    assert all(worker.process.poll() is not None for worker in workers)


def test_the_bursty_switcher_pauses_real_processes_between_bursts():
    """``follow`` on a clock the test moves, switching a real worker: busy in a burst, asleep between."""
    now, steps = [0.0], queue.Queue()

    def wait(seconds: float | None) -> bool:
        if not steps.get(timeout=10):
            return True
        now[0] += seconds
        return False

    worker = Worker()
    switcher = threading.Thread(target=follow, args=(BURSTY, [worker], wait), kwargs={"clock": lambda: now[0]})
    try:
        assert eventually(lambda: status(worker) == psutil.STATUS_SLEEPING), "started, idle until switched"
        switcher.start()
        for expected in (psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING, psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING):
            assert eventually(lambda: status(worker) == expected), now[0]  # at 0, 0.4, 1.6 and 1.85 s
            steps.put(True)
        steps.put(False)
        switcher.join(timeout=10)
        assert not switcher.is_alive()
    finally:
        steps.put(False)
        worker.stop()


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_the_load_ends_when_the_bench_fails_or_is_interrupted(error):
    with pytest.raises(error):
        with Load("bursty", workers=2).running() as workers:
            raise error("the bench stopped")
    assert len(workers) == 2 and all(worker.process.poll() is not None for worker in workers)


def test_a_worker_ends_itself_when_the_bench_dies():
    """A bench that dies without stopping its load (killed) closes the workers' pipes: they end themselves. The
    stand-in bench loads the module by path, as the workers run it, to start in milliseconds."""
    bench = (
        "import importlib.util, os, sys\n"
        f"spec = importlib.util.spec_from_file_location('load', {load_module.__file__!r})\n"
        "load = sys.modules['load'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(load)\n"
        "worker = load.Worker()\n"
        "worker.switch(True)\n"
        "print(worker.process.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    pid = int(subprocess.run([sys.executable, "-c", bench], capture_output=True, text=True, check=True).stdout)

    def ended() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert eventually(ended)


def test_no_load_starts_nothing_and_an_unknown_one_is_refused():
    with Load().running() as workers:
        assert workers == []
    with pytest.raises(ValueError, match="unknown load 'heavy'"):
        with Load("heavy").running():
            pass


def test_the_runner_holds_the_load_over_the_timed_calls_only():
    events: list[object] = []

    @contextmanager
    def load():
        events.append("on")
        yield
        events.append("off")

    def greedy(ids, common):
        events.append(common["max_new_tokens"])
        return outcome([1, 2], 0.1, 2)

    examples = [Example("custom", "hello"), Example("custom", "there")]
    run_methods({"greedy": greedy}, DigitTokenizer(), examples, 20, repeats=2, load=load())
    assert events == [8, "on", 20, 20, 20, 20, "off"], "the warm-up (8 tokens) before the load"


def test_the_run_records_and_names_its_load():
    assert Load().record() == {"kind": "none", "workers": 0, "schedule": None}
    assert Load("steady", 2).record() == {"kind": "steady", "workers": 2, "schedule": None}
    bursty = Load("bursty").record()
    assert [(step["busy_s"], step["idle_s"]) for step in bursty["schedule"]] == list(BURSTY)
    assert environment(1.0, bursty)["load"] == bursty
    assert str(Load()) == "no background load"
    assert str(Load("steady", 2)) == "steady background load (2 busy processes)"
    assert str(Load("bursty")) == ("bursty background load (1 busy process: 0.4 s on / 1.2 s off, 0.25 s on / 0.7 s "
                                   "off, 0.6 s on / 1.7 s off, repeating)")

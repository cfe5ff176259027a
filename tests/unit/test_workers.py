"""The `--workers` supervisor, over real processes (not Ferry: a sleeper)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.workers import supervise


def sleeper() -> None:
    """A worker that stops cleanly on SIGTERM, as Ferry's do."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    time.sleep(60)


def _children(n: int) -> list[multiprocessing.process.BaseProcess]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [p for p in multiprocessing.active_children() if p.name.startswith("ferry-worker")]
        if len(alive) == n:
            return alive
        time.sleep(0.05)
    raise AssertionError(f"expected {n} workers")


@pytest.mark.parametrize(("killed", "status"), [(1, 0), (2, 1)])
def test_a_worker_that_died_before_the_stop_fails_it_only_if_none_was_left(
    killed: int, status: int
) -> None:
    """Workers killed, their restarts still ahead, when SIGTERM comes: with one
    left to stop cleanly the stop is clean (exit 0); with none, it is not."""

    def kill_then_stop() -> None:
        for worker in _children(2)[:killed]:
            os.kill(worker.pid or 0, signal.SIGKILL)
        _children(2 - killed)
        time.sleep(0.3)  # the supervisor has seen the deaths and set their restarts
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_then_stop)
    killer.start()
    code = supervise(2, sleeper, (), stop_timeout_s=10, restart_delay_s=60, poll_s=0.05)
    killer.join()
    assert code == status


def flaky(counter: str) -> None:
    """Run n of a worker (counted in the file `counter`): the first serves, the
    second fails at once (Redis down just then), the third serves again."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(counter, "a+") as f:
        f.write("x")
    with open(counter) as f:
        run = len(f.read())
    if run == 2:
        sys.exit(1)
    time.sleep(60)


def test_a_restart_that_fails_at_once_is_tried_again(tmp_path: Path) -> None:
    """A worker killed after it ran a while, whose restart then fails before
    `min_uptime_s`, is started again after a longer wait: the service is back to
    its N workers, not one short for good."""
    counter = str(tmp_path / "runs")

    def runs() -> int:
        with open(counter) as f:
            return len(f.read())

    def kill_then_stop() -> None:
        [first] = _children(1)
        time.sleep(0.4)  # past min_uptime_s: it served
        os.kill(first.pid or 0, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while runs() < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        _children(1)  # the third run serves
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_then_stop)
    killer.start()
    code = supervise(
        1,
        flaky,
        (counter,),
        stop_timeout_s=10,
        restart_delay_s=0.05,
        min_uptime_s=0.3,
        poll_s=0.05,
    )
    killer.join()
    assert runs() == 3 and code == 0

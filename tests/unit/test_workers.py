"""The `--workers` supervisor, over real processes (not Ferry: a sleeper)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

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

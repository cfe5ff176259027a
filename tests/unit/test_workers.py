"""The `--workers` supervisor, over real processes (not Ferry: a sleeper)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time

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


def test_a_worker_that_died_before_the_stop_does_not_fail_it() -> None:
    """One worker killed, its restart still ahead, when SIGTERM comes: the
    others stop cleanly, and the supervisor says so (exit 0)."""

    def kill_one_then_stop() -> None:
        first, _ = _children(2)
        os.kill(first.pid or 0, signal.SIGKILL)
        _children(1)
        time.sleep(0.3)  # the supervisor has seen the death and set its restart
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_one_then_stop)
    killer.start()
    status = supervise(2, sleeper, (), stop_timeout_s=10, restart_delay_s=60, poll_s=0.05)
    killer.join()
    assert status == 0

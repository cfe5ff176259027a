"""The `--workers` supervisor, over real processes (not Ferry: a sleeper)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from proxy.workers import (
    EXIT_CONFIG,
    FLEET_SNAPSHOT,
    HEARTBEAT,
    MAX_FAILED_RESTARTS,
    SUPERVISOR,
    _kill_if_silent,
    supervise,
)


def sleeper(ready: str) -> None:
    """A worker that stops cleanly on SIGTERM, as Ferry's do; it says it is
    ready (a file in the folder `ready`) once a SIGTERM would find it so."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    Path(ready, str(os.getpid())).touch()
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
    killed: int, status: int, tmp_path: Path
) -> None:
    """Workers killed, their restarts still ahead, when SIGTERM comes: with one
    left to stop cleanly the stop is clean (exit 0); with none, it is not."""

    def kill_then_stop() -> None:
        workers = _children(2)
        deadline = time.monotonic() + 30  # a spawned child takes seconds on a busy machine
        while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        for worker in workers[:killed]:
            os.kill(worker.pid or 0, signal.SIGKILL)
        _children(2 - killed)
        time.sleep(0.3)  # the supervisor has seen the deaths and set their restarts
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_then_stop)
    killer.start()
    code = supervise(
        2, sleeper, (str(tmp_path),), stop_timeout_s=10, restart_delay_s=60, poll_s=0.05
    )
    killer.join()
    assert code == status


def flaky(counter: str, then: str) -> None:
    """Run n of a worker (counted in the file `counter`): the first serves; of
    the restarts, `then` = "once": the first fails at once (Redis down just
    then) and the next serves; "always": every one fails at once; "config":
    every one finds the config file broken."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with open(counter, "a+") as f:
        f.write("x")
    with open(counter) as f:
        run = len(f.read())
    if run > 1 and then == "config":
        sys.exit(EXIT_CONFIG)
    if run == 2 or (run > 1 and then == "always"):
        sys.exit(1)
    os.utime(os.environ[HEARTBEAT])  # it serves, as Ferry's workers say by their first beat
    time.sleep(60)


MIN_UPTIME_S = 1.5  # past a spawned worker's start on a slow machine


def supervise_flaky(counter: str, then: str, stop_after_runs: int | None) -> int:
    """Supervise one `flaky` worker: kill its first run once it has served, then
    SIGTERM the supervisor once `stop_after_runs` runs started (if given)."""

    def runs() -> int:
        if not os.path.exists(counter):  # no run has begun
            return 0
        with open(counter) as f:
            return len(f.read())

    def kill_then_stop() -> None:
        [first] = _children(1)
        deadline = time.monotonic() + 30
        while runs() < 1 and time.monotonic() < deadline:  # it has started (imports done)
            time.sleep(0.05)
        time.sleep(MIN_UPTIME_S + 0.2)  # it served
        os.kill(first.pid or 0, signal.SIGKILL)
        if stop_after_runs is None:
            return
        deadline = time.monotonic() + 30
        while runs() < stop_after_runs and time.monotonic() < deadline:
            time.sleep(0.05)
        _children(1)  # that run serves
        os.kill(os.getpid(), signal.SIGTERM)

    killer = threading.Thread(target=kill_then_stop)
    killer.start()
    code = supervise(
        1,
        flaky,
        (counter, then),
        stop_timeout_s=10,
        restart_delay_s=0.1,
        min_uptime_s=MIN_UPTIME_S,
        poll_s=0.02,
    )
    killer.join()
    return code


def test_a_restart_that_fails_at_once_is_tried_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker killed after it ran a while, whose restart then fails before
    `min_uptime_s`, is started again after a longer wait: the service is back to
    its N workers, not one short for good."""
    counter = str(tmp_path / "runs")
    with caplog.at_level("INFO", logger="ferry.workers"):
        code = supervise_flaky(counter, "once", stop_after_runs=3)
    assert code == 0
    with open(counter) as f:
        assert f.read() == "xxx"
    assert "another starts in 0.1 s" in caplog.text  # after the kill
    assert "another starts in 0.2 s" in caplog.text  # the failed restart: twice as long
    # Its workers' variables go with it: a `ferry serve` started later would take
    # this process for its supervisor (a reload there sent it SIGHUP).
    assert SUPERVISOR not in os.environ and FLEET_SNAPSHOT not in os.environ


@pytest.mark.parametrize(("then", "runs"), [("always", 1 + MAX_FAILED_RESTARTS), ("config", 2)])
def test_a_worker_that_cannot_start_again_is_given_up(tmp_path: Path, then: str, runs: int) -> None:
    """Restarts that keep failing at once end after MAX_FAILED_RESTARTS; a worker
    whose config file is broken is not restarted at all. With no worker left the
    supervisor exits 1, which is what a service manager sees."""
    counter = str(tmp_path / "runs")
    assert supervise_flaky(counter, then, stop_after_runs=None) == 1
    with open(counter) as f:
        assert len(f.read()) == runs


def slow_to_fail(counter: str) -> None:
    """A worker whose start fails (exit 1) after `MIN_UPTIME_S`, before it ever
    beat: a start on a loaded host that found Redis down."""
    with open(counter, "a") as f:
        f.write("x")
    time.sleep(MIN_UPTIME_S + 0.5)
    sys.exit(1)


def test_a_worker_that_fails_before_it_served_is_not_restarted_however_long_it_took(
    tmp_path: Path,
) -> None:
    """It was restarted as a worker that had crashed, and a restarted worker
    serves alone where Redis is down: the workers ran with no shared view."""
    counter = tmp_path / "runs"
    returned = threading.Event()

    def stop_later() -> None:  # (the old supervisor restarted it for ever)
        if not returned.wait(4 * MIN_UPTIME_S + 5):
            os.kill(os.getpid(), signal.SIGTERM)

    stopper = threading.Thread(target=stop_later)
    stopper.start()
    try:
        code = supervise(
            1,
            slow_to_fail,
            (str(counter),),
            stop_timeout_s=10,
            restart_delay_s=0.1,
            min_uptime_s=MIN_UPTIME_S,
            poll_s=0.02,
        )
    finally:
        returned.set()
        stopper.join()
    assert code == 1 and counter.read_text() == "x"


def beater(ready: str, every: str) -> None:
    """A worker that beats its heartbeat every `every` seconds (Ferry's: every
    second), and says so once (a file in the folder `ready`). It waits in
    tenths: thawed after a stop, its next beat is as far away as it was, where
    one long sleep would have run out meanwhile and beaten at once."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    for beat in range(600):
        os.utime(os.environ[HEARTBEAT])
        if beat == 0:
            Path(ready, str(os.getpid())).touch()
        for _ in range(round(float(every) * 10)):
            time.sleep(0.1)


def test_workers_frozen_with_their_parent_are_not_killed_as_silent(tmp_path: Path) -> None:
    """The whole group stopped (docker pause, Ctrl-Z) and thawed: the parent
    counted its own pause as its workers' silence and killed them, streams and
    all."""
    ready = tmp_path / "ready"
    ready.mkdir()
    script = (
        "import logging, sys\n"
        "from proxy.workers import supervise\n"
        "from tests.unit.test_workers import beater\n"
        "logging.basicConfig(level=logging.INFO)\n"
        # Beats 2 s apart against a 5 s timeout: thawed, the parent looks at
        # once, and a worker's next beat is up to 2 s away.
        f"sys.exit(supervise(2, beater, ({str(ready)!r}, '2'), stop_timeout_s=5, timeout_s=5,"
        " poll_s=0.05))\n"
    )
    log = tmp_path / "supervisor.log"
    with log.open("wb") as out:
        parent = subprocess.Popen(
            [sys.executable, "-c", script], stderr=out, start_new_session=True
        )
    try:
        deadline = time.monotonic() + 60
        while len(list(ready.iterdir())) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(ready.iterdir())) == 2, log.read_text()  # both beating
        time.sleep(0.5)
        os.killpg(parent.pid, signal.SIGSTOP)
        time.sleep(7)  # past timeout_s
        os.killpg(parent.pid, signal.SIGCONT)
        time.sleep(3)
        assert "silent for" not in log.read_text(), log.read_text()
    finally:
        parent.terminate()
        parent.wait(20)


def test_a_silent_worker_that_does_not_die_at_once_does_not_stop_the_watch(
    tmp_path: Path,
) -> None:
    """A worker stuck in the kernel dies only once out of it: the parent waited
    5 s for it, its other workers unwatched, then killed it again at every look."""

    class Stuck:
        pid, kills = 4242, 0

        def kill(self) -> None:
            self.kills += 1

        def join(self, timeout: float | None = None) -> None:
            time.sleep(timeout or 0)

    heartbeat = tmp_path / "heartbeat-0"
    heartbeat.touch()
    stuck, seen = Stuck(), {0: (heartbeat.stat().st_mtime, time.monotonic() - 11)}
    started = time.monotonic()
    _kill_if_silent(0, stuck, str(heartbeat), 10, seen)  # type: ignore[arg-type]
    _kill_if_silent(0, stuck, str(heartbeat), 10, seen)  # type: ignore[arg-type]
    assert time.monotonic() - started < 1 and stuck.kills == 1
    seen[0] = (seen[0][0], time.monotonic() - 11)  # silent for another timeout
    _kill_if_silent(0, stuck, str(heartbeat), 10, seen)  # type: ignore[arg-type]
    assert stuck.kills == 2


def test_no_directory_for_the_workers_files_is_said_not_raised(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A container's read-only root without a writable /tmp: one line, exit 1."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", "/nonexistent/ferry-tmp")
    assert supervise(2, sleeper, ("/nonexistent",), stop_timeout_s=1) == 1
    assert "no directory for their files" in caplog.text
    assert multiprocessing.active_children() == []

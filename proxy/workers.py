"""`ferry serve --workers N`: N processes serving one port.

Each worker is a whole Ferry (its own event loop, ledger, scrapes, streams)
bound to the same address with SO_REUSEPORT, so the kernel spreads incoming
connections across them; they see one cluster through Redis (proxy/sharing.py).
This parent only starts and watches them:
- SIGTERM and SIGINT go to every worker, each shuts down gracefully (its
  streams finish), and the parent exits when they have;
- SIGHUP goes to every worker: each re-reads the file;
- a worker whose event loop stops running (stuck in a call that never returns,
  or stopped by SIGSTOP) is killed after `timeout_s` without a heartbeat, and
  started again as a dead one is: the kernel would go on handing it
  connections that nobody answers. Each worker touches its heartbeat file
  (`HEARTBEAT`) every second from its event loop, from its first second of
  serving on; the parent reads the files' times.
- a worker that dies (killed, or crashed after it ran a while) is started
  again after `restart_delay_s`. Its streams broke with it: clients retry, and
  its load leaves the shared view with its record's TTL. A worker started
  again while Redis is down serves alone until it is back, as the others do,
  from the fleet state they keep in a file of the parent's (`FLEET_SNAPSHOT`):
  the drains, removals and additions made since the file was read.
  A restart that fails at once is tried again, each wait twice the last, up
  to MAX_RESTART_DELAY_S, MAX_FAILED_RESTARTS times in a row; a worker that
  cannot use the config file (edited badly since) is not restarted.

Workers are spawned, not forked: a fork would copy the parent's state into each
child, and an event loop must not cross a fork.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from multiprocessing.process import BaseProcess
from typing import Any

log = logging.getLogger("ferry.workers")

MAX_RESTART_DELAY_S = 30.0
# Restarts in a row that fail at once before the worker is given up (after
# about two minutes of waits): a broken config file or a Redis that stays down.
MAX_FAILED_RESTARTS = 6
# A worker's exit status for a configuration it cannot use: never restarted,
# as the same file would fail again (sysexits' EX_CONFIG).
EXIT_CONFIG = 78
# Set in the environment of a worker started again: it serves alone if Redis is
# down just then, as the workers still running do (the first start refuses).
RESTARTED_WORKER = "FERRY_RESTARTED_WORKER"
# Set in every worker's environment: the file where the workers keep the fleet
# state as they hold it (proxy/sharing.py), in a directory the parent removes.
FLEET_SNAPSHOT = "FERRY_FLEET_SNAPSHOT"
# Set in each worker's environment: the file it touches as its heartbeat.
HEARTBEAT = "FERRY_HEARTBEAT"
# Set in every worker's environment: the parent's pid, which passes a SIGHUP on
# to every worker (`reload_every_worker`).
SUPERVISOR = "FERRY_SUPERVISOR"
# A poll this late means the parent was not running: heartbeats are timed anew.
PAUSED_S = 2.0


def supervise(
    count: int,
    target: Callable[..., Any],
    args: tuple[Any, ...],
    *,
    stop_timeout_s: float,
    timeout_s: float = 0.0,
    restart_delay_s: float = 1.0,
    min_uptime_s: float = 5.0,
    poll_s: float = 0.2,
) -> int:
    """Run `target(*args)` in `count` processes until SIGTERM or SIGINT; returns
    the exit status (0 when every worker stopped cleanly). A worker killed by a
    signal, or one that fails after running `min_uptime_s` and serving (it beat
    its heartbeat), is started again; one whose first start fails sooner, or
    before it served (a port taken, Redis down), is not, nor is one that exits
    cleanly or with EXIT_CONFIG. A restart that fails sooner is tried
    again, each wait twice the last, up to MAX_FAILED_RESTARTS in a row. One that
    has not beaten for `timeout_s` (0: no watch) is killed, then started again.
    When no worker is left, the parent exits 1."""
    context = multiprocessing.get_context("spawn")
    stopping = False
    workers: dict[int, BaseProcess] = {}
    started_at: dict[int, float] = {}
    restart_at: dict[int, float] = {}
    restarts: dict[int, int] = {}  # restarts in a row that failed before min_uptime_s
    beats: dict[int, tuple[float, float]] = {}  # heartbeat file time, and when it changed

    def heartbeat(index: int) -> str:
        return os.path.join(snapshots, f"heartbeat-{index}")

    def start(index: int) -> None:
        process = context.Process(target=target, args=args, name=f"ferry-worker-{index}")
        if index in started_at:  # a spawned child takes the environment as it is now
            os.environ[RESTARTED_WORKER] = "1"
        beat = heartbeat(index)
        with open(beat, "w"):
            pass
        os.utime(beat, (0, 0))  # not beaten yet: a start is not timed
        beats.pop(index, None)
        os.environ[HEARTBEAT] = beat
        # And it ignores SIGHUP, as set now, until it can reload: one forwarded
        # while it starts would end it (the signal's default).
        reloads = signal.signal(signal.SIGHUP, signal.SIG_IGN)
        try:
            process.start()
        finally:
            signal.signal(signal.SIGHUP, reloads)
            os.environ.pop(RESTARTED_WORKER, None)
            os.environ.pop(HEARTBEAT, None)
        workers[index], started_at[index] = process, time.monotonic()
        log.info("worker %d started (pid %s)", index, process.pid)

    def forward(signum: int, _frame: Any) -> None:
        nonlocal stopping
        if signum != signal.SIGHUP:
            stopping = True
        for process in workers.values():
            if process.pid is not None and process.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)

    try:
        snapshots = tempfile.mkdtemp(prefix="ferry-workers-")
    except OSError as exc:  # (a read-only root with no writable /tmp: a container's)
        log.error("cannot start workers: no directory for their files: %s", exc)
        return 1
    handled = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    previous = {s: signal.signal(s, forward) for s in handled}
    os.environ[FLEET_SNAPSHOT] = os.path.join(snapshots, "fleet.json")
    os.environ[SUPERVISOR] = str(os.getpid())
    try:
        for index in range(count):
            if stopping:  # a SIGTERM while they start reaches only those started
                break
            start(index)
        polled = time.monotonic()
        while not stopping and workers:
            time.sleep(poll_s)
            now = time.monotonic()
            if now - polled > PAUSED_S:
                # The parent itself did not run (its whole group was frozen and
                # thawed: docker pause, Ctrl-Z): the workers' silence meanwhile
                # was not theirs. Timed again from now.
                beats.clear()
            polled = now
            for index, process in list(workers.items()):
                if stopping:
                    continue
                if process.is_alive():
                    if timeout_s > 0:
                        _kill_if_silent(index, process, heartbeat(index), timeout_s, beats)
                    continue
                if index in restart_at:  # dead, and its restart decided on already
                    if now >= restart_at[index]:
                        del restart_at[index]
                        try:
                            start(index)
                        except OSError as exc:  # no process to be had now (EAGAIN, ENOMEM)
                            log.error("worker %d could not start again: %s", index, exc)
                            restart_at[index] = now + MAX_RESTART_DELAY_S
                    continue
                code = process.exitcode or 0
                killed = code < 0  # by a signal: kill -9, the OOM killer
                # It never served (a slow start on a busy host can fail past
                # min_uptime_s, at Redis down): a failed start all the same.
                brief = now - started_at[index] < min_uptime_s or _never_beat(heartbeat(index))
                failed_to_start = brief and (
                    index not in restarts or restarts[index] >= MAX_FAILED_RESTARTS
                )
                if not killed and (code in (0, EXIT_CONFIG) or failed_to_start):
                    log.error(
                        "worker %d (pid %s) stopped by itself (status %s); not restarted",
                        index,
                        process.pid,
                        code,
                    )
                    del workers[index]
                    continue
                failed = restarts.get(index, 0) if brief else 0
                restarts[index] = failed + 1
                delay = min(restart_delay_s * 2**failed, MAX_RESTART_DELAY_S)
                log.error(
                    "worker %d (pid %s) died (status %s): its streams broke;"
                    " another starts in %.1f s",
                    index,
                    process.pid,
                    process.exitcode,
                    delay,
                )
                restart_at[index] = now + delay
        if not workers:
            return 1
        deadline = time.monotonic() + stop_timeout_s
        for process in workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
        # A worker that died before the stop was reported then; only a stop with
        # every worker dead is a failure of its own.
        status = 1 if all(index in restart_at for index in workers) else 0
        for index, process in workers.items():
            if index in restart_at:
                continue
            if process.is_alive():
                log.error("worker pid %s ran past %.0fs: killed", process.pid, stop_timeout_s)
                process.kill()
                process.join()
                status = 1
            elif process.exitcode != 0:
                status = 1
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        os.environ.pop(FLEET_SNAPSHOT, None)
        # (Else a `ferry serve` this process starts later would take it for its
        # supervisor, and a reload there would send it SIGHUP.)
        os.environ.pop(SUPERVISOR, None)
        shutil.rmtree(snapshots, ignore_errors=True)


def _never_beat(heartbeat: str) -> bool:
    """Whether a worker never beat: it died before it served (`start` left its
    file at time 0). A file gone says nothing: then its uptime alone decides."""
    try:
        return os.stat(heartbeat).st_mtime == 0
    except OSError:
        return False


def _kill_if_silent(
    index: int,
    process: BaseProcess,
    heartbeat: str,
    timeout_s: float,
    seen: dict[int, tuple[float, float]],
) -> None:
    """Kill the worker if it beat once and then not for `timeout_s`: it is then
    started again as a dead one is. A beat is a change of its file's time, timed
    on the parent's monotonic clock (`seen`: each worker's last time and when it
    changed), so a step of the wall clock kills nobody."""
    try:
        beaten = os.stat(heartbeat).st_mtime
    except OSError:
        return
    now = time.monotonic()
    last = seen.get(index)
    if not beaten or last is None or last[0] != beaten:
        seen[index] = (beaten, now)
        return
    silent = now - last[1]
    if silent > timeout_s:
        log.error(
            "worker %d (pid %s) silent for %.0f s (its event loop is stuck or stopped): killed",
            index,
            process.pid,
            silent,
        )
        process.kill()
        # Reaped, and started again, by the supervisor's loop. Not waited for
        # here: one stuck in the kernel (uninterruptible I/O) dies only once out
        # of it, and a wait would stop the parent, its other workers' watch with
        # it. Killed again after another timeout, if it is still there.
        seen[index] = (beaten, now)


def reload_every_worker() -> bool:
    """In a worker, have every worker read the configuration file again (the
    parent passes SIGHUP on to each); False in a process that is not one. A
    reload through the admin API reaches one worker: the others must follow,
    or they would serve another fleet."""
    parent = os.environ.get(SUPERVISOR, "")
    if not parent.isdecimal() or int(parent) != os.getppid():
        return False
    os.kill(int(parent), signal.SIGHUP)
    return True

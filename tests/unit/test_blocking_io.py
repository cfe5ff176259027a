"""`blocking_io.call`: a daemon thread's result or exception, handed back on the loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from proxy import blocking_io


def test_the_result_and_the_exception_come_back_to_the_caller() -> None:
    asyncio.run(_result_and_exception())


async def _result_and_exception() -> None:
    assert await blocking_io.call(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(FileNotFoundError):
        await blocking_io.call(open, "/nonexistent/ferry.yaml")


def test_it_runs_in_a_daemon_thread_not_on_the_loop() -> None:
    seen = asyncio.run(
        blocking_io.call(lambda: (threading.current_thread(), threading.get_ident()))
    )
    assert seen[0].daemon and seen[1] != threading.get_ident()


def test_a_cancelled_caller_leaves_the_call_to_finish_unseen() -> None:
    asyncio.run(_cancelled())


async def _cancelled() -> None:
    release, finished = threading.Event(), threading.Event()

    def slow() -> int:
        release.wait(5)
        finished.set()
        return 1

    call = asyncio.ensure_future(blocking_io.call(slow))
    await asyncio.sleep(0.05)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    release.set()
    assert await asyncio.to_thread(finished.wait, 5)
    await asyncio.sleep(0.05)  # its result reaches the loop, and is dropped quietly

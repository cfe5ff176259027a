"""File work that may never return, kept off the event loop and out of the way
of the process's exit.

asyncio's default executor (`asyncio.to_thread`) is joined when the loop closes,
and again when the interpreter exits: one read stuck there (a configuration
file replaced by a FIFO with no writer, a hung network mount) keeps Ferry from
exiting on SIGTERM, whatever its grace. A daemon thread of its own is not
waited for. Calls here are rare (a reload, a certificate read, the workers'
state file), so a thread each costs nothing that matters."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


async def call(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a daemon thread of its own; its result or its exception.
    Cancelling the caller leaves the thread to finish (or not) on its own."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, exc: BaseException | None) -> None:
        if done.done():  # its caller was cancelled meanwhile
            return
        if exc is not None:
            done.set_exception(exc)
        else:
            done.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the caller whole
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed while it ran: nobody waits for it
            pass

    name = f"ferry-io-{getattr(fn, '__name__', 'call')}"
    threading.Thread(target=run, name=name, daemon=True).start()
    return await done

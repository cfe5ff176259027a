"""The end of a graceful shutdown: in-flight requests get their grace, then what
is left is cut, each stream with a word to its client.

aiohttp's own shutdown cannot do this. It waits its timeout for handlers, fails
their request bodies (a handler past reading its body goes on) and waits as long
again, so requests got twice the grace; then it cancels each handler and closes
its connection in the same step, before the handler can write anything, so a
cut stream just stopped and its client could not tell it from a finished one.
Ferry keeps a register of the handlers running (`InFlight.middleware`), waits
for them itself (`InFlight.finish`), and cancels what is left while its
connection is still open: a cancelled stream ends with a 503 error event and [DONE] (which
the openai client raises), so its client knows to retry. A request that has sent
nothing yet (a whole one, or a stream queued or waiting for its first token) is
answered 503 in the OpenAI shape as its connection closes, so that its client can
tell a deploy from a crash.
"""

from __future__ import annotations

import asyncio
import json
import logging

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy import sse
from proxy.errors import anthropic_error_body, anthropic_route, error_body

log = logging.getLogger("ferry.shutdown")

# How long cancelled handlers get to end their streams and close their calls.
CUT_WAIT_S = 2.0
CUT_MESSAGE = "Ferry shut down before this stream finished; retry it"
_CUT_WHY = "Ferry shut down before answering this request; retry it"


def _cut_answer(body: object) -> bytes:
    data = json.dumps(body).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\nRetry-After: 1\r\nConnection: close\r\n\r\n%b" % (len(data), data)
    )


CUT_ANSWER = _cut_answer(error_body(503, _CUT_WHY, code="shutting_down"))
# On Anthropic's Messages routes, in its shape (`overloaded_error`), as Ferry's other errors there.
CUT_ANSWER_ANTHROPIC = _cut_answer(anthropic_error_body(503, _CUT_WHY))


class InFlight:
    """The request handlers running now."""

    def __init__(self) -> None:
        self.tasks: dict[asyncio.Task[object], web.Request] = {}
        self._idle = asyncio.Event()
        self._idle.set()

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        task = asyncio.current_task()
        assert task is not None  # aiohttp runs each request in a task of its own
        self.tasks[task] = request
        self._idle.clear()
        try:
            return await handler(request)
        except asyncio.CancelledError:
            if request.get(sse.CUT):  # by `finish`, not by a client that left
                sse.end_cut(request, CUT_MESSAGE)
                _answer_cut(request)
            raise
        finally:
            del self.tasks[task]
            if not self.tasks:
                self._idle.set()

    async def finish(self, grace_s: float) -> int:
        """Wait up to `grace_s` for the handlers running now (new connections
        must be refused already), then cancel those left; how many were."""
        try:
            await asyncio.wait_for(self._idle.wait(), grace_s)
            return 0
        except TimeoutError:
            pass
        left = list(self.tasks)
        log.warning("shutdown grace of %.1f s over: cutting %d requests", grace_s, len(left))
        for task, request in self.tasks.items():
            request[sse.CUT] = True  # its outcome: "shutdown", not a client that left
            task.cancel()
        await asyncio.wait(left, timeout=CUT_WAIT_S)
        return len(left)


def _answer_cut(request: web.Request) -> None:
    """Answer 503 a request cut before any byte of its answer went out (headers
    included), written at once: its task is being cancelled, and its
    connection closes after it (the bytes go first)."""
    writer, transport = request.writer, request.transport
    if writer.output_size or getattr(writer, "_headers_buf", None):  # (aiohttp's: held headers)
        return
    if transport is not None and not transport.is_closing():
        transport.write(CUT_ANSWER_ANTHROPIC if anthropic_route(request.path) else CUT_ANSWER)

"""A client's request body: received within its time, held under one budget
shared by every request, and decoded off the event loop.

aiohttp would inflate a compressed body itself, in its parser, on the event
loop: a 250 KB gzip of spaces is 256 MB, and every stream stalled for a second
while it was inflated. Ferry's server takes bodies as they came
(`auto_decompress=False`) and inflates them here, in a worker thread, never
past `max_body_bytes`.

A body is held in memory until it is whole. `max_body_bytes` bounds one; the
budget (`server.max_pending_body_bytes`, each process's) bounds them all:
twenty clients each sending all but the last byte of a 30 MB body held 774 MB
until their timeout. A body being inflated counts what it has inflated so far
as well as what came. Past the budget, the body whose bytes would cross it is
answered 503.

Bodies are inflated by a pool of their own, INFLATE_THREADS threads each
process: on the loop's default pool, where aiohttp resolves names and Ferry
parses large bodies, a flood of gzip bombs held every thread, and a 100 KB
request waited up to 1.6 s for one.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from proxy.openai_request import BadRequest

_BODY = web.RequestKey("ferry_body", bytes)  # (read once: /invocations reads it again)
# Content-Encodings taken, and the zlib window each is read with.
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
# zlib is fed this much of a body at a time (between looks at the clock).
SLICE_BYTES = 64 * 1024
# Gzip members one body may be made of (a tar of files has a few).
MAX_MEMBERS = 64
# Threads inflating bodies at once, each process (zlib lets go of the GIL).
INFLATE_THREADS = 2


class Bodies:
    """How request bodies are received (the server's settings), and the bytes
    of those being received now, against the budget."""

    def __init__(self, limit: int, timeout_s: float, budget: int, retry_after_s: int) -> None:
        self.limit, self.timeout_s, self.budget = limit, timeout_s, budget
        self.retry_after_s = retry_after_s
        self.held = 0  # (the event loop's)
        self.inflated = 0  # (the inflating threads', under _inflating)
        self._inflating = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    async def read(self, request: web.Request) -> bytes:
        """The request's body, whole and decoded: 408 for one that takes longer
        than `timeout_s` to come and inflate, 413 past `limit` bytes (as sent or
        inflated), 415 for an encoding Ferry does not take, 400 for one that
        does not decode, and 503 while the bodies being received hold the whole
        budget."""
        if (kept := request.get(_BODY)) is not None:
            return kept
        # Two header lines are one list (RFC 9110), as "gzip, gzip" is: refused below.
        encoding = ", ".join(request.headers.getall("Content-Encoding", ["identity"]))
        encoding = encoding.strip().lower()
        if encoding not in ("identity", "") and encoding not in _WBITS:
            raise BadRequest(
                f"Content-Encoding {encoding[:40]!r} is not taken; send gzip, deflate or none",
                status=415,
            )
        chunks: list[bytes] = []
        size = 0
        started = time.monotonic()
        try:
            async with asyncio.timeout(self.timeout_s):
                while chunk := await request.content.readany():
                    size += len(chunk)
                    self.held += len(chunk)
                    if size > self.limit:
                        raise BadRequest(f"request body is over {self.limit} bytes", status=413)
                    if self.held + self.inflated > self.budget:
                        raise self._busy()
                    chunks.append(chunk)
        except TimeoutError:
            message = f"request body not received within {self.timeout_s:g} s"
            raise BadRequest(message, status=408) from None
        finally:
            self.held -= size
        body = b"".join(chunks)
        if encoding in _WBITS and body:
            body = await self._inflated(body, _WBITS[encoding], started + self.timeout_s)
        request[_BODY] = body
        return body

    def _busy(self) -> BadRequest:
        return BadRequest(
            "too many request bodies are being received at once; try again",
            status=503,
            headers={"Retry-After": str(self.retry_after_s)},
        )

    async def _inflated(self, body: bytes, wbits: int, deadline: float) -> bytes:
        """`body` inflated in a thread (16 KB of gzip is 16 MB of spaces), by
        `deadline` (a thread cannot be called back). What it inflates to counts
        against the budget as it comes, until the thread is done; `body` itself
        (the caller's) counts until then too."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(INFLATE_THREADS, thread_name_prefix="ferry-inflate")
        taken = [0]

        def take(size: int) -> None:  # (in the inflating thread)
            with self._inflating:
                if self.held + self.inflated + size > self.budget:
                    raise self._busy()
                self.inflated += size
                taken[0] += size

        def inflate() -> bytes:
            try:
                return decode(body, wbits, self.limit, deadline, take)
            finally:
                with self._inflating:
                    self.inflated -= taken[0]

        loop = asyncio.get_running_loop()
        # Given back when the thread is done, not when the request is: a client
        # that hangs up cancels its handler, and the thread inflates on. So
        # does the compressed body it was given.
        self.held += len(body)
        try:
            inflating = loop.run_in_executor(self._pool, inflate)
        except BaseException:  # (no thread to be had: at exit)
            self.held -= len(body)
            raise
        inflating.add_done_callback(lambda done: self._given_back(len(body), done))
        return await asyncio.shield(inflating)

    def _given_back(self, size: int, done: asyncio.Future[bytes]) -> None:
        self.held -= size
        if not done.cancelled():
            done.exception()  # (retrieved: a request that left has no use for it)

    def close(self) -> None:
        """Stop the inflating threads (at exit; those inflating finish first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def decode(
    body: bytes,
    wbits: int,
    limit: int,
    deadline: float = math.inf,
    take: Callable[[int], None] = lambda size: None,
) -> bytes:
    """`body` inflated, never past `limit` bytes (413); 400 where it does not
    decode or is cut short, and 408 past `deadline` (time.monotonic()). It is
    fed to zlib a slice at a time, so its work follows the bytes it takes, not
    their square. Several gzip members are one body, as gzip reads them (at most
    MAX_MEMBERS); a `deflate` body is read with zlib's wrapper (RFC 9110) or
    without. `take(n)` is told of each n bytes it inflates (it may raise to
    stop it); their join into one is a copy made as it returns."""
    view = memoryview(body)
    out: list[bytes] = []
    size = at = members = 0
    while at < len(view):
        if members == MAX_MEMBERS:
            raise BadRequest(f"request body has over {MAX_MEMBERS} gzip members")
        inflate = zlib.decompressobj(wbits)
        start = at
        while not inflate.eof:
            if at == len(view):
                raise BadRequest(f"request body is cut short: its {_name(wbits)} stream has no end")
            if time.monotonic() > deadline:
                raise BadRequest("request body not read in time", status=408)
            piece = view[at : at + SLICE_BYTES]
            try:
                part = inflate.decompress(piece, limit + 1 - size)
            except zlib.error as exc:
                if wbits == zlib.MAX_WBITS and at == start == 0:  # raw deflate, as some send
                    wbits = -zlib.MAX_WBITS
                    break
                raise BadRequest(f"request body does not decode as {_name(wbits)}: {exc}") from None
            size += len(part)
            if size > limit or inflate.unconsumed_tail:
                raise BadRequest(f"request body inflates past {limit} bytes", status=413)
            take(len(part))
            out.append(part)
            at += len(piece) - len(inflate.unused_data)
        else:
            members += 1
            if wbits <= zlib.MAX_WBITS and at < len(view):  # one deflate stream, no more
                raise BadRequest("request body has bytes past its deflate stream")
            if at < len(view) and view[at] == 0:  # zeros pad a gzip file to its end
                if view[at:].tobytes().strip(b"\0"):
                    raise BadRequest("request body has bytes past its gzip stream")
                break
    return b"".join(out)


def _name(wbits: int) -> str:
    return "gzip" if wbits > zlib.MAX_WBITS else "deflate"


BODIES = web.AppKey("bodies", Bodies)  # the app's (proxy/server.py)

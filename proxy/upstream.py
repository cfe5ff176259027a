"""Ferry's HTTP client to its instances, and the one place a ledger entry ends.

Every request Ferry sends to an instance on a client's behalf is a `Call`: the
ledger entry that bills the instance for it and, once connected, the upstream
response. `Call.close()` closes the response (vLLM aborts a request whose
connection closes) and releases the entry; it is idempotent, and nothing else
releases ledger entries. A connect failure marks the instance unreachable until
a scrape succeeds. Control calls (detokenize, pre-warm, the shim's routes) go
through `post_json`.

A call waiting for its answer (the headers; a whole answer's body; a stream's
next bytes) is `Waiting` on its instance until it has it. When the instance
answers nothing, its scrapes and `/health` included (a frozen process, or one
shutting down that left a stream open and silent), `give_up` ends those waits
at once with `InstanceStopped`, rather than wait out `upstream_read_timeout_s`
(600 s) for an answer, or `upstream_idle_timeout_s` (60 s) for a stream's
bytes, that are not coming. Where nothing reached the client yet, the relay
tries another instance; a stream under way ends with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import math
import os
import re
import resource
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from types import TracebackType
from typing import Any

import aiohttp
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

from proxy import blocking_io, sse, tls
from proxy.cluster import Cluster
from proxy.config import InstanceConfig, ServerConfig
from proxy.ledger import LedgerEntry
from proxy.policy import Priority
from proxy.ttft_stages import TTFTStages

log = logging.getLogger("ferry.upstream")


def connector(**options: Any) -> aiohttp.TCPConnector:
    """A TCPConnector whose connections fail a body's reader on a parse error.

    aiohttp 3.14's C parser, meeting bytes that are no HTTP in the middle of a
    body (a bad chunk size), puts the error on the connection alone: the read of
    the body then waits forever, and its `sock_read` timer is dropped with it, so
    a client's request would hang on a broken instance."""
    made = aiohttp.TCPConnector(**options)
    if hasattr(made, "_factory"):
        made._factory = functools.partial(  # type: ignore[assignment]  # a subclass
            _ResponseHandler, loop=asyncio.get_running_loop()
        )
    return made


class _ResponseHandler(ResponseHandler):
    def is_connected(self) -> bool:
        # Asked of a pooled connection before it is taken again: one on which
        # bytes came while it sat idle (an instance that wrote a second answer
        # after a whole one) is not. Taken, those bytes would be read as the
        # next call's answer, another client's, and every answer after as the
        # one before's. (nginx closes a kept-alive upstream connection so too.)
        return super().is_connected() and not self._buffer and not self._tail

    def set_exception(self, exc: BaseException, *cause: BaseException) -> None:
        body = self._payload
        super().set_exception(exc, *cause)
        # Only a parse error: aiohttp passes its others (a timeout, a lost
        # connection) on to the body itself.
        if (
            isinstance(exc, HttpProcessingError)
            and isinstance(body, aiohttp.StreamReader)
            and not body.is_eof()
            and not body.exception()
        ):
            body.set_exception(aiohttp.ClientPayloadError(f"the answer broke off: {exc!r}"))


# What an engine that schedules by priority is sent for Ferry's priorities (vLLM:
# lower runs first). Normal is left out: it stays the engine's default, 0, the
# same as requests that do not come through Ferry.
ENGINE_PRIORITY = {Priority.HIGH: -1, Priority.LOW: 1}


class Call:
    """One request on one instance, billed in the ledger until `close()`."""

    __slots__ = ("cluster", "entry", "response", "_closed")

    def __init__(self, cluster: Cluster, entry: LedgerEntry) -> None:
        self.cluster = cluster
        self.entry = entry
        self.response: aiohttp.ClientResponse | None = None
        self._closed = False

    @property
    def instance(self) -> str:
        return self.entry.instance

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.response is not None:
            self.response.close()  # a no-op after release(); aborts the upstream otherwise
        self.cluster.release(self.entry)


class OutOfFiles(aiohttp.ClientConnectionError):
    """Ferry had no file descriptor left for a connection (EMFILE, ENFILE): its
    own shortage, not a fault of the instance it was calling, which is neither
    marked unreachable nor blamed, nor tried again elsewhere (that fails alike)."""


def out_of_files(exc: BaseException) -> bool:
    """Whether `exc`, or what caused it, is this process or host running out of
    file descriptors."""
    seen: BaseException | None = exc
    for _ in range(4):  # aiohttp wraps the OSError once or twice
        if seen is None:
            return False
        if isinstance(seen, OutOfFiles) or getattr(seen, "errno", None) in _NO_FILES:
            return True
        if isinstance(seen, socket.gaierror):
            # glibc's resolver out of descriptors says "Name or service not
            # known", even of localhost: ask the process's own count.
            return _at_file_limit()
        seen = seen.__cause__ or getattr(seen, "os_error", None)
    return False


def _at_file_limit() -> bool:
    """Whether this process holds about as many descriptors as it may: counted
    at most once a second (a listing of 65,536 takes milliseconds, and a storm
    of failures would ask for each)."""
    now = time.monotonic()
    if now - _FILE_COUNT[0] < 1.0:
        return _FILE_COUNT[1]
    try:
        used = len(os.listdir("/proc/self/fd"))
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        at_limit = soft != resource.RLIM_INFINITY and used >= soft - FILES_SPARE
    except OSError as exc:
        at_limit = exc.errno in _NO_FILES  # the listing needs one too
    _FILE_COUNT[:] = [now, at_limit]
    return at_limit


# The process's last count: when, and whether it was at its limit (one process, one count).
_FILE_COUNT: list[Any] = [-math.inf, False]


_NO_FILES = (errno.EMFILE, errno.ENFILE)
FILES_SPARE = 8  # descriptors short of the limit that count as at it
# A shortage of file descriptors is logged at most this often, not per call.
OUT_OF_FILES_LOG_S = 10.0


class ShortageLog:
    """Warns of a shortage of file descriptors at most every OUT_OF_FILES_LOG_S:
    in a storm, every call and every look would."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float]) -> None:
        self.logger, self.clock = logger, clock
        self._at = -math.inf

    def warn(self, message: str, *args: object) -> None:
        now = self.clock()
        if now - self._at >= OUT_OF_FILES_LOG_S:
            self._at = now
            self.logger.warning(message, *args)


async def tls_of(config: InstanceConfig) -> dict[str, Any]:
    """aiohttp's TLS arguments for a call to the instance (`ssl=True`: an https
    server checked against the system's roots). Its context is made at its first
    call, in a thread (proxy/tls.py). TLS files that cannot be read then (moved
    or spoiled since the file was checked) fail the call as a refused
    connection would: the instance is unhealthy, and says why."""
    settings = config.tls_settings
    made: ssl.SSLContext | bool = True
    if settings is not None:
        made = tls.cached(settings) or await _made_in_a_thread(settings)
    return {"ssl": made, "server_hostname": config.tls_server_name}


async def _made_in_a_thread(settings: tls.Settings) -> ssl.SSLContext:
    try:
        return await blocking_io.call(tls.context, settings)
    except (OSError, ssl.SSLError, ValueError) as exc:
        # (Its cause kept: `out_of_files` finds an EMFILE there.)
        raise TLSFilesUnusable(f"its TLS files cannot be used: {exc}") from exc


class TLSFilesUnusable(aiohttp.ClientOSError):
    """An instance's TLS files could not be read for a call (`tls_of`): one of
    `sse.CONNECT_ERRORS`, as a connection that failed."""


# A pooled connection the engine closed as it was reused fails at once (its
# close or reset was on the way); a call that fails later got to the engine.
STALE_CONNECTION_S = 0.5


class DroppedWhileAnswering(aiohttp.ClientPayloadError):
    """The instance closed the connection while it had the call's request (not
    at once, as a stale pooled connection does): the call broke there."""


class InstanceStopped(aiohttp.ServerTimeoutError):
    """A wait given up because its instance stopped answering (proxy/scraper.py `on_down`)."""


class Waiting:
    """`async with` around a call's wait for its answer: registered under the
    instance while it lasts, ended by `Waits.give_up` with `InstanceStopped`.
    A stream's wait spans its reads, and counts from the last bytes `heard`.
    Once the answer is whole (`whole_in`), the wait for the end of its body is
    bounded, and the block is left quietly when it is over. `fallback`: its
    caller has somewhere to go back to (a move's continuation: the stream goes
    on where it is), so it may be given up wherever its model is served."""

    __slots__ = ("_deadline", "_waits", "fallback", "instance", "model", "since", "whole")

    def __init__(
        self, waits: Waits, instance: str, model: str | None, fallback: bool = False
    ) -> None:
        self._waits, self.instance, self.model = waits, instance, model
        self.fallback = fallback
        self._deadline = asyncio.timeout(None)
        self.since = 0.0
        self.whole = False

    def give_up(self) -> None:
        self._deadline.reschedule(asyncio.get_running_loop().time())

    def whole_in(self, grace_s: float) -> None:
        """The answer is whole (its last event came): its body's end is left
        `grace_s` to come, then the wait ends as if it had. A server that keeps
        a finished stream open would hold the client (and the instance's bill)
        until the idle timeout; one that ends it at once keeps its connection
        for the next call."""
        if not self.whole:
            self.whole = True
            self._deadline.reschedule(asyncio.get_running_loop().time() + grace_s)

    def heard(self) -> None:
        self.since = self._waits.clock()

    async def __aenter__(self) -> None:
        await self._deadline.__aenter__()
        self.since = self._waits.clock()
        self._waits.on.setdefault(self.instance, set()).add(self)

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        waiting = self._waits.on.get(self.instance)
        if waiting is not None:
            waiting.discard(self)
            if not waiting:
                del self._waits.on[self.instance]
        try:
            await self._deadline.__aexit__(kind, exc, tb)
        except TimeoutError as stopped:
            if not self._deadline.expired():  # not ours: an aiohttp timeout
                raise
            if self.whole:  # only the end of a whole answer was still to come
                return True
            message = f"instance {self.instance} stopped answering (scrapes and /health)"
            raise InstanceStopped(message) from stopped
        return None


class Waits:
    """The calls `Waiting` on each instance."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.on: dict[str, set[Waiting]] = {}

    def __call__(self, instance: str, model: str | None = None, fallback: bool = False) -> Waiting:
        return Waiting(self, instance, model, fallback)

    def give_up(
        self, instance: str, waited_s: float, elsewhere: Callable[[str | None], bool]
    ) -> int:
        """End the waits on `instance` that began `waited_s` ago or more, for a
        model that can go `elsewhere` (or with a `fallback`); how many. Each is
        ended once: it leaves the register now, not when its task runs."""
        waiting = self.on.get(instance, set())
        now = self.clock()
        stale = [
            w for w in waiting if now - w.since >= waited_s and (w.fallback or elsewhere(w.model))
        ]
        for wait in stale:
            waiting.discard(wait)
            wait.give_up()
        if not waiting:
            self.on.pop(instance, None)
        return len(stale)


# An instance's answer headers that go on to the client: retry hints and rate
# limits (a gateway's before the engine, OpenAI's `x-ratelimit-*`), what a 405
# and a 401 must say (the methods a route takes, the engine's own challenge),
# and other `x-` headers of the engine's own. Not the rest: the body's framing and
# hop-by-hop ones are Ferry's to set, and what would speak for Ferry's origin
# (CORS, cookies, HSTS, Alt-Svc) is not an instance's to say: vLLM allows every
# origin by default, which would open a Ferry without client keys to any page a
# browser visits.
_RELAYED = frozenset({"retry-after", "retry-after-ms", "allow", "www-authenticate"})
_RELAYED_PREFIXES = ("x-", "ratelimit-")
_NOT_RELAYED = frozenset({"x-request-id", "x-ferry-instance"})  # Ferry's own
# What HTTP forbids in a field (RFC 9110 5.5): aiohttp's client reads such a
# value, but its server refuses to write it, and the client's answer would fail.
_FORBIDDEN_IN_HEADERS = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def encoded_against_ask(response: aiohttp.ClientResponse) -> str | None:
    """The Content-Encoding of an instance's answer, where it has one though
    Ferry asked for identity (proxy/server.py); aiohttp passes its bytes on
    as they came (`auto_decompress=False`)."""
    encoding = response.headers.get("Content-Encoding", "").strip()
    return None if encoding.lower() in ("", "identity") else encoding


def answer_headers(response: aiohttp.ClientResponse) -> CIMultiDict[str]:
    """The headers of an instance's answer that go on to the client."""
    hop = {
        t.strip().lower() for v in response.headers.getall("Connection", ()) for t in v.split(",")
    }
    relayed: CIMultiDict[str] = CIMultiDict()
    for key, value in response.headers.items():
        name = key.lower()
        if name in hop or name in _NOT_RELAYED:
            continue
        if (name in _RELAYED or name.startswith(_RELAYED_PREFIXES)) and writable(key, value):
            relayed.add(key, value)
    return relayed


def writable(*texts: str) -> bool:
    """Whether a header's name and value can go on to the client (RFC 9110 5.5)."""
    return not any(_FORBIDDEN_IN_HEADERS.search(text) for text in texts)


@contextlib.asynccontextmanager
async def _headers_within(seconds: float | None) -> AsyncIterator[None]:
    """Give up an answer whose headers take over `seconds` (a ServerTimeoutError,
    as aiohttp's own read timeout)."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError as exc:
        if isinstance(exc, aiohttp.ClientError):  # aiohttp's own: as it is
            raise
        raise aiohttp.ServerTimeoutError(f"no whole headers in {seconds:g} s") from exc


async def read_whole(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """A whole answer's body; sse.AnswerTooLarge past `limit` bytes, said or read."""
    if (response.content_length or 0) > limit:
        raise sse.AnswerTooLarge(f"an answer of {response.content_length} bytes, over {limit}")
    parts: list[bytes] = []
    size = 0
    while chunk := await response.content.readany():
        size += len(chunk)
        if size > limit:
            raise sse.AnswerTooLarge(f"an answer of more than {limit} bytes")
        parts.append(chunk)
    return b"".join(parts)


class Upstreams:
    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        server: ServerConfig,
        clock: Callable[[], float],
    ) -> None:
        self.cluster = cluster
        self.session = session
        self.clock = clock
        self.waits = Waits(clock)
        self.max_answer_bytes = server.max_answer_bytes
        self._short_of_files = ShortageLog(log, clock)
        # A whole (non-streamed) response may take as long as its generation.
        self.whole_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=server.upstream_connect_timeout_s,
            sock_read=server.upstream_read_timeout_s,
        )
        # A stream that sends nothing for this long is broken (a hung engine, a
        # dead peer behind a live socket), not slow: it resumes elsewhere.
        self.stream_timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=server.upstream_connect_timeout_s,
            sock_read=server.upstream_idle_timeout_s or server.upstream_read_timeout_s,
        )

    def url(self, instance: str) -> str:
        return self.cluster.instances[instance].url

    def with_priority(
        self, instance: str, body: dict[str, Any], priority: Priority
    ) -> dict[str, Any]:
        """`body` as `instance` is sent it: where its engine schedules by priority
        (`engine_priority: true`), with `priority` in the engine's field, unless
        the client set that field itself. Any other engine is sent no such field:
        a FCFS vLLM refuses it."""
        state = self.cluster.instances[instance]
        field = state.adapter.priority_field
        value = ENGINE_PRIORITY.get(priority)
        if not state.config.engine_priority or field is None or value is None or field in body:
            return body
        return {**body, field: value}

    def begin(
        self,
        instance: str,
        model: str,
        priority: Priority,
        prompt_tokens: int,
        now: float,
        cached_tokens: int = 0,
        watched: bool = True,
    ) -> Call:
        """Bill `instance` for a request about to be sent (before the connect, so
        a burst sees it at once); `cached_tokens` of its prompt are probably in
        the instance's prefix cache (the prefix index's guess); `watched`: its
        first token will be seen when it comes (a stream Ferry reads), not only
        at the end."""
        entry = self.cluster.ledger.add(
            instance, model, priority, prompt_tokens, now, cached_tokens, watched
        )
        return Call(self.cluster, entry)

    async def send(
        self,
        call: Call,
        method: str,
        path: str,
        data: bytes,
        *,
        stream: bool,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, str] | None = None,
        stages: TTFTStages | None = None,
        fallback: bool = False,
    ) -> aiohttp.ClientResponse:
        """Send the call's request. A connect failure closes the call, marks the
        instance unreachable and is raised (one of `sse.CONNECT_ERRORS`); any
        other failure closes the call and is raised. `stages` (a client's first
        call) is marked as the call starts and has its connection. `fallback`:
        the caller can do without the call (see `Waiting`)."""
        config = self.cluster.instances[call.instance].config
        auth = config.auth_headers()
        if auth:  # the instance's own credentials replace the client's
            names = {k.lower() for k in auth}
            headers = {k: v for k, v in (headers or {}).items() if k.lower() not in names}
            headers.update(auth)
        if stages is not None:
            stages.send()
        timeout = self.stream_timeout if stream else self.whole_timeout
        url = self.url(call.instance) + path
        # A stream's headers come at once (the engine's server answers before it
        # generates): ones that trickle in a byte at a time, each restarting the
        # read timer, are given up as a stream that says nothing is.
        deadline = timeout.sock_read if stream else None
        try:
            secure = await tls_of(config)
            async with (
                self.waits(call.instance, call.entry.model, fallback),
                _headers_within(deadline),
            ):
                sent = self.clock()
                try:
                    call.response = await self.session.request(
                        method, url, data=data, headers=headers, params=params, **secure,
                        timeout=timeout, trace_request_ctx=stages, allow_redirects=False,
                    )  # fmt: skip
                except aiohttp.ClientConnectorError:
                    raise
                except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                    if self.clock() - sent > STALE_CONNECTION_S:
                        # The engine had the request a while (it died generating
                        # a whole answer): sent again, it would run twice on an
                        # engine still up, and fail as "cannot connect" on one
                        # that is gone. The call broke; the relay tries elsewhere.
                        raise DroppedWhileAnswering(f"{type(exc).__name__}: {exc}") from exc
                    # Most likely a pooled keep-alive connection the engine closed
                    # just as it was reused: the request never got there, and one
                    # failure of that kind says nothing about the instance. Once
                    # more on another connection before calling it unreachable.
                    call.response = await self.session.request(
                        method, url, data=data, headers=headers, params=params, **secure,
                        timeout=timeout, allow_redirects=False,
                    )  # fmt: skip
        except sse.CONNECT_ERRORS as exc:
            call.close()
            if out_of_files(exc):
                self._short_of_files.warn(
                    "out of file descriptors, answering 503: %s (raise ulimit -n)", exc
                )
                raise OutOfFiles(f"ferry is out of file descriptors: {exc}") from exc
            if isinstance(exc, aiohttp.ClientConnectorError):
                # Not a connection the instance took and then dropped, twice:
                # that may be the request's doing (one its engine chokes on),
                # and is held against the instance as any failed call is.
                self.cluster.mark_unreachable(call.instance, f"{type(exc).__name__}: {exc}")
            raise
        except BaseException:
            call.close()
            raise
        return call.response

    async def read_whole(self, call: Call) -> bytes:
        """The call's whole answer (`read_whole`), given up if its instance stops."""
        assert call.response is not None
        async with self.waits(call.instance, call.entry.model):
            return await read_whole(call.response, self.max_answer_bytes)

    async def post_bytes(
        self, instance: str, path: str, body: dict[str, Any], timeout_s: float = 10.0
    ) -> bytes | None:
        """A control call's answer as it came, where it succeeded (2xx, and at
        most `max_answer_bytes`); None otherwise (logged where it failed)."""

        async def read(resp: aiohttp.ClientResponse) -> bytes | None:
            if not 200 <= resp.status < 300:
                return None
            return await read_whole(resp, self.max_answer_bytes)

        return await self._post(instance, path, body, timeout_s, read)

    async def post_json(
        self, instance: str, path: str, body: dict[str, Any], timeout_s: float = 10.0
    ) -> Any:
        """A control call; its JSON answer, or None when it failed (logged) or
        the instance is gone (removed while its caller waited on something else)."""

        async def read(resp: aiohttp.ClientResponse) -> Any:
            return None if resp.status == 404 else await resp.json(content_type=None)

        return await self._post(instance, path, body, timeout_s, read)

    async def _post(
        self,
        instance: str,
        path: str,
        body: dict[str, Any],
        timeout_s: float,
        read: Callable[[aiohttp.ClientResponse], Awaitable[Any]],
    ) -> Any:
        state = self.cluster.instances.get(instance)
        if state is None:
            return None
        try:
            async with self.session.post(
                state.url + path,
                json=body,
                headers=state.config.auth_headers(),
                **(await tls_of(state.config)),
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                return await read(resp)
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:  # (a body too large too)
            log.warning("POST %s%s failed: %s: %s", instance, path, type(exc).__name__, exc)
            return None

"""Forwarding one OpenAI request: dispatch, call the instance, relay the answer.

The ledger records the request before the upstream call starts and releases it
in `finally`, whatever happens: finish, upstream error, or client disconnect
(aiohttp cancels the handler; closing the upstream connection makes vLLM abort
the request). A connection failure before the first byte is retried once on
another instance; the failed one is marked unhealthy until a scrape succeeds.
A stream on a migration-enabled instance is handed to `resumable.ResumableStream`,
which can continue it on another instance (failover, drain, rebalance, priority).
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
import uuid
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from migration_shim import wire
from proxy import continuation, token_ids
from proxy.cluster import Cluster
from proxy.config import ServerConfig
from proxy.errors import error_body, error_response
from proxy.kv_migration import FullModeSettings, KVMigrator
from proxy.ledger import LedgerEntry
from proxy.metrics import FerryMetrics
from proxy.policy import DispatchRequest, InstanceView, NoCandidate, Priority, dispatch
from proxy.policy.policies import DispatchPolicy
from proxy.policy.virtual_usage import request_blocks
from proxy.resumable import ANYWHERE, LiveState, ResumableStream

log = logging.getLogger("ferry.relay")

# Failures that happen before the instance produced anything: safe to retry.
_CONNECT_ERRORS = (
    aiohttp.ClientConnectorError,
    aiohttp.ServerDisconnectedError,
    aiohttp.ClientOSError,
)
# Failures of a stream already under way.
_STREAM_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)
_FORWARD_HEADERS = ("authorization", "x-request-id", "openai-organization", "openai-project")
_ATTEMPTS = 2  # the first try and one retry on another instance


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Relay:
    def __init__(
        self,
        cluster: Cluster,
        policy: DispatchPolicy,
        metrics: FerryMetrics,
        session: aiohttp.ClientSession,
        server: ServerConfig,
        rng: random.Random,
        clock: Callable[[], float] = time.monotonic,
        *,
        max_resumes: int = 2,
        prewarm: bool = True,
        full_mode: FullModeSettings | None = None,
    ) -> None:
        self.cluster = cluster
        self.policy = policy
        self.metrics = metrics
        self.session = session
        self.rng = rng
        self.clock = clock
        self.retry_after = str(server.retry_after_s)
        self.max_resumes = max_resumes
        self.prewarm = prewarm
        self.kv_migrator = KVMigrator(cluster, session, metrics, full_mode or FullModeSettings())
        self.streams: dict[int, ResumableStream] = {}  # live, movable streams by id
        self.background: set[asyncio.Task[bool]] = set()  # moves started by the relay
        self.timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=server.upstream_connect_timeout_s,
            sock_read=server.upstream_read_timeout_s,
        )

    def choose(self, request: DispatchRequest) -> InstanceView:
        started = time.perf_counter()
        view = self.cluster.view()
        chosen = dispatch(self.policy, request, view, self.rng)
        self.cluster.note_dispatch()
        self.metrics.decision.observe(time.perf_counter() - started)
        return chosen

    def make_room(self, chosen: InstanceView, blocks_needed: int) -> bool:
        """Priority: a high-priority request was placed where it does not fit. Move
        the lowest-priority, shortest stream off that instance to the freest other
        one, rather than let the high-priority request wait for memory."""
        room = chosen.freeness_high * max(chosen.batch, 1)  # M - V, headroom not counted
        if not chosen.capacity_blocks or room >= blocks_needed:
            return False
        if chosen.name not in self.migration_instances():
            return False
        victims = sorted(
            (
                s
                for s in self.streams_on(chosen.name)
                if s.state.priority < Priority.HIGH and s.movable
            ),
            key=lambda s: (s.state.priority, len(s.state.generated)),
        )
        if not victims:
            return False
        dest = victims[0].destination(None, {chosen.name})
        if dest is None:
            return False
        task = asyncio.create_task(self.move(victims[0], dest, "priority"))
        self.background.add(task)
        task.add_done_callback(self.background.discard)
        return True

    def migration_instances(self) -> set[str]:
        """Instances that can take part in a migration (as source or destination)."""
        return {
            name
            for name, state in self.cluster.instances.items()
            if state.config.migration != "off" and state.healthy and not state.draining
        }

    def streams_on(self, instance: str) -> list[ResumableStream]:
        return [s for s in self.streams.values() if s.instance == instance]

    async def move(self, stream: ResumableStream, destination: str, reason: str) -> bool:
        """Move one live stream (`destination` ANYWHERE: the policy picks): with its
        KV where both ends run the shim (full mode), else by recompute (lite)."""
        if not stream.movable:
            return False
        if not destination:  # resolve now, so the destination can be pre-warmed
            destination = stream.destination(None, {stream.instance}) or ANYWHERE
        if destination and self.kv_migrator.applies(stream, destination):
            return await self.kv_migrator.move(stream, destination, reason)
        if self.prewarm and destination:
            await stream.prewarm(destination)
        return stream.move(destination, reason)

    async def forward(
        self,
        request: web.Request,
        path: str,
        body: dict[str, Any] | None,
        raw: bytes,
        *,
        model: str | None,
        priority: Priority,
        prompt_estimate: int,
        arrived: float,
    ) -> web.StreamResponse:
        """Relay a request to the instance the policy picks. `body` is None for a
        pass-through call whose body Ferry does not read."""
        upstream_body, wants_ids = (None, True) if body is None else token_ids.upstream_body(body)
        send = raw if upstream_body is None else dumps(upstream_body)
        stream = bool(body and body.get("stream"))
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        if request.content_type:
            headers["Content-Type"] = request.content_type
        tried: set[str] = set()
        for _ in range(_ATTEMPTS):
            try:
                chosen = self.choose(
                    DispatchRequest(model, prompt_estimate, priority, frozenset(tried))
                )
            except NoCandidate as exc:
                if exc.model_unknown:
                    return error_response(404, exc.reason, code="model_not_found", param="model")
                return error_response(
                    503, exc.reason, code="no_instance", headers={"Retry-After": self.retry_after}
                )
            name = chosen.name
            if priority is Priority.HIGH:
                self.make_room(
                    chosen, request_blocks(prompt_estimate, self.cluster.block_size(name))
                )
            entry = self.cluster.ledger.add(name, model or "", priority, prompt_estimate, arrived)
            data, tag = send, None
            if stream and upstream_body and self.cluster.instances[name].migration_mode == "full":
                # Full mode: the tag lets the instance's shim find this request later.
                tag = uuid.uuid4().hex
                params = {**upstream_body.get("kv_transfer_params", {}), wire.TAG: tag}
                data = dumps({**upstream_body, "kv_transfer_params": params})
            try:
                upstream = await self.session.request(
                    request.method,
                    self.cluster.instances[name].url + path,
                    data=data,
                    headers=headers,
                    params=request.query,
                    timeout=self.timeout,
                )
            except _CONNECT_ERRORS as exc:
                self.cluster.ledger.release(entry)
                self.cluster.mark_unreachable(name, f"{type(exc).__name__}: {exc}")
                self.metrics.requests.labels(name, "connect_error").inc()
                tried.add(name)
                continue
            except BaseException:
                self.cluster.ledger.release(entry)
                raise
            outcome = "error"
            try:
                if upstream.status != 200:
                    response, outcome = await self._whole(upstream, entry, wants_ids, body is None)
                    upstream.release()
                    return response
                movable = self._movable(name, body, path, priority, wants_ids, tag)
                if movable is not None:
                    live = ResumableStream(self, movable, entry, arrived)
                    response, outcome = await live.run(request, upstream)
                elif stream:
                    response, outcome = await self._stream(
                        request, upstream, entry, wants_ids, arrived
                    )
                else:
                    response, outcome = await self._whole(upstream, entry, wants_ids, body is None)
                upstream.release()
                return response
            except asyncio.CancelledError:
                outcome = "client_disconnect"
                raise
            finally:
                upstream.close()  # a no-op after release(); aborts the upstream otherwise
                self.cluster.ledger.release(entry)
                self.metrics.requests.labels(name, outcome).inc()
        return error_response(
            503,
            f"could not connect to any instance (tried {', '.join(sorted(tried))})",
            code="no_instance",
            headers={"Retry-After": self.retry_after},
        )

    def _movable(
        self,
        name: str,
        body: dict[str, Any] | None,
        path: str,
        priority: Priority,
        wants_ids: bool,
        tag: str | None,
    ) -> LiveState | None:
        """State for a resumable stream, or None where lite migration does not apply."""
        if body is None or self.cluster.instances[name].config.migration == "off":
            return None
        endpoint = "chat" if path.endswith("/chat/completions") else "completions"
        why = continuation.not_migratable(body, endpoint)
        if why is not None:
            if body.get("stream"):
                self.metrics.non_migratable.labels(why).inc()
                log.info("request on %s not migratable: %s", name, why)
            return None
        options = body.get("stream_options") or {}
        return LiveState(
            body, endpoint, path, priority, wants_ids, bool(options.get("include_usage")), tag=tag
        )

    async def _whole(
        self,
        upstream: aiohttp.ClientResponse,
        entry: LedgerEntry,
        wants_ids: bool,
        passthrough: bool,
    ) -> tuple[web.StreamResponse, str]:
        try:
            raw = await upstream.read()
        except _STREAM_ERRORS as exc:
            return _upstream_failed(entry.instance, exc), "upstream_error"
        status = upstream.status
        if status >= 500:
            message = f"instance {entry.instance} answered HTTP {status}: {_message_of(raw)}"
            return error_response(502, message, code="upstream_error"), "upstream_5xx"
        outcome = "ok" if status < 400 else "upstream_4xx"
        if status == 200 and not passthrough:
            raw = self._account_whole(raw, entry, wants_ids)
        response = web.Response(
            status=status,
            body=raw,
            headers={
                "Content-Type": upstream.headers.get("Content-Type", "application/json"),
                "x-ferry-instance": entry.instance,
            },
        )
        return response, outcome

    def _account_whole(self, raw: bytes, entry: LedgerEntry, wants_ids: bool) -> bytes:
        prompt, generated, _ = token_ids.scan(raw)
        if prompt is not None:
            self.cluster.ledger.set_prompt_tokens(entry, prompt)
        self.cluster.ledger.add_generated(entry, generated)
        return raw if wants_ids else token_ids.hide(raw)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        entry: LedgerEntry,
        wants_ids: bool,
        arrived: float,
    ) -> tuple[web.StreamResponse, str]:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-ferry-instance": entry.instance,
            }
        )
        await response.prepare(request)
        timing = _TokenTiming(self.metrics, self.clock, arrived)
        pending = b""
        try:
            async for data in upstream.content.iter_any():
                pending += data
                out: list[bytes] = []
                while (cut := pending.find(b"\n\n")) >= 0:
                    event, pending = pending[:cut], pending[cut + 2 :]
                    out.append(self._relay_event(event, entry, wants_ids, timing))
                if out:
                    await response.write(b"".join(out))
        except _STREAM_ERRORS as exc:
            error = error_body(502, f"instance {entry.instance} broke the stream: {exc}")
            await _write_quietly(response, b"data: " + dumps(error) + b"\n\n")
            return response, "stream_broken"
        except ConnectionResetError:
            return response, "client_disconnect"
        await _write_quietly(response, None)
        return response, "ok"

    def _relay_event(
        self, event: bytes, entry: LedgerEntry, wants_ids: bool, timing: _TokenTiming
    ) -> bytes:
        if not event.startswith(b"data: {"):  # [DONE], comments, other fields
            return event + b"\n\n"
        prompt, generated, seen = token_ids.scan(event)
        if prompt is not None:
            self.cluster.ledger.set_prompt_tokens(entry, prompt)
        if generated:
            self.cluster.ledger.add_generated(entry, generated)
            timing.token()
        elif not seen and token_ids.has_text(event[6:]):
            timing.token()  # an engine that does not report token ids
        if wants_ids or not seen:
            return event + b"\n\n"
        return token_ids.hide(event) + b"\n\n"


class _TokenTiming:
    """Records TTFT on the first token chunk and inter-token gaps after it."""

    __slots__ = ("metrics", "clock", "arrived", "last")

    def __init__(self, metrics: FerryMetrics, clock: Callable[[], float], arrived: float) -> None:
        self.metrics, self.clock, self.arrived = metrics, clock, arrived
        self.last: float | None = None

    def token(self) -> None:
        now = self.clock()
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrived)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now


def _upstream_failed(instance: str, exc: BaseException) -> web.Response:
    return error_response(
        502, f"instance {instance} failed: {type(exc).__name__}: {exc}", code="upstream_error"
    )


def _message_of(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw[:200].decode(errors="replace")


async def _write_quietly(response: web.StreamResponse, data: bytes | None) -> None:
    """Finish a stream whose client may already be gone."""
    try:
        if data:
            await response.write(data)
        await response.write_eof()
    except ConnectionResetError:
        pass

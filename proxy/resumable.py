"""A client stream that can move between instances: lite-mode migration and failover.

The relay hands a streaming request on a migration-enabled instance to a
`ResumableStream`. It relays chunks like the plain relay but also keeps the
prompt ids P and generated ids G. When the upstream breaks (failover), or when
`move()` is called (drain, rebalance, priority), it closes the upstream (vLLM
aborts the request there) and continues on another instance from P + G (see
`continuation`), optionally after pre-warming the destination's prefix cache
with P + G so that only the last few tokens are recomputed at the cut-over.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from migration_shim import wire
from proxy import continuation as cont
from proxy import token_ids
from proxy.errors import error_body
from proxy.ledger import LedgerEntry
from proxy.policy import DispatchRequest, NoCandidate, Priority

if TYPE_CHECKING:
    from proxy.relay import Relay

log = logging.getLogger("ferry.migration")

_STREAM_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)
ANYWHERE = ""  # move() target meaning "wherever the policy says"
STOPPED_WAIT_S = 30.0  # full mode: how long a stopped source waits for its cut-over
_ids = itertools.count(1)


@dataclass
class LiveState:
    body: dict[str, Any]
    endpoint: str  # "chat" | "completions"
    path: str  # the client's request path, for a start-over
    priority: Priority
    wants_ids: bool
    wants_usage: bool
    id: int = field(default_factory=lambda: next(_ids))
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    sent_text_len: int = 0  # characters of generated text the client has
    sent_tail: str = ""  # its last characters, for stop strings across the join
    origin: cont.Origin | None = None
    segment: int = 0  # 0: the original request; n: the n-th continuation
    finished: bool = False
    move_to: str | None = None  # set by move(); ANYWHERE or an instance name
    move_reason: str = ""
    upstream: aiohttp.ClientResponse | None = None
    stopper: cont.StopAcrossJoin | None = None
    last_token_at: float | None = None
    downtime_from: float | None = None
    tag: str | None = None  # full mode: how the source's shim finds this request
    kv_load: dict[str, Any] | None = None  # full mode: KV waiting at the destination


class ResumableStream:
    def __init__(self, relay: Relay, state: LiveState, entry: LedgerEntry, arrived: float) -> None:
        self.relay = relay
        self.state = state
        self.entry = entry
        self.arrived = arrived
        self.stops = cont.stop_strings(state.body)
        self.first_token_seen = False
        self.role_sent = False  # chat: a restarted request must not repeat the role chunk
        self.pending = b""  # bytes read from the current upstream, not yet relayed
        self.move_requested = asyncio.Event()
        # Full mode: the source's shim stops the request itself; its abort must
        # not reach the client, and the stream must wait for the cut-over.
        self.source_stopping = False
        self.source_stopped = False
        self.kv_moving = False  # a full-mode move is under way (see kv_migration)

    @property
    def movable(self) -> bool:
        """Not finished, and no move under way."""
        state = self.state
        return state.move_to is None and not state.finished and not self.kv_moving

    @property
    def instance(self) -> str:
        """Where the stream runs now: its current ledger entry's instance."""
        return self.entry.instance

    # -- driving ------------------------------------------------------------------
    async def run(
        self, request: web.Request, upstream: aiohttp.ClientResponse
    ) -> tuple[web.StreamResponse, str]:
        relay, state = self.relay, self.state
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-ferry-instance": self.entry.instance,
            }
        )
        await response.prepare(request)
        relay.streams[state.id] = self
        try:
            while True:
                state.upstream = upstream
                result = await self._relay_until_moved(upstream, response)
                if result == "done":
                    upstream.close()
                    await _finish(response)
                    return response, "ok"
                if result == "moved":
                    # The source keeps its request until the destination has taken over,
                    # so a destination that fails costs nothing: the source goes on.
                    moved = await self._continue(state.move_reason, response)
                    if moved is not None:
                        upstream.close()  # vLLM aborts the request on the source
                        upstream = moved
                        continue
                    if not self.source_stopped:
                        log.warning("move of %s failed; it stays on %s", state.id, self.instance)
                        continue
                    # The source's shim stopped it already: resume it like a broken stream.
                upstream.close()
                if state.segment > relay.max_resumes:
                    await self._fail(response, "too many resumes")
                    return response, "stream_broken"
                moved = await self._continue("failover", response)
                if moved is None:
                    await self._fail(response, "failover: no instance could continue")
                    return response, "stream_broken"
                upstream = moved
        except ConnectionResetError:
            return response, "client_disconnect"
        finally:
            relay.streams.pop(state.id, None)
            relay.cluster.ledger.release(self.entry)
            if state.upstream is not None:
                state.upstream.close()

    async def _relay_until_moved(
        self, upstream: aiohttp.ClientResponse, response: web.StreamResponse
    ) -> str:
        """Relay until the stream ends ("done"), breaks ("broken"), or `move()` asks
        ("moved"; the source upstream stays open and unread data stays buffered)."""
        pump = asyncio.create_task(self._pump(upstream, response))
        wake = asyncio.create_task(self.move_requested.wait())
        try:
            done, _ = await asyncio.wait({pump, wake}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wake.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await pump
        if pump in done and pump.result() != "stopped":
            return pump.result()
        if pump in done:  # stopped by the shim: the cut-over is on its way
            try:
                await asyncio.wait_for(self.move_requested.wait(), STOPPED_WAIT_S)
            except asyncio.TimeoutError:
                return "broken"
        self.move_requested.clear()
        return "moved"

    def move(self, destination: str, reason: str, *, load: dict[str, Any] | None = None) -> bool:
        """Ask this stream to continue elsewhere (ANYWHERE: the policy picks).
        `load`: full mode moved the KV there; the continuation loads it."""
        state = self.state
        if state.move_to is not None or state.finished:
            return False
        state.move_to, state.move_reason = destination, reason
        state.kv_load = None if load is None else {**load, "dest": destination}
        self.move_requested.set()
        return True

    def expect_source_stop(self, expected: bool = True) -> None:
        self.source_stopping = expected

    async def _pump(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse) -> str:
        state = self.state
        try:
            while True:
                if b"\n\n" not in self.pending:
                    data = await upstream.content.readany()
                    if not data:
                        break
                    self.pending += data
                out: list[bytes] = []
                while (cut := self.pending.find(b"\n\n")) >= 0:
                    event, self.pending = self.pending[:cut], self.pending[cut + 2 :]
                    out.extend(self._event(event))
                    if state.finished or self.source_stopped:
                        break
                if out:
                    await response.write(b"".join(out))
                if self.source_stopped:
                    return "stopped"
                if state.finished:
                    return "done"
        except _STREAM_ERRORS:
            pass
        return "done" if state.finished else "broken"

    # -- one SSE event ------------------------------------------------------------
    def _event(self, event: bytes) -> list[bytes]:
        state = self.state
        if event.startswith(b"data: [DONE]"):
            state.finished = True
            return [b"data: [DONE]\n\n"]
        if not event.startswith(b"data: {"):
            return [event + b"\n\n"]
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return [event + b"\n\n"]
        if "error" in chunk:
            state.finished = True
            return [event + b"\n\n", b"data: [DONE]\n\n"]
        if self.source_stopping and any(
            c.get("finish_reason") == "abort" for c in chunk.get("choices") or ()
        ):
            self.source_stopped = True  # the shim stopped it for the cut-over
            return []
        if state.segment == 0:
            return self._original(chunk, event)
        return self._continued(chunk)

    def _original(self, chunk: dict[str, Any], event: bytes) -> list[bytes]:
        state = self.state
        if state.origin is None and "id" in chunk:
            state.origin = cont.Origin(
                chunk["id"],
                chunk.get("created", 0),
                chunk.get("model", ""),
                chunk.get("system_fingerprint"),
            )
        top = chunk.get("prompt_token_ids")
        if isinstance(top, list):
            state.prompt_ids = top
        if state.endpoint == "chat" and _is_role_chunk(chunk):
            if self.role_sent:
                return []  # a start-over repeats it; the client has it already
            self.role_sent = True
        new: list[int] = []
        for choice in chunk.get("choices") or ():
            if state.prompt_ids is None and isinstance(choice.get("prompt_token_ids"), list):
                state.prompt_ids = choice["prompt_token_ids"]
            new.extend(choice.get("token_ids") or ())
            delta = choice.get("delta")
            self._sent(delta.get("content") if isinstance(delta, dict) else choice.get("text"))
        if state.origin and chunk.get("system_fingerprint"):
            state.origin.system_fingerprint = chunk["system_fingerprint"]
        self._credit(new)
        # Relay the engine's own bytes: no re-serialization on the hot path.
        return [(event if state.wants_ids else token_ids.hide(event)) + b"\n\n"]

    def _continued(self, chunk: dict[str, Any]) -> list[bytes]:
        state = self.state
        assert state.origin is not None and state.prompt_ids is not None
        choices = chunk.get("choices") or []
        if not choices and "usage" in chunk:  # the continuation's usage: count it once
            return [self._usage_chunk()]
        hit = None
        for choice in choices:
            self._credit(list(choice.get("token_ids") or ()))
            text = choice.get("text") or ""
            if state.stopper is not None and state.stopper.active:
                text, hit = state.stopper.feed(text)
                if hit is not None:
                    choice["finish_reason"], choice["stop_reason"] = "stop", hit
            choice["text"] = text
            self._sent(text)
        out = cont.client_chunk(chunk, state.endpoint, state.origin, wants_ids=state.wants_ids)
        events = [b"data: " + _dumps(out) + b"\n\n"]
        if hit is not None:  # we end the stream the destination would not have ended
            state.finished = True
            if state.wants_usage:
                events.append(self._usage_chunk())
            events.append(b"data: [DONE]\n\n")
        return events

    def _credit(self, new: list[int]) -> None:
        if not new:
            return
        state = self.state
        state.generated.extend(new)
        self.relay.cluster.ledger.add_generated(self.entry, len(new))
        now = time.monotonic()
        if state.downtime_from is not None:
            self.relay.metrics.migration_downtime.observe(now - state.downtime_from)
            state.downtime_from = None
        if not self.first_token_seen:
            self.first_token_seen = True
            self.relay.metrics.ttft.observe(now - self.arrived)
        elif state.last_token_at is not None:
            self.relay.metrics.itl.observe(now - state.last_token_at)
        state.last_token_at = now

    def _sent(self, text: str | None) -> None:
        if text:
            state = self.state
            state.sent_text_len += len(text)
            state.sent_tail = (state.sent_tail + text)[-256:]

    def _usage_chunk(self) -> bytes:
        state = self.state
        assert state.origin is not None and state.prompt_ids is not None
        out: dict[str, Any] = {
            "id": state.origin.id,
            "object": "chat.completion.chunk" if state.endpoint == "chat" else "text_completion",
            "created": state.origin.created,
            "model": state.origin.model,
            "choices": [],
            "usage": cont.usage(len(state.prompt_ids), len(state.generated)),
        }
        return b"data: " + _dumps(out) + b"\n\n"

    # -- the cut-over ---------------------------------------------------------------
    async def _continue(
        self, reason: str, response: web.StreamResponse
    ) -> aiohttp.ClientResponse | None:
        relay, state = self.relay, self.state
        source = self.entry.instance
        if state.prompt_ids is None and self.first_token_seen:
            relay.metrics.migrations.labels(reason, "no_prompt_ids").inc()
            return None
        budget = cont.max_tokens(state.body)
        if budget is not None and budget - len(state.generated) <= 0:
            state.finished = True
            await response.write(b"data: [DONE]\n\n")
            return None
        tried = {source}
        target = state.move_to
        state.move_to = None
        state.downtime_from = state.last_token_at or time.monotonic()
        for _ in range(2):
            dest = self.destination(target, tried)
            if dest is None:
                relay.metrics.migrations.labels(reason, "no_destination").inc()
                return None
            tried.add(dest)
            target = None
            upstream = await self._start(dest, response)
            if upstream is not None:
                relay.metrics.migrations.labels(reason, "ok").inc()
                log.info(
                    "request %s moved %s -> %s (%s) after %d tokens",
                    state.origin.id if state.origin else "?",
                    source,
                    dest,
                    reason,
                    len(state.generated),
                )
                return upstream
            relay.metrics.migrations.labels(reason, "destination_failed").inc()
        state.downtime_from = None
        return None

    def destination(self, target: str | None, tried: set[str]) -> str | None:
        relay = self.relay
        usable = relay.migration_instances()
        if target and target in usable and target not in tried:
            return target
        exclude = frozenset(tried | (set(relay.cluster.instances) - usable))
        tokens = len(self.state.prompt_ids or ()) + len(self.state.generated)
        try:
            chosen = relay.choose(
                DispatchRequest(self.state.body["model"], tokens, self.state.priority, exclude)
            )
        except NoCandidate:
            return None
        return chosen.name

    async def _start(
        self, dest: str, response: web.StreamResponse
    ) -> aiohttp.ClientResponse | None:
        relay, state = self.relay, self.state
        url = relay.cluster.instances[dest].url
        kv_params: dict[str, Any] = {}
        if relay.cluster.instances[dest].migration_mode == "full":
            kv_params[wire.TAG] = uuid.uuid4().hex
        if state.prompt_ids is None:
            # Nothing generated yet (queued, or broken before the first token): start
            # the original request over on the destination; the client sees no seam.
            path, body = state.path, {**state.body, "return_token_ids": True}
            held, tokens = "", self.entry.prompt_tokens
        else:
            path = "/v1/completions"
            held = await self._held_back_text(url) if self.stops else ""
            body = cont.continuation_body(
                state.body, state.prompt_ids, state.generated, wants_usage=state.wants_usage
            )
            tokens = len(state.prompt_ids) + len(state.generated)
            load, state.kv_load = state.kv_load, None
            if load is not None and load["dest"] == dest:
                # The source had the KV of its tokens but the last; the destination
                # computes at least that one itself.
                kv_params[wire.LOAD] = {
                    "mig_id": load["mig_id"],
                    "num_tokens": min(load["num_tokens"], tokens - 1),
                }
        if kv_params:
            body = {
                **body,
                "kv_transfer_params": {**body.get("kv_transfer_params", {}), **kv_params},
            }
        entry = relay.cluster.ledger.add(
            dest, state.body["model"], state.priority, tokens, time.monotonic()
        )
        try:
            upstream = await relay.session.post(
                url + path,
                data=_dumps(body),
                headers={"Content-Type": "application/json"},
                timeout=relay.timeout,
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            relay.cluster.ledger.release(entry)
            relay.cluster.mark_unreachable(dest, f"{type(exc).__name__}: {exc}")
            await self._release_kv(url, kv_params)
            return None
        if upstream.status != 200:
            detail = (await upstream.read())[:300]
            upstream.release()
            relay.cluster.ledger.release(entry)
            log.warning("continuation on %s refused: HTTP %s %s", dest, upstream.status, detail)
            await self._release_kv(url, kv_params)
            return None
        relay.cluster.ledger.release(self.entry)
        self.entry = entry
        self.pending = b""
        state.tag = kv_params.get(wire.TAG)
        self.source_stopping = self.source_stopped = False
        if state.prompt_ids is None:
            return upstream  # a fresh start: its chunks are the original kind
        state.segment += 1
        state.stopper = cont.StopAcrossJoin(
            self.stops, state.sent_tail, bool(state.body.get("include_stop_str_in_output"))
        )
        if held:
            await self._emit_held(held, response)
        return upstream

    async def _release_kv(self, url: str, kv_params: dict[str, Any]) -> None:
        """A continuation that did not start frees the KV moved for it at once,
        rather than when its lease runs out."""
        if wire.LOAD in kv_params:
            await self.relay.kv_migrator.release(url, kv_params[wire.LOAD]["mig_id"])

    async def _held_back_text(self, url: str) -> str:
        """Text of G the client has not seen: vLLM holds back up to the longest stop
        string minus one character while streaming, and the destination will never
        send it (G is its prompt)."""
        state = self.state
        try:
            async with self.relay.session.post(
                url + "/detokenize",
                json={"model": state.body["model"], "tokens": state.generated},
                timeout=aiohttp.ClientTimeout(total=5),
            ) as resp:
                text = (await resp.json()).get("prompt", "")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            return ""
        return str(text)[state.sent_text_len :]

    async def _emit_held(self, held: str, response: web.StreamResponse) -> None:
        state = self.state
        assert state.stopper is not None and state.origin is not None
        text, hit = state.stopper.feed(held)
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": None}
        if hit is not None:
            choice.update(finish_reason="stop", stop_reason=hit)
        self._sent(text)
        out = cont.client_chunk(
            {"choices": [choice]}, state.endpoint, state.origin, wants_ids=False
        )
        await response.write(b"data: " + _dumps(out) + b"\n\n")

    async def prewarm(self, dest: str) -> None:
        """Lite pre-copy: P + G0 as a one-token request, so the destination's prefix
        cache holds those blocks while the source keeps decoding."""
        state = self.state
        if state.prompt_ids is None:
            return
        body = {
            "model": state.body["model"],
            "prompt": state.prompt_ids + state.generated,
            "max_tokens": 1,
        }
        if "cache_salt" in state.body:
            body["cache_salt"] = state.body["cache_salt"]
        url = self.relay.cluster.instances[dest].url
        try:
            async with self.relay.session.post(
                url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=30)
            ) as resp:
                await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass  # pre-warm is an optimisation; the cut-over recomputes instead

    async def _fail(self, response: web.StreamResponse, why: str) -> None:
        error = error_body(
            502, f"stream from {self.entry.instance} broke and could not resume: {why}"
        )
        try:
            await response.write(b"data: " + _dumps(error) + b"\n\n")
            await response.write_eof()
        except ConnectionResetError:
            pass


def _is_role_chunk(chunk: dict[str, Any]) -> bool:
    choices = chunk.get("choices") or ()
    return bool(choices) and all(
        isinstance(c.get("delta"), dict) and "role" in c["delta"] and not c["delta"].get("content")
        for c in choices
    )


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


async def _finish(response: web.StreamResponse) -> None:
    try:
        await response.write_eof()
    except ConnectionResetError:
        pass

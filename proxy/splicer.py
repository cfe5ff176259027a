"""Splicing a moved stream, the pure part: upstream SSE events in, client bytes out.

A movable stream runs in segments: the original request (segment 0), then one
`/v1/completions` continuation per move, each started with prompt P + G (the
prompt ids and the ids generated so far). The client must see one stream, the
one an unmoved run would have given it:
- the original id, created, model and system fingerprint; chat deltas for a
  chat request; the role chunk once; usage counted once, over all segments;
- exactly the unmoved run's token ids and text at the join (see `plan_join`);
- a stop string that starts before the join and ends after it honoured (the
  destination cannot see text it did not generate).

Nothing here does I/O: the live stream feeds events and writes what comes out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy import sse, token_ids

REPLACEMENT = "\ufffd"  # what a detokenizer shows for bytes of an incomplete character
MAX_BACKOFF = 16  # tokens a join may step back to find a whole character


@dataclass
class Origin:
    """Identity of the client's stream, from its first chunk."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


@dataclass(frozen=True, slots=True)
class Fed:
    """What one upstream event gave: bytes for the client and what they mean."""

    data: bytes = b""
    tokens: int = 0  # generated token ids new to the client
    prompt_tokens: int | None = None  # the engine's count, when this event reports it
    finished: bool = False  # the stream is over ([DONE], an error, or a stop across the join)
    stopped_by_source: bool = False  # the abort a full-mode source sends when it stops


@dataclass(frozen=True, slots=True)
class Join:
    """Where a continuation starts: P + G[:keep], and the text the client still lacks.

    `held` is text of G[:keep] the source never sent (vLLM holds back the tail of
    its text while a character is incomplete or a stop string may be forming).
    The destination regenerates G[keep:] first; the splicer drops those ids.
    """

    keep: int
    held: str


def plan_join(generated: list[int], sent: str, detokenized: list[str | None], hold: int) -> Join:
    """Choose the join of a continuation after `generated`, given the text the
    client has (`sent`), `detokenized[i]` = the text of generated[:len - i] (None
    where unknown), i = 0..MAX_BACKOFF, and `hold`, the characters vLLM holds
    back for stop strings (the longest stop string's length - 1, or 0).

    A prompt that ends inside a character breaks the destination's detokenizer:
    vLLM primes it with the prompt, cannot find a clean prefix, and emits the
    whole prompt's text with the character's first piece. So the join steps back
    to the last token boundary where the text is whole; the destination
    regenerates the few tokens after it (they hold no text of their own). The
    source's stream had flushed all text up to that boundary but the `hold`
    characters kept for stop strings: those are owed to the client.
    """
    for back, text in enumerate(detokenized):
        if text is None:
            break
        if not text.endswith(REPLACEMENT):
            return Join(len(generated) - back, _held(text, sent, hold))
    return Join(len(generated), "")  # no whole boundary found: join where we are


def _held(text: str, sent: str, hold: int) -> str:
    """The end of `text` the client lacks: at most `hold` characters. (`/detokenize`
    keeps special tokens that the stream skips; then only the tail is trusted.)"""
    if hold <= 0 or not text:
        return ""
    held = text[len(sent) :] if text.startswith(sent) else ""
    return held if len(held) <= hold else text[-hold:]


class StopAcrossJoin:
    """Finds a stop string that starts before the join and ends after it.

    `tail` is the end of the text the client already has. Each piece of new text
    is checked with the tail in front until the new text alone is as long as the
    longest stop string; after that the destination's own check suffices.
    """

    def __init__(self, stops: list[str], tail: str, include_stop: bool) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.tail = tail[-self.longest :] if self.longest else ""
        self.new = ""
        self.include_stop = include_stop

    @property
    def active(self) -> bool:
        return bool(self.stops) and len(self.new) < self.longest

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text to pass on, the stop string hit or None). Of several, the one
        that ends first wins, as in vLLM."""
        if not self.active:
            return text, None
        before = len(self.tail) + len(self.new)
        window = self.tail + self.new + text
        self.new += text
        hit_end, hit = None, None
        for stop in self.stops:
            at = window.find(stop, max(0, len(self.tail) - len(stop) + 1))
            if at != -1 and at < len(self.tail) and (hit_end is None or at + len(stop) < hit_end):
                hit_end, hit = at + len(stop), stop
        if hit is None or hit_end is None:
            return text, None
        end = hit_end if self.include_stop else hit_end - len(hit)
        return window[before:end] if end > before else "", hit


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str)]
    return []


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Splicer:
    """The client's view of one movable stream, across all its segments."""

    def __init__(self, body: dict[str, Any], endpoint: str, wants_ids: bool) -> None:
        self.endpoint = endpoint  # "chat" | "completions"
        self.wants_ids = wants_ids
        self.wants_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.stops = stop_strings(body)
        self.hold = max((len(s) for s in self.stops), default=1) - 1  # vLLM's stop buffer
        self.include_stop = bool(body.get("include_stop_str_in_output"))
        self.origin: Origin | None = None
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.sent = ""  # all generated text the client has
        # len(generated) after the last chunk that carried text: vLLM's detokenizer
        # had flushed there, so the text of generated[:flushed] is whole. Sure only
        # when that chunk carried one token (else the flush may be inside it).
        self.flushed = 0
        self.flushed_sure = True
        self.segment = 0  # 0: the original request; n: the n-th continuation
        self.finished = False  # the client's stream is over
        self.ended = False  # the generation is over (a finish reason came); [DONE] may follow
        self.expect_source_stop = False  # full mode: the source's abort is a hand-over
        self._role_sent = False
        self._stopper: StopAcrossJoin | None = None
        self._regenerated: list[int] = []  # ids the destination repeats before new ones

    # -- upstream events ---------------------------------------------------------
    def feed(self, event: bytes) -> Fed:
        """One SSE event of the current upstream (without its blank line)."""
        if event.startswith(b"data: [DONE]"):
            self.finished = True
            return Fed(sse.DONE, finished=True)
        if not event.startswith(b"data: {"):
            return Fed(event + b"\n\n")
        try:
            chunk = json.loads(event[6:])
        except ValueError:
            return Fed(event + b"\n\n")
        if not isinstance(chunk, dict):
            return Fed(event + b"\n\n")
        if "error" in chunk:
            self.finished = True
            return Fed(event + b"\n\n" + sse.DONE, finished=True)
        choices = [c for c in chunk.get("choices") or () if isinstance(c, dict)]
        if self.expect_source_stop and any(c.get("finish_reason") == "abort" for c in choices):
            return Fed(stopped_by_source=True)
        if any(c.get("finish_reason") for c in choices):
            self.ended = True
        if self.segment == 0:
            return self._original(chunk, choices, event)
        return self._continued(chunk, choices)

    def _original(self, chunk: dict[str, Any], choices: list[dict[str, Any]], raw: bytes) -> Fed:
        if self.origin is None and "id" in chunk:
            self.origin = Origin(str(chunk["id"]), chunk.get("created", 0), chunk.get("model", ""))
        if self.origin is not None and chunk.get("system_fingerprint"):
            self.origin.system_fingerprint = chunk["system_fingerprint"]
        prompt = chunk.get("prompt_token_ids")
        for choice in choices:
            if not isinstance(prompt, list):
                prompt = choice.get("prompt_token_ids")
        reported = None
        if isinstance(prompt, list) and self.prompt_ids is None:
            self.prompt_ids, reported = prompt, len(prompt)
        if self.endpoint == "chat" and _is_role_chunk(choices):
            if self._role_sent:
                return Fed(prompt_tokens=reported)  # a start-over repeats it
            self._role_sent = True
        new: list[int] = []
        texts = ""
        for choice in choices:
            new.extend(choice.get("token_ids") or ())
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                texts += text
        self._credit(new, texts)
        # The engine's own bytes: no re-serialization on the hot path.
        data = raw if self.wants_ids else token_ids.hide(raw)
        return Fed(data + b"\n\n", len(new), reported)

    def _continued(self, chunk: dict[str, Any], choices: list[dict[str, Any]]) -> Fed:
        if not choices and "usage" in chunk:  # the continuation's own usage: ours instead
            return Fed(self._usage_event())
        hit = None
        new: list[int] = []
        texts = ""
        for choice in choices:
            ids = self._drop_regenerated(list(choice.get("token_ids") or ()))
            new.extend(ids)
            text = choice.get("text") or ""
            if self._stopper is not None and self._stopper.active:
                text, hit = self._stopper.feed(text)
                if hit is not None:
                    choice["finish_reason"], choice["stop_reason"] = "stop", hit
            choice["text"], choice["token_ids"] = text, ids
            texts += text
        self._credit(new, texts)
        if not new and not any(c["text"] or c.get("finish_reason") for c in choices):
            return Fed()  # only regenerated ids: nothing the client lacks
        data = sse.event(self._client_chunk(choices))
        if hit is not None:  # we end the stream the destination would not have ended
            self.finished = self.ended = True
            if self.wants_usage:
                data += self._usage_event()
            return Fed(data + sse.DONE, len(new), finished=True)
        return Fed(data, len(new))

    def _credit(self, new: list[int], text: str) -> None:
        self.generated.extend(new)
        self.sent += text
        if text:
            self.flushed, self.flushed_sure = len(self.generated), len(new) <= 1

    def _drop_regenerated(self, ids: list[int]) -> list[int]:
        while ids and self._regenerated:
            # Greedy decoding repeats them exactly. With sampling they may differ;
            # the client has the source's already, and those are what count.
            ids.pop(0)
            self._regenerated.pop(0)
        return ids

    # -- moves -------------------------------------------------------------------
    def restart(self) -> None:
        """The original request starts over elsewhere (nothing was generated)."""
        self.expect_source_stop = False

    def join(self, plan: Join) -> bytes:
        """A continuation from P + G[:plan.keep] starts now; returns what the
        client gets at once: the held text. It cannot complete a stop string (the
        source checked all of its text, held or not); stop strings that start
        before the join and end after it are checked from here on."""
        assert self.origin is not None and self.prompt_ids is not None
        self.segment += 1
        self.expect_source_stop = False
        self._regenerated = self.generated[plan.keep :]
        self.flushed = plan.keep
        self.sent += plan.held
        self._stopper = StopAcrossJoin(self.stops, self.sent, self.include_stop)
        if not plan.held:
            return b""
        choice = {"index": 0, "text": plan.held, "finish_reason": None}
        return sse.event(self._client_chunk([choice]))

    def join_point(self) -> tuple[int, bool]:
        """Where a continuation should start (see `plan_join`), and whether that
        is certain without asking `/detokenize`: the last flush, sure when it was
        a one-token chunk and no text is held back for stop strings."""
        return self.flushed, self.flushed_sure and self.hold == 0

    def continuation_tokens(self) -> int:
        return len(self.prompt_ids or ()) + len(self.generated)

    # -- client chunks -------------------------------------------------------------
    def _client_chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        """Destination completion choices as the client's stream expects them."""
        assert self.origin is not None
        out_choices = []
        for choice in choices:
            ids = choice.get("token_ids") if self.wants_ids else None
            if self.endpoint == "chat":
                out: dict[str, Any] = {
                    "index": choice.get("index", 0),
                    "delta": {"content": choice.get("text", "")},
                    "logprobs": None,  # completion-style logprobs do not map onto chat's
                    "finish_reason": choice.get("finish_reason"),
                    "token_ids": ids,
                }
                if "stop_reason" in choice:
                    out["stop_reason"] = choice["stop_reason"]
                out_choices.append(out)
            else:
                out_choices.append({**choice, "token_ids": ids, "prompt_token_ids": None})
        return self._envelope(out_choices)

    def _usage_event(self) -> bytes:
        out = self._envelope([])
        out["usage"] = usage(len(self.prompt_ids or ()), len(self.generated))
        return sse.event(out)

    def _envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        assert self.origin is not None
        out: dict[str, Any] = {
            "id": self.origin.id,
            "object": "chat.completion.chunk" if self.endpoint == "chat" else "text_completion",
            "created": self.origin.created,
            "model": self.origin.model,
            "choices": choices,
        }
        if self.origin.system_fingerprint:
            out["system_fingerprint"] = self.origin.system_fingerprint
        return out


def _is_role_chunk(choices: list[dict[str, Any]]) -> bool:
    return bool(choices) and all(
        isinstance(c.get("delta"), dict) and "role" in c["delta"] and not c["delta"].get("content")
        for c in choices
    )

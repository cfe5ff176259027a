"""Splicing a moved stream, the pure part: upstream SSE events in, client bytes out.

A movable stream runs in segments: the original request (segment 0), then one
`/v1/completions` continuation per move, each started with prompt P + G (the
prompt ids and the ids generated so far). The client must see one stream, the
one an unmoved run would have given it:
- the original id, created, model and system fingerprint; chat deltas for a
  chat request; the role chunk once; usage counted once, over all segments;
- exactly the unmoved run's token ids and text at the join, stop strings that
  span it included (see `Join`).

Nothing here does I/O: the live stream feeds events and writes what comes out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from proxy import sse, token_ids

REPLACEMENT = "\ufffd"  # what a detokenizer shows for bytes of an incomplete character
MAX_BACKOFF = 16  # tokens a join steps back at most before asking /detokenize


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
    # The engine gave the request up mid-way: any other abort, or a server error
    # (vLLM's API server, its engine core dead, sends each stream a 500 error
    # event and [DONE]). Nothing of the event reaches the client; the stream is
    # broken and resumes elsewhere. A client error (4xx) would fail anywhere: it
    # is relayed as the end.
    broken: bool = False


@dataclass(frozen=True, slots=True)
class Join:
    """Where a continuation starts: prompt P + G[:keep]. The destination first
    regenerates G[keep:] (the splicer drops those ids), and the first `skip`
    characters of its text are text the client already has.

    Why not simply P + G: vLLM's detokenizer, primed with a prompt that ends
    inside a character, emits the whole prompt's text; and a stop string that
    starts in text the destination sees as its prompt is never found. So the join
    steps back to a point where vLLM had flushed its text (a whole character), at
    least `lookback` characters (the longest stop string's, less one) before the
    end of the text generated so far. The destination sees those characters as
    its own output again: it holds them back and checks stop strings over them as
    the unmoved run did, and ends the stream where it would have. It costs a few
    decode steps on the destination.
    """

    keep: int
    skip: int


def plan_join(
    generated: list[int], sent: str, detokenized: list[str | None], hold: int, lookback: int
) -> Join | None:
    """A join found with `/detokenize`, for when the stream showed no flush near
    the cut (vLLM merged chunks): `detokenized[i]` is the text of
    generated[:len - i] (None: unknown), `sent` the text the client has, `hold`
    what vLLM holds back of its text (`lookback`, or 0 when stop strings are
    included in the output). None when no point in range will do."""
    made = len(sent) + hold if sent else 0  # the text vLLM has made so far
    for back, text in enumerate(detokenized):
        if text is None:
            return None
        if text.endswith(REPLACEMENT):
            continue
        if not lookback:
            # No stop strings: vLLM had sent all text up to the last whole point.
            # (Lengths are not compared: /detokenize shows special tokens.)
            return Join(len(generated) - back, 0)
        if len(text) > made - lookback:
            continue
        if not sent.startswith(text):  # special tokens: /detokenize shows them
            return None
        return Join(len(generated) - back, len(sent) - len(text))
    return None


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str)]
    return []


def server_fault(error: Any) -> bool:
    """Whether a streamed error event is the server's fault (a 5xx code, or no
    code at all), not the request's."""
    code = error.get("code") if isinstance(error, dict) else None
    if isinstance(code, str) and code.isdecimal():  # (isdigit takes "²": int() does not)
        code = int(code)
    return not isinstance(code, int) or code >= 500


_USAGE_COUNTS = frozenset({"prompt_tokens", "completion_tokens", "total_tokens"})


def only_ids(choices: list[Any]) -> bool:
    """Whether a chat chunk is there only for the token ids Ferry asked for:
    where a tool or reasoning parser holds a token's text back (or it makes
    none), vLLM's chat sends the token only where ids or logprobs were asked
    for, as `"delta": {}`. Without them the client would get none. (Without a
    parser, it sends a token that makes no text as `"content": ""` either way.)"""
    return bool(choices) and all(
        isinstance(c, dict)
        and c.get("delta") == {}
        and c.get("finish_reason") is None
        and c.get("logprobs") is None
        for c in choices
    )


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
        options = body.get("stream_options") or {}
        self.wants_usage = bool(options.get("include_usage"))
        # Usage on every chunk (vLLM's `continuous_usage_stats`): a continuation's
        # chunks get the stream's own, counted from its start.
        self.continuous_usage = self.wants_usage and bool(options.get("continuous_usage_stats"))
        # vLLM holds back the last `lookback` characters of its text while a stop
        # string may be forming, unless stop strings are included in the output.
        self.lookback = max((len(s) for s in stop_strings(body) if s), default=1) - 1
        self.hold = 0 if body.get("include_stop_str_in_output") else self.lookback
        # Sampled, the tokens a join regenerates are drawn anew (see `Join`).
        self.sampled = not _greedy(body)
        self.origin: Origin | None = None
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []
        self.sent = ""  # all generated text the client has
        self._counted = False  # the client has a usage count of generated tokens
        # (len(generated), len(sent)) after recent one-token chunks with text: vLLM's
        # detokenizer flushed at that token, so its text there was whole, `hold`
        # characters longer than what it had sent.
        self.flushes: deque[tuple[int, int]] = deque(maxlen=256)
        self.segment = 0  # 0: the original request; n: the n-th continuation
        self.finished = False  # the client's stream is over
        self.ended = False  # the generation is over (a finish reason came); [DONE] may follow
        self.expect_source_stop = False  # full mode: the source's abort is a hand-over
        # Why a continuation could not go on as this stream would (None: it can).
        # A reasoning model's thoughts come apart from its answer, and a
        # continuation (a completion) would give the rest of them as answer text.
        self.unmovable: str | None = None
        self.usage_sent = False
        # The source's usage fields past the three counts (vLLM's chat puts
        # `completion_tokens_details` on every chunk's), for a chunk with choices
        # (False) and the last, usage-only one (True): a continuation, a
        # completion, has others, and the client's usage keeps the source's shape.
        self._usage_extras: dict[bool, dict[str, Any]] = {}
        self._role_sent = False
        # The original request was sent again after the client had the start of
        # its stream (`restart`): the chunks that follow take the client's id.
        self._started_over = False
        self._regenerated: list[int] = []  # ids the destination repeats before new ones
        self._skip = 0  # characters of the destination's text the client has already
        # Chunks of tokens without text the client has (`restart`), and those a
        # start-over leaves out of its own first ones (the client has as many).
        self._textless_sent = 0
        self._textless_owed = 0

    @property
    def whole(self) -> bool:
        """The client has all of the stream, perhaps but its [DONE]: the finish reason,
        and the usage where it asked for it (as relay.StreamEnd judges a relayed
        stream). Some servers send no [DONE]."""
        return self.finished or self.ended and (self.usage_sent or not self.wants_usage)

    # -- upstream events ---------------------------------------------------------
    def feed(self, event: bytes) -> Fed:
        """One SSE event of the current upstream (without its blank line)."""
        data = sse.data_of(event)
        if data is not None and data.startswith(b"[DONE]"):
            self.finished = True
            # A continuation asked for the usage the client did: one that sent
            # none still leaves the client the count it asked for (`closing`).
            return Fed(self.closing() if self.segment else sse.DONE, finished=True)
        if data is None or not data.startswith(b"{"):
            return Fed(event + b"\n\n")
        try:
            chunk = sse.loads(data)
        except (ValueError, RecursionError):
            return Fed(event + b"\n\n")
        if not isinstance(chunk, dict):
            return Fed(event + b"\n\n")
        if "error" in chunk:
            if server_fault(chunk["error"]):
                return Fed(broken=True)
            self.finished = True
            return Fed(event + b"\n\n" + sse.DONE, finished=True)
        listed = chunk.get("choices")
        choices = [c for c in listed if isinstance(c, dict)] if isinstance(listed, list) else []
        if any(c.get("finish_reason") == "abort" for c in choices):
            return Fed(stopped_by_source=True) if self.expect_source_stop else Fed(broken=True)
        if any(c.get("finish_reason") for c in choices):
            self.ended = True
        final_usage = self._final_usage(chunk, choices)
        if final_usage:  # (segment 0 relays it as it came; a continuation's is ours instead)
            self.usage_sent = True
        if self.segment == 0 and isinstance(chunk.get("usage"), dict):
            extras = {k: v for k, v in chunk["usage"].items() if k not in _USAGE_COUNTS}
            self._usage_extras[not choices] = extras  # as of the cut (reasoning_tokens grow)
        if self.segment == 0:
            return self._original(chunk, choices, event)
        return self._continued(chunk, choices, final_usage)

    def _final_usage(self, chunk: dict[str, Any], choices: list[dict[str, Any]]) -> bool:
        """Whether the chunk carries the stream's usage: vLLM sends it in a chunk
        of its own, with no choices; other servers with the last choice's, or
        with `"choices": null`. With `continuous_usage_stats` every chunk has
        one, and the last comes with no choices (as relay.StreamEnd reads it)."""
        return isinstance(chunk.get("usage"), dict) and not (choices and self.continuous_usage)

    def _original(self, chunk: dict[str, Any], choices: list[dict[str, Any]], raw: bytes) -> Fed:
        if self.origin is None:  # (a server may send no id: a move still needs an origin)
            origin_id = str(chunk.get("id", ""))
            self.origin = Origin(origin_id, chunk.get("created", 0), chunk.get("model", ""))
        if self.origin is not None and chunk.get("system_fingerprint"):
            self.origin.system_fingerprint = chunk["system_fingerprint"]
        reported = None
        # The first chunk reports them, the request's own call's and, once it
        # starts over, its new call's (billed and indexed where it runs now).
        if self.prompt_ids is None or self._started_over and not self.generated:
            sent = [chunk.get("prompt_token_ids")] + [c.get("prompt_token_ids") for c in choices]
            prompt = next((ids for ids in map(_ids, sent) if ids is not None), None)
            if prompt is not None:
                self.prompt_ids, reported = prompt, len(prompt)
            elif any(sent):
                self.unmovable = "token ids that are not integers"
        if self.endpoint == "chat" and _is_role_chunk(choices):
            if self._role_sent:
                return Fed(prompt_tokens=reported)  # a start-over repeats it
            self._role_sent = True
        new: list[int] = []
        texts = ""
        for choice in choices:
            new.extend(self._valid_ids(choice.get("token_ids")))
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if isinstance(text, str):
                texts += text
                if text and choice.get("token_ids") is None and self.unmovable is None:
                    # Text whose ids the engine kept back (a chat with its
                    # reasoning hidden): a continuation would miss them.
                    self.unmovable = "text without token ids"
            if isinstance(delta, dict) and any(delta.get(k) for k in _REASONING):
                self.unmovable = "reasoning"
        self._credit(new, texts)
        if not self.wants_ids and self.endpoint == "chat" and only_ids(choices):
            return Fed(b"", len(new), reported)
        if new and isinstance(chunk.get("usage"), dict):
            self._counted = True  # the client has a count of the tokens generated
        if new and not texts and not self.ended:
            if self._textless_owed:  # the client has this chunk's like already
                self._textless_owed -= 1
                return Fed(b"", len(new), reported)
            self._textless_sent += 1
        else:
            self._textless_owed = 0  # (only the start-over's first ones)
        if self._started_over:  # the request sent again (`restart`): the client's identity
            origin = self.origin
            chunk.update(id=origin.id, created=origin.created, model=origin.model)
            raw = b"data: " + sse.dumps(chunk)
        # The engine's own bytes, elsewhere: no re-serialization on the hot path.
        data = raw if self.wants_ids else token_ids.hide(raw)
        return Fed(data + b"\n\n", len(new), reported)

    def _continued(
        self, chunk: dict[str, Any], choices: list[dict[str, Any]], final_usage: bool
    ) -> Fed:
        assert self.origin is not None
        if chunk.get("system_fingerprint"):  # vLLM's comes with the last chunk only
            self.origin.system_fingerprint = chunk["system_fingerprint"]
        if not choices and final_usage:  # the continuation's own usage: ours instead
            return Fed(self._usage_event())
        new: list[int] = []
        texts = ""
        for choice in choices:
            ids = self._valid_ids(choice.get("token_ids"))
            ids = self._drop_regenerated(list(ids))
            text = choice.get("text")
            if not isinstance(text, str):  # (an engine's null; anything else is no text)
                text = ""
            if self._skip:
                text, self._skip = text[self._skip :], max(0, self._skip - len(text))
            choice["text"], choice["token_ids"] = text, ids
            new.extend(ids)
            texts += text
        self._credit(new, texts)
        if not (new or final_usage or any(c["text"] or c.get("finish_reason") for c in choices)):
            return Fed()  # only regenerated tokens: nothing the client lacks
        # (A token with no text goes on as `"content": ""`, as vLLM's chat
        # sends one where no tool or reasoning parser holds it back.)
        out = self._client_chunk(choices)
        if final_usage:  # with the last choice's, where the server put it: ours instead
            out["usage"] = self._usage(final=True)
        return Fed(sse.event(out), len(new))

    def _valid_ids(self, value: Any) -> list[int]:
        """A choice's token ids; none, and the stream can no longer move, where
        the engine sent something else (a continuation needs them exact)."""
        ids = _ids(value)
        if ids is None:
            if value:
                self.unmovable = "token ids that are not integers"
            return []
        return ids

    def _credit(self, new: list[int], text: str) -> None:
        self.generated.extend(new)
        self.sent += text
        if text and len(new) == 1:
            self.flushes.append((len(self.generated), len(self.sent)))

    def _drop_regenerated(self, ids: list[int]) -> list[int]:
        while ids and self._regenerated:
            # Greedy decoding repeats them exactly. With sampling they may differ;
            # the client has the source's already, and those are what count.
            ids.pop(0)
            self._regenerated.pop(0)
        return ids

    # -- moves -------------------------------------------------------------------
    def starts_over(self) -> bool:
        """Whether a move sends the original request again, rather than continue
        it: the client has none of the answer yet (no text; no ids or usage
        counts, where it asked for them), so the destination may as well make
        all of it. A chat whose first tokens made no text (a reasoning model's
        `<think>`, before its thoughts show it reasons) is then made as a chat
        again, not continued as a completion that would show the thoughts."""
        shown = self.sent or (self.generated and (self.wants_ids or self._counted))
        return self.prompt_ids is None or (self.segment == 0 and not shown)

    def restart(self) -> None:
        """The original request starts over elsewhere (`starts_over`). Its first
        chunks of tokens without text are left out, as many as the client has:
        at temperature 0 they are those again (a client counting chunks counted
        them twice), sampled any text comes at once."""
        self.expect_source_stop = False
        self.generated, self.sent, self._counted = [], "", False
        self.flushes.clear()
        self._started_over = self.origin is not None
        self._textless_owed = self._textless_sent  # (all the client has, however many restarts)

    def join_point(self) -> tuple[Join, bool]:
        """The join from the stream's own flushes (see `Join`), and whether it is
        near the cut (within MAX_BACKOFF tokens; else `plan_join` may do better)."""
        target = len(self.sent) - self.lookback
        keep, whole = 0, 0  # the start, where the text is empty and whole
        for tokens, sent in reversed(self.flushes):
            if sent <= target:
                keep, whole = tokens, sent + self.hold
                break
        return Join(keep, len(self.sent) - whole), len(self.generated) - keep <= MAX_BACKOFF

    def join(self, plan: Join) -> None:
        """A continuation from P + G[:plan.keep] takes over now."""
        assert self.origin is not None and self.prompt_ids is not None
        self.segment += 1
        self.expect_source_stop = False
        self._regenerated = self.generated[plan.keep :]
        self._skip = plan.skip

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
                if out["finish_reason"] is not None:  # vLLM's chat says it with the finish
                    out["stop_reason"] = choice.get("stop_reason")
                out_choices.append(out)
            else:
                out_choices.append({**choice, "token_ids": ids, "prompt_token_ids": None})
        out = self._envelope(out_choices)
        if self.continuous_usage:
            out["usage"] = self._usage(final=False)
        return out

    def closing(self) -> bytes:
        """What ends the client's stream once the generation is over: the usage
        it asked for, if no upstream sent it before it went, and [DONE]."""
        if self.wants_usage and not self.usage_sent:
            self.usage_sent = True
            return self._usage_event() + sse.DONE
        return sse.DONE

    def _usage_event(self) -> bytes:
        out = self._envelope([])
        out["usage"] = self._usage(final=True)
        return sse.event(out)

    def _usage(self, final: bool) -> dict[str, Any]:
        counts = usage(len(self.prompt_ids or ()), len(self.generated))
        # vLLM's last usage has its chunks' fields: the source's chunks, if it
        # sent none of its own before the cut, say what they are.
        extras = self._usage_extras.get(final, self._usage_extras.get(False, {}))
        return {**counts, **extras}

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


# Where vLLM's reasoning parsers put a chat stream's thoughts (the name changed
# across versions).
_REASONING = ("reasoning_content", "reasoning")


def _greedy(body: dict[str, Any]) -> bool:
    """Whether the engine decodes greedily; without a temperature it samples
    (vLLM's default is 1.0, or the model's generation config)."""
    temperature, top_k = body.get("temperature"), body.get("top_k")
    number = (int, float)
    return (isinstance(temperature, number) and not isinstance(temperature, bool) and
            temperature == 0) or (isinstance(top_k, int) and not isinstance(top_k, bool) and
            top_k == 1)  # fmt: skip


def _ids(value: Any) -> list[int] | None:
    """`value` if it is a list of token ids, else None."""
    if isinstance(value, list) and all(type(i) is int for i in value):
        return value
    return None


def _is_role_chunk(choices: list[dict[str, Any]]) -> bool:
    return bool(choices) and all(
        isinstance(c.get("delta"), dict) and "role" in c["delta"] and not c["delta"].get("content")
        for c in choices
    )

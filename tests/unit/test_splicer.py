"""The pure splicer: a moved stream gives exactly the unmoved run's ids and text.

The engine here is a model of vLLM 0.32's streaming detokenizer, close enough to
break things the way vLLM does: a byte-level tokenizer whose tokens split
multi-byte characters, a decode stream primed with the prompt that holds text
back while a character is incomplete (and, when the prompt itself ends inside a
character, emits the whole prompt's text with the character's last piece, as
tokenizers' `DecodeStream(ids=...)` does), and stop strings checked on the new
text with the last len(stop) - 1 characters held back.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.splicer import MAX_BACKOFF, Join, Splicer, only_ids, plan_join

REPLACEMENT = "\ufffd"


class Vocab:
    """Token id -> bytes; ids are allocated as pieces are first seen."""

    def __init__(self) -> None:
        self.pieces: list[bytes] = []
        self.ids: dict[bytes, int] = {}

    def id(self, piece: bytes) -> int:
        if piece not in self.ids:
            self.ids[piece] = len(self.pieces)
            self.pieces.append(piece)
        return self.ids[piece]

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.pieces[i] for i in ids).decode("utf-8", errors="replace")


class DecodeStream:
    """tokenizers' DecodeStream primed with `prompt`, as vLLM uses it."""

    def __init__(self, vocab: Vocab, prompt: list[int]) -> None:
        self.vocab, self.ids = vocab, list(prompt)
        text = vocab.decode(prompt)
        # A prompt that ends inside a character leaves no clean prefix: the first
        # text out is then the whole of it (what breaks a naive join).
        self.prefix = "" if text.endswith(REPLACEMENT) else text

    def step(self, token: int) -> str:
        self.ids.append(token)
        text = self.vocab.decode(self.ids)
        if len(text) > len(self.prefix) and not text.endswith(REPLACEMENT):
            new, self.prefix = text[len(self.prefix) :], text
            return new
        return ""


def engine(
    vocab: Vocab,
    prompt: list[int],
    tokens: list[int],
    stops: list[str],
    include_stop: bool,
    *,
    chat: bool = False,
    first: bool = True,
) -> list[bytes]:
    """vLLM's stream for a request that generates `tokens` (then hits max_tokens)."""
    stream = DecodeStream(vocab, prompt)
    out, sent, events = "", 0, []
    hold = 0 if include_stop else max((len(s) for s in stops), default=1) - 1
    for n, token in enumerate(tokens):
        before = len(out)
        out += stream.step(token)
        finish = None
        best = None
        for stop in stops:
            at = out.find(stop, max(0, len(out) - (len(out) - before) - len(stop) + 1))
            if len(out) > before and at != -1 and (best is None or at + len(stop) < best[0]):
                best = (at + len(stop), stop, at)
        if best is not None:
            out = out[: best[0] if include_stop else best[2]]
            finish = "stop"
        elif n == len(tokens) - 1:
            finish = "length"
        end = len(out) - (0 if finish else hold)
        text = out[sent:end] if end > sent else ""
        sent = max(sent, end)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [token]}
        chunk: dict[str, Any] = {"id": "cmpl-1", "created": 1, "model": "m"}
        if chat:
            chunk["object"] = "chat.completion.chunk"
            choice["delta"] = {"content": text}
        else:
            chunk["object"] = "text_completion"
            choice["text"] = text
            choice["prompt_token_ids"] = prompt if n == 0 and first else None
        chunk["choices"] = [choice]
        events.append(b"data: " + json.dumps(chunk).encode())
        if finish:
            break
    return events + [b"data: [DONE]"]


def coalesce(events: list[bytes], sizes: list[int]) -> list[bytes]:
    """Merge runs of token events, as vLLM does for a client that reads slowly."""
    out, at, n = [], 0, 0
    body = events[:-1]  # [DONE] stays last
    while at < len(body):
        size = max(1, sizes[n % len(sizes)]) if sizes else 1
        group = [json.loads(e[6:]) for e in body[at : at + size]]
        first = group[0]
        for later in group[1:]:
            a, b = first["choices"][0], later["choices"][0]
            a["token_ids"] = a["token_ids"] + b["token_ids"]
            key = "delta" if "delta" in a else "text"
            if key == "delta":
                a["delta"]["content"] += b["delta"]["content"]
            else:
                a["text"] += b["text"]
            a["finish_reason"] = b["finish_reason"]
        out.append(b"data: " + json.dumps(first).encode())
        at, n = at + size, n + 1
    return out + events[-1:]


def client_view(data: bytes) -> tuple[str, list[int], str | None]:
    text, ids, finish = "", [], None
    for event in data.split(b"\n\n"):
        if not event.startswith(b"data: {"):
            continue
        for choice in json.loads(event[6:])["choices"]:
            delta = choice.get("delta")
            text += (delta.get("content") if delta else choice.get("text")) or ""
            ids += choice.get("token_ids") or []
            finish = choice.get("finish_reason") or finish
    return text, ids, finish


def moved(
    vocab: Vocab,
    prompt: list[int],
    tokens: list[int],
    stops: list[str],
    include_stop: bool,
    cut: int,
    chat: bool,
    sizes: list[int],
) -> bytes:
    """The client's bytes when the stream moves after `cut` source events (of
    `sizes` tokens each, cyclically)."""
    body = {"stop": stops, "include_stop_str_in_output": include_stop}
    splicer = Splicer(body, "chat" if chat else "completions", wants_ids=True)
    source = coalesce(engine(vocab, prompt, tokens, stops, include_stop, chat=chat), sizes)
    out = b""
    for event in source[:cut]:
        out += splicer.feed(event).data
    if splicer.ended:  # nothing left to move: the source ends the stream
        return out + b"".join(splicer.feed(event).data for event in source[cut:])
    if chat:
        splicer.prompt_ids = prompt  # chat reports them at the top level, role chunk first
    join, near = splicer.join_point()
    if not near:
        generated = splicer.generated
        texts = [vocab.decode(generated[: len(generated) - b]) for b in range(MAX_BACKOFF + 1)]
        texts = texts[: len(generated) - join.keep + 1]
        found = plan_join(generated, splicer.sent, list(texts), splicer.hold, splicer.lookback)
        join = found or join
    splicer.join(join)
    rest = tokens[join.keep :]
    events = engine(vocab, prompt + tokens[: join.keep], rest, stops, include_stop)
    for event in coalesce(events, sizes):
        fed = splicer.feed(event)
        out += fed.data
        if fed.finished:
            break
    return out


# Text that tokenizes into pieces splitting multi-byte characters.
_STOPS = ["!", "世界", "a b", "🙂.", "本語!"]
_CHARS = st.sampled_from(
    list("ab .,!\n") + list("你好世界日本語") + ["🙂", "🚀", "é", "ß"] + _STOPS
)


@st.composite
def generation(draw: Any) -> tuple[Any, ...]:
    chars = draw(st.lists(_CHARS | st.just("<lone byte>"), min_size=1, max_size=40))
    # A model can emit bytes that never form a character: vLLM shows them as U+FFFD.
    data = b"".join(b"\x80" if c == "<lone byte>" else c.encode() for c in chars)
    vocab = Vocab()
    tokens, at = [], 0
    while at < len(data):
        size = draw(st.integers(1, 3))
        tokens.append(vocab.id(data[at : at + size]))
        at += size
    prompt = [vocab.id(b"Q:"), vocab.id(b" ")]
    stops = draw(st.lists(st.sampled_from(_STOPS), max_size=2))
    cut = draw(st.integers(1, len(tokens)))
    sizes = draw(st.lists(st.integers(1, 4), max_size=3))  # tokens per source chunk
    return vocab, prompt, tokens, stops, draw(st.booleans()), cut, draw(st.booleans()), sizes


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(generation())
def test_a_moved_stream_is_the_unmoved_stream(case: tuple[Any, ...]) -> None:
    vocab, prompt, tokens, stops, include_stop, cut, chat, sizes = case
    splicer = Splicer({"stop": stops}, "chat" if chat else "completions", wants_ids=True)
    unmoved = b"".join(
        splicer.feed(e).data for e in engine(vocab, prompt, tokens, stops, include_stop, chat=chat)
    )
    expected = client_view(unmoved)
    after = moved(vocab, prompt, tokens, stops, include_stop, cut, chat, sizes)
    assert client_view(after) == expected


def test_the_join_steps_back_to_a_whole_character_before_any_stop_string() -> None:
    vocab = Vocab()
    data = "ab好cd".encode()  # 好 is three bytes
    tokens = [vocab.id(data[i : i + 1]) for i in range(len(data))]
    splicer = Splicer({}, "completions", wants_ids=True)
    for event in engine(vocab, [vocab.id(b"Q")], tokens, [], False)[:4]:  # a b, 2 of 好
        splicer.feed(event)
    assert splicer.sent == "ab"
    assert splicer.join_point() == (Join(keep=2, skip=0), True)
    # With a stop string of three characters, vLLM holds back two: the join goes
    # back two more characters, and the destination's first two are the client's.
    splicer = Splicer({"stop": ["xyz"]}, "completions", wants_ids=True)
    for event in engine(vocab, [vocab.id(b"Q")], tokens, ["xyz"], False):
        splicer.feed(event)
        if len(splicer.generated) == 6:
            break
    assert splicer.sent == "ab"  # 好c held back
    assert splicer.join_point() == (Join(keep=0, skip=2), True)


def test_plan_join_from_detokenize() -> None:
    texts = ["a" + REPLACEMENT, "a" + REPLACEMENT, "a", "a"]
    assert plan_join([1, 2, 3], "a", texts, hold=0, lookback=0) == Join(keep=1, skip=0)
    # A stop string of 3 characters: two are held back; step back past them.
    assert plan_join([1, 2, 3], "abcd", ["abcdef", "abcde", "abcd"], 2, 2) == Join(1, 0)
    # Special tokens the stream skipped but /detokenize shows: without stop
    # strings only the end matters; with them, no usable point.
    assert plan_join([4, 5], "ab", ["<|x|>ab", "<|x|>a"], hold=0, lookback=0) == Join(2, 0)
    assert plan_join([4, 5], "ab", ["<|x|>ab", "<|x|>a"], hold=1, lookback=1) is None
    assert plan_join([1, 2], "a", [None], hold=2, lookback=2) is None


def test_the_naive_join_is_wrong_in_this_engine_model() -> None:
    """The model above breaks a join inside a character the way vLLM does (so the
    property test would catch a splicer that joined there)."""
    vocab = Vocab()
    data = "好".encode()
    prompt = [vocab.id(b"Q")]
    tokens = [vocab.id(data[:1]), vocab.id(data[1:])]
    events = engine(vocab, prompt + tokens[:1], tokens[1:], [], False)
    assert client_view(b"\n\n".join(events))[0] == "Q好"


def test_continuation_chunks_take_the_clients_identity_and_shape() -> None:
    splicer = Splicer({"stream_options": {"include_usage": True}}, "chat", wants_ids=False)
    role = {"id": "chatcmpl-1", "created": 123, "model": "m", "system_fingerprint": "fp"}
    role["prompt_token_ids"] = [1, 2, 3]
    role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    assert splicer.feed(b"data: " + json.dumps(role).encode()).prompt_tokens == 3
    splicer.join(Join(keep=0, skip=0))
    chunk = {"id": "cmpl-9", "created": 9, "model": "m", "object": "text_completion"}
    chunk["choices"] = [{"index": 0, "text": " there", "token_ids": [5], "finish_reason": None}]
    fed = splicer.feed(b"data: " + json.dumps(chunk).encode())
    out = json.loads(fed.data[6:])
    assert fed.tokens == 1
    assert (out["id"], out["created"], out["object"]) == (
        "chatcmpl-1",
        123,
        "chat.completion.chunk",
    )
    assert out["system_fingerprint"] == "fp"
    assert out["choices"][0]["delta"] == {"content": " there"}
    assert out["choices"][0]["token_ids"] is None
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":4,"completion_tokens":1}}'
    total = json.loads(splicer.feed(usage).data[6:])["usage"]
    assert total == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_a_continued_chats_token_without_text_is_a_chunk_as_vllm_sends_it() -> None:
    """vLLM's chat (no tool or reasoning parser) sends a token that makes no
    text, half of a character, as `"content": ""`, asked for ids or not: a
    moved stream does too (leaving them out lost the per-token chunks, and
    their usage steps, after every move)."""
    splicer = Splicer({}, "chat", wants_ids=False)
    role = {"id": "chatcmpl-1", "created": 1, "model": "m", "prompt_token_ids": [1, 2]}
    role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    splicer.feed(b"data: " + json.dumps(role).encode())
    splicer.join(Join(keep=0, skip=0))
    half = {"id": "c", "choices": [{"index": 0, "text": "", "token_ids": [230]}]}
    fed = splicer.feed(b"data: " + json.dumps(half).encode())
    assert fed.tokens == 1 and json.loads(fed.data[6:])["choices"][0]["delta"] == {"content": ""}


@pytest.mark.parametrize("text", [5, None, ["x"], {"t": 1}])
def test_a_continuations_text_that_is_no_string_is_no_text(text: Any) -> None:
    splicer = Splicer({}, "completions", wants_ids=False)
    first = {"id": "c", "created": 1, "model": "m", "prompt_token_ids": [1, 2]}
    first["choices"] = [{"index": 0, "text": " a", "token_ids": [4]}]
    splicer.feed(b"data: " + json.dumps(first).encode())
    splicer.join(Join(keep=1, skip=0))
    chunk = {"id": "d", "choices": [{"index": 0, "text": text, "token_ids": [5]}]}
    fed = splicer.feed(b"data: " + json.dumps(chunk).encode())
    assert fed.tokens == 1 and json.loads(fed.data[6:])["choices"][0]["text"] == ""
    assert splicer.sent == " a" and splicer.generated == [4, 5]


def test_a_continued_chats_usage_keeps_the_shape_the_source_gave_it() -> None:
    """vLLM's chat puts `completion_tokens_details` in each chunk's usage
    (`continuous_usage_stats`), and its continuation, a completion, does not:
    the client's usage has the source's fields, with the stream's own counts."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    splicer = Splicer({"stream_options": options}, "chat", wants_ids=False)
    shape = {"completion_tokens_details": None}
    role: dict[str, Any] = {"id": "chatcmpl-1", "created": 1, "model": "m", "prompt_token_ids": [1]}
    role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    role["usage"] = {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0, **shape}
    splicer.feed(b"data: " + json.dumps(role).encode())
    splicer.join(Join(keep=0, skip=0))
    chunk: dict[str, Any] = {"id": "cmpl-9", "created": 9, "model": "m"}
    chunk["choices"] = [{"index": 0, "text": " a", "token_ids": [5]}]
    chunk["usage"] = {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}
    out = json.loads(splicer.feed(b"data: " + json.dumps(chunk).encode()).data[6:])
    assert out["usage"] == {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, **shape}
    final = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    last = b'data: {"id":"cmpl-9","choices":[],"usage":' + json.dumps(final).encode() + b"}"
    # The source sent none of its own: vLLM gives the last one its chunks' fields.
    assert json.loads(splicer.feed(last).data[6:])["usage"] == {**final, **shape}


def test_a_continued_chat_says_its_stop_reason_and_fingerprint_with_its_finish() -> None:
    """As vLLM's chat stream: `stop_reason` only on the chunk that finishes, and
    the fingerprint the engine sends with its last chunk."""
    splicer = Splicer({}, "chat", wants_ids=False)
    role = {"id": "chatcmpl-1", "created": 1, "model": "m", "prompt_token_ids": [1]}
    role["choices"] = [{"index": 0, "delta": {"role": "assistant", "content": ""}}]
    splicer.feed(b"data: " + json.dumps(role).encode())
    splicer.join(Join(keep=0, skip=0))
    chunk: dict[str, Any] = {"id": "cmpl-9", "created": 9, "model": "m"}
    chunk["choices"] = [{"index": 0, "text": " a", "token_ids": [5], "stop_reason": None}]
    first = json.loads(splicer.feed(b"data: " + json.dumps(chunk).encode()).data[6:])
    assert "stop_reason" not in first["choices"][0] and "system_fingerprint" not in first
    chunk["system_fingerprint"] = "fp-9"
    chunk["choices"] = [
        {"index": 0, "text": " b", "token_ids": [6], "finish_reason": "stop", "stop_reason": 2}
    ]
    last = json.loads(splicer.feed(b"data: " + json.dumps(chunk).encode()).data[6:])
    assert last["choices"][0]["stop_reason"] == 2 and last["system_fingerprint"] == "fp-9"


def test_a_start_over_does_not_repeat_the_role_chunk() -> None:
    splicer = Splicer({}, "chat", wants_ids=False)
    role = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'
    assert splicer.feed(role).data
    splicer.restart()
    assert splicer.feed(role).data == b""


def test_a_stream_that_showed_nothing_yet_starts_over() -> None:
    """A reasoning model's `<think>` comes as a chunk with ids and no text, the
    turn before its thoughts show that it reasons: continued as a completion,
    the rest of its thoughts would be answer text. Until the client has some of
    the answer, a move sends the original request again, and counts afresh."""

    def chunk(content: str, ids: list[int]) -> bytes:
        choice = {"index": 0, "delta": {"content": content}, "token_ids": ids}
        return (
            b"data: "
            + json.dumps({"id": "c", "prompt_token_ids": [1], "choices": [choice]}).encode()
        )

    splicer = Splicer({}, "chat", wants_ids=False)
    assert splicer.starts_over()  # nothing yet
    splicer.feed(chunk("", [151667]))  # <think>
    assert splicer.starts_over() and splicer.generated == [151667]
    splicer.restart()
    first = splicer.feed(chunk("", [151667]))  # the new call's: billed where it runs now
    assert splicer.generated == [151667] and (first.tokens, first.prompt_tokens) == (1, 1)
    again = json.loads(chunk("Hi", [5])[6:])
    again.update(id="d", created=9)  # the destination's
    fed = splicer.feed(b"data: " + json.dumps(again).encode())
    assert fed.tokens == 1
    out = json.loads(fed.data[6:])  # one stream, one id; ids only where asked for
    assert (out["id"], out["created"], out["prompt_token_ids"]) == ("c", 0, None)
    assert out["choices"][0]["token_ids"] is None and out["choices"][0]["delta"]["content"] == "Hi"
    assert not splicer.starts_over() and splicer.generated == [151667, 5]
    asked = Splicer({}, "chat", wants_ids=True)  # the client has the ids already
    asked.feed(chunk("", [151667]))
    assert not asked.starts_over()
    counted = Splicer(
        {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        "chat",
        wants_ids=False,
    )
    with_usage = json.loads(chunk("", [151667])[6:])
    with_usage["usage"] = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    counted.feed(b"data: " + json.dumps(with_usage).encode())  # and a usage count with it
    assert not counted.starts_over()


def test_a_chat_chunk_there_only_for_ids_is_left_out() -> None:
    """vLLM's chat sends a token that makes no text (a special token, half a
    character, text held back) as `"delta": {}` only because Ferry asks for
    ids: a client that did not ask got hundreds of empty chunks (1.6x the
    bytes of a sampled chat). Its tokens still count; with usage on every
    chunk, the client saw no count of them either, so a move starts over."""
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    empty = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None, "token_ids": [9]}
    event = {"id": "c", "prompt_token_ids": [1], "choices": [empty], "usage": usage}
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    splicer = Splicer(options, "chat", wants_ids=False)
    fed = splicer.feed(b"data: " + json.dumps(event).encode())
    assert fed.data == b"" and fed.tokens == 1 and splicer.generated == [9]
    assert splicer.starts_over()
    asked = Splicer(options, "chat", wants_ids=True)
    assert b'"token_ids": [9]' in asked.feed(b"data: " + json.dumps(event).encode()).data
    with_logprobs = {**event, "choices": [{**empty, "logprobs": {"content": []}}]}
    assert splicer.feed(b"data: " + json.dumps(with_logprobs).encode()).data
    assert not only_ids([empty, None])  # (what an engine should not send is no chunk of ids)


def test_a_full_mode_stop_is_not_relayed() -> None:
    splicer = Splicer({}, "completions", wants_ids=False)
    splicer.expect_source_stop = True
    abort = b'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"abort"}]}'
    fed = splicer.feed(abort)
    assert fed.stopped_by_source and fed.data == b""


def test_an_engine_abort_is_a_break_not_the_end() -> None:
    # vLLM aborts every stream as it shuts down or pauses: that stream goes on
    # elsewhere, so the client must not see the abort, nor the stream end.
    splicer = Splicer({}, "completions", wants_ids=True)
    token = b'data: {"id":"c","choices":[{"index":0,"text":"a","token_ids":[5],'
    splicer.feed(token + b'"prompt_token_ids":[1,2]}]}')
    abort = b'data: {"id":"c","choices":[{"index":0,"text":"","finish_reason":"abort"}]}'
    fed = splicer.feed(abort)
    assert fed.broken and not fed.stopped_by_source and fed.data == b""
    assert not splicer.ended and not splicer.finished
    assert (splicer.prompt_ids, splicer.generated) == ([1, 2], [5])


# What vLLM 0.32's API server sends each stream when its engine core dies.
ENGINE_DEAD = (
    b'data: {"error": {"message": "EngineCore encountered an issue. See stack trace'
    b' (above) for the root cause.", "type": "InternalServerError", "param": null,'
    b' "code": 500}}'
)


# "\u00b2" ("²") is digits to str.isdigit, and int() refuses it: it crashed the relay.
@pytest.mark.parametrize("code", [b"500", b'"503"', b"null", b'"\\u00b2"'])
def test_a_server_error_mid_stream_is_a_break(code: bytes) -> None:
    splicer = Splicer({}, "completions", wants_ids=True)
    fed = splicer.feed(ENGINE_DEAD.replace(b'"code": 500', b'"code": ' + code))
    assert fed.broken and fed.data == b"" and not splicer.finished


def test_a_client_error_mid_stream_is_the_end() -> None:
    splicer = Splicer({}, "completions", wants_ids=True)
    bad = b'data: {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}'
    fed = splicer.feed(bad)
    assert fed.finished and not fed.broken and fed.data == bad + b"\n\n" + b"data: [DONE]\n\n"


@pytest.mark.parametrize("cut", range(1, 7))
@pytest.mark.parametrize("include_stop", [False, True])
def test_a_stop_string_across_the_join_ends_the_stream_where_it_would_have(
    cut: int, include_stop: bool
) -> None:
    vocab = Vocab()
    prompt = [vocab.id(b"Q")]
    tokens = [vocab.id(c.encode()) for c in "ab世界cdef"]
    stops = ["世界", "xyzw"]
    splicer = Splicer({"stop": stops}, "completions", wants_ids=True)
    unmoved = b"".join(
        splicer.feed(e).data for e in engine(vocab, prompt, tokens, stops, include_stop)
    )
    want = ("ab世界" if include_stop else "ab", [1, 2, 3, 4], "stop")
    assert client_view(unmoved) == want
    assert client_view(moved(vocab, prompt, tokens, stops, include_stop, cut, False, [])) == want


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_a_stream_that_reasons_cannot_go_on_elsewhere(field: str) -> None:
    """A continuation is a completion: it would give the rest of a reasoning
    model's thoughts as answer text. A stream that only answers can move."""
    answering = Splicer({}, "chat", wants_ids=False)
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [4]}]}
    answering.feed(b"data: " + json.dumps(chunk).encode())
    assert answering.unmovable is None
    reasoning = Splicer({}, "chat", wants_ids=False)
    chunk["choices"][0]["delta"] = {field: "Let me think", "content": None}
    reasoning.feed(b"data: " + json.dumps(chunk).encode())
    assert reasoning.unmovable == "reasoning"


def test_text_whose_ids_the_engine_kept_back_pins_the_stream() -> None:
    """vLLM hides a chat's token ids when a reasoning parser runs with
    `include_reasoning: false`: the text the client has would then be missing
    from G, and a continuation would repeat it. Chunks without text (the role's,
    the finish's) need no ids."""
    splicer = Splicer({}, "chat", wants_ids=False)
    role = {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    splicer.feed(b"data: " + json.dumps(role).encode())
    assert splicer.unmovable is None
    for hidden in ({"token_ids": None}, {}):
        hiding = Splicer({}, "chat", wants_ids=False)
        chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hi"}, **hidden}]}
        assert json.loads(hiding.feed(b"data: " + json.dumps(chunk).encode()).data[6:])
        assert hiding.unmovable == "text without token ids"


def test_a_stream_over_ends_with_the_usage_no_upstream_sent() -> None:
    splicer = Splicer({"stream_options": {"include_usage": True}}, "completions", wants_ids=False)
    first = {"id": "cmpl-1", "created": 1, "model": "m"}
    first["choices"] = [
        {
            "index": 0,
            "text": "a",
            "token_ids": [5],
            "prompt_token_ids": [1, 2],
            "finish_reason": "length",
        }
    ]
    splicer.feed(b"data: " + json.dumps(first).encode())
    closing = splicer.closing()
    assert closing.endswith(b"data: [DONE]\n\n")
    usage = json.loads(closing.split(b"\n\n")[0][6:])["usage"]
    assert usage == {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    assert splicer.closing() == b"data: [DONE]\n\n"  # once
    sent = Splicer({"stream_options": {"include_usage": True}}, "completions", wants_ids=False)
    sent.feed(b"data: " + json.dumps(first).encode())
    sent.feed(b'data: {"id":"cmpl-1","choices":[],"usage":{"prompt_tokens":2}}')
    assert sent.closing() == b"data: [DONE]\n\n"
    assert Splicer({}, "completions", wants_ids=False).closing() == b"data: [DONE]\n\n"


def test_a_stream_whose_server_sends_no_id_can_still_go_on_elsewhere() -> None:
    splicer = Splicer({}, "completions", wants_ids=False)
    first = b'data: {"prompt_token_ids":[1,2],"choices":[{"index":0,"text":"a","token_ids":[5]}]}'
    assert splicer.feed(first).tokens == 1
    splicer.join(Join(keep=1, skip=0))  # raised AssertionError: no origin
    chunk = b'data: {"id":"cmpl-9","choices":[{"index":0,"text":"b","token_ids":[6]}]}'
    out = json.loads(splicer.feed(chunk).data[6:])
    assert out["id"] == "" and out["choices"][0]["text"] == "b"


@pytest.mark.parametrize("ids", ["abc", 7, [1, "2"], [1.0], [None], {"0": 1}, [True]], ids=repr)
def test_token_ids_that_are_not_integers_pin_the_stream_and_the_text_goes_on(ids: Any) -> None:
    """An engine that says it is vLLM but sends ids of another type (it raised
    TypeError, cutting the client's stream): the text still reaches the client,
    and the stream stays where it is, since a continuation needs exact ids."""
    splicer = Splicer({}, "completions", wants_ids=True)
    first = {"id": "c", "prompt_token_ids": [1, 2], "choices": [{"index": 0, "text": "a"}]}
    first["choices"][0]["token_ids"] = ids
    fed = splicer.feed(b"data: " + json.dumps(first).encode())
    assert json.loads(fed.data[6:])["choices"][0]["text"] == "a"
    assert fed.tokens == 0 and splicer.generated == []
    assert splicer.unmovable == "token ids that are not integers"
    bad_prompt = Splicer({}, "completions", wants_ids=True)
    chunk = {"id": "c", "prompt_token_ids": ["x"], "choices": [{"index": 0, "text": "a"}]}
    assert bad_prompt.feed(b"data: " + json.dumps(chunk).encode()).prompt_tokens is None
    assert bad_prompt.prompt_ids is None
    assert bad_prompt.unmovable == "token ids that are not integers"


def test_a_start_over_leaves_out_the_textless_chunks_the_client_has() -> None:
    """A completion whose first tokens made no text (the client got a chunk of
    `"text": ""` for each) starts over: the new call's first such chunks are
    the client's already (a client counting chunks as tokens got them twice).
    Its tokens still count; its first text goes on at once."""

    def chunk(text: str, token: int, finish: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "token_ids": [token], "finish_reason": finish}
        body = {"id": "c", "prompt_token_ids": [1], "choices": [choice]}
        return b"data: " + json.dumps(body).encode()

    splicer = Splicer({}, "completions", wants_ids=False)
    sent = [splicer.feed(chunk("", t)) for t in (7, 8, 9)]
    assert all(f.data for f in sent) and splicer.starts_over()
    splicer.restart()
    again = [splicer.feed(chunk("", t)) for t in (7, 8)]
    assert [f.data for f in again] == [b"", b""] and [f.tokens for f in again] == [1, 1]
    splicer.restart()  # again, before its first text: the client still has three
    again = [splicer.feed(chunk("", t)) for t in (7, 8, 9)]
    assert [f.data for f in again] == [b"", b"", b""]
    text = splicer.feed(chunk("Hi", 5))  # sampled, text may come sooner: it goes on
    assert json.loads(text.data[6:])["choices"][0]["text"] == "Hi"
    after = splicer.feed(chunk("", 6))  # past the start-over's first ones: the client's
    assert after.data and splicer.generated == [7, 8, 9, 5, 6]
    last = splicer.feed(chunk("", 10, "length"))
    assert json.loads(last.data[6:])["choices"][0]["finish_reason"] == "length"


def usages(sent: bytes) -> list[Any]:
    """The usage counts among the client's events."""
    events = [json.loads(e[6:]) for e in sent.split(b"\n\n") if e.startswith(b"data: {")]
    return [e["usage"] for e in events if e.get("usage")]


@pytest.mark.parametrize("choices", ["last", "null"])
def test_a_usage_sent_as_other_servers_send_it_is_counted_once_across_a_move(choices: str) -> None:
    """With the last choice's finish, or with `"choices": null`, not in a chunk of
    its own: the source's went out and `closing` added a second; a
    continuation's was dropped with the chunk it came on."""
    asked = {"stream_options": {"include_usage": True}}
    first = {"id": "cmpl-1", "created": 1, "model": "m"}
    first["choices"] = [{"index": 0, "text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]
    last: dict[str, Any] = {
        "id": "cmpl-1",
        "choices": [{"index": 0, "text": "b", "token_ids": [6]}],
    }
    last["choices"][0]["finish_reason"] = "length"
    usage = {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    if choices == "last":
        last["usage"] = usage
    tail = [] if choices == "last" else [{"id": "cmpl-1", "choices": None, "usage": usage}]
    unmoved = Splicer(asked, "completions", wants_ids=False)
    sent = b"".join(
        unmoved.feed(b"data: " + json.dumps(c).encode()).data for c in [first, last, *tail]
    )
    assert usages(sent + unmoved.closing()) == [usage]
    moved = Splicer(asked, "completions", wants_ids=False)
    moved.feed(b"data: " + json.dumps(first).encode())
    moved.join(Join(keep=1, skip=0))
    sent = b"".join(moved.feed(b"data: " + json.dumps(c).encode()).data for c in [last, *tail])
    sent += moved.feed(b"data: [DONE]").data
    assert usages(sent) == [usage]  # P of the original request, G over both segments
    assert sent.endswith(b"data: [DONE]\n\n")


def test_a_continuation_that_sends_no_usage_leaves_the_client_the_one_it_asked_for() -> None:
    splicer = Splicer({"stream_options": {"include_usage": True}}, "completions", wants_ids=False)
    first = b'data: {"id":"c","prompt_token_ids":[1],"choices":[{"text":"a","token_ids":[5]}]}'
    splicer.feed(first)
    splicer.join(Join(keep=1, skip=0))
    splicer.feed(
        b'data: {"id":"d","choices":[{"text":"b","token_ids":[6],"finish_reason":"stop"}]}'
    )
    end = splicer.feed(b"data: [DONE]").data.split(b"\n\n")
    assert json.loads(end[0][6:])["usage"]["total_tokens"] == 3 and end[1] == b"data: [DONE]"

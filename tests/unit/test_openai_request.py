from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import token_ids
from proxy.continuation import not_migratable
from proxy.openai_request import (
    MAX_BRACKETS,
    MAX_DEPTH,
    MULTIPART,
    BadRequest,
    form_model,
    parse,
    parse_passthrough,
    read_object,
)
from proxy.policy import Priority


@pytest.mark.parametrize(
    ("prompt", "tokens"),
    [
        ("abcdefghi", 3),  # English: 3 characters a token
        ("今天天气很好", 6),  # Chinese: a character a token (3 bytes of UTF-8 each)
        ("😀😀😀", 4),  # emoji: 4 bytes each
        ("\ud800\ud800", 2),  # lone surrogates (JSON may carry them): 3 bytes each
    ],
)
def test_a_text_prompt_is_estimated_by_its_bytes(prompt: str, tokens: int) -> None:
    for body in (
        {"model": "m", "prompt": prompt},
        {"model": "m", "messages": [{"role": "user", "content": prompt}]},
    ):
        endpoint = "chat" if "messages" in body else "completions"
        assert parse(json.dumps(body).encode(), endpoint, None).prompt_estimate == tokens


def test_parses_completions_and_chat() -> None:
    req = parse(b'{"model": "m", "prompt": "abcdefghi"}', "completions", None)
    assert (req.model, req.prompt_estimate, req.priority) == ("m", 3, Priority.NORMAL)
    req = parse(b'{"model": "m", "prompt": [1, 2, 3, 4]}', "completions", "high")
    assert (req.prompt_estimate, req.priority) == (4, Priority.HIGH)
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "abcdef"}]}'
    assert parse(chat, "chat", "LOW").priority == Priority.LOW
    # Sent twice, a header reads as its values joined by commas (RFC 9110).
    assert parse(chat, "chat", "high, HIGH").priority == Priority.HIGH


@pytest.mark.parametrize(
    ("raw", "endpoint", "header", "message"),
    [
        (b"", "completions", None, "empty"),
        (b"{nope", "completions", None, "not valid JSON"),
        (b"[1]", "completions", None, "JSON object"),
        (b'{"model": 3, "prompt": "x"}', "completions", None, "'model' must be a string"),
        (b'{"model": "m"}', "completions", None, "'prompt' is required"),
        (b'{"model": "m"}', "chat", None, "'messages' is required"),
        (b'{"model": "m", "prompt": "x", "stream": "maybe"}', "completions", None, "'stream'"),
        (b'{"model": "m", "prompt": "x", "stream": 2}', "completions", None, "'stream'"),
        (b'{"model": "m", "prompt": "x", "echo": []}', "completions", None, "'echo'"),
        (b'{"model": "m", "prompt": "x"}', "completions", "urgent", "x-ferry-priority"),
        (b'{"model": "m", "prompt": "x"}', "completions", "high, low", "not several"),
        (b'{"model": "m", "prompt": "x"}', "completions", "high,", "x-ferry-priority"),
        # A dotless i upper-cases to I: "hıgh" was taken for high.
        (b'{"model": "m", "prompt": "x"}', "completions", "h\u0131gh", "x-ferry-priority"),
    ],
)
def test_bad_requests_are_explained(
    raw: bytes, endpoint: str, header: str | None, message: str
) -> None:
    with pytest.raises(BadRequest, match=message):
        parse(raw, endpoint, header)


def test_token_ids_are_counted_and_hidden() -> None:
    # Shapes captured from vLLM 0.32 with return_token_ids.
    completion = (
        b'{"id":"cmpl-1","choices":[{"index":0,"text":"e","prompt_token_ids":[45,74,81],'
        b'"token_ids":[74]}]}'
    )
    assert token_ids.scan(completion) == (3, 3, 1, True)
    assert token_ids.hide(completion) == (
        b'{"id":"cmpl-1","choices":[{"index":0,"text":"e","prompt_token_ids":null,'
        b'"token_ids":null}]}'
    )
    chat_first = (
        b'{"choices":[{"delta":{"role":"assistant","content":""}}],"prompt_token_ids":[3,4]}'
    )
    assert token_ids.scan(chat_first) == (2, 2, 0, True)
    # Text that merely mentions the key is escaped inside JSON and never matches.
    tricky = b'{"choices":[{"text":"\\"token_ids\\":[1,2]","token_ids":[]}]}'
    assert token_ids.scan(tricky) == (None, 0, 0, True)
    assert token_ids.scan(b'{"choices":[{"text":"hi","token_ids":null}]}') == (None, 0, 0, False)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b'{"a": NaN}', "NaN is not a JSON number"),
        (b'{"a": [Infinity]}', "Infinity is not a JSON number"),
        (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
        (b'{"a": 1e400}', "out of range"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a": {"b": 1, "b": 1}}', "duplicate key 'b'"),
        (b'{"a": "\xff"}', "not UTF-8"),
        (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),  # a surrogate, encoded
        ('{"a": 1}'.encode("utf-16"), "not UTF-8"),
        ('{"a": 1}'.encode("utf-16-le"), "not valid JSON"),  # NULs are UTF-8, not JSON
        ('{"a": 1}'.encode("utf-32"), "not UTF-8"),
        (b"\xef\xbb\xbf\xef\xbb\xbf{}", "not valid JSON"),  # one BOM is ignored, not two
        (b'{"a": ' + b"[" * (MAX_DEPTH) + b"]" * (MAX_DEPTH) + b"}", "nested more than"),
        (b"[" * 100_000, "nested too deeply"),
        # Refused before it is read: reading it would cost seconds and gigabytes.
        (b'{"x": [' + b"{}," * MAX_BRACKETS + b"{}]}", "at most 1,000,000 are read"),
        (b'"{}"', "must be a JSON object"),
        (b"null", "must be a JSON object"),
    ],
)
def test_bodies_are_read_strictly(raw: bytes, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        read_object(raw)


def test_what_strict_reading_accepts() -> None:
    assert read_object(b'\xef\xbb\xbf{"a": 1.5}') == {"a": 1.5}  # RFC 8259 lets a BOM be ignored
    assert read_object(b'{"a": "\\ud800"}') == {"a": "\ud800"}  # an escape is JSON, even alone
    deep = b'{"a": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert read_object(deep)["a"]
    many = b'{"a": [' + b",".join([b"[]"] * 10_000) + b"]}"  # wide, not deep
    assert len(read_object(many)["a"]) == 10_000


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"model": "m", "prompt": "x", "n": "two"}', "n"),
        (b'{"model": "m", "prompt": "x", "n": "2.5"}', "n"),
        (b'{"model": "m", "prompt": "x", "n": "1e400"}', "n"),
        (b'{"model": "m", "prompt": "x", "n": [2]}', "n"),
        (b'{"model": "m", "prompt": "x", "stream_options": true}', "stream_options"),
        (b'{"model": "m", "prompt": "x", "kv_transfer_params": []}', "kv_transfer_params"),
    ],
)
def test_fields_ferry_reads_must_have_their_type(raw: bytes, param: str) -> None:
    with pytest.raises(BadRequest) as caught:
        parse(raw, "completions", None)
    assert caught.value.param == param
    nulls = b'{"model": "m", "prompt": "x", "n": null, "stream_options": null}'
    assert parse(nulls, "completions", None).model == "m"


@pytest.mark.parametrize("value", [1.5, "1.5", "x", [], {}])
def test_a_best_of_vllm_ignores_is_left_to_it(value: object) -> None:
    """vLLM 0.32 has no `best_of` and answers a request with any: Ferry refused
    one that is not a count."""
    body = {"model": "m", "prompt": "x", "best_of": value, "stream": True}
    req = parse(json.dumps(body).encode(), "completions", None)
    assert req.body["best_of"] == value
    assert not_migratable(req.body, "completions") is None


@pytest.mark.parametrize(
    ("value", "count"), [(2, 2), (2.0, 2), ("2", 2), (" 2 ", 2), ("2.0", 2), (True, 1)]
)
def test_counts_are_read_as_vllm_reads_them(value: object, count: int) -> None:
    """vLLM (pydantic, lax) takes `"n": 2.0`, `"2"` or `"2.0"` for 2 and `true`
    for 1: Ferry reads them the same and sends on an integer (it refused them)."""
    body = {"model": "m", "prompt": "x", "n": value, "best_of": value}
    req = parse(json.dumps(body).encode(), "completions", None)
    assert (req.body["n"], req.body["best_of"]) == (count, count)
    assert type(req.body["n"]) is int


@pytest.mark.parametrize(
    ("value", "seed"),
    [
        ("42", 42),
        ("9223372036854775807", 9223372036854775807),  # int64's most: a float's is past it
        ("9007199254740993", 9007199254740993),  # a float's nearest is ...992
        ("1_000", 1000),
        (" -7 ", -7),
        (42.0, 42),
    ],
)
def test_a_seed_is_read_exactly_as_vllm_reads_it(value: object, seed: int) -> None:
    """A seed is moved on at a join (continuation.py): read as a string, it was
    not; read through a float, a long one became another seed, or past int64."""
    body = {"model": "m", "prompt": "x", "seed": value}
    assert parse(json.dumps(body).encode(), "completions", None).body["seed"] == seed


@pytest.mark.parametrize("body", [b'{"prompt": "x"}', b'{"model": "", "prompt": "x"}'])
def test_a_body_may_name_no_model(body: bytes) -> None:
    """vLLM serves its own model to a request that names none (or ""): the
    proxy decides where that is (proxy/server.py `_implied_model`)."""
    assert parse(body, "completions", None).model is None


@pytest.mark.parametrize(
    ("value", "flag"),
    [("true", True), ("False", False), (1, True), (0, False), (1.0, True), ("on", True),
     ("no", False), ("YES", True), (True, True)],
)  # fmt: skip
def test_flags_are_read_as_vllm_reads_them(value: object, flag: bool) -> None:
    """vLLM (pydantic) takes `"stream": "true"` as a stream, and `"false"`, a
    truthy string, as none: Ferry reads each flag it reads the same, and sends
    it on as a boolean (it refused them, or read `"false"` as true)."""
    options = {"include_usage": value, "continuous_usage_stats": value}
    body = {"model": "m", "prompt": "x", "stream": value, "echo": value, "stream_options": options}
    req = parse(json.dumps(body).encode(), "completions", None)
    assert req.body["stream"] is flag and req.body["echo"] is flag
    assert req.body["stream_options"] == {"include_usage": flag, "continuous_usage_stats": flag}
    with pytest.raises(BadRequest) as caught:
        parse(json.dumps({**body, "stream_options": {"include_usage": "x"}}).encode(), "chat", None)
    assert caught.value.param == "messages"
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(BadRequest) as caught:
        parse(json.dumps({**chat, "stream_options": {"include_usage": "x"}}).encode(), "chat", None)
    assert caught.value.param == "stream_options.include_usage"


@pytest.mark.parametrize("value", [" true", "true\n", "\tyes", "on "])
def test_a_flag_with_spaces_is_refused_as_vllm_refuses_it(value: str) -> None:
    """pydantic reads `"true"` but not `" true"` (a 400 from vLLM): read as
    true, Ferry streamed what vLLM refuses."""
    body = {"model": "m", "prompt": "x", "stream": value}
    with pytest.raises(BadRequest) as caught:
        parse(json.dumps(body).encode(), "completions", None)
    assert caught.value.param == "stream"


def test_a_completion_of_prompt_embeds_needs_no_prompt() -> None:
    """vLLM takes `prompt_embeds` in place of `prompt`."""
    req = parse(b'{"model": "m", "prompt_embeds": "AAAA"}', "completions", None)
    assert req.prompt_estimate == 1


@pytest.mark.parametrize(
    ("header", "said"),
    [
        ("text/plain", "not 'text/plain'"),
        ("application/json, text/plain", "not 'application/json, text/plain'"),
        ("", "not none"),
    ],
)
def test_completions_and_chat_take_json_only(header: str, said: str) -> None:
    """A 400 naming the header as sent, as vLLM answers (its message names none)."""
    with pytest.raises(BadRequest, match="Content-Type must be application/json") as caught:
        parse(b'{"model": "m", "prompt": "x"}', "completions", None, header)
    assert caught.value.status == 400
    assert caught.value.message.endswith(said)


@pytest.mark.parametrize("header", ["application/json", "Application/JSON; charset=utf-8"])
def test_json_is_json_in_any_case_and_with_a_charset(header: str) -> None:
    assert parse(b'{"model": "m", "prompt": "x"}', "completions", None, header).model == "m"


def test_a_passed_through_body_is_read_for_its_model_only_when_json() -> None:
    assert parse_passthrough(b'{"model": "m", "stream": true}', "application/json") == (
        parse_passthrough(b'{"stream": true, "model": "m"}', "application/json")
    )
    body = parse_passthrough(b'{"model": "m", "stream": true}', "application/json")
    assert (body.model, body.stream) == ("m", True)
    assert parse_passthrough(b'{"input": "x", "stream": 1}', "application/json").model is None
    assert parse_passthrough(b"", "application/json").model is None
    assert parse_passthrough(b"--x\r\nmodel=m", "multipart/form-data").model is None
    with pytest.raises(BadRequest) as caught:
        parse_passthrough(b'{"model": 5}', "application/json")
    assert caught.value.param == "model"
    with pytest.raises(BadRequest, match="JSON object"):
        parse_passthrough(b'["m"]', "application/json")


def multipart(fields: list[tuple[str, bytes, str | None]], boundary: str) -> bytes:
    """A form as `requests`/httpx write one: (name, value, filename) parts."""
    out = b""
    for name, value, filename in fields:
        disposition = f'form-data; name="{name}"'
        if filename is not None:
            disposition += f'; filename="{filename}"'
        out += f"--{boundary}\r\nContent-Disposition: {disposition}\r\n".encode()
        if filename is not None:
            out += b"Content-Type: application/octet-stream\r\n"
        out += b"\r\n" + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode()


@given(
    audio=st.binary(max_size=300),
    model=st.text(max_size=12).filter(lambda m: "\r" not in m),
    before=st.booleans(),
    cut=st.integers(0, 10_000),
)
def test_a_forms_model_is_found_past_any_file(
    audio: bytes, model: str, before: bool, cut: int
) -> None:
    """The form's `model` field, wherever it is, whatever bytes the file holds
    (a boundary look-alike, CRLFs, a part named "model" in a file name); a cut
    body gives the model or None, never an error."""
    boundary = "b0undary"
    decoy = b'\r\n--b0undar\r\nContent-Disposition: form-data; name="model"\r\n\r\nno\r\n'
    file = ("file", decoy + audio, "model")
    fields = (
        [("model", model.encode(), None), file]
        if before
        else [file, ("model", model.encode(), None)]
    )
    fields.insert(0, ("language", b"en", None))
    raw = multipart(fields, boundary)
    assert form_model(raw, boundary) == model
    assert parse_passthrough(raw, MULTIPART, boundary).model == model
    assert form_model(raw[:cut], boundary) in (model, None)
    assert form_model(raw, "other") is None
    assert parse_passthrough(raw, MULTIPART, None).model is None  # no boundary: any instance


@pytest.mark.parametrize(("value", "stream"), [(b"true", True), (b"false", False), (None, False)])
def test_a_streamed_upload_is_a_stream(value: bytes | None, stream: bool) -> None:
    """A transcription's `stream` is a form field: a streamed one gets a
    stream's idle timeout, not a whole answer's."""
    fields: list[tuple[str, bytes, str | None]] = [
        ("file", b"RIFF", "a.wav"),
        ("model", b"m", None),
    ]
    if value is not None:
        fields.append(("stream", value, None))
    passed = parse_passthrough(multipart(fields, "B"), MULTIPART, "B")
    assert (passed.model, passed.stream) == ("m", stream)


def test_a_forms_model_is_read_as_starlette_reads_it() -> None:
    """A quoted file name may hold `; name=model`; names are case-sensitive,
    spaces may surround `=`, and of two `model` fields the last counts."""

    def part(disposition: bytes, value: bytes) -> bytes:
        return (
            b"--B\r\nContent-Disposition: form-data; " + disposition + b"\r\n\r\n" + value + b"\r\n"
        )

    trick = part(b'filename="x; name=model"; name="file"', b"audio") + part(b'name="model"', b"m1")
    assert form_model(trick + b"--B--\r\n", "B") == "m1"
    assert form_model(part(b'name = "model"', b"m2") + b"--B--\r\n", "B") == "m2"
    assert form_model(part(b"name=model", b"m3") + b"--B--\r\n", "B") == "m3"
    assert form_model(part(b'name="MODEL"', b"m4") + b"--B--\r\n", "B") is None
    both = part(b'name="model"', b"first") + part(b'name="model"', b"last") + b"--B--\r\n"
    assert form_model(both, "B") == "last"
    assert form_model(part(b'name="a\\"b"', b"x") + b"--B--\r\n", "B") is None

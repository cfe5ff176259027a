"""Bodies of any shape, size and encoding, posted through Ferry to two stand-in
servers (loadtest/standin_server.py, not vLLM). Ferry never answers with a 5xx:
what it refuses itself gets a 4xx in the OpenAI error shape, and what it
forwards comes back with the status the stand-in gave."""

from __future__ import annotations

import codecs
import gzip
import json
import logging
import socket
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.helpers import wait_until

MODELS = ("alpha", "beta")
PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/embeddings",
    "/v1/responses",
    "/tokenize",
    "/detokenize",
    "/rerank",
    "/v2/embed",
    "/v1/not-a-route",  # passed through; the stand-in's own 404
)
CONTENT_TYPES = (
    "application/json",
    "application/json; charset=utf-8",
    "Application/JSON",
    "application/json; charset=utf-16",
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    None,
)
ENCODINGS = ("utf-8", "utf-8-sig", "utf-16", "utf-16-be", "utf-32")
MAX_BODY = 16 * 1024  # server.max_body_bytes here, so "huge" is cheap

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats()  # NaN and Infinity included: json.dumps writes them, JSON has none
    | st.text(max_size=12)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
# Token budgets stay small so that a forwarded request is answered at once.
budgets = st.integers(1, 4) | st.integers(1, 4) | st.integers(-1, 0) | st.text(max_size=3)
objects = st.fixed_dictionaries(
    {"model": st.sampled_from(MODELS) | st.sampled_from(MODELS) | values},
    optional={
        "prompt": st.text(max_size=20) | st.lists(st.integers(0, 99), max_size=6) | values,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=12)}),
            max_size=2,
        )
        | values,
        "input": st.text(max_size=20) | values,
        "tokens": st.lists(st.integers(0, 9), max_size=4) | values,
        "stream": st.booleans() | values,
        "max_tokens": budgets,
        "max_output_tokens": budgets,
        "n": st.integers(0, 2) | values,
        "stream_options": st.just({"include_usage": True}) | values,
        "extra": values,
    },
)


@st.composite
def bodies(draw: Any) -> bytes:
    """A body as bytes: JSON objects and other values in several encodings,
    with duplicate keys, truncated, nested deep, huge, or no JSON at all."""
    shape = draw(st.sampled_from(["object"] * 6 + ["value", "bytes", "deep", "huge"]))
    if shape == "bytes":
        return bytes(draw(st.binary(max_size=40)))
    if shape == "value":
        text = json.dumps(draw(values))
    elif shape == "deep":
        depth = draw(st.integers(1, 3000))
        opening, closing = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        nested = opening * depth + "1" + closing * depth
        text = '{"model": "alpha", "prompt": "x", "extra": ' + nested + "}"
    elif shape == "huge":
        size = draw(st.integers(MAX_BODY - 100, 4 * MAX_BODY))
        text = json.dumps({"model": "alpha", "prompt": "x", "input": "x", "pad": "a" * size})
    else:
        text = json.dumps(draw(objects))
        if draw(st.booleans()) and draw(st.booleans()):
            text = '{"model": "beta", ' + text[1:]  # a duplicate key (or a stray comma)
    raw = text.encode(draw(st.just("utf-8") | st.sampled_from(ENCODINGS)), errors="surrogatepass")
    if draw(st.integers(0, 9)) == 0:
        raw = raw[: draw(st.integers(0, len(raw)))]
    if draw(st.integers(0, 9)) == 0:
        cut = draw(st.integers(0, len(raw)))
        raw = (
            raw[:cut]
            + draw(st.sampled_from([b"\xff", b"\xc3", b"\x00", b"\xed\xa0\x80"]))
            + raw[cut:]
        )
    return raw


def test_no_body_gets_a_5xx_and_every_refusal_is_in_the_openai_shape(
    standins: Any, ferry: Any
) -> None:
    alpha, beta = standins(1, model="alpha", itl_s=0)[0], standins(1, model="beta", itl_s=0)[0]
    # Lite migration: the odd body also meets the code that decides whether a stream can move.
    proxy = ferry(
        [alpha[1].url, beta[1].url],
        instances_migration="lite",
        server={"max_body_bytes": MAX_BODY},
    )
    stand_ins = (alpha[0], beta[0])

    with httpx.Client(base_url=proxy.url, timeout=10) as http:

        @settings(
            max_examples=250,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        @given(
            path=st.sampled_from(PATHS),
            body=bodies(),
            content_type=st.just("application/json") | st.sampled_from(CONTENT_TYPES),
        )
        def check(path: str, body: bytes, content_type: str | None) -> None:
            seen = [len(s.answers) for s in stand_ins]
            headers = {"Content-Type": content_type} if content_type else {}
            answer = http.post(path, content=body, headers=headers)
            forwarded = [a for s, n in zip(stand_ins, seen, strict=True) for a in s.answers[n:]]
            assert answer.status_code < 500, answer.text
            event(f"{'forwarded' if forwarded else 'refused'}: {answer.status_code}")
            if forwarded:
                assert [status for _, status in forwarded] == [answer.status_code]
                return
            assert 400 <= answer.status_code < 500, answer.text
            error = answer.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}
            assert isinstance(error["message"], str) and error["message"]
            assert error["type"] in ("invalid_request_error", "not_found_error")

        check()


COMPLETION = b'{"model": "standin", "prompt": "x", "max_tokens": 1'


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "param"),
    [
        ("/v1/completions", b"{bad", {}, 400, None),
        ("/v1/completions", b"", {}, 400, None),
        ("/v1/completions", b"[1, 2]", {}, 400, None),
        ("/v1/completions", b'"standin"', {}, 400, None),
        ("/v1/completions", b'{"model": 5, "prompt": "x"}', {}, 400, "model"),
        ("/v1/completions", COMPLETION + b', "temperature": NaN}', {}, 400, None),
        ("/v1/completions", COMPLETION + b', "temperature": -Infinity}', {}, 400, None),
        ("/v1/completions", COMPLETION + b', "temperature": 1e999}', {}, 400, None),
        ("/v1/completions", COMPLETION + b', "model": "other"}', {}, 400, None),
        ("/v1/completions", COMPLETION + b', "x": {"a": 1, "a": 2}}', {}, 400, None),
        ("/v1/completions", COMPLETION[:-1] + b'\xff"}', {}, 400, None),
        ("/v1/completions", COMPLETION[:-1] + b'\xc0\xaf"}', {}, 400, None),  # overlong
        ("/v1/completions", COMPLETION[:-1] + b'\xed\xa0\x80"}', {}, 400, None),  # surrogate
        ("/v1/completions", (COMPLETION + b"}").decode().encode("utf-16"), {}, 400, None),
        ("/v1/completions", (COMPLETION + b"}").decode().encode("utf-16-le"), {}, 400, None),
        ("/v1/completions", (COMPLETION + b"}").decode().encode("utf-32"), {}, 400, None),
        ("/v1/completions", codecs.BOM_UTF8 + COMPLETION + b"}", {}, 200, None),
        (
            "/v1/completions",
            COMPLETION + b', "x": ' + b"[" * 200 + b"]" * 200 + b"}",
            {},
            400,
            None,
        ),
        (
            "/v1/completions",
            b'{"model": "standin", "prompt": ' + b"[" * 960 + b"]" * 960 + b"}",
            {},
            400,
            None,
        ),
        ("/v1/completions", COMPLETION + b', "x": "' + b"a" * MAX_BODY + b'"}', {}, 413, None),
        ("/v1/completions", COMPLETION + b', "stream": true, "n": "two"}', {}, 400, "n"),
        (
            "/v1/completions",
            COMPLETION + b', "stream": true, "stream_options": 1}',
            {},
            400,
            "stream_options",
        ),
        ("/v1/completions", COMPLETION + b"}", {"Content-Type": "text/plain"}, 400, None),
        ("/v1/completions", COMPLETION + b"}", {"Content-Type": ""}, 400, None),
        ("/v1/completions", b"not gzip", {"Content-Encoding": "gzip"}, 400, None),
        ("/v1/embeddings", b"not gzip", {"Content-Encoding": "gzip"}, 400, None),
        ("/v1/embeddings", b'{"model": 5, "input": "x"}', {}, 400, "model"),
        ("/v1/embeddings", b'{"model": "standin", "input": NaN}', {}, 400, None),
        ("/v1/responses", b'{"model": "standin", "model": "x"}', {}, 400, None),
        ("/rerank", b'["standin"]', {}, 400, None),
        ("/tokenize", b'{"model": "standin", "prompt": "\xff"}', {}, 400, None),
        ("/tokenize", b'{"model": "standin", "x": ' + b"[" * 5000, {}, 400, None),
    ],
)
def test_each_kind_of_bad_body_is_a_4xx_in_the_openai_shape(
    standins: Any,
    ferry: Any,
    path: str,
    body: bytes,
    headers: dict[str, str],
    status: int,
    param: str | None,
) -> None:
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], instances_migration="lite", server={"max_body_bytes": MAX_BODY})
    answer = httpx.post(
        proxy.url + path, content=body, headers={"Content-Type": "application/json", **headers}
    )
    assert answer.status_code == status, answer.text
    if status == 200:
        return
    assert standin.answers == []  # Ferry's own answer
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["type"] == "invalid_request_error"


def test_a_body_that_does_not_decompress_is_answered_quietly(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The 400 is the answer; aiohttp then read on in the body, met the same error
    and logged a traceback at ERROR for each such request (a log any client could
    flood). Ferry reads the body as it came and inflates it itself: the
    connection serves on."""
    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    caplog.set_level(logging.ERROR)
    with httpx.Client() as client:
        for _ in range(2):
            answer = client.post(
                proxy.url + "/v1/completions",
                content=b"not gzip" * 1000,
                headers={"Content-Type": "application/json", "Content-Encoding": "gzip"},
            )
            assert answer.status_code == 400
            assert "does not decode as gzip" in answer.json()["error"]["message"]
        ok = client.post(proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"})
        assert ok.status_code == 200
    time.sleep(0.2)  # (aiohttp's lingering read came after the answer)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: zstd\r\n"
        b"Content-Length: 2\r\n\r\n{}",
    ],
    ids=["header line", "zstd"],
)
def test_a_request_aiohttps_parser_refuses_logs_no_error(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture, head: bytes
) -> None:
    """aiohttp answers it 400 before any of Ferry's code runs, and logged each
    one at ERROR with a traceback: a log any client could flood."""
    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    caplog.set_level(logging.INFO)
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(head)
        assert raw.recv(4096).startswith(b"HTTP/1.")
    assert httpx.post(proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"})
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize(
    "head",
    [
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
        b"P@ST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/9.9\r\nHost: x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Length: 2\r\n\r\n{}",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"zz\r\n{}\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Bad: a\x00b\r\n\r\n",
    ],
    ids=["header line", "method", "version", "length", "length and chunked", "chunk size", "nul"],
)
def test_a_request_aiohttps_parser_refuses_is_answered_in_the_openai_shape(
    standins: Any, ferry: Any, head: bytes
) -> None:
    """aiohttp refuses these before any middleware runs and answered text/plain;
    an OpenAI client reads the JSON error shape, whatever refused it."""
    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(head)
        answer = b""
        while chunk := raw.recv(65536):  # it closes the connection after
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    headers, _, body = rest.partition(b"\r\n\r\n")
    assert status_line.split()[1] in (b"400", b"501", b"505"), answer
    assert b"content-type: application/json" in headers.lower(), answer
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["message"], error
    assert httpx.post(proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/invocations"])
def test_a_body_that_takes_long_to_read_stalls_no_one(standins: Any, ferry: Any, path: str) -> None:
    """A body of nearly `MAX_BRACKETS` empty objects takes Python most of a
    second to read. It is read off the event loop: `/livez` (and every stream)
    is answered meanwhile, where it used to wait for the whole read."""
    from threading import Thread

    from proxy.openai_request import MAX_BRACKETS, read_object

    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], server={"max_body_bytes": 8 * 1024 * 1024})
    items = b",".join([b"{}"] * (MAX_BRACKETS - 10))
    body = b'{"model": "standin", "prompt": "x", "input": "x", "x": [' + items + b"]}"
    began = time.monotonic()
    read_object(body)
    read_s = time.monotonic() - began  # what the read costs, here and now
    answered: list[int] = []
    sender = Thread(
        target=lambda: answered.append(
            httpx.post(
                proxy.url + path,
                content=body,
                headers={"Content-Type": "application/json"},
                timeout=60,
            ).status_code
        )
    )
    with httpx.Client() as client:
        client.get(proxy.url + "/livez")  # connected before the read begins
        sender.start()
        waits = []
        while sender.is_alive():
            sent = time.monotonic()
            assert client.get(proxy.url + "/livez").status_code == 200
            waits.append(time.monotonic() - sent)
            time.sleep(0.01)
        sender.join()
    # Read, and sent on: the stand-in's own limit (aiohttp's 1 MiB) answers.
    assert answered == [413]
    print(f"read {read_s:.3f} s; /livez waited at most {max(waits):.3f} s")
    assert max(waits) < read_s / 2, (max(waits), read_s)


def test_a_body_declared_too_large_is_refused_before_it_is_sent(standins: Any, ferry: Any) -> None:
    """A declared Content-Length past `max_body_bytes` gets its 413 at once, its
    body unread (it was read up to the limit first), and the connection ends."""
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], server={"max_body_bytes": MAX_BODY})
    host, port = proxy.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as client:
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100000000\r\n\r\n"  # and not a byte of it
        )
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < 10:
            answer += client.recv(65536)  # (times out where no answer comes)
        head, _, body = answer.partition(b"\r\n\r\n")
        length = int(next(h for h in head.split(b"\r\n") if h.startswith(b"Content-Length:"))[15:])
        while len(body) < length:
            body += client.recv(65536)
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" in head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert standin.answers == []


def test_expect_continue_is_said_only_to_a_body_that_will_be_taken(
    standins: Any, ferry: Any
) -> None:
    """aiohttp said `100 Continue` to every `Expect`, before Ferry's limits ran:
    a client was told to send the body the 413 then refused."""
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], server={"max_body_bytes": MAX_BODY})
    host, port = proxy.url.removeprefix("http://").split(":")

    def ask(length: int, expect: str = "100-continue") -> socket.socket:
        client = socket.create_connection((host, int(port)), timeout=5)
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Expect: %s\r\nContent-Length: %d\r\n\r\n" % (expect.encode(), length)
        )
        return client

    def head_of(client: socket.socket) -> bytes:
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += client.recv(65536)  # (times out where no answer comes)
        return answer

    with ask(MAX_BODY + 1) as client:
        assert head_of(client).startswith(b"HTTP/1.1 413")  # and no 100 before it
    with ask(10, "teapot") as client:
        answer = head_of(client)
        assert answer.startswith(b"HTTP/1.1 417") and b"application/json" in answer
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 1}).encode()
    with ask(len(body)) as client:
        assert head_of(client) == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.sendall(body)
        assert head_of(client).startswith(b"HTTP/1.1 200")
    assert len(standin.answers) == 1


def test_headers_too_large_in_all_are_refused(standins: Any, ferry: Any) -> None:
    """Each line may be 64 KiB (a long JWT), but not 8 MiB of them in all."""
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    headers = {f"x-pad-{n}": "a" * 8000 for n in range(10)}
    answer = httpx.post(
        proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"}, headers=headers
    )
    assert answer.status_code == 431 and "in all" in answer.json()["error"]["message"]
    assert standin.answers == []
    # One line past 64 KiB, or past 128 lines, is aiohttp's parser's to refuse:
    # it said 400, "bad request".
    for many in ({"x-long": "a" * 70_000}, {f"x-h{n}": "a" for n in range(130)}):
        answer = httpx.post(proxy.url + "/v1/completions", json={}, headers=many)
        assert answer.status_code == 431, answer.text
        assert "headers too large" in answer.json()["error"]["message"]
    # The request line has the same limit, and aiohttp the same refusal: it
    # was a 431 too.
    with socket.create_connection(("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]))) as client:
        client.sendall(b"GET /v1/models?x=" + b"a" * 70_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = client.makefile("rb").read()
    assert answer.split(b" ", 2)[1] == b"414", answer[:100]
    assert b"URL is too long" in answer
    fine = {"Authorization": "Bearer " + "a" * 60_000}  # one long header: as before
    answer = httpx.post(
        proxy.url + "/v1/completions", json={"model": "standin", "prompt": "x"}, headers=fine
    )
    assert answer.status_code == 200


@pytest.mark.parametrize(
    "limit,megabytes",
    [(MAX_BODY, 1024), (1 << 20, 1024), (32 << 20, 256)],
    ids=["declared", "inflated", "default-limit"],
)
def test_a_compressed_body_past_the_limit_is_not_inflated_on(
    standins: Any, ferry: Any, limit: int, megabytes: int
) -> None:
    """A gzip body of 1 MB that inflates to 1 GB of spaces got its 413 (at once
    where its declared length is past the limit, else once it inflates past
    it), then aiohttp read on in it to drop it, inflating the rest on the event
    loop: every stream (and `/livez`) waited most of a second. And under the
    default limit, 250 KB of gzip (256 MB of spaces) was inflated whole on the
    event loop as it came, before any limit applied. Ferry now takes bodies as
    they come and inflates them in a thread, never past the limit."""
    import zlib
    from threading import Thread

    [(_, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url], server={"max_body_bytes": limit})
    packer = zlib.compressobj(6, zlib.DEFLATED, 31)  # (31: the gzip format)
    spaces = b" " * (1 << 20)
    bomb = packer.compress(b'{"model": "standin", "prompt": "x"')
    bomb += b"".join(packer.compress(spaces) for _ in range(megabytes)) + packer.compress(b"}")
    bomb += packer.flush()
    host, port = proxy.url.removeprefix("http://").split(":")
    answers: list[bytes] = []

    def send() -> None:
        with socket.create_connection((host, int(port)), timeout=10) as raw:
            raw.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(bomb)
            )
            try:
                raw.sendall(bomb)
            except OSError:
                pass  # the connection ended with the answer: the rest is not taken
            answers.append(raw.recv(100))

    sender = Thread(target=send)
    with httpx.Client() as client:
        client.get(proxy.url + "/livez")  # connected before the bomb goes off
        sender.start()
        waits = []
        while sender.is_alive() or len(waits) < 20:
            sent = time.monotonic()
            assert client.get(proxy.url + "/livez").status_code == 200
            waits.append(time.monotonic() - sent)
            time.sleep(0.01)
        sender.join()
    assert answers and answers[0].startswith(b"HTTP/1.1 413"), answers
    assert max(waits) < 0.25, max(waits)


def test_bodies_being_received_are_held_under_one_budget(standins: Any, ferry: Any) -> None:
    """Each client sent all but the last byte of a body under `max_body_bytes`
    and waited: twenty of them held 774 MB until their timeout. Past
    `max_pending_body_bytes`, the body whose bytes would cross it gets a 503
    (with Retry-After); a body that comes whole meanwhile is served, and the
    budget is free again once the held ones are gone."""
    import select

    [(standin, site)] = standins(1, itl_s=0)
    limit = 64 * 1024
    proxy = ferry([site.url], server={"max_body_bytes": limit, "max_pending_body_bytes": 2 * limit})
    host, port = proxy.url.removeprefix("http://").split(":")
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % limit
    )
    held = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
    try:
        for conn in held:  # 3 x 60 KB against 128 KB: one of them crosses it
            conn.sendall(head + b" " * (limit - 4 * 1024))
        answered, _, _ = select.select(held, [], [], 10)
        assert len(answered) == 1, answered
        answer = answered[0].recv(4096)
        assert answer.startswith(b"HTTP/1.1 503"), answer
        assert b"Retry-After: 1" in answer and b"being received at once" in answer
        small = {"model": "standin", "prompt": "x", "max_tokens": 2}
        assert httpx.post(proxy.url + "/v1/completions", json=small).status_code == 200
        others = [conn for conn in held if conn not in answered]
        assert select.select(others, [], [], 0.2)[0] == []  # they still wait
    finally:
        for conn in held:
            conn.close()
    big = {"model": "standin", "prompt": "x" * (limit - 1024), "max_tokens": 2}

    def served() -> bool:  # once the held ones' handlers have ended
        return httpx.post(proxy.url + "/v1/completions", json=big).status_code == 200

    wait_until(served, timeout=10)
    assert len(standin.answers) == 2


@pytest.mark.parametrize(
    "encodings",
    [["br"], ["zstd"], ["gzip, gzip"], ["compress"], ["gzip", "gzip"], ["identity", "gzip"]],
)
def test_a_content_encoding_ferry_does_not_take_is_415(
    standins: Any, ferry: Any, encodings: list[str]
) -> None:
    """Two header lines are one list, as HTTP reads them: Ferry read the first
    line alone (gzip, gzip: a 400 after one inflation; identity, gzip: gzip's
    bytes as JSON)."""
    [(standin, site)] = standins(1, itl_s=0)
    proxy = ferry([site.url])
    body = b'{"model": "standin", "prompt": "x"}'
    for encoding in reversed(encodings):
        body = gzip.compress(body) if encoding == "gzip" else body
    headers = [("Content-Type", "application/json")]
    answer = httpx.post(
        proxy.url + "/v1/completions",
        content=body,
        headers=headers + [("Content-Encoding", e) for e in encodings],
    )
    assert answer.status_code == 415, answer.text
    assert "send gzip, deflate or none" in answer.json()["error"]["message"]
    assert answer.json()["error"]["type"] == "invalid_request_error"
    assert standin.answers == []

"""Instances that break HTTP in ways no engine should, played by raw socket
servers (not vLLM): what they send must not reach another client, nor hold one.

Bytes an instance sends on a kept-alive connection while no request is waiting
on it (a buggy or hostile server writing a second answer after the first was
whole) must not become the answer to the next request that reuses the
connection: that request may be another client's. nginx closes a cached
upstream connection that receives anything while idle."""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest

from tests.helpers import wait_until

MODEL = "standin"
METRICS = (
    f'vllm:num_requests_running{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:num_requests_waiting{{engine="0",model_name="{MODEL}"}} 0.0\n'
    f'vllm:kv_cache_usage_perc{{engine="0",model_name="{MODEL}"}} 0.0\n'
    'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0\n'
).encode()


def _answer(body: bytes, kind: str = "application/json") -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        kind.encode(), len(body)) + body  # fmt: skip


def _completion(text: str) -> bytes:
    return json.dumps({
        "id": "cmpl-1", "object": "text_completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }).encode()  # fmt: skip


class RawServer:
    """An HTTP/1.1 server on a raw socket, a thread per connection (`_serve`)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed: the test is over
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer the requests on `conn` in turn: the engine's own pages well,
        a completion as `complete` does (False: the connection is done)."""
        buf = b""
        with conn:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = conn.recv(65536)
                    if not data:
                        return
                    buf += data
                head, _, buf = buf.partition(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                while len(buf) < length:
                    buf += conn.recv(65536)
                buf = buf[length:]
                path = head.split(b" ")[1]
                if path.startswith(b"/v1/models"):
                    models = {"object": "list", "data": [{"id": MODEL, "object": "model"}]}
                    conn.sendall(_answer(json.dumps(models).encode()))
                elif path.startswith(b"/metrics"):
                    conn.sendall(_answer(METRICS, "text/plain"))
                elif not path.startswith(b"/v1/"):
                    conn.sendall(_answer(b""))
                elif not self.complete(conn):
                    return

    def complete(self, conn: socket.socket) -> bool:
        raise NotImplementedError


class LateWriter(RawServer):
    """Answers well, except that after the first completion it answers, it
    writes a second, unasked-for answer on the same connection 0.3 s later."""

    poisoned = False

    def complete(self, conn: socket.socket) -> bool:
        conn.sendall(_answer(_completion("real answer")))
        if not self.poisoned:
            self.poisoned = True
            time.sleep(0.3)
            conn.sendall(_answer(_completion("SMUGGLED")))
        return True


@pytest.mark.parametrize("engine", ["openai", "vllm"])
def test_bytes_an_instance_sends_on_an_idle_connection_answer_no_one(
    ferry: Any, engine: str
) -> None:
    upstream = LateWriter()
    proxy = ferry([f"http://127.0.0.1:{upstream.port}"], instances_engine=engine)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    try:
        first = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
        assert first.status_code == 200, first.text
        assert first.json()["choices"][0]["text"] == "real answer"
        time.sleep(0.6)  # the unasked-for answer has come, on a connection idle in the pool
        texts = []
        for _ in range(10):  # another client's requests
            answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
            texts.append((answer.status_code, answer.text[:200]))
    finally:
        upstream.sock.close()
    # Each answer is a completion of its own: not the unasked-for one, nor the
    # answer to some other call (a look at /v1/models or /metrics) on that connection.
    assert all(t == (200, texts[0][1]) and "real answer" in t[1] for t in texts), texts


class SlowHeaders(RawServer):
    """A completion's status line, then one byte of header every 0.3 s, never
    finished (a slowloris upstream)."""

    def complete(self, conn: socket.socket) -> bool:
        try:
            conn.sendall(b"HTTP/1.1 200 OK\r\n")
            for _ in range(200):
                time.sleep(0.3)
                conn.sendall(b"X")
        except OSError:
            pass
        return False


def test_a_streams_headers_that_never_end_are_given_up(ferry: Any) -> None:
    """Headers trickling in a byte at a time never end: each byte restarted
    aiohttp's read timer, so the client (and the instance's bill) waited for
    ever. A stream's are given up after upstream_idle_timeout_s; a whole
    answer's come with its body, after its generation, and wait as it does."""
    upstream = SlowHeaders()
    proxy = ferry(
        [f"http://127.0.0.1:{upstream.port}"],
        server={"upstream_idle_timeout_s": 1.0, "upstream_read_timeout_s": 2.0},
    )
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, "stream": True}
    try:
        answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=6)
    finally:
        upstream.sock.close()
    assert answer.status_code == 503, answer.text
    assert "failed before answering: no data within" in answer.json()["error"]["message"]
    wait_until(lambda: proxy.view("i0").inflight == 0)

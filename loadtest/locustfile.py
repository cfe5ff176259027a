"""Streaming OpenAI load for locust: TTFT and inter-token latency as locust metrics.

Point it at any OpenAI-compatible base URL (Ferry, vLLM, a stand-in):

    locust -f loadtest/locustfile.py --headless -u 20 -r 20 -t 30s --host http://127.0.0.1:8000

Every user streams `POST /v1/completions` and reads the SSE events as they arrive.
Besides the usual POST entry (the whole request, last byte included) it reports:

    TTFT  /v1/completions   time from sending to the first token event
    ITL   /v1/completions   each gap between consecutive token events

Environment:

    FERRY_MODEL=tiny          model name sent in every request
    FERRY_MAX_TOKENS=32       output length without a trace
    FERRY_TRACE=t.jsonl       replay a trace (`ferry trace ...`, see loadtest/trace.py)

With FERRY_TRACE, users take the trace's requests in order, together, and each
waits until the request's `arrival_s` (from the test start) before sending it, so
the arrival pattern is replayed as long as enough users are idle (-u well above
rate x latency). Prompts are token ids (exact lengths for any vocabulary of >= 300
tokens), `ignore_eos` makes outputs exactly `output_tokens` long. When the trace
runs out it wraps around, shifted by its span, until locust stops (-t). Replay
assumes one locust process; each worker of a distributed run would replay it all.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import gevent
from locust import FastHttpUser, between, constant, events, task
from locust.env import Environment

from loadtest.trace import TraceRequest, read

MODEL = os.environ.get("FERRY_MODEL", "tiny")
MAX_TOKENS = int(os.environ.get("FERRY_MAX_TOKENS", "32"))
TRACE: list[TraceRequest] = (
    read(Path(os.environ["FERRY_TRACE"])) if "FERRY_TRACE" in os.environ else []
)
NAME = "/v1/completions"


class _Replay:
    """The trace's requests in order, shared by all users (gevent: next() needs no lock)."""

    def __init__(self) -> None:
        self.start = time.monotonic()
        self.counter = itertools.count()

    def next(self) -> tuple[TraceRequest, float]:
        """The next request and the monotonic time at which to send it."""
        i = next(self.counter)
        cycle, req = divmod(i, len(TRACE))
        span = TRACE[-1].arrival_s * (1 + 1 / len(TRACE))  # the trace plus one mean gap
        return TRACE[req], self.start + cycle * span + TRACE[req].arrival_s


replay = _Replay()


@events.test_start.add_listener
def _on_test_start(environment: Environment, **_: Any) -> None:
    global replay
    replay = _Replay()


def token_ids(n: int) -> list[int]:
    return [10 + k % 290 for k in range(n)]


class CompletionsUser(FastHttpUser):
    wait_time = constant(0) if TRACE else between(0.1, 0.5)

    @task
    def complete(self) -> None:
        headers = {"Accept-Encoding": "identity"}
        body: dict[str, Any] = {"model": MODEL, "stream": True}
        if TRACE:
            req, send_at = replay.next()
            gevent.sleep(max(0.0, send_at - time.monotonic()))
            body.update(prompt=token_ids(req.prompt_tokens), max_tokens=req.output_tokens)
            body.update(ignore_eos=True, temperature=0)
            headers["x-ferry-priority"] = req.priority
        else:
            body.update(prompt="The quick brown fox", max_tokens=MAX_TOKENS)
        self.stream(body, headers)

    def stream(self, body: dict[str, Any], headers: dict[str, str]) -> None:
        start = time.perf_counter()
        with self.client.post(
            NAME, json=body, headers=headers, stream=True, catch_response=True
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {(resp.text or '')[:200]}")
                return
            size, done, last, error = 0, False, None, None
            try:
                # readline() hands over each line as it arrives; iter_content() waits for 1 KiB
                while line := resp._response.readline(b"\n"):
                    size += len(line)
                    line = line.strip()
                    if done or not line.startswith(b"data:"):
                        continue  # blank separators, comments, the end of the body
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True  # read on to the end so the connection can be reused
                        continue
                    event = json.loads(data)
                    if "error" in event:
                        raise ValueError(f"error event: {event['error']}")
                    choice = (event.get("choices") or [{}])[0]
                    if not (choice.get("text") or choice.get("token_ids")):
                        continue
                    now = time.perf_counter()
                    if last is None:
                        self.report("TTFT", now - start)
                    else:
                        self.report("ITL", now - last)  # one entry per gap
                    last = now
            except Exception as exc:  # a broken stream is a failed request, not a crash
                error = f"{type(exc).__name__}: {exc}"
            resp.request_meta["response_time"] = (time.perf_counter() - start) * 1000
            resp.request_meta["response_length"] = size
            if error or not done or last is None:
                resp.failure(error or ("no token events" if done else "no data: [DONE]"))

    def report(self, kind: str, seconds: float) -> None:
        self.environment.events.request.fire(
            request_type=kind,
            name=NAME,
            response_time=seconds * 1000,
            response_length=0,
            exception=None,
            context={},
        )

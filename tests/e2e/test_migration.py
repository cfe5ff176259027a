"""Lite-mode migration on real vLLM CPU servers: moved streams are token-exact."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import openai
import pytest

from loadtest.vllm_servers import VLLMServer, metric
from tests.helpers import wait_until

PROMPT = "The quick brown fox jumps over the lazy dog while the scheduler"
CHAT = [{"role": "user", "content": "The quick brown fox"}]
TOKEN = "migr"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def stream_ids(
    client: openai.OpenAI,
    chat: bool,
    max_tokens: int | None,
    on_chunk: Callable[[int], None] = print,
    prompt: str = PROMPT,
) -> tuple[list[int], str, Any]:
    """Stream one greedy request; return (token ids, text, last chunk). A chat
    without `max_tokens` runs to the end of the context."""
    common: dict[str, Any] = {
        "model": "tiny",
        "temperature": 0,
        "stream": True,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    if max_tokens is not None:
        common["max_tokens"] = max_tokens
    if chat:
        messages = CHAT if prompt == PROMPT else [{"role": "user", "content": prompt}]
        stream: Any = client.chat.completions.create(messages=messages, **common)
    else:
        stream = client.completions.create(prompt=prompt, **common)
    ids: list[int] = []
    text, last = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        ids.extend(getattr(choice, "token_ids", None) or [])
        text += (choice.delta.content if chat else choice.text) or ""
        last = chunk
        on_chunk(len(ids))
    return ids, text, last


def once_at(tokens: int, action: Callable[[], object]) -> Callable[[int], None]:
    """An on_chunk callback that runs `action` once, when the count first reaches
    `tokens` (a chunk can carry several tokens, so the exact count may be skipped)."""
    done = False

    def on_chunk(n: int) -> None:
        nonlocal done
        if n >= tokens and not done:
            done = True
            action()

    return on_chunk


def drain_busy(proxy: Any, drained: list[str]) -> Callable[[], None]:
    """An action that drains, with migration, the instance serving the one
    stream in flight, and notes its name in `drained`."""

    def drain() -> None:
        source = next(name for name in ("i0", "i1") if proxy.view(name).inflight)
        drained.append(source)
        post(f"{proxy.url}/admin/instances/{source}/drain?migrate=true")

    return drain


def post(url: str) -> None:
    request = urllib.request.Request(url, data=b"", method="POST", headers=AUTH)
    urllib.request.urlopen(request, timeout=10).close()


@pytest.fixture
def lite(ferry: Any, vllm_pair: list[VLLMServer]) -> Callable[..., Any]:
    def make(prewarm: bool = True) -> Any:
        return ferry(
            [s.url for s in vllm_pair],
            instances_migration="lite",
            scheduler={"migration_prewarm": prewarm},
            admin_token=TOKEN,
        )

    return make


def test_greedy_decoding_is_deterministic_and_resumable(vllm_pair: list[VLLMServer]) -> None:
    """What token-exact migration relies on, shown on these servers (float32)."""
    a, b = (api(s.url) for s in vllm_pair)
    first, _, _ = stream_ids(a, False, 300, on_chunk=lambda n: None)
    again, _, _ = stream_ids(b, False, 300, on_chunk=lambda n: None)
    assert first == again and len(first) == 300
    prompt_ids = (
        a.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=1, extra_body={"return_token_ids": True}
        )
        .choices[0]
        .model_extra["prompt_token_ids"]
    )
    for cut in (1, 128, 250):
        resumed = (
            b.completions.create(
                model="tiny",
                prompt=prompt_ids + first[:cut],
                max_tokens=300 - cut,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            .choices[0]
            .model_extra["token_ids"]
        )
        assert resumed == first[cut:], cut


@pytest.mark.parametrize("prewarm", [True, False])
@pytest.mark.parametrize("chat", [False, True])
def test_moved_stream_is_token_exact(lite: Any, chat: bool, prewarm: bool) -> None:
    proxy = lite(prewarm)
    reference, ref_text, _ = stream_ids(api(proxy.url), chat, 300, on_chunk=lambda n: None)
    drained: list[str] = []
    ids, text, last = stream_ids(
        api(proxy.url), chat, 300, on_chunk=once_at(100, drain_busy(proxy, drained))
    )
    for name in ("i0", "i1"):
        post(f"{proxy.url}/admin/instances/{name}/undrain")
    assert drained
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="drain"}') == 1
    assert ids == reference and text == ref_text
    assert last.choices[0].finish_reason == "length"


def test_drain_moves_ten_streams_and_they_finish_intact(lite: Any) -> None:
    proxy = lite(True)
    reference, _, _ = stream_ids(api(proxy.url), False, 200, on_chunk=lambda n: None)
    results: list[list[int]] = []
    started = threading.Barrier(11)

    def one() -> None:
        ids, _, _ = stream_ids(api(proxy.url), False, 200, on_chunk=once_at(5, started.wait))
        results.append(ids)

    threads = [threading.Thread(target=one) for _ in range(10)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    busiest = max(("i0", "i1"), key=lambda n: proxy.view(n).inflight)
    post(f"{proxy.url}/admin/instances/{busiest}/drain?migrate=true")
    wait_until(lambda: proxy.view(busiest).inflight == 0, timeout=60)
    for t in threads:
        t.join(300)
    post(f"{proxy.url}/admin/instances/{busiest}/undrain")
    assert len(results) == 10 and all(r == reference for r in results)


def start_streams(
    url: str, n: int, results: list[tuple[int, str]], errors: list[BaseException]
) -> list[threading.Thread]:
    """`n` greedy 200-token streams through Ferry, each 3 tokens in when this
    returns; each adds (tokens, finish reason) to `results`, or its error to `errors`."""
    started = threading.Barrier(n + 1)

    def one() -> None:
        try:
            ids, _, last = stream_ids(api(url), False, 200, on_chunk=once_at(3, started.wait))
            results.append((len(ids), last.choices[0].finish_reason))
        except BaseException as exc:  # noqa: BLE001 - collected for the caller's assertion
            errors.append(exc)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    return threads


def test_kill_one_instance_and_twenty_streams_finish(
    ferry: Any, doomed: VLLMServer, vllm_pair: list[VLLMServer]
) -> None:
    proxy = ferry(
        [doomed.url, vllm_pair[1].url],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
    )
    results: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    threads = start_streams(proxy.url, 20, results, errors)
    doomed.kill()
    for t in threads:
        t.join(300)
    assert not errors
    assert results == [(200, "length")] * 20
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="failover"}') >= 1


# Round robin, scraped fast enough that a frozen server shows in under a second.
FREEZE_SHOWS_FAST = {
    "policy": "round_robin",
    "scrape_interval_s": 0.1,
    "scrape_timeout_s": 0.5,
    "unhealthy_after_failures": 2,
}


def frozen_while(server: VLLMServer, threads: list[threading.Thread]) -> float:
    """Freeze `server` (SIGSTOP) until `threads` end; how long they took."""
    began = time.monotonic()
    server.freeze()
    try:
        for t in threads:
            t.join(120)
        return time.monotonic() - began
    finally:
        server.thaw()


def test_a_frozen_server_s_streams_and_whole_requests_go_on_elsewhere(
    ferry: Any, vllm_pair: list[VLLMServer]
) -> None:
    """SIGSTOP one real server with streams and whole requests on both: once its
    scrapes fail and it produces nothing, its streams fail over and its whole
    requests are asked of the other, long before any timeout (60 s idle, 600 s
    for a whole answer)."""
    frozen = vllm_pair[0]
    proxy = ferry(
        [s.url for s in vllm_pair],
        instances_migration="lite",
        scheduler=FREEZE_SHOWS_FAST,
    )
    streams: list[tuple[int, str]] = []
    wholes: list[int] = []
    errors: list[BaseException] = []

    def whole() -> None:
        try:
            answer = api(proxy.url).completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=400,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            assert answer.usage is not None
            wholes.append(answer.usage.completion_tokens)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = start_streams(proxy.url, 4, streams, errors)
    threads += [threading.Thread(target=whole) for _ in range(2)]  # one on each server
    for t in threads[4:]:
        t.start()
    # All six placed (round robin: three on each) before i0 stops answering.
    wait_until(lambda: proxy.view("i0").inflight + proxy.view("i1").inflight == 6, timeout=30)
    time.sleep(0.3)
    took = frozen_while(frozen, threads)
    assert not errors, errors
    assert streams == [(200, "length")] * 4 and wholes == [400, 400]
    assert took < 60
    assert metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="failover"}') >= 1
    assert metric(proxy.url, 'ferry_retries_total{reason="upstream_error"}') >= 1
    wait_until(lambda: proxy.view("i0").healthy, timeout=30)  # thawed, as the next tests need it


def test_without_migration_a_frozen_server_s_streams_end_at_once(
    ferry: Any, vllm_pair: list[VLLMServer]
) -> None:
    """Without migration a stream under way cannot go on elsewhere; on a server
    that freezes (or shuts down leaving it open and silent) it ends with an
    error event once the freeze shows, not `upstream_idle_timeout_s` (60 s)
    later, so its client can retry. The other server's streams are untouched."""
    frozen = vllm_pair[0]
    proxy = ferry(
        [s.url for s in vllm_pair],
        scheduler=FREEZE_SHOWS_FAST,
    )
    results: list[tuple[int, str]] = []
    errors: list[BaseException] = []
    threads = start_streams(proxy.url, 4, results, errors)  # two on each
    took = frozen_while(frozen, threads)
    assert results == [(200, "length")] * 2
    assert len(errors) == 2 and all("stopped answering" in str(e) for e in errors), errors
    assert took < 30
    wait_until(lambda: proxy.view("i0").healthy, timeout=30)  # thawed, as the next tests need it


def preemptions(server: VLLMServer) -> int:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        from adapters.vllm import parse_metrics

        return parse_metrics(resp.read().decode()).preemptions_total


def run_imbalanced(ferry: Any, servers: list[VLLMServer], rebalance: bool) -> tuple[int, float]:
    """Six long streams all land on i0 (i1 is draining while they start), then i1
    comes back. Returns (i0's new preemptions, rebalance migrations)."""
    proxy = ferry(
        [s.url for s in servers],
        instances_migration="lite",
        admin_token=TOKEN,
        scheduler={"rebalance_interval_s": 0.2 if rebalance else 0.0},
    )
    post(f"{proxy.url}/admin/instances/i1/drain")
    before = preemptions(servers[0])
    results: list[int] = []
    started = threading.Barrier(7)

    def one() -> None:
        ids, _, _ = stream_ids(api(proxy.url), False, 600, on_chunk=once_at(2, started.wait))
        results.append(len(ids))

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    started.wait(timeout=120)
    post(f"{proxy.url}/admin/instances/i1/undrain")
    for t in threads:
        t.join(300)
    assert results == [600] * 6
    moved = metric(proxy.url, 'ferry_migrations_total{outcome="ok",reason="rebalance"}')
    return preemptions(servers[0]) - before, moved


def test_rebalance_moves_work_to_the_free_instance(ferry: Any, vllm_pair: list[VLLMServer]) -> None:
    still, _ = run_imbalanced(ferry, vllm_pair, rebalance=False)
    relieved, moved = run_imbalanced(ferry, vllm_pair, rebalance=True)
    print(
        f"preemptions on the loaded instance: {still} without rebalancing, {relieved} with"
        f" ({moved:g} rebalance migrations)"
    )
    assert moved >= 1
    assert relieved < still, (relieved, still)


def test_a_moved_chat_without_a_budget_runs_to_the_end_of_the_context(lite: Any) -> None:
    """A continuation is a completion, whose default budget is 16 tokens: it is
    sent the chat's own, the room left in the context."""
    proxy = lite(False)
    reference, ref_text, _ = stream_ids(api(proxy.url), True, None, on_chunk=lambda n: None)
    assert len(reference) > 500  # 1,024 less the prompt
    drained: list[str] = []
    ids, text, last = stream_ids(
        api(proxy.url), True, None, on_chunk=once_at(100, drain_busy(proxy, drained))
    )
    for name in ("i0", "i1"):
        post(f"{proxy.url}/admin/instances/{name}/undrain")
    assert drained
    assert ids == reference and text == ref_text
    assert last.choices[0].finish_reason == "length"

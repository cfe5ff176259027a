"""Failover and moves through the proxy against stand-in servers (not vLLM)."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
import urllib.request
from typing import Any

import httpx
import openai
import pytest

from loadtest.standin_server import PROMPT_IDS
from migration_shim import wire
from proxy.server import MIGRATOR
from tests.helpers import free_port, wait_until


def api(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def metrics(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        return resp.read().decode()


def test_a_stream_that_breaks_resumes_on_the_other_instance(standins: Any, ferry: Any) -> None:
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    broken.break_after = 10
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    chunks = list(
        api(proxy.url).completions.create(
            model="standin",
            prompt="hi",
            max_tokens=40,
            stream=True,
            extra_headers={
                "X-Session-ID": "s1",
                "Authorization": "Bearer engine-key",
                "X-data-parallel-rank": "1",
            },
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 40
    assert len({c.id for c in chunks}) == 1  # one stream, one id
    continued = healthy.seen_bodies[-1]
    assert continued["prompt"] == [1, 2, 3] + [7] * 10 and continued["max_tokens"] == 30
    # The continuation is sent the client's headers, as its first call was (an
    # engine that checks the client's key refused it).
    sent = {k.lower(): v for k, v in healthy.seen_headers[-1].items()}
    assert sent["x-session-id"] == "s1" and sent["authorization"] == "Bearer engine-key"
    assert "x-data-parallel-rank" not in sent  # the first instance's rank, not this one's
    first = {k.lower(): v for k, v in broken.seen_headers[-1].items()}
    assert first["x-data-parallel-rank"] == "1"
    text = metrics(proxy.url)
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in text
    # One per call: the one that broke, and the one that finished the stream.
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 1.0' in text
    assert 'ferry_requests_total{instance="i1",outcome="ok"} 1.0' in text


def test_chat_resumes_as_chat_deltas_with_usage_counted_once(standins: Any, ferry: Any) -> None:
    (broken, a), (_, b) = standins(2, itl_s=0.001)
    broken.break_after = 5
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    stream = api(proxy.url).chat.completions.create(
        model="standin",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 12
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert len({c.id for c in chunks}) == 1
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) <= 1  # the stand-in sends none; a continuation must not add a wrong one


def test_a_failing_destination_leaves_the_request_on_its_source(standins: Any, ferry: Any) -> None:
    (source, a), (dest, b) = standins(2, itl_s=0.02)
    dest.fail_status = 500  # refuses the continuation
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin"},
    )
    received: list[str] = []

    def client() -> None:
        for c in api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=40, stream=True
        ):
            received.append(c.choices[0].text)

    t = threading.Thread(target=client)
    t.start()
    while len(received) < 5:
        time.sleep(0.01)
    request = urllib.request.Request(
        proxy.url + "/admin/instances/i0/drain?migrate=true",
        data=b"",
        method="POST",
        headers={"Authorization": "Bearer t"},
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert json.load(resp)["migrating"] == 1
    t.join(30)
    assert "".join(received) == " tok" * 40
    assert source.served == 1
    text = metrics(proxy.url)
    assert 'ferry_migrations_total{outcome="destination_failed",reason="drain"}' in text


def test_requests_that_cannot_move_say_so(standins: Any, ferry: Any) -> None:
    [(_, a)] = standins(1, itl_s=0.001)
    proxy = ferry([a.url], instances_migration="lite")
    list(
        api(proxy.url).completions.create(
            model="standin", prompt="x", max_tokens=3, n=2, stream=True
        )
    )
    assert 'ferry_non_migratable_requests_total{reason="n > 1"} 1.0' in metrics(proxy.url)


def test_a_high_priority_request_makes_room_by_moving_a_lower_one(
    standins: Any, ferry: Any
) -> None:
    # Two small instances (10 KV blocks of 16 tokens); each runs one normal stream.
    sites = standins(2, itl_s=0.02, kv_blocks=10)
    proxy = ferry([s.url for _, s in sites], instances_migration="lite")
    normal: list[list[str]] = [[], []]

    def background(n: int) -> None:
        for c in api(proxy.url).completions.create(
            model="standin",
            # Distinct prompts: one shared prompt would draw both to its holder.
            prompt=f"{n}" + "x" * 239,
            max_tokens=60,
            stream=True,  # ~80 tokens
        ):
            normal[n].append(c.choices[0].text)

    threads = [threading.Thread(target=background, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    # Both under way (six chunks of one alone, on a loaded machine, left the
    # other instance free: the high one needed no room).
    wait_until(lambda: min(len(chunks) for chunks in normal) >= 3, timeout=30)
    # 128 prompt tokens = 8 blocks: no instance has that much room left.
    high = api(proxy.url).completions.create(
        model="standin",
        prompt="y" * 384,
        max_tokens=5,
        extra_headers={"x-ferry-priority": "high"},
    )
    assert high.choices[0].text == " tok" * 5
    for t in threads:
        t.join(30)
    assert ["".join(chunks) for chunks in normal] == [" tok" * 60] * 2  # both intact
    assert 'ferry_migrations_total{outcome="ok",reason="priority"} 1.0' in metrics(proxy.url)
    # Moved without a pre-warm: on a full destination it held the high one's room
    # for its whole second.
    bodies = [b for s, _ in sites for b in s.seen_bodies]
    assert not [b for b in bodies if b.get("max_tokens") == 1], bodies


def test_a_broken_stream_resumes_on_a_draining_instance_when_none_else_is_left(
    standins: Any, ferry: Any
) -> None:
    """A drain waits for its streams; a stream that breaks meanwhile is better
    resumed there than lost, when no other instance is left."""
    (broken, a), (draining, b) = standins(2, itl_s=0.001)
    broken.break_after = 10
    proxy = ferry([a.url, b.url], instances_migration="lite", admin_token="t")
    request = urllib.request.Request(
        proxy.url + "/admin/instances/i1/drain",
        data=b"",
        method="POST",
        headers={"Authorization": "Bearer t"},
    )
    urllib.request.urlopen(request, timeout=5).close()
    chunks = list(
        api(proxy.url).completions.create(model="standin", prompt="hi", max_tokens=40, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 40
    assert draining.seen_bodies[-1]["prompt"] == [1, 2, 3] + [7] * 10
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)
    assert proxy.view("i1").draining  # still draining: the rescue did not undo it


def test_a_stalled_stream_resumes_elsewhere(standins: Any, ferry: Any) -> None:
    (stalled, a), (_, b) = standins(2, itl_s=0.001)
    stalled.stall_after = 8
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
        server={"upstream_idle_timeout_s": 0.5},
    )
    started = time.monotonic()
    chunks = list(
        api(proxy.url).completions.create(model="standin", prompt="hi", max_tokens=30, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 30
    assert time.monotonic() - started < 10
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)


def test_an_instance_that_breaks_every_stream_is_ejected_though_each_resumes(
    standins: Any, ferry: Any
) -> None:
    """Failover saves each stream, and the instance that broke it is still held
    to it: enough in a row eject it, as without migration."""
    (broken, a), (_, b) = standins(2, itl_s=0.001)
    broken.break_after = 3
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={
            "policy": "round_robin",
            "eject_after_failures": 2,
            "eject_base_s": 60,
            "scrape_interval_s": 60,  # a good scrape clears the error read below
        },
    )
    for _ in range(6):
        chunks = list(
            api(proxy.url).completions.create(
                model="standin", prompt="hi", max_tokens=10, stream=True
            )
        )
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 10
    assert len(broken.seen_bodies) == 2  # ejected after its second: none since
    text = metrics(proxy.url)
    assert 'ferry_ejections_total{instance="i0"} 1.0' in text
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 2.0' in text
    assert "stream broken" in str(proxy.loop.call(lambda: proxy.cluster.instances["i0"].last_error))


def test_a_source_that_broke_is_held_to_it_though_the_client_left_during_the_failover(
    standins: Any, ferry: Any
) -> None:
    """The client left while the continuation waited for its headers: the stream
    was counted a client's disconnect, and the break was held against no one."""
    (broken, a), (slow, b) = standins(2, itl_s=0.001)
    broken.break_after = 3
    slow.headers_delay_s = 3.0
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={
            "policy": "round_robin",
            "eject_after_failures": 1,
            "eject_base_s": 60,
            "scrape_interval_s": 60,
        },
    )
    body = {"model": "standin", "prompt": "hi", "max_tokens": 10, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=10) as answer:
        chunks = answer.iter_raw()  # (kept: a generator closed ends the connection)
        seen = b""
        while seen.count(b'"text"') < 3:
            seen += next(chunks)
        wait_until(lambda: len(slow.seen_bodies) == 1, timeout=5)  # the continuation waits
    wait_until(lambda: 'ferry_ejections_total{instance="i0"} 1.0' in metrics(proxy.url), timeout=5)
    assert 'ferry_ejections_total{instance="i1"} 0.0' in metrics(proxy.url)  # not its fault


def test_an_ejected_instance_takes_what_has_nowhere_else_to_go(standins: Any, ferry: Any) -> None:
    """Ejection left i0 out while i1 could serve; then i1 breaks a stream and is
    drained. The stream resumes on i0 and a new request is served there: with
    no other instance left, an ejected one is better than none (Envoy's panic
    threshold, at routing time; the ejection itself lasts a minute here)."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.001)
    a.break_after = 3
    proxy = ferry(
        [site_a.url, site_b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={
            "policy": "round_robin",
            "eject_after_failures": 2,
            "eject_base_s": 60,
            "scrape_interval_s": 0.05,
        },
    )

    def stream() -> str:
        chunks = api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=10, stream=True
        )
        return "".join(c.choices[0].text for c in chunks)

    for _ in range(4):  # i0 breaks two (each resumes on i1): ejected
        assert stream() == " tok" * 10
    ejected_for = proxy.cluster.ejected_for
    assert proxy.loop.call(ejected_for, "i0") > 0 and not proxy.view("i0").dispatchable
    a.break_after, b.break_after = None, 3  # i0 is well again; i1 now breaks
    assert stream() == " tok" * 10  # from i1 to i0, ejected but the only other
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 3.0' in metrics(proxy.url)
    _drain(proxy, "i1")
    assert stream() == " tok" * 10  # i0 alone takes new requests
    assert proxy.loop.call(ejected_for, "i0") > 0  # still: a spare back ends the panic


def test_a_drain_does_not_move_a_stream_back_to_where_it_broke(standins: Any, ferry: Any) -> None:
    """A drain moved the stream to an instance that then hung; it came back by
    failover, and the drain does not send it there again (each round would
    stall it for the idle timeout until it ran out of resumes)."""
    (_, a), (hung, b) = standins(2, itl_s=0.02)
    hung.stall_after, hung.stall_s = 0, 5.0  # headers, then nothing
    proxy = ferry(
        [a.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"migration_max_resumes": 2},
        server={"upstream_idle_timeout_s": 0.5},
    )
    admin = {"Authorization": "Bearer t"}
    texts: list[str] = []
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=150, stream=True
    )
    reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
    reader.start()
    body = json.dumps({"name": "b", "url": b.url, "migration": "lite"}).encode()
    added = urllib.request.Request(proxy.url + "/admin/instances", data=body, headers=admin)
    urllib.request.urlopen(added, timeout=5).close()
    wait_until(lambda: proxy.view("b").healthy, timeout=5)
    drain = urllib.request.Request(
        proxy.url + "/admin/instances/i0/drain?migrate=true", data=b"", headers=admin
    )
    urllib.request.urlopen(drain, timeout=5).close()
    reader.join(30)
    assert "".join(texts) == " tok" * 150  # whole, after one stall on b
    streamed = [body for body in hung.seen_bodies if body.get("stream")]
    assert len(streamed) == 1 and len(hung.seen_bodies) <= 2  # a pre-warm, a continuation
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)


def test_a_stream_out_of_resumes_names_every_instance_it_broke_on(
    standins: Any, ferry: Any
) -> None:
    """Each instance stalls the stream after a few tokens; after its last resume
    the client's error names the three, not only the last (where an operator
    would look for one broken engine)."""
    sites = standins(3, itl_s=0.01)
    for standin, _ in sites:
        standin.stall_after, standin.stall_s = 3, 3.0
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"migration_max_resumes": 2, "migration_prewarm": False},
        server={"upstream_idle_timeout_s": 0.5},
    )
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=50, stream=True
    )
    with pytest.raises(openai.APIError) as failed:
        for _ in stream:
            pass
    message = str(failed.value)
    assert "too many resumes (2)" in message
    assert all(name in message for name in ("i0", "i1", "i2")), message


@pytest.mark.parametrize("migration", ["lite", "off"])
def test_a_stream_kept_alive_by_comments_alone_counts_as_stalled(
    migration: str, standins: Any, ferry: Any
) -> None:
    """sse-starlette (llama-cpp-python's server) pings every 15 s: a hung engine
    behind it never lets the socket go quiet, and the idle timeout is on events."""
    (stalled, a), (_, b) = standins(2, itl_s=0.001)
    stalled.stall_after, stalled.stall_s, stalled.stall_pings_s = 3, 20.0, 0.1
    proxy = ferry(
        [a.url, b.url],
        instances_migration=migration,
        scheduler={"policy": "round_robin"},
        server={"upstream_idle_timeout_s": 0.5},
    )
    started = time.monotonic()
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=10, stream=True
    )
    if migration == "lite":
        assert "".join(c.choices[0].text for c in stream) == " tok" * 10
    else:
        with pytest.raises(openai.APIError, match="keep-alives"):
            list(stream)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8}])
def test_a_sampled_stream_holding_text_back_is_not_moved_by_choice(
    sampling: dict[str, Any], standins: Any, ferry: Any
) -> None:
    """A stop string makes vLLM hold text back, and a join then steps back: the
    destination would draw those tokens anew. Greedy, they come out the same
    (on real vLLM: tests/e2e); sampled, the client would get a seam, so the
    stream stays where it is. (The stand-in holds no text back.)"""
    (source, a), (_, b) = standins(2, itl_s=0.02)
    proxy = ferry([a.url, b.url], instances_migration="lite", admin_token="t")
    texts: list[str] = []
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=40, stream=True, stop=["zz"], **sampling
    )
    reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
    reader.start()
    wait_until(lambda: source.running == 1)
    drain = urllib.request.Request(
        proxy.url + "/admin/instances/i0/drain?migrate=true",
        data=b"",
        headers={"Authorization": "Bearer t"},
    )
    urllib.request.urlopen(drain, timeout=5).close()
    reader.join(10)
    assert "".join(texts) == " tok" * 40
    assert 'ferry_migrations_total{outcome="not_migratable",reason="drain"} 1.0' in metrics(
        proxy.url
    )


def test_streams_silent_on_an_instance_that_fails_its_scrapes_fail_over_at_once(
    standins: Any, ferry: Any
) -> None:
    """A frozen process (SIGSTOP, a hung engine core) answers nothing: once its
    scrapes fail, its silent streams move without waiting out the idle timeout."""
    (frozen, a), (_, b) = standins(2, itl_s=0.01)
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={
            "policy": "round_robin",
            "scrape_interval_s": 0.05,
            "scrape_timeout_s": 0.2,
            "unhealthy_after_failures": 2,
        },
        server={"upstream_idle_timeout_s": 60},
    )
    frozen.stall_after, frozen.stall_s = 10, 6.0
    texts: list[str] = []
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=40, stream=True
    )
    reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
    reader.start()
    wait_until(lambda: len(texts) >= 10)
    started = time.monotonic()
    freeze(frozen, 6.0)
    reader.join(10)
    assert "".join(texts) == " tok" * 40
    assert time.monotonic() - started < 5
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)


def freeze(standin: Any, seconds: float) -> None:
    """What a frozen process (SIGSTOP) shows from outside: no answer to anything,
    its scrapes and `/health` included; its open streams go silent too."""
    standin.metrics_delay_s = standin.health_delay_s = seconds


def _frozen_pair(standins: Any, ferry: Any, migration: str) -> tuple[Any, Any, Any]:
    """Two stand-ins behind Ferry, scraped fast enough that a freeze shows in
    well under a second; the first one's answers can be held back."""
    (frozen, a), (_, b) = standins(2, itl_s=0.01)
    proxy = ferry(
        [a.url, b.url],
        instances_migration=migration,
        scheduler={
            "policy": "round_robin",
            "scrape_interval_s": 0.05,
            "scrape_timeout_s": 0.2,
            "unhealthy_after_failures": 2,
        },
    )
    return frozen, a, proxy


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_whole_requests_waiting_on_an_instance_that_fails_its_scrapes_go_elsewhere(
    standins: Any, ferry: Any, migration: str
) -> None:
    """A whole answer comes only at the end: on a frozen instance it would wait
    out upstream_read_timeout_s (600 s). Once the scrapes fail, the wait is given
    up and the request is answered by the other instance; migration is not needed,
    since nothing reached the client."""
    frozen, _, proxy = _frozen_pair(standins, ferry, migration)
    frozen.ttft_s = 8.0  # past the deadline below
    client = api(proxy.url)

    def ask() -> str:
        answer = client.completions.create(model="standin", prompt="hi", max_tokens=5)
        return answer.choices[0].text

    results: list[str] = []
    askers = [threading.Thread(target=lambda: results.append(ask())) for _ in range(2)]
    started = time.monotonic()
    for asker in askers:  # round robin: one each
        asker.start()
    time.sleep(1.2)  # past HUNG_AFTER_S, then the freeze shows in its scrapes
    freeze(frozen, 6.0)
    for asker in askers:
        asker.join(15)
    assert results == [" tok" * 5] * 2
    assert time.monotonic() - started < 5
    assert 'ferry_retries_total{reason="upstream_error"} 1.0' in metrics(proxy.url)


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_requests_on_a_frozen_instance_with_nowhere_else_to_go_wait_for_it(
    standins: Any, ferry: Any, migration: str
) -> None:
    """The other instance of their model down, the calls waiting on the frozen
    one were given up all the same: a 503 each (a stream not yet begun too),
    where the thaw would have answered them, as it does the streams under way.
    (A third instance, healthy, serves another model.)"""
    [(frozen, a)] = standins(1, itl_s=0.01)
    [(_, other)] = standins(1, itl_s=0.01, model="other")
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    proxy = ferry(
        [a.url, dead, other.url],
        instances_migration=migration,
        scheduler={
            "scrape_interval_s": 0.05,
            "scrape_timeout_s": 0.2,
            "unhealthy_after_failures": 2,
        },
    )
    wait_until(
        lambda: (
            proxy.view("i0").healthy and not proxy.view("i1").healthy and proxy.view("i2").healthy
        ),
        timeout=5,
    )
    assert _answers_through_a_freeze(proxy, frozen) == [" tok" * 5] * 2


@pytest.mark.parametrize("leave", ["drain", "remove"])
def test_a_move_to_an_instance_that_freezes_is_given_up_and_the_stream_stays(
    standins: Any, ferry: Any, leave: str
) -> None:
    """A drain's or a removal's move whose destination froze as it was handed
    the stream waited on it, the stream stalled, until the destination thawed
    (or the idle timeout): no other instance took the model, the source leaving.
    The source goes on, so the continuation is given up once the freeze shows,
    and the stream ends where it was."""
    sites = standins(2, itl_s=0.02)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={
            "scrape_interval_s": 0.05,
            "scrape_timeout_s": 0.2,
            "unhealthy_after_failures": 2,
        },
    )
    wait_until(lambda: proxy.view("i0").healthy and proxy.view("i1").healthy)
    texts: list[str] = []
    stream = api(proxy.url).completions.create(
        model="standin", prompt="x", max_tokens=50, stream=True
    )
    started = time.monotonic()
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        if len(texts) == 3:
            name, _ = _busy(sites)
            dest = next(s for n, (s, _) in enumerate(sites) if f"i{n}" != name)
            dest.headers_delay_s = 6.0  # it takes the continuation, and answers nothing
            if leave == "drain":
                _drain(proxy, name)
            else:
                _admin(proxy, f"/admin/instances/{name}?migrate=true", method="DELETE")
            time.sleep(0.2)
            freeze(dest, 6.0)
    assert "".join(texts) == " tok" * 50
    assert time.monotonic() - started < 4.5  # 1 s of tokens and a 1 s wait, not 6
    text = metrics(proxy.url)
    assert 'ferry_migrations_total{outcome="destination_failed",reason="drain"} 1.0' in text


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_requests_on_a_frozen_instance_wait_where_the_other_is_drained_and_ejected(
    standins: Any, ferry: Any, migration: str
) -> None:
    """A draining instance takes what a frozen one cannot answer, where nothing
    else is left; an ejected one takes nothing, so the frozen instance's calls
    wait for its thaw, as they did before draining instances counted."""
    (frozen, a), (flaky, b) = standins(2, itl_s=0.01)
    proxy = ferry(
        [a.url, b.url],
        instances_migration=migration,
        admin_token="t",
        scheduler={
            "policy": "round_robin",
            "scrape_interval_s": 0.05,
            "scrape_timeout_s": 0.2,
            "unhealthy_after_failures": 2,
            "eject_after_failures": 2,
            "eject_base_s": 60.0,
        },
    )
    wait_until(lambda: proxy.view("i0").healthy and proxy.view("i1").healthy)
    flaky.fail_status = 500
    client = api(proxy.url)
    for _ in range(4):  # each answered: i1 fails its share, i0 answers them
        client.completions.create(model="standin", prompt="hi", max_tokens=2)
    wait_until(lambda: proxy.view("i1").ejected)
    flaky.fail_status = None
    _drain(proxy, "i1")
    assert _answers_through_a_freeze(proxy, frozen) == [" tok" * 5] * 2


def _answers_through_a_freeze(proxy: Any, frozen: Any) -> list[str]:
    """A whole answer and a stream asked of `frozen` (i0), which then freezes
    past HUNG_AFTER_S and answers once thawed: what each got."""
    frozen.ttft_s = 3.0  # answers once thawed
    client = api(proxy.url)
    results: list[str] = []

    def ask(stream: bool) -> None:
        if stream:
            chunks = client.completions.create(
                model="standin", prompt="hi", max_tokens=5, stream=True
            )
            results.append("".join(c.choices[0].text for c in chunks))
        else:
            answer = client.completions.create(model="standin", prompt="hi", max_tokens=5)
            results.append(answer.choices[0].text)

    askers = [threading.Thread(target=ask, args=(stream,)) for stream in (False, True)]
    for asker in askers:
        asker.start()
    time.sleep(0.2)
    freeze(frozen, 2.5)  # the scrapes say it froze
    wait_until(lambda: not proxy.view("i0").healthy, timeout=5)
    for asker in askers:
        asker.join(15)
    return results


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_stream_still_waiting_for_its_first_token_on_a_frozen_instance_goes_elsewhere(
    standins: Any, ferry: Any, migration: str
) -> None:
    """vLLM sends a stream's headers at once: a stream queued on an instance that
    then freezes has its headers and no token. It is as hung as one gone silent:
    it fails over (lite), or, since its client has been sent nothing yet (its
    headers wait for the first event), it is sent to the other instance (off)."""
    frozen, _, proxy = _frozen_pair(standins, ferry, migration)
    frozen.ttft_s = 8.0
    started = time.monotonic()
    texts: list[str] = []

    def read() -> None:  # without migration, create() returns with the first event
        stream = api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=10, stream=True
        )
        texts.extend(c.choices[0].text for c in stream)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(1.2)
    freeze(frozen, 6.0)
    reader.join(10)
    assert "".join(texts) == " tok" * 10
    assert time.monotonic() - started < 5
    if migration == "lite":
        assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)
    else:
        assert 'ferry_retries_total{reason="upstream_error"} 1.0' in metrics(proxy.url)


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_stream_under_way_that_cannot_move_ends_soon_after_its_instance_freezes(
    standins: Any, ferry: Any, migration: str
) -> None:
    """A stream that cannot go on elsewhere (no migration; output penalties
    with lite) whose instance freezes mid-way, or shuts down leaving it open and
    silent as vLLM can on SIGTERM, ends with an error event once the freeze
    shows, not `upstream_idle_timeout_s` (60 s) later: its client can retry."""
    frozen, _, proxy = _frozen_pair(standins, ferry, migration)
    # Frozen for 4 s: about 8 times what the scrapes take to show it, and the
    # stand-in's teardown waits it out.
    frozen.stall_after, frozen.stall_s = 3, 4.0
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=10, stream=True, frequency_penalty=0.5
    )
    texts: list[str] = []
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="stopped answering"):
        for chunk in stream:
            texts.append(chunk.choices[0].text)
            if len(texts) == 3:
                freeze(frozen, 4.0)
    assert texts == [" tok"] * 3
    assert time.monotonic() - started < 3.5  # before the freeze ends
    assert 'ferry_requests_total{instance="i0",outcome="stream_broken"} 1.0' in metrics(proxy.url)


def test_a_movable_stream_no_instance_can_start_is_answered_with_an_error_status(
    standins: Any, ferry: Any
) -> None:
    """With migration too, a stream's headers wait for its first bytes: one that
    every instance breaks before its first token was sent nothing, and is
    answered 502 in the OpenAI error shape, which clients retry, rather than
    200 and an error event, which they do not."""
    (a, site_a), (b, site_b) = standins(2, itl_s=0.001)
    a.break_after = b.break_after = 0  # headers, then the connection drops
    proxy = ferry(
        [site_a.url, site_b.url], instances_migration="lite", scheduler={"policy": "round_robin"}
    )
    with pytest.raises(openai.InternalServerError, match="could not resume") as caught:
        api(proxy.url).completions.create(model="standin", prompt="hi", max_tokens=5, stream=True)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "upstream_error"  # type: ignore[index]
    assert a.served + b.served >= 2
    # One that starts on its second instance is whole, its client none the wiser.
    a.break_after = None
    chunks = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=5, stream=True
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 5


def test_a_stream_that_breaks_before_its_first_event_is_sent_elsewhere(
    standins: Any, ferry: Any
) -> None:
    """Without migration, a stream whose instance ends it before any event has
    sent its client nothing: another instance answers it whole, as a call that
    failed before its headers would be."""
    (broken, a), (_, b) = standins(2, itl_s=0.001)
    broken.end_after = 0  # headers, then the end: no event
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin"})
    for _ in range(2):  # at least one tries the broken instance first
        chunks = api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=5, stream=True
        )
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 5
    assert broken.served >= 1
    retried = f'ferry_retries_total{{reason="upstream_error"}} {float(broken.served)}'
    assert retried in metrics(proxy.url)


def test_calls_on_an_instance_whose_scrapes_are_slow_but_which_answers_are_kept(
    standins: Any, ferry: Any
) -> None:
    """A busy engine's `/metrics` can be slower than the scrape timeout, and a
    whole answer shows no progress until it comes: the instance still answers
    `/health`, so its calls keep waiting for it rather than run twice."""
    slow, _, proxy = _frozen_pair(standins, ferry, "off")
    slow.ttft_s = 3.0
    client = api(proxy.url)
    answers: list[str] = []

    def ask() -> None:
        answers.append(
            client.completions.create(model="standin", prompt="hi", max_tokens=1).choices[0].text
        )

    askers = [threading.Thread(target=ask) for _ in range(2)]  # one on each instance
    for asker in askers:
        asker.start()
    time.sleep(0.3)
    slow.metrics_delay_s = 6.0
    for asker in askers:
        asker.join(15)
    assert answers == [" tok"] * 2
    assert not proxy.view("i0").healthy  # its scrapes did fail
    assert "ferry_retries_total{" not in metrics(proxy.url)


@pytest.mark.parametrize("migration", ["off", "lite"])
def test_a_wait_on_an_instance_whose_streams_still_produce_is_kept(
    standins: Any, ferry: Any, migration: str
) -> None:
    """Scrapes that fail while the instance streams tokens say the scrapes are
    the trouble, not the instance: its whole requests keep waiting for it."""
    frozen, _, proxy = _frozen_pair(standins, ferry, migration)
    frozen.itl_s = 0.05
    client = api(proxy.url)
    texts: list[str] = []
    stream = client.completions.create(model="standin", prompt="hi", max_tokens=60, stream=True)
    reader = threading.Thread(target=lambda: texts.extend(c.choices[0].text for c in stream))
    reader.start()
    wait_until(lambda: len(texts) >= 2)
    frozen.ttft_s = 2.5  # slow, not frozen
    answers: list[str] = []
    whole = threading.Thread(
        target=lambda: answers.append(
            client.completions.create(model="standin", prompt="hi", max_tokens=1).choices[0].text
        )
    )
    whole.start()  # round robin: the second request goes to the other instance...
    whole.join(10)
    whole = threading.Thread(
        target=lambda: answers.append(
            client.completions.create(model="standin", prompt="hi", max_tokens=1).choices[0].text
        )
    )
    whole.start()  # ... and the third to the slow one
    time.sleep(1.2)
    frozen.metrics_delay_s = 3.0
    whole.join(10)
    reader.join(10)
    assert answers == [" tok"] * 2 and "".join(texts) == " tok" * 60
    assert "ferry_retries_total{" not in metrics(proxy.url)


def test_a_stalled_stream_without_migration_ends_with_an_error_event(
    standins: Any, ferry: Any
) -> None:
    [(stalled, a)] = standins(1, itl_s=0.001)
    stalled.stall_after = 3
    proxy = ferry([a.url], server={"upstream_idle_timeout_s": 0.5})
    with urllib.request.urlopen(
        urllib.request.Request(
            proxy.url + "/v1/completions",
            data=json.dumps(
                {"model": "standin", "prompt": "x", "max_tokens": 10, "stream": True}
            ).encode(),
            headers={"Content-Type": "application/json"},
        ),
        timeout=10,
    ) as resp:
        body = resp.read().decode()
    events = [e[6:] for e in body.split("\n\n") if e.startswith("data: {")]
    assert len(events) == 4  # three tokens, then the error
    error = json.loads(events[-1])["error"]
    assert "upstream_idle_timeout_s" in error["message"] and error["type"] == "upstream_error"


@pytest.mark.parametrize("trial", range(8))
def test_failover_loses_no_stream_whenever_the_instance_dies(
    trial: int, standins: Any, ferry: Any, loop_thread: Any
) -> None:
    """Twenty streams start over a second; the instance dies at a random moment:
    before some have their first token, as others get it, mid-stream for the rest."""
    rng = random.Random(trial)
    (doomed, a), (_, b) = standins(2, itl_s=0.01, ttft_s=0.05)
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    results: list[str] = []
    errors: list[BaseException] = []

    def one(delay: float) -> None:
        time.sleep(delay)
        try:
            chunks = api(proxy.url).completions.create(
                model="standin", prompt="hi", max_tokens=40, stream=True
            )
            results.append("".join(c.choices[0].text for c in chunks))
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(rng.uniform(0, 1.0),)) for _ in range(20)]
    for t in threads:
        t.start()
    time.sleep(rng.uniform(0.05, 0.9))
    loop_thread.call(doomed.kill)
    for t in threads:
        t.join(60)
    assert not errors
    assert results == [" tok" * 40] * 20


def test_a_move_bills_its_destination_for_the_uncached_tail_only(standins: Any, ferry: Any) -> None:
    from proxy.server import MIGRATOR

    (_, a), (_, b) = standins(2, itl_s=0.05)
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        admin_token="t",
        scheduler={"prefix_credit": True, "migration_prewarm": False},
    )
    received: list[str] = []

    def client() -> None:
        for c in api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=60, stream=True
        ):
            received.append(c.choices[0].text)

    t = threading.Thread(target=client)
    t.start()
    while len(received) < 35:  # 3 prompt ids + 35 generated: two full 16-token blocks
        time.sleep(0.01)
    migrator = proxy.site.app[MIGRATOR]
    prefixes = proxy.cluster.prefixes

    def hold_the_stream_elsewhere() -> tuple[str, str]:
        [stream] = migrator.streams.values()
        source = stream.instance
        dest = "i1" if source == "i0" else "i0"
        ids = stream.splicer.prompt_ids + stream.splicer.generated
        prefixes.record_tokens(dest, ids, 16, 1000)  # as if dest had served them
        return source, dest

    source, dest = proxy.loop.call(hold_the_stream_elsewhere)
    request = urllib.request.Request(
        proxy.url + f"/admin/instances/{source}/drain?migrate=true",
        data=b"",
        method="POST",
        headers={"Authorization": "Bearer t"},
    )
    with urllib.request.urlopen(request, timeout=5) as resp:
        assert json.load(resp)["migrating"] == 1

    def billed_on_dest() -> list[tuple[int, int]]:
        return [(e.prompt_tokens, e.cached_tokens) for e in proxy.cluster.ledger.entries(dest)]

    deadline = time.monotonic() + 5
    while not (billed := proxy.loop.call(billed_on_dest)) and time.monotonic() < deadline:
        time.sleep(0.01)
    # The continuation's P + G is billed there, its two cached blocks as shared.
    [(tokens, cached)] = billed
    assert tokens >= 38 and cached == 32
    assert proxy.loop.call(lambda: proxy.cluster.instance_view(dest).queued_tokens) in (
        0,  # its first token came already
        tokens - 32,
    )
    t.join(30)
    assert "".join(received) == " tok" * 60


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("after", [0, 7])
@pytest.mark.parametrize("how", ["abort", "error"])
def test_a_stream_its_engine_gives_up_resumes_elsewhere(
    how: str, after: int, endpoint: str, standins: Any, ferry: Any
) -> None:
    """An engine that gives a stream up, with finish_reason "abort" or with the 500
    error event vLLM sends when its engine core died, is a broken upstream: the
    stream goes on on the other instance, before its first token too, and the
    client sees neither."""
    (giving_up, a), (healthy, b) = standins(2, itl_s=0.001)
    setattr(giving_up, f"{how}_after", after)
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    if endpoint == "chat":
        chunks = list(
            api(proxy.url).chat.completions.create(
                model="standin", messages=[{"role": "user", "content": "x"}], max_tokens=20,
                stream=True,
            )
        )  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        chunks = list(
            api(proxy.url).completions.create(
                model="standin", prompt="hi", max_tokens=20, stream=True
            )
        )
        text = "".join(c.choices[0].text for c in chunks)
    assert text == " tok" * 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    continued = healthy.seen_bodies[-1]
    if after:  # prompt + generated ids
        assert continued["prompt"] == [1, 2, 3] + [7] * after
    else:  # nothing generated: the request starts over
        assert continued.get("prompt", continued.get("messages")) in (
            "hi",
            [{"role": "user", "content": "x"}],
        )
    assert continued["max_tokens"] == 20 - after
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)


def test_a_client_that_leaves_starts_no_failover(standins: Any, ferry: Any) -> None:
    """Writing to a client that left raises aiohttp's ClientConnectionResetError,
    which is also a ClientConnectionError: it must not pass for a broken upstream."""
    (source, a), (other, b) = standins(2, itl_s=0.02)
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=200, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    stream.close()
    deadline = time.monotonic() + 5
    while source.running and time.monotonic() < deadline:
        time.sleep(0.02)
    assert source.running == 0  # Ferry let the source go
    time.sleep(0.2)
    assert other.seen_bodies == []  # and started no continuation for nobody
    assert 'reason="failover"} 1.0' not in metrics(proxy.url)


def test_a_reused_connection_the_engine_closed_is_sent_again(standins: Any, ferry: Any) -> None:
    """An engine closes an idle keep-alive connection just as Ferry reuses it: the
    request goes again on a new connection, and the instance stays healthy."""
    ((only, a),) = standins(1, itl_s=0.001)
    proxy = ferry([a.url], admin_token="t", scheduler={"policy": "round_robin"})
    for stream in (False, True):
        only.drop_next = 1
        answer = api(proxy.url).completions.create(
            model="standin", prompt="hi", max_tokens=3, stream=stream
        )
        chunks = list(answer) if stream else [answer]  # type: ignore[call-overload]
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 3
    rows = urllib.request.Request(
        proxy.url + "/admin/instances", headers={"Authorization": "Bearer t"}
    )
    with urllib.request.urlopen(rows, timeout=5) as resp:
        [row] = json.loads(resp.read())
    assert row["healthy"] and only.served == 2 and only.drop_next == 0


def _drain(proxy: Any, name: str) -> None:
    _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")


def _busy(sites: list[tuple[Any, Any]]) -> tuple[str, Any]:
    """The name (i0, i1, ...) and stand-in of the one instance running a stream."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        busy = [(f"i{n}", s) for n, (s, _) in enumerate(sites) if s.running]
        if len(busy) == 1:
            return busy[0]
        time.sleep(0.005)
    raise AssertionError("no single instance runs the stream")


def test_a_move_ordered_between_tokens_cuts_right_after_the_next(standins: Any, ferry: Any) -> None:
    """The next token, on its way, reaches the client from the source (relayed
    as it arrives, by the tap) and the cut comes right after it: the
    continuation starts from three tokens, not two and not more (0.4 s apart:
    room for the drain to arrive before the third on a loaded machine, and
    within the 0.5 s a move waits for a next token)."""
    sites = standins(2, itl_s=0.4)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    stream = api(proxy.url).completions.create(
        model="standin", prompt="x", max_tokens=8, temperature=0, stream=True
    )
    texts = []
    for chunk in stream:
        texts.append(chunk.choices[0].text)
        if len(texts) == 2:
            source, _ = _busy(sites)
            _drain(proxy, source)
    assert "".join(texts) == " tok" * 8
    dest = sites[1][0] if source == "i0" else sites[0][0]
    continued = dest.seen_bodies[-1]["prompt"]
    assert continued[: len(PROMPT_IDS)] == PROMPT_IDS
    assert len(continued) - len(PROMPT_IDS) == 3, continued


def test_a_move_ordered_as_the_last_token_comes_keeps_the_usage(standins: Any, ferry: Any) -> None:
    """A move that waits for the stream's next token (a cut right after it) finds
    the generation over: the source's usage chunk, a separate write, still
    reaches the client."""
    sites = standins(2, itl_s=0.2)
    for standin, _ in sites:
        standin.usage_delay_s = 0.3
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    stream = api(proxy.url).chat.completions.create(
        model="standin",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 2:  # two tokens: the last is 0.2 s away
            _drain(proxy, _busy(sites)[0])
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == " tok" * 3
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1 and usage[0].completion_tokens == 3


def test_a_source_lost_after_its_last_token_still_gives_the_usage(
    standins: Any, ferry: Any
) -> None:
    """The source dies between its last token and its usage chunk: the stream is
    over, so nothing resumes, and Ferry sends the usage the client asked for."""
    sites = standins(2, itl_s=0.001)
    for standin, _ in sites:
        standin.break_after = 4  # after a stream's 4th and last token
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
    )
    chunks = _streamed_with_usage(proxy, 4)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 4
    usage = [c.usage for c in chunks if c.usage]
    assert len(usage) == 1
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (3, 4)
    assert sum(len(s.seen_bodies) for s, _ in sites) == 1  # no continuation started


def test_a_client_gone_during_a_move_frees_the_move(standins: Any, ferry: Any) -> None:
    """The client hangs up while its stream's continuation waits for the
    destination's answer: the move ends (its slot is free, its drain round
    done), and neither instance bills the request any longer."""
    sites = standins(2, itl_s=0.02)
    for standin, _ in sites:
        standin.headers_delay_s = 1.0  # a continuation answers late
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    migrator = proxy.site.app[MIGRATOR]
    slots = proxy.loop.call(lambda: migrator.free_slots)
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=200, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    name, source = _busy(sites)
    other = next(s for s, _ in sites if s is not source)
    _drain(proxy, name)
    wait_until(lambda: len(other.seen_bodies) == 1)  # the continuation is on its way
    stream.close()
    wait_until(lambda: proxy.loop.call(lambda: migrator.free_slots) == slots)
    wait_until(lambda: proxy.view("i0").inflight == 0 and proxy.view("i1").inflight == 0)
    assert proxy.loop.call(lambda: migrator.streams) == {}


def _under_way(
    standins: Any, ferry: Any, n: int, prewarm: bool = False
) -> tuple[list[tuple[Any, Any]], Any, Any, Any, str]:
    """`n` stand-ins behind a lite Ferry (round robin, admin token "t") and one
    stream of 300 tokens five tokens in: the stand-ins, Ferry, its migrator, the
    client's stream and the name of the instance it runs on."""
    sites = standins(n, itl_s=0.02)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": prewarm},
    )
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=300, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    name, _ = _busy(sites)
    return sites, proxy, proxy.site.app[MIGRATOR], stream, name


def _admin(
    proxy: Any, path: str, method: str = "POST", changes: dict[str, Any] | None = None
) -> Any:
    """An admin call's answer (its JSON); `changes` are a PATCH's body."""
    body = (
        json.dumps(changes).encode() if changes is not None else b"" if method == "POST" else None
    )
    request = urllib.request.Request(
        proxy.url + path,
        data=body,
        method=method,
        headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.load(answer)


def test_a_move_that_starts_after_its_stream_ended_gives_up_at_once(
    standins: Any, ferry: Any
) -> None:
    """A move waits for a slot (a drain of many streams queues behind
    `migration_max_concurrent`) while its client hangs up. When its turn comes it
    must end at once: nothing is left to answer its order, and a move that waits
    forever holds its slot and its drain round, so no drain would run again."""
    _, proxy, migrator, stream, name = _under_way(standins, ferry, 2)
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    stream.close()
    wait_until(lambda: proxy.loop.call(lambda: migrator.streams) == {})
    other = "i1" if name == "i0" else "i0"

    async def move_now() -> bool:
        return await asyncio.wait_for(migrator.move(live, other, "rebalance"), 2)

    assert proxy.loop.run(move_now()) is False
    assert proxy.loop.call(lambda: live.accepts_orders) is False


def test_a_move_whose_destination_left_while_it_waited_chooses_again(
    standins: Any, ferry: Any
) -> None:
    """A drain or a rebalance plans each move's destination, then the move may wait for a slot;
    an instance removed meanwhile is no destination (it raised KeyError in the
    pre-warm): the move chooses again and the stream goes on there."""
    _, proxy, migrator, stream, name = _under_way(standins, ferry, 3, prewarm=True)
    gone, kept = [f"i{n}" for n in range(3) if f"i{n}" != name]
    _admin(proxy, f"/admin/instances/{gone}", "DELETE")
    wait_until(lambda: gone not in proxy.loop.call(lambda: set(proxy.cluster.instances)))
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    assert proxy.loop.run(migrator.move(live, gone, "rebalance", prewarm=True)) is True
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert proxy.loop.call(lambda: live.instance) == kept


def test_kv_staged_on_a_destination_the_cut_over_passes_by_is_released(
    standins: Any, ferry: Any
) -> None:
    """A full-mode copy staged KV on a destination that stopped being one before
    the cut-over (drained here): the stream goes on elsewhere, and the staged
    blocks are released at once rather than held for the reservation's lease."""
    sites, proxy, migrator, stream, name = _under_way(standins, ferry, 3)
    staged, other = [n for n in range(3) if f"i{n}" != name]
    _admin(proxy, f"/admin/instances/i{staged}/drain")
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    load = {"dest": f"i{staged}", "mig_id": "m1", "num_tokens": 8}

    async def cut_over() -> bool:
        return await live.order_move(f"i{staged}", "drain", load, source_stopped=False)

    assert proxy.loop.run(cut_over()) is True
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert proxy.loop.call(lambda: live.instance) == f"i{other}"
    releases = [p for p, _ in sites[staged][0].answers if p == wire.RELEASE]
    assert releases == [wire.RELEASE]
    assert sites[staged][0].seen_bodies == []  # no continuation went there


def test_kv_staged_for_a_stream_that_ended_is_released(standins: Any, ferry: Any) -> None:
    """A full-mode copy finished after its stream did (the client hung up): the
    order is refused, and the KV staged for it is released, not held for the
    reservation's lease."""
    sites, proxy, migrator, stream, name = _under_way(standins, ferry, 2)
    other = 1 if name == "i0" else 0
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    stream.close()
    wait_until(lambda: proxy.loop.call(lambda: migrator.streams) == {})
    load = {"dest": f"i{other}", "mig_id": "m2", "num_tokens": 8}

    async def order() -> bool:
        return await live.order_move(f"i{other}", "drain", load)

    assert proxy.loop.run(order()) is False
    wait_until(lambda: (wire.RELEASE, 404) in sites[other][0].answers)


def test_a_drain_leaves_the_streams_of_an_instance_whose_migration_was_switched_off(
    standins: Any, ferry: Any
) -> None:
    """`migration: off` set at runtime (an engine whose defaults a continuation
    would not keep, README) stops moves off it: a drain let its streams finish
    in place, where it used to move the ones begun while it was on."""
    _, proxy, _, stream, name = _under_way(standins, ferry, 2)
    patch = urllib.request.Request(
        proxy.url + f"/admin/instances/{name}",
        data=json.dumps({"migration": "off"}).encode(),
        method="PATCH",
        headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
    )
    urllib.request.urlopen(patch, timeout=5).close()
    drain = urllib.request.Request(
        proxy.url + f"/admin/instances/{name}/drain?migrate=true",
        data=b"",
        headers={"Authorization": "Bearer t"},
    )
    with urllib.request.urlopen(drain, timeout=5) as answer:
        assert json.load(answer)["migrating"] == 0
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 0.0' in metrics(proxy.url)


def test_a_drain_with_no_other_instance_in_migration_says_nothing_moves(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A move needs migration on at both ends: with the other instance's off, a
    drain answers that none of its streams will move (it said one was moving),
    and logs why; they finish in place."""
    _, proxy, _, stream, name = _under_way(standins, ferry, 2)
    other = "i1" if name == "i0" else "i0"
    _admin(proxy, f"/admin/instances/{other}", "PATCH", {"migration": "off"})
    with caplog.at_level("WARNING", logger="ferry.migration"):
        assert _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")["migrating"] == 0
    assert "no other instance has migration on" in caplog.text
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 0.0' in metrics(proxy.url)


def test_a_drain_whose_partner_drains_for_now_says_its_streams_may_move(
    standins: Any, ferry: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An instance with migration on that drains (or is unhealthy) for now may
    take the streams later: the drain does not say none will move."""
    _, proxy, _, stream, name = _under_way(standins, ferry, 2)
    other = "i1" if name == "i0" else "i0"
    _admin(proxy, f"/admin/instances/{other}/drain?migrate=true")
    with caplog.at_level("WARNING", logger="ferry.migration"):
        assert _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")["migrating"] == 1
    assert "no other instance has migration on" not in caplog.text
    _admin(proxy, f"/admin/instances/{other}/undrain")
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in metrics(proxy.url)


def test_a_drain_round_that_fails_does_not_end_the_drain(standins: Any, ferry: Any) -> None:
    """A round that raises (a bug, state no check foresaw) loses that round, not
    the drain: the next round moves the stream."""
    _, proxy, migrator, stream, name = _under_way(standins, ferry, 2)
    rounds = migrator._drain_round
    failed: list[int] = []

    def flaky_round() -> None:
        if len(failed) < 2:
            failed.append(1)
            raise KeyError("gone")
        rounds()

    migrator._drain_round = flaky_round
    _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")  # its first round fails
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert len(failed) == 2
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in metrics(proxy.url)


def test_a_stream_whose_move_is_submitted_is_not_planned_again(standins: Any, ferry: Any) -> None:
    """Between a move's submission and its landing (a pre-warm, a queue for a
    slot), planners must not pick the stream again: it would move twice."""
    sites = standins(2, itl_s=0.02)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    migrator = proxy.site.app[MIGRATOR]
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=100, stream=True
    )
    for i, _ in enumerate(stream):
        if i == 5:
            break
    name, _ = _busy(sites)

    async def submit() -> tuple[list[int], list[int], bool]:
        [live] = migrator.streams.values()
        before = [r.id for r in migrator.candidates(name)]
        move = migrator.submit(live, None, "rebalance")
        during = [r.id for r in migrator.candidates(name)]
        return before, during, await move

    before, during, moved = proxy.loop.run(submit())
    assert len(before) == 1 and during == [] and moved
    rest = "".join(c.choices[0].text for c in stream)
    stream.close()
    assert rest == " tok" * 94


def test_a_chat_that_showed_nothing_yet_starts_over_as_a_chat(standins: Any, ferry: Any) -> None:
    """A reasoning model's first token, `<think>`, makes no text: the stream does
    not yet show that it reasons. Broken there, it goes on as the chat it was,
    sent again, not as a completion that would give its thoughts as content."""
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    for standin in (broken, healthy):
        standin.silent_tokens, standin.reasoning_tokens = 1, 4
    broken.break_after = 1
    healthy.served = 5  # (its chunks' ids differ from the source's)
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    chunks = list(
        api(proxy.url).chat.completions.create(
            model="standin", messages=[{"role": "user", "content": "x"}], max_tokens=10, stream=True
        )
    )
    assert healthy.seen_bodies[-1]["messages"] == [{"role": "user", "content": "x"}]
    assert len({c.id for c in chunks}) == 1  # one stream, one id
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thoughts = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    assert thoughts == " tok" * 4
    assert "".join(d.content or "" for d in deltas) == " tok" * 5
    assert 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0' in metrics(proxy.url)


def test_a_reasoning_stream_stays_and_says_why_it_cannot_resume(standins: Any, ferry: Any) -> None:
    """A continuation would give a reasoning model's remaining thoughts as its
    answer: a stream that reasons is not moved, and one that breaks ends with an
    error event that says why, not with thoughts passed off as content."""
    sites = standins(2, itl_s=0.02)
    for standin, _ in sites:
        standin.reasoning_tokens = 50
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin"},
    )
    stream = api(proxy.url).chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "x"}], max_tokens=20, stream=True
    )
    chunks = []
    with pytest.raises(openai.APIError, match="could not resume: failover: reasoning"):
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                name, source = _busy(sites)
                # It stays: the drain said it would move, and nothing said why not.
                drained = _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")
                assert drained["migrating"] == 0, drained
                source.kill()  # and its stream breaks
    assert 3 <= len(chunks) < 20
    assert all(c.choices[0].delta.content is None for c in chunks)  # thoughts, never content
    assert all(s.seen_bodies[-1].get("messages") for s, _ in sites if s.seen_bodies)
    text = metrics(proxy.url)
    assert 'outcome="not_migratable",reason="failover"} 1.0' in text
    assert 'ferry_non_migratable_requests_total{reason="reasoning"} 1.0' in text


def test_a_moved_stream_without_a_budget_keeps_the_one_it_had(standins: Any, ferry: Any) -> None:
    """A continuation is a completion, whose default budget is 16 tokens: it
    says the request's own. A chat without one runs to the end of the context;
    a completion without one stops at 16 tokens, wherever it moved."""
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    for standin in (broken, healthy):
        standin.max_model_len = 40
    broken.break_after = 10
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    client = api(proxy.url)
    chat = client.chat.completions.create(
        model="standin", messages=[{"role": "user", "content": "x"}], stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    assert text == " tok" * 37  # 40 less the prompt's 3
    assert healthy.seen_bodies[-1]["max_tokens"] == 27
    broken.break_after = 5
    broken.served = healthy.served = 0
    completions = []
    while not broken.served:  # round robin: until one lands on `broken`
        completions = list(client.completions.create(model="standin", prompt="x", stream=True))
    assert "".join(c.choices[0].text for c in completions) == " tok" * 16
    assert healthy.seen_bodies[-1]["max_tokens"] == 11


def test_a_moved_stream_keeps_the_budget_its_first_context_trimmed(
    standins: Any, ferry: Any
) -> None:
    """vLLM trims a budget to the context the prompt leaves: 60 tokens asked on
    a context of 40 are 37. Moved to an instance with room for more (50: none
    holds all 60, so the request may start on either), the stream still ends
    at 37, as it would have unmoved (it went on to 47)."""
    (small, a), (big, b) = standins(2, itl_s=0.001)
    small.max_model_len, big.max_model_len = 40, 50
    small.break_after = 10
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    client = api(proxy.url)
    chunks: list[Any] = []
    while not small.served:  # round robin: until one lands on the small one
        chunks = list(
            client.completions.create(model="standin", prompt="x", max_tokens=60, stream=True)
        )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 37
    assert chunks[-1].choices[0].finish_reason == "length"
    assert big.seen_bodies[-1]["max_tokens"] == 27


def test_a_request_goes_where_its_context_holds_the_budget_it_asks(
    standins: Any, ferry: Any
) -> None:
    """Where one instance's context would trim the budget (vLLM answers 37 of
    60 tokens, "length", and no error), the request goes to one that holds it;
    a budget both hold goes to either; with no instance holding it, it is
    served where the policy picks, trimmed."""
    (small, a), (big, b) = standins(2, itl_s=0.0)
    small.max_model_len, big.max_model_len = 40, 4096
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin", "models_refresh_s": 0.2})
    client = api(proxy.url)
    for _ in range(4):
        answer = client.completions.create(model="standin", prompt="x", max_tokens=60)
        assert answer.choices[0].text == " tok" * 60
    assert small.served == 0 and big.served == 4
    for _ in range(4):
        client.completions.create(model="standin", prompt="x", max_tokens=20)
    assert small.served == 2 and big.served == 6
    big.max_model_len = 50  # (seen at the next look at the models)
    wait_until(lambda: proxy.loop.call(proxy.cluster.context_length, "i1", "standin") == 50)
    answers = [
        client.completions.create(model="standin", prompt="x", max_tokens=60) for _ in range(4)
    ]
    assert sorted(a.choices[0].text.count("tok") for a in answers) == [37, 37, 47, 47]


@pytest.mark.parametrize("chat", [False, True])
def test_a_prompt_the_estimate_undercounts_is_counted_where_contexts_differ(
    standins: Any, ferry: Any, chat: bool
) -> None:
    """A prompt of 180 tokens in 360 characters (Chinese text, a small
    vocabulary) was estimated at 120: with a budget of 30 it went where the
    context is 200, and vLLM answered 20 tokens, "length", no error. Where the
    contexts differ and its bytes say it may not fit, an instance counts it."""
    (small, a), (big, b) = standins(2, itl_s=0.0)
    small.max_model_len, big.max_model_len = 200, 4096
    small.words_are_tokens = big.words_are_tokens = True
    proxy = ferry([a.url, b.url], scheduler={"policy": "round_robin", "models_refresh_s": 0.2})
    wait_until(lambda: proxy.loop.call(proxy.cluster.context_length, "i0", "standin") == 200)
    client = api(proxy.url)
    words = "w " * 180
    for _ in range(4):
        if chat:
            messages = [{"role": "user", "content": words}]
            answer = client.chat.completions.create(
                model="standin",
                messages=messages,
                max_tokens=30,  # type: ignore[arg-type]
            )
            assert answer.choices[0].message.content == " tok" * 30
        else:
            text = client.completions.create(model="standin", prompt=words, max_tokens=30)
            assert text.choices[0].text == " tok" * 30
    assert small.served == 0 and big.served == 4
    counted = small.tokenized + big.tokenized
    assert len(counted) == 4 and all(c["model"] == "standin" for c in counted)
    assert all(("messages" in c) == chat for c in counted)
    # A short one may reach no context's end: not counted, placed as ever.
    for _ in range(2):
        client.completions.create(model="standin", prompt="w", max_tokens=5)
    assert small.served == 1 and len(small.tokenized + big.tokenized) == 4
    # One whose budget alone is past the shorter context: no count decides it.
    client.completions.create(model="standin", prompt=words, max_tokens=300)
    assert big.served == 6 and len(small.tokenized + big.tokenized) == 4


def test_a_stream_moves_only_where_its_context_holds_all_it_may_reach(
    standins: Any, ferry: Any
) -> None:
    """Instances of one model with different contexts: a stream that may grow
    to 63 tokens does not go on where the context is 50, which would cut it
    short with a `length` finish."""
    (broken, a), (small, b), (big, c) = standins(3, itl_s=0.001)
    broken.max_model_len, small.max_model_len, big.max_model_len = 4096, 50, 4096
    broken.break_after = 20
    proxy = ferry(
        [a.url, b.url, c.url], instances_migration="lite", scheduler={"policy": "round_robin"}
    )
    client = api(proxy.url)
    for _ in range(3):  # the failover's round-robin turn falls on each in turn
        broken.served = 0
        while not broken.served:  # until one lands on `broken`
            chunks = list(
                client.completions.create(model="standin", prompt="x", max_tokens=60, stream=True)
            )
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 60
        assert chunks[-1].choices[0].finish_reason == "length"
    continued = [s for s in (small, big) for b in s.seen_bodies if isinstance(b["prompt"], list)]
    assert continued == [big] * 3


def test_a_lora_chat_without_a_budget_keeps_its_base_models_room(standins: Any, ferry: Any) -> None:
    """vLLM lists a LoRA adapter's card without `max_model_len`, naming its base
    model as `parent`: the room left is the base model's. Where no card says
    the length, the chat does not move (a continuation would stop at 16)."""
    (broken, a), (healthy, b) = standins(2, model="adapter", itl_s=0.001)
    cards = [
        {"id": "base", "object": "model", "max_model_len": 40},
        {"id": "adapter", "object": "model", "parent": "base", "max_model_len": None},
    ]
    for standin in (broken, healthy):
        standin.max_model_len = 40
        standin.models_body = json.dumps({"object": "list", "data": cards}).encode()
    broken.break_after = 10
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={"policy": "round_robin", "models_refresh_s": 0.1},
    )
    client = api(proxy.url)
    chat = client.chat.completions.create(
        model="adapter", messages=[{"role": "user", "content": "x"}], stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == " tok" * 37
    assert healthy.seen_bodies[-1]["max_tokens"] == 27
    served = healthy.served
    cards[0].pop("max_model_len")  # now no card says the model's length
    for standin in (broken, healthy):
        standin.models_body = json.dumps({"object": "list", "data": cards}).encode()
    wait_until(lambda: all(not state.model_cards[0].get("max_model_len") for state in
                           proxy.cluster.instances.values()))  # fmt: skip
    broken.served, broke = 0, []
    while not broken.served:  # round robin: until one lands on `broken`
        try:
            list(
                client.chat.completions.create(
                    model="adapter", messages=[{"role": "user", "content": "x"}], stream=True
                )
            )
        except openai.APIError as exc:  # said broken, not cut at 10 + 16 as if whole
            broke.append(str(exc))
    assert len(broke) == 1 and "broke the stream" in broke[0]
    assert 'ferry_non_migratable_requests_total{reason="budget unknown"}' in metrics(proxy.url)
    assert healthy.served - served <= 1  # at most its own turn: nothing continued there


def test_a_moved_stream_keeps_its_usage_on_every_chunk(standins: Any, ferry: Any) -> None:
    (broken, a), (_, b) = standins(2, itl_s=0.001)
    broken.break_after = 4
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    chunks = list(
        api(proxy.url).completions.create(
            model="standin",
            prompt="x",
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        )
    )
    tokens = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in tokens) == " tok" * 8
    assert [c.usage.completion_tokens for c in tokens[4:]] == [5, 6, 7, 8]
    assert {c.usage.prompt_tokens for c in tokens[4:]} == {3}


@pytest.mark.parametrize(
    "extra",
    [{"repetition_detection": {"max_pattern_size": 4}}, {"min_tokens": "5"}],
    ids=["uncarried-field", "count-as-string"],
)
def test_a_stream_a_continuation_would_get_wrong_finishes_where_it_is(
    standins: Any, ferry: Any, extra: dict[str, Any]
) -> None:
    """A field the continuation would drop, or a budget it would read otherwise
    than the engine: the drain leaves the stream alone, and it ends whole."""
    sites = standins(2, itl_s=0.01)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin"},
    )
    body = {"model": "standin", "prompt": "x", "max_tokens": 30, "stream": True, **extra}
    chunks = []
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body) as answer:
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 3:
                    _drain(proxy, _busy(sites)[0])
    assert "".join(c["choices"][0]["text"] for c in chunks) == " tok" * 30
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(standin.served for standin, _ in sites) == 1  # never continued elsewhere
    label = "field not carried over" if "repetition_detection" in extra else "min_tokens not"
    assert f'ferry_non_migratable_requests_total{{reason="{label}' in metrics(proxy.url)


@pytest.mark.parametrize("framing", ["crlf", "cr", "nospace"])
def test_a_stream_framed_as_other_servers_frame_it_moves_and_ends_whole(
    standins: Any, ferry: Any, framing: str
) -> None:
    """CRLF line ends and `data:` with no space are SSE too: a movable stream so
    framed is read event by event, moves token-exactly, and ends cleanly."""
    sites = standins(2, itl_s=0.02)
    for standin, _ in sites:
        standin.framing = framing
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        admin_token="t",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    text = ""
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=60, stream=True
    )
    for i, chunk in enumerate(stream):
        text += chunk.choices[0].text
        if i == 5:
            _drain(proxy, _busy(sites)[0])
    assert text == " tok" * 60
    assert 'ferry_migrations_total{outcome="ok",reason="drain"} 1.0' in metrics(proxy.url)


def test_a_move_queued_before_its_stream_failed_over_leaves_it_where_it_went(
    standins: Any, ferry: Any
) -> None:
    """A move waits its turn for a slot; meanwhile the stream broke and went on
    elsewhere by itself. The move was of the stream where it was: it is not
    taken off the healthy instance it went to. And a later full-mode copy is
    not given up as one its failover made moot."""
    sites = standins(3, itl_s=0.02)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin", "migration_prewarm": False,
                   "migration_max_concurrent": 1},
    )  # fmt: skip
    migrator = proxy.site.app[MIGRATOR]
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=100, stream=True
    )
    text = "".join(chunk.choices[0].text for _, chunk in zip(range(5), stream, strict=False))
    name, source = _busy(sites)
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    moot = live.copy_moot

    async def submit_behind_another() -> Any:
        await migrator._slots.acquire(0)  # another move holds the only slot
        return migrator.submit(live, None, "drain")

    queued = proxy.loop.run(submit_behind_another())
    source.kill()  # the stream fails over by itself meanwhile
    wait_until(lambda: proxy.loop.call(lambda: live.instance) != name)
    proxy.loop.call(migrator._slots.release)  # the queued move's turn
    wait_until(lambda: queued.done())
    assert queued.result() is False
    text += "".join(chunk.choices[0].text for chunk in stream)
    assert text == " tok" * 100
    assert [(m["from"], m["reason"]) for m in live.moves] == [(name, "failover")]
    assert moot.is_set() and not live.copy_moot.is_set()


def _a_move_with_staged_kv(
    standins: Any, ferry: Any, itl_s: float, headers_delay_s: float = 0.0
) -> tuple[Any, Any, Any, asyncio.Future[bool]]:
    """A stream under way through Ferry, and a drain move of it ordered with KV
    staged (as full mode would) on the other instance, whose continuation's
    headers come `headers_delay_s` late: the proxy, the stream, the destination
    stand-in and the order's future."""
    sites = standins(2, itl_s=itl_s)
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin", "migration_prewarm": False},
    )
    migrator = proxy.site.app[MIGRATOR]
    stream = api(proxy.url).completions.create(
        model="standin", prompt="hi", max_tokens=100, stream=True
    )
    for _, _chunk in zip(range(3), stream, strict=False):
        pass
    name, _ = _busy(sites)
    other = 1 if name == "i0" else 0
    dest = sites[other][0]
    dest.headers_delay_s = headers_delay_s
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    load = {"dest": f"i{other}", "mig_id": "m7", "num_tokens": 4}

    async def order() -> asyncio.Future[bool]:
        return live.order_move(f"i{other}", "drain", load)

    return proxy, stream, dest, proxy.loop.run(order())


def test_staged_kv_is_freed_when_the_client_leaves_during_the_cut_over(
    standins: Any, ferry: Any
) -> None:
    """The destination of a full-mode move holds the copied KV for the
    continuation; a client gone before it starts frees it at once, not when
    its lease runs out."""
    proxy, stream, dest, _ = _a_move_with_staged_kv(standins, ferry, 0.02, headers_delay_s=3.0)
    wait_until(lambda: len(dest.seen_bodies) == 1)  # the continuation waits for its headers
    stream.close()
    wait_until(lambda: any(path == wire.RELEASE for path, _ in dest.answers), timeout=2)
    wait_until(lambda: proxy.view("i0").inflight == proxy.view("i1").inflight == 0)


def test_staged_kv_is_freed_when_the_client_leaves_before_the_cut(
    standins: Any, ferry: Any
) -> None:
    """A move ordered between two tokens waits for the next one to cut; a client
    gone meanwhile ends the stream before any cut-over began, and the KV copied
    for it is freed too."""
    _, stream, dest, done = _a_move_with_staged_kv(standins, ferry, 0.3)
    stream.close()
    wait_until(lambda: done.done())
    assert done.result() is False and dest.seen_bodies == []  # no continuation began
    wait_until(lambda: any(path == wire.RELEASE for path, _ in dest.answers), timeout=2)


def test_a_finished_stream_leaves_no_cycle_for_the_collector(standins: Any, ferry: Any) -> None:
    """A movable stream whose end came through the tap kept itself (its request
    body, its last chunk) alive in a reference cycle until Python's cyclic
    collector ran: its end, an exception the upstream's reader held, held
    the frames that held the reader. Freed at once now, as without migration."""
    import gc

    from proxy.live_stream import LiveStream

    [(_, site)] = standins(1, itl_s=0.001)
    proxy = ferry([site.url], instances_migration="lite")
    client = api(proxy.url)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            chunks = client.completions.create(
                model="standin", prompt="hi", max_tokens=20, stream=True
            )
            assert "".join(c.choices[0].text for c in chunks) == " tok" * 20
        wait_until(lambda: proxy.view("i0").inflight == 0)
        time.sleep(0.2)  # the handlers have returned
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        cycled = [o for o in gc.garbage if isinstance(o, LiveStream)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert cycled == []


@pytest.mark.parametrize("policy", ["round_robin", "llumnix"])
@pytest.mark.parametrize("healthy", [0, 1, 2])
def test_failover_tries_an_instance_it_has_not_broken_on_before_one_it_has(
    standins: Any, ferry: Any, healthy: int, policy: str
) -> None:
    """Two of three instances break every stream: a failover went back to the
    first one it broke on (i0 -> i2 -> i0), ran out of resumes and failed the
    stream, the healthy one never tried."""
    sites = standins(3, itl_s=0.005)
    for n, (standin, _) in enumerate(sites):
        standin.break_after = None if n == healthy else 3
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": policy, "migration_max_resumes": 2},
    )
    for _ in range(3):  # (llumnix's first pick among equals is random)
        stream = api(proxy.url).completions.create(
            model="standin", prompt="x", max_tokens=30, stream=True
        )
        assert "".join(c.choices[0].text for c in stream) == " tok" * 30


@pytest.mark.parametrize("resumes", [0, 2])
def test_a_source_lost_after_its_last_token_with_no_resume_left_still_ends_whole(
    standins: Any, ferry: Any, resumes: int
) -> None:
    """Nothing is left to resume, so no resume is needed: with none left (none
    allowed, or every one used) the client got an error event in place of its
    usage and [DONE]."""
    sites = standins(3, itl_s=0.001)
    for standin, _ in sites:
        standin.break_after = 2 if resumes else 4  # the last call breaks after the last token
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin", "migration_max_resumes": resumes},
    )
    tokens = 2 * (resumes + 1) if resumes else 4
    chunks = _streamed_with_usage(proxy, tokens)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * tokens
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [tokens]


def test_a_move_does_not_go_to_a_destination_ejected_while_it_waited(
    standins: Any, ferry: Any
) -> None:
    """A drain or a rebalance names each move's destination, then the move may
    wait (a slot, a pre-warm, the next token): one ejected meanwhile took the
    stream anyway, with a healthy third instance free."""
    _, proxy, migrator, stream, name = _under_way(standins, ferry, 3)
    ejected, kept = [f"i{n}" for n in range(3) if f"i{n}" != name]

    def eject() -> bool:
        return any(proxy.cluster.record_call_failure(ejected, "test") for _ in range(10))

    assert proxy.loop.call(eject)
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    assert proxy.loop.run(migrator.move(live, ejected, "rebalance")) is True
    assert proxy.loop.call(lambda: live.instance) == kept
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294


def test_a_drain_called_off_while_its_move_waited_moves_nothing(standins: Any, ferry: Any) -> None:
    """An operator drains, then undrains at once: the move the drain had
    submitted (waiting on its pre-warm) still ran, a migration nobody wanted."""
    sites, proxy, migrator, stream, name = _under_way(standins, ferry, 2, prewarm=True)
    other = "i1" if name == "i0" else "i0"
    sites[int(other[1])][0].headers_delay_s = 0.8  # the pre-warm waits
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")
    assert proxy.loop.call(lambda: bool(migrator._drain_moves))  # waiting on its pre-warm
    _admin(proxy, f"/admin/instances/{name}/undrain")
    assert proxy.loop.run(migrator.move(live, other, "drain", prewarm=False)) is False
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294
    assert proxy.loop.call(lambda: live.instance) == name
    assert not [b for b in sites[int(other[1])][0].seen_bodies if b.get("stream")]


def test_a_seed_sent_as_a_string_moves_on_at_the_join(standins: Any, ferry: Any) -> None:
    """vLLM reads "seed": "42" as 42; the continuation carried "42" as it was,
    and drew the numbers the stream began with (the seed is moved on by the
    tokens generated, so that it does not)."""
    sites = standins(2, itl_s=0.005)
    sites[0][0].break_after = 5
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
    )
    body = {"model": "standin", "prompt": "x", "max_tokens": 20, "stream": True}
    sent = httpx.post(
        proxy.url + "/v1/completions", json={**body, "temperature": 0.8, "seed": "42"}
    )
    assert sent.status_code == 200 and sent.text.count(" tok") == 20
    assert sites[0][0].seen_bodies[-1]["seed"] == 42
    assert sites[1][0].seen_bodies[-1]["seed"] == 47


def test_a_stream_whose_drain_was_called_off_moves_when_drained_again(
    standins: Any, ferry: Any
) -> None:
    """The drain's move, waiting on its pre-warm when the undrain came, was
    counted refused after the undrain had cleared the refusals: drained again
    (or removed), the instance's rounds passed that stream over for good."""
    sites, proxy, migrator, stream, name = _under_way(standins, ferry, 2, prewarm=True)
    other = "i1" if name == "i0" else "i0"
    sites[int(other[1])][0].headers_delay_s = 0.8  # the pre-warm waits
    [live] = proxy.loop.call(lambda: list(migrator.streams.values()))
    _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")
    _admin(proxy, f"/admin/instances/{name}/undrain")
    assert proxy.loop.call(lambda: bool(migrator._drain_moves))  # waiting on its pre-warm
    wait_until(lambda: proxy.loop.call(lambda: not migrator._drain_moves), timeout=5)
    assert proxy.loop.call(lambda: live.instance) == name  # the move was called off
    _admin(proxy, f"/admin/instances/{name}/drain?migrate=true")
    wait_until(lambda: proxy.loop.call(lambda: live.instance) == other, timeout=10)
    assert "".join(c.choices[0].text for c in stream) == " tok" * 294


@pytest.mark.parametrize("done", [True, False], ids=["done", "no-done"])
@pytest.mark.parametrize("moved", [False, True], ids=["unmoved", "moved"])
@pytest.mark.parametrize("usage_with", ["last_choice", "null_choices"])
def test_a_usage_sent_as_other_servers_send_it_reaches_the_client_once_and_whole(
    standins: Any, ferry: Any, usage_with: str, moved: bool, done: bool
) -> None:
    """A server that puts the usage on its last choice's chunk (or with
    `"choices": null`): the client had it twice where no [DONE] came (the
    splicer added its own), and after a move none where one did (the
    continuation's chunks were rebuilt without it). It gets one, counting the
    whole request, as from vLLM."""
    sites = standins(2, itl_s=0.001)
    for standin, _ in sites:
        standin.usage_with, standin.send_done = usage_with, done
    if moved:
        sites[0][0].break_after = 5
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
    )
    chunks = _streamed_with_usage(proxy, 12)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 12
    usage = [
        (u.prompt_tokens, u.completion_tokens, u.total_tokens) for c in chunks if (u := c.usage)
    ]
    assert usage == [(3, 12, 15)]
    moves = 'ferry_migrations_total{outcome="ok",reason="failover"} 1.0'
    assert (moves in metrics(proxy.url)) == moved


def _streamed_with_usage(proxy: Any, max_tokens: int) -> list[Any]:
    """The chunks of a streamed completion through `proxy` that asks for its usage."""
    return list(
        api(proxy.url).completions.create(
            model="standin",
            prompt="x",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
        )
    )


@pytest.mark.parametrize("moved", [False, True], ids=["unmoved", "moved"])
@pytest.mark.parametrize("usage_with", [None, "own_chunk", "last_choice"])
def test_a_finished_stream_its_server_leaves_open_without_done_ends_at_once(
    standins: Any, ferry: Any, usage_with: str | None, moved: bool
) -> None:
    """A movable stream whose server sends no [DONE] and keeps the body open
    after its end (the finish reason, and the usage where asked) waited for
    `upstream_idle_timeout_s`; it ends a moment after, as a relayed one does."""
    sites = standins(2, itl_s=0.001)
    for standin, _ in sites:
        standin.send_done, standin.hold_open_s = False, 5.0
        standin.usage_with = usage_with or "own_chunk"
    if moved:
        sites[0][0].break_after = 3
    proxy = ferry(
        [site.url for _, site in sites],
        instances_migration="lite",
        scheduler={"policy": "round_robin"},
        server={"upstream_idle_timeout_s": 20.0},
    )
    options = {"stream_options": {"include_usage": True}} if usage_with else {}
    began = time.monotonic()
    chunks = list(
        api(proxy.url).completions.create(
            model="standin", prompt="x", max_tokens=6, stream=True, **options
        )
    )
    assert time.monotonic() - began < 4.0  # the grace of a second, not the 5 s held open
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " tok" * 6
    assert [c.usage.completion_tokens for c in chunks if c.usage] == ([6] if usage_with else [])
    last = "i1" if moved else "i0"
    ok = f'ferry_requests_total{{instance="{last}",outcome="ok"}} 1.0'
    wait_until(lambda: ok in metrics(proxy.url))
    wait_until(lambda: proxy.view(last).inflight == 0)


def test_a_continuation_compressed_against_the_ask_is_refused(standins: Any, ferry: Any) -> None:
    """A destination that gzips its stream though asked for identity was taken
    as the stream's new source, and its events, unread, broke it again: the
    continuation is refused there and held against it, and the client told
    the stream could not go on."""
    (source, a), (gzipped, b) = standins(2, itl_s=0.001)
    source.break_after = 4
    gzipped.gzip_stream = True
    proxy = ferry([a.url, b.url], instances_migration="lite", scheduler={"policy": "round_robin"})
    body = {"model": "standin", "prompt": "x", "max_tokens": 12, "stream": True}
    answer = httpx.post(proxy.url + "/v1/completions", json=body, timeout=10)
    events = [e for e in answer.text.split("\n\n") if e]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:4]] == [" tok"] * 4
    assert "could not resume" in events[-2] and events[-1] == "data: [DONE]"
    text = metrics(proxy.url)
    assert 'ferry_migrations_total{outcome="destination_failed",reason="failover"} 1.0' in text
    assert gzipped.served == 1  # asked once, and refused
    wait_until(lambda: proxy.view("i0").inflight == 0 and proxy.view("i1").inflight == 0)

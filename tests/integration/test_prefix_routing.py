"""Prefix locality against stand-in servers (loadtest/standin_server.py, not vLLM):
requests that share a long prefix follow the instance that served it, while
distinct prefixes still spread over the instances; without the credit they don't."""

from __future__ import annotations

import json
import urllib.request
from collections import defaultdict
from typing import Any

from tests.integration.test_proxy import get, post

TOKEN = "prefix-test-token"


def _run(proxy_url: str, groups: int, turns: int) -> dict[int, list[str]]:
    """Group g's turns (sent one after another), and where each went."""
    served: dict[int, list[str]] = defaultdict(list)
    for turn in range(turns):
        for g in range(groups):
            system = f"System prompt {g}: " + f"rule {g} says be brief. " * 60  # ~1.4k chars
            body = {
                "model": "standin",
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"question {turn}"},
                ],
                "max_tokens": 2,
            }
            status, _, headers = post(proxy_url + "/v1/chat/completions", json.dumps(body).encode())
            assert status == 200
            served[g].append(headers["x-ferry-instance"])
    return served


def test_shared_prefixes_follow_their_instance_with_credit(standins: Any, ferry: Any) -> None:
    sites = [site for _, site in standins(3, itl_s=0.001)]
    proxy = ferry(
        [s.url for s in sites],
        scheduler={"prefix_credit": True},
        admin_token=TOKEN,
    )
    served = _run(proxy.url, groups=6, turns=5)
    for where in served.values():
        assert len(set(where)) == 1, where  # every turn of a group on one instance
    # ... and the groups spread: the first turn of each is placed by freeness alone.
    assert len({where[0] for where in served.values()}) >= 2
    status, rows, _ = get(proxy.url + "/admin/instances", {"Authorization": f"Bearer {TOKEN}"})
    assert status == 200
    modes = {row["name"]: row["prefix_index"]["mode"] for row in rows}
    assert set(modes.values()) == {"approximate"}
    assert sum(row["prefix_index"]["text_blocks"] for row in rows) > 0
    exported = metric_lines(proxy.url, "ferry_prefix_index_")
    for row in rows:  # the same in /metrics
        name, held = row["name"], row["prefix_index"]["blocks"]
        assert exported[f'ferry_prefix_index_precise{{instance="{name}"}}'] == 0
        assert exported[f'ferry_prefix_index_blocks{{instance="{name}"}}'] == held


def metric_lines(url: str, prefix: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as answer:
        lines = answer.read().decode().splitlines()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith(prefix)
    }


def test_without_credit_shared_prefixes_scatter(standins: Any, ferry: Any) -> None:
    sites = [site for _, site in standins(3, itl_s=0.001)]
    proxy = ferry([s.url for s in sites], scheduler={"prefix_credit": False}, admin_token=TOKEN)
    served = _run(proxy.url, groups=6, turns=5)
    assert any(len(set(where)) > 1 for where in served.values())
    status, rows, _ = get(proxy.url + "/admin/instances", {"Authorization": f"Bearer {TOKEN}"})
    assert {row["prefix_index"]["mode"] for row in rows} == {"off"}


def test_cache_aware_follows_prefixes(standins: Any, ferry: Any) -> None:
    sites = [site for _, site in standins(3, itl_s=0.001)]
    proxy = ferry([s.url for s in sites], scheduler={"policy": "cache_aware"})
    served = _run(proxy.url, groups=6, turns=4)
    for where in served.values():
        assert len(set(where)) == 1, where


def test_failover_with_the_prefix_index_on(standins: Any, ferry: Any) -> None:
    # The move asks the index where the stream's ids are cached (the stand-in's
    # prompt ids hold no full block, so none): it still lands and finishes.
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    broken.break_after = 10
    proxy = ferry(
        [a.url, b.url],
        instances_migration="lite",
        scheduler={"prefix_credit": True},
    )
    status, body, _ = post(
        proxy.url + "/v1/completions",
        json.dumps({"model": "standin", "prompt": "x" * 500, "max_tokens": 40}).encode(),
    )
    assert status == 200
    for n in range(4):  # some land on the breaking instance and fail over
        data = json.dumps(
            {"model": "standin", "prompt": f"{n}" * 500, "max_tokens": 40, "stream": True}
        ).encode()
        status, body, _ = post(proxy.url + "/v1/completions", data)
        assert status == 200
        events = [e for e in body["raw"].split("\n\n") if e.startswith("data: {")]
        text = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events)
        assert text == " tok" * 40
    assert broken.served > 0 and healthy.served > 0
    status, raw, _ = get(proxy.url + "/metrics")
    assert 'outcome="ok",reason="failover"' in raw["raw"]


def test_long_answers_push_earlier_prompts_out_of_the_index(standins: Any, ferry: Any) -> None:
    """An engine's cache holds answers too: once one request has generated more
    blocks than the stand-in's whole cache (40 blocks of 16 tokens), the prompt
    recorded before it no longer counts as cached there."""
    site = standins(1, itl_s=0.0001, kv_blocks=40)[0][1]
    proxy = ferry([site.url], scheduler={"prefix_credit": True}, admin_token=TOKEN)
    auth = {"Authorization": f"Bearer {TOKEN}"}

    def text_blocks() -> int:
        status, rows, _ = get(proxy.url + "/admin/instances", auth)
        assert status == 200
        return int(rows[0]["prefix_index"]["text_blocks"])

    def ask(prompt: str, max_tokens: int) -> None:
        body = {"model": "standin", "prompt": prompt, "max_tokens": max_tokens}
        status, _, _ = post(proxy.url + "/v1/completions", json.dumps(body).encode())
        assert status == 200

    ask("a long system prompt. " * 40, 1)  # 880 characters: 18 chunks of 48
    assert text_blocks() == 18
    ask("short", 16 * 40)  # 640 tokens: 40 blocks
    assert text_blocks() == 0

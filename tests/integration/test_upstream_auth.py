"""Keyed backends: a per-instance api_key and headers on every call Ferry makes
(stand-in servers that refuse calls without the key, not vLLM)."""

from __future__ import annotations

import json
import urllib.request
from typing import Any

import openai
import pytest

from proxy.config import ConfigError, parse_config
from tests.helpers import Ferry


def config(urls: list[str], **instance: Any) -> Any:
    raw = {
        "instances": [
            {"name": f"i{n}", "url": u, "migration": "lite", **instance} for n, u in enumerate(urls)
        ],
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1, "policy": "round_robin"},
        "admin_token": "t",
    }
    return parse_config(raw, env={"BACKEND_KEY": "sekrit"})


def test_every_call_carries_the_instances_key(standins: Any, loop_thread: Any) -> None:
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    for standin in (broken, healthy):
        standin.api_key = "sekrit"
    broken.break_after = 5  # the continuation must carry the key too
    proxy = Ferry(loop_thread, config([a.url, b.url], api_key="${BACKEND_KEY}"))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="client-key", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["standin"]  # scraped with the key
        chunks = client.completions.create(model="standin", prompt="x", max_tokens=20, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 20
        assert healthy.seen_bodies[-1]["prompt"] == [1, 2, 3] + [7] * 5  # the continuation
        request = urllib.request.Request(
            proxy.url + "/admin/instances", headers={"Authorization": "Bearer t"}
        )
        with urllib.request.urlopen(request, timeout=5) as resp:
            listing = resp.read().decode()
        assert "sekrit" not in listing and json.loads(listing)[0]["healthy"]
        assert "sekrit" not in repr(proxy.cluster.instances["i0"].config)
    finally:
        proxy.close()


def test_headers_map_is_sent_and_a_wrong_key_is_refused(standins: Any, loop_thread: Any) -> None:
    [(standin, a)] = standins(1, itl_s=0.001)
    standin.api_key = "sekrit"
    proxy = Ferry(loop_thread, config([a.url], headers={"Authorization": "Bearer sekrit"}))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        assert client.completions.create(model="standin", prompt="x", max_tokens=2).choices
    finally:
        proxy.close()
    proxy = Ferry(loop_thread, config([a.url], api_key="wrong"))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError):  # never healthy: no instance to serve
            client.completions.create(model="standin", prompt="x", max_tokens=2)
    finally:
        proxy.close()


def test_an_unset_environment_variable_names_its_yaml_path() -> None:
    raw = {"instances": [{"name": "a", "url": "http://h:1", "api_key": "${NOPE}"}]}
    with pytest.raises(ConfigError, match=r"instances\[0\].api_key: environment variable NOPE"):
        parse_config(raw, env={})
    raw = {"instances": [{"name": "a", "url": "http://h:1", "headers": {"X": 3}}]}
    with pytest.raises(ConfigError, match=r"instances\[0\]\.headers"):
        parse_config(raw, env={})

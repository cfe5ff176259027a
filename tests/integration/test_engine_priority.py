"""Priority inside the engine: an instance with `engine_priority: true` (its
server runs vLLM's `--scheduling-policy priority`) is sent Ferry's priority in
the request's `priority` field, continuations included; any other instance is
sent none, since a FCFS vLLM refuses the field (stand-in servers, not vLLM)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from proxy.config import ConfigError, parse_config
from tests.helpers import Ferry, call_json
from tests.integration.test_upstream_auth import config


def sent_priority(client: openai.OpenAI, standin: Any, header: str, **extra: Any) -> Any:
    """The `priority` field the instance got for one stream sent with
    `x-ferry-priority: header` and `extra` in its body (None: no such field)."""
    chunks = client.completions.create(
        model="standin",
        prompt="x",
        max_tokens=3,
        stream=True,
        extra_headers={"x-ferry-priority": header},
        extra_body=extra or None,
    )
    assert "".join(c.choices[0].text for c in chunks) == " tok" * 3
    return standin.seen_bodies[-1].get("priority", None)


def test_the_field_follows_the_instance_setting_changed_at_runtime(
    standins: Any, loop_thread: Any
) -> None:
    [(standin, a)] = standins(1, itl_s=0.001)
    proxy = Ferry(loop_thread, config([a.url]))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        assert sent_priority(client, standin, "high") is None  # off by default
        status, listing = call_json(proxy.url + "/admin/instances", "GET", None, AUTH)
        assert status == 200 and listing[0]["engine_priority"] is False
        status, _ = call_json(
            proxy.url + "/admin/instances/i0", "PATCH", {"engine_priority": True}, AUTH
        )
        assert status == 200
        assert sent_priority(client, standin, "high") == -1  # lower runs first in vLLM
        assert sent_priority(client, standin, "normal") is None  # vLLM's default, 0
        assert sent_priority(client, standin, "low") == 1
        assert sent_priority(client, standin, "high", priority=7) == 7  # the client's own wins
        assert call_json(proxy.url + "/admin/instances", "GET", None, AUTH)[1][0]["engine_priority"]
    finally:
        proxy.close()


def test_a_continuation_carries_the_priority_its_destination_schedules_by(
    standins: Any, loop_thread: Any
) -> None:
    (broken, a), (healthy, b) = standins(2, itl_s=0.001)
    broken.break_after = 5  # the stream resumes on the other instance
    proxy = Ferry(loop_thread, config([a.url, b.url], engine_priority=True))
    try:
        client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="x", max_retries=0)
        chunks = client.completions.create(
            model="standin",
            prompt="x",
            max_tokens=20,
            stream=True,
            extra_headers={"x-ferry-priority": "high"},
        )
        assert "".join(c.choices[0].text for c in chunks) == " tok" * 20
        assert broken.seen_bodies[-1]["priority"] == -1
        continuation = healthy.seen_bodies[-1]
        assert continuation["prompt"] == [1, 2, 3] + [7] * 5
        assert continuation["priority"] == -1
    finally:
        proxy.close()


def test_an_engine_without_the_field_refuses_the_setting() -> None:
    with pytest.raises(ConfigError, match=r"instances\[0\]\.engine_priority"):
        parse_config(
            {
                "instances": [
                    {"name": "a", "url": "http://h:1", "engine": "openai", "engine_priority": True}
                ]
            },  # fmt: skip
            env={},
        )


AUTH = {"Authorization": "Bearer t"}

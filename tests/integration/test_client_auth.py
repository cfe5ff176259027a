"""Client API keys (`api_keys`): Ferry asks its clients for a key, keeps it to
itself, and lets probes and scrapers in without one; against stand-in servers
(not vLLM), through the official `openai` client."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from proxy.config import load_config
from tests.helpers import Ferry, wait_until

KEYS = ["sk-ferry-one", "sk-ferry-two"]


def client(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def complete(url: str, key: str, stream: bool = False) -> str:
    api = client(url, key)
    if stream:
        chunks = api.completions.create(model="standin", prompt="x", max_tokens=3, stream=True)
        return "".join(c.choices[0].text for c in chunks)
    return api.completions.create(model="standin", prompt="x", max_tokens=3).choices[0].text


@pytest.fixture
def keyed(standins: Any, ferry: Any) -> tuple[Any, Any]:
    """Ferry asking for KEYS, in front of an engine keyed with its own key."""
    [(engine, site)] = standins(1)
    engine.api_key = "engine-secret"
    proxy = ferry([site.url], api_keys=KEYS, admin_token="admin")
    # The instance's own key, as an operator gives it (its scrapes need it too).
    patch = httpx.patch(
        proxy.url + "/admin/instances/i0",
        json={"api_key": "engine-secret"},
        headers={"Authorization": "Bearer admin"},
    )
    assert patch.status_code == 200
    # Its models too: a look begun before the patch reads them with no key (a
    # 401) and its load with the key, healthy with no models yet (a 503).
    wait_until(lambda: proxy.view("i0").healthy and proxy.view("i0").models)
    return engine, proxy


def test_a_client_without_a_valid_key_is_refused_in_openais_shape(keyed: tuple[Any, Any]) -> None:
    engine, proxy = keyed
    for key in ("sk-ferry-on", "sk-ferry-one-", "engine-secret", "SK-FERRY-ONE", "sk-ferry-one sk"):
        with pytest.raises(openai.AuthenticationError) as refused:
            complete(proxy.url, key)
        assert refused.value.status_code == 401
        assert refused.value.code == "invalid_api_key"
    # Not a bearer token, or no header at all.
    for headers in ({"Authorization": "Basic c2stZmVycnktb25l"}, {}):
        answer = httpx.post(
            proxy.url + "/v1/completions",
            json={"model": "standin", "prompt": "x"},
            headers=headers,
        )
        assert answer.status_code == 401
        assert answer.json()["error"]["type"] == "authentication_error"
    assert engine.seen_bodies == []  # nothing reached the engine


def test_expect_continue_is_not_said_to_a_client_without_a_valid_key(
    keyed: tuple[Any, Any],
) -> None:
    """aiohttp said `100 Continue` before the key was checked: a client with no
    key was told to upload its body (30 MB here) only to be refused."""
    engine, proxy = keyed
    host, port = proxy.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "standin", "prompt": "x", "max_tokens": 1}).encode()

    def ask(key: str | None, length: int) -> tuple[socket.socket, bytes]:
        client = socket.create_connection((host, int(port)), timeout=5)
        auth = b"" if key is None else b"Authorization: Bearer %s\r\n" % key.encode()
        client.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"%bExpect: 100-continue\r\nContent-Length: %d\r\n\r\n" % (auth, length)
        )
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += client.recv(65536)  # (times out where no answer comes)
        return client, answer

    for key in (None, "sk-wrong"):
        client, answer = ask(key, 30_000_000)
        with client:
            assert answer.startswith(b"HTTP/1.1 401"), answer  # and no 100 before it
            assert b"Connection: close" in answer  # the client may send the body or not
    client, answer = ask(KEYS[0], len(body))
    with client:
        assert answer == b"HTTP/1.1 100 Continue\r\n\r\n"
        client.sendall(body)
        assert client.recv(65536).startswith(b"HTTP/1.1 200")
    assert len(engine.answers) == 1


def test_a_valid_key_is_ferrys_alone_and_the_engine_gets_its_own(keyed: tuple[Any, Any]) -> None:
    engine, proxy = keyed
    assert complete(proxy.url, KEYS[0]) == " tok" * 3
    assert complete(proxy.url, KEYS[1], stream=True) == " tok" * 3
    sent = [h.get("Authorization") for h in engine.seen_headers]
    assert sent and set(sent) == {"Bearer engine-secret"}


def test_every_client_route_asks_for_the_key_and_probes_do_not(keyed: tuple[Any, Any]) -> None:
    _, proxy = keyed
    key = {"Authorization": f"Bearer {KEYS[0]}"}
    for method, path, body in (
        ("GET", "/v1/models", None),
        ("POST", "/v1/embeddings", {"model": "standin", "input": "x"}),
        ("POST", "/tokenize", {"model": "standin", "prompt": "x"}),
        ("POST", "/v1/chat/completions", {"model": "standin", "messages": []}),
        ("GET", "/no/such/route", None),
    ):
        assert httpx.request(method, proxy.url + path, json=body).status_code == 401, path
        assert httpx.request(method, proxy.url + path, json=body, headers=key).status_code != 401
    for path in ("/health", "/livez", "/readyz", "/ping", "/metrics"):
        assert httpx.get(proxy.url + path).status_code == 200, path
    # A header that is not UTF-8 is a wrong key, not a server error, on both.
    raw = {"Authorization": b"Bearer \xff\xfe"}
    for path in ("/v1/models", "/admin/instances"):
        assert httpx.get(proxy.url + path, headers=raw).status_code == 401, path
    # /admin has its own token: a client key does not open it, nor is it asked there.
    assert httpx.get(proxy.url + "/admin/instances", headers=key).status_code == 401
    admin = {"Authorization": "Bearer admin"}
    assert httpx.get(proxy.url + "/admin/instances", headers=admin).status_code == 200


def test_a_clients_key_does_not_reach_an_engine_without_its_own(standins: Any, ferry: Any) -> None:
    [(engine, site)] = standins(1)
    proxy = ferry([site.url], api_keys=KEYS)
    assert complete(proxy.url, KEYS[0]) == " tok" * 3
    assert complete(proxy.url, KEYS[1], stream=True) == " tok" * 3
    assert len(engine.seen_headers) == 2
    assert all("Authorization" not in headers for headers in engine.seen_headers)
    refused = httpx.post(proxy.url + "/v1/completions", json={"model": "standin"})
    assert refused.headers["WWW-Authenticate"] == "Bearer"


def test_without_keys_a_clients_authorization_goes_to_the_engine(standins: Any, ferry: Any) -> None:
    """The default: Ferry asks for no key, and a client may hold the engine's."""
    [(engine, site)] = standins(1)
    proxy = ferry([site.url])
    assert complete(proxy.url, "whatever-the-engine-takes") == " tok" * 3
    assert engine.seen_headers[-1]["Authorization"] == "Bearer whatever-the-engine-takes"


def test_a_reload_rotates_the_keys(standins: Any, loop_thread: Any, tmp_path: Path) -> None:
    [(_, site)] = standins(1)
    path = tmp_path / "ferry.yaml"

    def write(keys: list[str]) -> None:
        instances = [{"name": "i0", "url": site.url}]
        path.write_text(json.dumps({"instances": instances, "api_keys": keys, "admin_token": "a"}))

    write(["old-key"])
    proxy = Ferry(loop_thread, load_config(path, env={}), load=lambda: load_config(path, env={}))
    try:
        assert complete(proxy.url, "old-key") == " tok" * 3
        write(["new-key"])
        reload = httpx.post(proxy.url + "/admin/reload", headers={"Authorization": "Bearer a"})
        assert reload.status_code == 200
        with pytest.raises(openai.AuthenticationError):
            complete(proxy.url, "old-key")
        assert complete(proxy.url, "new-key") == " tok" * 3
    finally:
        proxy.close()

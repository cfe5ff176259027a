"""DNS discovery's pure parts: the difference it applies, the instances it makes,
and its configuration (the resolver itself: tests/integration/test_discovery.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import cast

import pytest
import yaml

from proxy.config import DISCOVERY_KEYS, ConfigError, parse_config
from proxy.discovery import Change, Discovery, diff
from proxy.fleet import Fleet


def test_diff_adds_removes_and_takes_back() -> None:
    assert diff([], [], ["p@a:1", "p@b:1"]) == Change(("p@a:1", "p@b:1"), (), ())
    assert diff(["p@a:1", "p@b:1"], [], ["p@a:1"]) == Change((), (), ("p@b:1",))
    # Already on its way out: not removed twice; wanted again: taken back.
    assert diff(["p@a:1", "p@b:1"], ["p@b:1"], ["p@a:1"]) == Change((), (), ())
    assert diff(["p@a:1", "p@b:1"], ["p@b:1"], ["p@a:1", "p@b:1"]) == Change((), ("p@b:1",), ())
    assert diff(["p@a:1"], [], ["p@a:1"]) == Change((), (), ())


def test_discovered_instances_take_the_template() -> None:
    config = parse_config(
        {
            "instances": [],
            "discovery": [
                {
                    "dns": "vllm-headless.ns.svc.cluster.local",
                    "port": 8000,
                    "migration": "lite",
                    "labels": {"pool": "a"},
                    "api_key": "${KEY}",
                }
            ],
        },
        env={"KEY": "sk-1"},
    )
    (source,) = config.discovery
    assert source.name == "vllm-headless" and source.refresh_s == 10.0
    inst = source.instance("10.0.0.3")
    assert inst.name == "vllm-headless@10.0.0.3:8000" and inst.url == "http://10.0.0.3:8000"
    assert inst.migration == "lite" and inst.labels == {"pool": "a"}
    assert inst.auth_headers() == {"Authorization": "Bearer sk-1"}
    assert source.instance("fd00::7").url == "http://[fd00::7]:8000"
    # Over https its certificate is checked against the name it was found under.
    assert inst.tls_server_name == "vllm-headless.ns.svc.cluster.local"


def test_a_discovery_template_may_name_its_certificate_s_server() -> None:
    raw = {"dns": "vllm.", "port": 8443, "scheme": "https", "tls_server_name": "vllm.example"}
    (source,) = parse_config({"instances": [], "discovery": [raw]}, env={}).discovery
    inst = source.instance("10.0.0.3")
    assert inst.url == "https://10.0.0.3:8443" and inst.tls_server_name == "vllm.example"
    raw.pop("tls_server_name")
    (source,) = parse_config({"instances": [], "discovery": [raw]}, env={}).discovery
    assert source.instance("10.0.0.3").tls_server_name == "vllm"  # no trailing dot


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"dns": "x"}, "discovery[0].port: is required"),
        ({"dns": "x", "port": 0}, "discovery[0].port: must be between 1 and 65535"),
        ({"dns": "x", "port": 1, "scheme": "ftp"}, "discovery[0].scheme: must be one of"),
        ({"dns": "x", "port": 1, "refresh_s": 0}, "discovery[0].refresh_s: must be at least"),
        ({"dns": "x/y", "port": 1}, "discovery[0].dns: must be a DNS name"),
        ({"dns": "x", "port": 1, "name": "a@b"}, "discovery[0].name: must contain no"),
        ({"dns": "x", "port": 1, "migration": "on"}, "discovery[0].migration: must be one of"),
        ({"dns": "x", "port": 1, "url": "http://x"}, "discovery[0].url: unknown key; allowed:"),
    ],
)
def test_discovery_errors_name_the_yaml_path(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_config({"discovery": [entry]}, env={})


def test_a_name_the_resolver_refuses_is_a_failed_resolution(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """getaddrinfo raises UnicodeError, not OSError, for a name its IDNA encoding
    refuses: at start, that ended `ferry serve` with a traceback."""

    async def refuse(host: str, port: int) -> list[str]:
        raise UnicodeError("encoding with 'idna' codec failed")

    (source,) = parse_config({"discovery": [{"dns": "x", "port": 1}]}, env={}).discovery
    # Nothing of the fleet is read when the name did not resolve.
    discovery = Discovery(cast(Fleet, None), (source,), resolver=refuse)
    assert asyncio.run(discovery.refresh(0)) is None
    assert "x did not resolve (encoding with 'idna' codec failed)" in caplog.text


def test_instances_may_be_empty_only_with_discovery() -> None:
    assert parse_config({"discovery": [{"dns": "x", "port": 1}]}, env={}).instances == ()
    with pytest.raises(ConfigError, match="instances: must be a non-empty list"):
        parse_config({"instances": []}, env={})
    with pytest.raises(ConfigError, match=r"discovery\[1\].name: 'x' port 1 is already"):
        parse_config({"discovery": [{"dns": "x", "port": 1}, {"dns": "x.y", "port": 1}]}, env={})


def test_the_documented_example_parses() -> None:
    """configs/example.yaml shows `discovery:` commented out; uncommented, it loads."""
    text = (Path(__file__).resolve().parents[2] / "configs" / "example.yaml").read_text()
    lines = text.splitlines()
    start = lines.index("# discovery:")
    block = []
    for line in lines[start:]:
        if not line.startswith("#"):
            break
        block.append(line[2:])
    raw = yaml.safe_load("\n".join(block))
    (source,) = parse_config(raw, env={}).discovery
    assert source.instance("10.0.0.3").name == "vllm@10.0.0.3:8000"
    assert set(raw["discovery"][0]) == set(DISCOVERY_KEYS) | {"engine", "migration"}

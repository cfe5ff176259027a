from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path
from typing import Any

import pytest

from adapters import ADAPTERS
from proxy import config
from proxy.config import (
    ENGINES,
    ConfigError,
    FerryConfig,
    SchedulerConfig,
    config_from_backends,
    load_config,
    parse_config,
    redacted,
)
from proxy.server import _policy, _policy_changed

ROOT = Path(__file__).parent.parent.parent


def base(**overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"instances": [{"name": "a", "url": "http://127.0.0.1:8001"}]}
    raw.update(overrides)
    return raw


def test_shipped_configs_load() -> None:
    # compose.yaml is Docker Compose's (tests/unit/test_deploy.py checks it).
    for path in sorted(p for p in (ROOT / "configs").glob("*.yaml") if p.name != "compose.yaml"):
        config = load_config(path, env={})
        assert config.instances, path


def test_defaults_and_yaml_off() -> None:
    raw = base(instances=[{"name": "a", "url": "http://h:1", "migration": False}])
    config = parse_config(raw, env={})
    assert config.instances[0].migration == "off"  # YAML 1.1 reads `off` as false
    assert config.scheduler.policy == "llumnix"
    assert config.scheduler.scrape_interval_s <= 0.25
    assert config.admin_token is None
    assert config.scheduler.high_priority_headroom_blocks is None  # 10% of each capacity
    for given, read in ((None, None), (0, 0.0), (12, 12.0)):
        raw = base(scheduler={"high_priority_headroom_blocks": given})
        assert parse_config(raw, env={}).scheduler.high_priority_headroom_blocks == read


def test_tls_settings_go_with_an_https_url_in_any_case() -> None:
    """The scheme is read in any case (aiohttp speaks TLS to HTTPS://)."""
    raw = {"instances": [{"name": "a", "url": "HTTPS://h:1", "tls_server_name": "h.example"}]}
    assert parse_config(raw, env={}).instances[0].tls_server_name == "h.example"


def test_a_client_certificate_that_cannot_be_used_names_its_file(tmp_path: Path) -> None:
    """OpenSSL says only "[SSL] PEM lib": the operator was not told which file."""
    cert = tmp_path / "client.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    raw = {"instances": [{"name": "a", "url": "https://h:1", "tls_cert_file": str(cert)}]}
    with pytest.raises(ConfigError, match=f"{cert} \\(no key file\\): not a PEM certificate"):
        parse_config(raw, env={})


def test_admin_token_from_environment() -> None:
    assert parse_config(base(), env={"FERRY_ADMIN_TOKEN": "s3"}).admin_token == "s3"
    # A secret made from a file (`kubectl create secret --from-file`) ends in a newline.
    with pytest.raises(
        ConfigError, match=r"visible ASCII characters, no spaces \(a trailing newline"
    ):
        parse_config(base(), env={"FERRY_ADMIN_TOKEN": "s3\n"})
    assert (
        parse_config(base(admin_token="yaml"), env={"FERRY_ADMIN_TOKEN": "s3"}).admin_token
        == "yaml"
    )


def test_admin_token_and_redis_url_read_variables_as_instances_do() -> None:
    env = {"TOKEN": "t0k", "REDIS_PASSWORD": "pw"}
    raw = base(admin_token="${TOKEN}", redis_url="redis://:${REDIS_PASSWORD}@h:6379/0")
    config = parse_config(raw, env=env)
    assert config.admin_token == "t0k" and config.redis_url == "redis://:pw@h:6379/0"


def test_client_keys_from_yaml_or_environment() -> None:
    assert parse_config(base(), env={}).api_keys == ()
    assert parse_config(base(), env={"FERRY_API_KEYS": " k1, ,k2 "}).api_keys == ("k1", "k2")
    raw = base(api_keys=["${CLIENT_KEY}", "literal"])
    env = {"CLIENT_KEY": "from-env", "FERRY_API_KEYS": "ignored"}
    assert parse_config(raw, env=env).api_keys == ("from-env", "literal")
    with pytest.raises(ConfigError, match=r"^FERRY_API_KEYS, key 2: must be a key"):
        parse_config(base(), env={"FERRY_API_KEYS": "k1,a b"})
    assert "from-env" not in repr(parse_config(raw, env=env))  # not in logs by accident


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (base(api_keys="k1"), r"^api_keys: must be a non-empty list of strings"),
        (base(api_keys=[]), r"^api_keys: must be a non-empty list of strings"),
        (base(api_keys=["k1", 7]), r"^api_keys\[1\]: must be a string"),
        (base(api_keys=[""]), r"^api_keys\[0\]: must be a key: visible ASCII"),
        (base(api_keys=["a key"]), r"^api_keys\[0\]: must be a key: visible ASCII"),
        (base(api_keys=["k\n"]), r"^api_keys\[0\]: must be a key: visible ASCII"),
        (base(api_keys=["${NOPE}"]), r"^api_keys\[0\]: environment variable NOPE is not set"),
        (base(api_keys=None), r"^api_keys: must be a non-empty list of strings"),
        *(
            (
                base(instances=[{"name": name, "url": "http://h:1"}]),
                r"^instances\[0\]\.name: must be",
            )
            for name in ("", "a/b", "a b", "a\nb", "\ud800", "é", ".", "..", 7)
        ),
        *(
            (base(instances=[{"name": "a", "url": url}]), r"^instances\[0\]\.url: must be an http")
            for url in (
                "http://user:pw@h:1",
                "http://h:1/?q=1",
                "http://h:1/#f",
                "http://h:1\n",
                " http://h:1",
                "ftp://h:1",
            )
        ),
        (
            base(
                instances=[{"name": "a", "url": "http://h:1", "headers": {"Content-Length": "1"}}]
            ),
            r"^instances\[0\]\.headers: 'Content-Length' is the HTTP client's to set",
        ),
        (base(instances=[{"url": "http://h:1"}]), r"^instances\[0\]\.name: is required"),
        (base(instances=[{"name": "a", "url": "h:1"}]), r"^instances\[0\]\.url: must be an http"),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "engine": "tgi"}]),
            r"^instances\[0\]\.engine: must be one of vllm, openai \(got 'tgi'\)",
        ),
        (
            base(
                instances=[
                    {"name": "a", "url": "http://h:1", "engine": "openai", "migration": "lite"}
                ]
            ),
            r"^instances\[0\]\.migration: must be off for engine openai \(got 'lite'\)",
        ),
        (
            base(
                instances=[
                    {"name": "a", "url": "http://h:1", "engine": "openai", "migration": "full"}
                ]
            ),
            r"^instances\[0\]\.migration: must be off for engine openai \(got 'full'\)",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "migration": "on"}]),
            r"^instances\[0\]\.migration: must be one of off, lite, full \(got 'on'\)",
        ),
        (
            base(
                instances=[{"name": "a", "url": "http://h:1"}, {"name": "a", "url": "http://h:2"}]
            ),
            r"^instances\[1\]\.name: duplicate",
        ),
        (
            base(
                instances=[{"name": "a", "url": "http://h:1"}, {"name": "b", "url": "http://h:1/"}]
            ),
            r"^instances\[1\]\.url: the server of instance 'a'",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "weight": 2}]),
            r"^instances\[0\]\.weight: unknown key; allowed: api_key, engine, engine_priority,"
            r" headers, kv_events, kv_events_replay, labels, migration, name, tls_ca_file,"
            r" tls_cert_file, tls_key_file, tls_server_name, tls_verify, url",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "kv_events": "tcp://*:5557"}]),
            r"^instances\[0\]\.kv_events: must be tcp://HOST:PORT .* \(got 'tcp://\*:5557'\)",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "kv_events": "tcp://h:70000"}]),
            r"^instances\[0\]\.kv_events: must be tcp://HOST:PORT",
        ),
        (
            base(
                instances=[
                    {
                        "name": "a",
                        "url": "http://h:1",
                        "kv_events": "tcp://h:1",
                        "kv_events_replay": "h:2",
                    }
                ]
            ),
            r"^instances\[0\]\.kv_events_replay: must be tcp://HOST:PORT",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "kv_events_replay": "tcp://h:2"}]),
            r"^instances\[0\]\.kv_events_replay: needs instances\[0\]\.kv_events",
        ),
        (
            base(
                instances=[
                    {"name": "a", "url": "http://h:1", "engine": "openai", "kv_events": "tcp://h:1"}
                ]
            ),
            r"^instances\[0\]\.kv_events: must be unset for engine openai",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "kv_events": 5557}]),
            r"^instances\[0\]\.kv_events: must be str \| None",
        ),
        (
            base(scheduler={"policy": "fastest"}),
            r"^scheduler\.policy: must be one of cache_aware, least_kv, least_requests, llumnix",
        ),
        (
            base(scheduler={"scrape_interval_s": "fast"}),
            r"^scheduler\.scrape_interval_s: must be float",
        ),
        (
            base(scheduler={"scrape_interval_s": 0}),
            r"^scheduler\.scrape_interval_s: must be between",
        ),
        (base(scheduler={"topk": 0}), r"^scheduler\.topk: must be at least 1"),
        (base(scheduler={"cache_threshold": 1.5}), r"^scheduler\.cache_threshold: must be between"),
        (
            base(scheduler={"prefix_safe_freeness": -1.0}),
            r"^scheduler\.prefix_safe_freeness: must be a finite",
        ),
        (
            base(scheduler={"balance_rel_threshold": 0.5}),
            r"^scheduler\.balance_rel_threshold: must be a finite number, 1 or more",
        ),
        (
            base(scheduler={"prefix_crowd_factor": 0.5}),
            r"^scheduler\.prefix_crowd_factor: must be a finite number, 1 or more",
        ),
        (
            base(scheduler={"prefix_crowd_grace": -1}),
            r"^scheduler\.prefix_crowd_grace: must be a finite number, 0 or more",
        ),
        (base(scheduler={"prefix_credit": 1}), r"^scheduler\.prefix_credit: must be bool"),
        (
            base(scheduler={"migration_stalled_after_s": -0.1}),
            r"^scheduler\.migration_stalled_after_s: must not be negative",
        ),
        (
            base(scheduler={"high_priority_headroom_blocks": -1}),
            r"^scheduler\.high_priority_headroom_blocks: must not be negative",
        ),
        (
            base(scheduler={"high_priority_headroom_blocks": "10%"}),
            r"^scheduler\.high_priority_headroom_blocks: must be float \| None",
        ),
        (base(server={"port": True}), r"^server\.port: must be int"),
        (base(server={"port": 70000}), r"^server\.port: must be between"),
        (base(serverr={}), r"^serverr: unknown key"),
        (base(scheduler=[1]), r"^scheduler: must be a mapping"),
        (base(redis_url="http://h:6379"), r"^redis_url: must be a redis://, rediss:// or unix://"),
        (base(redis_url=6379), r"^redis_url: must be a redis://"),
        (base(redis_url="redis://[::1"), r"^redis_url: not a URL \(Invalid IPv6 URL"),
        (base(redis_url="redis://h:99999"), r"^redis_url: not a URL \(Port out of range"),
        (base(redis_url="redis://${NOT_SET_ANYWHERE}"), r"^redis_url: environment variable"),
        (
            {"instances": [], "discovery": [{"dns": "v.svc", "port": 80, "name": "p" * 65}]},
            r"^discovery\[0\]\.name: .*at most 64 characters",
        ),
        (
            {"discovery": [{"dns": "pods..test", "port": 80}]},
            r"^discovery\[0\]\.dns: 'pods\.\.test' has an empty label",
        ),
        (
            {"discovery": [{"dns": f"pods.{'a' * 64}.svc", "port": 80}]},
            r"^discovery\[0\]\.dns: label 'a+' is 64 characters \(at most 63\)",
        ),
        (
            {"discovery": [{"dns": "pods." + "\u00fc" * 60 + ".svc", "port": 80}]},
            r"^discovery\[0\]\.dns: 'pods\.\u00fc+\.svc' is no DNS name the resolver takes",
        ),
        (
            {"discovery": [{"dns": ".".join(["a" * 63] * 4), "port": 80}]},
            r"^discovery\[0\]\.dns: 'a+\.a+\.a+\.a+' is 255 characters \(at most 253\)",
        ),
        (
            {"instances": [{"name": "n" * 129, "url": "http://h:1"}]},
            r"^instances\[0\]\.name: .*at most 128 characters",
        ),
        (
            base(redis_url="redis://h:6379/abc"),
            r"^redis_url: the path names the database by number",
        ),
        (  # digits to str.isdigit, not to int()
            base(redis_url="redis://h:6379/\u00b2"),
            r"^redis_url: the path names the database by number",
        ),
        # redis-py refused it as the process started: a traceback, exit 1.
        (
            base(redis_url="redis://:s3cret@h:6379/0?socket_timeout=abc"),
            r"^redis_url: Invalid value for 'socket_timeout' .*got 'redis://:\*\*\*@h:6379",
        ),
        (base(server={"workers": 0}), r"^server\.workers: must be at least 1"),
        (
            base(server={"workers": 4}),
            r"^server\.workers: 4 processes need a shared cluster view: set redis_url",
        ),
        (
            base(redis_url="redis://h", server={"workers": 2, "port": 0}),
            r"^server\.port: must be named \(not 0\) with several workers",
        ),
        (
            base(sharing={"publish_interval_s": 2}),
            r"^sharing\.publish_interval_s: must be between 0\.01 and 1",
        ),
        (
            base(sharing={"publish_interval_s": 0.1, "ttl_s": 0.2}),
            r"^sharing\.ttl_s: must be between 3 x sharing\.publish_interval_s \(0\.3 s",
        ),
        (base(sharing={"lease_ttl_s": 0.1}), r"^sharing\.lease_ttl_s: must be between 3 x"),
        # Redis refused it at the first publish: the process exited 1, not 2.
        (base(sharing={"ttl_s": 1e20}), r"^sharing\.ttl_s: must be between .* and 86400 s"),
        (base(sharing={"key_prefix": "a b"}), r"^sharing\.key_prefix: must be letters"),
        (
            base(sharing={"change_interval_s": 0.1}),
            r"^sharing\.change_interval_s: must be between 0 and sharing\.publish_interval_s",
        ),
        (base(sharing={"ttl": 1}), r"^sharing\.ttl: unknown key"),
        (
            base(instances=[{"name": "a", "url": "http://[::1"}]),
            r"^instances\[0\]\.url: must be an http",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:99999"}]),
            r"^instances\[0\]\.url: must be an http",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "headers": {"X-Team": "a\nb"}}]),
            r"^instances\[0\]\.headers\.X-Team: must not contain control characters",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "headers": {"X Team": "a"}}]),
            r"^instances\[0\]\.headers: 'X Team' is not a header name",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "api_key": "k\r"}]),
            r"^instances\[0\]\.api_key: must not contain control characters",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "api_key": "k" * 200_000}]),
            r"^instances\[0\]\.api_key: 200000 bytes, over 8000",
        ),
        (
            base(instances=[{"name": "a", "url": "http://h:1", "headers": {"X-T": "é" * 4001}}]),
            r"^instances\[0\]\.headers\.X-T: 8002 bytes, over 8000",
        ),
        (
            base(server={"upstream_idle_timeout_s": math.nan}),
            r"^server\.upstream_idle_timeout_s: must be a finite",
        ),
        (
            base(scheduler={"rebalance_interval_s": math.inf}),
            r"^scheduler\.rebalance_interval_s: must be a fin",
        ),
        (
            base(scheduler={"rebalance_interval_s": 1e-300}),
            r"^scheduler\.rebalance_interval_s: must be 0 \(off\) or at least 0\.01",
        ),
        (
            base(scheduler={"scrape_timeout_s": 1e-300}),
            r"^scheduler\.scrape_timeout_s, models_refresh_s: must be at least 0\.01",
        ),
        (
            base(server={"worker_timeout_s": 1}),
            r"^server\.worker_timeout_s: must be 0 \(never\) or between 3 and",
        ),
        (
            base(scheduler={"high_priority_headroom_blocks": 10**400}),
            r"^scheduler\.high_priority_headroom_blocks: must be a finite number",
        ),
        # An empty host listened on every interface, unsaid; a bad name was a traceback.
        (base(server={"host": ""}), r"^server\.host: must be an address, a host name, or \*"),
        (base(server={"host": "ferry..internal"}), r"^server\.host: 'ferry\.\.internal' has"),
        # TLS settings on a plain http:// instance were ignored: it spoke plain text.
        (
            {"instances": [{"name": "a", "url": "http://h:1", "tls_verify": False}]},
            r"^instances\[0\]\.tls_verify: the instance's url is not https://",
        ),
    ],
)
def test_errors_name_the_yaml_path(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(raw, env={})


def test_a_discovery_name_may_end_in_a_dot_and_have_long_labels() -> None:
    for dns in ("vllm.ns.svc.", f"{'a' * 63}.svc", "pods.\u00fcber.test"):
        (source,) = parse_config({"discovery": [{"dns": dns, "port": 80}]}, env={}).discovery
        assert source.dns == dns


def test_sharing_is_off_unless_a_redis_url_is_given() -> None:
    alone = parse_config(base(), env={})
    assert alone.redis_url is None and alone.server.workers == 1
    shared = parse_config(base(redis_url="redis://r:6379/2", server={"workers": 4}), env={})
    assert shared.redis_url == "redis://r:6379/2" and shared.server.workers == 4
    assert shared.sharing.publish_interval_s == 0.05 and shared.sharing.key_prefix == "ferry"
    assert shared.sharing.fleet_log_length == 1000
    for length in (0, 10**20):  # (Redis refused the second at the first change)
        with pytest.raises(ConfigError, match=r"^sharing\.fleet_log_length: must be between 1"):
            parse_config(base(sharing={"fleet_log_length": length}), env={})


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("instances: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_bytes(b"# caf\xe9 in Latin-1\ninstances: []\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)
    bad.write_text("a: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match="nested too deeply"):
        load_config(bad)


def test_a_secret_with_a_trailing_newline_is_named() -> None:
    raw = base(instances=[{"name": "a", "url": "http://h:1", "api_key": "${GPU_KEY}"}])
    with pytest.raises(ConfigError, match=r"^instances\[0\]\.api_key: .*trailing newline"):
        parse_config(raw, env={"GPU_KEY": "secret\n"})
    assert parse_config(raw, env={"GPU_KEY": "secret"}).instances[0].api_key == "secret"


def test_addresses_read_the_environment() -> None:
    inst = {
        "name": "a",
        "url": "http://${GPU_HOST}:${GPU_PORT}",
        "kv_events": "tcp://${GPU_HOST}:5557",
    }
    env = {"GPU_HOST": "10.0.0.7", "GPU_PORT": "8000"}
    [parsed] = parse_config(base(instances=[inst]), env=env).instances
    assert (parsed.url, parsed.kv_events) == ("http://10.0.0.7:8000", "tcp://10.0.0.7:5557")
    with pytest.raises(ConfigError, match=r"^instances\[0\]\.url: environment variable GPU_PORT"):
        parse_config(base(instances=[inst]), env={"GPU_HOST": "h"})
    # What the variable holds is checked as a URL is; the error quotes the URL
    # as written (the admin API answers with it, and a variable may hold a secret).
    with pytest.raises(
        ConfigError, match=r"^instances\[0\]\.url: must be an http\(s\) base URL"
    ) as err:
        parse_config(base(instances=[inst]), env={**env, "GPU_PORT": "8000/v1?key=s3cret"})
    assert "s3cret" not in str(err.value) and "${GPU_PORT}" in str(err.value)


def test_quick_start_names_backends_by_host_port() -> None:
    config = config_from_backends(
        ["http://127.0.0.1:8001", "http://10.0.0.2:9000/"], policy="least_kv"
    )
    assert [i.name for i in config.instances] == ["127.0.0.1:8001", "10.0.0.2:9000"]
    # A broken stream goes on elsewhere without a YAML file.
    assert {i.migration for i in config.instances} == {"lite"}
    assert config.scheduler.policy == "least_kv"


def test_instance_defaults_fill_what_an_instance_does_not_say() -> None:
    """In the YAML list, in a discovery entry, and in the quick start (whose
    instances then say nothing of migration, so one added later moves too)."""
    raw = base(
        instance_defaults={"migration": "lite", "labels": {"zone": "a"}},
        instances=[
            {"name": "a", "url": "http://h:1"},
            {"name": "b", "url": "http://h:2", "migration": False, "labels": {}},
        ],
        discovery=[{"dns": "vllm.svc", "port": 8000, "engine_priority": True}],
    )
    config = parse_config(raw, env={})
    a, b = config.instances
    assert (a.migration, a.labels) == ("lite", {"zone": "a"})
    assert (b.migration, b.labels) == ("off", {})  # its own replace the defaults
    template = config.discovery[0].template
    assert template is not None and template.migration == "lite" and template.engine_priority
    # A default an engine cannot take is not its: an OpenAI-compatible server
    # in a fleet that moves streams (or schedules by priority) does neither.
    mixed = base(
        instance_defaults={"migration": "lite", "engine_priority": True},
        instances=[{"name": "o", "url": "http://h:3", "engine": "openai"}],
        discovery=[{"dns": "other.svc", "port": 8080, "engine": "openai"}],
    )
    parsed = parse_config(mixed, env={})
    (other,) = parsed.instances
    assert (other.migration, other.engine_priority) == ("off", False)
    found = parsed.discovery[0].template
    assert found is not None and (found.migration, found.engine_priority) == ("off", False)
    mixed["instances"][0]["migration"] = "lite"  # said by the instance itself: an error
    with pytest.raises(ConfigError, match=r"instances\[0\].migration: must be off"):
        parse_config(mixed, env={})
    quick = config_from_backends(["http://h:1"])
    assert quick.instance_defaults == {"migration": "lite"}
    assert quick.instances[0].migration == "lite"
    for defaults, message in (
        ({"url": "http://x"}, "instance_defaults.url: unknown key"),
        ({"migration": "on"}, "instance_defaults.migration: must be one of"),
        ([1], "instance_defaults: must be a mapping"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_config(base(instance_defaults=defaults), env={})


def test_the_example_config_loads() -> None:
    config = load_config(Path(__file__).parent.parent.parent / "configs" / "example.yaml")
    assert config.instances[0].auth_headers() == {"X-Team": "serving"}


@pytest.mark.parametrize(
    "settings",
    [
        config.InstanceConfig,
        config.DiscoveryConfig,
        config.SchedulerConfig,
        config.ServerConfig,
        config.SharingConfig,
        config.FerryConfig,
    ],
)
def test_the_example_config_names_every_setting(settings: type) -> None:
    """configs/example.yaml says it lists every setting (set, or commented out):
    `tls_server_name` was missing from it."""
    text = (Path(__file__).parent.parent.parent / "configs" / "example.yaml").read_text()
    named = set(re.findall(r"^[\s#-]*([a-z_0-9]+):", text, re.MULTILINE))
    missing = {f.name for f in dataclasses.fields(settings)} - named - {"template"}
    assert not missing


def test_engines_come_from_the_adapter_registry() -> None:
    assert ENGINES == tuple(ADAPTERS) == ("vllm", "openai")
    raw = base(
        instances=[{"name": "a", "url": "http://h:1", "engine": "openai", "migration": False}]
    )
    (instance,) = parse_config(raw, env={}).instances
    assert (instance.engine, instance.migration) == ("openai", "off")
    assert parse_config(base(), env={}).instances[0].engine == "vllm"  # the default


def test_kv_events_endpoints_are_kept() -> None:
    config = parse_config(
        {
            "instances": [
                {
                    "name": "a",
                    "url": "http://h:1",
                    "kv_events": "tcp://10.0.0.7:5557",
                    "kv_events_replay": "tcp://[::1]:5558",
                },
                {"name": "b", "url": "http://h:2", "kv_events": "ipc:///run/vllm-events"},
            ]
        },
        env={},
    )
    a, b = config.instances
    assert (a.kv_events, a.kv_events_replay) == ("tcp://10.0.0.7:5557", "tcp://[::1]:5558")
    assert (b.kv_events, b.kv_events_replay) == ("ipc:///run/vllm-events", None)


def test_retired_scheduler_keys_load_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    raw = base(scheduler={"prefix_weight": 2.0, "prefix_free_enough_blocks": 8.0, "topk": 2})
    with caplog.at_level("WARNING", logger="ferry.config"):
        config = parse_config(raw, env={})
    assert config.scheduler.topk == 2  # the rest of the section still applies
    assert "scheduler.prefix_free_enough_blocks: ignored" in caplog.text
    assert "scheduler.prefix_weight: ignored" in caplog.text


def test_the_crowd_bound_reaches_the_policy_and_a_change_rebuilds_it() -> None:
    loose = SchedulerConfig(prefix_crowd_factor=3.0, prefix_crowd_grace=8.0)
    policy = _policy(loose)
    assert (policy.crowd_factor, policy.crowd_grace) == (3.0, 8.0)  # type: ignore[attr-defined]
    assert _policy_changed(loose, SchedulerConfig())
    assert not _policy_changed(loose, SchedulerConfig(prefix_crowd_factor=3, prefix_crowd_grace=8))


def test_one_url_with_another_rank_header_is_another_instance() -> None:
    """vLLM's data-parallel ranks behind one API server: routed to by header."""
    ranks = [
        {"name": f"r{n}", "url": "http://h:1", "headers": {"X-data-parallel-rank": str(n)}}
        for n in range(2)
    ]
    assert [i.name for i in parse_config(base(instances=ranks)).instances] == ["r0", "r1"]


def test_a_yaml_alias_bomb_is_refused_in_a_short_message(tmp_path: Path) -> None:
    """Nine levels of aliases are 500 bytes of YAML that repr() made gigabytes
    of, on the event loop when a reload read it."""
    items = ["    - &a0 [x, x, x, x, x, x, x, x, x, x]"]
    items += [f"    - &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    instances = "instances: [{name: a, url: 'http://h:1'}]"
    path.write_text("\n".join([instances, "server:", "  port:", *items]) + "\n")
    with pytest.raises(ConfigError, match="server.port: must be int") as caught:
        load_config(path)
    assert len(str(caught.value)) < 500


def load_yaml(tmp_path: Path, text: str) -> FerryConfig:
    """`text` as a config file, loaded."""
    path = tmp_path / "f.yaml"
    path.write_text(text)
    return load_config(path)


@pytest.mark.parametrize(
    "text",
    [
        "instances: [{name: a, url: 'http://h:1'}]\ninstances: [{name: b, url: 'http://h:2'}]\n",
        "instances:\n  - name: a\n    url: http://h:1\n    url: http://h:2\n",
    ],
)
def test_a_key_written_twice_is_refused_not_the_last_one_kept(text: str, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"(?s)key '(instances|url)' is written first.*line [13].*and again.*line [24]",
    ):
        load_yaml(tmp_path, text)


@pytest.mark.parametrize(
    "text",
    [
        "instances:\n  - name: a\n    url: http://h:1\n    api_key: OLD-SECRET\n"
        "    api_key: NEW-SECRET\n",
        "admin_token: 'ADMIN-SECRET\ninstances: []\n",
        'api_keys: ["CLIENT-SECRET", "OTHER-SECRET]\ninstances: []\n',
        "api_keys:\n\t- CLIENT-SECRET\ninstances: []\n",
    ],
    ids=["twice", "unclosed-quote", "unclosed-list", "tab"],
)
def test_a_yaml_mistake_says_where_without_quoting_the_file(text: str, tmp_path: Path) -> None:
    """PyYAML quotes the lines around a mistake: the error (in the log, and in
    a refused reload's answer) would carry the keys on them."""
    with pytest.raises(ConfigError, match=r"not valid YAML: .*line \d+, column \d+") as refused:
        load_yaml(tmp_path, text)
    assert "SECRET" not in str(refused.value)


@pytest.mark.parametrize("key", [98765432109876, ["SECRET-IN-A-LIST"], {"k": "SECRET"}])
def test_a_mistyped_instance_key_is_not_repeated(key: Any) -> None:
    for where, raw in (
        (
            "instances[0].api_key",
            {"instances": [{"name": "a", "url": "http://h:1", "api_key": key}]},
        ),
        ("instance_defaults.api_key", {"instance_defaults": {"api_key": key}, "instances": []}),
    ):
        with pytest.raises(ConfigError, match=f"^{re.escape(where)}: must be str") as refused:
            parse_config(raw, env={})
        assert "SECRET" not in str(refused.value) and "98765" not in str(refused.value)


@pytest.mark.parametrize(
    "url", ["redis://:SE/CRET@h:6379/0", {"password": "SECRET"}], ids=["slash", "mapping"]
)
def test_a_redis_url_refused_does_not_show_its_password(url: Any) -> None:
    raw = {"instances": [{"name": "a", "url": "http://h:1"}], "redis_url": url}
    with pytest.raises(ConfigError, match="^redis_url: ") as refused:
        parse_config(raw, env={})
    assert "SECRET" not in str(refused.value) and "CRET" not in str(refused.value)


def test_yaml_merge_keys_still_merge(tmp_path: Path) -> None:
    text = (
        "instances:\n  - &a {name: a, url: 'http://h:1', labels: {zone: x}}\n"
        "  - <<: *a\n    name: b\n    url: 'http://h:2'\n"
    )
    instances = load_yaml(tmp_path, text).instances
    assert [(i.name, i.labels) for i in instances] == [("a", {"zone": "x"}), ("b", {"zone": "x"})]


@pytest.mark.parametrize("word", ["on", "yes", "true"])
def test_a_mode_yaml_reads_as_a_boolean_is_named_with_the_modes(word: str, tmp_path: Path) -> None:
    expected = r"instances\[0\]\.migration: must be one of off, lite, full \(got True\)"
    with pytest.raises(ConfigError, match=expected):
        load_yaml(tmp_path, f"instances: [{{name: a, url: 'http://h:1', migration: {word}}}]\n")


def test_a_float_yaml_reads_as_text_is_a_float(tmp_path: Path) -> None:
    """YAML 1.1 reads 1e4 (no dot) as text; it means 10,000."""
    text = (
        "instances: [{name: a, url: 'http://h:1'}]\n"
        "scheduler:\n  migration_prefill_tokens_per_s: 2e4\n"
    )
    assert load_yaml(tmp_path, text).scheduler.migration_prefill_tokens_per_s == 20_000.0


@pytest.mark.parametrize("token", ["tok ", "t\u00f6k", "to\nk"])
def test_an_admin_token_no_header_carries_as_written_is_refused(token: str) -> None:
    """A trailing space is trimmed off the header, and a client sends `ö` as
    Latin-1 where the server reads UTF-8: such a token would open nothing."""
    raw = {"instances": [{"name": "a", "url": "http://h:1"}], "admin_token": token}
    with pytest.raises(ConfigError, match="admin_token .*visible ASCII"):
        parse_config(raw)


@pytest.mark.parametrize(
    ("section", "key", "value", "says"),
    [
        ("server", "retry_after_s", -5, r"server.retry_after_s: must not be negative"),
        # --workers' parent crashed on SIGTERM, past what a wait can take.
        ("server", "shutdown_grace_s", 1e10, r"shutdown_grace_s: must be between 0 and 1e\+06"),
        ("server", "shutdown_delay_s", -1, r"shutdown_grace_s: must be between 0 and"),
        ("scheduler", "models_refresh_s", 0, r"models_refresh_s: must be at least 0.01 seconds"),
    ],
)
def test_bounds_a_client_or_an_engine_would_feel(
    section: str, key: str, value: float, says: str
) -> None:
    """`Retry-After: -5` reached clients; a refresh of 0 fetched /v1/models every scrape."""
    raw = {"instances": [{"name": "a", "url": "http://h:1"}], section: {key: value}}
    with pytest.raises(ConfigError, match=says):
        parse_config(raw)


@pytest.mark.parametrize("url", ["http://h:1/v1", "http://h:1/v1/", "http://h:0", "http://h/x/v1"])
def test_a_url_no_engine_answers_at_is_refused(url: str) -> None:
    """Ferry appends /v1/... to an instance's URL (a /v1 one stayed unhealthy
    forever), and port 0 is no server's."""
    with pytest.raises(ConfigError, match=r"instances\[0\]\.url: must be an http\(s\) base URL"):
        parse_config({"instances": [{"name": "a", "url": url}]})


@pytest.mark.parametrize(
    ("url", "twin"),
    [
        ("http://h:80", "HTTP://H:80/"),
        ("http://h:80", "http://h"),
        ("http://h:1", "http://h.:1"),  # the name written absolute
        ("http://[::1]:1", "http://[0::1]:1"),
        ("http://[::ffff:1.2.3.4]:1", "http://[::FFFF:102:304]:1"),
    ],
)
def test_one_server_written_two_ways_is_one_server(url: str, twin: str) -> None:
    """Scheme and host are case-blind, a default port is the same server, and an
    address has one spelling: such a server listed twice was billed twice."""
    raw = {"instances": [{"name": "a", "url": url}, {"name": "b", "url": twin}]}
    with pytest.raises(ConfigError, match=r"instances\[1\]\.url: the server of instance 'a'"):
        parse_config(raw)
    same = [{"name": n, "url": url, "headers": {k: "1"}} for n, k in (("a", "X-A"), ("b", "x-a"))]
    with pytest.raises(ConfigError, match=r"the server of instance 'a'"):
        parse_config({"instances": same})


def test_servers_told_apart_stay_apart() -> None:
    raw = {"instances": [{"name": "a", "url": "http://h"}, {"name": "b", "url": "https://h"}]}
    assert len(parse_config(raw).instances) == 2


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://user:p%40ss@h/0", "redis://user:***@h/0"),
        ("rediss://h:6379/0?password=pw&db=1", "rediss://h:6379/0?password=***&db=1"),
        ("unix:///run/redis.sock?db=3&Password=pw", "unix:///run/redis.sock?db=3&Password=***"),
        ("redis://user@h:6379/0", "redis://user@h:6379/0"),  # a name alone is no secret
        ("redis://h:6379/0", "redis://h:6379/0"),
        # Unescaped, as redis-py takes them: the credentials run to the last `@`.
        ("redis://:p@ssw0rd@h:6379/0", "redis://:***@h:6379/0"),
        ("redis://u:pa/ss#w?rd@h/0", "redis://u:***@h/0"),
    ],
)
def test_a_redis_url_is_shown_without_its_password(url: str, shown: str) -> None:
    """The start line and config errors show the URL: `${VAR}` keeps the
    password out of the file, and it must not land in the log instead."""
    assert redacted(url) == shown


@pytest.mark.parametrize(
    "section",
    [
        config.SchedulerConfig,
        config.ServerConfig,
        config.SharingConfig,
        config.InstanceConfig,
        config.DiscoveryConfig,
    ],
)
def test_every_setting_has_a_type_the_file_can_be_checked_against(section: type) -> None:
    """A setting whose annotation the check does not know would fail every file
    that sets it with a KeyError, not a config error: caught here, when it is added."""
    settable = {f.name: str(f.type) for f in dataclasses.fields(section) if f.init}
    if section is config.DiscoveryConfig:  # its instance settings are an instance's
        settable = {k: v for k, v in settable.items() if k in config.DISCOVERY_KEYS}
    assert {k: v for k, v in settable.items() if v not in config._SCALAR_TYPES} == {}

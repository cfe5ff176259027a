"""Ferry's configuration: YAML -> frozen dataclasses, validated in one place.

Unknown keys are errors, and every error names the YAML path and what is
allowed, e.g. `instances[1].migration: must be one of off, lite, full (got 'on')`.
Loading has no side effects; reload is all-or-nothing (load, then swap).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import math
import os
import re
import reprlib
import ssl
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import yaml

from adapters import ADAPTERS
from proxy import tls
from proxy.ejection import EjectionSettings
from proxy.policy import POLICIES
from proxy.policy.policies import CROWD_FACTOR, CROWD_GRACE
from proxy.policy.scaling import ScalingSettings

ENGINES = tuple(ADAPTERS)  # the `engine:` names: one per adapter in `adapters/`
MIGRATION_MODES = ("off", "lite", "full")
MAX_WAIT_S = 1e6  # a shutdown's delay or grace (11 days): past any generation
# A worker beats once a second (proxy/server.py): a shorter timeout would kill
# one that a busy core kept from beating for a moment.
MIN_WORKER_TIMEOUT_S = 3.0
MAX_SHARED_TTL_S = 86400.0
MAX_FLEET_LOG_LENGTH = 10**7

log = logging.getLogger("ferry.config")


class ConfigError(ValueError):
    """The configuration is invalid; the message names the YAML path."""


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    name: str
    url: str
    engine: str = "vllm"
    labels: dict[str, str] = field(default_factory=dict)
    migration: str = "off"
    # Sent on every call Ferry makes to the instance; `${VAR}` reads the
    # environment (as in `url` and the kv_events addresses, which, unlike
    # these, are shown). Kept out of reprs, so out of logs.
    api_key: str | None = field(default=None, repr=False)
    headers: dict[str, str] = field(default_factory=dict, repr=False)
    # Where the engine publishes its KV cache events (vLLM's --kv-events-config
    # endpoint, seen from Ferry: tcp://HOST:PORT or ipc://PATH) and its replay
    # endpoint; set, the instance's prefix index is precise (proxy/kv_events.py).
    # Ferry connects, so the engine must bind: vLLM binds `tcp://*:PORT` (given
    # a host instead, its publisher connects out and Ferry never hears it).
    kv_events: str | None = None
    kv_events_replay: str | None = None
    # The engine schedules by priority (vLLM's --scheduling-policy priority):
    # Ferry puts each request's priority in the engine's field, so a
    # high-priority request also overtakes the engine's own queue.
    engine_priority: bool = False
    # An https instance's TLS (proxy/tls.py): a CA bundle trusted instead of
    # the system's roots, a client certificate and its key (mutual TLS), or,
    # with `tls_verify: false`, no check of the server's certificate at all.
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    # The name its certificate is checked against where the URL names an
    # address (a discovered instance's: the DNS name it was found under).
    tls_server_name: str | None = None

    def same_server(self, other: InstanceConfig) -> bool:
        """Both name one server the same way: listed twice, it would be billed
        twice. (One URL with another `x-data-parallel-rank` header is another rank
        of a vLLM data-parallel server: a server of its own to route to.)"""
        return self.server == other.server

    @property
    def engine_at(self) -> tuple[str, str]:
        """Its URL and engine: another of either is another server to Ferry,
        known by nothing of the one before (`Cluster.reconfigure`)."""
        return self.url, self.engine

    @property
    def server(self) -> tuple[Any, ...]:
        """The server it names, as `same_server` compares them (a dict's key)."""
        headers = sorted((k.lower(), v) for k, v in self.headers.items())  # (names: any case)
        return (*_server_of(self.url), tuple(headers))

    def auth_headers(self) -> dict[str, str]:
        """The headers every call to this instance carries."""
        out = dict(self.headers)
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out

    @property
    def tls_settings(self) -> tls.Settings | None:
        """Its TLS settings; None where they are the defaults (the system's roots)."""
        settings = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file, self.tls_verify)
        return None if settings == (None, None, None, True) else settings


@dataclass(frozen=True, slots=True)
class DiscoveryConfig:
    """Instances found in DNS (proxy/discovery.py): every address `dns` resolves
    to becomes an instance `<name>@<address>:<port>` made from `template`, e.g.
    a Kubernetes headless Service's name, which resolves to its ready pods."""

    dns: str
    port: int
    scheme: str = "http"
    refresh_s: float = 10.0  # how often the name is resolved again
    name: str = ""  # instance name prefix; "" takes the name's first label
    # engine, migration, labels, api_key, headers of every instance found
    template: InstanceConfig = field(default_factory=lambda: InstanceConfig("", ""))

    def instance(self, address: str) -> InstanceConfig:
        """The instance at `address` (an IPv4 or IPv6 address)."""
        host = f"[{address}]" if ":" in address else address
        return replace(
            self.template,
            name=f"{self.name}@{address}:{self.port}",
            url=f"{self.scheme}://{host}:{self.port}",
            # Its certificate names the service, not the address it was found at.
            tls_server_name=self.template.tls_server_name or self.dns.removesuffix("."),
        )


DISCOVERY_KEYS = ("dns", "port", "scheme", "refresh_s", "name")
# An instance's TLS files (read where the configuration is, not named by the admin API).
TLS_KEYS = ("tls_ca_file", "tls_cert_file", "tls_key_file")
DISCOVERY_INSTANCE_KEYS = (
    "engine", "migration", "labels", "api_key", "headers", "engine_priority",
    *TLS_KEYS, "tls_verify", "tls_server_name",
)  # fmt: skip
# What `instance_defaults:` may set: what a discovery entry may (not a name,
# a URL or the KV event addresses, which are one server's own).
INSTANCE_DEFAULT_KEYS = DISCOVERY_INSTANCE_KEYS


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    policy: str = "llumnix"
    scrape_interval_s: float = 0.25
    scrape_timeout_s: float = 1.0
    unhealthy_after_failures: int = 3  # consecutive failed scrapes
    models_refresh_s: float = 10.0
    topk: int = 1  # llumnix: random among the k freest
    # llumnix: prefer an instance with no prefill queued among those nearly as
    # free (policies.Llumnix, UNQUEUED_FREE_SHARE); false ranks by memory alone.
    prefill_aware: bool = True
    # Prefix locality (proxy/prefix_index.py, proxy/policy/policies.py): with
    # more of a prompt cached on some instances than on others, llumnix sends it
    # where the least prefill is ahead of it (its own uncached tokens counted
    # twice: policies.COLD_PREFILL_WEIGHT), among the instances
    # that stay at or above prefix_safe_freeness (blocks per request) after
    # taking it and not crowded (at most prefix_crowd_factor x the fewest
    # requests in flight on any candidate, plus prefix_crowd_grace; see
    # policies.CROWD_FACTOR); a session stays on its instance unless another is
    # freer by more than affinity_margin_blocks.
    prefix_credit: bool = True
    affinity_margin_blocks: float = 32.0
    prefix_safe_freeness: float = 1.0
    prefix_crowd_factor: float = CROWD_FACTOR
    prefix_crowd_grace: float = CROWD_GRACE
    # cache_aware (vllm-router's defaults): follow a prefix match above
    # cache_threshold of the prompt unless in-flight counts differ by more than
    # balance_abs_threshold and by a factor above balance_rel_threshold.
    cache_threshold: float = 0.3
    balance_abs_threshold: float = 64.0
    balance_rel_threshold: float = 1.5
    # KV blocks reserved where high-priority requests run; None: 10% of each
    # instance's capacity (proxy/policy/virtual_usage.py says why).
    high_priority_headroom_blocks: float | None = None
    seed: int | None = None  # dispatch randomness; None seeds from the OS
    migration_max_resumes: int = 2  # failover: resumes of one broken stream
    # Before the first byte reaches the client, a request whose instance fails
    # (connect failure, 5xx, 429 with Retry-After) is sent to another, this often.
    retries: int = 1
    # Outlier ejection (proxy/ejection.py): after this many failed calls in a
    # row an instance takes no traffic for eject_base_s, doubling up to eject_max_s.
    eject_after_failures: int = 5  # 0: never eject
    eject_base_s: float = 5.0
    eject_max_s: float = 300.0
    migration_prewarm: bool = True  # lite: warm the destination's prefix cache first
    # ...for a rebalancing move only when the recompute it saves takes this long
    # at migration_prefill_tokens_per_s (drains always pre-warm).
    migration_prewarm_min_recompute_s: float = 0.05
    rebalance_interval_s: float = 0.0  # rescheduler tick; 0 turns rebalancing off
    migration_max_concurrent: int = 2  # moves in flight at once (rebalancing)
    migration_source_below: float = 1.0  # freeness under which an instance sheds requests
    migration_dest_above: float = 4.0  # freeness a destination must have
    # Lite moves recompute P + G on the destination; the planner weighs that
    # (see proxy/policy/migration.py).
    migration_prefill_tokens_per_s: float = 10_000.0  # a destination's prefill speed
    migration_preemption_stall_s: float = 1.0  # the stall one preemption costs a stream
    migration_dest_ttft_slack_s: float = 0.2  # how much a move may delay the destination's queue
    # A stream silent this long, where the engine queues more than Ferry has
    # waiting, is taken for preempted and moved at once (0: never). See
    # MigrationSettings.stalled_after_s for why 0.2.
    migration_stalled_after_s: float = 0.2
    # Full mode (instances running migration_shim): the paper's staged pre-copy.
    migration_full_max_stages: int = 3  # pre-copy stages before the stop-and-copy
    migration_full_last_stage_blocks: int = 1  # stop once at most this many blocks wait
    migration_bandwidth_mb_s: float = 0.0  # pre-copy cap per migration; 0: unlimited
    # The scaling signal (`ferry_desired_instances`; proxy/policy/scaling.py): scale
    # out below this average freeness, in above the other (KV blocks per request).
    scale_out_freeness_below: float = 10.0
    scale_in_freeness_above: float = 60.0
    min_instances: int = 1
    max_instances: int | None = None  # None: no cap

    def ejection_settings(self) -> EjectionSettings:
        return EjectionSettings(self.eject_after_failures, self.eject_base_s, self.eject_max_s)

    def scaling_settings(self) -> ScalingSettings:
        """The scaling rule's settings (validated by `_check_scheduler` first)."""
        return ScalingSettings(
            scale_out_freeness_below=self.scale_out_freeness_below,
            scale_in_freeness_above=self.scale_in_freeness_above,
            min_instances=self.min_instances,
            max_instances=self.max_instances,
        )


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Room for what vLLM takes whole: a 25 MB audio clip (its own limit), images
    # sent as base64 in a chat. (vllm-router's default is 256 MB.)
    max_body_bytes: int = 32 * 1024 * 1024
    # What the bodies being received may hold in memory in all (each is held
    # until it is whole); past it, the body that would cross it is answered 503.
    max_pending_body_bytes: int = 512 * 1024 * 1024
    upstream_connect_timeout_s: float = 3.0
    upstream_read_timeout_s: float = 600.0  # a whole (non-streamed) response may take this long
    # A stream that sends nothing for this long is broken: it resumes elsewhere
    # (migration on) or ends with an error event. Decode gaps are milliseconds to
    # a few seconds under preemption; a minute of silence is a hung engine or a
    # dead peer behind a live socket (or a queue wait no client should sit
    # through). It counts from the headers, so queueing counts; 0 turns it off.
    upstream_idle_timeout_s: float = 60.0
    # A client that reads nothing of its stream for this long is gone (nginx's
    # `send_timeout`): its request ends and frees its instance; 0 turns it off.
    client_send_timeout_s: float = 60.0
    # A client connection idle between requests is closed after this long
    # (nginx's `keepalive_timeout`; aiohttp's own is an hour, so idle sockets
    # could use up the process's file descriptors).
    client_keepalive_s: float = 75.0
    # A request body not read whole within this long gets 408 (nginx's
    # `client_body_timeout`): a client sending a byte a second holds nothing for ever.
    client_body_timeout_s: float = 60.0
    # The largest whole answer, or one event of a stream, read from an instance:
    # past it, the answer is a 502, not the whole of Ferry's memory.
    max_answer_bytes: int = 256 * 1024 * 1024
    retry_after_s: int = 1  # told to clients with 503
    # On SIGTERM: /readyz turns 503 at once, new requests are still served for
    # `shutdown_delay_s` (load balancers notice), then in-flight requests get up
    # to `shutdown_grace_s` to finish before Ferry exits.
    shutdown_delay_s: float = 5.0
    shutdown_grace_s: float = 30.0
    # One JSON line per request on stdout (proxy/access_log.py); off by default so
    # a benchmark or a busy Ferry logs nothing it was not asked to.
    access_log: bool = False
    # An OpenTelemetry span per request (proxy/tracing.py); needs the `otel` extra.
    otel: bool = False
    # Processes serving the port together (SO_REUSEPORT; proxy/workers.py). More
    # than one needs `redis_url`: apart, each would see only its own load.
    workers: int = 1
    # A worker whose event loop has not run this long (stuck, or stopped) is
    # killed and started again: the kernel goes on handing it connections that
    # nobody answers (proxy/workers.py). 0: never.
    worker_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class SharingConfig:
    """How processes share one cluster view through Redis (proxy/sharing.py)."""

    # Each process publishes its ledger totals and reads its peers' this often.
    # 50 ms is Llumnix v1's CMS pull interval: a burst of dispatches within it is
    # what one process cannot see of another's.
    publish_interval_s: float = 0.05
    # Between records, a dispatch or a release is announced at once; a burst's
    # announcements go out as one message at most this often.
    change_interval_s: float = 0.005
    # A process's totals vanish this long after its last publish (it died):
    # the window in which a dead process's load still counts.
    ttl_s: float = 1.0
    # The rescheduler lease: its holder renews it every publish; a dead holder's
    # lease passes to another process within this.
    lease_ttl_s: float = 2.0
    # Namespace of every key: processes with the same prefix share a view.
    key_prefix: str = "ferry"
    # Admin changes kept in the fleet log (a Redis stream). A process that starts
    # later, or falls further behind, starts from each instance's compacted
    # changes instead (proxy/fleet.py's `compact`).
    fleet_log_length: int = 1000


@dataclass(frozen=True, slots=True)
class FerryConfig:
    instances: tuple[InstanceConfig, ...]
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    admin_token: str | None = None
    # Keys clients must present (Authorization: Bearer) on every route but health,
    # readiness, metrics and /admin; empty: no key is asked (proxy/client_auth.py).
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    discovery: tuple[DiscoveryConfig, ...] = ()
    # Sharing one cluster view between processes and replicas; None: one process alone.
    redis_url: str | None = None
    sharing: SharingConfig = field(default_factory=SharingConfig)
    # What an instance that does not say takes (`instance_defaults:`): one in the
    # YAML, one added at runtime (`POST /admin/instances`), one discovered.
    instance_defaults: dict[str, Any] = field(default_factory=dict)


# Read once, when Ferry starts: a reload that changes one applies nothing of it
# until a restart (`start_only_changes` names them), and a worker started again
# runs with its parent's (`as_started`), not the file's latest.
START_ONLY = ("server", "redis_url", "sharing", "discovery")


def as_started(config: FerryConfig, started: FerryConfig) -> FerryConfig:
    """`config` with the start-only parts as `started` had them."""
    return replace(config, **{part: getattr(started, part) for part in START_ONLY})


def start_only_changes(new: FerryConfig, started: FerryConfig) -> list[str]:
    """The start-only settings `new` changes from `started` (`server.port`, `redis_url`)."""
    changes = []
    for part in START_ONLY:
        was, now = getattr(started, part), getattr(new, part)
        if isinstance(now, (ServerConfig, SharingConfig)):
            changes += [
                f"{part}.{f.name}"
                for f in fields(now)
                if getattr(now, f.name) != getattr(was, f.name)
            ]
        elif now != was:
            changes.append(part)
    return changes


def load_config(path: str | Path, env: dict[str, str] | None = None) -> FerryConfig:
    """Read and validate a YAML file. `FERRY_ADMIN_TOKEN` fills a missing admin_token,
    `FERRY_API_KEYS` (comma-separated) missing api_keys."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text: byte {exc.start} is {exc.object[exc.start]:#x}"
        ) from exc
    try:
        raw = yaml.load(text, Loader=_StrictLoader)  # noqa: S506  # a SafeLoader
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_error(exc)}") from exc
    except RecursionError as exc:
        raise ConfigError(f"{path}: nested too deeply") from exc
    return parse_config(raw, env=env)


def _yaml_error(exc: yaml.YAMLError) -> str:
    """What a YAML error says, and where (line and column), without PyYAML's
    excerpt of the file: the lines it quotes may hold a key or a password."""
    if not isinstance(exc, yaml.MarkedYAMLError):
        return type(exc).__name__
    said = []
    for text, mark in ((exc.context, exc.context_mark), (exc.problem, exc.problem_mark)):
        if text:
            where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
            said.append(f"{text}{where}")
    return "; ".join(said) or type(exc).__name__


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, but a key written twice in one mapping is an error:
    plain YAML keeps the last one, so a second `instances:` further down a long
    file would silently replace the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<:` merges, more than once is fine
                continue
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    f"the key {_shown(key)} is written first",
                    seen[key],
                    "and again",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


def parse_config(raw: Any, env: dict[str, str] | None = None) -> FerryConfig:
    env = dict(os.environ) if env is None else env
    top = _mapping(raw, "(top level)")
    known = {
        "instances",
        "scheduler",
        "server",
        "admin_token",
        "api_keys",
        "discovery",
        "redis_url",
        "sharing",
        "instance_defaults",
    }
    _reject_unknown(top, known, "")
    defaults = _instance_defaults(top.get("instance_defaults", {}), env)
    discovery = _discovery(top.get("discovery", []), env, defaults)
    instances = _instances(top.get("instances"), env, defaults, allow_none=bool(discovery))
    scheduler = _section(SchedulerConfig, _retired(top.get("scheduler", {})), "scheduler")
    server = _section(ServerConfig, top.get("server", {}), "server")
    sharing = _section(SharingConfig, top.get("sharing", {}), "sharing")
    _check_scheduler(scheduler)
    _check_server(server)
    _check_sharing(sharing)
    token = top.get("admin_token")
    if token is not None and not isinstance(token, str):
        raise ConfigError("admin_token: must be a string")
    # `${VAR}` as in the instances (taken as written, "${FERRY_TOKEN}" would be a
    # token anyone could guess).
    token = _expand(token, "admin_token", env) or env.get("FERRY_ADMIN_TOKEN") or None
    if token is not None:
        check_key(token, "admin_token (or FERRY_ADMIN_TOKEN)")
    redis_url = top.get("redis_url")
    if isinstance(redis_url, str):
        redis_url = _expand(redis_url, "redis_url", env)  # a password from the environment
    if redis_url is not None:
        check_redis_url(redis_url, "redis_url")
    config = FerryConfig(
        instances=instances,
        scheduler=scheduler,
        server=server,
        admin_token=token,
        api_keys=_api_keys(top, env),
        discovery=discovery,
        redis_url=redis_url or None,
        sharing=sharing,
        instance_defaults=defaults,
    )
    check_workers(config)
    return config


def _api_keys(top: dict[str, Any], env: dict[str, str]) -> tuple[str, ...]:
    """The clients' keys: the YAML's list (`${VAR}` read from the environment), or
    else FERRY_API_KEYS, comma-separated."""
    if "api_keys" not in top:
        given = env.get("FERRY_API_KEYS", "").split(",")
        keys = [k.strip() for k in given if k.strip()]
        for i, key in enumerate(keys):
            check_key(key, f"FERRY_API_KEYS, key {i + 1}")
        return tuple(keys)
    raw = top["api_keys"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError("api_keys: must be a non-empty list of strings (or leave it out)")
    keys = []
    for i, item in enumerate(raw):
        where = f"api_keys[{i}]"
        if not isinstance(item, str):
            raise ConfigError(f"{where}: must be a string")
        key = _expand(item, where, env) or ""
        check_key(key, where)
        keys.append(key)
    return tuple(keys)


def check_key(key: str, where: str) -> None:
    """A bearer token as a header carries it: visible ASCII (HTTP clients send
    headers as Latin-1, servers read UTF-8; a space is trimmed off)."""
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        # (A secret file's trailing newline: `kubectl create secret --from-file`.)
        hint = " (a trailing newline?)" if key.strip() and key != key.rstrip() else ""
        raise ConfigError(f"{where}: must be a key: visible ASCII characters, no spaces{hint}")


def check_redis_url(url: Any, where: str) -> None:
    shown = redacted(url) if isinstance(url, str) else f"a {type(url).__name__}"
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
        _ = parts and parts.port  # raises on a port that is none
    except ValueError as exc:  # "redis://[::1", "redis://h:99999"
        # The parser's words may quote a password that broke the URL ("/" in it).
        why = "" if "@" in url else f"{exc}; "
        raise ConfigError(f"{where}: not a URL ({why}got {shown!r})") from None
    if parts is None or parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(f"{where}: must be a redis://, rediss:// or unix:// URL (got {shown!r})")
    # redis-py reads the path as the database number and quietly uses 0 for anything else.
    if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdecimal():
        raise ConfigError(
            f"{where}: the path names the database by number, as in redis://host:6379/0"
            f" (got {parts.path!r})"
        )
    try:
        from redis.connection import parse_url
    except ImportError:  # the optional extra is not installed: `ferry serve` says so
        return
    try:
        parse_url(url)  # its query's options (`?socket_timeout=abc`)
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc} (got {shown!r})") from None


# A password in a URL's authority or its query, starred wherever a URL is shown.
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def redacted(url: str) -> str:
    """`url` as logs and errors show it: its password starred. The credentials
    run to the last `@` (as redis-py reads them: a password may hold `@`, `/`
    or `#` unescaped); the user's name before a `:` is no secret."""
    scheme, sep, rest = url.partition("://")
    if sep and "@" in rest:
        credentials, _, host = rest.rpartition("@")
        user, colon, _ = credentials.partition(":")
        url = f"{scheme}://{user}{':***' if colon else ''}@{host}"
    return _QUERY_PASSWORD.sub(r"\1***", url)


def check_workers(config: FerryConfig) -> None:
    """Several processes need a shared view and a port named in advance; the
    command line checks this again after its flags are applied."""
    workers = config.server.workers
    if workers < 1:
        raise ConfigError(f"server.workers: must be at least 1 (got {workers})")
    if workers > 1 and config.redis_url is None:
        raise ConfigError(
            f"server.workers: {workers} processes need a shared cluster view: set redis_url"
            " (or --redis URL). Apart, each process would see only the load it placed itself"
            " and several would pile onto the same instance"
        )
    if workers > 1 and config.server.port == 0:
        raise ConfigError(
            "server.port: must be named (not 0) with several workers: they share one port"
        )


def config_from_backends(
    urls: list[str],
    *,
    policy: str = "llumnix",
    port: int = 8000,
    host: str = "127.0.0.1",
    migration: str = "lite",
) -> FerryConfig:
    """The quick start: `ferry serve --backend URL ...`; names come from host:port.
    Lite migration by default: a stream whose instance fails or drains goes on
    elsewhere, where with it off the stream would end in an error."""
    raw = {
        # A default, so an instance added at runtime (`ferry add`) moves like the others.
        "instance_defaults": {"migration": migration},
        "instances": [{"name": _name_from_url(u), "url": u} for u in urls],
        "scheduler": {"policy": policy},
        "server": {"host": host, "port": port},
    }
    return parse_config(raw)


def _instance_defaults(raw: Any, env: dict[str, str]) -> dict[str, Any]:
    """`instance_defaults:`, checked as one instance's keys would be."""
    defaults = dict(_mapping(raw, "instance_defaults"))
    _reject_unknown(defaults, set(INSTANCE_DEFAULT_KEYS), "instance_defaults")
    parse_instance({"name": "defaults", "url": "http://defaults", **defaults},
                   "instance_defaults", env)  # fmt: skip
    return defaults


def _instances(
    raw: Any, env: dict[str, str], defaults: dict[str, Any], allow_none: bool = False
) -> tuple[InstanceConfig, ...]:
    """`allow_none`: discovery finds the instances, so the list may be empty or absent."""
    if allow_none and raw is None:
        return ()
    if not isinstance(raw, list) or not (raw or allow_none):
        raise ConfigError(
            "instances: must be a non-empty list of {name, url, engine}"
            " (or a list, maybe empty, next to discovery)"
        )
    result: list[InstanceConfig] = []
    names: set[str] = set()
    servers: dict[tuple[Any, ...], str] = {}
    for i, item in enumerate(raw):
        inst = parse_instance(item, f"instances[{i}]", env, defaults)
        if inst.name in names:
            raise ConfigError(f"instances[{i}].name: duplicate instance name {inst.name!r}")
        twin = servers.setdefault(inst.server, inst.name)
        if twin != inst.name:
            raise ConfigError(f"instances[{i}].url: the server of instance {twin!r}")
        names.add(inst.name)
        result.append(inst)
    return tuple(result)


def parse_instance(
    raw: Any,
    where: str,
    env: dict[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    *,
    runtime: bool = False,
) -> InstanceConfig:
    """One instance, as in the YAML list (also the body of `POST /admin/instances`,
    `runtime`); a key it does not set is taken from `defaults` (`instance_defaults:`)."""
    env = dict(os.environ) if env is None else env
    own = _mapping(raw, where)
    if runtime:
        _refuse_variables(own, where)
    entry = {**(defaults or {}), **own}
    # A default is for the engines that can take it: an `openai` instance in a
    # fleet whose default is lite migration stays off, as it must.
    engine = entry.get("engine", "vllm")  # (InstanceConfig's default)
    adapter = ADAPTERS.get(engine) if isinstance(engine, str) else None
    if adapter is not None and "migration" not in own and not adapter.returns_token_ids:
        entry.pop("migration", None)
    if adapter is not None and "engine_priority" not in own and adapter.priority_field is None:
        entry.pop("engine_priority", None)
    # YAML 1.1 reads a bare `off` as false.
    if entry.get("migration") is False:
        entry["migration"] = "off"
    # `${VAR}` in the addresses too: a Deployment passes hosts and ports in its env.
    # An error quotes an address as written, not as expanded: the admin API
    # answers with it, and a variable may hold a secret.
    written = {key: entry.get(key) for key in _ADDRESSES}
    for key in _ADDRESSES:
        if isinstance(entry.get(key), str):
            entry[key] = _expand(entry[key], f"{where}.{key}", env)
    inst = _section(InstanceConfig, entry, where, required=("name", "url"))
    if (
        not isinstance(inst.name, str)
        or not _INSTANCE_NAME.fullmatch(inst.name)
        or len(inst.name) > MAX_INSTANCE_NAME
    ):
        raise ConfigError(
            f"{where}.name: must be ASCII letters, digits and . _ : - @ [ ] only, not"
            f" starting with ., at most {MAX_INSTANCE_NAME} characters"
            f" (got {str(inst.name)[:200]!r})"
        )
    if not _http_url(inst.url):
        raise ConfigError(
            f"{where}.url: must be an http(s) base URL (the server's root, not its /v1),"
            f" without user, query, fragment or port 0 (got {written['url']!r})"
        )
    if inst.engine not in ENGINES:
        raise ConfigError(
            f"{where}.engine: must be one of {', '.join(ENGINES)} (got {inst.engine!r})"
        )
    if inst.migration not in MIGRATION_MODES:
        raise ConfigError(
            f"{where}.migration: must be one of {', '.join(MIGRATION_MODES)} "
            f"(got {inst.migration!r})"
        )
    if inst.migration != "off" and not ADAPTERS[inst.engine].returns_token_ids:
        raise ConfigError(
            f"{where}.migration: must be off for engine {inst.engine} (got {inst.migration!r}):"
            " a moved stream goes on from its token ids, and this engine returns none"
        )
    _check_kv_events(inst, where, written)
    if not isinstance(inst.engine_priority, bool):
        raise ConfigError(f"{where}.engine_priority: must be true or false")
    if inst.engine_priority and ADAPTERS[inst.engine].priority_field is None:
        raise ConfigError(
            f"{where}.engine_priority: must be false for engine {inst.engine}:"
            " it has no request priority field"
        )
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in inst.labels.items()):
        raise ConfigError(f"{where}.labels: must map strings to strings")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in inst.headers.items()):
        raise ConfigError(f"{where}.headers: must map strings to strings")
    api_key = _expand(inst.api_key, f"{where}.api_key", env)
    headers = {k: _expand(v, f"{where}.headers.{k}", env) or "" for k, v in inst.headers.items()}
    if api_key is not None:
        _check_header_value(api_key, f"{where}.api_key")
    for key, value in headers.items():
        if not _HEADER_NAME.fullmatch(key):
            raise ConfigError(f"{where}.headers: {key!r} is not a header name")
        if key.lower() in _FRAMING_HEADERS:
            raise ConfigError(f"{where}.headers: {key!r} is the HTTP client's to set")
        _check_header_value(value, f"{where}.headers.{key}")
    _check_tls(inst, where, own, runtime)
    return replace(inst, api_key=api_key, headers=headers)


def _check_tls(inst: InstanceConfig, where: str, own: Mapping[str, Any], runtime: bool) -> None:
    """An instance's TLS settings, its files checked now (see proxy/tls.py). The
    admin API names no file on Ferry's host: its instances take the file's
    `instance_defaults`, checked as the file was read."""
    if not isinstance(inst.tls_verify, bool):
        raise ConfigError(f"{where}.tls_verify: must be true or false")
    if where != "instance_defaults" and urlsplit(inst.url).scheme.lower() != "https":
        # (The defaults' may be for the https instances alone.)
        mistaken = [k for k in (*TLS_KEYS, "tls_server_name") if own.get(k) is not None]
        mistaken += ["tls_verify"] if own.get("tls_verify") is False else []
        if mistaken:
            raise ConfigError(
                f"{where}.{mistaken[0]}: the instance's url is not https://, so no TLS is spoken"
            )
    for key in TLS_KEYS:
        path = getattr(inst, key)
        if runtime and key in own:
            raise ConfigError(
                f"{where}.{key}: the admin API names no file on Ferry's host;"
                " set it in the configuration file's instance_defaults"
            )
        if path is not None and not (isinstance(path, str) and os.path.isfile(path)):
            raise ConfigError(f"{where}.{key}: no such file {path!r}")
    if inst.tls_key_file and not inst.tls_cert_file:
        raise ConfigError(f"{where}.tls_key_file: goes with a tls_cert_file")
    if inst.tls_server_name is not None:
        _check_dns_name(inst.tls_server_name, f"{where}.tls_server_name")
    settings = inst.tls_settings
    if settings is not None and not runtime:  # (the admin API's: the file's, checked)
        try:
            tls.check(settings)
        except (OSError, ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"{where}: its TLS files cannot be used: {exc}") from None


def _refuse_variables(own: dict[str, Any], where: str) -> None:
    """The admin API's instances read none of Ferry's environment: `${VAR}` in
    a URL would show the caller any variable (the clients' keys), and in an
    `api_key` send it to a server of the caller's choosing. (The file's
    `instance_defaults` still do: the operator wrote them.)"""
    values = [(k, v) for k, v in own.items() if isinstance(v, str)]
    headers = own.get("headers")
    if isinstance(headers, dict):
        values += [(f"headers.{k}", v) for k, v in headers.items() if isinstance(v, str)]
    for key, value in values:
        if "${" in value:
            raise ConfigError(
                f"{where}.{key}: the admin API reads none of Ferry's environment;"
                " send the value itself"
            )


# An instance's addresses, where `${VAR}` reads the environment.
_ADDRESSES = ("url", "kv_events", "kv_events_replay")


def _http_url(url: Any) -> bool:
    """A base URL paths are appended to: credentials go in `api_key` or
    `headers` (kept out of logs and the admin API), and a query or fragment
    would swallow the paths."""
    if not isinstance(url, str) or url != url.strip() or any(c.isspace() for c in url):
        return False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port out of range)
    except ValueError:  # "http://[::1", "http://host:99999"
        return False
    plain = not (parts.username or parts.password or parts.query or parts.fragment)
    # Ferry appends /v1/...: a URL that ends in /v1 would be asked for /v1/v1/...
    root = parts.port != 0 and not parts.path.rstrip("/").endswith("/v1")
    return (
        parts.scheme in ("http", "https")
        and bool(parts.hostname)
        and plain
        and root
        and "#" not in url
    )


def _server_of(url: str) -> tuple[str, str, int | None, str]:
    """What a URL names, as a server sees it: HTTP://H:80/ and http://h are one,
    and so are http://h. (the name absolute) and http://[0::1], http://[::1]."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or {"http": 80, "https": 443}.get(scheme)
    host = (parts.hostname or "").removesuffix(".")
    with contextlib.suppress(ValueError):  # an address: one spelling of it
        host = ipaddress.ip_address(host).compressed
    return scheme, host, port, parts.path.rstrip("/")


# An instance's name: in metrics labels, the admin API's paths, log lines and a
# response header, so printable ASCII and path-safe. '@' and brackets for the
# names discovery gives (name@address:port, name@[v6]:port), which a PATCH reads.
# A name is in every answer's `x-ferry-instance` header and every metric label.
MAX_INSTANCE_NAME = 128
MAX_DISCOVERY_PREFIX = 64  # + "@[" + an IPv6 address + "]:" + a port stays under it
_INSTANCE_NAME = re.compile(r"[A-Za-z0-9_:@\[\]-][A-Za-z0-9._:@\[\]-]*")
# Headers that frame the request, which the HTTP client sets: an instance's
# `headers` replacing them would break every call to it.
_FRAMING_HEADERS = frozenset(
    {"content-length", "transfer-encoding", "host", "connection", "content-encoding", "upgrade"}
)


# RFC 9110's token, the characters a header's name may have.
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


# A header line past 8 KiB is refused by most servers (aiohttp's at 8190 bytes,
# nginx's by default; uvicorn's h11 takes 16 KiB of headers in all): every call
# with such a value would fail, and read as the client's fault (a 400).
MAX_HEADER_VALUE_BYTES = 8000


def _check_header_value(value: str, where: str) -> None:
    """A value sent in a header: no control characters (aiohttp refuses to send
    them, so every call to the instance would fail), nor longer than servers
    take a header line."""
    bad = next((c for c in value if (ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F), None)
    if bad is not None:
        raise ConfigError(
            f"{where}: must not contain control characters (found {bad!r};"
            " a secret read from a file with its trailing newline?)"
        )
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > MAX_HEADER_VALUE_BYTES:
        raise ConfigError(
            f"{where}: {size} bytes, over {MAX_HEADER_VALUE_BYTES} (servers refuse a header"
            " line past 8 KiB)"
        )


def _check_kv_events(inst: InstanceConfig, where: str, written: dict[str, Any]) -> None:
    """`written`: the addresses as the configuration wrote them (for errors)."""
    if inst.kv_events is None:
        if inst.kv_events_replay is not None:
            raise ConfigError(f"{where}.kv_events_replay: needs {where}.kv_events (the events)")
        return
    if ADAPTERS[inst.engine].kv_events is None:
        raise ConfigError(
            f"{where}.kv_events: must be unset for engine {inst.engine}: it publishes no KV events"
        )
    for key in ("kv_events", "kv_events_replay"):
        endpoint = getattr(inst, key)
        if endpoint is not None and not _zmq_endpoint(endpoint):
            raise ConfigError(
                f"{where}.{key}: must be tcp://HOST:PORT (the engine's address as Ferry"
                f" reaches it, not *) or ipc://PATH (got {written[key]!r})"
            )


def _zmq_endpoint(endpoint: str) -> bool:
    """An address Ferry can connect a zmq socket to."""
    if endpoint.startswith("ipc://"):
        return len(endpoint) > len("ipc://")
    match = re.fullmatch(r"tcp://(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})", endpoint)
    return match is not None and 1 <= int(match.group(2)) <= 65535


def _discovery(
    raw: Any, env: dict[str, str], defaults: dict[str, Any]
) -> tuple[DiscoveryConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError("discovery: must be a list of {dns, port, refresh_s, ...}")
    result: list[DiscoveryConfig] = []
    for i, item in enumerate(raw):
        where = f"discovery[{i}]"
        entry = _mapping(item, where)
        _reject_unknown(entry, {*DISCOVERY_KEYS, *DISCOVERY_INSTANCE_KEYS}, where)
        own = {k: v for k, v in entry.items() if k in DISCOVERY_KEYS}
        source = _section(DiscoveryConfig, own, where, required=("dns", "port"))
        _check_discovery(source, where)
        name = source.name or source.dns.split(".")[0]
        template = {k: v for k, v in entry.items() if k in DISCOVERY_INSTANCE_KEYS}
        # Checked as one instance would be, under this entry's YAML path.
        url = f"{source.scheme}://{source.dns}:{source.port}"
        inst = parse_instance({"name": name, "url": url, **template}, where, env, defaults)
        source = replace(source, name=name, template=inst)
        if any((d.name, d.port) == (name, source.port) for d in result):
            raise ConfigError(f"{where}.name: {name!r} port {source.port} is already discovered")
        result.append(source)
    return tuple(result)


def _check_discovery(d: DiscoveryConfig, where: str) -> None:
    if not d.dns or "/" in d.dns or ":" in d.dns:
        raise ConfigError(f"{where}.dns: must be a DNS name (got {d.dns!r})")
    _check_dns_name(d.dns, f"{where}.dns")
    if not 1 <= d.port <= 65535:
        raise ConfigError(f"{where}.port: must be between 1 and 65535 (got {d.port})")
    if d.scheme not in ("http", "https"):
        raise ConfigError(f"{where}.scheme: must be one of http, https (got {d.scheme!r})")
    if not (math.isfinite(d.refresh_s) and d.refresh_s >= 0.1):
        raise ConfigError(f"{where}.refresh_s: must be at least 0.1 seconds (got {d.refresh_s})")
    if "/" in d.name or "@" in d.name:
        raise ConfigError(f"{where}.name: must contain no '/' or '@' (got {d.name!r})")
    if len(d.name or d.dns.split(".")[0]) > MAX_DISCOVERY_PREFIX:
        raise ConfigError(
            f"{where}.name: the instances' names start with it and end with @[address]:port:"
            f" at most {MAX_DISCOVERY_PREFIX} characters (set `name:` to a shorter one)"
        )


def _check_dns_name(name: str, where: str) -> None:
    """A hostname the resolver takes: labels of 1 to 63 characters, 253 in all, a
    trailing dot allowed. It refuses others before any lookup (a UnicodeError from
    its IDNA encoding), which is no resolution failure: `ferry serve` ended at start."""
    for label in name.removesuffix(".").split("."):
        if not label:
            raise ConfigError(f"{where}: {name!r} has an empty label (two dots, or a dot first)")
        if len(label) > 63:
            raise ConfigError(f"{where}: label {label!r} is {len(label)} characters (at most 63)")
    try:
        encoded = name.encode("idna").removesuffix(b".")  # a non-ASCII label: xn--...
    except UnicodeError as exc:  # such a label over 63 characters encoded, say
        raise ConfigError(f"{where}: {name!r} is no DNS name the resolver takes ({exc})") from None
    if len(encoded) > 253:
        raise ConfigError(f"{where}: {name!r} is {len(encoded)} characters (at most 253)")


def _expand(value: str | None, where: str, env: dict[str, str]) -> str | None:
    """`${VAR}` in a value becomes the environment variable VAR."""
    if value is None:
        return None

    def lookup(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return env[name]

    return re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lookup, value)


def _check_scheduler(s: SchedulerConfig) -> None:
    if s.policy not in POLICIES:
        raise ConfigError(
            f"scheduler.policy: must be one of {', '.join(sorted(POLICIES))} (got {s.policy!r})"
        )
    if not 0.01 <= s.scrape_interval_s <= 60:
        raise ConfigError("scheduler.scrape_interval_s: must be between 0.01 and 60 seconds")
    # (Below 10 ms no scrape comes back, and every instance reads as down.)
    if s.scrape_timeout_s < 0.01 or s.models_refresh_s < 0.01:
        raise ConfigError(
            "scheduler.scrape_timeout_s, models_refresh_s: must be at least 0.01 seconds"
        )
    if s.unhealthy_after_failures < 1:
        raise ConfigError("scheduler.unhealthy_after_failures: must be at least 1")
    if s.topk < 1:
        raise ConfigError("scheduler.topk: must be at least 1")
    _check_prefix(s)
    for key in (
        "migration_prefill_tokens_per_s",
        "migration_preemption_stall_s",
        "migration_dest_ttft_slack_s",
    ):
        if getattr(s, key) <= 0:
            raise ConfigError(f"scheduler.{key}: must be positive")
    for key in ("migration_stalled_after_s", "migration_prewarm_min_recompute_s"):
        if getattr(s, key) < 0:
            raise ConfigError(f"scheduler.{key}: must not be negative")
    # (A tick every microsecond keeps the event loop busy with nothing to move.)
    if not (s.rebalance_interval_s == 0 or s.rebalance_interval_s >= 0.01):
        raise ConfigError(
            "scheduler.rebalance_interval_s: must be 0 (off) or at least 0.01 seconds"
        )
    if s.migration_max_concurrent < 1:
        raise ConfigError("scheduler.migration_max_concurrent: must be at least 1")
    if s.migration_full_max_stages < 0 or s.migration_full_last_stage_blocks < 0:
        raise ConfigError(
            "scheduler.migration_full_max_stages, scheduler.migration_full_last_stage_blocks:"
            " must not be negative"
        )
    if s.migration_bandwidth_mb_s < 0:
        raise ConfigError("scheduler.migration_bandwidth_mb_s: must not be negative (0: no cap)")
    if s.retries < 0 or s.eject_after_failures < 0:
        raise ConfigError("scheduler.retries, scheduler.eject_after_failures: must not be negative")
    if not 0 < s.eject_base_s <= s.eject_max_s:
        raise ConfigError("scheduler.eject_base_s: must be positive and at most eject_max_s")
    if s.migration_max_resumes < 0:
        raise ConfigError("scheduler.migration_max_resumes: must not be negative")
    if s.high_priority_headroom_blocks is not None and s.high_priority_headroom_blocks < 0:
        raise ConfigError("scheduler.high_priority_headroom_blocks: must not be negative")
    _check_scaling(s)


def _check_prefix(s: SchedulerConfig) -> None:
    for key in (
        "affinity_margin_blocks",
        "prefix_safe_freeness",
        "prefix_crowd_grace",
        "balance_abs_threshold",
    ):
        value = getattr(s, key)
        if not (math.isfinite(value) and value >= 0):
            raise ConfigError(f"scheduler.{key}: must be a finite number, 0 or more (got {value})")
    if not 0 <= s.cache_threshold <= 1:
        raise ConfigError(
            f"scheduler.cache_threshold: must be between 0 and 1 (got {s.cache_threshold})"
        )
    for key in ("balance_rel_threshold", "prefix_crowd_factor"):
        value = getattr(s, key)
        if not (math.isfinite(value) and value >= 1):
            raise ConfigError(f"scheduler.{key}: must be a finite number, 1 or more (got {value})")


def _check_scaling(s: SchedulerConfig) -> None:
    try:
        s.scaling_settings()
    except ValueError as e:
        raise ConfigError(f"scheduler.{e}") from None


def check_host(host: Any, where: str) -> None:
    """Where Ferry listens: `*` (every interface), an IP address or a name the
    resolver takes. An empty one would listen everywhere unsaid."""
    if not isinstance(host, str) or not host:
        raise ConfigError(f"{where}: must be an address, a host name, or * for every interface")
    if host == "*":
        return
    try:
        ipaddress.ip_address(host)
    except ValueError:
        _check_dns_name(host, where)


def _check_server(s: ServerConfig) -> None:
    check_host(s.host, "server.host")
    if not 0 <= s.port <= 65535:
        raise ConfigError("server.port: must be between 0 and 65535")
    if s.max_body_bytes < 1024:
        raise ConfigError("server.max_body_bytes: must be at least 1024")
    if s.max_pending_body_bytes < s.max_body_bytes:
        raise ConfigError(
            "server.max_pending_body_bytes: must be at least server.max_body_bytes"
            f" ({s.max_body_bytes}), or no body that large could be received"
        )
    if s.upstream_connect_timeout_s <= 0 or s.upstream_read_timeout_s <= 0:
        raise ConfigError("server.upstream_*_timeout_s: must be positive")
    if s.upstream_idle_timeout_s < 0:
        raise ConfigError("server.upstream_idle_timeout_s: must be 0 (off) or positive")
    if s.client_send_timeout_s < 0:
        raise ConfigError("server.client_send_timeout_s: must be 0 (off) or positive")
    if s.client_keepalive_s <= 0 or s.client_body_timeout_s <= 0:
        raise ConfigError("server.client_keepalive_s, client_body_timeout_s: must be positive")
    if s.max_answer_bytes < 1024 * 1024:
        raise ConfigError("server.max_answer_bytes: must be at least 1 MiB")
    if not (0 <= s.shutdown_delay_s <= MAX_WAIT_S and 0 <= s.shutdown_grace_s <= MAX_WAIT_S):
        # (--workers' parent waits on them in one go: past ~9e9 s Python cannot.)
        raise ConfigError(
            f"server.shutdown_delay_s, shutdown_grace_s: must be between 0 and {MAX_WAIT_S:g}"
        )
    if s.retry_after_s < 0:
        raise ConfigError(f"server.retry_after_s: must not be negative (got {s.retry_after_s})")
    if not (s.worker_timeout_s == 0 or MIN_WORKER_TIMEOUT_S <= s.worker_timeout_s <= MAX_WAIT_S):
        raise ConfigError(
            f"server.worker_timeout_s: must be 0 (never) or between {MIN_WORKER_TIMEOUT_S:g}"
            f" and {MAX_WAIT_S:g} seconds (got {s.worker_timeout_s:g})"
        )


def _check_sharing(s: SharingConfig) -> None:
    if not 0 <= s.change_interval_s <= s.publish_interval_s:
        raise ConfigError(
            f"sharing.change_interval_s: must be between 0 and sharing.publish_interval_s"
            f" (got {s.change_interval_s:g})"
        )
    if not 0.01 <= s.publish_interval_s <= 1:
        raise ConfigError(
            f"sharing.publish_interval_s: must be between 0.01 and 1 second"
            f" (got {s.publish_interval_s:g})"
        )
    for key in ("ttl_s", "lease_ttl_s"):
        value = getattr(s, key)
        # Three publishes may be missed (a slow tick, a GC pause) before a live
        # process's totals or lease lapse; a dead one's should not outlast a day.
        if not (3 * s.publish_interval_s <= value <= MAX_SHARED_TTL_S):
            raise ConfigError(
                f"sharing.{key}: must be between 3 x sharing.publish_interval_s"
                f" ({3 * s.publish_interval_s:g} s) and {MAX_SHARED_TTL_S:g} s (got {value:g})"
            )
    if not 1 <= s.fleet_log_length <= MAX_FLEET_LOG_LENGTH:  # (Redis takes 64-bit counts)
        raise ConfigError(
            f"sharing.fleet_log_length: must be between 1 and {MAX_FLEET_LOG_LENGTH}"
            f" (got {s.fleet_log_length})"
        )
    if not re.fullmatch(r"[A-Za-z0-9_.:-]+", s.key_prefix):
        raise ConfigError(
            f"sharing.key_prefix: must be letters, digits or _ . : - (got {s.key_prefix!r})"
        )


# Scheduler keys an older Ferry read, and why they no longer mean anything: a
# file that sets them still loads (with a warning), so an upgrade is no outage.
RETIRED_SCHEDULER_KEYS = {
    "prefix_weight": "prefix locality ranks by prefill time now",
    "prefix_free_enough_blocks": "replaced by prefix_safe_freeness",
}


def _retired(raw: Any) -> Any:
    if not isinstance(raw, dict):
        return raw
    for key in sorted(raw.keys() & RETIRED_SCHEDULER_KEYS.keys()):
        log.warning("scheduler.%s: ignored (%s)", key, RETIRED_SCHEDULER_KEYS[key])
    return {k: v for k, v in raw.items() if k not in RETIRED_SCHEDULER_KEYS}


def _section(cls: Any, raw: Any, where: str, required: tuple[str, ...] = ()) -> Any:
    """Build dataclass `cls` from mapping `raw`, checking keys and scalar types."""
    data = _mapping(raw, where)
    known = {f.name: f for f in fields(cls)}
    _reject_unknown(data, set(known), where)
    for key in required:
        if key not in data:
            raise ConfigError(f"{where}.{key}: is required")
    values: dict[str, Any] = {}
    for key, value in data.items():
        type_name = str(known[key].type)
        expected = _SCALAR_TYPES[type_name]
        is_float = type_name == "float" or (type_name == "float | None" and value is not None)
        if is_float and isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
            value = float(value)  # YAML 1.1 reads 1e4 (no dot) as text
        # bool is an int to isinstance, but `port: true` is a mistake, not 1.
        if (isinstance(value, bool) and type_name != "bool") or not isinstance(value, expected):
            choices = _CHOICES.get(key)
            if choices is None:
                # A credential is not repeated into the log, even a mistyped one.
                got = f"a {type(value).__name__}" if key in _SECRETS else _shown(value)
                raise ConfigError(f"{_join(where, key)}: must be {type_name} (got {got})")
            hint = " (YAML reads on, off, yes and no as booleans: quote it)" * (type(value) is bool)
            names = ", ".join(choices)
            raise ConfigError(
                f"{_join(where, key)}: must be one of {names} (got {_shown(value)}){hint}"
            )
        if is_float:
            value = _finite(cast(float, value), _join(where, key))
        values[key] = value
    return cls(**values)


# A number as YAML 1.2 writes it: 1e4, -2.5E-3.
_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
# Fields that hold credentials (an instance's key; headers such as Authorization).
_SECRETS = frozenset({"api_key", "headers"})
# Fields whose values are names: a wrong type is answered with the names.
_CHOICES: dict[str, tuple[str, ...]] = {
    "migration": MIGRATION_MODES,
    "engine": ENGINES,
    "policy": tuple(sorted(POLICIES)),
}


def _shown(value: Any) -> str:
    """`value` as an error message shows it: short, however large (a YAML alias
    bomb is a few hundred bytes that repr() makes gigabytes of)."""
    shown = reprlib.Repr()
    shown.maxlevel, shown.maxdict, shown.maxlist = 2, 4, 4
    shown.maxstring = shown.maxother = 60
    return shown.repr(value)


_SCALAR_TYPES: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "bool": (bool,),
    "int": (int,),
    "float": (int, float),
    "int | None": (int, type(None)),
    "str | None": (str, type(None)),
    "float | None": (int, float, type(None)),
    "dict[str, str]": (dict,),
}


def _finite(value: float, where: str) -> float:
    """`value` as a float; .nan, .inf and integers too large for a float are
    refused (NaN passes every comparison the checks make)."""
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ConfigError(f"{where}: must be a finite number (got {_shown(value)})")
    return number


def _mapping(raw: Any, where: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping (got {type(raw).__name__})")
    return raw


def _reject_unknown(data: dict[str, Any], known: set[str], where: str) -> None:
    for key in data:
        if key not in known:
            raise ConfigError(
                f"{_join(where, key if isinstance(key, str) else _shown(key))}: unknown key;"
                f" allowed: {', '.join(sorted(known))}"
            )


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _name_from_url(url: str) -> str:
    try:
        return urlsplit(url).netloc or url
    except ValueError:  # "http://[::1": the URL's own check says why
        return "unnamed"

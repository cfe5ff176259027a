"""The `ferry` command: the front door. Each subcommand imports what it needs."""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from proxy.policy import POLICIES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ferry", description="Llumnix-style LLM load balancer")
    parser.add_argument("--version", action="version", version=f"ferry {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the proxy")
    source = serve.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="YAML configuration file")
    source.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="a vLLM base URL (repeat for more); quick start without YAML",
    )
    serve.add_argument(
        "--policy", choices=sorted(POLICIES), help="dispatch policy (with --backend)"
    )
    serve.add_argument(
        "--host", help="listen address (default 127.0.0.1; '*': every interface, IPv4 and IPv6)"
    )
    serve.add_argument("--port", type=int, help="listen port (default 8000)")
    serve.add_argument("--admin-token", help="bearer token for /admin (or FERRY_ADMIN_TOKEN)")
    serve.add_argument(
        "--migration",
        choices=("off", "lite", "full"),
        help="migration mode of every --backend (default lite: a stream whose instance"
        " fails goes on elsewhere, and drains and high-priority requests move streams;"
        " off: none of that)",
    )
    serve.add_argument(
        "--workers",
        type=int,
        help="processes serving the port together (SO_REUSEPORT; needs --redis or redis_url)",
    )
    serve.add_argument(
        "--redis",
        metavar="URL",
        help="share the cluster view with other processes and replicas through this Redis",
    )
    serve.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    )

    init = sub.add_parser("init", help="write the documented example configuration")
    init.add_argument("path", nargs="?", default="ferry.yaml", help="where ('-': stdout)")
    init.add_argument("--force", action="store_true", help="overwrite an existing file")

    def admin_command(name: str, help: str) -> argparse.ArgumentParser:
        command = sub.add_parser(name, help=help)
        command.add_argument("--url", default="http://127.0.0.1:8000", help="the running ferry")
        command.add_argument("--admin-token", help="bearer token (or FERRY_ADMIN_TOKEN)")
        return command

    drain = admin_command("drain", "move every request off an instance; wait until empty")
    drain.add_argument("name")
    drain.add_argument("--timeout", type=_seconds, default=600, help="seconds to wait")
    undrain = admin_command("undrain", "let a drained instance take traffic again")
    undrain.add_argument("name")
    add = admin_command("add", "add an instance to a running ferry")
    add.add_argument("name")
    add.add_argument("instance_url", metavar="URL", help="the instance's base URL")
    add.add_argument("--engine", help="engine adapter (default vllm)")
    add.add_argument("--migration", choices=("off", "lite", "full"))
    add.add_argument("--label", action="append", metavar="KEY=VALUE")
    add.add_argument("--api-key", help="sent to the instance as Authorization: Bearer")
    remove = admin_command("remove", "drain an instance (moving its streams), then remove it")
    remove.add_argument("name")
    remove.add_argument("--no-migrate", action="store_true", help="let streams finish in place")
    remove.add_argument("--no-wait", action="store_true", help="return at once")
    remove.add_argument("--timeout", type=_seconds, default=600, help="seconds to wait")
    admin_command("reload", "re-read the running ferry's configuration file")
    status = admin_command("status", "print the instances of a running ferry")
    status.add_argument("--json", action="store_true", help="print the raw JSON")

    shim = sub.add_parser(
        "vllm",
        help="run vLLM's OpenAI server with Ferry's migration shim (full-mode migration)",
        description="All arguments not listed here go to vLLM's OpenAI server unchanged.",
    )
    shim.add_argument("--ferry-kv-port", type=int, help="port receiving KV blocks (default: free)")
    shim.add_argument("--ferry-kv-host", default="127.0.0.1", help="address of that port")

    # Simulation and workload tools live in loadtest/; imported only when used.
    from loadtest import trace
    from loadtest.sim import run as sim

    trace.add_arguments(sub.add_parser("trace", help="write a request trace (JSONL)"))
    sim.add_arguments(sub.add_parser("sim", help="simulate a trace on N instances"))

    args, rest = parser.parse_known_args(argv)
    if args.command == "vllm":
        from migration_shim import launcher

        return launcher.run(rest, args.ferry_kv_port, args.ferry_kv_host)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "serve":
        return _serve(args)
    offline = {"init": _init, "trace": trace.run, "sim": sim.run}
    if args.command in offline:
        try:
            return int(offline[args.command](args))
        except OSError as exc:  # a file or folder it reads or writes
            print(f"ferry {args.command}: {exc}", file=sys.stderr)
            return 1
        except ValueError as exc:  # arguments out of range, a file not of its kind
            print(f"ferry {args.command}: {exc}", file=sys.stderr)
            return 2
    admin = {
        "status": _status,
        "drain": _drain,
        "undrain": _undrain,
        "add": _add,
        "remove": _remove,
        "reload": _reload,
    }
    try:
        return admin[args.command](args)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError) as exc:
        # JSON, but not what Ferry's admin API answers: another server on that
        # port (or a Ferry of another version), not a fault of this command.
        print(
            f"ferry {args.command}: {args.url} answered what Ferry's admin API does not"
            f" ({type(exc).__name__}: {exc})",
            file=sys.stderr,
        )
        return 1


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llm-ferry")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


def _init(args: argparse.Namespace) -> int:
    """Write the example configuration shipped in the package (configs/example.yaml)."""
    from importlib.resources import files
    from pathlib import Path

    text = files("proxy").joinpath("data/example.yaml").read_text()
    if args.path == "-":
        sys.stdout.write(text)
        return 0
    path = Path(args.path)
    if path.exists() and not args.force:
        print(f"ferry init: {path} exists; --force overwrites it", file=sys.stderr)
        return 1
    path.write_text(text)
    print(f"wrote {path}: edit instances, then `ferry serve --config {path}`")
    return 0


def _serve(args: argparse.Namespace) -> int:
    import signal

    from proxy.config import ConfigError

    # A reload's signal must not end the process (SIGHUP's default) while it
    # starts: it is held, and serve() reloads once it runs.
    signal.signal(signal.SIGHUP, _hold_reload)
    _log_setup(args, worker=bool(args.workers and args.workers > 1))
    try:
        config = _serve_config(args)
    except ConfigError as exc:
        print(f"ferry: configuration error: {exc}", file=sys.stderr)
        return 2
    if config.redis_url is not None:
        try:
            import redis  # noqa: F401 - only to say what is missing
        except ImportError:
            print(
                "ferry: redis_url needs the redis package: pip install 'llm-ferry[redis]'",
                file=sys.stderr,
            )
            return 2
    if config.server.workers > 1:
        from proxy.workers import supervise

        if not (args.workers and args.workers > 1):  # the file said it: the pid goes in too
            _log_setup(args, worker=True, force=True)

        server = config.server
        return supervise(
            server.workers,
            _serve_one,
            (args, config),
            stop_timeout_s=server.shutdown_delay_s + server.shutdown_grace_s + 10,
            timeout_s=server.worker_timeout_s,
        )
    return _serve_one(args)


_reload_asked = False  # a SIGHUP came while this process started (`_hold_reload`)


def _hold_reload(_signum: int, _frame: Any) -> None:
    global _reload_asked
    _reload_asked = True


def _serve_one(args: argparse.Namespace, started: Any = None) -> int:
    """One serving process: the only one, or a worker (then logging is set up
    again: a spawned worker starts with nothing of its parent) that runs with
    what only a restart applies as the parent read it at the start (`started`):
    one started again after the file changed serves as its siblings do."""
    import signal

    import uvloop

    # (A worker spawns ignoring SIGHUP: from here one is held for serve().)
    signal.signal(signal.SIGHUP, _hold_reload)

    from proxy.config import ConfigError, as_started
    from proxy.server import serve
    from proxy.workers import EXIT_CONFIG

    if started is not None:  # a worker (`--workers`, or `server.workers` in the file)
        _log_setup(args, worker=True)
    try:
        config = _serve_config(args)
        if started is not None:
            config = as_started(config, started)
    except ConfigError as exc:  # a worker restarted after the file was edited badly
        print(f"ferry: configuration error: {exc}", file=sys.stderr)
        sys.exit(EXIT_CONFIG)
    unavailable: tuple[type[Exception], ...] = ()
    if config.redis_url is not None:  # `redis` is an optional extra: imported only then
        from proxy.sharing import SharingUnavailable

        unavailable = (SharingUnavailable,)
    try:
        # A reload reads the file again, with the command line still on top.
        load = (lambda: _serve_config(args)) if args.config else None
        uvloop.run(serve(config, load, reload_asked=lambda: _reload_asked))
    except unavailable as exc:
        print(f"ferry: {exc}", file=sys.stderr)
        sys.exit(1)
    except OSError as exc:
        if not _cannot_listen(exc):
            raise
        where = f"{config.server.host}:{config.server.port}"
        print(f"ferry: cannot listen on {where}: {exc.strerror or exc}", file=sys.stderr)
        sys.exit(1)
    return 0


def _cannot_listen(exc: OSError) -> bool:
    """The listen address is taken, not this host's, or not a name at all."""
    import errno
    import socket

    listen = (errno.EADDRINUSE, errno.EADDRNOTAVAIL, errno.EACCES)
    return isinstance(exc, socket.gaierror) or exc.errno in listen


def _log_setup(args: argparse.Namespace, *, worker: bool, force: bool = False) -> None:
    pid = " [%(process)d]" if worker else ""
    handler = logging.StreamHandler()
    handler.setFormatter(OneLineFormatter(f"%(asctime)s %(levelname)s{pid} %(name)s: %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler], force=force)


class OneLineFormatter(logging.Formatter):
    """Log records whose message is one line, whatever it quotes: what a client
    sent (a field's name, a header) may hold a newline and a forged record after
    it, or a terminal's escapes. Control characters are written as `\\xNN` (or
    `\\uNNNN`); a traceback after the message keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802  (logging's name)
        record.message = _UNPRINTABLE.sub(_escaped, record.message)
        return super().formatMessage(record)


# C0 and C1 controls, DEL, and Unicode's line and paragraph separators.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _serve_config(args: argparse.Namespace) -> Any:
    """The configuration `ferry serve` runs: the file or --backend, then the flags."""
    import dataclasses

    from proxy.config import (
        ConfigError,
        check_host,
        check_key,
        check_redis_url,
        check_workers,
        config_from_backends,
        load_config,
    )

    if args.config:
        if args.policy or args.migration:
            raise ConfigError("--policy/--migration: set them in the YAML file instead")
        config = load_config(args.config)
    else:
        config = config_from_backends(
            args.backend, policy=args.policy or "llumnix", migration=args.migration or "lite"
        )
    server = config.server
    if args.port is not None and not 0 <= args.port <= 65535:  # as server.port
        raise ConfigError(f"--port: must be between 0 and 65535 (got {args.port})")
    if args.host is not None:
        check_host(args.host, "--host")
    if args.host or args.port is not None:
        server = dataclasses.replace(
            server,
            host=args.host or server.host,
            port=server.port if args.port is None else args.port,
        )
    if args.workers is not None:
        server = dataclasses.replace(server, workers=args.workers)
    token = args.admin_token or config.admin_token
    if args.admin_token:
        check_key(args.admin_token, "--admin-token")
    redis_url = config.redis_url
    if args.redis:
        check_redis_url(args.redis, "--redis")
        redis_url = args.redis
    config = dataclasses.replace(config, server=server, admin_token=token, redis_url=redis_url)
    check_workers(config)  # again, with the flags applied
    return config


def _admin(args: argparse.Namespace, path: str, method: str = "GET", body: Any = None) -> Any:
    """Call the admin API; raises SystemExit(1) with the reason on failure."""
    token = args.admin_token or os.environ.get("FERRY_ADMIN_TOKEN", "")
    headers = {"Authorization": f"Bearer {token}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    elif method in ("POST", "PATCH"):
        data = b""
    try:
        request = urllib.request.Request(
            args.url.rstrip("/") + path, method=method, data=data, headers=headers
        )
        with _NO_REDIRECTS.open(request, timeout=10) as resp:
            return json.load(resp)
    except urllib.error.HTTPError as exc:
        try:
            with exc:
                detail = exc.read().decode(errors="replace")
        except (http.client.HTTPException, OSError) as cut:  # the body cut short
            detail = f"(the answer was cut short: {cut!r})"
        print(f"ferry {args.command}: HTTP {exc.code}: {detail}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"ferry {args.command}: cannot reach {args.url}: {exc}", file=sys.stderr)
    except http.client.HTTPException as exc:  # not HTTP (a TLS port, say), or cut short
        # repr: a BadStatusLine's text is the raw bytes it got.
        print(
            f"ferry {args.command}: cannot reach {args.url}: no complete HTTP answer ({exc!r})",
            file=sys.stderr,
        )
    except ValueError as exc:  # a token or URL no HTTP request can carry
        print(f"ferry {args.command}: {exc}", file=sys.stderr)
    raise SystemExit(1)


def _seconds(text: str) -> float:
    """A wait: a positive, finite number of seconds (nan never timed out)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds (got {text!r})")
    return value


class _Refused(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a place to go: followed, it would carry the
    admin token to whatever the Location names, and print that place's answer
    as this call's."""

    def redirect_request(self, *_: Any) -> None:
        return None  # (urllib then raises the 3xx as an HTTPError)


_NO_REDIRECTS = urllib.request.build_opener(_Refused)


def _instance_path(name: str) -> str:
    """An instance's admin path, its name quoted: `a/drain?` names an instance,
    not another route."""
    return "/admin/instances/" + urllib.parse.quote(name, safe="")


def _status(args: argparse.Namespace) -> int:
    rows = _admin(args, "/admin/instances")
    if not isinstance(rows, list):
        raise TypeError(f"a list of instances, not {type(rows).__name__}")
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def _drain(args: argparse.Namespace) -> int:
    row = _admin(args, f"{_instance_path(args.name)}/drain?migrate=true", "POST")
    print(f"draining {args.name}: {row['inflight']} in flight, {row.get('migrating', 0)} moving")
    return _wait_empty(args, "draining")


def _remove(args: argparse.Namespace) -> int:
    migrate = "false" if args.no_migrate else "true"
    row = _admin(args, f"{_instance_path(args.name)}?migrate={migrate}", "DELETE")
    print(f"removing {args.name}: {row['inflight']} in flight, {row.get('migrating', 0)} moving")
    if args.no_wait:
        return 0
    return _wait_empty(args, "removing")


def _wait_empty(args: argparse.Namespace, flag: str) -> int:
    """Poll the instance list until the instance is empty (`flag` "draining") or
    gone ("removing"), or the timeout passes. An undrain, or a reload that keeps
    it, calls the change off: `flag` goes false, and waiting on is in vain."""
    import time

    deadline = time.monotonic() + args.timeout
    seen = False  # `flag` once on: a peer process asked first may not have the change yet
    while True:
        rows = _admin(args, "/admin/instances")
        row = next((r for r in rows if r["name"] == args.name), None)
        remaining = 0 if row is None else row["inflight"]
        # Removed meanwhile (by a reload, or by hand): nothing left on it either.
        done = row is None if flag == "removing" else remaining == 0
        # With a shared view, 0 counts every process's streams only while the one
        # asked can read the others' (Redis reachable): otherwise, wait on.
        counted = not done or _admin(args, "/admin/sharing").get("redis_ok", True)
        if done and counted:
            print(f"{args.name}: done")
            return 0
        on = row is not None and row.get(flag, True)  # a ferry before `removing`: on
        late = time.monotonic() > deadline
        if not on and (seen or late):
            what = "removal" if flag == "removing" else "drain"
            print(f"{args.name}: the {what} was called off (an undrain, or a reload that"
                  f" keeps it): it is still there, with {remaining} in flight")  # fmt: skip
            return 1
        seen = seen or on
        if late:
            if not counted:
                print(f"{args.name}: the other processes' streams cannot be counted"
                      f" (Redis unreachable) after {args.timeout}s")  # fmt: skip
            else:
                print(f"{args.name} still has {remaining} in flight after {args.timeout}s")
            return 1
        time.sleep(0.5)


def _add(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "url": args.instance_url}
    if args.engine:
        body["engine"] = args.engine
    if args.migration:
        body["migration"] = args.migration
    if args.label:
        if bad := [item for item in args.label if "=" not in item]:
            print(f"ferry add: --label {bad[0]!r}: must be KEY=VALUE", file=sys.stderr)
            return 2
        body["labels"] = dict(item.split("=", 1) for item in args.label)
    if args.api_key:
        body["api_key"] = args.api_key
    row = _admin(args, "/admin/instances", "POST", body)
    print(f"added {row['name']} ({row['url']}); it takes traffic once it answers a scrape")
    return 0


def _undrain(args: argparse.Namespace) -> int:
    row = _admin(args, f"{_instance_path(args.name)}/undrain", "POST")
    print(f"{row['name']} takes traffic again")
    return 0


def _reload(args: argparse.Namespace) -> int:
    summary = _admin(args, "/admin/reload", "POST")
    print(json.dumps(summary, indent=2))
    return 0


def format_table(rows: list[dict[str, Any]]) -> str:
    header = [
        "NAME",
        "URL",
        "HEALTHY",
        "DRAINING",
        "MIGRATION",
        "INFLIGHT",
        "FREENESS",
        "RUNNING",
        "WAITING",
        "KV%",
        "AGE_S",
    ]
    table = [header]
    for r in rows:
        snap = r.get("snapshot") or {}
        free = r.get("freeness")
        mode = r.get("migration", "off")
        if r.get("migration_configured") == "full" and mode != "full":
            mode += " (no shim)"  # configured full, but the instance runs no migration_shim
        table.append(
            [
                r["name"],
                r["url"],
                "yes" if r["healthy"] else "NO",
                "yes" if r["draining"] else "no",
                mode,
                str(r["inflight"]),
                "-" if free is None else f"{free:.1f}",
                str(snap.get("running", "-")),
                str(snap.get("waiting", "-")),
                "-" if "kv_usage" not in snap else f"{100 * snap['kv_usage']:.1f}",
                str(snap.get("age_s", "-")),
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in table
    )


if __name__ == "__main__":
    sys.exit(main())

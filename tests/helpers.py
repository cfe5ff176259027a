"""Shared test machinery: an event loop on a thread, and servers started on it.

Tests stay synchronous (the official `openai` client is used as users use it)
while the proxy and stand-in servers run on one background loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest
from aiohttp import web

from migration_shim import launcher
from proxy.config import FerryConfig, parse_config
from proxy.errors import MAX_HEADER_LINE_BYTES, MAX_REQUEST_LINE_BYTES
from proxy.server import CLUSTER, app_runner, build_app

T = TypeVar("T")
S = TypeVar("S")


class LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def call(self, fn: Any, *args: Any) -> Any:
        async def wrapper() -> Any:
            return fn(*args)

        return self.run(wrapper())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Site:
    runner: web.AppRunner
    port: int
    app: web.Application
    scheme: str = "http"

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"


async def start_site(
    app: web.Application,
    *,
    handler_cancellation: bool = False,
    host: str = "127.0.0.1",
    port: int = 0,
    keepalive_timeout: float = 75.0,
    runner: web.AppRunner | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Site:
    """Serve `app` on `host:port` (0: a free port) with `runner` (by default
    one that takes header lines as long as Ferry's: vLLM's server takes them),
    over TLS with `ssl_context`; `Site.url` names 127.0.0.1."""
    runner = runner or web.AppRunner(
        app,
        handler_cancellation=handler_cancellation,
        access_log=None,
        keepalive_timeout=keepalive_timeout,
        max_line_size=MAX_REQUEST_LINE_BYTES,
        max_field_size=MAX_HEADER_LINE_BYTES,
    )
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return Site(runner, port, app, "http" if ssl_context is None else "https")


class Sites:
    """Servers started on the loop thread for one test, all stopped after it."""

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self.started: list[Site] = []

    def start(
        self,
        server: S,
        *,
        handler_cancellation: bool = False,
        ssl_context: ssl.SSLContext | None = None,
    ) -> tuple[S, Site]:
        """Serve `server.app()` on a free port (over TLS with `ssl_context`)."""
        app = server.app()  # type: ignore[attr-defined]
        started = start_site(
            app, handler_cancellation=handler_cancellation, ssl_context=ssl_context
        )
        site = self.loop.run(started)
        self.started.append(site)
        return server, site

    def close(self) -> None:
        for site in self.started:
            self.loop.run(site.runner.cleanup())


def wait_until(predicate: Any, timeout: float = 10.0, poll: float = 0.05) -> None:
    """Poll `predicate` until it is true; fail the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(poll)


def call_json(
    url: str, method: str = "GET", body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    """One JSON call: (status, decoded answer), error statuses included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        with exc:  # an unclosed error response leaks its socket
            return exc.code, json.load(exc)


def debian_tool(name: str, package: str) -> str:
    """The path of a server or tool from a Debian package `make setup` installs.

    Missing, the test skips on a developer's machine and fails under CI, which
    must have run the setup."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} missing: `make setup` installs Debian's {package} package")
        pytest.skip(f"{name} missing (Debian's {package} package; `make setup` installs it)")
    return path


def ferry_process(
    config: dict[str, Any],
    path: Any,
    stderr: Any = subprocess.DEVNULL,
    launcher: tuple[str, ...] = (),
) -> tuple[subprocess.Popen[bytes], str]:
    """`ferry serve` in its own process, on `config` (written to `path`) and a free
    port, started through `launcher` (such as `prlimit --nofile=...`): the process
    and its URL, ready."""
    port = free_port()
    server = {**config.get("server", {}), "port": port}
    path.write_text(json.dumps({**config, "server": server}))
    proc = subprocess.Popen(
        [*launcher, sys.executable, "-m", "proxy.cli", "serve", "--config", str(path)],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: status(url + "/readyz") == 200, timeout=30)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def status(url: str) -> int:
    """The HTTP status of a GET, 0 when nothing listens."""
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        exc.close()
        return int(exc.code)
    except OSError:
        return 0


def free_port() -> int:
    """A free port outside the ephemeral range (see `launcher.free_port`)."""
    return launcher.free_port()


def ferry_config(
    urls: list[str],
    instances_migration: str = "off",
    instances_engine: str = "vllm",
    **sections: Any,
) -> FerryConfig:
    raw: dict[str, Any] = {
        "instances": [
            {
                "name": f"i{n}",
                "url": u,
                "migration": instances_migration,
                "engine": instances_engine,
            }
            for n, u in enumerate(urls)
        ],
        "scheduler": {"scrape_interval_s": 0.05, "seed": 1, **sections.pop("scheduler", {})},
        **sections,
    }
    return parse_config(raw, env={})


class Ferry:
    """A Ferry app on the loop thread, as `ferry serve` would run it."""

    def __init__(
        self, loop: LoopThread, config: FerryConfig, load: Callable[[], FerryConfig] | None = None
    ) -> None:
        self.loop = loop
        app = build_app(config, load)
        self.site = loop.run(start_site(app, runner=app_runner(app, config.server)))
        self.url = self.site.url
        self.cluster = self.site.app[CLUSTER]

    def view(self, name: str) -> Any:
        return self.loop.call(self.cluster.instance_view, name)

    def close(self) -> None:
        self.loop.run(self.site.runner.cleanup())

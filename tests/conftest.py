from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loadtest.paged_standin import DEFAULT_PROFILE, PagedStandIn
from loadtest.redis_server import redis_binary, start_redis
from loadtest.standin_server import StandIn
from tests.helpers import Ferry, LoopThread, Site, ferry_config, free_port, start_site

_REDIS_PREFIXES = itertools.count(1)


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def standins(loop_thread: LoopThread) -> Iterator[Callable[..., list[tuple[StandIn, Site]]]]:
    """Factory: start n stand-in servers (not vLLM) on the loop thread."""
    started: list[Site] = []

    def make(n: int, **options: Any) -> list[tuple[StandIn, Site]]:
        result = []
        for _ in range(n):
            standin = StandIn(**options)
            site = loop_thread.run(start_site(standin.app()))
            started.append(site)
            result.append((standin, site))
        return result

    yield make
    for site in started:
        loop_thread.run(site.runner.cleanup())


@pytest.fixture
def paged_standins(
    loop_thread: LoopThread,
) -> Iterator[Callable[..., list[tuple[PagedStandIn, Site]]]]:
    """Factory: start n paged-KV stand-in engines (not vLLM); other options override
    the fields of their `loadtest.sim.profile.Profile`."""
    started: list[Site] = []

    def make(n: int, stream_interval: int = 1, **profile: Any) -> list[tuple[PagedStandIn, Site]]:
        result = []
        for _ in range(n):
            engine = dataclasses.replace(DEFAULT_PROFILE, **profile)
            standin = PagedStandIn(engine, stream_interval=stream_interval)
            site = loop_thread.run(start_site(standin.app(), handler_cancellation=True))
            started.append(site)
            result.append((standin, site))
        return result

    yield make
    for site in started:
        loop_thread.run(site.runner.cleanup())


@pytest.fixture
def ferry(loop_thread: LoopThread) -> Iterator[Callable[..., Ferry]]:
    """Factory: start Ferry in front of the given base URLs."""
    started: list[Ferry] = []

    def make(urls: list[str], **sections: Any) -> Ferry:
        proxy = Ferry(loop_thread, ferry_config(urls, **sections))
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.close()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 (Debian's package: `make setup` installs
    it; CI must have it), for the whole session: its URL."""
    if redis_binary() is None or not _redis_client_installed():
        if os.environ.get("CI"):
            pytest.fail("redis-server or the redis package missing: `make setup` installs both")
        pytest.skip("redis-server or the redis package missing (`make setup` installs both)")
    port = free_port()
    proc = start_redis(port, tmp_path_factory.mktemp("redis"))
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def redis_prefix(redis_server: str) -> str:
    """A key prefix of this test's own, so tests sharing the server share nothing."""
    return f"test{next(_REDIS_PREFIXES)}"


def _redis_client_installed() -> bool:
    try:
        import redis  # noqa: F401
    except ImportError:
        return False
    return True

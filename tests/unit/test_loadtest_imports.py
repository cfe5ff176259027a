"""Every benchmark and tool under `loadtest/` imports: they are not run by the
tests, so a renamed helper would otherwise break them unnoticed (it once did:
four benchmarks imported a function the demo no longer had)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import loadtest

# The locustfile monkey-patches the interpreter that imports it (gevent);
# tests/integration/test_locust.py runs it for real.
MODULES = sorted(
    m.name
    for m in pkgutil.walk_packages(loadtest.__path__, "loadtest.")
    if m.name != "loadtest.locustfile"
)


def test_there_are_modules_to_check() -> None:
    assert {"loadtest.bench_scale", "loadtest.demo", "loadtest.sim.simulator"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_imports(name: str) -> None:
    importlib.import_module(name)

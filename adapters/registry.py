"""The engine registry: `engine:` names to adapters.

Adding an engine is one module in `adapters/` with an `ADAPTER` and one line
here; nothing in `proxy/` names an engine.
"""

from __future__ import annotations

from collections.abc import Iterable

from adapters import openai, vllm
from adapters.engine import EngineAdapter


class UnknownEngine(KeyError):
    """No adapter has that name; the message lists the ones that exist."""

    def __str__(self) -> str:
        return str(self.args[0])


def build_registry(adapters: Iterable[EngineAdapter]) -> dict[str, EngineAdapter]:
    """Name -> adapter, refusing two adapters under one name."""
    registry: dict[str, EngineAdapter] = {}
    for adapter in adapters:
        if adapter.name in registry:
            raise ValueError(f"engine adapter {adapter.name!r} is registered twice")
        registry[adapter.name] = adapter
    return registry


ADAPTERS = build_registry([vllm.ADAPTER, openai.ADAPTER])


def get_adapter(name: str) -> EngineAdapter:
    """The adapter for `engine: name`; UnknownEngine names the valid ones."""
    try:
        return ADAPTERS[name]
    except KeyError:
        raise UnknownEngine(
            f"unknown engine {name!r}; must be one of {', '.join(ADAPTERS)}"
        ) from None

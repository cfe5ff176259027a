"""Engine adapters: what each kind of engine exposes, as data and pure parsers.

Adapters are the ground floor: they import nothing from `proxy/`, do no I/O and
hold no policy. The proxy looks an instance's adapter up by its `engine:` name
(`get_adapter`), fetches what the adapter points at and hands it to its parser.
"""

from adapters.engine import EngineAdapter
from adapters.registry import ADAPTERS, UnknownEngine, get_adapter
from adapters.snapshot import EngineSnapshot, MetricsParseError

__all__ = [
    "ADAPTERS",
    "EngineAdapter",
    "EngineSnapshot",
    "MetricsParseError",
    "UnknownEngine",
    "get_adapter",
]

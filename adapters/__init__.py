"""Engine adapters: turn what an engine exposes into an `EngineSnapshot`.

Adapters are the ground floor: they import nothing from `proxy/`, do no I/O and
hold no policy. The proxy fetches the text and hands it to a parser here.
"""

from adapters.snapshot import EngineSnapshot, MetricsParseError

__all__ = ["EngineSnapshot", "MetricsParseError"]

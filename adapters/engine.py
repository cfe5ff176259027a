"""What an engine adapter is: the contract every entry of the registry fills.

An adapter is data plus pure functions. The proxy reads it to know where an
engine publishes its load (if it does), how to parse that, what to add to a
request so the engine reports token ids, and which kinds of migration it can
take part in. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from adapters.kv_events import KVEventsFormat
from adapters.snapshot import EngineSnapshot


@dataclass(frozen=True, slots=True)
class EngineAdapter:
    """One kind of engine, named by the instance's `engine:` in the YAML.

    - `metrics_path`, `parse_metrics`: where the engine publishes its load and the
      pure parser from that text to an `EngineSnapshot`; both None for an engine
      without metrics (its health then comes from `GET /v1/models`, its load from
      Ferry's ledger alone).
    - `metrics_narrow_path`: the same metrics narrowed to the series the parser
      reads, cheaper for the engine to render; tried first, with `metrics_path`
      read instead on an instance where it fails or reads differently
      (`proxy.scraper.Scraper._snapshot` says for how long).
    - `token_id_request_fields`: added to every completion request so the engine
      answers with `prompt_token_ids`/`token_ids` (exact ledger counts, and what a
      lite move continues from); empty when the engine has no such option.
    - `returns_token_ids`: those fields make it report token ids. Lite migration
      needs them (a continuation is the prompt ids plus the generated ids).
    - `runs_shim`: the engine can run `migration_shim` (full-mode migration).
    - `kv_events`: how the engine publishes its prefix cache's changes and names
      its blocks (an instance's `kv_events:` endpoint makes its prefix index
      precise); None for an engine that publishes none.
    - `priority_field`: the request field an engine that schedules by priority
      reads (lower runs first; an instance's `engine_priority: true` has Ferry
      fill it in); None for an engine without one.
    """

    name: str
    metrics_path: str | None = None
    metrics_narrow_path: str | None = None
    parse_metrics: Callable[[str], EngineSnapshot] | None = None
    token_id_request_fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    returns_token_ids: bool = False
    runs_shim: bool = False
    kv_events: KVEventsFormat | None = None
    priority_field: str | None = None

    def __post_init__(self) -> None:
        if (self.metrics_path is None) != (self.parse_metrics is None):
            raise ValueError(f"engine {self.name}: metrics_path and parse_metrics go together")
        if self.metrics_narrow_path is not None and self.metrics_path is None:
            raise ValueError(f"engine {self.name}: metrics_narrow_path needs metrics_path")
        if self.returns_token_ids and not self.token_id_request_fields:
            raise ValueError(f"engine {self.name}: token ids need the request fields that ask")
        # A frozen view, so no caller can change what every request is sent.
        object.__setattr__(
            self, "token_id_request_fields", MappingProxyType(dict(self.token_id_request_fields))
        )

    @property
    def has_metrics(self) -> bool:
        return self.parse_metrics is not None

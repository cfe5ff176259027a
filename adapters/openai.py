"""The generic adapter: any OpenAI-compatible server (`engine: openai`).

It promises only the OpenAI API: no load metrics, no token ids, no migration
shim. Ferry takes its health from `GET /v1/models` and its load from its own
ledger (requests in flight, tokens estimated from text), and never sends it
fields a strict server could reject.
"""

from __future__ import annotations

from adapters.engine import EngineAdapter

ADAPTER = EngineAdapter(name="openai")

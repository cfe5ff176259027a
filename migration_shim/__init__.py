"""Ferry's vLLM plugin for full-mode migration: move a running request with its KV cache.

Only `wire` and `launcher` may be imported without vLLM; the rest runs inside vLLM.
"""

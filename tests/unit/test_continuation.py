from __future__ import annotations

from proxy import continuation as cont


def test_what_cannot_move_exactly() -> None:
    base = {"model": "m", "prompt": "hi", "stream": True}
    assert cont.not_migratable(base, "completions") is None
    assert cont.not_migratable({**base, "stream": False}, "completions") is not None
    assert cont.not_migratable({**base, "n": 2}, "completions") == "n > 1"
    assert cont.not_migratable({**base, "use_beam_search": True}, "completions") == "beam search"
    schema = {"type": "json_schema", "json_schema": {}}
    assert cont.not_migratable({**base, "response_format": schema}, "completions")
    chat = {"model": "m", "messages": [], "stream": True}
    assert cont.not_migratable({**chat, "tools": [{"type": "function"}]}, "chat") == "tool calls"
    assert cont.not_migratable({**base, "prompt_logprobs": 1}, "completions")
    assert (
        cont.not_migratable({**base, "prompt": ["a", "b"]}, "completions") == "a batch of prompts"
    )


def test_continuation_body_reduces_the_budget_and_keeps_sampling() -> None:
    body = {
        "model": "m",
        "messages": [],
        "stream": True,
        "max_completion_tokens": 100,
        "min_tokens": 30,
        "temperature": 0.0,
        "seed": 7,
        "stop": ["\n"],
        "cache_salt": "s",
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 2,
    }
    out = cont.continuation_body(body, [1, 2, 3], [9] * 40, wants_usage=True)
    assert out["prompt"] == [1, 2, 3] + [9] * 40
    assert out["max_tokens"] == 60 and out["min_tokens"] == 0
    assert (out["temperature"], out["seed"], out["stop"], out["cache_salt"]) == (
        0.0,
        7,
        ["\n"],
        "s",
    )
    assert out["ignore_eos"] and out["logprobs"] == 2
    assert out["stream"] and out["return_token_ids"]
    assert out["stream_options"] == {"include_usage": True}
    assert "messages" not in out

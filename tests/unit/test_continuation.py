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


def test_grammars_and_logprobs_do_not_move() -> None:
    """A grammar would start over mid-output, and a continuation's logprobs are
    a completion's; fields left null or at their defaults move."""
    base = {"model": "m", "prompt": "hi", "stream": True}
    chat = {"model": "m", "messages": [], "stream": True}
    for field, value in (
        ("guided_json", {"type": "object"}),
        ("guided_regex", "[a-z]+"),
        ("guided_choice", ["yes", "no"]),
        ("guided_grammar", "root ::= 'a'"),
        ("structured_outputs", {"json": {"type": "object"}}),
        ("response_format", {"type": "json_object"}),
    ):
        assert cont.not_migratable({**chat, field: value}, "chat") == "structured output", field
        assert cont.not_migratable({**base, field: value}, "completions") == "structured output"
    for field in ("guided_json", "structured_outputs", "response_format"):
        assert cont.not_migratable({**chat, field: None}, "chat") is None
    assert cont.not_migratable({**chat, "response_format": {"type": "text"}}, "chat") is None
    assert cont.not_migratable({**chat, "logprobs": True, "top_logprobs": 2}, "chat") == "logprobs"
    assert cont.not_migratable({**chat, "logprobs": False}, "chat") is None
    assert cont.not_migratable({**base, "logprobs": 0}, "completions") == "logprobs"
    assert cont.not_migratable({**base, "logprobs": None}, "completions") is None


def test_a_null_budget_field_does_not_hide_the_other() -> None:
    """SDKs send unset fields as null: the budget is the field that is set."""
    assert cont.max_tokens({"max_completion_tokens": None, "max_tokens": 10}) == 10
    assert cont.max_tokens({"max_completion_tokens": 7, "max_tokens": 10}) == 7
    assert cont.max_tokens({"max_tokens": None}) is None
    body = {"model": "m", "messages": [], "max_completion_tokens": None, "max_tokens": 10}
    assert cont.continuation_body(body, [1], [2, 3], wants_usage=False)["max_tokens"] == 8


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
    assert out["ignore_eos"]
    assert out["stream"] and out["return_token_ids"]
    assert out["stream_options"] == {"include_usage": True}
    assert "messages" not in out

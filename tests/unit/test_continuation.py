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


def test_chat_client_sees_its_own_stream_shape() -> None:
    origin = cont.Origin("chatcmpl-1", 123, "m", "fp")
    chunk = {
        "id": "cmpl-9",
        "object": "text_completion",
        "created": 999,
        "model": "m",
        "choices": [{"index": 0, "text": " there", "token_ids": [5], "finish_reason": None}],
    }
    out = cont.client_chunk(chunk, "chat", origin, wants_ids=False)
    assert out["id"] == "chatcmpl-1" and out["created"] == 123
    assert out["object"] == "chat.completion.chunk" and out["system_fingerprint"] == "fp"
    assert out["choices"][0]["delta"] == {"content": " there"}
    assert out["choices"][0]["token_ids"] is None
    done = cont.client_chunk(chunk, "completions", origin, wants_ids=True)
    assert done["object"] == "text_completion" and done["choices"][0]["token_ids"] == [5]
    assert cont.usage(10, 5) == {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}


def test_stop_string_across_the_join() -> None:
    stop = cont.StopAcrossJoin(["END!"], tail="text that ends in EN", include_stop=False)
    assert stop.feed("D! and more") == ("", "END!")
    stop = cont.StopAcrossJoin(["END!"], tail="... EN", include_stop=True)
    assert stop.feed("D! more") == ("D!", "END!")
    # Entirely after the join: the destination's own check finds it, not us.
    stop = cont.StopAcrossJoin(["END!"], tail="nothing here", include_stop=False)
    assert stop.feed("abcEND!") == ("abcEND!", None)
    assert not stop.active
    assert cont.stop_strings({"stop": "x"}) == ["x"] and cont.stop_strings({}) == []

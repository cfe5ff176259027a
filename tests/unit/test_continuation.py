from __future__ import annotations

import json

from proxy import continuation as cont
from proxy.openai_request import parse


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
    for count in ("2", 2.0):  # vLLM reads both as 2
        assert cont.not_migratable({**base, "logprobs": count}, "completions") == "logprobs"
    # Chat's flag as vLLM reads it: `parse` makes 1 and "true" true.
    said = {**chat, "messages": [{"role": "user", "content": "x"}], "logprobs": 1}
    lax = parse(json.dumps(said).encode(), "chat", None).body
    assert cont.not_migratable(lax, "chat") == "logprobs"


def test_the_budget_is_read_as_vllm_reads_it() -> None:
    """SDKs send unset fields as null, some numbers as floats; a completion
    without a budget has vLLM's 16, a chat runs to the end of the context."""
    chat = {"model": "m", "messages": []}
    assert (
        cont.budget({**chat, "max_completion_tokens": None, "max_tokens": 10}, "chat", 5, 100) == 10
    )
    assert cont.budget({**chat, "max_completion_tokens": 7, "max_tokens": 10}, "chat", 5, 100) == 7
    assert cont.budget({**chat, "max_tokens": 150.0}, "chat", 5, 1000) == 150
    assert cont.budget(chat, "chat", 30, 100) == 70
    # vLLM trims a budget to the context the prompt leaves (a move must not lengthen it).
    assert cont.budget({**chat, "max_tokens": 150}, "chat", 5, 100) == 95
    assert cont.budget({**chat, "max_tokens": 150}, "chat", 5, None) == 150
    assert cont.budget({**chat, "max_tokens": None}, "chat", 30, None) is None
    completion = {"model": "m", "prompt": "x"}
    assert cont.budget(completion, "completions", 30, 100) == 16
    assert cont.budget({**completion, "max_tokens": None}, "completions", 30, 100) == 16
    assert cont.budget({**completion, "max_tokens": 40}, "completions", 30, 100) == 40
    assert cont.budget({**completion, "max_tokens": 450}, "completions", 100, 512) == 412
    assert cont.budget(completion, "completions", 500, 512) == 12
    # A completion has no max_completion_tokens: vLLM ignores it there.
    assert cont.budget({**completion, "max_completion_tokens": 5}, "completions", 3, 100) == 16
    body = cont.continuation_body(chat, [1], [2, 3], limit=10, wants_usage=False)
    assert body["max_tokens"] == 8
    assert "max_tokens" not in cont.continuation_body(chat, [1], [2], limit=None, wants_usage=False)


def test_output_penalties_do_not_move() -> None:
    """vLLM counts frequency and presence penalties over the output alone."""
    base = {"model": "m", "prompt": "hi", "stream": True}
    assert cont.not_migratable({**base, "frequency_penalty": 1.0}, "completions")
    assert cont.not_migratable({**base, "presence_penalty": -0.5}, "completions")
    assert cont.not_migratable({**base, "frequency_penalty": 0.0}, "completions") is None
    assert cont.not_migratable({**base, "repetition_penalty": 1.3}, "completions") is None
    # A bad word's first tokens are matched against the output alone, too.
    assert cont.not_migratable({**base, "bad_words": ["x y"]}, "completions")
    assert cont.not_migratable({**base, "bad_words": []}, "completions") is None


def test_a_chat_whose_reasoning_is_hidden_does_not_move() -> None:
    """Its thoughts are generated without being shown (vLLM then hides the
    token ids too): a continuation would show the rest of them as text."""
    chat = {"model": "m", "messages": [], "stream": True}
    assert cont.not_migratable({**chat, "include_reasoning": False}, "chat") == "reasoning"
    assert cont.not_migratable({**chat, "include_reasoning": True}, "chat") is None


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
    limit = cont.budget(body, "chat", 3, None)
    out = cont.continuation_body(body, [1, 2, 3], [9] * 40, limit=limit, wants_usage=True)
    assert out["prompt"] == [1, 2, 3] + [9] * 40
    assert out["max_tokens"] == 60 and out["min_tokens"] == 0
    assert (out["temperature"], out["stop"], out["cache_salt"]) == (0.0, ["\n"], "s")
    # Moved on by the 40 tokens before the join: the seed again would draw the
    # numbers the stream began with.
    assert out["seed"] == 7 + 40
    assert out["ignore_eos"]
    assert out["stream"] and out["return_token_ids"]
    assert out["stream_options"] == {"include_usage": True}
    assert "messages" not in out


def test_a_field_the_continuation_would_drop_keeps_the_request_in_place() -> None:
    """vLLM takes fields Ferry does not carry over (repetition_detection,
    vllm_xargs, ...): a request that sets one stays where it is, one that
    leaves it null or sends only fields a continuation needs nothing of moves."""
    base = {"model": "m", "prompt": "hi", "stream": True}
    for field, value in (
        ("repetition_detection", {"max_pattern_size": 8}),
        ("vllm_xargs", {"x": 1}),
        ("thinking_token_budget", 100),
        ("logits_processors", ["p"]),
        ("kv_transfer_params", {"do_remote_decode": True}),
    ):
        assert cont.not_migratable({**base, field: value}, "completions") == (
            f"field not carried over: {field}"
        )
        assert cont.not_migratable({**base, field: None}, "completions") is None
    # The client names the field: a name of any length is shown no longer than a name needs.
    long = "x" * 10_000
    assert cont.not_migratable({**base, long: 1}, "completions") == (
        "field not carried over: " + "x" * cont.MAX_FIELD_SHOWN
    )
    chat = {"model": "m", "messages": [], "stream": True, "user": "u", "metadata": {"a": "b"}}
    extras = {"stream_options": {"include_usage": True}, "tool_choice": "none", "store": False}
    assert cont.not_migratable({**chat, **extras, "chat_template_kwargs": {}}, "chat") is None
    # What OpenAI's SDK sends and vLLM ignores moves.
    sdk = {"prompt_cache_key": "k", "safety_identifier": "s", "verbosity": "low"}
    assert cont.not_migratable({**chat, **sdk}, "chat") is None


def test_a_chat_with_an_image_does_not_move() -> None:
    """Its image is placeholder tokens in the prompt's ids: a continuation sent
    as ids would go on without it."""
    text = {"role": "user", "content": [{"type": "text", "text": "hi"}]}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    chat = {"model": "m", "stream": True}
    assert cont.not_migratable({**chat, "messages": [text]}, "chat") is None
    with_image = {"role": "user", "content": [image, {"type": "text", "text": "what is it?"}]}
    assert cont.not_migratable({**chat, "messages": [text, with_image]}, "chat") == (
        "multimodal input"
    )
    # vLLM reads a part without a type as media, by its key.
    typeless = {"role": "user", "content": [{"image_url": "http://x/cat.png"}]}
    assert cont.not_migratable({**chat, "messages": [typeless]}, "chat") == "multimodal input"


def test_a_budget_that_is_not_a_number_keeps_the_request_in_place() -> None:
    """vLLM reads "300" as 300; a continuation that read it otherwise would stop
    early or run to the end of the context, so such a request does not move."""
    base = {"model": "m", "prompt": "hi", "stream": True}
    for field in ("max_tokens", "max_completion_tokens", "min_tokens"):
        assert cont.not_migratable({**base, field: "300"}, "completions") == (
            f"{field} not an integer"
        )
        assert cont.not_migratable({**base, field: 300.5}, "completions") is not None
        assert cont.not_migratable({**base, field: 300.0}, "completions") is None
    body = {**base, "min_tokens": 250.0}
    assert (
        cont.continuation_body(body, [1], [2] * 50, limit=300, wants_usage=False)["min_tokens"]
        == 200
    )


def test_the_seed_at_the_join_stays_in_int64() -> None:
    body = {"model": "m", "prompt": "x", "stream": True, "seed": 2**63 - 2}
    out = cont.continuation_body(body, [1], [5, 6, 7], limit=10, wants_usage=False)
    assert out["seed"] == -(2**63) + 1
    assert None is cont.continuation_body(
        {**body, "seed": None}, [1], [5], limit=10, wants_usage=False
    ).get("seed")

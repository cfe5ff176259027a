"""Lite-mode migration, the pure part: continuing a request elsewhere, token-exact.

A request that produced prompt ids P and generated ids G on one instance goes
on on another as a `/v1/completions` request for prompt P + G with the token
budget reduced by |G| and the same sampling parameters. The destination's
chunks are rewritten so the client sees one stream (see `splicer`).

Exact at temperature 0. With sampling, the destination draws from the same
distribution; a `seed` cannot carry the random sequence over the join, so the
continuation's seed is the request's plus |G| (`_join_seed`): the same seed
again would draw the same numbers the stream began with, and on a model whose
next token depends little on its context, repeat its opening.
"""

from __future__ import annotations

from typing import Any

# Parameters that mean the same on a continuation as on the original request.
_SAMPLING = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logit_bias",
    "cache_salt",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "user",
    "priority",  # the engine's own (vLLM's priority scheduling), as the client set it
    "stream_interval",  # tokens per chunk: the continuation's chunks as the original's
)


# Fields a continuation needs nothing more of: the prompt's (its ids carry
# them), the transport's and the answer's shape (the splicer rebuilds it), and
# those `not_migratable` and `continuation_body` read. Any other field set is
# one the continuation would drop, so the request stays where it is.
_CARRIED = frozenset(
    {
        # the request and its answer's shape
        "model", "prompt", "messages", "stream", "stream_options", "n", "best_of",
        "return_token_ids", "request_id", "user", "metadata", "store", "service_tier",
        "suffix", "modalities", "session_id",
        # OpenAI's, that vLLM takes and ignores
        "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
        "safety_identifier", "verbosity", "prediction", "audio", "function_call",
        "moderation", "web_search_options",
        # budgets (`budget`, `continuation_body`)
        "max_tokens", "max_completion_tokens", "min_tokens",
        # what makes a request stay (`not_migratable`)
        "use_beam_search", "length_penalty", "response_format", "tools", "functions",
        "tool_choice", "parallel_tool_calls", "prompt_logprobs", "echo", "logprobs",
        "top_logprobs", "return_tokens_as_token_ids", "guided_decoding_backend",
        "guided_whitespace_pattern",
        # the prompt's making (applied already: the continuation sends its ids)
        "add_generation_prompt", "continue_final_message", "add_special_tokens",
        "documents", "chat_template", "chat_template_kwargs", "mm_processor_kwargs",
        "truncate_prompt_tokens", "truncation_side", "media_io_kwargs", "reasoning_effort",
        "include_reasoning", "enable_thinking", "bad_words",
    }
)  # fmt: skip


MAX_FIELD_SHOWN = 64  # characters of a field's name that a reason shows


def not_migratable(body: dict[str, Any], endpoint: str) -> str | None:
    """Why the request cannot move exactly, or None if it can."""
    if not body.get("stream"):
        return "not streamed (the proxy holds no generated ids until it ends)"
    best_of = body.get("best_of")  # (a count, or what the engine ignores)
    if (body.get("n") or 1) > 1 or (type(best_of) is int and best_of > 1):
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if _structured(body):
        return "structured output"
    if endpoint == "chat" and (body.get("tools") or body.get("functions")):
        return "tool calls"
    if endpoint == "chat" and _multimodal(body.get("messages")):
        # An image's place in the prompt is placeholder tokens; the continuation,
        # sent as token ids, would go on without the image.
        return "multimodal input"
    if body.get("prompt_logprobs") or body.get("echo"):
        return "prompt logprobs or echo"
    if any(body.get(k) for k in ("frequency_penalty", "presence_penalty", "bad_words")):
        # vLLM counts them over the output alone (a bad word of several tokens
        # is banned where the output ends in its first ones), and a
        # continuation's output starts at the cut: it would forget the tokens
        # before it.
        return "output penalties"
    if body.get("include_reasoning") is False:
        # The thoughts are generated but not shown, and a continuation (a
        # completion) would show the rest of them as text.
        return "reasoning"
    if _wants_logprobs(body, endpoint):
        # A continuation's logprobs are a completion's, offset from where it
        # starts; neither chat's shape nor the original's offsets.
        return "logprobs"
    if endpoint == "completions" and not isinstance(body.get("prompt"), str | list):
        return "no single prompt"
    if endpoint == "completions" and isinstance(body.get("prompt"), list):
        prompt = body["prompt"]
        if prompt and not all(isinstance(t, int) for t in prompt) and len(prompt) != 1:
            return "a batch of prompts"
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        if body.get(key) is not None and integer(body[key]) is None:
            return f"{key} not an integer"  # vLLM reads "300" as 300; Ferry does not guess
    dropped = sorted(
        k for k, v in body.items() if v is not None and k not in _CARRIED and k not in _SAMPLING
    )
    if dropped:  # repetition_detection, vllm_xargs, thinking_token_budget, ...
        # The client names the field: it goes after the colon, out of the label,
        # and no longer than a name needs into the log.
        return f"field not carried over: {dropped[0][:MAX_FIELD_SHOWN]}"
    return None


def _multimodal(messages: Any) -> bool:
    """Whether a chat's messages hold any part that is not text (vLLM reads a
    part without a type as media: `{"image_url": ...}`)."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and any(
            not isinstance(part, dict) or part.get("type") != "text" for part in content
        ):
            return True
    return False


def integer(value: Any) -> int | None:
    """A token count as JSON gives it: 150, or 150.0 (vLLM takes it for 150);
    None for anything else."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return None


# Fields that constrain decoding to a grammar: a continuation would start the
# grammar over in the middle of the output.
_STRUCTURED = (
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "structured_outputs",
)


def _structured(body: dict[str, Any]) -> bool:
    if any(body.get(k) is not None for k in _STRUCTURED):
        return True
    return body.get("response_format") not in (None, {"type": "text"})


def _wants_logprobs(body: dict[str, Any], endpoint: str) -> bool:
    """Chat's flag (`parse` made it a bool), or a completion's count of any
    kind (vLLM reads `"2"` and `2.0` as 2, and 0 still returns the token's)."""
    value = body.get("logprobs")
    if endpoint == "chat":
        return value is True
    return value is not None


# vLLM's default budget of a completion (a chat has none: it runs to the end of
# the context). A continuation is a completion, so it always says its own.
COMPLETIONS_MAX_TOKENS = 16


def budget(
    body: dict[str, Any], endpoint: str, prompt_tokens: int, context: int | None
) -> int | None:
    """How many tokens the request may generate in all, as vLLM reads it: a
    chat's `max_completion_tokens` or else `max_tokens` (a null or a 0 does not
    count), a completion's `max_tokens` or 16; a chat without either runs to the
    end of its `context` (the model's length; None when unknown: no limit known).
    vLLM trims any budget to the context the prompt leaves: so is this one."""
    left = None if context is None else max(0, context - prompt_tokens)
    asked = asked_budget(body, endpoint)
    if asked is None:
        return left
    return asked if left is None else min(asked, left)


def asked_budget(body: dict[str, Any], endpoint: str) -> int | None:
    """The budget a request sets, or vLLM's default for one without (None: a
    chat's, the context left)."""
    keys = ("max_completion_tokens", "max_tokens") if endpoint == "chat" else ("max_tokens",)
    for key in keys:
        value = integer(body.get(key))
        if value:
            return value
    if endpoint == "completions":
        return 0 if body.get("max_tokens") == 0 else COMPLETIONS_MAX_TOKENS
    return None


_INT64 = 2**64


def _join_seed(seed: int, generated: int) -> int:
    """The continuation's seed: the request's moved on by the tokens before the
    join, within int64 (the range vLLM takes), so a stream moved twice at the
    same cut draws alike, and its second half not as its first."""
    return (seed + generated + _INT64 // 2) % _INT64 - _INT64 // 2


def continuation_body(
    body: dict[str, Any],
    prompt_ids: list[int],
    generated: list[int],
    *,
    limit: int | None,
    wants_usage: bool,
) -> dict[str, Any]:
    """The `/v1/completions` body that continues `body` after `generated`, for
    at most `limit` tokens in all (see `budget`)."""
    out: dict[str, Any] = {
        "model": body["model"],
        "prompt": prompt_ids + generated,
        "stream": True,
        "return_token_ids": True,
    }
    for key in _SAMPLING:
        if key in body:
            out[key] = body[key]
    seed = integer(body.get("seed"))
    if seed is not None:
        out["seed"] = _join_seed(seed, len(generated))
    if limit is not None:
        out["max_tokens"] = limit - len(generated)
    least = integer(body.get("min_tokens"))
    if least is not None:
        out["min_tokens"] = max(0, least - len(generated))
    if wants_usage:
        out["stream_options"] = {"include_usage": True}
    return out

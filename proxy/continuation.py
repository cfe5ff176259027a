"""Lite-mode migration, the pure part: continuing a request elsewhere, token-exact.

A request that produced prompt ids P and generated ids G on one instance goes
on on another as a `/v1/completions` request for prompt P + G with the token
budget reduced by |G| and the same sampling parameters. The destination's
chunks are rewritten so the client sees one stream: the original id, created
and model, chat deltas for a chat request, usage counted once, and stop strings
honoured across the join (the destination cannot see a stop string that starts
in text it did not generate).

Exact at temperature 0. With sampling, the destination draws from the same
distribution, but a `seed` restarts its random sequence at the join.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    "bad_words",
    "allowed_token_ids",
    "user",
)


def not_migratable(body: dict[str, Any], endpoint: str) -> str | None:
    """Why the request cannot move exactly, or None if it can."""
    if not body.get("stream"):
        return "not streamed (the proxy holds no generated ids until it ends)"
    if (body.get("n") or 1) > 1 or (body.get("best_of") or 1) > 1:
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if any(
        k in body
        for k in (
            "response_format",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "structured_outputs",
        )
    ):
        if body.get("response_format", {"type": "text"}) != {"type": "text"}:
            return "structured output"
    if endpoint == "chat" and (body.get("tools") or body.get("functions")):
        return "tool calls"
    if body.get("prompt_logprobs") or body.get("echo"):
        return "prompt logprobs or echo"
    if endpoint == "completions" and not isinstance(body.get("prompt"), str | list):
        return "no single prompt"
    if endpoint == "completions" and isinstance(body.get("prompt"), list):
        prompt = body["prompt"]
        if prompt and not all(isinstance(t, int) for t in prompt) and len(prompt) != 1:
            return "a batch of prompts"
    return None


def max_tokens(body: dict[str, Any]) -> int | None:
    value = body.get("max_completion_tokens", body.get("max_tokens"))
    return value if isinstance(value, int) else None


def continuation_body(
    body: dict[str, Any], prompt_ids: list[int], generated: list[int], *, wants_usage: bool
) -> dict[str, Any]:
    """The `/v1/completions` body that continues `body` after `generated`."""
    out: dict[str, Any] = {
        "model": body["model"],
        "prompt": prompt_ids + generated,
        "stream": True,
        "return_token_ids": True,
    }
    for key in _SAMPLING:
        if key in body:
            out[key] = body[key]
    budget = max_tokens(body)
    if budget is not None:
        out["max_tokens"] = budget - len(generated)
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - len(generated))
    if body.get("logprobs") is not None:
        # chat: logprobs=true, top_logprobs=k; completions: logprobs=k
        top = body.get("top_logprobs", 0) if body.get("logprobs") is True else body["logprobs"]
        out["logprobs"] = top or 0
    if wants_usage:
        out["stream_options"] = {"include_usage": True}
    return out


@dataclass
class Origin:
    """Identity of the client's stream, from its first chunk."""

    id: str
    created: int
    model: str
    system_fingerprint: str | None = None


def client_chunk(
    chunk: dict[str, Any], endpoint: str, origin: Origin, *, wants_ids: bool
) -> dict[str, Any]:
    """A destination completion chunk rewritten as the client's stream expects it."""
    out_choices = []
    for choice in chunk.get("choices") or ():
        ids = choice.get("token_ids") if wants_ids else None
        if endpoint == "chat":
            delta = {"content": choice.get("text", "")}
            out_choices.append(
                {
                    "index": choice.get("index", 0),
                    "delta": delta,
                    "logprobs": None,  # completion-style logprobs do not map onto chat's shape
                    "finish_reason": choice.get("finish_reason"),
                    "token_ids": ids,
                    **({"stop_reason": choice["stop_reason"]} if "stop_reason" in choice else {}),
                }
            )
        else:
            out_choices.append({**choice, "token_ids": ids, "prompt_token_ids": None})
    out: dict[str, Any] = {
        "id": origin.id,
        "object": "chat.completion.chunk" if endpoint == "chat" else "text_completion",
        "created": origin.created,
        "model": origin.model,
        "choices": out_choices,
    }
    if origin.system_fingerprint:
        out["system_fingerprint"] = origin.system_fingerprint
    return out


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class StopAcrossJoin:
    """Finds a stop string that starts before the join and ends after it.

    `tail` is the end of the text the client already has. Each piece of new text
    is checked with the tail in front until the new text alone is as long as the
    longest stop string; after that the destination's own check suffices.
    """

    def __init__(self, stops: list[str], tail: str, include_stop: bool) -> None:
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)
        self.tail = tail[-self.longest :] if self.longest else ""
        self.new = ""
        self.include_stop = include_stop

    @property
    def active(self) -> bool:
        return bool(self.stops) and len(self.new) < self.longest

    def feed(self, text: str) -> tuple[str, str | None]:
        """(text to pass on, the stop string hit or None)."""
        if not self.active:
            return text, None
        before = len(self.tail) + len(self.new)
        window = self.tail + self.new + text
        self.new += text
        hit_at, hit = None, None
        for stop in self.stops:
            at = window.find(stop, max(0, len(self.tail) - len(stop) + 1))
            if at != -1 and at < len(self.tail) and (hit_at is None or at < hit_at):
                hit_at, hit = at, stop
        if hit is None or hit_at is None:
            return text, None
        end = hit_at + len(hit) if self.include_stop else hit_at
        return window[before:end] if end > before else "", hit


def stop_strings(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop]
    if isinstance(stop, list):
        return [s for s in stop if isinstance(s, str)]
    return []

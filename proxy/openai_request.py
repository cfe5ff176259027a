"""Validating an OpenAI request body before it is dispatched.

Only what Ferry needs is checked (it is a proxy, not the engine): a JSON object,
a string `model`, and the field each endpoint cannot do without. Everything
else is the engine's to judge, and its 4xx answers pass through unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.policy import Priority

PRIORITY_HEADER = "x-ferry-priority"

# Characters per token when a prompt arrives as text. Byte-level BPE vocabularies
# average 3-4; the estimate only lasts until the engine reports the exact count.
CHARS_PER_TOKEN = 3


class BadRequest(ValueError):
    def __init__(self, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    body: dict[str, Any]
    model: str
    priority: Priority
    prompt_estimate: int


def parse(raw: bytes, endpoint: str, priority_header: str | None) -> OpenAIRequest:
    """`endpoint` is "completions" or "chat"."""
    priority = Priority.NORMAL
    if priority_header is not None:
        try:
            priority = Priority.parse(priority_header)
        except ValueError as exc:
            raise BadRequest(f"header {PRIORITY_HEADER}: {exc}") from None
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    try:
        body = json.loads(raw)
    except RecursionError:  # hostile nesting: json's C parser recurses per level
        raise BadRequest("request body is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required and must be a non-empty string", param="model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' is required and must be a non-empty list", param="messages"
            )
        estimate = sum(_text_tokens(m.get("content")) for m in messages if isinstance(m, dict))
    else:
        if "prompt" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        estimate = _prompt_tokens(body["prompt"])
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    return OpenAIRequest(body, model, priority, max(1, estimate))


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return len(prompt) // CHARS_PER_TOKEN
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # a batch of prompts: the request holds them all
        return sum(_prompt_tokens(p) for p in prompt)
    return 0


def _text_tokens(content: Any) -> int:
    if isinstance(content, str):
        return len(content) // CHARS_PER_TOKEN
    if isinstance(content, list):  # content parts
        return sum(_text_tokens(p.get("text")) for p in content if isinstance(p, dict))
    return 0

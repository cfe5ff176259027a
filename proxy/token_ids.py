"""Reading and hiding the token ids vLLM reports when asked (`return_token_ids`).

Ferry asks every request for token ids so its ledger counts tokens exactly
(a chunk can carry a token with empty text, so text is no measure). Where the
client did not ask for them, the fields are set back to null: exactly what
vLLM sends without the flag.
"""

from __future__ import annotations

from typing import Any

from adapters.vllm import TOKEN_ID_REQUEST_FIELDS


def upstream_body(body: dict[str, Any]) -> tuple[dict[str, Any], bool]:
    """The body to send upstream, and whether the client asked for token ids itself."""
    wants = bool(body.get("return_token_ids"))
    if wants:
        return body, True
    return {**body, **TOKEN_ID_REQUEST_FIELDS}, False


def count(obj: dict[str, Any]) -> tuple[int | None, int]:
    """(prompt tokens if this object reports them, tokens generated in it).

    Works on a stream chunk or a whole response, for completions and chat:
    completions put `prompt_token_ids` on the choice, chat at the top level.
    """
    prompt: int | None = None
    top = obj.get("prompt_token_ids")
    if isinstance(top, list):
        prompt = len(top)
    generated = 0
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                generated += len(ids)
            if prompt is None:
                p = choice.get("prompt_token_ids")
                if isinstance(p, list):
                    prompt = len(p)
    return prompt, generated


def hide(obj: dict[str, Any]) -> None:
    """Null the token-id fields the proxy asked for, in place."""
    if obj.get("prompt_token_ids") is not None:
        obj["prompt_token_ids"] = None
    choices = obj.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                if choice.get("token_ids") is not None:
                    choice["token_ids"] = None
                if choice.get("prompt_token_ids") is not None:
                    choice["prompt_token_ids"] = None


def has_text(obj: dict[str, Any]) -> bool:
    """Whether a chunk carries generated text (for engines without token ids)."""
    for choice in obj.get("choices") or ():
        if isinstance(choice, dict):
            delta = choice.get("delta")
            text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
            if text:
                return True
    return False

"""Token counts for the ledger: read from the token ids an engine reports when
asked, else estimated from the text.

An engine whose adapter has `token_id_request_fields` (vLLM: `return_token_ids`)
is asked for ids on every request, so the ledger counts tokens exactly (a chunk
can carry a token with empty text, so text is no measure). Where the client did
not ask for them, the fields are set back to null: exactly what the engine sends
without the flag. An engine that reports no ids (`engine: openai`) gets nothing
extra, and its tokens are estimated from the text and the `usage` block.

`scan` and `hide` run once per relayed chunk, so they work on the bytes with
regular expressions instead of a JSON round trip (4-5x cheaper per chunk). That
is exact for JSON: inside a JSON string a quote is escaped, so `"token_ids":[`
can only match a real key, and the arrays hold integers only (never a newline,
so a match cannot run from one SSE event into the next).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

_IDS = re.compile(rb'"(prompt_token_ids|token_ids)"\s*:\s*\[([^\]\n]*)\]')
# `hide` replaces each field with a literal: a template such as rb'"\1":null'
# is expanded in Python for every match, 4x the cost of the whole substitution.
_GENERATED_IDS = re.compile(rb'"token_ids"\s*:\s*\[[^\]\n]*\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids"\s*:\s*\[[^\]\n]*\]')
_PROMPT_KEY = b'"prompt_token_ids"'
_INDEX = re.compile(rb'"index"\s*:\s*(\d+)')  # a choice's (in a chunk that reports prompt ids)
# OpenAI's rule of thumb for English: about 4 characters a token. Only engines
# that report no ids are counted this way; a wrong guess shifts their block
# count, not which requests they hold.
CHARS_PER_TOKEN = 4
# Where generated text sits in a choice: a stream's delta, a chat message, or
# the choice itself (completions); reasoning text fills the KV cache too.
_TEXT_KEYS = ("content", "reasoning_content", "reasoning", "text")


class Estimate(NamedTuple):
    prompt_tokens: int | None  # the `usage` block's count, when present
    generated_tokens: int  # tokens to add to what was counted so far
    has_text: bool  # the data carries generated text (a token for timing)


def upstream_body(
    body: dict[str, Any], token_id_fields: Mapping[str, Any]
) -> tuple[dict[str, Any], bool]:
    """The body to send to an engine whose adapter asks for ids with
    `token_id_fields`, and whether the answer goes to the client as it comes:
    true when the client asked for the ids itself, or when nothing was added."""
    if all(body.get(key) == value for key, value in token_id_fields.items()):
        return body, True
    if body.get("echo"):
        # vLLM 0.32 leaves a completion's echoed prompt out of its text when asked
        # for token ids; such a request cannot move anyway, and its tokens are
        # estimated instead.
        return body, True
    return {**body, **token_id_fields}, False


def scan(data: bytes) -> tuple[int | None, int, int, bool]:
    """(the prompt ids reported, summed over the choices that report them, if
    any; the longest of them; tokens generated; whether any id field was seen)
    in one stream chunk or whole response, completions or chat. `PromptCount`
    makes the request's prompt tokens of the first two."""
    prompt: int | None = None
    longest = generated = 0
    seen = False
    for key, ids in _IDS.findall(data):  # (findall: half finditer's cost per chunk)
        seen = True
        n = ids.count(b",") + 1 if ids.strip() else 0
        if key == b"token_ids":
            generated += n
        else:  # (a stream's first chunk of each choice only)
            prompt = n if prompt is None else prompt + n
            longest = max(longest, n)
    return prompt, longest, generated, seen


class PromptCount:
    """A request's prompt tokens from the prompt ids its answer reports, as the
    engine's `usage` counts them. Each choice reports its prompt's ids (a
    stream in its first chunk): the `n` choices of one prompt the same ones, a
    batch's prompts (a completion's list of them) each their own; the count is
    the sum over the prompts. Until every choice has reported (a stream), the
    longest prompt seen stands for the rest. A stream chunk of choices that
    reported already (a server that repeats the ids on every chunk) adds none."""

    __slots__ = ("per_prompt", "reported", "longest", "choices")

    def __init__(self, body: Mapping[str, Any] | None) -> None:
        n = body.get("n") if body is not None else None
        self.per_prompt = n if type(n) is int and n > 0 else 1
        self.reported = self.longest = 0
        self.choices: set[bytes] = set()  # the `index` of each that reported

    def add(self, reported: int, longest: int, data: bytes = b"") -> int:
        """Take in what `scan` found of the prompt ids in `data`; the count so far."""
        choices = set(_INDEX.findall(data))
        if not choices or not choices <= self.choices:
            self.choices |= choices
            self.reported += reported
            self.longest = max(self.longest, longest)
        return max(self.longest, -(-self.reported // self.per_prompt))


def prompt_ids(data: bytes) -> list[int] | None:
    """The prompt ids a chunk or response reports (the first stream chunk does)."""
    for match in _IDS.finditer(data):
        if match.group(1) == b"prompt_token_ids":
            ids = match.group(2)
            try:
                return [int(t) for t in ids.split(b",")] if ids.strip() else []
            except ValueError:  # not integers: an engine that is not what it says
                return None
    return None


def hide(data: bytes) -> bytes:
    """Null the token-id arrays the proxy asked for (in any number of events)."""
    data = _GENERATED_IDS.sub(b'"token_ids":null', data)
    # Only a stream's first chunk has prompt ids; the others (`null`) skip the pass.
    if data.count(_PROMPT_KEY) != data.count(_PROMPT_KEY + b":null"):
        data = _PROMPT_IDS.sub(b'"prompt_token_ids":null', data)
    return data


def estimate(data: bytes, counted: int) -> Estimate:
    """Tokens in one stream chunk or whole response of an engine that reports no
    ids, `counted` being what the ledger has for the request so far.

    A `usage` block is the engine's own count: the generated tokens become its
    `completion_tokens` (never fewer than counted). Otherwise each choice's text
    counts ceil(characters / 4) tokens, at least one where there is any text.
    """
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError):
        return Estimate(None, 0, False)
    if not isinstance(obj, dict):
        return Estimate(None, 0, False)
    chars, has_text = 0, False
    choices = obj.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if isinstance(choice, dict):
            for part in (choice.get("delta"), choice.get("message"), choice):
                n = _text_chars(part)
                chars += n
                has_text = has_text or n > 0
    usage = obj.get("usage")
    prompt = completion = None
    if isinstance(usage, dict):
        prompt = _count(usage.get("prompt_tokens"))
        completion = _count(usage.get("completion_tokens"))
    if completion is not None:
        return Estimate(prompt, max(0, completion - counted), has_text)
    return Estimate(prompt, -(-chars // CHARS_PER_TOKEN), has_text)


def _text_chars(part: Any) -> int:
    if not isinstance(part, dict):
        return 0
    return sum(len(v) for k in _TEXT_KEYS if isinstance(v := part.get(k), str))


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

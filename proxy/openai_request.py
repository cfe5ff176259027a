"""Validating an OpenAI request body before it is dispatched.

Only what Ferry needs is checked (it is a proxy, not the engine): a JSON object,
`model` a string if given, the field each endpoint cannot do without, and the type of the
fields Ferry itself reads. Everything else is the engine's to judge, and its 4xx
answers pass through unchanged. Bodies are read strictly (`read_object`), so
that whatever Ferry accepts it can also re-encode and inspect without failing.
"""

from __future__ import annotations

import codecs
import json
import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.policy import Priority

PRIORITY_HEADER = "x-ferry-priority"
JSON = "application/json"
MULTIPART = "multipart/form-data"
MAX_SHOWN = 100  # characters of a client's header that an error shows
# A form part's Content-Disposition, and its parameters: `; key=value`, the
# value a token or a quoted string.
_DISPOSITION = re.compile(rb"(?im)^content-disposition:([^\r\n]*)")
_PARAMETER = re.compile(rb';\s*([^\s=;]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')

# Bytes of UTF-8 per token when a prompt arrives as text: 3 characters of English
# (byte-level BPE vocabularies average 3-4), a Chinese character (a token or
# two). The estimate only lasts until the engine reports the exact count.
BYTES_PER_TOKEN = 3
# Nesting levels a body may have. JSON Schemas in `tools` and `response_format`
# nest tens of levels; json's C parser and encoder recurse once per level and hit
# Python's stack limit (1000 frames, shared with the handler's) near 980.
MAX_DEPTH = 128
# A body may hold at most this many `[` and `{` (counted at C speed, strings
# too, before it is read): each empty object read costs Python ~100 bytes and
# its walk, so 32 MiB of `{},` made 1.6 GB and 12 s of work. A real request
# holds a few thousand (a batch of token-id lists: one per prompt).
MAX_BRACKETS = 1_000_000
# Fields Ferry reads itself (migration, usage): a wrong type is the client's 400.
_FIELD_KINDS: dict[str, tuple[type, str]] = {
    "stream_options": (dict, "an object"),
    "kv_transfer_params": (dict, "an object"),
}
# Counts Ferry reads itself. vLLM reads them as pydantic does (2, 2.0 and "2"
# are all 2): Ferry takes the same, made an int in place.
# (`seed` too: a continuation draws on from the seed plus the tokens generated,
# which a seed read as the string "42" would not.)
_COUNTS = ("n", "best_of", "seed")
# vLLM 0.32 dropped `best_of`: it ignores one it cannot read, so Ferry reads it
# only where it is a count, and refuses nothing for it.
_IGNORED_COUNTS = frozenset({"best_of"})


# Flags Ferry reads itself. vLLM reads a flag as pydantic does (`"true"`, `1`,
# `"off"`...): Ferry takes the same, as true or false, so that it reads them
# as the engine will (`"false"` is a truthy string).
_FLAGS = ("stream", "echo", "ignore_eos", "include_stop_str_in_output", "return_token_ids",
          "use_beam_search")  # fmt: skip
_STREAM_FLAGS = ("include_usage", "continuous_usage_stats")
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


# A body past this is read (and written again for an instance) in a worker
# thread: reading one can take seconds of Python (near `MAX_BRACKETS` of them; a
# long multipart form), and the event loop serves every other stream meanwhile
# (the GIL passes between them every few ms). A smaller one is done sooner than
# the hop to a thread takes.
OFF_LOOP_BYTES = 64 * 1024


class BadRequest(ValueError):
    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status
        self.headers = headers  # of the answer (a 503's Retry-After)


@dataclass(frozen=True, slots=True)
class OpenAIRequest:
    body: dict[str, Any]
    model: str | None  # None: the body names none (vLLM then serves its own)
    priority: Priority
    prompt_estimate: int


@dataclass(frozen=True, slots=True)
class PassThrough:
    """What Ferry reads of a body it sends on as it came."""

    model: str | None  # None: any instance will do
    stream: bool  # the body asks for a stream (an idle timeout applies)


def priority_of(header: str | None) -> Priority:
    """The priority the `x-ferry-priority` header says (its values joined by
    commas, as a header sent twice reads: RFC 9110 5.3), normal if none; one
    priority however often it is said, two are refused."""
    if header is None:
        return Priority.NORMAL
    try:
        said = {Priority.parse(value) for value in header.split(",")}
    except ValueError as exc:
        raise BadRequest(f"header {PRIORITY_HEADER}: {exc}") from None
    if len(said) > 1:
        names = ", ".join(sorted(p.name.lower() for p in said))
        raise BadRequest(f"header {PRIORITY_HEADER}: one priority, not several ({names})")
    (priority,) = said
    return priority


def parse(
    raw: bytes, endpoint: str, priority_header: str | None, content_type: str = JSON
) -> OpenAIRequest:
    """`endpoint` is "completions" or "chat"; `content_type` the header as sent."""
    priority = priority_of(priority_header)
    if content_type.split(";", 1)[0].strip().lower() != JSON:
        # 400, as vLLM answers it (the `openai` client's BadRequestError), not 415.
        shown = f"'{content_type[:MAX_SHOWN]}'" if content_type else "none"
        raise BadRequest(f"Content-Type must be {JSON}, not {shown}")
    if not raw:
        raise BadRequest("request body is empty; expected a JSON object")
    body = read_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest(
                "'messages' is required and must be a non-empty list", param="messages"
            )
        estimate = sum(_text_tokens(m.get("content")) for m in messages if isinstance(m, dict))
    else:
        if "prompt" not in body and "prompt_embeds" not in body:
            raise BadRequest("'prompt' is required", param="prompt")
        estimate = _prompt_tokens(body.get("prompt"))
    _read_flags(body, _FLAGS + (("logprobs",) if endpoint == "chat" else ()), "")
    if isinstance(body.get("stream_options"), dict):
        body["stream_options"] = dict(body["stream_options"])
        _read_flags(body["stream_options"], _STREAM_FLAGS, "stream_options.")
    for key, (kind, name) in _FIELD_KINDS.items():
        value = body.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
            raise BadRequest(f"'{key}' must be {name}", param=key)
    for key in _COUNTS:
        if body.get(key) is not None:
            count = _count(body[key])
            if count is not None:
                body[key] = count
            elif key not in _IGNORED_COUNTS:
                raise BadRequest(f"'{key}' must be an integer", param=key)
    return OpenAIRequest(body, model or None, priority, max(1, estimate))


def _count(value: Any) -> int | None:
    """An integer as pydantic's lax mode reads one: 2, 2.0, "2", "2.0", "2_000",
    or true (1); None otherwise. A string is read exactly (a seed of 19 digits
    is not a float's nearest)."""
    if isinstance(value, str):
        found = _DECIMAL.fullmatch(value.strip())
        return int(found[1]) if found else None
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    return int(value) if isinstance(value, int) else None


_DECIMAL = re.compile(r"([-+]?\d+(?:_\d+)*)(?:\.0*)?")


def _read_flags(body: dict[str, Any], names: tuple[str, ...], where: str) -> None:
    """Each flag set in `body` made a bool in place, read as vLLM reads it."""
    for name in names:
        value = body.get(name)
        if value is None or isinstance(value, bool):
            continue
        flag = _flag(value)
        if flag is None:
            raise BadRequest(f"'{where}{name}' must be a boolean", param=where + name)
        body[name] = flag


def _flag(value: Any) -> bool | None:
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()  # (no spaces: pydantic refuses " true")
        return True if word in _TRUE else False if word in _FALSE else None
    return None


def invocation_kind(raw: bytes) -> str | None:
    """What SageMaker's `/invocations` body is, as vLLM tells: "chat" (it has
    `messages`), "completions" (`prompt`), or None (anything else: it passes
    through, and the pass-through says what is wrong with a bad body)."""
    if _brackets(raw) > MAX_BRACKETS:
        return None
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if isinstance(body, dict) and "messages" in body:
        return "chat"
    if isinstance(body, dict) and "prompt" in body:
        return "completions"
    return None


def parse_passthrough(raw: bytes, content_type: str, boundary: str | None = None) -> PassThrough:
    """A body Ferry sends on unchanged. A JSON one is read (strictly, as by
    `parse`) for its `model`, a multipart form (an audio upload) for its fields
    `model` and `stream` (`boundary`: the Content-Type's); any other, or none,
    names no model."""
    if raw and content_type == MULTIPART and boundary:
        stream = form_field(raw, boundary, b"stream")
        return PassThrough(form_model(raw, boundary), _flag(stream) is True)
    if not raw or content_type != JSON:
        return PassThrough(None, False)
    body = read_object(raw)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", param="model")
    return PassThrough(model, _flag(body.get("stream")) is True)


def form_model(raw: bytes, boundary: str) -> str | None:
    return form_field(raw, boundary, b"model")


def form_field(raw: bytes, boundary: str, name: bytes) -> str | None:
    """The value of the field `name` in a multipart/form-data body (RFC 7578;
    the last, if several, as Starlette reads it), or None. Only the parts'
    headers are searched: a file is skipped over, never copied."""
    dash = b"--" + boundary.encode("latin-1", "replace")
    delimiter = b"\r\n" + dash
    at = 0 if raw.startswith(dash) else raw.find(delimiter) + 2  # past any preamble
    if at == 1:
        return None  # no delimiter at all
    value = None
    while True:
        head = at + len(dash)
        head_end = raw.find(b"\r\n\r\n", head)
        if raw.startswith(b"--", head) or head_end < 0:
            return value  # the closing delimiter, or a cut body
        end = raw.find(delimiter, head_end + 4)
        if end < 0:
            return value
        if _field_name(raw[head:head_end]) == name:
            value = raw[head_end + 4 : end].decode("utf-8", "replace")
        at = end + 2


def _field_name(head: bytes) -> bytes | None:
    """A part's name, from its Content-Disposition's parameters (a quoted one
    may hold `;` and `name=`)."""
    line = _DISPOSITION.search(head)
    if line is None:
        return None
    for key, value in _PARAMETER.findall(line.group(1)):
        if key.lower() == b"name":
            return value[1:-1].replace(b'\\"', b'"') if value.startswith(b'"') else value
    return None


def read_object(raw: bytes) -> dict[str, Any]:
    """`raw` as a JSON object, read strictly (RFC 8259): UTF-8, a leading byte
    order mark ignored; no NaN, Infinity or numbers that overflow to them; no
    duplicate keys (which one would an engine take?); at most `MAX_DEPTH` levels
    and `MAX_BRACKETS` brackets."""
    if raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8) :]
    brackets = _brackets(raw)
    if brackets > MAX_BRACKETS:
        raise BadRequest(
            f"request body has {brackets:,} brackets; at most {MAX_BRACKETS:,} are read"
        )
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise BadRequest(
            f"request body is not UTF-8 (byte {exc.start}: {exc.reason}); JSON must be UTF-8"
        ) from None
    try:
        body = json.loads(
            text, object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite
        )
    except RecursionError:  # hostile nesting: json's C parser recurses per level
        raise BadRequest("request body is nested too deeply") from None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if brackets > MAX_DEPTH and _deeper_than(MAX_DEPTH, body):
        raise BadRequest(f"request body is nested more than {MAX_DEPTH} levels deep")
    return body


def _brackets(raw: bytes) -> int:
    """How many arrays and objects `raw` may open (its strings' brackets too), at C speed."""
    return raw.count(b"[") + raw.count(b"{")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) < len(pairs):
        counts = Counter(k for k, _ in pairs)
        duplicate = next(k for k, n in counts.items() if n > 1)
        raise ValueError(f"duplicate key {duplicate!r}")
    return obj


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"number {literal[:20]} is out of range")
    return value


def _deeper_than(limit: int, value: Any) -> bool:
    # (The caller's fast path: a body cannot nest deeper than it has brackets.)
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            return True
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                stack.append((child, depth + 1))
    return False


def utf8_size(text: str) -> int:
    """The bytes of `text` in UTF-8 (a lone surrogate, which JSON may carry, as 3)."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def text_tokens(text: str) -> int:
    """A text's tokens, estimated: a token every 3 bytes of UTF-8. By bytes, not
    characters: a Chinese character or an emoji is a token or more, where 3
    characters of English are one."""
    return utf8_size(text) // BYTES_PER_TOKEN


def _prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # a batch of prompts: the request holds them all
        return sum(_prompt_tokens(p) for p in prompt)
    return 0


def _text_tokens(content: Any) -> int:
    if isinstance(content, str):
        return text_tokens(content)
    if isinstance(content, list):  # content parts
        return sum(_text_tokens(p.get("text")) for p in content if isinstance(p, dict))
    return 0

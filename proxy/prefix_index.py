"""Where each instance's prefix cache probably is: an approximate prefix index.

vLLM caches a prompt's KV in blocks of `block_size` tokens, each block keyed by
a hash chained over every block before it, so a block hit implies the whole
prefix up to it. This module keeps, per instance, the chained hashes of what
Ferry sent there, in an LRU bounded by the engine's cache size (kv_blocks_total
from the scrape), and answers how long a new request's cached prefix is on each.

Two keys, because Ferry has no token ids when it places a request:
- **text chunks** (what dispatch reads): the prompt text (a prompt of token ids
  as the ids' text), or the chat messages rendered `role NUL content SOH`, cut
  into chunks of `block_size * BYTES_PER_TOKEN` bytes of UTF-8 (the 3 bytes a
  token the prompt's estimate counts: 3 characters of English, a Chinese
  character) and hashed in a chain, like vllm-router's `cache_aware` approximate
  tree over the request text. A chunk stands for `block_size` tokens.
  Approximations: the chat template's tokens are not counted, and a chunk
  boundary is not a block boundary, so the cached length in tokens is matched
  chunks * block_size, capped at the request's estimate
  and cut to whole blocks of the instance's engine (vLLM reuses whole blocks
  only). Inserted when a request is placed (before the engine has it), as
  vllm-router does.
- **token blocks** (what a move reads): the prompt ids the engine reports
  (`return_token_ids`) hashed over full blocks exactly as vLLM chains them, but
  with Python's `hash`, not vLLM's sha256: it needs to match itself, not the
  engine.

**Precise mode**: an instance whose engine publishes KV events (its `kv_events:`
endpoint) gets an `EngineBlocks` (proxy/engine_blocks.py), the engine's own set
of cached blocks, followed by proxy/kv_events.py. While it is synced, token-id
lookups on that instance read it instead of Ferry's guess, so a prefix the
engine evicted stops counting and one cached by traffic that bypassed Ferry
starts. Text-keyed lookups (chat, text prompts: Ferry has no token ids before
the engine answers) stay approximate everywhere; on a precise instance the text
chunks are dropped when the engine drops its whole cache (a clear, a restart).

Eviction is LRU over chunks, a stand-in for vLLM's LRU over free blocks: a block
in use by a running request is never evicted there, so the index may forget a
prefix the engine still has (never the reverse for long). The generated tokens
of each request that ends take their blocks' room too (`record_generated`).

Pure data structure: no I/O, no clock. Hashes use Python's `hash`, salted per
process for text (PYTHONHASHSEED), which is fine for an in-memory index.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from adapters.kv_events import KVEventsFormat
from proxy import openai_request
from proxy.engine_blocks import EngineBlocks, LazyChain, token_block_hashes

# A text chunk of `block_size` tokens is this many bytes of UTF-8: the ratio the
# prompt's own estimate uses (proxy/openai_request.py), so a prompt cached whole
# is credited its whole estimate (at 4, three quarters of it), in any script.
BYTES_PER_TOKEN = openai_request.BYTES_PER_TOKEN
DEFAULT_CAPACITY_BLOCKS = 4096  # until the engine's cache size is known
MAX_SESSION_CHARS = 256  # a session named longer is kept by its digest
# A prompt's chunks hashed at most (128k tokens at 16 a block): longer ones are
# keyed by their start. Hashing and recording run on the event loop at dispatch;
# a 32 MB prompt's 500,000 chunks held it for a second.
MAX_PROMPT_CHUNKS = 8192
_SEED = 0x5EED


def text_chunk_hashes(
    text: str | bytes, chunk_size: int, seed: int = _SEED, limit: int = MAX_PROMPT_CHUNKS
) -> list[int]:
    """Chained hashes of the full `chunk_size`-long chunks of `text`, the first
    `limit` of them."""
    hashes, prev = [], seed
    end = min(len(text), limit * chunk_size) - chunk_size + 1
    for start in range(0, end, chunk_size):
        prev = hash((prev, text[start : start + chunk_size]))
        hashes.append(prev)
    return hashes


def _namespace(body: Mapping[str, Any] | None) -> int:
    """The seed of a request's chain: vLLM shares cached blocks only between
    requests of one LoRA adapter (its name, as the request's model) and one
    `cache_salt`, so neither a prompt of another adapter nor another salt is
    credited as cached."""
    if body is None:
        return _SEED
    return hash((_SEED, str(body.get("model")), str(body.get("cache_salt"))))


def prompt_ids(body: Mapping[str, Any] | None, limit: int | None = None) -> tuple[int, ...] | None:
    """A completion's prompt when the client sent token ids (then dispatch can
    look it up precisely), its first `limit`; None otherwise."""
    prompt = body.get("prompt") if body is not None else None
    if isinstance(prompt, list) and prompt:
        ids = prompt[:limit]
        if all(type(t) is int for t in ids):
            return tuple(ids)
    return None


def prompt_text(body: Mapping[str, Any] | None, limit: int | None = None) -> str:
    """The text a request's prompt starts with, its first `limit` characters or
    more: a completion's prompt, or the chat messages rendered `role NUL content
    SOH`; "" when there is none to key on."""
    if body is None:
        return ""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts, size = [], 0
        for m in messages:
            if isinstance(m, dict):
                parts.append(f"{m.get('role', '')}\0{_content_text(m.get('content'), limit)}\1")
                size += len(parts[-1])
                if limit is not None and size >= limit:
                    break
        return "".join(parts)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    # As many ids as `limit` is tokens.
    ids = prompt_ids(body, None if limit is None else limit // BYTES_PER_TOKEN)
    return _ids_text(ids) if ids is not None else ""


def _ids_text(ids: Sequence[int]) -> str:
    """Token ids as text: the same chunking applies."""
    return ",".join(map(str, ids))


def _whole_ids(text: str, chars: int) -> int:
    """How many ids of `_ids_text`'s `text` lie whole in its first `chars` characters."""
    return text.count(",", 0, chars) + (chars >= len(text))


def _content_text(content: Any, limit: int | None = None) -> str:
    """A message's text, its first `limit` characters: parts past them are not
    read (a chat of a million parts took the event loop a tenth of a second)."""
    if isinstance(content, str):
        return content[:limit]
    if isinstance(content, list):  # content parts
        texts, size = [], 0
        for p in content:
            if isinstance(p, dict) and "text" in p:
                texts.append(str(p.get("text", "")))
                size += len(texts[-1])
                if limit is not None and size >= limit:
                    break
        return "".join(texts)[:limit]
    return ""


def session_of(body: Mapping[str, Any] | None, header: str | None) -> str | None:
    """The session a request belongs to: `x-session-id`, else the body's `user`;
    one longer than MAX_SESSION_CHARS by its digest (the index keeps up to
    `max_sessions` of them, and a body's `user` may be megabytes long)."""
    session = header
    if not session:
        user = body.get("user") if body is not None else None
        session = user if isinstance(user, str) and user else None
    if session is not None and len(session) > MAX_SESSION_CHARS:
        digest = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16)
        return "#" + digest.hexdigest()
    return session


class _Taken:
    """Room in the engine's cache taken by blocks Ferry keeps no hashes of (a
    request's generated tokens), in the LRU where it was taken."""

    __slots__ = ("blocks",)

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks


class BlockLRU:
    """A set of chained block hashes, least recently used first out past
    `capacity`; room taken by blocks without hashes (`take`) counts too."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._blocks: OrderedDict[int | _Taken, None] = OrderedDict()
        self._taken = 0  # blocks held by _Taken entries
        self._entries_taken = 0  # how many _Taken entries

    def __len__(self) -> int:
        return len(self._blocks) - self._entries_taken

    def __iter__(self) -> Iterator[int]:
        return (h for h in self._blocks if not isinstance(h, _Taken))

    def insert(self, hashes: Iterable[int]) -> list[int]:
        """Hold `hashes` (most recent last); returns the hashes evicted for room."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        return self._evict()

    def take(self, blocks: int) -> list[int]:
        """`blocks` of the cache went to tokens Ferry has no hashes of; returns
        the hashes evicted for room."""
        if blocks > 0:
            self._blocks[_Taken(blocks)] = None
            self._taken += blocks
            self._entries_taken += 1
        return self._evict()

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading hashes are held (chained: the prefix up to the first miss)."""
        blocks, n = self._blocks, 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def resize(self, capacity: int) -> list[int]:
        self.capacity = max(1, capacity)
        return self._evict()

    def _evict(self) -> list[int]:
        blocks, evicted = self._blocks, []
        while (over := len(blocks) - self._entries_taken + self._taken - self.capacity) > 0:
            oldest = next(iter(blocks))
            if not isinstance(oldest, _Taken):
                blocks.popitem(last=False)
                evicted.append(oldest)
            elif oldest.blocks > over:  # part of that room is enough
                oldest.blocks -= over
                self._taken -= over
            else:
                del blocks[oldest]
                self._taken -= oldest.blocks
                self._entries_taken -= 1
        return evicted


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """What dispatch knows of a request's prefix: its text chunk hashes (for a
    chunk of `chunk_size` bytes), its estimated prompt tokens, its session, and its
    token ids when the client sent them."""

    chunks: tuple[int, ...]
    prompt_tokens: int
    session: str | None = None
    token_ids: tuple[int, ...] | None = None
    model: str | None = None
    salted: bool = False  # a `cache_salt`: the engine's first block hashes it in


@dataclass(slots=True)
class InstancePrefixes:
    text: BlockLRU
    tokens: BlockLRU
    mode: str = "approximate"  # approximate | off
    block_size: int = 0  # the engine's, in tokens (0: not known)


@dataclass(slots=True)
class PrefixIndex:
    """Every instance's prefix index, plus the last instance of each session.

    `block_size` sets the chunk: `block_size * BYTES_PER_TOKEN` bytes (every
    instance is keyed with one chunk size so one request hashes once).
    """

    block_size: int = 16
    enabled: bool = True  # off: nothing is recorded and every lookup is empty
    max_sessions: int = 65536
    instances: dict[str, InstancePrefixes] = field(default_factory=dict)
    sessions: OrderedDict[str, str] = field(default_factory=OrderedDict)
    # chunk hash -> instances holding it: a lookup walks the request's chunks
    # over their holders, so it costs O(chunks x holders), not O(instances).
    holders: dict[int, set[str]] = field(default_factory=dict)
    # Instances whose engine publishes KV events: what it holds (precise mode).
    engines: dict[str, EngineBlocks] = field(default_factory=dict)

    @property
    def chunk_size(self) -> int:
        return self.block_size * BYTES_PER_TOKEN

    def key(
        self, body: Mapping[str, Any] | None, prompt_tokens: int, session: str | None = None
    ) -> PrefixKey:
        ids = prompt_ids(body, MAX_PROMPT_CHUNKS * self.block_size)
        # (Ids read once: `prompt_text` would read them again.)
        if ids:
            keyed: str | bytes = _ids_text(ids)  # (ASCII: a character is a byte)
        else:
            # A character is a byte or more: as many characters as the chunks
            # hashed take in bytes are enough (a prompt of 32 MB is not copied whole).
            limit = MAX_PROMPT_CHUNKS * self.chunk_size
            keyed = prompt_text(body, limit)[:limit].encode("utf-8", "surrogatepass")
        chunks = text_chunk_hashes(keyed, self.chunk_size, _namespace(body))
        model = body.get("model") if body is not None else None
        model = model if isinstance(model, str) else None
        salted = body is not None and body.get("cache_salt") is not None
        return PrefixKey(tuple(chunks), prompt_tokens, session, ids, model, salted)

    def cached_tokens(self, key: PrefixKey) -> dict[str, int]:
        """Cached prompt tokens of `key` on each instance that has any (absent: 0):
        what a precise instance holds of its token ids, else estimated from text,
        at most the request's estimate."""
        if not self.enabled:
            return {}
        cached = self._cached_text(key)
        if key.token_ids is not None:
            memo: dict[object, LazyChain] = {}
            for name, engine in self.engines.items():
                # The engine hashes a cache salt or a LoRA adapter into its
                # blocks and Ferry does not: its blocks would credit the same
                # ids of another tenant or the base model. The text index,
                # keyed by both, says then.
                if engine.precise and not key.salted and key.model not in engine.adapters:
                    cached.pop(name, None)
                    n = engine.cached_tokens(key.token_ids, memo)
                    if n:
                        cached[name] = min(n, key.prompt_tokens)
        return cached

    def _cached_text(self, key: PrefixKey) -> dict[str, int]:
        chunks = key.chunks
        if not chunks:
            return {}
        holders = self.holders
        first = holders.get(chunks[0])
        if not first:
            return {}
        matched: dict[str, int] = {}
        alive = set(first)
        n = 1
        for h in chunks[1:]:
            held = holders.get(h)
            if held is None:
                break
            if not alive <= held:
                for name in alive - held:
                    matched[name] = n
                alive &= held
                if not alive:
                    break
            n += 1
        for name in alive:
            matched[name] = n
        # vLLM computes a prompt's last token whatever it holds: of a prompt of
        # n tokens it reuses whole blocks within the first n - 1.
        cap, size = max(0, key.prompt_tokens - 1), self.block_size
        # Ids keyed as text ("10000,10001,..."): a chunk holds as many of them as
        # its commas say, a few, not `size` (an id is 2 to 7 characters).
        ids = _ids_text(key.token_ids) if key.token_ids is not None else None
        out = {}
        for name, m in matched.items():
            tokens = min(cap, m * size if ids is None else _whole_ids(ids, m * self.chunk_size))
            entry = self.instances.get(name)
            if entry is not None and entry.block_size > 1:  # whole engine blocks only
                tokens -= tokens % entry.block_size
            if tokens:
                out[name] = tokens
        return out

    def affinity(self, key: PrefixKey) -> str | None:
        """The instance that last served the key's session."""
        return self.sessions.get(key.session) if key.session else None

    def record(
        self, name: str, key: PrefixKey, capacity_blocks: int, block_size: int | None = None
    ) -> None:
        """`key` was placed on `name`, whose cache holds `capacity_blocks` blocks of
        `block_size` tokens (the index's chunk size if not said): its chunks are
        (about to be) cached there."""
        if not self.enabled:
            return
        entry = self._entry(name, capacity_blocks, block_size or self.block_size)
        # No more than the cache holds: a match runs from the first chunk, so of
        # a prompt longer than the cache only its start can ever be found.
        chunks = key.chunks[: entry.text.capacity]
        holders = self.holders
        for h in chunks:
            held = holders.get(h)
            if held is None:
                holders[h] = {name}
            else:
                held.add(name)
        # The first chunk last, the most recent: an engine evicts a prefix's tail
        # before its start (vLLM frees a request's blocks tail first), and a
        # match that misses its first chunk finds nothing of the rest.
        self._drop(name, entry.text.insert(reversed(chunks)))
        if key.session:
            self.sessions[key.session] = name
            self.sessions.move_to_end(key.session)
            if len(self.sessions) > self.max_sessions:
                self.sessions.popitem(last=False)

    def record_tokens(
        self, name: str, token_ids: Sequence[int], block_size: int, capacity_blocks: int
    ) -> None:
        """The engine reported these prompt (+ generated) ids for a request on `name`."""
        if not self.enabled:
            return
        entry = self._entry(name, capacity_blocks, block_size)
        if entry.mode != "off":
            entry.tokens.insert(reversed(token_block_hashes(token_ids, block_size)))

    def record_generated(self, name: str, tokens: int, block_size: int) -> None:
        """A request on `name` ended after generating `tokens`. Their blocks took
        room in the engine's cache that the prompts recorded here do not show, so
        as much of the oldest record goes: without this, where answers are
        longer than prompts, the index remembers prefixes the engine evicted
        long ago."""
        entry = self.instances.get(name)
        if entry is None or tokens <= 0:
            return
        self._drop(name, entry.text.take(-(-tokens // self.block_size)))
        entry.tokens.take(-(-tokens // block_size))

    def cached_token_blocks(
        self, token_ids: Sequence[int], block_size: int, names: Iterable[str]
    ) -> dict[str, int]:
        """Cached tokens of an exact id sequence on each named instance (for moves):
        what the engine holds where it is precise, else Ferry's guess."""
        hashes = token_block_hashes(token_ids, block_size)
        out: dict[str, int] = {}
        if not self.enabled:
            return out
        memo: dict[object, LazyChain] = {}
        for name in names:
            engine = self.engines.get(name)
            if engine is not None and engine.precise:
                n = engine.cached_tokens(token_ids, memo)
                if n:
                    out[name] = n
                continue
            entry = self.instances.get(name)
            if entry is not None and entry.mode != "off" and hashes:
                n = entry.tokens.match(hashes)
                if n:
                    out[name] = n * block_size
        return out

    def mode(self, name: str) -> str:
        """off (no policy reads the index), precise (following the engine's KV
        events, caught up) or approximate."""
        if not self.enabled:
            return "off"
        engine = self.engines.get(name)
        if engine is not None and engine.precise:
            return "precise"
        entry = self.instances.get(name)
        return entry.mode if entry is not None else "approximate"

    def blocks(self, name: str) -> int:
        """The blocks held for `name`: its engine's where it publishes KV events,
        else Ferry's token blocks."""
        engine = self.engines.get(name)
        if engine is not None:
            return len(engine)
        entry = self.instances.get(name)
        return len(entry.tokens) if entry is not None else 0

    def describe(self, name: str) -> dict[str, Any]:
        """For /admin/instances: the mode, and the blocks held (the engine's blocks
        where it publishes KV events; Ferry's text chunks and token blocks)."""
        entry = self.instances.get(name)
        engine = self.engines.get(name)
        return {
            "mode": self.mode(name),
            "blocks": self.blocks(name),
            "text_blocks": len(entry.text) if entry else 0,
            "token_blocks": len(entry.tokens) if entry else 0,
            "capacity_blocks": entry.tokens.capacity if entry else None,
            "kv_events": engine.describe() if engine is not None else None,
        }

    def engine(self, name: str, format: KVEventsFormat) -> EngineBlocks:
        """The precise record of `name`'s engine (made on first use)."""
        engine = self.engines.get(name)
        if engine is None:
            engine = self.engines[name] = EngineBlocks(format)
        return engine

    def forget_engine(self, name: str) -> None:
        """`name` no longer publishes KV events (or they are no longer followed)."""
        self.engines.pop(name, None)

    def engine_cleared(self, name: str) -> None:
        """The engine dropped its whole cache: Ferry's text chunks for it go too."""
        entry = self.instances.get(name)
        if entry is not None:
            self._drop(name, list(entry.text))
            entry.text = BlockLRU(entry.text.capacity)
            entry.tokens = BlockLRU(entry.tokens.capacity)

    def forget(self, name: str) -> None:
        """`name` is gone, or its server is another now (a new URL): nothing of
        its cache is known, and no session is held to it."""
        self.engines.pop(name, None)
        entry = self.instances.pop(name, None)
        if entry is not None:
            self._drop(name, list(entry.text))
        for session in [s for s, held in self.sessions.items() if held == name]:
            del self.sessions[session]

    def _drop(self, name: str, hashes: Iterable[int]) -> None:
        holders = self.holders
        for h in hashes:
            held = holders.get(h)
            if held is not None:
                held.discard(name)
                if not held:
                    del holders[h]

    def _entry(self, name: str, capacity_blocks: int, block_size: int) -> InstancePrefixes:
        """`name`'s index, sized to its cache: `capacity_blocks` engine blocks of
        `block_size` tokens for the token blocks, as many tokens in the index's
        own chunks for the text (a CPU engine's blocks are 128 tokens: counted
        as chunks of 16, the text index held an eighth of the cache)."""
        blocks = capacity_blocks if capacity_blocks > 0 else DEFAULT_CAPACITY_BLOCKS
        chunks = max(1, blocks * block_size // self.block_size)
        entry = self.instances.get(name)
        if entry is None:
            entry = self.instances[name] = InstancePrefixes(BlockLRU(chunks), BlockLRU(blocks))
            entry.block_size = block_size
        else:  # the engine's cache size changed, or its block size became known
            entry.block_size = block_size
            if entry.text.capacity != chunks:
                self._drop(name, entry.text.resize(chunks))
            if entry.tokens.capacity != blocks:
                entry.tokens.resize(blocks)
        return entry

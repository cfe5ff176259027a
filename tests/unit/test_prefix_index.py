"""The approximate prefix index (proxy/prefix_index.py)."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from adapters.kv_events import BlocksStored
from adapters.vllm_kv_events import DEFAULT_SEED, FORMAT
from proxy.prefix_index import (
    MAX_PROMPT_CHUNKS,
    BlockLRU,
    PrefixIndex,
    prompt_text,
    session_of,
    text_chunk_hashes,
    token_block_hashes,
)


@given(st.lists(st.integers(0, 50), max_size=80), st.integers(1, 8))
def test_token_hashes_chain_over_full_blocks(ids: list[int], block_size: int) -> None:
    hashes = token_block_hashes(ids, block_size)
    assert len(hashes) == len(ids) // block_size
    # A prefix's hashes are the sequence's leading hashes (the chain).
    cut = len(ids) // 2
    assert token_block_hashes(ids[:cut], block_size) == hashes[: cut // block_size]


def test_chaining_tells_equal_blocks_after_different_prefixes_apart() -> None:
    a = token_block_hashes([1, 2, 9, 9], 2)
    b = token_block_hashes([3, 4, 9, 9], 2)
    assert a[1] != b[1]


@given(st.text(max_size=300), st.text(max_size=300), st.integers(1, 32))
def test_text_match_is_the_common_full_chunk_prefix(a: str, b: str, chunk: int) -> None:
    lru = BlockLRU(10_000)
    lru.insert(text_chunk_hashes(a, chunk))
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert lru.match(text_chunk_hashes(b, chunk)) == min(common, len(b)) // chunk


@given(st.lists(st.lists(st.integers(0, 1000), min_size=1, max_size=20), max_size=30))
def test_lru_never_holds_more_than_its_capacity(batches: list[list[int]]) -> None:
    lru = BlockLRU(16)
    for batch in batches:
        lru.insert(batch)
        assert len(lru) <= 16
        # What was just inserted survives when it fits.
        if len(set(batch)) <= 16:
            assert all(lru.match([h]) == 1 for h in batch[-16:])


def test_least_recently_used_goes_first() -> None:
    lru = BlockLRU(2)
    lru.insert([1, 2])
    lru.insert([1])  # touched: 2 is now the oldest
    lru.insert([3])
    assert (lru.match([1]), lru.match([2]), lru.match([3])) == (1, 0, 1)


@given(
    st.lists(
        st.one_of(
            st.lists(st.integers(0, 40), min_size=1, max_size=12).map(lambda b: ("insert", b)),
            st.integers(0, 30).map(lambda n: ("take", n)),
        ),
        max_size=40,
    ),
    st.integers(1, 24),
)
def test_room_taken_without_hashes_evicts_like_blocks(
    ops: list[tuple[str, object]], capacity: int
) -> None:
    """`take(n)` is n blocks no lookup can match: the LRU holds what a list of
    capacity slots, oldest out first, would hold."""
    lru, model = BlockLRU(capacity), []  # model: hashes and None (a taken block)
    for op, arg in ops:
        if op == "insert":
            for h in arg:  # type: ignore[union-attr]
                if h in model:
                    model.remove(h)
                model.append(h)
            evicted = lru.insert(arg)  # type: ignore[arg-type]
        else:
            model.extend([None] * arg)  # type: ignore[list-item]
            evicted = lru.take(arg)  # type: ignore[arg-type]
        gone, model = model[: max(0, len(model) - capacity)], model[-capacity:]
        assert evicted == [h for h in gone if h is not None]
        assert sorted(lru) == sorted(h for h in model if h is not None)
        assert len(lru) == sum(h is not None for h in model)


def test_generated_tokens_push_old_prefixes_out() -> None:
    """Answers fill the engine's cache too: after a request that generated more
    than the cache holds, the prompts recorded before it count less, their
    tails first (an engine evicts a prefix's tail before its start)."""
    index = PrefixIndex(block_size=4)  # 12-character chunks
    key = index.key({"prompt": "x" * 120}, 41)  # 10 chunks (of a prompt of 41 tokens, 40 reused)
    index.record("a", key, capacity_blocks=30)
    index.record_generated("a", 4 * 15, block_size=4)  # 15 blocks: 25 of 30 taken
    assert index.cached_tokens(key) == {"a": 40}
    index.record_generated("a", 4 * 6, block_size=4)  # 31: the prompt's last chunk goes
    assert index.cached_tokens(key) == {"a": 36}  # its start is the last to go
    assert index.describe("a")["text_blocks"] == 9
    # An instance the index never heard of, or nothing generated: nothing to do.
    index.record_generated("b", 100, block_size=4)
    index.record_generated("a", 0, block_size=4)
    assert index.describe("a")["text_blocks"] == 9


def test_cached_tokens_per_instance_and_affinity() -> None:
    index = PrefixIndex(block_size=4)  # 12-character chunks
    system = "You are a helpful assistant. " * 10  # 290 characters: 24 chunks
    first = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    key = index.key(first, prompt_tokens=80, session="s1")
    index.record("a", key, capacity_blocks=1000)
    second = {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "yo"}]
    }
    cached = index.cached_tokens(index.key(second, 80))
    assert set(cached) == {"a"} and 60 <= cached["a"] <= 80
    assert index.affinity(index.key(second, 80, "s1")) == "a"
    assert index.affinity(index.key(second, 80, "s2")) is None
    # Capped at the request's estimate, in whole blocks of the engine's (4 tokens).
    assert index.cached_tokens(index.key(first, 10)) == {"a": 8}


def test_a_prompt_is_cached_for_its_own_adapter_and_salt_only() -> None:
    """vLLM's block hashes take in the LoRA adapter and the `cache_salt`."""
    index = PrefixIndex(block_size=4)
    body = {"model": "base", "prompt": "x" * 120}
    index.record("a", index.key(body, 41), capacity_blocks=1000)
    assert index.cached_tokens(index.key(dict(body), 41)) == {"a": 40}
    assert index.cached_tokens(index.key({**body, "model": "sql-lora"}, 41)) == {}
    assert index.cached_tokens(index.key({**body, "cache_salt": "tenant-2"}, 41)) == {}


def test_capacity_comes_from_the_engine_cache() -> None:
    index = PrefixIndex(block_size=1)  # 4-character chunks
    key = index.key({"prompt": "x" * 400}, 100)
    index.record("a", key, capacity_blocks=10)
    assert index.describe("a")["text_blocks"] == 10
    assert index.describe("a")["mode"] == "approximate"
    # Its first chunks are what is kept: a match runs from the first (the last
    # ten, kept before, could never be found, and took every other prefix out).
    assert index.cached_tokens(key) == {"a": 10}


def test_a_huge_prompt_is_keyed_by_its_start() -> None:
    """Keying and recording run on the event loop at dispatch: a 32 MB prompt's
    500,000 chunks held it for a second. Past MAX_PROMPT_CHUNKS a prompt is
    keyed by its start, whatever its shape, and two that share it match."""
    index = PrefixIndex(block_size=4)  # 12-character chunks
    chars = MAX_PROMPT_CHUNKS * index.chunk_size
    text = "".join(f"{n:015d}-" for n in range(MAX_PROMPT_CHUNKS + 100))
    ids = list(range(MAX_PROMPT_CHUNKS * 4 + 400))
    bodies = [
        {"prompt": text},
        {"messages": [{"role": "user", "content": text}, {"role": "user", "content": "x"}]},
        {"prompt": ids},
    ]
    for body in bodies:
        key = index.key(body, 10**6)
        assert len(key.chunks) == MAX_PROMPT_CHUNKS
    for body in bodies[1:]:  # (a prompt's text is used as it is, not copied)
        assert chars <= len(prompt_text(body, chars)) < len(prompt_text(body))
    assert index.key(bodies[2], 10**6).token_ids == tuple(ids[: MAX_PROMPT_CHUNKS * 4])
    index.record("a", index.key(bodies[0], 10**6), capacity_blocks=10**6)
    longer = {"prompt": text + "and more"}
    assert index.cached_tokens(index.key(longer, 10**6)) == {"a": MAX_PROMPT_CHUNKS * 4}


def test_off_records_nothing() -> None:
    index = PrefixIndex(enabled=False)
    key = index.key({"prompt": "x" * 400}, 100, "s")
    index.record("a", key, 100)
    index.record_tokens("a", list(range(64)), 16, 100)
    assert index.cached_tokens(key) == {}
    assert index.describe("a")["mode"] == "off"


def test_token_blocks_for_moves() -> None:
    index = PrefixIndex()
    index.record_tokens("a", list(range(40)), 16, 100)
    assert index.cached_token_blocks(list(range(50)), 16, ["a", "b"]) == {"a": 32}
    index.forget("a")
    assert index.cached_token_blocks(list(range(50)), 16, ["a"]) == {}


def test_prompt_text_and_session() -> None:
    assert prompt_text({"prompt": "abc"}) == "abc"
    assert prompt_text({"prompt": [1, 2]}) == "1,2"
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(chat) == "user\0hi\1"
    assert prompt_text(None) == ""
    assert session_of({"user": "u"}, None) == "u"
    assert session_of({"user": "u"}, "h") == "h"
    assert session_of({}, None) is None


@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.text("xy", min_size=0, max_size=40)),
        max_size=25,
    ),
    st.text("xy", max_size=40),
    st.integers(1, 12),
)
def test_lookup_agrees_with_each_instance_lru(
    placed: list[tuple[str, str]], probe: str, capacity: int
) -> None:
    # The holders map (one walk over the request's chunks) answers as matching each
    # instance's own LRU would, through evictions.
    index = PrefixIndex(block_size=1)  # 4-character chunks
    for name, text in placed:
        index.record(name, index.key({"prompt": text}, 1000), capacity)
    key = index.key({"prompt": probe}, 1000)
    expected = {name: entry.text.match(key.chunks) for name, entry in index.instances.items()}
    assert index.cached_tokens(key) == {n: m for n, m in expected.items() if m}
    for name in list(index.instances):
        index.forget(name)
    assert index.holders == {}


def precise_engine(index: PrefixIndex, name: str, ids: list[int], size: int) -> None:
    """`name`'s engine reported storing the full blocks of `ids` (seq 0, synced)."""
    engine = index.engine(name, FORMAT)
    hashes = tuple(FORMAT.block_hashes(ids, size, DEFAULT_SEED))
    engine.reset()
    engine.begin_replay(0)
    engine.replay_done()
    engine.receive(0, [BlocksStored(hashes, None, tuple(ids[: len(hashes) * size]), size)])


def test_a_salted_or_adapter_request_is_not_credited_the_engines_plain_blocks() -> None:
    """The engine hashes a cache salt and a LoRA adapter into its blocks and Ferry
    does not: the plain blocks of the same ids were credited to a request of
    another tenant or adapter, which the engine would compute again. The text
    index, keyed by both, answers for them."""
    index = PrefixIndex(block_size=16)
    ids = list(range(100))
    precise_engine(index, "a", ids[:64], 16)
    plain = {"model": "base", "prompt": ids}
    assert index.cached_tokens(index.key(plain, 100)) == {"a": 64}
    salted = {**plain, "cache_salt": "tenant-b"}
    assert index.cached_tokens(index.key(salted, 100)) == {}
    engine = index.engines["a"]
    adapter = tuple(FORMAT.block_hashes([7] * 32, 16, DEFAULT_SEED))
    engine.receive(1, [BlocksStored(adapter, None, (7,) * 32, 16, (("sql",),) * 2, "sql")])
    assert index.cached_tokens(index.key({**plain, "model": "sql"}, 100)) == {}
    index.record("a", index.key(salted, 100), capacity_blocks=100)  # Ferry placed it there
    assert set(index.cached_tokens(index.key(salted, 100))) == {"a"}  # (by its text)


def test_forgetting_an_instance_lets_go_of_its_sessions() -> None:
    """Removed, or another server under its name now: its sessions stayed held
    to it, on a cache that no longer has their prompts."""
    index = PrefixIndex(block_size=16)
    key = index.key({"prompt": "x" * 200}, 60, session="s1")
    index.record("a", key, capacity_blocks=100)
    index.record("b", index.key({"prompt": "y"}, 1, session="s2"), capacity_blocks=100)
    assert index.affinity(key) == "a"
    index.forget("a")
    assert index.affinity(key) is None and index.sessions == {"s2": "b"}


def test_a_text_prompt_cached_whole_is_credited_its_whole_estimate() -> None:
    """Chunks counted 4 characters a token and prompts 3: a prompt cached whole
    was credited three quarters of itself, and cache_aware's 0.3 of vllm-router
    acted as 0.4."""
    import json

    from proxy.openai_request import parse

    index = PrefixIndex(block_size=16)
    body = {"model": "m", "prompt": "The quick brown fox. " * 40}
    estimate = parse(json.dumps(body).encode(), "completions", None).prompt_estimate
    index.record("a", index.key(body, estimate), capacity_blocks=100)
    credited = index.cached_tokens(index.key(body, estimate))["a"]
    assert estimate - 16 < credited <= estimate  # all of it but its last, partial chunk


def test_a_precise_instance_answers_token_id_prompts_from_the_engine() -> None:
    index = PrefixIndex(block_size=16)
    ids = list(range(100))
    body = {"prompt": ids}
    # Ferry placed the prompt on both; only b's engine says it holds it (a evicted it).
    for name in ("a", "b"):
        index.record(name, index.key(body, 100), capacity_blocks=100)
    precise_engine(index, "b", ids[:64], 16)
    precise_engine(index, "a", [7] * 64, 16)
    assert (index.mode("a"), index.mode("b"), index.mode("c")) == (
        "precise",
        "precise",
        "approximate",
    )
    assert index.cached_tokens(index.key(body, 100)) == {"b": 64}
    # A text prompt has no token ids: it stays keyed by text everywhere.
    text = {"prompt": "x" * 400}
    index.record("a", index.key(text, 100), capacity_blocks=100)
    # 8 chunks of 48 characters (128 tokens), no more than the request's 100, in
    # whole blocks.
    assert index.cached_tokens(index.key(text, 100)) == {"a": 96}
    # Moves read the engine too.
    assert index.cached_token_blocks(ids + [1, 2], 16, ["a", "b"]) == {"b": 64}
    row = index.describe("b")
    assert row["mode"] == "precise" and row["blocks"] == 4 and row["kv_events"]["complete"]


def test_an_engine_that_clears_takes_its_text_chunks_along() -> None:
    index = PrefixIndex(block_size=1)
    text = index.key({"prompt": "y" * 40}, 10)
    index.record("a", text, capacity_blocks=100)
    precise_engine(index, "a", list(range(8)), 4)
    index.engine_cleared("a")
    assert index.cached_tokens(text) == {} and index.describe("a")["text_blocks"] == 0
    # An unsynced record (disconnected) is not used: the instance is approximate.
    index.engines["a"].reset()
    assert index.mode("a") == "approximate"
    index.forget("a")
    assert "a" not in index.engines


def test_a_text_index_holds_as_many_tokens_as_an_engine_of_large_blocks() -> None:
    """A CPU engine's blocks are 128 tokens: its 15 blocks hold 1,920 tokens.
    Counted as 15 chunks of 16, the text index kept 240 tokens of prompts: a
    prompt of 15 chunks or more was never credited, and the first answer's
    block evicted a shorter one's start."""
    index = PrefixIndex()  # chunks of 16 tokens (48 characters)
    key = index.key({"prompt": "".join(f"{i:03d}" for i in range(240))}, 240)  # 15 chunks
    index.record("a", key, capacity_blocks=15, block_size=128)
    index.record_generated("a", 1, block_size=128)  # a one-token answer
    assert index.cached_tokens(key) == {"a": 128}  # (whole blocks of 128: vLLM reuses no less)
    assert index.describe("a")["capacity_blocks"] == 15
    other = index.key({"prompt": "".join(f"x{i:03d}" for i in range(320))}, 320)  # 26 chunks
    index.record("a", other, capacity_blocks=15, block_size=128)
    assert index.cached_tokens(key) == {"a": 128} and index.cached_tokens(other) == {"a": 256}


def test_a_long_session_name_is_kept_by_its_digest() -> None:
    """A body's `user` can be megabytes: the index keeps up to 65,536 sessions,
    and held each name whole (100 requests of 1 MB: +100 MB)."""
    long = "u" * 1_000_000
    session = session_of({"user": long}, None)
    assert session is not None and len(session) < 100
    assert session == session_of({"user": long}, None) != session_of({"user": long + "v"}, None)
    assert session_of(None, "s" * 300) == session_of({"user": "s" * 300}, None)
    assert session_of({"user": "alice"}, None) == "alice"  # a short one as it is


def test_a_prompt_s_text_reads_no_part_past_its_limit() -> None:
    """A chat of a million content parts was read whole (on the event loop) to
    key on its first few kilobytes."""

    class Unread(dict):  # type: ignore[type-arg]
        def get(self, *args: object) -> object:
            raise AssertionError("a part past the limit was read")

        def __contains__(self, key: object) -> bool:
            raise AssertionError("a part past the limit was read")

    parts = [{"type": "text", "text": "abcd"}] * 10 + [Unread()] * 1000
    body = {"messages": [{"role": "user", "content": parts}]}
    assert prompt_text(body, 40) == "user\0" + "abcd" * 10 + "\1"
    assert prompt_text({"messages": [{"role": "user", "content": "x" * 100}]}, 8) == (
        "user\0" + "x" * 8 + "\1"
    )


@given(
    shared=st.integers(0, 120),
    digits=st.sampled_from([1, 3, 5, 6]),
    block_size=st.sampled_from([1, 16]),
)
def test_a_token_id_prompt_is_credited_the_ids_it_shares_no_more(
    shared: int, digits: int, block_size: int
) -> None:
    """Ids are keyed as their text ("10000,10001,..."), chunked as text is,
    whose chunk is `block_size` tokens of 3 characters: five-digit ids were
    credited twice what two prompts shared (a block the engine could not reuse
    made the placement). The credit is the shared ids, at most."""
    index = PrefixIndex(block_size=16)
    base = 10 ** (digits - 1)
    common = [base + i % 7 for i in range(shared)]
    first = common + [base + 8] * 100
    later = common + [base + 9] * 100
    index.record("x", index.key({"model": "m", "prompt": first}, len(first)), 1000, block_size)
    credit = index.cached_tokens(index.key({"model": "m", "prompt": later}, len(later)))
    assert credit.get("x", 0) <= shared
    if shared >= 48 and digits == 1 and block_size == 1:  # 2 characters an id: a chunk is 24
        assert credit["x"] >= shared - 24


def test_a_chinese_prompt_cached_whole_is_credited_as_an_english_one_is() -> None:
    """Prompts were estimated at 3 characters a token and chunked by characters:
    a Chinese prompt (a token a character or more) of 226 characters read as 75
    tokens, credited less than one engine block of 128, so its repeats went
    anywhere. Both count bytes of UTF-8 now."""
    index = PrefixIndex(block_size=16)
    body = {"model": "m", "prompt": "今天天气很好我们去公园散步吧" * 16 + "再见"}  # 226 characters
    estimate = _estimate(body, "completions")
    assert estimate == 226
    index.record("a", index.key(body, estimate), capacity_blocks=15, block_size=128)
    assert index.cached_tokens(index.key(body, estimate)) == {"a": 128}  # a whole block
    assert index.describe("a")["text_blocks"] == 226 * 3 // 48  # chunks of 16 tokens


ENGLISH_SYSTEM = "".join(f"rule {i:04d}: be brief. " for i in range(240))  # 4,800 chars
CHINESE_SYSTEM = "今天天气很好我们去公园散步吧" * 22  # 308 characters: ~308 tokens


def _chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": "m",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }


def _estimate(body: dict[str, Any], endpoint: str = "chat") -> int:
    import json

    from proxy.openai_request import parse

    return parse(json.dumps(body).encode(), endpoint, None).prompt_estimate


def test_a_shared_english_start_is_credited_as_english_whatever_follows() -> None:
    """(A review's case: one weight for a whole prompt credited the English start
    it shared by its Chinese question's bytes a character, 34% too many.)"""
    index = PrefixIndex(block_size=16)
    first = _chat(ENGLISH_SYSTEM, "What is the weather like today? " * 3)
    index.record("a", index.key(first, _estimate(first)), capacity_blocks=10_000, block_size=16)
    second = _chat(ENGLISH_SYSTEM, "今天天气怎么样" * 150)  # 1,050 characters of Chinese
    credit = index.cached_tokens(index.key(second, _estimate(second))).get("a", 0)
    assert len(ENGLISH_SYSTEM) // 3 - 32 <= credit <= len(ENGLISH_SYSTEM) // 3 + 16


def test_a_shared_chinese_start_is_credited_before_an_english_question() -> None:
    index = PrefixIndex(block_size=16)
    first = _chat(CHINESE_SYSTEM, "Tell me about parks in Beijing. " * 200)
    index.record("a", index.key(first, _estimate(first)), capacity_blocks=100, block_size=128)
    second = _chat(CHINESE_SYSTEM, "Tell me about lakes in Hangzhou. " * 200)
    # ~308 tokens shared: two whole blocks of 128.
    assert index.cached_tokens(index.key(second, _estimate(second))) == {"a": 256}


def test_a_hot_chinese_prompt_keeps_the_room_its_tokens_take() -> None:
    """A Chinese prompt recorded again and again (a hot system prompt) takes the
    room of its tokens for as long as it is held: the index holds no more
    prompts than the engine's cache can."""
    index = PrefixIndex(block_size=16)
    hot = {"model": "m", "prompt": "天" * 48 * 20}  # 960 tokens
    englishes = [
        {"model": "m", "prompt": "".join(f"{n:02d}{i:04d}" for i in range(8 * 10))[:480]}
        for n in range(30)
    ]  # 160 tokens each
    for body in englishes:
        index.record("a", index.key(hot, 960), capacity_blocks=15, block_size=128)  # 1,920
        index.record("a", index.key(body, 160), capacity_blocks=15, block_size=128)
    assert index.cached_tokens(index.key(hot, 961)).get("a") == 896  # (whole 128s of 960)
    credited = [b for b in englishes if index.cached_tokens(index.key(b, 161)).get("a")]
    assert len(credited) <= 6, len(credited)  # 1,920 - 960 tokens: 6 prompts of 160


def test_a_chinese_prompt_loses_its_tail_first() -> None:
    """A cache of 1,920 tokens holding a Chinese prompt's 1,920, then sent 640
    tokens of English, still holds the prompt's first 1,280 (an engine frees a
    prefix's tail first)."""
    index = PrefixIndex(block_size=16)
    chinese = {"model": "m", "prompt": "天" * 48 * 40}  # 1,920 tokens
    index.record("a", index.key(chinese, 1920), capacity_blocks=15, block_size=128)
    english = {"model": "m", "prompt": "".join(f"{i:03d}" for i in range(16 * 40))}  # 640
    index.record("a", index.key(english, 640), capacity_blocks=15, block_size=128)
    assert index.cached_tokens(index.key(chinese, 1921)).get("a", 0) >= 1024

"""Token counts for the ledger: asked-for ids, and estimates where an engine has none."""

from __future__ import annotations

from adapters import get_adapter
from proxy import token_ids


def test_ids_are_asked_for_only_where_the_adapter_has_a_field() -> None:
    vllm = get_adapter("vllm").token_id_request_fields
    body, as_is = token_ids.upstream_body({"model": "m"}, vllm)
    assert body == {"model": "m", "return_token_ids": True} and not as_is
    assert token_ids.upstream_body({"model": "m", "return_token_ids": True}, vllm)[1]
    generic = get_adapter("openai").token_id_request_fields
    original = {"model": "m", "prompt": "x"}
    body, as_is = token_ids.upstream_body(original, generic)
    assert body is original and as_is  # nothing added, nothing to hide


def test_text_is_estimated_at_four_characters_a_token() -> None:
    chunk = b'{"choices":[{"index":0,"text":"hello"}]}'  # 5 characters: 2 tokens
    assert token_ids.estimate(chunk, 0) == (None, 2, True)
    chat = b'{"choices":[{"delta":{"content":" tok"}}]}'
    assert token_ids.estimate(chat, 7) == (None, 1, True)
    whole = b'{"choices":[{"message":{"role":"assistant","content":"abcdefghi"}}]}'
    assert token_ids.estimate(whole, 0) == (None, 3, True)
    role_only = b'{"choices":[{"delta":{"role":"assistant","content":""}}]}'
    assert token_ids.estimate(role_only, 0) == (None, 0, False)
    assert token_ids.estimate(b"not json", 0) == (None, 0, False)
    assert token_ids.estimate(b"[1, 2]", 0) == (None, 0, False)


def test_a_usage_block_is_the_engines_own_count() -> None:
    whole = (
        b'{"choices":[{"text":"abcdefgh"}],'
        b'"usage":{"prompt_tokens":11,"completion_tokens":5,"total_tokens":16}}'
    )
    assert token_ids.estimate(whole, 0) == (11, 5, True)
    # A stream's last chunk: usage only. It tops the text estimate up to the count...
    last = b'{"choices":[],"usage":{"prompt_tokens":11,"completion_tokens":5}}'
    assert token_ids.estimate(last, 3) == (11, 2, False)
    # ...and never takes tokens back.
    assert token_ids.estimate(last, 9) == (11, 0, False)
    odd = b'{"choices":[],"usage":{"prompt_tokens":"x","completion_tokens":true}}'
    assert token_ids.estimate(odd, 0) == (None, 0, False)


def test_hide_nulls_the_id_arrays_and_leaves_every_other_byte() -> None:
    first = b'data: {"choices":[{"text":" a","prompt_token_ids":[1, 2,3],"token_ids" : [7]}]}'
    # A later chunk says null: merged with the first, the first's prompt ids still go.
    second = (
        b'data: {"id":"c","choices":[{"text":"\\"token_ids\\":[","prompt_token_ids":null,'
        b'"token_ids":[]}]}'
    )
    hidden = token_ids.hide(first + b"\n\n" + second + b"\n\n")
    assert hidden == (
        b'data: {"choices":[{"text":" a","prompt_token_ids":null,"token_ids":null}]}'
        b'\n\ndata: {"id":"c","choices":[{"text":"\\"token_ids\\":[","prompt_token_ids":null,'
        b'"token_ids":null}]}\n\n'
    )
    assert token_ids.scan(first) == (3, 3, 1, True)
    assert token_ids.scan(second) == (None, 0, 0, True)
    # An array cut off at a line's end is no array: nothing runs into the next event.
    cut = b'data: {"token_ids":[1,2\n\ndata: {"token_ids":[3]}'
    assert token_ids.hide(cut) == b'data: {"token_ids":[1,2\n\ndata: {"token_ids":null}'
    assert token_ids.scan(cut) == (None, 0, 1, True)


def test_prompt_ids_that_are_not_integers_are_none() -> None:
    """A server that says it is vLLM but reports `[true,false]` (it raised
    ValueError, and the request got a bare 500)."""
    assert token_ids.prompt_ids(b'{"prompt_token_ids":[1, 2]}') == [1, 2]
    assert token_ids.prompt_ids(b'{"prompt_token_ids":[]}') == []
    assert token_ids.prompt_ids(b'{"prompt_token_ids":[true,false]}') is None
    assert token_ids.prompt_ids(b'{"prompt_token_ids":[1.5]}') is None
    assert token_ids.prompt_ids(b'{"text":"x"}') is None


def test_a_batch_counts_each_prompt_and_n_choices_one() -> None:
    """Each choice reports its prompt's ids: a batch's prompts are summed (as
    vLLM's usage counts them), the n choices of one prompt counted once. Only
    the first prompt was counted: a batch of 8 prompts of 294 tokens was billed
    294, in the ledger and in `ferry_prompt_tokens_total`."""
    whole = (
        b'{"choices":[{"index":0,"prompt_token_ids":[1,2,3],"token_ids":[9]},'
        b'{"index":1,"prompt_token_ids":[4,5],"token_ids":[9,9]}]}'
    )
    prompt, longest, generated, _ = token_ids.scan(whole)
    assert (prompt, longest, generated) == (5, 3, 3)
    assert token_ids.PromptCount({"prompt": ["a b c", "d e"]}).add(prompt, longest) == 5
    # n = 2 of one prompt: both choices report it.
    assert token_ids.PromptCount({"n": 2}).add(6, 3) == 3
    # A stream reports each choice's prompt in its first chunk: the longest
    # stands for the rest until they come, then the sum over the prompts.
    per_choice = token_ids.PromptCount({"n": 2})
    assert [per_choice.add(3, 3), per_choice.add(3, 3)] == [3, 3]
    batch = token_ids.PromptCount({"n": 2, "prompt": ["a b c", "d e"]})
    assert [batch.add(*r) for r in ((3, 3), (3, 3), (2, 2), (2, 2))] == [3, 3, 4, 5]
    assert token_ids.PromptCount({"n": "2"}).per_prompt == 1  # (vLLM refuses it first)
    # A server that repeats a choice's prompt ids on each of its chunks: once.
    repeated = token_ids.PromptCount({})
    chunk = b'{"choices":[{"index":0,"text":"a","prompt_token_ids":[1,2,3],"token_ids":[7]}]}'
    assert [repeated.add(3, 3, chunk) for _ in range(4)] == [3, 3, 3, 3]
    assert repeated.reported == 3

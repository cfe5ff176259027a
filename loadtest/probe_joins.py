"""Probe what a real vLLM server's text looks like at a lite-migration join.

A dev tool, not a test. It starts one vLLM CPU server (or uses `--url`), streams
an unmoved greedy run with `return_token_ids`, then for each cut k streams the
continuation `/v1/completions` with `prompt = P + G[:k]` (token ids), and
compares the client's text (S + the destination's text) with the unmoved text.

    python -m loadtest.probe_joins                       # builds .ferry/tiny-cjk if needed
    python -m loadtest.probe_joins --chat --cuts 3,4,17
    python -m loadtest.probe_joins --url http://127.0.0.1:8000 --model-name tiny ...

For each cut it prints whether the naive join (S + destination text) is right,
whether the destination leaked text decoded from its prompt, and whether the
join rule below repairs it; `--out DIR` saves one JSON trace per cut.

What vLLM 0.32 does (FastIncrementalDetokenizer -> tokenizers' DecodeStream,
primed with *all* prompt ids): if decode(prompt ids) ends in U+FFFD (the
prompt P + G[:k] ends inside a UTF-8 character), priming records no prefix, and
the first text the destination emits is decode(P + G[:k] + D[:m]) in full: the
whole prompt's text (special tokens skipped per `skip_special_tokens`), then
the text the client already has, then the new text. The rule: when the source
held text back at the cut (token ids after its last non-empty text), drop the
first len(decode_skip(P)) + len(S) characters of the destination's first
non-empty text; pass everything else through unchanged.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import httpx

DEFAULT_PROMPTS = (
    "今天天气很好，我们去公园散步吧。",
    "東京の空は青くて、桜の花が",
    "The quick brown fox jumps over the lazy dog.",
    "Emoji: 😀🚀🔥",
)


def stream(url: str, path: str, body: dict[str, Any]) -> tuple[list[int], list[dict[str, Any]]]:
    """(prompt ids, [{"ids": [...], "text": "..."} per chunk]) of one streamed request."""
    prompt_ids: list[int] = []
    chunks: list[dict[str, Any]] = []
    with httpx.stream("POST", url + path, json=body, timeout=300) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            prompt_ids = prompt_ids or chunk.get("prompt_token_ids") or []
            for choice in chunk.get("choices") or ():
                prompt_ids = prompt_ids or choice.get("prompt_token_ids") or []
                ids = choice.get("token_ids") or []
                delta = choice.get("delta")
                text = (delta or {}).get("content") if delta is not None else choice.get("text")
                if ids or text:
                    chunks.append({"ids": ids, "text": text or ""})
    return prompt_ids, chunks


def detokenize(url: str, model: str, tokens: list[int]) -> str:
    resp = httpx.post(url + "/detokenize", json={"model": model, "tokens": tokens}, timeout=60)
    resp.raise_for_status()
    return str(resp.json()["prompt"])


def text_through(chunks: list[dict[str, Any]], k: int) -> tuple[str, int]:
    """(S, j): the text of the chunks carrying the first k ids, and the number of
    ids up to the last of those chunks with non-empty text (j < k: held back)."""
    n, text, last_clean = 0, "", 0
    for c in chunks:
        if n + len(c["ids"]) > k:
            break
        n += len(c["ids"])
        text += c["text"]
        if c["text"]:
            last_clean = n
    assert n == k, f"a chunk straddles the cut {k}"
    return text, last_clean


def join(s_len: int, held_back: bool, prompt_text_len: int, texts: list[str]) -> str:
    """The join rule: the client's new text from the destination's chunk texts."""
    out, first = [], held_back
    for t in texts:
        if first and t:
            t, first = t[prompt_text_len + s_len :], False
        out.append(t)
    return "".join(out)


def probe_cut(
    url: str,
    model: str,
    tok: Any,
    prompt_ids: list[int],
    chunks: list[dict[str, Any]],
    k: int,
    *,
    max_tokens: int,
    endpoint: str,
) -> dict[str, Any]:
    gen = [t for c in chunks for t in c["ids"]]
    unmoved = "".join(c["text"] for c in chunks)
    s, j = text_through(chunks, k)
    body = {
        "model": model,
        "prompt": prompt_ids + gen[:k],
        "max_tokens": max_tokens - k,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    _, dest = stream(url, "/v1/completions", body)
    dest_ids = [t for c in dest for t in c["ids"]]
    texts = [c["text"] for c in dest]
    first = next((i for i, t in enumerate(texts) if t), None)
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=True)
    fixed = join(len(s), j < k, len(prompt_text), texts)
    # after the first non-empty destination text, compare chunk by chunk with the unmoved run
    later_same = first is None or [c["text"] for c in chunks[k + first + 1 :]] == texts[first + 1 :]
    return {
        "endpoint": endpoint,
        "k": k,
        "held_back_at_cut": j < k,
        "last_clean_j": j,
        "prompt_ids": prompt_ids,
        "G": gen,
        "unmoved_chunks": [[c["ids"], c["text"]] for c in chunks],
        "S": s,
        "detokenize_G_k": detokenize(url, model, gen[:k]),
        "detokenize_P_G_k_tail": detokenize(url, model, prompt_ids + gen[:k])[-8:],
        "dest_chunks": [[c["ids"], c["text"]] for c in dest],
        "dest_ids_equal_G_after_k": dest_ids == gen[k:],
        "dest_first_text": texts[first] if first is not None else None,
        "dest_first_text_starts_with_prompt_text_plus_S": first is not None
        and texts[first].startswith(prompt_text + s),
        "naive_equal": s + "".join(texts) == unmoved,
        "rule_equal": s + fixed == unmoved,
        "later_chunks_equal": later_same,
        "unmoved_after_S": unmoved[len(s) :][:40],
        "naive_after_S": "".join(texts)[:40],
    }


def auto_cuts(chunks: list[dict[str, Any]], n: int = 3) -> list[int]:
    """A few cuts where the source held text back and a few right after a character."""
    held: list[int] = []
    clean: list[int] = []
    for k in range(1, len(chunks)):
        _, j = text_through(chunks, k)
        (held if j < k else clean).append(k)
    return held[:n] + clean[:n]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path(".ferry/tiny-cjk"))
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--url", help="use this running server instead of starting one")
    parser.add_argument("--port", type=int, default=18431)
    parser.add_argument(
        "--prompt", action="append", help="repeatable; default: CJK/emoji/ASCII set"
    )
    parser.add_argument(
        "--cuts", help="comma-separated k, or all; default: 3 held-back + 3 clean cuts"
    )
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--chat", action="store_true", help="unmoved run on /v1/chat/completions")
    parser.add_argument("--out", type=Path, help="save one JSON trace per cut here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from loadtest.tiny_model import build_cjk
    from loadtest.vllm_servers import start_vllm, wait_ready

    server = None
    url = args.url
    if url is None:
        if args.model == Path(".ferry/tiny-cjk"):
            build_cjk(args.model)
        server = start_vllm(
            args.model,
            args.port,
            Path(tempfile.mkdtemp(prefix="probe-joins-")),
            kv_cache_bytes=50_000_000,
            max_model_len=2048,
            served_name=args.model_name,
        )
        url = server.url
    tok = AutoTokenizer.from_pretrained(args.model)
    endpoint = "chat" if args.chat else "completions"
    try:
        if server is not None:
            wait_ready([server])
        for n, prompt in enumerate(args.prompt or DEFAULT_PROMPTS):
            body: dict[str, Any] = {
                "model": args.model_name,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "return_token_ids": True,
            }
            if args.chat:
                body["messages"] = [{"role": "user", "content": prompt}]
                prompt_ids, chunks = stream(url, "/v1/chat/completions", body)
            else:
                body["prompt"] = prompt
                prompt_ids, chunks = stream(url, "/v1/completions", body)
            gen = [t for c in chunks for t in c["ids"]]
            unmoved = "".join(c["text"] for c in chunks)
            print(f"\n== {endpoint} prompt {prompt!r}: |P|={len(prompt_ids)} |G|={len(gen)}")
            same = unmoved == detokenize(url, args.model_name, gen)
            print(f"   unmoved text == /detokenize(G): {same}")
            if args.cuts == "all":
                cuts = list(range(1, len(chunks)))
            else:
                cuts = [int(c) for c in args.cuts.split(",")] if args.cuts else auto_cuts(chunks)
            for k in cuts:
                r = probe_cut(
                    url, args.model_name, tok, prompt_ids, chunks, k,
                    max_tokens=args.max_tokens, endpoint=endpoint,
                )  # fmt: skip
                print(
                    f"   k={k:3d} held_back={r['held_back_at_cut']!s:5}"
                    f" naive_ok={r['naive_equal']!s:5}"
                    f" leaks_prompt={r['dest_first_text_starts_with_prompt_text_plus_S']!s:5}"
                    f" rule_ok={r['rule_equal']!s:5} later_chunks_equal={r['later_chunks_equal']}"
                    f" ids_equal={r['dest_ids_equal_G_after_k']}"
                )
                print(
                    f"          S[-6:]={r['S'][-6:]!r}"
                    f" detokenize(G[:k])[-3:]={r['detokenize_G_k'][-3:]!r}"
                    f" dest first text={r['dest_first_text']!r:.60}"
                )
                if args.out:
                    args.out.mkdir(parents=True, exist_ok=True)
                    name = f"{endpoint}-p{n}-k{k}.json"
                    (args.out / name).write_text(
                        json.dumps({"prompt": prompt, **r}, ensure_ascii=False)
                    )
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    from loadtest.vllm_servers import stop_on_sigterm

    stop_on_sigterm()
    main()

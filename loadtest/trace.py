"""Request traces: heavy-tailed lengths, Poisson/Gamma/burst arrivals, a priority mix,
a constant or a day-shaped arrival rate.

A trace is JSONL, one request per line, deterministic from a seed, so the
simulator, locust and the live replay read the very same requests:

    {"id": 0, "arrival_s": 0.0132, "prompt_tokens": 187, "output_tokens": 402, "priority": "normal"}

Lengths are lognormal with the given mean (sigma 1.0 gives a ShareGPT-like
tail: median ~0.6x the mean, P99 ~6x), clamped to [1, max_len].

A day-shaped trace (`day_s` > 0) compresses a day into `day_s` seconds: the rate
follows rate * (1 - day_amplitude * cos(2 pi t / day_s)), lowest at t = 0
(midnight), highest at day_s / 2 (noon), `rate` on average over a whole day (the
peak/trough ratio is (1 + a) / (1 - a): 4x at the default 0.6). The arrival
process (Poisson, Gamma, burst) is drawn at the mean rate and its clock is then
stretched where the rate is low and squeezed where it is high (the time change
of an inhomogeneous process), so gaps keep their CV within each stretch.

Shared structure (`prefix_groups` > 0 or `turns` > 1): requests come in
multi-turn sessions, `sessions_at_once` sessions interleaved turn by turn (so a
session's next turn arrives about sessions_at_once / rate seconds after the
last). Each session draws one of `prefix_groups` system prompts of `prefix_len`
tokens; turn j's prompt is that system prompt, the whole conversation so far
(every earlier turn's user message and answer) and a new user message of about
`input_mean` tokens. `prefix_group`, `prefix_tokens` and `session` say so, and
the simulator keys its prefix cache on them.

    ferry trace --out t.jsonl --requests 10000 --rate 20 --arrival gamma --cv 3 --seed 1
    ferry trace --out day.jsonl --requests 12000 --rate 20 --day-s 600 --seed 1
    ferry trace --out chat.jsonl --requests 4000 --rate 20 --prefix-groups 8 \
        --prefix-len 1024 --turns 4 --seed 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

ARRIVALS = ("poisson", "gamma", "burst")


@dataclass(frozen=True, slots=True)
class TraceRequest:
    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    priority: str = "normal"  # high | normal | low
    prefix_group: int = -1  # its system prompt (-1: none shared)
    prefix_tokens: int = 0  # that system prompt's length, the head of prompt_tokens
    session: int = -1  # its conversation (-1: none); earlier turns head its prompt


@dataclass(frozen=True, slots=True)
class TraceSpec:
    requests: int
    rate: float  # requests per second, on average
    seed: int
    arrival: str = "poisson"
    cv: float = 1.0  # coefficient of variation of inter-arrival gaps (gamma)
    burst_size: int = 10  # burst: requests arriving together
    input_mean: float = 256
    output_mean: float = 256
    sigma: float = 1.0  # lognormal shape of both lengths
    max_len: int = 2048  # clamp for prompt and for output
    high_priority: float = 0.0  # fraction of high-priority requests
    day_s: float = 0.0  # length of one compressed day, seconds; 0: constant rate
    day_amplitude: float = 0.6  # day_s > 0: the rate swings +-60% around `rate`
    prefix_groups: int = 0  # shared system prompts (0: none)
    prefix_len: int = 0  # tokens of each
    turns: int = 1  # turns per session
    sessions_at_once: int = 32  # sessions interleaved turn by turn


MAX_MEAN_TOKENS = 1e9  # past it a length's draw overflows
MAX_SESSIONS_AT_ONCE = 10**6


def generate(spec: TraceSpec) -> list[TraceRequest]:
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)} (got {spec.arrival!r})")
    finite = (spec.rate, spec.cv, spec.input_mean, spec.output_mean, spec.sigma, spec.day_s)
    if not all(math.isfinite(x) for x in finite):
        raise ValueError("rate, cv, input_mean, output_mean, sigma and day_s must be finite")
    if spec.rate <= 0 or spec.requests < 0 or not 0.01 <= spec.cv <= 100:
        # (A gamma's shape is 1 / cv^2: past these it is 0 or infinite.)
        raise ValueError("rate must be positive, requests not negative, cv in [0.01, 100]")
    means = (spec.input_mean, spec.output_mean)
    if not all(0 < m <= MAX_MEAN_TOKENS for m in means) or spec.sigma < 0 or spec.max_len < 1:
        raise ValueError(
            f"input_mean and output_mean must be in (0, {MAX_MEAN_TOKENS:g}],"
            " sigma not negative, max_len at least 1"
        )
    if spec.burst_size < 1 or not 0 <= spec.high_priority <= 1:
        raise ValueError("burst_size must be at least 1, high_priority in [0, 1]")
    if spec.day_s < 0 or not 0 <= spec.day_amplitude < 1:
        raise ValueError("day_s must not be negative, day_amplitude must be in [0, 1)")
    if spec.prefix_groups < 0 or spec.prefix_len < 0 or spec.turns < 1:
        raise ValueError("prefix_groups and prefix_len must not be negative, turns at least 1")
    if not 1 <= spec.sessions_at_once <= MAX_SESSIONS_AT_ONCE:  # (a list of that many is made)
        raise ValueError(f"sessions_at_once must be between 1 and {MAX_SESSIONS_AT_ONCE}")
    rng = random.Random(spec.seed)
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(spec.requests):
        t += _gap(spec, rng, i)
        if not math.isfinite(t):
            raise ValueError(f"rate {spec.rate:g} is too small: arrivals pass any time")
        out.append(
            TraceRequest(
                id=i,
                arrival_s=round(day_time(t, spec.day_s, spec.day_amplitude), 6),
                prompt_tokens=_length(rng, spec.input_mean, spec.sigma, spec.max_len),
                output_tokens=_length(rng, spec.output_mean, spec.sigma, spec.max_len),
                priority="high" if rng.random() < spec.high_priority else "normal",
            )
        )
    if spec.prefix_groups > 0 or spec.turns > 1:
        out = _sessions(spec, out, random.Random(spec.seed + 1))
    return out


def _sessions(
    spec: TraceSpec, requests: list[TraceRequest], rng: random.Random
) -> list[TraceRequest]:
    """Recast `requests` (their arrivals, lengths and priorities kept as drawn, a
    prompt's length standing for its new user message) as turns of sessions."""
    out: list[TraceRequest] = []
    history: dict[int, int] = {}
    group: dict[int, int] = {}
    at_once = spec.sessions_at_once
    prefix = spec.prefix_len if spec.prefix_groups > 0 else 0
    order: list[int] = []  # the sessions of one round of turns, shuffled
    for i, r in enumerate(requests):
        wave, k = divmod(i, at_once * spec.turns)
        if k % at_once == 0:  # a new round: every session of the wave, in a new order
            order = list(range(wave * at_once, (wave + 1) * at_once))
            rng.shuffle(order)
        session = order[k % at_once]
        if session not in group:
            group[session] = rng.randrange(spec.prefix_groups) if spec.prefix_groups else -1
        prompt = prefix + history.get(session, 0) + r.prompt_tokens
        out.append(
            dataclasses.replace(
                r,
                prompt_tokens=prompt,
                prefix_group=group[session],
                prefix_tokens=prefix,
                session=session,
            )
        )
        history[session] = history.get(session, 0) + r.prompt_tokens + r.output_tokens
    return out


def _gap(spec: TraceSpec, rng: random.Random, i: int) -> float:
    if spec.arrival == "poisson":
        return rng.expovariate(spec.rate)
    if spec.arrival == "gamma":
        shape = 1.0 / (spec.cv * spec.cv)
        return rng.gammavariate(shape, 1.0 / (spec.rate * shape))
    # burst: groups of burst_size at Poisson times with the same mean rate
    if i % spec.burst_size:
        return 0.0
    return rng.expovariate(spec.rate / spec.burst_size)


def day_rate(t: float, rate: float, day_s: float, amplitude: float) -> float:
    """Requests per second at time t (seconds) of a day compressed into day_s."""
    if day_s <= 0:
        return rate
    return rate * (1 - amplitude * math.cos(2 * math.pi * t / day_s))


def day_time(s: float, day_s: float, amplitude: float) -> float:
    """The time t at which a day-shaped process has seen as many arrivals as a
    constant-rate one at time s: solves t - a * day_s / (2 pi) * sin(2 pi t / day_s) = s
    (the integral of day_rate / rate). The left side grows with t (slope 1 - a cos
    >= 1 - a > 0), so t is unique, increasing in s, and within a * day_s / (2 pi) of s:
    Newton's method, kept inside that bracket by bisection."""
    if day_s <= 0 or amplitude == 0:
        return s
    w = 2 * math.pi / day_s
    lo, hi = s - amplitude / w, s + amplitude / w
    t = s
    for _ in range(100):
        f = t - amplitude / w * math.sin(w * t) - s
        if f > 0:
            hi = t
        else:
            lo = t
        t_next = t - f / (1 - amplitude * math.cos(w * t))
        if not lo < t_next < hi:
            t_next = (lo + hi) / 2
        if abs(t_next - t) < 1e-9:
            return t_next
        t = t_next
    return t


def _length(rng: random.Random, mean: float, sigma: float, max_len: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2  # so that E[length] = mean before clamping
    return max(1, min(max_len, round(rng.lognormvariate(mu, sigma))))


def write(path: Path, requests: Iterable[TraceRequest]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps(asdict(r)) + "\n")


def read(path: Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    ids: set[int] = set()
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                request = TraceRequest(**json.loads(line))
                _check(request)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace request: {exc}") from None
            if request.id in ids:
                raise ValueError(f"{path}:{n}: request id {request.id} is taken")
            ids.add(request.id)
            out.append(request)
    return out


def _check(r: TraceRequest) -> None:
    """A request the simulator and the replays can run, else a ValueError."""

    def count(value: object, least: int) -> bool:
        return type(value) is int and value >= least

    if not count(r.id, 0):
        raise ValueError(f"id must be a count (got {r.id!r})")
    arrival = r.arrival_s
    if not (type(arrival) in (int, float) and math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"arrival_s must be seconds, 0 or more (got {arrival!r})")
    if not (count(r.prompt_tokens, 1) and count(r.output_tokens, 1)):
        raise ValueError("prompt_tokens and output_tokens must be counts, at least 1")
    if r.priority not in ("high", "normal", "low"):
        raise ValueError(f"priority must be high, normal or low (got {r.priority!r})")
    if not (count(r.prefix_group, -1) and count(r.session, -1)):
        raise ValueError("prefix_group and session must be counts (or -1: none)")
    if not (count(r.prefix_tokens, 0) and r.prefix_tokens <= r.prompt_tokens):
        raise ValueError("prefix_tokens must be a count, at most prompt_tokens")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--requests", type=int, required=True)
    parser.add_argument("--rate", type=float, required=True, help="requests per second")
    parser.add_argument("--arrival", choices=ARRIVALS, default="poisson")
    parser.add_argument("--cv", type=float, default=1.0, help="gamma: CV of the gaps")
    parser.add_argument("--burst-size", type=int, default=10)
    parser.add_argument("--input-mean", type=float, default=256)
    parser.add_argument("--output-mean", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=1.0, help="lognormal shape")
    parser.add_argument("--max-len", type=int, default=2048)
    parser.add_argument("--high-priority", type=float, default=0.0, help="fraction, 0..1")
    parser.add_argument(
        "--day-s",
        type=float,
        default=0.0,
        help="day-shaped rate: one day compressed into this many seconds (0: constant rate)",
    )
    parser.add_argument(
        "--day-amplitude", type=float, default=0.6, help="day-shaped rate: swing around --rate"
    )
    parser.add_argument("--prefix-groups", type=int, default=0, help="shared system prompts")
    parser.add_argument("--prefix-len", type=int, default=0, help="tokens of each")
    parser.add_argument("--turns", type=int, default=1, help="turns per session")
    parser.add_argument(
        "--sessions-at-once", type=int, default=32, help="sessions interleaved turn by turn"
    )
    parser.add_argument("--seed", type=int, required=True)


def run(args: argparse.Namespace) -> int:
    spec = TraceSpec(
        requests=args.requests,
        rate=args.rate,
        seed=args.seed,
        arrival=args.arrival,
        cv=args.cv,
        burst_size=args.burst_size,
        input_mean=args.input_mean,
        output_mean=args.output_mean,
        sigma=args.sigma,
        max_len=args.max_len,
        high_priority=args.high_priority,
        day_s=args.day_s,
        day_amplitude=args.day_amplitude,
        prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len,
        turns=args.turns,
        sessions_at_once=args.sessions_at_once,
    )
    requests = generate(spec)
    write(args.out, requests)
    span = requests[-1].arrival_s if requests else 0.0
    print(f"wrote {len(requests)} requests over {span:.1f}s to {args.out}")
    return 0

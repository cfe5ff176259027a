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

    ferry trace --out t.jsonl --requests 10000 --rate 20 --arrival gamma --cv 3 --seed 1
    ferry trace --out day.jsonl --requests 12000 --rate 20 --day-s 600 --seed 1
"""

from __future__ import annotations

import argparse
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


def generate(spec: TraceSpec) -> list[TraceRequest]:
    if spec.arrival not in ARRIVALS:
        raise ValueError(f"arrival must be one of {', '.join(ARRIVALS)} (got {spec.arrival!r})")
    if spec.rate <= 0 or spec.requests < 0 or spec.cv <= 0:
        raise ValueError("rate and cv must be positive, requests not negative")
    if spec.day_s < 0 or not 0 <= spec.day_amplitude < 1:
        raise ValueError("day_s must not be negative, day_amplitude must be in [0, 1)")
    rng = random.Random(spec.seed)
    out: list[TraceRequest] = []
    t = 0.0
    for i in range(spec.requests):
        t += _gap(spec, rng, i)
        out.append(
            TraceRequest(
                id=i,
                arrival_s=round(day_time(t, spec.day_s, spec.day_amplitude), 6),
                prompt_tokens=_length(rng, spec.input_mean, spec.sigma, spec.max_len),
                output_tokens=_length(rng, spec.output_mean, spec.sigma, spec.max_len),
                priority="high" if rng.random() < spec.high_priority else "normal",
            )
        )
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
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(TraceRequest(**json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: not a trace request: {exc}") from None
    return out


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
    )
    requests = generate(spec)
    write(args.out, requests)
    span = requests[-1].arrival_s if requests else 0.0
    print(f"wrote {len(requests)} requests over {span:.1f}s to {args.out}")
    return 0

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest

from loadtest.trace import TraceSpec, day_rate, generate, read, write


def test_deterministic_and_round_trips(tmp_path: Path) -> None:
    spec = TraceSpec(requests=500, rate=10, seed=3, high_priority=0.1)
    first, again = generate(spec), generate(spec)
    assert first == again
    assert generate(TraceSpec(requests=500, rate=10, seed=4)) != first
    write(tmp_path / "t.jsonl", first)
    assert read(tmp_path / "t.jsonl") == first


def test_shape_of_the_workload() -> None:
    reqs = generate(TraceSpec(requests=20000, rate=20, seed=1, high_priority=0.1))
    prompts = [r.prompt_tokens for r in reqs]
    # lognormal, sigma 1: mean near the target, heavy tail, median well below the mean
    assert 220 < statistics.mean(prompts) < 280
    assert statistics.median(prompts) < 0.75 * statistics.mean(prompts)
    assert max(prompts) <= 2048 and min(prompts) >= 1
    assert 0.08 < sum(r.priority == "high" for r in reqs) / len(reqs) < 0.12
    span = reqs[-1].arrival_s
    assert 900 < span < 1100  # 20000 requests at 20/s
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))


def test_gamma_arrivals_have_the_requested_cv() -> None:
    reqs = generate(TraceSpec(requests=20000, rate=10, seed=2, arrival="gamma", cv=3))
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(reqs, reqs[1:], strict=False)]
    cv = statistics.pstdev(gaps) / statistics.mean(gaps)
    assert 2.5 < cv < 3.5
    assert 0.08 < statistics.mean(gaps) < 0.12


def test_bursts_arrive_together() -> None:
    reqs = generate(TraceSpec(requests=100, rate=10, seed=2, arrival="burst", burst_size=10))
    assert len({r.arrival_s for r in reqs}) == 10


def test_bad_specs_and_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="arrival"):
        generate(TraceSpec(requests=1, rate=1, seed=1, arrival="uniform"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 0}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read(bad)


def test_a_day_shaped_rate_peaks_at_midday() -> None:
    day = 600.0
    reqs = generate(TraceSpec(requests=24000, rate=20, seed=5, day_s=day, day_amplitude=0.6))
    assert generate(TraceSpec(requests=24000, rate=20, seed=5, day_s=day)) == reqs
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:], strict=False))
    # Arrivals per tenth of the day against the rate's integral over that tenth.
    for k in range(10):
        start, end = k * day / 10, (k + 1) * day / 10
        n = sum(start <= r.arrival_s < end for r in reqs)
        w = 2 * math.pi / day
        expected = 20 * ((end - start) - 0.6 / w * (math.sin(w * end) - math.sin(w * start)))
        assert abs(n - expected) < 5 * math.sqrt(expected), (k, n, expected)
    noon = sum(day * 0.45 <= r.arrival_s < day * 0.55 for r in reqs)
    night = sum(r.arrival_s < day * 0.05 or day * 0.95 <= r.arrival_s < day for r in reqs)
    assert 3.0 < noon / night < 5.0  # (1 + 0.6) / (1 - 0.6) = 4 at the extremes
    assert day_rate(day / 2, 20, day, 0.6) == pytest.approx(32)
    with pytest.raises(ValueError, match="day_amplitude"):
        generate(TraceSpec(requests=1, rate=1, seed=1, day_s=day, day_amplitude=1.0))


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"rate": math.nan}, "finite"),
        ({"rate": 1e-320}, "too small"),
        ({"arrival": "burst", "burst_size": 0}, "burst_size"),
        ({"arrival": "gamma", "cv": math.inf}, "finite"),
        ({"output_mean": math.inf}, "finite"),
        ({"input_mean": 0}, r"input_mean and output_mean must be in \(0, "),
        # A traceback (a gamma's shape of 1e600, a length's overflow) or a hang
        # (a list of a billion sessions) before.
        ({"arrival": "gamma", "cv": 1e-300}, r"cv in \[0\.01, 100\]"),
        ({"input_mean": 1e308}, r"input_mean and output_mean must be in \(0, "),
        ({"turns": 3, "sessions_at_once": 10**9}, "sessions_at_once must be between"),
        ({"high_priority": 2}, "high_priority"),
        ({"max_len": 0}, "max_len"),
    ],
)
def test_a_spec_that_makes_no_trace_says_why(spec: dict[str, object], says: str) -> None:
    raw: dict[str, object] = {"requests": 10, "rate": 1.0, "seed": 1, **spec}
    with pytest.raises(ValueError, match=says):
        generate(TraceSpec(**raw))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "line",
    [
        '{"id": 0, "arrival_s": -1, "prompt_tokens": 5, "output_tokens": 5}',
        '{"id": 0, "arrival_s": NaN, "prompt_tokens": 5, "output_tokens": 5}',
        '{"id": 0, "arrival_s": "1", "prompt_tokens": 5, "output_tokens": 5}',
        '{"id": 0, "arrival_s": 1, "prompt_tokens": 0, "output_tokens": 5}',
        '{"id": 0, "arrival_s": 1, "prompt_tokens": 10.5, "output_tokens": 5}',
        '{"id": 0, "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5, "priority": 2}',
        '{"id": [0], "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5}',
        '{"id": 0, "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5, "session": "s"}',
    ],
)
def test_a_request_no_run_could_serve_is_refused_with_its_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:1: not a trace request"):
        read(path)


def test_a_taken_id_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    one = '{"id": 3, "arrival_s": 1, "prompt_tokens": 5, "output_tokens": 5}'
    path.write_text(one + "\n" + one + "\n")
    with pytest.raises(ValueError, match=r"t\.jsonl:2: request id 3 is taken"):
        read(path)

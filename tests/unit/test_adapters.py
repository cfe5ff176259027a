"""The engine registry: names to adapters, and what each adapter says."""

from __future__ import annotations

import pytest

from adapters import ADAPTERS, EngineAdapter, UnknownEngine, get_adapter
from adapters.registry import build_registry
from adapters.vllm import METRICS_PATH, parse_metrics


def test_vllm_reports_metrics_token_ids_and_runs_the_shim() -> None:
    vllm = get_adapter("vllm")
    assert (vllm.metrics_path, vllm.parse_metrics) == (METRICS_PATH, parse_metrics)
    assert dict(vllm.token_id_request_fields) == {"return_token_ids": True}
    assert vllm.returns_token_ids and vllm.runs_shim and vllm.has_metrics


def test_openai_is_generic_no_metrics_no_ids_no_shim() -> None:
    generic = get_adapter("openai")
    assert generic.metrics_path is None and generic.parse_metrics is None
    assert not generic.has_metrics
    assert dict(generic.token_id_request_fields) == {}  # nothing a strict server could reject
    assert not generic.returns_token_ids and not generic.runs_shim


def test_registry_lists_every_engine_and_names_them_on_a_miss() -> None:
    assert list(ADAPTERS) == ["vllm", "openai"]
    with pytest.raises(UnknownEngine, match=r"unknown engine 'tgi'; must be one of vllm, openai"):
        get_adapter("tgi")


def test_a_name_registered_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="'x' is registered twice"):
        build_registry([EngineAdapter(name="x"), EngineAdapter(name="x")])


def test_an_adapter_is_checked_when_built() -> None:
    with pytest.raises(ValueError, match="metrics_path and parse_metrics go together"):
        EngineAdapter(name="x", metrics_path="/metrics")
    with pytest.raises(ValueError, match="token ids need the request fields"):
        EngineAdapter(name="x", returns_token_ids=True)
    fields = {"return_token_ids": True}
    adapter = EngineAdapter(name="x", token_id_request_fields=fields, returns_token_ids=True)
    fields["extra"] = True  # the adapter keeps its own frozen copy
    assert dict(adapter.token_id_request_fields) == {"return_token_ids": True}
    with pytest.raises(TypeError):
        adapter.token_id_request_fields["x"] = 1  # type: ignore[index]

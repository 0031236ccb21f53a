"""ONNXTRAIN_BENCH_CONFIG: session config entries for onnxtrain's peers in A/B variants (bench/worker.py)."""

from __future__ import annotations

import pytest

from bench import worker


def test_entries_reach_the_numpy_peer(monkeypatch) -> None:
    monkeypatch.delenv("ONNXTRAIN_BENCH_BACKEND", raising=False)
    monkeypatch.delenv("ONNXTRAIN_BENCH_CONFIG", raising=False)
    assert worker._backend_options() is None  # the default: no options at all
    monkeypatch.setenv("ONNXTRAIN_BENCH_CONFIG", "onnxtrain.flat_update=0; session.some_key = a=b")
    so = worker._backend_options()
    assert so.get_session_config_entry("onnxtrain.flat_update") == "0"
    assert so.get_session_config_entry("session.some_key") == "a=b"  # split at the first '='
    with pytest.raises(KeyError):
        so.get_session_config_entry("onnxtrain.backend")


def test_entries_reach_the_backend_peer(monkeypatch) -> None:
    monkeypatch.setenv("ONNXTRAIN_BENCH_BACKEND", "onnxruntime")
    monkeypatch.setenv("ONNXTRAIN_BENCH_CONFIG", "onnxtrain.flat_update=0")
    so = worker._backend_options()
    assert so.get_session_config_entry("onnxtrain.backend") == "onnxruntime"
    assert so.get_session_config_entry("onnxtrain.flat_update") == "0"


@pytest.mark.parametrize("value", ["onnxtrain.flat_update", "=0", "a=1;b"])
def test_a_malformed_entry_is_an_error(monkeypatch, value: str) -> None:
    monkeypatch.setenv("ONNXTRAIN_BENCH_CONFIG", value)
    with pytest.raises(ValueError, match="ONNXTRAIN_BENCH_CONFIG"):
        worker._backend_options()

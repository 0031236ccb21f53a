"""bench --ort-spin: both onnxruntime peers get the same threading setting (bench/worker.py)."""

from __future__ import annotations

import pytest

from bench import run, worker


class Options:
    def __init__(self) -> None:
        self.entries: dict[str, str] = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        self.entries[key] = value


@pytest.mark.parametrize("setting, entries", [("on", {}), ("off", {"session.intra_op.allow_spinning": "0"})])
def test_ort_spin_reaches_both_onnxruntime_peers(setting: str, entries: dict, monkeypatch) -> None:
    monkeypatch.setenv(run.ORT_SPIN_ENV, "1" if setting == "on" else "0")
    so = Options()
    worker._ort_spin(so)  # the onnxruntime-training peer's options
    assert so.entries == entries
    monkeypatch.setenv("ONNXTRAIN_BENCH_BACKEND", "onnxruntime")
    backend = worker._backend_options()  # onnxtrain's onnxruntime backend peer
    for key, value in entries.items():
        assert backend.get_session_config_entry(key) == value
    if not entries:
        with pytest.raises(KeyError):
            backend.get_session_config_entry("session.intra_op.allow_spinning")

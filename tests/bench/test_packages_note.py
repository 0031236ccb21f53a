"""The bench names the package versions each peer loaded (peak RSS depends on them: ml_dtypes 0.7.0, which
onnx imports, holds 5 MiB more than 0.5.4 in every process)."""

from __future__ import annotations

import numpy as np

from bench import run, worker


def test_loaded_versions_are_the_imported_packages() -> None:
    got = worker.loaded_versions()
    assert got["numpy"] == np.__version__
    assert set(got) <= set(worker.REPORTED)


def test_packages_note_groups_peers_of_the_same_versions(monkeypatch) -> None:
    monkeypatch.setattr(run, "PACKAGES", {
        "onnxtrain TrainingSession": {"numpy": "2.4.6", "ml_dtypes": "0.7.0"},
        "onnxtrain Module+Optimizer": {"numpy": "2.4.6", "ml_dtypes": "0.7.0"},
        "onnxruntime-training 1.19.2": {"numpy": "1.26.4", "ml_dtypes": "0.5.4", "onnxruntime": "1.19.2"},
        "a skipped peer": {},
    })
    note = run.packages_note()
    assert note == ("packages loaded (peak RSS depends on their versions): onnxtrain TrainingSession, "
                    "onnxtrain Module+Optimizer: numpy 2.4.6, ml_dtypes 0.7.0; onnxruntime-training 1.19.2: "
                    "numpy 1.26.4, ml_dtypes 0.5.4, onnxruntime 1.19.2")
    monkeypatch.setattr(run, "PACKAGES", {})
    assert run.packages_note() == ""

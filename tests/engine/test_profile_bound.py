"""A profiled session that runs for hours holds a bounded profile: each of its graphs stops recording node
events at ``MAX_PROFILE_EVENTS`` (1,000,000, where onnxruntime's profiler stops recording), with one warning,
and the session's own ``model_run`` events stop there too. Before, the numpy engine appended one event per
node per run for as long as the session lived (about 1 KB each: a 100-node training step profiled for
10,000 steps held a gigabyte). Here the bound is lowered so that a few runs reach it; the node events
written per run are checked against onnxruntime's own profile of the same model."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnxruntime as ort
import pytest

import onnxtrain
from onnxtrain.engine import interface, plan
from tests.session.helpers import mlp_model, params

LIMIT = 40


def _node_events(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [e for e in json.load(f) if e["cat"] == "Node"]
    finally:
        os.remove(path)


@pytest.fixture
def low_limit(monkeypatch):
    monkeypatch.setattr(plan, "MAX_PROFILE_EVENTS", LIMIT)
    monkeypatch.setattr(interface, "MAX_PROFILE_EVENTS", LIMIT)
    import onnxtrain.inference

    monkeypatch.setattr(onnxtrain.inference, "MAX_PROFILE_EVENTS", LIMIT)


def _options(tmp_path, lib=onnxtrain):
    so = lib.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    so.graph_optimization_level = lib.GraphOptimizationLevel.ORT_DISABLE_ALL
    return so


def test_inference_profile_stops_growing_at_the_limit(tmp_path, low_limit) -> None:
    model = mlp_model(loss="mse").SerializeToString()  # (no function op that onnxruntime expands)
    feeds = {"x": np.ones((3, 8), np.float32), "y": np.zeros((3, 4), np.float32)}
    ref = ort.InferenceSession(model, _options(tmp_path, ort), providers=["CPUExecutionProvider"])
    ref.run(None, feeds)
    # onnxruntime's node kernels of one run (each has fence events around its kernel_time event)
    per_run = len([e for e in _node_events(ref.end_profiling()) if e["name"].endswith("_kernel_time")])
    sess = onnxtrain.InferenceSession(model, _options(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3 * LIMIT):
            sess.run(None, feeds)
    runs = -(-LIMIT // per_run)  # the runs that start below the limit are traced whole
    assert len(sess._plan.profile) == runs * per_run
    assert len(sess._session_events) <= LIMIT
    assert sum("reached" in str(w.message) for w in caught) == 1
    events = _node_events(sess.end_profiling())
    assert len(events) == runs * per_run


def test_training_profile_stops_growing_at_the_limit(tmp_path, low_limit) -> None:
    sess = onnxtrain.TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"),
                                     sess_options=_options(tmp_path))
    feeds = {"x": np.ones((3, 8), np.float32), "y": np.array([0, 1, 2]),
             "Learning_Rate": np.array([0.1], np.float32)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess.run(["loss"], feeds)
        per_run = len(sess._plan.profile)
        for _ in range(3 * LIMIT):
            sess.run(["loss"], feeds)
    assert len(sess._plan.profile) == -(-LIMIT // per_run) * per_run
    assert sum("reached" in str(w.message) for w in caught) == 1
    assert 0 < len(_node_events(sess.end_profiling())) <= LIMIT + per_run

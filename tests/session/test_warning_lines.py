"""Warnings raised while a session is built point at the line of user code that built it, however deep
inside onnxtrain they are raised (``onnxtrain.user_warning.warn``), as Python's own warnings do."""

from __future__ import annotations

import pathlib
import warnings

import numpy as np
import pytest
from onnx import numpy_helper

from onnxtrain import SessionOptions, TrainingSession
from onnxtrain.user_warning import warn
from tests.session.helpers import mlp_model, params


def _with_unused_weight():
    model = mlp_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(3, np.float32), "unused"))
    return model


def _threads() -> SessionOptions:
    options = SessionOptions()
    options.inter_op_num_threads = 2
    return options


CASES = {
    "weights_to_train: ['unused'] have no consumer": lambda: TrainingSession(
        _with_unused_weight().SerializeToString(), params(weights_to_train=["W1", "unused"])),
    "transformer_layer_recompute: no transformer layer found": lambda: TrainingSession(
        mlp_model().SerializeToString(), params(transformer_layer_recompute=True)),
    "num_pipeline_micro_batches have no effect with pipeline_parallel_size=1": lambda: TrainingSession(
        mlp_model().SerializeToString(), params(num_pipeline_micro_batches=4)),
    "SessionOptions.inter_op_num_threads has no effect on the numpy engine": lambda: TrainingSession(
        mlp_model().SerializeToString(), params(), _threads()),
    "CUDAExecutionProvider is not available": lambda: TrainingSession(
        mlp_model().SerializeToString(), params(), None, ["CUDAExecutionProvider"]),
}


@pytest.mark.parametrize("start", sorted(CASES))
def test_session_warnings_point_at_the_building_line(start: str) -> None:
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        CASES[start]()
    mine = [w for w in got if start in str(w.message)]
    assert len(mine) == 1, [str(w.message) for w in got]
    assert mine[0].filename == __file__, mine[0].filename
    assert mine[0].lineno in {n for n, line in enumerate(pathlib.Path(__file__).read_text().splitlines(), 1)
                              if "TrainingSession(" in line and "lambda" in line}


def _user_function() -> None:
    warn("here", RuntimeWarning)


def test_warn_from_user_code_points_at_its_caller() -> None:
    """Called outside onnxtrain, the first frame is already the user's: the call's own line."""
    with pytest.warns(RuntimeWarning, match="here") as got:
        _user_function()
    assert (got[0].filename, got[0].lineno) == (__file__, _user_function.__code__.co_firstlineno + 1)

"""The oracle of the tests of fused steps fed values their nodes refuse: onnxruntime fails naming the node,
and so does onnxtrain's plan, fused or not, with one error class."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnxtrain


def fails_as_unfused(model: bytes, feeds: dict[str, np.ndarray], node: str, op: str,
                     same_message: bool = False) -> onnxtrain.InferenceSession:
    """Check that onnxruntime refuses ``feeds`` naming ``node``, and that onnxtrain's unfused and fused
    plans fail naming ``node`` (of type ``op``), with the same error class (and message, with
    ``same_message``); returns the fused session."""
    with pytest.raises(Exception, match=node):  # noqa: PT011 - onnxruntime's Fail is no RuntimeError
        ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    levels = onnxtrain.GraphOptimizationLevel
    errors = []
    for level in (levels.ORT_DISABLE_ALL, levels.ORT_ENABLE_ALL):
        options = onnxtrain.SessionOptions()
        options.graph_optimization_level = level
        sess = onnxtrain.InferenceSession(model, options)
        with pytest.raises(RuntimeError) as e:
            sess.run(None, feeds)
        errors.append(e.value)
        assert f"node '{node}' ({op})" in str(e.value), e.value
    assert type(errors[1]) is type(errors[0])
    if same_message:
        assert str(errors[1]) == str(errors[0])
    return sess

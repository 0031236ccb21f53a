"""Review M: ``perform_fp16_allreduce`` (onnxruntime 1.5-1.7, default True) acts only under mixed precision in
onnxruntime (its ``ConfigureSessionForTraining`` gave it to the optimizer config as
``do_all_reduce_in_mixed_precision_type``, read only when the graph is mixed precision). Assigned True by
the caller without ``use_mixed_precision`` it asks for a half-precision exchange that cannot happen (the
gradients are the weights' own type) and should say so as the other idle options do (``mixed_precision_dtype``
without mixed precision warns). Left at its default it must stay silent, and so must an
assigned False (what onnxtrain does anyway: tests/session/test_parameters.py holds it to no warning).
``TrainingParameters.idle_options`` now says so."""

from __future__ import annotations

import warnings

from onnxtrain import TrainingSession
from tests.session.helpers import mlp_model, params


def _warnings(**kw) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        TrainingSession(mlp_model().SerializeToString(), params("SGDOptimizer", **kw))
    return [str(w.message) for w in caught if "perform_fp16_allreduce" in str(w.message)]


def test_perform_fp16_allreduce_left_alone_or_false_says_nothing() -> None:
    assert _warnings() == []
    assert _warnings(use_mixed_precision=True) == []
    assert _warnings(perform_fp16_allreduce=False) == []


def test_perform_fp16_allreduce_assigned_true_without_mixed_precision_warns() -> None:
    got = _warnings(perform_fp16_allreduce=True)
    assert any("perform_fp16_allreduce has no effect without use_mixed_precision" in m for m in got), got


def test_perform_fp16_allreduce_warning_says_how_half_gradients_are_exchanged() -> None:
    """Review R1: since 42f179af a float16 model's gradients are summed across ranks in float32, not in their
    own type, and the warning must not say otherwise."""
    import numpy as np
    from onnx import TensorProto

    from tests.parallel import review_m_worker as wk

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = TrainingSession(wk.half_model(TensorProto.FLOAT16),
                            wk.params("allreduce", "SGDOptimizer", 1, perform_fp16_allreduce=True))
    got = [str(w.message) for w in caught if "perform_fp16_allreduce" in str(w.message)]
    assert s.get_state()["W"].dtype == np.float16
    assert len(got) == 1 and "weights' own type" not in got[0], got
    assert "float16 and bfloat16 ones in float32" in got[0], got

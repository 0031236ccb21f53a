"""The legacy ``TrainingSession`` fed a learning rate at or past float32's range, against onnxruntime-training
1.16.3's (review R3 of 3fcca018, which made the on-device Optimizer take such rates silently, as 1.19.2).

Each feed of ``Learning_Rate`` (float32 ±inf, NaN, 3.4e38, and a Python list [1e39] that both convert
through numpy to float32 +inf) runs one step of a fresh session in both: the weights after it agree (±inf
and NaN where the other has them, the finite ones within float32 rounding of the gradients; Adam's within
1e-3, its ratio m/(√v + ε) magnifying the rounding of a gradient near 0 at such a rate), and the numpy
warnings raised during the step are the same: none for float32 arrays, numpy's "overflow encountered in
cast" for the list in both (1.16.3's binding casts the list with numpy too).
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest

from tests.ortt import ensure_ort_legacy, run_script
from tests.session.legacy_peer import legacy_model
from tests.session.test_legacy_ort116_numerics import mlp
from tests.tiers import extended, full

FEEDS = {"inf": [np.inf], "neg_inf": [-np.inf], "nan": [np.nan], "f32_max": [3.4e38], "list_past_f32": None}
WEIGHTS = ("W1", "b1", "W2", "b2")

# run by both: ``ort`` is onnxruntime (1.16.3) there, onnxtrain here
_STEPS = r"""
def steps(ort, path, optimizer):
    import warnings

    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 10)).astype(np.float32)
    y = rng.integers(0, 12, 6).astype(np.int64)
    out = {}
    for key in ("inf", "neg_inf", "nan", "f32_max", "list_past_f32"):
        lr = [1e39] if key == "list_past_f32" else np.array(
            {"inf": [np.inf], "neg_inf": [-np.inf], "nan": [np.nan], "f32_max": [3.4e38]}[key], np.float32)
        p = ort.TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = optimizer
        p.weights_to_train = {"W1", "b1", "W2", "b2"}
        p.optimizer_attributes_map = {w: {} for w in ("W1", "b1", "W2", "b2")}
        p.optimizer_int_attributes_map = {w: {} for w in ("W1", "b1", "W2", "b2")}
        s = ort.TrainingSession(path, p, ort.SessionOptions(), providers=["CPUExecutionProvider"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = s.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]
        state = s.get_state()
        out[key] = {"loss": float(np.asarray(loss)),
                    "warnings": sorted({f"{w.category.__name__}: {w.message}" for w in caught}),
                    "state": {w: np.asarray(state[w], np.float32).ravel().tolist() for w in state}}
    return out
"""

_SCRIPT = _STEPS + r"""
import json, sys
import onnxruntime
print(json.dumps({opt: steps(onnxruntime, sys.argv[1], opt) for opt in sys.argv[2:]}))
"""


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[dict, dict]:
    """(onnxtrain's, 1.16.3's) records per optimizer; one 1.16.3 process."""
    import onnx

    import onnxtrain

    python = ensure_ort_legacy()
    path = os.path.join(str(tmp_path_factory.mktemp("legacy_lr")), "mlp.onnx")
    onnx.save(legacy_model(mlp()), path)
    theirs = run_script(_SCRIPT, path, *(("SGDOptimizer", "AdamOptimizer") if full() else ("SGDOptimizer",)),
                        python=python)
    ns: dict = {}
    exec(compile(_STEPS, "<steps>", "exec"), ns)  # noqa: S102 - the same steps 1.16.3 runs
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (recorded inside)
        ours = {opt: ns["steps"](onnxtrain, path, opt) for opt in theirs}
    return json.loads(json.dumps(ours)), theirs


@pytest.mark.parametrize("optimizer", ["SGDOptimizer", extended("AdamOptimizer", id="AdamOptimizer")])
def test_learning_rate_feeds_past_float32_as_onnxruntime_training_1_16_3(records, optimizer):
    ours, theirs = (r[optimizer] for r in records)
    assert list(ours) == list(theirs) == list(FEEDS)
    assert theirs["list_past_f32"]["warnings"] == ["RuntimeWarning: overflow encountered in cast"]
    for key, b in theirs.items():
        a = ours[key]
        assert a["warnings"] == b["warnings"], (optimizer, key, a["warnings"], b["warnings"])
        assert a["loss"] == b["loss"], (optimizer, key)
        for w in WEIGHTS:
            x, y = np.array(a["state"][w], np.float32), np.array(b["state"][w], np.float32)
            # (at 3.4e38 the step is the rate times the gradient, whose float32 rounding differs by an ulp
            # between MLAS and numpy's BLAS: tolerances as tests/session/test_legacy_ort116_numerics.py's)
            finite = np.abs(y[np.isfinite(y)])
            atol = 1e-6 * float(finite.max()) if finite.size else 0.0
            rtol = 1e-5 if optimizer == "SGDOptimizer" else 1e-3
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=f"{optimizer} {key} {w}")

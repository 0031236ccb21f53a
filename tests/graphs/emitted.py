"""Checks for a model onnxtrain writes: onnx.checker's full check, and a run in onnxruntime's inference
package that gives the numpy engine's values on the same file and feeds."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import helper

from tests.engine.random_models import _options


def _np_type(elem: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem))


def feeds_for(model: onnx.ModelProto, known: Mapping[str, np.ndarray],
              seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for every graph input of ``model`` that is no initializer: ``known`` values where given, else
    small random values of the declared type (symbolic dims bound by the known values, 2 otherwise; an int64
    ``step`` is 2, other ints 0 or 1, bools False, a loss scale 1)."""
    rng = np.random.default_rng(seed)
    g = model.graph
    inits = {t.name for t in g.initializer}
    dims: dict[str, int] = {}
    for vi in g.input:
        if vi.name in known and vi.type.HasField("tensor_type"):
            shape = np.shape(known[vi.name])
            for d, n in zip(vi.type.tensor_type.shape.dim, shape):
                if d.dim_param:
                    dims.setdefault(d.dim_param, n)
    out: dict[str, np.ndarray] = {}
    for vi in g.input:
        if vi.name in inits:
            continue
        if vi.name in known:
            out[vi.name] = np.asarray(known[vi.name])
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else dims.get(d.dim_param, 2) for d in t.shape.dim]
        dt = _np_type(t.elem_type)
        if dt == np.bool_:
            value = np.zeros(shape, np.bool_)
        elif np.issubdtype(dt, np.integer):
            value = np.full(shape, 2, dt) if vi.name == "step" else rng.integers(0, 2, shape).astype(dt)
        else:
            scale = "loss_scale" in vi.name.lower()
            value = (np.ones(shape) if scale else 0.1 * rng.standard_normal(shape)).astype(dt)
        out[vi.name] = value
    return out


def _training_batch_norm(model: onnx.ModelProto) -> bool:
    from onnxtrain.ir.graphs import walk_graphs

    # (before opset 14, a BatchNormalization with its running statistics as outputs is one in training mode)
    return any(n.op_type == "BatchNormalization"
               and (any(a.name == "training_mode" and a.i for a in n.attribute) or len(n.output) > 1)
               for g in walk_graphs(model.graph) for n in g.node)


def float_error(a: np.ndarray, b: np.ndarray, floor: float = 1e-3) -> float:
    """``|a − b| / |a|`` (2-norms), with ``|a|`` at least ``floor`` per element's root mean square: a gradient
    that is rounding noise around zero (a bias before a BatchNormalization, an attention key's bias) is
    compared absolutely."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    least = floor * np.sqrt(max(a64.size, 1))
    return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(a64), least))


def run_both(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], label: str,
             level: str = "ORT_ENABLE_ALL") -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """Outputs of ``model`` on ``feeds`` from onnxruntime (``level`` of optimization) and the numpy engine."""
    import onnxruntime as ort

    from onnxtrain import InferenceSession

    data = model.SerializeToString()
    so = ort.SessionOptions()
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    # README ("Running a gradient graph elsewhere"): onnxruntime's ConstantSharing gives wrong values for a
    # training-mode BatchNormalization whose running statistics are no graph outputs; turn it off, as advised
    off = ["ConstantSharing"] if _training_batch_norm(model) else []
    try:
        theirs = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"], disabled_optimizers=off)
    except Exception as e:
        raise AssertionError(f"{label}: onnxruntime refuses the model: {e}") from e
    names = [o.name for o in theirs.get_outputs()]
    wanted = {i.name for i in theirs.get_inputs()}
    feed = {k: v for k, v in feeds.items() if k in wanted}
    try:
        got = theirs.run(None, feed)
    except Exception as e:
        raise AssertionError(f"{label}: onnxruntime cannot run the model: {e}") from e
    ours = InferenceSession(data, _options("numpy")).run(None, feed)
    return names, got, ours


def check_emitted(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], label: str,
                  tol: float = 1e-4, skip: tuple[str, ...] = (), step: float = 0.0,
                  floor: float = 1e-3) -> None:
    """Full check, then onnxruntime's outputs against the numpy engine's (:func:`float_error` within
    ``tol``; bool and integer outputs equal; outputs named in ``skip`` not compared). ``step``: an output
    that is an optimizer's updated weight (``*_out*``, not a moment or gradient) may also differ by up to
    ``step`` per element (Adam and Lamb move a weight whose gradient is rounding noise around zero by a step
    of the learning rate's size, of either sign)."""
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:
        raise AssertionError(f"{label}: onnx.checker (full_check) refuses the model: {e}") from e
    names, got, ours = run_both(model, feeds, label)
    for name, a, b in zip(names, got, ours):
        if name in skip:
            continue
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape, (label, name, a.shape, b.shape)
        if a.dtype == np.bool_ or np.issubdtype(a.dtype, np.integer):
            assert np.array_equal(a, b), (label, name)
            continue
        assert np.array_equal(np.isnan(a), np.isnan(b)), (label, name, "NaN positions differ")
        keep = ~np.isnan(a)
        err = float_error(a[keep], b[keep], floor)
        if err > tol and step and _updated_weight(name):
            err = 0.0 if np.max(np.abs(a[keep].astype(np.float64) - b[keep])) <= step else err
        assert err <= tol, (label, name, err)


def _updated_weight(name: str) -> bool:
    low = name.lower()
    return ("_out" in low or low.endswith(".out")) and not any(w in low for w in ("moment", "grad"))

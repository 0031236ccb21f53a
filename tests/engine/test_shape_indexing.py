"""Shape and indexing kernels on cases the op table cannot check against onnx.reference.

onnx.reference departs from the spec on a few of them (Slice clamping with negative steps,
negative Pad amounts); onnxruntime is the oracle there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model


def _model(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, out_types: Sequence[int] = (),
           **attrs: Any) -> onnx.ModelProto:
    """A one-node model; its outputs declared of ``out_types`` (element types), else of input 0's type."""
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = [f"y{i}" for i in range(n_outputs)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs) if n]
    # onnxruntime needs an output type; only ops that keep the data type are compared with it
    elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    types = list(out_types) or [elem] * n_outputs
    g_out = [helper.make_tensor_value_info(n, t, None) for n, t in zip(outs, types)]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _run_both(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, **attrs: Any):
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, n_outputs, **attrs)
    feeds = {f"x{i}": v for i, v in enumerate(inputs) if v is not None}
    ours = compile_model(model).run(feeds)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, feeds)
    return ours, theirs


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


X = np.arange(30, dtype=np.float32).reshape(5, 6)


@pytest.mark.parametrize("starts,ends,steps", [
    ((-10,), (-20,), (-1,)),   # start below -dim with a negative step clamps to 0 (element 0 kept)
    ((10,), (-20,), (-2,)),
    ((-10,), (20,), (1,)),
    ((2,), (-2**63,), (-1,)),
    ((4,), (1,), (-3,)),
    ((0,), (2**63 - 1,), (4,)),
])
def test_slice_clamping_matches_onnxruntime(starts, ends, steps) -> None:
    ours, theirs = _run_both("Slice", [X, _i64(*starts), _i64(*ends), _i64(1), _i64(*steps)], 13)
    np.testing.assert_array_equal(ours[0], theirs[0])


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_negative_amounts_matches_onnxruntime(mode: str) -> None:
    ours, theirs = _run_both("Pad", [X, _i64(-1, 2, 1, -2)], 13, mode=mode)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_pad_axes_negative_amounts_matches_onnxruntime() -> None:
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    ours, theirs = _run_both("Pad", [x, _i64(1, -2), np.array(7.0, np.float32), _i64(-1)], 18)
    np.testing.assert_array_equal(ours[0], theirs[0])


def test_topk_ties_keep_lower_index_first() -> None:
    x = np.array([[1, 3, 3, 2, 3, 1]], dtype=np.float32)
    kinds = (onnx.TensorProto.FLOAT, onnx.TensorProto.INT64)  # values, indices
    (vals, idx) = compile_model(_model("TopK", [x, _i64(4)], 13, n_outputs=2, out_types=kinds)).run(
        {"x0": x, "x1": _i64(4)})
    np.testing.assert_array_equal(idx, [[1, 2, 4, 3]])
    np.testing.assert_array_equal(vals, [[3, 3, 3, 2]])
    m = _model("TopK", [x, _i64(3)], 13, n_outputs=2, out_types=kinds, largest=0)
    _, idx = compile_model(m).run({"x0": x, "x1": _i64(3)})
    np.testing.assert_array_equal(idx, [[0, 5, 3]])


def test_scatter_nd_add_large_matches_add_at() -> None:
    rng = np.random.default_rng(1)
    data = rng.standard_normal((50, 8)).astype(np.float32)
    idx = rng.integers(-50, 50, (1000, 1)).astype(np.int64)
    upd = rng.standard_normal((1000, 8)).astype(np.float32)
    m = _model("ScatterND", [data, idx, upd], 16, reduction="add")
    (out,) = compile_model(m).run({"x0": data, "x1": idx, "x2": upd})
    want = data.copy()
    np.add.at(want, idx[:, 0], upd)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op,inputs,opset,attrs", [
    ("ScatterElements", [X, _i64(0, 1, 0).reshape(3, 1), np.ones((3, 1), np.float32)], 16,
     {"reduction": "add"}),
    ("ScatterND", [X, _i64(1, 1, 4).reshape(3, 1), np.ones((3, 6), np.float32)], 16, {"reduction": "mul"}),
    ("Pad", [X, _i64(1, 1, 1, 1)], 13, {"mode": "reflect"}),
    ("CumSum", [X, _i64(0)], 13, {"reverse": 1, "exclusive": 1}),
])
def test_kernels_leave_inputs_untouched(op: str, inputs: list[Any], opset: int, attrs: dict) -> None:
    before = [v.copy() for v in inputs]
    compile_model(_model(op, inputs, opset, **attrs)).run({f"x{i}": v for i, v in enumerate(inputs)})
    for a, b in zip(inputs, before):
        np.testing.assert_array_equal(a, b)


def test_index_out_of_range_is_an_error() -> None:
    m = _model("ScatterElements", [X, _i64(6).reshape(1, 1), np.ones((1, 1), np.float32)], 16)
    with pytest.raises(Exception, match="out of range"):
        compile_model(m).run({"x0": X, "x1": _i64(6).reshape(1, 1), "x2": np.ones((1, 1), np.float32)})


def test_gather_elements_indices_smaller_than_data_matches_onnxruntime() -> None:
    x = np.arange(24, dtype=np.float32).reshape(3, 4, 2)
    ours, theirs = _run_both("GatherElements", [x, _i64(3, 0, -1, 2).reshape(2, 2, 1)], 13, axis=1)
    np.testing.assert_array_equal(ours[0], theirs[0])


def _tensor_scatter_oracle(past: np.ndarray, update: np.ndarray, write: np.ndarray | None, mode: str,
                           axis: int) -> np.ndarray:
    """The schema's pseudocode, element by element."""
    out = past.copy()
    axis %= past.ndim
    write = np.zeros(past.shape[0], np.int64) if write is None else write
    for prefix in np.ndindex(past.shape[:axis]):
        for s in range(update.shape[axis]):
            at = int(write[prefix[0]]) + s
            if mode == "circular":
                at %= past.shape[axis]
            out[(*prefix, at)] = update[(*prefix, s)]
    return out


@pytest.mark.parametrize("past,update,write,mode,axis", [
    ((2, 3, 7, 4), (2, 3, 3, 4), [0, 4], "linear", -2),
    ((3, 6, 2), (3, 6, 2), None, "linear", 1),
    ((2, 2, 5, 3), (2, 2, 4, 3), [3, 9], "circular", 2),
    ((4, 5), (4, 2), [4, 0, 2, 13], "circular", -1),
    ((2, 4, 3, 2), (2, 4, 3, 2), [1, 0], "circular", 1),
])
def test_tensor_scatter_matches_the_schema_pseudocode(past, update, write, mode, axis) -> None:
    rng = np.random.default_rng(7)
    p, u = rng.standard_normal(past), rng.standard_normal(update)
    w = None if write is None else _i64(*write)
    inputs = [p, u] if w is None else [p, u, w]
    (out,) = compile_model(_model("TensorScatter", inputs, 24, mode=mode, axis=axis)).run(
        {f"x{i}": v for i, v in enumerate(inputs)})
    np.testing.assert_array_equal(out, _tensor_scatter_oracle(p, u, w, mode, axis))
    np.testing.assert_array_equal(inputs[0], p)  # a copy: the past cache is left as it was


@pytest.mark.parametrize("update,write,axis,match", [
    ((2, 3, 4), [2, 3], -2, "overrun"),  # linear: 3 + 3 > 5
    ((2, 3, 4), [-1, 0], -2, "overrun"),
    ((2, 6, 4), None, -2, "does not fit"),  # longer than the cache
    ((2, 3, 3), None, -2, "does not fit"),
    ((2, 2, 4), [0, 0, 0], -2, "write_indices"),
    ((2, 5, 4), None, 0, "batch axis"),
])
def test_tensor_scatter_errors(update, write, axis, match) -> None:
    past = np.zeros((2, 5, 4), np.float32)
    inputs = [past, np.ones(update, np.float32)] + ([] if write is None else [_i64(*write)])
    plan = compile_model(_model("TensorScatter", inputs, 24, axis=axis))
    with pytest.raises(Exception, match=match):
        plan.run({f"x{i}": v for i, v in enumerate(inputs)})


@pytest.mark.parametrize(("values", "dtype", "match"), [
    ((0, 10, 0), np.int64, "delta must not be 0"), ((0.0, 1.0, 0.0), np.float32, "delta must not be 0"),
    ((0.0, np.inf, 1.0), np.float32, "must be finite"), ((np.nan, 1.0, 0.5), np.float64, "must be finite")])
def test_range_with_a_zero_delta_or_a_bound_not_finite_is_refused_by_name(values, dtype, match) -> None:
    ort = pytest.importorskip("onnxruntime")
    inputs = [np.array(v, dtype) for v in values]
    model = _model("Range", inputs, 11)
    feeds = {f"x{i}": v for i, v in enumerate(inputs)}
    with pytest.raises(Exception, match="."):  # onnxruntime refuses each (an infinite range: no memory)
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(Exception, match=f"Range: .*{match}"):
        compile_model(model).run(feeds)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("n_updates", [1, 3])
def test_scatter_nd_with_empty_index_tuples_matches_onnxruntime(reduction: str, n_updates: int) -> None:
    """indices of shape (m, 0): each update is a whole tensor written over (or reduced into) the data; the
    data came back unchanged (no rows were found for empty tuples)."""
    if reduction == "none" and n_updates > 1:
        pytest.skip("duplicate writes without a reduction have no defined result")
    x = np.arange(1, 7, dtype=np.int64).reshape(2, 3)
    upd = (np.arange(n_updates * 6, dtype=np.int64).reshape(n_updates, 2, 3) % 5) - 2
    ours, theirs = _run_both("ScatterND", [x, np.zeros((n_updates, 0), np.int64), upd], 18,
                             reduction=reduction)
    np.testing.assert_array_equal(ours[0], theirs[0])


@pytest.mark.parametrize("x_shape, idx_shape, batch_dims", [((2, 3), (2, 0), 0), ((2, 3), (0,), 0),
                                                              ((2, 3, 1), (2, 4, 0), 1)])
def test_gather_nd_with_empty_index_tuples_matches_onnxruntime(x_shape, idx_shape, batch_dims) -> None:
    """Empty index tuples take each whole (per-batch) slice, as onnxruntime does (a reshape error before)."""
    x = np.arange(np.prod(x_shape), dtype=np.float32).reshape(x_shape)
    ours, theirs = _run_both("GatherND", [x, np.zeros(idx_shape, np.int64)], 13, batch_dims=batch_dims)
    assert ours[0].shape == theirs[0].shape
    np.testing.assert_array_equal(ours[0], theirs[0])


@pytest.mark.parametrize("idx_shape", [(1, 0), (0, 3, 0)])
def test_scatter_elements_indices_of_another_rank_are_refused_as_onnxruntime_does(idx_shape) -> None:
    """Empty indices of another rank than the data's passed as no update; onnxruntime refuses them."""
    ort = pytest.importorskip("onnxruntime")
    x, idx = np.ones((3,), np.float32), np.zeros(idx_shape, np.int64)
    model = _model("ScatterElements", [x, idx, np.zeros(idx_shape, np.float32)], 18).SerializeToString()
    feeds = {"x0": x, "x1": idx, "x2": np.zeros(idx_shape, np.float32)}
    with pytest.raises(Exception, match="rank"):
        ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    with pytest.raises(Exception, match="ScatterElements: indices rank"):
        compile_model(onnx.load_from_string(model)).run(feeds)


@pytest.mark.parametrize("lens", [[5, 1, 1], [-1, 1, 1], [1, 1], [1, 1, 1, 1]])
def test_reverse_sequence_refuses_lengths_out_of_range_or_of_another_batch_as_onnxruntime(lens) -> None:
    """A negative length passed as no reversal, and one past the time axis or a sequence_lens of another
    batch size failed on numpy's IndexError or reshape; onnxruntime refuses each, as the kernel now does by
    name."""
    ort = pytest.importorskip("onnxruntime")
    x, seq = np.arange(12, dtype=np.float32).reshape(4, 3), np.array(lens, np.int64)
    model = _model("ReverseSequence", [x, seq], 13, batch_axis=1, time_axis=0)
    with pytest.raises(Exception, match="sequence"):
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x0": x, "x1": seq})
    with pytest.raises(Exception, match="ReverseSequence: sequence_lens"):
        compile_model(model).run({"x0": x, "x1": seq})


def test_reverse_sequence_of_lengths_zero_to_full_matches_onnxruntime() -> None:
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    ours, theirs = _run_both("ReverseSequence", [x, np.array([0, 4, 2], np.int64)], 13, batch_axis=1,
                             time_axis=0)
    np.testing.assert_array_equal(ours[0], theirs[0])

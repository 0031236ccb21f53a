"""The fast paths of engine/kernels/indexing.py against onnxruntime, bit for bit: TopK by partition (k small
against the axis), CumSum / CumProd by whole slices (a non-last axis), and ScatterND with a reduction by
rounds of distinct rows or row by row (repeated rows). Each case also checks that its fast path is taken."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import helper as oh

import onnxtrain
from onnxtrain.engine.kernels import indexing

RNG = np.random.default_rng(0)
ELEM = {np.dtype(t): oh.np_dtype_to_tensor_dtype(np.dtype(t))
        for t in (np.float16, np.float32, np.float64, np.int32, np.int64)}


def _model(op: str, inputs: list[np.ndarray], out_types: list[int], opset: int,
           **attrs) -> tuple[bytes, dict]:
    """A one-node model of ``op`` and its feeds."""
    names = [f"i{j}" for j in range(len(inputs))]
    outs = [f"o{j}" for j in range(len(out_types))]
    g = oh.make_graph([oh.make_node(op, names, outs, **attrs)], "g",
                      [oh.make_tensor_value_info(n, ELEM[a.dtype], a.shape) for n, a in zip(names, inputs)],
                      [oh.make_tensor_value_info(n, t, None) for n, t in zip(outs, out_types)])
    model = oh.make_model(g, opset_imports=[oh.make_opsetid("", opset)])
    return model.SerializeToString(), dict(zip(names, inputs))


def _ours(op: str, inputs: list[np.ndarray], out_types: list[int], opset: int, **attrs) -> list:
    """The outputs of a one-node model of ``op`` on onnxtrain."""
    model, feeds = _model(op, inputs, out_types, opset, **attrs)
    return onnxtrain.InferenceSession(model).run(None, feeds)


def _both(op: str, inputs: list[np.ndarray], out_types: list[int], opset: int, **attrs) -> tuple[list, list]:
    """The outputs of a one-node model of ``op`` on onnxtrain and on onnxruntime."""
    model, feeds = _model(op, inputs, out_types, opset, **attrs)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    ref = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feeds)
    return _ours(op, inputs, out_types, opset, **attrs), ref


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint8), np.ascontiguousarray(b).view(np.uint8))


# ---- TopK ------------------------------------------------------------------------------------------------

def _topk_input(shape: tuple[int, ...], dtype: type, kind: str) -> np.ndarray:
    if kind == "ties":  # few distinct values: many ties at the k-th value
        return RNG.integers(-3, 4, shape).astype(dtype)
    if kind == "zeros":  # -0.0 and 0.0 tie
        return RNG.choice(np.array([0.0, -0.0, 1.0, -np.inf]), shape).astype(dtype)
    if np.dtype(dtype).kind == "i":
        return RNG.integers(np.iinfo(dtype).min, np.iinfo(dtype).max, shape, dtype=dtype, endpoint=True)
    return RNG.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64])
@pytest.mark.parametrize("kind", ["distinct", "ties", "zeros"])
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize(("shape", "axis", "k"), [((8, 1024), -1, 1), ((8, 1024), 1, 7), ((8, 1024), -1, 128),
                                                  ((2000, 3), 0, 50), ((2, 1500, 2), -2, 3)])
def test_topk_partition_matches_onnxruntime(dtype, kind, largest, shape, axis, k) -> None:
    if kind == "zeros" and np.dtype(dtype).kind == "i":
        pytest.skip("no -0.0 or -inf in integers")
    x = _topk_input(shape, dtype, kind)
    rows = np.moveaxis(x, axis, -1).reshape(-1, shape[axis])
    assert indexing._top_k_candidates(rows, k, bool(largest)) is not None  # the partition path
    ours, ref = _both("TopK", [x, np.array([k], np.int64)], [ELEM[np.dtype(dtype)], 7], 11, axis=axis,
                      largest=largest)
    assert _same_bits(ours[1], ref[1]) and _same_bits(ours[0], ref[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64])
@pytest.mark.parametrize("kind", ["distinct", "top_ties", "ties", "zeros"])
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize(("shape", "axis", "k"),
                         [((4, 8192), -1, 1), ((4, 8200), 1, 7), ((3, 9000, 2), 1, 30)])
def test_topk_of_long_rows_narrowed_by_block_extremes_matches_onnxruntime(dtype, kind, largest, shape, axis,
                                                                           k) -> None:
    if kind == "zeros" and np.dtype(dtype).kind == "i":
        pytest.skip("no -0.0 or -inf in integers")
    x = _topk_input(shape, dtype, "distinct" if kind == "top_ties" else kind)
    if kind == "top_ties":  # every 97th element ties at the top: the k picked are the first of them
        x.reshape(-1)[::97] = x.max() if largest else x.min()
    rows = np.moveaxis(x, axis, -1).reshape(-1, shape[axis])
    taken = indexing._block_narrowed(rows, k, bool(largest)) is not None
    assert taken or kind in ("ties", "zeros")  # (few distinct values: the narrowing would keep too many)
    ours, ref = _both("TopK", [x, np.array([k], np.int64)], [ELEM[np.dtype(dtype)], 7], 11, axis=axis,
                      largest=largest)
    assert _same_bits(ours[1], ref[1]) and _same_bits(ours[0], ref[0])


def test_topk_of_long_rows_with_a_nan_takes_the_sort() -> None:
    x = RNG.standard_normal((3, 8192)).astype(np.float32)
    x[1, 5000] = np.nan  # above every number: the first of row 1's top 5
    assert indexing._block_narrowed(x, 5, True) is None
    ours, ref = _both("TopK", [x, np.array([5], np.int64)], [1, 7], 11)
    assert _same_bits(ours[1], ref[1]) and np.array_equal(ours[0], ref[0], equal_nan=True)


@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("k", [0, 1, 9, 64, 1024])
def test_topk_edge_k_nan_and_unsorted(largest, k) -> None:
    """k = 0 and k = the axis length, NaN (above every number) in the top k, sorted=0 (onnxruntime's order is
    unspecified: the same indices, ours sorted)."""
    x = RNG.integers(-3, 4, (6, 1024)).astype(np.float32)
    x[RNG.random(x.shape) < 0.01] = np.nan
    x[0] = np.nan
    x[1, :1020] = np.nan  # the smallest 9 reach into the NaNs
    ours, ref = _both("TopK", [x, np.array([k], np.int64)], [1, 7], 11, largest=largest)
    assert _same_bits(ours[1], ref[1]) and np.array_equal(ours[0], ref[0], equal_nan=True)
    unsorted, ref = _both("TopK", [x, np.array([k], np.int64)], [1, 7], 11, largest=largest, sorted=0)
    assert _same_bits(unsorted[1], ours[1])
    assert np.array_equal(np.sort(unsorted[1], axis=1), np.sort(ref[1], axis=1))


def test_topk_empty() -> None:
    x = np.zeros((0, 2048), np.float32)
    ours, ref = _both("TopK", [x, np.array([3], np.int64)], [1, 7], 11)
    assert ours[0].shape == ref[0].shape == (0, 3) and ours[1].dtype == np.int64


# ---- CumSum / CumProd ------------------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["CumSum", "CumProd"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, np.int32, np.int64])
@pytest.mark.parametrize(("shape", "axis"), [((8, 20, 128), 1), ((8, 20, 128), 0), ((40, 16, 64), -3),
                                             ((2, 9, 4, 128), 1)])
@pytest.mark.parametrize(("reverse", "exclusive"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_cumulative_slices_match_onnxruntime(op, dtype, shape, axis, reverse, exclusive) -> None:
    assert indexing._slice_scan_pays(shape, axis % len(shape))
    if op == "CumProd":
        floats = np.dtype(dtype).kind == "f"
        x = 1 + RNG.standard_normal(shape) * 0.05 if floats else RNG.integers(-1, 2, shape)
    else:
        x = RNG.standard_normal(shape) * 5
    x = np.asarray(x).astype(dtype)
    if np.dtype(dtype).kind == "f":
        x.reshape(-1)[:3] = -0.0  # inclusive: copies keep the sign of zero; exclusive: 0 + -0.0 is 0.0
    opset = 26 if op == "CumProd" else 14
    ours, ref = _both(op, [x, np.array(axis, np.int64)], [ELEM[np.dtype(dtype)]], opset, reverse=reverse,
                      exclusive=exclusive)
    assert _same_bits(ours[0], ref[0])


# ---- ScatterND with a reduction --------------------------------------------------------------------------

def _scatter_case(shape: tuple[int, ...], n: int, k: int, dtype: type, reduction: str):
    x = (RNG.standard_normal(shape) * 4).astype(dtype)
    idx = np.stack([RNG.integers(-d, d, n) for d in shape[:k]], -1).astype(np.int64)
    ushape = (n,) + shape[k:]
    if reduction == "mul":
        floats = np.dtype(dtype).kind == "f"
        u = 1 + RNG.standard_normal(ushape) * 0.05 if floats else RNG.integers(-1, 2, ushape)
    else:
        u = RNG.standard_normal(ushape) * 4
    return x, idx, np.asarray(u).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize(("shape", "n", "k", "path"), [
    ((512, 256), 4096, 1, "rounds"), ((32, 16, 128), 4000, 2, "rounds"),
    ((4, 128), 2000, 1, "rows"), ((3, 2, 512), 900, 2, "rows")])
def test_scatter_nd_grouped_matches_onnxruntime(dtype, reduction, shape, n, k, path, monkeypatch) -> None:
    x, idx, u = _scatter_case(shape, n, k, dtype, reduction)
    taken = []
    for name in ("_scatter_rounds", "_scatter_each_row"):
        fn = getattr(indexing, name)
        monkeypatch.setattr(indexing, name, lambda *a, _f=fn, _n=name: (taken.append(_n), _f(*a))[1])
    ours, ref = _both("ScatterND", [x, idx, u], [ELEM[np.dtype(dtype)]], 18, reduction=reduction)
    assert taken == ["_scatter_rounds" if path == "rounds" else "_scatter_each_row"]
    assert _same_bits(ours[0], ref[0])  # each row's updates in their order: the same roundings


def test_scatter_nd_grouped_float16_matches_ufunc_at() -> None:
    """float16 (no onnxruntime kernel with a reduction): the same bits as numpy's ufunc.at, rounding after
    every update."""
    for reduction, ufunc in (("add", np.add), ("mul", np.multiply), ("max", np.maximum)):
        for shape, n in (((512, 256), 4096), ((4, 128), 2000)):
            x, idx, u = _scatter_case(shape, n, 1, np.float16, reduction)
            want = x.copy()
            ufunc.at(want, idx[:, 0], u)
            assert _same_bits(_ours("ScatterND", [x, idx, u], [10], 18, reduction=reduction)[0], want)

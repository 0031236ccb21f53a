"""Row-major copies of transposed views by OpenBLAS's omatcopy (onnxtrain/engine/transpose_copy.py): every
permutation of several shapes and dtypes against numpy's copy, special values bit for bit, which views take
the tiled path, and a Transpose (and a Transpose then Reshape) model's outputs against onnxruntime."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import helper

from onnxtrain.engine import transpose_copy

SHAPES = [(3, 4, 5), (2, 3, 4, 5), (1, 6, 1, 7), (2, 3, 1, 4, 5), (5, 33, 17)]


def _count_calls(f, calls: list[int]):
    return lambda *a: calls.append(1) or f(*a)


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """omatcopy's calls, counted."""
    calls: list[int] = []
    real = transpose_copy._functions()
    if real is None:
        pytest.skip("numpy's BLAS has no omatcopy")
    wrapped = {dt: _count_calls(f, calls) for dt, f in real.items()}
    monkeypatch.setattr(transpose_copy, "_functions", lambda: wrapped)
    return calls


@pytest.fixture
def every_size(monkeypatch: pytest.MonkeyPatch, counted: list[int]) -> list[int]:
    """Every block swap of a float array takes omatcopy; the list counts its calls."""
    monkeypatch.setattr(transpose_copy, "MIN_VALUES", 0)
    monkeypatch.setattr(transpose_copy, "MIN_COLUMNS", 0)
    return counted


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.float16, np.bool_])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_permutation_matches_numpys_copy(shape, dtype, every_size) -> None:
    rng = np.random.default_rng(len(shape))
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    for perm in itertools.permutations(range(len(shape))):
        v = x.transpose(perm)
        got = transpose_copy.contiguous(v)
        assert got.flags.c_contiguous and got.dtype == v.dtype and got.shape == v.shape
        np.testing.assert_array_equal(got, v)
        if v.flags.c_contiguous:
            assert got is v
    swaps = sum(transpose_copy._block_swap(x.transpose(p)) is not None
                for p in itertools.permutations(range(len(shape))))
    assert (len(every_size) > 0) == (swaps > 0 and np.dtype(dtype) in (np.float32, np.float64))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_special_values_keep_their_bits(dtype, every_size) -> None:
    finfo = np.finfo(dtype)
    special = np.array([np.nan, np.inf, -np.inf, -0.0, 0.0, finfo.tiny / 4, -finfo.tiny / 8, finfo.max,
                        -finfo.max, 1.0], dtype)
    x = np.resize(special, (6, 7, 11))
    got = transpose_copy.contiguous(x.transpose(0, 2, 1))
    assert every_size == [1] * 6
    want = np.ascontiguousarray(x.transpose(0, 2, 1))
    np.testing.assert_array_equal(got.view(f"u{got.itemsize}"), want.view(f"u{want.itemsize}"))


def test_block_swaps_found_and_other_views_left_to_numpy() -> None:
    x = np.zeros((4, 5, 6), np.float32)
    assert transpose_copy._block_swap(x.transpose(0, 2, 1)) == (4, 6, 5)
    assert transpose_copy._block_swap(x.transpose(2, 0, 1)) == (1, 6, 20)  # (5·6 … ) → the last axis first
    assert transpose_copy._block_swap(x.transpose(1, 2, 0)) == (1, 30, 4)
    assert transpose_copy._block_swap(x.transpose(1, 0, 2)) is None  # the last axis stays: numpy is fast
    assert transpose_copy._block_swap(x[:, ::2].transpose(0, 2, 1)) is None  # not dense
    assert transpose_copy._block_swap(x[::-1].transpose(0, 2, 1)) is None  # backwards
    assert transpose_copy._block_swap(x) is None


# each takes omatcopy at the default limits: 96 × 160, 3072 × 8 (rows a multiple of 256), 16 × 1920, 40 × 256
MODELS = [((4, 160, 96), [0, 2, 1], None), ((2, 8, 64, 48), [0, 2, 3, 1], None),
          ((2, 48, 40, 16), [0, 3, 1, 2], [2, -1]), ((3, 256, 40), [0, 2, 1], [3, 40, 16, 16])]


@pytest.mark.parametrize("xs,perm,target", MODELS)
def test_transpose_models_match_onnxruntime(xs, perm, target, counted) -> None:
    ort = pytest.importorskip("onnxruntime")
    import onnxtrain

    nodes = [helper.make_node("Transpose", ["x"], ["t" if target else "y"], perm=perm)]
    inits = []
    if target:
        nodes.append(helper.make_node("Reshape", ["t", "shape"], ["y"]))
        inits.append(helper.make_tensor("shape", 7, [len(target)], target))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, xs)],
                              [helper.make_tensor_value_info("y", 1, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    model = model.SerializeToString()
    x = np.random.default_rng(0).standard_normal(xs).astype(np.float32)
    got = onnxtrain.InferenceSession(model).run(None, {"x": x})[0]
    assert len(counted) == xs[0]  # one omatcopy per sample
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.flags.c_contiguous and got.flags.writeable and not np.shares_memory(got, x)
    np.testing.assert_array_equal(got, want)

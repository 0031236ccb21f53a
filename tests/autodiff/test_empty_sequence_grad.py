"""Gradients through empty sequences (an outside review of the control-flow rules): a SequenceMap over no
element summed its per-element gradients with a ConcatFromSequence of an empty sequence, and so did
SplitToSequence's gradient over an axis of length 0; the emitted graphs failed in onnxtrain's engine and in
onnxruntime. The oracle is float64 central differences; both engines run the emitted graph."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model
from tests.autodiff.grad_runs import gradients_by_both

ort = pytest.importorskip("onnxruntime")
N, D = helper.make_node, TensorProto.DOUBLE


def _vi(name: str, dims: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, D, dims)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto]) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, [_vi("loss", [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=8)


def _loss(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> float:
    return float(compile_model(model).run(dict(feeds))[0])


def _check(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str]) -> None:
    _, runs = gradients_by_both(model, feeds, wrt)
    for w in wrt:
        want = np.zeros_like(feeds[w])
        for idx in np.ndindex(want.shape):
            up, down = dict(feeds), dict(feeds)
            up[w], down[w] = feeds[w].copy(), feeds[w].copy()
            up[w][idx] += 1e-6
            down[w][idx] -= 1e-6
            want[idx] = (_loss(model, up) - _loss(model, down)) / 2e-6
        for got in runs:
            g = np.asarray(got[f"{w}_grad"])
            assert g.shape == want.shape
            np.testing.assert_allclose(g, want, rtol=1e-6, atol=1e-7, err_msg=w)


@pytest.mark.parametrize("n", [2, 0])
def test_sequence_map_over_no_element(n: int) -> None:
    """A tensor input and an outer value the body reads get zeros from an empty map (their direct parts
    only)."""
    body = helper.make_graph([N("Mul", ["a", "t"], ["r0"]), N("Mul", ["r0", "u"], ["r"])], "b",
                             [_vi("a", [3]), _vi("t", [3])], [_vi("r", [3])])
    nodes = [N("SplitToSequence", ["x"], ["s"], axis=0, keepdims=0),
             N("SequenceMap", ["s", "v"], ["o"], body=body),
             N("SequenceInsert", ["o", "v"], ["o2"]),
             N("ConcatFromSequence", ["o2"], ["c"], axis=0),
             N("Mul", ["c", "c"], ["q"]), N("ReduceSum", ["q"], ["loss"], keepdims=0)]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((n, 3)), "v": rng.standard_normal(3), "u": rng.standard_normal(3)}
    _check(_model(nodes, [_vi("x", ["N", 3]), _vi("v", [3]), _vi("u", [3])]), feeds, ["v", "u"])


@pytest.mark.parametrize("n", [2, 0])
@pytest.mark.parametrize("keepdims", [1, 0])
def test_split_to_sequence_of_an_empty_axis(n: int, keepdims: int) -> None:
    nodes = [N("SplitToSequence", ["x"], ["s"], axis=0, keepdims=keepdims),
             N("SequenceInsert", ["s", "v" if keepdims else "v1"], ["s2"]),
             N("ConcatFromSequence", ["s2"], ["c"], axis=0, new_axis=1 - keepdims),
             N("Mul", ["c", "c"], ["q"]), N("ReduceSum", ["q"], ["loss"], keepdims=0)]
    if not keepdims:
        nodes.insert(0, N("Squeeze", ["v", "zero"], ["v1"]))
        nodes.insert(0, N("Constant", [], ["zero"], value=onnx.numpy_helper.from_array(np.array([0]))))
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((n, 3)), "v": rng.standard_normal((1, 3))}
    _check(_model(nodes, [_vi("x", ["N", 3]), _vi("v", [1, 3])]), feeds, ["x", "v"])

"""Plan building and fusion must not trust what a model declares of its values (``value_info``, graph outputs)
over what its nodes compute: models in the wild carry stale or wrong declarations. Each model here carries a
wrong declaration that the engine cannot check against the values' sources; the results are compared with
onnxruntime's on the same model without that declaration."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.plan import Plan

_RNG = np.random.default_rng(0)
_N = 4096
# float16 terms whose float16 partial sums round differently from one float32 sum rounded once
_HALVES = {n: (_RNG.standard_normal(_N) * 100).astype(np.float16) for n in "abc"}


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _without_value_info(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.value_info[:]
    return out


def _sum_of_untyped_terms(source: str, stale: bool = True) -> onnx.ModelProto:
    """y = Sum(a', b', c') of float16 inputs, each term passed through ``source`` ("SequenceAt", "If"), whose
    output type the engine's checks do not derive; ``stale``: the Sum's value_info says float32."""
    nodes: list[onnx.NodeProto] = []
    for n in "abc":
        if source == "SequenceAt":
            nodes += [helper.make_node("SequenceConstruct", [n], [n + "_seq"]),
                      helper.make_node("SequenceAt", [n + "_seq", "zero"], [n + "_term"])]
        else:
            branch = helper.make_graph([helper.make_node("Identity", [n], [n + "_out"])], "branch", [],
                                       [helper.make_value_info(n + "_out", onnx.TypeProto())])
            nodes.append(helper.make_node("If", ["yes"], [n + "_term"], then_branch=branch,
                                          else_branch=branch))
    nodes += [helper.make_node("Sum", ["a_term", "b_term", "c_term"], ["s"]),
              helper.make_node("Identity", ["s"], ["y"])]
    declared = [helper.make_tensor_value_info("s", TensorProto.FLOAT, [_N])] if stale else []
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, [_N]) for n in "abc"],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [_N]) if not stale
         else helper.make_value_info("y", onnx.TypeProto())],  # (not float16 after a float32 declaration)
        [numpy_helper.from_array(np.array(0, np.int64), "zero"),
         numpy_helper.from_array(np.array(True), "yes")],
        value_info=declared)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("source", ["SequenceAt", "If"])
def test_a_float16_sum_declared_float32_sums_as_float16(source) -> None:
    """A float16 Sum whose value_info says float32 was expanded into float16 Adds (rounded after each term):
    904 of 4,096 values differed from onnxruntime's sum (float32, rounded once) by up to 0.25."""
    model = _sum_of_untyped_terms(source)
    want = _ort(_sum_of_untyped_terms(source, stale=False), _HALVES)[0]
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, _HALVES)[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)


def test_a_sum_of_untyped_graph_inputs_declared_float32() -> None:
    """Graph inputs of no declared type (which onnxruntime refuses, the Plan runs them) fed float16, the Sum's
    value_info float32: summed as onnxruntime sums the same model with typed inputs."""
    g = helper.make_graph(
        [helper.make_node("Sum", ["a", "b", "c"], ["s"]), helper.make_node("Identity", ["s"], ["y"])], "g",
        [helper.make_value_info(n, onnx.TypeProto()) for n in "abc"],
        [helper.make_value_info("y", onnx.TypeProto())],
        value_info=[helper.make_tensor_value_info("s", TensorProto.FLOAT, [_N])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    typed = _without_value_info(model)
    for v in typed.graph.input:
        v.CopyFrom(helper.make_tensor_value_info(v.name, TensorProto.FLOAT16, [_N]))
    typed.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT16, [_N]))
    want = _ort(typed, _HALVES)[0]
    got = Plan(model).run(_HALVES)[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, want)

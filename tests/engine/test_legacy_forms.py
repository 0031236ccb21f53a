"""Old operator forms no kernel runs are refused by name with the way to convert the model; they gave wrong
values (Sub-6 with broadcast=1, axis=0) or numpy errors. The converted model runs to the values the old
form defines (numpy the oracle), and old forms the kernels do follow still run."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, version_converter

from onnxtrain.engine import compile_model
from onnxtrain.engine.interface import UnsupportedOpError

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)
A, B4 = RNG.standard_normal((4, 4)).astype(np.float32), RNG.standard_normal(4).astype(np.float32)
X3 = RNG.standard_normal((2, 3, 4)).astype(np.float32)
STATS = {n: np.ones(4, np.float32) for n in ("s", "b", "m", "v")}


def _model(op: str, attrs: dict, inputs: dict[str, np.ndarray], opset: int, shape: list[int],
           out: int = F) -> onnx.ModelProto:
    node = helper.make_node(op, list(inputs), ["y"], name="old", **attrs)
    declared = [helper.make_tensor_value_info(n, F, a.shape) for n, a in inputs.items()]
    g = helper.make_graph([node], "g", declared, [helper.make_tensor_value_info("y", out, shape)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


x34 = RNG.standard_normal((3, 4)).astype(np.float32)
CASES = {
    "sub6_axis_broadcast": (_model("Sub", {"broadcast": 1, "axis": 0}, {"a": A, "b": B4}, 6, [4, 4]),
                            "broadcast=1 with axis=0"),
    "add6_axis_broadcast": (_model("Add", {"broadcast": 1, "axis": 1}, {"a": X3, "b": B4[:3]}, 6,
                                   [2, 3, 4]), "broadcast=1 with axis=1"),
    "pad1_paddings": (_model("Pad", {"paddings": [1, 0, 0, 2]}, {"x": x34}, 1, [4, 6]),
                      "attribute 'paddings'"),
    "reshape1_shape": (_model("Reshape", {"shape": [4, 3]}, {"x": x34}, 1, [4, 3]), "attribute 'shape'"),
    "cast1_string_to": (_model("Cast", {"to": "DOUBLE"}, {"x": x34}, 1, [3, 4], TensorProto.DOUBLE),
                        "a string 'to'"),
    "concat1_no_axis": (_model("Concat", {}, {"p": x34, "q": x34}, 1, [3, 8]), "no 'axis'"),
    "batchnorm7_spatial0": (_model("BatchNormalization", {"spatial": 0},
                                   {"x": X3, **{n: np.ones((3, 4), np.float32) for n in STATS}}, 7,
                                   [2, 3, 4]), "spatial=0"),
    # a [C] slope was per channel before PRelu-7 (ONNX's pytorch-converted PReLU_*_multiparam cases): numpy's
    # broadcasting error before; onnx's converter keeps the slope [C], so the advice is to reshape it
    "prelu6_channel_slope": (_model("PRelu", {}, {"x": X3, "s": np.array([0.1, 0.2, 0.3], np.float32)}, 6,
                                    [2, 3, 4]), "a 1-D slope, applied per channel"),
    # Tile before opset 6 repeats along one axis given as an input (no converter adapter, no onnxruntime or
    # onnx.reference kernel): the engine read 'tiles' as Tile-6's repeats, "one per input dimension"
    "tile1_tiles_axis": (_model("Tile", {}, {"x": x34, "t": np.array(2, np.float32),
                                             "ax": np.array(1, np.float32)}, 1, [3, 8]),
                         "inputs 'tiles' and 'axis'"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_old_forms_no_kernel_runs_are_refused_by_name(case: str) -> None:
    model, piece = CASES[case]
    opset = model.opset_import[0].version
    with pytest.raises(UnsupportedOpError) as e:
        compile_model(model)
    assert f"node 'old' ({model.graph.node[0].op_type}, opset {opset})" in str(e.value)
    way_out = "onnx.version_converter.convert_version"
    if case.startswith("prelu"):
        way_out = "the shape [C, 1, ..., 1]"
    elif case.startswith("tile"):
        way_out = "a 'repeats' input"
    assert piece in str(e.value) and way_out in str(e.value)


def test_the_converted_model_runs_the_old_forms_values() -> None:
    """Sub-6 with broadcast=1, axis=0 subtracts b from each row's values along axis 0 (b aligned at axis 0):
    a − b[:, None]; converted to opset 9 it runs so (it ran as a − b[None, :] before)."""
    model = version_converter.convert_version(CASES["sub6_axis_broadcast"][0], 9)
    got = compile_model(model).run({"a": A, "b": B4})[0]
    np.testing.assert_allclose(got, A - B4[:, None], rtol=1e-6)


def test_old_forms_the_kernels_follow_still_run() -> None:
    """broadcast=1 without an axis or with the axis that aligns the last axes (as NumPy's), spatial=0 on an
    (N, C) input (per value is per channel) and Concat-1 with its axis run as before."""
    y4 = RNG.standard_normal((2, 3, 4, 5)).astype(np.float32)
    w45 = RNG.standard_normal((4, 5)).astype(np.float32)
    stats = {"s": np.full(4, 2, np.float32), "b": np.ones(4, np.float32), "m": np.zeros(4, np.float32),
             "v": np.ones(4, np.float32)}
    cases = [
        (_model("Add", {"broadcast": 1}, {"a": A, "b": B4}, 6, [4, 4]), {"a": A, "b": B4}, A + B4),
        (_model("Mul", {"broadcast": 1, "axis": 2}, {"a": y4, "b": w45}, 6, [2, 3, 4, 5]),
         {"a": y4, "b": w45}, y4 * w45),
        (_model("BatchNormalization", {"spatial": 0}, {"x": x34, **stats}, 7, [3, 4]), {"x": x34, **stats},
         x34 * 2 / np.sqrt(1 + 1e-5) + 1),
        (_model("Concat", {"axis": 0}, {"p": x34, "q": x34}, 1, [6, 4]), {"p": x34, "q": x34},
         np.vstack([x34, x34])),
    ]
    for model, feeds, want in cases:
        np.testing.assert_allclose(compile_model(model).run(feeds)[0], want, rtol=1e-6)

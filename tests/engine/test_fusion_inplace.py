"""Activations written over a product nothing else reads (onnxtrain/engine/fusion/inplace.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def relu_layer_and_grad(fill: float = 0.0, extra_reader: bool = False) -> onnx.ModelProto:
    """h = Relu(Gemm(x, w, b)); dx = Where(h > 0, dy @ v, fill): a layer and the form of its ReLU gradient."""
    zero = numpy_helper.from_array(np.float32(0), "zero")
    nodes = [
        helper.make_node("Constant", [], ["fill"], value=numpy_helper.from_array(np.float32(fill), "fill")),
        helper.make_node("Gemm", ["x", "w", "b"], ["z"], transB=1),
        helper.make_node("Relu", ["z"], ["h"]),
        helper.make_node("Greater", ["h", "zero"], ["mask"]),
        helper.make_node("MatMul", ["dy", "v"], ["d"]),
        helper.make_node("Where", ["mask", "d", "fill"], ["dx"]),
    ]
    outputs = ["h", "dx"]
    if extra_reader:  # the products are read a second time: neither may be overwritten
        nodes += [helper.make_node("Neg", ["z"], ["nz"]), helper.make_node("Neg", ["d"], ["nd"])]
        outputs += ["nz", "nd"]
    return model(nodes, ["x", "w", "b", "dy", "v"], outputs, [zero])


def feeds(rng: np.random.Generator) -> dict[str, np.ndarray]:
    f = {
        "x": rng.standard_normal((32, 24)).astype(np.float32),
        "w": rng.standard_normal((40, 24)).astype(np.float32),
        "b": rng.standard_normal(40).astype(np.float32),
        "dy": rng.standard_normal((32, 16)).astype(np.float32),
        "v": rng.standard_normal((16, 40)).astype(np.float32),
    }
    f["x"][0, :] = np.nan  # a NaN row: Relu keeps NaN, and NaN > 0 is false so its gradient is +0.0
    f["dy"][1, :] = -0.0
    return f


def test_relu_and_relu_gradient_write_into_their_products_bit_identically() -> None:
    m = relu_layer_and_grad()
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "InplaceRelu" in ops(fused) and "InplaceReluGrad" in ops(fused)
    assert "Relu" not in ops(fused) and "Where" not in ops(fused) and "Greater" not in ops(fused)
    rng = np.random.default_rng(0)
    f = feeds(rng)
    first = fused.run(f)
    second = fused.run(f)
    want = plain.run(f)
    for a, b, w in zip(first, second, want):
        assert a.dtype == w.dtype and a.shape == w.shape
        assert a.tobytes() == w.tobytes() and b.tobytes() == w.tobytes()
        assert not np.shares_memory(a, b)  # each run writes into that run's fresh product
    assert np.isnan(first[0][0]).all()
    assert (first[1] == 0).sum() > 0 and not np.signbit(first[1][first[1] == 0]).any()


@pytest.mark.parametrize("fill", [-0.0, 1.0])
def test_where_with_another_fill_is_left_alone(fill: float) -> None:
    plan = Plan(relu_layer_and_grad(fill=fill))
    assert "Where" in ops(plan) and "InplaceWhere" not in ops(plan)
    f = feeds(np.random.default_rng(1))
    np.testing.assert_array_equal(plan.run(f)[1], Plan(relu_layer_and_grad(fill=fill), fuse=False).run(f)[1])


def test_products_read_elsewhere_are_not_overwritten() -> None:
    m = relu_layer_and_grad(extra_reader=True)
    plan = Plan(m)
    assert "Relu" in ops(plan) and "Where" in ops(plan)
    f = feeds(np.random.default_rng(2))
    h, dx, nz, nd = plan.run(f)
    want = Plan(m, fuse=False).run(f)
    for a, w in zip((h, dx, nz, nd), want):
        np.testing.assert_array_equal(a, w)


def test_where_whose_fill_is_an_initializer_is_left_alone() -> None:
    """An initializer may be fed another value at run time: only a folded constant zero qualifies."""
    m = relu_layer_and_grad()
    del m.graph.node[0]
    m.graph.initializer.append(numpy_helper.from_array(np.float32(0), "fill"))
    assert "InplaceWhere" not in ops(Plan(m))


def test_relu_of_a_graph_input_leaves_the_input_alone() -> None:
    plan = Plan(model([helper.make_node("Relu", ["x"], ["y"])], ["x"], ["y"]))
    assert ops(plan) == ["Relu"]
    x = np.array([-1.0, 2.0], np.float32)
    assert plan.run({"x": x})[0].tolist() == [0.0, 2.0] and x.tolist() == [-1.0, 2.0]


def cross_entropy_grad(extra_reader: bool = False, axis: int = 1) -> onnx.ModelProto:
    """dz = (ScatterElements(Exp(logp), labels, −1) · scale): the form of a cross-entropy gradient."""
    f, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes = [
        helper.make_node("Exp", ["logp"], ["p"]),
        helper.make_node("ScatterElements", ["p", "labels", "minus"], ["d"], axis=axis),
        helper.make_node("Mul", ["d", "scale"], ["dz"]),
    ]
    outputs = [helper.make_tensor_value_info("dz", f, [16, 30])]
    if extra_reader:  # the probabilities are read again: the scatter must not overwrite them
        nodes.append(helper.make_node("Neg", ["p"], ["np"]))
        outputs.append(helper.make_tensor_value_info("np", f, [16, 30]))
    idx_shape = [16, 1] if axis == 1 else [1, 30]
    graph = helper.make_graph(
        nodes, "ce_grad",
        [helper.make_tensor_value_info("logp", f, [16, 30]),
         helper.make_tensor_value_info("labels", i64, idx_shape),
         helper.make_tensor_value_info("minus", f, idx_shape),
         helper.make_tensor_value_info("scale", f, [])],
        outputs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


def _runs_in_place_like_plain(m: onnx.ModelProto, f: dict[str, np.ndarray], op: str) -> np.ndarray:
    """The fused plan runs ``op`` in place (twice: the unfused plan's bits, close to onnx.reference); returns
    the unfused plan's first output."""
    from onnx.reference import ReferenceEvaluator

    fused, plain = Plan(m), Plan(m, fuse=False)
    # (an Exp → ScatterElements → Mul chain is one InplaceCrossEntropyGrad step)
    assert op not in ops(fused) and (f"Inplace{op}" in ops(fused) or "InplaceCrossEntropyGrad" in ops(fused))
    want = plain.run(f)[0]
    for _ in range(2):
        got = fused.run(f)[0]
        assert got.tobytes() == want.tobytes()
    np.testing.assert_allclose(want, ReferenceEvaluator(m).run(None, f)[0], rtol=1e-6, atol=1e-7)
    return want


@pytest.mark.parametrize("axis", [1, 0])
def test_cross_entropy_gradient_scatters_into_the_exp_bit_identically(axis: int) -> None:

    rng = np.random.default_rng(4)
    n = 16 if axis == 1 else 30
    idx_shape = (16, 1) if axis == 1 else (1, 30)
    f = {"logp": rng.standard_normal((16, 30)).astype(np.float32) - 3,
         "labels": rng.integers(0, 30 if axis == 1 else 16, n).reshape(idx_shape).astype(np.int64),
         "minus": np.full(idx_shape, -1.0, np.float32), "scale": np.float32(1 / 16)}
    want = _runs_in_place_like_plain(cross_entropy_grad(axis=axis), f, "ScatterElements")
    # read again after the scatter: the Exp's array stays as it was
    m2 = cross_entropy_grad(extra_reader=True, axis=axis)
    fused2 = Plan(m2)
    assert "ScatterElements" in ops(fused2) and "InplaceScatterElements" not in ops(fused2)
    got, neg_p = fused2.run(f)
    assert got.tobytes() == want.tobytes()
    np.testing.assert_array_equal(neg_p, -np.exp(f["logp"]))


def scaled_cross_entropy_grad(rows: int, cols: int, scale_first: bool, extra_reader: bool) -> onnx.ModelProto:
    """dz = ScatterElements(Exp(logp), labels, −1) · scale[rows, 1]: the per-row factor of a loss gradient."""
    f, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    mul_ins = ["scale", "d"] if scale_first else ["d", "scale"]
    nodes = [
        helper.make_node("Exp", ["logp"], ["p"]),
        helper.make_node("ScatterElements", ["p", "labels", "minus"], ["d"], axis=1),
        helper.make_node("Mul", mul_ins, ["dz"]),
    ]
    outputs = [helper.make_tensor_value_info("dz", f, [rows, cols])]
    if extra_reader:  # the scattered array is read again: the scaling must not overwrite it
        nodes.append(helper.make_node("Neg", ["d"], ["nd"]))
        outputs.append(helper.make_tensor_value_info("nd", f, [rows, cols]))
    graph = helper.make_graph(
        nodes, "scaled_ce_grad",
        [helper.make_tensor_value_info("logp", f, [rows, cols]),
         helper.make_tensor_value_info("labels", i64, [rows, 1]),
         helper.make_tensor_value_info("minus", f, [rows, 1]),
         helper.make_tensor_value_info("scale", f, [rows, 1])],
        outputs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("scale_first", [False, True])
@pytest.mark.parametrize("column", ["uniform", "varied", "signed_zeros", "nan"])
def test_cross_entropy_gradient_scales_into_the_scatter_bit_identically(scale_first: bool,
                                                                         column: str) -> None:
    from onnxtrain.engine.fusion.inplace import UNIFORM_MIN

    rows, cols = 256, 200
    assert rows * cols >= UNIFORM_MIN  # the uniform-column test runs
    rng = np.random.default_rng(7)
    scale = {
        "uniform": np.full((rows, 1), 1 / 3, np.float32),
        "varied": rng.standard_normal((rows, 1)).astype(np.float32),
        # +0.0 and −0.0 compare equal but give products of different signs: not one scalar
        "signed_zeros": np.where(np.arange(rows)[:, None] % 2 == 0, np.float32(0.0), np.float32(-0.0)),
        "nan": np.full((rows, 1), np.nan, np.float32),
    }[column]
    f = {"logp": rng.standard_normal((rows, cols)).astype(np.float32) - 5,
         "labels": rng.integers(0, cols, (rows, 1)).astype(np.int64),
         "minus": np.full((rows, 1), -1.0, np.float32), "scale": scale}
    m = scaled_cross_entropy_grad(rows, cols, scale_first, extra_reader=False)
    want = _runs_in_place_like_plain(m, f, "Mul")
    if column == "signed_zeros":  # (one scalar for the column would give every row the same signs)
        assert np.signbit(want[0]).sum() == 1 and np.signbit(want[1]).sum() == cols - 1


def test_scaling_leaves_a_scatter_read_elsewhere_alone() -> None:
    rows, cols = 256, 200
    rng = np.random.default_rng(8)
    f = {"logp": rng.standard_normal((rows, cols)).astype(np.float32),
         "labels": rng.integers(0, cols, (rows, 1)).astype(np.int64),
         "minus": np.full((rows, 1), -1.0, np.float32), "scale": np.full((rows, 1), 0.5, np.float32)}
    m = scaled_cross_entropy_grad(rows, cols, False, extra_reader=True)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "Mul" in ops(fused) and "InplaceMul" not in ops(fused)
    for got, want in zip(fused.run(f), plain.run(f)):
        assert got.tobytes() == want.tobytes()


def test_uniform_column_is_tested_by_its_bits() -> None:
    from onnxtrain.engine.fusion.inplace import uniform

    c = np.full((5, 1), 0.25, np.float32)
    assert uniform(c).shape == () and uniform(c) == np.float32(0.25)
    mixed = np.array([[0.0], [-0.0]], np.float32)
    assert uniform(mixed) is mixed
    nan = np.full((3, 1), np.nan, np.float32)  # one NaN pattern repeated: the same bits, one scalar
    assert uniform(nan).shape == ()
    one = np.ones((1, 1), np.float32)
    assert uniform(one) is one


def _nan(bits: int) -> np.float32:
    return np.array(bits, np.uint32).view(np.float32).reshape(())[()]


def test_an_in_place_product_keeps_the_muls_operand_order_for_nans() -> None:
    # Mul(c, ScatterElements(...)) written into the scatter: where both factors are NaN the product is the
    # first operand's NaN (sign and payload, on x86), so the order must stay c·s
    nodes = [helper.make_node("ScatterElements", ["data", "idx", "upd"], ["s"], axis=1),
             helper.make_node("Mul", ["c", "s"], ["y"])]
    m = model(nodes, ["data", "idx", "upd", "c"], ["y"])
    m.graph.input[1].type.tensor_type.elem_type = onnx.TensorProto.INT64
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "InplaceMul" in ops(fused)
    f = {"data": np.full((2, 3), _nan(0x7FC00001), np.float32), "idx": np.array([[0], [1]], np.int64),
         "upd": np.array([[1], [2]], np.float32), "c": np.full((2, 3), _nan(0xFFC00002), np.float32)}
    got, want = fused.run(f)[0], plain.run({k: v.copy() for k, v in f.items()})[0]
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert (got.view(np.uint32) == 0xFFC00002).all()


@pytest.mark.parametrize("bias_first", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_bias_added_into_a_product_keeps_the_adds_operand_order_for_nans(bias_first: bool, dtype) -> None:
    et = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("MatMul", ["a", "b"], ["p"]),
             helper.make_node("Add", ["bias", "p"] if bias_first else ["p", "bias"], ["y"])]
    ins = [helper.make_tensor_value_info(n, et, None) for n in ("a", "b", "bias")]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", et, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["FusedMatMulAdd"]
    f = {"a": np.full((2, 3), np.nan, dtype), "b": np.ones((3, 4), dtype), "bias": -np.full(4, np.nan, dtype)}
    f["a"][1] = 1  # a row of finite products too
    got, want = fused.run(f)[0], plain.run(f)[0]
    it = np.uint32 if dtype == np.float32 else np.uint16
    np.testing.assert_array_equal(got.view(it), want.view(it))


def relu_grad_of(r_shape: tuple[int, ...], mask_output: bool = False, c: float = 0.0) -> onnx.ModelProto:
    """dx = Where(r > c, dy @ v, +0.0): a ReLU gradient of an activation ``r`` fed as it is."""
    fill = helper.make_node("Constant", [], ["fill"], value=numpy_helper.from_array(np.float32(0), "fill"))
    cst = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(np.float32(c), "c"))
    nodes = [fill, cst, helper.make_node("Greater", ["r", "c"], ["mask"]),
             helper.make_node("MatMul", ["dy", "v"], ["d"]),
             helper.make_node("Where", ["mask", "d", "fill"], ["dx"])]
    outputs = ["dx", "mask"] if mask_output else ["dx"]
    return model(nodes, ["r", "dy", "v"], outputs, output_types={"mask": onnx.TensorProto.BOOL})


def relu_grad_feeds(rng: np.random.Generator, r_shape: tuple[int, ...],
                    dtype=np.float32) -> dict[str, np.ndarray]:
    r = rng.standard_normal(r_shape).astype(dtype)
    r.reshape(-1)[:6] = [np.nan, -0.0, 0.0, np.inf, -np.inf, 1e-45]
    dy = rng.standard_normal((r_shape[-2] if len(r_shape) > 1 else 8, 5)).astype(dtype)
    dy[0, :3] = [np.nan, -0.0, np.inf]
    return {"r": r, "dy": dy, "v": rng.standard_normal((5, r_shape[-1])).astype(dtype)}


@pytest.mark.parametrize("c", [0.0, -0.0, 0.5])
def test_relu_gradient_computes_its_mask_in_the_fused_step_bit_identically(c: float) -> None:
    """Where(Greater(r, c), dX, +0.0) with the mask read by the Where alone: one step, no Greater; the unfused
    plan's bits (NaN, ±0, ±inf in r and dX), and float64's values."""
    m = relu_grad_of((12, 7), c=c)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["MatMul", "InplaceReluGrad"]
    f = relu_grad_feeds(np.random.default_rng(3), (12, 7))
    want = plain.run(f)[0]
    for _ in range(2):
        got = fused.run(f)[0]
        assert got.dtype == want.dtype and got.shape == want.shape and got.tobytes() == want.tobytes()
    d64 = f["dy"].astype(np.float64) @ f["v"].astype(np.float64)
    ref = np.where(f["r"] > np.float32(c), d64, 0.0)
    close = np.isfinite(ref)
    np.testing.assert_allclose(want[close], ref[close], rtol=1e-5, atol=1e-5)
    assert not np.signbit(want[~(f["r"] > np.float32(c))]).any()  # +0.0 where masked, NaN rows included


def test_relu_gradient_whose_mask_is_read_elsewhere_keeps_its_greater() -> None:
    m = relu_grad_of((12, 7), mask_output=True)
    fused = Plan(m)
    assert "Greater" in ops(fused) and "InplaceWhere" in ops(fused) and "InplaceReluGrad" not in ops(fused)
    f = relu_grad_feeds(np.random.default_rng(4), (12, 7))
    for a, w in zip(fused.run(f), Plan(m, fuse=False).run(f)):
        assert a.tobytes() == w.tobytes()


def test_relu_gradient_of_a_broadcast_activation_runs_the_original_steps() -> None:
    """r of shape (1, 7) against dX of (12, 7): the mask broadcasts; the fused step runs Greater and Where."""
    m = relu_grad_of((1, 7))
    fused = Plan(m)
    assert "InplaceReluGrad" in ops(fused)
    f = relu_grad_feeds(np.random.default_rng(5), (1, 7))
    f["dy"] = np.random.default_rng(6).standard_normal((12, 5)).astype(np.float32)
    got, want = fused.run(f)[0], Plan(m, fuse=False).run(f)[0]
    assert got.shape == want.shape == (12, 7) and got.tobytes() == want.tobytes()


def mean_cross_entropy_grad(rows: int, cols: int, dtype, scale_first: bool = False, reduction: str = "add",
                            labels=np.int64, per_row: bool = False) -> onnx.ModelProto:
    """dz = ScatterElements(Exp(logp), Unsqueeze(labels), −1) · (1 / rows): the gradient of a mean
    SoftmaxCrossEntropyLoss as the training graph writes it (a one-value scale; ``per_row``: a weight per
    row, as the legacy graph's with an ignored class)."""
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    i64 = helper.np_dtype_to_tensor_dtype(np.dtype(labels))
    nodes = [
        helper.make_node("Exp", ["logp"], ["p"]),
        helper.make_node("Unsqueeze", ["labels", "one"], ["idx"]),
        helper.make_node("ScatterElements", ["p", "idx", "minus"], ["d"], axis=-1, reduction=reduction),
        helper.make_node("Mul", ["scale", "d"] if scale_first else ["d", "scale"], ["dz"]),
    ]
    graph = helper.make_graph(
        nodes, "mean_ce_grad",
        [helper.make_tensor_value_info("logp", et, [rows, cols]),
         helper.make_tensor_value_info("labels", i64, [rows]),
         helper.make_tensor_value_info("minus", et, [rows, 1]),
         helper.make_tensor_value_info("scale", et, [rows, 1] if per_row else [])],
        [helper.make_tensor_value_info("dz", et, [rows, cols])],
        [numpy_helper.from_array(np.array([1], np.int64), "one")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("scale_first", [False, True])
@pytest.mark.parametrize("reduction", ["add", "none"])
@pytest.mark.parametrize("shape", [(2, 4), (64, 10), (300, 7)])
@pytest.mark.parametrize("index", [np.int64, np.int32])
@pytest.mark.parametrize("per_row", [False, True])
def test_cross_entropy_gradient_is_one_step_bit_identically(dtype, scale_first: bool, reduction: str,
                                                            shape: tuple[int, int], index,
                                                            per_row: bool) -> None:
    """Exp, the scatter and the scaling by 1/N as one step: the unfused plan's bits (NaN, ±inf and -0.0 among
    the log-probabilities, a NaN scale) and float64's values."""
    from onnx.reference import ReferenceEvaluator

    rows, cols = shape
    m = mean_cross_entropy_grad(rows, cols, dtype, scale_first, reduction, index, per_row)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "InplaceCrossEntropyGrad" in ops(fused)
    assert not {"Exp", "ScatterElements", "Mul", "InplaceScatterElements", "InplaceMul"} & set(ops(fused))
    rng = np.random.default_rng(rows)
    logp = (rng.standard_normal(shape) - 3).astype(dtype)
    logp.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    f = {"logp": logp, "labels": rng.integers(0, cols, rows).astype(index),
         "minus": np.full((rows, 1), -1.0, dtype), "scale": np.array(1 / rows, dtype)}
    weights = rng.uniform(0, 2, (rows, 1)).astype(dtype)  # a weight per row (the legacy graph's: 0 or 1/N)
    weights[0] = -0.0
    for scale in (f["scale"], np.array(np.nan, dtype)):
        f["scale"] = weights * scale if per_row else scale
        want = plain.run(f)[0]
        for _ in range(2):
            got = fused.run(f)[0]
            assert got.dtype == want.dtype == dtype and got.tobytes() == want.tobytes()
    f["scale"] = weights / dtype(rows) if per_row else np.array(1 / rows, dtype)
    want = plain.run(f)[0]
    with np.errstate(invalid="ignore"):  # (∞ · -0.0 in row 0)
        ref = ReferenceEvaluator(m).run(None, f)[0]
    np.testing.assert_allclose(want, ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("labels", [[-1, 2], [0, 4]])
@pytest.mark.parametrize("index", [np.int64, np.int32])
def test_cross_entropy_gradient_with_labels_out_of_range_runs_the_scatter_steps(labels: list[int],
                                                                                index) -> None:
    """A negative index (wrapped by the scatter) or one past the row: the fused step's scatter and Mul steps,
    with their results (or their error); int32 and int64 indices."""
    m = mean_cross_entropy_grad(2, 4, np.float32, labels=index)
    fused, plain = Plan(m), Plan(m, fuse=False)
    f = {"logp": np.zeros((2, 4), np.float32), "labels": np.array(labels, index),
         "minus": np.full((2, 1), -1.0, np.float32), "scale": np.float32(0.5)}
    if labels[1] == 4:
        with pytest.raises(Exception, match="out of"):
            fused.run(f)
        return
    got, want = fused.run(f)[0], plain.run(f)[0]
    assert got.tobytes() == want.tobytes() and got[0, 3] == 0.0  # (exp(0) − 1) · 0.5 at the wrapped index


def training_cross_entropy_grad(shape_output: bool = False, axes_constant: bool = True) -> onnx.ModelProto:
    """SoftmaxCrossEntropyLoss (mean) and its gradient with the shape steps the gradient builder writes: the
    seed ConstantOfShape(Shape(loss)) over Cast(Size(labels)), and −1 expanded to Shape(Unsqueeze(labels))."""
    f, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    nodes = [
        helper.make_node("Constant", [], ["minus"],
                         value=numpy_helper.from_array(np.array(-1.0, np.float32))),
        *([helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], np.int64)))]
          if axes_constant else []),
        helper.make_node("SoftmaxCrossEntropyLoss", ["x", "labels"], ["loss", "logp"], reduction="mean"),
        helper.make_node("Shape", ["loss"], ["loss_shape"]),
        helper.make_node("ConstantOfShape", ["loss_shape"], ["seed"],
                         value=numpy_helper.from_array(np.ones(1, np.float32))),
        helper.make_node("Exp", ["logp"], ["p"]),
        helper.make_node("Size", ["labels"], ["n"]),
        helper.make_node("Cast", ["n"], ["nf"], to=f),
        helper.make_node("Div", ["seed", "nf"], ["scale"]),
        helper.make_node("Unsqueeze", ["labels", "one"], ["idx"]),
        helper.make_node("Shape", ["idx"], ["idx_shape"]),
        helper.make_node("Expand", ["minus", "idx_shape"], ["upd"]),
        helper.make_node("ScatterElements", ["p", "idx", "upd"], ["d"], axis=1, reduction="add"),
        helper.make_node("Mul", ["d", "scale"], ["dx"]),
    ]
    outputs = [helper.make_tensor_value_info("loss", f, []),
               helper.make_tensor_value_info("dx", f, ["n", 10])]
    if shape_output:  # a shape step's result is read outside the gradient too: the shape steps stay
        outputs.append(helper.make_tensor_value_info("idx_shape", i64, [2]))
    graph = helper.make_graph(
        nodes, "sce_grad",
        [helper.make_tensor_value_info("x", f, ["n", 10]),
         helper.make_tensor_value_info("labels", i64, ["n"])],
        outputs,
        [] if axes_constant else [numpy_helper.from_array(np.array([1], np.int64), "one")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    return m


@pytest.mark.parametrize("shape_output", [False, True])
@pytest.mark.parametrize("axes_constant", [True, False])
def test_cross_entropy_gradient_takes_in_its_shape_steps(shape_output: bool, axes_constant: bool) -> None:
    """The fused gradient computes the scale and the updates from its shape steps itself, kept per batch
    size: the unfused plan's bits over batches of different sizes, in any order; where the updates' shape is
    also a graph output, the steps that make the updates stay (the scale's go). The Unsqueeze of the labels
    goes in too when its axes are a constant (an initializer may be fed)."""
    m = training_cross_entropy_grad(shape_output, axes_constant)
    fused, plain = Plan(m), Plan(m, fuse=False)
    left = ops(fused)
    assert "InplaceCrossEntropyGrad" in left
    assert ("Unsqueeze" in left) == (shape_output or not axes_constant)
    shape_ops = {"Shape", "ConstantOfShape", "Size", "Cast", "Div", "Expand"}
    assert (shape_ops & set(left)) == ({"Shape", "Expand"} if shape_output else set())
    assert left.count("Shape") == shape_output
    rng = np.random.default_rng(11)
    for n in (3, 64, 3, 1, 64, 7, 3):
        f = {"x": rng.normal(0, 3, (n, 10)).astype(np.float32), "labels": rng.integers(0, 10, n)}
        got, want = fused.run(f), plain.run(f)
        for a, b in zip(got, want):
            assert a.shape == b.shape and a.tobytes() == b.tobytes()
        # float64: (softmax − one-hot) / n
        x64 = f["x"].astype(np.float64)
        sm = np.exp(x64 - x64.max(1, keepdims=True))
        sm /= sm.sum(1, keepdims=True)
        sm[np.arange(n), f["labels"]] -= 1
        np.testing.assert_allclose(got[1], sm / n, rtol=1e-5, atol=1e-6)


def test_cross_entropy_gradient_of_labels_of_another_rank_fails_as_the_unfused_plan() -> None:
    """Labels of shape (N, 1) make indices of rank 3: the taken-in Unsqueeze runs, and the scatter fails as
    it does unfused."""
    f32, i64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64
    const = helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1], np.int64)))
    minus = helper.make_node("Constant", [], ["minus"], value=numpy_helper.from_array(np.float32(-1)))
    nodes = [const, minus, helper.make_node("Exp", ["logp"], ["p"]),
             helper.make_node("Unsqueeze", ["labels", "one"], ["idx"]),
             helper.make_node("Shape", ["idx"], ["idx_shape"]),
             helper.make_node("Expand", ["minus", "idx_shape"], ["upd"]),
             helper.make_node("ScatterElements", ["p", "idx", "upd"], ["d"], axis=1, reduction="add"),
             helper.make_node("Mul", ["d", "scale"], ["dx"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("logp", f32, None),
                                           helper.make_tensor_value_info("labels", i64, None),
                                           helper.make_tensor_value_info("scale", f32, None)],
                              [helper.make_tensor_value_info("dx", f32, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    fused = Plan(m)
    assert ops(fused) == ["InplaceCrossEntropyGrad"]
    f = {"logp": np.zeros((3, 10), np.float32), "scale": np.float32(0.5)}
    ok = {**f, "labels": np.array([1, 0, 9], np.int64)}
    assert fused.run(ok)[0].tobytes() == Plan(m, fuse=False).run(ok)[0].tobytes()
    f["labels"] = np.zeros((3, 1), np.int64)
    with pytest.raises(Exception) as got:
        fused.run(f)
    with pytest.raises(Exception) as want:
        Plan(m, fuse=False).run(f)
    assert type(got.value) is type(want.value) and "ScatterElements" in str(got.value)


def test_cross_entropy_gradient_keeps_no_batch_alive() -> None:
    """The shape steps' results are kept per leaf shape: the labels and the loss whose shapes they read are
    not held after the run."""
    import gc
    import weakref

    m = training_cross_entropy_grad()
    fused = Plan(m)
    rng = np.random.default_rng(12)
    x = rng.normal(0, 1, (5, 10)).astype(np.float32)
    labels = rng.integers(0, 10, 5)
    alive = weakref.ref(labels)
    loss, _ = fused.run({"x": x, "labels": labels})
    held = weakref.ref(loss)
    del labels, loss
    gc.collect()
    assert alive() is None and held() is None


def test_cross_entropy_gradient_step_is_named_after_its_mul() -> None:
    """The fused gradient makes the Mul's output: it carries the Mul's name (in its errors and the plan's
    profile), not that of a shape step or the Unsqueeze it took in."""
    m = training_cross_entropy_grad()
    for i, node in enumerate(m.graph.node):
        node.name = f"{node.op_type}_{i}"
    (step,) = [st for st in Plan(m).steps if st.node.op_type == "InplaceCrossEntropyGrad"]
    assert step.node.name == f"InplaceCrossEntropyGrad(Mul_{len(m.graph.node) - 1})"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["add", "none"])
@pytest.mark.parametrize("through_kernel", [False, True])
def test_cross_entropy_gradient_of_strided_or_large_log_probabilities(dtype, reduction: str,
                                                                      through_kernel: bool,
                                                                      monkeypatch) -> None:
    """The fused step calls np.exp itself below the Exp kernel's split size: log-probabilities laid out in
    Fortran order (an exp that is no C-contiguous array: the scatter and Mul steps) and, with that size
    lowered to nothing, the Exp kernel's result (checked for shared memory) give the unfused plan's bits."""
    from onnxtrain.engine.fusion import inplace

    if through_kernel:
        monkeypatch.setattr(inplace, "SPLIT_MIN", 0)
    rows, cols = 64, 10
    m = mean_cross_entropy_grad(rows, cols, dtype, reduction=reduction)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert "InplaceCrossEntropyGrad" in ops(fused)
    rng = np.random.default_rng(5)
    logp = (rng.standard_normal((rows, cols)) - 3).astype(dtype)
    logp.reshape(-1)[:4] = [np.nan, np.inf, -np.inf, -0.0]
    for lp in (logp, np.asfortranarray(logp)):
        f = {"logp": lp, "labels": rng.integers(0, cols, rows), "minus": np.full((rows, 1), -1.0, dtype),
             "scale": np.array(1 / rows, dtype)}
        want = plain.run(f)[0]
        got = fused.run(f)[0]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes()

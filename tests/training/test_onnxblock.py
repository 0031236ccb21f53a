"""onnxblock: building blocks, loss blocks against torch, gradients of the losses, errors."""

from __future__ import annotations

import numpy as np
import onnx
import onnx.reference
import pytest
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.training import onnxblock
from onnxtrain.training.onnxblock import BlockError

F = torch.nn.functional


def base_model(inputs: dict[str, tuple[int, list]], opset: int = 17) -> onnx.ModelProto:
    vis = [helper.make_tensor_value_info(n, et, shape) for n, (et, shape) in inputs.items()]
    return helper.make_model(
        helper.make_graph([], "g", vis, []), opset_imports=[helper.make_opsetid("", opset)]
    )


def finish(model: onnx.ModelProto, outputs: list[str]) -> onnx.ModelProto:
    model.graph.output.extend(helper.make_empty_tensor_value_info(o) for o in outputs)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    outs = {v.name: v for v in model.graph.value_info}
    ins = {v.name: v for v in model.graph.input}
    del model.graph.output[:]
    model.graph.output.extend(outs.get(o) or ins[o] for o in outputs)
    onnx.checker.check_model(model, full_check=True)
    return model


def build(block_call, inputs: dict[str, np.ndarray], opset: int = 17) -> tuple[onnx.ModelProto, list[str]]:
    m = base_model(
        {n: (helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)) for n, v in inputs.items()}, opset
    )
    with onnxblock.base(m) as acc:
        out = block_call()
    outs = [out] if isinstance(out, str) else list(out)
    return finish(acc.model, outs), outs


def run(
    block_call, inputs: dict[str, np.ndarray], opset: int = 17, extra: dict | None = None
) -> list[np.ndarray]:
    m, _ = build(block_call, inputs, opset)
    feeds = {**inputs, **(extra or {})}
    ours = compile_model(m).run(feeds)
    ref = onnx.reference.ReferenceEvaluator(m).run(None, feeds)
    for a, b in zip(ours, ref):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    return ours


RNG = np.random.default_rng(0)
X = RNG.standard_normal((3, 4)).astype(np.float32)
Y = (RNG.random((3, 4)) + 0.5).astype(np.float32)


# ---- building blocks ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,fn",
    [
        ("Add", np.add),
        ("Sub", np.subtract),
        ("Mul", np.multiply),
        ("Div", np.divide),
        ("Max", np.maximum),
        ("Min", np.minimum),
    ],
)
def test_binary_blocks(name, fn):
    (out,) = run(lambda: getattr(onnxblock.blocks, name)()("x", "y"), {"x": X, "y": Y})
    np.testing.assert_allclose(out, fn(X, Y), rtol=1e-6)


@pytest.mark.parametrize(
    "name,fn",
    [
        ("Neg", np.negative),
        ("Abs", np.abs),
        ("Exp", np.exp),
        ("Tanh", np.tanh),
        ("Relu", lambda a: np.maximum(a, 0)),
        ("Identity", lambda a: a),
        ("Sigmoid", lambda a: 1 / (1 + np.exp(-a))),
    ],
)
def test_unary_blocks(name, fn):
    (out,) = run(lambda: getattr(onnxblock.blocks, name)()("x"), {"x": X})
    np.testing.assert_allclose(out, fn(X), rtol=1e-6, atol=1e-7)


def test_log_sqrt_pow_clip_cast():
    (lg,) = run(lambda: onnxblock.blocks.Log()("y"), {"y": Y})
    (sq,) = run(lambda: onnxblock.blocks.Sqrt()("y"), {"y": Y})
    (pw,) = run(lambda: onnxblock.blocks.Pow(3.0)("x"), {"x": X})
    (cl,) = run(lambda: onnxblock.blocks.Clip(-0.5, 0.25)("x"), {"x": X})
    (lo,) = run(lambda: onnxblock.blocks.Clip(clip_min=0.0)("x"), {"x": X})
    (ca,) = run(lambda: onnxblock.blocks.Cast(TensorProto.DOUBLE)("x"), {"x": X})
    np.testing.assert_allclose(lg, np.log(Y), rtol=1e-6)
    np.testing.assert_allclose(sq, np.sqrt(Y), rtol=1e-6)
    np.testing.assert_allclose(pw, X**3, rtol=1e-6)
    np.testing.assert_array_equal(cl, np.clip(X, -0.5, 0.25))
    np.testing.assert_array_equal(lo, np.maximum(X, 0.0))
    assert ca.dtype == np.float64


@pytest.mark.parametrize("opset", [17, 18])
def test_reductions(opset):
    s, m, k, ax, sq = run(
        lambda: (
            onnxblock.blocks.ReduceSum(keepdims=False)("x"),
            onnxblock.blocks.ReduceMean()("x"),
            onnxblock.blocks.ReduceMean(keepdims=True, axes=[1])("x"),
            onnxblock.blocks.ReduceSum(keepdims=False, axes=[0])("x"),
            onnxblock.blocks.ReduceSumSquare(keepdims=False)("x"),
        ),
        {"x": X},
        opset,
    )
    assert s.shape == () and m.shape == (1, 1) and k.shape == (3, 1) and ax.shape == (4,)
    np.testing.assert_allclose(s, X.sum(), rtol=1e-5)
    np.testing.assert_allclose(m, X.mean(keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(k, X.mean(1, keepdims=True), rtol=1e-5)
    np.testing.assert_allclose(ax, X.sum(0), rtol=1e-5)
    np.testing.assert_allclose(sq, (X**2).sum(), rtol=1e-5)


def test_reduce_all_l2():
    (out,) = run(lambda: onnxblock.blocks.ReduceAllL2()("x", "y"), {"x": X, "y": Y})
    np.testing.assert_allclose(out, np.sqrt((X**2).sum() + (Y**2).sum()), rtol=1e-6)


def test_constant_is_a_scalar_of_the_other_operands_type():
    x64 = X.astype(np.float64)
    (out,) = run(lambda: onnxblock.blocks.Mul()("x", onnxblock.blocks.Constant(0.5)()), {"x": x64})
    assert out.dtype == np.float64 and out.shape == X.shape
    np.testing.assert_array_equal(out, 0.5 * x64)
    (s,) = run(
        lambda: onnxblock.blocks.Mul()(
            onnxblock.blocks.ReduceSum(keepdims=False)("x"), onnxblock.blocks.Constant(2.0)()
        ),
        {"x": X},
    )
    assert s.shape == ()  # a scalar loss times a constant stays a scalar


def test_softplus_is_stable_and_its_gradient_is_sigmoid():
    x = np.array([-1000.0, -30.0, -1.0, 0.0, 1e-8, 2.0, 30.0, 1000.0], np.float64)
    m, (out,) = build(lambda: onnxblock.blocks.Softplus()("x"), {"x": x})
    np.testing.assert_allclose(
        compile_model(m).run({"x": x})[0], F.softplus(torch.from_numpy(x)).numpy(), rtol=1e-12, atol=1e-15
    )  # log(1 + u), not log1p: absolute accuracy
    loss = helper.make_node("ReduceSum", [out], ["loss"], keepdims=0)
    m.graph.node.append(loss)
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    gm = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    grad = compile_model(gm).run({"x": x})[-1]
    np.testing.assert_allclose(grad, torch.sigmoid(torch.from_numpy(x)).numpy(), rtol=1e-12)  # 0.5 at 0


def test_input_like_and_pass_through():
    m = base_model({"x": (TensorProto.FLOAT, ["batch", 4])})
    with onnxblock.base(m) as acc:
        t = onnxblock.blocks.InputLike("x")("target")
        again = onnxblock.blocks.InputLike("x")("target")
        same = onnxblock.blocks.PassThrough()("x")
        pair = onnxblock.blocks.PassThrough()("x", "target")
    assert t == again == "target" and same == ("x",) and pair == ("x", "target")  # tuples, as onnxruntime
    assert [v.name for v in acc.model.graph.input] == ["x", "target"]
    assert acc.model.graph.input[1].type == acc.model.graph.input[0].type
    assert [v.name for v in m.graph.input] == ["x"]  # the caller's model is left as it was


def test_linear_is_a_gemm_over_new_normal_parameters():
    """onnxruntime's Linear block: W of (in, out) and b drawn from numpy's global normal generator."""
    np.random.seed(3)
    w_want, b_want = np.random.randn(4, 3).astype(np.float32), np.random.randn(3).astype(np.float32)
    np.random.seed(3)
    (y,) = run(lambda: onnxblock.blocks.Linear(4, 3, alpha=0.5, beta=2.0)("x"), {"x": X})
    np.testing.assert_allclose(y, 0.5 * X @ w_want + 2.0 * b_want, rtol=1e-5, atol=1e-6)
    (y,) = run(lambda: onnxblock.blocks.Linear(4, 2, bias=False)("x"), {"x": X})
    assert y.shape == (3, 2)
    with pytest.raises(BlockError, match="in_features"):
        onnxblock.blocks.Linear(0, 2)


def test_sequence_construct():
    m, outs = build(lambda: onnxblock.blocks.SequenceConstruct()("x", "y"), {"x": X, "y": Y})
    (seq,) = compile_model(m).run({"x": X, "y": Y})
    assert isinstance(seq, list) and len(seq) == 2
    np.testing.assert_array_equal(seq[0], X)
    np.testing.assert_array_equal(seq[1], Y)


def test_label_encoder_writes_the_ml_node_and_the_engine_runs_it():
    ort = pytest.importorskip("onnxruntime")
    m = base_model({"x": (TensorProto.INT64, [4])})
    with onnxblock.base(m) as acc:
        out = onnxblock.blocks.LabelEncoder(keys_int64s=[1, 2, 3], values_floats=[0.5, 1.5, 2.5],
                                            default_float=-1.0)("x")
    m = acc.model
    m.graph.output.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, [4]))
    onnx.checker.check_model(m, full_check=True)
    x = np.array([3, 1, 7, 2], np.int64)
    got = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(got[0], [2.5, 0.5, -1.0, 1.5])
    (ours,) = compile_model(m).run({"x": x})
    np.testing.assert_array_equal(ours, got[0])
    assert ours.dtype == got[0].dtype


def test_onnxruntime_names_of_the_optimizer_blocks():
    assert onnxblock.optim.AdamWOptimizer is onnxblock.optim.AdamW
    assert onnxblock.optim.SGDOptimizer is onnxblock.optim.SGD


# ---- losses vs torch ---------------------------------------------------------------------------------------
LOGITS = (3 * RNG.standard_normal((6, 5))).astype(np.float32)
TARGET = RNG.standard_normal((6, 5)).astype(np.float32)
BINARY = RNG.integers(0, 2, (6, 5)).astype(np.float32)
LABELS = RNG.integers(0, 5, 6).astype(np.int64)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_and_l1(reduction):
    mse, l1 = run(
        lambda: (onnxblock.loss.MSELoss(reduction)("x"), onnxblock.loss.L1Loss(reduction)("x")),
        {"x": LOGITS},
        extra={"target": TARGET},
    )
    x, t = torch.from_numpy(LOGITS), torch.from_numpy(TARGET)
    np.testing.assert_allclose(mse, F.mse_loss(x, t, reduction=reduction).numpy(), rtol=1e-5)
    np.testing.assert_allclose(l1, F.l1_loss(x, t, reduction=reduction).numpy(), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_bce_with_logits(reduction):
    w = RNG.random(5).astype(np.float32)
    pw = (RNG.random(5) + 0.5).astype(np.float32)
    plain, weighted = run(
        lambda: (
            onnxblock.loss.BCEWithLogitsLoss(reduction=reduction)("x"),
            onnxblock.loss.BCEWithLogitsLoss(w, reduction, pw)("x"),
        ),
        {"x": LOGITS},
        extra={"target": BINARY},
    )
    x, t = torch.from_numpy(LOGITS), torch.from_numpy(BINARY)
    np.testing.assert_allclose(
        plain, F.binary_cross_entropy_with_logits(x, t, reduction=reduction).numpy(), rtol=1e-5, atol=1e-6
    )
    ref = F.binary_cross_entropy_with_logits(
        x, t, torch.from_numpy(w), reduction=reduction, pos_weight=torch.from_numpy(pw)
    )
    np.testing.assert_allclose(weighted, ref.numpy(), rtol=1e-5, atol=1e-6)


def test_bce_with_large_logits_is_finite():
    big = (1000 * LOGITS).astype(np.float32)
    (out,) = run(lambda: onnxblock.loss.BCEWithLogitsLoss()("x"), {"x": big}, extra={"target": BINARY})
    ref = F.binary_cross_entropy_with_logits(torch.from_numpy(big), torch.from_numpy(BINARY))
    assert np.isfinite(out)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_weight_and_ignore_index(reduction):
    w = (RNG.random(5) + 0.1).astype(np.float32)  # a numpy weight (the reference fails on its truthiness)
    labels = LABELS.copy()
    labels[2] = -1
    (weighted,) = run(
        lambda: onnxblock.loss.CrossEntropyLoss(w, reduction, ignore_index=-1)("x", "labels"),
        {"x": LOGITS},
        extra={"labels": labels},
    )
    x = torch.from_numpy(LOGITS)
    ref = F.cross_entropy(
        x, torch.from_numpy(labels), torch.from_numpy(w), reduction=reduction, ignore_index=-1
    )
    np.testing.assert_allclose(weighted, ref.numpy(), rtol=1e-5, atol=1e-7)


def test_cross_entropy_plain_matches_torch():
    (out,) = run(lambda: onnxblock.loss.CrossEntropyLoss()("x"), {"x": LOGITS}, extra={"labels": LABELS})
    np.testing.assert_allclose(
        out, F.cross_entropy(torch.from_numpy(LOGITS), torch.from_numpy(LABELS)).numpy(), rtol=1e-6
    )


def test_cross_entropy_sequence_logits():
    """[B, T, C] logits with [B, T] labels, class_axis=-1 (onnxruntime-training fails at run time)."""
    logits = RNG.standard_normal((2, 3, 5)).astype(np.float32)
    labels = RNG.integers(0, 5, (2, 3)).astype(np.int64)
    m, _ = build(lambda: onnxblock.loss.CrossEntropyLoss(class_axis=-1)("x"), {"x": logits})
    assert [d.dim_value for d in m.graph.input[1].type.tensor_type.shape.dim] == [2, 3]
    (out,) = compile_model(m).run({"x": logits, "labels": labels})
    ref = F.cross_entropy(torch.from_numpy(logits).reshape(-1, 5), torch.from_numpy(labels).reshape(-1))
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-6)


@pytest.mark.parametrize("t", [3, 5])
def test_cross_entropy_takes_classes_on_axis_1_as_torch(t: int):
    """Scores [N, C, T] (torch's and ONNX's layout; onnxruntime-training's kernels read them so): labels
    [N, T], the loss as torch's cross_entropy, also when T equals C (3: the classes-last reading gave
    another loss without an error)."""
    scores = RNG.standard_normal((2, 3, t))
    labels = RNG.integers(0, 3, (2, t)).astype(np.int64)
    m, _ = build(lambda: onnxblock.loss.CrossEntropyLoss()("x"), {"x": scores})
    assert [d.dim_value for d in m.graph.input[1].type.tensor_type.shape.dim] == [2, t]
    (out,) = compile_model(m).run({"x": scores, "labels": labels})
    want = F.cross_entropy(torch.from_numpy(scores), torch.from_numpy(labels)).numpy()
    np.testing.assert_allclose(out, want, rtol=1e-12)
    with pytest.raises(onnxblock.BlockError, match="class_axis"):
        onnxblock.loss.CrossEntropyLoss(class_axis=2)


def test_existing_target_is_reused():
    m = base_model({"x": (TensorProto.FLOAT, [6, 5]), "y": (TensorProto.FLOAT, [6, 5])})
    with onnxblock.base(m) as acc:
        onnxblock.loss.MSELoss()("x", target_name="y")
    assert [v.name for v in acc.model.graph.input] == ["x", "y"]


# ---- optimizer blocks --------------------------------------------------------------------------------------
def test_optimizer_defaults():
    a = onnxblock.optim.AdamW()
    assert (a.bias_correction, a.betas, a.eps, a.weight_decay, a.clip_grad) == (
        True,
        (0.9, 0.999),
        1e-6,
        0.0,
        None,
    )
    assert a.state_names == ("momentum0", "momentum1")
    assert onnxblock.optim.SGD().state_names == ("momentum0",)
    assert onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(1.0)).clip_grad.max_norm == 1.0


def test_clip_grad_norm_block():
    g1, g2 = 3 * X, Y
    c1, c2 = run(lambda: onnxblock.optim.ClipGradNorm(1.0)("x", "y"), {"x": g1, "y": g2})
    norm = np.sqrt((g1.astype(np.float64) ** 2).sum() + (g2.astype(np.float64) ** 2).sum())
    coef = min(1.0 / (norm + 1e-6), 1.0)
    np.testing.assert_allclose(c1, g1 * coef, rtol=1e-6)
    np.testing.assert_allclose(c2, g2 * coef, rtol=1e-6)
    small = run(lambda: onnxblock.optim.ClipGradNorm(1e6)("x"), {"x": g1})[0]
    np.testing.assert_allclose(small, g1, rtol=1e-7)  # below max_norm: unchanged (coef 1)


# ---- errors ------------------------------------------------------------------------------------------------
def test_error_bad_reduction():
    with pytest.raises(RuntimeError, match="Reduction avg not supported"):
        onnxblock.loss.MSELoss(reduction="avg")
    with pytest.raises(BlockError, match="Reduction max not supported"):
        onnxblock.loss.CrossEntropyLoss(reduction="max")


def test_error_nested_base_and_no_base():
    m = base_model({"x": (TensorProto.FLOAT, [2])})
    nested = pytest.raises(BlockError, match="Base onnx model already exists")
    with onnxblock.base(m), nested, onnxblock.base(m):
        pass
    with pytest.raises(BlockError, match="no base model is set"):
        onnxblock.blocks.Add()("x", "x")


def test_error_cross_entropy_needs_rank_two():
    with pytest.raises(BlockError, match="known rank >= 2"):
        build(lambda: onnxblock.loss.CrossEntropyLoss()("x"), {"x": np.zeros(5, np.float32)})


def test_error_bad_clip_grad():
    with pytest.raises(BlockError, match="max_norm must be > 0"):
        onnxblock.optim.ClipGradNorm(0.0)
    with pytest.raises(BlockError, match="clip_grad must be an onnxblock.optim.ClipGradNorm"):
        onnxblock.optim.AdamW(clip_grad=1.0)


def test_checkpoint_helpers(tmp_path):
    from onnx import numpy_helper

    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "w")
    b = numpy_helper.from_array(np.ones(3, np.float32), "b")
    onnxblock.save_checkpoint(([w], [b]), tmp_path / "ckpt")
    onnxblock.save_checkpoint(([w], [b]), tmp_path / "nominal", nominal_checkpoint=True)
    onnxblock.save_checkpoint([[w], [b]], tmp_path / "listed")  # any pair, as onnxruntime-training takes
    with open(tmp_path / "ckpt", "rb") as f, open(tmp_path / "listed", "rb") as g:
        assert f.read() == g.read()
    model = helper.make_model(
        helper.make_graph([], "g", [], [], [numpy_helper.from_array(np.zeros((2, 3), np.float32), "w")])
    )
    onnxblock.load_checkpoint_to_model(tmp_path / "ckpt", model)
    np.testing.assert_array_equal(numpy_helper.to_array(model.graph.initializer[0]), numpy_helper.to_array(w))
    with pytest.raises(BlockError, match="Cannot load a nominal checkpoint"):
        onnxblock.load_checkpoint_to_model(tmp_path / "nominal", model)


def test_block_api_of_onnxruntime_training_custom_blocks():
    """What custom blocks written for onnxruntime-training use: Block(temp_file_name=...) (relative only),
    infer_shapes_on_base(), base(model, model_path).has_path / .path, InputLike(like)() with a generated
    name."""

    class Doubled(onnxblock.Block):
        def __init__(self):
            super().__init__(temp_file_name="doubled.onnx")
            self.add = onnxblock.blocks.Add()

        def build(self, x):
            out = self.add(x, x)
            inferred = self.infer_shapes_on_base()
            assert [d.dim_value for d in next(v for v in inferred.graph.value_info if v.name == out)
                    .type.tensor_type.shape.dim] == [2, 4]
            return out

    with pytest.raises(RuntimeError, match="relative path"):
        onnxblock.blocks.PassThrough.__init__(onnxblock.blocks.PassThrough(), temp_file_name="/abs.onnx")
    m = base_model({"x": (TensorProto.FLOAT, [2, 4])})
    with onnxblock.base(m, "model.onnx") as acc:
        y = Doubled()("x")
        extra = onnxblock.blocks.InputLike("x")()
    assert acc.has_path and acc.path == "model.onnx"
    assert extra.startswith("onnx::input::") and acc.model.graph.input[-1].name == extra
    (out,) = compile_model(finish(acc.model, [y])).run({"x": np.ones((2, 4), np.float32),
                                                       extra: np.zeros((2, 4), np.float32)})
    np.testing.assert_array_equal(out, 2 * np.ones((2, 4)))
    with onnxblock.base(m) as acc:
        assert not acc.has_path

"""Values that mixed precision must not change: Dropout's ratio (float32, spec §8.2), float32 constants
beyond the half type's range (saturated, not ±inf), the legacy session's ``loss_scale`` feed (positive,
finite); and the legacy options that do nothing under the other settings (a warning)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import TrainingParameters, TrainingSession

LR = np.array([0.01], np.float32)


def params(dtype: str | None, opt: str = "SGDOptimizer", **kw) -> TrainingParameters:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    if dtype:
        p.use_mixed_precision = True
        p.mixed_precision_dtype = dtype
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def feeds(sess: TrainingSession, **values: np.ndarray) -> dict[str, np.ndarray]:
    if sess.loss_scale_input_name:
        values[sess.loss_scale_input_name] = np.ones(1, np.float32)
    return {"Learning_Rate": LR, **values}


def dropout_model(ratio: float) -> onnx.ModelProto:
    w = (np.random.default_rng(0).standard_normal((64, 64)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Dropout", ["h", "ratio", "tm"], ["d", "mask"]),
        helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "tm")]
    g = helper.make_graph(
        nodes, "drop", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 64])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("mask", TensorProto.BOOL, [256, 64])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)])


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_dropout_ratio_stays_float32(dtype: str) -> None:
    """The ratio feeds Dropout as float32: the same seed drops the same cells as in float32 (bfloat16's 0.3
    is 0.30078125, whose 8-bit draw took another mask before)."""
    x = np.ones((256, 64), np.float32)
    masks = []
    for d in (None, dtype):
        sess = TrainingSession(dropout_model(0.3).SerializeToString(), params(d))
        node = next(n for n in sess._graphs.full.graph.node if n.op_type == "Dropout")
        assert node.input[1] == "ratio"
        onnxtrain.set_seed(3)
        masks.append(sess.run(["mask"], feeds(sess, x=x))[0])
    assert 0.25 < 1 - masks[0].mean() < 0.35
    np.testing.assert_array_equal(masks[0], masks[1])


def masked_attention(form: str) -> onnx.ModelProto:
    """scores + (1 - mask)·finfo(float32).min, then softmax and a classifier (a Hugging Face style mask);
    the minimum is an initializer or a Constant node."""
    r = np.random.default_rng(0)
    fmin = np.array(np.finfo(np.float32).min, np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "Wq"], ["q"]),
        helper.make_node("Transpose", ["q"], ["kt"], perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s"]),
        helper.make_node("Sub", ["one", "mask"], ["inv"]),
        helper.make_node("Mul", ["inv", "fmin"], ["add_mask"]),
        helper.make_node("Unsqueeze", ["add_mask", "ax1"], ["am"]),
        helper.make_node("Add", ["s", "am"], ["sm"]),
        helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "q"], ["c"]),
        helper.make_node("ReduceMean", ["c"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "Wo"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    inits = [numpy_helper.from_array((r.standard_normal((8, 8)) * 0.3).astype(np.float32), "Wq"),
             numpy_helper.from_array((r.standard_normal((8, 3)) * 0.3).astype(np.float32), "Wo"),
             numpy_helper.from_array(np.array(1.0, np.float32), "one"),
             numpy_helper.from_array(np.array([1], np.int64), "ax1")]
    if form == "initializer":
        inits.append(numpy_helper.from_array(fmin, "fmin"))
    else:  # a Constant node of each attribute form
        value = {"value": numpy_helper.from_array(fmin, "fmin"), "value_float": float(fmin),
                 "value_floats": [float(fmin)]}[form]
        nodes.insert(0, helper.make_node("Constant", [], ["fmin"], **{form: value}))
    g = helper.make_graph(
        nodes, "attn",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 8]),
         helper.make_tensor_value_info("mask", TensorProto.FLOAT, [2, 4]),
         helper.make_tensor_value_info("y", TensorProto.INT64, [2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("form", ["initializer", "value", "value_float", "value_floats"])
def test_constants_beyond_the_half_range_saturate(form: str) -> None:
    """The mask's float32 minimum became -inf in half, the loss NaN and every step skipped; it now saturates
    (with a warning naming it): the bfloat16 loss is torch autocast's, the float16 one close to float32's."""
    model = masked_attention(form).SerializeToString()
    r = np.random.default_rng(1)
    x = r.standard_normal((2, 4, 8)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    y = np.array([0, 2])
    losses = {}
    for dtype in (None, "float16", "bfloat16"):
        kw = {"weights_to_train": {"Wq", "Wo"}}
        if dtype:
            with pytest.warns(UserWarning, match=r"'fmin' holds 1 value\(s\) beyond"):
                sess = TrainingSession(model, params(dtype, **kw))
        else:
            sess = TrainingSession(model, params(dtype, **kw))
        out = sess.run(None, feeds(sess, x=x, mask=mask, y=y))
        named = dict(zip([o.name for o in sess.get_outputs()], out))
        assert np.isfinite(named["global_gradient_norm"])
        if dtype:
            assert named["all_gradients_finite"].all()
        losses[dtype] = float(named["loss"])
    init = {t.name: numpy_helper.to_array(t) for t in masked_attention("value").graph.initializer}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q = torch.tensor(x) @ torch.tensor(init["Wq"])
        s = q @ q.transpose(1, 2) + ((1 - torch.tensor(mask)) * torch.finfo(torch.float32).min)[:, None, :]
        p = torch.softmax(s.float(), -1)
        logits = (p.to(q.dtype) @ q).float().mean(1) @ torch.tensor(init["Wo"])
        ref = float(torch.nn.functional.cross_entropy(logits, torch.tensor(y)))
    assert losses["bfloat16"] == pytest.approx(ref, abs=1e-6)
    assert losses["float16"] == pytest.approx(losses[None], abs=1e-3)


@pytest.mark.parametrize("scale", [0.0, -1.0, np.nan, np.inf])
def test_legacy_loss_scale_feed_must_be_positive_and_finite(scale: float) -> None:
    """A zero scale made 0/0 updates (NaN weights), a negative one a step uphill: refused naming the input."""
    sess = TrainingSession(dropout_model(0.0).SerializeToString(), params("float16", "AdamOptimizer"))
    f = feeds(sess, x=np.ones((256, 64), np.float32))
    f[sess.loss_scale_input_name] = np.array([scale], np.float32)
    with pytest.raises(ValueError, match="input 'loss_scale': the loss scale must be a positive finite"):
        sess.run(["loss"], f)
    f[sess.loss_scale_input_name] = np.array([4.0], np.float32)
    assert np.isfinite(sess.run(["loss"], f)[0])


CLIP_2 = {w: {"max_norm_clip": 2.0} for w in ("W1", "b1", "W2", "b2")}


def mlp_bytes() -> bytes:
    from tests.session.helpers import mlp_model

    return mlp_model().SerializeToString()


@pytest.mark.parametrize(
    "opt, kw, message",
    [("AdamOptimizer", {"enable_grad_norm_clip": False, "optimizer_attributes_map": CLIP_2},
      "max_norm_clip .* has no effect with enable_grad_norm_clip=False"),
     ("SGDOptimizer", {"mixed_precision_dtype": "bfloat16"}, "mixed_precision_dtype has no effect"),
     ("SGDOptimizer", {"number_recompute_layers": 2}, "number_recompute_layers has no effect"),
     ("LambOptimizer", {"legacy_cpu_adam": True}, "legacy_cpu_adam has no effect with LambOptimizer"),
     ("SGDOptimizer", {"use_fp16_moments": True}, "use_fp16_moments has no effect with SGDOptimizer"),
     ("SGDOptimizer", {"loss_scale": 128.0}, "loss_scale has no effect"),
     ("SGDOptimizer", {"propagate_cast_ops_level": 2}, "propagate_cast_ops_level / propagate_cast_ops_allow"),
     ("SGDOptimizer", {"use_memory_efficient_gradient": True}, "use_memory_efficient_gradient has no eff")],
)
def test_options_without_effect_warn(opt: str, kw: dict, message: str) -> None:
    """An option set to a value that does nothing under the others says so (it was silently accepted)."""
    with pytest.warns(UserWarning, match=message):
        TrainingSession(mlp_bytes(), params(None, opt, **kw))


def test_options_with_effect_do_not_warn() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingSession(mlp_bytes(), params("bfloat16", "AdamOptimizer", legacy_cpu_adam=True,
                                            use_fp16_moments=True))
        TrainingSession(mlp_bytes(), params(None, "AdamOptimizer", optimizer_attributes_map=CLIP_2))


def test_infinite_constants_stay_infinite() -> None:
    """Saturation moves finite values only: a -inf beside a finite minimum stays -inf in the half constant."""
    from onnxtrain.graph_transforms.mixed_precision import mixed_precision

    values = np.array([-np.inf, np.finfo(np.float32).min, 1.5], np.float32)
    nodes = [helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(values, "c")),
             helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "c"], ["s"]),
             helper.make_node("ReduceMax", ["s"], ["loss"], keepdims=0)]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")])
    with pytest.warns(UserWarning, match="'c' holds 1 value"):
        mp = mixed_precision(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "loss")
    half = [numpy_helper.to_array(n.attribute[0].t) for n in mp.graph.node
            if n.op_type == "Constant" and n.attribute[0].t.data_type == TensorProto.FLOAT16]
    assert len(half) == 1
    np.testing.assert_array_equal(half[0].astype(np.float32), [-np.inf, -65504.0, 1.5])


def _one_step(model: onnx.ModelProto, dtype: str, x: np.ndarray) -> tuple[float, np.ndarray]:
    """Loss and W's change after one legacy SGD step (lr 0.01, loss scale 1) under ``dtype``."""
    sess = TrainingSession(model.SerializeToString(), params(dtype, weights_to_train={"W"}))
    w0 = np.array(sess.get_state()["W"])
    loss = float(sess.run(["loss"], feeds(sess, x=x))[0])
    return loss, w0 - sess.get_state()["W"]


_n, _a = helper.make_node, numpy_helper.from_array


def _split_model(w: np.ndarray) -> tuple:
    """loss = mean(a·b), a, b = SplitToSequence(x·W) (torch's dynamo export of qkv.split)."""
    nodes = [_n("MatMul", ["x", "W"], ["h"]),
             _n("SplitToSequence", ["h", "sizes"], ["seq"], axis=-1),
             _n("SequenceAt", ["seq", "i0"], ["a"]), _n("SequenceAt", ["seq", "i1"], ["b"]),
             _n("Mul", ["a", "b"], ["ab"]), _n("ReduceMean", ["ab"], ["loss"], keepdims=0)]
    inits = [_a(w, "W"), _a(np.array([4, 4], np.int64), "sizes"),
             _a(np.array(0, np.int64), "i0"), _a(np.array(1, np.int64), "i1")]
    return nodes, inits, lambda x, W: ((x @ W)[:, :4] * (x @ W)[:, 4:]).mean()


def _rms_model(w: np.ndarray) -> tuple:
    """loss = Σ RMSNorm(x·W, scale = a Constant of 0.5s)·t, as torch's export of a non-affine RMSNorm."""
    t = np.linspace(-1, 1, 8, dtype=np.float32)
    nodes = [_n("MatMul", ["x", "W"], ["h"]),
             _n("Constant", [], ["s"], value=_a(np.full(8, 0.5, np.float32))),
             _n("RMSNormalization", ["h", "s"], ["y"], epsilon=1e-5),
             _n("Mul", ["y", "t"], ["yt"]), _n("ReduceSum", ["yt"], ["loss"], keepdims=0)]
    return nodes, [_a(w, "W"), _a(t, "t")], (
        lambda x, W: (torch.nn.functional.rms_norm(x @ W, (8,), eps=1e-5) * 0.5 * torch.tensor(t)).sum())


def _attention_model(w: np.ndarray) -> tuple:
    """loss = Σ Attention(x·W, x·W, V constant)·t (4-D, one head)."""
    rng = np.random.default_rng(3)
    v, t = (rng.standard_normal((1, 1, 4, 8)).astype(np.float32) for _ in range(2))
    nodes = [_n("MatMul", ["x", "W"], ["q"]),
             _n("Constant", [], ["v"], value=_a(v)),
             _n("Attention", ["q", "q", "v"], ["y"]),
             _n("Mul", ["y", "t"], ["yt"]), _n("ReduceSum", ["yt"], ["loss"], keepdims=0)]
    return nodes, [_a(w, "W"), _a(t, "t")], (
        lambda x, W: (torch.nn.functional.scaled_dot_product_attention(x @ W, x @ W, torch.tensor(v))
                      * torch.tensor(t)).sum())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["SplitToSequence", "RMSNormalization", "Attention"])
def test_sequences_and_body_ops_under_mixed_precision(case: str, dtype: str) -> None:
    """Graphs mixed precision made ill-typed (the sessions refused them): a sequence of half tensors whose
    SequenceAt was taken as float32 (its gradient inserted float32 into it), and ops run as their ONNX
    body (RMSNormalization, Attention) whose constant scale or V stayed float32 beside half inputs. The
    step matches torch's float32 one within the half type's rounding."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((8, 8)) * 0.4).astype(np.float32)
    nodes, inits, fn = {"SplitToSequence": _split_model, "RMSNormalization": _rms_model,
                        "Attention": _attention_model}[case](w)
    shape = [1, 1, 4, 8] if case == "Attention" else [4, 8]
    x = rng.standard_normal(shape).astype(np.float32)
    g = helper.make_graph(nodes, case, [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    loss, step = _one_step(model, dtype, x)
    tw = torch.tensor(w, requires_grad=True)
    want = fn(torch.tensor(x), tw)
    want.backward()
    tol = 2e-2 if dtype == "bfloat16" else 4e-3
    np.testing.assert_allclose(loss, float(want), rtol=tol, atol=tol)
    grad = tw.grad.numpy()
    np.testing.assert_allclose(step / 0.01, grad, rtol=0, atol=4 * tol * np.abs(grad).max())


def _typed_cases() -> dict[str, tuple[list, list, bool]]:
    """Graphs whose mixed-precision forward was ill-typed: (nodes, initializers, deterministic)."""
    rng = np.random.default_rng(0)
    w = _a((rng.standard_normal((8, 8)) * 0.3).astype(np.float32), "W")
    t = _a(rng.standard_normal((4, 8)).astype(np.float32), "t")
    tail = [_n("Mul", ["y", "t"], ["yt"]), _n("ReduceSum", ["yt"], ["loss"], keepdims=0)]
    mm = _n("MatMul", ["x", "W"], ["h"])
    return {
        # an output that takes its input's type at run time (no dtype): recorded float32, fed half
        "Optional->GroupNormalization": ([
            mm, _n("Optional", ["h"], ["o"]), _n("OptionalGetElement", ["o"], ["h2"]),
            _n("Reshape", ["h2", "sh"], ["h3"]),
            _n("GroupNormalization", ["h3", "S", "Bb"], ["g"], num_groups=2),
            _n("Reshape", ["g", "shb"], ["y"]), *tail],
            [w, t, _a(np.ones(8, np.float32), "S"), _a(np.zeros(8, np.float32), "Bb"),
             _a(np.array([4, 8, 1], np.int64), "sh"), _a(np.array([4, 8], np.int64), "shb")], True),
        "RandomNormalLike": ([mm, _n("RandomNormalLike", ["h"], ["n"], scale=0.01),
                              _n("Softmax", ["h"], ["s"]), _n("Add", ["s", "n"], ["y"]), *tail],
                             [w, t], False),
        "Bernoulli": ([mm, _n("Sigmoid", ["h"], ["p"]), _n("Bernoulli", ["p"], ["m"]),
                       _n("Exp", ["h"], ["e"]), _n("Mul", ["e", "m"], ["y"]), *tail], [w, t], False),
        "EyeLike": ([_n("MatMul", ["W", "W"], ["ww"]), _n("EyeLike", ["ww"], ["e"]),
                     _n("Softmax", ["W"], ["sw"]), _n("Add", ["e", "sw"], ["m"]),
                     _n("MatMul", ["x", "m"], ["y"]), *tail], [w, t], True),
        # an op run as its body whose members mix float32 and half: a float32 Q/K beside a half V
        "Attention(float32 Q, half V)": ([
            mm, _n("Softmax", ["x"], ["q"]), _n("Unsqueeze", ["q", "ax"], ["q4"]),
            _n("Unsqueeze", ["h", "ax"], ["v4"]), _n("Attention", ["q4", "q4", "v4"], ["y4"]),
            _n("Squeeze", ["y4", "ax"], ["y"]), *tail], [w, t, _a(np.array([0, 1], np.int64), "ax")], True),
        # a float32 X beside a half scale
        "RMSNormalization(float32 X, half scale)": ([
            _n("LogSoftmax", ["x"], ["ls"]), _n("RMSNormalization", ["ls", "W8"], ["r"]),
            _n("MatMul", ["r", "W"], ["y"]), *tail], [w, t, _a(np.ones(8, np.float32), "W8")], True),
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", list(_typed_cases()))
def test_mixed_precision_keeps_graphs_well_typed(case: str, dtype: str) -> None:
    """Each forward graph mixed precision writes passes onnx.checker (full_check); the legacy session trains
    two steps where it refused the model, and a deterministic model's losses are the float32 ones within the
    half type's rounding."""
    from onnxtrain.graph_transforms.mixed_precision import mixed_precision

    nodes, inits, deterministic = _typed_cases()[case]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    onnx.checker.check_model(mixed_precision(model, "loss", dtype), full_check=True)
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    runs = {}
    for dt in (None, dtype):
        sess = TrainingSession(model.SerializeToString(), params(dt, weights_to_train={"W"}))
        runs[dt] = [float(sess.run(["loss"], feeds(sess, x=x))[0]) for _ in range(2)]
    assert np.isfinite(runs[dtype]).all()
    if deterministic:
        np.testing.assert_allclose(runs[dtype], runs[None], rtol=3e-2, atol=3e-2)

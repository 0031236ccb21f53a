"""Models whose weights are float16 or bfloat16 (not mixed precision): the global norm sums squares in float32
(a float16 sum overflowed at a norm of 256: clipping zeroed every update), accumulation builds before opset
20, and a bfloat16 model's gradient graph is valid before opset 20."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import GradientGraphBuilder, InferenceSession, TrainingParameters, TrainingSession

NP = {TensorProto.FLOAT16: np.float16, TensorProto.BFLOAT16: ml_dtypes.bfloat16}
TORCH = {TensorProto.FLOAT16: torch.float16, TensorProto.BFLOAT16: torch.bfloat16}


def linear_model(et: int, opset: int = 17) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """loss = mean((x·W + b) * y): its gradients scale with y."""
    rng = np.random.default_rng(0)
    ws = {"W": (rng.standard_normal((4, 3)) * 0.5).astype(np.float32).astype(NP[et]),
          "b": (rng.standard_normal(3) * 0.1).astype(np.float32).astype(NP[et])}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["o"]),
             helper.make_node("Mul", ["o", "y"], ["d"]),
             helper.make_node("ReduceMean", ["d"], ["loss"], keepdims=0)]
    g = helper.make_graph(
        nodes, "lin",
        [helper.make_tensor_value_info("x", et, ["N", 4]), helper.make_tensor_value_info("y", et, ["N", 3])],
        [helper.make_tensor_value_info("loss", et, [])],
        [numpy_helper.from_array(v, k) for k, v in ws.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    return m, ws


def params(opt: str, **kw) -> TrainingParameters:
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", opt
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def test_float16_global_norm_does_not_overflow() -> None:
    """A float16 gradient of norm ~1,200: the norm is torch's clip_grad_norm_'s and Adam moves the weights."""
    m, ws = linear_model(TensorProto.FLOAT16)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4)).astype(np.float16)
    y = (rng.standard_normal((6, 3)) * 3000).astype(np.float16)
    sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer"))
    lr = np.array([0.01], np.float32)
    norm = sess.run(["global_gradient_norm"], {"x": x, "y": y, "Learning_Rate": lr})[0]
    t = {k: torch.tensor(v, requires_grad=True) for k, v in ws.items()}
    ((torch.tensor(x) @ t["W"] + t["b"]) * torch.tensor(y)).mean().backward()
    want = float(np.sqrt(sum((t[k].grad.double() ** 2).sum() for k in t)))
    assert 256 < want < 65504 and np.isfinite(norm)
    assert float(norm) == pytest.approx(want, rel=2e-3)
    moved = sess.get_state()["W"].astype(np.float32) - ws["W"].astype(np.float32)
    assert np.abs(moved).max() > 5e-3  # Adam's first step: about lr per element


@pytest.mark.parametrize("et", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_accumulation_of_half_gradients_before_opset_20(et: int, opt: str) -> None:
    """IsInf of a float16 value was the accumulation's group output: a graph invalid before opset 20. Two
    micro-steps on the batch's halves update as one step on the whole batch (the mean of the gradients)."""
    m, _ = linear_model(et)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((8, 4)).astype(np.float32).astype(NP[et])
    y = rng.standard_normal((8, 3)).astype(np.float32).astype(NP[et])
    lr = {"Learning_Rate": np.array([0.05], np.float32)}
    acc = TrainingSession(m.SerializeToString(), params(opt, gradient_accumulation_steps=2,
                                                        gradient_accumulation_mode="auto"))
    whole = TrainingSession(m.SerializeToString(), params(opt))
    acc.run(["loss"], {"x": x[:4], "y": y[:4], **lr})
    acc.run(["loss"], {"x": x[4:], "y": y[4:], **lr})
    whole.run(["loss"], {"x": x, "y": y, **lr})
    ulp = 2e-3 if et == TensorProto.FLOAT16 else 2e-2
    for k in ("W", "b"):
        got, want = (s.get_state()[k].astype(np.float32) for s in (acc, whole))
        np.testing.assert_allclose(got, want, rtol=ulp, atol=ulp)


def test_bfloat16_gradient_graph_is_valid_before_opset_20() -> None:
    """The loss seed was a bfloat16 ConstantOfShape (allowed from opset 20): the builder now lifts the model
    to opset 20, as mixed precision does; the gradients are torch's in bfloat16."""
    m, ws = linear_model(TensorProto.BFLOAT16)
    b = GradientGraphBuilder(m.SerializeToString(), {"loss"}, {"W", "b"}, "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(gm, full_check=True)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 4)).astype(np.float32).astype(ml_dtypes.bfloat16)
    y = rng.standard_normal((6, 3)).astype(np.float32).astype(ml_dtypes.bfloat16)
    got = dict(zip(["W_grad", "b_grad"], InferenceSession(gm.SerializeToString()).run(
        ["W_grad", "b_grad"], {"x": x, "y": y})))
    t = {k: torch.tensor(v.astype(np.float32), dtype=torch.bfloat16, requires_grad=True)
         for k, v in ws.items()}
    xt, yt = (torch.tensor(a.astype(np.float32), dtype=torch.bfloat16) for a in (x, y))
    ((xt @ t["W"] + t["b"]) * yt).mean().backward()
    for k in ("W", "b"):
        np.testing.assert_allclose(got[f"{k}_grad"].astype(np.float32), t[k].grad.float().numpy(), rtol=2e-2,
                                   atol=2e-3)


def test_ondevice_clip_of_float16_gradients() -> None:
    """onnxblock's AdamW with ClipGradNorm(1.0) over float16 gradients of norm ~447: the clipped gradient is
    g / ‖g‖ (torch's clip_grad_norm_), where the float16 sum of squares overflowed and clipped it to 0."""
    from onnxtrain.training import onnxblock

    w = np.full((4, 5), 0.5, np.float16)
    block = onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(1.0))
    with onnxblock.empty_base():
        block(([numpy_helper.from_array(w, "W")], []))
    model = block.to_model_proto()
    onnx.checker.check_model(model, full_check=True)
    g = np.full((4, 5), 100.0, np.float16)
    feeds = {"learning_rate": np.array([0.01], np.float32), "step": np.array([1], np.int64), "W": w,
             "W_grad": g, "W.momentum0": np.zeros_like(w), "W.momentum1": np.zeros_like(w)}
    names = [i.name for i in model.graph.input]
    outs = [o.name for o in model.graph.output]
    got = dict(zip(outs, InferenceSession(model.SerializeToString()).run(None, {n: feeds[n] for n in names})))
    want = 100.0 / np.sqrt(20 * 100.0**2)  # torch.nn.utils.clip_grad_norm_'s factor, times g
    clipped = next(v for k, v in got.items() if k.startswith("W_grad"))
    np.testing.assert_allclose(clipped.astype(np.float32), want, rtol=2e-3)


@pytest.mark.parametrize("et", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_mixed_precision_needs_float32_weights(et: int) -> None:
    """A half model has no float32 master to keep: refused naming the weights (it trained its half weights
    on loss-scaled half gradients, skipping most first steps), as generate_artifacts refuses it."""
    m, _ = linear_model(et, opset=22)
    match = r"trains float32 master weights; trained weight\(s\) \['W', 'b'\] are"
    with pytest.raises(ValueError, match=match):
        TrainingSession(m.SerializeToString(), params("AdamOptimizer", use_mixed_precision=True))


def test_mixed_precision_keeps_training_float64_weights() -> None:
    """A float64 scale inside a float32 model still trains under mixed precision (only half weights lack a
    master), to the loss it reaches without it."""
    from tests.session.helpers import batches, mlp_model

    m = mlp_model()
    g = m.graph
    for n in g.node:
        if n.op_type == "Gemm" and n.input[0] == "hr":
            n.input[0] = "hr2"
    scaled = [helper.make_node("Cast", ["hr"], ["hrd"], to=TensorProto.DOUBLE),
              helper.make_node("Mul", ["hrd", "s"], ["hs"]),
              helper.make_node("Cast", ["hs"], ["hr2"], to=TensorProto.FLOAT)]
    nodes = list(g.node)
    del g.node[:]
    g.node.extend([*nodes[:2], *scaled, *nodes[2:]])
    g.initializer.append(numpy_helper.from_array(np.full(16, 1.5, np.float64), "s"))
    x, y = batches(1, 16)[0]
    losses = []
    for mp in (True, False):
        sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer", use_mixed_precision=mp))
        feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32)}
        if mp:
            feeds["loss_scale"] = np.array([1024.0], np.float32)
        for _ in range(3):
            loss = sess.run(["loss"], feeds)[0]
        assert sess.get_state()["s"].dtype == np.float64
        losses.append(float(loss))
    assert losses[0] == pytest.approx(losses[1], rel=1e-2)



@pytest.mark.parametrize(("et", "backend"), [(TensorProto.FLOAT16, "numpy"), (TensorProto.BFLOAT16, "numpy"),
                                             (TensorProto.FLOAT16, "onnxruntime")])  # (no bfloat16 Mul there)
def test_accumulation_of_half_gradients_sums_in_float32(et: int, backend: str) -> None:
    """onnxruntime-training's accumulation buffers are float32 whatever the gradient's type (spec §8.3): each
    micro-step's half gradient is added to a float32 sum, and the sum times 1/N is cast back to the half type
    for the update. Oracle: numpy's float32 sum of the micro-steps' own gradients (fetched as outputs) and
    SGD's rule on its mean. The last micro-step's gradients cancel the first's, and the middle one's are
    2^-8 of theirs: a sum kept in the half type loses up to a tenth of what remains."""
    from onnxtrain import SessionOptions

    m, ws = linear_model(et)
    rng = np.random.default_rng(4)
    half = NP[et]
    x1, x2 = (rng.standard_normal((4, 4)).astype(np.float32).astype(half) for _ in range(2))
    y1, y2 = ((rng.standard_normal((4, 3)) * s).astype(np.float32).astype(half) for s in (1.0, 1 / 256))
    xs, ys = [x1, x2, x1], [y1, y2, -y1]  # the first and last gradients cancel
    lr = np.array([100.0], np.float32)  # the mean is about 1e-3: a step the weights' rounding keeps
    p = params("SGDOptimizer", gradient_accumulation_steps=3, gradient_accumulation_mode="auto",
               set_gradients_as_graph_outputs=True)
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    sess = TrainingSession(m.SerializeToString(), p, so)
    sums = {k: np.zeros(v.shape, np.float32) for k, v in ws.items()}
    for x, y in zip(xs, ys):
        grads = dict(zip(ws, sess.run(["W_grad", "b_grad"], {"x": x, "y": y, "Learning_Rate": lr})))
        for k in ws:
            assert grads[k].dtype == half
            sums[k] += grads[k].astype(np.float32)
    state = sess.get_state()
    for k, w in ws.items():
        mean = (sums[k] * np.float32(1 / 3)).astype(half)
        # SGD on a half weight: w − lr·mean in float32, rounded once (onnxruntime's SGD kernel widens)
        want = (w.astype(np.float32) - lr[0] * mean.astype(np.float32)).astype(half)
        if backend == "numpy":
            np.testing.assert_array_equal(state[k].astype(np.float32), want.astype(np.float32), err_msg=k)
        else:  # onnxruntime computes half ops in float32 and drops casts between them: the gradients it
            # sums are not rounded to float16 (those it returns are): one ulp of the weight and of the step
            step = np.abs(lr[0] * mean.astype(np.float32))
            bound = np.spacing(np.abs(want)).astype(np.float32) + step * 2.0**-10
            np.testing.assert_array_less(np.abs(state[k].astype(np.float32) - want.astype(np.float32)),
                                         bound * 1.01, err_msg=k)

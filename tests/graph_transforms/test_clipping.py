"""Gradient-norm clipping in the loss-scaled domain (spec §10) against torch.nn.utils.clip_grad_norm_."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model
from onnxtrain.graph_transforms.clipping import global_norm
from onnxtrain.graph_transforms.mixed_precision import mixed_precision_update
from onnxtrain.ir.builder import NameGen, NodeWriter
from onnxtrain.optim import WeightSlot, get_optimizer

torch = pytest.importorskip("torch")

SHAPES = {"w": (5, 3), "b": (3,)}


def _update_graph(opt_name: str, max_norm: float) -> tuple[onnx.ModelProto, dict[str, np.ndarray],
                                                          dict[str, str]]:
    """Weights, loss-scaled gradients <w>_grad, loss_scale, lr and state in; norm, flag, new values out."""
    nodes: list[onnx.NodeProto] = []
    w = NodeWriter(NameGen(["loss_scale", "lr", *SHAPES, *(f"{k}_grad" for k in SHAPES)]), nodes)
    opt = get_optimizer(opt_name)
    slots = [WeightSlot(k, f"{k}_grad", s, TensorProto.FLOAT) for k, s in SHAPES.items()]
    specs = opt.state(slots)
    norm = global_norm(w, [s.grad for s in slots])
    new_w, new_s, flag = mixed_precision_update(w, opt, slots, "lr", {sp.name: sp.name for sp in specs}, norm,
                                                "loss_scale", {k: max_norm for k in SHAPES})
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(s)) for k, s in SHAPES.items()
              for n in (k, f"{k}_grad")]
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1]) for n in ("loss_scale", "lr")]
    inputs += [helper.make_tensor_value_info(sp.name, helper.np_dtype_to_tensor_dtype(sp.initial.dtype),
                                             list(sp.initial.shape)) for sp in specs]
    outs = {"norm": norm, "flag": flag, **{k: new_w[k] for k in SHAPES}}
    outputs = [helper.make_tensor_value_info(norm, TensorProto.FLOAT, []),
               helper.make_tensor_value_info(flag, TensorProto.BOOL, [])]
    outputs += [helper.make_tensor_value_info(new_w[k], TensorProto.FLOAT, list(s))
                for k, s in SHAPES.items()]
    model = helper.make_model(helper.make_graph(nodes, "update", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model, {sp.name: sp.initial for sp in specs}, outs


@pytest.mark.parametrize("opt_name", ["AdamOptimizer", "SGDOptimizer"])
@pytest.mark.parametrize("grad_size", [0.05, 10.0])  # below / above max_norm
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0])
def test_clipping_matches_torch(opt_name: str, grad_size: float, loss_scale: float) -> None:
    rng = np.random.default_rng(3)
    weights = {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}
    grads = {k: (rng.standard_normal(s) * grad_size).astype(np.float32) for k, s in SHAPES.items()}
    max_norm, lr = 1.0, 0.1
    model, state, outs = _update_graph(opt_name, max_norm)
    feeds = {**weights, **{f"{k}_grad": g * np.float32(loss_scale) for k, g in grads.items()},
             "loss_scale": np.array([loss_scale], np.float32), "lr": np.array([lr], np.float32), **state}
    res = dict(zip(outs, compile_model(model).run(feeds, list(outs.values()))))
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for k, v in zip(outs, sess.run(list(outs.values()), feeds)):
        np.testing.assert_allclose(v, res[k], rtol=1e-5, atol=1e-6)
    params = [torch.nn.Parameter(torch.from_numpy(weights[k].copy())) for k in SHAPES]
    for p, k in zip(params, SHAPES):
        p.grad = torch.from_numpy(grads[k].copy())
    total = float(np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in grads.values())))
    # the global norm is reported in the loss-scaled domain
    np.testing.assert_allclose(float(res["norm"]), total * loss_scale, rtol=1e-6)
    assert bool(res["flag"])
    if opt_name == "AdamOptimizer":
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        torch.optim.Adam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8).step()
    else:
        # SGD never clips (spec §10); under loss scaling it still divides by the scale
        torch.optim.SGD(params, lr=lr).step()
    for p, k in zip(params, SHAPES):
        np.testing.assert_allclose(res[k], p.detach().numpy(), rtol=1e-6, atol=1e-6)

"""A trained weight of no dimensions (a scalar gain) keeps its empty shape through every optimizer's update
and trains as torch trains it; the step graphs pass onnx.checker (the update once broadcast it to [1])."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession
from tests.session.helpers import batches, mlp_model

torch = pytest.importorskip("torch")


def gain_model() -> onnx.ModelProto:
    """``mlp_model`` whose logits are scaled by a trained scalar ``s``."""
    m = mlp_model()
    g = m.graph
    g.node[2].output[0] = "z"
    g.node.insert(3, helper.make_node("Mul", ["z", "s"], ["logits"]))
    g.initializer.append(numpy_helper.from_array(np.float32(0.9), "s"))
    return m


def torch_run(model: onnx.ModelProto, opt_name: str, steps: list, lr: float) -> tuple[list[float], dict]:
    w = {t.name: torch.tensor(numpy_helper.to_array(t), requires_grad=True) for t in model.graph.initializer}
    params = list(w.values())
    opt = (torch.optim.SGD(params, lr=lr) if opt_name == "SGDOptimizer"
           else torch.optim.AdamW(params, lr=lr, eps=1e-8, weight_decay=0.0))
    losses = []
    for x, y in steps:
        opt.zero_grad()
        h = torch.relu(torch.from_numpy(x) @ w["W1"].T + w["b1"])
        logits = (h @ w["W2"].T + w["b2"]) * w["s"]
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(y))
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().numpy() for k, v in w.items()}


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_scalar_weight_keeps_its_shape_and_trains_as_torch(opt: str, accumulation: int) -> None:
    model = gain_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.enable_grad_norm_clip = False
    p.gradient_accumulation_steps = accumulation
    p.gradient_accumulation_mode = "auto"
    if opt == "AdamOptimizer":  # torch's AdamW without decay: mode 1, bias correction on
        names = [t.name for t in model.graph.initializer]
        p.optimizer_attributes_map = {n: {"lambda": 0.0, "epsilon": 1e-8} for n in names}
        p.optimizer_int_attributes_map = {n: {"weight_decay_mode": 1} for n in names}
    sess = TrainingSession(model.SerializeToString(), p)
    for g in (sess._graphs.full, sess._graphs.update_graph, sess._graphs.accumulate):
        if g is not None:
            onnx.checker.check_model(g, full_check=True)
    steps = batches(4, 8)
    lr = np.array([0.05], np.float32)
    for x, y in steps:
        for xs, ys in zip(np.split(x, accumulation), np.split(y, accumulation)):
            sess.run(["loss"], {"x": xs, "y": ys, "Learning_Rate": lr})
    state = sess.get_state()
    assert state["s"].shape == () and all(v.shape == () for k, v in state.items() if k.startswith("Moment_")
                                          and k.endswith("_s"))
    _, expected = torch_run(model, opt, steps, 0.05)
    # Adam's steps are ±lr wherever a gradient is tiny, which float32 rounding then decides: looser there
    atol = 1e-4 if opt == "AdamOptimizer" else 2e-6
    for name, value in expected.items():
        np.testing.assert_allclose(state[name], value, rtol=2e-5, atol=atol, err_msg=name)

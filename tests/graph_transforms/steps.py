"""A training step graph built the way the session wires the transforms (weights and optimizer state as
graph inputs, new values as outputs), and a loop that runs it on the engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.graph_transforms.clipping import clip_divisor, global_norm
from onnxtrain.graph_transforms.loss_scaler import LossScaler
from onnxtrain.graph_transforms.mixed_precision import (
    mixed_precision,
    mixed_precision_info,
    mixed_precision_update,
)
from onnxtrain.ir.builder import NameGen, NodeWriter
from onnxtrain.optim import WeightSlot, get_optimizer

LR = "Learning_Rate"


@dataclass
class Step:
    model: onnx.ModelProto
    state: dict[str, np.ndarray]
    updates: dict[str, str]  # state name → output with its new value
    outputs: list[str] = field(default_factory=list)
    loss_scale: str | None = None


def make_step(model: onnx.ModelProto, weights: list[str], opt_name: str = "AdamOptimizer",
              dtype: str | None = None, max_norm: float | None = None,
              transform: Callable[[onnx.ModelProto, str], onnx.ModelProto] | None = None) -> Step:
    """Forward + backward + update of ``weights``; ``dtype`` turns mixed precision on; ``transform`` is
    applied to the gradient graph (e.g. a recompute pass)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    state: dict[str, np.ndarray] = {}
    keep = []
    for t in m.graph.initializer:
        if t.name in weights:
            state[t.name] = numpy_helper.to_array(t).copy()
            m.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    loss = "loss"
    if dtype is not None:
        m = mixed_precision(m, "loss", dtype)
        loss = mixed_precision_info(m).scaled_loss
    grad = build_gradient_model(m, loss, weights, outputs=["loss"])
    if transform is not None:
        grad = transform(grad, loss)
    nodes = list(grad.graph.node)
    w = NodeWriter(NameGen.for_model(grad), nodes)
    opt = get_optimizer(opt_name)
    slots = [WeightSlot(n, f"{n}_grad", state[n].shape, TensorProto.FLOAT) for n in weights]
    specs = opt.state(slots)
    inputs = list(grad.graph.input) + [helper.make_tensor_value_info(LR, TensorProto.FLOAT, [1])]
    for sp in specs:
        state[sp.name] = sp.initial.copy()
        et = helper.np_dtype_to_tensor_dtype(sp.initial.dtype)
        inputs.append(helper.make_tensor_value_info(sp.name, et, list(sp.initial.shape)))
    norm = global_norm(w, [s.grad for s in slots])
    outs = ["loss", norm]
    if dtype is not None:
        clip = {s.name: max_norm for s in slots} if max_norm is not None else None
        new_w, new_s, flag = mixed_precision_update(w, opt, slots, LR, {sp.name: sp.name for sp in specs},
                                                    norm, "loss_scale", clip)
        outs.append(flag)
    else:
        if max_norm is not None and opt.uses_norm:
            for s in slots:
                s.divisor = clip_divisor(w, norm, max_norm)
        new_w, new_s = opt.emit(w, slots, LR, {sp.name: sp.name for sp in specs})
    updates = {**new_w, **new_s}
    out_vi = [helper.make_tensor_value_info(o, TensorProto.FLOAT, []) for o in outs[:2]]
    if len(outs) > 2:
        out_vi.append(helper.make_tensor_value_info(outs[2], TensorProto.BOOL, []))
    for k, o in updates.items():
        out_vi.append(helper.make_tensor_value_info(o, helper.np_dtype_to_tensor_dtype(state[k].dtype),
                                                    list(state[k].shape)))
    g = helper.make_graph(nodes, "step", inputs, out_vi, initializer=list(grad.graph.initializer))
    step = helper.make_model(g, opset_imports=list(grad.opset_import), ir_version=grad.ir_version)
    return Step(step, state, updates, outs, "loss_scale" if dtype is not None else None)


def train(step: Step, batches: list[dict[str, np.ndarray]], lr: float, scaler: LossScaler | None = None,
          ) -> tuple[list[float], list[bool], dict[str, np.ndarray]]:
    """Run the step on each batch; returns the losses, the finite flags and the final state."""
    plan = compile_model(step.model)
    state = dict(step.state)
    names = step.outputs + list(step.updates.values())
    losses, flags = [], []
    for b in batches:
        feeds = {**b, LR: np.array([lr], np.float32), **state}
        if step.loss_scale is not None:
            feeds[step.loss_scale] = scaler.feed()
        res = dict(zip(names, plan.run(feeds, names)))
        losses.append(float(res["loss"]))
        finite = bool(res[step.outputs[2]]) if len(step.outputs) > 2 else True
        flags.append(finite)
        if scaler is not None:
            scaler.update_loss_scale(finite)
        for k, o in step.updates.items():
            state[k] = res[o]
    return losses, flags, state

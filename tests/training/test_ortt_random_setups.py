"""Seeded random on-device training setups, run both ways against onnxruntime-training 1.19.2.

Each seed draws a small model (an optional embedding Gather of int64 indices, MatMul or Gemm layers,
optionally a BatchNormalization, in training mode or not, and a Dropout of ratio 0; initializers named
short, torch-like or path-like, in a shuffled order), a
loss (the four built-in ones through LossType or onnxblock blocks with other reductions, ignore_index,
BCE weights; a built-in loss picked by loss_input_names; two custom onnxblock losses; a loss the model
computes itself, loss=None), which initializers train, stay frozen or stay constants, an optimizer (AdamW
with or without weight decay, bias correction and gradient clipping, SGD), a LinearLRScheduler from the start,
made later or none, additional outputs, a nominal checkpoint, and a sequence of API calls: train and eval
calls, gradients accumulated over several calls, lazy_reset_grad (and updates that re-apply the old
gradients), optimizer steps, learning-rate changes, get_contiguous_parameters / copy_buffer_to_parameters
with trainable_only either way, state.parameters assignments, properties, and a save-and-reload of the state.

One driver (``_DRIVER``, the same source in both processes) makes the calls on either implementation, and
the runs compared are:

* onnxruntime-training's artifacts, run by onnxtrain and by onnxruntime-training;
* the setup generated and run by onnxtrain against it generated and run by onnxruntime-training;
* onnxtrain's artifacts (IR lowered to 10) in onnxruntime-training's Module, for the calls that need no
  optimizer: onnxruntime-training cannot train them (its Optimizer refuses onnxtrain's standard-ONNX
  optimizer model and its Module does not take the gradients the training model outputs; README,
  "Differences from onnxruntime-training");
* a checkpoint with optimizer state saved by either side, continued by the other.

Every recorded value (losses, additional and eval outputs, gradients, contiguous buffers, learning rates,
input/output/parameter names), the final parameters, the saved checkpoint (parameters, properties, step,
moments) and the outputs of the exported inference model (run by onnxruntime) must agree within float32
tolerance. Three seeds run by default (about 10 s); the full suite (tests/tiers.py) runs 40.

Left out, as the two cannot agree there: an inference-mode Dropout (onnxruntime-training scales its
gradient by 1 / (1 - ratio), and fails to build it without the mask output); a bias right before a
BatchNormalization (its gradient is zero but for rounding, which AdamW turns into steps of lr); a batch
whose labels are all ignore_index (a NaN loss in onnxtrain as in ONNX and onnxruntime 1.32, 0 in
onnxruntime-training; README).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ortt import PREAMBLE, ensure_ortt, run_script
from tests.tiers import extended

DEFAULT_SEEDS = [0, 1, 2]
# seeds drawn again at a lower opset ("seed@opset"): embedding, cross-entropy, BatchNorm and MaxPool, whose
# gradients in onnxruntime-training's artifacts (GatherGrad, SoftmaxCrossEntropyLossGrad, BatchNormInternal,
# MaxPoolGrad) have standard forms of later opsets (ScatterND/ScatterElements that add: 16; training_mode: 14)
OPSET_CASES = ["4@13", "283@15", "16@13"]
SEEDS = DEFAULT_SEEDS + OPSET_CASES + [extended(s, id=str(s)) for s in range(3, 40)]
ATOL, RTOL = 2e-5, 1e-4
VOCAB = 6  # rows of the embedding table


# ---------------------------------------------------------------- the random setup
def setup_of(case: int | str) -> dict:
    """The setup of a seed, or of a "seed@opset" case: the seed's setup with the model at that opset."""
    if isinstance(case, int):
        return make_setup(case)
    seed, opset = (int(v) for v in case.split("@"))
    s = make_setup(seed)
    s["opset"] = opset
    return s


def make_setup(seed: int) -> dict:
    """A JSON description of one setup: model, loss, parameters, optimizer, scheduler and the call plan."""
    rng = np.random.default_rng(seed)
    pick = lambda xs: xs[int(rng.integers(len(xs)))]  # noqa: E731
    s: dict = {"seed": seed, "F": int(rng.integers(3, 6)), "H": int(rng.integers(3, 7)),
               "C": int(rng.integers(2, 5)), "N": int(rng.integers(3, 7))}
    s["gemm"] = bool(rng.random() < 0.4)
    s["embed"] = bool(rng.random() < 0.25)  # x: int64 indices into an embedding table E (Gather)
    s["opset"] = pick([13, 15, 17, 17, 18, 19, 21])
    # x: images [N, 1, 6, 6] through Conv (W1, b1), the activation, MaxPool 2x2 and Flatten: hidden [N, 4H]
    s["conv"] = bool(not s["embed"] and rng.random() < 0.25)
    s["bn"] = bool(rng.random() < 0.4)
    # a training-mode BatchNormalization (running statistics as outputs): onnxruntime-training 1.19.2 fails to
    # load the eval model its generator writes for it, so its artifacts run without (it loads onnxtrain's)
    s["bn_training"] = bool(s["bn"] and rng.random() < 0.3 and s["opset"] >= 14)
    s["eval_model"] = not s["bn_training"]
    # Dropout of ratio 0 in training mode, the identity (the two runtimes' random masks differ). Not one in
    # inference mode (training_mode false or left out): onnxruntime-training 1.19.2 scales its gradient by
    # 1 / (1 - ratio) although the forward is the identity (onnxtrain passes it through, as ONNX defines)
    s["dropout"] = pick([None, None, "ratio0"])
    s["act"] = pick(["Relu", "Tanh", "Sigmoid"])
    # "custom", "custom2": onnxblock losses of both model outputs; "model": the model computes its loss
    # (loss=None)
    loss = pick(["MSELoss", "CrossEntropyLoss", "CrossEntropyLoss", "BCEWithLogitsLoss", "L1Loss", "custom",
                 "custom2", "model"])
    s["loss"] = loss
    builtin = loss not in ("custom", "custom2", "model")
    s["reduction"] = pick(["mean", "mean", "sum"]) if builtin else "mean"
    s["ignore_index"] = pick([None, -1, 1]) if loss == "CrossEntropyLoss" else None
    s["bce_weights"] = None
    if loss == "BCEWithLogitsLoss" and rng.random() < 0.5:  # weight, pos_weight (per class, or None)
        s["bce_weights"] = [rng.uniform(0.5, 2, s["C"]).round(3).tolist() if rng.random() < 0.6 else None
                            for _ in range(2)]
    s["block"] = bool(s["reduction"] != "mean" or s["ignore_index"] is not None or s["bce_weights"]
                      or rng.random() < 0.3)
    # no bias before a BatchNormalization: its gradient is zero but for rounding, which AdamW scales up
    floats = ["W1", "W2", "b2"] + (["gamma", "beta"] if s["bn"] else ["b1"]) + (["E"] if s["embed"] else [])
    stats = ["mean", "var"] if s["bn"] else []
    order = floats + stats
    rng.shuffle(order)
    order = [str(n) for n in order]
    trainable = [n for n in floats if rng.random() < 0.7] or [pick(floats)]
    rest = [n for n in floats if n not in trainable]
    frozen = [n for n in rest if rng.random() < 0.5] + [n for n in stats if rng.random() < 0.5]
    # the initializers' names: short ones, torch's module paths, or exporter-like paths
    style = pick(["short", "torch", "path"])
    torch_names = {"W1": "fc1.weight", "b1": "fc1.bias", "W2": "fc2.weight", "b2": "fc2.bias",
                   "gamma": "bn.weight", "beta": "bn.bias", "mean": "bn.running_mean",
                   "var": "bn.running_var", "E": "emb.weight"}
    s["names"] = {n: {"short": n, "torch": torch_names[n], "path": f"/enc/{n}:0"}[style] for n in order}
    s["order"] = [s["names"][n] for n in order]
    s["trainable"] = [s["names"][n] for n in order if n in trainable]
    s["frozen"] = [s["names"][n] for n in order if n in frozen]
    # as listed to generate_artifacts: in any order (the artifacts keep the initializers' order)
    s["requires_grad"] = [str(n) for n in rng.permutation(s["trainable"])]
    s["frozen_params"] = [str(n) for n in rng.permutation(s["frozen"])]
    # a built-in loss of a two-output model takes the one loss_input_names says
    s["loss_input_names"] = ["output"] if builtin and rng.random() < 0.2 else None
    two = ["output", "hidden"]
    s["outputs"] = {"custom": two, "custom2": two, "model": ["loss", "output"]}.get(
        loss, ["output", "hidden"] if s["loss_input_names"] else ["output"])
    extra = [n for n in ("hidden", "h1", "output") if n not in s["outputs"] and rng.random() < 0.3]
    s["extra"] = extra
    s["nominal"] = bool(rng.random() < 0.3)
    opt = pick(["AdamW", "AdamW_wd", "SGD"])
    s["optimizer"] = opt
    s["clip"] = float(pick([0.5, 5.0])) if opt != "AdamW" and rng.random() < 0.3 else None
    s["bias_correction"] = bool(rng.random() < 0.7)
    s["lr"] = float(pick([0.01, 0.05])) if opt == "SGD" else float(pick([0.001, 0.01]))
    if opt == "SGD" and s["reduction"] == "sum":  # a summed loss at SGD's rates can diverge, where the two
        s["lr"] /= 5                              # sides' rounding grows without bound
    warmup = int(rng.integers(0, 4))
    s["scheduler"] = [warmup, warmup + int(rng.integers(1, 8)), s["lr"] * 2]
    s["scheduled"] = pick(["start", "start", "later", None, None])
    s["plan"] = _plan(rng, s)
    s["continuation"] = []
    for i in range(int(rng.integers(2, 4))):
        s["continuation"] += [["train", i], ["step"], ["reset"]]
    s["continuation"] += [["contig", False], ["grads"], ["eval", 3]]
    s["batch_sizes"] = [s["N"] + int(rng.integers(0, 3)) for _ in range(4)]
    return s


def _plan(rng: np.random.Generator, s: dict) -> list:
    """The calls: updates of 1-3 accumulated train calls, with eval calls, resets and buffer copies."""
    plan: list = [["eval", 1]] if rng.random() < 0.2 else []
    if rng.random() < 0.1:  # an update before any gradient
        plan.append(["step"])
    params = s["trainable"] + s["frozen"]
    scheduled = s["scheduled"] == "start"
    batch = 0
    for _ in range(int(rng.integers(3, 7))):
        for _ in range(int(rng.integers(1, 4))):
            plan.append(["train", batch % 4])
            batch += 1
            if rng.random() < 0.2:
                plan.append(["eval", int(rng.integers(4))])
        if rng.random() < 0.3:
            plan.append(["grads"])
        plan.append(["step"])
        if rng.random() < 0.15:  # (after a clipping optimizer: the clipped ones)
            plan.append(["grads"])
        if rng.random() < 0.85:  # else the next update adds to the old gradients
            plan.append(["reset"])
            if rng.random() < 0.15:
                plan.append(["reset"])
            if rng.random() < 0.1:  # the gradients are still there: the update is made again
                plan.append(["step"])
        if rng.random() < 0.2:  # a scheduler's next step overrides it
            plan.append(["lr", float(rng.choice([0.0, s["lr"] / 2, s["lr"] * 3]))])
        if not scheduled and s["scheduled"] == "later" and rng.random() < 0.4:
            plan.append(["new_scheduler"])
            scheduled = True
        if scheduled:
            plan.append(["sched"])
        if rng.random() < 0.1:
            plan.append(["resume"])
        if rng.random() < 0.2:
            plan.append(["copy", bool(rng.random() < 0.5), int(rng.integers(1 << 30))])
        if rng.random() < 0.2:
            plan.append(["contig", bool(rng.random() < 0.5)])
        if rng.random() < 0.15:
            plan.append(["set", params[int(rng.integers(len(params)))], int(rng.integers(1 << 30))])
        if rng.random() < 0.15:
            value = [int(rng.integers(-5, 100)), float(rng.uniform(-1, 1)), f"tag{int(rng.integers(9))}"]
            plan.append(["property", f"p{int(rng.integers(3))}", value[int(rng.integers(3))]])
    if rng.random() < 0.5:
        plan.append(["eval", 0])
    if s["scheduled"] == "later" and not scheduled:
        plan.append(["new_scheduler"])
    return plan


def base_model(s: dict) -> onnx.ModelProto:
    """The forward model of setup ``s``: input ``x`` → ``output`` [N, C] (and ``hidden`` [N, H or 4H])."""
    rng = np.random.default_rng(s["seed"] + 1000)
    F, H, C = s["F"], s["H"], s["C"]
    w1 = (H, 1, 3, 3) if s["conv"] else (H, F) if s["gemm"] else (F, H)
    shapes = {"W1": w1, "b1": (H,), "W2": (hidden_size(s), C), "b2": (C,),
              "gamma": (H,), "beta": (H,), "mean": (H,), "var": (H,), "E": (VOCAB, F)}
    values = {n: rng.standard_normal(shapes[n]).astype(np.float32) * 0.7 for n in shapes}
    values["var"] = rng.uniform(0.5, 2.0, H).astype(np.float32)
    values["gamma"] = rng.uniform(0.5, 1.5, H).astype(np.float32)
    if s["loss"] == "BCEWithLogitsLoss":  # moderate logits: onnxruntime-training's float32 BCE loses digits
        values["W2"] *= 0.2                # past |x| ~ 10 (1e-3 at 15; onnxtrain's form keeps them)
    nodes = []
    bias = [] if s["bn"] else ["b1"]
    x = "x"
    if s["embed"]:
        nodes.append(helper.make_node("Gather", ["E", "x"], ["xe"], name="embed"))
        x = "xe"
    if s["conv"]:
        nodes.append(helper.make_node("Conv", [x, "W1", *bias], ["h1"], kernel_shape=[3, 3], name="conv"))
    elif s["gemm"]:
        nodes.append(helper.make_node("Gemm", [x, "W1", *bias], ["h1"], transB=1, name="fc1"))
    elif bias:
        nodes += [helper.make_node("MatMul", [x, "W1"], ["xw"], name="mm1"),
                  helper.make_node("Add", ["xw", "b1"], ["h1"], name="add1")]
    else:
        nodes.append(helper.make_node("MatMul", [x, "W1"], ["h1"], name="mm1"))
    pre = "h1"
    if s["bn"]:
        outs = ["bn", "bn_mean", "bn_var"] if s["bn_training"] else ["bn"]
        nodes.append(helper.make_node("BatchNormalization", ["h1", "gamma", "beta", "mean", "var"], outs,
                                      epsilon=1e-5, momentum=0.9, name="bn"))
        if s["bn_training"]:
            nodes[-1].attribute.append(helper.make_attribute("training_mode", 1))
        pre = "bn"
    if s["conv"]:
        nodes += [helper.make_node(s["act"], [pre], ["activated"], name="act"),
                  helper.make_node("MaxPool", ["activated"], ["pooled"], kernel_shape=[2, 2], strides=[2, 2],
                                   name="pool"),
                  helper.make_node("Flatten", ["pooled"], ["hidden"], name="flatten")]
    else:
        nodes.append(helper.make_node(s["act"], [pre], ["hidden"], name="act"))
    cur = "hidden"
    if s["dropout"]:
        const = numpy_helper.from_array
        nodes += [helper.make_node("Constant", [], ["ratio"], value=const(np.float32(0.0))),
                  helper.make_node("Constant", [], ["mode"], value=const(np.bool_(True))),
                  helper.make_node("Dropout", ["hidden", "ratio", "mode"], ["dropped"], name="drop")]
        cur = "dropped"
    nodes += [helper.make_node("MatMul", [cur, "W2"], ["hw"], name="mm2"),
              helper.make_node("Add", ["hw", "b2"], ["output"], name="add2")]
    short = {v: k for k, v in s["names"].items()}
    inits = [numpy_helper.from_array(values[short[n]], n) for n in s["order"]]
    for node in nodes:  # the initializers' names
        node.input[:] = [s["names"].get(i, i) for i in node.input]
    infos = {"output": helper.make_tensor_value_info("output", TensorProto.FLOAT, ["N", C]),
             "hidden": helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["N", hidden_size(s)]),
             "loss": helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])}
    shape = ["N", 1, 6, 6] if s["conv"] else ["N", F]
    ins = [helper.make_tensor_value_info("x", TensorProto.INT64, ["N"]) if s["embed"]
           else helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)]
    if s["loss"] == "model":  # the mean squared error to y
        ins.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C]))
        nodes += [helper.make_node("Sub", ["output", "y"], ["diff"], name="sub"),
                  helper.make_node("Mul", ["diff", "diff"], ["squared"], name="square"),
                  helper.make_node("ReduceMean", ["squared"], ["loss"], keepdims=0, name="mean_loss")]
    graph = helper.make_graph(nodes, f"random_{s['seed']}", ins, [infos[n] for n in s["outputs"]], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", s["opset"])])
    model.ir_version = 10
    onnx.checker.check_model(model, full_check=True)
    return model


def hidden_size(s: dict) -> int:
    """The features of ``hidden``: H, or 4H after the convolution's 2x2 pooled maps."""
    return 4 * s["H"] if s["conv"] else s["H"]


def _inputs(rng: np.random.Generator, s: dict, n: int) -> np.ndarray:
    """A batch of ``n`` model inputs: features, or indices into the embedding (repeats likely)."""
    if s["embed"]:
        return rng.integers(0, VOCAB, n).astype(np.int64)
    shape = (n, 1, 6, 6) if s["conv"] else (n, s["F"])
    return rng.standard_normal(shape).astype(np.float32)


def make_data(s: dict) -> dict[str, np.ndarray]:
    """Four batches of inputs and labels (``x{i}``, ``y{i}``, ``z{i}``), copy noise and an export batch."""
    rng = np.random.default_rng(s["seed"] + 2000)
    H, C = hidden_size(s), s["C"]
    data = {}
    for i, N in enumerate(s["batch_sizes"]):
        data[f"x{i}"] = _inputs(rng, s, N)
        if s["loss"] == "CrossEntropyLoss":
            y = rng.integers(0, C, N).astype(np.int64)
            if s["ignore_index"] is not None:
                y[rng.random(N) < 0.3] = s["ignore_index"]
                y[0] = (s["ignore_index"] + 1) % C  # never every label ignored
            data[f"y{i}"] = y
        elif s["loss"] == "BCEWithLogitsLoss":
            data[f"y{i}"] = (rng.random((N, C)) < 0.5).astype(np.float32)
        else:
            data[f"y{i}"] = rng.standard_normal((N, C)).astype(np.float32)
        if s["loss"] == "custom":
            data[f"z{i}"] = rng.uniform(0, 1, (N, H)).astype(np.float32)
    for op in s["plan"]:
        if op[0] in ("copy", "set"):
            data[f"noise{op[2]}"] = np.random.default_rng(op[2]).uniform(-1, 1, 200).astype(np.float32)
    data["export_x"] = _inputs(rng, s, s["N"] + 1)
    data["export_y"] = rng.standard_normal((s["N"] + 1, C)).astype(np.float32)
    return data


# ---------------------------------------------------------------- the driver, run in both processes
_DRIVER = r'''
import os
import numpy as np
import onnx


def make_loss(api, s):
    ob, kind = api.onnxblock, s["loss"]
    if kind == "custom":
        class TwoHeadLoss(ob.Block):
            """MSE of the output plus the summed L1 distance of the hidden activations."""

            def __init__(self):
                super().__init__()
                self.mse = ob.loss.MSELoss()
                self.l1 = ob.loss.L1Loss(reduction="sum")
                self.add = ob.blocks.Add()

            def build(self, out, hidden):
                return self.add(self.mse(out, "target_out"), self.l1(hidden, "target_hidden"))

        return TwoHeadLoss()
    if kind == "custom2":
        class RegularizedLoss(ob.Block):
            """Summed squared distance of the clipped sigmoid of the output, plus the mean |hidden|."""

            def __init__(self):
                super().__init__()
                self.sigmoid, self.clip = ob.blocks.Sigmoid(), ob.blocks.Clip(clip_min=0.1, clip_max=0.9)
                self.sub, self.pow = ob.blocks.Sub(), ob.blocks.Pow(2.0)
                self.sum = ob.blocks.ReduceSum(keepdims=False)
                self.abs, self.mean = ob.blocks.Abs(), ob.blocks.ReduceMean(keepdims=False)
                self.add = ob.blocks.Add()

            def build(self, out, hidden):
                target = ob.blocks.InputLike(out)("target")
                fit = self.sum(self.pow(self.sub(self.clip(self.sigmoid(out)), target)))
                return self.add(fit, self.mean(self.abs(hidden)))

        return RegularizedLoss()
    if kind == "model":
        return None
    if not s["block"]:
        return getattr(api.artifacts.LossType, kind)
    if kind == "CrossEntropyLoss":
        return ob.loss.CrossEntropyLoss(reduction=s["reduction"], ignore_index=s["ignore_index"])
    if kind == "BCEWithLogitsLoss" and s["bce_weights"]:
        weight, pos_weight = (None if w is None else np.array(w, np.float32) for w in s["bce_weights"])
        return ob.loss.BCEWithLogitsLoss(weight=weight, reduction=s["reduction"], pos_weight=pos_weight)
    return getattr(ob.loss, kind)(reduction=s["reduction"])


def make_optimizer(api, s):
    ob = api.onnxblock
    clip = None if s["clip"] is None else ob.optim.ClipGradNorm(s["clip"])
    if s["optimizer"] == "AdamW":
        return api.artifacts.OptimType.AdamW if clip is None else ob.optim.AdamW(clip_grad=clip)
    if s["optimizer"] == "AdamW_wd":
        return ob.optim.AdamW(bias_correction=s["bias_correction"], betas=(0.8, 0.95), eps=1e-5,
                              weight_decay=0.05, clip_grad=clip)
    return api.artifacts.OptimType.SGD if clip is None else ob.optim.SGD(clip_grad=clip)


def generate(api, s, base, folder):
    """The setup's artifacts, written to folder by api's generate_artifacts."""
    api.artifacts.generate_artifacts(
        onnx.load(base), requires_grad=s["requires_grad"], frozen_params=s["frozen_params"] or None,
        loss=make_loss(api, s), optimizer=make_optimizer(api, s), artifact_directory=folder,
        additional_output_names=s["extra"] or None, nominal_checkpoint=s["nominal"],
        loss_input_names=s["loss_input_names"])


def exported(s):
    """The outputs of the inference model: the model's own loss too when it has one."""
    return (["loss"] if s["loss"] == "model" else []) + ["output"] + s["extra"]


def feeds(s, data, i):
    out = [data[f"x{i}"]]
    if s["loss"] == "custom":
        return out + [data[f"y{i}"], data[f"z{i}"]]
    return out + [data[f"y{i}"]]


def listed(outs):
    return list(outs) if isinstance(outs, (list, tuple)) else [outs]


def names(rec, key, m, state):
    """The Module's user inputs and outputs (generated names as onnx::*), the parameters in the state's order
    with whether they train, the properties."""
    rec[f"{key}_inputs"] = np.array(m.input_names())
    rec[f"{key}_outputs"] = np.array(["onnx::*" if n.startswith("onnx::") else n for n in m.output_names()])
    rec[f"{key}_params"] = np.array([f"{n}:{p.requires_grad}" for n, p in state.parameters] or [""])
    rec[f"{key}_properties"] = np.array([f"{n}={v!r}" for n, v in state.properties
                                         if not n.startswith("onnxtrain.")] or [""])


def train(api, s, folder, data, out, optimizer=True, checkpoint=None, evals=None):
    """Run the setup's calls on the artifacts in folder; the recorded values by key. Writes the final
    checkpoint (with the optimizer state) and the exported inference model into out. Without optimizer,
    only the calls that need none (train and eval calls, resets, parameter buffers). From a checkpoint
    (saved with its optimizer state), the setup's continuation instead. Without evals (default: whether
    onnxruntime-training loads its eval model of the setup), no eval model, eval calls or export."""
    evals = s["eval_model"] if evals is None else evals
    A = api
    rec = {}
    skipped = (() if optimizer else ("grads", "step", "sched", "lr", "new_scheduler"))
    skipped += () if evals else ("eval",)
    paths = {k: os.path.join(folder, k + ".onnx")
             for k in ("training_model", "eval_model", "optimizer_model")}
    plan = s["plan"] if checkpoint is None else s["continuation"]
    nominal = s["nominal"] and checkpoint is None
    state = A.CheckpointState.load_checkpoint(checkpoint or os.path.join(
        folder, "nominal_checkpoint" if nominal else "checkpoint"))
    eval_model = paths["eval_model"] if evals else None
    m = A.Module(paths["training_model"], state, eval_model)
    if nominal:  # the parameters from the full checkpoint, through a buffer
        full = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        other = A.Module(paths["training_model"], full)
        values = other.get_contiguous_parameters(False).numpy().copy()
        m.copy_buffer_to_parameters(A.buffer(values), False)
    # made after the parameters are loaded: onnxruntime-training 1.19.2 crashes (SIGSEGV) in
    # set_learning_rate on an Optimizer made over a nominal state before they were
    o = A.Optimizer(paths["optimizer_model"], m) if optimizer else None
    names(rec, "start", m, state)  # (onnxruntime-training lists no parameters of a nominal state)
    if evals:
        names(rec, "eval", m.eval(), state)
        m.train()
    sched = None
    if optimizer:
        if checkpoint is None:  # the default, 0.001
            rec["lr_default"] = np.float64(o.get_learning_rate())
        o.set_learning_rate(s["lr"])
        if s["scheduled"] == "start" and checkpoint is None:
            sched = A.scheduler(o, *s["scheduler"])
        rec["lr_start"] = np.float64(o.get_learning_rate())
    for k, op in enumerate(plan):
        what = op[0]
        if what in skipped:
            continue
        if what in ("train", "eval"):
            (m.train() if what == "train" else m.eval())
            for j, v in enumerate(listed(m(*feeds(s, data, op[1])))):
                rec[f"{k}_{what}_{j}"] = np.asarray(v)
        elif what == "grads":
            for name, p in state.parameters:
                if p.requires_grad:
                    rec[f"{k}_grad_{name}"] = np.asarray(p.grad).copy()
        elif what == "step":
            o.step()
        elif what == "reset":
            m.lazy_reset_grad()
        elif what == "new_scheduler":
            sched = A.scheduler(o, *s["scheduler"])
            rec[f"{k}_lr"] = np.float64(o.get_learning_rate())
        elif what == "sched":
            sched.step()
            rec[f"{k}_lr"] = np.float64(o.get_learning_rate())
        elif what == "lr":
            o.set_learning_rate(op[1])
        elif what == "copy":
            cur = m.get_contiguous_parameters(op[1]).numpy()
            noise = np.resize(data[f"noise{op[2]}"], cur.shape)
            m.copy_buffer_to_parameters(A.buffer(np.ascontiguousarray(cur * (1 + 0.05 * noise))), op[1])
        elif what == "set":
            p = state.parameters[op[1]]
            noise = np.resize(data[f"noise{op[2]}"], p.data.shape)
            state.parameters[op[1]] = np.ascontiguousarray(p.data * (1 + 0.05 * noise))
        elif what == "property":
            state.properties[op[1]] = op[2]
        elif what == "contig":
            rec[f"{k}_contig"] = m.get_contiguous_parameters(op[1]).numpy().copy()
            rec[f"{k}_size"] = np.int64(m.get_parameters_size(op[1]))
        elif what == "resume":  # saved with the optimizer state, then a new state, Module and Optimizer
            path = os.path.join(out, f"resume{k}")
            A.CheckpointState.save_checkpoint(state, path, optimizer)
            state = A.CheckpointState.load_checkpoint(path)
            m = A.Module(paths["training_model"], state, eval_model)
            names(rec, f"{k}_resumed", m, state)
            if optimizer:
                o = A.Optimizer(paths["optimizer_model"], m)
                # (onnxtrain restores the saved learning rate, onnxruntime-training its default)
                o.set_learning_rate(s["lr"])
                if sched is not None:
                    sched = A.scheduler(o, *s["scheduler"])
                    rec[f"{k}_lr"] = np.float64(o.get_learning_rate())
    for name, p in state.parameters:
        rec[f"final_{name}"] = np.asarray(p.data).copy()
    if optimizer:
        rec["lr_end"] = np.float64(o.get_learning_rate())
    A.CheckpointState.save_checkpoint(state, os.path.join(out, "final_checkpoint"), optimizer)
    if evals:
        m.export_model_for_inferencing(os.path.join(out, "inference.onnx"), exported(s))
    return rec
'''

_ORT_SCRIPT = PREAMBLE + _DRIVER + r'''
import types
from onnxruntime import OrtValue
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

api = types.SimpleNamespace(
    artifacts=artifacts, onnxblock=onnxblock, CheckpointState=CheckpointState, Module=Module,
    Optimizer=Optimizer,
    # its Python wrapper hands (warmup, total) to a binding that takes (total, warmup): swapped back here
    scheduler=lambda o, warmup, total, lr: LinearLRScheduler(o, total, warmup, lr),
    buffer=lambda a: OrtValue.ortvalue_from_numpy(a)._ortvalue)
with open(sys.argv[1]) as f:
    jobs = json.load(f)
done = {}
for job in jobs:
    s = job["setup"]
    data = dict(np.load(job["data"]))
    try:
        if job.get("generate"):
            generate(api, s, job["base"], job["folder"])
        rec = train(api, s, job["folder"], data, job["out"], job["optimizer"], job.get("checkpoint"),
                    job.get("evals"))
        np.savez(os.path.join(job["out"], "record.npz"), **rec)
        done[job["out"]] = None
    except Exception as e:  # reported per job, so one refusal does not hide the other jobs
        done[job["out"]] = f"{type(e).__name__}: {e}"
print(json.dumps(done))
'''


def _onnxtrain_api():
    import types

    from onnxtrain.training import artifacts, onnxblock
    from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    return types.SimpleNamespace(
        artifacts=artifacts, onnxblock=onnxblock, CheckpointState=CheckpointState, Module=Module,
        Optimizer=Optimizer, scheduler=lambda o, warmup, total, lr: LinearLRScheduler(o, warmup, total, lr),
        buffer=lambda a: a)


_NS: dict = {}
exec(compile(_DRIVER, "<driver>", "exec"), _NS)  # noqa: S102 - the same driver source onnxruntime-training runs


def _lowered_copy(src: str, dst: str) -> str:
    """A copy of the artifact folder with its models stamped IR 10 (onnxruntime 1.19 reads IR <= 10)."""
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".onnx"):
            model = onnx.load(os.path.join(dst, f))
            model.ir_version = min(model.ir_version, 10)
            onnx.save(model, os.path.join(dst, f))
    return dst


def _compare_records(ours: dict, theirs: dict, what: str) -> None:
    assert sorted(ours) == sorted(theirs), f"{what}: recorded keys differ"
    for k in theirs:
        a, b = np.asarray(ours[k]), np.asarray(theirs[k])
        assert a.shape == b.shape, f"{what} {k}: shape {a.shape} != {b.shape}"
        if b.dtype.kind == "U":
            assert a.tolist() == b.tolist(), f"{what} {k}"
            continue
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL, err_msg=f"{what} {k}")


def _compare_saved(ours_dir: str, theirs_dir: str, s: dict, data: dict, what: str) -> None:
    """The saved checkpoints (parameters, optimizer step, learning rate, moments) and the exported
    inference models' outputs (both run by onnxruntime) agree."""
    import onnxruntime as ort

    from onnxtrain.checkpoint import load_checkpoint

    a = load_checkpoint(os.path.join(ours_dir, "final_checkpoint"))
    b = load_checkpoint(os.path.join(theirs_dir, "final_checkpoint"))
    for kind in ("trainable", "frozen"):
        assert list(getattr(a, kind)) == list(getattr(b, kind)), f"{what}: {kind} parameters"
        for k, v in getattr(b, kind).items():
            np.testing.assert_allclose(getattr(a, kind)[k], v, atol=ATOL, rtol=RTOL, err_msg=f"{what} {k}")
    mine = {k: v for k, v in a.properties.items() if not k.startswith("onnxtrain.")}  # its reserved ones
    assert mine.keys() == b.properties.keys(), what
    for k, v in b.properties.items():
        assert type(mine[k]) is type(v) and (mine[k] == v or np.float32(mine[k]) == np.float32(v)), (what, k)
    assert len(a.optimizer_groups) == len(b.optimizer_groups), what
    for ga, gb in zip(a.optimizer_groups, b.optimizer_groups):
        assert (ga.step, np.float32(ga.initial_lr)) == (gb.step, np.float32(gb.initial_lr)), what
        assert sorted(ga.states) == sorted(gb.states), what
        for p, moments in gb.states.items():
            assert sorted(ga.states[p]) == sorted(moments), f"{what} {p}"
            for name, v in moments.items():
                np.testing.assert_allclose(ga.states[p][name], v, atol=ATOL, rtol=RTOL,
                                           err_msg=f"{what} {p}.{name}")
    exports = [os.path.exists(os.path.join(f, "inference.onnx")) for f in (ours_dir, theirs_dir)]
    assert exports[0] == exports[1], what
    if not exports[0]:
        return
    outs = []
    for folder in (ours_dir, theirs_dir):
        sess = ort.InferenceSession(os.path.join(folder, "inference.onnx"),
                                    providers=["CPUExecutionProvider"])
        feeds = {"x": data["export_x"], "y": data["export_y"]}
        assert [i.name for i in sess.get_inputs()] == list(feeds)[:1 + (s["loss"] == "model")], what
        outs.append(sess.run(_NS["exported"](s), {i.name: feeds[i.name] for i in sess.get_inputs()}))
    for x, y, name in zip(*outs, _NS["exported"](s)):
        np.testing.assert_allclose(x, y, atol=ATOL, rtol=RTOL, err_msg=f"{what} exported {name}")


@pytest.fixture(scope="module")
def ort_runs(tmp_path_factory) -> dict[int, tuple[str, dict]]:
    """For each seed its folder, holding ``ours`` (onnxtrain's artifacts), ``theirs`` (onnxruntime-training's)
    and onnxruntime-training's runs ``ort_on_ours`` (without optimizer) and ``ort_on_theirs``; and the
    errors of those runs by output folder."""
    python = ensure_ortt()
    from tests.tiers import full

    api = _onnxtrain_api()
    seeds = (list(range(40)) if full() else DEFAULT_SEEDS) + OPSET_CASES
    root = tmp_path_factory.mktemp("ortt_random")
    jobs, folders = [], {}
    for seed in seeds:
        s = setup_of(seed)
        d = root / str(seed)
        for sub in ("ours", "theirs", *OUTS):
            (d / sub).mkdir(parents=True)
        base = str(d / "base.onnx")
        onnx.save(base_model(s), base)
        np.savez(str(d / "data.npz"), **make_data(s))
        _NS["generate"](api, s, base, str(d / "ours"))
        lowered = _lowered_copy(str(d / "ours"), str(d / "ours_ir10"))
        common = {"setup": s, "data": str(d / "data.npz")}
        jobs.append({**common, "folder": lowered, "out": str(d / "ort_on_ours"), "optimizer": False,
                     "evals": True})
        jobs.append({**common, "folder": str(d / "theirs"), "base": base, "generate": True,
                     "out": str(d / "ort_on_theirs"), "optimizer": True})
        folders[seed] = str(d)
    with open(root / "jobs.json", "w") as f:
        json.dump(jobs, f)
    errors = run_script(_ORT_SCRIPT, str(root / "jobs.json"), timeout=1200, python=python)
    return {seed: (folders[seed], errors) for seed in seeds}


OUTS = ("ort_on_ours", "ort_on_theirs", "ot_on_ours", "ot_on_ours_forward", "ot_on_theirs")


def _check(ort_runs: dict, seed: int, artifacts: str, theirs: str, optimizer: bool) -> None:
    """onnxtrain's run of the seed's ``artifacts`` equals onnxruntime-training's run ``theirs``."""
    folder, errors = ort_runs[seed]
    theirs = os.path.join(folder, theirs)
    assert errors[theirs] is None, f"onnxruntime-training's run {theirs}: {errors[theirs]}"
    s = setup_of(seed)
    data = dict(np.load(os.path.join(folder, "data.npz")))
    out = os.path.join(folder, f"ot_on_{artifacts}" + ("" if optimizer else "_forward"))
    evals = True if not optimizer else None  # (onnxruntime-training loads onnxtrain's eval model)
    rec = _NS["train"](_onnxtrain_api(), s, os.path.join(folder, artifacts), data, out, optimizer,
                       evals=evals)
    what = f"seed {seed} ({os.path.basename(out)} vs {os.path.basename(theirs)})"
    _compare_records(rec, dict(np.load(os.path.join(theirs, "record.npz"))), what)
    _compare_saved(out, theirs, s, data, what)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_onnxruntime_training_artifacts_in_onnxtrain(ort_runs, seed):
    """onnxruntime-training's artifacts: onnxtrain's run of every call equals onnxruntime-training's."""
    _check(ort_runs, seed, "theirs", "ort_on_theirs", optimizer=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_both_generators_train_alike(ort_runs, seed):
    """The setup generated and run by onnxtrain equals it generated and run by onnxruntime-training."""
    _check(ort_runs, seed, "ours", "ort_on_theirs", optimizer=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_onnxtrain_artifacts_in_onnxruntime_training(ort_runs, seed):
    """onnxtrain's artifacts in onnxruntime-training's Module: the calls without an optimizer agree
    (its Optimizer refuses onnxtrain's standard-ONNX optimizer model, and its Module does not read
    gradients from the training model's outputs; README, differences from onnxruntime-training)."""
    _check(ort_runs, seed, "ours", "ort_on_ours", optimizer=False)


@pytest.fixture(scope="module")
def crossed_checkpoints(ort_runs) -> dict[int, tuple[str, dict]]:
    """For each seed, onnxruntime-training's artifacts continued from a checkpoint the other side saved
    (with the optimizer state) after the setup's calls: ``ort_from_ot`` continues onnxtrain's (saved
    training onnxruntime-training's artifacts), ``ort_from_ot_own`` onnxtrain's saved training its own
    artifacts, ``ort_from_ort`` its own; ``ot_from_ort`` is left to the test."""
    python = ensure_ortt()
    api = _onnxtrain_api()
    jobs = []
    for seed, (folder, errors) in ort_runs.items():
        if errors[os.path.join(folder, "ort_on_theirs")] is not None:
            continue
        s = setup_of(seed)
        data = dict(np.load(os.path.join(folder, "data.npz")))
        saved = {}
        for artifacts in ("theirs", "ours"):
            saved[artifacts] = os.path.join(folder, f"ot_saved_{artifacts}")
            os.makedirs(saved[artifacts])
            _NS["train"](api, s, os.path.join(folder, artifacts), data, saved[artifacts])
        common = {"setup": s, "data": os.path.join(folder, "data.npz"),
                  "folder": os.path.join(folder, "theirs"), "optimizer": True}
        for out, ckpt in (("ort_from_ot", saved["theirs"]), ("ort_from_ot_own", saved["ours"]),
                          ("ort_from_ort", os.path.join(folder, "ort_on_theirs"))):
            os.makedirs(os.path.join(folder, out))
            jobs.append({**common, "out": os.path.join(folder, out),
                         "checkpoint": os.path.join(ckpt, "final_checkpoint")})
    root = os.path.dirname(next(iter(ort_runs.values()))[0])
    with open(os.path.join(root, "resume_jobs.json"), "w") as f:
        json.dump(jobs, f)
    errors = run_script(_ORT_SCRIPT, os.path.join(root, "resume_jobs.json"), timeout=1200, python=python)
    return {seed: (folder, errors) for seed, (folder, _) in ort_runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_checkpoints_continue_on_the_other_side(crossed_checkpoints, seed):
    """A checkpoint with optimizer state saved by either side continues alike on both: onnxruntime-training
    (on its artifacts) from onnxtrain's checkpoints (saved training either side's artifacts), onnxtrain
    (on either side's artifacts) from onnxruntime-training's, as onnxruntime-training from its own."""
    folder, errors = crossed_checkpoints[seed]
    s = setup_of(seed)
    data = dict(np.load(os.path.join(folder, "data.npz")))
    runs = {}
    for out in ("ort_from_ot", "ort_from_ot_own", "ort_from_ort"):
        assert errors.get(os.path.join(folder, out), "not run") is None, errors.get(os.path.join(folder, out))
        runs[out] = dict(np.load(os.path.join(folder, out, "record.npz")))
    for out, artifacts in (("ot_from_ort", "theirs"), ("ot_own_from_ort", "ours")):
        os.makedirs(os.path.join(folder, out))
        runs[out] = _NS["train"](_onnxtrain_api(), s, os.path.join(folder, artifacts), data,
                                 os.path.join(folder, out),
                                 checkpoint=os.path.join(folder, "ort_on_theirs", "final_checkpoint"))
    for a in ("ot_from_ort", "ot_own_from_ort", "ort_from_ot", "ort_from_ot_own"):
        b = "ort_from_ort"
        what = f"seed {seed} ({a} vs {b})"
        _compare_records(runs[a], runs[b], what)
        _compare_saved(os.path.join(folder, a), os.path.join(folder, b), s, data, what)

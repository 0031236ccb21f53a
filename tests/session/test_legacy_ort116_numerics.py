"""onnxtrain's legacy ``TrainingSession`` against the real one, onnxruntime-training 1.16.3's, step by step.

Each case runs the same model, ``TrainingParameters`` and feeds in both (``tests/session/legacy_peer.py``;
all of 1.16.3's cases in one process of its venv) and compares, after every run, the fetched outputs (loss,
logits, ``global_gradient_norm``, ``<w>_grad``), ``get_state()`` (weights, moments, step counts) and
``get_optimizer_state()``, on the names 1.16.3 gives (onnxtrain's state also holds BatchNorm statistics).

Tolerance: rtol 1e-5, and atol 1e-6 times the array's largest magnitude. Both sides compute in float32 in
other orders (onnxruntime's MLAS kernels and its fused Adam kernel against numpy's BLAS and onnxtrain's Adam
written in ONNX ops), so each op's result may differ by an ulp or two (2^-23 = 1.2e-7 relative); a few steps
of these small models chain tens of such roundings, under 1e-5. A value near 0 that is a sum of larger terms
carries their rounding, not its own, hence the absolute part scaled by the array's magnitude. Parameters whose
true gradient is 0 (a conv bias before BatchNorm, the attention keys' bias) are left out of Adam cases: Adam
turns their float noise into full steps of either sign.

1.16.3's CPU build refuses (each recorded by a test, so the comparison can be added if that changes):
``LambOptimizer`` (no CPU kernel), ``gradient_accumulation_steps`` > 1 (Adam: no CPU kernel of the
MixedPrecisionScale that divides the sums by N; SGD: a float16 sum bound to SGDOptimizer, a type error) and
``use_mixed_precision`` (the same type error; Adam: an invalid graph). Those are checked against float64
references and torch in the other session tests. Its CPU Adam also ignores the global norm (no clipping, the
spec's §7.3): onnxtrain clips as the CUDA kernel did unless ``legacy_cpu_adam``, which the Adam cases set. Its
CPU BatchNormalization does not keep the running statistics it computes (each step starts from the model's);
onnxtrain keeps them, as torch and 1.16.3's CUDA kernel did (a test below).

1.16.3's faults found here, where onnxtrain keeps the right answer (torch's or float64's; README's legacy
section lists them):
* with its default session options it packs each Gemm weight once when the session is made (prepacking) and
  its NCHWc layout transform copies each Conv weight once: every later forward multiplies by the initial
  weights (the biases are the updated ones). It may also run a weight's in-place optimizer node before a
  backward node that still reads the weight (the order follows node names), so an earlier layer's gradient
  goes through the updated weight. The comparisons run it with prepacking off, the extended optimization
  level and the priority-based execution order (``legacy_peer.PEER_CONFIG``); three tests show the faults.
* its ConstantSharing renames every float initializer of at most 8 elements (a scalar or 1-D) to a shared
  ``ortshared_...`` constant before training is set up, trained ones included: a small bias in
  ``weights_to_train`` fails ("couldn't find the consumer node"), auto-discovery fails on the renamed one
  ("Failed to find attribute map"). The models here keep trained tensors above 8 elements.
* with ``use_fp16_moments`` its CPU Adam never stores the moments (zero after every step).
* a loss of more than one value: it seeds the backward with one value and reads N past it.
* at opsets before 11 it builds Gemm's gradient as a two-input Gemm, an invalid graph.
* a Dropout turned off by feeding ``training_mode`` False: its backward still divides by 1 − ratio.
* its LayerNormalization gradient reads the node's optional Mean and InvStdDev outputs, which torch's export
  does not name: the transformer cases name them (the same function).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from tests.ortt import ensure_ort_legacy
from tests.session.legacy_peer import Case, Step, Trace, run_cases

RTOL, ATOL = 1e-5, 1e-6
DIN, DH, DOUT, BATCH = 10, 16, 12, 6  # every trained tensor above 8 elements (1.16.3's ConstantSharing)
MLP_WEIGHTS = ("W1", "b1", "W2", "b2")


def mlp(opset: int = 15, scale: float = 0.3, dout: int = DOUT) -> onnx.ModelProto:
    """x → Gemm → Relu → Gemm → logits → SoftmaxCrossEntropyLoss(logits, y) = loss."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * scale).astype(np.float32), n)
             for n, s in (("W1", (DH, DIN)), ("b1", (DH,)), ("W2", (dout, DH)), ("b2", (dout,)))]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["hr"]),
             helper.make_node("Gemm", ["hr", "W2", "b2"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", T.FLOAT, ["N", DIN]),
                           helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", dout])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def mlp_feeds(n: int, lrs: list[float], seed: int = 1, x_scale: float = 1.0,
              dout: int = DOUT) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"x": (rng.standard_normal((BATCH, DIN)) * x_scale).astype(np.float32),
             "y": rng.integers(0, dout, BATCH).astype(np.int64),
             "Learning_Rate": np.array([lrs[k % len(lrs)]], np.float32)} for k in range(n)]


def params(opt: str, weights=MLP_WEIGHTS, floats=None, ints=None, **kw) -> dict:
    """TrainingParameters properties: loss ``loss``, optimizer ``opt``, both attribute maps filled for
    ``weights`` (1.16.3 wants an entry for every trained weight)."""
    p = {"loss_output_name": "loss", "training_optimizer_name": opt}
    if weights:
        p["weights_to_train"] = set(weights)
        p["optimizer_attributes_map"] = {w: dict((floats or {}).get(w, {})) for w in weights}
        p["optimizer_int_attributes_map"] = {w: dict((ints or {}).get(w, {})) for w in weights}
    p.update(kw)
    return p


LRS = [0.1, 0.05, 0.2, 0.0, 0.08]  # changing every step (0: Adam still moves its moments and count)
CPU_ADAM = {"legacy_cpu_adam": True}
ADAM_FLOATS = {
    "W1": {"alpha": 0.8, "beta": 0.99, "lambda": 0.01, "epsilon": 1e-6, "max_norm_clip": 0.5},
    "b1": {"alpha": 0.95, "beta": 0.9, "epsilon": 1e-4},
    "W2": {"lambda": 0.1, "beta": 0.95},
}
ADAM_INTS = {
    "W1": {"do_bias_correction": 1, "weight_decay_mode": 0},
    "b1": {"do_bias_correction": 0, "weight_decay_mode": 1},
    "W2": {"do_bias_correction": 1, "weight_decay_mode": 1},
    "b2": {"do_bias_correction": 0, "weight_decay_mode": 0},
}


def mlp_with_constant(opset: int = 15) -> onnx.ModelProto:
    """:func:`mlp` whose logits are divided by a float32 scalar initializer ``temperature`` (8.0), as BERT's
    exported ``/ sqrt(d)``: auto-discovery trains it unless ``immutable_weights`` names it."""
    m = mlp(opset)
    g = m.graph
    g.initializer.append(numpy_helper.from_array(np.array(8.0, np.float32), "temperature"))
    g.node[2].output[0] = "raw"
    g.node.insert(3, helper.make_node("Div", ["raw", "temperature"], ["logits"]))
    return m


def with_layer_norm_statistics(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` whose LayerNormalization nodes also name their optional Mean and InvStdDev outputs: 1.16.3's
    LayerNormalization gradient reads them and fails on torch's one-output export ("i <
    node_->OutputDefs().size() was false"); the function is the same."""
    for node in model.graph.node:
        if node.op_type == "LayerNormalization":
            while len(node.output) < 3:
                node.output.append(f"{node.output[0]}_stat{len(node.output)}")
    return model


KEY_BIAS = ("model.layers.0.self_attn.in_proj_bias",)


BN_STATISTICS = ("/model/bn/BatchNormalization_output_1", "/model/bn/BatchNormalization_output_2")


def _with_outputs(case: Case, names: tuple[str, ...]) -> Case:
    """``case`` whose model also outputs the float32 [C] values ``names`` (a copy of the model)."""
    m = onnx.ModelProto()
    m.CopyFrom(case.model)
    m.graph.output.extend(helper.make_tensor_value_info(n, T.FLOAT, None) for n in names)
    case.model = m
    return case


def _with_feeds(case: Case, **feeds: np.ndarray) -> Case:
    for step in case.steps:
        step.feeds = {**step.feeds, **feeds}
    return case


def _with_peer_config(case: Case, **config: str) -> Case:
    case.peer_config = dict(config)
    return case


def mlp_tied() -> onnx.ModelProto:
    """:func:`mlp` whose logits add a second product with W2 (a weight read by two nodes)."""
    m = mlp()
    g = m.graph
    g.node[2].output[0] = "l1"
    g.node.insert(3, helper.make_node("Gemm", ["hr", "W2"], ["l2"], transB=1))
    g.node.insert(4, helper.make_node("Add", ["l1", "l2"], ["logits"]))
    return m


def mlp_mse(opset: int) -> onnx.ModelProto:
    """:func:`mlp` with a mean squared error against float targets ``t`` (ops of every opset from 9)."""
    m = mlp(opset)
    g = m.graph
    del g.node[-1]
    g.node.extend([helper.make_node("Sub", ["logits", "t"], ["d"]),
                   helper.make_node("Mul", ["d", "d"], ["d2"]),
                   helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)])
    g.input[1].CopyFrom(helper.make_tensor_value_info("t", T.FLOAT, ["N", DOUT]))
    return m


def mlp_initializers_as_inputs(opset: int) -> onnx.ModelProto:
    """:func:`mlp` that also lists its initializers as graph inputs (older exporters' models)."""
    m = mlp(opset)
    for t in m.graph.initializer:
        m.graph.input.append(helper.make_tensor_value_info(t.name, T.FLOAT, list(t.dims)))
    return m


def mlp_vector_loss() -> onnx.ModelProto:
    """:func:`mlp` whose loss is the per-sample cross entropy, of shape [N] (reduction none)."""
    m = mlp()
    m.graph.node[-1].attribute.append(helper.make_attribute("reduction", "none"))
    m.graph.output[0].type.tensor_type.shape.dim.add().dim_param = "N"
    return m


def _op_models() -> dict[str, onnx.ModelProto]:
    """Small graphs over more gradient rules (x [4, 12]; weights A, C [12, 12], B, D [12], E [1, 12, 1];
    opset 15), each to a scalar loss."""
    n = helper.make_node
    chains = {
        "sigmoid_tanh": [n("MatMul", ["x", "A"], ["m"]), n("Sigmoid", ["m"], ["s"]),
                         n("Mul", ["s", "B"], ["sb"]), n("Tanh", ["sb"], ["t"]),
                         n("MatMul", ["t", "C"], ["u"]), n("Add", ["u", "D"], ["v"]),
                         n("ReduceSum", ["v"], ["r"], keepdims=0), n("Mul", ["r", "r"], ["loss"])],
        "softmax_log": [n("MatMul", ["x", "A"], ["m"]), n("Softmax", ["m"], ["s"], axis=-1),
                        n("Add", ["s", "B"], ["sb"]), n("Log", ["sb"], ["l"]), n("Mul", ["l", "D"], ["v"]),
                        n("ReduceMean", ["v"], ["loss"], keepdims=0)],
        "concat_transpose": [n("MatMul", ["x", "A"], ["m"]), n("Concat", ["m", "x"], ["cc"], axis=1),
                             n("Transpose", ["cc"], ["tt"]), n("MatMul", ["tt", "x"], ["q"]),
                             n("Mul", ["q", "q"], ["q2"]), n("Mul", ["q2", "B"], ["q3"]),
                             n("ReduceMean", ["q3"], ["loss"], keepdims=0)],
        "div_sqrt_exp": [n("MatMul", ["x", "A"], ["m"]), n("Mul", ["m", "m"], ["m2"]),
                         n("Add", ["m2", "D"], ["d"]),
                         n("Abs", ["d"], ["ad"]), n("Sqrt", ["ad"], ["sq"]), n("Div", ["m", "sq"], ["dv"]),
                         n("Exp", ["dv"], ["e"]), n("MatMul", ["e", "C"], ["f"]),
                         n("ReduceMean", ["f"], ["loss"], keepdims=0)],
        "layernorm_erf": [n("MatMul", ["x", "A"], ["m"]),
                          n("LayerNormalization", ["m", "B", "D"], ["ln", "mean", "inv_std"], axis=-1),
                          n("Erf", ["ln"], ["e"]), n("Mul", ["e", "ln"], ["g"]),
                          n("MatMul", ["g", "C"], ["f"]),
                          n("Mul", ["f", "f"], ["f2"]), n("ReduceMean", ["f2"], ["loss"], keepdims=0)],
        "max_min_pow_reshape": [n("MatMul", ["x", "A"], ["m"]), n("Max", ["m", "B"], ["mx"]),
                                n("Min", ["mx", "D"], ["mn"]), n("Pow", ["mn", "two"], ["p"]),
                                n("Neg", ["p"], ["ng"]),
                                n("Reshape", ["ng", "shape"], ["rs"]), n("Mul", ["rs", "E"], ["re"]),
                                n("ReduceSum", ["re"], ["loss"], keepdims=0)],
    }
    rng = np.random.default_rng(11)
    weights = {"A": rng.standard_normal((12, 12)) * 0.3, "B": rng.standard_normal(12),
               "C": rng.standard_normal((12, 12)) * 0.3, "D": rng.standard_normal(12),
               "E": rng.standard_normal((1, 12, 1)) * 0.5, "two": np.array(2.0)}
    models = {}
    for name, nodes in chains.items():
        used = {i for node in nodes for i in node.input}
        inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items() if k in used]
        if "shape" in used:
            inits.append(numpy_helper.from_array(np.array([4, 12, 1], np.int64), "shape"))
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info("x", T.FLOAT, [4, 12])],
                              [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
        models[name] = helper.make_model(g, opset_imports=[helper.make_opsetid("", 15)])
    return models


OP_MODELS = ("sigmoid_tanh", "softmax_log", "concat_transpose", "div_sqrt_exp", "layernorm_erf",
             "max_min_pow_reshape")


# ---- torch exports, the loss inside the graph -----------------------------------------------------------
def _torch_cases() -> dict[str, Case]:
    torch = pytest.importorskip("torch")
    models = pytest.importorskip("tests.models")
    nn = torch.nn

    class CNN(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 10, 3, padding=1, bias=False)  # (before BatchNorm its gradient is 0)
            self.bn = nn.BatchNorm2d(10)
            self.fc = nn.Linear(10 * 4 * 4, 12)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(torch.flatten(nn.functional.max_pool2d(torch.relu(self.bn(self.conv(x))), 2), 1))

    torch.manual_seed(3)
    rng = np.random.default_rng(4)
    builds = {
        "mlp": (lambda: nn.Sequential(nn.Linear(DIN, DH), nn.ReLU(), nn.Linear(DH, DOUT)),
                lambda: {"x": rng.standard_normal((BATCH, DIN)).astype(np.float32)}, DOUT),
        "cnn_bn": (CNN, lambda: {"x": rng.standard_normal((BATCH, 1, 8, 8)).astype(np.float32)}, 12),
        "transformer": (lambda: models.TransformerEncoder(vocab=20, seq=6, d=16, heads=2, ff=32, layers=1,
                                                          dropout=0.0, classes=10),
                        lambda: {"tokens": rng.integers(0, 20, (BATCH, 6)).astype(np.int64)}, 10),
        "mlp_dropout": (lambda: nn.Sequential(nn.Linear(DIN, DH), nn.ReLU(), nn.Dropout(0.3),
                                              nn.Linear(DH, DOUT)),
                        lambda: {"x": rng.standard_normal((BATCH, DIN)).astype(np.float32)}, DOUT),
        "transformer2": (lambda: models.TransformerEncoder(vocab=20, seq=6, d=16, heads=2, ff=32, layers=2,
                                                           dropout=0.0, classes=10),
                         lambda: {"tokens": rng.integers(0, 20, (BATCH, 6)).astype(np.int64)}, 10),
    }
    exported = {}
    for name, (build, inputs, classes) in builds.items():
        module = models.WithLoss(build(), nn.CrossEntropyLoss())
        batches = [{**inputs(), "labels": rng.integers(0, classes, BATCH).astype(np.int64)} for _ in range(4)]
        model = with_layer_norm_statistics(
            models.export_module(module, batches[0], "loss", training=True, batch_output=False))
        weights = sorted(n for n, _ in module.named_parameters())
        exported[name] = (model, weights, batches)

    def case(name: str, opt: str, lrs: list[float], skip: tuple[str, ...] = (), **kw) -> Case:
        model, weights, batches = exported[name]
        weights = [w for w in weights if w not in skip]
        steps = [Step({**b, "Learning_Rate": np.array([lrs[k % len(lrs)]], np.float32)})
                 for k, b in enumerate(batches)]
        return Case(model, params(opt, weights=weights, **kw), steps,
                    ours=CPU_ADAM if opt == "AdamOptimizer" else {})

    return {
        "torch_mlp_sgd": case("mlp", "SGDOptimizer", [0.1, 0.3, 0.05]),
        "torch_mlp_adam": case("mlp", "AdamOptimizer", [0.01, 0.03]),
        "torch_cnn_bn_sgd": case("cnn_bn", "SGDOptimizer", [0.05, 0.1]),
        "torch_cnn_bn_adam": case("cnn_bn", "AdamOptimizer", [0.01, 0.02],
                                  set_gradients_as_graph_outputs=True),
        "torch_transformer_sgd": case("transformer", "SGDOptimizer", [0.1, 0.05]),
        # the keys' bias has a gradient of 0 (softmax ignores a constant per row), float noise that Adam's
        # g/sqrt(g²) makes a full step of either sign: left out of the Adam cases
        "torch_transformer_adam": case("transformer", "AdamOptimizer", [0.01, 0.005], skip=KEY_BIAS),
        "torch_transformer_memory_efficient_gradient": case(
            "transformer", "AdamOptimizer", [0.01, 0.005], skip=KEY_BIAS, use_memory_efficient_gradient=True),
        # 1.16.3 in its default execution order and optimization level (its faults, recorded below)
        "peer_default_order": _with_peer_config(case("mlp", "SGDOptimizer", [0.1, 0.3]),
                                                execution_order="DEFAULT"),
        "peer_nchwc": _with_peer_config(case("cnn_bn", "SGDOptimizer", [0.05, 0.1]),
                                        graph_optimization_level="ORT_ENABLE_ALL"),
        # (two layers, so that the first one's recompute has something to do; its Dropouts have ratio 0)
        "torch_transformer_recompute": case(
            "transformer2", "SGDOptimizer", [0.1], gelu_recompute=True, attn_dropout_recompute=True,
            transformer_layer_recompute=True, set_gradients_as_graph_outputs=True),
        # the Dropout off: the shared training_mode fed False
        "dropout_training_mode_false": _with_feeds(case("mlp_dropout", "SGDOptimizer", [0.1, 0.2]),
                                                   training_mode=np.array(False)),
        "cnn_bn_running_statistics": _with_outputs(case("cnn_bn", "SGDOptimizer", [0.05, 0.1]),
                                                   BN_STATISTICS),
    }


def _op_cases() -> dict[str, Case]:
    """Each op model's gradient outputs without an optimizer, and two SGD steps (but div_sqrt_exp's, whose
    loss after a step is too ill-conditioned: 1e-8 apart in the weights, 2e-4 apart in the loss)."""
    x = np.random.default_rng(12).standard_normal((4, 12)).astype(np.float32)
    lr = np.array([0.01], np.float32)
    out = {}
    for name, model in _op_models().items():
        used = {i for node in model.graph.node for i in node.input}
        weights = [w for w in ("A", "B", "C", "D", "E") if w in used]
        grads = params("", weights=weights, set_gradients_as_graph_outputs=True)
        out[f"ops_{name}_gradients"] = Case(model, grads, [Step({"x": x})])
        if name != "div_sqrt_exp":
            out[f"ops_{name}_sgd"] = Case(model, {**grads, "training_optimizer_name": "SGDOptimizer"},
                                          [Step({"x": x, "Learning_Rate": lr})] * 2)
    return out


def _cases() -> dict[str, Case]:
    feeds = mlp_feeds(5, LRS)
    steps = [Step(f) for f in feeds]
    rng = np.random.default_rng(5)
    initial = {"W1": {"Moment_1": (rng.standard_normal((DH, DIN)) * 0.01).astype(np.float32),
                      "Moment_2": (rng.random((DH, DIN)) * 1e-3).astype(np.float32),
                      "Update_Count": np.array([7], np.int64)},
               "b2": {"Update_Count": np.array([3], np.int64)}}
    loaded = {"W1": (rng.standard_normal((DH, DIN)) * 0.2).astype(np.float32),
              "Moment_1_W2": (rng.standard_normal((DOUT, DH)) * 0.01).astype(np.float32),
              "Update_Count_b1": np.array([10], np.int64)}
    large = [Step(f) for f in mlp_feeds(4, LRS, x_scale=5.0)]  # global norm 3-40: clipping would act
    adam = params("AdamOptimizer", floats=ADAM_FLOATS, ints=ADAM_INTS)
    # the legacy protocol: a micro-step fetches Group_Accumulated_Gradients, running only the path to it
    accumulate = [Step(feeds[0], fetches=["loss", "Group_Accumulated_Gradients"],
                       run_options={"only_execute_path_to_fetches": True}), Step(feeds[1])]
    scaled = [Step({**f, "loss_scale": np.array([1024.0], np.float32)}) for f in feeds[:2]]
    targets = np.random.default_rng(9).standard_normal((len(feeds), BATCH, DOUT)).astype(np.float32)
    mse_steps = [Step({"x": f["x"], "t": t, "Learning_Rate": f["Learning_Rate"]})
                 for f, t in zip(feeds, targets)]
    with_grads = {"set_gradients_as_graph_outputs": True}
    return {
        "sgd": Case(mlp(), params("SGDOptimizer"), steps),
        "sgd_mse_gradients_out": Case(mlp_mse(13), params("SGDOptimizer", **with_grads), mse_steps),
        "adam_mse_opset9": Case(mlp_mse(9), params("AdamOptimizer"), mse_steps, ours=CPU_ADAM),
        "adam_mse_opset13": Case(mlp_mse(13), params("AdamOptimizer"), mse_steps, ours=CPU_ADAM),
        "adam_initializers_as_inputs": Case(mlp_initializers_as_inputs(15), params("AdamOptimizer"), steps,
                                            ours=CPU_ADAM),
        "sgd_initializers_as_inputs_opset12": Case(mlp_initializers_as_inputs(12), params("SGDOptimizer"),
                                                   steps[:3]),
        "sgd_tied_weight": Case(mlp_tied(), params("SGDOptimizer", **with_grads), steps),
        "adam_update_counts_loaded_0_and_negative": Case(
            mlp(), params("AdamOptimizer"),
            [steps[0], Step(feeds[1], load={"Update_Count_W1": np.array([0], np.int64),
                                            "Update_Count_b1": np.array([-3], np.int64)}), steps[2]],
            ours=CPU_ADAM),
        "adam_decay_rates_0_large_epsilon": Case(
            mlp(), params("AdamOptimizer", floats=dict.fromkeys(
                MLP_WEIGHTS, {"alpha": 0.0, "beta": 0.0, "epsilon": 0.5, "lambda": 0.05})),
            steps, ours=CPU_ADAM),
        "sgd_unread_attributes": Case(  # (SGD reads none: a momentum, an alpha are ignored on both sides)
            mlp(), params("SGDOptimizer", floats=dict.fromkeys(MLP_WEIGHTS, {"momentum": 0.9, "alpha": 0.5})),
            steps),
        "vector_loss": Case(mlp_vector_loss(), params("SGDOptimizer", **with_grads), steps[:1]),
        "sgd_bytes_opset12": Case(mlp(12), params("SGDOptimizer"), steps[:3], as_bytes=True),
        "sgd_gradients_out": Case(mlp(), params("SGDOptimizer", set_gradients_as_graph_outputs=True), steps),
        "no_optimizer_gradients_out": Case(
            mlp(), params("", set_gradients_as_graph_outputs=True),
            [Step({k: v for k, v in f.items() if k != "Learning_Rate"}) for f in feeds[:3]]),
        "sgd_fetch_loss_only": Case(mlp(), params("SGDOptimizer"),
                                    [Step(f, fetches=["loss"]) for f in feeds]),
        "sgd_some_weights": Case(mlp(), params("SGDOptimizer", weights=("W1", "b2")), steps),
        "sgd_weights_not_to_train": Case(
            mlp(), params("SGDOptimizer", weights=(), weights_not_to_train={"b1", "W2"},
                          optimizer_attributes_map={"W1": {}, "b2": {}},
                          optimizer_int_attributes_map={"W1": {}, "b2": {}}), steps),
        "sgd_immutable_weights": Case(
            mlp_with_constant(), params("SGDOptimizer", weights=(), immutable_weights={"Div": [(1, 8.0)]},
                                        optimizer_attributes_map={w: {} for w in MLP_WEIGHTS},
                                        optimizer_int_attributes_map={w: {} for w in MLP_WEIGHTS}), steps),
        "sgd_memory_efficient_gradient": Case(
            mlp(), params("SGDOptimizer", use_memory_efficient_gradient=True), steps[:2]),
        "adam_defaults": Case(mlp(), params("AdamOptimizer"), steps, ours=CPU_ADAM),
        "adam_attributes": Case(mlp(), adam, steps, ours=CPU_ADAM),
        "adam_attributes_no_clip": Case(mlp(), {**adam, "enable_grad_norm_clip": False}, large),
        "adam_attributes_clip_on_cpu": Case(mlp(), adam, large, ours=CPU_ADAM),
        "adam_initial_state": Case(mlp(), adam, steps, initial_state=initial, ours=CPU_ADAM),
        "adam_load_state": Case(
            mlp(), adam,
            [*steps[:2], Step(feeds[2], load=loaded), steps[3], Step(feeds[4], load=loaded, strict=True)],
            ours=CPU_ADAM),
        "adam_some_weights": Case(mlp(), params("AdamOptimizer", weights=("W1", "b2")), steps, ours=CPU_ADAM),
        "adam_gradients_out": Case(mlp(), params("AdamOptimizer", set_gradients_as_graph_outputs=True), steps,
                                   ours=CPU_ADAM),
        # features or settings 1.16.3's CPU build refuses or gets wrong (the tests after the comparison)
        "peer_prepacked": _with_peer_config(Case(mlp(), params("SGDOptimizer"), steps[:2]),
                                            **{"session.disable_prepacking": "0"}),
        "small_bias": Case(mlp(dout=4), params("SGDOptimizer"), [Step(f) for f in mlp_feeds(2, LRS, dout=4)]),
        "adam_fp16_moments": Case(mlp(), params("AdamOptimizer", use_fp16_moments=True), steps[:3],
                                  ours=CPU_ADAM),
        "adam_clip_gpu_semantics": Case(mlp(), adam, large[:1]),
        "lamb": Case(mlp(), params("LambOptimizer"), steps[:2]),
        "sgd_accumulation": Case(mlp(), params("SGDOptimizer", gradient_accumulation_steps=2), accumulate),
        "adam_accumulation": Case(mlp(), params("AdamOptimizer", gradient_accumulation_steps=2), accumulate),
        "sgd_mixed_precision": Case(mlp(), params("SGDOptimizer", use_mixed_precision=True), scaled),
        "adam_mixed_precision": Case(mlp(), params("AdamOptimizer", use_mixed_precision=True), scaled),
        **_torch_cases(),
        **_op_cases(),
    }


# cases whose every step both sides must give alike
COMPARED = [
    # the hand-made MLP (cross entropy; MSE), SGD
    "sgd", "sgd_bytes_opset12", "sgd_gradients_out", "no_optimizer_gradients_out", "sgd_fetch_loss_only",
    "sgd_mse_gradients_out", "sgd_initializers_as_inputs_opset12", "sgd_tied_weight", "sgd_unread_attributes",
    "sgd_some_weights", "sgd_weights_not_to_train", "sgd_immutable_weights", "sgd_memory_efficient_gradient",
    # Adam
    "adam_defaults", "adam_attributes", "adam_attributes_no_clip", "adam_attributes_clip_on_cpu",
    "adam_initial_state", "adam_load_state", "adam_update_counts_loaded_0_and_negative",
    "adam_decay_rates_0_large_epsilon", "adam_some_weights", "adam_gradients_out", "adam_mse_opset13",
    "adam_initializers_as_inputs",
    # torch exports
    "torch_mlp_sgd", "torch_mlp_adam", "torch_cnn_bn_sgd", "torch_cnn_bn_adam", "torch_transformer_sgd",
    "torch_transformer_adam", "torch_transformer_memory_efficient_gradient", "torch_transformer_recompute",
    # more gradient rules
    *(f"ops_{n}_gradients" for n in OP_MODELS), *(f"ops_{n}_sgd" for n in OP_MODELS if n != "div_sqrt_exp"),
]


def _close(actual: np.ndarray, desired: np.ndarray, what: str) -> None:
    """Equal to float32 rounding: rtol, and atol scaled by the array's magnitude (a value near 0 that is a
    sum of large terms, such as a logit of 0.3 among logits of 700, carries their ulps, not its own)."""
    desired = np.asarray(desired)
    scale = max(1.0, float(np.max(np.abs(desired)))) if desired.size else 1.0
    np.testing.assert_allclose(actual, desired, rtol=RTOL, atol=ATOL * scale, err_msg=what)


def _compare(name: str, peer: Trace, ours: Trace, steps: range | None = None) -> None:
    """Every step's (or ``steps``') outputs, state and optimizer state of 1.16.3 (``peer``) in ``ours``."""
    assert peer.error is None, f"{name}: 1.16.3 failed: {peer.error}"
    assert ours.error is None, f"{name}: onnxtrain failed: {ours.error}"
    for k in steps or range(len(peer.outputs)):
        po, oo = peer.outputs[k], ours.outputs[k]
        assert set(po) <= set(oo), f"{name} step {k}: outputs {sorted(set(po) - set(oo))} missing"
        for n, v in po.items():
            _close(oo[n], v, f"{name} step {k} output {n}")
        ps, os_ = peer.state[k], ours.state[k]
        assert set(ps) <= set(os_), f"{name} step {k}: state {sorted(set(ps) - set(os_))} missing"
        for n, v in ps.items():
            assert os_[n].dtype == v.dtype, f"{name} step {k} state {n}: {os_[n].dtype} vs {v.dtype}"
            _close(os_[n], v, f"{name} step {k} state {n}")
        pz, oz = peer.optimizer[k], ours.optimizer[k]
        assert set(pz) == set(oz), f"{name} step {k}: optimizer state keys {sorted(pz)} vs {sorted(oz)}"
        for n, v in pz.items():
            _close(oz[n], v, f"{name} step {k} optimizer state {n}")


@pytest.fixture(scope="module")
def traces() -> dict[str, tuple[Case, Trace, Trace]]:
    """Each case's (case, 1.16.3's trace, onnxtrain's trace), by name."""
    ensure_ort_legacy()  # (skips before the exports when the venv cannot be made)
    cases = _cases()
    peer, ours = run_cases(list(cases.values()))
    return {name: (c, p, o) for (name, c), p, o in zip(cases.items(), peer, ours)}


@pytest.mark.parametrize("name", COMPARED)
def test_steps_match_onnxruntime_training_116(traces, name: str) -> None:
    """Every run's fetched outputs, ``get_state()`` and ``get_optimizer_state()`` equal 1.16.3's."""
    case, peer, ours = traces[name]
    _compare(name, peer, ours)


# ---- what 1.16.3 gets wrong or refuses on CPU ----------------------------------------------------------
def _mlp_forward_backward(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray,
                          w2_backward: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """float64 logits and gradients of Gemm(transB) → Relu → Gemm(transB) → mean cross entropy, with the
    weights named (W1, b1, W2, b2); ``w2_backward`` is the W2 the backward multiplies by (the forward's)."""
    w = {k: v.astype(np.float64) for k, v in w.items()}
    h = x.astype(np.float64) @ w["W1"].T + w["b1"]
    hr = np.maximum(h, 0)
    logits = hr @ w["W2"].T + w["b2"]
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    d = p.copy()
    d[np.arange(len(y)), y] -= 1
    d /= len(y)
    dh = (d @ (w["W2"] if w2_backward is None else w2_backward)) * (h > 0)
    return logits, {"W1": dh.T @ x, "b1": dh.sum(0), "W2": d.T @ hr, "b2": d.sum(0)}


TORCH_MLP = {"W1": "model.0.weight", "b1": "model.0.bias", "W2": "model.2.weight", "b2": "model.2.bias"}


def test_peer_packs_its_weights_once(traces) -> None:
    """1.16.3 with weight prepacking on (its default): the second run's logits are those of the initial Gemm
    weights with the updated biases; onnxtrain's are the updated model's (float64 forward of its state)."""
    case, peer, ours = traces["peer_prepacked"]
    _compare("peer_prepacked", peer, ours, range(1))  # the first run and its update agree
    w0 = {t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}
    feeds = case.steps[1].feeds
    stale = {**peer.state[0], "W1": w0["W1"], "W2": w0["W2"]}
    x, y = feeds["x"], feeds["y"]
    _close(peer.outputs[1]["logits"], _mlp_forward_backward(stale, x, y)[0], "1.16.3: the initial weights")
    _close(ours.outputs[1]["logits"], _mlp_forward_backward(ours.state[0], x, y)[0], "onnxtrain")
    assert not np.allclose(peer.outputs[1]["logits"], ours.outputs[1]["logits"], atol=1e-3)


def test_peer_default_order_updates_weights_before_reading_them(traces) -> None:
    """1.16.3 in its default execution order on torch's MLP: SGDOptimizer_model.2.weight ran before the
    backward MatMul that reads model.2.weight, so model.0's gradient went through the updated weight.
    onnxtrain's step is the float64 gradient step of the weights as they were."""
    case, peer, ours = traces["peer_default_order"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    w0 = {k: numpy_helper.to_array(t) for t in case.model.graph.initializer
          for k, n in TORCH_MLP.items() if t.name == n}
    feeds = case.steps[0].feeds
    lr = float(feeds["Learning_Rate"][0])
    _, g = _mlp_forward_backward(w0, feeds["x"], feeds["labels"])
    right = {k: w0[k] - lr * g[k] for k in w0}
    _, g_late = _mlp_forward_backward(w0, feeds["x"], feeds["labels"], w2_backward=right["W2"])
    for k, name in TORCH_MLP.items():
        _close(ours.state[0][name], right[k], f"onnxtrain {name}")
    _close(peer.state[0][TORCH_MLP["W1"]], w0["W1"] - lr * g_late["W1"], "1.16.3 through the updated W2")
    assert not np.allclose(peer.state[0][TORCH_MLP["W1"]], right["W1"], rtol=0, atol=1e-4)


def test_peer_conv_keeps_its_initial_weights(traces) -> None:
    """1.16.3 at its default optimization level on the CNN: the second run's loss is the one of the initial
    conv weight (its NCHWc copy) with the other weights updated; onnxtrain's loss is torch's of its state."""
    torch = pytest.importorskip("torch")
    f = torch.nn.functional
    case, peer, ours = traces["peer_nchwc"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    w0 = {t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}
    feeds = case.steps[1].feeds

    def loss(state: dict[str, np.ndarray]) -> float:
        t = {k: torch.tensor(v.astype(np.float64)) for k, v in state.items()}
        h = f.conv2d(torch.tensor(feeds["x"].astype(np.float64)), t["model.conv.weight"], padding=1)
        h = f.batch_norm(h, None, None, t["model.bn.weight"], t["model.bn.bias"], training=True)
        h = f.max_pool2d(torch.relu(h), 2).flatten(1) @ t["model.fc.weight"].T + t["model.fc.bias"]
        return f.cross_entropy(h, torch.tensor(feeds["labels"])).item()

    np.testing.assert_allclose(ours.outputs[1]["loss"], loss(ours.state[0]), rtol=RTOL)
    stale = {**peer.state[0], "model.conv.weight": w0["model.conv.weight"]}
    np.testing.assert_allclose(peer.outputs[1]["loss"], loss(stale), rtol=RTOL)
    assert abs(peer.outputs[1]["loss"] - ours.outputs[1]["loss"]) > 1e-4


def test_cpu_batchnorm_running_statistics_are_not_kept(traces) -> None:
    """A training-mode BatchNormalization's new running statistics (its outputs 1 and 2, here model
    outputs): 1.16.3's CPU kernel writes them to new tensors, so every step starts again from the model's
    initial statistics; onnxtrain writes them back (into ``get_state()``), as torch's module.train() and
    1.16.3's CUDA kernel (BatchNormInternal, whose outputs alias its inputs) did. Both agree on the first step
    and on the statistics' formula (momentum 0.9, the batch's biased variance)."""
    torch = pytest.importorskip("torch")
    case, peer, ours = traces["cnn_bn_running_statistics"]
    _compare("cnn_bn_running_statistics", peer, ours, range(1))
    w0 = {t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}
    mean_name, var_name = BN_STATISTICS

    def batch_statistics(step: int, conv_weight: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x = torch.tensor(case.steps[step].feeds["x"].astype(np.float64))
        w = torch.tensor(conv_weight.astype(np.float64))
        y = torch.nn.functional.conv2d(x, w, padding=1).numpy()
        return y.mean(axis=(0, 2, 3)), y.var(axis=(0, 2, 3))

    for k in range(1, len(case.steps)):
        ours_batch = batch_statistics(k, ours.state[k - 1]["model.conv.weight"])
        peer_batch = batch_statistics(k, peer.state[k - 1]["model.conv.weight"])
        for i, (name, key) in enumerate(((mean_name, "running_mean"), (var_name, "running_var"))):
            kept = 0.9 * ours.outputs[k - 1][name] + 0.1 * ours_batch[i]
            _close(ours.outputs[k][name], kept, f"onnxtrain {name}")
            _close(ours.state[k][f"model.bn.{key}"], kept, f"onnxtrain {key}")
            _close(peer.outputs[k][name], 0.9 * w0[f"model.bn.{key}"] + 0.1 * peer_batch[i], f"1.16.3 {name}")


def test_peer_scales_the_gradient_of_a_dropout_fed_off(traces) -> None:
    """torch's MLP with Dropout(0.3), run with ``training_mode`` fed False: 1.16.3's forward drops nothing
    (its loss is the dropout-free one) but its DropoutGrad still divides by 1 − ratio, so the gradients below
    the Dropout are 1/0.7 times too large. onnxtrain's are the dropout-free model's (float64)."""
    case, peer, ours = traces["dropout_training_mode_false"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    names = {"W1": "model.0.weight", "b1": "model.0.bias", "W2": "model.3.weight", "b2": "model.3.bias"}
    w0 = {k: numpy_helper.to_array(t) for t in case.model.graph.initializer for k, n in names.items()
          if t.name == n}
    feeds = case.steps[0].feeds
    lr = float(feeds["Learning_Rate"][0])
    _, g = _mlp_forward_backward(w0, feeds["x"], feeds["labels"])
    _close(peer.outputs[0]["loss"], ours.outputs[0]["loss"], "the dropout-free loss")
    for k, name in names.items():
        _close(ours.state[0][name], w0[k] - lr * g[k], f"onnxtrain {name}")
        below = 1 / 0.7 if k in ("W1", "b1") else 1.0
        _close(peer.state[0][name], w0[k] - lr * below * g[k], f"1.16.3 {name}")


def test_peer_refuses_small_trained_biases(traces) -> None:
    """A trained bias of 4 elements: 1.16.3's ConstantSharing renamed it before training was configured
    (fails); onnxtrain trains it, its SGD step the float64 one."""
    case, peer, ours = traces["small_bias"]
    assert peer.error is not None and "b2 couldn't find the consumer node" in peer.error, peer.error
    assert ours.error is None, ours.error
    w0 = {t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}
    feeds = case.steps[0].feeds
    _, g = _mlp_forward_backward(w0, feeds["x"], feeds["y"])
    for k in w0:
        _close(ours.state[0][k], w0[k] - float(feeds["Learning_Rate"][0]) * g[k], f"onnxtrain {k}")


def test_peer_fp16_moments_are_never_stored(traces) -> None:
    """``use_fp16_moments`` with Adam on 1.16.3's CPU: its moments stay 0 in ``get_state()`` after every step
    (each step is a first step from zero moments). onnxtrain stores them: its first step's moments are
    1.16.3's float32 moments (``adam_defaults``) rounded to float16, and the first update agrees."""
    _, peer, ours = traces["adam_fp16_moments"]
    _, peer32, _ = traces["adam_defaults"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    for k in range(len(peer.state)):
        for w in MLP_WEIGHTS:
            for m in ("Moment_1", "Moment_2"):
                assert peer.state[k][f"{m}_{w}"].dtype == np.float16
                assert not peer.state[k][f"{m}_{w}"].any(), f"1.16.3 stored {m}_{w} at step {k}"
    for w in MLP_WEIGHTS:
        _close(ours.state[0][w], peer.state[0][w], f"first update of {w}")
        for m in ("Moment_1", "Moment_2"):
            got, want = ours.state[0][f"{m}_{w}"], peer32.state[0][f"{m}_{w}"]
            assert got.dtype == np.float16
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float16).astype(np.float32),
                                       rtol=1e-3, atol=1e-7, err_msg=f"{m}_{w}")


def test_cpu_adam_does_not_clip_where_onnxtrain_does_by_default(traces) -> None:
    """Gradients of global norm > max_norm_clip: 1.16.3's CPU Adam does not clip (the case with
    ``legacy_cpu_adam`` agrees with it, above); onnxtrain's default, the CUDA kernel's clipping, steps
    otherwise (bias-corrected Adam's first step is lr·g/|g| per element either way, so the second differs)."""
    _, peer, ours = traces["adam_clip_gpu_semantics"]
    _, peer_same, _ = traces["adam_attributes_clip_on_cpu"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    norm = float(peer.outputs[0]["global_gradient_norm"])
    assert norm > 1.0, norm
    _close(ours.outputs[0]["global_gradient_norm"], norm, "global_gradient_norm")
    # b1 has bias correction off: its first step is lr·m1/(sqrt(m2)+ε) with m1, m2 of the clipped gradient
    assert not np.allclose(ours.state[0]["b1"], peer.state[0]["b1"], rtol=1e-4, atol=1e-6)


def test_peer_reads_past_the_seed_of_a_vector_loss(traces) -> None:
    """A loss of shape [N] (per-sample cross entropy): 1.16.3 seeds its backward with one value, which the
    cross-entropy gradient reads as N, so its gradients depend on the memory past it (alone in a process,
    the first sample's gradients; after other sessions, other values). onnxtrain's are the sum's (it warns
    that the loss is not one value), float64's."""
    case, peer, ours = traces["vector_loss"]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    w0 = {t.name: numpy_helper.to_array(t) for t in case.model.graph.initializer}
    x, y = case.steps[0].feeds["x"], case.steps[0].feeds["y"]
    _, g = _mlp_forward_backward(w0, x, y)
    for k in MLP_WEIGHTS:
        _close(ours.outputs[0][f"{k}_grad"], g[k] * len(y), f"onnxtrain {k}_grad")
    assert not np.allclose(peer.outputs[0]["W2_grad"], g["W2"] * len(y), atol=1e-3)
    _close(ours.outputs[0]["loss"], peer.outputs[0]["loss"], "the losses")


def test_old_opset_model_that_the_peer_refuses(traces) -> None:
    """The MSE MLP at opset 9: 1.16.3 builds Gemm's gradient as a two-input Gemm, which opsets before 11 do
    not allow (refused); onnxtrain trains it as it trains the opset-13 model (which agrees with 1.16.3)."""
    _, peer, ours = traces["adam_mse_opset9"]
    _, _, ours13 = traces["adam_mse_opset13"]
    assert peer.error is not None and "has input size 2 not in range [min=3, max=3]" in peer.error, peer.error
    assert ours.error is None, ours.error
    for k in range(len(ours.state)):
        for n, v in ours13.state[k].items():
            _close(ours.state[k][n], v, f"step {k} {n}")


@pytest.mark.parametrize("name,message", [
    ("lamb", "Could not find an implementation for LambOptimizer"),
    ("adam_accumulation", "Could not find an implementation for MixedPrecisionScale"),
    ("sgd_accumulation", "bound to different types (tensor(float) and tensor(float16)"),
    ("adam_mixed_precision", "of operator (AdamOptimizer) in node (AdamOptimizer_"),
    ("sgd_mixed_precision", "bound to different types (tensor(float) and tensor(float16)"),
])
def test_features_the_peer_refuses_on_cpu(traces, name: str, message: str) -> None:
    """What 1.16.3's CPU build cannot run (no CPU kernel, or a graph it builds wrong): recorded, so a
    comparison can be added if that changes; onnxtrain runs each (its numbers are checked against float64
    references and torch in test_optimizer_formulas, test_accumulation_random_models, ...)."""
    _, peer, ours = traces[name]
    assert peer.error is not None and message in peer.error, peer.error
    assert ours.error is None, ours.error

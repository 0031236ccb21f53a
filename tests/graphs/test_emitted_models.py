"""Every kind of model onnxtrain writes passes onnx.checker's full check and runs in onnxruntime's inference
package to the numpy engine's values on the same file (tests/graphs/emitted.py): generate_artifacts' training,
eval and optimizer models (every built-in loss, custom loss blocks, no loss, AdamW and SGD, requires_grad
subsets with and without frozen parameters, float16 mixed precision, recompute) and the Module's exported
inference model; the GradientGraphBuilder's saved model, the legacy TrainingSession's four dumps (Adam, Lamb,
SGD; mixed precision, fp16 moments, accumulation, memory-efficient gradients, gradients as outputs) and the
InferenceSession's optimized_model_filepath; over the torch zoo (tests/models.py) exported at opsets 13 to 20
(converted to 21-23 too) and by torch's dynamo exporter, the benchmark's exports (bench/models.py),
onnxtrain.zoo's models, If/Loop/Scan models and float16 models; optimizer models of onnxblock's AdamW and
SGD with their options. Also the graphs a pipeline stage dumps, and the models `onnxtrain train`, `export`,
`gradient-graph` and `artifacts` write. (A horizontally split session writes no graph: it warns, README.)

Half precision is compared within 5 %: onnxruntime's CPU provider runs a float16 op it has no kernel for in
float32 and drops the Casts between two such ops, so a chain of them (a BatchNormalization's backward into a
Conv's) rounds once where the numpy engine rounds after each op as the graph says (LeNet's first Conv weight
gradient under mixed precision: 3 % from float32 in both when the chain's values are graph outputs, 0.04 % in
onnxruntime when they are not).

Documented exceptions: bfloat16 graphs pass the checker but onnxruntime's CPU package has no bfloat16 Gemm or
Add (README, "Mixed precision"); a graph with a training-mode BatchNormalization runs with onnxruntime's
ConstantSharing off, as the README advises (onnxruntime's kernel writes the running statistics into
input buffers that ConstantSharing may have merged with the scale or bias: onnxruntime issue #29790; a
ResNet block whose BatchNormalizations are constants was 0.26 off). The default suite runs a part of each
sweep; ONNXTRAIN_FULL_TESTS=1 runs all of it.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.graphs.emitted import check_emitted, feeds_for
from tests.tiers import extended

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
tm = pytest.importorskip("tests.models")

from onnxtrain import GradientGraphBuilder, InferenceSession, TrainingParameters  # noqa: E402
from onnxtrain.session import TrainingSession  # noqa: E402
from onnxtrain.training import artifacts, onnxblock  # noqa: E402
from onnxtrain.training.api import CheckpointState, Module  # noqa: E402
from tests.engine.random_models import _options, make_case  # noqa: E402

L, OPT = artifacts.LossType, artifacts.OptimType
LR = np.array([0.01], np.float32)
HALF_TOL = 5e-2  # float16 graphs (see the module docstring)
# how far an Adam or Lamb step may move one weight: lr·(1 − β1)/√(1 − β2) ≈ 3.2·lr on a first step without
# bias correction; twice that between two runs whose gradient for the weight is rounding noise of either sign
STEP = 2 * float(LR[0]) * 0.1 / np.sqrt(0.001)
NOT_TRAINED = ("running_", "mask", "scale", "zero_point")  # statistics, buffers, quantizer parameters


def _params(m: onnx.ModelProto) -> list[str]:
    return [t.name for t in m.graph.initializer if t.data_type in (1, 10, 11, 16) and t.dims
            and not any(w in t.name for w in NOT_TRAINED)]


class TwoTargets(onnxblock.Block):
    """A custom loss block: MSE against one target plus L1 against another."""

    def __init__(self) -> None:
        super().__init__()
        self.mse, self.l1 = onnxblock.loss.MSELoss(), onnxblock.loss.L1Loss()
        self.add = onnxblock.blocks.Add()

    def build(self, out: str) -> str:
        return self.add(self.mse(out, "target1"), self.l1(out, "target2"))


LOSSES = {"ce": lambda: L.CrossEntropyLoss, "mse": lambda: L.MSELoss, "l1": lambda: L.L1Loss,
          "bce": lambda: L.BCEWithLogitsLoss, "custom": TwoTargets, "none": lambda: None,
          "ce_last": lambda: onnxblock.loss.CrossEntropyLoss(class_axis=-1)}

# (zoo model, loss, optimizer, options); options: sel ("all", "half": the rest constants, "frozen": the rest
# frozen), mp (mixed precision), recompute
ARTIFACT_CASES = [
    ("mlp", "ce", "AdamW", {}),
    ("lenet_bn", "l1", "SGD", {"sel": "frozen"}),
    ("resnet_block", "mse", "SGD", {"sel": "half"}),
    ("transformer_encoder", "custom", "SGD", {"sel": "half"}),
    ("gpt_block", "ce_last", "AdamW",
     {"mp": "float16", "recompute": {"transformer_layer": True, "gelu": True}}),
    ("recommender", "bce", "SGD", {"mp": "float16", "sel": "frozen"}),
    ("lstm_cls", "none", "AdamW", {}),
    *(extended(n, loss, opt, kw)
      for n in ("mlp", "lenet_bn", "transformer_encoder", "resnet_block", "lstm_cls", "gru_cls",
                "rnn_relu_cls", "spatial_transformer", "fake_quant_mlp", "spectrogram_cls")
      for loss, opt, kw in (("ce", "AdamW", {}), ("mse", "SGD", {"sel": "half"}),
                            ("l1", "AdamW", {"sel": "frozen"}), ("ce", "AdamW", {"mp": "float16"}),
                            ("ce", "AdamW", {"recompute": {"transformer_layer": True, "gelu": True}}),
                            ("custom", "SGD", {}), ("none", "SGD", {}))),
    extended("gpt_block", "ce_last", "SGD", {"sel": "frozen"}),
    extended("gpt_block", "none", "AdamW", {"recompute": {"attn_dropout": True}}),
    extended("recommender", "bce", "AdamW", {}),
]


@pytest.mark.parametrize(("name", "loss", "opt", "kw"), ARTIFACT_CASES)
def test_artifacts_and_exported_model(name: str, loss: str, opt: str, kw: dict, tmp_path) -> None:
    no_loss = loss == "none"
    model, feeds, _ = tm.export(name, training=True, with_loss=no_loss, dropout=0.0)
    ps = _params(model)
    req, frozen = ps, None
    if kw.get("sel") == "half":
        req = ps[: len(ps) // 2]
    elif kw.get("sel") == "frozen":
        req, frozen = ps[: len(ps) // 2], ps[len(ps) // 2:]
    extra = {k: kw[k] for k in ("recompute",) if k in kw}
    if "mp" in kw:
        extra["mixed_precision"] = kw["mp"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a recompute option that finds nothing
        artifacts.generate_artifacts(onnx.ModelProto.FromString(model.SerializeToString()),
                                     requires_grad=req, frozen_params=frozen, loss=LOSSES[loss](),
                                     optimizer=getattr(OPT, opt),
                                     artifact_directory=str(tmp_path), **extra)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    known = {**feeds, **{k: p.data for k, p in state.parameters}}
    if not no_loss:
        known["labels"] = tm.example_inputs(name, 4, with_loss=True)["labels"]
    half = "mp" in kw
    tol, floor = (HALF_TOL, 1e-2) if half else (1e-4, 1e-3)
    for f in ("training_model", "eval_model", "optimizer_model"):
        m = onnx.load(str(tmp_path / f"{f}.onnx"))
        check_emitted(m, feeds_for(m, known), f"{name} {loss} {opt} {kw} {f}", tol=tol, floor=floor)
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    path = str(tmp_path / "inference.onnx")
    module.export_model_for_inferencing(path, [o.name for o in model.graph.output])
    exported = onnx.load(path)
    check_emitted(exported, feeds_for(exported, feeds), f"{name} exported", tol=tol, floor=floor)


def test_bfloat16_artifacts_pass_the_checker_and_onnxruntime_refuses_them_as_documented(tmp_path) -> None:
    model, _, _ = tm.export("mlp", training=True, dropout=0.0)
    artifacts.generate_artifacts(onnx.ModelProto.FromString(model.SerializeToString()),
                                 requires_grad=_params(model),
                                 loss=L.CrossEntropyLoss, optimizer=OPT.AdamW,
                                 artifact_directory=str(tmp_path),
                                 mixed_precision="bfloat16")
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    onnx.checker.check_model(training, full_check=True)
    try:
        ort.InferenceSession(training.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - 1.32: no bfloat16 Gemm in onnxruntime's CPU package
        assert "NOT_IMPLEMENTED" in str(e) and "Gemm" in str(e), e
    else:  # a release that has the kernels: the values must then agree
        state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
        known = {**tm.example_inputs("mlp", 4, with_loss=True), **{k: p.data for k, p in state.parameters}}
        check_emitted(training, feeds_for(training, known), "bfloat16 training model", tol=HALF_TOL,
                      floor=1e-2)
    for f in ("eval_model", "optimizer_model"):
        onnx.checker.check_model(onnx.load(str(tmp_path / f"{f}.onnx")), full_check=True)


DUMPS = ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
         "model_with_training_graph_path")
LEGACY = {
    "adam_mp": ("AdamOptimizer", {"use_mixed_precision": True}),
    "lamb_mp_accumulate": ("LambOptimizer", {"use_mixed_precision": True, "gradient_accumulation_steps": 2}),
    "adam_mp_fp16_moments": ("AdamOptimizer", {"use_mixed_precision": True, "use_fp16_moments": True,
                                               "transformer_layer_recompute": True}),
    "adam_grads_out": ("AdamOptimizer", {"use_memory_efficient_gradient": True,
                                         "set_gradients_as_graph_outputs": True}),
}
LEGACY_CASES = [("transformer_encoder", "adam_mp"), ("lenet_bn", "adam_grads_out"),
                ("gpt_block", "lamb_mp_accumulate"),
                *(extended(n, c) for n in ("mlp", "lenet_bn", "transformer_encoder", "gpt_block",
                                           "resnet_block", "spatial_transformer", "recommender", "gru_cls",
                                           "lstm_cls")
                  for c in LEGACY)]


def _write_dumps(model: onnx.ModelProto, p: TrainingParameters, tmp_path) -> dict[str, str]:
    """Build a legacy session of ``model`` asked for every dump and the optimized model; the paths by kind."""
    paths = {k: str(tmp_path / f"{k}.onnx") for k in (*DUMPS, "optimized")}
    for k in DUMPS:
        setattr(p, k, paths[k])
    so = _options("numpy")
    so.optimized_model_filepath = paths["optimized"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recompute options that select nothing
        TrainingSession(model.SerializeToString(), p, so)
    return paths


@pytest.mark.parametrize(("name", "config"), LEGACY_CASES)
def test_legacy_session_dumps(name: str, config: str, tmp_path) -> None:
    model, feeds, _ = tm.export(name, training=True, with_loss=True, dropout=0.0)
    opt, params = LEGACY[config]
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", opt
    for k, v in params.items():
        setattr(p, k, v)
    paths = _write_dumps(model, p, tmp_path)
    half = params.get("use_mixed_precision", False)
    for k, path in paths.items():
        m = onnx.load(path)
        check_emitted(m, feeds_for(m, {**feeds, "Learning_Rate": LR}), f"{name} {config} {k}",
                      tol=HALF_TOL if half else 1e-4, floor=1e-2 if half else 1e-3, step=STEP)


def _zoo_at(name: str, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Zoo model ``name`` with its loss, exported by the TorchScript exporter at ``opset``."""
    module = tm.build(name, 0.0, with_loss=True)
    old, tm.OPSET = tm.OPSET, opset
    try:
        m = tm.export_module(module, tm.example_inputs(name, 2, with_loss=True), "loss", True,
                             batch_output=False)
    finally:
        tm.OPSET = old
    return m, tm.example_inputs(name, 4, with_loss=True)


def _dynamo(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Zoo model ``name`` with its loss from torch's dynamo exporter (its default opset, batch 2 fixed)."""
    m, _ = tm.export_dynamo(name)
    values = tm.example_inputs(name, 2, with_loss=True).values()
    names = [i.name for i in m.graph.input]
    return onnx.ModelProto.FromString(m.SerializeToString()), dict(zip(names, values))


def _scan_model() -> onnx.ModelProto:
    """A running product-sum over a scan axis (its length symbolic); loss = sum(outputs) + sum(state)."""
    from tests.engine.graphs import scan_over_pairs

    d = TensorProto.DOUBLE
    node = scan_over_pairs([helper.make_node("Mul", ["s_in", "scale"], ["ss"]),
                            helper.make_node("Add", ["ss", "x_t"], ["s_out"]),
                            helper.make_node("Mul", ["s_out", "v"], ["y_t"])], d, name="the_scan")
    nodes = [node, helper.make_node("ReduceSum", ["ys"], ["l1"], keepdims=0),
             helper.make_node("ReduceSum", ["s"], ["l2"], keepdims=0),
             helper.make_node("Add", ["l1", "l2"], ["loss"])]
    inits = [numpy_helper.from_array(np.array([0.9, -1.1]), "scale"),
             numpy_helper.from_array(np.array([1.5, 0.5]), "v")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("s0", d, [2]),
                                       helper.make_tensor_value_info("xs", d, ["T", 2])],
                          [helper.make_tensor_value_info("loss", d, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _control_flow(kind: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    from tests.autodiff.test_control_flow_grad import loop_model, nested_model

    rng = np.random.default_rng(0)
    x = rng.standard_normal(3)
    if kind.startswith("if"):
        return nested_model(), {"x": x, "c1": np.array(kind[2] == "t"), "c2": np.array(kind[3] == "t")}
    if kind.startswith("loop"):
        return loop_model(kind == "loop"), {"x": x, "n": np.array(4), "c0": np.array(True)}
    return _scan_model(), {"s0": rng.standard_normal(2), "xs": rng.standard_normal((4, 2))}


def _converted(name: str, opset: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """Zoo model ``name`` exported at opset 20, then converted by ONNX's version converter to ``opset``."""
    from onnx import version_converter

    m, feeds = _zoo_at(name, 20)
    m = version_converter.convert_version(m, opset)
    m.ir_version = max(m.ir_version, 10 if opset >= 23 else 8)
    return m, feeds


def _bench(key: str, folder: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The benchmark's torch export of case ``key`` with its loss (bench/models.py, batch 2)."""
    from bench.models import ALL_CASES, prepare

    case = next(c for c in ALL_CASES if c.key == key)
    model = onnx.load(prepare(case, folder)["loss_model"])
    batch = case.batches(1, batch=2)
    return model, {case.input_name: batch["x0"], "labels": batch["y0"]}


def _package_zoo(name: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A model of onnxtrain.zoo (what `onnxtrain train`'s builders make), with its loss first."""
    from onnxtrain import zoo

    rng = np.random.default_rng(0)
    model = {"mlp": lambda: zoo.mlp([16, 8, 4]), "cnn": lambda: zoo.cnn(batch_norm=True),
             "stn": zoo.spatial_transformer, "transformer": zoo.transformer}[name]()
    x = {"mlp": lambda: rng.standard_normal((3, 16)).astype(np.float32),
         "transformer": lambda: rng.integers(0, 10, (3, 8))}.get(
        name, lambda: rng.standard_normal((3, 1, 8, 8)).astype(np.float32))()
    y = rng.integers(0, 10, (3, 8) if name == "transformer" else 3) % (4 if name == "mlp" else 10)
    return model, dict(zip([i.name for i in model.graph.input], (x, y)))


def _half(seed: int) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A float16 random model (tests/engine/random_models.py) with its own float16 weights."""
    case = make_case(seed, dtype=np.float16)
    return case.with_loss, case.feeds[0]


SOURCES = [
    ("zoo", ("mlp", 13)), ("zoo", ("lenet_bn", 13)), ("zoo", ("gpt_block", 20)), ("control", "iftt"),
    ("control", "loop"), ("control", "scan"), ("half", 22), ("half", 40),
    *(extended("zoo", (n, o)) for o in (13, 15, 18, 20)
      for n in ("mlp", "lenet_bn", "transformer_encoder", "gpt_block", "lstm_cls", "spatial_transformer")
      if not (o < 16 and n == "spatial_transformer") and not (o < 14 and n == "transformer_encoder")),
    ("converted", ("gpt_block", 23)), ("bench", "cnn64"), ("package_zoo", "transformer"),
    *(extended("package_zoo", n) for n in ("mlp", "cnn", "stn")),
    *(extended("bench", k) for k in ("mlp64", "transformer32", "gpt16", "mobilenet16", "resnet32")),
    *(extended("converted", (n, o)) for o in (21, 22, 23)
      for n in ("mlp", "lenet_bn", "transformer_encoder", "gpt_block", "lstm_cls", "spatial_transformer")),
    *(extended("dynamo", n) for n in ("mlp", "gpt_block", "lenet_bn", "lstm_cls", "transformer_encoder")),
    *(extended("control", k) for k in ("ifft", "iftf", "loop_nocond")),
    *(extended("half", s) for s in (3, 17, 31)),
]


@pytest.mark.parametrize(("source", "which"), SOURCES)
def test_builder_dumps_artifacts_and_inference_dump(source: str, which, tmp_path) -> None:
    """The GradientGraphBuilder's saved model, the legacy dumps (Adam), the InferenceSession's
    optimized_model_filepath and the artifacts (no loss block, AdamW) of one model."""
    model, feeds = {"zoo": lambda: _zoo_at(*which), "dynamo": lambda: _dynamo(which),
                    "converted": lambda: _converted(*which),
                    "bench": lambda: _bench(which, str(tmp_path / "bench")),
                    "package_zoo": lambda: _package_zoo(which),
                    "control": lambda: _control_flow(which), "half": lambda: _half(which)}[source]()
    ps = [p for p in _params(model) if not p.startswith("bn_")]
    if source == "bench":  # the module's parameters (a causal mask is an initializer too)
        import json

        with open(tmp_path / "bench" / "params.json") as f:
            ps = json.load(f)["loss_model"]
    if source == "control":  # (every weight of these; "limit" is a scalar bound)
        ps = [t.name for t in model.graph.initializer if t.dims]
    if source == "half":
        ps = [p for p in ps if p not in make_case(which, dtype=np.float16).no_train]
    loss = model.graph.output[0].name
    tol, floor = (HALF_TOL, 1e-2) if source == "half" else (1e-4, 1e-3)
    known = {**feeds, "Learning_Rate": LR}

    def check(label: str, path: str, values: dict[str, np.ndarray]) -> None:
        m = onnx.load(path)
        check_emitted(m, feeds_for(m, values), f"{source} {which} {label}", tol=tol, floor=floor,
                      step=STEP)

    b = GradientGraphBuilder(model.SerializeToString(), {loss}, set(ps), loss)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # dynamo's BatchNormalizations written for inference: said, expected
        b.build()
    b.save(str(tmp_path / "builder.onnx"))
    check("GradientGraphBuilder.save", str(tmp_path / "builder.onnx"), known)

    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name, p.weights_to_train = loss, "AdamOptimizer", set(ps)
    paths = _write_dumps(model, p, tmp_path)
    for k, path in paths.items():
        check(k, path, known)

    so = _options("numpy")
    so.optimized_model_filepath = str(tmp_path / "inference.onnx")
    InferenceSession(model.SerializeToString(), so)
    check("InferenceSession optimized_model_filepath", so.optimized_model_filepath, known)

    art = tmp_path / "artifacts"
    os.makedirs(art)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifacts.generate_artifacts(model, requires_grad=ps, loss=None, optimizer=OPT.AdamW,
                                     artifact_directory=str(art))
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    with_state = {**known, **{k: v.data for k, v in state.parameters}}
    for f in ("training_model", "eval_model", "optimizer_model"):
        check(f, str(art / f"{f}.onnx"), with_state)
    module = Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    module.export_model_for_inferencing(str(art / "inference.onnx"), [o.name for o in model.graph.output])
    check("export_model_for_inferencing", str(art / "inference.onnx"), feeds)


PIPELINE_CASES = [("mlp", "AdamOptimizer"), ("gpt_block", "LambOptimizer"),
                  *(extended(n, o) for n, o in (("lenet_bn", "SGDOptimizer"),
                                                ("transformer_encoder", "AdamOptimizer"),
                                                ("resnet_block", "AdamOptimizer"),
                                                ("lstm_cls", "SGDOptimizer")))]


@pytest.mark.parametrize(("name", "opt"), PIPELINE_CASES)
def test_pipeline_stage_dumps(name: str, opt: str) -> None:
    """The graphs a pipeline stage dumps (its forward, forward_train, stage and backward graphs, with its
    state as the session's dumps hold it), for a two-stage cut of a zoo model: fed the values the whole
    model computes (the received activations, random incoming gradients) and the stage's own saved values."""
    from onnxtrain.engine import compile_model
    from onnxtrain.optim import get_optimizer
    from onnxtrain.parallel.pipeline import parse_cut_info, partition
    from onnxtrain.parallel.stage_graphs import build_stage_graphs
    from onnxtrain.session import dumped_graph
    from onnxtrain.training_graph import select_trainable

    model, feeds, _ = tm.export(name, training=True, with_loss=True, dropout=0.0)
    nodes = list(model.graph.node)
    kinds = ("Relu", "Add", "Gemm", "MatMul", "Mul", "Transpose", "Reshape")
    cuts = [n.output[0] for n in nodes[len(nodes) // 3: 2 * len(nodes) // 3] if n.op_type in kinds]
    for cut in cuts:  # the first value of the middle third that cuts the model in two
        try:
            part = partition(model, parse_cut_info(cut, 2), "loss")
            break
        except Exception:  # noqa: BLE001, S112 - a value that does not cut the model: try the next
            continue
    else:
        pytest.fail(f"{name}: no cut among {cuts}")
    consts = {t.name for t in model.graph.initializer} | {i.name for i in model.graph.input}
    names = sorted({o for n in nodes for o in n.output if o} - consts)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=r) for r in names)
    values = dict(zip(names, compile_model(probe).run(feeds)[1:]))
    rng = np.random.default_rng(0)
    values.update({f"{k}_grad": (0.01 * rng.standard_normal(np.shape(v))).astype(v.dtype)
                   for k, v in list(values.items()) if isinstance(v, np.ndarray) and v.dtype.kind == "f"})
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", opt
    trainable = select_trainable(model, p)
    for s in (0, 1):
        sg = build_stage_graphs(model, part, s, trainable, p, get_optimizer(opt, False))
        saved: dict[str, np.ndarray] = {}
        if "forward_train" in sg.graphs:  # the values the stage's backward reads from its forward
            ft = dumped_graph(sg.graphs["forward_train"], dict(sg.initial), True)
            sess = InferenceSession(ft.SerializeToString(), _options("numpy"))
            wanted = {i.name for i in sess.get_inputs()}
            run = sess.run(None, {k: v for k, v in feeds_for(ft, {**values, **feeds}).items() if k in wanted})
            saved = dict(zip([o.name for o in ft.graph.output], run))
        for kind in ("forward", "forward_train", "stage", "backward"):
            if kind in sg.graphs:
                dump = dumped_graph(sg.graphs[kind], dict(sg.initial), True)
                known = {**values, **saved, **feeds, "Learning_Rate": LR}
                check_emitted(dump, feeds_for(dump, known), f"{name} cut {cut} stage {s} {kind}", step=STEP)


TRAIN_CONFIGS = [("digits_cnn", False), extended("digits_mlp", False), extended("digits_stn", False),
                 extended("tiny_transformer", False), extended("digits_cnn", True),
                 extended("tiny_transformer", True)]


@pytest.mark.parametrize(("config", "mixed"), TRAIN_CONFIGS)
def test_train_and_export_commands(config: str, mixed: bool, tmp_path) -> None:
    """The inference model `onnxtrain train` writes at the end of a (short) run, and `onnxtrain export`'s
    from its checkpoint (with training.mixed_precision too)."""
    from onnxtrain.cli import main

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                        "configs", f"{config}.yaml")
    sets = ["--set", "training.steps=12", "--set", "training.epochs=null", "--set", "output.plot=false"]
    if config == "tiny_transformer":
        sets += ["--set", "data.train_size=200", "--set", "data.eval_size=50"]
    if mixed:
        sets += ["--set", "training.mixed_precision=true"]
    out = str(tmp_path / "run")
    assert main(["train", path, "--output-dir", out, "--quiet", *sets]) == 0
    exported = str(tmp_path / "exported.onnx")
    assert main(["export", path, "--checkpoint", out, "-o", exported, *sets]) == 0
    for f in (os.path.join(out, "model.onnx"), exported):
        m = onnx.load(f)
        check_emitted(m, feeds_for(m, {}), f"{config} {f}")


OB = onnxblock.optim
OPTIMIZER_BLOCKS = {
    "adamw_clip_decay": lambda: OB.AdamW(weight_decay=0.01, clip_grad=OB.ClipGradNorm(0.5)),
    "adamw_no_bias_correction": lambda: OB.AdamW(bias_correction=False, betas=(0.8, 0.99), eps=1e-8),
    "sgd_clip": lambda: OB.SGD(clip_grad=OB.ClipGradNorm(1.0)),
}
OPTIMIZER_CASES = [("mixed", "adamw_clip_decay"), ("half", "sgd_clip"),
                   *(extended(m, o) for m in ("float32", "mixed", "half", "float64")
                     for o in OPTIMIZER_BLOCKS)]


@pytest.mark.parametrize(("kind", "block"), OPTIMIZER_CASES)
def test_optimizer_blocks(kind: str, block: str, tmp_path) -> None:
    """The optimizer model of onnxblock's AdamW and SGD with their options, for float32 parameters (and
    float16 mixed precision), a float16 model's own parameters and a float64 model's."""
    from tests.autodiff.test_control_flow_grad import nested_model

    mp = {"mixed_precision": "float16"} if kind == "mixed" else {}
    if kind in ("float32", "mixed"):
        model, loss = tm.export("mlp", dropout=0.0)[0], L.CrossEntropyLoss
        ps = _params(model)
    elif kind == "half":
        case = make_case(22, dtype=np.float16)
        model, loss = case.with_loss, None
        ps = [p for p in _params(model) if not p.startswith("bn_") and p not in case.no_train]
    else:
        model, loss = nested_model(), None
        ps = ["w", "u", "v"]
    artifacts.generate_artifacts(onnx.ModelProto.FromString(model.SerializeToString()), requires_grad=ps,
                                 loss=loss, optimizer=OPTIMIZER_BLOCKS[block](),
                                 artifact_directory=str(tmp_path), **mp)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    m = onnx.load(str(tmp_path / "optimizer_model.onnx"))
    check_emitted(m, feeds_for(m, {k: p.data for k, p in state.parameters}), f"{kind} {block}",
                  tol=1e-3 if kind == "half" else 1e-5)


COMMAND_CASES = [("lenet_bn", False), ("half", False),
                 *(extended(n, m)
                   for n in ("mlp", "gpt_block", "lstm_cls", "transformer_encoder", "recommender")
                   for m in (False, True)), extended("lenet_bn", True), extended("half", True)]


@pytest.mark.parametrize(("name", "memory_efficient"), COMMAND_CASES)
def test_gradient_graph_and_artifacts_commands(name: str, memory_efficient: bool, tmp_path,
                                               capsys) -> None:
    """`onnxtrain gradient-graph` (every float initializer, with --memory-efficient too) and `onnxtrain
    artifacts` (the model's loss, AdamW) on a zoo model with its loss or a float16 model (random_models
    seed 40: a MaxPool's and a cross-entropy's scatters)."""
    from onnxtrain.cli import main

    if name == "half":
        case = make_case(40, dtype=np.float16)
        model, feeds = case.with_loss, case.feeds[0]
    else:
        model, feeds, _ = tm.export(name, training=True, with_loss=True, dropout=0.0)
    src, out = str(tmp_path / "m.onnx"), str(tmp_path / "g.onnx")
    onnx.save(model, src)
    tol, floor = (HALF_TOL, 1e-2) if name == "half" else (1e-4, 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a non-scalar loss, BatchNormalization notes: said, expected
        assert main(["gradient-graph", src, "--loss", "loss", "--all-initializers", "-o", out,
                     *(["--memory-efficient"] if memory_efficient else [])]) == 0
        g = onnx.load(out)
        check_emitted(g, feeds_for(g, feeds), f"gradient-graph {name}", tol=tol, floor=floor)
        art = tmp_path / "artifacts"
        art.mkdir()
        assert main(["artifacts", src, "-o", str(art), "--optimizer", "AdamW"]) == 0
    capsys.readouterr()
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    known = {**feeds, **{k: p.data for k, p in state.parameters}}
    for f in ("training_model", "eval_model", "optimizer_model"):
        m = onnx.load(str(art / f"{f}.onnx"))
        check_emitted(m, feeds_for(m, known), f"artifacts {name} {f}", tol=tol, floor=floor)

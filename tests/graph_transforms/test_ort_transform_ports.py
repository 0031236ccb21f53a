"""onnxruntime-training's training graph-transform tests, ported as facts.

Sources (read for behaviour only): ``orttraining_test_orttrainer_frontend.py``'s DynamicLossScaler cases and
``amp/loss_scaler.py``; ``core/graph/mixed_precision_transformer.cc`` (the loss subgraph keeps float32 and
the inputs only it reads are not cast; ``Cast`` and ``ConstantOfShape`` outputs feeding the rest of the model
take the half type); ``core/optimizer/transformer_layer_recompute.cc`` (the first ``number_recompute_layers``
layers are recomputed, never the last; 0 or too many means all but the last; clones are named
``<node>_recompute``; a recomputed Dropout reuses the forward's mask).

Oracles: onnxruntime-training 1.19.2's own loss scaler (run in its venv), torch's ``GradScaler``, float64
torch autograd, onnxruntime's inference package on the emitted graphs, and ``check_model(full_check=True)``.
"""

from __future__ import annotations

import json
import random
import types
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
from onnxtrain.graph_transforms.mixed_precision import gradient_checks, mixed_precision, mixed_precision_info
from onnxtrain.ir.builder import make_model

torch = pytest.importorskip("torch")


# ---------------------------------------------------------------------------------------- the loss scaler
# onnxruntime-training's DynamicLossScaler, loaded from its file alone (the package's __init__ imports torch,
# which its venv lacks); each case is (constructor arguments, [(flag or "reset"), ...]); the answer is the
# scale and the count of stable steps after each entry
_SCALER_SCRIPT = r"""
import importlib.util, json, os, sys, types
import onnxruntime
path = os.path.join(os.path.dirname(onnxruntime.__file__), "training", "amp", "loss_scaler.py")
spec = importlib.util.spec_from_file_location("ort_loss_scaler", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
out = []
for kwargs, events in json.load(open(sys.argv[1])):
    s = mod.DynamicLossScaler(**kwargs)
    trace = []
    for e in events:
        if e == "reset":
            s.reset()
        else:
            s.update(types.SimpleNamespace(all_finite=e))
        trace.append([s.loss_scale, s._stable_steps_count])
    out.append(trace)
print(json.dumps(out))
"""


def _frontend_sequence() -> list:
    """The DynamicLossScaler sequence of onnxruntime's frontend test: 9 windows of 2,000 clean steps, 2,049
    more at the ceiling, 24 overflows down to the floor and 4 more there."""
    return [True] * (9 * 2000) + [True] * 2049 + [False] * 28


def _random_cases(seed: int, n: int) -> list:
    rng = random.Random(seed)
    cases = []
    while len(cases) < n:
        kw = {"automatic_update": rng.random() < 0.8,
              "loss_scale": rng.choice([3.0, 0.75, 2.0 ** 16, 2.0 ** 30, 1e-3, 12.5]),
              "up_scale_window": rng.choice([1, 2, 3, 7]),
              "min_loss_scale": rng.choice([0.5, 1.0, 5.0, 2.0 ** -10]),
              "max_loss_scale": rng.choice([10.0, 2.0 ** 24, 1e6])}
        if kw["min_loss_scale"] > kw["max_loss_scale"]:
            continue
        events = ["reset" if rng.random() < 0.04 else rng.random() < 0.7 for _ in range(60)]
        cases.append((kw, events))
    return cases


def _ours(kwargs: dict, events: list) -> list:
    s = DynamicLossScaler(**kwargs)
    trace = []
    for e in events:
        if e == "reset":
            s.reset()
        else:
            s.update(types.SimpleNamespace(all_finite=e))
        trace.append([s.loss_scale, s.stable_steps])
    return trace


@pytest.mark.filterwarnings("ignore:DynamicLossScaler. a step was not finite at the smallest")
def test_dynamic_loss_scaler_follows_onnxruntime_trainings_own_scaler(tmp_path) -> None:
    """The frontend test's sequence with the defaults (2^16 doubling 8 times to the 2^24 ceiling, the count
    of stable steps still wrapping at 2,000 there; 24 overflows halve it to the floor 1, where it stays), the
    custom values of its second test (a start of 3 below the floor 5: an overflow lifts it to 5; the ceiling
    10; with and without automatic_update) and random sequences with resets: after each update, the scale
    and the stable count are onnxruntime-training's."""
    from tests.ortt import run_script

    custom = {"loss_scale": 3.0, "up_scale_window": 7, "min_loss_scale": 5.0, "max_loss_scale": 10.0}
    short = [False, True] * 4 + [True] * 15 + ["reset"] + [True] * 8 + [False]
    cases = [({}, _frontend_sequence()),
             ({**custom, "automatic_update": True}, short),
             ({**custom, "automatic_update": False}, short),
             *_random_cases(0, 40)]
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    want = run_script(_SCALER_SCRIPT, str(path))
    for (kwargs, events), theirs in zip(cases, want, strict=True):
        assert _ours(kwargs, events) == theirs, kwargs
    # the facts the frontend test asserts, read from onnxruntime's trace
    trace = want[0]
    assert [trace[2000 * c - 1][0] for c in range(1, 10)] == [2.0 ** (16 + min(c, 8)) for c in range(1, 10)]
    assert [t[1] for t in trace[18000:20049]] == [k % 2000 for k in range(1, 2050)]
    assert trace[20049 + 23] == [1.0, 0] and trace[-1] == [1.0, 0]
    assert want[1][0] == [5.0, 0]  # below the floor: an overflow raises the scale to it
    assert all(t[0] == 3.0 for t in want[2])  # automatic_update=False: the scale stays


def test_dynamic_loss_scaler_matches_torch_grad_scaler() -> None:
    """With its bounds out of reach, DynamicLossScaler is torch's GradScaler (growth 2, backoff 0.5,
    growth_interval = up_scale_window): after each step of a random sequence of overflowing and clean
    steps, the same scale."""
    rng = np.random.default_rng(1)
    flags = (rng.random(200) < 0.75).tolist()
    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.0)
    ref = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5,
                               growth_interval=3)
    ours = DynamicLossScaler(loss_scale=2.0 ** 10, up_scale_window=3, min_loss_scale=2.0 ** -60,
                             max_loss_scale=2.0 ** 60)
    for k, finite in enumerate(flags):
        opt.zero_grad()
        ref.scale((p * (1.0 if finite else float("inf"))).sum()).backward()
        ref.step(opt)
        ref.update()
        assert ours.update(finite) == ref.get_scale(), f"step {k}"


# ---------------------------------------------------------------------------------------- mixed precision
def _check_all(*models: onnx.ModelProto) -> None:
    for m in models:
        onnx.checker.check_model(m, full_check=True)


def _run_both(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """The model's outputs on the numpy engine, checked against onnxruntime's inference session."""
    ort = pytest.importorskip("onnxruntime")
    plan = compile_model(model)
    ours = dict(zip(plan.output_names, plan.run(feeds)))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    for k, v in ours.items():
        a, b = np.asarray(v, np.float64), np.asarray(theirs[k], np.float64)
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * max(1.0, float(np.abs(b).max(initial=0))),
                                   err_msg=k)
    return ours


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def _weighted_loss_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """x[8,6] → MatMul W → Relu → MatMul W2 → SoftmaxCrossEntropyLoss(reduction none) · sample_weight →
    ReduceMean: a float32 input read only by the loss's own nodes."""
    rng = np.random.default_rng(2)
    w = {"W": (rng.standard_normal((6, 5)) * 0.4).astype(np.float32),
         "W2": (rng.standard_normal((5, 4)) * 0.4).astype(np.float32)}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["per_sample"], reduction="none"),
             helper.make_node("Mul", ["per_sample", "sample_weight"], ["weighted"]),
             helper.make_node("ReduceMean", ["weighted"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "weighted_ce",
                          [helper.make_tensor_value_info("x", T.FLOAT, [8, 6]),
                           helper.make_tensor_value_info("y", T.INT64, [8]),
                           helper.make_tensor_value_info("sample_weight", T.FLOAT, [8])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in w.items()])
    return make_model(g, 17), w


def test_an_input_only_the_loss_reads_stays_float32() -> None:
    """onnxruntime's transformer leaves a float32 input that only the loss subgraph reads uncast: per-sample
    loss weights up to 3e5, beyond float16's range (inf once cast), give a finite loss and, under a loss
    scale of 2^-5 that keeps the weighted gradients within float16, finite gradients, which agree with
    float64 torch autograd (and onnxruntime runs the emitted graphs alike)."""
    model, w = _weighted_loss_model()
    mp = mixed_precision(model, "loss", "float16")
    info = mixed_precision_info(mp)
    assert not any(n.op_type == "Cast" and "sample_weight" in n.input for n in mp.graph.node)
    grad = gradient_checks(build_gradient_model(mp, info.scaled_loss, list(w), outputs=["loss"]),
                           [f"{k}_grad" for k in w])
    _check_all(mp, grad)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 6)).astype(np.float32)
    y = rng.integers(0, 4, 8)
    sw = np.array([1e5, 3e5, 0.5, 1.0, 2e5, 1.0, 7e4, 2.0], np.float32)
    scale = 2.0 ** -5
    out = _run_both(grad, {"x": x, "y": y, "sample_weight": sw, "loss_scale": np.array([scale], np.float32)})
    assert bool(np.asarray(out["all_gradients_finite"]))
    tw = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    logits = torch.relu(torch.tensor(x, dtype=torch.float64) @ tw["W"]) @ tw["W2"]
    per = torch.nn.functional.cross_entropy(logits, torch.tensor(y), reduction="none")
    loss = (per * torch.tensor(sw, dtype=torch.float64)).mean()
    loss.backward()
    np.testing.assert_allclose(float(out["loss"]), loss.item(), rtol=1e-2)
    for k in w:
        assert _rel(out[f"{k}_grad"] / scale, tw[k].grad.numpy()) < 1e-2, k


def _shape_born_model() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """MatMul → + ConstantOfShape(0.25) → Cast(to float) → · s (a scalar weight) → Where(> 0, ·, 0) →
    MatMul → squared error against integer targets cast to float."""
    rng = np.random.default_rng(0)
    w = {"W": (rng.standard_normal((6, 5)) * 0.4).astype(np.float32),
         "W2": (rng.standard_normal((5, 3)) * 0.4).astype(np.float32),
         "s": np.array(1.5, np.float32)}
    zero = numpy_helper.from_array(np.array([0.0], np.float32), "zero")
    quarter = numpy_helper.from_array(np.array([0.25], np.float32))
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Shape", ["h"], ["hs"]),
             helper.make_node("ConstantOfShape", ["hs"], ["c"], value=quarter),
             helper.make_node("Add", ["h", "c"], ["h2"]),
             helper.make_node("Cast", ["h2"], ["h3"], to=T.FLOAT),
             helper.make_node("Mul", ["h3", "s"], ["h4"]),
             helper.make_node("Greater", ["h4", "zero"], ["pos"]),
             helper.make_node("Where", ["pos", "h4", "zero"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["z"]),
             helper.make_node("Cast", ["y"], ["yf"], to=T.FLOAT),
             helper.make_node("Sub", ["z", "yf"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "shape_born",
                          [helper.make_tensor_value_info("x", T.FLOAT, [4, 6]),
                           helper.make_tensor_value_info("y", T.INT64, [4, 3])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("r", T.FLOAT, [4, 5])],
                          [*(numpy_helper.from_array(v, k) for k, v in w.items()), zero])
    return make_model(g, 17), w


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_constant_of_shape_and_float_casts_take_the_half_type(dtype: str) -> None:
    """As onnxruntime's TransformConstants: a ConstantOfShape's float32 output and a Cast to float of a half
    value feed the half compute in the half type (the chain between the two MatMuls stays half, no float32
    copy); the model output ``r`` is still float32; gradients (also of the scalar weight) agree with float64
    torch autograd and, for float16, onnxruntime runs the emitted graphs alike."""
    model, w = _shape_born_model()
    half = T.FLOAT16 if dtype == "float16" else T.BFLOAT16
    mp = mixed_precision(model, "loss", dtype)
    info = mixed_precision_info(mp)
    inferred = onnx.shape_inference.infer_shapes(mp).graph.value_info
    types_ = {v.name: v.type.tensor_type.elem_type for v in inferred}
    outputs = {o.name: o.type.tensor_type.elem_type for o in mp.graph.output}
    by_out = {n.output[0]: n for n in mp.graph.node}
    for v in ("h2", "h4", "z"):
        assert types_[v] == half, v
    cast = next(n for n in mp.graph.node if n.op_type == "Cast" and n.input[0] == "h2")
    assert next(a.i for a in cast.attribute if a.name == "to") == half  # follows its input, as onnxruntime
    assert by_out["r"].op_type == "Cast" and outputs["r"] == T.FLOAT
    grad = gradient_checks(build_gradient_model(mp, info.scaled_loss, list(w), outputs=["loss", "r"]),
                           [f"{k}_grad" for k in w])
    _check_all(mp, grad)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    y = rng.integers(-1, 2, (4, 3))
    scale = 256.0
    feeds = {"x": x, "y": y, "loss_scale": np.array([scale], np.float32)}
    if dtype == "float16":
        out = _run_both(grad, feeds)
    else:  # onnxruntime's CPU package has no bfloat16 kernels for these ops
        plan = compile_model(grad)
        out = dict(zip(plan.output_names, plan.run(feeds)))
    tw = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    h4 = (torch.tensor(x, dtype=torch.float64) @ tw["W"] + 0.25) * tw["s"]
    r = torch.where(h4 > 0, h4, torch.zeros((), dtype=torch.float64))
    loss = ((r @ tw["W2"] - torch.tensor(y, dtype=torch.float64)) ** 2).mean()
    loss.backward()
    tol = 1e-2 if dtype == "float16" else 4e-2
    np.testing.assert_allclose(float(out["loss"]), loss.item(), rtol=tol)
    for k in w:
        assert out[f"{k}_grad"].dtype == np.float32
        assert _rel(out[f"{k}_grad"] / scale, tw[k].grad.numpy()) < tol, k


# ---------------------------------------------------------------------------------------- recompute
@pytest.fixture(scope="module")
def gpt_grad() -> tuple[onnx.ModelProto, list]:
    from tests.graph_transforms import nets

    model = nets.gpt(4, dropout=0.1)
    grad = build_gradient_model(model, "loss", nets.trained(model))
    from onnxtrain.graph_transforms.recompute import find_transformer_layers

    return grad, find_transformer_layers(grad, "loss")


@pytest.mark.parametrize("number,layers", [(1, 1), (2, 2), (0, 3), (3, 3), (9, 3), (-1, 3)])
def test_transformer_layer_recompute_takes_the_first_layers(gpt_grad, number: int, layers: int) -> None:
    """onnxruntime's TransformerLayerRecompute on a 4-layer stack: ``number_recompute_layers`` k recomputes
    layers 0..k-1; 0 means every layer but the last, and more than that is cut to it with a warning, as is a
    negative value (onnxruntime's binding takes -1, which its transformer reads as the default; it was an
    error here); the last layer is never recomputed. Each clone is named after its node with ``_recompute``
    (a Dropout's rebuild: a few nodes named after it), runs after the forward part, and no clone draws random
    numbers (a Dropout is rebuilt from its saved mask)."""
    from onnxtrain.graph_transforms.recompute import transformer_layer_recompute

    grad, found = gpt_grad
    assert len(found) == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = transformer_layer_recompute(grad, "loss", number_recompute_layers=number)
    assert any("number_recompute_layers" in str(c.message) for c in caught) == (number > 3 or number < 0)
    onnx.checker.check_model(out, full_check=True)
    names = {n.name for n in grad.graph.node}
    forward_end = max(k for k, n in enumerate(out.graph.node) if "loss" in n.output)
    clones = [(k, n) for k, n in enumerate(out.graph.node) if n.name not in names]
    assert clones and all("_recompute" in n.name for _, n in clones)
    # a clone of a node is that node's name with _recompute; the rest are a rebuilt Dropout's few nodes
    assert {n.name[: -len("_recompute")] for _, n in clones if n.name.endswith("_recompute")} <= names
    assert all(k > forward_end for k, _ in clones)
    assert not any(n.op_type in ("Dropout", "RandomUniformLike", "RandomUniform", "Bernoulli")
                   for _, n in clones)
    rebuilt = {o[: -len("_recompute")] for _, n in clones for o in n.output if o.endswith("_recompute")}
    per_layer = [bool(rebuilt & values) for _, _, values in found]
    assert per_layer == [True] * layers + [False] * (4 - layers)


def test_dynamic_loss_scaler_reads_the_flag_as_run_returns_it() -> None:
    """The flag as a session's ``run`` returns it, a list holding the [1] array of ``all_gradients_finite``
    (the unpacking forgotten), is read for its value: ``[array([False])]`` halves the scale (it was truthy,
    so the scale never backed off and, under float16, every later step was skipped). A flag of more values
    is an error naming the argument; onnxruntime's ``TrainStepInfo`` (an ``all_finite`` attribute) and
    plain bools are read as before."""
    s = DynamicLossScaler(loss_scale=2.0 ** 10, up_scale_window=2)
    assert s.update([np.array([False])]) == 2.0 ** 9
    s.update_loss_scale([np.array([False])])
    assert s.loss_scale == 2.0 ** 8
    assert s.update((np.array([True]),)) == 2.0 ** 8 and s.stable_steps == 1
    assert s.update(types.SimpleNamespace(all_finite=np.array([True]))) == 2.0 ** 9
    assert s.update(np.bool_(False)) == 2.0 ** 8 and s.update(False) == 2.0 ** 7
    for bad in ([True, False], np.array([True, True]), []):
        with pytest.raises(ValueError, match="train_step_info"):
            s.update(bad)
    assert s.loss_scale == 2.0 ** 7


def test_legacy_session_takes_a_negative_number_recompute_layers_as_onnxruntime() -> None:
    """TrainingParameters.number_recompute_layers = -1 (onnxruntime's binding stores it, its transformer
    recomputes every layer but the last): the session builds the training graph of 0, with a warning naming
    the option (it failed: "number_recompute_layers must be >= 0")."""
    from onnxtrain import TrainingSession
    from tests.graph_transforms import nets
    from tests.session.helpers import params

    model = nets.gpt(3).SerializeToString()
    graphs = {}
    for n in (0, -1):
        p = params("SGDOptimizer", transformer_layer_recompute=True, number_recompute_layers=n)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess = TrainingSession(model, p)
        assert any("number_recompute_layers=-1" in str(c.message) for c in caught) == (n < 0)
        graphs[n] = [(m.op_type, list(m.input), list(m.output)) for m in sess._graphs.full.graph.node]
    assert graphs[-1] == graphs[0]

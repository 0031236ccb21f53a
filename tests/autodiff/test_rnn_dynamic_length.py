"""Gradients of LSTM, GRU and RNN nodes whose sequence length is known only at run time (X's sequence axis
symbolic, as torch exports it with ``dynamic_axes``): the rules of onnxtrain/autodiff/rules/rnn.py then
emit their recurrences as ``Scan`` nodes (rnn_loop.py) instead of unrolling them.

Oracles: central differences in float64 (one-node models covering the attributes), torch 2.13 autograd
(torch-exported ``nn.LSTM``/``nn.GRU``/``nn.RNN``, float32) and torch's own training (a few SGD steps of
the legacy TrainingSession). One gradient graph serves every length; each passes the ONNX checker with
full_check and gives the same values on onnxruntime's InferenceSession as on onnxtrain's engine.
"""

from __future__ import annotations

import io
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, run_engine

ort = pytest.importorskip("onnxruntime")

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
BATCH, N_IN, HID = 3, 3, 4


def _scans(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Scan" for n in model.graph.node)


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in sess.get_inputs()}
    return sess.run(None, {k: v for k, v in feeds.items() if k in names})


# ---- one-node models, float64 central differences ----------------------------------------------------

def _node_model(op: str, kw: dict[str, Any], dtype: Any) -> tuple[onnx.ModelProto, list[str]]:
    """One ``op`` node with X's sequence axis symbolic ("T") and a smooth loss of its outputs ``loss_on``
    (default all): loss = Σ_k Σ y_k·sin(y_k). Returns the model and the names of the differentiable
    inputs."""
    attrs = {k: v for k, v in kw.items() if k not in ("init", "bias", "peep", "lens", "n_outputs", "loss_on")}
    direction = attrs.get("direction", "forward")
    layout = attrs.get("layout", 0)
    dirs = 2 if direction == "bidirectional" else 1
    g = _GATES[op] * HID
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    x_shape = ["T", BATCH, N_IN] if layout == 0 else [BATCH, "T", N_IN]
    h_shape = [dirs, BATCH, HID] if layout == 0 else [BATCH, dirs, HID]
    ins = [("X", x_shape), ("W", [dirs, g, N_IN]), ("R", [dirs, g, HID])]
    ins.append(("B", [dirs, 2 * g]) if kw.get("bias", True) else None)
    ins.append(("lens", [BATCH]) if kw.get("lens") else None)
    ins.append(("h0", h_shape) if kw.get("init", True) else None)
    if op == "LSTM":
        ins.append(("c0", h_shape) if kw.get("init", True) else None)
        ins.append(("P", [dirs, 3 * HID]) if kw.get("peep") else None)
    while ins[-1] is None:
        ins.pop()
    n_out = kw.get("n_outputs", 3 if op == "LSTM" else 2)
    outs = ["Y", "Y_h", "Y_c"][:n_out]
    nodes = [helper.make_node(op, [i[0] if i else "" for i in ins], outs, name=f"{op}_0", hidden_size=HID,
                              **attrs)]
    terms = []
    for y in [outs[k] for k in kw.get("loss_on", range(n_out))]:
        nodes += [helper.make_node("Sin", [y], [f"{y}_sin"]),
                  helper.make_node("Mul", [y, f"{y}_sin"], [f"{y}_m"]),
                  helper.make_node("ReduceSum", [f"{y}_m"], [f"{y}_l"], keepdims=0)]
        terms.append(f"{y}_l")
    nodes.append(helper.make_node("Sum", terms, ["loss"]))
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32 if n == "lens" else et, s)
              for n, s in (i for i in ins if i)]
    graph = helper.make_graph(nodes, f"{op}_dynamic", inputs, [helper.make_tensor_value_info("loss", et, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return model, [i[0] for i in ins if i and i[0] != "lens"]


def _feeds(model: onnx.ModelProto, steps: int, dtype: Any, lens: list[int] | None, seed: int = 0
           ) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for v in model.graph.input:
        if v.name == "lens":
            out["lens"] = np.array(lens, np.int32)
            continue
        shape = [steps if d.dim_param == "T" else d.dim_value for d in v.type.tensor_type.shape.dim]
        scale = 0.6 if v.name in ("W", "R") else 0.5 if v.name in ("B", "P") else 1.0
        out[v.name] = rng.uniform(-scale, scale, shape).astype(dtype)
    return out


def _lens(steps: int) -> list[int]:
    """Per-sample lengths within ``steps``: one full, one shorter, one empty."""
    return [steps, max(steps - 2, 1), 0]


ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("RNN", "plain", {"init": False, "bias": False, "n_outputs": 1}),
    ("RNN", "bias_init", {}),
    ("RNN", "bidir", {"direction": "bidirectional"}),
    ("RNN", "reverse_layout1", {"direction": "reverse", "layout": 1}),
    ("RNN", "relu_clip_bidir", {"direction": "bidirectional", "activations": ["Relu", "Tanh"], "clip": 0.7}),
    ("RNN", "lens_bidir", {"direction": "bidirectional", "lens": True}),
    ("LSTM", "plain", {"init": False, "bias": False, "n_outputs": 1}),
    ("LSTM", "bias_init", {}),
    ("LSTM", "yh_only", {"n_outputs": 2, "direction": "reverse"}),
    ("LSTM", "bidir", {"direction": "bidirectional"}),
    ("LSTM", "bidir_noinit", {"direction": "bidirectional", "init": False}),
    ("LSTM", "peep_clip_bidir", {"direction": "bidirectional", "peep": True, "clip": 0.6}),
    ("LSTM", "peep_input_forget", {"peep": True, "input_forget": 1, "init": False}),
    ("LSTM", "input_forget_clip", {"input_forget": 1, "clip": 0.5}),
    ("LSTM", "yc_only_bidir", {"direction": "bidirectional", "loss_on": [2]}),
    ("LSTM", "peep_bidir_two_acts", {"direction": "bidirectional", "peep": True, "clip": 0.8,
                                     "activations": ["Sigmoid", "Tanh", "Tanh",
                                                     "HardSigmoid", "Elu", "Softsign"]}),
    ("LSTM", "layout1_bidir", {"direction": "bidirectional", "layout": 1}),
    ("LSTM", "acts", {"activations": ["HardSigmoid", "LeakyRelu", "ScaledTanh"],
                      "activation_alpha": [0.3, 0.05, 0.8], "activation_beta": [0.4, 1.2]}),
    ("LSTM", "lens", {"lens": True}),
    ("LSTM", "lens_bidir_peep", {"lens": True, "direction": "bidirectional", "peep": True}),
    ("LSTM", "lens_layout1_reverse", {"lens": True, "direction": "reverse", "layout": 1}),
    ("GRU", "plain", {"init": False, "bias": False, "n_outputs": 1}),
    ("GRU", "bias_init", {}),
    ("GRU", "lbr", {"linear_before_reset": 1}),
    ("GRU", "bidir_lbr", {"direction": "bidirectional", "linear_before_reset": 1}),
    ("GRU", "reverse_clip_noinit", {"direction": "reverse", "clip": 0.4, "init": False}),
    ("GRU", "layout1_bidir", {"direction": "bidirectional", "layout": 1}),
    ("GRU", "acts_lbr", {"activations": ["HardSigmoid", "Softplus"], "linear_before_reset": 1}),
    ("GRU", "lens", {"lens": True}),
    ("GRU", "yh_only_lbr_noinit", {"linear_before_reset": 1, "init": False, "loss_on": [1]}),
    ("GRU", "lens_bidir_lbr", {"lens": True, "direction": "bidirectional", "linear_before_reset": 1}),
]
IDS = [f"{r[0]}-{r[1]}" for r in ROWS]


@pytest.mark.parametrize("op,variant,kw", ROWS, ids=IDS)
def test_gradients_match_central_differences_at_several_lengths(op: str, variant: str,
                                                                kw: dict[str, Any]) -> None:
    model, wrt = _node_model(op, kw, np.float64)
    gmodel = build_gradient_model(model, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    assert _scans(gmodel) == (2 if op == "LSTM" else 1)
    grads = {}
    for steps in (4, 1, 6):
        feeds = _feeds(model, steps, np.float64, _lens(steps) if kw.get("lens") else None)
        got = gradcheck(model, "loss", wrt, feeds, rtol=1e-5, atol=1e-7)
        assert got["X"].shape == feeds["X"].shape
        grads[steps] = got
        # the one gradient graph built above, at this length, gives those gradients
        ours = run_engine(gmodel, feeds)[1:]
        for n, a in zip(wrt, ours):
            np.testing.assert_allclose(a, got[n], rtol=1e-12, atol=0, err_msg=f"{n} at T={steps}")
    assert all(np.abs(g).max() > 1e-3 for g in grads[4].values())  # every gradient is exercised


@pytest.mark.parametrize("static", [False, True], ids=["symbolic", "static"])
@pytest.mark.parametrize("op,variant,kw", ROWS, ids=IDS)
def test_gradients_over_no_step(op: str, variant: str, kw: dict[str, Any], static: bool) -> None:
    """A sequence of length 0 (fed to the symbolic axis, or declared 0): the final states are zeros, as
    for a sequence of length 0 in sequence_lens (and as onnxruntime's RNN and LSTM give Y_h at T = 0), so
    the loss is 0 and every gradient is 0; dX is empty. The static case failed to build (no gradient
    reached initial_h; LSTM: an IndexError), the symbolic one failed at run time on LSTM (the previous
    states had one step), and the kernels gave the initial states as the final ones. The loss adds each
    final state's sum, whose gradient at a zero state is 1, not 0."""
    model, wrt = _node_model(op, kw, np.float64)
    # plus Σ of each final state: a term whose gradient at a zero state is not 0
    nodes = model.graph.node
    nodes[-1].output[0] = "loss_smooth"
    states = [o for o in nodes[0].output[1:] if o]
    nodes.extend(helper.make_node("ReduceSum", [o], [f"{o}_sum"], keepdims=0) for o in states)
    nodes.append(helper.make_node("Sum", ["loss_smooth", *(f"{o}_sum" for o in states)], ["loss"]))
    if static:
        x_dims = model.graph.input[0].type.tensor_type.shape.dim
        x_dims[0 if kw.get("layout", 0) == 0 else 1].dim_value = 0
    gmodel = build_gradient_model(model, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    feeds = _feeds(model, 0, np.float64, [0] * BATCH if kw.get("lens") else None)
    loss, *grads = run_engine(gmodel, feeds)
    assert loss == 0.0
    for name, got in zip(wrt, grads):
        assert got.shape == feeds[name].shape, name
        assert not got.any(), name
    assert run_engine(model, feeds)[0] == 0.0  # the forward alone


@pytest.mark.parametrize("op,variant,kw", ROWS, ids=IDS)
def test_onnxruntime_gives_the_engine_values(op: str, variant: str, kw: dict[str, Any]) -> None:
    """The float32 gradient graph, at two lengths, on onnxruntime and on onnxtrain's engine."""
    if kw.get("layout"):
        pytest.skip("onnxruntime's recurrent kernels have no layout=1")
    model, wrt = _node_model(op, kw, np.float32)
    gmodel = build_gradient_model(model, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    for steps in (5, 2):
        feeds = _feeds(model, steps, np.float32, _lens(steps) if kw.get("lens") else None, seed=steps)
        ours, theirs = run_engine(gmodel, feeds), _run_ort(gmodel, feeds)
        assert len(ours) == len(wrt) + 1
        for name, a, b in zip(["loss", *wrt], ours, theirs):
            assert a.shape == b.shape, name
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6 * max(1.0, float(np.abs(b).max())),
                                       err_msg=f"{name} at T={steps}")


# ---- torch-exported layers against torch autograd ----------------------------------------------------

torch = pytest.importorskip("torch")


class _Layer(torch.nn.Module):
    """One recurrent layer and a smooth loss of its outputs: Σ out·sin(out) + Σ h_n²/2 (+ Σ cos c_n)."""

    def __init__(self, cell: str, bidirectional: bool, batch_first: bool):
        super().__init__()
        kind = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU, "rnn": torch.nn.RNN}[cell]
        self.cell = cell
        self.rnn = kind(N_IN, HID, bidirectional=bidirectional, batch_first=batch_first)

    def forward(self, x: Any, *state: Any) -> Any:
        if self.cell == "lstm":
            out, (h, c) = self.rnn(x, tuple(state) if state else None)
            extra = torch.cos(c).sum()
        else:
            out, h = self.rnn(x, state[0] if state else None)
            extra = 0.0
        return (out * torch.sin(out)).sum() + 0.5 * (h * h).sum() + extra


def _export(module: Any, args: tuple, names: list[str], seq_axis: int) -> onnx.ModelProto:
    dynamic = {"x": {seq_axis: "seq", 1 - seq_axis: "batch"}}
    dynamic.update({n: {1: "batch"} for n in names[1:]})
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buf, dynamo=False, opset_version=17, input_names=names,
                          output_names=["loss"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False, dynamic_axes=dynamic)
    return onnx.load_from_string(buf.getvalue())


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


TORCH_ROWS = [
    ("lstm", False, True, False), ("lstm", True, True, True), ("lstm", True, False, False),
    ("gru", False, True, False), ("gru", True, True, True), ("gru", False, False, True),
    ("rnn", False, True, False), ("rnn", True, False, True),
]


@pytest.mark.parametrize("cell,bidirectional,init,batch_first", TORCH_ROWS,
                         ids=[f"{c}-{'bi' if b else 'uni'}-{'init' if i else 'noinit'}-{'bf' if f else 'tf'}"
                              for c, b, i, f in TORCH_ROWS])
def test_torch_export_gradients_match_torch(cell: str, bidirectional: bool, init: bool,
                                            batch_first: bool) -> None:
    torch.manual_seed(0)
    module = _Layer(cell, bidirectional, batch_first)
    dirs = 2 if bidirectional else 1
    n_states = (2 if cell == "lstm" else 1) if init else 0
    names = ["x", "h0", "c0"][:1 + n_states]

    def args_for(steps: int, seed: int) -> tuple:
        rng = np.random.default_rng(seed)
        x = rng.standard_normal((BATCH, steps, N_IN) if batch_first else (steps, BATCH, N_IN))
        return (x.astype(np.float32),
                *(rng.standard_normal((dirs, BATCH, HID)).astype(np.float32) for _ in range(n_states)))

    example = tuple(torch.from_numpy(a) for a in args_for(3, 99))
    model = _export(module, example, names, 1 if batch_first else 0)
    x_dims = model.graph.input[0].type.tensor_type.shape.dim
    assert x_dims[1 if batch_first else 0].dim_param  # the sequence axis is symbolic
    params = [n for n, _ in module.named_parameters()]
    assert set(params) <= {t.name for t in model.graph.initializer}
    gmodel = build_gradient_model(model, "loss", params + names)
    onnx.checker.check_model(gmodel, full_check=True)
    assert _scans(gmodel) == (2 if cell == "lstm" else 1)
    out_names = [o.name for o in gmodel.graph.output]
    for steps in (7, 1, 4):
        args = args_for(steps, steps)
        feeds = dict(zip(names, args))
        ours = dict(zip(out_names, run_engine(gmodel, feeds)))
        onnxrt = dict(zip(out_names, _run_ort(gmodel, feeds)))
        module.zero_grad()
        tins = [torch.from_numpy(a).requires_grad_(True) for a in args]
        loss = module(*tins)
        loss.backward()
        ref = {**{n: p.grad.numpy() for n, p in module.named_parameters()},
               **{n: t.grad.numpy() for n, t in zip(names, tins)}}
        assert _rel(ours["loss"], loss.item()) < 1e-6
        for n, r in ref.items():
            a = ours[f"{n}_grad"]
            assert a.shape == r.shape, n
            assert _rel(a, r) < 2e-6, (steps, n, _rel(a, r))
            np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6 * float(np.abs(r).max()),
                                       err_msg=f"{n} at T={steps}")
            np.testing.assert_allclose(onnxrt[f"{n}_grad"], a, rtol=1e-4, atol=1e-6 * float(np.abs(a).max()),
                                       err_msg=f"{n} at T={steps} (onnxruntime)")


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_dynamo_export_with_dynamic_sequence_matches_torch(cell: str) -> None:
    """torch's default exporter, the sequence axis a ``Dim``: its weights reach the node through run-time
    Slices; the gradients at two lengths equal torch's."""
    torch.manual_seed(1)
    module = _Layer(cell, True, True)
    seq = torch.export.Dim("seq", min=2, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prog = torch.onnx.export(module, (torch.randn(BATCH, 5, N_IN),), dynamo=True, optimize=False,
                                 dynamic_shapes=({1: seq},), input_names=["x"], output_names=["loss"],
                                 verbose=False)
    model = prog.model_proto
    assert model.graph.input[0].type.tensor_type.shape.dim[1].dim_param
    params = [n for n, _ in module.named_parameters()]
    gmodel = build_gradient_model(model, "loss", [*params, "x"])
    onnx.checker.check_model(gmodel, full_check=True)
    assert _scans(gmodel) == (2 if cell == "lstm" else 1)
    out_names = [o.name for o in gmodel.graph.output]
    for steps in (8, 3):
        x = np.random.default_rng(steps).standard_normal((BATCH, steps, N_IN)).astype(np.float32)
        ours = dict(zip(out_names, run_engine(gmodel, {"x": x})))
        module.zero_grad()
        xt = torch.from_numpy(x).requires_grad_(True)
        module(xt).backward()
        ref = {**{n: p.grad.numpy() for n, p in module.named_parameters()}, "x": xt.grad.numpy()}
        for n, r in ref.items():
            assert _rel(ours[f"{n}_grad"], r) < 2e-6, (steps, n, _rel(ours[f"{n}_grad"], r))


# ---- training end to end ----------------------------------------------------------------------------

class _Regressor(torch.nn.Module):
    """Batch-first LSTM → its last step → Linear → MSE against a target."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = torch.nn.LSTM(N_IN, 8, batch_first=True)
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x: Any, target: Any) -> Any:
        out, _ = self.rnn(x)
        return torch.nn.functional.mse_loss(self.fc(out[:, -1]), target)


def test_training_session_trains_dynamic_length_lstm_as_torch_does() -> None:
    from onnxtrain import TrainingParameters, TrainingSession

    torch.manual_seed(0)
    module = _Regressor()
    rng = np.random.default_rng(0)
    x0 = torch.from_numpy(rng.standard_normal((2, 5, N_IN)).astype(np.float32))
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x0, torch.zeros(2, 1)), buf, dynamo=False, opset_version=17,
                          input_names=["x", "target"], output_names=["loss"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "target": {0: "batch"}})
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.enable_grad_norm_clip = False
    sess = TrainingSession(buf.getvalue(), p)
    assert sorted(sess.get_model_state()["full_precision"]) == sorted(n for n, _ in module.named_parameters())
    topt = torch.optim.SGD(module.parameters(), lr=0.1)
    lr = np.array([0.1], np.float32)
    losses = []
    for step, steps in enumerate((6, 3, 9, 1, 4, 6)):
        x = rng.standard_normal((4, steps, N_IN)).astype(np.float32)
        target = rng.standard_normal((4, 1)).astype(np.float32)
        ours = float(sess.run(["loss"], {"x": x, "target": target, "Learning_Rate": lr})[0])
        topt.zero_grad()
        theirs = module(torch.from_numpy(x), torch.from_numpy(target))
        theirs.backward()
        topt.step()
        assert abs(ours - theirs.item()) <= 1e-5 * abs(theirs.item()), (step, ours, theirs.item())
        losses.append(ours)
    state = sess.get_state()
    for n, v in module.named_parameters():  # the same weights after six steps of their own
        assert _rel(state[n], v.detach().numpy()) < 1e-5, n
    assert losses[-1] != losses[0]


def test_on_device_artifacts_train_dynamic_length_gru_as_torch_does(tmp_path: Any) -> None:
    """generate_artifacts on a bidirectional GRU classifier exported with a dynamic sequence axis; Module and
    Optimizer step at three lengths as torch's SGD does."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    class Classifier(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.GRU(N_IN, 8, batch_first=True, bidirectional=True)
            self.fc = torch.nn.Linear(16, 4)

        def forward(self, x: Any) -> Any:
            out, _ = self.rnn(x)
            return self.fc(out[:, -1])

    torch.manual_seed(0)
    module = Classifier()
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 5, N_IN),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["logits"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={"x": {0: "batch", 1: "seq"}, "logits": {0: "batch"}})
    params = [n for n, _ in module.named_parameters()]
    artifacts.generate_artifacts(onnx.load_from_string(buf.getvalue()), requires_grad=params,
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    ours = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), ours)
    opt.set_learning_rate(0.5)
    topt = torch.optim.SGD(module.parameters(), lr=0.5)
    rng = np.random.default_rng(0)
    for steps in (6, 2, 9, 1):
        x = rng.standard_normal((4, steps, N_IN)).astype(np.float32)
        y = rng.integers(0, 4, 4).astype(np.int64)
        loss = float(ours(x, y))
        opt.step()
        ours.lazy_reset_grad()
        topt.zero_grad()
        theirs = torch.nn.functional.cross_entropy(module(torch.from_numpy(x)), torch.from_numpy(y))
        theirs.backward()
        topt.step()
        assert abs(loss - theirs.item()) <= 1e-5 * abs(theirs.item()), (steps, loss, theirs.item())

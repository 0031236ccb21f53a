"""onnxruntime-training's gradient-graph tests, ported to onnxtrain's ``GradientGraphBuilder``.

Sources (microsoft/onnxruntime, ``orttraining/orttraining/test/``):
``python/orttraining_test_gradient_graph.py``,
``python/orttraining_test_experimental_gradient_graph.py``, ``python/orttraining_test_lstm.py``,
``python/orttraining_test_gru.py`` and ``graph/gradient_graph_builder_test.cc``. What is taken from them is
facts: the models, the names the gradient graph has, the cases (shapes, directions, states). The oracles
are torch autograd (float64) and onnxruntime's inference package; every built graph passes
``onnx.checker.check_model(full_check=True)`` and runs in onnxruntime with the engine's values.

onnxruntime tested its own ``LSTMGrad``/``GRUGrad`` kernels (com.microsoft) against numpy loops; onnxtrain
differentiates the standard ``LSTM``/``GRU`` nodes, so each of their cases here is a one-node model whose
outputs all take an incoming gradient (``<y>_grad`` inputs: the builder's loss name is empty), as their
backward kernels took ``grad_all_hidden_states``, ``grad_final_hidden_state`` (and ``grad_final_cell_state``).
The torch side writes ONNX's equations out (gate order i, o, f, c for LSTM; z, r, h for GRU) and lets
autograd differentiate them.

Their inputs are uniform in [0, 1), so with 32 hidden units most gates saturate: in float32, sigmoid rounds
to 1 and the gradients through such gates (about 1e-5 of the largest one, the initial cell state's) keep few
digits. Each case is therefore checked twice: the float64 copy of the gradient graph on the engine against
torch to 1e-9, and the float32 graph on the engine and in onnxruntime to 1e-5 of the case's largest value.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain import GradientGraphBuilder
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine, to_float64
from tests.ortt import PREAMBLE, run_script
from tests.tiers import extended

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")


# ------------------------------------------------------------------------------------------ helpers


def _run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's outputs by name, run by onnxruntime's CPU provider."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in model.graph.output], sess.run(None, feeds)))


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The model's outputs by name, run by onnxtrain's engine."""
    return dict(zip([o.name for o in model.graph.output], run_engine(model, feeds)))


def _build(model: onnx.ModelProto, ys: Any, xs: Any, loss: str) -> onnx.ModelProto:
    """The gradient model GradientGraphBuilder writes for ``model``, checked by onnx's full checker."""
    b = GradientGraphBuilder(model.SerializeToString(), ys, xs, loss)
    b.build()
    built = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(built, full_check=True)
    return built


# ------------------------------------------------------------------------------- recurrent cases


def _recurrent_model(op: str, steps: int, batch: int, n_in: int, hid: int, direction: str, bias: bool,
                     lens: bool, h0: bool, c0: bool, peep: bool, **attrs: Any) -> onnx.ModelProto:
    """One LSTM or GRU node whose inputs are all graph inputs and whose outputs are all graph outputs."""
    gates = 4 if op == "LSTM" else 3
    dirs = 2 if direction == "bidirectional" else 1
    vi = helper.make_tensor_value_info
    inputs = [vi("X", T.FLOAT, [steps, batch, n_in]), vi("W", T.FLOAT, [dirs, gates * hid, n_in]),
              vi("R", T.FLOAT, [dirs, gates * hid, hid])]
    slots = ["X", "W", "R"]
    optional = [("B", bias, T.FLOAT, [dirs, 2 * gates * hid]), ("sequence_lens", lens, T.INT32, [batch]),
                ("initial_h", h0, T.FLOAT, [dirs, batch, hid])]
    if op == "LSTM":
        optional += [("initial_c", c0, T.FLOAT, [dirs, batch, hid]), ("P", peep, T.FLOAT, [dirs, 3 * hid])]
    for name, present, et, shape in optional:
        slots.append(name if present else "")
        if present:
            inputs.append(vi(name, et, shape))
    while slots[-1] == "":
        slots.pop()
    outs = ["Y", "Y_h", "Y_c"] if op == "LSTM" else ["Y", "Y_h"]
    shapes = {"Y": [steps, dirs, batch, hid], "Y_h": [dirs, batch, hid], "Y_c": [dirs, batch, hid]}
    node = helper.make_node(op, slots, outs, hidden_size=hid, direction=direction, **attrs)
    graph = helper.make_graph([node], op.lower(), inputs, [vi(o, T.FLOAT, shapes[o]) for o in outs])
    return make_model(graph, 17)


def _walks(direction: str, dirs: int) -> list[bool]:
    """Per direction of the node, whether it walks the sequence backwards."""
    return [direction == "reverse" or (direction == "bidirectional" and d == 1) for d in range(dirs)]


def _emptied(state: Any, lens: Any) -> Any:
    """``state`` with the rows of samples of length 0 zeroed: onnxruntime's LSTM and GRU give such a sample
    zero final states, not its initial ones."""
    return state if lens is None else torch.where((lens > 0)[:, None], state, torch.zeros_like(state))


def _torch_lstm(t: dict[str, Any], lens: Any, direction: str) -> tuple:
    """Y, Y_h, Y_c of ONNX's LSTM (default activations), written out in torch."""
    X, W, R = t["X"], t["W"], t["R"]
    steps, batch, _ = X.shape
    hid = R.shape[2]
    ys, hs, cs = [], [], []
    for d, backwards in enumerate(_walks(direction, W.shape[0])):
        h = t["initial_h"][d] if "initial_h" in t else X.new_zeros(batch, hid)
        c = t["initial_c"][d] if "initial_c" in t else X.new_zeros(batch, hid)
        b = t["B"][d, :4 * hid] + t["B"][d, 4 * hid:] if "B" in t else 0.0
        p_i, p_o, p_f = (t["P"][d, k * hid:(k + 1) * hid] for k in range(3)) if "P" in t else (0.0, 0.0, 0.0)
        y = [None] * steps
        for s in (reversed(range(steps)) if backwards else range(steps)):
            a = X[s] @ W[d].T + h @ R[d].T + b
            a_i, a_o, a_f, a_c = (a[:, k * hid:(k + 1) * hid] for k in range(4))
            i = torch.sigmoid(a_i + p_i * c)
            f = torch.sigmoid(a_f + p_f * c)
            c_new = f * c + i * torch.tanh(a_c)
            h_new = torch.sigmoid(a_o + p_o * c_new) * torch.tanh(c_new)
            live = (s < lens)[:, None] if lens is not None else torch.ones(batch, 1, dtype=torch.bool)
            h, c = torch.where(live, h_new, h), torch.where(live, c_new, c)
            y[s] = torch.where(live, h_new, torch.zeros_like(h_new))
        ys.append(torch.stack(y))
        hs.append(_emptied(h, lens))
        cs.append(_emptied(c, lens))
    return torch.stack(ys, 1), torch.stack(hs), torch.stack(cs)


def _torch_gru(t: dict[str, Any], lens: Any, direction: str, linear_before_reset: int = 0) -> tuple:
    """Y, Y_h of ONNX's GRU (default activations), written out in torch."""
    X, W, R = t["X"], t["W"], t["R"]
    steps, batch, _ = X.shape
    hid = R.shape[2]
    ys, hs = [], []
    for d, backwards in enumerate(_walks(direction, W.shape[0])):
        h = t["initial_h"][d] if "initial_h" in t else X.new_zeros(batch, hid)
        wb = t["B"][d, :3 * hid] if "B" in t else X.new_zeros(3 * hid)
        rb = t["B"][d, 3 * hid:] if "B" in t else X.new_zeros(3 * hid)
        r_z, r_r, r_h = (R[d, k * hid:(k + 1) * hid] for k in range(3))
        y = [None] * steps
        for s in (reversed(range(steps)) if backwards else range(steps)):
            xw = X[s] @ W[d].T + wb
            z = torch.sigmoid(xw[:, :hid] + h @ r_z.T + rb[:hid])
            r = torch.sigmoid(xw[:, hid:2 * hid] + h @ r_r.T + rb[hid:2 * hid])
            if linear_before_reset:
                cand = torch.tanh(xw[:, 2 * hid:] + r * (h @ r_h.T + rb[2 * hid:]))
            else:
                cand = torch.tanh(xw[:, 2 * hid:] + (r * h) @ r_h.T + rb[2 * hid:])
            h_new = (1 - z) * cand + z * h
            live = (s < lens)[:, None] if lens is not None else torch.ones(batch, 1, dtype=torch.bool)
            h = torch.where(live, h_new, h)
            y[s] = torch.where(live, h_new, torch.zeros_like(h_new))
        ys.append(torch.stack(y))
        hs.append(_emptied(h, lens))
    return torch.stack(ys, 1), torch.stack(hs)


def _check_recurrent(op: str, steps: int, batch: int, n_in: int, hid: int, direction: str = "forward",
                     bias: bool = True, lens: bool = False, h0: bool = True, c0: bool = True,
                     peep: bool = False, linear_before_reset: int = 0, seed: int = 0,
                     dynamic: bool = False, lengths: list[int] | None = None) -> None:
    """Build the gradient graph of one LSTM/GRU node with every output given an incoming gradient and
    compare its outputs (forward values and the gradients of every float input) with torch autograd.
    ``dynamic``: X's and Y's sequence axis is the symbolic dim ``steps``; ``lengths``: the sequence_lens fed
    (drawn when not given)."""
    lens = lens or lengths is not None
    attrs = {"linear_before_reset": linear_before_reset} if op == "GRU" else {}
    model = _recurrent_model(op, steps, batch, n_in, hid, direction, bias, lens, h0, c0, peep, **attrs)
    if dynamic:
        for v in (model.graph.input[0], model.graph.output[0]):
            v.type.tensor_type.shape.dim[0].dim_param = "steps"
    ys = [o.name for o in model.graph.output]
    xs = [i.name for i in model.graph.input if i.name != "sequence_lens"]
    built = _build(model, ys, xs, "")  # no loss: every y takes its gradient as an input
    names = [i.name for i in built.graph.input]
    assert names == [i.name for i in model.graph.input] + [f"{y}_grad" for y in ys]
    assert [o.name for o in built.graph.output] == ys + [f"{x}_grad" for x in xs]

    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for i in built.graph.input:
        shape = [d.dim_value or steps for d in i.type.tensor_type.shape.dim]  # (a symbolic dim: the steps)
        if i.name == "sequence_lens":  # lengths from 1 to the steps, the first sample the longest
            drawn = np.r_[steps, rng.integers(1, steps + 1, batch - 1)]
            feeds[i.name] = np.array(drawn if lengths is None else lengths, np.int32)
        else:  # as onnxruntime's tests drew them: uniform in [0, 1)
            feeds[i.name] = rng.random(shape)

    leaves = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items() if k in xs}
    seq = torch.tensor(feeds["sequence_lens"]) if lens else None
    outs = (_torch_lstm(leaves, seq, direction) if op == "LSTM"
            else _torch_gru(leaves, seq, direction, linear_before_reset))
    sum(((o * torch.tensor(feeds[f"{y}_grad"])).sum() for o, y in zip(outs, ys))).backward()
    want = {y: o.detach().numpy() for y, o in zip(ys, outs)}
    want.update({f"{x}_grad": leaves[x].grad.numpy() for x in xs})

    got64 = _run(to_float64(built), feeds)
    for name, value in want.items():
        err = np.abs(got64[name] - value).max()
        assert err <= 1e-9 * max(np.abs(value).max(), 1e-3), f"{name}: float64 graph {err:.3g} off torch"

    feeds32 = {k: v.astype(np.float32) if v.dtype == np.float64 else v for k, v in feeds.items()}
    scale = max(np.abs(v).max() for v in want.values())
    for who, got in (("engine", _run(built, feeds32)), ("onnxruntime", _run_ort(built, feeds32))):
        for name, value in want.items():
            err = np.abs(got[name] - value).max()
            assert err <= 1e-5 * scale, f"{name}: {who}'s float32 run {err:.3g} off torch (scale {scale:.3g})"


def _lstm_grid() -> list[Any]:
    """orttraining_test_lstm.py's shapes: steps × batch × input × hidden over {2, 4, 16, 32} × {2, 4, 32}³;
    by default a spread of them in which every size of every axis appears, all with ONNXTRAIN_FULL_TESTS=1."""
    default = {(2, 2, 2, 2), (4, 4, 4, 4), (16, 32, 2, 4), (32, 2, 32, 4), (32, 32, 32, 32), (2, 32, 4, 32),
               (16, 4, 32, 2), (4, 2, 2, 32)}
    cases = []
    for steps in (2, 4, 16, 32):
        for batch in (2, 4, 32):
            for n_in in (2, 4, 32):
                for hid in (2, 4, 32):
                    key = (steps, batch, n_in, hid)
                    cid = "S{}-N{}-I{}-H{}".format(*key)
                    cases.append(pytest.param(*key, id=cid) if key in default else extended(*key, id=cid))
    return cases


@pytest.mark.parametrize(("steps", "batch", "n_in", "hid"), _lstm_grid())
def test_lstm_gradients_over_onnxruntimes_shapes(steps: int, batch: int, n_in: int, hid: int) -> None:
    """orttraining_test_lstm.py::test_lstm_backward (and test_lstm_forward): forward direction, B, initial_h
    and initial_c given, every output's gradient given."""
    _check_recurrent("LSTM", steps, batch, n_in, hid)


LSTM_VARIANTS = {
    "reverse": {"direction": "reverse"},
    "bidirectional": {"direction": "bidirectional"},
    "no_bias_no_states": {"bias": False, "h0": False, "c0": False},
    "initial_h_only": {"c0": False},
    "initial_c_only": {"h0": False},
    "sequence_lens": {"lens": True},
    "sequence_lens_with_zeros": {"lengths": [0, 5, 2]},
    "reverse_sequence_lens": {"direction": "reverse", "lens": True},
    "bidirectional_sequence_lens_peepholes": {"direction": "bidirectional", "lens": True, "peep": True},
    "peepholes_no_states": {"peep": True, "h0": False, "c0": False},
    "symbolic_steps_bidirectional": {"direction": "bidirectional", "lens": True, "dynamic": True},
}


@pytest.mark.parametrize("variant", list(LSTM_VARIANTS))
def test_lstm_gradients_over_directions_states_and_lengths(variant: str) -> None:
    """orttraining_test_lstm.py's LSTM class: the inputs it takes beside its tested defaults
    (sequence_lengths, initial states left out, peephole_weights), with ONNX's directions, at steps 5,
    batch 3; also lengths of 0 (zero final states, as onnxruntime gives) and a symbolic sequence axis (the
    Scan form of the rule)."""
    _check_recurrent("LSTM", 5, 3, 4, 6, **LSTM_VARIANTS[variant])


@pytest.mark.parametrize("linear_before_reset", [1, 0])
@pytest.mark.parametrize("steps", [2, 4, 16, 32])
def test_gru_gradients_over_onnxruntimes_cases(steps: int, linear_before_reset: int) -> None:
    """orttraining_test_gru.py::test_gru_backward (and test_gru_forward): batch, input and hidden 32, forward
    direction, B and initial_h given, linear_before_reset on and off, both outputs' gradients given."""
    _check_recurrent("GRU", steps, 32, 32, 32, linear_before_reset=linear_before_reset)


GRU_VARIANTS = {
    "reverse": {"direction": "reverse"},
    "bidirectional_lbr": {"direction": "bidirectional", "linear_before_reset": 1},
    "no_bias_no_state": {"bias": False, "h0": False},
    "sequence_lens": {"lens": True},
    "sequence_lens_lbr": {"lens": True, "linear_before_reset": 1},
    "bidirectional_sequence_lens": {"direction": "bidirectional", "lens": True},
    "bidirectional_sequence_lens_with_zeros": {"direction": "bidirectional", "lengths": [3, 0, 0]},
    "symbolic_steps_sequence_lens": {"lens": True, "dynamic": True},
}


@pytest.mark.parametrize("variant", list(GRU_VARIANTS))
def test_gru_gradients_over_directions_states_and_lengths(variant: str) -> None:
    """orttraining_test_gru.py's GRU class: the inputs it takes beside its tested defaults (sequence_lengths,
    no initial state), with ONNX's directions, at steps 5, batch 3; also lengths of 0 and a symbolic
    sequence axis."""
    _check_recurrent("GRU", 5, 3, 4, 6, **GRU_VARIANTS[variant])



_KERNELS_SCRIPT = PREAMBLE + r"""
import numpy as np, onnxruntime as ort
folder, count = sys.argv[1], int(sys.argv[2])
for i in range(count):
    s = ort.InferenceSession(f"{folder}/model{i}.onnx", providers=["CPUExecutionProvider"])
    np.savez(f"{folder}/outputs{i}.npz", *s.run(None, dict(np.load(f"{folder}/feeds{i}.npz"))))
print("null")
"""


def _training_kernels_model(op: str, steps: int, batch: int, n_in: int, hid: int,
                            linear_before_reset: int) -> onnx.ModelProto:
    """onnxruntime-training's forward and backward recurrent kernels (com.microsoft LSTMTraining + LSTMGrad,
    or GRUTraining + GRUGrad), one direction, B and the initial states given, as in its tests; the inputs and
    outputs carry the names of the standard node's gradient graph (X ... Y_grad; Y, Y_h, X_grad ...)."""
    vi = helper.make_tensor_value_info
    gates = 4 if op == "LSTM" else 3
    state = [1, batch, hid]
    inputs = [vi("X", T.FLOAT, [steps, batch, n_in]), vi("W", T.FLOAT, [1, gates * hid, n_in]),
              vi("R", T.FLOAT, [1, gates * hid, hid]), vi("B", T.FLOAT, [1, 2 * gates * hid]),
              vi("initial_h", T.FLOAT, state)]
    ms = {"domain": "com.microsoft", "hidden_size": hid}
    if op == "LSTM":  # (1.19.2's LSTMGrad reads no B: the gates' values come in IOFC)
        inputs.append(vi("initial_c", T.FLOAT, state))
        grads = ["Y_grad", "Y_h_grad", "Y_c_grad"]
        states = ["initial_h", "initial_c"]
        nodes = [helper.make_node("LSTMTraining", ["X", "W", "R", "B", "", *states],
                                  ["Y", "Y_h", "Y_c", "c_all", "iofc"], **ms),
                 helper.make_node("LSTMGrad", ["X", "W", "R", "", *states, "Y", "c_all", "iofc", *grads],
                                  [f"{v}_grad" for v in ("X", "W", "R", "B", *states)], **ms)]
    else:
        ms["linear_before_reset"] = linear_before_reset
        grads = ["Y_grad", "Y_h_grad"]
        nodes = [helper.make_node("GRUTraining", ["X", "W", "R", "B", "", "initial_h"], ["Y", "Y_h", "zrh"],
                                  **ms),
                 helper.make_node("GRUGrad", ["X", "W", "R", "B", "", "initial_h", "Y", "zrh", *grads],
                                  ["X_grad", "W_grad", "R_grad", "B_grad", "initial_h_grad"], **ms)]
    inputs += [vi(g, T.FLOAT, [steps, 1, batch, hid] if g == "Y_grad" else state) for g in grads]
    xs = [i.name for i in inputs if not i.name.endswith("_grad")]
    outputs = [vi(n, T.FLOAT, None) for n in ([y[:-5] for y in grads] + [f"{x}_grad" for x in xs])]
    opsets = [helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)]
    graph = helper.make_graph(nodes, op, inputs, outputs)
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


TRAINING_KERNEL_CASES = [("LSTM", 2, 2, 2, 2, 0), ("LSTM", 16, 4, 32, 4, 0), ("LSTM", 32, 32, 32, 32, 0),
                         ("GRU", 2, 32, 32, 32, 0), ("GRU", 16, 32, 32, 32, 1), ("GRU", 4, 3, 2, 5, 1)]


@pytest.mark.slow
def test_recurrent_gradients_match_onnxruntime_trainings_own_kernels(tmp_path: Any) -> None:
    """orttraining_test_lstm.py / orttraining_test_gru.py's oracle the other way round: their LSTMGrad and
    GRUGrad kernels (onnxruntime-training 1.19.2, CPU, fed the forward kernels' own intermediates) give the
    gradients of the standard LSTM and GRU nodes' gradient graphs, at some of their shapes, float32."""
    feeds, built = [], []
    for i, (op, steps, batch, n_in, hid, lbr) in enumerate(TRAINING_KERNEL_CASES):
        attrs = {"linear_before_reset": lbr} if op == "GRU" else {}
        model = _recurrent_model(op, steps, batch, n_in, hid, "forward", bias=True, lens=False, h0=True,
                                 c0=True, peep=False, **attrs)
        ys = [o.name for o in model.graph.output]
        built.append(_build(model, ys, [i.name for i in model.graph.input], ""))
        theirs = _training_kernels_model(op, steps, batch, n_in, hid, lbr)
        assert [v.name for v in theirs.graph.input] == [v.name for v in built[-1].graph.input]
        onnx.save(theirs, tmp_path / f"model{i}.onnx")
        rng = np.random.default_rng(i)
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in theirs.graph.input}
        feeds.append({name: rng.random(shape).astype(np.float32) for name, shape in shapes.items()})
        np.savez(tmp_path / f"feeds{i}.npz", **feeds[-1])
    run_script(_KERNELS_SCRIPT, str(tmp_path), str(len(feeds)))
    for i, case in enumerate(TRAINING_KERNEL_CASES):
        got = _run(built[i], feeds[i])
        theirs = np.load(tmp_path / f"outputs{i}.npz")
        want = [theirs[f"arr_{k}"] for k in range(len(theirs.files))]
        scale = max(np.abs(w).max() for w in want)
        for name, value in zip([o.name for o in built[i].graph.output], want):
            err = np.abs(got[name] - value).max()
            assert err <= 1e-5 * scale, f"{case} {name}: {err:.3g} off onnxruntime-training's kernel"

# ------------------------------------------------------------------------------- torch-exported models


class _TwoLayers(torch.nn.Module):
    """orttraining_test_gradient_graph.py's NeuralNet: fc1 → ReLU → fc2 and a loss of the output and label,
    both returned."""

    def __init__(self, n_in: int, hid: int, classes: int, loss_fn: Any):
        super().__init__()
        self.fc1 = torch.nn.Linear(n_in, hid)
        self.fc2 = torch.nn.Linear(hid, classes)
        self.loss_fn = loss_fn

    def forward(self, x: Any, label: Any) -> tuple:
        out = self.fc2(torch.relu(self.fc1(x)))
        return out, self.loss_fn(out, label)


def _export(module: Any, args: tuple, path: Any, inputs: list[str], outputs: list[str]) -> None:
    """TorchScript export as onnxruntime's tests made it: opset 12, training mode, no constant folding, the
    batch axis of the data, the labels and the output dynamic."""
    batch = {0: "batch_size"}
    torch.onnx.export(module, args, str(path), dynamo=False, export_params=True, opset_version=12,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                      input_names=inputs, output_names=outputs,
                      dynamic_axes={inputs[0]: batch, inputs[1]: batch, outputs[0]: batch})


def _torch_values(module: Any, args: tuple, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """The module's output and loss and the gradients of the loss w.r.t. ``params``, by torch autograd."""
    for p in params.values():
        p.grad = None
    out, loss = module(*args)
    loss.backward()
    got = {"output": out.detach().numpy(), "loss": loss.detach().numpy()}
    got.update({f"{n}_grad": p.grad.numpy() for n, p in params.items()})
    return got


def _assert_values(got: dict[str, np.ndarray], want: dict[str, np.ndarray], who: str) -> None:
    for name, value in want.items():
        assert got[name].shape == value.shape, (who, name)
        np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{who}: {name}")


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_torchscript_mlp_with_cross_entropy_saves_and_runs_in_onnxruntime(tmp_path: Any) -> None:
    """orttraining_test_gradient_graph.py::test_save: the model exported with nn.CrossEntropyLoss, the
    builder given the file's path, {'loss'} and the four weights as sets, the graph saved, loaded, checked and
    run in an InferenceSession. Beyond their test (whose TODO was "test that gradients exist"): the outputs
    are the model's then the sorted gradients, and their values are torch's at batch 1 and 4. (onnxruntime-
    training 1.19.2's own builder fails on this export, the one-output SoftmaxCrossEntropyLoss, unless its
    ORTModule symbolic registry was set up first, as their test did.)"""
    torch.manual_seed(0)
    module = _TwoLayers(10, 5, 2, torch.nn.CrossEntropyLoss()).train()
    x, label = torch.randn(1, 10), torch.tensor([1])
    path = tmp_path / "model.onnx"
    _export(module, (x, label), path, ["input", "label"], ["output", "loss"])
    weights = {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    b = GradientGraphBuilder(str(path), {"loss"}, weights, "loss")
    b.build()
    b.save(str(tmp_path / "gradient_graph_model.onnx"))
    built = onnx.load(str(tmp_path / "gradient_graph_model.onnx"))
    onnx.checker.check_model(built, full_check=True)
    assert [i.name for i in built.graph.input] == ["input", "label"]
    assert [o.name for o in built.graph.output] == ["output", "loss", *(f"{w}_grad" for w in sorted(weights))]
    saved = str(tmp_path / "gradient_graph_model.onnx")
    sess = ort.InferenceSession(saved, providers=["CPUExecutionProvider"])
    params = dict(module.named_parameters())
    for batch in (1, 4):
        x, label = torch.randn(batch, 10), torch.randint(0, 2, (batch,))
        want = _torch_values(module, (x, label), params)
        feeds = {"input": x.numpy(), "label": label.numpy()}
        names = [o.name for o in built.graph.output]
        _assert_values(dict(zip(names, sess.run(None, feeds))), want, f"onnxruntime, batch {batch}")
        _assert_values(_run(built, feeds), want, f"engine, batch {batch}")


def _log2_cross_entropy(out: Any, target: Any) -> Any:
    """orttraining_test_experimental_gradient_graph.py's binary_cross_entropy_loss: the two logits read as
    probabilities, through log2."""
    return -torch.sum(target * torch.log2(out[:, 0]) + (1 - target) * torch.log2(out[:, 1]))


class _WithFrozenLayer(torch.nn.Module):
    """The experimental test's NeuralNet: a frozen bias-free Linear (no gradient wanted), then fc1 → ReLU →
    fc2."""

    def __init__(self, n_in: int, emb: int, hid: int, classes: int):
        super().__init__()
        self.frozen_layer = torch.nn.Linear(n_in, emb, bias=False)
        self.frozen_layer.requires_grad_(False)
        self.fc1 = torch.nn.Linear(emb, hid)
        self.fc2 = torch.nn.Linear(hid, classes)

    def forward(self, x: Any) -> Any:
        return self.forward_with(x, dict(self.named_parameters()))

    @staticmethod
    def forward_with(x: Any, p: dict[str, Any]) -> Any:
        """The forward with the parameters ``p`` (by name) in place of the module's."""
        linear = torch.nn.functional.linear
        h = linear(x, p["frozen_layer.weight"])
        h = torch.relu(linear(h, p["fc1.weight"], p["fc1.bias"]))
        return linear(h, p["fc2.weight"], p["fc2.bias"])


class _ParamsAsInputs(torch.nn.Module):
    """The model and loss with the model's parameters as arguments, so the export makes them graph inputs (as
    export_gradient_graph's wrapper did)."""

    def __init__(self, model: Any, loss_fn: Any):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn
        self.names = [n for n, _ in model.named_parameters()]

    def forward(self, x: Any, labels: Any, *params: Any) -> tuple:
        out = self.model.forward_with(x, dict(zip(self.names, params)))
        return out, self.loss_fn(out, labels)


@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")
def test_parameters_as_inputs_and_a_frozen_layer_as_export_gradient_graph_made_them(tmp_path: Any) -> None:
    """orttraining_test_experimental_gradient_graph.py::test_save (export_gradient_graph, which onnxtrain does
    not provide: it needs torch): the parameters are graph inputs and only those that require grad are
    asked for; the graph's inputs are the data, the int64 labels and the five parameters, its outputs the
    prediction, the loss and four ``<name>_grad`` of the parameters' shapes; values are torch's, in
    onnxruntime and on the engine. (fc2's bias is raised to 3 so the logits, read through log2, are positive:
    their test compared NaN with NaN when one was not.)"""
    torch.manual_seed(0)
    model = _WithFrozenLayer(10, 20, 5, 2)
    with torch.no_grad():
        model.fc2.bias.fill_(3.0)
    wrapper = _ParamsAsInputs(model, _log2_cross_entropy)
    params = dict(model.named_parameters())
    x, labels = torch.randn(1, 10), torch.tensor([1])
    path = tmp_path / "exported.onnx"
    _export(wrapper, (x, labels, *params.values()), path, ["input", "labels", *params], ["output", "loss"])
    trainable = {n for n, p in params.items() if p.requires_grad}
    assert len(trainable) == 4
    built = _build(onnx.load(str(path)), {"loss"}, trainable, "loss")
    assert [i.name for i in built.graph.input] == ["input", "labels", *params]
    grads = [f"{n}_grad" for n in sorted(trainable)]
    assert [o.name for o in built.graph.output] == ["output", "loss", *grads]
    assert built.graph.input[1].type.tensor_type.elem_type == T.INT64

    for batch in (1, 3):
        x, labels = torch.randn(batch, 10), torch.randint(0, 2, (batch,))
        feeds = {"input": x.numpy(), "labels": labels.numpy()}
        feeds.update({n: p.detach().numpy() for n, p in params.items()})
        with torch.no_grad():
            out = model(x)
        leaves = {n: p.detach().clone().requires_grad_(True) for n, p in params.items() if p.requires_grad}
        loss = _log2_cross_entropy(model.forward_with(x, {**params, **leaves}), labels)
        loss.backward()
        want = {"output": out.numpy(), "loss": loss.detach().numpy(),
                **{f"{n}_grad": p.grad.numpy() for n, p in leaves.items()}}
        assert np.isfinite(want["loss"])
        _assert_values(_run_ort(built, feeds), want, f"onnxruntime, batch {batch}")
        _assert_values(_run(built, feeds), want, f"engine, batch {batch}")


# ------------------------------------------------------------------------------- builder behaviours


def _embedding_model() -> onnx.ModelProto:
    """int64 ids → Gather from E → MatMul by W twice (W shared) → Relu → ReduceSum; a second output off
    the loss's path."""
    e = helper.make_tensor("E", T.FLOAT, [3, 2], [0.5, -1.0, 2.0, 0.25, -0.75, 1.5])
    w = helper.make_tensor("W", T.FLOAT, [2, 2], [1.0, 2.0, 3.0, -1.0])
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], name="lookup"),
             helper.make_node("MatMul", ["e", "W"], ["h"], name="first"),
             helper.make_node("MatMul", ["h", "W"], ["h2"], name="second"),
             helper.make_node("Relu", ["h2"], ["r"]),
             helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0),
             helper.make_node("Neg", ["h"], ["side"])]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "emb", [vi("ids", T.INT64, [4])],
                              [vi("loss", T.FLOAT, []), vi("side", T.FLOAT, [4, 2])], [e, w])
    return make_model(graph, 17)


def test_an_integer_input_asked_for_is_refused_naming_its_type() -> None:
    """onnxruntime's builders give integer inputs (token ids, labels) no gradient. Asking for one is an error
    that names the input and its type; it said the ids "do not reach" the loss, which they do (as a Gather's
    indices)."""
    model = _embedding_model()
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, ["W", "ids"], "loss")
    with pytest.raises(ValueError, match=r"'ids' is int64") as err:
        b.build()
    assert "does not reach" not in str(err.value)


def _embedding_torch(ids: np.ndarray, side_grad: np.ndarray | None) -> dict[str, np.ndarray]:
    """_embedding_model's outputs and its E and W gradients by torch autograd (of the loss, plus the side
    output's sum weighted by ``side_grad`` when given)."""
    model = _embedding_model()
    inits = {t.name: torch.tensor(onnx.numpy_helper.to_array(t), dtype=torch.float64, requires_grad=True)
             for t in model.graph.initializer}
    h = inits["E"][torch.tensor(ids)] @ inits["W"]
    loss = torch.relu(h @ inits["W"]).sum()
    side = -h
    total = loss if side_grad is None else loss + (side * torch.tensor(side_grad, dtype=torch.float64)).sum()
    total.backward()
    return {"loss": loss.detach().numpy(), "side": side.detach().numpy(),
            "E_grad": inits["E"].grad.numpy(), "W_grad": inits["W"].grad.numpy()}


@pytest.mark.parametrize("side_is_a_y", [False, True])
def test_shared_weight_embedding_ids_and_an_output_off_the_loss(side_is_a_y: bool) -> None:
    """gradient_graph_builder_test.cc's behaviours on one model: an int64 input (token ids) that gets no
    gradient and needs none, a weight read by two MatMuls (its gradient sums both), an embedding read by a
    Gather (its gradient scatters, repeated ids adding), and a model output off the loss's path: kept as an
    output, differentiated only when it is one of the ys (it then takes ``side_grad``)."""
    model = _embedding_model()
    ys = ["loss", "side"] if side_is_a_y else ["loss"]
    built = _build(model, ys, ["E", "W"], "loss")
    assert [i.name for i in built.graph.input] == ["ids"] + (["side_grad"] if side_is_a_y else [])
    assert [o.name for o in built.graph.output] == ["loss", "side", "E_grad", "W_grad"]
    ids = np.array([2, 0, 2, 1])  # a repeated id
    feeds: dict[str, np.ndarray] = {"ids": ids}
    if side_is_a_y:
        feeds["side_grad"] = np.random.default_rng(1).standard_normal((4, 2)).astype(np.float32)
    want = _embedding_torch(ids, feeds.get("side_grad"))
    for who, got in (("engine", _run(built, feeds)), ("onnxruntime", _run_ort(built, feeds))):
        for name, value in want.items():
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-5, err_msg=f"{who}: {name}")


def test_mlp_with_mean_squared_error_as_onnxruntimes_builder_test_model() -> None:
    """gradient_graph_builder_test.cc::BuildGradientGraphTest and TrainingSession_Basic: the MNIST MLP (X of
    [1, 784] → MatMul W1 + B1 → Relu → MatMul W2 + B2 → Relu → MatMul W3 + B3 = predictions) with a mean
    squared error against labels of [1, 10], fed ones as that test fed them (and random values); the
    gradient outputs are W1_grad ... B3_grad, with torch's values, in onnxruntime too."""
    rng = np.random.default_rng(0)
    sizes = [784, 128, 32, 10]
    inits, nodes, h = [], [], "X"
    for k in range(3):
        w = (rng.standard_normal((sizes[k], sizes[k + 1])) / np.sqrt(sizes[k])).astype(np.float32)
        b = (0.1 * rng.standard_normal(sizes[k + 1])).astype(np.float32)
        inits += [onnx.numpy_helper.from_array(w, f"W{k + 1}"), onnx.numpy_helper.from_array(b, f"B{k + 1}")]
        out = "predictions" if k == 2 else f"T{3 * k + 3}"
        added = out if k == 2 else f"T{3 * k + 2}"
        nodes += [helper.make_node("MatMul", [h, f"W{k + 1}"], [f"T{3 * k + 1}"]),
                  helper.make_node("Add", [f"T{3 * k + 1}", f"B{k + 1}"], [added])]
        if k < 2:
            nodes.append(helper.make_node("Relu", [f"T{3 * k + 2}"], [out]))
        h = out
    nodes += [helper.make_node("Sub", ["predictions", "labels"], ["diff"]),
              helper.make_node("Mul", ["diff", "diff"], ["diff_square"]),
              helper.make_node("ReduceMean", ["diff_square"], ["loss"], keepdims=0)]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "mnist", [vi("X", T.FLOAT, [1, 784]), vi("labels", T.FLOAT, [1, 10])],
                              [vi("predictions", T.FLOAT, [1, 10]), vi("loss", T.FLOAT, [])], inits)
    weights = ["W1", "B1", "W2", "B2", "W3", "B3"]
    built = _build(make_model(graph, 17), ["loss"], weights, "loss")
    assert [o.name for o in built.graph.output] == ["predictions", "loss", *(f"{w}_grad" for w in weights)]
    params = {t.name: torch.tensor(onnx.numpy_helper.to_array(t), dtype=torch.float64, requires_grad=True)
              for t in inits}
    for x, labels in ((np.ones((1, 784)), np.ones((1, 10))),
                      (rng.standard_normal((1, 784)), rng.standard_normal((1, 10)))):
        for p in params.values():
            p.grad = None
        t = torch.tensor(x)
        for k in range(3):
            t = t @ params[f"W{k + 1}"] + params[f"B{k + 1}"]
            t = torch.relu(t) if k < 2 else t
        loss = ((t - torch.tensor(labels)) ** 2).mean()
        loss.backward()
        want = {"predictions": t.detach().numpy(), "loss": loss.detach().numpy(),
                **{f"{w}_grad": params[w].grad.numpy() for w in weights}}
        feeds = {"X": x.astype(np.float32), "labels": labels.astype(np.float32)}
        for who, got in (("engine", _run(built, feeds)), ("onnxruntime", _run_ort(built, feeds))):
            for name, value in want.items():
                scale = np.abs(value).max()
                np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-5 * scale,
                                           err_msg=f"{who}: {name}")


def test_concat_of_trainable_weights() -> None:
    """gradient_graph_builder_test.cc::BuildConcatGradientGraphTest: a Concat whose inputs are trained
    weights (onnxruntime rewrote it as its ConcatTraining and the gradient as SplitTraining, com.microsoft
    ops): here the graph stays in the standard domain and each weight gets its slice of the gradient,
    torch's values, in onnxruntime too."""
    a = helper.make_tensor("A", T.FLOAT, [2, 3], [0.5, -1.0, 2.0, 0.25, -0.75, 1.5])
    b = helper.make_tensor("B", T.FLOAT, [2, 1], [1.0, -2.0])
    nodes = [helper.make_node("Concat", ["A", "B", "x"], ["ab"], axis=1),  # a data input concatenated too
             helper.make_node("Mul", ["ab", "ab"], ["sq"]),
             helper.make_node("MatMul", ["sq", "v"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    vi = helper.make_tensor_value_info
    graph = helper.make_graph(nodes, "concat", [vi("x", T.FLOAT, [2, 2]), vi("v", T.FLOAT, [6, 1])],
                              [vi("loss", T.FLOAT, [])], [a, b])
    built = _build(make_model(graph, 17), ["loss"], ["A", "B", "x"], "loss")
    assert {n.domain for n in built.graph.node} <= {""}
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((2, 2)).astype(np.float32),
             "v": rng.standard_normal((6, 1)).astype(np.float32)}
    leaves = {t.name: torch.tensor(onnx.numpy_helper.to_array(t), dtype=torch.float64, requires_grad=True)
              for t in graph.initializer}
    leaves["x"] = torch.tensor(feeds["x"], dtype=torch.float64, requires_grad=True)
    ab = torch.cat([leaves["A"], leaves["B"], leaves["x"]], 1)
    ((ab * ab) @ torch.tensor(feeds["v"], dtype=torch.float64)).sum().backward()
    for who, got in (("engine", _run(built, feeds)), ("onnxruntime", _run_ort(built, feeds))):
        for name in ("A", "B", "x"):
            np.testing.assert_allclose(got[f"{name}_grad"], leaves[name].grad.numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{who}: {name}_grad")

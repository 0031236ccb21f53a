"""Gradients of recurrent nodes with ``clip`` and with activations other than the defaults, against
central differences in float64 of the engine's forward (whose clip and activations
tests/engine/test_rnn_features.py checks against onnxruntime). onnx.reference ignores both, so these rows
live here rather than in the op table."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine
from tests.op_cases import OpCase
from tests.op_cases.harness import feeds_of, one_node_model
from tests.op_cases.rnn import _rnn_case

ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("RNN", "relu", {"activations": ["Relu"]}),
    ("RNN", "leakyrelu_bidir", {"direction": "bidirectional", "activations": ["LeakyRelu", "LeakyRelu"],
                                "activation_alpha": [0.1, 0.1], "n_outputs": 2}),
    ("RNN", "sigmoid_clip", {"activations": ["Sigmoid"], "clip": 0.5, "n_outputs": 2}),
    ("RNN", "bidir_relu_tanh", {"direction": "bidirectional", "activations": ["Relu", "Tanh"],
                                "n_outputs": 2}),
    ("LSTM", "bidir_two_sets", {"direction": "bidirectional", "n_outputs": 3,
                                "activations": ["Sigmoid", "Tanh", "Tanh",
                                                "HardSigmoid", "Elu", "Softsign"]}),
    ("GRU", "bidir_two_sets_lbr", {"direction": "bidirectional", "linear_before_reset": 1, "n_outputs": 2,
                                   "activations": ["Sigmoid", "Tanh", "Sigmoid", "Relu"]}),
    ("RNN", "tanh_clip_reverse", {"direction": "reverse", "clip": 0.4, "n_outputs": 2}),
    ("RNN", "hardsigmoid", {"activations": ["HardSigmoid"], "activation_alpha": [0.3],
                            "activation_beta": [0.4]}),
    ("RNN", "elu", {"activations": ["Elu"], "activation_alpha": [0.7]}),
    ("RNN", "softsign", {"activations": ["Softsign"]}),
    ("RNN", "softplus", {"activations": ["Softplus"], "n_outputs": 2}),
    ("RNN", "scaledtanh", {"activations": ["ScaledTanh"], "activation_alpha": [1.5],
                           "activation_beta": [0.8]}),
    ("RNN", "affine", {"activations": ["Affine"], "activation_alpha": [0.7], "activation_beta": [0.1]}),
    ("RNN", "thresholdedrelu", {"activations": ["ThresholdedRelu"], "activation_alpha": [0.2]}),
    ("LSTM", "acts", {"activations": ["HardSigmoid", "LeakyRelu", "ScaledTanh"], "n_outputs": 3,
                      "activation_alpha": [0.3, 0.05, 0.8], "activation_beta": [0.4, 1.2]}),
    ("LSTM", "acts_peep_clip", {"activations": ["Sigmoid", "Softsign", "Elu"], "activation_alpha": [0.9],
                                "peep": True, "clip": 0.6, "n_outputs": 3}),
    ("LSTM", "relu_cell_bidir", {"activations": ["Sigmoid", "Relu", "Relu"] * 2,
                                 "direction": "bidirectional", "n_outputs": 3}),
    ("GRU", "acts", {"activations": ["Sigmoid", "Elu"], "activation_alpha": [0.7], "n_outputs": 2}),
    ("GRU", "acts_lbr", {"activations": ["HardSigmoid", "Softplus"], "linear_before_reset": 1,
                         "n_outputs": 2}),
    ("LSTM", "input_forget", {"input_forget": 1, "n_outputs": 3}),
    ("LSTM", "input_forget_peep_clip_bidir", {"input_forget": 1, "peep": True, "clip": 0.6,
                                              "direction": "bidirectional", "n_outputs": 3}),
    ("LSTM", "clip", {"clip": 0.4, "n_outputs": 3}),
    ("LSTM", "clip_peep_bidir", {"clip": 0.4, "peep": True, "direction": "bidirectional", "n_outputs": 3}),
    ("GRU", "clip", {"clip": 0.4, "n_outputs": 2}),
    ("GRU", "clip_lbr_reverse", {"clip": 0.4, "linear_before_reset": 1, "direction": "reverse",
                                 "n_outputs": 2}),
]


def _setup(op: str, variant: str, kw: dict[str, Any]):
    case = _rnn_case(op, variant, **kw)
    inputs = case.inputs(np.float64)
    model = one_node_model(case, inputs)
    feeds = feeds_of(inputs)
    outs = run_engine(model, feeds)
    lmodel = random_loss_model(model, [np.shape(o) for o in outs], list(range(len(outs))))
    return lmodel, feeds, [f"x{i}" for i in case.wrt]


@pytest.mark.parametrize("op,variant,kw", ROWS, ids=[f"{r[0]}-{r[1]}" for r in ROWS])
def test_gradient_matches_central_differences(op: str, variant: str, kw: dict[str, Any]) -> None:
    lmodel, feeds, wrt = _setup(op, variant, kw)
    gmodel = build_gradient_model(lmodel, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    gradcheck(lmodel, "loss", wrt, feeds, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("op,variant,kw", [r for r in ROWS if "clip" in r[2]],
                         ids=[f"{r[0]}-{r[1]}" for r in ROWS if "clip" in r[2]])
def test_the_clip_cuts_some_gate_inputs(op: str, variant: str, kw: dict[str, Any]) -> None:
    """The rows exercise the clip: without it the forward outputs differ."""
    lmodel, feeds, _ = _setup(op, variant, kw)
    loose, _, _ = _setup(op, variant, {**kw, "clip": 1e9})
    assert not np.allclose(run_engine(lmodel, feeds)[0], run_engine(loose, feeds)[0])



# ---- sequence_lens: steps past a sample's length give zeros in Y and leave its state as it was

def _lens_case(op: str, variant: str, lens: list[int], direction: str = "forward", layout: int = 0,
               peep: bool = False, **attrs: Any) -> tuple[OpCase, list[int]]:
    """A row X, W, R, B, sequence_lens, initial_h[, initial_c[, P]] with the given per-sample lengths."""
    g = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    steps, batch, n_in, hid = max(lens) + 1, len(lens), 3, 4
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = (steps, batch, n_in) if layout == 0 else (batch, steps, n_in)
    h_shape = (dirs, batch, hid) if layout == 0 else (batch, dirs, hid)

    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        def u(*shape: int, scale: float = 1.0) -> np.ndarray:
            return rng.uniform(-scale, scale, shape).astype(dt)

        ins = [u(*x_shape), u(dirs, g * hid, n_in, scale=0.6), u(dirs, g * hid, hid, scale=0.6),
               u(dirs, 2 * g * hid, scale=0.5), np.array(lens, np.int32), u(*h_shape)]
        if op == "LSTM":
            ins.append(u(*h_shape))
            if peep:
                ins.append(u(dirs, 3 * hid, scale=0.5))
        return ins

    wrt = [0, 1, 2, 3, 5] + ([6] if op == "LSTM" else []) + ([7] if peep else [])
    n_out = 3 if op == "LSTM" else 2
    a = {"direction": direction, "hidden_size": hid, "layout": layout, **attrs}
    return OpCase(op, attrs=a, make_inputs=make, n_outputs=n_out, wrt=tuple(wrt), variant=variant,
                  opset=14 if layout else 17), wrt


LENS_ROWS = [
    ("RNN", "lens", [3, 1, 0, 2], {}),
    ("RNN", "lens_bidir_relu", [2, 3, 1], {"direction": "bidirectional", "activations": ["Relu", "Relu"]}),
    ("LSTM", "lens", [3, 1, 0, 2], {}),
    ("LSTM", "lens_reverse", [1, 3, 2], {"direction": "reverse"}),
    ("LSTM", "lens_bidir_peep_clip", [3, 2, 0], {"direction": "bidirectional", "peep": True, "clip": 0.6}),
    ("LSTM", "lens_layout1_bidir", [2, 3], {"direction": "bidirectional", "layout": 1}),
    ("LSTM", "lens_input_forget", [3, 0, 2], {"input_forget": 1}),
    ("GRU", "lens", [3, 1, 0, 2], {}),
    ("GRU", "lens_bidir_lbr", [1, 3, 2], {"direction": "bidirectional", "linear_before_reset": 1}),
    ("GRU", "lens_reverse", [2, 0, 3], {"direction": "reverse"}),
]


@pytest.mark.parametrize("op,variant,lens,kw", LENS_ROWS, ids=[f"{r[0]}-{r[1]}" for r in LENS_ROWS])
def test_sequence_lens_gradient_matches_central_differences(op: str, variant: str, lens: list[int],
                                                            kw: dict[str, Any]) -> None:
    case, wrt_idx = _lens_case(op, variant, lens, **kw)
    inputs = case.inputs(np.float64)
    model = one_node_model(case, inputs)
    feeds = feeds_of(inputs)
    outs = run_engine(model, feeds)
    y = outs[0] if case.attrs["layout"] == 0 else np.transpose(outs[0], (1, 2, 0, 3))
    for b, n in enumerate(lens):  # the forward really ends each sequence at its length
        assert not y[n:, :, b].any() and (n == 0 or y[:n, :, b].any())
    lmodel = random_loss_model(model, [np.shape(o) for o in outs], list(range(len(outs))))
    wrt = [f"x{i}" for i in wrt_idx]
    gmodel = build_gradient_model(lmodel, "loss", wrt, outputs=["loss"])
    onnx.checker.check_model(gmodel, full_check=True)
    gradcheck(lmodel, "loss", wrt, feeds, rtol=1e-5, atol=1e-7)


# onnxruntime's kernels have no layout 1
PORTABLE = [r for r in ROWS if "layout" not in r[2]][::3] + [
    (op, v, {"lens": lens, **kw}) for op, v, lens, kw in LENS_ROWS if "layout" not in kw]


@pytest.mark.parametrize("op,variant,kw", PORTABLE, ids=[f"{r[0]}-{r[1]}" for r in PORTABLE])
def test_gradient_graph_runs_on_onnxruntime(op: str, variant: str, kw: dict[str, Any]) -> None:
    """The float32 gradient graph gives onnxruntime's numbers (onnx.reference knows neither clip, nor
    these activations, nor sequence_lens)."""
    ort = pytest.importorskip("onnxruntime")
    kw = dict(kw)
    lens = kw.pop("lens", None)
    case, wrt_idx = _lens_case(op, variant, lens, **kw) if lens is not None else (
        _rnn_case(op, variant, **kw), None)
    wrt_idx = list(case.wrt) if wrt_idx is None else wrt_idx
    inputs = case.inputs(np.float32)
    model = one_node_model(case, inputs)
    feeds = feeds_of(inputs)
    outs = run_engine(model, feeds)
    lmodel = random_loss_model(model, [np.shape(o) for o in outs], list(range(len(outs))), dtype=np.float32)
    gmodel = build_gradient_model(lmodel, "loss", [f"x{i}" for i in wrt_idx])
    onnx.checker.check_model(gmodel, full_check=True)
    ours = run_engine(gmodel, feeds)
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, feeds)
    for o, a, b in zip(gmodel.graph.output, ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5, err_msg=o.name)

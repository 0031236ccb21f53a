"""Op-table rows for the recurrent ops LSTM, GRU and RNN.

onnx.reference ignores ``sequence_lens``, ``clip``, ``input_forget`` and most activations, so rows
here only use what it implements; ``tests/engine/test_rnn_features.py`` covers the rest against
onnxruntime.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from tests.op_cases import OpCase

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _rnn_case(op: str, variant: str, steps: int = 3, batch: int = 2, n_in: int = 3, hid: int = 4,
              direction: str = "forward", layout: int = 0, bias: bool = True, init: bool = True,
              peep: bool = False, n_outputs: int = 1, opset: int = 17, **attrs: Any) -> OpCase:
    """A row whose inputs are X, W, R[, B, sequence_lens=None, initial_h[, initial_c, P]]."""
    g = _GATES[op]
    dirs = 2 if direction == "bidirectional" else 1
    x_shape = (steps, batch, n_in) if layout == 0 else (batch, steps, n_in)
    h_shape = (dirs, batch, hid) if layout == 0 else (batch, dirs, hid)

    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        def u(*shape: int, scale: float = 1.0) -> np.ndarray:
            return (rng.uniform(-scale, scale, shape)).astype(dt)

        ins: list[Any] = [u(*x_shape), u(dirs, g * hid, n_in, scale=0.6), u(dirs, g * hid, hid, scale=0.6)]
        if bias or init or peep:
            ins.append(u(dirs, 2 * g * hid, scale=0.5) if bias else None)
            ins.append(None)  # sequence_lens (onnx.reference ignores it)
        if init or peep:
            ins.append(u(*h_shape) if init else None)
        if op == "LSTM" and (init or peep):
            ins.append(u(*h_shape) if init else None)
            if peep:
                ins.append(u(dirs, 3 * hid, scale=0.5))
        while ins and ins[-1] is None:
            ins.pop()
        return ins

    present = [0, 1, 2] + ([3] if bias else []) + ([5] if init else [])
    if op == "LSTM":
        present += ([6] if init else []) + ([7] if peep else [])
    a = {"direction": direction, "hidden_size": hid, **attrs}
    if layout:
        a["layout"] = layout
    ort_skip = None
    if op != "RNN":  # (RNN has no float64 kernel either, which the test detects by itself)
        ort_skip = f"onnxruntime's {op} has no float64 kernel (and no layout=1)"
    return OpCase(op, attrs=a, make_inputs=make, opset=opset, n_outputs=n_outputs, wrt=tuple(present),
                  variant=variant, ort_skip=ort_skip)


CASES = [
    # LSTM
    _rnn_case("LSTM", "plain", bias=False, init=False),
    _rnn_case("LSTM", "bias_init", n_outputs=3),
    _rnn_case("LSTM", "reverse", direction="reverse", n_outputs=3),
    _rnn_case("LSTM", "bidir", direction="bidirectional", n_outputs=3),
    _rnn_case("LSTM", "peepholes", peep=True, n_outputs=3),
    _rnn_case("LSTM", "bidir_peep_noinit", direction="bidirectional", init=False, peep=True, n_outputs=2),
    _rnn_case("LSTM", "layout1_bidir", direction="bidirectional", layout=1, n_outputs=3, opset=14),
    _rnn_case("LSTM", "batch1_long", steps=6, batch=1, n_in=2, hid=3, n_outputs=3),
    # GRU
    _rnn_case("GRU", "plain", bias=False, init=False),
    _rnn_case("GRU", "bias_init", n_outputs=2),
    _rnn_case("GRU", "lbr", n_outputs=2, linear_before_reset=1),
    _rnn_case("GRU", "bidir_lbr", direction="bidirectional", n_outputs=2, linear_before_reset=1),
    _rnn_case("GRU", "reverse", direction="reverse", n_outputs=2),
    _rnn_case("GRU", "layout1_bidir", direction="bidirectional", layout=1, n_outputs=2, opset=14),
    # RNN
    _rnn_case("RNN", "plain", bias=False, init=False),
    _rnn_case("RNN", "bias_init", n_outputs=2),
    _rnn_case("RNN", "reverse", direction="reverse", n_outputs=2),
    _rnn_case("RNN", "bidir", direction="bidirectional", n_outputs=2),
    _rnn_case("RNN", "layout1", layout=1, n_outputs=2, opset=14),
]

# gradient-focused rows (rules in onnxtrain/autodiff/rules/rnn.py): only some outputs feed the loss,
# a single step, no initial state
CASES += [
    replace(_rnn_case("LSTM", "grad_yh_only", direction="bidirectional", n_outputs=3), grad_outputs=(1,)),
    replace(_rnn_case("LSTM", "grad_yc_only", direction="reverse", n_outputs=3), grad_outputs=(2,)),
    _rnn_case("LSTM", "grad_steps1_noinit", steps=1, init=False, n_outputs=3),
    replace(_rnn_case("GRU", "grad_yh_only_lbr", n_outputs=2, linear_before_reset=1), grad_outputs=(1,)),
    _rnn_case("GRU", "grad_steps1_noinit", steps=1, init=False, n_outputs=2),
    _rnn_case("GRU", "grad_bidir_noinit", direction="bidirectional", init=False, n_outputs=2),
    _rnn_case("RNN", "grad_bidir_noinit", direction="bidirectional", init=False, n_outputs=2),
]

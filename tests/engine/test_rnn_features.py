"""LSTM/GRU/RNN features onnx.reference does not implement, checked against onnxruntime.

Covers sequence_lens, clip, input_forget, peepholes, linear_before_reset, activations with
alpha/beta, layout=1 (onnxruntime only runs layout 0, so its results are transposed), and the
optional outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine import compile_model

ort = pytest.importorskip("onnxruntime")

_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
STEPS, BATCH, N_IN, HID = 5, 3, 2, 4


def _model(op: str, attrs: dict[str, Any], inputs: list[Any], outputs: list[str]):
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, outputs, hidden_size=HID, **attrs)
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs) if n]
    g_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o]
    graph = helper.make_graph([node], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)


def _inputs(op: str, dirs: int, lens: list[int] | None, peep: bool, seed: int = 0) -> list[Any]:
    """X, W, R, B, sequence_lens, initial_h[, initial_c, P] in layout 0."""
    rng = np.random.default_rng(seed)
    g = _GATES[op]

    def n(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ins = [n(STEPS, BATCH, N_IN), n(dirs, g * HID, N_IN), n(dirs, g * HID, HID, scale=0.5),
           n(dirs, 2 * g * HID, scale=0.5), None if lens is None else np.array(lens, np.int32),
           n(dirs, BATCH, HID)]
    if op == "LSTM":
        ins += [n(dirs, BATCH, HID), n(dirs, 3 * HID) if peep else None]
    return ins


def _feeds(inputs: list[Any]) -> dict[str, Any]:
    return {f"x{i}": v for i, v in enumerate(inputs) if v is not None}


def _to_layout1(inputs: list[Any]) -> list[Any]:
    out = list(inputs)
    out[0] = np.ascontiguousarray(inputs[0].transpose(1, 0, 2))
    for i in (5, 6):
        if i < len(out) and out[i] is not None:
            out[i] = np.ascontiguousarray(out[i].transpose(1, 0, 2))
    return out


LENS = [None, [5, 2, 4], [1, 5, 3], [0, 5, 2]]  # the last: a sequence of length 0 (zero final states)
VARIANTS = [
    ("LSTM", {}, False),  # plain: the gate-major loop (full lengths; the layout-1 run takes the general one)
    ("LSTM", {}, True),
    ("LSTM", {"clip": 0.6}, True),
    ("LSTM", {"input_forget": 1}, False),
    ("LSTM", {"activations": ["HardSigmoid", "LeakyRelu", "ScaledTanh"], "activation_alpha": [0.3, 0.05, 0.8],
              "activation_beta": [0.4, 1.2]}, True),
    ("GRU", {}, False),
    ("GRU", {"linear_before_reset": 1}, False),
    ("GRU", {"clip": 0.5, "linear_before_reset": 1}, False),
    ("GRU", {"activations": ["Sigmoid", "Elu"], "activation_alpha": [0.7]}, False),
    ("RNN", {}, False),
    ("RNN", {"activations": ["Relu"], "clip": 2.0}, False),
]


@pytest.mark.parametrize("lens", LENS, ids=["full", "lens_a", "lens_b", "lens_empty"])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("op,attrs,peep", VARIANTS, ids=lambda v: v if isinstance(v, str) else None)
def test_matches_onnxruntime(op: str, attrs: dict, peep: bool, direction: str, lens) -> None:
    dirs = 2 if direction == "bidirectional" else 1
    ins = _inputs(op, dirs, lens, peep)
    outs = ["y0", "y1", "y2"] if op == "LSTM" else ["y0", "y1"]
    attrs = {**attrs, "direction": direction}
    if "activations" in attrs and dirs == 2:
        attrs["activations"] = attrs["activations"] * 2
        for k in ("activation_alpha", "activation_beta"):
            if k in attrs:
                attrs[k] = attrs[k] * 2
    model = _model(op, attrs, ins, outs)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, _feeds(ins))
    ours = compile_model(model).run(_feeds(ins))
    for i, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"output {i}")
    if lens is not None:  # steps past a sequence's end are zero
        for b_i, n in enumerate(lens):
            assert not ours[0][n:, :, b_i].any()
    # layout 1 gives the same numbers, transposed
    ours1 = compile_model(_model(op, {**attrs, "layout": 1}, _to_layout1(ins), outs)).run(
        _feeds(_to_layout1(ins)))
    np.testing.assert_allclose(ours1[0], ours[0].transpose(2, 0, 1, 3), rtol=1e-6, atol=1e-6)
    for a1, a0 in zip(ours1[1:], ours[1:]):
        np.testing.assert_allclose(a1, a0.transpose(1, 0, 2), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("op,attrs", [("LSTM", {}), ("GRU", {}), ("GRU", {"linear_before_reset": 1})])
@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
def test_gate_major_loop_equals_the_general_one(op: str, attrs: dict, direction: str, monkeypatch) -> None:
    """Plain LSTM/GRU nodes (layout 0, default activations, no clip, peepholes or partial lengths) run the
    loop on transposed states; the general loop gives the same outputs, to the bit here."""
    from onnxtrain.engine.kernels import rnn

    dirs = 2 if direction == "bidirectional" else 1
    ins = _inputs(op, dirs, None, False)
    outs = ["y0", "y1", "y2"] if op == "LSTM" else ["y0", "y1"]
    model = _model(op, {**attrs, "direction": direction}, ins, outs)
    taken: list[bool] = []
    real = rnn._plain
    monkeypatch.setattr(rnn, "_plain", lambda *a: taken.append(real(*a)) or taken[-1])
    fast = compile_model(model).run(_feeds(ins))
    monkeypatch.setattr(rnn, "_plain", lambda *a: False)
    general = compile_model(model).run(_feeds(ins))
    assert taken == [True]
    for a, b in zip(fast, general):
        np.testing.assert_array_equal(a, b)


def test_different_activations_per_direction() -> None:
    ins = _inputs("LSTM", 2, [5, 3, 1], False)
    acts = ["Sigmoid", "Tanh", "Tanh", "HardSigmoid", "Softsign", "Softplus"]
    model = _model("LSTM", {"direction": "bidirectional", "activations": acts}, ins, ["y0", "y1", "y2"])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, _feeds(ins))
    for a, b in zip(compile_model(model).run(_feeds(ins)), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act", ["Sigmoid", "Tanh", "Relu", "HardSigmoid", "LeakyRelu", "ScaledTanh",
                                 "Affine", "Elu", "Softsign", "Softplus", "ThresholdedRelu"])
def test_rnn_activation_with_alpha_beta(act: str) -> None:
    ins = _inputs("RNN", 1, None, False)
    model = _model("RNN", {"activations": [act], "activation_alpha": [0.6], "activation_beta": [0.3]}, ins,
                   ["y0", "y1"])
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, _feeds(ins))
    for a, b in zip(compile_model(model).run(_feeds(ins)), ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_activation_defaults_follow_the_onnx_ops() -> None:
    """Affine without alpha/beta is the identity (onnxruntime uses alpha=beta=0 here instead)."""
    ins = _inputs("RNN", 1, None, False)
    outs = ["y0", "y1"]
    ident = compile_model(_model("RNN", {"activations": ["Affine"]}, ins, outs)).run(_feeds(ins))
    explicit = compile_model(_model("RNN", {"activations": ["Affine"], "activation_alpha": [1.0],
                                            "activation_beta": [0.0]}, ins, outs)).run(_feeds(ins))
    np.testing.assert_array_equal(ident[0], explicit[0])


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_optional_outputs(op: str) -> None:
    ins = _inputs(op, 2, [5, 2, 4], op == "LSTM")
    full_names = ["y0", "y1", "y2"] if op == "LSTM" else ["y0", "y1"]
    full = compile_model(_model(op, {"direction": "bidirectional"}, ins, full_names)).run(_feeds(ins))
    only_state = ["", *full_names[1:]]
    got = compile_model(_model(op, {"direction": "bidirectional"}, ins, only_state)).run(_feeds(ins))
    for a, b in zip(got, full[1:]):
        np.testing.assert_array_equal(a, b)
    got_y = compile_model(_model(op, {"direction": "bidirectional"}, ins, ["y0"])).run(_feeds(ins))
    np.testing.assert_array_equal(got_y[0], full[0])


def test_inputs_are_not_mutated() -> None:
    ins = _inputs("LSTM", 2, [5, 2, 4], True)
    before = [None if v is None else v.copy() for v in ins]
    compile_model(_model("LSTM", {"direction": "bidirectional", "clip": 0.5}, ins, ["y0", "y1", "y2"])).run(
        _feeds(ins))
    for a, b in zip(ins, before):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("attrs,match", [
    ({"activations": ["Bogus"]}, "activation"),
    ({"direction": "bidirectional"}, "direction"),
])
def test_bad_attributes_raise(attrs: dict, match: str) -> None:
    ins = _inputs("RNN", 1, None, False)
    with pytest.raises(Exception, match=match):
        compile_model(_model("RNN", attrs, ins, ["y0", "y1"])).run(_feeds(ins))

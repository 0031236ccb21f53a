"""``use_memory_efficient_gradient``: a LayerNormalization whose input nothing else keeps takes its gradient
from its output, xhat = (Y − B)/Scale, so that the input is freed after the forward."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

D = 8


def _stack(layers: int, dtype: int = TensorProto.FLOAT, batch: int = 6, keep_input: bool = False,
           bias: bool = True) -> onnx.ModelProto:
    """x → (h = LN(h + tanh(h·W_i))) × layers → loss = Σ h·u. Each LN's input is an Add's output, which no
    gradient rule keeps (``keep_input``: the last LN's input is also squared into the loss, so it is)."""
    rng = np.random.default_rng(0)
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    nodes, inits = [], []
    h = "x"
    for i in range(layers):
        inits += [numpy_helper.from_array((rng.standard_normal((D, D)) / 3).astype(np_dt), f"W{i}"),
                  numpy_helper.from_array((1 + 0.3 * rng.standard_normal(D)).astype(np_dt), f"S{i}"),
                  numpy_helper.from_array((0.2 * rng.standard_normal(D)).astype(np_dt), f"B{i}")]
        ln_inputs = [f"a{i}", f"S{i}"] + ([f"B{i}"] if bias else [])
        nodes += [helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"]),
                  helper.make_node("Add", [h, f"t{i}"], [f"a{i}"]),
                  helper.make_node("LayerNormalization", ln_inputs, [f"h{i}"], name=f"LN{i}")]
        h = f"h{i}"
    inits.append(numpy_helper.from_array(rng.standard_normal((batch, D)).astype(np_dt), "u"))
    nodes += [helper.make_node("Mul", [h, "u"], ["hu"]),
              helper.make_node("ReduceSum", ["hu"], ["loss"], keepdims=0)]
    out = "loss"
    if keep_input:
        a = f"a{layers - 1}"
        nodes += [helper.make_node("Mul", [a, a], ["sq"]),
                  helper.make_node("ReduceSum", ["sq"], ["s2"], keepdims=0),
                  helper.make_node("Add", ["loss", "s2"], ["total"])]
        out = "total"
    graph = helper.make_graph(nodes, "ln_stack", [helper.make_tensor_value_info("x", dtype, [batch, D])],
                              [helper.make_tensor_value_info(out, dtype, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _backward_reads(gmodel: onnx.ModelProto, model: onnx.ModelProto) -> set[str]:
    """Values the backward nodes read (a Shape node, right after its input's producer, keeps nothing)."""
    forward = {o for n in model.graph.node for o in n.output}
    return {i for n in gmodel.graph.node if n.op_type != "Shape" and n.output[0] not in forward
            for i in n.input}


def _torch_grads(model: onnx.ModelProto, x: np.ndarray, layers: int, bias: bool) -> dict[str, np.ndarray]:
    """The same stack in torch, float64, autograd."""
    torch = pytest.importorskip("torch")
    w = {t.name: torch.tensor(numpy_helper.to_array(t).astype(np.float64), requires_grad=True)
         for t in model.graph.initializer}
    h = torch.tensor(x.astype(np.float64), requires_grad=True)
    x_t = h
    for i in range(layers):
        h = torch.nn.functional.layer_norm(h + torch.tanh(h @ w[f"W{i}"]), (D,), w[f"S{i}"],
                                           w[f"B{i}"] if bias else None)
    (h * w["u"]).sum().backward()
    return {"x": x_t.grad.numpy(),  # an unused bias (bias=False) gets a zero gradient
            **{k: np.zeros(v.shape) if v.grad is None else v.grad.numpy() for k, v in w.items()}}


@pytest.mark.parametrize("bias", [True, False])
def test_gradients_match_torch_and_the_standard_rule(bias: bool) -> None:
    layers = 3
    model = _stack(layers, bias=bias)
    wrt = ["x", *(t.name for t in model.graph.initializer if t.name != "u")]
    x = np.random.default_rng(1).standard_normal((6, D)).astype(np.float32)
    lean = build_gradient_model(model, "loss", wrt, memory_efficient=True)
    plain = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(lean, full_check=True)
    assert not {f"a{i}" for i in range(layers)} & _backward_reads(lean, model)  # the LN inputs: not read
    assert {f"a{i}" for i in range(layers)} <= _backward_reads(plain, model)
    names = [o.name for o in lean.graph.output]
    got = dict(zip(names, compile_model(lean).run({"x": x})))
    std = dict(zip(names, compile_model(plain).run({"x": x})))
    want = _torch_grads(model, x, layers, bias)
    ort = pytest.importorskip("onnxruntime")  # another runtime runs the graph to the same numbers
    sess = ort.InferenceSession(lean.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, {"x": x})
    for name, a in zip(names, theirs):
        np.testing.assert_allclose(got[name], a, rtol=1e-5, atol=1e-6, err_msg=name)
    for n in wrt:
        scale = np.abs(want[n]).max()
        np.testing.assert_allclose(got[f"{n}_grad"], want[n], rtol=1e-4, atol=1e-5 * scale, err_msg=n)
        np.testing.assert_allclose(got[f"{n}_grad"], std[f"{n}_grad"], rtol=1e-4, atol=1e-5 * scale,
                                   err_msg=n)


def test_an_input_another_rule_keeps_gets_the_standard_rule() -> None:
    model = _stack(2, keep_input=True)
    lean = build_gradient_model(model, "total", ["x", "W0", "W1"], memory_efficient=True)
    reads = _backward_reads(lean, model)
    assert "a1" in reads  # kept for the square anyway: its LN keeps the standard rule
    assert "a0" not in reads  # the first LN's input is still freed
    double = _stack(2, TensorProto.DOUBLE)
    lean64 = build_gradient_model(double, "loss", ["W0", "W1"], memory_efficient=True)
    assert {"a0", "a1"} <= _backward_reads(lean64, double)  # float64: InvStdDev is float32; standard rule


def test_the_inputs_are_freed_after_the_forward() -> None:
    """The lean graph's peak of live bytes is lower by at least all but one LN input (batch × D floats)."""
    layers, batch = 4, 512
    model = _stack(layers, batch=batch)
    wrt = [t.name for t in model.graph.initializer if t.name != "u"]
    x = np.random.default_rng(2).standard_normal((batch, D)).astype(np.float32)
    peaks = []
    for memory_efficient in (True, False):
        plan = compile_model(build_gradient_model(model, "loss", wrt, memory_efficient=memory_efficient))
        plan.run({"x": x})
        peaks.append(plan.peak_bytes)
    assert peaks[0] <= peaks[1] - (layers - 1) * batch * D * 4, peaks


def test_legacy_session_option_trains_like_the_default() -> None:
    from onnxtrain import TrainingSession
    from tests.session.helpers import params

    model = _stack(2, batch=16)
    sessions = [TrainingSession(model.SerializeToString(),
                                params("AdamOptimizer", use_memory_efficient_gradient=on))
                for on in (True, False)]
    assert "a1" not in _backward_reads(sessions[0]._graphs.gradient, model)
    assert "a1" in _backward_reads(sessions[1]._graphs.gradient, model)
    rng = np.random.default_rng(3)
    for _ in range(10):
        feeds = {"x": rng.standard_normal((16, D)).astype(np.float32),
                 "Learning_Rate": np.array([1e-2], np.float32)}
        losses = [s.run(["loss"], feeds)[0] for s in sessions]
        np.testing.assert_allclose(losses[0], losses[1], rtol=1e-4, atol=1e-4)
    a, b = (s.get_state() for s in sessions)
    for k in a:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_cli_gradient_graph_memory_efficient(tmp_path) -> None:
    import subprocess
    import sys

    path, out = tmp_path / "m.onnx", tmp_path / "g.onnx"
    model = _stack(2)
    onnx.save(model, str(path))
    r = subprocess.run([sys.executable, "-m", "onnxtrain", "gradient-graph", str(path), "--loss", "loss",
                        "--wrt", "W0,W1", "--memory-efficient", "-o", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert not {"a0", "a1"} & _backward_reads(onnx.load(str(out)), model)


def test_gradient_graph_builder_reads_the_option() -> None:
    """GradientGraphBuilder(..., options) with ``use_memory_efficient_gradient`` (TrainingParameters' name)
    builds the LayerNorm gradients from the outputs, as the CLI's --memory-efficient does (the options were
    stored and never read), with the default rule's gradients to rounding."""
    from types import SimpleNamespace

    from onnxtrain import GradientGraphBuilder

    model = _stack(2)
    built = []
    for options in (None, SimpleNamespace(use_memory_efficient_gradient=True)):
        b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W0", "W1"}, "loss", options)
        b.build()
        built.append(onnx.load_from_string(b.get_model()))
    assert {"a0", "a1"} <= _backward_reads(built[0], model)
    assert not {"a0", "a1"} & _backward_reads(built[1], model)
    x = np.random.default_rng(1).standard_normal((6, D)).astype(np.float32)
    for a, b in zip(compile_model(built[0]).run({"x": x}), compile_model(built[1]).run({"x": x})):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)

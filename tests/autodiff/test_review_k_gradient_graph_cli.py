"""Review K: ``onnxtrain gradient-graph`` (the CLI) on a model torch's TorchScript exporter wrote (Linear,
LayerNorm, erf GELU, Conv1d, Tanh, Softplus, an MSE in the graph), the written graph run by onnxruntime 1.32
against torch autograd in float64 on the same float32 weights: each flag does what its help says
(--all-initializers: every float initializer; --wrt: the values named, an intermediate one too;
--memory-efficient: the LayerNormalization gradient reads its output, not its input; the model's outputs
first, then <x>_grad), and a wrong value names its flag (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.ln, self.l2 = torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3)
        self.conv = torch.nn.Conv1d(1, 2, 3)

    def forward(self, x, t):
        self.h = h = self.l1(x)  # (kept for its gradient)
        y = self.l2(torch.nn.functional.gelu(self.ln(h))) + self.conv(x[:, None, :]).flatten(1)[:, :3].tanh()
        return ((y - t) ** 2).mean() + 0.1 * torch.nn.functional.softplus(y).sum(), y


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    m32 = _Model()
    x, t = torch.randn(4, 6), torch.randn(4, 3)
    path = str(tmp_path_factory.mktemp("gg") / "m.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m32, (x, t), path, input_names=["x", "t"], output_names=["loss", "y"], dynamo=False,
                          opset_version=17, dynamic_axes={"x": {0: "N"}, "t": {0: "N"}},
                          do_constant_folding=False)
    m64 = _Model().double()
    m64.load_state_dict({k: v.double() for k, v in m32.state_dict().items()})
    return path, m64, x, t


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ONNXTRAIN_DEBUG"}
    return subprocess.run([sys.executable, "-m", "onnxtrain.cli", "gradient-graph", *args],
                          capture_output=True, text=True, env=env, timeout=120)


def _torch_grads(m64, x, t, wanted: list[str]) -> tuple[float, dict[str, np.ndarray]]:
    loss, _ = m64(x.double(), t.double())
    h = m64.h
    h.retain_grad()
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in m64.named_parameters()}
    grads[_H] = h.grad.numpy()
    m64.zero_grad()
    return float(loss.detach()), {w: grads[w] for w in wanted}


_H = "/l1/Gemm_output_0"  # the first Linear's output, as the exporter names it
_PARAMS = sorted(["l1.weight", "l1.bias", "ln.weight", "ln.bias", "l2.weight", "l2.bias", "conv.weight",
                  "conv.bias"])


@pytest.mark.parametrize(("flags", "wanted"), [
    (["--all-initializers"], _PARAMS),
    (["--all-initializers", "--memory-efficient"], _PARAMS),
    (["--wrt", f"x,{_H},conv.weight"], ["x", _H, "conv.weight"]),
])
def test_gradient_graph_in_onnxruntime_against_torch_autograd(exported, tmp_path, flags, wanted) -> None:
    path, m64, x, t = exported
    out = str(tmp_path / "g.onnx")
    proc = _cli(path, "--loss", "loss", *flags, "-o", out)
    assert proc.returncode == 0, proc.stderr
    g = onnx.load(out)
    onnx.checker.check_model(g, full_check=True)
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    assert names[:2] == ["loss", "y"] and sorted(names[2:]) == sorted(w + "_grad" for w in wanted)
    got = dict(zip(names, sess.run(None, {"x": x.numpy(), "t": t.numpy()})))
    if "x" in wanted:
        x = x.clone().requires_grad_()
        loss, grads = _torch_grads(m64, x, t, [w for w in wanted if w != "x"])
        x64 = x.detach().double().requires_grad_()
        lx, _ = m64(x64, t.double())
        grads["x"] = torch.autograd.grad(lx, x64)[0].numpy()
    else:
        loss, grads = _torch_grads(m64, x, t, wanted)
    np.testing.assert_allclose(got["loss"], loss, rtol=1e-6)
    for w in wanted:
        scale = np.abs(grads[w]).max()
        np.testing.assert_allclose(got[w + "_grad"], grads[w], atol=1e-6 * max(scale, 1), err_msg=w)
    ln_grad = {i for n in g.graph.node if n.name.startswith("/ln/LayerNormalization_Grad") for i in n.input}
    if "--memory-efficient" in flags:  # from the output xhat = (Y - B) / Scale, not the input
        assert "/ln/LayerNormalization_output_0" in ln_grad and _H not in ln_grad
    elif "--all-initializers" in flags:
        assert _H in ln_grad


@pytest.mark.parametrize(("flags", "named"), [
    (["--loss", "nope", "--wrt", "x"], "--loss: 'nope'"),
    (["--loss", "loss", "--wrt", "nope"], "--wrt: 'nope'"),
    (["--loss", "loss", "--wrt", "x,x"], "--wrt: 'x' given twice"),
    (["--loss", "loss", "--wrt", "x", "--all-initializers"], "--all-initializers"),
    (["--loss", "loss"], "--wrt --all-initializers"),
])
def test_a_wrong_flag_value_names_the_flag(exported, tmp_path, flags, named) -> None:
    path = exported[0]
    proc = _cli(path, *flags, "-o", str(tmp_path / "g.onnx"))
    assert proc.returncode == 2, proc.stderr
    assert named in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not os.path.exists(tmp_path / "g.onnx")

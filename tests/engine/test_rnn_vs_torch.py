"""torch.nn.LSTM / nn.GRU (2 layers, bidirectional, batch_first) exported to ONNX, run on our engine."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from onnxtrain.engine import compile_model  # noqa: E402

N_IN, HID, LAYERS, BATCH, STEPS = 5, 6, 2, 3, 7


class _Net(torch.nn.Module):
    """The recurrent module alone; initial states are inputs when given, else zeros."""

    def __init__(self, kind: str):
        super().__init__()
        cls = torch.nn.LSTM if kind == "lstm" else torch.nn.GRU
        self.rnn = cls(N_IN, HID, num_layers=LAYERS, bidirectional=True, batch_first=True)
        self.kind = kind

    def forward(self, x, h0=None, c0=None):
        if h0 is None:  # zero initial states, built in the graph from x's shape
            y, hc = self.rnn(x)
            return (y, *hc) if self.kind == "lstm" else (y, hc)
        if self.kind == "lstm":
            y, (h, c) = self.rnn(x, (h0, c0))
            return y, h, c
        y, h = self.rnn(x, h0)
        return y, h


def _export(net: torch.nn.Module, args: tuple, names: list[str], fold: bool) -> onnx.ModelProto:
    buf = io.BytesIO()
    n_out = 3 if isinstance(net.rnn, torch.nn.LSTM) else 2
    torch.onnx.export(net, args, buf, dynamo=False, opset_version=17, input_names=names,
                      output_names=[f"out{i}" for i in range(n_out)], do_constant_folding=fold)
    return onnx.load_from_string(buf.getvalue())


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("fold", [True, False], ids=["folded", "unfolded"])
@pytest.mark.parametrize("states", [True, False], ids=["h0", "zero_h0"])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_matches_torch(kind: str, states: bool, fold: bool) -> None:
    torch.manual_seed(0)
    net = _Net(kind).eval()
    x = torch.randn(BATCH, STEPS, N_IN)
    h0 = torch.randn(2 * LAYERS, BATCH, HID)
    args: tuple = (x, h0, torch.randn(2 * LAYERS, BATCH, HID)) if kind == "lstm" else (x, h0)
    if not states:
        args = (x,)
    names = ["x", "h0", "c0"][:len(args)]
    model = _export(net, args, names, fold)
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("LSTM" if kind == "lstm" else "GRU") == LAYERS
    if not fold:  # the weight reordering stays in the graph as Slice/Concat chains
        assert "Slice" in ops and "Concat" in ops
    with torch.no_grad():
        expected = [t.numpy() for t in net(*args)]
    feeds = {n: a.numpy() for n, a in zip(names, args)}
    got = compile_model(model).run(feeds)
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert a.shape == b.shape, f"output {i}: {a.shape} != {b.shape}"
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=f"{kind} output {i}")

"""ConvTranspose with auto_pad SAME_* and static sizes: the gradient uses the output sizes the node
produces (the spec's S·s, as onnxtrain's kernel computes them), not ONNX shape inference's.

Inference disagrees with the spec in two cases: with output_padding it gives S·s + output_padding (the
grouped weight gradient's Reshape to Y's sizes then fails at run time), and where k_eff + output_padding < s
it clamps Y to the full, unpadded output (one column short, so dY was cropped one row too far and dX and dW
came out short). onnxruntime 1.32 follows the spec in the first case and the clamped size in the second;
the oracle here is the spec: torch's full transposed convolution, output_padding appended, then cropped (or,
for negative pads, zero-padded) to S·s, differentiated by autograd in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain import InferenceSession
from onnxtrain.autodiff import build_gradient_model

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _spec_pads(sp, k, s, d, op, upper: bool) -> list[tuple[int, int]]:
    """(begin, end) pads of SAME_*: total = s·(S − 1) + output_padding + k_eff − S·s, the odd one at the
    end (UPPER) or the beginning (LOWER); negative totals add zero rows."""
    pads = []
    for i in range(len(sp)):
        total = s[i] * (sp[i] - 1) + op[i] + (k[i] - 1) * d[i] + 1 - sp[i] * s[i]
        begin = total // 2 if upper else total - total // 2
        pads.append((begin, total - begin))
    return pads


def _oracle(x, w, b, s, d, op, group: int, upper: bool):
    nd = x.dim() - 2
    convt = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    y = convt(x, w, None, stride=s, dilation=d, groups=group)
    torch_pads: list[int] = []
    for i in reversed(range(nd)):  # F.pad: last axis first
        torch_pads += [0, op[i]]
    y = F.pad(y, tuple(torch_pads))  # output_padding rows belong to the full output
    torch_pads = []
    for pb, pe in reversed(_spec_pads(list(x.shape[2:]), list(w.shape[2:]), s, d, op, upper)):
        torch_pads += [-pb, -pe]
    return F.pad(y, tuple(torch_pads)) + b.reshape(1, -1, *[1] * nd)


def _model(attrs: dict[str, Any], xs, ws, bias: int) -> onnx.ModelProto:
    """loss = Σ ConvTranspose(x, w, b) · u, all sizes static except u's (fed at run time)."""
    el = onnx.TensorProto.DOUBLE
    ins = [helper.make_tensor_value_info("x", el, list(xs)), helper.make_tensor_value_info("w", el, list(ws)),
           helper.make_tensor_value_info("b", el, [bias]),
           helper.make_tensor_value_info("u", el, [f"u{i}" for i in range(len(xs))])]
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="convt", **attrs),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "convt_same", ins, [helper.make_tensor_value_info("loss", el, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


CASES = [  # X's shape, W's shape, strides, dilations, output_padding, group
    # output_padding ≠ 0: inference says 19×16 (grouped: the weight gradient's Reshape failed)
    ((2, 4, 9, 8), (4, 3, 3, 3), (2, 2), (1, 1), (1, 0), 2),
    ((2, 4, 5, 6), (4, 1, 3, 2), (2, 3), (2, 1), (1, 2), 2),
    ((1, 4, 5), (4, 2, 3), (2,), (1,), (1,), 2),
    ((1, 2, 3, 4, 3), (2, 1, 3, 1, 1), (2, 2, 3), (1, 1, 1), (1, 0, 1), 2),
    # k_eff + output_padding < s: inference clamps 27×24 to the full 27×23 (dX and dW came out short)
    ((2, 3, 9, 8), (3, 2, 3, 2), (3, 3), (1, 1), (0, 0), 1),
    ((2, 4, 7, 6), (4, 1, 1, 1), (3, 2), (1, 1), (1, 0), 2),
    ((1, 2, 5), (2, 2, 2), (3,), (1,), (0,), 1),
]


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("xs,ws,s,d,op,group", CASES, ids=str)
def test_conv_transpose_same_static_sizes_vs_torch(xs, ws, s, d, op, group: int, auto_pad: str) -> None:
    attrs = {"auto_pad": auto_pad, "strides": list(s), "dilations": list(d), "output_padding": list(op),
             "group": group}
    bias = ws[1] * group
    model = _model(attrs, xs, ws, bias)
    gmodel = build_gradient_model(model, "loss", ["x", "w", "b"])
    onnx.checker.check_model(gmodel, full_check=True)

    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal(xs), "w": rng.standard_normal(ws), "b": rng.standard_normal(bias)}
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    y = _oracle(ts["x"], ts["w"], ts["b"], list(s), list(d), list(op), group, auto_pad == "SAME_UPPER")
    assert list(y.shape[2:]) == [n * st for n, st in zip(xs[2:], s)]
    feeds["u"] = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(feeds["u"])).sum().backward()

    # the forward on onnxtrain's engine is the spec's
    fwd = onnx.ModelProto()
    fwd.CopyFrom(model)
    fwd.graph.output.append(helper.make_tensor_value_info("y", onnx.TensorProto.DOUBLE, None))
    y_ours = InferenceSession(fwd).run(["y"], feeds)[0]
    np.testing.assert_allclose(y_ours, y.detach().numpy(), rtol=1e-12, atol=1e-12)

    ours = dict(zip([o.name for o in gmodel.graph.output], InferenceSession(gmodel).run(None, feeds)))
    for name in ("x", "w", "b"):
        want = ts[name].grad.numpy()
        got = ours[f"{name}_grad"]
        assert got.shape == want.shape, f"d{name}: {got.shape} vs torch {want.shape}"
        np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-12, err_msg=f"d{name} ({auto_pad})")

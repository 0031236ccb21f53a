"""ConvTranspose with output_padding ≥ stride (the spec and torch allow it below max(stride, dilation)).

The gradient rule refused it ("output_padding ... >= strides ... is not supported"): dX, a Conv of dY over
the full output s·(S − 1) + output_padding + k_eff, then has S + ⌊output_padding / s⌋ windows, the last ones
past X's end; they are now cut off. The engine's kernel computed a stride-1 ConvTranspose with 8 or more
channels as a Conv whose end pads left the output_padding rows out (Y short by them). The oracle is torch's
autograd in float64: F.conv_transpose1d/2d with ``output_padding`` where the pads are symmetric, else the
full transposed convolution with output_padding cropped by the spec's pads (auto_pad SAME_*, output_shape).
Spatial sizes are static or symbolic (the gradient graph built once, run at the concrete sizes), and every
gradient graph passes onnx.checker's full check. output_padding ≥ max(stride, dilation), which the spec does
not allow, is refused with the node and the attribute named.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.testing import run_engine
from tests.ir.test_conv_transpose_shapes import _spec_pads

torch = pytest.importorskip("torch")
F = torch.nn.functional
DOUBLE = onnx.TensorProto.DOUBLE

# X's shape, W's shape, attributes (each output_padding ≥ its stride on some axis, below the dilation)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "2d_stride1": ((2, 3, 5, 4), (3, 2, 3, 3), {"dilations": [2, 2], "pads": [1, 1, 1, 1],
                                                "output_padding": [1, 1]}),
    "2d_group2": ((2, 4, 4, 5), (4, 3, 2, 3), {"strides": [2, 1], "dilations": [3, 2], "pads": [1, 0, 1, 0],
                                               "output_padding": [2, 1], "group": 2}),
    "2d_group3_one_channel_each": ((1, 6, 3, 4), (6, 1, 3, 2),
                                   {"strides": [1, 2], "dilations": [3, 3], "pads": [2, 1, 2, 1],
                                    "output_padding": [2, 2], "group": 3}),
    # stride 1, group 1, 8 channels, 3×3: the kernel's Conv-by-shifted-GEMMs path
    "2d_stride1_8_channels": ((2, 8, 5, 5), (8, 4, 3, 3), {"dilations": [2, 3], "pads": [1, 2, 1, 2],
                                                           "output_padding": [1, 2]}),
    "2d_group2_no_pads": ((2, 4, 6, 5), (4, 2, 2, 2), {"strides": [2, 2], "dilations": [4, 3],
                                                       "output_padding": [3, 2], "group": 2}),
    "1d_two_extra_windows": ((2, 3, 6), (3, 2, 3), {"dilations": [3], "pads": [1, 1],
                                                    "output_padding": [2]}),
    "1d_group3": ((2, 6, 5), (6, 2, 2), {"strides": [2], "dilations": [3], "pads": [2, 2],
                                         "output_padding": [2], "group": 3}),
    # pads from auto_pad / output_shape (the rule's run-time pads where the sizes are symbolic)
    "2d_same_upper": ((2, 3, 4, 5), (3, 2, 2, 3), {"auto_pad": "SAME_UPPER", "strides": [1, 2],
                                                    "dilations": [3, 3], "output_padding": [2, 2]}),
    "1d_same_lower_group2": ((2, 4, 5), (4, 1, 3), {"auto_pad": "SAME_LOWER", "dilations": [2],
                                                    "output_padding": [1], "group": 2}),
    "2d_output_shape": ((1, 3, 4, 3), (3, 2, 2, 2), {"strides": [1, 2], "dilations": [3, 3],
                                                      "output_padding": [2, 1], "output_shape": [9, 8]}),
}


def _torch_y(x, w, b, attrs: dict[str, Any]):
    nd = x.dim() - 2
    convt = (F.conv_transpose1d, F.conv_transpose2d)[nd - 1]
    kw = {"stride": attrs.get("strides", 1), "dilation": attrs.get("dilations", 1),
          "groups": attrs.get("group", 1), "output_padding": attrs.get("output_padding", 0)}
    pads = _spec_pads(tuple(x.shape), tuple(w.shape), attrs)
    if all(p == q >= 0 for p, q in pads):  # torch's own padding
        return convt(x, w, b, padding=[p for p, _ in pads], **kw)
    y = convt(x, w, None, **kw)  # the full output, then the spec's crop
    crop: list[int] = []
    for p, q in reversed(pads):  # F.pad takes the last axis first
        crop += [-p, -q]
    return F.pad(y, tuple(crop)) + b.reshape(1, -1, *[1] * nd)


def _model(xs, ws, attrs: dict[str, Any], dynamic: bool) -> onnx.ModelProto:
    """loss = Σ ConvTranspose(x, w, b)·u, u of a symbolic shape; x's spatial sizes symbolic if ``dynamic``."""
    nd = len(xs) - 2
    x_dims = [xs[0], xs[1], *(["H", "W"][2 - nd:] if dynamic else xs[2:])]
    m = ws[1] * attrs.get("group", 1)
    ins = [helper.make_tensor_value_info("x", DOUBLE, x_dims), helper.make_tensor_value_info("w", DOUBLE, ws),
           helper.make_tensor_value_info("b", DOUBLE, [m]),
           helper.make_tensor_value_info("u", DOUBLE, [f"u{i}" for i in range(nd + 2)])]
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", **attrs),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "convt_outpad", ins, [helper.make_tensor_value_info("loss", DOUBLE, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("case", list(CASES))
def test_output_padding_beyond_stride_vs_torch(case: str, dynamic: bool) -> None:
    xs, ws, attrs = CASES[case]
    nd = len(xs) - 2
    s, d = attrs.get("strides", [1] * nd), attrs["dilations"]
    op = attrs["output_padding"]
    assert any(o >= si for o, si in zip(op, s)) and all(o < max(si, di) for o, si, di in zip(op, s, d))
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal(xs), "w": rng.standard_normal(ws),
             "b": rng.standard_normal(ws[1] * attrs.get("group", 1))}
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    y = _torch_y(ts["x"], ts["w"], ts["b"], attrs)
    feeds["u"] = rng.standard_normal(tuple(y.shape))
    (y * torch.tensor(feeds["u"])).sum().backward()

    model = _model(xs, ws, attrs, dynamic)
    fwd = onnx.ModelProto()
    fwd.CopyFrom(model)
    fwd.graph.output.append(helper.make_tensor_value_info("y", DOUBLE, None))
    got_y = run_engine(fwd, feeds)[1]
    assert got_y.shape == tuple(y.shape)
    np.testing.assert_allclose(got_y, y.detach().numpy(), rtol=1e-10, atol=1e-12, err_msg="Y")

    gmodel = build_gradient_model(model, "loss", ["x", "w", "b"])
    onnx.checker.check_model(gmodel, full_check=True)
    got = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))
    for name in ("x", "w", "b"):
        want = ts[name].grad.numpy()
        mine = got[f"{name}_grad"]
        assert mine.shape == want.shape, f"d{name}: {mine.shape} vs torch {want.shape}"
        np.testing.assert_allclose(mine, want, rtol=1e-10, atol=1e-12, err_msg=f"d{name}")


@pytest.mark.parametrize("strides,dilations,output_padding", [
    ([2, 2], [1, 3], [1, 3]),  # 3 = max(2, 3) on the second axis
    ([1, 2], [1, 1], [1, 0]),  # 1 = max(1, 1)
    ([3, 1], [2, 2], [3, 1]),
])
def test_output_padding_at_max_of_stride_and_dilation_is_refused(strides, dilations,
                                                                   output_padding) -> None:
    xs, ws = (1, 2, 4, 4), (2, 2, 2, 2)
    attrs = {"strides": strides, "dilations": dilations, "output_padding": output_padding}
    with pytest.raises(RuntimeError, match="output padding must be smaller"):  # torch refuses it too
        F.conv_transpose2d(torch.zeros(xs), torch.zeros(ws), stride=strides, dilation=dilations,
                           output_padding=output_padding)
    with pytest.raises(GradientError) as e:
        build_gradient_model(_model(xs, ws, attrs, False), "loss", ["x", "w"])
    msg = str(e.value)
    assert "'up'" in msg and "output_padding" in msg and "max(stride, dilation)" in msg, msg

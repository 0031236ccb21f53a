"""``value_types`` gives ConvTranspose outputs the dims the node computes (the ONNX spec, which onnxtrain's
kernel follows), not ONNX 1.23's inference's, and carries them to the values after it.

Inference disagrees with the spec under auto_pad SAME_* with an output_padding (S·s + output_padding for
S·s), under SAME_* where k_eff + output_padding < s (the full output for S·s), and with an output_shape entry
below X's size (Y one or more dims short). The gradient of the ConvTranspose itself recomputed Y's sizes, but
the nodes after Y kept the wrong ones: a Conv of stride 2 or 3 after it got a dX of the wrong shape, a
ReduceMean a wrong count, and the short rank was refused outright. The oracle is torch in float64: the full
transposed convolution, output_padding appended, then cropped (zero-padded for negative pads) as the spec's
pads say, followed by the Conv, differentiated by autograd; the forward shapes are onnxtrain's kernel's.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain import InferenceSession
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import value_types
from onnxtrain.ir.conv_shapes import conv_transpose_dims, conv_transpose_geometry
from onnxtrain.ir.types import symbolic_shape

torch = pytest.importorskip("torch")
F = torch.nn.functional
DOUBLE = onnx.TensorProto.DOUBLE


def _spec_pads(xs, ws, attrs: dict[str, Any]) -> list[tuple[int, int]]:
    """(begin, end) pads per spatial axis as the ONNX spec derives them (negative: zero rows added)."""
    nd = len(xs) - 2
    s = attrs.get("strides", [1] * nd)
    d = attrs.get("dilations", [1] * nd)
    op = attrs.get("output_padding", [0] * nd)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    want = attrs.get("output_shape")
    if want is None and auto_pad.startswith("SAME"):
        want = [xs[2 + i] * s[i] for i in range(nd)]
    if want is None:
        pads = attrs.get("pads", [0] * (2 * nd))
        return [(pads[i], pads[nd + i]) for i in range(nd)]
    out = []
    for i in range(nd):
        total = s[i] * (xs[2 + i] - 1) + op[i] + (ws[2 + i] - 1) * d[i] + 1 - want[i]
        small, big = total // 2, total - total // 2
        out.append((small, big) if auto_pad == "SAME_UPPER" else (big, small))
    return out


def _torch_chain(ts: dict[str, Any], attrs: dict[str, Any], conv_stride: int | None):
    """Y = ConvTranspose(x, w, b) by the spec; Z = Conv(Y, w2, b2) with ``conv_stride`` (None: Z = Y)."""
    x, w = ts["x"], ts["w"]
    nd = x.dim() - 2
    convt = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[nd - 1]
    y = convt(x, w, None, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
              groups=attrs.get("group", 1))
    op = attrs.get("output_padding", [0] * nd)
    pads: list[int] = []
    for i in reversed(range(nd)):  # F.pad takes the last axis first
        pads += [0, op[i]]
    y = F.pad(y, tuple(pads))
    pads = []
    for pb, pe in reversed(_spec_pads(tuple(x.shape), tuple(w.shape), attrs)):
        pads += [-pb, -pe]
    y = F.pad(y, tuple(pads)) + ts["b"].reshape(1, -1, *[1] * nd)
    if conv_stride is None:
        return y
    conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
    return conv(y, ts["w2"], ts["b2"], stride=conv_stride)


def _chain_model(xs, ws, attrs: dict[str, Any], conv_stride: int,
                 k2: int = 2) -> tuple[onnx.ModelProto, dict]:
    """loss = ReduceMean(Conv(ConvTranspose(x, w, b), w2, b2)), all sizes as given; returns the model and
    the static shapes of its inputs."""
    nd = len(xs) - 2
    m = ws[1] * attrs.get("group", 1)
    shapes = {"x": xs, "w": ws, "b": (m,), "w2": (3, m, *[k2] * nd), "b2": (3,)}
    ins = [helper.make_tensor_value_info(k, DOUBLE, list(v)) for k, v in shapes.items()]
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs),
             helper.make_node("Conv", ["y", "w2", "b2"], ["z"], strides=[conv_stride] * nd),
             helper.make_node("ReduceMean", ["z"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "convt_chain", ins, [helper.make_tensor_value_info("loss", DOUBLE, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), shapes


def _static_shapes(shapes: dict, concrete: dict[str, tuple[int, ...]] | None) -> dict:
    return {k: tuple(v) if concrete is None or k not in concrete else concrete[k] for k, v in shapes.items()}


def _check_against_torch(model: onnx.ModelProto, shapes: dict, attrs: dict[str, Any], conv_stride: int | None,
                         wrt: list[str]) -> None:
    gmodel = build_gradient_model(model, "loss", wrt)
    try:
        onnx.checker.check_model(model, full_check=True)
    except onnx.shape_inference.InferenceError as e:
        # ONNX's own inference refuses the forward model (Y a rank short, the Conv after it then "of
        # incorrect size" or short of dims), and so the gradient model that contains it: the rest of the
        # check still holds
        assert "output_shape" in attrs and "(op_type:Conv)" in str(e), e
        onnx.checker.check_model(gmodel)
    else:
        onnx.checker.check_model(gmodel, full_check=True)
    rng = np.random.default_rng(3)
    feeds = {k: rng.standard_normal(v) for k, v in shapes.items()}
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    out = _torch_chain(ts, attrs, conv_stride)
    loss = out.mean() if conv_stride is not None else (out * torch.tensor(feeds["u"])).sum()
    loss.backward()
    got = dict(zip([o.name for o in gmodel.graph.output], InferenceSession(gmodel).run(None, feeds)))
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-12)
    for name in wrt:
        want = ts[name].grad.numpy()
        mine = got[f"{name}_grad"]
        assert mine.shape == want.shape, f"d{name}: {mine.shape} vs torch {want.shape}"
        np.testing.assert_allclose(mine, want, rtol=1e-10, atol=1e-13, err_msg=f"d{name}")


CASES = {  # X's shape, W's shape, ConvTranspose attributes: each one inference gets wrong
    "2d_same_upper_outpad": ((2, 3, 5, 4), (3, 2, 3, 3),
                             {"auto_pad": "SAME_UPPER", "strides": [2, 2], "output_padding": [1, 1]}),
    "2d_same_lower_short_kernel": ((2, 3, 4, 5), (3, 2, 2, 2), {"auto_pad": "SAME_LOWER", "strides": [3, 3]}),
    "1d_same_upper_outpad": ((2, 3, 6), (3, 2, 3), {"auto_pad": "SAME_UPPER", "strides": [2],
                                                    "output_padding": [1]}),
    "3d_same_lower_outpad": ((1, 2, 3, 4, 3), (2, 2, 3, 2, 2),
                             {"auto_pad": "SAME_LOWER", "strides": [2, 2, 3], "output_padding": [1, 0, 1]}),
    "2d_group2_same_upper": ((2, 4, 5, 4), (4, 3, 3, 3),
                             {"auto_pad": "SAME_UPPER", "strides": [2, 2], "output_padding": [1, 0],
                              "dilations": [1, 2], "group": 2}),
    "2d_output_shape_below_x": ((2, 3, 5, 4), (3, 2, 3, 3), {"output_shape": [6, 3]}),
    "2d_output_shape_below_x_strided": ((2, 3, 5, 4), (3, 2, 3, 3),
                                        {"strides": [2, 2], "output_shape": [10, 3]}),
    "1d_output_shape_below_x": ((2, 3, 7), (3, 2, 2), {"output_shape": [4]}),
    "3d_group2_output_shape_below_x": ((1, 4, 4, 3, 5), (4, 1, 2, 2, 2),
                                       {"group": 2, "strides": [1, 2, 1], "output_shape": [5, 2, 6]}),
}


def _kernel_forward_shapes(model: onnx.ModelProto, shapes: dict) -> dict[str, tuple[int, ...]]:
    fwd = onnx.ModelProto()
    fwd.CopyFrom(model)
    fwd.graph.output.extend(helper.make_tensor_value_info(v, DOUBLE, None) for v in ("y", "z"))
    rng = np.random.default_rng(0)
    got = InferenceSession(fwd).run(["y", "z"], {k: rng.standard_normal(v) for k, v in shapes.items()})
    return {"y": got[0].shape, "z": got[1].shape}


@pytest.mark.parametrize("conv_stride", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_value_types_are_the_kernels_shapes(case: str, conv_stride: int) -> None:
    xs, ws, attrs = CASES[case]
    model, shapes = _chain_model(xs, ws, attrs, conv_stride)
    want = _kernel_forward_shapes(model, shapes)
    types = value_types(model)
    for v in ("y", "z"):
        assert tuple(symbolic_shape(types, v)) == want[v], v


@pytest.mark.parametrize("conv_stride", [1, 2, 3])
@pytest.mark.parametrize("case", list(CASES))
def test_conv_transpose_then_conv_gradients_vs_torch(case: str, conv_stride: int) -> None:
    xs, ws, attrs = CASES[case]
    model, shapes = _chain_model(xs, ws, attrs, conv_stride)
    _check_against_torch(model, shapes, attrs, conv_stride, ["x", "w", "b", "w2", "b2"])


def test_output_shape_below_input_gets_torchs_gradients() -> None:
    """The model the rule refused ("ONNX shape inference gives Y 1 spatial dims instead of 2"): Y now has
    its 4 dims, and the gradient is torch's."""
    attrs = {"output_shape": [6, 3]}
    shapes = {"x": (2, 4, 5, 4), "w": (4, 3, 3, 3), "b": (3,), "u": (2, 3, 6, 3)}
    ins = [helper.make_tensor_value_info(k, DOUBLE, list(v)) for k, v in shapes.items() if k != "u"]
    ins.append(helper.make_tensor_value_info("u", DOUBLE, ["u0", "u1", "u2", "u3"]))
    nodes = [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "convt_short", ins, [helper.make_tensor_value_info("loss", DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    assert symbolic_shape(value_types(model), "y") == [2, 3, 6, 3]
    _check_against_torch(model, shapes, attrs, None, ["x", "w", "b"])


# X's spatial sizes not static: what the kernel tells (an output_shape, a static axis, X's dim name where
# Y keeps it), unknown elsewhere
DYNAMIC = {
    # axis 1 static: inference gave 9 (S·s + output_padding), the kernel 8; axis 0 unknown (2·H)
    "same_outpad_one_axis_static": (
        (2, 3, "H", 4), (3, 2, 3, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2], "output_padding": [1, 1]},
        [2, 2, None, 8], (2, 3, 5, 4)),
    # stride 1 and SAME: Y keeps X's spatial dims (inference made up names)
    "same_stride1_keeps_names": (
        ("N", 3, "H", "W"), (3, 2, 3, 3), {"auto_pad": "SAME_LOWER"}, ["N", 2, "H", "W"], (2, 3, 5, 4)),
    # stride 1 and pads taking back k_eff − 1: the same
    "pads_stride1_keeps_names": (
        ("N", 3, "H", "W"), (3, 2, 3, 3), {"pads": [1, 1, 1, 1]}, ["N", 2, "H", "W"], (2, 3, 5, 4)),
}


@pytest.mark.parametrize("case", list(DYNAMIC))
def test_dynamic_spatial_sizes(case: str) -> None:
    xs, ws, attrs, want, concrete = DYNAMIC[case]
    model, shapes = _chain_model(xs, ws, attrs, 2)
    types = value_types(model)
    got = symbolic_shape(types, "y")
    assert [d if d is None or not str(d).startswith("unk__") else None for d in got] == want
    static = _static_shapes(shapes, {"x": concrete})
    ran = _kernel_forward_shapes(model, static)["y"]
    names = {d: c for d, c in zip(xs, concrete) if isinstance(d, str)}
    for d, c in zip(want, ran):  # each dim told is the kernel's: a size, or X's size of that name
        assert d is None or (d == c if isinstance(d, int) else names[d] == c), (want, ran)
    _check_against_torch(model, static, attrs, 2, ["x", "w", "b", "w2", "b2"])


@pytest.mark.parametrize("conv_stride", [1, 2, 3])
@pytest.mark.parametrize("case", ["2d_same_upper_outpad", "2d_same_lower_short_kernel",
                                  "2d_group2_same_upper"])
def test_model_saved_after_onnx_inference(case: str, conv_stride: int) -> None:
    """A model saved after ONNX's inference declares its wrong dims for Y and every value after it (Z a
    graph output too): the declarations give way to the kernel's dims."""
    xs, ws, attrs = CASES[case]
    model, shapes = _chain_model(xs, ws, attrs, conv_stride)
    saved = onnx.shape_inference.infer_shapes(model)
    z = next(v for v in saved.graph.value_info if v.name == "z")
    saved.graph.output.append(z)
    want = _kernel_forward_shapes(model, shapes)
    types = value_types(saved)
    for v in ("y", "z"):
        assert tuple(symbolic_shape(types, v)) == want[v], v
    _check_against_torch(saved, shapes, attrs, conv_stride, ["x", "w", "b", "w2", "b2"])


def test_the_one_formula_gives_torchs_output_sizes() -> None:
    """conv_transpose_geometry (the formula the kernel, the gradient rule and these shapes share) against
    torch's output sizes over a grid of sizes, kernels, strides, dilations, pads and every output_padding
    the spec allows (below max(stride, dilation), so at or beyond the stride where the dilation is larger):
    Y's size with symmetric pads, the full output without them, S·s under auto_pad SAME_* and output_shape
    (torch's full output cropped by the pads, zero-padded where they are negative), and
    conv_transpose_dims on static and symbolic sizes."""
    checked = beyond_stride = 0
    for size, k, s, d in itertools.product(range(1, 5), range(1, 4), range(1, 4), range(1, 4)):
        x, w = torch.zeros(1, 1, size), torch.zeros(1, 1, k)
        for op in range(max(s, d)):
            full = F.conv_transpose1d(x, w, stride=s, dilation=d, output_padding=op).shape[-1]
            for p in range(3):
                geo = conv_transpose_geometry([size], [k], [s], [d], [op], "NOTSET", [p, p])
                assert geo.full == [full] and (geo.pad_begin, geo.pad_end) == ([p], [p])
                attrs = {"strides": [s], "dilations": [d], "output_padding": [op], "pads": [p, p]}
                if full - 2 * p < 1:  # torch refuses an empty output, the kernel too
                    with pytest.raises(RuntimeError):
                        F.conv_transpose1d(x, w, stride=s, padding=p, dilation=d, output_padding=op)
                    assert geo.out == [full - 2 * p]
                    assert conv_transpose_dims(attrs, [1, 1, size], [1, 1, k]) is None
                    continue
                want = F.conv_transpose1d(x, w, stride=s, padding=p, dilation=d, output_padding=op).shape[-1]
                assert geo.out == [want], (size, k, s, d, p, op)
                assert conv_transpose_dims(attrs, [2, 1, size], [1, 3, k]) == [2, 3, want]
                named = conv_transpose_dims(attrs, [2, 1, "S"], [1, 3, k])
                assert named is not None and named[2] in ("S", None)
                assert named[2] is None or want == size  # X's name where Y keeps X's size
                checked += 1
                beyond_stride += op >= s
            for spec in ({"auto_pad": "SAME_UPPER"}, {"auto_pad": "SAME_LOWER"},
                         {"output_shape": [max(1, full - 3)]}, {"output_shape": [full + 2]}):
                geo = conv_transpose_geometry([size], [k], [s], [d], [op], spec.get("auto_pad"), None,
                                              spec.get("output_shape"))
                want = spec.get("output_shape", [size * s])
                assert geo.out == want and geo.full == [full]
                # the pads by the spec's own formula (_spec_pads), independent of the function's
                attrs = {"strides": [s], "dilations": [d], "output_padding": [op], **spec}
                assert list(zip(geo.pad_begin, geo.pad_end)) == _spec_pads([1, 1, size], [1, 1, k], attrs)
                # and torch's full output cropped by them (zero rows where negative) is Y's size
                y = F.pad(F.conv_transpose1d(x + 1, w + 1, stride=s, dilation=d, output_padding=op),
                          (-geo.pad_begin[0], -geo.pad_end[0]))
                assert [y.shape[-1]] == want
                assert conv_transpose_dims({"strides": [s], "dilations": [d], "output_padding": [op], **spec},
                                           [1, 1, size], [1, 1, k]) == [1, 1, *want]
    assert checked > 600 and beyond_stride > 100, (checked, beyond_stride)
    # 2-D: each axis its own stride, dilation, pads and output_padding
    axes = [(2, 1, 1), (1, 3, 2), (2, 3, 2), (3, 2, 1)]  # stride, dilation, output_padding
    for (s0, d0, op0), (s1, d1, op1) in itertools.product(axes, repeat=2):
        x, w = torch.zeros(1, 1, 4, 3), torch.zeros(1, 1, 2, 3)
        y = F.conv_transpose2d(x, w, stride=(s0, s1), padding=(1, 2), dilation=(d0, d1),
                               output_padding=(op0, op1))
        geo = conv_transpose_geometry([4, 3], [2, 3], [s0, s1], [d0, d1], [op0, op1], "NOTSET", [1, 2, 1, 2])
        assert geo.out == list(y.shape[2:])

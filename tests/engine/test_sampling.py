"""GridSample, AffineGrid and DeformConv kernels on cases the op table cannot check against onnx.reference.

onnx.reference knows only the opset-20 GridSample mode names, computes coordinates in float32 and
clamps cubic coordinates beyond a border (torch and onnxruntime clamp only the taps); torch (float64)
and onnxruntime are the oracles here, on plain random grids reaching beyond the image.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _model(op: str, inputs: list[Any], opset: int, **attrs: Any) -> onnx.ModelProto:
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs, strict=True) if n]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], op, g_in,
                              [helper.make_empty_tensor_value_info("y")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _feeds(inputs: list[Any]) -> dict[str, Any]:
    return {f"x{i}": v for i, v in enumerate(inputs) if v is not None}


def _ours(op: str, inputs: list[Any], opset: int, **attrs: Any) -> np.ndarray:
    return compile_model(_model(op, inputs, opset, **attrs)).run(_feeds(inputs))[0]


def _ort(op: str, inputs: list[Any], opset: int, **attrs: Any) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(_model(op, inputs, opset, **attrs).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return sess.run(None, _feeds(inputs))[0]


_TORCH_MODE = {"bilinear": "bilinear", "linear": "bilinear", "nearest": "nearest", "bicubic": "bicubic",
               "cubic": "bicubic"}
_CONFIGS = [(m, p, a) for m in ("bilinear", "nearest", "bicubic") for p in ("zeros", "border", "reflection")
            for a in (0, 1)]


@pytest.mark.parametrize("mode, padding, align", _CONFIGS, ids=[f"{m}-{p}-ac{a}" for m, p, a in _CONFIGS])
def test_grid_sample_2d_matches_torch_and_ort(mode: str, padding: str, align: int) -> None:
    rng = np.random.default_rng(len(mode) + len(padding) + align)
    x = rng.standard_normal((2, 3, 5, 7))
    grid = rng.uniform(-3, 3, (2, 4, 6, 2))  # reflects up to twice
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    want = F.grid_sample(torch.tensor(x), torch.tensor(grid), mode=_TORCH_MODE[mode], padding_mode=padding,
                         align_corners=bool(align)).numpy()
    for opset, name in ((16, mode), (20, {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode))):
        got = _ours("GridSample", [x, grid], opset, **{**attrs, "mode": name})
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"opset {opset}")
    # onnxruntime has float32 kernels at opset 16
    x32, g32 = x.astype(np.float32), grid.astype(np.float32)
    np.testing.assert_allclose(_ours("GridSample", [x32, g32], 16, **attrs),
                               _ort("GridSample", [x32, g32], 16, **attrs), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["linear", "nearest"])
@pytest.mark.parametrize("padding", ["zeros", "border", "reflection"])
def test_grid_sample_3d_matches_torch(mode: str, padding: str) -> None:
    rng = np.random.default_rng(len(padding))
    x = rng.standard_normal((2, 2, 4, 3, 5))
    grid = rng.uniform(-2.5, 2.5, (2, 3, 2, 4, 3))
    for align in (0, 1):
        got = _ours("GridSample", [x, grid], 20, mode=mode, padding_mode=padding, align_corners=align)
        want = F.grid_sample(torch.tensor(x), torch.tensor(grid), mode=_TORCH_MODE[mode],
                             padding_mode=padding, align_corners=bool(align)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"align_corners={align}")


def test_grid_sample_cubic_3d_matches_1d_composition() -> None:
    """Tri-cubic sampling on a grid constant along two axes equals bicubic sampling of X summed with the
    weights of those axes: with the points on pixel centres there (weight 1 on one pixel), it is 2-D
    bicubic of one slice, which torch checks."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 2, 3, 5, 6))
    g2 = rng.uniform(-1.5, 1.5, (1, 4, 3, 2))
    depth = np.full((1, 4, 3, 1), 0.0)  # align_corners=1: the centre slice, index 1 of 3
    grid = np.concatenate([g2, depth], axis=-1)[:, None]  # (1, 1, 4, 3, 3)
    got = _ours("GridSample", [x, grid], 20, mode="cubic", padding_mode="border", align_corners=1)
    want = F.grid_sample(torch.tensor(x[:, :, 1]), torch.tensor(g2), mode="bicubic", padding_mode="border",
                         align_corners=True).numpy()
    np.testing.assert_allclose(got[:, :, 0], want, rtol=1e-12, atol=1e-12)


def test_grid_sample_mixed_dtypes_and_empty() -> None:
    rng = np.random.default_rng(1)
    x, grid = rng.standard_normal((1, 2, 4, 4)).astype(np.float32), rng.uniform(-1, 1, (1, 3, 2, 2))
    want = F.grid_sample(torch.tensor(x, dtype=torch.float64), torch.tensor(grid), align_corners=False)
    got = _ours("GridSample", [x, grid], 20)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
    assert _ours("GridSample", [x, grid[:, :0]], 20).shape == (1, 2, 0, 2)


@pytest.mark.parametrize("bad, attrs, opset, match", [
    ("grid_rank", {}, 20, "grid"),
    ("grid_last", {}, 20, "grid"),
    ("five_d", {}, 16, "4-D"),
    ("mode", {"mode": "bilinear"}, 20, "mode"),
])
def test_grid_sample_errors(bad: str, attrs: dict[str, Any], opset: int, match: str) -> None:
    x = np.zeros((1, 1, 3, 3, 3) if bad == "five_d" else (1, 1, 3, 3), dtype=np.float32)
    grid = {"grid_rank": np.zeros((1, 2, 2), np.float32), "grid_last": np.zeros((1, 2, 2, 3), np.float32),
            "five_d": np.zeros((1, 2, 2, 2, 3), np.float32), "mode": np.zeros((1, 2, 2, 2), np.float32)}[bad]
    with pytest.raises(Exception, match=match) as info:
        _ours("GridSample", [x, grid], opset, **attrs)
    assert "GridSample" in str(info.value)


@pytest.mark.parametrize("size", [(2, 3, 4, 5), (1, 1, 1, 6), (2, 2, 3, 4, 5), (1, 1, 3, 1, 2)], ids=str)
def test_affine_grid_matches_torch(size: tuple[int, ...]) -> None:
    rng = np.random.default_rng(sum(size))
    theta = rng.standard_normal((size[0], len(size) - 2, len(size) - 1))
    for align in (0, 1):
        if align and 1 in size[2:]:
            continue  # torch puts a unit axis's point at 0 here, onnx.reference and the engine at -1
        got = _ours("AffineGrid", [theta, np.array(size, dtype=np.int64)], 20, align_corners=align)
        want = F.affine_grid(torch.tensor(theta), list(size), align_corners=bool(align)).numpy()
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"align_corners={align}")


_DEFORM = [  # group, offset_group, strides, pads, dilations, mask, bias
    (1, 1, [1, 1], [0, 0, 0, 0], [1, 1], False, False),
    (2, 2, [2, 1], [1, 0, 1, 2], [1, 2], True, True),
    (1, 3, [1, 1], [1, 1, 1, 1], [2, 1], True, False),
    (3, 1, [1, 2], [2, 1, 0, 1], [1, 1], False, True),
]


@pytest.mark.parametrize("group, og, strides, pads, dil, mask, bias", _DEFORM)
def test_deform_conv_matches_ort(group, og, strides, pads, dil, mask, bias) -> None:
    rng = np.random.default_rng(group * 10 + og)
    n, c, h, w, m, k = 2, 6, 6, 7, 6, (3, 2)
    out = [(h + pads[0] + pads[2] - (k[0] - 1) * dil[0] - 1) // strides[0] + 1,
           (w + pads[1] + pads[3] - (k[1] - 1) * dil[1] - 1) // strides[1] + 1]
    inputs = [rng.standard_normal((n, c, h, w)), rng.standard_normal((m, c // group, *k)),
              rng.uniform(-3, 3, (n, og * 6 * 2, *out)), rng.standard_normal(m) if bias else None]
    if mask:
        inputs.append(rng.uniform(0, 1, (n, og * 6, *out)))
    attrs = {"group": group, "offset_group": og, "strides": strides, "pads": pads, "dilations": dil}
    got, want = _ours("DeformConv", inputs, 19, **attrs), _ort("DeformConv", inputs, 19, **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_deform_conv_zero_offsets_is_conv() -> None:
    """With zero offsets and no mask DeformConv is Conv (torch's conv2d the oracle)."""
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal((2, 4, 6, 5)), rng.standard_normal((6, 2, 3, 3)), rng.standard_normal(6)
    off = np.zeros((2, 2 * 9 * 2, 3, 3))
    got = _ours("DeformConv", [x, w, off, b], 19, group=2, offset_group=2, strides=[2, 1], pads=[1, 0, 0, 0],
                dilations=[1, 1])
    want = F.conv2d(F.pad(torch.tensor(x), (0, 0, 1, 0)), torch.tensor(w), torch.tensor(b), stride=(2, 1),
                    groups=2).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_deform_conv_bad_offset_shape() -> None:
    x, w = np.zeros((1, 2, 4, 4), np.float32), np.zeros((2, 2, 2, 2), np.float32)
    with pytest.raises(Exception, match="offset") as info:
        _ours("DeformConv", [x, w, np.zeros((1, 4, 3, 3), np.float32)], 19)
    assert "DeformConv" in str(info.value)


@pytest.mark.parametrize("padding, align", [("zeros", 0), ("zeros", 1), ("border", 0), ("border", 1),
                                            ("reflection", 0)])
@pytest.mark.parametrize("xdt, gdt", [(np.float16, np.float16), (np.float16, np.float32),
                                      (np.float32, np.float64)], ids=["f16-f16", "f16-f32", "f32-f64"])
def test_grid_sample_2d_linear_fast_path_rounds_like_the_generic_sampler(padding, align, xdt, gdt) -> None:
    """2-D linear sampling (its own fast path) of an X narrower than the coordinates weighs each tap in the
    coordinates' precision and rounds once to X's dtype, as the N-D sampler does: the same values as a
    5-D GridSample of X with a unit depth axis sampled at its centre (weight exactly 1 there)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 3, 5, 6)).astype(xdt)
    grid = rng.uniform(-1.6, 1.6, (2, 4, 7, 2)).astype(gdt)
    attrs = {"mode": "linear", "padding_mode": padding, "align_corners": align}
    got = _ours("GridSample", [x, grid], 20, **attrs)
    depth = np.zeros((2, 1, 4, 7, 1), gdt)  # the centre of a one-slice depth axis with either align_corners
    want = _ours("GridSample", [x[:, :, None], np.concatenate([grid[:, None], depth], axis=-1)], 20, **attrs)
    assert got.dtype == xdt
    np.testing.assert_array_equal(got, want[:, :, 0])
    ref = F.grid_sample(torch.tensor(x.astype(np.float64)), torch.tensor(grid.astype(np.float64)),
                        padding_mode=padding, align_corners=bool(align)).numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=4 * np.finfo(xdt).eps * np.abs(x).max())


_X, _W, _OFF = np.zeros((1, 2, 4, 4)), np.zeros((2, 2, 2, 2)), np.zeros((1, 8, 3, 3))


@pytest.mark.parametrize("op, inputs, attrs, match", [
    ("DeformConv", [_X, _W, _OFF], {"group": 0}, "group=0"),
    ("DeformConv", [_X, _W, _OFF], {"offset_group": 0}, "offset_group=0"),
    ("DeformConv", [_X, _W, _OFF], {"strides": [0, 1]}, r"strides \[0, 1\]"),
    ("DeformConv", [_X, _W, _OFF], {"dilations": [1, 0]}, r"dilations \[1, 0\]"),
    ("DeformConv", [_X, _W, _OFF, np.zeros(3)], {}, r"bias B \(3,\) must be \(2,\)"),
    ("AffineGrid", [np.zeros((1, 2, 3)), np.array([1, 1, -3, 3])], {}, r"size \[1, 1, -3, 3\]"),
], ids=["group0", "offset_group0", "stride0", "dilation0", "bias_shape", "affine_negative_size"])
def test_bad_attributes_and_inputs_are_refused_by_name(op, inputs, attrs, match) -> None:
    """Attributes and inputs the spec (and onnxruntime) refuse: an error naming the op and the value, not a
    ZeroDivisionError or numpy's reshape error, nor group=0 read as 1."""
    opset = 19 if op == "DeformConv" else 20
    with pytest.raises(Exception, match=f"{op}: .*{match}"):
        _ours(op, inputs, opset, **attrs)


@pytest.mark.parametrize("padding", ["zeros", "border"])
def test_grid_sample_non_finite_coordinates(padding: str) -> None:
    """A NaN grid value has no tap to read (the framed fast path would index out of range): that point is
    NaN. An infinite one is NaN with zeros padding, as in torch, and clamped to the edge with border
    padding, as in torch. Every other point is what torch gives (float64)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 5, 6))
    grid = rng.uniform(-1, 1, (2, 4, 4, 2))
    bad = grid.copy()
    bad[0, 1, 2, 0], bad[1, 3, 0, 1] = np.nan, np.inf
    got = _ours("GridSample", [x, bad], 16, mode="bilinear", padding_mode=padding)

    def torch_gs(g: np.ndarray) -> np.ndarray:
        return torch.nn.functional.grid_sample(torch.from_numpy(x), torch.from_numpy(g), mode="bilinear",
                                               padding_mode=padding, align_corners=False).numpy()

    assert np.isnan(got[0, :, 1, 2]).all()
    inf_point = torch_gs(bad)[1, :, 3, 0]
    if padding == "zeros":
        assert np.isnan(got[1, :, 3, 0]).all() and np.isnan(inf_point).all()
    else:
        np.testing.assert_allclose(got[1, :, 3, 0], inf_point, rtol=1e-10)
    keep = np.ones(got.shape, bool)
    keep[0, :, 1, 2] = keep[1, :, 3, 0] = False
    np.testing.assert_allclose(got[keep], torch_gs(grid)[keep], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode, opset, rank", [("nearest", 16, 2), ("bicubic", 16, 2), ("linear", 20, 3),
                                               ("nearest", 20, 3)])
def test_grid_sample_zeros_padding_keeps_non_finite_pixels_to_their_taps(mode: str, opset: int,
                                                                         rank: int) -> None:
    """With zeros padding a tap outside the image adds nothing: it read the image's first pixel with weight
    0, so that an inf or NaN there made NaN of every point sampled outside (onnxruntime: 0 there)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3) + (5, 6, 4)[:rank]).astype(np.float32)  # (GridSample-16 in onnxruntime)
    x[0, 1].reshape(-1)[0], x[1, 2].reshape(-1)[0] = np.inf, np.nan
    grid = rng.uniform(-1.6, 1.6, (2, 4, 5, rank) if rank == 2 else (2, 3, 2, 4, rank)).astype(np.float32)
    got = _ours("GridSample", [x, grid], opset, mode=mode, padding_mode="zeros")
    want = _ort("GridSample", [x, grid], opset, mode=mode, padding_mode="zeros")
    assert np.isfinite(want).mean() > 0.9  # the case is what it says
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

"""Shape-manipulation kernels: reshape, transpose, concat/split, slice, pad, tile, constants, ranges."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import helper

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.engine.transpose_copy import contiguous


def _ints(v: Any) -> list[int]:
    """A 1-D int tensor (or list, or scalar) as a list of Python ints."""
    return [int(v)] if np.ndim(v) == 0 else [int(i) for i in np.asarray(v).ravel().tolist()]


def _axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return a


def _opt_input(inputs: Inputs, i: int) -> Any:
    return inputs[i] if len(inputs) > i else None


def _key(v: Any) -> Any:
    """A hashable cache key for an optional small int tensor input."""
    if type(v) is np.ndarray:  # (the usual case first: a node's memo key is built on every run)
        return v.tobytes()
    return None if v is None else v.tobytes() if isinstance(v, np.ndarray) else tuple(_ints(v))


def _memo(attrs: Attrs, key: Any, make: Callable[[], Any]) -> Any:
    """``make()`` cached per node under ``key`` (index tuples, target shapes; the node memo's bound)."""
    return attrs.cached(key, make)


def _reshape_target(xshape: tuple[int, ...], shape: Any, allowzero: bool) -> tuple[int, ...]:
    dims = _ints(shape)
    if not allowzero:
        for i, d in enumerate(dims):
            if d == 0:
                if i >= len(xshape):
                    raise ValueError(f"shape {dims}: dim {i} is 0 but the input has rank {len(xshape)}")
                dims[i] = xshape[i]
    if dims.count(-1) > 1:
        raise ValueError(f"shape {dims} has more than one -1")
    if any(d < -1 for d in dims):
        raise ValueError(f"shape {dims}: a dimension below -1")
    return tuple(dims)


@kernel("Reshape", since=5)
def reshape(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, shape = inputs[0], inputs[1]
    key = (x.shape, _key(shape))
    target = attrs.cache.get(key)
    if target is None:
        target = attrs.cache[key] = _reshape_target(x.shape, shape, bool(attrs.get("allowzero")))
    if not x.flags.c_contiguous:  # a view numpy would copy to reshape: a Transpose's by tiles if it can
        try:
            return (x.reshape(target, copy=False),)
        except ValueError:
            x = contiguous(x)
    return (x.reshape(target),)


@kernel("Transpose", since=1)
def transpose(inputs: Inputs, attrs: Attrs) -> Outputs:
    perm = attrs.get("perm")
    return (np.transpose(inputs[0], perm if perm else None),)


@kernel("Concat", since=4)
def concat(inputs: Inputs, attrs: Attrs) -> Outputs:
    xs = [x for x in inputs if x is not None]
    return (np.concatenate(xs, axis=_axis(attrs["axis"], xs[0].ndim)),)


def _split_sizes(dim: int, split: Any, n: int) -> list[int]:
    if split is not None:
        sizes = _ints(split)
        if len(sizes) != n or any(s < 0 for s in sizes):
            raise ValueError(f"split sizes {sizes}: one size per output ({n}), none negative")
        if sum(sizes) != dim:
            raise ValueError(f"split sizes {sizes} do not add up to the dimension {dim}")
        return sizes
    chunk = -(-dim // n)  # ceil: every part but the last gets ceil(dim/n)
    sizes = [min(chunk, max(dim - i * chunk, 0)) for i in range(n)]
    return sizes


@kernel("Split", since=2)
def split(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    sp = _opt_input(inputs, 1)
    # the parts' indices per input shape and split input (an attribute's split is the node's own)
    key = (x.shape, _key(sp))
    index = attrs.cache.get(key)
    if index is None:
        index = attrs.cache[key] = _split_parts(x.shape, sp, attrs)
    return tuple([x[i] for i in index])


def _split_parts(shape: tuple[int, ...], sp: Any, attrs: Attrs) -> list[tuple[slice, ...]]:
    """The index of each of Split's parts of an input of ``shape`` (``sp``: the split input, or None)."""
    axis = _axis(attrs["axis"], len(shape))
    if sp is None:
        sp = attrs.get("split")  # opsets < 13 carry it as an attribute
    n = attrs.get("num_outputs") or attrs.n_outputs
    if sp is None and attrs.get("num_outputs") is None and shape[axis] % n:
        raise ValueError(f"dimension {shape[axis]} does not split into {n} equal parts")
    return _split_index(shape[axis], axis, sp, n)


def _split_index(dim: int, axis: int, sp: Any, n: int) -> list[tuple[slice, ...]]:
    pre = (slice(None),) * axis
    index, start = [], 0
    for size in _split_sizes(dim, sp, n):
        index.append(pre + (slice(start, start + size),))
        start += size
    return index


def _slice_index(shape: tuple[int, ...], starts: list[int], ends: list[int], axes: list[int] | None,
                 steps: list[int] | None) -> tuple[slice, ...]:
    """The numpy index of an ONNX Slice (clamping as the spec says, which differs from Python)."""
    rank = len(shape)
    index = [slice(None)] * rank
    axes = list(range(len(starts))) if axes is None else [_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    for a, s, e, st in zip(axes, starts, ends, steps):
        d = shape[a]
        if st == 0:
            raise ValueError("Slice step cannot be 0")
        s = s + d if s < 0 else s
        e = e + d if e < 0 else e
        if st > 0:
            index[a] = slice(min(max(s, 0), d), min(max(e, 0), d), st)
        else:
            s = min(max(s, 0), d - 1)
            e = min(max(e, -1), d - 1)
            index[a] = slice(s, e if e >= 0 else None, st)
    return tuple(index)


@kernel("Slice", since=1)
def slice_(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if len(inputs) == 1:  # opset 1: attributes
        index = _memo(attrs, x.shape, lambda: _slice_index(x.shape, attrs["starts"], attrs["ends"],
                                                             attrs.get("axes"), None))
        return (x[index],)
    axes, steps = _opt_input(inputs, 3), _opt_input(inputs, 4)
    key = (x.shape, _key(inputs[1]), _key(inputs[2]), _key(axes), _key(steps))
    index = _memo(attrs, key, lambda: _slice_index(
        x.shape, _ints(inputs[1]), _ints(inputs[2]), None if axes is None else _ints(axes),
        None if steps is None else _ints(steps)))
    return (x[index],)


def _axes_of(inputs: Inputs, attrs: Attrs) -> list[int] | None:
    axes = _opt_input(inputs, 1)
    if axes is not None:
        return _ints(axes)
    return attrs.get("axes")  # opsets < 13


@kernel("Squeeze", since=1)
def squeeze(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if len(inputs) == 1:  # no axes input (the attribute's, before opset 13, are the node's): by shape alone
        shape = attrs.cache.get(x.shape)
        if shape is None:
            shape = attrs.cache[x.shape] = _squeezed(x.shape, attrs.get("axes"))
        return (x.reshape(shape),)
    a = inputs[1]
    key = (x.shape, _key(a))  # (the node memo, looked up directly)
    shape = attrs.cache.get(key)
    if shape is None:
        shape = attrs.cache[key] = _squeezed(x.shape, _axes_of(inputs, attrs))
    return (x.reshape(shape),)


def _squeezed(shape: tuple[int, ...], axes: list[int] | None) -> tuple[int, ...]:
    if not axes:
        return tuple(d for d in shape if d != 1)
    drop = {_axis(a, len(shape)) for a in axes}
    for a in drop:
        if shape[a] != 1:
            raise ValueError(f"cannot squeeze axis {a} of size {shape[a]} (shape {shape})")
    return tuple(d for a, d in enumerate(shape) if a not in drop)


@kernel("Unsqueeze", since=1)
def unsqueeze(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    a = inputs[1] if len(inputs) > 1 else None
    key = (x.shape, _key(a))  # (the node memo, looked up directly)
    shape = attrs.cache.get(key)
    if shape is None:
        shape = attrs.cache[key] = _unsqueezed(x.shape, _axes_of(inputs, attrs) or [])
    return (x.reshape(shape),)


def _unsqueezed(shape: tuple[int, ...], axes: list[int]) -> tuple[int, ...]:
    rank = len(shape) + len(axes)
    norm = sorted(_axis(a, rank) for a in axes)
    if len(set(norm)) != len(norm):
        raise ValueError(f"Unsqueeze axes {axes} repeat an axis")
    out = list(shape)
    for a in norm:
        out.insert(a, 1)
    return tuple(out)


@kernel("Flatten", since=1)
def flatten(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    shape = attrs.cache.get(x.shape)  # (the node's 2-D shape per input shape)
    if shape is None:
        shape = attrs.cache[x.shape] = _flattened(x.shape, attrs["axis"])
    return (x.reshape(shape),)


def _flattened(shape: tuple[int, ...], axis: int) -> tuple[int, int]:
    """The 2-D shape Flatten gives an input of ``shape`` at ``axis``."""
    a = axis + len(shape) if axis < 0 else axis
    if not 0 <= a <= len(shape):
        raise ValueError(f"Flatten axis {axis} is out of range for rank {len(shape)}")
    return math.prod(shape[:a]), math.prod(shape[a:])


@kernel("Expand", since=8)
def expand(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    shape = _memo(attrs, (x.shape, _key(inputs[1])),
                  lambda: np.broadcast_shapes(x.shape, tuple(_ints(inputs[1]))))
    return (np.broadcast_to(x, shape),)  # a read-only view


@kernel("Shape", since=1)
def shape_(inputs: Inputs, attrs: Attrs) -> Outputs:
    start = attrs.get("start") or 0
    end = attrs.get("end")
    return (np.array(inputs[0].shape[start:end], dtype=np.int64),)


@kernel("Size", since=1)
def size(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (np.array(np.size(inputs[0]), dtype=np.int64),)


@kernel("Constant", since=1)
def constant(inputs: Inputs, attrs: Attrs) -> Outputs:
    if attrs.get("value") is not None:
        return (np.asarray(attrs["value"]),)
    if attrs.get("sparse_value") is not None:
        raise NotImplementedError("Constant with sparse_value is not supported")
    for name, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                        ("value_int", np.int64), ("value_ints", np.int64),
                        ("value_string", object), ("value_strings", object)):
        v = attrs.get(name)
        if v is not None:
            return (np.array(v, dtype=dtype),)
    raise ValueError("Constant has none of its value attributes")


@kernel("ConstantOfShape", since=9)
def constant_of_shape(inputs: Inputs, attrs: Attrs) -> Outputs:
    value = attrs.get("value")
    if value is None:
        value = np.zeros(1, dtype=np.float32)
    value = np.asarray(value)
    return (np.full(_ints(inputs[0]) if inputs[0].size else (), value.reshape(-1)[0], dtype=value.dtype),)


@kernel("Range", since=11)
def range_(inputs: Inputs, attrs: Attrs) -> Outputs:
    start, limit, delta = (np.asarray(v).reshape(()) for v in inputs[:3])
    dtype = start.dtype
    if delta == 0:
        raise ValueError("Range: delta must not be 0 (onnxruntime refuses it too)")
    if dtype.kind == "f" and not np.isfinite([start, limit, delta]).all():
        raise ValueError(f"Range: start, limit and delta must be finite; got {start}, {limit}, {delta}")
    if np.issubdtype(dtype, np.integer):
        s, lim, d = int(start), int(limit), int(delta)
        n = max(-(-(lim - s) // d), 0)
        return (np.arange(n, dtype=dtype) * dtype.type(d) + dtype.type(s),)
    n = max(int(np.ceil((float(limit) - float(start)) / float(delta))), 0)
    return (np.arange(n, dtype=np.float64).astype(dtype) * delta + start,)


@kernel("Tile", since=6)
def tile(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, repeats = inputs[0], _ints(inputs[1])
    if len(repeats) != x.ndim or any(r < 0 for r in repeats):
        raise ValueError(f"repeats {repeats}: one per input dimension ({x.ndim}), none negative")
    return (np.tile(x, repeats),)


def _pad(x: np.ndarray, pads: list[int], mode: str, value: Any, axes: list[int] | None) -> np.ndarray:
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [_axis(a, rank) for a in axes]
    if len(pads) != 2 * len(axes):
        raise ValueError(f"Pad: {len(pads)} pads for {len(axes)} axes")
    width = [[0, 0] for _ in range(rank)]
    for i, a in enumerate(axes):
        width[a] = [pads[i], pads[len(axes) + i]]
    if mode == "constant":
        return _pad_constant(x, width, value)
    if mode not in ("reflect", "edge", "wrap"):
        raise ValueError(f"Pad mode {mode!r} is not one of constant, reflect, edge, wrap")
    if any(b < 0 or e < 0 for b, e in width):  # negative pads crop
        x = x[tuple(slice(-b if b < 0 else 0, x.shape[a] + e if e < 0 else None)
                    for a, (b, e) in enumerate(width))]
        width = [[max(b, 0), max(e, 0)] for b, e in width]
    return np.pad(x, width, mode=mode)


def _pad_constant(x: np.ndarray, width: list[list[int]], value: Any) -> np.ndarray:
    """Constant padding, a negative pad cropping: output index i of an axis holds input index i - begin (the
    value outside the input), so an axis has d + begin + end values, also when a crop on one side takes more
    than the input holds and eats into the other side's padding."""
    sizes = [d + b + e for d, (b, e) in zip(x.shape, width)]
    bad = [a for a, n in enumerate(sizes) if n < 0]
    if bad:
        a = bad[0]
        raise ValueError(f"Pad: axis {a} of size {x.shape[a]} with pads {width[a]} would have "
                         f"{sizes[a]} values")
    out = np.full(tuple(sizes), value, dtype=x.dtype)
    src, dst = [], []
    for d, (b, _), n in zip(x.shape, width, sizes):
        lo, hi = max(0, -b), min(d, n - b)  # the input's part that lands in the output
        if hi <= lo:
            return out
        src.append(slice(lo, hi))
        dst.append(slice(lo + b, hi + b))
    out[tuple(dst)] = x[tuple(src)]
    return out


def _pad_default(x: np.ndarray) -> Any:
    """Pad's constant when none is given: 0, an empty string for strings, False for bools (the spec's)."""
    if x.dtype.kind in "OSU":
        return ""
    return False if x.dtype == np.bool_ else 0


def _attribute_value(x: np.ndarray, value: Any) -> Any:
    """What opset 2's Pad pads ``x`` with: its float ``value`` (the schema's 0.0 when left out)."""
    if value is None or (value == 0 and x.dtype.kind in "OSUb"):
        return _pad_default(x)
    if x.dtype.kind in "OSU":
        raise ValueError(f"Pad: the float value attribute ({value}) cannot pad a string tensor")
    return value


@kernel("Pad", since=2)
def pad(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    mode = attrs.get("mode") or "constant"
    if len(inputs) == 1:  # opset 2: attributes
        return (_pad(x, list(attrs["pads"]), mode, _attribute_value(x, attrs.get("value")), None),)
    value = _opt_input(inputs, 2)
    value = _pad_default(x) if value is None else np.asarray(value).reshape(-1)[0]
    axes = _opt_input(inputs, 3)
    return (_pad(x, _ints(inputs[1]), mode, value, None if axes is None else _ints(axes)),)


@kernel("DepthToSpace", since=1)
def depth_to_space(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    bs = attrs["blocksize"]
    n, c, h, w = x.shape
    if c % (bs * bs):
        raise ValueError(f"DepthToSpace: {c} channels are not divisible by blocksize² = {bs * bs}")
    c2 = c // (bs * bs)
    if attrs.get("mode", "DCR") == "CRD":
        y = x.reshape(n, c2, bs, bs, h, w).transpose(0, 1, 4, 2, 5, 3)
    else:
        y = x.reshape(n, bs, bs, c2, h, w).transpose(0, 3, 4, 1, 5, 2)
    return (y.reshape(n, c2, h * bs, w * bs),)


@kernel("SpaceToDepth", since=1)
def space_to_depth(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    bs = attrs["blocksize"]
    n, c, h, w = x.shape
    if h % bs or w % bs:
        raise ValueError(f"SpaceToDepth: spatial size {h}x{w} is not divisible by blocksize {bs}")
    y = x.reshape(n, c, h // bs, bs, w // bs, bs)
    # the "mode" attribute only exists in opsets newer than 21; DCR is the older behaviour
    y = y.transpose(0, 1, 3, 5, 2, 4) if attrs.get("mode") == "CRD" else y.transpose(0, 3, 5, 1, 2, 4)
    return (y.reshape(n, c * bs * bs, h // bs, w // bs),)


@kernel("ReverseSequence", since=10)
def reverse_sequence(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, lens = inputs[0], np.asarray(inputs[1], dtype=np.int64)
    b_ax, t_ax = attrs["batch_axis"], attrs["time_axis"]
    n, steps = x.shape[b_ax], x.shape[t_ax]
    if lens.shape != (n,):
        raise ValueError(f"ReverseSequence: sequence_lens has shape {list(lens.shape)}, expected [{n}] (the "
                         f"batch axis {b_ax} of the input of shape {list(x.shape)})")
    if lens.size and (lens.min() < 0 or lens.max() > steps):
        raise ValueError(f"ReverseSequence: sequence_lens {lens.tolist()} must lie in [0, {steps}] (the time "
                         f"axis {t_ax})")
    t = np.arange(steps, dtype=np.int64)
    # src[b, t] = lens[b] - 1 - t for t < lens[b], else t
    src = np.where(t[None, :] < lens[:, None], lens[:, None] - 1 - t[None, :], t[None, :])
    if b_ax > t_ax:
        src = src.T
    shape = [1] * x.ndim
    shape[b_ax], shape[t_ax] = x.shape[b_ax], x.shape[t_ax]
    return (np.take_along_axis(x, src.reshape(shape), axis=t_ax),)


@kernel("EyeLike", since=9)
def eye_like(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    dt = attrs.get("dtype")
    dtype = x.dtype if dt is None else helper.tensor_dtype_to_np_dtype(dt)
    if x.ndim != 2:
        raise ValueError(f"EyeLike needs a 2-D input, got shape {x.shape}")
    return (np.eye(x.shape[0], x.shape[1], k=attrs.get("k") or 0, dtype=dtype),)


@kernel("Trilu", since=14)
@kernel("Trilu", domain="com.microsoft")
def trilu(inputs: Inputs, attrs: Attrs) -> Outputs:
    """The upper (``upper`` 1, the default) or lower triangle of the last two axes from diagonal k; also
    onnxruntime's contrib op ``com.microsoft.Trilu``, the same op before ONNX's Trilu-14."""
    x = inputs[0]
    upper = attrs.get("upper", 1)
    if np.ndim(x) < 2:  # the spec's rank >= 2 (onnxruntime refuses rank 1 too)
        raise ValueError(f"Trilu: the input must have rank 2 or more, got rank {np.ndim(x)}")
    k = _opt_input(inputs, 1)
    k = 0 if k is None else int(np.asarray(k).reshape(-1)[0])
    # beyond the matrix's rows plus columns every k keeps all or nothing (numpy's own arithmetic on a k near
    # int64's ends overflows)
    reach = x.shape[-2] + x.shape[-1]
    k = max(-reach, min(reach, k))
    if x.dtype.kind in "OSU":  # a string's zero is "" (numpy's zero of an object array is the integer 0)
        keep = (np.triu if upper else np.tril)(np.ones(x.shape[-2:], bool), k)
        return (np.where(keep, x, "").astype(object, copy=False),)
    return ((np.triu if upper else np.tril)(x, k),)


def _center_crop_pad_plan(shape: tuple[int, ...], target: list[int], axes: list[int] | None
                          ) -> tuple[tuple[int, ...], tuple[slice, ...], tuple[slice, ...]]:
    """(output shape, slices of the input kept, slices of the output they fill)."""
    rank = len(shape)
    axes = list(range(rank)) if axes is None else [_axis(a, rank) for a in axes]
    if len(target) != len(axes) or len(set(axes)) != len(axes):
        raise ValueError(f"CenterCropPad: shape {target} must give one size per axis of {axes} "
                         "(distinct axes)")
    out = list(shape)
    src = [slice(None)] * rank
    dst = [slice(None)] * rank
    for a, t in zip(axes, target):
        d = shape[a]
        if t < 0:
            raise ValueError(f"CenterCropPad: negative size {t} in shape {target}")
        out[a] = t
        if t < d:  # crop: keep the centre, one more element off the end when the difference is odd
            b = (d - t) // 2
            src[a] = slice(b, b + t)
        elif t > d:  # pad: the input goes in the centre, one more zero at the end when odd
            b = (t - d) // 2
            dst[a] = slice(b, b + d)
    return tuple(out), tuple(src), tuple(dst)


@kernel("CenterCropPad", since=18)
def center_crop_pad(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    axes = attrs.get("axes")
    out, src, dst = _memo(attrs, (x.shape, _key(inputs[1])),
                          lambda: _center_crop_pad_plan(x.shape, _ints(inputs[1]),
                                                        None if axes is None else list(axes)))
    # padded with Pad's zero: "" for strings (numpy's zero of an object array is the integer 0)
    y = np.full(out, "", dtype=x.dtype) if x.dtype.kind in "OSU" else np.zeros(out, dtype=x.dtype)
    y[dst] = x[src]
    return (y,)

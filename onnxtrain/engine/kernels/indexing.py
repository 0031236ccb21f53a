"""Indexing kernels: gathers, scatters (with reductions), a KV-cache write (TensorScatter), one-hot, top-k,
arg-max/min, cumulative sums and products."""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine.kernels.half import F32, is_half
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _axis(axis: int, rank: int) -> int:
    a = axis + rank if axis < 0 else axis
    if not 0 <= a < max(rank, 1):
        raise ValueError(f"axis {axis} is out of range for rank {rank}")
    return a


def _normalize(idx: np.ndarray, dim: Any, what: str) -> np.ndarray:
    """Indices with negatives wrapped, checked against ``dim`` (an int or an array broadcasting to idx)."""
    if idx.size == 0:
        return idx.astype(np.int64, copy=False)
    lo, hi = idx.min(), idx.max()
    if np.isscalar(dim) or np.ndim(dim) == 0:
        if lo < -dim or hi >= dim:
            raise IndexError(f"{what}: index out of range [{-dim}, {dim - 1}] (got {lo}..{hi})")
        return idx + dim * (idx < 0) if lo < 0 else idx
    if (idx < -dim).any() or (idx >= dim).any():
        raise IndexError(f"{what}: index out of range for dims {np.asarray(dim).tolist()}")
    return idx + dim * (idx < 0) if lo < 0 else idx


_REDUCE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_rows(out: np.ndarray, rows: np.ndarray, upd: np.ndarray, reduction: str) -> None:
    """``out[rows[i]] <op>= upd[i]`` in place with duplicates combined; out is C-contiguous 2-D
    (rows of equal length) and upd matches ``(len(rows), out.shape[1])``."""
    if reduction == "none":
        out[rows] = upd
        return
    ufunc = _REDUCE.get(reduction)
    if ufunc is None:
        raise ValueError(f"reduction {reduction!r} is not one of none, add, mul, max, min")
    inner = out.shape[1]
    # more updates than rows means duplicates: no sort to find out (an embedding's gradient)
    if inner >= 16 and rows.size <= out.shape[0] and (rows.size == 1 or np.unique(rows).size == rows.size):
        # no duplicates (a scalar-index Gather's gradient): whole rows at once, far faster than ufunc.at
        out[rows] = ufunc(out[rows], upd)
        return
    if inner >= 64 and _scatter_grouped(out, rows, upd, ufunc):
        return
    # numpy's 1-D ufunc.at has a fast path: element offsets beat both row-wise ufunc.at and
    # sort + reduceat (3-10x measured for 32-4096 rows of 2-768 elements)
    lin = rows if inner == 1 else (rows[:, None] * inner + np.arange(inner, dtype=np.int64)).reshape(-1)
    ufunc.at(out.reshape(-1), lin, upd.reshape(-1))


_GROUP_STEP = 16384  # fewest elements per Python step of _scatter_grouped


def _scatter_grouped(out: np.ndarray, rows: np.ndarray, upd: np.ndarray, ufunc: np.ufunc) -> bool:
    """``ufunc.at(out, rows, upd)`` on whole rows, each row's updates applied one by one in their order (the
    same bits as ufunc.at and onnxruntime): in rounds of distinct rows (the i-th update of every row in
    round i) or, when fewer, row by row with one reduce each; False (nothing done) when the steps would
    be too small to beat ufunc.at."""
    # (16-bit keys take numpy's radix sort: 5-10x faster than sorting int64)
    order = np.argsort(rows.astype(np.uint16) if out.shape[0] <= 1 << 16 else rows, kind="stable")
    sorted_rows = rows[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_rows[1:] != sorted_rows[:-1])))
    sizes = np.diff(np.append(starts, rows.size))
    rounds = int(sizes.max())
    if min(rounds, starts.size) * _GROUP_STEP > upd.size:
        return False
    if rounds <= starts.size:
        _scatter_rounds(out, rows, upd, ufunc, order, starts, sizes)
    else:
        _scatter_each_row(out, sorted_rows[starts], upd, ufunc, order, starts, sizes)
    return True


def _scatter_rounds(out: np.ndarray, rows: np.ndarray, upd: np.ndarray, ufunc: np.ufunc, order: np.ndarray,
                    starts: np.ndarray, sizes: np.ndarray) -> None:
    """Round i: ``out[r] = ufunc(out[r], upd[j])`` for the i-th update j of every row r with more than i
    (``order`` sorts the updates stably by row; ``starts``, ``sizes``: its runs of one row)."""
    rank = np.arange(rows.size) - np.repeat(starts, sizes)  # place of each sorted update within its row
    by_round = order[np.argsort(rank, kind="stable")]
    ends = np.cumsum(np.bincount(rank))
    for a, b in zip([0, *ends[:-1].tolist()], ends.tolist()):
        sel = by_round[a:b]
        r = rows[sel]
        out[r] = ufunc(out[r], upd[sel])


def _scatter_each_row(out: np.ndarray, unique: np.ndarray, upd: np.ndarray, ufunc: np.ufunc,
                      order: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> None:
    """Row by row: ``out[r]`` then its updates in order, reduced along the first axis (numpy reduces a
    non-last axis one slice after another, so in that order)."""
    buf = np.empty((int(sizes.max()) + 1, out.shape[1]), out.dtype)
    for r, a, m in zip(unique.tolist(), starts.tolist(), sizes.tolist()):
        buf[0] = out[r]
        np.take(upd, order[a:a + m], axis=0, out=buf[1:m + 1])
        ufunc.reduce(buf[:m + 1], axis=0, out=out[r])


@kernel("Gather", since=1)
def gather(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, idx = inputs[0], inputs[1]
    axis = _axis(attrs["axis"], x.ndim)
    if idx.ndim == 0 and isinstance(x, np.ndarray):  # one index (e.g. q, k, v of a fused projection): a view
        i = int(idx)
        if not -x.shape[axis] <= i < x.shape[axis]:
            raise IndexError(f"Gather: index {i} is out of range for axis {axis} of size {x.shape[axis]}")
        return (x[(slice(None),) * axis + (i,)],)
    return (np.take(x, idx, axis=axis),)


@kernel("GatherElements", since=11)
def gather_elements(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, idx = inputs[0], inputs[1]
    axis = _axis(attrs["axis"], x.ndim)
    if idx.ndim != x.ndim:
        raise ValueError(f"GatherElements: indices rank {idx.ndim} != data rank {x.ndim}")
    idx = _normalize(idx, x.shape[axis], "GatherElements")
    if any(i != d for a, (i, d) in enumerate(zip(idx.shape, x.shape)) if a != axis):
        x = x[tuple(slice(None) if a == axis else slice(0, i) for a, i in enumerate(idx.shape))]
    return (np.take_along_axis(x, idx, axis=axis),)


def _element_offsets(attrs: Attrs, dshape: tuple[int, ...], ishape: tuple[int, ...], axis: int
                     ) -> tuple[np.ndarray, int]:
    """Flat offsets into a C-ordered tensor of ``dshape`` for every position of ``ishape`` with the
    ``axis`` coordinate set to 0, and the element stride of ``axis``; cached per shape pair."""
    key = ("offsets", dshape, ishape, axis)
    hit = attrs.cache.get(key)
    if hit is None:
        strides = np.cumprod((dshape[1:] + (1,))[::-1])[::-1].astype(np.int64)
        base = np.zeros(ishape, dtype=np.int64)
        for a, n in enumerate(ishape):
            if a != axis and n > 1:
                shp = [1] * len(ishape)
                shp[a] = n
                base = base + (np.arange(n, dtype=np.int64) * strides[a]).reshape(shp)
        hit = (base, int(strides[axis]) if len(dshape) else 1)
        attrs.cache.clear()  # keep one shape pair
        attrs.cache[key] = hit
    return hit


@kernel("ScatterElements", since=11)
def scatter_elements(inputs: Inputs, attrs: Attrs) -> Outputs:
    return scatter_elements_into(inputs, attrs, False)


def scatter_elements_into(inputs: Inputs, attrs: Attrs, inplace: bool) -> Outputs:
    """ScatterElements; ``inplace``: the data array is the caller's to overwrite, and the result is it."""
    x, idx, upd = inputs[0], inputs[1], inputs[2]
    axis = _axis(attrs["axis"], x.ndim)
    if idx.shape != upd.shape:
        raise ValueError(f"ScatterElements: indices shape {idx.shape} != updates shape {upd.shape}")
    if idx.ndim != x.ndim:  # (empty indices of another rank were taken as no update)
        raise ValueError(f"ScatterElements: indices rank {idx.ndim} != data rank {x.ndim}")
    reduction = attrs.get("reduction") or "none"
    if x.ndim == 2 and axis == 1 and idx.shape == (x.shape[0], 1) and x.size and upd.dtype == x.dtype:
        out = _one_per_row(x, idx.reshape(-1), upd.reshape(-1), reduction, inplace)
        if out is not None:
            return (out,)
    idx = _normalize(idx, x.shape[axis], "ScatterElements")
    base, stride = _element_offsets(attrs, x.shape, idx.shape, axis)
    out = x if inplace else np.array(x, copy=True, order="C")
    lin = (base + idx * stride).reshape(-1)
    _scatter_rows(out.reshape(-1, 1), lin, upd.reshape(-1, 1), reduction)
    return (out,)


_UNSIGNED = {np.dtype(t): np.dtype(t.replace("int", "uint")) for t in ("int8", "int16", "int32", "int64")}


def row_starts(rows: int, width: int) -> np.ndarray:
    """The flat offsets ``0, width, 2·width, …`` of the rows of a C-contiguous (rows, width) array
    (read-only, cached for the last 64 shapes)."""
    starts = _ROW_STARTS.get((rows, width))
    if starts is None:
        if len(_ROW_STARTS) >= 64:
            _ROW_STARTS.clear()
        starts = _ROW_STARTS[(rows, width)] = np.arange(0, rows * width, width)
        starts.flags.writeable = False
    return starts


_ROW_STARTS: dict[tuple[int, int], np.ndarray] = {}


def in_range(idx: np.ndarray, n: int) -> bool:
    """True when every integer in ``idx`` (non-empty) lies in [0, n): one maximum over the indices read as
    unsigned, where negatives become huge."""
    unsigned = idx.dtype if idx.dtype.kind == "u" else _UNSIGNED.get(idx.dtype)
    return unsigned is not None and int(np.maximum.reduce(idx.view(unsigned), axis=None)) < n


def _one_per_row(x: np.ndarray, col: np.ndarray, upd: np.ndarray, reduction: str,
                 inplace: bool = False) -> np.ndarray | None:
    """ScatterElements along the last axis of a 2-D ``x`` with one index per row (the −1 at each label of
    a cross-entropy gradient): the positions are distinct, so one fancy-indexed update gives what
    ``ufunc.at`` does, in four numpy calls; None (the general path) for indices that need wrapping or are
    out of range, and for an unknown reduction. ``inplace``: into ``x`` itself."""
    ufunc = _REDUCE.get(reduction)
    if (ufunc is None and reduction != "none") or not in_range(col, x.shape[1]):
        return None
    out = x if inplace else np.array(x, copy=True, order="C")
    flat = out.reshape(-1)
    pos = row_starts(*x.shape) + col
    flat[pos] = upd if ufunc is None else ufunc(flat[pos], upd)
    return out


@kernel("Scatter", since=9)
def scatter(inputs: Inputs, attrs: Attrs) -> Outputs:
    """The deprecated Scatter is ScatterElements without reduction."""
    return scatter_elements(inputs, attrs)


def _nd_rows(dshape: tuple[int, ...], idx: np.ndarray, what: str) -> np.ndarray:
    """Row numbers of the index tuples ``idx[..., :k]`` in ``dshape[:k]`` (negatives wrapped)."""
    k = idx.shape[-1]
    if k > len(dshape):
        raise ValueError(f"{what}: index tuples of length {k} for data of rank {len(dshape)}")
    dims = np.asarray(dshape[:k], dtype=np.int64)
    idx = _normalize(idx, dims, what)
    strides = np.cumprod(np.concatenate([dims[1:], [1]])[::-1])[::-1].astype(np.int64)
    if not k:  # empty tuples: each one picks the whole data, row 0 (idx.size is 0, not their number)
        return np.zeros(int(np.prod(idx.shape[:-1], dtype=np.int64)), dtype=np.int64)
    return idx.reshape(-1, k) @ strides


@kernel("ScatterND", since=11)
def scatter_nd(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, idx, upd = inputs[0], inputs[1], inputs[2]
    k = idx.shape[-1]
    rows = _nd_rows(x.shape, idx, "ScatterND")
    want = idx.shape[:-1] + x.shape[k:]
    if upd.shape != want:
        raise ValueError(f"ScatterND: updates shape {upd.shape}, expected {want}")
    out = np.array(x, copy=True, order="C")
    if out.size == 0 or rows.size == 0:
        return (out,)
    inner = int(np.prod(x.shape[k:], dtype=np.int64))
    _scatter_rows(out.reshape(-1, inner), rows, upd.reshape(-1, inner), attrs.get("reduction") or "none")
    return (out,)


@kernel("GatherND", since=11)
def gather_nd(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, idx = inputs[0], inputs[1]
    b = attrs.get("batch_dims") or 0
    k = idx.shape[-1]
    if x.shape[:b] != idx.shape[:b]:
        raise ValueError(f"GatherND: batch dims of data {x.shape[:b]} and indices {idx.shape[:b]} differ")
    nb = int(np.prod(x.shape[:b], dtype=np.int64))
    inner_shape = x.shape[b + k:]
    per_batch = int(np.prod(idx.shape[b:-1], dtype=np.int64))  # (sizes spelled out: a 0 dim leaves no -1)
    rows = _nd_rows(x.shape[b:], idx.reshape((nb, per_batch, k)), "GatherND").reshape(nb, per_batch)
    xr = x.reshape((nb, int(np.prod(x.shape[b:b + k], dtype=np.int64))) + inner_shape)
    out = xr[np.arange(nb)[:, None], rows]
    return (out.reshape(idx.shape[:-1] + inner_shape),)


@kernel("TensorScatter", since=24)
def tensor_scatter(inputs: Inputs, attrs: Attrs) -> Outputs:
    """A copy of ``past_cache`` with ``update`` written along ``axis`` from each batch row's write index
    (0 without ``write_indices``); mode "circular" wraps around the cache, "linear" must fit in it."""
    past, upd = inputs[0], inputs[1]
    w = inputs[2] if len(inputs) > 2 else None
    axis = _axis(attrs["axis"], past.ndim)
    mode = attrs["mode"]
    if axis == 0:
        raise ValueError("TensorScatter: axis must not be 0 (the batch axis)")
    if mode not in ("linear", "circular"):
        raise ValueError(f"TensorScatter: mode {mode!r} is not one of linear, circular")
    n = past.shape[axis]
    if (upd.ndim != past.ndim or upd.shape[:axis] != past.shape[:axis]
            or upd.shape[axis + 1:] != past.shape[axis + 1:] or upd.shape[axis] > n):
        raise ValueError(f"TensorScatter: update shape {upd.shape} does not fit the cache shape {past.shape} "
                         f"(equal but along axis {axis}, where it may be shorter)")
    batch, s = past.shape[0], upd.shape[axis]
    start = np.zeros(batch, np.int64) if w is None else np.asarray(w, dtype=np.int64).reshape(-1)
    if start.size != batch:
        raise ValueError(f"TensorScatter: write_indices of shape {np.shape(w)}, expected ({batch},)")
    pos = start[:, None] + np.arange(s, dtype=np.int64)
    if mode == "circular":
        pos %= max(n, 1)
    elif pos.size and (start.min() < 0 or start.max() + s > n):
        raise IndexError(f"TensorScatter: {s} linear writes from write_indices {start.tolist()} overrun a "
                         f"cache of length {n}")
    out = np.array(past, copy=True, order="C")
    mid, inner = int(np.prod(past.shape[1:axis])), int(np.prod(past.shape[axis + 1:]))
    # (batch, n, middle axes, trailing axes) views: each (row, position) pair takes one block
    view = out.reshape(batch, mid, n, inner).transpose(0, 2, 1, 3)
    view[np.arange(batch)[:, None], pos] = upd.reshape(batch, mid, s, inner).transpose(0, 2, 1, 3)
    return (out,)


@kernel("OneHot", since=9)
def one_hot(inputs: Inputs, attrs: Attrs) -> Outputs:
    idx, depth, values = inputs[0], inputs[1], inputs[2]
    depth = int(np.asarray(depth).reshape(-1)[0])
    if depth < 1:  # (onnxruntime refuses it too)
        raise ValueError(f"OneHot: depth must be at least 1, got {depth}")
    rank = idx.ndim + 1
    axis = _axis(attrs["axis"], rank)
    idx = np.asarray(idx)
    if not np.issubdtype(idx.dtype, np.integer):
        idx = idx.astype(np.int64)  # float indices are truncated
    idx = np.where(idx < 0, idx + depth, idx)  # still out of range afterwards: a row of off values
    shape = [1] * rank
    shape[axis] = depth
    hot = np.expand_dims(idx, axis) == np.arange(depth).reshape(shape)
    values = np.asarray(values).reshape(-1)
    return (np.where(hot, values[1], values[0]).astype(values.dtype, copy=False),)


@kernel("NonZero", since=9)
def non_zero(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if x.ndim == 0:
        return (np.zeros((0, int(bool(x))), dtype=np.int64),)
    return (np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1),)


def _cumulative(inputs: Inputs, attrs: Attrs, scan: Any, start: int) -> Outputs:
    """CumSum / CumProd: ``scan`` (np.cumsum, np.cumprod) along the axis input, honouring ``reverse`` and
    ``exclusive`` (an exclusive scan begins with ``start``, the operation's identity)."""
    x = inputs[0]
    axis = _axis(int(np.asarray(inputs[1]).reshape(-1)[0]), x.ndim)
    rev, excl = bool(attrs.get("reverse")), bool(attrs.get("exclusive"))
    # float16/bfloat16 scan in float32 and round once: a float16 running sum of ones stops at 2048
    half = is_half(x.dtype)
    dtype = F32 if half else x.dtype
    if _slice_scan_pays(x.shape, axis):
        cs = _scan_slices(x, axis, _SCAN_UFUNC[scan], start, rev, excl, dtype)
        return (cs.astype(x.dtype) if half else cs,)
    y = np.flip(x, axis) if rev else x
    cs = scan(y, axis=axis, dtype=dtype)
    if half:
        cs = cs.astype(x.dtype)
    if excl:
        shifted = np.full_like(cs, start)
        n = x.shape[axis]
        dst = [slice(None)] * x.ndim
        src = [slice(None)] * x.ndim
        dst[axis], src[axis] = slice(1, n), slice(0, n - 1)
        shifted[tuple(dst)] = cs[tuple(src)]
        _SCAN_UFUNC[scan](start, shifted, out=shifted)  # start ∘ x: as onnxruntime, 0 + -0.0 is 0.0
        cs = shifted
    return (np.flip(cs, axis) if rev else cs,)


_SCAN_UFUNC = {np.cumsum: np.add, np.cumprod: np.multiply}


def _slice_scan_pays(shape: tuple[int, ...], axis: int) -> bool:
    """Whether a Python loop of whole-slice ops along ``axis`` beats numpy's scan, which walks a non-last
    axis element by element: for slices of 1024+ elements in contiguous runs of 64+ (shorter runs at a
    power-of-two stride thrash the cache; measured 1.1-7x faster with these, up to 2.5x slower without)."""
    inner = int(np.prod(shape[axis + 1:], dtype=np.int64))
    n = shape[axis] if shape else 0
    return axis < len(shape) - 1 and n > 1 and inner >= 64 and int(np.prod(shape, dtype=np.int64)) >= 1024 * n


def _scan_slices(x: np.ndarray, axis: int, ufunc: np.ufunc, start: int, rev: bool, excl: bool,
                 dtype: np.dtype) -> np.ndarray:
    """The scan of ``x`` along ``axis`` as one ``ufunc`` of whole slices per step, into a new C-ordered
    array of ``dtype``: the same operations in the same order as np.cumsum / np.cumprod, so the same bits."""
    y = np.empty(x.shape, dtype)
    xs, ys = np.moveaxis(x, axis, 0), np.moveaxis(y, axis, 0)
    n = xs.shape[0]
    steps = list(range(n - 1, -1, -1) if rev else range(n))  # positions in scan order
    first = steps[0]
    if excl:
        ys[first] = start
        if n > 1:
            ufunc(start, xs[first], out=ys[steps[1]])  # as onnxruntime: 0 + -0.0 is 0.0
        for prev, i in zip(steps[1:], steps[2:]):
            ufunc(ys[prev], xs[prev], out=ys[i])
    else:
        ys[first] = xs[first]
        for prev, i in zip(steps, steps[1:]):
            ufunc(ys[prev], xs[i], out=ys[i])
    return y


@kernel("CumSum", since=11)
def cum_sum(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _cumulative(inputs, attrs, np.cumsum, 0)


@kernel("CumProd", since=26)
def cum_prod(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _cumulative(inputs, attrs, np.cumprod, 1)


def _order(x: np.ndarray, largest: bool) -> np.ndarray:
    """Indices sorting ``x`` along its last axis: descending (``largest``) or ascending by value, ties by
    ascending index, NaN above every number (onnxruntime's TopK order)."""
    if not largest:
        return np.argsort(x, axis=-1, kind="stable")
    # a stable ascending sort of the reversed axis, read backwards
    return (x.shape[-1] - 1) - np.flip(np.argsort(np.flip(x, -1), axis=-1, kind="stable"), -1)


def _top_k_candidates(x: np.ndarray, k: int, largest: bool) -> np.ndarray | None:
    """Ascending indices of the k elements of each row of 2-D ``x`` that TopK keeps (of the ties at the k-th
    value, the lowest indices), found by one partition; None when a NaN reaches the top k (the full sort
    handles it)."""
    n = x.shape[1]
    at = n - k if largest else k - 1
    part = np.partition(x, at, axis=1)
    if x.dtype.kind in "fc" and np.isnan(part[:, n - k:] if largest else part[:, :k]).any():
        return None
    kth = part[:, at:at + 1]
    keep = x >= kth if largest else x <= kth
    extra = np.flatnonzero(np.count_nonzero(keep, axis=1) > k)  # rows with more ties than places
    if extra.size:
        xe, ke = x[extra], kth[extra]
        tie = xe == ke
        need = k - np.count_nonzero(xe > ke if largest else xe < ke, axis=1)
        keep[extra] &= ~tie | (np.cumsum(tie, axis=1) <= need[:, None])
    return np.flatnonzero(keep).reshape(x.shape[0], k) - row_starts(x.shape[0], n)[:, None]


BLOCK = 64  # elements a block of a long row holds, for TopK's block extremes


def _block_narrowed(x: np.ndarray, k: int, largest: bool) -> tuple[np.ndarray, np.ndarray] | None:
    """For 2-D ``x`` whose rows hold at least 4·k blocks of ``BLOCK``: (values, columns) of the elements of
    each row that can be among its top k, left-aligned and padded by the type's extreme, the k-th largest
    (smallest) block extreme being a lower (upper) bound of the k-th value. None when a NaN is present or
    the narrowing keeps over a quarter of a row."""
    rows, n = x.shape
    nb = n // BLOCK
    if nb < 4 * k or not rows:
        return None
    blocks = x[:, : nb * BLOCK].reshape(rows, nb, BLOCK)
    ext = blocks.max(axis=2) if largest else blocks.min(axis=2)
    if ext.dtype.kind in "fc" and np.isnan(ext).any():
        return None
    at = nb - k if largest else k - 1
    bound = np.partition(ext, at, axis=1)[:, at : at + 1]
    keep = x >= bound if largest else x <= bound
    counts = np.count_nonzero(keep, axis=1)
    width = int(counts.max())
    if 4 * width > n:
        return None
    info = np.finfo(x.dtype) if x.dtype.kind == "f" else np.iinfo(x.dtype)
    fill = (-np.inf if largest else np.inf) if x.dtype.kind == "f" else (info.min if largest else info.max)
    flat = np.flatnonzero(keep)
    row = flat // n
    slot = np.arange(flat.size) - np.repeat(np.cumsum(counts) - counts, counts)
    values = np.full((rows, width), fill, x.dtype)
    cols = np.zeros((rows, width), np.int64)
    values[row, slot] = x.reshape(-1)[flat]
    cols[row, slot] = flat - row * n
    return values, cols


def _top_k_rows(x: np.ndarray, k: int, largest: bool) -> np.ndarray | None:
    """TopK's indices along the last axis of 2-D ``x`` by a partition then a sort of the k kept (long rows
    narrowed first to the elements their block extremes allow); None when a NaN reaches the top k."""
    narrowed = _block_narrowed(x, k, largest)
    if narrowed is not None:  # the padding ranks below every kept element: it is never picked
        values, cols = narrowed
        picked = _top_k_rows(values, k, largest)
        if picked is not None:
            return np.take_along_axis(cols, picked, axis=1)
    cand = _top_k_candidates(x, k, largest)
    if cand is None:
        return None
    return np.take_along_axis(cand, _order(np.take_along_axis(x, cand, axis=1), largest), axis=1)


@kernel("TopK", since=1)
def top_k(inputs: Inputs, attrs: Attrs) -> Outputs:
    """The k largest (smallest) values along the axis and their indices, always sorted (also for
    sorted=0, whose order is unspecified)."""
    x = inputs[0]
    axis = _axis(attrs["axis"], x.ndim)
    k = int(np.asarray(inputs[1]).reshape(-1)[0]) if len(inputs) > 1 and inputs[1] is not None else attrs["k"]
    n = x.shape[axis]
    if not 0 <= k <= n:
        raise ValueError(f"TopK: k={k} is out of range for an axis of size {n}")
    flag = attrs.get("largest", 1)
    largest = flag is None or bool(flag)
    xl = np.moveaxis(x, axis, -1)
    rows = None
    if k > 0 and 8 * k <= n and x.size >= 1024:  # k small against the axis: partition, sort only k
        rows = _top_k_rows(xl.reshape(-1, n), k, largest)
    if rows is None:  # one sort of the whole axis
        idx = np.moveaxis(_order(xl, largest)[..., :k], -1, axis)
    else:
        idx = np.moveaxis(rows.reshape(xl.shape[:-1] + (k,)), -1, axis)
    idx = np.ascontiguousarray(idx).astype(np.int64, copy=False)
    return (np.take_along_axis(x, idx, axis=axis), idx)


def _arg(inputs: Inputs, attrs: Attrs, fn: Any) -> Outputs:
    x = inputs[0]
    axis = _axis(attrs["axis"], x.ndim)
    keep = bool(attrs["keepdims"])
    if attrs.get("select_last_index"):
        r = (x.shape[axis] - 1) - fn(np.flip(x, axis), axis=axis, keepdims=keep)
    else:
        r = fn(x, axis=axis, keepdims=keep)
    return (np.asarray(r, dtype=np.int64),)


@kernel("ArgMax", since=1)
def arg_max(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _arg(inputs, attrs, np.argmax)


@kernel("ArgMin", since=1)
def arg_min(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _arg(inputs, attrs, np.argmin)


@kernel("Compress", since=9)
def compress(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, cond = inputs[0], np.asarray(inputs[1]).astype(bool, copy=False).reshape(-1)
    axis = attrs.get("axis")
    # a condition longer than the axis: its extra entries are ignored, as onnxruntime ignores them
    if axis is None:
        flat = x.reshape(-1)
        return (np.compress(cond[: flat.size], flat),)
    ax = _axis(axis, x.ndim)
    return (np.compress(cond[: x.shape[ax]], x, axis=ax),)


@kernel("Unique", since=11)
def unique(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    axis = attrs.get("axis")
    ax = None if axis is None else _axis(axis, x.ndim)
    vals, first, inverse, counts = np.unique(x, return_index=True, return_inverse=True,
                                             return_counts=True, axis=ax)
    inverse = inverse.reshape(-1)
    if not attrs.get("sorted", 1):  # order of first occurrence
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        vals = np.take(vals, order, axis=ax if ax is not None else 0)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    i64 = np.int64
    return (vals, first.astype(i64), inverse.astype(i64), counts.astype(i64))

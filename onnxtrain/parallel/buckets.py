"""Averaging gradients across ranks through a few large contiguous buffers (not one call per tensor).

Tensors of one dtype are laid out back to back in one flat buffer per dtype; the buffer is reduced
in chunks of at most ``bucket_bytes`` (one ``MPI_Allreduce`` each). Each gradient is copied in and
scaled in the same pass (``1/(N·D)`` as in the legacy), and the reduced gradients are returned as
views of the flat buffer, valid until the next reduction. Half-precision gradients (float16, bfloat16,
float8) are summed unscaled in float32 (exact for a few ranks' half values or float32 accumulation sums),
then times the factor in float32 and cast to their type: one process's mean, whose accumulation graph
multiplies its float32 sum by a float32 ``1/steps`` before the cast (a float64 factor rounds a few elements
in ten million otherwise). A buffer of the half type rounded twice (each rank's scaled part, then the sum;
float16 at every addition of MPI's reduction tree), one element in three a unit in the last place off.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxtrain.parallel.comm import Communicator

DEFAULT_BUCKET_BYTES = 16 << 20


class BucketReducer:
    """Sums (and scales) a fixed list of tensors across ranks; one reducer per list of shapes/dtypes."""

    def __init__(self, comm: Communicator, shapes: Sequence[tuple[int, ...]], dtypes: Sequence[np.dtype],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.comm = comm
        self.signature = (tuple(tuple(s) for s in shapes), tuple(np.dtype(d).str for d in dtypes))
        sizes: dict[np.dtype, int] = {}
        where: list[tuple[np.dtype, int, int]] = []
        for shape, dt in zip(shapes, dtypes):
            key = wire_dtype(dt)  # a dtype itself: its string is "<V2" for ml_dtypes' bfloat16
            n = int(np.prod(shape, dtype=np.int64))
            where.append((key, sizes.get(key, 0), n))
            sizes[key] = sizes.get(key, 0) + n
        self.flat = {k: np.zeros(n, k) for k, n in sizes.items()}
        self.wire = [self.flat[k][o:o + n].reshape(shape) for (k, o, n), shape in zip(where, shapes)]
        # what reduce() returns: the wire views themselves, or arrays of the gradients' own half type
        self.views = [w if w.dtype == np.dtype(dt) else np.zeros(w.shape, dt)
                      for w, dt in zip(self.wire, dtypes)]
        self.chunks: list[np.ndarray] = []
        for buf in self.flat.values():
            step = max(1, bucket_bytes // buf.itemsize)
            self.chunks += [buf[i:i + step] for i in range(0, buf.size, step)]
        self.nbytes = sum(b.nbytes for b in self.flat.values())

    def reduce(self, arrays: Sequence[np.ndarray], scale: float = 1.0,
               wide_scale: float | None = None) -> list[np.ndarray]:
        """``scale · Σ_ranks arrays[i]`` for every i, as views of the reducer's buffers (of the given dtypes;
        valid until the next call). ``wide_scale``: the factor of the half-precision gradients instead, when
        they are given as float32 sums that one process would scale by another count (default ``scale``)."""
        half_scale = scale if wide_scale is None else wide_scale
        if len(arrays) != len(self.views):
            raise ValueError(f"expected {len(self.views)} gradients, got {len(arrays)}")
        for i, (a, v) in enumerate(zip(arrays, self.wire)):
            if np.shape(a) != v.shape:
                raise ValueError(f"gradient {i} of shape {list(np.shape(a))} where {list(v.shape)} was "
                                 "expected")
            if v is not self.views[i]:  # a half type: summed in float32 as it is, scaled after the sum
                np.copyto(v, a, casting="same_kind")
            else:
                scale_into(a, scale, v)
        for k, c in enumerate(self.chunks):
            self.comm.allreduce_(c, f"gradient allreduce (bucket {k + 1} of {len(self.chunks)}, "
                                    f"{c.nbytes} bytes)")
        for w, v in zip(self.wire, self.views):
            if v is not w:  # the float32 sum times the float32 factor, cast to the half type (one process's);
                with np.errstate(over="ignore"):  # a sum past the half type's range is ±inf, as MPI's was
                    np.copyto(v, w * np.float32(half_scale) if half_scale != 1.0 else w, casting="unsafe")
        return self.views


def wire_dtype(dtype: np.dtype) -> np.dtype:
    """The type a gradient of ``dtype`` is summed in across ranks: float32 for the half and quarter
    precision floats (numpy's float16, ml_dtypes' bfloat16 and float8 types, which numpy sees as kind 'V'),
    else ``dtype`` itself."""
    dt = np.dtype(dtype)
    if dt.kind == "V" or (dt.kind == "f" and dt.itemsize < 4):
        return np.dtype(np.float32)
    return dt


def scale_into(a: np.ndarray, scale: float, out: np.ndarray) -> np.ndarray:
    """``out[...] = a · scale``, rounded once to ``out``'s type: the factor is taken in float32 (float64 for
    float64), not in a half type, where 1/3 or 1/6 (the 1/(N·D) of three accumulation steps or ranks) is 0.2 %
    off in bfloat16 and 0.02 % in float16, a bias of every gradient (one process scales its float32
    accumulation buffers in float32)."""
    if scale == 1.0:
        np.copyto(out, a, casting="same_kind")
    else:
        factor = np.float64(scale) if out.dtype == np.float64 else np.float32(scale)
        np.multiply(a, factor, out=out, casting="same_kind")
    return out


_REDUCERS: dict[tuple, BucketReducer] = {}


def allreduce_gradients(arrays: Sequence[np.ndarray], average: bool = True, inplace: bool = True,
                        comm: Communicator | None = None,
                        bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[np.ndarray]:
    """Average (``average=False``: sum) ``arrays`` across all ranks.

    ``inplace=True`` writes the result into the given arrays and returns them (they must be writeable
    and not share memory with anything that must not change, e.g. weights); ``inplace=False`` returns
    new arrays and leaves the inputs alone. Meant for training loops that hold their own gradients
    (the on-device ``Module``/``Optimizer``): call it on every rank with the same list of shapes and
    dtypes, after the backward pass and before the optimizer step. With one process it returns the
    inputs unchanged. The exchange goes through a few flat buffers kept between calls.
    """
    from onnxtrain.parallel.comm import get_communicator, world

    arrays = list(arrays)
    if comm is None:
        if world().size == 1:
            return arrays
        comm = get_communicator()
    if comm.size == 1:
        return arrays
    for i, a in enumerate(arrays):
        if not isinstance(a, np.ndarray) or (inplace and not a.flags.writeable):
            raise TypeError(f"allreduce_gradients: item {i} must be a writeable numpy array, got "
                            f"{type(a).__name__}")
    # the dtypes themselves: numpy's strings name several of ml_dtypes' float8 types alike ('<V1')
    key = (tuple(a.shape for a in arrays), tuple(a.dtype for a in arrays), bucket_bytes, id(comm))
    red = _REDUCERS.get(key)
    if red is None:
        red = _REDUCERS[key] = BucketReducer(comm, [a.shape for a in arrays], [a.dtype for a in arrays],
                                             bucket_bytes)
    out = red.reduce(arrays, 1.0 / comm.size if average else 1.0)
    if not inplace:
        return [r.copy() for r in out]
    for a, r in zip(arrays, out):
        np.copyto(a, r)
    return arrays

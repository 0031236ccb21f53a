"""Losses (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss) and Dropout.

Dropout draws its mask from a numpy Generator kept in the node's cache, so successive runs draw
new masks. A node with a ``seed`` attribute seeds its own generator and draws uniform doubles,
the same stream as numpy's legacy ``np.random.seed(seed)`` that ONNX's reference cases use. The
unseeded nodes (the usual case in training) draw from generators spawned off the random ops'
module-level seed, which :func:`set_dropout_seed` (:func:`onnxtrain.engine.seeds.set_random_seed`)
resets, and use 8 or 16 random bits per element, which is several times faster (the drop probability is
then ``ratio`` rounded to a multiple of 1/65536).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine import parallel
from onnxtrain.engine.kernels.buffering import MIN_VALUES, call_with_buffer, run_size
from onnxtrain.engine.kernels.half_cast import from_single, to_single
from onnxtrain.engine.kernels.indexing import in_range, row_starts
from onnxtrain.engine.kernels.normalization import log_softmax_along, row_sum
from onnxtrain.engine.kernels.random import node_generator
from onnxtrain.engine.kernels.reduce import empty_mean
from onnxtrain.engine.parallel import for_rows
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.engine.seeds import set_random_seed

_F32 = np.dtype(np.float32)


def _work(x: np.ndarray) -> np.ndarray:
    return x.astype(_F32) if x.dtype.itemsize < 4 and x.dtype.kind in "fV" else x


# ---------------------------------------------------------------- losses


def _nll(logp: np.ndarray, target: np.ndarray, weight: np.ndarray | None, attrs: Attrs) -> np.ndarray:
    """The ONNX NLL loss of log-probabilities ``logp`` (N, C, d1, ...) and class ``target`` (N, d1, ...)."""
    if logp.ndim < 2 or target.shape != logp.shape[:1] + logp.shape[2:]:
        raise ValueError(
            f"input of shape {logp.shape} (N, C, d1, ...) needs a target of shape "
            f"(N, d1, ...), got {target.shape}"
        )
    c = logp.shape[1]
    ignore_index = attrs["ignore_index"]
    ignored = None
    t = target
    if ignore_index is not None:
        ignored = target == ignore_index
        t = np.where(ignored, 0, target)
    if t.size and (t.min() < 0 or t.max() >= c):
        raise ValueError(f"target holds class indices outside [0, {c}) that are not ignore_index")
    picked = np.take_along_axis(logp, np.expand_dims(t.astype(np.intp, copy=False), 1), axis=1)
    loss = picked.reshape(target.shape)
    np.negative(loss, out=loss)
    w = None
    if weight is not None:
        w = weight.astype(loss.dtype, copy=False)[t]
        if ignored is not None:
            w[ignored] = 0
    elif ignored is not None:
        w = np.logical_not(ignored).astype(loss.dtype)
    if w is not None:
        loss *= w
    if ignored is not None:
        loss[ignored] = 0  # an ignored row adds nothing, also where its log-probability is ±inf or NaN
        # (padding positions whose logits are all masked to -inf: -inf · 0 would make the mean NaN)
    reduction = attrs["reduction"]
    if reduction == "none":
        return loss
    if reduction == "sum":
        return np.asarray(np.sum(loss))
    if reduction == "mean":
        if w is not None:
            return np.asarray(np.sum(loss) / np.sum(w))
        return np.asarray(np.mean(loss) if loss.size else empty_mean(loss, None))
    raise ValueError(f"unknown reduction {reduction!r}; expected none, sum or mean")


@kernel("NegativeLogLikelihoodLoss", since=12)
def negative_log_likelihood_loss(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, target = inputs[0], inputs[1]
    weight = inputs[2] if len(inputs) > 2 else None
    loss = _nll(_work(x), target, weight, attrs)
    return (loss.astype(x.dtype, copy=False),)


_LEAN_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _log_softmax_rows(x: np.ndarray, starts: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The log-softmax of each row of the C-contiguous 2-D ``x`` (into ``out`` when given); ``starts``: the
    rows' flat offsets."""
    # row maxima as one reduceat over the row starts (a maximum is exact in any order)
    logp = np.subtract(x, np.maximum.reduceat(x.reshape(-1), starts)[:, None], out=out)
    s = row_sum(np.exp(logp))
    logp -= np.log(s, out=s)
    return logp


def _picked_offsets(target: np.ndarray, n: int, c: int, starts: np.ndarray) -> np.ndarray:
    """The flat offsets of each row's target class in a C-contiguous (n, c) array; :class:`OutOfRange` for
    a target outside [0, c). int64 targets by one call that checks and computes them (half the time of the
    check, then the sum)."""
    if target.dtype == _I64:
        try:
            return np.ravel_multi_index((row_starts(n, 1), target), (n, c))
        except ValueError:
            pass
    elif in_range(target, c):
        return starts + target
    raise OutOfRange(f"target holds class indices outside [0, {c}) that are not ignore_index")


class OutOfRange(ValueError):
    """A target class index outside [0, C)."""


_I64 = np.dtype(np.int64)


def _sce_rows(x: np.ndarray, target: np.ndarray, reduction: str, weighed: bool = False
              ) -> tuple[np.ndarray, np.ndarray]:
    """The loss and log-probabilities of (N, C) scores and N class indices, no weights or ignored class:
    the same operations as the general path, so the same bits, in a dozen direct ufunc calls instead of
    about forty calls through numpy's Python wrappers (``np.mean``, ``ndarray.max``, ``take_along_axis``).
    In a training step this kernel runs with its code and data out of cache, where each such call costs
    5-20 µs: 153 → 76 µs in the MLP's step (batch 256). ``weighed``: the node names an ignored class
    (none of ``target`` is it), and the general path's mean divides by the sum of the (unit) weights."""
    n, c = x.shape
    starts = row_starts(n, c)
    work = x.size * 2 // 3
    if x.size < MIN_VALUES and work < 2 * parallel.MIN_ROWS_WORK:
        # one range on this thread (for_rows's rule), numpy's own buffer: the rows below, inlined
        logp = _log_softmax_rows(x, starts)
    else:
        logp = np.empty_like(x)

        def rows(lo: int, hi: int) -> None:
            # (the per-row subtractions walk long rows in place, not through numpy's buffer: buffering.py)
            call_with_buffer(run_size(c, (hi - lo) * c), _log_softmax_rows, x[lo:hi], starts[:hi - lo],
                             logp[lo:hi])

        # split by rows over the run's threads from about 786 K scores (each row computed as in one piece:
        # the same bits). One thread against two, alone: (512, 1000) 542 / 553 µs, (256, 3000) 833 / 678,
        # (1024, 1000) 1248 / 857, the bench GPT decoder's (1,024 rows of a 1,000-word head; 1.56 ms of its
        # step)
        for_rows(n, work, rows)
    loss = logp.reshape(-1).take(_picked_offsets(target, n, c, starts))
    np.negative(loss, out=loss)
    if reduction == "none":
        return loss, logp
    total = np.add.reduce(loss)
    if reduction == "sum":
        return np.asarray(total), logp
    if reduction == "mean" and weighed:  # the sum over the sum of n unit weights, in the loss's dtype
        return np.asarray(total / total.dtype.type(n)), logp
    if reduction == "mean":  # as np.mean computes it: the sum over a count of type intp (so in float64), cast
        # back; float(total) / n is that division without numpy's scalar promotion (2.6 → 0.3 µs)
        return np.asarray(total.dtype.type(float(total) / n)), logp
    raise ValueError(f"unknown reduction {reduction!r}; expected none, sum or mean")


@kernel("SoftmaxCrossEntropyLoss", since=12)
def softmax_cross_entropy_loss(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, target = inputs[0], inputs[1]
    weight = inputs[2] if len(inputs) > 2 else None
    if x.ndim < 2:
        raise ValueError(f"SoftmaxCrossEntropyLoss needs scores of shape (N, C, ...), got {x.shape}")
    ignore_index = attrs["ignore_index"]
    lean = (weight is None and x.ndim == 2 and target.ndim == 1 and x.dtype in _LEAN_DTYPES and x.size
            and target.dtype.kind in "iu" and x.flags.c_contiguous and target.shape[0] == x.shape[0])
    # torch's exports always name an ignored class (-100): the rows path serves them when no target is that
    # class. One outside [0, C) needs no scan: the rows path finds any target out of range (that one too)
    if lean and ignore_index is not None and 0 <= ignore_index < x.shape[1]:
        lean = not np.logical_or.reduce(np.equal(target, ignore_index))
    if lean:
        try:
            loss, logp = _sce_rows(x, target, attrs["reduction"], ignore_index is not None)
        except OutOfRange as e:
            if ignore_index is None:  # the general path's error (the onnxruntime backend words it so too)
                raise ValueError(str(e)) from None
        else:  # (both in x's dtype)
            return (loss, logp) if attrs.n_outputs > 1 and attrs.output_used[1] else (loss,)
        # an ignored target, or one the general path reports
    logp = log_softmax_along(_work(x), 1)
    loss = _nll(logp, target, weight, attrs).astype(x.dtype, copy=False)
    if attrs.n_outputs > 1 and attrs.output_used[1]:
        return loss, logp.astype(x.dtype, copy=False)
    return (loss,)


# ---------------------------------------------------------------- dropout

# unseeded Dropout nodes draw from the random ops' seed sequence: one call reseeds both
set_dropout_seed = set_random_seed


def _legacy_seeded(seed: float) -> np.random.Generator:
    """numpy's legacy seeding, so that masks match np.random.seed(seed) (ONNX's reference cases)."""
    bits = np.random.MT19937()
    bits.state = np.random.RandomState(int(seed) % 2**32).get_state(legacy=False)
    return np.random.Generator(bits)


def _generator(attrs: Attrs) -> np.random.Generator:
    return node_generator(attrs, _legacy_seeded)


def _keep_mask(gen: np.random.Generator, shape: tuple[int, ...], ratio: float) -> np.ndarray:
    """Bernoulli(1 - ratio) mask from the fewest random bits per element (8, 16 or 32) that hold ``ratio``
    exactly or within 1e-4 of both the drop and the keep probability (0.1 within 7e-6 with 16 bits;
    0.9999 needs 32, whose rounding kept 1.8 times too many), else from uniform doubles."""
    n = int(np.prod(shape))
    if (ratio * 256).is_integer():  # 0.5, 0.25, 0.125 ... are exact with one byte
        return np.frombuffer(gen.bytes(n), np.uint8).reshape(shape) >= np.uint8(ratio * 256)
    tolerance = 1e-4 * min(ratio, 1.0 - ratio)
    for bits, dtype in ((16, np.uint16), (32, np.uint32)):
        level = round(ratio * 2.0**bits)
        if 0 < level < 2**bits and abs(level / 2.0**bits - ratio) <= tolerance:
            draws = np.frombuffer(gen.bytes(bits // 8 * n), dtype).reshape(shape)
            return draws >= dtype(level)
    return gen.random(shape) >= ratio


def _dropout(x: np.ndarray, ratio: float, training: bool, attrs: Attrs, mask_dtype: Any) -> Outputs:
    want_mask = attrs.n_outputs > 1 and attrs.output_used[1]
    if not training or ratio == 0.0:
        return (x, np.ones(x.shape, dtype=mask_dtype)) if want_mask else (x,)
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"Dropout ratio must be in [0, 1) in training mode, got {ratio}")
    gen = _generator(attrs)
    # with a seed: uniform doubles, as np.random.seed(seed) + np.random.uniform draws them
    mask = _keep_mask(gen, x.shape, ratio) if attrs.get("seed") is None else gen.random(x.shape) >= ratio
    if x.dtype.kind == "f" and x.dtype.itemsize >= 4:
        y = np.multiply(x, 1.0 / (1.0 - ratio), dtype=x.dtype)
        y *= mask
    else:  # float16, bfloat16: scaled in float32 and rounded once (the scale itself is not rounded to the
        # half type first, which biased every kept float16 element by +0.02 % at ratio 0.1)
        y = from_single(to_single(x) * np.float32(1.0 / (1.0 - ratio)) * mask, x.dtype)
    return (y, mask.astype(mask_dtype, copy=False)) if want_mask else (y,)


@kernel("Dropout", since=7)
def dropout_7(inputs: Inputs, attrs: Attrs) -> Outputs:
    """Opsets 7-11: always the inference form (identity)."""
    x = inputs[0]
    return _dropout(x, 0.0, False, attrs, np.bool_ if attrs.opset >= 10 else x.dtype)


@kernel("Dropout", since=12)
def dropout(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    r = inputs[1] if len(inputs) > 1 else None
    t = inputs[2] if len(inputs) > 2 else None
    ratio = 0.5 if r is None else float(r)
    training = False if t is None else bool(t)
    return _dropout(x, ratio, training, attrs, np.bool_)

"""Random kernels: RandomNormal, RandomUniform, their ``*Like`` forms, Bernoulli and Multinomial.

Each node draws from its own numpy Generator, kept in the node's cache, so successive runs draw new
values. A node with a ``seed`` attribute seeds its generator once, from the seed (a float), and its values
then continue from run to run; a new plan of the same model starts the same sequence again (as a new
onnxruntime session does), unless the plans share a ``random_state`` (the graphs of one training session).
A node without a seed draws fresh randomness: its generator is spawned off one
module-level seed sequence, made from OS entropy unless
:func:`onnxtrain.engine.seeds.set_random_seed` fixed it.

ONNX fixes no sampling algorithm, so the values differ from onnxruntime's and onnx.reference's for the same
seed. The plan never folds, memoises or merges these steps (``RANDOM_OPS`` in ``engine/fusion/common.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.engine.seeds import unseeded_generator

_making = threading.Lock()  # makes a seeded node's generator once, whichever thread runs the node first


def node_generator(attrs: Attrs, from_seed: Callable[[float], np.random.Generator]) -> np.random.Generator:
    """A random node's generator: made once by ``from_seed`` from its ``seed`` attribute and kept in the
    node's cache, else :func:`unseeded_generator`."""
    seed = attrs.get("seed")
    if seed is None:
        return unseeded_generator(attrs.cache)
    gen = attrs.cache.get("rng")
    if gen is None:
        with _making:  # concurrent first runs share one generator (each made its own: the same draws)
            gen = attrs.cache.get("rng")
            if gen is None:
                gen = attrs.cache["rng"] = from_seed(seed)
    return gen


def _from_float_bits(seed: float) -> np.random.Generator:
    """A generator seeded by the float's bits, so that 0.5 and 0.25 are different seeds."""
    return np.random.default_rng(int(np.array(float(seed), np.float64).view(np.uint64)))


def _generator(attrs: Attrs) -> np.random.Generator:
    return node_generator(attrs, _from_float_bits)


def _is_float(dt: np.dtype) -> bool:
    return dt.kind == "f" or dt.name.startswith("bfloat")


def _float_dtype(attrs: Attrs, like: np.ndarray | None = None) -> np.dtype:
    """The output dtype: the ``dtype`` attribute, else the input's (``*Like``); a float type."""
    code = attrs.get("dtype")
    if code is None or (code == TensorProto.UNDEFINED and like is not None):
        if like is None:
            raise ValueError(f"{attrs.op}: the dtype attribute is required")
        dt = np.dtype(like.dtype)
        if not _is_float(dt):
            raise ValueError(f"{attrs.op}: the input is {dt} and no dtype attribute is given; "
                             "the output must be a float type")
        return dt
    dt = _dtype_attr(attrs, code)
    if not _is_float(dt):
        raise ValueError(f"{attrs.op}: dtype must be a float type, got {dt}")
    return dt


def _dtype_attr(attrs: Attrs, code: int) -> np.dtype:
    """The numpy dtype of a ``dtype`` attribute's TensorProto code; an unknown or UNDEFINED code is refused
    by name (not a bare KeyError)."""
    try:
        if code == TensorProto.UNDEFINED:
            raise KeyError(code)
        return np.dtype(helper.tensor_dtype_to_np_dtype(code))
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{attrs.op}: dtype {code} is not a known tensor element type") from None


def _shape(attrs: Attrs) -> tuple[int, ...]:
    shape = attrs.get("shape")
    if shape is None or any(d < 0 for d in shape):
        raise ValueError(f"{attrs.op}: the shape attribute must be given, with no negative dims; got {shape}")
    return tuple(shape)


def _work(dt: np.dtype) -> np.dtype:
    """float32 and float64 are drawn as they are; half-precision types are drawn in float32 and rounded."""
    return dt if dt in (np.dtype(np.float32), np.dtype(np.float64)) else np.dtype(np.float32)


def _normal(attrs: Attrs, shape: tuple[int, ...], dt: np.dtype) -> Outputs:
    y = _generator(attrs).standard_normal(shape, dtype=_work(dt))
    y *= attrs["scale"]
    y += attrs["mean"]
    return (y.astype(dt, copy=False),)


def _uniform(attrs: Attrs, shape: tuple[int, ...], dt: np.dtype) -> Outputs:
    low, high = attrs["low"], attrs["high"]
    y = _generator(attrs).random(shape, dtype=_work(dt))
    y *= high - low
    y += low
    y = y.astype(dt, copy=False)
    if high > low:  # the draws are in [low, high): a value rounded up to ``high`` takes the one below it
        np.minimum(y, _below(high, low, dt), out=y)
    return (y,)


def _below(high: float, low: float, dt: np.dtype) -> np.ndarray:
    """The largest value of ``dt`` under ``high`` (``low`` if none is above it)."""
    top, floor = np.array(high, dt), np.array(low, dt)
    while float(top) >= high and top > floor:
        top = np.nextafter(top, floor)
    return top


@kernel("RandomNormal", since=1)
def random_normal(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _normal(attrs, _shape(attrs), _float_dtype(attrs))


@kernel("RandomNormalLike", since=1)
def random_normal_like(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = np.asarray(inputs[0])
    return _normal(attrs, x.shape, _float_dtype(attrs, x))


@kernel("RandomUniform", since=1)
def random_uniform(inputs: Inputs, attrs: Attrs) -> Outputs:
    return _uniform(attrs, _shape(attrs), _float_dtype(attrs))


@kernel("RandomUniformLike", since=1)
def random_uniform_like(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = np.asarray(inputs[0])
    return _uniform(attrs, x.shape, _float_dtype(attrs, x))


@kernel("Bernoulli", since=15)
def bernoulli(inputs: Inputs, attrs: Attrs) -> Outputs:
    p = np.asarray(inputs[0])
    if not _is_float(p.dtype):
        raise ValueError(f"Bernoulli: the input holds probabilities and must be a float type, got {p.dtype}")
    code = attrs.get("dtype")
    dt = p.dtype if code is None or code == TensorProto.UNDEFINED else _dtype_attr(attrs, code)
    if dt.kind not in "biuf" and not _is_float(dt):  # T2: the integer, float and bool types
        raise ValueError(f"Bernoulli: dtype must be a bool, integer or float type, got {dt}")
    p64 = p.astype(np.float64, copy=False)
    if p.size and not ((p64 >= 0).all() and (p64 <= 1).all()):  # NaN fails both
        raise ValueError("Bernoulli: every input probability must be in [0, 1]")
    hit = _generator(attrs).random(p.shape) < p64  # P(u < p) = p for u uniform in [0, 1)
    return (hit.astype(dt),)


@kernel("Multinomial", since=7)
def multinomial(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = np.asarray(inputs[0])
    if x.ndim != 2 or not _is_float(x.dtype):
        raise ValueError(f"Multinomial: the input must be a float [batch, classes] tensor, got {x.dtype}"
                         f"{list(x.shape)}")
    n = attrs["sample_size"]
    if n < 0:
        raise ValueError(f"Multinomial: sample_size must be >= 0, got {n}")
    dt = _dtype_attr(attrs, attrs["dtype"])
    if dt not in (np.dtype(np.int32), np.dtype(np.int64)):
        raise ValueError(f"Multinomial: dtype must be int32 or int64, got {dt}")
    batch, classes = x.shape
    if batch and not classes:
        raise ValueError("Multinomial: there must be at least one class")
    logits = x.astype(np.float64)
    top = logits.max(axis=1, initial=-np.inf, keepdims=True)
    bad = np.flatnonzero(~np.isfinite(top[:, 0]))
    if bad.size:
        raise ValueError(f"Multinomial: row {bad[0]} has no finite largest log-probability "
                         "(all -inf, or +inf or NaN)")
    cdf = np.cumsum(np.exp(logits - top), axis=1)  # each row's unnormalised CDF; its max's term is 1
    if np.isnan(cdf).any():
        raise ValueError("Multinomial: the input holds NaN")
    cdf /= cdf[:, -1:]
    u = _generator(attrs).random((batch, n))
    out = np.empty((batch, n), dt)
    for b in range(batch):  # class k is drawn when cdf[k-1] <= u < cdf[k]
        out[b] = np.searchsorted(cdf[b], u[b], side="right")
    return (out,)

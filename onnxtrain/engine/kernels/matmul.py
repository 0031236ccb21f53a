"""Matrix products: MatMul, Gemm and Einsum; the determinant (Det).

Half-precision operands (float16, bfloat16) are multiplied in float32 and rounded back, since numpy
has no BLAS path for them.
"""

from __future__ import annotations

import functools

import numpy as np

from onnxtrain.engine.kernels.half_cast import HALF, from_single, narrow, round_to_half, to_single
from onnxtrain.engine.parallel import for_ranges_with_own_blas, width
from onnxtrain.engine.registry import Attrs, Inputs, NodeCache, Outputs, kernel

_F32 = np.dtype(np.float32)
_FAR_ROWS = 4096  # bytes between B's rows from which a batched MatMul copies B first
# A batch of products each too small for OpenBLAS to split over its threads (attention's scores) runs one
# GEMM after another on one thread in numpy; from SPLIT_BATCH_MIN_WORK multiply-adds in all, products at
# least SPLIT_BATCH_MIN_N wide with K ≤ N have the batch's first axis split over the run's threads instead,
# each GEMM on the thread that makes it (the same GEMMs, so the same bits). 2 cores, float32, (batch, heads,
# M, K) · (.., K, N), µs, numpy → split: (32, 4, 64, 32) · (.., 32, 64) 306 → 258, (16, 8, 64, 64) · (.., 64,
# 64) 600 → 404, (8, 12, 128, 64) · (.., 64, 128) 2,022 → 1,323, (4, 12, 256, 64) · (.., 64, 256) 3,227 →
# 2,496. Narrower or deeper products lose ((32, 4, 64, 64) · (.., 64, 32) 303 → 430; (8, 12, 128, 128) · (..,
# 128, 64) even), as do smaller batches (the GPT decoder's (16, 4, 64, 32) · (.., 32, 64): 154-267 → 176-298,
# waking the other thread costs more than it saves) and products of SPLIT_BATCH_MAX_EACH or more, which
# OpenBLAS splits itself
SPLIT_BATCH_MIN_WORK = 1 << 24
SPLIT_BATCH_MIN_N = 64
SPLIT_BATCH_MAX_EACH = 1 << 25
_BLAS_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _low_precision(dt: np.dtype) -> bool:
    """True for float dtypes narrower than float32 (float16, bfloat16, float8 ...)."""
    if dt.kind == "f":  # first: ``dt.name`` is a Python-level property, slow for a check made every call
        return dt.itemsize < 4
    return dt.kind == "V" or dt.name.startswith(("bfloat", "float8"))


@functools.lru_cache(maxsize=256)
def fits_onto(shape: tuple[int, ...], other: tuple[int, ...]) -> bool:
    """Whether ``other`` broadcasts onto ``shape`` without growing it, remembered per pair of shapes: the Add
    after a MatMul asks at every run, and numpy's answer costs as much as a small Add. Shapes that do not
    broadcast at all answer False: the unfused Add then fails, naming its node."""
    try:
        return np.broadcast_shapes(shape, other) == shape
    except ValueError:
        return False


def half_product_plus(a: np.ndarray, b: np.ndarray, bias: np.ndarray, bias_first: bool = False
                      ) -> np.ndarray | None:
    """``Add(MatMul(a, b), bias)`` (``Add(bias, MatMul(a, b))`` with ``bias_first``) of float16 arrays with
    the two nodes' bits, the product rounded to float16 while it stays in float32 (:func:`round_to_half`)
    and the bias added there, narrowed once: numpy's float16 add rounds the float32 sum of its operands
    once, as this does. None where the operands are not all float16 or the bias would grow the product's
    shape or does not broadcast onto it, or ``a`` and ``b`` do not multiply."""
    if not (a.dtype == b.dtype == bias.dtype == HALF) or a.ndim < 1 or b.ndim < 1:
        return None
    try:
        y = np.asarray(np.matmul(to_single(a), to_single(b)))  # (1-D by 1-D: a scalar, made a 0-d array)
    except ValueError:  # (operands that do not multiply: the unfused MatMul fails, naming its node)
        return None
    if not fits_onto(y.shape, bias.shape):  # (shapes that do not broadcast: the unfused Add fails, naming it)
        return None
    if not round_to_half(y):  # a value of 2¹⁵ or more (it may overflow), infinite or NaN: numpy's own add
        p = narrow(y)
        return np.add(bias, p) if bias_first else np.add(p, bias)
    w = to_single(bias)
    np.add(*((w, y) if bias_first else (y, w)), out=y)
    return narrow(y)


@kernel("MatMul", since=1)
def matmul(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs[0], inputs[1]
    dt = a.dtype
    if _low_precision(dt):
        return (from_single(np.matmul(to_single(a), to_single(b)), dt),)  # half_product_plus's product
    if a.ndim > 2 and b.ndim >= 2 and a.size and b.shape[:-2] == (1,) * (b.ndim - 2):
        # (..., K) @ (K, N) as one 2-D GEMM: faster than numpy's loop of small GEMMs over the batch, even
        # when ``a`` is a strided view (attention's transposes) that the reshape must copy. A B of batch
        # dims all 1 (an RNN gradient's per-direction weights, [1, 1, K, N]) is such a matrix too: numpy
        # would loop over A's batch (LSTM backward, 50 steps × 32 rows: 1.29 ms → 0.52 ms)
        lead = a.shape[:-2] if b.ndim == 2 else np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        y = np.matmul(a.reshape(-1, a.shape[-1]), b.reshape(b.shape[-2:]))
        return (y.reshape(*lead, a.shape[-2], b.shape[-1]),)
    if b.ndim > 2 and b.strides[-1] == b.itemsize and b.strides[-2] >= _FAR_ROWS:
        # a batch of B matrices with each row on its own page (attention's V as a view of a (S, B, H, d)
        # tensor): one copy first makes the small GEMMs faster (measured in the exported transformer's
        # forward: 320 -> 192 us for P @ V, copy included); closer rows and transposed B are left as they are
        b = np.ascontiguousarray(b)
    y = _split_batch(a, b)
    if y is not None:
        return (y,)
    y = np.matmul(a, b)
    return (y if isinstance(y, np.ndarray) else np.asarray(y, dtype=dt),)


def _split_batch(a: np.ndarray, b: np.ndarray) -> np.ndarray | None:
    """``a @ b`` for a batch of products of equal rank split over the run's threads along the batch's first
    axis (:data:`SPLIT_BATCH_MIN_WORK`; whole on this thread where OpenBLAS cannot be pinned), or None where
    numpy's own loop is taken."""
    if a.ndim != b.ndim or a.ndim < 3 or width() < 2 or a.dtype != b.dtype or a.dtype not in _BLAS_FLOATS:
        return None
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    if b.shape[-2] != k or n < SPLIT_BATCH_MIN_N or k > n:
        return None
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    each = m * k * n
    if lead[0] < 2 or each > SPLIT_BATCH_MAX_EACH or each * int(np.prod(lead)) < SPLIT_BATCH_MIN_WORK:
        return None
    y = np.empty((*lead, m, n), a.dtype)

    def part(lo: int, hi: int) -> None:
        np.matmul(a if a.shape[0] == 1 else a[lo:hi], b if b.shape[0] == 1 else b[lo:hi], out=y[lo:hi])

    for_ranges_with_own_blas(lead[0], part)
    return y


# A·Bᵀ with few rows of A (a Linear layer's forward at a small batch) is faster as (B·Aᵀ)ᵀ: OpenBLAS, given
# the long side first, packs the weight once. Measured, float32 Gemm with bias, (M, K) · (N, K)ᵀ, M ≤ 128:
# 64×784·512: 186 → 164 µs (native kernels), 286 → 259 µs (Haswell); 32×784·512: 174 → 96 µs; from
# M = 256 on it is slower (514 → 530 µs), and for a narrow B (N = 10) the copy back costs more than it saves
_FEW_ROWS = 128
_WIDE_B = 64


def _product(a: np.ndarray, b: np.ndarray, transposed_b: bool) -> np.ndarray:
    """a @ b as a C-contiguous array; ``transposed_b``: b is the transpose of a C-contiguous matrix."""
    if (
        transposed_b
        and a.shape[0] <= _FEW_ROWS
        and b.shape[1] >= _WIDE_B
        and a.dtype == b.dtype
        and a.dtype.kind == "f"
        and a.dtype.itemsize >= 4
    ):
        return np.ascontiguousarray(np.matmul(b.T, a.T).T)
    return np.matmul(a, b)


@kernel("Gemm", since=7)
def gemm(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"Gemm needs 2-D A and B, got shapes {a.shape} and {b.shape}")
    if attrs["transA"]:
        a = a.T
    transposed_b = bool(attrs["transB"]) and b.flags.c_contiguous
    if attrs["transB"]:
        b = b.T
    dt = a.dtype
    low = _low_precision(dt)
    if low:
        a, b = to_single(a), to_single(b)
        c = None if c is None else to_single(c)
        transposed_b = False
    alpha, beta = attrs["alpha"], attrs["beta"]
    y = _product(a, b, transposed_b)
    if dt.kind in "iu" and (alpha != 1.0 or (c is not None and beta not in (0.0, 1.0))):
        # integer Gemm with float scales: scaled in float64, then truncated to the type (onnx.reference's)
        f = y.astype(np.float64) * alpha
        if c is not None and beta != 0.0:
            f += c.astype(np.float64) * beta
        return (f.astype(dt),)
    if alpha != 1.0:
        y *= alpha
    if c is not None and beta != 0.0:
        if c.dtype != y.dtype:
            c = c.astype(y.dtype)
        if beta == 1.0:
            y += c  # C broadcasts one way onto (M, N); y is a fresh array
        else:
            y += beta * c
    return (from_single(y, dt) if low else y,)


class _Contraction:
    """A two-operand einsum as one (batched) matrix product: the subscripts in both operands and the output
    are the batch, those in both operands only are summed over by the product, and each operand's own
    subscripts are its rows or columns (summed first when the output drops them). np.einsum runs such a
    contraction in its own loops when a batch subscript is present; BLAS is 1.4-1.7x faster (the LSTM
    gradient's ``dtbg,dtbi->dgi`` over 50 steps × 32 rows: 739 → 524 µs, 521 → 312 µs on a strided x)."""

    __slots__ = ("a_sum", "b_sum", "a_perm", "b_perm", "a_shape", "b_shape", "y_shape", "y_perm")

    def __init__(self, sa: str, sb: str, out: str, size: dict[str, int]):
        batch = [c for c in out if c in sa and c in sb]
        left = [c for c in out if c in sa and c not in sb]
        right = [c for c in out if c in sb and c not in sa]
        summed = [c for c in sa if c in sb and c not in out]
        self.a_sum = tuple(i for i, c in enumerate(sa) if c not in sb and c not in out)
        self.b_sum = tuple(i for i, c in enumerate(sb) if c not in sa and c not in out)
        ka = [c for i, c in enumerate(sa) if i not in self.a_sum]
        kb = [c for i, c in enumerate(sb) if i not in self.b_sum]
        self.a_perm = [ka.index(c) for c in batch + left + summed]
        self.b_perm = [kb.index(c) for c in batch + summed + right]

        def prod(cs: list[str]) -> int:
            return int(np.prod([size[c] for c in cs], dtype=np.int64))

        self.a_shape = (prod(batch), prod(left), prod(summed))
        self.b_shape = (prod(batch), prod(summed), prod(right))
        order = batch + left + right
        self.y_shape = [size[c] for c in order]
        self.y_perm = [order.index(c) for c in out]

    @classmethod
    def of(cls, equation: str, a: np.ndarray, b: np.ndarray) -> _Contraction | None:
        """The contraction for an explicit two-operand ``equation`` over float operands, or None (ellipsis,
        a repeated subscript, nothing summed over, sizes that differ: np.einsum's business)."""
        lhs, arrow, out = equation.partition("->")
        terms = lhs.split(",")
        if not arrow or "." in equation or len(terms) != 2 or a.dtype.kind != "f" or b.dtype.kind != "f":
            return None
        sa, sb = terms
        if any(len(set(s)) != len(s) for s in (sa, sb, out)) or (len(sa), len(sb)) != (a.ndim, b.ndim):
            return None
        size: dict[str, int] = {}
        for s, shape in ((sa, a.shape), (sb, b.shape)):
            for c, n in zip(s, shape):
                if size.setdefault(c, n) != n:
                    return None
        if any(c not in size for c in out) or not any(c in sb and c not in out for c in sa):
            return None
        return cls(sa, sb, out, size)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if self.a_sum:
            a = a.sum(axis=self.a_sum)
        if self.b_sum:
            b = b.sum(axis=self.b_sum)
        a = a.transpose(self.a_perm).reshape(self.a_shape)
        b = b.transpose(self.b_perm).reshape(self.b_shape)
        y = np.matmul(a[0], b[0]) if self.a_shape[0] == 1 else np.matmul(a, b)
        return y.reshape(self.y_shape).transpose(self.y_perm)


def _einsum_plan(equation: str, operands: Inputs, cache: dict) -> _Contraction | list | bool:
    """How to run the einsum for these operand shapes, decided once per shape combination: a
    :class:`_Contraction`, else numpy's contraction path."""
    key = tuple(op.shape for op in operands) + tuple(op.dtype for op in operands)
    plan = cache.get(key)
    if plan is None:
        plan = _Contraction.of(equation, *operands) if len(operands) == 2 else None
        if plan is None:
            plan = np.einsum_path(equation, *operands, optimize=True)[0] if len(operands) > 1 else False
        cache[key] = plan
    return plan


@kernel("Einsum", since=12)
def einsum(inputs: Inputs, attrs: Attrs) -> Outputs:
    cache = attrs.cache
    eq = cache.get("equation")
    if eq is None:
        eq = cache["equation"] = "".join(attrs["equation"].split())
    if not eq:  # implicit mode with no subscripts: a scalar's identity, as numpy reads it
        if len(inputs) == 1 and inputs[0].ndim == 0:
            return (inputs[0].copy(),)
        raise ValueError(f"Einsum: an empty equation takes one scalar operand, got shapes "
                         f"{[list(x.shape) for x in inputs]}")
    dt = inputs[0].dtype
    ops = [to_single(x) for x in inputs] if _low_precision(dt) else inputs
    paths = cache.get("paths")
    if paths is None:
        paths = cache["paths"] = NodeCache()  # a plan per operand shapes, bounded as the node's memo
    plan = _einsum_plan(eq, ops, paths)
    y = plan(*ops) if isinstance(plan, _Contraction) else np.einsum(eq, *ops, optimize=plan)
    if not isinstance(y, np.ndarray) or y.dtype != dt:
        y = from_single(np.asarray(y), dt) if y.dtype == _F32 else np.asarray(y).astype(dt, copy=False)
    return (y,)


@kernel("Det", since=11)
def det(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if x.ndim < 2 or x.shape[-1] != x.shape[-2]:
        raise ValueError(f"Det needs square matrices (..., M, M), got shape {list(x.shape)}")
    if _low_precision(x.dtype):
        return (np.asarray(np.linalg.det(x.astype(_F32))).astype(x.dtype),)
    return (np.asarray(np.linalg.det(x), dtype=x.dtype),)

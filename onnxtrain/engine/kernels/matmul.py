"""Matrix products: MatMul, Gemm and Einsum.

Half-precision operands (float16, bfloat16) are multiplied in float32 and rounded back, since numpy
has no BLAS path for them.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel

_F32 = np.dtype(np.float32)
_FAR_ROWS = 4096  # bytes between B's rows from which a batched MatMul copies B first


def _low_precision(dt: np.dtype) -> bool:
    """True for float dtypes narrower than float32 (float16, bfloat16, float8 ...)."""
    if dt.kind == "f":  # first: ``dt.name`` is a Python-level property, slow for a check made every call
        return dt.itemsize < 4
    return dt.kind == "V" or dt.name.startswith(("bfloat", "float8"))


@kernel("MatMul", since=1)
def matmul(inputs: Inputs, attrs: Attrs) -> Outputs:
    a, b = inputs[0], inputs[1]
    dt = a.dtype
    if _low_precision(dt):
        return (np.matmul(a.astype(_F32), b.astype(_F32)).astype(dt),)
    if a.ndim > 2 and b.ndim == 2 and a.size:
        # (..., K) @ (K, N) as one 2-D GEMM: faster than numpy's loop of small GEMMs over the batch, even
        # when ``a`` is a strided view (attention's transposes) that the reshape must copy
        return (np.matmul(a.reshape(-1, a.shape[-1]), b).reshape(*a.shape[:-1], b.shape[1]),)
    if b.ndim > 2 and b.strides[-1] == b.itemsize and b.strides[-2] >= _FAR_ROWS:
        # a batch of B matrices with each row on its own page (attention's V as a view of a (S, B, H, d)
        # tensor): one copy first makes the small GEMMs faster (measured in the exported transformer's
        # forward: 320 -> 192 us for P @ V, copy included); closer rows and transposed B are left as they are
        b = np.ascontiguousarray(b)
    y = np.matmul(a, b)
    return (y if isinstance(y, np.ndarray) else np.asarray(y, dtype=dt),)


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
        a, b = a.astype(_F32), b.astype(_F32)
        c = None if c is None else c.astype(_F32)
        transposed_b = False
    alpha, beta = attrs["alpha"], attrs["beta"]
    y = _product(a, b, transposed_b)
    if alpha != 1.0:
        y *= alpha
    if c is not None and beta != 0.0:
        if c.dtype != y.dtype:
            c = c.astype(y.dtype)
        if beta == 1.0:
            y += c  # C broadcasts one way onto (M, N); y is a fresh array
        else:
            y += beta * c
    return (y.astype(dt) if low else y,)


def _einsum_path(equation: str, operands: Inputs, cache: dict) -> list | bool:
    """The contraction path for these operand shapes, searched once per shape combination."""
    key = tuple(op.shape for op in operands)
    path = cache.get(key)
    if path is None:
        path = np.einsum_path(equation, *operands, optimize=True)[0] if len(operands) > 1 else False
        cache[key] = path
    return path


@kernel("Einsum", since=12)
def einsum(inputs: Inputs, attrs: Attrs) -> Outputs:
    cache = attrs.cache
    eq = cache.get("equation")
    if eq is None:
        eq = cache["equation"] = "".join(attrs["equation"].split())
        if not eq:
            raise ValueError("Einsum needs a non-empty equation")
    dt = inputs[0].dtype
    ops = [x.astype(_F32) for x in inputs] if _low_precision(dt) else inputs
    path = _einsum_path(eq, ops, cache.setdefault("paths", {}))
    y = np.einsum(eq, *ops, optimize=path)
    if not isinstance(y, np.ndarray) or y.dtype != dt:
        y = np.asarray(y).astype(dt, copy=False)
    return (y,)

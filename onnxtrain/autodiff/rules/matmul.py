"""Gradient rules of MatMul, Gemm, Einsum and Det (same names as engine/kernels/matmul.py)."""

from __future__ import annotations

import string

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient


def _swap_last2(g: GradCtx, name: str, rank: int) -> str:
    """Transpose of the last two axes."""
    return g.emit("Transpose", name, perm=[*range(rank - 2), rank - 1, rank - 2])


@gradient("MatMul", uses=("x0", "x1"))
def matmul_grad(g: GradCtx) -> None:
    # Y = A·B (numpy semantics):  dA = dY·Bᵀ, dB = Aᵀ·dY on the last two axes, batch axes unbroadcast.
    # A 1-D A is (1, K) and a 1-D B is (K, 1), the unit axis removed from Y: it is put back on dY.
    ra, rb = g.rank(0), g.rank(1)
    if ra is None and rb == 2:
        _matrix_weight_grads(g)
        return
    if ra is None or rb is None:
        _any_rank_grads(g)
        return
    dy = g.dy(0)
    if ra == 1 and rb == 1:  # dot product: Y is a scalar
        for i in (0, 1):
            if g.needs_dx(i):
                g.set_dx(i, g.emit("Mul", dy, g.x(1 - i)))
        return
    if ra == 2 and rb == 2:  # plain matrices: Gemm does the transposes
        if g.needs_dx(0):
            g.set_dx(0, g.emit("Gemm", dy, g.x(1), transB=1))
        if g.needs_dx(1):
            g.set_dx(1, g.emit("Gemm", g.x(0), dy, transA=1))
        return
    r = max(ra, rb)  # rank of dY once the unit axes of 1-D operands are back
    if ra == 1:
        dy = g.emit("Unsqueeze", dy, g.ints([-2]))
    if rb == 1:
        dy = g.emit("Unsqueeze", dy, g.ints([-1]))
    if g.needs_dx(0):
        # dA = dY·Bᵀ; for a 1-D B, Bᵀ is the row (1, K)
        bt = g.emit("Unsqueeze", g.x(1), g.ints([0])) if rb == 1 else _swap_last2(g, g.x(1), rb)
        da = g.emit("MatMul", dy, bt)  # (..., M, K)
        if ra == 1:  # (..., 1, K) -> (K,)
            g.set_dx(0, g.reduce("ReduceSum", da, list(range(r - 1)), keepdims=0))
        else:
            g.set_dx(0, _unbroadcast_batch(g, da, 0, r))
    if g.needs_dx(1) and ra > 2 and rb == 2 and _weight_grad_as_gemm(g):
        return
    if g.needs_dx(1):
        # dB = Aᵀ·dY; for a 1-D A, Aᵀ is the column (K, 1)
        at = g.emit("Unsqueeze", g.x(0), g.ints([1])) if ra == 1 else _swap_last2(g, g.x(0), ra)
        db = g.emit("MatMul", at, dy)  # (..., K, N)
        if rb == 1:  # (..., K, 1) -> (K,)
            g.set_dx(1, g.reduce("ReduceSum", db, [*range(r - 2), r - 1], keepdims=0))
        else:
            g.set_dx(1, _unbroadcast_batch(g, db, 1, r))


def _matrix_weight_grads(g: GradCtx) -> None:
    """A[..., K] · B[K, N] where A's rank is unknown (e.g. rows picked by ``Gather`` with the indices of a
    ``Squeeze`` without axes of ``NonZero``'s output, torch's ``x[mask.nonzero().squeeze()]``): no axis of A
    is broadcast against B, so dA = dY·Bᵀ for any rank of A (a 1-D A too: dY is then (N,)), and
    dB = Aᵀ·dY over A and dY flattened to (ΣM, K) and (ΣM, N) (a 1-D A is one row)."""
    if g.needs_dx(0):
        g.set_dx(0, g.emit("MatMul", g.dy(0), g.emit("Transpose", g.x(1), perm=[1, 0])))
    if g.needs_dx(1) and not _weight_grad_as_gemm(g):  # B's K and N known at run time only
        shape = g.shape(1)
        minus1 = g.ints([-1])
        k = g.emit("Concat", minus1, g.emit("Slice", shape, g.ints([0]), g.ints([1])), axis=0)
        n = g.emit("Concat", minus1, g.emit("Slice", shape, g.ints([1]), g.ints([2])), axis=0)
        a2 = g.emit("Reshape", g.x(0), k)
        dy2 = g.emit("Reshape", g.dy(0), n)
        g.set_dx(1, g.emit("Gemm", a2, dy2, transA=1))


def _any_rank_grads(g: GradCtx) -> None:
    """MatMul gradients when shape inference knows the rank of one operand or neither (onnxruntime builds
    them so): the ranks are read at run time. As MatMul reads them, a 1-D A is the row (1, K) and a 1-D B
    the column (K, 1), each put back on dY; then dA = dY·Bᵀ and dB = Aᵀ·dY, summed over the batch axes the
    operand was broadcast along, and reshaped to the operand's shape."""
    sa, sb = g.shape(0), g.shape(1)
    sa2 = g.emit("Concat", _unit_dims(g, sa), sa, axis=0)  # a 1-D A as (1, K)
    sb2 = g.emit("Concat", sb, _unit_dims(g, sb), axis=0)  # a 1-D B as (K, 1)
    a2 = g.emit("Reshape", g.x(0), sa2, allowzero=1)
    b2 = g.emit("Reshape", g.x(1), sb2, allowzero=1)
    # dY of the product of a2 and b2: dY's batch axes, then M (of a2) and N (of b2)
    n_batch = g.emit("Sub", g.emit("Max", g.emit("Size", sa2), g.emit("Size", sb2)), g.int64(2))
    batch = g.emit("Slice", g.emit("Shape", g.dy(0)), g.ints([0]), g.emit("Reshape", n_batch, g.ints([1])))
    m = g.emit("Slice", sa2, g.ints([-2]), g.ints([-1]))
    n = g.emit("Slice", sb2, g.ints([-1]), g.ints([2**62]))
    sy2 = g.emit("Concat", batch, m, n, axis=0)
    dy2 = g.emit("Reshape", g.dy(0), sy2, allowzero=1)
    if g.needs_dx(0):
        da = g.emit("MatMul", dy2, _swap_last2_any_rank(g, b2, sb2))
        g.set_dx(0, g.emit("Reshape", _sum_to_shape(g, da, sa2), sa, allowzero=1))
    if g.needs_dx(1):
        db = g.emit("MatMul", _swap_last2_any_rank(g, a2, sa2), dy2)
        g.set_dx(1, g.emit("Reshape", _sum_to_shape(g, db, sb2), sb, allowzero=1))


def _unit_dims(g: GradCtx, shape: str) -> str:
    """The 1s that make ``shape`` two long: [1, 1] for a scalar's, [1] for a vector's, none otherwise."""
    short = g.emit("Max", g.emit("Sub", g.ints([2]), g.emit("Size", shape)), g.ints([0]))
    return g.emit("ConstantOfShape", short, value=numpy_helper.from_array(np.ones(1, dtype=np.int64)))


def _swap_last2_any_rank(g: GradCtx, x: str, shape: str) -> str:
    """``x`` (of ``shape``, rank 2 or more, known at run time only) with its last two axes swapped: viewed as
    (batch, R, C), transposed, viewed back."""
    end = g.ints([2**62])
    batch = g.emit("ReduceProd", g.emit("Slice", shape, g.ints([0]), g.ints([-2])), keepdims=1)
    rows, cols = g.emit("Slice", shape, g.ints([-2]), g.ints([-1])), g.emit("Slice", shape, g.ints([-1]), end)
    flat = g.emit("Reshape", x, g.emit("Concat", batch, rows, cols, axis=0), allowzero=1)
    back = g.emit("Concat", g.emit("Slice", shape, g.ints([0]), g.ints([-2])), cols, rows, axis=0)
    return g.emit("Reshape", g.emit("Transpose", flat, perm=[0, 2, 1]), back, allowzero=1)


def _sum_to_shape(g: GradCtx, grad: str, shape: str) -> str:
    """``grad`` summed over the axes along which a value of ``shape`` (no longer than grad's) was broadcast
    to grad's shape, keeping them: ``shape`` left-padded with 1s, the axes where it differs from grad's."""
    sg = g.emit("Shape", grad)
    n_pad = g.emit("Reshape", g.emit("Sub", g.emit("Size", sg), g.emit("Size", shape)), g.ints([1]))
    pad = g.emit("ConstantOfShape", n_pad, value=numpy_helper.from_array(np.ones(1, dtype=np.int64)))
    differ = g.emit("Not", g.emit("Equal", g.emit("Concat", pad, shape, axis=0), sg))
    axes = g.emit("Reshape", g.emit("NonZero", differ), g.ints([-1]))
    return g.emit("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)


def _weight_grad_as_gemm(g: GradCtx) -> bool:
    """dB of A[..., K] · B[K, N] as one GEMM over the flattened batch, Aᵀ[K, ΣM] · dY[ΣM, N], instead of a
    batch of products and a ReduceSum (a runtime runs that as many small GEMMs). Needs K and N."""
    kn = g.static_shape(1)
    if kn is None or len(kn) != 2 or not all(isinstance(d, int) and d > 0 for d in kn):
        return False
    k, n = kn
    a2 = g.emit("Reshape", g.x(0), g.ints([-1, k]))
    dy2 = g.emit("Reshape", g.dy(0), g.ints([-1, n]))
    g.set_dx(1, g.emit("Gemm", a2, dy2, transA=1))
    return True


def _unbroadcast_batch(g: GradCtx, grad: str, i: int, r: int) -> str:
    """``grad`` (rank ``r``, batch axes of Y) summed to input ``i``'s batch shape; a no-op when they agree."""
    xs, ys = g.static_shape(i), g.static_shape(0, output=True)
    if (xs is not None and ys is not None and len(xs) == r and len(ys) == r
            and all(a is not None and a == b for a, b in zip(xs[:-2], ys[:-2]))):
        return grad
    return g.unbroadcast(grad, i, grad_rank=r)


@gradient("Gemm", uses=("x0", "x1"))
def gemm_grad(g: GradCtx) -> None:
    # Y = alpha·op(A)·op(B) + beta·C:  d op(A) = alpha·dY·op(B)ᵀ, d op(B) = alpha·op(A)ᵀ·dY,
    # dC = beta·dY unbroadcast. The transposes and alpha go into the Gemm attributes.
    ta, tb = g.attr("transA"), g.attr("transB")
    alpha, beta = g.attr("alpha"), g.attr("beta")
    dy = g.dy(0)
    a = None if alpha == 1.0 else alpha
    if g.needs_dx(0):
        if ta:  # A is (K, M): dA = alpha·op(B)·dYᵀ
            g.set_dx(0, g.emit("Gemm", g.x(1), dy, transA=tb, transB=1, alpha=a))
        else:  # dA = alpha·dY·op(B)ᵀ
            g.set_dx(0, g.emit("Gemm", dy, g.x(1), transA=0, transB=1 - tb, alpha=a))
    if g.needs_dx(1):
        if tb:  # B is (N, K): dB = alpha·dYᵀ·op(A)
            g.set_dx(1, g.emit("Gemm", dy, g.x(0), transA=1, transB=ta, alpha=a))
        else:  # dB = alpha·op(A)ᵀ·dY
            g.set_dx(1, g.emit("Gemm", g.x(0), dy, transA=1 - ta, transB=0, alpha=a))
    if g.has_x(2) and g.needs_dx(2):
        dc = dy if beta == 1.0 else g.emit("Mul", dy, g.const(beta))
        g.set_dx(2, g.unbroadcast(dc, 2, grad_rank=2))


# ---------------------------------------------------------------- Einsum


class _Letters:
    """Fresh subscript letters not used by the equation."""

    def __init__(self, used: str):
        self.free = [c for c in string.ascii_letters if c not in used]

    def __call__(self) -> str:
        if not self.free:
            raise RuleError("Einsum gradient ran out of subscript letters")
        return self.free.pop(0)


def _parse_einsum(g: GradCtx, equation: str) -> tuple[list[str], str, _Letters]:
    """Explicit subscripts of every operand and of the output, '...' replaced by letters.

    The ellipsis axes are right-aligned across operands (numpy broadcasting); an operand's axis of
    size 1 that broadcasts against a larger one gets a letter of its own, so it is summed (not
    matched) in the gradient.
    """
    eq = equation.replace(" ", "")
    lhs, arrow, out = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != g.n_inputs:
        raise RuleError(f"Einsum equation {equation!r} names {len(terms)} operands, "
                        f"the node has {g.n_inputs}")
    letters = _Letters(eq)
    if not arrow:  # implicit output: '...' then the letters seen once, sorted
        flat = lhs.replace("...", "").replace(",", "")
        out = ("..." if "..." in lhs else "") + "".join(sorted(c for c in set(flat) if flat.count(c) == 1))
    if "..." not in eq:
        return _broadcast_letters(g, terms, out), out, letters
    ell_shapes: list[list[int | None] | None] = []
    for k, t in enumerate(terms):
        if "..." not in t:
            ell_shapes.append(None)
            continue
        s = g.static_shape(k)
        if s is None:
            raise RuleError(f"Einsum '...' needs the rank of operand {k} (shape inference found none)")
        before = t.index("...")  # named axes before and after the ellipsis: its axes are those between
        after = len(t) - 3 - before
        if len(s) < before + after:
            raise RuleError(f"Einsum term {t!r} names {before + after} axes, operand {k} has rank {len(s)}")
        ell_shapes.append(s[before: len(s) - after])
    width = max(len(s) for s in ell_shapes if s is not None)
    base = [letters() for _ in range(width)]
    sizes = [[s[p - width + len(s)] for s in ell_shapes if s is not None and p - width + len(s) >= 0]
             for p in range(width)]
    if "..." in out:  # ONNX's inference gives the output the first operand's static 1 there, too
        for p, found in enumerate(sizes):
            if found and found[0] == 1 and None in found[1:]:
                raise RuleError(f"Einsum '...' axis {p - width} has size 1 in its first operand and a size "
                                "not known before the run in another: " + _BROADCAST_WAY_OUT)
    new_terms = []
    for t, s in zip(terms, ell_shapes):
        if s is None:
            new_terms.append(t)
            continue
        sub = []
        for q, d in enumerate(s):
            p = width - len(s) + q
            broadcast = d == 1 and any(e != 1 for e in sizes[p])
            sub.append(letters() if broadcast else base[p])
        new_terms.append(t.replace("...", "".join(sub)))
    out = out.replace("...", "".join(base))
    return _broadcast_letters(g, new_terms, out), out, letters


_BROADCAST_WAY_OUT = ("a broadcast ONNX's shape inference does not follow, so the gradient graph would be "
                      "wrong; expand the operand to the other's size first (torch: .expand)")


def _broadcast_letters(g: GradCtx, terms: list[str], out: str) -> list[str]:
    """``terms`` as they are, unless a named axis of size 1 broadcasts against the same letter's larger
    size in another operand ("bij,bjk" of shapes (1, 3, 4) and (2, 4, 5)), or the first operand with an
    output letter has a static 1 there and another operand a size not known here: numpy and onnxruntime
    run it, but ONNX's shape inference (which the gradient's other rules read) takes the first operand's
    size for the output, so the gradient would be wrong; a RuleError names the letter and the way out."""
    shapes = [g.static_shape(k) for k in range(len(terms))]
    sizes: dict[str, list[int | None]] = {}
    for t, s in zip(terms, shapes):
        for p, c in enumerate(t):
            sizes.setdefault(c, []).append(s[p] if s is not None and p < len(s) else None)
    for c, found in sizes.items():
        known = {e for e in found if isinstance(e, int)}
        if 1 in known and len(known) > 1:
            raise RuleError(f"Einsum subscript {c!r} has size 1 in one operand and {max(known)} in another: "
                            + _BROADCAST_WAY_OUT)
        if c in out and found[0] == 1 and None in found[1:]:
            raise RuleError(f"Einsum subscript {c!r} has size 1 in its first operand and a size not known "
                            "before the run in another: " + _BROADCAST_WAY_OUT)
    return terms


@gradient("Einsum", uses=("x*",))
def einsum_grad(g: GradCtx) -> None:
    # operand i: Einsum(dY, other operands) with equation "out,others->sub_i"; letters summed away
    # from operand i alone come back with Unsqueeze + Expand; a letter repeated within operand i (a
    # diagonal) is renamed and tied to the original by an identity matrix, which puts the gradient
    # on the diagonal.
    terms, out, letters = _parse_einsum(g, g.attr("equation"))
    for i, sub in enumerate(terms):
        if not g.needs_dx(i):
            continue
        names = [g.x(j) for j in range(len(terms)) if j != i]
        subs = [t for j, t in enumerate(terms) if j != i]
        own: list[str] = []
        for pos, c in enumerate(sub):
            if c in own:
                n = (g.static_shape(i) or [None] * len(sub))[pos]
                c2 = letters()
                names.append(g.const(np.eye(n)) if n is not None else _eye_of_axis(g, i, pos))
                subs.append(c + c2)
                c = c2
            own.append(c)
        avail = set(out).union(*subs)
        target = "".join(c for c in own if c in avail)
        missing = [p for p, c in enumerate(own) if c not in avail]
        if not subs and target == out:
            grad = g.dy(0)
        else:
            grad = g.emit("Einsum", g.dy(0), *names, equation=f"{out},{','.join(subs)}->{target}"
                          if subs else f"{out}->{target}")
        if missing:
            grad = g.emit("Unsqueeze", grad, g.ints(missing))
            shape = g.static_shape(i)
            if shape is None or any(shape[p] != 1 for p in missing):
                grad = g.emit("Expand", grad, g.shape(i))
        if _may_broadcast(g, i, terms):  # a 1 matched to a larger size, in this operand (summed) or in
            # another (expanded to this one's size), found at run time
            grad = g.unbroadcast_at_run_time(g.emit("Expand", grad, g.shape(i)), i)
        g.set_dx(i, grad)


def _eye_of_axis(g: GradCtx, i: int, axis: int) -> str:
    """An identity matrix as large as axis ``axis`` of operand ``i`` is at run time."""
    n = g.emit("Gather", g.shape(i), g.ints([axis]), axis=0)
    zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(g.dtype)))
    return g.emit("EyeLike", g.emit("ConstantOfShape", g.emit("Concat", n, n, axis=0), value=zero))


def _may_broadcast(g: GradCtx, i: int, terms: list[str]) -> bool:
    """Whether a letter of operand ``i`` is shared with another operand and its size is not known here on one
    of them: numpy's broadcasting may match a 1 to a larger size there, found at run time (static sizes had
    their letters split, or were refused, by the parse)."""
    sizes: dict[str, list[tuple[int, int | None]]] = {}
    for j, t in enumerate(terms):
        shape = g.static_shape(j)
        for p, c in enumerate(t):
            sizes.setdefault(c, []).append((j, None if shape is None or p >= len(shape) else shape[p]))
    for c in set(terms[i]):
        found = sizes[c]
        if any(j != i for j, _ in found) and any(d is None for _, d in found):
            return True
    return False


@gradient("Det", uses=("x0",))
def det_grad(g: GradCtx) -> None:
    # Y = det(X):  dX = dY·cof(X), the cofactor matrix cof(X)[i, j] = (−1)^(i+j)·det(X without row i and
    # column j), which equals det(X)·inv(X)ᵀ where X is invertible and stays right where it is not.
    # The n² minors come from two Gathers of X and one batched Det (n must be static)
    xs = g.static_shape(0)
    if xs is None or len(xs) < 2 or xs[-1] is None:
        raise RuleError("Det gradient needs the rank and the static matrix size of its input")
    r, n = len(xs), int(xs[-1])  # type: ignore[arg-type]
    dy = g.emit("Unsqueeze", g.dy(0), g.ints([-2, -1]))  # (..., 1, 1)
    if n <= 1:  # d det/dX is 1 for 1×1 matrices; 0×0 ones (det 1) have an empty gradient
        g.set_dx(0, g.emit("Expand", dy, g.shape(0)))
        return
    keep = np.array([[k for k in range(n) if k != i] for i in range(n)], np.int64)  # (n, n − 1)
    idx = g.const(keep, TensorProto.INT64)
    rows = g.emit("Gather", g.x(0), idx, axis=r - 2)  # (..., i, n − 1, n)
    minors = g.emit("Gather", rows, idx, axis=r)  # (..., i, n − 1, j, n − 1)
    # (..., i, j, n − 1, n − 1)
    minors = g.emit("Transpose", minors, perm=[*range(r - 2), r - 2, r, r - 1, r + 1])
    sign = np.fromfunction(lambda i, j: (-1.0) ** (i + j), (n, n))
    cof = g.emit("Mul", g.emit("Det", minors), g.const(sign))
    g.set_dx(0, g.emit("Mul", dy, cof))

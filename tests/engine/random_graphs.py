"""A seeded generator of small random ONNX graphs (compositions of common ops) and a checker that runs them on
the numpy engine and on onnxruntime's inference package.

The graphs lean toward what the engine's plan-time passes rewrite (MatMul + Add (+ Relu/Gelu), LayerNorm
chains, softmax + cross-entropy, elementwise clusters, ``Where`` selects, ``Sum``) and toward buffer liveness
and aliasing: values with several consumers, graph outputs read again later, a value listed twice as an
output, outputs that are graph inputs or initializers, Identity/Reshape aliases of inputs and unused branches.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20
FLOAT_TYPES = {np.float32: TensorProto.FLOAT, np.float16: TensorProto.FLOAT16, np.float64: TensorProto.DOUBLE}


@dataclass
class Value:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # a numpy scalar type
    kind: str = "node"  # "input", "init", "node"


@dataclass
class RandomGraph:
    """A built model, the feeds its inputs take (one list per run) and what it is meant to stress."""

    model: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]
    dtype: Any
    notes: list[str] = field(default_factory=list)
    sizes: tuple[int, ...] = ()  # a shape-changing graph's sizes of SIZED dims, run by run

    @property
    def tolerance_dtype(self) -> Any:
        """The narrowest float type the graph computes in (a Cast to float16 rounds a float32 graph's
        values)."""
        half = TensorProto.FLOAT16
        halves = any(n.op_type == "Cast" and n.attribute[0].i == half for n in self.model.graph.node)
        return np.float16 if halves else self.dtype


class _Builder:
    def __init__(self, rng: np.random.Generator, dtype: Any):
        self.rng = rng
        self.dtype = dtype
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[Value] = []
        self.inits: list[tuple[Value, np.ndarray]] = []
        self.values: list[Value] = []
        self.uses: dict[str, int] = {}
        self.feed_makers: dict[str, Any] = {}
        self.n = 0
        self.notes: list[str] = []
        self.big = False
        self.poly = False  # dims of SIZED take another size in each run

    # ---- naming and leaves ----------------------------------------------------------------------------
    def fresh(self, prefix: str = "v") -> str:
        self.n += 1
        return f"{prefix}{self.n}"

    def data(self, shape: tuple[int, ...], dtype: Any, low: float | None = None, high: float | None = None
             ) -> np.ndarray:
        if dtype is np.bool_:
            return np.asarray(self.rng.random(shape) < 0.5)
        a = self.rng.uniform(low, high, shape) if low is not None else self.rng.standard_normal(shape)
        return np.asarray(a).astype(dtype)

    def leaf(self, shape: tuple[int, ...], dtype: Any = None, low: float | None = None,
             high: float | None = None, kind: str | None = None) -> Value:
        """A new graph input (new data each run) or initializer of ``shape``."""
        dtype = dtype or self.dtype
        kind = kind or ("input" if self.rng.random() < 0.5 else "init")
        if self.poly and SIZED in shape:  # a batch-sized value changes size between runs: fed
            kind = "input"
        v = Value(self.fresh("x" if kind == "input" else "w"), tuple(shape), dtype, kind)
        if kind == "input":
            self.inputs.append(v)
            self.feed_makers[v.name] = lambda batch, v=v, lo=low, hi=high: self.data(
                tuple(batch if d == SIZED else d for d in v.shape), v.dtype, lo, hi)
        else:
            self.inits.append((v, self.data(shape, dtype, low, high)))
        self.values.append(v)
        return v

    def const(self, arr: np.ndarray, name: str | None = None) -> str:
        """An initializer holding ``arr`` (axes, shapes, scalars), not offered to other ops."""
        n = name or self.fresh("c")
        if self.rng.random() < 0.5:  # a Constant node (the plan folds it; fusions read folded values only)
            self.nodes.append(helper.make_node("Constant", [], [n], value=numpy_helper.from_array(arr)))
        else:
            self.inits.append((Value(n, arr.shape, arr.dtype.type, "const"), arr))
        return n

    def scalar(self, x: float, dtype: Any = None) -> str:
        return self.const(np.array(x, dtype or self.dtype))

    def node(self, op: str, ins: list[str], shapes: list[tuple[int, ...]], dtypes: list[Any] | None = None,
             offer: bool = True, **attrs: Any) -> list[Value]:
        outs = [Value(self.fresh(), tuple(s), (dtypes[i] if dtypes else self.dtype))
                for i, s in enumerate(shapes)]
        self.nodes.append(helper.make_node(op, ins, [o.name for o in outs], name=self.fresh(op), **attrs))
        for i in ins:
            if i:
                self.uses[i] = self.uses.get(i, 0) + 1
        if offer:
            self.values.extend(outs)
        return outs

    # ---- picking values -------------------------------------------------------------------------------
    def pick(self, dtype: Any = None, min_rank: int = 0, max_rank: int = 4) -> Value:
        dtype = dtype or self.dtype
        cands = [v for v in self.values if v.dtype is dtype and min_rank <= len(v.shape) <= max_rank]
        if not cands or self.rng.random() < 0.12:
            return self.leaf(self.random_shape(max(min_rank, 1), max_rank))
        # lean toward recent values (chains) but also reuse old ones (several consumers)
        if self.rng.random() < 0.6:
            return cands[-1 - int(self.rng.integers(0, min(3, len(cands))))]
        return cands[int(self.rng.integers(0, len(cands)))]

    def random_shape(self, min_rank: int = 1, max_rank: int = 4) -> tuple[int, ...]:
        r = int(self.rng.integers(min_rank, max_rank + 1))
        if self.big:  # past the fused steps' thresholds: pooled scratch, traced slices, split work
            dims = [int(self.rng.choice([1, 2, 3, 7, 16, 33, 64, 130])) for _ in range(r)]
            while np.prod(dims) > 300_000:
                dims[int(np.argmax(dims))] //= 2
        else:
            dims = [int(d) for d in self.rng.integers(1, 6, r)]
        if self.poly:
            dims = [SIZED if self.rng.random() < 0.35 else d for d in dims]
        return tuple(dims)

    def broadcast_partner(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """A shape that broadcasts with ``shape`` (a suffix, some dims 1, sometimes a longer rank)."""
        r = int(self.rng.integers(0, len(shape) + 1))
        s = list(shape[len(shape) - r:])
        for i in range(len(s)):
            if self.rng.random() < 0.3:
                s[i] = 1
        if len(s) == len(shape) and self.rng.random() < 0.15 and len(s) < 4:
            s = [int(self.rng.integers(1, 4))] + s
        return tuple(s)

    def partner(self, a: Value) -> Value:
        """An existing value or a new leaf that broadcasts with ``a``."""
        cands = [v for v in self.values
                 if v.dtype is a.dtype and v is not a and _broadcasts(a.shape, v.shape)]
        r = self.rng.random()
        if r < 0.1:
            return a
        if cands and r < 0.55:
            return cands[int(self.rng.integers(0, len(cands)))]
        return self.leaf(self.broadcast_partner(a.shape), a.dtype)

    # ---- ops -------------------------------------------------------------------------------------------
    def binary(self, op: str | None = None) -> None:
        op = op or ["Add", "Sub", "Mul", "Div", "Add", "Mul"][int(self.rng.integers(0, 6))]
        a = self.pick()
        b = self.partner(a)
        if self.rng.random() < 0.5:
            a, b = b, a
        if op == "Div":
            b = self.positive(b)
        self.node(op, [a.name, b.name], [np.broadcast_shapes(a.shape, b.shape)], [a.dtype])

    def positive(self, v: Value) -> Value:
        """``Sigmoid(v) + 0.5`` (in (0.5, 1.5)) for denominators and bases."""
        if v.kind in ("input", "init") and self.rng.random() < 0.5:
            # a fresh positive leaf of v's shape instead
            return self.leaf(v.shape, v.dtype, 0.5, 2.0)
        s = self.node("Sigmoid", [v.name], [v.shape], [v.dtype])[0]
        return self.node("Add", [s.name, self.scalar(0.5, v.dtype)], [v.shape], [v.dtype])[0]

    def unary(self) -> None:
        ops = ["Relu", "Tanh", "Sigmoid", "Erf", "Gelu", "Identity", "Relu", "Sqrt", "Pow", "Neg", "Abs",
               "Exp"]
        op = ops[int(self.rng.integers(0, len(ops)))]
        a = self.pick()
        if op == "Gelu":
            approx = "tanh" if self.rng.random() < 0.4 else "none"
            self.node("Gelu", [a.name], [a.shape], [a.dtype], approximate=approx)
        elif op == "Sqrt":
            p = self.positive(a)
            self.node("Sqrt", [p.name], [p.shape], [p.dtype])
        elif op == "Pow":
            if self.rng.random() < 0.5:
                e = self.scalar(float(self.rng.choice([2.0, 3.0, 0.5, -1.0, 1.0])), a.dtype)
                base = a if self.const_of(e) in (2.0, 3.0, 1.0) else self.positive(a)
                self.node("Pow", [base.name, e], [base.shape], [a.dtype])
            else:
                base = self.positive(a)
                e = self.leaf(self.broadcast_partner(a.shape), a.dtype, -1.5, 2.0)
                self.node("Pow", [base.name, e.name], [np.broadcast_shapes(base.shape, e.shape)], [a.dtype])
        elif op == "Exp":
            t = self.node("Tanh", [a.name], [a.shape], [a.dtype])[0]
            self.node("Exp", [t.name], [a.shape], [a.dtype])
        else:
            self.node(op, [a.name], [a.shape], [a.dtype])

    def const_of(self, name: str) -> float | None:
        for v, arr in self.inits:
            if v.name == name:
                return float(arr)
        for n in self.nodes:
            if n.op_type == "Constant" and n.output[0] == name:
                return float(numpy_helper.to_array(n.attribute[0].t))
        return None

    def matmul(self, with_bias: bool | None = None) -> None:
        a = self.pick(min_rank=1)
        k = a.shape[-1]
        n = int(self.rng.integers(1, 6 if self.poly else 7))
        if len(a.shape) >= 3 and self.rng.random() < 0.3:
            bshape = (*(1 if self.rng.random() < 0.3 else d for d in a.shape[-3:-2]), k, n)
        else:
            bshape = (k, n)
        cands = [v for v in self.values if v.dtype is a.dtype and len(v.shape) >= 2 and v.shape[-2] == k
                 and _broadcasts(a.shape[:-2], v.shape[:-2])]
        if cands and self.rng.random() < 0.4:
            b = cands[int(self.rng.integers(0, len(cands)))]
        else:
            b = self.leaf(bshape, a.dtype, kind="init" if self.rng.random() < 0.7 else "input")
        if len(a.shape) == 1:
            oshape = (*b.shape[:-2], b.shape[-1])
        else:
            oshape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
        y = self.node("MatMul", [a.name, b.name], [oshape], [a.dtype])[0]
        if with_bias is None:
            with_bias = self.rng.random() < 0.6
        if with_bias:
            bshape = (oshape[-1],) if self.rng.random() < 0.7 else self.broadcast_partner(oshape)
            bias = self.leaf(bshape, a.dtype, kind="init")
            args = [y.name, bias.name] if self.rng.random() < 0.7 else [bias.name, y.name]
            y = self.node("Add", args, [np.broadcast_shapes(oshape, bias.shape)], [a.dtype])[0]
            r = self.rng.random()
            if r < 0.35:
                self.node("Relu", [y.name], [y.shape], [a.dtype])
            elif r < 0.6:
                self.node("Gelu", [y.name], [y.shape], [a.dtype],
                          approximate="tanh" if self.rng.random() < 0.3 else "none")

    def gemm(self) -> None:
        a = self.pick(min_rank=2, max_rank=2)
        m, k = a.shape
        n = int(self.rng.integers(1, 7))
        ta, tb = int(self.rng.random() < 0.3), int(self.rng.random() < 0.4)
        if ta:
            a = self.node("Transpose", [a.name], [(k, m)], [a.dtype], perm=[1, 0])[0]
        b = self.leaf((n, k) if tb else (k, n), a.dtype, kind="init" if self.rng.random() < 0.7 else "input")
        ins = [a.name, b.name]
        attrs: dict[str, Any] = {"transA": ta, "transB": tb}
        if self.rng.random() < 0.7:
            cshape = [(n,), (1, n), (m, n), (m, 1), ()][int(self.rng.integers(0, 5))]
            c = self.leaf(cshape, a.dtype, kind="init")
            ins.append(c.name)
            if self.rng.random() < 0.3:
                attrs["beta"] = float(self.rng.choice([0.5, 2.0, 0.0]))
        if self.rng.random() < 0.3:
            attrs["alpha"] = float(self.rng.choice([0.5, 2.0, -1.0]))
        y = self.node("Gemm", ins, [(m, n)], [a.dtype], **attrs)[0]
        if self.rng.random() < 0.4:
            self.node("Relu", [y.name], [y.shape], [a.dtype])

    def softmax(self) -> None:
        a = self.pick(min_rank=1)
        axis = int(self.rng.integers(-len(a.shape), len(a.shape)))
        op = "Softmax" if self.rng.random() < 0.55 else "LogSoftmax"
        if op == "Softmax" and self.rng.random() < 0.3:  # masked softmax
            mask = self.leaf(self.broadcast_partner(a.shape), np.bool_)
            ninf = self.scalar(-np.inf, a.dtype)
            args = [mask.name, ninf, a.name] if self.rng.random() < 0.5 else [mask.name, a.name, ninf]
            a = self.node("Where", args, [np.broadcast_shapes(a.shape, mask.shape)], [a.dtype])[0]
        y = self.node(op, [a.name], [a.shape], [a.dtype], axis=axis)[0]
        if op == "LogSoftmax" and self.rng.random() < 0.6:  # cross-entropy with a one-hot/soft target
            t = self.leaf(y.shape, a.dtype, 0.0, 1.0)
            p = self.node("Mul", [y.name, t.name], [y.shape], [a.dtype])[0]
            ax = self.const(np.array([axis], np.int64))
            kd = int(self.rng.random() < 0.5)
            sh = _reduced(y.shape, [axis], kd)
            s = self.node("ReduceSum", [p.name, ax], [sh], [a.dtype], keepdims=kd)[0]
            self.node("Neg", [s.name], [sh], [a.dtype])
        elif (op == "LogSoftmax" and self.rng.random() < 0.5 and len(a.shape) == 2
              and a.dtype is not np.float16 and SIZED not in a.shape):
            n, c = a.shape
            labels = self.leaf((n,), np.int64, kind="init")
            labels.kind = "const"  # (not overridable: the feeds' random values are no class indices)
            self.inits[-1] = (labels, self.rng.integers(0, c, n).astype(np.int64))
            red = ["mean", "sum", "none"][int(self.rng.integers(0, 3))]
            self.node("NegativeLogLikelihoodLoss", [y.name, labels.name], [(n,) if red == "none" else ()],
                      [a.dtype], reduction=red)

    def layernorm(self) -> None:
        a = self.pick(min_rank=1)
        axis = int(self.rng.integers(-len(a.shape), len(a.shape)))
        norm = a.shape[axis:]
        if not all(norm):  # (normalizing nothing: refused by onnxruntime and here)
            return
        if self.rng.random() < 0.5:
            scale = self.leaf(norm, a.dtype, kind="init")
            ins = [a.name, scale.name]
            if self.rng.random() < 0.7:
                ins.append(self.leaf(norm, a.dtype, kind="init").name)
            self.node("LayerNormalization", ins, [a.shape], [a.dtype], axis=axis,
                      epsilon=float(self.rng.choice([1e-5, 1e-3, 0.1])))
            return
        if not all(a.shape):
            return
        # the primitive chain torch exports: mean, centre, variance, rsqrt
        axes = self.const(np.array(list(range(axis % len(a.shape), len(a.shape))), np.int64))
        kshape = _reduced(a.shape, list(range(axis % len(a.shape), len(a.shape))), 1)
        mu = self.node("ReduceMean", [a.name, axes], [kshape], [a.dtype])[0]
        d = self.node("Sub", [a.name, mu.name], [a.shape], [a.dtype])[0]
        if self.rng.random() < 0.5:
            sq = self.node("Mul", [d.name, d.name], [a.shape], [a.dtype])[0]
        else:
            sq = self.node("Pow", [d.name, self.scalar(2.0, a.dtype)], [a.shape], [a.dtype])[0]
        var = self.node("ReduceMean", [sq.name, axes], [kshape], [a.dtype])[0]
        ve = self.node("Add", [var.name, self.scalar(1e-3, a.dtype)], [kshape], [a.dtype])[0]
        sd = self.node("Sqrt", [ve.name], [kshape], [a.dtype])[0]
        y = self.node("Div", [d.name, sd.name], [a.shape], [a.dtype])[0]
        if self.rng.random() < 0.7:
            g = self.leaf(norm, a.dtype, kind="init")
            y = self.node("Mul", [y.name, g.name], [a.shape], [a.dtype])[0]
            b = self.leaf(norm, a.dtype, kind="init")
            self.node("Add", [y.name, b.name], [a.shape], [a.dtype])

    def reduce(self) -> None:
        a = self.pick(min_rank=1)
        # (a mean over nothing: NaN here as in onnx.reference, 0 in onnxruntime; ONNX leaves it undefined)
        op = ["ReduceSum", "ReduceMean"][int(self.rng.integers(0, 2))] if all(a.shape) else "ReduceSum"
        r = len(a.shape)
        kd = int(self.rng.random() < 0.5)
        if self.rng.random() < 0.15:
            self.node(op, [a.name], [_reduced(a.shape, list(range(r)), kd)], [a.dtype], keepdims=kd)
            return
        if self.rng.random() < 0.3 and r >= 2:  # every axis but 1 (batch-norm statistics)
            axes = [i for i in range(r) if i != 1]
        else:
            k = int(self.rng.integers(1, r + 1))
            axes = sorted(int(x) for x in self.rng.choice(r, k, replace=False))
        if self.rng.random() < 0.3 and op == "ReduceSum":  # sum of a product
            b = self.partner(a)
            if np.broadcast_shapes(a.shape, b.shape) == a.shape:
                a = self.node("Mul", [a.name, b.name], [a.shape], [a.dtype])[0]
        written = [x - r if self.rng.random() < 0.3 else x for x in axes]
        self.node(op, [a.name, self.const(np.array(written, np.int64))], [_reduced(a.shape, axes, kd)],
                  [a.dtype], keepdims=kd)

    def reshape(self) -> None:
        a = self.pick()
        size = int(np.prod(a.shape))
        target = _factor(self.rng, size) if size else [0, *self.random_shape(0, 2)]
        written = list(target)
        if size and self.rng.random() < 0.4:
            written[int(self.rng.integers(0, len(written)))] = -1
        if len(written) == len(a.shape) and self.rng.random() < 0.3:
            i = int(self.rng.integers(0, len(written)))
            if a.shape[i] == target[i] and -1 not in written[i:i + 1]:
                written[i] = 0
        self.node("Reshape", [a.name, self.const(np.array(written, np.int64))], [tuple(target)], [a.dtype],
                  **({} if size else {"allowzero": 1}))

    def transpose(self) -> None:
        a = self.pick(min_rank=2)
        perm = [int(p) for p in self.rng.permutation(len(a.shape))]
        self.node("Transpose", [a.name], [tuple(a.shape[p] for p in perm)], [a.dtype], perm=perm)

    def concat(self) -> None:
        a = self.pick(min_rank=1)
        axis = int(self.rng.integers(0, len(a.shape)))
        parts = [a]
        for _ in range(int(self.rng.integers(1, 3))):
            if self.rng.random() < 0.3:
                parts.append(a if self.rng.random() < 0.5 else parts[-1])
                continue
            cands = [v for v in self.values if v.dtype is a.dtype and len(v.shape) == len(a.shape) and all(
                v.shape[i] == a.shape[i] for i in range(len(a.shape)) if i != axis)]
            if cands and self.rng.random() < 0.5:
                parts.append(cands[int(self.rng.integers(0, len(cands)))])
            else:
                s = list(a.shape)
                s[axis] = int(self.rng.integers(1, 4))
                parts.append(self.leaf(tuple(s), a.dtype))
        out = list(a.shape)
        out[axis] = sum(p.shape[axis] for p in parts)
        y = self.node("Concat", [p.name for p in parts], [tuple(out)], [a.dtype],
                      axis=axis - len(a.shape) if self.rng.random() < 0.3 else axis)[0]
        if self.rng.random() < 0.3:  # a product with the concatenation
            c = self.leaf(y.shape if self.rng.random() < 0.6 else self.broadcast_partner(y.shape), a.dtype)
            self.node("Mul", [y.name, c.name], [np.broadcast_shapes(y.shape, c.shape)], [a.dtype])

    def split(self) -> None:
        a = self.pick(min_rank=1)
        axis = int(self.rng.integers(0, len(a.shape)))
        d = a.shape[axis]
        if d == 0:
            return
        if self.rng.random() < 0.5 or d < 2:
            k = int(self.rng.integers(1, min(d, 3) + 1))
            cuts = sorted(int(x) for x in self.rng.choice(np.arange(1, d), k - 1, replace=False))
            sizes = np.diff([0, *cuts, d]).tolist()
            ins = [a.name, self.const(np.array(sizes, np.int64))]
            attrs = {}
        else:
            k = int(self.rng.integers(2, min(d, 3) + 1))
            per = -(-d // k)
            sizes = [per] * (d // per) + ([d % per] if d % per else [])
            ins = [a.name]
            attrs = {"num_outputs": len(sizes)}
        shapes = [tuple(s if i == axis else a.shape[i] for i in range(len(a.shape))) for s in sizes]
        self.node("Split", ins, shapes, [a.dtype] * len(shapes), axis=axis, **attrs)

    def slice(self) -> None:
        a = self.pick(min_rank=1)
        r = len(a.shape)
        k = int(self.rng.integers(1, r + 1))
        axes = [int(x) for x in self.rng.choice(r, k, replace=False)]
        starts, ends, steps, out = [], [], [], list(a.shape)
        for ax in axes:
            d = a.shape[ax]
            step = int(self.rng.choice([1, 1, 1, 2, -1, -2]))
            st = int(self.rng.integers(-d - 1, d + 2))
            en = int(self.rng.integers(-d - 1, d + 2))
            if self.rng.random() < 0.1:
                en = (2**63 - 1) if step > 0 else -(2**63)
            starts.append(st)
            ends.append(en)
            steps.append(step)
            out[ax] = _slice_length(d, st, en, step)
        ins = [a.name, self.const(np.array(starts, np.int64)), self.const(np.array(ends, np.int64)),
               self.const(np.array([x - r if self.rng.random() < 0.3 else x for x in axes], np.int64)),
               self.const(np.array(steps, np.int64))]
        self.node("Slice", ins, [tuple(out)], [a.dtype])

    def unsqueeze(self) -> None:
        a = self.pick(max_rank=3)
        r = len(a.shape) + 1
        ax = int(self.rng.integers(-r, r))
        out = list(a.shape)
        out.insert(ax % r, 1)
        y = self.node("Unsqueeze", [a.name, self.const(np.array([ax], np.int64))], [tuple(out)], [a.dtype])[0]
        if self.rng.random() < 0.4:
            self.node("Squeeze", [y.name, self.const(np.array([ax], np.int64))], [a.shape], [a.dtype])

    def squeeze(self) -> None:
        cands = [v for v in self.values if v.dtype is self.dtype and 1 in v.shape]
        if not cands:
            return self.unsqueeze()
        a = cands[int(self.rng.integers(0, len(cands)))]
        ones = [i for i, d in enumerate(a.shape) if d == 1]
        out = tuple(d for d in a.shape if d != 1)
        if self.rng.random() < 0.3:
            self.node("Squeeze", [a.name], [out], [a.dtype])
        else:
            ax = ones[int(self.rng.integers(0, len(ones)))]
            self.node("Squeeze", [a.name, self.const(np.array([ax], np.int64))],
                      [tuple(d for i, d in enumerate(a.shape) if i != ax)], [a.dtype])

    def cast(self) -> None:
        a = self.pick()
        others = [t for t in (np.float32, np.float64, np.float16) if t is not a.dtype]
        to = others[int(self.rng.integers(0, len(others)))]
        y = self.node("Cast", [a.name], [a.shape], [to], offer=False, to=FLOAT_TYPES[to])[0]
        if self.rng.random() < 0.5:
            op = "Tanh" if self.rng.random() < 0.5 else "Relu"
            y = self.node(op, [y.name], [a.shape], [to], offer=False)[0]
        self.node("Cast", [y.name], [a.shape], [a.dtype], to=FLOAT_TYPES[a.dtype])

    def where(self) -> None:
        a = self.pick()
        b = self.partner(a)
        shape = np.broadcast_shapes(a.shape, b.shape)
        r = self.rng.random()
        if r < 0.3:
            c = self.node("Greater", [a.name, b.name], [shape], [np.bool_], offer=False)[0]
        elif r < 0.5:  # one-element condition (the lazy select)
            c = self.leaf((1,) * int(self.rng.integers(0, 2)), np.bool_, kind="input")
            if self.rng.random() < 0.85:
                y = self.node(["Add", "Sub", "Mul", "Div"][int(self.rng.integers(0, 4))],
                              [a.name, self.positive(b).name], [shape], [a.dtype], offer=False)[0]
                b = y
        elif r < 0.6:  # Where(IsNaN(x), ...)
            x = self.pick()
            c = self.node("IsNaN", [x.name], [x.shape], [np.bool_], offer=False)[0]
            if not _broadcasts(shape, x.shape):
                c = self.node("IsNaN", [a.name], [a.shape], [np.bool_], offer=False)[0]
        else:
            c = self.leaf(self.broadcast_partner(shape), np.bool_)
        if r >= 0.5 and self.rng.random() < 0.2:  # a select against a zero (a ReLU gradient)
            b = Value(self.scalar(0.0, a.dtype), (), a.dtype)
        out = np.broadcast_shapes(c.shape, a.shape, b.shape)
        args = [c.name, a.name, b.name] if self.rng.random() < 0.5 else [c.name, b.name, a.name]
        self.node("Where", args, [out], [a.dtype])

    def expand(self) -> None:
        a = self.pick(max_rank=3)
        target = list(a.shape)
        for i, d in enumerate(target):
            if d == 1 and self.rng.random() < 0.6:
                target[i] = int(self.rng.integers(1, 5))
        written = [1 if (target[i] == a.shape[i] and self.rng.random() < 0.3) else target[i]
                   for i in range(len(target))]
        if self.rng.random() < 0.4:
            lead = int(self.rng.integers(1, 4))
            target, written = [lead, *target], [lead, *written]
        self.node("Expand", [a.name, self.const(np.array(written, np.int64))], [tuple(target)], [a.dtype])

    def sum_(self) -> None:
        a = self.pick()
        parts, shape = [a], a.shape
        for _ in range(int(self.rng.integers(1, 4))):
            p = self.partner(Value(a.name, shape, a.dtype) if parts[-1] is a else a)
            if _broadcasts(shape, p.shape):
                parts.append(p)
                shape = np.broadcast_shapes(shape, p.shape)
        self.node("Sum", [p.name for p in parts], [shape], [a.dtype])

    def weight_grad(self) -> None:
        """``ReduceSum(MatMul(Transpose(A), B), leading axes)``: a batched MatMul's weight gradient."""
        b_, t, k, n = (int(x) for x in self.rng.integers(1, 5, 4))
        lead = (int(self.rng.integers(1, 4)),) if self.rng.random() < 0.5 else ()
        A = self.leaf((*lead, b_, t, k), kind="input")
        B = self.leaf((*lead, b_, t, n))
        r = len(A.shape)
        perm = [*range(r - 2), r - 1, r - 2]
        At = self.node("Transpose", [A.name], [(*lead, b_, k, t)], perm=perm)[0]
        m = self.node("MatMul", [At.name, B.name], [(*lead, b_, k, n)])[0]
        axes = list(range(r - 2))
        kd = int(self.rng.random() < 0.3)
        self.node("ReduceSum", [m.name, self.const(np.array(axes, np.int64))], [_reduced(m.shape, axes, kd)],
                  keepdims=kd)

    def alias(self) -> None:
        """An Identity or a Reshape of a graph input or an initializer."""
        leaves = [v for v in self.values if v.kind in ("input", "init") and v.dtype is self.dtype]
        if not leaves:
            return self.unary()
        a = leaves[int(self.rng.integers(0, len(leaves)))]
        if self.rng.random() < 0.5 or not all(a.shape):
            self.node("Identity", [a.name], [a.shape], [a.dtype])
        else:
            flat = (int(np.prod(a.shape)),)
            self.node("Reshape", [a.name, self.const(np.array([-1], np.int64))], [flat], [a.dtype])


SIZED = 6  # the dim of a shape-changing graph that takes the run's size (no other dim is 6 there)
# ops whose shape constants would not follow a change of size: left out of shape-changing graphs
FIXED_SHAPE_OPS = frozenset({"reshape", "expand", "split", "slice", "gemm", "alias"})
SIZES = (6, 1, 11, 3)  # the runs' sizes of a shape-changing graph (big ones: BIG_SIZES)
BIG_SIZES = (6, 2, 40)
OPS = [
    ("binary", 14), ("unary", 10), ("matmul", 9), ("gemm", 4), ("softmax", 5), ("layernorm", 5),
    ("reduce", 6), ("reshape", 4), ("transpose", 4), ("concat", 4), ("split", 3), ("slice", 4),
    ("unsqueeze", 3), ("squeeze", 2),
    ("cast", 3), ("where", 5), ("expand", 3), ("sum_", 3), ("weight_grad", 1), ("alias", 3),
]


def random_graph(seed: int, n_runs: int = 3, big: bool | None = None) -> RandomGraph:
    """A random graph of 5 to 25 nodes, its feeds for ``n_runs`` runs; the same seed, the same graph.
    ``big``: values of up to ~300,000 elements (True), small ones (False), either (None: 15% big)."""
    rng = np.random.default_rng(seed)
    r = rng.random()
    dtype = np.float16 if r < 0.1 else np.float64 if r < 0.2 else np.float32
    b = _Builder(rng, dtype)
    b.big = rng.random() < 0.15
    if big is not None:
        b.big = big
    b.poly = rng.random() < 0.3
    ops = [(o, w) for o, w in OPS if not (b.poly and o in FIXED_SHAPE_OPS)]
    names = [o for o, _ in ops]
    weights = np.array([w for _, w in ops], float)
    target = int(rng.integers(5, 26))
    while len(b.nodes) < target:
        getattr(b, names[int(rng.choice(len(names), p=weights / weights.sum()))])()
    produced = [v for v in b.values if v.kind == "node"]
    # outputs: the last value, a few random ones (some read later), now and then a repeat, an input, an init
    outs: list[Value] = [produced[-1]] if produced else []
    for v in produced[:-1]:
        if rng.random() < 0.25:
            outs.append(v)
    leaves = [v for v in b.values if v.kind in ("input", "init")]
    if leaves and rng.random() < 0.15:
        outs.append(leaves[int(rng.integers(0, len(leaves)))])
    if outs and rng.random() < 0.15:
        outs.append(outs[int(rng.integers(0, len(outs)))])
    if not outs:
        outs = [b.values[-1]]
    rng.shuffle(outs)
    # some weights are also graph inputs (overridable initializers), fed in some runs and not others
    overridable = [v for v, _ in b.inits if v.kind == "init" and rng.random() < 0.3]
    model = _model(b, outs, overridable)
    feeds = []
    sizes = (BIG_SIZES if b.big else SIZES) if b.poly else (SIZED,)
    for k in range(n_runs):
        f = {n: make(sizes[k % len(sizes)]) for n, make in b.feed_makers.items()}
        for v in overridable:
            if (k + len(v.name)) % 2:
                f[v.name] = b.data(v.shape, v.dtype)
        if k and rng.random() < 0.4:  # one array under two names (where two inputs take the same type)
            same = {}
            for v in b.inputs:
                twin = same.setdefault((f[v.name].shape, v.dtype), v.name)
                if twin != v.name:
                    f[v.name] = f[twin]
        feeds.append(f)
    return RandomGraph(model, feeds, dtype, sizes=sizes if b.poly else ())


def as_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` computing in float64 throughout (float32/float16 inputs, initializers, outputs and Casts
    made float64): a more exact reference for the float32 and float16 graphs' outputs."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    narrow = (TensorProto.FLOAT, TensorProto.FLOAT16)
    for v in [*m.graph.input, *m.graph.output]:
        if v.type.tensor_type.elem_type in narrow:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    for k, t in enumerate(m.graph.initializer):
        if t.data_type in narrow:
            m.graph.initializer[k].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for n in m.graph.node:
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i in narrow:
                a.i = TensorProto.DOUBLE
            elif n.op_type == "Constant" and a.name == "value" and a.t.data_type in narrow:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64)))
    return m


def _model(b: _Builder, outs: list[Value], overridable: list[Value]) -> onnx.ModelProto:
    def tp(dtype: Any) -> int:
        return {np.bool_: TensorProto.BOOL, np.int64: TensorProto.INT64}.get(dtype) or FLOAT_TYPES[dtype]

    used_inputs = b.inputs
    inits = [numpy_helper.from_array(np.asarray(arr), v.name) for v, arr in b.inits]
    g = helper.make_graph(
        b.nodes, "random",
        [helper.make_tensor_value_info(v.name, tp(v.dtype), [
            "B" if b.poly and d == SIZED else d for d in v.shape]) for v in [*used_inputs, *overridable]],
        [helper.make_tensor_value_info(v.name, tp(v.dtype), None) for v in outs],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 10
    return m


def _slice_length(d: int, start: int, end: int, step: int) -> int:
    """The length of ONNX's Slice of a dim of ``d`` (its clamping, not Python's)."""
    start, end = start + d if start < 0 else start, end + d if end < 0 else end
    if step > 0:
        start, end = min(max(start, 0), d), min(max(end, 0), d)
        return max(0, -(-(end - start) // step))
    start, end = min(max(start, 0), d - 1), min(max(end, -1), d - 1)
    return max(0, -(-(start - end) // -step))


def _broadcasts(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    try:
        np.broadcast_shapes(a, b)
    except ValueError:
        return False
    return True


def _reduced(shape: tuple[int, ...], axes: list[int], keepdims: int) -> tuple[int, ...]:
    axes = [a % len(shape) for a in axes] if shape else []
    if keepdims:
        return tuple(1 if i in axes else d for i, d in enumerate(shape))
    return tuple(d for i, d in enumerate(shape) if i not in axes)


def _factor(rng: np.random.Generator, size: int) -> list[int]:
    """A random shape of ``size`` elements, rank 1 to 4."""
    dims: list[int] = []
    rest = size
    for _ in range(int(rng.integers(0, 3))):
        divs = [d for d in range(1, rest + 1) if rest % d == 0]
        d = divs[int(rng.integers(0, len(divs)))]
        dims.append(d)
        rest //= d
    dims.append(rest)
    rng.shuffle(dims)
    return [int(d) for d in dims]


# ---- checking --------------------------------------------------------------------------------------------

def tolerance(dtype: Any) -> tuple[float, float]:
    """(rtol, atol) for outputs of a graph of ``dtype`` computed in another order."""
    return {np.float16: (2e-2, 2e-2), np.float32: (2e-4, 2e-5), np.float64: (1e-10, 1e-12)}.get(dtype, (0, 0))


def compare(got: Any, want: np.ndarray, dtype: Any, what: str, exact: np.ndarray | None = None) -> str | None:
    """None when ``got`` matches onnxruntime's ``want`` (dtype, shape, values within the graph's float
    tolerance, NaNs and infs in the same places), or, when not, is no further from ``exact`` (the float64
    model's output) than ``want`` is; else what differs."""
    got = np.asarray(got)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{what}: {got.dtype}{list(got.shape)} vs onnxruntime's {want.dtype}{list(want.shape)}"
    if want.dtype.kind not in "fc":
        return None if np.array_equal(got, want) else f"{what}: values differ"
    rtol, atol = tolerance(dtype)
    g, w = got.astype(np.float64), want.astype(np.float64)
    if dtype is np.float16:  # a float16 value at the edge of its range rounds to inf one way, not the other
        edge = np.float64(np.finfo(np.float16).max) * (1 - rtol)
        for a, b in ((g, w), (w, g)):
            near = np.isinf(a) & np.isfinite(b) & (np.abs(b) >= edge) & (np.sign(a) == np.sign(b))
            b[near] = a[near]
    finite = np.isfinite(w)
    same_places = np.array_equal(finite, np.isfinite(g))
    if not same_places or not np.array_equal(g[~finite], w[~finite], equal_nan=True):
        return f"{what}: non-finite entries differ"
    if not finite.any():
        return None
    scale = max(1.0, float(np.abs(w[finite]).max()))
    err = np.abs(g[finite] - w[finite])
    bad = err > atol * scale + rtol * np.abs(w[finite])
    if bad.any() and exact is not None and exact.shape == w.shape:
        x = exact.astype(np.float64)[finite]
        ours, theirs = float(np.abs(g[finite] - x).max()), float(np.abs(w[finite] - x).max())
        if ours <= max(2 * theirs, atol * scale):
            return None
        return (f"{what}: max abs error {err.max():.3g} from onnxruntime's, {ours:.3g} from float64's "
                f"(onnxruntime's: {theirs:.3g}; scale {scale:.3g})")
    if bad.any():
        return f"{what}: max abs error {err.max():.3g} (scale {scale:.3g}) at {int(bad.sum())} of {err.size}"
    return None


def _no_further(got: Any, other: Any, exact: Any) -> bool:
    """True when ``got`` is at most 1.5 times as far from ``exact`` as ``other`` is (finite entries)."""
    if exact is None or np.shape(got) != np.shape(exact) or np.shape(other) != np.shape(exact):
        return False
    g, o, x = (np.asarray(a, np.float64) for a in (got, other, exact))
    fin = np.isfinite(g) & np.isfinite(o) & np.isfinite(x)
    if not fin.any() or not np.array_equal(np.isfinite(g), np.isfinite(o)):
        return False
    return float(np.abs(g[fin] - x[fin]).max()) <= 1.5 * float(np.abs(o[fin] - x[fin]).max())


def laid_out(feeds: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """``feeds`` with the same values in other memory layouts: Fortran order, reversed strides, strided views
    of larger buffers, read-only arrays (an array fed under two names stays one array)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    seen: dict[int, np.ndarray] = {}
    for n, a in feeds.items():
        if id(a) in seen:
            out[n] = seen[id(a)]
            continue
        r = rng.random()
        if a.ndim == 0 or r < 0.4:
            b = a
        elif r < 0.55:
            b = np.asfortranarray(a)
        elif r < 0.7:
            b = a[(slice(None, None, -1),) * a.ndim].copy()[(slice(None, None, -1),) * a.ndim]
        elif r < 0.85:
            big = np.empty(tuple(2 * d for d in a.shape), a.dtype)
            b = big[(slice(None, None, 2),) * a.ndim]
            b[...] = a
        else:
            b = a.copy()
            b.flags.writeable = False
        out[n] = seen[id(a)] = b
    return out


def check_graph(rg: RandomGraph, ort_session: Any, runners: dict[str, Any], exact_session: Any = None
                ) -> list[str]:
    """Run ``rg`` through each of ``runners`` (name → function(feeds) → outputs) on every feed, compare with
    ``ort_session``; also that the runs leave the caller's feeds unchanged and earlier outputs intact.
    Returns the problems found."""
    problems: list[str] = []
    names = [o.name for o in rg.model.graph.output]
    for rname, run in runners.items():
        kept: list[tuple[int, list[np.ndarray], list[np.ndarray]]] = []
        for k, feeds in enumerate(rg.feeds):
            want = ort_session.run(None, feeds)
            exact = [None] * len(want)
            if exact_session is not None:
                wide = {n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in feeds.items()}
                # (no float64 reference for this graph when it fails: onnxruntime's outputs alone)
                with contextlib.suppress(Exception):
                    exact = exact_session.run(None, wide)
            feeds = laid_out(feeds, k + len(rname))
            before = {n: a.copy() for n, a in feeds.items()}
            try:
                got = run(feeds)
            except Exception as e:  # noqa: BLE001 - reported as a problem
                problems.append(f"{rname} run {k}: {type(e).__name__}: {str(e)[:300]}")
                break
            for n, a in feeds.items():
                if not np.array_equal(a, before[n], equal_nan=True):
                    problems.append(f"{rname} run {k}: feed {n!r} modified")
            if len(got) != len(want):
                problems.append(f"{rname} run {k}: {len(got)} outputs, onnxruntime {len(want)}")
                continue
            plain = None
            for i, (n, g, w, x) in enumerate(zip(names, got, want, exact)):
                why = compare(g, w, rg.tolerance_dtype, f"{rname} run {k} output {n!r}", x)
                if why and rg.tolerance_dtype is np.float16:
                    # float16 op by op, rounded as the graph says: an ill-conditioned graph (a LayerNorm
                    # chain over values of small variance) amplifies each rounding; no further from float64's
                    # than that is fine
                    if plain is None:
                        plain = [None] * len(want)
                        with contextlib.suppress(Exception):  # (onnx.reference refuses it: no second say)
                            plain = Reference(rg.model).run(None, feeds)
                    p = plain[i]
                    if p is not None and (compare(g, p, rg.tolerance_dtype, why) is None
                                          or _no_further(g, p, x)):
                        why = None
                if why:
                    problems.append(why)
            kept.append((k, list(got), [np.array(g, copy=True) for g in got]))
        for k, got, copies in kept:
            for n, g, c in zip(names, got, copies):
                if not np.array_equal(np.asarray(g), c, equal_nan=True):
                    problems.append(f"{rname}: output {n!r} of run {k} changed by later runs")
    return problems


class Reference:
    """``onnx.reference`` on a model, with Erf and Gelu computed from ``math.erf`` (its own are accurate to
    float32 only: 3e-8 off in float64): for the float64 graphs onnxruntime has no kernel for (Erf), and for
    float16 graphs op by op (onnxruntime's CPU runs float16 ops without a float16 kernel in float32 and keeps
    the values float32 between them)."""

    def __init__(self, model: onnx.ModelProto):
        import math

        from onnx.reference import ReferenceEvaluator
        from onnx.reference.op_run import OpRun

        exact_erf = np.vectorize(math.erf, otypes=[np.float64])

        class Erf(OpRun):
            def _run(self, x):  # type: ignore[no-untyped-def]
                return (exact_erf(x).astype(x.dtype),)

        class Gelu(OpRun):
            def _run(self, x, approximate="none"):  # type: ignore[no-untyped-def]
                w = x.astype(np.float64)
                if approximate == "none":
                    y = 0.5 * w * (1 + exact_erf(w / math.sqrt(2)))
                else:  # the constants of ONNX's function body are float32 attributes
                    c = math.sqrt(float(np.float32(2 / math.pi)))
                    y = 0.5 * w * (1 + np.tanh(c * (w + float(np.float32(0.044715)) * w**3)))
                return (y.astype(x.dtype),)

        self.evaluator = ReferenceEvaluator(model, new_ops=[Erf, Gelu])

    def run(self, names: Any, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import warnings

        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return [np.asarray(x) for x in self.evaluator.run(None, feeds)]


def oracles(rg: RandomGraph) -> tuple[Any, Any] | None:
    """(onnxruntime's session of the graph, a float64 reference of it), or None when onnxruntime refuses
    the graph or a run of it (a float64 graph with an op it has no double kernel for is run by
    :class:`Reference` instead)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    # op by op, as the graph says: onnxruntime's fusions compute a float16 LayerNorm chain in float32
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        main = ort.InferenceSession(rg.model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        for f in rg.feeds:
            main.run(None, f)
    except Exception as e:  # noqa: BLE001
        if rg.dtype is not np.float64 or "NOT_IMPLEMENTED" not in str(e):
            return None
        main = Reference(rg.model)
    wide = as_float64(rg.model)
    try:
        exact: Any = ort.InferenceSession(wide.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001
        exact = Reference(wide)
    return main, exact

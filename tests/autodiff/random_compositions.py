"""Seeded random differentiable ONNX graphs, a small ONNX→torch interpreter for them, and the check of
onnxtrain's gradient graph of each against torch autograd (float64).

``make_case(seed)`` draws a DAG of MatMul, Gemm (transA/transB, alpha, beta, broadcast C), the broadcasting
arithmetic, activations, Softmax and LogSoftmax on any axis, LayerNormalization (its Mean and InvStdDev read
downstream too), reductions (axes as inputs, keepdims 0/1, noop), shape ops (Reshape, Transpose, Concat,
Split, Slice with steps, Gather, Expand), Where, Pow, Max/Min and Clip (ties with each other, with a constant
and with a learnable bound drawn on purpose), ReduceMax over ties, Cast (through float32 too) and Identity,
with fan-out, unused branches, shared initializers, a value read twice by one node, integer side paths
(Shape → Gather → Concat → Reshape/Expand), Slice bounds, Gather indices and Reshape shapes fed as inputs,
symbolic input dims (each its own name, or one name per size), opsets 18, 20 and 21, intermediate and
several outputs and, sometimes, other ys whose incoming gradients are graph inputs. Every fourth seed is
larger (rank-4 leaves, 15-35 steps).

``check_case(case)`` builds the gradient graph (``build_gradient_model``, with ``memory_efficient`` or not,
or ``GradientGraphBuilder``), checks it (``onnx.checker`` full check), runs it in onnxruntime (optimized,
without the optimizations of :data:`ORT_BROKEN`, and not) and onnxtrain's engine, and compares every
gradient with torch autograd of the same computation (the interpreter's forward is checked against
onnxruntime first); ``check_finite_differences`` compares a smooth case with float64 central differences.
``python -m tests.autodiff.random_compositions START COUNT`` sweeps seeds and prints the failures.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import GradientGraphBuilder
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

D, F, I64, BOOL = TensorProto.DOUBLE, TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
_TORCH_TYPES = {D: torch.float64, F: torch.float32, I64: torch.int64, BOOL: torch.bool}
# ops that keep a constant's values: a Max/Min input read from an initializer through them is a bound
_SAME_VALUES = ("Cast", "CastLike", "Identity", "Expand", "Reshape", "Squeeze", "Unsqueeze")


# ---- the interpreter ---------------------------------------------------------------------------------------
def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _take(x: torch.Tensor, axis: int, idx: list[int] | torch.Tensor) -> torch.Tensor:
    return torch.index_select(x, axis, torch.as_tensor(idx, dtype=torch.int64).reshape(-1))


def _extremum(xs: list[torch.Tensor], fixed: list[bool], big: bool) -> torch.Tensor:
    """Max (big) or Min of xs: ties between live inputs split evenly (torch.amax of the stacked inputs);
    a fixed (constant) input is a bound, as torch.clamp takes it."""
    live = [x for x, f in zip(xs, fixed) if not f]
    bounds = [x for x, f in zip(xs, fixed) if f]
    if not live:
        live, bounds = bounds, []
    b = torch.broadcast_tensors(*live)
    st = torch.stack(b)
    y = st.amax(0) if big else st.amin(0)
    for c in bounds:
        y, c = torch.broadcast_tensors(y, c)
        y = torch.clamp(y, min=c) if big else torch.clamp(y, max=c)
    return y


def torch_node(node: onnx.NodeProto, ins: list, fixed: list[bool] | None = None) -> list:
    """The outputs of ``node`` on torch tensors ``ins`` (None for an omitted input)."""
    op, a = node.op_type, _attrs(node)
    x = ins[0] if ins else None
    if op in ("Add", "Sub", "Mul", "Div", "Pow"):
        return [{"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div,
                 "Pow": torch.pow}[op](ins[0], ins[1])]
    if op in ("Relu", "Tanh", "Sigmoid", "Exp", "Log", "Identity"):
        return [{"Relu": torch.relu, "Tanh": torch.tanh, "Sigmoid": torch.sigmoid, "Exp": torch.exp,
                 "Log": torch.log, "Identity": lambda t: t}[op](x)]
    if op == "Sum":
        return [sum(ins[1:], ins[0])]
    if op == "MatMul":
        return [torch.matmul(ins[0], ins[1])]
    if op == "Gemm":
        A = ins[0].T if a.get("transA", 0) else ins[0]
        B = ins[1].T if a.get("transB", 0) else ins[1]
        y = a.get("alpha", 1.0) * (A @ B)
        if len(ins) > 2 and ins[2] is not None:
            y = y + a.get("beta", 1.0) * ins[2]
        return [y]
    if op in ("Softmax", "LogSoftmax"):
        f = torch.softmax if op == "Softmax" else torch.log_softmax
        return [f(x, a.get("axis", -1))]
    if op == "LayerNormalization":
        axis = a.get("axis", -1) % x.dim()
        shape = tuple(x.shape[axis:])
        scale = ins[1].expand(shape)
        bias = ins[2].expand(shape) if len(ins) > 2 and ins[2] is not None else None
        eps = a.get("epsilon", 1e-5)
        y = torch.nn.functional.layer_norm(x, shape, scale, bias, eps)
        if len(node.output) == 1:
            return [y]
        dims = list(range(axis, x.dim()))
        mean = x.mean(dims, keepdim=True)
        inv = 1 / torch.sqrt(((x - mean) ** 2).mean(dims, keepdim=True) + eps)
        stash = _TORCH_TYPES[a.get("stash_type", F)]
        return [y, mean.to(stash), inv.to(stash)]
    if op in ("ReduceSum", "ReduceMean", "ReduceMax"):
        keep = bool(a.get("keepdims", 1))
        axes = ins[1].tolist() if len(ins) > 1 and ins[1] is not None else []
        if not axes:
            if a.get("noop_with_empty_axes", 0):
                return [x]
            axes = list(range(x.dim()))
        axes = sorted({ax % x.dim() for ax in axes})
        if op == "ReduceSum":
            return [torch.sum(x, dim=axes, keepdim=keep)]
        if op == "ReduceMean":
            return [torch.mean(x, dim=axes, keepdim=keep)]
        return [torch.amax(x, dim=axes, keepdim=keep)]
    if op == "Reshape":
        shape = [int(s) for s in ins[1].tolist()]
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
        return [torch.reshape(x, shape)]
    if op == "Transpose":
        return [x.permute(*a.get("perm", list(range(x.dim()))[::-1]))]
    if op == "Concat":
        return [torch.cat(ins, a["axis"])]
    if op == "Split":
        axis = a.get("axis", 0) % x.dim()
        if len(ins) > 1 and ins[1] is not None:
            sizes = [int(s) for s in ins[1].tolist()]
        else:
            n = a["num_outputs"]
            sizes = [x.shape[axis] // n] * n
        return list(torch.split(x, sizes, axis))
    if op == "Slice":
        starts, ends = ins[1].tolist(), ins[2].tolist()
        axes = ins[3].tolist() if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
        steps = ins[4].tolist() if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
        y = x
        for s, e, ax, st in zip(starts, ends, axes, steps):
            ax %= x.dim()
            y = _take(y, ax, list(range(*slice(s, e, st).indices(x.shape[ax]))))
        return [y]
    if op == "Gather":
        axis = a.get("axis", 0) % x.dim()
        idx = ins[1] % x.shape[axis]
        y = _take(x, axis, idx)
        return [y.reshape(tuple(x.shape[:axis]) + tuple(ins[1].shape) + tuple(x.shape[axis + 1:]))]
    if op == "Expand":
        shape = torch.broadcast_shapes(tuple(x.shape), tuple(int(s) for s in ins[1].tolist()))
        return [torch.broadcast_to(x, shape)]
    if op == "Where":
        return [torch.where(ins[0], ins[1], ins[2])]
    if op in ("Max", "Min"):
        return [_extremum(list(ins), fixed or [False] * len(ins), op == "Max")]
    if op == "Clip":
        lo = ins[1] if len(ins) > 1 and ins[1] is not None else None
        hi = ins[2] if len(ins) > 2 and ins[2] is not None else None
        return [torch.clamp(x, lo, hi)]
    if op == "Cast":
        return [x.to(_TORCH_TYPES[a["to"]])]
    if op == "Shape":
        dims = list(x.shape)[a.get("start", 0):a.get("end")]
        return [torch.tensor(dims, dtype=torch.int64)]
    if op == "Greater":
        return [ins[0] > ins[1]]
    raise NotImplementedError(op)


# ---- the generator -----------------------------------------------------------------------------------------
@dataclass
class Case:
    seed: int
    model: onnx.ModelProto
    feeds: dict[str, np.ndarray]
    wrt: list[str]
    other_ys: dict[str, np.ndarray]  # y -> its incoming gradient
    float32: bool  # a value went through float32 (looser tolerance)
    ops: list[str] = field(default_factory=list)
    # build_gradient_model ("build", or "memory_efficient": that option) or GradientGraphBuilder ("builder")
    api: str = "build"


class _Gen:
    """A graph drawn node by node, each value computed (by the interpreter) as it is added, so that the
    next ops can be picked to fit its shape and range."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: dict[str, np.ndarray] = {}
        self.inputs: dict[str, np.ndarray] = {}
        self.vals: dict[str, torch.Tensor] = {}
        self.floats: list[str] = []  # differentiable values, in order of creation
        self.trainable: list[str] = []  # float graph inputs and initializers (wrt candidates)
        self.n = 0
        self.float32 = False
        self.big = seed % 4 == 3  # rank-4 leaves and longer chains

    # names and leaves
    def name(self, p: str) -> str:
        self.n += 1
        return f"{p}{self.n}"

    def shape(self, rank: int | None = None) -> tuple[int, ...]:
        r = self.rng.integers(1, 5 if self.big else 4) if rank is None else rank
        return tuple(int(d) for d in self.rng.integers(1, 5, size=r))

    def leaf(self, shape: tuple[int, ...], kind: str | None = None, low: float = -2.0,
             high: float = 2.0, trainable: bool = True) -> str:
        v = self.rng.uniform(low, high, size=shape)
        kind = kind or ("input" if self.rng.random() < 0.5 else "init")
        nm = self.name("x" if kind == "input" else "w")
        (self.inputs if kind == "input" else self.inits)[nm] = v
        self.vals[nm] = torch.tensor(v)
        if trainable:
            self.trainable.append(nm)
            self.floats.append(nm)
        return nm

    def const(self, value: np.ndarray, p: str = "c") -> str:
        nm = self.name(p)
        self.inits[nm] = np.asarray(value)
        self.vals[nm] = torch.as_tensor(np.asarray(value))
        return nm

    def ints(self, value: np.ndarray, p: str, fed: float = 0.0) -> str:
        """An int64 tensor: a constant, or with probability ``fed`` a graph input (its values, and the
        shapes they give, then known at run time only)."""
        if self.rng.random() >= fed:
            return self.const(np.asarray(value, np.int64), p)
        nm = self.name("i" + p)
        self.inputs[nm] = np.asarray(value, np.int64)
        self.vals[nm] = torch.as_tensor(self.inputs[nm])
        return nm

    def node(self, op: str, ins: list[str], n_out: int = 1, float_out: bool = True, **attrs) -> list[str]:
        outs = [self.name("v") for _ in range(n_out)]
        nd = helper.make_node(op, ins, outs, **attrs)
        # (a Max/Min bound only changes the gradient: the values are the same as without)
        res = torch_node(nd, [self.vals[i] if i else None for i in ins])
        self.nodes.append(nd)
        for o, r in zip(outs, res):
            self.vals[o] = r
            if float_out and r.dtype == torch.float64:
                self.floats.append(o)
        return outs

    # picking values
    def pick(self, pred=None, scalars: bool = False) -> str | None:
        cands = [f for f in self.floats if (scalars or self.vals[f].dim() > 0)
                 and (pred is None or pred(self.vals[f]))]
        if not cands:
            return None
        if self.rng.random() < 0.5:  # recent values: depth
            return cands[-1 - int(self.rng.integers(0, min(3, len(cands))))]
        return cands[int(self.rng.integers(0, len(cands)))]

    def broadcast_partner(self, x: str, low: float = -2.0, high: float = 2.0, pred=None) -> str:
        xs = tuple(self.vals[x].shape)
        r = self.rng.random()
        if r < 0.15 and (pred is None or pred(self.vals[x])):
            return x  # one value read twice by the node
        if r < 0.55:
            cands = []
            for f in self.floats:
                try:
                    torch.broadcast_shapes(xs, tuple(self.vals[f].shape))
                except RuntimeError:
                    continue
                if pred is None or pred(self.vals[f]):
                    cands.append(f)
            if cands:
                return cands[int(self.rng.integers(0, len(cands)))]
        # a fresh leaf of a broadcastable shape (a suffix of x's, some dims 1, or a longer one)
        k = int(self.rng.integers(0, len(xs) + 1))
        shp = [d if self.rng.random() < 0.6 else 1 for d in xs[len(xs) - k:]]
        if self.rng.random() < 0.15:
            shp = [int(self.rng.integers(1, 4))] + list(xs)
        return self.leaf(tuple(shp), low=low, high=high, trainable=self.rng.random() < 0.8)

    # ops
    def step(self) -> None:
        ops = ["binary", "binary", "unary", "unary", "matmul", "gemm", "softmax", "layernorm", "reduce",
               "reshape", "transpose", "concat", "split", "slice", "gather", "expand", "where", "pow",
               "extremum", "clip", "cast", "identity"]
        op = ops[int(self.rng.integers(0, len(ops)))]
        getattr(self, "op_" + op)()

    def op_binary(self) -> None:
        op = ["Add", "Sub", "Mul", "Div"][int(self.rng.integers(0, 4))]
        x = self.pick(scalars=True)
        if op == "Div":
            y = self.broadcast_partner(x, 0.5, 2.0, pred=lambda t: bool(t.abs().min() > 0.3))
            ins = [x, y]
        else:
            y = self.broadcast_partner(x)
            ins = [x, y] if self.rng.random() < 0.5 else [y, x]
        self.node(op, ins)

    def op_unary(self) -> None:
        op = ["Relu", "Tanh", "Sigmoid", "Exp", "Log"][int(self.rng.integers(0, 5))]
        if op == "Exp":
            x = self.pick(lambda t: bool(t.max() < 3))
        elif op == "Log":
            x = self.pick(lambda t: bool(t.min() > 0.05))
            if x is None:
                x = self.node("Sigmoid", [self.pick()])[0]
        else:
            x = self.pick(scalars=True)
        if x is None:
            op, x = "Tanh", self.pick(scalars=True)
        self.node(op, [x])

    def op_matmul(self) -> None:
        x = self.pick()
        xs = tuple(self.vals[x].shape)
        k = xs[-1]
        r = self.rng.random()
        if r < 0.4:
            cands = [f for f in self.floats if self.vals[f].dim() >= 1
                     and (self.vals[f].shape[0] if self.vals[f].dim() == 1 else self.vals[f].shape[-2]) == k]
            ok = []
            for c in cands:
                try:
                    torch.matmul(self.vals[x], self.vals[c])
                    ok.append(c)
                except RuntimeError:
                    pass
            if ok:
                self.node("MatMul", [x, ok[int(self.rng.integers(0, len(ok)))]])
                return
        n = int(self.rng.integers(1, 5))
        shp = [(k,), (k, n), (int(self.rng.integers(1, 3)), k, n)][int(self.rng.integers(0, 3))]
        if len(shp) == 3 and len(xs) > 1:
            shp = (1 if self.rng.random() < 0.5 else shp[0], k, n) if len(xs) == 2 else (
                xs[-3] if self.rng.random() < 0.5 else 1, k, n)
        w = self.leaf(shp)
        self.node("MatMul", [x, w] if self.rng.random() < 0.8 or len(xs) != 1 else [x, w])

    def op_gemm(self) -> None:
        x = self.pick(lambda t: t.dim() == 2)
        if x is None:
            x = self.leaf(self.shape(2))
        ta, tb = int(self.rng.integers(0, 2)), int(self.rng.integers(0, 2))
        m, k = self.vals[x].shape
        if ta:
            m, k = k, m
        n = int(self.rng.integers(1, 5))
        bshape = (n, k) if tb else (k, n)
        b = self.pick(lambda t: tuple(t.shape) == bshape) if self.rng.random() < 0.4 else None
        b = b or self.leaf(bshape)
        ins = [x, b]
        attrs = {"transA": ta, "transB": tb}
        if self.rng.random() < 0.5:
            attrs["alpha"] = float(self.rng.uniform(-1.5, 1.5))
        if self.rng.random() < 0.7:
            cshape = [(n,), (m, n), (1, n), (m, 1), ()][int(self.rng.integers(0, 5))]
            c = self.pick(lambda t: tuple(t.shape) == cshape) if self.rng.random() < 0.3 else None
            ins.append(c or self.leaf(cshape))
            if self.rng.random() < 0.5:
                attrs["beta"] = float(self.rng.uniform(-1.5, 1.5))
        if self.rng.random() < 0.5:
            ins = [x if i == 0 else v for i, v in enumerate(ins)]
        self.node("Gemm", ins, **attrs)

    def axis(self, rank: int) -> int:
        ax = int(self.rng.integers(0, rank))
        return ax - rank if self.rng.random() < 0.4 else ax

    def op_softmax(self) -> None:
        x = self.pick()
        op = "Softmax" if self.rng.random() < 0.5 else "LogSoftmax"
        self.node(op, [x], axis=self.axis(self.vals[x].dim()))

    def op_layernorm(self) -> None:
        x = self.pick()
        ax = self.axis(self.vals[x].dim())
        norm = tuple(self.vals[x].shape[ax % self.vals[x].dim():])
        ins = [x, self.leaf(norm, "init", 0.5, 1.5, trainable=self.rng.random() < 0.7)]
        if self.rng.random() < 0.7:
            ins.append(self.leaf(norm, "init", trainable=self.rng.random() < 0.7))
        eps = float(10.0 ** self.rng.uniform(-6, -1))
        if self.rng.random() < 0.6:
            self.node("LayerNormalization", ins, axis=ax, epsilon=eps)
            return
        # Mean and InvStdDev read downstream too (float32, the only stash_type ONNX allows, cast back)
        outs = self.node("LayerNormalization", ins, n_out=3, axis=ax, epsilon=eps)
        self.float32 = True
        for o in outs[1:]:
            if self.rng.random() < 0.7:
                self.node("Cast", [o], to=D)

    def op_reduce(self) -> None:
        x = self.pick()
        r = self.vals[x].dim()
        op = ["ReduceSum", "ReduceMean", "ReduceMax"][int(self.rng.integers(0, 3))]
        if op == "ReduceMax" and self.rng.random() < 0.3:  # over a value concatenated to itself: ties
            ax = self.axis(r)
            x = self.node("Concat", [x, x], axis=ax)[0]
            axes = self.const(np.array([ax], np.int64), "axes")
            self.node(op, [x, axes], keepdims=int(self.rng.integers(0, 2)))
            return
        ins = [x]
        if self.rng.random() < 0.1:  # no axes, as a noop
            axes = self.const(np.zeros(0, np.int64), "axes")
            self.node(op, [x, axes], keepdims=int(self.rng.integers(0, 2)), noop_with_empty_axes=1)
            return
        if self.rng.random() < 0.8:
            k = int(self.rng.integers(1, r + 1))
            axes = [self.axis(r) for _ in range(k)]
            axes = list({a % r: a for a in axes}.values())
            ins.append(self.const(np.array(axes, np.int64), "axes"))
        self.node(op, ins, keepdims=int(self.rng.integers(0, 2)))

    def shape_path(self, dims: list[int], x: str) -> str:
        """A shape tensor of ``dims`` (entries may be 0 or -1), sometimes read through Shape → Gather → Concat
        of an existing value whose dims give some of its entries."""
        if self.rng.random() < 0.5:
            for src in self.rng.permutation(self.floats):
                sdims = list(self.vals[src].shape)
                pos = [i for i, d in enumerate(dims) if d in sdims and d > 0]
                if not pos:
                    continue
                i = pos[int(self.rng.integers(0, len(pos)))]
                j = sdims.index(dims[i])
                if self.rng.random() < 0.5:
                    sh = self.node("Shape", [str(src)], float_out=False)[0]
                    idx = self.const(np.array([j - len(sdims) if self.rng.random() < 0.3 else j], np.int64),
                                     "idx")
                    g = self.node("Gather", [sh, idx], float_out=False, axis=0)[0]
                else:
                    g = self.node("Shape", [str(src)], float_out=False, start=j, end=j + 1)[0]
                parts = []
                if i > 0:
                    parts.append(self.const(np.array(dims[:i], np.int64), "shp"))
                parts.append(g)
                if i + 1 < len(dims):
                    parts.append(self.const(np.array(dims[i + 1:], np.int64), "shp"))
                if len(parts) == 1:
                    return g
                return self.node("Concat", parts, float_out=False, axis=0)[0]
        return self.const(np.array(dims, np.int64), "shape")

    def op_reshape(self) -> None:
        x = self.pick(scalars=True)
        xs = list(self.vals[x].shape)
        total = int(np.prod(xs))
        divs = [d for d in range(1, total + 1) if total % d == 0]
        rank = int(self.rng.integers(1, 4))
        dims, rest = [], total
        for _ in range(rank - 1):
            d = int(self.rng.choice([d for d in divs if rest % d == 0]))
            dims.append(d)
            rest //= d
        dims.append(rest)
        self.rng.shuffle(dims)
        dims = [int(d) for d in dims]
        if self.rng.random() < 0.4:
            dims[int(self.rng.integers(0, len(dims)))] = -1
        zeros = [i for i, d in enumerate(dims) if i < len(xs) and d == xs[i]]
        if zeros and self.rng.random() < 0.4:
            dims[zeros[0]] = 0
        if self.rng.random() < 0.3:
            shape = self.ints(np.array(dims), "shape", 0.5)
        else:
            shape = self.shape_path(dims, x)
        self.node("Reshape", [x, shape])

    def op_transpose(self) -> None:
        x = self.pick()
        perm = [int(p) for p in self.rng.permutation(self.vals[x].dim())]
        self.node("Transpose", [x], perm=perm)

    def op_concat(self) -> None:
        x = self.pick()
        xs = list(self.vals[x].shape)
        ax = self.axis(len(xs))
        ins = [x]
        for _ in range(int(self.rng.integers(1, 3))):
            r = self.rng.random()
            if r < 0.25:
                ins.append(x)
                continue
            cands = [f for f in self.floats if self.vals[f].dim() == len(xs) and all(
                a == b for i, (a, b) in enumerate(zip(self.vals[f].shape, xs)) if i != ax % len(xs))]
            if r < 0.6 and cands:
                ins.append(cands[int(self.rng.integers(0, len(cands)))])
            else:
                s = list(xs)
                s[ax] = int(self.rng.integers(1, 4))
                ins.append(self.leaf(tuple(s)))
        self.rng.shuffle(ins)
        self.node("Concat", [str(i) for i in ins], axis=ax)

    def op_split(self) -> None:
        x = self.pick(lambda t: max(t.shape) > 1)
        if x is None:
            return self.op_unary()
        xs = list(self.vals[x].shape)
        axes = [i for i, d in enumerate(xs) if d > 1]
        ax = axes[int(self.rng.integers(0, len(axes)))]
        n = xs[ax]
        k = int(self.rng.integers(2, n + 1))
        axa = ax - len(xs) if self.rng.random() < 0.3 else ax
        if n % k == 0 and self.rng.random() < 0.4:
            self.node("Split", [x], n_out=k, axis=axa, num_outputs=k)
            return
        cuts = sorted(int(c) for c in self.rng.choice(np.arange(1, n), size=k - 1, replace=False))
        sizes = np.diff([0, *cuts, n]).astype(np.int64)
        self.node("Split", [x, self.const(sizes, "split")], n_out=k, axis=axa)

    def op_slice(self) -> None:
        x = self.pick()
        xs = list(self.vals[x].shape)
        r = len(xs)
        axes = [int(a) for a in self.rng.permutation(r)[: int(self.rng.integers(1, r + 1))]]
        starts, ends, steps = [], [], []
        for ax in axes:
            d = xs[ax]
            while True:
                st = int(self.rng.choice([1, 1, 2, 3, -1, -2]))
                s = int(self.rng.integers(-d - 2, d + 2))
                e = int(self.rng.choice([int(self.rng.integers(-d - 2, d + 2)), 2**62, -(2**62)]))
                if len(range(*slice(s, e, st).indices(d))) > 0:
                    break
            starts.append(s)
            ends.append(e)
            steps.append(st)
        all_axes = sorted(axes) == list(range(r)) and axes == list(range(r))
        fed = 0.25 if self.rng.random() < 0.5 else 0.0
        ins = [x, self.ints(np.array(starts), "st", fed), self.ints(np.array(ends), "en", fed)]
        if not all_axes or self.rng.random() < 0.5 or any(s != 1 for s in steps):
            ins.append(self.const(np.array([a - r if self.rng.random() < 0.3 else a for a in axes], np.int64),
                                  "ax"))
            if any(s != 1 for s in steps) or self.rng.random() < 0.5:
                ins.append(self.ints(np.array(steps), "sp", fed))
        self.node("Slice", ins)

    def op_gather(self) -> None:
        x = self.pick()
        xs = list(self.vals[x].shape)
        ax = self.axis(len(xs))
        d = xs[ax]
        ishape = [(), (int(self.rng.integers(1, 5)),), (2, int(self.rng.integers(1, 3)))][
            int(self.rng.integers(0, 3))]
        idx = self.rng.integers(-d, d, size=ishape).astype(np.int64)
        self.node("Gather", [x, self.ints(idx, "gi", 0.25)], axis=ax)

    def op_expand(self) -> None:
        x = self.pick(scalars=True)
        xs = list(self.vals[x].shape)
        target = [int(self.rng.integers(2, 4)) if d == 1 and self.rng.random() < 0.7 else
                  (1 if self.rng.random() < 0.2 else d) for d in xs]
        if self.rng.random() < 0.3:
            target = [int(self.rng.integers(1, 4))] + target
        elif self.rng.random() < 0.2 and target:  # a shorter shape: broadcast from the right
            target = target[int(self.rng.integers(1, len(target) + 1)):]
        self.node("Expand", [x, self.shape_path(target, x)])

    def op_where(self) -> None:
        a = self.pick()
        b = self.broadcast_partner(a)
        shp = tuple(torch.broadcast_shapes(tuple(self.vals[a].shape), tuple(self.vals[b].shape)))
        if self.rng.random() < 0.5:
            cshape = shp[len(shp) - int(self.rng.integers(0, len(shp) + 1)):]
            c = self.const(self.rng.random(cshape) < 0.5, "cond")
        else:
            p, q = self.pick(), self.pick()
            try:
                torch.broadcast_shapes(tuple(self.vals[p].shape), tuple(self.vals[q].shape), shp)
                c = self.node("Greater", [p, q], float_out=False)[0]
            except RuntimeError:
                c = self.const(np.array(True), "cond")
        self.node("Where", [c, a, b] if self.rng.random() < 0.5 else [c, b, a])

    def op_pow(self) -> None:
        x = self.pick(lambda t: bool(t.min() > 0.1 and t.max() < 4), scalars=True)
        if x is None:
            s = self.node("Sigmoid", [self.pick()])[0]
            x = self.node("Add", [s, self.const(np.array(0.5), "half")])[0]
        r = self.rng.random()
        if r < 0.3:
            e = self.const(np.array(float(self.rng.choice([2.0, 3.0, 0.5, -1.0, 1.5]))), "e")
        else:
            e = self.broadcast_partner(x, -2.0, 2.0, pred=lambda t: bool(t.abs().max() < 2.5))
        self.node("Pow", [x, e])

    def op_extremum(self) -> None:
        op = "Max" if self.rng.random() < 0.5 else "Min"
        x = self.pick(scalars=True)
        r = self.rng.random()
        if r < 0.2:
            ins = [x, x]  # a tie everywhere
        elif r < 0.35:
            ins = [x, self.node("Identity", [x])[0]]  # a tie between two names of one value
        elif r < 0.5:
            rl = self.node("Relu", [x])[0]  # ties with a constant 0 where x <= 0
            ins = [rl, self.const(np.zeros(()), "zero")]
        elif r < 0.6:
            rl = self.node("Relu", [x])[0]  # ties between x and Relu(x) where x > 0
            ins = [x, rl]
        else:
            ins = [x]
            for _ in range(int(self.rng.integers(1, 3))):
                y = self.broadcast_partner(x)
                try:
                    torch.broadcast_shapes(*(tuple(self.vals[i].shape) for i in [*ins, y]))
                    ins.append(y)
                except RuntimeError:
                    pass
            if len(ins) == 1:
                ins.append(x)
        self.rng.shuffle(ins)
        self.node(op, [str(i) for i in ins])

    def op_clip(self) -> None:
        x = self.pick(scalars=True)
        lo = float(self.rng.uniform(-1.0, 0.0))
        hi = float(self.rng.uniform(0.0, 1.0))
        r = self.rng.random()
        if r < 0.15:  # Relu's zeros sit on a lower bound of 0 (constant, learnable, or through Expand)
            x = self.node("Relu", [x])[0]
            kind = self.rng.random()
            if kind < 0.4:
                zero = self.const(np.zeros(()), "zero")
            elif kind < 0.7:
                zero = self.leaf((), "init")
                self.inits[zero] = np.zeros(())
                self.vals[zero] = torch.zeros((), dtype=torch.float64)
            else:
                shape = self.const(np.ones(0, np.int64), "shape")
                zero = self.node("Expand", [self.const(np.zeros(()), "zero"), shape], float_out=False)[0]
            op = str(self.rng.choice(["Clip", "Max"]))
            self.node(op, [x, zero] if op == "Clip" or self.rng.random() < 0.5 else [zero, x])
            return
        if r < 0.3:
            ins = [x, self.const(np.array(lo), "lo"), self.const(np.array(hi), "hi")]
        elif r < 0.45:
            ins = [x, "", self.const(np.array(hi), "hi")]
        elif r < 0.6:
            ins = [x, self.const(np.array(lo), "lo")]
        else:  # learnable bounds
            ins = [x, self.leaf((), "init", -1.0, 0.0), self.leaf((), "init", 0.0, 1.0)]
        self.node("Clip", ins)

    def op_cast(self) -> None:
        x = self.pick(scalars=True)
        if self.rng.random() < 0.25:
            self.float32 = True
            f = self.node("Cast", [x], float_out=False, to=F)[0]
            self.node("Cast", [f], to=D)
        else:
            self.node("Cast", [x], to=D)

    def op_identity(self) -> None:
        self.node("Identity", [self.pick(scalars=True)])


def make_case(seed: int) -> Case:
    """The random case of ``seed``."""
    g = _Gen(seed)
    for _ in range(int(g.rng.integers(1, 4))):
        g.leaf(g.shape(), "input")
    for _ in range(int(g.rng.integers(0, 3))):
        g.leaf(g.shape(), "init")
    for _ in range(int(g.rng.integers(15, 36) if g.big else g.rng.integers(3, 22))):
        g.step()
    # the loss: Σ ReduceSum(v·u) over some values (the last ones and a few random), u fixed weights
    n_terms = int(g.rng.integers(1, 4))
    terms = {g.floats[-1]}
    while len(terms) < n_terms:
        terms.add(g.floats[int(g.rng.integers(0, len(g.floats)))])
    parts = []
    for t in sorted(terms):
        u = g.const(g.rng.uniform(0.5, 1.5, size=tuple(g.vals[t].shape)), "u")
        m = g.node("Mul", [t, u], float_out=False)[0]
        parts.append(g.node("ReduceSum", [m], float_out=False, keepdims=0)[0])
    loss = parts[0]
    if len(parts) > 1:
        loss = g.node("Sum", parts, float_out=False)[0] if g.rng.random() < 0.5 else parts[0]
        if loss == parts[0]:
            for p in parts[1:]:
                loss = g.node("Add", [loss, p], float_out=False)[0]
    g.nodes.append(helper.make_node("Identity", [loss], ["loss"]))
    # outputs: the loss, some intermediates; other ys: values whose incoming gradients are fed
    produced = [f for f in g.floats if f not in g.inputs and f not in g.inits]
    extra = [str(v) for v in g.rng.permutation(produced)[: int(g.rng.integers(0, 3))]] if produced else []
    other = [str(v) for v in g.rng.permutation(produced)[: int(g.rng.integers(0, 3))]] \
        if produced and g.rng.random() < 0.3 else []

    def vi(name: str, elem: int, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, list(shape))

    # some inputs declare symbolic dims: a name of their own each (so the gradients' sums back to a
    # broadcast input's shape are found at run time), or names shared by the dims of one size, which
    # are then taken to be fed one size (as a batch dim is)
    symbolic = g.rng.random() < 0.4
    by_size = g.rng.random() < 0.5
    model_inputs = []
    for n, v in g.inputs.items():
        # (a fed Reshape shape keeps its length: the output's rank cannot be known otherwise)
        named = symbolic and not n.startswith("ishape")
        dims = tuple((f"n{d}" if by_size else f"{n}_d{i}") if named and g.rng.random() < 0.6 else d
                     for i, d in enumerate(v.shape))
        model_inputs.append(vi(n, helper.np_dtype_to_tensor_dtype(v.dtype), dims))
    outputs = [vi("loss", D, ())] + [vi(n, D, tuple(g.vals[n].shape)) for n in dict.fromkeys(extra + other)]
    graph = helper.make_graph(g.nodes, f"random{seed}", model_inputs, outputs,
                              [numpy_helper.from_array(v, n) for n, v in g.inits.items()])
    opset = int(g.rng.choice([18, 18, 20, 21]))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    # wrt: a random subset of the trainable leaves that reach the loss or an other y
    reach = _reaching(g, model, other)
    wrt = [t for t in g.trainable if t in reach and g.rng.random() < 0.7]
    wrt = wrt or [t for t in g.trainable if t in reach][:1]
    if wrt:
        env = torch_forward(model, dict(g.inputs), wrt, {})
        other = [y for y in other if env[y].requires_grad]
    ys = {y: g.rng.uniform(-1, 1, size=tuple(g.vals[y].shape)) for y in other}
    feeds = dict(g.inputs)
    api = str(g.rng.choice(["build", "build", "memory_efficient", "builder"]))
    return Case(seed, model, feeds, wrt, ys, g.float32, [n.op_type for n in g.nodes], api)


def _reaching(g: _Gen, model: onnx.ModelProto, other: list[str]) -> set[str]:
    vals = torch_forward(model, {**g.inputs}, list(g.trainable), {})
    outs = [o for o in [vals["loss"]] + [vals[y] for y in other] if o.requires_grad]
    leaves = [vals[t] for t in g.trainable]
    grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
    return {t for t, gr in zip(g.trainable, grads) if gr is not None}


def _fixed_names(model: onnx.ModelProto, wrt: set[str]) -> set[str]:
    """Values that are constants of the graph read through ops that keep values (Max/Min bounds)."""
    consts = {t.name for t in model.graph.initializer} - wrt
    fixed = set(consts)
    for nd in model.graph.node:
        if nd.op_type in _SAME_VALUES and nd.input[0] in fixed:
            fixed.add(nd.output[0])
    return fixed


def torch_forward(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str],
                  leaves_out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every value of ``model`` computed by torch, the ``wrt`` leaves requiring grad (also put in
    ``leaves_out``)."""
    env: dict[str, torch.Tensor] = {}
    for t in model.graph.initializer:
        env[t.name] = torch.as_tensor(numpy_helper.to_array(t).copy())
    for k, v in feeds.items():
        env[k] = torch.as_tensor(np.asarray(v).copy())
    for w in wrt:
        env[w] = env[w].detach().clone().requires_grad_(True)
        leaves_out[w] = env[w]
    fixed = _fixed_names(model, set(wrt))
    for nd in model.graph.node:
        ins = [env[i] if i else None for i in nd.input]
        outs = torch_node(nd, ins, [i in fixed for i in nd.input] if nd.op_type in ("Max", "Min") else None)
        env.update(zip(nd.output, outs))
    return env


# ---- the check ---------------------------------------------------------------------------------------------
class Mismatch(AssertionError):
    pass


def seeded_ys(case: Case) -> dict[str, np.ndarray]:
    """The other ys fed an incoming gradient: all of them, but for ``GradientGraphBuilder`` those the loss is
    computed from, which take the loss's gradient alone and have no ``<y>_grad`` input (as
    onnxruntime-training 1.16.3's builder: tests/autodiff/test_ggb_ort116.py)."""
    if case.api != "builder":
        return case.other_ys
    maker = {o: n for n in case.model.graph.node for o in n.output if o}
    upstream: set[str] = set()
    todo = ["loss"]
    while todo:
        node = maker.get(todo.pop())
        for name in node.input if node is not None else ():
            if name in maker and name not in upstream:
                upstream.add(name)
                todo.append(name)
    return {y: v for y, v in case.other_ys.items() if y not in upstream}


def torch_grads(case: Case) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """torch's gradients of the case (loss seeded with 1, other ys with their incoming gradients), and its
    forward values of the model's outputs."""
    leaves: dict[str, torch.Tensor] = {}
    env = torch_forward(case.model, case.feeds, case.wrt, leaves)
    seeded = seeded_ys(case)
    outs = [env["loss"]] + [env[y] for y in seeded]
    seeds = [torch.ones(())] + [torch.as_tensor(v) for v in seeded.values()]
    live = [i for i, o in enumerate(outs) if o.requires_grad]
    grads = torch.autograd.grad([outs[i] for i in live], [leaves[w] for w in case.wrt],
                                [seeds[i] for i in live], allow_unused=True)
    res = {w: (np.zeros(tuple(leaves[w].shape)) if gr is None else gr.detach().numpy())
           for w, gr in zip(case.wrt, grads)}
    fwd = {o.name: env[o.name].detach().numpy() for o in case.model.graph.output}
    return res, fwd


def gradient_model(case: Case) -> onnx.ModelProto:
    """The gradient graph of the case, built by the API the case names."""
    if case.api == "builder":
        b = GradientGraphBuilder(case.model.SerializeToString(), {"loss", *case.other_ys}, case.wrt, "loss")
        b.build()
        return onnx.load_from_string(b.get_model())
    return build_gradient_model(case.model, "loss", case.wrt, other_ys=list(case.other_ys),
                                memory_efficient=case.api == "memory_efficient")


# onnxruntime 1.32's optimizations that compute these graphs wrong or fail to load them:
# MatmulTransposeFusion folds a Transpose (its transpose optimizer's too) into a MatMul by a 1-D B as
# FusedMatMul(transA=1), whose result is wrong; FuseReluClip refuses a float64 Clip after a Relu;
# GemmSumFusion fails an assertion on a Gemm reading a node's third output (README)
ORT_BROKEN = ["MatmulTransposeFusion", "FuseReluClip", "GemmSumFusion"]


def run_ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray], optimized: bool = True) -> dict:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                             disabled_optimizers=ORT_BROKEN)
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(None, feeds)))


def _close(a: np.ndarray, b: np.ndarray, f32: bool) -> bool:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    rtol, atol = (2e-5, 2e-5) if f32 else (1e-8, 1e-9)
    return bool(np.allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(b).max(initial=0)))))


def check_case(case: Case, engine: bool = True) -> None:
    """Raise Mismatch when onnxtrain's gradients of the case differ from torch's (the checker raises its own
    error)."""
    onnx.checker.check_model(case.model, full_check=True)
    if not case.wrt:
        return
    want, fwd = torch_grads(case)
    ort_fwd = run_ort(case.model, case.feeds)
    for k, v in fwd.items():
        if not _close(ort_fwd[k], v, case.float32):
            raise Mismatch(f"seed {case.seed}: the interpreter's forward {k} differs from onnxruntime's")
    gm = gradient_model(case)
    onnx.checker.check_model(gm, full_check=True)
    feeds = dict(case.feeds)
    feeds.update({f"{y}_grad": v for y, v in seeded_ys(case).items()})
    runs = {"onnxruntime": run_ort(gm, feeds), "onnxruntime unoptimized": run_ort(gm, feeds, optimized=False)}
    if engine:
        names = [o.name for o in gm.graph.output]
        runs["onnxtrain"] = dict(zip(names, run_engine(gm, feeds)))
    bad = []
    for who, got in runs.items():
        for w in case.wrt:
            if not _close(got[f"{w}_grad"], want[w], case.float32):
                err = np.abs(np.asarray(got[f"{w}_grad"]) - want[w]).max() if got[
                    f"{w}_grad"].shape == want[w].shape else "shape"
                bad.append(f"{who} d{w}: max err {err}")
        if not _close(got["loss"], fwd["loss"], case.float32):
            bad.append(f"{who} loss")
    if bad:
        raise Mismatch(f"seed {case.seed}: " + "; ".join(bad))


_KINKS = ("Relu", "Max", "Min", "Clip", "ReduceMax", "Greater")


def smooth(case: Case) -> bool:
    """Whether the case's loss is smooth at its point (no kinks or selections, no float32 rounding)."""
    return not case.float32 and not any(op in _KINKS for op in case.ops)


def finite_differences(case: Case, h: float = 1e-6) -> dict[str, np.ndarray]:
    """Central differences of loss + Σ⟨y, dy⟩ (the other ys' incoming gradients) w.r.t. every wrt element,
    each side computed by onnxruntime (no graph optimizations) on the forward model."""
    m = onnx.ModelProto()
    m.CopyFrom(case.model)
    base = dict(case.feeds)
    for t in list(m.graph.initializer):
        if t.name in case.wrt:
            base[t.name] = numpy_helper.to_array(t).copy()
            m.graph.initializer.remove(t)
            m.graph.input.append(helper.make_tensor_value_info(t.name, D, list(t.dims)))
    so = ort.SessionOptions()
    so.log_severity_level = 4
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    seeded = seeded_ys(case)
    outs = ["loss", *seeded]

    def total(feeds: dict[str, np.ndarray]) -> float:
        vals = sess.run(outs, feeds)
        return float(vals[0]) + sum(float(np.sum(v * seeded[y])) for y, v in zip(outs[1:], vals[1:]))

    res = {}
    for w in case.wrt:
        x = np.asarray(base[w], np.float64)
        gr = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            up, down = x.copy(), x.copy()
            up[i] += h
            down[i] -= h
            gr[i] = (total({**base, w: up}) - total({**base, w: down})) / (2 * h)
        res[w] = gr
    return res


def check_finite_differences(case: Case) -> None:
    """Raise Mismatch when onnxtrain's gradients (its engine) differ from central differences."""
    gm = gradient_model(case)
    feeds = dict(case.feeds)
    feeds.update({f"{y}_grad": v for y, v in seeded_ys(case).items()})
    names = [o.name for o in gm.graph.output]
    got = dict(zip(names, run_engine(gm, feeds)))
    fd = finite_differences(case)
    bad = [w for w in case.wrt if not np.allclose(got[f"{w}_grad"], fd[w], rtol=1e-5,
                                                  atol=1e-5 * max(1.0, float(np.abs(fd[w]).max(initial=0))))]
    if bad:
        raise Mismatch(f"seed {case.seed}: finite differences disagree on {bad}")


def main(argv: list[str]) -> None:
    start, count = int(argv[0]), int(argv[1])
    fails = 0
    for seed in range(start, start + count):
        try:
            case = make_case(seed)
            check_case(case)
            if smooth(case) and seed % 4 == 0:
                check_finite_differences(case)
        except Exception as e:  # noqa: BLE001 - a sweep reports every failure
            fails += 1
            print(f"FAIL {seed}: {type(e).__name__}: {str(e)[:400]}", flush=True)
            if not isinstance(e, Mismatch):
                traceback.print_exc(limit=-3)
    print(f"{fails} failures of {count}")


if __name__ == "__main__":
    main(sys.argv[1:])

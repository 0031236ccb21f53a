"""A seeded fuzz of the gradients of If, Loop, Scan, SequenceMap and the sequence ops.

Each case is a small float64 model drawn from a seed (the op mixes, shapes, trip counts, conditions, axes,
directions, positions and opset vary). For every case:

* the forward model passes ``onnx.checker`` (full check) and onnxtrain's engine gives the outputs that
  ``onnx.reference`` and onnxruntime give;
* the gradient graph (``build_gradient_model``) passes ``onnx.checker`` (full check), and onnxruntime
  runs it (with its graph optimizations and without) to the gradients onnxtrain's engine gives;
* every gradient element (wrt graph inputs and initializers) matches float64 central differences of the
  loss, computed by onnxruntime on the forward model.

The default suite runs the first third of each family's seeds, ``ONNXTRAIN_FULL_TESTS=1`` all of them.
``test_random_bodies`` runs the same checks on the models of ``tests/engine/control_flow_gen.py``, whose
bodies are random graphs (40 seeds by default, 300 in the full suite).

Where onnxruntime 1.32 or onnx.reference is known to compute a model wrong (each such case is a test at
the end, the engine following the spec), the other one is the oracle. After the fuzz: a test per defect
it found, on a small model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.graphs import captured_names
from onnxtrain.testing import run_engine
from tests.engine.control_flow_gen import random_case
from tests.tiers import extended

D, I64, BOOL = TensorProto.DOUBLE, TensorProto.INT64, TensorProto.BOOL
UNARY = ("Tanh", "Sin", "Cos", "Sigmoid", "Square", "Neg", "Identity", "Exp")
BINARY = ("Add", "Sub", "Mul")


# ---- building models ---------------------------------------------------------------------------------------
class Names:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}{self.n}"


@dataclass
class Graph:
    """A graph (main or body) under construction; bodies share the model's names and opset."""

    opset: int
    rng: np.random.Generator
    names: Names = field(default_factory=Names)
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    feeds: dict = field(default_factory=dict)
    wrt: list = field(default_factory=list)

    def body(self) -> Graph:
        return Graph(self.opset, self.rng, self.names)

    def op(self, op: str, *inputs: str, outputs: int = 1, **attrs) -> str | list[str]:
        outs = [self.names(op.lower() + "_") for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        return self.op("Constant", value=numpy_helper.from_array(np.array(value, dtype)))

    def init(self, array: np.ndarray, prefix: str = "w", train: bool = True) -> str:
        name = self.names(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        if train:
            self.wrt.append(name)
        return name

    def input(self, array: np.ndarray, prefix: str = "x", train: bool = True) -> str:
        array = np.asarray(array)
        name = self.names(prefix)
        et = helper.np_dtype_to_tensor_dtype(array.dtype)
        self.inputs.append(helper.make_tensor_value_info(name, et, list(array.shape)))
        self.feeds[name] = array
        if train:
            self.wrt.append(name)
        return name

    # opset-dependent forms
    def reduce_sum(self, x: str, axes: list[int] | None = None, keepdims: int = 0) -> str:
        if axes is None:
            return self.op("ReduceSum", x, keepdims=keepdims)
        if self.opset < 13:
            return self.op("ReduceSum", x, axes=axes, keepdims=keepdims)
        return self.op("ReduceSum", x, self.const(axes), keepdims=keepdims)

    def unsqueeze(self, x: str, axes: list[int]) -> str:
        if self.opset < 13:
            return self.op("Unsqueeze", x, axes=axes)
        return self.op("Unsqueeze", x, self.const(axes))

    def unary(self, x: str, kind: str | None = None) -> str:
        kind = kind or str(self.rng.choice(UNARY))
        if kind == "Square":
            return self.op("Mul", x, x)
        if kind == "Exp":  # of a value in (-1, 1): Exp(Exp(x)) could reach where differences say little
            return self.op("Exp", self.op("Tanh", x))
        return self.op(kind, x)

    def fit(self, v: str, shape: tuple, to: tuple) -> str:
        """``v`` (of ``shape``) summed down so that it broadcasts to ``to`` without growing it."""
        extra = len(shape) - len(to)
        if extra > 0 or any(a != b and b != 1 for a, b in zip(shape[max(extra, 0):], to[-len(shape):])):
            if not to:
                return self.reduce_sum(v)
            return self.reduce_sum(v, list(range(extra)))
        return v

    def chain(self, x: str, shape: tuple, reads: list[tuple[str, tuple]], depth: int) -> str:
        """A random mix of unary ops on ``x`` and binary ops with the values ``reads`` (name, shape)."""
        for _ in range(depth):
            if reads and self.rng.random() < 0.6:
                other, oshape = reads[self.rng.integers(len(reads))]
                other = self.fit(other, oshape, shape)
                a, b = (x, other) if self.rng.random() < 0.7 else (other, x)
                x = self.op(str(self.rng.choice(BINARY)), a, b)
            else:
                x = self.unary(x)
        return self.op("Tanh", x) if self.rng.random() < 0.5 else x

    def graph(self, name: str, outputs: list) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, self.inputs, outputs, self.inits)


def vi(name: str, shape, et: int = D) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, None if shape is None else list(shape))


def finish(g: Graph, terms: list[str]) -> onnx.ModelProto:
    """The model whose output ``loss`` sums ``Σ sin(t)·c`` over the terms (c a fixed random factor)."""
    parts = []
    for t in terms:
        c = g.init(np.array(g.rng.uniform(0.5, 1.5)), "c", train=False)
        parts.append(g.op("Mul", g.reduce_sum(g.op("Sin", t)), c))
    g.nodes.append(helper.make_node("Sum", parts, ["loss"]))
    graph = g.graph("fuzz", [vi("loss", [])])
    opsets = [helper.make_opsetid("", g.opset)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = min(helper.find_min_ir_version_for(opsets), 10)
    return model


def normal(g: Graph, *shape: int, scale: float = 1.0) -> np.ndarray:
    return g.rng.standard_normal(shape) * scale


@dataclass
class Case:
    model: onnx.ModelProto
    feeds: dict
    wrt: list
    desc: str
    reference: bool = True  # whether onnx.reference computes this model right (see check_case)
    ort_ok: bool = True  # whether onnxruntime does


# ---- checking a case ---------------------------------------------------------------------------------------
def _session(model: onnx.ModelProto, optimize: bool = False) -> ort.InferenceSession:
    """An onnxruntime session on ``model``, unoptimized unless ``optimize`` (onnxruntime 1.32 cannot
    initialize, unoptimized, a SequenceMap whose body leaves its types out: "Invalid tensor data type 0";
    the gradient graphs type theirs)."""
    opts = ort.SessionOptions()
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _reference_fails(graph: onnx.GraphProto) -> bool:
    """Whether a Loop in ``graph`` (at any depth) has scan outputs or no condition input, or a Scan
    non-default axes or directions. onnx 1.23's reference Loop stacks scan outputs with ``np.vstack``
    (scalars become a column, a rank-2 value is concatenated, not stacked), fails on zero iterations, and
    runs no iteration without a condition; its Scan raises on any axis or direction but 0; its SequenceMap
    raises on a body reading outer values, and gets three inputs wrong (two sequences of [3] and a tensor:
    [2, 2, 3] for [2, 3]) or raises. (Its SequenceInsert at a position equal to the length inserts first:
    the cases doing that say so.)"""
    for node in graph.node:
        if node.op_type == "Loop" and (len(node.output) > len(node.input) - 2 or not node.input[1]):
            return True
        if node.op_type == "Scan" and any(a.name != "num_scan_inputs" and any(a.ints) for a in node.attribute
                                          if a.type == onnx.AttributeProto.INTS):
            return True
        if node.op_type == "SequenceMap" and (len(node.input) > 2 or captured_names(node.attribute[0].g)):
            return True
        if any(_reference_fails(a.g) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH):
            return True
    return False


def check_case(model: onnx.ModelProto, feeds: dict, wrt: list[str], eps: float = 1e-6,
               reference: bool = True, ort_ok: bool = True) -> dict:
    """Run every oracle on one case (see the module's docstring); returns the gradients by name.
    ``reference``/``ort_ok`` False: onnx.reference/onnxruntime is known to compute this model wrong; the
    central differences are then computed by the other one (by onnxtrain's engine when both are)."""
    onnx.checker.check_model(model, full_check=True)
    names = [o.name for o in model.graph.output]
    mine = run_engine(model, feeds)
    if ort_ok:
        for n, a, c in zip(names, mine, _session(model).run(None, feeds)):
            np.testing.assert_allclose(a, c, rtol=1e-12, atol=1e-12, err_msg=f"engine vs onnxruntime: {n}")
    reference = reference and not _reference_fails(model.graph)
    if reference:
        for n, a, b in zip(names, mine, ReferenceEvaluator(model).run(None, feeds)):
            np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12, err_msg=f"engine vs onnx.reference: {n}")

    gmodel = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(gmodel, full_check=True)
    gnames = [o.name for o in gmodel.graph.output]
    got = dict(zip(gnames, run_engine(gmodel, feeds)))
    np.testing.assert_allclose(got["loss"], mine[names.index("loss")], rtol=1e-12,
                               err_msg="the gradient graph's loss")
    if ort_ok:
        runs = [_session(gmodel, optimize=True).run(None, feeds), _session(gmodel).run(None, feeds)]
        for run in runs:
            got_ort = dict(zip(gnames, run))
            for n in wrt:
                np.testing.assert_allclose(got_ort[f"{n}_grad"], got[f"{n}_grad"], rtol=1e-9, atol=1e-11,
                                           err_msg=f"{n}_grad: onnxruntime vs onnxtrain's engine")

    values = {n: feeds[n] if n in feeds else numpy_helper.to_array(
        next(t for t in model.graph.initializer if t.name == n)) for n in wrt}
    fmodel = onnx.ModelProto()
    fmodel.CopyFrom(model)
    for t in fmodel.graph.initializer:
        if t.name in wrt:
            fmodel.graph.input.append(vi(t.name, values[t.name].shape))  # fed in the differences below
    if ort_ok:
        fsess = _session(fmodel)

        def loss(vals: dict) -> float:
            return float(fsess.run(["loss"], {**feeds, **vals})[0])
    else:
        evaluator = ReferenceEvaluator(fmodel) if reference else None

        def loss(vals: dict) -> float:
            run = evaluator.run if evaluator is not None else (lambda _, f: run_engine(fmodel, f))
            return float(run(None, {**feeds, **vals})[names.index("loss")])

    for n in wrt:
        grad = got[f"{n}_grad"]
        assert grad.shape == values[n].shape, f"{n}_grad: shape {grad.shape}, want {values[n].shape}"
        fd = np.zeros(values[n].shape)
        for idx in np.ndindex(values[n].shape):
            plus, minus = values[n].copy(), values[n].copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd[idx] = (loss({n: plus}) - loss({n: minus})) / (2 * eps)
        np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7, err_msg=f"{n}_grad vs central differences")
    return got


# ---- If ----------------------------------------------------------------------------------------------------
def if_case(seed: int) -> Case:
    """An If whose branches read outer values (an initializer, a graph input, a value computed before it)
    with different op mixes; sometimes a branch reads nothing differentiable, outputs a shape of its own
    (the output's shape is then left unknown), or holds an If of its own."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([11, 13, 16, 19, 21]))
    g = Graph(opset, rng)
    a, b = (int(v) for v in rng.integers(1, 4, 2))
    x = g.input(normal(g, a, b))
    w = g.init(normal(g, a, b))
    v = g.init(normal(g, b))
    h = g.op("Tanh", g.op("Mul", x, w))
    cond = g.input(np.array(bool(rng.integers(2))), "cond", train=False)
    outer = [(x, (a, b)), (w, (a, b)), (v, (b,)), (h, (a, b))]
    kinds = ["chain", "chain", "constant", "shape", "nested", "outer", "twice"]
    then_kind, else_kind = (str(k) for k in rng.choice(kinds, 2))
    mixed_shapes = "shape" in (then_kind, else_kind)
    outs = 1 + int(rng.integers(2))
    twice = "twice" in (then_kind, else_kind) and outs == 2

    def branch(kind: str, tag: str) -> onnx.GraphProto:
        br = g.body()
        results = []
        for k in range(outs):
            start, sshape = [o for o in outer if o[1] == (a, b)][rng.integers(3)]
            if kind == "constant":
                y = br.op("Constant", value=numpy_helper.from_array(normal(g, a, b)))
            elif kind == "outer":  # the branch outputs an outer value as it is (ONNX wants a node to make it)
                y = br.op("Identity", start)
            elif kind == "nested":  # an inner If on a condition computed from the input
                inner_cond = br.op("Greater", br.reduce_sum(x), br.const(0.0, np.float64))
                inner = []
                for t in ("then", "else"):
                    ib = br.body()
                    y = ib.chain(start, sshape, outer, int(rng.integers(1, 4)))
                    inner.append(ib.graph(f"{tag}_{t}_inner{k}", [vi(y, None)]))
                y = br.op("If", inner_cond, then_branch=inner[0], else_branch=inner[1])
            elif kind == "twice" and k:  # the branch outputs one value as both outputs
                y = results[0]
            else:
                y = br.chain(start, sshape, outer, int(rng.integers(1, 5)))
                if kind == "shape" and k == 0:  # a different shape from the other branch's: rank 1
                    y = br.reduce_sum(br.op("Mul", y, y), [0])
            results.append(y)
        shapes = [None if mixed_shapes else (a, b)] * outs
        return br.graph(tag, [vi(r, s) for r, s in zip(results, shapes)])

    ys = g.op("If", cond, outputs=outs, then_branch=branch(then_kind, "then"),
              else_branch=branch(else_kind, "else"))
    ys = ys if isinstance(ys, list) else [ys]
    terms = ys + ([h] if rng.random() < 0.5 else [])
    desc = f"opset {opset} then={then_kind} else={else_kind} cond={g.feeds[cond]} outs={outs}"
    # onnxruntime 1.32 computes an If whose branch outputs one value twice wrong (test_a_body_outputting_...)
    return Case(finish(g, terms), g.feeds, g.wrt, desc, ort_ok=not twice)


# ---- Loop --------------------------------------------------------------------------------------------------
SHAPES = ("scalar", "row", "matrix")


def _loop_body(g: Graph, outer: list, carried: list, a: int, b: int, table: str, nest: int, with_count: bool,
               tag: str, stops: bool = False) -> tuple[onnx.GraphProto, list, int]:
    """A Loop body: each float carried value (name, shape) is updated by a random mix reading the outer
    values, the other carried values, the table's row at the iteration number and the iteration number
    itself; a carried integer counter (``with_count``) drives the condition, stopping at outer value
    ``stop``; sometimes an If or a Loop inside. Returns the body, the scan outputs' shapes, and how many."""
    rng = g.rng
    br = g.body()
    i, c = g.names("i"), g.names("cond")
    formal = [(g.names("carry"), sh) for _, sh in carried]
    br.inputs = [vi(i, [], I64), vi(c, [], BOOL)]
    if with_count:
        count = g.names("count")
        br.inputs.append(vi(count, [], I64))
    br.inputs += [vi(f, sh) for f, sh in formal]
    row = br.op("Gather", table, i, axis=0)
    fi = br.op("Mul", br.op("Cast", i, to=D), br.const(0.25, np.float64))
    reads = [*outer, *formal, (row, (b,)), (fi, ())]
    if with_count:
        fc = br.op("Mul", br.op("Cast", count, to=D), br.const(-0.1, np.float64))
        reads.append((fc, ()))
    extra = None
    if nest and rng.random() < 0.5:  # an If on the iteration's parity
        parity = br.op("Equal", br.op("Mod", i, br.const(2)), br.const(0))
        f, sh = formal[rng.integers(len(formal))]
        sides = []
        for t in ("then", "else"):
            sb = br.body()
            y = sb.chain(f, sh, reads, int(rng.integers(1, 4)))
            sides.append(sb.graph(f"{tag}_if_{t}", [vi(y, sh)]))
        extra = (br.op("If", parity, then_branch=sides[0], else_branch=sides[1]), sh)
    elif nest:  # a Loop inside, of 0 to i + 1 iterations (or a fixed count)
        inner_trip = br.op("Add", i, br.const(1)) if rng.random() < 0.5 else br.const(int(rng.integers(0, 3)))
        f, sh = formal[rng.integers(len(formal))]
        inner, _, k = _loop_body(br, reads, [(f, sh)], a, b, table, nest - 1, False, tag + "_inner")
        done = br.op("Loop", inner_trip, "", f, body=inner, outputs=1 + k)
        extra = (done if isinstance(done, str) else done[0], sh)
    if extra is not None:
        reads.append(extra)
    outs = []
    for f, sh in formal:  # sometimes carried through unchanged: the body outputs its input itself
        same = rng.random() < 0.15
        outs.append((f if same else br.op("Tanh", br.chain(f, sh, reads, int(rng.integers(1, 4)))), sh))
    for k, (_, sh) in enumerate(outs):  # sometimes one value carried as two
        same = [j for j in range(k) if outs[j][1] == sh]
        if same and rng.random() < 0.2:
            outs[k] = outs[same[0]]
    scans = []
    for _ in range(int(rng.integers(0, 3))):
        pick = rng.random()
        if scans and pick > 0.85:  # one value stacked twice
            scans.append(scans[-1])
            continue
        if pick < 0.15:  # a value of the body's inputs (itself) or of the outer graph (by Identity) stacked
            k = int(rng.integers(len(formal) + len(outer)))
            f, sh = [*formal, *outer][k]
            scans.append((f if k < len(formal) else br.op("Identity", f), sh))
            continue
        f, sh = outs[rng.integers(len(outs))]
        scans.append((br.chain(f, sh, reads, int(rng.integers(1, 3))), sh))
    # a Loop without a condition input ignores the body's condition (so says the spec; onnxruntime 1.32
    # stops when it is false): stop by it only when the Loop has one
    results = [(br.op("Identity", c), [], BOOL)]
    if with_count:
        nxt = br.op("Add", count, br.const(1))
        results = [(br.op("Less", nxt, "stop"), [], BOOL) if stops else results[0], (nxt, [], I64)]
    results += [(o, sh, D) for o, sh in outs + scans]
    if with_count and rng.random() < 0.3:  # an integer stacked too (last): i · count
        results.append((br.op("Mul", i, count), [], I64))
    body = br.graph(tag, [vi(n, sh, et) for n, sh, et in results])
    return body, [sh for _, sh in scans], len(results) - 1 - len(formal) - with_count


def loop_case(seed: int) -> Case:
    """A Loop with a trip count, a condition, or both (zero iterations, a condition that stops it early),
    carrying floats of ranks 0 to 2 (and an integer counter), stacking scan outputs, reading outer values,
    the iteration number and a table row at it; an If or a Loop in its body."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([11, 13, 16, 19, 21]))
    g = Graph(opset, rng)
    a, b = (int(v) for v in rng.integers(1, 4, 2))
    mode = str(rng.choice(["trip", "cond", "both"]))
    trip = int(rng.integers(0, 5))
    stop = int(rng.integers(0, 5))
    x = g.input(normal(g, a, b))
    w = g.init(normal(g, a, b, scale=0.7))
    v = g.init(normal(g, b))
    h = g.op("Tanh", g.op("Mul", x, w))
    outer = [(x, (a, b)), (w, (a, b)), (v, (b,)), (h, (a, b))]
    table = g.init(normal(g, max(trip, stop, 1) + 1, b), "table")
    g.nodes.append(helper.make_node("Constant", [], ["stop"], value=numpy_helper.from_array(np.array(stop))))
    dims = {"scalar": (), "row": (b,), "matrix": (a, b)}
    carried = []
    for _ in range(int(rng.integers(1, 4))):
        sh = dims[str(rng.choice(SHAPES))]
        kind = rng.integers(5)
        same = [c for c in carried if c[1] == sh]
        if kind == 0:
            start = g.input(normal(g, *sh), "s")
        elif kind == 1:
            start = g.init(normal(g, *sh), "s")
        elif kind == 2 and sh == (a, b):  # a value the body also reads from outside
            start = str(rng.choice([x, w]))
        elif kind == 3 and same:  # the start of another carried value too
            start = same[0][0]
        else:  # computed before the loop
            start = g.op("Sin", g.fit(h, (a, b), sh))
        carried.append((start, sh))
    with_count = mode != "trip" or bool(rng.random() < 0.5)
    nest = int(rng.integers(0, 3))
    body, scan_shapes, n_scan = _loop_body(g, outer, carried, a, b, table, nest, with_count, "body",
                                           stops=mode != "trip")
    trip_in = g.input(np.array(trip), "trip", train=False) if mode != "cond" else ""
    go = bool(rng.random() < 0.85)
    cond_in = g.input(np.array(go), "go", train=False) if mode != "trip" else ""
    starts = ([g.const(0)] if with_count else []) + [s for s, _ in carried]
    n_out = len(starts) + n_scan
    outs = g.op("Loop", trip_in, cond_in, *starts, outputs=n_out, body=body)
    outs = outs if isinstance(outs, list) else [outs]
    floats = outs[1:1 + len(carried) + len(scan_shapes)] if with_count else outs
    terms = [o for o in floats if rng.random() < 0.7] or floats[:1]
    desc = (f"opset {opset} mode={mode} trip={trip} stop={stop} go={go} carried={[s for _, s in carried]} "
            f"scans={scan_shapes} nest={nest} count={with_count}")
    return Case(finish(g, terms), g.feeds, g.wrt, desc)


def _nested(br: Graph, kind: str, start: str, shape: tuple, reads: list, flag: str) -> str:
    """In body ``br``: an If on ``flag`` whose branches mix ``start`` with ``reads``, or a Loop of two
    iterations doing so to a value carried from ``start``."""
    rng = br.rng
    if kind == "if":
        sides = []
        for t in ("then", "else"):
            sb = br.body()
            sides.append(sb.graph(f"nested_{t}", [vi(sb.chain(start, shape, reads, int(rng.integers(1, 4))),
                                                     None)]))
        return br.op("If", flag, then_branch=sides[0], else_branch=sides[1])
    lb = br.body()
    i, c, h = br.names("i"), br.names("cond"), br.names("h")
    lb.inputs = [vi(i, [], I64), vi(c, [], BOOL), vi(h, None)]  # (shapes left out: SequenceMap's vary)
    out = lb.op("Tanh", lb.chain(h, shape, [*reads, (h, shape)], int(rng.integers(1, 4))))
    body = lb.graph("nested_loop", [vi(lb.op("Identity", c), [], BOOL), vi(out, None)])
    return br.op("Loop", br.const(2), "", start, body=body)


# ---- Scan --------------------------------------------------------------------------------------------------
def scan_case(seed: int) -> Case:
    """A Scan (opset 9 to 21) with one to three states and scan inputs (ranks 1 to 3, any scan axis,
    negative ones from opset 11), either direction for each input and output, scan outputs stacked along
    any axis, its body reading outer values; sometimes the body leaves its inputs' shapes out."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([9, 11, 16, 19, 21]))
    g = Graph(opset, rng)
    a, b = (int(v) for v in rng.integers(1, 4, 2))
    length = int(rng.integers(0, 5))  # no step at all too
    x = g.input(normal(g, a, b))
    w = g.init(normal(g, a, b, scale=0.7))
    v = g.init(normal(g, b))
    h = g.op("Tanh", g.op("Mul", x, w))
    outer = [(x, (a, b)), (w, (a, b)), (v, (b,)), (h, (a, b))]
    dims = {"scalar": (), "row": (b,), "matrix": (a, b)}
    negative = opset >= 11

    def axis_attr(axis: int, rank: int) -> int:
        return axis - rank if negative and rng.random() < 0.5 else axis

    states, xs, elems, in_axes, in_dirs = [], [], [], [], []
    for _ in range(int(rng.integers(1, 4))):
        sh = dims[str(rng.choice(SHAPES))]
        start = g.input(normal(g, *sh), "s") if rng.random() < 0.6 else g.op("Sin", g.fit(h, (a, b), sh))
        states.append((start, sh))
    for _ in range(int(rng.integers(1, 4))):
        sh = dims[str(rng.choice(SHAPES))]
        axis = int(rng.integers(len(sh) + 1))
        full = (*sh[:axis], length, *sh[axis:])
        xs.append(g.input(normal(g, *full), "xs") if rng.random() < 0.7 else g.init(normal(g, *full), "xs"))
        elems.append(sh)
        in_axes.append(axis_attr(axis, len(full)))
        in_dirs.append(int(rng.integers(2)))
    typed = rng.random() < 0.7
    br = g.body()
    formal_s = [(g.names("state"), sh) for _, sh in states]
    formal_x = [(g.names("elem"), sh) for sh in elems]
    br.inputs = [vi(f, sh if typed else None) for f, sh in formal_s + formal_x]
    reads = outer + formal_s + formal_x
    nested = str(rng.choice(["none", "none", "if", "loop"]))
    if nested != "none":  # an If on an outer flag, or a Loop of two iterations, inside the body
        f, sh = [*formal_s, *formal_x][rng.integers(len(formal_s) + len(formal_x))]
        reads.append((_nested(br, nested, f, sh, reads, g.input(np.array(bool(rng.integers(2))), "flag",
                                                                 train=False)), sh))
    # a state kept or an input stacked as it is goes through an Identity: onnxruntime 1.32's Scan outputs
    # zeros or garbage for a body output that is a body input or another output (test_scan_pass_through)
    new_states = [(br.op("Identity", f), sh) if rng.random() < 0.15 else
                  (br.op("Tanh", br.chain(f, sh, reads, int(rng.integers(1, 4)))), sh) for f, sh in formal_s]
    reads += new_states
    outs, out_axes, out_dirs = [], [], []
    for _ in range(int(rng.integers(0, 3))):
        f, sh = reads[len(outer) + int(rng.integers(len(reads) - len(outer)))]
        # sometimes a body input (or a new state) stacked as it is
        outs.append((br.op("Identity", f), sh) if rng.random() < 0.2 else
                    (br.chain(f, sh, reads, int(rng.integers(1, 3))), sh))
        out_axes.append(axis_attr(int(rng.integers(len(sh) + 1)), len(sh) + 1))
        out_dirs.append(int(rng.integers(2)))
    body = br.graph("scan_body", [vi(n, sh) for n, sh in new_states + outs])
    attrs = {"num_scan_inputs": len(xs), "scan_input_axes": in_axes, "scan_input_directions": in_dirs}
    if outs:
        attrs.update(scan_output_axes=out_axes, scan_output_directions=out_dirs)
    for key in list(attrs)[1:]:  # the defaults, written or not
        if not any(attrs[key]) and rng.random() < 0.5:
            del attrs[key]
    res = g.op("Scan", *(s for s, _ in states), *xs, outputs=len(states) + len(outs), body=body, **attrs)
    res = res if isinstance(res, list) else [res]
    terms = [r for r in res if rng.random() < 0.7] or res[-1:]
    desc = (f"opset {opset} L={length} states={[s for _, s in states]} elems={elems} {attrs} "
            f"outs={[s for _, s in outs]} typed={typed} nested={nested}")
    # onnxruntime 1.32 fails on a Scan of no step, or dies of a floating-point exception (SIGFPE);
    # onnx.reference raises on one with scan outputs
    return Case(finish(g, terms), g.feeds, g.wrt, desc, reference=length > 0, ort_ok=length > 0)


# ---- SequenceMap and the sequence ops ----------------------------------------------------------------------
def _split(g: Graph, x: str, shape: tuple, how: str, axis: int = 0) -> tuple[str, list[tuple]]:
    """SplitToSequence of ``x`` along ``axis`` (written negative half the time when not 0): ``how`` is
    "squeeze" (keepdims=0), "ones" (keepdims=1), "lengths" (split sizes) or "size" (a scalar split);
    returns the sequence and its elements' shapes."""
    n = shape[axis]
    attr = axis - len(shape) if axis and g.rng.random() < 0.5 else axis

    def piece(k: int | None) -> tuple:
        return (*shape[:axis], *(() if k is None else (k,)), *shape[axis + 1:])

    if how == "squeeze":
        return g.op("SplitToSequence", x, axis=attr, keepdims=0), [piece(None)] * n
    if how == "ones":
        return g.op("SplitToSequence", x, axis=attr), [piece(1)] * n
    if how == "size":
        size = int(g.rng.integers(1, n + 1))
        sizes = [size] * (n // size) + ([n % size] if n % size else [])
        return g.op("SplitToSequence", x, g.const(size), axis=attr), [piece(k) for k in sizes]
    cuts = sorted(int(c) for c in g.rng.choice(np.arange(1, n), int(g.rng.integers(0, n)), replace=False))
    sizes = [e - s for s, e in zip([0, *cuts], [*cuts, n])]
    return g.op("SplitToSequence", x, g.const(sizes), axis=attr), [piece(k) for k in sizes]


def sequence_map_case(seed: int) -> Case:
    """SequenceMap (opset 17 to 21) over one or two split sequences and a tensor, its body (of one or two
    outputs) reading an outer value; the outputs concatenated or stacked back."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([17, 19, 21]))
    g = Graph(opset, rng)
    n, b = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    how = str(rng.choice(["squeeze", "ones", "lengths", "size"]))
    x = g.input(normal(g, n, b))
    w = g.init(normal(g, b))
    s1, shapes = _split(g, x, (n, b), how)
    inputs, formal = [s1], [(g.names("e"), shapes[0])]
    if rng.random() < 0.6:  # a second sequence, split alike
        y = g.input(normal(g, n, b), "y")
        s2 = g.op("SplitToSequence", y, *g.nodes[-1].input[1:], axis=0,
                  **({"keepdims": 0} if how == "squeeze" else {}))
        inputs.append(s2)
        formal.append((g.names("e"), shapes[0]))
    t = g.input(normal(g, b), "t") if rng.random() < 0.5 else g.init(normal(g, b), "t")
    inputs.append(t)
    formal.append((g.names("t"), (b,)))
    br = g.body()
    typed = rng.random() < 0.5
    br.inputs = [vi(f, None) if not typed else helper.make_tensor_value_info(f, D, None) for f, _ in formal]
    el = shapes[0]
    reads = [(formal[0][0], el), *formal[1:], (w, (b,))]
    nested = str(rng.choice(["none", "none", "if", "loop"]))
    if nested != "none":
        flag = g.input(np.array(bool(rng.integers(2))), "flag", train=False)
        reads.append((_nested(br, nested, formal[0][0], el, reads, flag), el))
    e0 = formal[0][0]
    outs = [e0 if rng.random() < 0.15 else br.chain(e0, el, reads, int(rng.integers(1, 4)))
            for _ in range(int(rng.integers(1, 3)))]
    if len(outs) == 2 and rng.random() < 0.2:  # one value output twice
        outs[1] = outs[0]
    twice = len(outs) == 2 and outs[0] == outs[1]  # onnxruntime 1.32 cannot load it ("Duplicate definition")
    body = br.graph("map_body", [vi(o, None) for o in outs])
    mapped = g.op("SequenceMap", *inputs, outputs=len(outs), body=body)
    mapped = mapped if isinstance(mapped, list) else [mapped]
    same = len(set(shapes)) == 1
    terms = []
    for m in mapped:
        stack = int(same and rng.random() < 0.5)
        axis = int(rng.integers(-len(el) - 1, len(el) + 1)) if stack else 0
        terms.append(g.op("ConcatFromSequence", m, axis=axis, new_axis=stack))
    desc = (f"opset {opset} n={n} b={b} split={how} shapes={shapes} inputs={len(inputs)} outs={len(outs)} "
            f"twice={twice} nested={nested}")
    return Case(finish(g, terms), g.feeds, g.wrt, desc, ort_ok=not twice)


def sequence_case(seed: int) -> Case:
    """A sequence from SplitToSequence (split sizes, a scalar split, keepdims 0 or 1), SequenceConstruct
    or a Loop appending to it (the TorchScript list pattern, opset 13 and later), then inserts at
    positions (negative ones too), erasures, reads at positions and lengths, then ConcatFromSequence
    (new_axis 0 or 1, any valid axis)."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([11, 13, 16, 19, 21]))
    g = Graph(opset, rng)
    n, b = int(rng.integers(1, 5)), int(rng.integers(1, 4))
    x = g.input(normal(g, n, b))
    w = g.init(normal(g, b))
    starts = ["squeeze", "ones", "lengths", "size", "last", "construct", "empty"] + ["loop"] * (opset >= 13)
    start = str(rng.choice(starts))
    terms: list[str] = []
    if start == "empty":  # filled by inserts below
        shapes, seq = [], g.op("SequenceEmpty", dtype=D)
    elif start == "last":  # split along the last axis (of x's transpose), in any of the four ways
        seq, shapes = _split(g, g.op("Transpose", x, perm=[1, 0]), (b, n), str(rng.choice(
            ["squeeze", "ones", "lengths", "size"])), axis=1)
    elif start == "construct":
        shapes = [(b,)] * n
        seq = g.op("SequenceConstruct", *(g.op("Gather", x, g.const(k), axis=0) for k in range(n)))
    elif start == "loop":  # for i in range(n): h = tanh(mix(x[i], w, h)); out.append(h)
        keep = rng.random() < 0.5
        shapes = [(1, b) if keep else (b,)] * n
        br = g.body()
        i, c, h, sq = g.names("i"), g.names("cond"), g.names("h"), g.names("list")
        br.inputs = [vi(i, [], I64), vi(c, [], BOOL), vi(h, shapes[0]),
                     helper.make_tensor_sequence_value_info(sq, D, None)]
        row = br.op("Gather", x, br.unsqueeze(i, [0]) if keep else i, axis=0)
        elem = br.op("Tanh", br.chain(row, shapes[0], [(w, (b,)), (h, shapes[0])], int(rng.integers(1, 4))))
        out = br.op("SequenceInsert", sq, elem)
        body = br.graph("append_body", [vi(br.op("Identity", c), [], BOOL), vi(elem, shapes[0]),
                                          helper.make_tensor_sequence_value_info(out, D, None)])
        h0 = g.init(normal(g, *shapes[0]), "h")
        h_end, seq = g.op("Loop", g.const(n), "", h0, g.op("SequenceEmpty", dtype=D), body=body, outputs=2)
        if rng.random() < 0.5:
            terms.append(h_end)
    else:
        seq, shapes = _split(g, x, (n, b), start)
    steps, reference = [], True
    for step in range(int(rng.integers(1, 5)) + (start == "empty")):
        kind = str(rng.choice(["insert", "erase", "at", "length"]))
        count = len(shapes)
        if not count or start == "empty" and step == 0:  # an empty sequence takes an insert first
            kind = "insert"
        if kind == "insert":
            el = shapes[int(rng.integers(count))] if count else (b,)
            t = g.input(normal(g, *el), "t") if rng.random() < 0.5 else g.init(normal(g, *el), "t")
            where = int(rng.integers(-count, count + 1))
            if rng.random() < 0.3:
                seq = g.op("SequenceInsert", seq, t)
                shapes = [*shapes, el]
                where = None
            else:
                seq = g.op("SequenceInsert", seq, t, g.const(where))
                k = where + count if where < 0 else where
                reference &= k != count  # onnx.reference inserts first there
                shapes = [*shapes[:k], el, *shapes[k:]]
        elif kind == "erase" and count > 1:
            where = int(rng.integers(-count, count))
            if rng.random() < 0.3:
                seq, where = g.op("SequenceErase", seq), None
                shapes = shapes[:-1]
            else:
                seq = g.op("SequenceErase", seq, g.const(where))
                del shapes[where]
        elif kind == "at":
            where = int(rng.integers(-count, count))
            scale = g.op("Tanh", w) if shapes[where][-1:] == (b,) else g.init(np.array(0.7), "scale")
            terms.append(g.op("Mul", g.op("SequenceAt", seq, g.const(where, np.int32)), scale))
        else:
            length = g.op("Cast", g.op("SequenceLength", seq), to=D)
            terms.append(g.op("Mul", g.op("Sin", g.op("SequenceAt", seq, g.const(0))), length))
            where = None
        steps.append((kind, where))
    rank = len(shapes[0])
    differ = [d for d in range(rank) if len({s[d] for s in shapes}) > 1]  # at most one: the split's
    if not differ and rng.random() < 0.5:
        axis = int(rng.integers(-rank - 1, rank + 1))
        terms.append(g.op("ConcatFromSequence", seq, axis=axis, new_axis=1))
        end = f"stack axis {axis}"
    else:
        axis = differ[0] if differ else int(rng.integers(rank))
        axis -= rank * int(rng.random() < 0.5)
        terms.append(g.op("ConcatFromSequence", seq, axis=axis))
        end = f"concat axis {axis}"
    desc = f"opset {opset} start={start} n={n} b={b} steps={steps} shapes={shapes} {end}"
    return Case(finish(g, terms), g.feeds, g.wrt, desc, reference)


# ---- bag pooling Loops (torch's exported nn.EmbeddingBag) -------------------------------------------------

def _bag_rows(g: Graph, table: str, ids: str, starts: str, ends: str) -> tuple[Graph, str, str]:
    """A Loop body over bags (EmbeddingBag's loop): iteration i gathers the rows of ``table`` at
    ``ids[starts[i]:ends[i]]``. Returns the body, its condition input and the rows."""
    br = g.body()
    i, c = g.names("i"), g.names("cond")
    br.inputs = [vi(i, [], I64), vi(c, [], BOOL)]
    lo = br.unsqueeze(br.op("Gather", starts, i, axis=0), [0])
    hi = br.unsqueeze(br.op("Gather", ends, i, axis=0), [0])
    return br, c, br.op("Gather", table, br.op("Slice", ids, lo, hi, br.const([0])), axis=0)


def bag_case(seed: int, free: bool = False) -> Case:
    """The Loop torch's TorchScript exporter writes for ``nn.EmbeddingBag`` (one iteration per bag: Slice
    the ids by the bag's bounds, Gather the table rows, reduce them), which the engine pools at once and
    the autodiff differentiates without a loop: bags as EmbeddingBag's offsets make them (empty ones for a
    sum), negative offsets, or (``free``) also bounds read from two tensors that do not follow one
    another, whose gradient is NaN (test_bag_bounds_that_do_not_follow_one_another)."""
    rng = np.random.default_rng(seed)
    opset = int(rng.choice([11, 13, 16, 19, 21]))
    g = Graph(opset, rng)
    mode = str(rng.choice(["sum", "mean", "max"]))
    rows, dim = int(rng.integers(2, 7)), int(rng.integers(1, 4))
    n = int(rng.integers(1, 9))
    layout = str(rng.choice(["offsets", "negative"] + ["free"] * free))
    ids = rng.integers(0, rows, n)
    if mode == "max":  # distinct ids: a tie between two equal rows has no gradient to check
        n = min(n, rows)
        ids = rng.permutation(rows)[:n]
    table = g.init(normal(g, rows, dim), "table")
    idv = g.input(np.asarray(ids, np.int64), "ids", train=False)
    empty_ok = mode == "sum"
    if layout == "free":  # bag i = ids[s_i:e_i], any bounds (overlapping, gaps, reversed when empty is ok)
        m = int(rng.integers(1, 5))
        s_b = rng.integers(0, n, m)
        e_b = np.minimum(s_b + rng.integers(0 if empty_ok else 1, n + 1, m), n)
        starts = g.input(s_b.astype(np.int64), "starts", train=False)
        ends = g.input(e_b.astype(np.int64), "ends", train=False)
    else:
        cuts = np.sort(rng.choice(np.arange(1, n), int(rng.integers(0, n)), replace=False)) if n > 1 else []
        offsets = np.array([0, *cuts], np.int64)
        if empty_ok and rng.random() < 0.4:  # an empty bag (two equal offsets)
            offsets = np.sort(np.append(offsets, offsets[rng.integers(len(offsets))]))
        if layout == "negative":
            offsets = offsets - n
        m = len(offsets)
        starts = g.input(offsets, "offsets", train=False)
        length = g.op("Shape", idv)
        ends = g.op("Concat", g.op("Slice", starts, g.const([1]), g.const([2**62])), length, axis=0)
    br, c, picked = _bag_rows(g, table, idv, starts, ends)
    op = {"sum": "ReduceSum", "mean": "ReduceMean", "max": "ReduceMax"}[mode]
    if opset >= 18 or op == "ReduceSum" and opset >= 13:
        pooled = br.op(op, picked, br.const([0]), keepdims=0)
    else:
        pooled = br.op(op, picked, axes=[0], keepdims=0)
    body = br.graph("bag_body", [vi(br.op("Identity", c), [], BOOL), vi(pooled, [dim])])
    out = g.op("Loop", g.const(m), "", body=body)
    desc = f"opset {opset} mode={mode} layout={layout} ids={list(map(int, ids))} bags={m} rows={rows}x{dim}"
    return Case(finish(g, [out]), g.feeds, g.wrt, desc)


CASES: dict[str, Callable[[int], Case]] = {
    "if": if_case, "loop": loop_case, "scan": scan_case, "sequence_map": sequence_map_case,
    "sequence": sequence_case, "bag": bag_case,
}
SEEDS = {"if": range(60), "loop": range(100), "scan": range(60), "sequence_map": range(40),
         "sequence": range(80), "bag": range(40)}
# the first third of each family's seeds runs in the default suite, the rest in the full one (tests/tiers.py)
DEFAULT_SEEDS = {f: len(seeds) // 3 for f, seeds in SEEDS.items()}


def _fuzz_params() -> list:
    return [(f, s) if s < DEFAULT_SEEDS[f] else extended(f, s) for f in CASES for s in SEEDS[f]]


@pytest.mark.parametrize("family, seed", _fuzz_params())
def test_fuzz(family: str, seed: int) -> None:
    case = CASES[family](seed)
    try:
        check_case(case.model, case.feeds, case.wrt, reference=case.reference, ort_ok=case.ort_ok)
    except Exception as e:
        raise AssertionError(f"{family} seed {seed} ({case.desc}): {type(e).__name__}: {e}") from e


# ---- the defects the fuzz found, each on a small model -----------------------------------------------------
def _model(nodes: list, inputs: list, inits: dict, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, [vi("loss", [])],
                              [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _sin_loss(y: str) -> list:
    return [helper.make_node("Sin", [y], ["sin_y"]),
            helper.make_node("ReduceSum", ["sin_y"], ["loss"], keepdims=0)]


def _plus_w(kind: str) -> tuple[onnx.ModelProto, dict, list[str]]:
    """``z = f(x) + w; loss = Σ sin(z)`` with f an If, a Loop's scan output or a Scan's: w's gradient is
    z's, the very value the control-flow node's gradient reads in its body."""
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    if kind == "If":
        then = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"])], "then", [], [vi("t", [2, 3])])
        other = helper.make_graph([helper.make_node("Mul", ["x", "x"], ["e"])], "else", [], [vi("e", [2, 3])])
        node = helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)
        model = _model([node, helper.make_node("Add", ["y", "w"], ["z"]), *_sin_loss("z")],
                       [vi("x", [2, 3]), vi("c", [], BOOL)], {"w": w})
        return model, {"x": x, "c": np.array(True)}, ["x", "w"]
    if kind == "Loop":  # stacks tanh(x[i]) for i < 2
        body = helper.make_graph(
            [helper.make_node("Identity", ["cond"], ["cond_out"]),
             helper.make_node("Gather", ["x", "i"], ["row"], axis=0),
             helper.make_node("Tanh", ["row"], ["t"])],
            "body", [vi("i", [], I64), vi("cond", [], BOOL)], [vi("cond_out", [], BOOL), vi("t", [3])])
        node = helper.make_node("Loop", ["n", ""], ["y"], body=body)
        model = _model([node, helper.make_node("Add", ["y", "w"], ["z"]), *_sin_loss("z")],
                       [vi("x", [2, 3])], {"w": w, "n": np.array(2)})
        model.graph.value_info.append(vi("y", [2, 3]))  # (else w's gradient is a run-time sum: a new value)
        return model, {"x": x}, ["x", "w"]
    body = helper.make_graph(  # scans tanh(x_t · s), carrying s
        [helper.make_node("Mul", ["s", "xt"], ["p"]), helper.make_node("Tanh", ["p"], ["t"]),
         helper.make_node("Identity", ["t"], ["s_out"])],
        "body", [vi("s", [3]), vi("xt", [3])], [vi("s_out", [3]), vi("t", [3])])
    node = helper.make_node("Scan", ["s0", "x"], ["s_end", "y"], body=body, num_scan_inputs=1)
    return _model([node, helper.make_node("Add", ["y", "w"], ["z"]), *_sin_loss("z")],
                  [vi("x", [2, 3])], {"w": w, "s0": np.ones(3)}), {"x": x}, ["x", "w", "s0"]


@pytest.mark.parametrize("kind", ["If", "Loop", "Scan"])
def test_a_body_reads_an_incoming_gradient_that_is_also_an_inputs_gradient(kind: str) -> None:
    """The builder renames a gradient that is some x's whole gradient to ``<x>_grad`` in the graph, not in
    the bodies reading it: the If, Loop and Scan rules now hand their bodies a copy (before: the gradient
    graph failed onnx.checker, a body reading a value made after the node)."""
    check_case(*_plus_w(kind))


def _nested_loops() -> tuple[onnx.ModelProto, dict, list[str]]:
    """acc ← acc · tanh(inner(acc)) for 3 iterations, inner: a Loop of i + 1 iterations h ← sin(h · w)."""
    inner = helper.make_graph(
        [helper.make_node("Identity", ["c2"], ["c2_out"]), helper.make_node("Mul", ["h", "w"], ["hw"]),
         helper.make_node("Sin", ["hw"], ["h_out"])],
        "inner", [vi("j", [], I64), vi("c2", [], BOOL), vi("h", [3])],
        [vi("c2_out", [], BOOL), vi("h_out", [3])])
    outer = helper.make_graph(
        [helper.make_node("Identity", ["c1"], ["c1_out"]), helper.make_node("Add", ["i", "one"], ["count"]),
         helper.make_node("Loop", ["count", "", "acc"], ["h_end"], body=inner),
         helper.make_node("Tanh", ["h_end"], ["t"]), helper.make_node("Mul", ["acc", "t"], ["acc_out"])],
        "outer", [vi("i", [], I64), vi("c1", [], BOOL), vi("acc", [3])],
        [vi("c1_out", [], BOOL), vi("acc_out", [3])])
    nodes = [helper.make_node("Loop", ["n", "", "x"], ["y"], body=outer), *_sin_loss("y")]
    rng = np.random.default_rng(2)
    model = _model(nodes, [vi("x", [3])], {"w": rng.standard_normal(3), "n": np.array(3), "one": np.array(1)})
    return model, {"x": rng.standard_normal(3) + 1.5}, ["x", "w"]


def test_nested_loop_gradient_names_are_unique() -> None:
    """A Loop in a Loop: the inner Loop's backward Loop, built inside the outer body's gradient, named its
    body's values as the outer one's does (``Loop_Grad_body/one``...); before, the gradient graph failed
    onnx.checker (SSA)."""
    check_case(*_nested_loops())


@pytest.mark.parametrize("op", ["SequenceAt", "SequenceMap"])
def test_sequence_gradients_run_in_onnxruntime_unoptimized(op: str) -> None:
    """SequenceAt's gradient maps a zeros-making body over the sequence, SequenceMap's a backward body;
    their inputs and outputs are now typed: onnxruntime 1.32, its graph optimizations off, could not
    initialize them ("Invalid tensor data type 0")."""
    if op == "SequenceAt":
        nodes = [helper.make_node("SequenceAt", ["s", "p"], ["y"])]
    else:
        body = helper.make_graph(
            [helper.make_node("Mul", ["e", "t"], ["et"]), helper.make_node("Tanh", ["et"], ["o"])],
            "body", [vi("e", None), vi("t", None)], [vi("o", None)])
        nodes = [helper.make_node("SequenceMap", ["s", "t"], ["m"], body=body),
                 helper.make_node("ConcatFromSequence", ["m"], ["y"], axis=0)]
    nodes = [helper.make_node("SplitToSequence", ["x"], ["s"], keepdims=0), *nodes, *_sin_loss("y")]
    rng = np.random.default_rng(3)
    model = _model(nodes, [vi("x", [3, 2])], {"p": np.array(-2), "t": rng.standard_normal(2)})
    x = rng.standard_normal((3, 2))
    got = check_case(model, {"x": x}, ["x", "t"])
    gmodel = build_gradient_model(model, "loss", ["x", "t"])
    from_ort = _session(gmodel).run(None, {"x": x})
    np.testing.assert_allclose(from_ort[1], got["x_grad"], rtol=1e-12)
    if op == "SequenceAt":
        want = np.zeros((3, 2))
        want[1] = np.cos(x[1])
        np.testing.assert_allclose(got["x_grad"], want, rtol=1e-12)


def _twice(kind: str) -> tuple[onnx.ModelProto, dict, list[str]]:
    """A body that outputs one value as two outputs (``loss = Σ sin(y1) + Σ sin(y2 · w)``)."""
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal(3), rng.uniform(0.5, 2.0, 3)
    tail = [helper.make_node("Mul", ["y2", "w"], ["y2w"]), helper.make_node("Sin", ["y1"], ["s1"]),
            helper.make_node("Sin", ["y2w"], ["s2"]), helper.make_node("Add", ["s1", "s2"], ["ss"]),
            helper.make_node("ReduceSum", ["ss"], ["loss"], keepdims=0)]
    if kind == "If":
        then = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"])], "then", [], [vi("t", [3])] * 2)
        other = helper.make_graph(
            [helper.make_node("Cos", ["x"], ["e1"]), helper.make_node("Neg", ["x"], ["e2"])],
            "else", [], [vi("e1", [3]), vi("e2", [3])])
        node = helper.make_node("If", ["c"], ["y1", "y2"], then_branch=then, else_branch=other)
        return _model([node, *tail], [vi("x", [3]), vi("c", [], BOOL)], {"w": w}), \
            {"x": x, "c": np.array(True)}, ["x", "w"]
    if kind == "SequenceMap":
        body = helper.make_graph([helper.make_node("Tanh", ["e"], ["t"])], "body", [vi("e", None)],
                                 [vi("t", None)] * 2)
        nodes = [helper.make_node("SplitToSequence", ["x"], ["s"], keepdims=0),
                 helper.make_node("SequenceMap", ["s"], ["m1", "m2"], body=body),
                 helper.make_node("ConcatFromSequence", ["m1"], ["y1"], axis=0, new_axis=1),
                 helper.make_node("ConcatFromSequence", ["m2"], ["y2"], axis=0, new_axis=1)]
        return _model([*nodes, *tail], [vi("x", [3])], {"w": w}), {"x": x}, ["x", "w"]
    # a Loop carrying one value as two: (a, b) ← (tanh(a · b), the same), twice
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"]), helper.make_node("Mul", ["a", "b"], ["ab"]),
         helper.make_node("Tanh", ["ab"], ["t"])],
        "body", [vi("i", [], I64), vi("c", [], BOOL), vi("a", [3]), vi("b", [3])],
        [vi("c_out", [], BOOL), vi("t", [3]), vi("t", [3])])
    node = helper.make_node("Loop", ["n", "", "x", "w"], ["y1", "y2"], body=body)
    return _model([node, *tail], [vi("x", [3])], {"w": w, "n": np.array(2)}), {"x": x}, ["x", "w"]


@pytest.mark.parametrize("kind", ["If", "SequenceMap", "Loop"])
def test_a_body_outputting_one_value_twice(kind: str) -> None:
    """Each output's gradient counts: before, an If branch or a SequenceMap body outputting one value twice
    kept the gradient of one of them only (measured on the If: ⟨∇L, v⟩ 1.729 against 2.350 by central
    differences), and a Loop carrying one value as two was an error. onnxruntime 1.32 computes such an If
    wrong (its loss here 0.2465, onnx.reference's and the engine's 0.3344) and cannot load such a
    SequenceMap ("Duplicate definition-site"); it checks the Loop."""
    check_case(*_twice(kind), ort_ok=kind == "Loop")


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scan_of_no_step(axis: int) -> None:
    """A Scan over a scan axis of length 0 (state ← tanh(state · x_t)): the state goes through unchanged,
    the scanned input's gradient is empty, shaped as the input, in its type. Before, the backward Loop
    stacked nothing into float32 [0]: that was the gradient (scan axis 0; want float64 [0, 2]), or the
    Transpose to the scan axis failed on it. (onnxruntime 1.32 cannot run such a Scan: it raises, or dies
    of SIGFPE; onnx.reference raises.)"""
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "e"], ["p"]), helper.make_node("Tanh", ["p"], ["s2"]),
         helper.make_node("Identity", ["s2"], ["y"])],
        "body", [vi("s", [2]), vi("e", [2])], [vi("s2", [2]), vi("y", [2])])
    shape = [0, 2] if axis == 0 else [2, 0]
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["s_end", "ys"], body=body, num_scan_inputs=1,
                              scan_input_axes=[axis]),
             helper.make_node("ReduceSum", ["ys"], ["ly"], keepdims=0),
             helper.make_node("Sin", ["s_end"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["ls"], keepdims=0),
             helper.make_node("Add", ["ly", "ls"], ["loss"])]
    model = _model(nodes, [vi("s0", [2]), vi("xs", shape)], {})
    feeds = {"s0": np.array([0.3, -1.2]), "xs": np.zeros(shape)}
    got = check_case(model, feeds, ["s0", "xs"], reference=False, ort_ok=False)  # (nor can onnx.reference)
    assert got["xs_grad"].shape == tuple(shape) and got["xs_grad"].dtype == np.float64
    np.testing.assert_allclose(got["s0_grad"], np.cos(feeds["s0"]), rtol=1e-12)


# ---- where onnxruntime 1.32 or onnx.reference disagree with the spec (the engine follows it) ---------------
@pytest.mark.parametrize("outs", [["s"], ["s2", "s"], ["s2", "e"], ["s2", "s2"]])
def test_scan_body_outputs_that_are_inputs_or_repeated(outs: list[str]) -> None:
    """A Scan body (s, e) → s2 = tanh(s · e) outputting a body input itself, or one value twice: the
    engine's forward against the values by hand and its gradients against central differences (by
    onnx.reference). onnxruntime 1.32 gets these wrong: zeros, or uninitialized memory, for such outputs
    (outs ["s"]: final state [0, 0] for s0 = [1, 2])."""
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "e"], ["p"]), helper.make_node("Tanh", ["p"], ["s2"])],
        "body", [vi("s", [2]), vi("e", [2])], [vi(o, [2]) for o in outs])
    ys = [f"y{k}" for k in range(len(outs) - 1)]
    nodes = [helper.make_node("Scan", ["s0", "xs"], ["s_end", *ys], body=body, num_scan_inputs=1),
             helper.make_node("Sin", ["s_end"], ["t"]),
             helper.make_node("ReduceSum", ["t"], ["l0"], keepdims=0)]
    for y in ys:
        nodes += [helper.make_node("Sin", [y], [f"{y}_sin"]),
                  helper.make_node("ReduceSum", [f"{y}_sin"], [f"{y}_l"], keepdims=0)]
    nodes.append(helper.make_node("Sum", ["l0", *(f"{y}_l" for y in ys)], ["loss"]))
    model = _model(nodes, [vi("s0", [2]), vi("xs", [3, 2])], {})
    rng = np.random.default_rng(6)
    feeds = {"s0": rng.standard_normal(2), "xs": rng.standard_normal((3, 2))}
    states, stacked = [feeds["s0"]], {"s": [], "s2": [], "e": []}
    for e in feeds["xs"]:
        s2 = np.tanh(states[-1] * e)
        for name, val in (("s", states[-1]), ("s2", s2), ("e", e)):
            stacked[name].append(val)
        states.append(s2 if outs[0] == "s2" else states[-1])
    want = np.sin(states[-1]).sum() + sum(np.sin(np.stack(stacked[o])).sum() for o in outs[1:])
    np.testing.assert_allclose(run_engine(model, feeds)[0], want, rtol=1e-12)
    check_case(model, feeds, ["s0", "xs"], ort_ok=False)


def test_loop_without_condition_input_runs_its_trip_count() -> None:
    """A Loop given a trip count and no condition ignores the condition its body outputs (the spec: "cond =
    ...; // ignored"): x ← x + 1 three times, the body's condition false. The engine gives 3 (and the
    gradient 1); onnxruntime 1.32 stops after one iteration (1); onnx.reference runs none (0)."""
    body = helper.make_graph(
        [helper.make_node("Constant", [], ["stop"], value=numpy_helper.from_array(np.array(False))),
         helper.make_node("Add", ["x", "one"], ["x2"])],
        "body", [vi("i", [], I64), vi("c", [], BOOL), vi("x", [])], [vi("stop", [], BOOL), vi("x2", [])])
    nodes = [helper.make_node("Loop", ["n", "", "x0"], ["loss"], body=body)]
    model = _model(nodes, [vi("x0", [])], {"n": np.array(3), "one": np.array(1.0)})
    feeds = {"x0": np.array(0.5)}
    assert float(run_engine(model, feeds)[0]) == 3.5
    got = check_case(model, feeds, ["x0"], reference=False, ort_ok=False)
    assert float(got["x0_grad"]) == 1.0


def test_bag_bounds_that_do_not_follow_one_another() -> None:
    """Bags [1, 3), [0, 2) (overlapping) and [3, 4) (after a gap) of ids [0, 1, 1, 2], summed: the forward
    pools them as the loop does, and the table's gradient (NaN before) is central differences' [[0.823],
    [1.975], [0.514]]."""
    g = Graph(17, np.random.default_rng(8))
    table = g.init(np.array([[0.3], [-0.4], [0.9]]), "table")
    ids, starts, ends = (g.const(v) for v in ([0, 1, 1, 2], [1, 0, 3], [3, 2, 4]))
    br, c, picked = _bag_rows(g, table, ids, starts, ends)
    body = br.graph("bag_body", [vi(br.op("Identity", c), [], BOOL),
                                 vi(br.op("ReduceSum", picked, br.const([0]), keepdims=0), [1])])
    out = g.op("Loop", g.const(3), "", body=body)
    check_case(finish(g, [out]), g.feeds, g.wrt)


def test_an_upgraded_model_keeps_its_names_unique() -> None:
    """An opset-11 model with two ReduceSum(axes) in its main graph and one in a Scan body: upgraded to opset
    17 for its gradient, onnx 1.23's version converter names the Constants of the axes ``_v_<n>`` per graph,
    so the main graph and the body both defined ``_v_8`` and the gradient graph failed onnx.checker (SSA);
    upgrade_opset renames the body's (converter_fixes.unique_body_names)."""
    body = helper.make_graph(
        [helper.make_node("ReduceSum", ["x"], ["b"], axes=[0], keepdims=0),
         helper.make_node("Add", ["s", "b"], ["s2"]), helper.make_node("Mul", ["s2", "e"], ["s3"])],
        "body", [vi("s", []), vi("e", [])], [vi("s3", [])])
    nodes = [helper.make_node("ReduceSum", ["x"], ["m0"], axes=[0], keepdims=0),
             helper.make_node("ReduceSum", ["x"], ["m1"], axes=[0], keepdims=0),
             helper.make_node("Scan", ["m0", "xs"], ["y"], body=body, num_scan_inputs=1),
             helper.make_node("Add", ["y", "m1"], ["loss"])]
    model = _model(nodes, [vi("x", [2]), vi("xs", [3])], {}, opset=11)
    rng = np.random.default_rng(9)
    check_case(model, {"x": rng.standard_normal(2), "xs": rng.standard_normal(3)}, ["x", "xs"])


@pytest.mark.parametrize("axis", [1, -1])
def test_scan_ranks_from_its_body(axis: int) -> None:
    """A Scan along axis 1 over a value whose rank ONNX's shape inference does not find (a Loop's carried
    value, the Loop's body leaving its shapes out; in the random-body fuzz, one whose body reads outer
    values), the Scan's body declaring its inputs' and outputs' shapes: the ranks the gradient needs are
    those plus one. Before, building the gradient failed ("the ranks of the scan inputs and outputs must
    be known")."""
    loop_body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c2"]), helper.make_node("Tanh", ["h"], ["h2"])],
        "loop_body", [vi("i", [], I64), vi("c", [], BOOL), vi("h", None)],
        [vi("c2", [], BOOL), vi("h2", None)])
    body = helper.make_graph(
        [helper.make_node("Mul", ["s", "e"], ["p"]), helper.make_node("Tanh", ["p"], ["s2"]),
         helper.make_node("Sin", ["p"], ["y"])],
        "body", [vi("s", [2]), vi("e", [2])], [vi("s2", [2]), vi("y", [2])])
    nodes = [helper.make_node("Loop", ["one", "", "x"], ["xs"], body=loop_body),
             helper.make_node("Scan", ["s0", "xs"], ["s_end", "ys"], body=body, num_scan_inputs=1,
                              scan_input_axes=[axis], scan_output_axes=[axis]),
             helper.make_node("ReduceSum", ["ys"], ["ly"], keepdims=0),
             helper.make_node("ReduceSum", ["s_end"], ["ls"], keepdims=0),
             helper.make_node("Add", ["ly", "ls"], ["loss"])]
    model = _model(nodes, [vi("s0", [2]), vi("x", [2, 3])], {"one": np.array(1)})
    rng = np.random.default_rng(10)
    check_case(model, {"s0": rng.standard_normal(2), "x": rng.standard_normal((2, 3))}, ["s0", "x"])


# ---- random bodies (tests/engine/control_flow_gen.py) ------------------------------------------------------
RANDOM_SEEDS, RANDOM_DEFAULT = 300, 40
# onnxruntime 1.32, its graph optimizations off, fails to run this seed's gradient graph (a Loop of no
# iteration, M = 2**62): "Shape mismatch attempting to re-use buffer. {0} != {2}" at a Shape of a scan
# output; with its optimizations on, or enable_mem_reuse off, it runs it to the engine's gradients
ORT_REUSE_FAILS = {129}


def _ort_without_reuse(model: onnx.ModelProto, feeds: dict) -> list:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.enable_mem_reuse = False
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, feeds)


@pytest.mark.parametrize("seed", [s if s < RANDOM_DEFAULT else extended(s) for s in range(RANDOM_SEEDS)])
def test_random_bodies(seed: int) -> None:
    """The gradient fuzz's checks (check_case) on a float64 model of If/Loop/Scan nodes with random bodies
    (outer values read at any depth, bodies' own Constants and initializers, appended lists, nesting three
    deep), as onnxruntime computes it right (``spec_equivalent``); where that differs from the model, the
    model's gradients against central differences too (by the engine, which runs the spec)."""
    case = random_case(seed, grad=True)
    try:
        if seed in ORT_REUSE_FAILS:
            got = check_case(case.oracle, case.feeds, case.wrt, reference=False, ort_ok=False)
            gmodel = build_gradient_model(case.oracle, "loss", case.wrt)
            for o, v in zip(gmodel.graph.output, _ort_without_reuse(gmodel, case.feeds)):
                np.testing.assert_allclose(got[o.name], v, rtol=1e-9, atol=1e-11, err_msg=o.name)
        else:
            check_case(case.oracle, case.feeds, case.wrt)
        if case.oracle.SerializeToString() != case.model.SerializeToString():
            check_case(case.model, case.feeds, case.wrt, reference=False, ort_ok=False)
    except Exception as e:
        raise AssertionError(f"random bodies seed {seed} ({case.desc}): {type(e).__name__}: {e}") from e

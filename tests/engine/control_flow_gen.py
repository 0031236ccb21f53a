"""Seeded random models of If, Loop and Scan nodes whose bodies are small random graphs.

Used by the forward fuzz (``tests/engine/test_control_flow_fuzz.py``, against onnxruntime) and the gradient
fuzz (``tests/autodiff/test_control_flow_fuzz.py``, against central differences). A model draws, from its
seed: one to three control-flow nodes in the main graph, each body a random mix of unary and binary ops
over the values it can see (the main graph's inputs and initializers, values computed before the node,
values of every enclosing body), with Constants and initializers of its own, and, down to a random depth,
control-flow nodes of its own (an If in a Loop, a Scan in an If, a Loop in a Scan, ...).

Loops take a trip count, a condition or both (a trip count of 0, a condition false from the start, one
that turns false part way through), carry values of ranks 0 to 2 (and an integer counter), stack scan
outputs of several shapes and types, and sometimes a list they append to. Scans take one to three states
and scan inputs along any axis, in either direction, and stack their outputs along any axis, in either
direction. Bodies sometimes output one of their inputs, or an outer value, as it is.

``grad=False`` adds what only the forward fuzz can check: float32, loop-carried values that grow.

Where onnxruntime 1.32 departs from the ONNX spec (README, "Limits"), :func:`spec_equivalent`
rewrites the model into one that means the same under the spec and that onnxruntime computes right; that
model is the oracle's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

I64, BOOL = TensorProto.INT64, TensorProto.BOOL
UNARY = ("Tanh", "Sin", "Cos", "Sigmoid", "Neg", "Square", "Identity")
BINARY = ("Add", "Sub", "Mul")


@dataclass
class Scope:
    """A graph under construction (the main graph or a body) and the values it can read."""

    gen: Gen
    parent: Scope | None = None
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    inputs: list = field(default_factory=list)
    own: list = field(default_factory=list)  # (name, shape) defined here
    depth: int = 0

    @property
    def visible(self) -> list[tuple[str, tuple]]:
        """Float values this graph can read: its own, then its enclosing graphs'."""
        return self.own + (self.parent.visible if self.parent is not None else [])

    def child(self) -> Scope:
        return Scope(self.gen, self, depth=self.depth + 1)

    def op(self, op: str, *inputs: str, outputs: int = 1, **attrs) -> str | list[str]:
        outs = [self.gen.name(op.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op, list(inputs), outs, **attrs))
        return outs[0] if outputs == 1 else outs

    def const(self, value, dtype=np.int64) -> str:
        return self.op("Constant", value=numpy_helper.from_array(np.array(value, dtype)))

    def reduce_sum(self, x: str, axes: list[int] | None = None) -> str:
        if axes is None:
            return self.op("ReduceSum", x, keepdims=0)
        if self.gen.opset < 13:
            return self.op("ReduceSum", x, axes=axes, keepdims=0)
        return self.op("ReduceSum", x, self.const(axes), keepdims=0)

    def unary(self, x: str) -> str:
        kind = str(self.gen.rng.choice(UNARY))
        if kind == "Square":
            return self.op("Mul", x, x)
        return self.op(kind, x)

    def fit(self, v: str, shape: tuple, to: tuple) -> str:
        """``v`` (of ``shape``) summed down so that it broadcasts to ``to`` without growing it."""
        if len(shape) <= len(to) and all(x in (1, y) for x, y in zip(shape[::-1], to[::-1])):
            return v
        extra = len(shape) - len(to)
        if extra > 0 and to and shape[extra:] == to:
            return self.reduce_sum(v, list(range(extra)))
        return self.reduce_sum(v)

    def own_value(self, shape: tuple) -> str:
        """A value of this graph's own: a Constant or (in a body, or in the main graph untrained) an
        initializer."""
        g = self.gen
        data = g.normal(*shape)
        if g.rng.random() < 0.5:
            return self.op("Constant", value=numpy_helper.from_array(data))
        name = g.name("binit" if self.parent is not None else "k")
        self.inits.append(numpy_helper.from_array(data, name))
        return name

    def start(self, shape: tuple) -> str:
        """A value of ``shape`` from a random visible one (summed down, or grown by adding a value of this
        graph's own)."""
        name, sh = self.pick()
        v = self.fit(name, sh, shape)
        return v if sh == shape else self.op("Add", v, self.own_value(shape))

    def pick(self) -> tuple[str, tuple]:
        vis = self.visible
        return vis[int(self.gen.rng.integers(len(vis)))]

    def as_output(self, name: str) -> str:
        """``name`` as an output of this graph: as it is when the graph defines it (one of its inputs or
        a node's output), else through an Identity (ONNX wants a graph's outputs defined in it)."""
        if any(name == n for n, _ in self.own) or any(name == v.name for v in self.inputs):
            return name
        return self.op("Identity", name)

    def chain(self, x: str, shape: tuple, depth: int) -> str:
        """A random mix of unary ops on ``x`` and binary ops with visible values or this graph's own."""
        rng = self.gen.rng
        for _ in range(depth):
            r = rng.random()
            if r < 0.5:
                other, osh = self.pick()
                other = self.fit(other, osh, shape)
            elif r < 0.6:
                other = self.own_value(shape if rng.random() < 0.5 else ())
            else:
                x = self.unary(x)
                continue
            a, b = (x, other) if rng.random() < 0.7 else (other, x)
            x = self.op(str(rng.choice(BINARY)), a, b)
        return self.op("Tanh", x)  # keeps values in (-1, 1) through any number of iterations

    def graph(self, name: str, outputs: list) -> onnx.GraphProto:
        return helper.make_graph(self.nodes, name, self.inputs, outputs, self.inits)


@dataclass
class Case:
    model: onnx.ModelProto
    feeds: dict
    wrt: list
    desc: str
    oracle: onnx.ModelProto  # the model onnxruntime computes right, meaning the same (spec_equivalent)


class Gen:
    """The state of one draw: the seed's generator, names, opset, element type, dims."""

    def __init__(self, seed: int, grad: bool):
        self.rng = np.random.default_rng(seed)
        self.grad = grad
        self.opset = int(self.rng.choice([11, 13, 16, 19, 21]))
        self.dtype = np.float64 if grad or self.rng.random() < 0.5 else np.float32
        self.et = helper.np_dtype_to_tensor_dtype(np.dtype(self.dtype))
        self.a, self.b = (int(v) for v in self.rng.integers(1, 4, 2))
        if not grad and self.rng.random() < 0.1:  # an empty dim: values of no element in every body
            self.a, self.b = [(0, self.b), (self.a, 0)][int(self.rng.integers(2))]
        self.n = 0
        self.feeds: dict = {}
        self.wrt: list = []
        self.kinds: list = []
        self.zero_scans: dict[str, list[tuple]] = {}  # a Scan of no step: its first output -> outputs' shapes

    def name(self, prefix: str) -> str:
        self.n += 1
        return f"{prefix}_{self.n}"

    def normal(self, *shape: int, scale: float = 1.0) -> np.ndarray:
        return (self.rng.standard_normal(shape) * scale).astype(self.dtype)

    def vi(self, name: str, shape, et: int | None = None) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, self.et if et is None else et,
                                             None if shape is None else list(shape))

    def shape(self) -> tuple:
        return [(), (self.b,), (self.a, self.b)][int(self.rng.integers(3))]

    # ---- control-flow nodes ------------------------------------------------------------------------
    def control_flow(self, s: Scope, depth: int) -> list[tuple[str, tuple]]:
        """A random If, Loop or Scan node in ``s`` whose bodies nest down to ``depth`` more levels; its
        float outputs (name, shape)."""
        kind = str(self.rng.choice(["if", "loop", "scan"]))
        self.kinds.append(f"{kind}@{s.depth}")
        return {"if": self.if_, "loop": self.loop, "scan": self.scan}[kind](s, depth)

    def body_values(self, body: Scope, depth: int) -> None:
        """Sometimes a control-flow node inside ``body`` (its outputs become readable there)."""
        if depth > 0 and self.rng.random() < 0.6:
            body.own += self.control_flow(body, depth - 1)

    def if_(self, s: Scope, depth: int) -> list[tuple[str, tuple]]:
        rng = self.rng
        if rng.random() < 0.5 and s.parent is None:
            cond = self.input(np.array(bool(rng.integers(2))), "flag", train=False)
        else:  # computed: the sign of a visible value's sum
            v, _ = s.pick()
            cond = s.op("Greater", s.reduce_sum(v), s.const(0.0, self.dtype))
        shapes = [self.shape() for _ in range(int(rng.integers(1, 3)))]
        branches = []
        for tag in ("then", "else"):
            br = s.child()
            self.body_values(br, depth)
            outs = []
            for sh in shapes:
                pass_through = [n for n, vsh in br.visible if vsh == sh]
                if pass_through and rng.random() < 0.15:  # a value output as it is
                    outs.append(br.as_output(str(rng.choice(pass_through))))
                elif outs and rng.random() < 0.1 and shapes[0] == sh:  # one value output twice
                    outs.append(outs[0])
                else:
                    outs.append(br.chain(br.start(sh), sh, int(rng.integers(1, 4))))
            branches.append(br.graph(self.name(tag), [self.vi(o, sh) for o, sh in zip(outs, shapes)]))
        ys = s.op("If", cond, outputs=len(shapes), then_branch=branches[0], else_branch=branches[1])
        ys = ys if isinstance(ys, list) else [ys]
        return list(zip(ys, shapes))

    def loop(self, s: Scope, depth: int) -> list[tuple[str, tuple]]:
        rng = self.rng
        mode = str(rng.choice(["trip", "cond", "both"]))
        trip = int(rng.integers(0, 4))
        stop = int(rng.integers(0, 4))
        huge = mode == "both" and rng.random() < 0.3  # M far beyond the iterations the condition allows
        by_data = not self.grad and mode != "trip" and rng.random() < 0.3  # stops on a value too
        go = bool(rng.random() < 0.85)
        # a trip count only: the body's condition is ignored (the spec); sometimes it turns false anyway
        counted = mode != "trip" or rng.random() < 0.5
        ignored_stop = mode == "trip" and counted and rng.random() < 0.5
        table = s.own_value((max(trip if not huge else 0, stop) + 1, self.b))
        carried = [(s.start(sh), sh) for sh in (self.shape() for _ in range(int(rng.integers(1, 4))))]
        seq = self.opset >= 13 and rng.random() < 0.25  # a list appended to every iteration (Loop-13)
        grow = not self.grad and rng.random() < 0.2  # a carried value one row longer every iteration

        br = s.child()
        i, c = self.name("i"), self.name("cond")
        br.inputs = [self.vi(i, [], I64), self.vi(c, [], BOOL)]
        count = self.name("count") if counted else None
        if count:
            br.inputs.append(self.vi(count, [], I64))
        formal = [(self.name("carry"), sh) for _, sh in carried]
        typed = not (rng.random() < 0.2 and (mode == "cond" or trip > 0))  # shapes left out of the body
        br.inputs += [self.vi(f, sh if typed else None) for f, sh in formal]
        seq_in = self.name("list") if seq else None
        if seq_in:
            br.inputs.append(helper.make_value_info(seq_in, helper.make_sequence_type_proto(
                helper.make_tensor_type_proto(self.et, [self.b]))))
        grow_in = self.name("rows") if grow else None
        if grow_in:
            br.inputs.append(self.vi(grow_in, None))
        br.own += formal
        row = br.op("Gather", table, i, axis=0)
        br.own += [(row, (self.b,)), (br.op("Cast", br.op("Mul", i, br.const(3)), to=self.et), ())]
        self.body_values(br, depth)
        outs = []
        for f, sh in formal:
            if rng.random() < 0.15:  # carried through unchanged: the body outputs its input
                outs.append(f)
            else:
                outs.append(br.chain(f, sh, int(rng.integers(1, 4))))
        scans = []
        for _ in range(int(rng.integers(0, 3))):
            pick = rng.random()
            if pick < 0.2:  # a body input or a visible outer value, as it is
                f, sh = br.pick()
                scans.append((br.as_output(f), sh, self.et))
            elif pick < 0.3 and count:
                scans.append((br.op("Mul", i, count), (), I64))
            else:
                sh = self.shape()
                scans.append((br.chain(br.start(sh), sh, int(rng.integers(1, 3))), sh, self.et))
        if count:
            nxt = br.op("Add", count, br.const(1))
            cond_out = br.op("Less", nxt, br.const(stop)) if mode != "trip" or ignored_stop else \
                br.op("Identity", c)
            if by_data:  # and while the first carried value sums above a threshold
                total = br.reduce_sum(outs[0])
                cond_out = br.op("And", cond_out, br.op("Greater", total, br.const(-0.5, self.dtype)))
            results = [(cond_out, [], BOOL), (nxt, [], I64)]
        else:
            results = [(c if rng.random() < 0.3 else br.op("Identity", c), [], BOOL)]
        results += [(o, sh, self.et) for o, (_, sh) in zip(outs, formal)]
        if seq_in:
            v = br.chain(br.start((self.b,)), (self.b,), int(rng.integers(1, 3)))
            results.append((br.op("SequenceInsert", seq_in, v), None, None))
        if grow_in:
            results.append((br.op("Concat", grow_in, br.op("Unsqueeze", row, br.const([0]))
                                   if self.opset >= 13 else br.op("Unsqueeze", row, axes=[0]), axis=0),
                            None, self.et))
        results += scans
        declared = []
        for n, sh, et in results:
            if et is None:
                declared.append(helper.make_value_info(n, helper.make_sequence_type_proto(
                    helper.make_tensor_type_proto(self.et, [self.b]))))
            elif any(n == sc[0] for sc in scans) and rng.random() < 0.2:  # a scan output's shape left out
                declared.append(self.vi(n, None, et))
            else:
                declared.append(self.vi(n, sh, et))
        body = br.graph(self.name("body"), declared)

        m_value = 2**62 if huge else trip
        m_in = (self.input(np.array(m_value), "trip", train=False) if s.parent is None and rng.random() < 0.5
                else s.const(m_value)) if mode != "cond" else ""
        cond_in = (self.input(np.array(go), "go", train=False) if s.parent is None and rng.random() < 0.5
                   else s.const(go, np.bool_)) if mode != "trip" else ""
        starts = ([s.const(0)] if count else []) + [v for v, _ in carried]
        if seq_in:
            first = s.start((self.b,))
            starts.append(s.op("SequenceConstruct", first) if rng.random() < 0.5 else
                          s.op("SequenceEmpty", dtype=self.et))
        if grow_in:
            starts.append(s.own_value((1, self.b)))
        outs = s.op("Loop", m_in, cond_in, *starts, outputs=len(results) - 1, body=body)
        outs = outs if isinstance(outs, list) else [outs]
        got = outs[int(bool(count)):]
        res: list[tuple[str, tuple]] = list(zip(got, [sh for _, sh in carried]))
        rest = got[len(carried):]
        if seq_in:
            lst, rest = rest[0], rest[1:]
            if starts[-1].startswith("sequenceconstruct") or rng.random() < 0.5:
                pos = s.const(int(rng.integers(-1, 1)))
                if starts[-1].startswith("sequenceconstruct"):
                    res.append((s.op("SequenceAt", lst, pos), (self.b,)))
                else:  # the list may be empty: its length times a value
                    n_el = s.op("Cast", s.op("SequenceLength", lst), to=self.et)
                    res.append((s.op("Mul", n_el, s.start((self.b,))), (self.b,)))
            if starts[-1].startswith("sequenceconstruct"):
                res.append((s.reduce_sum(s.op("ConcatFromSequence", lst, axis=0, new_axis=1), [0]),
                            (self.b,)))
        if grow_in:
            res.append((s.reduce_sum(rest[0], [0]), (self.b,)))
            rest = rest[1:]
        for o, (_, sh, et) in zip(rest, scans):  # stacked (iterations, *sh): summed over the iterations
            if et == I64:
                res.append((s.op("Cast", s.reduce_sum(o), to=self.et), ()))
            elif rng.random() < 0.5:
                res.append((s.reduce_sum(o, [0]), sh))
            else:
                res.append((s.reduce_sum(o), ()))
        self.kinds[-1] += (f"({mode} M={trip} stop={stop} go={go} ignored_stop={ignored_stop} huge={huge} "
                           f"by_data={by_data} seq={seq} grow={grow} typed={typed})")
        return res

    def scan(self, s: Scope, depth: int) -> list[tuple[str, tuple]]:
        rng = self.rng
        nested = s.parent is not None
        length = int(rng.integers(0, 4)) if not nested else 0
        states = [(s.start(sh), sh) for sh in (self.shape() for _ in range(int(rng.integers(1, 3))))]
        xs, elems, in_axes, in_dirs = [], [], [], []
        if nested:  # scan a visible value of rank 2 or 1 along one of its axes
            cands = [(n, sh) for n, sh in s.visible if len(sh) >= 1]
            n0, sh0 = cands[int(rng.integers(len(cands)))]
            axis = int(rng.integers(len(sh0)))
            length = sh0[axis]
            xs.append(n0)
            elems.append(sh0[:axis] + sh0[axis + 1:])
            in_axes.append(axis - len(sh0) if rng.random() < 0.3 else axis)
            in_dirs.append(int(rng.integers(2)))
        for _ in range(int(rng.integers(0 if nested else 1, 3))):
            sh = self.shape()
            axis = int(rng.integers(len(sh) + 1))
            full = (*sh[:axis], length, *sh[axis:])
            data = self.normal(*full)
            if s.parent is None and rng.random() < 0.6:
                xs.append(self.input(data, "xs"))
            else:
                xs.append(s.own_value(full) if s.parent is not None else self.init(data, "xs"))
            elems.append(sh)
            in_axes.append(axis - len(full) if rng.random() < 0.3 else axis)
            in_dirs.append(int(rng.integers(2)))
        br = s.child()
        fs = [(self.name("state"), sh) for _, sh in states]
        fx = [(self.name("elem"), sh) for sh in elems]
        br.inputs = [self.vi(f, sh) for f, sh in fs + fx]
        br.own += fs + fx
        self.body_values(br, depth)
        new_states = [(f if rng.random() < 0.15 else br.chain(f, sh, int(rng.integers(1, 4))), sh)
                      for f, sh in fs]
        outs = []
        for _ in range(int(rng.integers(0, 3))):
            if rng.random() < 0.2:
                f, sh = br.pick()  # an input, an outer value or a new state, as it is
                f = br.as_output(f)
            elif new_states and rng.random() < 0.1:
                f, sh = new_states[0]
            else:
                sh = self.shape()
                f = br.chain(br.start(sh), sh, int(rng.integers(1, 3)))
            outs.append((f, sh))
        out_axes = [int(rng.integers(-len(sh) - 1, len(sh) + 1)) for _, sh in outs]
        out_dirs = [int(rng.integers(2)) for _ in outs]
        body = br.graph(self.name("scan_body"), [self.vi(f, sh) for f, sh in new_states + outs])
        attrs = {"num_scan_inputs": len(xs)}
        if any(in_axes) or rng.random() < 0.3:
            attrs["scan_input_axes"] = in_axes
        if any(in_dirs):
            attrs["scan_input_directions"] = in_dirs
        if outs and (any(out_axes) or rng.random() < 0.3):
            attrs["scan_output_axes"] = out_axes
        if any(out_dirs):
            attrs["scan_output_directions"] = out_dirs
        ys = s.op("Scan", *[v for v, _ in states], *xs, outputs=len(states) + len(outs), body=body, **attrs)
        ys = ys if isinstance(ys, list) else [ys]
        stacked = []
        for (_, sh), ax in zip(outs, out_axes):
            a = ax % (len(sh) + 1)
            stacked.append((*sh[:a], length, *sh[a:]))
        if length == 0:
            self.zero_scans[ys[0]] = stacked
        self.kinds[-1] += (f"(L={length} axes={in_axes} dirs={in_dirs} out_axes={out_axes} "
                           f"out_dirs={out_dirs})")
        res = list(zip(ys, [sh for _, sh in states]))
        for y, st in zip(ys[len(states):], stacked):  # summed down to a row or a scalar
            if len(st) > 1 and st[-1] == self.b:
                res.append((s.reduce_sum(y, list(range(len(st) - 1))), (self.b,)))
            else:
                res.append((s.reduce_sum(y), ()))
        return res

    # ---- main graph --------------------------------------------------------------------------------
    def input(self, array: np.ndarray, prefix: str, train: bool = True) -> str:
        name = self.name(prefix)
        self.main.inputs.append(helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(array.dtype), list(array.shape)))
        self.feeds[name] = array
        if train:
            self.wrt.append(name)
        return name

    def init(self, array: np.ndarray, prefix: str, train: bool = True) -> str:
        name = self.name(prefix)
        self.main.inits.append(numpy_helper.from_array(array, name))
        if train:
            self.wrt.append(name)
        return name

    def model(self) -> Case:
        rng = self.rng
        self.main = s = Scope(self)
        x = self.input(self.normal(self.a, self.b), "x")
        w = self.init(self.normal(self.a, self.b, scale=0.7), "w")
        v = self.init(self.normal(self.b), "v")
        s.own += [(x, (self.a, self.b)), (w, (self.a, self.b)), (v, (self.b,))]
        s.own.append((s.op("Tanh", s.op("Mul", x, w)), (self.a, self.b)))
        terms = []
        for _ in range(int(rng.integers(1, 3))):
            got = self.control_flow(s, int(rng.integers(0, 3)))
            s.own += got
            terms += got
        terms = [t for t in terms if rng.random() < 0.8] or terms[:1]
        terms = list(dict(terms).items())  # each once (a pass-through may give one twice)
        parts = []
        for t, _ in terms:
            c = self.init(np.array(rng.uniform(0.5, 1.5), self.dtype), "c", train=False)
            parts.append(s.op("Mul", s.reduce_sum(s.op("Sin", t)), c))
        s.nodes.append(helper.make_node("Sum", parts, ["loss"]))
        outputs = [self.vi("loss", [])] + [self.vi(t, sh) for t, sh in terms if t not in self.feeds]
        graph = s.graph("fuzz", outputs)
        opsets = [helper.make_opsetid("", self.opset)]
        model = helper.make_model(graph, opset_imports=opsets)
        model.ir_version = min(helper.find_min_ir_version_for(opsets), 10)
        desc = f"opset {self.opset} {np.dtype(self.dtype).name} a={self.a} b={self.b} {' '.join(self.kinds)}"
        empty = 0 in (self.a, self.b)
        oracle = spec_equivalent(model, self.zero_scans, REWRITES + ("out_axes",) * empty)
        return Case(model, self.feeds, self.wrt, desc, oracle)


def random_case(seed: int, grad: bool = False) -> Case:
    """The model of ``seed`` (``grad``: float64 and only what the gradient builder differentiates)."""
    return Gen(seed, grad).model()


# ---- the oracle's model ------------------------------------------------------------------------------------
REWRITES = ("loop_cond", "outputs", "zero_scans")  # (and "out_axes", asked for by models with an empty dim)


def spec_equivalent(model: onnx.ModelProto, zero_scans: dict[str, list[tuple]],
                    rewrites: tuple[str, ...] = REWRITES) -> onnx.ModelProto:
    """A copy of ``model`` that means the same under the ONNX spec, rewritten around onnxruntime 1.32's
    departures from it: a Loop with a trip count and no condition input gets a body whose condition is
    its input (the spec ignores the body's); a body output that is one of the body's inputs, an outer value
    or another output of the body goes through an Identity; a Scan of no step becomes its states (Identity)
    and empty Constants of the scan outputs' shapes. ``rewrites`` picks some of the three (REWRITES).
    "out_axes" (for a model with an empty dim: onnxruntime 1.32 dies of SIGFPE on a Scan that stacks
    values of shape [0] along axis 1 or scans a [3, 3, 0] input along axis 1) Transposes a Scan's inputs
    to scan them along axis 0, and stacks its outputs along axis 0 and Transposes them to their axes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    counter = [0]

    def fresh() -> str:
        counter[0] += 1
        return f"spec_{counter[0]}"

    def rewrite(graph: onnx.GraphProto, is_body: bool) -> None:
        nodes = []
        for node in graph.node:
            for a in node.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    rewrite(a.g, True)
            if "loop_cond" in rewrites and node.op_type == "Loop" and node.input[0] and not (
                    len(node.input) > 1 and node.input[1]):
                body = next(a.g for a in node.attribute if a.name == "body")
                out = fresh()
                body.node.append(helper.make_node("Identity", [body.input[1].name], [out]))
                body.output[0].name = out
            if "zero_scans" in rewrites and node.op_type == "Scan" and node.output[0] in zero_scans:
                body = next(a.g for a in node.attribute if a.name == "body")
                n_states = len(body.output) - len(zero_scans[node.output[0]])
                et = [o.type.tensor_type.elem_type for o in body.output][n_states:]
                for k in range(n_states):
                    nodes.append(helper.make_node("Identity", [node.input[k]], [node.output[k]]))
                for o, sh, t in zip(node.output[n_states:], zero_scans[node.output[0]], et):
                    dtype = helper.tensor_dtype_to_np_dtype(t)
                    nodes.append(helper.make_node("Constant", [], [o], value=numpy_helper.from_array(
                        np.zeros(sh, dtype))))
                continue
            in_axes = next((a for a in node.attribute if a.name == "scan_input_axes"), None)
            if "out_axes" in rewrites and node.op_type == "Scan" and in_axes is not None and \
                    any(in_axes.ints):
                m_in = len(in_axes.ints)
                for q, axis in enumerate(in_axes.ints):
                    k = len(node.input) - m_in + q
                    rank = len(next(a.g for a in node.attribute if a.name == "body").input[k].type.tensor_type
                               .shape.dim) + 1
                    axis %= rank
                    if axis:
                        first = fresh()
                        perm = [axis, *range(axis), *range(axis + 1, rank)]
                        nodes.append(helper.make_node("Transpose", [node.input[k]], [first], perm=perm))
                        node.input[k] = first
                del in_axes.ints[:]
                in_axes.ints.extend([0] * m_in)
            nodes.append(node)
            axes = next((a for a in node.attribute if a.name == "scan_output_axes"), None)
            if "out_axes" in rewrites and node.op_type == "Scan" and axes is not None and any(axes.ints):
                body = next(a.g for a in node.attribute if a.name == "body")
                n_states = len(body.output) - len(axes.ints)
                for k, axis in enumerate(axes.ints):
                    rank = len(body.output[n_states + k].type.tensor_type.shape.dim) + 1
                    axis %= rank
                    if axis:
                        stacked = fresh()
                        perm = [*range(1, axis + 1), 0, *range(axis + 1, rank)]
                        nodes.append(helper.make_node("Transpose", [stacked], [node.output[n_states + k]],
                                                      perm=perm))
                        node.output[n_states + k] = stacked
                del axes.ints[:]
                axes.ints.extend([0] * (len(body.output) - n_states))
        del graph.node[:]
        graph.node.extend(nodes)
        if is_body and "outputs" in rewrites:
            made = {o for n in graph.node for o in n.output}
            seen: set = set()
            for o in graph.output:
                if o.name not in made or o.name in seen:
                    new = fresh()
                    graph.node.append(helper.make_node("Identity", [o.name], [new]))
                    seen.add(new)
                    o.name = new
                else:
                    seen.add(o.name)

    rewrite(m.graph, False)
    return m

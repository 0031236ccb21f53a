"""Elementwise clusters: one step per connected chain of ufuncs, with pooled scratch (cache-blocked over
large arrays: :mod:`onnxtrain.engine.fusion.blocked`)."""

from __future__ import annotations

import contextlib
import functools
import heapq
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import helper

from onnxtrain.engine.donation import donated_now
from onnxtrain.engine.exact_rounding import rounds_exactly
from onnxtrain.engine.fusion.blocked import Blocked, ScratchPool, release_ended, run_group
from onnxtrain.engine.fusion.common import consumers, make_step, producers, protected_slots, run_steps
from onnxtrain.engine.fusion.gemm import matmul_product_side
from onnxtrain.engine.fusion.shapes import is_memoized
from onnxtrain.engine.fusion.ufuncs import (
    OWN_KERNEL_OPS,
    UFUNCS,
    compile_program,
    member_ufunc,
    runs_as_ufunc,
)
from onnxtrain.engine.kernels.buffering import UnbufferedUfunc, broadcast_size
from onnxtrain.engine.kernels.half import is_half
from onnxtrain.engine.kernels.spread import spread, spread_shape
from onnxtrain.engine.registry import Attrs, find_kernel
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

MIN_POOLED = 256  # elements: smaller values are cheaper to allocate than to look up
# input signatures (shapes and dtypes) a cluster keeps a program for: a run over many shapes (every
# (batch, seq) of a data set) would otherwise keep one per shape for the session's life (a tiny GPT over
# 1,000 shapes: +14 MiB); a fixed-shape loop keeps its one program and its one lookup. Once the cluster
# holds that many, a new signature runs its members one by one (no trace) until it has come back
# PROMOTE_AFTER times; then it is traced and the oldest program dropped (a hot shape that comes late is
# compiled; a cycle through more shapes than the bound traces a quarter as often as it would)
MAX_PROGRAMS = 128
PROMOTE_AFTER = 4


def expand_sums(plan: Plan, steps: list[Step]) -> list[Step]:
    """Rewrite each ``Sum`` of two or more inputs as a chain of ``Add`` steps, in the Sum kernel's order
    ((a + b) + c) + ..., so bit-identical: the Adds can join the elementwise cluster of the values they sum
    (the gradient contributions of a tensor used several times, e.g. in the exported tanh GELU), which
    then need not be written out whole to be summed by a separate step.

    Only Sums known to be of float32, float64 or a non-float type: the Sum kernel adds float16/bfloat16 in
    float32 and rounds once, which Adds in the half type would not reproduce (nor one of unknown type)."""
    from onnxtrain.engine.plan import Step, expanded_sum_doc

    add = find_kernel("Add", plan.opset, "")
    name_of = {v: k for k, v in plan.slot.items()}
    sums = [st for st in steps if st.node.op_type == "Sum" and st.node.domain in DEFAULT_DOMAINS
            and len(st.inputs) >= 2 and min(st.inputs) >= 0]
    if not sums:
        return steps
    dtypes = _sum_dtypes(plan, sums)
    expand = {id(st) for st, dt in zip(sums, dtypes) if dt is not None and not is_half(dt)}
    out: list[Step] = []
    for st in steps:
        ins = st.inputs
        if id(st) not in expand:
            out.append(st)
            continue
        acc = ins[0]
        for i, s in enumerate(ins[1:], start=1):
            if i == len(ins) - 1:
                dst = st.outputs[0]
            else:
                name = f"{st.node.output[0]}/partial_sum_{i}"
                while name in plan.slot:
                    name += "_"
                dst = plan.slot[name] = plan.n_slots
                name_of[dst] = name
                plan.n_slots += 1
            node = helper.make_node(
                "Add", [name_of[acc], name_of[s]], [name_of[dst]], name=f"{st.node.name or 'Sum'}/add_{i}"
            )
            # (a failure or a stop before it names the Sum, the graph's node: Plan._raise_failed, _next_node)
            node.doc_string = expanded_sum_doc(st.node, st.node.input[:i])
            attrs = Attrs({}, "Add", node.name, plan.opset, 1, (True,))
            out.append(Step(add, (acc, s), (dst,), attrs, (), node))
            acc = dst
    return out


def _sum_dtypes(plan: Plan, sums: Sequence[Step]) -> list[np.dtype | None]:
    """The element type T of each Sum in ``sums`` as a run gives it: from the graph's typed inputs (sessions
    check their feeds), its initializers and Constants, carried through the nodes before the Sum by their
    schemas (:class:`~onnxtrain.engine.node_checks.NodeChecker` without the graph's declarations); None
    where that does not tell. A type the graph declares of any other value (value_info, graph outputs) is
    not read: nothing checks it where its sources' types are unknown (a SequenceAt's, an If's with untyped
    branches, an untyped graph input's), and a stale float32 declaration of a float16 Sum expanded it into
    float16 Adds."""
    from onnxtrain.engine.node_checks import NodeChecker, _bind, _output_types, checked_opsets
    from onnxtrain.ir.types import TENSOR_TYPE_STRINGS, type_string

    g = plan.model.graph
    known = {v.name: t for v in g.input if (t := type_string(v.type)) is not None}
    known.update((t.name, TENSOR_TYPE_STRINGS[t.data_type]) for t in g.initializer
                 if t.data_type in TENSOR_TYPE_STRINGS)
    name_of = {v: k for k, v in plan.slot.items()}
    known.update((name_of[s], t) for s, v in plan._const_values
                 if s in name_of and (t := _tensor_type(v.dtype)) is not None)
    checker = NodeChecker(checked_opsets(plan.model), None, known)
    types = checker.types
    wanted = {n for st in sums for n in st.node.input if n}
    last = max((k for k, node in enumerate(g.node) if wanted.intersection(node.output)), default=-1)
    for node in g.node[:last + 1]:  # (the plan has checked the nodes: only their output types are wanted)
        form = checker.form(node)
        if form is not None:
            bound = _bind(form, node.input, types)
            if not isinstance(bound, str):
                outs = node.output
                types.update((outs[j], t) for j, t in _output_types(node, form, outs, bound, types))
    found: list[np.dtype | None] = []
    for st in sums:
        seen = {types.get(n) for n in st.node.input}
        found.append(_SUM_TYPES.get(seen.pop()) if len(seen) == 1 else None)
    return found


# a Sum's type string → its element type (Sum takes float types only)
_SUM_TYPES = {"tensor(float16)": np.dtype(np.float16), "tensor(float)": np.dtype(np.float32),
              "tensor(double)": np.dtype(np.float64)}


def _tensor_type(dt: np.dtype) -> str | None:
    """The type string of a tensor of numpy dtype ``dt`` when it is one of :data:`_SUM_TYPES`', else None."""
    return next((t for t, d in _SUM_TYPES.items() if d == dt), None)


def fuse_elementwise(plan: Plan, steps: list[Step]) -> list[Step]:
    """Group connected elementwise steps into clusters of two or more and run each as one step."""
    cons, kept = consumers(steps), protected_slots(plan)
    members = _clusters(steps, _fusable(plan, steps, cons, kept), cons)
    groups = [
        sorted(v)
        for v in members.values()
        if len(v) >= 2 and sum(steps[i].node.op_type in UFUNCS for i in v) >= 2
    ]
    if not groups:
        return steps
    replace: dict[int, Step] = {}
    drop: set[int] = set()
    for idx in groups:
        step = _cluster_step(plan, steps, idx, cons, kept)
        if step is not None:
            replace[idx[-1]] = step
            drop.update(idx[:-1])
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _fusable(plan: Plan, steps: list[Step], cons: dict[int, list[int]], kept: set[int]) -> list[bool]:
    """Whether each step may join an elementwise cluster."""
    eligible = set(UFUNCS) | OWN_KERNEL_OPS
    bias_adds = _matmul_bias_adds(plan, steps, cons, kept)
    out = []
    for k, st in enumerate(steps):
        ok = (
            st.node.op_type in eligible
            and st.node.domain in DEFAULT_DOMAINS
            and all(s >= 0 for s in st.outputs)
            and not is_memoized(st)
            and not rounds_exactly(st.fn)
        )
        if (st.node.op_type == "Relu" and len(st.inputs) != 1) or k in bias_adds:
            ok = False
        out.append(ok)
    return out


def _clusters(steps: list[Step], fusable: list[bool], cons: dict[int, list[int]]) -> dict[int, list[int]]:
    """The clusters (id → step indices, in no particular order) of the ``fusable`` steps: each joins the
    clusters it reads from whose every consumer before it lies inside them (the fused step runs at the
    position of its last member), merged into the one of lowest id, else starts its own."""
    cluster_of_slot: dict[int, int] = {}  # slot → cluster id of its producer
    members: dict[int, list[int]] = {}  # cluster id → step indices
    merged_into: dict[int, int] = {}
    joined: dict[int, int] = {}  # step index → id of the cluster it joined (before later merges)
    # cluster id → heap of the consumers of its values; those that joined it since are dropped on the way
    readers: dict[int, list[int]] = {}

    def find(c: int) -> int:
        root = c
        while root in merged_into:
            root = merged_into[root]
        while c != root:  # path compression
            nxt = merged_into[c]
            merged_into[c] = root
            c = nxt
        return root

    def legal(c: int, k: int) -> bool:
        """Every consumer of cluster ``c``'s values before step ``k`` lies inside ``c``."""
        heap = readers[c]
        while heap and heap[0] < k and joined.get(heap[0]) is not None and find(joined[heap[0]]) == c:
            heapq.heappop(heap)
        return not heap or heap[0] >= k

    for k, st in enumerate(steps):
        if not fusable[k]:
            continue
        cands = {find(cluster_of_slot[s]) for s in st.inputs if s in cluster_of_slot}
        legal_ids = [c for c in sorted(cands) if legal(c, k)]
        if legal_ids:
            # each legal cluster's early consumers lie inside it, so those of the union lie in the union
            cid = legal_ids[0]
            for c in legal_ids[1:]:
                members[cid] = _union(members[cid], members.pop(c))
                readers[cid] = _merge_heaps(readers[cid], readers.pop(c))
                merged_into[c] = cid
            members[cid].append(k)
        else:
            cid = k
            members[cid], readers[cid] = [k], []
        joined[k] = cid
        heap = readers[cid]
        for s in st.outputs:
            cluster_of_slot[s] = cid
            for j in cons.get(s, ()):
                heapq.heappush(heap, j)
    return members


def _union(a: list[int], b: list[int]) -> list[int]:
    """``a`` and ``b`` as one list: the smaller appended to the larger (the order does not matter)."""
    if len(a) < len(b):
        a, b = b, a
    a += b
    return a


def _merge_heaps(a: list[int], b: list[int]) -> list[int]:
    """The heaps ``a`` and ``b`` as one: the smaller pushed into the larger."""
    if len(a) < len(b):
        a, b = b, a
    for j in b:
        heapq.heappush(a, j)
    return a


def _cluster_step(
    plan: Plan, steps: list[Step], idx: list[int], cons: dict[int, list[int]], kept: set[int]
) -> Step | None:
    """The fused step of the steps ``idx`` (ascending), or None when none of their outputs is read outside."""
    group = set(idx)
    mem = [steps[i] for i in idx]
    produced = {s for st in mem for s in st.outputs}
    ext = list(dict.fromkeys(s for st in mem for s in st.inputs if s not in produced))
    escaping = [
        s for st in mem for s in st.outputs if s in kept or any(j not in group for j in cons.get(s, ()))
    ]
    if not escaping:
        return None
    escaping_set = set(escaping)
    internal_only = {
        s
        for s in produced
        if s not in escaping_set and all(steps[j].node.op_type in UFUNCS for j in cons.get(s, ()))
    }
    fn = Cluster(plan, mem, ext, escaping, internal_only, plan.scratch)
    return make_step(plan, "FusedElementwise", mem, ext, escaping, fn)


def _matmul_bias_adds(plan: Plan, steps: list[Step], cons: dict[int, list[int]], kept: set[int]) -> set[int]:
    """The steps ``Add(MatMul(A, B), bias)``, nothing else reading the product and the bias a declared vector
    of more than one element (a Linear layer's bias): left out of clusters, they add the bias into the
    product in place (:func:`onnxtrain.engine.fusion.gemm.fuse_matmul_bias`), which costs less than a
    cluster's pass writing a new array: the exported GELU's first op, 0.5 M values, took 88 µs of the
    cluster's 1.04 ms, and the transformer's forward went 10.02 → 9.61 ms (legacy training step 36.0 → 35.4
    ms), the same bits."""
    prod = producers(steps)
    # one element (a scalar) would join a cluster's cache-blocked loop instead: those stay in clusters
    vectors = {plan.slot[n] for n, v in plan.initializers.items() if v.ndim == 1 and v.size > 1}
    vectors |= {plan.slot[n] for n, dims in plan.input_shapes.items() if dims is not None and len(dims) == 1
                and dims[0] != 1}
    out = set()
    for k, st in enumerate(steps):
        side = matmul_product_side(steps, k, prod, cons, kept)
        if side is not None and st.inputs[1 - side] in vectors:
            out.add(k)
    return out


class Cluster:
    """The kernel of one elementwise cluster; specialised per signature of its inputs on first use (at most
    :data:`MAX_PROGRAMS` signatures kept, see there)."""

    def __init__(
        self,
        plan: Plan,
        members: list[Step],
        ext: list[int],
        escaping: list[int],
        poolable: set[int],
        pool: ScratchPool,
    ):
        self.plan = plan
        self.members = members
        self.ext = ext
        self.escaping = escaping
        self.poolable = poolable
        self.pool = pool
        # outputs are new arrays (or donated inputs' memory) unless an Identity or Cast hands an input through
        passed = set(ext)
        for m in members:
            if m.node.op_type in ("Identity", "Cast") and passed.intersection(m.inputs):
                passed.update(m.outputs)
        self.fresh_outputs = not passed.intersection(escaping)
        self.reusable: frozenset[int] = frozenset()
        self.grouped = False  # a member of a ClusterGroup: its larger loops go to the group's one job
        self.programs: dict[tuple, list] = {}  # signature → program, oldest first
        self.misses: dict[tuple, int] = {}  # signatures run unfused since the programs were full → runs

    def __call__(self, inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        sig = tuple((a.shape, a.dtype) if type(a) is np.ndarray else type(a) for a in inputs)
        prog = self.programs.get(sig)
        if prog is None:
            if len(self.programs) < MAX_PROGRAMS:
                return self._trace(sig, inputs)
            return self._miss(sig, inputs)
        pool = self.pool
        if not pool.lock.acquire(blocking=False):
            return self._fallback(inputs)
        try:
            blocked = prog[5]
            if prog[4] != pool.version:  # the pool grew since: take views of its new arrays
                if blocked is None:
                    prog[3] = compile_program([
                        (k, f, i, o, pool.view(*b) if k == 0 else b, e) for k, f, i, o, b, e in prog[0]
                    ])
                else:
                    blocked.take_views(pool)
                prog[4] = pool.version
            donated = donated_now() & self.reusable if self.reusable else None
            if blocked is None and donated and prog[6] is not None:
                # the blocked program that writes into them; its scratch is taken on first use
                blocked = prog[6]
                if blocked.views_version != pool.version:
                    blocked.take_views(pool)
                    blocked.views_version = pool.version
            if blocked is not None:
                return blocked.run(inputs, donated)
            vals = list(inputs)
            vals.extend([None] * prog[1])
            prog[3](vals)
            return [vals[i] for i in prog[2]]
        finally:
            pool.lock.release()

    def allow_reuse(self, slots: frozenset[int]) -> frozenset[int]:
        """Let the cluster write its outputs into the graph inputs ``slots`` when a run donates them (the plan
        found nothing reads them after this step); returns the ones among its inputs."""
        self.reusable = frozenset(slots) & frozenset(self.ext)
        return self.reusable

    def _miss(self, sig: tuple, inputs: Sequence[Any]) -> list[Any]:
        """A signature beyond the programs kept: its members one by one, traced once it comes back often."""
        misses = self.misses
        n = misses.pop(sig, 0) + 1
        if n >= PROMOTE_AFTER:
            return self._trace(sig, inputs)  # (_store drops the oldest program)
        if len(misses) >= 2 * MAX_PROGRAMS:  # (a bound on the counts too)
            misses.clear()
        misses[sig] = n
        return self._fallback(inputs)

    def _fallback(self, inputs: Sequence[Any]) -> list[Any]:
        env = dict(zip(self.ext, inputs))
        run_steps(self.plan, self.members, env)
        return [env[s] for s in self.escaping]

    def _last_uses(self) -> dict[int, int]:
        """Each value read inside the cluster → the index of the last member reading it."""
        last: dict[int, int] = {}
        for k, st in enumerate(self.members):
            for s in st.inputs:
                last[s] = k
        return last

    def _traced_run(self, inputs: Sequence[Any], last: dict[int, int]) -> dict[int, Any]:
        """Run the original kernels, keeping every value's shape and dtype but not the memory of those that
        died inside the cluster (``last``: :meth:`_last_uses`; a zero-stride stand-in replaces them): the
        first run, which traces, must not need more memory than the later ones."""
        env = dict(zip(self.ext, inputs))
        keep = set(self.escaping) | set(self.ext)
        for k, st in enumerate(self.members):
            run_steps(self.plan, [st], env)
            for s in st.inputs:
                v = env.get(s)
                if last.get(s) == k and s not in keep and type(v) is np.ndarray and v.size > 1:
                    env[s] = np.broadcast_to(np.zeros((), v.dtype), v.shape)
        return env

    def _trace(self, sig: tuple, inputs: Sequence[Any]) -> list[Any]:
        """Run the original kernels once, then build the program for this input signature.

        Storage: an op whose input dies there (an array made inside the cluster, same shape and dtype)
        writes into that input (a chain of such ops is one "group" of values sharing a buffer). A group
        holding an escaping value, or a value an own-kernel member reads (it might return it as is), is
        a fresh array each run; other groups use scratch buffers of the pool, reused once they die.

        Over large arrays the kernels run on a slice of two entries of the longest axis (every member is
        elementwise), and the program then computes the whole: a first run whose outputs are whole new
        arrays would hold an optimizer update's new weights and moments beside the old ones, where the
        program writes them into the donated arrays (a first Optimizer.step of 192 MiB of weights: +700 MiB).
        """
        last_use = self._last_uses()
        cut = _trace_slice(inputs)
        if cut is not None:
            env = self._traced_run(cut[0], last_use)
            env = {s: _whole_stand_in(v, *cut[1:]) for s, v in env.items()}
            env.update(zip(self.ext, inputs))
            self._build(sig, env, last_use)
            return self(inputs, None)
        corner = self._trace_corners(inputs, last_use)
        if corner is not None:  # inputs of shapes that do not broadcast together (one chain per weight)
            self._build(sig, corner, last_use)
            return self(inputs, None)
        env = self._traced_run(inputs, last_use)
        self._build(sig, env, last_use)
        return [env[s] for s in self.escaping]

    def _trace_corners(self, inputs: Sequence[Any], last_use: dict[int, int]) -> dict[int, Any] | None:
        """The traced values of a run on every input cut to its first two entries along every axis (which
        keeps the inputs that broadcast together doing so), as zero-stride stand-ins of the whole run's
        shapes, which every member gives by broadcasting its inputs' (members are elementwise); the inputs
        themselves. For clusters over large arrays whose inputs do not all broadcast together, which
        :func:`_trace_slice` leaves whole: an on-device optimizer's update of weights of several shapes
        (a first Optimizer.step held 5 weights' worth beside them). None when no input is large."""
        if not any(type(a) is np.ndarray and a.size >= TRACE_SLICE_MIN for a in inputs):
            return None
        whole = {s: np.shape(a) for s, a in zip(self.ext, inputs) if a is not None}
        try:
            for st in self.members:
                shape = np.broadcast_shapes(*(whole[s] for s in st.inputs if s in whole))
                whole.update((s, shape) for s in st.outputs if s >= 0)
        except (ValueError, KeyError):
            return None
        corner = (slice(0, _TRACE_ROWS),)
        cut = [a[corner * a.ndim] if type(a) is np.ndarray else a for a in inputs]
        env = self._traced_run(cut, last_use)
        for s, v in env.items():
            if type(v) is np.ndarray:
                if v.shape != tuple(min(d, _TRACE_ROWS) for d in whole.get(s, ())):
                    return None  # (a member that is not elementwise after all: trace whole)
                env[s] = np.broadcast_to(np.zeros((), v.dtype), whole[s])
        env.update(zip(self.ext, inputs))
        return env

    def _build(self, sig: tuple, env: dict[int, Any], last_use: dict[int, int]) -> None:
        """The program for signature ``sig`` from the traced values ``env`` (their shapes and dtypes)."""
        local = {s: i for i, s in enumerate(self.ext)}
        for st in self.members:
            for s in st.outputs:
                local[s] = len(local)
        fast = [runs_as_ufunc(st, env) for st in self.members]
        blocked = Blocked.build(self, env, local, fast, last_use)
        if blocked is not None and not blocked.for_donation:
            blocked.take_views(self.pool)
            self._store(sig, [None, 0, None, None, self.pool.version, blocked, None])
            return
        escaping = set(self.escaping)
        pinned = escaping | {s for st in self.members if st.node.op_type not in UFUNCS for s in st.inputs}
        # pass 1: which ops run as ufuncs, and the groups of values sharing one buffer
        group: dict[int, int] = {}  # value slot → group id (the slot that started the group)
        reuse: dict[int, int] = {}  # op index → input slot whose buffer it writes into
        for k, st in enumerate(self.members):
            if not fast[k]:
                continue
            r = env[st.outputs[0]]
            out = st.outputs[0]
            for s in st.inputs:
                v = env.get(s)
                if (
                    s in group
                    and s not in pinned
                    and last_use.get(s) == k
                    and v.shape == r.shape
                    and v.dtype == r.dtype
                ):
                    group[out] = group[s]
                    reuse[k] = s
                    break
            else:
                group[out] = out
        members_of: dict[int, list[int]] = {}
        for s, gid in group.items():
            members_of.setdefault(gid, []).append(s)
        fresh_groups = {
            gid
            for gid, vals in members_of.items()
            if any(v in pinned for v in vals) or env[gid].size < MIN_POOLED
        }
        group_end = {gid: max(last_use.get(v, -1) for v in vals) for gid, vals in members_of.items()}
        # pass 2: the program; pooled groups take scratch buffers by liveness
        free_bufs: dict[tuple, list[int]] = {}
        counts: dict[tuple, int] = {}
        held: list[tuple[int, int, tuple, int]] = []  # heap of (end op, order taken, key, index)
        ops: list[tuple] = []
        spread_of: dict[tuple[int, tuple], int] = {}  # (slot, shape) → the value copied out to that shape
        for k, st in enumerate(self.members):
            ins = [local[s] for s in st.inputs]
            if not fast[k]:
                ops.append((2, st.fn, ins, [local[s] for s in st.outputs], None, st.attrs))
            else:
                ufunc, extra = member_ufunc(st, env)
                out = st.outputs[0]
                in_shapes = [env[s].shape for s in st.inputs]
                for j, s in enumerate(st.inputs):  # broadcast over small planes: copied out once (spread.py)
                    shape = spread_shape(env[s].shape, env[out].shape) if len(st.inputs) > 1 else None
                    if shape is not None:
                        if (s, shape) not in spread_of:
                            spread_of[s, shape] = len(local) + len(spread_of)
                            ops.append((2, _spread_kernel, [local[s]], [spread_of[s, shape]], None, shape))
                        ins[j] = spread_of[s, shape]
                        in_shapes[j] = shape
                size = broadcast_size(tuple(in_shapes), env[out].shape, env[out].size) if len(ins) > 1 else 0
                if size:  # broadcast along runs numpy would copy through its buffer (buffering.py)
                    ufunc = UnbufferedUfunc(ufunc, size)
                gid = group[out]
                if k in reuse:
                    ops.append((3, ufunc, ins, local[out], local[reuse[k]], extra))
                elif gid in fresh_groups:
                    ops.append((1, ufunc, ins, local[out], None, extra))
                else:
                    r = env[out]
                    key = r.dtype  # any shape: a view of the flat buffer
                    lst = free_bufs.get(key)
                    bi = lst.pop() if lst else counts.setdefault(key, 0)
                    if not lst and bi == counts[key]:
                        counts[key] += 1
                    heapq.heappush(held, (group_end[gid], len(ops), key, bi))
                    self.pool.reserve(r.size, r.dtype, bi)
                    ops.append((0, ufunc, ins, local[out], (r.shape, r.dtype, bi), extra))
            release_ended(held, k, free_bufs)
        self._store(sig, [
            ops,
            len(local) + len(spread_of) - len(self.ext),
            [local[s] for s in self.escaping],
            None,
            -1,
            None,
            blocked,  # None, or the blocked program for runs that donate (Blocked.for_donation)
        ])

    def _store(self, sig: tuple, prog: list) -> None:
        """Keep ``prog`` as the program of ``sig``, dropping the oldest ones beyond :data:`MAX_PROGRAMS`."""
        programs = self.programs
        while len(programs) >= MAX_PROGRAMS:
            # threads running one plan share its clusters: another may add or drop one during the look
            with contextlib.suppress(StopIteration, RuntimeError):
                programs.pop(next(iter(programs)), None)
        programs[sig] = prog


TRACE_SLICE_MIN = 1 << 16  # elements of a cluster's shape from which its first run traces a slice of it
_TRACE_ROWS = 2  # entries of the sliced axis traced (not 1, which would read as a broadcast dim)


def _trace_slice(inputs: Sequence[Any]) -> tuple[list[Any], int, int, int] | None:
    """``inputs`` cut to their first two entries along the longest axis of the shape they broadcast to,
    that shape's rank, the axis and its length; None when that shape is small, its longest axis short, or
    the inputs do not broadcast together."""
    arrays = [a for a in inputs if type(a) is np.ndarray]
    if not arrays:
        return None
    try:
        shape = np.broadcast_shapes(*(a.shape for a in arrays))
    except ValueError:
        return None
    if not shape or int(np.prod(shape)) < TRACE_SLICE_MIN:
        return None
    axis = int(np.argmax(shape))
    n = shape[axis]
    if n < 2 * _TRACE_ROWS:
        return None
    cut = []
    for a in inputs:
        at = axis - (len(shape) - a.ndim) if type(a) is np.ndarray else -1
        if at >= 0 and a.shape[at] == n:
            a = a[(slice(None),) * at + (slice(0, _TRACE_ROWS),)]
        cut.append(a)
    return cut, len(shape), axis, n


def _whole_stand_in(v: Any, rank: int, axis: int, n: int) -> Any:
    """The traced value ``v`` of a sliced run (see :func:`_trace_slice`) as a zero-stride stand-in of the
    whole run's shape when it spans the sliced entries, else ``v`` itself (its value is the whole run's)."""
    if type(v) is not np.ndarray:
        return v
    at = axis - (rank - v.ndim)
    if at < 0 or v.shape[at] != _TRACE_ROWS:
        return v
    shape = v.shape[:at] + (n,) + v.shape[at + 1:]
    return np.broadcast_to(np.zeros((), v.dtype), shape)


def _spread_kernel(inputs: Sequence[Any], shape: tuple[int, ...]) -> tuple[np.ndarray]:
    return (spread(inputs[0], shape),)


# ---- groups of sibling clusters ---------------------------------------------------------------------------
def group_sibling_clusters(plan: Plan, steps: list[Step]) -> list[Step]:
    """Consecutive cluster steps none of which reads another's outputs (the per-weight updates of a legacy
    optimizer graph) become one step, so that their split segments run as one job (:func:`run_group`)."""
    out: list[Step] = []
    run: list[Step] = []

    def flush() -> None:
        if len(run) >= 2:
            ins = list(dict.fromkeys(s for st in run for s in st.inputs))
            outs = [s for st in run for s in st.outputs]
            members = list(run)
            fn = ClusterGroup(plan, members, ins)
            out.append(make_step(plan, "FusedElementwiseGroup", members, ins, outs, fn))
        else:
            out.extend(run)
        run.clear()

    produced: set[int] = set()  # the outputs of ``run``
    for st in steps:
        if not isinstance(st.fn, Cluster):
            flush()
            produced.clear()
            out.append(st)
            continue
        if produced.intersection(st.inputs):
            flush()
            produced.clear()
        run.append(st)
        produced.update(st.outputs)
    flush()
    return out


class ClusterGroup:
    """The kernel of a group of sibling clusters: each member on its inputs, in order, their split segments'
    pieces together at the end; the members' outputs in order."""

    def __init__(self, plan: Plan, members: list[Step], ins: list[int]):
        self.plan = plan
        self.members = members
        at = {s: i for i, s in reversed(list(enumerate(ins)))}  # each slot's first position
        self.positions = [[at[s] for s in m.inputs] for m in members]
        self.fresh_outputs = all(m.fn.fresh_outputs for m in members)
        for m in members:
            m.fn.grouped = True

    def allow_reuse(self, slots: frozenset[int]) -> frozenset[int]:
        """Donated inputs each member may write into: those it reads and no other member does (a later member
        must still find an input as it was)."""
        n_readers: dict[int, int] = {}
        for m in self.members:
            for s in set(m.inputs):
                n_readers[s] = n_readers.get(s, 0) + 1
        taken: set[int] = set()
        for m in self.members:
            # its cluster's inputs among ``slots`` that no other member reads (allow_reuse keeps only those)
            mine = set(m.inputs)
            own = frozenset(s for s in m.fn.ext if s in slots and n_readers.get(s, 0) == (s in mine))
            taken.update(m.fn.allow_reuse(own))
        return frozenset(taken)

    def __call__(self, inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        calls = [functools.partial(m.fn, [inputs[i] for i in pos], m.attrs)
                 for m, pos in zip(self.members, self.positions)]
        results = run_group(self.plan.scratch, calls)
        if results is None:  # the pool is busy (the plan runs on another thread too): each member alone
            results = [c() for c in calls]
        return [r for res in results for r in res]

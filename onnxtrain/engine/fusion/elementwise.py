"""Elementwise clusters: one step per connected chain of ufuncs, with pooled and cache-blocked scratch."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import helper

from onnxtrain.engine.donation import donated_now
from onnxtrain.engine.fusion.common import consumers, make_step, protected_slots, run_steps
from onnxtrain.engine.fusion.shapes import is_memoized
from onnxtrain.engine.kernels.elementwise import erf_into
from onnxtrain.engine.kernels.filled import relu_into
from onnxtrain.engine.parallel import parallel_for, split, width
from onnxtrain.engine.registry import Attrs, find_kernel

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

# ---- elementwise clusters ------------------------------------------------------------------------------

# op → (ufunc, constant second operand or None); the kernels of these ops are exactly this ufunc call
_UFUNCS: dict[str, tuple[np.ufunc, Any]] = {
    "Add": (np.add, None),
    "Sub": (np.subtract, None),
    "Mul": (np.multiply, None),
    "Div": (np.divide, None),
    "Sqrt": (np.sqrt, None),
    "Neg": (np.negative, None),
    "Abs": (np.absolute, None),
    "Exp": (np.exp, None),
    "Log": (np.log, None),
    "Reciprocal": (np.reciprocal, None),
    "Tanh": (np.tanh, None),
    "Relu": (relu_into, None),  # max(x, 0) against an array of zeros: numpy's scalar path is 5x slower
    "Erf": (erf_into, None),  # not a ufunc, but called as one: the exported GELU chain is one cluster
}
# elementwise ops that may join a cluster but run through their own kernel (outputs are never pooled)
_OTHER = {"Identity", "Cast", "Pow"}
_QUIET = {"Div", "Sqrt", "Log", "Reciprocal"}
MIN_POOLED = 256  # elements: smaller values are cheaper to allocate than to look up
# cache blocking: a cluster whose ufuncs work on arrays of one shape (or size-1 broadcasts) runs its program
# over slices of about BLOCK_BYTES of working set (all the arrays the blocked ops touch) when the whole
# working set is at least BLOCK_MIN_BYTES. Measured on a Zen 4 (1 MiB L2, 32 MiB L3) with the Adam update
# (15 ufuncs): 1.03-1.08× at 0.26-0.4 M parameters, 1.25× at 2 M, 1.45× at 4 M; blocks small enough for L2
# lose to the per-slice Python overhead (15 ufunc calls per slice).
BLOCK_MIN_BYTES = 8 << 20
BLOCK_BYTES = 4 << 20
_BLOCK_ALIGN = 64
# a segment of at least PAR_MIN_WORK element-ops (elements × ufuncs, an Erf counting ERF_COST) splits its
# elements over the run's threads (:mod:`onnxtrain.engine.parallel`). Measured on 2 cores (bench/, one thread
# against two in the same run): the exported GELU of the transformer (1 M elements × 13) gained 0.5 ms of
# 2.3; the Adam update of the MLP's weights (0.4 M × 13) lost, as splitting at all makes OpenBLAS's threads
# sleep between GEMMs (onnxtrain/engine/blas.py), which the MLP's GEMMs pay for in waking them
PAR_MIN_WORK = 8 << 20
# an optimizer update's segment (one that may write into donated weights or moments) splits from
# UPDATE_PAR_MIN_WORK: in the on-device Optimizer.step, which starts after OpenBLAS's threads have stopped
# busy-waiting, splitting the MLP's two weight updates (0.4 M and 0.26 M parameters × 12) took the step
# 1.88-2.00 → 1.78-1.85 ms (batch 64; Optimizer.step 0.95-1.03 → 0.80-0.83 ms; four interleaved processes
# each)
UPDATE_PAR_MIN_WORK = 3 << 20
ERF_COST = 8  # an Erf costs about as much as eight plain ufuncs (two gathers and nine passes)


class ScratchPool:
    """Scratch buffers shared by the plan's fused steps: one flat array per (dtype, index within a step),
    sized to the largest request; a step's buffer of some shape is a view of its prefix.

    Fused steps run one at a time within a run; a run that finds the pool busy (the same plan run from
    two threads at once) runs the original steps instead. ``version`` changes whenever an array is
    replaced by a larger one, so that steps holding views of the old one take new views.
    """

    def __init__(self) -> None:
        self.arrays: dict[tuple, np.ndarray] = {}
        self.lock = threading.Lock()
        self.version = 0

    def reserve(self, size: int, dtype: np.dtype, index: int) -> None:
        a = self.arrays.get((dtype, index))
        if a is None or a.size < size:
            self.arrays[(dtype, index)] = np.empty(size, dtype)
            self.version += 1

    def view(self, shape: tuple[int, ...], dtype: np.dtype, index: int) -> np.ndarray:
        size = int(np.prod(shape))
        self.reserve(size, dtype, index)
        return self.arrays[(dtype, index)][:size].reshape(shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def expand_sums(plan: Plan, steps: list[Step]) -> list[Step]:
    """Rewrite each ``Sum`` of two or more inputs as a chain of ``Add`` steps, in the Sum kernel's order
    ((a + b) + c) + ..., so bit-identical: the Adds can join the elementwise cluster of the values they sum
    (the gradient contributions of a tensor used several times, e.g. in the exported tanh GELU), which
    then need not be written out whole to be summed by a separate step."""
    from onnxtrain.engine.plan import Step

    add = find_kernel("Add", plan.opset, "")
    name_of = {v: k for k, v in plan.slot.items()}
    out: list[Step] = []
    for st in steps:
        ins = st.inputs
        if st.node.op_type != "Sum" or st.node.domain not in ("", "ai.onnx") or len(ins) < 2 or min(ins) < 0:
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
            attrs = Attrs({}, "Add", node.name, plan.opset, 1, (True,))
            out.append(Step(add, (acc, s), (dst,), attrs, (), node))
            acc = dst
    return out


def fuse_elementwise(plan: Plan, steps: list[Step]) -> list[Step]:
    """Group connected elementwise steps into clusters of two or more and run each as one step."""
    eligible = set(_UFUNCS) | _OTHER
    cons, kept = consumers(steps), protected_slots(plan)
    cluster_of_slot: dict[int, int] = {}  # slot → cluster id of its producer
    members: dict[int, list[int]] = {}  # cluster id → step indices
    merged_into: dict[int, int] = {}

    def find(c: int) -> int:
        while c in merged_into:
            c = merged_into[c]
        return c

    for k, st in enumerate(steps):
        ok = (
            st.node.op_type in eligible
            and st.node.domain in ("", "ai.onnx")
            and all(s >= 0 for s in st.outputs)
            and not is_memoized(st)
        )
        if st.node.op_type == "Relu" and len(st.inputs) != 1:
            ok = False
        if not ok:
            continue
        cands = {find(cluster_of_slot[s]) for s in st.inputs if s in cluster_of_slot}
        legal: list[int] = []
        for c in sorted(cands):
            group = set(members[c])
            # every consumer of the cluster's values that ran before this step must be inside the cluster:
            # the fused step runs at the position of its last member
            early = {j for i in members[c] for s in steps[i].outputs for j in cons.get(s, ()) if j < k}
            if early <= group:
                legal.append(c)
        if legal:
            # each legal cluster's early consumers lie inside it, so those of the union lie in the union
            cid = legal[0]
            for c in legal[1:]:
                members[cid] += members.pop(c)
                merged_into[c] = cid
            members[cid].append(k)
        else:
            cid = k
            members[cid] = [k]
        for s in st.outputs:
            cluster_of_slot[s] = cid
    groups = [
        sorted(v)
        for v in members.values()
        if len(v) >= 2 and sum(steps[i].node.op_type in _UFUNCS for i in v) >= 2
    ]
    if not groups:
        return steps
    pool = plan.scratch
    replace: dict[int, Step] = {}
    drop: set[int] = set()
    for idx in groups:
        group = set(idx)
        mem = [steps[i] for i in idx]
        produced = {s for st in mem for s in st.outputs}
        ext: list[int] = []
        for st in mem:
            for s in st.inputs:
                if s not in produced and s not in ext:
                    ext.append(s)
        escaping = [
            s for st in mem for s in st.outputs if s in kept or any(j not in group for j in cons.get(s, ()))
        ]
        if not escaping:
            continue
        internal_only = {
            s
            for s in produced
            if s not in escaping and all(steps[j].node.op_type in _UFUNCS for j in cons.get(s, ()))
        }
        fn = _Cluster(plan, mem, ext, escaping, internal_only, pool)
        replace[idx[-1]] = make_step(plan, "FusedElementwise", mem, ext, escaping, fn)
        drop.update(idx[:-1])
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


class _Cluster:
    """The kernel of one elementwise cluster; specialised per signature of its inputs on first use."""

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
        self.quiet = any(m.node.op_type in _QUIET for m in members)
        # outputs are new arrays (or donated inputs' memory) unless an Identity or Cast hands an input through
        passed = set(ext)
        for m in members:
            if m.node.op_type in ("Identity", "Cast") and passed.intersection(m.inputs):
                passed.update(m.outputs)
        self.fresh_outputs = not passed.intersection(escaping)
        self.reusable: frozenset[int] = frozenset()
        self.programs: dict[tuple, tuple] = {}

    def __call__(self, inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        sig = tuple((a.shape, a.dtype) if type(a) is np.ndarray else type(a) for a in inputs)
        prog = self.programs.get(sig)
        if prog is None:
            return self._trace(sig, inputs)
        pool = self.pool
        if not pool.lock.acquire(blocking=False):
            return self._fallback(inputs)
        try:
            blocked = prog[5]
            if prog[4] != pool.version:  # the pool grew since: take views of its new arrays
                if blocked is None:
                    prog[3] = _compile([
                        (k, f, i, o, pool.view(*b) if k == 0 else b, e) for k, f, i, o, b, e in prog[0]
                    ])
                else:
                    blocked.take_views(pool)
                prog[4] = pool.version
            if blocked is not None:
                donated = donated_now() & self.reusable if self.reusable else None
                if self.quiet:
                    with np.errstate(divide="ignore", invalid="ignore"):
                        return blocked.run(inputs, donated)
                return blocked.run(inputs, donated)
            vals = list(inputs)
            vals.extend(None for _ in range(prog[1]))
            if self.quiet:
                with np.errstate(divide="ignore", invalid="ignore"):
                    prog[3](vals)
            else:
                prog[3](vals)
            return [vals[i] for i in prog[2]]
        finally:
            pool.lock.release()

    def allow_reuse(self, slots: frozenset[int]) -> frozenset[int]:
        """Let the cluster write its outputs into the graph inputs ``slots`` when a run donates them (the plan
        found nothing reads them after this step); returns the ones among its inputs."""
        self.reusable = frozenset(slots) & frozenset(self.ext)
        return self.reusable

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
        """
        last_use = self._last_uses()
        env = self._traced_run(inputs, last_use)
        local = {s: i for i, s in enumerate(self.ext)}
        for st in self.members:
            for s in st.outputs:
                local[s] = len(local)
        fast = [_runs_as_ufunc(st, env) for st in self.members]
        blocked = _Blocked.build(self, env, local, fast, last_use)
        if blocked is not None:
            blocked.take_views(self.pool)
            self.programs[sig] = [None, 0, None, None, self.pool.version, blocked]
            return [env[s] for s in self.escaping]
        escaping = set(self.escaping)
        pinned = escaping | {s for st in self.members if st.node.op_type not in _UFUNCS for s in st.inputs}
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
        held: list[tuple[int, tuple, int]] = []  # (end op, key, index)
        ops: list[tuple] = []
        for k, st in enumerate(self.members):
            ins = [local[s] for s in st.inputs]
            if not fast[k]:
                ops.append((2, st.fn, ins, [local[s] for s in st.outputs], None, st.attrs))
            else:
                ufunc, extra = _UFUNCS[st.node.op_type]
                out = st.outputs[0]
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
                    held.append((group_end[gid], key, bi))
                    self.pool.reserve(r.size, r.dtype, bi)
                    ops.append((0, ufunc, ins, local[out], (r.shape, r.dtype, bi), extra))
            for item in [h for h in held if h[0] <= k]:
                held.remove(item)
                free_bufs.setdefault(item[1], []).append(item[2])
        self.programs[sig] = [
            ops,
            len(local) - len(self.ext),
            [local[s] for s in self.escaping],
            None,
            -1,
            None,
        ]
        return [env[s] for s in self.escaping]


def _compile(ops: list[tuple]) -> Callable[[list[Any]], None]:
    """A cluster program as one generated Python function of the value slots: each op a single line with its
    slots written in, no per-op unpacking or dispatch (a 15-op Adam update of a bias: 13.4 → 7.2 µs). An op
    is ``(kind, fn, input slots, output slot(s), buffer, extra)``: kind 0, a ufunc into the scratch buffer;
    1, a ufunc into a fresh array; 3, a ufunc into the buffer of the input slot ``buffer``, which dies there;
    2, the op's own kernel ``fn(inputs, extra)``. ``extra`` of a ufunc is its constant second operand."""
    lines = ["def program(v):"]
    fns, bufs, extras = [], [], []
    for j, (kind, fn, ins, outs, buf, extra) in enumerate(ops):
        fns.append(fn)
        bufs.append(buf)
        extras.append(extra)
        if kind == 2:  # the op's own kernel
            lines.append(f"    res = F[{j}]([{', '.join(f'v[{i}]' for i in ins)}], E[{j}])")
            lines.append(f"    for o, r in zip({tuple(outs)!r}, res):")
            lines.append("        v[o] = r")
            continue
        args = f"v[{ins[0]}], E[{j}]" if extra is not None else ", ".join(f"v[{i}]" for i in ins)
        if kind == 0:  # into a scratch buffer
            lines.append(f"    v[{outs}] = F[{j}]({args}, out=B[{j}])")
        elif kind == 3:  # into the buffer of an input that dies here
            lines.append(f"    v[{outs}] = F[{j}]({args}, out=v[{buf}])")
        else:  # into a fresh array (a 0-d result comes back as a numpy scalar)
            lines.append(f"    r = F[{j}]({args})")
            lines.append(f"    v[{outs}] = r if type(r) is ndarray else asarray(r)")
    if len(lines) == 1:
        lines.append("    pass")
    namespace = {"F": fns, "B": bufs, "E": extras, "ndarray": np.ndarray, "asarray": np.asarray}
    exec("\n".join(lines), namespace)  # noqa: S102 - source made above from integers only
    return namespace["program"]


def _runs_as_ufunc(st: Step, env: dict[int, Any]) -> bool:
    """True when the traced run shows a member is exactly its ufunc called on arrays, giving an array."""
    op, r = st.node.op_type, env.get(st.outputs[0])
    if op not in _UFUNCS or type(r) is not np.ndarray or r.ndim < 1:
        return False
    if not all(type(env.get(s)) is np.ndarray for s in st.inputs):
        return False
    return not (op == "Div" and any(env[s].dtype.kind != "f" for s in st.inputs))


class _Blocked:
    """A cluster's program run over contiguous blocks of its flattened arrays (cache blocking).

    The members split into three phases, run in this order: ``pre``, ops whose inputs are cluster inputs or
    other ``pre`` values only (step counts, bias corrections), run once on whole values; the blocked ufuncs,
    whose operands all have the op's output shape or are size-1 values of the first phase, run slice by
    slice: the same ufuncs in the same order on every element, so results are bit-identical, while a
    block's temporaries stay in cache; ``post``, own-kernel members and whatever reads their outputs, on
    whole arrays. The blocked ufuncs form one :class:`_Segment` per shape (an optimizer graph updating
    several weights at once, tied together by a shared learning rate, has one per weight), run one after
    the other; a segment too small to gain from blocking runs as one block.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @classmethod
    def build(
        cls,
        cl: _Cluster,
        env: dict[int, Any],
        local: dict[int, int],
        fast: list[bool],
        last_use: dict[int, int],
    ) -> _Blocked | None:
        """The blocked program for the traced values ``env``, or None when blocking does not apply."""
        members = cl.members

        def shape_of(s: int) -> tuple[int, ...] | None:
            v = env.get(s)
            return v.shape if type(v) is np.ndarray and v.size > 1 else None

        def one(s: int, shape: tuple[int, ...]) -> bool:
            v = env.get(s)
            return type(v) is np.ndarray and v.size == 1 and v.ndim <= len(shape)

        # phases: x (cluster input), p (pre), m (blocked, in the segment of its output's shape), e (post)
        phase = {s: "x" for s in cl.ext}
        kinds: list[str] = []
        for k, st in enumerate(members):
            src = [phase[s] for s in st.inputs]
            shape = shape_of(st.outputs[0]) if fast[k] else None
            if (
                shape is not None
                and "e" not in src
                and all(
                    (shape_of(s) == shape and phase[s] in "xpm") or (one(s, shape) and phase[s] in "xp")
                    for s in st.inputs
                )
            ):
                ph = "m"
            elif all(p in "xp" for p in src):
                ph = "p"
            else:
                ph = "e"
            kinds.append(ph)
            for s in st.outputs:
                phase[s] = ph
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for k, ph in enumerate(kinds):
            if ph == "m":
                by_shape.setdefault(env[members[k].outputs[0]].shape, []).append(k)
        readers: dict[int, list[int]] = {}
        for k, st in enumerate(members):
            for s in st.inputs:
                readers.setdefault(s, []).append(k)
        segments = [
            _Segment.build(cl, env, local, last_use, kinds, readers, phase, shape, ops)
            for shape, ops in by_shape.items()
        ]
        if not any(seg.block < seg.n or seg.par for seg in segments):
            return None

        def program(phase_name: str) -> list[tuple]:
            out = []
            for k, st in enumerate(members):
                if kinds[k] != phase_name:
                    continue
                ins = [local[s] for s in st.inputs]
                if fast[k]:
                    ufunc, extra = _UFUNCS[st.node.op_type]
                    out.append((1, ufunc, ins, local[st.outputs[0]], None, extra))
                else:
                    out.append((2, st.fn, ins, [local[s] for s in st.outputs], None, st.attrs))
            return out

        pre, post = program("p"), program("e")
        return cls(
            segments=segments,
            n_new=len(local) - len(cl.ext),
            pre=pre,  # the op tuples, run as the generated functions below
            post=post,
            run_pre=_compile(pre) if pre else None,
            run_post=_compile(post) if post else None,
            out_idx=[local[s] for s in cl.escaping],
        )

    def take_views(self, pool: ScratchPool) -> None:
        for seg in self.segments:
            seg.take_views(pool)

    def run(self, inputs: Sequence[Any], donated: frozenset[int] | None = None) -> list[Any]:
        vals = list(inputs)
        vals.extend(None for _ in range(self.n_new))
        if self.run_pre is not None:
            self.run_pre(vals)
        for seg in self.segments:
            seg.run(vals, donated)
        if self.run_post is not None:
            self.run_post(vals)
        return [vals[i] for i in self.out_idx]


class _Segment:
    """The blocked ufuncs of one shape, run over slices of ``block`` of its ``n`` flattened elements.

    Blocked values that escape the cluster or that other phases read are whole arrays allocated once per run
    and written slice by slice; the others live in block-sized scratch buffers of the pool (an op whose
    input dies there writes into that input's buffer). Segments run one at a time, so they share buffers.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)
        self.pool: ScratchPool | None = None
        self.views: dict[int, tuple[int, list[tuple[int, np.ndarray]]]] = {}  # thread → (block, views)

    @classmethod
    def build(
        cls,
        cl: _Cluster,
        env: dict[int, Any],
        local: dict[int, int],
        last_use: dict[int, int],
        kinds: list[str],
        readers: dict[int, list[int]],
        phase: dict[int, str],
        full: tuple[int, ...],
        blocked_ops: list[int],
    ) -> _Segment:
        members = cl.members
        n = int(np.prod(full))
        mine = set(blocked_ops)

        def whole(s: int) -> bool:
            v = env.get(s)
            return type(v) is np.ndarray and v.shape == full

        escaping = set(cl.escaping)
        outs = [members[k].outputs[0] for k in blocked_ops]
        wholes = [o for o in outs if o in escaping or any(j not in mine for j in readers.get(o, ()))]
        whole_set = set(wholes)
        # donation (onnxtrain/engine/donation.py): a whole output may be written into a cluster input of its
        # dtype that only this segment reads, if its slice is first written no earlier than the input's last
        # read. Each output claims the input read last before it is computed (an update's old value: w in
        # w' = w − u), and no chain sinks into it (below) before that read
        pos = {k: i for i, k in enumerate(blocked_ops)}
        last_read: dict[int, int] = {}
        for s in {s for k in blocked_ops for s in members[k].inputs} & cl.reusable:
            rd = readers.get(s, ())
            if whole(s) and all(j in mine for j in rd):
                last_read[s] = max(pos[j] for j in rd)
        claim: dict[int, int] = {}
        for k in blocked_ops:
            o = members[k].outputs[0]
            if o in whole_set:
                free_in = [s for s in last_read if s not in claim.values()
                           and env[s].dtype == env[o].dtype and last_read[s] <= pos[k]]
                if free_in:
                    claim[o] = max(free_in, key=lambda s: (last_read[s], s))
        # block values: chains of ops whose input dies there share that input's buffer; a chain that dies
        # into a whole value runs in that value's slice ("sinks" into it) and needs no scratch buffer
        root: dict[int, int] = {}
        root_at: dict[int, int] = {}  # chain root → position of the op that starts the chain
        sink: dict[int, int] = {}  # chain root → the whole value whose slice it uses
        for k in blocked_ops:
            out = members[k].outputs[0]
            dt = env[out].dtype
            for s in members[k].inputs:
                if s in root and last_use.get(s) == k and env[s].dtype == dt and root[s] not in sink:
                    if out in whole_set:
                        if out in claim and root_at[root[s]] < last_read[claim[out]]:
                            continue  # would write the output's slice before its claimed input is read
                        sink[root[s]] = out
                    else:
                        root[out] = root[s]
                    break
            else:
                if out not in whole_set:
                    root[out] = out
                    root_at[out] = pos[k]
        end: dict[int, int] = {}
        for v, r in root.items():
            end[r] = max(end.get(r, -1), last_use.get(v, -1))
        # scratch buffers of the pool by liveness, block-sized
        free: dict[np.dtype, list[int]] = {}
        counts: dict[np.dtype, int] = {}
        held: list[tuple[int, np.dtype, int]] = []
        scratch: list[tuple[int, np.dtype, int]] = []
        for k in blocked_ops:
            out = members[k].outputs[0]
            if root.get(out) == out and out not in sink:
                dt = env[out].dtype
                lst = free.get(dt)
                if lst:
                    bi = lst.pop()
                else:
                    bi = counts.get(dt, 0)
                    counts[dt] = bi + 1
                held.append((end[out], dt, bi))
                scratch.append((local[out], dt, bi))
            for item in [h for h in held if h[0] <= k]:
                held.remove(item)
                free.setdefault(item[1], []).append(item[2])

        def slot(s: int) -> int:
            if s not in root:
                return local[s]
            return local[sink.get(root[s], root[s])]

        n_slots = len(local)
        consts: list[tuple[int, Any]] = []
        ops: list[tuple] = []
        for k in blocked_ops:
            st = members[k]
            ufunc, extra = _UFUNCS[st.node.op_type]
            ins = [slot(s) for s in st.inputs]
            if extra is not None:
                consts.append((n_slots + len(consts), extra))
                ins.append(consts[-1][0])
            ops.append((ufunc, ins[0], ins[1] if len(ins) > 1 else -1, slot(st.outputs[0])))
        m_inputs = {s for k in blocked_ops for s in members[k].inputs}
        whole_in = sorted(local[s] for s in m_inputs if whole(s) and phase[s] in "xp")
        whole_out = [(local[s], full, env[s].dtype) for s in wholes]
        per_elem = sum(env[s].itemsize for s in m_inputs if whole(s) and phase[s] in "xp")
        per_elem += sum(env[s].itemsize for s in wholes) + sum(dt.itemsize for _, dt, _ in scratch)
        block = n
        if len(ops) >= 2 and n >= 2 * _BLOCK_ALIGN and n * per_elem >= BLOCK_MIN_BYTES:
            # a multiple of _BLOCK_ALIGN elements: every slice starts as aligned as the whole array
            block = min(max(BLOCK_BYTES // max(per_elem, 1) // _BLOCK_ALIGN, 1) * _BLOCK_ALIGN, n)
        cost = sum(ERF_COST if f is erf_into else 1 for f, *_ in ops)  # per element
        # each whole output's donation candidates, its claimed input first: inputs whose every read comes no
        # later than the first write into the output's slice (then each block reads an input's slice before
        # it writes the same slice)
        reuse: list[list[tuple[int, int]]] = []
        for o in wholes:
            first = min(i for i, op in enumerate(ops) if op[3] == local[o])
            ok = [s for s in last_read if env[s].dtype == env[o].dtype and last_read[s] <= first]
            ok.sort(key=lambda s: (s != claim.get(o), s))
            reuse.append([(local[s], s) for s in ok])
        return cls(
            reuse=reuse,
            n=n,
            block=block,
            par=n >= 2 * _BLOCK_ALIGN and n * cost >= (UPDATE_PAR_MIN_WORK if any(reuse) else PAR_MIN_WORK),
            n_bv=n_slots + len(consts),
            consts=consts,
            small=sorted(local[s] for s in m_inputs if not whole(s)),
            whole_in=whole_in,
            whole_out=whole_out,
            flat_slots=whole_in + [w[0] for w in whole_out],
            scratch=scratch,
            ops=ops,
        )

    def take_views(self, pool: ScratchPool) -> None:
        """(Re)take the serial run's views of the pool's arrays (a split run takes its other threads')."""
        self.pool = pool
        self.views = {}
        self._views(0, self.block)

    def _views(self, thread: int, block: int) -> list[tuple[int, np.ndarray]]:
        """Block-sized views of ``thread``'s scratch buffers (thread 0 shares the pool's with other steps)."""
        got = self.views.get(thread)
        if got is None or got[0] != block:
            pool = self.pool
            keys = [(i, dt, bi if thread == 0 else (bi, thread)) for i, dt, bi in self.scratch]
            got = self.views[thread] = (block, [(i, pool.view((block,), dt, k)) for i, dt, k in keys])
        return got[1]

    def run(self, vals: list[Any], donated: frozenset[int] | None = None) -> None:
        bv: list[Any] = [None] * self.n_bv
        for i, c in self.consts:
            bv[i] = c
        for i in self.small:
            v = vals[i]
            bv[i] = v if v.ndim <= 1 else v.reshape(1)
        flats = [vals[i].reshape(-1) for i in self.whole_in]
        taken: list[int] = []
        for (i, shape, dt), reuse in zip(self.whole_out, self.reuse):
            a = None
            if donated:
                for j, ext in reuse:
                    if ext in donated and j not in taken:
                        a = vals[j]
                        taken.append(j)
                        break
            if a is None:
                a = np.empty(shape, dt)
            vals[i] = a
            flats.append(a.reshape(-1))
        slots = list(zip(self.flat_slots, flats))
        n = self.n
        parts = width() if self.par else 1
        if parts <= 1:
            self._run_range(bv, slots, 0, n, self.block, self._views(0, self.block))
            return
        ranges = split(n, parts, _BLOCK_ALIGN)
        block = min(self.block, ranges[0][1])
        views = [self._views(t, block) for t in range(len(ranges))]  # taken here: the pool is not thread-safe

        def part(t: int) -> None:
            self._run_range(list(bv), slots, *ranges[t], block, views[t])

        parallel_for(len(ranges), part)

    def _run_range(
        self,
        bv: list[Any],
        slots: list[tuple[int, np.ndarray]],
        start: int,
        stop: int,
        block: int,
        views: list[tuple[int, np.ndarray]],
    ) -> None:
        """The segment's ufuncs over elements [start, stop), ``block`` at a time, in the scratch ``views``."""
        for i, v in views:
            bv[i] = v
        ops = self.ops
        for lo in range(start, stop, block):
            hi = lo + block
            if hi > stop:
                hi = stop
                for i, v in views:
                    bv[i] = v[:hi - lo]
            for i, f in slots:
                bv[i] = f[lo:hi]
            for fn, a, b, o in ops:
                if b < 0:
                    fn(bv[a], out=bv[o])
                else:
                    fn(bv[a], bv[b], out=bv[o])

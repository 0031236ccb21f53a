"""Cache-blocked elementwise clusters: a cluster's ufuncs run slice by slice over its flattened arrays,
with block-sized scratch buffers, split over threads when the work is large enough."""

from __future__ import annotations

import bisect
import functools
import heapq
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from onnxtrain.engine.fusion.ufuncs import compile_program, member_ufunc
from onnxtrain.engine.kernels.elementwise import erf_into
from onnxtrain.engine.parallel import parallel_for, width

if TYPE_CHECKING:
    from onnxtrain.engine.fusion.elementwise import Cluster

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
# sleep between GEMMs (onnxtrain/engine/blas.py), which the MLP's GEMMs pay for in waking them (updates now
# have their own threshold, below). 8 M → 4 M: the GPT decoder's tanh GELU forward and gradient clusters
# (0.5 M elements × 9 and × 12) 3.23 → 2.76 ms a step, the step 40.3 → 39.8 ms (two sessions in one
# process, 12 alternating rounds); LeNet, both MLPs, the transformer, MobileNet and the ResNet unchanged
PAR_MIN_WORK = 4 << 20
# an optimizer update's segment (one that may write into donated weights or moments) splits from
# UPDATE_PAR_MIN_WORK: in the on-device Optimizer.step, which starts after OpenBLAS's threads have stopped
# busy-waiting, splitting the MLP's two weight updates (0.4 M and 0.26 M parameters × 12) took the step
# 1.88-2.00 → 1.78-1.85 ms (batch 64; Optimizer.step 0.95-1.03 → 0.80-0.83 ms; four interleaved processes
# each)
UPDATE_PAR_MIN_WORK = 3 << 20
# an update too small for blocks or threads gets a program writing into its donated arrays from this many
# values in all: below, the per-segment calls of the blocked program cost more than the copies they save
# (LeNet's update, 61 K values: Optimizer.step 300 -> 310-426 µs with it; the transformer's, 0.4 M values:
# 1.47 -> 1.16 ms)
DONATE_MIN = 1 << 17
ERF_COST = 8  # an Erf costs about as much as eight plain ufuncs (two gathers and nine passes)
# whole segments of at least RIDE_MIN elements run inside a job (:func:`run_job`); smaller ones,
# whose ufunc calls are too short for numpy to let go of the GIL, run before it: inside, the other threads
# would wait on the GIL for them
RIDE_MIN = 1 << 13
# ... and whole segments alone make a job (dealt out to the threads) from this much work (element-ops)
JOB_MIN_WORK = 1 << 20
CALL_COST = 8000  # a ufunc call's own time, in element-ops (about 1 µs against 0.12 ns a value, 2 cores)


class ScratchPool:
    """Scratch buffers shared by the plan's fused steps: one flat array per (dtype, index within a step),
    sized to the largest request; a step's buffer of some shape is a view of its prefix.

    Fused steps run one at a time within a run; a run that finds the pool busy (the same plan run from
    two threads at once) runs the original steps instead. A group of clusters (:func:`run_group`) holds the
    pool across its members and their deferred work. ``version`` changes whenever an array is
    replaced by a larger one, so that steps holding views of the old one take new views.
    """

    def __init__(self) -> None:
        self.arrays: dict[tuple, np.ndarray] = {}
        self.lock = threading.RLock()  # re-entrant: a group of clusters holds it across its members
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


_group = threading.local()  # .work: the prepared segments that a group's clusters leave to its one job


class Prepared(NamedTuple):
    """A segment waiting for a job: its run's block values and whole arrays (:meth:`Segment.prepare`), and
    whether it is cut over the threads."""

    seg: Segment
    bv: list[Any]
    slots: list[tuple]
    split: bool


def run_job(items: list[Prepared], threads: int) -> None:
    """Run prepared segments as one job over ``threads``: the split ones cut over all the threads, the others
    whole on one thread each; or all on this thread when there is nothing to split and too little work to
    share (:data:`JOB_MIN_WORK`).

    The split segments' pieces run together, each thread its piece of every segment in turn, so the threads
    wake and meet once instead of once per segment (the MLP's on-device update, two split weights:
    Optimizer.step 0.81 → 0.73 ms at batch 64, 1.25 → 1.16 ms at 256). The whole segments are dealt out
    first, largest first to the least loaded thread, and the split work then fills up the threads to equal
    loads (:func:`water_fill`), instead of the whole segments running before the job while the other threads
    wait: the on-device update of the GPT decoder (21 weights, the two largest split) Optimizer.step 1.46 →
    1.25 ms, of the transformer encoder (19 weights, none split) 1.24 → 1.03 ms (medians of 16 interleaved
    rounds; the MLP's and LeNet's unchanged).
    """
    whole = [it for it in items if not it.split]
    split = [it for it in items if it.split]
    if not split and (len(whole) < 2 or sum(it.seg.cost for it in whole) < JOB_MIN_WORK):
        for seg, bv, slots, _ in whole:
            seg.run_prepared(bv, slots)
        return
    loads = [0.0] * threads
    mine: list[list[Callable[[], None]]] = [[] for _ in range(threads)]
    for seg, bv, slots, _ in sorted(whole, key=lambda it: -it.seg.cost):
        t = loads.index(min(loads))
        loads[t] += seg.cost
        views = seg._views(t, seg.block)  # taken here: the pool is not thread-safe
        mine[t].append(functools.partial(seg._run_range, bv, slots, 0, seg.n, seg.block, views))
    if split:
        shares = water_fill(loads, sum(it.seg.cost for it in split))
        for seg, bv, slots, _ in split:
            for t, piece in enumerate(seg.split_work(bv, slots, shares)):
                mine[t].append(piece)
    parallel_for(threads, lambda t: [f() for f in mine[t]])


def water_fill(loads: Sequence[float], work: float) -> list[float]:
    """Each thread's fraction of ``work`` (divisible) that brings the threads' ``loads`` closest to equal:
    the least loaded filled up first."""
    if work <= 0:
        return [1.0 / len(loads)] * len(loads)
    order = sorted(loads)
    level, left = order[0], work
    for k in range(1, len(order) + 1):
        nxt = order[k] if k < len(order) else float("inf")
        if (nxt - level) * k >= left:
            level += left / k
            break
        left -= (nxt - level) * k
        level = nxt
    return [max(level - x, 0.0) / work for x in loads]


def run_group(pool: ScratchPool, members: Sequence[Callable[[], Any]]) -> list[Any] | None:
    """Call ``members`` (clusters of one plan, none reading another's outputs) in turn, holding the pool, with
    their split and larger segments run together at the end as one job (:func:`run_job`); None (nothing
    run) when the pool is busy."""
    if not pool.lock.acquire(blocking=False):
        return None
    try:
        _group.work = work = []
        try:
            results = [m() for m in members]
        finally:
            _group.work = None
        if work:
            run_job(work, width())
        return results
    finally:
        pool.lock.release()


class Blocked:
    """A cluster's program run over contiguous blocks of its flattened arrays (cache blocking).

    The members split into three phases, run in this order: ``pre``, ops whose inputs are cluster inputs or
    other ``pre`` values only (step counts, bias corrections), run once on whole values; the blocked ufuncs,
    whose operands all have the op's output shape or are size-1 values of the first phase, run slice by
    slice: the same ufuncs in the same order on every element, so results are bit-identical, while a
    block's temporaries stay in cache; ``post``, own-kernel members and whatever reads their outputs, on
    whole arrays. The blocked ufuncs form one :class:`Segment` per shape (an optimizer graph updating
    several weights at once, tied together by a shared learning rate, has one per weight), run one after
    the other; a segment too small to gain from blocking runs as one block.
    """

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)

    @classmethod
    def build(
        cls,
        cl: Cluster,
        env: dict[int, Any],
        local: dict[int, int],
        fast: list[bool],
        last_use: dict[int, int],
    ) -> Blocked | None:
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
        escaping = set(cl.escaping)
        segments = [
            Segment.build(cl, env, local, last_use, kinds, readers, phase, shape, ops, escaping)
            for shape, ops in by_shape.items()
        ]
        # a cluster that may write into donated inputs (an optimizer update's weights and moments) but needs
        # neither blocks nor threads is built too, as ``for_donation``: its caller runs it only when the run
        # donates (else the compiled whole-array program, which returns new arrays that an optimizer would
        # then copy into its weights). The transformer's on-device update (no segment big enough to split):
        # Optimizer.step 2.42-2.56 -> 1.50-2.14 ms alone
        needed = any(seg.block < seg.n or seg.par for seg in segments)
        # a member of a group of clusters (a legacy optimizer's per-weight updates) with loops that may run
        # on another thread: blocked, so that they go to the group's one job (run_job)
        shared = cl.grouped and width() > 1 and any(seg.n >= RIDE_MIN for seg in segments)
        needed = needed or shared
        if not needed and (not any(any(seg.reuse) for seg in segments)
                           or sum(seg.n for seg in segments) < DONATE_MIN):
            return None

        def program(phase_name: str) -> list[tuple]:
            out = []
            for k, st in enumerate(members):
                if kinds[k] != phase_name:
                    continue
                ins = [local[s] for s in st.inputs]
                if fast[k]:
                    ufunc, extra = member_ufunc(st, env)
                    out.append((1, ufunc, ins, local[st.outputs[0]], None, extra))
                else:
                    out.append((2, st.fn, ins, [local[s] for s in st.outputs], None, st.attrs))
            return out

        pre, post = program("p"), program("e")
        return cls(
            segments=segments,
            for_donation=not needed,
            views_version=None,  # the pool's version when a for_donation program last took its views
            n_new=len(local) - len(cl.ext),
            pre=pre,  # the op tuples, run as the generated functions below
            post=post,
            run_pre=compile_program(pre) if pre else None,
            run_post=compile_program(post) if post else None,
            out_idx=[local[s] for s in cl.escaping],
        )

    def take_views(self, pool: ScratchPool) -> None:
        for seg in self.segments:
            seg.take_views(pool)

    def run(self, inputs: Sequence[Any], donated: frozenset[int] | None = None) -> list[Any]:
        vals = list(inputs)
        vals.extend([None] * self.n_new)
        if self.run_pre is not None:
            self.run_pre(vals)
        threads = width()
        if threads < 2:
            for seg in self.segments:
                seg.run(vals, donated)
        else:
            # segments too small for numpy to let go of the GIL run now; the others as one job (run_job), or
            # inside a group of clusters in the group's one job (nothing reads these outputs before the
            # group ends), unless a post phase reads them
            group = getattr(_group, "work", None) if self.run_post is None else None
            items = []
            for seg in self.segments:
                if seg.par or seg.n >= RIDE_MIN:
                    items.append(Prepared(seg, *seg.prepare(vals, donated), seg.par))
                else:
                    seg.run(vals, donated)
            if group is not None:
                group.extend(items)
            elif items:
                run_job(items, threads)
        if self.run_post is not None:
            self.run_post(vals)
        return [vals[i] for i in self.out_idx]


def _claims(
    whole_at: list[tuple[int, int]], last_read: dict[int, int], env: dict[int, Any]
) -> dict[int, int]:
    """Each whole output (with its position ``whole_at``, ascending) → the unclaimed input of its dtype read
    last (the highest slot among equals) no later than that position, where there is one."""
    order = sorted(last_read, key=last_read.__getitem__)
    ready: dict[np.dtype, list[tuple[int, int]]] = {}  # dtype → heap of (-last read, -slot) of free inputs
    claim: dict[int, int] = {}
    nxt = 0
    for at, o in whole_at:
        while nxt < len(order) and last_read[order[nxt]] <= at:
            s = order[nxt]
            heapq.heappush(ready.setdefault(env[s].dtype, []), (-last_read[s], -s))
            nxt += 1
        heap = ready.get(env[o].dtype)
        if heap:
            claim[o] = -heapq.heappop(heap)[1]
    return claim


def _scratch_buffers(
    blocked_ops: list[int],
    starts: list[int | None],
    end: dict[int, int],
    env: dict[int, Any],
    local: dict[int, int],
) -> list[tuple[int, np.dtype, int]]:
    """The pool buffers (slot, dtype, index) of the chains started at ``blocked_ops`` (``starts``: the
    chain's root there, else None), by liveness: a buffer is free again from the first op at or after the
    chain's ``end``; buffers freed at the same op return to the free list in the order they were taken."""
    free: dict[np.dtype, list[int]] = {}
    counts: dict[np.dtype, int] = {}
    held: list[tuple[int, int, np.dtype, int]] = []  # heap of (end, order taken, dtype, index)
    scratch: list[tuple[int, np.dtype, int]] = []
    for k, out in zip(blocked_ops, starts):
        if out is not None:
            dt = env[out].dtype
            lst = free.get(dt)
            if lst:
                bi = lst.pop()
            else:
                bi = counts.get(dt, 0)
                counts[dt] = bi + 1
            heapq.heappush(held, (end[out], len(scratch), dt, bi))
            scratch.append((local[out], dt, bi))
        release_ended(held, k, free)
    return scratch


def release_ended(held: list[tuple[int, int, Any, int]], k: int, free: dict[Any, list[int]]) -> None:
    """Pop the buffers of ``held`` (a heap of (end op, order taken, key, index)) whose end op is ``k`` or
    earlier onto their free lists, in the order they were taken."""
    done = []
    while held and held[0][0] <= k:
        done.append(heapq.heappop(held))
    done.sort(key=lambda h: h[1])
    for _, _, key, bi in done:
        free.setdefault(key, []).append(bi)


class Candidates:
    """A whole output's donation candidates (slot, value) in order: its claimed input, then the others
    ascending by value, which are the first ``count`` of the shared ``pool`` (inputs of its dtype by last
    read), sorted on first need."""

    __slots__ = ("claimed", "pool", "count", "_rest")

    def __init__(self, claimed: tuple[int, int] | None, pool: list[tuple[int, int]], count: int) -> None:
        self.claimed = claimed
        self.pool = pool
        self.count = count
        self._rest: list[tuple[int, int]] | None = None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        if self.claimed is not None:
            yield self.claimed
        rest = self._rest
        if rest is None:
            rest = self._rest = sorted((p for p in self.pool[:self.count] if p != self.claimed),
                                       key=lambda p: p[1])
        yield from rest

    def __len__(self) -> int:
        return self.count

    def __bool__(self) -> bool:
        return self.count > 0


def _candidates(
    wholes: list[int],
    ops: list[tuple],
    last_read: dict[int, int],
    claim: dict[int, int],
    env: dict[int, Any],
    local: dict[int, int],
) -> list[Candidates]:
    """Each whole output's donation candidates: the inputs of its dtype whose last read comes no later than
    the first op writing into its slot, its claimed input first."""
    first: dict[int, int] = {}
    for i, op in enumerate(ops):
        first.setdefault(op[3], i)
    pools: dict[np.dtype, tuple[list[int], list[tuple[int, int]]]] = {}  # dtype → (last reads, pool)
    for s in sorted(last_read, key=lambda s: (last_read[s], s)):
        reads, pool = pools.setdefault(env[s].dtype, ([], []))
        reads.append(last_read[s])
        pool.append((local[s], s))
    out = []
    for o in wholes:
        reads, pool = pools.get(env[o].dtype, ((), []))
        at = first[local[o]]
        c = claim.get(o)
        claimed = (local[c], c) if c is not None and last_read[c] <= at else None
        out.append(Candidates(claimed, pool, bisect.bisect_right(reads, at)))
    return out


class Segment:
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
        cl: Cluster,
        env: dict[int, Any],
        local: dict[int, int],
        last_use: dict[int, int],
        kinds: list[str],
        readers: dict[int, list[int]],
        phase: dict[int, str],
        full: tuple[int, ...],
        blocked_ops: list[int],
        escaping: set[int],
    ) -> Segment:
        """The segment of the blocked ops ``blocked_ops`` (member indices, in order) of shape ``full``."""
        members = cl.members
        n = int(np.prod(full))
        mine = set(blocked_ops)

        def whole(s: int) -> bool:
            v = env.get(s)
            return type(v) is np.ndarray and v.shape == full

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
        claim = _claims([(i, o) for i, o in enumerate(outs) if o in whole_set], last_read, env)
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
        starts = [members[k].outputs[0] for k in blocked_ops]
        starts = [o if root.get(o) == o and o not in sink else None for o in starts]
        scratch = _scratch_buffers(blocked_ops, starts, end, env, local)

        def slot(s: int) -> int:
            if s not in root:
                return local[s]
            return local[sink.get(root[s], root[s])]

        n_slots = len(local)
        consts: list[tuple[int, Any]] = []
        ops: list[tuple] = []
        for k in blocked_ops:
            st = members[k]
            ufunc, extra = member_ufunc(st, env)
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
        reuse = _candidates(wholes, ops, last_read, claim, env, local)
        return cls(
            reuse=reuse,
            n=n,
            block=block,
            par=n >= 2 * _BLOCK_ALIGN and n * cost >= (UPDATE_PAR_MIN_WORK if any(reuse) else PAR_MIN_WORK),
            per_element=cost,
            bytes_per_element=per_elem,
            n_bv=n_slots + len(consts),
            consts=consts,
            small=sorted(local[s] for s in m_inputs if not whole(s)),
            whole_in=whole_in,
            whole_out=whole_out,
            flat_slots=whole_in + [w[0] for w in whole_out],
            scratch=scratch,
            ops=ops,
            # the one-block run as a generated straight-line program (a small weight's update), each op
            # writing into its output slot's buffer
            run_whole=compile_program([(3, f, [a] if b < 0 else [a, b], o, o, None) for f, a, b, o in ops]),
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
        """The whole segment on this thread (a split one runs as pieces: :meth:`split_work`)."""
        self.run_prepared(*self.prepare(vals, donated))

    def run_prepared(self, bv: list[Any], slots: list[tuple]) -> None:
        """The whole segment on the calling thread, in thread 0's scratch, from :meth:`prepare`'s values."""
        self._run_range(bv, slots, 0, self.n, self.block, self._views(0, self.block))

    @property
    def cost(self) -> float:
        """The segment's time in element-ops (elements × ufuncs, an Erf counting ERF_COST), each ufunc call
        counted as :data:`CALL_COST` more."""
        blocks = -(-self.n // self.block)
        return self.n * self.per_element + CALL_COST * len(self.ops) * blocks

    def prepare(self, vals: list[Any], donated: frozenset[int] | None) -> tuple[list[Any], list[tuple]]:
        """The run's block-value slots and its whole arrays (the outputs allocated, or donated inputs)."""
        bv: list[Any] = [None] * self.n_bv
        for i, c in self.consts:
            bv[i] = c
        for i in self.small:
            v = vals[i]
            bv[i] = v if v.ndim <= 1 else v.reshape(1)
        flats = [vals[i].reshape(-1) for i in self.whole_in]
        taken: set[int] = set()
        for (i, shape, dt), reuse in zip(self.whole_out, self.reuse):
            a = None
            if donated:
                for j, ext in reuse:
                    if ext in donated and j not in taken:
                        a = vals[j]
                        taken.add(j)
                        break
            if a is None:
                a = np.empty(shape, dt)
            vals[i] = a
            flats.append(a.reshape(-1))
        return bv, list(zip(self.flat_slots, flats))

    def split_work(self, bv: list[Any], slots: list[tuple],
                   shares: Sequence[float]) -> list[Callable[[], None]]:
        """The segment cut into one piece per thread (thread ``t`` runs piece ``t``), of the fractions
        ``shares`` of its elements (a piece may be empty)."""
        ranges = _cut(self.n, shares, _BLOCK_ALIGN)
        longest = max(hi - lo for lo, hi in ranges)
        # a piece whose working set is below BLOCK_MIN_BYTES runs as one block, as a segment of that size
        # would: each block costs every thread a round of ufunc calls, each a GIL handover that a thread
        # waiting on it pays with a wake-up (the MLP's two split weights, 0.2 M and 0.13 M values a piece:
        # Optimizer.step 0.85-0.94x in a training step, bench/HISTORY.md 2026-12-07)
        block = min(self.block, longest) if longest * self.bytes_per_element >= BLOCK_MIN_BYTES else longest
        views = [self._views(t, block) if hi > lo else [] for t, (lo, hi) in enumerate(ranges)]  # taken here:
        # the pool is not thread-safe
        return [functools.partial(self._run_range, list(bv), slots, lo, hi, block, views[t])
                for t, (lo, hi) in enumerate(ranges)]

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
        if start >= stop:
            return
        for i, v in views:
            bv[i] = v
        if start == 0 and stop == self.n == block:  # one block: the generated straight-line program
            for i, f in slots:
                bv[i] = f
            self.run_whole(bv)
            return
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


def _cut(n: int, shares: Sequence[float], align: int) -> list[tuple[int, int]]:
    """``[0, n)`` as one contiguous range per share (fractions summing to 1), in order, each boundary on a
    multiple of ``align``; a range may be empty."""
    ranges = []
    lo = 0
    acc = 0.0
    for k, f in enumerate(shares):
        acc += f
        hi = n if k == len(shares) - 1 else min(n, max(lo, int(round(acc * n / align)) * align))
        ranges.append((lo, hi))
        lo = hi
    return ranges

"""Inference on the two halves of a batch at once, one half per thread.

A plan splits each kernel over the cores, which leaves them partly idle: small kernels do not split, a
split kernel waits for its slowest part, and OpenBLAS's threads sleep and wake between products. When the
samples of a batch do not interact, the whole graph can instead run twice at the same time, on each half of
the batch, in two plans whose kernels and BLAS calls stay on their own thread. Measured on 2 cores, the
exported transformer encoder of ``bench/engine_overhead.py`` (batch 32): 12.7 → 11.5 ms per forward.

Whether the samples interact is read off the graph where it can be (:mod:`onnxtrain.engine.batch_mixing`:
a node that reduces, normalises, concatenates or gathers along the batch axis, found by following the axis
through the ops whose effect on it is known, keeps the session from splitting at all) and checked where it
cannot. The model must declare a symbolic
dimension (e.g. ``batch``) that every input and every output has exactly once: the batch axis of each. The
first time a batch of some size comes, the run is made both ways, and the halves are used from then on only
if their outputs agree with the whole run's (a model that mixes samples, a batch norm in training mode say,
fails that and keeps running whole). They agree to within :data:`RTOL`, not to the bit: BLAS rounds a
product of half the rows, or on one thread, differently; so the run that checks a batch size answers with
its halves once they agree, and every run of that size gives the same bits. Whether a batch size splits
does not depend on timing: only on the live activations of its whole run (:data:`MIN_ACTIVATION_BYTES`,
and twice the weights: :data:`ACTIVATIONS_PER_WEIGHT`), on the plan's threads (two or more) and on
numpy's BLAS being an OpenBLAS whose thread count can be pinned
(:func:`onnxtrain.engine.blas.single_threaded_blas`). Nor do a size's bits depend on the other Python
threads alive (one might be inside a BLAS call, so BLAS's thread count cannot be pinned then): a size first
seen while one is alive runs whole for the session's life; a checked size runs its halves one after the other
on the calling thread while one is alive, and is split only if that gives the bits of its halves on two
threads (a matrix-vector product that BLAS splits over its own threads rounds otherwise). The session
config entry ``onnxtrain.batch_split = 0`` turns it off. The halves share the whole plan's weights; their
activations, scratch and the second thread's BLAS buffers cost memory (the transformer's session: +15 MiB
of peak RSS).

With ``onnxtrain.batch_split = process`` the second half runs in a forked child process instead of a
thread (:mod:`onnxtrain.engine.half_process`): two threads share one GIL, two processes do not. The child
is made on the first split run, shares the weights' pages, and ends with the session. Where a process
cannot fork (no ``fork()``, an MPI rank) the halves run on threads, with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.engine import half_process
from onnxtrain.engine.affinity import placed
from onnxtrain.engine.backends import BATCH_SPLIT_KEY
from onnxtrain.engine.batch_mixing import batch_mixing_node
from onnxtrain.engine.blas import can_pin_blas_threads, single_threaded_blas
from onnxtrain.engine.interface import RUN_OPTIONS, Terminated
from onnxtrain.engine.parallel import parallel_for, running_with
from onnxtrain.engine.plan import Plan
from onnxtrain.ir.graphs import RANDOM_OPS, walk_graphs
from onnxtrain.user_warning import warn

MIN_ACTIVATION_BYTES = 1 << 20  # a run whose live activations peak lower is not split (too little work to
# gain from it: two dispatch loops and a handoff cost more); the peak depends on the batch size alone, so
# whether a batch size splits does not depend on timing
ACTIVATIONS_PER_WEIGHT = 2.0  # nor one whose activations peak below twice the weights' bytes: each half reads
# all the weights, and a product with many weights and few rows runs well on OpenBLAS's two threads as it is
# (MLP 784-512-512-10 forward at batch 256: 0.98 ms whole, 1.09 ms split; LeNet at 256: 6.9 → 4.2 ms)
# halves against the whole run, by float size in bytes: BLAS rounds products of other sizes differently;
# samples that interact differ by far more
RTOL = {2: 1e-2, 4: 1e-4, 8: 1e-4}
MAX_VERDICTS = 64  # batch sizes whose check is remembered


def batch_axes(model: onnx.ModelProto) -> tuple[dict[str, int], dict[str, int]] | None:
    """(input name → batch axis, output name → batch axis) from a symbolic dimension that each graph input
    (initializers aside) and each output declares exactly once; of several, one whose name says "batch",
    else the first input's first. None when there is none. A wrong pick only fails the check of the halves."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    inputs = [v for v in g.input if v.name not in inits]
    if not inputs or not g.output:
        return None

    def params(v: onnx.ValueInfoProto) -> list[str] | None:
        t = v.type
        if not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
            return None
        return [d.dim_param if d.HasField("dim_param") else "" for d in t.tensor_type.shape.dim]

    shapes = {v.name: params(v) for v in (*inputs, *g.output)}
    if any(not s for s in shapes.values()):  # no shape, or a scalar
        return None
    common = set.intersection(*({p for p in s if p and s.count(p) == 1} for s in shapes.values()))
    if not common:
        return None
    # several (a batch and a sequence length, say): one named for the batch, else the first input's first
    first = shapes[inputs[0].name]
    name = min(common, key=lambda p: ("batch" not in p.lower(), first.index(p)))
    axes = {n: s.index(name) for n, s in shapes.items()}
    return {v.name: axes[v.name] for v in inputs}, {v.name: axes[v.name] for v in g.output}


class BatchSplitter:
    """Runs ``plan``'s inference on the two halves of a batch at once, in two threads or in this thread and
    a child process, when that is checked to give the plan's own outputs (see the module docstring)."""

    def __init__(self, plan: Plan, axes: tuple[dict[str, int], dict[str, int]], mode: str = "threads"):
        self.plan = plan
        self.mode = mode  # "threads" or "process": where the second half runs
        self.child: half_process.HalfProcess | None = None
        self.input_axes, self.output_axes = axes
        self.halves: tuple[Plan, Plan] | None = None
        self.verdicts: dict[int, bool] = {}  # batch size → whether its halves agree with its whole run
        self.split_runs = 0  # runs answered by the halves alone (not those that check them)
        self.weight_bytes = sum(v.nbytes for v in plan.initializers.values())  # shared by the halves

    @classmethod
    def for_plan(cls, plan: Plan, mode: str = "threads") -> BatchSplitter | None:
        """A splitter for ``plan`` running its second half as ``mode`` says ("threads" or "process"), or
        None when its model declares no batch dimension, combines samples along it (found in the graph) or
        it runs on one thread."""
        axes = batch_axes(plan.model)
        if axes is None or plan.threads < 2:
            return None
        if batch_mixing_node(plan.model, axes[0], axes[1]) is not None:  # samples may meet: never split
            return None
        if draws(plan.model):  # halves draw other values than the whole, and their trial run would take
            return None  # generators off set_seed's sequence: later draws would depend on the threads
        if mode == "process" and (why := half_process.available()) is not None:
            warn(f"{BATCH_SPLIT_KEY} = process: {why}; the halves run on threads")
            mode = "threads"
        return cls(plan, axes, mode)

    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None) -> list[Any]:
        """The plan's outputs for ``feeds``: from the two halves when allowed, else from one whole run."""
        batch = self._batch(feeds)
        verdict = self.verdicts.get(batch, None) if batch else False
        if self.plan.profiling or verdict is False:
            return self.plan.run(feeds, output_names)
        if verdict:
            self.split_runs += 1
            try:
                if can_pin_blas_threads():
                    return self._run_halves(feeds, output_names, batch)
                return self._run_halves_here(feeds, output_names, batch)
            except (Terminated, KeyboardInterrupt):
                raise
            except Exception:  # (an input a node refuses): the whole batch's run raises it with its shapes
                return self.plan.run(feeds, output_names)
        whole = self.plan.run(feeds, output_names)
        if verdict is None and len(self.verdicts) < MAX_VERDICTS:
            activations = self.plan.peak_bytes - self.plan._base_bytes
            if activations < max(MIN_ACTIVATION_BYTES, ACTIVATIONS_PER_WEIGHT * self.weight_bytes):
                self.verdicts[batch] = False  # too little work, or too much of it on the weights, to gain
            elif not can_pin_blas_threads():
                # the check needs the halves on one-thread BLAS; this size runs whole from now on, so
                # that its later runs give this run's bits whatever threads are alive then
                self.verdicts[batch] = False
            else:
                try:
                    halves = self._run_halves(feeds, output_names, batch)
                    here = self._run_halves_here(feeds, output_names, batch)
                    # split only if the halves agree with the whole run and give the same bits when they
                    # run one after the other on BLAS's own threads (a later run while another Python
                    # thread is alive): a matrix-vector product split over BLAS's threads rounds otherwise
                    self.verdicts[batch] = (all(_agree(a, b) for a, b in zip(whole, halves))
                                            and all(_same_bits(a, b) for a, b in zip(halves, here)))
                except Terminated:  # the caller's RunOptions.terminate: the run fails, no verdict
                    raise
                except Exception:  # e.g. a reshape to a fixed batch: the model does not run on half a batch
                    self.verdicts[batch] = False
                if self.verdicts[batch]:
                    # the halves answer every later run of this size: this one too, or its bits would
                    # differ from theirs (BLAS rounds half the rows on one thread differently)
                    return halves
        return whole

    def _batch(self, feeds: Mapping[str, Any]) -> int:
        """The batch size all feeds agree on (2 or more), else 0 (no split)."""
        if set(feeds) != set(self.input_axes):
            return 0  # an overridden initializer, or a feed the plan will reject
        sizes = set()
        for name, v in feeds.items():
            if not isinstance(v, np.ndarray) or v.ndim <= self.input_axes[name]:
                return 0
            sizes.add(v.shape[self.input_axes[name]])
        size = sizes.pop() if len(sizes) == 1 else 0
        return size if size >= 2 else 0

    def _run_halves(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None,
                    batch: int) -> list[Any]:
        halves, parts = self._half_plans(), self._parts(feeds, batch)
        results: list[list[Any]]
        if self.mode == "process":
            results, second_peak = self._run_with_child(halves, parts, output_names)
        else:
            results = [[], []]
            watched = RUN_OPTIONS.get()  # the worker thread watches the caller's RunOptions.terminate too

            def half(i: int) -> None:
                token = RUN_OPTIONS.set(watched)
                try:
                    results[i] = halves[i].run(parts[i], output_names)
                finally:
                    RUN_OPTIONS.reset(token)

            # this thread on one CPU, the worker on another
            with single_threaded_blas(), running_with(2), placed(2):
                parallel_for(2, half)
            second_peak = halves[1].peak_bytes
        # both halves count the shared weights
        self.plan.peak_bytes = halves[0].peak_bytes + second_peak - self.weight_bytes
        return self._joined(results, output_names)

    def _parts(self, feeds: Mapping[str, Any], batch: int) -> list[dict[str, Any]]:
        """Each feed cut along its batch axis into a first half of ``batch // 2`` samples and the rest."""
        cut = batch // 2
        parts: list[dict[str, Any]] = [{}, {}]
        for name, v in feeds.items():
            axis = self.input_axes[name]
            index: list[Any] = [slice(None)] * v.ndim
            index[axis] = slice(0, cut)
            parts[0][name] = np.ascontiguousarray(v[tuple(index)])
            index[axis] = slice(cut, batch)
            parts[1][name] = np.ascontiguousarray(v[tuple(index)])
        return parts

    def _joined(self, results: list[list[Any]], output_names: Sequence[str] | None) -> list[Any]:
        """The two halves' outputs joined along each output's batch axis."""
        names = list(output_names) if output_names is not None else self.plan.output_names
        return [np.concatenate([a, b], axis=self.output_axes[n]) for n, a, b in zip(names, *results)]

    def _run_halves_here(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None,
                         batch: int) -> list[Any]:
        """The halves one after the other on the calling thread, BLAS's thread count left as it is: for
        runs while another Python thread is alive, which may be inside a BLAS call."""
        halves, parts = self._half_plans(), self._parts(feeds, batch)
        results = [halves[i].run(parts[i], output_names) for i in range(2)]
        self.plan.peak_bytes = max(h.peak_bytes for h in halves)
        return self._joined(results, output_names)

    def _run_with_child(self, halves: tuple[Plan, Plan], parts: list[dict[str, Any]],
                        output_names: Sequence[str] | None) -> tuple[list[list[Any]], int]:
        """The first half here, the second in the child process (forked on first use); both halves'
        outputs and the second half's peak live bytes. If the child has ended (killed, out of memory),
        its half runs here, with a warning, and the next split run forks a new child."""
        if self.child is None or not self.child.alive:
            self.child = half_process.HalfProcess(halves[1])
        child: half_process.HalfProcess | None = self.child
        try:
            child.submit(parts[1], output_names)
        except half_process.ChildEnded as e:
            _child_ended(e)
            child = None
        try:
            with single_threaded_blas(), placed(2):
                mine = halves[0].run(parts[0], output_names)
        except BaseException:
            if child is not None:
                with suppress(Exception):  # the reply is read, so that the pipe is clean for the next run
                    child.result()
            raise
        if child is not None:
            try:
                return [mine, child.result()], child.peak_bytes
            except half_process.ChildEnded as e:
                _child_ended(e)
        with single_threaded_blas():
            return [mine, halves[1].run(parts[1], output_names)], halves[1].peak_bytes

    def close(self) -> None:
        """End the child process, if one runs the second half."""
        if self.child is not None:
            self.child.close()
            self.child = None

    def _half_plans(self) -> tuple[Plan, Plan]:
        """Two single-threaded plans of the model, sharing the whole plan's initializer arrays."""
        if self.halves is None:
            whole = self.plan
            made = [Plan(whole.model, fuse=whole.fused, threads=1, initializers=whole.initializers)
                    for _ in range(2)]
            self.halves = (made[0], made[1])
        return self.halves


def _child_ended(e: Exception) -> None:
    warn(f"{e}; its half of this batch runs here", RuntimeWarning)


def _agree(whole: Any, half: Any) -> bool:
    """Same dtype and shape, and equal values: for floats within :data:`RTOL` of the largest finite
    magnitude, with NaN and infinities where the whole run has them; exactly for other types."""
    if not isinstance(whole, np.ndarray) or not isinstance(half, np.ndarray):
        return False
    if whole.dtype != half.dtype or whole.shape != half.shape:
        return False
    floating = whole.dtype.kind == "f" or whole.dtype.name == "bfloat16"
    if not floating:
        return bool(np.array_equal(whole, half))
    a, b = whole.astype(np.float64), half.astype(np.float64)
    scale = float(np.max(np.abs(a[np.isfinite(a)]), initial=0.0))
    tol = RTOL[whole.dtype.itemsize]
    return bool(np.allclose(b, a, rtol=tol, atol=tol * scale, equal_nan=True))


def _same_bits(a: Any, b: Any) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
            and a.shape == b.shape and a.tobytes() == b.tobytes())


def draws(model: onnx.ModelProto) -> bool:
    """Whether a run of ``model`` (its bodies too) may draw random values: a random op, or a Dropout whose
    training_mode input is not an initializer holding false."""
    for g in walk_graphs(model.graph):
        fixed = {t.name: t for t in g.initializer}
        for n in g.node:
            if n.op_type not in RANDOM_OPS:
                continue
            if n.op_type != "Dropout":
                return True
            mode = n.input[2] if len(n.input) > 2 else ""
            if mode and not (mode in fixed and not numpy_helper.to_array(fixed[mode]).any()):
                return True
    return False

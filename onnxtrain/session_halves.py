"""A legacy session's step as two graphs (on the onnxruntime backend; on the numpy engine over many small
weights).

The session's single step graph (forward, backward, update) makes onnxruntime's arena hold the update's
weight-sized intermediates beside the backward's: three 4096² weights with Adam peaked at 1,277 MiB above the
RSS before the build, against 796 on the numpy engine; the bench's MLP 784-512-512-10 at 108 MiB against
onnxruntime-training's 104. So a step on the backend runs the step's two halves instead, as data parallelism
does without the exchange: the gradients graph (forward and backward), whose gradients onnxruntime writes into
the arrays of the step before (the numpy engine's kernels allocate them), then the update graph, written into
the weights and moments in place (in pieces when its largest weight has ``ort_chunks.CHUNK_FROM`` values or
more and the graph allows it: :mod:`onnxtrain.engine.ort_chunks`). Peak RSS of the bench's models, single
graph → halves (MiB): MLP at batch 64 108.5 → 105.4, at 256 113.2 → 110.2, LeNet 99.6 → 99.0, transformer
171.0 → 161.4, GPT decoder 147.9 → 146.8; the steps as fast (two sessions in one process, alternating rounds,
halves / single: MLP 0.99 and 0.95, LeNet 0.94). One process (under gradient accumulation, the step that
updates: the gradients graph then gives the sums, which the update reads averaged); a run asking for an output
neither half computes, or feeding a trained weight, runs the single graph.

The numpy engine runs its steps as halves too when the flat update merges many small weights
(:data:`NUMPY_MIN_MERGED`): its single graph updates them weight by weight, a dozen ufunc calls each, where
the flat update makes that dozen for the whole group (the transformer encoder of the bench: 28 weights).

``HalfSteps`` holds the session methods for it; :class:`onnxtrain.session.TrainingSession` mixes it in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.capi.feeds import empty_run
from onnxtrain.capi.outputs import unshared_with
from onnxtrain.engine import ort_chunks
from onnxtrain.graph_transforms.accumulation import buffer_name
from onnxtrain.session_flat import FlatLegacyUpdate

# on the numpy engine the single step graph already runs each weight's update nodes as one fused cluster; the
# halves pay a second plan run and a gather of the merged gradients, so they take over only where the flat
# update saves many clusters (about 13 ufunc calls each): the bench's transformer encoder (28 weights) gains
# 2-3 % of its step, the GPT decoder (29) about nothing, LeNet (10) and the MLP (4) would lose
# (bench/HISTORY.md, 2026-12-07 07:30-08:30 UTC)
NUMPY_MIN_MERGED = 16


class HalfSteps:
    """The two-graph step of ``TrainingSession`` (state: ``_graphs``, ``_store``, ``_specs``, ``_params``)."""

    def _steps_in_halves(self) -> bool:
        """Whether a step runs as its two halves (see the module docstring), in one process, with an
        optimizer, unless ``ONNXTRAIN_ORT_PIECES=0`` (A/B runs): on the onnxruntime backend; on the numpy
        engine when the flat update merges :data:`NUMPY_MIN_MERGED` weights or more into one group. Decided
        once, when built (the update's plan is made here: over flat buffers when the step allows it,
        :mod:`onnxtrain.session_flat`, else the per-weight graph's)."""
        self._flat = None
        if self._dp is not None or self._opt is None or ort_chunks.pieces_off():
            return False
        numpy = self._backend == "numpy"
        self._flat = FlatLegacyUpdate.build(self, NUMPY_MIN_MERGED if numpy else 2)
        if numpy and self._flat is None:
            return False
        if self._flat is not None:
            self._plans["flat_update"] = self._flat.plan  # (profiled and measured with the others)
        else:
            self._get_plan("update")
        return True

    @property
    def peak_bytes(self) -> int:
        """Peak bytes of live tensors during the last run (weights included): of the graph that run ran (a
        micro-step's, a forward-only evaluation's), of the larger half when the step runs as two graphs;
        the training step's before any run."""
        last = getattr(self, "_last_plan", None)
        if last is not None:
            return last.peak_bytes
        if getattr(self, "_halves", False):
            return max(getattr(self._plans.get(k), "peak_bytes", 0)
                       for k in ("gradients", "update", "flat_update"))
        return self._plan.peak_bytes

    def _update_scalars(self) -> set[str]:
        """The update graph's inputs that are one value for every element of their weight: the learning
        rate, the loss scale, the per-weight step counts (optimizer state of another shape than its
        weight's); the weights, gradients and moments are the others."""
        g = self._graphs
        update = g.update_graph
        specs = {sp.name: sp for sp in self._specs}
        trained = set(g.trainable) | {f"{w}_grad" for w in g.trainable}
        out = set()
        for vi in update.graph.input:
            name = vi.name
            sp = specs.get(name)
            if name in trained:
                continue
            if (sp is not None and sp.weight and sp.initial.dtype.kind == "f"
                    and np.shape(sp.initial) == np.shape(self._store[sp.weight])):
                continue  # a moment (a step count is an integer)
            out.add(name)
        return out

    def _run_halves(self, names: list[str], feeds: dict[str, Any]) -> list[np.ndarray] | None:
        """One training step as the gradients graph, then the update graph; the outputs ``names``
        (None when one of them is in neither half: the caller runs the single graph)."""
        g, store = self._graphs, self._store
        if any(w in feeds for w in self._fed_weights):  # a trained weight overridden for this run
            return None
        gp, flat = self._get_plan("gradients"), self._flat
        # the flat update, unless a run asks for an output of the update graph or the step counts differ
        if (flat is not None and flat.lr in feeds and all(n in gp.output_info for n in names)
                and flat.applies(store)):
            up = None
        else:
            up, flat = self._get_plan("update"), None
        if any(n not in gp.output_info and (up is None or n not in up.output_info) for n in names):
            return None
        steps = self._params.gradient_accumulation_steps
        gupd = g.updates["gradients"]
        # the gradients the update reads: this run's, or the sums over the accumulation's micro-steps
        grad_names = [gupd[buffer_name(f"{w}_grad")] if steps > 1 else f"{w}_grad" for w in g.trainable]
        gitems = [(s, o) for s, o in gupd.items() if s in g.bn_stats]  # training-mode BatchNorm statistics
        # a batch of no sample leaves them as they were (its batch statistics are 0/0), as in the single graph
        empty = empty_run(feeds)
        local = [n for n in names if n in gp.output_info and n not in grad_names]
        gfeeds = self._feeds_of(gp, feeds)
        # the step's gradients go into the step before's arrays (zeros before the first), so that the arena
        # does not hold them beside the update's intermediates; under accumulation they are the sums' own
        kw: dict[str, Any] = {}  # (none on the numpy engine: its kernels allocate them)
        if steps == 1 and self._backend != "numpy":
            reuse = self._grad_arrays or {n: np.zeros_like(store[w]) for n, w in zip(grad_names, g.trainable)}
            if self._flat is not None and not self._grad_arrays:  # straight into the flat gradients
                reuse.update(self._flat.grad_targets())
            kw["reuse"] = reuse
        res = gp.run(gfeeds, local + grad_names + [o for _, o in gitems],
                     donate=[s for s, _ in gitems if s in gfeeds and not empty], **kw)
        outs = res[:len(local)]
        if self._backend == "numpy":  # an output passing a weight through must not see the update's writes
            outs = unshared_with(outs, store.values())
        got = dict(zip(local, outs))
        grads = res[len(local):len(local) + len(grad_names)]
        for (stat, _), v in zip(gitems, res[len(local) + len(grad_names):]):
            if not empty:
                store[stat] = v
        if steps > 1:  # their mean, as the single graph's Mul by 1/N (the sums are this run's own arrays),
            for a in grads:  # then in the weight's type (the sums of half gradients are float32)
                np.multiply(a, a.dtype.type(1.0 / steps), out=a)
            grads = [a.astype(store[w].dtype, copy=False) for a, w in zip(grads, g.trainable)]
        got.update((n, a.copy()) for n, a in zip(grad_names, grads) if n in names)  # the next step's arrays
        by_weight = {f"{w}_grad": a for w, a in zip(g.trainable, grads)}  # the update's gradient inputs
        if up is None:
            if self._backend == "numpy":  # nothing keeps them for the next step: each merged one dies once
                del res  # gathered, before the update's intermediates (the GPT decoder's peak RSS)
                grads = []
            flat.step(store, by_weight, feeds[flat.lr])
            return self._after_update(got, names, grad_names, grads)
        # the learning rate and a mixed-precision update's loss scale from the caller's feeds
        ufeeds = self._feeds_of(up, feeds, by_weight)
        uitems = list(g.updates["update"].items())
        extra = [n for n in names if n in up.output_info and n not in got]
        out = up.run(ufeeds, extra + [o for _, o in uitems], donate=[s for s, _ in uitems if s in ufeeds])
        got.update(zip(extra, out))
        for (state, _), v in zip(uitems, out[len(extra):]):
            store[state] = v
        return self._after_update(got, names, grad_names, grads)

    def _after_update(self, got: dict[str, Any], names: list[str], grad_names: list[str],
                      grads: list[np.ndarray]) -> list[np.ndarray]:
        """A two-graph step's end: the accumulation buffers zeroed, the gradients' arrays kept for the next
        step, the outputs ``names``."""
        for b in self._graphs.buffers:
            self._store[b] = np.zeros_like(self._store[b])
        self._micro_step = 0
        if self._params.gradient_accumulation_steps == 1 and self._backend != "numpy":
            self._grad_arrays = dict(zip(grad_names, grads))
        return [got[n] for n in names]

"""A legacy session's step as two graphs on the onnxruntime backend, for large weights.

The session's single step graph (forward, backward, update) makes onnxruntime's arena hold the update's
weight-sized intermediates beside the backward's: three 4096² weights with Adam peaked at 1,277 MiB above
the RSS before the build, against 796 on the numpy engine. When the session's largest trained weight has
``ort_chunks.CHUNK_FROM`` values or more and its update graph can run in pieces
(:mod:`onnxtrain.engine.ort_chunks`), a step on the backend runs the step's two halves instead, as data
parallelism does without the exchange: the gradients graph (forward and backward, the gradients out), then the
update graph in pieces, written into the weights and moments in place. One process (under gradient
accumulation, the step that updates: the gradients graph then gives the sums, which the update reads
averaged); a run asking for an output neither half computes runs the single graph.

``HalfSteps`` holds the session methods for it; :class:`onnxtrain.session.TrainingSession` mixes it in.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from onnxtrain.engine import ort_chunks
from onnxtrain.graph_transforms.accumulation import buffer_name


class HalfSteps:
    """The two-graph step of ``TrainingSession`` (state: ``_graphs``, ``_store``, ``_specs``, ``_params``)."""

    def _steps_in_halves(self) -> bool:
        """Whether a step runs as its two halves (see the module docstring): decided once, when built."""
        g = self._graphs
        if (self._backend == "numpy" or self._dp is not None or self._opt is None
                or not any(self._store[w].size >= ort_chunks.CHUNK_FROM for w in g.trainable)):
            return False
        # the halves are built here, for large weights only; the update's plan tells whether onnxruntime's
        # graph of it (after onnxtrain's rewrites) runs in pieces
        if getattr(self._get_plan("update"), "_chunks", None) is not None:
            return True
        del self._plans["update"]
        return False

    @property
    def peak_bytes(self) -> int:
        """Peak bytes of live tensors during the last run (weights included): of the graph that run ran (a
        micro-step's, a forward-only evaluation's), of the larger half when the step runs as two graphs;
        the training step's before any run."""
        last = getattr(self, "_last_plan", None)
        if last is not None:
            return last.peak_bytes
        if getattr(self, "_halves", False):
            return max(getattr(self._plans.get(k), "peak_bytes", 0) for k in ("gradients", "update"))
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
        gp, up = self._get_plan("gradients"), self._get_plan("update")
        if any(n not in gp.output_info and n not in up.output_info for n in names):
            return None
        steps = self._params.gradient_accumulation_steps
        gupd = g.updates["gradients"]
        # the gradients the update reads: this run's, or the sums over the accumulation's micro-steps
        grad_names = [gupd[buffer_name(f"{w}_grad")] if steps > 1 else f"{w}_grad" for w in g.trainable]
        gitems = [(s, o) for s, o in gupd.items() if s in g.bn_stats]  # training-mode BatchNorm statistics
        local = [n for n in names if n in gp.output_info and n not in grad_names]
        gfeeds = self._feeds_of(gp, feeds)
        res = gp.run(gfeeds, local + grad_names + [o for _, o in gitems],
                     donate=[s for s, _ in gitems if s in gfeeds])
        got = dict(zip(local, res))
        grads = res[len(local):len(local) + len(grad_names)]
        got.update(zip(grad_names, grads))
        for (stat, _), v in zip(gitems, res[len(local) + len(grad_names):]):
            store[stat] = v
        if steps > 1:  # their mean, as the single graph's Mul by 1/N (the sums are this run's own arrays)
            for a in grads:
                np.multiply(a, a.dtype.type(1.0 / steps), out=a)
        # the learning rate and a mixed-precision update's loss scale from the caller's feeds
        ufeeds = self._feeds_of(up, feeds, {f"{w}_grad": a for w, a in zip(g.trainable, grads)})
        uitems = list(g.updates["update"].items())
        extra = [n for n in names if n in up.output_info and n not in got]
        out = up.run(ufeeds, extra + [o for _, o in uitems], donate=[s for s, _ in uitems if s in ufeeds])
        got.update(zip(extra, out))
        for (state, _), v in zip(uitems, out[len(extra):]):
            store[state] = v
        for b in g.buffers:
            store[b] = np.zeros_like(store[b])
        self._micro_step = 0
        return [got[n] for n in names]

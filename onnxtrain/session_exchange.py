"""How the data-parallel replicas of a cut legacy session (pipeline stages, split layers) combine their
updates beyond averaging gradients: ZeRO stage 1 or Adasum, within the group of ranks that hold the same part
of the model (``self._data``).

* ZeRO stage 1 (:mod:`onnxtrain.parallel.zero`): each replica keeps the optimizer state of its pieces of the
  part's trained weights only, updates those pieces with the replicas' mean gradients, and the group
  all-gathers the weights.
* Adasum (:mod:`onnxtrain.parallel.adasum`): each replica updates with its own gradients, then the part's
  weights become the old ones plus the Adasum of the replicas' deltas. A weight split over the ranks of a
  replica (a share) takes the dot products of the whole tensor: its shares' sums added over the replica.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import onnx

from onnxtrain.graph_transforms.flags import flag_array
from onnxtrain.graph_transforms.mixed_precision import ALL_FINITE
from onnxtrain.parallel.adasum import adasum_step, every_rank_finite
from onnxtrain.parallel.stage_graphs import NORM
from onnxtrain.parallel.zero import zero_update_slots
from onnxtrain.training_graph import build_update_graph


class ReplicaExchange:
    """ZeRO stage 1 and Adasum for a :class:`~onnxtrain.session_cut.CutModelSession` (see the module
    docstring); the session gives its update plans through :meth:`_update_plan`."""

    def _update_plan(self, kind: str) -> tuple[Any, Mapping[str, str]]:
        """The plan of the update graph ``kind`` ("update", or "zero_update" under ZeRO) and its outputs
        (state name → output)."""
        raise NotImplementedError

    # ---- ZeRO stage 1 --------------------------------------------------------------------------
    def _setup_zero(self, base: onnx.ModelProto) -> onnx.ModelProto | None:
        """Under ZeRO stage 1: this replica's pieces of the part's trained weights and their optimizer state
        (sliced from the whole state, so a given initial state carries over). Returns the pieces' update
        graph (``base`` gives the weights' types), None when this replica updates nothing."""
        trained = self._trained()
        self._zero_updates: dict[str, str] = {}
        if self._mode != "zero1" or not trained:
            return None
        p, store = self._params, self._store
        weights = {w: store[w] for w in trained}
        z, self._zdtype, slots = zero_update_slots(
            weights, self.data_parallel_size, self.data_parallel_rank, p, self._original
        )
        self._zero = z
        self._full_state_names = {sp.name for sp in self._specs}
        whole = {sp.name: store.pop(sp.name) for sp in self._specs}
        graph, specs = None, []
        if slots:
            clip = p.enable_grad_norm_clip
            norm = NORM if clip or self._mp is not None else None  # mixed precision's finite flag: the norm
            graph, self._zero_updates, _, specs = build_update_graph(
                base, slots, p, self._opt, clip=clip, norm_input=norm, mp=self._mp
            )
        self._specs = specs
        for sp in specs:
            pc = z.piece_of.get(sp.weight)
            full = whole.get(f"{sp.key}_{pc.weight}" if pc is not None else sp.name)
            if full is None:
                store[sp.name] = sp.initial.copy()
            elif pc is not None and sp.elementwise and full.shape == z.shapes[pc.weight]:
                store[sp.name] = np.array(z.piece_view(pc, full)).reshape(pc.shape)
            else:
                store[sp.name] = np.array(full)
        return graph

    def _zero_update(self, given: Mapping[str, Any]) -> None:
        """Update this replica's pieces with the replicas' mean gradients (in ``given``), then all-gather the
        weights over the replicas."""
        z, store = self._zero, self._store
        wflat = np.zeros(z.padded, self._zdtype)
        if z.pieces:
            feeds = dict(given)
            for pc in z.pieces:
                w = store[pc.weight]
                feeds[pc.name] = w if pc.whole else np.array(z.piece_view(pc, w))
                feeds[f"{pc.name}_grad"] = z.piece_view(pc, given[f"{pc.weight}_grad"]).reshape(pc.shape)
            self._run_update(*self._update_plan("zero_update"), feeds)
            for pc in z.pieces:
                value = store[pc.name] if pc.whole else store.pop(pc.name)
                wflat[pc.offset : pc.offset + pc.stop - pc.start] = value.reshape(-1)
        self._data.allgather_(wflat, f"ZeRO weight allgather over the replicas ({wflat.nbytes} bytes)")
        store.update({w: v.copy() for w, v in z.unflatten(wflat).items()})

    # ---- Adasum --------------------------------------------------------------------------------
    def _adasum_update(
        self,
        given: Mapping[str, Any],
        finite: dict[str, np.ndarray],
        shares: Collection[str] = (),
        replica: Any = None,
    ) -> None:
        """Adasum: each replica updates with its own gradients (in ``given``), then the part's weights
        become the old ones plus the combination of its replicas' deltas; ``shares``: the trained weights
        that are shares of a tensor split over ``self._comm``'s ranks. Under mixed precision (``finite``
        holds this replica's flag) nothing is updated unless every replica's gradients were finite, and the
        combined deltas reach the weights only when they are all finite (on every rank of the replica:
        ``replica``, default ``self._comm``), as the legacy's data-parallel Adasum."""
        gated = self._mp is not None
        if gated:
            finite[ALL_FINITE] = flag_array(
                every_rank_finite(self._data, finite[ALL_FINITE], "Adasum all-finite check")
            )
            if not finite[ALL_FINITE]:
                return
        whole = self._comm if replica is None else replica
        names = self._trained()
        if not names:  # a part that trains nothing takes part in the check the replica's others make
            if gated:
                every_rank_finite(whole, True, "Adasum deltas-finite check")
            return
        old = [self._store[w].copy() for w in names]
        self._run_update(*self._update_plan("update"), given)
        split = [w in shares for w in names]
        weights, _ = adasum_step(
            self._data, old, [self._store[w] for w in names], gated,
            lambda ok: every_rank_finite(whole, ok, "Adasum deltas-finite check"),
            shares=(self._comm, split) if any(split) else None,
        )
        self._store.update(zip(names, weights))

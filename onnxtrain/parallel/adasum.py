"""Adasum (spec §11.3): combine per-rank update vectors pairwise, over a power-of-two number of ranks.

For two vectors ``a`` and ``b`` of one tensor (dot products in float64)::

    Adasum(a, b) = (1 − a·b / (2‖a‖²))·a + (1 − a·b / (2‖b‖²))·b

where a coefficient stays 1 when its squared norm is below sqrt(DBL_MIN). Ranks are combined as a
tree by recursive doubling: at level d = 1, 2, 4, … each rank swaps its current vector with rank
``rank XOR d`` and both compute the rule with the lower rank's vector as ``a``, so every rank ends
with bit-identical results.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from onnxtrain.parallel.comm import Communicator

_TINY = float(np.sqrt(np.finfo(np.float64).tiny))
ALL_DELTAS_FINITE = "adasum_all_deltas_finite"  # the legacy output of Adasum under mixed precision


def is_power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def adasum_pair(
    a: np.ndarray,
    b: np.ndarray,
    starts: np.ndarray,
    total: Callable[[np.ndarray], np.ndarray] | None = None,
) -> np.ndarray:
    """The pairwise rule applied per tensor to flat ``a`` and ``b``; tensor k starts at ``starts[k]``.
    ``total`` maps the per-tensor sums (rows a·b, ‖a‖², ‖b‖²) to those of the whole tensors, for tensors of
    which ``a`` and ``b`` hold a share.

    Returns a new array of ``a``'s dtype (the combination is formed in float64, then rounded once).
    """
    a64 = a.astype(np.float64)
    b64 = b.astype(np.float64)
    if a.size == 0:
        return a.copy()
    sums = np.stack([np.add.reduceat(x * y, starts) for x, y in ((a64, b64), (a64, a64), (b64, b64))])
    dot, na, nb = total(sums) if total is not None else sums
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(na >= _TINY, 1.0 - dot / (2.0 * na), 1.0)
        cb = np.where(nb >= _TINY, 1.0 - dot / (2.0 * nb), 1.0)
    counts = np.diff(np.append(starts, a.size))
    a64 *= np.repeat(ca, counts)
    a64 += b64 * np.repeat(cb, counts)
    return a64.astype(a.dtype, copy=False)


def adasum_reduce(
    comm: Communicator,
    arrays: Sequence[np.ndarray],
    shares: tuple[Communicator, Sequence[bool]] | None = None,
) -> list[np.ndarray]:
    """Adasum of every rank's ``arrays`` (same shapes and dtypes on all ranks); new arrays, equal on all.

    ``shares = (group, split)``: ``arrays[i]`` with ``split[i]`` is this rank's share of a tensor cut over
    ``group`` (whose ranks take the same steps together, each with its own ``comm``); its dot products are
    the whole tensor's, summed over the group. The other arrays are whole, alike on the group's ranks.
    """
    if not is_power_of_two(comm.size):
        raise ValueError(f"enable_adasum needs a power-of-two number of data-parallel ranks, got {comm.size}")
    arrays = [np.asarray(a) for a in arrays]
    out: list[np.ndarray | None] = [None] * len(arrays)
    by_dtype: dict[str, list[int]] = {}
    for i, a in enumerate(arrays):
        by_dtype.setdefault(a.dtype.str, []).append(i)
    for idx in by_dtype.values():
        keep = [i for i in idx if arrays[i].size]
        dt = arrays[idx[0]].dtype
        flat = np.concatenate([arrays[i].reshape(-1) for i in keep]) if keep else np.zeros(0, dt)
        starts = np.cumsum([0] + [arrays[i].size for i in keep[:-1]]).astype(np.int64)
        other = np.empty_like(flat)
        total = None
        if shares is not None and any(shares[1][i] for i in keep):
            total = _share_sums(shares[0], np.array([shares[1][i] for i in keep]))
        d = 1
        while d < comm.size:
            peer = comm.rank ^ d
            comm.sendrecv(flat, other, peer, f"Adasum exchange with rank {peer} ({flat.nbytes} bytes)")
            pair = (flat, other) if comm.rank < peer else (other, flat)
            flat = adasum_pair(*pair, starts, total)
            d *= 2
        pos = 0
        for i in idx:
            n = arrays[i].size
            out[i] = flat[pos:pos + n].reshape(arrays[i].shape) if n else arrays[i].copy()
            pos += n
    return out  # type: ignore[return-value]


def _share_sums(group: Communicator, split: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """The per-tensor sums of the whole tensors: a split tensor's added over ``group``, a whole tensor's
    its own (counted once: the other ranks give zero)."""
    own = split | (group.rank == 0)

    def total(sums: np.ndarray) -> np.ndarray:
        return group.allreduce_(np.where(own, sums, 0.0), "Adasum: the dot products of the split tensors")

    return total


def every_rank_finite(comm: Communicator, finite: bool, what: str) -> bool:
    """Whether ``finite`` holds on every rank of ``comm`` (a collective; ``what`` names it in errors)."""
    return comm.allreduce_scalar(float(bool(finite)), what) == comm.size


def adasum_step(
    comm: Communicator,
    old: Sequence[np.ndarray],
    new: Sequence[np.ndarray],
    gated: bool,
    agree: Callable[[bool], bool] | None = None,
    shares: tuple[Communicator, Sequence[bool]] | None = None,
) -> tuple[list[np.ndarray], bool]:
    """The weights after an Adasum step: ``old`` plus the Adasum over ``comm`` of every rank's delta
    ``new - old``. ``gated`` (mixed precision): the combined deltas are applied only when all are finite,
    a decision ``agree`` makes common to other ranks too, else ``old`` is kept. Returns the weights and
    whether the deltas were applied. ``shares``: as for :func:`adasum_reduce`."""
    deltas = adasum_reduce(comm, [n - o for n, o in zip(new, old)], shares)
    apply = not gated or all(bool(np.isfinite(d).all()) for d in deltas)  # alike on comm's ranks
    if gated and agree is not None:
        apply = agree(apply)
    return [o + d if apply else o for o, d in zip(old, deltas)], apply


def adasum_reference(vectors: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """Float64 numpy reference: ``vectors[r]`` is rank r's list of tensors; same tree, formula per tensor."""
    level = [[np.asarray(t, np.float64) for t in v] for v in vectors]
    while len(level) > 1:
        nxt = []
        for a, b in zip(level[0::2], level[1::2]):
            pair = []
            for x, y in zip(a, b):
                dot, nx, ny = float(np.vdot(x, y)), float(np.vdot(x, x)), float(np.vdot(y, y))
                cx = 1.0 - dot / (2 * nx) if nx >= _TINY else 1.0
                cy = 1.0 - dot / (2 * ny) if ny >= _TINY else 1.0
                pair.append(cx * x + cy * y)
            nxt.append(pair)
        level = nxt
    return level[0]

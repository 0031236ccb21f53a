"""ZeRO stage 1 layout (spec §11.4): which flat element range of the trained weights each rank updates.

Trained weights in sorted-name order form one flat range of ``T`` elements, padded to
``T + alignment − T mod alignment`` with ``alignment = D·32`` (a whole extra block when already
aligned); rank r owns ``[r·per_rank, (r+1)·per_rank)``. A weight inside the owned range is updated
whole; a weight that straddles a boundary of it is cut into up to three flat views
``<w>_view_<k>`` (before / owned / after; only non-empty pieces are numbered) and only the owned
view has optimizer state; a weight wholly outside has none. Names are as in the legacy builder,
so they depend on the rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from onnxtrain.parallel.buckets import scale_into

ALIGN_PER_RANK = 32


@dataclass(frozen=True)
class Piece:
    """An owned part of a weight: elements ``[start, stop)`` of the flattened weight."""

    weight: str
    name: str  # the weight's name, or ``<w>_view_<k>``
    start: int
    stop: int
    offset: int  # position of element ``start`` in the global flat range
    shape: tuple[int, ...]  # the weight's shape when whole, else (stop − start,)

    @property
    def whole(self) -> bool:
        return self.name == self.weight


class ZeroLayout:
    """The partition of ``weights`` (name → shape, in any order) over ``size`` ranks, seen by ``rank``."""

    def __init__(self, weights: dict[str, tuple[int, ...]], size: int, rank: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside 0..{size - 1}")
        self.size, self.rank = size, rank
        self.names = sorted(weights)
        self.shapes = {w: tuple(weights[w]) for w in self.names}
        self.numel = {w: int(np.prod(self.shapes[w], dtype=np.int64)) for w in self.names}
        self.offsets: dict[str, int] = {}
        total = 0
        for w in self.names:
            self.offsets[w] = total
            total += self.numel[w]
        alignment = size * ALIGN_PER_RANK
        self.total = total
        self.padded = total + alignment - total % alignment
        self.per_rank = self.padded // size
        lo, hi = rank * self.per_rank, (rank + 1) * self.per_rank
        self.lo, self.hi = lo, hi
        self.pieces: list[Piece] = []
        self.partition_info: dict[str, dict[str, list[int]]] = {}
        for w in self.names:
            o, n = self.offsets[w], self.numel[w]
            if n == 0 or o + n <= lo or o >= hi:
                continue  # wholly outside: no optimizer
            if lo <= o and o + n <= hi:
                self.pieces.append(Piece(w, w, 0, n, o, self.shapes[w]))
                continue
            cuts = [0, max(0, lo - o), min(n, hi - o), n]
            k = 0
            for a, b in zip(cuts[:-1], cuts[1:]):
                if b <= a:
                    continue
                if o + a >= lo and o + b <= hi:
                    self.pieces.append(Piece(w, f"{w}_view_{k}", a, b, o + a, (b - a,)))
                k += 1
            self.partition_info[w] = {"original_dim": list(self.shapes[w]), "megatron_row_partition": [-1]}
        self.piece_of = {p.name: p for p in self.pieces}

    def flatten_into(self, arrays: dict[str, np.ndarray], out: np.ndarray, scale: float = 1.0) -> np.ndarray:
        """Write every weight-shaped array (times ``scale``) at its offset in ``out`` (length ``padded``)."""
        for w in self.names:
            o, n = self.offsets[w], self.numel[w]
            scale_into(arrays[w], scale, out[o:o + n].reshape(self.shapes[w]))
        return out

    def unflatten(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Views of ``flat`` (length ``padded``) shaped as the weights."""
        return {w: flat[self.offsets[w]:self.offsets[w] + self.numel[w]].reshape(self.shapes[w])
                for w in self.names}

    def piece_view(self, p: Piece, weight_value: np.ndarray) -> np.ndarray:
        """The piece's part of a full weight-shaped array (a view when possible)."""
        if p.whole:
            return weight_value
        return np.ascontiguousarray(weight_value).reshape(-1)[p.start:p.stop]

    def local_slice(self, p: Piece) -> slice:
        """Where the piece lives inside this rank's owned block (0 .. per_rank)."""
        return slice(p.offset - self.lo, p.offset - self.lo + (p.stop - p.start))


def gather_zero_state(
    comm: Any,
    layout: ZeroLayout,
    state: dict[str, np.ndarray],
    full_names: dict[str, list[tuple[str, Piece, bool]]],
) -> dict[str, np.ndarray]:
    """``state`` (a rank's ``get_state()``) with its pieces' optimizer state replaced by the unpartitioned
    state reassembled over ``comm`` (a collective over the ZeRO group); ``full_names``: unpartitioned name →
    [(this rank's name, piece, elementwise)]."""
    state = dict(state)
    mine = []
    for full, parts in full_names.items():
        for name, pc, elementwise in parts:
            mine.append((full, pc.weight, pc.start, pc.stop, elementwise, state.pop(name)))
    gathered: dict[str, np.ndarray] = {}
    for part in comm.allgather_object(mine, "gathering the ZeRO optimizer state"):
        for full, w, a, b, elementwise, v in part:
            if not elementwise:
                gathered.setdefault(full, v)
                continue
            buf = gathered.setdefault(full, np.zeros(layout.shapes[w], v.dtype))
            buf.reshape(-1)[a:b] = v.reshape(-1)
    state.update(gathered)
    return dict(sorted(state.items()))


def zero_update_slots(
    weights: dict[str, np.ndarray],
    size: int,
    rank: int,
    params: Any,
    original: Callable[[str], str] | None = None,
) -> tuple[ZeroLayout, np.dtype, list[Any]]:
    """The ZeRO-1 layout of the trained ``weights`` over ``size`` ranks, their one dtype, and the update
    slots (``WeightSlot``) of rank ``rank``'s pieces with each weight's optimizer attributes from
    ``params`` (the legacy TrainingParameters), looked up under ``original(weight)`` (a share of a split
    weight: the whole weight's name)."""
    name = original or (lambda w: w)
    from onnxtrain.optim import WeightSlot

    dtypes = {a.dtype for a in weights.values()}
    if len(dtypes) != 1:
        raise NotImplementedError(
            f"deepspeed_zero_stage=1 needs trained weights of one dtype, got {sorted(map(str, dtypes))}"
        )
    dtype = dtypes.pop()
    layout = ZeroLayout({w: a.shape for w, a in weights.items()}, size, rank)
    elem = onnx.helper.np_dtype_to_tensor_dtype(dtype)
    slots = [
        WeightSlot(
            pc.name,
            f"{pc.name}_grad",
            pc.shape,
            elem,
            dict(params.optimizer_attributes_map.get(name(pc.weight), {})),
            dict(params.optimizer_int_attributes_map.get(name(pc.weight), {})),
        )
        for pc in layout.pieces
    ]
    return layout, dtype, slots


def state_bytes(arrays: Sequence[np.ndarray]) -> int:
    return int(sum(a.nbytes for a in arrays))

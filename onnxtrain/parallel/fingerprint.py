"""Start-up check that every rank trains the same model the same way, with an error naming what differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnxtrain.parallel.comm import Communicator


def digest(data: bytes) -> str:
    # imported here, not at the top: hashlib maps OpenSSL's libcrypto (3.6 MiB), which one process never needs
    import hashlib

    return hashlib.blake2b(data, digest_size=12).hexdigest()


def array_digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    return digest(f"{a.dtype.str}{a.shape}".encode() + a.tobytes())


def canonical(value: Any) -> str:
    """``repr(value)`` with the keys of every dict and the members of every set in sorted order: equal
    options give the same text on every rank whatever the order they were filled in (a dict built by
    iterating a set follows each process's hash seed)."""
    if isinstance(value, Mapping):
        items = sorted((canonical(k), canonical(v)) for k, v in value.items())
        return "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(canonical(v) for v in value)) + "}" if value else "set()"
    if isinstance(value, list):
        return "[" + ", ".join(canonical(v) for v in value) + "]"
    if isinstance(value, tuple):
        return "(" + ", ".join(canonical(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


def describe(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _difference(name: str, mine: Any, theirs: Any, r: int) -> str:
    if isinstance(mine, Mapping) and isinstance(theirs, Mapping):
        only_a = sorted(set(mine) - set(theirs))
        only_b = sorted(set(theirs) - set(mine))
        changed = sorted(k for k in set(mine) & set(theirs) if mine[k] != theirs[k])
        parts = []
        if only_a:
            parts.append(f"only on rank 0: {describe(only_a)}")
        if only_b:
            parts.append(f"only on rank {r}: {describe(only_b)}")
        for k in changed[:3]:
            parts.append(f"{k}: rank 0 {describe(mine[k], 60)}, rank {r} {describe(theirs[k], 60)}")
        if len(changed) > 3:
            parts.append(f"and {len(changed) - 3} more ({describe(changed[3:])})")
        return f"rank {r} differs from rank 0 in {name}: " + "; ".join(parts)
    return f"rank {r} differs from rank 0 in {name}: rank 0 {describe(mine)}, rank {r} {describe(theirs)}"


def check_same_on_all_ranks(comm: Communicator, fingerprint: Mapping[str, Any], what: str = "model") -> None:
    """Compare ``fingerprint`` (field → picklable value) with rank 0's; raise on every rank if any differs.

    The error lists, for each rank that differs, the fields and how they differ.
    """
    if comm.size == 1:
        return
    # a legacy session's check (its fingerprint holds TrainingParameters): what a timeout may mean
    hint = (" (every rank must build this session: a rank given TrainingParameters.world_size = 1 trains "
            "alone and never comes)") if "training parameters" in fingerprint else ""
    everyone = comm.allgather_object(dict(fingerprint), f"start-up check of the {what} on all ranks{hint}")
    ref = everyone[0]
    problems = []
    for r, fp in enumerate(everyone[1:], start=1):
        fields = [k for k in [*ref, *(k for k in fp if k not in ref)] if ref.get(k) != fp.get(k)]
        for k in fields:
            problems.append(_difference(k, ref.get(k), fp.get(k), r))
    if problems:
        raise RuntimeError(f"the ranks do not hold the same {what}: " + " | ".join(problems))


def check_same_scalars(comm: Communicator, values: Mapping[str, float], what: str) -> None:
    """ValueError on every rank when the ranks' ``values`` (label → number, the same labels on every rank)
    differ: the update settings each rank applies to its replica or its share (learning rate, loss scale).
    One allgather of ``len(values)`` doubles; ``what`` names the collective in a timeout's message."""
    if comm.size == 1 or not values:
        return
    labels = list(values)
    every = np.zeros((comm.size, len(labels)), np.float64)  # row r: rank r's values
    every[comm.rank] = [float(values[k]) for k in labels]
    comm.allgather_(every.reshape(-1), what)
    for k, label in enumerate(labels):
        column = every[:, k]
        if not (column == column[0]).all() and not np.isnan(column).all():
            raise ValueError(f"{label}: the ranks fed different values ({column.tolist()} by rank); "
                             "data-parallel ranks must update with the same ones, or their weights part "
                             "(replicas) or mix (ZeRO's shares)")

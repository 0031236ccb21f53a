"""The seed of random nodes without a ``seed`` attribute (Dropout, RandomNormal, ...): one module-level seed
sequence for the numpy engine's nodes, and the seed passed on to onnxruntime's generators for the backend.

Kept apart from the kernels so that the onnxruntime backend reads it without importing the numpy engine,
and without ``numpy.random`` until a seed is set or drawn: numpy.random imports ``secrets``, hence hashlib and
OpenSSL's libcrypto (with its own extension modules, 5.8 MiB of a backend session's peak RSS).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

# "seq": the seed sequence the unseeded nodes' generators spawn from, made from fresh OS entropy on first use
# unless set_random_seed made it first
_unseeded: dict[str, Any] = {"seq": None, "epoch": 0}


def set_random_seed(seed: int | None) -> None:
    """Reseed every random node (these ops and Dropout) that has no ``seed`` attribute (None: fresh OS
    entropy), on the numpy engine and on the onnxruntime backend.

    After this call the unseeded nodes draw the same values, run after run, as after any other call with
    the same seed (given the same graphs run in the same order). onnxruntime draws from generators of its
    own: it gets a seed made from this one now when it is imported, else when the backend imports it (see
    :func:`onnxruntime_seed`).
    """
    seq = np.random.SeedSequence(seed)
    _unseeded["seq"] = seq
    _unseeded["epoch"] += 1
    # onnxruntime's seed is an int64; derived from the sequence so that None gives fresh entropy there too
    _unseeded["ort_seed"] = int(seq.generate_state(1, np.uint64)[0] >> np.uint64(1))
    ort = sys.modules.get("onnxruntime")
    if ort is not None:
        seed_onnxruntime(ort)


def onnxruntime_seed() -> int | None:
    """The seed :func:`set_random_seed` last made for onnxruntime (None: never called)."""
    return _unseeded.get("ort_seed")


def seed_onnxruntime(ort: Any) -> None:
    """Pass the last :func:`set_random_seed` on to the ``onnxruntime`` module ``ort`` (``ort.set_seed``: its
    Dropout's draws from then on, and those of random nodes in sessions made after it)."""
    seed = onnxruntime_seed()
    set_seed = getattr(ort, "set_seed", None)
    if seed is not None and set_seed is not None:
        set_seed(seed)


_making = threading.Lock()  # makes a node's generator once, whichever thread runs the node first


def unseeded_generator(cache: dict[Any, Any]) -> np.random.Generator:
    """The generator of a node without a ``seed`` attribute (``cache``: the node's), spawned off the module's
    seed sequence; a new one after each :func:`set_random_seed`."""
    epoch, gen = cache.get("rng", (-1, None))
    if epoch != _unseeded["epoch"]:
        with _making:  # concurrent first runs share one generator (each made its own: the same draws)
            epoch, gen = cache.get("rng", (-1, None))
            if epoch != _unseeded["epoch"]:
                if _unseeded["seq"] is None:
                    _unseeded["seq"] = np.random.SeedSequence()
                gen = np.random.Generator(np.random.PCG64(_unseeded["seq"].spawn(1)[0]))
                cache["rng"] = (_unseeded["epoch"], gen)
    return gen

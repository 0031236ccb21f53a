"""Compare onnxtrain's float32 → float16 and float16 → float32 routes with numpy's casts on every input.

    python tools/check_half_cast.py [--chunk-bits 24]

All 2³² float32 bit patterns go through ``half_cast.narrow`` in chunks (arrays holding infinities, NaNs or
overflowing values take numpy's own cast there, so those chunks compare numpy with itself: the finite
values of each chunk are also checked apart), all 2¹⁶ float16 patterns through ``half_cast.widen``, and
every float32 under 2¹⁵ in magnitude through ``half_cast.round_to_half`` (against the cast there and
back). Prints the first differences and exits 1 if any; about 12 minutes on 2 CPUs (numpy's own cast of
subnormal results is the slow part).
"""

from __future__ import annotations

import argparse
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np

from onnxtrain.engine.kernels import half_cast


def check_narrow(chunk_bits: int) -> int:
    """Chunks of float32 patterns whose float16 bits differ from numpy's."""
    bad = 0
    step = 1 << chunk_bits
    base = np.arange(step, dtype=np.uint32)
    for start in range(0, 1 << 32, step):
        bits = base + np.uint32(start)
        x = bits.view(np.float32)
        finite = x[np.abs(x) < 65520]  # the fast route's own domain (the rest falls back to numpy)
        for part in (x, finite):
            with np.errstate(all="ignore"):
                ours = half_cast.narrow(part).view(np.uint16)
                theirs = part.astype(np.float16).view(np.uint16)
            if not np.array_equal(ours, theirs):
                at = np.flatnonzero(ours != theirs)[:5]
                print(f"narrow differs from 0x{start:08x}:",
                      [(hex(int(part.view(np.uint32)[i])), hex(int(ours[i])), hex(int(theirs[i])))
                       for i in at])
                bad += 1
    return bad


def check_round(chunk_bits: int) -> int:
    """Chunks of float32 patterns under 2¹⁵ in magnitude that ``round_to_half`` takes to other bits than
    numpy's casts to float16 and back (or refuses)."""
    bad = 0
    step = 1 << chunk_bits
    base = np.arange(step, dtype=np.uint32)
    for start in range(0, 1 << 32, step):
        x = (base + np.uint32(start)).view(np.float32)
        part = x[np.abs(x) < 2.0**15]
        ours = part.copy()
        if not half_cast.round_to_half(ours):
            print(f"round_to_half refused the chunk from 0x{start:08x}")
            bad += 1
            continue
        theirs = part.astype(np.float16).astype(np.float32)
        if not np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)):
            at = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))[:5]
            print(f"round_to_half differs from 0x{start:08x}:",
                  [(hex(int(part.view(np.uint32)[i])), float(ours[i]), float(theirs[i])) for i in at])
            bad += 1
    return bad


def check_widen() -> int:
    """1 if some float16 pattern widens to other float32 bits than numpy's, else 0."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    for part in (h, h[np.isfinite(h)]):
        ours, theirs = half_cast.widen(part).view(np.uint32), part.astype(np.float32).view(np.uint32)
        if not np.array_equal(ours, theirs):
            at = np.flatnonzero(ours != theirs)[:5]
            src = part.view(np.uint16)
            print("widen differs:", [(hex(int(src[i])), hex(int(ours[i])), hex(int(theirs[i]))) for i in at])
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunk-bits", type=int, default=24, help="float32 patterns per chunk, as a power of 2")
    a = ap.parse_args(argv)
    bad = check_narrow(a.chunk_bits) + check_widen() + check_round(a.chunk_bits)
    print("all float32 and float16 inputs: " + ("differences found" if bad else "numpy's bits"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

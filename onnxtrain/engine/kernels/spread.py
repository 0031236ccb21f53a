"""Broadcast operands laid out over the planes they repeat across.

numpy applies an operand broadcast along the trailing axes of an array (a per-channel vector against
(N, C, H, W) values) as one inner loop per run of those axes: with small planes the loop calls cost more
than the values. The operand copied out over the planes, e.g. (C, H, W), takes one loop of C·H·W values
per image, at the cost of 1/N of a pass to make: a multiply over 16 × 144 × 16² 134 → 84 µs, 16 × 192 × 4²
16.8 → 13.6 µs, 16 × 32 × 56² 347 → 241 µs, the copy included; the same values, so the same bits.
"""

from __future__ import annotations

import math

import numpy as np

MIN_IMAGES = 4  # leading extent (the images) from which the copy pays for itself
MAX_RUN = 4096  # values per inner loop from which the calls no longer matter
MIN_VALUES = 1 << 15  # values of the result below which the copy's own call costs more than it saves


def spread_shape(operand: tuple[int, ...], result: tuple[int, ...]) -> tuple[int, ...] | None:
    """The shape to copy an operand of shape ``operand`` out to when it is broadcast against ``result``,
    or None when numpy walks it well as it is: constant along the leading axis, varying along some middle
    axis, broadcast along a trailing run shorter than :data:`MAX_RUN`, against at least
    :data:`MIN_VALUES` values."""
    if (len(result) < 3 or len(operand) > len(result) or result[0] < MIN_IMAGES
            or math.prod(result) < MIN_VALUES):
        return None
    shape = (1,) * (len(result) - len(operand)) + tuple(operand)
    if shape[0] != 1 or math.prod(shape) <= 1:
        return None
    run, axis = 1, len(result) - 1
    while axis > 0 and shape[axis] == 1:
        run *= result[axis]
        axis -= 1
    if not 1 < run < MAX_RUN or axis == 0:
        return None
    return (1,) + tuple(result[1:])


def spread(v: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``v`` copied out to ``shape`` (C-contiguous)."""
    return np.ascontiguousarray(np.broadcast_to(v, shape))

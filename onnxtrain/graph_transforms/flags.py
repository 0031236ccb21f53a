"""The legacy session's bool outputs (``Group_Accumulated_Gradients``, ``all_gradients_finite``,
``adasum_all_deltas_finite``): one value in a tensor of shape [1], as onnxruntime-training's kernels
(``Group``, ``IsAllFinite``) wrote them and its frontends bound them."""

from __future__ import annotations

import numpy as np

FLAG_SHAPE = [1]


def flag_array(value: object) -> np.ndarray:
    """``value``'s truth as a bool array of shape [1]."""
    return np.asarray([bool(value)])

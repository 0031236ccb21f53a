"""The onnxruntime backend against the numpy engine on seeded random training models
(tests/engine/random_models.py: MLPs, CNNs with random Conv/ConvTranspose/pool geometry and training-mode
BatchNormalization, embedding-and-attention blocks with masks; MSE, cross-entropy with ignore_index,
BCE-with-logits and L1 losses; batch sizes 1 and odd, some changing between steps).

Each case trains 20 steps on both backends with the same data, through the legacy TrainingSession (SGD, Adam
with its default grad-norm clipping, Adam over 2 accumulated micro-steps, Lamb) or the on-device Module and
Optimizer (SGD, AdamW with weight decay, AdamW with clipping over 2 accumulated steps), and compares the
losses, the final weights and the optimizer moments (relative, within 1e-5). A fast sample; the sweep over
hundreds of seeds is ``python -m tests.engine.random_models 0 300``.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.random_models import CONFIGS, check, make_case

pytest.importorskip("onnxruntime")

# the sample: every family and loss, float16 weights (seed 17, compared at float16's tolerance),
# BatchNormalization, MaxPool with Indices (ceil_mode too), AveragePool with and without the pads counted,
# global pools, attention masks (Where with -inf, an additive mask, a key padding mask fed per batch), q, k
# and v split from one projection, batch sizes that change; seed 90 has a ConvTranspose with a bias whose
# output_padding reaches its stride past its end pad (the rows the backend's rewrite added lacked the bias:
# its loss was 11 % off after 20 SGD steps)
SAMPLE = [
    (90, "legacy", "SGDOptimizer"), (90, "ondevice", "AdamW"), (28, "ondevice", "SGD"),
    (6, "ondevice", "AdamW"), (12, "legacy", "AdamOptimizer"), (5, "legacy", "AdamOptimizer+accumulate"),
    (8, "legacy", "LambOptimizer"), (2, "ondevice", "AdamW+clip"), (14, "legacy", "AdamOptimizer"),
    (17, "legacy", "SGDOptimizer"), (36, "ondevice", "AdamW"), (19, "legacy", "SGDOptimizer"),
    (3, "ondevice", "AdamW+clip"),
]


def _config(api: str, name: str) -> tuple[str, str, dict]:
    wanted = {"AdamW": {"weight_decay": 0.01},
              "AdamW+clip": {"weight_decay": 0.01, "clip": 0.5, "accumulate": 2},
              "AdamOptimizer+accumulate": {"accumulate": 2}}.get(name, {})
    opt = name.split("+")[0]
    return next(c for c in CONFIGS if c[0] == api and c[1] == opt and c[2] == wanted)


@pytest.mark.parametrize(("seed", "api", "name"), SAMPLE)
def test_random_model_trains_the_same_on_both_backends(seed: int, api: str, name: str) -> None:
    case = make_case(seed)
    api, opt, extra = _config(api, name)
    status, details = check(case, api, opt, extra)
    assert status == "ok", (case.describe(), api, opt, extra, status, details)


def test_a_batch_size_that_changes_every_step() -> None:
    """An attention model over batch sizes 1, 3, 5, 7, … in turn (the backend's bound arrays and arena
    follow the shapes), through both APIs."""
    sizes = [1 + 2 * (k % 4) for k in range(20)]
    case = make_case(3, family="attention", loss="ce", dtype=np.float32, batch_sizes=sizes)
    for api, opt, extra in (CONFIGS[1], CONFIGS[5]):
        status, details = check(case, api, opt, extra)
        assert status == "ok", (case.describe(), api, opt, status, details)

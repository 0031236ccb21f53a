"""Gradient accumulation on seeded random training models (tests/engine/random_models.py and the transformer
stacks of tests/engine/random_stacks.py), on both backends.

``gradient_accumulation_steps = k`` over micro-batches b_1..b_k makes the update of one step on their
concatenation (the models' losses are means, the micro-batches of one size, so the mean of the k gradients is
the concatenation's gradient): after each of 3 updates the weights and optimizer state are within float32
rounding of the concatenated session's (SGD 1e-6 relative, Adam and Lamb 1e-5: their m / √v amplify the
rounding of small gradients; 1.2e-7 and 1.4e-6 the worst seen over 40 models), and so is the global norm
the update clips by (1e-6). The micro-steps before the k-th leave weights and state untouched, bit for bit,
and the update leaves the accumulation buffers zero. Models with training-mode BatchNormalization (batch
statistics), an ignore_index (a mean over the kept labels) or a Dropout that drops are left out: for them the
two are different computations.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxtrain import RunOptions
from onnxtrain.session import TrainingSession
from tests.engine.random_models import legacy_session, make_case, rel
from tests.engine.random_stacks import make_stack

UPDATES = 3
TOL = {"SGDOptimizer": 1e-6, "AdamOptimizer": 1e-5, "LambOptimizer": 1e-5}


def _session(case, backend: str, opt: str, steps: int, mode: str = "auto") -> TrainingSession:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return legacy_session(case, backend, opt, steps, mode)


def _named(sess: TrainingSession, outs: list) -> dict:
    return dict(zip([o.name for o in sess.get_outputs()], outs))


def check_accumulation(case, backend: str, opt: str, k: int, mode: str = "auto") -> None:
    lr = np.array([0.05 if opt == "SGDOptimizer" else 0.01], np.float32)
    acc, one = _session(case, backend, opt, k, mode), _session(case, backend, opt, 1)
    path = RunOptions()
    path.only_execute_path_to_fetches = True
    for u in range(UPDATES):
        micro = case.feeds[u * k:(u + 1) * k]
        for j, feed in enumerate(micro):
            before = {n: v.copy() for n, v in acc.get_state().items() if "accumulate_buffer" not in n}
            if j < k - 1:
                if mode == "auto":
                    acc.run(["loss"], {**feed, "Learning_Rate": lr})
                else:  # the legacy frontends' protocol: fetch the group output, run only the path to it
                    acc.run(["loss", "Group_Accumulated_Gradients"], {**feed, "Learning_Rate": lr}, path)
                after = acc.get_state()
                for n, v in before.items():
                    assert np.array_equal(v, after[n]), (case.describe(), u, j, n)
            else:
                outs = acc.run(None, {**feed, "Learning_Rate": lr})
                norm_acc = _named(acc, outs).get("global_gradient_norm")
        joined = {n: np.concatenate([f[n] for f in micro]) for n in micro[0]}
        norm_one = _named(one, one.run(None, {**joined, "Learning_Rate": lr})).get("global_gradient_norm")
        if norm_one is not None:
            assert rel(norm_one, norm_acc) <= 1e-6, (case.describe(), u, float(norm_one), float(norm_acc))
        got, want = acc.get_state(), one.get_state()
        for n, v in want.items():
            assert rel(v, got[n]) <= TOL[opt], (case.describe(), u, n, rel(v, got[n]))
        for n, v in got.items():
            if n.endswith("_accumulate_buffer"):
                assert not np.any(v), (case.describe(), u, n)


def _model(seed: int):
    n = int(np.random.default_rng(seed).choice([1, 2, 3]))
    case = make_case(seed, dtype=np.float32, batch_sizes=[n] * 20)
    assert "bn-train" not in case.notes and case.ignore_index is None, case.describe()
    return case


# (float32 draws of these seeds) an MLP with a Dropout of ratio 0 and a slice-and-swap, CNNs (a dilated
# Conv and an AveragePool, a grouped Conv and a MaxPool with Indices, a global max pool with cross-entropy, a
# transposed Reshape head), attention blocks (causal, q/k/v split or sliced from one projection); MSE, BCE,
# L1 and CE losses
SAMPLE = [(0, "AdamOptimizer", 2), (11, "SGDOptimizer", 3), (9, "LambOptimizer", 3), (16, "AdamOptimizer", 2),
          (12, "SGDOptimizer", 3), (15, "AdamOptimizer", 2), (10, "LambOptimizer", 3),
          (31, "SGDOptimizer", 2)]


# by default each model on one backend, each optimizer on both (these seeds on onnxruntime, the others on
# numpy); every model on both with ONNXTRAIN_FULL_TESTS=1 (tests/tiers.py)
ON_ORT = {11, 16, 15, 10}


def _sample_params() -> list:
    return [pytest.param(seed, opt, k, backend, marks=[] if (backend == "onnxruntime") == (seed in ON_ORT)
                         else [pytest.mark.extended])
            for seed, opt, k in SAMPLE for backend in ("numpy", "onnxruntime")]


@pytest.mark.parametrize(("seed", "opt", "k", "backend"), _sample_params())
def test_accumulated_steps_are_one_step_on_the_joined_batch(backend: str, seed: int, opt: str,
                                                            k: int) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    check_accumulation(_model(seed), backend, opt, k)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_legacy_accumulation_protocol(backend: str) -> None:
    """The same with gradient_accumulation_mode 'legacy', the micro-steps fetching Group_Accumulated_Gradients
    with only_execute_path_to_fetches."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    check_accumulation(_model(10), backend, "AdamOptimizer", 3, mode="legacy")


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_accumulation_on_a_transformer_stack(backend: str) -> None:
    """A 2-layer post-LN stack (tanh GELU, causal attention), Adam over 2 micro-batches of 4 sequences."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    case = make_stack(0)
    assert "attn-drop=0.0" in case.notes and "mlp-drop=0.0" in case.notes
    check_accumulation(case, backend, "AdamOptimizer", 2)

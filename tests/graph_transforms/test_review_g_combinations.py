"""Review G: the legacy TrainingSession's options in combination, against a float64 oracle and 1.16.3.

The sweep (``review_g_sweep.py``) draws per seed a model (an MLP with Gelu, a conv net, a regression with a
loss of generic ops), SGD / Adam / Lamb with attributes per weight, 1-4 accumulation steps (the legacy
protocol or ``auto``), clipping, float16 / bfloat16 mixed precision fed by a dynamic loss scaler with
micro-steps whose loss overflows, recompute options, a weight selection, gradient / norm / finite-flag
fetches, a learning rate fed per update, evaluations, initial optimizer state and loads of other weights and
state mid-accumulation, and checks every step against its float64 oracle (the spec's formulas, onnxruntime's
loss scaler). A second sweep runs the combinations 1.16.3's CPU build takes in it and in onnxtrain.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from onnxtrain import TrainingParameters, TrainingSession
from tests.graph_transforms import review_g_sweep as sweep
from tests.tiers import extended

torch = pytest.importorskip("torch")

DEFAULT_SEEDS = range(0, 12)
EXTENDED_SEEDS = range(12, 300)


@pytest.mark.parametrize("seed", [*DEFAULT_SEEDS, *(extended(s) for s in EXTENDED_SEEDS)])
def test_option_combinations_against_float64(seed: int) -> None:
    """One drawn combination, every micro-step's loss, gradients, norm and finite flag and every update's
    weights, moments, counts, loss scale, get_optimizer_state() and get_model_state() against the oracle."""
    if sweep.draw(seed).backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    sweep.run_case(sweep.draw(seed))


def test_option_combinations_against_onnxruntime_training_116() -> None:
    """SGD and Adam (its CPU Adam does not clip: legacy_cpu_adam on our side) with attributes per weight,
    clipping on and off, weight selections, gradient and norm outputs, initial state, a learning rate fed per
    step and loads of other weights and counts between steps: 24 drawn sessions, every step's outputs, state
    and optimizer state as 1.16.3's."""
    from tests.session.legacy_peer import run_cases

    drawn = [sweep.peer_case(seed) for seed in range(24)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases([c for c, _ in drawn])
    for seed, ((case, trained), p, o) in enumerate(zip(drawn, peer, ours)):
        assert p.error is None and o.error is None, (seed, p.error, o.error)
        for k in range(len(case.steps)):
            assert set(p.outputs[k]) == set(o.outputs[k]) and set(p.state[k]) == set(o.state[k]), (seed, k)
            assert sorted(p.optimizer[k]) == sorted(o.optimizer[k]), (seed, k)
            for kind, theirs, mine in (("output", p.outputs[k], o.outputs[k]),
                                       ("state", p.state[k], o.state[k]),
                                       ("optimizer", p.optimizer[k], o.optimizer[k])):
                for n, v in theirs.items():
                    assert mine[n].dtype == v.dtype, (seed, k, kind, n)
                    np.testing.assert_allclose(mine[n], v, rtol=1e-4, atol=1e-5,
                                               err_msg=f"seed {seed} step {k} {kind} {n}")
        assert sorted(w for w in p.state[-1] if not w.startswith(("Moment", "Update"))) == trained, seed


@pytest.mark.parametrize("scaled_by_client", [False, True])
def test_learning_rate_named_as_the_loss_scale_is_refused(scaled_by_client: bool) -> None:
    """lr_params_feed_name naming the loss-scale input of mixed precision (the session's ``loss_scale``, or
    the input a client's scaled loss reads): the session took the one feed as both, so the loss scale fed
    (1024) was the learning rate too: one SGD step moved the weights by hundreds (float64 oracle: by
    lr·gradient, below 0.1). Refused, naming the property and the input."""
    from onnx import TensorProto, helper

    model = sweep.mlp_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.use_mixed_precision = True
    p.lr_params_feed_name = "loss_scale"
    if scaled_by_client:  # onnxruntime 1.2-1.3's clients: loss · an input of their own
        model.graph.node.append(helper.make_node("Mul", ["loss", "client_scale"], ["scaled"]))
        model.graph.input.append(helper.make_tensor_value_info("client_scale", TensorProto.FLOAT, [1]))
        p.scaled_loss_output_name = "scaled"
        p.lr_params_feed_name = "client_scale"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"lr_params_feed_name .*loss scale"):
            TrainingSession(model.SerializeToString(), p)

"""Models exported from torch run in our engine as in onnxruntime (and torch), at two batch sizes.

onnxruntime's graph optimizations are switched off for the oracle: with them on, it fuses training-mode
BatchNormalization as if it were in inference mode (its result then differs from torch and onnx.reference).
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import onnxtrain
from tests import models
from tests.tiers import covering

RTOL, ATOL = 1e-5, 2e-6
BATCHES = (3, 8)
ALL = ["mlp", "lenet_bn", "transformer_encoder", "gpt_block", "resnet_block", "lstm_cls", "gru_cls",
       "recommender", "spatial_transformer", "fake_quant_mlp", "spectrogram_cls"]


def ort_session(model) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def exported(name: str, training: bool, with_loss: bool = False):
    # a training export with dropout 0: deterministic, so it can be compared
    return models.export(name, training=training, with_loss=with_loss, dropout=0.0 if training else None)


def _mode_id(value: object) -> str | None:
    return {False: "eval", True: "train"}.get(value) if isinstance(value, bool) else None


# by default each model in one mode here and in the other in test_loss_graph_matches, both modes in each
# with ONNXTRAIN_FULL_TESTS=1 (tests/tiers.py)
@pytest.mark.parametrize("name,training", covering(ALL, [False, True], strength=1), ids=_mode_id)
def test_matches_onnxruntime(name: str, training: bool) -> None:
    model, _, module = exported(name, training)
    ours = onnxtrain.InferenceSession(model.SerializeToString())
    ref = ort_session(model)
    assert [i.name for i in ours.get_inputs()] == [i.name for i in ref.get_inputs()]
    for batch in BATCHES:  # one session, two batch sizes: the batch axis is dynamic
        feeds = models.example_inputs(name, batch, seed=batch)
        got = ours.run(None, feeds)
        want = ref.run(None, feeds)
        assert len(got) == len(want) == 1
        assert got[0].shape == want[0].shape
        assert got[0].dtype == want[0].dtype
        np.testing.assert_allclose(got[0], want[0], rtol=RTOL, atol=ATOL, err_msg=f"{name} batch {batch}")
        np.testing.assert_allclose(got[0], models.torch_forward(module, feeds), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,training", covering(ALL, [True, False], strength=1), ids=_mode_id)
def test_loss_graph_matches(name: str, training: bool) -> None:
    model, _, module = exported(name, training, with_loss=True)
    assert [o.name for o in model.graph.output] == ["loss"]
    ours = onnxtrain.InferenceSession(model)
    ref = ort_session(model)
    for batch in BATCHES:
        feeds = models.example_inputs(name, batch, with_loss=True, seed=batch)
        (got,) = ours.run(["loss"], feeds)
        (want,) = ref.run(["loss"], feeds)
        assert got.shape == () and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
        np.testing.assert_allclose(got, models.torch_forward(module, feeds), rtol=1e-4, atol=1e-6)


def test_dropout_training_graph_runs() -> None:
    """With dropout > 0 the training graph is random: right shape, finite, and not the eval result."""
    model, feeds, _ = models.export("gpt_block", training=True, dropout=0.5)
    eval_model, _, _ = models.export("gpt_block", training=False)
    (y,) = onnxtrain.InferenceSession(model).run(None, feeds)
    (y_eval,) = onnxtrain.InferenceSession(eval_model).run(None, feeds)
    assert y.shape == y_eval.shape and np.isfinite(y).all()
    assert not np.allclose(y, y_eval)


def test_export_is_deterministic() -> None:
    """The zoo gives the same weights on every call and the module matches the graph's initializers."""
    a = models.build("mlp").state_dict()
    b = models.build("mlp").state_dict()
    assert all(np.array_equal(a[k].numpy(), b[k].numpy()) for k in a)
    model, _, module = models.export("lenet_bn", training=True)
    inits = {t.name: t for t in model.graph.initializer}
    for k, v in module.state_dict().items():
        if k in inits:
            np.testing.assert_array_equal(numpy_helper.to_array(inits[k]), v.numpy(), err_msg=k)

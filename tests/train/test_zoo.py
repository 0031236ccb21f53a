"""Built-in models: valid ONNX, onnxruntime's numbers (or onnx.reference's), gradients that pass gradcheck."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain import zoo
from onnxtrain.engine.plan import compile_model
from onnxtrain.testing import gradcheck

ort = pytest.importorskip("onnxruntime")

CASES = {
    "mlp": (lambda: zoo.mlp([12, 8, 5]), lambda r: r.standard_normal((3, 12)).astype(np.float32), (3,), 5),
    "cnn": (lambda: zoo.cnn(channels=(3, 4), classes=5),
            lambda r: r.random((3, 1, 8, 8), np.float32), (3,), 5),
    "cnn_bn_gap": (lambda: zoo.cnn(channels=(3,), classes=5, batch_norm=True, global_pool=True),
                   lambda r: r.random((3, 1, 8, 8), np.float32), (3,), 5),
    "transformer": (lambda: zoo.transformer(vocab=7, length=5, dim=8, heads=2, layers=2),
                    lambda r: r.integers(0, 7, (3, 5)), (3, 5), 7),
    "spatial_transformer": (lambda: zoo.spatial_transformer(channels=(3,), classes=5, hidden=6),
                            lambda r: r.random((3, 1, 8, 8), np.float32), (3,), 5),
}


@pytest.mark.parametrize("name", CASES)
def test_builder_matches_onnxruntime(name):
    build, make_x, label_shape, classes = CASES[name]
    model = build()
    onnx.checker.check_model(model, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"x": make_x(rng), "y": rng.integers(0, classes, label_shape)}
    ours = compile_model(model).run(feeds, ["loss", "logits"])
    if "bn" in name:  # onnxruntime's inference build ignores BatchNormalization's training_mode
        theirs = ReferenceEvaluator(model).run(["loss", "logits"], feeds)
    else:
        theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            ["loss", "logits"], feeds)
    assert ours[1].shape == (3, classes, *label_shape[1:])
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_builders_are_deterministic_and_seeded():
    a, b, c = zoo.transformer(seed=1), zoo.transformer(seed=1), zoo.transformer(seed=2)
    wa = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    wb = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    wc = {t.name: numpy_helper.to_array(t) for t in c.graph.initializer}
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert not np.array_equal(wa["tok_emb.weight"], wc["tok_emb.weight"])
    ops = {n.op_type for n in a.graph.node}
    assert {"Gather", "LayerNormalization", "Softmax", "Erf", "Reshape", "Transpose", "MatMul"} <= ops
    inference = zoo.cnn(loss=False)
    assert [i.name for i in inference.graph.input] == ["x"]
    assert [o.name for o in inference.graph.output] == ["logits"]


def _to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for i, t in enumerate(m.graph.initializer):
        if t.data_type == onnx.TensorProto.FLOAT:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64),
                                                                    t.name))
    for n in m.graph.node:  # the fixed values (attention scale, GELU's constants, the sampling grid)
        for a in n.attribute:
            if n.op_type == "Constant" and a.name == "value" and a.t.data_type == onnx.TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
    for v in [*m.graph.input, *m.graph.output]:
        if v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            v.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    return m


def _off_centre(model: onnx.ModelProto) -> onnx.ModelProto:
    """The spatial transformer with a transform near, not at, the identity: at the identity every sample
    lands on a pixel centre, where bilinear weights have a kink that central differences average over."""
    for t in model.graph.initializer:
        if t.name == "loc1.bias":
            t.CopyFrom(numpy_helper.from_array(np.array([1.02, 0.01, 0.013, -0.007, 0.98, 0.021], np.float32),
                                               t.name))
    return model


@pytest.mark.parametrize("name", ["cnn_bn_gap", "transformer", "spatial_transformer"])
def test_gradients_match_central_differences(name):
    build, make_x, label_shape, classes = CASES[name]
    model = _to_float64(_off_centre(build()))
    rng = np.random.default_rng(1)
    x = make_x(rng)
    feeds = {"x": x.astype(np.float64) if x.dtype == np.float32 else x,
             "y": rng.integers(0, classes, label_shape)}
    wrt = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.DOUBLE and t.dims
           and "running" not in t.name]
    gradcheck(model, "loss", wrt, feeds, rtol=1e-4, atol=1e-6)


def test_spatial_transformer_starts_at_the_identity():
    """The localisation net's last layer starts at the identity transform: the warped image is the input,
    so the network starts as its CNN head does (the same head weights, drawn from seed + 1)."""
    stn, head = zoo.spatial_transformer(seed=4, loss=False), zoo.cnn(seed=5, loss=False)
    x = np.random.default_rng(2).random((4, 1, 8, 8), np.float32)
    np.testing.assert_allclose(compile_model(stn).run({"x": x})[0], compile_model(head).run({"x": x})[0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["transformer", "spatial_transformer"])
def test_the_models_fixed_values_are_not_trained(name):
    """The attention scale, GELU's ½, 1 and 1/√2 and the sampling grid are Constant nodes: as float32
    initializers the legacy session (and ``onnxtrain train``) trained them (½ became 0.5034 in 20 steps), so
    the model stopped computing a GELU."""
    import onnxtrain

    model = CASES[name][0]()
    gelu = {f"layer0.mlp.{c}" for c in ("half", "one", "inv_sqrt2")}
    fixed = {"transformer": {"layer0.attn.scale", *gelu}, "spatial_transformer": {"base_grid"}}[name]
    assert not fixed & {t.name for t in model.graph.initializer}
    assert fixed <= {n.output[0] for n in model.graph.node if n.op_type == "Constant"}
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = onnxtrain.TrainingSession(model.SerializeToString(), p)
    assert not fixed & set(sess.get_state())

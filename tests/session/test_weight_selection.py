"""Which initializers the legacy session trains: discovery's stop slots, running statistics listed as
weights, and the attribute maps of weights that end up untrained."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import TrainingSession
from onnxtrain.ir.builder import make_model
from tests.session.helpers import params

LR = np.array([0.05], np.float32)


def _bn_pow_model() -> bytes:
    """x → Gemm → BatchNormalization (training mode) → (· − t)^two → mean; ``two`` an initializer."""
    rng = np.random.default_rng(0)
    inits = {
        "W": rng.standard_normal((3, 4)).astype(np.float32),
        "b": np.zeros(4, np.float32),
        "scale": np.ones(4, np.float32),
        "beta": np.zeros(4, np.float32),
        "mean": np.zeros(4, np.float32),
        "var": np.ones(4, np.float32),
        "two": np.array(2.0, np.float32),
    }
    nodes = [
        helper.make_node("Gemm", ["x", "W", "b"], ["h"]),
        helper.make_node(
            "BatchNormalization",
            ["h", "scale", "beta", "mean", "var"],
            ["n", "mean_out", "var_out"],
            training_mode=1,
        ),
        helper.make_node("Sub", ["n", "t"], ["d"]),
        helper.make_node("Pow", ["d", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes,
        "bn_pow",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("t", T.FLOAT, ["N", 4]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    return make_model(g, 17).SerializeToString()


def _feeds(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((8, 3)).astype(np.float32),
        "t": rng.standard_normal((8, 4)).astype(np.float32),
        "Learning_Rate": LR,
    }


def test_discovery_skips_the_exponent_of_pow_but_a_listed_one_trains() -> None:
    """onnxruntime's builder never differentiates Pow's exponent (spec §12.3): discovery leaves an
    exponent initializer alone; listed in weights_to_train, it gets its gradient d(a^b)/db = a^b·ln a
    (0 where a ≤ 0, where the logarithm is undefined)."""
    auto = TrainingSession(_bn_pow_model(), params("SGDOptimizer"))
    assert auto._graphs.trainable == ["W", "b", "beta", "scale"]
    for i in range(5):
        auto.run(["loss"], _feeds(i))
    assert "two" not in auto.get_state()
    p = params("SGDOptimizer", weights_to_train={"W", "two"}, set_gradients_as_graph_outputs=True)
    listed = TrainingSession(_bn_pow_model(), p)
    feeds = _feeds(0)
    (g,) = listed.run(["two_grad"], feeds)
    # the reference in float64: d = BN(xW + b) − t with batch statistics
    h = feeds["x"].astype(np.float64) @ np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    n = (h - h.mean(0)) / np.sqrt(h.var(0) + 1e-5)
    d = n - feeds["t"]
    positive = np.where(d > 0, d, 1.0)
    np.testing.assert_allclose(g, np.mean(np.where(d > 0, positive**2 * np.log(positive), 0.0)), rtol=1e-4)


def test_discovery_skips_clip_bounds_but_listed_ones_train_as_torch_clamp() -> None:
    """The dynamo exporter keeps ReLU6's and clamp's bounds as initializers: discovery leaves them alone, as
    onnxruntime's builder did (it never differentiated them); listed, they train with torch.clamp's
    gradients (the input below the lower bound gives it dY, above the upper one gives that one dY)."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Clip", ["h", "lo", "hi"], ["c"]),
         helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [8, 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array(-0.5, np.float32), "lo"),
         numpy_helper.from_array(np.array(0.5, np.float32), "hi")])
    model = make_model(g, 17).SerializeToString()
    assert TrainingSession(model, params("SGDOptimizer"))._graphs.trainable == ["W"]
    p = params("SGDOptimizer", weights_to_train={"W", "lo", "hi"}, set_gradients_as_graph_outputs=True)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    lo_grad, hi_grad = TrainingSession(model, p).run(["lo_grad", "hi_grad"], {"x": x, "Learning_Rate": LR})
    h = x @ numpy_helper.to_array(g.initializer[0])
    assert lo_grad == np.sum(h < -0.5) and hi_grad == np.sum(h > 0.5)


def test_discovery_skips_the_value_of_pad_but_a_listed_one_trains() -> None:
    """A Pad's constant_value is one of onnxruntime's stop-gradient slots (Pad 1, 2; spec §12.3): discovery
    trained it (0.25 → 0.15 in a step). Listed, it gets its gradient: the sum of dY over the padding."""
    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"]),
         helper.make_node("Pad", ["h", "pads", "value"], ["p"]),
         helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [8, 3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array([0, 1, 0, 2], np.int64), "pads"),
         numpy_helper.from_array(np.array(0.25, np.float32), "value")])
    model = make_model(g, 17).SerializeToString()
    assert TrainingSession(model, params("SGDOptimizer"))._graphs.trainable == ["W"]
    p = params("SGDOptimizer", weights_to_train={"W", "value"}, set_gradients_as_graph_outputs=True)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    (value_grad,) = TrainingSession(model, p).run(["value_grad"], {"x": x, "Learning_Rate": LR})
    assert value_grad == 8 * 7 - 8 * 4  # the padded elements: (8 × 7) − (8 × 4)


def test_running_statistics_listed_as_weights_are_updated_not_trained() -> None:
    """Frontends list every initializer: the BatchNormalization running statistics among them are left
    out with a warning and keep their forward-pass update, exactly as without the list."""
    everything = {"W", "b", "scale", "beta", "mean", "var"}
    p = params(
        "AdamOptimizer", weights_to_train=everything, optimizer_attributes_map={w: {} for w in everything}
    )
    with pytest.warns(UserWarning, match=r"\['mean', 'var'\] are BatchNormalization running statistics"):
        listed = TrainingSession(_bn_pow_model(), p)
    auto = TrainingSession(_bn_pow_model(), params("AdamOptimizer"))
    assert listed._graphs.trainable == auto._graphs.trainable
    for i in range(3):
        listed.run(["loss"], _feeds(i))
        auto.run(["loss"], _feeds(i))
    for k in ("mean", "var", "W"):
        np.testing.assert_array_equal(listed.get_state()[k], auto.get_state()[k], err_msg=k)
    assert not np.array_equal(auto.get_state()["var"], np.ones(4, np.float32))
    # the first step's running mean: 0.9·0 + 0.1·(batch mean of xW + b), ONNX's momentum convention
    first = TrainingSession(_bn_pow_model(), params("AdamOptimizer"))
    first.run(["loss"], _feeds(0))
    h = _feeds(0)["x"] @ np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(first.get_state()["mean"], 0.1 * h.mean(0), rtol=1e-5)


def test_attribute_maps_may_name_untrained_initializers_and_unknown_names() -> None:
    """As in onnxruntime, the maps are read for the trained weights only: entries for initializers that are
    not trained (excluded, unused) are ignored; a name that is no initializer is ignored too, with a warning
    naming it (a map built from a torch module's parameters names those its export left out)."""
    names = ["W", "b", "scale", "beta", "two"]
    p = params(
        "AdamOptimizer",
        weights_not_to_train={"b"},
        optimizer_attributes_map={n: {"lambda": 0.0} for n in names},
        optimizer_int_attributes_map={n: {} for n in names},
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess = TrainingSession(_bn_pow_model(), p)
    assert "b" not in sess._graphs.trainable
    p.optimizer_attributes_map = {**{n: {} for n in names}, "Wx": {}}
    with pytest.warns(UserWarning, match=r"optimizer_attributes_map: \['Wx'\] are not initializers"):
        other = TrainingSession(_bn_pow_model(), p)
    assert other._graphs.trainable == sess._graphs.trainable


def test_names_the_model_lacks_are_left_out_with_a_warning_as_onnxruntime_does() -> None:
    """weights_to_train from a module's parameters (one the export left out), weights_not_to_train naming
    nothing, an initial optimizer state for a weight that is not trained: onnxruntime trains what the model
    has (FilterUnusedWeights) and ignores the rest; onnxtrain does the same and says what it left out. The
    session then trains exactly as one given the right names."""
    from tests.session.helpers import batches, mlp_model

    model = mlp_model().SerializeToString()
    right = TrainingSession(model, params("AdamOptimizer", weights_to_train={"W1", "b1", "W2", "b2"}))
    p = params("AdamOptimizer", weights_to_train={"W1", "b1", "W2", "b2", "head.weight"},
               weights_not_to_train={"nothing"})
    p.set_optimizer_initial_state({"b2": {"Moment_1": np.zeros(4, np.float32)},
                                   "head.weight": {"Moment_1": np.ones(3, np.float32)}})
    with pytest.warns(UserWarning) as seen:
        loose = TrainingSession(model, p)
    text = " ".join(str(w.message) for w in seen)
    assert "['head.weight'] have no consumer and are not trained" in text
    assert "weights_not_to_train: ['nothing'] are not initializers" in text
    assert "set_optimizer_initial_state: ['head.weight'] are not trained" in text
    lr = np.array([0.01], np.float32)
    for x, y in batches(3, 4):
        a = right.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]
        b = loose.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]
        assert a == b
    assert sorted(right.get_state()) == sorted(loose.get_state())


def test_a_listed_weight_the_loss_does_not_depend_on_is_an_error() -> None:
    """As in onnxruntime (no gradient to compute), rather than "training" it on zeros."""
    from tests.session.helpers import mlp_model

    model = mlp_model()
    model.graph.initializer.append(numpy_helper.from_array(np.ones(4, np.float32), "V"))
    model.graph.node.append(helper.make_node("Mul", ["logits", "V"], ["side"]))
    model.graph.output.append(helper.make_tensor_value_info("side", T.FLOAT, ["N", 4]))
    with pytest.raises(ValueError, match="weights_to_train: 'V' does not reach 'loss'"):
        TrainingSession(model.SerializeToString(), params("SGDOptimizer", weights_to_train={"W1", "V"}))
    sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))  # discovery leaves V out
    assert "V" not in sess._graphs.trainable


def test_attributes_the_optimizer_does_not_read_are_ignored_with_one_warning() -> None:
    """One attribute function shared between optimizers (Adam's keys given to SGD, a ``momentum`` to Adam):
    onnxruntime's builders read the names they knew and ignored the rest, so the session trains exactly as
    one without them, and says once per map which names it ignored."""
    from tests.session.helpers import batches, mlp_model

    names = ["W1", "b1", "W2", "b2"]
    adam_keys = {n: {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-6} for n in names}
    for opt, fmap, imap, ignored in (
        ("SGDOptimizer", adam_keys, {n: {"do_bias_correction": 1} for n in names},
         [r"optimizer_attributes_map: SGDOptimizer does not read 'alpha', 'beta', 'epsilon', 'lambda' "
          r"from this map \(given for 4 weight\(s\), e.g. 'W1'\)",
          r"optimizer_int_attributes_map: SGDOptimizer does not read 'do_bias_correction'"]),
        ("AdamOptimizer", {n: {"momentum": 0.9} if n == "b2" else {} for n in names}, {},
         [r"optimizer_attributes_map: AdamOptimizer does not read 'momentum' from this map \(given for 1 "
          r"weight\(s\), e.g. 'b2'\)"]),
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            p = params(opt, optimizer_attributes_map=fmap, optimizer_int_attributes_map=imap)
            sess = TrainingSession(mlp_model().SerializeToString(), p)
        said = [str(c.message) for c in caught if "does not read" in str(c.message)]
        assert len(said) == len(ignored), said
        for pattern, message in zip(ignored, said):
            assert re.search(pattern, message), (pattern, message)
        plain = TrainingSession(mlp_model().SerializeToString(), params(opt))
        for x, y in batches(3, 8):
            feeds = {"x": x, "y": y, "Learning_Rate": LR}
            np.testing.assert_array_equal(sess.run(["loss"], feeds)[0], plain.run(["loss"], feeds)[0])
        a, b = sess.get_state(), plain.get_state()
        for k in b:
            np.testing.assert_array_equal(a[k], b[k])


@pytest.mark.parametrize("opt, fmap, imap, key, there", [
    ("AdamOptimizer", {"do_bias_correction": 0.0}, {}, "do_bias_correction", "optimizer_int_attributes_map"),
    ("AdamOptimizer", {"weight_decay_mode": 1.0}, {}, "weight_decay_mode", "optimizer_int_attributes_map"),
    ("AdamOptimizer", {}, {"alpha": 1}, "alpha", "optimizer_attributes_map"),
    ("LambOptimizer", {"do_bias_correction": 1.0}, {}, "do_bias_correction", "optimizer_int_attributes_map"),
])
def test_an_attribute_in_the_other_map_is_refused(opt, fmap, imap, key, there) -> None:
    """An attribute the optimizer reads, given in the map of the other type: onnxruntime-training 1.16.3
    refuses the session (InvalidGraph, "Mismatched attribute type"); onnxtrain only warned and dropped the
    value. SGD reads no attribute, so there a misplaced key stays a warning."""
    from onnxtrain.errors import InvalidGraph
    from tests.session.helpers import mlp_model

    names = ["W1", "b1", "W2", "b2"]
    p = params(opt, optimizer_attributes_map={n: dict(fmap) for n in names},
               optimizer_int_attributes_map={n: dict(imap) for n in names})
    with pytest.raises(InvalidGraph, match=rf"'{key}' of weight 'W1' .* {there}"):
        TrainingSession(mlp_model().SerializeToString(), p)


def _scaled_square_model() -> tuple[bytes, np.ndarray]:
    """loss = mean((((x·W) / sqrt2 + eps) / eight)²) with float32 scalar initializers sqrt2, eps, eight."""
    w = np.random.default_rng(0).standard_normal((3, 2)).astype(np.float32)
    consts = {"sqrt2": 1.4142135, "eps": 1e-12, "eight": 8.0}
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Div", ["h", "sqrt2"], ["h1"]),
             helper.make_node("Add", ["h1", "eps"], ["h2"]),
             helper.make_node("Div", ["h2", "eight"], ["h3"]),
             helper.make_node("Mul", ["h3", "h3"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(w, "W")] + [numpy_helper.from_array(np.array(v, np.float32), k)
                                                 for k, v in consts.items()]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])], inits)
    return make_model(g, 17).SerializeToString(), w


def test_immutable_weights_match_float32_scalars_as_onnxruntime_did() -> None:
    """The BERT entries of onnxruntime's legacy tests, {"Div": [(1, 1.4142135)], "Add": [(1, 1e-12)]}, keep
    float32 scalars that equal the values as float32 (onnxruntime compared float to float); compared in
    float64 they matched only values exact in float32, and the others were trained."""
    model, w = _scaled_square_model()
    p = params("SGDOptimizer", enable_grad_norm_clip=False)
    assert sorted(TrainingSession(model, p).get_state()) == ["W", "eight", "eps", "sqrt2"]
    p.immutable_weights = {"Div": [(1, 8.0), (1, 1.4142135)], "Add": [(1, 1e-12)]}
    s = TrainingSession(model, p)
    assert sorted(s.get_state()) == ["W"]
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    s.run(["loss"], {"x": x, "Learning_Rate": LR})
    # one SGD step, from the loss's gradient in float64
    s2, eps = np.float64(np.float32(1.4142135)), np.float64(np.float32(1e-12))
    h3 = (x.astype(np.float64) @ w / s2 + eps) / 8
    grad = x.T.astype(np.float64) @ (2 * h3 / h3.size / 8 / s2)
    np.testing.assert_allclose(s.get_state()["W"], w - LR[0] * grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("case", ["with_weights_to_train", "no_entry_matches", "misspelt_op"])
def test_immutable_weights_that_keep_nothing_warn(case: str) -> None:
    """immutable_weights is read by the discovery of trainable weights only: given with weights_to_train,
    or with no entry matching a scalar the loss reads, it keeps nothing from training, which went unsaid
    (the scalars trained as without it); the weights trained are the same as without it."""
    model, _ = _scaled_square_model()
    p = params("SGDOptimizer", enable_grad_norm_clip=False)
    p.immutable_weights = {"Div": [(1, 8.0)]}
    if case == "with_weights_to_train":
        p.weights_to_train = {"W", "eight"}
        said, trained = "has no effect when weights_to_train is given", ["W", "eight"]
    else:
        p.immutable_weights = {"Div": [(1, 7.0)]} if case == "no_entry_matches" else {"Dvi": [(1, 8.0)]}
        said, trained = "no entry matches a float32 scalar initializer", ["W", "eight", "eps", "sqrt2"]
    with pytest.warns(UserWarning, match=f"immutable_weights.*{said}"):
        s = TrainingSession(model, p)
    assert sorted(s.get_state()) == trained


def test_merged_running_statistics_in_weights_to_train_are_left_out_with_a_warning() -> None:
    """torch's exporter merges a fresh BatchNorm's running statistics with its scale and bias (equal values),
    reading them through Identity nodes named after the buffers. Listed in weights_to_train, those names
    are running statistics as when they are initializers: left out with a warning, not an error, and
    updated by the forward pass (checked against the batch's mean)."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 4)).astype(np.float32)
    nodes = [helper.make_node("Identity", ["bn.bias"], ["bn.running_mean"]),
             helper.make_node("Identity", ["bn.weight"], ["bn.running_var"]),
             helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "bn.weight", "bn.bias", "bn.running_mean",
                                                     "bn.running_var"], ["n", "m_out", "v_out"],
                              training_mode=1, momentum=0.9),
             helper.make_node("Mul", ["n", "n"], ["sq"]),
             helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    inits = {"W": w, "bn.weight": np.ones(4, np.float32), "bn.bias": np.zeros(4, np.float32)}
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, [8, 3])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    p = params("SGDOptimizer", enable_grad_norm_clip=False)
    p.weights_to_train = {"W", "bn.weight", "bn.bias", "bn.running_mean", "bn.running_var"}
    with pytest.warns(UserWarning, match=re.escape("['bn.running_mean', 'bn.running_var'] are BatchNorm")):
        s = TrainingSession(make_model(g, 17).SerializeToString(), p)
    x = rng.standard_normal((8, 3)).astype(np.float32)
    s.run(["loss"], {"x": x, "Learning_Rate": LR})
    state = s.get_state()
    np.testing.assert_allclose(state["bn.running_mean"], 0.1 * (x @ w).mean(axis=0), rtol=1e-5, atol=1e-7)
    assert not np.array_equal(state["bn.weight"], np.ones(4, np.float32))  # the scale trains on its own

"""TrainingParameters: option types as the legacy binding checked them, and the initial optimizer state."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import TrainingParameters, TrainingSession
from tests.session.helpers import batches, mlp_model, params

LR = np.array([0.05], np.float32)


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_initial_optimizer_state_resumes_a_run_bit_for_bit(opt: str) -> None:
    """A session started from another's weights and optimizer state (``set_optimizer_initial_state``)
    continues exactly as the other one does."""
    model = mlp_model(act="Tanh")
    data = batches(8, 16)
    first = TrainingSession(model.SerializeToString(), params(opt))
    for x, y in data[:4]:
        first.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
    p = params(opt)
    p.set_optimizer_initial_state(first.get_optimizer_state())
    weights = {k: first.get_state()[k] for k in ("W1", "b1", "W2", "b2")}  # without the moments
    resumed = TrainingSession(model.SerializeToString(), p)
    resumed.load_state(weights, strict=False)
    assert resumed.get_optimizer_state().keys() == first.get_optimizer_state().keys()
    for x, y in data[4:]:
        a = first.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})[0]
        b = resumed.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})[0]
        assert a == b
    for k, v in first.get_state().items():
        np.testing.assert_array_equal(resumed.get_state()[k], v, err_msg=k)
    # without the initial state, the moments restart from zero and the runs part
    fresh = TrainingSession(model.SerializeToString(), params(opt))
    fresh.load_state(weights, strict=False)
    x, y = data[4]
    fresh.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
    again = TrainingSession(model.SerializeToString(), p)
    again.load_state(weights, strict=False)
    again.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
    assert not np.array_equal(fresh.get_state()["W1"], again.get_state()["W1"])


def test_initial_optimizer_state_is_checked_by_name() -> None:
    model = mlp_model()
    p = params("AdamOptimizer")
    p.set_optimizer_initial_state({"W1": {"Moment_3": np.zeros((16, 8), np.float32)}})
    with pytest.raises(ValueError, match="Moment_3"):
        TrainingSession(model.SerializeToString(), p)
    with pytest.raises(TypeError, match="set_optimizer_initial_state"):
        p.set_optimizer_initial_state({"W1": np.zeros(3)})


@pytest.mark.parametrize(
    "name,value",
    [
        ("enable_grad_norm_clip", "False"),
        ("use_mixed_precision", "no"),
        ("set_gradients_as_graph_outputs", [1]),
        ("gradient_accumulation_steps", "4"),
        ("gradient_accumulation_steps", 2.5),
        ("world_size", 2.0),  # onnxruntime 1.16.3's binding refuses a Python float, even an integral one
        ("loss_scale", "1024"),
        ("optimizer_attributes_map", ["W1"]),
        ("immutable_weights", "W1"),
        ("weights_to_train", "W1"),
        ("weights_to_train", {1, 2}),  # the binding's set of strings refuses them (it was taken, and the
        ("weights_not_to_train", ["W1", 3]),  # session said "no trainable weight reaches the loss")
        ("propagate_cast_ops_allow", "Relu"),
        ("loss_output_name", 3),
        # one-pass iterators, refused by onnxruntime-training 1.16.3's binding (checked in /tmp/ortleg's
        # venv: TypeError, incompatible function arguments); they were consumed by the name check and set
        # an empty option (weights_to_train = set(): every float initializer trained)
        ("weights_to_train", "generator"),
        ("weights_not_to_train", "iterator"),
        ("propagate_cast_ops_allow", "generator"),
        ("recompute_checkpoints", "iterator"),
    ],
)
def test_options_of_the_wrong_type_are_refused_by_name(name: str, value) -> None:
    p = TrainingParameters()
    if value == "generator":
        value = (n for n in ["W1", "W2"])
    elif value == "iterator":
        value = iter(["W1", "W2"])
    with pytest.raises(TypeError, match=name):
        setattr(p, name, value)
    assert getattr(p, name) == getattr(TrainingParameters(), name)  # left as it was


def test_options_take_what_the_legacy_binding_took() -> None:
    p = TrainingParameters()
    p.enable_grad_norm_clip = 0
    p.use_mixed_precision = np.bool_(True)
    p.gradient_accumulation_steps = np.int64(4)
    p.world_size = np.int32(2)
    p.loss_scale = 128
    p.weights_to_train = ["W1", "W2"]
    assert (p.enable_grad_norm_clip, p.use_mixed_precision) == (False, True)
    assert (p.gradient_accumulation_steps, p.world_size, p.loss_scale) == (4, 2, 128.0)
    assert p.weights_to_train == {"W1", "W2"}


def test_accumulation_without_an_optimizer_is_refused() -> None:
    """Spec §4.4: with no optimizer nothing reads the accumulated gradients; an error, not a no-op."""
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.gradient_accumulation_steps = 2
    with pytest.raises(ValueError, match="gradient_accumulation_steps=2 needs an optimizer"):
        TrainingSession(mlp_model().SerializeToString(), p)


@pytest.mark.parametrize("name", ["enable_adasum", "deepspeed_zero_stage"])
def test_exchange_options_alone_warn_at_the_callers_line(name: str) -> None:
    """With one rank, Adasum and ZeRO do nothing: the warning says so and points at the script's line."""
    p = params(**{name: True if name == "enable_adasum" else 1})
    with pytest.warns(UserWarning, match=f"{name} has no effect with one data-parallel rank") as got:
        TrainingSession(mlp_model().SerializeToString(), p)
    assert [w.filename for w in got if name in str(w.message)] == [__file__]


def test_allow_layer_norm_mod_precision_is_a_property_that_warns_it_changes_nothing() -> None:
    """onnxruntime 1.8-1.11's option (LayerNormalization statistics in the half type): scripts of that time
    set it; onnxtrain keeps the statistics float32 and says so."""
    import warnings

    p = params("SGDOptimizer")
    assert p.allow_layer_norm_mod_precision is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingSession(mlp_model().SerializeToString(), p)
    p.allow_layer_norm_mod_precision = True
    with pytest.warns(UserWarning, match="allow_layer_norm_mod_precision: LayerNormalization keeps float32"):
        TrainingSession(mlp_model().SerializeToString(), p)


def test_a_session_without_an_optimizer_says_it_trains_nothing() -> None:
    """onnxruntime's session without an optimizer computed the loss and updated nothing, silently; a user
    who forgot ``training_optimizer_name`` now hears it. A session fetching the gradients is not told."""
    import warnings

    model = mlp_model().SerializeToString()
    with pytest.warns(UserWarning, match="training_optimizer_name is empty: run\\(\\) computes the loss and "
                                         "updates no weight"):
        sess = TrainingSession(model, params(""))
    before = sess.get_state()
    x, y = batches(1, 8)[0]
    loss = sess.run(["loss"], {"x": x, "y": y})[0]
    assert np.isfinite(loss) and "Learning_Rate" not in [a.name for a in sess.get_inputs()]
    after = sess.get_state()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingSession(model, params("", set_gradients_as_graph_outputs=True))


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_model_input_named_like_the_learning_rate_feed_is_that_feed(backend: str, tmp_path) -> None:
    """A model input ``Learning_Rate`` (float [1], added to the logits) was listed twice in the training
    graph: an invalid graph that the onnxruntime backend refused; onnxruntime skipped the duplicate, one feed
    serving both. SGD's step against numpy's."""
    import onnx
    from onnx import TensorProto, helper

    import onnxtrain

    model = mlp_model()
    g = model.graph
    g.input.append(helper.make_tensor_value_info("Learning_Rate", TensorProto.FLOAT, [1]))
    sce = next(n for n in g.node if n.op_type == "SoftmaxCrossEntropyLoss")
    g.node.insert(list(g.node).index(sce), helper.make_node("Add", ["logits", "Learning_Rate"], ["shifted"]))
    sce.input[0] = "shifted"
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    dump = str(tmp_path / "training.onnx")
    sess = TrainingSession(model.SerializeToString(), params(model_with_training_graph_path=dump), so)
    assert [i.name for i in sess.get_inputs()].count("Learning_Rate") == 1
    onnx.checker.check_model(onnx.load(dump), full_check=True)
    ((x, y),) = batches(1, 8)
    lr = np.array([0.5], np.float32)
    w = {k: v.copy() for k, v in sess.get_state().items()}
    sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})
    # the gradient of W2 by hand: softmax(logits + lr) − onehot, through the second Gemm
    h = np.maximum(x @ w["W1"].T + w["b1"], 0)
    z = h @ w["W2"].T + w["b2"] + lr
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    p[np.arange(len(y)), y] -= 1
    want = w["W2"] - 0.5 * (p / len(y)).T @ h
    np.testing.assert_allclose(sess.get_state()["W2"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name, value, entry", [
    ("optimizer_int_attributes_map", {"W1": {"do_bias_correction": 0.5}}, "do_bias_correction"),
    ("optimizer_attributes_map", {"W1": {"alpha": "0.9"}}, "alpha"),
    ("optimizer_attributes_map", {"W1": [1]}, "'W1'"),
    ("optimizer_attributes_map", {3: {"alpha": 0.9}}, "keys must be names"),
    ("immutable_weights", {"Add": [1.0]}, "'Add'"),
    ("immutable_weights", {"Mul": 3}, "'Mul'"),
    ("immutable_weights", {"Div": [(1.5, 8.0)]}, "'Div'"),
])
def test_map_entries_of_the_wrong_type_are_refused_by_entry(name: str, value, entry: str) -> None:
    # they were taken: int(0.5) == 0 turned bias correction off, silently
    p = TrainingParameters()
    with pytest.raises(TypeError, match=f"{name}.*{entry}"):
        setattr(p, name, value)


def test_map_entries_take_what_the_legacy_binding_took() -> None:
    import enum

    class Mode(enum.IntEnum):  # onnxruntime's ORTTrainer put bools and int enums in the int map
        L2 = 1

    p = TrainingParameters()
    p.optimizer_int_attributes_map = {"W1": {"do_bias_correction": True, "weight_decay_mode": Mode.L2}}
    p.optimizer_attributes_map = {"W1": {"alpha": 0.9, "beta": np.float32(0.999), "lambda": 0}}
    p.immutable_weights = {"Div": [(1, 8.0)], "Sub": [[0, 1]]}
    assert p.optimizer_int_attributes_map == {"W1": {"do_bias_correction": True, "weight_decay_mode": 1}}


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
@pytest.mark.parametrize("key, value", [("alpha", float("nan")), ("beta", 1.5), ("beta", 1.0),
                                        ("lambda", float("inf")), ("lambda", -0.1), ("epsilon", -1e-8)])
def test_optimizer_attributes_out_of_range_are_refused_by_entry(opt: str, key: str, value: float) -> None:
    # each gave NaN weights after a step, silently (torch's optimizers refuse these values too)
    model = mlp_model()
    fmap = {w: {} for w in ("W1", "b1", "W2", "b2")}
    fmap["W2"] = {key: value}
    imap = {w: {} for w in fmap}
    p = params(opt, optimizer_attributes_map=fmap, optimizer_int_attributes_map=imap)
    with pytest.raises(ValueError, match=f"\\['W2'\\]\\['{key}'\\].*out of range"):
        TrainingSession(model.SerializeToString(), p)


def test_arguments_of_the_wrong_kind_are_type_errors() -> None:
    from onnxtrain import GradientGraphBuilder

    s = TrainingSession(mlp_model().SerializeToString(), params())
    x, y = batches(1, 4)[0]
    with pytest.raises(TypeError, match="run_options must be a RunOptions"):
        s.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR}, 3)
    with pytest.raises(TypeError, match="load_state takes a mapping"):
        s.load_state("W1")
    with pytest.raises(TypeError, match="strict must be a bool"):
        s.load_state({}, strict="no")
    with pytest.raises(TypeError, match="x_node_arg_names must be a set or list"):  # 'WB' was {'W', 'B'}
        GradientGraphBuilder(mlp_model().SerializeToString(), {"loss"}, "W1", "loss")


def test_dir_lists_the_properties() -> None:
    names = set(dir(TrainingParameters()))  # it listed none of them (introspecting scripts found nothing)
    assert {"loss_output_name", "weights_to_train", "optimizer_attributes_map", "lr_params_feed_name"} \
        <= names
    assert "set_optimizer_initial_state" in names


def test_scalars_of_numpy_and_torch_and_int_like_flags_are_taken() -> None:
    torch = pytest.importorskip("torch")
    p = TrainingParameters()
    p.optimizer_attributes_map = {"W1": {"alpha": np.array(0.8), "beta": torch.tensor(0.99)}}
    p.optimizer_int_attributes_map = {"W1": {"do_bias_correction": np.array(1)}}
    s = TrainingSession(mlp_model().SerializeToString(), params())
    s.load_state({}, strict=0)  # ints for the bool, as the binding took them
    s.load_state({}, strict=np.int64(1))


@pytest.mark.parametrize("prop", ["model_with_training_graph_path", "model_with_gradient_graph_path",
                                  "model_after_graph_transforms_path"])
def test_a_dump_path_that_cannot_be_written_names_the_property_and_the_path(prop, tmp_path) -> None:
    """A folder given as a dump path, or a path under a file: the error names the property and the path the
    user gave (it named a temporary beside it before), and leaves no file behind."""
    import os

    (tmp_path / "file").write_text("x")
    for path, kind in ((tmp_path, IsADirectoryError), (tmp_path / "file" / "m.onnx", NotADirectoryError)):
        with pytest.raises(kind) as e:
            TrainingSession(mlp_model().SerializeToString(), params(**{prop: str(path)}))
        assert isinstance(e.value, RuntimeError)  # onnxruntime's Fail, as the session's other errors
        assert e.value.filename == str(path) and f"TrainingParameters.{prop}: " in str(e.value), e.value
    assert sorted(os.listdir(tmp_path)) == ["file"]


@pytest.mark.parametrize("old, new, value, expected", [
    ("partition_optimizer", "deepspeed_zero_stage", True, 1),
    ("partition_optimizer", "deepspeed_zero_stage", False, 0),
    ("use_invertible_layernorm_grad", "use_memory_efficient_gradient", True, True),
    ("use_adasum", "enable_adasum", True, True),
])
def test_renamed_options_of_older_bindings_set_the_new_one(old: str, new: str, value, expected) -> None:
    """onnxruntime 1.3-1.7's frontends set ``partition_optimizer``, ``use_invertible_layernorm_grad`` and
    ``use_adasum`` on every session; a port of them reads and writes the option that replaced each."""
    p = TrainingParameters()
    setattr(p, old, value)
    assert getattr(p, new) == expected and getattr(p, old) == value and p.is_set(new)
    with pytest.raises(TypeError, match=f"TrainingParameters.{old} must be a bool, got str"):
        setattr(p, old, "False")


def test_partition_optimizer_trains_as_zero_stage_one() -> None:
    """The old name builds the same session as ``deepspeed_zero_stage = 1`` (one rank: it warns that it
    does nothing, and the weights after three Adam steps equal a session without it)."""
    x, y = batches(1, 8)[0]
    states = []
    for kw in ({"partition_optimizer": True}, {"deepspeed_zero_stage": 1}, {}):
        p = params("AdamOptimizer", **kw)
        if kw:
            with pytest.warns(UserWarning, match="deepspeed_zero_stage has no effect with one data-parallel"):
                sess = TrainingSession(mlp_model().SerializeToString(), p)
        else:
            sess = TrainingSession(mlp_model().SerializeToString(), p)
        for _ in range(3):
            sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
        states.append(sess.get_state())
    for state in states[1:]:
        assert state.keys() == states[0].keys()
        for k in state:
            np.testing.assert_array_equal(state[k], states[0][k])


def test_perform_fp16_allreduce_is_taken_and_says_what_onnxtrain_sums() -> None:
    """onnxruntime 1.5-1.7's ``perform_fp16_allreduce`` (default True) is a property; set True under mixed
    precision it warns that the float32 master gradients are summed."""
    import warnings

    p = params("SGDOptimizer")
    assert p.perform_fp16_allreduce is True
    p.perform_fp16_allreduce = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TrainingSession(mlp_model().SerializeToString(), p)
    p = params("SGDOptimizer", use_mixed_precision=True, perform_fp16_allreduce=True)
    with pytest.warns(UserWarning, match="perform_fp16_allreduce has no effect: onnxtrain sums the float32"):
        TrainingSession(mlp_model().SerializeToString(), p)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_a_session_keeps_the_parameters_it_was_built_with(backend: str) -> None:
    """The legacy constructor read its parameters once: changing the object afterwards (to build another
    session from it) must not reach a session already built (its steps read them on every run: on the
    backend a KeyError for an accumulation buffer it never made, with "auto" accumulation no update where
    one was due)."""
    from tests.session.helpers import backend_options

    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    opts = backend_options(backend)
    model = mlp_model().SerializeToString()
    data = batches(4, 16)
    p = params("SGDOptimizer", gradient_accumulation_steps=2, gradient_accumulation_mode="auto")
    sess = TrainingSession(model, p, opts)
    p.gradient_accumulation_steps = 4
    p.lr_params_feed_name = "lr"
    ref = TrainingSession(model, params("SGDOptimizer", gradient_accumulation_steps=2,
                                        gradient_accumulation_mode="auto"), opts)
    for x, y in data:
        feeds = {"x": x, "y": y, "Learning_Rate": LR}
        np.testing.assert_array_equal(sess.run(["loss"], feeds)[0], ref.run(["loss"], feeds)[0])
    for name, value in ref.get_state().items():
        np.testing.assert_array_equal(sess.get_state()[name], value)
    assert p.gradient_accumulation_steps == 4  # (the caller's object keeps its own values)

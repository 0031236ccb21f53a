"""A model value named like a state tensor the legacy session adds (``Update_Count_<w>``, ``Moment_1_<w>``,
Lamb's ``Step``, ``<w>_grad_accumulate_buffer``) keeps its own value: the session renames it inside the
training graph. The oracle is the same model with the value named otherwise (renaming a model's internal
value changes nothing). A name the user feeds, fetches or reads in the state is refused by name."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession

LR = np.array([0.05], np.float32)
WEIGHTS = ("W1", "b1", "W2", "b2")


def _model(names: dict[str, str] | None = None) -> onnx.ModelProto:
    """x → Gemm → Relu → Gemm → logits; + a frozen offset ``off``; column ``idx`` (an int64 index) of it
    against y; loss = mean squared difference. ``names`` renames values of the canonical model."""
    n = {k: k for k in ("x", "y", "W1", "b1", "h", "hr", "W2", "b2", "logits", "off", "idx", "loss")}
    n.update(names or {})
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal((4, 5)) * 0.5).astype(np.float32), n["W1"]),
        numpy_helper.from_array((rng.standard_normal(5) * 0.1).astype(np.float32), n["b1"]),
        numpy_helper.from_array((rng.standard_normal((5, 3)) * 0.5).astype(np.float32), n["W2"]),
        numpy_helper.from_array((rng.standard_normal(3) * 0.1).astype(np.float32), n["b2"]),
        numpy_helper.from_array(np.array([2.0, -1.0, 0.5], np.float32), n["off"]),
        numpy_helper.from_array(np.array([1], np.int64), n["idx"]),
    ]
    nodes = [
        helper.make_node("Gemm", [n["x"], n["W1"], n["b1"]], [n["h"]], name="mm1"),
        helper.make_node("Relu", [n["h"]], [n["hr"]], name="relu"),
        helper.make_node("Gemm", [n["hr"], n["W2"], n["b2"]], [n["logits"]], name="mm2"),
        helper.make_node("Add", [n["logits"], n["off"]], ["shifted"], name="add"),
        helper.make_node("Gather", ["shifted", n["idx"]], ["col"], axis=1, name="gather"),
        helper.make_node("Sub", ["col", n["y"]], ["d"], name="sub"),
        helper.make_node("Mul", ["d", "d"], ["d2"], name="sq"),
        helper.make_node("ReduceMean", ["d2"], [n["loss"]], keepdims=0, name="mean"),
    ]
    g = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info(n["x"], T.FLOAT, ["N", 4]),
         helper.make_tensor_value_info(n["y"], T.FLOAT, ["N", 1])],
        [helper.make_tensor_value_info(n["loss"], T.FLOAT, []),
         helper.make_tensor_value_info(n["logits"], T.FLOAT, ["N", 3])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _params(opt: str, names: dict[str, str] | None = None, **kw) -> TrainingParameters:
    """The trained weights are the four of the MLP (under their names in ``names``): ``off`` stays frozen."""
    names = names or {}
    p = TrainingParameters()
    p.loss_output_name = names.get("loss", "loss")
    p.training_optimizer_name = opt
    p.weights_to_train = {names.get(w, w) for w in WEIGHTS}
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def _train(names: dict[str, str], opt: str, runs: int = 3, fetch: tuple[str, ...] = (), **kw):
    """Losses (and ``fetch``) of ``runs`` training runs, the state after them and the session."""
    s = TrainingSession(_model(names).SerializeToString(), _params(opt, names, **kw))
    for g in (s._graphs.full, s._graphs.forward, s._graphs.accumulate):
        if g is not None:
            onnx.checker.check_model(g, full_check=True)
    rng = np.random.default_rng(1)
    out = []
    for _ in range(runs):
        x, y = rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 1)).astype(np.float32)
        feeds = {names.get("x", "x"): x, names.get("y", "y"): y, "Learning_Rate": LR}
        if s.loss_scale_input_name:
            feeds[s.loss_scale_input_name] = np.array([8.0], np.float32)
        out.append([np.asarray(v).copy() for v in s.run([names.get("loss", "loss"), *fetch], feeds)])
    return out, s.get_state(), s


def _state_key(key: str, names: dict[str, str]) -> str:
    """The state key of the renamed model's ``key`` in the model whose trained weights ``names`` renames."""
    for old, new in names.items():
        for pre in ("", "Moment_1_", "Moment_2_", "Update_Count_"):
            for suf in ("", "_fp16", "_grad_accumulate_buffer"):
                if key == f"{pre}{old}{suf}":
                    return f"{pre}{new}{suf}"
    return key


def _assert_same_training(names: dict[str, str], opt: str, runs: int = 3, base_kw: dict | None = None,
                          **kw) -> TrainingSession:
    """The model with ``names`` trains as the canonical one (given ``base_kw`` in place of ``kw``'s): same
    losses, weights and state, each state entry under its key in that model."""
    base, base_state, _ = _train({}, opt, runs, **{**kw, **(base_kw or {})})
    got, state, s = _train(names, opt, runs, **kw)
    for a, b in zip(base, got):
        np.testing.assert_array_equal(b[0], a[0])
    assert sorted(state) == sorted(_state_key(k, names) for k in base_state)
    for k, v in base_state.items():
        np.testing.assert_array_equal(state[_state_key(k, names)], v, err_msg=k)
    return s


def test_int64_constant_named_like_adams_update_count_is_no_step_counter() -> None:
    # the index initializer became W1's step count: other losses, then an out-of-bounds Gather
    _assert_same_training({"idx": "Update_Count_W1"}, "AdamOptimizer")


def test_constant_named_like_lambs_step_is_no_step_counter() -> None:
    _assert_same_training({"idx": "Step"}, "LambOptimizer")


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_frozen_constant_named_like_an_accumulation_buffer_keeps_its_value(opt: str) -> None:
    # the offset was replaced by W2's zeroed accumulation buffer: the losses of another model
    _assert_same_training({"off": "W2_grad_accumulate_buffer"}, opt, runs=4, gradient_accumulation_steps=2,
                          gradient_accumulation_mode="auto")


@pytest.mark.parametrize("kw", [{}, {"use_mixed_precision": True},
                                {"use_mixed_precision": True, "gradient_accumulation_steps": 2,
                                 "gradient_accumulation_mode": "auto"}])
@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_node_outputs_named_like_optimizer_state_keep_their_values(opt: str, kw: dict) -> None:
    names = {"h": "Moment_1_W2", "hr": "Update_Count_W1" if opt == "AdamOptimizer" else "Step"}
    _assert_same_training(names, opt, runs=4, **kw)


def test_recompute_checkpoint_named_like_optimizer_state_is_found() -> None:
    _assert_same_training({"h": "Moment_1_W2"}, "AdamOptimizer", base_kw={"recompute_checkpoints": ["h"]},
                          recompute_checkpoints=["Moment_1_W2"])


def test_weight_named_like_a_generated_moment_output_keeps_its_state() -> None:
    # W1's new first moment was named 'Moment_1_W1_Out', the state input of the weight 'W1_Out'
    s = _assert_same_training({"W2": "W1_Out"}, "AdamOptimizer")
    assert "Moment_1_W1_Out" in s.get_state()


def test_weight_named_like_the_half_twins_gradient_output_is_kept() -> None:
    """With set_gradients_as_graph_outputs under mixed precision, W2's half gradient ``W2_fp16_grad``
    (onnxruntime's name) cannot take the name of a trained weight ``W2_fp16_grad``: it takes a fresh one."""
    kw = {"use_mixed_precision": True, "set_gradients_as_graph_outputs": True}
    names = {"b1": "W2_fp16_grad"}
    _assert_same_training(names, "AdamOptimizer", **kw)
    base, _, _ = _train({}, "AdamOptimizer", fetch=("W2_fp16_grad", "W2_grad"), **kw)
    got, _, s = _train(names, "AdamOptimizer", fetch=("W2_fp16_grad_1", "W2_grad"), **kw)
    assert "W2_fp16_grad_1" in [o.name for o in s.get_outputs()]
    for a, b in zip(base, got):
        assert b[1].dtype == np.float16
        np.testing.assert_array_equal(b[1], a[1])
        np.testing.assert_array_equal(b[2], a[2])


@pytest.mark.parametrize(("names", "opt", "kw", "message"), [
    ({"x": "Step"}, "LambOptimizer", {},
     "the model's input 'Step' has the name the session gives LambOptimizer's state 'Step' "
     r"\(a get_state\(\) entry\); rename the input$"),
    ({"logits": "Update_Count_W1"}, "AdamOptimizer", {},
     "the model's output 'Update_Count_W1' has the name the session gives AdamOptimizer's state "
     "'Update_Count' of weight 'W1'.*rename the output$"),
    ({"b1": "Moment_1_W2"}, "AdamOptimizer", {},
     "the model's trained weight 'Moment_1_W2' has the name the session gives AdamOptimizer's state "
     "'Moment_1' of weight 'W2'.*rename the trained weight"),
    ({"b1": "W2_grad_accumulate_buffer"}, "SGDOptimizer", {"gradient_accumulation_steps": 2},
     "the model's trained weight 'W2_grad_accumulate_buffer' has the name the session gives the gradient "
     "accumulation buffer of weight 'W2'"),
])
def test_names_the_user_sees_are_refused_by_name(names: dict, opt: str, kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainingSession(_model(names).SerializeToString(), _params(opt, names, **kw))
    TrainingSession(_model().SerializeToString(), _params(opt, **kw))  # the model named otherwise trains

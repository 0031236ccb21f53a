"""A recompute option that selects nothing in the model beside options that do is named in a warning (README:
"Recompute options ... that select nothing in the model are named in a warning"); only the case where all of
them selected nothing was said. The warning changes nothing: the step is the one of the options that act."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import onnxtrain as ort
from tests.graph_transforms import nets

LR = np.array([0.01], np.float32)


def _gelu_mlp() -> onnx.ModelProto:
    """x → (MatMul → Gelu) × 2 → MatMul → SoftmaxCrossEntropyLoss: GELUs, no attention, no Dropout."""
    rng = np.random.default_rng(4)
    n, inits, cur = helper.make_node, [], "x"
    nodes = []
    for k, (a, b) in enumerate(((6, 12), (12, 12), (12, 5))):
        inits.append(numpy_helper.from_array((rng.standard_normal((a, b)) * 0.4).astype(np.float32), f"W{k}"))
        nodes.append(n("MatMul", [cur, f"W{k}"], [f"h{k}"]))
        cur = f"h{k}"
        if k < 2:
            nodes.append(n("Gelu", [cur], [f"g{k}"]))
            cur = f"g{k}"
    nodes.append(n("SoftmaxCrossEntropyLoss", [cur, "y"], ["loss"]))
    g = helper.make_graph(nodes, "gelu_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 6]),
                                              helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def _session(model: onnx.ModelProto, **options) -> tuple[ort.TrainingSession, list[str]]:
    p = ort.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    for k, v in options.items():
        setattr(p, k, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = ort.TrainingSession(model.SerializeToString(), p)
    return sess, [str(w.message) for w in caught if "recompute" in str(w.message)]


def _same_steps(a: ort.TrainingSession, b: ort.TrainingSession, feeds: dict) -> None:
    for _ in range(2):
        la, lb = (s.run(["loss"], {**feeds, "Learning_Rate": LR})[0] for s in (a, b))
        np.testing.assert_array_equal(la, lb)
    for k, v in b.get_state().items():
        np.testing.assert_array_equal(a.get_state()[k], v, err_msg=k)


def _recomputes(sess: ort.TrainingSession) -> bool:
    return any(n.name.endswith("_recompute") for n in sess._graphs.full.graph.node)


def test_attention_dropout_recompute_beside_a_gelu_recompute_on_a_model_without_attention() -> None:
    model = _gelu_mlp()
    both, said = _session(model, gelu_recompute=True, attn_dropout_recompute=True)
    gelu, alone = _session(model, gelu_recompute=True)
    assert _recomputes(both) and not alone
    assert len(said) == 1 and "attention-dropout recompute finds no Dropout" in said[0], said
    assert said[0].startswith("TrainingParameters gelu_recompute, attn_dropout_recompute: ")
    rng = np.random.default_rng(0)
    _same_steps(both, gelu, {"x": rng.standard_normal((4, 6)).astype(np.float32),
                             "y": rng.integers(0, 5, 4).astype(np.int64)})


def test_transformer_layer_recompute_of_a_one_layer_model_beside_a_gelu_recompute() -> None:
    """One layer: the last, never recomputed (number_recompute_layers 0 is every layer but the last)."""
    model = nets.gpt(1)
    both, said = _session(model, gelu_recompute=True, transformer_layer_recompute=True)
    gelu, alone = _session(model, gelu_recompute=True)
    assert _recomputes(both) and not alone
    assert len(said) == 1 and "transformer-layer recompute finds one transformer layer" in said[0], said
    _same_steps(both, gelu, nets.gpt_feeds(2))


def test_options_that_all_act_say_nothing() -> None:
    _, said = _session(nets.gpt(2), gelu_recompute=True, attn_dropout_recompute=True,
                       transformer_layer_recompute=True)
    assert said == []

"""``GradientGraphBuilder`` against onnxruntime-training 1.16.3's own (its pybind class
``onnxruntime.capi._pybind_state.GradientGraphBuilder``, run in ``tests/ortt.py``'s legacy venv).

One 1.16.3 process runs every case of ``ggb_peer.py``; the same script runs them here on onnxtrain's builder.
Compared: the constructor's and each call's result (an exception of onnxtrain must be an instance of 1.16.3's
class), the built models' inputs and outputs (names, order, element types, shapes), and the gradients of
three models (a Gemm/MatMul+Add/Relu/Softmax cross-entropy MLP, a Conv + inference BatchNormalization +
MaxPool net, and a torch export of a GPT block with its LayerNorms, causal attention and cross-entropy):
1.16.3's gradient model run by 1.16.3's InferenceSession, onnxtrain's run by onnxruntime (this
environment's) and by onnxtrain's engine, and torch autograd as the oracle of all three.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.autodiff import ggb_peer

F = TensorProto.FLOAT
MLP_WEIGHTS = ["w1", "b1", "w2", "b2"]
CONV_WEIGHTS = ["cw", "cb", "bn_s", "bn_b", "fw", "fb"]
BATCH = 3


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.4
          ) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _model(nodes: list, inputs: list, outputs: list, inits: list, name: str) -> onnx.ModelProto:
    """At opset 17 and IR 8, which 1.16.3's onnx 1.15 reads."""
    g = helper.make_graph(nodes, name, inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def mlp() -> onnx.ModelProto:
    """x[batch, 6] -> Gemm(w1ᵀ, b1) -> Relu -> MatMul w2 + b2 = logits -> Softmax -> Log -> · one-hot t ->
    -mean over the batch of the row sums = loss. Also hsum = sum(h) (w2 does not reach it), and two values
    that are no graph outputs: zsum = sum(z) and penalty = sum(w2 · w2) (one Mul reading w2 twice)."""
    rng = np.random.default_rng(1)
    inits = [_init(rng, "w1", (10, 6)), _init(rng, "b1", (10,)), _init(rng, "w2", (10, 4)),
             _init(rng, "b2", (4,)), numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "w2"], ["z"]),
        helper.make_node("Add", ["z", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["p"], axis=-1),
        helper.make_node("Log", ["p"], ["lp"]),
        helper.make_node("Mul", ["lp", "t"], ["tl"]),
        helper.make_node("ReduceSum", ["tl", "axis1"], ["s"], keepdims=0),
        helper.make_node("Neg", ["s"], ["ns"]),
        helper.make_node("ReduceMean", ["ns"], ["loss"], keepdims=0),
        helper.make_node("ReduceSum", ["h"], ["hsum"], keepdims=0),
        helper.make_node("ReduceSum", ["z"], ["zsum"], keepdims=0),
        helper.make_node("Mul", ["w2", "w2"], ["w2sq"]),
        helper.make_node("ReduceSum", ["w2sq"], ["penalty"], keepdims=0),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 6]),
                          helper.make_tensor_value_info("t", F, ["batch", 4])],
                  [helper.make_tensor_value_info("loss", F, []),
                   helper.make_tensor_value_info("logits", F, ["batch", 4]),
                   helper.make_tensor_value_info("hsum", F, [])], inits, "mlp")


def mlp_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {"x": rng.standard_normal((BATCH, 6)).astype(np.float32),
            "t": np.eye(4, dtype=np.float32)[rng.integers(0, 4, BATCH)]}


def conv(bn: bool = True) -> onnx.ModelProto:
    """x[batch, 2, 8, 8] -> Conv 3x3 pad 1 (cw, cb) -> BatchNormalization in inference mode (bn_s, bn_b;
    running bn_mean, bn_var) -> Relu -> MaxPool 2x2 -> Flatten -> Gemm (fw, fb) = out;
    loss = mean((out - t)²). Without ``bn``, the BatchNormalization is ``c · bn_s + bn_b`` (bn_s, bn_b
    of shape [4, 1, 1])."""
    rng = np.random.default_rng(3)
    per_channel = (4,) if bn else (4, 1, 1)
    inits = [_init(rng, "cw", (4, 2, 3, 3)), _init(rng, "cb", (4,)),
             numpy_helper.from_array((1 + 0.2 * rng.standard_normal(per_channel)).astype(np.float32), "bn_s"),
             _init(rng, "bn_b", per_channel), _init(rng, "bn_mean", (4,), 0.1),
             numpy_helper.from_array((0.5 + rng.random(4)).astype(np.float32), "bn_var"),
             _init(rng, "fw", (64, 3), 0.2), _init(rng, "fb", (3,))]
    normalize = [helper.make_node("BatchNormalization", ["c", "bn_s", "bn_b", "bn_mean", "bn_var"], ["n"],
                                  epsilon=1e-5)]
    if not bn:
        del inits[4:6]
        normalize = [helper.make_node("Mul", ["c", "bn_s"], ["cs"]),
                     helper.make_node("Add", ["cs", "bn_b"], ["n"])]
    nodes = [
        helper.make_node("Conv", ["x", "cw", "cb"], ["c"], pads=[1, 1, 1, 1]),
        *normalize,
        helper.make_node("Relu", ["n"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["mp"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["mp"], ["f"]),
        helper.make_node("Gemm", ["f", "fw", "fb"], ["out"]),
        helper.make_node("Sub", ["out", "t"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
    ]
    return _model(nodes, [helper.make_tensor_value_info("x", F, ["batch", 2, 8, 8]),
                          helper.make_tensor_value_info("t", F, ["batch", 3])],
                  [helper.make_tensor_value_info("loss", F, []),
                   helper.make_tensor_value_info("out", F, ["batch", 3])], inits,
                  "conv" if bn else "conv_affine")


def conv_feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(4)
    return {"x": rng.standard_normal((BATCH, 2, 8, 8)).astype(np.float32),
            "t": rng.standard_normal((BATCH, 3)).astype(np.float32)}


def gpt() -> tuple[onnx.ModelProto, dict[str, np.ndarray], Any]:
    """tests/models.py's GPT block with its cross-entropy, exported by torch (TorchScript, training mode,
    Dropout ratios 0) at IR 8; its feeds and module. (In eval mode the exporter ties the three LayerNorms'
    equal initial weights: ln2's and ln_f's become Identities of ln1's.)"""
    from tests.models import export
    from tests.session.legacy_peer import legacy_model

    model, feeds, module = export("gpt_block", training=True, with_loss=True, dropout=0.0)
    return legacy_model(model), feeds, module


def with_saved_statistics(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its LayerNormalizations' Mean and InvStdDev outputs and its SoftmaxCrossEntropyLoss's
    log_prob output named (torch leaves them out): 1.16.3's builder reads them."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for k, n in enumerate(m.graph.node):
        if n.op_type == "LayerNormalization" and len(n.output) == 1:
            n.output.extend([f"ln{k}_mean", f"ln{k}_inv_std"])
        elif n.op_type == "SoftmaxCrossEntropyLoss" and len(n.output) == 1:
            n.output.append(f"sce{k}_log_prob")
    onnx.checker.check_model(m, full_check=True)
    return m


def gpt_weights(module: Any) -> list[str]:
    return [n for n, _ in module.named_parameters()]


def write_models(folder: str) -> dict[str, Any]:
    """The models and feeds of the cases, in ``folder``; the torch module of the GPT block."""
    os.makedirs(folder, exist_ok=True)
    g, g_feeds, module = gpt()
    for name, model, feeds in (("mlp", mlp(), mlp_feeds()), ("conv", conv(), conv_feeds()),
                               ("conv_affine", conv(bn=False), conv_feeds()), ("gpt", g, g_feeds),
                               ("gpt_saved_statistics", with_saved_statistics(g), g_feeds)):
        onnx.save(model, os.path.join(folder, f"{name}.onnx"))
        np.savez(os.path.join(folder, f"{name}.npz"), **feeds)
    with open(os.path.join(folder, "garbage.onnx"), "wb") as f:
        f.write(b"not a model")
    return {"gpt_module": module, "gpt_weights": gpt_weights(module)}


def cases(gpt_names: list[str]) -> list[dict[str, Any]]:
    """The cases run on both sides (see ggb_peer.py); most on the MLP, asking for loss w.r.t. its weights."""
    c: list[dict[str, Any]] = []

    def add(name: str, calls: tuple[str, ...] = ("build", "get_model"), model: str = "mlp",
            **kw: Any) -> None:
        c.append({"name": name, "model": f"{model}.onnx", "ys": ["loss"], "xs": list(MLP_WEIGHTS),
                  "loss": "loss", "calls": list(calls), **kw})

    # when build() is called
    add("get_model_before_build", ("get_model",))
    add("save_before_build", ("save",))
    add("built_and_saved", ("build", "get_model", "save"))
    add("build_twice", ("build", "build", "get_model"))
    add("save_to_a_missing_folder", ("build", "save_missing_folder"))
    add("save_to_a_folder", ("build", "save_to_folder"))
    add("save_to_a_pathlike", ("build", "save_pathlike"))
    # argument types
    for kind in ("path", "pathlike", "proto", "bytearray"):
        add(f"model_as_{kind}", model_as=kind)
    add("model_not_a_model", model="garbage")
    for kind in ("list", "tuple", "frozenset", "str", "ints"):
        add(f"xs_as_{kind}", xs_as=kind)
        add(f"ys_as_{kind}", ys_as=kind)
    add("loss_none", loss=None)
    add("options_session", options="session")
    add("options_str", options="str")
    add("xs_duplicated_in_a_list", xs=["w1", "w1"], xs_as="list")
    add("ys_duplicated_in_a_list", ys=["loss", "loss"], ys_as="list")
    # names
    add("unknown_y", ys=["nope"])
    add("unknown_x", xs=["w1", "nope"])
    add("unknown_loss", ("build", "get_model", "run"), loss="nope", feeds="mlp.npz")
    add("empty_loss", loss="")
    add("empty_ys", ys=[])
    add("empty_xs", ("build", "get_model", "run"), xs=[], feeds="mlp.npz")
    add("loss_not_a_scalar", ys=["logits"], loss="logits")
    add("y_not_a_scalar_without_loss", ys=["logits"], loss="")
    add("loss_and_another_y", ("build", "get_model", "run"), ys=["loss", "logits"], feeds="mlp.npz")
    add("loss_no_graph_output", ("build", "get_model", "run"), ys=["zsum"], xs=["w2"], loss="zsum",
        feeds="mlp.npz")
    add("x_read_twice_by_a_node", ("build", "get_model", "run"), ys=["penalty"], xs=["w2"], loss="penalty",
        feeds="mlp.npz")
    add("x_not_reached", ys=["hsum"], xs=["w1", "w2"], loss="hsum")
    add("x_graph_input", ("build", "get_model", "run"), xs=["x", "w1"], feeds="mlp.npz")
    add("x_label_input", xs=["t"])
    add("x_activation", ("build", "get_model", "run"), xs=["h"], feeds="mlp.npz")
    add("x_integer", xs=["axis1", "w1"])
    add("x_is_the_loss", xs=["loss"])
    add("y_graph_input", ys=["x"], xs=["w1"], loss="x")
    add("y_initializer", ys=["w2"], xs=["w2"], loss="w2")
    # values
    value = ("build", "get_model", "run")
    add("values_mlp", value, xs=[*MLP_WEIGHTS, "x"], feeds="mlp.npz")
    add("values_conv_bn", value, model="conv", xs=[*CONV_WEIGHTS, "x"], feeds="conv.npz")
    add("values_conv_affine", value, model="conv_affine", xs=[*CONV_WEIGHTS, "x"], feeds="conv_affine.npz")
    add("values_gpt", value, model="gpt", xs=gpt_names, feeds="gpt.npz")
    add("values_gpt_saved_statistics", value, model="gpt_saved_statistics", xs=gpt_names,
        feeds="gpt_saved_statistics.npz")
    return c


def run_both(folder: str) -> dict[str, Any]:
    """The cases on 1.16.3 (one process of its venv) and on onnxtrain (here)."""
    import onnxruntime

    import onnxtrain
    from tests.ortt import ensure_ort_legacy, run_script

    python = ensure_ort_legacy()
    info = write_models(os.path.join(folder, "models"))
    spec = {"models": os.path.join(folder, "models"), "cases": cases(info["gpt_weights"])}
    with open(os.path.join(folder, "spec.json"), "w") as f:
        json.dump({**spec, "out": os.path.join(folder, "peer")}, f)
    with open(ggb_peer.__file__) as f:
        peer = run_script(f.read(), os.path.join(folder, "spec.json"), python=python)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ours = ggb_peer.run_cases(onnxtrain.GradientGraphBuilder, onnxtrain.SessionOptions, onnxruntime,
                                  {**spec, "out": os.path.join(folder, "ours")})
    return {"peer": peer, "ours": ours, "folder": folder, **info}


# ---- torch autograd, in float64: the oracle of the values --------------------------------------------------
def _weights(folder: str, model: str) -> dict[str, np.ndarray]:
    m = onnx.load(os.path.join(folder, "models", f"{model}.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


def _feeds(folder: str, model: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(folder, "models", f"{model}.npz")) as z:
        return {k: z[k] for k in z.files}


def torch_gradients(both: dict[str, Any], case: str) -> dict[str, np.ndarray]:
    """The loss and its gradients (``<x>_grad``) by torch autograd in float64, from the case's model's
    initializers and feeds; the math of each model written anew in torch."""
    import torch
    import torch.nn.functional as tf

    folder = both["folder"]
    if case == "values_mlp":
        w, f = _weights(folder, "mlp"), _feeds(folder, "mlp")
    elif case.startswith("values_conv"):
        model = "conv" if case == "values_conv_bn" else "conv_affine"
        w, f = _weights(folder, model), _feeds(folder, model)
    else:
        return _torch_gpt(both)
    p = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in [*MLP_WEIGHTS, *CONV_WEIGHTS, "x"])
         for k, v in {**w, **f}.items() if k != "t"}
    t = torch.tensor(f["t"], dtype=torch.float64)
    if case == "values_mlp":
        h = torch.relu(p["x"] @ p["w1"].T + p["b1"])
        logp = torch.log(torch.softmax(h @ p["w2"] + p["b2"], dim=-1))
        loss = (-(logp * t).sum(1)).mean()
    else:
        c = tf.conv2d(p["x"], p["cw"], p["cb"], padding=1)
        if case == "values_conv_bn":
            n = tf.batch_norm(c, p["bn_mean"], p["bn_var"], p["bn_s"], p["bn_b"], training=False, eps=1e-5)
        else:
            n = c * p["bn_s"] + p["bn_b"]
        out = torch.flatten(tf.max_pool2d(torch.relu(n), 2), 1) @ p["fw"] + p["fb"]
        loss = ((out - t) ** 2).mean()
    loss.backward()
    return {"loss": loss.detach().numpy(),
            **{f"{k}_grad": v.grad.numpy() for k, v in p.items() if v.grad is not None}}


def _torch_gpt(both: dict[str, Any]) -> dict[str, np.ndarray]:
    import copy

    import torch

    module = copy.deepcopy(both["gpt_module"]).double()
    feeds = _feeds(both["folder"], "gpt")
    loss = module(*(torch.from_numpy(v) for v in feeds.values()))
    loss.backward()
    return {"loss": loss.detach().numpy(),
            **{f"{n}_grad": p.grad.numpy() for n, p in module.named_parameters()}}


# ---- the comparison ----------------------------------------------------------------------------------------
# Where onnxtrain takes what 1.16.3 refuses (the case: 1.16.3's refusal); every call of onnxtrain's succeeds.
OURS_ACCEPTS = {
    "build_twice": "Duplicate definition of name (w1_grad)",  # it adds the gradient outputs again
    "save_to_a_pathlike": "incompatible function arguments",  # save() takes a str only
    **{f"model_as_{k}": "incompatible constructor arguments"
       for k in ("path", "pathlike", "proto", "bytearray")},
    **{f"{w}_as_{k}": "incompatible constructor arguments" for w in ("xs", "ys") for k in ("list", "tuple")},
    "ys_duplicated_in_a_list": "incompatible constructor arguments",
    # it seeds a scalar 1 and its gradient graph then fails shape inference; onnxtrain seeds ones of the
    # loss's shape (the gradient of its sum)
    "loss_not_a_scalar": "axis must be in [-rank, rank-1]",
    "x_is_the_loss": "loss couldn't find the consumer node",  # onnxtrain: loss_grad, ones
    "y_initializer": "w2: couldn't find the producer node",  # onnxtrain: w2_grad, ones
    "x_read_twice_by_a_node": "Duplicate definition of name (w2_grad)",  # Mul(w2, w2)
    "values_conv_bn": "The gradient builder has not been registered: BatchNormalization",  # (inference mode)
    # torch writes LayerNormalization without its Mean/InvStdDev outputs and SoftmaxCrossEntropyLoss without
    # log_prob; 1.16.3's gradients read them (values_gpt_saved_statistics names them: both build it)
    "values_gpt": "i < node_->OutputDefs().size() was false",
}
# Where onnxtrain refuses otherwise (the case: a piece of onnxtrain's message): 1.16.3 refuses lists; it
# takes an empty set of ys and fails in build() ("Cannot compute the partial derivative for 'b1' as it's
# unreachable from the output node(s)"), onnxtrain refuses it when constructed, by name.
OURS_REFUSES = {"xs_duplicated_in_a_list": "x_node_arg_names lists 'w1' twice",
                "empty_ys": "y_node_arg_names is empty"}
# A y given with no loss seeding it, and no loss upstream of it: 1.16.3 leaves its '<y>_grad' dangling (a
# model its InferenceSession refuses, "Node input 'loss_grad' is not a graph input"); onnxtrain makes it
# a graph input, to be fed (the case: the input).
OURS_Y_GRAD_INPUT = {"unknown_loss": "loss_grad", "empty_loss": "loss_grad",
                     "y_not_a_scalar_without_loss": "logits_grad"}
VALUE_CASES = ["values_mlp", "values_conv_bn", "values_conv_affine", "values_gpt",
               "values_gpt_saved_statistics"]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return run_both(str(tmp_path_factory.mktemp("ggb")))


def _show(r: dict[str, Any]) -> str:
    return f"{r['error']}: {r['message'][-250:]}" if "error" in r else f"ok {str(r.get('ok'))[:250]}"


def _failure(side: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """Where a side's case failed (``init`` or the call's name with its index) and the error, or None."""
    if "error" in side["init"]:
        return "init", side["init"]
    for k, c in enumerate(side["calls"]):
        if "error" in c:
            return f"{k}:{c['call']}", c
    return None


def _same_interface(peer: dict[str, Any], ours: dict[str, Any], where: str, extra_inputs: tuple = ()) -> None:
    """The same inputs (in order, with types and shapes; ours may add ``extra_inputs`` at the end), the
    model's outputs in order and then the same gradient outputs (1.16.3 in its unordered_set's order,
    onnxtrain sorted by name); the same IR version and default opset. onnxtrain's graph keeps the model's
    initializers (an x that is one stays one, none becomes a graph input), adds none (1.16.3 adds its
    ``loss_grad`` ones and reduce axes) and imports the default domain only (1.16.3 lists its contrib
    domains too, and uses com.microsoft ops)."""
    assert ours["inputs"] == peer["inputs"] + [i for i in ours["inputs"] if i[0] in extra_inputs], where
    grads = [o for o in peer["outputs"] if o[0].endswith("_grad")]
    forward = [o for o in peer["outputs"] if o not in grads]
    assert ours["outputs"][:len(forward)] == forward, where
    ours_grads = ours["outputs"][len(forward):]
    assert sorted(map(str, ours_grads)) == sorted(map(str, grads)), where
    assert set(ours["initializers"]) <= set(peer["initializers"]), where
    assert ours["ir_version"] == peer["ir_version"] and ours["opsets"]["ai.onnx"] == peer["opsets"]["ai.onnx"]
    assert ours["node_domains"] == ["ai.onnx"] and list(ours["opsets"]) == ["ai.onnx"], where


@pytest.mark.parametrize("case", [c["name"] for c in cases(["w"]) if c["name"] not in VALUE_CASES])
def test_surface_against_1_16_3(both: dict[str, Any], case: str) -> None:
    """Each case: the same outcome at the same step, exceptions of 1.16.3's class (by name, or a class
    onnxtrain's derives from), the same interfaces; or a difference listed above."""
    peer, ours = both["peer"][case], both["ours"][case]
    p_fail, o_fail = _failure(peer), _failure(ours)
    if case in OURS_ACCEPTS:
        assert p_fail is not None and OURS_ACCEPTS[case] in p_fail[1]["message"], (
            _show(p_fail[1]) if p_fail else "1.16.3 took it")
        assert o_fail is None, f"onnxtrain refused at {o_fail[0]}: {_show(o_fail[1])}"
        if case.startswith(("model_as", "xs_as", "ys_as", "save_to", "build_twice")):  # the same model
            _same_interface(both["peer"]["built_and_saved"]["calls"][1]["ok"], ours["calls"][-1]["ok"], case)
        return
    if case in OURS_REFUSES:
        assert p_fail is not None and o_fail is not None and OURS_REFUSES[case] in o_fail[1]["message"], (
            _show(o_fail[1]) if o_fail else "onnxtrain took it")
        assert o_fail[1]["error"] == "TypeError" or "ValueError" in o_fail[1]["mro"]
        return
    if case in OURS_Y_GRAD_INPUT:  # (the run's refusals: the next test)
        p_fail = o_fail = None
    if p_fail is not None:
        assert o_fail is not None and o_fail[0] == p_fail[0], (
            f"1.16.3 raised at {p_fail[0]}: {_show(p_fail[1])}; onnxtrain "
            + (f"at {o_fail[0]}: {_show(o_fail[1])}" if o_fail else "took it"))
        assert p_fail[1]["error"] in [o_fail[1]["error"], *o_fail[1]["mro"]], (
            f"1.16.3 raised {p_fail[1]['error']}, onnxtrain {_show(o_fail[1])}")
        return
    assert o_fail is None, _show(o_fail[1])
    for p, o in zip(peer["calls"], ours["calls"]):
        if isinstance(p.get("ok"), dict):
            _same_interface(p["ok"], o["ok"], f"{case}: {p['call']}", (OURS_Y_GRAD_INPUT.get(case),))
        elif p["call"] == "run" and "ok" in p:
            assert sorted(o["ok"]) == sorted(p["ok"])


@pytest.mark.parametrize("case", sorted(OURS_Y_GRAD_INPUT))
def test_a_y_no_loss_seeds_takes_its_gradient_as_an_input(both: dict[str, Any], case: str) -> None:
    """1.16.3's graph reads a '<y>_grad' that nothing makes: its InferenceSession refuses the model;
    onnxtrain's takes it as its last input and asks for the feed."""
    name = OURS_Y_GRAD_INPUT[case]
    assert both["ours"][case]["calls"][1]["ok"]["inputs"][-1][0] == name
    peer_run = [c for c in both["peer"][case]["calls"] if c["call"] == "run"]
    if peer_run:
        assert f"Node input '{name}' is not a graph input" in peer_run[0]["message"]
        assert f"(['{name}']) are missing" in both["ours"][case]["calls"][2]["message"]


def _spec(both: dict[str, Any], case: str) -> dict[str, Any]:
    return next(c for c in cases(both["gpt_weights"]) if c["name"] == case)


def outputs(both: dict[str, Any], side: str, case: str) -> dict[str, np.ndarray] | None:
    """A side's run of the case's gradient model: ``peer`` (1.16.3's model on 1.16.3's InferenceSession),
    ``ours`` (onnxtrain's on this environment's onnxruntime) or ``engine`` (onnxtrain's on its engine);
    None when that side built no model."""
    folder = both["folder"]
    if side == "engine":
        path = os.path.join(folder, "ours", f"{case}.grad.onnx")
        if not os.path.exists(path):
            return None
        from onnxtrain.engine import compile_model

        model = onnx.load(path)
        with np.load(os.path.join(folder, "models", _spec(both, case)["feeds"])) as z:
            got = compile_model(model).run({k: z[k] for k in z.files})
        return dict(zip([o.name for o in model.graph.output], got))
    path = os.path.join(folder, side, f"{case}.npz")
    if not os.path.exists(path):
        return None
    with np.load(path) as z:
        return {k: z[k] for k in z.files}


def close(got: np.ndarray, want: np.ndarray, where: str) -> None:
    """float32 agreement: rtol 1e-5 per element, and 1e-5 of the tensor's largest magnitude absolutely (a
    gradient that is zero in exact arithmetic, as the attention's key bias's, is rounding noise)."""
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=where)


RUN_CASES = [c["name"] for c in cases(["w"]) if "run" in c["calls"] and c["name"] not in
             {*OURS_ACCEPTS, *OURS_Y_GRAD_INPUT}]


@pytest.mark.parametrize("case", RUN_CASES)
def test_values_agree_with_1_16_3(both: dict[str, Any], case: str) -> None:
    """Every output of every gradient model both sides built and ran: 1.16.3's against onnxtrain's, on
    onnxruntime and on onnxtrain's engine."""
    peer = outputs(both, "peer", case)
    assert peer is not None, _show(_failure(both["peer"][case])[1])
    for side in ("ours", "engine"):
        got = outputs(both, side, case)
        assert got is not None and sorted(got) == sorted(peer), f"{side}: {sorted(got or [])}"
        for name, want in peer.items():
            close(got[name], want, f"{case} {side} {name}")


@pytest.mark.parametrize("case", [*VALUE_CASES, "loss_and_another_y"])
def test_values_against_torch_autograd(both: dict[str, Any], case: str) -> None:
    """The loss and every gradient, by each side that built the model, against torch autograd in float64.
    loss_and_another_y's (the logits a y beside the loss) are the loss's alone, as 1.16.3 gives them."""
    want = torch_gradients(both, "values_mlp" if case == "loss_and_another_y" else case)
    sides = {s: outputs(both, s, case) for s in ("peer", "ours", "engine")}
    assert sides["ours"] is not None and sides["engine"] is not None
    for side, got in sides.items():
        if got is None:
            continue
        names = [n for n in got if n in want]
        assert names and all(n in want or n in ("logits", "hsum", "out") for n in got), sorted(got)
        for name in names:
            close(got[name], want[name].astype(np.float32), f"{case} {side} {name}")


def test_an_x_read_twice_by_one_node(both: dict[str, Any]) -> None:
    """penalty = sum(w2 · w2), one Mul reading w2 on both inputs, which 1.16.3 fails to build: 2·w2, the
    closed form, on onnxruntime and on the engine."""
    w2 = _weights(both["folder"], "mlp")["w2"]
    for side in ("ours", "engine"):
        close(outputs(both, side, "x_read_twice_by_a_node")["w2_grad"], 2 * w2, side)

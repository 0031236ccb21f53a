"""onnxruntime's legacy training tests, ported to onnxtrain's TrainingSession.

Sources (microsoft/onnxruntime): onnxruntime/test/python/onnxruntime_test_ort_trainer.py,
onnxruntime_test_ort_trainer_with_mixed_precision.py and onnxruntime_test_training_unit_tests.py. Their
ORTTrainer drove a legacy TrainingSession; each test here makes the same session calls the trainer made
(which TrainingParameters, feeds, fetches, RunOptions, get_state/load_state) on a small hand-built model,
and checks the results against torch autograd with a float64 reference of the optimizer (their expected
losses came from onnxruntime on CUDA and MNIST/BERT data, so they are not copied).
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import RunOptions, TrainingParameters, TrainingSession
from onnxtrain.ir.builder import make_model
from tests.session.helpers import backend_options

LR_NAME = "Learning_Rate"
DIN, DH, DOUT = 12, 10, 5


def _rng_arrays(seed: int, shapes: dict[str, tuple[int, ...]], scale: float = 0.3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: (rng.standard_normal(s) * scale).astype(np.float32) for k, s in shapes.items()}


# --- the MNIST test's network: fc1 -> relu -> fc2 -> + bias_buffer, loss nll(log_softmax) -----------------

MNIST_SHAPES = {"fc1.weight": (DH, DIN), "fc1.bias": (DH,), "fc2.weight": (DOUT, DH), "fc2.bias": (DOUT,)}
MNIST_PARAMS = set(MNIST_SHAPES)


def mnist_model(opset: int) -> onnx.ModelProto:
    """The MNIST wrapper's NeuralNet with its loss: outputs ``loss`` and ``probability`` (the logits), and a
    registered buffer ``bias_buffer`` (1e-6) added to the logits. At opset 12 the loss is
    NegativeLogLikelihoodLoss of LogSoftmax; at opset 10 (no NLL op) the same mean through a one-hot mask."""
    w = _rng_arrays(0, MNIST_SHAPES)
    inits = [numpy_helper.from_array(v, k) for k, v in w.items()]
    inits.append(numpy_helper.from_array(np.array(1e-6, np.float32), "bias_buffer"))
    nodes = [
        helper.make_node("Gemm", ["input1", "fc1.weight", "fc1.bias"], ["h"], transB=1),
        helper.make_node("Relu", ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "fc2.weight", "fc2.bias"], ["out"], transB=1),
        helper.make_node("Add", ["out", "bias_buffer"], ["probability"]),
        helper.make_node("LogSoftmax", ["probability"], ["logp"], axis=1),
    ]
    if opset >= 12:
        nodes.append(helper.make_node("NegativeLogLikelihoodLoss", ["logp", "label"], ["loss"]))
    else:
        inits += [numpy_helper.from_array(np.array([0.0, 1.0], np.float32), "off_on"),
                  numpy_helper.from_array(np.array(DOUT, np.int64), "depth")]
        nodes += [
            helper.make_node("OneHot", ["label", "depth", "off_on"], ["hot"], axis=-1),
            helper.make_node("Mul", ["logp", "hot"], ["picked"]),
            helper.make_node("ReduceSum", ["picked"], ["rows"], axes=[1], keepdims=0),
            helper.make_node("ReduceMean", ["rows"], ["mean"], keepdims=0),
            helper.make_node("Neg", ["mean"], ["loss"]),
        ]
    g = helper.make_graph(
        nodes, "mnist",
        [helper.make_tensor_value_info("input1", T.FLOAT, ["batch", DIN]),
         helper.make_tensor_value_info("label", T.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", T.FLOAT, []),
         helper.make_tensor_value_info("probability", T.FLOAT, ["batch", DOUT])],
        inits,
    )
    return make_model(g, opset)


def mnist_batches(n: int, size: int = 16, seed: int = 7) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, DIN)).astype(np.float32),
             rng.integers(0, DOUT, size).astype(np.int64)) for _ in range(n)]


def torch_mnist_loss(w: dict[str, torch.Tensor], x: np.ndarray,
                     y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The float64 torch network of ``mnist_model``: (loss, logits)."""
    xt = torch.tensor(x, dtype=torch.float64)
    h = torch.relu(xt @ w["fc1.weight"].T + w["fc1.bias"])
    out = h @ w["fc2.weight"].T + w["fc2.bias"] + 1e-6
    return torch.nn.functional.nll_loss(torch.log_softmax(out, 1), torch.tensor(y)), out


def trainer_params(opt: str, weights: set[str], attrs=None, **kw) -> TrainingParameters:
    """The parameters ORTTrainer set: loss = the model's first output, the named weights, an attribute map
    entry for each of them (``attrs(name)`` or empty), the learning-rate feed name."""
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.lr_params_feed_name = LR_NAME
    p.weights_to_train = set(weights)
    p.optimizer_attributes_map = {n: (attrs(n) if attrs else {}) for n in weights}
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def eval_options() -> RunOptions:
    """ORTTrainer.eval_step's RunOptions: only the path to the fetches, Dropout off."""
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    ro.training_mode = False
    return ro


def lr(v: float) -> np.ndarray:
    return np.array([v], np.float32)


@pytest.mark.parametrize("opset", [10, 12])
def test_mnist_sgd_training_and_eval_match_torch(opset: int) -> None:
    """testMNISTTrainingAndTestingOpset10/12: SGD train steps (loss and weights) and eval_step's fetch of
    'probability' without a learning rate, against torch's SGD on the same network."""
    model = mnist_model(opset)
    sess = TrainingSession(model.SerializeToString(), trainer_params("SGDOptimizer", MNIST_PARAMS))
    w = {k: torch.tensor(numpy_helper.to_array(t).astype(np.float64), requires_grad=True)
         for t in model.graph.initializer if (k := t.name) in MNIST_PARAMS}
    opt = torch.optim.SGD(list(w.values()), lr=0.01)
    for x, y in mnist_batches(6):
        loss, _ = sess.run(["loss", "probability"], {"input1": x, "label": y, LR_NAME: lr(0.01)})
        opt.zero_grad()
        ref, _ = torch_mnist_loss(w, x, y)
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
    state = sess.get_state()
    assert set(state) == MNIST_PARAMS  # SGD keeps no optimizer state; the buffer is not trained
    for k, t in w.items():
        np.testing.assert_allclose(state[k], t.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    x, y = mnist_batches(1, 40, seed=99)[0]
    prob, = sess.run(["probability"], {"input1": x}, eval_options())  # no label, no learning rate
    with torch.no_grad():
        _, ref_out = torch_mnist_loss(w, x, y)
    np.testing.assert_allclose(prob, ref_out.numpy(), rtol=1e-5, atol=1e-5)
    after = sess.get_state()
    for k in state:
        np.testing.assert_array_equal(after[k], state[k], err_msg=k)


def test_mnist_resume_from_state_continues_identically() -> None:
    """testMNISTResumeTrainingAndTesting: a fresh session given the first session's state with
    load_state(strict=True) trains on exactly as the uninterrupted session does."""
    data = mnist_batches(8)
    blob = mnist_model(12).SerializeToString()
    whole = TrainingSession(blob, trainer_params("SGDOptimizer", MNIST_PARAMS))
    first = TrainingSession(blob, trainer_params("SGDOptimizer", MNIST_PARAMS))
    feeds = [{"input1": x, "label": y, LR_NAME: lr(0.01)} for x, y in data]
    expected = [whole.run(["loss"], f)[0] for f in feeds]
    for f in feeds[:4]:
        first.run(["loss"], f)
    resumed = TrainingSession(blob, trainer_params("SGDOptimizer", MNIST_PARAMS))
    resumed.load_state(first.get_state(), strict=True)
    got = [resumed.run(["loss"], f)[0] for f in feeds[4:]]
    np.testing.assert_array_equal(got, expected[4:])


def test_mnist_state_names_are_the_model_parameters() -> None:
    """testMNISTStateDict / testMNISTInitializerNames / testWrapModelLossFnStateDict: the state of an SGD
    session is the trained initializers by their own names, nothing renamed, no buffer or constant."""
    sess = TrainingSession(mnist_model(12).SerializeToString(), trainer_params("SGDOptimizer", MNIST_PARAMS))
    x, y = mnist_batches(1)[0]
    sess.run(["loss"], {"input1": x, "label": y, LR_NAME: lr(0.02)})
    assert set(sess.get_state()) == MNIST_PARAMS
    # a model whose forward adds a constant (torch.ones(2, 4) exported as a Constant node)
    lin = _rng_arrays(3, {"linear.weight": (4, 2), "linear.bias": (4,)})
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "linear.weight", "linear.bias"], ["l"], transB=1),
         helper.make_node("Constant", [], ["ones"],
                          value=numpy_helper.from_array(np.ones((2, 4), np.float32))),
         helper.make_node("Add", ["l", "ones"], ["output"]),
         helper.make_node("LogSoftmax", ["output"], ["lp"], axis=1),
         helper.make_node("NegativeLogLikelihoodLoss", ["lp", "label"], ["loss"])],
        "wrap", [helper.make_tensor_value_info("x", T.FLOAT, [2, 2]),
                 helper.make_tensor_value_info("label", T.INT64, [2])],
        [helper.make_tensor_value_info("loss", T.FLOAT, []),
         helper.make_tensor_value_info("output", T.FLOAT, [2, 4])],
        [numpy_helper.from_array(v, k) for k, v in lin.items()])
    m = make_model(g, 12)
    sess = TrainingSession(m.SerializeToString(),
                           trainer_params("SGDOptimizer", {t.name for t in m.graph.initializer}))
    sess.run(["loss"], {"x": np.random.default_rng(0).standard_normal((2, 2)).astype(np.float32),
                        "label": np.array([0, 1], np.int64), LR_NAME: lr(0.02)})
    assert set(sess.get_state()) == {"linear.weight", "linear.bias"}


@pytest.mark.parametrize("how", ["left_out", "weights_not_to_train"])
def test_mnist_frozen_weight_stays_and_the_rest_trains_as_torch(how: str) -> None:
    """testMNISTFrozenWeight / testMNISTTorchBuffer: a frozen fc1.weight (left out of weights_to_train, as
    ORTTrainer's frozen_weights did, or named in weights_not_to_train) and the buffer never change, the
    other weights step as torch's SGD with fc1.weight not requiring grad."""
    model = mnist_model(12)
    if how == "left_out":
        p = trainer_params("SGDOptimizer", MNIST_PARAMS - {"fc1.weight"})
    else:
        p = trainer_params("SGDOptimizer", MNIST_PARAMS, weights_not_to_train={"fc1.weight"})
    sess = TrainingSession(model.SerializeToString(), p)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    w = {k: torch.tensor(init[k].astype(np.float64), requires_grad=k != "fc1.weight") for k in MNIST_PARAMS}
    opt = torch.optim.SGD([t for t in w.values() if t.requires_grad], lr=0.02)
    for x, y in mnist_batches(3):
        sess.run(["loss"], {"input1": x, "label": y, LR_NAME: lr(0.02)})
        opt.zero_grad()
        torch_mnist_loss(w, x, y)[0].backward()
        opt.step()
    state = sess.get_state()
    assert "fc1.weight" not in state and "bias_buffer" not in state
    for k in MNIST_PARAMS - {"fc1.weight"}:
        np.testing.assert_allclose(state[k], w[k].detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=k)
    # the frozen weight as the session reads it: the eval output equals torch's with the initial fc1.weight
    x, y = mnist_batches(1, 8, seed=5)[0]
    prob, = sess.run(["probability"], {"input1": x}, eval_options())
    with torch.no_grad():
        np.testing.assert_allclose(prob, torch_mnist_loss(w, x, y)[1].numpy(), rtol=1e-5, atol=1e-5)


def test_mnist_lamb_checkpoint_with_frozen_weight_round_trips() -> None:
    """testMNISTFrozenWeightCheckpoint / testMNISTTrainingCheckpoint: Lamb with fc1.weight frozen, 5 steps,
    an eval step; a new session given the state reproduces the eval loss exactly, and its state (weights,
    moments, the shared Step) equals the saved one name for name and value for value."""
    blob = mnist_model(12).SerializeToString()
    weights = MNIST_PARAMS - {"fc1.weight"}
    sess = TrainingSession(blob, trainer_params("LambOptimizer", weights))
    data = mnist_batches(6)
    for x, y in data[:5]:
        sess.run(["loss", "probability"], {"input1": x, "label": y, LR_NAME: lr(0.02)})
    x, y = data[5]
    loss, _ = sess.run(["loss", "probability"], {"input1": x, "label": y}, eval_options())
    state = sess.get_state()
    expected_names = weights | {f"Moment_{i}_{w}" for i in (1, 2) for w in weights} | {"Step"}
    assert set(state) == expected_names
    np.testing.assert_array_equal(state["Step"], [6])  # 1 before the first step, +1 a step
    fresh = TrainingSession(blob, trainer_params("LambOptimizer", weights))
    fresh.load_state(state)
    ckpt_loss, _ = fresh.run(["loss", "probability"], {"input1": x, "label": y}, eval_options())
    assert ckpt_loss == loss
    loaded = fresh.get_state()
    assert loaded.keys() == state.keys()
    for k in state:
        np.testing.assert_array_equal(loaded[k], state[k], err_msg=k)


def test_mnist_save_as_onnx_runs_in_onnxruntime() -> None:
    """testMNISTSaveAsONNX: the model with its initializers replaced by get_state()'s values (what
    ORTTrainer.save_as_onnx wrote) gives, in onnxruntime, the probabilities the session's eval run gives."""
    ort = pytest.importorskip("onnxruntime")
    model = mnist_model(12)
    sess = TrainingSession(model.SerializeToString(), trainer_params("SGDOptimizer", MNIST_PARAMS))
    for x, y in mnist_batches(3):
        sess.run(["loss"], {"input1": x, "label": y, LR_NAME: lr(0.05)})
    state = sess.get_state()
    saved = onnx.ModelProto()
    saved.CopyFrom(model)
    kept = [t for t in saved.graph.initializer if t.name not in state]
    del saved.graph.initializer[:]
    saved.graph.initializer.extend([*kept, *(numpy_helper.from_array(v, k) for k, v in state.items())])
    x, y = mnist_batches(1, 20, seed=11)[0]
    ref = ort.InferenceSession(saved.SerializeToString(), providers=["CPUExecutionProvider"])
    expected, = ref.run(["probability"], {"input1": x, "label": y})
    got, = sess.run(["probability"], {"input1": x}, eval_options())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


# --- the BERT tests' settings on a small transformer-like block: Lamb, per-weight decay, lr schedule -------

BERT_SHAPES = {"dense.weight": (DH, DIN), "dense.bias": (DH,),
               "LayerNorm.weight": (DH,), "LayerNorm.bias": (DH,),
               "cls.weight": (DOUT, DH), "cls.bias": (DOUT,)}
LR_SCHEDULE = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07]  # starts at 0 as the BERT tests' list did


def map_optimizer_attributes(name: str) -> dict[str, float]:
    """The BERT tests' map: no weight decay for biases and LayerNorm, 0.01 for the rest; ε 1e-6."""
    no_decay = any(k in name for k in ("bias", "gamma", "beta", "LayerNorm"))
    return {"alpha": 0.9, "beta": 0.999, "lambda": 0.0 if no_decay else 0.01, "epsilon": 1e-6}


def bert_model() -> onnx.ModelProto:
    w = _rng_arrays(1, BERT_SHAPES)
    w["LayerNorm.weight"] += 1.0
    g = helper.make_graph(
        [helper.make_node("Gemm", ["x", "dense.weight", "dense.bias"], ["h"], transB=1),
         helper.make_node("LayerNormalization", ["h", "LayerNorm.weight", "LayerNorm.bias"], ["n"], axis=-1,
                          epsilon=1e-5),
         helper.make_node("Tanh", ["n"], ["t"]),
         helper.make_node("Gemm", ["t", "cls.weight", "cls.bias"], ["logits"], transB=1),
         helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"])],
        "bert_toy",
        [helper.make_tensor_value_info("x", T.FLOAT, ["batch", DIN]),
         helper.make_tensor_value_info("labels", T.INT64, ["batch"])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(v, k) for k, v in w.items()])
    return make_model(g, 17)


def torch_bert_loss(w: dict[str, torch.Tensor], x: np.ndarray, y: np.ndarray) -> torch.Tensor:
    h = torch.tensor(x, dtype=torch.float64) @ w["dense.weight"].T + w["dense.bias"]
    n = torch.nn.functional.layer_norm(h, (DH,), w["LayerNorm.weight"], w["LayerNorm.bias"], eps=1e-5)
    logits = torch.tanh(n) @ w["cls.weight"].T + w["cls.bias"]
    return torch.nn.functional.cross_entropy(logits, torch.tensor(y))


class LambReference:
    """Float64 Lamb as the legacy builder configured it: per-weight α, β, λ, ε (float32 attributes), no bias
    correction, unbounded trust ratio, gradients divided by max(1, global norm / max_norm_clip 1.0)."""

    def __init__(self, weights: dict[str, np.ndarray], clip: bool = True) -> None:
        self.w = {k: v.astype(np.float64) for k, v in weights.items()}
        self.m1 = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.m2 = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.clip = clip

    def grads(self, batches: list[tuple[np.ndarray, np.ndarray]]
              ) -> tuple[list[float], dict[str, np.ndarray]]:
        """Each batch's loss at the current weights, and the mean of their gradients."""
        wt = {k: torch.tensor(v, requires_grad=True) for k, v in self.w.items()}
        losses, total = [], {k: np.zeros_like(v) for k, v in self.w.items()}
        for x, y in batches:
            for t in wt.values():
                t.grad = None
            loss = torch_bert_loss(wt, x, y)
            loss.backward()
            losses.append(loss.item())
            for k, t in wt.items():
                total[k] += t.grad.numpy() / len(batches)
        return losses, total

    def step(self, g: dict[str, np.ndarray], lr_value: float) -> None:
        norm = np.sqrt(sum(float((v * v).sum()) for v in g.values()))
        s = max(1.0, norm / 1.0) if self.clip else 1.0
        for k in self.w:
            at = map_optimizer_attributes(k)
            a, b = float(np.float32(at["alpha"])), float(np.float32(at["beta"]))
            lam, eps = float(np.float32(at["lambda"])), float(np.float32(at["epsilon"]))
            gk = g[k] / s
            self.m1[k] = a * self.m1[k] + (1 - a) * gk
            self.m2[k] = b * self.m2[k] + (1 - b) * gk * gk
            d = lam * self.w[k] + self.m1[k] / (np.sqrt(self.m2[k]) + eps)
            wn, dn = np.linalg.norm(self.w[k]), np.linalg.norm(d)
            ratio = wn / dn if wn > 0 and dn > 0 else 1.0
            self.w[k] = self.w[k] - lr_value * ratio * d


def bert_batches(n: int, size: int = 16, seed: int = 3) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((size, DIN)).astype(np.float32),
             rng.integers(0, DOUT, size).astype(np.int64)) for _ in range(n)]


def bert_session(**kw) -> TrainingSession:
    """create_ort_trainer: every initializer trained, its attributes from map_optimizer_attributes."""
    m = bert_model()
    p = trainer_params("LambOptimizer", {t.name for t in m.graph.initializer}, map_optimizer_attributes, **kw)
    return TrainingSession(m.SerializeToString(), p)


def initial_bert_weights() -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in bert_model().graph.initializer}


def train_like_ort_trainer(sess: TrainingSession, data, accumulation: int, mixed: bool = False):
    """runBertTrainingTest's loop through ORTTrainer.train_step: micro-steps fetch the outputs and
    Group_Accumulated_Gradients with only_execute_path_to_fetches; an update step runs normally and, under
    mixed precision, fetches all_gradients_finite and feeds the loss scale of a dynamic LossScaler."""
    losses, finites, scale, stable = [], [], float(1 << 16), 0
    group = next((o.name for o in sess._outputs_meta if "Group_Accumulated_Gradients" in o.name), None)
    finite = next((o.name for o in sess._outputs_meta if "all_gradients_finite" in o.name), None)
    for i, (x, y) in enumerate(data):
        feeds = {"x": x, "labels": y, LR_NAME: lr(LR_SCHEDULE[i])}
        if mixed:
            feeds[sess.loss_scale_input_name] = np.array([scale], np.float32)
        if (i + 1) % accumulation:
            ro = RunOptions()
            ro.only_execute_path_to_fetches = True
            loss, _ = sess.run(["loss", group], feeds, ro)
        elif mixed:
            loss, ok = sess.run(["loss", finite], feeds)
            finites.append(bool(np.asarray(ok).reshape(-1)[0]))
            stable = stable + 1 if finites[-1] else 0
            if not finites[-1]:
                scale /= 2
        else:
            loss, = sess.run(["loss"], feeds)
        losses.append(float(loss))
    return losses, finites


def reference_run(data, accumulation: int) -> tuple[list[float], LambReference]:
    ref = LambReference(initial_bert_weights())
    losses: list[float] = []
    for start in range(0, len(data), accumulation):
        # the micro-batches of one update all see the weights before it
        part, g = ref.grads(data[start:start + accumulation])
        losses += part
        ref.step(g, LR_SCHEDULE[start + accumulation - 1])
    return losses, ref


def assert_follows_reference(sess: TrainingSession, losses: list[float], data, accumulation: int,
                             half: bool) -> LambReference:
    """The session's losses and weights against :func:`reference_run`'s float64 Lamb (within half
    precision's error when ``half``); returns the reference."""
    ref_losses, ref = reference_run(data, accumulation)
    np.testing.assert_allclose(losses, ref_losses, rtol=5e-3 if half else 2e-5)
    state = sess.get_state()
    rtol, atol = (2e-2, 2e-3) if half else (2e-4, 2e-5)
    for k, v in ref.w.items():
        np.testing.assert_allclose(state[k], v, rtol=rtol, atol=atol, err_msg=k)
    return ref


@pytest.mark.parametrize("accumulation", [1, 4])
def test_bert_lamb_training_and_eval_match_reference(accumulation: int) -> None:
    """testBertTrainingBasic / testBertTrainingGradientAccumulation: Lamb with per-weight decay and ε, a
    learning-rate schedule starting at 0, 8 micro-steps (accumulating 4 with the Group_Accumulated_Gradients
    protocol), then eval_step(fetches=['loss']): losses and weights against a float64 Lamb on torch's
    gradients (the mean of each update's micro-batch gradients)."""
    data = bert_batches(8)
    sess = bert_session(gradient_accumulation_steps=accumulation)
    losses, _ = train_like_ort_trainer(sess, data, accumulation)
    ref = assert_follows_reference(sess, losses, data, accumulation, half=False)
    state = sess.get_state()
    np.testing.assert_array_equal(state["Step"], [1 + len(data) // accumulation])
    # eval_step after the training: the loss at the trained weights, nothing updated (not even Step)
    x, y = bert_batches(1, 24, seed=50)[0]
    eval_loss, = sess.run(["loss"], {"x": x, "labels": y}, eval_options())
    wt = {k: torch.tensor(v) for k, v in ref.w.items()}
    np.testing.assert_allclose(eval_loss, torch_bert_loss(wt, x, y).item(), rtol=5e-5)
    after = sess.get_state()
    for k in state:
        np.testing.assert_array_equal(after[k], state[k], err_msg=k)


def test_bert_first_step_at_learning_rate_zero_moves_moments_not_weights() -> None:
    """The BERT tests' schedule begins with lr 0: that step leaves every weight as it was but advances the
    moments and the shared Step, so the second step's update uses both batches' moments."""
    data = bert_batches(2)
    sess = bert_session()
    w0 = initial_bert_weights()
    sess.run(["loss"], {"x": data[0][0], "labels": data[0][1], LR_NAME: lr(0.0)})
    state = sess.get_state()
    for k, v in w0.items():
        np.testing.assert_array_equal(state[k], v, err_msg=k)
    ref = LambReference(w0)
    _, g = ref.grads(data[:1])
    ref.step(g, 0.0)
    for k in w0:
        np.testing.assert_allclose(state[f"Moment_1_{k}"], ref.m1[k], rtol=1e-4, atol=1e-9, err_msg=k)
        np.testing.assert_allclose(state[f"Moment_2_{k}"], ref.m2[k], rtol=1e-4, atol=1e-12, err_msg=k)
    np.testing.assert_array_equal(state["Step"], [2])


@pytest.mark.parametrize("accumulation", [1, 4])
def test_bert_mixed_precision_flags_and_losses(accumulation: int) -> None:
    """testBertTrainingMixedPrecision / testBertTrainingGradientAccumulationMixedPrecision: fp16 mixed
    precision with the loss scale fed from a dynamic LossScaler (2^16): all_gradients_finite is fetched on
    update steps only (8 flags, or 2 when accumulating 4), all True; losses and weights follow the float64
    Lamb within half precision's error; eval_step's loss too."""
    data = bert_batches(8)
    sess = bert_session(gradient_accumulation_steps=accumulation, use_mixed_precision=True)
    losses, finites = train_like_ort_trainer(sess, data, accumulation, mixed=True)
    assert finites == [True] * (len(data) // accumulation)
    ref = assert_follows_reference(sess, losses, data, accumulation, half=True)
    x, y = bert_batches(1, 24, seed=50)[0]
    eval_loss, = sess.run(["loss"], {"x": x, "labels": y}, eval_options())
    wt = {k: torch.tensor(v) for k, v in ref.w.items()}
    np.testing.assert_allclose(eval_loss, torch_bert_loss(wt, x, y).item(), rtol=5e-3)


def test_bert_checkpointing_basic() -> None:
    """testBertCheckpointingBasic: a state changed by hand (LayerNorm.weight + 1) and loaded with load_state
    is what a second session, given that state, holds and computes with."""
    sess = bert_session()
    sd = sess.get_state()
    sd["LayerNorm.weight"] = sd["LayerNorm.weight"] + 1
    sess.load_state(sd)
    second = bert_session()
    second.load_state(sess.get_state())
    loaded = second.get_state()
    assert loaded.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(loaded[k], sd[k], err_msg=k)
    x, y = bert_batches(1, 8, seed=4)[0]
    got, = second.run(["loss"], {"x": x, "labels": y}, eval_options())
    wt = {k: torch.tensor(sd[k].astype(np.float64)) for k in BERT_SHAPES}
    np.testing.assert_allclose(got, torch_bert_loss(wt, x, y).item(), rtol=1e-5)


# --- onnxruntime_test_training_unit_tests.py ----------------------------------------------------------------

def two_dropout_model(ratio: float) -> onnx.ModelProto:
    """TwoDropoutNet exported for training: (input + weight_1) through two Dropouts, element 0 the output."""
    g = helper.make_graph(
        [helper.make_node("Add", ["input", "weight_1"], ["s"]),
         helper.make_node("Dropout", ["s", "ratio", "mode"], ["d1"]),
         helper.make_node("Dropout", ["d1", "ratio", "mode"], ["d2"]),
         helper.make_node("Gather", ["d2", "zero"], ["output"], axis=0)],
        "two_dropout", [helper.make_tensor_value_info("input", T.FLOAT, [3])],
        [helper.make_tensor_value_info("output", T.FLOAT, [])],
        [numpy_helper.from_array(np.zeros(3, np.float32), "weight_1"),
         numpy_helper.from_array(np.array(ratio, np.float32), "ratio"),
         numpy_helper.from_array(np.array(True), "mode"),
         numpy_helper.from_array(np.array(0, np.int64), "zero")])
    return make_model(g, 13)


def test_training_and_eval_dropout() -> None:
    """testTrainingAndEvalDropout: with ratio 0.999 twice a training step drops everything (output 0), an
    eval step (training_mode False) keeps it (input + weight_1 = 1: Lamb left the zero weight as it was,
    its gradient being 0), and the next training step drops again: eval did not change the ratios."""
    p = TrainingParameters()
    p.loss_output_name = "output"
    p.training_optimizer_name = "LambOptimizer"
    p.weights_to_train = {"weight_1"}
    p.optimizer_attributes_map = {"weight_1": map_optimizer_attributes("weight_1")}
    sess = TrainingSession(two_dropout_model(0.999).SerializeToString(), p)
    x = np.ones(3, np.float32)
    out, = sess.run(["output"], {"input": x, LR_NAME: lr(1.0)})
    assert out == 0.0
    ev, = sess.run(["output"], {"input": x}, eval_options())
    np.testing.assert_allclose(ev, 1.0, rtol=1e-4)
    np.testing.assert_array_equal(sess.get_state()["weight_1"], np.zeros(3, np.float32))
    # eval through an IOBinding as ORTTrainer.eval_step bound it
    b = sess.io_binding()
    b.bind_cpu_input("input", x)
    b.bind_output("output")
    sess.run_with_iobinding(b, eval_options())
    np.testing.assert_allclose(b.copy_outputs_to_cpu()[0], 1.0, rtol=1e-4)
    out2, = sess.run(["output"], {"input": x, LR_NAME: lr(1.0)})
    assert out2 == 0.0


# --- the first ort_trainer.py (2020): the client scaled the loss itself ------------------------------------

def client_scaled_bert_model() -> onnx.ModelProto:
    """What add_loss_scale_input of the first ort_trainer.py did to the model: a float input
    'loss_scale_loss_1' (declared rank 0) and a node Mul(loss_scale_loss_1, loss) -> 'scaled_loss_loss_1'."""
    m = bert_model()
    m.graph.input.append(helper.make_tensor_value_info("loss_scale_loss_1", T.FLOAT, []))
    m.graph.node.append(helper.make_node("Mul", ["loss_scale_loss_1", "loss"], ["scaled_loss_loss_1"],
                                         name="loss_scale_loss_1"))
    return m


def first_trainer_params(mixed: bool, accumulation: int = 1) -> TrainingParameters:
    """create_ort_training_session_with_optimizer of the first ort_trainer.py: it set loss_scale_input_name
    and scaled_loss_output_name on every session ('' without mixed precision) and world_rank -1."""
    m = bert_model()
    p = trainer_params("LambOptimizer", {t.name for t in m.graph.initializer}, map_optimizer_attributes,
                       world_rank=-1, world_size=1, gradient_accumulation_steps=accumulation,
                       use_mixed_precision=mixed, allreduce_post_accumulation=False)
    p.scaled_loss_output_name = "scaled_loss_loss_1" if mixed else ""
    p.loss_scale_input_name = "loss_scale_loss_1" if mixed else ""
    return p


def test_first_ort_trainer_parameters_without_mixed_precision() -> None:
    """The first ort_trainer.py's session factory (the scaled-loss names left empty) trains as Lamb does."""
    data = bert_batches(4)
    sess = TrainingSession(bert_model().SerializeToString(), first_trainer_params(mixed=False))
    losses, _ = train_like_ort_trainer(sess, data, 1)
    ref_losses, ref = reference_run(data, 1)
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-5)
    state = sess.get_state()
    for k, v in ref.w.items():
        np.testing.assert_allclose(state[k], v, rtol=2e-4, atol=2e-5, err_msg=k)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
@pytest.mark.parametrize("accumulation", [1, 4])
def test_first_ort_trainer_mixed_precision_with_its_own_scaled_loss(accumulation: int, backend: str) -> None:
    """testBertTrainingMixedPrecision as the first ort_trainer.py ran it: the model holds its own
    loss · loss_scale, named by scaled_loss_output_name, and the scale is the client's input named by
    loss_scale_input_name, fed [scale] (the test's LossScaler) or as a 0-d value (the internal one). The
    updates are those of the unscaled loss (a float64 Lamb), not scaled twice."""
    data = bert_batches(8)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "the onnxruntime backend .* has no float16")
        sess = TrainingSession(client_scaled_bert_model().SerializeToString(),
                               first_trainer_params(mixed=True, accumulation=accumulation),
                               backend_options(backend))
    assert sess.loss_scale_input_name == "loss_scale_loss_1"
    finite = next(o.name for o in sess._outputs_meta if "all_gradients_finite" in o.name)
    group = next((o.name for o in sess._outputs_meta if "Group_Accumulated_Gradients" in o.name), None)
    losses, finites = [], []
    for i, (x, y) in enumerate(data):
        # one scale through an accumulation (the scaler changed it on update steps only), in both forms
        value = 2.0 ** (15 + (i // accumulation) % 2)
        scale = np.array([value], np.float32) if i % 2 else np.array(value, np.float32)
        feeds = {"x": x, "labels": y, LR_NAME: lr(LR_SCHEDULE[i]), "loss_scale_loss_1": scale}
        if (i + 1) % accumulation:
            ro = RunOptions()
            ro.only_execute_path_to_fetches = True
            loss, _ = sess.run(["loss", group], feeds, ro)
        else:
            loss, ok = sess.run(["loss", finite], feeds)
            finites.append(bool(np.asarray(ok).reshape(-1)[0]))
        losses.append(float(loss))
    assert finites == [True] * (len(data) // accumulation)
    assert_follows_reference(sess, losses, data, accumulation, half=True)


def test_first_ort_trainer_scaled_loss_must_scale_the_loss() -> None:
    """A scaled_loss_output_name that is not the loss times a fed input is refused, naming the option."""
    m = bert_model()
    m.graph.node.append(helper.make_node("Mul", ["loss", "loss"], ["scaled_loss_loss_1"]))
    with pytest.raises(ValueError, match="scaled_loss_output_name"):
        TrainingSession(m.SerializeToString(), first_trainer_params(mixed=True))


def test_ort_trainer_binding_sequence_with_accumulation_and_mixed_precision() -> None:
    """ORTTrainer.train_step's use of one IOBinding (runBertTrainingTest with mixed precision, accumulating
    4): inputs and outputs bound by pointer each step; micro-steps bind the loss and
    Group_Accumulated_Gradients and run with only_execute_path_to_fetches; the update step binds the loss and
    all_gradients_finite over the same binding (the group output still bound) and runs normally, then
    clear_binding_outputs. The losses, flags and weights follow the float64 Lamb."""
    data = bert_batches(8)
    accumulation = 4
    sess = bert_session(gradient_accumulation_steps=accumulation, use_mixed_precision=True)
    group = next(o.name for o in sess._outputs_meta if "Group_Accumulated_Gradients" in o.name)
    finite = next(o.name for o in sess._outputs_meta if "all_gradients_finite" in o.name)
    binding = sess.io_binding()
    scale = np.array([2.0 ** 16], np.float32)
    losses, flags = [], []
    for i, (x, y) in enumerate(data):
        rate = lr(LR_SCHEDULE[i])
        for name, a in (("x", x), ("labels", y), (LR_NAME, rate), (sess.loss_scale_input_name, scale)):
            binding.bind_input(name, "cpu", 0, a.dtype, list(a.shape), a.ctypes.data)
        loss = np.zeros((), np.float32)
        binding.bind_output("loss", "cpu", 0, np.float32, [], loss.ctypes.data)
        if (i + 1) % accumulation:
            flag = np.zeros([1], bool)
            binding.bind_output(group, "cpu", 0, np.bool_, [1], flag.ctypes.data)
            ro = RunOptions()
            ro.only_execute_path_to_fetches = True
            sess.run_with_iobinding(binding, ro)
        else:
            ok = np.zeros([1], bool)
            binding.bind_output(finite, "cpu", 0, np.bool_, [1], ok.ctypes.data)
            sess.run_with_iobinding(binding)
            binding.clear_binding_outputs()
            flags.append(bool(ok[0]))
        losses.append(float(loss))
    assert flags == [True, True]
    assert_follows_reference(sess, losses, data, accumulation, half=True)
    np.testing.assert_array_equal(sess.get_state()["Step"], [3])


@pytest.mark.parametrize("split", [{"pipeline_parallel_size": 2, "pipeline_cut_info_string": "t"},
                                   {"horizontal_parallel_size": 2}])
def test_first_ort_trainer_scaled_loss_is_refused_by_split_sessions(split: dict) -> None:
    """The pipelined and horizontally split sessions build their own loss scaling: they refuse the first
    era's names of a model's own one, naming them, rather than leave the model's product unread."""
    p = first_trainer_params(mixed=True)
    for k, v in split.items():
        setattr(p, k, v)
    with pytest.raises(NotImplementedError, match="scaled_loss_output_name, loss_scale_input_name"):
        TrainingSession(client_scaled_bert_model().SerializeToString(), p)


@pytest.mark.parametrize("split", [{"pipeline_parallel_size": 2, "pipeline_cut_info_string": "t"},
                                   {"horizontal_parallel_size": 2}])
def test_first_ort_trainer_scaled_loss_names_warn_in_split_sessions_without_fp16(split: dict) -> None:
    """Without mixed precision the two names do nothing: the split sessions warn so, as one process does,
    instead of refusing them (they get as far as asking for mpiexec here)."""
    p = first_trainer_params(mixed=False)
    p.scaled_loss_output_name, p.loss_scale_input_name = "scaled_loss_loss_1", "loss_scale_loss_1"
    for k, v in split.items():
        setattr(p, k, v)
    idle = "scaled_loss_output_name has no effect without use_mixed_precision"
    with pytest.warns(UserWarning, match=idle), pytest.raises(Exception) as got:  # noqa: PT011 - any but that
        TrainingSession(bert_model().SerializeToString(), p)
    assert not isinstance(got.value, NotImplementedError), got.value

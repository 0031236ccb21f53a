"""A Llama-style block exported by torch 2.13's exporter at opset 23 (``nn.RMSNorm`` → RMSNormalization,
``scaled_dot_product_attention`` with grouped heads → Attention) trains as torch trains it: the legacy
session and the on-device API, step by step, with the ops run and differentiated as their ONNX bodies.
The same block exported at the exporter's default opset (20, the layers written out in older ops) too."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript", reason="torch's opset-23 exporter (dynamo) needs onnxscript")
nn, F = torch.nn, torch.nn.functional

LR = 1e-2
STEPS = 8


class LlamaBlock(nn.Module):
    """Pre-norm attention with 4 query heads over 2 key/value heads (causal), a SwiGLU MLP, a head and
    the MSE loss."""

    def __init__(self, d: int = 16, heads: int = 4, kv_heads: int = 2, hidden: int = 32) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.v = nn.Linear(d, kv_heads * self.dh, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.head = nn.Linear(d, 5)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.dh).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.dh).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return F.mse_loss(self.head(x), target)


def _batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"x": rng.standard_normal((2, 6, 16)).astype(np.float32),
            "target": rng.standard_normal((2, 6, 5)).astype(np.float32)}


def export_llama(opset: int, batch: int = 2) -> onnx.ModelProto:
    """The block (torch's seed 0) as torch's exporter writes it at ``opset``, for batches of ``batch`` (the
    exporter writes the batch size into the head reshapes)."""
    torch.manual_seed(0)
    module = LlamaBlock()
    args = tuple(torch.from_numpy(np.concatenate([v] * (batch // 2))) for v in _batch(0).values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # optimize=False: the exporter's optimizer folds the weights' transposes into new constants and
        # merges equal initializers (the two RMSNorm scales), which loses the parameters' names
        program = torch.onnx.export(module, args, dynamo=True, opset_version=opset, optimize=False,
                                    input_names=["x", "target"], output_names=["loss"], verbose=False)
    return program.model_proto


@pytest.fixture(scope="module", params=[23, 20], ids=["opset23", "opset20"])
def exported(request) -> onnx.ModelProto:
    """The block as torch's exporter writes it: at opset 23 with the new ops, at its default opset 20 with
    the same layers written out in older ops."""
    model = export_llama(request.param)
    ops = {n.op_type for n in model.graph.node}
    assert ({"Attention", "RMSNormalization"} <= ops) == (request.param >= 23), sorted(ops)
    return model


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _torch_twin(weights: dict[str, np.ndarray]) -> nn.Module:
    module = LlamaBlock()
    with torch.no_grad():
        for k, v in module.state_dict().items():
            v.copy_(torch.from_numpy(np.array(weights[k])))
    return module


def _session(model: onnx.ModelProto, backend: str = "numpy", mixed_precision: bool = False
             ) -> TrainingSession:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.enable_grad_norm_clip = False
    p.use_mixed_precision = mixed_precision
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return TrainingSession(model.SerializeToString(), p, so)


def test_legacy_session_adam_matches_torch(exported: onnx.ModelProto) -> None:
    sess = _session(exported)
    module = _torch_twin(sess.get_state())
    assert sorted(sess.get_model_state()["full_precision"]) == sorted(dict(module.named_parameters()))
    opt = torch.optim.Adam(module.parameters(), lr=LR)
    for step in range(STEPS):
        feeds = _batch(step)
        ours = sess.run(["loss"], {**feeds, "Learning_Rate": np.array([LR], np.float32)})[0]
        opt.zero_grad()
        theirs = module(*(torch.from_numpy(v) for v in feeds.values()))
        theirs.backward()
        opt.step()
        assert _rel(ours, theirs.item()) < 1e-5, (step, ours, theirs.item())
        state = sess.get_state()
        for k, v in module.named_parameters():
            assert _rel(state[k], v.detach().numpy()) < 1e-5, (step, k)


def test_onnxruntime_backend_trains_as_the_numpy_engine(exported: onnx.ModelProto) -> None:
    """The same training graph (the bodies' ops) on onnxruntime: the losses of the numpy engine's run. (Its
    rewrite of Where(mask, x, 0) into a Mul once turned the Attention body's Where(mask, 0, -inf) into
    0·inf = NaN.)"""
    pytest.importorskip("onnxruntime")
    runs = []
    for backend in ("numpy", "onnxruntime"):
        sess = _session(exported, backend)
        lr = np.array([LR], np.float32)
        runs.append([float(sess.run(["loss"], {**_batch(s), "Learning_Rate": lr})[0]) for s in range(STEPS)])
    np.testing.assert_allclose(runs[1], runs[0], rtol=1e-5)


def test_mixed_precision_trains_close_to_float32(exported: onnx.ModelProto) -> None:
    """Under mixed precision the bodies run on float16 casts of the weights: the losses stay within float16
    rounding of the float32 run's."""
    runs = []
    for mixed in (False, True):
        sess = _session(exported, mixed_precision=mixed)
        feeds = {"Learning_Rate": np.array([LR], np.float32)}
        if mixed:
            feeds[sess.loss_scale_input_name] = np.array([1024.0], np.float32)
        runs.append([float(sess.run(["loss"], {**_batch(s), **feeds})[0]) for s in range(STEPS)])
    assert np.all(np.isfinite(runs[1]))
    np.testing.assert_allclose(runs[1], runs[0], rtol=3e-3)
    assert runs[1] != runs[0]  # it did run in float16


def test_on_device_api_sgd_matches_torch(exported: onnx.ModelProto, tmp_path) -> None:
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    params = [t.name for t in exported.graph.initializer]
    folder = str(tmp_path)
    artifacts.generate_artifacts(exported, requires_grad=params, loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=folder)
    training = onnx.load(os.path.join(folder, "training_model.onnx"))
    onnx.checker.check_model(training, full_check=True)
    assert not {"Attention", "RMSNormalization"} & {n.op_type for n in training.graph.node}
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    model = Module(os.path.join(folder, "training_model.onnx"), state,
                   os.path.join(folder, "eval_model.onnx"))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), model)
    opt.set_learning_rate(LR)
    module = _torch_twin({name: p.data for name, p in state.parameters})
    topt = torch.optim.SGD(module.parameters(), lr=LR)
    for step in range(STEPS):
        feeds = _batch(step)
        ours = model(feeds["x"], feeds["target"])
        opt.step()
        model.lazy_reset_grad()
        topt.zero_grad()
        theirs = module(*(torch.from_numpy(v) for v in feeds.values()))
        theirs.backward()
        topt.step()
        assert _rel(ours, theirs.item()) < 1e-5, (step, ours, theirs.item())
    for name, p in state.parameters:
        assert _rel(p.data, dict(module.named_parameters())[name].detach().numpy()) < 1e-5, name
    model.eval()  # the eval model runs the original nodes (the engine expands them too)
    loss = model(_batch(99)["x"], _batch(99)["target"])
    with torch.no_grad():
        want = module(*(torch.from_numpy(v) for v in _batch(99).values())).item()
    assert _rel(loss, want) < 1e-5

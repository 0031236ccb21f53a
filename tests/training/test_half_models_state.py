"""The state of a model whose own weights are float16 or bfloat16 (no mixed precision): get_state/load_state
dtypes, checkpoints (save, load, resume), export for inference, and onnxruntime-training 1.19.2 reading such
a checkpoint.

Oracles: the session's own uninterrupted steps (a reload continues with the same bits); onnxruntime 1.32
running the exported model; onnxruntime-training 1.19.2 (tests/ortt.py) for the README's claim that it cannot
load a checkpoint holding float16 tensors ("Unsupported data type")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

from onnxtrain import TrainingSession
from onnxtrain.checkpoint import Checkpoint, OptimizerGroup, load_checkpoint, save_checkpoint
from tests.graph_transforms.test_half_weights import NP, linear_model, params


def _batch(et: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((6, 4)).astype(np.float32).astype(NP[et]),
            "y": rng.standard_normal((6, 3)).astype(np.float32).astype(NP[et]),
            "Learning_Rate": np.array([0.01], np.float32)}


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        np.testing.assert_array_equal(a[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
@pytest.mark.parametrize("et", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_legacy_half_state_through_a_checkpoint_file(tmp_path: Path, et: int, opt: str) -> None:
    """Weights in their half type, moments float32; the state saved to a checkpoint file and loaded into a
    new session continues with the bits of the session that was never saved."""
    m, _ = linear_model(et)
    a = TrainingSession(m.SerializeToString(), params(opt))
    for s in range(2):
        a.run(["loss"], _batch(et, s))
    state = a.get_state()
    assert state["W"].dtype == state["b"].dtype == NP[et]
    assert all(v.dtype == np.float32 for k, v in state.items() if k.startswith("Moment_"))
    weights = {k: v for k, v in state.items() if k in ("W", "b")}
    rest = {k: v for k, v in state.items() if k not in weights}
    path = tmp_path / "half.ckpt"
    save_checkpoint(Checkpoint(trainable=weights, optimizer_groups=[OptimizerGroup(states={"": rest})]), path)
    back = load_checkpoint(path)
    _same(back.trainable, weights)
    b = TrainingSession(m.SerializeToString(), params(opt))
    b.load_state({**back.trainable, **back.optimizer_groups[0].states[""]}, strict=True)
    _same(b.get_state(), state)
    for s in (2, 3):
        la, lb = (sess.run(["loss"], _batch(et, s))[0] for sess in (a, b))
        assert la.dtype == NP[et] and la.view(np.uint16) == lb.view(np.uint16)
    _same(a.get_state(), b.get_state())


@pytest.mark.parametrize("et", [TensorProto.FLOAT16, TensorProto.BFLOAT16])
def test_legacy_load_state_refuses_a_float32_value_for_a_half_weight(et: int) -> None:
    """A float32 array for a half weight does not fit its type: refused naming the state entry, and the state
    is as it was."""
    m, _ = linear_model(et)
    sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer"))
    before = sess.get_state()
    with pytest.raises(TypeError, match=r"state 'W': expected dtype"):
        sess.load_state({"b": before["b"], "W": before["W"].astype(np.float32)})
    _same(sess.get_state(), before)


def test_legacy_load_state_widens_float16_moments() -> None:
    """float16 moments (a checkpoint of ``use_fp16_moments``) load into a float16 model's float32 moments,
    widened exactly (the README's load_state rule)."""
    m, _ = linear_model(TensorProto.FLOAT16)
    sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer"))
    moment = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3).astype(np.float16)
    sess.load_state({"Moment_1_W": moment})
    got = sess.get_state()["Moment_1_W"]
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, moment.astype(np.float32))


def test_legacy_load_state_widens_bfloat16_moments() -> None:
    m, _ = linear_model(TensorProto.BFLOAT16)
    sess = TrainingSession(m.SerializeToString(), params("AdamOptimizer"))
    moment = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3).astype(ml_dtypes.bfloat16)
    sess.load_state({"Moment_1_W": moment})
    np.testing.assert_array_equal(sess.get_state()["Moment_1_W"], moment.astype(np.float32))


def _ondevice(folder: Path, optimizer: object) -> tuple[object, object, object]:
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer
    from tests.training.test_flat_update import _model

    artifacts.generate_artifacts(_model(np.float16), requires_grad=["W1", "b1", "W2", "b2", "W3"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=optimizer,
                                 artifact_directory=str(folder))
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    return state, module, Optimizer(str(folder / "optimizer_model.onnx"), module)


def test_ondevice_float16_checkpoint_round_trip_and_export(tmp_path: Path) -> None:
    """AdamW on a float16 MLP: the checkpoint saved after a step holds float16 parameters and moments and
    loads back with the same bits; a Module on the reloaded state steps as the original; the inference export
    keeps float16 initializers (the trained bits) and onnxruntime 1.32 runs it."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    state, module, opt = _ondevice(tmp_path, artifacts.OptimType.AdamW)
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((16, 6)).astype(np.float16), rng.integers(0, 3, 16).astype(np.int64))
               for _ in range(3)]
    module(*batches[0])
    opt.step()
    module.lazy_reset_grad()
    CheckpointState.save_checkpoint(state, str(tmp_path / "after1"), include_optimizer_state=True)
    ck = load_checkpoint(tmp_path / "after1")
    assert {v.dtype for v in ck.trainable.values()} == {np.dtype(np.float16)}
    moments = [a for g in ck.optimizer_groups for s in g.states.values() for a in s.values()]
    assert moments and {a.dtype for a in moments} == {np.dtype(np.float16)}
    state2 = CheckpointState.load_checkpoint(str(tmp_path / "after1"))
    module2 = Module(str(tmp_path / "training_model.onnx"), state2, str(tmp_path / "eval_model.onnx"))
    opt2 = Optimizer(str(tmp_path / "optimizer_model.onnx"), module2)
    for mod, o in ((module, opt), (module2, opt2)):
        for b in batches[1:]:
            mod(*b)
            o.step()
            mod.lazy_reset_grad()
    names = ["W1", "b1", "W2", "b2", "W3"]
    for k in names:
        a, b = state.parameters[k].data, state2.parameters[k].data
        assert a.dtype == np.float16
        np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16), err_msg=k)
    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["logits"])
    exported = onnx.load(str(tmp_path / "inference.onnx"))
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    for k in names:
        assert inits[k].dtype == np.float16
        np.testing.assert_array_equal(inits[k].view(np.uint16), state.parameters[k].data.view(np.uint16))
    ort = pytest.importorskip("onnxruntime")
    x = batches[0][0]
    out = ort.InferenceSession(str(tmp_path / "inference.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    assert out.dtype == np.float16 and out.shape == (16, 3) and np.isfinite(out.astype(np.float32)).all()


def test_ortt_cannot_load_a_float16_checkpoint(tmp_path: Path) -> None:
    """The README's claim: onnxruntime-training 1.19.2 refuses a checkpoint holding float16 tensors
    ("Unsupported data type"), ours (generate_artifacts' of a float16 model) included."""
    from tests.ortt import PREAMBLE, ensure_ortt

    python = ensure_ortt()
    from onnxtrain.training import artifacts

    _ondevice(tmp_path, artifacts.OptimType.SGD)
    script = PREAMBLE + (
        "from onnxruntime.training.api import CheckpointState\n"
        "try:\n"
        "    CheckpointState.load_checkpoint(sys.argv[1]); print('loaded')\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e)\n")
    out = subprocess.run([python, "-c", script, os.path.join(str(tmp_path), "checkpoint")],
                         capture_output=True, text=True, timeout=300)
    assert "Unsupported data type: 10" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_cli_resume_of_a_float16_model_is_bit_for_bit(tmp_path: Path) -> None:
    """`onnxtrain train` on a float16 MLP file (Adam, clipping): 2 × 15 steps with --resume end at the weights
    of 30 steps in one run; model.onnx keeps float16."""
    from onnxtrain import zoo

    m = zoo.mlp([64, 32, 10])
    g = m.graph
    for i, t in enumerate(list(g.initializer)):
        if t.data_type == TensorProto.FLOAT:
            g.initializer[i].CopyFrom(
                numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float16), t.name))
    for vi in [*g.input, *g.output, *g.value_info]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, str(tmp_path / "mlp16.onnx"))
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model:\n  path: mlp16.onnx\n"
                   "optimizer:\n  name: adam\n  lr: 2.0e-3\n  clip_grad_norm: 1.0\n"
                   "training:\n  batch_size: 32\n  steps: 30\n  eval_every: 15\n  checkpoint_every: 15\n"
                   "output:\n  plot: false\n")

    def train(out: str, *extra: str) -> None:
        r = subprocess.run([sys.executable, "-m", "onnxtrain", "train", str(cfg), "-q", "--output-dir", out,
                            *extra], capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]

    train(str(tmp_path / "one"))
    train(str(tmp_path / "two"), "--set", "training.steps=15")
    train(str(tmp_path / "two"), "--resume")
    a, b = (onnx.load(str(tmp_path / d / "model.onnx")) for d in ("one", "two"))
    wa = {t.name: numpy_helper.to_array(t) for t in a.graph.initializer}
    wb = {t.name: numpy_helper.to_array(t) for t in b.graph.initializer}
    assert wa.keys() == wb.keys() and {v.dtype for v in wa.values()} == {np.dtype(np.float16)}
    for k in wa:
        np.testing.assert_array_equal(wa[k].view(np.uint16), wb[k].view(np.uint16), err_msg=k)


def test_onnxruntime_backend_refuses_a_bfloat16_model_without_blaming_mixed_precision() -> None:
    pytest.importorskip("onnxruntime")
    from onnxtrain import SessionOptions

    m, _ = linear_model(TensorProto.BFLOAT16)
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    with pytest.raises(Exception, match="bfloat16") as e:
        TrainingSession(m.SerializeToString(), params("SGDOptimizer"), so)
    assert "mixed precision" not in str(e.value)

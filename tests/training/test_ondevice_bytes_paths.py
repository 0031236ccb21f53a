"""File names given as ``bytes`` (``os.fsencode(path)``) to the on-device API, as onnxruntime-training 1.19.2
takes them: its wrappers pass ``os.fspath(name)`` to the binding, which reads bytes as the file's name, for
``Module``'s training and eval models, ``Optimizer``'s model, ``export_model_for_inferencing``'s target,
``CheckpointState``'s load and save and onnxblock's ``save_checkpoint`` and ``load_checkpoint_to_model``.

Oracle: onnxruntime-training 1.19.2 itself (tests/ortt.py) making the same calls, with the same bytes names,
on the artifacts its generator writes: the losses of two training steps and an evaluation, the parameters
after them, the exported model's outputs (run by onnxruntime on both sides' files), the checkpoint
onnxblock wrote and the initializers it loads into a model. onnxtrain's ``Module`` also takes the bytes
of a serialized model (an extension): bytes that name an existing file are read as its name.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest

from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp

# the same calls on either implementation: ``api`` is (CheckpointState, Module, Optimizer, onnxblock)
_DRIVER = r'''
def bytes_calls(api, folder):
    import os
    import numpy as np
    import onnx
    from onnx import numpy_helper
    CheckpointState, Module, Optimizer, onnxblock = api
    b = lambda name: os.fsencode(os.path.join(folder, name))  # noqa: E731
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.standard_normal((5, 3)).astype(np.float32)
    state = CheckpointState.load_checkpoint(b("checkpoint"))
    module = Module(b("training_model.onnx"), state, b("eval_model.onnx"))
    optimizer = Optimizer(b("optimizer_model.onnx"), module)
    optimizer.set_learning_rate(0.05)
    out = {"losses": []}
    for _ in range(2):
        out["losses"].append(float(module(x, y)))
        optimizer.step()
        module.lazy_reset_grad()
    module.eval()
    out["losses"].append(float(module(x, y)))
    out["parameters"] = {n: p.data.tolist() for n, p in state.parameters}
    module.export_model_for_inferencing(b("inference.onnx"), ["output"])
    CheckpointState.save_checkpoint(state, b("saved"), include_optimizer_state=True)
    out["saved"] = {n: p.data.tolist() for n, p in CheckpointState.load_checkpoint(b("saved")).parameters}
    trainable = [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3), "fc2.bias_like")]
    frozen = [numpy_helper.from_array(np.full(3, 7.0, np.float32), "frozen_one")]
    onnxblock.save_checkpoint((trainable, frozen), b("blocks_checkpoint"))
    written = CheckpointState.load_checkpoint(b("blocks_checkpoint"))
    out["blocks_checkpoint"] = {n: [p.requires_grad, p.data.tolist()] for n, p in written.parameters}
    model = onnx.load(os.path.join(folder, "base.onnx"))
    onnxblock.load_checkpoint_to_model(b("saved"), model)
    out["loaded_into_model"] = {t.name: numpy_helper.to_array(t).tolist() for t in model.graph.initializer}
    return out
'''

_NS: dict = {}
exec(compile(_DRIVER, "<driver>", "exec"), _NS)  # noqa: S102 - the same source onnxruntime-training runs

_PEER = PREAMBLE + _DRIVER + r"""
import onnx
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module, Optimizer
base, folder = sys.argv[1:3]
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"],
                             frozen_params=["fc1.bias"], loss=artifacts.LossType.MSELoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
print(json.dumps(bytes_calls((CheckpointState, Module, Optimizer, onnxblock), folder)))
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """onnxruntime-training's results on its artifacts, and the folders of its run and of a fresh copy of
    the artifacts for onnxtrain's."""
    python = ensure_ortt()
    root = tmp_path_factory.mktemp("bytes_paths")
    theirs, ours = str(root / "ortt"), str(root / "onnxtrain")
    for folder in (theirs, ours):
        os.makedirs(folder)
        onnx.save(small_mlp(), os.path.join(folder, "base.onnx"))
    base = os.path.join(ours, "base.onnx")
    # the artifacts as generated, before the peer's run writes its files beside them
    peer_generate = PREAMBLE + r"""
import onnx
from onnxruntime.training import artifacts
base, folder = sys.argv[1:3]
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc1.weight", "fc2.weight", "fc2.bias"],
                             frozen_params=["fc1.bias"], loss=artifacts.LossType.MSELoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
"""
    run_script(peer_generate, base, ours, python=python)
    reference = run_script(_PEER, base, theirs, python=python)
    return reference, theirs, ours


def test_bytes_file_names_work_as_in_onnxruntime_training(runs):
    import onnxruntime as ort

    from onnxtrain.training import onnxblock
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    reference, theirs, ours = runs
    got = _NS["bytes_calls"]((CheckpointState, Module, Optimizer, onnxblock), ours)
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5)
    assert got["parameters"].keys() == reference["parameters"].keys() == reference["loaded_into_model"].keys()
    for name, want in reference["parameters"].items():
        np.testing.assert_allclose(got["parameters"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["saved"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
        np.testing.assert_allclose(got["loaded_into_model"][name], want, rtol=1e-5, atol=1e-6, err_msg=name)
    assert got["blocks_checkpoint"] == reference["blocks_checkpoint"]
    x = np.random.default_rng(4).standard_normal((6, 4)).astype(np.float32)
    outputs = []
    for folder in (ours, theirs):
        sess = ort.InferenceSession(os.path.join(folder, "inference.onnx"),
                                    providers=["CPUExecutionProvider"])
        assert [i.name for i in sess.get_inputs()] == ["input"]
        outputs.append(sess.run(["output"], {"input": x})[0])
    np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-5, atol=1e-6)


def test_bytes_still_carry_a_serialized_model(runs, tmp_path):
    """onnxtrain's extension stays: bytes that name no file are a serialized model; bytes naming a missing
    file are refused as a missing file (onnxruntime-training's NoSuchFile), not as a damaged model."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    _, _, ours = runs
    folder = str(tmp_path / "copy")
    shutil.copytree(ours, folder)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    with open(os.path.join(folder, "training_model.onnx"), "rb") as f:
        module = Module(f.read(), state)
    with open(os.path.join(folder, "optimizer_model.onnx"), "rb") as f:
        Optimizer(f.read(), module)
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    assert np.isfinite(module(x, y))
    missing = os.fsencode(os.path.join(folder, "no_such_model.onnx"))
    with pytest.raises(FileNotFoundError, match="no_such_model.onnx"):
        Module(missing, state)
    with pytest.raises(RuntimeError, match="no_such_model.onnx"):
        Optimizer(missing, module)
    with pytest.raises(ValueError, match="could not be parsed"):
        Module(b"\x08\x07\x12\xff\xff\x00garbage", state)

"""``import onnxtrain`` loads its public names on first use: the on-device API skips the legacy session."""

from __future__ import annotations

import subprocess
import sys

import pytest

import onnxtrain


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_loads_only_the_package():
    code = "import sys, onnxtrain; print(sorted(m for m in sys.modules if m.startswith('onnxtrain')))"
    assert _run(code) == "['onnxtrain']"


def test_command_line_module_loads_neither_numpy_nor_onnx():
    """``onnxtrain`` parses its command line before the heavy imports, so that Ctrl-C while they load is
    caught by its handler (one line, exit 130)."""
    code = "import sys, onnxtrain.cli; print([m for m in ('numpy', 'onnx') if m in sys.modules])"
    assert _run(code) == "[]"


def test_on_device_api_does_not_load_the_legacy_session():
    code = (
        "import sys\n"
        "from onnxtrain import SessionOptions\n"
        "from onnxtrain.training import api, artifacts\n"
        "legacy = ('onnxtrain.session', 'onnxtrain.training_graph', 'onnxtrain.optim',\n"
        "          'onnxtrain.parallel.zero', 'onnxtrain.parallel.adasum', 'onnxtrain.inference')\n"
        "print([m for m in legacy if m in sys.modules], api.Module.__name__, SessionOptions.__name__)"
    )
    assert _run(code) == "[] Module SessionOptions"


def test_sessions_do_not_load_hashlib():
    """hashlib maps OpenSSL's libcrypto (about 4 MiB of RSS, seen in the bench's peak RSS): the sessions,
    the on-device API and checkpoints do without it (the file writer's random names come from os.urandom)."""
    code = (
        "import sys\n"
        "import onnxtrain.session, onnxtrain.inference, onnxtrain.checkpoint, onnxtrain.ir.io\n"
        "from onnxtrain.training import api, artifacts\n"
        "print([m for m in ('hashlib', '_hashlib', 'secrets') if m in sys.modules])"
    )
    assert _run(code) == "[]"


def test_onnxruntime_backend_sessions_do_not_load_the_numpy_engine():
    """A session on the onnxruntime backend imports neither the numpy engine's plan, kernels, control flow
    and node checks nor the gradient rules of ops its graph does not hold (peak RSS: bench/HISTORY.md)."""
    code = (
        "import sys\n"
        "import numpy as np\n"
        "from onnxtrain import InferenceSession, SessionOptions, TrainingSession\n"
        "from tests.session.helpers import batches, mlp_model, params\n"
        "so = SessionOptions()\n"
        "so.add_session_config_entry('onnxtrain.backend', 'onnxruntime')\n"
        "sess = TrainingSession(mlp_model(), params(), so)\n"
        "x, y = batches(1, 4)[0]\n"
        "sess.run(['loss'], {'x': x, 'y': y, 'Learning_Rate': np.array([0.1], np.float32)})\n"
        "InferenceSession(mlp_model(), so).run(None, {'x': x, 'y': y})\n"
        "engine = ['onnxtrain.engine.' + m for m in\n"
        "          ('plan', 'kernels', 'control_flow', 'node_checks', 'batch_split', 'fusion')]\n"
        "rules = [m.rsplit('.', 1)[1] for m in sys.modules if m.startswith('onnxtrain.autodiff.rules.')]\n"
        "print([m for m in engine if m in sys.modules], 'rnn' in rules, 'control_flow' in rules,\n"
        "      'matmul' in rules)"
    )
    assert _run(code) == "[] False False True"


def test_engine_names_resolve_on_first_use():
    code = (
        "import sys, onnxtrain.engine as e\n"
        "before = 'onnxtrain.engine.plan' in sys.modules\n"
        "from onnxtrain.engine.plan import Plan, compile_model\n"
        "from onnxtrain.engine.interface import EngineError\n"
        "print(before, e.Plan is Plan, e.compile_model is compile_model, e.EngineError is EngineError,\n"
        "      set(e.__all__) <= set(dir(e)), hasattr(e, 'no_such_name'),\n"
        "      e.registry.available_ops()[0], e.ort_plan.__name__)"  # submodules, as attributes too
    )
    assert _run(code) == "False True True True True False Abs onnxtrain.engine.ort_plan"


def test_every_public_name_resolves_to_its_defining_object():
    from onnxtrain.capi.options import SessionOptions
    from onnxtrain.session import TrainingSession

    for name in onnxtrain.__all__:
        assert getattr(onnxtrain, name) is not None, name
        assert name in dir(onnxtrain), name
    assert onnxtrain.TrainingSession is TrainingSession
    assert onnxtrain.SessionOptions is SessionOptions
    namespace: dict = {}
    exec("from onnxtrain import *", namespace)
    assert set(onnxtrain.__all__) <= set(namespace)


def test_subpackages_are_attributes_and_unknown_names_raise():
    import onnxtrain.training.api as api

    assert onnxtrain.training.api is api
    assert onnxtrain.checkpoint.__name__ == "onnxtrain.checkpoint"
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = onnxtrain.no_such_name


def test_onnxruntime_backend_sessions_do_not_load_numpy_random(tmp_path):
    """numpy.random imports ``secrets``, hence hashlib and OpenSSL (5.8 MiB of the bench's backend peak RSS):
    a legacy session and a Module + Optimizer on the backend, built and trained, leave it unloaded (the model
    and batches are made here, where numpy.random may load)."""
    import numpy as np
    import onnx

    from onnxtrain.training import artifacts
    from tests.session.helpers import batches, mlp_model

    model = mlp_model()
    onnx.save(model, tmp_path / "model.onnx")
    x, y = batches(1, 4)[0]
    np.savez(tmp_path / "batch.npz", x=x, y=y)
    forward = onnx.load(tmp_path / "model.onnx")  # the logits alone, for the artifacts' own loss
    del forward.graph.node[-1]
    forward.graph.ClearField("output")
    forward.graph.output.append(onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, None))
    del forward.graph.input[1:]
    (tmp_path / "art").mkdir()
    artifacts.generate_artifacts(forward, requires_grad=["W1", "b1", "W2", "b2"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path / "art")
    code = (
        "import sys\n"
        "import numpy as np, onnx\n"
        "from onnxtrain import SessionOptions, TrainingParameters, TrainingSession\n"
        "from onnxtrain.training import api\n"
        f"d = {str(tmp_path)!r}\n"
        "so = SessionOptions()\n"
        "so.add_session_config_entry('onnxtrain.backend', 'onnxruntime')\n"
        "p = TrainingParameters()\n"
        "p.loss_output_name, p.training_optimizer_name = 'loss', 'AdamOptimizer'\n"
        "b = np.load(d + '/batch.npz')\n"
        "sess = TrainingSession(onnx.load(d + '/model.onnx').SerializeToString(), p, so)\n"
        "sess.run(['loss'], {'x': b['x'], 'y': b['y'], 'Learning_Rate': np.array([0.1], np.float32)})\n"
        "state = api.CheckpointState.load_checkpoint(d + '/art/checkpoint')\n"
        "module = api.Module(d + '/art/training_model.onnx', state, session_options=so)\n"
        "opt = api.Optimizer(d + '/art/optimizer_model.onnx', module)\n"
        "module(b['x'], b['y'])\n"
        "opt.step()\n"
        "print([m for m in ('numpy.random', 'secrets', 'hashlib', '_hashlib') if m in sys.modules])"
    )
    assert _run(code) == "[]"

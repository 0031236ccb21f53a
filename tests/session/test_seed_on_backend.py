"""``onnxtrain.set_seed`` on the onnxruntime backend: it reaches onnxruntime's own generators (its Dropout
draws from them), whether onnxruntime was imported before the call or is imported by the backend after it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain import SessionOptions, TrainingSession
from tests.session.helpers import batches, mlp_model, params

pytest.importorskip("onnxruntime")


def _with_dropout() -> onnx.ModelProto:
    """The helpers' MLP with an unseeded Dropout(ratio 0.5, training) after its activation."""
    m = mlp_model()
    g = m.graph
    k = next(i for i, n in enumerate(g.node) if n.op_type == "Relu")
    g.node[k + 1].input[0] = "dropped"
    g.node.insert(k + 1, helper.make_node("Dropout", ["hr", "ratio", "on"], ["dropped", "mask"]))
    g.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                          numpy_helper.from_array(np.array(True), "on")])
    onnx.checker.check_model(m, full_check=True)
    return m


def _losses(seed: int | None, steps: int = 4) -> list[float]:
    """Losses of ``steps`` SGD steps on the backend, ``set_seed(seed)`` called after the session is built."""
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    s = TrainingSession(_with_dropout().SerializeToString(), params("SGDOptimizer"), so)
    if seed is not None:
        onnxtrain.set_seed(seed)
    lr = np.array([0.1], np.float32)
    return [float(s.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0])
            for x, y in batches(steps, 16)]


def test_set_seed_makes_the_backends_dropout_repeat() -> None:
    first, again, other = _losses(5), _losses(5), _losses(6)
    assert first == again
    assert first != other  # the seed is what fixes them: another seed, other masks
    assert len(set(first)) == len(first)


_SCRIPT = textwrap.dedent("""
    import sys
    import numpy as np
    import onnxtrain
    from onnxtrain import SessionOptions, TrainingSession
    from tests.session.helpers import batches, params

    onnxtrain.set_seed(11)
    assert "onnxruntime" not in sys.modules
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    s = TrainingSession(sys.argv[1], params("SGDOptimizer"), so)
    lr = np.array([0.1], np.float32)
    print([float(s.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]) for x, y in batches(3, 16)])
""")


def test_a_seed_set_before_onnxruntime_is_imported_reaches_it(tmp_path) -> None:
    """Two fresh processes that seed before the backend imports onnxruntime draw the same masks."""
    path = str(tmp_path / "dropout.onnx")
    onnx.save(_with_dropout(), path)
    runs = [subprocess.run([sys.executable, "-c", _SCRIPT, path], capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for r in runs:
        assert r.returncode == 0, r.stderr[-2000:]
    assert runs[0].stdout == runs[1].stdout
    assert runs[0].stdout.startswith("[")

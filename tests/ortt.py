"""onnxruntime-training 1.19.2 (and 1.16.3, for the legacy TrainingSession) in their own virtual environments
(they need numpy < 2), made on first use.

The peer tests call ``ensure_ortt()`` (``ensure_ort_legacy()``): it creates /tmp/ortt (/tmp/ortleg) when
missing (about a minute from PyPI) and skips the test with the reason when that cannot be done (no network,
no wheel for this Python). Set ONNXTRAIN_ORTT=0 to skip them without trying, ONNXTRAIN_ORTT_DIR
(ONNXTRAIN_ORT_LEGACY_DIR) to use another folder.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

VENV = os.environ.get("ONNXTRAIN_ORTT_DIR", "/tmp/ortt")
PYTHON = os.path.join(VENV, "bin", "python")
PACKAGES = ["onnxruntime-training==1.19.2", "numpy<2", "onnx"]
_PROBE = "import onnxruntime.capi._pybind_state as c; c.CheckpointState"

# onnxruntime-training 1.16.3: the last release with the legacy TrainingSession binding (removed in 1.17,
# microsoft/onnxruntime#18333); its onnx must be < 1.16 (IR 9 at most), its protobuf < 4.
LEGACY_VENV = os.environ.get("ONNXTRAIN_ORT_LEGACY_DIR", "/tmp/ortleg")
LEGACY_PYTHON = os.path.join(LEGACY_VENV, "bin", "python")
LEGACY_PACKAGES = ["onnxruntime-training==1.16.3", "numpy<2", "onnx<1.16", "protobuf<4"]
_LEGACY_PROBE = "import onnxruntime as o; o.TrainingSession, o.TrainingParameters"


def ensure_ortt() -> str:
    """The 1.19.2 venv's python, creating the venv first if needed; skips the calling test when impossible."""
    return _ensure(VENV, PACKAGES, _PROBE)


def ensure_ort_legacy() -> str:
    """The 1.16.3 venv's python (legacy ``TrainingSession``), made on first use; skips when impossible (no
    wheel for this Python: 1.16.3 has them for 3.8-3.11)."""
    return _ensure(LEGACY_VENV, LEGACY_PACKAGES, _LEGACY_PROBE)


def _ensure(venv: str, packages: list[str], probe: str) -> str:
    python = os.path.join(venv, "bin", "python")
    what = packages[0].replace("==", " ")
    if os.environ.get("ONNXTRAIN_ORTT", "1") == "0":
        pytest.skip("ONNXTRAIN_ORTT=0: onnxruntime-training peer tests disabled")
    with open(venv + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one installer at a time (pytest-xdist, parallel runs)
        if not _works(python, probe):
            try:
                if not os.path.exists(python):
                    subprocess.run(
                        [sys.executable, "-m", "venv", venv], check=True, timeout=120, capture_output=True
                    )
                subprocess.run(
                    [python, "-m", "pip", "install", "-q", *packages],
                    check=True,
                    timeout=900,
                    capture_output=True,
                )
            except (subprocess.SubprocessError, OSError) as e:
                pytest.skip(f"could not install {what} into {venv}: {e}")
            if not _works(python, probe):
                pytest.skip(f"{what} does not import in {venv}")
    return python


def run_script(script: str, *args: str, timeout: float = 600, python: str | None = None) -> Any:
    """Run ``script`` (``python -c``, PREAMBLE included by the caller) in the onnxruntime-training venv
    (``python``, default 1.19.2's) with ``args``, outside this project's path; the JSON value its last
    stdout line prints (None: no output)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python or ensure_ortt(), "-c", script, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]) if lines else None


_WORKING: set[str] = set()  # venv pythons seen to import their onnxruntime-training in this process


def _works(python: str, probe: str) -> bool:
    """Whether the venv's python imports its onnxruntime-training: asked once per process (a check starts
    that python, about a second, and the peer tests call this a few dozen times in a run)."""
    if python in _WORKING:
        return True
    if not os.path.exists(python):
        return False
    r = subprocess.run([python, "-c", probe], capture_output=True, timeout=120)
    if r.returncode == 0:
        _WORKING.add(python)
    return r.returncode == 0


# The first lines of every script run in the venv: onnxruntime.training's optim and amp modules import
# torch (not installed there, not used by the scripts), and onnxruntime 1.19 reads models of IR <= 10
# while the generator stamps onnx's own IR version.
PREAMBLE = r"""
import json, sys, types
for name in ("onnxruntime.training.optim", "onnxruntime.training.amp"):
    sys.modules[name] = types.ModuleType(name)
import onnx
onnx.IR_VERSION = 10


# the checkpoint state, Module and Optimizer (learning rate lr) of the artifacts in folder; the Module
# without the eval model, which onnxruntime-training fails to load for a training-mode BatchNorm
def open_artifacts(folder, lr):
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    state = CheckpointState.load_checkpoint(folder + "/checkpoint")
    m = Module(folder + "/training_model.onnx", state)
    o = Optimizer(folder + "/optimizer_model.onnx", m)
    o.set_learning_rate(lr)
    return state, m, o
"""


def small_mlp() -> onnx.ModelProto:
    """A 4-8-3 MLP (MatMul, Add, Relu; weights fc1/fc2 drawn from seed 0; batch dim "b") at IR 10, which
    onnxruntime-training 1.19.2 loads: the on-device peer tests' model."""
    rng = np.random.default_rng(0)
    shapes = {"fc1.weight": (4, 8), "fc1.bias": (8,), "fc2.weight": (8, 3), "fc2.bias": (3,)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in shapes.items()]
    nodes = [helper.make_node("MatMul", ["input", "fc1.weight"], ["a"]),
             helper.make_node("Add", ["a", "fc1.bias"], ["b"]), helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("MatMul", ["c", "fc2.weight"], ["d"]),
             helper.make_node("Add", ["d", "fc2.bias"], ["output"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["b", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m

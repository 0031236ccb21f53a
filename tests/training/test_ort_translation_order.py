"""The translation of onnxruntime-training's gradient operators names its new values in the nodes' order, not
in the process's string-hash order: the ranks of an ``mpiexec`` run, each with its own hash seed, must
translate one artifact to the same model (the on-device ``Optimizer`` compares the ranks' training models and
refused them; with 3-4 ranks almost every run)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.training.ort_artifacts import translate_training_model

_SCRIPT = r"""
import hashlib, sys
import onnx
from onnxtrain.training.ort_artifacts import translate_training_model
m = translate_training_model(onnx.load(sys.argv[1]))
print(hashlib.sha256(m.SerializeToString(deterministic=True)).hexdigest())
"""


def _grad_model(op: str, n_in: int, **attrs) -> onnx.ModelProto:
    """One com.microsoft gradient operator over float [2, 3, 4, 4] operands."""
    names = [f"i{k}" for k in range(n_in)]
    shape = [2, 3, 4, 4]
    node = helper.make_node(op, names, ["dx"], name="g", domain="com.microsoft", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape)
                                        for n in names],
                          [helper.make_tensor_value_info("dx", TensorProto.FLOAT, shape)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17),
                                               helper.make_opsetid("com.microsoft", 1)])


CASES = {
    "ReluGrad": _grad_model("ReluGrad", 2),
    "TanhGrad": _grad_model("TanhGrad", 2),
    "SoftmaxGrad_13": _grad_model("SoftmaxGrad_13", 2, axis=-1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_translations_do_not_depend_on_the_hash_seed(case: str, tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(CASES[case], path)
    here = translate_training_model(CASES[case]).SerializeToString(deterministic=True)
    here = hashlib.sha256(here).hexdigest()
    digests = set()
    for seed in ("1", "2", "3", "4"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "OPENBLAS_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-c", _SCRIPT, str(path)], capture_output=True, text=True,
                              timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        digests.add(done.stdout.split()[-1])
    assert digests == {here}

"""A node that fails while running raises onnxruntime's class for that failure (onnxtrain's twin of it), so
that a ported ``except InvalidArgument`` / ``except RuntimeException`` clause catches it: onnxruntime's
kernels return INVALID_ARGUMENT for an index out of range in Gather, throw (``RuntimeException`` in
onnxruntime-training 1.16.3 and 1.19.2, ``Fail`` in 1.32) for a Reshape that does not fit, a broadcast of
unequal dims or an axis outside the rank, and fail otherwise. Before, every node failure was a plain
``Fail``. The oracles: 1.16.3 (tests/ortt.py's legacy venv, one process for every case) and the installed
onnxruntime, on the single-node models of tests/engine/node_failure_probes.py.

Where they differ on purpose: a SoftmaxCrossEntropyLoss label outside the classes runs in 1.16.3 (it reads
past the scores) and fails in onnxtrain (and in onnxruntime 1.32, with ``Fail``); a SoftmaxCrossEntropyLoss
label batch of another size is 1.16.3's ``RuntimeException`` (1.32: ``InvalidArgument``).
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import pytest

import onnxtrain
from onnxtrain.capi import onnxruntime_pybind11_state as C
from onnxtrain.engine.failure_classes import OP_CLASSES
from tests.engine import node_failure_probes as probes

PEER_RUNS = {"softmax_cross_entropy_label"}  # 1.16.3 takes a label out of range; onnxtrain refuses it
LATER_CLASSES = {"softmax_cross_entropy_batch": "InvalidArgument"}  # onnxruntime 1.32's, not 1.16.3's


@pytest.fixture(scope="module")
def ours() -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return json.loads(json.dumps(probes.run_cases(onnxtrain)))


def _same(theirs: dict[str, Any], mine: dict[str, Any]) -> bool:
    if "ok" in theirs or "ok" in mine:
        return "ok" in theirs and "ok" in mine
    return theirs["error"] in [mine["error"], *mine["mro"]]


def test_classes_are_onnxruntime_training_1_16_3s(ours) -> None:
    from tests.ortt import ensure_ort_legacy, run_script

    python = ensure_ort_legacy()
    with open(probes.__file__) as f:
        peer = run_script(f.read(), "onnxruntime", python=python)
    assert peer.keys() == ours.keys()
    for name, theirs in peer.items():
        if name in PEER_RUNS:
            assert "ok" in theirs and "RuntimeException" in ours[name]["mro"], (theirs, ours[name])
            continue
        assert _same(theirs, ours[name]), (name, theirs, ours[name])


def test_classes_are_the_installed_onnxruntimes(ours) -> None:
    ort = pytest.importorskip("onnxruntime")
    ort.set_default_logger_severity(3)
    for name, theirs in probes.run_cases(ort).items():
        if name in LATER_CLASSES and "error" in theirs:
            assert theirs["error"] in (LATER_CLASSES[name], "RuntimeException"), theirs
            continue
        assert _same(theirs, ours[name]), (name, theirs, ours[name])


def test_every_op_of_the_table_is_compared() -> None:
    assert set(OP_CLASSES) <= {case[0] for case in probes.CASES.values()}


def test_a_failed_node_is_still_a_fail_naming_the_node_and_op(ours) -> None:
    for name, mine in ours.items():
        if "error" in mine:
            op = probes.CASES[name][0]
            assert {"EngineError", "Fail"} <= {mine["error"], *mine["mro"]}, (name, mine)
            # (a Sum the fusions expand into Adds is named as the graph's Sum, as onnxruntime names it)
            assert "node 'the_node'" in mine["message"] and f"({op})" in mine["message"], (name, mine)


def test_on_the_onnxruntime_backend_the_class_is_onnxruntimes() -> None:
    pytest.importorskip("onnxruntime")
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = probes.run_case(onnxtrain, "gather_index", so)
    assert {"InvalidArgument", "Fail"} <= set(got["mro"]) and "the_node" in got["message"], got


def test_a_ported_except_clause_catches_the_failure() -> None:
    """``except InvalidArgument`` around a run whose Gather index is out of range, as a script written for
    onnxruntime catches it."""
    import numpy as np

    sess = onnxtrain.InferenceSession(probes.model_bytes("gather_index"))
    with pytest.raises(C.InvalidArgument, match=r"node 'the_node' \(Gather\).*index 5"):
        sess.run(None, {"d": np.ones((3, 2), np.float32), "i": np.array([5])})
    with pytest.raises(C.RuntimeException, match=r"node 'the_node' \(Reshape\)"):
        onnxtrain.InferenceSession(probes.model_bytes("reshape_size")).run(
            None, {"d": np.ones((2, 12), np.float32), "s": np.array([5, 7])})


INT_DIV = r"""
import sys
import numpy as np
from onnx import TensorProto, helper
import {module} as ort
g = helper.make_graph([helper.make_node("Div", ["a", "b"], ["o"], name="n")], "g",
                      [helper.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in "ab"],
                      [helper.make_tensor_value_info("o", TensorProto.INT64, [2])])
m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
s = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
try:
    s.run(None, {{"a": np.array([3, 4]), "b": np.array([0, 2])}})
except Exception as e:
    print(type(e).__name__, str(e))
    sys.exit(0)
sys.exit(3)
"""


def test_an_integer_division_by_zero_fails_where_1_16_3_dies() -> None:
    """1.16.3's CPU Div of int64 values divides by the zero (the process ends with SIGFPE: no except clause
    runs); onnxtrain raises, naming the node (a Fail and a RuntimeException, as Div's broadcast failure)."""
    import os
    import signal
    import subprocess
    import sys

    from tests.ortt import ensure_ort_legacy

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    peer = subprocess.run([ensure_ort_legacy(), "-c", INT_DIV.format(module="onnxruntime")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert peer.returncode == -signal.SIGFPE, (peer.returncode, peer.stdout, peer.stderr[-500:])
    ours = subprocess.run([sys.executable, "-c", INT_DIV.format(module="onnxtrain")], capture_output=True,
                          text=True, timeout=120)
    assert ours.returncode == 0 and ours.stdout.startswith("NodeRuntimeException node 'n' (Div)"), ours


@pytest.mark.parametrize("raised", [MemoryError("cannot allocate"), AssertionError("axis 3 is out of range"),
                                    TypeError("unsupported operand")])
@pytest.mark.parametrize("case", ["gather_index", "reshape_size"])
def test_a_kernel_failure_not_caused_by_the_values_is_a_plain_fail(monkeypatch, raised, case) -> None:
    """A MemoryError, an internal AssertionError or a TypeError inside a kernel is not a fault of the
    user's values: it stays a plain ``Fail`` naming the node, not the op's ``InvalidArgument`` /
    ``RuntimeException`` (which onnxruntime raises only for the values its kernel checks, as above)."""
    from onnxtrain.engine import registry

    op, ins, *_ = probes.CASES[case]
    registry.find_kernel(op, 17)  # (loads the kernels before one is replaced)

    def broken(inputs, attrs):
        raise raised

    monkeypatch.setitem(registry._KERNELS, op, [(1, broken)])
    sess = onnxtrain.InferenceSession(probes.model_bytes(case))
    with pytest.raises(C.Fail) as caught:
        sess.run(None, {n: v for n, _, v in ins})
    assert not isinstance(caught.value, (C.InvalidArgument, C.RuntimeException)), type(caught.value).__mro__
    assert caught.value.__cause__ is raised
    assert f"node 'the_node' ({op})" in str(caught.value) and type(raised).__name__ in str(caught.value)

"""The elementwise fusion's build work grows near-linearly with the number of parameters.

The on-device Optimizer of a deep chain (one AdamW graph whose updates form one cluster, tied by the
learning rate, and one segment per weight shape) is built at two sizes, ``n`` and ``4n`` weights: the Python
lines run in the fusion's cluster and segment code (``fusion/elementwise.py``, ``fusion/blocked.py``),
counted by a trace function, while the Optimizer is made (``fuse_elementwise``) and while its first step
traces the cluster (``Cluster._build``, ``Blocked.build``, ``Segment.build``) must grow less than 5× (a
quadratic build grew ~16×, the cubic first step more). Counting lines, not seconds, keeps it independent
of the machine's load.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.fusion import blocked, elementwise
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer

WIDTH, BATCH = 8, 4
SMALL, LARGE = 12, 48  # layers: each a [8, 8] weight and an [8] bias
MAX_GROWTH = 5.0  # line counts at LARGE over SMALL (4× the parameters): ~3.9 now, 7.9-9.5 when quadratic


def _chain(layers: int) -> Any:
    """``x`` through ``layers`` of MatMul, Add (bias), Relu; loss the mean of the squared output."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(layers):
        inits += [
            numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.1).astype(np.float32), f"W{i}"),
            numpy_helper.from_array((rng.standard_normal(WIDTH) * 0.1).astype(np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [cur, f"W{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
            helper.make_node("Relu", [f"a{i}"], [f"r{i}"]),
        ]
        cur = f"r{i}"
    nodes += [helper.make_node("Mul", [cur, cur], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"],
                                                                            keepdims=0)]
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, WIDTH])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _lines_run(fn: Callable[[], Any], files: tuple[str, ...]) -> int:
    """The number of line events in ``files`` while ``fn`` runs on this thread."""
    count = 0

    def local(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal count
        if event == "line":
            count += 1
        return local

    def call(frame: FrameType, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename in files else None

    old = sys.gettrace()
    sys.settrace(call)
    try:
        fn()
    finally:
        sys.settrace(old)
    return count


def _build_counts(layers: int, folder: str) -> tuple[int, int]:
    """Line events of the fusion code while the chain's Optimizer is made, and during its first step."""
    model = _chain(layers)
    params = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(model, requires_grad=params, loss=None, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=folder)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state)
    files = (elementwise.__file__, blocked.__file__)
    made: list[Optimizer] = []
    path = os.path.join(folder, "optimizer_model.onnx")
    construct = _lines_run(lambda: made.append(Optimizer(path, module)), files)
    module(np.ones((BATCH, WIDTH), np.float32))
    first_step = _lines_run(made[0].step, files)
    return construct, first_step


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[int, int]]:
    return {n: _build_counts(n, str(tmp_path_factory.mktemp(f"chain{n}"))) for n in (SMALL, LARGE)}


def test_optimizer_construction_fuses_in_near_linear_work(counts: dict[int, tuple[int, int]]) -> None:
    small, large = counts[SMALL][0], counts[LARGE][0]
    assert small > 0
    assert large / small < MAX_GROWTH, (small, large)


def test_first_step_builds_the_blocked_program_in_near_linear_work(
    counts: dict[int, tuple[int, int]],
) -> None:
    small, large = counts[SMALL][1], counts[LARGE][1]
    assert small > 0
    assert large / small < MAX_GROWTH, (small, large)

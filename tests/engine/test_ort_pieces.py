"""The onnxruntime backend runs a large elementwise graph (an optimizer's update) piece by piece
(:mod:`onnxtrain.engine.ort_chunks`): which graphs qualify, the same values as plain onnxruntime running the
whole graph (the oracle), outputs written into donated arrays, and the memory it saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import ort_chunks
from onnxtrain.engine.backends import make_plan
from onnxtrain.engine.interface import EngineError
from onnxtrain.training import artifacts, onnxblock

SCALARS = {"learning_rate", "step", "loss_scale"}


def _small_pieces(monkeypatch) -> None:
    """Pieces of 100 values, from groups of 1,000 values up (the defaults: 2^18 and 2^20)."""
    monkeypatch.setattr(ort_chunks, "CHUNK_VALUES", 100)
    monkeypatch.setattr(ort_chunks, "CHUNK_FROM", 1000)


def _trained_model() -> onnx.ModelProto:
    """y = (x · W + b) · s, with W 37 × 29, b 29 and s a one-element weight."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((37, 29)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(29).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0.7], np.float32), "s")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Mul", ["a", "s"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 37])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 29])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


# the optimizer graphs: onnxtrain's AdamW and SGD, AdamW clipping the global norm, AdamW of mixed-precision
# artifacts (loss-scaled gradients, the finiteness flag), the last two with reductions (a prefix)
KINDS = ["adamw", "sgd", "adamw-clipped", "adamw-loss-scaled"]


def _artifacts(tmp_path, kind: str = "adamw") -> None:
    optimizer = {"adamw": artifacts.OptimType.AdamW, "sgd": artifacts.OptimType.SGD,
                 "adamw-clipped": onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(0.5)),
                 "adamw-loss-scaled": artifacts.OptimType.AdamW}[kind]
    extra = {"mixed_precision": "float16"} if kind == "adamw-loss-scaled" else {}
    artifacts.generate_artifacts(_trained_model(), requires_grad=["W", "b", "s"],
                                 loss=artifacts.LossType.MSELoss, optimizer=optimizer,
                                 artifact_directory=str(tmp_path), **extra)


def _optimizer_model(tmp_path, kind: str = "adamw") -> onnx.ModelProto:
    _artifacts(tmp_path, kind)
    return onnx.load(os.path.join(tmp_path, "optimizer_model.onnx"))


def _feeds(model: onnx.ModelProto, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {"learning_rate": np.array([0.01], np.float32), "step": np.array([3], np.int64),
             "loss_scale": np.array([1024.0], np.float32)}
    names = {vi.name for vi in model.graph.input}
    feeds = {k: v for k, v in feeds.items() if k in names}
    for vi in model.graph.input:
        if vi.name not in feeds:
            shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
            v = rng.standard_normal(shape).astype(np.float32)
            feeds[vi.name] = np.abs(v) if vi.name.endswith("momentum1") else v
    return feeds


def test_an_adamw_update_falls_into_one_group_per_weight(tmp_path) -> None:
    model = _optimizer_model(tmp_path)
    layout = ort_chunks.chunk_layout(model, SCALARS)
    assert layout is not None
    groups = {}
    for name, k in layout.group.items():
        groups.setdefault(k, set()).add(name)
    assert sorted(sorted(v) for v in groups.values()) == [
        sorted(f"{p}{s}" for p in (w,) for s in ("", "_grad", ".momentum0", ".momentum1", ".out",
                                                  ".momentum0.out", ".momentum1.out"))
        for w in ("W", "b", "s")]
    assert sorted(layout.sizes) == [1, 29, 37 * 29]
    assert "learning_rate" not in layout.group and "step" not in layout.group
    # its pieces cover each group once, in order, the same share of each
    pieces = list(layout.pieces(7))
    for k, n in enumerate(layout.sizes):
        spans = [p[k] for p in pieces]
        assert spans[0][0] == 0 and spans[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    # no reductions: no prefix; the graph onnxruntime runs on pieces is a valid model
    prefix, main = ort_chunks.split_models(model, layout)
    assert prefix is None and len(main.graph.node) == len(model.graph.node)
    onnx.checker.check_model(main, full_check=True)


@pytest.mark.parametrize("kind", ["adamw-clipped", "adamw-loss-scaled"])
def test_a_global_norm_goes_to_a_prefix_run_on_the_whole_arrays(tmp_path, kind: str) -> None:
    model = _optimizer_model(tmp_path, kind)
    layout = ort_chunks.chunk_layout(model, SCALARS)
    assert layout is not None and sorted(layout.sizes) == [1, 29, 37 * 29]
    prefix, main = ort_chunks.split_models(model, layout)
    # the prefix reduces the gradients to scalars; the pieces never reduce
    assert prefix is not None and {o.name for o in prefix.graph.output} == set(layout.reduced)
    assert any(n.op_type == "ReduceSumSquare" for n in prefix.graph.node)
    assert not any(n.op_type in ort_chunks.REDUCTIONS for n in main.graph.node)
    assert {vi.name for vi in prefix.graph.input} <= {"W_grad", "b_grad", "s_grad", "loss_scale"}
    for m in (prefix, main):
        onnx.checker.check_model(m, full_check=True)
    if kind == "adamw-loss-scaled":  # the flag is an output of the prefix
        assert "all_gradients_finite" in layout.reduced
        assert "all_gradients_finite" not in layout.group


def _one_node(op: str, inputs: list, outputs: list, inits: list = (), **attrs) -> onnx.ModelProto:
    g = helper.make_graph([helper.make_node(op, [i.name for i in inputs if i is not None], ["y"], **attrs)],
                          "g", [i for i in inputs if i is not None], outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    return m


def _vi(name: str, shape: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


@pytest.mark.parametrize("case", ["reduction", "mixed shapes", "big constant", "passed through",
                                  "wide scalar", "unknown shape"])
def test_graphs_that_are_not_elementwise_do_not_qualify(case: str) -> None:
    y = _vi("y", [8, 4])
    if case == "reduction":  # over some axes (over all of them it is a reduced scalar: see above)
        m = _one_node("ReduceSumSquare", [_vi("a", [8, 4])], [_vi("y", [8])], keepdims=0, axes=[1])
    elif case == "mixed shapes":  # a broadcast between two grouped values
        m = _one_node("Add", [_vi("a", [8, 4]), _vi("b", [1, 4])], [y])
    elif case == "big constant":
        m = _one_node("Mul", [_vi("a", [8, 4]), _vi("c", [4])], [y],
                      [numpy_helper.from_array(np.ones(4, np.float32), "c")])
    elif case == "passed through":  # an output that is an input
        m = _one_node("Neg", [_vi("a", [8, 4])], [y])
        m.graph.output.append(_vi("a", [8, 4]))
    elif case == "wide scalar":  # one value, but of rank 2: it would widen a flat piece
        m = _one_node("Mul", [_vi("a", [8, 4]), _vi("learning_rate", [1, 1])], [y])
    else:
        m = _one_node("Neg", [_vi("a", ["n", 4])], [y])
    assert ort_chunks.chunk_layout(m, SCALARS) is None
    # a product with a scalar is fine; an output computed from the scalars alone is the prefix's
    ok = _one_node("Mul", [_vi("a", [8, 4]), _vi("learning_rate", [1])], [y])
    ok.graph.node.append(helper.make_node("Neg", ["learning_rate"], ["count"]))
    ok.graph.output.append(_vi("count", [1]))
    layout = ort_chunks.chunk_layout(ok, SCALARS)
    assert layout is not None and layout.group == {"a": 0, "y": 0} and layout.reduced == ("count",)


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_in_pieces_gives_onnxruntimes_values_in_the_donated_arrays(tmp_path, monkeypatch,
                                                                          kind: str) -> None:
    model = _optimizer_model(tmp_path, kind)
    feeds = _feeds(model)
    oracle = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outputs = [v.name for v in model.graph.output]
    want = oracle.run(outputs, feeds)
    # 100 values a piece: W's 1,073 in 11 pieces, b's 29 in pieces of 2-3, s's one value in one of them
    _small_pieces(monkeypatch)
    updates = {o: o[:-len(".out")] for o in outputs if o.endswith(".out")}
    plan = make_plan(model, "onnxruntime", updates=updates, keep_binding=True, scalar_inputs=SCALARS)
    assert plan._chunks is not None and ort_chunks.piece_count(plan._chunks) == 11
    assert (plan._prefix is not None) == (kind in ("adamw-clipped", "adamw-loss-scaled"))
    mine = {k: v.copy() for k, v in feeds.items()}
    got = plan.run(mine, outputs, donate=list(updates.values()))
    for name, a, b in zip(outputs, got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    # the updates came back in the donated arrays (weights, moments, clipped gradients), rewritten in place
    for name, a in zip(outputs, got):
        if name in updates:
            assert a is mine[updates[name]], name
    # without donation: new arrays, the inputs left as they were
    fresh = {k: v.copy() for k, v in feeds.items()}
    got = plan.run(fresh, outputs)
    for name, a, b in zip(outputs, got, want):
        np.testing.assert_array_equal(a, b, err_msg=name)
    for name, v in fresh.items():
        np.testing.assert_array_equal(v, feeds[name], err_msg=name)
    # a subset of the outputs, in another order
    np.testing.assert_array_equal(plan.run(feeds, [outputs[-1], outputs[1]])[1], want[1])
    # a wrong shape is an error naming the input
    bad = {**feeds, "W": np.zeros((29, 37), np.float32)}
    with pytest.raises(EngineError, match="'W'.*37, 29"):
        plan.run(bad, outputs)
    if kind == "adamw-loss-scaled":  # a gradient overflowed: the prefix's flag keeps every value as it was
        inf = {**feeds, "b_grad": feeds["b_grad"].copy()}
        inf["b_grad"][3] = np.inf
        want = oracle.run(outputs, inf)
        got = plan.run({k: v.copy() for k, v in inf.items()}, outputs)
        assert not got[-1] and not want[-1]
        for name, a, b in zip(outputs, got, want):
            np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_array_equal(got[0], feeds["W"])


def test_pieces_can_be_switched_off_and_small_graphs_run_whole(tmp_path, monkeypatch) -> None:
    model = _optimizer_model(tmp_path)
    updates = {v.name: v.name[:-len(".out")] for v in model.graph.output}
    assert make_plan(model, "onnxruntime", updates=updates, scalar_inputs=SCALARS)._chunks is None  # 1 piece
    _small_pieces(monkeypatch)
    assert make_plan(model, "onnxruntime", updates=updates)._chunks is None  # no scalars named: not asked
    monkeypatch.setenv("ONNXTRAIN_ORT_PIECES", "0")
    assert make_plan(model, "onnxruntime", updates=updates, scalar_inputs=SCALARS)._chunks is None


def _train_on(backend: str, folder, x: np.ndarray, t: np.ndarray, steps: int) -> tuple:
    """(losses, W after the steps, the optimizer plan's piece layout) of on-device training on ``backend``
    with the artifacts in ``folder``."""
    import onnxtrain
    from onnxtrain.training import api

    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, session_options=so)
    opt = api.Optimizer(str(folder / "optimizer_model.onnx"), module)
    losses = []
    for _ in range(steps):
        losses.append(float(module(x, t)))
        opt.step()
        module.lazy_reset_grad()
    return losses, state.parameters["W"].data.copy(), getattr(opt._plan, "_chunks", None)


@pytest.mark.parametrize("kind", ["adamw", "adamw-clipped"])
def test_on_device_training_on_the_backend_in_pieces_matches_the_numpy_engine(tmp_path, monkeypatch,
                                                                              kind: str) -> None:

    _artifacts(tmp_path, kind)
    _small_pieces(monkeypatch)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 37)).astype(np.float32)
    t = rng.standard_normal((4, 29)).astype(np.float32)
    runs = {backend: _train_on(backend, tmp_path, x, t, 6) for backend in ("numpy", "onnxruntime")}
    assert runs["onnxruntime"][2] is not None
    np.testing.assert_allclose(runs["onnxruntime"][0], runs["numpy"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["onnxruntime"][1], runs["numpy"][1], rtol=1e-5, atol=1e-6)
    assert runs["numpy"][0][-1] < runs["numpy"][0][0]


_PEAK_CHILD = r"""
import json, os, sys
import numpy as np
import onnx
from onnxtrain.engine.backends import make_plan
model = onnx.load(sys.argv[1])
feeds = {"learning_rate": np.array([0.01], np.float32), "step": np.array([1], np.int64)}
for vi in model.graph.input:
    if vi.name not in feeds:
        feeds[vi.name] = np.full([d.dim_value for d in vi.type.tensor_type.shape.dim], 0.5, np.float32)
outputs = [v.name for v in model.graph.output]
plan = make_plan(model, "onnxruntime", updates={o: o[:-4] for o in outputs}, keep_binding=True,
                 scalar_inputs={"learning_rate", "step"})
def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS")
for _ in range(2):
    plan.run(feeds, outputs, donate=[o[:-4] for o in outputs])
print(json.dumps({"pieces": plan._chunks is not None, "growth_kib": status("VmHWM") - base}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc peak reset")
def test_an_update_in_pieces_holds_no_weight_sized_intermediates(tmp_path) -> None:
    """AdamW over one 2048² weight (16 MiB): run whole, onnxruntime's arena holds weight-sized
    intermediates; in pieces the run's peak grows by less than a weight (the oracle is the whole run)."""
    w = numpy_helper.from_array(np.zeros((2048, 2048), np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                          [_vi("x", [2, 2048])], [_vi("y", [2, 2048])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    artifacts.generate_artifacts(m, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    script = tmp_path / "child.py"
    script.write_text(_PEAK_CHILD)
    growth = {}
    for pieces in ("1", "0"):
        env = {**os.environ, "ONNXTRAIN_ORT_PIECES": pieces, "ONNXTRAIN_ALLOCATOR": "system"}
        done = subprocess.run([sys.executable, str(script), str(tmp_path / "optimizer_model.onnx")],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        r = json.loads(done.stdout.strip().splitlines()[-1])
        assert r["pieces"] == (pieces == "1")
        growth[pieces] = r["growth_kib"] / 1024
    weight_mib = 16
    assert growth["0"] > 2 * weight_mib, growth  # whole: weight-sized intermediates
    assert growth["1"] < weight_mib, growth


def test_an_output_without_a_declared_shape_comes_back_whole(monkeypatch) -> None:
    """y = a · lr + b with y declared of unknown shape: made at its group's shape, piece by piece."""
    nodes = [helper.make_node("Mul", ["a", "learning_rate"], ["t"]),
             helper.make_node("Add", ["t", "b"], ["y"])]
    g = helper.make_graph(nodes, "g", [_vi("learning_rate", [1]), _vi("a", [9, 5]), _vi("b", [9, 5])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    monkeypatch.setattr(ort_chunks, "CHUNK_VALUES", 10)
    monkeypatch.setattr(ort_chunks, "CHUNK_FROM", 20)
    plan = make_plan(m, "onnxruntime", scalar_inputs={"learning_rate"})
    assert plan._chunks is not None and ort_chunks.piece_count(plan._chunks) == 5
    rng = np.random.default_rng(3)
    feeds = {"learning_rate": np.array([0.3], np.float32),
             "a": rng.standard_normal((9, 5)).astype(np.float32),
             "b": rng.standard_normal((9, 5)).astype(np.float32)}
    want = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    got = plan.run(feeds)[0]
    assert got.shape == (9, 5)
    np.testing.assert_array_equal(got, want)


def test_a_module_over_a_weight_of_2_to_the_20_values_updates_in_pieces_by_default(tmp_path) -> None:
    """The default thresholds: a 1024² weight's AdamW runs in 4 pieces on the backend, and trains as the
    numpy engine does."""

    w = numpy_helper.from_array((np.random.default_rng(0).standard_normal((1024, 1024)) * 0.03)
                                .astype(np.float32), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g", [_vi("x", [2, 1024])],
                          [_vi("y", [2, 1024])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 9
    artifacts.generate_artifacts(m, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    x = np.full((2, 1024), 0.5, np.float32)
    t = np.zeros((2, 1024), np.float32)
    runs = {backend: _train_on(backend, tmp_path, x, t, 3) for backend in ("numpy", "onnxruntime")}
    assert runs["onnxruntime"][2] is not None and ort_chunks.piece_count(runs["onnxruntime"][2]) == 4
    np.testing.assert_allclose(runs["onnxruntime"][0], runs["numpy"][0], rtol=1e-5)
    np.testing.assert_allclose(runs["onnxruntime"][1], runs["numpy"][1], rtol=1e-5, atol=1e-6)

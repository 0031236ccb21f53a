"""Random-composition findings on onnxtrain's onnxruntime backend (onnxruntime with its optimizations on),
checked against onnxruntime with its graph optimizations off."""

from __future__ import annotations

import gc

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper

from onnxtrain import InferenceSession, SessionOptions
from onnxtrain.ir.builder import make_model
from tests.engine.random_graphs import RandomGraph, as_float64, check_graph, oracles, random_graph
from tests.tiers import covering

ort = pytest.importorskip("onnxruntime")


def _backend(model: onnx.ModelProto) -> InferenceSession:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    return InferenceSession(model.SerializeToString(), so)


def _plain(model: onnx.ModelProto) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _laid_out(a: np.ndarray, layout: str) -> np.ndarray:
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout == "reversed":
        return a[::-1, ::-1].copy()[::-1, ::-1]
    if layout == "strided":
        big = np.zeros((2 * a.shape[0], 2 * a.shape[1]), a.dtype)
        big[::2, ::2] = a
        return big[::2, ::2]
    raise AssertionError(layout)


# by default each alias and each layout once (tests/tiers.py); every pair with ONNXTRAIN_FULL_TESTS=1
@pytest.mark.parametrize("aliased,layout", covering(["input", "Reshape", "Identity"],
                                                    ["fortran", "reversed", "strided"], strength=1))
def test_an_output_reading_a_converted_feed_keeps_its_values(layout: str, aliased: str) -> None:
    """A graph input that is also a graph output (or whose Reshape/Identity is one), fed as an array the
    backend must make C-contiguous: onnxruntime's output is a view of the bound input, and that was the
    backend's temporary copy, freed after the run, so the output read freed memory (garbage such as 3.7e19
    or the next run's values; 1 graph in ~70 of the random compositions)."""
    x = helper.make_tensor_value_info("x", T.FLOAT, [6, 5])
    nodes = [helper.make_node("Relu", ["x"], ["r"])]
    shown = "x"
    if aliased == "Reshape":
        shape = helper.make_tensor("shape", T.INT64, [2], [5, 6])
        nodes.append(helper.make_node("Reshape", ["x", "shape"], ["s"]))
        shown, inits = "s", [shape]
    else:
        inits = []
        if aliased == "Identity":
            nodes.append(helper.make_node("Identity", ["x"], ["s"]))
            shown = "s"
    outs = [helper.make_tensor_value_info(n, T.FLOAT, None) for n in (shown, "r")]
    model = make_model(helper.make_graph(nodes, "g", [x], outs, inits), 17)
    sess, plain = _backend(model), _plain(model)
    rng = np.random.default_rng(0)
    kept = []
    for k in range(6):  # a feed in another layout, then C-contiguous ones, whose runs reuse freed memory
        a = rng.standard_normal((6, 5)).astype(np.float32)
        got = sess.run(None, {"x": _laid_out(a, layout) if k % 3 == 0 else a})
        kept.append((got, plain.run(None, {"x": a})))
        gc.collect()
    for got, want in kept:
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)


# seeds 47, 203 and 341 pass a graph input through to an output (they failed before the fix above)
SEEDS = [47, 203, 341, *range(2000, 2012)]


@pytest.mark.parametrize("wide", [False, True])
def test_random_compositions_on_the_backend(wide: bool) -> None:
    """A seeded sample of the composition fuzzer (tests/engine/random_graphs.py) through the backend, its
    graphs as drawn and made float64, each run three times on feeds in varied memory layouts, against
    onnxruntime with its optimizations off (the sweep: ~7,000 graphs, float64 and opsets 11-21 too)."""
    problems, checked = [], 0
    for seed in SEEDS:
        rg = random_graph(seed, big=False)
        if wide and rg.dtype is not np.float64:
            feeds = [{n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in f.items()}
                     for f in rg.feeds]
            rg = RandomGraph(as_float64(rg.model), feeds, np.float64, sizes=rg.sizes)
        pair = oracles(rg)
        if pair is None or not isinstance(pair[0], ort.InferenceSession):  # (no float64 Erf in onnxruntime)
            continue
        sess = _backend(rg.model)
        runners = {"backend": lambda f, s=sess: s.run(None, f)}
        problems += [f"seed {seed}: {p}" for p in check_graph(rg, pair[0], runners, pair[1])]
        checked += 1
    assert checked >= len(SEEDS) // 2
    assert not problems, "\n".join(problems[:10])

"""Random compositions of common ops (tests/engine/random_graphs.py) on the numpy engine against onnxruntime:
InferenceSession, the plan the training sessions run (with and without donated feeds) and the unfused plan,
three runs each on new feeds in varied memory layouts, some runs overriding initializers and some graphs
changing a dim's size from run to run. The feeds must come back unchanged and the outputs of earlier runs
must not change in later ones. A small seeded sample of the fuzzer (run it over more seeds by hand); keep it
fast."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.random_graphs import check_graph, oracles, random_graph
from tests.tiers import extended

ort = pytest.importorskip("onnxruntime")

SEEDS_PER_CHUNK = 20
CHUNKS = 5


def _runners(model_bytes: bytes, input_names: list[str]) -> dict:
    import onnxtrain
    from onnxtrain.engine.plan import compile_model

    session = onnxtrain.InferenceSession(model_bytes)
    plan, donor, unfused = compile_model(model_bytes), compile_model(model_bytes), compile_model(model_bytes,
                                                                                                   fuse=False)

    def donating(feeds: dict) -> list:
        own = {n: np.array(a, copy=True) for n, a in feeds.items()}
        return donor.run(own, donate=[n for n in input_names if n in own])

    return {"session": lambda f: session.run(None, f), "plan": plan.run, "plan, donated": donating,
            "plan, unfused": unfused.run}


def _check_seeds(seeds: range, big: bool | None = None) -> None:
    checked, problems = 0, []
    for seed in seeds:
        rg = random_graph(seed, big=big)
        pair = oracles(rg)
        if pair is None:  # onnxruntime refuses the graph (e.g. a LayerNormalization over nothing)
            continue
        model = rg.model.SerializeToString()
        runners = _runners(model, [i.name for i in rg.model.graph.input])
        found = check_graph(rg, pair[0], runners, pair[1])
        problems += [f"seed {seed}: {p}" for p in found]
        checked += 1
    assert checked >= len(seeds) * 0.8
    assert not problems, "\n".join(problems[:20])


# the default suite's chunks (the others with ONNXTRAIN_FULL_TESTS=1, tests/tiers.py): their 60 graphs hold
# each of the 37 op types the 100 do
DEFAULT_CHUNKS = 3


@pytest.mark.parametrize("chunk", [c if c < DEFAULT_CHUNKS else extended(c, id=str(c))
                                   for c in range(CHUNKS)])
def test_random_compositions_match_onnxruntime(chunk: int) -> None:
    _check_seeds(range(10_000 + chunk * SEEDS_PER_CHUNK, 10_000 + (chunk + 1) * SEEDS_PER_CHUNK))


def test_random_compositions_of_large_values_match_onnxruntime() -> None:
    """Values of up to ~300,000 elements: the fused steps' pooled scratch, traced slices and split work."""
    _check_seeds(range(30_000, 30_010), big=True)


REDUCTIONS = ["ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
              "ReduceSumSquare", "ReduceLogSumExp"]


@pytest.mark.parametrize("op", REDUCTIONS)
@pytest.mark.parametrize("opset", [13, 18])
def test_a_reduction_of_a_scalar_over_given_axes_reduces_its_one_element(op: str, opset: int) -> None:
    """Found by the fuzzer (seed 402 of the shape-changing graphs): ``Squeeze`` (no axes) of a value whose
    batch dim became 1 is a scalar, and a later ``ReduceSum(axes=[0])`` of it failed with numpy's AxisError;
    onnxruntime reduces the one element whatever the axes."""
    import onnx
    from onnx import helper, numpy_helper

    import onnxtrain

    axes_first = opset >= 18 or op == "ReduceSum"
    nodes = [helper.make_node("Squeeze", ["x"], ["s"])]
    inits = []
    for k, (axes, keep) in enumerate([([0], 0), ([-1], 1), ([2], 0), ([0, 0], 1)]):
        if axes_first:
            inits.append(numpy_helper.from_array(np.array(axes, np.int64), f"a{k}"))
            nodes.append(helper.make_node(op, ["s", f"a{k}"], [f"y{k}"], keepdims=keep))
        else:
            nodes.append(helper.make_node(op, ["s"], [f"y{k}"], keepdims=keep, axes=axes))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 1])],
        [helper.make_tensor_value_info(f"y{k}", onnx.TensorProto.FLOAT, None) for k in range(4)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]).SerializeToString()
    x = np.array([[-2.5]], np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = onnxtrain.InferenceSession(model).run(None, {"x": x})
    for g, w in zip(got, want):
        assert g.shape == w.shape == ()
        np.testing.assert_allclose(g, w, rtol=1e-6)

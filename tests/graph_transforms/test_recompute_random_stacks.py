"""The legacy session's recompute options on seeded random transformer stacks (tests/engine/random_stacks.py:
pre-LN and post-LN layers, GELU as the op or its erf / tanh forms, seeded attention and MLP Dropouts).

Recompute must not change values: on the numpy engine the losses, weights and Adam moments after 20 steps are
the same bits as without it; on the onnxruntime backend (float32 models) too with onnxruntime's basic
optimizations, and within onnxruntime's fusions' rounding with all of them. A rebuilt Dropout output is
checked against onnxruntime's Dropout on that backend directly.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.engine.random_models import compare, run_legacy
from tests.engine.random_stacks import make_stack
from tests.tiers import extended

OPTIONS = {
    "gelu": {"gelu_recompute": True},
    "attn_dropout": {"attn_dropout_recompute": True},
    "layers": {"transformer_layer_recompute": True},
    "first_layer": {"transformer_layer_recompute": True, "number_recompute_layers": 1},
    "all": {"gelu_recompute": True, "attn_dropout_recompute": True, "transformer_layer_recompute": True},
}


def _run(case, backend: str, opt: str, **params):
    lr = 0.05 if opt == "SGDOptimizer" else 0.01
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # options that select nothing in a stack say so
        return run_legacy(case, backend, opt, lr, **params)


# 2 and 3 layers, pre-LN and post-LN, each GELU form, attention Dropout 0 / 0.1 / 0.25, float16 (seed 6)
NUMPY_SAMPLE = [(0, "SGDOptimizer"), (1, "AdamOptimizer"), (3, "SGDOptimizer"), (6, "AdamOptimizer"),
                (8, "AdamOptimizer"), (13, "SGDOptimizer")]
# the default suite's part of each sample (the rest with ONNXTRAIN_FULL_TESTS=1, tests/tiers.py): on numpy
# both layer counts, LN placements, GELU forms and optimizers, Dropout 0 / 0.1 / 0.25, float16; on the
# backend every seed once over its two tests, the two that failed before with basic optimizations
NUMPY_DEFAULT = {0, 6, 8}
BASIC_DEFAULT = {1, 3}
ALL_DEFAULT = {9, 0}


def _tiered(sample: list[tuple[int, str]], default: set[int]) -> list:
    return [pytest.param(seed, opt) if seed in default else extended(seed, opt, id=f"{seed}-{opt}")
            for seed, opt in sample]


@pytest.mark.parametrize(("seed", "opt"), _tiered(NUMPY_SAMPLE, NUMPY_DEFAULT))
def test_recompute_keeps_the_bits_on_the_numpy_engine(seed: int, opt: str) -> None:
    case = make_stack(seed)
    ref = _run(case, "numpy", opt)
    for label, params in OPTIONS.items():
        got = _run(case, "numpy", opt, **params)
        assert np.array_equal(ref.losses, got.losses), (case.describe(), label)
        for k, v in ref.state.items():
            assert np.array_equal(v, got.state[k]), (case.describe(), label, k)


# float32 stacks with attention Dropout (0.25, 0.1, 0.1 with an MLP Dropout; seed 0 without): before the
# backend's rebuilds divided as its Dropout kernel does, attn_dropout_recompute ended 1e-5 (seed 1, Adam's
# moments) to 3e-5 (seed 3, the loss) off the same session without it
BACKEND_SAMPLE = [(1, "SGDOptimizer"), (3, "AdamOptimizer"), (9, "SGDOptimizer"), (0, "AdamOptimizer")]


def _level(monkeypatch: pytest.MonkeyPatch, level: str | None) -> None:
    """The sessions run_legacy makes take onnxruntime's graph optimization ``level`` (None: its default)."""
    import tests.engine.random_models as rm
    from onnxtrain import GraphOptimizationLevel

    made = rm._options

    def options(backend: str):
        so = made(backend)
        if level is not None:
            so.graph_optimization_level = getattr(GraphOptimizationLevel, level)
        return so

    monkeypatch.setattr(rm, "_options", options)


@pytest.mark.parametrize(("seed", "opt"), _tiered(BACKEND_SAMPLE, BASIC_DEFAULT))
def test_recompute_keeps_the_bits_on_the_backend_with_basic_optimizations(
        seed: int, opt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With onnxruntime's basic optimizations the recomputed graph runs the forward nodes as the plain one
    does: the same bits (float32 models)."""
    pytest.importorskip("onnxruntime")
    _level(monkeypatch, "ORT_ENABLE_BASIC")
    case = make_stack(seed)
    assert case.dtype == np.float32
    ref = _run(case, "onnxruntime", opt)
    for label, params in OPTIONS.items():
        errors = compare(ref, _run(case, "onnxruntime", opt, **params))
        worst = max(errors, key=errors.get)
        assert errors[worst] == 0.0, (case.describe(), label, worst, errors[worst])


@pytest.mark.parametrize(("seed", "opt"), _tiered(BACKEND_SAMPLE, ALL_DEFAULT))
def test_recompute_on_the_backend_with_all_optimizations(seed: int, opt: str) -> None:
    """With all of onnxruntime's optimizations (the backend's default) the forward of a recomputed graph
    takes fusions the plain graph cannot (SkipLayerNormalization, FastGelu: the backward no longer reads
    their intermediates), whose float32 rounding differs: within 5e-5 after 20 steps (2.1e-5 the worst of
    12 stacks, Adam's first moments), 1e-6 where no layer is recomputed."""
    pytest.importorskip("onnxruntime")
    case = make_stack(seed)
    ref = _run(case, "onnxruntime", opt)
    for label, params in OPTIONS.items():
        errors = compare(ref, _run(case, "onnxruntime", opt, **params))
        worst = max(errors, key=errors.get)
        bound = 5e-5 if "transformer_layer_recompute" in params else 1e-6
        assert errors[worst] <= bound, (case.describe(), label, worst, errors[worst])


def _dropout_and_rebuild(dtype: np.dtype, ratio: float, fed_mode: bool) -> onnx.ModelProto:
    """y = Dropout(x) and its rebuild from the mask as the attention-dropout recompute makes it, both
    outputs, through the legacy gradient graph's recompute pass."""
    from onnxtrain.graph_transforms.recompute import recompute_values

    et = helper.np_dtype_to_tensor_dtype(dtype)
    nodes = [helper.make_node("Dropout", ["x", "r", "t"], ["y", "mask"], seed=5),
             helper.make_node("Identity", ["y"], ["y_forward"]),
             helper.make_node("Mul", ["y", "y"], ["sq"]),
             helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
             helper.make_node("Identity", ["y"], ["y_back"], name="backward")]
    inits = [numpy_helper.from_array(np.array(ratio, np.float32), "r")]
    inputs = [helper.make_tensor_value_info("x", et, [4, 257])]
    if fed_mode:
        inputs.append(helper.make_tensor_value_info("t", TensorProto.BOOL, []))
    else:
        inits.append(numpy_helper.from_array(np.array(True), "t"))
    outputs = [helper.make_tensor_value_info(n, et, None) for n in ("loss", "y_forward", "y_back")]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    rebuilt = recompute_values(model, "loss", {"y"})
    assert any(o.endswith("_recompute") for n in rebuilt.graph.node for o in n.output)
    return rebuilt


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("ratio", [0.1, 0.25, 0.3, 0.7])
@pytest.mark.parametrize("fed_mode", [False, True])
def test_a_rebuilt_dropout_is_the_dropout_on_the_backend(dtype: np.dtype, ratio: float,
                                                         fed_mode: bool) -> None:
    """The rebuild (y_back, from x and the mask) against onnxruntime's own Dropout output (y), bit for bit,
    on the onnxruntime backend; and on the numpy engine against its kernel."""
    pytest.importorskip("onnxruntime")
    from onnxtrain import InferenceSession
    from tests.engine.random_models import _options

    model = _dropout_and_rebuild(np.dtype(dtype), ratio, fed_mode)
    x = np.random.default_rng(1).standard_normal((4, 257)).astype(dtype)
    feed = {"x": x, **({"t": np.array(True)} if fed_mode else {})}
    for backend in ("onnxruntime", "numpy"):
        _, y, y_back = InferenceSession(model.SerializeToString(), _options(backend)).run(None, feed)
        assert 0 < np.count_nonzero(y) < y.size
        assert np.array_equal(y, y_back), (backend, int(np.sum(y != y_back)))

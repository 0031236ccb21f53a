"""The graphs onnxtrain exports for seeded random training models (tests/engine/random_models.py, the
transformer stacks of tests/engine/random_stacks.py) are portable ONNX: the GradientGraphBuilder's model and
the legacy session's dumps (model_after_graph_transforms_path, model_with_gradient_graph_path,
model_with_training_graph_path, SessionOptions.optimized_model_filepath) with SGD, Adam (clipping), Adam over
accumulated steps, Lamb, the recompute options and gradients as outputs pass onnx.checker's full check, use
the default domain only, and run in plain onnxruntime with all its optimizations (ORT_ENABLE_ALL), on the
feeds the model takes (the dumps' state and training_mode as initializers), to the numpy engine's values on
the same file (relative 1e-5; float16 models 2e-2).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from onnxtrain import GradientGraphBuilder, InferenceSession
from tests.engine.random_models import _options, legacy_session, make_case, rel
from tests.engine.random_stacks import make_stack
from tests.tiers import extended

ort = pytest.importorskip("onnxruntime")

CONFIGS = {
    "sgd": ("SGDOptimizer", {}),
    "adam": ("AdamOptimizer", {}),
    "adam_accumulate": ("AdamOptimizer", {"gradient_accumulation_steps": 2}),
    "lamb": ("LambOptimizer", {}),
    "adam_recompute": ("AdamOptimizer", {"gelu_recompute": True, "attn_dropout_recompute": True,
                                         "transformer_layer_recompute": True}),
    "sgd_grads_accumulate": ("SGDOptimizer", {"set_gradients_as_graph_outputs": True,
                                              "gradient_accumulation_steps": 3}),
}
DUMPS = ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
         "model_with_training_graph_path", "optimized_model_filepath")


def _domains(model: onnx.ModelProto) -> set[str]:
    found = {o.domain for o in model.opset_import}

    def walk(g: onnx.GraphProto) -> None:
        for n in g.node:
            found.add(n.domain)
            for a in n.attribute:
                if a.type == onnx.AttributeProto.GRAPH:
                    walk(a.g)
                for sub in a.graphs:
                    walk(sub)

    walk(model.graph)
    return found


def check_portable(model: onnx.ModelProto, feed: dict[str, np.ndarray], tol: float, label: str) -> None:
    """Checker, domains, and plain onnxruntime (all optimizations) against the numpy engine."""
    onnx.checker.check_model(model, full_check=True)
    assert _domains(model) <= {"", "ai.onnx"}, (label, _domains(model))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    theirs = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    wanted = {i.name for i in theirs.get_inputs()}
    feed = {k: v for k, v in feed.items() if k in wanted}
    got = theirs.run(None, feed)
    ours = InferenceSession(model.SerializeToString(), _options("numpy")).run(None, feed)
    for out, a, b in zip(theirs.get_outputs(), got, ours):
        if a.dtype == np.bool_:
            continue  # Group_Accumulated_Gradients: a barrier, its value means nothing
        assert rel(b, a) <= tol, (label, out.name, rel(b, a))


def _case(kind: str, seed: int):
    return make_case(seed) if kind == "model" else make_stack(seed)


def _tol(case) -> float:
    return 2e-2 if case.dtype == np.float16 else 1e-5


# float32: an attention block with a Dropout of ratio 0 (its graphs take training_mode: its dumps failed in
# onnxruntime, 'Required inputs ([training_mode]) are missing'), an MLP with two, a CNN (MaxPool with
# Indices, BatchNormalization in training mode), a 2-layer transformer stack without dropping Dropouts;
# float16: attention blocks and a CNN whose gradients scatter-add in float16 (a Gather's, a cross-entropy's,
# a MaxPool's: onnxruntime's CPU provider has no float16 ScatterND/ScatterElements with a reduction, so the
# dumps with gradients failed to run there)
SAMPLE = [("model", 8), ("model", 11), ("model", 6), ("stack", 0), ("model", 17), ("model", 22),
          ("model", 31)]
# the default suite runs each model with two of the configs, each config with two models or more (the
# recompute ones with the attention models); ONNXTRAIN_FULL_TESTS=1 runs every pair (tests/tiers.py)
DEFAULT_CONFIGS = {
    ("model", 8): ("adam_recompute", "sgd_grads_accumulate"), ("model", 11): ("sgd", "adam_accumulate"),
    ("model", 6): ("adam", "sgd_grads_accumulate"), ("stack", 0): ("adam_recompute", "lamb"),
    ("model", 17): ("adam", "sgd_grads_accumulate"), ("model", 22): ("lamb", "adam_accumulate"),
    ("model", 31): ("sgd", "adam_recompute"),
}


def _dump_params() -> list:
    cases = [(kind, seed, label) for kind, seed in SAMPLE for label in CONFIGS]
    return [pytest.param(*c, id="-".join(map(str, c))) if c[2] in DEFAULT_CONFIGS[c[:2]]
            else extended(*c, id="-".join(map(str, c))) for c in cases]


@pytest.mark.parametrize(("kind", "seed", "label"), _dump_params())
def test_session_dumps_run_in_onnxruntime(kind: str, seed: int, label: str, tmp_path) -> None:
    case = _case(kind, seed)
    feed = {**case.feeds[0], "Learning_Rate": np.array([0.01], np.float32)}
    opt, params = CONFIGS[label]
    paths = {d: str(tmp_path / f"{label}_{d}.onnx") for d in DUMPS}
    so = _options("numpy")
    so.optimized_model_filepath = paths[DUMPS[3]]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # recompute options that select nothing
        legacy_session(case, "numpy", opt, options=so, **params, **{d: paths[d] for d in DUMPS[:3]})
    for d, path in paths.items():
        assert os.path.exists(path), (label, d)
        check_portable(onnx.load(path), feed, _tol(case), f"{case.describe()} {label} {d}")


@pytest.mark.parametrize(("kind", "seed"), [*SAMPLE, ("model", 1), ("model", 5), ("model", 90)])
def test_gradient_graph_builder_runs_in_onnxruntime(kind: str, seed: int) -> None:
    case = _case(kind, seed)
    trained = {t.name for t in case.with_loss.graph.initializer
               if t.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16) and "bn_" not in t.name
               and t.name not in case.no_train}
    b = GradientGraphBuilder(case.with_loss.SerializeToString(), {"loss"}, trained, "loss")
    b.build()
    model = onnx.load_from_string(b.get_model())
    try:  # a model onnxruntime cannot run itself (seed 1's ConvTranspose) is no matter of the builder's
        ort.InferenceSession(case.with_loss.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, case.feeds[0])
    except Exception:  # noqa: BLE001
        onnx.checker.check_model(model, full_check=True)
        return
    check_portable(model, case.feeds[0], _tol(case), case.describe())

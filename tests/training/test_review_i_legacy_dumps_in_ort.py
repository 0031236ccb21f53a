"""The legacy TrainingSession's dumped graphs of torch.nn layers in series, run in onnxruntime (review I).

tests/graphs/test_emitted_models.py checks the legacy session's three dumps (after the graph transforms,
with the gradient graph, with the training graph) over the zoo's models. Here the layers-in-series models of
``tests/autodiff/test_review_i_layers_in_ort.py`` (their loss Σ y·r as the model's output), exported by
TorchScript and dynamo, go through the session with Adam, Lamb with gradient accumulation, SGD with the
gradients as graph outputs and memory-efficient LayerNorm gradients, Adam under float16 mixed precision,
and Adam with gradient-norm clipping and transformer-layer recompute: every dump passes the full check,
imports the default domain only, and gives in onnxruntime's inference package the numpy engine's outputs
(tests/graphs/emitted.py's ``check_emitted``: 1e-4, 5 % under mixed precision; a gradient that is float32
rounding noise, such as a ConvTranspose bias before an InstanceNorm, compared absolutely to 1e-2 per element's
root mean square; an Adam/Lamb weight whose gradient is such noise within a step of the learning rate's size).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest

from tests.tiers import extended

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

from onnxtrain import TrainingParameters  # noqa: E402
from onnxtrain.session import TrainingSession  # noqa: E402
from tests.autodiff.test_review_i_layers_in_ort import (  # noqa: E402
    MODELS,
    Weighted,
    _weights,
    export,
    make,
    standard_only,
)
from tests.engine.random_models import _options  # noqa: E402
from tests.graphs.emitted import check_emitted, feeds_for  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LR = np.array([0.01], np.float32)
STEP = 2 * float(LR[0]) * 0.1 / np.sqrt(0.001)  # an Adam/Lamb step on a weight whose gradient is noise
DUMPS = ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
         "model_with_training_graph_path")
CONFIGS = {
    "adam": ("AdamOptimizer", {}),
    "lamb_accumulate": ("LambOptimizer", {"gradient_accumulation_steps": 2}),
    "sgd_grads_out": ("SGDOptimizer", {"set_gradients_as_graph_outputs": True,
                                       "use_memory_efficient_gradient": True}),
    "adam_mixed": ("AdamOptimizer", {"use_mixed_precision": True}),
    "adam_clip_recompute": ("AdamOptimizer", {"enable_grad_norm_clip": True,
                                              "transformer_layer_recompute": True}),
}
DEFAULT = [("emb_mha_gru", "torchscript", 17, "adam_mixed"), ("conv2d", "torchscript", 17, "sgd_grads_out"),
           ("bilstm", "dynamo", 18, "lamb_accumulate")]
CASES = [*DEFAULT,
         *(extended(n, e, o, c) for n in MODELS for e, o in (("torchscript", 17), ("dynamo", 18))
           for c in CONFIGS if (n, e, o, c) not in DEFAULT and not (n == "pads" and e == "torchscript"))]


@pytest.mark.parametrize(("name", "exporter", "opset", "config"), CASES)
def test_legacy_dumps_run_in_onnxruntime(name: str, exporter: str, opset: int, config: str, tmp_path) -> None:
    body, args = make(name)
    r = _weights(body, args, 1)
    loss_module = Weighted(body)
    model = export(loss_module, (*args, r), exporter, opset)
    inits = {t.name for t in model.graph.initializer}
    opt, options = CONFIGS[config]
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = model.graph.output[0].name, opt
    p.weights_to_train = {n for n, _ in copy.deepcopy(loss_module).named_parameters() if n in inits}
    for k, v in options.items():
        setattr(p, k, v)
    paths = {k: str(tmp_path / f"{k}.onnx") for k in DUMPS}
    for k, path in paths.items():
        setattr(p, k, path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a recompute option that finds nothing to recompute
        TrainingSession(model.SerializeToString(), p, _options("numpy"))
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    feeds = {n: a.numpy() for n, a in zip(inputs, (*args, r))}
    half = options.get("use_mixed_precision", False)
    for kind, path in paths.items():
        dump = onnx.load(path)
        label = f"{name} {exporter} {opset} {config} {kind}"
        standard_only(dump, label)
        check_emitted(dump, feeds_for(dump, {**feeds, "Learning_Rate": LR}), label,
                      tol=5e-2 if half else 1e-4, floor=1e-2, step=STEP)

"""Every peer of the bench trains the same parameters: each of the torch module's parameters is an initializer
of its own in both exports (bench/models.prepare), so that onnxtrain's and onnxruntime-training's peers train
it as torch eager does. The TorchScript exporter merges initializers of equal values: left at their
defaults, a transformer's LayerNorm scales (all ones) and zero biases became one tensor shared by every
layer, trained as one."""

from __future__ import annotations

import json

import onnx
import pytest

torch = pytest.importorskip("torch")

from bench import models  # noqa: E402


@pytest.mark.parametrize("case", models.ALL_CASES, ids=lambda c: c.key)
def test_every_torch_parameter_is_its_own_initializer(case: models.Case, tmp_path) -> None:
    paths = models.prepare(case, str(tmp_path / case.key))
    module = case.build()
    module.load_state_dict(torch.load(paths["weights"]))
    names = [n for n, _ in module.named_parameters()]
    with open(paths["params"]) as f:
        params = json.load(f)
    assert params["model"] == names
    assert params["loss_model"] == [f"model.{n}" for n in names]
    for path, prefix in ((paths["model"], ""), (paths["loss_model"], "model.")):
        inits = {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
        for n, p in module.named_parameters():
            assert (inits[prefix + n] == p.detach().numpy()).all(), n  # the values torch trains from

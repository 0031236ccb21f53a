"""onnxtrain against torch's ModuleInfo database (``module_db``): forward values and float64 gradients of
each ``torch.nn`` module's samples, exported by the TorchScript exporter
(``tests/autodiff/moduledb_exports.py`` builds and classifies the cases).

Where ``test_torch_layers_audit.py`` and ``test_torch_module_gradients.py`` take one or two hand-made
configurations per layer, module_db brings the constructor variants torch tests its modules with: padding
modes, groups and dilation, reductions, class weights and ignore_index, label smoothing, batch_first,
norm_first, key_padding_mask and attn_mask, add_bias_kv, bidirectional and projected LSTMs, unbatched
inputs, and so on.

Each sample's module is built in float64 under a fixed seed (a Lazy* module materialised by one forward),
put in training mode for training samples (exported with ``TrainingMode.TRAINING``) or eval mode (exported
as it is, the wrapper marked training so that the exporter does not merge parameters of equal values into
one initializer); eval samples run only for modules torch says behave differently in eval (the others' are
the same samples). Where torch's exporter refuses the float64 sample but writes its float32 one (a float64
attention mask: the Transformer layers' masks), the case runs in float32. Forward: ``onnxtrain
.InferenceSession`` on the export against torch's outputs (rtol 1e-9 in float64, 2e-5 in float32).
Gradients: the gradient graph (``build_gradient_model``) of Σᵢ sum(outᵢ·wᵢ), fixed random wᵢ, w.r.t. every
parameter (an initializer of the export) and every float input that torch differentiates, against
``torch.autograd.grad`` (rtol 1e-7 and atol 1e-9 times the gradient's magnitude in float64; 1e-4 and 1e-5
in float32); the gradient graph passes ``onnx.checker``'s full check.

A case torch's exporter cannot write, whose export is not valid ONNX, or whose export computes something else
than torch (onnxruntime, run on the float32 export where it has no float64 kernel, agrees with onnxtrain
and not with torch; a 0-dim value computed in float32; a NaN loss, from torch's KLDivLoss samples, under
which the export's function and torch's differ only in the gradient) is skipped with the reason: the
exporter's fault. So is a difference the README lists (``documented``: a float64 export keeps ONNX's float32
attributes, SELU's alpha and gamma and HardSwish's 1/6). FractionalMaxPool (random regions) is not exported,
nor the unbatched CircularPad2d/3d samples (torch's exporter aborts the process on them); a module whose
training forward is random (dropout) is skipped by the harness; module_db has no CUDA-only entry on the CPU.
Where torch's gradient and onnxtrain's differ, central differences of the export decide whose is the
derivative. The counts over every case are in the README (torch's ModuleInfo database).

The default suite runs ``DEFAULT``, a fixed set of samples chosen for the variants above; with
``ONNXTRAIN_FULL_TESTS=1`` every sample of every module.
"""

from __future__ import annotations

import pytest

from tests import tiers

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's module_db imports it
moduledb = pytest.importorskip("tests.autodiff.moduledb_exports")

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# (module, training, sample index): run by default
DEFAULT = (
    ("nn.Conv2d", True, 1),  # groups, dilation, padding mode
    ("nn.Conv3d", True, 2),  # no batch dim
    ("nn.LazyConvTranspose2d", True, 0),
    ("nn.BatchNorm2d", True, 2),  # momentum
    ("nn.BatchNorm1d", False, 0),  # running statistics
    ("nn.InstanceNorm2d", False, 1),  # tracking running statistics
    ("nn.GroupNorm", True, 7),  # affine without bias
    ("nn.LayerNorm", True, 6),  # no bias
    ("nn.LocalResponseNorm", True, 1),  # uneven padding
    ("nn.MaxPool3d", True, 2),  # stride and padding
    ("nn.MaxPool1d", True, 2),  # return_indices
    ("nn.AvgPool2d", True, 3),  # stride and padding
    ("nn.AdaptiveMaxPool3d", True, 4),
    ("nn.LPPool2d", True, 0),
    ("nn.NLLLoss", True, 13),  # ignore_index, N-d
    ("nn.CrossEntropyLoss", True, 79),  # class weights, no reduction
    ("nn.CrossEntropyLoss", True, 20),  # ignore_index
    ("nn.BCEWithLogitsLoss", True, 4),  # weights
    ("nn.GaussianNLLLoss", True, 4),  # homoscedastic
    ("nn.MultiLabelSoftMarginLoss", True, 0),
    ("nn.Embedding", True, 1),
    ("nn.PReLU", True, 5),  # a slope per channel
    ("nn.CircularPad2d", True, 1),
    ("nn.ReflectionPad3d", True, 0),
    ("nn.GRU", True, 15),  # bidirectional, batch_first
    ("nn.LSTM", True, 29),  # bidirectional, batch_first, initial state
    ("nn.LSTMCell", True, 1),
    ("nn.MultiheadAttention", True, 14),  # key_padding_mask and attn_mask, add_bias_kv
    ("nn.TransformerEncoderLayer", True, 35),  # norm_first
    ("nn.TransformerEncoderLayer", False, 27),  # masks (float32: the exporter refuses float64 masks)
    ("nn.Hardswish", True, 1),  # documented: ONNX's 1/6 in float32
)

# onnxtrain refusals, by module: the reason (none)
REFUSED: dict[str, str] = {}


def _cases() -> list[object]:
    cases: list[object] = [pytest.param(n, t, i, id=f"{n[3:]}-{'train' if t else 'eval'}-{i}")
                           for n, t, i in DEFAULT]
    if not tiers.full():
        return cases
    for name, training, index in moduledb.cases():
        if (name, training, index) not in DEFAULT:
            cases.append(tiers.extended(name, training, index, id=moduledb.case_id(name, training, index)))
    return cases


@pytest.mark.parametrize(("name", "training", "index"), _cases())
def test_module_sample(name: str, training: bool, index: int) -> None:
    """The sample's forward on onnxtrain equals torch's, and so do its float64 gradients."""
    outcomes = moduledb.check(name, training, index)
    faults = [f"{what}: {o.detail}" for what, o in outcomes.items()
              if o.kind == "disagrees" or (o.kind == "refused" and name not in REFUSED)]
    assert not faults, f"{name} sample {index} ({'train' if training else 'eval'}):\n  " + "\n  ".join(faults)
    skipped = [f"{what}: {o.detail}"[:300] for what, o in outcomes.items()
               if o.kind in ("export", "documented")]
    if skipped:
        pytest.skip("; ".join(skipped))

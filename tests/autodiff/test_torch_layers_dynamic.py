"""The torch layer audit (``test_torch_layers_audit.py``) with every input dim dynamic.

A representative subset of the audit's cases (each family: convolutions 1/2/3-D with transposed ones and
padding modes, pools with ceil mode and adaptive ones, resizes, normalizations, pads, activations,
attention and transformer layers, recurrent cells, embeddings, losses with reductions) is exported with
every dim of every input dynamic (TorchScript: ``dynamic_axes`` naming each axis, channels and features
included; dynamo: ``dynamic_shapes`` of ``Dim.AUTO``, which keeps static the dims the module fixes),
differentiated once by ``build_gradient_model`` (the gradient graph
passes ``onnx.checker.check_model(full_check=True)``) and run on onnxtrain's engine at TWO input sizes
(SIZES: the first is the export's), each compared with torch autograd on the same module, in float64 where
the audit uses float64 and with the audit's tolerances.

The audit's layer cases weigh the layer's output by a fixed buffer of its static shape; here the weights
are an extra input ``r`` of the output's shape (dynamic as well, not differentiated), drawn at each size.
The case table, module construction, export, input naming, tolerances, FLOAT32, EXPORT_WRONG and NO_GRAD
are the audit's; EXPORT_WRONG_DYNAMIC adds the exports that are torch's function only at the export's size
(onnxruntime fails or agrees with onnxtrain at the other).

The TorchScript exports run for every case; dynamo's dynamic exports (about 2.5 s each) for the cases of
DEFAULT_DYNAMO in the default suite, for all of them with ``ONNXTRAIN_FULL_TESTS=1``; the static audit runs
the others' static dynamo export in the default suite.
"""

from __future__ import annotations

import pytest

from tests.autodiff.test_torch_layers_audit import (
    EXPORT_WRONG,
    FLOAT32,
    Weighted,
    _build,
    _compare,
    _export,
    _gradient_model,
    _params,
)
from tests.autodiff.torch_layer_sizes import EXPORT_WRONG_DYNAMIC, SIZES, dynamic_dynamo_cases

torch = pytest.importorskip("torch")
nn = torch.nn

pytestmark = [pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning"),
              pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")]

# onnxtrain failures left: none (every case whose export is torch's function at both sizes passes); an xfail
# would go into the audit's XFAIL, which _params reads


class _RunTimeWeighted(nn.Module):
    """Σ layer(*args)·r with the weights r the last input (of the output's shape, dynamic too)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args):  # noqa: ANN002, ANN201
        *xs, r = args
        return (self.layer(*xs) * r).sum()


def _like(a: torch.Tensor, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """A new input of ``shape`` drawn like the audit's ``a``: its integer range (±1 signs, class indices,
    counts), uniform in (0.1, 0.9) or standard normal."""
    vals = a.unique()
    if not a.is_floating_point() or bool((vals == vals.round()).all()):
        if set(vals.tolist()) <= {-1, 1}:
            return (torch.randint(0, 2, shape, generator=g) * 2 - 1).to(a.dtype)
        lo, hi = int(a.min()), int(a.max())
        return torch.randint(lo, hi + 1, shape, generator=g).to(a.dtype)
    if float(a.min()) >= 0.1 and float(a.max()) <= 0.9:
        return (torch.rand(shape, generator=g, dtype=a.dtype) * 0.8 + 0.1)
    return torch.randn(shape, generator=g, dtype=a.dtype)


def _sized(case: str, dtype: torch.dtype) -> tuple[nn.Module, list[tuple]]:
    """The audit's module of ``case`` (run-time weights for a layer) and its inputs at both SIZES."""
    module, args = _build(case, dtype)
    layer = isinstance(module, Weighted)
    if layer:
        module = _RunTimeWeighted(module.layer).train()
    g = torch.Generator().manual_seed(2)
    sets = []
    for shapes in SIZES[case]:
        xs = tuple(_like(a, s, g) for a, s in zip(args, shapes))
        if layer:
            with torch.no_grad():
                y = module.layer(*xs)
            xs = (*xs, torch.randn(y.shape, generator=g, dtype=y.dtype))
        sets.append(xs)
    return module, sets


def _dynamic_params() -> list:
    """The audit's params of the SIZES cases; a dynamo case the default suite leaves out is extended."""
    run = dynamic_dynamo_cases()
    return [p if p.values[1] != "dynamo" or p.values[0] in run
            else pytest.param(*p.values, id=p.id, marks=[*p.marks, pytest.mark.extended])
            for p in _params(SIZES)]


@pytest.mark.parametrize("case,exporter", _dynamic_params())
def test_dynamic_layer_gradients_match_torch_at_two_sizes(case: str, exporter: str) -> None:
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
    for wrong in (EXPORT_WRONG, EXPORT_WRONG_DYNAMIC):
        if (case, exporter) in wrong:
            pytest.skip(f"torch's {exporter} exporter {wrong[case, exporter]}")
    dtype = torch.float32 if (case, exporter) in FLOAT32 else torch.float64
    module, sets = _sized(case, dtype)
    n_in = len(sets[0]) - (1 if isinstance(module, _RunTimeWeighted) else 0)  # r: not differentiated
    graded = _gradient_model(case, module, _export(module, sets[0], exporter, dynamic=True), sets[0], n_in)
    errors = []
    for args in sets:
        errors += _compare(graded, module, args, dtype, tag=f"[{'×'.join(map(str, args[0].shape))}] ")
    assert not errors, f"{case} ({exporter}):\n  " + "\n  ".join(errors)

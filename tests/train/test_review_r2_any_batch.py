"""Review R2: any_batch_export frees a fixed batch axis only for a model whose rows do not mix (its own check
says so: "the rows mix"). Before, the check ran integer and bool inputs as all zeros and bfloat16 inputs as
zeros too, so every row was the same and a model mixing its rows (centring over the batch, a training-mode
BatchNorm after an Embedding) was freed, while the same model on float features was kept fixed; and it
compared only the first row at 1 and 2 rows, so a mix that leaves the first row alone (a cumulative sum
over the batch) was freed too.

Oracle: the fixed model run by onnxruntime on each chunk of its batch size (what the file computed before
it was freed), against the freed model run by onnxruntime on the whole 32 rows; torch exports the models
(TorchScript exporter, no dynamic_axes). A model whose rows do not mix (an Embedding MLP) is still freed
and gives the fixed model's values per chunk."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

from onnxtrain.train.free_batch import any_batch_export

B = 16


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e, self.fc = nn.Embedding(10, 8), nn.Linear(8, 3)

    def features(self, ids: torch.Tensor) -> torch.Tensor:
        return self.e(ids).mean(1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(ids))


class _EmbedCentred(_Embed):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # each row minus the batch's mean: rows mix
        h = self.features(ids)
        return self.fc(h - h.mean(0, keepdim=True))


class _EmbedBatchNormTraining(_Embed):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # batch statistics: rows mix
        return self.fc(nn.functional.batch_norm(self.features(ids), None, None, training=True))


class _CumulativeRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # row k sums rows 0..k: the first row is its own
        return self.fc(x).cumsum(0)


class _ReverseCumulativeRows(_CumulativeRows):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # row k sums rows k..: the last row is its own
        return self.fc(x).flip(0).cumsum(0).flip(0)


def _torch_export(net: nn.Module, x: torch.Tensor) -> onnx.ModelProto:
    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net.eval(), (x,), buf, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"])
    m = onnx.load_from_string(buf.getvalue())
    assert m.graph.input[0].type.tensor_type.shape.dim[0].dim_value == B
    return m


def _ort(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


def _per_chunk(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return np.concatenate([_ort(m, x[k:k + B]) for k in range(0, len(x), B)])


def _ids(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).integers(0, 10, (rows, 5)).astype(np.int64)


def _floats(rows: int) -> np.ndarray:
    return np.random.default_rng(rows).standard_normal((rows, 8)).astype(np.float32)


MIXING = {"embedding_centred": (_EmbedCentred, _ids),
          "embedding_batchnorm_training": (_EmbedBatchNormTraining, _ids),
          "cumulative_sum_over_rows": (_CumulativeRows, _floats),
          "reverse_cumulative_sum": (_ReverseCumulativeRows, _floats)}


@pytest.mark.parametrize("case", list(MIXING))
def test_a_model_whose_rows_mix_keeps_its_fixed_batch(case: str) -> None:
    net, data = MIXING[case]
    torch.manual_seed(0)
    m = _torch_export(net(), torch.from_numpy(data(B)))
    x = data(2 * B)
    # (the oracle: what a freed file would compute differs from the fixed model's per chunk)
    freed_as_is = onnx.ModelProto()
    freed_as_is.CopyFrom(m)
    for v in (freed_as_is.graph.input[0], freed_as_is.graph.output[0]):
        v.type.tensor_type.shape.dim[0].dim_param = "batch"
    assert not np.allclose(_ort(freed_as_is, x), _per_chunk(m, x), rtol=1e-3, atol=1e-4)
    free, why = any_batch_export(m)
    assert why is not None and "mix" in why, why
    assert free is m


def test_rows_of_integer_ids_that_do_not_mix_are_still_freed() -> None:
    torch.manual_seed(0)
    m = _torch_export(_Embed(), torch.from_numpy(_ids(B)))
    free, why = any_batch_export(m)
    assert why is None, why
    x = _ids(2 * B + 3)
    np.testing.assert_allclose(_ort(free, x)[:2 * B], _per_chunk(m, x[:2 * B]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(_ort(free, x[:7]), _ort(free, x)[:7], rtol=1e-5, atol=1e-6)


def _bfloat16_model(centred: bool) -> onnx.ModelProto:
    """x: bfloat16 [16, 4] → float → (minus the batch's mean) → y: float [16, 4]."""
    f, vi = TensorProto.FLOAT, helper.make_tensor_value_info
    nodes = [helper.make_node("Cast", ["x"], ["xf"], to=f)]
    if centred:
        nodes += [helper.make_node("ReduceMean", ["xf"], ["mu"], axes=[0], keepdims=1),
                  helper.make_node("Sub", ["xf", "mu"], ["y"])]
    else:
        nodes += [helper.make_node("Mul", ["xf", "two"], ["y"])]
    g = helper.make_graph(nodes, "bf16", [vi("x", TensorProto.BFLOAT16, [B, 4])], [vi("y", f, [B, 4])],
                          [numpy_helper.from_array(np.array(2, np.float32), "two")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("centred", [True, False], ids=["rows_mix", "rows_apart"])
def test_bfloat16_inputs(centred: bool) -> None:
    free, why = any_batch_export(_bfloat16_model(centred))
    assert (why is None) is (not centred), why

"""Review R5 of 67762658: any_batch_export's row-mix check ran the freed model at 1 and 2 rows only, so a
model mixing rows further apart than that (row k reads row k - 2: a lag over the rows, as a static export
of a model whose batch axis is time) was freed, and the freed file computed other values than the fixed
model per chunk (onnxruntime as oracle, as in test_review_r2_any_batch)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from onnxtrain.train.free_batch import any_batch_export
from tests.train.test_review_r2_any_batch import B, _floats, _ids, _ort, _per_chunk, _torch_export


class _LagRows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # row k adds row k - 2 (rows 0 and 1 their own)
        h = self.fc(x)
        return h + torch.cat([torch.zeros(2, 3), h])[:-2]


class _LagIds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e = nn.Embedding(10, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # the same lag after an Embedding
        h = self.e(ids).mean(1)
        return h + torch.cat([torch.zeros(2, 3), h])[:-2]


def _check_kept(net: nn.Module, data) -> None:
    torch.manual_seed(0)
    m = _torch_export(net, torch.from_numpy(data(B)))
    free, why = any_batch_export(m)
    x = data(2 * B)
    if why is None:  # (what the freed file computes, against the fixed model per chunk)
        np.testing.assert_allclose(_ort(free, x), _per_chunk(m, x), rtol=1e-4, atol=1e-5)
    assert why is not None and "mix" in why, why
    assert free is m


def test_rows_mixing_two_apart_keep_the_fixed_batch() -> None:
    torch.manual_seed(0)
    _check_kept(_LagRows(), _floats)


def test_integer_rows_mixing_two_apart_keep_the_fixed_batch() -> None:
    torch.manual_seed(0)
    _check_kept(_LagIds(), _ids)

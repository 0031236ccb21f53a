"""The gradient of ``nn.EmbeddingBag(mode="max")`` (TorchScript export: a Loop over the bags) has no
backward loop (onnxtrain/autodiff/rules/control_flow.py, ``_bag_table_grad``): one gather of every bag's
rows, a comparison with the pooled maxima and one ScatterND into the table. Oracles: the backward Loop it
replaces (the gradient graph built with the bag-loop match switched off), bit for bit, ties included;
torch autograd; float64 central differences; onnxruntime 1.32 running the gradient graph."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.autodiff.rules import control_flow
from onnxtrain.testing import gradcheck, run_engine, to_float64
from tests import models

VOCAB, DIM = 10, 3
IDS = np.array([1, 2, 4, 5, 4, 3, 2, 9, 4, 4, 7, 1], np.int64)  # id 4 three times in [2, 10): exact ties


class PooledLoss(nn.Module):
    """Half the sum of squares of the max-pooled bags: each bag's output gradient is its maximum, so the
    shares a row collects from several bags differ and their order of summation shows in the bits (an
    empty bag's maximum, -inf in the exported loop, takes no share)."""

    def __init__(self, bag: nn.EmbeddingBag) -> None:
        super().__init__()
        self.bag = bag

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.bag(*args) ** 2).sum()


def exported(variant: str = "offsets") -> tuple[onnx.ModelProto, nn.EmbeddingBag, str]:
    """The TorchScript export of a max EmbeddingBag loss, the torch bag and the table's name."""
    torch.manual_seed(0)
    last = variant == "include_last_offset"
    bag = nn.EmbeddingBag(VOCAB, DIM, mode="max", include_last_offset=last)
    if variant == "2d_input":
        args, names = (torch.from_numpy(IDS[:8].reshape(2, 4)),), ["ids"]
    else:
        offs = [0, 3, 12] if last else [0, 3]
        args, names = (torch.from_numpy(IDS), torch.tensor(offs)), ["ids", "offsets"]
    model = models.export_torchscript(PooledLoss(bag), args, names, ["loss"], {n: {0: "n"} for n in names})
    (weight,) = [t.name for t in model.graph.initializer if tuple(t.dims) == (VOCAB, DIM)]
    return model, bag, weight


def loopless_grad(model: onnx.ModelProto, weight: str) -> onnx.ModelProto:
    """The gradient graph, checked: valid (full check) and holding no Loop but the forward one."""
    gmodel = build_gradient_model(model, "loss", [weight])
    onnx.checker.check_model(gmodel, full_check=True)
    loops = [nd.name for nd in gmodel.graph.node if nd.op_type == "Loop"]
    assert len(loops) == 1, f"a backward Loop remains: {loops}"
    return gmodel


def loop_grad(model: onnx.ModelProto, weight: str, monkeypatch: pytest.MonkeyPatch) -> onnx.ModelProto:
    """The gradient graph the general Loop rule builds (a backward Loop, one iteration per bag)."""
    with monkeypatch.context() as m:
        m.setattr(control_flow, "match_bag_loop", lambda *a, **k: None)
        gmodel = build_gradient_model(model, "loss", [weight])
    assert [nd.op_type for nd in gmodel.graph.node].count("Loop") == 2
    return gmodel


def grads(gmodel: onnx.ModelProto, feeds: dict[str, np.ndarray], weight: str) -> np.ndarray:
    out = dict(zip([o.name for o in gmodel.graph.output], run_engine(gmodel, feeds)))
    return out[f"{weight}_grad"]


def ort_grads(gmodel: onnx.ModelProto, feeds: dict[str, np.ndarray], weight: str) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3  # its notes on the forward loop's implicit inputs
    sess = ort.InferenceSession(gmodel.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in gmodel.graph.output], sess.run(None, feeds)))[f"{weight}_grad"]


def tied_table(model: onnx.ModelProto, weight: str) -> onnx.ModelProto:
    """``model`` with rows 3 and 5 of the table equal to row 4 in columns 0 and 2 (ties between rows)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    (t,) = [t for t in out.graph.initializer if t.name == weight]
    table = onnx.numpy_helper.to_array(t).copy()
    for r in (3, 5):
        table[r, [0, 2]] = table[4, [0, 2]] + 10.0
    table[4, [0, 2]] += 10.0
    t.CopyFrom(onnx.numpy_helper.from_array(table, weight))
    return out


# bags [0, 3), [3, 6), ...: consecutive, with an empty one, one of all ids, of one id, from a later start
LAYOUTS = [[0, 3, 6], [0, 1], [0, 12], [0, 3, 3, 8], [0, 0, 12], [2, 5, 10], [0, 2, 4, 6, 8, 10]]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("offsets", LAYOUTS)
def test_max_bag_grad_is_the_loops_bit_for_bit(offsets: list[int], tied: bool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The loopless gradient equals the backward Loop's exactly, also where rows tie (the same id twice or
    three times in a bag; ``tied``: three distinct rows equal in two columns, splitting evenly), and
    onnxruntime runs the graph to the same values."""
    model, _, weight = exported()
    if tied:
        model = tied_table(model, weight)
    new, old = loopless_grad(model, weight), loop_grad(model, weight, monkeypatch)
    feeds = {"ids": IDS, "offsets": np.array(offsets, np.int64)}
    got = grads(new, feeds, weight)
    np.testing.assert_array_equal(got, grads(old, feeds, weight))
    np.testing.assert_allclose(ort_grads(new, feeds, weight), got, rtol=1e-6, atol=1e-7)


def test_max_bag_grad_many_bags_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    """60 bags of 0-9 ids over a vocabulary of 10 (each row in many bags, duplicates within bags): the
    table's rows sum their shares in the backward loop's order, so the bits are the same."""
    model, _, weight = exported()
    rng = np.random.default_rng(1)
    sizes = rng.integers(0, 10, 60)
    feeds = {"ids": rng.integers(0, VOCAB, int(sizes.sum())).astype(np.int64),
             "offsets": np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)}
    got = grads(loopless_grad(model, weight), feeds, weight)
    np.testing.assert_array_equal(got, grads(loop_grad(model, weight, monkeypatch), feeds, weight))
    assert np.count_nonzero(got) > VOCAB


def test_max_bag_ties_between_rows_split_evenly() -> None:
    """Bag [3, 6) holds rows 5, 4, 3, equal in columns 0 and 2: each takes a third of the bag's output
    gradient there (ReduceMax's rule, which the loop applied); column 1 goes to its one maximum."""
    model, _, weight = exported()
    model = tied_table(model, weight)
    table = onnx.numpy_helper.to_array([t for t in model.graph.initializer if t.name == weight][0])
    feeds = {"ids": IDS[3:6], "offsets": np.array([0], np.int64)}
    got = grads(loopless_grad(model, weight), feeds, weight)
    top = table[[5, 4, 3]].max(0)  # the bag's output and its gradient
    want = np.zeros((VOCAB, DIM), np.float32)
    want[[3, 4, 5], 0], want[[3, 4, 5], 2] = top[0] / 3, top[2] / 3
    want[[5, 4, 3][int(np.argmax(table[[5, 4, 3], 1]))], 1] = top[1]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("variant", ["offsets", "include_last_offset", "2d_input"])
def test_max_bag_grad_matches_torch(variant: str) -> None:
    """The table's gradient is torch's (torch routes a bag's gradient to one position of its maximum; an
    id repeated in a bag gets the same total here in equal shares), for EmbeddingBag's export forms."""
    model, bag, weight = exported(variant)
    if variant == "2d_input":
        args = (torch.from_numpy(IDS[:8].reshape(2, 4)),)
        feeds = {"ids": args[0].numpy()}
    else:
        offs = [0, 3, 3, 6, 12] if variant == "include_last_offset" else [0, 3, 3, 6]  # an empty bag
        args = (torch.from_numpy(IDS), torch.tensor(offs))
        feeds = {"ids": IDS, "offsets": np.array(offs, np.int64)}
    gmodel = loopless_grad(model, weight)
    bag.zero_grad()
    PooledLoss(bag)(*args).backward()
    want = bag.weight.grad.numpy()
    np.testing.assert_allclose(grads(gmodel, feeds, weight), want, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ort_grads(gmodel, feeds, weight), want, rtol=1e-6, atol=1e-7)


def test_max_bag_grad_float64_central_differences() -> None:
    """In float64, every element of the table's gradient matches central differences (the repeated id 4
    ties with itself, which is differentiable); the float64 gradient graph has no backward loop either."""
    model, _, weight = exported()
    model64 = to_float64(model)
    loopless_grad(model64, weight)
    feeds = {"ids": IDS, "offsets": np.array([0, 2, 7, 10], np.int64)}
    got = gradcheck(model64, "loss", [weight], feeds, eps=1e-6, rtol=1e-6, atol=1e-9)
    assert np.count_nonzero(got[weight]) >= 6

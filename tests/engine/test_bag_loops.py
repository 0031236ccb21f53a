"""Bag-pooling Loops (torch's exported nn.EmbeddingBag): the engine pools all bags at once, bit for bit as
the loop run as written (fusions off), and runs the loop itself whenever the bags are not what
EmbeddingBag's offsets make; the matcher takes nothing but that body."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from onnxtrain.engine import Plan
from onnxtrain.engine import bag_loops as engine_bags
from onnxtrain.ir.bag_loops import match_bag_loop
from tests import models

IDS = np.array([1, 2, 4, 5, 4, 3, 2, 9], np.int64)


def bag_model(mode: str, dtype=torch.float32, dim: int = 3) -> onnx.ModelProto:
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(10, dim, mode=mode).to(dtype)
    return models.export_torchscript(bag, (torch.from_numpy(IDS), torch.tensor([0, 4])), ["ids", "offsets"],
                                     ["y"], {"ids": {0: "n"}, "offsets": {0: "b"}})


@pytest.fixture
def pooled(monkeypatch) -> list[bool]:
    """Whether each Loop run was answered by the pooling (True) or ran as written (False)."""
    calls: list[bool] = []
    real = engine_bags.BagPooling.__call__

    def spy(self, *args):
        out = real(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(engine_bags.BagPooling, "__call__", spy)
    return calls


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    "offsets,fast",
    [([0, 3, 6], True), ([0], True), ([0, 0, 3], True), ([0, 3, 3, 6], True), ([0, 3, 8], True),
     ([2, 5], True), ([-3, 5], True), ([0, 5, 3], False)],
    ids=["three", "one", "empty-first", "empty-middle", "empty-last", "ids-before-first", "negative",
         "decreasing"],
)
def test_pooled_bags_equal_the_loop_bit_for_bit(mode, dtype, offsets, fast, pooled) -> None:
    model = bag_model(mode, dtype)
    feeds = {"ids": IDS, "offsets": np.array(offsets, np.int64)}
    if mode == "max" and offsets == [0, 5, 3]:
        pytest.skip("the loop's max of the reversed bag [5, 3) is the empty max; covered by empty-middle")
    with np.errstate(invalid="ignore", divide="ignore"):  # the loop's mean of an empty bag is 0 / 0
        (want,) = Plan(model, fuse=False).run(feeds)
        (got,) = Plan(model).run(feeds)
    assert pooled == [fast]
    assert got.dtype == want.dtype and got.shape == want.shape == (len(offsets), 3)
    np.testing.assert_array_equal(got, want)  # NaN (an empty bag's mean) and -inf (its max) included
    if fast and 0 not in np.diff([*offsets, len(IDS)]) and offsets[0] == 0:  # bags torch accepts
        with torch.no_grad():
            torch.manual_seed(0)
            bag = nn.EmbeddingBag(10, 3, mode=mode).to(dtype)
            t = bag(torch.from_numpy(IDS), torch.tensor(offsets)).numpy()
        np.testing.assert_allclose(got, t, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("longest", [7, 8, 9, 20])
def test_bags_of_one_value_rows_keep_the_loops_bits(mode: str, longest: int, pooled) -> None:
    # an embedding of dimension 1: the loop sums each bag along a contiguous axis, by eight partial sums
    # from 8 values on
    model = bag_model(mode, dim=1)
    ids = np.random.default_rng(3).integers(0, 10, 2 * longest)
    feeds = {"ids": ids, "offsets": np.array([0, longest], np.int64)}
    (want,) = Plan(model, fuse=False).run(feeds)
    (got,) = Plan(model).run(feeds)
    assert pooled == [mode == "max" or longest < engine_bags.PAIRWISE_MIN]
    np.testing.assert_array_equal(got, want)


def test_loop_runs_as_written_for_large_bags_and_without_fusion(pooled, monkeypatch) -> None:
    model = bag_model("mean")
    feeds = {"ids": IDS, "offsets": np.array([0, 4], np.int64)}
    (want,) = Plan(model, fuse=False).run(feeds)
    assert pooled == []  # fusions off: no pooling at all
    monkeypatch.setattr(engine_bags, "MAX_ROWS", 3)  # the bags hold 4 rows
    (got,) = Plan(model).run(feeds)
    assert pooled == [False]
    np.testing.assert_array_equal(got, want)


def test_matcher_takes_the_bag_body_and_nothing_else() -> None:
    from tests.engine.test_control_flow import nested_model

    model = bag_model("sum")
    (loop,) = [n for n in model.graph.node if n.op_type == "Loop"]
    bag = match_bag_loop(loop)
    assert bag is not None and (bag.ids, bag.reduce) == ("ids", "sum")
    assert bag.table in {t.name for t in model.graph.initializer}
    assert list(bag.checks.values()) == [[0]]  # the Slice's axes live outside the body: checked at run time
    constants = {n.output[0]: onnx.numpy_helper.to_array(n.attribute[0].t)
                 for n in model.graph.node if n.op_type == "Constant"}
    assert match_bag_loop(loop, constants.get).checks == {}

    def variant(edit) -> onnx.NodeProto:
        node = onnx.NodeProto()
        node.CopyFrom(loop)
        edit(node.attribute[0].g)
        return node

    def weigh(body: onnx.GraphProto) -> None:  # per-sample weights: rows scaled before the sum
        red = next(n for n in body.node if n.op_type == "ReduceSum")
        body.node.append(onnx.helper.make_node("Mul", [red.input[0], red.input[0]], ["sq"]))
        red.input[0] = "sq"

    def every_other(body: onnx.GraphProto) -> None:  # a Slice with steps 2
        sl = next(n for n in body.node if n.op_type == "Slice")
        body.node.append(onnx.helper.make_node("Constant", [], ["two"], value=onnx.numpy_helper.from_array(
            np.array([2], np.int64))))
        sl.input.extend(["two"] if len(sl.input) == 4 else ["", "two"])

    assert match_bag_loop(variant(weigh)) is None
    assert match_bag_loop(variant(every_other)) is None
    assert all(match_bag_loop(n) is None for n in nested_model().graph.node)

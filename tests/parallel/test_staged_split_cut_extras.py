"""Review of 719e87fb and 485c038d (:func:`onnxtrain.parallel.pipeline.merge_cuts`): a stage cut on a split
block's output plus other values is taken when those values are computed beside the block and read after it
(``"o:s"``: sent on, as any value read later). Every other extra value was dropped without a word, so a cut
the one-process pipeline refuses was taken as the cut on the block's output alone: a value of the block
itself (``r``, the hidden activation, or ``h1``, its first product: read inside the block) and, without the
bias after the block, a value computed after it (``q = o · s``). Oracle: the one-process pipeline's
:func:`partition` on the same model and cut, which refuses each of them; ``"o:s"`` is taken by both."""

from __future__ import annotations

import pytest

from onnxtrain.parallel.megatron import find_mlp_blocks, shard_blocks
from onnxtrain.parallel.pipeline import merge_cuts, parse_cut_info, partition
from tests.parallel.test_staged_split_side_values import side_model


def _merged(bias: bool, cut: str):
    m = side_model(bias)
    trained = ["W1", "W2", "W3", *(["b2"] if bias else [])]
    sharded, cuts, _ = shard_blocks(m, find_mlp_blocks(m, trained, 2), 0, 2)
    merged = merge_cuts(sharded, parse_cut_info(cut, 2), cuts)
    return partition(sharded, [mc.edges for mc in merged], "loss"), merged


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cut,value", [("o:r", "r"), ("o:h1", "h1"), ("o:q", "q")])
def test_a_cut_the_plain_pipeline_refuses_is_refused_by_name(bias: bool, cut: str, value: str) -> None:
    with pytest.raises(ValueError, match="pipeline_cut_info_string"):  # the oracle
        partition(side_model(bias), parse_cut_info(cut, 2), "loss")
    with pytest.raises(ValueError, match=rf"pipeline_cut_info_string: cut \d .*'{value}'"):
        _merged(bias, cut)


@pytest.mark.parametrize("bias", [False, True])
def test_a_value_beside_the_block_is_still_taken(bias: bool) -> None:
    partition(side_model(bias), parse_cut_info("o:s", 2), "loss")  # the plain pipeline takes it
    part, merged = _merged(bias, "o:s")
    assert [e.tensor for e in merged[-1].edges] == ["o"] and merged[-1].ends_stage

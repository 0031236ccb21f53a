"""Pipeline stages whose blocks are split (``pipeline_parallel_size`` with ``horizontal_parallel_size``,
``mpiexec -n 4``: 2 stages × 2 shares) train as one process accumulating the same micro-batches; how the
pipeline's cuts and the split's interleave."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from onnxtrain import TrainingParameters
from onnxtrain.parallel.megatron import find_mlp_blocks, shard_blocks
from onnxtrain.parallel.pipeline import merge_cuts, parse_cut_info, partition
from onnxtrain.training_graph import select_trainable
from tests.parallel.pipeline_worker import GRADIENTS, gelu_blocks_model
from tests.parallel.test_pipeline import (
    assert_adasum,
    assert_gradient_outputs,
    assert_same_run,
    compare,
    compare_half,
    pipelined,
)


@pytest.mark.mpi
def test_split_blocks_in_two_stages_train_as_one_process(tmp_path) -> None:
    """Two GELU blocks cut between them (each stage splits its block over two ranks), two micro-batches per
    run, Adam with clipping (the norm over both stages and both shares): also cut where the first block's
    partial output is summed, with gradient accumulation over two runs, the gradients as outputs, and under
    mixed precision; two transformer layers (attention heads and MLP split) cut after the first, also with
    the first layer recomputed in the backward (the same bits); a projection tied across the stages (nothing
    splits; its gradient summed over the stages). Against one process (2e-6; under mixed precision, float16
    rounding)."""
    cases = ["adam2_h2_gelu_clip", "adam2_h2_cut_at_sum_clip", "adam2_h2_acc2_clip", "sgd2_h2_layers"]
    cases.append("adam2_h2_tied_clip")
    more = ["adam2_h2_mp_gelu", "adam2_h2_gelu_grads", "sgd2_h2_layers_recompute"]
    got = pipelined(tmp_path, [*cases, *more], 4)
    for case in cases:
        compare(got, case, 2e-6)
    # transformer_layer_recompute: the first layer's activations rebuilt in the backward, the same bits
    assert got.pop("sgd2_h2_layers_recompute/recomputed") > 0
    for k, v in got.items():
        if k.startswith("sgd2_h2_layers/"):
            np.testing.assert_array_equal(got[k.replace("layers/", "layers_recompute/")], v, err_msg=k)
    # rank 0 (stage 0) holds a share of the first block's weights only, of the first layer's only
    assert list(got["adam2_h2_gelu_clip/split"]) == ["W1", "W2", "b1"]
    layer0 = list(got["sgd2_h2_layers/split"])
    assert layer0 and all(w.startswith("layer0.") for w in layer0), layer0
    assert {"layer0.attn.q.weight", "layer0.attn.out.weight", "layer0.fc1.weight", "layer0.fc2.weight"} <= {
        *layer0
    }, layer0
    assert_gradient_outputs(got, "adam2_h2_gelu_grads", GRADIENTS["adam2_h2_gelu_grads"])
    compare_half(got, "adam2_h2_mp_gelu")


@pytest.mark.mpi
def test_split_stages_times_two_replicas_with_zero_adasum_and_neither(tmp_path) -> None:
    """mpiexec -n 8: 2 stages × 2 replicas × 2 shares (rank = stage · 4 + replica · 2 + share), each replica
    on half of every batch; ZeRO stage 1 shards each rank's Adam state over the two replicas holding its
    share of its stage: both as one process, and the same run with ZeRO as without. Adasum: each replica
    updates with its own gradients (its own norm over its stages and shares) and the replicas combine the
    deltas, a split weight's dot products the whole tensor's; against one process per replica whose deltas
    the float64 formula combines. Under mixed precision with a loss scale that overflows, no step applies."""
    cases = ["adam2_h2x2_gelu_clip", "adam2_h2x2_gelu_zero_clip", "adam2_h2x2_gelu_adasum"]
    got = pipelined(tmp_path, [*cases, "adam2_h2x2_mp_adasum_overflow"], 8)
    compare(got, "adam2_h2x2_gelu_clip", 2e-6)
    compare(got, "adam2_h2x2_gelu_zero_clip", 2e-6)
    assert_same_run(got, "adam2_h2x2_gelu_zero_clip", "adam2_h2x2_gelu_clip")
    assert_adasum(got, "adam2_h2x2_gelu_adasum", "adam2_h2x2_gelu_clip")
    for t in gelu_blocks_model().graph.initializer:  # mixed precision, every step overflowing: none applied
        kept = got[f"adam2_h2x2_mp_adasum_overflow/state/{t.name}"]
        np.testing.assert_array_equal(kept, numpy_helper.to_array(t), err_msg=t.name)


@pytest.mark.mpi
def test_onnxruntime_backend_runs_the_split_stages_as_one_process(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    got = pipelined(tmp_path, ["adam2_h2_gelu_clip"], 4, env={"ONNXTRAIN_TEST_BACKEND": "onnxruntime"})
    compare(got, "adam2_h2_gelu_clip", 1e-5)


def _sharded() -> tuple:
    m = gelu_blocks_model()
    p = TrainingParameters()
    p.loss_output_name = "loss"
    blocks = find_mlp_blocks(m, select_trainable(m, p), 2)
    sharded, cuts, _ = shard_blocks(m, blocks, 0, 2)
    return sharded, cuts


def test_stage_cuts_interleave_with_the_split_cuts() -> None:
    """A stage cut between two blocks lands between the first block's G cut and the second's F cut; one on
    a block's partial output is that G cut (the stage sends the ranks' sum); the partition runs each piece
    in one stage."""
    sharded, cuts = _sharded()
    assert [c[0].tensor for c in cuts] == ["x_megatron_f0", "m2", "r1_megatron_f1", "m4"]
    merged = merge_cuts(sharded, parse_cut_info("r1", 2), cuts)
    assert [(m.edges[0].tensor, m.ends_stage, m.block_cut) for m in merged] == [
        ("x_megatron_f0", False, 0), ("m2", False, 1), ("r1", True, None),
        ("r1_megatron_f1", False, 2), ("m4", False, 3),
    ]
    part = partition(sharded, [m.edges for m in merged], "loss")
    assert part.stages == 6
    residual = next(k for k, n in enumerate(sharded.graph.node) if n.output[0] == "r1")
    assert part.stage_of[residual] == 2  # with the first block's bias, before the stage cut
    merged = merge_cuts(sharded, parse_cut_info("m2", 2), cuts)
    assert [(m.edges[0].tensor, m.ends_stage, m.block_cut) for m in merged] == [
        ("x_megatron_f0", False, 0), ("m2", True, 1), ("r1_megatron_f1", False, 2), ("m4", False, 3),
    ]


@pytest.mark.parametrize(
    ("cut", "match"),
    [
        ("g1", r"cut 0 \(g1\) falls inside the split block that reads 'x': cut before the block or after"),
        ("t3", r"cut 0 \(t3\) falls inside the split block that reads 'r1'"),
        ("nowhere", r"cut 0: 'nowhere' is not computed by a node of the graph"),
    ],
)
def test_a_stage_cut_inside_a_split_block_is_refused(cut: str, match: str) -> None:
    sharded, cuts = _sharded()
    with pytest.raises(ValueError, match=match):
        merge_cuts(sharded, parse_cut_info(cut, 2), cuts)

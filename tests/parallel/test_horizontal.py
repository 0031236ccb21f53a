"""Horizontal (Megatron) parallelism of the legacy session: MLP blocks split over ``mpiexec -n 2`` train as
one process does (within float32 rounding of the split sums); which blocks split; the errors."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxtrain import TrainingParameters, TrainingSession, zoo
from onnxtrain.parallel.megatron import find_mlp_blocks, join_shares, shard_blocks, take_share
from onnxtrain.parallel.megatron_attention import find_attention_blocks
from onnxtrain.parallel.pipeline import partition
from onnxtrain.session_horizontal import SHARE_SEED_STEP
from onnxtrain.training_graph import select_trainable
from tests.parallel.conftest import run_mpi
from tests.parallel.pipeline_worker import (
    _batch_norm,
    attention3d_model,
    attention_dropout_model,
    gelu_block_dropout_model,
    gelu_blocks_model,
    gelu_dropout_model,
    tied_model,
)
from tests.parallel.test_pipeline import (
    assert_adasum,
    assert_same_run,
    compare,
    compare_half,
    one_process,
    pipelined,
    torch_llama_case,
    torch_transformer_case,
)
from tests.session.helpers import batches, mlp_model


@pytest.mark.mpi
def test_split_blocks_train_as_one_process(tmp_path) -> None:
    got = pipelined(tmp_path, ["adam_h2_clip", "adam_h2_gelu_blocks"], 2)
    # rank r holds columns/rows [8r, 8r + 8) of the 16 hidden units; the sums of the two halves round
    # differently from one product over all 16
    compare(got, "adam_h2_clip", 2e-6)
    compare(got, "adam_h2_gelu_blocks", 2e-6)


@pytest.mark.mpi
def test_batch_norm_outside_split_blocks(tmp_path) -> None:
    """A training-mode BatchNormalization of the input, ahead of the two split blocks (and read again by the
    residual between them), runs whole on every rank: the weights and its running statistics move as one
    process's."""
    got = pipelined(tmp_path, ["adam_h2_bn_blocks"], 2)
    compare(got, "adam_h2_bn_blocks", 2e-6)
    assert {"bn_mean", "bn_var"} <= {k.split("/", 2)[2] for k in got if "/state/" in k}


def test_a_block_with_batch_norm_inside_stays_whole() -> None:
    """Between a block's two products, a training-mode BatchNormalization would see a share of the
    channels: such a block is not split (the next one still is)."""
    m = gelu_blocks_model()
    g = m.graph
    k = next(i for i, n in enumerate(g.node) if n.output[0] == "g1")
    bn, inits = _batch_norm("g1", "g1b", 16, "inner", np.random.default_rng(0))
    g.node.insert(k + 1, bn)
    next(n for n in g.node if n.op_type == "MatMul" and n.input[0] == "g1").input[0] = "g1b"
    g.initializer.extend(inits)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    trainable = select_trainable(m, p)
    assert [(b.w1, b.w2) for b in find_mlp_blocks(m, trainable, 2)] == [("W3", "W4")]


@pytest.mark.parametrize("output, whole", [("m1", ("W3", "W4")), ("m3", ("W1", "W2")), (None, None)])
def test_a_block_whose_first_product_is_a_graph_output_stays_whole(output: str | None, whole: Any) -> None:
    """A MatMul's output, before its bias Add, that the graph also outputs must stay whole: the block was
    split from the Add on, the output became a rank's share, and the session failed at build time naming
    another tensor (shape inference lost its type)."""
    m = gelu_blocks_model()
    if output is not None:
        m.graph.output.append(onnx.helper.make_tensor_value_info(output, onnx.TensorProto.FLOAT, None))
    p = TrainingParameters()
    p.loss_output_name = "loss"
    blocks = [(b.w1, b.w2) for b in find_mlp_blocks(m, select_trainable(m, p), 2)]
    assert blocks == ([whole] if whole else [("W1", "W2"), ("W3", "W4")])


@pytest.mark.mpi
def test_split_blocks_accumulate_gradients_as_one_process(tmp_path) -> None:
    """gradient_accumulation_steps=2 over the split: the micro-steps counted by the session ("auto") or
    marked by fetching Group_Accumulated_Gradients ("legacy"), each batch's two halves one run each."""
    got = pipelined(tmp_path, ["adam_h2_acc2_clip", "adam_h2_acc2_legacy"], 2)
    compare(got, "adam_h2_acc2_clip", 2e-6)
    compare(got, "adam_h2_acc2_legacy", 2e-6)


@pytest.mark.mpi
def test_split_blocks_times_two_data_parallel_replicas(tmp_path) -> None:
    """mpiexec -n 4: two replicas of the two-way split, each on half of every batch (rank = replica · 2 +
    share); the replicas average their gradients, as one process accumulating both halves does."""
    got = pipelined(tmp_path, ["adam_h2x2_gelu_blocks", "adam_h2x2_acc2_clip"], 4)
    compare(got, "adam_h2x2_gelu_blocks", 2e-6)
    compare(got, "adam_h2x2_acc2_clip", 2e-6)  # with gradient accumulation as well


@pytest.mark.mpi
def test_zero_and_adasum_over_the_replicas_of_the_split(tmp_path) -> None:
    """mpiexec -n 4, the two-way split × two replicas. ZeRO stage 1 shards each rank's Adam state over the
    two replicas holding its share: the same weights as without it (and as one process), its gathered state
    the whole model's, also when resumed from it halfway. Adasum: each replica updates with its own
    gradients and the replicas combine the deltas, a split weight's dot products those of the whole tensor;
    checked against one process per replica whose deltas the float64 formula combines."""
    zero = ["adam_h2x2_gelu_zero", "adam_h2x2_gelu_zero_resumed"]
    got = pipelined(tmp_path, ["adam_h2x2_gelu_blocks", *zero, "adam_h2x2_gelu_adasum"], 4)
    for case in zero:
        compare(got, case, 2e-6)
        assert_same_run(got, case, "adam_h2x2_gelu_blocks")
    assert_adasum(got, "adam_h2x2_gelu_adasum", "adam_h2x2_gelu_blocks")


@pytest.mark.mpi
def test_split_under_mixed_precision(tmp_path) -> None:
    """Mixed precision over the two-way split: each rank's products in float16 on its float32 master
    shares, the ranks' float16 partial sums added in float32. Against one process under mixed precision,
    within float16 rounding of the split products; with a loss scale that overflows, every update is
    skipped on every rank (the initial state, as one process keeps it); the half twins in the gathered
    state are the whole weights'. On 4 ranks, ZeRO over the replicas as well: the same state as without it."""
    got = pipelined(tmp_path, ["adam_h2_mp_gelu", "adam_h2_mp_overflow"], 2)
    for case in ("adam_h2_mp_gelu", "adam_h2_mp_overflow"):
        compare_half(got, case)
    first = {t.name: numpy_helper.to_array(t) for t in gelu_blocks_model().graph.initializer}
    for w, v in first.items():
        np.testing.assert_array_equal(got[f"adam_h2_mp_overflow/state/{w}"], v, err_msg=w)
    for w in ("W1", "W2", "b1"):  # the gathered twins: the whole weights rounded to float16
        np.testing.assert_array_equal(got[f"adam_h2_mp_gelu/state/{w}_fp16"],
                                      got[f"adam_h2_mp_gelu/state/{w}"].astype(np.float16))
    got = pipelined(tmp_path, ["adam_h2x2_mp_gelu", "adam_h2x2_mp_gelu_zero"], 4)
    assert_same_run(got, "adam_h2x2_mp_gelu_zero", "adam_h2x2_mp_gelu")
    losses = one_process("adam_h2x2_mp_gelu")[0]
    np.testing.assert_allclose(got["adam_h2x2_mp_gelu/losses"], losses, rtol=5e-4)


@pytest.mark.mpi
def test_dropout_between_split_blocks_draws_alike_on_every_rank(tmp_path) -> None:
    """An unseeded Dropout between the blocks runs on both ranks: they agree on a seed, so they drop the same
    values and train as one process whose Dropout has that seed."""
    case = "adam_h2_gelu_dropout"
    got = pipelined(tmp_path, [case], 2)
    (seed,) = got[f"{case}/seeds"]
    # the worker fixes the seed sequence (onnxtrain.set_seed): the same masks and ~1e-7 differences every run
    compare(got, case, 2e-6, model=gelu_dropout_model(int(seed)))


@pytest.mark.mpi
def test_dropout_inside_a_split_block_drops_per_share(tmp_path) -> None:
    """A Dropout on the first block's hidden units splits with the block: rank r drops on its half with
    the agreed seed + SHARE_SEED_STEP × r, so the split trains as one process that cuts the hidden units
    in two halves and drops each with that rank's seed."""
    case = "adam_h2_gelu_block_dropout"
    got = pipelined(tmp_path, [case], 2)
    (seed,) = got[f"{case}/seeds"]  # rank 0's
    model = gelu_block_dropout_model((int(seed), int(seed) + SHARE_SEED_STEP))
    compare(got, case, 2e-6, model=model)
    blocks = find_mlp_blocks(gelu_block_dropout_model(), ["W1", "b1", "W2", "b2", "W3", "W4", "b4"], 2)
    assert len(blocks) == 2  # the block with its Dropout splits


@pytest.mark.mpi
def test_attention_dropout_drops_per_head_share(tmp_path) -> None:
    """A Dropout on the attention probabilities splits with the heads: rank r drops on its two heads of
    four with the agreed seed + SHARE_SEED_STEP × r, so the split trains as one process that cuts the
    heads in two halves and drops each with that rank's seed."""
    case = "sgd_h2_attention_dropout"
    got = pipelined(tmp_path, [case], 2)
    (seed,) = got[f"{case}/seeds"]  # rank 0's
    compare(got, case, 2e-6, model=attention_dropout_model((int(seed), int(seed) + SHARE_SEED_STEP)))
    model = attention_dropout_model()
    trainable = [t.name for t in model.graph.initializer if t.dims and t.data_type == onnx.TensorProto.FLOAT]
    assert len(find_attention_blocks(model, trainable, 2)) == 1  # the attention with its Dropout splits


@pytest.mark.mpi
def test_torch_exported_transformer_feed_forward_split(tmp_path, monkeypatch) -> None:
    torch_transformer_case(tmp_path, monkeypatch, "sgd_h2_torch_transformer", 2e-6)


@pytest.mark.mpi
def test_torch_exported_gpt_attention_heads_split(tmp_path, monkeypatch) -> None:
    """The GPT block's fused QKV attention (shapes computed from Shape at run time, a causal mask) and its MLP
    split over two ranks, two heads each: SGD steps as one process takes them."""
    torch_transformer_case(tmp_path, monkeypatch, "sgd_h2_torch_gpt", 2e-6, name="gpt_block")


@pytest.mark.mpi
def test_torch_exported_gpt_of_two_layers_heads_split(tmp_path, monkeypatch) -> None:
    """Two GPT layers: the second layer's head reshapes read shapes computed in a part the split cuts off
    (its stage's own shape inference found no ranks, and building failed); the ranks one process's
    inference finds are declared in each part, and SGD steps as one process takes them."""
    pytest.importorskip("torch")
    from tests.graph_transforms import nets

    path = str(tmp_path / "gpt2.onnx")
    onnx.save(nets.gpt(2, dropout=0.0, seq=10), path)
    monkeypatch.setenv("PIPELINE_TORCH_MODEL", path)
    case = "sgd_h2_torch_gpt"
    compare(pipelined(tmp_path, [case], 2, env={"PIPELINE_TORCH_MODEL": path}), case, 2e-6)


@pytest.mark.mpi
def test_torch_opset23_attention_op_heads_split(tmp_path, monkeypatch) -> None:
    """torch's opset-23 Llama-style block (ONNX's Attention op, 4 query heads over 2 key/value heads, causal;
    a SwiGLU MLP) split over two ranks: Adam steps as one process takes them."""
    torch_llama_case(tmp_path, monkeypatch, "adam_h2_torch_llama", 2e-6)


@pytest.mark.mpi
def test_onnxruntime_backend_split_attention(tmp_path, monkeypatch) -> None:
    pytest.importorskip("onnxruntime")
    torch_transformer_case(tmp_path, monkeypatch, "sgd_h2_torch_gpt", 1e-5, "gpt_block", "onnxruntime")


@pytest.mark.mpi
def test_onnxruntime_backend_split_blocks(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    env = {"ONNXTRAIN_TEST_BACKEND": "onnxruntime"}
    got = pipelined(tmp_path, ["adam_h2_clip", "adam_h2_bn_blocks"], 2, env=env)
    compare(got, "adam_h2_clip", 1e-5)
    compare(got, "adam_h2_bn_blocks", 1e-5)


# ---- which blocks split (one process) ---------------------------------------------------------------------
def test_blocks_found_and_their_shares() -> None:
    m = mlp_model()  # Gemm(transB) → Relu → Gemm(transB), hidden 16
    (b,) = find_mlp_blocks(m, ["W1", "b1", "W2", "b2"], 2)
    assert (b.w1, b.w1_axis, b.b1, b.w2, b.w2_axis, b.hidden) == ("W1", 0, "b1", "W2", 1, 16)
    sharded, cuts, split = shard_blocks(m, [b], 1, 2)
    assert split == {
        "W1": ("W1_column_rank_1", 0, 0, (16,)),
        "b1": ("b1_column_rank_1", 0, 0, (16,)),
        "W2": ("W2_row_rank_1", 1, 1, (16,)),
    }
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in sharded.graph.initializer}
    full = {t.name: onnx.numpy_helper.to_array(t) for t in m.graph.initializer}
    assert np.array_equal(inits["W1_column_rank_1"], full["W1"][8:]) and np.array_equal(
        inits["W2_row_rank_1"], full["W2"][:, 8:]
    )
    assert [c[0].tensor for c in cuts] == ["x_megatron_f0", "logits_megatron_g0"]
    # the second Gemm's bias is added after the ranks' sum, once
    assert [n.op_type for n in sharded.graph.node] == [
        "Identity",
        "Gemm",
        "Relu",
        "Gemm",
        "Add",
        "SoftmaxCrossEntropyLoss",
    ]
    assert partition(sharded, cuts, "loss").stage_of == [0, 1, 1, 1, 2, 2]
    onnx.checker.check_model(sharded, full_check=True)


def test_a_product_belongs_to_one_block() -> None:
    """Three layers (784 → 512 → 512 → 10 as torch exports them): the middle product ends the first block and
    opens no second one (the blocks would overlap)."""
    from onnx import TensorProto as T
    from onnx import helper

    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), n)
        for n, s in (("W1", (16, 8)), ("W2", (16, 16)), ("W3", (4, 16)))
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1"], ["a"], transB=1),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Gemm", ["ar", "W2"], ["b"], transB=1),
        helper.make_node("Relu", ["b"], ["br"]),
        helper.make_node("Gemm", ["br", "W3"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "mlp3",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    blocks = find_mlp_blocks(m, ["W1", "W2", "W3"], 2)
    assert [(b.w1, b.w2) for b in blocks] == [("W1", "W2")]
    sharded, cuts, _ = shard_blocks(m, blocks, 1, 2)
    assert partition(sharded, cuts, "loss").stages == 3


def test_which_blocks_do_not_split() -> None:
    weights = ["W1", "b1", "W2", "b2"]
    assert find_mlp_blocks(mlp_model(), weights, 3) == []  # 16 hidden units over 3 ranks
    # W2 not trained: the block splits all the same (its frozen share gets no update)
    assert [(b.w1, b.w2) for b in find_mlp_blocks(mlp_model(), ["W1", "b1", "b2"], 2)] == [("W1", "W2")]
    assert find_mlp_blocks(tied_model(), ["E", "b"], 2) == []  # E is read twice
    two = find_mlp_blocks(gelu_blocks_model(), ["W1", "b1", "W2", "b2", "W3", "W4", "b4"], 2)
    assert [(b.w1, b.b1, b.w2) for b in two] == [("W1", "b1", "W2"), ("W3", None, "W4")]
    # a trained scalar in the activation (its gradient would be each rank's part): that block stays whole
    m = gelu_blocks_model()
    m.graph.initializer.append(onnx.numpy_helper.from_array(np.float32(0.5), "gain"))
    next(n for n in m.graph.node if n.output[0] == "g1").input[1] = "gain"
    one = find_mlp_blocks(m, ["W1", "b1", "W2", "b2", "W3", "W4", "b4", "gain"], 2)
    assert [b.w1 for b in one] == ["W3"]


def test_horizontal_session_errors_in_one_process() -> None:
    def params(**kw) -> TrainingParameters:
        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "AdamOptimizer"
        p.horizontal_parallel_size = 2
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    model = mlp_model().SerializeToString()
    with pytest.raises(ValueError, match="launch with: mpiexec -n 2"):
        TrainingSession(model, params())
    # without stages, micro-batches would do nothing
    with pytest.raises(NotImplementedError, match="num_pipeline_micro_batches do not combine with "
                       "horizontal_parallel_size > 1 yet"):
        TrainingSession(model, params(num_pipeline_micro_batches=2))
    with pytest.raises(ValueError, match=r"horizontal_parallel_size × pipeline_parallel_size=4 needs a "
                       r"multiple of 4 MPI ranks"):
        TrainingSession(model, params(pipeline_parallel_size=2, pipeline_cut_info_string="hr"))


def test_blocks_side_by_side_cannot_be_cut_in_turn() -> None:
    """Two blocks reading the same input: the pieces between the cuts cannot run one after the other (the
    session turns this into a NotImplementedError naming the blocks)."""
    from onnx import TensorProto as T
    from onnx import helper

    rng = np.random.default_rng(0)
    inits = [
        onnx.numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
        for n, s in (("W1", (8, 16)), ("W2", (16, 4)), ("W3", (8, 16)), ("W4", (16, 4)))
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["a"]),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("MatMul", ["ar", "W2"], ["la"]),
        helper.make_node("MatMul", ["x", "W3"], ["b"]),
        helper.make_node("Relu", ["b"], ["br"]),
        helper.make_node("MatMul", ["br", "W4"], ["lb"]),
        helper.make_node("Add", ["la", "lb"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "heads",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    blocks = find_mlp_blocks(m, ["W1", "W2", "W3", "W4"], 2)
    assert [b.w1 for b in blocks] == ["W1", "W3"]
    sharded, cuts, _ = shard_blocks(m, blocks, 0, 2)
    with pytest.raises(ValueError, match="cut 2 separates stage 2 from stage 3"):
        partition(sharded, cuts, "loss")


# ---- attention heads (one process) -------------------------------------------------------------------------
def _split_blocks(model: onnx.ModelProto, trainable: list[str], size: int) -> list:
    mlp = find_mlp_blocks(model, trainable, size)
    taken = {k for b in mlp for k in (*b.entries, b.second)}
    return sorted([*mlp, *find_attention_blocks(model, trainable, size, taken)], key=lambda b: min(b.entries))


def _zoo_transformer() -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    """onnxtrain's transformer: separate Q, K and V products, constant head shapes ([0, 0, 4, 8])."""
    m = zoo.transformer(dim=32, heads=4, length=8)
    p = TrainingParameters()
    p.loss_output_name = "loss"  # its scalar constants are initializers: trained unless left out
    p.weights_not_to_train = {f"layer0.{c}" for c in ("attn.scale", "mlp.half", "mlp.inv_sqrt2", "mlp.one")}
    rng = np.random.default_rng(0)
    feeds = {"x": rng.integers(0, 10, (3, 8)), "y": rng.integers(0, 10, (3, 8))}
    return m, select_trainable(m, p), feeds


def _gpt() -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    """torch's export of a GPT block: a fused QKV product, head shapes computed from Shape, a causal mask."""
    pytest.importorskip("torch")
    from tests.models import export

    m, feeds, _ = export("gpt_block", training=True, with_loss=True, dropout=0.0)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    return m, select_trainable(m, p), feeds


@pytest.mark.parametrize("which", [_zoo_transformer, _gpt])
def test_attention_shares_sum_to_the_whole(which) -> None:
    """Each rank's share of the attention (its two heads of four) run by onnx.reference: the two partial
    output projections add up to the unsplit model's; the sharded graphs pass the full checker."""
    model, trainable, feeds = which()
    blocks = _split_blocks(model, trainable, 2)
    assert [type(b).__name__ for b in blocks] == ["AttentionBlock", "MlpBlock"]
    assert len(blocks[0].reshapes) == 4  # the three head splits and the merge
    _shares_sum_to_the_whole(model, blocks[0], feeds)


def _shares_sum_to_the_whole(model: onnx.ModelProto, block: Any, feeds: dict[str, np.ndarray]) -> None:
    """``block``'s output product on each of two ranks' models with that block sharded (onnx.reference) adds
    up to the unsplit model's; the sharded graphs pass the full checker."""
    from onnx.reference import ReferenceEvaluator

    blocks = [block]
    partial = model.graph.node[block.second].output[0]

    def value(m: onnx.ModelProto) -> np.ndarray:
        probe = onnx.ModelProto()
        probe.CopyFrom(m)
        probe.graph.output.append(onnx.helper.make_empty_tensor_value_info(partial))
        return ReferenceEvaluator(probe).run([partial], feeds)[0]

    shares = []
    for rank in range(2):
        sharded, cuts, _ = shard_blocks(model, blocks, rank, 2)
        onnx.checker.check_model(sharded, full_check=True)
        assert cuts[1][0].tensor == partial
        shares.append(value(sharded))
    whole = value(model)
    assert shares[0].shape == whole.shape
    assert not np.allclose(shares[0], whole, atol=1e-3)  # a share alone is not the whole
    np.testing.assert_allclose(shares[0] + shares[1], whole, rtol=1e-5, atol=1e-6)


def _llama_block() -> tuple[onnx.ModelProto, list[str], dict[str, np.ndarray]]:
    """torch's opset-23 export of a Llama-style block (tests/session/test_opset23_exports.py): Q, K and V
    products into ONNX's Attention op, 4 query heads over 2 key/value heads, causal; a SwiGLU MLP."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript", reason="torch's opset-23 exporter (dynamo) needs onnxscript")
    from tests.session.test_opset23_exports import _batch, export_llama

    m = export_llama(23)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    return m, select_trainable(m, p), _batch(0)


def test_attention_op_heads_and_gated_mlp_split() -> None:
    """ONNX's Attention op (torch's opset-23 export) splits by heads: each rank's 2 of 4 query heads with its
    1 of 2 key/value heads (each query head keeps its group); the SwiGLU MLP by its hidden units; the shares
    add up to the whole."""
    model, trainable, feeds = _llama_block()
    blocks = _split_blocks(model, trainable, 2)
    assert [type(b).__name__ for b in blocks] == ["AttentionBlock", "GatedMlpBlock"]
    attn, mlp = blocks
    assert [(w, segments) for w, _, segments in attn.columns] == [
        ("q.weight", (16,)), ("k.weight", (8,)), ("v.weight", (8,))
    ]
    _shares_sum_to_the_whole(model, attn, feeds)
    # the SwiGLU MLP: gate and up split by columns alike, down by rows
    assert [w for w, _, _ in mlp.columns] == ["gate.weight", "up.weight"] and mlp.rows[0] == "down.weight"
    _shares_sum_to_the_whole(model, mlp, feeds)


def test_attention_op_on_3d_inputs_splits_its_head_counts() -> None:
    """ONNX's Attention op on 3-D inputs (4 query heads over 2 key/value heads packed in the last axis,
    causal): each rank's share attends with half of each head count (its attributes halved); the shares of
    the output projection (onnx.reference running the op) add up to the whole."""
    model = attention3d_model()
    trainable = [t.name for t in model.graph.initializer]
    (attn,) = _split_blocks(model, trainable, 2)
    at = [k for k, n in enumerate(model.graph.node) if n.op_type == "Attention"]
    assert attn.heads == tuple(at) and [w for w, _, _ in attn.columns] == ["Wq", "Wk", "Wv"]
    sharded, _, _ = shard_blocks(model, [attn], 1, 2)
    (node,) = [n for n in sharded.graph.node if n.op_type == "Attention"]
    assert {a.name: a.i for a in node.attribute if a.name.endswith("_num_heads")} == {
        "q_num_heads": 2, "kv_num_heads": 1
    }
    x, y = batches(1, 5)[0]
    _shares_sum_to_the_whole(model, attn, {"x": x, "y": y})
    # head counts that do not divide by the ranks keep the attention whole
    odd = attention3d_model()
    next(a for n in odd.graph.node if n.op_type == "Attention" for a in n.attribute
         if a.name == "kv_num_heads").i = 1
    for w in ("Wk", "Wv"):  # one key/value head of 2
        next(t for t in odd.graph.initializer if t.name == w).CopyFrom(
            numpy_helper.from_array(np.ones((8, 2), np.float32), w))
    assert find_attention_blocks(odd, trainable, 2) == []


@pytest.mark.mpi
def test_attention_op_on_3d_inputs_trains_split(tmp_path) -> None:
    """The same model over two ranks (Adam with clipping): the weights move as one process's."""
    got = pipelined(tmp_path, ["adam_h2_heads_op_3d"], 2)
    compare(got, "adam_h2_heads_op_3d", 2e-6)


def test_fused_qkv_shares_take_each_part() -> None:
    """A fused QKV weight [3·d, d] (torch's layout): rank r keeps rows r of each of the three parts, and the
    shares join back in order."""
    full = np.arange(12 * 2, dtype=np.float32).reshape(12, 2)
    share = take_share(full, 0, 1, 2, (4, 4, 4))
    np.testing.assert_array_equal(share, full[[2, 3, 6, 7, 10, 11]])
    back = join_shares([take_share(full, 0, r, 2, (4, 4, 4)) for r in range(2)], 0, (4, 4, 4))
    np.testing.assert_array_equal(back, full)


def test_which_attention_does_not_split() -> None:
    model, trainable, _ = _zoo_transformer()
    assert find_attention_blocks(model, trainable, 3) == []  # 4 heads over 3 ranks
    assert find_attention_blocks(model, trainable, 8) == []  # fewer heads than ranks
    # a trained scale inside the attention (its gradient would be each rank's part)
    assert find_attention_blocks(model, [*trainable, "layer0.attn.scale"], 2) == []
    pytest.importorskip("torch")
    from tests.models import export

    # torch's nn.MultiheadAttention folds the heads into the batch axis ([T, N·heads, d/heads]): kept whole
    m, _, _ = export("transformer_encoder", training=True, with_loss=True, dropout=0.0)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    assert find_attention_blocks(m, select_trainable(m, p), 2) == []
    # attention dropout that drops splits with the heads (each rank drops on its own: tested below)
    m, _, _ = export("gpt_block", training=True, with_loss=True, dropout=0.1)
    assert len(find_attention_blocks(m, select_trainable(m, p), 2)) == 1


_DISAGREEING = r"""
import sys
sys.path.insert(0, sys.argv[1])
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.parallel.pipeline_worker import gelu_blocks_model

p = TrainingParameters()
p.loss_output_name = "loss"
p.training_optimizer_name = "AdamOptimizer"
p.horizontal_parallel_size = 2
p.set_gradients_as_graph_outputs = world().rank == 1
try:
    TrainingSession(gelu_blocks_model().SerializeToString(), p)
except RuntimeError as e:
    print(f"rank {world().rank}: {e}")
"""


@pytest.mark.mpi
def test_ranks_disagreeing_on_gradient_outputs_are_refused(tmp_path) -> None:
    """Gradient outputs are gathered over the ranks: a rank that asks for them when the other does not would
    wait forever in the gathering, so the session refuses the mismatch on every rank when it is built."""
    script = tmp_path / "disagree.py"
    script.write_text(_DISAGREEING)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = run_mpi(root, n=2, timeout=120, worker=str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    for rank in (0, 1):
        assert f"rank {rank}: the ranks do not hold the same model and horizontal setup" in r.stdout, r.stdout
    assert "set_gradients_as_graph_outputs" in r.stdout, r.stdout

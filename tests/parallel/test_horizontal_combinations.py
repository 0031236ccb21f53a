"""Horizontal (Megatron) parallelism in combination on ``mpiexec -n 2``, against one process training the
unsplit model on the same batches; and models the split must leave whole.

Models (``tests/parallel/horizontal_combo_worker.py``): two MLP blocks between LayerNorms (MatMul + bias,
ReLU; Gemm without biases, erf GELU), a GELU block with a Dropout inside, onnxtrain's transformer with 2 or 4
heads and a causal mask, torch 2.13's export of a 2-layer GPT (fused QKV, causal mask, tanh GELU). Options:
gradient_accumulation_steps 1 / 2 × clipping × float16 mixed precision × SGD / Adam / LAMB × numpy engine /
onnxruntime backend × a frozen weight. The default suite runs a pairwise selection in one ``mpiexec``;
``ONNXTRAIN_FULL_TESTS=1`` every combination.

Oracles, in one process without MPI (the numpy engine):

* SGD and Adam: the unsplit model, accumulating the same micro-batches.
* LAMB takes its trust ratio per share (README, as onnxruntime's Megatron): one process on the same model
  whose split weights are stored as two separate initializers (each rank's share) joined by ``Concat`` in
  the graph, so the function and the global norm are the unsplit model's and LAMB's ratio is per share.
* The Dropout inside a block: rank r drops on its half of the hidden units with the agreed seed + 7919·r;
  one process on the model whose hidden units are cut in halves, each dropped with that seed.

Tolerances (relative, per tensor: ‖got − want‖ / ‖want‖): 2e-5 in float32 on the numpy engine — the split
sums round differently from one product (≈1e-7 a step) and Adam's or LAMB's normalisation carries that
through 3 steps with a gain of order one, while a weight counted twice in the norm, a missed clip, a dropped
micro-batch or a share updated with the wrong gradient is ≥ 1e-3 off; 1e-4 on the onnxruntime backend
(its float32 kernels sum in another order than numpy's); 2e-2 under float16 mixed precision (the ranks add
float16 partial sums of half products, which round differently from one float16 product: ≈ 5e-4 a value;
the reference in mixed precision too). Norms fetched at each update: the same tolerances. Weights every rank
holds whole must be bit for bit equal on both ranks (and their optimizer state).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.parallel.megatron import find_mlp_blocks, shard_blocks
from onnxtrain.parallel.megatron_attention import find_attention_blocks


# ---- models the split must leave whole (one process) -------------------------------------------------------
def _shared_transpose_model() -> onnx.ModelProto:
    """A ReLU block whose first weight (torch's layout, read through one Transpose) is applied again after
    the block: the Transpose's output has two readers."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
        for n, s in (("W1", (16, 8)), ("W2", (8, 16)), ("W3", (4, 16)))
    ]
    nodes = [
        helper.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "W1t"], ["a"]),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Transpose", ["W2"], ["W2t"], perm=[1, 0]),
        helper.make_node("MatMul", ["ar", "W2t"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["h"]),
        helper.make_node("MatMul", ["h", "W1t"], ["a2"]),  # W1 again
        helper.make_node("Transpose", ["W3"], ["W3t"], perm=[1, 0]),
        helper.make_node("MatMul", ["a2", "W3t"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "shared_transpose",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_read_through_a_shared_transpose_stays_whole() -> None:
    """W1 reaches two products through one Transpose: it is not a block's weight (it was taken into two
    blocks, and cutting the second block's share from the first's failed on rank 1 with an IndexError)."""
    m = _shared_transpose_model()
    weights = ["W1", "W2", "W3"]
    assert find_mlp_blocks(m, weights, 2) == []
    assert find_attention_blocks(m, weights, 2) == []
    for rank in (0, 1):
        sharded, _, split = shard_blocks(m, [], rank, 2)
        assert split == {}

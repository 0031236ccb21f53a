"""Run under ``mpiexec -n N``: legacy sessions cut into pipeline stages, or with split MLP blocks.

``python pipeline_worker.py OUT.npz CASE[,CASE...]`` trains each case of ``CASES`` whose stage count equals
the number of ranks for ``STEPS`` steps, on the backend ``$ONNXTRAIN_TEST_BACKEND`` names (default numpy),
after checking every stage graph with ``onnx.checker`` (full check); rank 0 saves, per case, the loss of
every step, the state ``gather_state()`` assembles and the logits (or loss) of a forward-only run
(``<case>/losses``, ``<case>/state/<name>``, ``<case>/eval``). ``tests/parallel/test_pipeline.py`` compares
them with one process.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from onnxtrain import (  # noqa: E402
    RunOptions,
    SessionOptions,
    TrainingParameters,
    TrainingSession,
    set_seed,
    zoo,
)
from onnxtrain.parallel import world  # noqa: E402
from tests.session.helpers import batches, mlp_model  # noqa: E402

LR = np.array([0.05], np.float32)
STEPS = 6
BATCH = 16
CLIP = {"max_norm_clip": 0.3}  # below the global norm of these models' gradients: clipping acts


def _classifier(nodes: list, name: str, classes: int, inits: list) -> onnx.ModelProto:
    """A model of ``nodes`` from ``x`` [N, 8] and labels ``y`` [N] to ``loss`` and ``logits`` [N, classes]."""
    g = helper.make_graph(
        nodes,
        name,
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("loss", T.FLOAT, []),
            helper.make_tensor_value_info("logits", T.FLOAT, ["N", classes]),
        ],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def skip_model(seed: int = 3) -> onnx.ModelProto:
    """x → Gemm → Relu (r1) → Gemm → Relu (r2) → r1 + r2 → Gemm · scale → loss: cut at ``r1,r2`` into three
    stages, r1 passes through the middle stage, which also reads it; ``scale`` is a Constant the last stage
    takes."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
        for n, s in (
            ("W1", (16, 8)),
            ("b1", (16,)),
            ("W2", (16, 16)),
            ("b2", (16,)),
            ("W3", (4, 16)),
            ("b3", (4,)),
        )
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Gemm", ["r1", "W2", "b2"], ["h2"], transB=1),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Add", ["r1", "r2"], ["s"]),
        helper.make_node("Gemm", ["s", "W3", "b3"], ["z"], transB=1),
        helper.make_node("Constant", [], ["scale"], value=numpy_helper.from_array(np.float32(0.7))),
        helper.make_node("Mul", ["z", "scale"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _classifier(nodes, "skip", 4, inits)


def tied_model(seed: int = 5) -> onnx.ModelProto:
    """A GPT-style tied projection: logits = tanh(x·E + b)·Eᵀ, cut at ``t``. E is read in both stages (the
    ``Transpose`` of it, a node of initializers only, runs in the second), and so is one ``Constant`` shape
    (``Reshape`` on both sides of the cut): the stages sum E's gradients and each makes the shape itself."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 16)) * 0.3).astype(np.float32), "E"),
        numpy_helper.from_array((rng.standard_normal(16) * 0.1).astype(np.float32), "b"),
    ]
    nodes = [
        helper.make_node(
            "Constant", [], ["shape"], value=numpy_helper.from_array(np.array([-1, 16], np.int64))
        ),
        helper.make_node("MatMul", ["x", "E"], ["h0"]),
        helper.make_node("Reshape", ["h0", "shape"], ["h1"]),
        helper.make_node("Add", ["h1", "b"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Reshape", ["t", "shape"], ["t2"]),
        helper.make_node("Transpose", ["E"], ["Et"], perm=[1, 0]),
        helper.make_node("MatMul", ["t2", "Et"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _classifier(nodes, "tied", 8, inits)


def _dropout_constants(g: onnx.GraphProto) -> None:
    """The inputs the test models' Dropouts read: ``ratio`` 0.3 and ``train`` (training mode) true."""
    g.initializer.append(numpy_helper.from_array(np.array(0.3, np.float32), "ratio"))
    g.initializer.append(numpy_helper.from_array(np.array(True), "train"))


def dropout_model() -> onnx.ModelProto:
    """``mlp_model`` with a seeded Dropout after its first layer, in the first stage: the stage's forward
    draws the mask once and its backward reads it; with one micro-batch it draws as one process does."""
    m = mlp_model()
    g = m.graph
    g.node[1].output[0] = "hr0"
    g.node.insert(2, helper.make_node("Dropout", ["hr0", "ratio", "train"], ["hr"], seed=7))
    _dropout_constants(g)
    return m


def gelu_blocks_model(seed: int = 11) -> onnx.ModelProto:
    """Two MLP blocks as torch exports them (MatMul + bias Add, the erf GELU chain; then Tanh), with a
    residual around the first: both split over two ranks."""
    rng = np.random.default_rng(seed)
    shapes = (
        ("W1", (8, 16)),
        ("b1", (16,)),
        ("W2", (16, 8)),
        ("b2", (8,)),
        ("W3", (8, 16)),
        ("W4", (16, 4)),
        ("b4", (4,)),
    )
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n) for n, s in shapes]
    consts = [  # Constant nodes, as torch writes them: not trained
        helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.float32(v)))
        for n, v in (("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5))
    ]
    nodes = [
        *consts,
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Div", ["a1", "sqrt2"], ["d1"]),
        helper.make_node("Erf", ["d1"], ["e1"]),
        helper.make_node("Add", ["e1", "one"], ["p1"]),
        helper.make_node("Mul", ["a1", "p1"], ["q1"]),
        helper.make_node("Mul", ["q1", "half"], ["g1"]),
        helper.make_node("MatMul", ["g1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["o1"]),
        helper.make_node("Add", ["o1", "x"], ["r1"]),
        helper.make_node("MatMul", ["r1", "W3"], ["m3"]),
        helper.make_node("Tanh", ["m3"], ["t3"]),
        helper.make_node("MatMul", ["t3", "W4"], ["m4"]),
        helper.make_node("Add", ["m4", "b4"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _classifier(nodes, "gelu_blocks", 4, inits)


def _batch_norm(x: str, y: str, n: int, prefix: str, rng: np.random.Generator) -> tuple:
    """A training-mode BatchNormalization over ``n`` channels (its new running statistics as its second and
    third outputs, as ONNX requires in training mode) and its four initializers."""
    inits = [
        numpy_helper.from_array(v.astype(np.float32), f"{prefix}_{k}")
        for k, v in (
            ("scale", 1 + 0.2 * rng.standard_normal(n)),
            ("bias", 0.1 * rng.standard_normal(n)),
            ("mean", 0.1 * rng.standard_normal(n)),
            ("var", 1 + 0.3 * rng.uniform(size=n)),
        )
    ]
    outs = [y, f"{prefix}_mean_out", f"{prefix}_var_out"]
    node = helper.make_node(
        "BatchNormalization", [x, *(t.name for t in inits)], outs, training_mode=1, momentum=0.8
    )
    return node, inits


def bn_model(seed: int = 13, inference: bool = False) -> onnx.ModelProto:
    """x → Gemm → BatchNormalization (training mode; written for inference with ``inference``) → Relu
    (hr) → Gemm → BatchNormalization → Relu →
    Gemm → loss: cut at ``hr``, each stage updates the running statistics of its own normalization. The
    products before a normalization have no bias (as convolutions before one have none): its gradient
    would be zero but for rounding, which Adam turns into whole steps."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
        for n, s in (("W1", (16, 8)), ("W2", (16, 16)), ("W3", (4, 16)), ("b3", (4,)))
    ]
    bn1, i1 = _batch_norm("h", "hb", 16, "bn1", rng)
    bn2, i2 = _batch_norm("h2", "h2b", 16, "bn2", rng)
    if inference:  # as exported in eval mode: the training APIs still run them in training mode
        for bn in (bn1, bn2):
            del bn.output[1:]
            bn.attribute.remove(next(a for a in bn.attribute if a.name == "training_mode"))
    nodes = [
        helper.make_node("Gemm", ["x", "W1"], ["h"], transB=1),
        bn1,
        helper.make_node("Relu", ["hb"], ["hr"]),
        helper.make_node("Gemm", ["hr", "W2"], ["h2"], transB=1),
        bn2,
        helper.make_node("Relu", ["h2b"], ["r2"]),
        helper.make_node("Gemm", ["r2", "W3", "b3"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _classifier(nodes, "bn", 4, [*inits, *i1, *i2])


def bn_blocks_model() -> onnx.ModelProto:
    """``gelu_blocks_model`` on its input normalized by a training-mode BatchNormalization (ahead of the
    two split blocks and the residual): every rank computes it whole and keeps the same running
    statistics."""
    m = gelu_blocks_model()
    g = m.graph
    for n in g.node:
        n.input[:] = ["xb" if i == "x" else i for i in n.input]
    bn, inits = _batch_norm("x", "xb", 8, "bn", np.random.default_rng(17))
    g.node.insert(0, bn)
    g.initializer.extend(inits)
    return m


def attention3d_model(seed: int = 19) -> onnx.ModelProto:
    """ONNX's Attention op (opset 23) on 3-D inputs, the heads packed in the last axis and counted by its
    attributes: x → a product reshaped to 4 positions of 8 → Q (4 heads of 2), K and V (2 heads of 2) →
    causal Attention → output projection, residual → mean over the positions → logits."""
    rng = np.random.default_rng(seed)
    shapes = (("W0", (8, 32)), ("Wq", (8, 8)), ("Wk", (8, 4)), ("Wv", (8, 4)), ("Wo", (8, 8)), ("W5", (8, 4)),
              ("b5", (4,)))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n) for n, s in shapes]
    consts = {"seq": [-1, 4, 8], "positions": [1]}
    nodes = [
        *(helper.make_node("Constant", [], [n], value=numpy_helper.from_array(np.array(v, np.int64)))
          for n, v in consts.items()),
        helper.make_node("MatMul", ["x", "W0"], ["h0"]),
        helper.make_node("Reshape", ["h0", "seq"], ["s"]),
        *(helper.make_node("MatMul", ["s", w], [o]) for w, o in (("Wq", "q"), ("Wk", "k"), ("Wv", "v"))),
        helper.make_node("Attention", ["q", "k", "v"], ["a"], q_num_heads=4, kv_num_heads=2, is_causal=1),
        helper.make_node("MatMul", ["a", "Wo"], ["o"]),
        helper.make_node("Add", ["o", "s"], ["r"]),
        helper.make_node("ReduceMean", ["r", "positions"], ["m"], keepdims=0),
        helper.make_node("MatMul", ["m", "W5"], ["z"]),
        helper.make_node("Add", ["z", "b5"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    m = _classifier(nodes, "attention3d", 4, inits)
    m.opset_import[0].version = 23
    return m


def gelu_dropout_model(seed: int | None = None) -> onnx.ModelProto:
    """``gelu_blocks_model`` with a Dropout (ratio 0.3, unseeded unless ``seed``) on the residual sum
    between its two blocks: a node every rank of a split runs whole."""
    m = gelu_blocks_model()
    g = m.graph
    k = next(k for k, n in enumerate(g.node) if n.output[0] == "r1")
    g.node[k].output[0] = "r1_kept"
    extra = {} if seed is None else {"seed": int(seed)}
    g.node.insert(k + 1, helper.make_node("Dropout", ["r1_kept", "ratio", "train"], ["r1"], **extra))
    _dropout_constants(g)
    return m


def gelu_block_dropout_model(seeds: tuple[int, int] | None = None) -> onnx.ModelProto:
    """``gelu_blocks_model`` with a Dropout (ratio 0.3) on the first block's GELU output, inside the block:
    each rank of a two-way split drops on its half of the hidden units. With ``seeds``, the one-process
    equivalent: the hidden units cut in two halves, each dropped by a Dropout of that rank's seed."""
    m = gelu_blocks_model()
    g = m.graph
    k = next(k for k, n in enumerate(g.node) if n.output[0] == "g1")
    g.node[k].output[0] = "g1_kept"
    if seeds is None:
        new = [helper.make_node("Dropout", ["g1_kept", "ratio", "train"], ["g1"])]
    else:
        g.initializer.append(numpy_helper.from_array(np.array([8, 8], np.int64), "halves"))
        new = [
            helper.make_node("Split", ["g1_kept", "halves"], ["g1_0", "g1_1"], axis=-1),
            *(helper.make_node("Dropout", [f"g1_{r}", "ratio", "train"], [f"g1_{r}d"], seed=int(s))
              for r, s in enumerate(seeds)),
            helper.make_node("Concat", ["g1_0d", "g1_1d"], ["g1"], axis=-1),
        ]
    for j, n in enumerate(new):
        g.node.insert(k + 1 + j, n)
    _dropout_constants(g)
    return m


def transformer_model(layers: int = 1, dropout: bool = True) -> onnx.ModelProto:
    """onnxtrain's transformer (four heads) with a Dropout (ratio 0.3, unseeded) on each layer's attention
    probabilities [N, heads, T, T] (unless not ``dropout``); its scalars and shapes are Constant nodes
    (untrained)."""
    m = zoo.transformer(dim=32, heads=4, length=8, layers=layers)
    g = m.graph
    rng = np.random.default_rng(3)
    for t in g.initializer:  # the key biases start at zeros, their gradients rounding only: a start far from
        if t.name.endswith("attn.k.bias"):  # 0 compares their trained values in relative terms
            t.CopyFrom(numpy_helper.from_array(rng.normal(0, 0.1, tuple(t.dims)).astype(np.float32), t.name))
    fixed = [t for t in g.initializer if np.prod(t.dims) == 1 or t.data_type == T.INT64]
    for t in fixed:
        g.initializer.remove(t)
        g.node.insert(0, helper.make_node("Constant", [], [t.name], value=t))
    if not dropout:
        return m
    for k in reversed([k for k, n in enumerate(g.node) if n.op_type == "Softmax"]):
        probs = g.node[k].output[0]
        g.node[k].output[0] = f"{probs}_kept"
        g.node.insert(k + 1, helper.make_node("Dropout", [f"{probs}_kept", "ratio", "train"], [probs]))
    _dropout_constants(g)
    return m


def attention_dropout_model(seeds: tuple[int, int] | None = None) -> onnx.ModelProto:
    """``transformer_model()``: each rank of a two-way split drops on its two heads of four. With ``seeds``,
    the one-process equivalent: the heads cut in two halves, each dropped by a Dropout of that rank's seed."""
    m = transformer_model()
    if seeds is None:
        return m
    g = m.graph
    k = next(k for k, n in enumerate(g.node) if n.op_type == "Dropout")
    kept, probs = g.node[k].input[0], g.node[k].output[0]
    g.initializer.append(numpy_helper.from_array(np.array([2, 2], np.int64), "halves"))
    new = [
        helper.make_node("Split", [kept, "halves"], ["probs_0", "probs_1"], axis=1),
        *(helper.make_node("Dropout", [f"probs_{r}", "ratio", "train"], [f"probs_{r}d"], seed=int(s))
          for r, s in enumerate(seeds)),
        helper.make_node("Concat", ["probs_0d", "probs_1d"], [probs], axis=1),
    ]
    g.node.remove(g.node[k])
    for j, n in enumerate(new):
        g.node.insert(k + j, n)
    return m


# name → (model, stages, cut, micro-batches, optimizer, clip attributes)
CASES = {
    "adam2": (mlp_model, 2, "hr", 2, "AdamOptimizer", False),
    # halfway, gather_state() into a new session's load_state(strict=True), as a resumed run does
    "adam2_resumed": (mlp_model, 2, "hr", 2, "AdamOptimizer", False),
    "adam2_clip_m4": (mlp_model, 2, "hr", 4, "AdamOptimizer", True),
    "sgd2_consumer_cut": (mlp_model, 2, "hr-logits", 2, "SGDOptimizer", False),
    "lamb2_clip": (mlp_model, 2, "h", 2, "LambOptimizer", True),
    "adam2_tied_clip": (tied_model, 2, "t", 2, "AdamOptimizer", True),
    "adam2_dropout_m1": (dropout_model, 2, "hr", 1, "AdamOptimizer", True),
    # torch's export of a transformer encoder layer (tests/models.py, dropout 0), written by the test to
    # $PIPELINE_TORCH_MODEL, cut after its attention; SGD, as Adam turns the attention key bias's gradient,
    # zero but for rounding, into whole steps
    "sgd2_torch_transformer": (
        lambda: onnx.load(os.environ["PIPELINE_TORCH_MODEL"]),
        2,
        "/model/layers.0/norm1/LayerNormalization_output_0",
        2,
        "SGDOptimizer",
        False,
    ),
    "adam3_skip_clip": (skip_model, 3, "r1,r2", 2, "AdamOptimizer", True),
    # two stages × two data-parallel replicas (mpiexec -n 4): each pipeline gets half of every batch
    "adam2x2_tied_clip": (tied_model, 2, "t", 2, "AdamOptimizer", True),
    "lamb3_skip_m4": (skip_model, 3, "r1,r2", 4, "LambOptimizer", False),
    # mixed precision: float16 activations cross the cut; a loss scale that overflows skips every update
    "adam2_mp_clip": (mlp_model, 2, "hr", 2, "AdamOptimizer", True),
    "lamb2_mp_overflow": (mlp_model, 2, "hr", 2, "LambOptimizer", False),
    "adam2_mp_resumed": (mlp_model, 2, "hr", 2, "AdamOptimizer", True),  # its half twins loaded midway
}
# gradient accumulation over two runs on top of the micro-batches, counted or marked by the caller
# torch's opset-23 export of a Llama-style block (its batch size baked into its reshapes: one micro-batch),
# cut after the attention's residual: the first stage's backward differentiates ONNX's Attention body
CASES["adam2_torch_llama"] = (CASES["sgd2_torch_transformer"][0], 2, "add", 1, "AdamOptimizer", False)
CASES["adam2_acc2_clip"] = (mlp_model, 2, "hr", 2, "AdamOptimizer", True)
CASES["sgd2_acc2_legacy"] = (mlp_model, 2, "hr", 2, "SGDOptimizer", False)
ACCUMULATE = {"adam2_acc2_clip": 2, "sgd2_acc2_legacy": 2}  # runs per update (default 1)
# horizontal (Megatron) parallelism over two ranks: one stage, the MLP blocks split
CASES.update(
    {
        "adam_h2_clip": (mlp_model, 1, "", 1, "AdamOptimizer", True),
        "adam_h2_gelu_blocks": (gelu_blocks_model, 1, "", 1, "AdamOptimizer", True),
        "sgd_h2_torch_transformer": CASES["sgd2_torch_transformer"][:1] + (1, "", 1, "SGDOptimizer", False),
        # torch's export of a GPT block (tests/models.py, dropout 0): the fused QKV attention's heads split
        "sgd_h2_torch_gpt": CASES["sgd2_torch_transformer"][:1] + (1, "", 1, "SGDOptimizer", False),
        # torch's opset-23 export of a Llama-style block: ONNX's Attention op over grouped heads splits
        "adam_h2_torch_llama": CASES["sgd2_torch_transformer"][:1] + (1, "", 1, "AdamOptimizer", False),
    }
)
CASES["adam_h2x2_gelu_blocks"] = CASES["adam_h2_gelu_blocks"]  # the split × two data-parallel replicas
# gradient accumulation over each batch's two halves, counted by the session or marked by the caller
CASES["adam_h2_acc2_clip"] = (mlp_model, 1, "", 2, "AdamOptimizer", True)
CASES["adam_h2_acc2_legacy"] = (gelu_blocks_model, 1, "", 2, "AdamOptimizer", False)
CASES["adam_h2x2_acc2_clip"] = CASES["adam_h2_acc2_clip"]  # and two data-parallel replicas
HORIZONTAL = {
    "adam_h2_clip": 2,
    "adam_h2_gelu_blocks": 2,
    "sgd_h2_torch_transformer": 2,
    "sgd_h2_torch_gpt": 2,
    "adam_h2_torch_llama": 2,
    "adam_h2x2_gelu_blocks": 2,
    "adam_h2_acc2_clip": 2,
    "adam_h2_acc2_legacy": 2,
    "adam_h2x2_acc2_clip": 2,
}
# the split × two replicas with ZeRO stage 1 (also resumed halfway from the gathered state) or Adasum
H_ZERO = {"adam_h2x2_gelu_zero", "adam_h2x2_gelu_zero_resumed"}
H_ADASUM = {"adam_h2x2_gelu_adasum"}
for _case in (*sorted(H_ZERO), *H_ADASUM):
    CASES[_case] = CASES["adam_h2_gelu_blocks"]
    HORIZONTAL[_case] = 2
# two stages × two replicas with ZeRO stage 1 in each stage, or Adasum, and the same pipeline without
CASES["adam2x2_clip"] = (mlp_model, 2, "hr", 2, "AdamOptimizer", True)
CASES["adam2x2_zero_clip"] = CASES["adam2x2_clip"]
CASES["adam2x2_tied_zero_resumed"] = (tied_model, 2, "t", 2, "AdamOptimizer", True)
CASES["adam2x2_adasum_clip"] = CASES["adam2x2_clip"]
# and under mixed precision: a loss scale that trains (against the pipeline without ZeRO and one process) or
# overflows (every replica skips every update)
CASES["adam2x2_mp_clip"] = CASES["adam2x2_clip"]
CASES["adam2x2_mp_zero_clip"] = CASES["adam2x2_clip"]
CASES["adam2x2_mp_zero_overflow"] = (mlp_model, 2, "hr", 2, "AdamOptimizer", False)
CASES["adam2x2_mp_adasum_clip"] = CASES["adam2x2_clip"]
# enable_grad_norm_clip off: Adasum under float16 clips all the same (by the finite check's norm), as
# onnxruntime's Adasum builder turns clipping on in every optimizer node
CASES["adam2x2_mp_adasum_noclip"] = CASES["adam2x2_clip"]
NO_NORM_CLIP = {"adam2x2_mp_adasum_noclip"}  # enable_grad_norm_clip False in the distributed session
CASES["adam2x2_mp_adasum_overflow"] = CASES["adam2x2_mp_zero_overflow"]
# the second replica's inputs overflow float16 (its half of every batch times 1e5): no replica updates
CASES["adam2x2_mp_adasum_half_overflow"] = CASES["adam2x2_clip"]
ZERO = {"adam2x2_zero_clip", "adam2x2_tied_zero_resumed", "adam2x2_mp_zero_clip", "adam2x2_mp_zero_overflow",
        "adam2x2_bn_zero_clip"}
ADASUM = {"adam2x2_adasum_clip", "adam2x2_mp_adasum_clip", "adam2x2_mp_adasum_noclip",
          "adam2x2_mp_adasum_overflow",
          "adam2x2_mp_adasum_half_overflow", "adam2x2_mp_adasum_frozen"}
# Adasum under mixed precision with a first stage that trains nothing (its weights frozen)
CASES["adam2x2_mp_adasum_frozen"] = (mlp_model, 2, "hr", 2, "AdamOptimizer", False)
FROZEN = {"adam2x2_mp_adasum_frozen": {"W2", "b2"}}  # weights_to_train (default: all)
# a Dropout between the split blocks: the ranks draw the same masks (a seed they agree on)
CASES["adam_h2_gelu_dropout"] = (gelu_dropout_model, 1, "", 1, "AdamOptimizer", True)
HORIZONTAL["adam_h2_gelu_dropout"] = 2
# a Dropout inside a split block: each rank drops on its own share (its seed + SHARE_SEED_STEP × rank)
CASES["adam_h2_gelu_block_dropout"] = (gelu_block_dropout_model, 1, "", 1, "AdamOptimizer", True)
HORIZONTAL["adam_h2_gelu_block_dropout"] = 2
# a Dropout on the attention probabilities: each rank drops on its heads (its seed + SHARE_SEED_STEP × rank);
# SGD, as Adam turns the key bias's gradient (zero but for rounding: the softmax ignores it) into whole steps
CASES["sgd_h2_attention_dropout"] = (attention_dropout_model, 1, "", 1, "SGDOptimizer", False)
HORIZONTAL["sgd_h2_attention_dropout"] = 2
# two transformer layers (attention dropout in each), split or cut after the first layer, with and
# without transformer_layer_recompute (the first layer's activations rebuilt in the backward)
CASES["adam_h2_layers"] = (lambda: transformer_model(2), 1, "", 1, "AdamOptimizer", True)
CASES["adam2_layers"] = (lambda: transformer_model(2), 2, "layer0.res2", 2, "AdamOptimizer", True)
for _case in ("adam_h2_layers", "adam2_layers"):
    CASES[f"{_case}_recompute"] = CASES[_case]
HORIZONTAL.update({"adam_h2_layers": 2, "adam_h2_layers_recompute": 2})
# recompute options (the same bits as without them): GELU or checkpoints over the split, checkpoints in a
# pipeline whose first stage draws a Dropout mask
RECOMPUTE = {
    "adam_h2_layers_recompute": {"transformer_layer_recompute": True},
    "adam2_layers_recompute": {"transformer_layer_recompute": True},
    "adam_h2_gelu_recompute": {"gelu_recompute": True},
    "adam_h2_gelu_ckpt": {"recompute_checkpoints": ["a1", "r1"]},
    "adam2_dropout_ckpt_m1": {"recompute_checkpoints": ["h"]},
}
for _case in ("adam_h2_gelu_recompute", "adam_h2_gelu_ckpt"):
    CASES[_case] = CASES["adam_h2_gelu_blocks"]
    HORIZONTAL[_case] = 2
CASES["adam2_dropout_ckpt_m1"] = CASES["adam2_dropout_m1"]
# training-mode BatchNormalization: in both stages of a pipeline (its running statistics updated by each
# micro-batch's forward, as one process's micro-steps update them), and ahead of two split blocks
CASES["adam2_bn_clip"] = (bn_model, 2, "hr", 2, "AdamOptimizer", True)
CASES["adam2_bn_mp_clip"] = CASES["adam2_bn_clip"]  # and under mixed precision (LOSS_SCALE below)
CASES["adam2_bn_eval_clip"] = (lambda: bn_model(inference=True), 2, "hr", 2, "AdamOptimizer", True)
# two stages × two replicas (each replica keeps its own statistics), with ZeRO stage 1 and without
CASES["adam2x2_bn_clip"] = CASES["adam2_bn_clip"]
CASES["adam2x2_bn_zero_clip"] = CASES["adam2_bn_clip"]
CASES["adam_h2_bn_blocks"] = (bn_blocks_model, 1, "", 1, "AdamOptimizer", True)
HORIZONTAL["adam_h2_bn_blocks"] = 2
# ONNX's Attention op on 3-D inputs: each rank's heads, its head counts halved
CASES["adam_h2_heads_op_3d"] = (attention3d_model, 1, "", 1, "AdamOptimizer", True)
HORIZONTAL["adam_h2_heads_op_3d"] = 2
# data-parallel replicas (default 1)
REPLICAS = {"adam2x2_tied_clip": 2, "adam_h2x2_gelu_blocks": 2, "adam_h2x2_acc2_clip": 2}
REPLICAS.update({c: 2 for c in (*H_ZERO, *H_ADASUM)})
REPLICAS.update({c: 2 for c in ("adam2x2_clip", "adam2x2_mp_clip", "adam2x2_bn_clip", *ZERO, *ADASUM)})
# the mixed-precision cases' loss scale
LOSS_SCALE = {"adam2_mp_clip": 256.0, "lamb2_mp_overflow": 1e30, "adam2_mp_resumed": 256.0,
              "adam2_bn_mp_clip": 256.0}
LOSS_SCALE.update(  # the half overflow's comes from its inputs, not its scale
    {c: 1e30 if c.endswith("_overflow") and "_half_" not in c else 256.0 for c in CASES if "x2_mp_" in c}
)
# the split under mixed precision: a loss scale that trains (against one process), also with ZeRO over two
# replicas, or that overflows (every update skipped)
for _case in ("adam_h2_mp_gelu", "adam_h2_mp_overflow", "adam_h2x2_mp_gelu", "adam_h2x2_mp_gelu_zero"):
    CASES[_case] = CASES["adam_h2_gelu_blocks"]
    HORIZONTAL[_case] = 2
    LOSS_SCALE[_case] = 1e30 if _case.endswith("_overflow") else 256.0
H_ZERO.add("adam_h2x2_mp_gelu_zero")
REPLICAS.update({"adam_h2x2_mp_gelu": 2, "adam_h2x2_mp_gelu_zero": 2})
# the gradients as outputs (set_gradients_as_graph_outputs): fetched with the first step's update and on
# the fetches' path alone after the last (a tied weight's, from both stages; under mixed precision too)
GRADIENTS = {"adam2_tied_grads": "adam2_tied_clip", "adam2_mp_grads": "adam2_mp_clip"}
# and over the two-way split: the split weights' gradients put together from the ranks' shares
GRADIENTS.update({"adam_h2_gelu_grads": "adam_h2_gelu_blocks", "adam_h2_mp_grads": "adam_h2_mp_gelu"})
for _case, _plain in GRADIENTS.items():
    CASES[_case] = CASES[_plain]
    if _plain in HORIZONTAL:
        HORIZONTAL[_case] = HORIZONTAL[_plain]
    if _plain in LOSS_SCALE:
        LOSS_SCALE[_case] = LOSS_SCALE[_plain]

# pipeline stages whose blocks are split (mpiexec -n 4: 2 stages × 2 shares), against one process
# accumulating the micro-batches: the GELU blocks cut between them, also with gradient accumulation over runs
# and under mixed precision; two transformer layers (their attention heads and MLPs split) cut after the first
CASES["adam2_h2_gelu_clip"] = (gelu_blocks_model, 2, "r1", 2, "AdamOptimizer", True)
CASES["adam2_h2_acc2_clip"] = CASES["adam2_h2_gelu_clip"]
ACCUMULATE["adam2_h2_acc2_clip"] = 2
CASES["adam2_h2_mp_gelu"] = CASES["adam2_h2_gelu_clip"]
LOSS_SCALE["adam2_h2_mp_gelu"] = 256.0
# (SGD: Adam would turn the key biases' gradients, zero but for rounding, into whole steps)
CASES["sgd2_h2_layers"] = (
    lambda: transformer_model(2, dropout=False), 2, "layer0.res2", 2, "SGDOptimizer", False
)
# the tied projection (nothing of it splits: each stage whole on both ranks), its tied weight summed over the
# stages
CASES["adam2_h2_tied_clip"] = (tied_model, 2, "t", 2, "AdamOptimizer", True)
CASES["sgd2_h2_layers_recompute"] = CASES["sgd2_h2_layers"]  # the same bits with the first layer recomputed
RECOMPUTE["sgd2_h2_layers_recompute"] = {"transformer_layer_recompute": True}
# and cut at the first block's partial output: the stage sends the ranks' sum
CASES["adam2_h2_cut_at_sum_clip"] = (gelu_blocks_model, 2, "m2", 2, "AdamOptimizer", True)
STAGED_SPLITS = (
    "adam2_h2_gelu_clip",
    "adam2_h2_acc2_clip",
    "adam2_h2_mp_gelu",
    "sgd2_h2_layers",
    "adam2_h2_cut_at_sum_clip",
    "sgd2_h2_layers_recompute",
    "adam2_h2_tied_clip",
)
HORIZONTAL.update({c: 2 for c in STAGED_SPLITS})
# × two data-parallel replicas (mpiexec -n 8), with ZeRO stage 1 over them, with Adasum and without
CASES["adam2_h2x2_gelu_clip"] = CASES["adam2_h2x2_gelu_zero_clip"] = CASES["adam2_h2_gelu_clip"]
HORIZONTAL.update({"adam2_h2x2_gelu_clip": 2, "adam2_h2x2_gelu_zero_clip": 2})
REPLICAS.update({"adam2_h2x2_gelu_clip": 2, "adam2_h2x2_gelu_zero_clip": 2})
H_ZERO.add("adam2_h2x2_gelu_zero_clip")
CASES["adam2_h2x2_gelu_adasum"] = CASES["adam2_h2_gelu_clip"]  # and Adasum over the replicas
HORIZONTAL["adam2_h2x2_gelu_adasum"] = REPLICAS["adam2_h2x2_gelu_adasum"] = 2
H_ADASUM.add("adam2_h2x2_gelu_adasum")
# under mixed precision, a loss scale that overflows: no replica updates
CASES["adam2_h2x2_mp_adasum_overflow"] = CASES["adam2_h2_gelu_clip"]
HORIZONTAL["adam2_h2x2_mp_adasum_overflow"] = REPLICAS["adam2_h2x2_mp_adasum_overflow"] = 2
H_ADASUM.add("adam2_h2x2_mp_adasum_overflow")
LOSS_SCALE["adam2_h2x2_mp_adasum_overflow"] = 1e30
GRADIENTS["adam2_h2_gelu_grads"] = "adam2_h2_gelu_clip"  # each stage's, put together from its shares
CASES["adam2_h2_gelu_grads"] = CASES["adam2_h2_gelu_clip"]
HORIZONTAL["adam2_h2_gelu_grads"] = 2


def ranks(case: str) -> int:
    """The MPI ranks a case runs on: stages × replicas × shares."""
    return CASES[case][1] * REPLICAS.get(case, 1) * HORIZONTAL.get(case, 1)

def parameters(case: str, model: onnx.ModelProto, pipelined: bool) -> TrainingParameters:
    """The case's options: distributed (``pipelined``), or one process accumulating the same micro-batches."""
    _, stages, cut, micro, opt, clip = CASES[case]
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    if clip:
        p.optimizer_attributes_map = {t.name: dict(CLIP) for t in model.graph.initializer if t.dims}
    replicas = REPLICAS.get(case, 1)
    p.use_mixed_precision = case in LOSS_SCALE
    p.weights_to_train = set(FROZEN.get(case, ()))
    p.set_gradients_as_graph_outputs = case in GRADIENTS
    for k, v in RECOMPUTE.get(case, {}).items() if pipelined else ():
        setattr(p, k, v)
    if pipelined and case in HORIZONTAL:
        p.horizontal_parallel_size = HORIZONTAL[case]
        p.data_parallel_size = replicas
        p.deepspeed_zero_stage = int(case in H_ZERO)
        p.enable_adasum = case in H_ADASUM
        if stages > 1:  # and pipeline stages: micro-batches cut from each run
            p.pipeline_parallel_size = stages
            p.pipeline_cut_info_string = cut
            p.num_pipeline_micro_batches = micro
            p.gradient_accumulation_steps = ACCUMULATE.get(case, 1)
            p.gradient_accumulation_mode = "auto"
        elif micro > 1:  # the split session accumulates the micro-batches itself, one run each
            p.gradient_accumulation_steps = micro
            p.gradient_accumulation_mode = "legacy" if case.endswith("_legacy") else "auto"
    elif pipelined:
        p.pipeline_parallel_size = stages
        p.pipeline_cut_info_string = cut
        p.num_pipeline_micro_batches = micro
        p.data_parallel_size = replicas
        p.deepspeed_zero_stage = int(case in ZERO)
        p.enable_adasum = case in ADASUM
        p.enable_grad_norm_clip = case not in NO_NORM_CLIP
        if case in ACCUMULATE:
            p.gradient_accumulation_steps = ACCUMULATE[case]
            p.gradient_accumulation_mode = "legacy" if case.endswith("_legacy") else "auto"
    else:
        p.gradient_accumulation_steps = micro * replicas * ACCUMULATE.get(case, 1)
        p.gradient_accumulation_mode = "auto"
    return p


def case_feeds(case: str, steps: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """The feeds of ``steps`` batches for a case's model (its ``x``/``y``, or the torch model's tokens)."""
    if "torch_llama" in case:  # 6 positions of 16 features, 5 targets each
        rng = np.random.default_rng(seed)
        return [
            {
                "x": rng.standard_normal((BATCH, 6, 16)).astype(np.float32),
                "target": rng.standard_normal((BATCH, 6, 5)).astype(np.float32),
            }
            for _ in range(steps)
        ]
    if "torch_gpt" in case:  # 10 tokens of 40, a label per token
        rng = np.random.default_rng(seed)
        return [
            {
                "tokens": rng.integers(0, 40, (BATCH, 10)).astype(np.int64),
                "labels": rng.integers(0, 40, (BATCH, 10)).astype(np.int64),
            }
            for _ in range(steps)
        ]
    if "torch" in case:
        rng = np.random.default_rng(seed)
        return [
            {
                "tokens": rng.integers(0, 50, (BATCH, 12)).astype(np.int64),
                "labels": rng.integers(0, 5, BATCH).astype(np.int64),
            }
            for _ in range(steps)
        ]
    if "attention" in case or "layers" in case:  # onnxtrain's transformer: 8 tokens of 10, a label per token
        rng = np.random.default_rng(seed)
        return [{n: rng.integers(0, 10, (BATCH, 8)) for n in ("x", "y")} for _ in range(steps)]
    out = [{"x": x, "y": y} for x, y in batches(steps, BATCH, seed=seed)]
    if case.endswith("_half_overflow"):
        for feeds in out:
            feeds["x"][BATCH // 2 :] *= 1e5
    return out


def scale_feed(case: str) -> dict[str, np.ndarray]:
    """The loss scale a mixed-precision case feeds (under the pass's input name), else nothing."""
    return {"loss_scale": np.array([LOSS_SCALE[case]], np.float32)} if case in LOSS_SCALE else {}


def eval_output(case: str) -> str | None:
    """The output a forward-only run fetches (None: the model has none but its loss)."""
    return None if "torch" in case else "logits"


def gradient_names(sess: TrainingSession) -> list[str]:
    """The session's gradient outputs (``<w>_grad``, and a half twin's ``<w>_fp16_grad``)."""
    return [o.name for o in sess.get_outputs() if o.name.endswith("_grad")]


def main(out: str, cases: list[str]) -> None:
    saved: dict[str, np.ndarray] = {}
    for case in cases:
        build, stages, *_ = CASES[case]
        replicas = REPLICAS.get(case, 1)
        if ranks(case) != world().size:
            continue
        model = build()
        set_seed(2026)  # unseeded random nodes draw the same values in every run of the test
        so = SessionOptions()
        backend = os.environ.get("ONNXTRAIN_TEST_BACKEND", "")
        if backend:
            so.add_session_config_entry("onnxtrain.backend", backend)
        p = parameters(case, model, True)
        dump = f"{out}.{case}.onnx"  # each rank writes <out>.<case>.stage<k>.onnx
        if case not in HORIZONTAL:
            p.model_with_training_graph_path = dump
        sess = TrainingSession(model.SerializeToString(), p, so)
        if case not in HORIZONTAL:  # the stage's dump holds its state's values: it runs on its own
            written = onnx.load(f"{out}.{case}.stage{sess._stage}.onnx")
            onnx.checker.check_model(written, full_check=True)
            inits = {t.name for t in written.graph.initializer}
            state = [i.name for i in written.graph.input if i.name in sess._store]
            assert set(state) <= inits, (case, sorted(set(state) - inits))
            # the Dropouts' shared training_mode too (the model's mode), so that no run has to feed it
            shared = [i.name for i in written.graph.input if i.name == "training_mode"]
            assert set(shared) <= inits, case
        graphs = (
            [g for sg in sess._pieces.values() for g in sg.graphs.values()]
            + [g for g in (sess._update_graph, sess._zero_graph) if g is not None]
            if case in HORIZONTAL
            else list(sess._sg.graphs.values())
        )
        for graph in graphs:  # every graph a rank runs is standard, checked ONNX
            onnx.checker.check_model(graph, full_check=True)
        if case in RECOMPUTE:  # how many values the rank's graphs rebuild
            made = [o for g in graphs for n in g.graph.node for o in n.output]
            saved[f"{case}/recomputed"] = np.array(sum("_recompute" in o for o in made))
        losses = []
        for step, feeds in enumerate(case_feeds(case, STEPS)):
            if case.endswith("_resumed") and step == STEPS // 2:
                state = sess.gather_state()
                sess = TrainingSession(model.SerializeToString(), parameters(case, model, True), so)
                sess.load_state(state, strict=True)
            mine = {
                n: np.split(v, replicas)[getattr(sess, "data_parallel_rank", 0)] for n, v in feeds.items()
            }
            # a horizontal case's micro-batches are runs of their own; a pipeline's, cuts of one run
            split_runs = case in HORIZONTAL and stages == 1
            micro = CASES[case][3] if split_runs else 1
            runs = micro if split_runs else ACCUMULATE.get(case, 1)  # runs per update
            for k in range(micro):
                part = {n: np.split(v, micro)[k] for n, v in mine.items()}
                ro = RunOptions()
                fetch = ["loss"]
                if case.endswith("_legacy") and (step * micro + k) % runs < runs - 1:  # a marked micro-step
                    ro.only_execute_path_to_fetches = True
                    fetch.append("Group_Accumulated_Gradients")
                if case in GRADIENTS and step == 0:  # the first step's gradients, with its update
                    fetch += gradient_names(sess)
                got = sess.run(fetch, {**part, **scale_feed(case), "Learning_Rate": LR}, ro)
                loss = got[0]
                if case in GRADIENTS and step == 0:
                    saved.update({f"{case}/grads0/{n}": v for n, v in zip(fetch[1:], got[1:])})
            losses.append(float(loss))
        ro = RunOptions()
        ro.only_execute_path_to_fetches = True
        fetch = eval_output(case) or "loss"
        (saved[f"{case}/eval"],) = sess.run(
            [fetch], {**case_feeds(case, 1, seed=9)[0], **scale_feed(case)}, ro
        )
        if fetch != "loss":  # a forward-only run may leave the labels out, as one process's may (Dropout off)
            quiet = RunOptions()
            quiet.only_execute_path_to_fetches, quiet.training_mode = True, False
            labelled = case_feeds(case, 1, seed=9)[0]
            unlabelled = {n: v for n, v in labelled.items() if n != "y"}
            (saved[f"{case}/eval_labelled"],) = sess.run([fetch], labelled, quiet)
            (saved[f"{case}/eval_unlabelled"],) = sess.run([fetch], unlabelled, quiet)
        if case in GRADIENTS:  # on the fetches' path alone: no update (the state is the plain case's)
            names = gradient_names(sess)
            got = sess.run(names, {**case_feeds(case, 1, seed=9)[0], **scale_feed(case)}, ro)
            saved.update({f"{case}/grads_eval/{n}": v for n, v in zip(names, got)})
        state = sess.gather_state()
        if case in HORIZONTAL:  # the weights rank 0 holds a share of (those of its stage)
            info = sess.get_partition_info_map()
            split = sorted(w for w, d in info.items() if d.get("megatron_row_partition", [-1]) != [-1])
            saved[f"{case}/split"] = np.array(split)
        if case in HORIZONTAL:  # the seeds the ranks agreed on for the unseeded Dropout nodes
            nodes = [n for sg in sess._pieces.values() for n in sg.graphs["stage"].graph.node]
            nodes = [n for n in nodes if n.op_type == "Dropout"]
            seeds = [a.i for n in nodes for a in n.attribute if a.name == "seed"]
            saved[f"{case}/seeds"] = np.array(seeds, np.int64)
        saved[f"{case}/losses"] = np.array(losses)
        saved.update({f"{case}/state/{k}": v for k, v in state.items()})
    if world().rank == 0:
        np.savez(out, **saved)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","))

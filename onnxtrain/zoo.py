"""Built-in models made with onnx.helper: forward graph plus an in-graph loss, ready to train.

Every builder returns a checked model (``onnx.checker`` full check, the large weights' values aside: see
:func:`~onnxtrain.ir.large.check_model_arrays`) with inputs ``x`` (and ``y``, the labels, when ``loss`` is
set) and outputs ``loss`` (when ``loss`` is set) and ``logits``, whose class axis is 1. Weights are drawn
from ``seed``, so the same arguments give the same model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import make_model
from onnxtrain.ir.large import check_model_arrays
from onnxtrain.ir.stream import array_raw, elem_type
from onnxtrain.version import PRODUCER

OPSET = 17
_DRAW_CHUNK = 1 << 18  # the values :meth:`_Graph.normal` draws at a time


class BuilderArgumentError(ValueError):
    """A builder argument out of range; ``arg`` names it (the config reports ``model.args.<arg>``)."""

    def __init__(self, arg: str, message: str):
        self.arg = arg
        self.message = message
        super().__init__(f"{arg}: {message}")


def _check_sizes(low: int = 1, **sizes: int | Sequence[int]) -> None:
    """A BuilderArgumentError naming the first of ``sizes`` (an int or a list of ints) below ``low``."""
    for arg, value in sizes.items():
        single = isinstance(value, (int, np.integer))
        values = [int(value)] if single else [int(v) for v in value]
        if any(v < low for v in values):
            what = "a positive int" if low == 1 else f"an int >= {low}"
            raise BuilderArgumentError(arg, f"expected {what}{'' if single else ' each'}, "
                                            f"got {values[0] if single else values}")


def _check_image(image: Sequence[int]) -> None:
    """A BuilderArgumentError naming ``image`` unless it holds three sizes, [channels, height, width]."""
    if len(image) != 3:
        raise BuilderArgumentError("image", "expected three sizes [channels, height, width], got "
                                            f"{list(image)}")


class _Graph:
    """Nodes and initializers of a model under construction, with unique value names."""

    def __init__(self, seed: int):
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise BuilderArgumentError("seed", f"expected an int >= 0, got {seed!r}")
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[tuple[str, np.ndarray]] = []  # (name, value): the initializers, in order
        self._count = 0

    def init(self, name: str, value: np.ndarray) -> str:
        self.inits.append((name, np.ascontiguousarray(value)))
        return name

    def normal(self, name: str, shape: Sequence[int], std: float) -> str:
        """A float32 initializer of normal values times ``std``, drawn in float64 a chunk at a time (the
        values of one draw of the whole: the generator takes its values one after the other)."""
        value = np.empty(shape, np.float32)
        flat = value.reshape(-1)
        for at in range(0, flat.size, _DRAW_CHUNK):
            part = self.rng.standard_normal(min(_DRAW_CHUNK, flat.size - at))
            part *= std
            flat[at:at + part.size] = part
        return self.init(name, value)

    def const(self, name: str, value: float | Sequence[int] | np.ndarray, dtype: type = np.float32) -> str:
        """An initializer (a float one is a weight the sessions train)."""
        return self.init(name, np.asarray(value, dtype))

    def fixed(self, name: str, value: float | np.ndarray) -> str:
        """A float32 Constant node: a value of the model's math (a scale, a sampling grid) that no session
        trains, as an initializer would be."""
        arr = np.ascontiguousarray(np.asarray(value, np.float32))
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(arr, name)))
        return name

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None,
           extra_outputs: Sequence[str] = (), **attrs) -> str:
        """Append a node; returns its (first) output name."""
        if out is None:
            self._count += 1
            out = f"{op_type.lower()}_{self._count}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out, *extra_outputs], name=out, **attrs))
        return out

    def finish(self, name: str, inputs: list[onnx.ValueInfoProto], logits_shape: list,
               labels_shape: list | None, logits: str) -> onnx.ModelProto:
        outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, logits_shape)]
        if logits != "logits":
            self.op("Identity", [logits], "logits")
        if labels_shape is not None:
            self.op("SoftmaxCrossEntropyLoss", ["logits", "y"], "loss")
            inputs = [*inputs, helper.make_tensor_value_info("y", TensorProto.INT64, labels_shape)]
            outputs.insert(0, helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
        graph = helper.make_graph(self.nodes, name, inputs, outputs)
        model = make_model(graph, OPSET, **PRODUCER)
        check_model_arrays(model, self.inits)
        self.inits.reverse()
        while self.inits:  # each value held once: an array until it is the bytes of the model's tensor
            init, value = self.inits.pop()
            t = model.graph.initializer.add(name=init, data_type=elem_type(value), dims=value.shape)
            raw = bytes(array_raw(value))
            del value
            t.raw_data = raw
            del raw
        return model


def mlp(sizes: Sequence[int], seed: int = 0, loss: bool = True) -> onnx.ModelProto:
    """An MLP ``sizes[0] → … → sizes[-1]`` with ReLU; inputs ``x`` [N, sizes[0]] (and ``y`` int64 [N]).

    Outputs ``loss`` (softmax cross-entropy, mean) when ``loss`` is set, then ``logits``. Weights
    are He-initialised from ``seed`` and named ``fc<k>.weight`` / ``fc<k>.bias`` like torch's Linear.
    """
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least an input and an output size, got {list(sizes)}")
    _check_sizes(sizes=sizes)
    g = _Graph(seed)
    h = "x"
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        g.normal(f"fc{k}.weight", (b, a), math.sqrt(2.0 / a))
        g.const(f"fc{k}.bias", np.zeros(b))
        out = "logits" if k == len(sizes) - 2 else f"h{k}"
        g.op("Gemm", [h, f"fc{k}.weight", f"fc{k}.bias"], out, transB=1)
        if out != "logits":
            h = g.op("Relu", [out], f"{out}_relu")
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])]
    return g.finish("mlp", inputs, ["N", sizes[-1]], ["N"] if loss else None, "logits")


def cnn(channels: Sequence[int] = (8, 16), classes: int = 10, image: Sequence[int] = (1, 8, 8),
        batch_norm: bool = False, global_pool: bool = False, seed: int = 0,
        loss: bool = True) -> onnx.ModelProto:
    """A LeNet-style CNN for small images such as the 1×8×8 digits; input ``x`` [N, C, H, W].

    Each block is Conv 3×3 (pad 1) → [BatchNormalization in training mode] → Relu → MaxPool 2×2;
    then GlobalAveragePool (``global_pool``) or Flatten, and a Gemm to ``classes`` logits.
    """
    _check_image(image)
    _check_sizes(channels=channels, classes=classes, image=image)
    g = _Graph(seed)
    _conv_classifier(g, "x", channels, classes, image, batch_norm, global_pool)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", *(int(v) for v in image)])]
    return g.finish("cnn", inputs, ["N", classes], ["N"] if loss else None, "logits")


def _conv_classifier(g: _Graph, x: str, channels: Sequence[int], classes: int, image: Sequence[int],
                     batch_norm: bool = False, global_pool: bool = False) -> None:
    """:func:`cnn`'s blocks and Gemm on ``x`` (an image of shape ``image``), ending in ``logits``."""
    if not channels:
        raise ValueError("cnn needs at least one convolution (channels is empty)")
    c, hgt, wid = (int(v) for v in image)
    h = x
    for k, out_c in enumerate(channels):
        g.normal(f"conv{k}.weight", (out_c, c, 3, 3), math.sqrt(2.0 / (c * 9)))
        g.const(f"conv{k}.bias", np.zeros(out_c))
        h = g.op("Conv", [h, f"conv{k}.weight", f"conv{k}.bias"], f"conv{k}", pads=[1, 1, 1, 1],
                 kernel_shape=[3, 3])
        if batch_norm:
            names = [g.const(f"bn{k}.{p}", np.full(out_c, v)) for p, v in
                     (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0))]
            h = g.op("BatchNormalization", [h, *names], f"bn{k}", [f"bn{k}.mean_out", f"bn{k}.var_out"],
                     training_mode=1, momentum=0.9)
        h = g.op("Relu", [h], f"relu{k}")
        if hgt >= 2 and wid >= 2:
            h = g.op("MaxPool", [h], f"pool{k}", kernel_shape=[2, 2], strides=[2, 2])
            hgt, wid = hgt // 2, wid // 2
        c = out_c
    if global_pool:
        h = g.op("Flatten", [g.op("GlobalAveragePool", [h], "gap")], "flat")
        features = c
    else:
        h = g.op("Flatten", [h], "flat")
        features = c * hgt * wid
    g.normal("fc.weight", (classes, features), math.sqrt(1.0 / features))
    g.const("fc.bias", np.zeros(classes))
    g.op("Gemm", [h, "fc.weight", "fc.bias"], "logits", transB=1)


def spatial_transformer(channels: Sequence[int] = (8, 16), classes: int = 10,
                        image: Sequence[int] = (1, 8, 8), hidden: int = 32, seed: int = 0,
                        loss: bool = True) -> onnx.ModelProto:
    """A spatial transformer network: a small localisation net (Gemm → Relu → Gemm) predicts an affine
    transform per image, starting at the identity; the image is resampled along the transformed grid
    (``GridSample``, bilinear) and classified by :func:`cnn`'s blocks. Input ``x`` [N, C, H, W]."""
    _check_image(image)
    _check_sizes(channels=channels, classes=classes, image=image, hidden=hidden)
    c, hgt, wid = (int(v) for v in image)
    g = _Graph(seed)
    flat = g.op("Flatten", ["x"], "loc_flat")
    g.normal("loc0.weight", (hidden, c * hgt * wid), math.sqrt(2.0 / (c * hgt * wid)))
    g.const("loc0.bias", np.zeros(hidden))
    h = g.op("Relu", [g.op("Gemm", [flat, "loc0.weight", "loc0.bias"], "loc0", transB=1)], "loc0_relu")
    g.const("loc1.weight", np.zeros((6, hidden)))  # the identity transform to start with
    g.const("loc1.bias", [1.0, 0.0, 0.0, 0.0, 1.0, 0.0])
    theta = g.op("Reshape", [g.op("Gemm", [h, "loc1.weight", "loc1.bias"], "loc1", transB=1),
                             g.const("theta_shape", [-1, 2, 3], np.int64)], "theta")
    # the sampling grid: base (x, y, 1) per output pixel (align_corners=0 centres) times thetaᵀ
    ys, xs = ((np.arange(n) * 2 + 1) / n - 1 for n in (hgt, wid))
    base = np.stack([np.tile(xs, hgt), np.repeat(ys, wid), np.ones(hgt * wid)], 1)
    grid = g.op("MatMul", [g.fixed("base_grid", base), g.op("Transpose", [theta], "theta_t", perm=[0, 2, 1])],
                "grid_flat")
    grid = g.op("Reshape", [grid, g.const("grid_shape", [-1, hgt, wid, 2], np.int64)], "grid")
    g.op("GridSample", ["x", grid], "warped", mode="bilinear", align_corners=0)
    head = _Graph(seed + 1)  # the weights of cnn(seed=seed + 1)
    _conv_classifier(head, "warped", channels, classes, image)
    g.nodes.extend(head.nodes)
    g.inits.extend(head.inits)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", c, hgt, wid])]
    return g.finish("spatial_transformer", inputs, ["N", classes], ["N"] if loss else None, "logits")


def _layer_norm(g: _Graph, x: str, name: str, dim: int) -> str:
    g.const(f"{name}.weight", np.ones(dim))
    g.const(f"{name}.bias", np.zeros(dim))
    return g.op("LayerNormalization", [x, f"{name}.weight", f"{name}.bias"], name, axis=-1, epsilon=1e-5)


def _linear(g: _Graph, x: str, name: str, d_in: int, d_out: int, std: float) -> str:
    g.normal(f"{name}.weight", (d_in, d_out), std)  # stored [in, out] so MatMul needs no transpose
    g.const(f"{name}.bias", np.zeros(d_out))
    return g.op("Add", [g.op("MatMul", [x, f"{name}.weight"]), f"{name}.bias"], name)


def _attention(g: _Graph, x: str, p: str, dim: int, heads: int) -> str:
    """Multi-head self-attention over [N, T, D] (no mask: every token sees every token)."""
    dh = dim // heads
    split = g.const(f"{p}.split_shape", [0, 0, heads, dh], np.int64)
    merge = g.const(f"{p}.merge_shape", [0, 0, dim], np.int64)
    std = math.sqrt(1.0 / dim)
    qkv = []
    for which in ("q", "k", "v"):
        t = _linear(g, x, f"{p}.{which}", dim, dim, std)
        t = g.op("Reshape", [t, split], f"{p}.{which}_heads")  # [N, T, H, Dh]
        perm = [0, 2, 3, 1] if which == "k" else [0, 2, 1, 3]  # kᵀ: [N, H, Dh, T]; q, v: [N, H, T, Dh]
        qkv.append(g.op("Transpose", [t], f"{p}.{which}_t", perm=perm))
    scale = g.fixed(f"{p}.scale", 1.0 / math.sqrt(dh))
    scores = g.op("Mul", [g.op("MatMul", [qkv[0], qkv[1]], f"{p}.scores"), scale], f"{p}.scaled")
    attn = g.op("Softmax", [scores], f"{p}.attn", axis=-1)
    ctx = g.op("Transpose", [g.op("MatMul", [attn, qkv[2]], f"{p}.ctx")], f"{p}.ctx_t", perm=[0, 2, 1, 3])
    ctx = g.op("Reshape", [ctx, merge], f"{p}.ctx_merged")
    return _linear(g, ctx, f"{p}.out", dim, dim, std / math.sqrt(2.0))


def _gelu(g: _Graph, x: str, p: str) -> str:
    """Exact GELU as 0.5·x·(1 + erf(x/√2)) (the Gelu op needs opset 20)."""
    inv_sqrt2 = g.fixed(f"{p}.inv_sqrt2", 1.0 / math.sqrt(2.0))
    one, half = g.fixed(f"{p}.one", 1.0), g.fixed(f"{p}.half", 0.5)
    e = g.op("Add", [g.op("Erf", [g.op("Mul", [x, inv_sqrt2])]), one])
    return g.op("Mul", [g.op("Mul", [x, half]), e], f"{p}.gelu")


def transformer(vocab: int = 10, length: int = 8, dim: int = 32, heads: int = 4, layers: int = 1,
                mlp_ratio: int = 4, seed: int = 0, loss: bool = True) -> onnx.ModelProto:
    """A small pre-LN transformer encoder that labels every token; input ``x`` int64 [N, length].

    Token and position embeddings (Gather), ``layers`` blocks of x + Attention(LN(x)) and
    x + MLP(LN(x)) with a GELU MLP, a final LayerNorm and a per-token vocabulary head. ``logits``
    are [N, vocab, length] so that SoftmaxCrossEntropyLoss (against ``y`` int64 [N, length]) and the
    accuracy both see the classes on axis 1.
    """
    _check_sizes(vocab=vocab, length=length, dim=dim, heads=heads, mlp_ratio=mlp_ratio)
    _check_sizes(0, layers=layers)
    if dim % heads:
        raise ValueError(f"transformer: dim {dim} is not divisible by heads {heads}")
    g = _Graph(seed)
    g.normal("tok_emb.weight", (vocab, dim), 0.5)
    g.normal("pos_emb.weight", (length, dim), 0.5)
    positions = g.const("positions", np.arange(length), np.int64)
    tok = g.op("Gather", ["tok_emb.weight", "x"], "tok")
    h = g.op("Add", [tok, g.op("Gather", ["pos_emb.weight", positions], "pos")], "emb")
    for k in range(layers):
        p = f"layer{k}"
        h = g.op("Add", [h, _attention(g, _layer_norm(g, h, f"{p}.ln1", dim), f"{p}.attn", dim, heads)],
                 f"{p}.res1")
        u = _linear(g, _layer_norm(g, h, f"{p}.ln2", dim), f"{p}.fc1", dim, dim * mlp_ratio,
                    math.sqrt(2.0 / dim))
        u = _linear(g, _gelu(g, u, f"{p}.mlp"), f"{p}.fc2", dim * mlp_ratio, dim,
                    math.sqrt(1.0 / (dim * mlp_ratio)))
        h = g.op("Add", [h, u], f"{p}.res2")
    h = _layer_norm(g, h, "ln_f", dim)
    logits = g.op("Transpose", [_linear(g, h, "head", dim, vocab, math.sqrt(1.0 / dim))], "logits_nct",
                  perm=[0, 2, 1])
    inputs = [helper.make_tensor_value_info("x", TensorProto.INT64, ["N", length])]
    return g.finish("transformer", inputs, ["N", vocab, length], ["N", length] if loss else None, logits)

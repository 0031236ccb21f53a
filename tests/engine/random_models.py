"""Seeded random small trainable models, trained on the numpy engine and the onnxruntime backend alike.

``make_case(seed)`` builds one model with onnx.helper (an MLP, a CNN, or an embedding-and-attention block,
with a loss of its own), its float16 or float32 weights and 20 steps of data (batch sizes 1 and odd, and in
some cases a batch size that changes between steps). ``run_legacy`` trains it through the legacy
TrainingSession, ``run_ondevice`` through the on-device Module and Optimizer (its artifacts generated with a
built-in loss block). ``compare`` says how far the onnxruntime backend's losses, weights and optimizer moments
are from the numpy engine's. ``python -m tests.engine.random_models 0 300 [-v]`` sweeps seeds and prints every
case that diverges, is refused or crashes on the backend while the numpy engine runs it (``-v``: every case).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
import traceback
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

STEPS = 20
TOL = 1e-5
HALF_TOL = 2e-2  # float16 models: both backends round to float16, onnxruntime computes some ops in float32

FAMILIES = ("mlp", "cnn", "attention")
LOSSES = ("mse", "ce", "bce", "l1")


@dataclasses.dataclass
class Case:
    """One random model: the body (``x`` … → ``logits``), the same with its loss (``loss``), the data."""

    seed: int
    family: str
    loss: str
    dtype: Any
    body: onnx.ModelProto
    with_loss: onnx.ModelProto
    feeds: list[dict[str, np.ndarray]]  # per step, the model's inputs and its labels (``y``)
    ignore_index: int | None
    notes: list[str]
    no_train: set[str]  # weights whose gradient is rounding noise (a bias before a normalization)

    def describe(self) -> str:
        head = f"seed={self.seed} {self.family} loss={self.loss} {np.dtype(self.dtype).name} "
        return head + " ".join(self.notes)


class _Builder:
    """Nodes, initializers and names of one graph under construction."""

    def __init__(self, rng: np.random.Generator, dtype: Any) -> None:
        self.rng, self.dtype = rng, np.dtype(dtype)
        self.elem = helper.np_dtype_to_tensor_dtype(self.dtype)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0
        self.notes: list[str] = []
        self.no_train: set[str] = set()
        self.inference_off = False  # ONNX's shape inference miscounts a pool's windows (ceil_mode)

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def weight(self, shape: tuple[int, ...], scale: float | None = None, prefix: str = "w") -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 4
        s = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        name = self.fresh(prefix)
        value = (self.rng.standard_normal(shape) * s).astype(self.dtype)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def scale_weight(self, n: int) -> str:
        """A normalization's scale: 1 plus a little noise."""
        name = self.fresh("g")
        value = (1 + 0.1 * self.rng.standard_normal(n)).astype(self.dtype)
        self.inits.append(numpy_helper.from_array(value, name))
        return name

    def held(self, value: np.ndarray, prefix: str = "c") -> str:
        """A non-float (never trained) initializer."""
        name = self.fresh(prefix)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def const(self, value: Any, dtype: Any = None) -> str:
        """A Constant node (never trained), in the model's float type unless ``dtype``."""
        arr = np.asarray(value, dtype=self.dtype if dtype is None else dtype)
        name = self.fresh("k")
        self.nodes.append(helper.make_node("Constant", [], [name], value=numpy_helper.from_array(arr, name)))
        return name

    def op(self, op: str, inputs: list[str], n_out: int = 1, **attrs: Any) -> Any:
        outs = [self.fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, inputs, outs, name=self.fresh(f"n_{op}_"), **attrs))
        return outs[0] if n_out == 1 else outs

    def act(self, x: str, allow_relu: bool = True, opset: int = 17) -> str:
        choices = ["Tanh", "Sigmoid", "LeakyRelu", "erf_gelu"] + (["Relu"] if allow_relu else [])
        if opset >= 20:
            choices += ["Gelu", "GeluTanh"]
        kind = str(self.rng.choice(choices))
        self.notes.append(kind)
        if kind == "erf_gelu":  # x * 0.5 * (1 + erf(x / sqrt(2))), torch's export of exact GELU
            e = self.op("Erf", [self.op("Div", [x, self.const(np.sqrt(2.0))])])
            half = self.op("Mul", [x, self.op("Add", [e, self.const(1.0)])])
            return self.op("Mul", [half, self.const(0.5)])
        if kind == "Gelu":
            return self.op("Gelu", [x])
        if kind == "GeluTanh":
            return self.op("Gelu", [x], approximate="tanh")
        if kind == "LeakyRelu":
            return self.op("LeakyRelu", [x], alpha=0.1)
        return self.op(kind, [x])

    def dropout0(self, x: str) -> str:
        """A training-mode Dropout of ratio 0 (an identity with a mask)."""
        self.notes.append("dropout0")
        return self.op("Dropout", [x, self.const(0.0), self.const(True, np.bool_)], 2)[0]

    def linear(self, x: str, din: int, dout: int, bias: bool | None = None, rank: int = 2) -> str:
        bias = bool(self.rng.integers(2)) if bias is None else bias
        if rank == 2 and self.rng.integers(2):
            trans = int(self.rng.integers(2))
            w = self.weight((dout, din) if trans else (din, dout), scale=1 / np.sqrt(din))
            ins = [x, w] + ([self.weight((dout,), 0.1)] if bias else [])
            self.notes.append(f"gemm{'T' if trans else ''}{'+b' if bias else ''}")
            return self.op("Gemm", ins, transB=trans)
        w = self.weight((din, dout), scale=1 / np.sqrt(din))
        y = self.op("MatMul", [x, w])
        self.notes.append(f"matmul{'+b' if bias else ''}")
        return self.op("Add", [y, self.weight((dout,), 0.1)]) if bias else y


def _conv_out(size: int, k: int, s: int, d: int, pb: int, pe: int) -> int:
    return (size + pb + pe - d * (k - 1) - 1) // s + 1


def _mlp(b: _Builder, opset: int) -> tuple[list[onnx.ValueInfoProto], str, int, dict[str, tuple]]:
    din = int(b.rng.integers(3, 9))
    x = "x"
    width = din
    for _ in range(int(b.rng.integers(1, 4))):
        dh = int(b.rng.integers(4, 13))
        x = b.act(b.linear(x, width, dh), opset=opset)
        if b.rng.random() < 0.3:
            x = b.dropout0(x)
        width = dh
    if b.rng.random() < 0.4:  # plumbing: split the features, swap the halves, concat them back
        half = width // 2
        first = b.op("Slice", [x, b.held(np.array([0], np.int64)), b.held(np.array([half], np.int64)),
                               b.held(np.array([1], np.int64))])
        rest = b.op("Slice", [x, b.held(np.array([half], np.int64)), b.held(np.array([width], np.int64)),
                              b.held(np.array([1], np.int64))])
        x = b.op("Concat", [rest, first], axis=1)
        b.notes.append("slice-concat")
    inputs = [helper.make_tensor_value_info("x", b.elem, ["N", din])]
    return inputs, x, width, {"x": ("float", (din,))}


def _cnn(b: _Builder, opset: int) -> tuple[list[onnx.ValueInfoProto], str, int, dict[str, tuple]]:
    rng = b.rng
    c = int(rng.choice([1, 2, 3, 4]))
    size = [int(rng.integers(6, 11)), int(rng.integers(6, 11))]
    shape_in = (c, *size)
    x = "x"
    for _ in range(int(rng.integers(1, 3))):
        k = [int(rng.integers(1, 4)) for _ in range(2)]
        s = [int(rng.integers(1, 3)) for _ in range(2)]
        d = [int(rng.integers(1, 3)) for _ in range(2)]
        pads = [int(rng.integers(0, k[i])) for i in range(2)] + [int(rng.integers(0, k[i])) for i in range(2)]
        out = [_conv_out(size[i], k[i], s[i], d[i], pads[i], pads[i + 2]) for i in range(2)]
        if min(out) < 2:
            k, s, d, pads = [1, 1], [1, 1], [1, 1], [0, 0, 0, 0]
            out = list(size)
        groups = int(rng.choice([g for g in (1, 2, c) if c % g == 0]))
        cout = groups * int(rng.integers(1, 4))
        # a normalization after a channel that is one weight times one input value cancels that weight
        bn = rng.random() < 0.4 and (c // groups) * k[0] * k[1] > 1
        bias = (not bn) and bool(rng.integers(2))
        w = b.weight((cout, c // groups, *k))
        ins = [x, w] + ([b.weight((cout,), 0.1)] if bias else [])
        x = b.op("Conv", ins, kernel_shape=k, strides=s, dilations=d, pads=pads, group=groups)
        b.notes.append(f"conv(k{k}s{s}d{d}p{pads}g{groups}{'+b' if bias else ''})")
        c, size = cout, out
        if bn:
            mean = numpy_helper.from_array(np.zeros(c, b.dtype), b.fresh("bn_mean"))
            var = numpy_helper.from_array(np.ones(c, b.dtype), b.fresh("bn_var"))
            b.inits += [mean, var]
            ins = [x, b.scale_weight(c), b.weight((c,), 0.1), mean.name, var.name]
            x = b.op("BatchNormalization", ins, 3, training_mode=1, epsilon=1e-5, momentum=0.9)[0]
            b.notes.append("bn-train")
        pool_next = rng.random() < 0.6
        x = b.act(x, allow_relu=not pool_next, opset=opset)
        if pool_next:
            kind = str(rng.choice(["max", "avg"]))
            pk = [int(rng.integers(1, 4)) for _ in range(2)]
            if rng.random() < 0.4:  # windows that tile the input (the backend's ArgMax form of Indices)
                ps, pp, ceil = list(pk), [0, 0, 0, 0], 0
            else:
                ps = [int(rng.integers(1, 3)) for _ in range(2)]
                pp = [int(rng.integers(0, pk[i])) for i in range(2)] * 2
                ceil = int(rng.random() < 0.3)
            rnd = np.ceil if ceil else np.floor
            pout = [int(rnd((size[i] + 2 * pp[i] - pk[i]) / ps[i])) + 1 for i in range(2)]
            # a last window that starts in the end pad is dropped under ceil_mode (ONNX's inference counts it)
            dropped = [ceil and (o - 1) * ps[i] >= size[i] + pp[i] for i, o in enumerate(pout)]
            pout = [o - d for o, d in zip(pout, dropped, strict=True)]
            if min(pout) >= 1 and max(pk) > 1:
                if kind == "max":
                    x = b.op("MaxPool", [x], 2, kernel_shape=pk, strides=ps, pads=pp, ceil_mode=ceil)[0]
                    b.notes.append(f"maxpool-idx(k{pk}s{ps}p{pp}c{ceil})")
                else:
                    cip = int(rng.integers(2))
                    x = b.op("AveragePool", [x], kernel_shape=pk, strides=ps, pads=pp, count_include_pad=cip,
                             ceil_mode=ceil)
                    b.notes.append(f"avgpool(k{pk}s{ps}p{pp}cip{cip}c{ceil})")
                size = pout
                b.inference_off |= any(dropped)
    if rng.random() < 0.35:  # a ConvTranspose
        k = [int(rng.integers(1, 4)) for _ in range(2)]
        s = [int(rng.integers(1, 3)) for _ in range(2)]
        d = [int(rng.integers(1, 3)) for _ in range(2)]
        pads = [int(rng.integers(0, k[i])) for i in range(2)] * 2
        op = [int(rng.integers(0, max(s[i], d[i]))) for i in range(2)]
        out = [s[i] * (size[i] - 1) + op[i] + ((k[i] - 1) * d[i] + 1) - 2 * pads[i] for i in range(2)]
        if min(out) >= 1:
            groups = int(rng.choice([g for g in (1, 2, c) if c % g == 0]))
            cout = groups * int(rng.integers(1, 3))
            bias = bool(rng.integers(2))
            ins = [x, b.weight((c, cout // groups, *k))] + ([b.weight((cout,), 0.1)] if bias else [])
            x = b.op("ConvTranspose", ins, kernel_shape=k, strides=s, dilations=d, pads=pads, group=groups,
                     output_padding=op)
            b.notes.append(f"convT(k{k}s{s}d{d}p{pads}op{op}g{groups}{'+b' if bias else ''})")
            c, size = cout, out
            x = b.act(x, allow_relu=False, opset=opset)
    head = str(rng.choice(["flatten", "gap", "gmp", "reshape"]))
    if head == "gap" or head == "gmp":
        x = b.op("GlobalAveragePool" if head == "gap" else "GlobalMaxPool", [x])
        x = b.op("Flatten", [x], axis=1)
        width = c
    elif head == "flatten":
        x = b.op("Flatten", [x], axis=1)
        width = c * size[0] * size[1]
    else:  # Transpose to channels-last, Reshape to (N, -1)
        x = b.op("Transpose", [x], perm=[0, 2, 3, 1])
        x = b.op("Reshape", [x, b.held(np.array([0, -1], np.int64))])
        width = c * size[0] * size[1]
    b.notes.append(head)
    inputs = [helper.make_tensor_value_info("x", b.elem, ["N", *shape_in])]
    return inputs, x, width, {"x": ("float", shape_in)}


def _attention(b: _Builder, opset: int) -> tuple[list[onnx.ValueInfoProto], str, int, dict[str, tuple]]:
    rng = b.rng
    vocab, t = int(rng.integers(3, 8)), int(rng.integers(2, 6))
    heads = int(rng.choice([1, 2]))
    dh = int(rng.integers(2, 5)) if heads == 2 else int(rng.integers(4, 7))  # a LayerNorm of 2 is a sign
    dm = heads * dh
    emb = b.weight((vocab, dm), 0.5)
    x = b.op("Gather", [emb, "ids"])
    if rng.integers(2):
        x = b.op("Add", [x, b.weight((t, dm), 0.2)])
        b.notes.append("pos")
    ln_first = rng.random() < 0.7
    if ln_first:
        ln = b.op("LayerNormalization", [x, b.scale_weight(dm), b.weight((dm,), 0.1)], axis=-1, epsilon=1e-5)
        b.notes.append("ln")
    else:
        ln = x

    def split_heads(v: str, perm: list[int]) -> str:
        r = b.op("Reshape", [v, b.held(np.array([0, t, heads, dh], np.int64))])
        return b.op("Transpose", [r], perm=perm)

    if rng.random() < 0.4:  # one projection split into q, k and v (their gradients' Pads summed)
        qkv = b.op("MatMul", [ln, b.weight((dm, 3 * dm), 1 / np.sqrt(dm))])
        if rng.integers(2):
            parts = b.op("Split", [qkv, b.held(np.array([dm] * 3, np.int64))], 3, axis=2)
            b.notes.append("qkv-split")
        else:
            parts = [b.op("Slice", [qkv, b.held(np.array([i * dm], np.int64)),
                                    b.held(np.array([(i + 1) * dm], np.int64)),
                                    b.held(np.array([2], np.int64))])
                     for i in range(3)]
            b.notes.append("qkv-slice")
        perms = ([0, 2, 1, 3], [0, 2, 3, 1], [0, 2, 1, 3])
        q, k, v = (split_heads(part, perm) for part, perm in zip(parts, perms, strict=True))
    else:
        q = split_heads(b.linear(ln, dm, dm, rank=3), [0, 2, 1, 3])
        k = split_heads(b.linear(ln, dm, dm, bias=False, rank=3), [0, 2, 3, 1])
        v = split_heads(b.linear(ln, dm, dm, rank=3), [0, 2, 1, 3])
    scores = b.op("Mul", [b.op("MatMul", [q, k]), b.const(1.0 / np.sqrt(dh))])
    mask_kind = str(rng.choice(["causal-where", "causal-add", "pad-where", "none"]))
    inputs = [helper.make_tensor_value_info("ids", T.INT64, ["N", t])]
    spec: dict[str, tuple] = {"ids": ("ids", (t,), vocab)}
    if mask_kind == "causal-where":
        mask = np.triu(np.ones((t, t), bool), 1)
        scores = b.op("Where", [b.held(mask), b.const(-np.inf), scores])
    elif mask_kind == "causal-add":
        mask = np.triu(np.full((t, t), -1e4 if b.dtype == np.float16 else -1e9), 1)
        scores = b.op("Add", [scores, b.const(mask)])
    elif mask_kind == "pad-where":  # a key padding mask fed per batch (True: keep)
        inputs.append(helper.make_tensor_value_info("keep", T.BOOL, ["N", 1, 1, t]))
        spec["keep"] = ("keep", (1, 1, t))
        scores = b.op("Where", ["keep", scores, b.const(-np.inf)])
    b.notes.append(mask_kind)
    att = b.op("MatMul", [b.op("Softmax", [scores], axis=-1), v])
    att = b.op("Transpose", [att], perm=[0, 2, 1, 3])
    att = b.op("Reshape", [att, b.held(np.array([0, t, dm], np.int64))])
    x = b.op("Add", [x, b.linear(att, dm, dm, rank=3)])
    if rng.random() < 0.5:
        hidden = int(rng.integers(4, 9))
        h = b.op("LayerNormalization", [x, b.scale_weight(dm)], axis=-1, epsilon=1e-5)
        h = b.act(b.linear(h, dm, hidden, rank=3), opset=opset)
        if rng.random() < 0.5:
            h = b.dropout0(h)
        x = b.op("Add", [x, b.linear(h, hidden, dm, rank=3)])
        b.notes.append("mlp-block")
    pool = str(rng.choice(["mean", "first-last", "slice-mean"]))
    if pool == "mean":
        x = b.op("ReduceMean", [x, b.held(np.array([1], np.int64))], keepdims=0) if opset >= 18 else \
            b.op("ReduceMean", [x], axes=[1], keepdims=0)
        width = dm
    elif pool == "first-last":
        first = b.op("Slice", [x, b.held(np.array([0], np.int64)), b.held(np.array([1], np.int64)),
                               b.held(np.array([1], np.int64))])
        last = b.op("Slice", [x, b.held(np.array([-1], np.int64)), b.held(np.array([t], np.int64)),
                              b.held(np.array([1], np.int64))])
        x = b.op("Reshape", [b.op("Concat", [first, last], axis=2), b.held(np.array([-1, 2 * dm], np.int64))])
        width = 2 * dm
    else:
        step = int(rng.integers(1, 3))
        sl = b.op("Slice", [x, b.held(np.array([0], np.int64)), b.held(np.array([t], np.int64)),
                            b.held(np.array([1], np.int64)), b.held(np.array([step], np.int64))])
        x = b.op("ReduceSum", [sl, b.held(np.array([1], np.int64))], keepdims=0) if opset >= 13 else \
            b.op("ReduceSum", [sl], axes=[1], keepdims=0)
        width = dm
    b.notes.append(pool)
    return inputs, x, width, spec


def _loss_nodes(b: _Builder, kind: str, logits: str, k: int, ignore: int | None) -> tuple[list, str]:
    """The loss of ``logits`` [N, k] against ``y``, its nodes added to ``b``: (y's value info, the loss)."""
    if kind == "ce":
        attrs = {} if ignore is None else {"ignore_index": ignore}
        loss = b.op("SoftmaxCrossEntropyLoss", [logits, "y"], **attrs)
        return [helper.make_tensor_value_info("y", T.INT64, ["N"])], loss
    y = [helper.make_tensor_value_info("y", b.elem, ["N", k])]
    if kind == "mse":
        d = b.op("Sub", [logits, "y"])
        per = b.op("Mul", [d, d])
    elif kind == "l1":
        per = b.op("Abs", [b.op("Sub", [logits, "y"])])
    else:  # BCE with logits, the stable form: max(x, 0) - x*y + log(1 + exp(-|x|))
        soft = b.op("Log", [b.op("Add", [b.const(1.0), b.op("Exp", [b.op("Neg", [b.op("Abs", [logits])])])])])
        per = b.op("Add", [b.op("Sub", [b.op("Relu", [logits]), b.op("Mul", [logits, "y"])]), soft])
    loss = b.op("ReduceMean", [per], keepdims=0)
    return y, loss


def make_case(seed: int, family: str | None = None, loss: str | None = None, dtype: Any = None,
              batch_sizes: list[int] | None = None) -> Case:
    """The random model and data of ``seed`` (``family``, ``loss``, ``dtype`` and the batch sizes drawn from
    it unless given)."""
    rng = np.random.default_rng(seed)
    family = family or str(rng.choice(FAMILIES))
    loss = loss or str(rng.choice(LOSSES))
    dtype = np.dtype(dtype or (np.float16 if rng.random() < 0.2 else np.float32))
    opset = int(rng.choice([17, 18, 20]))
    b = _Builder(rng, dtype)
    inputs, x, width, spec = {"mlp": _mlp, "cnn": _cnn, "attention": _attention}[family](b, opset)
    k = int(rng.integers(2, 6))
    logits = b.linear(x, width, k, rank=2)
    b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name="logits_out"))
    body_nodes = list(b.nodes)
    body_inits = list(b.inits)
    ignore = int(rng.choice([-100, 1])) if loss == "ce" and rng.random() < 0.6 else None
    y_info, loss_value = _loss_nodes(b, loss, "logits", k, ignore)
    b.nodes.append(helper.make_node("Identity", [loss_value], ["loss"], name="loss_out"))
    logits_info = helper.make_tensor_value_info("logits", b.elem, ["N", k])
    loss_info = helper.make_tensor_value_info("loss", b.elem, [])
    opsets = [helper.make_opsetid("", opset)]
    body = helper.make_model(helper.make_graph(body_nodes, "body", inputs, [logits_info], body_inits),
                             opset_imports=opsets, ir_version=8)
    with_loss = helper.make_model(helper.make_graph(b.nodes, "with_loss", inputs + y_info,
                                                    [loss_info, logits_info], b.inits),
                                  opset_imports=opsets, ir_version=8)
    onnx.checker.check_model(with_loss, full_check=not b.inference_off)
    if batch_sizes is None:
        if rng.random() < 0.3:  # a batch size that changes between steps
            batch_sizes = [int(n) for n in rng.choice([1, 3, 5, 7], STEPS)]
            b.notes.append("varying-batch")
        else:
            batch_sizes = [int(rng.choice([1, 3, 5, 7]))] * STEPS
    b.notes.append(f"batch={batch_sizes[0] if len(set(batch_sizes)) == 1 else 'var'}")
    feeds = [_feed(rng, spec, n, loss, k, ignore, dtype) for n in batch_sizes]
    return Case(seed, family, loss, dtype, body, with_loss, feeds, ignore, b.notes, b.no_train)


def _feed(rng: np.random.Generator, spec: dict[str, tuple], n: int, loss: str, k: int, ignore: int | None,
          dtype: Any) -> dict[str, np.ndarray]:
    feed: dict[str, np.ndarray] = {}
    for name, (kind, shape, *more) in spec.items():
        if kind == "float":
            feed[name] = rng.standard_normal((n, *shape)).astype(dtype)
        elif kind == "ids":  # repeated indices: fewer rows than positions
            ids = rng.integers(0, more[0], (n, *shape)).astype(np.int64)
            # but not one token throughout (equal keys: the query and key weights' gradients are 0 but for
            # rounding, which Adam scales into full steps)
            ids[:, 1] = np.where(ids[:, 1] == ids[:, 0], (ids[:, 0] + 1) % more[0], ids[:, 1])
            feed[name] = ids
        else:  # a key padding mask keeping the first key
            keep = rng.random((n, *shape)) < 0.7
            keep[..., 0] = True
            feed[name] = keep
    if loss == "ce":
        y = rng.integers(0, k, n).astype(np.int64)
        if ignore is not None:
            y[rng.random(n) < 0.3] = ignore
            y[0] = 0 if ignore != 0 else 1  # never a batch of ignored labels only (NaN loss)
        feed["y"] = y
    elif loss == "bce":
        feed["y"] = (rng.random((n, k)) < 0.5).astype(dtype)
    else:
        feed["y"] = rng.standard_normal((n, k)).astype(dtype)
    return feed


# ---- training ---------------------------------------------------------------------------------------

def _options(backend: str) -> Any:
    from onnxtrain import SessionOptions

    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return so


@dataclasses.dataclass
class Result:
    losses: list[float]
    state: dict[str, np.ndarray]  # weights, moments, running statistics
    trained: list[str]


def legacy_session(case: Case, backend: str, opt: str = "SGDOptimizer", accumulate: int = 1,
                   mode: str = "auto", options: Any = None, **params: Any) -> Any:
    """The legacy TrainingSession of ``case`` on ``backend``: loss ``loss``, ``opt``, the case's frozen
    weights, ``accumulate`` micro-steps an update in ``mode``, other TrainingParameters from ``params``;
    ``options``: SessionOptions of the caller's (the backend's own by default)."""
    from onnxtrain import TrainingParameters
    from onnxtrain.session import TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    if case.no_train:
        p.weights_not_to_train = set(case.no_train)
    if accumulate > 1:
        p.gradient_accumulation_steps = accumulate
        p.gradient_accumulation_mode = mode
    for key, value in params.items():
        setattr(p, key, value)
    so = _options(backend) if options is None else options
    return TrainingSession(case.with_loss.SerializeToString(), p, so)


def run_legacy(case: Case, backend: str, opt: str = "SGDOptimizer", lr: float = 0.05, accumulate: int = 1,
               **params: Any) -> Result:
    """20 steps (20 updates; ``accumulate`` micro-steps each) through the legacy TrainingSession."""
    sess = legacy_session(case, backend, opt, accumulate, **params)
    rate = np.array([lr], np.float32)
    losses = []
    for feed in case.feeds:
        losses.append(float(np.asarray(sess.run(["loss"], {**feed, "Learning_Rate": rate})[0])))
    return Result(losses, {k: np.array(v) for k, v in sess.get_state().items()}, list(sess._graphs.trainable))


def _loss_block(case: Case) -> Any:
    from onnxtrain.training import artifacts, onnxblock

    if case.loss == "ce":
        return onnxblock.loss.CrossEntropyLoss(ignore_index=case.ignore_index)
    return {"mse": artifacts.LossType.MSELoss, "bce": artifacts.LossType.BCEWithLogitsLoss,
            "l1": artifacts.LossType.L1Loss}[case.loss]


def make_artifacts(case: Case, folder: str, opt: str, weight_decay: float = 0.0,
                   clip: float | None = None) -> None:
    """The on-device artifacts of ``case``'s body with its loss as a built-in block."""
    from onnxtrain.training import artifacts, onnxblock

    clip_block = None if clip is None else onnxblock.optim.ClipGradNorm(clip)
    block = (onnxblock.optim.AdamW(weight_decay=weight_decay, clip_grad=clip_block) if opt == "AdamW"
             else onnxblock.optim.SGD(clip_grad=clip_block))
    trainable = [t.name for t in case.body.graph.initializer if t.data_type in (T.FLOAT, T.FLOAT16)
                 and "bn_" not in t.name and t.name not in case.no_train]
    frozen = [t.name for t in case.body.graph.initializer if "bn_" in t.name]
    artifacts.generate_artifacts(case.body, requires_grad=trainable, frozen_params=frozen or None,
                                 loss=_loss_block(case), optimizer=block, artifact_directory=folder)


def run_ondevice(case: Case, folder: str, backend: str, lr: float = 0.05, accumulate: int = 1) -> Result:
    """20 optimizer steps (``accumulate`` Module calls each) through the on-device Module and Optimizer."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"), session_options=_options(backend))
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(lr)
    names = [i.name for i in case.body.graph.input]
    losses = []
    for step, feed in enumerate(case.feeds):
        out = module(*[feed[n] for n in names], feed["y"])
        losses.append(float(np.asarray(out).reshape(-1)[0]))
        if (step + 1) % accumulate == 0:
            opt.step()
            module.lazy_reset_grad()
    result = {f"param:{n}": np.array(p.data) for n, p in state.parameters}
    for n, moments in state._optimizer_state().moments.items():
        for key, m in moments.items():
            result[f"{key}:{n}"] = np.array(m)
    return Result(losses, result, [n for n, p in state.parameters if p.requires_grad])


# ---- comparison ---------------------------------------------------------------------------------------

def rel(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a64.shape != b64.shape:
        return float("inf")
    norm = np.linalg.norm(a64)
    diff = np.linalg.norm(a64 - b64)
    return float(diff / norm) if norm else float(diff)


def compare(ref: Result, got: Result) -> dict[str, float]:
    """Worst relative loss error and per-state-tensor relative errors of ``got`` against ``ref``."""
    errors = {"loss": max(abs(a - b) / max(abs(a), 1e-3) if np.isfinite(a) or np.isfinite(b) else 0.0
                          for a, b in zip(ref.losses, got.losses))}
    if any(np.isnan(a) != np.isnan(b) for a, b in zip(ref.losses, got.losses)):
        errors["loss"] = float("inf")
    for k, v in ref.state.items():
        errors[k] = rel(v, got.state[k]) if k in got.state else float("inf")
    return errors


def tolerance(case: Case) -> float:
    return HALF_TOL if case.dtype == np.float16 else TOL


CONFIGS = (
    ("legacy", "SGDOptimizer", {}),
    ("legacy", "AdamOptimizer", {}),  # clips the global norm at 1.0 (enable_grad_norm_clip's default)
    ("legacy", "AdamOptimizer", {"accumulate": 2}),
    ("legacy", "LambOptimizer", {}),
    ("ondevice", "SGD", {}),
    ("ondevice", "AdamW", {"weight_decay": 0.01}),
    ("ondevice", "AdamW", {"weight_decay": 0.01, "clip": 0.5, "accumulate": 2}),
)


def check(case: Case, api: str, opt: str, extra: dict[str, Any]) -> tuple[str, Any]:
    """("ok" | "diverged" | "backend-error" | "numpy-error" | "numpy-nonfinite", details) of one training
    configuration of ``case`` (an entry of :data:`CONFIGS`)."""
    with tempfile.TemporaryDirectory(prefix="random_model_") as folder:
        return _check(case, api, opt, dict(extra), folder)


def _check(case: Case, api: str, opt: str, extra: dict[str, Any], folder: str) -> tuple[str, Any]:
    accumulate = extra.pop("accumulate", 1)
    lr = 0.05 if opt in ("SGDOptimizer", "SGD") else 0.01
    try:
        if api == "legacy":
            ref = run_legacy(case, "numpy", opt, lr, accumulate)
        else:
            make_artifacts(case, folder, opt, **extra)
            ref = run_ondevice(case, folder, "numpy", lr, accumulate)
    except Exception:  # noqa: BLE001 - the sweep reports what the numpy engine refuses
        return "numpy-error", traceback.format_exc(limit=3)
    if not all(np.isfinite(ref.losses)):
        return "numpy-nonfinite", ref.losses
    try:
        got = run_legacy(case, "onnxruntime", opt, lr, accumulate) if api == "legacy" else \
            run_ondevice(case, folder, "onnxruntime", lr, accumulate)
    except Exception:  # noqa: BLE001
        return "backend-error", traceback.format_exc(limit=6)
    errors = compare(ref, got)
    worst = {k: v for k, v in errors.items() if v > tolerance(case)}
    if worst:
        return "diverged", dict(sorted(worst.items(), key=lambda kv: -kv[1])[:6])
    return "ok", max(errors.values())


def main(argv: list[str]) -> None:
    import onnxtrain

    onnxtrain.set_default_logger_severity(3)  # onnxruntime's constant-folding notes
    verbose = "-v" in argv
    argv = [a for a in argv if a != "-v"]
    start, stop = int(argv[0]), int(argv[1])
    only = argv[2] if len(argv) > 2 else None
    tally: dict[str, int] = {}
    for seed in range(start, stop):
        try:
            case = make_case(seed)
        except Exception:  # noqa: BLE001
            print(f"seed={seed} GENERATOR {traceback.format_exc(limit=2)}", flush=True)
            continue
        for api, opt, extra in CONFIGS:
            if only and only not in f"{api}:{opt}":
                continue
            status, details = check(case, api, opt, extra)
            tally[status] = tally.get(status, 0) + 1
            if status != "ok" or verbose:
                print(f"{case.describe()} | {api} {opt} {extra} -> {status}: {details}", flush=True)
    print(tally, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""A convolution's weight gradient rewritten for onnxruntime: one MatMul per kernel offset.

The autodiff writes the weight gradient of a group-1 Conv as a Conv whose batch is X's channels and whose
kernel is the output gradient, ``Conv(Transpose(X), Transpose(dY))`` with strides and dilations swapped
(standard ONNX, which the numpy engine fuses into GEMMs). onnxruntime runs it as one GEMM per channel of X
with as many columns as the few output positions (the kernel's offsets): 11–24 ms for each of a CIFAR
ResNet's 3×3 layers at batch 32. Here, for each offset p, the window of the padded input it sees (a
strided Slice of X laid channels-last) times dY:

    Xt      = Transpose(Pad(X), [0, 2, 3, 1])                            (N, Hp, Wp, C)
    part_p  = MatMul(Reshape(dY, [N, O, Q]), Reshape(Slice(Xt, p), [N, Q, C]))      (N, O, C)
    R       = Transpose(Reshape(ReduceSum(Concat(part_p …), 0), [O, C, k…]), [1, 0, 2, 3])

the same values to rounding. The sum over the batch costs onnxruntime about 3 ns a value of the N·O·C·P
products (a ReduceSum over a leading axis), so where the gradient's values per sample (C·P) outnumber the
output positions Q by :data:`FOLD_RATIO` (deep, small layers) the batch goes inside the products instead,
at the cost of one transposing copy of dY (N·O·Q values):

    dYt     = Reshape(Transpose(Reshape(dY, [N, O, Q]), [1, 0, 2]), [O, N·Q])
    part_p  = MatMul(dYt, Reshape(Slice(Xt, p), [N·Q, C]))                           (O, C)
    R       = Transpose(Reshape(Concat(part_p …), [O, C, k…]), [1, 0, 2, 3])

A 512 → 512 1×1 Conv at batch 8 over 4 × 4: the gradient graph 10.6 → 1.0 ms (7 ms had been the ReduceSum,
1.3 ms the Concat's copy). Whole gradient graphs of one Conv, the folded form over the per-sample one:
C·P/Q of 0.14–1.1 took 1.07–1.39× as long, 2.0 1.16×, 2.25 0.94×, 4–9 0.75–0.90×, 32 0.45×.

Each window dies at its MatMul; the Pad waits for dY (a dependency on its first value), or onnxruntime
would cut every layer's windows during the forward and hold them all. A
ResNet's training step on the backend 144 → 92 ms, its peak RSS 158 → 170 MiB (onnxruntime-training's:
173). Only kernels of at most :data:`MAX_POSITIONS` offsets are rewritten (LeNet's 5×5 ran slower so:
5.3 → 6.5 ms a step, the node count per offset outweighing the gain), with :data:`MAX_SAMPLE_BYTES` of
windows per sample; the batch may be dynamic, channels and spatial sizes must be known, opset 13 or later.

Kernel offsets whose windows read only padding (a dilation wider than X: DeepLabV3's ASPP, 3×3 at dilations
12, 24, 36 over 4² planes, reads X by its centre alone) get no window and no product; X is padded only as far
as the live windows reach, and the live block's gradient gets its zeros by a product with a one-hot mask (each
axis live at one offset or all) or else a Pad. 1 thread, CPU ms, that layer's gradient graph 2 × 960 × 4² →
256 at dilation 12 10.9 → 7.2, 24 14.7 → 6.4, 36 24.6 → 6.8; deeplabv3_mobilenet_v3_large's at batch 2 of 64²
123 → 91 (2 threads: CPU 240 → 182). Which Convs are rewritten does not change (the limits above count every
offset), nor does the graph of one whose offsets all read X.

A depthwise Conv's weight gradient (the autodiff's grouped Conv, its inputs regrouped by Reshape/Transpose)
is, for each offset p, ``ReduceSum(Slice(Pad(X), p) · dY)`` over the positions, then over the batch: a
depthwise 3×3 layer's training step 30.3 → 22.3 ms (16×64×32×32), 16.0 → 13.0 ms (16×144×16×16). Only
stride 1: at stride 2 it ran slower (6.8 → 12.7 ms), so those keep their Conv, as do grouped Convs that are
not depthwise.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.builder import NameGen, model_opset, static_shape, with_nodes_replaced
from onnxtrain.ir.conv_shapes import reads_input
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, constant_arrays, drop_unread

MAX_POSITIONS = 16
FOLD_RATIO = 3  # the batch goes inside the products from C·P ≥ FOLD_RATIO·Q (measured break-even: 2–2.5)
MAX_SAMPLE_BYTES = 2 << 20  # of all the windows of one sample: 64 MiB at batch 32
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
_SWAP = [1, 0, 2, 3]


def _plan(node: onnx.NodeProto, made_by: dict[str, onnx.NodeProto], types: dict,
          consts: Callable[[list[str]], dict[str, np.ndarray]], opset: int) -> dict | None:
    """What the rewrite of ``node`` needs when it is a weight-gradient Conv it can take, else None."""
    if node.op_type != "Conv" or node.domain not in DEFAULT_DOMAINS or len(node.input) != 2:
        return None
    a = parse_attributes(node, opset)
    if a["auto_pad"] not in ("NOTSET", ""):
        return None
    if a["group"] != 1:
        found = _grouped_sources(node, made_by, a["group"], consts, opset)
        if found is None:
            return None
        x, dy = found
    else:
        sources = [made_by.get(i) for i in node.input]
        if any(t is None or t.op_type != "Transpose" or parse_attributes(t, opset)["perm"] != _SWAP
               for t in sources):
            return None
        x, dy = (t.input[0] for t in sources)
    xs, ds = static_shape(types, x), static_shape(types, dy)
    tp = types.get(x)
    if (xs is None or ds is None or len(xs) != 4 or len(ds) != 4 or None in xs[1:] or None in ds[1:]
            or tp is None or tp.tensor_type.elem_type not in _FLOATS):
        return None
    c, h, w = xs[1:]
    o, ho, wo = ds[1:]
    sigma, delta, pads = a["strides"] or [1, 1], a["dilations"] or [1, 1], a["pads"] or [0, 0, 0, 0]
    k = [(size + pads[i] + pads[i + 2] - (out - 1) * delta[i] - 1) // sigma[i] + 1
         for i, (size, out) in enumerate(((h, ho), (w, wo)))]
    if min(k) < 1:
        return None
    live = _live_offsets(k, sigma, delta, pads, (h, w), (ho, wo))
    if live is None:
        return None  # every offset reads only padding: a zero gradient, left to the Conv
    taps, pads, origin = live
    k_full, k = k, [b - a + 1 for a, b in taps]
    # the gates below count every offset, so the Convs rewritten are the same whether or not some are dead
    # (a 256 → 256 5×5 at dilation 2 over 4² planes, 9 live of 25, took 1.25× as long rewritten as its Conv)
    positions = k_full[0] * k_full[1]
    dtype = _FLOATS[tp.tensor_type.elem_type]
    group = a["group"]
    windows = 1 if group > 1 else positions  # a depthwise window dies at its Mul, before the next is cut
    if (positions > MAX_POSITIONS or positions >= ho * wo
            or windows * c * ho * wo * np.dtype(dtype).itemsize > MAX_SAMPLE_BYTES):
        return None
    if group > 1 and (group != c or o % c or a["dilations"] not in (None, [], [1, 1])):
        return None  # only depthwise ones, and of stride 1 (the weight gradient's dilations)
    return {"x": x, "dy": dy, "c": c, "in": (h, w), "o": o, "out": (ho, wo), "k": k, "sigma": sigma,
            "delta": delta, "pads": pads, "dtype": dtype, "group": group, "k_full": k_full, "taps": taps,
            "origin": origin}


def _live_offsets(k: list[int], sigma: list[int], delta: list[int], pads: list[int], size: tuple[int, int],
                  out: tuple[int, int]) -> tuple[list[tuple[int, int]], list[int], list[int]] | None:
    """The kernel offsets of a weight-gradient Conv whose windows read X (a dilation wider than X, as
    DeepLabV3's ASPP: 3×3 at dilation 36 over 4² planes, reads X by its centre alone; the others' products
    are zero): per axis the first and last such offset, the pads their windows need and where the first
    offset's window starts in X so padded. The pads as given and origin 0 where every offset reads X; None
    where none does."""
    taps, trimmed, origin = [], list(pads), [0, 0]
    for i in range(2):
        # offset t's window: padded rows t·σ + j·δ for j < out, X's rows from pads[i]
        live = [t for t in range(k[i]) if reads_input(t * sigma[i] - pads[i], delta[i], out[i], size[i])]
        if not live:
            return None
        a, b = live[0], live[-1]
        taps.append((a, b))
        if (a, b) == (0, k[i] - 1):
            continue
        first, stop = a * sigma[i], b * sigma[i] + (out[i] - 1) * delta[i] + 1
        trimmed[i] = max(0, pads[i] - first)
        trimmed[i + 2] = max(0, min(pads[i + 2], stop - pads[i] - size[i]))
        origin[i] = first - pads[i] + trimmed[i]
    return taps, trimmed, origin


def _grouped_sources(node: onnx.NodeProto, made_by: dict[str, onnx.NodeProto], group: int,
                     consts: Callable[[list[str]], dict[str, np.ndarray]],
                     opset: int) -> tuple[str, str] | None:
    """X and dY behind a grouped weight-gradient Conv as the autodiff writes it
    (``Reshape(Transpose(Reshape(t, [0, g, ·, -1]), perm), shape)`` for each input), else None."""
    found = []
    for name, perm in zip(node.input, ([2, 1, 0, 3], [1, 2, 0, 3])):
        outer = made_by.get(name)
        middle = made_by.get(outer.input[0]) if outer is not None and outer.op_type == "Reshape" else None
        if middle is None or middle.op_type != "Transpose" or parse_attributes(middle, opset)["perm"] != perm:
            return None
        inner = made_by.get(middle.input[0])
        if inner is None or inner.op_type != "Reshape" or len(inner.input) != 2:
            return None
        shape = consts([inner.input[1]]).get(inner.input[1])
        if shape is None or [int(v) for v in shape[:2]] != [0, group] or int(shape[-1]) != -1:
            return None
        found.append(inner.input[0])
    x, dy = found
    return x, dy


class _Builder:
    """Names, int64 initializers and nodes for the rewrite of one Conv (initializers added to ``model``)."""

    def __init__(self, node: onnx.NodeProto, names: NameGen, model: onnx.ModelProto) -> None:
        self.node, self.names, self.model = node, names, model
        self.base = node.name or "Conv"

    def const(self, what: str, value: list[int]) -> str:
        name = self.names(f"{self.base}/{what}")
        self.model.graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def value(self, what: str) -> str:
        return self.names(f"{self.node.output[0]}/{what}")

    def make(self, op: str, ins: list[str], out: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(op, ins, [out], name=self.names(f"{self.base}/{op}"), **attrs)


def _held_padded_x(p: dict, b: _Builder) -> tuple[list[onnx.NodeProto], str]:
    """Nodes giving X padded, read only once dY exists, and the name of that value."""
    pt, pl, pb, pr = p["pads"]
    # X waits for dY (a false comparison of dY's first value, as an integer 0 added to X's own shape, which
    # a Reshape takes): reading X alone, the windows would be cut as soon as onnxruntime could, long before
    # their MatMuls, and every layer's would be alive at once (peak RSS of a ResNet step 158 → 318 MiB)
    flat, first_value, never, flag, zero, x_shape, held = (
        b.value(s) for s in ("flat_dy", "first", "never", "flag", "zero", "x_shape", "held"))
    inf = b.names(f"{b.base}/inf")
    b.model.graph.initializer.append(numpy_helper.from_array(np.array([np.inf], p["dtype"]), inf))
    nodes = [b.make("Reshape", [p["dy"], b.const("flat", [-1])], flat),
             b.make("Slice", [flat, b.const("first", [0]), b.const("one", [1])], first_value),
             b.make("Greater", [first_value, inf], never),
             b.make("Cast", [never], flag, to=TensorProto.INT64),
             b.make("ReduceSum", [flag], zero, keepdims=1),  # [0] even for an empty dY
             b.make("Add", [zero, b.const("x_dims", [0, p["c"], *p["in"]])], x_shape),
             b.make("Reshape", [p["x"], x_shape], held)]
    if any(p["pads"]):
        padded = b.value("padded")
        nodes.append(b.make("Pad", [held, b.const("pads", [0, 0, pt, pl, 0, 0, pb, pr])], padded))
        held = padded
    return nodes, held


def _replacement(node: onnx.NodeProto, p: dict, names: NameGen,
                 model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes computing ``node``'s output by one MatMul per kernel offset (initializers added to
    ``model``)."""
    k = p["k"]
    (ho, wo), sigma, delta = p["out"], p["sigma"], p["delta"]
    b = _Builder(node, names, model)
    base, const, value, make = b.base, b.const, b.value, b.make
    pt, pl, pb, pr = p["pads"]
    c, o, q = p["c"], p["o"], ho * wo
    nodes, held = _held_padded_x(p, b)
    last = value("channels_last")
    nodes.append(make("Transpose", [held], last, perm=[0, 2, 3, 1]))  # (N, Hp, Wp, C)
    full = [p["in"][0] + pt + pb, p["in"][1] + pl + pr]
    positions = k[0] * k[1]
    # the batch inside each product where the gradient's C·P values per sample outweigh the Q positions
    # (module docstring): dY as (O, N·Q), the window as (N·Q, C), a product (O, C); else (N, O, C) products
    # summed over the batch
    fold = c * positions >= FOLD_RATIO * q
    lift_axis = 2 if fold else 3
    new_axis = const("new_axis", [lift_axis]) if positions > 1 else ""  # one offset: the Reshape lifts it
    slicing: list[str] = []  # the Slices' axes and steps, made when a window needs them
    dy2 = value("dy")
    if fold:
        dy3, dy_t = value("dy_samples"), value("dy_channels_first")
        nodes += [make("Reshape", [p["dy"], const("dy_shape", [-1, o, q])], dy3),
                  make("Transpose", [dy3], dy_t, perm=[1, 0, 2]),
                  make("Reshape", [dy_t, const("dy_rows", [o, -1])], dy2)]
    else:
        nodes.append(make("Reshape", [p["dy"], const("dy_shape", [-1, o, q])], dy2))
    rows_shape = const("rows_shape", [-1, c] if fold else [-1, q, c])
    products = []
    for i in range(k[0]):
        for j in range(k[1]):  # each position's window, product and the window's end, in turn
            window, rows, product, lifted = (value(f"{s}_{i}_{j}") for s in ("window", "rows", "product",
                                                                             "lifted"))
            first = [p["origin"][0] + i * sigma[0], p["origin"][1] + j * sigma[1]]
            stop = [first[0] + (ho - 1) * delta[0] + 1, first[1] + (wo - 1) * delta[1] + 1]
            if first == [0, 0] and stop == full and delta == [1, 1]:
                window = last  # the whole input (a 1×1 kernel, or the one live offset): no Slice's copy
            else:
                slicing = slicing or [const("axes", [1, 2]), const("steps", delta)]
                bounds = [const("start", first), const("stop", stop)]
                nodes.append(make("Slice", [last, *bounds, *slicing], window))  # (N, Ho, Wo, C)
            nodes += [make("Reshape", [window, rows_shape], rows),  # (N·Q, C) or (N, Q, C)
                      make("MatMul", [dy2, rows], product)]  # (O, C) or (N, O, C)
            if new_axis:
                nodes.append(make("Unsqueeze", [product, new_axis], lifted))
                product = lifted
            products.append(product)
    v = {s: value(s) for s in ("each", "sum", "grid")}
    # dY on the left, a Reshape (of dY, or of its Transpose): a Transpose feeding a MatMul would become one
    # of onnxruntime's fused MatMuls, a node it adds at the graph's end and runs there
    joined = products[0]
    tail = []
    if len(products) > 1:
        tail.append(make("Concat", products, v["each"], axis=lift_axis))  # (O, C, P) or (N, O, C, P)
        joined = v["each"]
    if not fold:
        tail.append(make("ReduceSum", [joined, const("batch_axis", [0])], v["sum"], keepdims=0))
        joined = v["sum"]
    tail.append(make("Reshape", [joined, const("grid_shape", [o, c, *k])], v["grid"]))
    last_node = helper.make_node("Transpose", [v["grid"]], list(node.output), name=names(f"{base}/Transpose"),
                                 perm=[1, 0, 2, 3])
    return [*nodes, *tail, *_with_dead_offsets(last_node, p, b)]


def _with_dead_offsets(last: onnx.NodeProto, p: dict, b: _Builder) -> list[onnx.NodeProto]:
    """``last`` (the node writing the gradient of the live offsets), followed where some offsets read only
    padding by the node that puts zeros in their place: a Pad, or for one live offset a product with the
    kernel's one-hot mask (onnxruntime's Pad took 1.6× as long: 960 × 256 × 3 × 3, 9.7 against 5.8 ms),
    whose zeros are NaN where the live value is not finite (as the Conv's sums of zeros times dY are, where
    dY is not)."""
    if p["k"] == p["k_full"]:
        return [last]
    live = b.value("live")
    out = last.output[0]
    last.output[0] = live
    (a0, b0), (a1, b1) = p["taps"]
    kh, kw = p["k_full"]
    if all(v in (1, full) for v, full in zip(p["k"], p["k_full"], strict=True)):
        # per axis one live offset (a one-hot row) or every one (a 1, broadcast along it)
        rows = [np.eye(full, dtype=p["dtype"])[first] if v < full else np.ones(1, p["dtype"])
                for v, full, first in zip(p["k"], p["k_full"], (a0, a1), strict=True)]
        one_hot = np.multiply.outer(*rows).reshape(1, 1, rows[0].size, rows[1].size)
        mask = b.names(f"{b.base}/live_offsets")
        b.model.graph.initializer.append(numpy_helper.from_array(one_hot, mask))
        return [last, helper.make_node("Mul", [live, mask], [out], name=b.names(f"{b.base}/Mul"))]
    pads = b.const("dead_offsets", [0, 0, a0, a1, 0, 0, kh - 1 - b0, kw - 1 - b1])
    return [last, helper.make_node("Pad", [live, pads], [out], name=b.names(f"{b.base}/Pad"))]


def conv_weight_grads(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each weight-gradient Conv it can take rewritten (a copy), or ``model`` itself."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    if not any(n.op_type == "Conv" and len(n.input) == 2 and all(
            made_by.get(i) is not None and made_by[i].op_type in ("Transpose", "Reshape") for i in n.input)
            for n in model.graph.node):
        return model
    opset = model_opset(model)
    if opset < 13:  # Unsqueeze and ReduceSum with their axes as inputs
        return model
    types = typed()

    def consts(names: list[str]) -> dict[str, np.ndarray]:
        return constant_arrays(model.graph, names)

    plans = {k: p for k, n in enumerate(model.graph.node)
             if (p := _plan(n, made_by, types, consts, opset)) is not None}
    if not plans:
        return model

    def replace(k: int, n: onnx.NodeProto, names: NameGen, copy: onnx.ModelProto) -> list[onnx.NodeProto]:
        make = _replacement if plans[k]["group"] == 1 else _depthwise_replacement
        return make(n, plans[k], names, copy)

    out = with_nodes_replaced(model, plans, replace)
    # the layout changes (and their shapes) only the rewritten Convs read go too
    drop_unread(out.graph, {i for k in plans for i in model.graph.node[k].input},
                ops=("Transpose", "Reshape", "Constant"))
    return out



def _depthwise_replacement(node: onnx.NodeProto, p: dict, names: NameGen,
                           model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes computing a depthwise weight-gradient Conv's output (1, M, k…): for each kernel offset,
    its window of X times dY summed over the positions, then over the batch (initializers added to
    ``model``)."""
    b = _Builder(node, names, model)
    (ho, wo), sigma, delta, (kh, kw) = p["out"], p["sigma"], p["delta"], p["k"]
    c, mult = p["c"], p["o"] // p["c"]  # channels and outputs per channel
    pt, pl, pb, pr = p["pads"]
    full = [p["in"][0] + pt + pb, p["in"][1] + pl + pr]
    nodes, held = _held_padded_x(p, b)
    dy = p["dy"]
    if mult > 1:  # dY as (N, C, mult, Ho, Wo), each window (N, C, 1, Ho, Wo)
        dy = b.value("dy")
        nodes.append(b.make("Reshape", [p["dy"], b.const("dy_shape", [0, c, mult, ho, wo])], dy))
        channel_axis = b.const("channel_axis", [2])
    positions = b.const("positions", [-2, -1])
    slicing: list[str] = []  # the Slices' axes and steps, made when a window needs them
    sums = []
    for i in range(kh):
        for j in range(kw):
            window, product, total = (b.value(f"{s}_{i}_{j}") for s in ("window", "product", "total"))
            first = [p["origin"][0] + i * sigma[0], p["origin"][1] + j * sigma[1]]
            stop = [first[0] + (ho - 1) * delta[0] + 1, first[1] + (wo - 1) * delta[1] + 1]
            if first == [0, 0] and stop == full and delta == [1, 1]:
                window = held  # a 1×1 kernel (or the one live offset): the whole input
            else:
                slicing = slicing or [b.const("axes", [2, 3]), b.const("steps", delta)]
                bounds = [b.const("start", first), b.const("stop", stop)]
                nodes.append(b.make("Slice", [held, *bounds, *slicing], window))  # (N, C, Ho, Wo)
            if mult > 1:
                lifted = b.value(f"lifted_{i}_{j}")
                nodes.append(b.make("Unsqueeze", [window, channel_axis], lifted))
                window = lifted
            nodes += [b.make("Mul", [window, dy], product),
                      b.make("ReduceSum", [product, positions], total, keepdims=1)]  # (N, C[, mult], 1, 1)
            sums.append(total)
    each, summed = b.value("each"), b.value("sum")
    return [*nodes,
            b.make("Concat", sums, each, axis=-2),  # (N, C[, mult], P, 1)
            b.make("ReduceSum", [each, b.const("batch_axis", [0])], summed, keepdims=0),
            *_with_dead_offsets(helper.make_node(
                "Reshape", [summed, b.const("grid_shape", [1, p["o"], kh, kw])], list(node.output),
                name=names(f"{b.base}/Reshape")), p, b)]

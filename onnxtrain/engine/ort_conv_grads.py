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

the same values to rounding. Each window dies at its MatMul; the Pad waits for dY (a dependency on its
first value), or onnxruntime would cut every layer's windows during the forward and hold them all. A
ResNet's training step on the backend 144 → 92 ms, its peak RSS 158 → 170 MiB (onnxruntime-training's:
173). Only kernels of at most :data:`MAX_POSITIONS` offsets are rewritten (LeNet's 5×5 ran slower so:
5.3 → 6.5 ms a step, the node count per offset outweighing the gain), with :data:`MAX_SAMPLE_BYTES` of
windows per sample; the batch may be dynamic, channels and spatial sizes must be known, opset 13 or later.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.builder import NameGen, model_opset, static_shape, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, drop_unread

MAX_POSITIONS = 16
MAX_SAMPLE_BYTES = 2 << 20  # of all the windows of one sample: 64 MiB at batch 32
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
_SWAP = [1, 0, 2, 3]


def _plan(node: onnx.NodeProto, made_by: dict[str, onnx.NodeProto], types: dict,
          opset: int) -> dict | None:
    """What the rewrite of ``node`` needs when it is a weight-gradient Conv it can take, else None."""
    if node.op_type != "Conv" or node.domain not in DEFAULT_DOMAINS or len(node.input) != 2:
        return None
    a = parse_attributes(node, opset)
    if a["group"] != 1 or a["auto_pad"] not in ("NOTSET", ""):
        return None
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
    positions = k[0] * k[1]
    dtype = _FLOATS[tp.tensor_type.elem_type]
    if (min(k) < 1 or positions > MAX_POSITIONS or positions >= ho * wo
            or positions * c * ho * wo * np.dtype(dtype).itemsize > MAX_SAMPLE_BYTES):
        return None
    return {"x": x, "dy": dy, "c": c, "in": (h, w), "o": o, "out": (ho, wo), "k": k, "sigma": sigma,
            "delta": delta, "pads": pads, "dtype": dtype}


def _replacement(node: onnx.NodeProto, p: dict, names: NameGen,
                 model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes computing ``node``'s output by one MatMul per kernel offset (initializers added to
    ``model``)."""
    k = p["k"]
    (ho, wo), sigma, delta = p["out"], p["sigma"], p["delta"]
    base = node.name or "Conv"

    def const(what: str, value: list[int]) -> str:
        name = names(f"{base}/{what}")
        model.graph.initializer.append(numpy_helper.from_array(np.array(value, np.int64), name))
        return name

    def value(what: str) -> str:
        return names(f"{node.output[0]}/{what}")

    def make(op: str, ins: list[str], out: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(op, ins, [out], name=names(f"{base}/{op}"), **attrs)

    pt, pl, pb, pr = p["pads"]
    c, o, q = p["c"], p["o"], ho * wo
    # X waits for dY (a false comparison of dY's first value, as an integer 0 added to X's own shape, which
    # a Reshape takes): reading X alone, the windows would be cut as soon as onnxruntime could, long before
    # their MatMuls, and every layer's would be alive at once (peak RSS of a ResNet step 158 → 318 MiB)
    flat, first_value, never, flag, zero, x_shape, held = (
        value(s) for s in ("flat_dy", "first", "never", "flag", "zero", "x_shape", "held"))
    inf = names(f"{base}/inf")
    model.graph.initializer.append(numpy_helper.from_array(np.array([np.inf], p["dtype"]), inf))
    nodes = [make("Reshape", [p["dy"], const("flat", [-1])], flat),
             make("Slice", [flat, const("first", [0]), const("one", [1])], first_value),
             make("Greater", [first_value, inf], never),
             make("Cast", [never], flag, to=TensorProto.INT64),
             make("ReduceSum", [flag], zero, keepdims=1),  # [0] even for an empty dY
             make("Add", [zero, const("x_dims", [0, c, *p["in"]])], x_shape),
             make("Reshape", [p["x"], x_shape], held)]
    if any(p["pads"]):
        padded = value("padded")
        nodes.append(make("Pad", [held, const("pads", [0, 0, pt, pl, 0, 0, pb, pr])], padded))
        held = padded
    last = value("channels_last")
    nodes.append(make("Transpose", [held], last, perm=[0, 2, 3, 1]))  # (N, Hp, Wp, C)
    full = [p["in"][0] + pt + pb, p["in"][1] + pl + pr]
    new_axis = const("new_axis", [3])
    slicing: list[str] = []  # the Slices' axes and steps, made when a window needs them
    dy2 = value("dy")
    nodes.append(make("Reshape", [p["dy"], const("dy_shape", [-1, o, q])], dy2))
    rows_shape = const("rows_shape", [-1, q, c])
    products = []
    for i in range(k[0]):
        for j in range(k[1]):  # each position's window, product and the window's end, in turn
            window, rows, product, lifted = (value(f"{s}_{i}_{j}") for s in ("window", "rows", "product",
                                                                             "lifted"))
            first = [i * sigma[0], j * sigma[1]]
            stop = [first[0] + (ho - 1) * delta[0] + 1, first[1] + (wo - 1) * delta[1] + 1]
            if first == [0, 0] and stop == full and delta == [1, 1]:
                window = last  # the whole input (a 1×1 kernel): no Slice's copy
            else:
                slicing = slicing or [const("axes", [1, 2]), const("steps", delta)]
                bounds = [const("start", first), const("stop", stop)]
                nodes.append(make("Slice", [last, *bounds, *slicing], window))  # (N, Ho, Wo, C)
            nodes += [make("Reshape", [window, rows_shape], rows),
                      make("MatMul", [dy2, rows], product),  # (N, O, C)
                      make("Unsqueeze", [product, new_axis], lifted)]
            products.append(lifted)
    v = {s: value(s) for s in ("each", "sum", "grid")}
    # dY on the left, as it is: a Transpose feeding a MatMul would become one of onnxruntime's fused
    # MatMuls, a node it adds at the graph's end and runs there
    return [
        *nodes,
        make("Concat", products, v["each"], axis=3),  # (N, O, C, P)
        make("ReduceSum", [v["each"], const("batch_axis", [0])], v["sum"], keepdims=0),
        make("Reshape", [v["sum"], const("grid_shape", [o, c, *k])], v["grid"]),
        helper.make_node("Transpose", [v["grid"]], list(node.output), name=names(f"{base}/Transpose"),
                         perm=[1, 0, 2, 3]),
    ]


def conv_weight_grads(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each weight-gradient Conv it can take rewritten (a copy), or ``model`` itself."""
    made_by = {o: n for n in model.graph.node for o in n.output}
    if not any(n.op_type == "Conv" and len(n.input) == 2 and all(
            made_by.get(i) is not None and made_by[i].op_type == "Transpose" for i in n.input)
            for n in model.graph.node):
        return model
    opset = model_opset(model)
    if opset < 13:  # Unsqueeze and ReduceSum with their axes as inputs
        return model
    types = typed()
    plans = {k: p for k, n in enumerate(model.graph.node)
             if (p := _plan(n, made_by, types, opset)) is not None}
    if not plans:
        return model
    out = with_nodes_replaced(model, plans, lambda k, n, names, copy: _replacement(n, plans[k], names, copy))
    # the Transposes only the rewritten Convs read go too
    drop_unread(out.graph, {i for k in plans for i in model.graph.node[k].input}, ops=("Transpose",))
    return out

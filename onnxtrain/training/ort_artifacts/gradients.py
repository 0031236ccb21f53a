"""onnxruntime gradient operators, translated through onnxtrain's own gradient rules."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.training.ort_artifacts.common import Context, TranslationError, node_label


@dataclass(frozen=True)
class Grad:
    """An onnxruntime gradient operator as the backward of one forward operator.

    ``inputs`` maps each of the node's inputs to a role in the forward node: ``x<i>`` (forward input),
    ``y<i>`` (forward output), ``dy<i>`` (the gradient of output i) or ``shape_x<i>`` (the shape of input
    i); output k of the node is the gradient of forward input ``outputs[k]``."""

    forward: str
    n_in: int
    n_out: int
    inputs: tuple[str, ...]
    outputs: tuple[int, ...]
    like: dict[str, str] = field(default_factory=dict)  # role without a value -> role whose type it has
    attrs: tuple[str, ...] | None = None  # attributes passed on (None: all)
    min_opset: int = 0  # the opset the rule's standard nodes need (e.g. ScatterND's reduction: 16)


GRADS: dict[str, Grad] = {
    "ReluGrad": Grad("Relu", 1, 1, ("dy0", "y0"), (0,), {"x0": "y0"}),
    "SigmoidGrad": Grad("Sigmoid", 1, 1, ("dy0", "y0"), (0,), {"x0": "y0"}),
    "TanhGrad": Grad("Tanh", 1, 1, ("dy0", "y0"), (0,), {"x0": "y0"}),
    "SoftmaxGrad_13": Grad("Softmax", 1, 1, ("dy0", "y0"), (0,), {"x0": "y0"}, ("axis",)),
    "LogSoftmaxGrad_13": Grad("LogSoftmax", 1, 1, ("dy0", "y0"), (0,), {"x0": "y0"}, ("axis",)),
    "SoftmaxCrossEntropyLossGrad": Grad(
        "SoftmaxCrossEntropyLoss",
        3,
        2,
        ("dy0", "y1", "x1", "x2"),
        (0,),
        {"x0": "y1"},
        ("reduction", "ignore_index"),
    ),
    "ConvGrad": Grad("Conv", 3, 1, ("dy0", "x0", "x1"), (0, 1, 2)),
    "MaxPoolGrad": Grad("MaxPool", 1, 2, ("dy0", "y1"), (0,)),
    "LayerNormalizationGrad": Grad(
        "LayerNormalization",
        3,
        3,
        ("dy0", "x0", "x1", "y1", "y2"),
        (0, 1, 2),
        {"x2": "x1"},
        ("axis", "epsilon"),
    ),
    "DropoutGrad": Grad("Dropout", 3, 2, ("dy0", "y1", "x1", "x2"), (0,), {"x0": "dy0"}, ()),
    "GatherGrad": Grad("Gather", 2, 1, ("shape_x0", "x1", "dy0"), (0,), {"x0": "dy0"}, ("axis",)),
    "GatherNDGrad": Grad(
        "GatherND", 2, 1, ("shape_x0", "x1", "dy0"), (0,), {"x0": "dy0"}, ("batch_dims",), min_opset=16
    ),
    "BatchNormalizationGrad": Grad(
        "BatchNormalization",
        5,
        3,
        ("dy0", "x0", "x1", "", ""),
        (0, 1, 2),
        {"x2": "x1", "x3": "x1", "x4": "x1"},
        ("epsilon",),
    ),
    "AveragePoolGrad": Grad("AveragePool", 1, 1, ("dy0",), (0,)),
    "ConvTransposeGrad": Grad("ConvTranspose", 3, 1, ("dy0", "x0", "x1"), (0, 1, 2)),
    "DivGrad": Grad("Div", 2, 1, ("dy0", "x0", "x1"), (0, 1)),
    "GatherElementsGrad": Grad(
        "GatherElements", 2, 1, ("dy0", "shape_x0", "x1"), (0,), {"x0": "dy0"}, ("axis",)
    ),
    "ResizeGrad": Grad("Resize", 4, 1, ("dy0", "x0", "x1", "x2", "x3"), (0,)),
    "SliceGrad": Grad("Slice", 5, 1, ("dy0", "shape_x0", "x1", "x2", "x3", "x4"), (0,), {"x0": "dy0"}, ()),
    # the recurrent gradients also take the forward's saved gates, which onnxtrain's rules recompute
    "LSTMGrad": Grad(
        "LSTM",
        8,
        3,
        ("x0", "x1", "x2", "x4", "x5", "x6", "y0", "", "", "dy0", "dy1", "dy2"),
        (0, 1, 2, 3, 5, 6),
    ),
    "GRUGrad": Grad(
        "GRU", 6, 2, ("x0", "x1", "x2", "x3", "x4", "x5", "y0", "", "dy0", "dy1"), (0, 1, 2, 3, 5)
    ),
}


def grad_by_rule(node: onnx.NodeProto, spec: Grad, ctx: Context) -> list[onnx.NodeProto]:
    """The standard nodes of onnxtrain's gradient rule of ``spec.forward`` standing in for ``node``."""
    from onnxtrain.autodiff import build_gradient_model

    if ctx.opset < spec.min_opset:
        raise TranslationError(
            f"{node_label(node)}: its standard form needs opset {spec.min_opset} and the model has opset "
            f"{ctx.opset}; export the model at opset {spec.min_opset} or later"
        )
    ort: dict[str, str] = {}  # role -> the onnxruntime value that plays it
    for role, name in zip(spec.inputs, node.input):
        if role and name:
            ort[role] = name
    if spec.forward == "MaxPool":  # the input is the forward MaxPool's, found through its indices
        src = ctx.producer.get(ort["y1"])
        if src is None or src.op_type != "MaxPool":
            raise TranslationError(f"{node_label(node)}: its indices do not come from a MaxPool")
        ort["x0"] = src.input[0]
    if spec.forward == "BatchNormalization":  # running statistics: the inputs of the forward node
        src = ctx.producer.get(node.input[3]) if len(node.input) > 3 else None
        if src is None or src.op_type != "BatchNormalization":
            raise TranslationError(
                f"{node_label(node)}: its saved mean does not come from a BatchNormalization"
            )
        ort["x2"], ort["x3"], ort["x4"] = src.input[2], src.input[3], src.input[4]
    if spec.forward == "AveragePool":  # the gradient takes only dY: find the forward node for X
        ort["x0"] = _average_pool_input(node, ctx)
    if spec.forward in ("LSTM", "GRU"):  # every forward value from the training node's translation
        saved = ctx.recurrent.get(ort.get("y0", ""))
        if saved is None:
            raise TranslationError(
                f"{node_label(node)}: its hidden states do not come from an {spec.forward}Training node"
            )
        fwd_in, fwd_out = saved
        for i, name in enumerate(fwd_in):
            ort.pop(f"x{i}", None)
            if name:
                ort[f"x{i}"] = name
        ort["y1"] = fwd_out[1]
    shape_of = {r[len("shape_") :]: n for r, n in ort.items() if r.startswith("shape_")}
    wanted = [spec.outputs[k] for k, o in enumerate(node.output) if k < len(spec.outputs) and o]
    # the forward node's inputs: the first, those the node gives or whose gradient it asks for (optional
    # ones left out: a Conv without bias when no bias gradient is asked)
    present = [
        i == 0 or f"x{i}" in ort or i in wanted or spec.forward == "BatchNormalization"
        for i in range(spec.n_in)
    ]
    n_in = max(i for i, p in enumerate(present) if p) + 1

    def type_of(role: str) -> onnx.TypeProto:
        given = shape_of.get(role)
        if given is not None:  # a value known by its shape: the rank is the shape's length
            t = ctx.types.get(given)
            dims = t.tensor_type.shape.dim if t is not None and t.tensor_type.HasField("shape") else ()
            like = type_of(spec.like[role]) if role in spec.like else None
            et = like.tensor_type.elem_type if like is not None else TensorProto.FLOAT
            if len(dims) == 1 and dims[0].HasField("dim_value"):
                return helper.make_tensor_type_proto(et, [None] * dims[0].dim_value)
            return helper.make_tensor_type_proto(et, None)
        for r in (role, spec.like.get(role, ""), role[1:] if role.startswith("d") else ""):
            if r and r in ort and ort[r] in ctx.types:
                return ctx.types[ort[r]]
        if role.startswith("dy") or role.startswith("y"):
            for r in (f"y{role[-1]}", f"dy{role[-1]}"):
                if r in ort and ort[r] in ctx.types:
                    return ctx.types[ort[r]]
        return helper.make_tensor_type_proto(TensorProto.FLOAT, None)

    xs = [f"x{i}" if present[i] else "" for i in range(n_in)]
    ys = [f"y{i}" for i in range(spec.n_out)]
    attrs = {
        a.name: helper.get_attribute_value(a)
        for a in node.attribute
        if spec.attrs is None or a.name in spec.attrs
    }
    if spec.forward == "BatchNormalization":
        attrs["training_mode"] = 1
    fwd = helper.make_node(spec.forward, xs, ys, name="fwd", **attrs)
    inits = [numpy_helper.from_array(ctx.constants[ort[x]], x) for x in xs if ort.get(x) in ctx.constants]
    init_names = {t.name for t in inits}
    inputs = [helper.make_value_info(x, type_of(x)) for x in xs if x and x not in init_names]
    inputs.append(helper.make_tensor_value_info("__loss", TensorProto.FLOAT, []))
    outputs = [
        helper.make_value_info(
            y,
            type_of(y)
            if y in ort or f"d{y}" in ort
            else helper.make_tensor_type_proto(TensorProto.FLOAT, None),
        )
        for y in ys
    ]
    mini = helper.make_model(
        helper.make_graph([fwd], "grad", inputs, outputs, initializer=inits),
        opset_imports=[helper.make_opsetid("", ctx.opset)],
    )
    other_ys = [y for y in ys if f"d{y}" in ort]
    grad = build_gradient_model(mini, "__loss", [f"x{i}" for i in wanted], other_ys=other_ys)

    rename: dict[str, str] = {f"{y}_grad": ort[f"d{y}"] for y in other_ys}
    for k, o in enumerate(node.output):
        if k < len(spec.outputs) and o:
            rename[f"x{spec.outputs[k]}_grad"] = o
    for role, name in ort.items():
        if not role.startswith(("d", "shape_")):
            rename[role] = name
    # the gradient model holds only what its outputs need: all but the forward node itself, whose outputs
    # the onnxruntime model has (a value known by its shape takes that shape instead of a Shape node);
    # when the rule reads a forward output the node does not take, the forward node runs again
    read = {v for n in grad.graph.node if n.name != "fwd" for v in n.input}
    recompute = any(y in read and y not in ort for y in ys)
    out: list[onnx.NodeProto] = []
    for n in grad.graph.node:
        if n.name == "fwd":
            if recompute:
                out.append(onnx.NodeProto())
                out[-1].CopyFrom(n)
                for j, y in enumerate(n.output):  # its own copies, even of outputs the model has
                    if y in ort:
                        out[-1].output[j] = f"{y}.again"
            continue
        if n.op_type == "Shape" and n.input[0] in shape_of:
            out.append(helper.make_node("Identity", [shape_of[n.input[0]]], [n.output[0]]))
        else:
            out.append(onnx.NodeProto())
            out[-1].CopyFrom(n)
    # every other value gets a name of its own in the model; the forward values must exist there
    # (in the nodes' order: the names must not depend on the process's string hashing, or the ranks of an
    # mpiexec run would translate one model differently)
    inner = dict.fromkeys(o for n in out for o in n.output if o not in rename)
    local = {v: ctx.fresh(f"{node.name or node.op_type}/{v}") for v in inner}
    for n in out:
        n.name = ctx.fresh(f"{node.name or node.op_type}/{n.op_type}")
        for seq in (n.input, n.output):
            for j, v in enumerate(seq):
                if v in local:
                    seq[j] = local[v]
                elif v in rename:
                    seq[j] = rename[v]
        missing = [
            v
            for v in n.input
            if v
            and v not in local.values()
            and v not in ctx.types
            and v not in ctx.producer
            and v not in rename.values()
        ]
        unmapped = [v for v in missing if v in xs or v in ys or v in init_names]
        if unmapped:
            raise TranslationError(
                f"{node_label(node)}: onnxtrain's gradient of {spec.forward} reads forward value(s) "
                f"{unmapped}, which this node does not take"
            )
    for o in node.output:
        if o and not any(o in n.output for n in out):  # a gradient the rule says is zero or a copy
            raise TranslationError(f"{node_label(node)}: no gradient for output {o!r}")
    for k, o in enumerate(node.output):
        x = f"x{spec.outputs[k]}" if k < len(spec.outputs) else ""
        if o and x in ort and ort[x] in ctx.types:
            ctx.types[o] = ctx.types[ort[x]]
    return out


def _average_pool_input(node: onnx.NodeProto, ctx: Context) -> str:
    """The input of the forward AveragePool that ``node`` (an AveragePoolGrad, which takes only dY) is
    the gradient of: the one whose output's gradient is its dY (onnxruntime names a gradient after its
    value), else the only AveragePool with the same attributes."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    pools = {
        id(n): n for n in ctx.producer.values() if n.op_type == "AveragePool" and n.domain in DEFAULT_DOMAINS
    }.values()
    alike = [n for n in pools if {a.name: helper.get_attribute_value(a) for a in n.attribute} == attrs]
    named = [n for n in alike if node.input[0].startswith(f"{n.output[0]}_grad")]
    if len(named) == 1:
        return named[0].input[0]
    if len(alike) == 1:
        return alike[0].input[0]
    raise TranslationError(f"{node_label(node)}: cannot tell which AveragePool it is the gradient of")

"""Mixed precision (spec §8): the forward model computes in float16 or bfloat16 on float32 master weights.

``mixed_precision(model, loss)`` rewrites the *forward* model before the gradient graph is built (as
onnxruntime's mixed-precision transformer did), so the backward pass is generated in half precision too:

* Each op is classed like an autocast policy. Compute-bound ops (``HALF_OPS``: MatMul, Gemm, Conv, ...)
  run in the half type. ``FP32_OPS`` (softmax/log-softmax, reductions, losses, batch/instance/group
  norms, Exp/Log/Pow, recurrent ops, LRN, DFT/STFT, Det, steep trigonometric functions, Quantize/
  DequantizeLinear) run in float32:
  their float inputs are cast up. Every other op follows its inputs: float32 if one of them is float32,
  else half. LayerNormalization follows its input with ``stash_type=1``, so its Mean/InvStdDev
  statistics are float32 whatever the input type.
* Float32 initializers and float32 graph inputs (the trained weights once the session made them
  inputs) stay float32 — the master copies. A consumer that runs in half reads a twin ``<w>_fp16``
  (``<w>_bf16``) made by a ``Cast`` placed right before the first such consumer. The twin is computed
  from the master inside every step, so the optimizer only updates the master: there is no twin state
  to refresh, and the gradient builder differentiates through the Cast, which turns the twin's
  gradient into a float32 gradient of the master (``<w>_grad``).
* Gather/GatherElements/GatherND on a float32 master (an embedding table) stay float32 and their rows
  are cast like a weight: the backward scatter-adds the rows' gradients in float32.
* Constants and values computed from shapes only ("weak" floats) take the type of the op using them.
* The loss region stays float32 (the loss ops are float32 and everything downstream follows them);
  ``scaled_loss = loss · loss_scale`` is appended, ``loss_scale`` a new float32 ``[1]`` graph input.
  Original float32 graph outputs keep float32 (a Cast back is added when needed), so
  ``is_output_fp32_node`` is true for all of them.

After the gradient graph of ``scaled_loss`` exists, ``gradient_checks`` (a ModelProto pass) or the
node-level ``all_finite``/``skip_update_if_not_finite`` helpers add ``global_gradient_norm``,
``all_gradients_finite`` and the guarded update. The graph stays standard ONNX at its opset.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.opset_upgrade import upgrade_opset
from onnxtrain.graph_transforms.clipping import global_norm
from onnxtrain.ir.builder import NameGen, NodeWriter, elem_type, model_opset, value_types
from onnxtrain.ir.elem_types import formal_types
from onnxtrain.ir.functions import has_function
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, body_reads, rename_values, subgraphs
from onnxtrain.ir.types import np_dtype
from onnxtrain.user_warning import warn

HALF_TYPES = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
SUFFIX = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16", TensorProto.FLOAT: "fp32"}
LOSS_SCALE = "loss_scale"
SCALED_LOSS = "scaled_loss"
ALL_FINITE = "all_gradients_finite"
METADATA_KEY = "onnxtrain.mixed_precision"
BF16_MIN_OPSET = 20
#: the largest finite value of each half type: larger float32 constants saturate to it (not ±inf)
HALF_MAX = {TensorProto.FLOAT16: 65504.0, TensorProto.BFLOAT16: 3.3895313892515355e38}

#: ops that run in the half type (compute-bound; the engine multiplies half operands in float32)
HALF_OPS = frozenset({"MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum"})
#: ops whose statistics or range need float32: their float inputs are cast to float32
FP32_OPS = frozenset({
    "Softmax", "LogSoftmax", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
    "ReduceSum", "ReduceMean", "ReduceSumSquare", "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
    "ReduceProd", "CumSum", "BatchNormalization", "InstanceNormalization", "GroupNormalization",
    "LpNormalization", "MeanVarianceNormalization", "LpPool", "GlobalLpPool",
    "Exp", "Log", "Pow", "Reciprocal", "Softplus", "RNN", "LSTM", "GRU",
    # sums of many terms or steep functions, as in torch's autocast float32 list
    "LRN", "DFT", "STFT", "Det", "Acos", "Asin", "Cosh", "Sinh", "Tan",
    # a fake quantizer in float32, as at opset 13 (float32 only there): both nodes read the one float32
    # scale (in half, one of them read a half copy of it, and the pair was no longer one quantizer)
    "QuantizeLinear", "DequantizeLinear",
    # sequences and optionals hold float32 tensors: their element type is not tracked, so what SequenceAt
    # or OptionalGetElement takes out (and the gradients the backward puts in) must be what went in
    "SplitToSequence", "SequenceConstruct", "SequenceInsert", "Optional",
})
#: ops whose output takes their input's type when they have no ``dtype``: float32 barriers then (their output
#: is recorded as float32, so their input must be)
COPIES_INPUT_TYPE = frozenset({"RandomNormalLike", "RandomUniformLike", "Bernoulli", "EyeLike"})

#: lookups of a float32 master table stay float32 (their rows are cast like weights)
GATHER_OPS = frozenset({"Gather", "GatherElements", "GatherND"})

_HALF, _F32, _WEAK = "half", "f32", "weak"  # kinds of float32-born values


@dataclass
class MixedPrecisionInfo:
    """What the pass did, as recorded in the model's metadata (``mixed_precision_info(model)``)."""

    dtype: int  # TensorProto.FLOAT16 or BFLOAT16
    loss: str
    loss_scale: str
    scaled_loss: str
    twins: dict[str, str] = field(default_factory=dict)  # float32 initializer/graph input → its half twin

    @property
    def np_dtype(self) -> np.dtype:
        return np_dtype(self.dtype)


def _half_type(dtype: Any) -> int:
    if isinstance(dtype, str):
        if dtype not in HALF_TYPES:
            raise ValueError(f"mixed precision dtype must be one of {sorted(HALF_TYPES)}, got {dtype!r}")
        return HALF_TYPES[dtype]
    if dtype in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        return int(dtype)
    try:
        et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    except (TypeError, KeyError):
        et = TensorProto.UNDEFINED
    if et not in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
        raise ValueError(f"mixed precision dtype must be float16 or bfloat16, got {dtype!r}")
    return et


def mixed_precision(model: onnx.ModelProto, loss: str, dtype: Any = "float16", *,
                    loss_scale_name: str = LOSS_SCALE, scaled_loss_name: str = SCALED_LOSS,
                    half_ops: Iterable[str] | None = None, fp32_ops: Iterable[str] | None = None,
                    keep_fp32_nodes: Iterable[str] = ()) -> onnx.ModelProto:
    """The forward ``model`` computing in ``dtype`` ("float16" or "bfloat16") with float32 master weights.

    ``loss`` names the float32 loss; the result has a float32 ``[1]`` input ``loss_scale`` and an output
    ``scaled_loss`` = loss·loss_scale, the value to differentiate (default names the model already uses
    get a suffix: :func:`mixed_precision_info` holds the names). ``half_ops``/``fp32_ops`` replace the
    default op classes (an op given in one leaves the other's default; in both, an error),
    ``keep_fp32_nodes`` names nodes that must run in float32 (a name no node has is an error). Example::

        mp = mixed_precision(model, "loss")
        info = mixed_precision_info(mp)
        grad = build_gradient_model(mp, info.scaled_loss, weights)   # <w>_grad are float32
        grad = gradient_checks(grad, [f"{w}_grad" for w in weights])
    """
    half = _half_type(dtype)
    # bfloat16 ConstantOfShape (zero gradients, Gather's backward) is valid from opset 20
    model = upgrade_opset(model, BF16_MIN_OPSET if half == TensorProto.BFLOAT16 else 17)
    src = onnx.ModelProto()
    src.CopyFrom(model)
    g = src.graph
    opset = model_opset(src)
    types = value_types(src)
    half_set, f32_set = _op_classes(half_ops, fp32_ops)
    keep_nodes = set(keep_fp32_nodes)
    unknown = sorted(keep_nodes - {n.name for n in g.node if n.name})
    if unknown:
        raise ValueError(f"mixed_precision: keep_fp32_nodes {unknown} name no node of the model's graph (a "
                         "node is kept by its name; control-flow bodies run in float32 already)")
    names = NameGen.for_model(src)
    if loss not in {o for n in g.node for o in n.output} | {i.name for i in g.input}:
        raise ValueError(f"mixed_precision: loss {loss!r} is not a value of the model")
    given = []
    for name, default in ((loss_scale_name, LOSS_SCALE), (scaled_loss_name, SCALED_LOSS)):
        if name in names.taken and name != default:
            raise ValueError(f"mixed_precision: the model already has a value named {name!r}")
        given.append(names(name))  # the default name, made unique as onnxruntime made it
    loss_scale_name, scaled_loss_name = given

    orig: dict[str, int] = {k: elem_type(types, k) for k in types}
    phys: dict[str, int] = dict(orig)  # element type each value has after the rewrite
    kind: dict[str, str] = {}
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            kind[t.name] = _HALF
    for v in g.input:
        if orig.get(v.name) == TensorProto.FLOAT:
            kind[v.name] = _HALF
    const_nodes = {n.output[0]: n for n in g.node if n.op_type == "Constant" and n.output}
    nodes: list[onnx.NodeProto] = []
    converted: dict[tuple[str, int], str] = {}
    twins: dict[str, str] = {}
    master_names = {t.name for t in g.initializer} | {v.name for v in g.input}
    inits = {t.name: t for t in g.initializer if t.data_type == TensorProto.FLOAT}

    def as_type(v: str, target: int) -> str:
        """``v`` as element type ``target``: itself, a converted Constant, or a shared Cast."""
        if phys.get(v) == target:
            return v
        key = (v, target)
        if key in converted:
            return converted[key]
        out = names(f"{v}_{SUFFIX[target]}")
        cn = const_nodes.get(v)
        if cn is not None and phys.get(v) == TensorProto.FLOAT and cn.attribute[0].name in _FLOAT_VALUES:
            arr = _constant_value(cn.attribute[0])
            if target == half and _beyond(arr, half, v):  # (infinities stay infinite)
                arr = np.where(np.isfinite(arr), np.clip(arr, -HALF_MAX[half], HALF_MAX[half]), arr)
            arr = arr.astype(np_dtype(target))
            cname = names(f"{cn.name or 'Constant'}_{SUFFIX[target]}")
            tensor = numpy_helper.from_array(arr, out)
            nodes.append(helper.make_node("Constant", [], [out], name=cname, value=tensor))
        else:
            src = v
            t = inits.get(v)
            if (target == half and t is not None and not t.external_data
                    and _beyond(numpy_helper.to_array(t), half, v)):
                bounds = [names(f"{v}_{end}") for end in ("min", "max")]
                for b, x in zip(bounds, (-HALF_MAX[half], HALF_MAX[half])):
                    nodes.append(helper.make_node("Constant", [], [b], name=names(f"{b}_Constant"),
                                                  value=numpy_helper.from_array(np.array(x, np.float32), b)))
                src = names(f"{v}_saturated")
                nodes.append(helper.make_node("Clip", [v, *bounds], [src], name=names(f"{v}_Clip")))
            cname = names(f"{v}_Cast_{SUFFIX[target]}")
            nodes.append(helper.make_node("Cast", [src], [out], name=cname, to=target))
        if v in master_names and target == half:
            twins[v] = out
        converted[key] = out
        phys[out] = target
        kind[out] = _HALF if target == half else _F32
        return out

    for node in g.node:
        node = _copy(node)
        if node.op_type == "Constant":
            for o in node.output:
                if orig.get(o) == TensorProto.FLOAT:
                    kind[o] = _WEAK
            nodes.append(node)
            continue
        if any(True for _ in subgraphs(node)):
            # control flow runs in float32: its inputs, and the outer values its bodies read, are cast back
            for i, v in enumerate(node.input):
                if v and orig.get(v) == TensorProto.FLOAT and phys.get(v) != TensorProto.FLOAT:
                    node.input[i] = as_type(v, TensorProto.FLOAT)
            reads = {c: as_type(c, TensorProto.FLOAT) for c in body_reads(node)
                     if orig.get(c) == TensorProto.FLOAT and phys.get(c) != TensorProto.FLOAT}
            rename_values(node, reads)  # its inputs already read the casts
            for o in node.output:
                if o and orig.get(o) == TensorProto.FLOAT:
                    kind[o] = _F32
            nodes.append(node)
            continue
        schema = _schema(node, opset)
        if (node.op_type == "Cast" and _attr_int(node, "to") == TensorProto.FLOAT and node.input[0]
                and node.name not in keep_nodes):  # (a kept one gives float32, as the op class below does)
            _rewrite_float_cast(node, orig, phys, kind)
            nodes.append(node)
            continue
        if schema is None:  # unknown op: a float32 barrier
            for i, v in enumerate(node.input):
                if v and orig.get(v) == TensorProto.FLOAT and phys.get(v) != TensorProto.FLOAT:
                    node.input[i] = as_type(v, TensorProto.FLOAT)
            for o in node.output:
                if o and orig.get(o) == TensorProto.FLOAT:
                    kind[o] = _F32
            nodes.append(node)
            continue
        if (node.op_type in GATHER_OPS and node.input[0] in master_names
                and orig.get(node.input[0]) == TensorProto.FLOAT and node.name not in keep_nodes):
            # an embedding lookup reads the float32 table and its rows are cast where a half op uses them,
            # like a weight: the backward scatter-adds the rows' gradients in float32
            for o in node.output:
                if o and orig.get(o) == TensorProto.FLOAT:
                    kind[o] = _HALF
            nodes.append(node)
            continue
        copies = node.op_type in COPIES_INPUT_TYPE and _attr_int(node, "dtype") is None
        policy = "f32" if node.op_type in f32_set or node.name in keep_nodes or copies else (
            "half" if node.op_type in half_set else "follow")
        in_t = formal_types(schema, len(node.input), outputs=False)
        out_t = formal_types(schema, len(node.output), outputs=True)
        allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
        half_str = "tensor(float16)" if half == TensorProto.FLOAT16 else "tensor(bfloat16)"
        one_type = _runs_as_body(node, opset)  # its body needs its float type variables alike
        if one_type and policy == "follow":
            floats = [node.input[i] for i, t in enumerate(in_t) if t in allowed and node.input[i]
                      and orig.get(node.input[i]) == TensorProto.FLOAT]
            kinds = {kind.get(v, _F32) for v in floats}
            if _F32 in kinds:
                policy = "f32"  # every member float32 (a half V beside a float32 Q was left half)
            elif _HALF in kinds:
                policy = "half"  # a weak member (a constant scale or V) takes the half type with the rest
        for tv in sorted({t for t in (*in_t, *out_t) if t in allowed}):
            if node.op_type == "Dropout" and len(in_t) > 1 and tv == in_t[1]:
                continue  # the ratio stays float32 (spec §8.2): 0.3 in bfloat16 is 0.30078125
            ins = [i for i, t in enumerate(in_t) if t == tv and node.input[i]]
            outs = [j for j, t in enumerate(out_t) if t == tv and node.output[j]]
            members = [node.input[i] for i in ins] + [node.output[j] for j in outs]
            if not any(orig.get(m) == TensorProto.FLOAT for m in members):
                continue
            if any(orig.get(m) not in (TensorProto.FLOAT, TensorProto.UNDEFINED, None) for m in members):
                # e.g. a float64 member: the group keeps its original types
                for i in ins:
                    v = node.input[i]
                    if orig.get(v) == TensorProto.FLOAT and phys.get(v) != TensorProto.FLOAT:
                        node.input[i] = as_type(v, TensorProto.FLOAT)
                continue
            in_kinds = {kind.get(node.input[i], _F32) for i in ins}
            can_half = half_str in allowed[tv]
            if policy == "f32" or not can_half:
                target = TensorProto.FLOAT
            elif policy == "half":
                target = half
            elif _F32 in in_kinds:
                target = TensorProto.FLOAT
            elif _HALF in in_kinds:
                target = half
            else:
                target = TensorProto.FLOAT  # only weak inputs (constants, shapes): the result stays weak
            for i in ins:
                node.input[i] = as_type(node.input[i], target)
            out_kind = _HALF if target == half else (_WEAK if in_kinds <= {_WEAK} else _F32)
            for j in outs:
                o = node.output[j]
                phys[o] = target
                kind[o] = out_kind
            if node.op_type == "LayerNormalization" and target == half:
                _set_int_attr(node, "stash_type", TensorProto.FLOAT)
        for o in node.output:  # float outputs outside any converted group
            if o and orig.get(o) == TensorProto.FLOAT and o not in kind:
                kind[o] = _F32
        nodes.append(node)

    # float32 graph outputs stay float32: rename the half value and cast it back
    renames: dict[str, str] = {}
    for out in g.output:
        o = out.name
        if orig.get(o) == TensorProto.FLOAT and phys.get(o) != TensorProto.FLOAT and o not in master_names:
            renames[o] = names(f"{o}_{SUFFIX[phys[o]]}")
    if renames:
        back_of = {v: k for k, v in renames.items()}
        fixed: list[onnx.NodeProto] = []
        for n in nodes:
            for seq in (n.input, n.output):
                for k, v in enumerate(seq):
                    if v in renames:
                        seq[k] = renames[v]
            fixed.append(n)
            for o in n.output:
                if o in back_of:
                    back = back_of[o]
                    phys[o] = phys[back]
                    phys[back] = TensorProto.FLOAT
                    fixed.append(helper.make_node("Cast", [o], [back], name=names(f"{back}_Cast_fp32"),
                                                  to=TensorProto.FLOAT))
        nodes = fixed
    # loss scaling, in float32
    loss32 = loss
    if phys.get(loss) != TensorProto.FLOAT:
        if phys.get(loss) not in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            got = phys.get(loss)
            kind = TensorProto.DataType.Name(got).lower() if got else "of unknown type"
            raise ValueError(f"mixed precision (TrainingParameters.use_mixed_precision, generate_artifacts' "
                             f"mixed_precision): the loss {loss!r} is {kind}, not float32: mixed precision "
                             "trains a float32 model (float32 master weights, computed in the half type); "
                             "train this model without it")
        loss32 = as_type(loss, TensorProto.FLOAT)
    nodes.append(helper.make_node("Mul", [loss32, loss_scale_name], [scaled_loss_name],
                                  name=names("LossScale_Mul")))

    changed = {v for v, t in phys.items() if orig.get(v) not in (None, t)}
    del g.node[:]
    g.node.extend(nodes)
    kept_vi = [v for v in g.value_info if v.name not in changed]
    del g.value_info[:]
    g.value_info.extend(kept_vi)
    g.input.append(helper.make_tensor_value_info(loss_scale_name, TensorProto.FLOAT, [1]))
    g.output.append(_scaled_loss_info(src, scaled_loss_name))
    # a twin's name for every float32 initializer or weight fed as an input, as onnxruntime gave each one
    # (one read in float32 only has no Cast: its half gradient and state copy still come out by that name)
    floats = [t.name for t in g.initializer if t.data_type == TensorProto.FLOAT]
    floats += [v.name for v in g.input if orig.get(v.name) == TensorProto.FLOAT]
    for name in floats:
        if name not in twins:
            twins[name] = names(f"{name}_{SUFFIX[half]}")
    info = MixedPrecisionInfo(half, loss, loss_scale_name, scaled_loss_name, twins)
    _set_metadata(src, info)
    return src


def mixed_precision_info(model: onnx.ModelProto) -> MixedPrecisionInfo | None:
    """What ``mixed_precision`` recorded in ``model`` (None for a model it did not transform)."""
    for p in model.metadata_props:
        if p.key == METADATA_KEY:
            d = json.loads(p.value)
            return MixedPrecisionInfo(int(d["dtype"]), d["loss"], d["loss_scale"], d["scaled_loss"],
                                      dict(d["twins"]))
    return None


def half_copies(weights: Mapping[str, np.ndarray], dtype: Any = "float16") -> dict[str, np.ndarray]:
    """The half twins of float32 master weights, as the graph's Cast computes them (round to nearest even).

    For ``get_model_state(include_mixed_precision_weights=True)``: ``{"mixed_precision": half_copies(...)}``.
    """
    dt = np_dtype(_half_type(dtype))
    return {k: np.asarray(v).astype(dt) for k, v in weights.items()}


# ---- the finite check and the guarded update (node level, for the step graph) --------------------

def all_finite(w: NodeWriter, norm: str, out_name: str = ALL_FINITE) -> str:
    """``all_gradients_finite`` = isfinite(global gradient norm), a bool scalar (spec §8.4).

    The norm is the float32 sum of squares of the loss-scaled gradients, so it is NaN or inf as soon as
    one gradient element is.
    """
    bad = w.one("Or", w.one("IsInf", norm), w.one("IsNaN", norm))
    return w.emit("Not", [bad], [w.names(out_name)])[0]


def skip_update_if_not_finite(w: NodeWriter, flag: str, updates: Mapping[str, str]) -> dict[str, str]:
    """``{old: Where(flag, new, old)}`` for every ``old → new`` of an optimizer's updates.

    Weights, moments and counters keep their values when the flag is false (the step is skipped).
    """
    out: dict[str, str] = {}
    for old, new in updates.items():
        out[old] = w.emit("Where", [flag, new, old], [w.names(f"{new}_if_finite")])[0]
    return out


def unscale(w: NodeWriter, grad: str, divisor: str) -> str:
    """grad / divisor (the loss scale, or the clipping divisor of ``clipping.clip_divisor``)."""
    return w.one("Div", grad, divisor)


def mixed_precision_update(w: NodeWriter, opt: Any, slots: list[Any], lr: str, state: dict[str, str],
                           norm: str, loss_scale: str, max_norm_clip: Mapping[str, float] | None = None,
                           norm_et: int = TensorProto.FLOAT) -> tuple[dict[str, str], dict[str, str], str]:
    """The optimizer step on loss-scaled gradients: unscale (with clipping, spec §10, when ``max_norm_clip``
    gives each weight's bound and the optimizer uses the norm), update, and keep every old value when
    the gradients are not all finite. ``norm`` is the global norm of the scaled gradients
    (``clipping.global_norm``), of type ``norm_et``.
    Returns (weight → new weight, state → new state, ``all_gradients_finite``).
    """
    from onnxtrain.graph_transforms.clipping import clip_divisor

    flag = all_finite(w, norm, f"{ALL_FINITE}_scalar")  # the output, its [1] copy, is made by the caller
    for s in slots:
        if max_norm_clip is not None and getattr(opt, "uses_norm", False):
            s.divisor = clip_divisor(w, norm, float(max_norm_clip[s.name]), loss_scale, norm_et, s.elem_type)
        elif s.elem_type != TensorProto.FLOAT:  # a float64 weight's gradient: the float32 scale cast
            s.divisor = w.one("Cast", loss_scale, to=s.elem_type)
        else:
            s.divisor = loss_scale  # SGD, or clipping off: s = L
    new_w, new_s = opt.emit(w, slots, lr, state)
    return skip_update_if_not_finite(w, flag, new_w), skip_update_if_not_finite(w, flag, new_s), flag


def gradient_checks(model: onnx.ModelProto, grads: Sequence[str], norm_name: str = "global_gradient_norm",
                    flag_name: str = ALL_FINITE) -> onnx.ModelProto:
    """Add outputs ``global_gradient_norm`` (float32, loss-scaled) and ``all_gradients_finite`` to a
    gradient model whose ``grads`` are graph outputs; half gradients are cast to float32 first."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    types = value_types(m)
    nodes = list(g.node)
    w = NodeWriter(NameGen.for_model(m), nodes)
    f32 = []
    for name in grads:
        et = elem_type(types, name)
        f32.append(name if et == TensorProto.FLOAT else w.one("Cast", name, to=TensorProto.FLOAT))
    norm = global_norm(w, f32, norm_name)
    flag = all_finite(w, norm, flag_name)
    del g.node[:]
    g.node.extend(nodes)
    g.output.append(helper.make_tensor_value_info(norm, TensorProto.FLOAT, []))
    g.output.append(helper.make_tensor_value_info(flag, TensorProto.BOOL, []))
    return m


# ---- helpers --------------------------------------------------------------------------------

_FLOAT_VALUES = ("value", "value_float", "value_floats")


def _constant_value(attr: onnx.AttributeProto) -> np.ndarray:
    """The float32 array of a Constant's ``value``, ``value_float`` or ``value_floats`` attribute."""
    if attr.name == "value_float":
        return np.array(attr.f, np.float32)
    if attr.name == "value_floats":
        return np.array(list(attr.floats), np.float32)
    return numpy_helper.to_array(attr.t)


def check_loss_scale_feed(name: str, value: Any) -> None:
    """ValueError naming input ``name`` unless the fed loss scale is one positive finite number (0 made zero
    gradients and 0/0 updates, NaN weights; a negative scale a step uphill)."""
    a = np.asarray(value)
    if not (a.size == 1 and np.isfinite(a).all() and (a > 0).all()):
        raise ValueError(f"input {name!r}: the loss scale must be a positive finite number, got "
                         f"{a.ravel()[:4]}")


def _beyond(arr: np.ndarray, half: int, name: str) -> bool:
    """Whether float32 constant ``name`` has finite values the half type cannot hold (a warning then: they
    saturate, e.g. an attention mask's float32 minimum, which a Cast would make -inf and the loss NaN)."""
    big = np.isfinite(arr) & (np.abs(arr) > HALF_MAX[half])
    if big.any():
        warn(f"mixed precision: {name!r} holds {int(big.sum())} value(s) beyond {SUFFIX[half]}'s range "
             f"(e.g. {float(arr[big].flat[0]):.4g}); they saturate to ±{HALF_MAX[half]:.6g}")
    return bool(big.any())


def _runs_as_body(node: onnx.NodeProto, opset: int) -> bool:
    """Whether ``node`` runs as its ONNX function body (no kernel of its own: RMSNormalization,
    Attention ...), whose nodes need the node's float inputs to share one type. (The ops with a body
    and no kernel are those with a body and no gradient rule: the gradient builder expands the same.)"""
    from onnxtrain.engine.registry import find_kernel

    return has_function(node.op_type, opset, node.domain) and find_kernel(node.op_type, opset) is None


def _op_classes(half_ops: Iterable[str] | None,
                fp32_ops: Iterable[str] | None) -> tuple[frozenset, frozenset]:
    """The op types run in the half type and in float32: the defaults, or the lists given. An op given in
    one list leaves the other one's default (``half_ops=["MatMul", "Softmax"]`` runs Softmax in half); an
    op given in both is an error."""
    half = None if half_ops is None else frozenset(half_ops)
    f32 = None if fp32_ops is None else frozenset(fp32_ops)
    if half is not None and f32 is not None and half & f32:
        raise ValueError(f"mixed_precision: op(s) {sorted(half & f32)} are in both half_ops and fp32_ops")
    if half is None:
        half = HALF_OPS - (f32 or frozenset())
    if f32 is None:
        f32 = FP32_OPS - half
    return half, f32


def _schema(node: onnx.NodeProto, opset: int) -> onnx.defs.OpSchema | None:
    if node.domain not in DEFAULT_DOMAINS:
        return None
    try:
        return onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None


def _rewrite_float_cast(node: onnx.NodeProto, orig: dict[str, int], phys: dict[str, int],
                        kind: dict[str, str]) -> None:
    """Cast(x, to=FLOAT): from a float input it follows the input's new type (as onnxruntime's transformer
    turned float Casts into float16 ones); from an integer or bool input its output is a weak float."""
    x, y = node.input[0], node.output[0]
    if orig.get(x) == TensorProto.FLOAT and kind.get(x) in (_HALF, _F32, _WEAK):
        target = phys.get(x, TensorProto.FLOAT)
        _set_int_attr(node, "to", target)
        phys[y] = target
        kind[y] = kind[x]
    else:
        kind[y] = _WEAK


def _attr_int(node: onnx.NodeProto, name: str) -> int | None:
    for a in node.attribute:
        if a.name == name:
            return int(a.i)
    return None


def _set_int_attr(node: onnx.NodeProto, name: str, value: int) -> None:
    for a in node.attribute:
        if a.name == name:
            a.i = value
            return
    node.attribute.append(helper.make_attribute(name, value))


def _scaled_loss_info(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """The inferred type of ``scaled_loss`` (the loss shape broadcast with ``[1]``)."""
    tp = value_types(model).get(name)
    if tp is not None and tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
        return helper.make_value_info(name, tp)
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1])


def _set_metadata(model: onnx.ModelProto, info: MixedPrecisionInfo) -> None:
    keep = [p for p in model.metadata_props if p.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    p = model.metadata_props.add()
    p.key = METADATA_KEY
    p.value = json.dumps({"dtype": info.dtype, "loss": info.loss, "loss_scale": info.loss_scale,
                          "scaled_loss": info.scaled_loss, "twins": info.twins})


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c

"""The types and shapes an ``InferenceSession`` reports for its outputs: the model's declarations merged with
what shape inference finds, as onnxruntime merges them when it resolves the graph."""

from __future__ import annotations

import onnx

from onnxtrain.engine.interface import holds_values, without_values


def inferred_output_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Each graph output's type as onnxruntime shows it: its declaration (type and dims) merged with the type
    ONNX shape inference gives it (no data propagation, unknown dims unnamed, an overridable initializer's
    value not read). An output inference says nothing about keeps its declaration."""
    light = without_values(model)  # (weights need not be copied: inference reads small constants only)
    probe = onnx.ModelProto()
    probe.CopyFrom(light)
    for v in probe.graph.output:  # inference's own finding, merged with the declaration below
        v.ClearField("type")
    g = probe.graph
    fed = {v.name for v in g.input} if model.ir_version >= 4 else set()
    kept = []
    for t in g.initializer:
        if t.name in fed:  # an overridable initializer: its declared input's type only
            continue
        if holds_values(t):
            kept.append(t)
        else:  # a weight the session holds apart (no values here): its type, as an input's
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    del g.initializer[:]
    g.initializer.extend(kept)
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False, data_prop=False)
    except Exception:  # noqa: BLE001 - the declarations as they are
        return {v.name: v.type for v in model.graph.output}
    found: dict[str, onnx.TypeProto] = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if v.type.WhichOneof("value") is not None:
            found[v.name] = v.type
    for t in inferred.graph.initializer:
        found.setdefault(t.name, onnx.helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    symbols = _dim_params(model.graph)
    out: dict[str, onnx.TypeProto] = {}
    for v in model.graph.output:
        merged = onnx.TypeProto()
        merged.CopyFrom(v.type)
        source = found.get(v.name)
        if source is not None:
            _merge(source, merged, symbols)
        out[v.name] = merged
    return out


def _dim_params(graph: onnx.GraphProto) -> set[str]:
    """The symbolic dim names the graph's inputs, outputs and value_info declare."""
    names = set()
    for v in [*graph.input, *graph.output, *graph.value_info]:
        if v.type.HasField("tensor_type"):
            names.update(d.dim_param for d in v.type.tensor_type.shape.dim if d.dim_param)
    return names


def _merge(source: onnx.TypeProto, target: onnx.TypeProto, symbols: set[str]) -> None:
    """Merge the inferred type ``source`` into the declared ``target`` in place, as onnxruntime's
    ``MergeShapeInfo`` does (ONNX's ``mergeInShapeInfo``; on a conflict its lenient fallback
    ``UnionShapeInfo``, which forgets the dims that disagree, or the rank)."""
    kind = target.WhichOneof("value")
    if kind is None:
        target.CopyFrom(source)
        _forget_generated(target, symbols)
        return
    if kind != "tensor_type" or not source.HasField("tensor_type"):
        return  # a container keeps its declaration
    src, dst = source.tensor_type, target.tensor_type
    if not dst.elem_type:
        dst.elem_type = src.elem_type
    if not src.HasField("shape"):
        return
    if not dst.HasField("shape"):
        dst.shape.CopyFrom(src.shape)
        _forget_generated(target, symbols)
        return
    if len(src.shape.dim) != len(dst.shape.dim):
        dst.ClearField("shape")
        return
    for s, d in zip(src.shape.dim, dst.shape.dim):
        s_param = s.dim_param if s.dim_param in symbols else ""
        if s.HasField("dim_value"):
            if d.HasField("dim_value") and d.dim_value != s.dim_value:
                _union(src.shape, dst.shape, symbols)
                return
            d.dim_value = s.dim_value
        elif d.HasField("dim_value") or d.dim_param:
            continue  # the declared dim stays
        elif s_param:
            d.dim_param = s_param


def _union(source: onnx.TensorShapeProto, target: onnx.TensorShapeProto, symbols: set[str]) -> None:
    """Forget each dim of ``target`` that ``source`` disagrees with (ONNX's ``UnionShapeInfo``)."""
    for s, d in zip(source.dim, target.dim):
        s_param = s.dim_param if s.dim_param in symbols else ""
        if s.HasField("dim_value"):
            same = d.HasField("dim_value") and d.dim_value == s.dim_value
        elif s_param:
            same = d.dim_param == s_param
        else:
            same = not (d.HasField("dim_value") or d.dim_param)
        if not same:
            d.Clear()


def _forget_generated(tp: onnx.TypeProto, symbols: set[str]) -> None:
    """Unname the dims shape inference named itself (``unk__0``: onnxruntime leaves them unknown)."""
    if tp.HasField("tensor_type"):
        for d in tp.tensor_type.shape.dim:
            if d.dim_param and d.dim_param not in symbols:
                d.Clear()

"""Graph helpers that onnxruntime-training's own loss blocks use and custom losses copy from them
(``onnxblock._graph_utils``): look up a graph input or output, name a new value, set the graph outputs,
ask whether a node reads or writes a value."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import onnx

from onnxtrain.training.onnxblock import model_accessor

_tokens = itertools.count(1)


def _named(values: Sequence[onnx.ValueInfoProto], name: str, what: str) -> onnx.ValueInfoProto:
    for v in values:
        if v.name == name:
            return v
    raise LookupError(f"{name!r} is not a graph {what}; the {what}s are {[v.name for v in values]}")


def get_output_from_output_name(onnx_model: onnx.ModelProto, output_name: str) -> onnx.ValueInfoProto:
    """The graph output ``output_name``; LookupError when the graph has none of that name."""
    return _named(onnx_model.graph.output, output_name, "output")


def get_input_from_input_name(onnx_model: onnx.ModelProto, input_name: str) -> onnx.ValueInfoProto:
    """The graph input ``input_name``; LookupError when the graph has none of that name."""
    return _named(onnx_model.graph.input, input_name, "input")


def generate_graph_name(token: str) -> str:
    """A new value name ``onnx::<token>::<n>``: inside a block's build, one the model being built does
    not hold yet (the blocks' own names come from the same counter)."""
    try:
        acc = model_accessor.current()
    except RuntimeError:  # outside onnxblock.base(...): a process-wide count
        return f"onnx::{token}::{next(_tokens)}"
    return acc.fresh(token)


def register_graph_outputs(model: onnx.ModelProto, output_names: list[str] | str) -> None:
    """Make ``output_names`` the graph's outputs, in that order, each typed from its graph output or its
    value_info entry (LookupError for a name that has neither)."""
    names = [output_names] if isinstance(output_names, str) else list(output_names)
    known = {v.name: v for v in model.graph.value_info}
    known.update({o.name: o for o in model.graph.output})
    missing = [n for n in names if n not in known]
    if missing:
        raise LookupError(f"{missing} are neither graph outputs nor value_info entries: their types are "
                          "unknown")
    chosen = [onnx.ValueInfoProto() for _ in names]
    for v, n in zip(chosen, names):
        v.CopyFrom(known[n])
    del model.graph.output[:]
    model.graph.output.extend(chosen)


def node_arg_exists(model: onnx.ModelProto, node_arg_name: str) -> bool:
    """Whether a node of the graph reads or writes ``node_arg_name``."""
    return any(node_arg_name in n.input or node_arg_name in n.output for n in model.graph.node)

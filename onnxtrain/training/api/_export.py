"""``export_model_for_inferencing``: the eval graph cut to chosen outputs, parameters baked in (§3.5)."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from onnxtrain.ir.builder import value_types
from onnxtrain.ir.graphs import inference_batch_norms, path_to
from onnxtrain.ir.io import save_model_sized


def _check_output_names(names: Sequence[str]) -> list[str]:
    if isinstance(names, np.ndarray) and names.ndim == 1:  # a list, as onnxruntime-training takes it
        names = names.tolist()
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise TypeError(f"graph_output_names must be a list of str, got {type(names).__name__}")
    # a name given as bytes or bytearray is the one it spells in UTF-8, as onnxruntime-training's binding
    # takes it (as the name's string); invalid UTF-8 is kept escaped, and names no value
    names = [bytes(n).decode("utf-8", "surrogateescape") if isinstance(n, (bytes, bytearray)) else n
             for n in names]
    if not names:
        raise ValueError("Expected a non empty vector of graph output names. Got an empty vector.")
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"graph_output_names must hold str, got {bad!r}")
    return names


def _check_target(path: str) -> None:
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Cannot export the inference model, the path is a directory",
                                path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(errno.ENOENT,
                                "Cannot export the inference model, its directory does not exist", path)


def _last_reads(g: onnx.GraphProto) -> list[str]:
    """The computed values the graph's last node reads (the loss's inputs, in a generated eval model)."""
    made = {o for n in g.node for o in n.output if o}
    return [i for i in g.node[-1].input if i in made] if g.node else []


def export_for_inference(eval_model: onnx.ModelProto, params: Mapping[str, np.ndarray],
                         path: str | os.PathLike, graph_output_names: Sequence[str]) -> None:
    """Write ``eval_model`` with outputs ``graph_output_names`` and ``params`` as initializers.

    Nodes that do not lead to the outputs are removed, inputs nobody reads (e.g. ``target``) dropped.
    """
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"inference_model_uri must be a path, got {type(path).__name__}")
    path = os.fsdecode(path)  # (bytes: the file's name, as onnxruntime-training's binding reads them)
    names = _check_output_names(graph_output_names)
    g = eval_model.graph
    known = {v.name for v in g.input} | {t.name for t in g.initializer}
    known |= {o for n in g.node for o in n.output if o}
    for n in names:
        if n not in known:
            raise ValueError(f"Expected graph output for inference graph {n} could not be found. Please "
                             "regenerate the eval graph (graph outputs of the eval model: "
                             f"{[v.name for v in g.output]}; any value it computes may be named, e.g. "
                             f"the values its last node reads: {_last_reads(g)}).")
    _check_target(path)

    kept, needed = path_to(g.node, names)

    types = value_types(eval_model)
    out = onnx.ModelProto()
    out.CopyFrom(eval_model)
    og = out.graph
    del og.node[:]
    og.node.extend(kept)
    del og.output[:]
    for n in names:
        vi = onnx.ValueInfoProto(name=n)
        if n in types:
            vi.type.CopyFrom(types[n])
        og.output.append(vi)
    inputs = [v for v in g.input if v.name in needed and v.name not in params]
    del og.input[:]
    og.input.extend(inputs)
    inits = [t for t in g.initializer if t.name in needed and t.name not in params]
    del og.initializer[:]
    og.initializer.extend(inits)
    arrays = [(p, np.asarray(params[p])) for p in params if p in needed]  # written as they are
    value_info = [v for v in g.value_info if v.name in needed and v.name not in set(names)]
    del og.value_info[:]
    og.value_info.extend(value_info)
    out = inference_batch_norms(out)  # inference BatchNorms' running-statistics outputs: checkers refuse them

    # past protobuf's 2 GiB the parameters go to <file>.data, written whole and renamed with the model
    save_model_sized(out, path, arrays=arrays)

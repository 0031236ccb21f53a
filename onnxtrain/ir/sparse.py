"""Sparse tensors of a model (``graph.sparse_initializer``, ``Constant``'s ``sparse_value``) made dense, as
onnxruntime makes them when it loads a model: every kernel and gradient rule then sees plain initializers
and Constants."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.ir.graphs import model_graphs, model_nodes


def dense_tensor(sparse: onnx.SparseTensorProto) -> onnx.TensorProto:
    """The dense tensor of ``sparse`` (COO: indices [NNZ] into the flattened tensor, or [NNZ, rank]), named as
    its values."""
    values = numpy_helper.to_array(sparse.values)
    indices = numpy_helper.to_array(sparse.indices).astype(np.int64)
    dense = np.zeros(tuple(sparse.dims), values.dtype)
    if indices.ndim == 1:
        dense.reshape(-1)[indices] = values
    else:
        dense[tuple(indices.T)] = values
    return numpy_helper.from_array(dense, sparse.values.name)


def _has_sparse(model: onnx.ModelProto) -> bool:
    return any(g.sparse_initializer for g in model_graphs(model)) or any(
        a.name == "sparse_value" for n in model_nodes(model) if n.op_type == "Constant" for a in n.attribute)


def dense_sparse_tensors(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its sparse initializers and sparse Constants dense (a copy), or itself without any."""
    if not _has_sparse(model):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in model_graphs(out):
        g.initializer.extend(dense_tensor(s) for s in g.sparse_initializer)
        del g.sparse_initializer[:]
    for n in model_nodes(out):
        if n.op_type != "Constant":
            continue
        for k, a in enumerate(n.attribute):
            if a.name == "sparse_value":
                n.attribute[k].CopyFrom(onnx.helper.make_attribute("value", dense_tensor(a.sparse_tensor)))
    return out


__all__ = ["dense_sparse_tensors", "dense_tensor"]

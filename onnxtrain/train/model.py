"""The model of a training config: built or loaded, a loss appended when asked, and its inference form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import NameGen, value_types
from onnxtrain.ir.graphs import (
    chain_shared_batch_norms,
    graph_values,
    inference_mode,
    node_reads,
    untie_batch_norm_statistics,
)
from onnxtrain.ir.large import IN_MEMORY, MOVED_TENSOR_BYTES, external_tensor, skeleton, tensor_nbytes
from onnxtrain.ir.stream import Arrays
from onnxtrain.ir.types import np_dtype, value_info_shape
from onnxtrain.train.config import Config, ConfigError


def _values(model: onnx.ModelProto) -> set[str]:
    return graph_values(model.graph)


def user_inputs(model: onnx.ModelProto) -> list[str]:
    inits = {t.name for t in model.graph.initializer}
    return [v.name for v in model.graph.input if v.name not in inits]


def _append_loss(model: onnx.ModelProto, cfg: Config) -> None:
    m = cfg.model
    g = model.graph
    types = value_types(model)
    if m.labels in _values(model):
        raise ConfigError("model.labels", f"{m.labels!r} is already a value of the model; pick a new input "
                                          "name for the labels of the appended loss")
    # the loss is of the logits' type (float64 logits: a float64 loss)
    et = types[m.logits].tensor_type.elem_type if m.logits in types else TensorProto.FLOAT
    if m.add_loss == "cross_entropy":
        g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [m.logits, m.labels], [m.loss],
                                       name=m.loss))
        # the labels' shape is the logits' without the class axis (1): checked against the data at load
        logits = types.get(m.logits)
        shape = list(logits.tensor_type.shape.dim) if logits is not None and logits.HasField("tensor_type") \
            and logits.tensor_type.HasField("shape") else []
        dims = None
        if len(shape) >= 2:
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in shape]
            dims = [dims[0], *dims[2:]]
        g.input.append(helper.make_tensor_value_info(m.labels, TensorProto.INT64, dims))
    else:
        diff, sq = f"{m.loss}_diff", f"{m.loss}_sq"
        g.node.extend([helper.make_node("Sub", [m.logits, m.labels], [diff], name=diff),
                       helper.make_node("Mul", [diff, diff], [sq], name=sq),
                       helper.make_node("ReduceMean", [sq], [m.loss], keepdims=0, name=m.loss)])
        # the labels take the logits' shape (a [N] array against [N, 3] logits: refused at load, naming it)
        logits = types.get(m.logits)
        dims = None
        if logits is not None and logits.HasField("tensor_type") and logits.tensor_type.HasField("shape"):
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in logits.tensor_type.shape.dim]
        g.input.append(helper.make_tensor_value_info(m.labels, et, dims))
    g.output.insert(0, helper.make_tensor_value_info(m.loss, et or TensorProto.FLOAT, []))


def build_model(cfg: Config) -> onnx.ModelProto:
    """The trainable model: the builder's output (seeded by training.seed) or the .onnx file."""
    m = cfg.model
    if m.builder is not None:
        from onnxtrain import zoo

        args = {"seed": cfg.training.seed, **m.args}
        try:
            model = getattr(zoo, m.builder)(**args)
        except zoo.BuilderArgumentError as e:
            raise ConfigError(f"model.args.{e.arg}", f"{e.message} (the {m.builder} builder)") from None
        except (ValueError, TypeError, ZeroDivisionError) as e:
            raise ConfigError("model.args", f"the {m.builder} builder refused them: {e}") from None
    else:
        try:
            model = onnx.load(m.path)
        except Exception as e:  # noqa: BLE001 - any parse failure is a bad model file
            raise ConfigError("model.path", f"cannot read {m.path} as an ONNX model: {e}") from None
        g = model.graph
        if not (g.node or g.input or g.output):  # (an empty file parses as an empty ModelProto)
            raise ConfigError("model.path", f"{m.path} is not an ONNX model (no graph nodes, inputs or "
                                            "outputs)")
    names = _values(model)
    outputs = [o.name for o in model.graph.output]
    if m.logits not in names:
        raise ConfigError("model.logits", f"{m.logits!r} is not a value of the model; outputs: {outputs}")
    if m.add_loss != "none":
        if m.loss in names:
            raise ConfigError("model.add_loss", f"the model already has a value {m.loss!r} (model.loss); "
                                                "set add_loss: none to train it, or rename the new loss")
        _append_loss(model, cfg)
    elif m.loss not in names:
        raise ConfigError("model.loss", f"{m.loss!r} is not a value of the model (outputs {outputs}); set "
                                        "model.add_loss: cross_entropy or mse to append a loss to the logits")
    if m.labels not in user_inputs(model):
        raise ConfigError("model.labels",
                          f"{m.labels!r} is not an input of the model; inputs: {user_inputs(model)}")
    _check_scalar_loss(model, m.loss)
    _check_logits(model, m.logits, m.loss)
    _check_labels_input(model, m.labels, m.loss)
    return model


def _check_logits(model: onnx.ModelProto, logits: str, loss: str) -> None:
    """A ConfigError naming model.logits when the logits are the loss or (from shape inference) a scalar:
    accuracy and the exported inference model need a batch axis 0 and a class axis 1."""
    hint = "name the output holding the logits (batch axis 0, class axis 1)"
    if logits == loss:
        raise ConfigError("model.logits", f"{logits!r} is the loss (model.loss), not the logits; {hint}")
    tp = next((o.type for o in model.graph.output if o.name == logits), None)
    if tp is None or not tp.tensor_type.HasField("shape"):
        try:
            tp = value_types(model).get(logits)
        except Exception:  # noqa: BLE001 - inference that fails leaves the logits unchecked
            return
    dims = value_info_shape(tp) if tp is not None else None
    if dims is not None and len(dims) == 0:
        raise ConfigError("model.logits", f"{logits!r} is a scalar (shape []), not logits with a batch "
                                          f"dimension; {hint}")


LABEL_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")  # the losses that read class labels
# ops that pass a label tensor on with its values and their order unchanged (a sequence model's y.view(-1))
_LABEL_RESHAPES = {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity"}


def label_source(graph: onnx.GraphProto, value: str) -> str:
    """The value ``value`` is a reshape of (through Reshape, Flatten, Squeeze, Unsqueeze and Identity nodes):
    the graph input that feeds a loss its labels, when they are reshaped on the way; ``value`` itself
    otherwise."""
    producers = {o: n for n in graph.node for o in n.output}
    seen = set()
    while value in producers and value not in seen and producers[value].op_type in _LABEL_RESHAPES:
        seen.add(value)
        value = producers[value].input[0]
    return value


def _check_labels_input(model: onnx.ModelProto, labels: str, loss: str) -> None:
    """A ConfigError naming model.labels when the loss is a cross-entropy node that reads its labels
    from another graph input than ``labels``, as it is or reshaped (the data's inputs would go to the
    labels)."""
    node = next((n for n in model.graph.node if loss in n.output), None)
    if node is None or node.op_type not in LABEL_LOSSES or len(node.input) < 2:
        return
    read = label_source(model.graph, node.input[1])
    if read != labels and read in user_inputs(model):
        raise ConfigError("model.labels", f"{labels!r} is not the input the loss {loss!r} reads its labels "
                                          f"from: that is {read!r} (set model.labels: {read})")


_SCALAR_HINT = "name the model's scalar loss, or set model.add_loss to append one to the logits"


def _check_scalar_loss(model: onnx.ModelProto, loss: str) -> None:
    """A ConfigError naming model.loss when shape inference knows the loss is not a scalar (a shape of
    one element, such as [1], passes); an unknown shape is checked at the first step."""
    shapes = {v.name: v.type for v in model.graph.output}
    tp = shapes.get(loss)
    if tp is None or not tp.tensor_type.HasField("shape"):
        try:
            tp = value_types(model).get(loss)
        except Exception:  # noqa: BLE001 - inference that fails leaves the check to the first step
            return
    if tp is None or not tp.tensor_type.HasField("shape"):
        return
    dims = value_info_shape(tp)
    if any(d is not None and d != 1 for d in dims):  # a dim of unknown size may be 1
        raise ConfigError("model.loss", f"{loss!r} is not a scalar (shape {dims}); {_SCALAR_HINT}")


def check_loss_value(loss: np.ndarray, name: str) -> float:
    """The loss a step fetched, as a float; a ConfigError naming model.loss when it is not a scalar."""
    if np.size(loss) != 1:
        raise ConfigError("model.loss", f"{name!r} is not a scalar (shape {list(np.shape(loss))}); "
                                        f"{_SCALAR_HINT}")
    return float(np.asarray(loss).reshape(()))


def with_own_statistics(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` in which each BatchNormalization reads running statistics of its own, named as the
    training graph names them (an exporter's merged statistics untied, a layer applied twice chained): the
    names the session's state and the checkpoints hold them under."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    names = NameGen.for_model(m)
    chain_shared_batch_norms(m, names)
    untie_batch_norm_statistics(m, names)
    return m


def inference_model(model: onnx.ModelProto, outputs: Sequence[str], weights: Mapping[str, np.ndarray] = {},
                    as_inputs: Sequence[str] = ()) -> onnx.ModelProto:
    """``model`` for inference: BatchNormalization and Dropout in inference mode, only ``outputs`` kept.

    ``weights`` replace initializer values; initializers named in ``as_inputs`` become graph inputs
    (so one compiled plan can be fed fresh weights). Nodes, inputs and initializers that no output
    needs are dropped. Each BatchNormalization reads running statistics of its own
    (:func:`with_own_statistics`), so that the trained ones in ``weights`` reach it.
    """
    m = with_own_statistics(model)
    g = m.graph
    types = None
    out_vis = []
    for name in outputs:
        vi = next((o for o in model.graph.output if o.name == name), None)
        if vi is None:
            types = types or value_types(model)
            if name in types:
                vi = helper.make_value_info(name, types[name])
            else:
                vi = helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
        out_vis.append(vi)
    inference_mode(g)  # (the bodies' nodes too)
    needed = set(outputs)
    keep = []
    for n in reversed(g.node):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(node_reads(n))
    keep.reverse()
    del g.node[:]
    g.node.extend(keep)
    del g.output[:]
    g.output.extend(out_vis)
    moved = set(as_inputs)
    listed = {v.name for v in g.input}
    inits = []
    for held in m.graph.initializer:  # (the model's, and the statistics untied above)
        if held.name not in needed:
            continue
        if held.name in weights:  # (the stale values are not copied first)
            t = numpy_helper.from_array(_as_type(weights[held.name], held.data_type), held.name)
        else:
            t = onnx.TensorProto()
            t.CopyFrom(held)
        if t.name in moved:
            if t.name not in listed:
                g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            inits.append(t)
    del g.initializer[:]
    g.initializer.extend(inits)
    kept_inputs = [v for v in g.input if v.name in needed and v.name not in {t.name for t in inits}]
    del g.input[:]
    g.input.extend(kept_inputs)
    return m


def inference_parts(model: onnx.ModelProto, outputs: Sequence[str], weights: Mapping[str, np.ndarray]
                    ) -> tuple[onnx.ModelProto, Arrays]:
    """:func:`inference_model` of ``model`` with ``weights``, as a model without the large weights (those
    of :data:`MOVED_TENSOR_BYTES` or more) and those weights (name, array in the initializer's type), in
    the order of its initializers: built without copying their values (nor ``model``'s stale ones)."""
    big = {t.name for t in model.graph.initializer
           if t.name in weights and tensor_nbytes(t) >= MOVED_TENSOR_BYTES}
    hollow = skeleton(model, lambda t: external_tensor(t, IN_MEMORY, 0, 0) if t.name in big else None)
    m = inference_model(hollow, outputs, weights={n: w for n, w in weights.items() if n not in big})
    inits = m.graph.initializer
    if any(t.data_location == TensorProto.EXTERNAL and t.name not in big for t in inits):
        return inference_model(model, outputs, weights), []  # a large weight copied under a new name
    arrays = [(t.name, _as_type(weights[t.name], t.data_type)) for t in inits if t.name in big]
    kept = [t for t in inits if t.name not in big]
    del inits[:]
    inits.extend(kept)
    return m, arrays


def _as_type(value: np.ndarray, data_type: int) -> np.ndarray:
    """``value`` in the numpy type of ONNX element type ``data_type`` (itself when it is)."""
    return np.asarray(value).astype(np_dtype(data_type), copy=False)

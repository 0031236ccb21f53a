"""An ONNX backend (``onnx.backend.base.Backend``) over the numpy engine, for ONNX's conformance suite."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from onnxtrain.engine.plan import Plan


class OnnxtrainRep(BackendRep):
    """A compiled model (an InferenceSession: feeds checked as onnxruntime's backend checks them); ``run``
    takes inputs in graph-input order (or a dict) and returns a list, as onnxruntime's backend does."""

    def __init__(self, model: onnx.ModelProto):
        from onnxtrain.inference import InferenceSession

        self.session = InferenceSession(model)
        self.plan = self.session._plan

    def run(self, inputs: Any, **kwargs: Any) -> list[np.ndarray]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        else:
            if isinstance(inputs, (np.ndarray, np.generic)):
                inputs = [inputs]
            feeds = dict(zip([i.name for i in self.session.get_inputs()], inputs))
        # a numpy scalar (onnx's node cases feed zero points as np.uint8) becomes a 0-d array, as
        # onnxruntime's backend makes it: its session.run, like ours, takes arrays only
        return self.session.run(None, {n: np.asarray(v) if isinstance(v, np.generic) else v
                                       for n, v in feeds.items()})


class OnnxtrainBackend(Backend):
    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> OnnxtrainRep:
        return OnnxtrainRep(model)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper() == "CPU"

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        """Whether the device is the CPU and the model's opsets are ones onnx knows."""
        newest = onnx.defs.onnx_opset_version()
        return cls.supports_device(device) and all(
            o.version <= newest for o in model.opset_import if o.domain in ("", "ai.onnx"))

    @classmethod
    def run_model(cls, model: onnx.ModelProto, inputs: Any, device: str = "CPU",
                  **kwargs: Any) -> list[np.ndarray]:
        return cls.prepare(model, device).run(inputs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info: Any = None, **kwargs: Any) -> tuple[np.ndarray, ...]:
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        values = list(inputs)
        # one value per input name, the empty names' included, or (onnx's node tests) per non-empty name
        named = list(node.input) if len(values) == len(node.input) else [n for n in node.input if n]
        if len(values) != len(named):
            raise ValueError(f"run_node: {len(values)} inputs for node {node.name!r} ({node.op_type}) with "
                             f"inputs {list(node.input)}")
        feeds = {n: _node_feed(v) for n, v in zip(named, values) if n}
        g_in = [onnx.helper.make_value_info(n, _type_of(v)) for n, v in feeds.items()]
        g_out = [onnx.helper.make_empty_tensor_value_info(n) for n in node.output if n]
        graph = onnx.helper.make_graph([node], "run_node", g_in, g_out)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return tuple(Plan(model).run(feeds))


def _node_feed(value: Any) -> Any:
    """A run_node input as the engine takes it: a list of arrays for a sequence, None for an empty optional,
    else an array."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [np.asarray(v) for v in value]
    return np.asarray(value)


def _type_of(value: Any) -> onnx.TypeProto:
    """The declared type of a run_node feed: a tensor's, a sequence of its first element's (float when
    empty), an optional tensor of float for None."""
    helper = onnx.helper
    if value is None:
        return helper.make_optional_type_proto(helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, None))
    if isinstance(value, list):
        elem = value[0].dtype if value else np.dtype(np.float32)
        return helper.make_sequence_type_proto(
            helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(elem), None))
    return helper.make_tensor_type_proto(helper.np_dtype_to_tensor_dtype(value.dtype), value.shape)


prepare = OnnxtrainBackend.prepare
run_model = OnnxtrainBackend.run_model
run_node = OnnxtrainBackend.run_node
supports_device = OnnxtrainBackend.supports_device
is_compatible = OnnxtrainBackend.is_compatible

"""An ONNX backend (``onnx.backend.base.Backend``) over the numpy engine, for ONNX's conformance suite."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from onnxtrain.engine.plan import Plan

# the SessionOptions / RunOptions attributes onnxruntime's backend takes as keywords (the other attributes of
# those classes are refused; names neither class has are let through)
SESSION_KEYWORDS = frozenset({
    "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "execution_mode", "execution_order",
    "graph_optimization_level", "inter_op_num_threads", "intra_op_num_threads", "log_severity_level",
    "log_verbosity_level", "logid", "use_deterministic_compute", "use_per_session_threads"})
RUN_KEYWORDS = frozenset({
    "log_severity_level", "log_verbosity_level", "logid", "only_execute_path_to_fetches"})


def _options(options: Any, kwargs: dict[str, Any], allowed: frozenset[str]) -> Any:
    """``options`` with the allowed keywords set; a RuntimeError for another attribute of its class."""
    for key, value in kwargs.items():
        if key in allowed:
            setattr(options, key, value)
        elif hasattr(options, key):
            raise RuntimeError(f"{type(options).__name__} attribute '{key}' is not permitted via the backend "
                               f"API. Allowed attributes: {', '.join(sorted(allowed))}")
    return options


class OnnxtrainRep(BackendRep):
    """A compiled model (an InferenceSession: feeds checked as onnxruntime's backend checks them); ``run``
    takes inputs in graph-input order (or a dict), or one value for a model of one input, and returns a
    list, as onnxruntime's backend does."""

    def __init__(self, model: Any, sess_options: Any = None):
        from onnxtrain.inference import InferenceSession

        self.session = model if isinstance(model, InferenceSession) else InferenceSession(model, sess_options)
        self.plan = getattr(self.session, "_plan", None)

    def run(self, inputs: Any, **kwargs: Any) -> list[Any]:
        """The model's outputs; ``kwargs``: RunOptions attributes among ``RUN_KEYWORDS``."""
        from onnxtrain.capi.options import RunOptions

        run_options = _options(RunOptions(), kwargs, RUN_KEYWORDS)
        declared = self.session.get_inputs()
        if isinstance(inputs, dict) and not (len(declared) == 1 and declared[0].type.startswith("map(")):
            feeds = dict(inputs)  # feeds by name (a dict for a model whose one input is a map is that map)
        elif isinstance(inputs, (list, tuple)):
            feeds = dict(zip([i.name for i in declared], inputs))
        else:
            if len(declared) != 1:
                raise RuntimeError(f"the model expects {len(declared)} inputs "
                                   f"({', '.join(i.name for i in declared)}): give a list, not one value")
            feeds = {declared[0].name: inputs}
        # a numpy scalar (onnx's node cases feed zero points as np.uint8) becomes a 0-d array, as
        # onnxruntime's backend makes it: its session.run, like ours, takes arrays only
        return self.session.run(None, {n: np.asarray(v) if isinstance(v, np.generic) else v
                                       for n, v in feeds.items()}, run_options)


class OnnxtrainBackend(Backend):
    """onnx's backend API over onnxtrain's InferenceSession, answering as onnxruntime's
    (``onnxruntime.backend``) does on a CPU build."""

    @classmethod
    def prepare(cls, model: Any, device: str | None = None, **kwargs: Any) -> OnnxtrainRep:
        """A rep of ``model`` (a path, serialized bytes, a ModelProto, an InferenceSession or a rep, returned
        as is); ``kwargs``: SessionOptions attributes among ``SESSION_KEYWORDS``."""
        from onnxtrain.capi.options import SessionOptions, get_device
        from onnxtrain.inference import InferenceSession

        if isinstance(model, OnnxtrainRep):
            return model
        if device is not None and not cls.supports_device(device):
            raise RuntimeError(f"Incompatible device expected '{device}', got '{get_device()}'")
        if isinstance(model, InferenceSession):
            return OnnxtrainRep(model)
        return OnnxtrainRep(model, _options(SessionOptions(), kwargs, SESSION_KEYWORDS))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        """Whether this build runs on ``device`` ("CPU"; "GPU" and "CUDA" not), as onnxruntime answers it."""
        from onnxtrain.capi.options import get_device

        built = get_device()
        device = "GPU" if device == "CUDA" else device
        return f"-{device}" in built or f"{device}-" in built or device == built

    @classmethod
    def is_compatible(cls, model: onnx.ModelProto, device: str | None = None, **kwargs: Any) -> bool:
        """Whether the device (None: this build's) is supported and the model's opsets are ones onnx knows."""
        from onnxtrain.capi.options import get_device

        newest = onnx.defs.onnx_opset_version()
        return cls.supports_device(get_device() if device is None else device) and all(
            o.version <= newest for o in model.opset_import if o.domain in ("", "ai.onnx"))

    @classmethod
    def run_model(cls, model: Any, inputs: Any, device: str | None = None, **kwargs: Any) -> list[Any]:
        """``prepare(model, device, **kwargs).run(inputs, **kwargs)``."""
        return cls.prepare(model, device, **kwargs).run(inputs, **kwargs)

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str | None = None,
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
run = OnnxtrainBackend.run_model
run_node = OnnxtrainBackend.run_node
supports_device = OnnxtrainBackend.supports_device
is_compatible = OnnxtrainBackend.is_compatible

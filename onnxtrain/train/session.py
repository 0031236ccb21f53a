"""The legacy session a config asks for: its options, its backend, the feeds keyed by the model's inputs."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnxtrain.capi.options import SessionOptions
from onnxtrain.engine.backends import CONFIG_KEY
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession
from onnxtrain.train import data as data_mod
from onnxtrain.train.config import Config, ConfigError, FilesData
from onnxtrain.train.model import user_inputs

OPTIMIZERS = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}


def training_parameters(cfg: Config, model: onnx.ModelProto) -> TrainingParameters:
    """The legacy session's options for ``cfg``."""
    from onnxtrain.optim import get_optimizer
    from onnxtrain.training_graph import select_trainable

    t, o = cfg.training, cfg.optimizer
    p = TrainingParameters()
    p.loss_output_name = cfg.model.loss
    p.training_optimizer_name = OPTIMIZERS[o.name]
    p.gradient_accumulation_steps = t.gradient_accumulation_steps
    p.gradient_accumulation_mode = "auto"
    p.use_mixed_precision = t.mixed_precision
    p.data_parallel_size = t.data_parallel_size
    p.enable_grad_norm_clip = o.clip_grad_norm is not None
    for k, v in t.parameters.items():
        setattr(p, k, v)
    attrs: dict[str, float] = {}
    for key, value in (("alpha", o.betas[0] if o.betas else None), ("beta", o.betas[1] if o.betas else None),
                       ("epsilon", o.eps), ("lambda", o.weight_decay), ("max_norm_clip", o.clip_grad_norm)):
        if value is not None:
            attrs[key] = float(value)
    if attrs:  # added to the other attributes training.parameters.optimizer_attributes_map may give
        known = get_optimizer(p.training_optimizer_name).FLOAT_ATTRS
        attrs = {k: v for k, v in attrs.items() if k in known}
        given = p.optimizer_attributes_map
        p.optimizer_attributes_map = {**given, **{w: {**given.get(w, {}), **attrs}
                                                  for w in select_trainable(model, p)}}
    return p


def backend_options(backend: str) -> SessionOptions:
    """Session options selecting ``backend`` (training.backend: numpy | onnxruntime)."""
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    return so


def make_session(cfg: Config, model: onnx.ModelProto, p: TrainingParameters) -> TrainingSession:
    """The legacy session; a refused option becomes a ConfigError naming the config key that set it."""
    try:
        return TrainingSession(model, p, backend_options(cfg.training.backend))
    except ImportError as e:  # training.backend: onnxruntime without the package
        raise ConfigError("training.backend", str(e)) from None
    except (ValueError, NotImplementedError) as e:
        keys = {"use_mixed_precision": "training.mixed_precision",
                "data_parallel_size": "training.data_parallel_size",
                "gradient_accumulation_steps": "training.gradient_accumulation_steps",
                **{k: f"training.parameters.{k}" for k in cfg.training.parameters}}
        hit = next((key for prop, key in keys.items() if prop in str(e)), None)
        if hit is None:
            raise
        prefix = "not implemented yet: " if isinstance(e, NotImplementedError) else ""
        raise ConfigError(hit, prefix + str(e)) from None


def feed_names(cfg: Config, model: onnx.ModelProto, ds: data_mod.Dataset) -> data_mod.Dataset:
    """``ds`` keyed by the model's input names and cast to their element types."""
    inputs = user_inputs(model)
    label = cfg.model.labels
    if isinstance(cfg.data, FilesData):
        for k in cfg.data.feeds:
            if k not in inputs:
                raise ConfigError(f"data.feeds.{k}", f"{k!r} is not an input of the model; inputs: {inputs}")
        rename = {k: k for k in cfg.data.feeds}
    else:
        others = [i for i in inputs if i != label]
        if len(others) != 1:
            raise ConfigError("data.source", f"{cfg.data.source} data feeds one input and the labels, but "
                                             f"the model has inputs {inputs}; use source: files with feeds")
        rename = {"x": others[0], "y": label}
    missing = [i for i in inputs if i not in rename.values()]
    if missing:
        raise ConfigError("data.feeds", f"no array for model input(s) {missing}")
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}

    def convert(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for k, v in arrays.items():
            name = rename[k]
            dt = helper.tensor_dtype_to_np_dtype(types[name]) if types.get(name) else v.dtype
            out[name] = np.ascontiguousarray(v, dtype=dt)
        return out

    return data_mod.Dataset(convert(ds.train), convert(ds.eval))

"""The legacy session a config asks for: its options, its backend, the feeds keyed by the model's inputs."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.capi.options import SessionOptions
from onnxtrain.engine.backends import CONFIG_KEY
from onnxtrain.ir.builder import static_shape, value_types
from onnxtrain.ir.types import value_info_shape
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession
from onnxtrain.train import data as data_mod
from onnxtrain.train.config import (
    Config,
    ConfigError,
    DigitsData,
    FilesData,
    SequenceData,
    builder_signature,
)
from onnxtrain.train.model import LABEL_LOSSES, label_source, user_inputs

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
    if t.data_parallel_size != 1:  # the default leaves it to the world size under mpiexec, without a warning
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
        with warnings.catch_warnings():  # (the session selects them again, and warns then: once a run)
            warnings.simplefilter("ignore")
            trained = select_trainable(model, p)
        p.optimizer_attributes_map = {**given, **{w: {**given.get(w, {}), **attrs} for w in trained}}
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
    except OSError as e:  # a graph dump (model_with_training_graph_path, ...) the session cannot write
        hit = next((k for k in cfg.training.parameters if k in str(e)), None)
        if hit is None:
            raise
        where = f"TrainingParameters.{hit}: "
        why = e.strerror.removeprefix(where) if isinstance(e.strerror, str) else str(e)
        raise ConfigError(f"training.parameters.{hit}", f"cannot write {e.filename or 'the graph'}: {why}"
                          ) from None
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
    declared = {v.name: value_info_shape(v.type) for v in model.graph.input
                if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape")}

    inferred: dict[str, Any] = {}  # the model's value types, inferred once for both splits when needed

    def convert(arrays: dict[str, np.ndarray], split: str) -> dict[str, np.ndarray]:
        out = {}
        for k, v in arrays.items():
            name = rename[k]
            _check_shape(cfg, k, name, v, declared.get(name), split)
            dt = helper.tensor_dtype_to_np_dtype(types[name]) if types.get(name) else v.dtype
            if np.dtype(dt).kind in "biuf" and v.dtype.kind not in "biuf":  # strings, complex, dates
                data_key, where = _data_where(cfg, k, split)
                try:  # strings that spell numbers are read as numbers (not as truth values: "False")
                    if v.dtype.kind not in "US" or np.dtype(dt).kind == "b":
                        raise ValueError
                    v = _text_numbers(v, np.dtype(dt))
                except (ValueError, OverflowError):
                    kind = np.dtype(dt).name
                    raise ConfigError(data_key, f"{where}: the model input {name!r} takes {kind} numbers, "
                                                f"got {v.dtype} values") from None
            if np.issubdtype(dt, np.integer) and not np.issubdtype(v.dtype, np.integer):
                _check_whole(cfg, k, name, v, dt, split)
            if np.issubdtype(dt, np.integer) and v.size:
                _check_range(cfg, k, name, v, np.dtype(dt), split)
            out[name] = np.ascontiguousarray(v, dtype=dt)
        _check_indices(cfg, model, out, {rename[k]: k for k in arrays}, split)
        _check_classes(cfg, model, out, {rename[k]: k for k in arrays}, split, inferred)
        return out

    return data_mod.Dataset(convert(ds.train, "train"), convert(ds.eval, "eval"))


def _data_where(cfg: Config, key: str, split: str) -> tuple[str, str]:
    """(config key, words) saying where the data array ``key`` (a built-in source's x or y, or a feed name)
    comes from."""
    d = cfg.data
    if isinstance(d, FilesData):
        name = d.feeds[key]
        if name.lower().endswith(".npy"):
            return f"data.feeds.{key}", name
        npz = d.eval_path if split == "eval" and d.eval_path is not None else d.path
        return f"data.feeds.{key}", f"array {name!r} in {npz}"
    what = "labels" if key == "y" else "inputs"
    if isinstance(d, DigitsData):
        return "", f"data 'digits' (data.images: {str(d.images).lower()}) gives {what} {key}"
    if isinstance(d, SequenceData):
        return "", f"data 'sequence' (data.length: {d.length}) gives {what} {key}"
    return "data", f"the data's {key}"


def _model_where(cfg: Config, name: str) -> str:
    """Which config key decides the declared shape of the model input ``name``."""
    m = cfg.model
    if m.builder is None:
        return f"model.path {m.path}"
    if name == m.labels:
        return "model.labels"
    if name != "x":  # the builders' inputs: x, and the labels y
        return f"the {m.builder} builder's labels input"
    sig = builder_signature(m.builder)
    value = lambda k: m.args.get(k, sig[k][1] if k in sig else None)  # noqa: E731 - a local one-liner
    if m.builder == "mlp":
        sizes = value("sizes")
        return f"model.args.sizes[0] = {sizes[0]}" if sizes else "model.args.sizes"
    if m.builder == "transformer":
        return f"model.args.length = {value('length')}"
    return f"model.args.image = {list(value('image'))}"


def _check_shape(cfg: Config, key: str, name: str, array: np.ndarray, want: list | None, split: str) -> None:
    """A ConfigError naming the data and model keys when ``array`` cannot feed the model input ``name``
    (rank, or a fixed size past the batch axis, differs from the declared shape)."""
    if want is None:
        return
    got = list(array.shape)
    fits = len(got) == len(want) and all(w is None or isinstance(w, str) or w == g
                                         for w, g in zip(want[1:], got[1:]))
    if fits:
        return
    data_key, where = _data_where(cfg, key, split)
    shown = ["N", *got[1:]] if got else got
    note = ""
    if not isinstance(cfg.data, FilesData) and cfg.model.labels != "y":
        note = (f"; model.labels = {cfg.model.labels!r} sends the labels to that input and the data's inputs "
                "to the model's other input")
    raise ConfigError(data_key, f"{where} of shape {shown}, but the model input {name!r} takes shape "
                                f"{want} ({_model_where(cfg, name)}){note}")


def _text_numbers(v: np.ndarray, dt: np.dtype) -> np.ndarray:
    """Text spelling numbers, read exactly: integers as int64 for an integer input (a float64 would round
    9007199254740993), else float64 (``3.0`` for an integer input goes through the whole-number check)."""
    if dt.kind in "iu":
        wide = np.uint64 if dt.kind == "u" else np.int64
        try:
            return v.astype(wide)
        except OverflowError:  # beyond 64 bits: read as floats, refused by the range check
            pass
        except ValueError:  # "3.0", "1e3": read as exact integers where whole, else as floats
            exact = [_whole_text(x) for x in v.ravel().tolist()]
            if all(e is not None for e in exact):
                try:
                    return np.array(exact, wide).reshape(v.shape)
                except OverflowError:
                    pass
    return v.astype(np.float64)


def _whole_text(text: str | bytes) -> int | None:
    """The integer a text spells when it is a whole number ("3.0", "1e3", "9007199254740993.0"), read with
    Python's exact decimals; None otherwise."""
    import decimal

    try:
        d = decimal.Decimal(text.decode() if isinstance(text, bytes) else text)
    except decimal.InvalidOperation:
        return None
    return int(d) if d.is_finite() and d == d.to_integral_value() else None


def _check_range(cfg: Config, key: str, name: str, array: np.ndarray, dt: np.dtype, split: str) -> None:
    """Numbers for an integer model input must fit its type: a cast would wrap them (300 to uint8 is 44)."""
    info = np.iinfo(dt)
    number = float if array.dtype.kind == "f" else int  # (Python compares either exactly with the bounds)
    lo, hi = number(array.min()), number(array.max())
    if info.min <= lo and hi <= info.max:
        return
    data_key, where = _data_where(cfg, key, split)
    bad = lo if lo < info.min else hi
    raise ConfigError(data_key, f"{where}: the model input {name!r} takes {dt.name} numbers "
                                f"({info.min}..{info.max}), but the array holds {bad}")


def _check_whole(cfg: Config, key: str, name: str, array: np.ndarray, dt: np.dtype, split: str) -> None:
    """Float data for an integer model input (class labels, token ids): whole numbers only, never
    silently truncated."""
    flat = np.asarray(array).reshape(-1)
    if not np.issubdtype(flat.dtype, np.floating) and flat.dtype != np.bool_:
        data_key, where = _data_where(cfg, key, split)
        raise ConfigError(data_key, f"{where}: the model input {name!r} takes {np.dtype(dt).name}, got "
                                    f"{flat.dtype} values")
    bad = ~np.isfinite(flat)
    if flat.dtype != np.bool_:
        bad |= np.isfinite(flat) & (flat != np.round(flat))
    if bad.any():
        data_key, where = _data_where(cfg, key, split)
        what = "class labels" if name == cfg.model.labels else "values"
        raise ConfigError(data_key, f"{where}: the model input {name!r} takes integer {what} "
                                    f"({np.dtype(dt).name}), but the {flat.dtype} array holds "
                                    f"{int(bad.sum())} value(s) that are not whole numbers, e.g. "
                                    f"{float(flat[bad][0]):.6g} (store the labels as integers)")


def _check_indices(cfg: Config, model: onnx.ModelProto, arrays: dict[str, np.ndarray],
                   keys: dict[str, str], split: str) -> None:
    """Integer data that a Gather uses as indices into an initializer (token ids into an embedding
    table) must lie within that table: a ConfigError naming the data and model keys otherwise."""
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in arrays:
            continue
        table, x = node.input[0], arrays[node.input[1]]
        if table not in inits or not x.size or not np.issubdtype(x.dtype, np.integer):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        rows = inits[table][axis]
        hi, lo = int(x.max()), int(x.min())
        if hi < rows and lo >= -rows:
            continue
        key = keys[node.input[1]]
        data_key, where = _data_where(cfg, key, split)
        if isinstance(cfg.data, SequenceData):
            data_key, where = "", f"data 'sequence' (data.vocab: {cfg.data.vocab}) gives {key}"
        m = cfg.model
        model_key = (f"model.args.vocab = {m.args.get('vocab', builder_signature('transformer')['vocab'][1])}"
                     if m.builder == "transformer" else _model_where(cfg, node.input[1]))
        raise ConfigError(data_key, f"{where} with values up to {hi if hi >= rows else lo}, but the model "
                                    f"input {node.input[1]!r} indexes {table!r}, which has {rows} rows "
                                    f"({model_key})")


def _check_classes(cfg: Config, model: onnx.ModelProto, arrays: dict[str, np.ndarray],
                   keys: dict[str, str], split: str, inferred: dict[str, Any]) -> None:
    """Class labels fed to a SoftmaxCrossEntropyLoss or NegativeLogLikelihoodLoss (as they are or reshaped)
    must lie in [0, classes) (or be its ignore_index): a ConfigError naming the data key otherwise, not a
    failed step.
    ``inferred`` keeps the model's value types (key ``"types"``) between calls."""
    for node in model.graph.node:
        if node.op_type not in LABEL_LOSSES or len(node.input) < 2:
            continue
        fed = label_source(model.graph, node.input[1])
        if fed not in arrays:
            continue
        y = arrays[fed]
        if not y.size or not np.issubdtype(y.dtype, np.integer):
            continue
        if "types" not in inferred:
            inferred["types"] = value_types(model)
        dims = static_shape(inferred["types"], node.input[0])
        classes = dims[1] if dims is not None and len(dims) > 1 else None
        if classes is None:
            continue
        ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
        bad = (y < 0) | (y >= classes)
        if ignore is not None:
            bad &= y != ignore
        if not bad.any():
            continue
        data_key, where = _data_where(cfg, keys[fed], split)
        raise ConfigError(data_key, f"{where}: class label {int(y[bad].flat[0])}, but the loss "
                                    f"{node.name or node.op_type!r} scores {classes} classes "
                                    f"({node.input[0]!r} has shape {dims}): labels must lie in "
                                    f"[0, {classes})")

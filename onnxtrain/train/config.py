"""Training configurations: YAML files checked against typed dataclasses, with errors naming the key path.

A configuration has six sections (``model``, ``data``, ``optimizer``, ``schedule``, ``training``,
``output``); see ``configs/digits_mlp.yaml`` for a commented example. ``load_config(path, overrides)``
reads the file, applies ``--set key.path=value`` overrides, checks every key and type, resolves
relative file paths against the config's folder and checks that those files exist.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import itertools
import json
import math
import os
import re
import reprlib
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import yaml

FLOAT32_MAX = (2 - 2 ** -23) * 2 ** 127  # float32's largest value, the largest rate the loop can feed


class ConfigError(ValueError):
    """A bad configuration value; ``str()`` is one line: ``key.path: what was expected``."""

    def __init__(self, path: str, message: str):
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


MAX_DEPTH = 100  # lists and mappings nested deeper than this are refused (a config needs a handful)
MAX_ALIAS_VALUES = 100_000  # values that aliases may repeat in one document (a "billion laughs" stops here)


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads ``1e-3`` as a float (YAML 1.1 wants ``1.0e-3``) and refuses a key given
    twice in one mapping (YAML would keep the last silently); values nested too deeply, aliases that repeat
    too many values in all and aliases to a value that holds them, as ConfigErrors naming the key."""

    def __init__(self, stream: str, key: str = ""):
        super().__init__(stream)
        self.key = key  # the key path the document's values sit at ("" for a whole config)
        self.steps: list[Any] = []  # compose_node's index of each node being composed, outermost first
        self.sizes: dict[int, int] = {}  # id(node) → values in it with its aliases expanded
        self.repeated = 0  # values that aliases repeated so far

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        where = f"line {event.start_mark.line + 1}"
        if len(self.steps) >= MAX_DEPTH:
            raise ConfigError(self._path(index), f"lists and mappings nested more than {MAX_DEPTH} levels "
                                                 f"deep ({where})")
        self.steps.append(index)
        node = super().compose_node(parent, index)
        self.steps.pop()
        if not isinstance(event, yaml.AliasEvent):
            self.sizes[id(node)] = 1 + sum(self.sizes[id(c)] for c in _children(node))
            return node
        size = self.sizes.get(id(node))
        if size is None:  # its anchor's node is still being composed: the alias is inside it
            raise ConfigError(self._path(index), f"alias *{event.anchor} ({where}) is inside the value it "
                                                 "names: a recursive structure")
        self.repeated += size
        if self.repeated > MAX_ALIAS_VALUES:
            raise ConfigError(self._path(index), f"aliases repeat more than {MAX_ALIAS_VALUES} values in all "
                                                 f"(at *{event.anchor}, {where}); write the values out")
        return node

    def _path(self, index: Any) -> str:
        """The key path of the node at ``index`` below the current one: its mapping keys down to the first
        list (an index deep in nested lists says little)."""
        path = self.key
        for step in [*self.steps, index]:
            if isinstance(step, int):
                break
            if isinstance(step, yaml.ScalarNode):
                path = f"{path}.{step.value}" if path else str(step.value)
        return path

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<": SafeLoader merges it below (keys given
                continue  # here override merged ones)
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."))


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def parse_yaml(text: str, key: str = "") -> Any:
    """The YAML document ``text``, read safely; ``key`` is the key path it is the value of (for errors)."""
    loader = _Loader(text, key)
    try:
        return loader.get_single_data()
    except RecursionError:  # a fallback: MAX_DEPTH stops nesting first unless the stack is already deep
        raise ConfigError(key, "lists and mappings nested too deeply to read") from None
    finally:
        loader.dispose()


# ---- the schema -------------------------------------------------------------------------------

@dataclass
class ModelConfig:
    """The model to train: a built-in builder (``mlp``, ``cnn``, ``transformer``, ``spatial_transformer``)
    or an .onnx file."""

    builder: Literal["mlp", "cnn", "transformer", "spatial_transformer"] | None = None
    path: str | None = None  # an .onnx file, relative to the config file
    args: dict[str, Any] = field(default_factory=dict)  # keyword arguments of the builder
    logits: str = "logits"  # the output holding the logits (class axis 1): accuracy and export
    loss: str = "loss"  # the output holding the scalar loss to minimise
    labels: str = "y"  # the input the labels are fed to
    add_loss: Literal["none", "cross_entropy", "mse"] = "none"  # append this loss when the model has none


EVAL_FRACTION = 0.1  # data.eval_fraction's default
BUILDERS: tuple[str, ...] = ("mlp", "cnn", "transformer", "spatial_transformer")  # onnxtrain.zoo


@dataclass
class DigitsData:
    """The bundled 8×8 digits: its fixed train split for training and test split for eval."""

    source: Literal["digits"] = "digits"
    images: bool = False  # [N, 1, 8, 8] instead of [N, 64]


@dataclass
class FilesData:
    """User arrays in an .npz (named arrays) or .npy files."""

    source: Literal["files"] = "files"
    path: str | None = None  # the .npz with the training arrays (not needed when every feed is a .npy)
    feeds: dict[str, str] = field(default_factory=dict)  # model input → array name in ``path``, or a .npy
    eval_path: str | None = None  # an .npz with the same array names for eval; else a held-out split
    eval_fraction: float = EVAL_FRACTION  # share of the training arrays held out for eval without eval_path


@dataclass
class SequenceData:
    """A token task generated from the seed: input ``x`` [N, length], per-token labels ``y``."""

    source: Literal["sequence"] = "sequence"
    task: Literal["reverse", "sort", "copy"] = "reverse"
    vocab: int = 10
    length: int = 8
    train_size: int = 20000
    eval_size: int = 1000


DataConfig = DigitsData | FilesData | SequenceData
DATA_SOURCES: dict[str, type] = {"digits": DigitsData, "files": FilesData, "sequence": SequenceData}


@dataclass
class OptimizerConfig:
    """Optimizer and hyper-parameters; unset ones keep the legacy optimizer's defaults."""

    name: Literal["sgd", "adam", "lamb"] = "adam"
    lr: float = 1e-3
    betas: list[float] | None = None  # (β1, β2) of Adam/Lamb
    eps: float | None = None
    weight_decay: float | None = None
    clip_grad_norm: float | None = None  # clip the global gradient norm to this (Adam/Lamb); null = off


@dataclass
class ScheduleConfig:
    """Learning rate against the optimizer step: linear warm-up, then constant, linear or cosine decay."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    final_lr_ratio: float = 0.0  # decayed schedules end at lr × this


@dataclass
class TrainingConfig:
    """How long and how to train; `backend` picks the session's engine, and the last four keys are passed
    through to TrainingParameters."""

    batch_size: int = 32
    epochs: int | None = None  # give epochs or steps
    steps: int | None = None  # optimizer steps; overrides epochs
    eval_every: int | None = None  # steps between evals; null = once per epoch
    eval_batch_size: int = 1024
    checkpoint_every: int | None = None  # steps between checkpoints; null = once per epoch (and the end)
    keep_checkpoints: int = 3  # keep this many most recent checkpoints (0 = all)
    log_every: int = 10  # steps between metrics.jsonl entries
    seed: int = 0  # model initialisation and data order
    backend: Literal["numpy", "onnxruntime"] = "numpy"  # what runs the graphs (onnxruntime: optional)
    gradient_accumulation_steps: int = 1
    mixed_precision: bool | None = None  # null (unset): false, or training.parameters.use_mixed_precision
    data_parallel_size: int = 1
    parameters: dict[str, Any] = field(default_factory=dict)  # any other TrainingParameters property


@dataclass
class OutputConfig:
    dir: str | None = None  # default: runs/<config name>
    plot: bool = True
    export: bool = True


@dataclass
class Config:
    """A whole training run."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DigitsData)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    name: str = field(default="run", metadata={"internal": True})  # the config file's stem
    base_dir: str = field(default=".", metadata={"internal": True})  # the config file's folder
    source: str | None = field(default=None, metadata={"internal": True})  # the config file's path

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        del d["name"], d["base_dir"], d["source"]
        if d["data"].get("eval_path") is not None:  # not used with an eval file
            d["data"].pop("eval_fraction", None)
        return d


# ---- checking values against the types above ------------------------------------------------

_TYPE_WORDS = {int: "an int", float: "a number", bool: "true or false", str: "a string"}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        text = " or ".join(_describe(a) for a in args)
        return text + " or null" if len(args) < len(typing.get_args(tp)) else text
    if origin in (list, Sequence, tuple):
        if not typing.get_args(tp):
            return "a list"
        item = _describe(typing.get_args(tp)[0])
        if item.startswith(("a ", "an ")):  # "an int" → "a list of ints"
            return f"a list of {item.split(' ', 1)[1]}s"
        return f"a list, each {item}"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return _TYPE_WORDS.get(tp, getattr(tp, "__name__", str(tp)))


class _ShortRepr(reprlib.Repr):
    """reprlib's bounded repr, mappings in their own order (reprlib sorts them)."""

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        items = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                 for k, v in itertools.islice(x.items(), self.maxdict)]
        return "{" + ", ".join(items) + (", ...}" if len(x) > self.maxdict else "}")


_REPR = _ShortRepr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxset, _REPR.maxdict = 4, 10, 10, 10, 6
_REPR.maxstring = _REPR.maxother = _REPR.maxlong = 60


def _show(value: Any) -> str:
    """``value`` for a message, at most 60 characters; a container's repr is bounded as it is built (its
    aliases may repeat a list a billion times)."""
    text = _REPR.repr(value) if isinstance(value, (list, tuple, dict, set)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` checked against the type ``tp``; raises ConfigError naming ``path``."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return coerce(value, a, path)
            except ConfigError:
                continue
        raise ConfigError(path, f"expected {_describe(tp)}, got {_show(value)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices or isinstance(value, bool) != isinstance(choices[0], bool):
            raise ConfigError(path, f"expected {_describe(tp)}, got {_show(value)}")
        return value
    if origin in (list, Sequence, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected {_describe(tp)}, got {_show(value)}")
        (item,) = typing.get_args(tp)[:1] or (Any,)
        return [coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {_show(value)}")
        _, item = typing.get_args(tp)
        return {str(k): coerce(v, item, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)
    if ok is None:
        raise TypeError(f"config schema: unsupported type {tp!r} at {path}")
    if not ok:
        raise ConfigError(path, f"expected {_describe(tp)}, got {_show(value)}")
    return float(value) if tp is float else value


def _unknown(path: str, key: str, known: Sequence[str]) -> ConfigError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return ConfigError(f"{path}.{key}" if path else key,
                       f"unknown key{hint}; expected one of {', '.join(known)}")


def from_dict(cls: type, raw: Any, path: str) -> Any:
    """An instance of dataclass ``cls`` from the mapping ``raw``; every key and value is checked."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {_show(raw)}")
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    kwargs = {}
    for key, value in raw.items():
        key = str(key)
        if key not in fields:
            raise _unknown(path, key, fields)
        sub = f"{path}.{key}" if path else key
        if cls is Config and key == "data":
            kwargs[key] = _data_from_dict(value, sub)
        else:
            kwargs[key] = coerce(value, hints[key], sub)
    return cls(**kwargs)


def _data_from_dict(raw: Any, path: str) -> DataConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, f"expected a mapping, got {_show(raw)}")
    source = raw.get("source", "digits")
    if not isinstance(source, str) or source not in DATA_SOURCES:  # (a list is not hashable)
        raise ConfigError(f"{path}.source", f"expected one of {', '.join(map(repr, DATA_SOURCES))}, "
                                            f"got {_show(source)}")
    # both would choose the eval set (the default's value is the one a saved config holds: not refused)
    if raw.get("eval_path") is not None and raw.get("eval_fraction", EVAL_FRACTION) != EVAL_FRACTION:
        raise ConfigError(f"{path}.eval_fraction", "has no effect with data.eval_path (the eval set is that "
                                                   "file); leave one of them out")
    return from_dict(DATA_SOURCES[source], raw, path)


# ---- overrides and the checks that need more than one key -----------------------------------

def apply_override(raw: dict[str, Any], assignment: str) -> None:
    """Apply one ``key.path=value`` (value in YAML syntax) to the raw config mapping."""
    if "=" not in assignment:
        raise ConfigError("", f"--set {assignment!r}: expected key.path=value")
    key, text = assignment.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError("", f"--set {assignment!r}: empty key in {key!r}")
    try:
        value = parse_yaml(text, key.strip()) if text.strip() else None
    except yaml.YAMLError as e:
        why = e.__class__.__name__
        raise ConfigError(key, f"--set value {_show(text)} is not valid YAML ({why})") from None
    except ConfigError as e:
        raise ConfigError(e.path, f"--set value: {e.message}") from None
    node = raw
    for i, p in enumerate(parts[:-1]):
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(parts[:i + 1]),
                              f"is {_show(nxt)}, not a mapping, so {key} cannot be set")
        node = nxt
    node[parts[-1]] = value


def builder_signature(name: str) -> dict[str, tuple[Any, Any]]:
    """Builder keyword arguments that a config may set: name → (type, default)."""
    from onnxtrain import zoo

    fn: Callable = getattr(zoo, name)
    hints = typing.get_type_hints(fn)
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.name != "loss":
            out[p.name] = (hints.get(p.name, Any), p.default)
    return out


def _resolve(cfg: Config, rel: str, key: str, exts: tuple[str, ...]) -> str:
    path = os.path.normpath(os.path.join(cfg.base_dir, os.path.expanduser(rel)))
    if os.path.isdir(path):
        raise ConfigError(key, f"{path} is a folder, not a file")
    if not os.path.isfile(path):
        here = os.path.abspath(os.path.expanduser(rel))
        hint = (f" (paths are relative to the config's folder, in --set too; for the file in the working "
                f"folder give {here})" if here != os.path.abspath(path) and os.path.isfile(here) else "")
        raise ConfigError(key, f"file not found: {path}{hint}")
    if exts and not path.lower().endswith(exts):
        raise ConfigError(key, f"expected a {' or '.join(exts)} file, got {rel!r}")
    return path


def validate(cfg: Config) -> Config:
    """Cross-key checks; resolves file paths (relative to the config's folder) in place."""
    m = cfg.model
    if (m.builder is None) == (m.path is None):
        builders = ", ".join(BUILDERS)
        raise ConfigError("model", f"give exactly one of builder ({builders}) or path (an .onnx)")
    if m.path is not None:
        m.path = _resolve(cfg, m.path, "model.path", (".onnx",))
        if m.args:
            raise ConfigError("model.args", "builder arguments need model.builder, not model.path")
    else:
        sig = builder_signature(m.builder)
        for k, v in list(m.args.items()):
            if k not in sig:
                raise _unknown("model.args", k, list(sig))
            m.args[k] = coerce(v, sig[k][0], f"model.args.{k}")
        missing = [k for k, (_, d) in sig.items() if d is inspect.Parameter.empty and k not in m.args]
        if missing:
            raise ConfigError(f"model.args.{missing[0]}", f"required by the {m.builder} builder")
    d = cfg.data
    if isinstance(d, FilesData):
        if not d.feeds:
            raise ConfigError("data.feeds", "give each model input its array, e.g. {x: images, y: labels}")
        if d.path is not None:
            d.path = _resolve(cfg, d.path, "data.path", (".npz",))
        for k, v in d.feeds.items():
            if v.lower().endswith(".npy"):
                d.feeds[k] = _resolve(cfg, v, f"data.feeds.{k}", (".npy",))
            elif d.path is None:
                raise ConfigError(f"data.feeds.{k}",
                                  f"{v!r} is an array name but data.path (an .npz) is not set")
        if d.path is not None and all(v.lower().endswith(".npy") for v in d.feeds.values()):
            raise ConfigError("data.path", "no feed reads it (every feed is a .npy file); leave it out, or "
                                           "name its arrays in data.feeds")
        if d.eval_path is not None:
            d.eval_path = _resolve(cfg, d.eval_path, "data.eval_path", (".npz",))
        if not 0.0 < d.eval_fraction < 1.0 and d.eval_path is None:
            raise ConfigError("data.eval_fraction", f"expected a fraction in (0, 1), got {d.eval_fraction}")
    elif isinstance(d, SequenceData):
        for k in ("vocab", "length", "train_size", "eval_size"):
            if getattr(d, k) < 1:
                raise ConfigError(f"data.{k}", f"expected a positive int, got {getattr(d, k)}")
        if d.vocab > 2**63:
            raise ConfigError("data.vocab", f"expected an int from 1 to 2**63 (the token ids are int64), got "
                                            f"{d.vocab}")
    o = cfg.optimizer
    if not (math.isfinite(o.lr) and o.lr > 0):
        raise ConfigError("optimizer.lr", f"expected a positive number, got {o.lr}")
    if o.lr > FLOAT32_MAX:  # (the rate is fed as float32: it would be +inf)
        raise ConfigError("optimizer.lr", f"expected at most float32's largest value {FLOAT32_MAX:.7g}, got "
                                          f"{o.lr}")
    for k, zero_ok in (("eps", True), ("weight_decay", True), ("clip_grad_norm", False)):
        v = getattr(o, k)
        if v is not None and not (math.isfinite(v) and (v >= 0 if zero_ok else v > 0)):
            bound = ">= 0" if zero_ok else "> 0"
            raise ConfigError(f"optimizer.{k}", f"expected a finite number {bound} or null, got {v}")
    if o.betas is not None and (len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas)):
        raise ConfigError("optimizer.betas", f"expected two numbers in [0, 1), got {o.betas}")
    if o.name == "sgd":
        for k in ("betas", "eps", "weight_decay", "clip_grad_norm"):
            if getattr(o, k) is not None:
                raise ConfigError(f"optimizer.{k}", "not supported by sgd (use adam or lamb)")
    if o.name == "adam" and o.eps == 0:  # (Lamb sets a step that is not finite to 0)
        raise ConfigError("optimizer.eps", "expected a number > 0 with adam: a weight whose gradient is 0 (a "
                                           "dead ReLU, an input that is always 0) would step by 0/0 and turn "
                                           "NaN; leave it out for adam's 1e-8")
    s = cfg.schedule
    if s.warmup_steps < 0:
        raise ConfigError("schedule.warmup_steps", f"expected an int >= 0, got {s.warmup_steps}")
    if not 0.0 <= s.final_lr_ratio <= 1.0:
        raise ConfigError("schedule.final_lr_ratio", f"expected a number in [0, 1], got {s.final_lr_ratio}")
    t = cfg.training
    for k in ("batch_size", "eval_batch_size", "log_every", "gradient_accumulation_steps",
              "data_parallel_size"):
        if getattr(t, k) < 1:
            raise ConfigError(f"training.{k}", f"expected an int >= 1, got {getattr(t, k)}")
    for k in ("epochs", "steps", "eval_every", "checkpoint_every"):
        if getattr(t, k) is not None and getattr(t, k) < 1:
            raise ConfigError(f"training.{k}", f"expected an int >= 1 or null, got {getattr(t, k)}")
    if t.seed < 0:
        raise ConfigError("training.seed", f"expected an int >= 0, got {t.seed}")
    if t.keep_checkpoints < 0:
        raise ConfigError("training.keep_checkpoints", f"expected an int >= 0, got {t.keep_checkpoints}")
    if t.epochs is None and t.steps is None:
        raise ConfigError("training.epochs", "give training.epochs or training.steps")
    if cfg.output.dir is not None and not cfg.output.dir.strip():  # as --output-dir '' is refused
        raise ConfigError("output.dir", "an empty path (leave it out, or null, for runs/<config name>)")
    _check_parameters(cfg)
    return cfg


# TrainingParameters properties that the config sets through its own keys: under training.parameters they
# would silently override those keys (and the saved config.yaml would not say what ran)
OWN_KEYS: dict[str, str] = {
    "loss_output_name": "use model.loss",
    "training_optimizer_name": "use optimizer.name",
    "lr_params_feed_name": "the trainer feeds the learning rate itself (optimizer.lr and schedule)",
    "gradient_accumulation_steps": "use training.gradient_accumulation_steps (the trainer counts optimizer "
                                   "steps, not micro-batches, only through that key)",
    "gradient_accumulation_mode": "the trainer sets it; use training.gradient_accumulation_steps",
    "data_parallel_size": "use training.data_parallel_size",
    "enable_grad_norm_clip": "use optimizer.clip_grad_norm",
}
# optimizer attributes that the optimizer section sets
OWN_ATTRIBUTES: dict[str, str] = {
    "alpha": "optimizer.betas", "beta": "optimizer.betas", "epsilon": "optimizer.eps",
    "lambda": "optimizer.weight_decay", "max_norm_clip": "optimizer.clip_grad_norm",
}
_SCALARS = (bool, int, float, str)


_MAP_KINDS = {"optimizer_attributes_map": float, "optimizer_int_attributes_map": int}


def _check_attribute_map(label: str, maps: dict, kind: type) -> None:
    """The per-weight optimizer attributes of ``training.parameters.<label>``: numbers (integers in the
    int map; true/false taken as 1/0, in place, as onnxruntime's binding stored a bool given for a
    number), not the attributes the config sets itself; a ConfigError naming the full key path."""
    for w, attrs in maps.items():
        if not isinstance(attrs, dict):
            raise ConfigError(f"training.parameters.{label}.{w}",
                              f"expected a mapping of attribute names to numbers, got {_show(attrs)}")
        for a, value in attrs.items():
            if isinstance(value, bool):
                value = attrs[a] = kind(value)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or (kind is int and not float(value).is_integer()):
                what = "an integer" if kind is int else "a number"
                raise ConfigError(f"training.parameters.{label}.{w}.{a}",
                                  f"expected {what}, got {_show(value)}")
            if a in OWN_ATTRIBUTES and kind is float:
                raise ConfigError(f"training.parameters.{label}.{w}.{a}",
                                  f"set by the config itself: use {OWN_ATTRIBUTES[a]}")


def _check_parameters(cfg: Config) -> None:
    """training.parameters: known TrainingParameters properties of the right type, none that another key of
    the config sets; ``use_mixed_precision`` is moved to training.mixed_precision (the same switch)."""
    from onnxtrain.graph_transforms.mixed_precision import HALF_TYPES
    from onnxtrain.parameters import TrainingParameters

    t = cfg.training
    probe = TrainingParameters()
    for k, v in t.parameters.items():
        path = f"training.parameters.{k}"
        if k not in probe._values:
            raise _unknown("training.parameters", k, sorted(probe._values))
        if k in OWN_KEYS:
            raise ConfigError(path, f"set by the config itself: {OWN_KEYS[k]}")
        default = getattr(probe, k)
        if type(default) in _SCALARS:  # as strict as the config's own keys: no "false" or 1 for a bool
            v = coerce(v, type(default), path)
        if k in _MAP_KINDS and isinstance(v, dict):  # named by their full key path, before the property
            _check_attribute_map(k, v, _MAP_KINDS[k])
        try:
            setattr(probe, k, v)
        except (TypeError, ValueError) as e:
            raise ConfigError(path, str(e)) from None
    if "use_mixed_precision" in t.parameters:  # the same switch: values given for both must agree
        if t.mixed_precision is not None and t.mixed_precision != probe.use_mixed_precision:
            said = lambda v: "true" if v else "false"  # noqa: E731 - a local one-liner
            raise ConfigError("training.parameters.use_mixed_precision",
                              f"{said(probe.use_mixed_precision)} contradicts training.mixed_precision: "
                              f"{said(t.mixed_precision)} (the same switch; give only "
                              "training.mixed_precision)")
        t.mixed_precision = probe.use_mixed_precision
        del t.parameters["use_mixed_precision"]
    if t.mixed_precision is None:
        t.mixed_precision = False
    clip = cfg.optimizer.clip_grad_norm
    if probe.legacy_cpu_adam and clip is not None:
        why = f"true makes adam ignore clipping, so optimizer.clip_grad_norm ({clip}) would have no effect"
        raise ConfigError("training.parameters.legacy_cpu_adam", f"{why}; give only one of them")
    if probe.mixed_precision_dtype not in HALF_TYPES:
        raise ConfigError("training.parameters.mixed_precision_dtype",
                          f"expected one of {', '.join(map(repr, HALF_TYPES))}, "
                          f"got {_show(probe.mixed_precision_dtype)}")
    if probe.set_gradients_as_graph_outputs:
        raise ConfigError("training.parameters.set_gradients_as_graph_outputs",
                          "the main job fetches no gradients, so the outputs would only cost memory; they "
                          "are for scripts using the TrainingSession API (see the README)")
    if probe.horizontal_parallel_size < 1:  # (the trainer divides the ranks by it)
        raise ConfigError("training.parameters.horizontal_parallel_size",
                          f"expected an int >= 1 (a number of ranks), got {probe.horizontal_parallel_size}")
    if probe.pipeline_parallel_size != 1:
        raise ConfigError("training.parameters.pipeline_parallel_size",
                          "the main job splits batches over its ranks for data parallelism only; pipeline "
                          "stages are for scripts using the TrainingSession API (see the README)")


def load_config(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Config:
    """Read, override, check and resolve the configuration at ``path``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        saved = os.path.join(path, "config.yaml")
        hint = f" (a run folder: its own config is {saved})" if os.path.isfile(saved) else ""
        raise ConfigError("", f"{path} is a folder; give the config's .yaml file{hint}")
    if not os.path.isfile(path):
        hint = ""
        if not os.path.isabs(path) and os.path.normpath(path).split(os.sep)[0] == "configs":
            hint = (f" (in {os.getcwd()}; the example configs are in the repository's configs/ folder, not "
                    "in the installed package: run from the repository root, or give the path of a copy)")
        raise ConfigError("", f"config file not found: {path}{hint}")
    with open(path, encoding="utf-8") as f:
        try:
            raw = parse_yaml(f.read())
        except UnicodeDecodeError as e:
            raise ConfigError("", f"{path}: not a UTF-8 text file ({e.reason} at byte {e.start}); give the "
                                  "YAML config here (a model goes in its model.path, a checkpoint after "
                                  "--checkpoint)") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark else ""
            raise ConfigError("", f"{path}: not valid YAML{where}: {getattr(e, 'problem', e)}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("", f"{path}: expected a mapping of sections, got {_show(raw)}")
    for o in overrides:
        apply_override(raw, o)
    cfg = from_dict(Config, raw, "")
    set_epochs = any(o.split("=", 1)[0].strip() == "training.epochs" for o in overrides)
    if set_epochs and cfg.training.steps is not None and cfg.training.epochs is not None:
        raise ConfigError("training.epochs", f"set with --set, but training.steps ({cfg.training.steps}) "
                                             "decides the run's length; add --set training.steps=null")
    cfg.name = os.path.splitext(os.path.basename(path))[0]
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.basename(path) == "config.yaml" and os.path.isfile(os.path.join(folder, "metrics.jsonl")):
        cfg.name = os.path.basename(folder)  # a run's own saved config: the run's name, not "config"
    cfg.base_dir = os.path.dirname(os.path.abspath(path))
    cfg.source = os.path.abspath(path)
    return validate(cfg)


def key_line(path: str | os.PathLike, key: str, overrides: Sequence[str] = ()) -> int | None:
    """The line (1-based) of the config file at ``path`` where ``key`` (a ConfigError's key path, such as
    ``model.args.sizes[1]``) is written, else where its nearest enclosing key is; None when the value came
    from an override (``key.path=value``) or the file does not say (or cannot be read)."""
    if not key or key.startswith("-"):
        return None
    for o in overrides:
        given = o.split("=", 1)[0].strip()
        if key == given or key.startswith((given + ".", given + "[")):
            return None
    try:
        with open(path, encoding="utf-8") as f:
            loader = _Loader(f.read())
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except (OSError, UnicodeDecodeError, yaml.YAMLError, ConfigError, RecursionError):
        return None
    lines: dict[str, int] = {}
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")] if root is not None else []
    while stack:  # (each node once: an alias does not walk the value it repeats again)
        node, where = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    sub = f"{where}.{k.value}" if where else str(k.value)
                    lines.setdefault(sub, k.start_mark.line + 1)
                    stack.append((v, sub))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                sub = f"{where}[{i}]"
                lines.setdefault(sub, item.start_mark.line + 1)
                stack.append((item, sub))
    while key:
        if key in lines:
            return lines[key]
        key = re.sub(r"(\[\d+\]|\.[^.\[]*)$", "", key) if re.search(r"[.\[]", key) else ""
    return None


def config_from_dict(raw: dict[str, Any], name: str = "run", base_dir: str = ".") -> Config:
    """A checked Config from a mapping (as a YAML file would give)."""
    cfg = from_dict(Config, raw, "")
    cfg.name, cfg.base_dir = name, os.path.abspath(base_dir)
    return validate(cfg)


def changed_keys(saved: str, cfg: Config) -> list[str]:
    """The keys ("section.key") whose values differ between a config saved as JSON (a checkpoint's) and
    ``cfg``, sorted."""
    old, new = flatten_keys(json.loads(saved)), flatten_keys(cfg.to_dict())
    keys = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
    # an empty mapping on one side (flatten_keys keeps it as a value) whose keys the other side holds:
    # those keys say what changed, the mapping itself did not
    return sorted(k for k in keys if not any(other.startswith(k + ".") for other in keys))


def flatten_keys(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"section.key": value} (an empty dict kept as a value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten_keys(v, key + "."))
        else:
            out[key] = v
    return out

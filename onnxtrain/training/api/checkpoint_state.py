"""``CheckpointState``: the one owner of the training state (parameters, gradients, optimizer, properties).

``Module`` and ``Optimizer`` are executors over it: graphs take these arrays as inputs and the
executors swap the graphs' new arrays in. Files are onnxruntime-training's on-device checkpoints.
"""

from __future__ import annotations

import json
import math
import os
import sys
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup
from onnxtrain.checkpoint import load_checkpoint as _load_file
from onnxtrain.checkpoint import save_checkpoint as _save_file
from onnxtrain.checkpoint.format import DATA_TOKEN
from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler
from onnxtrain.locks import fork_safe_rlock
from onnxtrain.user_warning import warn

DEFAULT_LEARNING_RATE = float(np.float32(0.001))  # a float32 value, as onnxruntime reports it
GROUP_NAME = "group0"
# The current learning rate, saved with the optimizer state (onnxruntime keeps only initial_lr and step) as
# "<lr>@<step>#<digest of the trainable parameters>": a file that onnxruntime-training trained on and saved
# again (keeping the property) holds other parameters, and mostly a later step: the stale rate is then
# dropped (onnxruntime's default is used, as there).
LEARNING_RATE_PROPERTY = "onnxtrain.learning_rate"
# The dynamic loss scaler of a mixed-precision Module (scale and count of clean steps), as the JSON text
# '{"loss_scale": 32768.0, "stable_steps": 3}': a string keeps the scale exact (float properties are float32).
LOSS_SCALER_PROPERTY = "onnxtrain.loss_scaler"
_RESERVED = (LEARNING_RATE_PROPERTY, LOSS_SCALER_PROPERTY, DATA_TOKEN)


def _parameters_digest(trainable: dict[str, np.ndarray | None]) -> str:
    """A checksum of the trainable parameters' names and values (CRC-32, hex): tells a file whose
    parameters changed after onnxtrain recorded its learning rate."""
    crc = 0
    for name in sorted(trainable):
        crc = zlib.crc32(name.encode(), crc)
        arr = trainable[name]
        if arr is not None:
            crc = zlib.crc32(np.ascontiguousarray(arr).view(np.uint8).reshape(-1), crc)
    return f"{crc:08x}"


def _saved_learning_rate(value: int | float | str | None, step: int, digest: str) -> float | None:
    """The learning rate of :data:`LEARNING_RATE_PROPERTY` when it belongs to the group's ``step`` and the
    parameters' ``digest`` (a float: a file of an onnxtrain that recorded neither; a value without a digest:
    one that recorded only the step); None for another step or digest, and for a value that is not a finite
    rate (with a warning: such a property was not written by onnxtrain). A rate set past float32's range
    (+-inf, NaN: taken as onnxruntime-training takes it) comes back as saved when it carries its step and
    digest."""
    lr: float | None = None
    ours = False  # a value in the "<lr>@<step>#<digest>" form onnxtrain writes
    if isinstance(value, float):
        lr = value
    elif isinstance(value, str):
        text, _, at = value.partition("@")
        at, hashed, recorded = at.partition("#")
        try:
            if int(at) != step or (hashed and recorded != digest):
                return None
            lr, ours = float(text), bool(hashed)
        except ValueError:
            lr = None
    if value is not None and (lr is None or not (ours or math.isfinite(lr))):
        warn(f"ignoring checkpoint property {LEARNING_RATE_PROPERTY}={value!r}: not a learning rate "
             "onnxtrain wrote; the optimizer starts from the default learning rate")
        return None
    return lr


def _saved_loss_scaler(value: int | float | str) -> tuple[float, int] | None:
    """(scale, clean steps) of a :data:`LOSS_SCALER_PROPERTY` value; None (with a warning) if unreadable."""
    try:
        record = json.loads(value) if isinstance(value, str) else None
        scale, steps = float(record["loss_scale"]), int(record["stable_steps"])  # type: ignore[index]
        if math.isfinite(scale) and scale > 0 and steps >= 0:
            return scale, steps
    except (ValueError, TypeError, KeyError):
        pass
    warn(f"ignoring checkpoint property {LOSS_SCALER_PROPERTY}={value!r}: not a loss scaler state; "
         "mixed-precision Modules start from their scaler's initial scale")
    return None


@dataclass
class _Param:
    """One parameter; ``data`` is None while the state is nominal (name and dtype only)."""

    name: str
    dtype: np.dtype
    requires_grad: bool
    data: np.ndarray | None
    grad: np.ndarray | None = None
    # the view of an Optimizer's flat gradient buffer that ``grad`` is while it is that view (flat_update.py):
    # a gradient the Parameter need not give its own array (the buffer keeps it, and views of it, live)
    grad_home: np.ndarray | None = None


def _refs(a: np.ndarray | None) -> int:
    return sys.getrefcount(a)


# the references to an array that only the state holds (one _Param field), counted as _refs counts them
_probe = _Param("probe", np.dtype(np.float32), True, np.zeros(1, np.float32))
_ALONE = _refs(_probe.data)
del _probe


def data_unheld(p: _Param) -> bool:
    """Whether only the state holds ``p``'s value array (no caller's ``.data``, view or base of it): then
    it may be replaced by another array of the same values without anyone seeing the change."""
    return p.data is not None and p.data.base is None and _refs(p.data) <= _ALONE


def grad_unheld(p: _Param) -> bool:
    """Whether only the state holds ``p``'s gradient array (no caller's ``.grad`` or view of it, and not a
    view of an array someone may hold): it may then be replaced by another array of the same values."""
    return p.grad is not None and not isinstance(p.grad.base, np.ndarray) and _refs(p.grad) <= _ALONE


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _overlapping(arrays: Sequence[np.ndarray]) -> list[int]:
    """The indices of arrays whose memory overlaps that of an array before them in address order."""
    roots = [_root(a) for a in arrays]
    sharing: dict[int, list[int]] = {}  # a root buffer → the indices of its arrays
    for i, root in enumerate(roots):
        sharing.setdefault(id(root), []).append(i)
    out = []
    for members in sharing.values():
        if len(members) < 2:  # an array alone in its buffer overlaps nothing (no address asked: 1.3 µs each)
            continue
        taken = sorted((*_span(arrays[i], roots[i]), i) for i in members)
        reach = taken[0][1]
        for start, stop, i in taken[1:]:
            if start < reach:
                out.append(i)
            else:
                reach = stop
    return out


def _span(a: np.ndarray, root: np.ndarray) -> tuple[int, int]:
    """The bytes ``a`` covers, as [start, stop) addresses: its own for a C-contiguous array (none when it is
    empty), else the whole of ``root``'s (an overlap is then assumed with anything else of that buffer)."""
    if a.flags.c_contiguous:
        start = a.ctypes.data
        return start, start + a.nbytes
    start = root.ctypes.data
    return start, start + max(root.nbytes, 1)


def drop_unheld_grads(params: Sequence[_Param]) -> list[_Param]:
    """Let go of the gradient arrays that only the state holds (no caller's ``.grad``, view or base of
    them), so that a training call that overwrites them computes the new ones in their memory instead of
    beside them; returns the parameters whose gradient was dropped (:func:`replace_grads` sets them)."""
    dropped = []
    for p in params:
        if p.grad is not None and p.grad.base is None and _refs(p.grad) <= _ALONE:
            p.grad = None
            dropped.append(p)
    return dropped


def replace_grads(params: Sequence[_Param], new: Sequence[np.ndarray]) -> None:
    """Make ``new[i]`` the gradient of ``params[i]``, keeping held ``.grad`` arrays live.

    ``Parameter.grad`` is a view of the gradient buffer, as in onnxruntime: an array taken earlier must see
    the next training call's gradient, and edits of it must reach the optimizer. When something besides the
    state references the current array (the caller's ``.grad``, a view of it, a torch tensor over it), the
    new values are copied into it; otherwise nobody can see the old array and the new one simply takes its
    place, which costs nothing (the usual training loop, where no copy of the MLP's 669 K gradient values
    is made). The caller must hold no reference to the current arrays itself. Results whose memory overlaps
    are copied first, so that no two parameters ever share an element; disjoint views of one buffer (an
    Optimizer's flat gradients, which onnxruntime writes into) stay views."""
    new = list(new)
    for i in _overlapping(new):
        new[i] = new[i].copy()
    for p, value in zip(params, new):
        if p.grad is None or p.grad is value:
            p.grad = value
            continue
        if _refs(p.grad) > _ALONE:
            held = p.grad
            assert held is not None
            if held.shape == value.shape and held.dtype == value.dtype and held.flags.writeable:
                np.copyto(held, value)
                continue
        p.grad = value


@dataclass
class _OptimizerState:
    """Optimizer group ``group0``: completed steps, learning rates and per-parameter moments."""

    step: int = 0
    initial_lr: float = DEFAULT_LEARNING_RATE
    lr: float = DEFAULT_LEARNING_RATE
    moments: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    active: bool = False  # an Optimizer runs over this state (else: restored from a file, not yet used)


def _owned(a: np.ndarray) -> np.ndarray:
    """A writable, C-contiguous array (a copy only when needed)."""
    return a if a.flags.writeable and a.flags.c_contiguous else np.array(a, order="C")


def _property_value(name: str, value: Any) -> int | float | str:
    if isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "biuf":
        value = value[()]  # a 0-d array (a loss Module returned) as its numpy scalar
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        v = int(value)
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"Property {name!r}: {v} does not fit in int64")
        return v
    if isinstance(value, (float, np.floating)):
        with np.errstate(over="ignore"):
            return float(np.float32(value))  # stored as float32, as onnxruntime-training does
    if isinstance(value, str):
        _check_utf8(value, f"Property {name!r}: the value")
        return value
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as e:  # (onnxruntime-training stored them, then failed on every read)
            raise TypeError(f"Property {name!r}: the value is not valid UTF-8 text ({e.reason} at index "
                            f"{e.start}); checkpoints store strings as UTF-8") from None
    raise TypeError(f"Property {name!r}: a value of type {type(value).__name__} cannot be stored; "
                    "properties are int, float or str")


def _check_utf8(text: str, what: str) -> None:
    """A ``TypeError`` (onnxruntime-training's) for a string the checkpoint cannot store: one with a lone
    surrogate (``os.fsdecode`` of undecodable bytes) has no UTF-8 form, and every later save would fail."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TypeError(f"{what} is not valid UTF-8 text ({e.reason} at index {e.start}); checkpoints store "
                        "strings as UTF-8") from None


LOAD_HINT = "(Module.copy_buffer_to_parameters(buffer, trainable_only=False) loads them.)"


class NominalStateError(RuntimeError, ValueError):
    """A call that needs parameter values on a nominal state (names and types only); the message is
    onnxruntime-training's, plus how to load the values."""


def _nominal_get(name: str) -> str:
    return (f"Cannot get parameter {name!r} from a nominal state. Please load the parameter states first. "
            f"{LOAD_HINT}")


class Parameter:
    """A view of one parameter of a :class:`CheckpointState`.

    ``data`` is the live array: edits in place change the training state, and an array taken earlier
    sees the optimizer's updates. ``grad`` is the gradient buffer, or None for frozen parameters and
    before any Module was built over the state; an array taken earlier sees later training calls (new or
    accumulated gradients), and edits in place reach the optimizer, as onnxruntime's do.
    """

    __slots__ = ("_state", "_name")

    def __init__(self, state: CheckpointState, name: str) -> None:
        self._state, self._name = state, name

    @property
    def name(self) -> str:
        return self._name

    @property
    def requires_grad(self) -> bool:
        return self._state._param(self._name).requires_grad

    @property
    def data(self) -> np.ndarray:
        p = self._state._param(self._name)
        if p.data is None:
            raise NominalStateError(_nominal_get(self._name))
        return p.data

    @data.setter
    def data(self, value: Any) -> None:
        self._state._set_param(self._name, value)

    @property
    def grad(self) -> np.ndarray | None:
        """The gradient buffer (a view the next training call updates, as onnxruntime's). One that the plan
        gave as a view of another array (a Reshape of a sum) is first made an array of its own: a caller's
        view of it then counts as holding it (its base is this array), so that :func:`replace_grads` writes
        the next gradients into it instead of dropping it. A view of an Optimizer's flat gradients stays
        that view: the Optimizer holds it, so the next gradients are always written into it."""
        p = self._state._param(self._name)
        if p.grad is not None and p.grad.base is not None and p.grad is not p.grad_home:
            with self._state._lock:  # (a training call in another thread replaces it)
                if p.grad is not None and p.grad.base is not None and p.grad is not p.grad_home:
                    p.grad = p.grad.copy()
        return p.grad

    def __repr__(self) -> str:
        return f"Parameter(name={self._name}, requires_grad={self.requires_grad})"


class Parameters:
    """Mapping-like view of the parameters: ``[name]``, ``[name] = array``, ``in``, ``len``; iteration
    yields ``(name, Parameter)`` pairs sorted by name, as onnxruntime-training's does."""

    __slots__ = ("_state",)

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> Parameter:
        if self._state._param(name).data is None:
            raise NominalStateError(_nominal_get(name))
        return Parameter(self._state, name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._state._set_param(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._state._params

    def __iter__(self) -> Iterator[tuple[str, Parameter]]:
        if self._state.is_nominal:  # as onnxruntime-training's, which reads each parameter as it iterates
            raise NominalStateError(_nominal_get(next(n for n, p in sorted(self._state._params.items())
                                                      if p.data is None)))
        for name in sorted(self._state._params):
            yield name, Parameter(self._state, name)

    def __len__(self) -> int:
        return len(self._state._params)

    def keys(self) -> list[str]:
        return sorted(self._state._params)

    def __repr__(self) -> str:
        names = sorted(self._state._params)
        return f"Parameters({', '.join(repr(Parameter(self._state, n)) for n in names)})"


class Properties:
    """Mapping-like view of the user properties (int → int64, float → float32 on disk, str)."""

    __slots__ = ("_state",)

    def __init__(self, state: CheckpointState) -> None:
        self._state = state

    def __getitem__(self, name: str) -> int | float | str:
        try:
            return self._state._properties[name]
        except KeyError:
            raise KeyError(f"Property {name} not found.") from None

    def __setitem__(self, name: str, value: Any) -> None:
        if not isinstance(name, str):
            raise TypeError(f"Property names must be str, got {type(name).__name__}")
        if name in _RESERVED:
            raise ValueError(f"Property name {name!r} is reserved by onnxtrain")
        _check_utf8(name, f"Property name {name!r}")
        self._state._properties[name] = _property_value(name, value)

    def __contains__(self, name: object) -> bool:
        return name in self._state._properties

    def __iter__(self) -> Iterator[tuple[str, int | float | str]]:
        props = self._state._properties
        for name in sorted(props):
            yield name, props[name]

    def __len__(self) -> int:
        return len(self._state._properties)

    def __repr__(self) -> str:
        return f"Properties({dict(self)})"


class CheckpointState:
    """All training state; load with :meth:`load_checkpoint`, save with :meth:`save_checkpoint`.

    Example::

        state = CheckpointState.load_checkpoint("checkpoint")
        state.properties["epoch"] = 3
        state.parameters["fc.bias"] = np.zeros(10, np.float32)   # allowed before any Module exists
        CheckpointState.save_checkpoint(state, "checkpoint", include_optimizer_state=True)
    """

    def __init__(self, checkpoint: Checkpoint) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(f"Invalid argument for CheckpointState received {type(checkpoint)}; use "
                            "CheckpointState.load_checkpoint(path)")
        self._params: dict[str, _Param] = {}
        # held by a Module's training call and an Optimizer's step over this state: one at a time (two
        # threads stepping at once lost gradients)
        fork_safe_rlock(self, "_lock")
        for trainable, tensors in ((True, checkpoint.trainable), (False, checkpoint.frozen)):
            for name, arr in tensors.items():
                arr = np.asarray(arr)
                data = None if checkpoint.nominal else _owned(arr)
                self._params[name] = _Param(name, arr.dtype, trainable, data)
        self._properties: dict[str, int | float | str] = {}
        saved_lr: int | float | str | None = None
        # the loss scaler state read from the file, and the scaler of the Module that trains over this state
        self._saved_loss_scaler: tuple[float, int] | None = None
        self._loss_scaler: LossScaler | None = None
        for name, value in checkpoint.properties.items():
            if name == LEARNING_RATE_PROPERTY:
                saved_lr = value
            elif name == LOSS_SCALER_PROPERTY:
                self._saved_loss_scaler = _saved_loss_scaler(value)
            else:
                self._properties[name] = value
        self._optimizer: _OptimizerState | None = None
        # the file's other optimizer groups, which no Optimizer trains (onnxruntime's trains group0 alone):
        # kept as read and saved with the optimizer state, as onnxruntime-training keeps them
        self._other_groups = [OptimizerGroup(g.name, int(g.step), float(g.initial_lr),
                                             {p: {k: _owned(np.asarray(v)) for k, v in m.items()}
                                              for p, m in g.states.items()})
                              for g in checkpoint.optimizer_groups if g.name != GROUP_NAME]
        for g in checkpoint.optimizer_groups:
            if g.name == GROUP_NAME:
                moments = {p: {k: _owned(np.asarray(v)) for k, v in m.items()} for p, m in g.states.items()}
                digest = _parameters_digest({n: p.data for n, p in self._params.items() if p.requires_grad})
                lr = _saved_learning_rate(saved_lr, int(g.step), digest)
                self._optimizer = _OptimizerState(int(g.step), float(g.initial_lr),
                                                  DEFAULT_LEARNING_RATE if lr is None else lr, moments)
        self.path: str | None = None

    # ---------------------------------------------------------------- files
    @classmethod
    @raises_as_onnxruntime
    def load_checkpoint(cls, checkpoint_uri: str | os.PathLike) -> CheckpointState:
        """Load a complete or nominal checkpoint file."""
        checkpoint_uri = _path(checkpoint_uri)
        state = cls(_load_file(checkpoint_uri))
        state.path = os.fspath(checkpoint_uri)
        return state

    @classmethod
    @raises_as_onnxruntime
    def save_checkpoint(cls, state: CheckpointState, checkpoint_uri: str | os.PathLike,
                        include_optimizer_state: bool = False) -> None:
        """Write ``state`` to ``checkpoint_uri`` (atomically; ``<path>.data`` beside it for large models).

        The optimizer state (moments, step, initial and current learning rate) is written only with
        ``include_optimizer_state=True`` and when the state holds one (an Optimizer was created over it,
        or it was loaded from a file). The state of the dynamic loss scaler of a mixed-precision Module
        over ``state`` (scale and count of clean steps) is written always, as property
        :data:`LOSS_SCALER_PROPERTY`; a Module built over the loaded state resumes it.
        """
        if not isinstance(state, CheckpointState):
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}")
        checkpoint_uri = _path(checkpoint_uri)
        if isinstance(include_optimizer_state, (str, bytes)):  # ("no" would be true)
            raise TypeError("include_optimizer_state must be a bool, got "
                            f"{type(include_optimizer_state).__name__} {include_optimizer_state!r}")
        with state._lock:  # a Module's or Optimizer's step in another thread writes the arrays in place
            _save_file(state._to_checkpoint(bool(include_optimizer_state)), checkpoint_uri)

    def _to_checkpoint(self, include_optimizer_state: bool) -> Checkpoint:
        nominal = self.is_nominal
        trainable: dict[str, np.ndarray] = {}
        frozen: dict[str, np.ndarray] = {}
        for p in self._params.values():
            arr = np.empty(0, p.dtype) if p.data is None else p.data
            (trainable if p.requires_grad else frozen)[p.name] = arr
        props: dict[str, int | float | str] = dict(self._properties)
        groups = []
        opt = self._optimizer
        if include_optimizer_state and opt is not None:
            groups.append(OptimizerGroup(GROUP_NAME, opt.step, opt.initial_lr, opt.moments))
            digest = _parameters_digest(trainable)
            props[LEARNING_RATE_PROPERTY] = f"{float(opt.lr)!r}@{int(opt.step)}#{digest}"
        if include_optimizer_state:
            groups += self._other_groups
        scaler = self._loss_scaler_state()
        if scaler is not None:
            props[LOSS_SCALER_PROPERTY] = json.dumps({"loss_scale": scaler[0], "stable_steps": scaler[1]})
        return Checkpoint(trainable, frozen, groups, props, nominal=nominal)

    # ---------------------------------------------------------------- views
    @property
    def parameters(self) -> Parameters:
        return Parameters(self)

    @property
    def properties(self) -> Properties:
        return Properties(self)

    @property
    def is_nominal(self) -> bool:
        """True while some parameter has a name and dtype but no value (a nominal checkpoint)."""
        return any(p.data is None for p in self._params.values())

    def __repr__(self) -> str:
        n_train = sum(p.requires_grad for p in self._params.values())
        return (f"CheckpointState({n_train} trainable and {len(self._params) - n_train} frozen parameters, "
                f"{len(self._properties)} properties{', nominal' if self.is_nominal else ''})")

    # ---------------------------------------------------------------- internal, for Module/Optimizer
    def _param(self, name: str) -> _Param:
        try:
            return self._params[name]
        except (KeyError, TypeError):
            raise KeyError(f"Parameter {name} not found.") from None

    @raises_as_onnxruntime
    def _set_param(self, name: str, value: Any) -> None:
        p = self._param(name)
        if p.data is None:  # whatever the value, as onnxruntime-training
            raise NominalStateError(f"Cannot copy parameter {name!r} to a nominal state. Please load all the "
                                    f"parameter states first. {LOAD_HINT}")
        arr = value.numpy() if hasattr(value, "numpy") and not isinstance(value, np.ndarray) else value
        arr = np.asarray(arr)
        if arr.dtype != p.dtype:
            raise TypeError(f"Parameter {name!r}: data type mismatch. Expected: {p.dtype}, Got: {arr.dtype}")
        if arr.shape != p.data.shape:
            raise ValueError(f"Parameter {name!r}: data shape mismatch. Expected: {p.data.shape}, "
                             f"Got: {arr.shape}")
        with self._lock:  # between whole steps (a step in another thread writes the arrays in place)
            np.copyto(p.data, arr)

    def _loss_scaler_state(self) -> tuple[float, int] | None:
        """(scale, clean steps) of the bound dynamic loss scaler, else as loaded (None: no scaler state)."""
        s = self._loss_scaler
        if isinstance(s, DynamicLossScaler):
            return float(s.loss_scale), int(s.stable_steps)
        return self._saved_loss_scaler

    def _attach_loss_scaler(self, scaler: LossScaler) -> None:
        """A new mixed-precision Module's ``scaler``: a dynamic one resumes the state's scaler state (a
        loaded checkpoint's, or the Module's trained before over this state); then it is the one saved."""
        resumed = self._loss_scaler_state()
        if resumed is not None and isinstance(scaler, DynamicLossScaler):
            scaler.loss_scale, scaler.stable_steps = resumed
        self._loss_scaler = scaler

    def _optimizer_state(self) -> _OptimizerState:
        if self._optimizer is None:
            self._optimizer = _OptimizerState()
        return self._optimizer


def _path(checkpoint_uri: object) -> str:
    """``checkpoint_uri`` as a str path: a str, an os.PathLike or bytes (onnxruntime-training's
    ``os.fspath`` lets bytes through to its loader)."""
    if not isinstance(checkpoint_uri, (str, bytes, os.PathLike)):
        raise TypeError(f"checkpoint_uri must be a path, got {type(checkpoint_uri).__name__}")
    return os.fsdecode(checkpoint_uri)

"""``Optimizer``: runs the optimizer model over a Module's trainable parameters (spec §4.1).

The optimizer model takes ``learning_rate``, ``step`` (completed steps + 1), and per trainable
parameter ``<p>``, ``<p>_grad`` and its moments ``<p>.momentum0`` (``<p>.momentum1``); every
output ``X.out`` is the new value of input ``X``, swapped into the state. A model whose parameter
names would clash with those (parameters ``step``, ``W`` and ``W.momentum0``, ``W`` and ``W.out``)
names the clashing inputs and outputs otherwise and says in its ``onnxtrain.optimizer_io`` metadata
what each one is; the Optimizer then binds them by that record. Gradients are never
cleared by a step (only replaced when the model clips them in place, as onnxruntime does).

Under ``mpiexec -n N`` each step first averages the gradients over the ranks
(``onnxtrain.parallel.allreduce_gradients``) and updates with the average, so N ranks that each run
the module on an equal share of a batch (``parallel.split_batch``) step as one process on the whole
batch would. Constructing the Optimizer is then a collective: the ranks check that they hold the
same models, trainable parameters and values; so is each step, which checks that they use the same
learning rate and loss scale.

Mixed-precision artifacts (onnxtrain extension): the optimizer model also takes ``loss_scale`` (the
scale of the module's gradients) and outputs ``all_gradients_finite``. A step whose gradients are
not all finite changes nothing (parameters, moments, ``step_count``); after every step the module's
loss scaler is updated with the flag (a ``DynamicLossScaler`` halves on overflow and doubles after
its window of clean steps), and :attr:`Optimizer.last_step_finite` tells what happened.

The models of onnxtrain's AdamW and SGD blocks (and onnxruntime-training's, translated into them) run as
one update over flat buffers, the same bits in far fewer array passes (``flat_update.py``).
"""

from __future__ import annotations

import json
import math
import numbers
import time
from typing import Any

import numpy as np

from onnxtrain import parallel
from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.flat_settings import flat_update_enabled
from onnxtrain.interrupts import sigint_deferred
from onnxtrain.ir.builder import pausing_gc
from onnxtrain.model_config_env import warn_on_device_model_config
from onnxtrain.parallel.fingerprint import array_digest, check_same_on_all_ranks, check_same_scalars, digest
from onnxtrain.training.api._graph import ModelLike, load_model
from onnxtrain.training.api._profile import (
    SessionProfile,
    profiles_written_at_collection,
    session_option,
    write_optimized_model,
)
from onnxtrain.training.api.checkpoint_state import (
    LOAD_HINT,
    NominalStateError,
    _OptimizerState,
    replace_grads,
)
from onnxtrain.training.api.flat_update import FlatUpdate
from onnxtrain.training.api.module import Module, _compile, loss_scaling
from onnxtrain.training.ort_artifacts import translate_optimizer_model

LR_INPUT = "learning_rate"
STEP_INPUT = "step"
GRAD_SUFFIX = "_grad"
OUT_SUFFIX = ".out"
IO_KEY = "onnxtrain.optimizer_io"  # what each input and output is, when the names do not say it
PARAM, GRADIENT = "param", "gradient"  # the roles of an input besides its moments' keys


def _into(current: np.ndarray, value: np.ndarray) -> np.ndarray:
    """The array to keep for a weight whose update is ``value``: the current one, holding the new values
    (so that arrays handed out as Parameter.data see the update), unless it cannot take them."""
    if value is current:
        return current
    if current.flags.writeable and current.shape == value.shape and current.dtype == value.dtype:
        np.copyto(current, value)
        return current
    return value


def learning_rate_value(lr: Any) -> float:
    """``lr`` as the float32 value the optimizer stores; TypeError for non-numbers. A numpy array of one
    int or float value counts as that value (onnxruntime-training's float arguments take one)."""
    if isinstance(lr, np.ndarray) and lr.size == 1 and lr.dtype.kind in "iuf":
        lr = lr.reshape(()).item()
    if isinstance(lr, (bool, np.bool_)) or not isinstance(lr, numbers.Real):
        raise TypeError(f"the learning rate must be a float, got {type(lr).__name__}")
    try:
        # past float32's range: ±inf, as onnxruntime's float argument, silently
        with np.errstate(over="ignore"):
            return float(np.float32(lr))
    except OverflowError:  # an int past float64's range: onnxruntime-training's binding refuses it as a type
        raise TypeError(f"the learning rate must be a float; this {type(lr).__name__} is past float64's "
                        "range") from None


def _io_record(model: Any) -> dict[str, Any] | None:
    """The model's ``onnxtrain.optimizer_io`` record (None without one); an error when it is malformed."""
    text = next((p.value for p in model.metadata_props if p.key == IO_KEY), None)
    if text is None:
        return None
    try:
        record = json.loads(text)
        ok = isinstance(record["inputs"], dict) and isinstance(record["outputs"], dict)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"the optimizer model's {IO_KEY} metadata is no JSON "
                         '{"inputs": {name: [parameter, role]}, "outputs": {name: input}}')
    return record


def _recorded_roles(record: dict[str, Any], names: list[str]) -> dict[str, tuple[str, str]]:
    """Input name -> (parameter, role) from the record, which must describe every one of ``names``."""
    roles = {}
    for n in names:
        entry = record["inputs"].get(n)
        if not (isinstance(entry, list) and len(entry) == 2 and all(isinstance(x, str) for x in entry)):
            raise ValueError(f"optimizer model input {n!r} has no [parameter, role] entry in its {IO_KEY} "
                             "metadata")
        roles[n] = (entry[0], entry[1])
    return roles


def _roles_by_name(names: list[str], trainable: set[str], frozen: set[str]) -> dict[str, tuple[str, str]]:
    """Input name -> (parameter, role) read from the names: ``<p>``, ``<p>_grad``, ``<p>.<moment key>``
    (trainable parameters first, then frozen ones)."""
    roles = {}
    for n in names:
        role = _named_role(n, trainable) or _named_role(n, frozen)
        if role is None:
            if n in ("params", "gradients", "first_order_moments"):
                raise ValueError("this optimizer model takes tensor sequences (onnxruntime-training's "
                                 "com.microsoft optimizer); regenerate it with onnxtrain.training.artifacts")
            raise ValueError(f"unexpected optimizer model input {n!r}: it is no trainable parameter, "
                             "gradient ('<p>_grad') or moment ('<p>.momentumK') of the module")
        roles[n] = role
    return roles


def _named_role(n: str, params: set[str]) -> tuple[str, str] | None:
    if n in params:
        return n, PARAM
    if n.endswith(GRAD_SUFFIX) and n[:-len(GRAD_SUFFIX)] in params:
        return n[:-len(GRAD_SUFFIX)], GRADIENT
    p, _, key = n.rpartition(".")
    return (p, key) if p in params else None


def _output_targets(record: dict[str, Any] | None, outputs: list[str], inputs: set[str]) -> dict[str, str]:
    """Output name -> the input it is the new value of: from the record, else ``<input>.out``."""
    if record is not None:
        targets = {o: record["outputs"].get(o) for o in outputs}
    else:
        targets = {o: o[:-len(OUT_SUFFIX)] if o.endswith(OUT_SUFFIX) else None for o in outputs}
    bad = [o for o, x in targets.items() if x not in inputs]
    if bad:
        how = f"in its {IO_KEY} metadata" if record is not None else "'<input>.out'"
        raise ValueError(f"optimizer model outputs {bad} are not the new value ({how}) of a parameter, "
                         "gradient or moment input")
    return targets


class Optimizer:
    """Updates the trainable parameters of ``module`` with the generated optimizer model.

    Example::

        optimizer = Optimizer("optimizer_model.onnx", module)
        loss = module(x, y); optimizer.step(); module.lazy_reset_grad()
    """

    @raises_as_onnxruntime
    @pausing_gc
    def __init__(self, optimizer_uri: ModelLike, module: Module) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"module must be a Module, got {type(module).__name__}")
        warn_on_device_model_config("Optimizer")
        self._module = module
        self._state = module.state
        begin = time.perf_counter_ns()
        model, path = load_model(optimizer_uri, "optimizer")
        model = translate_optimizer_model(model, module._train_model)  # onnxruntime-training's, if it is
        loaded = time.perf_counter_ns()
        self._classify(model)
        # the module's backend; on onnxruntime, its threads stop spinning when its run ends (the training
        # model's run next), and a weight's or moment's update may be written into the old array (the numpy
        # plan finds that itself)
        replaced = set(self._param_inputs.values()) | set(self._moments)
        updates = {o: self._targets[o] for o in self._outputs if self._targets[o] in replaced}
        scalars = {LR_INPUT, STEP_INPUT} | ({self._loss_scale_input} if self._loss_scale_input else set())
        # the model of onnxtrain's AdamW or SGD runs as one update over flat buffers (flat_update.py)
        self._flat = self._flat_update(model, scalars)
        if self._flat is not None:
            self._plan = self._flat.plan
        else:
            self._plan = _compile(model, "optimizer", module._session_options, follower=True, updates=updates,
                                  scalar_inputs=scalars)
        compiled = time.perf_counter_ns()
        self.algorithm = next((p.value for p in model.metadata_props if p.key == "onnxtrain.optimizer"),
                              "AdamW" if "momentum1" in self._moment_keys else "SGD")
        with self._state._lock:  # a save in another thread writes the moments made here: all or none
            self._opt = self._bind_state()
        #: whether the last step's gradients were all finite (None before the first step;
        #: always True without loss scaling)
        self.last_step_finite: bool | None = None
        self._data_parallel = parallel.world().size > 1
        if self._data_parallel:
            check_same_on_all_ranks(parallel.get_communicator(), self._fingerprint(model),
                                    "on-device training setup")
        self._apply_session_options(model, path is not None, (begin, loaded), (loaded, compiled))

    def _apply_session_options(self, model: Any, from_file: bool, loading: tuple[int, int],
                               initialization: tuple[int, int]) -> None:
        """The module's ``optimized_model_filepath`` and ``enable_profiling`` on the numpy engine, as
        onnxruntime-training's optimizer session applies them: the (translated) optimizer model written over
        the path, and a trace of the update's runs written when this Optimizer is collected."""
        options = self._module._session_options
        write_optimized_model(options, model)
        if not session_option(options, "enable_profiling"):
            return
        profile = SessionProfile(options, "optimizer", from_file, loading)
        self._plan = profile.watch(self._plan, initialization)
        if self._flat is not None:
            self._flat.plan = self._plan
        profiles_written_at_collection(self, [profile])

    # ---------------------------------------------------------------- interface
    def _classify(self, model: Any) -> None:
        g = model.graph
        init = {t.name for t in g.initializer}
        inputs = [v.name for v in g.input if v.name not in init]
        if inputs[:2] != [LR_INPUT, STEP_INPUT]:
            raise ValueError(f"not an optimizer model: its inputs must start with {LR_INPUT!r}, "
                             f"{STEP_INPUT!r}; got {inputs[:6]}{' ...' if len(inputs) > 6 else ''}")
        record = loss_scaling(model)
        self._loss_scale_input = record["loss_scale"] if record and record["loss_scale"] in inputs else None
        self._finite_output = (record or {}).get("all_gradients_finite") if self._loss_scale_input else None
        module_scaled = self._module._loss_scale_input is not None
        if module_scaled and self._loss_scale_input is None:
            raise ValueError("the training model computes loss-scaled gradients (mixed precision) but the "
                             "optimizer model takes no loss_scale: use the optimizer model generated with it")
        if self._loss_scale_input is not None and not module_scaled:
            raise ValueError("the optimizer model expects loss-scaled gradients (mixed precision) but the "
                             "training model takes no loss_scale: use the training model generated with it")
        trainable = self._module.trainable_parameter_names
        tset = set(trainable)
        # parameters the checkpoint freezes although the artifacts train them (the Module warned and drops
        # their gradients): the optimizer model still takes them, fed as they are with zero gradients and
        # moments, and their updates are discarded
        frozen = {n for n in self._state._params if n not in tset}
        record = _io_record(model)
        names = [n for n in inputs[2:] if n != self._loss_scale_input]
        roles = _recorded_roles(record, names) if record else _roles_by_name(names, tset, frozen)
        self._frozen_inputs: dict[str, tuple[str, str]] = {}  # input name -> (frozen parameter, role)
        self._roles: dict[str, tuple[str, str]] = {}  # input name -> (trainable parameter, role)
        for n, (p, role) in roles.items():
            if p in tset:
                self._roles[n] = (p, role)
            elif p in frozen:
                self._frozen_inputs[n] = (p, role)
            else:
                raise ValueError(f"optimizer model input {n!r} is the {role} of {p!r}, which is no parameter "
                                 "of the module")
        self._param_inputs = {p: n for n, (p, role) in self._roles.items() if role == PARAM}
        self._grads = {p: n for n, (p, role) in self._roles.items() if role == GRADIENT}
        self._moments = {n: pk for n, pk in self._roles.items() if pk[1] not in (PARAM, GRADIENT)}
        missing = [p for p in trainable if p not in self._param_inputs or p not in self._grads]
        if missing:
            raise ValueError(f"the optimizer model does not update trainable parameter(s) {missing}")
        self._params = list(trainable)
        self._moment_keys = sorted({k for _, k in self._moments.values()})
        keys_of: dict[str, list[str]] = {}  # parameter → its moments' keys (one pass: per parameter, n²)
        for q, k in self._moments.values():
            keys_of.setdefault(q, []).append(k)
        for p in trainable:
            have = sorted(keys_of.get(p, ()))
            if have != self._moment_keys:
                raise ValueError(f"the optimizer model gives parameter {p!r} moments {have}, others "
                                 f"{self._moment_keys}")
        outputs = [v.name for v in g.output]
        if self._loss_scale_input is not None and self._finite_output not in outputs:
            raise ValueError(f"the mixed-precision optimizer model has no {self._finite_output!r} output")
        outputs = [o for o in outputs if o != self._finite_output]
        self._targets = _output_targets(record, outputs, set(roles))
        self._outputs = outputs
        lr_vi = next(v for v in g.input if v.name == LR_INPUT)
        self._lr_dtype = np.float64 if lr_vi.type.tensor_type.elem_type == 11 else np.float32
        self._lr_array: np.ndarray | None = None  # the last learning rate feed (runs only read it)

    def _flat_update(self, model: Any, scalars: set[str]) -> FlatUpdate | None:
        """The update over flat buffers when the model allows it (no loss scaling, every input a trainable
        parameter's, the model its recorded block generates) and the session options do not turn it off."""
        if (self._loss_scale_input is not None or self._frozen_inputs
                or not flat_update_enabled(self._module._session_options)):
            return None
        types = {v.name: v.type for v in model.graph.input}
        params = [(p, types[n]) for n, (p, role) in self._roles.items() if role == PARAM]
        options = self._module._session_options

        def compile_flat(flat: Any, updates: dict[str, str]) -> Any:
            return _compile(flat, "optimizer", options, follower=True, updates=updates, scalar_inputs=scalars)

        # onnxruntime writes the Module's gradients into the arrays .grad holds (IOBinding outputs): the
        # flat gradient buffer's views, so that no step gathers them
        in_place = getattr(self._module._overwrite_plan, "backend", None) == "onnxruntime"
        return FlatUpdate.build(model, params, self._moment_keys, compile_flat,
                                self._module._release_bindings, grads_in_place=in_place)

    def _fingerprint(self, optimizer_model: Any) -> dict[str, Any]:
        """What every data-parallel rank must hold identically (digests of graphs and values)."""
        params = self._state._params
        return {
            "training model": digest(self._module._train_model.SerializeToString(deterministic=True)),
            "optimizer model": digest(optimizer_model.SerializeToString(deterministic=True)),
            "trainable parameters": self._params,
            "parameter values": {p: "nominal" if params[p].data is None else array_digest(params[p].data)
                                 for p in self._params},
            "optimizer step and learning rate": (self._opt.step, self._opt.lr),
        }

    def _bind_state(self) -> _OptimizerState:
        opt = self._state._optimizer_state()
        params = self._state._params
        if not opt.active and opt.moments:  # restored from a checkpoint: strict, as onnxruntime
            for p in self._params:
                saved = opt.moments.get(p)
                if saved is None:
                    raise ValueError(f"Parameter {p} not found in the source optimizer checkpoint states.")
                for key in self._moment_keys:
                    if key not in saved:
                        raise ValueError(f"Parameter {p}: moment {key!r} not found in the source optimizer "
                                         f"checkpoint states (it has {sorted(saved)}).")
                    data = params[p].data
                    m = saved[key]
                    if data is not None and (m.shape != data.shape or m.dtype != data.dtype):
                        raise ValueError(f"Parameter {p}: saved moment {key!r} is {m.dtype}{list(m.shape)}, "
                                         f"the parameter {data.dtype}{list(data.shape)}")
        opt.active = True
        self._allocate_moments(opt)
        return opt

    def _allocate_moments(self, opt: _OptimizerState) -> None:
        params = self._state._params
        for p in self._params:
            data = params[p].data
            if data is None:
                continue  # nominal: allocated once the parameters are loaded
            slot = opt.moments.setdefault(p, {})
            for key in self._moment_keys:
                if key not in slot:
                    slot[key] = np.zeros_like(data)

    # ---------------------------------------------------------------- public API
    @raises_as_onnxruntime
    def step(self) -> None:
        """Apply one update with the current learning rate; gradients are left as they are.

        Under ``mpiexec`` the update uses the gradients averaged over the ranks (a collective: every
        rank calls ``step`` the same number of times). With loss scaling, a step whose gradients are
        not all finite is skipped (``step_count`` unchanged, :attr:`last_step_finite` False) and the
        module's loss scaler is updated either way."""
        # not while a Module's training call or another step runs on the state; Ctrl-C waits for the step's
        # end in one process (under MPI a rank must stop at once)
        with self._state._lock, sigint_deferred(not self._data_parallel):
            self._step()

    def _check_same_rates(self) -> None:
        """ValueError on every rank when the ranks' learning rates or loss scales differ: each rank updates
        its own replica with its own, so the replicas would part without a word. One allgather a step."""
        rates = {"the learning rate (set_learning_rate, a scheduler)": float(self._opt.lr)}
        if self._loss_scale_input is not None:
            scale = self._module._grad_loss_scale_for_step()
            rates["the loss scale (the Module's loss scaler)"] = float(np.asarray(scale).reshape(-1)[0])
        check_same_scalars(parallel.get_communicator(), rates, "Optimizer.step: checking the ranks' rates")

    def _lr_feed(self, lr: float) -> np.ndarray:
        """``np.array([lr])`` of the model's learning rate type, the last one again while it holds ``lr``
        (a zero rate of the same sign too: -0.0 == 0.0, but a -0.0 weight minus -0.0·g is +0.0 where g > 0,
        minus 0.0·g stays -0.0)."""
        feed = self._lr_array
        if feed is None or feed[0] != lr or (lr == 0 and math.copysign(1, lr) != math.copysign(1, feed[0])):
            feed = self._lr_array = np.array([lr], self._lr_dtype)
        return feed

    def _step(self) -> None:
        opt = self._opt
        params = self._state._params
        self._allocate_moments(opt)
        feeds: dict[str, Any] = {LR_INPUT: self._lr_feed(opt.lr),
                                 STEP_INPUT: np.array([opt.step + 1], np.int64)}
        if self._data_parallel:
            self._check_same_rates()
        for p in self._params:
            if params[p].data is None:
                raise NominalStateError("The optimizer state cannot be constructed from a nominal state. "
                                        f"Please load the model parameters first. {LOAD_HINT}")
        if self._flat is not None:
            reduce = None
            if self._data_parallel:
                def reduce(grads: list[np.ndarray]) -> list[np.ndarray]:
                    return parallel.allreduce_gradients(grads, inplace=False)
            self._flat.step(feeds[LR_INPUT], feeds[STEP_INPUT], params, opt.moments, reduce)
            self.last_step_finite = True
            opt.step += 1
            return
        for p in self._params:
            prm = params[p]
            feeds[self._param_inputs[p]] = prm.data
            feeds[self._grads[p]] = prm.grad if prm.grad is not None else np.zeros_like(prm.data)
        if self._data_parallel:  # fresh arrays: the averages never alias weights or .grad
            names = [self._grads[p] for p in self._params]
            feeds.update(zip(names, parallel.allreduce_gradients([feeds[n] for n in names], inplace=False)))
        for name, (p, key) in self._moments.items():
            feeds[name] = opt.moments[p][key]
        for name, (p, role) in self._frozen_inputs.items():  # kept as they are: the updates are discarded
            data = params[p].data
            if data is None:
                raise NominalStateError(f"The optimizer model reads frozen parameter {p!r}, which the "
                                        f"nominal state holds no value of. {LOAD_HINT}")
            feeds[name] = data if role == PARAM else np.zeros_like(data)
        # weights and moments are replaced by their updates: the plan may write the new values into them,
        # which is also what keeps a Parameter's .data aliasing the live weights, as onnxruntime's does
        donate = [*self._param_inputs.values(), *self._moments]
        if self._loss_scale_input is not None:
            feeds[self._loss_scale_input] = self._module._grad_loss_scale_for_step()
            results = self._plan.run(feeds, [*self._outputs, self._finite_output], donate=donate)
            finite = bool(np.asarray(results.pop()).reshape(-1)[0])
        else:
            results = self._plan.run(feeds, self._outputs, donate=donate)
            finite = True
        feeds.clear()  # (it references the gradients, which replace_grads must see unshared)
        clipped: list[tuple[Any, np.ndarray]] = []
        for out, value in zip(self._outputs, results):
            target = self._targets[out]
            if target in self._frozen_inputs:
                continue
            p, role = self._roles[target]
            if role == PARAM:
                params[p].data = _into(params[p].data, value)
            elif role == GRADIENT:  # a clipped gradient
                clipped.append((params[p], value))
            else:
                opt.moments[p][role] = value
        if clipped:
            replace_grads([p for p, _ in clipped], [v for _, v in clipped])
        self.last_step_finite = finite
        if finite:  # a skipped step's outputs are its inputs: only the count would change
            opt.step += 1
        scaler = self._module.loss_scaler
        automatic = scaler is not None and getattr(scaler, "automatic_update", True)
        if self._loss_scale_input is not None and automatic:
            scaler.update_loss_scale(finite)
        if scaler is not None:
            self._state._loss_scaler = scaler  # the scaler the state's checkpoints record

    @raises_as_onnxruntime
    def set_learning_rate(self, learning_rate: float) -> None:
        """Use ``learning_rate`` (stored as float32) from the next step on."""
        self._opt.lr = learning_rate_value(learning_rate)

    def get_learning_rate(self) -> float:
        """The current learning rate (a float32 value)."""
        return self._opt.lr

    @property
    def module(self) -> Module:
        return self._module

    @property
    def step_count(self) -> int:
        """Completed optimizer steps (restored from a checkpoint saved with its optimizer state)."""
        return self._opt.step

    def _set_initial_lr(self, lr: float) -> None:
        self._opt.initial_lr = lr
        self._opt.lr = lr

    @property
    def _initial_lr(self) -> float:
        return self._opt.initial_lr

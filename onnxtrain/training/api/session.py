"""``TrainingSession``: the C# ``TrainingSession`` flow (spec §5) over Module, Optimizer, LinearLRScheduler.

Not to be confused with the legacy ``onnxtrain.TrainingSession`` (one ONNX model and
``TrainingParameters``): this one runs the artifacts of ``generate_artifacts``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import raises_as_onnxruntime
from onnxtrain.ir.types import np_dtype_of, value_info_shape
from onnxtrain.training.api._graph import ModelLike, is_optimizer_model, load_model
from onnxtrain.training.api.checkpoint_state import CheckpointState
from onnxtrain.training.api.lr_scheduler import LinearLRScheduler
from onnxtrain.training.api.module import Module
from onnxtrain.training.api.optimizer import Optimizer, learning_rate_value


class TrainingSession:
    """One Module (with its eval model) and optionally one Optimizer over a :class:`CheckpointState`.

    As in C#, ``TrainingSession(state, train_model, optimizer_model)`` (an optimizer model third) makes
    the session without an eval model.

    Example::

        state = CheckpointState.load_checkpoint("checkpoint")
        session = TrainingSession(state, "training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")
        session.register_linear_lr_scheduler(warmup_step_count=10, total_step_count=100,
                                             initial_learning_rate=0.01)
        for x, y in batches:
            loss, = session.train_step([x, y])
            session.optimizer_step(); session.lazy_reset_grad(); session.scheduler_step()
        eval_loss, = session.eval_step([x, y])
    """

    @raises_as_onnxruntime
    def __init__(self, state: CheckpointState, train_model: ModelLike, eval_model: ModelLike | None = None,
                 optimizer_model: ModelLike | None = None, device: str = "cpu",
                 session_options: Any = None) -> None:
        if not isinstance(state, CheckpointState):
            hint = (": C#'s TrainingSession(options, state, ...) is TrainingSession(state, ..., "
                    "session_options=options) here" if isinstance(train_model, CheckpointState) else "")
            raise TypeError(f"state must be a CheckpointState, got {type(state).__name__}{hint}")
        if eval_model is not None and optimizer_model is None:
            # C#'s TrainingSession(state, trainModel, optimizerModel): a third model that is an optimizer
            # model is the optimizer's (parsed once, for both the check and the Module or Optimizer)
            eval_model = load_model(eval_model, "eval")[0]
            if is_optimizer_model(eval_model):
                eval_model, optimizer_model = None, eval_model
        self._state = state
        self._module = Module(train_model, state, eval_model, device=device, session_options=session_options)
        self._optimizer = Optimizer(optimizer_model, self._module) if optimizer_model is not None else None
        self._scheduler: LinearLRScheduler | None = None

    # ---------------------------------------------------------------- steps
    def _feeds(self, inputs: Sequence[Any] | Mapping[str, Any], training: bool) -> list[Any]:
        names, _ = self._module._mode_names(training)
        if isinstance(inputs, Mapping):
            unknown = sorted(set(inputs) - set(names))
            missing = [n for n in names if n not in inputs]
            if unknown or missing:
                raise ValueError(f"{'train' if training else 'eval'} step inputs: unknown {unknown}, missing "
                                 f"{missing}; expected {names}")
            return [inputs[n] for n in names]
        if isinstance(inputs, (np.ndarray, str, bytes)) or not isinstance(inputs, Sequence):
            raise TypeError(f"inputs must be a list of arrays (in the order {names}) or a dict by name, got "
                            f"{type(inputs).__name__}")
        return list(inputs)

    def _declared_outputs(self, training: bool) -> dict[str, tuple[np.dtype | None, list | None]]:
        """Output name → (dtype, dims) the training (``True``) or eval model declares (None: not declared)."""
        m = self._module
        model = m._train_model if training else m._eval_model
        if model is None:
            return {}
        return {v.name: (np_dtype_of(v.type), value_info_shape(v.type)) for v in model.graph.output}

    def _check_buffers(self, outputs: Sequence[Any] | None, training: bool) -> None:
        """Refuse, before the step runs, pre-allocated ``outputs`` the step's results cannot be written into
        exactly (another count, not a writable array, another declared dtype, rank or fixed dim), so that a
        refused train step accumulates no gradient; symbolic dims are checked after the step."""
        if outputs is None:
            return
        names = self.output_names(training)
        if isinstance(outputs, (np.ndarray, str, bytes)) or not isinstance(outputs, Sequence):
            raise TypeError(f"outputs must be a list of arrays, one per output {names}, got "
                            f"{type(outputs).__name__}")
        if len(outputs) != len(names):
            raise ValueError(f"{len(outputs)} output buffer(s) given, the model has {len(names)} output(s) "
                             f"{names}")
        declared = self._declared_outputs(training)
        for name, buf in zip(names, outputs):
            if not isinstance(buf, np.ndarray):
                raise TypeError(f"output buffer for {name!r} must be a numpy array, got {type(buf).__name__}")
            dtype, dims = declared.get(name, (None, None))
            if dtype is not None and buf.dtype != dtype:
                raise TypeError(f"output buffer for {name!r} must be of dtype {dtype} (the output's type), "
                                f"got {buf.dtype}")
            if not buf.flags.writeable:
                raise ValueError(f"output buffer for {name!r} is read-only")
            if dims is not None and (buf.ndim != len(dims) or any(
                    isinstance(d, int) and d >= 0 and d != n for d, n in zip(dims, buf.shape))):
                raise ValueError(f"output buffer for {name!r} must be an array of shape {dims}, got "
                                 f"{buf.shape}")

    @staticmethod
    def _deliver(results: list[np.ndarray], outputs: Sequence[np.ndarray] | None,
                 names: list[str]) -> list[np.ndarray]:
        """The step's ``results``, or ``outputs`` (checked by :meth:`_check_buffers`) filled with them."""
        if outputs is None:
            return results
        for name, buf, res in zip(names, outputs, results):
            if buf.shape != res.shape:
                raise ValueError(f"output buffer for {name!r} must be an array of shape {res.shape}, got "
                                 f"{buf.shape}")
            if buf.dtype != res.dtype:  # (an output the model declares no type for)
                raise TypeError(f"output buffer for {name!r} must be of dtype {res.dtype}, got {buf.dtype}")
            np.copyto(buf, res)
        return list(outputs)

    @raises_as_onnxruntime
    def train_step(self, inputs: Sequence[Any] | Mapping[str, Any],
                   outputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Forward and backward on one batch; gradients accumulate until :meth:`lazy_reset_grad`.

        ``inputs``: arrays in :meth:`input_names` order (training) or a dict by name. Returns the
        training model's outputs (loss first), or fills and returns the pre-allocated ``outputs``.
        """
        self._check_buffers(outputs, True)
        results = self._module._run_step(self._feeds(inputs, True), training=True)
        return self._deliver(results, outputs, self.output_names(True))

    @raises_as_onnxruntime
    def eval_step(self, inputs: Sequence[Any] | Mapping[str, Any],
                  outputs: Sequence[np.ndarray] | None = None) -> list[np.ndarray]:
        """Run the eval model on one batch (gradients untouched)."""
        self._check_buffers(outputs, False)
        results = self._module._run_step(self._feeds(inputs, False), training=False)
        return self._deliver(results, outputs, self.output_names(False))

    def lazy_reset_grad(self) -> None:
        """The next train step overwrites the gradients instead of adding to them."""
        self._module.lazy_reset_grad()

    def _need_optimizer(self, what: str) -> Optimizer:
        if self._optimizer is None:
            raise RuntimeError(f"{what} needs an optimizer model: TrainingSession(state, train_model, "
                               "eval_model, optimizer_model)")
        return self._optimizer

    def optimizer_step(self) -> None:
        """Update the trainable parameters with the accumulated gradients."""
        self._need_optimizer("optimizer_step").step()

    # ---------------------------------------------------------------- learning rate
    def set_learning_rate(self, learning_rate: float) -> None:
        """Use a constant learning rate; refused once a scheduler is registered."""
        opt = self._need_optimizer("set_learning_rate")
        if self._scheduler is not None:
            raise RuntimeError("Cannot set the learning rate: a linear learning-rate scheduler is registered "
                               "and sets it at every scheduler_step()")
        opt.set_learning_rate(learning_rate)

    def get_learning_rate(self) -> float:
        return self._need_optimizer("get_learning_rate").get_learning_rate()

    def register_linear_lr_scheduler(self, warmup_step_count: int, total_step_count: int,
                                     initial_learning_rate: float) -> None:
        """Register a linear warm-up/decay schedule; the lr equals ``initial_learning_rate`` until the
        first :meth:`scheduler_step` (as the C API does)."""
        opt = self._need_optimizer("register_linear_lr_scheduler")
        if self._scheduler is not None:
            raise RuntimeError("A linear learning-rate scheduler is already registered with this session")
        lr = learning_rate_value(initial_learning_rate)
        scheduler = LinearLRScheduler(opt, warmup_step_count, total_step_count, lr)
        opt._set_initial_lr(lr)
        self._scheduler = scheduler

    def scheduler_step(self) -> None:
        """Recompute the learning rate from the completed optimizer steps."""
        if self._scheduler is None:
            raise RuntimeError("No learning-rate scheduler is registered: call register_linear_lr_scheduler "
                               "first")
        self._scheduler.step()

    # ---------------------------------------------------------------- parameters, export, names
    def to_buffer(self, only_trainable: bool) -> np.ndarray:
        """The parameters as one 1-D array (training-model input order)."""
        return self._module.get_contiguous_parameters(bool(only_trainable)).numpy()

    @raises_as_onnxruntime
    def from_buffer(self, buffer: Any) -> None:
        """Load a 1-D array of either the trainable or all parameters (chosen by its length)."""
        arr = buffer.numpy() if hasattr(buffer, "numpy") and not isinstance(buffer, np.ndarray) else buffer
        arr = np.asarray(arr)
        if arr.ndim != 1:
            raise ValueError(f"Incorrect buffer size received: expected a 1-D tensor, got shape "
                             f"{list(arr.shape)}")
        trainable = self._module.get_parameters_size(True)
        every = self._module.get_parameters_size(False)
        if arr.size == trainable and not self._state.is_nominal:
            self._module.copy_buffer_to_parameters(arr, True)
        elif arr.size == every:
            self._module.copy_buffer_to_parameters(arr, False)
        else:
            raise ValueError(f"Incorrect buffer size received: {arr.size} elements; expected {trainable} "
                             f"(trainable parameters) or {every} (all parameters)")

    def export_model_for_inferencing(self, inference_model_path: str | os.PathLike,
                                     graph_output_names: Sequence[str]) -> None:
        self._module.export_model_for_inferencing(inference_model_path, graph_output_names)

    def input_names(self, training: bool) -> list[str]:
        """User input names of the training (``True``) or eval graph."""
        return self._module._mode_names(bool(training))[0]

    def output_names(self, training: bool) -> list[str]:
        """User output names of the training (``True``) or eval graph."""
        return self._module._mode_names(bool(training))[1]

    @property
    def state(self) -> CheckpointState:
        return self._state

    @property
    def module(self) -> Module:
        return self._module

    @property
    def optimizer(self) -> Optimizer | None:
        return self._optimizer

"""The legacy session's state in onnxtrain's checkpoint format, and back.

* trained weights → ``trainable``; every other initializer of the model (BatchNormalization
  running statistics, frozen weights, constants) → ``frozen``;
* Adam/Lamb ``Moment_1``/``Moment_2`` → ``momentum0``/``momentum1`` of one optimizer group, whose
  ``step`` is the number of updates done (the session's ``Update_Count``/``Step`` minus one);
* the trainer's run state (step, epoch, data position, data-order RNG state, …) → ``properties``.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup
from onnxtrain.session import TrainingSession

MOMENTS = {"Moment_1": "momentum0", "Moment_2": "momentum1"}
COUNTERS = ("Update_Count", "Step")  # 1 before the first update
SHARED = "shared_optimizer_state"


def trainable_names(sess: TrainingSession) -> list[str]:
    return list(sess.get_model_state()["full_precision"])


def optimizer_state_names(sess: TrainingSession) -> set[str]:
    """Store names of the session's optimizer state (``Moment_1_<w>``, ``Step``, …)."""
    return {k if w == SHARED else f"{k}_{w}" for w, d in sess.get_optimizer_state().items() for k in d}


def session_to_checkpoint(sess: TrainingSession, model: onnx.ModelProto, initial_lr: float, steps_done: int,
                          properties: Mapping[str, int | float | str]) -> Checkpoint:
    """A checkpoint of ``sess`` (trained from ``model``) after ``steps_done`` optimizer steps."""
    state = sess.get_state()
    trained = trainable_names(sess)
    opt = sess.get_optimizer_state()
    opt_names = optimizer_state_names(sess)
    frozen = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name not in trained}
    for name, v in state.items():  # BatchNormalization running statistics: the session's current values
        if name not in trained and name not in opt_names:
            frozen[name] = v
    counts = {int(d[k].reshape(-1)[0]) for d in opt.values() for k in COUNTERS if k in d}
    if len(counts) > 1:
        raise ValueError(f"optimizer step counters disagree across weights: {sorted(counts)}")
    step = counts.pop() - 1 if counts else steps_done  # SGD keeps no counter
    states: dict[str, dict[str, np.ndarray]] = {}
    for w, d in opt.items():
        if w == SHARED:
            continue
        states[w] = {MOMENTS.get(k, k): v for k, v in d.items() if k not in COUNTERS}
    group = OptimizerGroup(name="group0", step=step, initial_lr=float(initial_lr), states=states)
    return Checkpoint(trainable={w: state[w] for w in trained}, frozen=frozen, optimizer_groups=[group],
                      properties=dict(properties))


def checkpoint_to_state(ckpt: Checkpoint, sess: TrainingSession) -> dict[str, np.ndarray]:
    """The ``load_state`` dict that puts ``ckpt`` back into ``sess`` (every state tensor, checked)."""
    current = sess.get_state()
    opt = sess.get_optimizer_state()
    if not ckpt.optimizer_groups:
        raise ValueError("the checkpoint has no optimizer group")
    group = ckpt.optimizer_groups[0]
    out: dict[str, np.ndarray] = {}
    for name in trainable_names(sess):
        if name not in ckpt.trainable:
            raise ValueError(f"the checkpoint has no trained weight {name!r}; "
                             f"it holds {sorted(ckpt.trainable)}")
        out[name] = ckpt.trainable[name]
    for w, d in opt.items():
        for key in d:
            name = key if w == SHARED else f"{key}_{w}"
            if key in COUNTERS:
                out[name] = np.full_like(current[name], group.step + 1)
                continue
            saved = group.states.get(w, {}).get(MOMENTS.get(key, key))
            if saved is None:
                raise ValueError(f"the checkpoint has no optimizer state {MOMENTS.get(key, key)!r} for {w!r}")
            out[name] = saved
    for name in current:
        if name not in out:
            if name not in ckpt.frozen:
                raise ValueError(f"the checkpoint has no value for {name!r}")
            out[name] = ckpt.frozen[name]
    return out


def checkpoint_weights(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """Every parameter value a checkpoint holds (trained and frozen), for an inference model."""
    return {**ckpt.frozen, **ckpt.trainable}

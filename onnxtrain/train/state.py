"""The legacy session's state in onnxtrain's checkpoint format, and back.

* trained weights → ``trainable``; every other initializer of the model (BatchNormalization
  running statistics, frozen weights, constants) → ``frozen``; under mixed precision the weights' half
  twins (``<w>_fp16``) are left out: they are derived from the float32 masters (the session recomputes
  them), and onnxruntime-training cannot load float16 parameters;
* Adam/Lamb ``Moment_1``/``Moment_2`` → ``momentum0``/``momentum1`` of one optimizer group, whose
  ``step`` is the number of updates done (the session's ``Update_Count``/``Step`` minus one);
* the trainer's run state (step, epoch, data position, data-order RNG state, …) → ``properties``.

Both directions work on the *unpartitioned* state (``TrainingSession.gather_state()``), so a
checkpoint written under ZeRO stage 1, by a pipeline stage or by a horizontally split rank holds the whole
model's weights and optimizer state, under one process's names, and loads anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup
from onnxtrain.parallel import Communicator
from onnxtrain.session import TrainingSession

MOMENTS = {"Moment_1": "momentum0", "Moment_2": "momentum1"}
COUNTERS = ("Update_Count", "Step")  # 1 before the first update
SHARED = "shared_optimizer_state"
GROUP = "group0"  # the optimizer group a checkpoint's readers take

# weight (or SHARED) → the keys of its optimizer state, over the whole model
OptimizerLayout = dict[str, list[str]]


class OptimizerStateMismatch(ValueError):
    """A checkpoint without the optimizer state (group, moment) this run's optimizer keeps: written by a run
    of another optimizer."""


def trainable_names(sess: TrainingSession) -> list[str]:
    """The trained weights of the whole model: a pipeline stage's or a horizontally split rank's session names
    every stage's whole weights (its ``get_model_state()`` holds its own, a split rank's under its shares'
    names)."""
    whole = getattr(sess, "model_trained_weights", None)
    return whole() if whole is not None else list(sess.get_model_state()["full_precision"])


def optimizer_layout(sess: TrainingSession, comm: Communicator | None = None) -> OptimizerLayout:
    """Which optimizer state each weight has. Under ZeRO stage 1 a rank holds the state of its own
    weights only: with ``comm`` (a collective: every rank calls it) the ranks' parts are merged. Weights go
    by the whole model's names (a horizontally split rank's shares by their weights')."""
    model_name = getattr(sess, "_original", None)  # a horizontally split rank: share → its weight
    mine = {model_name(w) if model_name else w: sorted(d) for w, d in sess.get_optimizer_state().items()}
    if comm is None or comm.size == 1:
        return mine
    merged: OptimizerLayout = {}
    for part in comm.allgather_object(mine, "exchanging the optimizer state layout"):
        for w, keys in part.items():
            merged.setdefault(w, keys)
    return merged


def half_twins(sess: TrainingSession) -> set[str]:
    """Names of the session's half twins of trained weights under mixed precision (``<w>_fp16``): state
    that ``get_state`` derives from the float32 masters and ``load_state`` skips."""
    whole = getattr(sess, "model_trained_weights", None)
    if whole is not None:  # a stage or a split rank: every stage's whole twins, as gather_state() has them
        twins = (sess._twin_of(w) for w in whole())
        return {t for t in twins if t is not None}
    return set(getattr(sess, "_twin_masters", dict)())  # the session's own record of its twins


def state_name(weight: str, key: str) -> str:
    """The session's (unpartitioned) store name of optimizer state ``key`` of ``weight``."""
    return key if weight == SHARED else f"{key}_{weight}"


def layout_state_names(layout: OptimizerLayout) -> set[str]:
    """Store names of the optimizer state of ``layout`` (``Moment_1_<w>``, ``Step``, …)."""
    return {state_name(w, k) for w, keys in layout.items() for k in keys}


def optimizer_state_names(sess: TrainingSession) -> set[str]:
    """Store names of the session's optimizer state (``Moment_1_<w>``, ``Step``, …)."""
    return layout_state_names(optimizer_layout(sess))


def session_to_checkpoint(sess: TrainingSession, model: onnx.ModelProto, initial_lr: float, steps_done: int,
                          properties: Mapping[str, int | float | str],
                          state: Mapping[str, np.ndarray] | None = None,
                          layout: OptimizerLayout | None = None) -> Checkpoint:
    """A checkpoint of ``sess`` (trained from ``model``) after ``steps_done`` optimizer steps.

    Under ZeRO stage 1 pass the unpartitioned ``state`` (``sess.gather_state()``) and the merged
    ``layout`` (``optimizer_layout(sess, comm)``); by default both are this session's own.
    """
    state = sess.get_state() if state is None else state
    layout = optimizer_layout(sess) if layout is None else layout
    trained = trainable_names(sess)
    opt_names = layout_state_names(layout)
    derived = half_twins(sess)
    frozen = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.name not in trained}
    for name, v in state.items():  # BatchNormalization running statistics: the session's current values
        if name not in trained and name not in opt_names and name not in derived:
            frozen[name] = v
    group = optimizer_group(state, layout, initial_lr, steps_done)
    return Checkpoint(trainable={w: state[w] for w in trained}, frozen=frozen, optimizer_groups=[group],
                      properties=dict(properties))


def optimizer_group(state: Mapping[str, np.ndarray], layout: OptimizerLayout, initial_lr: float,
                    steps_done: int, name: str = GROUP) -> OptimizerGroup:
    """The optimizer group ``name`` of a session's (unpartitioned) ``state``: its moments by ``layout``, and
    the updates done (the step counters less one; ``steps_done`` for SGD, which keeps none)."""
    counts = {int(state[state_name(w, k)].reshape(-1)[0]) for w, keys in layout.items() for k in keys
              if k in COUNTERS}
    if len(counts) > 1:
        raise ValueError(f"optimizer step counters disagree across weights: {sorted(counts)}")
    step = counts.pop() - 1 if counts else steps_done
    states: dict[str, dict[str, np.ndarray]] = {}
    for w, keys in layout.items():
        if w == SHARED:
            continue
        states[w] = {MOMENTS.get(k, k): state[state_name(w, k)] for k in keys if k not in COUNTERS}
    return OptimizerGroup(name=name, step=step, initial_lr=float(initial_lr), states=states)


def checkpoint_to_state(ckpt: Checkpoint, sess: TrainingSession,
                        current: Mapping[str, np.ndarray] | None = None,
                        layout: OptimizerLayout | None = None,
                        group_name: str | None = None) -> dict[str, np.ndarray]:
    """The ``load_state`` dict that puts ``ckpt`` back into ``sess`` (every state tensor, checked).

    Under ZeRO stage 1 pass the unpartitioned ``current`` state and merged ``layout`` as above. The
    optimizer state comes from the group named ``group_name``, by default ``group0`` (or the first).
    """
    current = sess.get_state() if current is None else current
    layout = optimizer_layout(sess) if layout is None else layout
    trained = trainable_names(sess)
    if not ckpt.optimizer_groups:
        raise ValueError("the checkpoint has no optimizer group")
    named = [g for g in ckpt.optimizer_groups if g.name == (group_name or GROUP)]
    if group_name is not None and not named:
        raise OptimizerStateMismatch(f"the checkpoint has no optimizer group {group_name!r}; it holds "
                         f"{[g.name for g in ckpt.optimizer_groups]}")
    group = named[0] if named else ckpt.optimizer_groups[0]
    out: dict[str, np.ndarray] = {}
    derived = half_twins(sess)  # recomputed by the session from the masters: never loaded
    for name in trained:
        if name not in ckpt.trainable:
            raise ValueError(f"the checkpoint has no trained weight {name!r}; "
                             f"it holds {sorted(ckpt.trainable)}")
        out[name] = ckpt.trainable[name]
    for w, keys in layout.items():
        for key in keys:
            name = state_name(w, key)
            if key in COUNTERS:
                out[name] = np.full_like(current[name], group.step + 1)
                continue
            saved = group.states.get(w, {}).get(MOMENTS.get(key, key))
            if saved is None:
                moment = MOMENTS.get(key, key)
                raise OptimizerStateMismatch(f"the checkpoint has no optimizer state {moment!r} for {w!r}")
            out[name] = saved
    for name in current:
        if name not in out and name not in derived:
            if name not in ckpt.frozen:
                raise ValueError(f"the checkpoint has no value for {name!r}")
            out[name] = ckpt.frozen[name]
    return out


def rank_group_name(rank: int) -> str:
    """The optimizer group that holds rank ``rank``'s own optimizer state under Adasum (rank 0's is the
    first group, ``group0``, which every other reader of the checkpoint takes)."""
    return f"{GROUP}_rank{rank}"


def optimizer_moments(state: Mapping[str, np.ndarray], layout: OptimizerLayout) -> dict[str, np.ndarray]:
    """The optimizer state tensors of ``state`` (moments, not the step counters), by store name."""
    return {state_name(w, k): state[state_name(w, k)] for w, keys in layout.items() for k in keys
            if k not in COUNTERS}


def checkpoint_weights(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    """Every parameter value a checkpoint holds (trained and frozen), for an inference model."""
    return {**ckpt.frozen, **ckpt.trainable}

"""Review J: CheckpointState load/save round trips against onnxruntime-training 1.19.2 (tests/ortt.py).

A state loaded from a file and saved again with its optimizer state keeps what onnxruntime-training keeps:
every optimizer group of the file (onnxruntime's Optimizer trains ``group0`` only, but its state holds and
saves the others as read), with their step, initial learning rate and moments.
"""

from __future__ import annotations

import textwrap

import numpy as np
import pytest

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup, load_checkpoint, save_checkpoint
from onnxtrain.training.api import CheckpointState
from onnxtrain.training.api.checkpoint_state import LEARNING_RATE_PROPERTY
from tests.checkpoint.test_checkpoint import _array, _same
from tests.ortt import PREAMBLE, ensure_ortt, run_script

# Loads each file with onnxruntime-training's CheckpointState and saves it to <file>.ort, with or without
# its optimizer state.
_RESAVE = PREAMBLE + textwrap.dedent("""
    from onnxruntime.training.api import CheckpointState
    for path in sys.argv[1:]:
        state = CheckpointState.load_checkpoint(path)
        for include in (True, False):
            CheckpointState.save_checkpoint(state, f"{path}.ort.{int(include)}", include)
    print(json.dumps("ok"))
""")


def _moments(seed: int) -> dict[str, dict[str, np.ndarray]]:
    return {"w": {"momentum0": _array(1, (2, 3), seed), "momentum1": _array(1, (2, 3), seed + 1)},
            "b": {"momentum0": _array(1, (3,), seed + 2), "momentum1": _array(1, (3,), seed + 3)}}


def _groups(ckpt: Checkpoint) -> list[tuple[str, int, float, dict[str, dict[str, object]]]]:
    def saved(a: np.ndarray) -> object:
        return str(a.dtype), a.shape, a.tobytes()

    return [(g.name, g.step, g.initial_lr,
             {p: {m: saved(a) for m, a in ms.items()} for p, ms in g.states.items()})
            for g in ckpt.optimizer_groups]


@pytest.mark.slow
@pytest.mark.parametrize("names", [("group0", "aux"), ("aux",), ("group0", "group1", "zz")])
def test_every_optimizer_group_survives_a_load_and_save(tmp_path, names):
    """onnxtrain kept only group ``group0`` of a loaded file: a load and save with
    ``include_optimizer_state=True`` silently dropped the other groups (their step, learning rate and
    moments), which onnxruntime-training 1.19.2 writes back as it read them."""
    ensure_ortt()
    params = {"w": _array(1, (2, 3)), "b": _array(1, (3,), 1)}
    groups = [OptimizerGroup(n, 7 + i, 0.0125 * (i + 1), _moments(10 * i)) for i, n in enumerate(names)]
    src = str(tmp_path / "src")
    save_checkpoint(Checkpoint(params, {"f": _array(7, (2,))}, groups, {"epoch": 2}), src)
    run_script(_RESAVE, src)
    state = CheckpointState.load_checkpoint(src)
    for include in (True, False):
        ours = str(tmp_path / f"ours.{int(include)}")
        CheckpointState.save_checkpoint(state, ours, include_optimizer_state=include)
        want, got = load_checkpoint(f"{src}.ort.{int(include)}"), load_checkpoint(ours)
        assert _groups(got) == _groups(want), include
        assert all(_same(got.trainable[n], a) for n, a in want.trainable.items())
        got.properties.pop(LEARNING_RATE_PROPERTY, None)  # onnxtrain's current rate, with group0
        assert got.properties == want.properties
    assert [g.name for g in load_checkpoint(f"{src}.ort.1").optimizer_groups] == sorted(names)

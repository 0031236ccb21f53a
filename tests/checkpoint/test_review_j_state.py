"""Review J: CheckpointState load/save round trips against onnxruntime-training 1.19.2 (tests/ortt.py).

A state loaded from a file and saved again with its optimizer state keeps what onnxruntime-training keeps:
every optimizer group of the file (onnxruntime's Optimizer trains ``group0`` only, but its state holds and
saves the others as read), with their step, initial learning rate and moments. A save past the number of
FlatBuffers tables onnxruntime-training's verifier takes (a million) warns that it cannot load the file.
"""

from __future__ import annotations

import textwrap
import warnings

import numpy as np
import pytest

from onnxtrain.checkpoint import (
    Checkpoint,
    OptimizerGroup,
    checkpoint_to_bytes,
    load_checkpoint,
    save_checkpoint,
)
from onnxtrain.training.api import CheckpointState
from onnxtrain.training.api.checkpoint_state import LEARNING_RATE_PROPERTY
from tests.checkpoint.test_checkpoint import _array, _same, fbs  # noqa: F401 (a fixture)
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


# ---------------------------------------------------------------- onnxruntime-training's table limit

def _walked_tables(fbs, data: bytes) -> int:  # noqa: F811
    """The tables of a checkpoint file, counted by walking it with onnxruntime's generated readers."""
    root = fbs.CheckpointFb.Checkpoint.GetRootAs(data, 0)
    count = 1
    module = root.ModuleState()
    if module is not None:
        count += 1 + module.RequiresGradParamsLength() + module.FrozenParamsLength()
    for i in range(root.OptimizerGroupsLength()):
        group = root.OptimizerGroups(i)
        count += 1
        for j in range(group.OptimizerStatesLength()):
            count += 1 + group.OptimizerStates(j).MomentumsLength()
    bag = root.PropertyBag()
    if bag is not None:
        count += 1 + bag.IntsLength() + bag.FloatsLength() + bag.StringsLength()
    return count


_CASES = {
    "parameters": lambda: Checkpoint({"w": _array(1, (2, 3)), "b": _array(1, (3,))}, {"f": _array(7, (2,))}),
    "everything": lambda: Checkpoint({"w": _array(1, (2, 3)), "b": _array(1, (3,), 1)},
                                     {"f": _array(7, (2,))},
                                     [OptimizerGroup("group0", 3, 0.1, _moments(0)),
                                      OptimizerGroup("aux", 1, 0.2, {"w": {"m": _array(1, (2, 3), 9)}})],
                                     {"epoch": 2, "loss": 0.5, "tag": "x"}),
    "empty": lambda: Checkpoint(),
    "nominal": lambda: Checkpoint({"w": _array(1, (2, 3))}, {"f": _array(7, (2,))}, properties={"a": 1},
                                  nominal=True),
}


@pytest.mark.parametrize("case", list(_CASES))
@pytest.mark.parametrize("threshold", [10**9, 0])
def test_a_save_past_onnxruntime_trainings_table_limit_warns(fbs, tmp_path, monkeypatch, case,  # noqa: F811
                                                             threshold):
    """onnxruntime-training refuses a checkpoint of more than ORT_MAX_TABLES FlatBuffers tables (see the slow
    test below); onnxtrain wrote one without a word. The count the save checks is that of the file written
    (walked with onnxruntime's generated readers, .data token property included), and the save warns, naming
    the file, exactly past the limit."""
    from onnxtrain.checkpoint import format as fmt

    path = str(tmp_path / "c")
    save_checkpoint(_CASES[case](), path, external_threshold=threshold)
    with open(path, "rb") as f:
        tables = _walked_tables(fbs, f.read())
    monkeypatch.setattr(fmt, "ORT_MAX_TABLES", tables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_checkpoint(_CASES[case](), path, external_threshold=threshold)
    monkeypatch.setattr(fmt, "ORT_MAX_TABLES", tables - 1)
    with pytest.warns(UserWarning, match=f"{path} is written as {tables} FlatBuffers tables.*refuses"):
        save_checkpoint(_CASES[case](), path, external_threshold=threshold)
    if threshold:
        with pytest.warns(UserWarning, match=f"the checkpoint is written as {tables} FlatBuffers tables"):
            checkpoint_to_bytes(_CASES[case]())


_LOADS = PREAMBLE + textwrap.dedent("""
    from onnxruntime.capi import _pybind_state as C
    out = []
    for path in sys.argv[1:]:
        try:
            out.append(len(C.load_checkpoint(path).property_names()))
        except Exception as e:
            out.append(str(e)[-60:])
    print(json.dumps(out))
""")


@pytest.mark.slow
@pytest.mark.extended  # about 45 s: the full suite only (ONNXTRAIN_FULL_TESTS=1)
def test_onnxruntime_training_loads_a_million_tables_and_refuses_one_more(tmp_path):
    """The limit itself, with onnxruntime-training 1.19.2 as the oracle: a file of ORT_MAX_TABLES tables (the
    root, module state, one parameter, property bag and properties) loads there, one more property is
    refused; onnxtrain warns for the second save only, and loads both. (About a minute: two 20 MB files.)"""
    from onnxtrain.checkpoint import format as fmt

    ensure_ortt()
    props = {f"p{i}": i for i in range(fmt.ORT_MAX_TABLES - 4)}
    at, past = str(tmp_path / "at"), str(tmp_path / "past")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        save_checkpoint(Checkpoint({"w": np.ones(2, np.float32)}, properties=props), at)
    props["one more"] = -1
    with pytest.warns(UserWarning, match="1000001 FlatBuffers tables"):
        save_checkpoint(Checkpoint({"w": np.ones(2, np.float32)}, properties=props), past)
    loaded = run_script(_LOADS, at, past)
    assert loaded[0] == len(props) - 1
    assert "Checkpoint verification failed" in loaded[1]
    assert len(load_checkpoint(past).properties) == len(props)


# ---------------------------------------------------------------- optimizer state saved, resumed

# Generates artifacts (onnxruntime-training's own) for tests/ortt.py's MLP with fc2.bias frozen, trains two
# steps (lr 0.05) and saves with and without the optimizer state; then, for each situation, saves a state
# to <folder>/<case>.ort: a) fresh, no Optimizer, b) an Optimizer before any step, c) loaded with optimizer
# state and only a Module, d) loaded with it, saved without, e) loaded with it, Module and Optimizer; and
# continues training from <folder>/ours (onnxtrain's save) two steps, to <folder>/ours.ort.
_OPT_SCRIPT = PREAMBLE + textwrap.dedent("""
    import os
    import numpy as np
    from onnxruntime.training import artifacts
    from onnxruntime.training.api import CheckpointState, Module, Optimizer
    folder, kind, stage = sys.argv[1], sys.argv[2], sys.argv[3]
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    def train(ckpt, steps):
        state = CheckpointState.load_checkpoint(ckpt)
        m = Module(folder + "/training_model.onnx", state)
        o = Optimizer(folder + "/optimizer_model.onnx", m)
        o.set_learning_rate(0.05)
        for _ in range(steps):
            m(x, y); o.step(); m.lazy_reset_grad()
        return state
    if stage == "generate":
        artifacts.generate_artifacts(onnx.load(folder + "/model.onnx"),
                                     requires_grad=["fc1.weight", "fc1.bias", "fc2.weight"],
                                     frozen_params=["fc2.bias"], loss=artifacts.LossType.MSELoss,
                                     optimizer=getattr(artifacts.OptimType, kind), artifact_directory=folder)
        state = train(folder + "/checkpoint", 2)
        CheckpointState.save_checkpoint(state, folder + "/with_opt", True)
        for case in "abcde":
            src = folder + ("/with_opt" if case in "cde" else "/checkpoint")
            state = CheckpointState.load_checkpoint(src)
            if case in "bce":
                m = Module(folder + "/training_model.onnx", state)
            if case in "be":
                Optimizer(folder + "/optimizer_model.onnx", m)
            CheckpointState.save_checkpoint(state, f"{folder}/{case}.ort", case != "d")
    else:
        CheckpointState.save_checkpoint(train(folder + "/ours", 2), folder + "/ours.ort", True)
    print(json.dumps("ok"))
""")


def _train_ours(folder: str, ckpt: str, steps: int) -> CheckpointState:
    from onnxtrain.training.api import Module, Optimizer

    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    state = CheckpointState.load_checkpoint(ckpt)
    m = Module(f"{folder}/training_model.onnx", state)
    o = Optimizer(f"{folder}/optimizer_model.onnx", m)
    o.set_learning_rate(0.05)
    for _ in range(steps):
        m(x, y)
        o.step()
        m.lazy_reset_grad()
    return state


def _close(got: Checkpoint, want: Checkpoint) -> None:
    assert list(got.trainable) == list(want.trainable) and list(got.frozen) == list(want.frozen)
    for name, arr in {**want.trainable, **want.frozen}.items():
        np.testing.assert_allclose({**got.trainable, **got.frozen}[name], arr, rtol=1e-5, atol=1e-6)
    assert [(g.name, g.step, g.initial_lr) for g in got.optimizer_groups] == \
        [(g.name, g.step, g.initial_lr) for g in want.optimizer_groups]
    for g, h in zip(got.optimizer_groups, want.optimizer_groups):
        assert {p: sorted(m) for p, m in g.states.items()} == {p: sorted(m) for p, m in h.states.items()}
        for p, moments in h.states.items():
            for k, arr in moments.items():
                np.testing.assert_allclose(g.states[p][k], arr, rtol=1e-5, atol=1e-7, err_msg=f"{p} {k}")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["AdamW", "SGD"])
def test_optimizer_state_is_saved_and_resumed_as_onnxruntime_training_does(tmp_path, kind):
    """Against onnxruntime-training 1.19.2, on its own artifacts: which optimizer state a save writes (none
    without an Optimizer or a loaded one; step 0 and zero moments for a new Optimizer; the loaded step,
    learning rate and moments kept through a Module alone; nothing with include_optimizer_state=False), and
    training resumed from each other's files (two more steps) ends on the same parameters and moments."""
    from tests.ortt import small_mlp

    python = ensure_ortt()
    folder = str(tmp_path)
    import onnx

    onnx.save(small_mlp(), f"{folder}/model.onnx")
    run_script(_OPT_SCRIPT, folder, kind, "generate", python=python)
    from onnxtrain.training.api import Module, Optimizer

    for case in "abcde":
        state = CheckpointState.load_checkpoint(f"{folder}/{'with_opt' if case in 'cde' else 'checkpoint'}")
        if case in "bce":
            module = Module(f"{folder}/training_model.onnx", state)
        if case in "be":
            Optimizer(f"{folder}/optimizer_model.onnx", module)
        CheckpointState.save_checkpoint(state, f"{folder}/{case}.ours", include_optimizer_state=case != "d")
        _close(load_checkpoint(f"{folder}/{case}.ours"), load_checkpoint(f"{folder}/{case}.ort"))
    assert load_checkpoint(f"{folder}/c.ort").optimizer_groups[0].step == 2
    assert not load_checkpoint(f"{folder}/a.ort").optimizer_groups

    # onnxtrain resumes onnxruntime's file, onnxruntime resumes onnxtrain's, both for two steps
    CheckpointState.save_checkpoint(_train_ours(folder, f"{folder}/with_opt", 2), f"{folder}/ours",
                                    include_optimizer_state=True)
    run_script(_OPT_SCRIPT, folder, kind, "resume", python=python)
    CheckpointState.save_checkpoint(_train_ours(folder, f"{folder}/ours", 2), f"{folder}/ours.ours",
                                    include_optimizer_state=True)
    theirs, ours = load_checkpoint(f"{folder}/ours.ort"), load_checkpoint(f"{folder}/ours.ours")
    assert theirs.optimizer_groups[0].step == 6
    theirs.properties.pop(LEARNING_RATE_PROPERTY, None)
    ours.properties.pop(LEARNING_RATE_PROPERTY, None)
    _close(ours, theirs)

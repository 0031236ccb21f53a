"""A commit of several files killed (SIGKILL) at any point is put back whole by recover_commits.

The kills are real: the commit runs in a forked child that sends itself SIGKILL just before its k-th call
of a file-system function (open, write, fsync, link, symlink, replace, rename, unlink, close), for every k
until one commit runs to its end. After each kill, recover_commits (itself killed at every point of its
own, then run again) must leave the targets all old or all new, byte for byte, with no journal or backup
left: old while the journal is there, new once the commit has deleted it.
"""

from __future__ import annotations

import errno
import json
import os
import pathlib
import signal
import subprocess
import sys
import traceback
import warnings
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxtrain.ir.io import StagedFiles, recover_commits, stage_model, write_atomic
from onnxtrain.train.outputs import remove_stale_temporaries

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="kills a forked child")

HOOKED = ("open", "write", "fsync", "link", "symlink", "replace", "rename", "unlink", "close")
KillAt = int | Callable[[str, tuple], bool] | None


def _killed(fn: Callable[[], object], kill_at: KillAt) -> bool:
    """Run ``fn()`` in a forked child that SIGKILLs itself just before its ``kill_at``-th call of one of
    :data:`HOOKED` (or the first call for which ``kill_at(name, args)`` holds); whether it was killed (it
    must otherwise end well)."""
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            count = [0]
            for name in HOOKED:
                real = getattr(os, name)

                def hook(*args, _real=real, _name=name, **kwargs):
                    count[0] += 1
                    if count[0] == kill_at if isinstance(kill_at, int) else kill_at and kill_at(_name, args):
                        os.kill(os.getpid(), signal.SIGKILL)
                    return _real(*args, **kwargs)

                setattr(os, name, hook)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        assert os.WTERMSIG(status) == signal.SIGKILL
        return True
    assert os.WEXITSTATUS(status) == 0, "the child failed (its traceback is in the captured stderr)"
    return False


def _state(folder, names) -> dict[str, object]:
    """What each of ``names`` is in ``folder``: ("link", its target), ("file", its bytes) or None."""
    out: dict[str, object] = {}
    for n in names:
        p = os.path.join(folder, n)
        if os.path.islink(p):
            out[n] = ("link", os.readlink(p))
        elif os.path.isfile(p):
            with open(p, "rb") as f:
                out[n] = ("file", f.read())
        else:
            out[n] = None
    return out


def _commit_files(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith((".journal.tmp", ".old.tmp")))


def _journal_of_kill(folder) -> bool:
    return any(f.endswith(".journal.tmp") for f in os.listdir(folder))


# A two-file commit (a checkpoint's .data then its main file, both there before) and a three-file one:
# a file replaced, a file that is new, and a symlink replaced by a file.
SCENARIOS = {
    "two": ({"w.data": b"old data " * 50, "w": b"old main"},
            [("w.data", b"new data " * 70), ("w", b"new main")]),
    "three": ({"a": b"old a", "c": "real_c"}, [("a", b"new a" * 9), ("b", b"new b"), ("c", b"new c")]),
}


def _prepare(folder, name: str) -> tuple[StagedFiles, dict, dict]:
    """``folder`` with the scenario's old files, and its new ones staged (not committed); (files, the old
    state, the new state) of the targets."""
    olds, news = SCENARIOS[name]
    os.makedirs(folder)
    with open(os.path.join(folder, "real_c"), "w") as f:
        f.write("the target of the symlink c")
    for n, v in olds.items():
        if isinstance(v, str):
            os.symlink(v, os.path.join(folder, n))
        else:
            with open(os.path.join(folder, n), "wb") as f:
                f.write(v)
    names = [n for n, _ in news]
    old = _state(folder, names)
    files = StagedFiles()
    for n, data in news:
        files.write(os.path.join(folder, n), lambda f, d=data: f.write(d))
    new = {n: ("file", data) for n, data in news}
    return files, old, new


def _check_recovered(folder, old, new, want: dict | None) -> str:
    """After recover_commits: the targets all old or all new (``want`` when given), no journal or backup,
    and only plain temporaries besides; a second recovery does nothing. "old" or "new"."""
    now = _state(folder, list(new))
    assert now == want if want is not None else now in (old, new)
    assert _commit_files(folder) == []
    extra = set(os.listdir(folder)) - set(new) - {"real_c"}
    assert all(f.endswith(".tmp") for f in extra), extra
    assert not recover_commits(folder)
    assert _state(folder, list(new)) == now
    return "old" if now == old else "new"


@pytest.mark.parametrize("links", [True, False], ids=["hard_links", "no_hard_links"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_commit_killed_at_any_point_is_recovered_whole(name, links, tmp_path, monkeypatch):
    """Kill the commit before each of its file-system calls in turn: recover_commits leaves the old set
    (the journal was there and a rename had not landed) or the new one (every rename had landed: the
    commit stands, even with its journal left), byte for byte; the outcomes go old ... old, new ... new,
    and the kills between two renames left a mix that recovery undid."""
    if not links:  # backups are then copies, flushed to disk
        def refuse(*args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", refuse)
    outcomes, mixed, stood = [], 0, 0
    for k in range(1, 200):
        folder = str(tmp_path / f"k{k}")
        files, old, new = _prepare(folder, name)
        killed = _killed(files.commit, k)
        now = _state(folder, list(new))
        if now not in (old, new):
            mixed += 1
        journal = _journal_of_kill(folder)
        stood += journal and now == new
        done = recover_commits(folder)
        if journal and now != new:
            assert set(done.put_back) >= {os.path.join(folder, n) for n in new if now[n] != old[n]}
        if now == new:
            assert not done.put_back
        outcomes.append(_check_recovered(folder, old, new, old if journal and now != new
                                         else new if journal else None))
        if not killed:
            break
    else:
        pytest.fail("the commit never finished")
    assert outcomes[-1] == "new" and outcomes[0] == "old"
    assert outcomes == sorted(outcomes, key=lambda o: o == "new"), outcomes
    assert mixed >= len(new) - 1, "no kill fell between two renames"
    assert stood >= 1, "no kill fell between the last rename and the journal's deletion"


def _in_a_small_process(fn: Callable[..., object], *args: object) -> None:
    """``fn(*args)`` (a function of this module) in a new Python process that imports only this module: its
    hundreds of forks cost several times less than forks of a test worker holding torch and the rest of the
    suite (the double kills below: 53 s of test time in the suite, 13 s this way)."""
    code = (f"import sys; sys.path.insert(0, {REPO!r})\n"
            f"from tests.ir.test_commit_journal import {fn.__name__}\n{fn.__name__}(*{args!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_recovery_killed_at_any_point_is_finished_by_the_next(name, tmp_path):
    """For every kill of the commit that leaves a journal, kill recover_commits before each of its own
    file-system calls in turn: the next recover_commits still puts the old set back whole."""
    _in_a_small_process(_recovery_killed_at_any_point, name, str(tmp_path))


def _recovery_killed_at_any_point(name: str, root: str) -> None:
    tmp_path = pathlib.Path(root)
    pairs = 0
    for k in range(1, 200):
        folder = str(tmp_path / f"probe{k}")
        files, old, new = _prepare(folder, name)
        if not _killed(files.commit, k):
            break
        if not _journal_of_kill(folder):
            continue
        for j in range(1, 100):
            folder = str(tmp_path / f"k{k}_j{j}")
            files, old, new = _prepare(folder, name)
            assert _killed(files.commit, k)
            stands = _state(folder, list(new)) == new  # every rename landed before the kill
            killed = _killed(lambda f=folder: recover_commits(f), j)
            pairs += 1
            if killed:
                recover_commits(folder)
            _check_recovered(folder, old, new, new if stands else old)
            if not killed:
                break
    assert pairs > 10


def _ckpt(seed: int) -> Checkpoint:
    rng = np.random.default_rng(seed)
    return Checkpoint(trainable={"w": rng.standard_normal((16, 8)).astype(np.float32),
                                 "b": rng.standard_normal(8).astype(np.float32)},
                      frozen={"e": rng.integers(0, 9, (4, 4)).astype(np.int64)},
                      properties={"step": seed})


def _arrays(ckpt: Checkpoint) -> dict[str, np.ndarray]:
    return {**ckpt.trainable, **ckpt.frozen}


def _same(a: Checkpoint, b: Checkpoint) -> bool:
    x, y = _arrays(a), _arrays(b)
    return x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k]) for k in x)


def test_load_checkpoint_puts_back_the_pair_of_a_killed_save(tmp_path):
    """save_checkpoint(path) with every tensor in ``path.data``, killed at every point: load_checkpoint
    gives the old state's arrays exactly while a rename had not landed (with a warning naming the files
    it put back, when they were mixed), the new state's once both had (even with the journal left)."""
    old, new = _ckpt(1), _ckpt(2)
    seen = set()
    for k in range(1, 200):
        folder = tmp_path / f"k{k}"
        folder.mkdir()
        path = str(folder / "ckpt")
        save_checkpoint(old, path, external_threshold=0)
        assert sorted(os.listdir(folder)) == ["ckpt", "ckpt.data"]
        before = _state(folder, ["ckpt", "ckpt.data"])
        killed = _killed(lambda p=path: save_checkpoint(new, p, external_threshold=0), k)
        journal = _journal_of_kill(folder)
        now = _state(folder, ["ckpt", "ckpt.data"])
        stood = journal and all(now[n] != before[n] for n in now)  # both renames landed: the save stands
        mixed = now["ckpt.data"] != before["ckpt.data"] and journal and not stood
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = load_checkpoint(path)
        put_back = [str(w.message) for w in caught if "killed part way" in str(w.message)]
        if stood:
            seen.add("stood")
            assert _same(loaded, new) and not put_back
            assert _state(folder, ["ckpt", "ckpt.data"]) == now
        elif journal:
            assert _same(loaded, old)
            assert _state(folder, ["ckpt", "ckpt.data"]) == before
        else:
            assert _same(loaded, old) or _same(loaded, new)
        if mixed:
            seen.add("mixed")
            assert len(put_back) == 1 and f"{path}.data" in put_back[0], put_back
        assert _commit_files(folder) == []
        if not killed:
            assert _same(loaded, new)
            break
    assert seen == {"mixed", "stood"}


def test_load_checkpoint_that_cannot_put_back_a_killed_save_says_why(tmp_path, monkeypatch):
    """A save killed between its renames, in a folder the loader cannot write (a read-only copy, another
    user's run): load_checkpoint refuses the mixed pair with an error that says a save was killed and that
    its files could not be put back, naming the checkpoint, not a bare PermissionError on a backup."""
    path = str(tmp_path / "ckpt")
    save_checkpoint(_ckpt(1), path, external_threshold=0)
    assert _killed(lambda: save_checkpoint(_ckpt(2), path, external_threshold=0),
                   _kill_after_first_rename(path + ".data"))
    before = _snapshot(tmp_path)

    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", args[0])

    monkeypatch.setattr(os, "replace", refused)
    monkeypatch.setattr(os, "unlink", refused)
    with pytest.raises(PermissionError, match=r"a save of checkpoint .*ckpt was killed part way.*cannot be "
                                              r"put back") as e:
        load_checkpoint(path)
    assert path in str(e.value)
    monkeypatch.undo()
    assert _snapshot(tmp_path) == before  # nothing touched
    with pytest.warns(UserWarning, match="killed part way"):
        assert _same(load_checkpoint(path), _ckpt(1))


def test_symlinked_pair_killed_before_any_rename_is_not_reported_as_put_back(tmp_path):
    """A checkpoint and its data that are symlinks (a save writes through them, into the folder of the
    files they point to), a save killed after its backups but before its first rename: nothing was
    replaced, so load_checkpoint loads the old pair without the warning that the files were mismatched and
    put back, and the links are left as they were."""
    (tmp_path / "store").mkdir()
    save_checkpoint(_ckpt(1), str(tmp_path / "store" / "real"), external_threshold=0)
    path = str(tmp_path / "ckpt")
    os.symlink(os.path.join("store", "real"), path)
    os.symlink(os.path.join("store", "real.data"), path + ".data")
    links = [os.lstat(p).st_ino for p in (path, path + ".data")]

    def first_rename(name: str, args: tuple) -> bool:
        if name != "replace":
            return False
        source = os.path.basename(os.fspath(args[0]))  # (not a journal's, nor a temporary's naming)
        return ".journal." not in source and not source.endswith(".onnxtrain.new")

    assert _killed(lambda: save_checkpoint(_ckpt(2), path, external_threshold=0), first_rename)
    assert _journal_of_kill(tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _same(load_checkpoint(path), _ckpt(1))
    assert [os.lstat(p).st_ino for p in (path, path + ".data")] == links
    assert _commit_files(tmp_path / "store") == [] and _commit_files(tmp_path) == []
    save_checkpoint(_ckpt(2), path, external_threshold=0)  # not killed: through the links
    assert [os.lstat(p).st_ino for p in (path, path + ".data")] == links
    assert _same(load_checkpoint(path), _ckpt(2))
    assert _same(load_checkpoint(str(tmp_path / "store" / "real")), _ckpt(2))


def _kill_after_first_rename(target: str) -> Callable[[str, tuple], bool]:
    """Kill just after ``target`` was renamed onto (before the next file-system call)."""
    renamed = [False]

    def when(name: str, args: tuple) -> bool:
        if renamed[0]:
            return True
        renamed[0] = name == "replace" and os.fspath(args[1]) == target
        return False

    return when


def test_train_start_up_puts_back_a_checkpoint_pair_then_deletes_temporaries(tmp_path, capsys):
    """``onnxtrain train``'s start-up cleanup (remove_stale_temporaries) on a run folder whose checkpoint
    save was killed between its renames (new .data, old main file): the old pair is back (said on stderr)
    before the temporaries go, and the journal, the backups (also one of a commit that finished) and the
    temporaries are deleted and returned."""
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    path = str(ckpts / "step_00000004.ckpt")
    old, new = _ckpt(4), _ckpt(6)
    save_checkpoint(old, path, external_threshold=0)
    before = _snapshot(run)
    assert _killed(lambda: save_checkpoint(new, path, external_threshold=0),
                   _kill_after_first_rename(path + ".data"))
    assert _snapshot(run)[f"checkpoints{os.sep}step_00000004.ckpt.data"] != before[
        f"checkpoints{os.sep}step_00000004.ckpt.data"]  # mixed: new data, old main file
    leftovers = sorted(os.path.join(ckpts, f) for f in os.listdir(ckpts) if f.endswith(".tmp"))
    assert any(f.endswith(".journal.tmp") for f in leftovers)
    assert any(f.endswith(".old.tmp") for f in leftovers)
    orphan = str(ckpts / "step_00000002.ckpt.0123abcd.old.tmp")  # a backup of a commit that finished
    stray = str(run / "model.onnx.x1y2z3_w.onnxtrain.tmp")  # a temporary of a killed single write
    for f in (orphan, stray):
        with open(f, "wb") as fh:
            fh.write(b"leftover")
    capsys.readouterr()
    removed = remove_stale_temporaries(str(run))
    err = capsys.readouterr().err
    assert f"put back {path}.data" in err
    assert _snapshot(run) == before
    assert sorted(removed) == sorted([*(f for f in leftovers if not f.endswith(".old.tmp")), orphan, stray])
    assert _same(load_checkpoint(path), old)
    assert remove_stale_temporaries(str(run)) == []


def _snapshot(folder) -> dict[str, bytes]:
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            with open(os.path.join(root, f), "rb") as fh:
                out[os.path.relpath(os.path.join(root, f), folder)] = fh.read()
    return out


def test_a_journal_left_behind_never_undoes_a_later_save(tmp_path):
    """A save killed between its renames, then another save of the same files that runs to the end (no load
    or cleanup in between): the later save first puts back the killed one's files (a warning says so), so
    no journal is left to roll its own files back afterwards."""
    path = str(tmp_path / "ckpt")
    save_checkpoint(_ckpt(1), path, external_threshold=0)
    assert _killed(lambda: save_checkpoint(_ckpt(2), path, external_threshold=0),
                   _kill_after_first_rename(path + ".data"))
    with pytest.warns(UserWarning, match="killed part way"):
        save_checkpoint(_ckpt(3), path, external_threshold=0)
    assert _commit_files(tmp_path) == []
    assert not recover_commits(str(tmp_path))
    assert _same(load_checkpoint(path), _ckpt(3))


def test_a_commit_still_running_is_left_alone(tmp_path, monkeypatch):
    """recover_commits, the train start-up cleanup and load_checkpoint, while another process is between
    the renames of a save (its journal locked): nothing is put back or deleted, and the save then ends
    with the new files. A load of the pair as it stands (the new .data, the old main file) is refused, after
    its retries, as two saves' files (it loaded them mixed)."""
    from onnxtrain.checkpoint import format as fmt

    monkeypatch.setattr(fmt, "_TORN_RETRIES", 2)
    path = str(tmp_path / "ckpt")
    save_checkpoint(_ckpt(1), path, external_threshold=0)
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()

    def pause_after_data(name: str, args: tuple) -> bool:
        if name == "replace" and os.fspath(args[1]) == path:  # the .data file is in place: wait
            os.write(ready_w, b"1")
            os.read(go_r, 1)
        return False

    pid = os.fork()
    if pid == 0:
        os._exit(0 if not _killed(lambda: save_checkpoint(_ckpt(2), path, external_threshold=0),
                                  pause_after_data) else 1)
    try:
        assert os.read(ready_r, 1) == b"1"
        during = _snapshot(tmp_path)
        assert any(f.endswith(".journal.tmp") for f in during)
        assert not recover_commits(str(tmp_path))
        assert remove_stale_temporaries(str(tmp_path)) == []  # (as a run folder)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(ValueError, match="not the one saved with it"):  # nothing put back, no warning
                load_checkpoint(path)
        assert _snapshot(tmp_path) == during
    finally:
        os.write(go_w, b"1")
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert _commit_files(tmp_path) == []
    assert _same(load_checkpoint(path), _ckpt(2))


def test_an_unreadable_journal_is_reported_not_guessed(tmp_path):
    (tmp_path / "x").write_bytes(b"x")
    journal = tmp_path / "x.0123abcd.journal.tmp"
    journal.write_text(json.dumps({"format": "onnxtrain commit journal", "version": 1,
                                   "files": [{"target": "../x", "temporary": "t.tmp", "backup": None,
                                              "existed": False}]}))
    with pytest.raises(ValueError, match="not a readable onnxtrain commit journal"):
        recover_commits(str(tmp_path))
    assert (tmp_path / "x").read_bytes() == b"x" and journal.exists()



def test_an_unreadable_journal_does_not_hold_up_other_saves(tmp_path):
    """A commit (or load_checkpoint) recovers the journals of its own files: one it cannot read is left with
    a warning instead of failing every save in the folder; the full recovery still refuses it."""
    journal = tmp_path / "other.0123abcd.journal.tmp"
    journal.write_bytes(b"not json")
    with pytest.warns(UserWarning, match="not a readable onnxtrain commit journal"), StagedFiles() as files:
        files.write(str(tmp_path / "a"), lambda f: f.write(b"A"))
        files.write(str(tmp_path / "b"), lambda f: f.write(b"B"))
    assert (tmp_path / "a").read_bytes() == b"A" and (tmp_path / "b").read_bytes() == b"B"
    assert journal.exists()
    with pytest.raises(ValueError, match="not a readable onnxtrain commit journal"):
        recover_commits(str(tmp_path))


# ---- stage_model over a model whose tensors are already in the file it would write -----------------------

def _model_with_weights(folder, location: str):
    """A model saved in ``folder`` with its 4 KiB weight in ``location``, loaded back without its external
    data, plus a second inline weight of 4 KiB (so that a save with external data writes that file)."""
    w = numpy_helper.from_array(np.arange(1024, dtype=np.float32).reshape(32, 32), "w")
    node = helper.make_node("MatMul", ["x", "w"], ["y"])
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 32])], [w])
    m = helper.make_model(g)
    onnx.save_model(m, os.path.join(folder, "model.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location=location, size_threshold=0)
    lazy = onnx.load(os.path.join(folder, "model.onnx"), load_external_data=False)
    lazy.graph.initializer.append(numpy_helper.from_array(np.ones((32, 32), np.float32), "v"))
    return lazy


def test_stage_model_refuses_to_rewrite_the_file_holding_external_tensors(tmp_path):
    """A model loaded with load_external_data=False whose weight lives in ``model.onnx.data``: saving it
    to the same folder with external_data="model.onnx.data" would rewrite that file without the weight;
    a ValueError names the tensor and the file and says how to load the model, and nothing changes."""
    lazy = _model_with_weights(str(tmp_path), "model.onnx.data")
    before = _snapshot(tmp_path)
    refused = r"initializer 'w' .*model\.onnx\.data.*load_external_data_for_model"
    with pytest.raises(ValueError, match=refused), StagedFiles() as files:
        stage_model(files, lazy, str(tmp_path / "model.onnx"), external_data="model.onnx.data")
    assert _snapshot(tmp_path) == before
    # loaded whole it saves there, and loads back with both weights
    full = onnx.load(str(tmp_path / "model.onnx"))
    full.graph.initializer.append(numpy_helper.from_array(np.ones((32, 32), np.float32), "v"))
    with StagedFiles() as files:
        stage_model(files, full, str(tmp_path / "model.onnx"), external_data="model.onnx.data")
    again = onnx.load(str(tmp_path / "model.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in again.graph.initializer}
    np.testing.assert_array_equal(got["w"], np.arange(1024, dtype=np.float32).reshape(32, 32))
    np.testing.assert_array_equal(got["v"], np.ones((32, 32), np.float32))


def test_stage_model_keeps_tensors_external_to_another_file(tmp_path):
    """Tensors external to another file stay as they are (pointing at it, which is not touched)."""
    lazy = _model_with_weights(str(tmp_path), "weights.bin")
    weights = (tmp_path / "weights.bin").read_bytes()
    with StagedFiles() as files:
        stage_model(files, lazy, str(tmp_path / "model.onnx"), external_data="model.onnx.data")
    assert (tmp_path / "weights.bin").read_bytes() == weights
    again = onnx.load(str(tmp_path / "model.onnx"))
    got = {t.name: numpy_helper.to_array(t) for t in again.graph.initializer}
    np.testing.assert_array_equal(got["w"], np.arange(1024, dtype=np.float32).reshape(32, 32))
    locations = {t.name: {e.key: e.value for e in t.external_data}["location"]
                 for t in onnx.load(str(tmp_path / "model.onnx"), load_external_data=False).graph.initializer}
    assert locations == {"w": "weights.bin", "v": "model.onnx.data"}


@pytest.mark.parametrize("external", [False, True])
def test_saving_onto_a_symbolic_link_writes_through_it(tmp_path, external):
    """A checkpoint path that is a symbolic link keeps the link and updates the file it points to, as
    onnxruntime-training's save does (the link was replaced by a plain file, its target left old)."""
    (tmp_path / "real").mkdir()
    target, link = tmp_path / "real" / "ckpt", tmp_path / "link"
    threshold = 0 if external else 1 << 30
    save_checkpoint(_ckpt(1), str(target), external_threshold=threshold)
    os.symlink(os.path.join("real", "ckpt"), link)
    save_checkpoint(_ckpt(2), str(link), external_threshold=threshold)
    assert os.path.islink(link) and sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert _same(load_checkpoint(str(link)), _ckpt(2))
    assert _same(load_checkpoint(str(target)), _ckpt(2))
    assert not [f for f in os.listdir(tmp_path / "real") if f.endswith(".tmp")]


def test_a_save_removes_the_temporaries_a_killed_save_of_that_file_left(tmp_path):
    """A save killed after writing its temporary, before its rename, left ``ckpt.<random>.tmp`` for good
    (hundreds of MB for a big model: a one-file save has no journal to name it); the next save of that
    checkpoint removes them, and those a killed save of another file in the folder left (unlocked), but no
    user's file."""
    path = str(tmp_path / "ckpt")
    save_checkpoint(_ckpt(1), path)

    def the_rename(name: str, args: tuple) -> bool:  # the commit's (not the temporary's naming)
        return name == "replace" and not os.fspath(args[0]).endswith(".onnxtrain.new")

    for _ in range(2):
        assert _killed(lambda: save_checkpoint(_ckpt(2), path), the_rename)
    left = [f for f in os.listdir(tmp_path) if f != "ckpt"]
    assert len(left) == 2 and all(f.startswith("ckpt.") and f.endswith(".onnxtrain.tmp") for f in left), left
    # killed before its lock: kept while young (a live writer's looks the same), removed when old
    assert _killed(lambda: save_checkpoint(_ckpt(2), path), lambda name, args: name == "replace")
    young = [f for f in os.listdir(tmp_path) if f.endswith(".onnxtrain.new")]
    assert len(young) == 1
    (tmp_path / "ckpt.oldoldol.onnxtrain.new").write_bytes(b"x")
    os.utime(tmp_path / "ckpt.oldoldol.onnxtrain.new", (1e9, 1e9))
    others = ["ckpt.notes.tmp", "ckpt.20240101.tmp", "other.tmp"]  # (a user's files)
    for f in [*others, "other.abcd1234.onnxtrain.tmp"]:  # (and a killed save's of another file)
        (tmp_path / f).write_bytes(b"x")
    assert _same(load_checkpoint(path), _ckpt(1))
    save_checkpoint(_ckpt(3), path)
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", *others, *young])
    assert _same(load_checkpoint(path), _ckpt(3))


def test_the_clean_up_leaves_another_writers_temporary_alone(tmp_path):
    """Two saves of one file at once: the first commit's clean-up does not delete the other's temporary,
    still being written (locked while in flight), and the other commit then succeeds."""
    target = str(tmp_path / "f")
    slow = StagedFiles()
    slow.write(target, lambda f: f.write(b"slow"))
    with StagedFiles() as fast:
        fast.write(target, lambda f: f.write(b"fast"))
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".onnxtrain.tmp")]) == 1
    slow.commit()
    assert (tmp_path / "f").read_bytes() == b"slow" and os.listdir(tmp_path) == ["f"]


def test_the_run_start_clean_up_leaves_live_temporaries_and_user_files(tmp_path):
    """``onnxtrain train``'s start-up clean-up removed any ``<run file>.<something>.tmp``: another save's
    temporary still being written (its commit then failed) and a user's ``model.onnx.20240101.tmp``."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "model.onnx.20240101.tmp").write_bytes(b"a user's backup")
    live = StagedFiles()
    live.write(str(run / "checkpoints" / "step_00000002.ckpt"), lambda f: f.write(b"ckpt"))
    dead = run / "checkpoints" / "step_00000001.ckpt.ab12cd_3.onnxtrain.tmp"  # a killed write's
    dead.write_bytes(b"half")
    assert remove_stale_temporaries(str(run)) == [str(dead)]
    live.commit()
    assert (run / "checkpoints" / "step_00000002.ckpt").read_bytes() == b"ckpt"
    assert (run / "model.onnx.20240101.tmp").exists()


def test_a_failed_commit_releases_its_temporaries_locks(tmp_path):
    """The descriptors locking the temporaries were kept open after a failed commit (one per file). The
    target becomes a folder while its temporary is written (a folder there already fails the write before
    any temporary), so the commit's rename fails."""
    assert _open_under(tmp_path) == []
    for i in range(5):
        target = tmp_path / f"becomes_a_folder_{i}"
        with pytest.raises(IsADirectoryError):
            write_atomic(str(target), lambda f, t=target: (t.mkdir(), f.write(b"x")))
        # (the commit failed at the rename: the temporary is gone, the folder stays)
        assert sorted(os.listdir(tmp_path)) == [f"becomes_a_folder_{j}" for j in range(i + 1)]
    assert _open_under(tmp_path) == []


def _open_under(folder) -> list[str]:
    """This process's open descriptors on files in ``folder`` (only these: a count of all descriptors also
    moved with whatever else the test worker opened or the collector closed meanwhile)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (closed since the listing, e.g. the listing's own descriptor)
            continue
        if target.startswith(str(folder) + os.sep):
            found.append(target)
    return found

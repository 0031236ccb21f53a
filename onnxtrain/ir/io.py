"""Writing files atomically: a temporary name in the same folder, flushed, then renamed.

:func:`write_atomic` writes one file. :class:`StagedFiles` writes several that go together (a model and
its external data, a checkpoint and its ``.data`` file, a set of training artifacts): every file goes to
its temporary first, and only when all are written are they renamed onto their targets. A failure
while writing leaves every old file as it was; a failure among the renames puts the old files back
(kept meanwhile as hard links). Temporaries are named ``<target name>.<random>.onnxtrain.tmp`` and stay
locked while in flight; one that a killed write left (unlocked) is deleted by the next commit into its
folder, of any file where the file system enforces the locks, else of its own target.

A process killed between two renames cannot put anything back itself. So before renaming several files, a
commit writes a journal beside them, ``<first target name>.<hex>.journal.tmp`` (flushed to disk with its
folder), naming each target with its backup ``<target name>.<hex>.old.tmp``, or saying it had no old file;
the journal goes only once every rename is on disk, and the backups after it. :func:`recover_commits` puts
back, from the journals it finds, the old files of every commit that did not finish, so that the targets of
a commit in one folder are afterwards all old or all new, never some of each (a commit that spans folders
is kept whole folder by folder); a commit in one folder killed after its last rename (before its journal
went) stands, its backups deleted. It can itself be killed and run again. A commit first recovers the
unfinished commits of its own targets, so that a journal left behind never undoes a later commit; the
journal of a commit still running is locked (``flock``, where the system has it) and left alone.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import IO, Any, NamedTuple

import numpy as np
import onnx

from onnxtrain.ir.graphs import walk_graphs
from onnxtrain.ir.stream import (
    Arrays,
    array_nbytes,
    array_raw,
    array_tensor,
    elem_type,
    total_nbytes,
    write_model,
)
from onnxtrain.user_warning import warn

try:
    import fcntl
except ImportError:  # (Windows) no locks: a journal is taken for one of a killed commit
    fcntl = None  # type: ignore[assignment]
HAS_LOCKS = fcntl is not None  # whether try_lock can lock at all here


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (os.umask is process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (the renames) to disk; best effort (not every system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


TMP_SUFFIX = ".onnxtrain.tmp"  # the end of StagedFiles' temporaries' names
FRESH_SUFFIX = ".onnxtrain.new"  # a temporary's name for the moment before its lock is taken
_FRESH_MAX_AGE = 3600.0  # seconds: such a file older than this was left by a write killed in that moment


class StagedFiles:
    """Files written to temporaries beside their targets, renamed onto them together by :meth:`commit`.

    Use as a context manager: the files are committed when the block ends, discarded when it raises::

        with StagedFiles() as files:
            files.save_model(training, "art/training_model.onnx")
            files.write("art/checkpoint", lambda f: f.write(data))
    """

    def __init__(self, make_folders: bool = True) -> None:
        """``make_folders``: create a target's missing folders (else a missing folder is an error naming the
        target, as onnxruntime's and onnx's writers give)."""
        self._make_folders = make_folders
        self._staged: list[tuple[str, str]] = []  # (temporary, target), in rename order
        self._remove: list[str] = []
        self._locks: list[int] = []  # open descriptors locking the temporaries until commit or discard
        self._closed = False

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    @property
    def targets(self) -> list[str]:
        """The files staged so far, in the order they will be renamed."""
        return [path for _, path in self._staged]

    def write(self, path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
        """Call ``write(f)`` on a new temporary beside ``path`` and fsync it; renamed at :meth:`commit` (onto
        ``path`` itself: a symbolic link there is replaced; see :func:`written_through`)."""
        if self._closed:
            raise RuntimeError("these staged files were already committed or discarded")
        path = os.fspath(path)
        if os.path.abspath(path) in {os.path.abspath(t) for t in self.targets}:  # ./a/x and a/x alike
            raise ValueError(f"{path} is staged twice")
        if os.path.isdir(path):  # (else found only at the rename, naming the temporary)
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
        folder = os.path.dirname(os.path.abspath(path))
        try:
            if self._make_folders:
                os.makedirs(folder, exist_ok=True)
            elif not os.path.isdir(folder):
                os.stat(folder)  # the error onnxruntime's writers give: a missing (or not a) folder
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        except FileExistsError:  # a file where a folder on the way should be
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
        except OSError as e:
            raise _about(e, path) from None
        # made under a name no clean-up matches, locked, then named as a temporary: another writer's commit
        # removes the unlocked temporaries of killed writes, and must never see this one unlocked
        try:
            fd, fresh = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=FRESH_SUFFIX,
                                         dir=folder)
        except OSError as e:
            raise _about(e, path) from None
        tmp = fresh[: -len(FRESH_SUFFIX)] + TMP_SUFFIX
        lock = None
        try:
            lock = os.open(fresh, os.O_RDONLY)  # held (and locked) while the temporary is in flight
            try_lock(lock)
            os.replace(fresh, tmp)
        except BaseException:
            os.close(fd)
            _unlink_quietly(fresh)
            if lock is not None:
                os.close(lock)
            raise
        self._locks.append(lock)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            try:  # mkstemp makes files owner-only: the old file's mode, else the usual one
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:
                mode = 0o666 & ~_umask()
            os.chmod(tmp, mode)
        except BaseException as e:
            _unlink_quietly(tmp)
            os.close(self._locks.pop())
            if isinstance(e, OSError):  # a full disk, a file size limit, an I/O error: about the file named
                raise _about(e, path) from None
            raise
        self._staged.append((tmp, path))

    def save_model(self, model: onnx.ModelProto, path: str | os.PathLike, arrays: Arrays = ()) -> None:
        """Stage ``model`` serialized (no external data) for ``path``, with ``arrays`` (name, values) as
        initializers after its own (see :func:`~onnxtrain.ir.stream.write_model`)."""
        self.write(path, lambda f: write_model(f, model, arrays))

    def remove_after(self, path: str | os.PathLike) -> None:
        """Delete ``path`` (if it is a file) once every staged file is in place: a side file now unused."""
        self._remove.append(os.fspath(path))

    def discard(self) -> None:
        """Delete the temporaries; the targets stay as they were."""
        for tmp, _ in self._staged:
            _unlink_quietly(tmp)
        self._staged.clear()
        self._closed = True
        self._unlock()

    def _unlock(self) -> None:
        for fd in self._locks:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._locks.clear()

    def __del__(self) -> None:  # dropped without commit() or discard(): its temporaries are no longer held
        with contextlib.suppress(Exception):
            self._unlock()

    def commit(self) -> None:
        """Rename every temporary onto its target; if one rename fails, put back the files already
        replaced (the old ones, or none where there was none) and raise. With several files, a journal
        (see the module's docstring) lets :func:`recover_commits` do the same after a kill."""
        if self._closed:
            raise RuntimeError("these staged files were already committed or discarded")
        self._closed = True
        staged = list(self._staged)
        pending = list(staged)
        done: list[str] = []  # the targets renamed onto so far
        existed: dict[str, bool] = {}
        folders = sorted({os.path.dirname(os.path.abspath(p)) for _, p in staged})
        journal = _Journal()
        try:
            targets = {os.path.abspath(p) for _, p in staged}
            for folder in folders:  # a killed commit of these files is undone first, never after this one
                _warn_put_back(recover_commits(folder, naming=targets))
            existed = {path: os.path.lexists(path) for _, path in staged}
            if len(staged) > 1:
                journal.begin(staged, existed)
            while pending:
                tmp, path = pending[0]
                try:
                    os.replace(tmp, path)
                except OSError as e:
                    raise _about(e, path) from None
                pending.pop(0)
                done.append(path)
        except BaseException:
            for path in reversed(done):
                try:
                    old = journal.backups.get(path)
                    if old is not None:
                        os.replace(old, path)
                    elif not existed.get(path, True):
                        _unlink_quietly(path)  # there was no such file before
                except OSError:
                    pass
            for tmp, _ in pending:
                _unlink_quietly(tmp)
            journal.end(folders)
            self._unlock()
            raise
        journal.end(folders)
        for path in self._remove:
            if path not in self.targets and os.path.isfile(path):
                _unlink_quietly(path)  # (another writer's commit may have removed it since)
        enforced = [f for f in folders if _locks_enforced(self._locks, staged, f)]  # (while still locked)
        self._unlock()
        for path in self.targets:
            _remove_leftover_temporaries(path)
        for folder in enforced:
            _remove_killed_temporaries(folder)
        for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in self.targets + self._remove}):
            _fsync_dir(folder)


def _remove_leftover_temporaries(path: str) -> None:
    """Delete the temporaries of ``path`` that writes killed before their rename left (named
    ``<name>.<8 random>.onnxtrain.tmp`` by :meth:`StagedFiles.write`; another writer's, still locked, stay):
    the file now in place supersedes them."""
    folder, name = os.path.split(os.path.abspath(path))
    pattern = re.compile(re.escape(name) + r"\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX) + "$")
    fresh = re.compile(re.escape(name) + r"\.[a-z0-9_]{8}" + re.escape(FRESH_SUFFIX) + "$")
    with contextlib.suppress(OSError):
        for f in os.listdir(folder):
            if pattern.match(f):
                remove_unless_held(os.path.join(folder, f))
            elif fresh.match(f):  # a write killed before its lock: unlocked, so told from a live one by age
                with contextlib.suppress(OSError):
                    if time.time() - os.stat(os.path.join(folder, f)).st_mtime > _FRESH_MAX_AGE:
                        remove_unless_held(os.path.join(folder, f))


_ANY_TMP = re.compile(r"^.+\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX) + "$")
_JOURNAL_TMP = re.compile(r"\.[0-9a-f]{8,}\.journal\.tmp\.[a-z0-9_]{8}" + re.escape(TMP_SUFFIX) + "$")


def _locks_enforced(locks: list[int], staged: list[tuple[str, str]], folder: str) -> bool:
    """Whether ``folder``'s file system refuses a lock of a file another descriptor holds locked: tried on
    the first target committed there, whose temporary's descriptor (in ``locks``, in the order of
    ``staged``) still holds its lock. False where locks are not enforced, or cannot be told."""
    if not HAS_LOCKS:
        return False
    for fd, (_, path) in zip(locks, staged):
        if os.path.dirname(os.path.abspath(path)) != folder:
            continue
        try:
            probe = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            return not try_lock(probe) and os.path.samestat(os.fstat(probe), os.fstat(fd))
        finally:
            os.close(probe)
    return False


def _remove_killed_temporaries(folder: str) -> None:
    """Delete the temporaries in ``folder`` that killed writes of any file left (``<name>.<8
    random>.onnxtrain.tmp``, unlocked), so that they do not pile up where each save writes a new name
    (``epoch_<n>.ckpt``). Only where locks are enforced (:func:`_locks_enforced`): a live writer's
    temporary is locked there, so it is never taken for a killed one. Journals' own temporaries are left
    to :func:`recover_commits`."""
    with contextlib.suppress(OSError):
        for f in os.listdir(folder):
            if _ANY_TMP.match(f) and not _JOURNAL_TMP.search(f):
                remove_unless_held(os.path.join(folder, f))


def remove_unless_held(path: str) -> bool:
    """Delete the temporary ``path`` unless a live writer holds its lock (:meth:`StagedFiles.write` locks
    its temporaries until they are renamed); whether it was deleted."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        if not try_lock(fd):
            return False
        _unlink_quietly(path)
        return True
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the commit journal

_JOURNAL_FORMAT = "onnxtrain commit journal"
_JOURNAL = re.compile(r"^.+\.[0-9a-f]{8,}\.journal\.tmp$")
_BACKUP = re.compile(r"^(?P<target>.+)\.[0-9a-f]{8,}\.old\.tmp$")


def try_lock(fd: int) -> bool:
    """Take an exclusive lock (``flock``) of the open file or folder ``fd`` without waiting; False when
    another process (or descriptor) holds it. True where there are no locks (no ``fcntl``, or a file system
    without them): a journal is then taken for a killed commit's, a run folder goes unlocked."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # a file system without locks
        return True
    return True


def _keepable(path: str) -> bool:
    """Whether there is an old entry at ``path`` to keep: a file or a symlink (a folder in the way makes the
    rename itself fail)."""
    return os.path.lexists(path) and (os.path.islink(path) or not os.path.isdir(path))


class _Journal:
    """The journals and backups of one commit: :meth:`begin` writes them, :meth:`end` deletes them."""

    def __init__(self) -> None:
        self.backups: dict[str, str] = {}  # target -> backup, for the targets that had an old file
        self.paths: list[str] = []  # one journal per folder of targets
        self.fds: list[int] = []  # held open (and locked) until the journals are deleted

    def begin(self, staged: list[tuple[str, str]], existed: dict[str, bool]) -> None:
        """Write a journal in each folder of the targets, then keep every old file under its backup name,
        and flush it all to disk, before the first rename."""
        by_folder: dict[str, list[tuple[str, str]]] = {}
        for tmp, path in staged:
            by_folder.setdefault(os.path.dirname(os.path.abspath(path)), []).append((tmp, path))
        for _ in range(8):
            token = os.urandom(4).hex()  # (not secrets: its hashlib import costs 4 MiB of RSS)
            paths = [os.path.join(folder, f"{os.path.basename(entries[0][1])}.{token}.journal.tmp")
                     for folder, entries in by_folder.items()]
            backups = {path: os.path.join(os.path.dirname(os.path.abspath(path)),
                                          f"{os.path.basename(path)}.{token}.old.tmp")
                       for _, path in staged if existed[path] and _keepable(path)}
            if not any(os.path.lexists(p) for p in [*paths, *backups.values()]):
                break
        else:
            raise FileExistsError(f"no free name for a commit journal in {sorted(by_folder)}")
        for (folder, entries), path in zip(by_folder.items(), paths):
            files = [{"target": os.path.basename(p), "temporary": os.path.basename(tmp),
                      "backup": os.path.basename(backups[p]) if p in backups else None,
                      "existed": existed[p]} for tmp, p in entries]
            data = json.dumps({"format": _JOURNAL_FORMAT, "version": 1, "folders": len(by_folder),
                               "files": files}, indent=1).encode()
            # written whole under a temporary name, then renamed: a journal that exists is complete
            fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=TMP_SUFFIX, dir=folder)
            self.fds.append(fd)
            try:
                try_lock(fd)
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
                os.replace(tmp, path)
            except BaseException:
                _unlink_quietly(tmp)
                raise
            self.paths.append(path)
        for path, backup in backups.items():
            self.backups[path] = backup  # (deleted at the end even if it is made only in part)
            _keep_old(path, backup)
        for folder in by_folder:  # the journals and backups on disk before any rename
            _fsync_dir(folder)

    def end(self, folders: Iterable[str]) -> None:
        """After the renames (or their roll-back): flush them to disk, delete the journals (flushed too),
        then the backups. Does nothing for a commit without a journal."""
        try:
            if self.paths:
                for folder in folders:
                    _fsync_dir(folder)
                for path in self.paths:
                    _unlink_quietly(path)  # while still locked: nobody takes it for a killed commit's
                for folder in sorted({os.path.dirname(p) for p in self.paths}):
                    _fsync_dir(folder)
        finally:
            for fd in self.fds:
                os.close(fd)
            self.fds.clear()
        for backup in self.backups.values():
            _unlink_quietly(backup)


def _keep_old(path: str, backup: str) -> None:
    """Make ``backup`` (a new name beside ``path``) hold the entry at ``path``, so that a failed or killed
    commit can put it back with one rename: a hard link to a file (a byte copy, flushed to disk, where hard
    links are refused), a new symlink to a symlink's target."""
    if os.path.islink(path):
        os.symlink(os.readlink(path), backup)
        return
    try:
        os.link(path, backup)
    except FileExistsError:
        raise
    except FileNotFoundError:  # another writer's commit removed it since (a side file): nothing to keep
        return
    except OSError:  # no hard links here: keep a copy of the bytes and the mode
        shutil.copy2(path, backup)
        fd = os.open(backup, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _read_journal(fd: int, path: str) -> list[dict[str, Any]]:
    """The entries of the journal open as ``fd``; a ValueError naming it when it is not one of ours."""
    return _read_journal_whole(fd, path)[0]


def _read_journal_whole(fd: int, path: str) -> tuple[list[dict[str, Any]], bool]:
    """The entries of the journal open as ``fd`` and whether its commit had all its targets in this folder
    (journals of older versions do not say: taken as not); a ValueError naming it when it is not ours."""
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    try:
        j = json.loads(b"".join(chunks))
        files = j["files"] if j["format"] == _JOURNAL_FORMAT else None
        ok = isinstance(files, list) and all(
            isinstance(e, dict) and all(isinstance(e.get(k), str) and os.path.basename(e[k]) == e[k]
                                        and e[k] not in ("", ".", "..") for k in ("target", "temporary"))
            and e["temporary"].endswith(".tmp") and isinstance(e.get("existed"), bool)
            and (e.get("backup") is None or isinstance(e["backup"], str) and _BACKUP.match(e["backup"])
                 and os.path.basename(e["backup"]) == e["backup"]) for e in files)
    except (ValueError, TypeError, KeyError):
        ok = False
    if not ok:
        raise ValueError(f"{path} is not a readable onnxtrain commit journal; the files it is beside may be "
                         "a mix of two saves: check them, then delete it")
    return files, j.get("folders") == 1


def _same_entry(a: str, b: str) -> bool:
    """Whether backup ``a`` still holds what target ``b`` is: the same file, or (a symlink's backup is a new
    symlink) a symlink to the same place."""
    try:
        sa, sb = os.lstat(a), os.lstat(b)
        if stat.S_ISLNK(sa.st_mode) and stat.S_ISLNK(sb.st_mode):
            return os.readlink(a) == os.readlink(b)
        return os.path.samestat(sa, sb)
    except OSError:
        return False


def _recover_journal(path: str, wanted: set[str] | None, put_back: list[str], removed: list[str]
                     ) -> set[str]:
    """Undo the commit of the journal ``path`` unless it is still running (then: its backups, to be kept)
    or names none of ``wanted``; appends to ``put_back`` the targets put back, to ``removed`` the leftovers
    deleted. Every step can be done again: a backup is renamed onto its target (or deleted when the target
    is still that file), a target that had no old file is deleted, and the journal goes last."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return set()  # its commit just ended
    except PermissionError:
        if wanted is None:
            raise
        warn(f"cannot read {path} (another user's commit journal?); left as it is")
        return set()
    try:
        folder = os.path.dirname(path)
        if not try_lock(fd):  # a running commit: complete (journals are renamed in once written)
            return {os.path.join(folder, e["backup"]) for e in _read_journal(fd, path) if e["backup"]}
        if not _still_there(fd, path):
            return set()  # its commit ended (and deleted it) between our open and our lock
        try:
            files, one_folder = _read_journal_whole(fd, path)
        except ValueError as e:  # a commit of these files is not held up by a journal it cannot read
            if wanted is None:
                raise
            warn(f"{e}; left as it is")
            return set()
        if wanted is not None and not any(os.path.abspath(os.path.join(folder, e["target"])) in wanted
                                          for e in files):
            return set()
        if one_folder and _all_renamed(folder, files):  # killed after its last rename: the commit stands
            os.unlink(path)  # as the commit would have ended: the journal, then its backups
            removed.append(path)
            _fsync_dir(folder)
            for e in files:
                if e["backup"] is not None and os.path.lexists(backup := os.path.join(folder, e["backup"])):
                    _unlink_quietly(backup)
                    removed.append(backup)
            return set()
        for e in reversed(files):
            target = os.path.join(folder, e["target"])
            if e["backup"] is not None:
                backup = os.path.join(folder, e["backup"])
                if os.path.lexists(backup):
                    if _same_entry(backup, target):  # never replaced
                        os.unlink(backup)
                    else:
                        os.replace(backup, target)
                        put_back.append(target)
            elif not e["existed"] and _keepable(target):  # this commit made it
                os.unlink(target)
                put_back.append(target)
            tmp = os.path.join(folder, e["temporary"])
            if os.path.lexists(tmp) and not os.path.isdir(tmp):
                os.unlink(tmp)
                removed.append(tmp)
        _fsync_dir(folder)  # the old files back on disk before the journal goes
        os.unlink(path)
        removed.append(path)
        _fsync_dir(folder)
        return set()
    finally:
        os.close(fd)


def _all_renamed(folder: str, files: list[dict[str, Any]]) -> bool:
    """Whether every rename of a commit's entries landed and none was undone: no temporary is left, every
    target is there and every old file's backup still is (undoing an entry removes its backup or its new
    target, so a recovery killed part way is never taken for a finished commit)."""
    for e in files:
        if os.path.lexists(os.path.join(folder, e["temporary"])):
            return False
        target = os.path.join(folder, e["target"])
        if not os.path.lexists(target):
            return False
        if e["backup"] is not None:
            backup = os.path.join(folder, e["backup"])
            if not os.path.lexists(backup) or _same_entry(backup, target):
                return False
    return True


def _still_there(fd: int, path: str) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        return os.path.samestat(os.fstat(fd), os.lstat(path))
    except OSError:
        return False


class Recovered(NamedTuple):
    """What :func:`recover_commits` did: the targets it put back, the leftovers it deleted (journals,
    backups, temporaries)."""

    put_back: list[str]
    removed: list[str]

    def __bool__(self) -> bool:
        return bool(self.put_back or self.removed)


def recover_commits(folder: str | os.PathLike, *, naming: Iterable[str | os.PathLike] | None = None
                    ) -> Recovered:
    """Put back the files of every commit in ``folder`` that a killed process left unfinished (its journal
    is there): each target from its backup, or deleted where it had no old file, then the journal deleted;
    afterwards the targets of each such commit are all as they were before it. A commit in one folder whose
    every rename had landed stands (its journal and backups deleted). Backups without a journal
    come from commits that finished and are deleted. The journals of commits still running (locked by
    their process) are left alone, with their backups. Safe to run again after being killed itself.

    With ``naming`` (paths), only the commits that name one of those files are recovered, and only the
    backups of those files deleted.

    Returns the paths of the targets put back and those of the leftovers deleted (nothing when ``folder``
    is not a folder or cannot be listed). Raises ValueError for a journal it cannot read."""
    folder = os.fspath(folder)
    try:
        names = sorted(os.listdir(folder))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return Recovered([], [])
    wanted = None if naming is None else {os.path.abspath(os.fspath(p)) for p in naming}
    put_back: list[str] = []
    removed: list[str] = []
    keep: set[str] = set()
    for name in names:
        if _JOURNAL.match(name):
            keep |= _recover_journal(os.path.join(folder, name), wanted, put_back, removed)
    for name in names:  # then the backups of commits that finished (of those files, with ``naming``)
        path = os.path.join(folder, name)
        m = _BACKUP.match(name)
        if (m and path not in keep and os.path.lexists(path) and not os.path.isdir(path)
                and (wanted is None or os.path.abspath(os.path.join(folder, m["target"])) in wanted)):
            _unlink_quietly(path)
            removed.append(path)
    return Recovered(put_back, removed)


def _warn_put_back(done: Recovered) -> None:
    if done.put_back:
        warn(f"put back {', '.join(done.put_back)} as they were before a save that was killed part way")


def written_through(path: str | os.PathLike) -> str:
    """Where a save to ``path`` writes: the file a symbolic link points to (the link stays, as onnxruntime's
    and onnx's writers keep it), else ``path``."""
    path = os.fspath(path)
    return os.path.realpath(path) if os.path.islink(path) else path


def _about(e: OSError, path: str | os.PathLike, where: str = "") -> OSError:
    """``e`` (of the same class) about ``path``, the file the caller named, not the temporary beside it;
    its message led by ``where`` (the option that gave the path) when given."""
    if e.errno is None:
        return e
    return OSError(e.errno, f"{where}: {e.strerror}" if where else e.strerror, os.fspath(path))


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path`` (onto
    the file it points to when it is a symbolic link)."""
    with StagedFiles() as files:
        files.write(written_through(path), write)


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike, *,
                      external_data: str | None = None, size_threshold: int = 1024,
                      make_folders: bool = True) -> None:
    """Save ``model`` to ``path`` atomically (with ``external_data``: see :func:`stage_model`;
    ``make_folders``: see :class:`StagedFiles`)."""
    with StagedFiles(make_folders) as files:
        stage_model(files, model, path, external_data=external_data, size_threshold=size_threshold)


def save_dump(model: onnx.ModelProto, path: str | os.PathLike, where: str, *,
              missing_folder: type[FileNotFoundError] | None = None,
              external_data: str | None = None, size_threshold: int = 1024) -> None:
    """:func:`save_model_atomic` for a path the user gave as the option ``where``, which its errors name
    (``missing_folder``: the class raised when ``path``'s folder does not exist, else the OSError's own;
    ``external_data``, ``size_threshold``: initializers of that many bytes or more go to that file)."""
    try:
        save_model_atomic(model, path, make_folders=False, external_data=external_data,
                          size_threshold=size_threshold)
    except OSError as e:
        if isinstance(e, FileNotFoundError) and missing_folder is not None:
            raise missing_folder(e.errno, f"{where}: {e.strerror}", os.fspath(path)) from None
        raise _about(e, path, where) from None


def _initializers(g: onnx.GraphProto) -> list[onnx.TensorProto]:
    """The initializers of ``g`` and of the graphs inside its nodes' attributes."""
    return [t for sub in walk_graphs(g) for t in sub.initializer]


def stage_model_sized(files: StagedFiles, model: onnx.ModelProto, path: str | os.PathLike,
                      arrays: Arrays = ()) -> None:
    """:func:`stage_model` for ``path``, its tensors in ``<file name>.data`` beside it when they pass
    :data:`~onnxtrain.ir.large.LARGE_MODEL_BYTES` (such a file left by an earlier, larger save is removed
    otherwise: the model written never reads it)."""
    from onnxtrain.ir.large import is_large

    target = written_through(path)
    data = os.path.basename(target) + ".data"
    big = is_large(model, total_nbytes(arrays))
    stage_model(files, model, target, external_data=data if big else None, arrays=arrays)
    if not big:
        files.remove_after(os.path.join(os.path.dirname(target), data))


def save_model_sized(model: onnx.ModelProto, path: str | os.PathLike, make_folders: bool = True,
                     arrays: Arrays = ()) -> None:
    """Save ``model`` to ``path`` atomically with :func:`stage_model_sized`."""
    with StagedFiles(make_folders) as files:
        stage_model_sized(files, model, path, arrays)


def stage_model(files: StagedFiles, model: onnx.ModelProto, path: str | os.PathLike, *,
                external_data: str | None = None, size_threshold: int = 1024, arrays: Arrays = ()) -> None:
    """Stage ``model``, with ``arrays`` (name, values) as initializers after its own, for ``path`` in
    ``files``. With ``external_data`` (a file name in ``path``'s folder),
    initializers of at least ``size_threshold`` bytes go to that file, written whole (never appended to an
    old one, as onnx.save_model's external-data writer does) and renamed just before the model; ``model``
    itself is left unchanged. Raises ValueError if a tensor that is already external (a model loaded with
    ``load_external_data=False``) has its bytes in that very file, which would be rewritten without them;
    tensors external to other files stay as they are."""
    path = written_through(path)  # (its external data beside the file written)
    if external_data is None:
        files.save_model(model, path, arrays)
        return
    if os.path.basename(external_data) != external_data or external_data in ("", ".", ".."):
        raise ValueError(f"external_data must be a file name (no folder), got {external_data!r}")
    from onnxtrain.ir.large import external_tensor, skeleton

    # the data file's contents in order: main-graph tensors of ``model`` and arrays (read when written), bytes
    chunks: list[onnx.TensorProto | bytes | np.ndarray] = []
    offset = 0

    def external(t: onnx.TensorProto, n: int) -> onnx.TensorProto:
        nonlocal offset
        offset += n
        return external_tensor(t, external_data, offset - n, n)

    def moved_bytes(t: onnx.TensorProto) -> bytes | None:
        """``t``'s bytes when they go to the data file (one tensor's at a time: never the whole model's)."""
        if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type == onnx.TensorProto.STRING:
            return None
        raw = _raw_bytes(t)
        return raw if len(raw) >= size_threshold else None

    def emptied(t: onnx.TensorProto) -> onnx.TensorProto | None:
        raw = moved_bytes(t)
        if raw is None:
            return None
        chunks.append(t)  # (read again when written: its bytes are not held meanwhile)
        return external(t, len(raw))

    m = skeleton(model, emptied)
    for sub in walk_graphs(m.graph):  # the bodies' tensors (copies in m): moved out in place
        if sub is m.graph:
            continue
        for k, t in enumerate(sub.initializer):
            raw = moved_bytes(t)
            if raw is not None:
                chunks.append(raw)
                sub.initializer[k].CopyFrom(external(t, len(raw)))
    for name, a in arrays:
        n = array_nbytes(a)
        if n < size_threshold or a.dtype.kind in "OSU":  # (small: a copy in the model)
            m.graph.initializer.append(array_tensor(name, a))
            continue
        chunks.append(a)
        stub = onnx.TensorProto(name=name, data_type=elem_type(a), dims=a.shape)
        m.graph.initializer.append(external(stub, n))

    def write_data(f: IO[bytes]) -> None:
        for c in chunks:
            raw = c if isinstance(c, bytes) else array_raw(c) if isinstance(c, np.ndarray) else _raw_bytes(c)
            f.write(raw)

    if not chunks:  # (no tensor that large: the model alone)
        files.save_model(model, path, arrays)
        return
    _refuse_rewriting_own_data(model, path, external_data)
    files.write(os.path.join(os.path.dirname(path), external_data), write_data)
    files.save_model(m, path)


def _raw_bytes(t: onnx.TensorProto) -> bytes:
    """``t``'s values as its raw_data bytes."""
    if t.HasField("raw_data"):
        return t.raw_data
    from onnx import numpy_helper

    return numpy_helper.from_array(numpy_helper.to_array(t)).raw_data


def _refuse_rewriting_own_data(model: onnx.ModelProto, path: str, external_data: str) -> None:
    """A ValueError naming the first initializer of ``model`` (already external) whose bytes are in the file
    ``external_data`` beside ``path``, which is about to be rewritten without them."""
    folder = os.path.dirname(os.path.abspath(path))
    data = os.path.join(folder, external_data)
    for t in _initializers(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in t.external_data if e.key == "location"), "")
        there = os.path.join(folder, location)
        if location and os.path.realpath(there) == os.path.realpath(data):
            raise ValueError(
                f"initializer {t.name!r} keeps its bytes in {data}, the external-data file this save "
                "rewrites (without them: the model was loaded without its external data); load the model "
                "with its external data (onnx.load(path), whose default loads it, or "
                "onnx.load_external_data_for_model(model, folder)) before saving it there")

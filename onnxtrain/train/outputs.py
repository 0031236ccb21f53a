"""A run folder's files: where checkpoints go and which are there, the metrics plot, the exported model."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import sys
from typing import Any

import numpy as np
import onnx

from onnxtrain import __version__
from onnxtrain.ir.io import (
    FRESH_SUFFIX,
    HAS_LOCKS,
    TMP_SUFFIX,
    recover_commits,
    remove_unless_held,
    save_model_sized,
    try_lock,
    write_atomic,
)
from onnxtrain.ir.large import check_model_arrays
from onnxtrain.train.config import Config
from onnxtrain.train.free_batch import any_batch_export
from onnxtrain.train.model import inference_parts

_CKPT = re.compile(r"^step_(\d+)\.ckpt$")


# write_atomic's temporaries of checkpoints (``<name>.<8 random>.onnxtrain.tmp``: a user's ``.tmp`` stays)
# (also a commit journal's own temporary: ``<name>.<hex>.journal.tmp.<8 random>.onnxtrain.tmp``)
# (and a temporary killed in the moment before its lock was taken: ``<name>.<8 random>.onnxtrain.new``)
_TMP_END = (r"(\.[0-9a-f]{8,}\.journal\.tmp)?\.[a-z0-9_]{8}(" + re.escape(TMP_SUFFIX) + "|"
            + re.escape(FRESH_SUFFIX) + ")$")
_STALE_TMP = re.compile(r"^step_\d+\.ckpt(\.data|\.sha256)?" + _TMP_END)
_ORPHAN_DATA = re.compile(r"^step_\d+\.ckpt\.(data|sha256)$")  # (a checkpoint's side files)
RUN_OUTPUTS = ("metrics.png", "model.onnx")  # written at the end of a run
RUN_FILES = ("metrics.jsonl", "config.yaml", *RUN_OUTPUTS)  # every file a run writes next to checkpoints/
# write_atomic's temporaries of those files
_STALE_RUN_TMP = re.compile(r"^(" + "|".join(re.escape(f) for f in RUN_FILES) + r")(\.data)?" + _TMP_END)


def output_dir(cfg: Config, override: str | None = None) -> str:
    """The run's folder: ``--output-dir``, else ``output.dir``, else ``runs/<config name>`` (``~`` expanded,
    as in the config's other paths)."""
    return os.path.expanduser(override or cfg.output.dir or os.path.join("runs", cfg.name))


def check_output_dir(folder: str) -> None:
    """A ValueError naming ``folder`` unless it is, or can be made as, a folder this process can write in
    (checked without creating anything), where the run's ``checkpoints`` folder and files can go: a file
    named ``checkpoints``, or a folder named as one of the run's files, fails here rather than at the first
    write (after the training)."""
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"output folder {folder}: a file of that name exists")
    ckpts = os.path.join(folder, "checkpoints")
    if os.path.lexists(ckpts) and not os.path.isdir(ckpts):
        raise ValueError(f"output folder {folder}: {ckpts} is a file, where the run keeps its checkpoints "
                         "folder")
    for name in RUN_FILES:
        if os.path.isdir(os.path.join(folder, name)):
            raise ValueError(f"output folder {folder}: {name} is a folder, where the run writes that file")
    up = os.path.abspath(folder)
    while not os.path.exists(up):
        up = os.path.dirname(up)
    if not os.path.isdir(up):
        raise ValueError(f"output folder {folder}: {up} is a file, not a folder")
    if not os.access(up, os.W_OK | os.X_OK):
        raise ValueError(f"output folder {folder}: no permission to write in {up}")


def is_run_folder(folder: str) -> bool:
    """Whether ``folder`` holds an onnxtrain run: its ``metrics.jsonl`` (written first) or checkpoints."""
    return os.path.isfile(os.path.join(folder, "metrics.jsonl")) or bool(list_checkpoints(folder))


_LOCKS: set[int] = set()  # the descriptors lock_folder handed out and unlock_folder has not closed


def lock_folder(folder: str) -> int | None:
    """An open descriptor of ``folder`` holding an exclusive advisory lock (``flock``) until
    :func:`unlock_folder` or the end of the process, however it ends; None where the system has no such
    locks. Raises ``BlockingIOError`` when another process (or another descriptor) holds the lock."""
    if not HAS_LOCKS:  # (Windows, which cannot open a folder either)
        return None
    fd = os.open(folder, os.O_RDONLY)  # not inherited by the programs a run starts
    if not try_lock(fd):
        os.close(fd)
        raise BlockingIOError(errno.EAGAIN, "another process holds the folder's lock", folder)
    _LOCKS.add(fd)
    return fd


def unlock_folder(fd: int) -> None:
    """Release a lock of :func:`lock_folder`."""
    _LOCKS.discard(fd)
    os.close(fd)


def _close_locks_in_child() -> None:
    """A forked child (the engine's half-batch process, a user's worker) closes its copies of the locks: it
    may outlive the run, and its copy would hold the folder's lock on (the parent's copy keeps it held)."""
    for fd in _LOCKS:
        with contextlib.suppress(OSError):
            os.close(fd)
    _LOCKS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_locks_in_child)


def foreign_files(folder: str) -> list[str]:
    """The files of ``folder`` that a new run would replace or delete though no run wrote them: those of
    :data:`RUN_FILES` in a folder that is not a run's (:func:`is_run_folder`)."""
    if not os.path.isdir(folder) or is_run_folder(folder):
        return []
    return [f for f in RUN_FILES if os.path.lexists(os.path.join(folder, f))]


def inputs_in_the_way(cfg: Config, folder: str) -> list[tuple[str, str]]:
    """(config key, path) of each input of ``cfg`` (the config file itself under the key "", model.path, the
    data files) that is one of the files a run in ``folder`` writes."""
    outputs = {os.path.realpath(os.path.join(folder, f)): f for f in RUN_FILES}
    d = cfg.data
    inputs = [("", cfg.source), ("model.path", cfg.model.path), ("data.path", getattr(d, "path", None)),
              ("data.eval_path", getattr(d, "eval_path", None)),
              *((f"data.feeds.{k}", v) for k, v in getattr(d, "feeds", {}).items() if v.endswith(".npy"))]
    return [(key, path) for key, path in inputs if path and os.path.realpath(path) in outputs]


def remove_checkpoint(path: str) -> None:
    """Delete a checkpoint file, its external-data file and its SHA-256 sums, where they exist."""
    for f in (path, path + ".data", path + ".sha256"):
        if os.path.exists(f):
            os.unlink(f)


def remove_stale_temporaries(folder: str) -> list[str]:
    """Clear up after a run killed while writing in ``folder``: first put back the files of a save killed
    between its renames (a checkpoint and its ``.data`` file, a model and its data: see
    :func:`onnxtrain.ir.io.recover_commits`), saying so on stderr; then delete the partial files,
    temporaries of checkpoints (never loaded: :func:`list_checkpoints` matches whole names only) and of the
    run's own files (``metrics.jsonl``, ``config.yaml``, ``metrics.png``, ``model.onnx``), and the ``.data``
    and ``.sha256`` of a checkpoint whose main file is gone (a prune or overwrite killed between them).
    Returns the paths of the files deleted (temporaries, and the journals and backups of those saves)."""
    stale: list[str] = []
    for d, pattern in ((os.path.join(folder, "checkpoints"), _STALE_TMP), (folder, _STALE_RUN_TMP)):
        if os.path.isdir(d):
            done = recover_commits(d)
            for f in done.put_back:
                print(f"onnxtrain: warning: put back {f} as it was before the save a killed run left "
                      "half done (with the other files of that save)", file=sys.stderr)
            stale += done.removed
            names = sorted(os.listdir(d))
            temporaries = [os.path.join(d, f) for f in names
                           if pattern.match(f) and os.path.isfile(os.path.join(d, f))]
            if pattern is _STALE_TMP:  # a pruned checkpoint's .data or .sha256, its main file deleted first
                temporaries += [os.path.join(d, f) for f in names if _ORPHAN_DATA.match(f)
                                and f.rsplit(".", 1)[0] not in names]
            stale += [f for f in temporaries if remove_unless_held(f)]  # (a live writer's stays)
    return stale


def checkpoint_path(folder: str, step: int) -> str:
    return os.path.join(folder, "checkpoints", f"step_{step:08d}.ckpt")


def list_checkpoints(folder: str) -> list[tuple[int, str]]:
    """(step, path) of the complete checkpoints of a run folder, oldest first."""
    d = os.path.join(folder, "checkpoints")
    if not os.path.isdir(d):
        return []
    found = [(int(m.group(1)), os.path.join(d, f)) for f in os.listdir(d) if (m := _CKPT.match(f))]
    return sorted(found)


def find_checkpoint(path: str) -> str:
    """``path`` if it is a checkpoint file, else the latest checkpoint of the run folder ``path`` (or of its
    ``checkpoints`` folder itself)."""
    return checkpoint_candidates(path)[0]


def checkpoint_candidates(path: str) -> list[str]:
    """``[path]`` if it is a checkpoint file, else the checkpoints of the run folder ``path`` (or of its
    ``checkpoints`` folder itself), latest first; a FileNotFoundError when there is none."""
    path = os.path.expanduser(path)
    if os.path.isfile(path):
        return [path]
    if os.path.isdir(path):
        found = list_checkpoints(path)
        folder = os.path.join(path, "checkpoints")
        if not found and os.path.basename(os.path.normpath(path)) == "checkpoints":
            found = list_checkpoints(os.path.dirname(os.path.normpath(path)) or ".")
            folder = path
        if found:
            return [p for _, p in reversed(found)]
        raise FileNotFoundError(f"no checkpoint in {folder} (give a run folder, its checkpoints folder or a "
                                ".ckpt file)")
    raise FileNotFoundError(f"checkpoint not found: {path}")


def export_model(model: onnx.ModelProto, cfg: Config, weights: dict[str, np.ndarray], path: str) -> None:
    """Write the plain inference model (logits only, trained weights as initializers) to ``path``, the large
    weights written from ``weights`` as they are (no proto copy of them, no whole serialization).

    A model whose data inputs declare one fixed batch size (a torch export without ``dynamic_axes``) is
    written with a symbolic batch axis (``batch``) when it runs at other batch sizes and its rows do not mix
    (tried at 1, 2, the fixed size and twice it); otherwise it keeps the fixed size and a warning on stderr
    says why. A built-in model names onnxtrain and its version as its producer; a model from ``model.path``
    keeps its own, as onnxruntime-training's export_model_for_inferencing keeps the base model's."""
    m, arrays = inference_parts(model, [cfg.model.logits], weights)
    if cfg.model.builder is not None:  # onnxtrain made the model; a user's keeps its producer, as
        m.producer_name, m.producer_version = "onnxtrain", __version__  # export_model_for_inferencing's
    free, why = any_batch_export(m, arrays)
    if why:
        print(f"onnxtrain: warning: {path} keeps the model's fixed batch size: {why}", file=sys.stderr)
    check_model_arrays(free, arrays)
    save_model_sized(free, path, arrays=arrays)


def _plain_log_labels() -> type:
    """A log-axis tick formatter that labels the ticks matplotlib's would, as plain numbers (2.45, 0.2), not
    as 2.45×10⁰."""
    from matplotlib import ticker

    class PlainLogFormatter(ticker.LogFormatterSciNotation):
        def __call__(self, x: float, pos: int | None = None) -> str:
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter


def plot_metrics(records: list[dict[str, Any]], path: str, title: str) -> None:
    """Train/eval loss and eval accuracy against step, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def num(v: Any) -> float:  # a value metrics.jsonl holds as null (not finite): a gap in the line
        return float("nan") if v is None else float(v)

    train = [(r["step"], num(r["loss"])) for r in records if "loss" in r]
    ev = [{**r, "eval_loss": num(r["eval_loss"])} for r in records if "eval_loss" in r]
    acc = [(r["step"], num(r["eval_accuracy"])) for r in ev if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 2 if acc else 1, figsize=(10 if acc else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    finite = [v for _, v in train if v == v and abs(v) != float("inf")]
    if finite and min(finite) > 0:
        ax.set_yscale("log")
        plain = _plain_log_labels()
        ax.yaxis.set_major_formatter(plain())
        ax.yaxis.set_minor_formatter(plain(labelOnlyBase=False))
    ax.legend()
    ax.grid(alpha=0.3)
    if acc:
        ax = axes[0][1]
        ax.plot(*zip(*acc), "o-", color="tab:green", ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel("eval accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    try:
        fig.tight_layout()
        write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    finally:
        plt.close(fig)

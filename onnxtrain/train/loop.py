"""The training loop behind ``onnxtrain train``: progress, metrics, eval, checkpoints, resume, plot, export.

The output folder holds ``metrics.jsonl`` (one JSON object per logged step and per eval),
``checkpoints/step_<N>.ckpt`` (written atomically, with its SHA-256 sums in ``step_<N>.ckpt.sha256``:
see :mod:`onnxtrain.train.checksums`), ``metrics.png``, ``model.onnx`` (a plain
inference model of the trained weights) and ``config.yaml`` (the resolved configuration).

Ctrl-C (SIGINT) and SIGTERM (what Slurm, Kubernetes and systemd send before SIGKILL) set a flag that the loop
checks between steps: it stops there and saves a checkpoint of that step (unless it has one), which
``--resume`` continues from; the CLI exits 128 + the signal's number (130, 143). A second signal raises
KeyboardInterrupt at once, even during that save (:mod:`onnxtrain.train.stop_signals` says which signals count
as a second one); files are only ever replaced atomically, so the last complete checkpoint stays. Under
``mpiexec`` (which forwards SIGTERM and SIGINT to every rank) the ranks agree at each step's start whether any
of them was signalled, so they stop after the same step however far apart the signals land, and no rank waits
in a collective for one that left.

Under ``mpiexec -n N`` every rank runs the loop on its share of each global batch (``split_batch``:
the batch size stays the config's, so N ranks train as one process would); gradients are averaged
by the session. Rank 0 alone prints the progress bar and writes metrics, plots, checkpoints and the
export; eval is sharded over the ranks; on ``--resume`` every rank reads rank 0's latest checkpoint
(under Adasum, where each rank's optimizer state is its own, the checkpoint holds every rank's).
With ``training.parameters.horizontal_parallel_size = H`` the H ranks of one split take the same batches
(the data is split over the N / H replicas only); eval, checkpoints and the export read the whole model's
state, which the ranks gather from their shares.
"""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import onnx
import yaml

from onnxtrain import parallel
from onnxtrain.checkpoint import Checkpoint, load_checkpoint
from onnxtrain.engine.seeds import set_random_seed
from onnxtrain.ir.graphs import RANDOM_OPS, model_nodes
from onnxtrain.ir.io import write_atomic
from onnxtrain.train import data as data_mod
from onnxtrain.train.checksums import checksum_problem, save_with_checksum
from onnxtrain.train.config import Config, ConfigError, changed_keys
from onnxtrain.train.evaluate import Evaluator
from onnxtrain.train.model import build_model, check_loss_value, with_own_statistics
from onnxtrain.train.outputs import (
    RUN_OUTPUTS,
    check_output_dir,
    checkpoint_path,
    export_model,
    foreign_files,
    inputs_in_the_way,
    is_run_folder,
    list_checkpoints,
    lock_folder,
    output_dir,
    plot_metrics,
    remove_checkpoint,
    remove_stale_temporaries,
    unlock_folder,
)
from onnxtrain.train.progress import progress_bar
from onnxtrain.train.schedule import learning_rate
from onnxtrain.train.session import feed_names, make_session, training_parameters
from onnxtrain.train.state import (
    OptimizerStateMismatch,
    checkpoint_to_state,
    optimizer_group,
    optimizer_layout,
    optimizer_moments,
    rank_group_name,
    session_to_checkpoint,
    trainable_names,
)
from onnxtrain.train.stop_signals import StopSignals

_T = TypeVar("_T")
EXIT_INTERRUPTED = 130
ADASUM_RANKS = "adasum_ranks"  # checkpoint property: the number of ranks whose optimizer states it holds
_ADASUM_TAG = 7301  # message tag of the ranks' optimizer states sent to rank 0


# ---- the run ------------------------------------------------------------------------------

@dataclass
class RunState:
    """Where a run is: saved in every checkpoint's properties."""

    global_step: int = 0  # optimizer steps done
    epoch: int = 0
    epoch_pos: int = 0  # samples of this epoch's permutation already used (whatever the batch size)
    epoch_rng: str = ""  # data-order generator state that this epoch's permutation is drawn from
    samples: int = 0
    loss_scale: float = 0.0  # mixed precision: the dynamic loss scaler's state (0: no scaler)
    loss_scale_stable_steps: int = 0
    # of the global steps, those mixed precision skipped (gradients not finite): the schedule reads the steps
    # that updated, global_step - skipped_steps, as onnxruntime-training's ORTTrainer read optimization_step
    skipped_steps: int = 0
    # this rank's losses since the last metrics.jsonl entry (their sum and count): saved with the
    # checkpoint so that the first entry after --resume averages the same steps as without a stop
    window_loss: float = 0.0
    window_n: int = 0

    def properties(self, lr: float, cfg: Config) -> dict[str, int | float | str]:
        # epoch_position counts micro-batches of the run's batch size, as checkpoints always did;
        # epoch_samples is exact when a resumed run changed the batch size
        props: dict[str, int | float | str] = {
            "global_step": self.global_step, "epoch": self.epoch,
            "epoch_position": self.epoch_pos // cfg.training.batch_size, "epoch_samples": self.epoch_pos,
            "data_order_rng": self.epoch_rng, "samples_seen": self.samples, "learning_rate": lr,
            "config": json.dumps(cfg.to_dict(), sort_keys=True)}
        if self.loss_scale:  # powers of two: exact in the checkpoint's float32
            props.update(loss_scale=self.loss_scale, loss_scale_stable_steps=self.loss_scale_stable_steps,
                         skipped_steps=self.skipped_steps)
        return props

    @classmethod
    def from_properties(cls, props: dict[str, Any], batch_size: int) -> RunState:
        """The state a checkpoint's properties hold; ``batch_size`` is the one it was written with (an
        older checkpoint counts its position in the epoch in micro-batches of that size only)."""
        try:
            pos = props.get("epoch_samples")
            pos = int(pos) if pos is not None else int(props["epoch_position"]) * batch_size
            return cls(int(props["global_step"]), int(props["epoch"]), pos,
                       str(props["data_order_rng"]), int(props.get("samples_seen", 0)),
                       float(props.get("loss_scale", 0.0)), int(props.get("loss_scale_stable_steps", 0)),
                       skipped_steps=int(props.get("skipped_steps", 0)))
        except KeyError as e:
            raise ValueError(f"the checkpoint has no run property {e}; was it written by onnxtrain train?"
                             ) from None


@dataclass
class RunResult:
    output_dir: str
    status: str  # "finished" or "interrupted"
    global_step: int
    metrics: dict[str, float] = field(default_factory=dict)  # the last eval
    checkpoint: str | None = None
    exported: str | None = None
    # metrics that are NaN because nothing counted (an eval set whose labels are all the ignore_index or of
    # classes of weight 0: 0/0, as torch's), not because training diverged
    undefined: tuple[str, ...] = ()
    train_loss: float | None = None  # the last logged training loss (None: not defined, or not known)
    signal: int = 0  # the signal that interrupted the run (SIGINT, SIGTERM), 0 when it finished


class Trainer:
    """One ``onnxtrain train`` run of ``cfg`` in ``output_dir``.

    Example::

        cfg = load_config("configs/digits_mlp.yaml", ["training.epochs=5"])
        result = Trainer(cfg, "runs/try").run()

    Under ``mpiexec`` every rank builds its own Trainer and calls ``run`` (see the module docstring).
    """

    def __init__(self, cfg: Config, out_dir: str | None = None, progress: bool = True):
        self.cfg = cfg
        self.out = output_dir(cfg, out_dir)
        self.progress = progress
        t = cfg.training
        w = parallel.world()
        self.ranks = w.size
        self.rank = w.rank
        self.main = w.rank == 0  # prints and writes files
        self.comm = parallel.get_communicator() if w.size > 1 else None
        if self.main:  # before the model is built: a folder that cannot be written fails at once
            try:
                check_output_dir(self.out)
            except ValueError as e:
                raise ConfigError("output.dir", f"{e} (the folder comes from output.dir or --output-dir)"
                                  ) from None
        # the run would replace its own input: refused whatever the options (but a config.yaml that the run
        # would rewrite as it is, or a run folder's own, which records the config of the run's last start)
        clashes = [(key, path) for key, path in inputs_in_the_way(cfg, self.out)
                   if key or not (_holds(path, self.resolved_config()) or _written_by_a_run(path, self.out))]
        if clashes:
            key, path = clashes[0]
            what = f"model.path {path}" if key == "model.path" else (
                f"the config file {path}" if not key else f"{key} {path}")
            how = ("copy it out of that folder and pass the copy, or choose another --output-dir" if not key
                   else "choose another --output-dir (or output.dir)")
            raise ConfigError("", f"{what} is one of the files a run writes in its output folder {self.out} "
                                  f"({os.path.basename(path)}); {how}")
        s = cfg.schedule
        if self.main and s.kind == "constant" and s.final_lr_ratio:
            print(f"onnxtrain: warning: schedule.final_lr_ratio ({s.final_lr_ratio}) has no effect with "
                  "schedule.kind constant (the rate stays optimizer.lr after the warm-up)", file=sys.stderr)
        # horizontal parallelism: the H ranks of one split (rank = replica · H + share) take the same batches,
        # so the data is split over the replicas only
        self.split = int(t.parameters.get("horizontal_parallel_size", 1))
        if self.split > 1 and w.size % self.split:
            how = "without mpiexec there is one" if w.size == 1 else f"mpiexec started {w.size}"
            raise ConfigError("training.parameters.horizontal_parallel_size",
                              f"{self.split} needs a multiple of {self.split} ranks (the ranks of one split, "
                              f"times the data-parallel replicas), but {how}; run mpiexec -n {self.split} "
                              "onnxtrain train ...")
        self.replicas = w.size // self.split
        self.replica = w.rank // self.split
        if t.batch_size % self.replicas:
            over = (f"{w.size} ranks mpiexec started (each rank takes" if self.split == 1 else
                    f"{self.replicas} data-parallel replicas of the {w.size} ranks mpiexec started (each "
                    "replica takes")
            raise ConfigError("training.batch_size", f"{t.batch_size} does not split evenly over the {over} "
                                                     "an equal part of every batch)")
        self.model = build_model(cfg)
        self.data = feed_names(cfg, self.model, data_mod.load_data(cfg))
        self._check_fixed_batch()
        self.params = training_parameters(cfg, self.model)
        if self.split > 1 and t.data_parallel_size == 1:  # the default: the world's replicas, unwarned
            self.params.data_parallel_size = self.replicas
        # whether the session exchanges updates by Adasum (parallel.exchange_mode: ZeRO stage 1 wins over it)
        self.adasum = w.size > 1 and bool(self.params.enable_adasum) and self.params.deepspeed_zero_stage != 1
        # onnxruntime seeds its random nodes (but Dropout) when their session is built: seeded here from the
        # config, two runs of it draw the same values there too (each step's reseed comes later)
        self.reseed(0)
        self.sess = make_session(cfg, self.model, self.params)
        self.trained = trainable_names(self.sess)
        self.layout = optimizer_layout(self.sess, self.comm)
        # (the statistics an exporter merged are held apart, under their layers' names)
        inits = {i.name for i in with_own_statistics(self.model).graph.initializer}
        self.weight_names = [n for n in self.whole_state() if n in inits]
        self.evaluate = Evaluator(cfg, self.model, self.weight_names, self.comm)
        self.micro = t.gradient_accumulation_steps
        self.steps_per_epoch = self.data.n_train // (t.batch_size * self.micro)
        if self.steps_per_epoch < 1:
            raise ConfigError("training.batch_size", f"{t.batch_size} × {self.micro} accumulation steps is "
                                                     f"more than the {self.data.n_train} training samples")
        self.total = t.steps if t.steps is not None else t.epochs * self.steps_per_epoch
        self.metrics_path = os.path.join(self.out, "metrics.jsonl")

    def _check_fixed_batch(self) -> None:
        """A ConfigError naming training.batch_size when a model input the data feeds declares a fixed batch
        size (an export without a dynamic batch axis) that the batches fed to each rank do not have (the
        first step would fail on it; eval and the export take any batch size)."""
        t = self.cfg.training
        rows = t.batch_size // self.replicas
        for v in self.model.graph.input:
            if v.name not in self.data.train or not v.type.tensor_type.HasField("shape"):
                continue
            dims = v.type.tensor_type.shape.dim
            if len(dims) and dims[0].HasField("dim_value") and dims[0].dim_value != rows:
                fixed = dims[0].dim_value
                shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in dims]
                each = f" ({rows} rows for each of {self.replicas} replicas)" if self.replicas > 1 else ""
                raise ConfigError("training.batch_size",
                                  f"{t.batch_size}{each}, but the model input {v.name!r} has a fixed batch "
                                  f"size, {fixed} (shape {shape}; a model exported without a dynamic batch "
                                  f"axis): set training.batch_size to {fixed * self.replicas}, or export the "
                                  "model with a dynamic first axis")

    # ---- state ----
    def lr(self, step: int) -> float:
        s = self.cfg.schedule
        return learning_rate(step, self.total, self.cfg.optimizer.lr, s.kind, s.warmup_steps,
                             s.final_lr_ratio)

    def resolved_config(self) -> str:
        """The ``config.yaml`` this run writes: the checked config, with the output folder it uses."""
        resolved = self.cfg.to_dict()
        # where this run's files went, as an absolute path as the model's and data's are: the file works
        # from any folder (--resume from it found no checkpoint elsewhere)
        resolved.setdefault("output", {})["dir"] = os.path.abspath(self.out)
        return yaml.safe_dump(resolved, sort_keys=False)

    def reseed(self, step: int) -> None:
        """Seed the random nodes without a ``seed`` attribute (Dropout, RandomNormal, ...) for optimizer step
        ``step`` from (training.seed, step): a resumed run draws what an uninterrupted one draws. Under
        mpiexec each rank draws its own values (the rank is part of the seed)."""
        key = [self.cfg.training.seed, step, *([self.replica] if self.replicas > 1 else [])]
        set_random_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]))

    def whole_state(self) -> dict[str, np.ndarray]:
        """The session's state under the model's names: a horizontally split rank's gathered from every
        share (then a collective: every rank calls it)."""
        return self.sess.gather_state() if self.split > 1 else self.sess.get_state()

    def weights(self) -> dict[str, np.ndarray]:
        """The model's weights as trained so far (a collective under horizontal parallelism)."""
        state = self.whole_state()
        return {n: state[n] for n in self.weight_names}

    def eval_weights(self) -> dict[str, np.ndarray]:
        """The weights an eval scores: under mpiexec the state the ranks update apart (BatchNormalization
        running statistics) is rank 0's, which checkpoints and the export hold, so that the run's eval
        equals ``onnxtrain eval`` of its checkpoint (a collective: every rank calls it)."""
        w = self.weights()
        if self.comm is None:
            return w
        return {**w, **self.agree({n: v for n, v in w.items() if n not in self.trained})}

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``value`` itself when running alone)."""
        if self.comm is None:
            return value
        return self.comm.allgather_object(value, "agreeing with rank 0")[0]

    def save(self, st: RunState) -> str:
        """Write a checkpoint (rank 0; under ZeRO every rank must call this: it gathers the state)."""
        state = self.sess.gather_state()
        windows = self._log_windows(st)
        peers = self._adasum_states(state)
        path = checkpoint_path(self.out, st.global_step)
        if not self.main:
            return path
        applied = st.global_step - st.skipped_steps  # updates done (SGD's step: it keeps no counter)
        props = {**st.properties(self.lr(max(applied - 1, 0)), self.cfg), "log_windows": windows}
        if peers:
            props[ADASUM_RANKS] = self.ranks
        ckpt = session_to_checkpoint(self.sess, self.model, self.cfg.optimizer.lr, applied,
                                     props, state, self.layout)
        for rank, moments in enumerate(peers[1:], 1):  # each further rank's state as a group of its own
            ckpt.optimizer_groups.append(optimizer_group({**state, **moments}, self.layout,
                                                         self.cfg.optimizer.lr, applied,
                                                         rank_group_name(rank)))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_with_checksum(ckpt, path)
        keep = self.cfg.training.keep_checkpoints
        if keep:  # (not later ones: left by a run this one resumed before, passed over as damaged)
            for _, old in [c for c in list_checkpoints(self.out) if c[0] <= st.global_step][:-keep]:
                remove_checkpoint(old)
        return path

    def _adasum_states(self, state: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        """Under Adasum, every rank's own optimizer state, on rank 0 (a collective; [] elsewhere and
        without Adasum): the ranks' moments differ, so that --resume gives each rank its own back."""
        if not self.adasum:
            return []
        mine = optimizer_moments(state, self.layout)
        if not self.main:
            self.comm.isend_object(mine, 0, _ADASUM_TAG, "sending the Adasum optimizer state").wait()
            return []
        return [mine, *(self.comm.recv_object(r, _ADASUM_TAG, "gathering the Adasum optimizer states")
                        for r in range(1, self.ranks))]

    def _log_window(self, saved: str) -> tuple[float, int]:
        """This rank's (loss sum, count) of a checkpoint's ``log_windows`` property (JSON text)."""
        windows = json.loads(saved)
        if not windows:
            return 0.0, 0
        if len(windows) == self.ranks:  # written by the same number of ranks: each takes its own back
            return float(windows[self.rank][0]), int(windows[self.rank][1])
        # by another number: each rank takes their mean (the logged loss averages the ranks' means over
        # equal shares, so the window's steps count as they would have)
        return sum(float(w[0]) for w in windows) / len(windows), int(windows[0][1])

    def _log_windows(self, st: RunState) -> str:
        """Every rank's partial log window as JSON (floats written exactly), for the checkpoint."""
        mine = [st.window_loss, st.window_n]
        windows = [mine] if self.comm is None else self.comm.allgather_object(mine, "log windows")
        return json.dumps(windows)

    def restore(self, ckpt: Checkpoint, path: str = "") -> RunState:
        """Put ``ckpt`` (read from ``path``) into the session (every rank calls this with the same one)."""
        saved = ckpt.properties.get("config")
        diff: list[str] = []
        if isinstance(saved, str):
            diff = _run_property(path, "config", lambda: [k for k in changed_keys(saved, self.cfg)
                                                          if not _cannot_change_weights(k)])
            if self.cfg.schedule.kind == "constant":  # a step's rate does not depend on the run's length
                diff = [k for k in diff if k not in LENGTH_KEYS]
        own = self.adasum and ckpt.properties.get(ADASUM_RANKS) == self.ranks
        if self.adasum and not own and self.main:
            written = ckpt.properties.get(ADASUM_RANKS)
            held = (f"holds those of {written} ranks, and this run has {self.ranks}" if written else
                    "holds rank 0's only (written without Adasum or by an earlier version)")
            print(f"onnxtrain: warning: under Adasum each rank keeps optimizer state of its own, and "
                  f"{path or 'the checkpoint'} {held}: every rank continues from rank 0's, so the run goes "
                  "on close to, not exactly as, an uninterrupted one", file=sys.stderr)
        try:
            state = checkpoint_to_state(ckpt, self.sess, self.sess.gather_state(), self.layout,
                                        rank_group_name(self.rank) if own and self.rank else None)
            # checkpoint_to_state names every state tensor; under ZeRO a rank's strict load_state refuses
            # the unpartitioned state of weights that other ranks update, so it is not strict there
            self.sess.load_state(state, strict=self.comm is None)
        except (ValueError, TypeError, KeyError) as e:  # a shape, dtype or name that does not fit
            changed = f"; config keys changed since it was written: {', '.join(diff)}" if diff else ""
            what = "optimizer" if isinstance(e, OptimizerStateMismatch) else "model"
            raise ConfigError("--resume", f"the checkpoint {path or ''} does not fit this config's {what} "
                                          f"({e}){changed}") from None
        batch_size = _saved_batch_size(saved, self.cfg.training.batch_size)
        try:
            st = RunState.from_properties(ckpt.properties, batch_size)
        except ValueError as e:
            raise ValueError(f"Cannot resume from checkpoint {path!r}: {e}") from None
        _run_property(path, "data_order_rng", lambda: data_mod.rng_from_str(st.epoch_rng))  # (run() reads it)
        windows = ckpt.properties.get("log_windows")
        if isinstance(windows, str):
            window = _run_property(path, "log_windows", lambda: self._log_window(windows))
            st.window_loss, st.window_n = window
        redrawn = _unrepeatable_random_nodes(self.model, self.cfg.training.backend)
        if redrawn and self.main:
            shown = ", ".join(redrawn[:3]) + (f" and {len(redrawn) - 3} more" if len(redrawn) > 3 else "")
            nodes = "node" if len(redrawn) == 1 else "nodes"
            print(f"onnxtrain: warning: the random {nodes} {shown} cannot draw after --resume what an "
                  "uninterrupted run draws (a seed attribute restarts its generator; on the onnxruntime "
                  "backend random ops but Dropout draw from generators seeded when the session is built): "
                  "the run will not match an uninterrupted one", file=sys.stderr)
        if diff and self.main:
            print(f"onnxtrain: warning: resuming with a changed config ({', '.join(diff)}); the run will "
                  "not match an uninterrupted one", file=sys.stderr)
        self.total = self._epochs_length(st)
        if self.progress and self.main and path:  # (as the progress bar: not with -q)
            print(f"onnxtrain: resuming from {path} (step {st.global_step} of {self.total})", file=sys.stderr)
        if st.global_step > self.total and self.main:
            print(f"onnxtrain: warning: the checkpoint is at step {st.global_step}, past the {self.total} "
                  "steps this config trains (training.epochs / training.steps): nothing more to train",
                  file=sys.stderr)
        return st

    def _restore_whole(self, paths: list[str]) -> tuple[RunState, str]:
        """Restore the latest of the checkpoints ``paths`` (oldest first) that is whole: one whose SHA-256
        differs from the sums its save wrote beside it, or that cannot be read, is passed over with a warning
        naming it (the steps after the one restored are trained again, to the same weights). A ValueError
        when none is whole."""
        problems: list[str] = []
        for i in range(len(paths) - 1, -1, -1):
            path = paths[i]
            problem = self.agree(checksum_problem(path) if self.main else None)  # (rank 0 reads the files)
            if problem is None:
                try:
                    return self.restore(load_checkpoint(path), path), path
                except ConfigError:  # one that does not fit the config: the one before would not either
                    raise
                except ValueError as e:  # damaged, and written without sums (or they match a damaged save)
                    problem = str(e)
            problems.append(problem)
            if i and self.main:
                print(f"onnxtrain: warning: {problem}; resuming from the checkpoint before it, "
                      f"{paths[i - 1]}", file=sys.stderr)
        raise ValueError(f"no checkpoint in {os.path.dirname(paths[-1])} to resume from is whole: "
                         f"{problems[-1]}" + ("; and the later ones, as warned" if len(problems) > 1 else ""))

    def _epochs_length(self, st: RunState) -> int:
        """The run's length in optimizer steps, resumed at ``st``: ``training.steps``, or the step where
        ``training.epochs`` passes over the data end (steps of the checkpoint's batch size before, of this
        config's after: the same as epochs × steps an epoch unless the batch size changed)."""
        t = self.cfg.training
        if t.steps is not None or st.epoch >= t.epochs:  # (an epoch count already reached: as before)
            return self.total if t.steps is not None else min(self.total, st.global_step)
        # full steps left in this epoch (none when the data now has fewer rows than the epoch had used)
        left = max(self.data.n_train - st.epoch_pos, 0) // (t.batch_size * self.micro)
        return st.global_step + left + (t.epochs - st.epoch - 1) * self.steps_per_epoch

    # ---- metrics ----
    def _start_metrics(self, resume_step: int | None) -> _Logged:
        """``metrics.jsonl`` anew, or on resume cut to the records up to ``resume_step``."""
        records = _read_records(self.metrics_path, resume_step) if resume_step is not None else []
        text = "".join(json_line(r) for r in records)
        write_atomic(self.metrics_path, lambda f: f.write(text.encode()))
        logged = _Logged()
        for r in records:
            logged.append(r)
        return logged

    def _undefined_eval(self) -> tuple[str, ...]:
        """("eval_loss",) when the last eval counted no label (every one ignored or of weight 0: its NaN is
        0/0, not a divergence), else ()."""
        return ("eval_loss",) if self.evaluate.counted == 0 else ()

    def _log(self, records: _Logged, fh: Any, record: dict[str, Any],
             undefined: tuple[str, ...] = ()) -> None:
        """Append ``record`` to ``metrics.jsonl`` (``fh``, rank 0) and ``records``; a value that is not finite
        is warned about once as a divergence, unless it is one of ``undefined`` (nothing counted: 0/0)."""
        records.append(record, undefined)
        if "eval_loss" in undefined and not getattr(self, "_said_undefined", False):
            self._said_undefined = True
            if self.main:
                why = self.evaluate.why_undefined(self.data.eval)
                print(f"onnxtrain: warning: eval_loss at step {record.get('step')} is not defined (NaN, null "
                      f"in metrics.jsonl): {why}, so its mean is 0/0, as torch's CrossEntropyLoss gives",
                      file=sys.stderr)
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)
               and k not in undefined]
        if bad and not getattr(self, "_diverged", False):
            self._diverged = True
            if self.main:
                print(f"onnxtrain: warning: {', '.join(bad)} {record[bad[0]]} at step {record.get('step')}: "
                      "training diverges (a smaller optimizer.lr or gradient clipping may help)",
                      file=sys.stderr)
        if fh is not None:  # rank 0
            fh.write(json_line(record))
            fh.flush()

    def _labels_counted(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether a micro-batch holds a label that its loss does not ignore."""
        labels = feeds.get(self.cfg.model.labels)
        return labels is None or self.evaluate.labels.any_counted(labels)

    def _rank_mean(self, loss: float, held: bool | None) -> tuple[float, bool]:
        """The ranks' mean of their logged losses, and whether it is defined; with ``held`` given (labels
        that may all be ignored: whether this rank's window held a loss), of the ranks whose window held
        one (NaN, not defined: none did)."""
        if held is None:
            return self.comm.allreduce_scalar(loss, "averaging the logged loss") / self.ranks, True
        total = self.comm.allreduce_scalar(loss if held else 0.0, "averaging the logged loss")
        ranks = self.comm.allreduce_scalar(float(held), "counting the ranks with a logged loss")
        return (total / ranks, True) if ranks else (math.nan, False)

    def _stop_requested(self, signum: int) -> int:
        """The stop signal (SIGINT, SIGTERM; 0: none) seen here, or (under mpiexec) on any rank, SIGTERM
        first: all ranks stop after the same step, whichever of them the signal reached and when."""
        if self.comm is None:
            return signum
        seen = np.array([signum == signal.SIGINT, signum == signal.SIGTERM], np.float64)
        seen = self.comm.allreduce_(seen, "agreeing on a stop request")
        return int(signal.SIGTERM) if seen[1] else int(signal.SIGINT) if seen[0] else 0

    # ---- the loop ----
    def _full_step_left(self, st: RunState) -> bool:
        """Whether this epoch's order holds the samples of one more optimizer step."""
        t = self.cfg.training
        return st.epoch_pos + t.batch_size * self.micro <= self.data.n_train

    def run(self, resume: bool = False, overwrite: bool = True) -> RunResult:
        """Train; ``resume`` continues from the output folder's latest checkpoint. Without it, the
        folder's old checkpoints are deleted when ``overwrite`` (the CLI's --overwrite; the command
        line refuses by default), else a ConfigError says that the folder holds a run. A folder another
        run is training in is refused (a lock the process holds until it ends)."""
        self._folder_lock: int | None = None
        try:
            return self._run(resume, overwrite)
        finally:
            if self._folder_lock is not None:
                unlock_folder(self._folder_lock)
                self._folder_lock = None

    def _lock_output_folder(self) -> None:
        """Hold the output folder's lock (rank 0), or refuse on every rank when another run holds it."""
        busy = False
        if self.main:
            try:
                self._folder_lock = lock_folder(self.out)
            except BlockingIOError:
                busy = True
        if self.agree(busy):
            raise ConfigError("output.dir", f"another onnxtrain run is training in {self.out}; wait for it "
                                            "to end or choose another --output-dir (or output.dir)")

    def _checkpoints_to_resume(self) -> list[tuple[int, str]]:
        """The output folder's checkpoints (rank 0's list, on every rank), or a ConfigError naming --resume
        when there is none."""
        found = self.agree(list_checkpoints(self.out))
        if not found:
            raise ConfigError("--resume", f"no checkpoint in {os.path.join(self.out, 'checkpoints')} to "
                                          "continue from; start without --resume, or give the run's "
                                          "--output-dir")
        return found

    def _run(self, resume: bool, overwrite: bool) -> RunResult:
        main = self.main
        if not resume:  # files that no run wrote are never replaced, with --overwrite or without
            foreign = self.agree(foreign_files(self.out) if main else [])
            if foreign:
                raise ConfigError("", f"{self.out} holds {', '.join(foreign)}, which a new run would "
                                      "replace, but it is not the folder of an onnxtrain run (no "
                                      "metrics.jsonl or checkpoints); choose another --output-dir (or "
                                      "output.dir), or move them away (--overwrite replaces only a run's own "
                                      "files)")
        if not resume and not overwrite:
            old = self.agree(list_checkpoints(self.out))
            if old:
                raise ConfigError("", f"{self.out} already holds checkpoints of a run (the latest: step "
                                      f"{old[-1][0]}); pass --resume to continue it, --overwrite to start "
                                      "over (deleting them), or choose another --output-dir")
        if resume:  # refused before the output folder is made: a mistyped one stays unmade
            self._checkpoints_to_resume()
        if main:
            try:  # the check above cannot see every refusal (a root process in a pseudo file system)
                os.makedirs(self.out, exist_ok=True)
            except OSError as e:
                why = f"cannot make the output folder {self.out}: {e.strerror}"
                raise ConfigError("output.dir", f"{why} (the folder comes from output.dir or --output-dir)"
                                  ) from None
        self._lock_output_folder()  # before anything of an earlier run is read, removed or replaced
        if main:
            for f in remove_stale_temporaries(self.out):
                print(f"onnxtrain: removed {f}, left by a run killed while writing it", file=sys.stderr)
        # listed after the clean-up, which deletes a checkpoint that a save killed between its renames had put
        # in place (the folder is put back as it was before that save)
        found = self._checkpoints_to_resume() if resume else []
        rng = data_mod.order_rng(self.cfg.training.seed)
        st = RunState(epoch_rng=data_mod.rng_state_to_str(rng))
        last_ckpt = None
        self.resumed_at = None  # the step a resumed run continues from
        if resume:
            st, last_ckpt = self._restore_whole([p for _, p in found])
            self.resumed_at = st.global_step
            rng = data_mod.rng_from_str(st.epoch_rng)
        elif main:  # a new run: nothing of an earlier one stays
            for _, old in list_checkpoints(self.out):
                remove_checkpoint(old)
            for name in RUN_OUTPUTS:
                if os.path.isfile(os.path.join(self.out, name)):
                    os.unlink(os.path.join(self.out, name))
        records = _Logged()
        if main:
            records = self._start_metrics(st.global_step if resume else None)
            text = self.resolved_config()
            write_atomic(os.path.join(self.out, "config.yaml"), lambda f: f.write(text.encode()))
        perm = rng.permutation(self.data.n_train) if st.epoch_pos else None
        t, n = self.cfg.training, self.data.n_train
        if not self._full_step_left(st):  # resumed with a larger batch: none left in this epoch's order
            _end_epoch(st, rng)
            perm = None
        # (null: at the end of each epoch, which a resumed run with another batch size does not reach at
        # multiples of steps_per_epoch)
        eval_every, ckpt_every = t.eval_every, t.checkpoint_every
        last_eval: dict[str, float] = {}
        window_t, window_samples = time.perf_counter(), 0  # the loss window itself is in st
        lr_feed = np.zeros([1], np.float32)
        name = self.params.lr_params_feed_name
        scaler = None
        if self.sess.loss_scale_input_name:  # mixed precision: a dynamic loss scale, fed every run
            from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler

            scaler = DynamicLossScaler()
            if st.loss_scale:
                scaler.loss_scale, scaler.stable_steps = st.loss_scale, st.loss_scale_stable_steps
        show = self.progress and main
        # the label the loss ignores: a batch of such labels only has no loss (0/0) to log
        ignore = self.evaluate.labels.ignore
        bar = progress_bar(show, total=self.total, initial=st.global_step, desc=self.cfg.name)
        status, stopped_by = "finished", 0
        try:
            with (open(self.metrics_path, "a", encoding="utf-8") if main else nullcontext()) as fh, \
                    StopSignals() as stop:
                started = st.global_step
                while st.global_step < self.total:
                    stopped_by = self._stop_requested(stop.signum)
                    if stopped_by:
                        status = "interrupted"
                        here = checkpoint_path(self.out, st.global_step)
                        if st.global_step > started and last_ckpt != here:  # (a second Ctrl-C stops the
                            last_ckpt = self.save(st)  # save at once: the files stay whole)
                        break
                    lr = self.lr(st.global_step - st.skipped_steps)  # a skipped update does not advance it
                    lr_feed[0] = lr
                    self.reseed(st.global_step)
                    for micro in range(self.micro):
                        if perm is None:
                            st.epoch_rng = data_mod.rng_state_to_str(rng)
                            perm = rng.permutation(n)
                        idx = perm[st.epoch_pos:st.epoch_pos + t.batch_size]
                        mine = (parallel.split_batch(idx, rank=self.replica, size=self.replicas)
                                if self.replicas > 1 else idx)
                        feeds = {k: v[mine] for k, v in self.data.train.items()}
                        feeds[name] = lr_feed
                        if scaler is None:
                            loss = self.sess.run([self.cfg.model.loss], feeds)[0]
                        else:
                            feeds[self.sess.loss_scale_input_name] = scaler.feed()
                            if micro < self.micro - 1:  # a micro-step has no finite check yet
                                loss = self.sess.run([self.cfg.model.loss], feeds)[0]
                            else:
                                fetch = [self.cfg.model.loss, "all_gradients_finite"]
                                loss, finite = self.sess.run(fetch, feeds)
                                scaler.update_loss_scale(bool(finite))  # a skipped update halves the scale
                                st.skipped_steps += not bool(finite)
                                st.loss_scale = scaler.loss_scale
                                st.loss_scale_stable_steps = scaler.stable_steps
                        value = check_loss_value(loss, self.cfg.model.loss)
                        if ignore is None or self._labels_counted(feeds):  # (else: 0/0, no loss)
                            st.window_loss += value
                            st.window_n += 1
                        window_samples += len(idx)
                        st.epoch_pos += len(idx)
                        st.samples += len(idx)
                    st.global_step += 1
                    s = st.global_step
                    epoch_end = not self._full_step_left(st)
                    if epoch_end:  # the rest of the order is shorter than a step: dropped
                        _end_epoch(st, rng)
                        perm = None
                    bar.update(1)
                    if s % t.log_every == 0 or s == self.total:
                        now = time.perf_counter()
                        loss = st.window_loss / st.window_n if st.window_n else math.nan
                        held = st.window_n > 0
                        if self.comm is not None:  # each rank's loss is the mean over its equal share
                            loss, held = self._rank_mean(loss, held if ignore is not None else None)
                        rec = {"step": s, "epoch": st.epoch, "loss": loss, "lr": lr,
                               "samples_per_s": window_samples / max(now - window_t, 1e-9)}
                        self._log(records, fh, rec, () if held else ("loss",))
                        bar.set_postfix({"loss": f"{rec['loss']:.4f}", "lr": f"{lr:.2e}",
                                         "samples/s": f"{rec['samples_per_s']:.0f}"}, refresh=False)
                        st.window_loss, st.window_n, window_t, window_samples = 0.0, 0, now, 0
                    if (s % eval_every == 0 if eval_every else epoch_end) or s == self.total:
                        last_eval = self.evaluate(self.data.eval, self.eval_weights())
                        self._log(records, fh, {"step": s, "epoch": st.epoch, **last_eval},
                                  self._undefined_eval())
                        if show:
                            bar.write(f"step {s}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
                    if (s % ckpt_every == 0 if ckpt_every else epoch_end) or s == self.total:
                        last_ckpt = self.save(st)
                    if window_samples == 0:  # samples/s counts training time only
                        window_t = time.perf_counter()
        finally:
            bar.close()
        if status == "interrupted":
            where = f"the last checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
            if main:
                how = "interrupted" if stopped_by == signal.SIGINT else "stopped by SIGTERM"
                print(f"onnxtrain: {how} at step {st.global_step}; {where}"
                      + ("; continue with --resume" if last_ckpt else ""), file=sys.stderr)
            return RunResult(self.out, status, st.global_step, last_eval, last_ckpt, signal=stopped_by)
        with StopSignals() as late:  # the run's last outputs take seconds: a first signal waits for them
            last_eval, exported = self._finish(st, records, last_eval)
        if late.hit and main:
            what = "Ctrl-C" if late.signum == signal.SIGINT else signal.Signals(late.signum).name
            print(f"onnxtrain: {what} came after the last step; the final eval, plot and export were "
                  "finished first", file=sys.stderr)
        undefined = tuple(k for k, v in last_eval.items() if k == "eval_loss" and not math.isfinite(v)
                          and self.evaluate.counted_weight(self.data.eval, self.sess.get_state()) == 0)
        return RunResult(self.out, status, st.global_step, last_eval, last_ckpt, exported, undefined,
                         records.last_loss)

    def _finish(self, st: RunState, records: _Logged, last_eval: dict[str, float]
                ) -> tuple[dict[str, float], str | None]:
        """The final eval (unless the last step had one), the plot and the export; returns the last eval's
        metrics and the exported model's path."""
        main = self.main
        # rank 0 decides: only it reads old metrics on resume
        evaluated = records.last_eval is not None and records.last_eval.get("step") == st.global_step
        if self.agree(not evaluated):
            last_eval = self.evaluate(self.data.eval, self.eval_weights())
            with (open(self.metrics_path, "a", encoding="utf-8") if main else nullcontext()) as fh:
                self._log(records, fh, {"step": st.global_step, "epoch": st.epoch, **last_eval},
                          self._undefined_eval())
        # (metrics.jsonl holds null for a number that was not finite: NaN again here)
        r = records.last_eval
        if r is not None:
            last_eval = {k: math.nan if v is None else v for k, v in r.items() if k.startswith("eval_")}
        exported = None
        if self.cfg.output.export:  # (before the plot, which needs matplotlib)
            exported = os.path.join(self.out, "model.onnx")
            weights = self.weights() if main or self.split > 1 else {}  # (split: gathered on every rank)
            if main:
                export_model(self.model, self.cfg, weights, exported)
        if main and self.resumed_at is not None and st.global_step > self.resumed_at:
            for name, key, written in (("model.onnx", "output.export", self.cfg.output.export),
                                       ("metrics.png", "output.plot", self.cfg.output.plot)):
                if not written and os.path.isfile(os.path.join(self.out, name)):
                    print(f"onnxtrain: warning: {os.path.join(self.out, name)} is of an earlier step of this "
                          f"run, not of step {st.global_step}: {key} is false, so it was not replaced",
                          file=sys.stderr)
        if self.cfg.output.plot and main:
            try:
                plot_metrics(_read_records(self.metrics_path), os.path.join(self.out, "metrics.png"),
                             self.cfg.name)
            except ImportError as e:  # the run and its outputs stand; only the picture is missing
                print(f"onnxtrain: warning: no plot (metrics.png): matplotlib cannot be imported ({e}); "
                      "pip install matplotlib, or set output.plot=false", file=sys.stderr)
        return last_eval, exported


class _Logged:
    """What a run keeps of the records it logged: the last one with eval metrics, and the last training
    loss. The records themselves are in ``metrics.jsonl`` only (a list of them grew with every logged step
    for the whole run)."""

    __slots__ = ("last_eval", "last_loss")

    def __init__(self) -> None:
        self.last_eval: dict[str, Any] | None = None
        self.last_loss: float | None = None  # None: not defined (or a null read back: not known)

    def append(self, record: dict[str, Any], undefined: tuple[str, ...] = ()) -> None:
        if "eval_loss" in record:
            self.last_eval = record
        if "loss" in record:
            v = record["loss"]
            self.last_loss = None if v is None or "loss" in undefined else float(v)


def _read_records(path: str, up_to: int | None = None) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` at ``path`` (those of steps up to ``up_to`` when given); a line cut
    short by a crash is skipped, a missing file has none."""
    records: list[dict[str, Any]] = []
    if not os.path.isfile(path):
        return records
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if up_to is None or r.get("step", 0) <= up_to:
                records.append(r)
    return records


def _end_epoch(st: RunState, rng: np.random.Generator) -> None:
    """Move ``st`` to the start of the next epoch, whose order ``rng`` draws next."""
    st.epoch += 1
    st.epoch_pos = 0
    st.epoch_rng = data_mod.rng_state_to_str(rng)


# config keys that only say when to log, eval or checkpoint and where outputs go: changing them before a
# --resume leaves the weights as in an uninterrupted run
WEIGHT_NEUTRAL_KEYS = frozenset({"training.keep_checkpoints", "training.checkpoint_every",
                                 "training.log_every", "training.eval_every", "training.eval_batch_size"})


# the run's length: the schedule's decay reads it (a constant schedule, its warm-up too, does not), so a run
# with a constant schedule trained for longer goes on as an uninterrupted run of the new length
LENGTH_KEYS = frozenset({"training.steps", "training.epochs"})


# how the ranks share the work: a resumed run with another value goes on as an uninterrupted one (within
# float32 rounding, as with another number of ranks), so a change is not warned about
LAYOUT_KEYS = frozenset({"training.parameters.horizontal_parallel_size"})


def _cannot_change_weights(key: str) -> bool:
    return key in WEIGHT_NEUTRAL_KEYS or key in LAYOUT_KEYS or key.startswith("output.")


_UNREADABLE = (ValueError, TypeError, KeyError, IndexError, AttributeError)


def _run_property(path: str, name: str, read: Callable[[], _T]) -> _T:
    """``read()`` of the run property ``name`` of the checkpoint at ``path``; a ValueError naming the file
    and the property when its text is damaged (one saved without SHA-256 sums, which would have told)."""
    try:
        return read()
    except _UNREADABLE as e:
        raise ValueError(f"Cannot resume from checkpoint {path!r}: the file is damaged, its run property "
                         f"{name!r} cannot be read ({type(e).__name__}: {e})") from None


def _unrepeatable_random_nodes(model: onnx.ModelProto, backend: str) -> list[str]:
    """The model's random nodes (as "'name' (op)") whose draws a resumed run cannot repeat: those with a
    ``seed`` attribute (their generator restarts from it), and on the onnxruntime backend every one but
    Dropout (onnxruntime seeds them once, when it builds the session; the trainer reseeds Dropout at each
    step)."""
    def unrepeatable(n: onnx.NodeProto) -> bool:
        seeded = any(a.name == "seed" for a in n.attribute)
        return seeded or (backend == "onnxruntime" and n.op_type != "Dropout")

    return [f"{n.name or '(unnamed)'!r} ({n.op_type})" for n in model_nodes(model)
            if n.op_type in RANDOM_OPS and unrepeatable(n)]


def _saved_batch_size(saved: Any, default: int) -> int:
    """``training.batch_size`` of a checkpoint's saved config (JSON text), else ``default``."""
    try:
        return int(json.loads(saved)["training"]["batch_size"])
    except (TypeError, ValueError, KeyError):
        return default


def _written_by_a_run(path: str, folder: str) -> bool:
    """Whether ``path``, the config.yaml of ``folder``, is the one a run saved there: ``folder`` holds a run
    and the file is YAML as a run writes it (no comments or other layout a person would give it)."""
    if not is_run_folder(folder):
        return False
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        return text == yaml.safe_dump(yaml.safe_load(text), sort_keys=False)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False


def _holds(path: str, text: str) -> bool:
    """Whether the file ``path`` holds exactly ``text`` (UTF-8)."""
    try:
        with open(path, "rb") as f:
            return f.read() == text.encode()
    except OSError:
        return False


def json_line(record: dict[str, Any]) -> str:
    """``record`` as one line of JSON, a value that is not a finite number as null (NaN and inf are not
    JSON: other readers refuse the line)."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(clean, allow_nan=False) + "\n"

"""The training loop behind ``onnxtrain train``: progress, metrics, eval, checkpoints, resume, plot, export.

The output folder holds ``metrics.jsonl`` (one JSON object per logged step and per eval),
``checkpoints/step_<N>.ckpt`` (written atomically), ``metrics.png``, ``model.onnx`` (a plain
inference model of the trained weights) and ``config.yaml`` (the resolved configuration).

Ctrl-C (SIGINT) sets a flag that the loop checks between steps: it stops there without writing
anything, so the last complete checkpoint is what ``--resume`` continues from. A second Ctrl-C
raises KeyboardInterrupt at once (files are still only ever replaced atomically).

Under ``mpiexec -n N`` every rank runs the loop on its share of each global batch (``split_batch``:
the batch size stays the config's, so N ranks train as one process would); gradients are averaged
by the session. Rank 0 alone prints the progress bar and writes metrics, plots, checkpoints and the
export; eval is sharded over the ranks; on ``--resume`` every rank reads rank 0's latest checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import yaml
from onnx import helper

from onnxtrain import parallel
from onnxtrain.capi.options import SessionOptions
from onnxtrain.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxtrain.engine.backends import CONFIG_KEY, make_plan
from onnxtrain.ir.io import save_model_atomic, write_atomic
from onnxtrain.parameters import TrainingParameters
from onnxtrain.session import TrainingSession
from onnxtrain.train import data as data_mod
from onnxtrain.train.config import Config, ConfigError, FilesData
from onnxtrain.train.model import build_model, inference_model, user_inputs
from onnxtrain.train.schedule import learning_rate
from onnxtrain.train.state import (
    checkpoint_to_state,
    checkpoint_weights,
    optimizer_layout,
    session_to_checkpoint,
    trainable_names,
)

EXIT_INTERRUPTED = 130
OPTIMIZERS = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}
_CKPT = re.compile(r"^step_(\d+)\.ckpt$")


# ---- pieces that eval/export share with training ----------------------------------------------

def output_dir(cfg: Config, override: str | None = None) -> str:
    return override or cfg.output.dir or os.path.join("runs", cfg.name)


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
    """``path`` if it is a checkpoint file, else the latest checkpoint of the run folder ``path``."""
    if os.path.isfile(path):
        return path
    if os.path.isdir(path):
        found = list_checkpoints(path)
        if found:
            return found[-1][1]
        raise FileNotFoundError(f"no checkpoint in {os.path.join(path, 'checkpoints')}")
    raise FileNotFoundError(f"checkpoint not found: {path}")


def training_parameters(cfg: Config, model: onnx.ModelProto) -> TrainingParameters:
    """The legacy session's options for ``cfg``."""
    from onnxtrain.optim import get_optimizer
    from onnxtrain.training_graph import select_trainable

    t, o = cfg.training, cfg.optimizer
    p = TrainingParameters()
    p.loss_output_name = cfg.model.loss
    p.training_optimizer_name = OPTIMIZERS[o.name]
    p.gradient_accumulation_steps = t.gradient_accumulation_steps
    p.gradient_accumulation_mode = "auto"
    p.use_mixed_precision = t.mixed_precision
    p.data_parallel_size = t.data_parallel_size
    p.enable_grad_norm_clip = o.clip_grad_norm is not None
    for k, v in t.parameters.items():
        setattr(p, k, v)
    attrs: dict[str, float] = {}
    for key, value in (("alpha", o.betas[0] if o.betas else None), ("beta", o.betas[1] if o.betas else None),
                       ("epsilon", o.eps), ("lambda", o.weight_decay), ("max_norm_clip", o.clip_grad_norm)):
        if value is not None:
            attrs[key] = float(value)
    if attrs:  # added to the other attributes training.parameters.optimizer_attributes_map may give
        known = get_optimizer(p.training_optimizer_name).FLOAT_ATTRS
        attrs = {k: v for k, v in attrs.items() if k in known}
        given = p.optimizer_attributes_map
        p.optimizer_attributes_map = {**given, **{w: {**given.get(w, {}), **attrs}
                                                  for w in select_trainable(model, p)}}
    return p


def backend_options(backend: str) -> SessionOptions:
    """Session options selecting ``backend`` (training.backend: numpy | onnxruntime)."""
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    return so


def _session(cfg: Config, model: onnx.ModelProto, p: TrainingParameters) -> TrainingSession:
    """The legacy session; a refused option becomes a ConfigError naming the config key that set it."""
    try:
        return TrainingSession(model, p, backend_options(cfg.training.backend))
    except ImportError as e:  # training.backend: onnxruntime without the package
        raise ConfigError("training.backend", str(e)) from None
    except (ValueError, NotImplementedError) as e:
        keys = {"use_mixed_precision": "training.mixed_precision",
                "data_parallel_size": "training.data_parallel_size",
                "gradient_accumulation_steps": "training.gradient_accumulation_steps",
                **{k: f"training.parameters.{k}" for k in cfg.training.parameters}}
        hit = next((key for prop, key in keys.items() if prop in str(e)), None)
        if hit is None:
            raise
        prefix = "not implemented yet: " if isinstance(e, NotImplementedError) else ""
        raise ConfigError(hit, prefix + str(e)) from None


def feed_names(cfg: Config, model: onnx.ModelProto, ds: data_mod.Dataset) -> data_mod.Dataset:
    """``ds`` keyed by the model's input names and cast to their element types."""
    inputs = user_inputs(model)
    label = cfg.model.labels
    if isinstance(cfg.data, FilesData):
        for k in cfg.data.feeds:
            if k not in inputs:
                raise ConfigError(f"data.feeds.{k}", f"{k!r} is not an input of the model; inputs: {inputs}")
        rename = {k: k for k in cfg.data.feeds}
    else:
        others = [i for i in inputs if i != label]
        if len(others) != 1:
            raise ConfigError("data.source", f"{cfg.data.source} data feeds one input and the labels, but "
                                             f"the model has inputs {inputs}; use source: files with feeds")
        rename = {"x": others[0], "y": label}
    missing = [i for i in inputs if i not in rename.values()]
    if missing:
        raise ConfigError("data.feeds", f"no array for model input(s) {missing}")
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.input}

    def convert(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = {}
        for k, v in arrays.items():
            name = rename[k]
            dt = helper.tensor_dtype_to_np_dtype(types[name]) if types.get(name) else v.dtype
            out[name] = np.ascontiguousarray(v, dtype=dt)
        return out

    return data_mod.Dataset(convert(ds.train), convert(ds.eval))


class Evaluator:
    """Loss and accuracy over the eval set, on an inference-mode copy of the model fed the current weights.

    With ``comm`` (several ranks) each rank scores its shard of the eval set and the sums are combined.
    """

    def __init__(self, cfg: Config, model: onnx.ModelProto, weight_names: list[str],
                 comm: parallel.Communicator | None = None):
        self.cfg = cfg
        self.comm = comm
        self.names = [cfg.model.loss, cfg.model.logits]
        self.weight_names = weight_names
        self.plan = make_plan(inference_model(model, self.names, as_inputs=weight_names),
                              cfg.training.backend)

    def __call__(self, arrays: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> dict[str, float]:
        w = {n: weights[n] for n in self.weight_names}
        labels_name = self.cfg.model.labels
        if self.comm is not None:
            arrays = {k: parallel.shard(v, self.comm.rank, self.comm.size, drop_remainder=False)
                      for k, v in arrays.items()}
        loss_sum, n, correct, count = 0.0, 0, 0, 0
        for batch in data_mod.eval_batches(arrays, self.cfg.training.eval_batch_size):
            loss, logits = self.plan.run({**batch, **w}, self.names)
            labels = batch[labels_name]
            k = len(labels)
            loss_sum += float(loss) * k
            n += k
            if np.issubdtype(labels.dtype, np.integer) and logits.ndim == labels.ndim + 1:
                correct += int(np.count_nonzero(logits.argmax(axis=1) == labels))
                count += labels.size
        if self.comm is not None:
            sums = self.comm.allreduce_(np.array([loss_sum, n, correct, count], np.float64), "eval sums")
            loss_sum, n, correct, count = float(sums[0]), int(sums[1]), int(sums[2]), int(sums[3])
        out = {"eval_loss": loss_sum / max(n, 1)}
        if count:
            out["eval_accuracy"] = correct / count
        return out


def export_model(model: onnx.ModelProto, cfg: Config, weights: dict[str, np.ndarray], path: str) -> None:
    """Write the plain inference model (logits only, trained weights as initializers) to ``path``."""
    m = inference_model(model, [cfg.model.logits], weights=weights)
    m.producer_name = "onnxtrain"
    onnx.checker.check_model(m, full_check=True)
    save_model_atomic(m, path)


def plot_metrics(records: list[dict[str, Any]], path: str, title: str) -> None:
    """Train/eval loss and eval accuracy against step, as a PNG (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    ev = [r for r in records if "eval_loss" in r]
    acc = [(r["step"], r["eval_accuracy"]) for r in ev if "eval_accuracy" in r]
    fig, axes = plt.subplots(1, 2 if acc else 1, figsize=(10 if acc else 5.5, 4), squeeze=False)
    ax = axes[0][0]
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1)
    if ev:
        ax.plot([r["step"] for r in ev], [r["eval_loss"] for r in ev], "o-", label="eval loss", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if train and min(v for _, v in train) > 0:
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    if acc:
        ax = axes[0][1]
        ax.plot(*zip(*acc), "o-", color="tab:green", ms=3)
        ax.set_xlabel("step")
        ax.set_ylabel("eval accuracy")
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=100))
    plt.close(fig)


class _Interrupts:
    """Turns the first SIGINT into a flag (checked between steps); the second raises KeyboardInterrupt."""

    def __init__(self) -> None:
        self.hit = False
        self._prev: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.hit:
            raise KeyboardInterrupt
        self.hit = True

    def __enter__(self) -> _Interrupts:
        if threading.current_thread() is threading.main_thread():
            self._prev = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._prev is not None:
            signal.signal(signal.SIGINT, self._prev)


# ---- the run ------------------------------------------------------------------------------

@dataclass
class RunState:
    """Where a run is: saved in every checkpoint's properties."""

    global_step: int = 0  # optimizer steps done
    epoch: int = 0
    epoch_pos: int = 0  # micro-batches of this epoch already used
    epoch_rng: str = ""  # data-order generator state that this epoch's permutation is drawn from
    samples: int = 0
    loss_scale: float = 0.0  # mixed precision: the dynamic loss scaler's state (0: no scaler)
    loss_scale_stable_steps: int = 0
    # this rank's losses since the last metrics.jsonl entry (their sum and count): saved with the
    # checkpoint so that the first entry after --resume averages the same steps as without a stop
    window_loss: float = 0.0
    window_n: int = 0

    def properties(self, lr: float, cfg: Config) -> dict[str, int | float | str]:
        props: dict[str, int | float | str] = {
            "global_step": self.global_step, "epoch": self.epoch, "epoch_position": self.epoch_pos,
            "data_order_rng": self.epoch_rng, "samples_seen": self.samples, "learning_rate": lr,
            "config": json.dumps(cfg.to_dict(), sort_keys=True)}
        if self.loss_scale:  # powers of two: exact in the checkpoint's float32
            props.update(loss_scale=self.loss_scale, loss_scale_stable_steps=self.loss_scale_stable_steps)
        return props

    @classmethod
    def from_properties(cls, props: dict[str, Any]) -> RunState:
        try:
            return cls(int(props["global_step"]), int(props["epoch"]), int(props["epoch_position"]),
                       str(props["data_order_rng"]), int(props.get("samples_seen", 0)),
                       float(props.get("loss_scale", 0.0)), int(props.get("loss_scale_stable_steps", 0)))
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
        if t.batch_size % w.size:
            raise ConfigError("training.batch_size", f"{t.batch_size} does not split evenly over the "
                                                     f"{w.size} ranks mpiexec started (each rank takes an "
                                                     "equal part of every batch)")
        self.model = build_model(cfg)
        self.data = feed_names(cfg, self.model, data_mod.load_data(cfg))
        self.params = training_parameters(cfg, self.model)
        self.sess = _session(cfg, self.model, self.params)
        self.trained = trainable_names(self.sess)
        self.layout = optimizer_layout(self.sess, self.comm)
        inits = {i.name for i in self.model.graph.initializer}
        self.weight_names = [n for n in self.sess.get_state() if n in inits]
        self.evaluate = Evaluator(cfg, self.model, self.weight_names, self.comm)
        self.micro = t.gradient_accumulation_steps
        self.steps_per_epoch = self.data.n_train // (t.batch_size * self.micro)
        if self.steps_per_epoch < 1:
            raise ConfigError("training.batch_size", f"{t.batch_size} × {self.micro} accumulation steps is "
                                                     f"more than the {self.data.n_train} training samples")
        self.total = t.steps if t.steps is not None else t.epochs * self.steps_per_epoch
        self.metrics_path = os.path.join(self.out, "metrics.jsonl")

    # ---- state ----
    def lr(self, step: int) -> float:
        s = self.cfg.schedule
        return learning_rate(step, self.total, self.cfg.optimizer.lr, s.kind, s.warmup_steps,
                             s.final_lr_ratio)

    def weights(self) -> dict[str, np.ndarray]:
        state = self.sess.get_state()
        return {n: state[n] for n in self.weight_names}

    def agree(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank (``value`` itself when running alone)."""
        if self.comm is None:
            return value
        return self.comm.allgather_object(value, "agreeing with rank 0")[0]

    def save(self, st: RunState) -> str:
        """Write a checkpoint (rank 0; under ZeRO every rank must call this: it gathers the state)."""
        state = self.sess.gather_state()
        windows = self._log_windows(st)
        path = checkpoint_path(self.out, st.global_step)
        if not self.main:
            return path
        props = {**st.properties(self.lr(max(st.global_step - 1, 0)), self.cfg), "log_windows": windows}
        ckpt = session_to_checkpoint(self.sess, self.model, self.cfg.optimizer.lr, st.global_step,
                                     props, state, self.layout)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        save_checkpoint(ckpt, path)
        keep = self.cfg.training.keep_checkpoints
        if keep:
            for _, old in list_checkpoints(self.out)[:-keep]:
                for f in (old, old + ".data"):
                    if os.path.exists(f):
                        os.unlink(f)
        return path

    def _log_windows(self, st: RunState) -> str:
        """Every rank's partial log window as JSON (floats written exactly), for the checkpoint."""
        mine = [st.window_loss, st.window_n]
        windows = [mine] if self.comm is None else self.comm.allgather_object(mine, "log windows")
        return json.dumps(windows)

    def restore(self, ckpt: Checkpoint) -> RunState:
        """Put ``ckpt`` into the session (every rank calls this with the same checkpoint)."""
        state = checkpoint_to_state(ckpt, self.sess, self.sess.gather_state(), self.layout)
        # checkpoint_to_state names every state tensor; under ZeRO a rank's strict load_state refuses
        # the unpartitioned state of weights that other ranks update, so it is not strict there
        self.sess.load_state(state, strict=self.comm is None)
        st = RunState.from_properties(ckpt.properties)
        windows = ckpt.properties.get("log_windows")
        if isinstance(windows, str):  # written by the same number of ranks: each takes its own back
            windows = json.loads(windows)
            if len(windows) == self.ranks:
                st.window_loss, st.window_n = float(windows[self.rank][0]), int(windows[self.rank][1])
        saved = ckpt.properties.get("config")
        if isinstance(saved, str) and self.main:
            old, new = _flatten(json.loads(saved)), _flatten(self.cfg.to_dict())
            diff = sorted(k for k in old.keys() | new.keys()
                          if old.get(k) != new.get(k) and not _cannot_change_weights(k))
            if diff:
                print(f"onnxtrain: warning: resuming with a changed config ({', '.join(diff)}); the run will "
                      "not match an uninterrupted one", file=sys.stderr)
        return st

    # ---- metrics ----
    def _start_metrics(self, resume_step: int | None) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        if resume_step is not None and os.path.isfile(self.metrics_path):
            with open(self.metrics_path, encoding="utf-8") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except json.JSONDecodeError:
                        continue  # a line cut short by a crash
                    if r.get("step", 0) <= resume_step:
                        records.append(r)
        text = "".join(json.dumps(r) + "\n" for r in records)
        write_atomic(self.metrics_path, lambda f: f.write(text.encode()))
        return records

    def _log(self, records: list[dict[str, Any]], fh: Any, record: dict[str, Any]) -> None:
        records.append(record)
        if fh is not None:  # rank 0
            fh.write(json.dumps(record) + "\n")
            fh.flush()

    def _stop_requested(self, hit: bool) -> bool:
        """Ctrl-C seen here, or (under mpiexec) on any rank: all ranks stop after the same step."""
        if self.comm is None:
            return hit
        return self.comm.allreduce_scalar(float(hit), "agreeing on a stop request") > 0

    # ---- the loop ----
    def run(self, resume: bool = False, overwrite: bool = True) -> RunResult:
        """Train; ``resume`` continues from the output folder's latest checkpoint. Without it, the
        folder's old checkpoints are deleted when ``overwrite`` (the CLI's --overwrite; the command
        line refuses by default), else a ConfigError says that the folder holds a run."""
        main = self.main
        if not resume and not overwrite:
            old = self.agree(list_checkpoints(self.out))
            if old:
                raise ConfigError("", f"{self.out} already holds checkpoints of a run (the latest: step "
                                      f"{old[-1][0]}); pass --resume to continue it, --overwrite to start "
                                      "over (deleting them), or choose another --output-dir")
        if main:
            os.makedirs(self.out, exist_ok=True)
        rng = data_mod.order_rng(self.cfg.training.seed)
        st = RunState(epoch_rng=data_mod.rng_state_to_str(rng))
        last_ckpt = None
        if resume:
            found = self.agree(list_checkpoints(self.out))
            if not found:
                raise FileNotFoundError(f"--resume: no checkpoint in {os.path.join(self.out, 'checkpoints')}")
            last_ckpt = found[-1][1]
            st = self.restore(load_checkpoint(last_ckpt))
            rng = data_mod.rng_from_str(st.epoch_rng)
        elif main:
            for _, old in list_checkpoints(self.out):
                os.unlink(old)
        records: list[dict[str, Any]] = []
        if main:
            records = self._start_metrics(st.global_step if resume else None)
            text = yaml.safe_dump(self.cfg.to_dict(), sort_keys=False)
            write_atomic(os.path.join(self.out, "config.yaml"), lambda f: f.write(text.encode()))
        perm = rng.permutation(self.data.n_train) if st.epoch_pos else None
        t, n = self.cfg.training, self.data.n_train
        eval_every = t.eval_every or self.steps_per_epoch
        ckpt_every = t.checkpoint_every or self.steps_per_epoch
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
        from tqdm import tqdm

        show = self.progress and main
        bar = tqdm(total=self.total, initial=st.global_step, desc=self.cfg.name, unit="step",
                   disable=not show, dynamic_ncols=True, file=sys.stderr)
        status = "finished"
        try:
            with (open(self.metrics_path, "a", encoding="utf-8") if main else nullcontext()) as fh, \
                    _Interrupts() as stop:
                while st.global_step < self.total:
                    if self._stop_requested(stop.hit):
                        status = "interrupted"
                        break
                    lr = self.lr(st.global_step)
                    lr_feed[0] = lr
                    for micro in range(self.micro):
                        if perm is None:
                            st.epoch_rng = data_mod.rng_state_to_str(rng)
                            perm = rng.permutation(n)
                        idx = perm[st.epoch_pos * t.batch_size:(st.epoch_pos + 1) * t.batch_size]
                        mine = parallel.split_batch(idx, size=self.ranks) if self.ranks > 1 else idx
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
                                st.loss_scale = scaler.loss_scale
                                st.loss_scale_stable_steps = scaler.stable_steps
                        st.window_loss += float(loss)
                        st.window_n += 1
                        window_samples += len(idx)
                        st.epoch_pos += 1
                        st.samples += len(idx)
                    st.global_step += 1
                    s = st.global_step
                    if st.epoch_pos >= self.steps_per_epoch * self.micro:
                        st.epoch += 1
                        st.epoch_pos = 0
                        perm = None
                        st.epoch_rng = data_mod.rng_state_to_str(rng)
                    bar.update(1)
                    if s % t.log_every == 0 or s == self.total:
                        now = time.perf_counter()
                        loss = st.window_loss / st.window_n
                        if self.comm is not None:  # each rank's loss is the mean over its equal share
                            loss = self.comm.allreduce_scalar(loss, "averaging the logged loss") / self.ranks
                        rec = {"step": s, "epoch": st.epoch, "loss": loss, "lr": lr,
                               "samples_per_s": window_samples / max(now - window_t, 1e-9)}
                        self._log(records, fh, rec)
                        bar.set_postfix({"loss": f"{rec['loss']:.4f}", "lr": f"{lr:.2e}",
                                         "samples/s": f"{rec['samples_per_s']:.0f}"}, refresh=False)
                        st.window_loss, st.window_n, window_t, window_samples = 0.0, 0, now, 0
                    if s % eval_every == 0 or s == self.total:
                        last_eval = self.evaluate(self.data.eval, self.weights())
                        self._log(records, fh, {"step": s, "epoch": st.epoch, **last_eval})
                        if show:
                            bar.write(f"step {s}: " + ", ".join(f"{k} {v:.4f}" for k, v in last_eval.items()))
                    if s % ckpt_every == 0 or s == self.total:
                        last_ckpt = self.save(st)
                    if window_samples == 0:  # samples/s counts training time only
                        window_t = time.perf_counter()
        finally:
            bar.close()
        if status == "interrupted":
            where = f"the last checkpoint is {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
            if main:
                print(f"onnxtrain: interrupted at step {st.global_step}; {where}"
                      + ("; continue with --resume" if last_ckpt else ""), file=sys.stderr)
            return RunResult(self.out, status, st.global_step, last_eval, last_ckpt)
        # a final eval unless the last step had one (rank 0 decides: only it reads old metrics on resume)
        if self.agree(not any(r.get("step") == st.global_step and "eval_loss" in r for r in records)):
            last_eval = self.evaluate(self.data.eval, self.weights())
            with (open(self.metrics_path, "a", encoding="utf-8") if main else nullcontext()) as fh:
                self._log(records, fh, {"step": st.global_step, "epoch": st.epoch, **last_eval})
        last_eval = next(({k: v for k, v in r.items() if k.startswith("eval_")} for r in reversed(records)
                          if "eval_loss" in r), last_eval)
        exported = None
        if self.cfg.output.plot and main:
            plot_metrics(records, os.path.join(self.out, "metrics.png"), self.cfg.name)
        if self.cfg.output.export:
            exported = os.path.join(self.out, "model.onnx")
            if main:
                export_model(self.model, self.cfg, self.weights(), exported)
        return RunResult(self.out, status, st.global_step, last_eval, last_ckpt, exported)


# config keys that only say when to log, eval or checkpoint and where outputs go: changing them before a
# --resume leaves the weights as in an uninterrupted run
WEIGHT_NEUTRAL_KEYS = frozenset({"training.keep_checkpoints", "training.checkpoint_every",
                                 "training.log_every", "training.eval_every", "training.eval_batch_size"})


def _cannot_change_weights(key: str) -> bool:
    return key in WEIGHT_NEUTRAL_KEYS or key.startswith("output.")


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def load_for_inference(cfg: Config, checkpoint: str) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The config's model and the weights of ``checkpoint`` (a file or a run folder)."""
    path = find_checkpoint(checkpoint)
    ckpt = load_checkpoint(path)
    model = build_model(cfg)
    weights = checkpoint_weights(ckpt)
    inits = {t.name for t in model.graph.initializer}
    missing = sorted(set(ckpt.trainable) - inits)
    if missing:
        raise ValueError(f"checkpoint {path} does not fit the config's model: "
                         f"no initializer(s) {missing[:5]}")
    return model, weights


def evaluate_checkpoint(cfg: Config, checkpoint: str) -> dict[str, float]:
    """Eval loss and accuracy of ``checkpoint`` on the config's eval data."""
    model, weights = load_for_inference(cfg, checkpoint)
    data = feed_names(cfg, model, data_mod.load_data(cfg))
    names = [t.name for t in model.graph.initializer if t.name in weights]
    return Evaluator(cfg, model, names)(data.eval, weights)

"""Eval loss and accuracy: during a run (sharded over MPI ranks) and of a saved checkpoint."""

from __future__ import annotations

import math

import numpy as np
import onnx

from onnxtrain import parallel
from onnxtrain.autodiff.stable_rewrites import stable_log_sigmoids
from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.engine.backends import make_plan
from onnxtrain.engine.seeds import set_random_seed
from onnxtrain.train import data as data_mod
from onnxtrain.train.checksums import checksum_problem
from onnxtrain.train.config import Config, ConfigError, changed_keys
from onnxtrain.train.model import LABEL_LOSSES, build_model, inference_model, label_source
from onnxtrain.train.outputs import checkpoint_candidates, is_run_folder
from onnxtrain.train.session import feed_names, training_parameters
from onnxtrain.train.state import checkpoint_weights


def any_batch(model: onnx.ModelProto, weights: list[str]) -> onnx.ModelProto:
    """``model`` (changed in place) taking batches of any size: the fixed first dim of its data inputs and
    outputs made a symbol, its main graph's value_info (which may repeat the fixed size) dropped. Eval runs
    ``training.eval_batch_size`` rows at once, not the batch a torch export without ``dynamic_axes``
    declares: the numpy engine runs that as it is; onnxruntime refused it after the whole run had trained."""
    g = model.graph
    fixed = set(weights) | {t.name for t in g.initializer}
    for v in [*(i for i in g.input if i.name not in fixed), *g.output]:
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else ()
        if len(dims) and dims[0].HasField("dim_value"):
            dims[0].dim_param = "eval_batch"
    del g.value_info[:]
    return model


_EVAL_STREAM = 0xE7A1  # seed-sequence tag of the evals' random draws


class Evaluator:
    """Loss and accuracy over the eval set, on an inference-mode copy of the model fed the current weights.

    With ``comm`` (several ranks) each rank scores its shard of the eval set and the sums are combined.
    ``eval_loss`` is NaN when no label of the set counts (every one the loss's ``ignore_index``: 0/0, as
    torch's ``CrossEntropyLoss`` gives); ``counted`` is then 0 (see :meth:`counted_weight`).
    """

    def __init__(self, cfg: Config, model: onnx.ModelProto, weight_names: list[str],
                 comm: parallel.Communicator | None = None):
        self.cfg = cfg
        self.comm = comm
        self.names = [cfg.model.loss, cfg.model.logits]
        # the loss as training computes it (the exporters' log σ terms in stable form)
        scored = stable_log_sigmoids(inference_model(model, self.names, as_inputs=weight_names))
        self._seed()  # (onnxruntime seeds a plan's random nodes when it builds it)
        self.plan = make_plan(any_batch(scored, weight_names), cfg.training.backend)
        # the weights the inference-mode model still reads (a Dropout's training_mode initializer goes)
        taken = {v.name for v in scored.graph.input}
        self.weight_names = [n for n in weight_names if n in taken]
        self.labels = LabelLoss.of(model, cfg.model.labels, cfg.model.loss)
        self.counted = math.nan  # the labels' weight in the last eval's mean loss (0: none counted)

    def _seed(self) -> None:
        """Seed the random nodes that eval mode keeps (RandomNormal, ...; Dropout is off) from training.seed
        (and the rank), so that every eval, in a run or of its checkpoint, draws the same values."""
        key = [self.cfg.training.seed, _EVAL_STREAM, *([self.comm.rank] if self.comm is not None else [])]
        set_random_seed(int(np.random.SeedSequence(key).generate_state(1, np.uint64)[0]))

    def __call__(self, arrays: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> dict[str, float]:
        self._seed()
        w = {n: weights[n] for n in self.weight_names}
        labels_name = self.cfg.model.labels
        if self.comm is not None:
            arrays = {k: parallel.shard(v, self.comm.rank, self.comm.size, drop_remainder=False)
                      for k, v in arrays.items()}
        loss_sum, n, correct, count = 0.0, 0.0, 0, 0
        for batch in data_mod.eval_batches(arrays, self.cfg.training.eval_batch_size):
            loss, logits = self.plan.run({**batch, **w}, self.names)
            labels = batch[labels_name]
            kept = self.labels.kept(labels)
            k = self.labels.weight(labels, kept, weights)  # the batch's share of the whole set's mean loss
            if k:  # (a batch of ignored labels only: its mean is 0/0, and it counts for nothing)
                loss_sum += float(loss) * k
                n += k
            if np.issubdtype(labels.dtype, np.integer) and logits.ndim == labels.ndim + 1:
                right = logits.argmax(axis=1) == labels
                correct += int(np.count_nonzero(right if kept is None else right & kept))
                count += labels.size if kept is None else int(np.count_nonzero(kept))
        if self.comm is not None:
            sums = self.comm.allreduce_(np.array([loss_sum, n, correct, count], np.float64), "eval sums")
            loss_sum, n, correct, count = float(sums[0]), float(sums[1]), int(sums[2]), int(sums[3])
        self.counted = n
        out = {"eval_loss": loss_sum / n if n else math.nan}  # (no label counted: 0/0, as torch's)
        if count:
            out["eval_accuracy"] = correct / count
        return out


    def counted_weight(self, arrays: dict[str, np.ndarray], weights: dict[str, np.ndarray]) -> float:
        """The weight of the labels of ``arrays`` (the whole eval set, on this rank alone) in its mean loss,
        without running the model: 0 when every label is ignored (``eval_loss`` is then NaN)."""
        labels = arrays.get(self.cfg.model.labels)
        if labels is None:
            return float(len(next(iter(arrays.values()))))
        return float(self.labels.weight(labels, self.labels.kept(labels), weights))

    def why_undefined(self, arrays: dict[str, np.ndarray]) -> str:
        """Why no label of ``arrays`` (the whole eval set) counts in its mean loss, in words."""
        labels = arrays.get(self.cfg.model.labels)
        ignore, cw = self.labels.ignore, self.labels.class_weights
        ignored = labels is not None and self.labels.kept(labels) is not None
        if ignored and not self.labels.any_counted(labels):
            return f"every label of the eval set is the loss's ignore_index ({ignore})"
        if cw is not None:
            but = f" that is not the loss's ignore_index ({ignore})" if ignored else ""
            return f"the class weights ({cw!r}) are 0 for every label of the eval set{but}"
        return "no label of the eval set counts in the loss"


class LabelLoss:
    """How the eval set's batches make up its mean loss and accuracy, from the SoftmaxCrossEntropyLoss or
    NegativeLogLikelihoodLoss node that reads the labels: labels equal to its ``ignore_index`` count in
    neither, and when that node's mean (reduction ``mean``) is the model's loss, each batch weighs as its
    labels do (their class weights summed, when the weights are an initializer), as torch's
    ``CrossEntropyLoss`` over the whole set; otherwise as its rows. A batch whose labels are all ignored
    weighs nothing (its mean is 0/0)."""

    def __init__(self, ignore: int | None = None, by_labels: bool = False, class_weights: str | None = None,
                 initial: np.ndarray | None = None):
        self.ignore = ignore
        self.by_labels = by_labels
        self.class_weights = class_weights  # the initializer holding them
        self.initial = initial  # their value in the model

    @classmethod
    def of(cls, model: onnx.ModelProto, labels: str, loss: str) -> LabelLoss:
        """The labels' loss node of ``model`` (labels input ``labels``, fed to it as they are or reshaped;
        loss output ``loss``)."""
        g = model.graph
        node = next((n for n in g.node if n.op_type in LABEL_LOSSES and len(n.input) > 1
                     and label_source(g, n.input[1]) == labels), None)
        if node is None:
            return cls()
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        ignore = attrs.get("ignore_index")
        reduction = attrs.get("reduction", b"mean")
        reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
        producers = {o: n for n in g.node for o in n.output}
        value = loss
        while value in producers and producers[value] is not node and producers[value].op_type == "Identity":
            value = producers[value].input[0]  # (an exporter's Identity between the loss and the output)
        weights = name = None
        if len(node.input) > 2 and node.input[2]:
            name = node.input[2]
            weights = next((onnx.numpy_helper.to_array(t) for t in g.initializer if t.name == name), None)
            if weights is None:  # class weights fed or computed: their sum per batch is not known here
                return cls(ignore)
        by_labels = reduction == "mean" and producers.get(value) is node
        return cls(ignore, by_labels, name, weights)

    def _ignores_some(self, labels: np.ndarray) -> bool:
        """Whether the ignore_index applies to ``labels`` (the loss has one and they are integers)."""
        return self.ignore is not None and np.issubdtype(labels.dtype, np.integer)

    def kept(self, labels: np.ndarray) -> np.ndarray | None:
        """Which labels count (None: all of them)."""
        if not self._ignores_some(labels):
            return None
        kept = labels != self.ignore
        return None if kept.all() else kept

    def any_counted(self, labels: np.ndarray) -> bool:
        """Whether some label of a batch counts (a batch of ignored labels only has no loss: 0/0)."""
        return not self._ignores_some(labels) or bool((labels != self.ignore).any())

    def weight(self, labels: np.ndarray, kept: np.ndarray | None, weights: dict[str, np.ndarray]) -> float:
        """The batch's weight in the eval set's mean loss, in rows (its row count when no label is left out
        and there are no class weights); ``weights`` are the model's current ones."""
        rows = len(labels)
        if kept is not None and not kept.any():
            return 0
        if not self.by_labels or (kept is None and self.class_weights is None):
            return rows
        per_row = labels.size / rows
        if self.class_weights is None:
            return int(np.count_nonzero(kept)) / per_row
        counted = labels if kept is None else labels[kept]
        values = np.asarray(weights.get(self.class_weights, self.initial), np.float64)
        return float(values[counted].sum()) / per_row


def load_for_inference(cfg: Config, checkpoint: str, data_split: bool = False
                       ) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The config's model and the weights of ``checkpoint`` (a file or a run folder); a ConfigError naming
    the tensors when the checkpoint does not fit the model (a weight the config would train that it lacks,
    a trained weight the model does not have, a shape that differs). With ``data_split``, a warning when the
    config's data keys or seed differ from those the run saved (its held-out split then differs). A
    checkpoint whose SHA-256 differs from the sums its save wrote beside it is refused (a ValueError naming
    it) or, the latest of a run folder, passed over for the one before it, with a warning naming it."""
    from onnxtrain.training_graph import select_trainable

    path = _whole_checkpoint(checkpoint_candidates(checkpoint))
    model = build_model(cfg)  # (its building's transient copies before the checkpoint's weights are held)
    ckpt = load_checkpoint(path, optimizer_state=False)  # (the moments: twice the weights, never used)
    if data_split:
        _warn_split_changes(cfg, ckpt.properties.get("config"), path)
    weights = checkpoint_weights(ckpt)
    inits = {t.name: list(t.dims) for t in model.graph.initializer}
    problems = []
    extra = sorted(set(ckpt.trainable) - set(inits))
    if extra:
        problems.append(f"the model has no initializer(s) {_few(extra)}")
    missing = sorted(set(select_trainable(model, training_parameters(cfg, model))) - set(weights))
    if missing:
        problems.append(f"the checkpoint has no value for {_few(missing)}")
    shapes = [f"{n} (checkpoint {list(np.shape(weights[n]))}, model {dims})" for n, dims in inits.items()
              if n in weights and list(np.shape(weights[n])) != dims]
    if shapes:
        problems.append(f"shapes differ: {_few(shapes, quote=False)}")
    if problems:
        raise ConfigError("", f"checkpoint {path} does not fit this config's model: {'; '.join(problems)}"
                              f"{_own_config_hint(cfg, path)}")
    return model, weights


def _own_config_hint(cfg: Config, checkpoint: str) -> str:
    """"; give the run's own config, <run>/config.yaml ..." when ``checkpoint`` is in a run folder whose saved
    config is not the one given (a run trained with --set values, evaluated with the file alone), else "" (a
    checkpoint copied elsewhere: the config.yaml beside its folder is no run's)."""
    import os

    folder = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint)))
    own = os.path.join(folder, "config.yaml")
    if not os.path.isfile(own) or not is_run_folder(folder) or (
            cfg.source and os.path.realpath(cfg.source) == os.path.realpath(own)):
        return ""
    return f"; give the run's own config, {own}, which holds the values it trained with"


def _whole_checkpoint(paths: list[str]) -> str:
    """The first of ``paths`` (latest first) whose files match their SHA-256 sums (or have none); a warning
    names each one passed over, a ValueError the last when none matches."""
    import sys

    problems = []
    for i, path in enumerate(paths):
        problem = _killed_save(path) or checksum_problem(path)
        if problem is None:
            return path
        problems.append(problem)
        if i + 1 < len(paths) and parallel.world().rank == 0:
            print(f"onnxtrain: warning: {problem}; using the checkpoint before it, {paths[i + 1]}",
                  file=sys.stderr)
    raise ValueError(problems[-1] + ("; no checkpoint of the folder is whole" if len(problems) > 1 else ""))


def _killed_save(path: str) -> str | None:
    """What became of the checkpoint at ``path`` when a save of it was killed between its renames (its
    commit journal beside it): the folder is put back as it was before that save, as its load would do
    (:func:`onnxtrain.checkpoint.load_checkpoint`), here before the checkpoint is chosen, since that takes
    away a checkpoint the killed save had renamed into place. A sentence naming it when it is gone, else None
    (a checkpoint put back is checked by its sums as any other; a folder that cannot be written is left to
    the load, which refuses the mixed files)."""
    import os
    import sys

    from onnxtrain.ir.io import recover_commits

    folder = os.path.dirname(os.path.abspath(path))
    try:
        put_back = recover_commits(folder, naming=[path, path + ".data"]).put_back
    except (OSError, ValueError):
        return None
    if not os.path.exists(path):
        return f"checkpoint {path} is gone: the save that wrote it was killed part way, and was undone"
    if put_back and parallel.world().rank == 0:
        print(f"onnxtrain: warning: a save of checkpoint {path} was killed part way: put back "
              f"{', '.join(put_back)} as they were before it", file=sys.stderr)
    return None


def _warn_split_changes(cfg: Config, saved: object, path: str) -> None:
    """Warn when the config's data keys or ``training.seed`` (which draws a held-out split from the data)
    differ from those of the run that wrote the checkpoint (its config, as saved in it)."""
    if not isinstance(saved, str):
        return
    import sys

    try:
        keys = [k for k in changed_keys(saved, cfg) if k.startswith("data.") or k == "training.seed"]
    except (ValueError, AttributeError, TypeError) as e:  # JSON cut short, or not an object
        if parallel.world().rank == 0:
            print(f"onnxtrain: warning: the config saved in {path} cannot be read (the file is damaged: "
                  f"{type(e).__name__}: {e}), so whether its data split is this config's is not checked",
                  file=sys.stderr)
        return
    if keys and parallel.world().rank == 0:
        verb = "differs" if len(keys) == 1 else "differ"
        print(f"onnxtrain: warning: {', '.join(keys)} {verb} from the run that wrote {path}: the eval data "
              "may not be the run's (a held-out split drawn with another seed or fraction holds samples it "
              "trained on); evaluate with the run's own config.yaml", file=sys.stderr)


def _few(names: list[str], quote: bool = True, n: int = 5) -> str:
    shown = ", ".join(repr(x) if quote else x for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def evaluate_checkpoint(cfg: Config, checkpoint: str) -> dict[str, float]:
    """Eval loss and accuracy of ``checkpoint`` on the config's eval data."""
    model, weights = load_for_inference(cfg, checkpoint, data_split=True)
    data = feed_names(cfg, model, data_mod.load_data(cfg))
    names = [t.name for t in model.graph.initializer if t.name in weights]
    return Evaluator(cfg, model, names)(data.eval, weights)

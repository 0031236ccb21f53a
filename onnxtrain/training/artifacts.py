"""``generate_artifacts``: training, eval and optimizer models plus the checkpoint (spec §1).

Interface note (the exact graph I/O this module writes; ``<p>`` = a trainable parameter name,
``<f>`` = a frozen one; parameters are listed in the base model's initializer order, §1.2).
Every graph is standard ONNX (default domain only), IR version = the lowest its opset allows (older
runtimes load it: onnxruntime-training 1.19 reads IR 10 at most).

Files (``prefix`` prepended): ``training_model.onnx``, ``eval_model.onnx``, ``checkpoint``,
``nominal_checkpoint`` (when asked), ``optimizer_model.onnx`` (when an optimizer is given). Every file
is written to a temporary first and all are renamed at the end (``onnxtrain.ir.io.StagedFiles``): an
error before then leaves the folder's earlier set whole. The training and eval models keep the base
model's doc_string, model_version, producer name and version, domain, graph name and doc_string and
metadata_props (as onnxruntime-training's generator keeps them; the base's own ``onnxtrain.*`` keys,
from an earlier generation, are dropped).

``training_model.onnx``
    inputs:  user inputs of the base model (in order), inputs created by the loss
             (``target`` / ``labels`` / custom names), every trainable and frozen parameter
             (``<p>``, ``<f>``, initializer order), ``<x>_grad.accumulation.buffer`` per
             requires_grad graph input ``<x>`` (graph input order; same type as ``<x>``), then
             ``<p>_grad.accumulation.buffer`` per trainable parameter (same dtype/shape as
             ``<p>``), ``lazy_reset_grad`` BOOL[1].
    outputs: the loss (first, the differentiated value), then ``additional_output_names`` in
             order, then ``<x>_grad.accumulation.out`` per requires_grad graph input, then
             ``<p>_grad.accumulation.out`` per trainable parameter.
    A loss of more than one element (``reduction="none"``) is differentiated as the sum of its
    elements (the backward pass starts from ones), as onnxruntime-training's is; the loss output
    keeps its shape. A requires_grad graph input is no parameter: it stays a user input and
    is not in the checkpoint.
    Difference from onnxruntime (no in-place ops in standard ONNX): ``<p>_grad.accumulation.out``
    is the **new gradient buffer** (dtype/shape of ``<p>``), not a BOOL[1] flag:
    ``out = lazy_reset_grad ? <p>_grad : buffer + <p>_grad``. The runtime stores it as the new
    buffer (which is the parameter's ``.grad``).

``eval_model.onnx``
    inputs:  user inputs, loss inputs, every parameter ``<p>``/``<f>`` (no buffers, no flag).
    outputs: the loss, then ``additional_output_names``. Dropout and BatchNormalization switched
    to inference mode (a Dropout's ``training_mode`` input becomes ``''``, omitted;
    BatchNormalization's running-statistics outputs removed).

``optimizer_model.onnx`` (one tensor per parameter instead of onnxruntime's sequences; every
group lists the trainable parameters in checkpoint order)
    inputs:  ``learning_rate`` FLOAT[1]; ``step`` INT64[1] (= completed steps + 1, the ``t`` of
             the bias correction); ``<p>`` for every p (params); ``<p>_grad`` for every p
             (gradients, i.e. the accumulation buffers); ``<p>.momentum0`` for every p
             (first_order_moments); AdamW only: ``<p>.momentum1`` for every p
             (second_order_moments). SGD declares ``<p>.momentum0`` but never reads it.
    outputs: ``<p>.out`` (new parameter) for every p; AdamW: ``<p>.momentum0.out`` then
             ``<p>.momentum1.out`` for every p; with ``clip_grad`` also ``<p>_grad.out``
             (the clipped gradient, which onnxruntime writes back in place) for every p.
    Rule: every output ``X.out`` is the new value of input ``X``. The per-parameter state keys
    are the checkpoint's momentum names (``momentum0``, ``momentum1``).
    Names that collide (parameters ``learning_rate``/``step``, ``W`` beside ``W.momentum0`` or
    ``W.out``): the fixed inputs keep theirs, then parameters, gradients and states in that order;
    a later input or an output whose name is taken gets a fresh one (``learning_rate_1``,
    ``W.momentum0_1``, ``W.out_1``), and metadata_props ``onnxtrain.optimizer_io`` = JSON
    ``{"inputs": {name: [parameter, role]}, "outputs": {name: input}}`` (role ``param``,
    ``gradient`` or a state key) says what each is. Without collisions there is no such record.
    metadata_props: ``onnxtrain.optimizer`` = ``AdamW`` | ``SGD``.

``checkpoint``: onnxruntime-training's format via ``onnxtrain.checkpoint`` — trainable
(requires_grad) and frozen parameters in initializer order, no optimizer group, no properties.

onnxtrain extensions (keyword-only arguments of ``generate_artifacts``; off by default, and then
every file is exactly what it is without them):

``mixed_precision="float16" | "bfloat16"`` (spec §8, ``graph_transforms.mixed_precision``)
    The training model's forward pass computes in the half type on the float32 parameters (the
    master weights; each is cast in-graph to a half twin where a half op reads it), with the loss
    region, softmax statistics, reductions and normalization statistics in float32. Its backward
    pass is of ``loss · loss_scale``: a new input ``loss_scale`` FLOAT[1] (after the parameters),
    so ``<p>_grad.accumulation.out`` (float32, like ``<p>``) holds loss-scaled gradients; the loss
    output stays the unscaled float32 loss. The optimizer model takes ``loss_scale`` FLOAT[1]
    right after ``step``; it computes the global norm N of the (accumulated) scaled gradients,
    ``all_gradients_finite`` = isfinite(N) (BOOL scalar, its last output), divides the gradients
    by L (with ``clip_grad``: by ``max(L, (N + L·1e-6)/max_norm)``, i.e. clipping in the
    loss-scaled domain, spec §10), updates, and falls back to the old value of every output when
    the flag is false (parameters, moments and gradients unchanged; the host keeps ``step``). With
    ``clip_grad``, ``<p>_grad.out`` is the clipped gradient times L (the buffers stay loss-scaled).
    The eval model stays float32 (evaluation and export see the master weights).
    bfloat16 artifacts use opset 20 (bfloat16 ConstantOfShape). metadata_props of both models:
    ``onnxtrain.loss_scaling`` = JSON ``{"dtype", "loss_scale", "all_gradients_finite"}``; the
    training model also keeps the pass's ``onnxtrain.mixed_precision`` record.

``recompute={...}`` (spec §9, ``graph_transforms.recompute``)
    Keys ``gelu``, ``attn_dropout``, ``transformer_layer`` (bools), ``number_recompute_layers``
    (int) and ``checkpoints`` (names of forward values to keep; every other activation is
    recomputed). The marked forward values of the training model are recomputed right before their
    first backward use instead of being kept alive: same interface, bit-identical results, lower
    peak memory. metadata_props of the training model: ``onnxtrain.recompute`` = the JSON dict.
"""

from __future__ import annotations

import enum
import inspect
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.builder import GradientError, build_gradient_model, upgrade_opset
from onnxtrain.autodiff.exporter_checks import export_hint
from onnxtrain.autodiff.stable_rewrites import stable_log_sigmoids
from onnxtrain.engine.backends import load_onnxruntime
from onnxtrain.engine.feed_sizes import SAME_SIZE_KEY
from onnxtrain.engine.ort_half_scatters import half_scatters_in_float32
from onnxtrain.errors import program_hint
from onnxtrain.graph_transforms import mixed_precision as mp_pass
from onnxtrain.graph_transforms.recompute import recompute_or_warn
from onnxtrain.ir.builder import FLOAT_TYPES, NameGen, carry_description, model_opset, pausing_gc
from onnxtrain.ir.graphs import (
    chain_shared_batch_norms,
    in_topological_order,
    node_reads,
    path_to,
    text_value_names,
    train_batch_norms,
    untie_batch_norm_statistics,
)
from onnxtrain.ir.io import StagedFiles, stage_model_sized
from onnxtrain.ir.types import shown_dims
from onnxtrain.training import onnxblock
from onnxtrain.training.api._accumulation import ACCUMULATED_SUFFIX as ACC_OUT_SUFFIX
from onnxtrain.training.api._accumulation import BUFFER_SUFFIX
from onnxtrain.training.api._accumulation import RESET_INPUT as RESET
from onnxtrain.training.api._graph import parse_model_file
from onnxtrain.training.artifact_meta import (
    LOSS_SCALE,
    LOSS_SCALING_KEY,
    RECOMPUTE_KEY,
    ArtifactError,
    UnknownLossInput,
    add_metadata,
    finish_model,
)
from onnxtrain.training.onnxblock.model_accessor import UnknownValue, editing, value_info
from onnxtrain.training.onnxblock.optim import Optimizer as OptimizerBlock
from onnxtrain.training.optimizer_model import build_optimizer_model
from onnxtrain.user_warning import warn

RECOMPUTE_KEYS = ("gelu", "attn_dropout", "transformer_layer", "number_recompute_layers", "checkpoints")


class LossType(enum.Enum):
    """Built-in losses (spec §1.7)."""

    MSELoss = 1
    CrossEntropyLoss = 2
    BCEWithLogitsLoss = 3
    L1Loss = 4


class OptimType(enum.Enum):
    """Built-in optimizers (spec §1.8), with their default hyper-parameters."""

    AdamW = 1
    SGD = 2


def _loss_block(loss: LossType | onnxblock.Block | None) -> onnxblock.Block:
    if loss is None:
        return onnxblock.blocks.PassThrough()
    if isinstance(loss, onnxblock.TrainingBlock):
        # (its call would build a second gradient graph inside the one built here; onnxruntime-training's
        # artifacts of one fail to generate or to load)
        raise ArtifactError(
            f"loss: {type(loss).__name__} is a TrainingBlock, which builds a training model of its own; "
            "generate_artifacts builds the training model around the loss, so pass the loss as a plain "
            "onnxblock.Block (the same build, subclassing onnxblock.Block)"
        )
    if isinstance(loss, onnxblock.Block):
        return loss
    if isinstance(loss, LossType):
        return {
            LossType.MSELoss: onnxblock.loss.MSELoss,
            LossType.CrossEntropyLoss: onnxblock.loss.CrossEntropyLoss,
            LossType.BCEWithLogitsLoss: onnxblock.loss.BCEWithLogitsLoss,
            LossType.L1Loss: onnxblock.loss.L1Loss,
        }[loss]()
    raise ArtifactError(
        f"Unknown loss provided {type(loss).__name__}: {loss!r}. Use a LossType, an "
        "onnxblock.Block (custom loss) or None (the model's first output is the loss)."
    )


class _LabelsNamed(onnxblock.Block):
    """A built-in loss whose labels input takes the name ``labels``."""

    def __init__(self, inner: onnxblock.Block, labels: str) -> None:
        super().__init__()
        self.inner, self.labels = inner, labels

    def build(self, prediction: str) -> str:
        return self.inner(prediction, self.labels)


def _labels_apart(base: onnx.ModelProto, loss: Any, block: onnxblock.Block) -> onnxblock.Block:
    """``block``, a built-in loss, with a labels input of its own when the model computes or holds a value of
    the labels' default name (``target``, CrossEntropyLoss's ``labels``) that is no graph input: the loss
    would take that value for the labels (as onnxruntime-training's does, silently), and the training model
    would have no labels input. A graph input of that name is the labels, as there."""
    if not isinstance(loss, LossType):
        return block
    default = "labels" if loss is LossType.CrossEntropyLoss else "target"
    g = base.graph
    inputs = {v.name for v in g.input}
    made = {o for n in g.node for o in n.output} | {t.name for t in g.initializer}
    if default in inputs or default not in made:
        return block
    name = NameGen.for_model(base)(default)
    warn(f"generate_artifacts: the model has a value named {default!r} that is not a graph input; the "
         f"{loss.name} labels input is named {name!r} instead, so that the loss does not take that value "
         "for its labels")
    return _LabelsNamed(block, name)


def _optimizer_block(optimizer: Any) -> OptimizerBlock | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, OptimizerBlock):
        return optimizer
    if optimizer is OptimType.AdamW:
        return onnxblock.optim.AdamW()
    if optimizer is OptimType.SGD:
        return onnxblock.optim.SGD()
    raise TypeError(
        f"Unknown optimizer provided {type(optimizer).__name__}: {optimizer!r}. Use OptimType.AdamW, "
        "OptimType.SGD or an onnxblock.optim.AdamW(...)/SGD(...) block."
    )


def _load(model: Any) -> onnx.ModelProto:
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"model file not found: {path}")
        m = parse_model_file(path)  # (refused as the training Module's loader refuses it)
        if not m.graph.node and not m.graph.output:  # (an empty file parses as an empty model)
            raise ValueError(f"Load model from {path} failed: not a valid ONNX model (its "
                             f"{os.path.getsize(path)} bytes hold no graph)")
        from onnxtrain.engine.interface import check_initializers

        check_initializers(m.graph, f"model file {path}")
        return in_topological_order(_text_names(m))
    if isinstance(model, onnx.ModelProto):  # (past 2 GiB too: copied, never serialized)
        m = in_topological_order(_text_names(model))
        if m is model:
            m = onnx.ModelProto()
            m.CopyFrom(model)
        return m
    raise ArtifactError(
        f"Unknown model type {type(model).__name__}: pass an onnx.ModelProto or the path of an .onnx "
        f"file{program_hint(model)}."
    )


def _text_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with value names that are not valid UTF-8 decoded (the artifacts make names from them)."""
    try:
        return text_value_names(model)
    except ValueError as e:
        raise ArtifactError(str(e)) from None


def _names(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArtifactError(
            f"Unknown type provided for {what}: {type(value).__name__}. Expected a list of tensor names."
        )
    out = []
    for v in value:
        if not isinstance(v, str):
            raise ArtifactError(f"{what} must hold tensor names (str), got {v!r}")
        if v not in out:
            out.append(v)
    return out


def _mixed_precision_dtype(value: Any) -> str | None:
    if value is None:
        return None
    if value not in mp_pass.HALF_TYPES:
        raise ArtifactError(
            f"mixed_precision must be None, 'float16' or 'bfloat16', got {value!r}"
        )
    return str(value)


def _recompute_options(value: Any) -> dict[str, Any] | None:
    """The validated ``recompute`` dict (None or an empty dict: no recompute)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ArtifactError(f"recompute must be a dict with keys among {list(RECOMPUTE_KEYS)}, got "
                            f"{type(value).__name__}")
    unknown = sorted(set(value) - set(RECOMPUTE_KEYS))
    if unknown:
        raise ArtifactError(f"recompute: unknown key(s) {unknown}; known: {list(RECOMPUTE_KEYS)}")
    out: dict[str, Any] = {}
    for k in ("gelu", "attn_dropout", "transformer_layer"):
        if k in value:
            if not isinstance(value[k], (bool, np.bool_)):
                raise ArtifactError(f"recompute[{k!r}] must be a bool, got {value[k]!r}")
            out[k] = bool(value[k])
    if "number_recompute_layers" in value:
        n = value["number_recompute_layers"]
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ArtifactError(f"recompute['number_recompute_layers'] must be an int >= 0, got {n!r}")
        out["number_recompute_layers"] = int(n)
    if value.get("checkpoints") is not None:
        out["checkpoints"] = _names(value["checkpoints"], "recompute['checkpoints']")
    return out or None


@pausing_gc
def generate_artifacts(
    model: onnx.ModelProto | str | os.PathLike,
    requires_grad: Sequence[str] | None = None,
    frozen_params: Sequence[str] | None = None,
    loss: LossType | onnxblock.Block | None = None,
    optimizer: Any = None,
    artifact_directory: str | bytes | os.PathLike | None = None,
    prefix: str = "",
    ort_format: bool = False,
    custom_op_library: str | bytes | os.PathLike | None = None,
    additional_output_names: Sequence[str] | None = None,
    nominal_checkpoint: bool = False,
    loss_input_names: Sequence[str] | None = None,
    *,
    mixed_precision: str | None = None,
    recompute: dict[str, Any] | None = None,
) -> None:
    """Write the training, eval and optimizer models and the checkpoint for ``model`` (spec §1).

    ``requires_grad`` initializers become trainable parameters, ``frozen_params`` fixed ones
    (both are graph inputs and go to the checkpoint); other initializers stay constants.
    ``loss`` is a LossType, a custom ``onnxblock.Block`` or None (the first model output is the
    loss). Example::

        generate_artifacts(onnx.load("mlp.onnx"), requires_grad=["fc1.weight", "fc1.bias"],
                           loss=LossType.CrossEntropyLoss, optimizer=OptimType.AdamW,
                           artifact_directory="artifacts")

    onnxtrain extensions (keyword-only; see the module docstring): ``mixed_precision="float16"``
    or ``"bfloat16"`` trains in half precision on float32 master weights with loss scaling (the
    ``Module`` feeds ``loss_scale`` from its loss scaler, the ``Optimizer`` skips non-finite
    steps); ``recompute={"transformer_layer": True}`` (or ``gelu``, ``attn_dropout``,
    ``number_recompute_layers``, ``checkpoints=[names]``) trades compute for memory.
    """
    if custom_op_library is not None:
        raise ArtifactError(
            f"custom_op_library={custom_op_library!r} is not supported: onnxtrain builds "
            "gradients for standard ONNX ops only."
        )
    half = _mixed_precision_dtype(mixed_precision)
    recompute_opts = _recompute_options(recompute)
    from onnxtrain.engine.interface import standard_model

    base = standard_model(_load(model))  # (torch's export_modules_as_functions, sparse initializers)
    loss_block = _labels_apart(base, loss, _loss_block(loss))
    trainable = _names(requires_grad, "requires_grad")
    frozen = _names(frozen_params, "frozen_params")
    both = set(trainable) & set(frozen)
    if both:
        raise ArtifactError(
            f"A parameter cannot be frozen and require gradient computation at the same time {sorted(both)}"
        )
    extra_outputs = _names(additional_output_names, "additional output names")
    given = list(additional_output_names or ())
    repeated = sorted({n for n in given if given.count(n) > 1})
    if repeated:
        raise ArtifactError(f"additional_output_names repeats {repeated}: each output is returned once")
    # an empty list means every model output, as in onnxruntime-training (it tests the list's truth)
    loss_inputs = None if loss_input_names is None else _names(loss_input_names, "loss input names") or None
    outputs = [o.name for o in base.graph.output]
    if isinstance(loss, LossType) and loss_inputs is None and len(outputs) > 1:
        # the reference silently takes the second output as the target
        raise ArtifactError(
            f"the model has {len(outputs)} outputs {outputs} but {loss.name} takes one prediction: say which "
            "with loss_input_names=[...] (the others can be kept with additional_output_names)"
        )
    opt_block = _optimizer_block(optimizer)
    if opt_block is not None and not trainable:
        _refuse_optimizer_without_parameters([])
    folder = os.getcwd() if artifact_directory is None else os.fsdecode(artifact_directory)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise NotADirectoryError(f"artifact_directory is a file, not a folder: {folder}")
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"artifact_directory does not exist: {folder}")
    if not isinstance(prefix, str):
        raise ArtifactError(f"prefix must be a str, got {type(prefix).__name__}")

    if half is not None and not trainable:
        raise ArtifactError("mixed_precision needs parameters to train: list them in requires_grad")
    training, evaluation, ckpt = build_training_models(
        base, trainable, frozen, loss_block, extra_outputs, loss_inputs,
        mixed_precision=half, recompute=recompute_opts,
    )
    optimizer_model = None
    if opt_block is not None and not ckpt[0]:  # requires_grad named graph inputs only
        _refuse_optimizer_without_parameters(trainable)
    if opt_block is not None:
        params = training_input_types(training, ckpt[0])
        optimizer_model = build_optimizer_model(opt_block, params, model_opset(training),
                                                mixed_precision=half)
    from onnxtrain.checkpoint import Checkpoint, stage_checkpoint

    def path(name: str) -> str:
        return os.path.join(folder, prefix + name)

    # every file goes to a temporary first; they are renamed into place together only when all are
    # written, so an error (or a kill) before then leaves the folder's earlier set as it was
    models = {"training_model.onnx": training, "eval_model.onnx": evaluation}
    if optimizer_model is not None:
        models["optimizer_model.onnx"] = optimizer_model
    with StagedFiles() as files:
        stage_model_sized(files, training, path("training_model.onnx"))  # past 2 GiB: <file>.data
        stage_model_sized(files, evaluation, path("eval_model.onnx"))
        # the parameters in the model's initializer order, as onnxruntime-training's generator writes them
        stage_checkpoint(files, Checkpoint(ckpt[0], ckpt[1], [], {}), path("checkpoint"),
                         sort_parameters=False)
        if nominal_checkpoint:
            stage_checkpoint(files, Checkpoint(ckpt[0], ckpt[1], [], {}, nominal=True),
                             path("nominal_checkpoint"), sort_parameters=False)
        if optimizer_model is not None:
            stage_model_sized(files, optimizer_model, path("optimizer_model.onnx"))
        if ort_format:
            _stage_ort_format(files, {prefix + n: m for n, m in models.items()}, folder)
            warn("ort_format=True: onnxruntime-training cannot train the .ort training and optimizer models "
                 "(its Module accumulates gradients in place and drops the training model's gradient "
                 "outputs, so its gradients stay 0; its Optimizer refuses the optimizer model): its eval "
                 "model and checkpoint work there, and onnxtrain's Module trains these artifacts")
    written = artifact_files(nominal_checkpoint, optimizer_model is not None)
    stale = [prefix + n for n in ARTIFACT_FILES if n not in written and os.path.exists(path(n))]
    if stale:  # an earlier generation's files, which do not go with these (as onnxruntime, they are kept)
        warn(f"{folder} also holds {stale} from an earlier generation, which do not go with the artifacts "
             "just written; delete them, or generate into an empty folder")


def _stage_ort_format(files: StagedFiles, models: dict[str, onnx.ModelProto], folder: str) -> None:
    """``ort_format=True``: each model (by its file name) also as a ``.ort`` file (onnxruntime's flatbuffer
    format, "Fixed" optimisations) with its ``.required_operators.config``, made by onnxruntime's own
    converter as onnxruntime-training made them, and staged with the other files; without onnxruntime
    installed, a warning (the .onnx files are written)."""
    try:
        load_onnxruntime()  # telemetry off, as the backend imports it
        from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort
    except ImportError as e:
        warn(f"ort_format=True: the .ort files need onnxruntime's converter, which cannot be imported ({e}); "
             "the .onnx artifacts are written (pip install onnxruntime, then python -m "
             "onnxruntime.tools.convert_onnx_models_to_ort <folder>)")
        return
    import contextlib
    import io
    import logging
    import pathlib
    import tempfile
    import warnings

    # the converter logs each config file it writes (its module loggers set their own levels), prints its
    # progress and leaves a file it read open: all silenced while it runs
    loggers = [logging.getLogger(n) for n in ("ort_format_model", "ort_format_model.utils")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory() as work, warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            source, out = pathlib.Path(work, "onnx"), pathlib.Path(work, "ort")
            source.mkdir()
            for name, model in models.items():  # one by one: a config file per model
                onnx.save_model(model, source / name)
                with contextlib.redirect_stdout(io.StringIO()):
                    convert_onnx_models_to_ort(source / name, output_dir=out,
                                               optimization_styles=[OptimizationStyle.Fixed])
            for made in sorted(out.iterdir()):
                data = made.read_bytes()
                if made.name.endswith(".config"):  # the models it names: where they go, not the temporary
                    for tmp in (out, source):
                        data = data.replace(str(tmp).encode(), os.path.abspath(folder).encode())
                files.write(os.path.join(folder, made.name), lambda f, data=data: f.write(data))
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


# the files generate_artifacts may write (each with the prefix)
ARTIFACT_FILES = ("training_model.onnx", "eval_model.onnx", "checkpoint", "nominal_checkpoint",
                  "optimizer_model.onnx")


def artifact_files(nominal_checkpoint: bool, optimizer: bool) -> list[str]:
    """The files (without prefix) one generation writes, given its nominal_checkpoint and optimizer
    options."""
    wanted = {"nominal_checkpoint": nominal_checkpoint, "optimizer_model.onnx": optimizer}
    return [n for n in ARTIFACT_FILES if wanted.get(n, True)]


def _refuse_optimizer_without_parameters(input_grads: list[str]) -> None:
    """An optimizer needs trainable parameters; ``input_grads``: the graph inputs requires_grad names."""
    why = (f" ({input_grads} are graph inputs: the training model outputs their gradients, no optimizer "
           "updates them)") if input_grads else ""
    raise ArtifactError(
        "An optimizer was requested but no parameter requires a gradient: list the "
        f"initializers to train in requires_grad{why}."
    )


def training_input_type(model: onnx.ModelProto, name: str) -> onnx.TypeProto:
    for v in model.graph.input:
        if v.name == name:
            return v.type
    raise ArtifactError(f"{name!r} is not an input of the model")


def training_input_types(model: onnx.ModelProto, names: list[str]) -> list[tuple[str, onnx.TypeProto]]:
    """(name, type) of the graph inputs ``names`` of ``model``, as :func:`training_input_type` gives them
    (the first input of a name), reading the inputs once (not once a name)."""
    types: dict[str, onnx.TypeProto] = {}
    for v in model.graph.input:
        types.setdefault(v.name, v.type)
    missing = next((n for n in names if n not in types), None)
    if missing is not None:
        raise ArtifactError(f"{missing!r} is not an input of the model")
    return [(n, types[n]) for n in names]


# ---- training and eval models ---------------------------------------------------------------------
def _unknown_loss_input(name: str, model_outputs: list[str]) -> UnknownLossInput:
    """The error for a loss input that is neither a value of the model nor one the loss block adds (a
    LookupError too, as onnxruntime-training raised)."""
    return UnknownLossInput(f"loss input {name!r} is not a value of the model, nor one the loss block adds; "
                            f"outputs: {model_outputs}")


def _declare_as_computed(g: onnx.GraphProto, types: Mapping[str, onnx.TypeProto]) -> None:
    """Rewrite, in place, the value_info entries of ``g`` whose element type, rank or a static dim the
    computed ``types`` (:func:`~onnxtrain.ir.builder.value_types`, which warned naming them) contradict, with
    the computed type: the eval and training models carry the graph's declarations, and onnx.checker's full
    check refuses contradicted ones."""
    for v in g.value_info:
        t = types.get(v.name)
        if t is None or not t.HasField("tensor_type") or not v.type.HasField("tensor_type"):
            continue
        have, got = v.type.tensor_type, t.tensor_type
        wrong = bool(got.elem_type) and have.elem_type != got.elem_type
        if have.HasField("shape") and got.HasField("shape"):
            dims, computed = have.shape.dim, got.shape.dim
            wrong = wrong or len(dims) != len(computed) or any(
                d.HasField("dim_value") and c.HasField("dim_value") and d.dim_value != c.dim_value
                for d, c in zip(dims, computed))
        if wrong:
            v.type.CopyFrom(t)


def build_training_models(
    base: onnx.ModelProto,
    trainable: list[str],
    frozen: list[str],
    loss: onnxblock.Block,
    extra_outputs: list[str],
    loss_inputs: list[str] | None,
    *,
    mixed_precision: str | None = None,
    recompute: dict[str, Any] | None = None,
) -> tuple[onnx.ModelProto, onnx.ModelProto, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
    """(training model, eval model, (trainable, frozen) parameter values) — spec §1.3–1.5.

    ``mixed_precision`` ("float16"/"bfloat16") and ``recompute`` (validated options) transform the
    training model only (see the module docstring)."""
    m = upgrade_opset(base)
    chain_shared_batch_norms(m, NameGen.for_model(m))  # a layer applied twice updates its statistics twice
    untie_batch_norm_statistics(m, NameGen.for_model(m))  # an exporter's merged ones: each layer its own
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    unknown = [n for n in frozen if n not in inits]
    if unknown:  # onnxruntime-training looks frozen names up among the initializers and skips the others
        warn(f"frozen_params names {unknown} that are not initializers of the model; they are left out")
        frozen = [n for n in frozen if n in inits]
    _check_float({n: inits[n].data_type for n in trainable if n in inits}, "initializers")
    model_outputs = [o.name for o in g.output]
    args = model_outputs if loss_inputs is None else loss_inputs
    with editing(m) as acc:
        _check_arity(loss, args)
        # a loss input may be one the loss block adds itself (a teacher's logits, labels) as a graph input
        absent = [n for n in args if not acc.has_value(n)]
        try:
            result = loss(*args)
        except Exception as e:
            if absent:
                raise _unknown_loss_input(absent[0], model_outputs) from e
            raise
        for n in absent:
            if not acc.has_value(n):
                raise _unknown_loss_input(n, model_outputs)
        outs = [result] if isinstance(result, str) else list(result)
        if not outs or not all(isinstance(o, str) for o in outs):
            raise ArtifactError(
                f"the loss block must return a tensor name or a tuple of names, got {result!r}"
            )
        for n in outs:  # (else the eval model failed onnx.checker without naming it)
            if not acc.has_value(n):
                raise UnknownValue(f"the loss block's build() returned {n!r}, which is not a value of the "
                                   "model")
        for n in extra_outputs:
            if not acc.has_value(n):
                raise LookupError(f"The provided name {n} is not a graph value info or a graph output.")
        all_outs = outs + extra_outputs
        # (a model that lists an output twice keeps it twice, as onnxruntime-training's generator does)
        dup = sorted({n for n in extra_outputs if all_outs.count(n) > 1})
        if dup:
            raise ArtifactError(
                f"graph outputs would repeat {dup}: additional_output_names must not repeat the loss outputs"
            )
        types = acc.types()
    # a ForwardBlock in the loss replaces the model in place (CopyFrom), which leaves the graph and the
    # initializers taken above detached from it: take them again (the same names: the base's initializers)
    g = m.graph
    inits = {t.name: t for t in g.initializer if t.name in inits}
    _declare_as_computed(g, types)
    input_grads = _input_gradients(base, g, inits, trainable)  # (loss inputs such as target count too)
    if isinstance(loss, onnxblock.blocks.PassThrough):
        _warn_non_scalar_output(outs[0], types)
    del g.output[:]
    g.output.extend(value_info(n, types) for n in all_outs)
    params = [t.name for t in g.initializer if t.name in set(trainable) | set(frozen)]  # initializer order
    values = {n: numpy_helper.to_array(inits[n]) for n in params}
    kept = [t for t in g.initializer if t.name not in values]
    del g.initializer[:]
    g.initializer.extend(kept)
    user_inputs = [v for v in g.input if v.name not in values]
    del g.input[:]
    g.input.extend(user_inputs)
    g.input.extend(helper.make_tensor_value_info(n, inits[n].data_type, list(inits[n].dims)) for n in params)
    ckpt = ({n: values[n] for n in params if n in trainable}, {n: values[n] for n in params if n in frozen})

    # the loss the eval model computes in the stable form the training model differentiates (log σ terms)
    evaluation = finish_model(stable_log_sigmoids(_inference_mode(m)), "eval")
    # as onnxruntime-training's generator: batch statistics, whatever mode the model was exported in
    train_batch_norms(m.graph.node, NameGen.for_model(m))
    train_names = list(ckpt[0])
    if mixed_precision is not None:
        not_f32 = [p for p in train_names if inits[p].data_type != TensorProto.FLOAT]
        if not_f32:
            raise ArtifactError(f"mixed_precision trains float32 master weights; parameter(s) {not_f32} "
                                "are not float32")
        if input_grads:
            raise ArtifactError(f"mixed_precision computes loss-scaled gradients of parameters only; "
                                f"requires_grad names graph input(s) {input_grads}")
    # as onnxruntime-training's: the gradients of graph inputs first (graph input order), then the parameters'
    wrt = input_grads + train_names
    grad = _gradient_model(m, all_outs, wrt, mixed_precision=mixed_precision,
                           recompute=recompute, weights=params)
    # float16/bfloat16 scatters that add in float32, as the GradientGraphBuilder writes them: onnxruntime's
    # CPU provider has no half kernel for them, so the training model would not run there
    grad = half_scatters_in_float32(grad)
    training = _with_accumulation(grad, wrt)
    _repeat_outputs(training, all_outs)
    if mixed_precision is not None:
        # the pass names the input 'loss_scale', or a fresh name when a parameter has that one
        info = mp_pass.mixed_precision_info(training)
        scale = LOSS_SCALE if info is None else info.loss_scale
        add_metadata(training, LOSS_SCALING_KEY, {"dtype": mixed_precision, "loss_scale": scale})
    if recompute is not None:
        add_metadata(training, RECOMPUTE_KEY, recompute)
    training = finish_model(training, "training")
    own = {LOSS_SCALING_KEY, mp_pass.METADATA_KEY} if mixed_precision is not None else set()
    own.add(SAME_SIZE_KEY)  # (the dims the Module checks the feeds of: build_gradient_model's feeds_checked)
    _carry_model_info(base, training, own | ({RECOMPUTE_KEY} if recompute is not None else set()))
    _carry_model_info(base, evaluation, set())
    return training, evaluation, ckpt


def _repeat_outputs(model: onnx.ModelProto, names: list[str]) -> None:
    """Give ``model``'s outputs ``names`` first, in that order, repeats included (a model output listed twice
    stays twice in the training model, as in onnxruntime-training's: the gradient graph lists it once), the
    others after them."""
    if len(set(names)) == len(names):
        return
    g = model.graph
    by_name, listed = {o.name: o for o in g.output}, set(names)
    outputs = [by_name[n] for n in names] + [o for o in g.output if o.name not in listed]
    copies = [onnx.ValueInfoProto() for _ in outputs]
    for c, o in zip(copies, outputs):
        c.CopyFrom(o)
    del g.output[:]
    g.output.extend(copies)


def _carry_model_info(base: onnx.ModelProto, m: onnx.ModelProto, own: set[str]) -> None:
    """Give ``m`` the base model's description, as onnxruntime-training's generator keeps it
    (:func:`carry_description`; ``own``: the keys this generation wrote into ``m``), and its graph's
    doc_string."""
    carry_description(base, m, own)
    m.graph.doc_string = base.graph.doc_string


def _check_initializers(base: onnx.ModelProto, inits: dict[str, onnx.TensorProto], names: list[str],
                        what: str, also: str = "") -> None:
    """Error naming the ``names`` that are not initializers (``also``: what else they may be)."""
    missing = [n for n in names if n not in inits]
    if missing:
        raise ArtifactError(
            f"{what} names {missing} that are not initializers of the model{also}; initializers: "
            f"{list(inits)[:20]}{' ...' if len(inits) > 20 else ''}"
            + export_hint(base)
        )


def _check_float(elem_types: dict[str, int], what: str) -> None:
    """Error naming the requires_grad values (name -> element type) that are not floating-point."""
    not_float = [n for n, t in elem_types.items() if t not in FLOAT_TYPES]
    if not_float:
        raise ArtifactError(
            f"requires_grad names {not_float}, {what} of type "
            f"{[onnx.TensorProto.DataType.Name(elem_types[n]) for n in not_float]}: only floating-point "
            "tensors have gradients"
        )


def _input_gradients(base: onnx.ModelProto, g: onnx.GraphProto, inits: dict[str, onnx.TensorProto],
                     requires_grad: list[str]) -> list[str]:
    """The requires_grad names that are graph inputs (not parameters), in graph input order."""
    inputs = {v.name: v for v in g.input if v.name not in inits}
    _check_initializers(base, inits, [n for n in requires_grad if n not in inputs], "requires_grad",
                        " nor graph inputs")
    wanted = [n for n in inputs if n in set(requires_grad)]
    _check_float({n: inputs[n].type.tensor_type.elem_type for n in wanted}, "graph inputs")
    return wanted


def _warn_non_scalar_output(loss: str, types: dict[str, onnx.TypeProto]) -> None:
    """Warn when a model output, differentiated without a loss block, is not one element."""
    shape = _shape(types.get(loss))
    if shape is not None and any(d != 1 for d in shape):
        warn(f"no loss was given and the differentiated model output {loss!r} has shape {shape}: the "
             "training model differentiates the sum of its elements (as onnxruntime-training does); "
             "give a loss (loss=LossType..., a custom block) if that is not intended")


def _check_arity(block: onnxblock.Block, args: list[str]) -> None:
    """The loss block gets one positional argument per loss input (onnxruntime issue #19008)."""
    try:
        inspect.signature(block.build).bind(*args)
    except TypeError as e:
        raise ArtifactError(
            f"the loss block {type(block).__name__}.build() cannot take the {len(args)} loss "
            f"input(s) {args} ({e}); the loss receives every model output in order unless "
            "loss_input_names says which ones"
        ) from None
    except ValueError:
        pass  # no signature (builtin): let the call decide


def _gradient_model(
    m: onnx.ModelProto, outputs: list[str], trainable: list[str],
    *, mixed_precision: str | None = None, recompute: dict[str, Any] | None = None,
    weights: Sequence[str] = (),
) -> onnx.ModelProto:
    if not trainable:
        if recompute is not None:
            raise ArtifactError("recompute needs parameters to train: list them in requires_grad")
        return m
    loss = outputs[0]  # a non-scalar one: seeded with ones, i.e. the gradient of the sum of its elements
    _, ancestors = path_to(m.graph.node, [loss])
    unreachable = [p for p in trainable if p not in ancestors]
    why = ""
    if not unreachable:
        try:
            if mixed_precision is None:
                grad = build_gradient_model(m, loss, trainable, outputs=outputs[1:], zero_unreachable=False,
                                            feeds_checked=True)
                diff = loss
            else:
                fwd = mp_pass.mixed_precision(m, loss, mixed_precision)
                diff = mp_pass.mixed_precision_info(fwd).scaled_loss  # backward of loss · loss_scale
                grad = build_gradient_model(fwd, diff, trainable, outputs=outputs, zero_unreachable=False,
                                            feeds_checked=True)
                if mp_pass.mixed_precision_info(grad) is None:  # keep the pass's record
                    grad.metadata_props.extend(p for p in fwd.metadata_props if p.key == mp_pass.METADATA_KEY)
            if recompute is not None:
                grad = _recompute(grad, diff, weights, recompute)
            return grad if diff == loss else _drop_output(grad, diff)
        except GradientError as e:
            # a parameter that reaches the loss only through non-differentiable ops (Shape, ...)
            unreachable = [p for p in trainable if f"{p!r} does not reach" in str(e)]
            if not unreachable:
                raise ArtifactError(f"cannot build the gradient graph: {e}") from None
            why = f" (the gradient builder: {e})"
    names = ", ".join(repr(p) for p in unreachable)
    raise ArtifactError(
        f"Cannot compute the partial derivative for {names} as it's unreachable from the output "
        f"node(s) ({loss!r}){why}: remove it from requires_grad (or freeze it)."
    )


def _recompute(grad: onnx.ModelProto, loss: str, weights: Sequence[str],
               options: dict[str, Any]) -> onnx.ModelProto:
    """The recompute pass over ``grad``; a warning when it finds nothing to recompute (one warning: the
    pass's own reasons, such as no transformer layer found, go into it)."""
    return recompute_or_warn(grad, loss, f"recompute={options}", weights=weights, **options)


def _drop_output(m: onnx.ModelProto, name: str) -> onnx.ModelProto:
    """``m`` without graph output ``name`` (and its node when nothing else reads the value)."""
    g = m.graph
    kept = [o for o in g.output if o.name != name]
    del g.output[:]
    g.output.extend(kept)
    if not any(name in node_reads(n) for n in g.node):
        nodes = [n for n in g.node if list(n.output) != [name]]
        del g.node[:]
        g.node.extend(nodes)
    return m


def _shape(tp: onnx.TypeProto | None) -> list[int | str] | None:
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return shown_dims(tp.tensor_type.shape)


def _with_accumulation(m: onnx.ModelProto, trainable: list[str]) -> onnx.ModelProto:
    """Replace each ``<p>_grad`` output by ``<p>_grad.accumulation.out`` = reset ? grad : buffer + grad."""
    if not trainable:
        m.graph.input.append(helper.make_tensor_value_info(RESET, TensorProto.BOOL, [1]))
        return m
    g = m.graph
    by_name = {v.name: v for v in g.input}
    grads = {f"{p}_grad" for p in trainable}
    kept = [o for o in g.output if o.name not in grads]
    del g.output[:]
    g.output.extend(kept)
    fresh = _accumulation_names(m, trainable)
    reset = fresh(f"{RESET}.scalar")
    g.node.append(helper.make_node("Squeeze", [RESET], [reset], name=fresh("lazy_reset_grad_Squeeze")))
    for k, p in enumerate(trainable):
        tp = by_name[p].type
        buf, grad, out = f"{p}{BUFFER_SUFFIX}", f"{p}_grad", f"{p}{ACC_OUT_SUFFIX}"
        g.input.append(helper.make_value_info(buf, tp))
        total = fresh(f"{p}_grad.accumulation.sum")
        add, where = fresh(f"GradientAccumulator{k}_Add"), fresh(f"GradientAccumulator{k}")
        g.node.append(helper.make_node("Add", [buf, grad], [total], name=add))
        # overwrite when the reset flag is set, else accumulate (onnxruntime's InPlaceAccumulatorV2)
        g.node.append(helper.make_node("Where", [reset, grad, total], [out], name=where))
        g.output.append(helper.make_value_info(out, tp))
    g.input.append(helper.make_tensor_value_info(RESET, TensorProto.BOOL, [1]))
    return m


def _accumulation_names(m: onnx.ModelProto, trainable: list[str]) -> NameGen:
    """Fresh names for the accumulators' temporaries and nodes (a model value may be called
    ``lazy_reset_grad.scalar``); an error naming a model value that has one of the interface's names
    (``lazy_reset_grad``, ``<p>_grad.accumulation.buffer`` / ``.out``), which the runtimes bind by."""
    fresh = NameGen.for_model(m)
    fixed = [RESET, *(f"{p}{s}" for p in trainable for s in (BUFFER_SUFFIX, ACC_OUT_SUFFIX))]
    used = [n for n in fixed if n in fresh.taken]
    if used:
        raise ArtifactError(f"the model has value(s) {used}, names the training model's gradient "
                            "accumulation interface uses: rename them")
    fresh.taken.update(fixed)
    return fresh


def _inference_mode(m: onnx.ModelProto) -> onnx.ModelProto:
    """A copy with Dropout and BatchNormalization in inference mode, in the bodies of control-flow nodes
    too (spec §1.3 step 5, §1.12 fixed)."""
    from onnxtrain.ir.graphs import inference_mode

    e = onnx.ModelProto()
    e.CopyFrom(m)
    inference_mode(e.graph)
    _warn_random_nodes(e)
    return e


def _warn_random_nodes(model: onnx.ModelProto) -> None:
    """A warning naming the eval model's nodes that draw random values other than Dropout: torch's export of
    ``nn.Dropout1d/2d/3d``, ``AlphaDropout`` and ``FeatureAlphaDropout`` writes them as random ops and
    arithmetic, which eval mode cannot switch off (evaluation then differs from run to run)."""
    from onnxtrain.ir.graphs import RANDOM_OPS, walk_graphs

    drawn = [f"{n.name or '(unnamed)'} ({n.op_type})" for g in walk_graphs(model.graph) for n in g.node
             if n.op_type in RANDOM_OPS and n.op_type != "Dropout"]
    if drawn:
        shown = ", ".join(drawn[:5]) + (f" and {len(drawn) - 5} more" if len(drawn) > 5 else "")
        warn(f"the eval model draws random values in {shown}: eval mode switches off Dropout nodes only, "
             "and torch exports Dropout1d/2d/3d, AlphaDropout and FeatureAlphaDropout as random ops, so "
             "evaluation differs from run to run; export the model with those layers replaced by "
             "nn.Identity() (for evaluation), or use nn.Dropout")


__all__ = ["ArtifactError", "LossType", "OptimType", "generate_artifacts"]

_CONVERTER_NAMES = ("OptimizationStyle", "convert_onnx_models_to_ort")


def __getattr__(name: str) -> Any:
    """onnxruntime's ORT-format converter names, which onnxruntime-training's ``artifacts`` module imports
    (and ported scripts may import from there): onnxruntime's own objects, when it is installed."""
    if name in _CONVERTER_NAMES:
        try:
            load_onnxruntime()
            from onnxruntime.tools import convert_onnx_models_to_ort as tool
        except ImportError:
            raise AttributeError(f"artifacts.{name} is onnxruntime's ORT-format converter; install "
                                 "onnxruntime to use it") from None
        return getattr(tool, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The ``onnxtrain`` command: ``train``, ``eval``, ``export``, ``info``, ``gradient-graph`` and ``artifacts``.

Exit codes: 0 done, 1 a runtime failure (e.g. a file that is not an ONNX model or not a checkpoint, a
graph node that fails to run), 2 a bad config or command line (one line on stderr naming the key path,
option or file: a missing model file or checkpoint, ``--resume`` without a checkpoint or with one that
does not fit the config, an output path that is one of the command's inputs or in a folder it cannot
write in, data that does not fit the model), 130 interrupted by Ctrl-C, 143 stopped by SIGTERM (``train``
saves a checkpoint first). Failures print one line; ``ONNXTRAIN_DEBUG=1`` shows the traceback instead.
Warnings print as one ``onnxtrain: warning: ...`` line each on stderr.

Under ``mpiexec -n N onnxtrain train CONFIG`` the ranks train data-parallel (see
``onnxtrain.train.loop``); only rank 0 prints. A rank that fails ends the whole job (MPI_Abort)
with its message, so that no rank waits for ever on it.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import importlib
import json
import math
import os
import signal
import sys
import threading
import warnings
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """A bad command-line argument found after parsing: one line on stderr, exit code 2."""


def _load(path: str) -> onnx.ModelProto:
    """``onnx.load`` with a one-line error for a file that is not an ONNX model (an empty file parses as
    an empty ModelProto: no graph nodes, inputs or outputs) or whose external data cannot be read."""
    import onnx
    from google.protobuf.message import DecodeError

    if os.path.isdir(path):
        raise UsageError(f"{path} is a folder, not an ONNX model file")
    if not os.path.exists(path):  # (a pipe or device is read as it is: `info <(cat m.onnx)`)
        raise UsageError(f"model file not found: {path}")
    try:
        model = onnx.load(path)
    except DecodeError as e:
        raise ValueError(f"{path} is not an ONNX model (protobuf: {e})") from None
    except onnx.checker.ValidationError as e:
        raise ValueError(f"{path}: cannot read its external data: {_one_line(e)}") from None
    g = model.graph
    if not (g.node or g.input or g.output):
        raise ValueError(f"{path} is not an ONNX model (no graph nodes, inputs or outputs)")
    return model


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _check_versions(model: onnx.ModelProto, path: str) -> None:
    """Refuse a model whose IR version or default-domain opset the installed onnx does not know."""
    from onnxtrain.ir.builder import unknown_versions

    unknown = unknown_versions(model)
    if unknown:
        raise ValueError(f"{path}: {unknown}")


def _names(value: str | None, option: str) -> list[str]:
    """A comma-separated option as a list of names (spaces around them dropped); a repeat is an error."""
    names = [n.strip() for n in (value or "").split(",") if n.strip()]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"{option}: {', '.join(map(repr, repeated))} given twice")
    return names


def _values(model: onnx.ModelProto) -> set[str]:
    """Every value of the main graph: inputs, initializers and node outputs."""
    from onnxtrain.ir.graphs import graph_values

    return graph_values(model.graph)


def _value_types(model: onnx.ModelProto, names) -> dict[str, int]:
    """Element type of the main-graph values whose type is known (onnx shape inference runs only when one of
    ``names`` is not declared, and only if it can)."""

    def declared(g: onnx.GraphProto) -> dict[str, int]:
        types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]
                 if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
        types.update((t.name, t.data_type) for t in g.initializer)
        return types

    types = declared(model.graph)
    if all(n in types for n in names):
        return types
    import onnx

    try:
        return declared(onnx.shape_inference.infer_shapes(model).graph)
    except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
        return types


def _refuse_non_float(model: onnx.ModelProto, names: dict[str, str]) -> None:
    """UsageError for a value (name -> its option) whose known element type is not floating-point."""
    import onnx

    from onnxtrain.ir.builder import FLOAT_TYPES

    types = _value_types(model, names)
    for name, option in names.items():
        if name in types and types[name] not in FLOAT_TYPES:
            raise UsageError(f"{option}: {name!r} is of type {onnx.TensorProto.DataType.Name(types[name])}; "
                             "only floating-point values have gradients")


def _warn_non_scalar_loss(model: onnx.ModelProto, loss: str) -> None:
    """Warn when the value --loss names is known to hold more than one element (the logits given for the
    loss, say): its gradients are those of the sum of its elements."""
    import onnx

    def declared(g: onnx.GraphProto) -> onnx.ValueInfoProto | None:
        return next((v for v in [*g.input, *g.value_info, *g.output] if v.name == loss
                     and v.type.tensor_type.HasField("shape")), None)

    info = declared(model.graph)
    if info is None:
        try:
            info = declared(onnx.shape_inference.infer_shapes(model).graph)
        except Exception:  # noqa: BLE001 - inference is a help here, not a requirement
            return
    if info is None:
        return
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
            for d in info.type.tensor_type.shape.dim]
    if any(d != 1 for d in dims):
        warnings.warn(f"--loss: {loss!r} has shape {dims}, not a scalar: the gradients written are those of "
                      "the sum of its elements", stacklevel=2)


def _check_output_file(path: str) -> None:
    """-o/--output must name a file in a folder that exists (as ``export``'s)."""
    if not path.strip():
        raise UsageError("-o/--output: an empty path; give the .onnx file to write")
    if os.path.isdir(path):
        raise UsageError(f"-o/--output: {path} is a folder; give the .onnx file to write, e.g. "
                         f"{os.path.join(path, 'model.onnx')}")
    if path.endswith(tuple(s for s in (os.sep, os.altsep) if s)):
        raise UsageError(f"-o/--output: {path} names a folder (it ends with a separator); give the .onnx "
                         f"file to write, e.g. {os.path.join(path, 'model.onnx')}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise UsageError(f"-o/--output: the folder {parent} does not exist")
    _check_writable(parent)


def _check_writable(folder: str) -> None:
    """UsageError (naming -o/--output) when no file can be made in ``folder``, found before the command's
    work rather than after it (outputs are written to a temporary file there, then renamed). A file is made
    and removed: permission bits do not tell (root writes in any folder, except on a read-only or special
    file system)."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(prefix=".onnxtrain-write-check-", dir=folder)
    except OSError as e:
        raise UsageError(f"-o/--output: cannot write in the folder {folder}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)


def _same_file(a: str, b: str) -> bool:
    """Whether paths ``a`` and ``b`` name one file (symlinks, relative paths and hard links resolved)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist: not the same file
        return False


def _refuse_overwriting_inputs(outputs: list[str], inputs: list[tuple[str, str | None]],
                               option: str = "-o/--output") -> None:
    """UsageError when a file the command would write (``outputs``) is one of the files it reads
    (``inputs``: (what it is, path)); only an existing output can be an input."""
    for out in outputs:
        if not os.path.lexists(out):
            continue
        for what, path in inputs:
            if path and _same_file(out, path):
                raise UsageError(f"{option}: {out} is {what}, which this command reads; write to another "
                                 "path")


def _external_files(path: str) -> list[tuple[str, str]]:
    """(what, path) of the external-data files the ONNX model at ``path`` reads (its tensors are not
    loaded)."""
    import onnx

    from onnxtrain.ir.graphs import walk_graphs

    try:
        model = onnx.load(path, load_external_data=False)
    except Exception:  # noqa: BLE001 - _load reports a model that cannot be read
        return []
    folder = os.path.dirname(os.path.abspath(path))
    found = []
    tensors = [t for g in walk_graphs(model.graph) for t in (
        *g.initializer, *(a.t for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.TENSOR))]
    for t in tensors:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            loc = next((e.value for e in t.external_data if e.key == "location"), None)
            if loc:
                found.append((f"the external data of {path}", os.path.join(folder, loc)))
    return found


def _config_inputs(cfg) -> list[tuple[str, str | None]]:
    """(what, path) of the files a training config reads: itself, model.path and the data files."""
    d = cfg.data
    return [("the config file", cfg.source), ("model.path", cfg.model.path),
            ("data.path", getattr(d, "path", None)), ("data.eval_path", getattr(d, "eval_path", None)),
            *((f"data.feeds.{k}", v) for k, v in getattr(d, "feeds", {}).items() if v.endswith(".npy"))]


def _checkpoint_arg(path: str) -> list[str]:
    """The checkpoint files --checkpoint names, latest first (a file, or a run folder's checkpoints: a
    damaged latest gives way to the one before); UsageError if none."""
    from onnxtrain.train.outputs import checkpoint_candidates

    try:
        return checkpoint_candidates(path)
    except FileNotFoundError as e:
        raise UsageError(f"--checkpoint: {e}") from None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _differentiable(model: onnx.ModelProto) -> list[str]:
    """The graph inputs and initializers of float type: what --wrt usually names."""
    import onnx

    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    g = model.graph
    names = [v.name for v in g.input if v.type.tensor_type.elem_type in floats]
    return names + [t.name for t in g.initializer if t.data_type in floats and t.name not in names]


def _gradient_graph(a: argparse.Namespace) -> int:
    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.autodiff.legacy import outputs_in_model_order
    from onnxtrain.engine.ort_half_scatters import half_scatters_in_float32
    from onnxtrain.ir.io import save_model_sized
    from onnxtrain.ir.large import check_model_full
    from onnxtrain.training_graph import discover_trainable

    _check_output_file(a.output)
    _refuse_overwriting_inputs([a.output], [("the model", a.model)])
    model = _load(a.model)
    _check_versions(model, a.model)
    _refuse_overwriting_inputs([a.output], _external_files(a.model))
    values = _values(model)
    if a.loss not in values:
        outs = ", ".join(o.name for o in model.graph.output)
        raise UsageError(f"--loss: {a.loss!r} is not a value of {a.model}; its outputs are: {outs or 'none'}")
    if a.all_initializers:
        wrt = discover_trainable(model, a.loss, {})
        if not wrt:
            raise UsageError(f"--all-initializers: no float initializer of {a.model} reaches {a.loss!r}; "
                             "name the values to differentiate with --wrt")
    else:  # argparse requires one of the two
        wrt = _names(a.wrt, "--wrt")
        unknown = [w for w in wrt if w not in values]
        if unknown or not wrt:
            cands = _differentiable(model)
            shown = ", ".join(cands[:20]) + (f", ... ({len(cands)} in all)" if len(cands) > 20 else "")
            what = f"{unknown[0]!r} is not a value of {a.model}" if unknown else "no value given"
            raise UsageError(f"--wrt: {what}; its float inputs and initializers are: {shown or 'none'} "
                             "(any intermediate value of the graph works too)")
    _refuse_non_float(model, {a.loss: "--loss", **{w: "--wrt" for w in wrt}})
    _warn_non_scalar_loss(model, a.loss)
    try:  # a --wrt the loss does not depend on is an error, as GradientGraphBuilder's
        out = build_gradient_model(model, a.loss, wrt, memory_efficient=a.memory_efficient,
                                   zero_unreachable=False)
    except ValueError as e:
        if "does not reach" in str(e):
            raise UsageError(f"--wrt: {_one_line(e)}") from None
        raise
    outputs_in_model_order(out, model, wrt, keep_others=True)  # a loss that was no output of the model first
    # float16/bfloat16 scatters that add in float32, as the GradientGraphBuilder writes them (onnxruntime's
    # CPU provider has no half kernel for them)
    out = half_scatters_in_float32(out)
    check_model_full(out)
    save_model_sized(out, a.output)
    print(f"wrote {a.output}: {_plural(len(out.graph.node), 'node')}, gradients of {a.loss!r} "
          f"w.r.t. {_plural(len(wrt), 'value')}")
    return 0


def _info(a: argparse.Namespace) -> int:
    from onnx import numpy_helper

    from onnxtrain.autodiff.opset_upgrade import upgrade_opset
    from onnxtrain.autodiff.registry import find_rule, has_no_gradient
    from onnxtrain.engine.registry import has_kernel
    from onnxtrain.inference import node_arg
    from onnxtrain.ir.builder import FLOAT_TYPES, model_opset, unknown_versions
    from onnxtrain.ir.functions import has_function
    from onnxtrain.ir.graphs import walk_graphs

    model = _load(a.model)
    too_new = unknown_versions(model)
    if too_new:  # described all the same, but no session or gradient builder takes it
        warnings.warn(f"{a.model}: {too_new}: onnxtrain cannot run or train this model (the kernel and "
                      "gradient lines go by op name only)", stacklevel=2)
    g = model.graph
    inits = {t.name for t in g.initializer}
    opset = model_opset(model)
    print(f"{a.model}: opset {opset}, {_plural(len(g.node), 'node')}")
    for v in g.input:
        if v.name not in inits:
            print(f"  input  {node_arg(v)}")
    for v in g.output:
        print(f"  output {node_arg(v)}")
    arrays = [numpy_helper.to_array(t) for t in g.initializer if t.data_type in FLOAT_TYPES]
    others = len(g.initializer) - len(arrays)
    print(f"  parameters: {sum(x.size for x in arrays):,} in {_plural(len(arrays), 'float initializer')}, "
          f"{sum(x.nbytes for x in arrays):,} bytes"
          + (f" (and {_plural(others, 'other initializer')}, not counted)" if others else ""))
    nodes = [n for sub in walk_graphs(g) for n in sub.node]
    # a custom-domain op named like a standard one is another op: keyed by (domain, op_type)
    hist = collections.Counter((n.domain if n.domain != "ai.onnx" else "", n.op_type) for n in nodes)
    name = {(d, op): f"{d}:{op}" if d else op for d, op in hist}
    inside = len(nodes) - len(g.node)
    label = f"ops (with the {inside} nodes inside control-flow bodies)" if inside else "ops"
    print(f"  {label}: " + ", ".join(f"{name[k]}×{hist[k]}" for k in sorted(hist, key=name.get)))
    no_kernel = sorted(k for k in hist if not has_kernel(k[1], opset, k[0]))
    # gradients are built on the model upgraded to the builder's opset (an opset-9 Upsample becomes Resize)
    try:
        upgraded = upgrade_opset(model)
    except Exception:  # noqa: BLE001 - gradient-graph reports why; here the model's own ops are looked up
        upgraded = model
    rule_opset = model_opset(upgraded)
    rule_ops = {(n.domain if n.domain != "ai.onnx" else "", n.op_type)
                for sub in walk_graphs(upgraded.graph) for n in sub.node}
    # ONNX's rules are for ONNX's ops: a custom-domain op named like one has none
    no_rule = sorted(k for k in rule_ops if k[0] != "" or (find_rule(k[1], max(rule_opset, 17)) is None
                                                          and not has_no_gradient(k[1])))
    bodies = sorted({*(k for k in no_kernel if has_function(k[1], opset, k[0])),
                     *(k for k in no_rule if has_function(k[1], rule_opset, k[0]))})
    shown = lambda k: name.get(k) or (f"{k[0]}:{k[1]}" if k[0] else k[1])  # noqa: E731 - a local one-liner
    no_kernel = [shown(k) for k in no_kernel if k not in bodies]
    no_rule = [shown(k) for k in no_rule if k not in bodies]
    bodies = [shown(k) for k in bodies]
    print(f"  ops without a kernel: {', '.join(no_kernel) or 'none'}")
    print(f"  ops without a gradient rule: {', '.join(no_rule) or 'none'}")
    if bodies:
        print(f"  ops run and differentiated as their ONNX function body: {', '.join(bodies)}")
    return 0


def _config(a: argparse.Namespace):
    from onnxtrain.train import load_config

    return load_config(a.config, a.set or ())


def _train(a: argparse.Namespace) -> int:
    from onnxtrain.parallel import is_main_process
    from onnxtrain.train import Trainer

    if a.output_dir is not None and not a.output_dir.strip():
        raise UsageError("--output-dir: an empty path (leave the option out for output.dir or runs/<name>)")
    cfg = _config(a)
    result = Trainer(cfg, a.output_dir, progress=not a.quiet).run(resume=a.resume, overwrite=a.overwrite)
    if result.status == "interrupted":
        a.stopped_together = True  # every rank stopped after the same step: no need to abort the job
        return 128 + result.signal if result.signal else EXIT_INTERRUPTED  # (130 SIGINT, 143 SIGTERM)
    if not is_main_process():
        return 0
    scores = ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    print(f"trained {cfg.name} for {_plural(result.global_step, 'step')}: {scores}")
    plotted = cfg.output.plot and os.path.exists(os.path.join(result.output_dir, "metrics.png"))
    inside = [result.checkpoint, *([result.exported] if result.exported else [])]  # (paths in the folder)
    files = ["metrics.jsonl", "config.yaml", *(["metrics.png"] if plotted else []),
             *(os.path.relpath(f, result.output_dir) for f in inside if f)]
    print(f"outputs in {result.output_dir}: {', '.join(files)}")
    diverged = [k for k, v in result.metrics.items()
                if isinstance(v, float) and not math.isfinite(v) and k not in result.undefined]
    loss = result.train_loss
    if result.undefined and not diverged and loss is not None and not math.isfinite(loss):
        diverged = ["training loss"]  # (an eval that counts no label cannot tell: the training loss does)
    if diverged:  # the run ended, but its model is no use: a failure to scripts and CI
        print(f"onnxtrain: error: training diverged: the final {', '.join(diverged)} is not a finite number",
              file=sys.stderr)
        return 1
    return 0


def _eval(a: argparse.Namespace) -> int:
    from onnxtrain.train import evaluate_checkpoint

    cfg = _config(a)
    _checkpoint_arg(a.checkpoint)  # (one is there: a folder's damaged latest gives way to the one before)
    metrics = evaluate_checkpoint(cfg, os.path.expanduser(a.checkpoint))
    if not _first_rank():  # under mpiexec every rank evaluates the same: one prints
        return 0
    if a.json:  # (null for a number that is not finite, as metrics.jsonl: NaN is not JSON)
        print(json.dumps({k: v if math.isfinite(v) else None for k, v in metrics.items()}))
    else:
        print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def _export(a: argparse.Namespace) -> int:
    from onnxtrain.train import export_model, load_for_inference

    _check_output_file(a.output)
    cfg = _config(a)
    latest, *older = _checkpoint_arg(a.checkpoint)  # (a run folder's latest whole one is read)
    _refuse_overwriting_inputs([a.output], [
        *_config_inputs(cfg), ("the checkpoint --checkpoint names", latest),
        ("the checkpoint's data file", latest + ".data"),
        *((f"{what} of an older checkpoint of that run folder (read when the later ones are damaged)", f)
          for c in older for what, f in (("the file", c), ("the data file", c + ".data")))])
    if cfg.model.path:
        _refuse_overwriting_inputs([a.output], _external_files(cfg.model.path))
    model, weights = load_for_inference(cfg, os.path.expanduser(a.checkpoint))
    if _first_rank():  # under mpiexec one rank writes (and says so)
        export_model(model, cfg, weights, a.output)
        print(f"wrote {a.output}")
    return 0


def _first_rank() -> bool:
    """Whether this process is rank 0 of its MPI job (or runs alone): read from the launcher's environment."""
    from onnxtrain.parallel.comm import world

    return world().rank == 0


_SET_HELP = "override a config value, e.g. {} (YAML syntax, checked like the file; repeatable)"
_CKPT_HELP = ("a run folder, its checkpoints folder or a .ckpt file (of a folder, the latest checkpoint; a "
              "damaged one is passed over, with a warning, for the one before it)")


def _add_config_args(p: argparse.ArgumentParser, example: str) -> None:
    p.add_argument("config", help="the training configuration (YAML), e.g. configs/digits_mlp.yaml")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help=_SET_HELP.format(example))


def _recompute_flags(a: argparse.Namespace) -> dict | None:
    """The --recompute choices as generate_artifacts' ``recompute`` dict (None: no recompute)."""
    if not a.recompute:
        return None
    chosen = {k.strip() for k in a.recompute.split(",") if k.strip()}
    unknown = sorted(chosen - {"gelu", "attn_dropout", "transformer_layer"})
    if unknown:
        raise UsageError(f"--recompute: unknown choice(s) {', '.join(unknown)}; "
                         "choose among gelu, attn_dropout, transformer_layer")
    return {k: True for k in chosen}


def _loss_inputs(a: argparse.Namespace, loss: object, outputs: list[str],
                 values: set[str]) -> list[str] | None:
    """generate_artifacts' ``loss_input_names`` from --loss-input-names or --loss-output (None: every model
    output feeds the loss, in order)."""
    names = _names(a.loss_input_names, "--loss-input-names")
    if a.loss_output is not None:
        if names:
            raise UsageError("--loss-output and --loss-input-names exclude each other: --loss-output X is "
                             "--loss-input-names X followed by the model's other outputs")
        if loss is not None:
            raise UsageError("--loss-output and --loss exclude each other: --loss-output names the model "
                             "output that is the loss, --loss appends a loss to the model's output (say "
                             "which output it reads with --loss-input-names)")
        if a.loss_output not in outputs:
            raise UsageError(f"--loss-output: {a.loss_output!r} is not an output of {a.model}; its outputs "
                             f"are: {', '.join(outputs) or 'none'}")
        # the named output first (the differentiated one), then the model's other outputs in order
        return [a.loss_output, *(o for o in outputs if o != a.loss_output)]
    unknown = [n for n in names if n not in values]
    if unknown:
        raise UsageError(f"--loss-input-names: {', '.join(map(repr, unknown))} "
                         f"{'is not a value' if len(unknown) == 1 else 'are not values'} of {a.model}; its "
                         f"outputs are: {', '.join(outputs) or 'none'} (any value of the graph works too)")
    if loss is not None and len(outputs) > 1 and not names:
        raise UsageError(f"--loss {a.loss} takes one prediction but {a.model} has {len(outputs)} outputs "
                         f"({', '.join(outputs)}): say which with --loss-input-names (the others can be kept "
                         "with --additional-outputs)")
    return names or None


def _folders_to_make(path: str) -> list[str]:
    """The folders that do not exist yet on the way to the output folder ``path``, deepest first; UsageError
    (naming -o/--output) when the nearest one that exists is a file or cannot be written in."""
    missing, up = [], os.path.abspath(path)
    while not os.path.lexists(up):
        missing.append(up)
        up = os.path.dirname(up)
    if os.path.islink(up) and not os.path.exists(up):
        raise UsageError(f"-o/--output: cannot make the folder {path}: {up} is a broken symbolic link (to "
                         f"{os.readlink(up)}, which does not exist)")
    if not os.path.isdir(up):
        raise UsageError(f"-o/--output: cannot make the folder {path}: {up} is a file, not a folder")
    if missing and not os.access(up, os.W_OK | os.X_OK):
        raise UsageError(f"-o/--output: cannot make the folder {path}: no permission to write in {up}")
    return missing


def _refuse_non_float_loss(a: argparse.Namespace, model: onnx.ModelProto, loss_inputs: list[str] | None,
                           outputs: list[str]) -> None:
    """UsageError when the value differentiated (the loss without --loss, else the prediction the loss
    reads) is known not to be floating-point, naming the option that chose it."""
    import onnx

    from onnxtrain.ir.builder import FLOAT_TYPES

    if loss_inputs:
        name = loss_inputs[0]
        option = "--loss-output" if a.loss_output is not None else "--loss-input-names"
        where = f"{option}: {name!r}"
    elif outputs and a.loss is not None:
        name = outputs[0]
        where = f"--loss {a.loss}: the model's output {name!r}, which it reads,"
    elif outputs:
        name = outputs[0]
        where = f"the model's first output {name!r}, the loss without --loss or --loss-output,"
    else:
        return
    elem = _value_types(model, [name]).get(name)
    if elem is None or elem in FLOAT_TYPES:
        return
    hint = "" if a.loss is not None or len(outputs) < 2 else (
        f"; say which output is the loss with --loss-output (the outputs: {', '.join(outputs)})")
    raise UsageError(f"{where} is of type {onnx.TensorProto.DataType.Name(elem)}; only a floating-point "
                     f"value can be differentiated{hint}")


def _artifacts(a: argparse.Namespace) -> int:
    from onnxtrain.training import artifacts
    from onnxtrain.training_graph import discover_trainable

    if not a.output.strip():
        raise UsageError("-o/--output: an empty path; give the artifact folder")
    if os.path.exists(a.output) and not os.path.isdir(a.output):
        raise UsageError(f"-o/--output: {a.output} is a file; give the artifact folder")
    if any(sep and sep in a.prefix for sep in (os.sep, os.altsep)):
        raise UsageError(f"--prefix: {a.prefix!r} names a folder; it is put before the file names in the "
                         "-o/--output folder (give the folder with -o)")
    to_make = _folders_to_make(a.output)
    if not to_make:
        _check_writable(a.output)
    written = [os.path.join(a.output, a.prefix + f) for f in artifacts.ARTIFACT_FILES]
    # a folder where an artifact goes: found now, not after the work as the save's IsADirectoryError
    for f in artifacts.artifact_files(a.nominal_checkpoint, bool(a.optimizer)):
        if os.path.isdir(os.path.join(a.output, a.prefix + f)):
            raise UsageError(f"-o/--output: {os.path.join(a.output, a.prefix + f)} is a folder, where the "
                             f"artifact {a.prefix + f} goes; write to another folder (or give a --prefix)")
    _refuse_overwriting_inputs(written, [("the model", a.model)])
    model = _load(a.model)
    _check_versions(model, a.model)
    _refuse_overwriting_inputs(written, _external_files(a.model))
    g = model.graph
    outputs = [o.name for o in g.output]
    loss = getattr(artifacts.LossType, a.loss) if a.loss else None
    requires, frozen = _names(a.requires_grad, "--requires-grad"), _names(a.frozen, "--frozen")
    extra = _names(a.additional_outputs, "--additional-outputs")
    inits = {t.name: t for t in g.initializer}
    inputs = {v.name for v in g.input if v.name not in inits}
    unknown = [n for n in requires if n not in inits and n not in inputs]
    if unknown:
        cands = ", ".join(_differentiable(model)) or "none"
        raise UsageError(f"--requires-grad: {unknown[0]!r} is neither an initializer nor a graph input of "
                         f"{a.model}; its float inputs and initializers are: {cands}")
    both = [n for n in requires if n in frozen]
    if both:
        raise UsageError(f"--requires-grad and --frozen both name {both[0]!r}")
    values = _values(model)
    unknown = [n for n in extra if n not in values]
    if unknown:
        raise UsageError(f"--additional-outputs: {unknown[0]!r} is not a value of {a.model}")
    loss_inputs = _loss_inputs(a, loss, outputs, values)
    _refuse_non_float_loss(a, model, loss_inputs, outputs)
    if not requires:  # the float initializers that reach the loss (or the values it reads), but --frozen
        if loss_inputs:
            reads = loss_inputs[:1] if loss is None else loss_inputs
        else:
            reads = outputs[:1] if loss is None else outputs
        found = {n for o in reads for n in discover_trainable(model, o, {})}
        requires = [t.name for t in g.initializer if t.name in found and t.name not in frozen]
        if not requires:
            raise UsageError(f"no float initializer of {a.model} reaches the loss (all frozen or none): name "
                             "the values to train with --requires-grad")
    try:
        os.makedirs(a.output, exist_ok=True)
    except OSError as e:
        raise UsageError(f"-o/--output: cannot make the folder {a.output}: {e.strerror}") from None
    caught: list[warnings.WarningMessage] = []
    try:
        try:
            # (said in the flags' words below; the filters as they are: a library's DeprecationWarning stays
            # ignored)
            with warnings.catch_warnings(record=True) as caught:
                artifacts.generate_artifacts(  # the path: it loads its own copy (a ModelProto is copied)
                    a.model, requires_grad=requires, frozen_params=frozen, loss=loss,
                    optimizer=getattr(artifacts.OptimType, a.optimizer) if a.optimizer else None,
                    artifact_directory=a.output, prefix=a.prefix, additional_output_names=extra or None,
                    nominal_checkpoint=a.nominal_checkpoint, loss_input_names=loss_inputs,
                    mixed_precision=a.mixed_precision, recompute=_recompute_flags(a))
        except artifacts.ArtifactError as e:
            raise _flag_error(e, a) from None
        finally:
            for text, category in dict.fromkeys((str(w.message), w.category) for w in caught):
                warnings.warn(_flag_words(text, a), category, stacklevel=2)  # (each once, as by default)
    except BaseException:
        for folder in to_make:  # a failed run leaves none of the folders it made behind, if empty
            if os.path.isdir(folder) and not os.listdir(folder):
                os.rmdir(folder)
        raise
    print(f"wrote the training artifacts of {a.model} to {a.output} "
          f"({_plural(len(requires), 'trainable parameter')})")
    return 0


# generate_artifacts' arguments that a flag of ``artifacts`` sets, and the flag
_ARTIFACT_FLAGS = {"requires_grad": "--requires-grad", "mixed_precision": "--mixed-precision",
                   "frozen_params": "--frozen"}


def _flag_words(text: str, a: argparse.Namespace) -> str:
    """A message of generate_artifacts with the flags of ``artifacts`` for the API's arguments."""
    import re

    for arg, flag in _ARTIFACT_FLAGS.items():
        text = re.sub(rf"(?<![\w-]){arg}\b", flag, text)
    text = text.replace("(loss=LossType..., a custom block)", "(--loss, with --loss-input-names)")
    return re.sub(r"(?<![\w-])recompute=\{[^}]*\}", lambda _: f"--recompute {a.recompute}", text)


def _flag_error(e: Exception, a: argparse.Namespace) -> Exception:
    """generate_artifacts' refusal of what a flag chose (a --requires-grad value without gradient: not
    floating-point, or not read by the loss; --mixed-precision of a model that is not float32) as a
    UsageError naming the flags for the API's arguments; any other refusal (a model the gradient builder
    cannot differentiate) as it is."""
    import re

    text = _one_line(e)
    if text.startswith("cannot build the gradient graph") or not re.search(
            r"\b(requires_grad|mixed_precision)\b", text):
        return e
    return UsageError(_flag_words(text, a))


def _parser() -> argparse.ArgumentParser:
    """The ``onnxtrain`` command line and its subcommands."""
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models with numpy.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config",
                        description="Train the model a YAML config describes; writes metrics.jsonl, "
                                    "config.yaml (the config as resolved), checkpoints, metrics.png and "
                                    "model.onnx to the output folder. Ctrl-C "
                                    "(or SIGTERM) stops between steps and saves a checkpoint there (exit "
                                    "130; 143); --resume continues from the last checkpoint.",
                        epilog="Exit codes: 0 done; 2 a bad config or command line, refused before "
                               "training (one line on stderr naming the key or file); 1 a failure while "
                               "running, or a run whose final metrics are not finite (diverged); 130 "
                               "Ctrl-C; 143 SIGTERM.")
    _add_config_args(tr, "--set training.epochs=5 --set optimizer.lr=3e-3")
    tr.add_argument("--output-dir",
                    help="where the run's files go (default: output.dir, else runs/<config name>)")
    resume = tr.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in the output folder (a changed config "
                             "key that changes the weights is allowed, and warned about)")
    resume.add_argument("--overwrite", action="store_true",
                        help="start over in an output folder that holds checkpoints of an earlier run, "
                             "deleting them and its metrics.png and model.onnx (without it such a folder is "
                             "refused)")
    tr.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar and no per-eval lines (the final summary, warnings and errors "
                         "are still printed)")
    tr.set_defaults(fn=_train)
    ev = sub.add_parser("eval", help="eval loss and accuracy of a checkpoint",
                        description="Score a checkpoint on the config's eval data (loss, and accuracy for "
                                    "class labels).")
    _add_config_args(ev, "--set training.eval_batch_size=256, and those the run was trained with (or give "
                         "the run folder's config.yaml)")
    ev.add_argument("--checkpoint", required=True, help=_CKPT_HELP)
    ev.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    ev.set_defaults(fn=_eval)
    ex = sub.add_parser("export", help="write a checkpoint as a plain inference .onnx",
                        description="Write the config's model with a checkpoint's weights as an inference "
                                    "model (logits output, no loss or labels, BatchNormalization/Dropout in "
                                    "inference mode) that any ONNX runtime can load.")
    _add_config_args(ex, "--set model.args.sizes=[64,256,10]: those the run was trained with (or give the "
                         "run folder's config.yaml)")
    ex.add_argument("--checkpoint", required=True, help=_CKPT_HELP)
    ex.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    ex.set_defaults(fn=_export)
    gg = sub.add_parser("gradient-graph", help="write the forward + backward graph of a model",
                        description="Append the backward pass of --loss to MODEL: the model's outputs stay "
                                    "where they were, then <x>_grad per x.")
    gg.add_argument("model", help="the ONNX model (with its loss in the graph)")
    gg.add_argument("--loss", required=True, help="name of the loss value (a float value of the graph)")
    grp = gg.add_mutually_exclusive_group(required=True)
    grp.add_argument("--wrt", help="comma-separated float values to differentiate with respect to (each must "
                                   "reach the loss)")
    grp.add_argument("--all-initializers", action="store_true",
                     help="every float initializer that reaches the loss")
    gg.add_argument("--memory-efficient", action="store_true",
                    help="LayerNormalization gradients from the output where the input is kept for nothing "
                         "else (use_memory_efficient_gradient)")
    gg.add_argument("-o", "--output", required=True, help="where to write the gradient graph")
    gg.set_defaults(fn=_gradient_graph)
    ar = sub.add_parser("artifacts",
                        help="generate_artifacts: training, eval and optimizer models + checkpoint",
                        description="Write the on-device training artifacts of MODEL (standard ONNX graphs "
                                    "and an onnxruntime-training checkpoint).")
    ar.add_argument("model", help="the forward ONNX model")
    ar.add_argument("-o", "--output", required=True, help="the artifact directory")
    ar.add_argument("--requires-grad",
                    help="comma-separated trainable initializers (default: the float initializers that "
                         "reach the loss, but --frozen)")
    ar.add_argument("--frozen", help="comma-separated frozen initializers (names that are no initializer: "
                                     "a warning, and left out)")
    ar.add_argument("--loss", choices=["MSELoss", "CrossEntropyLoss", "BCEWithLogitsLoss", "L1Loss"],
                    help="loss appended to the model (default: the model's first output is the loss)")
    ar.add_argument("--loss-output", help="with no --loss: the output that is the loss (the model's other "
                                          "outputs follow it)")
    ar.add_argument("--loss-input-names", metavar="NAMES",
                    help="comma-separated values of the model that the loss reads, in order "
                         "(generate_artifacts' loss_input_names; default: every model output); with no "
                         "--loss the first is the loss")
    ar.add_argument("--optimizer", choices=["AdamW", "SGD"], help="write an optimizer model too")
    ar.add_argument("--prefix", default="", help="prefix of the artifact file names (no folder: they go in "
                                                 "-o's)")
    ar.add_argument("--additional-outputs", help="comma-separated extra outputs of the training/eval models")
    ar.add_argument("--nominal-checkpoint", action="store_true", help="also write a nominal checkpoint")
    ar.add_argument("--mixed-precision", choices=["float16", "bfloat16"],
                    help="compute in half precision with float32 master weights and a loss_scale input")
    ar.add_argument("--recompute", help="comma-separated: gelu, attn_dropout, transformer_layer")
    ar.set_defaults(fn=_artifacts)
    info = sub.add_parser("info", help="inputs, outputs, parameters and op coverage of a model",
                          description="Inputs, outputs, parameter count and bytes, op histogram, and which "
                                      "ops lack a kernel or a gradient rule.")
    info.add_argument("model", help="an .onnx file")
    info.set_defaults(fn=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``onnxtrain`` with the arguments ``argv`` (default: the command line); the exit code."""
    try:
        code = _main(argv)
    except KeyboardInterrupt:  # a Ctrl-C in the instants before SIGINT is held (the command not yet known)
        code = _interrupted(None)
    if argv is None:  # the command line's process: a Ctrl-C while it exits no longer changes the outcome
        _ignore_sigterm()
        atexit.register(_ignore_sigint)
    return code


def _ignore_sigterm() -> None:
    """Ignore SIGTERM from now on: the command is done. Under mpiexec a SIGTERM that reaches this rank after
    the ranks agreed to stop on another's (and saved) would otherwise end it by the default action (exit
    15, and mpiexec's "bad termination" of the job) instead of with the stop's exit code."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _ignore_sigint() -> None:
    """Ignore SIGINT from now on (at exit, first of the exit-time callbacks: the command is done). Python's
    teardown would otherwise raise it in other callbacks or, once it has put back the default action, die
    of it with the command's work finished."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv: list[str] | None) -> int:
    held = _SigintHeld()
    a = None
    try:
        with held:  # a Ctrl-C here waits until the modules are loaded
            a = _parser().parse_args(argv)
            _preload(a.command)
    except KeyboardInterrupt:  # (a thread that does not block SIGINT received it)
        held.came = True
    except SystemExit:  # --help, or a bad command line
        if not held.came:
            raise
    if held.came:
        return _interrupted(a)
    try:
        return _run(a)
    except KeyboardInterrupt:  # Ctrl-C before the subcommand's own handler
        return _interrupted(a)


def _interrupted(a: argparse.Namespace | None) -> int:
    """Say that Ctrl-C stopped the command (one line); the exit code."""
    print(f"onnxtrain{' ' + a.command if a else ''}: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED


class _SigintHeld:
    """Within the block SIGINT is blocked, not handled: a Ctrl-C landing in the import of a C extension
    (numpy, onnx) breaks that import (numpy's "bad install" error, an abort, a crash) instead of stopping
    the command. ``came`` says afterwards whether one arrived; it is taken off, never delivered. Only in
    the main thread where signals can be blocked (POSIX), and only if SIGINT was not blocked already."""

    def __init__(self) -> None:
        self.came = False
        self._mask: set[signal.Signals] | None = None

    def __enter__(self) -> _SigintHeld:
        if hasattr(signal, "pthread_sigmask") and threading.current_thread() is threading.main_thread():
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            if signal.SIGINT not in mask:  # (blocked already by whoever started us: left to them)
                self._mask = mask
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mask is None:
            return
        if signal.SIGINT in signal.sigpending():
            signal.sigwait({signal.SIGINT})  # taken off while still blocked
            self.came = True
        signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        self._mask = None


# the modules with C extensions (numpy, onnx, PyYAML, protobuf) that each subcommand imports first
_COMMON_MODULES = ("numpy", "onnx", "onnxtrain.engine.plan", "onnxtrain.parallel")
_COMMAND_MODULES = {"train": ("onnxtrain.train",), "eval": ("onnxtrain.train",),
                    "export": ("onnxtrain.train",), "gradient-graph": ("onnxtrain.autodiff",),
                    "artifacts": ("onnxtrain.training.artifacts",)}


def _preload(command: str) -> None:
    """Import the modules ``command`` needs first. At one that fails this stops: the command imports it
    again where it is used, and reports the failure as it always did."""
    for name in (*_COMMON_MODULES, *_COMMAND_MODULES.get(command, ())):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - reported by the command itself
            return


def _run(a: argparse.Namespace) -> int:
    """``_guarded`` alone, or under an MPI launcher inside ``abort_on_error``: a rank that fails (or
    exits non-zero) aborts every rank instead of leaving them in their next collective."""
    from onnxtrain import parallel

    if a.command != "train" or not parallel.launched_by_mpi() or parallel.world().size == 1:
        return _guarded(a)
    try:
        parallel.get_communicator()  # before anything can fail, so that a failure can abort the job
    except ImportError as e:  # no mpi4py: no job to abort either; every rank ends, rank 0 says why
        if parallel.world().rank == 0:
            print(f"onnxtrain {a.command}: {_one_line(e)}", file=sys.stderr)
        return EXIT_ERROR
    with parallel.abort_on_error():
        code = _guarded(a)
        if code and not getattr(a, "stopped_together", False):
            raise SystemExit(code)
    return code


# the subcommands that read a YAML config (theirs or a run folder's)
_READ_CONFIGS = frozenset({"train", "eval", "export"})


class _NoConfigError(Exception):
    """Stands for the config module's ConfigError where PyYAML is missing and no config is read."""


def _guarded(a: argparse.Namespace) -> int:
    """Run the subcommand; known failures become one line on stderr and an exit code."""
    import onnx

    from onnxtrain.engine.plan import EngineError
    from onnxtrain.parallel import world

    w = world()
    prog = f"onnxtrain {a.command}" + (f" [rank {w.rank}/{w.size}]" if w.size > 1 else "")
    try:
        from onnxtrain.train.config import ConfigError  # (reads PyYAML)
    except ImportError as e:
        if a.command in _READ_CONFIGS:
            print(f"{prog}: {_missing_package(e)}", file=sys.stderr)
            return EXIT_ERROR
        ConfigError = _NoConfigError  # noqa: N806 - the commands that read no YAML run without PyYAML
    try:
        with warnings.catch_warnings():  # restores warnings.showwarning afterwards
            warnings.showwarning = _warning_printer(w.rank == 0)
            return a.fn(a)
    except KeyboardInterrupt as e:  # (a second SIGTERM while train stops: its Terminated, exit 143)
        signum = getattr(e, "signum", None)
        print(f"{prog}: {'interrupted' if signum is None else 'stopped by SIGTERM'}", file=sys.stderr)
        return EXIT_INTERRUPTED if signum is None else 128 + signum
    except ConfigError as e:
        where = getattr(a, "config", None)
        # a message about the file itself (no key) may name it already; one about a key is led by file:line
        # even when it shows the file elsewhere (a suggested command line)
        where = where if where and (e.path or where not in str(e)) else None
        if e.path.startswith("--"):  # an option at fault (--resume), not a key of the file
            where = None
        # (--output-dir stands for output.dir: a value given on the command line, as --set's)
        given = [*(a.set or ()), *(["output.dir="] if getattr(a, "output_dir", None) else [])]
        line = _config_line(a.config, e.path, given) if where else None
        if line is not None:  # file:line, as compilers write it (editors jump there)
            where = f"{where}:{line}"
        print(f"{prog}: {where + ': ' if where else ''}{e}", file=sys.stderr)
        return EXIT_USAGE
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except NotImplementedError as e:
        print(f"{prog}: not implemented yet: {e}", file=sys.stderr)
        return EXIT_USAGE
    except EngineError as e:  # a graph that fails to compile or run, often from a config mistake
        if _debug():
            raise
        text = " ".join(str(e).split("\n"))
        print(f"{prog}: {text} (set ONNXTRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    except ImportError as e:  # a package the command needs is missing or broken
        if _debug():
            raise
        print(f"{prog}: {_missing_package(e)} (set ONNXTRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # the output went to a pipe that closed (| head): nothing more to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python would complain again at exit
        return EXIT_ERROR
    except MemoryError as e:  # a model or data sized past the machine (numpy's _ArrayMemoryError)
        if _debug():
            raise
        print(f"{prog}: out of memory: {_one_line(e) or 'MemoryError'} (check the model's sizes and the "
              "batch size; set ONNXTRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR
    except (OSError, ValueError, LookupError, TypeError, onnx.checker.ValidationError) as e:
        # a missing or unwritable file, a misfit model, external data that cannot be read, data of the
        # wrong kind
        if _debug():
            raise
        print(f"{prog}: {_one_line(e)} (set ONNXTRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _config_line(config: str, key: str, overrides: list[str]) -> int | None:
    """The line of the config file where the key at fault is written (None: a --set value, or unknown)."""
    from onnxtrain.train.config import key_line

    return key_line(config, key, overrides)


# import name -> what pip installs it as
_PIP_NAMES = {"yaml": "PyYAML", "mpi4py": "mpi4py mpich", "google": "protobuf"}


def _missing_package(e: ImportError) -> str:
    """One line for an ImportError: onnxtrain's own messages as they are (they name the package), else
    the package that failed to import and the pip command that installs it."""
    top = (e.name or "").split(".")[0]
    if not top or top == "onnxtrain":
        return _one_line(e)
    return (f"the Python package {top!r} cannot be imported ({_one_line(e)}): "
            f"pip install {_PIP_NAMES.get(top, top)}")


def _warning_printer(shown: bool):
    """A ``warnings.showwarning`` that prints ``onnxtrain: warning: <message>`` as one line on stderr, as
    ``train``'s own warnings are (nothing when not ``shown``: under mpiexec only rank 0 prints)."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ARG001
        if shown:
            print(f"onnxtrain: warning: {_one_line(message)}", file=sys.stderr)

    return show


def _debug() -> bool:
    """ONNXTRAIN_DEBUG set to anything but empty, 0, false or no: failures show their traceback."""
    return os.environ.get("ONNXTRAIN_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


if __name__ == "__main__":
    sys.exit(main())

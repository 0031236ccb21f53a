"""The ``onnxtrain`` command: ``train``, ``eval``, ``export``, ``info``, ``gradient-graph`` and ``artifacts``.

Exit codes: 0 done, 1 a runtime failure (e.g. a missing checkpoint, a file that is not an ONNX model,
a graph node that fails to run), 2 a bad config or command line (one line on stderr naming the key
path or option), 130 interrupted by Ctrl-C. Failures print one line; ``ONNXTRAIN_DEBUG=1`` shows the
traceback instead.

Under ``mpiexec -n N onnxtrain train CONFIG`` the ranks train data-parallel (see
``onnxtrain.train.loop``); only rank 0 prints. A rank that fails ends the whole job (MPI_Abort)
with its message, so that no rank waits for ever on it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import onnx

EXIT_ERROR, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(Exception):
    """A bad command-line argument found after parsing: one line on stderr, exit code 2."""


def _load(path: str) -> onnx.ModelProto:
    """``onnx.load`` with a one-line error for a file that is not an ONNX model."""
    from google.protobuf.message import DecodeError

    try:
        return onnx.load(path)
    except DecodeError as e:
        raise ValueError(f"{path} is not an ONNX model (protobuf: {e})") from None


def _differentiable(model: onnx.ModelProto) -> list[str]:
    """The graph inputs and initializers of float type: what --wrt usually names."""
    floats = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
              onnx.TensorProto.BFLOAT16}
    g = model.graph
    names = [v.name for v in g.input if v.type.tensor_type.elem_type in floats]
    return names + [t.name for t in g.initializer if t.data_type in floats and t.name not in names]


def _gradient_graph(a: argparse.Namespace) -> int:
    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.ir.io import save_model_atomic
    from onnxtrain.training_graph import discover_trainable

    model = _load(a.model)
    if a.all_initializers:
        wrt = discover_trainable(model, a.loss, {})
    else:  # argparse requires one of the two
        wrt = [w for w in a.wrt.split(",") if w]
        g = model.graph
        values = ({v.name for v in g.input} | {t.name for t in g.initializer}
                  | {o for n in g.node for o in n.output})
        unknown = [w for w in wrt if w not in values]
        if unknown or not wrt:
            cands = _differentiable(model)
            shown = ", ".join(cands[:20]) + (f", ... ({len(cands)} in all)" if len(cands) > 20 else "")
            what = f"{unknown[0]!r} is not a value of {a.model}" if unknown else "no value given"
            raise UsageError(f"--wrt: {what}; its float inputs and initializers are: {shown or 'none'} "
                             "(any intermediate value of the graph works too)")
    out = build_gradient_model(model, a.loss, wrt, memory_efficient=a.memory_efficient)
    onnx.checker.check_model(out, full_check=True)
    save_model_atomic(out, a.output)
    print(f"wrote {a.output}: {len(out.graph.node)} nodes, gradients of {a.loss!r} "
          f"w.r.t. {len(wrt)} value(s)")
    return 0


def _info(a: argparse.Namespace) -> int:
    from onnx import numpy_helper

    from onnxtrain.autodiff.registry import find_rule, has_no_gradient
    from onnxtrain.engine.registry import has_kernel
    from onnxtrain.inference import node_arg
    from onnxtrain.ir.builder import model_opset
    from onnxtrain.ir.functions import has_function
    from onnxtrain.ir.graphs import walk_graphs

    model = _load(a.model)
    g = model.graph
    inits = {t.name for t in g.initializer}
    opset = model_opset(model)
    print(f"{a.model}: opset {opset}, {len(g.node)} nodes")
    for v in g.input:
        if v.name not in inits:
            print(f"  input  {node_arg(v)}")
    for v in g.output:
        print(f"  output {node_arg(v)}")
    arrays = [numpy_helper.to_array(t) for t in g.initializer]
    print(f"  parameters: {sum(x.size for x in arrays):,} in {len(arrays)} initializers, "
          f"{sum(x.nbytes for x in arrays):,} bytes")
    nodes = [n for sub in walk_graphs(g) for n in sub.node]
    hist = collections.Counter(n.op_type for n in nodes)
    domains = {n.op_type: n.domain for n in nodes}
    inside = len(nodes) - len(g.node)
    label = f"ops (with the {inside} nodes inside control-flow bodies)" if inside else "ops"
    print(f"  {label}: " + ", ".join(f"{op}×{c}" for op, c in sorted(hist.items())))
    no_kernel = sorted(op for op in hist if not has_kernel(op, opset, domains[op]))
    no_rule = sorted(op for op in hist if find_rule(op, max(opset, 17)) is None and not has_no_gradient(op))
    bodies = sorted(op for op in {*no_kernel, *no_rule} if has_function(op, opset, domains[op]))
    no_kernel = [op for op in no_kernel if op not in bodies]
    no_rule = [op for op in no_rule if op not in bodies]
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
        return EXIT_INTERRUPTED
    if not is_main_process():
        return 0
    scores = ", ".join(f"{k} {v:.4f}" for k, v in result.metrics.items())
    print(f"trained {cfg.name} for {result.global_step} steps: {scores}")
    files = ["metrics.jsonl", *(["metrics.png"] if cfg.output.plot else []), result.checkpoint,
             *([result.exported] if result.exported else [])]
    print(f"outputs in {result.output_dir}: {', '.join(f for f in files if f)}")
    return 0


def _eval(a: argparse.Namespace) -> int:
    from onnxtrain.train import evaluate_checkpoint

    metrics = evaluate_checkpoint(_config(a), a.checkpoint)
    print(json.dumps(metrics) if a.json else "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return 0


def _export(a: argparse.Namespace) -> int:
    from onnxtrain.train import export_model, load_for_inference

    if not a.output.strip():
        raise UsageError("-o/--output: an empty path; give the .onnx file to write")
    if os.path.isdir(a.output):
        raise UsageError(f"-o/--output: {a.output} is a folder; give the .onnx file to write, e.g. "
                         f"{os.path.join(a.output, 'model.onnx')}")
    parent = os.path.dirname(os.path.abspath(a.output))
    if not os.path.isdir(parent):
        raise UsageError(f"-o/--output: the folder {parent} does not exist")
    cfg = _config(a)
    model, weights = load_for_inference(cfg, a.checkpoint)
    export_model(model, cfg, weights, a.output)
    print(f"wrote {a.output}")
    return 0


_SET_HELP = ("override a config value, e.g. --set training.epochs=5 --set optimizer.lr=3e-3 "
             "(YAML syntax, checked like the file; repeatable)")
_CKPT_HELP = "a checkpoint file, or a run folder (its latest checkpoint)"


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the training configuration (YAML), e.g. configs/digits_mlp.yaml")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help=_SET_HELP)


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


def _artifacts(a: argparse.Namespace) -> int:
    from onnxtrain.training import artifacts
    from onnxtrain.training_graph import discover_trainable

    model = _load(a.model)
    os.makedirs(a.output, exist_ok=True)
    split = lambda v: [n for n in (v or "").split(",") if n]  # noqa: E731 - a local one-liner
    loss = getattr(artifacts.LossType, a.loss) if a.loss else None
    requires = split(a.requires_grad)
    if not requires and loss is None:
        out = a.loss_output or model.graph.output[0].name
        requires = discover_trainable(model, out, {})
    elif not requires:
        requires = [t.name for t in model.graph.initializer if t.name not in split(a.frozen)]
    artifacts.generate_artifacts(
        model, requires_grad=requires, frozen_params=split(a.frozen), loss=loss,
        optimizer=getattr(artifacts.OptimType, a.optimizer) if a.optimizer else None,
        artifact_directory=a.output, prefix=a.prefix,
        additional_output_names=split(a.additional_outputs) or None, nominal_checkpoint=a.nominal_checkpoint,
        mixed_precision=a.mixed_precision, recompute=_recompute_flags(a))
    print(f"wrote the training artifacts of {a.model} to {a.output} ({len(requires)} trainable parameters)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models with numpy.")
    sub = parser.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config",
                        description="Train the model a YAML config describes; writes metrics.jsonl, "
                                    "checkpoints, metrics.png and model.onnx to the output folder. Ctrl-C "
                                    "stops between steps (exit 130); --resume continues from the last "
                                    "checkpoint.")
    _add_config_args(tr)
    tr.add_argument("--output-dir",
                    help="where the run's files go (default: output.dir, else runs/<config name>)")
    resume = tr.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_true",
                        help="continue from the last checkpoint in the output folder")
    resume.add_argument("--overwrite", action="store_true",
                        help="start over in an output folder that holds checkpoints of an earlier run, "
                             "deleting them (without it such a folder is refused)")
    tr.add_argument("-q", "--quiet", action="store_true",
                    help="no progress bar and no per-eval lines (the final summary, warnings and errors "
                         "are still printed)")
    tr.set_defaults(fn=_train)
    ev = sub.add_parser("eval", help="eval loss and accuracy of a checkpoint",
                        description="Score a checkpoint on the config's eval data (loss, and accuracy for "
                                    "class labels).")
    _add_config_args(ev)
    ev.add_argument("--checkpoint", required=True, help=_CKPT_HELP)
    ev.add_argument("--json", action="store_true", help="print the metrics as one JSON object")
    ev.set_defaults(fn=_eval)
    ex = sub.add_parser("export", help="write a checkpoint as a plain inference .onnx",
                        description="Write the config's model with a checkpoint's weights as an inference "
                                    "model (logits output, no loss or labels, BatchNormalization/Dropout in "
                                    "inference mode) that any ONNX runtime can load.")
    _add_config_args(ex)
    ex.add_argument("--checkpoint", required=True, help=_CKPT_HELP)
    ex.add_argument("-o", "--output", required=True, help="the .onnx file to write")
    ex.set_defaults(fn=_export)
    gg = sub.add_parser("gradient-graph", help="write the forward + backward graph of a model",
                        description="Append the backward pass of --loss to MODEL; outputs <x>_grad per x.")
    gg.add_argument("model", help="the ONNX model (with its loss in the graph)")
    gg.add_argument("--loss", required=True, help="name of the loss value")
    grp = gg.add_mutually_exclusive_group(required=True)
    grp.add_argument("--wrt", help="comma-separated values to differentiate with respect to")
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
                    help="comma-separated trainable initializers (default: all but --frozen)")
    ar.add_argument("--frozen", help="comma-separated frozen initializers")
    ar.add_argument("--loss", choices=["MSELoss", "CrossEntropyLoss", "BCEWithLogitsLoss", "L1Loss"],
                    help="loss appended to the model (default: the model's first output is the loss)")
    ar.add_argument("--loss-output", help="with no --loss: the output that is the loss")
    ar.add_argument("--optimizer", choices=["AdamW", "SGD"], help="write an optimizer model too")
    ar.add_argument("--prefix", default="", help="prefix of the artifact file names")
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
    a = parser.parse_args(argv)
    return _run(a)


def _run(a: argparse.Namespace) -> int:
    """``_guarded`` alone, or under an MPI launcher inside ``abort_on_error``: a rank that fails (or
    exits non-zero) aborts every rank instead of leaving them in their next collective."""
    from onnxtrain import parallel

    if a.command != "train" or not parallel.launched_by_mpi() or parallel.world().size == 1:
        return _guarded(a)
    parallel.get_communicator()  # before anything can fail, so that a failure can abort the job
    with parallel.abort_on_error():
        code = _guarded(a)
        if code and not getattr(a, "stopped_together", False):
            raise SystemExit(code)
    return code


def _guarded(a: argparse.Namespace) -> int:
    """Run the subcommand; known failures become one line on stderr and an exit code."""
    from onnxtrain.engine.plan import EngineError
    from onnxtrain.parallel import world
    from onnxtrain.train.config import ConfigError

    w = world()
    prog = f"onnxtrain {a.command}" + (f" [rank {w.rank}/{w.size}]" if w.size > 1 else "")
    try:
        return a.fn(a)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except ConfigError as e:
        where = getattr(a, "config", None)
        where = where if where and where not in str(e) else None  # the message may name the file itself
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
    except BrokenPipeError:  # the output went to a pipe that closed (| head): nothing more to say
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python would complain again at exit
        return EXIT_ERROR
    except (OSError, ValueError) as e:  # a missing or unwritable file, a misfit model
        if _debug():
            raise
        print(f"{prog}: {e} (set ONNXTRAIN_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _debug() -> bool:
    """ONNXTRAIN_DEBUG set to anything but empty, 0, false or no: failures show their traceback."""
    return os.environ.get("ONNXTRAIN_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


if __name__ == "__main__":
    sys.exit(main())

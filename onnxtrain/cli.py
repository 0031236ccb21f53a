"""The ``onnxtrain`` command."""

from __future__ import annotations

import argparse
import collections
import sys

import onnx


def _gradient_graph(a: argparse.Namespace) -> int:
    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.ir.io import save_model_atomic
    from onnxtrain.training_graph import discover_trainable

    model = onnx.load(a.model)
    if a.all_initializers:
        wrt = discover_trainable(model, a.loss, {})
    elif a.wrt:
        wrt = [w for w in a.wrt.split(",") if w]
    else:
        raise SystemExit("onnxtrain gradient-graph: give --wrt a,b or --all-initializers")
    out = build_gradient_model(model, a.loss, wrt)
    onnx.checker.check_model(out, full_check=True)
    save_model_atomic(out, a.output)
    print(f"wrote {a.output}: {len(out.graph.node)} nodes, gradients of {a.loss!r} w.r.t. {len(wrt)} value(s)")
    return 0


def _info(a: argparse.Namespace) -> int:
    from onnx import numpy_helper

    from onnxtrain.autodiff.registry import find_rule, has_no_gradient
    from onnxtrain.engine.registry import find_kernel
    from onnxtrain.inference import node_arg
    from onnxtrain.ir.builder import model_opset

    model = onnx.load(a.model)
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
    hist = collections.Counter(n.op_type for n in g.node)
    print("  ops: " + ", ".join(f"{op}×{c}" for op, c in sorted(hist.items())))
    no_kernel = sorted(op for op in hist if find_kernel(op, opset) is None)
    no_rule = sorted(op for op in hist if find_rule(op, max(opset, 17)) is None and not has_no_gradient(op))
    print(f"  ops without a kernel: {', '.join(no_kernel) or 'none'}")
    print(f"  ops without a gradient rule: {', '.join(no_rule) or 'none'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="onnxtrain", description="Train ONNX models with numpy.")
    sub = parser.add_subparsers(dest="command", required=True)
    gg = sub.add_parser("gradient-graph", help="write the forward + backward graph of a model",
                        description="Append the backward pass of --loss to MODEL; outputs <x>_grad per x.")
    gg.add_argument("model", help="the ONNX model (with its loss in the graph)")
    gg.add_argument("--loss", required=True, help="name of the loss value")
    grp = gg.add_mutually_exclusive_group()
    grp.add_argument("--wrt", help="comma-separated values to differentiate with respect to")
    grp.add_argument("--all-initializers", action="store_true",
                     help="every float initializer that reaches the loss")
    gg.add_argument("-o", "--output", required=True, help="where to write the gradient graph")
    gg.set_defaults(fn=_gradient_graph)
    info = sub.add_parser("info", help="inputs, outputs, parameters and op coverage of a model")
    info.add_argument("model")
    info.set_defaults(fn=_info)
    a = parser.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())

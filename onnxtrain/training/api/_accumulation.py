"""The training model without its gradient accumulators, for steps that overwrite the gradients.

A generated training model returns ``<p>_grad.accumulation.out = Where(reset, <p>_grad, buffer + <p>_grad)``.
onnxruntime runs every node of a graph whatever outputs are asked for, so on its backend a step after
``lazy_reset_grad()`` (the usual case) would still pay for the sum and the select over every parameter; the
numpy engine skips them by itself (``onnxtrain/engine/fusion/select.py``). The variant made here returns the
gradients as they are and takes neither the buffers nor the reset flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnx

from onnxtrain.ir.graphs import node_reads

RESET_INPUT = "lazy_reset_grad"
BUFFER_SUFFIX = "_grad.accumulation.buffer"
ACCUMULATED_SUFFIX = "_grad.accumulation.out"


def overwrite_variant(model: onnx.ModelProto, trainable: Sequence[str]) -> onnx.ModelProto | None:
    """A copy of ``model`` whose accumulated outputs are the gradients themselves (no buffer inputs, no reset
    flag); None when its accumulators are not exactly the ``Where(reset, g, buffer + g)`` that
    ``generate_artifacts`` writes, in which case the caller keeps the model as it is."""
    g = model.graph
    by_output = {o: n for n in g.node for o in n.output}
    inputs = {v.name for v in g.input}
    if RESET_INPUT not in inputs or not trainable:
        return None
    drop: set[int] = set()
    rename: dict[str, str] = {}
    index = {id(n): k for k, n in enumerate(g.node)}
    for p in trainable:
        grad, buf, out = f"{p}_grad", p + BUFFER_SUFFIX, p + ACCUMULATED_SUFFIX
        where = by_output.get(out)
        if where is None or where.op_type != "Where" or buf not in inputs:
            return None
        cond, chosen, total = where.input
        add = by_output.get(total)
        squeeze = by_output.get(cond)
        if (chosen != grad or add is None or add.op_type != "Add" or sorted(add.input) != sorted([buf, grad])
                or squeeze is None or list(squeeze.input)[:1] != [RESET_INPUT]):
            return None
        drop |= {index[id(where)], index[id(add)], index[id(squeeze)]}
        rename[grad] = out
    kept = [n for k, n in enumerate(g.node) if k not in drop]
    used = {i for n in kept for i in node_reads(n)}
    if RESET_INPUT in used or any(p + BUFFER_SUFFIX in used for p in trainable) or \
            any(t in rename for t in (o.name for o in g.output)):
        return None  # the flag, a buffer or a raw gradient is read elsewhere: not the generated pattern
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    for n in kept:
        m = out.graph.node.add()
        m.CopyFrom(n)
        m.input[:] = [rename.get(i, i) for i in n.input]
        m.output[:] = [rename.get(o, o) for o in n.output]
    dropped_inputs = {RESET_INPUT} | {p + BUFFER_SUFFIX for p in trainable}
    keep_inputs = [v for v in out.graph.input if v.name not in dropped_inputs]
    del out.graph.input[:]
    out.graph.input.extend(keep_inputs)
    keep_info = [v for v in out.graph.value_info if v.name not in rename]
    del out.graph.value_info[:]
    out.graph.value_info.extend(keep_info)
    return out

"""A gradient model cut in two: its forward pass and its backward pass as separate graphs.

``build_gradient_model`` returns one graph that runs the forward, then the backward. A caller that must run
the backward later, once the gradients of its outputs are known (a pipeline stage, seeded by the stage
after it), runs the forward graph first, keeps what it returns, and feeds that to the backward graph:

    fwd, bwd, saved = split_gradient_model(grad, forward_model)
    out = run(fwd, inputs)                     # forward outputs + the saved activations
    grads = run(bwd, {**saved_of(out), **seeds, **weights})

The forward nodes are those of ``forward_model`` (the model differentiated); every other node belongs to the
backward pass. The saved tensors are the forward values the backward reads: activations, Dropout masks,
pooling indices. A random node therefore draws once, in the forward graph.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.ir.builder import value_types
from onnxtrain.ir.graphs import RANDOM_OPS, node_reads
from onnxtrain.version import PRODUCER


def split_gradient_model(
    grad: onnx.ModelProto, forward_model: onnx.ModelProto
) -> tuple[onnx.ModelProto, onnx.ModelProto, list[str]]:
    """``(forward, backward, saved)``: ``forward`` computes ``forward_model``'s outputs and ``saved``;
    ``backward`` reads ``saved`` (graph inputs of the same names), the seeds and weights ``grad`` takes, and
    returns ``grad``'s outputs that the forward does not compute (the gradients)."""
    g = grad.graph
    forward_values = {o for n in forward_model.graph.node for o in n.output if o}
    fwd_nodes, bwd_nodes = [], []
    for n in g.node:
        (fwd_nodes if any(o in forward_values for o in n.output) else bwd_nodes).append(n)
    made_by_fwd = {o for n in fwd_nodes for o in n.output if o}
    made_by_bwd = {o for n in bwd_nodes for o in n.output if o}
    for n in fwd_nodes:
        late = [i for i in node_reads(n) if i in made_by_bwd]
        if late:
            raise ValueError(
                f"split_gradient_model: forward node {n.name or n.output[0]!r} reads {late[0]!r}, "
                "a value of the backward pass"
            )
    types = value_types(grad)
    for name, t in value_types(forward_model).items():  # the forward's value_info may know ranks more
        if _rank(types, name) is None:
            types[name] = t
    # a forward value whose rank shape inference cannot find cannot be a graph output: the nodes making it
    # run again in the backward graph, from values that can be saved (reshapes of attention heads, say)
    redo: set[int] = set()
    producer = {o: k for k, n in enumerate(fwd_nodes) for o in n.output if o}
    while True:
        again = [fwd_nodes[k] for k in sorted(redo)]
        bwd_reads = {i for n in (*again, *bwd_nodes) for i in node_reads(n)}
        remade = {o for n in again for o in n.output if o}
        saved = [o for n in fwd_nodes for o in n.output if o and o in bwd_reads and o not in remade]
        unranked = [x for x in saved if _rank(types, x) is None]
        if not unranked:
            break
        for x in unranked:
            k = producer[x]
            if fwd_nodes[k].op_type in RANDOM_OPS:
                raise ValueError(
                    f"split_gradient_model: the random node {fwd_nodes[k].name or x!r} makes {x!r}, "
                    "whose rank is unknown: it can neither be saved nor drawn again"
                )
            redo.add(k)
    bwd_nodes = [*again, *bwd_nodes]
    outputs = {o.name: o for o in g.output}
    fwd_outputs = [o for o in forward_model.graph.output] + [
        _value(s, types) for s in saved if s not in {o.name for o in forward_model.graph.output}
    ]
    fwd_reads = {i for n in fwd_nodes for i in node_reads(n)} | {o.name for o in fwd_outputs}
    forward = _model(
        grad,
        fwd_nodes,
        [i for i in g.input if i.name in fwd_reads],
        fwd_outputs,
        fwd_reads,
        f"{g.name}_forward",
    )
    bwd_outputs = [o for name, o in outputs.items() if name not in made_by_fwd]
    needed = (bwd_reads - remade) | {o.name for o in bwd_outputs}
    bwd_inputs = [i for i in g.input if i.name in needed] + [_value(s, types) for s in saved]
    backward = _model(grad, bwd_nodes, bwd_inputs, bwd_outputs, needed, f"{g.name}_backward")
    return forward, backward, saved




def _rank(types: dict[str, onnx.TypeProto], name: str) -> int | None:
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
        return None
    return len(t.tensor_type.shape.dim)


def _value(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    """A saved tensor's declaration: its element type and rank (dimensions unnamed: batches vary)."""
    t = types.get(name)
    if t is None or not t.HasField("tensor_type"):
        raise ValueError(f"split_gradient_model: the type of the saved value {name!r} is unknown")
    tt = t.tensor_type
    rank = len(tt.shape.dim) if tt.HasField("shape") else None
    return helper.make_tensor_value_info(name, tt.elem_type, [None] * rank if rank is not None else None)


def _model(
    base: onnx.ModelProto,
    nodes: list[onnx.NodeProto],
    inputs: list,
    outputs: list,
    reads: set[str],
    name: str,
) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes, name, inputs, outputs, initializer=[t for t in base.graph.initializer if t.name in reads]
    )
    m = helper.make_model(
        graph, opset_imports=list(base.opset_import), **PRODUCER, ir_version=base.ir_version
    )
    m.functions.extend(base.functions)
    return m

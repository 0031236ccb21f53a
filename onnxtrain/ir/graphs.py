"""Graph structure that node inputs alone do not show: the values a control-flow node's bodies read from
the graphs around them ("captures"). Passes that prune or follow dependencies read :func:`node_reads`;
constant values by name: :func:`constant_arrays`."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from functools import cache
from typing import Any

import numpy as np
import onnx
from onnx import AttributeProto, helper, numpy_helper

DEFAULT_DOMAINS = ("", "ai.onnx")  # the two names of ONNX's own operator domain

# ops that draw random values: a run of them cannot be repeated or shared (recompute, CSE, pipeline stages)
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                        "Bernoulli", "Multinomial"})


def added_later(node: onnx.NodeProto, opset: int) -> str:
    """", not an operator of opset M: ONNX added it at opset N" for a default-domain op that ``opset`` does
    not have yet (a model using an op before its version), else ""."""
    if node.domain not in DEFAULT_DOMAINS:
        return ""
    first = first_opset(node.op_type)
    return f", not an operator of opset {opset}: ONNX added it at opset {first}" if first > opset else ""


@cache
def first_opset(op_type: str, domain: str = "") -> int:
    """The first opset of ``domain`` (ONNX's own: ``""``) that defines ``op_type``; 0 for an op it never
    defines."""
    versions = [s.since_version for s in onnx.defs.get_all_schemas_with_history()
                if s.name == op_type and (s.domain or "") == domain]
    return min(versions, default=0)


def is_training_batch_norm(n: onnx.NodeProto) -> bool:
    """Whether ``n`` is a BatchNormalization in training mode (it computes new running statistics)."""
    return n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute)


def inference_batch_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its inference-mode BatchNormalizations stripped of the running-statistics outputs that
    nothing reads (from opset 14, where the ``training_mode`` attribute, not the number of outputs, sets the
    mode): onnxruntime-training's generator leaves them on the eval model of a model exported in training
    mode, and ONNX's checker and onnxruntime refuse such a node ("should be 1 when Training_mode = False").
    ``model`` itself when there are none."""
    from onnxtrain.ir.builder import model_opset

    if model_opset(model) < 14:
        return model
    read = {i for n in model.graph.node for i in node_reads(n)} | {o.name for o in model.graph.output}
    found = [
        k for k, n in enumerate(model.graph.node)
        if n.op_type == "BatchNormalization" and n.domain in DEFAULT_DOMAINS and len(n.output) > 1
        and not is_training_batch_norm(n) and not read & set(n.output[1:])
    ]
    if not found:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for k in found:
        del out.graph.node[k].output[1:]
    return out


def eval_batch_norms(model: onnx.ModelProto) -> onnx.ModelProto:
    """An eval model with its training-mode BatchNormalizations (and Dropouts) in inference mode
    (:func:`inference_mode`, a copy), or ``model`` itself when it has none.

    onnxruntime-training's generator leaves a BatchNormalization of a model exported in training mode below
    opset 14 with its four statistics outputs in the eval model (there is no ``training_mode`` attribute to
    clear), which makes it a training-mode node: onnxruntime, and onnxruntime-training 1.19.2's eval mode,
    then normalize with the batch's statistics and compute new running ones."""
    from onnxtrain.ir.builder import model_opset

    old = model_opset(model) < 14

    def training(n: onnx.NodeProto) -> bool:
        if n.op_type != "BatchNormalization" or n.domain not in DEFAULT_DOMAINS:
            return False
        return any(n.output[1:]) if old else is_training_batch_norm(n)

    if not any(training(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    inference_mode(out.graph)
    return out


def inference_mode(graph: onnx.GraphProto) -> None:
    """Put ``graph``'s Dropout and BatchNormalization nodes, those of the bodies nested in it too, in
    inference mode (in place): a Dropout's ``training_mode`` left out (its slot kept empty), a
    BatchNormalization's ``training_mode`` 0 and its running-statistics outputs Identities of its running
    statistics inputs (other outputs dropped)."""
    for g in walk_graphs(graph):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            nodes.append(n)
            if n.domain not in DEFAULT_DOMAINS:
                continue
            if n.op_type == "Dropout" and len(n.input) >= 3:
                n.input[2] = ""
            elif n.op_type == "BatchNormalization":
                for a in n.attribute:
                    if a.name == "training_mode":
                        a.i = 0
                for k in (1, 2):  # not allowed in inference mode: they equal the inputs
                    if len(n.output) > k and n.output[k]:
                        nodes.append(helper.make_node("Identity", [n.input[k + 2]], [n.output[k]],
                                                      name=f"{n.name}_running_stat{k}"))
                del n.output[1:]
        del g.node[:]
        g.node.extend(nodes)


def train_batch_norms(nodes: Iterable[onnx.NodeProto], names: Callable[[str], str]) -> list[str]:
    """Put every BatchNormalization among ``nodes`` in training mode, in place, as onnxruntime's training
    graphs do (its BatchNormReplacement rewrites each one, whatever mode it was exported in, into a
    training-mode BatchNormInternal): batch statistics, and new running statistics computed, in outputs
    named by ``names`` (a :class:`~onnxtrain.ir.builder.NameGen` of the graph) where the node has none.
    Returns the names of the nodes changed. Needs opset 14 or later (the attribute)."""
    changed = []
    for n in nodes:
        if n.op_type != "BatchNormalization" or n.domain not in DEFAULT_DOMAINS or is_training_batch_norm(n):
            continue
        for a in list(n.attribute):
            if a.name == "training_mode":
                n.attribute.remove(a)
        n.attribute.append(onnx.helper.make_attribute("training_mode", 1))
        for k, what in ((1, "running_mean"), (2, "running_var")):  # named: shape inference wants all three
            if len(n.output) <= k:
                n.output.append("")
            if not n.output[k]:
                n.output[k] = names(f"{n.output[0]}_{what}")
        changed.append(n.name)
    return changed


def chain_shared_batch_norms(model: onnx.ModelProto, names: Callable[[str], str]) -> list[str]:
    """Chain, in place, the running statistics of one BatchNorm layer applied several times in a forward
    (a shared encoder): nodes that read the same scale and bias and the same running mean and variance
    (directly or through Identity nodes) each read the statistics the one before computes, as torch updates
    the layer's buffers once per application; the exporter writes each application reading the initial
    values. Returns the names of the nodes rewired. Run before :func:`untie_batch_norm_statistics`, which
    would otherwise give each application statistics of its own, none of them the layer's."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output if o}

    def source(name: str) -> str:
        while name in producers and producers[name].op_type == "Identity":
            name = producers[name].input[0]
        return name

    groups: dict[tuple[str, ...], list[onnx.NodeProto]] = {}
    for n in g.node:
        if n.op_type == "BatchNormalization" and n.domain in DEFAULT_DOMAINS and len(n.input) == 5:
            stats = (source(n.input[3]), source(n.input[4]))
            if all(s in inits for s in stats):
                groups.setdefault((n.input[1], n.input[2], *stats), []).append(n)
    rewired: list[str] = []
    for nodes in groups.values():
        for prev, n in zip(nodes, nodes[1:]):
            while len(prev.output) < 3:
                prev.output.append("")
            for k, what in ((1, "running_mean"), (2, "running_var")):
                if not prev.output[k]:
                    prev.output[k] = names(f"{prev.output[0]}_{what}")
                n.input[k + 2] = prev.output[k]  # (computed once the node trains: train_batch_norms)
            rewired.append(n.name)
    if rewired:  # the Identity copies of the statistics nothing reads any more
        read = {i for n in g.node for i in node_reads(n)} | {o.name for o in g.output}
        dead = [n for n in g.node if n.op_type == "Identity" and n.output[0] not in read]
        while dead:
            for n in dead:
                g.node.remove(n)
            read = {i for n in g.node for i in node_reads(n)} | {o.name for o in g.output}
            dead = [n for n in g.node if n.op_type == "Identity" and n.output[0] not in read]
    return rewired


def last_statistics(nodes: Iterable[onnx.NodeProto], output: str, k: int) -> str:
    """The statistics a chain of BatchNorm applications (:func:`chain_shared_batch_norms`) ends on: ``output``
    (running statistic ``k``, 1 or 2, of one application), or that of the last application reading it."""
    readers = {n.input[k + 2]: n for n in nodes
               if n.op_type == "BatchNormalization" and len(n.input) > k + 2 and n.input[k + 2]}
    seen = {output}
    while output in readers and len(readers[output].output) > k and readers[output].output[k]:
        output = readers[output].output[k]
        if output in seen:
            break
        seen.add(output)
    return output


def untie_batch_norm_statistics(model: onnx.ModelProto, names: Callable[[str], str]) -> list[str]:
    """Give each BatchNormalization of ``model``'s graph a running mean and variance of its own, in place.

    Exporters merge initializers of equal value (torch's TorchScript exporter does so for a fresh model,
    whose BatchNorm scales and running variances are all ones), reading the survivor through Identity nodes
    named after the merged tensors: a layer's running variance is then another layer's scale, and training
    would write the new statistics over it (onnxruntime does, in place) or keep no statistics at all. Each
    such input becomes an initializer holding a copy of the value, named after the Identity's output (the
    exported buffer's name) when nothing else reads that, else by ``names``; a layer reading the initializer
    itself keeps it (it is its buffer) when the others read it only as running statistics through Identity
    nodes. Returns the new initializers."""
    g = model.graph
    inits = {t.name: t for t in g.initializer}
    producers = {o: n for n in g.node for o in n.output if o}
    readers: dict[str, int] = {}  # reads of each value (a node reading it twice: 2)
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        reads = node_reads(n)
        for name in reads:
            readers[name] = readers.get(name, 0) + 1
        for name in set(reads):
            consumers.setdefault(name, []).append(n)
    outside = {v.name for v in (*g.input, *g.output)}
    made: list[str] = []
    dropped: list[onnx.NodeProto] = []
    for n in g.node:
        if n.op_type != "BatchNormalization" or n.domain not in DEFAULT_DOMAINS:
            continue
        for k in (3, 4):
            name = n.input[k] if len(n.input) > k else ""
            source, chain = name, []
            while source in producers and producers[source].op_type == "Identity":
                chain.append(producers[source])
                source = chain[-1].input[0]
            if source not in inits or source in outside or (not chain and readers.get(source) == 1):
                continue
            if not chain and all(m is n or (m.op_type == "Identity" and _stats_only(m.output[0], consumers))
                                 for m in consumers.get(source, [])) and list(n.input).count(source) == 1:
                continue  # the layers reading it through Identity nodes get copies: it keeps its buffer
            only_here = readers.get(name) == 1 and name not in outside
            new = name if chain and only_here else names(f"{name}_{('mean', 'var')[k - 3]}")
            if new == name:
                dropped.append(chain[0])
            t = g.initializer.add()
            t.CopyFrom(inits[source])
            t.name = new
            n.input[k] = new
            made.append(new)
    for d in dropped:
        g.node.remove(d)
    return made


def _stats_only(value: str, consumers: Mapping[str, list[onnx.NodeProto]]) -> bool:
    """Whether ``value`` is read only as BatchNormalization running statistics, directly or through
    Identity nodes."""
    for m in consumers.get(value, []):
        if m.op_type == "Identity":
            if not _stats_only(m.output[0], consumers):
                return False
        elif m.op_type != "BatchNormalization" or any(i == value for i in m.input[:3]):
            return False
    return True


def named_subgraphs(node: onnx.NodeProto) -> Iterable[tuple[str, onnx.GraphProto]]:
    """(attribute name, graph) of the graphs held by a node's attributes (If's branches, Loop's and Scan's
    bodies)."""
    for a in node.attribute:
        if a.type == AttributeProto.GRAPH:
            yield a.name, a.g
        elif a.type == AttributeProto.GRAPHS:
            for g in a.graphs:
                yield a.name, g


def subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    """The graphs held by a node's attributes (If's branches, Loop's and Scan's bodies)."""
    if not node.attribute:  # (most nodes: this runs several times a node in every graph pass)
        return []
    return [g for _, g in named_subgraphs(node)]


def graph_values(graph: onnx.GraphProto) -> set[str]:
    """The names ``graph`` itself defines: its inputs, initializers (sparse ones too) and node outputs."""
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    names |= {t.values.name for t in graph.sparse_initializer}
    names |= {o for n in graph.node for o in n.output if o}
    return names


def in_topological_order(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose graphs (bodies too) list their nodes in an order where each node comes after
    the nodes making what it reads, as onnxruntime sorts them at load (ONNX requires the order; hand-built
    graphs may lack it). The given order is kept wherever it already allows; a graph with a cycle or a name
    written twice is left as it is (:func:`misdefined_name` names the fault)."""
    if all(_sorted_nodes(g) is None for g in walk_graphs(model.graph)):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for g in walk_graphs(out.graph):
        order = _sorted_nodes(g)
        if order is not None:
            nodes = [g.node[k] for k in order]
            copies = [onnx.NodeProto() for _ in nodes]
            for c, n in zip(copies, nodes):
                c.CopyFrom(n)
            del g.node[:]
            g.node.extend(copies)
    return out


def _sorted_nodes(graph: onnx.GraphProto) -> list[int] | None:
    """The indices of ``graph``'s nodes in topological order (the lowest index first among those ready), or
    None when they are in order already, or when no order exists or a name is written twice."""
    import heapq

    maker: dict[str, int] = {}
    for k, n in enumerate(graph.node):
        for o in n.output:
            if o:
                if o in maker:
                    return None
                maker[o] = k
    if _in_order(graph, maker):  # (the common case: no node's dependencies need be mapped)
        return None
    needs = [{maker[r] for r in node_reads(n) if r in maker and maker[r] != k}
             for k, n in enumerate(graph.node)]
    waiting = [len(d) for d in needs]
    feeds: list[list[int]] = [[] for _ in needs]
    for k, deps in enumerate(needs):
        for d in deps:
            feeds[d].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(k)
        for j in feeds[k]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    return order if len(order) == len(needs) else None


def _in_order(graph: onnx.GraphProto, maker: Mapping[str, int]) -> bool:
    """Whether every node of ``graph`` comes after the nodes making what it reads (``maker``: value → index
    of the node making it)."""
    for k, n in enumerate(graph.node):
        for r in node_reads(n):
            if maker.get(r, -1) > k:
                return False
    return True


class _Enclosing:
    """The names the graphs around a body define so far, innermost graph first."""

    def __init__(self, defined: dict[str, str], graph: str, outer: _Enclosing | None):
        self.defined, self.graph, self.outer = defined, graph, outer

    def find(self, name: str) -> str | None:
        """What defines ``name`` in an enclosing graph (and which graph), or None."""
        scope: _Enclosing | None = self
        while scope is not None:
            if name in scope.defined:
                return f"{scope.defined[name]} of graph {scope.graph!r}"
            scope = scope.outer
        return None


def misdefined_name(graph: onnx.GraphProto, outer: _Enclosing | None = None) -> str | None:
    """What first breaks ONNX's naming rules in ``graph`` or a body in it, or None: a name defined twice (two
    graph inputs, a node output named like an input, initializer or earlier output, or a body's node output
    named like a value an enclosing graph defines before the body's node), or a node reading a value that a
    later node defines (nodes out of topological order). onnxruntime refuses the first at load. A graph
    input may share an initializer's name (the initializer is its default), and initializers and Constant
    outputs may repeat a name (onnxruntime warns and takes the last, as the engine does); a body's inputs
    and initializers may take an enclosing graph's names (they hide them inside the body)."""
    where: dict[str, str] = {}
    for v in graph.input:
        if v.name in where:
            return f"graph {graph.name!r} declares input {v.name!r} twice"
        where[v.name] = "a graph input"
    constants: set[str] = set()  # initializers and Constant outputs: onnxruntime takes the last of a name
    for name in [t.name for t in graph.initializer] + [t.values.name for t in graph.sparse_initializer]:
        constants.add(name)
        where.setdefault(name, "an initializer")
    later = {o for n in graph.node for o in n.output if o}
    scope = _Enclosing(where, graph.name, outer)  # what a body of this graph sees (``where`` as it grows)
    for k, node in enumerate(graph.node):
        label = f"node {node.name!r}" if node.name else f"node #{k} (unnamed)"
        early = next((r for r in node_reads(node) if r and r not in where and r in later
                      and (outer is None or outer.find(r) is None)), None)
        if early is not None:
            return (f"{label} ({node.op_type}) in graph {graph.name!r} reads {early!r} before the node that "
                    "writes it: the nodes are not in topological order")
        for body in subgraphs(node):  # before the node's own outputs, which its bodies do not see
            found = misdefined_name(body, scope)
            if found:
                return found
        found = _redefined(graph, node, label, where, constants, outer)
        if found:
            return found
    return None


def _redefined(graph: onnx.GraphProto, node: onnx.NodeProto, label: str, where: dict[str, str],
               constants: set[str], outer: _Enclosing | None) -> str | None:
    """The error for an output of ``node`` whose name is already defined, in its graph or (for a body) in an
    enclosing one, else None; records the outputs in ``where`` (and ``constants``)."""
    constant = node.op_type == "Constant" and node.domain in DEFAULT_DOMAINS
    for o in node.output:
        if not o:
            continue
        if o in where and not (constant and o in constants):
            return (f"{label} ({node.op_type}) in graph {graph.name!r} writes {o!r}, which {where[o]} "
                    "already defines (each name has one definition)")
        above = outer.find(o) if outer is not None and o not in where else None
        if above is not None:
            return (f"{label} ({node.op_type}) in body {graph.name!r} writes {o!r}, which {above} already "
                    "defines (a body may not define again a name of an enclosing graph)")
        where[o] = f"{label} ({node.op_type})"
        if constant:
            constants.add(o)
    return None


# typed fields that hold one value per element, by element type
_ONE_PER_ELEMENT = {onnx.TensorProto.FLOAT: "float_data", onnx.TensorProto.DOUBLE: "double_data",
                    onnx.TensorProto.INT64: "int64_data", onnx.TensorProto.INT32: "int32_data",
                    onnx.TensorProto.UINT64: "uint64_data"}


def mis_sized_initializer(graph: onnx.GraphProto) -> str | None:
    """The first initializer of ``graph`` (bodies included) whose data holds another number of values than
    its shape says (checked for data in the file, of types a byte or more wide), or None."""
    for g in walk_graphs(graph):
        for t in g.initializer:
            if t.data_location == onnx.TensorProto.EXTERNAL:
                continue
            count = int(np.prod(t.dims, dtype=np.int64))
            if t.raw_data:
                width = _WIDTHS.get(t.data_type)
                if width is None:
                    continue
                held, want = len(t.raw_data), count * width
                unit = "bytes"
            elif t.data_type in _ONE_PER_ELEMENT:
                held, want, unit = len(getattr(t, _ONE_PER_ELEMENT[t.data_type])), count, "values"
            else:
                continue
            if held != want and not (count == 0 and held == 0):
                return (f"initializer {t.name!r} of shape {list(t.dims)} holds {held} {unit} of data, where "
                        f"its shape takes {want}")
    return None


_WIDTHS = {code: np.dtype(onnx.helper.tensor_dtype_to_np_dtype(code)).itemsize
           for code in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
                        onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
                        onnx.TensorProto.UINT16, onnx.TensorProto.INT32, onnx.TensorProto.UINT32,
                        onnx.TensorProto.INT64, onnx.TensorProto.UINT64, onnx.TensorProto.BOOL,
                        onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128)}
_WIDTHS[onnx.TensorProto.BFLOAT16] = 2


def captured_names(graph: onnx.GraphProto) -> list[str]:
    """Names ``graph`` reads but does not define (inputs, initializers, node outputs), nested graphs
    included, in order of first use: what it captures from the graphs around it."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    defined |= {t.values.name for t in graph.sparse_initializer}
    out: list[str] = []

    def use(name: str) -> None:
        if name and name not in defined and name not in out:
            out.append(name)

    for node in graph.node:
        for name in node_reads(node):
            use(name)
        defined.update(o for o in node.output if o)
    for v in graph.output:
        use(v.name)
    return out


def body_reads(node: onnx.NodeProto) -> list[str]:
    """The values of enclosing graphs that a node's bodies read (none for a node without a body)."""
    if not node.attribute:  # (most nodes; asked of every node by several passes)
        return []
    reads: list[str] = []
    for g in subgraphs(node):
        reads.extend(n for n in captured_names(g) if n not in reads)
    return reads


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Every value a node reads: its inputs (omitted ones skipped), then what its bodies capture."""
    reads = [n for n in node.input if n]
    if node.attribute:  # only a node with attributes may have a body
        reads.extend(n for n in body_reads(node) if n not in reads)
    return reads


def walk_graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """``graph`` and every body nested in its nodes."""
    yield graph
    for node in graph.node:
        if node.attribute:
            for g in subgraphs(node):
                yield from walk_graphs(g)


def model_graphs(model: onnx.ModelProto) -> list[onnx.GraphProto]:
    """The model's graph and every body in it or in its local functions' nodes."""
    graphs = list(walk_graphs(model.graph))
    return graphs + [b for f in model.functions for n in f.node for g in subgraphs(n) for b in walk_graphs(g)]


def model_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The nodes of :func:`model_graphs` and of the local functions themselves."""
    return [n for g in model_graphs(model) for n in g.node] + [n for f in model.functions for n in f.node]


def rename_values(node: onnx.NodeProto, names: dict[str, str]) -> None:
    """Rename, in place, the values ``node`` reads or makes and those its bodies (nested ones too) read,
    make, take as inputs or initializers, declare or output, by ``names``."""
    if not names:
        return
    node.input[:] = [names.get(n, n) for n in node.input]
    node.output[:] = [names.get(n, n) for n in node.output]
    for g in subgraphs(node):
        rename_in_graph(g, names)


def rename_in_graph(g: onnx.GraphProto, names: dict[str, str]) -> None:
    """Rename, in place, the values graph ``g`` (a body) takes, makes, declares or outputs, and those of its
    nodes' bodies, by ``names``."""
    for inner in g.node:
        rename_values(inner, names)
    for v in (*g.input, *g.output, *g.value_info):
        v.name = names.get(v.name, v.name)
    for t in g.initializer:
        t.name = names.get(t.name, t.name)


def path_to(nodes: Iterable[onnx.NodeProto], outputs: Iterable[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes (in order) that ``outputs`` depend on, and every value they and ``outputs`` read."""
    needed = set(outputs)
    kept = []
    for node in reversed(list(nodes)):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(node_reads(node))
    kept.reverse()
    return kept, needed


def path_from(nodes: Iterable[onnx.NodeProto],
              values: Iterable[str]) -> tuple[list[onnx.NodeProto], set[str]]:
    """The nodes (in order) that depend on ``values``, and ``values`` with every value those nodes make:
    :func:`path_to` the other way."""
    reach = set(values)
    kept = []
    for node in nodes:
        if any(i in reach for i in node_reads(node)):
            kept.append(node)
            reach.update(o for o in node.output if o)
    return kept, reach


def model_for_outputs(model: onnx.ModelProto, outputs: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` computing only ``outputs`` (graph outputs of it): the nodes, inputs and
    initializers on their path, nothing else."""
    wanted = list(outputs)
    g = model.graph
    nodes, needed = path_to(g.node, wanted)
    out_info = {v.name: v for v in g.output}
    graph = onnx.helper.make_graph(
        nodes,
        g.name,
        [v for v in g.input if v.name in needed],
        [out_info[n] for n in wanted],
        initializer=[t for t in g.initializer if t.name in needed],
        value_info=[v for v in g.value_info if v.name in needed],
    )
    result = onnx.ModelProto()
    result.CopyFrom(model)
    result.graph.CopyFrom(graph)
    return result


def fed_initializers(model: onnx.ModelProto) -> set[str]:
    """The initializers a run may feed: those also declared as graph inputs, from IR version 4 (below it
    every initializer is declared so, and they are constants), as onnxruntime tells them."""
    if model.ir_version < 4:
        return set()
    return {i.name for i in model.graph.input} & {t.name for t in model.graph.initializer}


def with_input_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """``model`` (a copy) whose graph inputs named in ``values`` also hold those values as initializers, each
    of the input's declared element type and static shape (others are left out): a session's state written
    into a dumped graph, so that it runs on its own; the inputs stay, so a run may still feed them. From IR
    version 4 only (before it, every initializer was a graph input and a constant)."""
    if model.ir_version < 4:
        return model
    have = {t.name for t in model.graph.initializer}
    add = []
    for v in model.graph.input:
        a = values.get(v.name)
        if a is None or v.name in have or not v.type.HasField("tensor_type"):
            continue
        tt = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim]
        a = np.asarray(a)
        if (not tt.HasField("shape") or list(a.shape) != dims
                or onnx.helper.np_dtype_to_tensor_dtype(a.dtype) != tt.elem_type):
            continue
        add.append(numpy_helper.from_array(a, v.name))
    if not add:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.initializer.extend(add)
    return out


def constant_arrays(graph: onnx.GraphProto, wanted: Collection[str],
                    fed: Collection[str] = ()) -> dict[str, np.ndarray]:
    """Values of the initializers (but those in ``fed``: :func:`fed_initializers`) and Constant nodes (their
    ``value`` attribute) named in ``wanted``."""
    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer
           if t.name in wanted and t.name not in fed}
    for n in graph.node:
        if n.op_type == "Constant" and n.output and n.output[0] in wanted:
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None:
                out[n.output[0]] = numpy_helper.to_array(value)
    return out


def drop_value_info(graph: onnx.GraphProto, names: Collection[str]) -> None:
    """Remove from ``graph`` (in place) the declared ``value_info`` of the values named in ``names``."""
    kept = [vi for vi in graph.value_info if vi.name not in names]
    if len(kept) < len(graph.value_info):
        graph.ClearField("value_info")
        graph.value_info.extend(kept)


def drop_unread(graph: onnx.GraphProto, names: Collection[str], ops: Collection[str] = ("Constant",)) -> None:
    """Remove from ``graph`` (in place) the initializers named in ``names`` and the nodes of ``ops`` making
    them that nothing reads any more, then likewise what those nodes read: the constants, shape arithmetic
    or transposes that only a rewritten node used (onnxruntime warns of unused initializers)."""
    outputs = {o.name for o in graph.output}
    declared = {i.name for i in graph.input}  # an initializer that is also an input stays (it may be fed)
    todo = set(names)
    while todo:
        read = {i for n in graph.node for i in node_reads(n)} | outputs
        unread = todo - read
        dead = [k for k, n in enumerate(graph.node)
                if n.op_type in ops and n.output and not set(n.output) & read and set(n.output) & unread]
        for t in [t for t in graph.initializer if t.name in unread and t.name not in declared]:
            graph.initializer.remove(t)
        todo = {i for k in dead for i in graph.node[k].input if i}
        if dead:
            gone = set(dead)
            kept = [n for k, n in enumerate(graph.node) if k not in gone]
            del graph.node[:]
            graph.node.extend(kept)


def _name_lists(model: onnx.ModelProto) -> Iterator[tuple[Any, str | int]]:
    """Every (message or repeated field, attribute or index) that holds a value name in ``model``."""
    for g in model_graphs(model):
        for v in (*g.input, *g.output, *g.value_info, *g.initializer):
            yield v, "name"
        for s in g.sparse_initializer:
            yield s.values, "name"
            yield s.indices, "name"
        for n in g.node:
            yield from ((n.input, k) for k in range(len(n.input)))
            yield from ((n.output, k) for k in range(len(n.output)))
    for f in model.functions:
        yield from ((f.input, k) for k in range(len(f.input)))
        yield from ((f.output, k) for k in range(len(f.output)))
        for n in f.node:
            yield from ((n.input, k) for k in range(len(n.input)))
            yield from ((n.output, k) for k in range(len(n.output)))


def _get(holder: Any, key: Any) -> Any:
    return getattr(holder, key) if isinstance(key, str) else holder[key]


def text_value_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose value names that are not valid UTF-8 (protobuf gives them as bytes) are
    decoded with backslash escapes, the same everywhere they occur, so that names made from them are text.
    A decoded name that another value already has is refused (:class:`ValueError`)."""
    if not any(type(_get(h, k)) is bytes for h, k in _name_lists(model)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    spots = list(_name_lists(copy))
    texts = {v for v in (_get(h, k) for h, k in spots) if type(v) is str}
    for holder, key in spots:
        raw = _get(holder, key)
        if type(raw) is not bytes:
            continue
        text = raw.decode("utf-8", errors="backslashreplace")
        if text in texts:
            raise ValueError(f"value name {raw!r} is not valid UTF-8, and its decoded form {text!r} names "
                             "another value of the model")
        if isinstance(key, str):
            setattr(holder, key, text)
        else:
            holder[key] = text
    return copy

"""Pipeline parallelism: the legacy ``pipeline_cut_info_string``, and the stages it cuts a graph into.

The string lists the cuts in order, separated by ``,``; cut ``i`` separates stage ``i`` from stage ``i + 1``.
A cut lists edges separated by ``:``. An edge is a tensor name (every consumer of the tensor goes to the
later stage) or ``tensor-consumer1/consumer2`` (only those consumers do; a consumer node is named by one of
its outputs, as onnxruntime's parser took it). ``"12"`` cuts a graph in two at tensor ``12``;
``"11,15"`` in three.

A node's stage is the highest stage of what it reads (its inputs and the outer values its bodies capture),
plus one across a cut edge. A node that reads only graph inputs, initializers or other such nodes (a
``Constant``, an ``Identity`` of a weight, a label's preprocessing), draws no random values and keeps no
running statistics runs in every stage that reads it other than across a cut, instead of its values being
sent. :func:`partition` checks that every stage has nodes, that each cut's tensors are computed in the stage
the cut ends and that the loss is computed in the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx

from onnxtrain.ir.graphs import RANDOM_OPS, is_training_batch_norm, node_reads, subgraphs


@dataclass(frozen=True)
class CutEdge:
    """A tensor cut between two stages; ``consumers`` (names of their outputs) limits the cut to them."""

    tensor: str
    consumers: tuple[str, ...] = ()


@dataclass
class Partition:
    """Stage of each node (by index) and the tensors each stage hands to the next."""

    stages: int
    stage_of: list[int]  # the first stage running each node
    copies: dict[int, set[int]] = field(default_factory=dict)  # node → the other stages running a copy of it
    sends: list[list[str]] = field(default_factory=list)  # sends[s]: tensors stage s passes to stage s + 1

    def runs(self, k: int) -> set[int]:
        """The stages that run node ``k``."""
        return {self.stage_of[k], *self.copies.get(k, ())}

    def nodes(self, model: onnx.ModelProto, stage: int) -> list[onnx.NodeProto]:
        return [n for k, n in enumerate(model.graph.node) if stage in self.runs(k)]

    def received(self, stage: int) -> list[str]:
        return self.sends[stage - 1] if stage > 0 else []


def parse_cut_info(text: str, stages: int) -> list[list[CutEdge]]:
    """The cuts of ``pipeline_cut_info_string``; there must be ``stages - 1`` of them."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError(
            f"pipeline_parallel_size={stages} needs pipeline_cut_info_string (the tensors where "
            f"one stage ends, e.g. '12' for two stages or '11,15' for three), got {text!r}"
        )
    cuts: list[list[CutEdge]] = []
    for i, group in enumerate(text.split(",")):
        edges = []
        for item in group.split(":"):
            parts = item.strip().split("-")
            if len(parts) > 2 or not parts[0] or (len(parts) == 2 and not parts[1]):
                raise ValueError(
                    f"pipeline_cut_info_string: cut {i} has a malformed edge {item!r} (write "
                    "'tensor' or 'tensor-consumer1/consumer2')"
                )
            consumers = tuple(c.strip() for c in parts[1].split("/")) if len(parts) == 2 else ()
            if any(not c for c in consumers):
                raise ValueError(f"pipeline_cut_info_string: cut {i}: empty consumer name in {item!r}")
            edges.append(CutEdge(parts[0].strip(), consumers))
        cuts.append(edges)
    if len(cuts) != stages - 1:
        raise ValueError(
            f"pipeline_cut_info_string {text!r} has {len(cuts)} cut(s), but "
            f"pipeline_parallel_size={stages} needs {stages - 1}"
        )
    return cuts


def partition(model: onnx.ModelProto, cuts: list[list[CutEdge]], loss: str) -> Partition:
    """Assign every node of ``model`` (topologically sorted, as ONNX requires) to a stage."""
    nodes = list(model.graph.node)
    stages = len(cuts) + 1
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    # what a node reads: its inputs and the outer values its bodies capture (an If's branches)
    reads = [node_reads(n) for n in nodes]
    readers: dict[str, list[int]] = {}
    for k in range(len(nodes)):
        for i in reads[k]:
            readers.setdefault(i, []).append(k)
    cut_at: dict[tuple[str, int], int] = {}  # (tensor, reading node) → the cut it crosses
    for c, edges in enumerate(cuts):
        for e in edges:
            if e.tensor not in producer:
                where = (
                    "a graph input or initializer (every stage reads those)"
                    if e.tensor in _sources(model)
                    else "not a tensor of the graph"
                )
                raise ValueError(f"pipeline_cut_info_string: cut {c}: {e.tensor!r} is {where}")
            targets = readers.get(e.tensor, [])
            if e.consumers:
                chosen = []
                for name in e.consumers:
                    k = producer.get(name)
                    if k is None or k not in targets:
                        raise ValueError(
                            f"pipeline_cut_info_string: cut {c}: no node with output {name!r} "
                            f"reads {e.tensor!r}"
                        )
                    chosen.append(k)
                targets = chosen
            if not targets:
                raise ValueError(f"pipeline_cut_info_string: cut {c}: nothing reads {e.tensor!r}")
            for k in targets:
                cut_at[(e.tensor, k)] = c
    stage_of = [0] * len(nodes)
    free = [True] * len(nodes)  # reads no tensor a node computed, apart from other free nodes'
    for k in range(len(nodes)):
        for i in reads[k]:
            p = producer.get(i)
            if p is None:
                continue
            c = cut_at.get((i, k))
            stage_of[k] = max(stage_of[k], stage_of[p] if c is None else c + 1)
            if c is not None or not free[p]:
                free[k] = False
    feeds_cut = set()  # the nodes the cut tensors are computed from: they stay where the cuts put them
    todo = [producer[e.tensor] for edges in cuts for e in edges]
    while todo:
        k = todo.pop()
        if k not in feeds_cut:
            feeds_cut.add(k)
            todo.extend(producer[i] for i in reads[k] if i in producer)
    # a free node runs in every stage that reads it other than across a cut (where its tensor is sent),
    # and, when a cut tensor is computed from it, in the stage its inputs put it
    # (not a random node, nor a training-mode BatchNormalization, nor a node whose bodies hold one: run twice,
    # they would draw twice or update their running statistics twice)
    floating = [k for k in range(len(nodes)) if free[k] and not _draws_or_keeps(nodes[k])]
    needed: dict[int, set[int]] = {}
    for k in reversed(floating):
        stages_k = {stage_of[k]} if k in feeds_cut else set()
        for o in nodes[k].output:
            for r in readers.get(o, []) if o else []:
                if (o, r) not in cut_at:
                    stages_k |= needed.get(r, {stage_of[r]})
        if stages_k:
            needed[k] = stages_k
            stage_of[k] = min(stages_k)
    for c, edges in enumerate(cuts):
        for e in edges:
            s = stage_of[producer[e.tensor]]
            if s != c:
                raise ValueError(
                    f"pipeline_cut_info_string: cut {c} separates stage {c} from stage {c + 1}, "
                    f"but {e.tensor!r} is computed in stage {s} (list the cuts in graph order)"
                )
    used = set(stage_of)
    empty = [s for s in range(stages) if s not in used]
    if empty:
        raise ValueError(f"pipeline_cut_info_string: stage(s) {empty} of {stages} get no node")
    if loss not in producer:
        raise ValueError(f"pipeline parallel: the loss {loss!r} must be computed by a node of the graph")
    if stage_of[producer[loss]] != stages - 1:
        raise ValueError(
            f"pipeline parallel: the loss {loss!r} is computed in stage "
            f"{stage_of[producer[loss]]}, not in the last stage ({stages - 1}): add a cut after it "
            "or fewer stages"
        )
    part = Partition(stages, stage_of, copies={k: v - {stage_of[k]} for k, v in needed.items() if len(v) > 1})
    sends: list[dict[str, None]] = [{} for _ in range(stages - 1)]
    for k, n in enumerate(nodes):
        runs = part.runs(k)
        for o in n.output:
            for t in {t for r in readers.get(o, []) if o for t in part.runs(r)} - runs:
                before = [p for p in runs if p < t]
                for b in range(max(before), t) if before else ():
                    sends[b][o] = None
    part.sends = [list(x) for x in sends]
    return part


@dataclass(frozen=True)
class MergedCut:
    """A cut of a model both cut into stages and split into blocks: its edges, whether it ends a pipeline
    stage, and its index among the split's cuts (F, G, F, G, ...; None for a stage's cut alone)."""

    edges: list[CutEdge]
    ends_stage: bool
    block_cut: int | None


def merge_cuts(
    model: onnx.ModelProto, stage_cuts: list[list[CutEdge]], block_cuts: list[list[CutEdge]]
) -> list[MergedCut]:
    """The pipeline's cuts and the split's (both on ``model``, the split rank's model) as one list in graph
    order, for :func:`partition`: a stage cut on the same tensors as a split cut, or on a G cut's tensors and
    values computed beside the block, is that cut; one on values computed beside a block whose nodes lie
    between the block's in graph order ends the stage at the block's G cut (the block stays in the earlier
    stage, as a plain pipeline puts it; the values are sent on); one on a value of the block (between its F
    and G cuts) is an error naming the cut."""
    producer = {o: k for k, n in enumerate(model.graph.node) for o in n.output if o}
    readers: dict[str, list[int]] = {}
    for k, n in enumerate(model.graph.node):
        for i in node_reads(n):
            readers.setdefault(i, []).append(k)

    for c, edges in enumerate(stage_cuts):
        for e in edges:
            if e.tensor not in producer:
                raise ValueError(
                    f"pipeline_cut_info_string: cut {c}: {e.tensor!r} is not computed by a node of the graph"
                )
    # (position: the last node a cut's tensors come from, a split cut first on a tie, index, edges)
    marked = [(max(producer[e.tensor] for e in edges), 0, j, edges) for j, edges in enumerate(block_cuts)]
    marked += [(max(producer[e.tensor] for e in edges), 1, c, edges) for c, edges in enumerate(stage_cuts)]
    merged: list[MergedCut] = []
    inside: int | None = None  # the F cut of the block being walked
    deferred: list[int] = []  # a stage cut beside that block: the stage ends at its G cut
    split_at: int | None = None  # where the last split cut's tensors are computed
    for position, is_stage, j, edges in sorted(marked, key=lambda m: (m[0], m[1])):
        last = merged[-1] if merged else None
        if is_stage and last is not None and last.block_cut is not None and (
            {*last.edges} == {*edges} or (last.block_cut % 2 and {*last.edges} <= {*edges})
        ):
            # on a split cut's tensors (the G cut's, with values computed beside the block): that cut ends
            # the stage; the other values cross it as any value read later does (sent on)
            if last.ends_stage:
                raise ValueError(f"pipeline_cut_info_string: cut {j} ({', '.join(e.tensor for e in edges)}) "
                                 "ends its stage where the cut before it does: the stage between has no node")
            ends = {e.tensor for e in last.edges}
            _check_sent_on(producer, readers, j, edges, [e for e in edges if e.tensor not in ends], split_at)
            merged[-1] = MergedCut(last.edges, True, last.block_cut)
            continue
        if is_stage and inside is not None:
            block = _block_values(model, producer, block_cuts[inside], block_cuts[inside + 1])
            hit = [e.tensor for e in edges if e.tensor in block]
            if hit or deferred:
                entry = model.graph.node[producer[block_cuts[inside][0].tensor]]  # the Identity before it
                raise ValueError(
                    f"pipeline_cut_info_string: cut {j} ({', '.join(e.tensor for e in edges)}) falls inside "
                    f"the split block that reads {entry.input[0]!r}: cut before the block or after its output"
                )
            # values computed beside the block, between its nodes in graph order: the stage ends after it
            deferred.append(j)
            continue
        if not is_stage:
            inside = j if j % 2 == 0 else None
            if j % 2 and deferred:  # the G cut ends the stage; the deferred cut's values are sent on
                deferred, split_at = [], position
                merged.append(MergedCut(list(edges), True, j))
                continue
        if is_stage and split_at is not None:
            # values computed before the last split cut (beside its block, in an earlier piece) cross this cut
            # as any value read later does (sent on); the cut ends the stage at the others
            _check_sent_on(producer, readers, j, edges, [e for e in edges if producer[e.tensor] <= split_at],
                           position)
            edges = [e for e in edges if producer[e.tensor] > split_at]
        elif not is_stage:
            split_at = position
        merged.append(MergedCut(list(edges), bool(is_stage), None if is_stage else j))
    return merged


def _check_sent_on(
    producer: dict[str, int], readers: dict[str, list[int]], j: int, edges: list[CutEdge],
    extra: list[CutEdge], at: int | None,
) -> None:
    """A stage cut ending at node ``at`` (a split block's output) takes its ``extra`` edges as values sent on
    only when they are computed before it and every reader they cut comes after it, as a plain pipeline
    would take such a cut; else (a value of the block itself, read inside it, or one computed after the
    block) it is refused naming the value."""
    if at is None:
        return
    for e in extra:
        if producer[e.tensor] > at:
            why = "is computed after the split block's output the stage ends at: list it in a later cut"
        elif any(r <= at for r in ([producer.get(c, -1) for c in e.consumers] or readers.get(e.tensor, []))):
            why = ("is read before the split block's output the stage ends at (inside the block or by it): "
                   "cut before the block or after its output")
        else:
            continue
        raise ValueError(f"pipeline_cut_info_string: cut {j} ({', '.join(x.tensor for x in edges)}): "
                         f"{e.tensor!r} {why}")


def _draws_or_keeps(node: onnx.NodeProto) -> bool:
    """Whether ``node``, or a node of its bodies (an If's branches, a Loop's body), draws random values or is
    a training-mode BatchNormalization."""
    if node.op_type in RANDOM_OPS or is_training_batch_norm(node):
        return True
    return any(_draws_or_keeps(n) for g in subgraphs(node) for n in g.node)


def _block_values(
    model: onnx.ModelProto, producer: dict[str, int], f_edges: list[CutEdge], g_edges: list[CutEdge]
) -> set[str]:
    """The values of a split block: its F cut's tensor, what nodes up to its G cut's compute from it, and that
    tensor."""
    values = {e.tensor for e in f_edges}
    lo, hi = max(producer[t] for t in values), max(producer[e.tensor] for e in g_edges)
    for n in model.graph.node[lo + 1:hi + 1]:
        if any(i in values for i in node_reads(n)):
            values.update(o for o in n.output if o)
    return values


def _sources(model: onnx.ModelProto) -> set[str]:
    return {v.name for v in model.graph.input} | {t.name for t in model.graph.initializer}

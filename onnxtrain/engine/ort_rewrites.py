"""Rewrites of a graph before onnxruntime runs it: standard ONNX in, standard ONNX out, the same values.

MaxPool's ``Indices`` output takes onnxruntime's plain loop over the windows instead of its vectorised
pooling (LeNet's first pool at batch 64: 508 µs with Indices, 35 µs without). Where the windows tile the
input exactly (kernel = strides, no pads or dilation, spatial sizes divisible by the kernel), the Indices
are the first maximum of each window in row-major window order, which is what ``ArgMax`` over the
window's elements returns; so the pool keeps only ``Y`` and the Indices are rebuilt as

    window = Reshape(Transpose(Reshape(X, [N, C, H/kh, kh, W/kw, kw]), [0, 1, 2, 4, 3, 5]), [..., kh·kw])
    Indices = offset(ArgMax(window, -1)) + base[c, i, j] + n·C·H·W

with ``offset(a)`` the flat offset of window element ``a`` in X (``a + (a // kw)·(W − kw)``, the row
``a // kw`` found by comparisons: onnxruntime's integer Div is slow, and so is a Gather from a table of
the offsets; see :func:`_window_offset`) and ``base`` the flat position of each window's first element.
Measured on LeNet's pools: 508 → 230 µs and 345 → 80 µs with the table.
Indices that nothing reads are simply dropped, whatever the windows.

``Where(mask, x, 0)`` with a constant zero (the ReLU gradient, masked gradients) takes onnxruntime's generic
broadcasting loop, about 4 ns a value: LeNet's first ReLU gradient, 301,056 values, 1,192 µs. It becomes
``Mul(x, Cast(mask))`` (98 µs for the Greater, Cast and Mul together). Where a masked ``x`` is not finite
the product holds a NaN (0·inf, 0·NaN) where Where gives 0, so the product is taken only when every value
of ``x`` is finite (its sum ``s`` has ``s − s`` not NaN; in float16, whose sums overflow early, the sum of
``x · 0`` is not NaN), through an ``If`` whose branches are the product
and the Where itself (one ReduceSum, two scalar nodes and the If; a guarded ``Where(x > 0, Log(x), 0)``,
the ReLU gradient of an infinite upstream gradient and LAMB's guard of a 0/0 direction took the Where).
The values are the same but where a masked ``x`` is negative (−0 instead of +0). A constant non-finite
``x`` (``Where(mask, 0, -inf)``, the bias of ONNX's ``Attention`` body) keeps its Where.

``Where(mask, -inf, x)`` with a constant infinite fill (an attention mask) takes the same slow loop over the
scores: 386 and 247 µs for the GPT decoder's two [16, 4, 64, 64] masks. It becomes
``Add(x, Where(mask, -inf, 0))``, whose Where runs on the mask's own shape ([1, 1, 64, 64]) and whose Add
broadcasts fast: 91 + 14 and 38 + 14 µs (kernel times, profiled steps). A masked x that is NaN or the
opposite infinity would give NaN there: x is checked and the Where taken instead, as above. An
unmasked −0 gives +0.

A group-1 Conv's weight gradient, which the autodiff writes as a Conv with X's channels as its batch, becomes
one MatMul per kernel offset on strided windows of X (:mod:`onnxtrain.engine.ort_conv_grads`).

A ``SoftmaxCrossEntropyLoss`` of 2-D scores, which onnxruntime runs as ONNX's function body with its
LogSoftmax over a middle axis, becomes a LogSoftmax over the last axis and a gather of the labels' column
(:mod:`onnxtrain.engine.ort_losses`): the GPT decoder's loss 770 → 122 µs, the same bits.

A ``ReduceSum`` over a tensor's leading axes (a bias's gradient) becomes a MatMul of a row of ones by the
tensor laid out as a matrix (:mod:`onnxtrain.engine.ort_sums`): 40–46 → 18–19 µs on a (16, 64, 512) sum.

A ``Sum`` of zero ``Pad``s that lay pieces side by side along one axis (the gradient of q, k and v taken from
one projection) becomes one ``Concat`` (:mod:`onnxtrain.engine.ort_pads`).

An elementwise node broadcasting an operand of lower rank onto an output whose last axis is 1 (a 1×1
convolution's weight times the learning rate) gets that operand at the output's rank: onnxruntime's kernels
take such a broadcast one value at a time, 50–300× slower (:mod:`onnxtrain.engine.ort_broadcast_ranks`).

The labels of a ``SoftmaxCrossEntropyLoss`` or ``NegativeLogLikelihoodLoss`` (of the main graph or of an
``If``, ``Loop`` or ``Scan`` body, nested ones too) go through Reshapes that fail unless they have the shape
the scores say they have (``(N, d1, ...)`` of scores ``(N, C, d1, ...)``), and the nodes after the loss in
its graph that read them (its gradient) read that: onnxruntime 1.32 runs either loss (ONNX's function body,
or the gather above) on 5 score rows and 4 labels without a word, training on the first 4 rows, where the
numpy engine's kernel refuses them. The check then fails, as the numpy kernel does, and the plan names the
inputs (:class:`~onnxtrain.engine.ort_plan.OrtPlan`). It costs Shapes, a Max of the shapes and Reshapes of
the labels (no copy), and is written even with onnxruntime's optimisations off, since onnxruntime's own loss
does not check either (:func:`for_onnxruntime`: the check, then the other rewrites). Inside a body, where the
shapes are mostly not known before the run, the check is written unless they are and agree; its constants
(opsets before 15) are Constant nodes of the body.

The same labels then go through a Reshape that fails when one of them is outside [0, C) and not the loss's
``ignore_index`` (C: the scores' axis 1): onnxruntime's GatherElements takes −1 (down to −C) as a class
counted from the end, so a label −1 trained on the last class where the numpy engine, as torch, refuses it.
The check is a ReduceMin and a ReduceMax over the labels (ignored ones first replaced by 0) and a few scalar
nodes; the failing Reshape carries the numpy engine's message in its ``doc_string``, which the plan raises
(:func:`label_range_messages`). It is written for every label loss, its labels' shape known or not.

A dilated Conv with ``auto_pad`` SAME_*, which onnxruntime refuses, takes explicit pads
(:mod:`onnxtrain.engine.ort_same_pads`), even with onnxruntime's optimisations off.

A ConvTranspose whose ``output_padding`` reaches its stride (the spec allows it below the dilation), which
onnxruntime refuses too, takes no output_padding on that axis, a smaller end pad and where needed a Pad of
zeros after it (:mod:`onnxtrain.engine.ort_output_padding`), even with onnxruntime's optimisations off;
one with an ``output_shape`` first takes the explicit pads that shape gives (where X's sizes are known).

float64 activations and pools that onnxruntime has no double kernel for (LeakyRelu, Elu, Softplus, PRelu,
GlobalAveragePool, ...) become standard ops that have one (:mod:`onnxtrain.engine.ort_float64`), even with
onnxruntime's optimisations off. So do float16 MeanVarianceNormalization and GlobalLpPool from opset 22,
which onnxruntime cannot load (:mod:`onnxtrain.engine.ort_half_ops`).

A ScatterND that combines values (reduction add, mul, min or max: a Gather's or GatherND's gradient) and is
large enough for onnxruntime to split over threads becomes a chain of ScatterNDs over pieces of its tuples,
each too small to be split (:mod:`onnxtrain.engine.ort_scatter_nd`), even with onnxruntime's optimisations
off, unless onnxruntime runs the graph on one intra-op thread: onnxruntime's threads combined the updates of
a repeated index tuple without a lock and lost some (an embedding's gradient off by whole values, other
bits at every run).

A BatchNormalization in inference mode that names running-statistics outputs nothing reads (the eval model
onnxruntime-training's artifact generator writes for a model exported in training mode) loses them, even
with onnxruntime's optimisations off: onnxruntime refuses to load the node otherwise ("should be 1 when
Training_mode = False"), while the numpy engine ignores them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine.ort_bernoulli import bernoulli_complements
from onnxtrain.engine.ort_broadcast_ranks import equal_rank_operands
from onnxtrain.engine.ort_conv_grads import conv_weight_grads
from onnxtrain.engine.ort_dropout_rebuilds import dropout_rebuilds
from onnxtrain.engine.ort_float64 import float64_ops
from onnxtrain.engine.ort_half_ops import half_ops
from onnxtrain.engine.ort_half_scatters import half_scatters_in_float32
from onnxtrain.engine.ort_losses import softmax_cross_entropy_losses
from onnxtrain.engine.ort_output_padding import (
    large_output_paddings,
    output_shape_conv_transposes,
    same_conv_transposes,
)
from onnxtrain.engine.ort_pads import pads_as_concat
from onnxtrain.engine.ort_same_pads import dilated_same_pads
from onnxtrain.engine.ort_scatter_nd import serial_scatter_nds
from onnxtrain.engine.ort_sums import leading_sums
from onnxtrain.ir.builder import (
    NameGen,
    elem_type,
    model_opset,
    static_shape,
    value_types,
    with_nodes_replaced,
)
from onnxtrain.ir.ceil_pools import ceil_mode_pools
from onnxtrain.ir.graphs import (
    DEFAULT_DOMAINS,
    drop_unread,
    fed_initializers,
    inference_batch_norms,
    node_reads,
    subgraphs,
    walk_graphs,
)

_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE)
_MIN_OPSET = 11  # Range


def _lazy_types(current: Callable[[], onnx.ModelProto], types: dict) -> Callable[[], dict]:
    """A getter of ``types``, filled on its first call with the inferred value types of the model
    ``current`` returns then (declared intermediate types may be stale, so only inferred ones)."""
    def typed() -> dict:
        if not types:
            types.update(value_types(current(), declared=False))
        return types
    return typed


def for_onnxruntime(model: onnx.ModelProto, optimise: bool = True,
                    threads: int | None = None) -> onnx.ModelProto:
    """The graph onnxruntime runs for ``model``: its label losses' check (:func:`checked_labels`, whatever
    ``optimise`` says: it keeps the graph's meaning), then :func:`rewrite_for_onnxruntime`'s rewrites, which
    reuse the value types the check inferred, and Bernoulli's probabilities complemented
    (:func:`~onnxtrain.engine.ort_bernoulli.bernoulli_complements`, whatever ``optimise`` says: onnxruntime's
    kernel inverts them), and recompute's Dropout rebuilds dividing as onnxruntime's Dropout does
    (:func:`~onnxtrain.engine.ort_dropout_rebuilds.dropout_rebuilds`, whatever ``optimise`` says: they then
    give the forward Dropout's values). ``model`` itself when nothing applies. Pools whose ceil_mode window
    count ONNX's inference gets wrong take the pads that make it right first (:mod:`onnxtrain.ir.ceil_pools`;
    a model read through :func:`~onnxtrain.engine.interface.standard_model` has them already), so that the
    value types every rewrite reads, and onnxruntime's plan, have the run's dims. ``threads``: the intra-op
    threads onnxruntime will run the graph on (None: its default)."""
    types: dict = {}
    model = ceil_mode_pools(model)
    checked = checked_labels(model, _lazy_types(lambda: model, types))
    return dropout_rebuilds(bernoulli_complements(rewrite_for_onnxruntime(checked, optimise, types, threads)))


def rewrite_for_onnxruntime(model: onnx.ModelProto, optimise: bool = True,
                            types: dict | None = None, threads: int | None = None) -> onnx.ModelProto:
    """``model`` with the rewrites above but the labels' check applied (a copy), or ``model`` itself when none
    applies; without ``optimise`` (onnxruntime's optimisations turned off) only those onnxruntime needs to
    load or run the graph (or run it right): the BatchNormalization outputs', half-precision scatters',
    combining row ScatterNDs (:mod:`~onnxtrain.engine.ort_scatter_nd`), dilated SAME Convs' and pools' pads,
    SAME ConvTransposes' pads, ConvTransposes' large output_paddings, float64 ops without a float64 kernel
    and the float16 ops and GlobalLpPool onnxruntime cannot load.
    ``types``: value types of ``model`` already inferred (empty: inferred when a rewrite needs them).
    ``threads``: onnxruntime's intra-op threads (None: its default); on one, the ScatterNDs stay."""
    # inferred once, when a rewrite needs them (the rewrites keep the types of the values they read)
    types = {} if types is None else types
    typed = _lazy_types(lambda: model, types)
    if optimise:
        model = _infinite_fills(_mask_multiplies(_pool_indices(model, typed), typed))
        model = conv_weight_grads(model, typed)
        model = softmax_cross_entropy_losses(model, typed)
        model = leading_sums(model, typed)
        model = equal_rank_operands(pads_as_concat(model, typed), typed)
    model = same_conv_transposes(dilated_same_pads(model, typed), typed)
    model = large_output_paddings(output_shape_conv_transposes(model, typed))
    model = serial_scatter_nds(half_scatters_in_float32(model, typed), typed, threads)
    model = float64_ops(inference_batch_norms(model), typed)
    return half_ops(model, typed)


_LABEL_LOSSES = ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss")
_INT64_MAX = np.iinfo(np.int64).max


def checked_labels(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each label-reading loss's labels reshaped to the shape its scores give them (module
    docstring; not where the labels' and the scores' dims are all static and agree in ``typed()``: a body's
    values are mostly not there, and their losses are checked) and checked to be classes in range or ignored,
    read so by the loss and the nodes after it in its graph, the main graph's and those of the control-flow
    bodies (nested ones too); ``model`` itself without such a loss. The new values take the labels' type in
    ``typed()`` (the loss rewrite after this one reads it)."""
    losses = [n for g in walk_graphs(model.graph) for n in g.node if _is_label_loss(n)]
    if not losses:
        return model
    types = typed()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _check_graph(out.graph, types, model_opset(model), NameGen.for_model(out), body=False)
    return out


def label_range_messages(model: onnx.ModelProto) -> dict[str, str]:
    """The labels' range checks of ``model`` (its bodies' too) written by :func:`checked_labels`: the name of
    the node that fails → the loss node's label and the numpy engine's error, a line each."""
    return {n.name: n.doc_string for g in walk_graphs(model.graph) for n in g.node
            if n.op_type == "Reshape" and _RANGE_CHECK in n.name and n.doc_string.startswith("node ")}


_RESHAPED = re.compile(r"Input shape:\{(\d+)[,}].*?requested shape:\{(\d+)[,}]")


def label_range_error(checks: Mapping[str, str], text: str) -> tuple[str, str] | None:
    """The loss node and the numpy engine's error for the label range check of ``checks``
    (:func:`label_range_messages`) that onnxruntime's error ``text`` names; None when it names none. A class
    count known only at run time is read from the failed Reshape's shapes (C + 1 apart on the first axis)."""
    for name, why in checks.items():
        if f"Name:'{name}'" in text:
            loss, _, error = why.partition("\n")
            shapes = _RESHAPED.search(text)
            if "[0, C)" in error and shapes is not None:
                error = error.replace("[0, C)", f"[0, {int(shapes[2]) - int(shapes[1]) - 1})")
            return loss, error
    return None


def _is_label_loss(node: onnx.NodeProto) -> bool:
    return (node.op_type in _LABEL_LOSSES and node.domain in DEFAULT_DOMAINS and len(node.input) > 1
            and bool(node.input[1]))


def _check_graph(g: onnx.GraphProto, types: dict, opset: int, names: NameGen, body: bool) -> None:
    """:func:`checked_labels` on graph ``g`` (in place), its bodies first: a body's constants are Constant
    nodes of that body, the main graph's are initializers."""
    checked: dict[str, str] = {}  # labels → their checked copy, for the nodes after the loss
    nodes: list[onnx.NodeProto] = []
    changed = False
    for k, n in enumerate(g.node):
        for i, x in enumerate(n.input):
            if x in checked:
                n.input[i] = checked[x]
        for sub in subgraphs(n):  # before ``n`` is copied into the new node list below
            _check_graph(sub, types, opset, names, body=True)
        if _is_label_loss(n):
            labels = name = n.input[1]
            scores = static_shape(types, n.input[0])
            new, inits = [], []
            if _needs_check(types, n):
                new, inits, name = _labels_check(n, scores, opset, names)
            more, consts, name = _range_check(n, k, name, elem_type(types, labels), scores, opset, names)
            new, inits = new + more, inits + consts
            if body:
                nodes.extend(helper.make_node("Constant", [], [t.name], name=names(f"{t.name}/Constant"),
                                              value=t) for t in inits)
            else:
                g.initializer.extend(inits)
            nodes.extend(new)
            n.input[1] = checked[labels] = name
            if labels in types:
                types[name] = types[labels]
            changed = True
        nodes.append(n)
    if changed:
        del g.node[:]
        g.node.extend(nodes)


def _needs_check(types: dict, node: onnx.NodeProto) -> bool:
    """Whether the loss's labels may be fed a shape other than its scores give: not when both are static and
    agree."""
    scores, labels = static_shape(types, node.input[0]), static_shape(types, node.input[1])
    if scores is None or labels is None or None in scores or None in labels or len(scores) < 2:
        return True
    return [scores[0], *scores[2:]] != labels


def _labels_check(node: onnx.NodeProto, scores_shape: list | None, opset: int,
                  names: NameGen) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """The nodes reshaping ``node``'s labels to the dims of its scores but the classes' (axis 1), the
    constants they read, and the checked labels' name."""
    scores, labels = node.input[0], node.input[1]
    base = node.output[0] or scores

    def name(what: str) -> str:
        return names(f"{base}/labels_check_{what}")

    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []
    two_d = scores_shape is not None and len(scores_shape) == 2
    if opset >= 15:  # Shape's start and end
        head = name("batch")
        nodes.append(helper.make_node("Shape", [scores], [head], name=name("Shape"), start=0, end=1))
        if not two_d:
            tail = name("rest")
            nodes.append(helper.make_node("Shape", [scores], [tail], name=name("Shape"), start=2))
    else:
        shape, head = name("shape"), name("batch")
        nodes.append(helper.make_node("Shape", [scores], [shape], name=name("Shape")))
        bounds = {"zero": 0, "one": 1} if two_d else {"zero": 0, "one": 1, "two": 2, "end": _INT64_MAX}
        cuts = {key: name(key) for key in bounds}
        inits += [numpy_helper.from_array(np.array([v], np.int64), cuts[key]) for key, v in bounds.items()]
        nodes.append(helper.make_node("Slice", [shape, cuts["zero"], cuts["one"]], [head],
                                      name=name("Slice")))
        if not two_d:
            tail = name("rest")
            nodes.append(helper.make_node("Slice", [shape, cuts["two"], cuts["end"]], [tail],
                                          name=name("Slice")))
    want = head
    if not two_d:
        want = name("want")
        nodes.append(helper.make_node("Concat", [head, tail], [want], name=name("Concat"), axis=0))
    # The labels' shape must be ``want`` itself, not only hold as many values (a Reshape alone would turn
    # labels (N, 1) for scores (N, C), or a transposed label map, into a loss that runs): ``want`` reshaped
    # to the labels' rank fails unless the ranks agree; labels reshaped to max(their dims, want) fail unless
    # each dim is at least want's, and that reshaped to ``want`` unless each is at most want's
    own, rank, same_rank, hi, wide = name("own"), name("rank"), name("same_rank"), name("max"), name("wide")
    out = names(f"{labels}/checked")
    # allowzero: a batch of 0 scores must not take the labels' own count
    extra = {"allowzero": 1} if opset >= 14 else {}
    nodes += [helper.make_node("Shape", [labels], [own], name=name("Shape")),
              helper.make_node("Shape", [own], [rank], name=name("Shape")),
              helper.make_node("Reshape", [want, rank], [same_rank], name=name("Reshape"), **extra),
              helper.make_node("Max", [own, same_rank], [hi], name=name("Max")),
              helper.make_node("Reshape", [labels, hi], [wide], name=name("Reshape"), **extra),
              helper.make_node("Reshape", [wide, same_rank], [out], name=name("Reshape"), **extra)]
    return nodes, inits, out


_RANGE_CHECK = "/labels_range_check"
_INDEX_TYPES = {TensorProto.INT32: np.int32, TensorProto.INT64: np.int64}


def _range_check(node: onnx.NodeProto, k: int, labels: str, label_type: int, scores_shape: list | None,
                 opset: int, names: NameGen) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], str]:
    """The nodes that pass ``labels`` of loss ``node`` (index ``k`` in its graph) on through a Reshape that
    fails unless each is in [0, C) or the loss's ignore_index, the constants they read, and the checked
    labels' name. Labels of a type not known here are compared as int64."""
    base = node.output[0] or node.input[0]

    def name(what: str) -> str:
        return names(f"{base}/labels_range_{what}")

    nodes: list[onnx.NodeProto] = []
    inits: list[onnx.TensorProto] = []

    def make(op: str, ins: list[str], **kw: object) -> str:
        out = name(op)
        nodes.append(helper.make_node(op, ins, [out], name=name(op), **kw))
        return out

    def const(what: str, value: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(value, name(what)))
        return inits[-1].name

    work = labels
    if label_type not in _INDEX_TYPES:
        label_type = TensorProto.INT64
        work = make("Cast", [labels], to=TensorProto.INT64)
    dtype = _INDEX_TYPES[label_type]
    zero = const("zero", np.array(0, dtype))
    ignore = next((a.i for a in node.attribute if a.name == "ignore_index"), None)
    if ignore is not None and np.iinfo(dtype).min <= ignore <= np.iinfo(dtype).max:
        ignored = make("Equal", [work, const("ignore_index", np.array(ignore, dtype))])
        work = make("Where", [ignored, zero, work])
    lo, hi = make("ReduceMin", [work], keepdims=0), make("ReduceMax", [work], keepdims=0)
    classes = scores_shape[1] if scores_shape is not None and len(scores_shape) > 1 else None
    if classes is not None:
        count = const("classes", np.array(classes, dtype))
    else:  # the scores' axis 1 at run time ([1])
        if opset >= 15:
            count = make("Shape", [node.input[0]], start=1, end=2)
        else:
            count = make("Slice", [make("Shape", [node.input[0]]), const("one", np.array([1], np.int64)),
                                   const("two", np.array([2], np.int64))])
        if label_type != TensorProto.INT64:
            count = make("Cast", [count], to=label_type)
    bad = make("Cast", [make("Or", [make("Less", [lo, zero]), make("GreaterOrEqual", [hi, count])])],
               to=TensorProto.INT64)
    if classes is None:  # C + 1 more, which the error's shapes then tell (label_range_error)
        if label_type != TensorProto.INT64:
            count = make("Cast", [count], to=TensorProto.INT64)
        bad = make("Mul", [bad, make("Add", [count, const("step", np.array([1], np.int64))])])
    # every dim of the labels' shape larger when a label is out of range: a Reshape that cannot be (the
    # labels are then not empty), else the labels themselves
    wanted = make("Add", [make("Shape", [labels]), bad])
    out = names(f"{labels}/in_range")
    label = repr(node.name) if node.name else f"#{k} (unnamed)"
    limit = classes if classes is not None else "C"
    # the failing node and the error, a line each (see label_range_messages)
    why = (f"node {label} ({node.op_type})\n"
           f"target holds class indices outside [0, {limit}) that are not ignore_index")
    nodes.append(helper.make_node("Reshape", [labels, wanted], [out], name=names(f"{base}{_RANGE_CHECK}"),
                                  doc_string=why))
    return nodes, inits, out


def _mask_multiplies(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """Each ``Where(mask, x, 0)`` (or ``Where(mask, 0, x)``, the mask negated) of a float ``x`` as a Mul."""
    zeros = _zero_scalars(model)
    found = _wheres_with_one_branch_in(model, zeros)
    if not found:
        return model
    types = typed()
    # a constant infinite other branch (an attention mask's bias, Where(mask, 0, -inf)) would give 0·inf
    fills = _scalars(model, lambda v: not bool(np.isfinite(v)))
    ranks = _constant_ranks(model)
    found = [k for k in found if _float_of(types, model.graph.node[k]) is not None
             and not fills.keys() & set(model.graph.node[k].input[1:])
             and _zero_adds_no_axis(model.graph.node[k], zeros, ranks, types)]
    if not found:
        return model

    def as_mul(_k: int, n: onnx.NodeProto, names: NameGen, _: onnx.ModelProto) -> list[onnx.NodeProto]:
        mask, a, b = n.input
        x, keep = (a, mask) if b in zeros else (b, None)
        nodes = []
        if keep is None:  # Where(mask, 0, x): x where the mask is false
            keep = names(f"{n.output[0]}/kept")
            nodes.append(helper.make_node("Not", [mask], [keep], name=names(f"{n.name or 'Where'}_Not")))
        as_float, product = names(f"{n.output[0]}/mask"), names(f"{n.output[0]}/product")
        et = _float_of(types, n)
        return _unless_not_finite(x, [
            *nodes,
            helper.make_node("Cast", [keep], [as_float], name=names(f"{n.name or 'Where'}_Cast"), to=et),
            helper.make_node("Mul", [x, as_float], [product], name=n.name or names("Where_Mul")),
        ], n, et, names)

    out = with_nodes_replaced(model, found, as_mul)
    # the zeros only the Wheres read go too (onnxruntime warns of unused initializers and constants)
    drop_unread(out.graph, zeros)
    return out


def _infinite_fills(model: onnx.ModelProto) -> onnx.ModelProto:
    """Each ``Where(mask, ±inf, x)`` (or ``Where(mask, x, ±inf)``) as ``Add(x, Where(mask, ±inf, 0))``."""
    fills = _scalars(model, lambda v: bool(np.isinf(v)))
    found = _wheres_with_one_branch_in(model, fills)
    if not found:
        return model
    zeros: dict[int, str] = {}  # element type → its zero scalar

    def as_add(_k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        mask, a, b = n.input
        fill, x = (a, b) if a in fills else (b, a)
        et = fills[fill]
        if et not in zeros:
            zeros[et] = names("zero")
            out.graph.initializer.append(
                numpy_helper.from_array(np.zeros((), helper.tensor_dtype_to_np_dtype(et)), zeros[et]))
        added, total = names(f"{n.output[0]}/fill"), names(f"{n.output[0]}/sum")
        branches = [fill, zeros[et]] if a == fill else [zeros[et], fill]
        return _unless_not_finite(x, [
            helper.make_node("Where", [mask, *branches], [added], name=names(f"{n.name or 'Where'}_Fill")),
            helper.make_node("Add", [x, added], [total], name=n.name or names("Where_Add")),
        ], n, et, names)

    return with_nodes_replaced(model, found, as_add)


def _unless_not_finite(x: str, fast: list[onnx.NodeProto], where: onnx.NodeProto, et: int,
                       names: NameGen) -> list[onnx.NodeProto]:
    """Nodes giving ``where``'s output by the ``fast`` nodes (its Mul or Add form; the last one's output is
    the result) when every value of its operand ``x`` is finite, and by the Where itself otherwise (0·inf, a
    masked NaN, inf − inf): an ``If`` on whether ``s − s`` is NaN for ``x``'s sum ``s`` (one pass; a sum
    that overflows takes the Where too, which float32 sums of gradients never do). A float16 sum overflows
    from 65,504 (65,504 values of 1), so there the If asks whether the sum of ``x · 0`` is NaN, which it is
    only when a value is not finite (two passes; onnxruntime's float16 ``s − s`` of an overflowed sum even
    gave 0). The fast nodes run inside the If's branch, which writes the If's output:
    checking the fast form's own result instead needed an Identity copying it out of the branch (the MLP's
    ReLU gradients at batch 256, 131,072 values: 130 → 85 µs a mask with the check, 70 without)."""
    label = where.name or "Where"
    spread, bad = names(f"{where.output[0]}/spread"), names(f"{where.output[0]}/not_finite")
    out = where.output[0]
    if et == TensorProto.FLOAT16:
        zero, zeroed = names(f"{where.output[0]}/zero"), names(f"{where.output[0]}/zeroed")
        check = [helper.make_node("Constant", [], [zero], name=names(f"{label}_Zero"),
                                  value=numpy_helper.from_array(np.zeros((), np.float16))),
                 helper.make_node("Mul", [x, zero], [zeroed], name=names(f"{label}_Zeroed")),
                 helper.make_node("ReduceSum", [zeroed], [spread], name=names(f"{label}_Check"), keepdims=0)]
    else:
        total = names(f"{where.output[0]}/check")
        check = [helper.make_node("ReduceSum", [x], [total], name=names(f"{label}_Check"), keepdims=0),
                 helper.make_node("Sub", [total, total], [spread], name=names(f"{label}_Spread"))]
    slow_out = names(f"{out}/where")
    slow = helper.make_graph([helper.make_node("Where", list(where.input), [slow_out], name=names(label))],
                             names(f"{label}_slow"), [], [helper.make_tensor_value_info(slow_out, et, None)])
    kept = helper.make_graph(fast, names(f"{label}_fast"), [],
                             [helper.make_tensor_value_info(fast[-1].output[0], et, None)])
    return [
        *check,
        helper.make_node("IsNaN", [spread], [bad], name=names(f"{label}_NotFinite")),
        helper.make_node("If", [bad], [out], name=names(f"{label}_If"), then_branch=slow, else_branch=kept),
    ]


def _wheres_with_one_branch_in(model: onnx.ModelProto, consts: Collection[str]) -> list[int]:
    """Indices of the Where nodes exactly one of whose two branches is named in ``consts``."""
    return [k for k, n in enumerate(model.graph.node)
            if n.op_type == "Where" and n.domain in DEFAULT_DOMAINS and len(n.input) == 3
            and (n.input[1] in consts) != (n.input[2] in consts)]


def _constant_ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The ranks of the graph's initializers and Constant outputs, by name."""
    ranks = {t.name: len(t.dims) for t in model.graph.initializer}
    ranks.update({n.output[0]: len(a.t.dims) for n in model.graph.node if n.op_type == "Constant"
                  for a in n.attribute if a.name == "value"})
    return ranks


def _zero_adds_no_axis(node: onnx.NodeProto, zeros: set[str], ranks: dict[str, int], types: dict) -> bool:
    """Whether a Where's one-value zero branch leaves its output's rank to the other operands (a [1, 1] zero
    broadcasts a rank-1 Where to rank 2, which a Mul of the other two would not): rank 0, or a rank at most
    the others' known ones."""
    zero = next(i for i in node.input[1:] if i in zeros)
    if ranks.get(zero, 0) == 0:
        return True
    others = [i for i in node.input if i != zero]
    known = []
    for name in others:
        tp = types.get(name)
        if name in ranks:
            known.append(ranks[name])
        elif tp is not None and tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
            known.append(len(tp.tensor_type.shape.dim))
        else:
            return False
    return ranks[zero] <= max(known)


def _zero_scalars(model: onnx.ModelProto) -> set[str]:
    """Names of constant float scalars of value +0 (initializers and Constant outputs)."""
    return set(_scalars(model, lambda v: v == 0 and not np.signbit(v)))


def _scalars(model: onnx.ModelProto, keep: Callable[[np.generic], bool]) -> dict[str, int]:
    """Constant float scalars (initializers and Constant outputs, one value) whose value ``keep`` accepts:
    name → element type."""
    out = {}
    fed = fed_initializers(model)  # a value a run may feed is no constant
    tensors = [(t.name, t) for t in model.graph.initializer if t.name not in fed]
    tensors += [
        (n.output[0], a.t)
        for n in model.graph.node
        if n.op_type == "Constant"
        for a in n.attribute
        if a.name == "value"
    ]
    for name, t in tensors:
        if (t.data_type in (*_FLOATS, TensorProto.FLOAT16) and int(np.prod(t.dims)) == 1
                and keep(numpy_helper.to_array(t).reshape(-1)[0])):
            out[name] = t.data_type
    return out


def _float_of(types: dict, node: onnx.NodeProto) -> int | None:
    """The float element type of a Where's output when its condition is known to be bool, else None."""
    cond, out = types.get(node.input[0]), types.get(node.output[0])
    if cond is None or out is None or not cond.HasField("tensor_type") or not out.HasField("tensor_type"):
        return None
    et = out.tensor_type.elem_type
    ok = cond.tensor_type.elem_type == TensorProto.BOOL and et in (*_FLOATS, TensorProto.FLOAT16)
    return et if ok else None


def _pool_indices(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """MaxPool's Indices by ArgMax where the windows tile the input, dropped where nothing reads them."""
    pools = [k for k, n in enumerate(model.graph.node)
             if n.op_type == "MaxPool" and n.domain in DEFAULT_DOMAINS and len(n.output) > 1 and n.output[1]]
    if not pools:
        return model
    read = {i for n in model.graph.node for i in node_reads(n)} | {o.name for o in model.graph.output}
    unused = {k for k in pools if model.graph.node[k].output[1] not in read}
    tiled = [k for k in pools if k not in unused] if model_opset(model) >= _MIN_OPSET else []
    types = typed() if tiled else {}
    plans = {k: p for k in tiled if (p := _tiling(model.graph.node[k], types)) is not None}
    if not plans and not unused:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    names = NameGen.for_model(out)
    nodes: list[onnx.NodeProto] = []
    for k, n in enumerate(g.node):
        if k in unused:
            del n.output[1:]
        if k not in plans:
            nodes.append(n)
            continue
        new, inits = _argmax_indices(n, *plans[k], names=names)
        nodes.extend(new)
        g.initializer.extend(inits)
    del g.node[:]
    g.node.extend(nodes)
    return out


def _tiling(node: onnx.NodeProto, types: dict) -> tuple[int, int, int, int, int] | None:
    """(C, H, W, kh, kw) when ``node`` pools exactly tiling 2-D windows of a static float C·H·W input."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    k = list(a.get("kernel_shape", []))
    if len(k) != 2 or list(a.get("strides", [1, 1])) != k:
        return None
    if any(a.get("pads", [0] * 4)) or any(d != 1 for d in a.get("dilations", [1, 1])):
        return None
    auto = a.get("auto_pad", b"NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto not in ("NOTSET", "VALID") or a.get("ceil_mode", 0) or a.get("storage_order", 0):
        return None
    shape = static_shape(types, node.input[0])
    tp = types.get(node.input[0])
    if shape is None or len(shape) != 4 or any(d is None for d in shape[1:]) or tp is None:
        return None
    _, c, h, w = shape
    if tp.tensor_type.elem_type not in _FLOATS or h % k[0] or w % k[1]:  # type: ignore[operator]
        return None
    return int(c), int(h), int(w), int(k[0]), int(k[1])  # type: ignore[arg-type]


def _argmax_indices(node: onnx.NodeProto, c: int, h: int, w: int, kh: int, kw: int,
                    names: NameGen) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The MaxPool without its Indices, and the nodes computing the Indices by ArgMax (module docstring);
    new value and node names come from ``names``, derived from the Indices' name."""
    x, idx = node.input[0], node.output[1]

    def name(what: str) -> str:
        return names(f"{idx}/argmax_{what}")

    pool = onnx.NodeProto()
    pool.CopyFrom(node)
    del pool.output[1:]
    hk, wk = h // kh, w // kw
    a = np.arange(kh * kw)
    base = (np.arange(c)[:, None, None] * h + np.arange(hk)[None, :, None] * kh) * w \
        + np.arange(wk)[None, None, :] * kw
    consts = {
        "split": np.array([-1, c, hk, kh, wk, kw], np.int64),
        "windows": np.array([-1, c, hk, wk, kh * kw], np.int64),
        "offset": (a // kw * w + a % kw).astype(np.int64),
        "base": base.astype(np.int64),
        "zero": np.array(0, np.int64),
        "one": np.array(1, np.int64),
        "image": np.array(c * h * w, np.int64),
        "column": np.array([-1, 1, 1, 1], np.int64),
        "row_step": np.array(w - kw, np.int64),
        **{f"row{j}": np.array(j * kw - 1, np.int64) for j in range(1, kh)},  # a ≥ j·kw: a > j·kw − 1
    }
    v = {key: name(key) for key in consts}
    t = {key: name(key) for key in ("x6", "xt", "x5", "arg", "off", "pos", "shape", "n", "images", "first",
                                     "first4")}
    t.update({f"{k}{j}": name(f"{k}{j}") for j in range(1, kh) for k in ("past", "rows", "skip", "off")})
    # opset 11 onwards: Shape without start/end, Gather of a scalar index, Reshape rather than Unsqueeze

    def make(op: str, ins: list[str], out: str, **attrs: object) -> onnx.NodeProto:
        return helper.make_node(op, ins, [out], name=name(op), **attrs)

    nodes = [
        pool,
        make("Reshape", [x, v["split"]], t["x6"]),
        make("Transpose", [t["x6"]], t["xt"], perm=[0, 1, 2, 4, 3, 5]),
        make("Reshape", [t["xt"], v["windows"]], t["x5"]),
        make("ArgMax", [t["x5"]], t["arg"], axis=-1, keepdims=0),
        *_window_offset(make, t, v, kh),
        make("Add", [t["off"], v["base"]], t["pos"]),
        make("Shape", [x], t["shape"]),
        make("Gather", [t["shape"], v["zero"]], t["n"], axis=0),
        make("Range", [v["zero"], t["n"], v["one"]], t["images"]),
        make("Mul", [t["images"], v["image"]], t["first"]),
        make("Reshape", [t["first"], v["column"]], t["first4"]),
        make("Add", [t["pos"], t["first4"]], idx),
    ]
    # the constants the nodes read (onnxruntime warns of unused initializers: the table, when comparisons
    # find the offsets)
    read = {i for n in nodes for i in n.input}
    return nodes, [numpy_helper.from_array(arr, v[key]) for key, arr in consts.items() if v[key] in read]


# windows of up to this many rows find an element's offset by comparisons; taller ones gather it from a table
_MAX_ROWS = 3


def _window_offset(make, t: dict[str, str], v: dict[str, str], kh: int) -> list[onnx.NodeProto]:
    """The flat offset in X of each window's maximum, from its index ``a`` in the window (``t["arg"]``) into
    ``t["off"]``: ``a + (a // kw)·(W − kw)``, the row ``a // kw`` counted as the number of row starts
    ``j·kw`` that ``a`` reaches (onnxruntime's integer Div is slow: 406 µs for LeNet's 75 K indices; the
    table lookup, a Gather, 320 µs; the comparisons 100 µs)."""
    if kh > _MAX_ROWS:
        return [make("Gather", [v["offset"], t["arg"]], t["off"])]
    nodes, last = [], t["arg"]
    for j in range(1, kh):
        out = t["off"] if j == kh - 1 else t[f"off{j}"]
        nodes += [
            make("Greater", [t["arg"], v[f"row{j}"]], t[f"past{j}"]),
            make("Cast", [t[f"past{j}"]], t[f"rows{j}"], to=TensorProto.INT64),
            make("Mul", [t[f"rows{j}"], v["row_step"]], t[f"skip{j}"]),
            make("Add", [last, t[f"skip{j}"]], out),
        ]
        last = out
    return nodes or [make("Identity", [t["arg"]], t["off"])]

"""The onnxruntime graph optimizers the backend turns off for a model, each for a graph it gets wrong."""

from __future__ import annotations

from collections.abc import Iterable

import onnx
from onnx import TensorProto

from onnxtrain.ir.graphs import walk_graphs

# onnxruntime's ConstantSharing merges equal initializers into one buffer; a training-mode
# BatchNormalization then writes its running statistics into the shared buffer, corrupting the
# initializers it was merged with (scale/bias) from the second run on. Its EliminateDropout deletes a
# Dropout whose training_mode is a constant true (a forward or inference graph of a model exported in
# training mode then ran without dropout, where the numpy engine drops). Both are always disabled.
DISABLED_OPTIMIZERS = ("ConstantSharing", "EliminateDropout")


def disabled_optimizers(model: onnx.ModelProto) -> list[str]:
    """:data:`DISABLED_OPTIMIZERS`, and those of onnxruntime's optimizers that would load ``model`` wrong:
    GemmSumFusion (:func:`_late_products`), MatmulTransposeFusion (:func:`_transposed_by_vectors`),
    FuseReluClip (:func:`_clips_of_other_types`), the transpose optimizer (:func:`_pads_of_some_axes`) and
    ConstantFolding (:func:`_body_ifs_of_constants`)."""
    known = _Known(model)
    return [*DISABLED_OPTIMIZERS,
            *(["ConstantFolding"] if _body_ifs_of_constants(model) else []),
            *(["GemmSumFusion"] if _late_products(model) else []),
            *(["MatmulTransposeFusion"] if _transposed_by_vectors(model, known) else []),
            *(["FuseReluClip"] if _clips_of_other_types(model, known) else []),
            *(TRANSPOSE_OPTIMIZERS if _pads_of_some_axes(model) else ())]


class _Known:
    """Element types (0: unknown) and ranks (None: unknown) of a model's values: those its graphs state
    (value_info, inputs, outputs, then initializers and Constants), and, once :meth:`infer` is called,
    those ONNX's shape inference finds for the main graph (none when it refuses the model)."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.values: dict[str, tuple[int, int | None]] = {}
        self._inferred = False
        for g in walk_graphs(model.graph):
            self._add((*g.input, *g.output, *g.value_info))
            self.values.update((t.name, (t.data_type, len(t.dims))) for t in g.initializer)
            self.values.update((n.output[0], (a.t.data_type, len(a.t.dims))) for n in g.node
                               if n.op_type == "Constant" and n.output
                               for a in n.attribute if a.name == "value")

    def _add(self, infos: Iterable[onnx.ValueInfoProto]) -> None:
        for vi in infos:
            if vi.type.HasField("tensor_type"):
                t = vi.type.tensor_type
                self.values[vi.name] = (t.elem_type, len(t.shape.dim) if t.HasField("shape") else None)

    def infer(self) -> None:
        """Add what ONNX's shape inference finds for the main graph (once)."""
        if self._inferred:
            return
        self._inferred = True
        try:
            inferred = onnx.shape_inference.infer_shapes(self.model)
        except Exception:  # noqa: BLE001 - a model inference refuses: only the stated types are known
            return
        self._add(inferred.graph.value_info)

    def rank(self, name: str) -> int | None:
        return self.values.get(name, (0, None))[1]

    def elem_type(self, name: str) -> int:
        return self.values.get(name, (0, None))[0]


# the transpose optimizer's two registrations (level 1, and again for the CPU provider's layout)
TRANSPOSE_OPTIMIZERS = ("TransposeOptimizer", "TransposeOptimizer_CPUExecutionProvider")


def _late_products(model: onnx.ModelProto) -> bool:
    """Whether a Gemm or MatMul reads a node's third or later output (a Split's v, LayerNormalization's
    InvStdDev): GemmSumFusion then fails an assertion (gemm_sum_fusion.cc, src_arg_index < 2) when the
    product feeds a Sum, as a weight's gradient summed over its uses does, and the session does not load."""
    index = {o: k for n in model.graph.node for k, o in enumerate(n.output) if o}
    return any(index.get(i, 0) >= 2 for n in model.graph.node if n.op_type in ("Gemm", "MatMul")
               for i in n.input)


def _swaps_last_two(node: onnx.NodeProto) -> bool:
    perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
    if perm is None or len(perm) < 2:
        return perm is None  # no perm: reversed axes, the last two swapped when the rank is 2
    rank = len(perm)
    return perm[:-2] == list(range(rank - 2)) and perm[-2:] == [rank - 1, rank - 2]


def _transposed_by_vectors(model: onnx.ModelProto, known: _Known) -> bool:
    """Whether a MatMul reads a Transpose of its first operand's last two axes and a second operand not
    known to have two axes or more: MatmulTransposeFusion makes that a FusedMatMul with transA, whose CPU
    kernel gives wrong values for a 1-D second operand (onnxruntime 1.32: Xᵀ·v of a (3, 4) X off by 3.5),
    the weight gradient of a vector weight (MatMul(X, w), w 1-D) among them."""
    suspects: list[tuple[str, onnx.GraphProto]] = []
    for g in walk_graphs(model.graph):
        outputs = {o.name for o in g.output}
        transposed = {n.output[0] for n in g.node if n.op_type == "Transpose" and n.domain in ("", "ai.onnx")
                      and n.output and n.output[0] not in outputs and _swaps_last_two(n)}
        suspects += [(n.input[1], g) for n in g.node if n.op_type == "MatMul" and n.domain in ("", "ai.onnx")
                     and len(n.input) == 2 and n.input[0] in transposed]
    if any(g is model.graph and known.rank(name) is None for name, g in suspects):
        known.infer()
    return any((known.rank(name) or 1) < 2 for name, _ in suspects)


def _clips_of_other_types(model: onnx.ModelProto, known: _Known) -> bool:
    """Whether a Relu feeds a Clip whose lower bound is, or may fold into, a constant of a type other than
    float and float16: FuseReluClip, which folds the Relu into that bound, refuses the type ('Unexpected
    data type for Clip 'min' input'), and the session does not load (a float64 model's Relu then Clip, say,
    its bound an initializer or an Expand, Identity or Cast of one that constant folding makes constant)."""
    fine = (TensorProto.FLOAT, TensorProto.FLOAT16)
    for g in walk_graphs(model.graph):
        constants = {t.name: t.data_type for t in g.initializer}
        constants.update((n.output[0], a.t.data_type) for n in g.node if n.op_type == "Constant" and n.output
                         for a in n.attribute if a.name == "value")
        relus = {n.output[0]: n.input[0] for n in g.node if n.op_type == "Relu" and n.output and n.input}
        for n in g.node:
            if n.op_type != "Clip" or len(n.input) < 2 or not n.input[1] or n.input[0] not in relus:
                continue
            if n.input[1] in constants:
                if constants[n.input[1]] not in fine:
                    return True
                continue
            # a computed bound: Clip's inputs share one type, that of the Relu's input
            known.infer()
            types = [known.elem_type(v) for v in (n.input[1], n.input[0], relus[n.input[0]])]
            found = [t for t in types if t]
            if not found or found[0] not in fine:
                return True
    return False


def _pads_of_some_axes(model: onnx.ModelProto) -> bool:
    """Whether a graph of ``model`` has a Pad with an axes input, and the model a Transpose: onnxruntime's
    transpose optimizer, moving a Transpose through that Pad, permutes its pads as if they named every axis
    (a Gather of out-of-range indices that fails at run time, at every optimization level)."""
    padded = transposed = False
    for g in walk_graphs(model.graph):
        for n in g.node:
            if n.domain in ("", "ai.onnx"):
                transposed = transposed or n.op_type == "Transpose"
                padded = padded or (n.op_type == "Pad" and len(n.input) > 3 and bool(n.input[3]))
        if padded and transposed:
            return True
    return False


_UNFOLDED = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                       "Multinomial", "Bernoulli", "Dropout", "If", "Loop", "Scan", "SequenceMap"})


def _body_ifs_of_constants(model: onnx.ModelProto) -> bool:
    """Whether an If inside a body (of a Loop, Scan or If) has a condition computed from constants alone
    (initializers, Constants, values of the enclosing graphs computed from them): ConstantFolding inlines
    such an If, and in the backward Loop of a gradient graph (a recomputed If and its gradient If on one
    such condition) the inlined If's used output went missing ("Missing Input" at run time, onnxruntime
    1.32)."""
    fed = {i.name for i in model.graph.input}
    constants = {t.name for t in model.graph.initializer if t.name not in fed}
    return _constant_ifs(model.graph, constants, nested=False)


def _constant_ifs(graph: onnx.GraphProto, outer: set[str], nested: bool) -> bool:
    constants = set(outer) | {t.name for t in graph.initializer}
    constants -= {i.name for i in graph.input}
    for n in graph.node:
        if n.op_type == "If" and nested and n.input and n.input[0] in constants:
            return True
        if n.op_type == "Constant" or (n.input and n.op_type not in _UNFOLDED
                                       and all(not i or i in constants for i in n.input)):
            constants.update(o for o in n.output if o)
        if any(_constant_ifs(g, constants, True) for a in n.attribute if a.type == onnx.AttributeProto.GRAPH
               for g in [a.g]):
            return True
    return False

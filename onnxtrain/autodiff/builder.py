"""Reverse-mode autodiff on ONNX graphs: forward graph in, forward + backward graph out.

The output uses only standard ONNX operators at one opset (17 or newer), so any ONNX runtime can
run it. ``build_gradient_model`` is the core; ``GradientGraphBuilder`` wraps it with the API of
onnxruntime's legacy class of that name.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.errors import GradientError
from onnxtrain.autodiff.exporter_checks import warn_inference_batch_norms
from onnxtrain.autodiff.opset_upgrade import BF16_OPSET, MIN_OPSET, has_bfloat16, upgrade_opset
from onnxtrain.autodiff.patterns import find_erf_gelus, find_tanh_gelus
from onnxtrain.autodiff.registry import find_rule, find_variant, has_no_gradient, ops_with_rules
from onnxtrain.autodiff.rules.normalization import FROM_OUTPUT
from onnxtrain.autodiff.rules.quantize import find_fake_quants
from onnxtrain.autodiff.stable_rewrites import stable_log_sigmoids
from onnxtrain.autodiff.symbolic_dims import forget_dims, sequence_element_dims
from onnxtrain.engine.feed_sizes import SAME_SIZE_KEY
from onnxtrain.errors import program_hint
from onnxtrain.ir.attrs import attribute_value, parse_attributes
from onnxtrain.ir.builder import (
    FLOAT_TYPES,
    LOW_FLOAT_TYPES,
    NameGen,
    NodeWriter,
    carry_description,
    elem_type,
    loadable_model,
    model_opset,
    symbolic_shape,
    value_types,
)
from onnxtrain.ir.elem_types import fill_elem_types
from onnxtrain.ir.functions import expand_functions
from onnxtrain.ir.graphs import (
    DEFAULT_DOMAINS,
    added_later,
    body_reads,
    node_reads,
    path_from,
    path_to,
    rename_values,
)


def _read_for_the_loss(nodes: list[onnx.NodeProto], reads: list[tuple[onnx.NodeProto, int]],
                       loss: str) -> dict[str, tuple[onnx.NodeProto, int]]:
    """Of ``reads`` (node, input slot), those whose node the loss depends on, by the value read."""
    if not reads:
        return {}
    on_path = {id(n) for n in path_to(nodes, [loss])[0]}
    return {node.input[i]: (node, i) for node, i in reads if id(node) in on_path}


def _refuse_uncomputed(nodes: list[onnx.NodeProto], x: str,
                       uncomputed: dict[str, tuple[onnx.NodeProto, int]], only: bool) -> None:
    """GradientError when ``x`` reaches the loss through an input whose gradient the rules do not compute
    though it is not zero (a loss's class weights): zeros (``only``: x got no gradient otherwise), or the
    part of the other paths alone, would be wrong numbers."""
    if not uncomputed:
        return
    _, reach = path_from(nodes, [x])
    hit = next((v for v in uncomputed if v in reach), None)
    if hit is not None:
        node, i = uncomputed[hit]
        where = (f"input {i} ({hit!r}) of node {node.name!r} ({node.op_type}), whose gradient onnxtrain "
                 "does not compute")
        if only:
            raise GradientError(f"{x!r} reaches the loss only through {where}: leave it out of the "
                                "gradient's inputs (keep it fixed)")
        raise GradientError(f"{x!r} reaches the loss also through {where}: its gradient would lack that "
                            "part; keep that input constant (torch: detach what feeds it) or leave it out of "
                            "the gradient's inputs")


def blocked_by(nodes: list[onnx.NodeProto], x: str, loss: str, types: dict[str, onnx.TypeProto] | None = None,
               opset: int | None = None) -> str:
    """" through a differentiable path (it passes through <nodes>, which have no gradient)" when ``x`` does
    reach ``loss`` through ``nodes`` but a gradient cannot follow: ops without a gradient (Unique, ArgMax,
    Shape ...), nodes that turn the path into a non-float value (a Cast to int64; its type from ``types``,
    else from the Cast), or, given the ``opset``, that read it only at inputs their rule gives no gradient
    (CastLike's target). "" when ``x`` does not reach ``loss`` at all or nothing of the kind is found."""
    after_x, reach = path_from(nodes, [x])
    if loss not in reach:
        return ""
    back = {loss}
    for n in reversed(after_x):
        if any(o in back for o in n.output):
            back.update(node_reads(n))
    on_path = [n for n in after_x if any(o in back for o in n.output)]
    path = reach & back
    known = {n.output[0]: attribute_value(a) for n in on_path if n.op_type == "Cast" and n.output
             for a in n.attribute if a.name == "to"}
    no_grad = [_named(n) for n in on_path if has_no_gradient(n.op_type, n.domain)]
    others = [why for n in on_path if not has_no_gradient(n.op_type, n.domain)
              for why in (_why_stopped(n, path, types, known, opset),) if why]
    verb = "has" if len(no_grad) == 1 else "have"
    parts = [f"{', '.join(no_grad)}, which {verb} no gradient"] if no_grad else []
    parts += others
    return f" through a differentiable path (it passes through {'; '.join(parts)})" if parts else ""


def _named(n: onnx.NodeProto) -> str:
    return f"{n.name or n.output[0]!r} ({n.op_type})"


def _type_name(et: int) -> str:
    return TensorProto.DataType.Name(et).lower()


def _why_stopped(n: onnx.NodeProto, path: set[str], types: dict[str, onnx.TypeProto] | None,
                 known: dict[str, int], opset: int | None) -> str:
    """Why node ``n`` (with a gradient rule) passes no gradient along ``path``, or "": it reads float values
    of the path and makes only non-float ones of it, or reads the path only at slots its rule stops."""
    def code(v: str) -> int:
        return (elem_type(types, v) if types is not None else 0) or known.get(v, 0)

    def floating(v: str) -> bool:
        return code(v) in (0, *FLOAT_TYPES, *LOW_FLOAT_TYPES)

    ins = [(i, v) for i, v in enumerate(n.input) if v in path]
    if not ins or not all(floating(v) for _, v in ins):
        return ""  # (a non-float path value: the node that made it is the one to name)
    outs = [o for o in n.output if o in path]
    if outs and not any(floating(o) for o in outs):
        return f"{_named(n)}, whose output {outs[0]!r} is {_type_name(code(outs[0]))}, not a float"
    rule = find_rule(n.op_type, opset, n.domain) if opset is not None else None
    stop = rule.stopped(n) if rule is not None else frozenset()
    if all(i in stop for i, _ in ins):
        i, v = ins[0]
        return f"{_named(n)} only at its input {i} ({v!r}), which takes no gradient"
    return ""


def expand_for_gradient(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each node of an op that ONNX defines by a function body (Attention, RMSNormalization,
    ...) and that has no gradient rule replaced by that body: the forward that :func:`build_gradient_model`
    differentiates (``model`` itself when there is none), its log-sigmoid terms written in stable form
    (:func:`~onnxtrain.autodiff.stable_rewrites.stable_log_sigmoids`)."""
    opset = model_opset(model)
    expanded = expand_functions(
        model,
        lambda n: find_rule(n.op_type, opset, n.domain) is None and not has_no_gradient(n.op_type, n.domain),
    )
    return stable_log_sigmoids(expanded)


def fake_quant_inputs(model: onnx.ModelProto) -> dict[str, str]:
    """Each DequantizeLinear output of a QuantizeLinear -> DequantizeLinear pair that carries the
    straight-through estimator (quantization-aware training) → the QuantizeLinear's float input."""
    if not any(n.op_type == "DequantizeLinear" for n in model.graph.node):
        return {}
    bw = _Backward(model)
    return {bw.fwd_nodes[k].output[0]: fq.x for k, fq in find_fake_quants(bw).items()}


class _Backward:
    """State of one backward construction."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.opset = model_opset(model)
        self.types = value_types(model)
        fill_elem_types(model, self.types)  # what inference left untyped (GroupNormalization-21 at IR 8)
        forget_dims(self.types, sequence_element_dims(model, self.types))
        self.names = NameGen.for_model(model)
        self.fwd_nodes = [_copy(n) for n in model.graph.node]
        self.producer: dict[str, tuple[int, int]] = {}
        for k, n in enumerate(self.fwd_nodes):
            for j, o in enumerate(n.output):
                if o:
                    self.producer[o] = (k, j)
        self.backward_nodes: list[onnx.NodeProto] = []
        self.after_node: dict[int, list[onnx.NodeProto]] = {}  # forward-side nodes (Shape) per producer
        self.before_all: list[onnx.NodeProto] = []
        self._shapes: dict[str, str] = {}
        self.shape_outputs: set[str] = set()  # the Shape values of shape_of: real shapes (no 0 to copy)
        self.const_cache: dict[tuple, str] = {}
        self._graph_inputs = {v.name for v in model.graph.input}
        self._initializers = {t.name: t for t in model.graph.initializer}
        self.graph_outputs = {o.name for o in model.graph.output}
        self._readers: dict[str, list[onnx.NodeProto]] | None = None  # built on first use
        self.requires: set[str] = set()  # the values that depend on a differentiated input
        self._slots: dict[str, list[tuple[str, int]]] | None = None  # (one_size's, built on first use)
        self._source_map: dict[str, frozenset[str]] | None = None
        self.feeds_checked = False  # (build_gradient_model's option)
        self.assumed: dict[str, set[tuple[str, int]]] = {}  # dims taken for one size (as feeds_checked lets)

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """The forward nodes that read ``name`` as an input."""
        if self._readers is None:
            self._readers = {}
            for n in self.fwd_nodes:
                for i in dict.fromkeys(n.input):
                    if i:
                        self._readers.setdefault(i, []).append(n)
        return self._readers.get(name, [])

    def producer_node(self, name: str) -> onnx.NodeProto | None:
        """The forward node that makes ``name`` (None for inputs, initializers and unknown names)."""
        where = self.producer.get(name)
        return None if where is None else self.fwd_nodes[where[0]]

    def constant_value(self, name: str) -> Any:
        """The value of ``name`` when it is fixed (an initializer that is not a graph input, a Constant
        node's output, or an Identity or Cast of one: torch's dynamo exporter casts its constants), else
        None."""
        if not name or name in self._graph_inputs:
            return None  # a graph input (even one with an initializer as its default) can be fed
        if name in self._initializers:
            return numpy_helper.to_array(self._initializers[name])
        where = self.producer.get(name)
        if where is None:
            return None
        node = self.fwd_nodes[where[0]]
        if node.op_type == "Constant" and len(node.attribute) == 1:
            a = node.attribute[0]
            if a.name in ("value", "value_int", "value_ints", "value_float", "value_floats"):
                import numpy as np

                return np.asarray(attribute_value(a))
        elif node.op_type in ("Identity", "Cast") and node.domain in ("", "ai.onnx"):
            v = self.constant_value(node.input[0])
            if v is None or node.op_type == "Identity":
                return v
            from onnxtrain.engine.kernels.elementwise import cast_to

            attrs = {a.name: attribute_value(a) for a in node.attribute}
            mode = attrs.get("round_mode", "up")
            return cast_to(v, int(attrs["to"]), bool(attrs.get("saturate", 1)),
                           mode.decode() if isinstance(mode, bytes) else mode)
        return None

    def ensure_output(self, node: onnx.NodeProto, i: int) -> str:
        """Give ``node`` an output ``i`` (e.g. MaxPool's Indices, Dropout's mask) if it has none."""
        while len(node.output) <= i:
            node.output.append("")
        if not node.output[i]:
            node.output[i] = self.names(f"{node.name or node.op_type}_out{i}")
            # known as the node's output from now on (a Shape of it then follows the node, not the inputs)
            k = next((k for k, n in enumerate(self.fwd_nodes) if n is node), None)
            if k is not None:
                self.producer[node.output[i]] = (k, i)
        return node.output[i]

    def shape_of(self, name: str) -> str:
        """A ``Shape`` of ``name`` placed right after its producer in the forward pass."""
        if name in self._shapes:
            return self._shapes[name]
        out = self.names(f"{name}_shape")
        node = helper.make_node("Shape", [name], [out], name=self.names(f"{name}_Shape"))
        where = self.producer.get(name)
        if where is None:
            self.before_all.append(node)
        else:
            self.after_node.setdefault(where[0], []).append(node)
        self._shapes[name] = out
        self.shape_outputs.add(out)
        return out

    def unbroadcast(self, g: GradCtx, grad: str, x: str, grad_rank: int | None) -> str:
        xs = symbolic_shape(self.types, x)
        out_shape = symbolic_shape(self.types, g.node.output[0]) if g.node.output else None
        if grad_rank is None and out_shape is not None:
            grad_rank = len(out_shape)
        if xs is None or grad_rank is None:
            return self._unbroadcast_dynamic(g, grad, x)
        lead = grad_rank - len(xs)
        if lead < 0:
            raise RuleError(
                f"node {g.node.name!r} ({g.node.op_type}): gradient rank {grad_rank} is smaller "
                f"than the rank {len(xs)} of input {x!r}"
            )
        ys = out_shape if out_shape is not None and len(out_shape) == grad_rank else [None] * grad_rank
        axes = list(range(lead))
        for j, d in enumerate(xs):
            dy = ys[lead + j]
            if d == 1:
                if dy != 1:
                    axes.append(lead + j)
            elif isinstance(d, int):
                continue
            elif d is not None and d == dy and self.one_size(g.node, d, record=False):
                continue  # x's named dim is the output's, and no feed can make one of them 1
            elif self._kept_by_others(g, x, lead + j, grad_rank, d):
                continue
            elif d is not None and d == dy and self.one_size(g.node, d):
                continue  # (the same, the caller checking the feeds: feeds_checked)
            else:
                # a dim we cannot see may or may not be broadcast (or two inputs share its name, so one may be
                # fed a 1 where the other is not): decide at run time
                return self._unbroadcast_dynamic(g, grad, x, same_rank=lead == 0)
        if not axes:
            return grad
        if axes == list(range(lead)):
            return g.reduce("ReduceSum", grad, axes, keepdims=0)
        red = g.reduce("ReduceSum", grad, axes, keepdims=1)
        return g.emit("Squeeze", red, g.ints(range(lead))) if lead else red

    def _kept_by_others(self, g: GradCtx, x: str, axis: int, rank: int, d: str | None) -> bool:
        """Whether the node's output has input ``x``'s (unknown) dim ``d`` on ``axis`` of its ``rank`` axes,
        seen from its other inputs: each has no dim there, a 1, or the same named dim, so that ``x`` is not
        broadcast along it (an attention mask beside its scores, a bias beside its activations). For
        MatMul, only its batch axes broadcast; the last two are the operand's own."""
        op = g.node.op_type
        if op not in BROADCASTING_OPS and op != "MatMul":
            return False
        if op == "MatMul" and axis >= rank - 2:
            return True
        if d is None or self.one_size(g.node, d, record=False):
            return self._others_keep(g, x, axis, rank, d)
        # the name alone proves nothing: another input's dim of that name may be fed otherwise
        if self._others_keep(g, x, axis, rank, None):
            return True
        return self.feeds_checked and self._others_keep(g, x, axis, rank, d) and self.one_size(g.node, d)

    def _others_keep(self, g: GradCtx, x: str, axis: int, rank: int, d: str | None) -> bool:
        """:meth:`_kept_by_others` for a broadcasting op, the other inputs' dims ``d`` taken for x's."""
        op = g.node.op_type
        for name in g.node.input:
            if not name or name == x:  # (x read twice: the same size on both)
                continue
            other = symbolic_shape(self.types, name)
            if other is None or (op == "MatMul" and len(other) < 2):
                return False
            k = axis - (rank - len(other))
            if k < 0 or (op == "MatMul" and k >= len(other) - 2):
                continue
            if other[k] != 1 and (d is None or other[k] != d):
                return False
        return True

    def one_size(self, node: onnx.NodeProto, d: str, record: bool = True) -> bool:
        """Whether every dim named ``d`` among ``node``'s inputs has one size at run time: the graph inputs
        these inputs come from hold ``d`` on at most one axis, so each such dim goes back to that one fed
        size (or to none: a name only value infos give). Two graph inputs declared ``[N, 3]`` may be fed 4
        and 1 rows (broadcast), so a name they share is no proof, unless ``feeds_checked``: the dim is then
        taken for one size, and noted in :attr:`assumed` when ``record``."""
        slots = self._dim_slots().get(d)
        if not slots or len(slots) == 1:
            return True
        sources: set[str] = set()
        for name in node.input:
            if name:
                sources |= self._sources(name)
        mine = [s for s in slots if s[0] in sources]
        if len(mine) <= 1:
            return True
        if not (self.feeds_checked and record):
            return False
        self.assumed.setdefault(d, set()).update(mine)  # (the caller refuses feeds of different sizes)
        return True

    def _dim_slots(self) -> dict[str, list[tuple[str, int]]]:
        """Symbolic dim name → the (graph input, axis) pairs declaring it."""
        if self._slots is None:
            self._slots = {}
            for v in self.model.graph.input:
                for a, d in enumerate(symbolic_shape(self.types, v.name) or ()):
                    if isinstance(d, str) and d:
                        self._slots.setdefault(d, []).append((v.name, a))
        return self._slots

    def _sources(self, name: str) -> frozenset[str]:
        """The graph inputs ``name`` is computed from (all of them past a node with a subgraph, which may
        read any outer value)."""
        if self._source_map is None:
            everything = frozenset(self._graph_inputs)
            found: dict[str, frozenset[str]] = {n: frozenset((n,)) for n in self._graph_inputs}
            bodies = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
            for n in self.fwd_nodes:
                if any(a.type in bodies for a in n.attribute):
                    srcs = everything
                else:
                    srcs = frozenset().union(*(found.get(i, frozenset()) for i in n.input if i))
                for o in n.output:
                    if o:
                        found[o] = srcs
            self._source_map = found
        return self._source_map.get(name, frozenset())

    def _unbroadcast_dynamic(self, g: GradCtx, grad: str, x: str, same_rank: bool = False) -> str:
        sg = g.emit("Shape", grad)
        sx = self.shape_of(x)
        if same_rank:  # (x's rank is the gradient's) the axes where their sizes differ, summed keeping them
            axes = g.emit("Reshape", g.emit("NonZero", g.emit("Not", g.emit("Equal", sx, sg))), g.ints([-1]))
            return g.emit("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        # axes where Shape(x), left-padded with ones to the gradient's rank, differs from Shape(grad)
        diff = g.emit("Sub", g.emit("Size", sg), g.emit("Size", sx))
        one = numpy_helper.from_array(_np_int64_1())
        pad = g.emit("ConstantOfShape", g.emit("Reshape", diff, g.ints([1])), value=one)
        sxp = g.emit("Concat", pad, sx, axis=0)
        axes = g.emit("Reshape", g.emit("NonZero", g.emit("Not", g.emit("Equal", sxp, sg))), g.ints([-1]))
        red = g.emit("ReduceSum", grad, axes, keepdims=1, noop_with_empty_axes=1)
        return g.emit("Reshape", red, sx)


# ops whose inputs all broadcast against one another (numpy style) to make the output
BROADCASTING_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min", "Sum", "Mean", "PRelu",
})


def _differentiable_ys(bw: Any, ys: Sequence[str], requires: set[str]) -> list[str]:
    """The ``ys`` a gradient can flow through; the others — graph inputs and initializers (nothing makes
    them), values of a non-float type or that no x reaches — are left out with a warning, as onnxruntime's
    builder logged and ignored them (an input ``<y>_grad`` nothing reads would have to be fed)."""
    made = {o for n in bw.fwd_nodes for o in n.output if o}
    kept, left = [], []
    for y in ys:
        (kept if y in made and y in requires else left).append(y)
    if left:
        from onnxtrain.user_warning import warn

        warn(f"GradientGraphBuilder: y {left} are not differentiable with respect to the x (inputs, "
             "initializers, non-float values or values no x reaches): they take no incoming gradient")
    return kept


def _np_int64_1() -> Any:
    import numpy as np

    return np.ones(1, dtype=np.int64)


def _copy(node: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(node)
    return c


def build_gradient_model(
    model: onnx.ModelProto | bytes | str,
    loss: str,
    wrt: Sequence[str],
    outputs: Sequence[str] | None = None,
    extra_outputs: Sequence[str] = (),
    other_ys: Sequence[str] = (),
    zero_unreachable: bool = True,
    grad_suffix: str = "_grad",
    memory_efficient: bool = False,
    seed_loss: bool = True,
    drop_non_differentiable_ys: bool = False,
    feeds_checked: bool = True,
) -> onnx.ModelProto:
    """Append the backward pass of ``loss`` with respect to ``wrt`` to ``model``.

    The result outputs the loss, ``outputs`` (default: the model's outputs), ``extra_outputs``
    (forward values such as BatchNormalization running statistics) and ``<x>_grad`` for every
    ``x`` in ``wrt``, in that order. ``other_ys`` are further differentiated values whose incoming
    gradients ``<y>_grad`` become graph inputs. ``memory_efficient`` (the legacy
    ``use_memory_efficient_gradient``): a LayerNormalization whose input nothing else keeps for the
    backward pass takes its gradient from its output instead, so that the input is freed after the
    forward (:func:`~onnxtrain.autodiff.rules.normalization.layer_norm_grad_from_output`). With
    ``seed_loss=False`` the loss too takes its incoming gradient ``<loss>_grad`` as a graph input
    instead of ones. With ``drop_non_differentiable_ys`` (onnxruntime's GradientGraphBuilder), other ys
    that are inputs, initializers, non-float or out of the x's reach are left out with a warning.
    Where two graph inputs declare one symbolic dim name and their values meet in a broadcasting op, the
    name is taken for one size, as ONNX means it (``feeds_checked``, the default), and those dims are listed
    in the result's metadata ``onnxtrain.same_size_dims`` (JSON: dim → [[input, axis], ...]) for a runner to
    check each run's feeds against (:func:`onnxtrain.engine.feed_sizes.same_size_error`; onnxtrain's
    sessions do); with ``feeds_checked=False`` the gradient sums along such a dim at run time instead, so
    that one input may be fed a 1 there (a broadcast) on any runtime.
    Example::

        m = build_gradient_model(onnx.load("mlp_loss.onnx"), "loss", ["fc1.weight", "fc1.bias"])
    """
    from onnxtrain.engine.interface import load_model  # (read and refused as the sessions read them)

    if isinstance(model, (bytes, bytearray)):
        model = load_model(bytes(model))
    elif isinstance(model, (str, os.PathLike)):
        model = load_model(os.fspath(model))
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"model must be an onnx.ModelProto, its serialized bytes or a path, got "
                        f"{type(model).__name__}{program_hint(model)}")
    from onnxtrain.engine.interface import standard_model

    model = loadable_model(model)
    model = standard_model(model)  # (torch's export_modules_as_functions, sparse initializers)
    warn_inference_batch_norms(model)
    # bfloat16 zeros and seeds (ConstantOfShape) are valid from opset 20, as mixed precision upgrades too
    model = expand_for_gradient(upgrade_opset(model, BF16_OPSET if has_bfloat16(model) else MIN_OPSET))
    bw = _Backward(model)
    bw.feeds_checked = feeds_checked
    g = model.graph
    known = {v.name for v in g.input} | {t.name for t in g.initializer} | set(bw.producer)
    for name, what in [(loss, "loss"), *((x, "x (wrt)") for x in wrt), *((y, "y") for y in other_ys)]:
        if name not in known:
            raise GradientError(
                f"{what} {name!r} is not a value of the graph; graph outputs: {[o.name for o in g.output]}"
            )
    if len(set(wrt)) != len(wrt):
        raise GradientError(f"wrt lists a value twice: {list(wrt)}")

    for x in wrt:
        gname = f"{x}{grad_suffix}"
        if gname in bw.names.taken:
            raise GradientError(
                f"the model already has a value named {gname!r}; cannot name the gradient of {x!r}"
            )
        bw.names.taken.add(gname)

    # forward reachability from wrt through differentiable, float-typed edges
    requires: set[str] = set(wrt)
    bw.requires = requires  # filled below; rules ask it whether a value varies with the wrt
    rules: dict[int, Any] = {}
    # QuantizeLinear -> DequantizeLinear pairs (quantization-aware training): their integer edge carries the
    # straight-through estimator from the DequantizeLinear's output to the QuantizeLinear's input
    fakes = find_fake_quants(bw)
    uncomputed_reads: list[tuple[onnx.NodeProto, int]] = []
    for k, node in enumerate(bw.fwd_nodes):
        fake = fakes.get(k)
        if fake is not None:
            if fake.x in requires:
                rules[k] = fake
                requires.add(node.output[0])
            continue
        if has_no_gradient(node.op_type, node.domain):
            uncomputed_reads.extend(_smooth_low_float_reads(bw, node, requires))
            continue
        rule = find_rule(node.op_type, bw.opset, node.domain)
        stop = rule.stopped(node) if rule else frozenset()
        for i in (stop & rule.uncomputed) if rule else ():  # left out by the rule, though not zero
            if i < len(node.input) and node.input[i] in requires:
                uncomputed_reads.append((node, i))
        if any(n in requires and i not in stop for i, n in enumerate(node.input)) or any(
            n in requires for n in body_reads(node)
        ):
            rules[k] = rule
            for o in node.output:
                if o and _is_float(bw, o):
                    requires.add(o)
    uncomputed = _read_for_the_loss(bw.fwd_nodes, uncomputed_reads, loss)
    if drop_non_differentiable_ys:
        other_ys = _differentiable_ys(bw, other_ys, requires)
    ys = [loss, *other_ys]
    # backward reachability from the ys
    needed: set[str] = {y for y in ys if y in requires}
    on_path: list[int] = []
    for k in range(len(bw.fwd_nodes) - 1, -1, -1):
        node = bw.fwd_nodes[k]
        if k in rules and any(o in needed for o in node.output if o):
            on_path.append(k)
            if k in fakes:
                needed.add(fakes[k].x)
            stop = rules[k].stopped(node) if rules[k] else frozenset()
            for i, n in enumerate(node.input):
                if n in requires and i not in stop:
                    needed.add(n)
            needed.update(n for n in body_reads(node) if n in requires)
    for k in on_path:
        if rules[k] is None:
            node = bw.fwd_nodes[k]
            op = node.op_type if node.domain in DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
            later = added_later(node, bw.opset)
            raise GradientError(
                f"node {node.name!r} ({op}{later}) lies on the path from the parameters to the "
                f"loss but {op} has no gradient rule{' there' if later else ''}; ops with rules (ONNX's): "
                f"{', '.join(ops_with_rules())}"
            )

    gelus: dict[int, Any] = {}
    if os.environ.get("ONNXTRAIN_GELU_GRAD", "1") != "0":
        gelus = {**find_tanh_gelus(bw), **find_erf_gelus(bw)}
    gelus.update(fakes)  # these too get their gradient in one piece, at their last node
    if memory_efficient:
        _layer_norms_from_output(bw, rules, on_path, gelus)

    # seeds
    seed_w = NodeWriter(bw.names, bw.backward_nodes, prefix="")
    contributions: dict[str, list[str]] = {}
    new_inputs: list[onnx.ValueInfoProto] = []
    if loss in needed and not seed_loss:
        name = bw.names(f"{loss}{grad_suffix}")
        tp = bw.types.get(loss) or helper.make_tensor_type_proto(TensorProto.FLOAT, None)
        new_inputs.append(helper.make_value_info(name, tp))
        contributions[loss] = [name]
    elif loss in needed:
        _refuse_low_float_constant(bw, loss, "its seed (ones)", zeros=False)
        one = numpy_helper.from_array(_ones(elem_type(bw.types, loss) or TensorProto.FLOAT))
        seed = seed_w.emit(
            "ConstantOfShape",
            [bw.shape_of(loss)],
            [bw.names(f"{loss}{grad_suffix}")],
            name=bw.names(f"{loss}_grad_seed"),
            value=one,
        )[0]
        contributions[loss] = [seed]
    for y in other_ys:
        name = bw.names(f"{y}{grad_suffix}")
        tp = bw.types.get(y) or helper.make_tensor_type_proto(TensorProto.FLOAT, None)
        new_inputs.append(helper.make_value_info(name, tp))
        contributions.setdefault(y, []).append(name)

    def grad_of(name: str) -> str | None:
        parts = contributions.get(name)
        if not parts:
            return None
        if len(parts) > 1:
            _refuse_low_float_sum(bw, name)
            tp = bw.types.get(name)
            if tp is not None and tp.HasField("sequence_type"):  # element by element
                et = tp.sequence_type.elem_type.tensor_type.elem_type or TensorProto.FLOAT
                summed = _sum_sequences(bw, seed_w, parts, f"{name}{grad_suffix}", et)
            else:
                summed = seed_w.emit(
                    "Sum", parts, [bw.names(f"{name}{grad_suffix}_sum")], name=bw.names(f"{name}_grad_Sum")
                )[0]
            contributions[name] = [summed]
        return contributions[name][0]

    # the reverse walk; a matched GELU (tanh or exact) gets its gradient in one piece at its last node (its
    # inner values, read nowhere else, then receive no gradient and their nodes are skipped)
    for k in on_path:
        node = bw.fwd_nodes[k]
        rule = rules[k]
        dys = [grad_of(o) if o else None for o in node.output]
        if all(d is None for d in dys):
            continue
        gelu = gelus.get(k)
        if gelu is not None and gelu.x in needed:
            et = elem_type(bw.types, gelu.x) or TensorProto.FLOAT
            dx = gelu.grad(NodeWriter(bw.names, bw.backward_nodes, prefix=f"{node.name}_Grad/"), dys[0], et)
            contributions.setdefault(gelu.x, []).append(dx)
            continue
        stop = rule.stopped(node)
        needs = [bool(n) and n in needed and i not in stop for i, n in enumerate(node.input)]
        ctx = GradCtx(bw, node, rule, parse_attributes(node, bw.opset), dys, needs)
        ctx.body_wrt = [n for n in body_reads(node) if n in needed]
        passed = [o for o, d in zip(node.output, dys) if d] + [n for n, w in zip(node.input, needs) if w]
        _refuse_low_float_backward(bw, node, passed + ctx.body_wrt)
        try:
            rule.fn(ctx)
        except RuleError as e:
            raise GradientError(f"node {node.name!r} ({node.op_type}): {e}") from None
        for i, d in ctx.dxs.items():
            contributions.setdefault(node.input[i], []).append(d)
        for n, d in ctx.body_dxs.items():
            contributions.setdefault(n, []).append(d)

    out_names = [loss] + [
        o for o in (outputs if outputs is not None else [o.name for o in g.output]) if o != loss
    ]
    out_names += [e for e in extra_outputs if e not in out_names]
    grad_outputs: list[onnx.ValueInfoProto] = []
    tail = NodeWriter(bw.names, bw.backward_nodes, prefix="")
    produced_by_backward = {o for n in bw.backward_nodes for o in n.output}
    renames: dict[str, str] = {}
    for x in wrt:
        gname = f"{x}{grad_suffix}"
        d = grad_of(x)
        _refuse_uncomputed(bw.fwd_nodes, x, uncomputed, only=d is None)
        if d is None:
            if not zero_unreachable:
                if not _is_float(bw, x):  # (token ids, labels: they may well reach the loss, as indices)
                    raise GradientError(f"{x!r} is {_type_name(elem_type(bw.types, x))}, not a float: it has "
                                        "no gradient; leave it out of the values to differentiate")
                why = blocked_by(bw.fwd_nodes, x, loss, bw.types, bw.opset)
                raise GradientError(f"{x!r} does not reach {loss!r}{why}: no gradient flows back to it")
            _refuse_low_float_constant(bw, x, f"its gradient (zeros: it does not reach {loss!r})", zeros=True)
            zero = numpy_helper.from_array(_zeros(elem_type(bw.types, x) or TensorProto.FLOAT))
            tail.emit("ConstantOfShape", [bw.shape_of(x)], [gname], value=zero)
        elif d != gname:
            if d in produced_by_backward and d not in renames and d not in (loss, *wrt):
                renames[d] = gname  # name the last gradient node's output <x>_grad directly
            else:
                tail.emit("Identity", [d], [gname])
        tp = bw.types.get(x)
        grad_outputs.append(
            helper.make_value_info(gname, tp)
            if tp is not None
            else helper.make_empty_tensor_value_info(gname)
        )
    for n in bw.backward_nodes:  # in the bodies of control-flow nodes too, which may read the gradient
        rename_values(n, renames)
    # assemble, after the zero gradients (they may add Shape nodes): the forward with its Shape nodes,
    # then the seeds and the backward
    backward = _fold_transposed_gemms(bw.backward_nodes, set(out_names) | {o.name for o in grad_outputs})
    nodes: list[onnx.NodeProto] = list(bw.before_all)
    for k, n in enumerate(bw.fwd_nodes):
        nodes.append(n)
        nodes.extend(bw.after_node.get(k, ()))
    nodes.extend(backward)
    value_infos = {v.name: v for v in (*g.output, *g.input, *g.value_info)}
    outs = [_vi(bw, n, value_infos.get(n)) for n in out_names] + grad_outputs
    keep = _live_nodes(nodes, [o.name for o in outs])
    result = helper.make_model(
        helper.make_graph(keep, g.name or "gradient_graph", list(g.input) + new_inputs, outs),
        opset_imports=list(model.opset_import), ir_version=model.ir_version,
    )
    result.graph.initializer.extend(g.initializer)  # (once: make_graph and make_model copy what they take)
    result.functions.extend(model.functions)
    if bw.assumed:
        helper.set_model_props(result, {SAME_SIZE_KEY: json.dumps(
            {d: sorted(map(list, slots)) for d, slots in sorted(bw.assumed.items())})})
    carry_description(model, result)  # (as onnxruntime-training 1.16.3's and 1.19.2's builder keeps it)
    return result


_SINGLE_OR_HALF = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _layer_norms_from_output(bw: _Backward, rules: dict[int, Any], on_path: list[int],
                             gelus: dict[int, Any]) -> None:
    """Give the LayerNormalizations on the path whose input no other gradient rule reads, and which is no
    graph input, initializer or output, the rule that reads their output instead (in ``rules``)."""
    variant = find_variant("LayerNormalization", FROM_OUTPUT)
    g = bw.model.graph
    kept = {v.name for v in g.input} | {t.name for t in g.initializer} | {o.name for o in g.output}
    kept.update(m.x for m in gelus.values())
    readers: dict[str, set[int]] = {}
    for k in on_path:
        rule, node = rules[k], bw.fwd_nodes[k]
        if rule is None:
            continue
        for key in rule.uses:
            names = node.input if key[0] == "x" else node.output
            picked = names if key[1:] == "*" else names[int(key[1:]):int(key[1:]) + 1]
            for n in picked:
                if n:
                    readers.setdefault(n, set()).add(k)
    for k in on_path:
        node = bw.fwd_nodes[k]
        if node.op_type != "LayerNormalization" or rules[k] is None:
            continue
        x = node.input[0]
        # a float64 input keeps the standard rule: InvStdDev is float32 (its only valid stash type), which
        # that rule then recomputes in float64 from the input
        if x in kept or readers.get(x, set()) - {k} or elem_type(bw.types, x) not in _SINGLE_OR_HALF:
            continue
        rules[k] = variant


def _vi(bw: _Backward, name: str, given: onnx.ValueInfoProto | None = None) -> onnx.ValueInfoProto:
    """A value info for output ``name``: the model's own when it has a type, else the inferred one. A given
    tensor type without a shape (which onnx.checker refuses on a graph output), or of a rank its producer
    contradicts (an exporter's mistake), takes the inferred shape; one of an element type its producer
    contradicts, the inferred element type."""
    tp = bw.types.get(name)
    if given is not None and given.type.HasField("tensor_type") and given.type.tensor_type.elem_type:
        tt = given.type.tensor_type
        known = tp is not None and tp.tensor_type.HasField("shape")
        reshape = known and not (tt.HasField("shape") and len(tt.shape.dim) == len(tp.tensor_type.shape.dim))
        elem = tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else 0
        retype = bool(elem) and elem != tt.elem_type
        if not reshape and not retype:
            return given
        out = onnx.ValueInfoProto()
        out.CopyFrom(given)
        if reshape:
            out.type.tensor_type.shape.CopyFrom(tp.tensor_type.shape)
        if retype:
            out.type.tensor_type.elem_type = elem
        return out
    return helper.make_value_info(name, tp) if tp is not None else helper.make_empty_tensor_value_info(name)


def _sum_sequences(bw: _Backward, w: NodeWriter, parts: list[str], base: str, et: int) -> str:
    """The element-wise sum of sequences of equal lengths (gradient contributions to one sequence of
    element type ``et``), as a SequenceMap whose body adds one element of each."""
    elements = [bw.names(f"{base}_part{i}") for i in range(len(parts))]
    total = bw.names(f"{base}_element")
    body = helper.make_graph(  # typed: onnxruntime, its optimizations off, cannot run an untyped body
        [helper.make_node("Sum", elements, [total])],
        f"{base}_sum",
        [helper.make_tensor_value_info(e, et, None) for e in elements],
        [helper.make_tensor_value_info(total, et, None)],
    )
    return w.emit("SequenceMap", parts, [bw.names(f"{base}_sum")], name=bw.names(f"{base}_Sum"), body=body)[0]


def _is_float(bw: _Backward, name: str) -> bool:
    """Whether ``name`` can carry a gradient: a float of any width (float8 and float4 too, as in torch) or of
    unknown type."""
    et = elem_type(bw.types, name)
    return et == TensorProto.UNDEFINED or et in FLOAT_TYPES or et in LOW_FLOAT_TYPES


# ops with a gradient rule that ONNX can run on a float8/float4 gradient: the ops each rule emits on it (their
# schemas decide, at the model's opset). Cast's rule casts dY back, Identity's passes it on, the reshapes
# reshape it to Shape(X). Every other rule computes on dY (Mul, Slice, Sum ...), which ONNX defines for no
# float8/float4 type.
_LOW_FLOAT_BACKWARDS: dict[str, tuple[str, ...]] = {
    "Cast": ("Cast",), "CastLike": ("Cast",), "Identity": (), "Transpose": ("Transpose",),
    **{op: ("Shape", "Reshape") for op in ("Reshape", "Flatten", "Squeeze", "Unsqueeze")},
}
# ops without a gradient rule whose float output varies smoothly with a float8/float4 input (at these slots):
# that input's gradient is not zero, so a path to the loss through one is an error, not a silent zero
_SMOOTH_LOW_FLOAT_READS: dict[str, tuple[int, ...]] = {"DequantizeLinear": (0,), "QLinearMatMul": (0, 3)}


def _onnx_defines(op: str, opset: int, et: int) -> bool:
    """Whether ONNX's ``op`` at ``opset`` takes tensors of element type ``et``."""
    try:
        schema = onnx.defs.get_schema(op, opset, "")
    except onnx.defs.SchemaError:
        return False
    want = f"tensor({_type_name(et)})"
    return any(want in tc.allowed_type_strs for tc in schema.type_constraints)


def _refuse_low_float_backward(bw: _Backward, node: onnx.NodeProto, names: Iterable[str]) -> None:
    """GradientError naming ``node`` when its gradient would compute on one of ``names`` (its inputs and
    outputs the gradient passes) that is a float8/float4 value, with ops ONNX does not define on that type."""
    ops = _LOW_FLOAT_BACKWARDS.get(node.op_type) if node.domain in DEFAULT_DOMAINS else None
    for v in names:
        et = elem_type(bw.types, v)
        if et not in LOW_FLOAT_TYPES:
            continue
        missing = [o for o in ops or () if not _onnx_defines(o, bw.opset, et)]
        if ops is not None and not missing:
            continue
        lacking = "any of its arithmetic" if ops is None else ", ".join(missing)
        raise GradientError(
            f"node {node.name or node.output[0]!r} ({node.op_type}): its gradient would be computed on "
            f"{v!r}, of type {_type_name(et)}, for which ONNX (opset {bw.opset}) defines no {lacking} "
            f"(only casts, copies and reshapes); cast {v!r} to float before {node.op_type} reads it "
            "(and back after it, to keep the rounding)"
        )


def _refuse_low_float_sum(bw: _Backward, name: str) -> None:
    """GradientError when ``name``, a float8/float4 value, gets gradients from several nodes: ONNX has no
    Sum or Add of that type (nor does torch's autograd: it fails adding them)."""
    et = elem_type(bw.types, name)
    if et not in LOW_FLOAT_TYPES:
        return
    readers = ", ".join(_named(n) for n in bw.readers(name))
    raise GradientError(
        f"{name!r}, of type {_type_name(et)}, is read by several nodes ({readers}): its gradient is the sum "
        f"of theirs, which ONNX (Sum, Add) cannot compute in {_type_name(et)}, nor can torch; cast it to "
        "float once and let the nodes read that"
    )


def _refuse_low_float_constant(bw: _Backward, name: str, what: str, zeros: bool) -> None:
    """GradientError when ``what`` (a ConstantOfShape of ``name``'s type, of ``zeros`` or ones) cannot be
    written: a float8/float4 type that ConstantOfShape lacks at the model's opset, or zeros of float8e8m0,
    which has no zero."""
    et = elem_type(bw.types, name)
    if et not in LOW_FLOAT_TYPES:
        return
    no_zero = zeros and et == getattr(TensorProto, "FLOAT8E8M0", -1)
    if no_zero or not _onnx_defines("ConstantOfShape", bw.opset, et):
        why = "has no zero" if no_zero else f"has no ConstantOfShape at opset {bw.opset}"
        raise GradientError(f"{name!r}: {what} would be of type {_type_name(et)}, which {why}")


def _smooth_low_float_reads(bw: _Backward, node: onnx.NodeProto,
                            requires: set[str]) -> list[tuple[onnx.NodeProto, int]]:
    """The (node, slot) pairs where ``node``, an op without a gradient, reads a float8/float4 value that
    depends on the wrt and its output depends smoothly on it (:data:`_SMOOTH_LOW_FLOAT_READS`)."""
    if node.domain not in DEFAULT_DOMAINS:
        return []
    return [(node, i) for i in _SMOOTH_LOW_FLOAT_READS.get(node.op_type, ())
            if i < len(node.input) and node.input[i] in requires
            and elem_type(bw.types, node.input[i]) in LOW_FLOAT_TYPES]


def _ones(et: int) -> Any:
    import numpy as np

    return np.ones(1, dtype=helper.tensor_dtype_to_np_dtype(et))


def _zeros(et: int) -> Any:
    import numpy as np

    return np.zeros(1, dtype=helper.tensor_dtype_to_np_dtype(et))


def _fold_transposed_gemms(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """``Transpose(Gemm(A, B), perm=[1, 0])``, the product read nowhere else, becomes one Gemm of the swapped
    operands: (op(A)·op(B))ᵀ = op(B)ᵀ·op(A)ᵀ. The weight gradient of a Linear exported as
    ``MatMul(x, Transpose(W))`` is such a pair: a runtime that runs Transpose as a copy (onnxruntime) saves
    the copy, and the gradient comes out contiguous."""
    uses: dict[str, int] = {}
    for n in nodes:
        for i in node_reads(n):
            uses[i] = uses.get(i, 0) + 1
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    replace: dict[int, onnx.NodeProto] = {}
    drop: set[int] = set()
    for k, t in enumerate(nodes):
        if t.op_type != "Transpose" or t.domain not in DEFAULT_DOMAINS:
            continue
        perm = next((list(a.ints) for a in t.attribute if a.name == "perm"), None)
        x = t.input[0]
        j = producer.get(x)
        if perm != [1, 0] or j is None or j in replace or uses.get(x) != 1 or x in outputs:
            continue
        gm = nodes[j]
        if gm.op_type != "Gemm" or gm.domain not in DEFAULT_DOMAINS or (len(gm.input) > 2 and gm.input[2]):
            continue
        at = {a.name: attribute_value(a) for a in gm.attribute}
        alpha = float(at.get("alpha", 1.0))
        extra = {} if alpha == 1.0 else {"alpha": alpha}
        replace[j] = helper.make_node(
            "Gemm", [gm.input[1], gm.input[0]], [t.output[0]], name=gm.name,
            transA=1 - int(at.get("transB", 0)), transB=1 - int(at.get("transA", 0)), **extra,
        )
        drop.add(k)
    return [replace.get(k, n) for k, n in enumerate(nodes) if k not in drop]


def _live_nodes(nodes: list[onnx.NodeProto], outputs: Iterable[str]) -> list[onnx.NodeProto]:
    """Drop nodes none of whose outputs is needed (dead code), keeping the order."""
    needed = set(outputs)
    keep: list[onnx.NodeProto] = []
    needed.discard("")  # (an omitted output is never needed)
    for n in reversed(nodes):
        if not needed.isdisjoint(n.output):
            keep.append(n)
            needed.update(node_reads(n))
    keep.reverse()
    return keep

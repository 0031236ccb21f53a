"""Helpers to emit ONNX nodes with unique names: a small graph writer shared by all passes."""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.conv_shapes import declared_outputs, refined_conv_transposes
from onnxtrain.ir.graphs import (
    DEFAULT_DOMAINS,
    fed_initializers,
    in_topological_order,
    mis_sized_initializer,
    misdefined_name,
    text_value_names,
    walk_graphs,
)
from onnxtrain.ir.reshapes import refined_reshapes
from onnxtrain.ir.same_shapes import refined_same_shapes
from onnxtrain.ir.shape_values import ShapeValues
from onnxtrain.ir.slices import refined_slices
from onnxtrain.ir.types import np_dtype, shown_dims
from onnxtrain.ir.types import symbolic_shape as symbolic_shape  # re-exported for its callers
from onnxtrain.user_warning import warn

FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16})
HALF_TYPES = (TensorProto.FLOAT16, TensorProto.BFLOAT16)  # the 16-bit floats
# the float8 and float4 types: floats whose values torch's autograd differentiates through (x.to(float8)),
# though ONNX defines only casts, copies and reshapes on them (no arithmetic)
LOW_FLOAT_TYPES = frozenset(
    getattr(TensorProto, n) for n in ("FLOAT8E4M3FN", "FLOAT8E4M3FNUZ", "FLOAT8E5M2", "FLOAT8E5M2FNUZ",
                                      "FLOAT4E2M1", "FLOAT8E8M0") if hasattr(TensorProto, n)
)


# ---- the cyclic garbage collector during a build -------------------------------------------------------
_GC_LOCK = threading.Lock()
_gc_builds: dict[int, int] = {}  # builds under way that paused the collector, by thread
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off while a large graph or plan is built, on again (if it was) when the
    last build under way ends: a build allocates containers by the hundred thousand and keeps nearly all of
    them, and each full collection walked them all again (nine of them, ~1 s of a 4 s build of a 34k-node
    training graph). Its cyclic garbage is collected as it ends, by one collection of the youngest objects
    (all that the build made and kept: no collection moved them on).

    Ctrl-C (or any exception a signal handler raises) at any point leaves the collector as the caller had it:
    the count is set back to what it was before (not decremented), and setting it back is retried when a
    signal cuts it, the exception raised afterwards. A cut there left the collector off for good."""
    me = threading.get_ident()
    depth = _gc_builds.get(me, 0)  # this thread's builds under way around this one
    try:
        _pause_gc(me, depth)
        yield
    finally:
        pending: BaseException | None = None
        tries = 0
        while True:  # (no call before the try: a signal's exception can only land inside it)
            try:
                if _resume_gc(me, depth):
                    gc.collect(0)
                break
            except BaseException as e:  # a signal handler's: the count is set again, then it is raised
                pending = e
                tries += 1
                if tries > 100:
                    raise
        if pending is not None:
            raise pending


def _pause_gc(me: int, depth: int) -> None:
    """Record one more build on thread ``me`` (``depth`` before it) and turn the collector off if it is the
    first build under way. The record and the collector's state before it are stored with no call in
    between (where a signal handler could run)."""
    global _gc_was_enabled
    enabled = gc.isenabled()
    with _GC_LOCK:
        first = not _gc_builds
        if first:
            _gc_was_enabled = enabled
        _gc_builds[me] = depth + 1
    if first:
        gc.disable()


def _resume_gc(me: int, depth: int) -> bool:
    """Set thread ``me``'s count of builds back to ``depth``; when that ends the last build under way, turn
    the collector on again if it was on before the first. True when it was turned on (once: a second call
    finds the count set back and does nothing)."""
    with _GC_LOCK:
        if _gc_builds.get(me, 0) <= depth:  # set back already (or never recorded)
            return False
        if depth:
            _gc_builds[me] = depth
        else:
            del _gc_builds[me]
        if _gc_builds or not _gc_was_enabled:
            return False
        gc.enable()
    return True


def _gc_after_fork_in_child() -> None:
    """A child forked while other threads were building: their builds will never end there, so only the
    forking thread's count stays, and the collector comes back now if that leaves none (a new lock too:
    the old one may have been held by a thread the child does not have)."""
    global _GC_LOCK
    _GC_LOCK = threading.Lock()
    me = threading.get_ident()
    paused = bool(_gc_builds)  # (else the collector is as the program left it: nothing to give back)
    mine = _gc_builds.get(me, 0)
    _gc_builds.clear()
    if mine:
        _gc_builds[me] = mine
    elif paused and _gc_was_enabled:
        gc.enable()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_gc_after_fork_in_child)


def pausing_gc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run under :func:`gc_paused`."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with gc_paused():
            return fn(*args, **kwargs)

    return run


class NameGen:
    """Unique value and node names within one graph."""

    def __init__(self, taken: Iterable[str] = ()):
        self.taken: set[str] = set(taken)  # (names are only ever added, here or by the callers)
        self._next: dict[str, int] = {}  # base → the suffix to try first: those below it are taken

    def __call__(self, base: str) -> str:
        """``base``, or ``base_<i>`` for the smallest i whose name is free (probing from where the last name
        of ``base`` was found: from 1 each time, a graph of n names of one base took n² probes)."""
        base = base or "v"
        if base not in self.taken:
            self.taken.add(base)
            return base
        i = self._next.get(base, 1)
        while f"{base}_{i}" in self.taken:
            i += 1
        name = f"{base}_{i}"
        self.taken.add(name)
        self._next[base] = i + 1
        return name

    @classmethod
    def for_model(cls, model: onnx.ModelProto) -> NameGen:
        """The names of ``model``, those inside control-flow bodies included (a body may not define a
        name its graph defines)."""
        names: set[str] = set()
        for g in walk_graphs(model.graph):
            names |= {v.name for v in (*g.input, *g.output, *g.value_info)} | {t.name for t in g.initializer}
            for n in g.node:
                names.update(n.input)
                names.update(n.output)
                names.add(n.name)
        return cls(names)


class NodeWriter:
    """Appends nodes to a list, naming their outputs uniquely under a prefix."""

    def __init__(
        self,
        names: NameGen,
        nodes: list[onnx.NodeProto],
        prefix: str = "",
        const_cache: dict[tuple, str] | None = None,
    ):
        self.names = names
        self.nodes = nodes
        self.prefix = prefix
        self.const_cache = const_cache if const_cache is not None else {}  # one Constant per distinct value

    def emit(
        self,
        op: str,
        inputs: Sequence[str | None],
        outputs: int | Sequence[str] = 1,
        name: str | None = None,
        **attrs: Any,
    ) -> list[str]:
        """Append one node; returns its output names."""
        if isinstance(outputs, int):
            outputs = [self.names(f"{self.prefix}{op}_out") for _ in range(outputs)]
        node_name = self.names(name or f"{self.prefix}{op}")
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.nodes.append(
            helper.make_node(op, [i or "" for i in inputs], list(outputs), name=node_name, **attrs)
        )
        return list(outputs)

    def one(self, op: str, *inputs: str | None, **attrs: Any) -> str:
        return self.emit(op, inputs, 1, **attrs)[0]

    def const(self, value: Any, elem_type: int = TensorProto.FLOAT, base: str = "const") -> str:
        """A Constant node holding ``value`` as a tensor of ``elem_type``."""
        arr = np.asarray(value, dtype=np_dtype(elem_type))
        key = (elem_type, arr.shape, arr.tobytes())
        if key in self.const_cache:
            return self.const_cache[key]
        out = self.names(f"{self.prefix}{base}")
        self.const_cache[key] = out
        tensor = numpy_helper.from_array(arr, name=out)
        self.nodes.append(
            helper.make_node("Constant", [], [out], name=self.names(f"{self.prefix}Constant"), value=tensor)
        )
        return out

    def ints(self, values: Sequence[int], base: str = "ints") -> str:
        """A 1-D int64 Constant."""
        return self.const(np.asarray(list(values), dtype=np.int64), TensorProto.INT64, base)


def with_nodes_replaced(
    model: onnx.ModelProto, found: Collection[int],
    replace: Callable[[int, onnx.NodeProto, NameGen, onnx.ModelProto], list[onnx.NodeProto]],
) -> onnx.ModelProto:
    """A copy of ``model`` in which each node whose index ``k`` is in ``found`` is replaced by the nodes
    ``replace(k, node, names, copy)`` returns (new names from ``names``; it may add initializers to the
    copy)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    nodes: list[onnx.NodeProto] = []
    for k, n in enumerate(out.graph.node):
        nodes.extend(replace(k, n, names, out) if k in found else [n])
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def model_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    return 0


# domains onnxruntime registers at version 1 only (its contrib, NCHWc, experimental, training and ATen ops):
# it refuses a model importing more
_OTHER_DOMAIN_NEWEST = {"com.microsoft": 1, "com.microsoft.nchwc": 1, "com.microsoft.experimental": 1,
                        "ai.onnx.training": 1, "org.pytorch.aten": 1}


@functools.cache
def _newest_versions() -> dict[str, int]:
    """The newest opset version of each domain the installed onnx has schemas for, and onnxruntime's own."""
    newest: dict[str, int] = dict(_OTHER_DOMAIN_NEWEST)
    for schema in onnx.defs.get_all_schemas_with_history():
        if schema.domain not in DEFAULT_DOMAINS:
            newest[schema.domain] = max(newest.get(schema.domain, 0), schema.since_version)
    return newest


def unknown_versions(model: onnx.ModelProto) -> str | None:
    """What of ``model``'s IR version and opsets the installed onnx (or onnxruntime, for its own domains)
    does not know (None: all known): its converter and checker cannot handle them, and its version tables
    stamp IR versions too old for them. Domains neither knows are not checked."""
    if model.ir_version > onnx.IR_VERSION:
        return (f"IR version {model.ir_version}, newer than the installed onnx {onnx.__version__} knows "
                f"({onnx.IR_VERSION})")
    newest = onnx.defs.onnx_opset_version()
    if model_opset(model) > newest:
        return (f"opset {model_opset(model)} is newer than the installed onnx {onnx.__version__} knows "
                f"({newest}); re-export it at opset {newest} or older")
    others = _newest_versions()
    for o in model.opset_import:
        top = others.get(o.domain)
        if top is not None and o.version > top:
            return (f"opset {o.version} of domain {o.domain!r} is newer than the installed onnx "
                    f"{onnx.__version__} knows ({top})" if o.domain not in _OTHER_DOMAIN_NEWEST else
                    f"opset {o.version} of domain {o.domain!r} is not one onnxruntime knows (it has {top})")
    return None


def loadable_model(model: onnx.ModelProto, where: str = "", text_names: bool = True) -> onnx.ModelProto:
    """``model`` as the sessions and builders take it: its nodes in topological order
    (:func:`~onnxtrain.ir.graphs.in_topological_order`, as onnxruntime sorts them; a copy when they were
    not) and, with ``text_names`` (the training graphs make names from the model's), its value names that
    are not valid UTF-8 decoded (:func:`~onnxtrain.ir.graphs.text_value_names`). Raises onnxruntime's
    ``Fail`` (its message after ``where``) for a model of versions :func:`unknown_versions` finds, or one
    that :func:`misdefined_name` or :func:`mis_sized_initializer` finds (onnxruntime refuses a name defined
    twice, a cycle or a short initializer at load)."""
    from onnxtrain.errors import Fail

    newer = unknown_versions(model)
    if newer is not None:
        raise Fail(f"{where}the model's {newer}")
    if text_names:
        try:
            model = text_value_names(model)
        except ValueError as e:
            raise Fail(f"{where}{e}") from None
    model = in_topological_order(model)
    wrong = misdefined_name(model.graph) or mis_sized_initializer(model.graph)
    if wrong is not None:
        raise Fail(f"{where}{wrong}")
    return model


_DATA_KEPT = 1024  # initializers of at most this many elements keep their values for shape inference


def _inputs_output_as_declared(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose graph outputs that are graph inputs too take the input's declared type: ONNX
    inference lets an output declared without a shape hide the input's (a rank-0 input then lost its rank,
    and every value after it)."""
    g = model.graph
    inputs = {v.name: v for v in g.input}
    hidden = [k for k, o in enumerate(g.output) if o.name in inputs and o.type != inputs[o.name].type]
    if not hidden:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for k in hidden:
        m.graph.output[k].type.CopyFrom(inputs[m.graph.output[k].name].type)
    return m


def _skeleton(model: onnx.ModelProto, with_value_info: bool = True) -> onnx.ModelProto:
    """``model`` without the values of its large float initializers (graph inputs of the same type instead):
    the same shapes for ONNX shape inference, whose data propagation only reads small integer tensors, for
    a fraction of the memory (inference copies the whole model, and on a 0.67 M-parameter MLP the copies
    left about 10 MiB of resident memory behind). The initializers a run may feed (:func:`fed_initializers`)
    are left to their input declarations: a fed Reshape shape must not make its output's dims static.
    Without ``with_value_info``, the intermediate values' declared types (``value_info``) are left out too."""
    src = model.graph
    big = [t for t in src.initializer
           if t.data_type in FLOAT_TYPES and int(np.prod(t.dims, dtype=np.int64)) > _DATA_KEPT]
    fed = fed_initializers(model)
    if not big and not fed and (with_value_info or not src.value_info):
        return model
    skip = {t.name for t in big} | fed
    declared = {v.name for v in src.input}
    m = onnx.ModelProto()
    m.ir_version, m.producer_name = model.ir_version, model.producer_name
    m.opset_import.extend(model.opset_import)
    m.functions.extend(model.functions)
    g = m.graph
    g.name = src.name
    g.node.extend(src.node)
    g.input.extend(v for v in src.input)
    g.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                   for t in big if t.name not in declared)
    g.output.extend(src.output)
    if with_value_info:
        g.value_info.extend(src.value_info)
    g.initializer.extend(t for t in src.initializer if t.name not in skip)
    g.sparse_initializer.extend(src.sparse_initializer)
    return m


_QUIET: ContextVar[bool] = ContextVar("onnxtrain_quiet_types", default=False)


def quiet_value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """:func:`value_types` without its warning about wrongly declared ranks (for a reader that only looks,
    such as the batch split's screen: the model's user is told when the model is built)."""
    token = _QUIET.set(True)
    try:
        return value_types(model)
    finally:
        _QUIET.reset(token)


def value_types(model: onnx.ModelProto, declared: bool = True) -> dict[str, onnx.TypeProto]:
    """Type (element type and shape where known) of every value, from ONNX shape inference, with more
    rounds where the dims of a Slice or a Reshape can be read before a run though inference lost them
    (:mod:`onnxtrain.ir.slices`, :mod:`onnxtrain.ir.reshapes`), or where inference has a ConvTranspose's
    output dims wrong (:mod:`onnxtrain.ir.conv_shapes`: those rounds carry the kernel's dims to the values
    after it). Without ``declared``, the model's declared types of intermediate values (``value_info``,
    which may be stale: dims no run has) are not read, only inferred ones."""
    skeleton = _inputs_output_as_declared(_skeleton(model, declared))
    if declared:
        skeleton = _reconciled(skeleton)
    types = _inferred_types(model, skeleton, model)
    assert types is not None  # a fallback was given
    known: dict[str, onnx.ValueInfoProto] = {}
    produced = {n.output[0] for n in model.graph.node
                if n.op_type == "ConvTranspose" and n.domain in DEFAULT_DOMAINS and n.output}
    for _ in range(_SLICE_ROUNDS):  # a value computed from one learnt learns its dims in the next round
        refined = [v for v in _refined(model, types) if v.name not in known or known[v.name] != v]
        if not refined:
            break
        known.update((v.name, v) for v in refined)
        again = onnx.ModelProto()
        again.CopyFrom(skeleton)
        added: list[str] = []
        if any(k in produced for k in known):
            # a ConvTranspose output inference has wrong: declared as a graph input's Identity, which the
            # next round cannot contradict
            again, added = declared_outputs(again, [v for k, v in known.items() if k in produced],
                                            NameGen.for_model(again))
        kept = [v for v in again.graph.value_info if v.name not in known]
        del again.graph.value_info[:]
        again.graph.value_info.extend([*kept, *(v for k, v in known.items() if k not in produced)])
        before = types
        types = _inferred_types(model, again, None)
        if types is None:  # the refined round failed: keep what the rounds before gave
            before.update((k, v.type) for k, v in known.items() if k in produced)
            return before
        for name in added:
            del types[name]
    return types


_SLICE_ROUNDS = 4


def _refined(model: onnx.ModelProto, types: dict[str, onnx.TypeProto]) -> list[onnx.ValueInfoProto]:
    """The Slice and Reshape outputs' dims learnt from the shape values ``types`` lets read, the
    ConvTranspose outputs' dims where inference's differ from the kernel's, and the types of the outputs
    inference leaves unknown though they are their input's (GroupNormalization)."""
    opset = model_opset(model)
    values = ShapeValues(model, types, opset, fed_initializers(model))
    return [*refined_slices(model, types, opset, values), *refined_reshapes(model, types, values),
            *refined_conv_transposes(model, types), *refined_same_shapes(model, types)]


# ONNX's data propagation treats a 1-D value of any type as shape data: an elementwise node over 500,000
# values held 76 MiB while inferred, and an optimizer's flat update graph over 524,288 (a dozen such nodes)
# 600 MiB
_DATA_PROP_MAX = 1 << 16


def _propagates(model: onnx.ModelProto) -> bool:
    """Whether shape inference should propagate values: unless a graph input or declared value is 1-D with
    :data:`_DATA_PROP_MAX` elements or more and no graph has a Shape or Size node (whose values are what
    propagation is for: a flat optimizer update's graph)."""
    g = model.graph
    large = any(
        len(dims) == 1 and dims[0].HasField("dim_value") and dims[0].dim_value >= _DATA_PROP_MAX
        for v in (*g.input, *g.value_info)
        if v.type.HasField("tensor_type")
        for dims in [v.type.tensor_type.shape.dim]
    )
    if not large:
        return True
    return any(n.op_type in ("Shape", "Size") for sub in walk_graphs(g) for n in sub.node)


def _for_inference(model: onnx.ModelProto) -> tuple[onnx.ModelProto, bool]:
    """``model`` as shape inference should see it, and whether it should propagate values. Without
    propagation, the small integer values computed from constants alone (a Reshape's target as a Concat or a
    Mul of Constants) are given as Constants, whose values inference reads: else the dims of a Reshape that
    is a graph output, an Expand, a ConstantOfShape or a Resize with such a target were unknown (and the
    autodiff wrote an Expand's gradient with its axes found at run time)."""
    if _propagates(model):
        return model, True
    return _constants_folded(model), False


def _constants_folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose main graph's nodes that compute a small integer value from constants
    (:meth:`ShapeValues.value`, without ``Shape``: no dims are read) are Constants of that value."""
    g = model.graph
    values = ShapeValues(model, {}, model_opset(model), fed_initializers(model))
    folded: dict[int, np.ndarray] = {}
    for k, n in enumerate(g.node):
        if (n.op_type not in ("Constant", "Shape", "Size") and n.domain in DEFAULT_DOMAINS
                and len(n.output) == 1 and n.output[0]):
            value = values.value(n.output[0])  # (in the element type the run gives it)
            if value is not None:
                folded[k] = value
    if not folded:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)  # (a skeleton: its large float values are inputs)
    for k, value in folded.items():
        n = m.graph.node[k]
        n.CopyFrom(helper.make_node("Constant", [], [n.output[0]], name=n.name,
                                    value=numpy_helper.from_array(value, f"{n.output[0]}_folded")))
    return m


def _inferred_types(model: onnx.ModelProto, skeleton: onnx.ModelProto,
                    fallback: onnx.ModelProto | None) -> dict[str, onnx.TypeProto] | None:
    """The types inference gives ``skeleton`` (``model``'s initializers and constants included); where it
    fails, those ``fallback``'s value infos declare, or None without a fallback."""
    skeleton, prop = _for_inference(skeleton)
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=True, data_prop=prop)
    except Exception:  # an op inference cannot type, or a declared shape its producer contradicts
        try:
            inferred = onnx.shape_inference.infer_shapes(skeleton, strict_mode=False, data_prop=prop)
        except Exception:
            if fallback is None:
                return None
            inferred = fallback
    g = inferred.graph
    types: dict[str, onnx.TypeProto] = {}
    for v in (*g.value_info, *g.input, *g.output):
        types[v.name] = v.type
    fed = fed_initializers(model)  # typed by their input declarations
    for t in model.graph.initializer:
        if t.name not in fed:
            types[t.name] = helper.make_tensor_type_proto(t.data_type, list(t.dims))
    for n in g.node:
        if n.op_type == "Constant":
            for a in n.attribute:
                if a.name == "value":
                    types.setdefault(
                        n.output[0], helper.make_tensor_type_proto(a.t.data_type, list(a.t.dims))
                    )
    return types


def _reconciled(skeleton: onnx.ModelProto) -> onnx.ModelProto:
    """``skeleton`` with its declared types of intermediate values and outputs (``value_info``, which may
    be stale) reconciled with those inference gives from the graph's inputs alone: a declared element type,
    rank or static dim that contradicts the computed one takes the computed type or dim (with a warning naming
    them: lenient inference keeps such an exporter's mistake, which onnx.checker refuses), and a static dim
    where the computed one is symbolic takes the symbol (a declaration recorded at one batch size is no
    other's); a declaration is kept where inference knows nothing. A gradient built on a stale dim (a mean's
    count, a broadcast's axes) is wrong without an error."""
    g = skeleton.graph
    if not g.value_info and not any(_shape_of(o.type) is not None for o in g.output):
        return skeleton
    bare = onnx.ModelProto()
    bare.CopyFrom(skeleton)  # (small: a skeleton holds no large values)
    del bare.graph.value_info[:]
    for o in bare.graph.output:  # inference fills a graph output's type and shape anew
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
            o.type.tensor_type.elem_type = 0
    try:
        inferred, prop = _for_inference(bare)
        computed = onnx.shape_inference.infer_shapes(inferred, strict_mode=False, data_prop=prop).graph
    except Exception:
        return skeleton
    fresh = {v.name: v.type for v in (*computed.value_info, *computed.output)
             if _shape_of(v.type) is not None or _elem_of(v.type)}
    symbols = {d.dim_param for v in g.input if (sh := _shape_of(v.type)) is not None for d in sh.dim
               if d.HasField("dim_param")}  # (inference names the dims it does not know unk__<k>)
    # ONNX's inference has some ConvTranspose outputs wrong (see ir.conv_shapes, whose rounds correct them
    # later): the declarations of the values from a ConvTranspose on are kept as they are
    for name in _after_conv_transposes(g):
        fresh.pop(name, None)
    wrong: list[str] = []
    bare.graph.value_info.extend(_reconcile(v, fresh.get(v.name), symbols, wrong) for v in g.value_info)
    for k, o in enumerate(g.output):
        bare.graph.output[k].CopyFrom(_reconcile(o, fresh.get(o.name), symbols, wrong))
    if wrong and not _QUIET.get():
        warn(f"the model declares value(s) with a rank or dims (or element type) their producers do not "
             f"compute: {wrong}; the computed types are used (an exporter's mistake: "
             "onnx.checker.check_model(full_check=True) refuses the model)")
    return bare


def _after_conv_transposes(g: onnx.GraphProto) -> set[str]:
    """The values of ``g`` a ConvTranspose makes, and those computed from them (``g``'s nodes are sorted)."""
    after: set[str] = set()
    for n in g.node:
        if (n.op_type == "ConvTranspose" and n.domain in DEFAULT_DOMAINS) or any(i in after for i in n.input):
            after.update(o for o in n.output if o)
    return after


def _elem_of(tp: onnx.TypeProto) -> int:
    """A tensor type's element type; 0 (UNDEFINED) for another type or none."""
    return tp.tensor_type.elem_type if tp.HasField("tensor_type") else 0


def _shape_of(tp: onnx.TypeProto) -> onnx.TensorShapeProto | None:
    if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
        return tp.tensor_type.shape
    return None


def _reconcile(v: onnx.ValueInfoProto, computed: onnx.TypeProto | None, symbols: Collection[str],
               wrong: list[str]) -> onnx.ValueInfoProto:
    """``v`` with the computed element type, rank or dims where its declared ones are contradicted or less
    general (see :func:`_reconciled`; ``symbols``: the graph inputs' dim names); contradictions are added to
    ``wrong``."""
    if computed is None:
        return v
    out = v
    elem, made = _elem_of(v.type), _elem_of(computed)
    if elem and made and elem != made:  # (a wrong type made the gradient's constants of that type)
        name_of = TensorProto.DataType.Name
        wrong.append(f"{v.name} ({name_of(elem).lower()}, computed {name_of(made).lower()})")
        out = onnx.ValueInfoProto()
        out.CopyFrom(v)
        out.type.tensor_type.elem_type = made
    declared, shape = _shape_of(v.type), _shape_of(computed)
    if declared is None or shape is None:
        return out
    dims, got = declared.dim, shape.dim
    if out is v:
        out = onnx.ValueInfoProto()
        out.CopyFrom(v)
    if len(dims) != len(got):
        wrong.append(f"{v.name} (rank {len(dims)}, computed {len(got)})")
        out.type.tensor_type.shape.CopyFrom(computed.tensor_type.shape)
        return out
    contradicted = False
    for k, (d, c) in enumerate(zip(dims, got)):
        if c.HasField("dim_value"):
            contradicted |= d.HasField("dim_value") and d.dim_value != c.dim_value
            out.type.tensor_type.shape.dim[k].CopyFrom(c)
        elif c.dim_param in symbols:
            out.type.tensor_type.shape.dim[k].CopyFrom(c)
    if contradicted:
        shown = shown_dims(computed.tensor_type.shape)
        wrong.append(f"{v.name} (dims {shown_dims(declared)}, computed {shown})")
    return out


def elem_type(types: dict[str, onnx.TypeProto], name: str) -> int:
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type"):
        return TensorProto.UNDEFINED
    return tp.tensor_type.elem_type


def static_shape(types: dict[str, onnx.TypeProto], name: str) -> list[int | None] | None:
    """Dims of ``name`` (None for a dynamic dim); None when the rank is unknown."""
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]


def static_kernel(node: onnx.NodeProto, types: dict[str, onnx.TypeProto]) -> list[int] | None:
    """A Conv's, ConvTranspose's or pool's kernel sizes: its ``kernel_shape``, else its weight's (input 1)
    spatial dims in ``types``; None when one of them is not known."""
    stated = next((list(a.ints) for a in node.attribute if a.name == "kernel_shape"), None)
    if stated is not None:
        return stated
    w = static_shape(types, node.input[1]) if len(node.input) > 1 else None
    kernel = w[2:] if w is not None else None
    return kernel if kernel and all(isinstance(k, int) for k in kernel) else None


def replace_attributes(node: onnx.NodeProto, drop: Iterable[str] = (), **values: Any) -> None:
    """``node`` (in place) without the attributes named in ``drop``, with ``values`` set (replacing any of
    those names), appended in their order."""
    gone = {*drop, *values}
    kept = [a for a in node.attribute if a.name not in gone]
    del node.attribute[:]
    node.attribute.extend(kept)
    node.attribute.extend(helper.make_attribute(k, v) for k, v in values.items())


# the ModelProto fields that describe a model (with its graph's name and metadata_props: carry_description)
MODEL_DESCRIPTION = ("producer_name", "producer_version", "doc_string", "domain", "model_version")


def carry_description(base: onnx.ModelProto, m: onnx.ModelProto, own: Collection[str] | None = None) -> None:
    """Give ``m`` the description of ``base``, a model it was made from, as onnxruntime-training keeps the
    user's model's: the :data:`MODEL_DESCRIPTION` fields, the graph's name (when ``base``'s has one: onnx's
    checker wants one) and metadata_props: ``base``'s first, then ``m``'s own keys (those in ``own``; every
    one when None). ``base``'s ``onnxtrain.*`` keys are left out: they describe what onnxtrain made of it
    before (a base that is an eval model of mixed-precision artifacts would make a Module expect a loss
    scale)."""
    for f in MODEL_DESCRIPTION:
        setattr(m, f, getattr(base, f))
    if base.graph.name:
        m.graph.name = base.graph.name
    props = {p.key: p.value for p in base.metadata_props if not p.key.startswith("onnxtrain.")}
    props.update((p.key, p.value) for p in m.metadata_props if own is None or p.key in own)
    helper.set_model_props(m, props)


def make_model(graph: onnx.GraphProto, opset: int, **kw: Any) -> onnx.ModelProto:
    """A model at default-domain ``opset`` with the lowest IR version that opset allows.

    A low IR version keeps the file loadable by older runtimes (onnxruntime rejects IR versions
    newer than it knows, and onnx writes its newest by default).
    """
    opsets = [helper.make_opsetid("", opset)]
    return helper.make_model(
        graph, opset_imports=opsets, ir_version=helper.find_min_ir_version_for(opsets), **kw
    )


def half_widened(elem_type: int) -> int:
    """float32 for a 16-bit float type, else ``elem_type``: the type an optimizer's update computes in (in
    float16 Adam's ε = 1e-8 is 0 and (1 − β)·g² underflows, as onnxruntime's kernels avoid)."""
    return TensorProto.FLOAT if elem_type in HALF_TYPES else elem_type

"""What every backend's plan shares: the engine's errors, reading a model, and a plan's view of its model's
interface (:class:`GraphInterface`: opset, initializers, input and output names, types and shapes).

Kept apart from :mod:`onnxtrain.engine.plan` so that sessions on the onnxruntime backend do not import the
numpy engine (its plan, control flow, kernels and node checks: about 0.5 MiB of Python objects in a
LeNet session).
"""

from __future__ import annotations

import math
import os
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.errors import Fail, InvalidArgument, InvalidGraph, InvalidProtobuf, ModelNotFound, program_hint
from onnxtrain.ir.functions import expand_functions
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, model_graphs, model_nodes
from onnxtrain.ir.large import copy_fields
from onnxtrain.ir.types import np_dtype_of, value_info_shape


class EngineError(Fail):
    """A failure while compiling or running a graph (onnxruntime's ``Fail``, a RuntimeError); the message
    names the node and op."""


class ModelParseError(EngineError, InvalidProtobuf):
    """Bytes or a file that do not parse as an ONNX model (onnxruntime's ``InvalidProtobuf``)."""


class NoGraphError(ModelParseError, InvalidArgument):
    """Empty model bytes or file: onnxruntime's ``InvalidArgument`` ("No graph was found")."""


class MissingOpsetImport(EngineError, InvalidGraph):
    """A model that imports no opset, or a node of a domain the model does not import (onnxruntime's
    ``Fail`` and ``InvalidGraph`` at load)."""


class DuplicateNodeNameError(EngineError):
    """Two nodes of one graph with the same name (onnxruntime's ``Fail`` at load)."""


class UnsupportedOpError(EngineError, NotImplementedError):
    """The graph holds an op that has no kernel (yet)."""


class UnknownOpError(UnsupportedOpError, InvalidGraph):
    """The graph holds an op of ONNX's domains that ONNX does not define (onnxruntime's ``InvalidGraph`` at
    load: "No Op registered")."""


class UndefinedValueError(EngineError, InvalidArgument):
    """A node reads a value that no earlier node, graph input or initializer gives (onnxruntime's
    ``InvalidArgument`` at load)."""


class InitializerError(EngineError, InvalidGraph):
    """An initializer of negative dims, or one that a graph input of the same name declares with another
    element type or static shape (onnxruntime's ``Fail`` at load); the message names the tensor and the
    model."""


class InvalidNodeError(EngineError, InvalidGraph):
    """A node of a standard domain that its ONNX schema does not allow (inputs, outputs or attributes), found
    when the plan is compiled (onnxruntime's ``InvalidGraph`` at load); the message names the node, op,
    opset and what is wrong."""


# node events a plan's profile holds at most (onnxruntime's profiler records up to 1,000,000 a session): a
# run profiled for hours keeps no growing list
MAX_PROFILE_EVENTS = 1_000_000


@dataclass
class ProfileEvent:
    """One span of a profile: a node's kernel (its inputs' and outputs' types and shapes as onnxruntime
    writes them, ``[{"float": [2, 3]}, ...]``, its outputs' bytes and its index in the graph) or a session's
    own span. ``stats``: more of the node's trace arguments under onnxruntime's names (its inputs' bytes as
    ``activation_size`` and ``parameter_size``, the memory in use, the threads that ran it)."""

    name: str
    op: str
    start_ns: int
    dur_ns: int
    shapes: list[Any] = field(default_factory=list)
    cat: str = "Node"  # or "Session": a session's own span (its initialization, a run), as onnxruntime's
    outputs: list[Any] = field(default_factory=list)
    output_bytes: int = 0
    index: int | None = None
    stats: dict[str, Any] = field(default_factory=dict)


# the RunOptions of the run in progress in this context, when the caller gave some: the numpy plans check
# their ``terminate`` between steps (a run without them pays nothing)
RUN_OPTIONS: ContextVar[Any] = ContextVar("onnxtrain_run_options", default=None)


class Terminated(EngineError):
    """A run stopped because its RunOptions' ``terminate`` was set (onnxruntime's ``Fail``)."""


def load_model(model: onnx.ModelProto | str | bytes | os.PathLike,
               external_dir: str | None = None, supplied: Collection[str] = (),
               in_memory: Mapping[str, bytes] | None = None) -> onnx.ModelProto:
    """A ModelProto from a proto, a path or serialized bytes, its local functions (``model.functions``:
    torch's ``export_modules_as_functions``, say) inlined as onnxruntime inlines them; errors name the
    file. Tensors kept in external files are read from ``external_dir`` when given (onnxruntime's
    ``session.model_external_initializers_file_folder_path``), else from beside the model file or, for
    bytes, the working folder; a data file reached through symbolic links must resolve into that folder
    or, for a model file, into the folder of the file the model's own path resolves to (a Hugging Face
    cache: both are links into its blobs), as onnxruntime 1.32 requires. Initializers named in
    ``supplied`` are not read (their values come from elsewhere:
    ``SessionOptions.add_external_initializers``). ``in_memory``: the bytes of data files by their location
    (``SessionOptions.add_external_initializers_from_files_in_memory``), read in place of those files."""
    m = _text_names(_loaded(model, external_dir, supplied, in_memory))
    path = model if isinstance(model, (str, os.PathLike)) else None
    if not isinstance(model, onnx.ModelProto):
        check_model_structure(m, path)
    where = (f"model file {os.fspath(path)}" if path is not None
             else "the model" if isinstance(model, onnx.ModelProto) else "the model bytes")
    check_initializers(m.graph, where)
    return standard_model(m)


def standard_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` as kernels and gradient rules take it: its local functions inlined and its sparse tensors
    dense (as onnxruntime loads a model), and its ceil_mode pools whose window count ONNX's shape inference
    gets wrong given the end pads that make the same windows with a count it agrees with
    (:mod:`onnxtrain.ir.ceil_pools`), so that the static shapes read from inference are the run's; itself
    when none of these applies."""
    from onnxtrain.ir.ceil_pools import ceil_mode_pools
    from onnxtrain.ir.sparse import dense_sparse_tensors

    return ceil_mode_pools(inline_local_functions(dense_sparse_tensors(model)))


def check_model_structure(model: onnx.ModelProto, path: str | os.PathLike | None = None) -> None:
    """Refuse, as onnxruntime does, a model that imports no opset, a node (bodies and local functions'
    included) of a domain neither the model nor a local function imports, and a graph with two nodes of
    one name."""
    where = f"model file {os.fspath(path)}" if path is not None else "the model bytes"
    if not model.opset_import:
        raise MissingOpsetImport(f"{where}: the model imports no opset (opset_import); an ONNX model must "
                                 "import at least one, naming the ONNX version its nodes are written for")
    imported = {o.domain for o in model.opset_import} | {o.domain for f in model.functions
                                                        for o in f.opset_import}
    for n in model_nodes(model):
        if n.domain not in imported and n.domain not in DEFAULT_DOMAINS:
            label = repr(n.name) if n.name else f"writing {list(n.output)}"
            raise MissingOpsetImport(f"{where}: node {label} ({n.domain}.{n.op_type}): the model has no "
                                     f"opset import for domain {n.domain!r}")
    for g in model_graphs(model):
        names = [n.name for n in g.node if n.name]
        if len(set(names)) < len(names):
            twice = sorted({x for x in names if names.count(x) > 1})
            raise DuplicateNodeNameError(f"{where}: graph {g.name!r} has several nodes named {twice[:5]} "
                                         "(node names must be unique in a graph)")


def check_graph_links(model: onnx.ModelProto) -> None:
    """Raise, as onnxruntime's load does, for the first node of ``model``'s main graph that reads a value
    no graph input, initializer or earlier node gives (:class:`UndefinedValueError`) or whose op ONNX's
    domains do not define (:class:`UnknownOpError`). Bodies are left to the plans (they read the values
    around them)."""
    g = model.graph
    known = {v.name for v in g.input} | {t.name for t in g.initializer} | {""}
    for k, node in enumerate(g.node):
        label = f"node {node_label(node, k)} ({op_name(node)})"
        domain = ONNX_DOMAINS.get(node.domain)
        if domain is not None and not onnx.defs.has(node.op_type, domain):
            raise UnknownOpError(f"{label}: ONNX defines no op {node.op_type!r} in domain "
                                 f"{node.domain or 'ai.onnx'!r} (no op registered under that name)")
        for name in node.input:
            if name not in known:
                raise UndefinedValueError(f"{label}: input {name!r} is not produced by any earlier node, "
                                          "graph input or initializer")
        known.update(node.output)


# the domains whose nodes are checked against ONNX's schemas ("" for ONNX's own under either name)
ONNX_DOMAINS = {"": "", "ai.onnx": "", "ai.onnx.ml": "ai.onnx.ml"}


def node_label(node: onnx.NodeProto, k: int) -> str:
    """A node as errors name it: its name, or its index ``k`` when it has none."""
    return repr(node.name) if node.name else f"#{k} (unnamed)"


def op_name(node: onnx.NodeProto) -> str:
    """A node's op, with its domain when not ONNX's."""
    return f"{node.domain}.{node.op_type}" if node.domain else node.op_type


def _text_names(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model``, or a copy whose node names that are not valid UTF-8 (protobuf gives them as bytes) are
    decoded with backslash escapes: they only label nodes, and onnxruntime runs such models."""
    if not any(type(n.name) is bytes for n in model_nodes(model)):
        return model
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for n in model_nodes(copy):
        if type(n.name) is bytes:
            n.name = n.name.decode("utf-8", errors="backslashreplace")
    return copy


def _external_tensors(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    """The tensors of ``model`` kept in external files: initializers and tensor attributes (Constant values),
    of the graph, its bodies and its local functions, as onnx's loader finds them."""
    found = [t for g in model_graphs(model) for t in g.initializer]
    for a in (a for n in model_nodes(model) for a in n.attribute):
        found += [a.t] if a.type == onnx.AttributeProto.TENSOR else list(a.tensors)
    return [t for t in found if t.data_location == onnx.TensorProto.EXTERNAL]


def _read_external(model: onnx.ModelProto, folder: str, what: str, supplied: Collection[str] = (),
                   roots: Sequence[str] = (), in_memory: Mapping[str, bytes] | None = None) -> None:
    """Read the external tensors of ``model`` from ``folder`` into the model (in place), but for the graph's
    initializers named in ``supplied``. A location must be relative and stay in the folder ("..",
    absolute: refused), and the file it names, its symbolic links resolved, must lie under one of the real
    folders ``roots`` (default: the folder's own); each span is checked against the file's size before it
    is read. A location named in ``in_memory`` is read from those bytes instead of a file."""
    for t in model.graph.initializer:
        if t.name in supplied and t.data_location == onnx.TensorProto.EXTERNAL:  # no data until replaced
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
    allowed = list(roots) or [os.path.realpath(folder)]
    for t in _external_tensors(model):
        location, offset, length = _external_entries(t, what)
        held = in_memory.get(os.path.normpath(location)) if in_memory else None
        if held is not None:
            t.raw_data = _memory_span(t, location, held, offset, length, what)
        else:
            path = _data_path(t, location, folder, allowed, what)
            t.raw_data = _read_span(t, path, offset, length, what)
        t.data_location = onnx.TensorProto.DEFAULT
        del t.external_data[:]


def _external_entries(t: onnx.TensorProto, what: str) -> tuple[str, int, int | None]:
    """An external tensor's ``location``, ``offset`` (0 when not given) and ``length`` (None when not
    given), checked: a location without NUL bytes, offsets and lengths that are whole numbers >= 0."""
    info = {e.key: e.value for e in t.external_data}
    location = info.get("location", "")
    if "\0" in location:
        raise ModelParseError(f"{what}: tensor {t.name!r} has its data at {location!r}, a location holding "
                              "a NUL byte")
    offset = _entry_number(t, info, "offset", what)
    return location, 0 if offset is None else offset, _entry_number(t, info, "length", what)


def _entry_number(t: onnx.TensorProto, info: Mapping[str, str], key: str, what: str) -> int | None:
    """The whole number >= 0 of an external tensor's entry ``key``, None when it has none."""
    text = info.get(key)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ModelParseError(f"{what}: tensor {t.name!r} (data at {info.get('location', '')!r}) has "
                              f"{key} {text!r}, not a whole number >= 0")
    return value


def _data_path(t: onnx.TensorProto, location: str, folder: str, allowed: Sequence[str], what: str) -> str:
    """The real path of the file holding ``t``'s data: ``location`` in ``folder``, its symbolic links
    resolved, refused when outside every folder of ``allowed``."""
    if not location:
        raise ModelParseError(f"{what}: tensor {t.name!r} is kept in an external file but has no location")
    rel = os.path.normpath(location)
    if os.path.isabs(rel) or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ModelParseError(f"External data path validation failed: {what}: tensor {t.name!r} has its "
                              f"data at {location!r}, outside the folder {folder}")
    real = os.path.realpath(os.path.join(folder, rel))
    if not any(_within(real, root) for root in allowed):
        raise ModelParseError(f"External data path validation failed: {what}: tensor {t.name!r} has its "
                              f"data at {location!r}, which resolves "
                              f"through symbolic links to {real}, outside the model's folder "
                              f"{' and '.join(dict.fromkeys(allowed))} (refused, as onnxruntime refuses "
                              "an external data path that escapes the model directory)")
    return real


def _within(path: str, folder: str) -> bool:
    """Whether the real path ``path`` is ``folder`` (a real path) or lies under it."""
    try:
        return os.path.commonpath([path, folder]) == folder
    except ValueError:  # (Windows: another drive)
        return False


def _read_span(t: onnx.TensorProto, path: str, offset: int, length: int | None, what: str) -> bytes:
    """The bytes of ``t``'s data in the regular file ``path`` from ``offset``: ``length`` of them, else
    those its shape takes (strings: the rest of the file); refused, before anything is read, when the file
    holds fewer."""
    try:
        info = os.stat(path)
    except OSError as e:
        raise ModelParseError(f"{what}: could not read the data of tensor {t.name!r} from {path}: {e}") \
            from None
    size = info.st_size
    if not stat.S_ISREG(info.st_mode):
        raise ModelParseError(f"{what}: the data of tensor {t.name!r} is at {path}, not a regular file")
    wanted = _span_size(t, length, offset, size, path, what)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "rb") as f:
            f.seek(offset)
            data = f.read(wanted)
    except OSError as e:
        raise ModelParseError(f"{what}: could not read the data of tensor {t.name!r} from {path}: {e}") \
            from None
    if len(data) != wanted:  # (the file changed since)
        raise ModelParseError(f"{what}: tensor {t.name!r} takes {wanted} bytes from {path} at offset "
                              f"{offset}, the file holds {len(data)} there")
    return data


def _memory_span(t: onnx.TensorProto, location: str, data: bytes, offset: int, length: int | None,
                 what: str) -> bytes:
    """The bytes of ``t``'s data in the in-memory file ``location`` (``data``) from ``offset``, as
    :func:`_read_span` reads a file's."""
    wanted = _span_size(t, length, offset, len(data), f"the in-memory file {location!r}", what)
    return bytes(data[offset:offset + wanted])


def _span_size(t: onnx.TensorProto, length: int | None, offset: int, size: int, where: str, what: str) -> int:
    """The bytes ``t`` takes from a file of ``size`` bytes (``where``) at ``offset``: ``length``, else those
    its shape takes (strings: the rest of the file); a ModelParseError when the file holds fewer."""
    wanted = _external_size(t, length, what)
    if wanted is None:
        wanted = max(size - offset, 0)
    if offset + wanted > size:
        raise ModelParseError(f"{what}: tensor {t.name!r} takes {wanted} bytes from {where} at offset "
                              f"{offset}, the file holds {max(size - offset, 0)} there")
    return wanted


# elements a byte holds, of the types packed below a byte
_PER_BYTE = {getattr(onnx.TensorProto, n): k for n, k in (("INT4", 2), ("UINT4", 2), ("FLOAT4E2M1", 2),
                                                          ("INT2", 4), ("UINT2", 4))
             if hasattr(onnx.TensorProto, n)}


def _external_size(t: onnx.TensorProto, length: int | None, what: str) -> int | None:
    """The bytes an external tensor's data takes: its ``length`` entry, else its shape's (None: strings)."""
    _check_dims(t, what)
    if length is not None:
        return length
    if t.data_type == onnx.TensorProto.STRING:
        return None
    count = math.prod(t.dims)  # (Python ints: no overflow)
    per_byte = _PER_BYTE.get(t.data_type)
    if per_byte is not None:
        return -(-count // per_byte)
    return count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def _check_dims(t: onnx.TensorProto, what: str) -> None:
    """Refuse tensor ``t`` when a dim of its shape is negative."""
    if any(d < 0 for d in t.dims):
        raise InitializerError(f"{what}: tensor {t.name!r} has negative dims {list(t.dims)} (a tensor's "
                               "dims are sizes, >= 0)")


def check_initializers(graph: onnx.GraphProto, where: str) -> None:
    """Refuse, as onnxruntime does at load, an initializer of ``graph`` with a negative dim, or one whose
    graph input of the same name declares another element type, rank or static dim (a symbolic or unknown
    dim, or no shape, fits any)."""
    inits = {t.name: t for t in graph.initializer}
    for t in graph.initializer:
        _check_dims(t, where)
    for v in graph.input:
        t = inits.get(v.name)
        if t is None or not v.type.HasField("tensor_type"):
            continue
        declared = v.type.tensor_type
        same_type = declared.elem_type in (0, t.data_type)
        if same_type and (not declared.HasField("shape") or _dims_fit(declared.shape, t.dims)):
            continue
        shape = _declared_dims(declared) if declared.HasField("shape") else ""
        raise InitializerError(f"{where}: graph input {v.name!r} is also an initializer and is declared "
                               f"{_type_name(declared.elem_type)}{shape}, where the initializer is "
                               f"{_type_name(t.data_type)}{list(t.dims)} (a value fed for it replaces the "
                               "initializer, so both must agree)")


def _dims_fit(shape: onnx.TensorShapeProto, dims: Sequence[int]) -> bool:
    """Whether a declared shape allows ``dims``: the same rank, and each static dim equal."""
    return len(shape.dim) == len(dims) and all(
        not d.HasField("dim_value") or d.dim_value == n for d, n in zip(shape.dim, dims))


def _declared_dims(declared: onnx.TypeProto.Tensor) -> str:
    """A declared shape as errors write it: ``[N, 4]`` (static dims, symbols, ``?`` for unknown ones)."""
    dims = (str(d.dim_value) if d.HasField("dim_value") else d.dim_param or "?" for d in declared.shape.dim)
    return f"[{', '.join(dims)}]"


def _type_name(code: int) -> str:
    """An ONNX element type by its name (``FLOAT``), or its number when ONNX has none for it."""
    try:
        return onnx.TensorProto.DataType.Name(code)
    except ValueError:
        return str(code)


def inline_local_functions(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with its local functions' calls replaced by their bodies (a copy), or itself without any."""
    if not model.functions:
        return model
    from onnx import inliner

    try:
        model = _with_attribute_defaults(model)
        out = inliner.inline_local_functions(model)
        if _calls_left(out, model):  # a function importing another version of a domain the model imports:
            # inlined converted, which needs the types of the values around the calls
            typed = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            out = inliner.inline_local_functions(typed, convert_version=True)
    except Exception as e:
        raise ModelParseError(f"could not inline the model's local functions "
                              f"{[f.domain + '.' + f.name for f in model.functions]}: {e}") from None
    # the functions' own domains, once no node is of them, leave the opset imports (the graphs built from
    # the model would import a domain none of their nodes uses)
    from onnxtrain.ir.graphs import walk_graphs

    used = {n.domain for g in walk_graphs(out.graph) for n in g.node} | {f.domain for f in out.functions}
    gone = {f.domain for f in model.functions} - used
    if gone:
        kept = [o for o in out.opset_import if o.domain not in gone]
        del out.opset_import[:]
        out.opset_import.extend(kept)
    return out


def _calls_left(out: onnx.ModelProto, model: onnx.ModelProto) -> bool:
    """Whether a node of ``out`` still calls one of ``model``'s local functions."""
    local = {(f.domain, f.name) for f in model.functions}
    return any((n.domain, n.op_type) in local for n in model_nodes(out))


def _with_attribute_defaults(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` whose calls of a local function with attribute defaults (``attribute_proto``) give the
    attributes they leave out (a copy), or itself without such a function: onnx's inliner drops a reference
    to an attribute the call does not give, so the body's op took its own default (LeakyRelu's 0.01 for the
    function's 0.5)."""
    defaults = {(f.domain, f.name, f.overload): f.attribute_proto
                for f in model.functions if f.attribute_proto}
    if not defaults:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in model_nodes(out):  # (nested calls too)
        given = {a.name for a in n.attribute}
        missing = defaults.get((n.domain, n.op_type, n.overload), ())
        n.attribute.extend(a for a in missing if a.name not in given)
    return out


def _loaded(model: onnx.ModelProto | str | bytes | os.PathLike, external_dir: str | None,
            supplied: Collection[str] = (), in_memory: Mapping[str, bytes] | None = None) -> onnx.ModelProto:
    if isinstance(model, onnx.ModelProto):
        return model
    if not isinstance(model, (bytes, bytearray, memoryview, str, os.PathLike)):
        raise TypeError(f"the model must be an onnx.ModelProto, its serialized bytes or a path, got "
                        f"{type(model).__name__}{program_hint(model)}")
    if isinstance(model, (bytes, bytearray, memoryview)):
        try:
            m = onnx.load_from_string(bytes(model))
        except Exception as e:
            raise ModelParseError(f"could not parse the model bytes ({len(model)} bytes): {e}") from None
        if not m.graph.node and not m.graph.output:
            raise NoGraphError(f"the model bytes ({len(model)} bytes) hold no graph")
        if _external_tensors(m):  # from the working directory, as onnxruntime, or the folder given
            where = "the model bytes (give the data's folder as the session config entry " \
                    "session.model_external_initializers_file_folder_path)"
            _read_external(m, external_dir or os.getcwd(), where, supplied, in_memory=in_memory)
        return m
    path = os.fspath(model)
    if not os.path.exists(path):
        raise ModelNotFound(f"model file not found: {path}")
    try:
        m = onnx.load(path, load_external_data=False)
    except Exception as e:
        raise ModelParseError(f"could not load model file {path}: {e}") from None
    if not m.graph.node and not m.graph.output:  # (an empty file parses as an empty model)
        raise NoGraphError(f"model file {path} ({os.path.getsize(path)} bytes) holds no graph")
    if _external_tensors(m):  # read here: onnx's loader refuses data files that are symbolic links
        # from the folder given (onnxruntime 1.32's config entry; 1.19 ignored it for a path), else its own;
        # links must resolve into that folder or, without a folder given, that of the file the model's own
        # path resolves to (a Hugging Face cache), as onnxruntime 1.32 requires
        folder = external_dir or os.path.dirname(os.path.abspath(path))
        roots = [] if external_dir else [os.path.realpath(folder), os.path.dirname(os.path.realpath(path))]
        _read_external(m, folder, f"model file {path}", supplied, roots, in_memory)
    return m


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in DEFAULT_DOMAINS:
            return int(o.version)
    return onnx.defs.onnx_opset_version()


class GraphInterface:
    """What every plan exposes of its model: opset, initializers, input and output names and types."""

    def release_binding(self) -> None:
        """Let go of the arrays a kept binding holds between runs (the next run binds afresh); nothing to
        do on the numpy engine, which holds no array between runs."""

    def drained_profile(self) -> list[ProfileEvent]:
        """Profile events the backend kept outside ``profile`` (onnxruntime's own per-node trace), handed
        over once; none on the numpy engine, whose events are all in ``profile``."""
        return []

    def _lacks_kernel(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` runs as its ONNX function body (its op has no kernel here): never, unless the
        backend says so (the numpy engine's :class:`~onnxtrain.engine.plan.Plan` asks its kernel registry;
        onnxruntime runs such ops itself, a kernel or the body it inlines)."""
        return False

    def _read_interface(self, model: onnx.ModelProto | str | bytes | os.PathLike,
                        initializers: Mapping[str, np.ndarray] | None = None,
                        convert: bool = True, loaded: bool = False) -> onnx.ModelProto:
        """Read the model's interface; ``initializers``: arrays to take for the model's initializers of those
        names instead of converting them (another plan's of the same model). ``convert=False``: the
        initializers are converted only when read (:class:`TensorArrays`: a backend that reads the model's
        own tensors keeps no second copy of its weights). ``loaded``: ``model`` is already what
        :func:`load_model` returned (loading it again gives itself)."""
        if not loaded:  # each load walks every node of the model several times
            model = load_model(model)
        self.opset = default_opset(model)
        model = expand_functions(model, self._lacks_kernel)  # an op without a kernel: its ONNX body
        self._hold_model(model)
        g = model.graph
        given = initializers or {}
        self.initializers: Mapping[str, np.ndarray] = {} if convert else TensorArrays(g)
        for t in g.initializer if convert else ():
            v = given.get(t.name)
            if v is None:
                v = numpy_helper.to_array(t)
                v.setflags(write=False)  # a constant: an output passing it through is the caller's copy
            else:
                dt = helper.tensor_dtype_to_np_dtype(t.data_type)
                if list(v.shape) != list(t.dims) or v.dtype != dt:
                    raise EngineError(f"initializer {t.name!r}: the array given for it is {v.dtype}"
                                      f"{list(v.shape)}, the model's is {dt}{list(t.dims)}")
            self.initializers[t.name] = v
        inits = set(self.initializers)
        self.input_names = [v.name for v in g.input if v.name not in inits]
        self.all_input_names = [v.name for v in g.input]
        self.output_names = [v.name for v in g.output]
        self.input_dtypes = {v.name: np_dtype_of(v.type) for v in g.input}
        self.input_shapes = {v.name: value_info_shape(v.type) for v in g.input}
        self.output_dtypes = {v.name: np_dtype_of(v.type) for v in g.output}
        self.output_shapes = {v.name: value_info_shape(v.type) for v in g.output}
        return model

    def _hold_model(self, model: onnx.ModelProto) -> None:
        """Hold ``model`` (the one read, or a copy of it without its weights' values) and its graph's inputs
        and outputs, and no part of another model: a part of a message keeps all of it alive (protobuf's
        arenas), so inputs kept from the read model kept its weights held after it was replaced."""
        self.model = model
        self.input_info = {v.name: v for v in model.graph.input}
        self.output_info = {v.name: v for v in model.graph.output}


def graph_interface(model: onnx.ModelProto) -> GraphInterface:
    """The inputs' and outputs' names, types and shapes of ``model`` (a plan's interface), not compiled."""
    interface = GraphInterface()
    interface._read_interface(model, convert=False)
    return interface


class TensorArrays(Mapping):
    """A graph's initializers by name, each converted to a read-only array when it is read (not kept)."""

    def __init__(self, graph: onnx.GraphProto):
        self._tensors = {t.name: t for t in graph.initializer}

    def __getitem__(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        if not holds_values(t):  # emptied by without_values: the values are where the graph was handed
            raise EngineError(f"initializer {name!r}: its values are held by onnxruntime only")
        v = numpy_helper.to_array(t)
        v.setflags(write=False)
        return v

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


# initializers of up to this many values keep them in :func:`without_values`' copy (shapes, axes and small
# constants, which plan-time readers such as engine/batch_mixing.py fold, stay readable)
KEPT_VALUES = 4096


def heavy(t: onnx.TensorProto, max_kept: int = KEPT_VALUES) -> bool:
    """Whether :func:`without_values` empties initializer ``t``: numeric, held in the model, of more than
    ``max_kept`` values."""
    try:
        numeric = helper.tensor_dtype_to_np_dtype(t.data_type).kind in "biufc"
    except (KeyError, ValueError):
        return False
    return (numeric and t.data_location != onnx.TensorProto.EXTERNAL
            and int(np.prod(t.dims, dtype=np.int64)) > max_kept)


def heavy_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the values of the initializers of ``model`` that :func:`without_values` empties."""
    total = 0
    for t in model.graph.initializer:
        if heavy(t):
            itemsize = helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
            total += int(np.prod(t.dims, dtype=np.int64)) * itemsize
    return total


def heavy_arrays(model: onnx.ModelProto, given: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``given``, and a read-only array of each other initializer of ``model`` that :func:`without_values`
    empties: what a plan of the emptied copy is given."""
    out = dict(given)
    for t in model.graph.initializer:
        if t.name not in out and heavy(t):
            v = numpy_helper.to_array(t)
            v.setflags(write=False)  # a constant (as GraphInterface's own)
            out[t.name] = v
    return out


def without_values(model: onnx.ModelProto, max_kept: int = KEPT_VALUES,
                   names: Collection[str] | None = None) -> onnx.ModelProto:
    """A copy of ``model`` whose numeric initializers of more than ``max_kept`` values (of those ``names``,
    when given) hold no values (names, types and dims kept), made without copying those values: for a plan
    given the arrays themselves, so that a session does not hold its weights twice. ``model`` itself when none
    is that large. A read of a cleared tensor's values fails (its data is missing) rather than giving other
    values."""
    def cleared(t: onnx.TensorProto) -> bool:
        return heavy(t, max_kept) and (names is None or t.name in names)

    if not any(cleared(t) for t in model.graph.initializer):
        return model
    out = onnx.ModelProto()
    copy_fields(model, out, skip={"graph"})
    copy_fields(model.graph, out.graph, skip={"initializer"})
    for t in model.graph.initializer:
        kept = out.graph.initializer.add()
        if cleared(t):
            copy_fields(t, kept, skip=_TENSOR_VALUES)
        else:
            kept.CopyFrom(t)
    return out


_TENSOR_VALUES = frozenset({"raw_data", "float_data", "int32_data", "int64_data", "double_data",
                            "uint64_data", "string_data"})


def holds_values(t: onnx.TensorProto) -> bool:
    """Whether tensor ``t`` has its values (in the model or in an external file): False for one that
    :func:`without_values` emptied."""
    return (not heavy(t) or t.data_location == onnx.TensorProto.EXTERNAL or t.HasField("raw_data")
            or any(len(getattr(t, f)) for f in _TENSOR_VALUES if f != "raw_data"))


def copied(value: Any) -> Any:
    """A copy of a run's output of any kind: an array, a sequence (a list of arrays), None (an empty
    optional)."""
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, list):
        return [copied(v) for v in value]
    return value


def repeats_copied(keys: Sequence[Any], values: list[Any]) -> list[Any]:
    """``values`` (one per key of ``keys``, an output asked for) with each value whose key came before
    replaced by a copy, so that the caller owns every array it gets (``run(["y", "y"])``)."""
    if len(set(keys)) < len(keys):
        seen: set[Any] = set()
        for k, key in enumerate(keys):
            if key in seen:
                values[k] = copied(values[k])
            seen.add(key)
    return values

"""Values of the small integer tensors an exported graph computes its shapes with, read before a run.

Exporters build the shapes of Reshape, the bounds of Slice and the like from ``Shape`` and a handful of
integer ops; ONNX's shape inference follows some of them (its data propagation) and gives up at others (a
``Mod``, a ``Slice`` end computed at run time). :class:`ShapeValues` reads two kinds of values:

* :meth:`ShapeValues.value`: the whole value, when every entry is known: constants through Unsqueeze,
  Squeeze, Concat, Reshape, Cast, Identity and integer Add, Sub, Mul, Div and Mod, and known dims read
  through ``Shape`` or a ``Gather`` from it;
* :meth:`ShapeValues.dims`: a shape vector entry by entry, each an int, a dim's name ("batch") or None,
  through ``Shape`` (start and end), Gather, Slice and Concat along axis 0, Unsqueeze and Squeeze of a
  single entry, Cast (numbers wrapped as the Cast does) and Identity.

A value has the element type the run gives it: a Gather's value has its data's type (a constant's own,
int64 from ``Shape``, a Cast's target), and the ops computing from it keep that type; a Concat or an
arithmetic op over mixed types (a graph ONNX rejects) has no value.

Only small values are read (at most :data:`MAX_VALUES` entries); dims that ONNX's inference made up names
for ("unk__3") count as unknown.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS, constant_arrays
from onnxtrain.ir.types import np_dtype, symbolic_shape

FRESH = "unk__"  # the prefix of the dim names ONNX shape inference makes up for unknown dims
MAX_VALUES = 64
_ARITHMETIC = ("Add", "Sub", "Mul", "Div", "Mod")
_PLAIN = ("Unsqueeze", "Squeeze", "Concat", "Reshape", "Cast", "Identity", *_ARITHMETIC)
# ops whose output has their first input's element type
_SAME_TYPE = ("Gather", "Slice", "Unsqueeze", "Squeeze", "Concat", "Reshape", "Identity", *_ARITHMETIC)

Dim = int | str | None
_ABSENT = "absent"  # an optional input not given
_INTEGERS = {getattr(onnx.TensorProto, f"{kind}{bits}") for kind in ("INT", "UINT")
             for bits in (8, 16, 32, 64)}


def unknown(d: Dim) -> bool:
    """A dim inference did not know: none, or one of the fresh names it makes up ("unk__3")."""
    return d is None or isinstance(d, str) and d.startswith(FRESH)


class ShapeValues:
    """The values of ``model``'s small integer tensors that can be read before a run (module docstring)."""

    def __init__(self, model: onnx.ModelProto, types: dict[str, onnx.TypeProto], opset: int,
                 fed: Collection[str] = ()):
        """``fed``: initializers whose values a run may replace (not constants)."""
        g = model.graph
        self._made_by = {o: n for n in g.node for o in n.output}
        self._consts = constant_arrays(g, _small_integers(g), fed)
        self._types = types
        self._opset = opset
        self._values: dict[str, np.ndarray | None] = {}
        self._dims: dict[str, tuple[bool, list[Dim]] | None] = {}

    # ---- whole values ----------------------------------------------------------------------------
    def value(self, name: str) -> np.ndarray | None:
        """The integer value of ``name`` when all of it is known, else None."""
        if name in self._values:
            return self._values[name]
        self._values[name] = None  # a cycle (not in a valid graph) stops here
        found = self._consts.get(name)
        node = self._made_by.get(name)
        if found is None and node is not None and node.domain in DEFAULT_DOMAINS:
            if node.op_type in _PLAIN:
                try:
                    found = self._apply(node)
                except (ValueError, IndexError, TypeError):  # shapes that do not fit: a graph not valid
                    found = None
            if found is None and node.op_type in ("Shape", "Gather", "Cast"):
                found = self._known_entries(name)
        if found is not None and (found.size > MAX_VALUES or found.dtype.kind not in "iu"):
            found = None
        self._values[name] = found
        return found

    def _known_entries(self, name: str) -> np.ndarray | None:
        """``name``'s entries as a value of its element type, when all are numbers."""
        entry = self.dims(name)
        if entry is None or not all(isinstance(d, int) for d in entry[1]):
            return None
        dtype = self._dtype(name)
        if dtype is None or dtype.kind not in "iu":
            return None
        try:
            return np.array(entry[1], dtype).reshape(() if entry[0] else (-1,))
        except OverflowError:  # entries the type cannot hold (a graph not valid)
            return None

    def _dtype(self, name: str) -> np.dtype | None:
        """The element type of ``name`` followed back along what :meth:`dims` reads (a constant's own type,
        int64 for Shape, a Cast's target, the first input's for the ops that keep it), else the type
        ``types`` gives; None when neither tells."""
        seen: set[str] = set()
        while name not in seen:
            seen.add(name)
            const = self._consts.get(name)
            if const is not None:
                return const.dtype
            node = self._made_by.get(name)
            if node is None or node.domain not in DEFAULT_DOMAINS or not node.input:
                break
            if node.op_type == "Shape":
                return np.dtype(np.int64)
            if node.op_type == "Cast":
                return _np_type(next((a.i for a in node.attribute if a.name == "to"), 0))
            if node.op_type not in _SAME_TYPE:
                break
            name = node.input[0]
        return self._declared_dtype(name)

    def _declared_dtype(self, name: str) -> np.dtype | None:
        tp = self._types.get(name)
        return _np_type(tp.tensor_type.elem_type) if tp is not None and tp.HasField("tensor_type") else None

    def _apply(self, node: onnx.NodeProto) -> np.ndarray | None:
        args = [self.value(i) if i else None for i in node.input]
        needs_all = node.op_type in ("Concat", "Reshape", *_ARITHMETIC)
        if not args or args[0] is None or (needs_all and any(a is None for a in args)):
            return None
        if node.op_type in ("Concat", *_ARITHMETIC) and any(a.dtype != args[0].dtype for a in args[1:]):
            return None  # mixed types (a graph ONNX rejects): numpy would widen them as no run does
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        x = args[0]
        op = node.op_type
        if op in ("Unsqueeze", "Squeeze"):
            axes = attrs.get("axes") if self._opset < 13 else (
                args[1].tolist() if len(args) > 1 and args[1] is not None else None)
            if op == "Squeeze":
                return np.squeeze(x, axis=tuple(axes)) if axes is not None else np.squeeze(x)
            if axes is None:
                return None
            for a in sorted(int(v) % (x.ndim + len(axes)) for v in axes):
                x = np.expand_dims(x, a)
            return x
        if op == "Concat":
            return np.concatenate(args, axis=attrs.get("axis", 0))  # type: ignore[arg-type]
        if op == "Reshape":
            target = args[1].tolist()  # type: ignore[union-attr]
            if not attrs.get("allowzero", 0):
                target = [int(d) if d != 0 else x.shape[k] for k, d in enumerate(target)]
            return x.reshape(target)
        if op == "Cast":
            to = helper.tensor_dtype_to_np_dtype(attrs["to"])
            return x.astype(to) if np.dtype(to).kind in "iu" else None
        if op in _ARITHMETIC:
            return _arithmetic(op, x, args[1], attrs)  # type: ignore[arg-type]
        return x

    # ---- shape vectors entry by entry ------------------------------------------------------------
    def dims(self, name: str) -> tuple[bool, list[Dim]] | None:
        """``name`` as (is a scalar, its entries), each an int, a dim's name or None; None when not even the
        number of entries is known."""
        if name in self._dims:
            return self._dims[name]
        self._dims[name] = None
        found: tuple[bool, list[Dim]] | None = None
        const = self._consts.get(name)
        node = self._made_by.get(name)
        if const is not None:
            if const.ndim <= 1 and const.dtype.kind in "iu" and const.size <= MAX_VALUES:
                found = const.ndim == 0, [int(v) for v in const.reshape(-1)]
        elif node is not None and node.domain in DEFAULT_DOMAINS:
            found = self._entries(node)
        self._dims[name] = found
        return found

    def _single(self, node: onnx.NodeProto, k: int) -> int | str | None:
        """The one value of ``node``'s input ``k``: :data:`_ABSENT` when not given, None when not known."""
        if len(node.input) <= k or not node.input[k]:
            return _ABSENT
        v = self.value(node.input[k])
        return None if v is None or v.size != 1 else int(v.reshape(-1)[0])

    def _entries(self, node: onnx.NodeProto) -> tuple[bool, list[Dim]] | None:
        op = node.op_type
        if not node.input or not node.input[0]:
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if op == "Shape":
            dims = symbolic_shape(self._types, node.input[0])
            if dims is None:
                return None
            kept = dims[slice(attrs.get("start", 0), attrs.get("end"))]
            return False, [None if unknown(d) else d for d in kept]
        if op == "Identity":
            return self.dims(node.input[0])
        if op == "Cast":
            src = self.dims(node.input[0])
            return None if src is None or "to" not in attrs else (src[0], _cast(src[1], attrs["to"]))
        if op in (*_ARITHMETIC, "Reshape"):
            v = self.value(node.output[0])
            return None if v is None or v.ndim > 1 else (v.ndim == 0, v.reshape(-1).tolist())
        src = self.dims(node.input[0])
        if src is None:
            return None
        scalar, entries = src
        if op == "Gather" and not scalar and attrs.get("axis", 0) in (0, -1):
            at = self.value(node.input[1])
            n = len(entries)
            if at is None or at.ndim > 1 or any(not -n <= int(i) < n for i in at.reshape(-1)):
                return None
            return at.ndim == 0, [entries[int(i)] for i in at.reshape(-1)]
        if op == "Slice" and not scalar and self._opset >= 10:
            start, stop, axis, step = (self._single(node, k) for k in range(1, 5))
            if None in (start, stop, axis, step) or _ABSENT in (start, stop) or axis not in (_ABSENT, 0, -1):
                return None
            step = 1 if step == _ABSENT else step
            return (False, entries[slice(start, stop, step)]) if step != 0 else None
        if op == "Concat" and attrs.get("axis", 0) in (0, -1):
            parts = [self.dims(i) for i in node.input]
            if any(p is None or p[0] for p in parts):
                return None
            return False, [d for p in parts for d in p[1]]  # type: ignore[index]
        if op == "Unsqueeze" and scalar:
            axes = attrs.get("axes") if self._opset < 13 else (
                self.value(node.input[1]) if len(node.input) > 1 and node.input[1] else None)
            return (False, entries) if axes is not None and np.size(axes) == 1 else None
        if op == "Squeeze" and not scalar and len(entries) == 1:
            return True, entries
        return None


def _cast(entries: list[Dim], to: int) -> list[Dim]:
    """Shape entries cast to ONNX type ``to``: numbers as the Cast makes them (wrapped into a narrower
    integer; unknown where a float cannot hold them exactly); a dim's name kept in integers of 32 bits or
    more and in double (taken to hold any real dim), unknown in narrower types; nothing known for a bool."""
    dtype = _np_type(to)
    if dtype is None or dtype.kind not in "iuf":
        return [None] * len(entries)
    out: list[Dim] = []
    for d in entries:
        if isinstance(d, int) and dtype.kind in "iu":
            bits = 8 * dtype.itemsize
            d %= 1 << bits
            out.append(d - (1 << bits) if dtype.kind == "i" and d >> (bits - 1) else d)
        elif isinstance(d, int):  # (every integer up to 2 ** (mantissa bits + 1) is a float's)
            out.append(d if abs(d) <= 1 << (np.finfo(dtype).nmant + 1) else None)
        else:
            out.append(d if dtype.itemsize >= (4 if dtype.kind in "iu" else 8) else None)
    return out


def _np_type(code: int) -> np.dtype | None:
    """The numpy type of ONNX element type ``code``; None for none (0) or one numpy lacks."""
    try:
        return np_dtype(code) if code else None
    except (KeyError, ValueError, TypeError):
        return None


def _small_integers(g: onnx.GraphProto) -> set[str]:
    """Names of the graph's integer initializers and Constants of at most :data:`MAX_VALUES` values (a
    model's weights are never read)."""
    def small(t: onnx.TensorProto) -> bool:
        return t.data_type in _INTEGERS and int(np.prod(t.dims, dtype=np.int64)) <= MAX_VALUES

    names = {t.name for t in g.initializer if small(t)}
    for n in g.node:
        if n.op_type == "Constant" and n.output:
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            if value is not None and small(value):
                names.add(n.output[0])
    return names


def _arithmetic(op: str, a: np.ndarray, b: np.ndarray, attrs: dict) -> np.ndarray | None:
    """ONNX's integer Add, Sub, Mul, Div (truncating) and Mod (the divisor's sign, or C's with fmod)."""
    if a.dtype.kind not in "iu" or b.dtype.kind not in "iu":
        return None
    if op in ("Div", "Mod") and not np.all(b):
        return None
    if op == "Add":
        return a + b
    if op == "Sub":
        return a - b
    if op == "Mul":
        return a * b
    if op == "Div":
        if a.dtype.kind == "i" and np.any((a == np.iinfo(a.dtype).min) & (b == -1)):
            return None  # the one quotient the type cannot hold (undefined in C)
        # a minus its remainder (C's, the dividend's sign) is a multiple of b: floor division is then exact
        # (not through abs: the type's minimum has none)
        return (a - np.fmod(a, b)) // b
    return np.fmod(a, b) if attrs.get("fmod", 0) else np.mod(a, b)

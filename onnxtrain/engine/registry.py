"""Kernel registry: ``@kernel("Relu", since=14)`` maps an ONNX op to a numpy function.

A kernel is a plain function ``fn(inputs, attrs) -> tuple of arrays``. ``inputs`` holds one
entry per node input (``None`` for an omitted optional input); ``attrs`` is an :class:`Attrs`
whose values were parsed once at compile time, with the defaults of the ONNX schema filled in.
Lookup picks the kernel with the highest ``since`` that is not newer than the model's opset.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from onnxtrain.ir.attrs import attribute_value, parse_attributes  # noqa: F401 - re-exported
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

Inputs = Sequence[Any]
Outputs = Sequence[Any]


_MISSING = object()


class NodeCache(dict):
    """A node's memo of what its kernel derives per input shape (geometry, index tables), holding at most
    ``LIMIT`` entries (16 or more shapes): the oldest goes first, so a run over many shapes (every batch
    size of a data set) does not keep each one's tables for the life of the session."""

    LIMIT = 32  # entries: a kernel may keep two per shape (AveragePool's geometry and divisors)

    # threads running one session share its nodes' caches: another may evict or add between two lines
    def __setitem__(self, key: Any, value: Any) -> None:
        if key not in self:
            while len(self) >= self.LIMIT:
                # (emptied, or changed during the look: look again)
                with contextlib.suppress(StopIteration, RuntimeError):
                    self.pop(next(iter(self)), None)
        super().__setitem__(key, value)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        value = self.get(key, _MISSING)
        if value is _MISSING:
            self[key] = default
            return default
        return value

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


class Attrs(dict):
    """Parsed attributes of one node, plus what a kernel may need to know about the node: ``input_types``,
    the declared type of each input where the graph gives it ("map(string,tensor(double))"; None where
    unknown, and empty when the plan did not say)."""

    __slots__ = ("op", "name", "opset", "n_outputs", "output_used", "cache", "input_types")

    def __init__(self, values: dict[str, Any], op: str = "", name: str = "", opset: int = 0,
                 n_outputs: int = 1, output_used: tuple[bool, ...] = (True,),
                 input_types: tuple[str | None, ...] = ()):
        super().__init__(values)
        self.op = op
        self.name = name
        self.opset = opset
        self.n_outputs = n_outputs
        self.output_used = output_used
        self.input_types = input_types
        self.cache: dict[Any, Any] = NodeCache()  # per-node memo a kernel may keep between runs

    def cached(self, key: Any, make: Callable[[], Any]) -> Any:
        """``cache[key]``, made by ``make()`` on first use (e.g. geometry per input shape)."""
        value = self.cache.get(key)
        if value is None:
            value = self.cache[key] = make()
        return value


Kernel = Callable[[Inputs, Attrs], Outputs]

SUBGRAPH_OPS = frozenset({"If", "Loop", "Scan", "SequenceMap"})  # kernels made per node from their bodies
_KERNELS: dict[str, list[tuple[int, Kernel]]] = {}
# kernels of other domains than ONNX's default one, by (domain, op): one kernel for all of an op's versions
# (those of ``ai.onnx.ml`` read whichever attributes the node's version has)
_DOMAIN_KERNELS: dict[tuple[str, str], Kernel] = {}
_LOADED = False


def kernel(op: str, since: int = 1, domain: str = "") -> Callable[[Kernel], Kernel]:
    """Register ``fn`` as the kernel of ``op`` for opsets ``>= since`` (of ``domain``'s op: every version)."""

    def register(fn: Kernel) -> Kernel:
        if domain not in DEFAULT_DOMAINS:
            if (domain, op) in _DOMAIN_KERNELS:
                raise ValueError(f"kernel for {domain}.{op} registered twice")
            _DOMAIN_KERNELS[(domain, op)] = fn
            return fn
        versions = _KERNELS.setdefault(op, [])
        if any(v == since for v, _ in versions):
            raise ValueError(f"kernel for {op} since opset {since} registered twice")
        versions.append((since, fn))
        versions.sort(key=lambda v: v[0])
        return fn

    return register


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    from onnxtrain.engine import kernels

    for mod in pkgutil.iter_modules(kernels.__path__):
        importlib.import_module(f"{kernels.__name__}.{mod.name}")
    _LOADED = True


def find_kernel(op: str, opset: int, domain: str = "") -> Kernel | None:
    """The kernel for ``op`` at ``opset``, or None."""
    _load_all()
    if domain not in DEFAULT_DOMAINS:
        return _DOMAIN_KERNELS.get((domain, op))
    best = None
    for since, fn in _KERNELS.get(op, ()):
        if since <= opset:
            best = fn
    if best is None and op in _KERNELS:  # models older than our first version: use the oldest
        best = _KERNELS[op][0][1]
    return best


def has_kernel(op: str, opset: int, domain: str = "") -> bool:
    """Whether the engine runs ``op``: a registered kernel, or a control-flow op (compiled per node)."""
    return find_kernel(op, opset, domain) is not None or (op in SUBGRAPH_OPS and domain in DEFAULT_DOMAINS)


def available_ops() -> list[str]:
    """Names of every op of ONNX's default domain that has a kernel."""
    _load_all()
    return sorted(_KERNELS)


def available_domain_ops() -> list[str]:
    """``domain.op`` of every op of another domain that has a kernel (``ai.onnx.ml.LabelEncoder``)."""
    _load_all()
    return sorted(f"{d}.{op}" for d, op in _DOMAIN_KERNELS)


def as_array(x: Any, dtype: Any = None) -> np.ndarray:
    """A kernel result as an ndarray (numpy ufuncs return scalars for 0-d inputs)."""
    return x if isinstance(x, np.ndarray) and dtype is None else np.asarray(x, dtype=dtype)

"""Gradient-rule registry: ``@gradient("Relu", uses=("y0",))`` and ``no_gradient("Shape", ...)``.

A rule is a plain function ``fn(g: GradCtx) -> None`` that emits standard ONNX nodes computing the
input gradients of one forward node. ``uses`` names the forward values the rule reads (``x0``,
``y0`` ...; ``x*``/``y*`` for all): the builder refuses any other, so the declaration is what the
backward pass really keeps alive. ``stop`` lists input slots that never get a gradient (with ``stop_if``,
only in the nodes for which it holds, e.g. an attribute's value); ``uncomputed``, those of them whose
gradient is not zero but is not computed (a loss's class weights): asking for a gradient that could only
come through them is an error, not zeros.

The rule modules are imported on demand: a lookup of an op imports the modules that
:data:`onnxtrain.autodiff.rules.MODULES` lists for it, and the listings (``ops_with_rules``) import them
all. A legacy ``TrainingSession`` of LeNet on the onnxruntime backend then imports 9 rule modules of 20
(peak RSS 94.0 → 93.1 MiB; ``Module`` 92.9 → 91.4; 2026-11-30, 4,000 steps).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    import onnx

    from onnxtrain.autodiff.context import GradCtx

RuleFn = Callable[["GradCtx"], None]
NodeTest = Callable[["onnx.NodeProto"], bool]


@dataclass(frozen=True)
class Rule:
    op: str
    since: int
    fn: RuleFn
    uses: frozenset[str]
    stop: frozenset[int]
    linear: bool = False  # cheap to recompute: its gradient needs no forward values
    stop_if: NodeTest | None = None  # the nodes whose ``stop`` slots get no gradient (None: every node)
    uncomputed: frozenset[int] = frozenset()  # stopped slots whose gradient is not zero (not computed)

    def stopped(self, node: onnx.NodeProto) -> frozenset[int]:
        """The input slots of ``node`` that get no gradient (the rule's, and those registered with
        :func:`register_custom_stop_gradient_edges`)."""
        stop = self.stop if self.stop_if is None or self.stop_if(node) else frozenset()
        custom = _CUSTOM_STOPS.get(self.op)
        return stop | custom if custom else stop


_RULES: dict[str, list[Rule]] = {}
# op → input slots the user stopped (onnxruntime's register_custom_stop_gradient_edges)
_CUSTOM_STOPS: dict[str, frozenset[int]] = {}
_VARIANTS: dict[tuple[str, str], Rule] = {}  # (op, variant) → a rule the builder picks on request
_NO_GRADIENT: set[str] = set()
# op → the modules that registered something for it (checked against rules.MODULES by the tests)
_ORIGINS: dict[str, set[str]] = {}
_LOADED = False  # every rule module imported
_READY: set[str] = set()  # ops whose modules are imported
_MODULES_OF: dict[str, tuple[str, ...]] = {}  # op → its modules (rules.MODULES inverted)


def gradient(op: str, since: int = 1, uses: Iterable[str] = (), stop: Iterable[int] = (),
             linear: bool = False, variant: str = "", stop_if: NodeTest | None = None,
             uncomputed: Iterable[int] = ()) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the gradient rule of ``op`` for opsets ``>= since``; with ``variant``, as an
    alternative rule that the builder uses only where asked to (:func:`find_variant`)."""

    def register(fn: RuleFn) -> RuleFn:
        _ORIGINS.setdefault(op, set()).add(fn.__module__)
        if variant:
            if (op, variant) in _VARIANTS:
                raise ValueError(f"gradient rule variant {variant!r} of {op} registered twice")
            _VARIANTS[(op, variant)] = Rule(op, since, fn, frozenset(uses), frozenset(stop), linear, stop_if,
                                            frozenset(uncomputed))
            return fn
        rules = _RULES.setdefault(op, [])
        if any(r.since == since for r in rules):
            raise ValueError(f"gradient rule for {op} since opset {since} registered twice")
        rules.append(Rule(op, since, fn, frozenset(uses), frozenset(stop), linear, stop_if,
                          frozenset(uncomputed)))
        rules.sort(key=lambda r: r.since)
        return fn

    return register


def register_custom_stop_gradient_edges(key: str, indices: Iterable[int]) -> None:
    """Stop the gradient at input slots ``indices`` of every node of op ``key`` ("domain::op_type", the
    domain empty or ``ai.onnx``), as onnxruntime's training binding did; added to the op's own stopped
    slots, for the gradient builders and the legacy session's choice of trained weights."""
    where = "register_custom_stop_gradient_edges"
    if not isinstance(key, str) or key.count("::") < 1:
        raise TypeError(f"{where}: the key must be 'domain::op_type' (e.g. '::Mul'), got {key!r}")
    if isinstance(indices, (str, bytes)) or not isinstance(indices, Iterable):
        raise TypeError(f"{where}: the input slots must be a set of ints, got {type(indices).__name__}")
    slots = list(indices)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in slots):
        raise TypeError(f"{where}: the input slots must be ints >= 0, got {slots!r}")
    domain, op = key.split("::")[:2]
    if domain not in DEFAULT_DOMAINS:
        from onnxtrain.user_warning import warn

        warn(f"{where}({key!r}): only ops of ONNX's own domain have gradient rules here; the edges of an op "
             f"of domain {domain!r} change nothing")
    _CUSTOM_STOPS[op] = _CUSTOM_STOPS.get(op, frozenset()) | frozenset(slots)


def no_gradient(*ops: str) -> None:
    """Declare that ``ops`` have no gradient: their outputs never carry one."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    for op in ops:
        _ORIGINS.setdefault(op, set()).add(caller)
    _NO_GRADIENT.update(ops)


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    from onnxtrain.autodiff import rules

    for name in rules.MODULES:
        importlib.import_module(f"{rules.__name__}.{name}")
    _LOADED = True


def _load_for(op: str) -> None:
    """Import the rule modules that register something for ``op`` (none for an op they do not know)."""
    if _LOADED or op in _READY:
        return
    from onnxtrain.autodiff import rules

    if not _MODULES_OF:  # built whole, then added in one call: another thread sees none of it or all
        inverse: dict[str, tuple[str, ...]] = {}
        for name, ops in rules.MODULES.items():
            for o in ops:
                inverse[o] = (*inverse.get(o, ()), name)
        _MODULES_OF.update(inverse)
    for name in _MODULES_OF.get(op, ()):
        importlib.import_module(f"{rules.__name__}.{name}")
    _READY.add(op)


def find_rule(op: str, opset: int, domain: str = "") -> Rule | None:
    """The rule of ``op`` in force at ``opset`` (the oldest one for older models), or None; None for an
    op of another domain than ONNX's (a custom op named like a standard one means something else)."""
    if domain not in DEFAULT_DOMAINS:
        return None
    _load_for(op)
    rules = _RULES.get(op)
    if not rules:
        return None
    best = rules[0]
    for r in rules:
        if r.since <= opset:
            best = r
    return best


def find_variant(op: str, variant: str) -> Rule | None:
    """The alternative rule ``variant`` of ``op``, or None."""
    _load_for(op)
    return _VARIANTS.get((op, variant))


def has_no_gradient(op: str, domain: str = "") -> bool:
    """Whether ONNX's ``op`` has no gradient at all (Shape, ArgMax, ...); False for other domains' ops."""
    if domain not in DEFAULT_DOMAINS:
        return False
    _load_for(op)
    return op in _NO_GRADIENT


def ops_with_rules() -> list[str]:
    """Names of every op with a gradient rule."""
    _load_all()
    return sorted(_RULES)


def ops_without_gradient() -> list[str]:
    _load_all()
    return sorted(_NO_GRADIENT)

"""Gradient-rule registry: ``@gradient("Relu", uses=("y0",))`` and ``no_gradient("Shape", ...)``.

A rule is a plain function ``fn(g: GradCtx) -> None`` that emits standard ONNX nodes computing the
input gradients of one forward node. ``uses`` names the forward values the rule reads (``x0``,
``y0`` ...; ``x*``/``y*`` for all): the builder refuses any other, so the declaration is what the
backward pass really keeps alive. ``stop`` lists input slots that never get a gradient (with ``stop_if``,
only in the nodes for which it holds, e.g. an attribute's value).
"""

from __future__ import annotations

import importlib
import pkgutil
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

    def stopped(self, node: onnx.NodeProto) -> frozenset[int]:
        """The input slots of ``node`` that get no gradient."""
        return self.stop if self.stop_if is None or self.stop_if(node) else frozenset()


_RULES: dict[str, list[Rule]] = {}
_VARIANTS: dict[tuple[str, str], Rule] = {}  # (op, variant) → a rule the builder picks on request
_NO_GRADIENT: set[str] = set()
_LOADED = False


def gradient(op: str, since: int = 1, uses: Iterable[str] = (), stop: Iterable[int] = (),
             linear: bool = False, variant: str = "", stop_if: NodeTest | None = None
             ) -> Callable[[RuleFn], RuleFn]:
    """Register ``fn`` as the gradient rule of ``op`` for opsets ``>= since``; with ``variant``, as an
    alternative rule that the builder uses only where asked to (:func:`find_variant`)."""

    def register(fn: RuleFn) -> RuleFn:
        if variant:
            if (op, variant) in _VARIANTS:
                raise ValueError(f"gradient rule variant {variant!r} of {op} registered twice")
            _VARIANTS[(op, variant)] = Rule(op, since, fn, frozenset(uses), frozenset(stop), linear, stop_if)
            return fn
        rules = _RULES.setdefault(op, [])
        if any(r.since == since for r in rules):
            raise ValueError(f"gradient rule for {op} since opset {since} registered twice")
        rules.append(Rule(op, since, fn, frozenset(uses), frozenset(stop), linear, stop_if))
        rules.sort(key=lambda r: r.since)
        return fn

    return register


def no_gradient(*ops: str) -> None:
    """Declare that ``ops`` have no gradient: their outputs never carry one."""
    _NO_GRADIENT.update(ops)


def _load_all() -> None:
    global _LOADED
    if _LOADED:
        return
    from onnxtrain.autodiff import rules

    for mod in pkgutil.iter_modules(rules.__path__):
        importlib.import_module(f"{rules.__name__}.{mod.name}")
    _LOADED = True


def find_rule(op: str, opset: int, domain: str = "") -> Rule | None:
    """The rule of ``op`` in force at ``opset`` (the oldest one for older models), or None; None for an
    op of another domain than ONNX's (a custom op named like a standard one means something else)."""
    if domain not in DEFAULT_DOMAINS:
        return None
    _load_all()
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
    _load_all()
    return _VARIANTS.get((op, variant))


def has_no_gradient(op: str, domain: str = "") -> bool:
    """Whether ONNX's ``op`` has no gradient at all (Shape, ArgMax, ...); False for other domains' ops."""
    if domain not in DEFAULT_DOMAINS:
        return False
    _load_all()
    return op in _NO_GRADIENT


def ops_with_rules() -> list[str]:
    """Names of every op with a gradient rule."""
    _load_all()
    return sorted(_RULES)


def ops_without_gradient() -> list[str]:
    _load_all()
    return sorted(_NO_GRADIENT)

"""The shared op table: one ``OpCase`` row per op variant, used by the engine and autodiff tests.

Each family module (``elementwise.py``, ``shape.py`` ...) defines ``CASES: list[OpCase]``;
``ALL_CASES`` gathers them. Test ids are ``<Op>-<variant>``, so ``pytest -k Gemm`` works.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class OpCase:
    op: str
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # float inputs drawn in [low, high)
    attrs: dict[str, Any] = field(default_factory=dict)
    make_inputs: Callable[[np.random.Generator, Any], list[Any]] | None = None  # (rng, dtype) -> inputs
    low: float = -2.0
    high: float = 2.0
    opset: int = 17
    n_outputs: int = 1
    grad: bool = True  # has a gradient rule to check
    wrt: tuple[int, ...] | None = None  # differentiable inputs (default: every float input)
    grad_outputs: tuple[int, ...] | None = None  # outputs the loss depends on (default: all float)
    rtol: float = 1e-5
    atol: float = 1e-6
    variant: str = ""
    skip: str | None = None  # a reason is required to skip
    ref_skip: str | None = None  # why onnx.reference cannot be the oracle for this row's gradient graph
    ort_skip: str | None = None  # why onnxruntime cannot be the oracle for this row's gradient graph
    # why onnx.reference's own kernel of the op cannot check this row's forward: it is checked against
    # onnx.reference running the op's ONNX function body instead
    body_oracle: str | None = None
    # output index -> (dtype the spec gives it for float64 inputs, why onnx.reference's differs); the values
    # are still compared with the reference's
    f64_dtypes: dict[int, tuple[Any, str]] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.variant}" if self.variant else self.op

    def inputs(self, dtype: Any = np.float32, seed: int = 0) -> list[Any]:
        rng = np.random.default_rng(seed)
        if self.make_inputs is not None:
            return self.make_inputs(rng, dtype)
        return [rng.uniform(self.low, self.high, s).astype(dtype) for s in self.shapes]


def _collect() -> list[OpCase]:
    cases: list[OpCase] = []
    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        cases.extend(getattr(importlib.import_module(f"{__name__}.{mod.name}"), "CASES", []))
    return cases


ALL_CASES: list[OpCase] = _collect()

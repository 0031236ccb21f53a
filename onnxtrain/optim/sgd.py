"""SGDOptimizer: ``w ← w − lr·g``."""

from __future__ import annotations

from onnxtrain.ir.builder import NodeWriter
from onnxtrain.optim.base import Optimizer, WeightSlot


class SGD(Optimizer):
    name = "SGDOptimizer"

    def emit(self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]) -> tuple[
            dict[str, str], dict[str, str]]:
        new: dict[str, str] = {}
        for s in slots:
            g = s.grad if s.divisor is None else w.one("Div", s.grad, s.divisor)
            step = w.one("Mul", w.one("Cast", lr, to=s.elem_type) if s.elem_type != 1 else lr, g)
            new[s.name] = w.emit("Sub", [s.name, step], [w.names(f"{s.name}_SGD_out")])[0]
        return new, {}

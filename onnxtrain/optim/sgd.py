"""SGDOptimizer: ``w ← w − lr·g``."""

from __future__ import annotations

from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter
from onnxtrain.optim.base import Optimizer, WeightSlot


class SGD(Optimizer):
    name = "SGDOptimizer"

    def emit(self, w: NodeWriter, slots: list[WeightSlot], lr: str, state: dict[str, str]) -> tuple[
            dict[str, str], dict[str, str]]:
        """A float16 or bfloat16 weight steps in float32 with the float32 rate and is rounded to its type
        once, as onnxruntime's SGD kernel body widens (``w + -lr·g`` in float); in the half type the rate,
        lr·g and the difference each rounded (1 ulp off on a third of the weights at lr 0.1)."""
        new: dict[str, str] = {}
        for s in slots:
            weight, g, et = self.operands(w, s)
            step = w.one("Mul", w.one("Cast", lr, to=et) if et != TensorProto.FLOAT else lr, g)
            out = w.names(f"{s.name}_SGD_out")
            if et == s.elem_type:
                new[s.name] = w.emit("Sub", [weight, step], [out])[0]
            else:
                new[s.name] = w.emit("Cast", [w.one("Sub", weight, step)], [out], to=s.elem_type)[0]
        return new, {}

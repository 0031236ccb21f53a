"""The error the gradient builder raises."""

from __future__ import annotations

from onnxtrain.errors import Fail


class GradientError(Fail, ValueError):
    """The gradient graph cannot be built; the message names the node, op or value at fault (a
    RuntimeError, as onnxruntime's builder raised, and a ValueError)."""

"""RunOptions that request a stop at a chosen point of a run, for the tests of ``RunOptions.terminate``."""

from __future__ import annotations

import onnxtrain


class StopAtRead(onnxtrain.RunOptions):
    """RunOptions whose ``terminate`` reads True from its ``at``-th read on: a stop requested before each
    step of a run in turn, without timing."""

    def __init__(self, at: int) -> None:
        super().__init__()
        object.__setattr__(self, "_at", at)
        object.__setattr__(self, "_reads", 0)

    def __getattribute__(self, name: str):
        if name == "terminate":
            reads = object.__getattribute__(self, "_reads") + 1
            object.__setattr__(self, "_reads", reads)
            return reads >= object.__getattribute__(self, "_at")
        return super().__getattribute__(name)

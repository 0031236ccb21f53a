"""Warnings attributed to the user's code: the first frame outside the onnxtrain package."""

from __future__ import annotations

import os
import sys
import warnings

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside onnxtrain, seen from ``warn``'s caller."""
    frame = sys._getframe(2)  # the caller of warn()
    level = 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame = frame.f_back
        level += 1
    # Every frame inside onnxtrain (e.g. a worker thread's): point at the warning's own line.
    return 2 if frame is None else level


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` pointing at the line of user code that led here, however deep the call."""
    warnings.warn(message, category, stacklevel=_stacklevel())

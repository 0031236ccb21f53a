"""The producer fields of the models onnxtrain builds itself (a model it passes through keeps the input's)."""

from __future__ import annotations

from onnxtrain import __version__

PRODUCER = {"producer_name": "onnxtrain", "producer_version": __version__}

"""Sequences and optionals: which of their ops never carry a gradient (a length, a presence flag, an empty
sequence). The others have no rule yet: a loss reached through one is a clear error."""

from __future__ import annotations

from onnxtrain.autodiff.registry import no_gradient

no_gradient("SequenceEmpty", "SequenceLength", "OptionalHasElement")

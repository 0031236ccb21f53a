"""Gradient marks of the text ops (same names as engine/kernels/text.py): string, bool or count outputs."""

from __future__ import annotations

from onnxtrain.autodiff.registry import no_gradient

no_gradient("StringConcat", "StringNormalizer", "StringSplit", "RegexFullMatch", "TfIdfVectorizer")

"""tools/loc.py counts code lines and tokens, not docstrings or comments."""

from __future__ import annotations

import importlib.util
import os


def _loc():
    path = os.path.join(os.path.dirname(__file__), "..", "tools", "loc.py")
    spec = importlib.util.spec_from_file_location("loc", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measure_skips_docstrings_and_comments() -> None:
    src = '"""Module doc."""\n\n# a comment\ndef f(x):\n    """Doc."""\n    return x + 1  # trailing\n'
    lines, tokens = _loc().measure(src)
    assert lines == 2  # "def f(x):" and "return x + 1"
    assert tokens == 10  # def f ( x ) : return x + 1

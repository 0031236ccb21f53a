"""Review R5 of d9607112 (config entry values value by value): onnxruntime 1.32's
SessionOptions.add_session_config_entry keeps a key and a value up to their first NUL character (C strings),
so 'session.function_expansion_node_limit' = '5\\x00abc' is read back as '5' and taken by InferenceSession.
onnxtrain's SessionOptions kept the whole string, and the numpy engine's entry check then refused it
(InvalidArgument); it now cuts both at the first NUL (capi/options.py). Oracle: onnxruntime 1.32 in this
process."""

from __future__ import annotations

import contextlib
import io

import onnxruntime as ort

import onnxtrain
from tests.engine.test_review_r2_config_entry_values import _model

VALUE = "5\x00abc"
KEY = "session.function_expansion_node_limit"


def test_onnxruntime_cuts_at_the_nul() -> None:
    so = ort.SessionOptions()
    so.add_session_config_entry(KEY, VALUE)
    so.add_session_config_entry("onnxtrain.r5\x00tail", "1")
    assert so.get_session_config_entry(KEY) == "5"
    assert so.get_session_config_entry("onnxtrain.r5") == "1"
    with contextlib.redirect_stdout(io.StringIO()):
        ort.InferenceSession(_model(), so, providers=["CPUExecutionProvider"])


def test_onnxtrain_reads_and_takes_the_entry_as_onnxruntime() -> None:
    opts = onnxtrain.SessionOptions()
    opts.add_session_config_entry(KEY, VALUE)
    assert opts.get_session_config_entry(KEY) == "5"
    onnxtrain.InferenceSession(_model(), opts)

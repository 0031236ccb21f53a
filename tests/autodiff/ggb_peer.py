"""One script that drives a ``GradientGraphBuilder`` through the cases of ``test_ggb_ort116.py``, run
unchanged on onnxtrain (imported, :func:`run_cases`) and on onnxruntime-training 1.16.3 (``python ggb_peer.py
SPEC.json`` in ``tests/ortt.py``'s legacy venv, which imports its binding). numpy, onnx and the standard
library only (the venv has numpy 1.26 and onnx 1.15).

SPEC is ``{"models": folder, "out": folder, "cases": [...]}``; a case is ``{"name", "model": file in the
models folder, "model_as": "bytes" | "bytearray" | "path" | "pathlike" | "proto", "ys", "xs": lists of
names, "ys_as", "xs_as": "set" | "frozenset" | "list" | "tuple" | "str" | "ints", "loss": str or None,
"options": "none" | "session" | "str", "calls": [...], "feeds": npz file in the models folder or None}``.
A call is ``build``, ``get_model`` (the model's interface), ``save`` (into the out folder, the file's
interface), ``save_missing_folder``, ``save_to_folder``, ``save_pathlike`` or ``run`` (the built model on the
side's InferenceSession, every output fetched and written to ``<out>/<case>.npz``, the model to
``<out>/<case>.grad.onnx``). What each call gave is recorded (its value, or the exception's class, bases
and message); the calls stop at the first exception.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
from typing import Any

import numpy as np
import onnx


def error(e: BaseException) -> dict[str, Any]:
    """An exception as the comparison sees it: its class, the classes it derives from, the message's start
    and end (pybind's argument errors print the bytes given)."""
    message = str(e)
    return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__][1:],
            "message": message if len(message) <= 600 else f"{message[:200]} ... {message[-400:]}"}


def _dims(t: onnx.TypeProto) -> list[Any] | None:
    if not t.tensor_type.HasField("shape"):
        return None
    dims = t.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in dims]


def interface(model: onnx.ModelProto) -> dict[str, Any]:
    """What a script feeding and fetching the model by name sees: inputs and outputs as [name, element
    type, dims], initializer names, opset imports, IR version, the domains of the nodes."""
    g = model.graph
    return {"inputs": [[v.name, v.type.tensor_type.elem_type, _dims(v.type)] for v in g.input],
            "outputs": [[v.name, v.type.tensor_type.elem_type, _dims(v.type)] for v in g.output],
            "initializers": [t.name for t in g.initializer],
            "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "ir_version": model.ir_version,
            "node_domains": sorted({n.domain or "ai.onnx" for n in g.node})}


def _names(names: list[str], kind: str) -> Any:
    return {"set": set, "frozenset": frozenset, "list": list, "tuple": tuple,
            "str": lambda v: v[0], "ints": lambda v: set(range(len(v)))}[kind](names)


def _model_arg(path: str, kind: str) -> Any:
    if kind == "path":
        return path
    if kind == "pathlike":
        return pathlib.Path(path)
    if kind == "proto":
        return onnx.load(path)
    with open(path, "rb") as f:
        data = f.read()
    return bytearray(data) if kind == "bytearray" else data


def _call(builder: Any, call: str, case: dict[str, Any], spec: dict[str, Any], runtime: Any) -> Any:
    out = os.path.join(spec["out"], case["name"])
    if call == "build":
        return builder.build()
    if call == "get_model":
        return interface(onnx.load_from_string(builder.get_model()))
    if call in ("save", "save_pathlike"):
        builder.save(out + ".onnx" if call == "save" else pathlib.Path(out + ".onnx"))
        return interface(onnx.load(out + ".onnx"))
    if call == "save_missing_folder":
        return builder.save(os.path.join(spec["out"], "no_such_folder", "m.onnx"))
    if call == "save_to_folder":
        return builder.save(spec["out"])
    if call == "run":
        data = builder.get_model()
        with open(out + ".grad.onnx", "wb") as f:
            f.write(data)
        so = runtime.SessionOptions()
        so.log_severity_level = 4
        sess = runtime.InferenceSession(data, so, providers=["CPUExecutionProvider"])
        with np.load(os.path.join(spec["models"], case["feeds"])) as z:
            feeds = {k: z[k] for k in z.files}
        names = [o.name for o in sess.get_outputs()]
        np.savez(out + ".npz", **dict(zip(names, sess.run(None, feeds))))
        return names
    raise ValueError(f"unknown call {call!r}")


def run_case(builder_cls: Any, options_cls: Any, runtime: Any, case: dict[str, Any],
             spec: dict[str, Any]) -> dict[str, Any]:
    """One case: the constructor's result, then each call's, up to the first exception."""
    path = os.path.join(spec["models"], case["model"])
    args: list[Any] = [_model_arg(path, case.get("model_as", "bytes")),
                       _names(case["ys"], case.get("ys_as", "set")),
                       _names(case["xs"], case.get("xs_as", "set")), case["loss"]]
    options = case.get("options", "none")
    if options != "none":
        args.append(options_cls() if options == "session" else "not options")
    try:
        builder = builder_cls(*args)
    except Exception as e:  # noqa: BLE001 - every exception is what is compared
        return {"init": error(e), "calls": []}
    calls = []
    for call in case.get("calls", []):
        try:
            calls.append({"call": call, "ok": _call(builder, call, case, spec, runtime)})
        except Exception as e:  # noqa: BLE001
            calls.append({"call": call, **error(e)})
            break
    return {"init": {"ok": None}, "calls": calls}


def run_cases(builder_cls: Any, options_cls: Any, runtime: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Every case of ``spec`` by name, as JSON values: the builder class and the SessionOptions class it is
    given, ``runtime`` the onnxruntime module whose InferenceSession runs the gradient models."""
    os.makedirs(spec["out"], exist_ok=True)
    return json.loads(json.dumps({c["name"]: run_case(builder_cls, options_cls, runtime, c, spec)
                                  for c in spec["cases"]}))


if __name__ == "__main__":  # in onnxruntime-training 1.16.3's venv
    import onnxruntime
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    onnxruntime.set_default_logger_severity(4)
    with open(sys.argv[1]) as f:
        the_spec = json.load(f)
    print(json.dumps(run_cases(GradientGraphBuilder, onnxruntime.SessionOptions, onnxruntime, the_spec)))

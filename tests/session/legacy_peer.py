"""Run one described legacy training session in onnxtrain and in onnxruntime-training 1.16.3, the last release
with the real ``TrainingSession`` binding (``tests.ortt.ensure_ort_legacy``), and collect what each step gave.

A :class:`Case` names the model, the ``TrainingParameters`` properties, the optimizer's initial state and
the runs (feeds, fetches, ``RunOptions``, a ``load_state`` before the run). :func:`run_cases` runs every case
in one 1.16.3 process (a process costs about a second) and in this one, and returns for each side a
:class:`Trace`: the error, or per run the fetched outputs, ``get_state()`` and ``get_optimizer_state()``
after it. Models reach the peer as files (or bytes) of IR version 9 or lower: its onnx (< 1.16) reads no
newer. The same loop (``_LOOP``) drives both sessions.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from tests.ortt import ensure_ort_legacy, run_script

SETS = ("weights_to_train", "weights_not_to_train")
# The session options 1.16.3's sessions get (a case may override them). Its CPU Gemm packs its constant weight
# operand once, when the session is made, and the
# training session's optimizer updates the weight's own buffer: with packing on, every forward after the first
# update still multiplies by the initial weights (the biases, added apart, are the updated ones) while the
# backward reads the updated ones. Off, its forward is the updated model's (test_peer_packs_its_weights_once).
# Its default execution order may also run a weight's in-place optimizer node before a backward node that
# still reads the weight (nothing orders them: which comes first follows the node names), so an earlier
# layer's gradient is taken through the later layer's updated weight; the priority-based order runs the
# backward first (test_peer_default_order_updates_weights_before_reading_them). At the default optimization
# level, its NCHWc layout transform copies each Conv weight once into a reordered initializer, which the
# optimizer never updates: a Conv's forward keeps the initial weights; the extended level has no such copy
# (test_peer_conv_keeps_its_initial_weights).
PEER_CONFIG = {"session.disable_prepacking": "1", "execution_order": "PRIORITY_BASED",
               "graph_optimization_level": "ORT_ENABLE_EXTENDED"}


@dataclass
class Step:
    """One ``run()``: ``fetches`` None for every output; ``load`` a ``load_state(load, strict)`` before it."""

    feeds: dict[str, np.ndarray]
    fetches: list[str] | None = None
    run_options: dict[str, Any] = field(default_factory=dict)
    load: dict[str, np.ndarray] | None = None
    strict: bool = False


@dataclass
class Case:
    """A session and its runs. ``ours`` holds onnxtrain-only properties (``legacy_cpu_adam``) set on our side;
    ``as_bytes`` hands both sessions the serialized model instead of a file path."""

    model: onnx.ModelProto
    params: dict[str, Any]
    steps: list[Step]
    initial_state: dict[str, dict[str, np.ndarray]] | None = None
    ours: dict[str, Any] = field(default_factory=dict)
    as_bytes: bool = False
    peer_config: dict[str, str] = field(default_factory=dict)  # 1.16.3's session options over PEER_CONFIG
    ours_config: dict[str, str] = field(default_factory=dict)  # onnxtrain's (its onnxtrain.backend entry)


@dataclass
class Trace:
    """What one side gave: ``error`` (construction or run) or per step ``outputs`` (fetch name → array),
    ``state`` (``get_state()``) and ``optimizer`` (``get_optimizer_state()`` flattened to (weight, key))."""

    error: str | None = None
    inputs: list[str] = field(default_factory=list)
    output_names: list[str] = field(default_factory=list)
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)
    state: list[dict[str, np.ndarray]] = field(default_factory=list)
    optimizer: list[dict[tuple[str, str], np.ndarray]] = field(default_factory=list)


def legacy_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` stamped with the lowest IR version its default-domain opset allows (7 to 9), as 1.16.3's
    onnx reads it (torch's exporter writes IR 10 and newer)."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    opset = max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=13)
    if opset > 19:
        raise ValueError(f"1.16.3's onnx reads opsets up to 19, the model imports {opset}")
    m.ir_version = 7 if opset <= 12 else 8 if opset <= 18 else 9
    return m


# the session loop, run by both sides (``ort`` is onnxruntime there, onnxtrain here; numpy < 2 there); SETS is
# defined before it
_LOOP = r"""
def _params(ort, params, initial, arrays):
    p = ort.TrainingParameters()
    for k, v in params.items():
        if k in SETS:
            v = set(v)
        elif k == "immutable_weights":
            v = {op: [tuple(e) for e in entries] for op, entries in v.items()}
        setattr(p, k, v)
    if initial is not None:
        p.set_optimizer_initial_state({w: {k: arrays[a] for k, a in d.items()} for w, d in initial.items()})
    return p


def _trace(ort, case, arrays, out, prefix):
    p = _params(ort, case["params"], case["initial"], arrays)
    for k, v in case.get("ours", {}).items():
        setattr(p, k, v)
    model = case["path"]
    if case["as_bytes"]:
        with open(model, "rb") as f:
            model = f.read()
    so = ort.SessionOptions()
    for k, v in case.get("config", {}).items():
        if k == "execution_order":
            so.execution_order = getattr(ort.ExecutionOrder, v)
        elif k == "graph_optimization_level":
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, v)
        else:
            so.add_session_config_entry(k, v)
    s = ort.TrainingSession(model, p, so, providers=["CPUExecutionProvider"])
    meta = {"inputs": [i.name for i in s.get_inputs()], "outputs": [o.name for o in s.get_outputs()]}
    for k, st in enumerate(case["steps"]):
        if st["load"] is not None:
            s.load_state({n: arrays[a] for n, a in st["load"].items()}, st["strict"])
        ro = ort.RunOptions()
        for name, value in st["run_options"].items():
            setattr(ro, name, value)
        fetches = st["fetches"] or meta["outputs"]
        res = s.run(fetches, {n: arrays[a] for n, a in st["feeds"].items()}, ro)
        for n, v in zip(fetches, res):
            out[f"{prefix}|{k}|out|{n}"] = np.asarray(v)
        for n, v in s.get_state().items():
            out[f"{prefix}|{k}|state|{n}"] = np.asarray(v)
        for w, d in s.get_optimizer_state().items():
            for n, v in d.items():
                out[f"{prefix}|{k}|opt|{w}|{n}"] = np.asarray(v)
    return meta


def run_all(ort, spec, arrays):
    out, metas = {}, []
    for i, case in enumerate(spec):
        try:
            metas.append(_trace(ort, case, arrays, out, str(i)))
        except Exception as e:  # the case's error is its result
            metas.append({"error": f"{type(e).__name__}: {e}"})
    return out, metas
"""

_PEER = "SETS = " + repr(SETS) + "\n" + _LOOP + r"""
import json, sys
import numpy as np
import onnxruntime as ort
spec = json.load(open(sys.argv[1]))
out, metas = run_all(ort, spec, np.load(sys.argv[2]))
np.savez(sys.argv[3], **out)
print(json.dumps(metas))
"""

_namespace: dict[str, Any] = {"SETS": SETS, "np": np}
exec(compile(_LOOP, __file__ + ":_LOOP", "exec"), _namespace)  # the same loop for onnxtrain


def _describe(cases: list[Case], folder: str) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """The cases as JSON with their arrays by key, their models written to ``folder``."""
    arrays: dict[str, np.ndarray] = {}

    def keep(a: Any) -> str:
        key = f"a{len(arrays)}"
        arrays[key] = np.asarray(a)
        return key

    spec = []
    for i, c in enumerate(cases):
        path = os.path.join(folder, f"model{i}.onnx")
        onnx.save(legacy_model(c.model), path)
        params = {k: (sorted(v) if k in SETS else v) for k, v in c.params.items()}
        initial = (None if c.initial_state is None
                   else {w: {k: keep(v) for k, v in d.items()} for w, d in c.initial_state.items()})
        steps = [{"feeds": {n: keep(v) for n, v in st.feeds.items()}, "fetches": st.fetches,
                  "run_options": st.run_options, "strict": st.strict,
                  "load": None if st.load is None else {n: keep(v) for n, v in st.load.items()}}
                 for st in c.steps]
        spec.append({"path": path, "as_bytes": c.as_bytes, "params": params, "initial": initial,
                     "steps": steps, "ours": c.ours, "config": c.peer_config, "ours_config": c.ours_config})
    return spec, arrays


def _collect(out: dict[str, np.ndarray], metas: list[dict[str, Any]], cases: list[Case]) -> list[Trace]:
    traces = []
    for i, (meta, case) in enumerate(zip(metas, cases)):
        n = len(case.steps)  # (a run that failed leaves the runs before it)
        t = Trace(meta.get("error"), meta.get("inputs", []), meta.get("outputs", []),
                  [{} for _ in range(n)], [{} for _ in range(n)], [{} for _ in range(n)])
        for key, v in out.items():
            ci, step, kind, *name = key.split("|")
            if int(ci) != i:
                continue
            k = int(step)
            if kind == "out":
                t.outputs[k][name[0]] = v
            elif kind == "state":
                t.state[k][name[0]] = v
            else:
                t.optimizer[k][(name[0], name[1])] = v
        traces.append(t)
    return traces


def run_cases(cases: list[Case]) -> tuple[list[Trace], list[Trace]]:
    """(1.16.3's traces, onnxtrain's traces) of ``cases``; 1.16.3's in one process of its venv (skips the
    calling test when that venv cannot be made)."""
    python = ensure_ort_legacy()
    with tempfile.TemporaryDirectory() as folder:
        spec, arrays = _describe(cases, folder)
        spec_path, arrays_path = os.path.join(folder, "spec.json"), os.path.join(folder, "arrays.npz")
        with open(spec_path, "w") as f:  # (the onnxtrain-only properties stay on our side)
            json.dump([{**c, "ours": {}, "config": {**PEER_CONFIG, **c["config"]}} for c in spec], f)
        np.savez(arrays_path, **arrays)
        result = os.path.join(folder, "result.npz")
        metas = run_script(_PEER, spec_path, arrays_path, result, python=python)
        with np.load(result) as z:
            peer_out = {k: z[k] for k in z.files}
        peer = _collect(peer_out, metas, cases)
        import onnxtrain

        ours_spec = [{**c, "config": c["ours_config"]} for c in spec]  # (1.16.3's entries are its own)
        ours_out, ours_metas = _namespace["run_all"](onnxtrain, ours_spec, arrays)
    return peer, _collect(ours_out, ours_metas, cases)

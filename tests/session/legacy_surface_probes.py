"""One script that walks the legacy ``TrainingSession``'s API surface, run unchanged on onnxtrain and on
onnxruntime-training 1.16.3 (the last release with the legacy binding): the module to drive is passed in.

``python legacy_surface_probes.py CASES.json`` (in the 1.16.3 venv) imports ``onnxruntime`` and prints one
JSON line; the tests call :func:`run_cases` with ``onnxtrain``. Only numpy, onnx and the standard library
are used (the peer venv has numpy 1.26 and onnx 1.15). What is recorded is the surface, not the numbers:
names, order, dtypes, shapes, which state entries a call changed, and which exception class a call raised.

A case (JSON) is ``{"name", "model": file in the models folder, "params": {TrainingParameters property:
value}, "as_bytes", "providers", "sess_options", "dumps", "runs": [...], "loads": [...], "probe_state"}``;
``weights_to_train`` and the other set properties are given as lists. A run is ``{"outputs": names or
None, "drop": feeds left out, "extra": {name: [dtype, shape]}, "as": {name: [dtype, shape]} (a feed given
in another dtype or shape), "values": {name: [values, dtype]} (a feed of these values), "raw": {name:
"list" | "none" | "string"} (a feed that is no array), "lr_shape", "run_options": {attribute: value},
"run_options_as": "dict" | "string" (something else in RunOptions' place), "iobinding"}``. A case's
``"values"`` are its feeds' values for every run; its ``"save_as_onnx"`` a path that method is called with.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import onnx

SET_PROPERTIES = ("weights_to_train", "weights_not_to_train")


def error(e: BaseException) -> dict[str, Any]:
    """An exception as the comparison sees it: its class, the classes it derives from, the message's end."""
    return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__][1:],
            "module": type(e).__module__, "message": str(e)[-300:]}


def tensor(a: Any) -> Any:
    """An array as ``["arr", dtype, shape]``; other values as JSON (nested dicts and lists kept)."""
    if isinstance(a, np.ndarray):
        return ["arr", str(a.dtype), list(a.shape)]
    if isinstance(a, dict):
        return {str(k): tensor(v) for k, v in a.items()}
    if isinstance(a, (list, tuple)):
        return [tensor(v) for v in a]
    if isinstance(a, (bool, int, float, str)) or a is None:
        return a
    if isinstance(a, np.generic):
        return ["scalar", str(a.dtype)]
    return ["object", type(a).__name__]


def attempt(f: Any, *args: Any, **kwargs: Any) -> Any:
    """``{"ok": f(...)}`` as JSON, or the exception's ``error``."""
    try:
        return {"ok": tensor(f(*args, **kwargs))}
    except Exception as e:  # noqa: BLE001 - every exception is what is compared
        return error(e)


def args_meta(args: Any) -> list[list[Any]]:
    """NodeArgs as [name, shape (symbolic dims as their names, unknown as None), type]."""
    return [[a.name, [d if isinstance(d, (int, str)) or d is None else str(d) for d in a.shape], a.type]
            for a in args]


# --- TrainingParameters ----------------------------------------------------------------------------------

# value sources (evaluated with np in scope) assigned to properties of each kind
ASSIGNMENTS: dict[str, list[str]] = {
    "loss_output_name": ["'loss'", "b'loss'", "1", "None"],
    "training_optimizer_name": ["'AdamOptimizer'", "'NoSuchOptimizer'", "3"],
    "weights_to_train": ["{'a', 'b'}", "['a', 'b']", "('a',)", "frozenset({'a'})", "'ab'", "{1, 2}",
                         "None", "{'a': 1}"],
    "weights_not_to_train": ["{'a'}", "[]"],
    "optimizer_attributes_map": ["{'W': {'alpha': 0.9}}", "{'W': {}}", "{'W': {'alpha': 1}}",
                                 "{'W': {'alpha': '0.9'}}", "{'W': 0.9}", "{1: {}}", "[('W', {})]", "None"],
    "optimizer_int_attributes_map": ["{'W': {'x': 1}}", "{'W': {'x': 1.0}}", "{'W': {'x': 1.5}}",
                                     "{'W': {'x': True}}", "{'W': {'x': 2**40}}",
                                     "{b'W': {b'x': np.int64(3)}}"],
    "immutable_weights": ["{'Div': [(1, 8.0)]}", "{'Div': [[1, 8.0]]}", "{'Div': 1}"],
    "gradient_accumulation_steps": ["4", "4.0", "4.5", "'4'", "True", "np.int64(4)", "-1", "np.float64(4)",
                                    "np.int32(4)", "None", "2**40"],
    "world_size": ["2", "2.0"],
    "enable_grad_norm_clip": ["False", "0", "1", "'False'", "None", "np.bool_(False)", "2", "0.0", "1.5",
                              "np.float32(0)", "[]", "np.int64(0)", "np.array([1, 2])", "np.array([0])"],
    "loss_scale": ["2.0", "2", "'2'", "np.float32(2)", "None", "np.float64(0.1)", "True", "0.1", "1e39",
                   "10**400", "np.array(0.5)"],
    "lr_params_feed_name": ["'lr'", "''", "np.str_('lr')", "None"],
    "world_rank": ["1", "-1"],
    "propagate_cast_ops_allow": ["['Add']", "('Add',)", "{'Add'}", "'Add'"],
    "sliced_schema": ["{'x': [2, 4]}"],
    "sliced_tensor_names": ["['x']"],
    "model_with_training_graph_path": ["'/tmp/x.onnx'", "None"],
}


def parameters_probe(ort: Any) -> dict[str, Any]:
    """Every property's default (value, type), what each assignment of ASSIGNMENTS reads back as (or
    raises), whether in-place mutation of a returned container sticks, and unknown names."""
    p = ort.TrainingParameters()
    names = sorted(n for n in dir(p) if not n.startswith("_") and not callable(getattr(p, n)))
    out: dict[str, Any] = {"defaults": {}, "assign": {}, "methods": sorted(
        n for n in dir(p) if not n.startswith("_") and callable(getattr(p, n)))}
    for n in names:
        v = getattr(p, n)
        out["defaults"][n] = [type(v).__name__, sorted(v) if isinstance(v, (set, frozenset)) else v]
    for prop, sources in ASSIGNMENTS.items():
        for src in sources:
            q = ort.TrainingParameters()
            try:
                setattr(q, prop, eval(src, {"np": np}))  # noqa: S307 - our own literal table
                back = getattr(q, prop)
                out["assign"][f"{prop} = {src}"] = {"ok": [type(back).__name__, repr(
                    sorted(back) if isinstance(back, (set, frozenset)) else back)]}
            except Exception as e:  # noqa: BLE001
                out["assign"][f"{prop} = {src}"] = error(e)
    q = ort.TrainingParameters()
    q.weights_to_train.add("a")
    q.optimizer_attributes_map["W"] = {}
    q.propagate_cast_ops_allow.append("Add")
    out["mutation"] = [sorted(q.weights_to_train), sorted(q.optimizer_attributes_map),
                       list(q.propagate_cast_ops_allow)]
    out["unknown_get"] = attempt(getattr, q, "no_such_option")
    out["unknown_set"] = attempt(setattr, q, "no_such_option", 1)
    q = ort.TrainingParameters()
    out["set_optimizer_initial_state"] = attempt(
        q.set_optimizer_initial_state, {"W": {"Moment_1": np.zeros((2, 2), np.float32)}})
    out["set_optimizer_initial_state_bad"] = attempt(q.set_optimizer_initial_state, {"W": 1})
    return out


# --- sessions --------------------------------------------------------------------------------------------

def make_parameters(ort: Any, params: dict[str, Any], initial_state: Any = None) -> Any:
    p = ort.TrainingParameters()
    for k, v in params.items():
        setattr(p, k, set(v) if k in SET_PROPERTIES else v)
    if initial_state is not None:
        p.set_optimizer_initial_state({w: {k: np.array(a[0], a[1]) for k, a in d.items()}
                                       for w, d in initial_state.items()})
    return p


def default_feeds(case: dict[str, Any], session: Any) -> dict[str, np.ndarray]:
    """Feeds of the case's model inputs (``case["feeds"]``: {name: [dtype, shape]}), the learning rate and
    the loss scale when the session asks for one."""
    rng = np.random.default_rng(0)
    feeds = {k: rng.standard_normal(shape).astype(dtype) for k, (dtype, shape) in case["feeds"].items()}
    feeds.update((k, np.array(v, dtype)) for k, (v, dtype) in case.get("values", {}).items())
    lr = case.get("params", {}).get("lr_params_feed_name", "Learning_Rate")
    if case.get("params", {}).get("training_optimizer_name"):
        feeds[lr] = np.array([0.01], np.float32)
    if getattr(session, "loss_scale_input_name", None):
        feeds[session.loss_scale_input_name] = np.array([1.0], np.float32)
    return feeds


def state_or_none(session: Any) -> dict[str, np.ndarray] | None:
    try:
        return {k: np.array(v) for k, v in session.get_state().items()}
    except Exception:  # noqa: BLE001 - the probe of get_state records it
        return None


def changed(before: dict | None, after: dict | None) -> list[str] | None:
    if before is None or after is None:
        return None
    return sorted(k for k in before if k in after and not np.array_equal(before[k], after[k]))


def run_once(ort: Any, case: dict[str, Any], session: Any, spec: dict[str, Any]) -> Any:
    feeds = default_feeds(case, session)
    lr = case.get("params", {}).get("lr_params_feed_name", "Learning_Rate")
    if "lr_shape" in spec and lr in feeds:
        feeds[lr] = np.full(spec["lr_shape"], 0.01, np.float32)
    for k in spec.get("drop", []):
        feeds.pop(k, None)
    for k, (dtype, shape) in {**spec.get("extra", {}), **spec.get("as", {})}.items():
        feeds[k] = np.ones(shape, dtype)
    feeds.update((k, np.array(v, dtype)) for k, (v, dtype) in spec.get("values", {}).items())
    for k, kind in spec.get("raw", {}).items():
        feeds[k] = {"list": lambda a: a.tolist(), "none": lambda a: None, "string": str}[kind](feeds[k])
    ro: Any = None
    before = state_or_none(session)
    try:
        if "run_options" in spec:
            ro = ort.RunOptions()
            for k, v in spec["run_options"].items():
                setattr(ro, k, v)
        ro = {"dict": {}, "string": "options"}.get(spec.get("run_options_as"), ro)
        if spec.get("iobinding"):
            b = session.io_binding()
            for k, v in feeds.items():
                b.bind_cpu_input(k, v)
            for k in spec["outputs"]:
                b.bind_output(k)
            session.run_with_iobinding(b, ro)
            outs = b.copy_outputs_to_cpu()
        else:
            outs = session.run(spec.get("outputs"), feeds, ro)
        result: dict[str, Any] = {"ok": tensor(list(outs))}
    except Exception as e:  # noqa: BLE001
        result = error(e)
    result["changed"] = changed(before, state_or_none(session))
    return result


LOADS = ("same", "plus_one", "unknown_key", "missing_key", "wrong_dtype", "wrong_shape", "wrong_size",
         "list_value", "scalar_for_vector", "optimizer_wrong_dtype", "model_state_nested")


def load_once(session: Any, kind: str, strict: bool, weight: str) -> Any:
    """load_state of the current state changed as ``kind`` says; records the error and which entries
    changed (a successful load of W + 1 changes W)."""
    before = state_or_none(session)
    if before is None:
        return {"skipped": "no state"}
    st: dict[str, Any] = {k: v.copy() for k, v in before.items()}
    w = st[weight]
    if kind == "plus_one":
        st[weight] = w + 1
    elif kind == "unknown_key":
        st[weight] = w + 1
        st["no_such_tensor"] = np.zeros(3, np.float32)
    elif kind == "missing_key":
        st = {k: v + 1 if v.dtype.kind == "f" else v for k, v in st.items() if k != weight}
    elif kind == "wrong_dtype":
        st[weight] = (w + 1).astype(np.float64)
    elif kind == "wrong_shape":
        st[weight] = (w + 1).reshape(-1)
    elif kind == "wrong_size":
        st[weight] = np.ones(w.size + 1, w.dtype)
    elif kind == "list_value":
        st[weight] = (w + 1).tolist()
    elif kind == "scalar_for_vector":
        st[weight] = np.float32(5.0)
    elif kind == "optimizer_wrong_dtype":
        moments = [k for k in st if k.startswith("Moment_1_")]
        if not moments:
            return {"skipped": "no moments"}
        st[moments[0]] = st[moments[0]].astype(np.float64)
    elif kind == "model_state_nested":
        st = {k: {kk: vv + 1 for kk, vv in d.items()} for k, d in session.get_model_state().items()}
    try:
        session.load_state(st, strict)
        result: dict[str, Any] = {"ok": None}
    except Exception as e:  # noqa: BLE001
        result = error(e)
    result["changed"] = changed(before, state_or_none(session))
    return result


def dumped(path: str) -> Any:
    if not os.path.exists(path):
        return None
    m = onnx.load(path)
    g = m.graph
    return {"inputs": [i.name for i in g.input], "outputs": [o.name for o in g.output],
            "initializers": sorted(i.name for i in g.initializer)}


def session_probe(ort: Any, case: dict[str, Any], models: str, out_dir: str) -> dict[str, Any]:
    res: dict[str, Any] = {}
    params = dict(case.get("params", {}))
    paths = {}
    if case.get("dumps"):
        for key in ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
                    "model_with_training_graph_path"):
            paths[key] = os.path.join(out_dir, f"{case['name']}.{key}.onnx")
            params[key] = paths[key]
    model = case["model"] if os.path.isabs(case["model"]) else os.path.join(models, case["model"])
    try:
        p = make_parameters(ort, params, case.get("initial_state"))
        p = {"none": None, "dict": dict(params)}.get(case.get("parameters_as"), p)
        options = None
        if case.get("sess_options") == "providers":  # a providers list given in sess_options' place
            options = ["CPUExecutionProvider"]
        elif "sess_options" in case:
            options = ort.SessionOptions()
            for k, v in case["sess_options"].items():
                setattr(options, k, v)
        source: Any = model
        if case.get("as_bytes"):
            with open(model, "rb") as f:
                source = f.read()
        elif case.get("as_pathlike"):
            import pathlib
            source = pathlib.Path(model)
        providers = case.get("providers", ["CPUExecutionProvider"])
        session = ort.TrainingSession(source, p, options, providers)
    except Exception as e:  # noqa: BLE001
        res["ctor"] = error(e)
        res["dumps"] = {k: dumped(v) for k, v in paths.items()}
        return res
    res["ctor"] = {"ok": None}
    res["dumps"] = {k: dumped(v) for k, v in paths.items()}
    res["loss_scale_input_name"] = session.loss_scale_input_name
    res["inputs"] = attempt(lambda: args_meta(session.get_inputs()))
    res["outputs"] = attempt(lambda: args_meta(session.get_outputs()))
    res["overridable"] = attempt(lambda: args_meta(session.get_overridable_initializers()))
    res["providers"] = attempt(session.get_providers)
    res["provider_options"] = attempt(session.get_provider_options)
    res["session_options"] = attempt(lambda: _options(session.get_session_options()))
    res["modelmeta"] = attempt(lambda: _meta(session.get_modelmeta()))
    native = getattr(session, "_sess", None)  # 1.16.3's wrapper leaves these unset: the binding's own
    if native is not None and not isinstance(native, (str, bytes)):
        res["native"] = {
            "overridable": attempt(lambda: args_meta(native.overridable_initializers)),
            "providers": attempt(native.get_providers),
            "modelmeta": attempt(lambda: _meta(native.model_meta)),
            "session_options": attempt(lambda: _options(native.session_options)),
        }
    if case.get("probe_state", True):
        res["get_state"] = attempt(session.get_state)
        res["get_model_state"] = attempt(session.get_model_state)
        res["get_model_state_mp"] = attempt(session.get_model_state, True)
        res["get_optimizer_state"] = attempt(session.get_optimizer_state)
        res["get_partition_info_map"] = attempt(session.get_partition_info_map)
        outs = res["outputs"].get("ok") or []
        res["fp32"] = {n: attempt(session.is_output_fp32_node, n) for n in [o[0] for o in outs] + ["no_such"]}
    res["runs"] = [run_once(ort, case, session, spec) for spec in case.get("runs", [])]
    weight = case.get("load_weight", "W")
    res["loads"] = {f"{kind}/{strict}": load_once(session, kind, strict, weight)
                    for kind, strict in case.get("loads", [])}
    if "save_as_onnx" in case:
        res["save_as_onnx"] = attempt(lambda: session.save_as_onnx(case["save_as_onnx"]))
    return res


OPTIONS = ("log_severity_level", "log_verbosity_level", "logid", "graph_optimization_level", "execution_mode",
           "execution_order", "intra_op_num_threads", "inter_op_num_threads", "enable_profiling",
           "profile_file_prefix", "optimized_model_filepath", "enable_mem_pattern", "enable_mem_reuse",
           "enable_cpu_mem_arena", "use_deterministic_compute")


def _options(o: Any) -> dict[str, Any]:
    """A SessionOptions' class name and its common attributes (enums by their str())."""
    return {"class": type(o).__name__,
            **{k: str(getattr(o, k)) if hasattr(o, k) else "missing" for k in OPTIONS}}


def _meta(m: Any) -> dict[str, Any]:
    return {k: getattr(m, k) for k in ("producer_name", "graph_name", "domain", "description",
                                        "graph_description", "version", "custom_metadata_map")}


def run_cases(ort: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """Every case of ``spec`` ({"models", "out", "cases", "parameters"}) on ``ort``'s TrainingSession."""
    os.makedirs(spec["out"], exist_ok=True)
    result: dict[str, Any] = {"cases": {}}
    if spec.get("parameters"):
        result["parameters"] = parameters_probe(ort)
    for case in spec["cases"]:
        result["cases"][case["name"]] = session_probe(ort, case, spec["models"], spec["out"])
    return result


if __name__ == "__main__":
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    print(json.dumps(run_cases(onnxruntime, spec), default=str))

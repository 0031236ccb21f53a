"""The on-device API, call by call, against onnxruntime-training 1.19.2.

Small models (an MLP, a conv net, an MLP with a frozen weight, a linear layer with a BatchNormalization
whose running statistics are frozen buffers, an MLP with two additional outputs, one whose bias is neither
trained nor frozen (a constant of the models), an embedding of int64 indices) get their artifacts from each
project's ``generate_artifacts``; the same call sequence (``tests/training/ortt_api_driver.py``) runs on

* onnxruntime-training's artifacts in onnxruntime-training (the oracle),
* the same files in onnxtrain (which translates them),
* onnxtrain's own artifacts in onnxtrain,

and every recorded return value, exception class and state read must agree: values within float32
tolerance (SGD's updates bit for bit, AdamW's first within 1 ulp), exceptions of a class ours is also an
instance of, and our messages name what is at fault. Where 1.19.2 is the one at fault, or onnxtrain
differs on purpose (README), the comparison says so and checks what onnxtrain does (``KNOWN``,
``KNOWN_EDGES``). Edge calls, exported models, checkpoints cross-loaded both ways, scheduler rates and
drawn call sequences are compared the same way.
"""

from __future__ import annotations

import json
import os
import types

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp
from tests.tiers import extended, full
from tests.training.ortt_api_driver import DRIVER

F, I64 = TensorProto.FLOAT, TensorProto.INT64
N = 4  # batch


def _model(nodes, inputs, outputs, inits) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "m", inputs, outputs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


def _init(rng, name, shape, scale=1.0):
    return numpy_helper.from_array((scale * rng.standard_normal(shape)).astype(np.float32), name)


def conv_net() -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["input", "conv.weight", "conv.bias"], ["c"], kernel_shape=[3, 3]),
             helper.make_node("Relu", ["c"], ["r"]), helper.make_node("Flatten", ["r"], ["fl"], axis=1),
             helper.make_node("MatMul", ["fl", "fc.weight"], ["mm"]),
             helper.make_node("Add", ["mm", "fc.bias"], ["output"])]
    inits = [_init(rng, "conv.weight", (2, 1, 3, 3)), _init(rng, "conv.bias", (2,)),
             _init(rng, "fc.weight", (18, 3), 0.3), _init(rng, "fc.bias", (3,))]
    return _model(nodes, [helper.make_tensor_value_info("input", F, ["b", 1, 5, 5])],
                  [helper.make_tensor_value_info("output", F, ["b", 3])], inits)


def bn_net() -> onnx.ModelProto:
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("MatMul", ["input", "fc.weight"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "bn.scale", "bn.bias", "bn.mean", "bn.var"],
                              ["output"])]
    inits = [_init(rng, "fc.weight", (3, 4)), _init(rng, "bn.scale", (4,)), _init(rng, "bn.bias", (4,)),
             _init(rng, "bn.mean", (4,), 0.1),
             numpy_helper.from_array(rng.uniform(0.5, 2.0, 4).astype(np.float32), "bn.var")]
    return _model(nodes, [helper.make_tensor_value_info("input", F, ["b", 3])],
                  [helper.make_tensor_value_info("output", F, ["b", 4])], inits)


def embed_net() -> onnx.ModelProto:
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Gather", ["emb.weight", "input"], ["e"]),
             helper.make_node("Flatten", ["e"], ["fl"], axis=1),
             helper.make_node("MatMul", ["fl", "fc.weight"], ["output"])]
    inits = [_init(rng, "emb.weight", (5, 3)), _init(rng, "fc.weight", (6, 3), 0.5)]
    return _model(nodes, [helper.make_tensor_value_info("input", I64, ["b", 2])],
                  [helper.make_tensor_value_info("output", F, ["b", 3])], inits)


def elementwise_net() -> onnx.ModelProto:
    """``output = input * W + B`` on [1, 8]: its MSE gradients are the same bits in any graph (products by
    powers of two and one rounding each), so the optimizers' updates can be compared to the ulp."""
    rng = np.random.default_rng(4)
    nodes = [helper.make_node("Mul", ["input", "W"], ["p"]), helper.make_node("Add", ["p", "B"], ["output"])]
    return _model(nodes, [helper.make_tensor_value_info("input", F, [1, 8])],
                  [helper.make_tensor_value_info("output", F, [1, 8])],
                  [_init(rng, "W", (8,)), _init(rng, "B", (8,))])


CASES = {
    "mlp": dict(model=small_mlp, loss="ce", optimizer=["adamw"], frozen=[],
                requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"], exports=["output", "c"]),
    "conv": dict(model=conv_net, loss="mse", optimizer=["sgd"], frozen=[],
                 requires_grad=["conv.weight", "conv.bias", "fc.weight", "fc.bias"], exports=["output", "r"]),
    "frozen": dict(model=small_mlp, loss="l1", optimizer=["adamw"], frozen=["fc1.weight"],
                   requires_grad=["fc1.bias", "fc2.weight", "fc2.bias"], exports=["output", "b"]),
    "bn": dict(model=bn_net, loss="mse", optimizer=["sgd"], frozen=["bn.mean", "bn.var"],
               requires_grad=["fc.weight", "bn.scale", "bn.bias"], exports=["output", "h"]),
    "constant": dict(model=small_mlp, loss="ce", optimizer=["sgd"], frozen=["fc1.weight"],  # fc2.bias stays
                     requires_grad=["fc1.bias", "fc2.weight"], exports=["output", "c"]),
    "outputs": dict(model=small_mlp, loss="mse", optimizer=["adamw"], frozen=[], extra=["c", "output"],
                    requires_grad=["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
                    exports=["c", "output"]),
    "embed": dict(model=embed_net, loss="ce", optimizer=["adamw"], frozen=[],
                  requires_grad=["emb.weight", "fc.weight"], exports=["output", "fl"]),
}


def case_data(name: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(len(name))
    c = CASES[name]
    out: dict[str, np.ndarray] = {}
    for i in range(4):
        if name == "conv":
            x = rng.standard_normal((N, 1, 5, 5)).astype(np.float32)
        elif name == "embed":
            x = rng.integers(0, 5, (N, 2)).astype(np.int64)
        elif name == "bn":
            x = rng.standard_normal((N, 3)).astype(np.float32)
        else:
            x = rng.standard_normal((N, 4)).astype(np.float32)
        classes = 4 if name == "bn" else 3
        if c["loss"] == "ce":
            y = rng.integers(0, classes, N).astype(np.int64)
        else:
            y = rng.standard_normal((N, classes)).astype(np.float32)
        out[f"x{i}"], out[f"y{i}"] = x, y
    return out


_ORT_SCRIPT = PREAMBLE + DRIVER + r'''
import types
IMPL = "onnxruntime-training"
from onnxruntime import OrtValue, SessionOptions
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

def run_model(path, feeds):
    import onnxruntime

    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, feeds)


A = types.SimpleNamespace(
    artifacts=artifacts, onnxblock=onnxblock, CheckpointState=CheckpointState, Module=Module,
    Optimizer=Optimizer,
    # its Python wrapper hands (warmup, total) to a binding that takes (total, warmup): swapped back here
    scheduler=lambda o, warmup, total, lr: LinearLRScheduler(o, total, warmup, lr),
    wrapper_scheduler=LinearLRScheduler,
    buffer=lambda a: OrtValue.ortvalue_from_numpy(a)._ortvalue,
    ortvalue=OrtValue.ortvalue_from_numpy, onnxruntime_ortvalue=OrtValue.ortvalue_from_numpy,
    SessionOptions=SessionOptions, run_model=run_model)
with open(sys.argv[1]) as f:
    jobs = json.load(f)
done = {}
for job in jobs:
    data = dict(np.load(job["data"]))
    os.makedirs(job["out"], exist_ok=True)
    try:
        if job.get("generate"):
            generate(A, job["case"], job["base"], job["folder"])
        if job["kind"] == "scenario":
            rec = scenario(A, job["case"], job["folder"], data, job["out"])
        elif job["kind"] == "schedules":
            rec = schedules(A, job["case"], job["folder"], data, [tuple(t) for t in job["cases"]])
        elif job["kind"] == "edges":
            rec = edges(A, job["case"], job["folder"], data, job["out"])
        elif job["kind"] == "sequence":
            rec = sequence(A, job["case"], job["folder"], data, job["out"], job["ops"])
        elif job["kind"] == "continue":
            rec = continue_from(A, job["case"], job["folder"], job["checkpoint"], data)
        else:
            rec = optimizer_steps(A, job["folder"], data, job["out"], job["steps"])
        with open(os.path.join(job["out"], "record.json"), "w") as fh:
            json.dump(rec, fh)
        done[job["out"]] = None
    except Exception as e:  # reported per job
        import traceback
        done[job["out"]] = f"{type(e).__name__}: {e} {traceback.format_exc()[-1500:]}"
print(json.dumps(done))
'''

_NS: dict = {}
exec(compile(DRIVER, "<driver>", "exec"), _NS)  # noqa: S102 - the same driver source onnxruntime-training runs


def onnxtrain_api() -> types.SimpleNamespace:
    import onnxruntime

    from onnxtrain import OrtValue, SessionOptions
    from onnxtrain.training import artifacts, onnxblock
    from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

    return types.SimpleNamespace(
        artifacts=artifacts, onnxblock=onnxblock, CheckpointState=CheckpointState, Module=Module,
        Optimizer=Optimizer, scheduler=lambda o, warmup, total, lr: LinearLRScheduler(o, warmup, total, lr),
        wrapper_scheduler=lambda o, warmup, total, lr: LinearLRScheduler(o, warmup, total, lr,
                                                                        swap_warmup_and_total=True),
        buffer=lambda a: a, ortvalue=OrtValue.ortvalue_from_numpy,
        onnxruntime_ortvalue=onnxruntime.OrtValue.ortvalue_from_numpy, SessionOptions=SessionOptions,
        run_model=lambda path, feeds: onnxruntime.InferenceSession(
            path, providers=["CPUExecutionProvider"]).run(None, feeds))


def serialize(case: dict) -> dict:
    return {k: v for k, v in case.items() if k != "model"}


# ---------------------------------------------------------------- the runs
SCHEDULES = [(0, 5), (5, 5), (2, 5), (0, 0), (3, 2), (1, 1), (4, 0)]  # (warmup, total)
OPTIMIZERS = {"adamw": ["adamw"], "no_bias_correction": ["adamw_block", {"bias_correction": False}],
              "betas_eps_decay": ["adamw_block", {"betas": [0.8, 0.95], "eps": 1e-4, "weight_decay": 0.1}],
              "decay": ["adamw_block", {"weight_decay": 0.01, "eps": 1e-8}], "sgd": ["sgd"],
              "sgd_block": ["sgd_block"],  # and with ClipGradNorm(0.05), which clips every step here
              "clip": ["adamw_block", {}, 0.05], "sgd_clip": ["sgd_block", {}, 0.05]}
STEPS = 20
SIDES = ("theirs", "ours")  # onnxtrain on onnxruntime-training's artifacts, on its own
# the default suite's cases (a few seconds): the MLP (AdamW, cross-entropy) and the BatchNorm net (SGD, frozen
# running statistics); AdamW and SGD as generated by default. The rest in the full suite (tests/tiers.py).
DEFAULT_CASES, DEFAULT_OPTIMIZERS = ("mlp", "bn", "outputs"), ("adamw", "sgd")


SEQUENCE_SEEDS, DEFAULT_SEQUENCE_SEEDS = range(8), (0,)


def draw_ops(seed: int, n: int = 40) -> list:
    """A seeded sequence of calls for the driver's ``sequence``: training and eval calls, resets, steps,
    learning rates, gradient reads, buffers and copies, parameter sets, a scheduler and its steps, reloads,
    exports (run by onnxruntime)."""
    rng = np.random.default_rng(1000 + seed)
    kinds = ["train"] * 6 + ["eval"] * 2 + ["reset", "step", "step", "grads", "lr", "contig", "copy", "set",
                                              "sched", "sched_step", "sched_step", "reload", "export"]
    ops = []
    for _ in range(n):
        k = kinds[int(rng.integers(len(kinds)))]
        if k in ("train", "eval", "export"):
            ops.append([k, int(rng.integers(4))])
        elif k == "lr":
            ops.append([k, float(rng.choice([0.0, 0.01, 0.05, 0.2]))])
        elif k == "contig":
            ops.append([k, bool(rng.integers(2))])
        elif k in ("copy", "set"):
            ops.append([k, bool(rng.integers(2)) if k == "copy" else int(rng.integers(8)),
                        float(rng.choice([0.5, 0.9, 1.1]))])
        elif k == "sched":
            total = int(rng.integers(0, 8))
            ops.append([k, int(rng.integers(0, total + 2)), total, float(rng.choice([0.01, 0.1]))])
        else:
            ops.append([k])
    return ops


def _tiered(names, default) -> list:
    return [n if n in default else extended(n, id=str(n)) for n in names]


def _elementwise_data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(9)
    return {f"{k}{i}": rng.standard_normal((1, 8)).astype(np.float32) for i in range(4) for k in "xy"}


def _write(path: str, rec: dict) -> None:
    with open(path, "w") as f:
        json.dump(rec, f)


def _read(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def _folder(root: str, name: str, model: onnx.ModelProto, data: dict[str, np.ndarray]) -> str:
    d = os.path.join(root, name)
    for sub in ("theirs", "ours", "ort", "ot_theirs", "ot_ours"):
        os.makedirs(os.path.join(d, sub))
    onnx.save(model, os.path.join(d, "base.onnx"))
    np.savez(os.path.join(d, "data.npz"), **data)
    return d


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> str:
    """The folder of every run: ``<case>/{theirs,ours}`` (artifacts), ``<case>/ort`` (onnxruntime-training
    on its artifacts), ``<case>/ot_{theirs,ours}`` (onnxtrain on each), each with its record.json (the edge
    calls in ``ort_edges`` and ``ot_{theirs,ours}_edges``); the
    continuations from each project's checkpoint on onnxruntime-training's artifacts in
    ``<case>/{ort,ot}_from_{ours,theirs}``. One onnxruntime-training process."""
    python = ensure_ortt()
    root = str(tmp_path_factory.mktemp("ortt_api_calls"))
    A = onnxtrain_api()
    todo = [(n, serialize(c), "scenario", c["model"](), case_data(n)) for n, c in CASES.items()
            if full() or n in DEFAULT_CASES]
    todo.append(("schedules", serialize(CASES["mlp"]), "schedules", small_mlp(), case_data("mlp")))
    todo += [(n, {"loss": "mse", "optimizer": opt, "frozen": [], "requires_grad": ["W", "B"]}, "steps",
              elementwise_net(), _elementwise_data())
             for n, opt in OPTIMIZERS.items() if full() or n in DEFAULT_OPTIMIZERS]
    jobs = []
    for name, case, kind, model, data in todo:  # onnxtrain's artifacts and its run on them first
        d = _folder(root, name, model, data)
        _NS["generate"](A, case, os.path.join(d, "base.onnx"), os.path.join(d, "ours"))
        _write(os.path.join(d, "ot_ours", "record.json"),
               _run(A, case, kind, os.path.join(d, "ours"), data, os.path.join(d, "ot_ours")))
        common = {"case": case, "data": os.path.join(d, "data.npz"), "folder": os.path.join(d, "theirs")}
        jobs.append({**common, "base": os.path.join(d, "base.onnx"), "generate": True, "kind": kind,
                     "out": os.path.join(d, "ort"), "cases": SCHEDULES, "steps": STEPS})
        if kind == "scenario":  # the edge calls; both checkpoints saved mid-training, continued on 1.19.2's
            os.makedirs(os.path.join(d, "ot_ours_edges"))
            _write(os.path.join(d, "ot_ours_edges", "record.json"),
                   _NS["edges"](A, case, os.path.join(d, "ours"), data, os.path.join(d, "ot_ours_edges")))
            jobs.append({**common, "kind": "edges", "out": os.path.join(d, "ort_edges")})
            for seed in _sequence_seeds():
                for who in ("ours",):
                    out = os.path.join(d, f"ot_{who}_seq{seed}")
                    os.makedirs(out)
                    _write(os.path.join(out, "record.json"),
                           _NS["sequence"](A, case, os.path.join(d, who), data, out, draw_ops(seed)))
                jobs.append({**common, "kind": "sequence", "ops": draw_ops(seed),
                             "out": os.path.join(d, f"ort_seq{seed}")})
            for who, ckpt in (("ours", os.path.join(d, "ot_ours", "ckpt_opt")),
                              ("theirs", os.path.join(d, "ort", "ckpt_opt"))):
                jobs.append({**common, "kind": "continue", "checkpoint": ckpt,
                             "out": os.path.join(d, f"ort_from_{who}")})
    _write(os.path.join(root, "jobs.json"), jobs)
    errors = run_script(_ORT_SCRIPT, os.path.join(root, "jobs.json"), python=python)
    assert not any(errors.values()), errors
    for name, case, kind, _, data in todo:  # then onnxtrain on onnxruntime-training's artifacts
        d = os.path.join(root, name)
        _write(os.path.join(d, "ot_theirs", "record.json"),
               _run(A, case, kind, os.path.join(d, "theirs"), data, os.path.join(d, "ot_theirs")))
        if kind == "scenario":
            for seed in _sequence_seeds():
                out = os.path.join(d, f"ot_theirs_seq{seed}")
                os.makedirs(out)
                _write(os.path.join(out, "record.json"),
                       _NS["sequence"](A, case, os.path.join(d, "theirs"), data, out, draw_ops(seed)))
            os.makedirs(os.path.join(d, "ot_theirs_edges"))
            _write(os.path.join(d, "ot_theirs_edges", "record.json"),
                   _NS["edges"](A, case, os.path.join(d, "theirs"), data, os.path.join(d, "ot_theirs_edges")))
            for who, ckpt in (("ours", os.path.join(d, "ot_ours", "ckpt_opt")),
                              ("theirs", os.path.join(d, "ort", "ckpt_opt"))):
                os.makedirs(os.path.join(d, f"ot_from_{who}"))
                _write(os.path.join(d, f"ot_from_{who}", "record.json"),
                       _NS["continue_from"](A, case, os.path.join(d, "theirs"), ckpt, data))
    return root


def _sequence_seeds() -> list[int]:
    return list(SEQUENCE_SEEDS if full() else DEFAULT_SEQUENCE_SEEDS)


def _run(A, case: dict, kind: str, folder: str, data: dict, out: str) -> dict:
    if kind == "scenario":
        return _NS["scenario"](A, case, folder, data, out)
    if kind == "schedules":
        return _NS["schedules"](A, case, folder, data, SCHEDULES)
    return _NS["optimizer_steps"](A, folder, data, out, STEPS)


# ---------------------------------------------------------------- comparing records
ATOL, RTOL = 2e-5, 1e-4


def _unwrap(v):
    """A record value with OrtValues as the arrays they hold (and generated names without their counter)."""
    if isinstance(v, dict):
        if "ortvalue" in v:
            return _unwrap(v["ortvalue"])
        return {k: _unwrap(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_unwrap(x) for x in v]
    if isinstance(v, str) and v.startswith("onnx::"):
        return v.rsplit("::", 1)[0]  # onnxruntime-training numbers generated names process-wide
    return v


def _ortvalues(v, at: str = "") -> list[str]:
    """Where a record value holds OrtValues."""
    if isinstance(v, dict):
        if "ortvalue" in v:
            return [at]
        return [p for k, x in v.items() for p in _ortvalues(x, f"{at}.{k}")]
    if isinstance(v, list):
        return [p for i, x in enumerate(v) for p in _ortvalues(x, f"{at}[{i}]")]
    return []


def assert_same(ours, theirs, what: str) -> None:
    """Two encoded values agree: the same structure and types, arrays of one dtype and shape within float32
    tolerance, floats as float32."""
    if isinstance(theirs, dict) and "array" in theirs:
        assert isinstance(ours, dict) and "array" in ours, f"{what}: {ours!r:.200} is not an array"
        assert (ours["dtype"], ours["shape"]) == (theirs["dtype"], theirs["shape"]), what
        if theirs["dtype"].startswith(("<U", "object")):
            assert ours["array"] == theirs["array"], what
        else:
            np.testing.assert_allclose(ours["array"], theirs["array"], atol=ATOL, rtol=RTOL, err_msg=what)
    elif isinstance(theirs, dict) and "float" in theirs:
        assert isinstance(ours, dict) and "float" in ours, f"{what}: {ours!r} is not a float"
        # (the floats the API returns, rates and properties, are float32 values in both: the same value)
        x, y = ours["float"], theirs["float"]
        assert x == y or (np.isnan(x) and np.isnan(y)), f"{what}: {x!r} != {y!r}"
    elif isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), \
            f"{what}: {ours!r:.300} vs {theirs!r:.300}"
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{what}.{k}")
    elif isinstance(theirs, list):
        assert isinstance(ours, list) and len(ours) == len(theirs), \
            f"{what}: {ours!r:.300} vs {theirs!r:.300}"
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{what}[{i}]")
    else:
        assert ours == theirs, f"{what}: {ours!r} != {theirs!r}"


def _without(value, name: str):
    """A recorded property list without property ``name``."""
    return {"ok": {"seq": [p for p in value["ok"]["seq"] if p["seq"][0] != name], "type": "list"}}


# Where onnxruntime-training 1.19.2 is the one at fault, what onnxtrain does instead (checked below).
KNOWN = {
    # its Module.__call__ takes every argument that is not a numpy array for an OrtValue and fails on its
    # private attribute (AttributeError '_ortvalue'); onnxtrain refuses one list/tuple/dict argument naming
    # the inputs it expects, and runs nested lists (README: "with any numpy array or list among the inputs")
    "call_one_list", "call_one_tuple", "call_one_dict", "call_nested_lists",
    # np.float32(0.25) is stored as the int 0 there (pybind11 takes it for an int); a float here (README)
    "prop_np_float",
    # a checkpoint saved with its optimizer state resumes at the saved learning rate here (README: the
    # property onnxtrain.learning_rate); onnxruntime keeps only the initial rate and restarts at 0.001
    "ckpt_opt_lr",
    # an eval call on a Module made without an eval model kills its process (SIGSEGV); an error here
    "noeval_call",
}
# the keys whose recorded properties hold the np.float32 property above
_PROPERTY_LISTS = ("prop_after", "ckpt_opt_props", "ckpt_plain_props")

# what onnxtrain's message must name (onnxruntime-training's name a C++ source line instead)
MESSAGES = {
    "call_too_few": lambda c: "expects 2 input(s)", "call_too_many": lambda c: "got 3",
    "call_wrong_dtype": lambda c: "input", "eval_call_x_only": lambda c: "eval model",
    "copy_full_as_trainable": lambda c: "size", "copy_short": lambda c: "Actual: 3",
    "copy_float64": lambda c: "float64", "export_wrong": lambda c: "no_such_output",
    "export_empty": lambda c: "empty", "export_missing_folder": lambda c: "no_folder",
    "param_set_shape": lambda c: c["requires_grad"][0], "param_set_dtype": lambda c: c["requires_grad"][0],
    "param_missing": lambda c: "nope", "param_set_missing": lambda c: "nope",
    "prop_missing": lambda c: "zz", "prop_bad_list": lambda c: "bad",
    "save_folder_missing": lambda c: "no_folder",
    "load_missing": lambda c: "no_such_ckpt", "load_trunc_half": lambda c: "trunc_half",
    "load_trunc_empty": lambda c: "trunc_empty", "load_folder": lambda c: "directory",
    "noeval_export": lambda c: "Eval model",
}


def compare_scenarios(ours: dict, theirs: dict, case: dict, what: str) -> None:
    assert list(ours) == list(theirs), f"{what}: the recorded calls differ"
    for key, b in theirs.items():
        a = ours[key]
        if key in KNOWN:
            if key == "noeval_call":
                assert b == {"crash": True} and "RuntimeError" in a["bases"], (what, key, a)
            elif key == "prop_np_float":
                assert b["ok"]["seq"][1] == {"int": 0, "type": "int"}, (what, key, b)
                assert a["ok"]["seq"][1] == {"float": 0.25, "type": "float"}, (what, key, a)
            elif key == "ckpt_opt_lr":
                assert np.float32(b["ok"]["float"]) == np.float32(1e-3), (what, key, b)
                assert np.float32(a["ok"]["float"]) == np.float32(0.05), (what, key, a)  # the rate it saved
            elif key == "call_nested_lists":
                assert b["err"] == "AttributeError" and "ok" in a, (what, key, a, b)
                assert_same(a["ok"], ours["call_nested_as_arrays"]["ok"], f"{what} {key}")
            else:
                assert b["err"] == "AttributeError" and "ValueError" in a.get("bases", ()), (what, key, a)
            continue
        if key in _PROPERTY_LISTS:
            a, b = _without(a, "nf"), _without(b, "nf")
        if "err" in b:
            assert "err" in a, f"{what} {key}: onnxruntime-training raises {b}, onnxtrain returns {a!r:.300}"
            assert set(b["bases"]) <= set(a["bases"]), \
                f"{what} {key}: onnxtrain's {a['err']} is not also a {b['bases']} ({a['msg']})"
            if key in MESSAGES:
                assert MESSAGES[key](case) in a["msg"], f"{what} {key}: {a['msg']!r}"
            continue
        assert "ok" in a, f"{what} {key}: onnxtrain raises {a}, onnxruntime-training returns {b!r:.300}"
        if not key.startswith("contig_"):  # (1.19.2 returns its C OrtValue there, ours an ndarray with
            # OrtValue's methods: README); elsewhere an OrtValue where 1.19.2 returns one
            assert _ortvalues(a["ok"]) == _ortvalues(b["ok"]), f"{what} {key}: OrtValues where"
        assert_same(_unwrap(a["ok"]), _unwrap(b["ok"]), f"{what} {key}")


def _INT(v: int) -> dict:  # noqa: N802 - reads as a constructor of the record's form
    return {"int": v, "type": "int"}


# the edge calls where onnxtrain differs on purpose, and what it does there
KNOWN_EDGES = {
    # Module.train(0): 1.19.2 keeps the int in .training (annotated bool there); onnxtrain stores bool(mode)
    "train_int_mode": lambda a, b, ours, theirs: a["ok"]["seq"][0] is False and b["ok"]["seq"][0] == _INT(0),
    "train_int_mode_1": lambda a, b, ours, theirs: a["ok"]["seq"][0] is True and b["ok"]["seq"][0] == _INT(1),
    # 2**63 does not fit the int64 property: 1.19.2 stores it as the float 9.223372e18 without a word;
    # onnxtrain refuses it naming the property
    "prop_too_big": lambda a, b, ours, theirs: b == {"ok": None} and a["err"] == "ValueError"
    and "big2" in a["msg"],
    "props_loaded": lambda a, b, ours, theirs: a["ok"]["seq"]
    == [p for p in b["ok"]["seq"] if p["seq"][0] != "big2"],
    # a path where the state goes: 1.19.2 fails on its private attribute (AttributeError '_state'); a
    # TypeError naming the class here
    "state_not_a_state": lambda a, b, ours, theirs: b["err"] == "AttributeError" and "TypeError" in a["bases"]
    and "CheckpointState" in a["msg"],
    # two Modules over one state (README: "Modules built over one CheckpointState share its gradients"):
    # 1.19.2 gives each Module buffers of its own and .grad shows the newest Module's, so the first Module's
    # later call leaves .grad as it was; here it adds to the shared ones. The calls before agree.
    "two_modules": lambda a, b, ours, theirs: _same(a["ok"]["seq"][:3], b["ok"]["seq"][:3])
    and _same(b["ok"]["seq"][4], b["ok"]["seq"][2]) and not _same(a["ok"]["seq"][4], a["ok"]["seq"][2]),
    "two_modules_reset": lambda a, b, ours, theirs: "ok" in a and "ok" in b,
    "two_modules_step": lambda a, b, ours, theirs: "ok" in a and "ok" in b,
    # refused training calls leave the state as it was here; 1.19.2 runs the nodes before the failing one
    # (the loss, for labels of another batch), and a BatchNormalization's running statistics change: a
    # refused step that moves the state is its fault. Everything else it leaves as well.
    "params_after_refusals": lambda a, b, ours, theirs: _same(a, ours["params_before_refusals"])
    and _same(_without_buffers(b), _without_buffers(theirs["params_before_refusals"])),
    # set_learning_rate(True): 1.19.2's float argument takes a bool as 1.0; onnxtrain refuses it (a TypeError
    # naming bool), as a rate given a flag by mistake
    "set_lr_bool": lambda a, b, ours, theirs: b["ok"]["seq"][1] == {"float": 1.0, "type": "float"}
    and "TypeError" in a["bases"] and "bool" in a["msg"],
    # the rate saved with the optimizer state (README): 0.01 here, 1.19.2's default 0.001 there
    "resumed_two_lr": lambda a, b, ours, theirs: np.float32(a["ok"]["float"]) == np.float32(0.01)
    and np.float32(b["ok"]["float"]) == np.float32(1e-3),
}


def _without_buffers(value: dict) -> dict:
    """A recorded parameter list without BatchNormalization's running statistics."""
    return {"ok": {"seq": [p for p in value["ok"]["seq"] if p["seq"][0] not in ("bn.mean", "bn.var")],
                   "type": "list"}}


def _labels(c: dict) -> str:
    return "labels" if c["loss"] == "ce" else "target"


# what onnxtrain's message of an edge call's refusal must name
EDGE_MESSAGES = {
    "labels_other_dtype": _labels, "labels_other_batch": _labels, "eval_other_batch": _labels,
    "input_other_dims": lambda c: "'input'", "input_extra_axis": lambda c: "'input'",
    "module_missing_train": lambda c: "none.onnx", "module_missing_eval": lambda c: "none.onnx",
    "optimizer_missing": lambda c: "none.onnx", "set_lr_str": lambda c: "str",
    "set_lr_int_past_float64": lambda c: "learning rate",
    "sched_int_past_float64_lr": lambda c: "learning rate",
    "sched_float_counts": lambda c: "warmup_step_count", "export_str_names": lambda c: "graph_output_names",
    "device_bad": lambda c: "tpu", "save_to_folder": lambda c: "directory",
    "nominal_get": lambda c: c["requires_grad"][0],
    "nominal_train": lambda c: "nominal", "nominal_copy_trainable": lambda c: "trainable_only",
}


def _same(a, b) -> bool:
    try:
        assert_same(_unwrap(a), _unwrap(b), "")
    except AssertionError:
        return False
    return True


def _sessions_outputs(path: str, feeds: dict[str, np.ndarray]) -> tuple[list[str], list[str], list]:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    inputs = [i.name for i in sess.get_inputs()]
    outputs = [o.name for o in sess.get_outputs()]
    return inputs, outputs, sess.run(None, {k: feeds[k] for k in inputs})


EXPORTS = {"": ("inference1", "inference2", "inference3", "wrong", "empty"),
           "_edges": ("pl", "dup", "str", "tup", "inp", "par")}


# ---------------------------------------------------------------- tests
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", _tiered(CASES, DEFAULT_CASES))
def test_call_sequences_as_onnxruntime_training(runs, name, side):
    """Every call of the Module / Optimizer / CheckpointState sequence returns what onnxruntime-training
    1.19.2 returns on its own artifacts (or raises an error of a class ours is too), on its artifacts and on
    onnxtrain's."""
    d = os.path.join(runs, name)
    compare_scenarios(_read(os.path.join(d, f"ot_{side}", "record.json")),
                      _read(os.path.join(d, "ort", "record.json")), CASES[name], f"{name} ({side})")


@pytest.mark.parametrize("name", _tiered(CASES, DEFAULT_CASES))
def test_checkpoints_cross_load(runs, name):
    """A checkpoint saved (with the optimizer state) mid-training by either project loads in the other and
    continues as in the saver: parameters, properties, eval and training outputs, gradients, updates, on
    1.19.2's artifacts. Only the learning rate differs: onnxtrain resumes the rate it saved (README),
    onnxruntime-training restarts at 0.001 whoever saved."""
    d = os.path.join(runs, name)
    recs = {f"{who}_from_{saver}": _read(os.path.join(d, f"{who}_from_{saver}", "record.json"))
            for who in ("ort", "ot") for saver in ("ours", "theirs")}
    for key, rec in recs.items():
        assert list(rec) == list(recs["ort_from_theirs"]), key
        for call, b in recs["ort_from_theirs"].items():
            a = rec[call]
            assert "ok" in a and "ok" in b, (key, call, a, b)
            if call == "props":  # (the np.float32 property: 0 in every file onnxruntime-training wrote)
                a, b = _without(a, "nf"), _without(b, "nf")
            if call != "lr":
                assert_same(_unwrap(a["ok"]), _unwrap(b["ok"]), f"{name}: {key} {call}")
    rates = {k: np.float32(r["lr"]["ok"]["float"]) for k, r in recs.items()}
    assert rates == {"ort_from_ours": np.float32(1e-3), "ort_from_theirs": np.float32(1e-3),
                     "ot_from_ours": np.float32(0.05), "ot_from_theirs": np.float32(1e-3)}


@pytest.mark.parametrize("side", SIDES)
def test_linear_lr_scheduler_rates_as_onnxruntime_training(runs, side):
    """LinearLRScheduler's rate after construction and after each step (warm-up 0, warm-up == total,
    warm-up > total, total 0, steps past the total, a set_learning_rate in between, an optimizer whose own
    rate differs from initial_lr; and 1.19.2's wrapper's swapped order as swap_warmup_and_total=True) equals
    the rate 1.19.2's get_learning_rate prints, as float32 bits."""
    d = os.path.join(runs, "schedules")
    ours, theirs = (_read(os.path.join(d, f, "record.json")) for f in (f"ot_{side}", "ort"))
    assert list(ours) == list(theirs)
    for key, b in theirs.items():
        a = ours[key]
        assert ("err" in a) == ("err" in b), (key, a, b)
        if key.endswith("_lrs"):
            rates = [np.float32(v["float"]) for v in a["ok"]["seq"]]
            assert rates == [np.float32(v["float"]) for v in b["ok"]["seq"]], key
        elif "ok" in b:
            assert_same(_unwrap(a["ok"]), _unwrap(b["ok"]), key)


def _params(rec: dict, key: str) -> dict[str, np.ndarray]:
    return {t["seq"][0]: np.array(t["seq"][-1]["array"], np.float32) for t in rec[key]["ok"]["seq"]}


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def _worst_ulps(runs: str, name: str, side: str, steps: range) -> int:
    d = os.path.join(runs, name)
    ours, theirs = (_read(os.path.join(d, f, "record.json")) for f in (f"ot_{side}", "ort"))
    worst = 0
    for i in steps:
        assert_same(ours[f"grads_{i}"]["ok"], theirs[f"grads_{i}"]["ok"], f"{name} grads {i}")
        a, b = _params(ours, f"params_{i}"), _params(theirs, f"params_{i}")
        worst = max(worst, *(_ulps(a[k], b[k]) for k in b))
    return worst


def _same_saved_optimizer_state(d: str, side: str) -> None:
    """The checkpoints saved after the 20 steps hold the same step count, initial rate, moments."""
    from onnxtrain.checkpoint import load_checkpoint

    a, b = (load_checkpoint(os.path.join(d, f, "steps_ckpt")) for f in (f"ot_{side}", "ort"))
    assert [(g.name, g.step, np.float32(g.initial_lr)) for g in a.optimizer_groups] == \
        [(g.name, g.step, np.float32(g.initial_lr)) for g in b.optimizer_groups] == [("group0", STEPS, 1e-3)]
    for ga, gb in zip(a.optimizer_groups, b.optimizer_groups):
        assert {p: sorted(m) for p, m in ga.states.items()} == {p: sorted(m) for p, m in gb.states.items()}
        for p, moments in gb.states.items():
            for k, v in moments.items():
                np.testing.assert_allclose(ga.states[p][k], v, rtol=1e-5, atol=1e-6, err_msg=f"{p}.{k}")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", _tiered(OPTIMIZERS, DEFAULT_OPTIMIZERS))
def test_optimizer_updates_as_onnxruntime_training(runs, name, side):
    """AdamW (defaults, no bias correction, other betas/eps, weight decay, clipping) and SGD (clipping too)
    over 20 train-and-step rounds of a model whose gradients are the same bits in any graph: SGD bit for
    bit; AdamW's first update (same weights, gradients, zero moments) within 1 ulp and 20 updates within
    1e-5 (1.19.2's CPU kernel's square root looks approximate: where its first update differs from a
    float32 computation of its own formula, a square root 1 ulp higher gives its value; so bits cannot be
    matched everywhere; the rest of the gap is the xfail below)."""
    _same_saved_optimizer_state(os.path.join(runs, name), side)
    if name.startswith("sgd"):
        assert _worst_ulps(runs, name, side, range(STEPS)) == 0
        return
    assert _worst_ulps(runs, name, side, range(1)) <= 1
    d = os.path.join(runs, name)
    ours, theirs = (_read(os.path.join(d, f, "record.json")) for f in (f"ot_{side}", "ort"))
    for i in range(STEPS):
        a, b = _params(ours, f"params_{i}"), _params(theirs, f"params_{i}")
        for k in b:
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-7, err_msg=f"{name} step {i} {k}")


@pytest.mark.xfail(strict=True, reason=(
    "a kept difference (README, AdamW's rounding order): onnxblock.optim.AdamW takes the bias-corrected "
    "rate in float64, lr*sqrt(1-b2^t)/(1-b1^t), where onnxruntime's AdamWOptimizer CPU kernel takes "
    "c = 1.f - (float)pow(b, t) and lr*(sqrtf(c2)/c1) in float32 (1 - 0.999^2 cancels: its rate is ~1e-5 "
    "off); it updates lr_t*(m/denom) where the kernel does (lr_t*m)/denom, and decays p*(1 - lr*wd), one "
    "pass over the weights, where the kernel's p - (lr*wd)*p takes two. The kernel's order (tried in a "
    "worktree) gives 1 ulp of 1.19.2 over 20 steps instead of 17 and 30; the weights agree within 1e-5 "
    "(test above)"))
@pytest.mark.parametrize("name", _tiered(["adamw", "decay"], DEFAULT_OPTIMIZERS))
def test_adamw_rounds_as_onnxruntime_trainings_kernel(runs, name):
    """20 AdamW updates within 2 ulps of onnxruntime-training 1.19.2's (its square root leaves 1 ulp)."""
    assert _worst_ulps(runs, name, "theirs", range(STEPS)) <= 2
    assert _worst_ulps(runs, name, "ours", range(STEPS)) <= 2


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", _tiered(CASES, DEFAULT_CASES))
def test_edge_calls_as_onnxruntime_training(runs, name, side):
    """Argument types and edge uses (devices, session options, keyword arguments, a path for the state,
    labels of another dtype or batch, inputs of other dims or rank,
    pathlib paths, missing or wrong model files, train(0), learning rates of
    other types, live .data/.grad views, contiguous buffers as copies, 2-D buffers, property numbers at
    their limits and text, saves without an optimizer or as flags of other types, two Optimizers over one
    Module, two Modules over one state, a nominal checkpoint before and after its values are copied in,
    scheduler arguments, export names as str/tuple/duplicates/inputs/parameters) as 1.19.2."""
    d = os.path.join(runs, name)
    ours, theirs = (_read(os.path.join(d, f, "record.json")) for f in (f"ot_{side}_edges", "ort_edges"))
    assert list(ours) == list(theirs)
    if name == "bn":  # (1.19.2's refused step moved the running statistics; see KNOWN_EDGES)
        assert not _same(theirs["params_after_refusals"], theirs["params_before_refusals"])
    for key, b in theirs.items():
        a = ours[key]
        if key in KNOWN_EDGES:
            assert KNOWN_EDGES[key](a, b, ours, theirs), (key, a, b)
        elif "err" in b:
            assert "err" in a and set(b["bases"]) <= set(a["bases"]), (key, a, b)
            if key in EDGE_MESSAGES:
                assert EDGE_MESSAGES[key](CASES[name]) in a["msg"], (key, a["msg"])
        else:
            assert "ok" in a, (key, a, b)
            assert_same(_unwrap(a["ok"]), _unwrap(b["ok"]), f"{name} {key}")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", _tiered(CASES, DEFAULT_CASES))
def test_exported_models_as_onnxruntime_trainings(runs, name, side):
    """The models export_model_for_inferencing wrote (one output, two, reversed, through pathlib, a tuple, a
    duplicate name, an input or a parameter name; none for a wrong or empty list) are the same files in
    both: the same inputs and outputs in the same order, the same values in onnxruntime."""
    d = os.path.join(runs, name)
    data = dict(np.load(os.path.join(d, "data.npz")))
    feeds = {"input": data["x0"], "labels": data["y0"], "target": data["y0"]}
    for suffix, files in EXPORTS.items():
        for f in files:
            paths = [os.path.join(d, f"{who}{suffix}", f + ".onnx") for who in (f"ot_{side}", "ort")]
            assert os.path.exists(paths[0]) == os.path.exists(paths[1]), paths
            if not os.path.exists(paths[1]):
                continue
            if f == "inp":  # a graph input named as the output: 1.19.2 drops the input from the graph, so
                # onnxruntime refuses its file ("Graph output (input) does not exist"); ours keeps it
                assert [i.name for i in onnx.load(paths[1]).graph.input] == [], "1.19.2 writes it whole now"
                ia, oa, va = _sessions_outputs(paths[0], feeds)
                assert (ia, oa) == (["input"], ["input"]), (ia, oa)
                np.testing.assert_array_equal(va[0], feeds["input"])
                continue
            (ia, oa, va), (ib, ob, vb) = (_sessions_outputs(p, feeds) for p in paths)
            assert (ia, oa) == (ib, ob), (f, ia, oa, ib, ob)
            for x, y, n in zip(va, vb, ob):
                np.testing.assert_allclose(x, y, atol=ATOL, rtol=RTOL, err_msg=f"{name} {f} {n}")


def test_a_learning_rate_past_float32_is_infinite_without_a_numpy_warning(runs):
    """set_learning_rate(1e39) and LinearLRScheduler(initial_lr=1e39) store +inf, as 1.19.2 does without a
    word (its edge record; NaN at a warm-up's step 0, inf * 0); onnxtrain let numpy's "overflow encountered
    in cast" (and "invalid value encountered in multiply") RuntimeWarnings out of its float32 arithmetic."""
    import warnings

    theirs = _read(os.path.join(runs, "mlp", "ort_edges", "record.json"))
    assert theirs["set_lr_huge"]["ok"]["seq"][1]["float"] == float("inf")
    assert theirs["sched_huge_lr"]["ok"]["seq"][1]["float"] == float("inf")
    assert theirs["sched_huge_lr_warmup"]["ok"]["seq"][1] == "nan"  # inf * 0 at step 0 of a warm-up
    A = onnxtrain_api()
    folder = os.path.join(runs, "mlp", "ours")

    def optimizer():
        state = A.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        return A.Optimizer(os.path.join(folder, "optimizer_model.onnx"),
                           A.Module(os.path.join(folder, "training_model.onnx"), state))

    opt = optimizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.set_learning_rate(1e39)
        assert opt.get_learning_rate() == float("inf")
        A.scheduler(opt, 0, 5, 1e39)
        assert opt.get_learning_rate() == float("inf")
        opt = optimizer()
        A.scheduler(opt, 2, 5, 1e39)
        assert np.isnan(opt.get_learning_rate())
        opt.set_learning_rate(-1e39)
        assert opt.get_learning_rate() == float("-inf")


@pytest.mark.parametrize("seed", _tiered(SEQUENCE_SEEDS, DEFAULT_SEQUENCE_SEEDS))
@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", _tiered(CASES, DEFAULT_CASES))
def test_drawn_call_sequences_as_onnxruntime_training(runs, name, side, seed):
    """40 calls drawn at random (train/eval calls, resets, steps, rates, gradients, buffers and copies,
    parameter sets, a scheduler and its steps, save-and-reload, exports run by onnxruntime) on one state give
    1.19.2's values."""
    d = os.path.join(runs, name)
    ours, theirs = (_read(os.path.join(d, f, "record.json"))
                    for f in (f"ot_{side}_seq{seed}", f"ort_seq{seed}"))
    assert list(ours) == list(theirs)
    for key, b in theirs.items():
        a = ours[key]
        if "err" in b:
            assert "err" in a and set(b["bases"]) <= set(a["bases"]), (key, a, b)
        else:
            assert "ok" in a, (key, a, b)
            assert_same(_unwrap(a["ok"]), _unwrap(b["ok"]), f"{name} seed {seed}: {key}")

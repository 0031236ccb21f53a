"""``get_tuning_results()``, ``set_tuning_results(results, *, error_on_invalid=False)`` and
``run_with_ortvaluevector(...)`` of the InferenceSession and of the legacy TrainingSession, against
onnxruntime-training 1.16.3's own (tests/ortt.py's legacy venv, CPU build).

1.16.3's CPU provider tunes no kernel (TunableOp is its GPU providers'), and neither does onnxtrain: the
results are an empty list, before and after a set. set_tuning_results reads every entry first (a list of
dicts with 'ep', 'results' {op: {params: kernel id}} and 'validators'; a missing key is a KeyError, a
value of the wrong form a TypeError or ValueError), then checks each against the session's providers: a
provider it does not have, or one of its own that does not tune, is a RuntimeError when error_on_invalid,
else (1.16.3: a logged warning) skipped. One probe runs the same calls on both sides; onnxtrain's exception
must be an instance of 1.16.3's class (by name), and its message must name what is wrong (messages differ
otherwise).

run_with_ortvaluevector (VEC_PROBE) takes parallel lists of input names and values (an OrtValueVector), and
fills ``fetches`` (an OrtValueVector): appended when empty, else written into the values it holds (one per
output, of its shape). Left out of the comparison, where 1.16.3 is at fault: too few fetch_devices aborts
its process; a missing input (without only_execute_path_to_fetches) or a feed name given twice fails inside
its run (RuntimeException); a value in fetches of the output's size but another type gets the output's bytes.
onnxtrain refuses each before running (checked here on onnxtrain only).

A legacy TrainingSession's calls are compared over three run_with_ortvaluevector calls and two run()s after
them, each one an SGD step: the losses, and the weight after each. 1.16.3 runs with
``session.disable_prepacking`` "1" here. With its default options its CPU MatMul packs the constant weight
operand W once, when the session is made, and every later forward multiplies by that packed copy: the
SGD node updates W's own buffer (get_state() shows it move), but the loss of the same batch repeats
(1.333 each call) and each step's gradient is the initial weights' (W_k+1 = W_k - lr g(W_0)), through
run() as through run_with_ortvaluevector, whichever outputs are fetched. That is 1.16.3's fault, not a
rule of the API (the spec's §4.1: a run updates the weights the next run uses; the same packing of Gemm
weights is test_legacy_ort116_numerics.test_peer_packs_its_weights_once), and onnxtrain keeps training
on the updated weights. test_1_16_3_packs_the_matmul_weight_once records it: with packing on, 1.16.3's
first loss and step are onnxtrain's and its later losses repeat the first; off, every step is onnxtrain's.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from tests.ortt import ensure_ort_legacy, run_script

# The probe, run as it is by 1.16.3's python (with ``ort`` = onnxruntime) and here (``ort`` = onnxtrain).
PROBE = r'''
def entry(ep="CPUExecutionProvider", **kw):
    d = {"ep": ep, "results": {}, "validators": {}}
    d.update(kw)
    return {k: v for k, v in d.items() if v is not None}


SET_CASES = {
    "empty": (([],), {}),
    "empty_strict": (([],), {"error_on_invalid": True}),
    "cpu": (([entry()],), {}),
    "cpu_strict": (([entry()],), {"error_on_invalid": True}),
    "cpu_with_results_strict": (([entry(results={"op": {"k": 1}}, validators={"ORT_VERSION": "1"})],),
                                {"error_on_invalid": True}),
    "cuda": (([entry("CUDAExecutionProvider")],), {}),
    "cuda_strict": (([entry("CUDAExecutionProvider")],), {"error_on_invalid": True}),
    "cuda_then_cpu_strict": (([entry("CUDAExecutionProvider"), entry()],), {"error_on_invalid": True}),
    "ep_a_number": (([entry(3)],), {}),
    "ep_a_number_strict": (([entry(3)],), {"error_on_invalid": True}),
    "strict_as_int": (([entry()],), {"error_on_invalid": 2}),
    "strict_none": (([entry()],), {"error_on_invalid": None}),
    "pairs_entry": (([[("ep", "CPUExecutionProvider"), ("results", {}), ("validators", {})]],), {}),
    "no_ep": (([{"results": {}, "validators": {}}],), {}),
    "no_ep_strict": (([{"results": {}, "validators": {}}],), {"error_on_invalid": True}),
    "no_results": (([{"ep": "CPUExecutionProvider", "validators": {}}],), {}),
    "no_validators": (([{"ep": "CPUExecutionProvider", "results": {}}],), {"error_on_invalid": True}),
    "bad_results_before_no_validators": (([{"ep": "CPUExecutionProvider", "results": 3}],), {}),
    "second_entry_bad_after_cuda": (([entry("CUDAExecutionProvider"), {"results": {}, "validators": {}}],),
                                    {}),
    "results_not_a_dict": (([entry(results=3)],), {}),
    "kernel_map_not_a_dict": (([entry(results={"op": 3})],), {}),
    "kernel_id_not_a_number": (([entry(results={"op": {"k": "v"}})],), {}),
    "validators_not_a_dict": (([entry(validators=3)],), {}),
    "entry_a_number": (([3],), {}),
    "none": ((None,), {}),
    "a_dict": (({},), {}),
    "a_tuple": (((entry(),),), {}),
    "strict_a_string": (([],), {"error_on_invalid": "x"}),
    "strict_positional": (([], True), {}),
}


def outcome(f):
    try:
        return {"ok": f()}
    except Exception as e:  # noqa: BLE001
        classes = [c.__name__ for c in type(e).__mro__]
        return {"error": type(e).__name__, "message": str(e), "classes": classes}


def session(ort, model, training, prepacking=True):
    """An SGD TrainingSession of ``model`` (its loss "loss", its weight W), or an InferenceSession; with
    ``prepacking`` False, the options carry session.disable_prepacking "1"."""
    if not training:
        return ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    p = ort.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.optimizer_attributes_map = {"W": {}}
    p.optimizer_int_attributes_map = {"W": {}}
    options = ort.SessionOptions()
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    return ort.TrainingSession(model, p, options, ["CPUExecutionProvider"])


def probe(ort, model, training):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = session(ort, model, training)
        res = {"get": outcome(s.get_tuning_results), "get_arg": outcome(lambda: s.get_tuning_results(1))}
        for name, (args, kw) in SET_CASES.items():
            res["set " + name] = outcome(lambda: s.set_tuning_results(*args, **kw))
        res["get_after"] = outcome(s.get_tuning_results)
        res["providers"] = s._sess.get_providers() if hasattr(s, "_sess") else s.get_providers()
    return res
'''

VEC_PROBE = r'''
def vec_probe(ort, C, path, training):
    import warnings

    import numpy as np

    x, y = np.array([1, 2], np.float32), np.array([10, 20], np.float32)
    dev = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)

    def vector(*arrays):
        v = C.OrtValueVector()
        for a in arrays:
            v.push_back(ort.OrtValue.ortvalue_from_numpy(a)._ortvalue)
        return v

    def call(s, *args, keep=None):
        fetches = args[4]
        r = outcome(lambda: s.run_with_ortvaluevector(*args))
        if isinstance(fetches, C.OrtValueVector):
            r["fetches"] = [np.asarray(v.numpy()).tolist() for v in fetches]
        if keep is not None:
            r["kept"] = np.asarray(keep.numpy()).tolist()
        return r

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if training:
            rng = np.random.default_rng(1)
            x, t = (rng.standard_normal((3, 12)).astype(np.float32) for _ in range(2))
            lr = np.array([0.1], np.float32)
            res = {}
            for prepacking in (False, True):
                s, tag = session(ort, path, training, prepacking), ("" if prepacking else "unpacked ")
                for k in range(3):  # (three steps through the vectors, then two through run())
                    res[f"{tag}loss {k}"] = call(s, ort.RunOptions(), ["x", "t", "Learning_Rate"],
                                                 vector(x, t, lr), ["loss"], C.OrtValueVector(), [dev])
                    res[f"{tag}loss {k}"]["W"] = np.asarray(s.get_state()["W"]).tolist()
                for k in (3, 4):
                    loss = s.run(["loss"], {"x": x, "t": t, "Learning_Rate": lr})[0]
                    res[f"{tag}loss {k}"] = {"ok": None, "fetches": [np.asarray(loss).tolist()],
                                             "W": np.asarray(s.get_state()["W"]).tolist()}
            return res
        s = session(ort, path, training)
        ro, E = ort.RunOptions(), C.OrtValueVector
        path_only = ort.RunOptions()
        path_only.only_execute_path_to_fetches = True
        res = {
            "fill_empty": call(s, ro, ["x", "y"], vector(x, y), ["w", "z"], E(), [dev, dev]),
            "names_as_tuples": call(s, ro, ("y", "x"), vector(y, x), ("z",), E(), (dev,)),
            "more_devices": call(s, ro, ["x", "y"], vector(x, y), ["z"], E(), [dev, dev, dev]),
            "an_output_twice": call(s, ro, ["x", "y"], vector(x, y), ["z", "z"], E(), [dev, dev]),
            "path_only": call(s, path_only, ["x"], vector(x), ["w"], E(), [dev]),
            "no_run_options": call(s, None, ["x", "y"], vector(x, y), ["z"], E(), [dev]),
            "feeds_a_list": call(s, ro, ["x", "y"], list(vector(x, y)), ["z"], E(), [dev]),
            "fetches_a_list": call(s, ro, ["x", "y"], vector(x, y), ["z"], [], [dev]),
            "device_a_string": call(s, ro, ["x", "y"], vector(x, y), ["z"], E(), ["cpu"]),
            "fewer_names_than_feeds": call(s, ro, ["x"], vector(x, y), ["z"], E(), [dev]),
            "unknown_feed": call(s, ro, ["x", "q"], vector(x, y), ["z"], E(), [dev]),
            "unknown_fetch": call(s, ro, ["x", "y"], vector(x, y), ["q"], E(), [dev]),
            "no_fetch_names": call(s, ro, ["x", "y"], vector(x, y), [], E(), []),
            "fetches_of_another_size": call(s, ro, ["x", "y"], vector(x, y), ["z"], vector(x, y, x), [dev]),
            "feed_of_another_type": call(s, ro, ["x", "y"], vector(x.astype(np.int64), y), ["z"], E(), [dev]),
            "feed_of_another_shape": call(s, ro, ["x", "y"], vector(np.ones(3, np.float32), y), ["z"], E(),
                                          [dev]),
        }
        kept = ort.OrtValue.ortvalue_from_numpy(np.zeros(2, np.float32))
        into = C.OrtValueVector()
        into.push_back(kept._ortvalue)
        res["written_into_fetches"] = call(s, ro, ["x", "y"], vector(x, y), ["z"], into, [dev], keep=kept)
        wrong = ort.OrtValue.ortvalue_from_numpy(np.zeros(5, np.float32))
        into = C.OrtValueVector()
        into.push_back(wrong._ortvalue)
        res["fetches_value_of_another_shape"] = call(s, ro, ["x", "y"], vector(x, y), ["z"], into, [dev])
    return res
'''

N, D = 3, 12

# What onnxtrain's message names (1.16.3's says less: "'ep'", "incompatible function arguments", ...)
NAMED = {
    "cpu_strict": ["CPUExecutionProvider", "TunableOp", "index=0"],
    "cpu_with_results_strict": ["CPUExecutionProvider", "TunableOp"],
    "strict_as_int": ["CPUExecutionProvider", "TunableOp"],
    "cuda_strict": ["CUDAExecutionProvider"],
    "cuda_then_cpu_strict": ["CUDAExecutionProvider"],
    "ep_a_number_strict": ["execution provider 3"],
    "no_ep": ["'ep'", "entry 0"],
    "no_ep_strict": ["'ep'"],
    "no_results": ["'results'"],
    "no_validators": ["'validators'"],
    "bad_results_before_no_validators": ["'results'", "int"],
    "second_entry_bad_after_cuda": ["'ep'", "entry 1"],
    "results_not_a_dict": ["'results'", "int"],
    "kernel_map_not_a_dict": ["'results'['op']", "int"],
    "kernel_id_not_a_number": ["'results'['op']['k']", "'v'"],
    "validators_not_a_dict": ["'validators'", "int"],
    "entry_a_number": ["entry 0", "int"],
    "none": ["list", "NoneType"],
    "a_dict": ["list", "dict"],
    "a_tuple": ["list", "tuple"],
    "strict_a_string": ["error_on_invalid", "'x'"],
    "strict_positional": ["positional"],
}
# 1.16.3's message names these too
PEER_NAMED = {"cpu_strict": ["CPUExecutionProvider", "TunableOp", "index=0"],
              "cuda_strict": ["CUDAExecutionProvider"], "ep_a_number_strict": ["execution provider 3"],
              "no_ep": ["'ep'"], "no_results": ["'results'"], "no_validators": ["'validators'"],
              "kernel_id_not_a_number": ["'v'"]}


def _add_neg_model(path: str) -> str:
    """z = x + y, w = -x, of float[2]."""
    v = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("x", "y", "z", "w")]
    g = helper.make_graph([helper.make_node("Add", ["x", "y"], ["z"]), helper.make_node("Neg", ["x"], ["w"])],
                          "add_neg", v[:2], v[2:])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    return path


def _model(path: str) -> str:
    """x[N, D] → MatMul W = y; loss = mean((y - t)^2), an output (W has more than 8 values: 1.16.3's
    ConstantSharing renames smaller weights)."""
    w = (np.random.default_rng(0).standard_normal((D, D)) * 0.3).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Sub", ["y", "t"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "tuning",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, D]),
                           helper.make_tensor_value_info("t", TensorProto.FLOAT, [N, D])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    onnx.save(m, path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return _model(str(tmp_path_factory.mktemp("tuning") / "m.onnx"))


@pytest.fixture(scope="module")
def peer(model: str) -> dict:
    script = (PROBE + "\nimport json, sys\nimport onnxruntime\nonnxruntime.set_default_logger_severity(3)\n"
              "print(json.dumps({k: probe(onnxruntime, sys.argv[1], k == 'training') "
              "for k in ('inference', 'training')}))\n")
    return run_script(script, model, python=ensure_ort_legacy())


def _ours(model: str, training: bool) -> dict:
    ns: dict = {}
    exec(compile(PROBE, "tuning_probe", "exec"), ns)
    return ns["probe"](onnxtrain, model, training)


@pytest.fixture(scope="module")
def ours(model: str) -> dict:
    return {k: _ours(model, k == "training") for k in ("inference", "training")}


KINDS = ["inference", "training"]


def _calls(peer: dict) -> list[str]:
    return [k for k in peer["inference"] if k != "providers"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_answers_and_refusals_are_1_16_3s(kind: str, peer: dict, ours: dict) -> None:
    assert peer[kind]["providers"] == ours[kind]["providers"] == ["CPUExecutionProvider"]
    assert peer[kind]["get"] == {"ok": []}  # (the oracle's answer on its CPU provider)
    for call in _calls(peer):
        p, o = peer[kind][call], ours[kind][call]
        if "ok" in p:
            assert o == p, f"{kind} {call}: 1.16.3 {p}, onnxtrain {o}"
            continue
        assert "error" in o, f"{kind} {call}: 1.16.3 raised {p}, onnxtrain returned {o}"
        assert p["error"] in o["classes"], f"{kind} {call}: 1.16.3 {p}, onnxtrain {o}"
        case = call.removeprefix("set ")
        for word in NAMED.get(case, []):
            assert word in o["message"], f"{kind} {call}: {word!r} not in {o['message']!r}"
        for word in PEER_NAMED.get(case, []):
            assert word in p["message"], f"{kind} {call}: the oracle's {p['message']!r} lacks {word!r}"


def test_every_refusal_is_checked_for_its_words(peer: dict) -> None:
    """Each set_tuning_results case 1.16.3 refuses has the words onnxtrain's message must name."""
    refused = {c.removeprefix("set ") for c, v in peer["inference"].items()
               if c.startswith("set ") and "error" in v}
    assert refused == set(NAMED)


def test_an_invalid_entry_warns_naming_it_when_not_strict(model: str) -> None:
    """Without error_on_invalid, an entry is skipped with a warning naming the provider (1.16.3 logs it)."""
    s = onnxtrain.InferenceSession(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert s.set_tuning_results([{"ep": "CUDAExecutionProvider", "results": {}, "validators": {}},
                                     {"ep": "CPUExecutionProvider", "results": {}, "validators": {}}]) is None
    messages = [str(w.message) for w in caught]
    assert any("Cannot find execution provider CUDAExecutionProvider" in m for m in messages), messages
    assert any("index=1" in m and "CPUExecutionProvider does not support TunableOp" in m for m in messages)
    assert s.get_tuning_results() == []


@pytest.fixture(scope="module")
def vec_peer(model: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    small = _add_neg_model(str(tmp_path_factory.mktemp("vec") / "add_neg.onnx"))
    script = (PROBE + VEC_PROBE + "\nimport json, sys\nimport onnxruntime\n"
              "from onnxruntime.capi import _pybind_state as C\nonnxruntime.set_default_logger_severity(3)\n"
              "print(json.dumps({'inference': vec_probe(onnxruntime, C, sys.argv[1], False), "
              "'training': vec_probe(onnxruntime, C, sys.argv[2], True)}))\n")
    return {"small": small, **run_script(script, small, model, python=ensure_ort_legacy())}


def _vec_ours(small: str, model: str) -> dict:
    from onnxtrain.capi import _pybind_state as C

    ns: dict = {}
    exec(compile(PROBE + VEC_PROBE, "vec_probe", "exec"), ns)
    return {"inference": ns["vec_probe"](onnxtrain, C, small, False),
            "training": ns["vec_probe"](onnxtrain, C, model, True)}


# what onnxtrain's message names
VEC_NAMED = {"no_run_options": ["RunOptions", "NoneType"], "feeds_a_list": ["feeds", "OrtValueVector"],
             "fetches_a_list": ["fetches", "OrtValueVector"], "device_a_string": ["fetch_devices", "'cpu'"],
             "fewer_names_than_feeds": ["feed_names has 1", "feeds has 2"], "unknown_feed": ["'q'"],
             "unknown_fetch": ["q"], "no_fetch_names": ["fetch_names"],
             "fetches_of_another_size": ["fetches holds 3", "1 fetch_names"], "feed_of_another_type": ["x"],
             "feed_of_another_shape": ["x"], "fetches_value_of_another_shape": ["'z'", "[2]"]}


def test_run_with_ortvaluevector_is_1_16_3s(model: str, vec_peer: dict) -> None:
    ours = _vec_ours(vec_peer["small"], model)
    assert vec_peer["inference"]["fill_empty"] == {"ok": None, "fetches": [[-1.0, -2.0], [11.0, 22.0]]}
    assert vec_peer["inference"]["written_into_fetches"]["kept"] == [11.0, 22.0]  # (in place)
    assert [c for c in vec_peer["training"] if c.startswith("unpacked")] == [f"unpacked loss {k}"
                                                                             for k in range(5)]
    for kind in ("inference", "training"):
        for case, p in vec_peer[kind].items():
            if kind == "training" and case.startswith("loss ") and case != "loss 0":
                continue  # (1.16.3's packed weight: test_1_16_3_packs_the_matmul_weight_once)
            o = ours[kind][case]
            if "ok" in p:
                assert o.keys() == p.keys(), f"{kind} {case}: 1.16.3 {p}, onnxtrain {o}"
                assert o["ok"] is None
                np.testing.assert_allclose(np.asarray(o["fetches"]), np.asarray(p["fetches"]), rtol=1e-6,
                                           err_msg=f"{kind} {case}")
                if "kept" in p:
                    assert o["kept"] == p["kept"]
                if "W" in p:  # (the weight after the step, float32 sums in other orders)
                    np.testing.assert_allclose(np.asarray(o["W"]), np.asarray(p["W"]), rtol=1e-5, atol=1e-6,
                                               err_msg=f"{kind} {case}")
                continue
            assert "error" in o, f"{kind} {case}: 1.16.3 raised {p}, onnxtrain returned {o}"
            assert p["error"] in o["classes"], f"{kind} {case}: 1.16.3 {p}, onnxtrain {o}"
            assert o.get("fetches") == p.get("fetches"), f"{kind} {case}: fetches changed"
            for word in VEC_NAMED[case]:
                assert word in o["message"], f"{kind} {case}: {word!r} not in {o['message']!r}"
    assert set(VEC_NAMED) == {c for c, p in vec_peer["inference"].items() if "error" in p}


def test_1_16_3_packs_the_matmul_weight_once(model: str, vec_peer: dict) -> None:
    """1.16.3 with its default options (MatMul prepacking on): its forward keeps multiplying by W as the
    session was made, so the loss of the same batch repeats and every step subtracts the initial gradient,
    while get_state()'s W moves; its first loss and step are onnxtrain's, which then trains on its updated
    W (the float64 forward of its state) as 1.16.3 does with packing off (test above)."""
    ours = _vec_ours(vec_peer["small"], model)["training"]
    peer = vec_peer["training"]
    w0 = numpy_helper.to_array(onnx.load(model).graph.initializer[0]).astype(np.float64)
    rng = np.random.default_rng(1)
    x, t = (rng.standard_normal((3, 12)).astype(np.float32).astype(np.float64) for _ in range(2))
    packed = [np.asarray(peer[f"loss {k}"]["fetches"][0]) for k in range(5)]
    assert all(v == packed[0] for v in packed), packed
    w = [w0] + [np.asarray(peer[f"loss {k}"]["W"], np.float64) for k in range(5)]
    steps = [w[k + 1] - w[k] for k in range(5)]
    for k in range(1, 5):  # (W_k+1 - W_k = W_1 - W_0: the initial weights' gradient every time)
        np.testing.assert_allclose(steps[k], steps[0], rtol=1e-3, atol=1e-6, err_msg=f"1.16.3's step {k}")
    np.testing.assert_allclose(packed[0], ours["loss 0"]["fetches"][0], rtol=1e-6)
    np.testing.assert_allclose(w[1], ours["loss 0"]["W"], rtol=1e-5, atol=1e-6)
    mine = [np.asarray(ours[f"loss {k}"]["fetches"][0], np.float64) for k in range(5)]
    assert all(a > b for a, b in zip(mine, mine[1:])), mine
    for k in range(1, 5):
        weights = np.asarray(ours[f"loss {k - 1}"]["W"], np.float64)
        np.testing.assert_allclose(mine[k], np.mean((x @ weights - t) ** 2),
                                   rtol=1e-5, err_msg=f"onnxtrain's loss {k}")


def test_run_with_ortvaluevector_refuses_before_running_where_1_16_3_fails_inside(vec_peer: dict) -> None:
    """onnxtrain only: 1.16.3 aborts (too few fetch_devices), fails inside its run (a missing input, a name
    given twice) or writes bytes of the wrong type (a fetches value of another type)."""
    from onnxtrain.capi import _pybind_state as C

    s = onnxtrain.InferenceSession(vec_peer["small"])
    x, y = np.array([1, 2], np.float32), np.array([10, 20], np.float32)
    dev = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)

    def vector(*arrays: np.ndarray) -> C.OrtValueVector:
        v = C.OrtValueVector()
        for a in arrays:
            v.push_back(onnxtrain.OrtValue.ortvalue_from_numpy(a))
        return v

    ro = onnxtrain.RunOptions()
    with pytest.raises(onnxtrain.capi._pybind_state.InvalidArgument, match="1 fetch_devices for 2"):
        s.run_with_ortvaluevector(ro, ["x", "y"], vector(x, y), ["z", "w"], C.OrtValueVector(), [dev])
    with pytest.raises(onnxtrain.capi._pybind_state.InvalidArgument, match="y"):
        s.run_with_ortvaluevector(ro, ["x"], vector(x), ["z"], C.OrtValueVector(), [dev])
    with pytest.raises(onnxtrain.capi._pybind_state.InvalidArgument, match=r"\['x'\] more than once"):
        s.run_with_ortvaluevector(ro, ["x", "x"], vector(x, y), ["z"], C.OrtValueVector(), [dev])
    kept = [np.zeros(2, np.float32), np.zeros(2, np.int64)]
    into = vector(*kept)
    with pytest.raises(onnxtrain.capi._pybind_state.RuntimeException, match="'z'.*int64"):
        s.run_with_ortvaluevector(ro, ["x", "y"], vector(x, y), ["w", "z"], into, [dev, dev])
    assert [a.tolist() for a in kept] == [[0.0, 0.0], [0, 0]]  # (checked before any write)

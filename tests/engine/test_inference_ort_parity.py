"""InferenceSession against onnxruntime's own InferenceSession on the same models: the outputs' NodeArgs,
which feeds are taken or refused (and with which exception class), and runs that fetch only some outputs."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import onnxtrain

ort = pytest.importorskip("onnxruntime")

E = h.make_empty_tensor_value_info
X = h.make_tensor_value_info("x", T.FLOAT, ["N", 3])


def _model(nodes, inputs, outputs, inits=(), ir=9, opset=17) -> bytes:
    g = h.make_graph(nodes, "g", inputs, outputs, list(inits))
    return h.make_model(g, opset_imports=[h.make_opsetid("", opset)], ir_version=ir).SerializeToString()


def _args(args) -> list[tuple]:
    return [(a.name, a.type, a.shape) for a in args]


def _i64(name: str, values: list[int], dims: list[int] | None = None) -> onnx.TensorProto:
    return h.make_tensor(name, T.INT64, [len(values)] if dims is None else dims, values)


_RELU = [h.make_node("Relu", ["x"], ["y"])]
_THREE = [h.make_node("Relu", ["x"], ["y"]), h.make_node("Shape", ["y"], ["s"]),
          h.make_node("ReduceSum", ["x"], ["r"], keepdims=0)]
_BRANCHES = {
    "then_branch": h.make_graph([h.make_node("Relu", ["x"], ["t"])], "t", [], [E("t")]),
    "else_branch": h.make_graph([h.make_node("Concat", ["x", "x"], ["e"], axis=0)], "e", [], [E("e")]),
}
_COND = h.make_tensor_value_info("c", T.BOOL, [])

NODE_ARG_MODELS = {
    "no type": _model(_THREE, [X],
                      [E("y"), onnx.ValueInfoProto(name="s"), h.make_value_info("r", onnx.TypeProto())]),
    "type only": _model(_THREE, [X], [h.make_tensor_value_info("y", T.FLOAT, None),
                                      h.make_tensor_value_info("s", T.INT64, None),
                                      h.make_tensor_value_info("r", T.FLOAT, None)]),
    "dims merged": _model(_THREE, [X], [h.make_tensor_value_info("y", T.FLOAT, [None, None]),
                                        h.make_tensor_value_info("s", T.INT64, ["k"]),
                                        h.make_tensor_value_info("r", T.FLOAT, [])]),
    "declared symbol kept": _model(_RELU, [X], [h.make_tensor_value_info("y", T.FLOAT, ["M", None])]),
    "declared size kept": _model(_RELU, [X], [h.make_tensor_value_info("y", T.FLOAT, [5, 3])]),
    "rank contradicted": _model(_RELU, [X], [h.make_tensor_value_info("y", T.FLOAT, [5, 3, 1])]),
    "size contradicted": _model(_RELU, [h.make_tensor_value_info("x", T.FLOAT, [2, 3])],
                                [h.make_tensor_value_info("y", T.FLOAT, [5, 4])]),
    "input of no shape": _model(_RELU, [h.make_tensor_value_info("x", T.FLOAT, None)], [E("y")]),
    "reshape by shape": _model([h.make_node("Shape", ["x"], ["s"]),
                                h.make_node("Reshape", ["x", "s"], ["y"])], [X], [E("y")]),
    "reshape by constant": _model([h.make_node("Reshape", ["x", "c"], ["y"])], [X], [E("y")],
                                  [_i64("c", [3, -1])]),
    "nonzero": _model([h.make_node("NonZero", ["x"], ["y"])], [X], [E("y")]),
    "matmul": _model([h.make_node("MatMul", ["x", "w"], ["y"]), h.make_node("Add", ["y", "y"], ["z"])],
                     [X, h.make_tensor_value_info("w", T.FLOAT, [3, "K"])], [E("z")]),
    "concat": _model([h.make_node("Concat", ["x", "x"], ["y"], axis=0)], [X], [E("y")]),
    "cast": _model([h.make_node("Cast", ["x"], ["y"], to=T.INT64)], [X], [E("y")]),
    "gather a scalar": _model([h.make_node("Gather", ["x", "i"], ["y"], axis=1)], [X], [E("y")],
                              [_i64("i", [1], [])]),
    "ir 3": _model([h.make_node("Add", ["x", "b"], ["y"])], [X, h.make_tensor_value_info("b", T.FLOAT, [3])],
                   [E("y")], [h.make_tensor("b", T.FLOAT, [3], [1, 2, 3])], ir=3, opset=9),
    "overridable": _model([h.make_node("Add", ["x", "b"], ["y"])],
                          [X, h.make_tensor_value_info("b", T.FLOAT, None)], [E("y")],
                          [h.make_tensor("b", T.FLOAT, [3], [1, 2, 3])]),
    "initializer and input as outputs": _model(_RELU, [X], [E("y"), E("b"), E("x")],
                                               [h.make_tensor("b", T.FLOAT, [3], [1, 2, 3])]),
    "sequence": _model([h.make_node("SequenceConstruct", ["x", "x"], ["y"])], [X], [E("y")]),
    "if": _model([h.make_node("If", ["c"], ["y"], **_BRANCHES)], [X, _COND], [E("y")]),
    "large weight": _model([h.make_node("MatMul", ["x", "w"], ["y"])], [X], [E("y")],
                           [h.make_tensor("w", T.FLOAT, [3, 5000], np.ones(15000, np.float32))]),
}


@pytest.mark.parametrize("case", list(NODE_ARG_MODELS))
def test_node_args_are_onnxruntimes(case: str) -> None:
    """Outputs declared without a type or with unknown or symbolic dims show what shape inference finds,
    merged with the declaration as onnxruntime merges them (a contradicted rank or size forgotten)."""
    model = NODE_ARG_MODELS[case]
    ours = onnxtrain.InferenceSession(model)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    for get in ("get_outputs", "get_inputs", "get_overridable_initializers"):
        assert _args(getattr(ours, get)()) == _args(getattr(theirs, get)()), get


def test_node_args_of_a_torch_export_are_onnxruntimes_before_its_graph_rewrites() -> None:
    """A dynamic-batch torch export whose outputs declare nothing: the shapes onnxruntime's loader infers
    (with graph optimizations on, its Reshape fusion names more dims; onnxtrain does not rewrite the
    graph)."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.conv = torch.nn.Linear(12, 4), torch.nn.Conv2d(3, 4, 3)

        def forward(self, x, img):
            y = self.lin(x.reshape(x.shape[0], -1))
            return y.softmax(-1), self.conv(img).flatten(1), torch.nonzero(y > 0), y.argmax(1)

    f = io.BytesIO()
    torch.onnx.export(Net(), (torch.randn(2, 3, 4), torch.randn(2, 3, 8, 8)), f, dynamo=False,
                      input_names=["x", "img"], output_names=["p", "z", "nz", "am"],
                      dynamic_axes={"x": {0: "batch"}, "img": {0: "batch", 2: "H", 3: "W"}})
    m = onnx.load_from_string(f.getvalue())
    for o in m.graph.output:
        o.ClearField("type")
    model = m.SerializeToString()
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    theirs = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    ours = onnxtrain.InferenceSession(model)
    assert _args(ours.get_outputs()) == _args(theirs.get_outputs())
    assert _args(ours.get_outputs())[1] == ("z", "tensor(float)", ["batch", None])


class _WithArray:
    """An object numpy converts (``__array__``) that is no array."""

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array([1.5, 2.0], np.float32)


FEEDS = {
    "python float": 1.5, "python int": 2, "python bool": True, "str": "a", "bytes": b"a",
    "float list": [1.5, 2.0], "int list": [1, 2], "mixed list": [1, 2.5], "bool list": [True, False],
    "str list": ["a", "b"], "empty list": [], "nested list": [[1.0], [2.0]],
    "ragged list": [[1.0], [2.0, 3.0]],
    "tuple": (1.5, 2.0), "set": {1.0}, "numpy float32": np.float32(1.5), "numpy float64": np.float64(1.5),
    "numpy int64": np.int64(2), "numpy bool": np.bool_(True), "numpy str": np.str_("a"),
    "0-d float32": np.array(1.5, np.float32), "0-d int64": np.array(2), "0-d str": np.array("a"),
    "0-d object": np.array("a", object), "float32 array": np.array([1.5, 2.0], np.float32),
    "matrix": np.matrix([[1.5, 2.0]], np.float32), "with __array__": _WithArray(),
}


def _identity(elem: int, shape: list | None) -> bytes:
    return _model([h.make_node("Identity", ["x"], ["y"])], [h.make_tensor_value_info("x", elem, shape)],
                  [h.make_tensor_value_info("y", elem, None)])


def _outcome(sess, feed):
    try:
        return sess.run(None, {"x": feed})[0], None
    except Exception as e:  # noqa: BLE001 - compared below
        return None, e


@pytest.mark.parametrize("shape", [[], None, [2]], ids=["scalar", "no shape", "[2]"])
@pytest.mark.parametrize("elem", [T.FLOAT, T.INT64, T.STRING, T.BOOL],
                         ids=["float", "int64", "string", "bool"])
def test_feeds_are_taken_or_refused_as_onnxruntime_takes_them(elem: int, shape: list | None) -> None:
    """A numpy array, a list or an OrtValue is taken (a list converted to the input's type; for a string input
    each item as its str()); a Python or numpy scalar, a tuple, a set, a str or bytes, and an object that is
    only convertible (``__array__``) are refused with onnxruntime's exception class (a RuntimeError)."""
    import onnxtrain.capi.onnxruntime_pybind11_state as ours_c

    model = _identity(elem, shape)
    so = ort.SessionOptions()
    so.log_severity_level = 4
    theirs = ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    ours = onnxtrain.InferenceSession(model)
    for what, feed in FEEDS.items():
        (want, their_error), (got, our_error) = _outcome(theirs, feed), _outcome(ours, feed)
        if their_error is None:
            assert our_error is None, (what, our_error)
            assert got.dtype == want.dtype and got.shape == want.shape, what
            assert got.tolist() == want.tolist(), what
        else:
            assert our_error is not None, (what, their_error)
            cls = type(their_error)
            if cls.__module__.startswith("onnxruntime"):  # its binding's classes, as onnxtrain names them
                cls = getattr(ours_c, cls.__name__)
            assert isinstance(our_error, cls), (what, their_error, our_error)
            assert "'x'" in str(our_error) or "x" in str(our_error), what


def test_torch_tensors_are_refused_as_onnxruntime_refuses_them() -> None:
    torch = pytest.importorskip("torch")
    model = _identity(T.FLOAT, [2])
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    with pytest.raises(RuntimeError, match="numpy array"):
        theirs.run(None, {"x": torch.tensor([0.5, -2.0])})
    with pytest.raises(RuntimeError, match="numpy array"):
        onnxtrain.InferenceSession(model).run(None, {"x": torch.tensor([0.5, -2.0])})


def test_the_training_session_still_takes_tuples_and_python_numbers() -> None:
    """The legacy TrainingSession (a separate API) keeps converting tuples of Python numbers (here the labels
    and the learning rate) to its inputs' types."""
    from tests.session.helpers import mlp_model, params

    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.integers(0, 4, 4)
    lr_name = params().lr_params_feed_name
    weights = []
    for labels, lr in ((y, np.array([0.1], np.float32)), (tuple(int(k) for k in y), (0.1,))):
        sess = onnxtrain.TrainingSession(mlp_model().SerializeToString(), params())
        sess.run(["loss"], {"x": x, "y": labels, lr_name: lr})
        weights.append(sess.get_state()["W1"])
    np.testing.assert_array_equal(weights[1], weights[0])


_RELU_MODEL = _model(_RELU, [h.make_tensor_value_info("x", T.FLOAT, [2])],
                     [h.make_tensor_value_info("y", T.FLOAT, [2])])


@pytest.mark.parametrize("providers,options", [
    (["FooExecutionProvider"], None),
    (["CPUExecutionProvider"], [{}, {}]),
    ([("CPUExecutionProvider", {"a": 1})], [{}]),
], ids=["unknown name", "options of another length", "options twice"])
def test_a_bad_providers_argument_falls_back_to_the_cpu_as_in_onnxruntime(providers, options, capsys) -> None:
    """onnxruntime's constructor falls back to the CPU once (its "EP Error" banner on stdout, fallback then
    disabled); with enable_fallback=0 it raises (a RuntimeError or a ValueError)."""
    import warnings

    x = np.array([-1.0, 2.0], np.float32)
    sessions, printed = [], []
    for lib in (ort, onnxtrain):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sessions.append(lib.InferenceSession(_RELU_MODEL, providers=providers, provider_options=options))
        printed.append(capsys.readouterr().out)
    assert all("EP Error" in out and "Falling back to ['CPUExecutionProvider']" in out for out in printed)
    theirs, ours = sessions
    assert ours.get_providers() == theirs.get_providers() == ["CPUExecutionProvider"]
    assert ours._enable_fallback is theirs._enable_fallback is False
    np.testing.assert_array_equal(ours.run(None, {"x": x})[0], theirs.run(None, {"x": x})[0])
    for lib in (ort, onnxtrain):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises((RuntimeError, ValueError)) as e:
                lib.InferenceSession(_RELU_MODEL, providers=providers, provider_options=options,
                                     enable_fallback=0)
        if lib is ort:
            want = type(e.value)
        else:
            assert isinstance(e.value, want)


def test_provider_options_and_fallback_switches_are_onnxruntimes() -> None:
    for providers in (["CPUExecutionProvider"], [("CPUExecutionProvider", {"arena_extend_strategy": "1"})]):
        ours = onnxtrain.InferenceSession(_RELU_MODEL, providers=providers)
        theirs = ort.InferenceSession(_RELU_MODEL, providers=providers)
        assert ours.get_provider_options() == theirs.get_provider_options()
        assert ours._enable_fallback is theirs._enable_fallback is True
        for s in (ours, theirs):
            s.disable_fallback()
        assert ours._enable_fallback is theirs._enable_fallback is False
        for s in (ours, theirs):
            s.enable_fallback()
        assert ours._enable_fallback is theirs._enable_fallback is True


def test_only_execute_path_to_fetches_needs_only_the_inputs_on_the_path() -> None:
    """onnxruntime 1.32's inference package still needs every input with the option (its run refuses a missing
    one); onnxtrain, as onnxruntime-training's builds, needs only those on the fetches' path, and gives the
    same values as onnxruntime fed everything."""
    vi = h.make_tensor_value_info
    model = _model([h.make_node("Relu", ["a"], ["ya"]), h.make_node("Neg", ["b"], ["yb"])],
                   [vi("a", T.FLOAT, [2]), vi("b", T.FLOAT, [2])],
                   [vi("ya", T.FLOAT, [2]), vi("yb", T.FLOAT, [2])])
    a = np.array([-1.0, 2.0], np.float32)
    theirs = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    ours = onnxtrain.InferenceSession(model)
    want = theirs.run(["ya"], {"a": a, "b": a})[0]
    ro, their_ro = onnxtrain.RunOptions(), ort.RunOptions()
    ro.only_execute_path_to_fetches = their_ro.only_execute_path_to_fetches = True
    with pytest.raises(ValueError, match="b"):
        theirs.run(["ya"], {"a": a}, their_ro)
    np.testing.assert_array_equal(ours.run(["ya"], {"a": a}, ro)[0], want)
    got = ours.run_with_ort_values(["ya"], {"a": onnxtrain.OrtValue.ortvalue_from_numpy(a)}, ro)[0]
    np.testing.assert_array_equal(got.numpy(), want)
    io = ours.io_binding()
    io.bind_cpu_input("a", a)
    io.bind_output("ya")
    ours.run_with_iobinding(io, ro)
    np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], want)
    with pytest.raises(ValueError, match="'b'"):  # without the option every input is needed, as there
        ours.run(["ya"], {"a": a})


_FLOATS = h.make_tensor_type_proto(T.FLOAT, None)
_SEQ_MODEL = _model([h.make_node("SequenceLength", ["x"], ["y"])],
                    [h.make_value_info("x", h.make_sequence_type_proto(_FLOATS))],
                    [h.make_tensor_value_info("y", T.INT64, [])])
_OPTIONAL_MODEL = _model([h.make_node("OptionalHasElement", ["x"], ["y"])],
                         [h.make_value_info("x", h.make_optional_type_proto(_FLOATS))],
                         [h.make_tensor_value_info("y", T.BOOL, [])], opset=18)
_ONES = np.ones(2, np.float32)


@pytest.mark.parametrize("model", [_SEQ_MODEL, _OPTIONAL_MODEL], ids=["sequence", "optional tensor"])
@pytest.mark.parametrize("feed", [[_ONES, _ONES], (_ONES, _ONES), [], [1.0, 2.0], 1.5, np.float32(1.5),
                                  _ONES, None],
                         ids=["list", "tuple", "empty list", "list of floats", "python float", "numpy scalar",
                              "array", "None"])
def test_sequence_and_optional_feeds_are_taken_or_refused_as_in_onnxruntime(model: bytes, feed) -> None:
    """A sequence input takes a list of arrays, not a tuple of them; None fed to it is onnxruntime's Fail."""
    import onnxtrain.capi.onnxruntime_pybind11_state as ours_c

    so = ort.SessionOptions()
    so.log_severity_level = 4
    (want, their_error) = _outcome(ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]), feed)
    (got, our_error) = _outcome(onnxtrain.InferenceSession(model), feed)
    if their_error is None:
        assert our_error is None, our_error
        assert got.tolist() == want.tolist() and got.dtype == want.dtype
    else:
        cls = type(their_error)
        cls = getattr(ours_c, cls.__name__) if cls.__module__.startswith("onnxruntime") else cls
        assert isinstance(our_error, cls), (their_error, our_error)


@pytest.mark.parametrize("device", ["cuda", "gpu", "dml"])
def test_an_output_bound_by_name_to_another_known_device_is_made_on_the_cpu(device: str) -> None:
    """onnxruntime's CPU package makes an output bound by name to a device it knows (without a buffer) on
    the CPU; binding an input there, or to a device name it does not know, fails in both."""
    x = np.array([-1.0, 2.0], np.float32)
    results = []
    for lib in (ort, onnxtrain):
        sess = lib.InferenceSession(_RELU_MODEL, providers=["CPUExecutionProvider"])
        io = sess.io_binding()
        io.bind_cpu_input("x", x)
        io.bind_output("y", device)
        sess.run_with_iobinding(io)
        assert io.get_outputs()[0].device_name() == "cpu"
        results.append(io.copy_outputs_to_cpu()[0])
        with pytest.raises(Exception, match="mps"):
            io.bind_output("y", "mps")
        with pytest.raises(RuntimeError):
            io.bind_input("x", device, 0, np.float32, [2], x.ctypes.data)
            sess.run_with_iobinding(io)
    np.testing.assert_array_equal(results[1], results[0])


def test_one_output_name_in_place_of_the_list_is_a_type_error() -> None:
    x = np.array([-1.0, 2.0], np.float32)
    for lib in (ort, onnxtrain):
        sess = lib.InferenceSession(_RELU_MODEL, providers=["CPUExecutionProvider"])
        with pytest.raises(TypeError):
            sess.run("y", {"x": x})
        with pytest.raises(TypeError):
            sess.run_with_ort_values("y", {"x": lib.OrtValue.ortvalue_from_numpy(x)})

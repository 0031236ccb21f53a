"""More of onnxruntime's Python tests, ported to onnxtrain's ONNX backend (``onnxtrain.backend``), its
InferenceSession and the engine's kernels: onnxruntime_test_python_backend.py, _backend_mlops.py, _mlops.py,
_nested_control_flow_op.py, _sparse_matmul.py, _symlink_data.py, onnxruntime_test_scatternd.py,
onnxruntime_scatternd_test.py and onnx_test_trilu.py.

onnxruntime's tests read models from its testdata folder; the same kinds of model are built here (or taken
from the examples the onnxruntime package ships, ``onnxruntime.datasets``). Each test runs onnxruntime 1.32
on the same model and feeds as the oracle (numpy's triu/tril and onnx.reference besides, where onnxruntime's
test used them). The CUDA/TensorRT, optimizer-output and profiling parts of those files are not ported
(onnxtrain runs on the CPU and writes no onnxruntime-optimized graph); the docstring of each test names the
onnxruntime test it covers.
"""

from __future__ import annotations

import itertools
import os
import struct
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
import onnxtrain.backend as tbackend

ort = pytest.importorskip("onnxruntime")
ort_backend = pytest.importorskip("onnxruntime.backend")

ML = "ai.onnx.ml"
F = TensorProto.FLOAT
CPU = ["CPUExecutionProvider"]


def _example(name: str) -> str:
    """A model file that the onnxruntime package ships as an example (mul_1.onnx, logreg_iris.onnx)."""
    path = os.path.join(os.path.dirname(ort.__file__), "datasets", name)
    if not os.path.exists(path):
        pytest.skip(f"onnxruntime's example {name} is not installed")
    return path


def _model(nodes: list, inputs: list, outputs: list, opsets: dict[str, int], inits: list = (),
           ir: int = 8) -> bytes:
    graph = helper.make_graph(nodes, "ported", inputs, outputs, list(inits))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets.items()])
    m.ir_version = ir
    return m.SerializeToString()


def _sessions(model: bytes | str) -> tuple[Any, Any]:
    return ort.InferenceSession(model, providers=CPU), onnxtrain.InferenceSession(model, providers=CPU)


def _same_run(model: bytes | str, feeds: dict, names: list[str] | None = None) -> list:
    """onnxtrain's outputs, checked equal (values, types) to onnxruntime's on the same feeds."""
    want_s, got_s = _sessions(model)
    want, got = want_s.run(names, feeds), got_s.run(names, feeds)
    assert len(got) == len(want)
    for w, g in zip(want, got):
        if isinstance(w, np.ndarray):
            assert isinstance(g, np.ndarray) and g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7) if w.dtype.kind == "f" else \
                np.testing.assert_array_equal(g, w)
        else:
            assert g == w
    return got


# ---------------------------------------------------------------- onnxruntime_test_python_backend.py


def test_backend_prepare_and_run_as_onnxruntime_backend() -> None:
    """testRunModel: ``prepare`` on a file path (and its bytes) and ``run`` with one array."""
    path = _example("mul_1.onnx")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    want = ort_backend.prepare(path).run(x)
    with open(path, "rb") as f:
        serialized = f.read()
    for model in (path, serialized):
        got = tbackend.prepare(model).run(x)
        assert isinstance(got, list) and len(got) == len(want) == 1
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(tbackend.prepare(model).run([x])[0], want[0])
    np.testing.assert_array_equal(tbackend.run(path, x)[0], ort_backend.run(path, x)[0])


def test_backend_prepare_takes_a_rep_or_a_session() -> None:
    """onnxruntime's backend.prepare: a prepared rep is returned as is, an InferenceSession is wrapped."""
    path = _example("mul_1.onnx")
    x = np.ones((3, 2), np.float32)
    rep = tbackend.prepare(path)
    assert tbackend.prepare(rep) is rep
    assert ort_backend.prepare(ort_backend.prepare(path)) is not None
    got = tbackend.prepare(onnxtrain.InferenceSession(path)).run(x)
    want = ort_backend.prepare(ort.InferenceSession(path, providers=CPU)).run(x)
    np.testing.assert_array_equal(got[0], want[0])


def test_backend_devices_as_onnxruntime_backend() -> None:
    """backend.supports_device / is_compatible / prepare(device=...) as onnxruntime's CPU build answers."""
    path = _example("mul_1.onnx")
    for device in ("CPU", "cpu", "GPU", "CUDA", "CPU-FP32"):
        assert tbackend.supports_device(device) == ort_backend.supports_device(device), device
    model = onnx.load(path)
    for device in (None, "CPU", "GPU"):
        assert tbackend.is_compatible(model, device) == ort_backend.is_compatible(model, device), device
    for device in ("GPU", "CUDA"):
        with pytest.raises(RuntimeError, match="Incompatible device") as want:
            ort_backend.prepare(path, device)
        with pytest.raises(RuntimeError, match=f"Incompatible device expected '{device}'") as got:
            tbackend.prepare(path, device)
        assert str(got.value) == str(want.value)


def test_backend_options_by_keyword_as_onnxruntime_backend() -> None:
    """onnxruntime's backend takes a safe list of SessionOptions / RunOptions attributes as keywords and
    refuses the other attributes of those classes with a RuntimeError naming the attribute."""
    path = _example("mul_1.onnx")
    x = np.ones((3, 2), np.float32)
    want = ort_backend.prepare(path, intra_op_num_threads=1, use_deterministic_compute=True).run(
        x, logid="a", only_execute_path_to_fetches=True)
    got = tbackend.prepare(path, intra_op_num_threads=1, use_deterministic_compute=True).run(
        x, logid="a", only_execute_path_to_fetches=True)
    np.testing.assert_array_equal(got[0], want[0])
    rep = tbackend.prepare(path, intra_op_num_threads=1)
    assert rep.session.get_session_options().intra_op_num_threads == 1
    for module in (ort_backend, tbackend):
        with pytest.raises(RuntimeError, match="SessionOptions attribute 'optimized_model_filepath' is not "
                                               "permitted via the backend API"):
            module.prepare(path, optimized_model_filepath="never.onnx")
        with pytest.raises(RuntimeError, match="RunOptions attribute 'terminate' is not permitted"):
            module.prepare(path).run(x, terminate=True)
        # names neither class has are let through, as onnxruntime's backend lets them
        np.testing.assert_array_equal(module.prepare(path, not_an_option=1).run(x, nor_this=2)[0], want[0])
    assert not os.path.exists("never.onnx")


def test_backend_one_value_for_a_model_of_two_inputs() -> None:
    """onnxruntime's backend: one value (not a list) for a model of two inputs is a RuntimeError."""
    model = _model([helper.make_node("Add", ["a", "b"], ["c"])],
                   [helper.make_tensor_value_info(n, F, [2]) for n in "ab"],
                   [helper.make_tensor_value_info("c", F, [2])], {"": 17})
    with pytest.raises(RuntimeError, match="Model expect 2 inputs"):
        ort_backend.prepare(model).run(np.ones(2, np.float32))
    with pytest.raises(RuntimeError, match="expects 2 inputs"):
        tbackend.prepare(model).run(np.ones(2, np.float32))


def test_only_execute_path_to_fetches_runs_the_fetched_branch() -> None:
    """testAllocationPlanWorksWithOnlyExecutePathToFetchesOption: two branches whose intermediates have the
    same size, each fetched alone with only_execute_path_to_fetches."""
    vi = [helper.make_tensor_value_info(n, F, [10]) for n in ("inp0", "inp1", "outp0", "outp1")]
    model = _model([helper.make_node("Add", ["inp0", "inp1"], ["tsor0"]),
                    helper.make_node("Sub", ["inp0", "inp1"], ["tsor1"]),
                    helper.make_node("Neg", ["tsor0"], ["outp0"]),
                    helper.make_node("Neg", ["tsor1"], ["outp1"])], vi[:2], vi[2:], {"": 17})
    rng = np.random.default_rng(0)
    feeds = {"inp0": rng.standard_normal(10).astype(np.float32),
             "inp1": rng.standard_normal(10).astype(np.float32)}
    want_s, got_s = _sessions(model)
    for name in ("outp0", "outp1", "outp1", "outp0"):
        ro, tro = ort.RunOptions(), onnxtrain.RunOptions()
        ro.only_execute_path_to_fetches = tro.only_execute_path_to_fetches = True
        want = want_s.run([name], feeds, ro)[0]
        got = got_s.run([name], feeds, tro)[0]
        np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------- onnxruntime_test_python_backend_mlops.py


def _dict_vectorizer_model() -> bytes:
    """DictVectorizer over int64 keys 0..4, then a LinearRegressor: one [1, 1] output."""
    map_type = helper.make_map_type_proto(TensorProto.INT64, helper.make_tensor_type_proto(F, []))
    return _model(
        [helper.make_node("DictVectorizer", ["float_input"], ["v"], domain=ML,
                          int64_vocabulary=[0, 1, 2, 3, 4]),
         helper.make_node("LinearRegressor", ["v"], ["variable1"], domain=ML,
                          coefficients=[1.5, 2.0, -1.0, 3.0, 0.5], intercepts=[10.0])],
        [helper.make_value_info("float_input", map_type)],
        [helper.make_tensor_value_info("variable1", F, [1, 1])], {"": 17, ML: 1})


_MAP = {0: 25.0, 1: 5.13, 2: 0.0, 3: 0.453, 4: 5.966}


def test_backend_runs_a_model_whose_input_is_a_map() -> None:
    """testRunModelNonTensor: ``rep.run(dict)`` feeds the dict as the model's one map input."""
    model = _dict_vectorizer_model()
    want = ort_backend.prepare(model).run(_MAP)
    got = tbackend.prepare(model).run(_MAP)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    # a dict of feeds by name is still taken for a model whose input is a tensor
    path = _example("mul_1.onnx")
    x = np.ones((3, 2), np.float32)
    want = ort_backend.prepare(path).run(x)
    np.testing.assert_array_equal(tbackend.prepare(path).run({"X": x})[0], want[0])


def _same_label_maps(want: list[dict], got: list[dict]) -> None:
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert sorted(g) == sorted(w)
        np.testing.assert_allclose([g[k] for k in sorted(w)], [w[k] for k in sorted(w)], rtol=1e-5, atol=1e-7)


def test_backend_runs_onnxruntimes_logreg_iris_example() -> None:
    """testRunModelProto, testRunModelProtoApi: onnxruntime's example logreg_iris.onnx (LinearClassifier,
    Normalizer, ZipMap) through ``prepare(ModelProto).run`` and ``run_model``. Its LinearClassifier holds 12
    coefficients for 3 intercepts and declares 2 features: onnxruntime reads the first 3 × 2."""
    model = onnx.load(_example("logreg_iris.onnx"))
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], dtype=np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"float_input": x})
    for got in (tbackend.prepare(model).run(x), tbackend.OnnxtrainBackend.run_model(model, x)):
        np.testing.assert_array_equal(got[0], want[0])
        assert got[0].dtype == want[0].dtype
        _same_label_maps(want[1], got[1])


# ---------------------------------------------------------------- onnxruntime_test_python_mlops.py


@pytest.mark.parametrize("labels", ["strings", "int64s"])
def test_zipmap_outputs_as_onnxruntime(labels: str) -> None:
    """testZipMapStringFloat, testZipMapInt64Float: the output's type string and the list of dicts."""
    classes = ["class1", "class2", "class3"] if labels == "strings" else [10, 20, 30]
    key = TensorProto.STRING if labels == "strings" else TensorProto.INT64
    out = helper.make_sequence_type_proto(
        helper.make_map_type_proto(key, helper.make_tensor_type_proto(F, [])))
    node = helper.make_node("ZipMap", ["X"], ["Z"], domain=ML, **{f"classlabels_{labels}": classes})
    model = _model([node], [helper.make_tensor_value_info("X", F, [2, 3])],
                   [helper.make_value_info("Z", out)], {"": 17, ML: 1})
    want_s, got_s = _sessions(model)
    pairs = ((want_s.get_inputs(), got_s.get_inputs()), (want_s.get_outputs(), got_s.get_outputs()))
    for want_io, got_io in pairs:
        assert [(a.name, a.type, a.shape) for a in got_io] == [(a.name, a.type, a.shape) for a in want_io]
    x = np.array([1.0, 0.0, 3.0, 44.0, 23.0, 11.0], dtype=np.float32).reshape((2, 3))
    want, got = want_s.run(["Z"], {"X": x})[0], got_s.run(["Z"], {"X": x})[0]
    assert got == want
    assert [type(k) for d in got for k in d] == [type(k) for d in want for k in d]


def test_dict_vectorizer_feeds_as_onnxruntime() -> None:
    """testDictVectorizer: the map input's type and shape, Python and numpy keys and values, and a key of
    the wrong type refused."""
    model = _dict_vectorizer_model()
    want_s, got_s = _sessions(model)
    assert [(i.name, i.type, i.shape) for i in got_s.get_inputs()] == \
        [(i.name, i.type, i.shape) for i in want_s.get_inputs()]
    assert [(o.name, o.type, o.shape) for o in got_s.get_outputs()] == \
        [(o.name, o.type, o.shape) for o in want_s.get_outputs()]
    feeds = [_MAP, {np.int64(k): np.float32(v) for k, v in _MAP.items()},
             {np.int64(k): np.float64(v) for k, v in _MAP.items()},
             {np.int32(k): np.float64(v) for k, v in _MAP.items()}, {7: 1.0, 1: 2.0}]
    for x in feeds:
        np.testing.assert_allclose(got_s.run(None, {"float_input": x})[0],
                                   want_s.run(None, {"float_input": x})[0], rtol=1e-6)
    wrong = dict(_MAP, a=5.6)
    with pytest.raises(RuntimeError, match="key type"):
        want_s.run(None, {"float_input": wrong})
    with pytest.raises(RuntimeError, match="'a'"):
        got_s.run(None, {"float_input": wrong})


def test_label_encoder_string_feeds_as_onnxruntime() -> None:
    """testLabelEncoder: str and object arrays into a string-to-int64 LabelEncoder."""
    model = _model([helper.make_node("LabelEncoder", ["input"], ["variable"], domain=ML,
                                     keys_strings=["1", "2", "3", "4"], values_int64s=[0, 1, 2, 3])],
                   [helper.make_tensor_value_info("input", TensorProto.STRING, [1, 1])],
                   [helper.make_tensor_value_info("variable", TensorProto.INT64, [1, 1])], {"": 17, ML: 2})
    for x in (np.array([["4"]]), np.array(["4"], ndmin=2, dtype=object), np.array([["9"]])):
        _same_run(model, {"input": x})


def test_string_feed_of_raw_bytes_keeps_every_byte() -> None:
    """test_run_model_mlnet: string categories with NULs inside, fed as numpy void arrays of 4 and 5 bytes."""
    model = _model([helper.make_node("OneHotEncoder", ["C1"], ["C12"], domain=ML,
                                     cats_strings=["B\0B\0", "Z", "C\0C\0", "D"], zeros=1)],
                   [helper.make_tensor_value_info("C1", TensorProto.STRING, [1, 3])],
                   [helper.make_tensor_value_info("C12", F, [1, 3, 4])], {"": 17, ML: 1})
    for width in (4, 5):
        pad = b"\0" * (width - 4)
        c1 = np.array([b"A\0A\0" + pad, b"B\0B\0" + pad, b"C\0C\0" + pad], np.void).reshape(1, 3)
        got = _same_run(model, {"C1": c1})
        assert got[0].sum() == (2 if width == 4 else 0)


@pytest.mark.parametrize("op", ["TreeEnsembleRegressor", "TreeEnsemble"])
def test_tree_ensemble_with_double_thresholds(op: str) -> None:
    """test_run_model_tree_ensemble_aionnxml_3: a tree whose threshold is a double that float32 rounds
    (TreeEnsembleRegressor-3's nodes_values_as_tensor, float output; TreeEnsemble-5's nodes_splits, double
    output): float64 feeds on either side of it give onnxruntime's leaves and output type."""
    thresholds = np.array([1.7999999523162842, 0.0, 0.0], np.float64)
    weights = numpy_helper.from_array(np.array([0.7284910678863525, 0.9134243130683899], np.float64))
    if op == "TreeEnsembleRegressor":
        node = helper.make_node(
            op, ["X"], ["Y"], domain=ML, n_targets=1, nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2],
            nodes_featureids=[2, 0, 0], nodes_modes=["BRANCH_LEQ", "LEAF", "LEAF"],
            nodes_truenodeids=[1, 0, 0], nodes_falsenodeids=[2, 0, 0],
            nodes_missing_value_tracks_true=[0, 0, 0],
            nodes_values_as_tensor=numpy_helper.from_array(thresholds), target_treeids=[0, 0],
            target_nodeids=[1, 2], target_ids=[0, 0], target_weights_as_tensor=weights)
        out, opsets = F, {"": 17, ML: 3}
    else:
        node = helper.make_node(
            op, ["X"], ["Y"], domain=ML, n_targets=1, aggregate_function=1, post_transform=0, tree_roots=[0],
            nodes_modes=numpy_helper.from_array(np.array([0], np.uint8)), nodes_featureids=[2],
            nodes_splits=numpy_helper.from_array(thresholds[:1]), nodes_truenodeids=[0], nodes_trueleafs=[1],
            nodes_falsenodeids=[1], nodes_falseleafs=[1], leaf_targetids=[0, 0], leaf_weights=weights)
        out, opsets = TensorProto.DOUBLE, {"": 21, ML: 5}
    model = _model([node], [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [None, 4])],
                   [helper.make_tensor_value_info("Y", out, [None, 1])], opsets)
    iris = np.array([[0, 1, 1.7999999523162842, 3], [0, 1, 1.7999999523, 3], [0, 1, 1.79999995232, 3]])
    leaves = [0.7284910678863525, 0.7284910678863525, 0.9134243130683899]
    for x, want in ((iris, leaves), (iris.astype(np.float32).astype(np.float64), leaves[:1] * 3)):
        got = _same_run(model, {"X": x})[0]
        np.testing.assert_allclose(got[:, 0], want, rtol=1e-7)


# ---------------------------------------------------- onnxruntime_test_python_nested_control_flow_op.py


def _nested_optional_model() -> bytes:
    """Three levels of If reading the main graph's inputs from the inner bodies: x1 + x2 when the optional
    x1 is there, else (x3 ≥ 0 ? expand(x3 + 2) : x2 + 1)."""
    def fill(name: str, shape: list[int], value: float) -> tuple[onnx.NodeProto, onnx.TensorProto]:
        dims = numpy_helper.from_array(np.array(shape, np.int64), f"{name}.shape")
        return helper.make_node("ConstantOfShape", [dims.name], [name],
                                value=helper.make_tensor("v", F, [1], [value])), dims

    def out(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, F, [1, 2])

    has_x1 = helper.make_graph([helper.make_node("OptionalGetElement", ["x1.opt"], ["x1"]),
                                helper.make_node("Add", ["x1", "x2"], ["a"])], "x1_x2", [], [out("a")])
    one, one_dims = fill("one", [1, 2], 1.0)
    x2_plus = helper.make_graph([one, helper.make_node("Add", ["one", "x2"], ["b"])], "x2_const", [],
                                [out("b")], [one_dims])
    two, two_dims = fill("two", [1], 2.0)
    to = numpy_helper.from_array(np.array([1, 2], np.int64), "to")
    x3_plus = helper.make_graph([two, helper.make_node("Add", ["two", "x3"], ["t"]),
                                 helper.make_node("Expand", ["t", "to"], ["c"])], "x3_const", [], [out("c")],
                                [two_dims, to])
    zero, zero_dims = fill("zero", [1], 0.0)
    on_x3 = helper.make_graph([zero, helper.make_node("GreaterOrEqual", ["x3", "zero"], ["ge"]),
                               helper.make_node("Squeeze", ["ge"], ["cond"]),
                               helper.make_node("If", ["cond"], ["d"], then_branch=x3_plus,
                                                else_branch=x2_plus)],
                              "x3", [], [out("d")], [zero_dims])
    opt = helper.make_optional_type_proto(helper.make_tensor_type_proto(F, [1, 2]))
    graph = helper.make_graph(
        [helper.make_node("OptionalHasElement", ["x1.opt"], ["has"]),
         helper.make_node("If", ["has"], ["y"], then_branch=has_x1, else_branch=on_x3)], "nested",
        [helper.make_value_info("x1.opt", opt), helper.make_tensor_value_info("x2", F, [1, 2]),
         helper.make_tensor_value_info("x3", F, [1])], [out("y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 15)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


@pytest.mark.parametrize("x1", [None, [[3.0, 4.0]]])
@pytest.mark.parametrize("x3", [-1.0, 0.0, 5.0])
def test_three_levels_of_if_reading_outer_inputs(x1: list | None, x3: float) -> None:
    """test_3_level_control_flow_ops_graph (run there on CUDA/TensorRT only; here on the CPU): every branch
    of the three-level model."""
    feeds = {"x1.opt": None if x1 is None else np.array(x1, np.float32),
             "x2": np.array([[1.5, -2.0]], np.float32), "x3": np.array([x3], np.float32)}
    _same_run(_nested_optional_model(), feeds)


# ---------------------------------------------------------------- onnxruntime_test_python_sparse_matmul.py


def test_sparse_initializer_as_output_has_onnxruntimes_values() -> None:
    """testRunSparseOutputOnly, testRunSparseOutputOrtValueVector (in part): a graph output that is a sparse
    initializer. onnxruntime hands back a SparseTensor; onnxtrain makes sparse tensors dense at load and hands
    back the dense array, whose values are those of onnxruntime's sparse one."""
    values = np.array([1.764052391052246, 0.40015721321105957, 0.978738009929657], np.float32)
    indices = np.array([2, 3, 5], np.int64)
    sparse = helper.make_sparse_tensor(numpy_helper.from_array(values, "values"),
                                       numpy_helper.from_array(indices, "values_i"), [3, 3])
    graph = helper.make_graph([], "sparse_out", [], [helper.make_value_info(
        "values", helper.make_sparse_tensor_type_proto(F, [3, 3]))], sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    want_s, got_s = _sessions(model.SerializeToString())
    want = want_s.run_with_ort_values(["values"], {})[0]
    assert want.is_sparse_tensor()
    dense = np.zeros(9, np.float32)
    dense[indices] = want.as_sparse_tensor().values()
    got = got_s.run(["values"], {})[0]
    np.testing.assert_array_equal(got, dense.reshape(3, 3))


# ---------------------------------------------------------------- onnxruntime_test_python_symlink_data.py


def _external_data_model() -> onnx.ModelProto:
    """input + a Constant of 10 floats held in the external file data.bin."""
    tensor = helper.make_tensor("external_data", F, [10], [float(i) for i in range(10)])
    tensor.data_location = TensorProto.EXTERNAL
    tensor.ClearField("float_data")
    tensor.ClearField("raw_data")
    for key, value in (("location", "data.bin"), ("offset", "0"), ("length", "40")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph([helper.make_node("Constant", [], ["c"], value=tensor),
                               helper.make_node("Add", ["input", "c"], ["output"])], "symlinked",
                              [helper.make_tensor_value_info("input", F, [10])],
                              [helper.make_tensor_value_info("output", F, [10])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("layout", ["same folder", "data in a subfolder", "data elsewhere"])
def test_symlinked_model_and_external_data(tmp_path: Any, layout: str) -> None:
    """test_symlink_model_and_data_under_same_directory, test_symlink_with_data_in_model_sub_dir,
    test_symlink_with_data_not_in_model_sub_dir: a hub-cache layout, model.onnx and data.bin links in a
    snapshot folder to files elsewhere. Loads where the data's real file is under the model's real folder,
    refused (as onnxruntime refuses it) where it is not."""
    real_model_dir = tmp_path / ("model" if layout == "data elsewhere" else "blobs")
    real_data_dir = {"same folder": real_model_dir, "data in a subfolder": real_model_dir / "data",
                     "data elsewhere": tmp_path / "data"}[layout]
    snapshot = tmp_path / "snapshots" / "version"
    for folder in (real_model_dir, real_data_dir, snapshot):
        folder.mkdir(parents=True, exist_ok=True)
    (real_data_dir / "guid2").write_bytes(struct.pack("10f", *range(10)))
    onnx.save(_external_data_model(), str(real_model_dir / "guid1"))
    try:
        os.symlink(real_model_dir / "guid1", snapshot / "model.onnx")
        os.symlink(real_data_dir / "guid2", snapshot / "data.bin")
    except (OSError, NotImplementedError) as e:
        pytest.skip(f"no symbolic links here: {e}")
    path = str(snapshot / "model.onnx")
    if layout == "data elsewhere":
        with pytest.raises(Exception, match="External data path validation failed"):
            ort.InferenceSession(path, providers=CPU)
        with pytest.raises(RuntimeError, match="External data path validation failed.*escapes the model "
                                               "directory"):  # (onnxruntime's words first, for scripts)
            onnxtrain.InferenceSession(path, providers=CPU)
        return
    got = _same_run(path, {"input": np.zeros(10, np.float32)}, ["output"])
    np.testing.assert_array_equal(got[0], np.arange(10, dtype=np.float32))


# ------------------------------------------ onnxruntime_test_scatternd.py, onnxruntime_scatternd_test.py


def _cast_scatter_sub(op_type: str, opset: int, dtype: type, reduction: str) -> bytes:
    """CastLike(X, I) → op_type(·, indices, updates) → Sub(·, I), with I = [0] of ``dtype``."""
    rank = 2 if op_type == "ScatterElements" else 3
    elem = F if dtype == np.float32 else TensorProto.FLOAT16
    return _model([helper.make_node("CastLike", ["X", "I"], ["data"]),
                   helper.make_node(op_type, ["data", "indices", "updates"], ["sy"], reduction=reduction),
                   helper.make_node("Sub", ["sy", "I"], ["Y"])],
                  [helper.make_tensor_value_info("X", F, [None] * rank),
                   helper.make_tensor_value_info("indices", TensorProto.INT64, [None, None]),
                   helper.make_tensor_value_info("updates", elem, [None] * rank)],
                  [helper.make_tensor_value_info("Y", elem, [None] * rank)], {"": opset},
                  [numpy_helper.from_array(np.array([0], dtype=dtype), "I")], ir=8 if opset <= 18 else 9)


def _scatter_feeds(op_type: str, dtype: type) -> dict[str, np.ndarray]:
    if op_type == "ScatterElements":
        data = np.zeros((3, 3), np.float32)
        data[0, 0] = 1
        return {"X": data, "indices": np.array([[1, 0, 2], [0, 2, 1]], np.int64),
                "updates": np.array([[1.0, 1.1, 1.2], [2.0, 2.1, 2.2]], dtype=dtype)}
    block = np.array([[1, 2, 3, 4], [5, 6, 7, 8], [8, 7, 6, 5], [4, 3, 2, 1]], np.float32)
    rows = np.arange(1.0, 9.0)[:, None].repeat(4, axis=1)
    updates = np.stack([rows[4:], rows[:4]])
    return {"X": np.stack([block, block, block[::-1], block[::-1]]),
            "indices": np.array([[0], [2]], np.int64),
            "updates": updates.astype(dtype)}


_SCATTER_CASES = [(op, opset, dtype, reduction) for op, opset, dtype, reduction in itertools.product(
    ["ScatterElements", "ScatterND"], [16, 18], [np.float32, np.float16],
    ["none", "add", "mul", "min", "max"])
    if opset >= 18 or reduction not in ("min", "max")]


@pytest.mark.parametrize("op_type,opset,dtype,reduction", _SCATTER_CASES)
def test_scatter_after_castlike(op_type: str, opset: int, dtype: type, reduction: str) -> None:
    """test_scatterels_cpu, test_scatternd_cpu (and the float16 cases of the _cuda tests): the output's type
    is the updates', values those of onnx.reference and of onnxruntime (whose CPU kernels lack float16
    reductions: there onnx.reference alone)."""
    from onnx.reference import ReferenceEvaluator

    model = _cast_scatter_sub(op_type, opset, dtype, reduction)
    feeds = _scatter_feeds(op_type, dtype)
    got = onnxtrain.InferenceSession(model).run(None, feeds)[0]
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, ReferenceEvaluator(model).run(None, feeds)[0])
    if dtype == np.float32 or reduction == "none":
        np.testing.assert_array_equal(got, ort.InferenceSession(model, providers=CPU).run(None, feeds)[0])


@pytest.mark.parametrize("reduction", ["add", "mul", "min", "max"])
@pytest.mark.parametrize("line", [0, 1])
def test_scatternd_reduction_over_repeated_indices(reduction: str, line: int) -> None:
    """test_scatternd_standalone_cuda (its CPU half): ScatterND-18 whose indices name one slice twice."""
    from onnx.reference import ReferenceEvaluator

    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"], reduction=reduction)
    model = _model([node],
                   [helper.make_tensor_value_info("data", F, [None] * 3),
                    helper.make_tensor_value_info("indices", TensorProto.INT64, [None, None]),
                    helper.make_tensor_value_info("updates", F, [None] * 3)],
                   [helper.make_tensor_value_info("y", F, [None] * 3)], {"": 18}, ir=9)
    feeds = {"data": np.full((2, 2, 3), 0.1, np.float32),
             "indices": np.array([[line], [1 - line], [line]], np.int64),
             "updates": (2 ** (np.arange(18) + 1).astype(np.float32).reshape((3, 2, 3))).astype(np.float32)}
    got = _same_run(model, feeds)[0]
    assert got.tolist() == ReferenceEvaluator(model).run(None, feeds)[0].tolist()


# ---------------------------------------------------------------- onnx_test_trilu.py

_TRILU_CASES = [  # (shape, k; None: no k input)
    ((3, 4, 5), None), ((3, 4, 5), -1), ((3, 4, 5), -7), ((3, 4, 5), 2), ((3, 4, 5), 6), ((3, 5, 5), None),
    ((3, 5, 5), -1), ((3, 1, 5), -7), ((3, 5, 5), 2), ((3, 0, 5), 6)]


@pytest.mark.parametrize("upper", [1, 0])
@pytest.mark.parametrize("shape,k", _TRILU_CASES)
def test_contrib_trilu(shape: tuple[int, ...], k: int | None, upper: int) -> None:
    """test_triu*, test_tril* (onnx_test_trilu.py): onnxruntime's contrib op com.microsoft.Trilu, upper
    and lower, with k absent, negative, positive and past the matrix, square, one-row and empty inputs."""
    names = ["x"] + ([] if k is None else ["k"])
    attrs = {} if upper else {"upper": 0}
    inputs = [helper.make_tensor_value_info("x", F, list(shape))]
    if k is not None:
        inputs.append(helper.make_tensor_value_info("k", TensorProto.INT64, [1]))
    model = _model([helper.make_node("Trilu", names, ["y"], domain="com.microsoft", **attrs)], inputs,
                   [helper.make_tensor_value_info("y", F, None)], {"": 17, "com.microsoft": 1})
    x = np.random.default_rng(len(shape) * 7 + (k or 0)).standard_normal(shape).astype(np.float32)
    feeds = {"x": x} if k is None else {"x": x, "k": np.array([k], np.int64)}
    got = _same_run(model, feeds)[0]
    np.testing.assert_array_equal(got, (np.triu if upper else np.tril)(x, k or 0))


_LINEAR_CASES = [  # (op, coefficients, intercepts, targets): more coefficients than 2 features take, too few
    ("LinearRegressor", 6, [0.5, 1.0], 2), ("LinearRegressor", 6, [0.5], 1),
    ("LinearRegressor", 4, [0.5, 1, 2], 3),
    ("LinearClassifier", 8, [0.5, 1.0], None), ("LinearClassifier", 9, [0.5, 1.0, 2.0], None),
    ("LinearClassifier", 8, [0.5, 1.0, 2.0], None), ("LinearClassifier", 12, [0.25, 0.5, -1.0], None)]


@pytest.mark.parametrize("op,n_coef,intercepts,targets", _LINEAR_CASES)
def test_linear_models_read_the_leading_coefficients(op: str, n_coef: int, intercepts: list[float],
                                                     targets: int | None) -> None:
    """What testRunModelProto's logreg_iris.onnx needs, on both linear ops: coefficients beyond targets ×
    features (here 2) are left unread, as onnxruntime leaves them; fewer than that, or (LinearClassifier) a
    count that is not a multiple of the classes, is refused by both."""
    attrs: dict[str, Any] = {"coefficients": [float(v) for v in range(1, n_coef + 1)],
                             "intercepts": intercepts}
    outs = [helper.make_tensor_value_info("Y", F, None)]
    if op == "LinearRegressor":
        attrs["targets"] = targets
    else:
        attrs["classlabels_ints"] = list(range(len(intercepts)))
        attrs["post_transform"] = "SOFTMAX"
        outs = [helper.make_tensor_value_info("L", TensorProto.INT64, None)] + outs
    model = _model([helper.make_node(op, ["X"], [o.name for o in outs], domain=ML, name="lin", **attrs)],
                   [helper.make_tensor_value_info("X", F, [3, 2])], outs, {"": 17, ML: 1})
    x = np.array([[1.0, 2.0], [3.0, -4.0], [0.5, 0.25]], np.float32)
    try:
        ort.InferenceSession(model, providers=CPU).run(None, {"X": x})
    except Exception:  # noqa: BLE001 - onnxruntime refuses the node: so must onnxtrain, naming it
        with pytest.raises(RuntimeError, match="lin"):
            onnxtrain.InferenceSession(model).run(None, {"X": x})
        assert n_coef < 2 * len(intercepts) or n_coef % len(intercepts)
        return
    _same_run(model, {"X": x})

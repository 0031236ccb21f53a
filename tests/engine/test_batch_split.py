"""Inference on the two halves of a batch at once (onnxtrain/engine/batch_split.py): used only when checked to
give the whole run's bits, and never for models that mix the samples of a batch."""

from __future__ import annotations

import os
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine import batch_split, blas
from onnxtrain.engine.batch_split import batch_axes
from tests import models

F = TensorProto.FLOAT


@pytest.fixture
def no_minimum(monkeypatch):
    """Split runs of any size (the models here are far below the real minimum)."""
    monkeypatch.setattr(batch_split, "MIN_ACTIVATION_BYTES", 0)
    monkeypatch.setattr(batch_split, "ACTIVATIONS_PER_WEIGHT", 0.0)


def session(model: onnx.ModelProto, split: str | None = None, threads: int = 0) -> onnxtrain.InferenceSession:
    so = onnxtrain.SessionOptions()
    so.intra_op_num_threads = threads
    if split is not None:
        so.add_session_config_entry("onnxtrain.batch_split", split)
    return onnxtrain.InferenceSession(model, so)


def batch_model(nodes, inits=(), out_dims=("batch", 3)) -> onnx.ModelProto:
    """x: float[batch, 3] → y (declared ``out_dims``)."""
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", 3])],
                          [helper.make_tensor_value_info("y", F, list(out_dims))], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_blas_thread_count_can_be_pinned_and_is_restored():
    assert blas.can_pin_blas_threads(), "numpy's BLAS is not an OpenBLAS whose thread count can be set"
    setter, getter = blas._thread_count_functions()
    before = getter()
    with blas.single_threaded_blas():
        assert getter() == 1
    assert getter() == before


def test_batch_axes_come_from_the_declared_symbol():
    model, _, _ = models.export("transformer_encoder", training=False)
    assert batch_axes(model) == ({"tokens": 0}, {"logits": 0})
    # batch on axis 1 of the input and 0 of the output; the sequence length is symbolic too
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], "g",
                          [helper.make_tensor_value_info("x", F, ["seq", "batch"])],
                          [helper.make_tensor_value_info("y", F, ["batch", "seq"])])
    assert batch_axes(helper.make_model(g)) == ({"x": 1}, {"y": 0})
    relu = [helper.make_node("Relu", ["x"], ["y"])]
    assert batch_axes(batch_model(relu, out_dims=(4, 3))) is None  # the output has no batch axis
    g = helper.make_graph(relu, "g", [helper.make_tensor_value_info("x", F, [4, 3])],
                          [helper.make_tensor_value_info("y", F, [4, 3])])
    assert batch_axes(helper.make_model(g)) is None  # nothing symbolic


@pytest.mark.parametrize("name,batch", [("transformer_encoder", 6), ("gpt_block", 5), ("lenet_bn", 4),
                                        ("mlp", 7), ("recommender", 6), ("lstm_cls", 4)])
def test_halves_agree_with_the_whole_run(no_minimum, name, batch):
    model, _, _ = models.export(name, training=False)
    feeds = models.example_inputs(name, batch, seed=3)
    split, whole = session(model), session(model, split="0")
    assert whole._splitter is None
    want = whole.run(None, feeds)[0]
    runs = [split.run(None, feeds)[0] for _ in range(3)]  # whole, then the halves checked; halves; halves
    assert split._splitter.verdicts == {batch: True} and split._splitter.split_runs == 2
    # the check's run answers with the halves it checked: every run of the batch gives the same bits
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[1], runs[2])
    assert runs[2].shape == want.shape and runs[2].dtype == want.dtype
    atol = 1e-5 * float(np.abs(want).max())  # products of other sizes round differently
    np.testing.assert_allclose(runs[2], want, rtol=1e-5, atol=atol)
    half = batch // 2
    first = session(model, split="0").run(None, {k: v[:half] for k, v in feeds.items()})[0]
    np.testing.assert_allclose(runs[2][:half], first, rtol=1e-5, atol=atol)  # a half is a batch of its own
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(runs[-1], ref.run(None, feeds)[0], rtol=1e-5, atol=atol)
    assert split.peak_bytes > 0
    for half in split._splitter.halves:  # the weights are the whole plan's arrays, not copies
        assert all(half.initializers[n] is v for n, v in split._plan.initializers.items())


def test_the_batch_axis_may_be_any_axis(no_minimum):
    g = helper.make_graph([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0]),
                           helper.make_node("Softmax", ["t"], ["y"], axis=1)], "g",
                          [helper.make_tensor_value_info("x", F, ["seq", "batch"])],
                          [helper.make_tensor_value_info("y", F, ["batch", "seq"])])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.random.default_rng(2).standard_normal((5, 6)).astype(np.float32)
    e = np.exp(x.T - x.T.max(axis=1, keepdims=True))
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], e / e.sum(axis=1, keepdims=True), rtol=1e-6)
    assert sess._splitter.verdicts == {6: True} and sess._splitter.split_runs == 2


def test_a_model_that_mixes_the_samples_keeps_running_whole(no_minimum):
    # y = x - mean over the batch: each half would subtract its own mean. The graph screen follows the batch
    # axis through the Reshape ([-1, 3] keeps it first) and finds the mean over it
    shape = numpy_helper.from_array(np.array([-1, 3], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
             helper.make_node("ReduceMean", ["r"], ["m"], axes=[0], keepdims=1),
             helper.make_node("Sub", ["x", "m"], ["y"])]
    sess = session(batch_model(nodes, [shape]))
    x = np.random.default_rng(0).standard_normal((6, 3)).astype(np.float32)
    want = x - x.mean(axis=0, keepdims=True)
    for _ in range(4):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-6, atol=1e-6)
    assert sess._splitter is None


def test_a_graph_that_combines_samples_along_the_batch_axis_is_never_split(no_minimum):
    """A batch-wide maximum of values that are zero but for outliers: the first batch's halves agree with
    the whole run, so the run check alone let a later batch with an outlier in one half come out wrong
    (every row of the other half); the graph screen finds the ReduceMax over the batch axis first. The
    outputs equal onnxruntime's (the oracle) on both batches."""
    import onnxruntime as ort

    from onnxtrain.engine.batch_mixing import batch_mixing_node

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array((rng.standard_normal((3, 8)) * 0.1).astype(np.float32), "W")
    thr = numpy_helper.from_array(np.array(100, np.float32), "thr")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Sub", ["a", "thr"], ["s"]),
             helper.make_node("Relu", ["s"], ["rs"]),
             helper.make_node("ReduceMax", ["rs"], ["mx"], axes=[0], keepdims=1, name="batch_max"),
             helper.make_node("Add", ["a", "mx"], ["y"])]
    model = batch_model(nodes, [w, thr], out_dims=("batch", 8))
    assert batch_mixing_node(model, {"x": 0}) == "'batch_max' (ReduceMax, reduces along the batch axis 0)"
    sess = session(model)
    assert sess._splitter is None
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    first = rng.standard_normal((8, 3)).astype(np.float32)
    second = first.copy()
    second[0] *= 1e4  # an outlier in the first half
    for x in (first, second):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], reference.run(None, {"x": x})[0], rtol=1e-5)


def test_a_model_that_fails_on_half_a_batch_keeps_running_whole(no_minimum):
    shape = numpy_helper.from_array(np.array([4, -1], np.int64), "shape")
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["y"])]
    sess = session(batch_model(nodes, [shape]))
    x = np.arange(12, dtype=np.float32).reshape(4, 3)
    for _ in range(3):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x)  # [4, -1] of [2, 3] has no shape
    assert sess._splitter is None  # the screen: a constant 4 rows cuts across the batch


def test_each_batch_size_is_checked_and_a_batch_of_one_is_not_split(no_minimum):
    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]))
    rng = np.random.default_rng(1)
    for n in (1, 1, 1, 8, 8, 8, 3, 3):
        x = rng.standard_normal((n, 3)).astype(np.float32)
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], np.maximum(x, 0))
    assert sess._splitter.verdicts == {8: True, 3: True} and sess._splitter.split_runs == 3


def test_short_runs_one_thread_or_the_config_entry_keep_it_whole():
    relu = batch_model([helper.make_node("Relu", ["x"], ["y"])])
    x = np.ones((8, 3), np.float32)
    sess = session(relu)
    for _ in range(3):
        sess.run(None, {"x": x})
    assert sess._splitter.verdicts == {8: False}  # far below MIN_ACTIVATION_BYTES
    assert session(relu, threads=1)._splitter is None
    assert session(relu, split="0")._splitter is None
    assert session(relu, split="1")._splitter is not None
    with pytest.raises(ValueError, match="onnxtrain.batch_split"):
        session(relu, split="yes")
    theirs = ort.SessionOptions()  # onnxruntime's options are accepted too
    assert onnxtrain.InferenceSession(relu, theirs)._splitter is not None
    theirs.add_session_config_entry("onnxtrain.batch_split", "0")
    assert onnxtrain.InferenceSession(relu, theirs)._splitter is None


def test_a_profiled_session_runs_whole(no_minimum, tmp_path):
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = onnxtrain.InferenceSession(batch_model([helper.make_node("Relu", ["x"], ["y"])]), so)
    for _ in range(3):
        sess.run(None, {"x": np.ones((8, 3), np.float32)})
    assert sess._splitter.verdicts == {} and sess._splitter.split_runs == 0


def test_no_split_while_another_python_thread_may_be_inside_blas(no_minimum):
    sess = session(batch_model([helper.make_node("Relu", ["x"], ["y"])]))
    x = np.ones((8, 3), np.float32)
    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="user-thread")
    other.start()
    try:
        for _ in range(3):
            sess.run(None, {"x": x})
    finally:
        stop.set()
        other.join()
    # decided at the first run: the size runs whole from then on, whatever threads are alive later
    assert sess._splitter.verdicts == {8: False}
    sess.run(None, {"x": x})
    assert sess._splitter.split_runs == 0



def test_a_progress_bars_monitor_thread_does_not_count_as_a_blas_caller():
    from tqdm import tqdm

    with open(os.devnull, "w") as sink, tqdm(total=1, disable=False, file=sink) as bar:
        assert tqdm.monitor is not None and tqdm.monitor.is_alive()
        assert blas.can_pin_blas_threads()
        bar.update(1)


def test_a_plan_takes_given_initializer_arrays_and_checks_them():
    from onnxtrain.engine.plan import EngineError, Plan

    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, ["batch", 3])],
                          [helper.make_tensor_value_info("y", F, ["batch", 2])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    mine = np.ones((3, 2), np.float32)
    p = Plan(m, initializers={"w": mine})
    assert p.initializers["w"] is mine
    got = p.run({"x": np.ones((2, 3), np.float32)})[0]
    np.testing.assert_array_equal(got, np.full((2, 2), 3, np.float32))
    with pytest.raises(EngineError, match="initializer 'w'.*float64\\[3, 2\\].*float32\\[3, 2\\]"):
        Plan(m, initializers={"w": np.ones((3, 2))})
    with pytest.raises(EngineError, match="initializer 'w'.*\\[2, 3\\]"):
        Plan(m, initializers={"w": np.ones((2, 3), np.float32)})


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_halves_of_other_float_types(no_minimum, dtype):
    rng = np.random.default_rng(4)
    t = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(dtype), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Tanh", ["h"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", t, ["batch", 16])],
                          [helper.make_tensor_value_info("y", t, ["batch", 8])], [w])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    x = rng.standard_normal((10, 16)).astype(dtype)
    want = np.tanh(x.astype(np.float64) @ numpy_helper.to_array(w).astype(np.float64))
    for _ in range(3):
        got = sess.run(None, {"x": x})[0]
        assert got.dtype == dtype
        atol = 1e-2 if dtype == np.float16 else 1e-12
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=0, atol=atol)
    assert sess._splitter.verdicts == {10: True} and sess._splitter.split_runs == 2


def test_a_run_whose_weights_outweigh_its_activations_keeps_running_whole(monkeypatch):
    monkeypatch.setattr(batch_split, "MIN_ACTIVATION_BYTES", 0)
    w = numpy_helper.from_array(np.ones((256, 256), np.float32), "w")  # 256 KiB of weights
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, ["batch", 256])],
                          [helper.make_tensor_value_info("y", F, ["batch", 256])], [w])
    sess = session(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    for n in (8, 8, 1024, 1024, 1024):  # 8 KiB of rows: whole; 1 MiB in and out: split
        sess.run(None, {"x": np.ones((n, 256), np.float32)})
    assert sess._splitter.verdicts == {8: False, 1024: True} and sess._splitter.split_runs == 2


def _screened(nodes, inits=(), opset=17):
    from onnxtrain.engine.batch_mixing import batch_mixing_node

    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", 3, 4])],
                          [helper.make_tensor_value_info("y", F, None)], list(inits))
    return batch_mixing_node(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), {"x": 0})


def _rows_then_max(lengths: list[int], sequence_first: bool = False) -> tuple[list, list]:
    """Nodes and initializers: x (its batch and sequence axes swapped when ``sequence_first``) reshaped to
    rows of each of ``lengths`` in turn (a -1 taking the batch), then the maximum of each row."""
    nodes, inits, at = [], [], "x"
    if sequence_first:
        nodes.append(helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]))
        at = "t"
    for k, n in enumerate(lengths):
        inits.append(numpy_helper.from_array(np.array([-1, n], np.int64), f"rows{k}"))
        nodes.append(helper.make_node("Reshape", [at, f"rows{k}"], [f"r{k}"]))
        at = f"r{k}"
    nodes.append(helper.make_node("ReduceMax", [at], ["y"], axes=[1]))
    return nodes, inits


_AXES0 = numpy_helper.from_array(np.array([0], np.int64), "axes0")
_AXES2 = numpy_helper.from_array(np.array([2], np.int64), "axes2")
# nodes, initializers, opset → the op the screen names (None: nothing combines the samples)
SCREEN_CASES = {
    "softmax_over_batch": ([helper.make_node("Softmax", ["x"], ["y"], axis=0)], [], 17, "Softmax"),
    "softmax_last_axis": ([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], [], 17, None),
    "softmax_opset11_flattens_from_axis_0": ([helper.make_node("Softmax", ["x"], ["y"], axis=0)], [], 11,
                                             "Softmax"),
    "layer_norm_from_axis_0": ([helper.make_node("LayerNormalization", ["x", "s"], ["y"], axis=0)],
                               [numpy_helper.from_array(np.ones((3, 4), np.float32), "s")], 17,
                               "LayerNormalization"),
    "concat_along_batch": ([helper.make_node("Concat", ["x", "x"], ["y"], axis=0)], [], 17, "Concat"),
    "concat_along_features": ([helper.make_node("Concat", ["x", "x"], ["y"], axis=2)], [], 17, None),
    "reduce_all_axes": ([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=0)], [], 13, "ReduceSum"),
    # the batch axis followed through a Transpose (batch → 1) and a reduction dropping axis 0 (→ 0)
    "transpose_then_reduce": ([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
                               helper.make_node("ReduceMean", ["t"], ["r"], axes=[0], keepdims=0),
                               helper.make_node("ReduceMax", ["r"], ["y"], axes=[0], keepdims=1)], [], 17,
                              "ReduceMax"),
    "transpose_then_feature_reduce": ([helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
                                       helper.make_node("ReduceMean", ["t"], ["y"], axes=[0])], [], 17, None),
    # opset 18: the axes as a constant input
    "reduce_axes_input_batch": ([helper.make_node("ReduceMax", ["x", "axes0"], ["y"])], [_AXES0], 18,
                                "ReduceMax"),
    "reduce_axes_input_features": ([helper.make_node("ReduceMax", ["x", "axes2"], ["y"])], [_AXES2], 18,
                                   None),
    # followed through Flatten(axis 1), Unsqueeze/Squeeze and a Reshape copying the batch dim (0)
    "flatten_then_softmax_over_batch": ([helper.make_node("Flatten", ["x"], ["f"], axis=1),
                                         helper.make_node("Softmax", ["f"], ["y"], axis=0)], [], 17,
                                        "Softmax"),
    "flatten_at_0_merges_the_batch": ([helper.make_node("Flatten", ["x"], ["y"], axis=0)], [], 17, "Flatten"),
    "unsqueeze_then_reduce": ([helper.make_node("Unsqueeze", ["x", "axes0"], ["u"]),
                               helper.make_node("ReduceSum", ["u"], ["y"], axes=[1])], [_AXES0], 17,
                              "ReduceSum"),
    "unsqueeze_then_reduce_new_axis": ([helper.make_node("Unsqueeze", ["x", "axes0"], ["u"]),
                                        helper.make_node("ReduceSum", ["u"], ["y"], axes=[0])], [_AXES0], 17,
                                       None),
    "reshape_copying_batch": ([helper.make_node("Reshape", ["x", "keep"], ["r"]),
                               helper.make_node("ReduceMean", ["r"], ["y"], axes=[0])],
                              [numpy_helper.from_array(np.array([0, -1], np.int64), "keep")], 17,
                              "ReduceMean"),
    # a -1 that takes the batch: rows within one sample stay apart, rows longer than a sample hold several
    "reshape_rows_within_samples": (*_rows_then_max([4]), 17, None),
    "reshape_rows_of_two_samples": (*_rows_then_max([24]), 17, "Reshape"),
    # [B, 3, 4] → [3, B, 4] → [3·B, 4] (rows position-major) → [-1, 12]: each row takes 3 samples' rows
    "sequence_first_rows_regrouped": (*_rows_then_max([4, 12], sequence_first=True), 17, "Reshape"),
    "sequence_first_rows_halved": (*_rows_then_max([4, 2], sequence_first=True), 17, None),
    "cumsum_over_features_axis_input": ([helper.make_node("CumSum", ["x", "two"], ["y"])],
                                        [numpy_helper.from_array(np.array(2, np.int64), "two")], 17, None),
    "cumsum_over_batch_axis_input": ([helper.make_node("CumSum", ["x", "zero"], ["y"])],
                                     [numpy_helper.from_array(np.array(0, np.int64), "zero")], 17, "CumSum"),
    "topk_default_last_axis": ([helper.make_node("TopK", ["x", "k"], ["y", "i"])],
                               [numpy_helper.from_array(np.array([2], np.int64), "k")], 17, None),
    "concat_of_a_constant_and_the_batch": ([helper.make_node("Concat", ["c", "x"], ["y"], axis=0)],
                                           [numpy_helper.from_array(np.zeros((1, 3, 4), np.float32), "c")],
                                           17, "Concat"),
    # the batch size read with Shape and used as a value: each half would divide by its own half
    "batch_size_as_a_value": ([helper.make_node("Shape", ["x"], ["s"]),
                               helper.make_node("Gather", ["s", "zero"], ["n"]),
                               helper.make_node("Cast", ["n"], ["nf"], to=F),
                               helper.make_node("Div", ["x", "nf"], ["y"])],
                              [numpy_helper.from_array(np.array(0, np.int64), "zero")], 17, "Div"),
    "pad_along_the_batch": ([helper.make_node("Pad", ["x", "pads_b"], ["y"])],
                            [numpy_helper.from_array(np.array([-1, 0, 0, 1, 0, 0], np.int64), "pads_b")], 17,
                            "Pad"),
    "pad_along_features": ([helper.make_node("Pad", ["x", "pads_f"], ["y"])],
                           [numpy_helper.from_array(np.array([0, 0, 1, 0, 0, 1], np.int64), "pads_f")], 17,
                           None),
    "lp_norm_along_the_batch": ([helper.make_node("LpNormalization", ["x"], ["y"], axis=0)], [], 17,
                                "LpNormalization"),
    "lp_norm_along_features": ([helper.make_node("LpNormalization", ["x"], ["y"], axis=-1)], [], 17, None),
    "cumsum_axis_from_a_value_int_constant": ([helper.make_node("Constant", [], ["ax"], value_int=0),
                                               helper.make_node("CumSum", ["x", "ax"], ["y"])], [], 17,
                                              "CumSum"),
    "reduce_axes_computed_at_run_time": ([helper.make_node("ArgMax", ["scores"], ["ax"], keepdims=1),
                                          helper.make_node("ReduceSum", ["x", "ax"], ["y"])],
                                         [numpy_helper.from_array(np.array([3.0, 1.0], np.float32),
                                                                  "scores")], 18, "ReduceSum"),
    # a comparison of the batch size is still of the batch: the halves compare their own half
    "batch_size_compared": ([helper.make_node("Shape", ["x"], ["s"]),
                             helper.make_node("Gather", ["s", "zero"], ["n"]),
                             helper.make_node("Equal", ["n", "sixty_four"], ["is64"]),
                             helper.make_node("Cast", ["is64"], ["f"], to=F),
                             helper.make_node("Mul", ["x", "f"], ["y"])],
                            [numpy_helper.from_array(np.array(0, np.int64), "zero"),
                             numpy_helper.from_array(np.array(64, np.int64), "sixty_four")], 17, "Mul"),
    # constants folded as ONNX computes them: Cast to uint8 wraps 256 to 0, the batch axis
    "axes_folded_through_a_cast": ([helper.make_node("Cast", ["c256"], ["u8"], to=TensorProto.UINT8),
                                    helper.make_node("Cast", ["u8"], ["ax"], to=TensorProto.INT64),
                                    helper.make_node("ReduceSum", ["x", "ax"], ["y"])],
                                   [numpy_helper.from_array(np.array([256], np.int64), "c256")], 18,
                                   "ReduceSum"),
    "axes_folded_through_fmod": ([helper.make_node("Mod", ["m3", "c3"], ["ax"], fmod=1),
                                  helper.make_node("ReduceSum", ["x", "ax"], ["y"])],
                                 [numpy_helper.from_array(np.array([-3], np.int64), "m3"),
                                  numpy_helper.from_array(np.array([3], np.int64), "c3")], 18, "ReduceSum"),
    "conv_of_the_batch_with_itself": ([helper.make_node("Conv", ["x", "x"], ["y"])], [], 17, "Conv"),
    "max_pool_indices": ([helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[2])], [], 17,
                         "MaxPool"),
    # Resize-10 takes (X, scales): a scale of 1 on the batch axis keeps the samples apart (it was read as
    # Resize-11's roi and the node refused), one of 2 resizes it
    "resize10_scales_keep_the_batch": ([helper.make_node("Resize", ["x", "sc"], ["y"])],
                                       [numpy_helper.from_array(np.array([1, 1, 2], np.float32), "sc")], 10,
                                       None),
    "resize10_scales_the_batch": ([helper.make_node("Resize", ["x", "sc"], ["y"])],
                                  [numpy_helper.from_array(np.array([2, 1, 1], np.float32), "sc")], 10,
                                  "Resize"),
    # followed through a Reshape that keeps the batch first ([-1, 4]): the sum over it is found
    "after_a_reshape": ([helper.make_node("Reshape", ["x", "shape"], ["r"]),
                         helper.make_node("ReduceSum", ["r"], ["y"], axes=[0])],
                        [numpy_helper.from_array(np.array([-1, 4], np.int64), "shape")], 17, "ReduceSum"),
    # before opset 14 a BatchNormalization with more outputs than Y trains, their names empty or not
    "bn12_empty_optional_outputs": (
        [helper.make_node("BatchNormalization", ["x", "sc", "b0", "rm", "rv"], ["y", "", "", "", ""])],
        [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("sc", "rv")]
        + [numpy_helper.from_array(np.zeros(3, np.float32), n) for n in ("b0", "rm")],
        12, "BatchNormalization"),
    "bn12_inference": (
        [helper.make_node("BatchNormalization", ["x", "sc", "b0", "rm", "rv"], ["y"])],
        [numpy_helper.from_array(np.ones(3, np.float32), n) for n in ("sc", "rv")]
        + [numpy_helper.from_array(np.zeros(3, np.float32), n) for n in ("b0", "rm")], 12, None),
    # the batch size read by a Slice of the Shape with a negative step from a start below -rank (ONNX
    # clamps it to the last entry and counts down: [batch]), then used as a value
    "batch_size_by_a_reversed_slice": (
        [helper.make_node("Shape", ["x"], ["s"]),
         helper.make_node("Slice", ["s", "st", "en", "ax", "stp"], ["b"]),
         helper.make_node("Cast", ["b"], ["bf"], to=F), helper.make_node("Mul", ["x", "bf"], ["y"])],
        [numpy_helper.from_array(np.array(v, np.int64), n)
         for n, v in (("st", [-4]), ("en", [-100]), ("ax", [0]), ("stp", [-1]))], 17, "Mul"),
}


@pytest.mark.parametrize("case", sorted(SCREEN_CASES))
def test_the_graph_screen_follows_the_batch_axis(case):
    nodes, inits, opset, op = SCREEN_CASES[case]
    found = _screened(nodes, inits, opset)
    if op is None:
        assert found is None, found
    else:
        assert found is not None and f"({op}," in found, found


def _seq_first(back: str) -> onnx.ModelProto:
    """x [4, batch, 3] (sequence first, as nn.MultiheadAttention's export) laid out as [4·batch, 3] for a
    row-wise Gemm, then back to [4, batch, 3] (``back="same"``) or to [batch, 4, 3] (``"swapped"``, which
    moves rows of one sample to others), the targets read from the input's Shape."""
    c = {n: numpy_helper.from_array(np.array(v, np.int64), n) for n, v in
         (("zero", 0), ("one", 1), ("three", [3]), ("axes0", [0]))}
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 3)).astype(np.float32),
                                "W")
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["L"]),
             helper.make_node("Gather", ["s", "one"], ["B"]),
             helper.make_node("Mul", ["L", "B"], ["LB"]),
             helper.make_node("Unsqueeze", ["LB", "axes0"], ["LB1"]),
             helper.make_node("Concat", ["LB1", "three"], ["flat_shape"], axis=0),
             helper.make_node("Reshape", ["x", "flat_shape"], ["rows"]),
             helper.make_node("Gemm", ["rows", "W"], ["g"]),
             helper.make_node("Unsqueeze", ["L", "axes0"], ["L1"]),
             helper.make_node("Unsqueeze", ["B", "axes0"], ["B1"]),
             helper.make_node("Concat", ["L1", "B1", "three"] if back == "same" else ["B1", "L1", "three"],
                              ["back_shape"], axis=0),
             helper.make_node("Reshape", ["g", "back_shape"], ["y"], name="back")]
    out = [4, "batch", 3] if back == "same" else ["batch", 4, 3]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, "batch", 3])],
                          [helper.make_tensor_value_info("y", F, out)], [*c.values(), w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_the_screen_follows_interleaved_rows_and_refuses_a_reshape_that_moves_samples():
    """[4, B, 3] → [4·B, 3] → Gemm → [4, B, 3]: the batch stays the inner part of the rows and comes back
    (no refusal); → [B, 4, 3] instead moves rows between samples: refused. Both run to onnxruntime's values
    on the session."""
    from onnxtrain.engine.batch_mixing import batch_mixing_node

    same, swapped = _seq_first("same"), _seq_first("swapped")
    assert batch_mixing_node(same, {"x": 1}, {"y": 1}) is None
    found = batch_mixing_node(swapped, {"x": 1}, {"y": 0})
    assert found == "'back' (Reshape, moves samples across the batch axis)", found
    x = np.random.default_rng(1).standard_normal((4, 6, 3)).astype(np.float32)
    for model in (same, swapped):
        want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": x})[0]
        np.testing.assert_allclose(session(model).run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_a_global_norm_over_a_flattened_batch_is_refused():
    """h = x·W; y = h · min(1, c / ‖reshape(h, [-1])‖): the norm spans every sample. The screen lost the axis
    at the Reshape and the run check passed on a first batch where the clip was idle: a later batch came out
    41 % wrong. Now followed through the Reshape (the flat vector keeps the samples in order) to the norm,
    which is refused; the outputs equal onnxruntime's on both batches."""
    from onnxtrain.engine.batch_mixing import batch_mixing_node

    w = numpy_helper.from_array(np.eye(3, dtype=np.float32), "W")
    c = numpy_helper.from_array(np.array(10.0, np.float32), "c")
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one_f")
    flat = numpy_helper.from_array(np.array([-1], np.int64), "flat")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Reshape", ["h", "flat"], ["hf"], name="flatten"),
             helper.make_node("ReduceL2", ["hf"], ["n"], keepdims=0, name="norm"),
             helper.make_node("Div", ["c", "n"], ["q"]), helper.make_node("Min", ["q", "one_f"], ["s"]),
             helper.make_node("Mul", ["h", "s"], ["y"])]
    model = batch_model(nodes, [w, c, one, flat])
    assert batch_mixing_node(model, {"x": 0}) == "'norm' (ReduceL2, reduces every axis, the batch's too)"
    sess = session(model)
    assert sess._splitter is None
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    quiet = rng.standard_normal((4096, 3)).astype(np.float32) * 1e-3  # the norm under c: no clip
    loud = rng.standard_normal((4096, 3)).astype(np.float32)  # the norm over c: clipped
    for x in (quiet, loud):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], reference.run(None, {"x": x})[0], rtol=1e-5)


def test_what_the_screen_does_not_follow_keeps_the_batch_whole():
    """An op the screen does not know (Einsum here), a control-flow body reading a value of the batch: it
    cannot show the samples stay apart, so the session does not split."""
    from onnxtrain.engine.batch_mixing import batch_mixing_node

    einsum = batch_model([helper.make_node("Einsum", ["x", "x"], ["y"], equation="bi,bi->bi", name="e")])
    assert batch_mixing_node(einsum, {"x": 0}) == "'e' (Einsum, the batch axis is not followed past it)"
    body = helper.make_graph([helper.make_node("Relu", ["x"], ["r"])], "then", [],
                             [helper.make_tensor_value_info("r", F, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["n"])], "else", [],
                              [helper.make_tensor_value_info("n", F, None)])
    flag = numpy_helper.from_array(np.array(True), "flag")
    branch = batch_model([helper.make_node("If", ["flag"], ["y"], then_branch=body, else_branch=other,
                                           name="branch")], [flag])
    found = batch_mixing_node(branch, {"x": 0})
    assert found is not None and found.startswith("'branch' (If, ") and "does not follow" in found, found


def test_gemm_of_the_batch_with_itself_and_folded_constants():
    """Gemm(x, x, transB=1) crosses every pair of samples: refused (only its first input was looked at).
    Small integer constants are folded as ONNX computes them: a Reshape target with a 0 (copy) and a Max of
    three inputs made the screen raise and the session fail to load."""
    from onnxtrain.engine.batch_mixing import batch_mixing_node

    cross = batch_model([helper.make_node("Gemm", ["x", "x"], ["y"], transB=1, name="cross")],
                        out_dims=("batch", "batch2"))
    assert batch_mixing_node(cross, {"x": 0}) == "'cross' (Gemm, the batch axis is not followed past it)"
    values = (("six", [[1, 2, 3], [4, 5, 6]]), ("target", [0, -1]), ("a", [1]), ("b", [3]), ("c", [2]))
    c = {n: numpy_helper.from_array(np.array(v, np.int64), n) for n, v in values}
    nodes = [helper.make_node("Reshape", ["six", "target"], ["r"]),
             helper.make_node("Max", ["a", "b", "c"], ["m"]), helper.make_node("Relu", ["x"], ["y"])]
    model = batch_model(nodes, list(c.values()))
    assert batch_mixing_node(model, {"x": 0}) is None
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    np.testing.assert_array_equal(session(model).run(None, {"x": x})[0], np.maximum(x, 0))


class _TerminateWhen:
    """RunOptions whose ``terminate`` turns true after ``reads`` reads, or (``worker_only``) when read from
    another thread than the caller's: a deterministic stand-in for a flag set during a run."""

    def __init__(self, reads: int = 0, worker_only: bool = False) -> None:
        self.reads, self.worker_only, self.caller = reads, worker_only, threading.get_ident()
        self.log_severity_level = -1

    @property
    def terminate(self) -> bool:
        if self.worker_only:
            return threading.get_ident() != self.caller
        self.reads -= 1
        return self.reads < 0


def _on_other_threads(n: int, fn) -> None:
    """parallel_for with every call on a thread of its own (the pool may run both halves on the caller's)."""
    errors: list[BaseException] = []

    def call(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # noqa: BLE001 - raised in the caller below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_terminate_during_the_checked_halves_or_in_the_worker_half_fails_the_run(no_minimum, monkeypatch):
    """A terminate during the halves' check run failed no run (the error was taken for a model that does not
    split, and the verdict set to never), and the worker thread's half did not watch the flag."""
    from onnxtrain.engine.interface import RUN_OPTIONS, Terminated

    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Sin", ["t"], ["y"])]
    sess = session(batch_model(nodes))
    splitter = sess._splitter
    x = {"x": np.ones((8, 3), np.float32)}
    token = RUN_OPTIONS.set(_TerminateWhen(reads=2))  # the whole run's two nodes read it, then the halves
    try:
        with pytest.raises(Terminated):
            splitter.run(x, None)
    finally:
        RUN_OPTIONS.reset(token)
    assert splitter.verdicts == {}  # no verdict from a stopped check
    sess.run(None, x)
    assert splitter.verdicts == {8: True}
    monkeypatch.setattr(batch_split, "can_pin_blas_threads", lambda: True)  # (threads are alive below)
    monkeypatch.setattr(batch_split, "parallel_for", _on_other_threads)
    token = RUN_OPTIONS.set(_TerminateWhen(worker_only=True))
    try:
        with pytest.raises(Terminated):
            splitter.run(x, None)
    finally:
        RUN_OPTIONS.reset(token)


def test_rows_regrouped_across_samples_run_whole(no_minimum):
    """[B, L, E] → [L, B, E] → [L·B, E] → [-1, L·E]: each row of the last holds L samples' values, so a
    maximum over it combines samples. The session runs such a graph whole and gives onnxruntime's values on
    a batch whose outlier a split would keep in one half (it split before, after a first batch of zeros)."""
    import onnxruntime as ort

    seq, width = 4, 8
    shapes = {"rows": [-1, width], "merged": [-1, seq * width], "back": [seq, -1, width]}
    nodes = [helper.make_node("Transpose", ["x"], ["t"], perm=[1, 0, 2]),
             helper.make_node("Reshape", ["t", "rows"], ["r"]),
             helper.make_node("Reshape", ["r", "merged"], ["m"]),
             helper.make_node("ReduceMax", ["m"], ["mx"], axes=[1], keepdims=1),
             helper.make_node("Add", ["m", "mx"], ["a"]),
             helper.make_node("Reshape", ["a", "back"], ["b"]),
             helper.make_node("Transpose", ["b"], ["y"], perm=[1, 0, 2])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["batch", seq, width])],
                          [helper.make_tensor_value_info("y", F, ["batch", seq, width])],
                          [numpy_helper.from_array(np.array(v, np.int64), k) for k, v in shapes.items()])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = session(model)
    assert sess._splitter is None
    reference = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    outlier = np.zeros((16, seq, width), np.float32)
    outlier[0, 1, 0] = 100.0
    for x in (np.zeros_like(outlier), outlier):
        np.testing.assert_array_equal(sess.run(None, {"x": x})[0], reference.run(None, {"x": x})[0])


_SEEDED_DRAWS = r"""
import hashlib, sys
import numpy as np
from onnx import TensorProto as T, helper, numpy_helper
import onnxtrain
from onnxtrain.engine import batch_split

batch_split.MIN_ACTIVATION_BYTES, batch_split.ACTIVATIONS_PER_WEIGHT = 0, 0.0  # (a trial at any size)
D = 64
w = np.random.default_rng(0).standard_normal((D, D)).astype(np.float32) * 0.05


def model(train: bool) -> bytes:
    inits = [numpy_helper.from_array(w, "W"), numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(train), "train")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Dropout", ["h", "ratio", "train"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.FLOAT, ["batch", D])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["batch", D])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


x = np.random.default_rng(1).standard_normal((512, D)).astype(np.float32)
onnxtrain.set_seed(0)
first = onnxtrain.InferenceSession(model(True))
first.run(None, {"x": x})
kept = onnxtrain.InferenceSession(model(False))  # no draws: its batches may still split
kept.run(None, {"x": x})
later = onnxtrain.InferenceSession(model(True)).run(None, {"x": x[:4]})[0]
print(first._splitter is None, kept._splitter is not None, hashlib.sha256(later.tobytes()).hexdigest())
"""


def test_draws_after_a_random_model_do_not_depend_on_the_threads() -> None:
    """set_seed(0), a model with a training-mode Dropout run on a large batch, then another: the later
    draws were other at 2 threads than at 1 (the first model's trial run in two halves took generators off
    set_seed's sequence); onnxruntime's draws do not depend on its thread count. A model that draws no
    value still splits."""
    import subprocess
    import sys

    outs = []
    for threads in ("1", "2"):
        env = {**os.environ, "ONNXTRAIN_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-c", _SEEDED_DRAWS], capture_output=True, text=True, timeout=120,
                           env=env)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(r.stdout.split())
    assert outs[0][2] == outs[1][2], outs
    assert outs[1][:2] == ["True", "True"], outs  # at 2 threads: no splitter for the drawing model

"""Review F: the inference session's surface against onnxruntime 1.32's, under awkward use (session options
that change what a run computes, runs while other threads are alive)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from tests.engine.run_stops import StopAtRead
from tests.engine.unfused_failures import fails_as_unfused

F = TensorProto.FLOAT


def _product_model() -> bytes:
    """c = a · b, elementwise, of three floats."""
    g = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info("a", F, [3]),
                           helper.make_tensor_value_info("b", F, [3])],
                          [helper.make_tensor_value_info("c", F, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


# subnormal float32 results: 1e-39 · 1, 1e-20 · 1e-20 (1e-40), 1 · 1e-39
_A = [1e-39, 1e-20, 1.0]
_B = [1.0, 1e-20, 1e-39]

_ORT_FLUSHES = textwrap.dedent("""
    import sys, numpy as np, onnxruntime as ort
    so = ort.SessionOptions()
    so.add_session_config_entry("session.set_denormal_as_zero", "1")
    s = ort.InferenceSession(sys.stdin.buffer.read(), so, providers=["CPUExecutionProvider"])
    c, = s.run(None, {"a": np.array(%r, np.float32), "b": np.array(%r, np.float32)})
    print(c.tolist())
""") % (_A, _B)


def test_set_denormal_as_zero_is_not_silently_ignored() -> None:
    """onnxruntime's session config entry ``session.set_denormal_as_zero = "1"`` flushes subnormal floats to
    zero (the oracle, in a process of its own: it sets the calling thread's FTZ/DAZ flags, which would reach
    the other tests' numpy); the numpy engine keeps them, as IEEE does. The session took the entry without a
    word and returned other values than onnxruntime's: it now warns, naming the entry."""
    model = _product_model()
    ort_out = subprocess.run([sys.executable, "-c", _ORT_FLUSHES], input=model, capture_output=True,
                             check=True, timeout=60).stdout.decode()
    assert eval(ort_out) == [0.0, 0.0, 0.0]  # noqa: S307 - a list of floats printed by the oracle
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    with pytest.warns(UserWarning, match=r"session\.set_denormal_as_zero"):
        sess = onnxtrain.InferenceSession(model, options)
    c, = sess.run(None, {"a": np.array(_A, np.float32), "b": np.array(_B, np.float32)})
    np.testing.assert_array_equal(c, np.array(_A, np.float32) * np.array(_B, np.float32))
    assert (c > 0).all()  # the subnormals kept: what the warning says
    # "0" (onnxruntime's default) asks for nothing: no warning
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.InferenceSession(model, options)


def _graph_optimizing_entry_model(key: str) -> tuple[bytes, dict[str, np.ndarray]]:
    """A model onnxruntime rewrites when session config entry ``key`` is "1", and its feed."""
    x = np.linspace(-4, 4, 1001, dtype=np.float32) * np.float32(1.001)
    io = ([helper.make_tensor_value_info("x", F, [1001])], [helper.make_tensor_value_info("y", F, [1001])])
    if key == "optimization.enable_cast_chain_elimination":  # float32 → float16 → float32
        nodes = [helper.make_node("Cast", ["x"], ["h"], to=TensorProto.FLOAT16),
                 helper.make_node("Cast", ["h"], ["y"], to=F)]
        inits = []
    elif key == "optimization.enable_gelu_approximation":  # torch's export of the exact GELU
        nodes = [helper.make_node("Div", ["x", "sqrt2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
                 helper.make_node("Add", ["e", "one"], ["a"]), helper.make_node("Mul", ["x", "a"], ["m"]),
                 helper.make_node("Mul", ["m", "half"], ["y"])]
        inits = [numpy_helper.from_array(np.array(v, np.float32), n)
                 for n, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    else:  # a quantized activation: QuantizeLinear → DequantizeLinear
        nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"]),
                 helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["d"]),
                 helper.make_node("Relu", ["d"], ["y"])]
        inits = [numpy_helper.from_array(np.array(0.05, np.float32), "scale"),
                 numpy_helper.from_array(np.array(0, np.uint8), "zero")]
    g = helper.make_graph(nodes, "g", *io, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString(), {"x": x}


@pytest.mark.parametrize(("key", "lowest"), [
    ("optimization.enable_cast_chain_elimination", "ORT_ENABLE_BASIC"),
    ("optimization.enable_gelu_approximation", "ORT_ENABLE_EXTENDED"),
    ("session.enable_quant_qdq_cleanup", "ORT_ENABLE_EXTENDED"),
])
def test_config_entries_that_change_onnxruntimes_values_are_not_silently_ignored(key: str,
                                                                                 lowest: str) -> None:
    """With these session config entries onnxruntime rewrites the graph into one that computes other values
    (the oracle: onnxruntime with and without the entry, from its graph optimization level ``lowest`` on;
    below it, onnxruntime leaves the graph as it is). The numpy engine computes the graph as it is: the
    session took the entries without a word; it now warns, naming the entry, at the levels where onnxruntime
    applies it, and its values are onnxruntime's without the entry."""
    import onnxruntime as ort

    model, feed = _graph_optimizing_entry_model(key)

    def ort_run(entry: bool, level: str = "ORT_ENABLE_ALL") -> np.ndarray:
        so = ort.SessionOptions()
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
        if entry:
            so.add_session_config_entry(key, "1")
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"]).run(None, feed)[0]

    plain = ort_run(False)
    assert np.abs(ort_run(True) - plain).max() > 1e-4  # what the entry does in onnxruntime
    assert np.abs(ort_run(True, lowest) - plain).max() > 1e-4
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry(key, "1")
    with pytest.warns(UserWarning, match=key.replace(".", r"\.")):
        sess = onnxtrain.InferenceSession(model, options)
    np.testing.assert_allclose(sess.run(None, feed)[0], plain, rtol=1e-6, atol=1e-6)
    below = {"ORT_ENABLE_BASIC": "ORT_DISABLE_ALL", "ORT_ENABLE_EXTENDED": "ORT_ENABLE_BASIC"}[lowest]
    # onnxruntime leaves the graph as it is there
    np.testing.assert_allclose(ort_run(True, below), ort_run(False, below), rtol=1e-6, atol=1e-6)
    options.graph_optimization_level = getattr(onnxtrain.GraphOptimizationLevel, below)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.InferenceSession(model, options)


def _wide_product_model(width: int) -> bytes:
    """y = (tanh(x) · x) @ W of x [batch, width], W [width, 2]: the batch split's kind of model (activations
    well above its 1 MiB and twice the weights at batch 2), whose product of one row (each half's) rounds
    otherwise than the product of two."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((width, 2)).astype(np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["u"]),
         helper.make_node("MatMul", ["u", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", F, ["batch", width])],
        [helper.make_tensor_value_info("y", F, ["batch", 2])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _run_with_another_thread_alive(sess, feeds):
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        return sess.run(None, feeds)[0]
    finally:
        idle.set()
        other.join()


@pytest.mark.parametrize("batch", [2, 4, 8])
def test_a_batch_size_gives_the_same_bits_while_another_thread_is_alive(batch: int) -> None:
    """onnxruntime gives the same bits for the same feeds, whatever other threads the process runs (and its
    sessions allow concurrent runs). The batch split gave the halves' bits, or the whole batch's when another
    Python thread was alive: two runs of one session on one feed differed (about 4e-3 on values of about 800
    at batch 2, where each half's product is a matrix-vector product)."""
    model = _wide_product_model(1 << 18)
    sess = onnxtrain.InferenceSession(model)
    if sess._splitter is None:
        pytest.skip("the batch split is off here (one thread, or no OpenBLAS)")
    x = np.random.default_rng(batch).standard_normal((batch, 1 << 18)).astype(np.float32)
    first, = sess.run(None, {"x": x})  # (the first run checks the halves)
    again, = sess.run(None, {"x": x})
    meanwhile = _run_with_another_thread_alive(sess, {"x": x})
    later, = sess.run(None, {"x": x})
    want, = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))
    for out in (again, meanwhile, later):
        assert out.tobytes() == first.tobytes()
    if batch == 8:  # (products of 4 rows round alike on one thread and on BLAS's two)
        assert sess._splitter.verdicts == {8: True} and sess._splitter.split_runs == 3


def test_a_batch_size_first_run_while_another_thread_is_alive_keeps_its_bits() -> None:
    """A size whose check cannot be made (BLAS's threads cannot be pinned while another Python thread is
    alive) runs whole from then on: its later runs, the other thread gone, give the first run's bits."""
    model = _wide_product_model(1 << 18)
    sess = onnxtrain.InferenceSession(model)
    if sess._splitter is None:
        pytest.skip("the batch split is off here (one thread, or no OpenBLAS)")
    x = np.random.default_rng(3).standard_normal((8, 1 << 18)).astype(np.float32)
    meanwhile = _run_with_another_thread_alive(sess, {"x": x})
    later = [sess.run(None, {"x": x})[0] for _ in range(2)]
    assert sess._splitter.verdicts == {8: False} and sess._splitter.split_runs == 0
    for out in later:
        assert out.tobytes() == meanwhile.tobytes()


@pytest.mark.parametrize("providers", [None, ["CPUExecutionProvider"], ["CUDAExecutionProvider"],
                                       [("CPUExecutionProvider", {})]])
def test_disabled_cpu_fallback_is_refused_as_onnxruntime_refuses_it(providers) -> None:
    """``session.disable_cpu_ep_fallback = "1"`` asks for a session that never runs a node on the CPU: the
    numpy engine runs every node there. onnxruntime refuses the session (the oracle: its Fail when the CPU
    provider would be the fallback, its InvalidArgument when the CPU provider is asked for too); onnxtrain
    made it and ran on the CPU without a word (or with the unavailable provider's fallback warning). It now
    refuses it as onnxruntime does, naming the entry; "0" is taken."""
    import onnxruntime as ort

    model = _product_model()
    kind = {}
    for lib in (ort, onnxtrain):
        options = lib.SessionOptions()
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the unavailable CUDA provider's fallback warning)
            with pytest.raises(Exception) as e:  # noqa: PT011 - onnxruntime's classes are no RuntimeErrors
                lib.InferenceSession(model, options, providers=providers)
        kind[lib.__name__] = type(e.value).__name__
        if lib is onnxtrain:
            assert "session.disable_cpu_ep_fallback" in str(e.value)
    assert kind["onnxtrain"] == kind["onnxruntime"]
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0")
    c, = onnxtrain.InferenceSession(model, options).run(None, {"a": np.ones(3, np.float32),
                                                              "b": np.full(3, 2, np.float32)})
    np.testing.assert_array_equal(c, np.full(3, 2, np.float32))


def test_an_optimized_model_asked_in_ort_format_is_not_silently_written_as_onnx(tmp_path) -> None:
    """``session.save_model_format = "ORT"`` makes onnxruntime write ``optimized_model_filepath`` in its ORT
    format whatever the file's name (the oracle: the file it writes does not parse as ONNX); onnxtrain writes
    an ONNX model there, and said so only for a name ending in .ort. It now warns, naming the entry."""
    import onnx
    import onnxruntime as ort

    model = _product_model()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.save_model_format", "ORT")
    options.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):  # noqa: B017, PT011 - protobuf's DecodeError, whatever onnx wraps it in
        onnx.load(str(tmp_path / "ort.onnx"))
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.save_model_format", "ORT")
    options.optimized_model_filepath = str(tmp_path / "ours.onnx")
    with pytest.warns(UserWarning, match=r"session\.save_model_format"):
        onnxtrain.InferenceSession(model, options)
    onnx.checker.check_model(onnx.load(str(tmp_path / "ours.onnx")))  # what the warning says: ONNX


def _passing_weight_model() -> bytes:
    """Outputs that pass the initializer w through (Identity, a Reshape, a Squeeze's view, a sequence of it)
    and y = x · w."""
    shape = numpy_helper.from_array(np.array([1, 3], np.int64), "shape")
    axis = numpy_helper.from_array(np.array([0], np.int64), "axis")
    w = numpy_helper.from_array(np.ones(3, np.float32), "w")
    g = helper.make_graph(
        [helper.make_node("Identity", ["w"], ["wi"]), helper.make_node("Mul", ["x", "w"], ["y"]),
         helper.make_node("Reshape", ["w", "shape"], ["wr"]),
         helper.make_node("Squeeze", ["wr", "axis"], ["ws"]),
         helper.make_node("SequenceConstruct", ["w"], ["wseq"])], "g",
        [helper.make_tensor_value_info("x", F, [3])],
        [helper.make_tensor_value_info("wi", F, [3]), helper.make_tensor_value_info("y", F, [3]),
         helper.make_tensor_value_info("wr", F, [1, 3]), helper.make_tensor_value_info("ws", F, [3]),
         helper.make_tensor_sequence_value_info("wseq", F, [3])], [w, shape, axis])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_outputs_passing_an_add_initializer_array_through_are_the_callers_own(layout: str) -> None:
    """``SessionOptions.add_initializer`` hands the session the caller's array, which the plan reads in place
    (a strided one: a copy). An output passing that initializer through (Identity, a Reshape or Squeeze view,
    a sequence of it) was that very array: writing into the output the run returned rewrote the session's
    weight (the next run's x · w used it) and the caller's array. The oracle: numpy (the outputs are w as
    given, y = x · w, whatever the caller then writes into them), and onnxruntime side by side for a
    contiguous array, whose next run is unchanged (its pass-through outputs themselves show the model's own
    initializer, folded before the override: not compared; it refuses a strided array)."""
    import onnxruntime as ort

    model = _passing_weight_model()
    x = np.array([1, 2, 3], np.float32)
    libs = (ort, onnxtrain) if layout == "contiguous" else (onnxtrain,)
    for lib in libs:
        given = np.full(6 if layout == "strided" else 3, 2, np.float32)
        array = given[::2] if layout == "strided" else given
        value = lib.OrtValue.ortvalue_from_numpy(array)  # (onnxruntime reads it: it must outlive the session)
        options = lib.SessionOptions()
        options.add_initializer("w", value)
        sess = lib.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        wi, y, wr, ws, wseq = sess.run(None, {"x": x})
        np.testing.assert_array_equal(y, 2 * x)
        if lib is onnxtrain:
            for out in (wi, wr.reshape(-1), ws, *wseq):
                np.testing.assert_array_equal(out, np.full(3, 2, np.float32))
        for out in (wi, wr, ws, *wseq):
            out[...] = 100  # the caller's outputs, to write
        after = sess.run(None, {"x": x})
        np.testing.assert_array_equal(after[1], 2 * x)  # the weight as given
        np.testing.assert_array_equal(given, np.full_like(given, 2))
        if lib is onnxtrain:
            np.testing.assert_array_equal(after[0], np.full(3, 2, np.float32))


def test_a_run_stopped_before_a_fused_step_names_a_node_of_the_graph() -> None:
    """A run stopped by ``RunOptions.terminate`` names the node it stopped before (onnxruntime's message
    names none). Before a step the engine fused (a linear layer's exported GELU: one elementwise step) it
    named the step, 'FusedElementwise(/gelu/Mul_1)', which no node of the model is; it now names the first
    node of those the step runs, which is where the run stopped."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b"),
             *[numpy_helper.from_array(np.array(v, np.float32), n)
               for n, v in (("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="/lin/MatMul"),
             helper.make_node("Add", ["m", "b"], ["h"], name="/lin/Add"),
             helper.make_node("Div", ["h", "sqrt2"], ["d"], name="/gelu/Div"),
             helper.make_node("Erf", ["d"], ["e"], name="/gelu/Erf"),
             helper.make_node("Add", ["e", "one"], ["a"], name="/gelu/Add"),
             helper.make_node("Mul", ["h", "a"], ["g"], name="/gelu/Mul"),
             helper.make_node("Mul", ["g", "half"], ["y"], name="/gelu/Mul_1")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 8])],
                          [helper.make_tensor_value_info("y", F, ["N", 8])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    sess = onnxtrain.InferenceSession(model)
    assert any(st.node.domain == "onnxtrain.fused" for st in sess._plan.steps)  # (what the test is about)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    names = {n.name for n in nodes}
    named = []
    for at in range(1, 20):
        try:
            sess.run(None, {"x": x}, StopAtRead(at))
            break
        except RuntimeError as e:
            assert "terminate" in str(e), e
            found = re.search(r"before node '([^']*)'", str(e))  # (none: stopped before the run began)
            if found:
                named.append(found.group(1))
    assert named and all(n in names for n in named), named
    assert "/gelu/Div" in named  # the fused GELU's first node


def test_a_bias_that_does_not_broadcast_fails_as_the_unfused_add() -> None:
    """A MatMul's product plus a bias fed at run time of a size that does not broadcast onto it: onnxruntime
    (the oracle) fails naming the Add node, and so does the unfused plan (a NodeRuntimeException,
    onnxruntime's Fail). The fused MatMul + Add step asked numpy whether the bias fits with
    np.broadcast_shapes, whose ValueError escapes: the run fails naming 'FusedMatMulAdd(/lin/Add)' (no
    node of the model), as a plain EngineError, with numpy's words about broadcast_shapes."""

    w = numpy_helper.from_array(np.ones((4, 3), np.float32), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"], name="/lin/MatMul"),
             helper.make_node("Add", ["m", "b"], ["y"], name="/lin/Add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["B", 4]),
                                       helper.make_tensor_value_info("b", F, ["E"])],
                          [helper.make_tensor_value_info("y", F, ["B", 3])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    feed = {"x": np.ones((2, 4), np.float32), "b": np.ones(5, np.float32)}
    sess = fails_as_unfused(model, feed, "/lin/Add", "Add", same_message=True)
    assert any(st.node.op_type == "FusedMatMulAdd" for st in sess._plan.steps)  # (what the test is about)
    # a bias that fits still adds
    y, = sess.run(None, {"x": np.ones((2, 4), np.float32), "b": np.arange(3, dtype=np.float32)})
    np.testing.assert_array_equal(y, 4 + np.arange(3, dtype=np.float32)[None].repeat(2, 0))


def test_a_lazy_select_of_operands_that_do_not_broadcast_fails_as_the_unfused_nodes() -> None:
    """``Where(c, x, a + b)`` with a one-element c is one fused step that runs the Add only when c picks it.
    With operands that do not broadcast together, onnxruntime (the oracle) fails naming the Add, and so does
    the unfused plan; the fused step's own np.broadcast_shapes raised first: the run failed naming
    'LazySelect(/sel/Where)' as a plain EngineError. It now fails as the unfused plan does."""

    nodes = [helper.make_node("Add", ["a", "b"], ["s"], name="/sel/Add"),
             helper.make_node("Where", ["c", "x", "s"], ["y"], name="/sel/Where")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, [1]),
                                       helper.make_tensor_value_info("x", F, ["N"]),
                                       helper.make_tensor_value_info("a", F, ["A"]),
                                       helper.make_tensor_value_info("b", F, ["B"])],
                          [helper.make_tensor_value_info("y", F, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    feed = {"c": np.array([False]), "x": np.ones(3, np.float32), "a": np.ones(3, np.float32),
            "b": np.ones(2, np.float32)}
    sess = fails_as_unfused(model, feed, "/sel/Add", "Add", same_message=True)
    assert any(st.node.op_type == "LazySelect" for st in sess._plan.steps)  # (what the test is about)
    for flag in (False, True):  # operands that broadcast: as onnxruntime computes them
        feed.update(c=np.array([flag]), b=np.full(3, 2, np.float32))
        want = np.full(3, 1 if flag else 3, np.float32)
        np.testing.assert_array_equal(sess.run(None, feed)[0], want)


def test_layer_norm_statistics_declared_of_another_type_than_stash_type_are_refused() -> None:
    """onnxruntime (the oracle) refuses a model whose LayerNormalization's Mean is declared float16 while its
    stash_type (float, the default) makes it float32: a Fail at load naming the output's type. onnxtrain
    takes the model and returns a float32 array for an output it lists as tensor(float16)."""
    import onnxruntime as ort

    g = numpy_helper.from_array(np.ones(5, np.float16), "g")
    b = numpy_helper.from_array(np.zeros(5, np.float16), "b")
    half = TensorProto.FLOAT16
    graph = helper.make_graph(
        [helper.make_node("LayerNormalization", ["x", "g", "b"], ["y", "mean"], axis=-1)], "g",
        [helper.make_tensor_value_info("x", half, [3, 5])],
        [helper.make_tensor_value_info("y", half, [3, 5]),
         helper.make_tensor_value_info("mean", half, [3, 1])],
        [g, b])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(Exception, match="Type Error"):  # noqa: PT011 - onnxruntime's Fail is no RuntimeError
        ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float16)
    try:
        sess = onnxtrain.InferenceSession(model)
    except RuntimeError as e:
        assert "mean" in str(e) and "LayerNormalization" in str(e)
        return
    declared = {o.name: o.type for o in sess.get_outputs()}
    outs = dict(zip(declared, sess.run(None, {"x": x})))
    assert declared["mean"] == "tensor(float16)"
    assert outs["mean"].dtype == np.float16, "an output of another type than get_outputs() says"

"""Review R1 of the session commits of review F: the same faults on neighbouring paths (onnxruntime's own
SessionOptions given to an onnxtrain session; a Sum the fusions expand into Adds)."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import onnx
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


# in a process of its own (the entry sets the thread's FTZ/DAZ flags): onnxruntime's values with the entry
_ORT_FLUSHES = textwrap.dedent("""
    import sys, numpy as np, onnxruntime as ort
    so = ort.SessionOptions()
    so.add_session_config_entry("session.set_denormal_as_zero", "1")
    s = ort.InferenceSession(sys.stdin.buffer.read(), so, providers=["CPUExecutionProvider"])
    c, = s.run(None, {"a": np.array([1e-39, 1e-20, 1.0], np.float32),
                      "b": np.array([1.0, 1e-20, 1e-39], np.float32)})
    print(c.tolist())
""")


def test_onnxruntimes_options_with_set_denormal_as_zero_are_warned_of() -> None:
    """onnxtrain's session takes onnxruntime's own SessionOptions, and reads their config entries
    (onnxtrain.backend: engine/backends.session_config_entry). ``session.set_denormal_as_zero = "1"`` set on
    them flushes subnormal results to
    zero in onnxruntime (the oracle, in a process of its own) while the numpy engine keeps them: the warning
    review F added for onnxtrain's SessionOptions was not given for onnxruntime's (config_entries reads
    onnxtrain's only)."""
    out = subprocess.run([sys.executable, "-c", _ORT_FLUSHES], input=_product_model(), capture_output=True,
                         check=True, timeout=60).stdout.decode()
    assert [float(v) for v in out.strip()[1:-1].split(",")] == [0.0, 0.0, 0.0]
    options = ort.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    with pytest.warns(UserWarning, match=r"session\.set_denormal_as_zero"):
        sess = onnxtrain.InferenceSession(_product_model(), options)
    c, = sess.run(None, {"a": np.array([1e-39, 1e-20, 1.0], np.float32),
                         "b": np.array([1.0, 1e-20, 1e-39], np.float32)})
    assert np.all(c > 0)  # (the numpy engine keeps them, as the warning says)


def erf_gelu_model() -> onnx.ModelProto:
    """The exported erf GELU of x[200] (onnxruntime's optimization.enable_gelu_approximation replaces it)."""
    consts = [helper.make_tensor(n, F, [], [v]) for n, v in (("s", 2 ** 0.5), ("one", 1.0), ("half", 0.5))]
    nodes = [helper.make_node("Div", ["x", "s"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["f"]), helper.make_node("Mul", ["x", "f"], ["g"]),
             helper.make_node("Mul", ["g", "half"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [200])],
                          [helper.make_tensor_value_info("y", F, [200])], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _gelu_model() -> bytes:
    return erf_gelu_model().SerializeToString()


def test_onnxruntimes_options_with_gelu_approximation_are_warned_of() -> None:
    """The same for ``optimization.enable_gelu_approximation``: onnxruntime with that very options object
    gives other values (the oracle: up to 5e-4 from the erf GELU), onnxtrain must say it does not apply it."""
    x = np.linspace(-4, 4, 200).astype(np.float32)
    options = ort.SessionOptions()
    cpu = ["CPUExecutionProvider"]
    plain = ort.InferenceSession(_gelu_model(), options, providers=cpu).run(None, {"x": x})[0]
    options.add_session_config_entry("optimization.enable_gelu_approximation", "1")
    approx = ort.InferenceSession(_gelu_model(), options, providers=cpu).run(None, {"x": x})[0]
    assert np.abs(approx - plain).max() > 1e-4
    with pytest.warns(UserWarning, match=r"optimization\.enable_gelu_approximation"):
        sess = onnxtrain.InferenceSession(_gelu_model(), options)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], plain, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("providers", [None, ["CPUExecutionProvider"]])
def test_onnxruntimes_options_disabling_cpu_fallback_are_refused_as_onnxruntime_does(providers) -> None:
    """``session.disable_cpu_ep_fallback = "1"`` on onnxruntime's SessionOptions: onnxruntime refuses the
    session with those very options (Fail, or InvalidArgument with the CPU provider asked for); onnxtrain's
    numpy engine ran every node on the CPU without a word."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    kind = {}
    for lib in (ort, onnxtrain):
        with pytest.raises(Exception) as e:  # noqa: PT011 - onnxruntime's classes are no RuntimeErrors
            lib.InferenceSession(_product_model(), options, providers=providers)
        kind[lib.__name__] = type(e.value).__name__
    assert kind["onnxtrain"] == kind["onnxruntime"]
    assert "session.disable_cpu_ep_fallback" in str(e.value)


def test_onnxruntimes_options_asking_the_ort_format_are_warned_of(tmp_path) -> None:
    """``session.save_model_format = "ORT"`` on onnxruntime's SessionOptions: onnxruntime writes its ORT
    format (the oracle: the file does not parse as ONNX); onnxtrain writes ONNX and must say so."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.save_model_format", "ORT")
    options.optimized_model_filepath = str(tmp_path / "ort.onnx")
    ort.InferenceSession(_product_model(), options, providers=["CPUExecutionProvider"])
    with pytest.raises(Exception):  # noqa: B017, PT011 - protobuf's DecodeError, whatever onnx wraps it in
        onnx.load(str(tmp_path / "ort.onnx"))
    options.optimized_model_filepath = str(tmp_path / "ours.onnx")
    with pytest.warns(UserWarning, match=r"session\.save_model_format"):
        onnxtrain.InferenceSession(_product_model(), options)


def test_onnxruntimes_options_without_such_entries_are_taken_quietly() -> None:
    """The other side: onnxruntime's options with those entries unset or "0" give no warning."""
    options = ort.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "0")
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sess = onnxtrain.InferenceSession(_product_model(), options)
    c, = sess.run(None, {"a": np.ones(3, np.float32), "b": np.full(3, 2, np.float32)})
    np.testing.assert_array_equal(c, np.full(3, 2, np.float32))


def _sum_model(name: str, first: str | None = "Exp") -> bytes:
    """y = tanh(first(a) + b + c) (without ``first``: tanh(a + b + c)) with a Sum of three inputs (the
    fusions expand it into two Adds); a, b, c of their own dims, so a run may feed sizes that do not
    broadcast."""
    nodes = [helper.make_node(first, ["a"], ["ea"], name="/first")] if first else []
    nodes += [helper.make_node("Sum", ["ea" if first else "a", "b", "c"], ["s"], name=name),
              helper.make_node("Tanh", ["s"], ["y"], name="/tanh")]
    inputs = [helper.make_tensor_value_info(n, F, [d]) for n, d in zip("abc", "PQR")]
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", F, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("name", ["/sum", ""])
def test_a_sum_of_operands_that_do_not_broadcast_fails_naming_the_sum(name: str) -> None:
    """Review F made fused steps fail as their graph nodes (cfb631e0, 996f8942); the fusions' expansion of a
    Sum into Adds ((a + b) + c, fusion/elementwise.expand_sums) still failed naming 'node '/sum/add_2' (Add)'
    on inputs 's/partial_sum_1' and 'c', no node nor value of the model. onnxruntime 1.32 (the oracle) fails
    naming the Sum node, as the unfused plan does (graph optimizations off), of the same class."""
    model = _sum_model(name)
    feeds = {"a": np.ones(4, np.float32), "b": np.ones(4, np.float32), "c": np.ones(3, np.float32)}
    with pytest.raises(Exception) as want:  # noqa: PT011 - onnxruntime's Fail is no RuntimeError
        ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    assert f"running Sum node. Name:'{name}'" in str(want.value)
    errors = []
    levels = onnxtrain.GraphOptimizationLevel
    for level in (levels.ORT_DISABLE_ALL, levels.ORT_ENABLE_ALL):
        options = onnxtrain.SessionOptions()
        options.graph_optimization_level = level
        sess = onnxtrain.InferenceSession(model, options)
        # (what the test is about: the Sum is expanded when optimizing, not when not)
        assert any(st.node.op_type == "Sum" for st in sess._plan.steps) == (not level)
        with pytest.raises(RuntimeError) as e:
            sess.run(None, feeds)
        errors.append(e.value)
    label = f"'{name}'" if name else "(unnamed, making 's')"
    for e in errors:
        assert f"node {label} (Sum) failed" in str(e), e
        assert "add_" not in str(e) and "partial_sum" not in str(e), e
    assert type(errors[1]) is type(errors[0])


@pytest.mark.parametrize("first", ["Exp", None])
def test_a_run_stopped_before_an_expanded_sum_names_a_node_of_the_graph(first: str | None) -> None:
    """A run stopped by ``RunOptions.terminate`` names the node it stopped before (64332ec5: a fused step's
    first graph node). A fused step that begins with a Sum the fusions expanded named its first Add,
    '/sum/add_1', no node of the model; every name must be one of the graph's nodes (the oracle: the
    model's own node list), the Sum where the run stops before it."""
    model = _sum_model("/sum", first)
    names = {n.name for n in onnx.load_from_string(model).graph.node}
    sess = onnxtrain.InferenceSession(model)
    assert not any(st.node.op_type == "Sum" for st in sess._plan.steps)  # (expanded)
    x = np.ones(4, np.float32)
    named = []
    for at in range(1, 20):
        try:
            sess.run(None, {"a": x, "b": x, "c": x}, StopAtRead(at))
            break
        except RuntimeError as e:
            assert "terminate" in str(e), e
            found = re.search(r"before node '([^']*)'", str(e))  # (none: stopped before the run began)
            if found:
                named.append(found.group(1))
    assert named and all(n in names for n in named), named
    assert named[0] == ("/first" if first else "/sum"), named


def test_a_float16_bias_that_does_not_broadcast_fails_as_the_unfused_add() -> None:
    """996f8942 made the fused MatMul + Add step answer a bias that does not broadcast onto the product by
    running the unfused Add, which fails naming its node; its float16 path (kernels/matmul.half_product_plus,
    tried first for float16 operands) still let np.broadcast_shapes' ValueError escape: the run failed naming
    'FusedMatMulAdd(/lin/Add)', no node of the model, as a plain EngineError. onnxruntime 1.32 (the oracle)
    fails naming the Add node, as the unfused plan does, of the same class."""
    half = TensorProto.FLOAT16
    nodes = [helper.make_node("MatMul", ["x", "w"], ["m"], name="/lin/MatMul"),
             helper.make_node("Add", ["m", "b"], ["y"], name="/lin/Add")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", half, ["N", 4]),
                                       helper.make_tensor_value_info("w", half, [4, 3]),
                                       helper.make_tensor_value_info("b", half, ["B"])],
                          [helper.make_tensor_value_info("y", half, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    feeds = {"x": np.ones((2, 4), np.float16), "w": np.ones((4, 3), np.float16), "b": np.ones(5, np.float16)}
    sess = fails_as_unfused(model, feeds, "/lin/Add", "Add")
    assert len(sess._plan.steps) == 1  # (fused when optimizing)
    # a bias that fits still takes the float16 path: the values of float32 arithmetic rounded once
    feeds["b"] = np.arange(3, dtype=np.float16)
    want, = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, feeds)
    got, = onnxtrain.InferenceSession(model).run(None, feeds)
    np.testing.assert_array_equal(got, want)


def test_a_run_stopped_before_a_fused_step_names_a_node_whose_name_holds_a_comma() -> None:
    """64332ec5 names the first graph node of a fused step, read back from the step's member list, which it
    joined with ', ': a node named 'block 1, exp' came back as 'block 1', no node of the model. Every name
    must be one of the graph's nodes (the oracle: the model's own node list)."""
    nodes = [helper.make_node("Exp", ["a"], ["e"], name="block 1, exp"),
             helper.make_node("Tanh", ["e"], ["y"], name="block 1, tanh")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", F, ["N"])],
                          [helper.make_tensor_value_info("y", F, ["N"])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    sess = onnxtrain.InferenceSession(model)
    assert len(sess._plan.steps) == 1  # (one fused step)
    named = []
    for at in range(1, 10):
        try:
            sess.run(None, {"a": np.ones(4, np.float32)}, StopAtRead(at))
            break
        except RuntimeError as e:
            found = re.search(r"before node '([^']*)'", str(e))
            if found:
                named.append(found.group(1))
    assert named == ["block 1, exp"], named


@pytest.mark.parametrize("providers", [["FooExecutionProvider"], ["CUDAExecutionProvider"]])
def test_disabled_cpu_fallback_after_a_provider_fallback_is_refused_as_onnxruntime_refuses_it(
        providers, capsys) -> None:
    """fa1c031b refuses ``session.disable_cpu_ep_fallback = "1"`` by the providers asked for, before the
    session's fallback for a providers argument it cannot use (an unknown name): onnxruntime 1.32 (the
    oracle) prints its 'EP Error' banner, retries with the CPU provider itself and so refuses the session as
    asking for the CPU (InvalidArgument), where onnxtrain raised a Fail. An unavailable provider (CUDA) is
    no such fallback: a Fail on both sides."""
    kind = {}
    for lib in (ort, onnxtrain):
        options = lib.SessionOptions()
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the unavailable CUDA provider's warning)
            with pytest.raises(Exception) as e:  # noqa: PT011 - onnxruntime's classes are no RuntimeErrors
                lib.InferenceSession(_product_model(), options, providers=providers)
        kind[lib.__name__] = type(e.value).__name__
    assert kind["onnxtrain"] == kind["onnxruntime"], kind
    assert "session.disable_cpu_ep_fallback" in str(e.value)


def test_onnxruntimes_options_put_the_optimized_models_weights_in_a_data_file(tmp_path) -> None:
    """The optimized model's initializers go to a data file beside it with the config entries
    ``session.optimized_model_external_initializers_file_name`` (and ``..._min_size_in_bytes``), as
    onnxruntime writes them (the oracle: onnxruntime with the very same options object writes that file).
    With onnxruntime's SessionOptions onnxtrain read neither entry (87b2dea0 made the entries of review F
    read there, not these) and wrote the weights inside the model."""
    w = numpy_helper.from_array(np.arange(64 * 64, dtype=np.float32).reshape(64, 64), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, [2, 64])],
                          [helper.make_tensor_value_info("y", F, [2, 64])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    files = {}
    for lib in (ort, onnxtrain):
        folder = tmp_path / lib.__name__
        folder.mkdir()
        options = ort.SessionOptions()
        options.optimized_model_filepath = str(folder / "m.onnx")
        options.add_session_config_entry("session.optimized_model_external_initializers_file_name", "m.data")
        options.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes",
                                         "100")
        lib.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        files[lib.__name__] = sorted(p.name for p in folder.iterdir())
    assert files["onnxruntime"] == ["m.data", "m.onnx"]
    assert files["onnxtrain"] == files["onnxruntime"]
    written = onnx.load(str(tmp_path / "onnxtrain" / "m.onnx"))  # (its data read from m.data)
    np.testing.assert_array_equal(numpy_helper.to_array(written.graph.initializer[0]),
                                  numpy_helper.to_array(w))


def test_onnxruntimes_options_give_the_folder_of_a_models_external_data(tmp_path) -> None:
    """``session.model_external_initializers_file_folder_path`` names the folder of the external data of a
    model given as bytes: onnxruntime with those very options loads it (the oracle: its output); onnxtrain
    did not read the entry from onnxruntime's SessionOptions and could not find the data."""
    w = np.arange(16, dtype=np.float32).reshape(4, 4)
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", F, [2, 4])],
                          [helper.make_tensor_value_info("y", F, [2, 4])], [numpy_helper.from_array(w, "w")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, location="m.data", size_threshold=0)
    data = (tmp_path / "m.onnx").read_bytes()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.model_external_initializers_file_folder_path", str(tmp_path))
    x = np.ones((2, 4), np.float32)
    want, = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_array_equal(want, x @ w)
    got, = onnxtrain.InferenceSession(data, options).run(None, {"x": x})
    np.testing.assert_array_equal(got, want)


def test_onnxruntimes_options_recording_the_ep_assignment_answer_it() -> None:
    """``session.record_ep_graph_assignment_info = "1"`` makes get_provider_graph_assignment_info answer (the
    oracle: onnxruntime 1.32 with the very same options object lists the CPU provider's node); with
    onnxruntime's SessionOptions onnxtrain did not read the entry and raised its Fail."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"], name="r")], "g",
                          [helper.make_tensor_value_info("x", F, [2])],
                          [helper.make_tensor_value_info("y", F, [2])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    options = ort.SessionOptions()
    options.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
    answers = []
    for lib in (ort, onnxtrain):
        info = lib.InferenceSession(model, options, providers=["CPUExecutionProvider"]
                                    ).get_provider_graph_assignment_info()
        answers.append([(s.ep_name, [(n.op_type, n.name) for n in s.get_nodes()]) for s in info])
    assert answers[0] == [("CPUExecutionProvider", [("Relu", "r")])]
    assert answers[1] == answers[0]

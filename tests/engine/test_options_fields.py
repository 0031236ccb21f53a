"""onnxruntime's API details scripts hit: a misspelt option field is an AttributeError (it was stored and
ignored), ``OrtValue.update_inplace(data=...)``, and a model of an opset newer than onnx knows is refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper

from onnxtrain import InferenceSession, OrtValue, RunOptions, SessionOptions
from onnxtrain.capi.onnxruntime_pybind11_state import Fail


@pytest.mark.parametrize("cls, good, typo", [(SessionOptions, "intra_op_num_threads", "intra_op_threads"),
                                             (RunOptions, "terminate", "terminat")])
def test_misspelt_option_fields_are_refused(cls: type, good: str, typo: str) -> None:
    ours, theirs = cls(), getattr(onnxruntime, cls.__name__)()
    for o in (ours, theirs):
        setattr(o, good, getattr(o, good))
        with pytest.raises(AttributeError):
            setattr(o, typo, 1)


def test_update_inplace_by_keyword() -> None:
    v = OrtValue.ortvalue_from_numpy(np.zeros(3, np.float32))
    v.update_inplace(data=np.arange(3, dtype=np.float32))
    np.testing.assert_array_equal(v.numpy(), [0, 1, 2])


def test_an_opset_onnx_does_not_know_is_refused() -> None:
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    newest = onnx.defs.onnx_opset_version()
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", newest + 1)]).SerializeToString()
    with pytest.raises(Fail, match=f"opset {newest + 1} is newer than the installed onnx"):
        InferenceSession(model)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's class for it differs by version
        onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("domain, known", [("ai.onnx.ml", None), ("ai.onnx.preview.training", None),
                                           ("com.microsoft", 1), ("com.microsoft.nchwc", 1),
                                           ("ai.onnx.training", 1), ("org.pytorch.aten", 1)])
def test_other_domains_opsets_past_the_known_are_refused(domain: str, known: int | None) -> None:
    """A model importing ai.onnx.ml, the training preview domain or com.microsoft at a version newer than
    onnx (or onnxruntime, for com.microsoft) knows ran; onnxruntime refuses it at load. The newest known
    version still loads, and so does a domain neither knows."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    if known is None:
        known = max(s.since_version for s in onnx.defs.get_all_schemas_with_history() if s.domain == domain)

    def model(*imports: tuple[str, int]) -> bytes:
        opsets = [helper.make_opsetid("", 17), *(helper.make_opsetid(d, v) for d, v in imports)]
        return helper.make_model(g, opset_imports=opsets, ir_version=8).SerializeToString()

    x = np.array([-1.0, 2.0], np.float32)
    for ok in (model((domain, known)), model(("my.domain", 99))):
        np.testing.assert_array_equal(InferenceSession(ok).run(None, {"x": x})[0], [0.0, 2.0])
        onnxruntime.InferenceSession(ok, providers=["CPUExecutionProvider"])
    bad = model((domain, known + 1))
    with pytest.raises(Fail, match=f"opset {known + 1} of domain '{domain}'"):
        InferenceSession(bad)
    with pytest.raises(Exception):  # noqa: B017 - onnxruntime's class for it differs by version
        onnxruntime.InferenceSession(bad, providers=["CPUExecutionProvider"])


def test_training_entry_points_refuse_unknown_opsets(tmp_path) -> None:
    """The legacy session, the gradient builder and the on-device Module loaded models of opsets onnx does
    not know (the default domain's too) and trained them."""
    from onnxtrain import GradientGraphBuilder, TrainingParameters, TrainingSession
    from onnxtrain.training import api

    w = helper.make_tensor("W", TensorProto.FLOAT, [2, 2], [1.0, 0.0, 0.0, 1.0])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    newest = onnx.defs.onnx_opset_version()
    for imports, match in [([("", 13), ("ai.onnx.ml", 99)], "opset 99 of domain 'ai.onnx.ml'"),
                           ([("", newest + 1)], f"opset {newest + 1} is newer")]:
        model = helper.make_model(g, opset_imports=[helper.make_opsetid(d, v) for d, v in imports],
                                  ir_version=8).SerializeToString()
        p = TrainingParameters()
        p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
        with pytest.raises(Fail, match=match):
            TrainingSession(model, p)
        with pytest.raises(Fail, match=match):
            GradientGraphBuilder(model, {"loss"}, {"W"}, "loss")
        path = tmp_path / "training_model.onnx"
        path.write_bytes(model)
        state = api.CheckpointState.__new__(api.CheckpointState)  # never read: the model is refused first
        with pytest.raises(Fail, match=match):
            api.Module(str(path), state)


def test_subclasses_keep_their_own_fields() -> None:
    class Tagged(SessionOptions):
        def __init__(self) -> None:
            super().__init__()
            self.tag = "mine"

    assert Tagged().tag == "mine"


def test_initializers_passed_through_and_sequence_feeds_are_copies() -> None:
    """A float_data initializer returned by an Identity was the plan's own array (writing it changed the
    next run); a sequence feed's items came back as the output's items."""
    g = helper.make_graph([helper.make_node("Identity", ["W"], ["y"])], "g", [],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])],
                          [helper.make_tensor("W", TensorProto.FLOAT, [3], [1.0, 2.0, 3.0])])
    opset = [helper.make_opsetid("", 17)]
    sess = InferenceSession(helper.make_model(g, opset_imports=opset).SerializeToString())
    y = sess.run(None, {})[0]
    y[0] = 99
    np.testing.assert_array_equal(sess.run(None, {})[0], [1, 2, 3])
    g = helper.make_graph([helper.make_node("Identity", ["s"], ["t"])], "g",
                          [helper.make_tensor_sequence_value_info("s", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_sequence_value_info("t", TensorProto.FLOAT, [2])])
    seq = [np.ones(2, np.float32), np.zeros(2, np.float32)]
    sess = InferenceSession(helper.make_model(g, opset_imports=opset).SerializeToString())
    t = sess.run(None, {"s": seq})[0]
    assert not any(np.shares_memory(a, b) for a, b in zip(t, seq))


@pytest.mark.parametrize("cls, name, value", [
    (RunOptions, "only_execute_path_to_fetches", "False"),  # a path-only run: no update, silently
    (RunOptions, "terminate", "False"),  # stopped the run
    (SessionOptions, "enable_profiling", "False"),  # wrote a trace
    (SessionOptions, "graph_optimization_level", "all"),
    (SessionOptions, "graph_optimization_level", 7),
    (SessionOptions, "execution_mode", 5),
    (SessionOptions, "intra_op_num_threads", 2.5),
    (SessionOptions, "log_severity_level", "1"),
    (SessionOptions, "logid", None),
    (RunOptions, "log_verbosity_level", 1.5),
])
def test_option_values_onnxruntime_refuses_are_type_errors(cls: type, name: str, value) -> None:
    ort_cls = getattr(onnxruntime, cls.__name__)
    with pytest.raises(TypeError):
        setattr(ort_cls(), name, value)
    with pytest.raises(TypeError, match=f"{cls.__name__}.{name}"):
        setattr(cls(), name, value)


@pytest.mark.parametrize("cls, name, value, stored", [
    (RunOptions, "only_execute_path_to_fetches", 1, True),
    (RunOptions, "terminate", np.bool_(False), False),
    (SessionOptions, "enable_profiling", 0, False),
    (SessionOptions, "intra_op_num_threads", np.int64(2), 2),
    (SessionOptions, "log_severity_level", 3, 3),
])
def test_option_values_convert_as_onnxruntime_converts_them(cls: type, name: str, value, stored) -> None:
    ours = cls()
    setattr(ours, name, value)
    theirs = getattr(onnxruntime, cls.__name__)()
    setattr(theirs, name, value)
    assert getattr(ours, name) == getattr(theirs, name) == stored
    assert type(getattr(ours, name)) is type(stored)


def test_enum_options_take_members_onnxruntimes_members_and_their_values() -> None:
    from onnxtrain import ExecutionMode, GraphOptimizationLevel

    so = SessionOptions()
    so.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert so.graph_optimization_level is GraphOptimizationLevel.ORT_ENABLE_BASIC
    so.graph_optimization_level = 0
    assert so.graph_optimization_level is GraphOptimizationLevel.ORT_DISABLE_ALL
    so.execution_mode = ExecutionMode.ORT_PARALLEL
    assert so.execution_mode is ExecutionMode.ORT_PARALLEL


def test_every_onnxruntime_optimization_level_is_taken() -> None:
    from onnxtrain import GraphOptimizationLevel

    for member in onnxruntime.GraphOptimizationLevel.__members__.values():
        so = SessionOptions()
        so.graph_optimization_level = member  # ORT_ENABLE_LAYOUT was refused
        assert so.graph_optimization_level == GraphOptimizationLevel[member.name] == int(member)


def test_a_run_given_no_options_gets_fresh_defaults() -> None:
    """``InferenceSession.run`` without run options makes its defaults without the fields' checks (they
    took half of a one-node run): each is a new object, equal to ``RunOptions()``, whose state (the config
    entries, the backend's linked options) is its own, and which still refuses a misspelt field."""
    a, b, made = RunOptions._default(), RunOptions._default(), RunOptions()
    assert a is not b and a._config is not b._config and a._linked is not b._linked
    assert {k: v for k, v in a.__dict__.items()} == {k: v for k, v in made.__dict__.items()}
    a.add_run_config_entry("k", "v")
    a.terminate = True
    assert RunOptions._default()._config == {} and not RunOptions._default().terminate
    with pytest.raises(AttributeError, match="no attribute 'terminat'"):
        a.terminat = True

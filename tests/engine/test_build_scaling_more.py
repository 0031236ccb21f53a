"""Building a large training graph repeats no per-node work it can share. Measured on a 660-layer
MatMul+Add+Relu chain (34k nodes with its Adam update): every plan looked each node's schema up again
(``onnx.defs.get_schema`` and its attribute objects, once a node), a plan loaded its model twice (each load
walks every node several times), the graph passes looked for bodies in every node (``subgraphs``, ~12 times a
node) although only a node with attributes can hold one, and each of the ten fusion passes mapped the
consumers and producers of all the steps anew though most passes change nothing; the cyclic garbage collector
walked the build's objects again and again (nine full collections, ~1 s of a 4 s build). On the on-device
path, the optimizer model looked up each parameter's type by a scan of every graph input. Counted, not timed;
the graphs built still compute what onnxruntime computes."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain as ort
from onnxtrain.engine import fusion, interface
from onnxtrain.engine.plan import Plan, Step
from onnxtrain.ir import attrs, builder, graphs
from onnxtrain.training import artifacts
from onnxtrain.training.onnxblock import model_accessor
from tests.engine.test_fusion_build_scaling import _lines_run

WIDTH = 4


def _chain(layers: int) -> onnx.ModelProto:
    """``x`` through ``layers`` of MatMul, Add (bias), Relu (every third one a LeakyRelu); loss the mean."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"
    for i in range(layers):
        inits += [
            numpy_helper.from_array((rng.standard_normal((WIDTH, WIDTH)) * 0.5).astype(np.float32), f"W{i}"),
            numpy_helper.from_array((rng.standard_normal(WIDTH) * 0.1 + 0.2).astype(np.float32), f"b{i}"),
        ]
        act = (helper.make_node("LeakyRelu", [f"a{i}"], [f"r{i}"], alpha=0.3) if i % 3 == 2
               else helper.make_node("Relu", [f"a{i}"], [f"r{i}"]))
        nodes += [helper.make_node("MatMul", [cur, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]), act]
        cur = f"r{i}"
    nodes.append(helper.make_node("ReduceMean", [cur], ["loss"], keepdims=0))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", WIDTH])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return model


def _session(model: onnx.ModelProto) -> ort.TrainingSession:
    p = ort.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    return ort.TrainingSession(model.SerializeToString(), p)


def _feeds() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((3, WIDTH)).astype(np.float32)}


# ---- schema look-ups -----------------------------------------------------------------------------------
def test_a_plan_looks_each_op_schema_up_once(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _session(_chain(40))._graphs.full  # the training graph: ~2k nodes of a dozen ops
    Plan(model, fuse=False)  # (node_checks' per-op forms cached, as a session stepping in halves has not)
    calls = []
    real = onnx.defs.get_schema

    def counted(*args: object) -> onnx.defs.OpSchema:
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(onnx.defs, "get_schema", counted)
    getattr(attrs, "_DEFAULTS", {}).clear()  # (the schemas this process read already)
    Plan(model, fuse=False)
    ops = {(n.op_type, n.domain) for n in model.graph.node}
    assert len(model.graph.node) > 20 * len(ops)
    assert len(calls) <= len(ops), (len(calls), len(ops))  # (one per node before: 1,980 here)


def test_attributes_are_the_schema_defaults_and_the_node_own() -> None:
    node = helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], group=1)
    schema = onnx.defs.get_schema("Conv", 17, "")
    want = {name: (helper.get_attribute_value(a.default_value) if a.default_value.name else None)
            for name, a in schema.attributes.items()}
    want = {k: v.decode() if isinstance(v, bytes) else v for k, v in want.items()}  # strings as str
    want.update(pads=[1, 1, 1, 1], group=1)
    first = attrs.parse_attributes(node, 17)
    assert first == want and list(first) == list(want)
    # a default's value (a list) is each node's own: changing one leaves the next parse alone
    gemm = helper.make_node("Gemm", ["a", "b"], ["c"])
    assert attrs.parse_attributes(gemm, 13) == {"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0}
    mvn = attrs.parse_attributes(helper.make_node("MeanVarianceNormalization", ["x"], ["y"]), 13)
    mvn["axes"].append(7)
    assert attrs.parse_attributes(helper.make_node("MeanVarianceNormalization", ["x"], ["y"]), 13) == {
        "axes": [0, 2, 3]}
    # an op without a schema: its own attributes only
    assert attrs.parse_attributes(helper.make_node("Foo", ["x"], ["y"], domain="my.ops", k=2), 1) == {"k": 2}


# ---- loading ---------------------------------------------------------------------------------------------
def test_a_plan_loads_its_model_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = interface._text_names

    def counted(m: onnx.ModelProto) -> onnx.ModelProto:
        calls.append(m)
        return real(m)

    monkeypatch.setattr(interface, "_text_names", counted)
    Plan(_chain(3))
    assert len(calls) == 1, len(calls)  # (2 before: _read_interface loaded the loaded model again)


# ---- bodies ------------------------------------------------------------------------------------------------
def test_graph_passes_look_for_bodies_only_in_nodes_with_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _chain(60)
    asked = []
    real = graphs.subgraphs

    def counted(node: onnx.NodeProto) -> list[onnx.GraphProto]:
        asked.append(bool(node.attribute))
        return real(node)

    monkeypatch.setattr(graphs, "subgraphs", counted)
    s = _session(model)
    assert len(s._graphs.full.graph.node) > 1500
    # the graphs the build made: the step graph, and its two halves and the flat update where the numpy engine
    # steps in halves (120 small weights: session_halves.NUMPY_MIN_MERGED)
    built = [s._graphs.full]
    if s._halves:
        built += [s._graphs.gradients_graph, s._graphs.update_graph, s._flat.model]
    n = sum(len(m.graph.node) for m in built)
    # the passes over every node (walks, reads, the output folding) ask only nodes with attributes: 1.5
    # times a node in all now, 12.6 before
    assert len(asked) <= 2 * n, (len(asked), n)


def test_body_reads_and_walks_still_find_bodies() -> None:
    body = helper.make_graph(
        [helper.make_node("Add", ["outer_a", "outer_a"], ["o"])], "body", [],
        [helper.make_tensor_value_info("o", TensorProto.FLOAT, [2])],
    )
    branch = helper.make_node("If", ["c"], ["y"], then_branch=body, else_branch=body)
    plain = helper.make_node("Relu", ["x"], ["z"])
    g = helper.make_graph(
        [plain, branch], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("outer_a", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    assert graphs.node_reads(branch) == ["c", "outer_a"] and graphs.body_reads(branch) == ["outer_a"]
    assert graphs.body_reads(plain) == [] and graphs.node_reads(plain) == ["x"]
    assert [x.name for x in graphs.walk_graphs(g)] == ["g", "body", "body"]


# ---- fusion maps -----------------------------------------------------------------------------------------
class _Reads(tuple):
    """A step's input slots that count how often they are read through (iteration)."""

    read = 0

    def __iter__(self):  # type: ignore[override]
        _Reads.read += 1
        return super().__iter__()


def test_fusion_passes_share_the_step_maps_of_unchanged_steps() -> None:
    plan = Plan(_session(_chain(40))._graphs.full, fuse=False)
    base = [Step(st.fn, _Reads(st.inputs), st.outputs, st.attrs, st.free, st.node) for st in plan.steps]
    plan.steps = base
    _Reads.read = 0
    fusion.fuse(plan)
    per_step = _Reads.read / len(base)
    # the passes' own reads and ~3 consumer maps; ten maps before (14.2 reads a step here, 9.2 now)
    assert per_step < 11, per_step
    assert not fusion.common._LAST_MAPS  # no steps held after the build


def test_a_consumer_map_follows_changed_steps() -> None:
    def step(ins: tuple[int, ...], outs: tuple[int, ...]) -> Step:
        return Step(None, ins, outs, None, (), helper.make_node("Relu", ["a"], ["b"]))  # type: ignore[arg-type]

    a, b, c = step((0,), (1,)), step((1,), (2,)), step((1, 2), (3,))
    assert fusion.common.consumers([a, b, c]) == {0: [0], 1: [1, 2], 2: [2]}
    assert fusion.common.producers([a, b, c]) == {1: 0, 2: 1, 3: 2}
    steps = [a, b, c]
    steps[1] = step((0,), (2,))  # the same list, one step replaced: mapped anew
    assert fusion.common.consumers(steps) == {0: [0, 1], 1: [2], 2: [2]}
    assert fusion.common.consumers([a, c]) == {0: [0], 1: [1], 2: [1]}
    assert fusion.common.producers([a, c]) == {1: 0, 3: 1}
    fusion.common.forget_step_maps()


# ---- what the built graphs compute -----------------------------------------------------------------------
def test_the_training_graph_computes_the_model_loss_as_onnxruntime() -> None:
    onnxruntime = pytest.importorskip("onnxruntime")
    model = _chain(30)
    s = _session(model)
    onnx.checker.check_model(s._graphs.full, full_check=True)
    feeds = _feeds()
    want = onnxruntime.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["loss"], feeds)[0]
    got = s.run(["loss"], {**feeds, "Learning_Rate": np.array([1e-3], np.float32)})[0]
    assert want > 0  # the chain does not die in the ReLUs: the gradient reaches every weight
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # the first step's update moved the weights: the next loss is onnxruntime's on them
    weights = {n: s._store[n] for n in s._graphs.trainable}
    moved = onnx.ModelProto()
    moved.CopyFrom(model)
    for t in moved.graph.initializer:
        t.CopyFrom(numpy_helper.from_array(weights[t.name], t.name))
    again = onnxruntime.InferenceSession(moved.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["loss"], feeds)[0]
    assert not np.array_equal(again, want)
    np.testing.assert_allclose(s.run(["loss"], {**feeds, "Learning_Rate": np.array([1e-3], np.float32)})[0],
                               again, rtol=1e-5)


# ---- on-device artifacts ---------------------------------------------------------------------------------
def _artifact_lines(layers: int, folder: Any) -> int:
    """Line events of the accessor and the artifact builder while the chain's artifacts are generated."""
    folder.mkdir()
    model = _chain(layers)
    params = [t.name for t in model.graph.initializer]
    files = (model_accessor.__file__, artifacts.__file__)
    return _lines_run(lambda: artifacts.generate_artifacts(
        model, requires_grad=params, loss=None, optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(folder),
    ), files)


def test_the_optimizer_model_is_built_in_near_linear_work(tmp_path: Any) -> None:
    small = _artifact_lines(40, tmp_path / "small")
    large = _artifact_lines(160, tmp_path / "large")
    # each parameter's type was looked up by a scan of every graph input (of the training model for the
    # optimizer's inputs, of the optimizer model for each update): 7.6x for 4x the parameters before, 3.9x now
    assert large < 5 * small, (small, large)
    opt = onnx.load(str(tmp_path / "large" / "optimizer_model.onnx"))
    onnx.checker.check_model(opt, full_check=True)
    types = {v.name: v.type.tensor_type.elem_type for v in opt.graph.input}
    assert all(types[f"{w}{i}"] == TensorProto.FLOAT for i in range(160) for w in "Wb")


def test_input_types_follow_the_inputs_as_they_change() -> None:
    model = _chain(2)
    model.graph.input.extend([helper.make_tensor_value_info("d", TensorProto.DOUBLE, [2])])
    acc = model_accessor.ModelBase(model)
    assert acc.elem_type("x") == TensorProto.FLOAT and acc.elem_type("d") == TensorProto.DOUBLE
    acc.add_input("h", helper.make_tensor_type_proto(TensorProto.FLOAT16, [1]))
    assert acc.elem_type("h") == TensorProto.FLOAT16
    acc.graph.input[1].name = "d2"  # renamed in place: found under its new name, not the old
    assert acc.elem_type("d2") == TensorProto.DOUBLE
    assert acc._input_named("d") is None
    assert [n for n, _ in artifacts.training_input_types(model, ["h", "x"])] == ["h", "x"]
    with pytest.raises(artifacts.ArtifactError, match="'nope' is not an input of the model"):
        artifacts.training_input_types(model, ["x", "nope"])


# ---- the garbage collector ---------------------------------------------------------------------------------
def test_no_collection_walks_the_objects_of_a_build_under_way() -> None:
    model = _chain(60)
    made: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            made.append(info["generation"])

    s = _session(model)  # (imports and first-use caches out of the way)
    gc.callbacks.append(count)
    try:
        s = _session(model)
        built = list(made)
        made.clear()
        Plan(s._graphs.full)
    finally:
        gc.callbacks.remove(count)
    # the build's own containers: collections all through it before (127 of the youngest, 11 of the middle
    # generation and a full one here, nine full ones for 34k nodes); one of the youngest as each build ends
    assert built.count(0) <= 2 and built.count(1) == 0 and built.count(2) == 0, built
    assert made == [0], made
    assert gc.isenabled()


def test_the_collector_is_left_as_the_caller_set_it() -> None:
    gc.disable()
    try:
        Plan(_chain(2))
        with builder.gc_paused(), builder.gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()
    with builder.gc_paused():
        assert not gc.isenabled()
        Plan(_chain(2))  # a build within a build: still paused when it ends
        assert not gc.isenabled()
    assert gc.isenabled()

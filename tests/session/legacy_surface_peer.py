"""The models and cases of ``test_legacy_ort116_surface.py``, and one run of them on each side: onnxtrain in
this process, onnxruntime-training 1.16.3 (``tests/ortt.py``'s legacy venv) in one script run.

Models are written with IR version 8 at opset 17 (1.16.3's onnx 1.15 reads IR <= 9). Every weight has more
than 8 values: 1.16.3's ConstantSharing pass renames an initializer of 8 values or fewer to
``ortshared_...`` before the trainable weights are chosen (a bias of 3 came back as
``ortshared_1_1_3_0_token_0``, "Failed to find attribute map for weight ortshared_..." or "B couldn't find
the consumer node" when named in ``weights_to_train``), a 1.16.3 fault that onnxtrain does not copy.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.session import legacy_surface_probes as probes

WEIGHTS = ["z_w1", "a_b1", "m_w2", "scale"]  # graph order; sorted order differs
BN_STATS = ["bn_mean", "bn_var"]  # batchnorm.onnx's running statistics
FEEDS = {"x": ["float32", [2, 4]], "t": ["float32", [2, 12]]}


def _mlp(overridable: bool = False) -> onnx.ModelProto:
    """x[batch, 4] -> MatMul z_w1 + a_b1 -> Relu -> MatMul m_w2 -> * scale = y[batch, 12]; loss = mean((y -
    t)^2). With ``overridable``, ``scale`` is also a graph input."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
             for n, s in (("z_w1", (4, 10)), ("a_b1", (10,)), ("m_w2", (10, 12)))]
    inits.append(numpy_helper.from_array(np.full(12, 0.5, np.float32), "scale"))
    nodes = [
        helper.make_node("MatMul", ["x", "z_w1"], ["h0"]),
        helper.make_node("Add", ["h0", "a_b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h"]),
        helper.make_node("MatMul", ["h", "m_w2"], ["y0"]),
        helper.make_node("Mul", ["y0", "scale"], ["y"]),
        helper.make_node("Sub", ["y", "t"], ["d"]),
        helper.make_node("Mul", ["d", "d"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4]),
              helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch", 12])]
    if overridable:
        inputs.append(helper.make_tensor_value_info("scale", TensorProto.FLOAT, [12]))
    g = helper.make_graph(nodes, "mlp2", inputs,
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 12])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    m.producer_name, m.doc_string, m.graph.doc_string, m.model_version = "surface", "doc", "gdoc", 3
    m.metadata_props.add(key="k", value="v")
    onnx.checker.check_model(m, full_check=True)
    return m


def _dropout(ratio: bool = True, training_mode: bool = False) -> onnx.ModelProto:
    """:func:`_mlp` with a Dropout after the Relu: its ratio (0.25) and training_mode (True) inputs
    initializers when asked for (training_mode with ratio), its mask an output (1.16.3's gradient builder
    needs it). 1.16.3 fails on the one with a ratio and no training_mode ("i < node_->OutputDefs().size()"
    in the gradient builder) and then aborts the process at exit, and aborts building one whose ratio is
    an empty input name: neither is in the cases."""
    m = _mlp()
    g = m.graph
    relu = next(i for i, n in enumerate(g.node) if n.op_type == "Relu")
    g.node[relu + 1].input[0] = "hd"
    inputs = ["h", "ratio", "training_mode_init"][:1 + ratio + training_mode]
    g.node.insert(relu + 1, helper.make_node("Dropout", inputs, ["hd", "mask"]))
    g.initializer.append(numpy_helper.from_array(np.array(0.25, np.float32), "ratio"))
    if training_mode:
        g.initializer.append(numpy_helper.from_array(np.array(True), "training_mode_init"))
    if not (ratio or training_mode):
        del g.initializer[-1]
    onnx.checker.check_model(m, full_check=True)
    return m


def _all_initializers_as_inputs(ir: int) -> onnx.ModelProto:
    """:func:`_mlp` at opset 13 with every initializer also a graph input, as exporters wrote them before
    IR version 4 (where such an input is a constant) and some after (where it can be fed)."""
    m = _mlp()
    m.opset_import[0].version = 13  # (at opset 9 1.16.3 builds a two-input Gemm, invalid before 11)
    m.ir_version = ir
    g = m.graph
    for t in g.initializer:
        g.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(m, full_check=True)
    return m


def _batchnorm() -> onnx.ModelProto:
    """:func:`_mlp` with a BatchNormalization (scale, bias, running mean and variance: 10 each) after the
    Relu."""
    m = _mlp()
    g = m.graph
    relu = next(i for i, n in enumerate(g.node) if n.op_type == "Relu")
    g.node[relu + 1].input[0] = "hb"
    g.node.insert(relu + 1, helper.make_node("BatchNormalization", ["h", "bn_s", "bn_b", "bn_mean", "bn_var"],
                                             ["hb"], epsilon=1e-5, momentum=0.9))
    for name, v in (("bn_s", 1.0), ("bn_b", 0.0), ("bn_mean", 0.0), ("bn_var", 1.0)):
        g.initializer.append(numpy_helper.from_array(np.full(10, v, np.float32), name))
    onnx.checker.check_model(m, full_check=True)
    return m


def _small_bias() -> onnx.ModelProto:
    """:func:`_mlp` whose first bias has 3 values (z_w1 4 x 3, m_w2 3 x 12): 1.16.3's ConstantSharing prey."""
    m = _mlp()
    rng = np.random.default_rng(1)
    for t in m.graph.initializer:
        if t.name in ("z_w1", "a_b1", "m_w2"):
            shape = {"z_w1": (4, 3), "a_b1": (3,), "m_w2": (3, 12)}[t.name]
            t.CopyFrom(numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), t.name))
    onnx.checker.check_model(m, full_check=True)
    return m


def _lookup() -> onnx.ModelProto:
    """emb[10, 12] gathered at idx[batch] (int64), reshaped to the fed ``shape`` and divided by the fed
    ``div`` = y; loss = mean((y - t)^2): runs that fail inside a node (an index out of range, a shape the
    values do not fill) or do not (a division by zero)."""
    rng = np.random.default_rng(2)
    emb = numpy_helper.from_array((rng.standard_normal((10, 12)) * 0.3).astype(np.float32), "emb")
    nodes = [
        helper.make_node("Gather", ["emb", "idx"], ["e"], name="lookup"),
        helper.make_node("Reshape", ["e", "shape"], ["r"], name="reshape"),
        helper.make_node("Div", ["r", "div"], ["y"], name="divide"),
        helper.make_node("Sub", ["y", "t"], ["dd"]),
        helper.make_node("Mul", ["dd", "dd"], ["d2"]),
        helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
    ]
    inputs = [helper.make_tensor_value_info("idx", TensorProto.INT64, ["batch"]),
              helper.make_tensor_value_info("shape", TensorProto.INT64, [2]),
              helper.make_tensor_value_info("div", TensorProto.FLOAT, []),
              helper.make_tensor_value_info("t", TensorProto.FLOAT, ["batch", 12])]
    g = helper.make_graph(nodes, "lookup", inputs,
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, ["r0", "r1"])], [emb])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _broken(kind: str) -> onnx.ModelProto:
    """:func:`_mlp` spoilt as ``kind`` says, so that onnx's checker refuses it: ``unknown_op`` (its Relu a
    NoSuchOp), ``arity`` (its first Add given one input), ``types`` (a float64 bias added to a float32
    value), ``undefined`` (the second MatMul reads a value nothing defines)."""
    m = _mlp()
    g = m.graph
    node = {n.op_type + n.input[0]: n for n in g.node}
    if kind == "unknown_op":
        node["Reluh1"].op_type = "NoSuchOp"
    elif kind == "arity":
        del node["Addh0"].input[1]
    elif kind == "types":
        b = next(t for t in g.initializer if t.name == "a_b1")
        b.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(b).astype(np.float64), "a_b1"))
    elif kind == "undefined":
        node["MatMulh"].input[0] = "nowhere"
    return m


BROKEN = ("unknown_op", "arity", "types", "undefined")


def write_models(folder: str) -> None:
    os.makedirs(folder, exist_ok=True)
    onnx.save(_mlp(), os.path.join(folder, "mlp2.onnx"))
    onnx.save(_dropout(ratio=False), os.path.join(folder, "dropout_default_ratio.onnx"))
    onnx.save(_dropout(training_mode=True), os.path.join(folder, "dropout_training_mode.onnx"))
    onnx.save(_small_bias(), os.path.join(folder, "small_bias.onnx"))
    onnx.save(_batchnorm(), os.path.join(folder, "batchnorm.onnx"))
    for ir in (3, 4):
        onnx.save(_all_initializers_as_inputs(ir), os.path.join(folder, f"inputs_ir{ir}.onnx"))
    onnx.save(_mlp(overridable=True), os.path.join(folder, "mlp2_overridable.onnx"))
    onnx.save(_lookup(), os.path.join(folder, "lookup.onnx"))
    for kind in BROKEN:
        onnx.save(_broken(kind), os.path.join(folder, f"broken_{kind}.onnx"))
    with open(os.path.join(folder, "garbage.onnx"), "wb") as f:
        f.write(b"this is no model")
    with open(os.path.join(folder, "empty.onnx"), "wb"):
        pass


def _params(opt: str = "", maps: bool = True, **kw: Any) -> dict[str, Any]:
    p: dict[str, Any] = {"loss_output_name": "loss"}
    if opt:
        p["training_optimizer_name"] = opt
    if maps:  # 1.16.3 wants an entry for every trained weight in both maps
        p["optimizer_attributes_map"] = {w: {} for w in WEIGHTS}
        p["optimizer_int_attributes_map"] = {w: {} for w in WEIGHTS}
    p.update(kw)
    return p


# run() variants: fetches, feeds left out / extra / of another dtype or shape, RunOptions, IO binding
RUNS: list[dict[str, Any]] = [
    {"outputs": None}, {"outputs": ["loss"]}, {"outputs": ["y"]}, {"outputs": []},
    {"outputs": ["y", "loss"]}, {"outputs": ["loss"], "lr_shape": []},
    {"outputs": ["loss"], "lr_shape": [1, 1]},
    {"outputs": ["loss"], "drop": ["t"]}, {"outputs": ["loss"], "drop": ["Learning_Rate"]},
    {"outputs": ["loss"], "extra": {"zzz": ["float32", [1]]}},
    {"outputs": ["loss"], "as": {"x": ["float64", [2, 4]]}},
    {"outputs": ["loss"], "as": {"x": ["float32", [2, 5]]}},
    {"outputs": ["loss"], "as": {"x": ["float32", [2, 4, 1]]}},
    {"outputs": ["loss"], "as": {"x": ["float32", [3, 4]]}},  # x and t fed other sizes of dim "batch"
    {"outputs": ["loss"], "as": {"Learning_Rate": ["float64", [1]]}},
    {"outputs": ["loss"], "as": {"Learning_Rate": ["float32", [2]]}},
    {"outputs": ["nope"]}, {"outputs": ["loss", "loss"]}, {"outputs": ["z_w1_grad"]}, {"outputs": ["x"]},
    {"outputs": ["h"]}, {"outputs": ["loss"], "extra": {"z_w1": ["float32", [4, 10]]}},
    {"outputs": ["loss"], "run_options": {"only_execute_path_to_fetches": True}},
    {"outputs": ["y"], "run_options": {"only_execute_path_to_fetches": True}},
    {"outputs": ["loss", "y"], "run_options": {"training_mode": False}},
    {"outputs": ["loss", "y"], "run_options": {"training_mode": True, "logid": "r"}},
    {"outputs": ["loss", "global_gradient_norm"], "iobinding": True},
    {"outputs": ["y"], "iobinding": True, "run_options": {"only_execute_path_to_fetches": True}},
]
# runs of a model with Dropout: training, forward only, training_mode fed, eval through IO binding
DROPOUT_RUNS: list[dict[str, Any]] = [
    {"outputs": None}, {"outputs": ["y"], "run_options": {"only_execute_path_to_fetches": True}},
    {"outputs": ["y"], "extra": {"training_mode": ["bool", []]}},
    {"outputs": ["loss", "y"], "iobinding": True, "run_options": {"training_mode": False}},
    {"outputs": ["y"], "iobinding": True,
     "run_options": {"training_mode": False, "only_execute_path_to_fetches": True}},
]
# runs that fail, as a user's mistakes make them (README's legacy section: the exception table)
FAILING_RUNS: list[dict[str, Any]] = [
    {"outputs": ["loss"], "raw": {"x": "list"}}, {"outputs": ["loss"], "raw": {"x": "none"}},
    {"outputs": ["loss"], "raw": {"x": "string"}}, {"outputs": ["loss"], "raw": {"Learning_Rate": "list"}},
    {"outputs": ["loss"], "run_options_as": "dict"}, {"outputs": ["loss"], "run_options_as": "string"},
    {"outputs": ["loss"], "run_options": {"terminate": True}},
    {"outputs": ["loss"], "run_options": {"log_severity_level": 9}},
    {"outputs": ["loss"], "run_options": {"only_execute_path_to_fetches": "yes"}},
]
LOOKUP_FEEDS = {"t": ["float32", [2, 12]]}
LOOKUP_VALUES = {"idx": [[1, 3], "int64"], "shape": [[2, 12], "int64"], "div": [2.0, "float32"]}
LOOKUP_RUNS: list[dict[str, Any]] = [
    {"outputs": ["loss", "y"]}, {"outputs": ["y"], "values": {"idx": [[-1, -10], "int64"]}},
    {"outputs": ["loss"], "values": {"idx": [[1, 10], "int64"]}},
    {"outputs": ["loss"], "values": {"idx": [[-11, 0], "int64"]}},
    {"outputs": ["y"], "values": {"idx": [[1, 10], "int64"]},
     "run_options": {"only_execute_path_to_fetches": True}},
    {"outputs": ["loss"], "values": {"shape": [[5, 7], "int64"]}},
    {"outputs": ["loss"], "values": {"shape": [[-1, 12], "int64"]}},
    {"outputs": ["loss"], "values": {"shape": [[-1, -1], "int64"]}},
    {"outputs": ["loss"], "values": {"shape": [[2, 12, 1], "int64"]}},
    {"outputs": ["loss"], "values": {"div": [0.0, "float32"]}},
]
LOADS = [[k, s] for k in probes.LOADS for s in (False, True)]
DUMPED = {"dumps": True}


def cases() -> list[dict[str, Any]]:
    """Every session case, named; each compared on both sides."""
    c: list[dict[str, Any]] = []

    def add(name: str, params: dict[str, Any], **kw: Any) -> None:
        c.append({"name": name, "model": kw.pop("model", "mlp2.onnx"), "params": params, "feeds": FEEDS,
                  "load_weight": "z_w1", **kw})

    strict_as = [["unknown_key", "yes"], ["unknown_key", None], ["unknown_key", 2]]  # load_state's strict
    add("sgd", _params("SGDOptimizer"), runs=RUNS + FAILING_RUNS, loads=LOADS + strict_as,
        save_as_onnx="/nonexistent/dir/saved.onnx", **DUMPED)
    add("adam", _params("AdamOptimizer"), runs=RUNS[:5] + RUNS[-2:], loads=LOADS, **DUMPED)
    add("adam_noclip", _params("AdamOptimizer", enable_grad_norm_clip=False),
        runs=[{"outputs": None}, {"outputs": ["global_gradient_norm"]}])
    add("adam_fp16_moments", _params("AdamOptimizer", use_fp16_moments=True), loads=LOADS[:4] + LOADS[-4:])
    add("adam_bytes", _params("AdamOptimizer"), as_bytes=True, sess_options={"log_severity_level": 3},
        runs=[{"outputs": ["loss"]}])
    add("sgd_gradients_out", _params("SGDOptimizer", set_gradients_as_graph_outputs=True),
        runs=[{"outputs": None}, {"outputs": ["m_w2_grad", "loss"]},
              {"outputs": ["z_w1_grad"], "run_options": {"only_execute_path_to_fetches": True}}], **DUMPED)
    add("adam_gradients_out_noclip", _params("AdamOptimizer", set_gradients_as_graph_outputs=True,
                                             enable_grad_norm_clip=False), runs=[{"outputs": None}])
    add("no_optimizer", _params(maps=False), runs=[{"outputs": None}, {"outputs": ["loss"]}], **DUMPED)
    add("no_optimizer_gradients_out", _params(maps=False, set_gradients_as_graph_outputs=True),
        runs=[{"outputs": None}], **DUMPED)
    add("lr_name", _params("SGDOptimizer", lr_params_feed_name="lr"),
        runs=[{"outputs": ["loss"]},
              {"outputs": ["loss"], "drop": ["lr"], "extra": {"Learning_Rate": ["float32", [1]]}}])
    add("lr_name_empty", _params("SGDOptimizer", lr_params_feed_name=""))
    add("providers_none", _params("SGDOptimizer"), providers=None)
    add("weights_to_train", _params("AdamOptimizer", weights_to_train=["z_w1", "m_w2"]),
        runs=[{"outputs": None}], loads=[["plus_one", True], ["missing_key", True]])
    add("weights_not_to_train", _params("SGDOptimizer", weights_not_to_train=["z_w1"]),
        runs=[{"outputs": None}], loads=[["unknown_key", True]], load_weight="m_w2")
    add("overridable", _params("SGDOptimizer", weights_not_to_train=["scale"]), model="mlp2_overridable.onnx",
        runs=[{"outputs": ["y"]}, {"outputs": ["y"], "extra": {"scale": ["float32", [12]]}}])
    add("initial_state", _params("AdamOptimizer"),
        initial_state={"z_w1": {"Moment_1": [np.ones((4, 10)).tolist(), "float32"],
                                "Update_Count": [[3], "int64"]}})
    # (1.16.3 aborts the process (SIGABRT) when a run feeds training_mode, or IO binding's RunOptions has
    # training_mode False, and no Dropout has a training_mode input: those runs are left out of this one)
    add("dropout_default_ratio", _params("SGDOptimizer"), model="dropout_default_ratio.onnx",
        runs=DROPOUT_RUNS[:2], **DUMPED)
    add("dropout_training_mode", _params("SGDOptimizer"), model="dropout_training_mode.onnx",
        runs=DROPOUT_RUNS, **DUMPED)
    for ir in (3, 4):
        add(f"initializers_as_inputs_ir{ir}", _params("SGDOptimizer"), model=f"inputs_ir{ir}.onnx",
            runs=[{"outputs": ["loss"]}, {"outputs": ["loss"], "extra": {"scale": ["float32", [12]]}}])
        add(f"initializers_as_inputs_ir{ir}_frozen", _params("SGDOptimizer", weights_not_to_train=["scale"]),
            model=f"inputs_ir{ir}.onnx",
            runs=[{"outputs": ["y"]}, {"outputs": ["y"], "extra": {"scale": ["float32", [12]]}}])
    add("initializers_as_inputs_ir4_adam", _params("AdamOptimizer"), model="inputs_ir4.onnx",
        runs=[{"outputs": ["loss"], "extra": {"scale": ["float32", [12]]}}, {"outputs": ["loss"]}])
    bn_maps = {w: {} for w in [*WEIGHTS, "bn_s", "bn_b"]}
    add("batchnorm", _params("AdamOptimizer", optimizer_attributes_map=bn_maps,
                             optimizer_int_attributes_map=bn_maps), model="batchnorm.onnx",
        runs=[{"outputs": None}, {"outputs": ["y"], "run_options": {"only_execute_path_to_fetches": True}}],
        loads=[["plus_one", True]], **DUMPED)
    add("parameters_none", _params("SGDOptimizer"), parameters_as="none")
    add("parameters_dict", _params("SGDOptimizer"), parameters_as="dict")
    add("sess_options_a_list", _params("SGDOptimizer"), sess_options="providers")
    add("providers_unknown", _params("SGDOptimizer"), providers=["FooExecutionProvider"])
    add("small_bias_weights_found", _params("SGDOptimizer"), model="small_bias.onnx")
    add("small_bias_weights_named", _params("SGDOptimizer", weights_to_train=WEIGHTS),
        model="small_bias.onnx")
    # refused on 1.16.3's CPU build (no kernel): its dumps are compared with onnxtrain's graphs
    add("lamb", _params("LambOptimizer"), **DUMPED)
    add("sgd_accumulation", _params("SGDOptimizer", gradient_accumulation_steps=3), **DUMPED)
    add("adam_accumulation", _params("AdamOptimizer", gradient_accumulation_steps=3), **DUMPED)
    add("adam_mixed_precision", _params("AdamOptimizer", use_mixed_precision=True), **DUMPED)
    add("sgd_mixed_precision", _params("SGDOptimizer", use_mixed_precision=True), **DUMPED)
    # bad parameters and paths
    add("unknown_optimizer", _params("FooOptimizer"), **DUMPED)
    add("missing_loss", _params("SGDOptimizer", loss_output_name="nope"))
    add("empty_loss", _params("SGDOptimizer", loss_output_name=""))
    add("loss_is_an_input", _params("SGDOptimizer", loss_output_name="t"))
    add("maps_left_empty", _params("SGDOptimizer", maps=False))
    add("map_missing_a_weight", _params("SGDOptimizer", optimizer_attributes_map={"z_w1": {}},
                                        optimizer_int_attributes_map={w: {} for w in WEIGHTS}))
    add("int_map_missing_a_weight", _params("SGDOptimizer", optimizer_int_attributes_map={"z_w1": {}}))
    # an attribute in the map of the other type: refused where the optimizer reads it, else ignored
    for opt, fmap, imap in (("AdamOptimizer", {"do_bias_correction": 1.0}, {}),
                            ("AdamOptimizer", {}, {"alpha": 1}),
                            ("SGDOptimizer", {"do_bias_correction": 1.0}, {"alpha": 1})):
        add(f"{opt[:-9].lower()}_attribute_in_the_other_map{'_int' if imap else ''}",
            _params(opt, optimizer_attributes_map={w: dict(fmap) for w in WEIGHTS},
                    optimizer_int_attributes_map={w: dict(imap) for w in WEIGHTS}))
    add("train_unknown_name", _params("SGDOptimizer", weights_to_train=["z_w1", "no_such"]))
    add("train_an_input", _params("SGDOptimizer", weights_to_train=["z_w1", "x"]))
    add("train_an_activation", _params("SGDOptimizer", weights_to_train=["z_w1", "h"]))
    add("accumulation_without_optimizer", _params(maps=False, gradient_accumulation_steps=3))
    add("lookup", {**_params("SGDOptimizer", maps=False), "optimizer_attributes_map": {"emb": {}},
                   "optimizer_int_attributes_map": {"emb": {}}}, model="lookup.onnx", feeds=LOOKUP_FEEDS,
        values=LOOKUP_VALUES, runs=LOOKUP_RUNS, load_weight="emb")
    for kind in BROKEN:
        add(f"broken_{kind}", _params("SGDOptimizer"), model=f"broken_{kind}.onnx")
    add("dump_to_a_missing_folder", _params("SGDOptimizer",
                                            model_with_training_graph_path="/nonexistent/dir/t.onnx"))
    add("optimized_model_to_a_missing_folder", _params("SGDOptimizer"),
        sess_options={"optimized_model_filepath": "/nonexistent/dir/o.onnx"})
    add("no_such_file", _params("SGDOptimizer"), model="/nonexistent/dir/model.onnx")
    add("not_a_model", _params("SGDOptimizer"), model="garbage.onnx")
    add("bytes_not_a_model", _params("SGDOptimizer"), model="garbage.onnx", as_bytes=True)
    add("empty_file", _params("SGDOptimizer"), model="empty.onnx")
    add("empty_bytes", _params("SGDOptimizer"), model="empty.onnx", as_bytes=True)
    add("pathlike", _params("SGDOptimizer"), as_pathlike=True)
    return c


def spec(folder: str) -> dict[str, Any]:
    return {"models": os.path.join(folder, "models"), "out": os.path.join(folder, "out"), "parameters": True,
            "cases": cases()}


def run_peer(folder: str) -> dict[str, Any]:
    """The cases on onnxruntime-training 1.16.3: one script run (about 3 s)."""
    from tests.ortt import ensure_ort_legacy, run_script

    python = ensure_ort_legacy()
    s = spec(folder)
    s["out"] += "_peer"
    path = os.path.join(folder, "cases_peer.json")
    with open(path, "w") as f:
        json.dump(s, f)
    with open(probes.__file__) as f:
        return run_script(f.read(), path, python=python)


def run_ours(folder: str) -> dict[str, Any]:
    """The same cases on onnxtrain, as JSON (so both sides compare as the same types)."""
    import warnings

    import onnxtrain

    s = spec(folder)
    s["out"] += "_ours"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return json.loads(json.dumps(probes.run_cases(onnxtrain, copy.deepcopy(s)), default=str))

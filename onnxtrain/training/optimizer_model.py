"""The optimizer model of the on-device artifacts: one update of every trainable parameter by an optimizer
block, its inputs and outputs named as the interface note says (``<p>``, ``<p>_grad``, ``<p>.<state>``,
``<p>.out``), renamed where a name is taken and the renaming recorded for the ``Optimizer`` to bind by."""

from __future__ import annotations

import json
from collections.abc import Sequence

import onnx
from onnx import TensorProto, helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.training import onnxblock
from onnxtrain.training.artifact_meta import (
    LOSS_SCALE,
    LOSS_SCALING_KEY,
    OPTIMIZER_IO_KEY,
    add_metadata,
    finish_model,
)
from onnxtrain.training.onnxblock.optim import ALL_FINITE
from onnxtrain.training.onnxblock.optim import Optimizer as OptimizerBlock


def _optimizer_input_names(names: list[str], state_names: Sequence[str],
                           reserved: Sequence[str]) -> dict[tuple[str, str], str]:
    """(parameter, role) -> the optimizer graph's input name, role ``param``, ``gradient`` or a state key.

    Each input is named as the interface note says (``<p>``, ``<p>_grad``, ``<p>.<state>``) unless that
    name is reserved or went to an earlier input (parameters come first, then gradients, then states);
    such an input gets a fresh name, ``<name>_<i>``."""
    wanted = ([((p, "param"), p) for p in names] + [((p, "gradient"), f"{p}_grad") for p in names]
              + [((p, k), f"{p}.{k}") for k in state_names for p in names])
    fresh = NameGen([*reserved, *(n for _, n in wanted)])
    used = set(reserved)
    out: dict[tuple[str, str], str] = {}
    for key, n in wanted:
        out[key] = fresh(n) if n in used else n
        used.add(out[key])
    return out


def _default_input_name(key: tuple[str, str]) -> str:
    p, role = key
    return {"param": p, "gradient": f"{p}_grad"}.get(role, f"{p}.{role}")


def build_optimizer_model(
    block: OptimizerBlock, params: list[tuple[str, onnx.TypeProto]], opset: int,
    mixed_precision: str | None = None,
) -> onnx.ModelProto:
    """The optimizer graph over the trainable ``params`` (name, type) — see the interface note.

    ``mixed_precision`` ("float16"/"bfloat16"): loss-scaled gradients (``loss_scale`` input, guarded
    update, ``all_gradients_finite`` output)."""
    names = [p for p, _ in params]
    fixed = ["learning_rate", "step"] + ([LOSS_SCALE] if mixed_precision is not None else [])
    reserved = fixed + ([ALL_FINITE] if mixed_precision is not None else [])
    io = _optimizer_input_names(names, block.state_names, reserved)
    inputs = [io[p, "param"] for p in names]
    grads = [io[p, "gradient"] for p in names]
    states = {k: [io[p, k] for p in names] for k in block.state_names}
    ptypes = dict(params)
    vtypes = {n: ptypes[p] for (p, _), n in io.items()}
    with onnxblock.empty_base(opset) as acc:
        acc.add_input("learning_rate", helper.make_tensor_type_proto(TensorProto.FLOAT, [1]))
        acc.add_input("step", helper.make_tensor_type_proto(TensorProto.INT64, [1]))
        if mixed_precision is not None:
            acc.add_input(LOSS_SCALE, helper.make_tensor_type_proto(TensorProto.FLOAT, [1]))
        for group in (inputs, grads, *states.values()):
            for n in group:
                acc.add_input(n, vtypes[n])
        if mixed_precision is None:
            new = block("learning_rate", "step", inputs, grads, states)
        else:
            new = block("learning_rate", "step", inputs, grads, states, loss_scale=LOSS_SCALE)
        model = acc.model
    g = model.graph
    flag = new.pop(ALL_FINITE, None)
    order = [x for x in inputs + [s for k in block.state_names for s in states[k]] + grads if x in new]
    outs = _output_names(model, order, reserved)
    rename = {new[x]: outs[x] for x in order}
    if flag is not None:
        rename[flag] = ALL_FINITE
    graph_inputs = {v.name for v in g.input}
    for x in order:
        if new[x] in graph_inputs:  # returned unchanged
            g.node.append(helper.make_node("Identity", [new[x]], [outs[x]], name=f"{outs[x]}_Identity"))
    for n in g.node:
        for j, v in enumerate(n.output):
            if v in rename:
                n.output[j] = rename[v]
        for j, v in enumerate(n.input):
            if v in rename and v not in graph_inputs:
                n.input[j] = rename[v]
    g.output.extend(helper.make_value_info(outs[x], vtypes[x]) for x in order)
    if flag is not None:
        g.output.append(helper.make_tensor_value_info(ALL_FINITE, TensorProto.BOOL, []))
    label = block.name or type(block).__name__
    g.name = f"{label}_optimizer"
    helper.set_model_props(
        model,
        {"onnxtrain.optimizer": label, "onnxtrain.hyperparameters": json.dumps(block.hyperparameters())},
    )
    if mixed_precision is not None:
        add_metadata(model, LOSS_SCALING_KEY, {"dtype": mixed_precision, "loss_scale": LOSS_SCALE,
                                                "all_gradients_finite": ALL_FINITE})
    _record_renamed_io(model, io, outs)
    return finish_model(model, "optimizer")


def _output_names(model: onnx.ModelProto, order: list[str], reserved: Sequence[str]) -> dict[str, str]:
    """Input name -> the name of its new value: ``<input>.out``, or a fresh name when the graph has that
    one already (a parameter ``W.out`` beside ``W``)."""
    fresh = NameGen.for_model(model)
    fresh.taken.update(reserved)
    return {x: fresh(f"{x}.out") for x in order}


def _record_renamed_io(model: onnx.ModelProto, io: dict[tuple[str, str], str], outs: dict[str, str]) -> None:
    """When some input or output is not named as the interface note says: metadata_props
    ``onnxtrain.optimizer_io`` = JSON ``{"inputs": {name: [parameter, role]}, "outputs": {name: input}}``,
    which the Optimizer binds by instead of the names."""
    renamed = any(n != _default_input_name(key) for key, n in io.items())
    if renamed or any(o != f"{x}.out" for x, o in outs.items()):
        add_metadata(model, OPTIMIZER_IO_KEY, {"inputs": {n: list(key) for key, n in io.items()},
                                                "outputs": {o: x for x, o in outs.items()}})

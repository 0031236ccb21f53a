"""``gradcheck``: check the gradient graph of a model against finite differences in float64.

Usable on your own models::

    from onnxtrain.testing import gradcheck
    gradcheck(model64, loss="loss", wrt=["fc.weight"], feeds={"x": x})

The model should compute in float64 (``to_float64`` converts a float32 model).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.user_warning import warn

Runner = Callable[[onnx.ModelProto, Mapping[str, np.ndarray]], list[np.ndarray]]


def run_engine(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """Run ``model`` on onnxtrain's engine (outputs in graph order)."""
    from onnxtrain.engine import compile_model

    return compile_model(model).run(dict(feeds))


def to_float64(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose float32 initializers, inputs, outputs, constants and casts are float64, in
    its graph and in the bodies of its control-flow nodes."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    _graph_to_float64(m.graph)
    return m


# ops whose "to"/"dtype" attribute names the element type of their output
_TYPED_OUTPUT_OPS = ("Cast", "EyeLike", "RandomNormal", "RandomNormalLike", "RandomUniform",
                     "RandomUniformLike", "Bernoulli", "SequenceEmpty")


# ops whose output is float32 when their "dtype" is left out
_FLOAT_BY_DEFAULT = ("RandomNormal", "RandomUniform", "SequenceEmpty")


def _type_to_float64(tp: onnx.TypeProto) -> None:
    """A float32 tensor type, or a sequence or optional of one, made float64 in place."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type" and tp.tensor_type.elem_type == TensorProto.FLOAT:
        tp.tensor_type.elem_type = TensorProto.DOUBLE
    elif kind == "sequence_type":
        _type_to_float64(tp.sequence_type.elem_type)
    elif kind == "optional_type":
        _type_to_float64(tp.optional_type.elem_type)


def _graph_to_float64(g: onnx.GraphProto) -> None:
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name))
    for v in (*g.input, *g.output, *g.value_info):
        _type_to_float64(v.type)
    for n in g.node:
        if n.op_type in _FLOAT_BY_DEFAULT and not any(a.name == "dtype" for a in n.attribute):
            n.attribute.append(onnx.helper.make_attribute("dtype", TensorProto.DOUBLE))
        if n.op_type == "ConstantOfShape" and not any(a.name == "value" for a in n.attribute):  # float32 0
            n.attribute.append(onnx.helper.make_attribute("value", numpy_helper.from_array(np.zeros(1))))
        for a in n.attribute:
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
            elif a.type == onnx.AttributeProto.GRAPH:
                _graph_to_float64(a.g)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for body in a.graphs:
                    _graph_to_float64(body)
            elif n.op_type == "Constant" and a.name in ("value_float", "value_floats"):
                value = np.asarray(a.f if a.name == "value_float" else list(a.floats), np.float64)
                a.CopyFrom(onnx.helper.make_attribute("value", numpy_helper.from_array(value)))
            if n.op_type in _TYPED_OUTPUT_OPS and a.name in ("to", "dtype") and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
    _cast_back_float_only_inputs(g)


# op → its input that only float32 may feed (Resize's and Upsample's scales)
_FLOAT_ONLY_INPUTS = {"Resize": 2, "Upsample": 1}


def _cast_back_float_only_inputs(g: onnx.GraphProto) -> None:
    """Feed the float-only inputs of ``g``'s nodes through a Cast to float32 (in place): the values that
    fed them are float64 now, which their schemas do not allow."""
    nodes = []
    for n in g.node:
        k = _FLOAT_ONLY_INPUTS.get(n.op_type, -1) if n.domain in DEFAULT_DOMAINS else -1
        if 0 <= k < len(n.input) and n.input[k]:
            cast = f"{n.input[k]}_float32_for_{n.name or n.output[0]}"
            nodes.append(onnx.helper.make_node("Cast", [n.input[k]], [cast], to=TensorProto.FLOAT))
            n.input[k] = cast
        nodes.append(n)
    if len(nodes) > len(g.node):
        del g.node[:]
        g.node.extend(nodes)


def gradcheck(
    model: onnx.ModelProto,
    loss: str,
    wrt: Sequence[str],
    feeds: Mapping[str, np.ndarray],
    eps: float = 1e-6,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    directions: int = 3,
    full_jacobian_max: int = 64,
    seed: int = 0,
    runner: Runner = run_engine,
) -> dict[str, np.ndarray]:
    """Compare the gradients of ``loss`` w.r.t. ``wrt`` with central differences; returns the gradients.

    Checks ⟨∇L, v⟩ against (L(x+εv) − L(x−εv)) / 2ε along ``directions`` random directions, and
    every gradient element when ``wrt`` holds at most ``full_jacobian_max`` elements in all.
    Raises AssertionError naming the value and the error found.
    """
    from onnxtrain.autodiff import build_gradient_model

    hint = _not_float64(model, [loss, *wrt])
    if hint:
        warn(f"gradcheck: {hint}; finite differences at eps={eps} will likely fail")
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    values = {n: np.array(feeds[n] if n in feeds else inits[n], dtype=np.float64) for n in wrt}
    gmodel = build_gradient_model(model, loss, list(wrt), outputs=[loss])
    out_names = [o.name for o in gmodel.graph.output]
    got = dict(zip(out_names, runner(gmodel, {**feeds, **values})))
    grads = {n: np.asarray(got[f"{n}_grad"], dtype=np.float64) for n in wrt}
    for n in wrt:
        if grads[n].shape != values[n].shape:
            raise AssertionError(f"gradient of {n!r} has shape {grads[n].shape}, expected {values[n].shape}")
    lmodel = _loss_only(model, loss)
    run = runner
    if runner is run_engine and not _draws(lmodel):  # compiled once for the many runs below (a plan
        from onnxtrain.engine import compile_model  # with random ops draws anew at each of its runs)

        plan = compile_model(lmodel)

        def run(_: onnx.ModelProto, fed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
            return plan.run(dict(fed))

    def f(vals: Mapping[str, np.ndarray]) -> float:
        return float(np.sum(run(lmodel, {**feeds, **vals})[0]))

    rng = np.random.default_rng(seed)
    for k in range(directions):
        v = {n: rng.standard_normal(values[n].shape) for n in wrt}
        fd = (f({n: values[n] + eps * v[n] for n in wrt}) - f({n: values[n] - eps * v[n] for n in wrt})) / (
            2 * eps
        )
        ad = sum(float(np.sum(grads[n] * v[n])) for n in wrt)
        if not np.isclose(ad, fd, rtol=rtol, atol=atol):
            raise AssertionError(
                f"direction {k} (seed {seed}): autodiff ⟨∇L, v⟩ = {ad!r}, finite differences = {fd!r}"
                + (f" ({hint})" if hint else "")
            )
    if sum(v.size for v in values.values()) <= full_jacobian_max:
        for n in wrt:
            for idx in np.ndindex(values[n].shape):
                plus, minus = values[n].copy(), values[n].copy()
                plus[idx] += eps
                minus[idx] -= eps
                fd = (f({**values, n: plus}) - f({**values, n: minus})) / (2 * eps)
                if not np.isclose(grads[n][idx], fd, rtol=rtol, atol=atol):
                    raise AssertionError(
                        f"d{loss}/d{n}{list(idx)}: autodiff {grads[n][idx]!r}, finite differences {fd!r}"
                    )
    return grads


def _not_float64(model: onnx.ModelProto, names: Sequence[str]) -> str:
    """"" when the model computes the loss and the values differentiated in float64, else which it does
    not, with the fix."""
    from onnxtrain.ir.builder import elem_type, value_types

    types = value_types(model)
    narrow = []
    for n in names:
        et = elem_type(types, n)
        if et not in (TensorProto.DOUBLE, TensorProto.UNDEFINED):
            narrow.append(f"{n!r} is {TensorProto.DataType.Name(et).lower()}")
    if not narrow:
        return ""
    return (f"{', '.join(narrow)}, not float64 (convert the model with onnxtrain.testing.to_float64 and feed "
            "float64 arrays)")


def _draws(model: onnx.ModelProto) -> bool:
    """Whether ``model`` (its control-flow bodies too) holds a random op."""
    from onnxtrain.ir.graphs import RANDOM_OPS, walk_graphs

    return any(n.op_type in RANDOM_OPS for g in walk_graphs(model.graph) for n in g.node)


def _loss_only(model: onnx.ModelProto, loss: str) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    vi = next((o for o in m.graph.output if o.name == loss), None)
    del m.graph.output[:]
    m.graph.output.append(vi if vi is not None else onnx.helper.make_empty_tensor_value_info(loss))
    return m


def random_loss_model(
    node_model: onnx.ModelProto,
    output_shapes: Sequence[tuple[int, ...]],
    outputs: Sequence[int],
    seed: int = 0,
    dtype: Any = np.float64,
) -> onnx.ModelProto:
    """``node_model`` with ``loss = Σ_k ReduceSum(y_k · u_k)`` appended, u_k fixed random weights."""
    from onnx import helper

    m = onnx.ModelProto()
    m.CopyFrom(node_model)
    g = m.graph
    rng = np.random.default_rng(seed + 1000)
    terms = []
    for k in outputs:
        y = g.output[k].name
        u = numpy_helper.from_array(rng.uniform(0.5, 1.5, output_shapes[k]).astype(dtype), f"u{k}")
        g.initializer.append(u)
        g.node.append(helper.make_node("Mul", [y, u.name], [f"yu{k}"]))
        g.node.append(helper.make_node("ReduceSum", [f"yu{k}"], [f"l{k}"], keepdims=0))
        terms.append(f"l{k}")
    g.node.append(
        helper.make_node("Sum", terms, ["loss"])
        if len(terms) > 1
        else helper.make_node("Identity", terms, ["loss"])
    )
    g.output.append(
        helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [])
    )
    return m

"""An exported model's fixed batch axis made symbolic where the model allows it: a torch export without
``dynamic_axes`` declares one batch size, which onnxruntime then holds every caller to."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx

from onnxtrain.ir.stream import elem_type
from onnxtrain.ir.types import np_dtype

BATCH_SYMBOL = "batch"  # the name of the exported model's batch axis where it was a fixed size (batch_1, ...
# when the model names another axis so)


def _first_dims(values: Any) -> list[tuple[str, int | None]]:
    """(name, fixed size of axis 0 or None) of the tensor values that declare at least one axis."""
    found = []
    for v in values:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape") \
                and len(v.type.tensor_type.shape.dim):
            d = v.type.tensor_type.shape.dim[0]
            found.append((v.name, d.dim_value if d.HasField("dim_value") else None))
    return found


def any_batch_export(m: onnx.ModelProto, arrays: Sequence[tuple[str, np.ndarray]] = ()
                     ) -> tuple[onnx.ModelProto, str | None]:
    """``m`` (an inference model whose weights are initializers or ``arrays``) with its fixed batch axis
    made symbolic, and None; or ``m`` itself and the reason it keeps its batch size (the data inputs'
    first axes differ, the model fails or gives other batch sizes at 1 and 2 rows, an Expand to a
    constant shape holding the batch size, say, or its rows mix: a mean over the batch). A Reshape to a
    constant shape that starts with the batch size (a static torch export's flatten) is tried with 0 there
    (the input's first axis, as ONNX's Reshape reads 0) first, and its reason given when both fail. A freed
    model must give the fixed model's outputs at the fixed batch size. A model without fixed first axes is
    returned as is."""
    held = {t.name for t in m.graph.initializer} | {n for n, _ in arrays}
    data = _first_dims(v for v in m.graph.input if v.name not in held)
    sizes = {n for _, n in data if n is not None}
    if not sizes:
        return m, None
    if len(sizes) > 1 or any(n is None for _, n in data):
        return m, ("its inputs' first axes are not one batch axis "
                   f"({', '.join(f'{k}: {n if n is not None else chr(63)}' for k, n in data)})")
    (fixed,) = sizes
    outs = _first_dims(m.graph.output)
    if any(n is not None and n != fixed for _, n in outs):
        return m, f"an output's first axis is not its batch axis of {fixed} ({dict(outs)})"
    free = onnx.ModelProto()
    free.CopyFrom(m)
    g = free.graph
    declared = [v for v in [*g.input, *g.output] if v.type.HasField("tensor_type")]
    taken = {d.dim_param for v in declared for d in v.type.tensor_type.shape.dim}
    names = (BATCH_SYMBOL + (f"_{k}" if k else "") for k in range(len(taken) + 1))
    symbol = next(s for s in names if s not in taken)
    for v in [*(v for v in g.input if v.name not in held), *g.output]:
        dims = v.type.tensor_type.shape.dim if v.type.HasField("tensor_type") else ()
        if len(dims) and dims[0].HasField("dim_value"):
            dims[0].dim_param = symbol
    del g.value_info[:]  # (shapes inferred for the fixed batch)
    tries = [free]
    reshaped = onnx.ModelProto()
    reshaped.CopyFrom(free)
    if _reshapes_keep_rows(reshaped.graph, fixed):
        tries.insert(0, reshaped)
    reasons = []
    for t in tries:
        why = _runs_at_any_batch(t, m, arrays, fixed)
        if why is None:
            return t, None
        reasons.append(why)
    return m, reasons[0]


def _reshapes_keep_rows(g: onnx.GraphProto, fixed: int) -> int:
    """Give each Reshape of ``g`` whose shape is a constant starting with ``fixed`` (and holding no 0) a
    copy of that shape starting with 0 (its input's first axis) and ``allowzero`` 0, in place; how many it
    changed."""
    from onnx import numpy_helper

    consts = {t.name: t for t in g.initializer}
    consts.update({n.output[0]: a.t for n in g.node if n.op_type == "Constant" and n.output
                   for a in n.attribute if a.name == "value"})
    used = {t.name for t in g.initializer} | {o for n in g.node for o in n.output}
    changed = 0
    for n in g.node:
        if n.op_type != "Reshape" or len(n.input) < 2 or n.input[1] not in consts:
            continue
        shape = numpy_helper.to_array(consts[n.input[1]])
        if shape.ndim != 1 or not len(shape) or shape[0] != fixed or (shape == 0).any():
            continue
        name = next(c for k in range(len(used) + 1) if (c := f"{n.input[1]}_rows{k}") not in used)
        used.add(name)
        rows = np.concatenate([[0], shape[1:]]).astype(shape.dtype)
        g.initializer.append(numpy_helper.from_array(rows, name))
        n.input[1] = name
        for a in n.attribute:  # (allowzero = 1, as torch's dynamo exporter writes it, read 0 as a size: the
            if a.name == "allowzero":  # shape held none, so 0 can mean "the input's" without changing it)
                a.i = 0
        changed += 1
    return changed


def _runs_at_any_batch(free: onnx.ModelProto, fixed_model: onnx.ModelProto,
                       arrays: Sequence[tuple[str, np.ndarray]], fixed: int) -> str | None:
    """None when ``free`` runs on the numpy engine at 1, 2 and ``fixed`` rows, each output's first axis
    that many rows, each row of the 2-row run alike when run alone (the rows do not mix), at ``fixed``
    rows the outputs of ``fixed_model``, and at twice ``fixed`` rows its outputs on each half (rows that mix
    further apart); else what went wrong."""
    from onnxtrain.engine.backends import make_plan

    def plan_of(model: onnx.ModelProto) -> tuple[Any, onnx.GraphProto]:
        trial = onnx.ModelProto()
        trial.CopyFrom(model)
        for name, a in arrays:  # (fed, not copied into the proto)
            trial.graph.input.append(onnx.helper.make_tensor_value_info(name, elem_type(a), a.shape))
        return make_plan(trial), trial.graph

    held = {t.name for t in free.graph.initializer} | {n for n, _ in arrays}
    rng = np.random.default_rng(0)
    results: list[tuple[list, dict[str, Any]]] = []
    at = 1  # (the rows of the run under way, for the reason of a failure)
    try:
        plan, g = plan_of(free)
        for at in (1, 2, fixed):
            feeds: dict[str, Any] = dict(arrays)
            for v in g.input:
                if v.name in held:
                    continue
                tt = v.type.tensor_type
                shape = [at, *(d.dim_value if d.HasField("dim_value") else 1 for d in tt.shape.dim[1:])]
                feeds[v.name] = _trial_rows(rng, shape, np_dtype(tt.elem_type))
                if results:  # (row 0 as at 1 row)
                    feeds[v.name][:1] = results[0][1][v.name]
            results.append((plan.run(feeds), feeds))
        # (the second row of the 2-row run alone: a mix that leaves the first row as it was, a cumulative
        # sum over the rows, shows there)
        at = 1
        second = plan.run({k: (a[1:2] if k not in held else a) for k, a in results[1][1].items()})
        at = fixed
        fixed_plan = plan_of(fixed_model)[0]
        want = fixed_plan.run(results[-1][1])
        # (two batches of the fixed size in one run against the fixed model on each: rows that mix further
        # apart than the 2-row runs see, row k reading row k - 2, show at the seam)
        later = {k: (_trial_rows(rng, list(a.shape), a.dtype) if k not in held else a)
                 for k, a in results[-1][1].items()}
        at = 2 * fixed
        both = plan.run({k: (np.concatenate([a, later[k]]) if k not in held else a)
                         for k, a in results[-1][1].items()})
        want_later = fixed_plan.run(later)
    except Exception as e:  # noqa: BLE001 - any failure at another batch size keeps the fixed one
        return f"at {at} rows instead of {fixed} it fails ({str(e).splitlines()[0][:300]})"
    for rows, (outs, _) in zip((1, 2, fixed), results):
        for o, a in zip(g.output, outs):
            if np.ndim(a) == 0 or np.shape(a)[0] != rows:
                return f"at {rows} rows instead of {fixed}, output {o.name!r} has shape {list(np.shape(a))}"

    def alike(a: Any, b: Any, rtol: float) -> bool:
        a, b = np.asarray(a), np.asarray(b)
        if a.dtype.kind in "fc":
            return a.shape == b.shape and np.allclose(a, b, rtol=rtol, atol=rtol * 1e-2, equal_nan=True)
        return np.array_equal(a, b)

    for o, a, b, c in zip(g.output, results[0][0], results[1][0], second):
        if not alike(a[:1], b[:1], 1e-3) or not alike(c, b[1:2], 1e-3):
            return f"output {o.name!r}'s rows change with the other rows (the rows mix)"
    for o, a, b in zip(g.output, results[2][0], want):
        if not alike(a, b, 1e-5):
            return f"at {fixed} rows output {o.name!r} differs from the fixed model's"
    for o, a, b, c in zip(g.output, both, want, want_later):
        if not (alike(a[:fixed], b, 1e-3) and alike(a[fixed:], c, 1e-3)):
            return (f"output {o.name!r}'s rows change with the other rows (the rows mix: at {2 * fixed} rows "
                    f"not the fixed model's values on each {fixed})")
    return None


def _trial_rows(rng: np.random.Generator, shape: list[int], dt: np.dtype) -> np.ndarray:
    """An input of ``shape`` whose rows differ, to show rows that mix: standard normal values for a float
    type (bfloat16 and float8 included), row k all k % 2 for an integer or bool type (valid ids, counts and
    flags: 0 and 1)."""
    if dt.kind in "fc" or dt.name.startswith(("float", "bfloat")):
        return rng.standard_normal(shape).astype(dt)
    rows = (np.arange(shape[0]) % 2).reshape(-1, *[1] * (len(shape) - 1))
    return np.broadcast_to(rows, shape).astype(dt)

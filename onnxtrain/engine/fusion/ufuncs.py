"""The ufuncs an elementwise cluster runs, and the generated Python function that runs them."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.kernels.clamp import relu_into
from onnxtrain.engine.kernels.elementwise import erf_into, reciprocal
from onnxtrain.engine.kernels.half_cast import via_single

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Step

# op → (ufunc, constant second operand or None); the kernels of these ops are exactly this ufunc call
UFUNCS: dict[str, tuple[np.ufunc, Any]] = {
    "Add": (np.add, None),
    "Sub": (np.subtract, None),
    "Mul": (np.multiply, None),
    "Div": (np.divide, None),
    "Sqrt": (np.sqrt, None),
    "Neg": (np.negative, None),
    "Abs": (np.absolute, None),
    "Exp": (np.exp, None),
    "Log": (np.log, None),
    "Reciprocal": (reciprocal, None),  # numpy's divide of one: its reciprocal is not vectorised
    "Tanh": (np.tanh, None),
    "Relu": (relu_into, None),  # max(x, 0) by the clip ufunc: numpy's scalar maximum is 1.7-3x slower
    "Erf": (erf_into, None),  # not a ufunc, but called as one: the exported GELU chain is one cluster
}
# elementwise ops that may join a cluster but run through their own kernel (outputs are never pooled)
OWN_KERNEL_OPS = {"Identity", "Cast", "Pow"}


def member_ufunc(st: Step, env: dict[int, Any]) -> tuple[Any, Any]:
    """(ufunc, constant second operand) a cluster runs member ``st`` as, for the traced values ``env``: its
    :data:`UFUNCS` entry, float16 arithmetic through float32 arrays (``half_cast.via_single``)."""
    ufunc, extra = UFUNCS[st.node.op_type]
    return via_single(ufunc, [env[s].dtype for s in st.inputs], env[st.outputs[0]].dtype), extra


def compile_program(ops: list[tuple]) -> Callable[[list[Any]], None]:
    """A cluster program as one generated Python function of the value slots: each op a single line with its
    slots written in, no per-op unpacking or dispatch (a 15-op Adam update of a bias: 13.4 → 7.2 µs). An op
    is ``(kind, fn, input slots, output slot(s), buffer, extra)``: kind 0, a ufunc into the scratch buffer;
    1, a ufunc into a fresh array; 3, a ufunc into the buffer of the input slot ``buffer``, which dies there;
    2, the op's own kernel ``fn(inputs, extra)``. ``extra`` of a ufunc is its constant second operand."""
    lines = ["def program(v):"]
    fns, bufs, extras = [], [], []
    for j, (kind, fn, ins, outs, buf, extra) in enumerate(ops):
        fns.append(fn)
        bufs.append(buf)
        extras.append(extra)
        if kind == 2:  # the op's own kernel
            lines.append(f"    res = F[{j}]([{', '.join(f'v[{i}]' for i in ins)}], E[{j}])")
            lines.append(f"    for o, r in zip({tuple(outs)!r}, res):")
            lines.append("        v[o] = r")
            continue
        args = f"v[{ins[0]}], E[{j}]" if extra is not None else ", ".join(f"v[{i}]" for i in ins)
        if kind == 0:  # into a scratch buffer
            lines.append(f"    v[{outs}] = F[{j}]({args}, out=B[{j}])")
        elif kind == 3:  # into the buffer of an input that dies here
            lines.append(f"    v[{outs}] = F[{j}]({args}, out=v[{buf}])")
        else:  # into a fresh array (a 0-d result comes back as a numpy scalar)
            lines.append(f"    r = F[{j}]({args})")
            lines.append(f"    v[{outs}] = r if type(r) is ndarray else asarray(r)")
    if len(lines) == 1:
        lines.append("    pass")
    namespace = {"F": fns, "B": bufs, "E": extras, "ndarray": np.ndarray, "asarray": np.asarray}
    exec("\n".join(lines), namespace)  # noqa: S102 - source made above from integers only
    return namespace["program"]


def runs_as_ufunc(st: Step, env: dict[int, Any]) -> bool:
    """True when the traced run shows a member is exactly its ufunc called on arrays, giving an array."""
    op, r = st.node.op_type, env.get(st.outputs[0])
    if op not in UFUNCS or type(r) is not np.ndarray or r.ndim < 1:
        return False
    if not all(type(env.get(s)) is np.ndarray for s in st.inputs):
        return False
    return not (op == "Div" and any(env[s].dtype.kind != "f" for s in st.inputs))

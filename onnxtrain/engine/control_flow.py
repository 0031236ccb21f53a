"""Control-flow ops: If, Loop, Scan (and its batched opset-8 form) and SequenceMap. Each body graph is
compiled once into a plan of its own; the values a body reads from enclosing graphs ("captures") become
extra inputs of the node's step, so the outer plan keeps them alive until the node has run and frees them
after."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import AttributeProto, helper

from onnxtrain.engine.bag_loops import BagPooling
from onnxtrain.engine.donation import donated_now, donating
from onnxtrain.engine.registry import Attrs, Inputs, Outputs
from onnxtrain.ir.bag_loops import match_bag_loop
from onnxtrain.ir.graphs import captured_names
from onnxtrain.ir.types import np_dtype_of, value_info_shape

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan


class Body:
    """One body graph compiled into a plan whose inputs are the body's own, then its captures."""

    def __init__(self, graph: onnx.GraphProto, model: onnx.ModelProto, threads: int, fuse: bool, where: str,
                 outer_types: Mapping[str, str] | None = None,
                 deciding: Mapping[str, tuple[bool, bool]] | None = None):
        """``outer_types``: the types of the enclosing graphs' values, for the check of the body's nodes;
        ``deciding``: the body's outputs whose values decide a discrete result after the node (exact
        rounding's sinks)."""
        from onnxtrain.engine.plan import EngineError, Plan

        self.where = where
        self.captures = captured_names(graph)
        if outer_types:  # the outer values the body reads, not names it defines itself (it may reuse one)
            outer_types = {n: outer_types[n] for n in self.captures if n in outer_types}
        body = onnx.GraphProto()
        body.CopyFrom(graph)
        body.input.extend(onnx.ValueInfoProto(name=n) for n in self.captures)
        wrapper = helper.make_model(body, opset_imports=model.opset_import, ir_version=model.ir_version)
        try:
            self.plan: Plan = Plan(wrapper, threads=threads, fuse=fuse, outer_types=outer_types,
                                   deciding_outputs=deciding)
        except EngineError as e:
            raise type(e)(f"{where}: {e}") from None
        self.input_names = [v.name for v in graph.input]
        self.outputs = list(graph.output)
        self.graph = graph  # for the shapes of a loop of no iteration (inferred_dims)
        self.opsets, self.ir_version = list(model.opset_import), model.ir_version
        self._inferred: tuple[Any, dict[str, list[int | None]]] = (None, {})
        self._declared: dict[str, list[int | None]] | None = None  # see _declared_inference
        self._outer: tuple[Any, dict[str, list[int | None]]] = (None, {})  # see _outer_inference
        self.peak_extra = 0  # bytes: see run

    def take(self, captured: dict[str, Any]) -> list[Any]:
        """The values this body captures, in its order, from all of its node's captures by name."""
        return [captured[n] for n in self.captures]

    def run(self, values: Sequence[Any], captured: Sequence[Any], step: str = "",
            index: int = -1) -> list[Any]:
        """Outputs of the body for its inputs ``values`` and its captured values (:meth:`take`), both in
        order; an error names ``step`` (e.g. "iteration") and ``index`` when given."""
        self.check_arity(len(values))
        return self.ran(self.plan.run_inputs, [*values, *captured], step, index)

    def check_arity(self, given: int) -> None:
        """Raise as :meth:`run` does when the body does not take ``given`` inputs (checked once per loop)."""
        from onnxtrain.engine.plan import EngineError

        if given != len(self.input_names):
            raise EngineError(f"{self.where}: the body takes {len(self.input_names)} inputs, given {given}")

    def ran(self, run: Callable[[list[Any]], list[Any]], args: list[Any], step: str, index: int) -> list[Any]:
        """:meth:`run` for a loop's iteration: ``run`` is ``self.plan.run_inputs``, ``args`` the body's inputs
        then its captures (their count checked by :meth:`check_arity`). The peak bytes the run held beyond
        its inputs (those are counted where they live) raise :attr:`peak_extra`."""
        from onnxtrain.engine.plan import EngineError

        try:
            out = run(args)
        except EngineError as e:  # of its class (a Terminated stays one), named with the iteration
            raise type(e)(f"{self.where}{f', {step} {index}' if step else ''}: {e}") from None
        plan = self.plan
        extra = plan.peak_bytes - plan.input_bytes
        if extra > self.peak_extra:
            self.peak_extra = extra
        return out

    def empty_output(self, k: int, given: Sequence[Any] = (), captured: Sequence[Any] = ()) -> np.ndarray:
        """An empty stack of body output ``k`` (a scan output of a loop that ran no iteration): its dims are
        the body's declared ones (when it declares no shape, those shape inference finds from the body's own
        declarations and the shapes of the outer values it reads, as onnxruntime's load-time inference does
        from the outer graph's; else rank 1, as onnxruntime defaults), those
        it leaves open as ONNX shape inference finds them from the body's inputs ``given`` (arrays, or shapes
        as tuples) and its ``captured`` values when it can (see :meth:`inferred_dims`), 0 otherwise."""
        tp = self.outputs[k].type
        dtype = np_dtype_of(tp) or np.dtype(np.float32)
        dims = value_info_shape(tp)
        if dims is None:  # no shape declared: the rank the body's declarations give (onnxruntime's), if any
            dims = self._declared_inference().get(self.outputs[k].name)
        if dims is None and captured:  # nor those: with the outer values' shapes too
            dims = self._outer_inference(captured).get(self.outputs[k].name)
        if dims is not None and not all(isinstance(d, int) and d >= 0 for d in dims) and given:
            found = self.inferred_dims(given, captured).get(self.outputs[k].name)
            if found is not None and len(found) == len(dims):
                dims = [d if isinstance(d, int) and d >= 0 else f for d, f in zip(dims, found)]
        inner = tuple(d if isinstance(d, int) and d >= 0 else 0 for d in dims) if dims is not None else ()
        return np.zeros((0, *inner), dtype)

    def inferred_dims(self, given: Sequence[Any], captured: Sequence[Any]) -> dict[str, list[int | None]]:
        """The body's output dims (None where unknown) by ONNX shape inference, the body's inputs typed with
        the shapes of ``given`` (arrays, or shapes as tuples: a scan input's slice) and ``captured``, small
        integer captures given as constants (the sizes of a Split, the shape of a Reshape). Only for a loop
        of no iteration; the last result is kept for the same input shapes. Empty when inference fails."""
        key = tuple(v if isinstance(v, tuple) else (np.shape(v), str(getattr(v, "dtype", type(v))),
                                                     v.tobytes() if _small_ints(v) else b"")
                    for v in (*given, *captured))
        if self._inferred[0] != key:
            self._inferred = (key, self._infer(given, captured))
        return self._inferred[1]

    def _declared_inference(self) -> dict[str, list[int | None]]:
        """The body's output dims (None where unknown) by ONNX shape inference on the body as declared (its
        inputs' declared types, the values it captures untyped); computed once."""
        if self._declared is None:
            self._declared = self._output_dims(self.graph, data_prop=False)
        return self._declared

    def _outer_inference(self, captured: Sequence[Any]) -> dict[str, list[int | None]]:
        """The body's output dims (None where unknown) by ONNX shape inference on the body's declared inputs
        and the values it captures typed as ``captured`` (arrays; others left untyped): what onnxruntime's
        load-time inference finds from the outer graph's types. The last result is kept for the same
        shapes."""
        key = tuple((np.shape(v), str(v.dtype)) if type(v) is np.ndarray else None for v in captured)
        if self._outer[0] != key:
            body = onnx.GraphProto()
            body.CopyFrom(self.graph)
            for name, v in zip(self.captures, captured):
                if type(v) is np.ndarray:
                    body.input.append(helper.make_tensor_value_info(
                        name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
            for o in body.output:
                o.type.tensor_type.ClearField("shape")
            self._outer = (key, self._output_dims(body, data_prop=False))
        return self._outer[1]

    def _infer(self, given: Sequence[Any], captured: Sequence[Any]) -> dict[str, list[int | None]]:
        body = onnx.GraphProto()
        body.CopyFrom(self.graph)
        del body.input[:]
        consts = []
        for name, v in zip([*self.input_names, *self.captures], [*given, *captured]):
            if isinstance(v, tuple):
                tp = self.graph.input[self.input_names.index(name)].type
                body.input.append(helper.make_tensor_value_info(
                    name, tp.tensor_type.elem_type if tp.HasField("tensor_type") else 0, list(v)))
            elif _small_ints(v):
                consts.append(onnx.numpy_helper.from_array(v, name))
            elif type(v) is np.ndarray:
                body.input.append(helper.make_tensor_value_info(
                    name, helper.np_dtype_to_tensor_dtype(v.dtype), list(v.shape)))
            else:
                return {}
        body.initializer.extend(consts)
        body.input.extend(helper.make_tensor_value_info(c.name, c.data_type, list(c.dims)) for c in consts)
        for o in body.output:
            o.type.tensor_type.ClearField("shape")
        return self._output_dims(body, data_prop=True)

    def _output_dims(self, body: onnx.GraphProto, data_prop: bool) -> dict[str, list[int | None]]:
        """The dims (None where unknown) ONNX shape inference finds for ``body``'s outputs, by name; empty
        when inference fails."""
        try:
            model = helper.make_model(body, opset_imports=self.opsets, ir_version=self.ir_version)
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=data_prop)
        except Exception:
            return {}
        out: dict[str, list[int | None]] = {}
        for o in inferred.graph.output:
            dims = value_info_shape(o.type)
            if dims is not None:
                out[o.name] = [d if isinstance(d, int) else None for d in dims]
        return out


def _small_ints(v: Any) -> bool:
    """An integer array small enough to be a shape or sizes (shape inference reads it as a constant)."""
    return type(v) is np.ndarray and v.dtype.kind in "iu" and v.size <= 64


class ControlFlow:
    """The kernel of one control-flow node: ``inputs`` are the node's inputs, then its captures."""

    def __init__(self, node: onnx.NodeProto, bodies: dict[str, Body], n_inputs: int):
        self.node = node
        self.bodies = bodies
        self.n_inputs = n_inputs
        self.captures: list[str] = []
        for b in bodies.values():
            self.captures.extend(n for n in b.captures if n not in self.captures)

    @property
    def extra_bytes(self) -> int:
        """The most bytes a body run of the last call held beyond its inputs (for the plan's peak)."""
        return max(b.peak_extra for b in self.bodies.values())

    def __call__(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        for b in self.bodies.values():
            b.peak_extra = 0
        if donated_now():  # the outer run's donated slots are not the bodies' (see _NOT_DONATING)
            with donating(_NOT_DONATING):
                return self.compute(inputs, attrs)
        return self.compute(inputs, attrs)

    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        raise NotImplementedError

    def split(self, inputs: Inputs) -> tuple[Sequence[Any], dict[str, Any]]:
        """The node's own inputs, and the captured values by name."""
        return inputs[:self.n_inputs], dict(zip(self.captures, inputs[self.n_inputs:]))


# A body's steps never write into its inputs: the arrays of a donated outer run (onnxtrain.engine.donation)
# are named by the outer plan's slots, which mean other values in a body's plan; body runs donate nothing.
_NOT_DONATING: frozenset[int] = frozenset()

_TRUE = np.array(True)  # a Loop body's condition input (read-only, shared by all iterations)
_TRUE.flags.writeable = False


def _scalar(v: Any, what: str, iteration: int = -1) -> Any:
    a = np.asarray(v)
    if a.size != 1:
        at = f" (iteration {iteration})" if iteration >= 0 else ""
        raise ValueError(f"{what}{at} must hold a single value, got shape {list(a.shape)}")
    return a.reshape(-1)[0]


class If(ControlFlow):
    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        (cond,), captured = self.split(inputs)
        if cond is None:
            raise ValueError("the condition input is missing")
        branch = self.bodies["then_branch" if bool(_scalar(cond, "the condition")) else "else_branch"]
        return branch.run((), branch.take(captured))


class Loop(ControlFlow):
    pool: BagPooling | None = None  # set when the body pools bags (onnxtrain.engine.bag_loops)

    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        own, captured = self.split(inputs)
        trip, cond, carried = own[0], own[1], list(own[2:])
        body = self.bodies["body"]
        if self.pool is not None:
            pooled = self.pool(trip, cond, captured)
            if pooled is not None:
                body.peak_extra = self.pool.last_bytes
                return (pooled,)
        captured = body.take(captured)
        n_carried = len(carried)
        n_scan = len(body.outputs) - 1 - n_carried
        if n_scan < 0:
            raise ValueError(f"the body has {len(body.outputs)} outputs, fewer than 1 + {n_carried} "
                             "loop-carried values")
        limit = None if trip is None else int(_scalar(trip, "the trip count M"))
        go = True if cond is None else bool(_scalar(cond, "the condition"))
        # without a condition the loop runs exactly ``limit`` iterations: its scan outputs are stacked into
        # arrays of that length as it goes, else into lists
        count = limit if cond is None and limit is not None and limit > 0 else None
        scans = [_Stacker(count, 0, 0) for _ in range(n_scan)]
        i = 0
        if (limit is None or i < limit) and go:
            body.check_arity(2 + n_carried)
        args = [None, _TRUE, *carried, *captured]  # updated in place, iteration after iteration
        first = 1 + n_carried
        run = body.plan.run_inputs
        while (limit is None or i < limit) and go:
            args[0] = np.array(i, np.int64)
            res = body.ran(run, args, "iteration", i)
            if cond is not None:
                c = res[0]
                go = bool(c.item()) if type(c) is np.ndarray and c.size == 1 else \
                    bool(_scalar(c, "the body's condition output", i))
            args[2:first + 1] = res[1:first]
            for st, v in zip(scans, res[first:]):
                st.add(i, v)
            i += 1
        carried = args[2:first + 1]
        given = (np.array(0, np.int64), _TRUE, *carried)  # the first iteration's inputs, for no iteration
        return (*carried, *(st.result(i, lambda k=k: body.empty_output(first + k, given, captured))
                            for k, st in enumerate(scans)))


class Scan(ControlFlow):
    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        own, captured = self.split(inputs)
        m = attrs["num_scan_inputs"]
        n = len(own) - m
        k_out = len(self.bodies["body"].outputs) - n
        return self.scan(own[:n], own[n:], captured, attrs.get("scan_input_axes") or [0] * m,
                         attrs.get("scan_input_directions") or [0] * m,
                         attrs.get("scan_output_axes") or [0] * k_out,
                         attrs.get("scan_output_directions") or [0] * k_out)

    def scan(self, states: Sequence[Any], xs: Sequence[Any], captured: dict[str, Any], in_axes: list[int],
             in_dirs: list[int], out_axes: list[int], out_dirs: list[int]) -> list[Any]:
        """The final states, then the stacked scan outputs, of the body run along the scan inputs."""
        body = self.bodies["body"]
        captured = body.take(captured)
        m, n = len(xs), len(states)
        states = list(states)
        k_out = len(body.outputs) - n
        if not (len(in_axes) == len(in_dirs) == m and len(out_axes) == len(out_dirs) == k_out):
            raise ValueError(f"scan_input_axes/directions need {m} entries and scan_output_axes/directions"
                             f" {k_out}; got {len(in_axes)}/{len(in_dirs)}, {len(out_axes)}/{len(out_dirs)}")
        axes = []
        for x, a in zip(xs, in_axes):
            if not -x.ndim <= a < x.ndim:
                raise ValueError(f"scan input axis {a} is out of range for rank {x.ndim}")
            axes.append(a % x.ndim)
        lengths = {x.shape[a] for x, a in zip(xs, axes)}
        if len(lengths) > 1:
            raise ValueError(f"scan inputs differ in length along their scan axes: {sorted(lengths)}")
        steps = lengths.pop() if lengths else 0
        outs = [_Stacker(steps, a, d) for a, d in zip(out_axes, out_dirs)]
        if steps:
            body.check_arity(n + m)
            slicers = [_slicer(x, a, d, steps) for x, a, d in zip(xs, axes, in_dirs)]
            args = [*states, *(None for _ in xs), *captured]  # updated in place, step after step
            run = body.plan.run_inputs
            for t in range(steps):
                for j, sl in enumerate(slicers, n):
                    args[j] = sl(t)
                res = body.ran(run, args, "step", t)
                args[:n] = res[:n]
                for st, v in zip(outs, res[n:]):
                    st.add(t, v)
            states = [_own_state(v, xs) for v in args[:n]]
        # no step: the shapes of the first step's inputs (a slice of each scan input) for the outputs'
        given = (*states, *(x.shape[:a] + x.shape[a + 1:] for x, a in zip(xs, axes)))
        stacked = [st.result(steps, lambda k=k: body.empty_output(n + k, given, captured))
                   for k, st in enumerate(outs)]
        return [*states, *stacked]


class Scan8(Scan):
    """Scan before opset 9: every state and scan input has a leading batch axis (the scan inputs' second
    axis is the sequence), an optional first input gives each batch entry's sequence length, and scan
    outputs are (batch, sequence, ...) with zeros past an entry's length."""

    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        own, captured = self.split(inputs)
        lens, own = own[0], own[1:]
        m = attrs["num_scan_inputs"]
        n = len(own) - m
        states, xs = own[:n], own[n:]
        dirs = list(attrs.get("directions") or [0] * m)
        if len(dirs) != m:
            raise ValueError(f"directions needs {m} entries, got {len(dirs)}")
        batch = {v.shape[0] for v in (*states, *xs) if np.ndim(v)}
        if len(batch) != 1 or any(np.ndim(v) == 0 for v in (*states, *xs)):
            raise ValueError(f"states and scan inputs need one common batch axis, got sizes {sorted(batch)}")
        b = batch.pop()
        longest = xs[0].shape[1] if xs and xs[0].ndim > 1 else 0
        if lens is None:
            lens = np.full(b, longest, np.int64)
        lens = np.asarray(lens).reshape(-1)
        if lens.shape != (b,) or lens.min(initial=0) < 0 or lens.max(initial=0) > longest:
            raise ValueError(f"sequence_lens {lens.tolist()} must give {b} lengths in [0, {longest}]")
        k_out = len(self.bodies["body"].outputs) - n
        per_entry = []
        for i in range(b):
            t = int(lens[i])
            per_entry.append(self.scan([s[i] for s in states], [x[i, :t] for x in xs], captured,
                                       [0] * m, dirs, [0] * k_out, [0] * k_out))
        body = self.bodies["body"]
        if not b:  # an empty batch: the states as given, empty scan outputs
            empty = [body.empty_output(k) for k in range(n, n + k_out)]
            return [*states, *(np.zeros((0, longest, *e.shape[1:]), e.dtype) for e in empty)]
        results: list[Any] = [np.stack([r[k] for r in per_entry]) for k in range(n)]
        for k in range(n, n + k_out):
            first = next((r[k] for r in per_entry if r[k].shape[0]), per_entry[0][k])
            shape, dt = (b, longest, *first.shape[1:]), first.dtype
            # padded with zeros, "" for strings (as onnxruntime; numpy's zero of an object array is the int 0)
            out = np.full(shape, "", dt) if dt.kind in "OSU" else np.zeros(shape, dt)
            for i, r in enumerate(per_entry):
                out[i, :r[k].shape[0]] = r[k]
            results.append(out)
        return results


class SequenceMap(ControlFlow):
    def compute(self, inputs: Inputs, attrs: Attrs) -> Outputs:
        own, captured = self.split(inputs)
        body = self.bodies["body"]
        captured = body.take(captured)
        if not isinstance(own[0], list):
            raise TypeError(f"the first input must be a sequence, got {type(own[0]).__name__}")
        count = len(own[0])
        for j, v in enumerate(own[1:], start=1):
            if isinstance(v, list) and len(v) != count:
                raise ValueError(f"input {j} is a sequence of {len(v)} values, the first input's has {count}")
        outs: list[list[Any]] = [[] for _ in body.outputs]
        for i in range(count):
            values = [v[i] if isinstance(v, list) else v for v in own]
            for lst, r in zip(outs, body.run(values, captured, "element", i)):
                lst.append(r)
        return tuple(outs)


def _slicer(x: Any, axis: int, reverse: int, steps: int) -> Callable[[int], Any]:
    """Step ``t``'s slice of scan input ``x`` along ``axis`` (counted from the end when ``reverse``).

    Where the slice is C-contiguous (laid out as a copy by ``np.take`` would be), it is a read-only view: no
    copy, and no body step can write into the caller's array through it (body runs donate nothing, and the
    in-place fusions only write into products of the body's own steps). A strided slice (a transposed input)
    is copied as before, kernels may take other paths, in another summation order, on strided data; but by
    ``np.ascontiguousarray``, the same bits as ``np.take`` gives and far faster on a strided input (a
    [1, 50, 32, 896] float32 array transposed: 1.9 against 109 µs a slice).
    """
    last = steps - 1
    if type(x) is np.ndarray:
        pre = (slice(None),) * axis
        if x[(*pre, 0, Ellipsis)].flags.c_contiguous:
            def view(t: int) -> np.ndarray:
                v = x[(*pre, last - t if reverse else t, Ellipsis)]
                v.flags.writeable = False
                return v

            return view
        return lambda t: np.ascontiguousarray(x[(*pre, last - t if reverse else t, Ellipsis)])
    return lambda t: np.take(x, last - t if reverse else t, axis=axis)


def _own_state(v: Any, xs: Sequence[Any]) -> Any:
    """A final state that may be (a view of) a scan input's read-only slice: a copy of its own, as the state
    was before slices became views."""
    if type(v) is np.ndarray and not v.flags.writeable and v.base is not None and \
            any(type(x) is np.ndarray and np.may_share_memory(v, x) for x in xs):
        return v.copy()
    return v


class _Stacker:
    """One scan output of a loop, stacked as its iterations give it: written into an array of ``count``
    entries along ``axis`` (in reverse order when ``reverse``) when the count is known and every value is an
    array of the first one's shape and dtype; otherwise kept in a list for :func:`_stack`, which gives the
    same values."""

    __slots__ = ("count", "axis", "reverse", "buf", "lst", "pre", "shape", "dtype")

    def __init__(self, count: int | None, axis: int, reverse: int):
        self.count, self.axis, self.reverse = count, axis, reverse
        self.buf: np.ndarray | None = None
        self.lst: list[Any] | None = None if count else []
        self.pre: tuple = ()
        self.shape: tuple = ()
        self.dtype: Any = None

    def _at(self, t: int) -> tuple:
        return (*self.pre, self.count - 1 - t if self.reverse else t, Ellipsis)

    def add(self, t: int, v: Any) -> None:
        buf = self.buf
        if buf is not None:
            if type(v) is np.ndarray and v.shape == self.shape and v.dtype == self.dtype:
                buf[(*self.pre, self.count - 1 - t if self.reverse else t, Ellipsis)] = v
                return
            # another shape or type: the values so far (views of the buffer) go to a list, as without it
            self.lst = [buf[self._at(j)] for j in range(t)]
            self.buf = None
        elif self.lst is None:  # the first value
            rank = np.ndim(v) + 1
            if type(v) is np.ndarray and -rank <= self.axis < rank:
                a = self.axis % rank
                self.pre, self.shape, self.dtype = (slice(None),) * a, v.shape, v.dtype
                try:
                    self.buf = np.empty((*v.shape[:a], self.count, *v.shape[a:]), v.dtype)
                except (MemoryError, ValueError):  # a trip count too large to plan for: a list
                    self.buf = None
                else:
                    self.buf[self._at(t)] = v
                    return
            self.lst = []
        self.lst.append(v)

    def result(self, count: int, empty: Callable[[], np.ndarray]) -> np.ndarray:
        """The stacked output after ``count`` iterations (those given to :meth:`add`)."""
        if self.buf is not None and count == self.count:
            return self.buf
        lst = self.lst or []
        if self.buf is not None:  # fewer iterations than planned (not reached: the count is exact)
            lst = [self.buf[self._at(j)] for j in range(count)]
        return _stack(lst[::-1] if self.reverse else lst, self.axis, count, empty)


def _stack(values: list[Any], axis: int, count: int, empty: Callable[[], np.ndarray]) -> np.ndarray:
    """Per-iteration values stacked along a new ``axis`` (negative: from the end of the result)."""
    if not count:  # an empty stack (along axis 0 of the body output's declared shape) moved to ``axis``
        out = empty()
        return np.moveaxis(out, 0, axis) if -out.ndim <= axis < out.ndim else out
    shapes = {np.shape(v) for v in values}
    if len(shapes) > 1:
        raise ValueError(f"a scan output changes shape between iterations: {sorted(shapes)}")
    rank = np.ndim(values[0]) + 1
    if not -rank <= axis < rank:
        raise ValueError(f"scan output axis {axis} is out of range for rank {rank}")
    return np.stack(values, axis=axis)


_KINDS: dict[str, tuple[type[ControlFlow], tuple[str, ...]]] = {
    "If": (If, ("then_branch", "else_branch")),
    "Loop": (Loop, ("body",)),
    "Scan": (Scan, ("body",)),
    "SequenceMap": (SequenceMap, ("body",)),
}


def compile_control_flow(node: onnx.NodeProto, model: onnx.ModelProto, opset: int, threads: int,
                         fuse: bool, outer_types: Mapping[str, str] | None = None,
                         deciding: Mapping[str, Mapping[str, tuple[bool, bool]]] | None = None
                         ) -> ControlFlow:
    """The kernel of a control-flow node, its bodies compiled (with the plan's ``threads`` and ``fuse``, their
    nodes checked with the types ``outer_types`` of the values they may read from outside, each with its
    outputs of ``deciding``, by body name: see :func:`~onnxtrain.engine.exact_rounding.body_sinks`); its
    ``captures`` name the outer values to pass after the node's inputs."""
    from onnxtrain.engine.plan import EngineError, UnsupportedOpError

    where = f"node {node.name!r} ({node.op_type})"
    if node.op_type not in _KINDS:
        raise UnsupportedOpError(f"{where}: not a control-flow op ({', '.join(_KINDS)} are)")
    kind, names = _KINDS[node.op_type]
    if kind is Scan and opset < 9:
        kind = Scan8
    graphs = {a.name: a.g for a in node.attribute if a.type == AttributeProto.GRAPH}
    missing = [n for n in names if n not in graphs]
    if missing:
        raise EngineError(f"{where}: attribute(s) {missing} missing")
    bodies = {n: Body(graphs[n], model, threads, fuse, f"{where}, {n}", outer_types, (deciding or {}).get(n))
              for n in names}
    n_out = len(node.output)
    for n, b in bodies.items():
        given = len(b.outputs) - (1 if node.op_type == "Loop" else 0)
        if given != n_out:
            after = " after its condition" if kind is Loop else ""
            raise EngineError(f"{where}: {n} has {given} outputs{after}, the node {n_out}")
    if node.op_type == "Loop" and len(bodies["body"].input_names) != len(node.input):
        raise EngineError(f"{where}: the body takes {len(bodies['body'].input_names)} inputs; the node has "
                         f"{len(node.input)} (M, cond and the loop-carried values)")
    flow = kind(node, bodies, len(node.input))
    if fuse and isinstance(flow, Loop):
        bag = match_bag_loop(node)
        flow.pool = BagPooling(bag) if bag is not None else None
    return flow

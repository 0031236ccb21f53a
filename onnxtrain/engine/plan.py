"""Compile an ONNX graph once into a :class:`Plan`; run the plan many times.

The plan is a flat list of steps ``(kernel, input slots, output slots, attrs, slots to free)``.
Values live in a list indexed by slot; each intermediate is dropped right after its last use,
and the plan records the peak bytes of live tensors during its last run. A run raises no numpy
floating-point warning: its kernels' infs and NaNs are their IEEE results, as in other ONNX runtimes.
"""

from __future__ import annotations

import gc
import json
import operator
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import numpy as np
import onnx

from onnxtrain.engine.affinity import caller_cpu, placed
from onnxtrain.engine.allocator import tune_allocator
from onnxtrain.engine.control_flow import ControlFlow, compile_control_flow
from onnxtrain.engine.donation import donated_now, donated_slots, donating, reusable_inputs
from onnxtrain.engine.exact_rounding import body_sinks, round_deciding_steps
from onnxtrain.engine.failure_classes import node_failure_class
from onnxtrain.engine.interface import (  # noqa: F401  (the engine's errors, imported from here elsewhere)
    MAX_PROFILE_EVENTS,
    RUN_OPTIONS,
    EngineError,
    GraphInterface,
    InvalidNodeError,
    ModelParseError,
    ProfileEvent,
    Terminated,
    UndefinedValueError,
    UnknownOpError,
    UnsupportedOpError,
    default_opset,
    load_model,
    node_label,
    repeats_copied,
)
from onnxtrain.engine.legacy_forms import legacy_form, refusal
from onnxtrain.engine.node_checks import (  # noqa: F401 (re-exported)
    ONNX_DOMAINS,
    NodeChecker,
    check_nodes,
    checked_opsets,
    graph_types,
)
from onnxtrain.engine.parallel import default_width, recording_splits, running_with, width, worker_threads
from onnxtrain.engine.registry import (
    SUBGRAPH_OPS,
    Attrs,
    Kernel,
    available_domain_ops,
    available_ops,
    find_kernel,
    parse_attributes,
)
from onnxtrain.ir.builder import pausing_gc
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, RANDOM_OPS, added_later, first_opset
from onnxtrain.ir.types import TENSOR_TYPE_STRINGS


def _plain(v: Any) -> Any:
    """An ndarray subclass's value as a plain ndarray (no copy), anything else as it is: kernels and fused
    steps key their work on ``type(v) is np.ndarray`` (a cluster's program is chosen by its inputs' shapes
    and dtypes, which a subclass's would not be part of), and ONNX has no subclass semantics (np.matrix's
    ``*``)."""
    return np.asarray(v) if type(v) is not np.ndarray and isinstance(v, np.ndarray) else v


def _quiet() -> np.errstate:
    """numpy's floating-point warnings off for a run: the kernels give IEEE results (an overflow's inf, a
    NaN from inf - inf) silently, as other ONNX runtimes do, instead of numpy's RuntimeWarnings (mixed
    precision training overflows on purpose, until its loss scale comes down). The fused clusters rely on it,
    and the engine's worker threads take it over from the run's thread (``parallel_for``)."""
    return np.errstate(all="ignore")


@dataclass
class Step:
    fn: Kernel
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: Attrs
    free: tuple[int, ...]
    node: onnx.NodeProto


class Plan(GraphInterface):
    """An executable form of one ONNX graph."""

    _laid_slots: list[Any] | None = None  # the value slots every run starts from (_new_slots)
    _outputs_known: dict[tuple[str, ...] | None, tuple[tuple[int, ...], bool]] | None = None  # (_outputs_of)

    def _lacks_kernel(self, node: onnx.NodeProto) -> bool:
        return node.op_type not in SUBGRAPH_OPS and find_kernel(node.op_type, self.opset, node.domain) is None

    @pausing_gc
    def __init__(
        self,
        model: onnx.ModelProto | str | bytes,
        fold_constants: bool = True,
        fuse: bool | None = None,
        threads: int | None = None,
        initializers: Mapping[str, np.ndarray] | None = None,
        random_state: dict[Any, dict[Any, Any]] | None = None,
        outer_types: Mapping[str, str] | None = None,
        deciding_outputs: Mapping[str, tuple[bool, bool]] | None = None,
    ):
        """``fuse``: apply the execution-time fusions of :mod:`onnxtrain.engine.fusion` (default: on, unless
        the environment says ``ONNXTRAIN_FUSION=0``). ``threads``: how many threads a kernel may split its
        work over (default: :func:`~onnxtrain.engine.parallel.default_width`). ``initializers``: arrays to
        use for the model's initializers of those names (shared with another plan of the same model).
        ``random_state``: where the random nodes (Dropout, RandomNormal, ...) keep their generators, by node
        name, shared by the plans of one session, so that a node in two graphs that run in turn (the
        micro-steps and the update step of gradient accumulation) draws one sequence, not the same draws
        twice. ``deciding_outputs``: a body's outputs whose values decide a discrete result after its node
        (:func:`~onnxtrain.engine.exact_rounding.body_sinks`)."""
        if threads is not None and (not isinstance(threads, int) or threads < 0):
            raise ValueError(f"threads must be a non-negative integer (0: the default), got {threads!r}")
        self.threads = threads or default_width()
        from onnxtrain.engine import fusion  # on first use: onnxruntime plans never load it

        self.fused = fusion.enabled() if fuse is None else bool(fuse)
        tune_allocator()
        # the nodes are checked against their schemas (InvalidNodeError) as they are compiled, below; the
        # model's own nodes, before the ops without a kernel are replaced by their function bodies
        original = load_model(model)
        try:
            model = self._read_interface(original, initializers, loaded=True)
        except Exception:
            check_nodes(original)  # an invalid node may be why its function body could not be built
            raise
        checker = None
        if model is original:
            # the types the graph declares and, for a body, those of the enclosing graphs' values
            checker = NodeChecker(checked_opsets(model), model.graph, outer_types)
        else:
            check_nodes(original)  # functions expanded: the whole model's, bodies included, now
        g = model.graph
        init_names = set(self.initializers)

        slot: dict[str, int] = {}

        def slot_of(name: str) -> int:
            if name not in slot:
                slot[name] = len(slot)
            return slot[name]

        for name in self.all_input_names:
            slot_of(name)
        for name in self.initializers:
            slot_of(name)
        raw_steps: list[tuple[onnx.NodeProto, Kernel, Attrs, list[int], list[int]]] = []
        ranks = _ranks_of(model)
        missing: list[str] = []
        unknown = False  # a missing op that ONNX does not define
        captures: dict[int, list[str]] = {}  # node index → outer values its bodies read
        domain_opsets = {o.domain: o.version for o in model.opset_import}
        declared: dict[str, str] | None = None  # the value types the graph declares, read when first needed
        flow_sinks = self._flow_sinks(g, deciding_outputs)
        for k, node in enumerate(g.node):
            in_names, out_names = tuple(node.input), tuple(node.output)
            if checker is not None and checker.invalid(node, in_names, out_names):
                check_nodes(model, outer_types)  # raises, naming every invalid node (bodies: their plans)
            if node.op_type in SUBGRAPH_OPS and node.domain in DEFAULT_DOMAINS:
                fn = compile_control_flow(node, model, self.opset, self.threads, self.fused,
                                          checker.types if checker is not None else None, flow_sinks.get(k))
                captures[k] = fn.captures
            else:
                fn = find_kernel(node.op_type, self.opset, node.domain)
                why = fn and legacy_form(node, self.opset, ranks)
                if why:
                    raise UnsupportedOpError(refusal(node, k, self.opset, why))
            if fn is None:
                unknown = unknown or (node.domain in ONNX_DOMAINS
                                      and not first_opset(node.op_type, ONNX_DOMAINS[node.domain]))
                label = repr(node.name) if node.name else f"#{k} (unnamed)"
                missing.append(f"{label} ({node.domain + '.' if node.domain else ''}{node.op_type}"
                               f"{added_later(node, self.opset)})")
                continue
            # a node of another domain (ai.onnx.ml) is read at that domain's opset
            opset = self.opset if node.domain in DEFAULT_DOMAINS else domain_opsets.get(node.domain, 1)
            try:
                values = parse_attributes(node, opset)
            except Exception as e:
                raise EngineError(f"node {node.name!r} ({node.op_type}): bad attributes: {e}") from None
            used = tuple(bool(o) for o in out_names)
            input_types: tuple[str | None, ...] = ()
            if node.domain == "ai.onnx.ml":  # a map input's value type is known from the graph only
                if checker is None and declared is None:
                    declared = graph_types(g)
                types = checker.types if checker is not None else declared
                input_types = tuple(types.get(n) if n else None for n in in_names)
            attrs = Attrs(values, node.op_type, node.name, opset, len(out_names), used, input_types)
            if random_state is not None and node.op_type in RANDOM_OPS:
                attrs.cache = random_state.setdefault(node.name or out_names, {})
            ins = [slot_of(n) if n else -1 for n in (*in_names, *captures.get(k, ()))]
            outs = [slot_of(n) if n else -1 for n in out_names]
            raw_steps.append((node, fn, attrs, ins, outs))
        if missing:
            why = " (ONNX defines no such op: a typo, or a custom op's domain left out?)" if unknown else ""
            raise (UnknownOpError if unknown else UnsupportedOpError)(
                f"no kernel for node(s) {', '.join(missing)}{why}; ops with kernels: "
                f"{', '.join(available_ops() + available_domain_ops())}"
            )
        self._check_produced(raw_steps, slot, g, init_names)
        fed = set(self.all_input_names)  # an initializer a feed may override is no constant
        raw_steps = round_deciding_steps(
            raw_steps, {slot[n]: v for n, v in self.initializers.items() if n not in fed},
            {slot[n]: r for n, r in (deciding_outputs or {}).items() if n in slot})
        self.slot = slot
        self.n_slots = len(slot)
        self.steps = [
            Step(fn, tuple(ins), tuple(outs), attrs, (), node) for node, fn, attrs, ins, outs in raw_steps
        ]
        self.peak_bytes = 0
        self.profiling = False
        self.profile: list[ProfileEvent] = []
        self._output_slots = [slot[n] for n in self.output_names]
        self._input_slots = [slot[n] for n in self.all_input_names]
        self._init_values = [(slot[n], _plain(v)) for n, v in self.initializers.items()]
        self._base_bytes = sum(v.nbytes for v in self.initializers.values())
        self._const_values: list[tuple[int, np.ndarray]] = []
        if fold_constants:
            self._fold_constants()
        self.scratch = fusion.ScratchPool()  # scratch buffers of fused steps, kept across runs
        if self.fused:
            fusion.fuse(self)
        self._assign_frees()
        self._reusable = self._offer_reuse()
        self._bodies = any(isinstance(st.fn, ControlFlow) for st in self.steps)

    def _flow_sinks(self, g: onnx.GraphProto, deciding_outputs: Mapping[str, tuple[bool, bool]] | None
                    ) -> dict[int, dict[str, dict[str, tuple[bool, bool]]]]:
        """Per control-flow node, its bodies' outputs that decide a discrete result (see
        :func:`~onnxtrain.engine.exact_rounding.body_sinks`), found before the bodies are built."""
        if not any(n.op_type in SUBGRAPH_OPS for n in g.node):
            return {}
        fed = set(self.all_input_names)
        return body_sinks(g, self.opset, deciding_outputs or {},
                          {n: v for n, v in self.initializers.items() if n not in fed})

    def _check_produced(self, raw_steps: list[tuple[onnx.NodeProto, Kernel, Attrs, list[int], list[int]]],
                        slot: Mapping[str, int], g: onnx.GraphProto, init_names: set[str]) -> None:
        """Raise for the first node reading a value that no earlier node, graph input or initializer gives,
        and for a graph output no node gives."""
        # by slot (one a name); -1, an omitted input, counts as given
        produced = {-1, *(slot[n] for n in init_names), *(slot[n] for n in self.all_input_names)}
        for node, _, _, ins, outs in raw_steps:
            if not produced.issuperset(ins):
                name_of = {s: n for n, s in slot.items()}
                n = next(name_of[s] for s in ins if s not in produced)
                what = "input" if n in node.input else "value read by its body"
                k = next(k for k, m in enumerate(g.node) if m is node)
                raise UndefinedValueError(
                    f"node {node_label(node, k)} ({node.op_type}): {what} {n!r} is not produced "
                    "by any earlier node, graph input or initializer"
                )
            produced.update(outs)
        for n in self.output_names:
            if slot.get(n, -1) < 0 or slot[n] not in produced:
                raise EngineError(f"graph output {n!r} is not produced by any node")

    def _assign_frees(self) -> None:
        """Give every step the slots whose last use it is; graph outputs and initializers are never freed."""
        keep = set(self._output_slots) | {s for s, _ in self._init_values}
        last: dict[int, int] = {}
        for i, st in enumerate(self.steps):
            for s in st.inputs:
                if s >= 0:
                    last[s] = i
            for s in st.outputs:
                if s >= 0:
                    last[s] = max(last.get(s, i), i)  # an output nobody reads dies at once
        frees: list[list[int]] = [[] for _ in self.steps]
        for s, i in last.items():
            if s not in keep:
                frees[i].append(s)
        self.steps = [
            Step(st.fn, st.inputs, st.outputs, st.attrs, tuple(fr), st.node)
            for st, fr in zip(self.steps, frees)
        ]

    def _offer_reuse(self) -> frozenset[int]:
        """Tell the steps that can write into donated inputs which ones they may take; returns them all."""
        taken: set[int] = set()
        self._reuse_at: dict[int, int] = {}  # slot → the step that may write into it
        for i, slots in reusable_inputs(self).items():
            allow = getattr(self.steps[i].fn, "allow_reuse", None)
            if allow is not None:
                for s in allow(slots):
                    taken.add(s)
                    self._reuse_at[s] = min(i, self._reuse_at.get(s, i))
        return frozenset(taken)

    def _fold_constants(self) -> None:
        """Evaluate Constant nodes once, at compile time (initializers stay feedable). The values are
        read-only, as the initializers the engine reads: every run shares them, so an output passing one
        through is the caller's copy (:func:`~onnxtrain.capi.outputs.own_outputs`)."""
        kept: list[Step] = []
        folded: list[tuple[int, np.ndarray]] = []
        for st in self.steps:
            if st.node.op_type != "Constant":
                kept.append(st)
                continue
            res = self._call(st, [])
            for s, v in zip(st.outputs, res):
                a = np.asarray(v)
                a.flags.writeable = False
                folded.append((s, a))
        self.steps = kept
        self._const_values = folded
        self._base_bytes += sum(v.nbytes for _, v in folded)

    @staticmethod
    def _call(st: Step, vals: list[Any]) -> Sequence[Any]:
        try:
            return st.fn(vals, st.attrs)
        except Exception as e:
            Plan._raise_failed(st, vals, e)

    @staticmethod
    def _raise_failed(st: Step, vals: list[Any], e: Exception) -> NoReturn:
        """Raise for step ``st`` that failed on inputs ``vals`` with ``e`` (the step is not run again: it may
        have written in place, drawn, or run a loop): ``e`` itself when it is already an EngineError (a
        body's, a Terminated), else an EngineError naming the node and its inputs, caused by ``e``, of
        onnxruntime's class for that op's failure (:mod:`onnxtrain.engine.failure_classes`)."""
        if isinstance(e, EngineError):
            raise e
        node = st.node
        name, op, names, outs = node.name, node.op_type, list(node.input), list(node.output)
        origin = expanded_sum(node)
        if origin is not None:  # one of the Adds of a Sum expand_sums made: the Sum is the graph's node
            name, made, summed = origin
            op, names, outs = "Sum", [summed, *names[1:]], [made]
        shapes = ", ".join(f"{n or '<none>'}: {_describe(v)}" for n, v in zip(names, vals))
        made = next((o for o in outs if o), "")
        label = repr(name) if name or not made else f"(unnamed, making {made!r})"
        cls = node_failure_class(op, e)
        raise cls(f"node {label} ({op}) failed on inputs [{shapes}]: {type(e).__name__}: {e}") from e

    def run(
        self,
        feeds: Mapping[str, Any],
        output_names: Sequence[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        donate: Collection[str] = (),
    ) -> list[np.ndarray]:
        """Run the graph on ``feeds`` (name → array) and return the requested outputs.

        ``donate`` names feeds the caller will not use again: their arrays may be overwritten (and come
        back as outputs) when that is safe; see :mod:`onnxtrain.engine.donation`."""
        vals = self._new_slots()
        slot = self.slot
        live = self._base_bytes
        inits = self.initializers
        for name, v in feeds.items():
            s = slot.get(name)
            if s is None:
                raise EngineError(f"unknown feed {name!r}; graph inputs: {self.all_input_names}")
            if type(v) is np.ndarray:
                size = v.nbytes
            else:
                v = _plain(v)
                size = nbytes(v)
            held = vals[s]
            if held is not None and name in inits:  # a fed initializer: its own array is not held
                live -= held.nbytes
            vals[s] = v
            live += size
        if overrides:
            for name, v in overrides.items():
                vals[slot[name]] = _plain(v)
        reuse = None
        if donate:  # only a donated array the run really reads (an override may have replaced it)
            given = donated_slots(self, feeds, donate)
            reuse = frozenset(s for s, a in given.items() if s in self._reusable and vals[s] is a)
        with running_with(self.threads), placed(self.threads), _quiet():
            if reuse:
                # RunOptions.terminate is obeyed up to the first step that may write into a donated array
                # (the update of a weight, a moment): past it a stop would leave the state half updated
                with donating(reuse):
                    peak = self._run_steps(vals, live, min(self._reuse_at[s] for s in reuse))
            elif donated_now():  # another plan's slots, left by a donating run an exception cut as it ended
                with donating(frozenset()):  # (a signal handler's): never this run's inputs
                    peak = self._run_steps(vals, live)
            else:
                peak = self._run_steps(vals, live)
        self.peak_bytes = peak + self.scratch.nbytes
        slots, repeated = self._outputs_of(output_names)
        outs = [v if type(v) is np.ndarray else _as_array(v) for v in map(vals.__getitem__, slots)]
        return repeats_copied(slots, outs) if repeated else outs

    def _outputs_of(self, names: Sequence[str] | None) -> tuple[Sequence[int], bool]:
        """The slots of the outputs ``names`` (None: all, in order) and whether one is asked for twice;
        remembered per list of names (a training loop asks for the same ones at every step)."""
        known = self._outputs_known
        if known is None:
            known = self._outputs_known = {}
        key = None if names is None else tuple(names)
        got = known.get(key)
        if got is not None:
            return got
        if names is None:
            slots = self._output_slots
        else:
            slots = []
            for n in key:
                s = self.slot.get(n)
                if s is None or n not in self.output_info:
                    raise EngineError(f"unknown output {n!r}; graph outputs: {self.output_names}")
                slots.append(s)
        got = (tuple(slots), len(set(slots)) < len(slots))
        if len(known) >= _OUTPUT_LISTS_KEPT:
            known.clear()
        known[key] = got
        return got

    def _new_slots(self) -> list[Any]:
        """A run's value slots holding the initializers and folded constants (fixed once the plan is built:
        laid out at the first run, copied at each); the extra last slot stays None (omitted inputs)."""
        laid = self._laid_slots
        if laid is None:
            laid = [None] * (self.n_slots + 1)
            for s, v in self._init_values:
                laid[s] = v
            for s, v in self._const_values:
                laid[s] = v
            self._laid_slots = laid
        return laid.copy()

    def run_inputs(self, values: Sequence[Any]) -> list[Any]:
        """Run on all graph inputs given in order (``all_input_names``), without checking them: for callers
        that made the graph themselves (control-flow bodies, once per iteration). ``input_bytes`` holds
        their bytes afterwards."""
        vals = self._new_slots()
        given = 0
        for s, v in zip(self._input_slots, values):
            vals[s] = v
            given += v.nbytes if type(v) is np.ndarray else nbytes(v)
        self.input_bytes = given
        if width() == self.threads:  # a body inside a run of its outer plan: already set
            peak = self._run_steps(vals, self._base_bytes + given)
        else:
            with running_with(self.threads), _quiet():
                peak = self._run_steps(vals, self._base_bytes + given)
        self.peak_bytes = peak + self.scratch.nbytes
        return [_as_array(vals[s]) for s in self._output_slots]

    def _run_steps(self, vals: list[Any], live: int, until: int | None = None) -> int:
        """Run every step on the slots ``vals``, freeing values after their last use; returns the peak of
        live bytes. ``RunOptions.terminate`` is read before each step up to step ``until`` (all: None)."""
        stop = RUN_OPTIONS.get()
        if self.profiling and len(self.profile) >= MAX_PROFILE_EVENTS:
            self._end_full_profile()
        if self.profiling or self._bodies or (stop is not None and until is not None):
            peak = self._run_watched(vals, live, stop, until)
        else:
            peak = live
            for fn, get, in1, out1, outs, attrs, free, st in self._program:
                if stop is not None and stop.terminate:
                    raise Terminated(_TERMINATED.format(_next_node(st.node)))
                # two or more inputs: one C-level itemgetter call builds the tuple
                args = get(vals) if get is not None else [vals[in1]] if in1 >= 0 else []
                try:
                    res = fn(args, attrs)
                except Exception as e:
                    self._raise_failed(st, args, e)
                if out1 >= 0:  # one output (the common case)
                    r = vals[out1] = res[0]
                    try:
                        live += r.nbytes
                    except AttributeError:
                        live += nbytes(r)
                else:
                    live += self._store(vals, outs, res) - self._free_written(vals, free, res)
                if live > peak:
                    peak = live
                for s in free:
                    v = vals[s]
                    if v is not None:
                        vals[s] = None
                        live -= v.nbytes if type(v) is np.ndarray else nbytes(v)
                v = None  # a local must not keep the last freed value alive during the next step
        return peak

    @property
    def _program(self) -> list[tuple]:
        """The steps as flat tuples for the run loop, rebuilt when ``steps`` was replaced."""
        cached = self.__dict__.get("_program_cache")
        if cached is not None and cached[0] is self.steps and len(cached[1]) == len(self.steps):
            return cached[1]
        none_slot = self.n_slots
        prog = []
        for st in self.steps:
            ins = tuple(i if i >= 0 else none_slot for i in st.inputs)
            get = operator.itemgetter(*ins) if len(ins) >= 2 else None
            in1 = ins[0] if len(ins) == 1 else -1
            outs = st.outputs
            out1 = outs[0] if len(outs) == 1 and outs[0] >= 0 else -1
            prog.append((st.fn, get, in1, out1, outs, st.attrs, st.free, st))
        self._program_cache = (self.steps, prog)
        return prog

    @staticmethod
    def _store(vals: list[Any], outs: tuple[int, ...], res: Sequence[Any]) -> int:
        """Put a multi-output step's results in their slots; returns their bytes."""
        added = 0
        for s, r in zip(outs, res):
            if s >= 0:
                vals[s] = r
                added += r.nbytes if type(r) is np.ndarray else nbytes(r)
        return added

    @staticmethod
    def _free_written(vals: list[Any], free: tuple[int, ...], res: Sequence[Any]) -> int:
        """Free now the inputs of a multi-output step that one of its results was written into (a donated
        weight updated in place): that memory is the result's from here on, not new. Returns their bytes."""
        if not free:
            return 0
        freed = 0
        written = set(map(id, res))
        for s in free:
            v = vals[s]
            if v is not None and id(v) in written:
                vals[s] = None
                freed += v.nbytes if type(v) is np.ndarray else nbytes(v)
        return freed

    def _run_watched(self, vals: list[Any], live: int, stop: Any = None, until: int | None = None) -> int:
        """The run loop with one :class:`ProfileEvent` per step when profiling, the bytes a control-flow
        step's bodies held during it counted in the peak, and ``stop.terminate`` (RunOptions) read before
        each step up to step ``until`` (all: None); returns the peak of live bytes."""
        peak = live
        constants = self._constant_slots() if self.profiling else frozenset()
        last = len(self.steps) if until is None else until
        for k, (fn, get, in1, _, outs, attrs, free, st) in enumerate(self._program):
            if stop is not None and k <= last and stop.terminate:
                raise Terminated(_TERMINATED.format(_next_node(st.node)))
            args = get(vals) if get is not None else [vals[in1]] if in1 >= 0 else []
            bodies = fn.bodies.values() if isinstance(fn, ControlFlow) else ()
            for b in bodies:
                b.plan.profiling = self.profiling
            splits: list[int] = []
            before = live
            # profiling, the cyclic collector waits for the step to end: a collection that the kernel's
            # allocations set off would land in its time (the profile's own events make full collections
            # long: 40 ms in one Shape step of the transformer's 20-step profile)
            paused = self.profiling and gc.isenabled()
            if paused:
                gc.disable()
            t0 = time.perf_counter_ns()
            try:
                if self.profiling:
                    with recording_splits(splits):
                        res = fn(args, attrs)
                else:
                    res = fn(args, attrs)
            except Exception as e:
                self._raise_failed(st, args, e)
            finally:
                t1 = time.perf_counter_ns()
                if paused:
                    gc.enable()
            if bodies:
                peak = max(peak, live + fn.extra_bytes)
            live += self._store(vals, outs, res) - self._free_written(vals, free, res)
            peak = max(peak, live)
            if self.profiling:
                self._profile_step(k, st, args, res, t0, t1, constants, splits, (before, live, peak))
                for b in bodies:  # the body's nodes, named under this node
                    for e in b.plan.profile:
                        e.name = f"{self.profile[-1].name}/{e.name}"
                    self.profile.extend(b.plan.profile)
                    b.plan.profile.clear()
            for s in free:
                if vals[s] is not None:
                    live -= nbytes(vals[s])
                    vals[s] = None
        return peak

    def _end_full_profile(self) -> None:
        """Stop tracing this plan's runs once its profile holds :data:`MAX_PROFILE_EVENTS` events (a warning
        says so), as onnxruntime's profiler stops recording at that many."""
        self.profiling = False
        from onnxtrain.user_warning import warn

        warn(f"SessionOptions.enable_profiling: a graph's profile reached {MAX_PROFILE_EVENTS:,} events; its "
             "later runs are not traced (onnxruntime's profiler stops recording there too); end_profiling() "
             "writes the trace")

    def _constant_slots(self) -> frozenset[int]:
        """Slots of the values no run can feed (initializers that are no graph input, folded constants):
        a profile counts their bytes as a node's ``parameter_size``, as onnxruntime counts constant inputs."""
        fed = set(self.all_input_names)
        return frozenset([self.slot[n] for n in self.initializers if n not in fed]
                         + [s for s, _ in self._const_values])

    def _profile_step(self, k: int, st: Step, args: Sequence[Any], res: Sequence[Any], t0: int, t1: int,
                      constants: frozenset[int], splits: list[int], memory: tuple[int, int, int]) -> None:
        """Append step ``k``'s :class:`ProfileEvent`: its inputs and outputs, their bytes, the bytes of live
        tensors before and after it (``memory``: before, after, the run's peak so far) and its threads."""
        results = [r for r in res if r is not None and not isinstance(r, list)]
        tensors = [(s, a) for s, a in zip(st.inputs, args) if a is not None and not isinstance(a, list)]
        parameters = sum(nbytes(a) for s, a in tensors if s in constants)
        before, after, peak = memory
        caller = str(threading.get_native_id())
        threads = {
            "main_thread": {"thread_pool_name": "onnxtrain-intra-op", "thread_id": caller,
                            "core": caller_cpu(), "splits": splits},
            "sub_threads": {str(t): {"core": c} for t, c in worker_threads().items()},
        }
        self.profile.append(
            ProfileEvent(
                st.node.name or f"{st.node.op_type}_{k}",  # an unnamed node as onnxruntime names it
                st.node.op_type,
                t0,
                t1 - t0,
                [_typed_shape(a) for _, a in tensors],
                outputs=[_typed_shape(r) for r in results],
                output_bytes=sum(nbytes(r) for r in results),
                index=k,
                stats={"activation_size": str(sum(nbytes(a) for _, a in tensors) - parameters),
                       "parameter_size": str(parameters),
                       "mem_bytes_in_use": str(after), "mem_in_use_delta": str(after - before),
                       "mem_in_use_peak": str(peak), "thread_scheduling_stats": threads},
            )
        )


def nbytes(v: Any) -> int:
    """Bytes held by a value: an array, a sequence of arrays, or None (an empty optional); a sequence of maps
    (ZipMap's dicts) is not counted."""
    if isinstance(v, np.ndarray):
        return v.nbytes
    if isinstance(v, (list, tuple)):
        return sum(map(nbytes, v)) if v and not isinstance(v[0], dict) else 0
    return int(getattr(v, "nbytes", 0))


def _typed_shape(v: Any) -> dict[str, list[int]]:
    """A tensor's element type and shape as onnxruntime's profile writes them (``{"float": [2, 3]}``: ONNX's
    type name; it leaves sequences out, and so do the callers)."""
    dtype = np.asarray(v).dtype if not hasattr(v, "dtype") else v.dtype
    elem = onnx.TensorProto.STRING if dtype.kind in "OUS" else onnx.helper.np_dtype_to_tensor_dtype(dtype)
    return {TENSOR_TYPE_STRINGS[elem][len("tensor("):-1]: list(np.shape(v))}


def _as_array(v: Any) -> Any:
    return v if isinstance(v, np.ndarray) or v is None or isinstance(v, list) else np.asarray(v)


def _describe(v: Any) -> str:
    if v is None:
        return "None"
    if isinstance(v, np.ndarray) or np.isscalar(v):
        a = np.asarray(v)
        return f"{a.dtype}{list(a.shape)}"
    return type(v).__name__


def compile_model(model: onnx.ModelProto | str | bytes, **kw: Any) -> Plan:
    """Compile ``model`` (a ModelProto, a path or bytes) into a :class:`Plan`."""
    return Plan(model, **kw)


_OUTPUT_LISTS_KEPT = 64  # lists of output names a plan remembers the slots of (Plan._outputs_of)
_TERMINATED = "Exiting due to terminate flag being set to true (RunOptions.terminate), before node {!r}"
FUSED_DOMAIN = "onnxtrain.fused"  # the domain of the nodes the fusions make for their steps
FUSED_FROM = "fused from: "  # how such a node's doc_string starts: the graph nodes the step runs, in order


def fused_doc(labels: Sequence[str]) -> str:
    """The doc_string of a fused step's node that runs the graph's nodes ``labels`` (their names; an unnamed
    one: its op), in order: a JSON list, as a name may hold any character (', ' too)."""
    return FUSED_FROM + json.dumps(list(labels), ensure_ascii=False)


def fused_members(node: onnx.NodeProto) -> list[str] | None:
    """The names (an unnamed one: its op) of the graph's nodes that a fused step's ``node`` runs, in order
    (:func:`fused_doc`); None for a node of the graph."""
    if node.domain != FUSED_DOMAIN or not node.doc_string.startswith(FUSED_FROM):
        return None
    return json.loads(node.doc_string[len(FUSED_FROM):])


EXPANDED_SUM = "an Add of Sum: "  # how the doc_string of an Add that expand_sums makes of a Sum starts


def expanded_sum_doc(node: onnx.NodeProto, summed: Sequence[str]) -> str:
    """The doc_string of an Add that ``expand_sums`` makes of the Sum ``node``, adding its next input to the
    sum of its inputs ``summed``: what names the Sum when the Add fails or a run stops before it."""
    return EXPANDED_SUM + json.dumps([node.name, node.output[0] if node.output else "", " + ".join(summed)])


def expanded_sum(node: onnx.NodeProto) -> tuple[str, str, str] | None:
    """For an Add that ``expand_sums`` made of a Sum: the Sum's name, its output and the inputs summed
    before the Add's second (``"a + b"``); None for any other node."""
    if node.op_type != "Add" or not node.doc_string.startswith(EXPANDED_SUM):
        return None
    try:  # (a graph's own Add may carry any doc_string, this prefix too: it is then that Add)
        found = json.loads(node.doc_string[len(EXPANDED_SUM):])
    except ValueError:
        return None
    if not (isinstance(found, list) and len(found) == 3 and all(isinstance(x, str) for x in found)):
        return None
    name, made, summed = found
    return name, made, summed


def graph_label(node: onnx.NodeProto) -> str:
    """The name of the graph's node that a step's (unfused) ``node`` runs (an unnamed one: its op): the Sum,
    for one of the Adds expand_sums made of it."""
    origin = expanded_sum(node)
    if origin is not None:
        return origin[0] or "Sum"
    return node.name or node.op_type


def _next_node(node: onnx.NodeProto) -> str:
    """The node of the graph that a step runs first (a fused step's first member), for a stopped run's
    message: a fused step's own name ('FusedElementwise(...)') is no node of the model, nor is an Add that
    expand_sums made of a Sum."""
    members = fused_members(node)
    return members[0] if members else graph_label(node)


def _ranks_of(model: onnx.ModelProto) -> Callable[[str], int | None]:
    """A value's rank from shape inference, computed on first use (old-opset forms only ask)."""
    known: dict[str, int] = {}

    def rank(name: str) -> int | None:
        if not known:
            from onnxtrain.ir.builder import quiet_value_types

            for n, tp in quiet_value_types(model).items():
                if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
                    known[n] = len(tp.tensor_type.shape.dim)
            known.setdefault("", -1)  # (computed)
        return known.get(name)

    return rank

"""torch's ModuleInfo samples exported to ONNX, for the differential tests of ``test_torch_moduledb.py``.

torch's ``module_db`` lists, per ``torch.nn`` module class, samples made for its own tests: constructor
arguments and forward inputs (``module_inputs_func``), for training and for eval. Here one sample becomes a
module built under a fixed seed, in float64, put in training or eval mode (a Lazy* module is materialised by
one forward first), wrapped so that the forward's tensors (lists and tuples included) are graph inputs and
everything else stays a constant. The TorchScript exporter (``dynamo=False``, opset 17, no constant folding,
``TrainingMode.TRAINING`` for training samples; an eval module is exported as it is, under a wrapper marked
training, since an eval export merges parameters of equal values into one initializer) writes the module's
parameters as initializers under their names (``m.<name>``). Where the exporter refuses the float64 sample
and writes the float32 one (a float64 attention mask), the case runs in float32.

``check`` runs the export on onnxtrain's engine against torch's outputs, then differentiates the weighted sum
Σᵢ sum(outᵢ·wᵢ) (fixed random wᵢ, appended to the export) with ``build_gradient_model`` with respect to every
parameter in the export and every float input torch differentiates, and compares those gradients with
``torch.autograd.grad`` (the gradient graph must pass ``onnx.checker``'s full check). The classification
follows ``opinfo_exports.py``: ``export`` (torch cannot export the sample, the export is not valid ONNX, or
onnxruntime, run on the float32 export where it has no float64 kernel, computes it as onnxtrain does and
torch differs), ``documented`` (a difference the README lists), ``refused``/``disagrees`` (onnxtrain's
fault) and ``agrees``. Where torch's gradient and onnxtrain's differ, central differences of onnxtrain's
float64 forward (over at most ``FD_LIMIT`` elements of each tensor) tell whose it is.
"""

from __future__ import annotations

import copy
import functools
import io
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from tests.autodiff import opinfo_exports as opinfo
from tests.autodiff.opinfo_exports import Outcome

SEED = 1234
OPSET = 17
FD_LIMIT = 200  # elements of a tensor differentiated by finite differences when torch and onnxtrain disagree

# modules whose export of an input of that rank (no batch dim) kills the process: never exported
EXPORT_ABORTS = {"nn.CircularPad2d": 3, "nn.CircularPad3d": 4}

# module_db entries not exported, and why
SKIPPED = {
    "nn.FractionalMaxPool2d": "random pooling regions, drawn afresh on every call",
    "nn.FractionalMaxPool3d": "random pooling regions, drawn afresh on every call",
}


@functools.cache
def module_db() -> dict[str, Any]:
    """torch's ModuleInfos by name (``nn.Conv2d``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_modules import module_db as db
    return {m.name: m for m in db}


def modes(name: str) -> tuple[bool, ...]:
    """The modes whose samples run: training always; eval too where torch says the module's behaviour
    differs (norms, attention, recurrent layers), since the others' samples and functions are the same."""
    return (True, False) if module_db()[name].train_and_eval_differ else (True,)


@functools.cache
def samples(name: str, training: bool) -> tuple[Any, ...]:
    """The module's float64 samples on the CPU in that mode, drawn under a fixed seed."""
    info = module_db()[name]
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tuple(info.module_inputs_func(info, device="cpu", dtype=torch.float64, requires_grad=True,
                                             training=training))


def case_id(name: str, training: bool, index: int) -> str:
    """A case's pytest id: module, mode, sample index and torch's description of the sample."""
    desc = samples(name, training)[index].desc
    return f"{name[3:]}-{'train' if training else 'eval'}-{index}" + (f"-{desc}" if desc else "")


def cases() -> Iterator[tuple[str, bool, int]]:
    """Every (module, training, sample index) of module_db, the SKIPPED modules left out."""
    for name in module_db():
        if name in SKIPPED:
            continue
        for training in modes(name):
            for index in range(len(samples(name, training))):
                yield name, training, index


def _flat(value: Any) -> list[torch.Tensor]:
    """The tensors of a module's output, nested tuples flattened, Nones dropped."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat(v)]
    return [value] if isinstance(value, torch.Tensor) else []


class Wrapped(torch.nn.Module):
    """The sample's module called on the sample's forward arguments, its tensors taken as the forward's
    arguments; the output tensors flattened to a tuple."""

    def __init__(self, module: torch.nn.Module, structure: tuple[Any, Any]) -> None:
        super().__init__()
        self.m = module
        self.structure = structure

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = opinfo._join(self.structure, tensors)
        return tuple(_flat(self.m(*args, **kwargs)))


class ExportFailed(Exception):
    """torch could not run or export the sample (or it is random)."""


@dataclass
class Case:
    """One sample's module and inputs in float64, its export and torch's outputs."""

    name: str
    training: bool
    index: int
    wrapped: Wrapped  # in its state before any forward (running statistics untouched)
    tensors: list[torch.Tensor]
    ex: opinfo.Export  # model, feeds, expected outputs, names
    params: list[str]  # parameters that require a gradient, by name in the wrapper (``m.weight``)
    dtype: torch.dtype = torch.float64


def _fresh(wrapped: Wrapped) -> Wrapped:
    """A copy to run (a training forward updates running statistics)."""
    return copy.deepcopy(wrapped)


def _export_bytes(wrapped: Wrapped, tensors: Sequence[torch.Tensor], training: bool,
                  n_out: int) -> bytes:
    buffer = io.BytesIO()
    model = _fresh(wrapped)
    if training:
        mode = torch.onnx.TrainingMode.TRAINING
    else:
        # the module in eval mode as it is (PRESERVE), the wrapper marked training: an eval-mode export
        # merges parameters of equal values (a LayerNorm's ones and zeros) into one initializer
        mode = torch.onnx.TrainingMode.PRESERVE
        model.training = True
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, tuple(t.detach() for t in tensors), buffer, dynamo=False,
                          opset_version=OPSET, input_names=[f"in{i}" for i in range(len(tensors))],
                          output_names=[f"out{i}" for i in range(n_out)], training=mode,
                          do_constant_folding=False)
    return buffer.getvalue()


@functools.cache
def build(name: str, training: bool, index: int, dtype: torch.dtype = torch.float64) -> Case:
    """Sample ``index`` of ``name`` in that mode, built in ``dtype`` and exported (cached in this process)."""
    info = module_db()[name]
    one = samples(name, training)[index]
    tensors: list[torch.Tensor] = []
    structure = opinfo._split((tuple(one.forward_input.args), dict(one.forward_input.kwargs)), tensors)
    # leaves of their own (torch makes some inputs by ops on a leaf: log-probabilities)
    tensors = [(t.detach().to(dtype) if t.is_floating_point() else t.detach()).clone()
               .requires_grad_(t.requires_grad) for t in tensors]
    if any(t.is_complex() or t.layout != torch.strided for t in tensors):
        raise ExportFailed("complex or sparse tensor input")
    if name in EXPORT_ABORTS and tensors[0].dim() == EXPORT_ABORTS[name]:
        raise ExportFailed("torch's exporter aborts the process on it (free(): invalid pointer)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.manual_seed(SEED)
            module = info.module_cls(*one.constructor_input.args, **one.constructor_input.kwargs)
            module = module.to(dtype).train(training)
            wrapped = Wrapped(module, structure)
            if info.is_lazy:  # its parameters take their shapes from the first forward
                with torch.no_grad():
                    wrapped(*tensors)
            with torch.no_grad():
                outputs = list(_fresh(wrapped)(*tensors))
                torch.manual_seed(SEED + 1)
                again = list(_fresh(wrapped)(*tensors))
    except Exception as e:  # noqa: BLE001 - torch's own sample fails: nothing to compare
        raise ExportFailed(f"torch runs the sample: {type(e).__name__}: {str(e)[:200]}") from e
    if not outputs:
        raise ExportFailed("no tensor output")
    if any(not torch.equal(a.nan_to_num(), b.nan_to_num()) for a, b in zip(outputs, again)):
        raise ExportFailed("random: two runs of the module differ (dropout in training)")
    if any(o.is_complex() or o.layout != torch.strided for o in outputs):
        raise ExportFailed("complex or sparse output")
    try:
        data = _export_bytes(wrapped, tensors, training, len(outputs))
    except Exception as e:  # noqa: BLE001 - torch's exporter refuses the module or the sample
        raise ExportFailed(f"torch.onnx.export: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
    graph_inputs = {i.name for i in onnx.load_from_string(data).graph.input}
    input_names = [f"in{i}" for i in range(len(tensors))]
    feeds = {n: opinfo._numpy(t) for n, t in zip(input_names, tensors) if n in graph_inputs}
    ex = opinfo.Export(data, feeds, tensors, [opinfo._numpy(o) for o in outputs], wrapped, input_names,
                       [f"out{i}" for i in range(len(outputs))])
    params = [n for n, p in wrapped.named_parameters() if p.requires_grad]
    return Case(name, training, index, wrapped, tensors, ex, params, dtype)


def _onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | str:
    """onnxruntime's outputs (CPU, no graph optimizations that change numerics), or its error."""
    import onnxruntime

    try:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        sess = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"],
                                            disabled_optimizers=["ConstantSharing"])
        return sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - reported as onnxruntime's error
        return f"onnxruntime: {type(e).__name__}: {str(e)[:200]}"


@functools.cache
def _float32_export(name: str, training: bool, index: int) -> bytes | None:
    """The same module and sample exported in float32 (onnxruntime lacks float64 kernels of many ops)."""
    case = build(name, training, index)
    tensors = [t.float() if t.dtype == torch.float64 else t for t in case.tensors]
    try:
        return _export_bytes(_fresh(case.wrapped).float(), tensors, training, len(case.ex.expected))
    except Exception:  # noqa: BLE001 - no second opinion then
        return None


def second_opinion(case: Case, model: bytes | None = None,
                   float32_model: bytes | None = None) -> tuple[list[np.ndarray] | None, bool]:
    """onnxruntime's outputs of ``model`` (default: the export) and whether they are of the float32 export
    fed the float64 sample's values (where it has no float64 kernel); None if it runs neither."""
    model = case.ex.model if model is None else model
    ort = _onnxruntime(model, case.ex.feeds)
    if not isinstance(ort, str):
        return ort, False
    if case.dtype != torch.float64:
        return None, False
    single = float32_model if float32_model is not None else _float32_export(case.name, case.training,
                                                                              case.index)
    if single is None:
        return None, False
    feeds = {n: v.astype(np.float32) if v.dtype == np.float64 else v for n, v in case.ex.feeds.items()}
    got = _onnxruntime(single, feeds)
    return (None, False) if isinstance(got, str) else (got, True)


def check_forward(case: Case) -> Outcome:
    """The export's outputs on onnxtrain against torch's (onnxruntime telling an export fault apart)."""
    import onnxtrain

    ex = case.ex
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = onnxtrain.InferenceSession(ex.model).run(None, ex.feeds)
    except Exception as e:  # noqa: BLE001 - classified below
        invalid = opinfo._invalid(ex.model)
        if invalid:
            return Outcome("export", f"the export is not valid ONNX: {invalid}")
        ort, _ = second_opinion(case)
        if ort is None:
            return Outcome("export", f"no runtime runs the export: onnxtrain: {type(e).__name__}: "
                                     f"{str(e)[:200]}")
        kind = "refused" if opinfo._refusal(e) else "disagrees"
        return Outcome(kind, f"onnxtrain: {type(e).__name__}: {str(e)[:300]}")
    if len(got) != len(ex.expected):
        return Outcome("export", f"the export has {len(got)} outputs, torch's module {len(ex.expected)}")
    problems, worst = [], 0.0
    ort: list[np.ndarray] | None = None
    single = False
    for i, (a, b) in enumerate(zip(got, ex.expected)):
        ok, why, ratio = opinfo.compare(a, b)
        worst = max(worst, ratio)
        if ok:
            continue
        if ort is None:
            ort, single = second_opinion(case)
        low = np.float32 if b.dtype == np.float64 else None
        if a.dtype == np.float32 and low and opinfo.compare(a, b, low)[0]:
            return Outcome("export", f"out{i}: the export computes it in float32 (a 0-dim value), torch in "
                                     f"float64 ({why})")
        if ort is not None and not opinfo.compare(ort[i], b, low if single else None)[0] and opinfo.compare(
                a, ort[i], low)[0]:
            return Outcome("export", f"out{i}: onnxruntime{' (float32 export)' if single else ''} computes "
                                     f"the export as onnxtrain does, torch differs ({why})")
        problems.append(f"out{i}: {why}" + ("" if ort is not None else " (onnxruntime cannot run it)"))
    if problems:
        invalid = opinfo._invalid(ex.model)
        if invalid:
            return Outcome("export", f"the export is not valid ONNX: {invalid}")
        known = opinfo._documented(ex, got, [str(w.message) for w in caught]) or _float32_constants(ex, got)
        if known:
            return Outcome("documented", f"{known}: {'; '.join(problems)}", worst)
        return Outcome("disagrees", "; ".join(problems), worst)
    return Outcome("agrees", worst=worst)


def _float32_constants(ex: opinfo.Export, got: list[np.ndarray]) -> str:
    """The README's entry (a float64 export keeps float32 where ONNX's attributes are float32: SELU's alpha
    and gamma, HardSigmoid's 1/6, which HardSwish's definition shares) when the export has an op with a
    float attribute and its outputs are torch's to float32 precision."""
    ops = {n.op_type for n in onnx.load_from_string(ex.model).graph.node if _float_attributes(n.op_type)}
    if ops and all(opinfo.compare(a, b, np.float32)[0] for a, b in zip(got, ex.expected)):
        return f"README: a float64 export keeps ONNX's float32 attributes ({', '.join(sorted(ops))})"
    return ""


@functools.cache
def _float_attributes(op: str) -> bool:
    """Whether the default-domain op has a float attribute (or is HardSwish: 1/6 by definition)."""
    try:
        schema = onnx.defs.get_schema(op, OPSET)
    except Exception:  # noqa: BLE001 - not a default-domain op
        return False
    return op == "HardSwish" or any(a.type == onnx.AttributeProto.FLOAT for a in schema.attributes.values())


def torch_gradients(case: Case, weights: list[np.ndarray], used: list[int]) -> dict[str, np.ndarray | None]:
    """torch.autograd's gradients of Σ sum(outᵢ·wᵢ) w.r.t. the parameters (``m.<name>``) and the float
    inputs that require one (``in<k>``); None where the loss does not reach them."""
    wrapped = _fresh(case.wrapped)
    leaves = [t.detach().clone().requires_grad_(t.requires_grad and t.is_floating_point())
              for t in case.tensors]
    outs = wrapped(*leaves)
    loss = sum((outs[i] * torch.from_numpy(weights[i])).sum() for i in used)
    named = dict(wrapped.named_parameters())
    wanted = [(n, named[n]) for n in case.params]
    wanted += [(f"in{k}", t) for k, t in enumerate(leaves) if t.requires_grad]
    if not wanted or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return {}
    grads = torch.autograd.grad(loss, [t for _, t in wanted], allow_unused=True)
    return {n: (None if g is None else g.detach().numpy().copy()) for (n, _), g in zip(wanted, grads)}


def _as_inputs(model: onnx.ModelProto, names: Sequence[str]) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of ``model`` whose initializers ``names`` are graph inputs, and their values."""
    model = copy.deepcopy(model)
    values = {}
    keep = []
    for t in model.graph.initializer:
        if t.name in names:
            values[t.name] = numpy_helper.to_array(t)
            model.graph.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        else:
            keep.append(t)
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    return model, values


def finite_differences(case: Case, model: onnx.ModelProto, name: str,
                       step: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Central differences of the loss (the last output of ``model``) w.r.t. at most FD_LIMIT elements of
    the input or initializer ``name``, through onnxtrain's float64 forward: (flat indices, values)."""
    import onnxtrain

    model, values = _as_inputs(model, [name])
    feeds = {**case.ex.feeds, **values}
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    last = len(model.graph.output) - 1
    x = feeds[name].astype(np.float64)
    picks = np.arange(x.size)
    if x.size > FD_LIMIT:
        picks = np.sort(np.random.default_rng(SEED).choice(x.size, FD_LIMIT, replace=False))
    out = np.zeros(len(picks))
    for j, flat in enumerate(picks):
        vals = []
        for s in (step, -step):
            xp = x.copy().reshape(-1)
            xp[flat] += s
            vals.append(float(sess.run(None, {**feeds, name: xp.reshape(x.shape)})[last]))
        out[j] = (vals[0] - vals[1]) / (2 * step)
    return picks, out


def check_gradients(case: Case) -> Outcome:
    """onnxtrain's gradient graph of the weighted sum against torch.autograd's gradients."""
    from onnxtrain.autodiff import build_gradient_model

    ex = case.ex
    invalid = opinfo._invalid(ex.model)
    if invalid:  # the gradient graph could not pass the full check
        return Outcome("export", f"the export is not valid ONNX: {invalid}")
    wrong = opinfo._misdeclared(ex)
    if wrong:  # the gradient graph takes declared dims at their word
        return Outcome("export", wrong)
    weights = opinfo._weights(ex)
    model, used = loss_model(ex, weights)
    if not used:
        return Outcome("export", "no float output of the sample's type to differentiate (the export computes "
                                 "in float32)")
    try:
        want = torch_gradients(case, weights, used)
    except Exception as e:  # noqa: BLE001 - torch's own backward fails
        return Outcome("export", f"torch.autograd: {type(e).__name__}: {str(e)[:200]}")
    inits = {t.name for t in model.graph.initializer}
    missing = [n for n in case.params if n not in inits and want.get(n) is not None and np.any(want[n])]
    if missing:
        return Outcome("export", f"parameters torch differentiates are not initializers of the export: "
                                 f"{missing}")
    wrt = [n for n in case.params if n in inits and want.get(n) is not None]
    wrt += [n for n, g in want.items() if n.startswith("in") and g is not None and n in ex.feeds]
    if not wrt:
        return Outcome("agrees", "torch differentiates nothing the export takes")
    while True:
        try:
            gmodel = build_gradient_model(model, "loss", wrt)
            break
        except Exception as e:  # noqa: BLE001 - classified below
            # an x the ONNX graph does not differentiate must have torch's zeros
            cut = [n for n in wrt if f"'{n}'" in str(e) and opinfo.UNREACHED.search(str(e))]
            if not cut or any(np.any(want[n]) for n in cut):
                kind = "refused" if opinfo._refusal(e) else "disagrees"
                return Outcome(kind, f"build_gradient_model: {type(e).__name__}: {str(e)[:300]}")
            wrt = [n for n in wrt if n not in cut]
            if not wrt:
                return Outcome("agrees", "no gradient reaches the inputs: torch's are zeros")
    return _compare_gradients(case, model, gmodel, wrt, want)


def _compare_gradients(case: Case, model: onnx.ModelProto, gmodel: onnx.ModelProto, wrt: list[str],
                       want: dict[str, Any]) -> Outcome:
    import onnxtrain

    try:
        onnx.checker.check_model(gmodel, full_check=True)
    except Exception as e:  # noqa: BLE001
        return Outcome("disagrees", f"check_model(full_check=True) of the gradient graph: {str(e)[:300]}")
    feeds = {i.name: case.ex.feeds[i.name] for i in gmodel.graph.input if i.name in case.ex.feeds}
    names = [o.name for o in gmodel.graph.output]
    data = gmodel.SerializeToString()
    try:
        got = dict(zip(names, onnxtrain.InferenceSession(data).run(None, feeds)))
    except Exception as e:  # noqa: BLE001
        kind = "refused" if opinfo._refusal(e) else "disagrees"
        return Outcome(kind, f"onnxtrain running the gradient graph: {type(e).__name__}: {str(e)[:300]}")
    problems, worst, off = [], 0.0, []
    for name, expected in zip(case.ex.output_names, case.ex.expected):
        if name in got and not opinfo.compare(got[name], expected)[0]:
            problems.append(f"{name}: the gradient graph's forward differs from torch")
    tol = (1e-7, 1e-9) if case.dtype == torch.float64 else (1e-4, 1e-5)
    for n in wrt:
        ok, ratio = opinfo.grad_close(got[f"{n}_grad"], want[n], *tol)
        worst = max(worst, ratio)
        if not ok:
            off.append(n)
            problems.append(f"{n}_grad: tolerance ratio {ratio:.3g}")
    if not problems:
        return Outcome("agrees", worst=worst)
    if len(off) == len(problems) and case.dtype == torch.float64:
        # torch's gradient may not be the derivative of what it computes (a convention): finite differences
        # of the forward decide; onnxruntime's run of the gradient graph is a second opinion
        fd = {n: finite_differences(case, model, n) for n in off}
        ours = all(_fd_close(got[f"{n}_grad"].reshape(-1)[i], v) for n, (i, v) in fd.items())
        theirs = any(_fd_close(np.asarray(want[n]).reshape(-1)[i], v) for n, (i, v) in fd.items())
        if ours and not theirs:
            return Outcome("agrees", f"torch's gradient is not the derivative; onnxtrain's is finite "
                                     f"differences' ({off})", worst, {"torch_convention": off})
        if all(np.isnan(v).all() for _, v in fd.values()):
            # (torch's KLDivLoss samples take the log of negative numbers: the export's Where(target > 0)
            # and torch's xlogy differ only where both forwards are NaN)
            return Outcome("export", f"the loss is NaN (the sample's inputs are): the forward cannot tell "
                                     f"the export's function from torch's ({'; '.join(problems)})", worst)
    return Outcome("disagrees", "; ".join(problems), worst, {"got": got, "want": want})


def _fd_close(grad: np.ndarray, fd: np.ndarray) -> bool:
    return bool(np.allclose(grad, fd, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(fd).max(initial=0)))))


def check(name: str, training: bool, index: int) -> dict[str, Outcome]:
    """The forward's and the gradients' outcomes of one sample: in float64, or in float32 where torch's
    exporter refuses the float64 sample only (a float64 attention mask)."""
    try:
        case = build(name, training, index)
    except ExportFailed as e:
        if not str(e).startswith("torch.onnx.export"):
            return {"forward": Outcome("export", str(e))}
        try:
            case = build(name, training, index, torch.float32)
        except ExportFailed:
            return {"forward": Outcome("export", str(e))}
    outcomes = {"forward": check_forward(case)}
    if outcomes["forward"].kind == "agrees":
        outcomes["gradients"] = check_gradients(case)
    for o in outcomes.values():
        o.extra["dtype"] = str(case.dtype).removeprefix("torch.")
    return outcomes


def loss_model(ex: opinfo.Export, weights: list[np.ndarray]) -> tuple[onnx.ModelProto, list[int]]:
    """The export with a scalar ``loss`` = Σᵢ sum(outᵢ·wᵢ) over its outputs of the sample's float type
    (their indexes returned), as ``opinfo_exports.loss_model`` for float64 and float32."""
    model = onnx.load_from_string(ex.model)
    floats = [e.dtype for e in ex.expected if e.dtype.kind == "f"]
    dtype = np.float64 if np.float64 in floats or not floats else np.float32
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    types = [o.type.tensor_type.elem_type for o in model.graph.output]
    used = [i for i, e in enumerate(ex.expected) if e.dtype == dtype and types[i] == elem]
    terms = []
    for i in used:
        w = f"moduledb_w{i}"
        model.graph.initializer.append(numpy_helper.from_array(weights[i], w))
        model.graph.node.extend([
            onnx.helper.make_node("Mul", [ex.output_names[i], w], [f"moduledb_p{i}"]),
            onnx.helper.make_node("ReduceSum", [f"moduledb_p{i}"], [f"moduledb_s{i}"], keepdims=0),
        ])
        terms.append(f"moduledb_s{i}")
    if terms:
        model.graph.node.append(onnx.helper.make_node("Sum", terms, ["loss"]))
        model.graph.output.append(onnx.helper.make_tensor_value_info("loss", elem, []))
    return model, used

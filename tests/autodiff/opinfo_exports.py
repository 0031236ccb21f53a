"""torch's OpInfo samples exported to ONNX, for the differential tests of ``test_torch_opinfo.py``.

torch's ``op_db`` lists, per op, sample calls (``op(sample.input, *sample.args, **sample.kwargs)``) made for
its own tests. Here one sample becomes a ``torch.nn.Module`` whose tensors (the input, and any tensor among
the args and kwargs, lists included) are graph inputs and whose other arguments stay constants; the
TorchScript exporter (``dynamo=False``) writes it at a chosen opset. ``check_forward`` compares
``onnxtrain.InferenceSession``'s outputs with torch's, and with onnxruntime's to tell an export problem from
an onnxtrain one (onnx.reference stands in where onnxruntime has no kernel); ``check_gradients`` compares
the gradient graph of Σᵢ sum(outᵢ·wᵢ) (``GradientGraphBuilder``, fixed random weights) with
``torch.autograd.grad`` in float64. Both return an ``Outcome`` whose ``kind`` is one of four classes:
``export`` (torch cannot export the sample, the export is not valid ONNX, or it computes something else than
torch: the second runtime disagrees with torch as onnxtrain does), ``refused`` (onnxtrain refuses the op with
an error naming it), ``agrees`` or ``disagrees``.
"""

from __future__ import annotations

import functools
import io
import itertools
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

# ops whose output is random or uninitialized memory (multi_head_attention_forward's samples train with
# dropout 0.5)
NONDETERMINISTIC = re.compile(
    r"(^|\.)(rand|randn|randint|rand_like|randn_like|randint_like|bernoulli|multinomial|normal|uniform|cauchy|"
    r"exponential|geometric|log_normal|empty|empty_like|new_empty|new_empty_strided|empty_strided|"
    r"empty_permuted|rrelu|fractional_max_pool2d|fractional_max_pool3d|svd_lowrank|pca_lowrank|"
    r"hash_tensor|multi_head_attention_forward)$|dropout"
)

SEED = 1234

# samples whose export kills the process (torch's TorchScript exporter divides an integer by zero: SIGFPE),
# never exported here: all of im2col's, and those of these ops with an empty tensor
EXPORT_CRASHES = {"nn.functional.unfold"}
EMPTY_EXPORT_CRASHES = {"nn.functional.group_norm", "take", "nn.functional.pixel_unshuffle"}


@functools.cache
def op_db() -> dict[str, Any]:
    """torch's OpInfos by ``name`` or ``name.variant`` (the names pytest ids use)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db as db
    return {op_key(o): o for o in db}


def op_key(info: Any) -> str:
    """An OpInfo's name, with its variant after a dot."""
    return info.name + (f".{info.variant_test_name}" if info.variant_test_name else "")


def deterministic(key: str) -> bool:
    """Whether the op's output is a function of its inputs (not random, not uninitialized memory)."""
    return NONDETERMINISTIC.search(op_db()[key].name) is None


@functools.cache
def samples(key: str, dtype: torch.dtype, requires_grad: bool = False,
            count: int | None = None) -> tuple[Any, ...]:
    """The op's first ``count`` (default: all) sample inputs for ``dtype`` on the CPU, drawn under a fixed
    seed (the same every call; torch makes each sample slowly: the tests take only those they need)."""
    torch.manual_seed(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = op_db()[key].sample_inputs("cpu", dtype, requires_grad=requires_grad)
        return tuple(itertools.islice(made, count))


def sample(key: str, dtype: torch.dtype, index: int, requires_grad: bool = False) -> Any | None:
    """The op's ``index``-th sample for ``dtype`` (None: it has fewer)."""
    first = samples(key, dtype, requires_grad, index + 1)
    return first[index] if len(first) > index else None


@dataclass
class Outcome:
    """Which class an (op, sample) falls in, and why."""

    kind: str  # "export", "refused", "agrees", "disagrees", "documented" (a difference the README states)
    detail: str = ""
    worst: float = 0.0  # the largest error over the tolerance (disagrees)
    extra: dict[str, Any] = field(default_factory=dict)


class _Slot:
    """Where the i-th graph input goes back into the call's arguments."""

    def __init__(self, index: int) -> None:
        self.index = index


def _split(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a slot (appended to ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (list, tuple)):
        parts = [_split(v, tensors) for v in value]
        return parts if isinstance(value, list) else tuple(parts)
    if isinstance(value, dict):
        return {k: _split(v, tensors) for k, v in value.items()}
    return value


def _join(value: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return tensors[value.index]
    if isinstance(value, (list, tuple)):
        parts = [_join(v, tensors) for v in value]
        return parts if isinstance(value, list) else tuple(parts)
    if isinstance(value, dict):
        return {k: _join(v, tensors) for k, v in value.items()}
    return value


def _flat_outputs(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [o for v in value for o in _flat_outputs(v)]
    return [value]


class SampleModule(torch.nn.Module):
    """``op(input, *args, **kwargs)`` of one sample, its tensors taken as the forward's arguments; the outputs
    flattened to a tuple."""

    def __init__(self, op: Callable[..., Any], structure: tuple[Any, Any, Any]) -> None:
        super().__init__()
        self.op = op
        self.structure = structure

    def forward(self, *tensors: torch.Tensor) -> tuple[Any, ...]:
        first, args, kwargs = _join(self.structure, tensors)
        return tuple(_flat_outputs(self.op(first, *args, **kwargs)))


@dataclass
class Export:
    """One sample's ONNX model, its feeds (by graph input name) and torch's outputs."""

    model: bytes
    feeds: dict[str, np.ndarray]
    tensors: list[torch.Tensor]  # the sample's tensors, in graph input order
    expected: list[np.ndarray]
    module: SampleModule
    input_names: list[str]
    output_names: list[str]


class ExportFailed(Exception):
    """torch could not run or export the sample."""


def _numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.detach().float().numpy().astype(ml_dtypes.bfloat16)
    return t.detach().resolve_conj().resolve_neg().cpu().numpy().copy()


@functools.cache
def export(key: str, dtype: torch.dtype, index: int, opset: int = 17, requires_grad: bool = False) -> Export:
    """The ``index``-th sample of ``key`` in ``dtype`` exported at ``opset`` (cached in this process)."""
    info = op_db()[key]
    one = sample(key, dtype, index, requires_grad)
    if one is None:
        raise ExportFailed(f"no sample {index} in {dtype}")
    tensors: list[torch.Tensor] = []
    structure = _split((one.input, tuple(one.args), dict(one.kwargs)), tensors)
    if key in EXPORT_CRASHES or (key in EMPTY_EXPORT_CRASHES and any(t.numel() == 0 for t in tensors)):
        raise ExportFailed("torch's exporter divides by zero on it (SIGFPE kills the process)")
    if any(t.is_complex() or t.layout != torch.strided or t.is_quantized for t in tensors):
        raise ExportFailed("complex, sparse or quantized tensor input")
    module = SampleModule(info.op, structure)
    try:
        with torch.no_grad():
            outputs = list(module(*tensors))
    except Exception as e:  # noqa: BLE001 - torch's own sample fails: nothing to compare
        raise ExportFailed(f"torch runs the sample: {type(e).__name__}: {e}") from e
    if not outputs or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise ExportFailed("an output is not a tensor")
    if any(o.is_complex() or o.layout != torch.strided for o in outputs):
        raise ExportFailed("complex or sparse output")
    input_names = [f"in{i}" for i in range(len(tensors))]
    output_names = [f"out{i}" for i in range(len(outputs))]
    buffer = io.BytesIO()
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, tuple(t.detach() for t in tensors), buffer, dynamo=False,
                              opset_version=opset, input_names=input_names, output_names=output_names,
                              do_constant_folding=False)
    except Exception as e:  # noqa: BLE001 - torch's exporter refuses the op or the sample
        raise ExportFailed(f"torch.onnx.export: {type(e).__name__}: {str(e).splitlines()[0][:200]}") from e
    data = buffer.getvalue()
    graph_inputs = {i.name for i in onnx.load_from_string(data).graph.input}
    feeds = {n: _numpy(t) for n, t in zip(input_names, tensors) if n in graph_inputs}
    return Export(data, feeds, tensors, [_numpy(o) for o in outputs], module, input_names, output_names)


def _tolerance(dtype: np.dtype) -> tuple[float, float]:
    """(rtol, atol relative to the output's largest magnitude) for a forward comparison."""
    if dtype == np.float64:
        return 1e-9, 1e-11
    if dtype == np.float16 or str(dtype) == "bfloat16":
        return 1e-2, 1e-3
    return 2e-5, 2e-6


def compare(got: np.ndarray, want: np.ndarray, as_type: Any = None) -> tuple[bool, str, float]:
    """Whether an output matches torch's (shape, values; nan where torch has nan), the reason if not and the
    ratio of the worst error to its tolerance. ``as_type``: at that float type's tolerance, not want's."""
    got = np.asarray(got)
    if got.shape != want.shape:
        return False, f"shape {got.shape} vs torch's {want.shape}", np.inf
    if want.dtype.kind in "biu" or want.dtype == np.bool_:
        if got.dtype.kind not in "biuf" and got.dtype != np.bool_:
            return False, f"dtype {got.dtype} vs {want.dtype}", np.inf
        bad = got.astype(np.float64) != want.astype(np.float64)
        if bad.any():
            return False, f"{int(bad.sum())}/{bad.size} elements differ", np.inf
        return True, "", 0.0
    a, b = got.astype(np.float64), want.astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if (nan_a != nan_b).any():
        where = int((nan_a != nan_b).sum())
        return False, f"nan at {where} places where torch has none, or the reverse", np.inf
    a, b = np.where(nan_b, 0.0, a), np.where(nan_b, 0.0, b)
    inf = np.isinf(b)
    if (a[inf] != b[inf]).any():
        return False, "infinities differ", np.inf
    a, b = np.where(inf, 0.0, a), np.where(inf, 0.0, b)
    rtol, atol = _tolerance(np.dtype(as_type or want.dtype))
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    limit = rtol * np.abs(b) + atol * scale
    err = np.abs(a - b)
    ratio = float((err / limit).max()) if b.size else 0.0
    if ratio > 1:
        return False, f"max abs error {float(err.max()):.3g} (tolerance ratio {ratio:.3g})", ratio
    return True, "", ratio


def _run_onnxruntime(model: bytes, feeds: dict[str, np.ndarray]) -> list[np.ndarray] | str:
    """The outputs of plain onnxruntime or, where it cannot run the model (no float64 kernel of many ops),
    of onnx.reference; else both errors."""
    import onnxruntime
    from onnx.reference import ReferenceEvaluator

    try:
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        sess = onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - reported as onnxruntime's error
        ort_error = f"onnxruntime: {type(e).__name__}: {str(e)[:200]}"
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return list(ReferenceEvaluator(onnx.load_from_string(model)).run(None, feeds))
    except Exception as e:  # noqa: BLE001 - reported as onnx.reference's error
        return f"{ort_error}; onnx.reference: {type(e).__name__}: {str(e)[:200]}"


REFUSAL = re.compile(r"not (supported|implemented)|unsupported|no kernel|no gradient rule|no rule|"
                     r"cannot differentiate|not differentiable|a broadcast ONNX's shape inference does not "
                     r"follow", re.I)

# exports whose graph has no derivative where torch's fused op defines one: op → why
EXPORT_CONVENTIONS = {
    "linalg.norm.subgradients_at_zero": "exported as Sqrt(ReduceSum(x·x)), whose derivative at x = 0 is 0·∞ "
                                        "(NaN, as torch's autograd gives for that composition); torch's norm "
                                        "takes the subgradient 0",
}


NO_KERNEL = re.compile(r"Could not find an implementation for|NOT_IMPLEMENTED")
FD_LIMIT = 200  # elements of an input differentiated by finite differences when torch and onnxtrain disagree

# the builder's error for an x the loss does not depend on, or only through ops without a gradient
UNREACHED = re.compile(r"does not depend|no gradient flows back|does not reach", re.I)


@functools.cache
def _invalid(model: bytes) -> str:
    """onnx.checker's objection to an export (full check), or ''."""
    try:
        onnx.checker.check_model(onnx.load_from_string(model), full_check=True)
    except Exception as e:  # noqa: BLE001 - the checker's message is the answer
        return str(e).splitlines()[0][:200]
    return ""


def _refusal(e: BaseException) -> bool:
    """Whether onnxtrain's error is a clear refusal of an op (it names what it does not support)."""
    return isinstance(e, (NotImplementedError, ValueError, TypeError, RuntimeError)) and bool(
        REFUSAL.search(str(e)))


def check_forward(key: str, dtype: torch.dtype, index: int, opset: int = 17,
                  requires_grad: bool = False) -> Outcome:
    """Run one sample's export on onnxtrain and compare with torch (and onnxruntime)."""
    import onnxtrain

    try:
        ex = export(key, dtype, index, opset, requires_grad)
    except ExportFailed as e:
        return Outcome("export", str(e))
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = onnxtrain.InferenceSession(ex.model).run(None, ex.feeds)
    except Exception as e:  # noqa: BLE001 - classified below
        invalid = _invalid(ex.model)
        if invalid:
            return Outcome("export", f"the export is not valid ONNX: {invalid}")
        ort = _run_onnxruntime(ex.model, ex.feeds)
        if isinstance(ort, str):
            return Outcome("export", f"no runtime runs the export: onnxtrain: {type(e).__name__}: "
                                     f"{str(e)[:200]}; {ort}")
        kind = "refused" if _refusal(e) else "disagrees"
        return Outcome(kind, f"onnxtrain: {type(e).__name__}: {str(e)[:300]}")
    ort = _run_onnxruntime(ex.model, ex.feeds)
    problems, worst = [], 0.0
    for name, a, b, i in zip(ex.output_names, got, ex.expected, range(len(got))):
        ok, why, ratio = compare(a, b)
        worst = max(worst, ratio)
        if ok:
            continue
        ort_ok = not isinstance(ort, str) and compare(ort[i], b)[0]
        # both runtimes within float32 rounding of each other and off torch: the export computes in float32
        low = np.float32 if b.dtype == np.float64 else None
        if not ort_ok and not isinstance(ort, str) and compare(a, ort[i], low)[0]:
            return Outcome("export", f"{name}: onnxruntime computes the export as onnxtrain does, torch "
                                     f"differs ({why})")
        single = _float32_onnxruntime(key, index, opset, ex, i) if b.dtype == np.float64 else None
        if single is not None and not compare(single, b, np.float32)[0] and compare(a, single, np.float32)[0]:
            return Outcome("export", f"{name}: onnxruntime computes the float32 export as onnxtrain does the "
                                     f"float64 one, torch differs ({why})")
        other = ort if isinstance(ort, str) else "differs too"
        problems.append(f"{name}: {why}" + ("" if ort_ok else f" (second runtime: {other})"))
    if problems:
        invalid = _invalid(ex.model) if isinstance(ort, str) else ""
        if invalid:
            return Outcome("export", f"the export is not valid ONNX: {invalid}")
        known = _documented(ex, got, [str(w.message) for w in caught])
        if known:
            return Outcome("documented", f"{known}: {'; '.join(problems)}", worst)
        return Outcome("disagrees", "; ".join(problems), worst)
    return Outcome("agrees", worst=worst)


def _misdeclared(ex: Export) -> str:
    """The export's graph output declared with static dims other than torch's output's, or ''."""
    for o, want in zip(onnx.load_from_string(ex.model).graph.output, ex.expected):
        dims = o.type.tensor_type.shape.dim
        if o.type.tensor_type.HasField("shape") and (
                len(dims) != want.ndim
                or any(d.HasField("dim_value") and d.dim_value != n for d, n in zip(dims, want.shape))):
            declared = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]
            return f"the export declares {o.name} as {declared}, torch's is {list(want.shape)}"
    return ""


def _documented(ex: Export, got: list[np.ndarray], messages: list[str]) -> str:
    """The README's entry for a difference from torch that onnxtrain makes on purpose, or ''."""
    if any(m.startswith("Resize with align_corners") for m in messages):
        return "README Limits: Resize with align_corners and scales of a fractional length follows ONNX"
    graph = onnx.load_from_string(ex.model).graph
    means = any(n.op_type == "ReduceMean" for g in [graph, *_bodies(graph)] for n in g.node)
    nan_for_zero = all(np.array_equal(np.isnan(a) & (b == 0), np.isnan(a) != np.isnan(b))
                       for a, b in zip(got, ex.expected) if b.dtype.kind == "f" and a.shape == b.shape)
    if means and nan_for_zero:
        return "README Limits: a ReduceMean over nothing is NaN (torch: 0)"
    return ""


def _bodies(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    """The graphs of ``graph``'s control-flow nodes, nested ones too."""
    found = []
    for n in graph.node:
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                found += [g, *_bodies(g)]
    return found


def _float32_onnxruntime(key: str, index: int, opset: int, ex64: Export, output: int) -> np.ndarray | None:
    """onnxruntime's output ``output`` of the same sample's float32 export fed the float64 sample's values
    (it has no float64 kernel of many ops, and onnx.reference differs from it on some, e.g. AveragePool under
    ceil_mode); None if that fails."""
    import onnxruntime

    try:
        ex = export(key, torch.float32, index, opset)
        feeds = {n: v.astype(np.float32) if v.dtype == np.float64 else v for n, v in ex64.feeds.items()}
        options = onnxruntime.SessionOptions()
        options.log_severity_level = 3
        sess = onnxruntime.InferenceSession(ex.model, options, providers=["CPUExecutionProvider"])
        return sess.run(None, feeds)[output]
    except Exception:  # noqa: BLE001 - no second opinion then
        return None


def differentiable(key: str) -> bool:
    """Whether torch's OpInfo says the op has gradients."""
    return bool(op_db()[key].supports_autograd)


def loss_model(ex: Export, weights: list[np.ndarray]) -> tuple[onnx.ModelProto, list[int]]:
    """The export with a scalar ``loss`` = Σᵢ sum(outᵢ·wᵢ) over its float outputs (their indexes returned)."""
    model = onnx.load_from_string(ex.model)
    types = [o.type.tensor_type.elem_type for o in model.graph.output]
    used = [i for i, e in enumerate(ex.expected) if e.dtype == np.float64 and types[i] == TensorProto.DOUBLE]
    terms = []
    for i in used:
        w = f"opinfo_w{i}"
        model.graph.initializer.append(numpy_helper.from_array(weights[i], w))
        model.graph.node.extend([
            helper.make_node("Mul", [ex.output_names[i], w], [f"opinfo_p{i}"]),
            helper.make_node("ReduceSum", [f"opinfo_p{i}"], [f"opinfo_s{i}"], keepdims=0),
        ])
        terms.append(f"opinfo_s{i}")
    model.graph.node.append(helper.make_node("Sum", terms, ["loss"]))
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []))
    return model, used


def _weights(ex: Export) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    return [rng.uniform(0.5, 1.5, e.shape).astype(e.dtype) if e.dtype.kind == "f" else e for e in ex.expected]


def torch_gradients(ex: Export, weights: list[np.ndarray], used: list[int]) -> dict[str, np.ndarray | None]:
    """torch.autograd's gradients of the same loss w.r.t. the sample's float tensors (None: not reached)."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in ex.tensors]
    outs = ex.module(*leaves)
    loss = sum((outs[i] * torch.from_numpy(weights[i])).sum() for i in used)
    wanted = [(n, t) for n, t in zip(ex.input_names, leaves) if t.requires_grad and t.dtype == torch.float64]
    if not wanted or not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return {}
    grads = torch.autograd.grad(loss, [t for _, t in wanted], allow_unused=True)
    return {n: (None if g is None else g.numpy().copy()) for (n, _), g in zip(wanted, grads)}


def grad_close(got: np.ndarray, want: np.ndarray, rtol: float = 1e-7,
               atol: float = 1e-9) -> tuple[bool, float]:
    """float64 gradients equal within rtol, and atol scaled by the gradient's magnitude (nan where torch's
    is); also the worst error's ratio to that tolerance."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if a.shape != b.shape:
        return False, np.inf
    if (np.isnan(a) != np.isnan(b)).any():
        return False, np.inf
    a, b = np.nan_to_num(a, nan=0.0), np.nan_to_num(b, nan=0.0)
    scale = max(1.0, float(np.abs(b).max())) if b.size else 1.0
    ratio = float((np.abs(a - b) / (rtol * np.abs(b) + atol * scale)).max()) if b.size else 0.0
    return ratio <= 1, ratio


def check_gradients(key: str, index: int, opset: int = 17) -> Outcome:
    """Differentiate one float64 sample's export with onnxtrain's GradientGraphBuilder and compare the
    gradients with torch.autograd's; the gradient graph must also pass onnx's full check and run on
    onnxruntime."""
    import onnxtrain

    try:
        ex = export(key, torch.float64, index, opset, True)
    except ExportFailed as e:
        return Outcome("export", str(e))
    invalid = _invalid(ex.model)
    if invalid:  # onnxtrain may run it, but its gradient graph cannot pass the full check
        return Outcome("export", f"the export is not valid ONNX: {invalid}")
    wrong = _misdeclared(ex)
    if wrong:  # the gradient graph takes declared dims at their word
        return Outcome("export", wrong)
    forward = check_forward(key, torch.float64, index, opset, True)
    if forward.kind != "agrees":
        return Outcome(forward.kind, f"forward: {forward.detail}", forward.worst)
    weights = _weights(ex)
    model, used = loss_model(ex, weights)
    if not used:
        return Outcome("export", "no float64 output to differentiate (the export computes in float32)")
    try:
        want = torch_gradients(ex, weights, used)
    except Exception as e:  # noqa: BLE001 - torch's own backward fails
        return Outcome("export", f"torch.autograd: {type(e).__name__}: {e}")
    wrt = sorted(n for n, g in want.items() if g is not None and n in ex.feeds)
    if not wrt:
        return Outcome("export", "no float64 input that torch differentiates is a graph input")
    while True:
        try:
            builder = onnxtrain.GradientGraphBuilder(model, {"loss"}, wrt, "loss")
            builder.build()
            gmodel = onnx.load_from_string(builder.get_model())
            break
        except Exception as e:  # noqa: BLE001 - classified below
            # an x the ONNX graph does not differentiate (Floor, Sign, a Cast to int) must have torch's zeros
            cut = [n for n in wrt if f"'{n}'" in str(e) and UNREACHED.search(str(e))]
            if not cut or any(np.any(want[n]) for n in cut):
                kind = "refused" if _refusal(e) else "disagrees"
                return Outcome(kind, f"GradientGraphBuilder: {type(e).__name__}: {str(e)[:300]}")
            wrt = [n for n in wrt if n not in cut]
            if not wrt:
                return Outcome("agrees", "no gradient reaches the inputs: torch's are zeros")
    outcome = _compare_gradients(gmodel, wrt, want, ex)
    if outcome.kind == "disagrees" and key in EXPORT_CONVENTIONS:
        return Outcome("export", f"{EXPORT_CONVENTIONS[key]}: {outcome.detail}", outcome.worst)
    return outcome


def _compare_gradients(gmodel: onnx.ModelProto, wrt: list[str], want: dict[str, Any], ex: Export) -> Outcome:
    import onnxtrain

    try:
        onnx.checker.check_model(gmodel, full_check=True)
    except Exception as e:  # noqa: BLE001
        return Outcome("disagrees", f"check_model(full_check=True): {str(e)[:300]}")
    feeds = {i.name: ex.feeds[i.name] for i in gmodel.graph.input if i.name in ex.feeds}
    names = [o.name for o in gmodel.graph.output]
    try:
        got = dict(zip(names, onnxtrain.InferenceSession(gmodel.SerializeToString()).run(None, feeds)))
    except Exception as e:  # noqa: BLE001
        kind = "refused" if _refusal(e) else "disagrees"
        return Outcome(kind, f"onnxtrain running the gradient graph: {type(e).__name__}: {str(e)[:300]}")
    ort = _run_onnxruntime(gmodel.SerializeToString(), feeds)
    ort_got = None if isinstance(ort, str) else dict(zip(names, ort))
    problems, worst = [], 0.0
    for name, expected in zip(ex.output_names, ex.expected):
        if name in got and not compare(got[name], expected)[0]:
            if ort_got is not None and compare(ort_got[name], got[name], np.float32)[0]:
                return Outcome("export", f"{name}: onnxruntime computes the export as onnxtrain does, torch "
                                         "differs")
            problems.append(f"{name}: forward differs from torch")
    for n in wrt:
        ok, ratio = grad_close(got[f"{n}_grad"], want[n])
        worst = max(worst, ratio)
        if not ok:
            ort_ok = ort_got is not None and grad_close(ort_got[f"{n}_grad"], want[n])[0]
            problems.append(f"{n}_grad: tolerance ratio {ratio:.3g}" + (" (onnxruntime agrees with torch)"
                                                                        if ort_ok else ""))
    note = ""
    if isinstance(ort, str):
        if NO_KERNEL.search(ort):  # onnxruntime has no float64 kernel of many ops: not our fault
            note = f"onnxruntime has no kernel: {ort}"
        else:
            problems.append(f"onnxruntime cannot run the gradient graph: {ort}")
    if problems and all("tolerance ratio" in p for p in problems):
        # torch's gradient may follow a convention that is not the derivative (native_layer_norm's mean and
        # rstd outputs pass no gradient back): finite differences of the forward decide
        off = [p.split("_grad:")[0] for p in problems]
        weights = _weights(ex)
        _, used = loss_model(ex, weights)
        if all(ex.feeds[n].size <= FD_LIMIT for n in off):
            fd = {n: finite_differences(ex, weights, used, n) for n in off}
            ours_right = all(_fd_close(got[f"{n}_grad"], fd[n]) for n in off)
            if ours_right and not any(_fd_close(want[n], fd[n]) for n in off):
                why = f"torch's gradient is not the derivative; onnxtrain's is finite differences' ({off})"
                return Outcome("agrees", why, worst, {"torch_convention": off})
    if problems:
        return Outcome("disagrees", "; ".join(problems), worst, {"got": got, "want": want})
    return Outcome("agrees", note, worst=worst)


def _fd_close(grad: np.ndarray, fd: np.ndarray) -> bool:
    return bool(np.allclose(grad, fd, rtol=1e-5, atol=1e-6 * max(1.0, float(np.abs(fd).max()))))


def finite_differences(ex: Export, weights: list[np.ndarray], used: list[int], name: str,
                       step: float = 1e-6) -> np.ndarray:
    """Central differences of the loss w.r.t. the input ``name``, through onnxtrain's forward in float64."""
    import onnxtrain

    model, _ = loss_model(ex, weights)
    sess = onnxtrain.InferenceSession(model.SerializeToString())
    loss_index = len(model.graph.output) - 1
    x = ex.feeds[name].astype(np.float64)
    grad = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        vals = []
        for s in (step, -step):
            xp = x.copy()
            xp[i] += s
            vals.append(float(sess.run(None, {**ex.feeds, name: xp})[loss_index]))
        grad[i] = (vals[0] - vals[1]) / (2 * step)
    return grad


def deterministic_keys() -> Iterator[str]:
    """Every deterministic OpInfo's key, in op_db's order."""
    return (k for k in op_db() if deterministic(k))

"""torch.nn layers in series, differentiated by ``GradientGraphBuilder`` and run in onnxruntime (review I).

The other sweeps take one layer at a time (the layer audit, torch's ModuleInfo samples) and run the gradient
graph on onnxtrain's engine; the zoo's models, which onnxruntime runs, have few kinds of layer. Here small
models chain the less common arguments: grouped and dilated Conv1d with reflect and circular padding into
GroupNorm, GELU, a padded average pool and LayerNorm; a `same`/replicate Conv2d into a training-mode
BatchNorm, a ceil-mode MaxPool, a grouped ConvTranspose with output_padding and a bilinear resize; Conv3d
with BatchNorm3d into a ConvTranspose1d and a linear resize; an Embedding with padding_idx into
MultiheadAttention (kdim/vdim, a key padding mask, the averaged weights used) or into LayerNorm,
attention and a GRU; a two-layer bidirectional LSTM; a stacked bidirectional GRU with a bias-free
LayerNorm; circular, constant and reflect pads with an Lp pool; bicubic/align_corners resizes with pixel
(un)shuffle.

Each is exported by the TorchScript exporter (training mode, no constant folding) and by dynamo
(``optimize=False``) at several opsets, its loss Σ y·r (fixed random r); the gradient graph of every
parameter and float input must pass ``onnx.checker.check_model(full_check=True)``, import the default
domain only, and give in onnxruntime's inference package (float32) the loss and gradients of
``torch.autograd`` and of the numpy engine. In float64, onnxruntime has no Conv, ConvTranspose, LSTM, GRU or
Erf kernel: the engine is compared with torch there (and onnxruntime where it runs the graph). The
dynamic cases export every input dim as dynamic and run one gradient graph at three batch sizes.

Known and documented, so left out: dynamo writes a training-mode BatchNorm as an inference one, which
`GradientGraphBuilder` differentiates as given (README, "Models from torch's exporters"); an embedding's
padding_idx row trains (a plain Gather), so that row is not compared. A gradient that is rounding noise
(a bias before a normalization) is compared against a floor of 1 % of the model's gradient scale in float32
(0.1 % in float64).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings

import numpy as np
import onnx
import pytest

from tests.tiers import extended

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn, F = torch.nn, torch.nn.functional

from onnxtrain import GradientGraphBuilder, InferenceSession  # noqa: E402
from onnxtrain.engine.ort_optimizers import disabled_optimizers  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]


class Conv1dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv1d(4, 6, 3, groups=2, dilation=2, padding=2, padding_mode="reflect")
        self.gn = nn.GroupNorm(3, 6)
        self.c2 = nn.Conv1d(6, 6, 3, groups=6, stride=2, padding=1, padding_mode="circular")
        self.ln = nn.LayerNorm(5)
        self.fc = nn.Linear(30, 3)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = F.gelu(self.gn(self.c1(x)))
        h = F.avg_pool1d(h, 3, 1, 1, count_include_pad=False)
        h = self.ln(F.silu(self.c2(h)))
        return self.fc(h.flatten(1))


class Conv2dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, 4, 3, dilation=(1, 2), padding="same", padding_mode="replicate")
        self.bn = nn.BatchNorm2d(4)
        self.c2 = nn.Conv2d(4, 8, 3, groups=2, stride=2, padding=1, bias=False)
        self.ct = nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.fc = nn.Linear(4, 3)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = F.relu(self.bn(self.c1(x)))
        h = F.max_pool2d(h, 3, 2, 1, ceil_mode=True)
        h = self.ct(F.leaky_relu(self.c2(h), 0.2))
        h = F.interpolate(h, scale_factor=2, mode="bilinear", align_corners=False)
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class Conv2dNet2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pad = nn.ReflectionPad2d((1, 2, 0, 1))
        self.c1 = nn.Conv2d(3, 6, (2, 3), stride=(1, 2))
        self.bn = nn.BatchNorm2d(6, affine=False, momentum=0.3)
        self.ct = nn.ConvTranspose2d(6, 3, 3, dilation=2)
        self.inn = nn.InstanceNorm2d(3, affine=True)
        self.fc = nn.Linear(27, 2)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = torch.tanh(self.bn(self.c1(self.pad(x))))
        h = self.inn(self.ct(h))
        h = F.interpolate(h, size=(5, 7), mode="nearest")
        h = F.pad(h, (1, 1, 1, 1), mode="replicate")
        return self.fc(F.max_pool2d(h, (3, 4), (3, 4), ceil_mode=True).flatten(1))


class Conv3dNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv3d(2, 4, 2, groups=2, dilation=(1, 1, 2))
        self.bn = nn.BatchNorm3d(4)
        self.ct = nn.ConvTranspose1d(4, 2, 2, stride=2)
        self.fc = nn.Linear(48, 3)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = F.elu(self.bn(self.c(x)))
        h = self.ct(F.avg_pool3d(h, (2, 1, 2)).flatten(2))
        return self.fc(F.interpolate(h, scale_factor=2, mode="linear").flatten(1))


class EmbAttentionGRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, padding_idx=0)
        self.ln = nn.LayerNorm(8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)
        self.gru = nn.GRU(8, 6, batch_first=True)
        self.fc = nn.Linear(6, 4)

    def forward(self, ids):  # noqa: ANN001, ANN201
        h = self.ln(self.emb(ids))
        h = h + self.mha(h, h, h, need_weights=False)[0]
        return self.fc(self.gru(h)[0][:, -1])


class EmbAttentionKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8, padding_idx=3)
        self.mha = nn.MultiheadAttention(8, 4, kdim=6, vdim=5, batch_first=True)
        self.k, self.v = nn.Linear(8, 6), nn.Linear(8, 5)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):  # noqa: ANN001, ANN201
        h = self.emb(ids)
        a, w = self.mha(h, self.k(h), self.v(h), key_padding_mask=ids == 3)
        return self.fc(a.mean(1)) + w.sum()


class BiLSTM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(9, 6, padding_idx=1)
        self.lstm = nn.LSTM(6, 5, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(10, 3)

    def forward(self, ids):  # noqa: ANN001, ANN201
        o, (_, c) = self.lstm(self.emb(ids))
        return self.fc(o[:, -1]) + c.sum()


class GRUStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(4, 5, num_layers=2, bidirectional=True)
        self.ln = nn.LayerNorm(10, bias=False)
        self.fc = nn.Linear(10, 3)

    def forward(self, x):  # noqa: ANN001, ANN201
        o, h = self.gru(x)
        return self.fc(self.ln(o).mean(0)) + h.mean()


class Pads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, padding=2, padding_mode="circular")
        self.c2 = nn.Conv2d(3, 3, 3, padding=1, padding_mode="reflect")
        self.fc = nn.Linear(27, 2)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = F.pad(self.c(x), (2, 0, 1, 1), mode="constant", value=0.5)
        h = F.lp_pool2d(self.c2(h).abs() + 0.1, 2, 2)
        return self.fc(F.adaptive_avg_pool2d(h, 3).flatten(1))


class Upsamplers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.c2 = nn.Conv2d(2, 2, 1), nn.Conv2d(1, 4, 1)
        self.fc = nn.Linear(36, 2)

    def forward(self, x):  # noqa: ANN001, ANN201
        h = F.interpolate(self.c(x), scale_factor=2, mode="bicubic", align_corners=True)
        h = self.c2(F.pixel_shuffle(F.pixel_unshuffle(h, 2), 2)[:, :1])
        return self.fc(F.interpolate(h, size=(3, 3), mode="bilinear", align_corners=True).flatten(1))


def _ids(high: int, *shape: int) -> torch.Tensor:
    t = torch.randint(0, high, shape)
    t[0, 0] = 0
    return t


# name: (module class, inputs, classes of the output)
MODELS = {
    "conv1d": (Conv1dNet, lambda: (torch.randn(2, 4, 10),)),
    "conv2d": (Conv2dNet, lambda: (torch.randn(2, 3, 9, 9),)),
    "conv2d_b": (Conv2dNet2, lambda: (torch.randn(2, 3, 6, 8),)),
    "conv3d": (Conv3dNet, lambda: (torch.randn(2, 2, 3, 4, 6),)),
    "emb_mha_gru": (EmbAttentionGRU, lambda: (_ids(11, 2, 5),)),
    "emb_mha_kv": (EmbAttentionKV, lambda: (torch.tensor([[1, 3, 4, 5], [3, 6, 3, 2]]),)),
    "bilstm": (BiLSTM, lambda: (_ids(9, 2, 5),)),
    "gru_stack": (GRUStack, lambda: (torch.randn(5, 2, 4),)),
    "pads": (Pads, lambda: (torch.randn(2, 2, 4, 4),)),  # (TorchScript cannot export its adaptive pool)
    "upsample": (Upsamplers, lambda: (torch.randn(2, 2, 3, 3),)),
}
WITH_BATCH_NORM = {"conv2d", "conv2d_b", "conv3d"}


def make(name: str, dtype: torch.dtype = torch.float32) -> tuple[nn.Module, tuple]:
    """Model ``name`` (weights from seed 0) in training mode and its inputs (seed 1), float ones in dtype."""
    cls, inputs = MODELS[name]
    torch.manual_seed(0)
    module = cls().to(dtype).train()
    torch.manual_seed(1)
    return module, tuple(a.to(dtype) if a.is_floating_point() else a for a in inputs())


def export(module: nn.Module, args: tuple, exporter: str, opset: int,
           dynamic: bool = False) -> onnx.ModelProto:
    """The module exported (a copy: a training export updates running statistics); skips when torch cannot."""
    module = copy.deepcopy(module)
    names = [f"in{i}" for i in range(len(args))]
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            if exporter == "dynamo":
                kw = {}
                if dynamic:
                    auto = torch.export.Dim.AUTO
                    kw["dynamic_shapes"] = (tuple({ax: auto for ax in range(a.dim())} for a in args),)
                return torch.onnx.export(module, args, dynamo=True, optimize=False, opset_version=opset,
                                         input_names=names, verbose=False, **kw).model_proto
            f = io.BytesIO()
            axes = {n: {ax: f"{n}_{ax}" for ax in range(a.dim())} for n, a in zip(names, args)}
            torch.onnx.export(module, args, f, dynamo=False, opset_version=opset, input_names=names,
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                              dynamic_axes=axes if dynamic else None)
            return onnx.load_from_string(f.getvalue())
        except Exception as e:  # noqa: BLE001
            pytest.skip(f"torch's {exporter} exporter fails: {type(e).__name__}: {str(e)[:120]}")


def standard_only(model: onnx.ModelProto, label: str) -> None:
    """The full check, and no domain but the default one (imports, nodes of every body, functions)."""
    onnx.checker.check_model(model, full_check=True)
    domains = {o.domain for o in model.opset_import}
    stack = [model.graph]
    while stack:
        g = stack.pop()
        domains |= {n.domain for n in g.node}
        stack += [a.g for n in g.node for a in n.attribute if a.type == onnx.AttributeProto.GRAPH]
        stack += [s for n in g.node for a in n.attribute for s in a.graphs]
    assert domains <= {"", "ai.onnx"}, (label, domains)
    assert not model.functions, (label, [f.name for f in model.functions])


def ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """onnxruntime's session with the optimizers the README advises against for such graphs turned off."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"],
                                disabled_optimizers=disabled_optimizers(model))


def no_kernel(e: Exception) -> bool:
    """onnxruntime's CPU package has no kernel of that type (float64 Conv, LSTM, GRU, Erf, Col2Im...)."""
    return "NOT_IMPLEMENTED" in str(e) or "does not support double" in str(e)


def error(got: np.ndarray, want: np.ndarray, floor: float) -> float:
    """‖got − want‖ / max(‖want‖, floor·√n)."""
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), floor * np.sqrt(max(b.size, 1))))


class Weighted(nn.Module):
    """Σ body(*x)·r with r fed as the last input (so that the batch may change)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, *a):  # noqa: ANN002, ANN201
        *xs, r = a
        return (self.body(*xs) * r).sum()


def _weights(module: nn.Module, args: tuple, seed: int) -> torch.Tensor:
    with torch.no_grad():
        y = copy.deepcopy(module)(*args)
    return torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)


def _torch_grads(loss_module: Weighted, args: tuple, params: list[str], n_float: list[int]
                 ) -> tuple[np.ndarray, list[np.ndarray]]:
    ref = copy.deepcopy(loss_module)
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in args]
    loss = ref(*leaves)
    named = dict(ref.named_parameters())
    gs = torch.autograd.grad(loss, [named[p] for p in params] + [leaves[i] for i in n_float])
    return loss.detach().numpy(), [g.numpy() for g in gs]


def check_gradient_graph(name: str, exporter: str, opset: int, dtype: torch.dtype,
                         dynamic: bool = False) -> None:
    body, args = make(name, dtype)
    r = _weights(body, args, 1)
    loss_module = Weighted(body)
    model = export(loss_module, (*args, r), exporter, opset, dynamic)
    inits = {t.name for t in model.graph.initializer}
    params = [n for n, _ in loss_module.named_parameters() if n in inits]
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    floats = [k for k, a in enumerate(args) if a.is_floating_point()]
    loss = model.graph.output[0].name
    b = GradientGraphBuilder(model.SerializeToString(), {loss}, [*params, *(inputs[k] for k in floats)], loss)
    b.build()
    g = onnx.load_from_string(b.get_model())
    label = f"{name} {exporter} opset {opset} {dtype}"
    standard_only(g, label)
    names = [o.name for o in g.graph.output]
    f64 = dtype == torch.float64
    try:
        sess = ort_session(g)
    except Exception as e:  # noqa: BLE001
        if not (f64 and no_kernel(e)):
            raise AssertionError(f"{label}: onnxruntime refuses the gradient graph: {e}") from e
        sess = None
    engine = InferenceSession(g.SerializeToString())
    pads = {f"body.{m}.weight_grad": sub.padding_idx for m, sub in body.named_modules()
            if isinstance(sub, nn.Embedding) and sub.padding_idx is not None}
    tol = 1e-8 if f64 else 2e-4
    sizes = (0, 1, 2) if dynamic else (0,)
    for k in sizes:
        run_args = args
        if k:  # another batch: every input's first dim k longer (ids drawn in the same range)
            gen = torch.Generator().manual_seed(5 + k)
            run_args = tuple(
                torch.randn([a.shape[0] + k, *a.shape[1:]], generator=gen, dtype=a.dtype)
                if a.is_floating_point() else
                torch.randint(0, int(a.max()) + 1, [a.shape[0] + k, *a.shape[1:]], generator=gen)
                for a in args)
        rk = r if k == 0 else _weights(body, run_args, 9)
        want_loss, want = _torch_grads(loss_module, (*run_args, rk), params, floats)
        want = dict(zip([*(f"{p}_grad" for p in params), *(f"{inputs[i]}_grad" for i in floats)], want))
        want[loss] = want_loss
        feeds = dict(zip(inputs, (a.numpy() for a in (*run_args, rk))))
        runs = {"engine": dict(zip(names, engine.run(None, feeds)))}
        try:
            if sess is not None:
                runs["onnxruntime"] = dict(zip(names, sess.run(None, feeds)))
        except Exception as e:  # noqa: BLE001
            if not (f64 and no_kernel(e)):
                raise AssertionError(f"{label} batch +{k}: onnxruntime cannot run the gradient graph: "
                                     f"{e}") from e
        # a gradient that is float32 rounding noise is compared against 1 % of the model's gradient scale
        scale = max(float(np.sqrt(np.mean(np.square(v)))) for v in want.values())
        scale *= 0.1 if f64 else 1.0
        for out, w in want.items():
            for runner, got in runs.items():
                a = got[out]
                if out in pads:
                    keep = np.arange(w.shape[0]) != pads[out] % w.shape[0]
                    a, w2 = a[keep], w[keep]
                else:
                    w2 = w
                err = error(a, w2, 1e-2 * scale)
                assert err <= tol, (label, f"batch +{k}", runner, out, err)
        if "onnxruntime" in runs:
            for out in names:
                err = error(runs["onnxruntime"][out], runs["engine"][out], 1e-2 * scale)
                assert err <= tol, (label, f"batch +{k}", "onnxruntime vs engine", out, err)


NO_DYNAMO_BN = [n for n in MODELS if n not in WITH_BATCH_NORM]

CASES = [
    ("conv1d", "torchscript", 17), ("conv2d", "torchscript", 20), ("emb_mha_kv", "dynamo", 18),
    ("bilstm", "torchscript", 17), ("pads", "dynamo", 23),
    *(extended(n, "torchscript", o) for n in MODELS if n != "pads" for o in (17, 20)
      if (n, "torchscript", o) not in {("conv1d", "torchscript", 17), ("conv2d", "torchscript", 20),
                                       ("bilstm", "torchscript", 17)}),
    *(extended(n, "dynamo", o) for n in NO_DYNAMO_BN for o in (18, 20, 23)
      if (n, o) not in {("emb_mha_kv", 18), ("pads", 23)}),
]


@pytest.mark.parametrize(("name", "exporter", "opset"), CASES)
def test_gradient_graph_runs_in_onnxruntime_as_torch(name: str, exporter: str, opset: int) -> None:
    check_gradient_graph(name, exporter, opset, torch.float32)


@pytest.mark.parametrize(("name", "exporter"), [
    ("conv2d_b", "torchscript"), ("emb_mha_kv", "torchscript"), ("gru_stack", "dynamo"),
    *(extended(n, "torchscript") for n in MODELS if n not in ("conv2d_b", "emb_mha_kv", "pads")),
    *(extended(n, "dynamo") for n in NO_DYNAMO_BN if n != "gru_stack"),
])
def test_float64_gradient_graph_matches_torch(name: str, exporter: str) -> None:
    """float64: the engine (and onnxruntime, where it has the kernels) against torch to 1e-8."""
    check_gradient_graph(name, exporter, 17 if exporter == "torchscript" else 18, torch.float64)


@pytest.mark.parametrize(("name", "exporter"), [
    ("emb_mha_gru", "torchscript"), ("conv1d", "dynamo"),
    *(extended(n, "torchscript") for n in MODELS if n not in ("emb_mha_gru", "pads")),
    *(extended(n, "dynamo") for n in NO_DYNAMO_BN if n != "conv1d"),
])
def test_dynamic_gradient_graph_at_three_batch_sizes(name: str, exporter: str) -> None:
    """Every input dim dynamic: one gradient graph, run at the export's batch and two larger ones."""
    check_gradient_graph(name, exporter, 17 if exporter == "torchscript" else 18, torch.float32, dynamic=True)

"""onnxruntime's ORTModule gradient checks, run on onnxtrain: small torch modules exported by torch's
TorchScript exporter, differentiated by onnxtrain, against torch autograd.

The cases come from onnxruntime's ``orttraining/orttraining/test/python/orttraining_test_ortmodule_api.py``
(``api:`` in a case's source) and ``orttraining_test_onnx_ops_ortmodule.py`` (``ops:``): each names the
onnxruntime test it was taken from. Their modules, shapes and attributes are kept, sizes made small. The
loss reads each float output y of a module with fixed random weights r: Σ y·r (onnxruntime sums the
outputs; weights also test gradients a plain sum makes vanish, such as Softmax's).

Export: ``dynamo=False``, opset 17 unless a case says otherwise, TrainingMode.TRAINING, no constant folding,
parameters as initializers under their torch names. Gradients are taken w.r.t. every torch parameter that
requires one and every float input, in three ways (``style``):

* ``loss``: the loss inside the exported graph, differentiated by ``build_gradient_model``;
* ``ortmodule``: as ORTModule differentiates a module: the module's float outputs are the ys of a
  ``GradientGraphBuilder`` without a loss, fed their incoming gradients ``<y>_grad`` = r (zeros for an output
  the loss does not read), against ``torch.autograd.backward(outputs, r)``; the outputs are compared too;
* ``ortmodule_dynamic``: the same on an export with every input dim dynamic, as ORTModule exports, run
  also with the inputs' dim 0 of size 1 and twice the export's (ORTModule reuses its graph for every batch
  size, onnxruntime's test_ortmodule_inputs_with_dynamic_shape), where torch takes those inputs.

The gradient model passes ``onnx.checker.check_model(full_check=True)``, and what it computes on onnxtrain's
engine and on onnxruntime (CPU) must equal torch's. Cases run in float64 (module and inputs ``.double()``)
unless marked float32 (onnxruntime's CPU Conv, ConvTranspose, Resize and Erf take float32 only: it runs
those cases' float32 export). Tolerance per tensor: |a − b| ≤ rtol·|b| + atol·max(max|b|, 1e-3·g) elementwise,
g the case's largest gradient element, with (rtol, atol) = (1e-8, 1e-10) in float64 and (1e-4, 1e-5) in
float32.

An embedding's ``padding_idx`` is exported as a plain Gather (torch warns that ONNX cannot keep that row out
of training): for cases that have one, the reference module keeps the zero row but drops padding_idx, which
is the function the exported graph computes. torch.max(x, dim) and min along a dim route dY to the index they
return; their export (ReduceMax/ReduceMin beside ArgMax/ArgMin, the graph torch.amax beside argmax writes
too) takes torch.amax's gradient, shared among tied elements: the cases draw values without ties there.
"""

from __future__ import annotations

import io
import itertools
import random
import warnings
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import onnx
import pytest

from onnxtrain import GradientGraphBuilder
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn = torch.nn
F = torch.nn.functional

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TOL = {torch.float64: (1e-8, 1e-10), torch.float32: (1e-4, 1e-5)}

# onnxruntime tests not ported, and why
SKIPPED_SOURCES = {
    "api: test_gradient_correctness_conv1d and _cross_entropy_loss with use_fp16": "CUDA autocast only",
    "api: the conv tests' conv_algo_search": "cuDNN's algorithm search, CUDA only",
    "api: test_correctness_argmax_bitwise_or, test_aten_multinomial": "forward only, no gradient",
    "api: test_runtime_inspector_*, the graph checks of the padding elimination tests": "ORTModule's "
    "sparsity optimizers (ShrunkenGather, PadAndUnflatten); their modules' gradients are ported",
    "api: the ORTModule API tests (devices, kwargs, state_dict, fallback, debug options, caching, "
    "FusedAdam, HuggingFace models)": "ORTModule's PyTorch front end",
}

# ---- modules ---------------------------------------------------------------------------------------------


class Lambda(nn.Module):
    """fn(self, *args), with the given submodules and parameters registered."""

    def __init__(self, fn: Callable, **children: nn.Module | nn.Parameter | torch.Tensor) -> None:
        super().__init__()
        self.fn = fn
        for name, child in children.items():
            if isinstance(child, (nn.Module, nn.Parameter)):
                setattr(self, name, child)
            else:
                self.register_buffer(name, child)

    def forward(self, *args):  # noqa: ANN002, ANN201
        return self.fn(self, *args)


def _mlp(d_in: int, hidden: int, d_out: int, act: nn.Module) -> nn.Module:
    return nn.Sequential(nn.Linear(d_in, hidden), act, nn.Linear(hidden, d_out))


def _r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def _away_from_zero(*shape: int) -> torch.Tensor:
    """Normal values pushed 0.2 away from 0 (onnxruntime's inputs for 1/x and LeakyReLU)."""
    x = torch.randn(*shape)
    return x + 0.2 * torch.where(x > 0, 1.0, -1.0)


def _no_padding_idx(module: nn.Module) -> nn.Module:
    """The module with its embeddings' padding_idx dropped (rows kept): what a TorchScript export computes."""
    for m in module.modules():
        if isinstance(m, nn.Embedding):
            m.padding_idx = None
    return module


class Case(NamedTuple):
    """A ported case: ``make()`` gives the module and its inputs."""

    source: str
    make: Callable[[], tuple[nn.Module, tuple]]
    float32: bool = False  # the export holds float32 constants: compare at float32 precision
    opset: int = 17
    keep_outputs: bool = False  # the exported graph keeps the module's outputs beside the loss
    in_loss: tuple[int, ...] | None = None  # the outputs the loss reads (default: every float one)


CASES: dict[str, Case] = {}
EXTENDED: set[str] = set()  # run with ONNXTRAIN_FULL_TESTS=1 only


def case(name: str, source: str, make: Callable, *, full_only: bool = False, **kw) -> None:
    assert name not in CASES, name
    CASES[name] = Case(source, make, **kw)
    if full_only:
        EXTENDED.add(name)


# conv, transpose, embedding --------------------------------------------------------------------------------
SRC = "api: test_gradient_correctness_conv1d"
for grad_in in (False, True):
    case(
        f"conv1d_permuted_input_grad_{grad_in}",
        SRC,
        lambda grad_in=grad_in: (
            Lambda(
                lambda s, x: s.conv2(s.conv1(x.permute(0, 2, 1).contiguous())).permute(0, 2, 1).contiguous(),
                conv1=nn.Conv1d(6, 6, 3, padding=1),
                conv2=nn.Conv1d(6, 6, 3, padding=1),
            ),
            (_r(2, 7, 6).requires_grad_(grad_in),),
        ),
    )

PERMS3 = list(itertools.permutations(range(3)))
PERMS4 = list(itertools.permutations(range(4)))
for shape in ((3, 4, 5), (4, 1, 2), (1, 2, 2), (2, 1, 4), (2, 2, 1)):
    case(
        f"transpose3d_{'x'.join(map(str, shape))}",
        "api: test_gradient_correctness_transpose3d",
        lambda shape=shape: (
            Lambda(lambda s, x: tuple(torch.sin(x.permute(*p)) for p in PERMS3)),
            (_r(*shape),),
        ),
    )
for shape in ((2, 3, 4, 5), (4, 1, 2, 1), (1, 2, 1, 2), (2, 1, 4, 1), (1, 4, 2, 1)):
    case(
        f"transpose4d_{'x'.join(map(str, shape))}",
        "api: test_gradient_correctness_transpose4d",
        lambda shape=shape: (
            Lambda(lambda s, x: tuple(torch.sin(x.permute(*p)) for p in PERMS4)),
            (_r(*shape),),
        ),
        full_only=shape != (2, 3, 4, 5),
    )

for pad in (None, 1):
    case(
        f"embedding_linear_padding_idx_{pad}",
        "api: test_gradient_correctness_embedding",
        lambda pad=pad: (
            _no_padding_idx(
                Lambda(
                    lambda s, i: s.linear(s.embedding(i)),
                    embedding=nn.Embedding(12, 5, padding_idx=pad),
                    linear=nn.Linear(5, 4),
                )
            ),
            (torch.tensor([0, 1, 3, 1, 11, 7, 3, 2]),),
        ),
    )


# losses -----------------------------------------------------------------------------------------------------
def _ce_all_ones_weight() -> tuple[nn.Module, tuple]:
    fc = nn.Linear(3, 3, bias=False)
    with torch.no_grad():
        fc.weight.fill_(1.0)  # every class gets the same logit: a uniform softmax per row
    return (
        Lambda(
            lambda s, x, t: F.cross_entropy(s.fc1(x), t).reshape(1) * s.scale,
            fc1=fc,
            scale=torch.tensor([65536.0]),
        ),
        (0.1 * _r(16, 3), torch.randint(0, 3, (16,))),
    )


case(
    "cross_entropy_equal_logits_scaled",
    "api: test_gradient_correctness_cross_entropy_loss_fp16_boundary_set",
    _ce_all_ones_weight,
)


def _ce_transposed_embedding(ignored: int) -> tuple[nn.Module, tuple]:
    n = 9
    module = _no_padding_idx(
        Lambda(
            lambda s, i, pos: F.cross_entropy(s.embedding(i).transpose(0, 1), pos, ignore_index=i.shape[0]),
            embedding=nn.Embedding(12, 6, padding_idx=1),
        )
    )
    positions = torch.randint(0, n, (6,))
    positions[:ignored] = n  # = ignore_index (the batch size): left out of the mean
    return module, (torch.randint(0, 12, (n,)), positions)


for ignored in (0, 2):
    case(
        f"cross_entropy_transposed_embedding_ignored_{ignored}",
        "api: test_gradient_correctness_cross_entropy_loss",
        lambda ignored=ignored: _ce_transposed_embedding(ignored),
    )

case(
    "bce_with_logits",
    "api: test_gradient_correctness_bce_with_logits",
    lambda: (
        Lambda(lambda s, x, t: F.binary_cross_entropy_with_logits(s.linear(x), t), linear=nn.Linear(7, 5)),
        (torch.rand(4, 7), torch.rand(4, 5)),
    ),
)


def _sparse_labels_ce(rank: int, sparse_labels: bool) -> tuple[nn.Module, tuple]:
    fc = nn.Linear(6, 3, bias=False)
    with torch.no_grad():
        fc.weight.fill_(1.0)

    def fn(s, ids, labels):  # noqa: ANN001, ANN202
        out = s.fc1(s.embedding(ids))
        if rank == 1:
            return F.cross_entropy(out, labels)
        return F.cross_entropy(out.view(-1, 3), labels.view(-1))

    ids = torch.tensor([[0, 2, 3, 4], [2, 3, 5, 6], [8, 7, 7, 7]])
    labels = (
        torch.tensor([[1, 2, -100, 2], [-100, -100, 2, 1], [-100, 1, 2, -100]])
        if sparse_labels
        else torch.tensor([[1, 2, 0, 2], [0, 0, 2, 1], [0, 1, 2, 0]])
    )
    if rank == 1:
        ids, labels = ids.view(-1), labels.view(-1)
    return _no_padding_idx(Lambda(fn, embedding=nn.Embedding(16, 6, padding_idx=1), fc1=fc)), (ids, labels)


for rank, sparse in itertools.product((1, 2), (False, True)):
    case(
        f"embedding_cross_entropy_rank{rank}_ignored_labels_{sparse}",
        "api: test_runtime_inspector_label_and_embed_sparsity_detection",
        lambda rank=rank, sparse=sparse: _sparse_labels_ce(rank, sparse),
    )


# pools ------------------------------------------------------------------------------------------------------
POOLS = {
    "MaxPool": lambda: nn.MaxPool2d(3, stride=2, padding=1),
    "AvgPool": lambda: nn.AvgPool2d(3, stride=2, padding=1),
    "AdaptiveAvgPool": lambda: nn.AdaptiveAvgPool2d((5, 7)),
}
for kind, make_pool in POOLS.items():
    case(
        f"conv_then_{kind}",
        "api: test_gradient_correctness_pool2d",
        lambda make_pool=make_pool: (
            Lambda(
                lambda s, x: s.pool(s.conv(x)),
                conv=nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False),
                pool=make_pool(),
            ),
            (_r(2, 3, 20, 28),),
        ),
    )
for kind, stride in itertools.product(("max", "avg"), (None, 2)):
    pool = getattr(F, f"{kind}_pool2d")
    case(
        f"conv_then_functional_{kind}_pool_stride_{stride}",
        "api: test_export_correctness_pool2d",
        lambda pool=pool, stride=stride: (
            Lambda(
                lambda s, x: pool(s.conv(x), kernel_size=3, stride=stride),
                conv=nn.Conv2d(3, 4, 7, stride=2, padding=3, bias=False),
            ),
            (_r(2, 3, 22, 18),),
        ),
    )


# min / max, argmax, reductions ------------------------------------------------------------------------------
def _minmax(op: str, ties: bool) -> tuple[nn.Module, tuple]:
    f = getattr(torch, op)

    def fn(s, x):  # noqa: ANN001, ANN202
        outs = [f(x)]
        for dim, keep in itertools.product((0, -1), (True, False)):
            outs.append(f(x, dim=dim, keepdim=keep)[0])
        return tuple(outs)

    x = torch.randint(0, 3, (3, 5, 4)).float() if ties else torch.rand(3, 5, 4)
    return Lambda(fn), (x,)


for op in ("min", "max"):
    case(
        f"{op}_full_and_along_dims", "api: test_gradient_correctness_minmax", lambda op=op: _minmax(op, False)
    )
    # torch.max(x) shares dY evenly among tied maxima; max(x, dim) gives it to the index it returns
    case(
        f"{op}_full_with_ties",
        "api: test_gradient_correctness_minmax (tied values)",
        lambda op=op: (Lambda(lambda s, x: getattr(torch, op)(x)), (torch.randint(0, 3, (3, 5, 4)).float(),)),
    )
    # the values and indices along a dim (onnxruntime compares the indices with torch's)
    for dim, keep in itertools.product((0, -1), (True, False)):
        case(
            f"{op}_dim_{dim}_keepdim_{keep}_indices",
            "api: test_gradient_correctness_minmax",
            lambda op=op, dim=dim, keep=keep: (
                Lambda(lambda s, x: getattr(torch, op)(x, dim=dim, keepdim=keep)),
                (torch.rand(3, 5, 4),),
            ),
            keep_outputs=True,
        )
    case(
        f"{op}_two_tensors",
        "api: test_gradient_correctness_minmax_two_tensors",
        lambda op=op: (
            Lambda(lambda s, a, b: getattr(torch, op)(a, b)),
            (torch.rand(3, 5, 4), torch.rand(3, 5, 4)),
        ),
    )
    # torch ≥ 1.10 gives each of two equal operands half of dY (onnxruntime's test checks it)
    case(
        f"{op}_two_tensors_with_ties",
        "api: test_gradient_correctness_minmax_two_tensors (equal values)",
        lambda op=op: (
            Lambda(lambda s, a, b: getattr(torch, op)(a, b)),
            (torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 0.0, 1.0, 0.0])),
        ),
    )

case(
    "argmax_linear_unfold",
    "api: test_gradient_correctness_argmax_unfold",
    lambda: (
        Lambda(
            lambda s, x: s.linear(
                x.argmax(-1).to(s.linear.weight.dtype) * x.argmax().to(s.linear.weight.dtype)
            ).unfold(dimension=1, size=5, step=3),
            linear=nn.Linear(6, 14),
        ),
        (torch.randint(0, 100, (2, 6, 5), dtype=torch.uint8),),
    ),
)

for dims in ((0, 1), (0, 2), (1, 2), (2, 0)):
    case(
        f"diagonal_dims_{dims[0]}{dims[1]}",
        "api: test_gradient_correctness_argmax_diagonal",
        lambda dims=dims: (
            Lambda(lambda s, x: tuple(torch.diagonal(x, off, *dims) for off in (-1, 0, 1))),
            (torch.rand(3, 4, 5),),
        ),
        float32=True,
    )  # (the export's If has a float32 branch: invalid in float64)

for dim in (None, 0, 1, (0, 1), (-1, 0), (0, 1, 2)):
    case(
        f"linear_then_sum_dim_{dim}".replace(" ", ""),
        "api: test_gradient_correctness_reducesum",
        lambda dim=dim: (
            Lambda(
                lambda s, x: (
                    s.linear(x).sum()
                    if dim is None
                    else tuple(torch.sum(s.linear(x), dim, keepdim=k) for k in (True, False))
                ),
                linear=nn.Linear(5, 3),
            ),
            (torch.rand(4, 2, 5),),
        ),
    )

for dim in (0, 1, -1):
    case(
        f"chunk_dim_{dim}",
        "api: test_gradient_correctness_chunk",
        lambda dim=dim: (
            Lambda(lambda s, x: (*x.chunk(1, dim=dim), *x.chunk(3, dim=dim))),
            (torch.rand(7, 8, 9),),
        ),
    )


# einsum -----------------------------------------------------------------------------------------------------
def _einsum(equation: str, sizes: dict[str, int]) -> tuple[nn.Module, tuple]:
    lhs, rhs = equation.split("->")[0].split(",")
    bias = nn.Parameter(torch.randn(sizes[lhs[-1]]))
    module = Lambda(lambda s, a, b: torch.einsum(equation, a + s.bias, b), bias=bias)
    return module, (torch.rand(*(sizes[c] for c in lhs)), torch.rand(*(sizes[c] for c in rhs)))


MOE_SIZES = {"k": 2, "s": 6, "m": 5, "e": 3, "c": 4}
for eq in (
    "s,se->se",
    "se,sc->sec",
    "se,se->s",
    "ks,ksm->sm",
    "kes,ems->mek",
    "kes,ksm->ms",
    "sec,sm->ecm",
    "sec,ecm->sm",
):
    case(
        f"einsum_{eq.replace(',', '_').replace('->', '_to_')}",
        "api: test_gradient_correctness_einsum",
        lambda eq=eq: _einsum(eq, MOE_SIZES),
    )


def _einsum_sweep() -> list[str]:
    """onnxruntime's generated equations (left: a, ab or abc; right: any 1-3 of abcd, no gaps, letters new to
    the right in order; up to 8 outputs each, here drawn with a fixed seed)."""
    rng = random.Random(0)
    rights = [
        list(p)
        for n in (1, 2, 3)
        for c in itertools.combinations(range(4), n)
        for p in itertools.permutations(c)
    ]
    out = []
    for left in ([0], [0, 1], [0, 1, 2]):
        for right in rights:
            union = sorted(set(left + right))
            if any(v >= len(union) for v in union):
                continue
            new = [v for v in right if v not in left]
            if new != sorted(new):
                continue
            outs = [
                p
                for n in range(1, len(union) + 1)
                for c in itertools.combinations(union, n)
                for p in itertools.permutations(c)
            ]
            rng.shuffle(outs)
            for o in outs[:8]:
                word = lambda vs: "".join(chr(97 + v) for v in vs)  # noqa: E731
                out.append(f"{word(left)},{word(right)}->{word(o)}")
    return out


EINSUM_SWEEP = _einsum_sweep()
for i, eq in enumerate(EINSUM_SWEEP):
    case(
        f"einsum_sweep_{eq.replace(',', '_').replace('->', '_to_')}",
        "api: test_gradient_correctness_einsum_2",
        lambda eq=eq: _einsum(eq, {"a": 4, "b": 5, "c": 2, "d": 3}),
        full_only=i % 12 != 0,
    )


# scatter / gather / index -----------------------------------------------------------------------------------
def _scatter_argmax(s, x):  # noqa: ANN001, ANN202
    idx = torch.argmax(x, dim=1)
    return torch.zeros(idx.shape[0], 2, dtype=torch.int64).scatter(-1, idx.unsqueeze(-1), 1) + x


case(
    "argmax_scatter_plus_input",
    "api: test_aten_argmax",
    lambda: (Lambda(_scatter_argmax), (torch.rand(4, 2),)),
)


def _index_put(indices: list[list[int]]) -> tuple[nn.Module, tuple]:
    def fn(s, routed, mask, expert):  # noqa: ANN001, ANN202
        routed = routed.clone()
        if torch.onnx.is_in_onnx_export():
            routed[mask] = expert
            return routed
        # torch's oracle: the same values, written by the updates each slot keeps (the last one to it, as
        # the engine and onnxruntime write). torch's own index_put gives every repeat of an index the slot's
        # gradient, as onnxruntime-training's ScatterND gradient did, though only the kept one reaches the
        # output; onnxtrain differentiates what the forward computes (README, ScatterND)
        flat = mask.reshape(-1)
        flat = torch.where(flat < 0, flat + routed.shape[0], flat)  # (one past the end still raises)
        later = torch.ones(len(flat), len(flat), dtype=torch.bool).triu(1)
        kept = ~((flat[:, None] == flat[None, :]) & later).any(1)
        routed[flat[kept]] = expert.reshape(len(flat), *expert.shape[mask.dim():])[kept]
        return routed

    expert = torch.tensor([[[0.3817], [0.9625], [0.9625], [0.9625]]] * 2)
    return Lambda(fn), (torch.zeros(5, 1), torch.tensor(indices), expert)


for indices in ([[2, 3, -1, -1], [0, 1, -1, -1]], [[2, 3, 4, 4], [0, 1, 4, 4]]):
    case(
        f"index_put_repeated_{indices[0][-1]}",
        "api: test_scatternd_correctness",
        lambda indices=indices: _index_put(indices),
    )

case(
    "gather_elements_reversed",
    "ops: test_onnx_ops GatherElements",
    lambda: (
        Lambda(
            lambda s, x: s.fc2(torch.gather(s.fc1(x), 1, s.idx)),
            fc1=nn.Linear(4, 6),
            fc2=nn.Linear(6, 3),
            idx=torch.arange(5, -1, -1).repeat(3, 1),
        ),
        (_r(3, 4),),
    ),
)
case("softmax_implicit_dim", "ops: test_onnx_ops Softmax", lambda: (_mlp(4, 6, 3, nn.Softmax()), (_r(5, 4),)))

for shape in ((), (5,), (2, 5), (3, 2, 5)):
    case(
        f"numpy_T_rank{len(shape)}",
        "api: test_numpy_T",
        lambda shape=shape: (Lambda(lambda s, x: torch.sin(x.T)), (torch.randn(shape),)),
    )

case(
    "slice_past_end",
    "api: test_random_states_unchanged_for_ortmodule",
    lambda: (Lambda(lambda s, x: x[:32, :]), (_r(16, 16),)),
)


# normalization, resize, activations -------------------------------------------------------------------------
case(
    "group_norm_of_sum",
    "api: test_aten_group_norm",
    lambda: (Lambda(lambda s, x, y: s.gn(x + y), gn=nn.GroupNorm(3, 6)), (_r(4, 6, 3, 3), _r(4, 6, 3, 3))),
)
case("batch_norm_1d", "api: test_eval_onnx_models", lambda: (nn.BatchNorm1d(5), (_r(6, 5),)))
for rank, use_factor in itertools.product((3, 4, 5), (True, False)):
    case(
        f"upsample_nearest_rank{rank}_{'scale' if use_factor else 'size'}",
        "api: test_aten_upsample_nearest",
        lambda rank=rank, use_factor=use_factor: (
            Lambda(
                lambda s, x: (
                    F.interpolate(x, scale_factor=2.0, mode="nearest")
                    if use_factor
                    else F.interpolate(x, size=12, mode="nearest")
                )
            ),
            (_r(*(2 * (d + 1) for d in range(rank))),),
        ),
    )
case(
    "upsample_bilinear_size",
    "api: test_aten_upsample_bilinear",
    lambda: (Lambda(lambda s, x: F.interpolate(x, size=(8, 12), mode="bilinear")), (_r(2, 4, 6, 8),)),
)

case("sigmoid", "api: test_sigmoid_grad", lambda: (nn.Sequential(nn.Linear(6, 5), nn.Sigmoid()), (_r(4, 6),)))
case(
    "sigmoid_opset13",
    "api: test_sigmoid_grad_opset13",
    lambda: (nn.Sequential(nn.Linear(6, 5), nn.Sigmoid()), (_r(4, 6),)),
    opset=13,
)
case("tanh", "api: test_tanh_grad", lambda: (nn.Sequential(nn.Linear(6, 5), nn.Tanh()), (_r(4, 6),)))
case("cos", "api: test_ortmodule_gradient_builder", lambda: (Lambda(lambda s, x: torch.cos(x)), (_r(2, 2),)))
case(
    "reciprocal",
    "api: test_reciprocal_gradient",
    lambda: (Lambda(lambda s, x: 1 / x), (_away_from_zero(3, 6, 5),)),
)
case(
    "leaky_relu_half",
    "api: test_leakyrelu_gradient",
    lambda: (nn.LeakyReLU(0.5), (_away_from_zero(3, 6, 5),)),
)
for m, n in ((2, 3), (4, 3), (5, 5), (3, 4)):
    for batch in (1, 3):
        case(
            f"trilu_{batch}x{m}x{n}",
            "api: test_trilu_grad",
            lambda batch=batch, m=m, n=n: (
                Lambda(
                    lambda s, x: tuple(
                        f(x) if k is None else f(x, k)
                        for f in (torch.triu, torch.tril)
                        for k in (None, -5, -3, -1, 0, 2, 4)
                    )
                ),
                (torch.rand(batch, m, n),),
            ),
            full_only=(m, n) in ((4, 3), (3, 4)),
        )
case("softmax_dim1", "api: test_softmax", lambda: (nn.Softmax(dim=1), (torch.rand(24, 6),)))
case(
    "squeeze_then_conv",
    "api: test_squeeze_custom_symbolic_registry",
    lambda: (
        Lambda(lambda s, x: s.conv(x.squeeze(1)), conv=nn.Conv2d(3, 4, 7, stride=7, bias=False)),
        (_r(1, 1, 3, 28, 21),),
    ),
)
case(
    "squeeze_intermediate_then_conv1d",
    "api: test_squeeze_custom_symbolic_registry (an intermediate squeezed)",
    lambda: (
        Lambda(
            lambda s, x: s.conv(torch.relu(s.lin(x)).squeeze(1)).sum(dim=2) @ s.w,
            lin=nn.Linear(5, 6),
            conv=nn.Conv1d(3, 4, 2),
            w=torch.randn(4, 2),
        ),
        (_r(2, 1, 3, 5),),
    ),
)
case(
    "cast_chain_bool_mask",
    "api: test_gradient_correctness_cast_chain",
    lambda: (
        Lambda(
            lambda s, b: s.a + b + s.a.bool().to(b.dtype),
            a=nn.Parameter(torch.rand(16) * (torch.rand(16) > 0.3)),
        ),
        (torch.rand(16),),
    ),
)
case(
    "triu_mask_on_linear",
    "api: test_register_custom_ops_pytorch_exporter_tensor_triu",
    lambda: (
        Lambda(lambda s, x: s.fc1(x) * torch.ones_like(s.fc1(x)).triu(diagonal=1), fc1=nn.Linear(10, 10)),
        (_r(1, 10, 10),),
    ),
)
case(
    "torch_triu_mask_on_linear",
    "api: test_register_custom_ops_pytorch_exporter_torch_triu",
    lambda: (
        Lambda(lambda s, x: s.fc1(x) * torch.triu(torch.ones_like(s.fc1(x))), fc1=nn.Linear(10, 10)),
        (_r(1, 10, 10),),
    ),
)
case(
    "where_bool_condition",
    "api: test_bool_input_and_output",
    lambda: (
        Lambda(lambda s, c, x1, x2: torch.relu(s.fc(torch.where(c, x1, x2))), fc=nn.Linear(6, 3)),
        (torch.rand(4, 6) > 0.5, _r(4, 6), _r(4, 6)),
    ),
)
case(
    "where_uint8_mask",
    "api: test_uint8_input_and_output",
    lambda: (
        Lambda(lambda s, c, x1, x2: torch.relu(s.fc(torch.where(c == 1, x1, x2))), fc=nn.Linear(6, 3)),
        (torch.randint(0, 2, (4, 6), dtype=torch.uint8), _r(4, 6), _r(4, 6)),
    ),
)


# conv transpose ---------------------------------------------------------------------------------------------
class _ChainedConvTranspose(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ct1 = nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1)
        self.ct2 = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
        self.ct3 = nn.ConvTranspose3d(3, 4, 3, stride=2, padding=1)

    def forward(self, x):  # noqa: ANN001, ANN201
        y = torch.relu(self.ct1(x))
        y = torch.relu(self.ct2(y.unsqueeze(2)))
        return torch.relu(self.ct3(y.unsqueeze(2))).squeeze(2)


case(
    "conv_transpose_1d_2d_3d_chain",
    "api: test_conv_transpose_gradient",
    lambda: (_ChainedConvTranspose(), (_r(1, 4, 8),)),
)
case(
    "conv_transpose3d_groups",
    "api: test_conv_transpose_gradient_with_groups",
    lambda: (nn.ConvTranspose3d(6, 4, 3, stride=2, padding=1, groups=2), (_r(1, 6, 3, 4, 4),)),
)
case(
    "conv_transpose3d_strides_padding_dilation_times_param",
    "api: test_conv_transpose_gradient_with_strides_padding_and_dilation",
    lambda: (
        Lambda(
            lambda s, x: s.ct(x) * s.param,
            ct=nn.ConvTranspose3d(4, 5, (3, 5, 2), stride=(2, 1, 1), padding=(0, 4, 2), dilation=(1, 2, 1)),
            param=nn.Parameter(torch.randn(2, 5, 7, 8, 3)),
        ),
        (_r(2, 4, 3, 8, 6),),
    ),
)


# outputs, parameters and inputs that are not differentiated -------------------------------------------------
def _non_differentiable_outputs(s, x):  # noqa: ANN001, ANN202
    out1 = torch.relu(s.fc1(x))
    out2 = s.fc2(out1)
    return out1, torch.gt(out1, 0.01).long(), out2, torch.lt(out2, 0.02).long()


case(
    "non_differentiable_outputs",
    "api: test_module_with_non_differential_output",
    lambda: (Lambda(_non_differentiable_outputs, fc1=nn.Linear(6, 5), fc2=nn.Linear(5, 3)), (_r(4, 6),)),
    keep_outputs=True,
    in_loss=(2,),
)
case(
    "duplicated_output",
    "api: test_duplicated_output",
    lambda: (Lambda(lambda s, x: (s.fc1(x), 2 * s.fc1(x)), fc1=nn.Linear(8, 4)), (_r(3, 2, 8),)),
)
case(
    "two_outputs_with_dependency",
    "api: test_loss_combines_two_outputs_with_dependency",
    lambda: (
        Lambda(
            lambda s, a, b: (torch.relu(s.fc1(a + b)), s.fc2(torch.relu(s.fc1(a + b)))),
            fc1=nn.Linear(6, 5),
            fc2=nn.Linear(5, 3),
        ),
        (_r(4, 6), _r(4, 6)),
    ),
)


case(
    "loss_from_one_of_two_outputs",
    "api: test_input_requires_grad_backward_creates_input_grad_as_required0",
    lambda: (
        Lambda(
            lambda s, a, b: (torch.relu(s.fc1(a + b)), torch.relu(s.fc2(a + b))),
            fc1=nn.Linear(6, 5),
            fc2=nn.Linear(6, 5),
        ),
        (_r(4, 6), _r(4, 6)),
    ),
    keep_outputs=True,
    in_loss=(0,),
)
case(
    "bypass_input",
    "api: test_model_with_bypass_input",
    lambda: (
        Lambda(lambda s, x1, x2: (s.net(x1).view(x2.size()[0], -1), x2), net=_mlp(6, 5, 3, nn.ReLU())),
        (_r(4, 6), _r(4, 6)),
    ),
)


class _Unused(nn.Module):
    def __init__(self, which: str) -> None:
        super().__init__()
        self.which = which
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(6 if which == "begin" else 5, 4)
        if which == "middle":
            self.fc3 = nn.Linear(5, 3)
        self.register_buffer("buffer", torch.ones({"begin": 4, "middle": 3, "end": 5}[which]))

    def forward(self, x):  # noqa: ANN001, ANN201
        if self.which == "begin":
            return torch.relu(self.fc2(x)) + self.buffer
        out = torch.relu(self.fc1(x))
        return (self.fc3(out) if self.which == "middle" else out) + self.buffer


for which in ("begin", "middle", "end"):
    case(
        f"unused_parameters_{which}",
        "api: test_unused_parameters",
        lambda which=which: (_Unused(which), (_r(4, 6),)),
    )


def _partially_frozen() -> tuple[nn.Module, tuple]:
    net = _mlp(6, 5, 3, nn.ReLU())
    net[0].requires_grad_(False)
    return net, (_r(4, 6),)


case("partially_frozen", "api: test_model_partially_requires_grad", _partially_frozen)
case(
    "buffers_params_and_constant",
    "api: test_model_with_constant_and_registered_parameters",
    lambda: (
        Lambda(
            lambda s, x: s.net(x) + s.param1 + s.param2 + torch.tensor([3.0], dtype=x.dtype) + s.buffer1s,
            net=_mlp(6, 5, 3, nn.ReLU()),
            param1=nn.Parameter(torch.ones(3)),
            param2=nn.Parameter(1 + torch.ones(3)),
            buffer1s=torch.ones(3),
        ),
        (_r(4, 6),),
    ),
)
for flag in (True, False):
    case(
        f"primitive_inputs_{flag}",
        "api: test_primitive_inputs",
        lambda flag=flag: (
            Lambda(
                lambda s, x: (
                    s.fc2(torch.relu(s.fc1(x + 100000 + -11209123.12452)))
                    if flag
                    else torch.relu(s.fc2(s.fc1(x + -100 + 1.23)))
                ),
                fc1=nn.Linear(6, 5),
                fc2=nn.Linear(5, 3),
            ),
            (_r(4, 6),),
        ),
    )


# padding elimination ops (onnxruntime checks the graph rewrite; the gradients are ported) -------------------
def _padded_ids() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    rows = []
    for n in (3, 1, 5):
        rows.append(
            torch.cat([torch.randint(2, 20, (n,), generator=g), torch.ones(6 - n, dtype=torch.int64)])
        )
    return torch.stack(rows)


def _padding_elimination(op: str, variant: int) -> tuple[nn.Module, tuple]:
    ids = _padded_ids()
    h = 8

    def fn(s, ids):  # noqa: ANN001, ANN202
        e = s.emb(ids)
        if op in ("Add", "Sub", "Mul"):
            one = {
                0: torch.ones(h, dtype=torch.long),
                2: torch.ones((ids.shape[0], 1, h), dtype=torch.long),
                3: torch.ones((1, h), dtype=torch.long),
                4: torch.ones(ids.shape, dtype=torch.long).unsqueeze(-1).expand(-1, -1, h),
            }[variant]
            return {"Add": one + e, "Sub": one - e, "Mul": one * e}[op]
        if op == "MatMul":
            return torch.matmul(e, s.w) if variant == 0 else torch.matmul(s.w2, e)
        if op == "LayerNormalization":
            return s.ln(e)
        if op == "BiasGelu":
            return F.gelu(e + s.bias)
        if op == "Gelu":
            return F.gelu(e)
        if op == "Cast":
            return e.to(torch.float16).to(e.dtype)
        return torch.mean(e, dim=-1 if variant == 0 else 0)

    module = Lambda(
        fn,
        emb=nn.Embedding(20, h, padding_idx=1),
        ln=nn.LayerNorm(h, eps=1e-5),
        w=torch.randn(h, 5),
        w2=torch.randn(2, ids.shape[1]),
        bias=torch.randn(h),
    )
    return _no_padding_idx(module), (ids,)


for op, variant in [
    ("Add", 0),
    ("Add", 2),
    ("Add", 3),
    ("Add", 4),
    ("Sub", 0),
    ("Sub", 2),
    ("Sub", 3),
    ("Sub", 4),
    ("Mul", 0),
    ("Mul", 2),
    ("Mul", 3),
    ("Mul", 4),
    ("MatMul", 0),
    ("MatMul", 1),
    ("LayerNormalization", 0),
    ("Cast", 0),
    ("BiasGelu", 0),
    ("Gelu", 0),
    ("ReduceMean", 0),
    ("ReduceMean", 1),
]:
    case(
        f"padding_elimination_{op}_{variant}",
        "api: test_ops_for_padding_elimination",
        lambda op=op, variant=variant: _padding_elimination(op, variant),
        # LayerNorm's epsilon attribute and Gelu's constants are float32; the Cast goes through float16
        float32=op in ("Cast", "LayerNormalization", "Gelu", "BiasGelu"),
        full_only=op in ("Sub", "Mul"),
    )


class _ToyBert(nn.Module):
    """onnxruntime's test_e2e_padding_elimination model, small: embeddings, attention layers, a classifier."""

    def __init__(
        self, layers: int = 2, vocab: int = 20, hidden: int = 8, heads: int = 2, labels: int = 3
    ) -> None:
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(vocab, hidden, padding_idx=1)
        self.token_type = nn.Embedding(1, hidden)
        self.ln = nn.LayerNorm(hidden, eps=1e-5)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "q": nn.Linear(hidden, hidden),
                    "k": nn.Linear(hidden, hidden),
                    "v": nn.Linear(hidden, hidden),
                    "dense": nn.Linear(hidden, hidden),
                    "ln": nn.LayerNorm(hidden, eps=1e-5),
                }
            )
            for _ in range(layers)
        )
        self.out = nn.Linear(hidden, labels)

    def _heads(self, x):  # noqa: ANN001, ANN202
        b, t, h = x.shape
        return x.view(b, t, self.heads, h // self.heads).permute(0, 2, 1, 3)

    def forward(self, ids, mask, target):  # noqa: ANN001, ANN201
        h = self.ln(self.word(ids) + self.token_type(torch.zeros(ids.shape, dtype=torch.long)))
        ext = (1.0 - mask[:, None, None, :].to(h.dtype)) * torch.finfo(torch.float32).min
        for layer in self.layers:
            q, k, v = (self._heads(layer[n](h)) for n in "qkv")
            p = F.softmax(torch.matmul(q, k.transpose(-1, -2)) / (q.shape[-1] ** 0.5) + ext, dim=-1)
            ctx = torch.matmul(p, v).permute(0, 2, 1, 3).contiguous()
            ctx = ctx.view(ctx.shape[0], ctx.shape[1], -1)
            h = layer["ln"](layer["dense"](ctx) + h)
        return F.cross_entropy(self.out(h[:, 0, :]), target)


def _toy_bert() -> tuple[nn.Module, tuple]:
    ids = _padded_ids()
    mask = (ids != 1).to(torch.get_default_dtype())
    return _no_padding_idx(_ToyBert()), (ids, mask, torch.tensor([0, 2, 1]))


case("toy_bert_padded_batch", "api: test_e2e_padding_elimination", _toy_bert, float32=True)


# ops torch modules often use that the stored onnxruntime file has no test of (source "extra") -------------
EXTRA = "extra (no onnxruntime test)"
case(
    "topk_values",
    EXTRA,
    lambda: (
        Lambda(lambda s, x: (torch.topk(x, 3, dim=1).values, torch.topk(x, 2, dim=0, largest=False).values)),
        (torch.rand(4, 6),),
    ),
)
case(
    "cumsum_both_ways",
    EXTRA,
    lambda: (
        Lambda(lambda s, x: (torch.cumsum(x, 1), torch.cumsum(x.flip(0), 0).flip(0))),
        (torch.rand(4, 5),),
    ),
)
case(
    "log_softmax_dims",
    EXTRA,
    lambda: (Lambda(lambda s, x: (F.log_softmax(x, dim=-1), F.log_softmax(x, dim=1))), (_r(2, 3, 5),)),
)
for approx in ("none", "tanh"):
    case(
        f"linear_gelu_{approx}",
        EXTRA,
        lambda approx=approx: (
            Lambda(lambda s, x: F.gelu(s.fc(x), approximate=approx), fc=nn.Linear(6, 5)),
            (_r(4, 6),),
        ),
        float32=True,
    )
case("layer_norm_affine", EXTRA, lambda: (nn.LayerNorm((3, 5)), (_r(2, 3, 5),)), float32=True)
case(
    "masked_fill_scores",
    EXTRA,
    lambda: (
        Lambda(
            lambda s, q, k: (
                F.softmax((q @ k.transpose(-1, -2)).masked_fill(s.mask, float("-inf")), dim=-1) @ k
            ),
            mask=torch.triu(torch.ones(4, 4, dtype=torch.bool), 1),
        ),
        (_r(2, 4, 3), _r(2, 4, 3)),
    ),
)
case(
    "gather_scatter_index_ops",
    EXTRA,
    lambda: (
        Lambda(
            lambda s, x, idx: (
                x.gather(1, idx),
                torch.zeros_like(x).scatter(1, idx[:, :1], x[:, :1]),
                x.index_select(0, torch.tensor([2, 0, 2])),
                x[idx[:, 0]],
            )
        ),
        (_r(3, 4), torch.tensor([[1, 3], [0, 0], [2, 1]])),
    ),
)
case(
    "boolean_mask_read_and_write",
    EXTRA,
    lambda: (
        Lambda(
            lambda s, x, m: (x[m], x.masked_fill(~m, 0.0), torch.where(m, x, x * 2).index_put((m,), x[m] * 3))
        ),
        (
            _r(3, 4),
            torch.tensor(
                [[True, False, True, False], [False, False, False, False], [True, True, True, True]]
            ),
        ),
    ),
)
for sa, sb in (((5,), (5,)), ((5,), (5, 3)), ((2, 5), (5,)), ((2, 1, 3, 5), (4, 5, 2)), ((4, 3, 5), (5, 2))):
    case(
        f"matmul_{'x'.join(map(str, sa))}_by_{'x'.join(map(str, sb))}",
        EXTRA,
        lambda sa=sa, sb=sb: (Lambda(lambda s, a, b: torch.matmul(a, b)), (_r(*sa), _r(*sb))),
    )


# ---- running a case ----------------------------------------------------------------------------------------


def _make(name: str, dtype: torch.dtype) -> tuple[nn.Module, tuple, dict[int, torch.Tensor]]:
    """Case ``name``'s module (training mode) and inputs in ``dtype``, and the fixed random weight r of each
    output the loss reads (by output index)."""
    spec = CASES[name]
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        module, args = spec.make()
    finally:
        torch.set_default_dtype(prev)
    module = module.to(dtype).train()
    args = tuple(a.detach().to(dtype) if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        outs = _as_tuple(module(*args))
    g = torch.Generator().manual_seed(1)
    weights = {
        i: torch.randn(y.shape, generator=g, dtype=y.dtype)
        for i, y in enumerate(outs)
        if y.is_floating_point() and (spec.in_loss is None or i in spec.in_loss)
    }
    return module, args, weights


def _as_tuple(out: torch.Tensor | tuple) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class _Loss(nn.Module):
    """Σ y·r over the outputs of ``module`` that ``weights`` names; with ``keep``, the module's outputs follow
    the loss."""

    def __init__(self, module: nn.Module, weights: dict[int, torch.Tensor], keep: bool) -> None:
        super().__init__()
        self.module = module
        self.keep = keep
        self.read = sorted(weights)
        for i, r in weights.items():
            # (a 0-dim weight would be a scalar to the exporter, which computes scalars in float32)
            self.register_buffer(f"r{i}", r.reshape(r.shape or (1,)))

    def forward(self, *args):  # noqa: ANN002, ANN201
        outs = _as_tuple(self.module(*args))
        # (summed as a 1-D tensor: an op on two 0-dim tensors would be exported in float32, see above)
        loss = torch.cat([(outs[i] * getattr(self, f"r{i}")).sum().reshape(1) for i in self.read]).sum()
        return (loss, *outs) if self.keep else loss


def _export(
    module: nn.Module, args: tuple, opset: int, n_outputs: int | None = None, dynamic: bool = False
) -> onnx.ModelProto:
    """The TorchScript export of ``module`` (inputs in0, in1, ...; outputs out0, out1, ... when
    ``n_outputs`` is given); ``dynamic``: every dim of every input dynamic, as ORTModule exports."""
    f = io.BytesIO()
    names = [f"in{i}" for i in range(len(args))]
    axes = {n: {ax: f"{n}_{ax}" for ax in range(a.dim())} for n, a in zip(names, args)} if dynamic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(
                module,
                args,
                f,
                dynamo=False,
                opset_version=opset,
                input_names=names,
                dynamic_axes=axes,
                output_names=None if n_outputs is None else [f"out{i}" for i in range(n_outputs)],
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
            )
        except Exception as e:  # noqa: BLE001
            msg = str(e).splitlines()[0][:160]
            pytest.skip(f"torch's TorchScript exporter fails: {type(e).__name__}: {msg}")
    return onnx.load_from_string(f.getvalue())


def _close(what: str, got: np.ndarray, want: np.ndarray, dtype: torch.dtype, floor: float) -> str | None:
    """None if ``got`` is ``want`` to ``dtype``'s tolerance, else a message. ``floor``: the least scale atol
    applies to (a gradient that is 0 analytically is roundoff on both sides, at the case's scale)."""
    rtol, atol = TOL[dtype]
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        return f"{what}: shape {got.shape} vs {want.shape}"
    scale = float(np.abs(want).max()) if want.size else 0.0
    bad = ~(np.abs(got - want) <= rtol * np.abs(want) + atol * max(scale, floor, 1e-30))
    if bad.any():
        diff = float(np.nanmax(np.abs(got - want)))
        return f"{what}: {int(bad.sum())}/{want.size} off, max abs diff {diff:.3g} (max |torch| {scale:.3g})"
    return None


def _check(name: str, dtype: torch.dtype, runners: tuple[str, ...], style: str) -> list[str]:
    """Export case ``name`` in ``dtype``, differentiate it and compare what the ``runners`` compute with
    torch: one message per value that differs.

    ``style`` "loss": the loss Σ y·r inside the graph, differentiated by ``build_gradient_model``.
    "ortmodule": as ORTModule differentiates a module: the graph's float outputs are the ys of a
    ``GradientGraphBuilder`` without a loss, each fed its incoming gradient ``<y>_grad`` (r, or zeros for an
    output the loss does not read), against ``torch.autograd.backward(outputs, r)``; "ortmodule_dynamic": the
    same on an export whose input dims are all dynamic, as ORTModule exports, run also at other sizes of the
    inputs' first dim (1, and twice the export's: ORTModule reuses its graph for every batch size), where
    torch takes them."""
    spec = CASES[name]
    module, args, weights = _make(name, dtype)
    with torch.no_grad():
        n_out = len(_as_tuple(module(*args)))
    if style == "loss":
        module = _Loss(module, weights, spec.keep_outputs)
        model = _export(module, args, spec.opset)
    else:
        model = _export(module, args, spec.opset, n_out, dynamic=style == "ortmodule_dynamic")

    inits = {t.name for t in model.graph.initializer}
    given = [i.name for i in model.graph.input if i.name not in inits]
    names = [f"in{k}" if f"in{k}" in given else None for k in range(len(args))]
    params = [n for n, p in module.named_parameters() if p.requires_grad]
    # the parameters the export left out must be those torch gives no gradient (checked at each run)
    dropped = [p for p in params if p not in inits]
    diff_in = [k for k, a in enumerate(args) if a.is_floating_point() and names[k] is not None]
    wrt = [p for p in params if p in inits] + [names[k] for k in diff_in]
    if style == "loss":
        gmodel = build_gradient_model(model, model.graph.output[0].name, wrt)
        ys = []
    else:
        with torch.no_grad():
            ys = [f"out{i}" for i, y in enumerate(_as_tuple(module(*args))) if y.is_floating_point()]
        builder = GradientGraphBuilder(model, ys, wrt, "")
        builder.build()
        gmodel = onnx.load_from_string(builder.get_model())
    onnx.checker.check_model(gmodel, full_check=True)
    sessions = {}
    if "onnxruntime" in runners:
        # (ConstantSharing merges equal initializers, which breaks onnxruntime's training BatchNormalization:
        # onnxruntime#29790, see test_torch_models.py)
        sessions["onnxruntime"] = ort.InferenceSession(
            gmodel.SerializeToString(),
            providers=["CPUExecutionProvider"],
            disabled_optimizers=["ConstantSharing"],
        )

    errors = []
    for tag, run_args in _sizes(module, args, n_out, style == "ortmodule_dynamic"):
        if run_args is not args:  # fresh weights for the outputs' new shapes
            with torch.no_grad():
                outs = _as_tuple(module(*run_args))
            g = torch.Generator().manual_seed(2)
            weights = {i: torch.randn(outs[i].shape, generator=g, dtype=outs[i].dtype) for i in weights}
        ts = [a.clone().requires_grad_(k in diff_in) for k, a in enumerate(run_args)]
        module.zero_grad(set_to_none=True)
        out = _as_tuple(module(*ts))
        if style == "loss":
            out[0].backward()
        else:
            pairs = [(out[i], r) for i, r in weights.items() if out[i].requires_grad]
            torch.autograd.backward([y for y, _ in pairs], [r for _, r in pairs])
        grads = {p: t.grad for p, t in module.named_parameters()}
        grads.update({names[k]: ts[k].grad for k in diff_in})
        assert all(grads[p] is None for p in dropped), f"parameters missing from the export: {dropped}"
        want = {n: None if w is None else w.numpy() for n, w in grads.items()}
        # the outputs compared: the loss (and the module's outputs with keep_outputs), or the module's outputs
        shown = model.graph.output if spec.keep_outputs or style != "loss" else model.graph.output[:1]
        outputs = {o.name: y.detach().numpy() for o, y in zip(shown, out)}

        feeds = {names[k]: a.numpy() for k, a in enumerate(run_args) if names[k] is not None}
        fed = {i.name for i in gmodel.graph.input}
        for y in ys:
            i = int(y[3:])
            if f"{y}_grad" in fed:
                feeds[f"{y}_grad"] = (
                    weights[i] if i in weights else torch.zeros(out[i].shape, dtype=dtype)
                ).numpy()
        runs = {}
        if "engine" in runners:
            runs["engine"] = run_engine(gmodel, feeds)
        for runner, sess in sessions.items():
            runs[runner] = sess.run(None, feeds)
        # 1e-3 of the case's largest gradient: the scale of the roundoff in a gradient that is exactly 0
        floor = 1e-3 * max(
            (float(np.abs(w).max()) for w in want.values() if w is not None and w.size), default=0.0
        )
        for runner, values in runs.items():
            got = dict(zip([o.name for o in gmodel.graph.output], values))
            what = f"{runner}{tag}"
            for o, y in outputs.items():  # integer outputs (indices, masks) exactly
                if y.dtype.kind == "f":
                    errors.append(_close(f"{what} output {o}", got[o], y, dtype, 0.0))
                elif not np.array_equal(got[o], y):
                    errors.append(f"{what} output {o}: {got[o].tolist()} vs torch {y.tolist()}")
            for n in wrt:
                g = got[f"{n}_grad"]
                w = np.zeros(g.shape) if want[n] is None else want[n]
                errors.append(_close(f"{what} {n}", g, w, dtype, floor))
    return [e for e in errors if e]


def _sizes(module: nn.Module, args: tuple, n_out: int, others: bool) -> list[tuple[str, tuple]]:
    """The inputs to run at, each with a tag for messages: ``args``, and with ``others`` their first entries
    along dim 0 and the inputs repeated twice along it (float values other than 0/1 masks scaled by 1 + ε,
    ε ~ 1e-3, against ties), those torch takes with as many outputs."""
    out = [("", args)]
    if not others or not all(a.dim() > 0 and a.shape[0] > 1 for a in args):
        return out
    g = torch.Generator().manual_seed(4)

    def doubled(a: torch.Tensor) -> torch.Tensor:
        b = a.repeat(2, *[1] * (a.dim() - 1))
        if not a.is_floating_point() or bool(((a == 0) | (a == 1)).all()):
            return b
        return b * (1 + 1e-3 * torch.randn(b.shape, generator=g, dtype=b.dtype))

    for n, new in ((1, tuple(a[:1] for a in args)), (2 * args[0].shape[0], tuple(doubled(a) for a in args))):
        try:
            with torch.no_grad():
                if len(_as_tuple(module(*new))) != n_out:
                    continue
        except Exception:  # noqa: BLE001 - torch refuses that size (fixed-size buffers, index ranges)
            continue
        out.append((f" (dim 0 = {n})", new))
    return out


# the cases run on dynamic-axes exports by default (the others with ONNXTRAIN_FULL_TESTS=1): those whose
# export reads its input shapes at run time
DYNAMIC_DEFAULT = {
    "squeeze_then_conv",
    "squeeze_intermediate_then_conv1d",
    "slice_past_end",
    "chunk_dim_1",
    "diagonal_dims_02",
    "bypass_input",
    "index_put_repeated_-1",
    "argmax_linear_unfold",
    "upsample_nearest_rank4_size",
    "toy_bert_padded_batch",
}


def _style_params() -> list:
    """Every case in each style; by default the cases not in EXTENDED in one of the two static styles, in
    turn (``loss`` and ``ortmodule`` each on half of them), and those of DYNAMIC_DEFAULT dynamic too."""
    out = []
    default = [name for name in CASES if name not in EXTENDED]
    for name in CASES:
        for style in ("loss", "ortmodule", "ortmodule_dynamic"):
            if style == "ortmodule_dynamic":
                full_only = name not in DYNAMIC_DEFAULT
            else:
                full_only = name in EXTENDED or style != ("loss", "ortmodule")[default.index(name) % 2]
            out.append(
                pytest.param(
                    name, style, id=f"{name}-{style}", marks=[pytest.mark.extended] if full_only else []
                )
            )
    return out


@pytest.mark.parametrize("name,style", _style_params())
def test_gradients_match_torch(name: str, style: str) -> None:
    spec = CASES[name]
    if spec.float32:
        errors = _check(name, torch.float32, ("engine", "onnxruntime"), style)
    else:
        try:
            errors = _check(name, torch.float64, ("engine", "onnxruntime"), style)
        except ort.capi.onnxruntime_pybind11_state.NotImplemented:
            # onnxruntime's CPU kernels of some ops (Conv, ConvTranspose, Resize, Erf, ...) take float32 only
            errors = _check(name, torch.float64, ("engine",), style) + _check(
                name, torch.float32, ("onnxruntime",), style
            )
    assert not errors, f"{name} ({spec.source}, {style}):\n  " + "\n  ".join(errors)

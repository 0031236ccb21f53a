"""Horizontal (Megatron) parallelism in combination on ``mpiexec -n 2``, against one process training the
unsplit model on the same batches; and models the split must leave whole.

Models (``tests/parallel/horizontal_combo_worker.py``): two MLP blocks between LayerNorms (MatMul + bias,
ReLU; Gemm without biases, erf GELU), a GELU block with a Dropout inside, onnxtrain's transformer with 2 or 4
heads and a causal mask, torch 2.13's export of a 2-layer GPT (fused QKV, causal mask, tanh GELU). Options:
gradient_accumulation_steps 1 / 2 (the session counting the runs, or micro-steps fetching
``Group_Accumulated_Gradients``) × clipping × float16 mixed precision × SGD / Adam / LAMB × numpy engine /
onnxruntime backend × frozen weights. The default suite runs a pairwise selection in one ``mpiexec``;
``ONNXTRAIN_FULL_TESTS=1`` every combination.

Oracles, in one process without MPI, on the case's backend:

* SGD and Adam: the unsplit model, accumulating the same micro-batches (the session counting them).
* LAMB takes its trust ratio per share (README, as onnxruntime's Megatron): one process on the same model
  whose split weights are stored as two separate initializers (each rank's share) joined by ``Concat`` in
  the graph, so the function and the global norm are the unsplit model's and LAMB's ratio is per share.
* The Dropout inside a block: rank r drops on its half of the hidden units with the agreed seed + 7919·r;
  one process on the model whose hidden units are cut in halves, each dropped with that seed.

Tolerances (relative, per tensor: ‖got − want‖ / ‖want‖): 1e-4 in float32 — the split sums round
differently from one product (≈1e-7 a step), and Adam's or LAMB's normalisation carries that through 3
updates of up to 6 runs with a gain of tens for elements whose gradients are small (measured: 5.4e-5 at most,
the GPT under Adam with accumulation; the onnxruntime backend's kernels add another summation order), while
a weight counted twice in the norm, a missed clip, a dropped micro-batch or a share updated with the wrong
gradient is ≥ 1e-3 off. Under float16 mixed precision (the reference too) the ranks add float16 partial sums
of half products, which round differently from one float16 product (≈ 5e-4 a value): losses, norms and SGD's
state within 2e-2. Adam and LAMB divide by the gradients' size, so elements whose gradients are mostly
rounding move by whole steps either way: measured, one process with a loss scale of 250 instead of 256
moves a tensor by up to 17 % (attn2's fc2.bias) and the GPT's by more, while the split stays within 21 % a
tensor (the GPT's LayerNorm biases, which start at zero) and 2.4 % over all weights taken as one vector; the
bounds are 3e-1 a tensor and 5e-2 for all weights (a gradient left loss-scaled, a norm counted twice or a
missed clip is off by far more, and shows in the norms at 2e-2). Norms fetched at each update: the losses'
tolerance. The weights every rank holds whole must be bit for bit equal on both ranks (and their optimizer
state).
"""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.parallel.megatron import find_mlp_blocks, shard_blocks
from onnxtrain.parallel.megatron_attention import find_attention_blocks
from onnxtrain.session_horizontal import SHARE_SEED_STEP
from tests.parallel import horizontal_combo_worker as hw
from tests.parallel.conftest import run_mpi
from tests.tiers import extended

WORKER = hw.__file__


# ---- models the split must leave whole (one process) -------------------------------------------------------
def _shared_transpose_model() -> onnx.ModelProto:
    """A ReLU block whose first weight (torch's layout, read through one Transpose) is applied again after
    the block: the Transpose's output has two readers."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array((rng.standard_normal(s) * 0.3).astype(np.float32), n)
        for n, s in (("W1", (16, 8)), ("W2", (8, 16)), ("W3", (4, 16)))
    ]
    nodes = [
        helper.make_node("Transpose", ["W1"], ["W1t"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "W1t"], ["a"]),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Transpose", ["W2"], ["W2t"], perm=[1, 0]),
        helper.make_node("MatMul", ["ar", "W2t"], ["o"]),
        helper.make_node("Add", ["o", "x"], ["h"]),
        helper.make_node("MatMul", ["h", "W1t"], ["a2"]),  # W1 again
        helper.make_node("Transpose", ["W3"], ["W3t"], perm=[1, 0]),
        helper.make_node("MatMul", ["a2", "W3t"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "shared_transpose",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_weight_read_through_a_shared_transpose_stays_whole() -> None:
    """W1 reaches two products through one Transpose: it is not a block's weight (it was taken into two
    blocks, and cutting the second block's share from the first's failed on rank 1 with an IndexError)."""
    m = _shared_transpose_model()
    weights = ["W1", "W2", "W3"]
    assert find_mlp_blocks(m, weights, 2) == []
    assert find_attention_blocks(m, weights, 2) == []
    for rank in (0, 1):
        sharded, _, split = shard_blocks(m, [], rank, 2)
        assert split == {}


# ---- the references --------------------------------------------------------------------------------------
def _shards(model: onnx.ModelProto, case: hw.Case) -> dict:
    """The weights the two-way split cuts (name → SplitWeight)."""
    from onnxtrain.training_graph import select_trainable

    trainable = select_trainable(model, hw.params(case, model, split=False))
    mlp = find_mlp_blocks(model, trainable, 2)
    taken = {k for b in mlp for k in (*b.entries, b.second)}
    blocks = sorted([*mlp, *find_attention_blocks(model, trainable, 2, taken)], key=lambda b: min(b.entries))
    return shard_blocks(model, blocks, 0, 2)[2]


def _split_weights(model: onnx.ModelProto, case: hw.Case) -> dict[str, tuple[int, tuple[int, ...]]]:
    """The weights the two-way split cuts: name → (axis, the axis's segments)."""
    return {w: (sw.axis, sw.segments) for w, sw in _shards(model, case).items()}


ROWS = ("W2", "W4", "attn.out.weight", "fc2.weight", "attn.proj.weight", "fc_out.weight")  # second products


def partition_info(case: hw.Case) -> list[str]:
    """``get_partition_info_map()`` as the worker writes it (``weight:original dims:row partition``): each
    split weight's whole shape, 1 for the second products' weights (split by rows), else 0 (by columns)."""
    model = hw.model_of(case.model)
    dims = {t.name: list(t.dims) for t in model.graph.initializer}
    return sorted(
        f"{w}:{','.join(map(str, dims[w]))}:{int(w.endswith(ROWS))}" for w in _split_weights(model, case)
    )


def _share(full: np.ndarray, axis: int, segments: tuple[int, ...], r: int) -> np.ndarray:
    """Rank ``r``'s half of ``full`` along ``axis``: of each segment (a fused QKV weight's three) in turn."""
    pieces = np.split(full, np.cumsum(segments)[:-1], axis=axis)
    return np.concatenate([np.split(p, 2, axis=axis)[r] for p in pieces], axis=axis)


def _joined(parts: list[np.ndarray], axis: int, segments: tuple[int, ...]) -> np.ndarray:
    """The whole tensor from the two halves :func:`_share` cuts."""
    halves = [np.split(p, np.cumsum([s // 2 for s in segments])[:-1], axis=axis) for p in parts]
    return np.concatenate([halves[r][j] for j in range(len(segments)) for r in (0, 1)], axis=axis)


def per_share_model(model: onnx.ModelProto, split: dict[str, tuple[int, tuple[int, ...]]]) -> onnx.ModelProto:
    """``model`` with each split weight stored as its two ranks' shares (``<w>__share<r>``), joined in the
    graph by Split and Concat: the same function, but an optimizer that works per tensor (LAMB's trust
    ratio) sees the shares."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    nodes = []
    for w, (axis, segments) in split.items():
        full = numpy_helper.to_array(inits[w])
        g.initializer.remove(inits[w])
        names = [f"{w}__share{r}" for r in (0, 1)]
        g.initializer.extend(
            numpy_helper.from_array(_share(full, axis, segments, r), n) for r, n in enumerate(names)
        )
        if len(segments) == 1:
            nodes.append(helper.make_node("Concat", names, [w], axis=axis))
            continue
        sizes = f"{w}__segment_sizes"
        g.initializer.append(numpy_helper.from_array(np.array([s // 2 for s in segments], np.int64), sizes))
        pieces = [[f"{n}__seg{j}" for j in range(len(segments))] for n in names]
        nodes += [helper.make_node("Split", [n, sizes], pieces[r], axis=axis) for r, n in enumerate(names)]
        nodes.append(
            helper.make_node(
                "Concat", [pieces[r][j] for j in range(len(segments)) for r in (0, 1)], [w], axis=axis
            )
        )
    old = list(g.node)
    del g.node[:]
    g.node.extend([*nodes, *old])
    return m


def reference(case: hw.Case, seeds: np.ndarray) -> dict[str, np.ndarray]:
    """One process's losses, fetched norms and state (under the unsplit model's names) for ``case``."""
    model = hw.drop_model((int(seeds[0]), int(seeds[0]) + SHARE_SEED_STEP)) if case.model == "drop" else None
    model = hw.model_of(case.model) if model is None else model
    split = _split_weights(hw.model_of(case.model), case)
    if case.opt == "lamb":
        model = per_share_model(model, split)
    sess = hw.session(case, model, split=False)
    losses, norms = hw.steps(sess, case, 0, hw.STEPS)
    state = sess.get_state()
    if case.opt == "lamb":  # the shares' state joined under the whole weight's names
        for key in [k for k in state if "__share0" in k]:
            w = next(w for w in split if f"{w}__share0" in key)
            parts = [state.pop(key), state.pop(key.replace("__share0", "__share1"))]
            whole = key.replace(f"{w}__share0", w)
            if parts[0].ndim == 0 or parts[0].shape == (1,):  # a step count
                assert np.array_equal(parts[0], parts[1]), key
                state[whole] = parts[0]
            else:
                state[whole] = _joined(parts, *split[w])
    return {
        "losses": np.asarray(losses),
        "norms": np.asarray(norms),
        "split": split,
        **{f"state/{k}": v for k, v in state.items()},
    }


# ---- the checks --------------------------------------------------------------------------------------------
def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tolerance(case: hw.Case) -> float:
    """See the module docstring."""
    return 2e-2 if case.mp else 1e-4


def state_tolerance(case: hw.Case) -> tuple[float, float]:
    """Per state tensor, and for all weights as one vector; see the module docstring (Adam and LAMB under
    mixed precision)."""
    return (3e-1, 5e-2) if case.mp and case.opt != "sgd" else (tolerance(case), tolerance(case))


def _masters_error(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    """The relative error of all float32 weights (no optimizer state, no half twins) taken as one vector."""
    keys = [k for k, v in want.items() if v.dtype == np.float32 and not k.startswith(("Moment_", "Update_"))]
    a = np.concatenate([np.ravel(got[k]) for k in keys]) if keys else np.zeros(0)
    b = np.concatenate([np.ravel(want[k]) for k in keys]) if keys else np.zeros(0)
    return rel_err(a, b)


def _whole_name(local: str, split: dict) -> tuple[str, str | None]:
    """A rank's state name under the whole model's name, and the split weight it belongs to (else None)."""
    for w in split:
        for share in (f"{w}_{kind}_rank_{r}" for kind in ("column", "row") for r in (0, 1)):
            if share in local:
                return local.replace(share, w), w
    return local, None


def _without_key_bias(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The attention key biases zeroed (their optimizer state too; the key part of the GPT's fused QKV bias,
    the middle third, of a share as well): their gradient is rounding noise (softmax ignores a shift along
    the keys), which Adam and LAMB turn into steps of their own."""
    out = dict(state)
    for k, v in state.items():
        if "attn.k.bias" in k:
            out[k] = np.zeros_like(v)
        elif "attn.qkv.bias" in k and v.ndim == 1:
            out[k] = v.copy()
            out[k][v.size // 3 : 2 * v.size // 3] = 0
    return out


def check_case(name: str, got: dict[str, np.ndarray], want: dict) -> list[str]:
    """What differs between the ranks' results and one process's (empty: all well)."""
    case = hw.Case.parse(name)
    tol, split = tolerance(case), want["split"]
    state_tol, masters_tol = state_tolerance(case)
    bad = []
    if case.model.startswith(("attn", "gpt")) and not any(".attn." in w for w in split):
        bad.append(f"its attention does not split: {sorted(split)}")
    ref = _without_key_bias({k[6:]: v for k, v in want.items() if k.startswith("state/")})
    for r in (0, 1):
        mine = {k[len(f"{name}/{r}/") :]: v for k, v in got.items() if k.startswith(f"{name}/{r}/")}
        mine = _without_key_bias(mine)
        for what in ("losses", "norms"):
            if mine[what].shape != want[what].shape:
                bad.append(f"rank {r} {what}: {mine[what]} != {want[what]}")
            elif rel_err(mine[what], want[what]) > tol:
                bad.append(f"rank {r} {what}: relative error {rel_err(mine[what], want[what]):.3g}")
        if sorted(mine["split"]) != sorted(split):
            bad.append(f"rank {r}: split {sorted(mine['split'])} != {sorted(split)}")
        if list(mine["info"]) != partition_info(case):
            bad.append(f"rank {r}: partition info {list(mine['info'])} != {partition_info(case)}")
        gathered = {k[6:]: v for k, v in mine.items() if k.startswith("state/")}
        if sorted(gathered) != sorted(ref):
            bad.append(f"rank {r}: gathered names {sorted(set(gathered) ^ set(ref))} differ")
            continue
        for k, v in ref.items():
            g = gathered[k]
            if g.shape != v.shape or g.dtype != v.dtype:
                bad.append(f"rank {r} {k}: {g.shape} {g.dtype} != {v.shape} {v.dtype}")
            elif v.dtype.kind in "iub":
                if not np.array_equal(g, v):
                    bad.append(f"rank {r} {k}: {g} != {v}")
            elif rel_err(g, v) > (max(state_tol, 1e-3) if v.dtype == np.float16 else state_tol):
                bad.append(f"rank {r} {k}: relative error {rel_err(g, v):.3g}")
        if _masters_error(gathered, ref) > masters_tol:
            bad.append(f"rank {r}: the weights' relative error {_masters_error(gathered, ref):.3g}")
        # the rank's own state: its shares of the split tensors, the rest whole
        local = {k[6:]: v for k, v in mine.items() if k.startswith("local/")}
        for k, v in local.items():
            whole, w = _whole_name(k, split)
            if whole not in ref:
                bad.append(f"rank {r}: its {k} is no state of one process's")
                continue
            expect = (
                ref[whole] if w is None or ref[whole].shape == v.shape else _share(ref[whole], *split[w], r)
            )
            limit = max(state_tol, 1e-3 * (v.dtype == np.float16))
            if expect.shape != v.shape or (v.size and rel_err(v, expect) > limit):
                bad.append(f"rank {r} own {k}: not its share of {whole}")
    # every tensor both ranks hold whole: bit for bit the same
    for k in [k for k in got if k.startswith(f"{name}/0/local/") and "_rank_0" not in k]:
        other = got.get(k.replace(f"{name}/0/", f"{name}/1/"))
        if other is None or not np.array_equal(got[k], other):
            bad.append(f"{k[len(name) + 9 :]}: ranks 0 and 1 differ")
    return [f"{name}: {m}" for m in bad]


def _selected(sweep: str) -> list[hw.Case]:
    """``pairwise``: a few cases holding every pair of option values (17); ``every``: all 672."""
    cases = hw.all_cases()
    return cases if sweep == "every" else hw.pairwise(cases)


@pytest.fixture(scope="module")
def gpt2_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    """torch 2.13's export of a two-layer GPT (4 heads, causal mask, fused QKV, tanh GELU)."""
    pytest.importorskip("torch")
    from tests.graph_transforms import nets

    path = str(tmp_path_factory.mktemp("gpt2") / "gpt2.onnx")
    onnx.save(nets.gpt(2, dropout=0.0, seq=10), path)
    return path


def _run_worker(tmp_path, gpt2: str, *args: str, timeout: float) -> dict[str, np.ndarray]:
    out = tmp_path / f"{args[0]}.npz"
    t0 = time.perf_counter()
    r = run_mpi(args[0], str(out), *args[1:], worker=WORKER, timeout=timeout, env={hw.GPT2_ENV: gpt2})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    print(f"mpiexec -n 2 {args[0]}: {time.perf_counter() - t0:.1f} s")
    return dict(np.load(out))


@pytest.mark.mpi
@pytest.mark.parametrize("sweep", ["pairwise", extended("every", id="every")])
def test_split_options_in_combination(tmp_path, monkeypatch, gpt2_path: str, sweep: str) -> None:
    """Every selected combination on 2 ranks: losses, fetched global norms, gathered state and each rank's
    own shares equal one process's; the weights both ranks hold whole are bit for bit equal."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv(hw.GPT2_ENV, gpt2_path)
    cases = _selected(sweep)
    got = _run_worker(
        tmp_path,
        gpt2_path,
        "train",
        ",".join(c.name for c in cases),
        timeout=3600 if sweep == "every" else 300,
    )
    bad = []
    for c in cases:
        bad += check_case(c.name, got, reference(c, got[f"{c.name}/0/seeds"]))
    assert not bad, "\n".join(bad)


# each model's blocks: the weights a two-way split cuts (an MLP's two products and first bias; an attention's
# Q, K, V projections and their biases, or the fused QKV, and its output projection)
SPLIT_BY_MODEL = {
    "mlp": {"W1", "b1", "W2", "W3", "W4"},
    "attn2": {
        f"layer0.{w}"
        for w in (
            *(f"attn.{p}.{k}" for p in "qkv" for k in ("weight", "bias")),
            "attn.out.weight",
            "fc1.weight",
            "fc1.bias",
            "fc2.weight",
        )
    },
    "gpt2": {
        f"model.blocks.{i}.{w}"
        for i in (0, 1)
        for w in (
            "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "fc.weight", "fc.bias", "fc_out.weight"
        )
    },
}


@pytest.mark.parametrize("model", sorted(SPLIT_BY_MODEL))
@pytest.mark.parametrize("frozen", [False, True])
def test_blocks_with_frozen_weights_split(model: str, frozen: bool, gpt2_path: str, monkeypatch) -> None:
    """A block splits whether its weights are trained or frozen (:data:`hw.FROZEN` freezes a bias or a
    weight inside each model's blocks): a frozen share is cut as a trained one is and gets no update
    (``test_split_options_in_combination``'s frozen cases train such blocks on 2 ranks against one process).
    Before, a frozen weight kept its whole block unsplit, without a word."""
    monkeypatch.setenv(hw.GPT2_ENV, gpt2_path)
    case = hw.Case(model, 1, False, False, "adam", "numpy", frozen)
    inside = hw.not_trained(case) & SPLIT_BY_MODEL[model]
    assert inside or not frozen  # the case freezes weights inside the blocks
    assert set(_split_weights(hw.model_of(model), case)) == SPLIT_BY_MODEL[model]


@pytest.mark.mpi
def test_models_that_do_not_split_train_whole(tmp_path, gpt2_path: str) -> None:
    """A block of 7 hidden units, a block whose first weight is read through a Transpose applied again after
    it (also with the first block's bias frozen): no block splits, every rank computes the whole model (a
    warning says so) and trains as one process."""
    cases = [
        hw.Case.parse(n) for n in ("odd-a1-clip-fp32-adam-numpy-all", "odd-a2-noclip-fp32-lamb-ort-frozen")
    ]
    r = run_mpi(
        "train", str(tmp_path / "odd.npz"), ",".join(c.name for c in cases), worker=WORKER, timeout=120
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    assert "no MLP or attention block of the model splits over 2 ranks" in r.stderr, r.stderr[-3000:]
    got = dict(np.load(tmp_path / "odd.npz"))
    bad = []
    for c in cases:
        want = reference(c, np.zeros(0))
        assert want["split"] == {}
        bad += check_case(c.name, got, want)
    assert not bad, "\n".join(bad)


# ---- state, checkpoints, resuming ------------------------------------------------------------------------
RESUMED = [
    "mlp-a2-clip-fp32-adam-numpy-frozen",
    "gpt2-a1-clip-fp32-sgd-numpy-all",
    "attn4-a1-noclip-mp-adam-ort-all",
]


def _of(got: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix) :]: v for k, v in got.items() if k.startswith(prefix)}


def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], tol: float, what: str) -> list[str]:
    got, want = _without_key_bias(got), _without_key_bias(want)
    if sorted(got) != sorted(want):
        return [f"{what}: names {sorted(set(got) ^ set(want))} differ"]
    return [
        f"{what} {k}: relative error {rel_err(got[k], v):.3g}"
        for k, v in want.items()
        if v.size and rel_err(got[k], v) > (max(tol, 1e-3) if v.dtype == np.float16 else tol)
    ]


def _checkpoint_round_trip(
    case: hw.Case, state: dict[str, np.ndarray], k: int, path: str
) -> dict[str, np.ndarray]:
    """``state`` (a whole model's, after ``k`` updates) written to a checkpoint in onnxtrain's format by one
    process's session of ``case`` and read back into a state for it."""
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, optimizer_layout, session_to_checkpoint

    model = hw.model_of(case.model)
    one = hw.session(case, model, split=False)
    save_checkpoint(
        session_to_checkpoint(one, model, float(hw.LR[0]), k, {}, state=state, layout=optimizer_layout(one)),
        path,
    )
    return checkpoint_to_state(load_checkpoint(path), one)


@pytest.mark.mpi
def test_state_and_checkpoints_resume_on_the_same_trajectory(tmp_path, monkeypatch, gpt2_path: str) -> None:
    """After K updates on 2 ranks: the gathered state is one process's and each rank's own state its shares;
    a new split session resumed from the gathered state or from the rank's own state continues bit for bit
    as the uninterrupted session, and one resumed from a checkpoint one process wrote on one process's
    trajectory; the gathered state, written to a checkpoint and read back in one process, too (the split
    session's own checkpoints: ``test_checkpoints_of_a_split_session``)."""
    pytest.importorskip("onnxruntime")
    monkeypatch.setenv(hw.GPT2_ENV, gpt2_path)
    k = hw.RESUME_STEPS
    refs = {}
    for name in RESUMED:
        case = hw.Case.parse(name)
        ref = hw.session(case, hw.model_of(case.model), split=False)
        hw.steps(ref, case, 0, k)
        at_k = ref.get_state()
        alone = _checkpoint_round_trip(case, at_k, k, str(tmp_path / f"{name}.alone.ckpt"))
        np.savez(tmp_path / f"{name}.alone.npz", **alone)
        hw.steps(ref, case, k, 2 * k)
        refs[name] = (at_k, ref.get_state())
    got = _run_worker(tmp_path, gpt2_path, "resume", str(tmp_path), ",".join(RESUMED), timeout=240)
    bad = []
    for name in RESUMED:
        case = hw.Case.parse(name)
        tol, (at_k, final) = state_tolerance(case)[0], refs[name]
        split = _split_weights(hw.model_of(case.model), case)
        for r in (0, 1):
            mine = f"{name}/{r}/"
            bad += _close(_of(got, mine + "gathered/"), at_k, tol, f"{name} rank {r} gathered after {k}")
            shares = {}  # the rank's own state, as one process's under the rank's names
            for key, v in _of(got, mine + "local/").items():
                whole, w = _whole_name(key, split)
                want = _without_key_bias(at_k).get(whole)
                if want is not None:  # (else the names differ)
                    shares[key] = want if w is None or want.shape == v.shape else _share(want, *split[w], r)
            bad += _close(_of(got, mine + "local/"), shares, tol, f"{name} rank {r} own state")
            bad += _close(_of(got, mine + "continued/"), final, tol, f"{name} rank {r} after {2 * k}")
            cont = _of(got, mine + "continued/")
            for what in ("from_gathered", "from_local"):
                for key, v in _of(got, f"{mine}{what}/").items():
                    if not np.array_equal(v, cont.get(key)):
                        bad.append(f"{name} rank {r} {what} {key}: not the uninterrupted run's")
            bad += _close(
                _of(got, mine + "from_checkpoint/"),
                final,
                tol,
                f"{name} rank {r} resumed from one process's checkpoint",
            )
        gathered = _of(got, f"{name}/0/gathered/")
        one = hw.session(case, hw.model_of(case.model), split=False)
        one.load_state(
            _checkpoint_round_trip(case, gathered, k, str(tmp_path / f"{name}.ranks.ckpt")), strict=True
        )
        hw.steps(one, case, k, 2 * k)
        bad += _close(one.get_state(), final, tol, f"{name}: one process resumed from the ranks' checkpoint")
    assert not bad, "\n".join(bad)


CHECKPOINTED = RESUMED


@pytest.mark.mpi
def test_checkpoints_of_a_split_session(tmp_path, monkeypatch, gpt2_path: str) -> None:
    """After K updates on 2 ranks, ``onnxtrain.train.state.session_to_checkpoint`` of ``gather_state()`` (with
    the layout merged over the ranks) holds the whole model's trained weights, frozen parameters and moments,
    as one process's checkpoint after the same K updates. Loaded by ``checkpoint_to_state`` into a new split
    session, and one process's checkpoint too, and the ranks' checkpoint into one process: K more updates
    give the losses and the state of one process that never stopped. (Before, ``session_to_checkpoint`` of a
    split session failed with a KeyError on a share's name.)"""
    pytest.importorskip("onnxruntime")
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, session_to_checkpoint

    monkeypatch.setenv(hw.GPT2_ENV, gpt2_path)
    k = hw.RESUME_STEPS
    refs = {}
    for name in CHECKPOINTED:
        case = hw.Case.parse(name)
        model = hw.model_of(case.model)
        one = hw.session(case, model, split=False)
        hw.steps(one, case, 0, k)
        ckpt = session_to_checkpoint(one, model, float(hw.LR[0]), k, {})
        save_checkpoint(ckpt, str(tmp_path / f"{name}.alone.ckpt"))
        losses, _ = hw.steps(one, case, k, 2 * k)
        refs[name] = (hw._checkpoint_arrays(ckpt), np.asarray(losses), one.get_state())
    got = _run_worker(tmp_path, gpt2_path, "checkpoint", str(tmp_path), ",".join(CHECKPOINTED), timeout=240)
    bad = []
    for name in CHECKPOINTED:
        case = hw.Case.parse(name)
        tol, (want, losses, final) = state_tolerance(case)[0], refs[name]
        for r in (0, 1):
            mine = f"{name}/{r}/"
            bad += _close(_of(got, mine + "ckpt/"), want, tol, f"{name} rank {r} checkpoint after {k}")
            for what in ("split", "alone"):
                again = _of(got, f"{mine}from_{what}/")
                if rel_err(again["losses"], losses) > tolerance(case):
                    bad.append(f"{name} rank {r} from the {what} checkpoint: losses {again['losses']}")
                bad += _close(_of(again, "state/"), final, tol, f"{name} rank {r} from the {what} checkpoint")
        one = hw.session(case, hw.model_of(case.model), split=False)
        ranks = load_checkpoint(str(tmp_path / f"{name}.split.ckpt"))
        one.load_state(checkpoint_to_state(ranks, one), strict=True)
        again, _ = hw.steps(one, case, k, 2 * k)
        if rel_err(np.asarray(again), losses) > tolerance(case):
            bad.append(f"{name}: one process from the ranks' checkpoint: losses {again} != {losses}")
        bad += _close(one.get_state(), final, tol, f"{name}: one process from the ranks' checkpoint")
    assert not bad, "\n".join(bad)


# ---- a rank fed a bad batch ------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("name", ["mlp-a1-clip-fp32-adam-numpy-all", "attn2-a2-noclip-mp-sgd-ort-all"])
def test_rank_fed_a_bad_batch_ends_both_ranks(tmp_path, name: str) -> None:
    """Rank 1 feeds x of twice the width at the second run while rank 0 waits in the first block's sum: the
    job ends at once, non-zero, the error naming rank 1 and the input."""
    t0 = time.perf_counter()
    r = run_mpi(
        "badfeed",
        str(tmp_path / "unused.npz"),
        name,
        worker=WORKER,
        timeout=90,
        env={"ONNXTRAIN_MPI_TIMEOUT": "60"},
    )
    took = time.perf_counter() - t0
    assert r.returncode != 0, r.stdout + r.stderr
    assert "finished without noticing" not in r.stdout, r.stdout
    assert took < 45, f"the job took {took:.1f} s to end"
    assert "[rank 1/2]" in r.stderr and "aborting all ranks" in r.stderr, r.stderr[-3000:]
    assert "'x'" in r.stderr, r.stderr[-3000:]

"""Horizontal (Megatron) parallelism in combination, under ``mpiexec -n 2`` (the worker of
``test_horizontal_combinations.py``).

``python horizontal_combo_worker.py train OUT CASE,CASE,...`` trains each case with ``horizontal_parallel_size
= 2`` and rank 0 saves, per case and rank, the rank's own state (``get_state``), the gathered state, the
fetched global norms and losses, the split weights and the Dropout seeds the ranks agreed on.
``resume OUT FOLDER CASE,...``: K updates, the state, K more; then new sessions resumed from the gathered
state, from the rank's own state and from the state one process read from its checkpoint (in FOLDER), K
more each. ``checkpoint OUT FOLDER CASE,...``: K updates, a checkpoint of the gathered state (written to
FOLDER by rank 0); new sessions load it, and one process's checkpoint from FOLDER, and train K more each.
``badfeed OUT CASE``: rank 1 feeds a batch of the wrong width.

A case name spells its options: ``mlp-a2-clip-mp-lamb-ort-frozen`` is the model (:data:`MODELS`),
gradient accumulation steps (``a2L``: onnxruntime's protocol, micro-steps fetching the accumulated
gradients' group; else ``gradient_accumulation_mode = "auto"``), clipping, float16 mixed precision,
optimizer, backend (numpy engine or the onnxruntime backend) and whether some weights are frozen
(:data:`FROZEN`). The single-process references
live in the test. The torch-exported GPT is read from ``$HCOMBO_GPT2`` (written by the test).
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto as T  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402

from tests.parallel import combo_worker as combos  # noqa: E402
from tests.parallel.combo_worker import save_everyone, session_options  # noqa: E402

LR = np.array([0.05], np.float32)
STEPS = 3
BATCH = 8  # rows of a micro-batch
CLIP = 0.3  # below these models' global gradient norms: clipping acts
LOSS_SCALE = 256.0
RESUME_STEPS = 2
SEED = 2026
OPTIMIZERS = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}
GPT2_ENV = "HCOMBO_GPT2"


def _const(name: str, value: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


def _layer_norm(x: str, y: str, prefix: str, n: int, rng: np.random.Generator) -> tuple[onnx.NodeProto, list]:
    inits = [
        numpy_helper.from_array((1 + 0.1 * rng.standard_normal(n)).astype(np.float32), f"{prefix}.scale"),
        numpy_helper.from_array((0.1 * rng.standard_normal(n)).astype(np.float32), f"{prefix}.bias"),
    ]
    return helper.make_node(
        "LayerNormalization", [x, f"{prefix}.scale", f"{prefix}.bias"], [y], axis=-1
    ), inits


def mlp_model(seed: int = 5) -> onnx.ModelProto:
    """x [N, 8] → LN → MatMul + bias, ReLU, MatMul + bias → + x → LN → Gemm (transB, no bias), erf GELU,
    Gemm (transB, no bias) → + residual → MatMul + bias → logits [N, 4] → loss: two blocks that split."""
    rng = np.random.default_rng(seed)
    shapes = (
        ("W1", (8, 16)),
        ("b1", (16,)),
        ("W2", (16, 8)),
        ("b2", (8,)),
        ("W3", (16, 8)),
        ("W4", (8, 16)),
        ("Wh", (8, 4)),
        ("bh", (4,)),
    )
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n) for n, s in shapes]
    ln1, i1 = _layer_norm("x", "n1", "ln1", 8, rng)
    ln2, i2 = _layer_norm("r1", "n2", "ln2", 8, rng)
    nodes = [
        _const("sqrt2", np.float32(np.sqrt(2.0))),
        _const("one", np.float32(1.0)),
        _const("half", np.float32(0.5)),
        ln1,
        helper.make_node("MatMul", ["n1", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["o1"]),
        helper.make_node("Add", ["o1", "x"], ["r1"]),
        ln2,
        helper.make_node("Gemm", ["n2", "W3"], ["m3"], transB=1),
        helper.make_node("Div", ["m3", "sqrt2"], ["d3"]),
        helper.make_node("Erf", ["d3"], ["e3"]),
        helper.make_node("Add", ["e3", "one"], ["p3"]),
        helper.make_node("Mul", ["m3", "p3"], ["q3"]),
        helper.make_node("Mul", ["q3", "half"], ["g3"]),
        helper.make_node("Gemm", ["g3", "W4"], ["o2"], transB=1),
        helper.make_node("Add", ["o2", "r1"], ["r2"]),
        helper.make_node("MatMul", ["r2", "Wh"], ["mh"]),
        helper.make_node("Add", ["mh", "bh"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "mlp_blocks",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("loss", T.FLOAT, []),
            helper.make_tensor_value_info("logits", T.FLOAT, None),
        ],
        [*inits, *i1, *i2],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def drop_model(seeds: tuple[int, int] | None = None) -> onnx.ModelProto:
    """Two GELU / Tanh blocks with a Dropout (0.3) on the first block's hidden units (inside the block);
    with ``seeds``, the one-process equivalent (``pipeline_worker.gelu_block_dropout_model``)."""
    from tests.parallel.pipeline_worker import gelu_block_dropout_model

    return gelu_block_dropout_model(seeds)


def attention_model(heads: int) -> onnx.ModelProto:
    """onnxtrain's transformer (one layer, 16 features, ``heads`` heads, 6 tokens) with a causal mask added to
    the attention scores; the key bias starts away from zero (its gradient is rounding noise: softmax ignores
    a shift along the keys)."""
    from onnxtrain import zoo

    m = zoo.transformer(dim=16, heads=heads, length=6, layers=1, seed=3)
    g = m.graph
    rng = np.random.default_rng(4)
    for t in g.initializer:
        if t.name.endswith("attn.k.bias"):
            t.CopyFrom(numpy_helper.from_array(rng.normal(0, 0.1, tuple(t.dims)).astype(np.float32), t.name))
    k = next(k for k, n in enumerate(g.node) if n.op_type == "Softmax")
    scores = g.node[k].input[0]
    mask = np.triu(np.full((6, 6), -1e4, np.float32), 1)
    g.node[k].input[0] = f"{scores}_masked"
    g.node.insert(k, helper.make_node("Add", [scores, "causal_mask"], [f"{scores}_masked"]))
    g.node.insert(k, _const("causal_mask", mask))
    return m


def gpt2_model() -> onnx.ModelProto:
    """torch's export of a two-layer GPT (written by the test to ``$HCOMBO_GPT2``)."""
    return onnx.load(os.environ[GPT2_ENV])


def odd_model() -> onnx.ModelProto:
    """``mlp_model`` whose first block has 7 hidden units (no two-way split) and whose second block's weights
    are read through one Transpose applied twice (the same layer again after the block)."""
    rng = np.random.default_rng(6)
    shapes = (("W1", (8, 7)), ("b1", (7,)), ("W2", (7, 8)), ("W3", (16, 8)), ("W4", (8, 16)), ("Wh", (16, 4)))
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n) for n, s in shapes]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["h1"]),
        helper.make_node("MatMul", ["h1", "W2"], ["o1"]),
        helper.make_node("Add", ["o1", "x"], ["r1"]),
        helper.make_node("Transpose", ["W3"], ["W3t"], perm=[1, 0]),
        helper.make_node("MatMul", ["r1", "W3t"], ["m3"]),
        helper.make_node("Tanh", ["m3"], ["t3"]),
        helper.make_node("Gemm", ["t3", "W4"], ["o3"], transB=1),
        helper.make_node("Add", ["o3", "r1"], ["r3"]),
        helper.make_node("MatMul", ["r3", "W3t"], ["m5"]),  # W3 again
        helper.make_node("MatMul", ["m5", "Wh"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes,
        "unsplittable",
        [
            helper.make_tensor_value_info("x", T.FLOAT, ["N", 8]),
            helper.make_tensor_value_info("y", T.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("loss", T.FLOAT, []),
            helper.make_tensor_value_info("logits", T.FLOAT, None),
        ],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


MODELS = {
    "mlp": mlp_model,
    "drop": drop_model,
    "attn2": lambda: attention_model(2),
    "attn4": lambda: attention_model(4),
    "gpt2": gpt2_model,
}
UNSPLIT = {"odd": odd_model}  # models no block of which splits (not in the sweep)
# frozen weights per model: inside the split blocks (the mlp's first bias and second block's second weight,
# an attention's value projection and its MLP's first bias, the GPT's fused QKV bias and its second MLP's
# second weight: frozen shares) and replicated weights
FROZEN = {
    "mlp": {"b1", "W4", "ln2.scale"},
    "drop": {"b2"},
    "attn2": {"layer0.ln1.weight", "head.bias", "layer0.attn.v.weight", "layer0.fc1.bias"},
    "attn4": {"layer0.ln1.weight", "head.bias", "layer0.attn.v.weight", "layer0.fc1.bias"},
    "gpt2": {"model.tok.weight", "model.blocks.0.attn.qkv.bias", "model.blocks.1.fc_out.weight"},
    "odd": {"b1"},
}


@dataclass(frozen=True)
class Case:
    model: str
    accum: int
    clip: bool
    mp: bool
    opt: str
    backend: str  # numpy, ort
    frozen: bool
    protocol: str = "auto"  # gradient_accumulation_mode; "legacy": micro-steps fetch the accumulated group

    @property
    def accum_token(self) -> str:
        return f"a{self.accum}" + ("L" if self.protocol == "legacy" else "")

    @property
    def name(self) -> str:
        return "-".join(
            [
                self.model,
                self.accum_token,
                "clip" if self.clip else "noclip",
                "mp" if self.mp else "fp32",
                self.opt,
                self.backend,
                "frozen" if self.frozen else "all",
            ]
        )

    @staticmethod
    def parse(name: str) -> Case:
        model, a, clip, mp, opt, backend, frozen = name.split("-")
        protocol = "legacy" if a.endswith("L") else "auto"
        return Case(
            model,
            int(a[1:].rstrip("L")),
            clip == "clip",
            mp == "mp",
            opt,
            backend,
            frozen == "frozen",
            protocol,
        )


def all_cases() -> list[Case]:
    """Every combination (accumulating over 2 runs counted by the session, or marked by the legacy
    protocol)."""
    out = []
    for model, accum, clip, mp, opt, backend, frozen in itertools.product(
        MODELS,
        ("1", "2", "2L"),
        (False, True),
        (False, True),
        tuple(OPTIMIZERS),
        ("numpy", "ort"),
        (False, True),
    ):
        if model == "drop" and backend == "ort" and accum != "1":
            # onnxruntime's Dropout masks follow its sessions' draws: one process runs its micro-steps and
            # its updates in two onnxruntime sessions (two mask sequences), the split one piece's session
            # (one sequence), so the masks differ (documented: not the numpy engine's draws either)
            continue
        protocol = "legacy" if accum.endswith("L") else "auto"
        out.append(Case(model, int(accum.rstrip("L")), clip, mp, opt, backend, frozen, protocol))
    return out


def pairwise(cases: list[Case]) -> list[Case]:
    """A few cases that, between them, hold every pair of option values (greedy)."""
    return combos.pairwise(cases, ("model", "accum_token", "clip", "mp", "opt", "backend", "frozen"))


def not_trained(case: Case) -> set[str]:
    """The weights ``case`` does not train."""
    return set(FROZEN[case.model]) if case.frozen else set()


def params(case: Case, model: onnx.ModelProto, split: bool = True):
    """The TrainingParameters of ``case`` (``split`` False: one process's)."""
    from onnxtrain import TrainingParameters

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = OPTIMIZERS[case.opt]
    p.gradient_accumulation_steps = case.accum
    p.gradient_accumulation_mode = case.protocol if split else "auto"
    p.use_mixed_precision = case.mp
    p.enable_grad_norm_clip = case.clip
    if case.clip:
        p.optimizer_attributes_map = {
            t.name: {"max_norm_clip": CLIP} for t in model.graph.initializer if t.dims
        }
    frozen = not_trained(case)  # (with the shares the LAMB reference stores a frozen split weight as)
    p.weights_not_to_train = frozen | {
        t.name for t in model.graph.initializer if t.name.split("__share")[0] in frozen
    }
    if split:
        p.horizontal_parallel_size = 2
    return p


def model_of(name: str) -> onnx.ModelProto:
    return (MODELS | UNSPLIT)[name]()




def session(case: Case, model: onnx.ModelProto | None = None, split: bool = True):
    from onnxtrain import TrainingSession, set_seed

    model = model_of(case.model) if model is None else model
    set_seed(SEED)
    return TrainingSession(
        model.SerializeToString(), params(case, model, split), session_options(case.backend)
    )


def micro_batches(case: Case, count: int, seed: int = 1) -> list[dict[str, np.ndarray]]:
    """``count`` micro-batches of ``case``'s model."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        if case.model in ("mlp", "drop", "odd"):
            out.append(
                {
                    "x": rng.standard_normal((BATCH, 8)).astype(np.float32),
                    "y": rng.integers(0, 4, BATCH).astype(np.int64),
                }
            )
        elif case.model.startswith("attn"):
            out.append({n: rng.integers(0, 10, (BATCH, 6)).astype(np.int64) for n in ("x", "y")})
        else:
            out.append({n: rng.integers(0, 50, (BATCH, 10)).astype(np.int64) for n in ("tokens", "labels")})
    return out


def run(sess, feeds: dict[str, np.ndarray], update: bool) -> tuple[float | None, float | None]:
    """One run: the loss and, on an update, the global gradient norm when the session outputs one. Under
    ``gradient_accumulation_mode = "legacy"`` a micro-step fetches the accumulated gradients' group on the
    fetches' path alone (no loss), as onnxruntime's protocol has it."""
    from onnxtrain import RunOptions
    from onnxtrain.graph_transforms.accumulation import GROUP_OUTPUT

    feeds = {**feeds, "Learning_Rate": LR}
    if sess.loss_scale_input_name:
        feeds[sess.loss_scale_input_name] = np.array([LOSS_SCALE], np.float32)
    if not update and sess._params.gradient_accumulation_mode == "legacy":
        ro = RunOptions()
        ro.only_execute_path_to_fetches = True
        sess.run([GROUP_OUTPUT], feeds, ro)
        return None, None
    norm = next((o.name for o in sess.get_outputs() if o.name.startswith("global_gradient_norm")), None)
    fetch = ["loss", norm] if update and norm else ["loss"]
    got = sess.run(fetch, feeds)
    return float(got[0]), (float(got[1]) if len(got) > 1 else None)


def steps(sess, case: Case, first: int, last: int) -> tuple[list[float], list[float]]:
    """Updates ``first`` .. ``last - 1`` (``accum`` runs each): the losses of the updating runs, the norms
    fetched."""
    data = micro_batches(case, last * case.accum)
    losses, norms = [], []
    for i in range(first * case.accum, last * case.accum):
        update = (i + 1) % case.accum == 0
        loss, norm = run(sess, data[i], update)
        if update:
            losses.append(loss)
        if norm is not None:
            norms.append(norm)
    return losses, norms


def dropout_seeds(sess) -> list[int]:
    """The seeds of the Dropout nodes of the rank's pieces."""
    nodes = [
        n for sg in sess._pieces.values() for n in sg.graphs["stage"].graph.node if n.op_type == "Dropout"
    ]
    return [a.i for n in nodes for a in n.attribute if a.name == "seed"]


def train(case: Case) -> dict[str, np.ndarray]:
    sess = session(case)
    losses, norms = steps(sess, case, 0, STEPS)
    out = {f"local/{k}": v for k, v in sess.get_state().items()}
    out.update({f"state/{k}": v for k, v in sess.gather_state().items()})
    out["losses"], out["norms"] = np.asarray(losses), np.asarray(norms, np.float64)
    info = sess.get_partition_info_map()
    out["split"] = np.array(sorted(info), dtype=str)
    out["info"] = np.array(  # weight:original dims:megatron_row_partition
        sorted(
            f"{w}:{','.join(map(str, d['original_dim']))}:{d['megatron_row_partition'][0]}"
            for w, d in info.items()
        ),
        dtype=str,
    )
    out["seeds"] = np.array(dropout_seeds(sess), np.int64)
    return out


def resume(case: Case, folder: str) -> dict[str, np.ndarray]:
    """K updates; the rank's own and the gathered state; K more. Then K more from each of: the gathered
    state, the rank's own state, and the whole state one process read from its checkpoint after K updates
    (``<folder>/<case>.alone.npz``)."""
    k = RESUME_STEPS
    model = model_of(case.model)
    sess = session(case, model)
    steps(sess, case, 0, k)
    local, full = sess.get_state(), sess.gather_state()
    mine = {f"local/{n}": v for n, v in local.items()}
    mine.update({f"gathered/{n}": v for n, v in full.items()})
    steps(sess, case, k, 2 * k)
    mine.update({f"continued/{n}": v for n, v in sess.gather_state().items()})
    alone = dict(np.load(os.path.join(folder, f"{case.name}.alone.npz")))
    for what, state in (("from_gathered", full), ("from_local", local), ("from_checkpoint", alone)):
        again = session(case, model)
        again.load_state(state, strict=True)
        steps(again, case, k, 2 * k)
        mine.update({f"{what}/{n}": v for n, v in again.gather_state().items()})
    return mine


def _checkpoint_arrays(ckpt) -> dict[str, np.ndarray]:
    """A checkpoint's contents as named arrays: ``trainable/<w>``, ``frozen/<name>``, ``moment/<w>/<key>`` of
    its first optimizer group and that group's ``step``."""
    out = {f"trainable/{k}": v for k, v in ckpt.trainable.items()}
    out.update({f"frozen/{k}": v for k, v in ckpt.frozen.items()})
    group = ckpt.optimizer_groups[0]
    out.update({f"moment/{w}/{k}": v for w, d in group.states.items() for k, v in d.items()})
    out["step"] = np.array(group.step, np.int64)
    return out


def checkpoint(case: Case, folder: str, comm) -> dict[str, np.ndarray]:
    """K updates; a checkpoint of the gathered state (``onnxtrain.train.state.session_to_checkpoint``), which
    rank 0 writes to ``<folder>/<case>.split.ckpt``. Then new split sessions load that checkpoint, and the one
    one process wrote after K updates (``<folder>/<case>.alone.ckpt``), by ``checkpoint_to_state``, and train
    K more each: their losses and gathered states."""
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, optimizer_layout, session_to_checkpoint

    k = RESUME_STEPS
    model = model_of(case.model)
    sess = session(case, model)
    steps(sess, case, 0, k)
    ckpt = session_to_checkpoint(sess, model, float(LR[0]), k, {}, state=sess.gather_state(),
                                 layout=optimizer_layout(sess, comm))
    path = os.path.join(folder, f"{case.name}.split.ckpt")
    if comm.rank == 0:
        save_checkpoint(ckpt, path)
    comm.barrier()
    mine = {f"ckpt/{n}": v for n, v in _checkpoint_arrays(ckpt).items()}
    for what in ("split", "alone"):
        again = session(case, model)
        state = checkpoint_to_state(load_checkpoint(os.path.join(folder, f"{case.name}.{what}.ckpt")), again,
                                    again.gather_state(), optimizer_layout(again, comm))
        again.load_state(state, strict=True)
        losses, _ = steps(again, case, k, 2 * k)
        mine[f"from_{what}/losses"] = np.asarray(losses)
        mine.update({f"from_{what}/state/{n}": v for n, v in again.gather_state().items()})
    return mine


def bad_feed(case: Case, rank: int) -> None:
    """Rank 1 feeds x of twice the width at the second update, while rank 0 waits in the first block's sum."""
    sess = session(case)
    for i, feeds in enumerate(micro_batches(case, 4)):
        if i == 1 and rank == 1:
            feeds = {**feeds, "x": np.concatenate([feeds["x"], feeds["x"]], axis=1)}
        run(sess, feeds, (i + 1) % case.accum == 0)
    print(f"rank {rank} finished without noticing the failure", flush=True)


def main() -> None:
    from onnxtrain.parallel import get_communicator, world

    what, out = sys.argv[1], sys.argv[2]
    rank = world().rank
    comm = get_communicator()
    saved: dict[str, np.ndarray] = {}
    if what == "train":
        for name in sys.argv[3].split(","):
            save_everyone(comm, rank, train(Case.parse(name)), name, saved)
    elif what == "resume":
        for name in sys.argv[4].split(","):
            save_everyone(comm, rank, resume(Case.parse(name), sys.argv[3]), name, saved)
    elif what == "checkpoint":
        for name in sys.argv[4].split(","):
            save_everyone(comm, rank, checkpoint(Case.parse(name), sys.argv[3], comm), name, saved)
    elif what == "badfeed":
        bad_feed(Case.parse(sys.argv[3]), rank)
    else:
        raise SystemExit(f"unknown command {what!r}")
    if rank == 0:
        np.savez(out, **saved)


if __name__ == "__main__":
    main()

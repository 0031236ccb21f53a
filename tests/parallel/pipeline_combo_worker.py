"""Pipeline options in combination, under ``mpiexec -n 2`` (the worker of ``test_pipeline_combinations.py``).

``python pipeline_combo_worker.py train OUT CASE,CASE,...`` trains each named case of :func:`cases` with the
legacy ``TrainingSession`` cut into two stages (one a rank) and rank 0 saves what every rank fetched
(losses and logits of each run, the global norms of the updates, an eval run's logits), its own
``get_state()`` and the ``gather_state()`` to ``OUT``; ``resume`` moves a stage's state to and from one
process, ``badfeed`` feeds one rank a bad batch. The single-process references live in the test.

A case name spells its options, e.g. ``skip-m4-a2L-clip-mp-adam-ort-w1``: the model and its cut
(:data:`MODELS`), micro-batches a run, runs an update (gradient accumulation; ``L``: onnxruntime's protocol,
the runs that do not update fetching ``Group_Accumulated_Gradients``), clipping, float16 mixed
precision, optimizer, backend, frozen weights (``all`` train; ``w1``: ``W1`` of the first stage frozen;
``s0``: every weight of the first stage frozen).
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
STEPS = 2  # updates a case trains
# rows a run: 4 micro-batches of 4 at most (a BatchNormalization of 2 rows maps them to ±1, its input's
# gradient then rounding alone, which Adam on the onnxruntime backend turned into 2e-2 apart)
BATCH = 16
DIN, DOUT = 6, 3
CLIP = 0.3  # below these models' global gradient norms: clipping acts
LOSS_SCALE = 256.0
OPTIMIZERS = {"sgd": "SGDOptimizer", "adam": "AdamOptimizer", "lamb": "LambOptimizer"}


# ---- the models and their cuts ------------------------------------------------------------------------

GEMM_SHAPES = {"W1": (8, DIN), "b1": (8,), "W2": (8, 8), "b2": (8,), "W3": (DOUT, 8), "b3": (DOUT,)}


def _weights(rng: np.random.Generator, shapes: dict[str, tuple[int, ...]]) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n)
            for n, s in shapes.items()]


def _model(nodes: list, inits: list, name: str) -> onnx.ModelProto:
    """``nodes`` from ``x`` [N, DIN] and ``y`` [N] to ``logits`` [N, DOUT] and ``loss``."""
    g = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", T.FLOAT, ["N", DIN]),
         helper.make_tensor_value_info("y", T.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", T.FLOAT, []),
         helper.make_tensor_value_info("logits", T.FLOAT, ["N", DOUT])],
        inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def matmul_model() -> onnx.ModelProto:
    """x → MatMul + b1 → Relu → MatMul (``m2``, the cut: right after a MatMul) + b2 → Tanh → MatMul + b3."""
    rng = np.random.default_rng(21)
    inits = _weights(rng, {"W1": (DIN, 8), "b1": (8,), "W2": (8, 8), "b2": (8,), "W3": (8, DOUT),
                           "b3": (DOUT,)})
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["m1"]),
        helper.make_node("Add", ["m1", "b1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["r1"]),
        helper.make_node("MatMul", ["r1", "W2"], ["m2"]),
        helper.make_node("Add", ["m2", "b2"], ["a2"]),
        helper.make_node("Tanh", ["a2"], ["t2"]),
        helper.make_node("MatMul", ["t2", "W3"], ["m3"]),
        helper.make_node("Add", ["m3", "b3"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _model(nodes, inits, "matmul")


def skip_model() -> onnx.ModelProto:
    """x → Gemm → Relu (``r1``) → Gemm (``h2``) → Relu (``r2``) → r1 + r2 → Gemm: ``r1`` is read by two later
    nodes (cut ``r1``), or crosses a cut after it (cut ``h2``: r1 is sent along uncut)."""
    rng = np.random.default_rng(22)
    inits = _weights(rng, GEMM_SHAPES)
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Gemm", ["r1", "W2", "b2"], ["h2"], transB=1),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Add", ["r1", "r2"], ["s"]),
        helper.make_node("Gemm", ["s", "W3", "b3"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _model(nodes, inits, "skip")


def _batch_norm(x: str, out: str, n: int, prefix: str, rng: np.random.Generator) -> tuple:
    inits = [numpy_helper.from_array(v.astype(np.float32), f"{prefix}_{k}") for k, v in (
        ("scale", 1 + 0.2 * rng.standard_normal(n)), ("bias", 0.1 * rng.standard_normal(n)),
        ("mean", 0.1 * rng.standard_normal(n)), ("var", 1 + 0.3 * rng.uniform(size=n)))]
    node = helper.make_node("BatchNormalization", [x, *(t.name for t in inits)],
                            [out, f"{prefix}_mean_out", f"{prefix}_var_out"], training_mode=1, momentum=0.8)
    return node, inits


def bn_model() -> onnx.ModelProto:
    """A training-mode BatchNormalization in each stage (cut ``r1``, after the first one's Relu)."""
    rng = np.random.default_rng(23)
    inits = _weights(rng, {"W1": (8, DIN), "W2": (8, 8), "W3": (DOUT, 8), "b3": (DOUT,)})
    bn1, i1 = _batch_norm("h1", "n1", 8, "bn1", rng)
    bn2, i2 = _batch_norm("h2", "n2", 8, "bn2", rng)
    nodes = [
        helper.make_node("Gemm", ["x", "W1"], ["h1"], transB=1), bn1,
        helper.make_node("Relu", ["n1"], ["r1"]),
        helper.make_node("Gemm", ["r1", "W2"], ["h2"], transB=1), bn2,
        helper.make_node("Relu", ["n2"], ["r2"]),
        helper.make_node("Gemm", ["r2", "W3", "b3"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _model(nodes, [*inits, *i1, *i2], "bn")


def dropout_model() -> onnx.ModelProto:
    """A seeded Dropout (ratio 0.25) in each stage (cut ``d1``, the first Dropout's output)."""
    rng = np.random.default_rng(24)
    inits = _weights(rng, GEMM_SHAPES)
    inits += [numpy_helper.from_array(np.array(0.25, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "train")]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h1"], transB=1),
        helper.make_node("Relu", ["h1"], ["r1"]),
        helper.make_node("Dropout", ["r1", "ratio", "train"], ["d1"], seed=5),
        helper.make_node("Gemm", ["d1", "W2", "b2"], ["h2"], transB=1),
        helper.make_node("Relu", ["h2"], ["r2"]),
        helper.make_node("Dropout", ["r2", "ratio", "train"], ["d2"], seed=6),
        helper.make_node("Gemm", ["d2", "W3", "b3"], ["logits"], transB=1),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]),
    ]
    return _model(nodes, inits, "dropout")


def act_model() -> onnx.ModelProto:
    """``skip_model`` without its skip: x → Gemm → Relu (``r1``, the cut: after an activation) → ..."""
    m = skip_model()
    add = next(n for n in m.graph.node if n.op_type == "Add")
    add.input[:] = ["r2", "r2"]
    return m


# name → (model, cut, the first stage's weights)
MODELS = {
    "mm": (matmul_model, "m2", ("W1", "b1", "W2")),
    "act": (act_model, "r1", ("W1", "b1")),
    "skip": (skip_model, "r1", ("W1", "b1")),
    "cross": (skip_model, "h2", ("W1", "b1", "W2", "b2")),
    "bn": (bn_model, "r1", ("W1", "bn1_scale", "bn1_bias")),
    "drop": (dropout_model, "d1", ("W1", "b1")),
}


# ---- the cases -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    model: str
    micro: int
    accum: int
    clip: bool
    mp: bool
    opt: str
    backend: str  # numpy, ort
    frozen: str  # all, w1, s0
    protocol: str = "auto"  # gradient_accumulation_mode; "legacy": micro-steps fetch the accumulated group

    @property
    def accum_token(self) -> str:
        return f"a{self.accum}" + ("L" if self.protocol == "legacy" else "")

    @property
    def name(self) -> str:
        return "-".join([self.model, f"m{self.micro}", self.accum_token, "clip" if self.clip else "noclip",
                         "mp" if self.mp else "fp32", self.opt, self.backend, self.frozen])

    @staticmethod
    def parse(name: str) -> Case:
        model, m, a, clip, mp, opt, backend, frozen = name.split("-")
        return Case(model, int(m[1:]), int(a[1:].rstrip("L")), clip == "clip", mp == "mp", opt, backend,
                    frozen, "legacy" if a.endswith("L") else "auto")

    @property
    def runs(self) -> int:
        return STEPS * self.accum


FIELDS = ("model", "micro", "accum_token", "clip", "mp", "opt", "backend", "frozen")


def cases() -> list[Case]:
    """Every combination of the options on two stages that one process can be compared with: not a Dropout
    on the onnxruntime backend drawing more than one mask an update (there one process's micro-step and
    update graphs each hold a copy of the node seeded apart, README "Gradient accumulation", so its masks
    are not the pipeline's; the numpy engine keeps one generator a node, as the pipeline does)."""
    every = [Case(model, micro, int(a.rstrip("L")), *rest, "legacy" if a.endswith("L") else "auto")
             for model, micro, a, *rest in itertools.product(
                 tuple(MODELS), (1, 2, 4), ("1", "2", "2L"), (False, True), (False, True), tuple(OPTIMIZERS),
                 ("numpy", "ort"), ("all", "w1", "s0"))]
    return [c for c in every if not (c.model == "drop" and c.backend == "ort" and c.micro * c.accum > 1)]


def pairwise(pool: list[Case]) -> list[Case]:
    """A few cases of ``pool`` that, between them, hold every pair of option values (greedy)."""
    return combos.pairwise(pool, FIELDS)


def model_of(case: Case) -> onnx.ModelProto:
    return MODELS[case.model][0]()


def frozen_weights(case: Case) -> set[str]:
    return {"all": set(), "w1": {"W1"}, "s0": set(MODELS[case.model][2])}[case.frozen]


def parameters(case: Case, pipelined: bool):
    """The options of ``case``: two stages (``pipelined``), or one process accumulating the same
    micro-batches (``micro × accum`` runs an update, counted by the session or marked by the caller)."""
    from onnxtrain import TrainingParameters

    model = model_of(case)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = OPTIMIZERS[case.opt]
    p.enable_grad_norm_clip = case.clip
    trained = [t.name for t in model.graph.initializer if t.dims and t.name not in frozen_weights(case)]
    if case.clip and case.opt != "sgd":
        p.optimizer_attributes_map = {w: {"max_norm_clip": CLIP} for w in trained}
    p.use_mixed_precision = case.mp
    p.weights_not_to_train = frozen_weights(case)
    p.gradient_accumulation_mode = case.protocol
    if pipelined:
        p.pipeline_parallel_size = 2
        p.pipeline_cut_info_string = MODELS[case.model][1]
        p.num_pipeline_micro_batches = case.micro
        p.gradient_accumulation_steps = case.accum
    else:
        p.gradient_accumulation_steps = case.micro * case.accum
    return p




def session(case: Case, pipelined: bool):
    from onnxtrain import TrainingSession, set_seed

    set_seed(2026)
    return TrainingSession(model_of(case).SerializeToString(), parameters(case, pipelined),
                           session_options(case.backend))


def run_batches(count: int, seed: int = 3) -> list[dict[str, np.ndarray]]:
    """The feeds (``x``, ``y``) of ``count`` runs of BATCH rows."""
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((BATCH, DIN)).astype(np.float32), "y": rng.integers(0, DOUT, BATCH)}
            for _ in range(count)]


EVAL_BATCH = run_batches(1, seed=99)[0]


def extra_feeds(sess) -> dict[str, np.ndarray]:
    """The learning rate, and under mixed precision the loss scale."""
    out = {"Learning_Rate": LR}
    if sess.loss_scale_input_name:
        out[sess.loss_scale_input_name] = np.array([LOSS_SCALE], np.float32)
    return out


def norm_output(sess) -> str | None:
    return next((o.name for o in sess.get_outputs() if o.name.startswith("global_gradient_norm")), None)


def train_run(sess, case: Case, feeds: dict[str, np.ndarray], update: bool) -> list[np.ndarray]:
    """One training run: ``loss``, ``logits`` and on an update the global norm (when the session has one).
    Under ``gradient_accumulation_mode = "legacy"`` a run that does not update is marked by fetching
    ``Group_Accumulated_Gradients`` on the fetches' path alone, as onnxruntime's frontends did."""
    from onnxtrain import RunOptions
    from onnxtrain.graph_transforms.accumulation import GROUP_OUTPUT

    ro = RunOptions()
    fetch = ["loss", "logits"]
    norm = norm_output(sess)
    if update and norm:
        fetch.append(norm)
    if not update and case.protocol == "legacy":
        ro.only_execute_path_to_fetches = True
        return sess.run([*fetch, GROUP_OUTPUT], {**feeds, **extra_feeds(sess)}, ro)[:2]
    return sess.run(fetch, {**feeds, **extra_feeds(sess)}, ro)


def eval_run(sess) -> list[np.ndarray]:
    """``logits`` and ``loss`` of the eval batch, forward only with Dropout off."""
    from onnxtrain import RunOptions

    ro = RunOptions()
    ro.only_execute_path_to_fetches, ro.training_mode = True, False
    feeds = dict(EVAL_BATCH)
    if sess.loss_scale_input_name:
        feeds[sess.loss_scale_input_name] = np.array([LOSS_SCALE], np.float32)
    return sess.run(["logits", "loss"], feeds, ro)


def train_pipeline(case: Case, sess=None, first: int = 0, last: int | None = None) -> dict[str, np.ndarray]:
    """Runs ``first`` .. ``last - 1`` of ``case`` on this rank's stage: the loss and logits each run returns
    (its last micro-batch's), the norms of the updates, the eval run after the first run (mid-accumulation
    when accumulating) and after the last; the rank's own state and the gathered one."""
    sess = session(case, True) if sess is None else sess
    last = case.runs if last is None else last
    losses, logits, norms = [], [], []
    out: dict[str, np.ndarray] = {}
    for i, feeds in enumerate(run_batches(case.runs)[first:last], start=first):
        got = train_run(sess, case, feeds, (i + 1) % case.accum == 0)
        losses.append(got[0])
        logits.append(got[1])
        if len(got) > 2:
            norms.append(got[2])
        if i == first:
            out["eval_mid_logits"], out["eval_mid_loss"] = eval_run(sess)
    out["eval_logits"], out["eval_loss"] = eval_run(sess)
    out["losses"], out["logits"] = np.asarray(losses), np.asarray(logits)
    out["norms"] = np.asarray(norms, np.float64)
    out.update({f"own/{k}": v for k, v in sess.get_state().items()})
    out.update({f"state/{k}": v for k, v in sess.gather_state().items()})
    return out


def checkpoint_of(sess, case: Case, state: dict[str, np.ndarray], comm=None):
    """The checkpoint (``onnxtrain.checkpoint``) of ``case``'s session after ``STEPS // 2`` updates, from
    its whole ``state`` (a stage's: ``gather_state()``, with ``comm``)."""
    from onnxtrain.train.state import optimizer_layout, session_to_checkpoint

    return session_to_checkpoint(sess, model_of(case), float(LR[0]), STEPS // 2, {}, state=state,
                                 layout=optimizer_layout(sess, comm))


def load_checkpoint_into(sess, path: str, comm=None) -> None:
    """Put the checkpoint at ``path`` into ``sess`` (a stage: with ``comm``, on every rank)."""
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, optimizer_layout

    sess.load_state(checkpoint_to_state(load_checkpoint(path), sess, sess.gather_state(),
                                        optimizer_layout(sess, comm)), strict=True)


def resume(case: Case, out_dir: str, rank: int, saved: dict) -> None:
    """Half the runs; rank 0 writes the gathered state (``from_ranks.npz``) and its checkpoint
    (``from_ranks.ckpt``); the other half. Then new pipelines loading one process's state after half the
    runs (``alone.npz``, strictly) and its checkpoint (``alone.ckpt``), each for the other half."""
    from onnxtrain.checkpoint import save_checkpoint
    from onnxtrain.parallel import get_communicator

    comm = get_communicator()
    half = case.runs // 2
    sess = session(case, True)
    mine = {f"first/{k}": v for k, v in train_pipeline(case, sess, 0, half).items()}
    state = sess.gather_state()
    ckpt = checkpoint_of(sess, case, state, comm)
    if rank == 0:
        np.savez(os.path.join(out_dir, "from_ranks.npz"), **state)
        save_checkpoint(ckpt, os.path.join(out_dir, "from_ranks.ckpt"))
    comm.barrier()
    mine.update({f"continued/{k}": v for k, v in train_pipeline(case, sess, half).items()})
    resumed = session(case, True)
    resumed.load_state(dict(np.load(os.path.join(out_dir, "alone.npz"))), strict=True)
    mine.update({f"resumed/{k}": v for k, v in train_pipeline(case, resumed, half).items()})
    from_ckpt = session(case, True)
    load_checkpoint_into(from_ckpt, os.path.join(out_dir, "alone.ckpt"), comm)
    mine.update({f"checkpoint/{k}": v for k, v in train_pipeline(case, from_ckpt, half).items()})
    save_everyone(comm, rank, mine, case.name, saved)


def bad_feed(case: Case, kind: str, rank: int) -> None:
    """A bad feed at the second run, while the other rank runs its stage: ``width`` (rank 1's ``x`` too
    wide), ``rows`` (rank 0's batch of rows the micro-batches do not divide) or ``label`` (every rank's
    labels out of range: only the last stage's loss reads them)."""
    sess = session(case, True)
    for i, feeds in enumerate(run_batches(4)):
        x, y = feeds["x"], feeds["y"]
        if i == 1 and kind == "width" and rank == 1:
            x = np.concatenate([x, x], axis=1)
        if i == 1 and kind == "rows" and rank == 0:
            x, y = x[:-1], y[:-1]
        if i == 1 and kind == "label":
            y = y + 100
        sess.run(["loss"], {"x": x, "y": y, **extra_feeds(sess)})
    print(f"rank {rank} finished without noticing the failure", flush=True)


def main() -> None:
    from onnxtrain.parallel import get_communicator, world

    what, out = sys.argv[1], sys.argv[2]
    w = world()
    saved: dict[str, np.ndarray] = {}
    if what == "train":
        comm = get_communicator()
        for name in sys.argv[3].split(","):
            save_everyone(comm, w.rank, train_pipeline(Case.parse(name)), name, saved)
    elif what == "resume":
        resume(Case.parse(sys.argv[4]), sys.argv[3], w.rank, saved)
    elif what == "badfeed":
        bad_feed(Case.parse(sys.argv[3]), sys.argv[4], w.rank)
    else:
        raise SystemExit(f"unknown command {what!r}")
    if w.rank == 0:
        np.savez(out, **saved)


if __name__ == "__main__":
    main()

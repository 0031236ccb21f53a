"""Pipeline parallelism of the legacy session: stages over ``mpiexec`` train exactly as one process that
accumulates the same micro-batches; the cut string's parsing and the stage partition; the errors."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxtrain import RunOptions, TrainingParameters, TrainingSession
from onnxtrain.optim import get_optimizer
from onnxtrain.parallel.adasum import adasum_reference
from onnxtrain.parallel.pipeline import CutEdge, parse_cut_info, partition
from onnxtrain.parallel.stage_graphs import StageGraphs, build_stage_graphs
from onnxtrain.training_graph import select_trainable
from tests.parallel.conftest import run_mpi
from tests.parallel.pipeline_worker import (
    CASES,
    GRADIENTS,
    LOSS_SCALE,
    LR,
    REPLICAS,
    STEPS,
    bn_blocks_model,
    bn_model,
    case_feeds,
    dropout_model,
    eval_output,
    gradient_names,
    parameters,
    ranks,
    scale_feed,
    skip_model,
    tied_model,
    transformer_model,
)
from tests.session.helpers import mlp_model

PIPELINE_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pipeline_worker.py")
TWO = [
    "adam2",
    "adam2_resumed",
    "adam2_clip_m4",
    "sgd2_consumer_cut",
    "lamb2_clip",
    "adam2_tied_clip",
    "adam2_mp_clip",
    "lamb2_mp_overflow",
    "adam2_dropout_m1",
]
THREE = ["adam3_skip_clip", "lamb3_skip_m4"]


def one_process(
    case: str, model: onnx.ModelProto | None = None
) -> tuple[list[float], dict[str, np.ndarray], np.ndarray]:
    """The reference: one session accumulating the case's micro-batches (losses of each step's last one),
    and its forward-only output on another batch; ``model`` in place of the case's."""
    build, _, _, micro, *_ = CASES[case]
    model = build() if model is None else model
    sess = TrainingSession(model.SerializeToString(), parameters(case, model, False))
    losses = []
    replicas = REPLICAS.get(case, 1)
    for feeds in case_feeds(case, STEPS):
        for r in range(replicas):  # each replica's part of the batch, micro-batch by micro-batch
            for k in range(micro):
                part = {n: np.split(np.split(v, replicas)[r], micro)[k] for n, v in feeds.items()}
                (loss,) = sess.run(["loss"], {**part, **scale_feed(case), "Learning_Rate": LR})
                if r == 0 and k == micro - 1:
                    losses.append(float(loss))  # rank 0's: the last micro-batch of the first replica
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    feeds = {**case_feeds(case, 1, seed=9)[0], **scale_feed(case)}
    (out,) = sess.run([eval_output(case) or "loss"], feeds, ro)
    return losses, sess.get_state(), out


def pipelined(tmp_path, cases: list[str], n: int, env: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    out = tmp_path / f"pipeline{n}.npz"
    r = run_mpi(str(out), ",".join(cases), n=n, timeout=240, env=env, worker=PIPELINE_WORKER)
    assert r.returncode == 0, r.stdout + r.stderr
    # onnxruntime's warnings of the graphs handed to it (an initializer that is an input too, one that no node
    # reads) were printed by every rank on the backend
    assert "[W:onnxruntime:" not in r.stderr, r.stderr[-3000:]
    return dict(np.load(out))


def compare(got: dict[str, np.ndarray], case: str, tol: float, model: onnx.ModelProto | None = None) -> None:
    losses, state, out = one_process(case, model)
    np.testing.assert_allclose(got[f"{case}/losses"], losses, rtol=tol, atol=0, err_msg=case)
    assert sorted(k.split("/", 2)[2] for k in got if k.startswith(f"{case}/state/")) == sorted(state), case
    twins = {k for k in state if k.endswith(("_fp16", "_bf16"))}  # derived: the masters' casts, tested apart
    for k, v in state.items():
        if k in twins:
            continue
        np.testing.assert_allclose(
            got[f"{case}/state/{k}"], v, rtol=tol, atol=tol * float(np.abs(v).max()), err_msg=f"{case}: {k}"
        )
    np.testing.assert_allclose(got[f"{case}/eval"], out, rtol=tol, atol=tol, err_msg=case)
    if f"{case}/eval_unlabelled" in got:  # the same forward without the labels
        np.testing.assert_array_equal(got[f"{case}/eval_unlabelled"], got[f"{case}/eval_labelled"],
                                      err_msg=case)


def compare_half(got: dict[str, np.ndarray], case: str) -> None:
    """``compare`` for a mixed-precision case whose products split over ranks: within float16 rounding of
    the split products (losses 5e-4, state and output 1e-2 of their largest value)."""
    losses, state, out = one_process(case)
    np.testing.assert_allclose(got[f"{case}/losses"], losses, rtol=5e-4, err_msg=case)
    assert sorted(k.split("/", 2)[2] for k in got if k.startswith(f"{case}/state/")) == sorted(state)
    for k, v in state.items():
        tol = 1e-2 * float(np.abs(v).max())
        np.testing.assert_allclose(got[f"{case}/state/{k}"], v, rtol=0, atol=tol, err_msg=f"{case}: {k}")
    np.testing.assert_allclose(got[f"{case}/eval"], out, rtol=0, atol=1e-2, err_msg=case)


@pytest.mark.mpi
def test_batch_norm_running_statistics_in_both_stages(tmp_path) -> None:
    """A training-mode BatchNormalization in each stage: each micro-batch's forward updates its running
    statistics (momentum 0.8), as each micro-step of one process does; the statistics are state (gathered,
    compared with one process's after 6 steps of 2 micro-batches) and move away from their start; also
    under mixed precision (float16 activations cross the cut)."""
    got = pipelined(tmp_path, ["adam2_bn_clip", "adam2_bn_mp_clip", "adam2_bn_eval_clip"], 2)
    compare(got, "adam2_bn_clip", 1e-6)
    compare(got, "adam2_bn_mp_clip", 1e-6)
    compare(got, "adam2_bn_eval_clip", 1e-6)  # written for inference: trained in training mode all the same
    start = {t.name: numpy_helper.to_array(t) for t in bn_model().graph.initializer}
    for stat in ("bn1_mean", "bn1_var", "bn2_mean", "bn2_var"):
        assert np.abs(got[f"adam2_bn_clip/state/{stat}"] - start[stat]).max() > 1e-2, stat
        np.testing.assert_array_equal(got[f"adam2_bn_eval_clip/state/{stat}"],
                                      got[f"adam2_bn_clip/state/{stat}"])


@pytest.mark.mpi
def test_two_stages_accumulate_gradients_over_runs(tmp_path) -> None:
    """gradient_accumulation_steps=2 on top of two micro-batches: the update every second run, with the mean
    over the four micro-batches, as one process accumulating them; micro-steps counted by the session or
    marked by fetching Group_Accumulated_Gradients."""
    got = pipelined(tmp_path, ["adam2_acc2_clip", "sgd2_acc2_legacy"], 2)
    compare(got, "adam2_acc2_clip", 1e-6)
    compare(got, "sgd2_acc2_legacy", 1e-6)


@pytest.mark.mpi
def test_two_stages_train_as_one_process_accumulating_the_micro_batches(tmp_path) -> None:
    got = pipelined(tmp_path, TWO, 2)
    for case in TWO:
        # the same graphs on the same micro-batches: bit for bit, but for the global norm, which the
        # stages sum in float64 (LAMB reads it: a last-bit difference)
        compare(got, case, 1e-6)
    assert np.array_equal(got["adam2/losses"], one_process("adam2")[0])


@pytest.mark.mpi
def test_three_stages_with_a_tensor_passed_through_the_middle_stage(tmp_path) -> None:
    got = pipelined(tmp_path, THREE, 3)
    for case in THREE:
        compare(got, case, 1e-6)


@pytest.mark.mpi
def test_two_stages_times_two_data_parallel_replicas(tmp_path) -> None:
    """mpiexec -n 4: each pipeline on half of every batch; the replicas average their gradients, as one
    process accumulating all four micro-batches does."""
    got = pipelined(tmp_path, ["adam2x2_tied_clip"], 4)
    compare(got, "adam2x2_tied_clip", 1e-6)


@pytest.mark.mpi
def test_zero_and_adasum_within_each_stage_of_two_by_two(tmp_path) -> None:
    """mpiexec -n 4, two stages × two replicas. ZeRO stage 1 shards each stage's Adam state over its two
    replicas: the same weights as the pipeline without it (and one process), its gathered state the
    unsharded one, also when resumed from it halfway (tied weights). Adasum: each replica updates with its
    own gradients, the stage's replicas combine the deltas; checked against one process per replica whose
    deltas the float64 formula (``adasum_reference``) combines."""
    zero = ["adam2x2_zero_clip", "adam2x2_tied_zero_resumed"]
    bn = ["adam2x2_bn_clip", "adam2x2_bn_zero_clip"]  # each replica keeps its own running statistics
    got = pipelined(tmp_path, ["adam2x2_clip", *zero, "adam2x2_adasum_clip", *bn], 4)
    for case in zero:
        compare(got, case, 1e-6)
    assert_same_run(got, "adam2x2_zero_clip", "adam2x2_clip")
    assert_adasum(got, "adam2x2_adasum_clip", "adam2x2_clip")
    assert_same_run(got, *reversed(bn))


@pytest.mark.mpi
def test_zero_and_adasum_under_mixed_precision(tmp_path) -> None:
    """mpiexec -n 4, two stages × two replicas, mixed precision (float16 activations cross the cut). ZeRO:
    the same weights as the pipeline without it and as one process. Adasum: as one process per replica
    combined by the float64 formula. With a loss scale that overflows, every replica of every stage skips
    every update, with ZeRO or Adasum: the state stays the initial one, as one process keeps it. So it does
    when only the second replica's gradients overflow (its inputs beyond float16's range): under Adasum the
    first replica, whose own gradients are finite, skips too."""
    overflow = ["adam2x2_mp_zero_overflow", "adam2x2_mp_adasum_overflow", "adam2x2_mp_adasum_half_overflow"]
    trained = ["adam2x2_mp_clip", "adam2x2_mp_zero_clip", "adam2x2_mp_adasum_clip"]
    trained += ["adam2x2_mp_adasum_noclip", "adam2x2_mp_adasum_frozen"]
    got = pipelined(tmp_path, [*trained, *overflow], 4)
    for case in ("adam2x2_mp_clip", "adam2x2_mp_zero_clip", *overflow):
        compare(got, case, 1e-6)
    assert np.isfinite(got["adam2x2_mp_adasum_half_overflow/losses"]).all()  # the first replica's: finite
    first = {t.name: numpy_helper.to_array(t) for t in mlp_model().graph.initializer}
    for case in overflow:
        for w, v in first.items():
            np.testing.assert_array_equal(got[f"{case}/state/{w}"], v, err_msg=f"{case}: {w}")
    for k in (k for k in got if k.startswith("adam2x2_mp_clip/state/")):
        np.testing.assert_allclose(got[k.replace("_mp_clip", "_mp_zero_clip")], got[k], rtol=1e-7, atol=1e-8,
                                   err_msg=k)
    # the frozen case: a first stage that trains nothing still takes part in the replica's deltas check
    for case in ("adam2x2_mp_adasum_clip", "adam2x2_mp_adasum_noclip", "adam2x2_mp_adasum_frozen"):
        losses, state = adasum_oracle(case)
        np.testing.assert_allclose(got[f"{case}/losses"], losses, rtol=1e-5, err_msg=case)
        assert sorted(k.split("/", 2)[2] for k in got if k.startswith(f"{case}/state/")) == sorted(state)
        for k, v in state.items():
            # the pipeline combines the deltas in float32, the oracle in float64: a weight within float32
            # rounding of a float16 rounding boundary may give its half twin the other value, and the steps
            # after it other gradients (W1[15, 1]: 6e-6 apart after 7 steps, its moments within 2e-12)
            np.testing.assert_allclose(got[f"{case}/state/{k}"], v, rtol=1e-5, atol=1e-5, err_msg=k)
    assert not np.allclose(got["adam2x2_mp_adasum_clip/state/W1"], got["adam2x2_mp_clip/state/W1"], rtol=1e-4)


@pytest.mark.mpi
def test_recompute_in_stages_and_split_blocks(tmp_path) -> None:
    """GELU, checkpoint and transformer-layer recompute over the two-way split, checkpoints and
    transformer layers in a pipeline whose first stage draws a Dropout mask (rebuilt from it): the same bits
    as without recompute."""
    pairs = {
        "adam_h2_layers_recompute": "adam_h2_layers",
        "adam2_layers_recompute": "adam2_layers",
        "adam_h2_gelu_recompute": "adam_h2_gelu_blocks",
        "adam_h2_gelu_ckpt": "adam_h2_gelu_blocks",
        "adam2_dropout_ckpt_m1": "adam2_dropout_m1",
    }
    got = pipelined(tmp_path, [*pairs, *dict.fromkeys(pairs.values())], 2)
    for case, plain in pairs.items():
        assert got.pop(f"{case}/recomputed") > 0, case  # the option acted (rank 0's graphs)
        theirs = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(f"{plain}/")}
        assert sorted(theirs) == sorted(k.split("/", 1)[1] for k in got if k.startswith(f"{case}/"))
        for k, v in theirs.items():
            np.testing.assert_array_equal(got[f"{case}/{k}"], v, err_msg=f"{case}: {k}")


def _stage_builder(
    model: onnx.ModelProto, cut: str
) -> tuple[Callable[[int], StageGraphs], TrainingParameters]:
    """Builds of ``model``'s stage graphs, cut in two at ``cut`` and trained by Adam, with the options
    (returned, to change between builds)."""
    part = partition(model, parse_cut_info(cut, 2), "loss")
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    opt = get_optimizer("AdamOptimizer", False)
    trainable = select_trainable(model, p)
    return (lambda s: build_stage_graphs(model, part, s, trainable, p, opt)), p


def test_stage_graphs_recompute_from_checkpoints() -> None:
    """A stage's backward recomputes what the checkpoints leave out (the ReLU output, from the checkpoint
    before it; a Dropout output from its saved mask) instead of reading it from the forward; a checkpoint
    that is no value of the model is an error naming the option."""
    model = dropout_model()
    stage, p = _stage_builder(model, "hr")
    plain = stage(0)
    p.recompute_checkpoints = ["h"]
    ckpt = stage(0)
    assert "hr0" in plain.saved and "hr0" not in ckpt.saved and "h" in ckpt.saved
    made = [o for n in ckpt.graphs["backward"].graph.node for o in n.output]
    assert "hr0_recompute" in made
    for graph in ckpt.graphs.values():
        onnx.checker.check_model(graph, full_check=True)
    p.recompute_checkpoints = ["nowhere"]
    with pytest.raises(ValueError, match=r"recompute_checkpoints: \['nowhere'\]"):
        stage(0)


def test_stage_graphs_recompute_transformer_layers() -> None:
    """transformer_layer_recompute in a pipeline: the layers are found on the whole model (from its loss,
    which the first stage does not hold), and the first stage's backward rebuilds its layer's activations
    (all layers but the last: the second stage's layer is kept)."""
    stage, p = _stage_builder(transformer_model(2), "layer0.res2")
    plain = [stage(s) for s in (0, 1)]
    p.transformer_layer_recompute = True
    layers = [stage(s) for s in (0, 1)]
    assert "layer0.mlp.gelu" in plain[0].saved and "layer0.mlp.gelu" not in layers[0].saved
    assert len(layers[0].saved) < len(plain[0].saved)
    made = [o for n in layers[0].graphs["backward"].graph.node for o in n.output]
    assert any(o.startswith("layer0.mlp.gelu_recompute") for o in made)
    for s in (0, 1):
        for graph in layers[s].graphs.values():
            onnx.checker.check_model(graph, full_check=True)
    last = [o for n in layers[1].graphs["backward"].graph.node for o in n.output]
    assert not any("_recompute" in o for o in last)  # the last layer is kept


@pytest.mark.mpi
def test_gradients_as_outputs(tmp_path) -> None:
    """set_gradients_as_graph_outputs in a pipeline and over a two-way split: each rank returns the whole
    model's gradients (a tied weight's summed over the stages that hold it, a split weight's put together
    from the ranks' shares), a pipeline's the mean over the run's micro-batches, as one process computes
    them on the whole batch; fetched with an update, or on the fetches' path alone (no update: the runs
    train as the case without the fetches does). Under mixed precision too (loss-scaled, the half twins'
    gradients the masters' cast)."""
    two = {case: plain for case, plain in GRADIENTS.items() if ranks(case) == 2}
    got = pipelined(tmp_path, [*two, *two.values()], 2)
    for case, plain in two.items():
        assert_gradient_outputs(got, case, plain)


def assert_gradient_outputs(got: dict[str, np.ndarray], case: str, plain: str) -> None:
    """``case`` trained as ``plain`` (the same options but the gradients as outputs), and its gradient outputs
    are one process's on the whole batch: after the first step (with its update) and at the last weights."""
    theirs = {k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(f"{plain}/")}
    for k, v in theirs.items():
        np.testing.assert_array_equal(got[f"{case}/{k}"], v, err_msg=f"{case}: {k}")
    model = CASES[case][0]()
    p = parameters(case, model, False)
    p.gradient_accumulation_steps = 1  # the whole batch in one run
    sess = TrainingSession(model.SerializeToString(), p)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    names = gradient_names(sess)
    tol = 2e-2 if case in LOSS_SCALE else 1e-5  # float16 activations: the batch's sums round apart
    for when, seed in (("grads0", 1), ("grads_eval", 9)):
        if when == "grads_eval":  # at the pipeline's last weights
            state = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{case}/state/")}
            sess.load_state(state)
        want = sess.run(names, {**case_feeds(case, 1, seed=seed)[0], **scale_feed(case)}, ro)
        mine = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{case}/{when}/")}
        assert sorted(mine) == sorted(names), case
        for n, w in zip(names, want):
            assert mine[n].dtype == w.dtype, n
            scale = float(np.abs(w.astype(np.float64)).max())
            np.testing.assert_allclose(
                mine[n].astype(np.float64), w, rtol=tol, atol=tol * scale, err_msg=f"{case} {when}: {n}"
            )
            assert scale > 0, n


def assert_same_run(got: dict[str, np.ndarray], case: str, other: str) -> None:
    """``case`` saved the same losses, outputs and state as ``other`` (ZeRO against the unsharded run)."""
    mine, theirs = ({k.split("/", 1)[1]: v for k, v in got.items() if k.startswith(f"{c}/")}
                    for c in (case, other))
    assert sorted(mine) == sorted(theirs), case
    for k, v in theirs.items():
        if v.dtype.kind == "U":  # names (the split weights)
            np.testing.assert_array_equal(mine[k], v, err_msg=f"{case}: {k}")
        else:
            np.testing.assert_allclose(mine[k], v, rtol=1e-7, atol=1e-8, err_msg=f"{case}: {k}")


def assert_adasum(got: dict[str, np.ndarray], case: str, mean: str) -> None:
    """``case`` trained as :func:`adasum_oracle` says, and elsewhere than ``mean`` (the replicas' mean)."""
    losses, state = adasum_oracle(case)
    np.testing.assert_allclose(got[f"{case}/losses"], losses, rtol=1e-5, err_msg=case)
    assert sorted(k.split("/", 2)[2] for k in got if k.startswith(f"{case}/state/")) == sorted(state)
    for k, v in state.items():
        np.testing.assert_allclose(got[f"{case}/state/{k}"], v, rtol=1e-5, atol=1e-6, err_msg=k)
    assert not np.allclose(got[f"{case}/state/W1"], got[f"{mean}/state/W1"], rtol=1e-4, atol=0)


def adasum_oracle(case: str) -> tuple[list[float], dict[str, np.ndarray]]:
    """One process per replica (accumulating its micro-batches only, clipping by its own gradients' norm,
    keeping its own Adam state); after each step the replicas' weight deltas are combined by
    ``adasum_reference`` (float64) and both take the old weights plus it. Returns replica 0's losses and
    state."""
    build, _, _, micro, *_ = CASES[case]
    model = build()
    replicas = REPLICAS[case]
    sessions = [
        TrainingSession(model.SerializeToString(), _per_replica(case, model)) for _ in range(replicas)
    ]
    names = [t.name for t in model.graph.initializer if t.name in sessions[0].get_state()]  # the trained
    losses = []
    for feeds in case_feeds(case, STEPS):
        old = sessions[0].get_state()
        deltas = []
        for r, sess in enumerate(sessions):
            for k in range(micro):
                part = {n: np.split(np.split(v, replicas)[r], micro)[k] for n, v in feeds.items()}
                (loss,) = sess.run(["loss"], {**part, **scale_feed(case), "Learning_Rate": LR})
                if r == 0 and k == micro - 1:
                    losses.append(float(loss))
            new = sess.get_state()
            deltas.append([new[w].astype(np.float64) - old[w] for w in names])
        combined = adasum_reference(deltas)
        weights = {w: (old[w] + d).astype(old[w].dtype) for w, d in zip(names, combined)}
        for sess in sessions:
            sess.load_state(weights)
    return losses, sessions[0].get_state()


def _per_replica(case: str, model: onnx.ModelProto) -> TrainingParameters:
    p = parameters(case, model, False)
    p.gradient_accumulation_steps = CASES[case][3]
    return p


def torch_transformer_case(
    tmp_path, monkeypatch, case: str, tol: float, name: str = "transformer_encoder", backend: str = ""
) -> None:
    """Run ``case`` on torch's export of model ``name`` (a transformer encoder layer by default; dropout 0)
    and compare with one process of the numpy engine (the worker and the reference read the model from
    ``$PIPELINE_TORCH_MODEL``; the workers run on ``backend``, default numpy)."""
    pytest.importorskip("torch")
    from tests.models import export

    model, _, _ = export(name, training=True, with_loss=True, dropout=0.0)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, path)
    monkeypatch.setenv("PIPELINE_TORCH_MODEL", str(path))
    env = {"PIPELINE_TORCH_MODEL": str(path), **({"ONNXTRAIN_TEST_BACKEND": backend} if backend else {})}
    compare(pipelined(tmp_path, [case], 2, env=env), case, tol)


def torch_llama_case(tmp_path, monkeypatch, case: str, tol: float) -> None:
    """Run ``case`` on torch's opset-23 export of the Llama-style block of
    tests/session/test_opset23_exports.py (for the worker's batch) and compare with one process, as
    :func:`torch_transformer_case` does."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxscript", reason="torch's opset-23 exporter (dynamo) needs onnxscript")
    from tests.parallel.pipeline_worker import BATCH
    from tests.session.test_opset23_exports import export_llama

    path = str(tmp_path / "llama.onnx")
    onnx.save(export_llama(23, BATCH), path)
    monkeypatch.setenv("PIPELINE_TORCH_MODEL", path)
    compare(pipelined(tmp_path, [case], 2, env={"PIPELINE_TORCH_MODEL": path}), case, tol)


@pytest.mark.mpi
def test_torch_exported_transformer_cut_after_its_attention(tmp_path, monkeypatch) -> None:
    """torch's export shares initializers through Identity nodes and constants between layers: the shared
    weights' gradients are summed over the stages, the constants computed on both sides of the cut."""
    torch_transformer_case(tmp_path, monkeypatch, "sgd2_torch_transformer", 1e-6)


@pytest.mark.mpi
def test_torch_opset23_block_in_two_stages(tmp_path, monkeypatch) -> None:
    """torch's opset-23 Llama-style block cut after its attention's residual: the first stage holds ONNX's
    Attention and RMSNormalization ops, differentiated as their bodies; Adam steps as one process takes."""
    torch_llama_case(tmp_path, monkeypatch, "adam2_torch_llama", 1e-6)


@pytest.mark.mpi
def test_onnxruntime_backend_stages_equal_the_numpy_engine_in_one_process(tmp_path) -> None:
    pytest.importorskip("onnxruntime")
    """Also with a training-mode BatchNormalization in each stage: onnxruntime writes a normalization's new
    running statistics into the buffer it is given for the old ones when the graph does not return them,
    so the forward-only graph holds them as constants (a test found the forward-only run corrupting the
    state)."""
    got = pipelined(
        tmp_path, ["adam2_clip_m4", "adam2_bn_clip"], 2, env={"ONNXTRAIN_TEST_BACKEND": "onnxruntime"}
    )
    compare(got, "adam2_clip_m4", 1e-5)
    compare(got, "adam2_bn_clip", 1e-5)


# ---- the cut string and the partition (one process) ------------------------------------------------------
def test_cut_string_grammar() -> None:
    assert parse_cut_info("12", 2) == [[CutEdge("12")]]
    assert parse_cut_info("a:b-c/d,e", 3) == [[CutEdge("a"), CutEdge("b", ("c", "d"))], [CutEdge("e")]]
    with pytest.raises(ValueError, match="has 1 cut"):
        parse_cut_info("a", 3)
    with pytest.raises(ValueError, match="needs pipeline_cut_info_string") as e:
        parse_cut_info("", 2)
    assert str(e.value).endswith("got ''")  # the value given (the message showed a literal {text!r})
    with pytest.raises(ValueError, match="malformed edge 'a-'"):
        parse_cut_info("a-", 2)


def test_partition_places_nodes_and_lists_what_crosses() -> None:
    m = skip_model()
    part = partition(m, parse_cut_info("r1,r2", 3), "loss")
    by_name = {n.output[0]: s for n, s in zip(m.graph.node, part.stage_of)}
    assert by_name == {"h1": 0, "r1": 0, "h2": 1, "r2": 1, "s": 2, "z": 2, "scale": 2, "logits": 2, "loss": 2}
    assert part.sends == [["r1"], ["r1", "r2"]]  # r1 goes on through stage 1 to the Add of stage 2
    assert part.copies == {}
    # a consumer-limited edge: only the named reader moves on
    m2 = mlp_model()
    part2 = partition(m2, parse_cut_info("hr-logits", 2), "loss")
    assert part2.stage_of == [0, 0, 1, 1]
    # nodes of constants and weights alone run in every stage that reads them; only activations cross
    m3 = tied_model()
    part3 = partition(m3, parse_cut_info("t", 2), "loss")
    names = [n.output[0] for n in m3.graph.node]
    assert [names[k] for k, n in enumerate(m3.graph.node) if 1 in part3.runs(k)] == [
        "shape",
        "t2",
        "Et",
        "logits",
        "loss",
    ]
    assert part3.runs(names.index("shape")) == {0, 1} and part3.sends == [["t"]]
    # but a training-mode BatchNormalization of an input (xb, read on both sides of the cut) runs once:
    # twice, it would update its running statistics twice; its output crosses the cut instead
    m4 = bn_blocks_model()
    part4 = partition(m4, parse_cut_info("o1", 2), "loss")
    assert part4.runs(0) == {0} and part4.sends == [["xb", "o1"]]
    m4.graph.node[0].attribute[-1].i = 0  # in inference mode it is a function of an input alone: it floats
    part5 = partition(m4, parse_cut_info("o1", 2), "loss")
    assert part5.runs(0) == {0, 1} and part5.sends == [["o1"]]


@pytest.mark.parametrize(
    "cut, match",
    [
        ("nope", "'nope' is not a tensor of the graph"),
        ("x", "'x' is a graph input or initializer"),
        ("hr-h", "no node with output 'h' reads 'hr'"),
        ("loss", "nothing reads 'loss'"),
    ],
)
def test_partition_names_a_bad_cut(cut: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        partition(mlp_model(), parse_cut_info(cut, 2), "loss")


def test_partition_refuses_cuts_out_of_order_and_a_loss_outside_the_last_stage() -> None:
    with pytest.raises(
        ValueError, match="cut 0 separates stage 0 from stage 1, but 'r2' is computed in stage 2"
    ):
        partition(skip_model(), parse_cut_info("r2,r1", 3), "loss")
    # the loss in stage 0 of a model whose logits are read after a cut
    with pytest.raises(ValueError, match="'logits' is computed in stage 0, not in the last stage \\(1\\)"):
        partition(mlp_model(), parse_cut_info("logits", 2), "logits")


def test_sliced_schema_is_checked_against_the_inputs_and_the_micro_batches() -> None:
    """sliced_schema gives a micro-batch's input shapes: a name that is no input of the model, or a shape
    that the micro-batches do not have, is an error naming it (both were accepted and changed nothing)."""
    from onnxtrain.session_stages import MicroBatching

    model = mlp_model()  # x [N, 8], y [N]

    def micro(schema: dict) -> MicroBatching:
        m = MicroBatching()
        m._params = TrainingParameters()
        m._params.num_pipeline_micro_batches = 2
        m._params.sliced_schema = schema
        m._setup_micro_batches(model, None)
        return m

    with pytest.raises(ValueError, match=r"sliced_schema: \['nope'\] are not inputs of the model"):
        micro({"x": [2, 8], "nope": [7]})
    feeds = {"x": np.zeros((4, 8), np.float32), "y": np.zeros(4, np.int64)}
    parts = micro({"x": [2, 8], "y": [2]})._micro_feeds(feeds, 2)
    assert [p["x"].shape for p in parts] == [(2, 8), (2, 8)]
    with pytest.raises(ValueError, match=r"sliced_schema\['x'\] = \[9, 9, 9\], but a micro-batch of 'x' "
                                         r"has shape \[2, 8\]"):
        micro({"x": [9, 9, 9]})._micro_feeds(feeds, 2)


def test_pipeline_session_errors_in_one_process() -> None:
    model = mlp_model().SerializeToString()

    def params(**kw) -> TrainingParameters:
        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "AdamOptimizer"
        p.pipeline_parallel_size = 2
        p.pipeline_cut_info_string = "hr"
        for k, v in kw.items():
            setattr(p, k, v)
        return p

    with pytest.raises(ValueError, match="launch with: mpiexec -n 2"):
        TrainingSession(model, params())
    with pytest.raises(ValueError, match=r"horizontal_parallel_size × pipeline_parallel_size=4 needs a "
                       r"multiple of 4 MPI ranks .* launch with: mpiexec -n 4"):
        TrainingSession(model, params(horizontal_parallel_size=2))
    with pytest.raises(ValueError, match="needs an optimizer"):
        TrainingSession(model, params(training_optimizer_name=""))
    p = params(pipeline_parallel_size=1, num_pipeline_micro_batches=4)
    with pytest.warns(
        UserWarning, match="num_pipeline_micro_batches, pipeline_cut_info_string have no effect"
    ):
        TrainingSession(model, p)



@pytest.mark.mpi
def test_mixed_precision_state_lists_the_half_twins(tmp_path) -> None:
    """Under mixed precision the gathered state holds every trained weight's half twin (``<w>_fp16``), as one
    process's does: the float32 master cast to float16. The resumed case loads such a state strictly (each
    stage checks and skips the twins) and trains on as one process."""
    case = "adam2_mp_resumed"
    got = pipelined(tmp_path, [case], 2)
    compare(got, case, 1e-6)
    state = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{case}/state/")}
    weights = [t.name for t in mlp_model().graph.initializer]
    assert weights
    for w in weights:
        assert state[f"{w}_fp16"].dtype == np.float16, w
        np.testing.assert_array_equal(state[f"{w}_fp16"], state[w].astype(np.float16), err_msg=w)


def test_a_cut_at_a_shape_gives_the_next_stage_the_ranks_after_it(tmp_path) -> None:
    """Cut at the shape an attention block's Reshape reads (torch's ``/Concat_output_0``): the next stage
    alone cannot infer the ranks after that Reshape, so it is given those one process's shape inference
    finds, and its backward builds (before: an error naming the cut); its gradients are torch's."""
    torch = pytest.importorskip("torch")
    from onnxtrain.engine import compile_model

    torch.manual_seed(0)

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            q = self.q(x).reshape(b, t, 2, 4).transpose(1, 2)
            k = self.k(x).reshape(b, t, 2, 4).transpose(1, 2)
            return ((q @ k.transpose(-1, -2)).mean() - y.mean()) ** 2

    module = Attention()
    x, y = torch.randn(2, 3, 8), torch.randn(2)
    path = str(tmp_path / "attention.onnx")
    torch.onnx.export(module, (x, y), path, input_names=["x", "y"],
                      output_names=["loss"], dynamic_axes={"x": {0: "N"}, "y": {0: "N"}}, dynamo=False,
                      opset_version=17, do_constant_folding=False, export_params=True,
                      keep_initializers_as_inputs=False)
    model = onnx.load(path)
    cut = next(o for n in model.graph.node if n.op_type == "Concat" for o in n.output)
    build, p = _stage_builder(model, cut)
    p.pipeline_cut_info_string = cut
    stage = build(1)
    backward = stage.graphs["backward"]
    onnx.checker.check_model(backward, full_check=True)
    # the values the stage receives, from one process's run of the model
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.output.extend(onnx.ValueInfoProto(name=r) for r in stage.received)
    feeds = {"x": x.numpy(), "y": y.numpy()}
    got = compile_model(probe).run(feeds)[1:]
    inputs = {i.name for i in backward.graph.input}
    run = {**{k: v for k, v in feeds.items() if k in inputs}, **dict(zip(stage.received, got)),
           **{w: stage.initial[w] for w in stage.trainable}}
    out = dict(zip([o.name for o in backward.graph.output], compile_model(backward).run(run)))
    module(x, y).backward()
    params = dict(module.named_parameters())
    assert stage.trainable
    for w in stage.trainable:
        np.testing.assert_allclose(out[f"{w}_grad"], params[w].grad.numpy(), rtol=1e-5, atol=1e-6)


def test_stage_graphs_hand_onnxruntime_no_dead_values() -> None:
    """Each stage graph declares a weight either as an input or as an initializer, not both, and holds no
    Constant that nothing reads: onnxruntime warned of each ("Initializer W1 appears in graph inputs",
    "Removing initializer 'pipeline_stage0_loss'") on every rank of a backend session."""
    stage, _ = _stage_builder(dropout_model(), "hr")
    for s in (0, 1):
        for kind, graph in stage(s).graphs.items():
            g = graph.graph
            inputs = {i.name for i in g.input}
            assert [t.name for t in g.initializer if t.name in inputs] == [], (s, kind)
            read = {x for n in g.node for x in n.input} | {o.name for o in g.output}
            dead = [o for n in g.node if n.op_type == "Constant" for o in n.output if o not in read]
            assert dead == [], (s, kind)


def test_update_graph_takes_weights_as_inputs_only() -> None:
    """The update graph of weights that its base graph still holds as initializers (a horizontal split's
    shares) declares them as inputs only: it held both, and onnxruntime warned of each on every rank."""
    from onnxtrain.optim import WeightSlot
    from onnxtrain.training_graph import build_update_graph

    base = mlp_model()  # W1, b1, W2, b2 are initializers
    p = TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "AdamOptimizer"
    inits = {t.name: t for t in base.graph.initializer}
    slots = [WeightSlot(w, f"{w}_grad", tuple(inits[w].dims), inits[w].data_type) for w in ("W1", "b1")]
    graph, *_ = build_update_graph(base, slots, p, get_optimizer("AdamOptimizer", False), clip=False)
    inputs = {i.name for i in graph.graph.input}
    assert {"W1", "b1"} <= inputs
    assert [t.name for t in graph.graph.initializer if t.name in inputs] == []
    onnx.checker.check_model(graph, full_check=True)

"""Data parallelism over more than two ranks (the worker of ``test_ort_distributed_ports.py``).

``mpiexec -n N python ort_distributed_worker.py OUT CASE,CASE,...`` trains each named case of ``CASES`` on
this rank's share of every global micro-batch and rank 0 saves, for every rank, the weights after each
optimizer step (``CASE/RANK/STEP/W``), the global norms fetched, ZeRO's gathered state and the message of a
session the options refused (``CASE/RANK/error``). The float64 and single-process references live in the
test.
"""

from __future__ import annotations

import os
import sys
import warnings
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

LR = np.array([0.05], np.float32)
STEPS = 3
MICRO = 24  # rows of a global micro-batch: splits evenly over 2, 3 and 4 ranks
WEIGHTS = ("W1", "W2", "b1", "b2")


@dataclass(frozen=True)
class Case:
    opt: str  # SGDOptimizer, AdamOptimizer, LambOptimizer
    accum: int = 1
    mode: str = "allreduce"  # allreduce, adasum, zero, or zero+adasum (both options set)
    clip: float | None = None  # max_norm_clip of every weight; None: enable_grad_norm_clip off
    mp: bool = False
    dims: tuple[int, int, int] = (10, 16, 4)  # din, dh, dout of tests.session.helpers.mlp_model
    loss_scale: float = 1024.0  # under mixed precision


CASES = {
    # 4 ranks: Adasum's tree is two levels deep (ranks 0+1 and 2+3, then the two pairs)
    "adasum_sgd_a2": Case("SGDOptimizer", accum=2, mode="adasum"),
    "adasum_adam": Case("AdamOptimizer", mode="adasum"),
    "adasum_adam_mp": Case("AdamOptimizer", mode="adasum", clip=0.3, mp=True),
    # onnxruntime's own Adasum test trained LAMB, in single and in half precision
    "adasum_lamb": Case("LambOptimizer", mode="adasum", clip=0.3),
    "adasum_lamb_mp": Case("LambOptimizer", mode="adasum", clip=0.3, mp=True),
    # mlp 10-16-4: 244 elements, padded to 256 over 4 ranks (64 each): W1 (offsets 0..159) spans ranks 0, 1
    # and 2, rank 1 owning its middle piece; over 3 ranks (96 each) W1 and W2 each straddle a boundary
    "zero_adam_clip": Case("AdamOptimizer", mode="zero", clip=0.3),
    "zero_adam_mp": Case("AdamOptimizer", mode="zero", clip=0.3, mp=True),
    # mlp 2-3-2: 17 elements, padded to 32 a rank: every weight is rank 0's, the other ranks own nothing
    "zero_tiny_adam": Case("AdamOptimizer", mode="zero", clip=0.3, dims=(2, 3, 2)),
    # and under mixed precision, the loss scale overflowing float16: every rank skips every update alike
    "zero_tiny_adam_mp_overflow": Case("AdamOptimizer", mode="zero", clip=0.3, mp=True, dims=(2, 3, 2),
                                       loss_scale=1e30),
    # both set: ZeRO, as onnxruntime's builder registry chose it first (so three ranks are no error either)
    "zero_adasum_adam": Case("AdamOptimizer", mode="zero+adasum", clip=0.3),
    "allreduce_lamb_a2": Case("LambOptimizer", accum=2, clip=0.3),
    "allreduce_sgd_a3": Case("SGDOptimizer", accum=3),
}


def micro_batches(case: Case, seed: int = 11) -> list[tuple[np.ndarray, np.ndarray]]:
    """The global micro-batches of ``case``, ``STEPS * accum`` of them."""
    din, _, dout = case.dims
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((MICRO, din)).astype(np.float32), rng.integers(0, dout, MICRO))
            for _ in range(STEPS * case.accum)]


def model_bytes(case: Case) -> bytes:
    from tests.session.helpers import mlp_model

    din, dh, dout = case.dims
    return mlp_model(din=din, dh=dh, dout=dout).SerializeToString()


def parameters(case: Case, data_parallel: bool = True):
    """The TrainingParameters of ``case``; without ``data_parallel``, those of its single-process reference
    (no exchange: Adasum's reference is one such session a rank)."""
    from onnxtrain import TrainingParameters

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = case.opt
    p.gradient_accumulation_steps = case.accum
    p.gradient_accumulation_mode = "auto"
    p.use_mixed_precision = case.mp
    p.enable_grad_norm_clip = case.clip is not None
    if case.clip is not None and case.opt != "SGDOptimizer":
        p.optimizer_attributes_map = {w: {"max_norm_clip": case.clip} for w in WEIGHTS}
    if data_parallel:
        p.enable_adasum = "adasum" in case.mode
        p.deepspeed_zero_stage = 1 if "zero" in case.mode else 0
    return p


def train(case: Case, parts: list[tuple[np.ndarray, np.ndarray]], data_parallel: bool = True,
          sess=None) -> tuple[object, list[dict[str, np.ndarray]], list[float]]:
    """``sess`` (a new session of ``case`` when None) run on the micro-batches ``parts`` (``accum`` a step):
    the session, its weights after each step, the global norms and the all-finite flags it fetched."""
    from onnxtrain import TrainingSession

    if sess is None:
        sess = TrainingSession(model_bytes(case), parameters(case, data_parallel))
    names = [o.name for o in sess.get_outputs()]
    fetch = ["loss"] + [n for n in ("global_gradient_norm", "all_gradients_finite") if n in names]
    weights, norms, flags = [], [], []
    for i, (x, y) in enumerate(parts):
        feeds = {"x": x, "y": y, "Learning_Rate": LR}
        if sess.loss_scale_input_name:
            feeds[sess.loss_scale_input_name] = np.array([case.loss_scale], np.float32)
        update = (i + 1) % case.accum == 0
        out = sess.run(fetch if update else ["loss"], feeds)
        if update:
            if len(out) > 1:
                norms.append(float(out[1]))
            if len(out) > 2:
                flags.append(bool(out[2]))
            weights.append({k: v.copy() for k, v in sess.get_model_state()["full_precision"].items()})
    sess.test_flags = flags
    return sess, weights, norms


# cases of tests/parallel/pipeline_worker.py's harness: (model, stages, cuts, micro-batches, optimizer,
# clipping), the horizontal split's size, the data-parallel replicas and how they combine their updates
CUT_CASES = {
    # four ranks
    "adam_h4_clip": ("mlp", 1, "", 1, "AdamOptimizer", True, 4, 1, ""),  # 16 hidden units, 4 a rank
    "adam_h4_gelu_blocks": ("gelu_blocks", 1, "", 1, "AdamOptimizer", True, 4, 1, ""),
    "adam4_clip": ("mlp", 4, "h,hr,logits", 4, "AdamOptimizer", True, 1, 1, ""),  # a node a stage
    # eight ranks: four replicas of two stages or of a two-way split, the replicas averaging, under ZeRO or
    # combined by Adasum's two-level tree (SGD: Adam on four rows a replica amplifies float32 rounding of the
    # split products, 1e-7 of the initial weights moving its loss by 7e-5)
    "adam2x4_clip": ("mlp", 2, "hr", 2, "AdamOptimizer", True, 1, 4, ""),
    "adam2x4_zero_clip": ("mlp", 2, "hr", 2, "AdamOptimizer", True, 1, 4, "zero"),
    "adam2x4_adasum_clip": ("mlp", 2, "hr", 2, "AdamOptimizer", True, 1, 4, "adasum"),
    "adam_h2x4_gelu_zero": ("gelu_blocks", 1, "", 1, "AdamOptimizer", True, 2, 4, "zero"),
    "sgd_h2x4_gelu_blocks": ("gelu_blocks", 1, "", 1, "SGDOptimizer", False, 2, 4, ""),
    "sgd_h2x4_gelu_adasum": ("gelu_blocks", 1, "", 1, "SGDOptimizer", False, 2, 4, "adasum"),
}


def register_cut_cases() -> None:
    """Add ``CUT_CASES`` to the pipeline harness (in the test process too, for its one-process reference)."""
    from tests.parallel import pipeline_worker as pw

    builds = {"mlp": pw.mlp_model, "gelu_blocks": pw.gelu_blocks_model}
    for name, (model, stages, cut, micro, opt, clip, h, replicas, exchange) in CUT_CASES.items():
        pw.CASES[name] = (builds[model], stages, cut, micro, opt, clip)
        if h > 1:
            pw.HORIZONTAL[name] = h
        if replicas > 1:
            pw.REPLICAS[name] = replicas
        if exchange:
            sets = {("zero", True): pw.H_ZERO, ("adasum", True): pw.H_ADASUM,
                    ("zero", False): pw.ZERO, ("adasum", False): pw.ADASUM}
            sets[exchange, h > 1].add(name)


def cut_cases(ranks: int) -> list[str]:
    """The ``CUT_CASES`` of ``ranks`` ranks."""
    return [c for c, (_, stages, *_, h, replicas, _) in CUT_CASES.items() if stages * h * replicas == ranks]


def main() -> None:
    from onnxtrain.parallel import get_communicator, split_batch, world

    if sys.argv[1] == "cut":  # the pipeline harness on this module's cases
        from tests.parallel import pipeline_worker

        register_cut_cases()
        pipeline_worker.main(sys.argv[2], sys.argv[3].split(","))
        return
    out, names = sys.argv[1], sys.argv[2].split(",")
    w = world()
    comm = get_communicator()
    saved: dict[str, np.ndarray] = {}
    for name in names:
        case = CASES[name]
        mine: dict[str, np.ndarray] = {}
        try:
            parts = [split_batch(b) for b in micro_batches(case)]
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sess, weights, norms = train(case, parts)
        except ValueError as e:  # refused alike by every rank, before any exchange
            mine["error"] = np.array(str(e))
        else:
            for s, ws in enumerate(weights):
                for k, v in ws.items():
                    mine[f"{s}/{k}"] = v
            mine["norms"] = np.asarray(norms)
            mine["flags"] = np.asarray(sess.test_flags, bool)
            mine["warnings"] = np.array([str(c.message) for c in caught] or [""])
            if "zero" in case.mode:
                for k, v in sess.gather_state().items():
                    mine[f"gathered/{k}"] = v
        for r, d in enumerate(comm.allgather_object(mine, f"gathering the results of {name}")):
            saved.update({f"{name}/{r}/{k}": v for k, v in d.items()})
    if w.rank == 0:
        np.savez(out, **saved)


if __name__ == "__main__":
    main()

"""Run under ``mpiexec -n 2``: data-parallel sessions on half batches, Adasum on random vectors, faults.

``python mpi_worker.py train OUT.npz [CASE,...]`` trains every case of ``CASES`` (or those named) and rank
0 saves the final weights (and per-rank optimizer-state bytes), on the backend ``$ONNXTRAIN_TEST_BACKEND``
names (default numpy); ``collectives OUT.npz`` saves each rank's Adasum input
vectors and results, and what the helpers (``allreduce_gradients``, ``world``, ``shard_range``) gave;
``raise``/``kill``/``hang`` [CKPT] and ``mismatch`` exercise the failure paths.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession  # noqa: E402
from onnxtrain.parallel import split_batch, world  # noqa: E402
from tests.session.helpers import batches, mlp_model  # noqa: E402

LR = np.array([0.05], np.float32)
STEPS = 20
GLOBAL_BATCH = 16

CLIP = {w: {"max_norm_clip": 0.3} for w in ("W1", "W2", "b1", "b2")}  # the global norm is about 0.5..1
NO_CLIP = {"enable_grad_norm_clip": False}
# name → (optimizer, gradient accumulation steps, ZeRO stage, TrainingParameters extras)
CASES = {
    "sgd": ("SGDOptimizer", 1, 0, {}),
    "adam": ("AdamOptimizer", 1, 0, {}),
    "adam_accum": ("AdamOptimizer", 2, 0, {}),
    "sgd_accum": ("SGDOptimizer", 3, 0, {}),
    "lamb": ("LambOptimizer", 1, 0, {}),
    "adam_zero": ("AdamOptimizer", 1, 1, {}),
    "adam_zero_accum": ("AdamOptimizer", 2, 1, {}),
    "sgd_zero": ("SGDOptimizer", 1, 1, {}),
    "adam_clip": ("AdamOptimizer", 1, 0, {"optimizer_attributes_map": CLIP}),
    "adam_zero_clip": ("AdamOptimizer", 1, 1, {"optimizer_attributes_map": CLIP}),
    # Adasum of equal deltas is that delta: both ranks on the whole batch equal one process
    "adam_adasum": ("AdamOptimizer", 1, 0, {"enable_adasum": True, "same_data": True}),
    "sgd_adasum_accum": ("SGDOptimizer", 3, 0, {"enable_adasum": True, "same_data": True}),
    # clipping off: onnxruntime's Adasum turns clipping on in its optimizer nodes, but has a norm to clip by
    # only under float16 mixed precision (its finite check's); in float32 nothing is clipped
    "adam_noclip": ("AdamOptimizer", 1, 0, {**NO_CLIP, "optimizer_attributes_map": CLIP}),
    "adam_adasum_noclip": ("AdamOptimizer", 1, 0, {**NO_CLIP, "enable_adasum": True, "same_data": True,
                                                   "optimizer_attributes_map": CLIP}),
    "adam_mp_clip": ("AdamOptimizer", 1, 0, {"use_mixed_precision": True, "optimizer_attributes_map": CLIP}),
    "adam_adasum_mp_noclip": ("AdamOptimizer", 1, 0,
                              {**NO_CLIP, "use_mixed_precision": True, "enable_adasum": True,
                               "same_data": True, "optimizer_attributes_map": CLIP}),
    # float16 moments, partitioned: both ranks on the whole batch, so that no float16 rounding of a moment can
    # part from one process's over a last-bit difference of the reduced gradient
    "adam_fp16m": ("AdamOptimizer", 1, 0, {"use_fp16_moments": True, "same_data": True}),
    "adam_zero_fp16m": ("AdamOptimizer", 1, 1, {"use_fp16_moments": True, "same_data": True}),
    # mixed precision over plain allreduce: the loss scale reaches the update; with a scale that overflows
    # float16, every rank skips every update alike
    "adam_mp": ("AdamOptimizer", 1, 0, {"use_mixed_precision": True}),
    "adam_mp_accum": ("AdamOptimizer", 2, 0, {"use_mixed_precision": True}),
    "lamb_mp": ("LambOptimizer", 1, 0, {"use_mixed_precision": True}),
    "adam_mp_overflow": ("AdamOptimizer", 1, 0, {"use_mixed_precision": True, "loss_scale_feed": 1e30}),
    "adam_zero_mp": ("AdamOptimizer", 1, 1, {"use_mixed_precision": True}),
    "adam_zero_mp_clip": ("AdamOptimizer", 1, 1,
                          {"use_mixed_precision": True, "optimizer_attributes_map": CLIP}),
    "adam_zero_mp_overflow": ("AdamOptimizer", 1, 1, {"use_mixed_precision": True, "loss_scale_feed": 1e30}),
    # Adasum of equal deltas is that delta: both ranks on the whole batch equal one process; with a scale
    # that overflows on rank 1 only, both ranks skip every update
    "adam_adasum_mp": ("AdamOptimizer", 1, 0,
                       {"use_mixed_precision": True, "enable_adasum": True, "same_data": True}),
    "adam_adasum_mp_overflow": ("AdamOptimizer", 1, 0,
                                {"use_mixed_precision": True, "enable_adasum": True, "same_data": True,
                                 "loss_scale_feed": (1024.0, 1e30)}),
}
# mixed precision rounds each rank's products to float16, so one process on the whole batch is not the
# reference: one process accumulating the ranks' halves as micro-batches is (the same float16 gradients,
# summed in float32 and averaged alike)
HALVES = {c for c, (_, _, _, extra) in CASES.items()
          if extra.get("use_mixed_precision") and not extra.get("same_data")}
DIN = 10  # W1 has 160 elements: under ZeRO over 2 ranks (128 each) it straddles the boundary


def params(opt: str, accum: int, zero: int, extra: dict) -> TrainingParameters:
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.gradient_accumulation_steps = accum
    p.gradient_accumulation_mode = "auto"
    p.deepspeed_zero_stage = zero
    for k, v in extra.items():
        setattr(p, k, v)
    return p


def _session_options() -> SessionOptions | None:
    """Session options naming the backend in ``$ONNXTRAIN_TEST_BACKEND`` (None: the numpy engine)."""
    backend = os.environ.get("ONNXTRAIN_TEST_BACKEND", "")
    if not backend:
        return None
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return so


def train(case: str, rank: int | None = None, size: int | None = None,
          halves: bool = False) -> tuple[TrainingSession, list[float]]:
    """``STEPS`` optimizer steps (each of ``accum`` micro-batches); this rank's part of each global batch.
    ``halves``: one process taking, for each step, rank 0's micro-batches then rank 1's, as accumulation."""
    opt, accum, zero, extra = CASES[case]
    extra = dict(extra)
    scale = extra.pop("loss_scale_feed", 1024.0)
    if isinstance(scale, tuple):  # one per rank
        scale = scale[world().rank if rank is None else rank]
    scale = np.array([scale], np.float32)
    if extra.pop("same_data", False):
        rank, size = 0, 1
    global_batches = batches(STEPS * accum, GLOBAL_BATCH, din=DIN)
    if halves:
        parts = [(r, global_batches[i * accum + j])
                 for i in range(STEPS) for r in (0, 1) for j in range(accum)]
        accum *= 2
        zero = 0
    else:
        parts = [(rank, b) for b in global_batches]
    sess = TrainingSession(mlp_model(din=DIN).SerializeToString(), params(opt, accum, zero, extra),
                           _session_options())
    norms = []
    outputs = [o.name for o in sess.get_outputs()]
    wanted = [n for n in ("global_gradient_norm", "all_gradients_finite", "adasum_all_deltas_finite")
              if n in outputs]
    flags: dict[str, list[bool]] = {n: [] for n in wanted[1:]}
    for i, (part, (x, y)) in enumerate(parts):
        n = 2 if halves else size
        feeds = {"x": split_batch(x, part, n), "y": split_batch(y, part, n), "Learning_Rate": LR}
        if sess.loss_scale_input_name:
            feeds[sess.loss_scale_input_name] = scale
        update = (i + 1) % accum == 0
        out = sess.run(["loss", *wanted] if update else ["loss"], feeds)
        if len(out) > 1:
            norms.append(float(out[1]))
            for name, v in zip(wanted[1:], out[2:]):
                flags[name].append(bool(v))
    sess.test_flags = flags  # the mixed-precision flags of each update, for the tests
    return sess, norms


def reference_case(case: str) -> str:
    """The single-process case with the same result."""
    if case == "adam_adasum_mp_noclip":  # Adasum clips by the float16 finite check's norm
        return "adam_mp_clip"
    return case.replace("_zero", "").replace("_adasum", "")


def main() -> None:
    what, out = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else ""
    w = world()
    if what == "train":
        saved: dict[str, np.ndarray] = {}
        cases = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
        for case in cases:
            zero = CASES[case][2]
            sess, norms = train(case)
            opt_state = sess.get_optimizer_state()
            opt_bytes = sum(a.nbytes for d in opt_state.values() for a in d.values())
            print(f"rank {w.rank}: {case}: optimizer-state bytes on this rank {opt_bytes}; partitioned "
                  f"weights {sorted(sess.get_partition_info_map())}", flush=True)
            state = sess.get_model_state()["full_precision"]
            if zero:
                full = sess.gather_state()
                state.update({f"gathered/{k}": v for k, v in full.items()})
                # every rank takes the whole gathered state back, strictly (regression: names of the
                # optimizer state that other ranks hold were refused)
                sess.load_state(full, strict=True)
            everyone = sess._dp.comm.allgather_object((state, opt_bytes, norms, sess.test_flags))
            if w.rank == 0:
                for r, (st, nbytes, nm, fl) in enumerate(everyone):
                    for k, v in st.items():
                        saved[f"{case}/{r}/{k}"] = v
                    saved[f"{case}/{r}/optimizer_state_bytes"] = np.int64(nbytes)
                    saved[f"{case}/{r}/norms"] = np.asarray(nm)
                    for name, values in fl.items():
                        saved[f"{case}/{r}/flags/{name}"] = np.asarray(values)
        if w.rank == 0:
            np.savez(out, **saved)
    elif what == "collectives":
        from onnxtrain.parallel import get_communicator
        from onnxtrain.parallel.adasum import adasum_reduce

        comm = get_communicator()
        rng = np.random.default_rng(100 + w.rank)
        saved = {}
        for dt in (np.float32, np.float64):
            mine = [rng.standard_normal(s).astype(dt) for s in ((3, 5), (7,), (0,), (4, 2, 2))]
            mine.append(np.zeros(6, dt))  # a zero vector: its coefficient stays 1
            res = adasum_reduce(comm, mine)
            for r, vs in enumerate(comm.allgather_object(mine)):
                for i, v in enumerate(vs):
                    saved[f"{np.dtype(dt).name}/in/{r}/{i}"] = v
            for r, vs in enumerate(comm.allgather_object(res)):
                for i, v in enumerate(vs):
                    saved[f"{np.dtype(dt).name}/out/{r}/{i}"] = v
        # the helpers offered to other training loops (the on-device Module, the CLI)
        from onnxtrain.parallel import allreduce_gradients, shard_range

        grads = [np.full((3, 4), w.rank + 1.0, np.float32), np.full(5, 10.0 * (w.rank + 1), np.float64)]
        fresh = allreduce_gradients(grads, inplace=False)
        assert grads[0][0, 0] == w.rank + 1.0, "inplace=False changed its input"
        same = allreduce_gradients(grads)
        assert same[0] is grads[0]
        for k, (a, b) in enumerate(zip(fresh, grads)):
            saved[f"helpers/{w.rank}/avg{k}"] = a
            saved[f"helpers/{w.rank}/inplace{k}"] = b
        saved[f"helpers/{w.rank}/world"] = np.array(tuple(w))
        # the ranks share the host's CPUs: OpenBLAS's thread count and the engine's width are each rank's
        from onnxtrain.engine.blas import _thread_count_functions
        from onnxtrain.engine.parallel import default_width

        functions = _thread_count_functions()
        saved[f"helpers/{w.rank}/threads"] = np.array(
            [functions[1]() if functions else -1, default_width(), len(os.sched_getaffinity(0))]
        )
        saved[f"helpers/{w.rank}/shard"] = np.array([shard_range(9).start, shard_range(9).stop])
        everyone = comm.allgather_object({k: v for k, v in saved.items() if k.startswith("helpers/")})
        for d in everyone:
            saved.update(d)
        if w.rank == 0:
            np.savez(out, **saved)
    elif what in ("raise", "kill", "hang", "exit"):
        # ZeRO-1 Adam; after every step rank 0 writes a checkpoint of the gathered state
        from onnxtrain.checkpoint import Checkpoint, save_checkpoint

        sess = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer", 1, 1, {}))
        if what == "hang":
            sess._dp.comm.timeout = 3.0  # after the start-up check, which a loaded machine may slow down
        for step, (x, y) in enumerate(batches(1000, GLOBAL_BATCH)):
            if step == 3 and w.rank == 1:
                if what == "kill":
                    os.kill(os.getpid(), 9)
                if what == "hang":
                    import time

                    time.sleep(1000)
                if what == "exit":  # a script's own error exit, its main wrapped as the README says
                    from onnxtrain.parallel import abort_on_error

                    with abort_on_error():
                        print("rank 1 exits with status 4 on purpose", flush=True)
                        sys.exit(4)
                raise RuntimeError("rank 1 fails on purpose at step 3")
            sess.run(["loss"], {"x": split_batch(x), "y": split_batch(y), "Learning_Rate": LR})
            state = sess.gather_state()
            if w.rank == 0 and out:
                save_checkpoint(Checkpoint(trainable={k: v for k, v in state.items()
                                                      if not k.startswith(("Moment_", "Update_"))},
                                           properties={"step": step + 1}), out)
        print("finished without noticing the failure", flush=True)
    elif what == "mismatch":
        model = mlp_model(dh=16 if w.rank == 0 else 12)
        TrainingSession(model.SerializeToString(), params("AdamOptimizer", 1, 0, {}))
    elif what == "sizes":  # sizes of 1 assigned: each rank alone (world_size), all ranks (data_parallel_size)
        import json
        import warnings

        x, y = batches(1, GLOBAL_BATCH, din=DIN)[0]
        result = {}
        for option in ("world_size", "data_parallel_size"):
            p = params("SGDOptimizer", 1, 0, {option: 1})
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                sess = TrainingSession(mlp_model(din=DIN).SerializeToString(), p)
            x_mine = x if w.rank == 0 else 2 * x  # the ranks' data differ
            sess.run(["loss"], {"x": x_mine, "y": y, "Learning_Rate": LR})
            result[option] = {"W1": sess.get_state()["W1"].tolist(),
                              "warnings": [str(c.message) for c in caught]}
        with open(f"{out}.{w.rank}.json", "w") as f:  # (one file a rank: their stdout lines interleave)
            json.dump(result, f)
    else:
        raise SystemExit(f"unknown command {what!r}")


if __name__ == "__main__":
    main()

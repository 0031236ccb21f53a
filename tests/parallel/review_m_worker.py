"""Run under ``mpiexec -n N``: data parallelism of the legacy session against float64 oracles (review M).

``python review_m_worker.py OUT.pkl``: rank 0 writes every rank's results (a list, one dict a rank):

* ``train``: weights (and, under ZeRO, the gathered Adam state) after 3 steps of the MLP of
  :func:`model` in each case of :data:`CASES`, each rank on its part of every micro-batch;
* ``half``: a bfloat16 / float16 weight ``W`` of ``loss = ReduceSum(x·W)`` (its gradient is ``x``) after one
  SGD step from ``W = 0`` with learning rate −1 (so ``W`` becomes the exchanged mean gradient) under
  allreduce and ZeRO, 3 micro-steps a rank; and ``allreduce_gradients`` of half arrays (sum, average);
* ``skip``: float16 mixed precision with Adasum, ZeRO and allreduce through a schedule
  where rank 1's gradients overflow on step 2 and every rank's on step 3, against a session of the same
  mode that ran steps 1 and 4 only; the flags each step returned (allreduce, and 2 micro-steps a step,
  under ``ONNXTRAIN_FULL_TESTS=1`` only).
"""

from __future__ import annotations

import os
import pickle
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

DIN, DH, DOUT = 10, 16, 4  # W1 has 160 elements: it straddles the ZeRO ranks' blocks on 2 and 3 ranks
ROWS = 12  # rows of a micro-batch (all ranks together)
STEPS = 3
LR = 0.02
MAX_NORM = 0.05  # below the gradients' norm: clipping acts on every step
# name → (mode, optimizer, accumulation steps)
CASES = {
    "allreduce_sgd": ("allreduce", "SGDOptimizer", 1),
    "allreduce_adam_acc2": ("allreduce", "AdamOptimizer", 2),
    "zero_adam_acc2": ("zero", "AdamOptimizer", 2),
    "zero_adam": ("zero", "AdamOptimizer", 1),
    "adasum_sgd": ("adasum", "SGDOptimizer", 1),
    "adasum_adam_acc2": ("adasum", "AdamOptimizer", 2),
}
HALF_N = 200  # elements of the half weight (straddles the ZeRO blocks)
HALF_MICRO = 3


def model() -> onnx.ModelProto:
    """x[N, DIN] → Gemm → Tanh → Gemm; loss = ReduceMean((out − y)²)."""
    rng = np.random.default_rng(3)
    inits = {"W1": rng.standard_normal((DH, DIN)) * 0.4, "b1": rng.standard_normal(DH) * 0.1,
             "W2": rng.standard_normal((DOUT, DH)) * 0.4, "b2": rng.standard_normal(DOUT) * 0.1}
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Tanh", ["h"], ["t"]),
             helper.make_node("Gemm", ["t", "W2", "b2"], ["o"], transB=1),
             helper.make_node("Sub", ["o", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "mlp",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", DIN]),
                           helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", DOUT])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def model_weights() -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model().graph.initializer}


def micro_batches(accumulation: int, scale: float = 1.0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every micro-batch of the 3 steps (all ranks' rows), ``STEPS · accumulation`` of them."""
    rng = np.random.default_rng(11)
    out = []
    for _ in range(STEPS * accumulation):
        x = rng.standard_normal((ROWS, DIN)).astype(np.float32) * np.float32(scale)
        y = rng.standard_normal((ROWS, DOUT)).astype(np.float32)
        out.append((x, y))
    return out


def params(mode: str, opt: str, accumulation: int, **kw):
    from onnxtrain import TrainingParameters

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.gradient_accumulation_steps = accumulation
    p.gradient_accumulation_mode = "auto"
    p.deepspeed_zero_stage = int(mode == "zero")
    p.enable_adasum = mode == "adasum"
    if opt == "AdamOptimizer":
        p.optimizer_attributes_map = {w: {"max_norm_clip": MAX_NORM} for w in ("W1", "b1", "W2", "b2")}
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def part(a: np.ndarray, rank: int, size: int) -> np.ndarray:
    n = len(a) // size
    return a[rank * n:(rank + 1) * n]


def train_cases(rank: int, size: int) -> dict:
    from onnxtrain import TrainingSession

    out = {}
    for name, (mode, opt, acc) in CASES.items():
        if mode == "adasum" and size & (size - 1):
            continue
        s = TrainingSession(model().SerializeToString(), params(mode, opt, acc))
        norms = []
        for i, (x, y) in enumerate(micro_batches(acc)):
            due = opt == "AdamOptimizer" and mode != "adasum" and i % acc == acc - 1  # an update step's norm
            got = s.run(["loss", "global_gradient_norm"] if due else ["loss"],
                        {"x": part(x, rank, size), "y": part(y, rank, size),
                         "Learning_Rate": np.array([LR], np.float32)})
            if due:
                norms.append(float(np.asarray(got[1]).reshape(-1)[0]))
        state = s.gather_state() if mode == "zero" else s.get_state()
        out[name] = {k: np.asarray(v) for k, v in state.items()}
        out[name + " norms"] = norms
        out[name + " own state"] = {k: int(np.asarray(v).size) for k, v in s.get_state().items()}
    return out


def half_model(dtype: int) -> bytes:
    g = helper.make_graph([helper.make_node("Mul", ["x", "W"], ["p"]),
                           helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)], "half",
                          [helper.make_tensor_value_info("x", dtype, [1, HALF_N])],
                          [helper.make_tensor_value_info("loss", dtype, [])],
                          [helper.make_tensor("W", dtype, [HALF_N], [0.0] * HALF_N)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


HALF_TYPES = {"bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
              "float16": (TensorProto.FLOAT16, np.float16)}


# float16 columns (bits; rank r's micro-step k is row 3r + k) whose mean over 2 ranks x 3 micro-steps one
# process rounds otherwise than the float64 mean: its float32 sum times float32(1/6) (the accumulation graph's
# Mul) lands on a float16 midpoint the exact mean is just below (1.1030273 -> 1.104, not 1.103)
HALF_MIDPOINT_COLUMNS = np.array([[11473, 50127, 18650, 13705, 13915, 4991],
                                  [16221, 46310, 19049, 10830, 5615, 42331]], np.uint16)


def half_rows(size: int, dtype: type) -> np.ndarray:
    """Every rank's micro-step rows, [size, HALF_MICRO, HALF_N]: values of several magnitudes (on 2 ranks in
    float16, the first columns are :data:`HALF_MIDPOINT_COLUMNS`)."""
    rng = np.random.default_rng(21)
    x = rng.standard_normal((size, HALF_MICRO, HALF_N)) * np.exp2(rng.integers(-4, 4, (size, HALF_MICRO, 1)))
    x = x.astype(dtype)
    if size == 2 and np.dtype(dtype) == np.float16:
        cols = HALF_MIDPOINT_COLUMNS.view(np.float16)
        x[:, :, :len(cols)] = cols.T.reshape(size, HALF_MICRO, len(cols))
    return x


def half_cases(rank: int, size: int) -> dict:
    from onnxtrain import TrainingSession
    from onnxtrain.parallel import allreduce_gradients

    out = {}
    for tname, (ttype, dtype) in HALF_TYPES.items():
        rows = half_rows(size, dtype)
        for mode in ("allreduce", "zero"):
            s = TrainingSession(half_model(ttype), params(mode, "SGDOptimizer", HALF_MICRO))
            for k in range(HALF_MICRO):
                s.run(["loss"], {"x": rows[rank, k][None], "Learning_Rate": np.array([-1.0], np.float32)})
            out[f"{tname}_{mode}"] = np.asarray(s.get_state()["W"])
        for average in (False, True):
            out[f"{tname}_allreduce_gradients_{average}"] = allreduce_gradients(
                [rows[rank].astype(np.float32).sum(0).astype(dtype)], average=average, inplace=False
            )[0]
    return out


def skip_cases(rank: int, size: int) -> dict:
    """Mixed precision (Adasum on a power-of-two number of ranks): step 2 overflows on rank 1, step 3 on every
    rank (with 2 micro-steps a step: rank 1's second micro-step of step 2, every rank's first of step 3)."""
    from onnxtrain import TrainingSession

    out = {}
    full = os.environ.get("ONNXTRAIN_FULL_TESTS") == "1"
    for mode in ("adasum", "zero", "allreduce") if full else ("adasum", "zero"):
        if mode == "adasum" and size & (size - 1):
            continue
        for acc in (1, 2) if full else (1,):
            batches = micro_batches(acc)  # 3 steps' batches; the 4th step reuses the first
            steps = [batches[k * acc:(k + 1) * acc] for k in range(STEPS)] + [batches[:acc]]
            over = [[set()] * acc, [set()] * (acc - 1) + [{1}], [set(range(size))] + [set()] * (acc - 1),
                    [set()] * acc]
            got = {}
            for label, chosen in (("skipped", [0, 1, 2, 3]), ("control", [0, 3])):
                s = TrainingSession(model().SerializeToString(),
                                    params(mode, "AdamOptimizer", acc, use_mixed_precision=True))
                fetch = ["loss", "all_gradients_finite"]
                if mode == "adasum":
                    fetch.append("adasum_all_deltas_finite")
                flags = []
                for k in chosen:
                    for (x, y), overflow in zip(steps[k], over[k]):
                        xr = part(x, rank, size) * np.float32(1e5 if rank in overflow else 1.0)
                        feeds = {"x": xr, "y": part(y, rank, size),
                                 "Learning_Rate": np.array([LR], np.float32),
                                 s.loss_scale_input_name: np.array([1024.0], np.float32)}
                        res = s.run(fetch if (x is steps[k][-1][0]) else ["loss"], feeds)
                    flags.append([bool(np.asarray(v).all()) for v in res[1:]])
                state = s.gather_state() if mode == "zero" else s.get_state()
                got[label] = ({k: np.asarray(v) for k, v in state.items()}, flags)
            out[f"{mode}{acc}"] = got
    return out


def main() -> None:
    from onnxtrain.parallel import get_communicator

    comm = get_communicator()
    rank, size = comm.rank, comm.size
    result = {"train": train_cases(rank, size), "half": half_cases(rank, size),
              "skip": skip_cases(rank, size)}
    everyone = comm.allgather_object(result, "gathering the results")
    if rank == 0:
        with open(sys.argv[1], "wb") as f:
            pickle.dump(everyone, f)


if __name__ == "__main__":
    main()

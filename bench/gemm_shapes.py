"""The MLP's training-step GEMMs, one at a time: onnxtrain's numpy engine against onnxruntime (MLAS).

    python -m bench.gemm_shapes [--batches 64,256] [--repeats 9] [--min-time 0.2] [--quick]

Each case is a one-node ``Gemm`` model of a product that a training step of the bench's MLP 784-512-512-10
makes: per layer the forward ``X·Wᵀ + b``, the input gradient ``dY·W`` (not for the first layer, whose
input needs none) and the weight gradient ``dYᵀ·X``. Both engines run the same model through their plain
``run`` (so the per-call overhead of each is in its figure), interleaved in rounds with a pause before each
turn (both keep idle threads spinning a while after a call); figures are medians over the rounds. The
outputs are checked against each other first. The step's sum tells how much of a step's time the BLAS
library alone accounts for: numpy's GEMMs are OpenBLAS's, onnxruntime's (and so onnxruntime-training's)
are MLAS's.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import compare  # noqa: E402

LAYERS = ((784, 512), (512, 512), (512, 10))  # the bench MLP's (inputs, outputs) per layer
PAUSE_S = 0.15  # before each turn: the other engine's idle threads stop spinning


@dataclass(frozen=True)
class Case:
    """One product of a training step: ``Gemm(a, b[, c])`` with its transpose flags."""

    name: str
    a: tuple[int, int]
    b: tuple[int, int]
    trans_a: int
    trans_b: int
    bias: int  # length of the bias (0: none)

    @property
    def out(self) -> tuple[int, int]:
        m = self.a[1] if self.trans_a else self.a[0]
        n = self.b[0] if self.trans_b else self.b[1]
        return m, n

    @property
    def flops(self) -> int:
        k = self.a[0] if self.trans_a else self.a[1]
        return 2 * self.out[0] * self.out[1] * k


def step_cases(batch: int) -> list[Case]:
    """The GEMMs of one MLP training step at ``batch`` (weights stored as torch exports them: out × in)."""
    cases = []
    for i, (n_in, n_out) in enumerate(LAYERS, start=1):
        cases.append(Case(f"fc{i} forward X·Wᵀ+b", (batch, n_in), (n_out, n_in), 0, 1, n_out))
        if i > 1:
            cases.append(Case(f"fc{i} input grad dY·W", (batch, n_out), (n_out, n_in), 0, 0, 0))
        cases.append(Case(f"fc{i} weight grad dYᵀ·X", (batch, n_out), (batch, n_in), 1, 0, 0))
    return cases


def gemm_model(case: Case) -> onnx.ModelProto:
    """A one-node float32 Gemm model of ``case`` with inputs a, b (and c)."""
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(case.a)),
              helper.make_tensor_value_info("b", TensorProto.FLOAT, list(case.b))]
    names = ["a", "b"]
    if case.bias:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [case.bias]))
        names.append("c")
    node = helper.make_node("Gemm", names, ["y"], transA=case.trans_a, transB=case.trans_b)
    graph = helper.make_graph([node], "gemm", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(case.out))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds_for(case: Case, rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {"a": rng.standard_normal(case.a, np.float32), "b": rng.standard_normal(case.b, np.float32)}
    if case.bias:
        feeds["c"] = rng.standard_normal(case.bias, np.float32)
    return feeds


def runners(case: Case, feeds: dict[str, np.ndarray]) -> dict[str, Callable[[], object]]:
    """The two engines' calls on ``case``, their outputs checked against each other."""
    import onnxruntime as ort

    from onnxtrain.engine import compile_model

    model = gemm_model(case)
    plan = compile_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ours, theirs = plan.run(feeds)[0], sess.run(None, feeds)[0]
    k = case.a[0] if case.trans_a else case.a[1]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.sqrt(k))
    return {"numpy": lambda: plan.run(feeds), "onnxruntime": lambda: sess.run(None, feeds)}


def measure(batches: Sequence[int], repeats: int, min_time: float,
            pause: float = PAUSE_S) -> list[tuple[int, Case, float, float]]:
    """(batch, case, numpy seconds, onnxruntime seconds) per case."""
    rng = np.random.default_rng(0)
    rows = []
    for batch in batches:
        for case in step_cases(batch):
            t = compare(runners(case, feeds_for(case, rng)), repeats=repeats, min_time=min_time,
                        pause=pause)
            rows.append((batch, case, t["numpy"].median, t["onnxruntime"].median))
    return rows


def table(rows: list[tuple[int, Case, float, float]]) -> str:
    """Markdown: one row per product and a sum per batch; ratio = numpy time / onnxruntime time."""
    out = ["| batch | product | shape (m×k·k×n) | numpy µs | onnxruntime µs | numpy / onnxruntime | "
           "numpy GFLOP/s | onnxruntime GFLOP/s |", "|---|---|---|---|---|---|---|---|"]
    for batch in sorted({r[0] for r in rows}):
        mine = [r for r in rows if r[0] == batch]
        for _, case, t_np, t_ort in mine:
            m, n = case.out
            k = case.a[0] if case.trans_a else case.a[1]
            rates = f"{case.flops / t_np / 1e9:.0f} | {case.flops / t_ort / 1e9:.0f}"
            out.append(f"| {batch} | {case.name} | {m}×{k}·{k}×{n} | {t_np * 1e6:.0f} | {t_ort * 1e6:.0f} | "
                       f"{t_np / t_ort:.2f} | {rates} |")
        s_np, s_ort = sum(r[2] for r in mine), sum(r[3] for r in mine)
        flops = sum(r[1].flops for r in mine)
        out.append(f"| {batch} | **the step's GEMMs** | | **{s_np * 1e6:.0f}** | **{s_ort * 1e6:.0f}** | "
                   f"**{s_np / s_ort:.2f}** | {flops / s_np / 1e9:.0f} | {flops / s_ort / 1e9:.0f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,256", help="comma-separated batch sizes")
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (≥ 5)")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per sample")
    p.add_argument("--quick", action="store_true", help="a smoke run: batch 64, short samples")
    a = p.parse_args(argv)
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        print("onnxruntime is not installed: nothing to compare against (pip install onnxruntime)")
        return 0
    try:
        batches = [int(b) for b in a.batches.split(",") if b.strip()]
    except ValueError:
        p.error(f"--batches must be comma-separated integers, got {a.batches!r}")
    if not batches or min(batches) < 1:
        p.error(f"--batches must be positive integers, got {a.batches!r}")
    pause = PAUSE_S
    if a.quick:  # figures are not results
        batches, a.repeats, a.min_time, pause = batches[:1], 5, 0.005, 0.0
    print(table(measure(batches, a.repeats, a.min_time, pause)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

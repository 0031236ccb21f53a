"""Size and memory of the gradient graph of a torch-exported transformer, next to torch's own step.

    python bench/gradient_graph.py [--batch 32] [--seq 64] [--d 128] [--layers 2] [--dropout 0.1]

The model: token + position embeddings, ``--layers`` nn.TransformerEncoderLayer (4 heads, feed-forward 4·d,
GELU, batch-first), mean pool, a 5-class linear head and cross entropy, exported with the loss in the graph
(TorchScript exporter, opset 17, TrainingMode.TRAINING, no constant folding). We differentiate the loss
w.r.t. every parameter and report:

- nodes: forward nodes (as exported) and the nodes the backward adds (including its Constants and the
  Shape nodes it places in the forward pass), and their ratio;
- onnxtrain: ``Plan.peak_bytes`` of the forward graph and of the gradient graph (one training step: forward,
  backward, parameter gradients), both including parameters and feeds; "saved" is the live bytes right after
  the last forward node of the gradient graph, minus parameters and feeds: the forward values the backward
  keeps. ``Plan.peak_bytes`` sums the arrays in live slots, so a view (e.g. a Reshape) counts again; the
  "distinct" row counts every underlying buffer once, like an allocator would;
- torch: bytes of the tensors saved for backward (``saved_tensors_hooks``, each storage once, minus
  storages that are parameters or inputs), and the allocation peaks of a no-grad forward and of a forward +
  backward, measured with the profiler's CPU memory events; "params + saved" is parameters, buffers and
  inputs plus the saved bytes. Ratios are to the forward peak of the same system.

Wall times are one run each after a warm-up (indicative only).
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch  # noqa: E402 - benchmark only; the package never imports torch

from onnxtrain.autodiff import build_gradient_model  # noqa: E402
from onnxtrain.engine import compile_model  # noqa: E402
from onnxtrain.engine.plan import Plan, Step  # noqa: E402
from tests.models import TransformerEncoder, WithLoss  # noqa: E402

MiB = 1 << 20


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, np.ndarray]]:
    """The seeded module (model + cross entropy) and one batch of tokens and labels."""
    torch.manual_seed(1234)
    model = TransformerEncoder(vocab=args.vocab, seq=args.seq, d=args.d, heads=4, ff=4 * args.d,
                               layers=args.layers, dropout=args.dropout, classes=5)
    module = WithLoss(model, torch.nn.CrossEntropyLoss())
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, args.vocab, (args.batch, args.seq)).astype(np.int64),
             "labels": rng.integers(0, 5, args.batch).astype(np.int64)}
    return module, feeds


def export(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """TorchScript export in training mode with the loss as the single output ``loss``."""
    module.train(True)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, tuple(torch.from_numpy(v) for v in feeds.values()), buf, dynamo=False,
                          opset_version=17, input_names=list(feeds), output_names=["loss"],
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False,
                          dynamic_axes={n: {0: "batch"} for n in feeds})
    return onnx.load_from_string(buf.getvalue())


# ---- onnxtrain ------------------------------------------------------------------------------------------
def _root(a: Any) -> Any:
    while isinstance(a, np.ndarray) and a.base is not None:
        a = a.base
    return a


def _buf_bytes(a: Any) -> int:
    return a.nbytes if isinstance(a, np.ndarray) else int(getattr(a, "nbytes", 0))


def replay(plan: Plan, feeds: dict[str, np.ndarray], forward_names: set[str]) -> dict[str, int]:
    """Run ``plan`` once, keeping every step's outputs, then replay slot lifetimes.

    Returns the live bytes (as ``Plan.peak_bytes`` counts them) right after the last forward step, and the
    peak of distinct buffers (each array's root buffer counted once while any live slot uses it).
    """
    produced: dict[int, Any] = {}

    def recording(st: Step) -> Callable:
        def fn(inputs: Any, attrs: Any) -> Any:
            res = st.fn(inputs, attrs)
            for s, r in zip(st.outputs, res):
                if s >= 0:
                    produced[s] = r
            return res
        return fn

    original = plan.steps
    plan.steps = [Step(recording(st), st.inputs, st.outputs, st.attrs, st.free, st.node) for st in original]
    try:
        plan.run(feeds)
    finally:
        plan.steps = original
    last_fwd = max(k for k, st in enumerate(original) if st.node.name in forward_names)
    initial = {plan.slot[n]: v for n, v in plan.initializers.items()}
    initial.update({s: v for s, v in plan._const_values})
    initial.update({plan.slot[n]: v for n, v in feeds.items()})
    base = sum(_buf_bytes(v) for v in initial.values())
    live_slots = dict(initial)
    users: dict[int, int] = {}
    roots: dict[int, Any] = {}

    def add(v: Any) -> int:
        r = _root(v)
        users[id(r)] = users.get(id(r), 0) + 1
        roots[id(r)] = r
        return _buf_bytes(r) if users[id(r)] == 1 else 0

    def drop(v: Any) -> int:
        r = _root(v)
        users[id(r)] -= 1
        return _buf_bytes(r) if users[id(r)] == 0 else 0

    distinct = sum(add(v) for v in initial.values())
    naive = base
    peak_distinct = distinct
    saved = 0
    for k, st in enumerate(original):
        for s in st.outputs:
            if s >= 0 and s in produced:
                live_slots[s] = produced[s]
                distinct += add(produced[s])
                naive += _buf_bytes(produced[s])
        peak_distinct = max(peak_distinct, distinct)
        for s in st.free:
            v = live_slots.pop(s, None)
            if v is not None:
                distinct -= drop(v)
                naive -= _buf_bytes(v)
        if k == last_fwd:
            saved = naive - base
    return {"saved": saved, "peak_distinct": peak_distinct, "base": base}


def onnxtrain_figures(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    model = export(module, feeds)
    params = [n for n, _ in module.named_parameters()]
    inits = {t.name for t in model.graph.initializer}
    missing = [p for p in params if p not in inits]
    if missing:
        raise SystemExit(f"parameters missing from the exported graph: {missing}")
    t0 = time.perf_counter()
    gmodel = build_gradient_model(model, "loss", params)
    build_s = time.perf_counter() - t0
    forward_names = {n.name for n in model.graph.node}
    n_fwd = len(model.graph.node)
    n_all = len(gmodel.graph.node)
    n_fwd_kept = sum(n.name in forward_names for n in gmodel.graph.node)
    n_bwd = n_all - n_fwd_kept
    n_bwd_const = sum(n.op_type == "Constant" and n.name not in forward_names for n in gmodel.graph.node)

    fplan, gplan = compile_model(model), compile_model(gmodel)
    for plan in (fplan, gplan):  # warm-up
        plan.run(feeds)
    t0 = time.perf_counter()
    fplan.run(feeds)
    f_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gplan.run(feeds)
    g_s = time.perf_counter() - t0
    fwd_rep = replay(compile_model(model), feeds, forward_names)
    step_rep = replay(compile_model(gmodel), feeds, forward_names)
    return {"n_fwd": n_fwd, "n_bwd": n_bwd, "n_bwd_const": n_bwd_const, "build_s": build_s,
            "fwd_peak": fplan.peak_bytes, "step_peak": gplan.peak_bytes,
            "fwd_distinct": fwd_rep["peak_distinct"], "step_distinct": step_rep["peak_distinct"],
            "saved": step_rep["saved"], "base": step_rep["base"], "fwd_s": f_s, "step_s": g_s}


# ---- torch ----------------------------------------------------------------------------------------------
def _alloc_peak(fn: Callable[[], Any]) -> int:
    """Peak of bytes allocated (net of frees) while ``fn`` runs, from the profiler's CPU memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def torch_figures(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    module.train(True)
    args = [torch.from_numpy(v) for v in feeds.values()]
    tensors = [*module.parameters(), *module.buffers(), *args]
    base_ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    unique = {t.untyped_storage().data_ptr(): t for t in tensors}
    base = sum(t.untyped_storage().nbytes() for t in unique.values())

    saved: dict[int, int] = {}
    saved_base: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        (saved_base if st.data_ptr() in base_ptrs else saved)[st.data_ptr()] = st.nbytes()
        return t

    def step() -> None:
        module.zero_grad(set_to_none=True)
        module(*args).backward()

    def forward() -> None:
        with torch.no_grad():
            module(*args)

    step()
    forward()  # warm-up
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = module(*args)
    loss.backward()
    del loss
    t0 = time.perf_counter()
    forward()
    f_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()
    g_s = time.perf_counter() - t0
    module.zero_grad(set_to_none=True)
    return {"base": base, "saved": sum(saved.values()), "saved_params": sum(saved_base.values()),
            "fwd_peak": base + _alloc_peak(forward), "step_peak": base + _alloc_peak(step),
            "fwd_s": f_s, "step_s": g_s}


# ---- report ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dropout", type=float, default=0.1)
    args = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    module, feeds = build(args)
    ours = onnxtrain_figures(module, feeds)
    theirs = torch_figures(module, feeds)
    n_params = sum(p.numel() for p in module.parameters())

    print(f"transformer encoder: batch {args.batch}, seq {args.seq}, d {args.d}, heads 4, ff {4 * args.d}, "
          f"{args.layers} layers, dropout {args.dropout}, vocab {args.vocab}; {n_params:,} parameters")
    print(f"nodes: forward {ours['n_fwd']}, backward {ours['n_bwd']} ({ours['n_bwd_const']} Constant) "
          f"-> backward/forward = {ours['n_bwd'] / ours['n_fwd']:.2f} "
          f"({(ours['n_bwd'] - ours['n_bwd_const']) / ours['n_fwd']:.2f} without Constants); "
          f"built in {ours['build_s'] * 1e3:.0f} ms")
    print()
    rows = [
        ("params + buffers + feeds", ours["base"], None, theirs["base"], None),
        ("saved for backward", ours["saved"], None, theirs["saved"], None),
        ("forward peak", ours["fwd_peak"], 1.0, theirs["fwd_peak"], 1.0),
        ("params + saved", ours["base"] + ours["saved"], (ours["base"] + ours["saved"]) / ours["fwd_peak"],
         theirs["base"] + theirs["saved"], (theirs["base"] + theirs["saved"]) / theirs["fwd_peak"]),
        ("training step peak", ours["step_peak"], ours["step_peak"] / ours["fwd_peak"],
         theirs["step_peak"], theirs["step_peak"] / theirs["fwd_peak"]),
        ("forward peak, distinct buffers", ours["fwd_distinct"], 1.0, None, None),
        ("step peak, distinct buffers", ours["step_distinct"], ours["step_distinct"] / ours["fwd_distinct"],
         None, None),
    ]
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'onnxtrain MiB':>13} {'/fwd':>6}   {'torch MiB':>9} {'/fwd':>6}")
    for label, a, ra, b, rb in rows:
        def cell(v: float | None, r: float | None, width: int) -> str:
            return (f"{v / MiB:{width}.2f}" if v is not None else " " * (width - 1) + "-") + (
                f" {r:6.2f}" if r is not None else " " * 7)
        print(f"{label:{w}}  {cell(a, ra, 13)}   {cell(b, rb, 9)}")
    print(f"(torch also saves {theirs['saved_params'] / MiB:.2f} MiB of parameter/input storages, "
          f"counted in the first row)")
    print(f"one run: onnxtrain forward {ours['fwd_s'] * 1e3:.0f} ms, step {ours['step_s'] * 1e3:.0f} ms; "
          f"torch forward {theirs['fwd_s'] * 1e3:.0f} ms, step {theirs['step_s'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()

"""Engine overhead against onnxruntime, in the same run.

    python bench/engine_overhead.py [--repeats 7] [--quick]
    python -m bench.engine_overhead

(a) dispatch: a 2,000-node chain of alternating Add/Mul on a [4] tensor, where the arithmetic is
    nothing and the time is the engine's per-node cost; quoted as µs per node and as a ratio.
(b) a transformer encoder exported from torch (2 layers, d=128, 4 heads, ff 512, seq 64, batch 32):
    forward wall time, ours / onnxruntime's; also ours with the batch split off (two halves of the batch
    at once, onnxtrain/engine/batch_split.py), in the same interleaved rounds. ``--breakdown`` adds where
    the time goes: both engines' profiles, kernel time per group of ops (bench/op_breakdown.py).
(c) control flow: nn.EmbeddingBag exported from torch as a Loop with one iteration per bag (256 bags);
    µs per bag, ours / onnxruntime's: with the bags pooled at once (onnxtrain/engine/bag_loops.py), and
    with the loop run as written, a Loop's cost per iteration (no target: figures to track).

Both peers run with their defaults (onnxruntime: ORT_ENABLE_ALL graph optimizations, its own thread pool;
numpy: its BLAS threads), except that in this process onnxruntime's threads stop spinning as soon as each
of its runs ends (``session.force_spinning_stop``): threads spinning on would keep the cores busy while the
other peer's turn runs (on a 2-core machine that slowed numpy's BLAS tenfold). Before 2026-11-23 they did
not spin at all, which also slowed onnxruntime's own runs (transformer forward 6.5-6.8 against 5.8-6.1
ms). (b) is also measured against onnxruntime at its default threading (spinning on after its runs) in a
process of its own, the turns of the two processes interleaved with a pause between them (as in bench/run.py).
Figures are medians of interleaved repeats after warm-up (bench/common.py).
Targets: ≤ 5 µs per node; transformer ≤ 1.5× onnxruntime.

numpy's BLAS matters for (b): the line "BLAS:" says which OpenBLAS kernels and how many threads numpy
uses. Some machines pin OpenBLAS to its Haswell (AVX2) kernels with ``OPENBLAS_CORETYPE`` (and
``OPENBLAS_L2_SIZE``), for older OpenBLAS builds; on a CPU with AVX-512 that halves numpy's matmul speed.
``--native-blas`` runs the benchmark with both unset, so that OpenBLAS picks its kernels (the "BLAS:" line
shows which). ``--blas-threads N`` limits numpy's BLAS threads (needs threadpoolctl).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from bench.common import calls_per_sample, compare, fmt_time, ratio_line

NODE_TARGET_US = 5.0
TRANSFORMER_TARGET = 1.5


def chain_model(n_nodes: int = 2000, size: int = 4) -> onnx.ModelProto:
    """y = ((x + a) * m + a) * m ... with ``n_nodes`` nodes; the values stay near x."""
    nodes = []
    for i in range(n_nodes):
        src = "x" if i == 0 else f"t{i - 1}"
        dst = "y" if i == n_nodes - 1 else f"t{i}"
        op, const = ("Add", "a") if i % 2 == 0 else ("Mul", "m")
        nodes.append(helper.make_node(op, [src, const], [dst], name=f"n{i}"))
    graph = helper.make_graph(
        nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])],
        [numpy_helper.from_array(np.full(size, 1e-3, np.float32), "a"),
         numpy_helper.from_array(np.full(size, 0.999, np.float32), "m")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def ort_session(model: onnx.ModelProto):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.add_session_config_entry("session.force_spinning_stop", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def blas_info() -> str:
    """numpy's BLAS library, kernel architecture and thread count (from threadpoolctl when installed)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (install threadpoolctl to see it)"
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not infos:
        return "none found"
    i = infos[0]
    text = (f"{i.get('internal_api')} {i.get('version')}, {i.get('architecture')} kernels, "
            f"{i.get('num_threads')} threads")
    if i.get("architecture") == "Haswell" and _cpu_has("avx512f"):
        text += " (this CPU has AVX-512: try --native-blas)"
    return text


def _cpu_has(flag: str) -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and f" {flag}" in line for line in f)
    except OSError:
        return False


def bench_dispatch(repeats: int, n_nodes: int = 2000) -> dict[str, float]:
    import onnxtrain
    from onnxtrain.engine.plan import compile_model

    model = chain_model(n_nodes)
    x = np.linspace(-1, 1, 4, dtype=np.float32)
    # per-node dispatch is the figure: without fusion, which would run the whole chain as one step
    saved = os.environ.get("ONNXTRAIN_FUSION")
    os.environ["ONNXTRAIN_FUSION"] = "0"
    try:
        plan = compile_model(model)
        sess = onnxtrain.InferenceSession(model)
    finally:
        if saved is None:
            del os.environ["ONNXTRAIN_FUSION"]
        else:
            os.environ["ONNXTRAIN_FUSION"] = saved
    ref = ort_session(model)
    feeds = {"x": x}
    np.testing.assert_allclose(sess.run(None, feeds)[0], ref.run(None, feeds)[0], rtol=1e-4, atol=1e-6)
    t = compare({"plan": lambda: plan.run(feeds), "session": lambda: sess.run(None, feeds),
                 "onnxruntime": lambda: ref.run(None, feeds)}, repeats=repeats)
    per = {k: v.median / n_nodes * 1e6 for k, v in t.items()}
    print(f"(a) dispatch, {n_nodes}-node Add/Mul chain on float32[4]")
    labels = {"plan": "Plan.run", "session": "InferenceSession.run", "onnxruntime": "onnxruntime"}
    for key, label in labels.items():
        print(f"    {label:20s} {fmt_time(t[key].median)} per run = {per[key]:.2f} µs/node")
    verdict = "met" if per["session"] <= NODE_TARGET_US else "MISSED"
    print("    " + ratio_line("µs/node", per["session"], per["onnxruntime"]) +
          f" (target ≤ {NODE_TARGET_US:g} µs/node: {verdict})")
    return per


def embedding_bag_model(bags: int, per_bag: int = 8, rows: int = 1000, dim: int = 32):
    """torch's nn.EmbeddingBag (mean) exported with TorchScript: a Loop with one iteration per bag."""
    import io
    import warnings

    import torch

    torch.manual_seed(0)
    bag = torch.nn.EmbeddingBag(rows, dim, mode="mean")
    ids = torch.randint(0, rows, (bags * per_bag,))
    offsets = torch.arange(0, bags * per_bag, per_bag)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(bag, (ids, offsets), buf, dynamo=False, opset_version=17,
                          input_names=["ids", "offsets"], output_names=["y"],
                          dynamic_axes={"ids": {0: "n"}, "offsets": {0: "b"}})
    return onnx.load_from_string(buf.getvalue()), {"ids": ids.numpy(), "offsets": offsets.numpy()}


def bench_control_flow(repeats: int, bags: int = 256) -> float:
    """(c) nn.EmbeddingBag's exported loop, one iteration per bag: µs per bag with its bags pooled at once
    (onnxtrain/engine/bag_loops.py), and run as written (fusions off: a Loop's cost per iteration)."""
    import onnxtrain
    from onnxtrain.engine.plan import Plan

    model, feeds = embedding_bag_model(bags)
    sess = onnxtrain.InferenceSession(model)
    loop = Plan(model, fuse=False)
    ref = ort_session(model)
    want = ref.run(None, feeds)[0]
    np.testing.assert_allclose(sess.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(loop.run(feeds)[0], want, rtol=1e-5, atol=1e-6)
    t = compare({"onnxtrain": lambda: sess.run(None, feeds), "loop as written": lambda: loop.run(feeds),
                 "onnxruntime": lambda: ref.run(None, feeds)}, repeats=repeats)
    ours, written, theirs = (t[k].median / bags * 1e6
                             for k in ("onnxtrain", "loop as written", "onnxruntime"))
    print(f"(c) control flow: nn.EmbeddingBag exported as a Loop over {bags} bags (7 nodes per iteration)")
    print("    " + ratio_line("µs per bag, bags pooled at once", ours, theirs))
    print("    " + ratio_line("µs per iteration, the loop run as written", written, theirs))
    return written / theirs


def transformer_model(batch: int, seq: int, d: int, layers: int):
    """The zoo's TransformerEncoder at bench size, exported in eval mode; returns (model, feeds)."""
    import torch

    from tests import models

    torch.manual_seed(models.SEED)
    module = models.TransformerEncoder(vocab=1000, seq=seq, d=d, heads=4, ff=4 * d, layers=layers,
                                       dropout=0.0, classes=10)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, (batch, seq)).astype(np.int64)
    model = models.export_module(module, {"tokens": tokens[:2]}, "logits", training=False)
    return model, {"tokens": tokens}


def bench_transformer(repeats: int, batch: int = 32, seq: int = 64, d: int = 128, layers: int = 2,
                      breakdown: bool = False) -> float:
    import onnxtrain

    model, feeds = transformer_model(batch, seq, d, layers)
    sess = onnxtrain.InferenceSession(model)
    off = onnxtrain.SessionOptions()  # the same engine, the batch split off (onnxtrain/engine/batch_split.py)
    off.add_session_config_entry("onnxtrain.batch_split", "0")
    whole = onnxtrain.InferenceSession(model, off)
    forked = onnxtrain.SessionOptions()  # the second half in a child process (engine/half_process.py)
    forked.add_session_config_entry("onnxtrain.batch_split", "process")
    proc = onnxtrain.InferenceSession(model, forked)
    ref = ort_session(model)
    want = ref.run(None, feeds)[0]
    for s in (sess, proc):
        np.testing.assert_allclose(s.run(None, feeds)[0], want, rtol=1e-4, atol=1e-5)
    t = compare({"onnxtrain": lambda: sess.run(None, feeds), "onnxruntime": lambda: ref.run(None, feeds),
                 "whole": lambda: whole.run(None, feeds), "process": lambda: proc.run(None, feeds)},
                repeats=repeats, min_time=0.2)
    n_nodes = len(model.graph.node)
    print(f"(b) transformer encoder forward: {layers} layers, d={d}, 4 heads, ff {4 * d}, seq {seq}, "
          f"batch {batch} ({n_nodes} nodes)")
    r = t["onnxtrain"].median / t["onnxruntime"].median
    print("    " + ratio_line("ms per forward", t["onnxtrain"].median * 1e3, t["onnxruntime"].median * 1e3,
                              target=TRANSFORMER_TARGET))
    split = "on" if sess._splitter is not None and sess._splitter.split_runs else "not used"
    print(f"    onnxtrain with the batch split off: {t['whole'].median * 1e3:.3g} ms per forward "
          f"(the split was {split} above)")
    used = ("the second half in a child process" if proc._splitter is not None and proc._splitter.split_runs
            else "not split")
    print(f"    onnxtrain.batch_split = process ({used}):")
    print("    " + ratio_line("ms per forward", t["process"].median * 1e3, t["onnxruntime"].median * 1e3,
                              target=TRANSFORMER_TARGET))
    ours, theirs = against_default_onnxruntime(
        model, feeds, {"threads": lambda: sess.run(None, feeds), "process": lambda: proc.run(None, feeds)},
        repeats)
    print("    against onnxruntime at its default threading (idle threads spin), in its own process:")
    for key in ("threads", "process"):
        print(f"    {key:8s}" + ratio_line("ms per forward", ours[key] * 1e3, theirs * 1e3,
                                           target=TRANSFORMER_TARGET))
    if breakdown:
        from bench.op_breakdown import breakdown as by_group
        from bench.op_breakdown import table

        print("    where the time goes (profiled, same process, onnxruntime at its default threading):")
        print("\n".join(table(by_group(model, feeds))))
    return r


# onnxruntime at its default threading, in a process of its own: "N" on stdin runs N forwards, and the
# seconds they took come back on stdout
_ORT_CHILD = """
import sys, time
import numpy as np, onnxruntime as ort
so = ort.SessionOptions()
so.log_severity_level = 3
sess = ort.InferenceSession(sys.argv[1], so, providers=["CPUExecutionProvider"])
feeds = dict(np.load(sys.argv[2]))
for line in sys.stdin:
    n = int(line)
    t0 = time.perf_counter()
    for _ in range(n):
        sess.run(None, feeds)
    print(time.perf_counter() - t0, flush=True)
"""
SETTLE_S = 0.15  # between two turns: numpy's OpenBLAS threads busy-wait about 0.1 s after their last call


def against_default_onnxruntime(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                                ours: dict[str, Any], repeats: int,
                                min_time: float = 1.0) -> tuple[dict[str, float], float]:
    """Median seconds per call of each of ``ours`` (name → callable) and of onnxruntime with its default
    threading in a child process, over ``repeats`` interleaved rounds. Turns last ``min_time``: a forward
    right after the pause between turns is slower (measured here: 13.3 ms in back-to-back turns of 14
    forwards, 14.7-15.8 ms with 0.15 s of idle before each), so short turns would add that to both
    peers' figures."""
    import statistics
    import tempfile

    from bench.common import calibrate

    with tempfile.TemporaryDirectory(prefix="onnxtrain-eo-") as tmp:
        path, data = os.path.join(tmp, "model.onnx"), os.path.join(tmp, "feeds.npz")
        onnx.save(model, path)
        np.savez(data, **feeds)
        child = subprocess.Popen([sys.executable, "-c", _ORT_CHILD, path, data], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdin is not None and child.stdout is not None

        def theirs(n: int) -> float:
            child.stdin.write(f"{n}\n")
            child.stdin.flush()
            line = child.stdout.readline()
            if not line:
                raise RuntimeError("the onnxruntime child process ended early")
            return float(line)

        try:
            theirs(3)
            for fn in ours.values():
                for _ in range(3):
                    fn()
            n_ours = {k: calibrate(fn, min_time) for k, fn in ours.items()}
            n_theirs = calls_per_sample(theirs, min_time)
            a: dict[str, list[float]] = {k: [] for k in ours}
            b = []
            for _ in range(repeats):
                for k, fn in ours.items():
                    time.sleep(SETTLE_S)
                    t0 = time.perf_counter()
                    for _ in range(n_ours[k]):
                        fn()
                    a[k].append((time.perf_counter() - t0) / n_ours[k])
                time.sleep(SETTLE_S)
                b.append(theirs(n_theirs) / n_theirs)
        finally:
            child.stdin.close()
            child.wait(timeout=30)
    return {k: statistics.median(v) for k, v in a.items()}, statistics.median(b)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_overhead", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7, help="timed rounds per peer (≥ 5)")
    p.add_argument("--quick", action="store_true", help="a smaller transformer (a smoke test, not a figure)")
    p.add_argument("--blas-threads", type=int, default=0, help="limit numpy's BLAS threads (threadpoolctl)")
    p.add_argument("--breakdown", action="store_true",
                   help="also print the transformer's kernel time per group of ops, for both engines")
    p.add_argument("--native-blas", action="store_true",
                   help="run without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (OpenBLAS picks its kernels)")
    a = p.parse_args(argv)
    pinned = [k for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if k in os.environ]
    if a.native_blas and pinned:
        # both unset together, in this command alone (the machine sets them for older OpenBLAS builds)
        env = {k: v for k, v in os.environ.items() if k not in pinned}
        args = [x for x in (sys.argv[1:] if argv is None else argv) if x != "--native-blas"]
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        cmd = [sys.executable, "-m", "bench.engine_overhead", *args]
        return subprocess.run(cmd, env=env, cwd=here).returncode
    if a.blas_threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(a.blas_threads, user_api="blas")
    import onnxruntime

    print(f"numpy {np.__version__}, onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs")
    print(f"BLAS: {blas_info()}")
    bench_dispatch(a.repeats)
    if a.quick:
        bench_transformer(a.repeats, batch=4, seq=16, d=32, layers=1, breakdown=a.breakdown)
        bench_control_flow(a.repeats, bags=16)
    else:
        bench_transformer(a.repeats, breakdown=a.breakdown)
        bench_control_flow(a.repeats)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Peak memory of training a model of large weights, onnxtrain against onnxruntime-training, in the same run.

    python -m bench.large [--size 4096] [--layers 3] [--steps 3] [--peers onnxtrain,...]

The model is ``layers`` square MatMuls of ``size`` × ``size`` float32 weights (3 × 4096² = 192 MiB), with an
MSE loss and AdamW (learning rate 1e-5). Each peer runs in a fresh process (this file, ``--child``) that
builds the model, writes its artifacts, then measures the peak RSS (VmHWM, reset just before) of what a
user's script does: load the checkpoint and build ``Module`` and ``Optimizer``, then train ``steps`` steps.
Peers: onnxtrain's on-device API on the numpy engine and on the onnxruntime backend, onnxruntime-training
1.19.2 in its own environment (``$ORTT_PYTHON``, as ``python -m bench``; skipped with a message when it is
missing), and onnxtrain's legacy ``TrainingSession`` on either backend (built from the serialized model with
an MSE loss added, then the steps; no peer has that API any more). The engine's allocator settings, which
keep freed pages, are off here, so that RSS after a phase is what is held. Figures are MiB above the RSS
before the build; "ms a step" is the median step after the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ORTT_PYTHON = os.environ.get("ORTT_PYTHON", "/tmp/ortt/bin/python")
PEERS = ("onnxtrain", "onnxtrain-backend", "onnxruntime-training", "onnxtrain-legacy",
         "onnxtrain-legacy-backend")
LR = 1e-5  # small enough that wide layers' losses go down


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith(key))


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _model(size: int, layers: int):
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((size, size), dtype=np.float32) * (1.0 / size) ** 0.5).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, size])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [4, size])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 7
    return m


def _child(peer: str, size: int, layers: int, steps: int, folder: str) -> dict:
    """One peer's figures (runs in its own process)."""
    import ctypes
    import gc
    import time

    import numpy as np

    if peer == "onnxruntime-training":
        import types

        import onnx

        for name in ("onnxruntime.training.optim", "onnxruntime.training.amp"):  # they import torch; unused
            sys.modules[name] = types.ModuleType(name)
        onnx.IR_VERSION = 10  # onnxruntime 1.19 reads IR <= 10
        from onnxruntime.training import api, artifacts
    else:
        import onnxtrain
        from onnxtrain.training import api, artifacts
    x = np.full((4, size), 0.5, np.float32)
    t = np.zeros((4, size), np.float32)
    model = _model(size, layers)
    out: dict = {"peer": peer}
    times: list[float] = []
    if peer.startswith("onnxtrain-legacy"):
        data = model.SerializeToString()
        del model
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base = _status("VmRSS")
        _reset_peak()
        p = onnxtrain.TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "AdamOptimizer"
        loss_model = _with_mse(data, size, layers)
        del data
        so = onnxtrain.SessionOptions()
        if peer == "onnxtrain-legacy-backend":
            so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
        sess = onnxtrain.TrainingSession(loss_model, p, so)
        out["built"], out["build_peak"] = _status("VmRSS") - base, _status("VmHWM") - base
        for _ in range(steps):
            times.append(time.perf_counter())
            loss = sess.run(["loss"], {"x": x, "target": t, "Learning_Rate": np.array([LR], np.float32)})[0]
    else:
        artifacts.generate_artifacts(model, requires_grad=[f"W{i}" for i in range(layers)],
                                     loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                     artifact_directory=folder)
        del model
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base = _status("VmRSS")
        _reset_peak()
        kw = {}
        if peer == "onnxtrain-backend":
            so = onnxtrain.SessionOptions()
            so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
            kw["session_options"] = so
        state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        module = api.Module(os.path.join(folder, "training_model.onnx"), state, **kw)
        opt = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
        opt.set_learning_rate(LR)
        out["built"], out["build_peak"] = _status("VmRSS") - base, _status("VmHWM") - base
        for _ in range(steps):
            times.append(time.perf_counter())
            loss = module(x, t)
            opt.step()
            module.lazy_reset_grad()
    times.append(time.perf_counter())
    out["held"], out["peak"] = _status("VmRSS") - base, _status("VmHWM") - base
    later = [b - a for a, b in zip(times[1:], times[2:])] or [times[-1] - times[0]]
    out["step_ms"] = 1000 * sorted(later)[len(later) // 2]  # the median step after the first
    out["loss"] = float(np.asarray(loss).reshape(-1)[0])  # the last step's (the peers must agree)
    return out


def _with_mse(data: bytes, size: int, layers: int):
    """The serialized model with ``loss = mean((y − target)²)`` added (the legacy session trains a loss the
    model computes)."""
    import onnx
    from onnx import TensorProto, helper

    m = onnx.load_from_string(data)
    y = m.graph.output[0].name
    m.graph.node.extend([helper.make_node("Sub", [y, "target"], ["diff"]),
                         helper.make_node("Mul", ["diff", "diff"], ["sq"]),
                         helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)])
    m.graph.input.append(helper.make_tensor_value_info("target", TensorProto.FLOAT, [4, size]))
    del m.graph.output[:]
    m.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return m.SerializeToString()


def _run_peer(peer: str, args: argparse.Namespace, folder: str) -> dict:
    python = ORTT_PYTHON if peer == "onnxruntime-training" else sys.executable
    if not os.path.exists(python):
        return {"peer": peer, "skipped": f"no onnxruntime-training environment at {python} (python -m bench "
                                          "tells how to make one)"}
    env = {**os.environ, "ONNXTRAIN_ALLOCATOR": "system"}
    if peer == "onnxruntime-training":  # its environment has no onnxtrain: this file alone
        env.pop("PYTHONPATH", None)
    else:  # this checkout's onnxtrain, as bench/run.py's workers: not whichever one is installed (if any)
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [python, os.path.abspath(__file__), "--child", peer, "--size", str(args.size), "--layers",
           str(args.layers), "--steps", str(args.steps), "--folder", os.path.join(folder, peer)]
    os.makedirs(os.path.join(folder, peer), exist_ok=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode != 0:
        return {"peer": peer, "skipped": f"failed: {done.stderr.strip().splitlines()[-1:]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--peers", default=",".join(PEERS), help=f"comma-separated subset of {list(PEERS)}")
    ap.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.size, args.layers, args.steps, args.folder)))
        return 0
    peers = [p for p in args.peers.split(",") if p]
    unknown = [p for p in peers if p not in PEERS]
    if unknown:
        ap.error(f"--peers: unknown peer(s) {unknown}; valid: {list(PEERS)}")
    weights = args.size * args.size * 4 * args.layers / 2**20
    print(f"{args.layers} × {args.size}² float32 weights ({weights:.0f} MiB), AdamW, {args.steps} steps; MiB "
          "above the RSS before the build (weights, moments and gradients are "
          f"{4 * weights:.0f} MiB)")
    print("| peer | held after build | build peak | held after the steps | peak | ms a step | last loss |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="onnxtrain-bench-large-") as tmp:
        for peer in peers:
            r = _run_peer(peer, args, tmp)
            if "skipped" in r:
                print(f"| {peer} | skipped: {r['skipped']} | | | | | |")
            else:
                print(f"| {peer} | {r['built']} | {r['build_peak']} | {r['held']} | {r['peak']} | "
                      f"{r['step_ms']:.0f} | {r['loss']:.6g} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

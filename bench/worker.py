"""One peer of the training benchmark in its own process, driven over stdin/stdout by ``bench/run.py``.

    python bench/worker.py PEER FOLDER          # PEER: legacy | api | torch | ort | ortleg | ortleg-default

The worker loads the model files that ``bench/models.prepare`` wrote in FOLDER, builds its trainer
(AdamW, lr 1e-3, betas 0.9 / 0.999, weight decay 0.01, eps 1e-8, bias correction, no clipping: the same
settings for every peer) and answers one JSON line per command line:

    run N   → {"seconds": wall time of N training steps, "loss": last loss}
    stats   → {"rss_peak": bytes (VmHWM), "rss_base": bytes after imports, "plan_peak": bytes or null}
    quit

A training step is forward + backward + optimizer update (+ clearing the gradients), on the next of the
cached batches. The AdamW of onnxruntime-training's ``generate_artifacts`` is the Hugging Face form
(``adam_mode`` 1: eps added to the root of the uncorrected second moment, the decay applied to the updated
weight); onnxtrain's on-device peer runs the same and its legacy session its equal (``weight_decay_mode`` 1),
torch eager its own ``AdamW`` (eps added after the bias correction, the decay applied first). The two differ
in value only where a gradient is below about eps / sqrt(1 - 0.999^t) (3e-7 at the first step) and make the
same passes over the weights; tests/bench/test_peer_optimizers.py holds each peer to its form.

The ``ortleg`` peer is onnxruntime-training 1.16.3's legacy ``TrainingSession`` (the last release with that
binding), given the legacy model and the ``TrainingParameters`` of onnxtrain's legacy peer (its
``AdamOptimizer`` with ``weight_decay_mode`` 1: the same Hugging Face form) and the session options under
which its CPU build trains correctly (:data:`ORT_LEGACY_FIXES`); ``ortleg-default`` is the same session with
1.16.3's default options, which trains the wrong weights, kept to price those options
(tests/bench/test_ort_legacy_peer.py checks both against onnxtrain's legacy session and float64 AdamW). It
trains the MLPs, the transformer and the GPT decoder (their first losses agree with onnxtrain's to 2e-6);
LeNet it refuses: its ConstantSharing renames the 6-value bias of the first Conv, which it then cannot train
("couldn't find the consumer node"), so the peer is skipped there with that error.

This file imports only the standard library, numpy and the peer's own package (onnxtrain, torch or
onnxruntime-training), so each process's memory is its peer's; every peer also loads onnx (onnxtrain and
onnxruntime-training's generator need it, the torch peer gets it with the models' module: about 7 MiB). The
``ort`` peer runs in the onnxruntime-training virtual environment (numpy<2, no torch, no onnxtrain), the
``ortleg`` peers in 1.16.3's (numpy<2, onnx<1.16: models of IR 9 or lower).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
import types

LR, WEIGHT_DECAY, EPS = 1e-3, 0.01, 1e-8


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _rss_peak() -> int:
    """Peak RSS of this process: VmHWM (``ru_maxrss`` would include the parent's, as it survives exec)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _params(folder: str, graph: str) -> list[str]:
    with open(os.path.join(folder, "params.json")) as f:
        return json.load(f)[graph]


def _batches(folder: str):
    import numpy as np

    data = np.load(os.path.join(folder, "batches.npz"))
    n = len(data.files) // 2
    return [(data[f"x{i}"], data[f"y{i}"]) for i in range(n)]


ORT_SPIN_ENV = "ONNXTRAIN_BENCH_ORT_SPIN"  # "0": onnxruntime's intra-op threads do not spin (--ort-spin off)


def _ort_spin(so) -> None:
    """``--ort-spin off`` (``ONNXTRAIN_BENCH_ORT_SPIN=0``): onnxruntime's idle intra-op threads sleep at once
    instead of spinning a while (its default), set the same way for both onnxruntime peers."""
    if os.environ.get(ORT_SPIN_ENV, "1") == "0":
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")


def _backend_options():
    """onnxtrain SessionOptions naming the backend in ``$ONNXTRAIN_BENCH_BACKEND`` (None: the default, numpy,
    with no config entries), with the config entries ``key=value`` of ``$ONNXTRAIN_BENCH_CONFIG`` (separated
    by ``;``); e.g. ``--variant ortbackend:ONNXTRAIN_BENCH_BACKEND=onnxruntime`` or ``--variant
    perweight:ONNXTRAIN_BENCH_CONFIG=onnxtrain.flat_update=0``."""
    backend = os.environ.get("ONNXTRAIN_BENCH_BACKEND", "")
    entries = [e.partition("=") for e in os.environ.get("ONNXTRAIN_BENCH_CONFIG", "").split(";") if e.strip()]
    if any(not sep or not key.strip() for key, sep, _ in entries):
        raise ValueError("ONNXTRAIN_BENCH_CONFIG takes key=value entries separated by ';', got "
                         f"{os.environ['ONNXTRAIN_BENCH_CONFIG']!r}")
    if not backend and not entries:
        return None
    from onnxtrain import SessionOptions

    so = SessionOptions()
    for key, _, value in entries:
        so.add_session_config_entry(key.strip(), value.strip())
    if not backend:
        return so
    so.add_session_config_entry("onnxtrain.backend", backend)
    _ort_spin(so)
    # a training step runs one shape: onnxruntime's memory pattern (a block planned for all of a run's
    # tensors) only raises the peak (GPT: 219 -> 183 MiB without it, at the same speed)
    so.enable_mem_pattern = False
    return so


# ---- peers: each returns (step(x, y) -> loss, plan_peak() -> int | None) --------------------------------
def legacy_peer(folder: str):
    import numpy as np

    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.enable_grad_norm_clip = False
    import onnx

    model = onnx.load(os.path.join(folder, "model_loss.onnx"))
    names = _params(folder, "loss_model")
    p.optimizer_attributes_map = {n: {"lambda": WEIGHT_DECAY, "epsilon": EPS} for n in names}
    p.optimizer_int_attributes_map = {n: {"weight_decay_mode": 1} for n in names}
    sess = TrainingSession(model.SerializeToString(), p, _backend_options())
    inputs = [i.name for i in sess.get_inputs()]
    x_name = inputs[0]
    lr = np.array([LR], np.float32)

    def step(x, y):
        return sess.run(["loss"], {x_name: x, "labels": y, "Learning_Rate": lr})[0]

    step.weights = lambda: {n.removeprefix("model."): v for n, v in sess.get_state().items() if n in names}
    return step, lambda: max(getattr(pl, "peak_bytes", 0) for pl in sess._plans.values()) or None


def _on_device_step(artifacts, api, onnxblock, model, folder: str, subdir: str, session_options):
    """Artifacts (cross-entropy; AdamW with the weight decay and epsilon of the other peers, not the
    generator's defaults of 0 and 1e-6) in ``folder/subdir``, then a Module + Optimizer of ``api``: the same
    calls for onnxtrain and onnxruntime-training, whose on-device APIs share their names. Returns
    (step(x, y) -> loss, module, optimizer); ``step.update_seconds[0]`` adds up the time in
    ``Optimizer.step``; ``step.weights()`` reads the trained parameters (every peer's step has it)."""
    out = os.path.join(folder, subdir)
    os.makedirs(out, exist_ok=True)
    artifacts.generate_artifacts(
        model,
        requires_grad=_params(folder, "model"),
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=onnxblock.optim.AdamW(eps=EPS, weight_decay=WEIGHT_DECAY),
        artifact_directory=out,
    )
    state = api.CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
    module = api.Module(os.path.join(out, "training_model.onnx"), state, session_options=session_options)
    opt = api.Optimizer(os.path.join(out, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)

    spent = [0.0]  # seconds in Optimizer.step, read by the worker loop ("update_seconds")

    def step(x, y):
        loss = module(x, y.reshape(-1))
        t0 = time.perf_counter()
        opt.step()
        spent[0] += time.perf_counter() - t0
        module.lazy_reset_grad()
        return loss

    step.update_seconds = spent
    params = _params(folder, "model")
    step.weights = lambda: {n: state.parameters[n].data.copy() for n in params}
    return step, module, opt


def api_peer(folder: str):
    import onnx

    from onnxtrain.training import api, artifacts, onnxblock

    model = onnx.load(os.path.join(folder, "model.onnx"))
    options = _backend_options()
    step, module, opt = _on_device_step(artifacts, api, onnxblock, model, folder, "onnxtrain_artifacts",
                                        options)
    return (
        step,
        lambda: (
            max(getattr(module._step_plan, "peak_bytes", 0), getattr(opt._plan, "peak_bytes", 0)) or None
        ),
    )


def torch_peer(folder: str):
    import torch

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from bench.models import ALL_CASES

    key = os.path.basename(os.path.normpath(folder))
    case = next(c for c in ALL_CASES if c.key == key)
    module = case.build()
    module.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    module.train()
    # eps given, not left to torch's default: that it equals EPS was a coincidence a change of EPS would break
    opt = torch.optim.AdamW(module.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS, foreach=True)
    ce = torch.nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = ce(module(torch.from_numpy(x)), torch.from_numpy(y).reshape(-1))
        loss.backward()
        opt.step()
        return loss.detach()

    step.weights = lambda: {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    return step, lambda: None


def _name_layer_norm_statistics(model) -> None:
    """Name every LayerNormalization's optional Mean and InvStdDev outputs, which torch's export leaves out
    and onnxruntime's gradient of it reads (1.16.3 and 1.19.2: "GradientBuilderBase::O ... i <
    node_->OutputDefs().size() was false")."""
    for i, node in enumerate(model.graph.node):
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"{node.output[0]}.mean{i}", f"{node.output[0]}.inv_std_dev{i}"])


def ort_peer(folder: str):
    for name in ("onnxruntime.training.optim", "onnxruntime.training.amp"):  # they import torch; unused
        sys.modules[name] = types.ModuleType(name)
    import onnx

    onnx.IR_VERSION = 10  # onnxruntime 1.19 reads IR <= 10; the generator stamps onnx.IR_VERSION
    import onnxruntime as ort
    from onnxruntime.training import api, artifacts, onnxblock

    model = onnx.load(os.path.join(folder, "model.onnx"))
    model.ir_version = 10
    _name_layer_norm_statistics(model)
    so = ort.SessionOptions()
    _ort_spin(so)
    step, _, _ = _on_device_step(artifacts, api, onnxblock, model, folder, "ort_artifacts", so)
    return step, lambda: None


# 1.16.3's CPU faults in training, which these session options avoid (tests/session/legacy_peer.py, whose
# PEER_CONFIG they are, has the tests that show each): its Gemm packs a constant weight once when the session
# is made, so every forward after the first update multiplies by the initial weights (prepacking off); its
# default execution order may run a weight's in-place update before a backward node that still reads the
# weight (the priority-based order runs the backward first); at its default optimization level its NCHWc
# transform copies each Conv weight once into an initializer the optimizer never updates (the extended level
# has no such copy).
ORT_LEGACY_FIXES = {"session.disable_prepacking": "1", "execution_order": "PRIORITY_BASED",
                    "graph_optimization_level": "ORT_ENABLE_EXTENDED"}


def ort_legacy_peer(folder: str, fixes: bool = True):
    """onnxruntime-training 1.16.3's ``TrainingSession`` on the legacy model, with the parameters of
    :func:`legacy_peer` and, when ``fixes``, the session options of :data:`ORT_LEGACY_FIXES`."""
    import numpy as np
    import onnx
    import onnxruntime as ort

    path = os.path.join(folder, "model_loss.onnx")
    model = onnx.load(path)
    opset = max((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), default=13)
    if opset > 19:
        raise ValueError(f"{path}: imports opset {opset}; onnxruntime 1.16.3 and its onnx read up to 19")
    model.ir_version = min(model.ir_version, 7 if opset <= 12 else 8 if opset <= 18 else 9)
    _name_layer_norm_statistics(model)
    names = _params(folder, "loss_model")
    p = ort.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    p.enable_grad_norm_clip = False
    # named: it would also train the float Constants its ConstantSharing turns into initializers
    p.weights_to_train = set(names)
    p.optimizer_attributes_map = {n: {"lambda": WEIGHT_DECAY, "epsilon": EPS} for n in names}
    p.optimizer_int_attributes_map = {n: {"weight_decay_mode": 1} for n in names}
    so = ort.SessionOptions()
    if fixes:
        for key, value in ORT_LEGACY_FIXES.items():
            if key == "execution_order":
                so.execution_order = getattr(ort.ExecutionOrder, value)
            elif key == "graph_optimization_level":
                so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, value)
            else:
                so.add_session_config_entry(key, value)
    _ort_spin(so)
    sess = ort.TrainingSession(model.SerializeToString(), p, so, providers=["CPUExecutionProvider"])
    trained = {n for n in sess.get_state() if n in names}
    if trained != set(names):
        raise RuntimeError(f"onnxruntime 1.16.3 trains {sorted(trained)}, not the model's parameters "
                           f"{sorted(names)}")
    x_name = sess.get_inputs()[0].name
    lr = np.array([LR], np.float32)

    def step(x, y):
        return sess.run(["loss"], {x_name: x, "labels": y, "Learning_Rate": lr})[0]

    step.weights = lambda: {n.removeprefix("model."): v for n, v in sess.get_state().items() if n in names}
    return step, lambda: None


PEERS = {"legacy": legacy_peer, "api": api_peer, "torch": torch_peer, "ort": ort_peer,
         "ortleg": ort_legacy_peer, "ortleg-default": lambda folder: ort_legacy_peer(folder, fixes=False)}
# packages whose versions move a peer's figures (ml_dtypes, which onnx imports: 0.7.0 holds 5 MiB more
# than 0.5.4 in every process), reported when the peer has loaded them
REPORTED = ("numpy", "onnx", "ml_dtypes", "onnxruntime", "torch")


def loaded_versions() -> dict[str, str]:
    """Version of each package of :data:`REPORTED` this process has imported."""
    return {name: str(getattr(sys.modules[name], "__version__", "?")) for name in REPORTED
            if name in sys.modules}


def main(argv: list[str]) -> int:
    peer, folder = argv
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    import numpy as np

    base = _rss_now()
    try:
        step, plan_peak = PEERS[peer](folder)
    except Exception as e:  # the parent prints it and skips this peer
        proto.write(json.dumps({"error": f"{type(e).__name__}: {e}"}) + "\n")
        return 1
    batches = _batches(folder)
    proto.write(json.dumps({"ready": True, "packages": loaded_versions()}) + "\n")
    i = 0
    loss = None
    update = getattr(step, "update_seconds", None)  # on-device peers: time in Optimizer.step
    first: list[float] = []  # losses of the first steps: every peer must agree on them
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        if cmd[0] == "run":
            n = int(cmd[1])
            before = update[0] if update is not None else 0.0
            t0 = time.perf_counter()
            for _ in range(n):
                x, y = batches[i % len(batches)]
                loss = step(x, y)
                i += 1
                if len(first) < 3:
                    first.append(float(np.asarray(loss).reshape(-1)[0]))
            dt = time.perf_counter() - t0
            reply = {"seconds": dt, "loss": float(np.asarray(loss).reshape(-1)[0])}
            if update is not None:
                reply["update_seconds"] = update[0] - before
            proto.write(json.dumps(reply) + "\n")
        elif cmd[0] == "stats":
            proto.write(
                json.dumps(
                    {
                        "rss_peak": _rss_peak(),
                        "rss_base": base,
                        "plan_peak": plan_peak(),
                        "first_losses": first,
                    }
                )
                + "\n"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

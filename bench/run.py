"""Training-step throughput and peak memory of onnxtrain against its peers, in the same run.

    python -m bench [--quick] [--models mlp64,gpt16] [--repeats 7] [--min-time 0.5] [--results FILE]
    python bench/run.py ...

Models (exported by torch 2.13, see bench/models.py): MLP 784-512-512-10 at batch 64 and 256, LeNet-5
CNN (64), 2-layer transformer encoder d=128 seq=64 (32), 2-layer GPT-style causal decoder (16); when named
with ``--models``, also a small MobileNetV2 with depthwise convolutions (16) and a CIFAR ResNet (32).
Peers, each in its own fresh process (bench/worker.py): onnxtrain's legacy ``TrainingSession`` (loss in
the graph) and its on-device ``Module`` + ``Optimizer``, onnxruntime-training 1.19.2's on-device API (in
the virtual environment at ``$ORTT_PYTHON``, default /tmp/ortt/bin/python) and torch eager; numpy peers
and torch run with the inherited ``OPENBLAS_CORETYPE`` and, where the environment pins it, also with it and
``OPENBLAS_L2_SIZE`` unset ("native": OpenBLAS picks the kernels for this CPU, shown on the GEMM line).
Every peer trains with AdamW, lr 1e-3, weight decay 0.01, eps 1e-8, no clipping (onnxruntime-training's and
onnxtrain's peers in the Hugging Face form that ``generate_artifacts`` writes, torch eager in torch's: see
bench/worker.py). A peer that cannot start is skipped with its error.

Optional peers, named with ``--peers``: ``ortleg``, onnxruntime-training 1.16.3's legacy ``TrainingSession``
(the last release with it; its venv at ``$ORT_LEGACY_PYTHON``, default /tmp/ortleg/bin/python, which
tests/ortt.py's ``ensure_ort_legacy`` makes), training the legacy model with the parameters of onnxtrain's
legacy session under the session options that make its CPU build train correctly (bench/worker.py's
``ORT_LEGACY_FIXES``; LeNet it refuses, see there); ``ortleg-default``, the same with 1.16.3's default
options, under which it trains the wrong weights (prepacked Gemm weights never updated): what those options
cost it. With ``ortleg`` measured, the notes give every peer's round-by-round ratio to it; a peer that trains
wrong is left out of the first losses' agreement.

Timing: after a warm-up, every round runs each peer in turn (the order rotates every round) for enough
steps to last ``--min-time``; a peer's figure is the median over ``--repeats`` rounds. The notes also give,
for each peer, the middle half of its round-by-round ratios to onnxruntime-training (the two ran in the same
round, under nearly the same load): how far a ratio moves with the machine's load, and for the on-device
peers the time their ``Optimizer.step`` takes per step (the update, timed inside the step), and the CPU
steal of the samples with each peer's ratio again over the rounds that had none (:mod:`bench.steal`).
Memory: peak RSS of the peer's process (VmHWM: interpreter, imports, model, training) and, for onnxtrain, the
engine's peak live bytes (``Plan.peak_bytes``, the largest over its plans). That counts what the plan holds:
a feed is dropped from it after its last use even when the caller keeps it, and state it is not fed does not
appear. So the legacy session's one graph (weights, gradients, moments and update in it) and the ``Module``'s
training plan (the moments outside it, the weights let go after their last use) are not like for like: the
GPT decoder 43.1 against 35.6 MiB, while the two processes' numpy peaks in a step (tracemalloc) were 62.7
and 61.8 MiB. Peak RSS is the figure to compare across peers. FLOPs: bench/flops.py;
"% peak" is step FLOPs / step time / the best numpy float32 GEMM figure measured in this run; as the machine's
speed changes over a run, a GEMM probe (``bench/gemm.py --serve``) is also sampled first in every round, and
the notes give each peer's step against the rate of its own round (medians over the rounds).

``--variant LABEL:NAME=VALUE,...`` adds onnxtrain peers run with extra environment, interleaved with the rest
(A/B): ``nofuse:ONNXTRAIN_FUSION=0`` (engine fusions off), ``1thread:OPENBLAS_NUM_THREADS=1``,
``ortbackend:ONNXTRAIN_BENCH_BACKEND=onnxruntime`` (onnxtrain's onnxruntime backend);
``ONNXTRAIN_BENCH_CONFIG=key=value;...`` gives the onnxtrain sessions config entries, e.g.
``perweight:ONNXTRAIN_BENCH_BACKEND=onnxruntime,ONNXTRAIN_BENCH_CONFIG=onnxtrain.flat_update=0``.

onnxruntime runs with its default threading (idle intra-op threads spin a while before they sleep), in the
onnxruntime-training peer and in onnxtrain's onnxruntime backend alike; ``--ort-spin off`` sets
``session.intra_op.allow_spinning = 0`` in both (``ONNXTRAIN_BENCH_ORT_SPIN=0`` in their environment).
Spinning threads do not reach the next peer's turn: every turn starts after a pause (``SETTLE_S``).

``--quick`` (a smoke run for CI, seconds): the MLP at batch 64 only, few short rounds, inherited BLAS
setting only; its figures are not results and are not written to the results file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ROOT, calls_per_sample  # noqa: E402
from bench.steal import QUIET_SHARE, quiet_rounds, steal_seconds, stolen_share  # noqa: E402
from bench.worker import ORT_SPIN_ENV  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "worker.py")
ORTT_PYTHON = os.environ.get("ORTT_PYTHON", "/tmp/ortt/bin/python")
ORT_LEGACY_PYTHON = os.environ.get("ORT_LEGACY_PYTHON", "/tmp/ortleg/bin/python")
NATIVE_BLAS = "native"
MiB = 1 << 20
LABELS = {
    "legacy": "onnxtrain TrainingSession",
    "api": "onnxtrain Module+Optimizer",
    "ort": "onnxruntime-training 1.19.2",
    "torch": "torch eager",
    "ortleg": "onnxruntime-training 1.16.3 TrainingSession",
    "ortleg-default": "onnxruntime-training 1.16.3 TrainingSession, default options (trains wrong)",
}
ORT_KINDS = ("ort", "ortleg", "ortleg-default")  # onnxruntime peers: their own venvs, no OpenBLAS setting
WRONG_TRAINING = ("ortleg-default",)  # measured for their speed only: their losses part from the others'
# how to make a missing venv of an onnxruntime peer
VENVS = {
    "ort": (ORTT_PYTHON, "python -m venv /tmp/ortt && /tmp/ortt/bin/pip install onnxruntime-training==1.19.2 "
            "'numpy<2' onnx"),
    "ortleg": (ORT_LEGACY_PYTHON, "python -m venv /tmp/ortleg && /tmp/ortleg/bin/pip install "
               "onnxruntime-training==1.16.3 'numpy<2' 'onnx<1.16' 'protobuf<4'"),
}
VENVS["ortleg-default"] = VENVS["ortleg"]


@dataclass
class Peer:
    """A running worker process and its samples."""

    kind: str
    blas: str  # OPENBLAS_CORETYPE it runs with ("" for onnxruntime, which does not use OpenBLAS)
    variant: str = ""  # "LABEL:NAME=VALUE,...": extra environment of an onnxtrain peer (A/B runs)
    proc: subprocess.Popen | None = None
    error: str = ""
    packages: dict = field(default_factory=dict)  # versions of the packages the worker loaded
    number: int = 1
    samples: list[float] = field(default_factory=list)
    update_samples: list[float] = field(default_factory=list)  # on-device peers: Optimizer.step per step
    steal: list[float | None] = field(default_factory=list)  # per sample: share of the CPUs' time stolen
    stats: dict = field(default_factory=dict)
    loss: float = math.nan

    @property
    def name(self) -> str:
        label = self.variant.split(":", 1)[0]
        return LABELS[self.kind] + (f" [{self.blas}]" if self.blas else "") + (f" ({label})" if label else "")

    @property
    def extra_env(self) -> dict[str, str]:
        if not self.variant:
            return {}
        pairs = self.variant.split(":", 1)[1].split(",")
        return dict(p.split("=", 1) for p in pairs if p)

    def send(self, line: str) -> dict:
        assert self.proc is not None and self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"{self.name}: worker exited: {self.stderr_tail()}")
        return json.loads(reply)

    def stderr_tail(self) -> str:
        if self.proc is None or self.proc.stderr is None:
            return ""
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return "(no stderr: still running)"
        return self.proc.stderr.read()[-1500:].strip()


def start(peer: Peer, folder: str) -> None:
    env = dict(os.environ)
    if peer.kind in ORT_KINDS:
        python, make = VENVS[peer.kind]
        for k in ("PYTHONPATH", "PYTHONHOME"):
            env.pop(k, None)
        if not os.path.exists(python):
            peer.error = f"no onnxruntime-training environment at {python} (create it: {make})"
            return
    else:
        python = sys.executable
        env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
        set_blas(env, peer.blas)
        env.update(peer.extra_env)
    peer.proc = subprocess.Popen(
        [python, WORKER, peer.kind, folder],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=folder,
    )


def wait_ready(peer: Peer) -> None:
    if peer.proc is None:
        return
    line = peer.proc.stdout.readline()
    try:
        msg = json.loads(line) if line else {"error": peer.stderr_tail()}
    except json.JSONDecodeError:
        msg = {"error": line.strip()}
    if "error" in msg:
        peer.error = msg["error"].strip().splitlines()[-1] if msg["error"].strip() else "worker failed"
        peer.proc.kill()
        peer.proc = None
        return
    peer.packages = msg.get("packages", {})
    PACKAGES.setdefault(peer.name, peer.packages)


# peer name → the package versions its worker loaded (first case seen): one note of the run
PACKAGES: dict[str, dict] = {}


def packages_note() -> str:
    """The package versions each peer loaded, peers of the same versions together ("" when none reported)."""
    by: dict[tuple, list[str]] = {}
    for name, pk in PACKAGES.items():
        if pk:
            by.setdefault(tuple(pk.items()), []).append(name)
    if not by:
        return ""
    return "packages loaded (peak RSS depends on their versions): " + "; ".join(
        f"{', '.join(names)}: " + ", ".join(f"{k} {v}" for k, v in pk) for pk, names in by.items())


def set_blas(env: dict[str, str], setting: str) -> None:
    """Apply a --blas setting to a peer's environment: NATIVE_BLAS unsets OPENBLAS_CORETYPE and
    OPENBLAS_L2_SIZE together (OpenBLAS then picks its kernels for this CPU); a name forces those kernels."""
    if setting == NATIVE_BLAS:
        env.pop("OPENBLAS_CORETYPE", None)
        env.pop("OPENBLAS_L2_SIZE", None)
    elif setting:
        env["OPENBLAS_CORETYPE"] = setting


class GemmProbe:
    """``bench/gemm.py --serve`` under one BLAS setting, sampled once a round (:func:`measure`): the machine's
    speed changes over a run (a peak measured at 436 GFLOP/s at a run's start and 210 at its end), so each
    peer's step is also set against the GEMM rate of its own round."""

    def __init__(self, coretype: str, quick: bool):
        env = dict(os.environ)
        set_blas(env, coretype)
        n, repeats = ("1024", "2") if quick else ("2048", "3")  # the sizes of gemm_peak
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "gemm.py"), "--serve", "--n", n, "--repeats", repeats],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        self.coretype = coretype
        self.best = 0.0  # the best rate sampled so far: part of the run's peak

    def sample(self) -> float:
        """GFLOP/s of the best of a few n×n products now."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        if not reply:
            raise RuntimeError(f"bench/gemm.py --serve exited with code {self.proc.wait()}")
        rate = float(json.loads(reply)["gflops"])
        self.best = max(self.best, rate)
        return rate

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def round_peak_shares(flops: float, samples: list[float], round_peaks: list[float]) -> float:
    """Median over the rounds of step FLOPs / step time / the GEMM rate measured in the same round."""
    if len(samples) != len(round_peaks) or not samples:
        raise ValueError(f"need one GEMM rate per round, got {len(round_peaks)} for {len(samples)} rounds")
    return statistics.median(flops / s / 1e9 / g for s, g in zip(samples, round_peaks))


def gemm_peak(coretype: str, quick: bool) -> dict:
    env = dict(os.environ)
    set_blas(env, coretype)
    args = ["--n", "1024", "--repeats", "3"] if quick else ["--n", "2048", "--repeats", "9"]
    out = subprocess.run(
        [sys.executable, os.path.join(HERE, "gemm.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


# pause between two peers' turns: numpy's OpenBLAS threads busy-wait about 0.1 s after their last call
# (measured: 0.104 s of CPU in a 0.3 s sleep after one GEMM; torch's threads 0.009 s), which would take a
# core from whichever peer runs next
SETTLE_S = 0.15


def calibrate(p: Peer, min_time: float) -> int:
    """Steps per sample for ``p``: enough for ``min_time`` seconds, from a timed run of growing length."""
    return calls_per_sample(lambda n: p.send(f"run {n}")["seconds"], min_time)


def measure(peers: list[Peer], repeats: int, warmup: int, min_time: float,
            probes: Sequence[GemmProbe] = ()) -> list[float]:
    """Interleaved rounds of the peers' samples; returns the best GEMM rate of ``probes`` in each round
    (sampled first in the round), or nothing without probes."""
    live = [p for p in peers if p.proc is not None]
    for p in live:
        p.send(f"run {warmup}")
    for p in live:
        p.number = calibrate(p, min_time)
    round_peaks = []
    for r in range(repeats):
        if probes:
            time.sleep(SETTLE_S)
            round_peaks.append(max(probe.sample() for probe in probes))
        k = r % len(live) if live else 0
        for p in live[k:] + live[:k]:
            time.sleep(SETTLE_S)
            stolen, t0 = steal_seconds(), time.perf_counter()
            res = p.send(f"run {p.number}")
            wall = time.perf_counter() - t0
            p.steal.append(stolen_share(stolen, steal_seconds(), wall, os.cpu_count() or 1))
            p.samples.append(res["seconds"] / p.number)
            if "update_seconds" in res:
                p.update_samples.append(res["update_seconds"] / p.number)
            p.loss = res["loss"]
    for p in live:
        p.stats = p.send("stats")
        p.proc.stdin.write("quit\n")
        p.proc.stdin.flush()
        p.proc.wait(timeout=30)
    return round_peaks


@dataclass
class Row:
    case: str
    peer: str
    kind: str
    blas: str
    ms: float
    samples_s: float
    gflops: float
    rss: float
    plan: float | None
    variant: str = ""  # label of the A/B variant ("" for the default)
    vs_ort: float | None = None
    vs_torch: float | None = None


def round_ratios(reference: list[float], samples: list[float]) -> tuple[float, float, float]:
    """Quartiles (25 %, 50 %, 75 %) of the per-round speed ratios reference time / peer time: the peers of
    a round ran one after the other, so each ratio saw nearly the same machine load."""
    if len(reference) != len(samples) or not samples:
        raise ValueError(f"need rounds of both peers, got {len(reference)} and {len(samples)}")
    ratios = sorted(r / s for r, s in zip(reference, samples))
    if len(ratios) == 1:
        return ratios[0], ratios[0], ratios[0]
    q = statistics.quantiles(ratios, n=4, method="inclusive")
    return q[0], q[1], q[2]


def run_case(
    case, folder: str, peers_wanted: list[tuple[str, str, str]], args, probes: Sequence[GemmProbe] = ()
) -> tuple[list[Row], list[str]]:
    import numpy as np
    import onnx

    from bench.flops import step_flops
    from bench.models import prepare

    paths = prepare(case, folder)
    batches = np.load(paths["batches"])
    flops = step_flops(onnx.load(paths["model"]), {case.input_name: batches["x0"]})["step"]
    peers = [Peer(kind, blas, variant) for kind, blas, variant in peers_wanted]
    for p in peers:
        start(p, folder)
    for p in peers:
        wait_ready(p)
    notes = [f"{case.title}: {p.name} skipped: {p.error}" for p in peers if p.error]
    round_peaks = measure(peers, args.repeats, args.warmup, args.min_time, probes)
    rows = []
    for p in peers:
        if not p.samples:
            continue
        med = statistics.median(p.samples)
        plan = p.stats.get("plan_peak")
        rows.append(
            Row(
                case.title,
                p.name,
                p.kind,
                p.blas,
                med * 1e3,
                case.batch / med,
                flops / med / 1e9,
                p.stats["rss_peak"] / MiB,
                plan / MiB if plan else None,
                p.variant.split(":", 1)[0],
            )
        )
    ort = next((r for r in rows if r.kind == "ort"), None)
    for r in rows:
        if ort is not None:
            r.vs_ort = r.samples_s / ort.samples_s
        torch_same = next(
            (t for t in rows if t.kind == "torch" and (t.blas == r.blas or r.kind in ORT_KINDS)), None
        )
        if torch_same is not None:
            r.vs_torch = r.samples_s / torch_same.samples_s
    ort_peer = next((p for p in peers if p.kind == "ort" and p.samples), None)
    spreads = []
    for p in peers:
        if ort_peer is not None and p is not ort_peer and len(p.samples) == len(ort_peer.samples):
            lo, _, hi = round_ratios(ort_peer.samples, p.samples)
            spreads.append(f"{p.name}: {lo:.2f}–{hi:.2f}")
    if spreads:
        head = f"{case.title}: × ORT-T round by round, the middle half of the rounds: "
        notes.append(head + "; ".join(spreads))
    legacy_ort = next((p for p in peers if p.kind == "ortleg" and p.samples), None)
    if legacy_ort is not None:
        notes.append(versus_note(case.title, legacy_ort, peers))
    notes += steal_notes(case.title, [p for p in peers if p.samples], ort_peer)
    measured = [p for p in peers if p.samples]
    if round_peaks and measured:
        notes.append(
            f"{case.title}: % of the GEMM rate measured in the same round (step FLOPs / step time / that "
            f"round's n² GEMM, medians over the rounds; the rounds' GEMM rates "
            f"{min(round_peaks):.0f}–{max(round_peaks):.0f} GFLOP/s): "
            + "; ".join(f"{p.name}: {100 * round_peak_shares(flops, p.samples, round_peaks):.0f} %"
                        for p in measured)
        )
    updates = update_split(peers)
    if updates:
        notes.append(f"{case.title}: {updates}")
    firsts = [p.stats.get("first_losses", []) for p in peers if p.samples and p.kind not in WRONG_TRAINING]
    spread = max((abs(a - b) for f in firsts for g in firsts for a, b in zip(f, g)), default=0.0)
    wrong = [p.name for p in peers if p.samples and p.kind in WRONG_TRAINING]
    notes.append(
        f"{case.title}: {flops / 1e9:.3f} GFLOP per step; losses of the first 3 steps agree within "
        f"{spread:.1e} across peers" + (f", leaving out {', '.join(wrong)}" if wrong else "") + " ("
        + "; ".join(
            f"{p.name}: " + ", ".join(f"{v:.5f}" for v in p.stats.get("first_losses", []))
            for p in peers
            if p.samples
        )
        + ")"
    )
    return rows, notes


def versus_note(title: str, reference: Peer, peers: list[Peer]) -> str:
    """Each other measured peer's round-by-round speed ratio to ``reference`` (its time over the peer's, > 1:
    the peer is faster): the median and the middle half of the rounds."""
    parts = []
    for p in peers:
        if p is reference or len(p.samples) != len(reference.samples) or not p.samples:
            continue
        lo, mid, hi = round_ratios(reference.samples, p.samples)
        parts.append(f"{p.name}: {mid:.2f} ({lo:.2f}–{hi:.2f})")
    return (f"{title}: × {reference.name} round by round (its step time / the peer's; median, middle half): "
            + "; ".join(parts))


def steal_notes(title: str, peers: list[Peer], ort_peer: Peer | None) -> list[str]:
    """The CPU steal of the timed samples and, when some rounds had none worth counting, each peer's
    median ratio to onnxruntime-training over those rounds (:mod:`bench.steal`); none where the kernel does
    not report steal."""
    shares = [s for p in peers for s in p.steal if s is not None]
    if not peers or not shares:
        return []
    quiet = quiet_rounds([p.steal for p in peers])
    rounds = len(peers[0].steal)
    out = [f"{title}: CPU steal (the host running other guests) in the timed samples: median "
           f"{100 * statistics.median(shares):.1f} %, at most {100 * max(shares):.1f} % of the CPUs' time; "
           f"{len(quiet)} of {rounds} rounds quiet (every peer under {100 * QUIET_SHARE:.0f} %)"]
    if ort_peer is not None and len(quiet) >= 3:
        reference = [ort_peer.samples[r] for r in quiet]
        ratios = [f"{p.name}: {round_ratios(reference, [p.samples[r] for r in quiet])[1]:.2f}"
                  for p in peers if p is not ort_peer]
        out.append(f"{title}: × ORT-T over the quiet rounds only (medians): " + "; ".join(ratios))
    return out


def update_split(peers: list[Peer]) -> str:
    """How much of each on-device peer's step is ``Optimizer.step`` (medians over the rounds), or ""."""
    parts = [
        f"{p.name}: {statistics.median(p.update_samples) * 1e3:.2f} of "
        f"{statistics.median(p.samples) * 1e3:.2f} ms"
        for p in peers
        if p.update_samples and p.samples
    ]
    return "time in Optimizer.step per step (the update), medians: " + "; ".join(parts) if parts else ""


def table(rows: list[Row], markdown: bool, peak: float) -> str:
    head = [
        "model",
        "peer",
        "ms/step",
        "samples/s",
        "× ORT-T",
        "× torch",
        "% GEMM peak",
        "peak RSS MiB",
        "plan peak MiB",
    ]

    def cells(r: Row) -> list[str]:
        return [
            r.case,
            r.peer,
            f"{r.ms:.2f}",
            f"{r.samples_s:,.0f}",
            "-" if r.vs_ort is None else f"{r.vs_ort:.2f}",
            "-" if r.vs_torch is None else f"{r.vs_torch:.2f}",
            f"{100 * r.gflops / peak:.0f} %",
            f"{r.rss:.0f}",
            "-" if r.plan is None else f"{r.plan:.1f}",
        ]

    body = [cells(r) for r in rows]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        lines += ["| " + " | ".join(c) + " |" for c in body]
        return "\n".join(lines)
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    fmt = lambda c: "  ".join(x.ljust(w) if i < 2 else x.rjust(w) for i, (x, w) in enumerate(zip(c, widths)))  # noqa
    out, prev = [fmt(head)], None
    for r, c in zip(rows, body):
        if prev is not None and r.case != prev:
            out.append("")
        prev = r.case
        out.append(fmt(c))
    return "\n".join(out)


def versions() -> str:
    import numpy as np

    parts = [f"Python {platform.python_version()}", f"numpy {np.__version__}"]
    try:
        import torch

        parts.append(f"torch {torch.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main(argv: list[str] | None = None) -> int:
    from bench.models import ALL_CASES, CASES, QUICK_CASES

    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run (seconds); figures are not results")
    p.add_argument("--models", default="", help=f"comma-separated subset of {[c.key for c in ALL_CASES]} "
                   "(default: all but the extras mobilenet16 and resnet32)")
    p.add_argument("--peers", default="legacy,api,ort,torch", help="comma-separated subset of peers")
    p.add_argument("--repeats", type=int, default=0, help="timed rounds (≥ 5; default 7, quick 5)")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps per peer first (default 5, quick 2)")
    p.add_argument("--min-time", type=float, default=0.0, help="seconds per sample (default 0.5, quick 0.03)")
    p.add_argument(
        "--blas",
        default="",
        help="OPENBLAS_CORETYPE settings for numpy/torch peers, comma-separated ('env' = as inherited, "
        f"'{NATIVE_BLAS}' = OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE unset); default: env,{NATIVE_BLAS} "
        "(quick: env)",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL:NAME=VALUE,...",
        help="also run the onnxtrain peers with this extra environment, e.g. "
        "'nofuse:ONNXTRAIN_FUSION=0' (an A/B comparison in the same run); repeatable",
    )
    p.add_argument(
        "--ort-spin",
        choices=("on", "off"),
        default="on",
        help="onnxruntime's idle intra-op threads spin before they sleep: 'on' (onnxruntime's default) or "
        "'off' (session.intra_op.allow_spinning = 0), for the onnxruntime-training peer and onnxtrain's "
        "onnxruntime backend alike",
    )
    p.add_argument(
        "--results",
        default="",
        help="write the markdown results here (default: bench/RESULTS.md "
        "for a full run, nothing for --quick)",
    )
    a = p.parse_args(argv)
    os.environ[ORT_SPIN_ENV] = "1" if a.ort_spin == "on" else "0"  # the peers' processes inherit it
    a.repeats = a.repeats or (5 if a.quick else 7)
    if a.repeats < 5:
        p.error("use at least 5 repeats: a median of fewer is noise")
    a.warmup = a.warmup or (2 if a.quick else 5)
    a.min_time = a.min_time or (0.03 if a.quick else 0.5)
    cases = (
        [c for c in ALL_CASES if c.key in a.models.split(",")]
        if a.models
        else (QUICK_CASES[:1] if a.quick else CASES)
    )
    unknown_models = [m for m in a.models.split(",") if m and m not in {c.key for c in ALL_CASES}]
    if not cases or unknown_models:
        p.error(f"--models: unknown model(s) {unknown_models}; pick from {[c.key for c in ALL_CASES]}")
    blas_settings = [s.strip() for s in (a.blas or ("env" if a.quick else f"env,{NATIVE_BLAS}")).split(",")]
    inherited = os.environ.get("OPENBLAS_CORETYPE", "")
    pinned = any(k in os.environ for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE"))
    blas_settings = [inherited if s == "env" or s == NATIVE_BLAS and not pinned else s for s in blas_settings]
    try:
        import torch  # noqa: F401 - the models are exported by torch
    except ImportError:
        print("bench: torch is not installed: the models cannot be exported; nothing measured")
        return 0
    kinds = [k.strip() for k in a.peers.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in LABELS]
    if unknown or not kinds:
        p.error(f"--peers: unknown peer(s) {unknown}; pick from {sorted(LABELS)}")
    wanted = []
    for k in kinds:
        if k in ORT_KINDS:
            wanted.append((k, "", ""))
        elif k == "torch":
            wanted += [(k, s, "") for s in dict.fromkeys(blas_settings)]
        else:
            wanted += [(k, s, v) for s in dict.fromkeys(blas_settings) for v in ["", *a.variant]]

    t_start = time.time()
    load0 = os.getloadavg()
    print(
        f"{cpu_name()}, {os.cpu_count()} CPUs; {versions()}; load average at start {load0[0]:.2f} "
        f"(1 min), {load0[1]:.2f} (5 min)"
    )
    peaks = {}
    for s in dict.fromkeys(blas_settings):
        peaks[s] = gemm_peak(s, a.quick)
        print(
            f"numpy float32 GEMM {peaks[s]['n']}²: {peaks[s]['gflops']:.0f} GFLOP/s "
            f"(OPENBLAS_CORETYPE={s or 'unset'}: {peaks[s].get('kernels', '?')} kernels, "
            f"{peaks[s].get('threads', '?')} threads)"
        )
    peak = max(v["gflops"] for v in peaks.values())
    rows: list[Row] = []
    notes: list[str] = []
    probes = [GemmProbe(s, a.quick) for s in peaks]
    try:
        with tempfile.TemporaryDirectory(prefix="onnxtrain-bench-") as tmp:
            for case in cases:
                r, n = run_case(case, os.path.join(tmp, case.key), wanted, a, probes)
                rows += r
                notes += n
                print()
                print(table(r, markdown=False, peak=peak))
                sys.stdout.flush()
    finally:
        for probe in probes:
            probe.close()
    # a second GEMM measurement: the machine may have been busier at the start
    for s in peaks:
        again = gemm_peak(s, a.quick)["gflops"]
        peaks[s]["gflops_end"] = again
    for probe in probes:
        peaks[probe.coretype]["gflops_rounds"] = probe.best
    peak_end = max(v["gflops_end"] for v in peaks.values())
    peak_rounds = max(v.get("gflops_rounds", 0.0) for v in peaks.values())
    peak = max(peak, peak_end, peak_rounds)  # a peak: the best figure the machine gave
    packages = packages_note()
    if packages:
        notes.append(packages)
    load1 = os.getloadavg()
    print()
    for n in notes:
        print(n)
    load_line = (
        f"load average {load0[0]:.2f} at start, {load1[0]:.2f} at end (1 min; {os.cpu_count()} CPUs: "
        "the machine is shared, so figures are medians of interleaved rounds)"
    )
    print(load_line)
    print(
        f"GEMM peak used for '% GEMM peak': {peak:.0f} GFLOP/s, the best of the measurements at the start, "
        f"in the rounds ({peak_rounds:.0f}) and at the end ({peak_end:.0f}); the tables above used the start "
        "figure"
    )
    if len(cases) > 1:
        print()
        print(table(rows, markdown=False, peak=peak))
    results = a.results or ("" if a.quick else os.path.join(HERE, "RESULTS.md"))
    if results:
        cmd = "python -m bench " + " ".join(
            shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
        )
        write_results(results, cmd.strip(), rows, notes, peaks, peak, load_line, time.time() - t_start)
        print(f"results written to {results}")
    return 0


def ab_lines(rows: list[Row]) -> list[str]:
    """Per model and variant: samples/s of each variant row over its counterpart (same peer and BLAS
    setting; the counterpart of "a-b" is "a", of "a" the default)."""
    out = []
    cases = list(dict.fromkeys(r.case for r in rows))
    labels = list(dict.fromkeys(r.variant for r in rows if r.variant))
    for label in labels:
        base = label.rsplit("-", 1)[0] if "-" in label else ""
        parts = []
        for case in cases:
            ratios = []
            for r in rows:
                if r.case != case or r.variant != label:
                    continue
                twin = next(
                    (
                        t
                        for t in rows
                        if t.case == case and t.kind == r.kind and t.blas == r.blas and t.variant == base
                    ),
                    None,
                )
                if twin is not None:
                    ratios.append(
                        f"{LABELS[r.kind].split()[-1]} [{r.blas}] {twin.samples_s / r.samples_s:.2f}"
                    )
            if ratios:
                parts.append(f"{case}: " + ", ".join(ratios))
        out.append(
            f"- `{base or 'default'}` over `{label}` (samples/s ratio, > 1: `{base or 'default'}` is "
            "faster): " + "; ".join(parts)
        )
    return out


def write_results(
    path: str,
    cmd: str,
    rows: list[Row],
    notes: list[str],
    peaks: dict,
    peak: float,
    load_line: str,
    seconds: float,
) -> None:
    lines = [
        "# Benchmark results",
        "",
        f"Made by `{cmd}` on {time.strftime('%Y-%m-%d %H:%M %Z')} ({seconds / 60:.0f} min), "
        f"{cpu_name()}, {os.cpu_count()} CPUs; {versions()}.",
        "",
        "Training step = forward + backward + AdamW update, lr 1e-3, weight decay 0.01, eps 1e-8, "
        "no clipping (onnxruntime-training and onnxtrain: the Hugging Face form of `generate_artifacts`; "
        "torch eager: torch's `AdamW`"
        + ("; onnxruntime-training 1.16.3's `TrainingSession`: its `AdamOptimizer` with `weight_decay_mode` "
           "1, the legacy session's parameters" if any(r.kind in ("ortleg", "ortleg-default") for r in rows)
           else "")
        + "). "
        "Each peer runs in its own process; figures are medians of interleaved rounds after warm-up. "
        "`× ORT-T`: samples/s relative to onnxruntime-training 1.19.2's on-device API; `× torch`: relative "
        "to "
        "torch eager under the same BLAS setting; `% GEMM peak`: step FLOPs (bench/flops.py) / step time / "
        f"{peak:.0f} GFLOP/s (the best numpy GEMM rate of the run: at its start, in its rounds, at its end). "
        "Peak RSS is the whole process (interpreter, imports, model, training); plan "
        "peak is onnxtrain's `Plan.peak_bytes` of its largest plan: what that plan holds, without the state "
        "kept outside it (a `Module`'s moments, its weights after their last use), so it is not comparable "
        "between the legacy session (one graph with the update) and the `Module` (bench/run.py's docstring). "
        "onnxruntime's idle threads "
        + ("spin before they sleep (its default)" if os.environ.get(ORT_SPIN_ENV, "1") != "0"
           else "do not spin (`--ort-spin off`)")
        + ", in onnxruntime-training and in onnxtrain's onnxruntime backend alike.",
        "",
        "numpy float32 GEMM: "
        + "; ".join(
            f"OPENBLAS_CORETYPE={s or 'unset'} → {v['gflops']:.0f} GFLOP/s (best in the rounds "
            f"{v.get('gflops_rounds', 0.0):.0f}, {v['gflops_end']:.0f} at the end)"
            for s, v in peaks.items()
        )
        + ".",
        "",
        load_line + ".",
        "",
        table([r for r in rows if not r.variant], markdown=True, peak=peak),
        "",
        *[f"- {n}" for n in notes],
        "",
        *(
            ["## A/B variants (same run)", "", *ab_lines(rows), "", table(rows, markdown=True, peak=peak)]
            if any(r.variant for r in rows)
            else []
        ),
        "",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())

"""The real ``onnxtrain train`` process: Ctrl-C while its modules load (numpy, onnx: C extensions whose import
a KeyboardInterrupt breaks) exits 130 with one line; with stderr not a terminal the progress bar writes a
few lines, not ten redraws a second."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.tiers import full
from tests.train.conftest import REPO, config_path

# the console script `onnxtrain` (from onnxtrain.cli import main; sys.exit(main())) with a line on stdout
# once the CLI module is imported: a Ctrl-C before that lands in the interpreter's own start-up, which is
# Python's, not onnxtrain's
_ENTRY = r"""
import sys
from onnxtrain.cli import main
print("ready", flush=True)
sys.argv[0] = "onnxtrain"
sys.exit(main())
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    env.update(PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""), OPENBLAS_NUM_THREADS="1")
    env.pop("ONNXTRAIN_DEBUG", None)
    return env


def _interrupt_after(delay: float, out: str) -> tuple[int, str]:
    """Start ``onnxtrain train``, send SIGINT ``delay`` s after the CLI module is imported; (exit code,
    stderr). The run is long enough (4,400 steps) that the last delays still find it training: the bundled
    660 steps take 0.3 s on a fast host, and a Ctrl-C after them is no interruption."""
    argv = [sys.executable, "-c", _ENTRY, "train", config_path("digits_mlp"), "--output-dir", out, "-q",
            "--set", "training.epochs=null", "--set", "training.steps=4400"]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="SIGINT cannot be held off here")
def test_ctrl_c_while_the_modules_load_exits_130_with_one_line(tmp_path):
    delays = [0.0, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.07, 0.09, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5]
    if not full():  # the default suite every other delay, the whole range still (tests/tiers.py)
        delays = delays[::2]
    bad = []
    for i, delay in enumerate(delays):
        for attempt in range(3):
            code, err = _interrupt_after(delay, str(tmp_path / f"run{i}_{attempt}"))
            if not _in_the_entry_script(err):
                break
        lines = err.strip().splitlines()
        if code != 130 or len(lines) != 1 or "interrupted" not in lines[0]:
            bad.append((delay, code, err.strip()[-300:]))
    assert not bad, bad


def _in_the_entry_script(err: str) -> bool:
    """The SIGINT landed in this test's entry script, after its "ready" line and before ``main()`` began
    (a few bytecodes, hit once at delay 0 in a full run): the harness's lines, not onnxtrain's; sent again."""
    frames = re.findall(r'File "([^"]+)"', err)
    return err.rstrip().endswith("KeyboardInterrupt") and frames == ["<string>"]


# ---- the progress bar on a stderr that is not a terminal ----

def test_progress_to_a_file_is_a_few_lines(tmp_path):
    """A run of seconds with stderr in a file: the bar's output stays a few lines, the per-eval lines
    and the final summary are all there (stdout)."""
    out = tmp_path / "run"
    err_path = tmp_path / "stderr.txt"
    argv = [sys.executable, "-m", "onnxtrain", "train", config_path("digits_mlp"), "--output-dir", str(out),
            "--set", "training.epochs=null", "--set", "training.steps=4400",
            "--set", "training.eval_every=1100", "--set", "output.plot=false"]
    start = time.monotonic()
    with open(err_path, "w") as err:
        proc = subprocess.run(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=err, text=True,
                              timeout=300)
    seconds = time.monotonic() - start
    text = err_path.read_text()
    assert proc.returncode == 0, text
    # tqdm's redraws are separated by carriage returns: each is one line of progress in the file
    updates = [u for u in re.split(r"[\r\n]+", text) if u.strip()]
    assert len(updates) <= 4 + seconds / 5, (seconds, updates)
    assert "4400/4400" in updates[-1]  # the bar's last state is written
    assert len(text) < 2000, text
    lines = proc.stdout.splitlines()
    assert [ln.split(":")[0] for ln in lines[:4]] == ["step 1100", "step 2200", "step 3300", "step 4400"]
    assert lines[4].startswith("trained digits_mlp for 4400 steps: eval_loss ")
    assert lines[5].startswith("outputs in ")


@pytest.mark.parametrize("every, shown", [(0.0, [1, 2, 3, 4, 5, 6, 6]), (3600.0, [6])])
def test_progress_lines_come_every_interval_and_at_the_end(monkeypatch, capsys, tmp_path, every, shown):
    """A line at each step when the interval is 0, else one at the end with the last logged loss."""
    from onnxtrain.train import Trainer, load_config, progress

    monkeypatch.setattr(progress, "LOG_PROGRESS_EVERY", every)
    cfg = load_config(config_path("digits_mlp"), ["training.epochs=null", "training.steps=6",
                                                  "output.plot=false", "output.export=false"])
    Trainer(cfg, str(tmp_path / "run"), progress=True).run()
    err = capsys.readouterr().err.splitlines()
    assert [ln.split("|")[2].split()[0] for ln in err] == [f"{s}/6" for s in shown]
    assert "loss=" in err[-1]


def test_ctrl_c_just_before_sigint_is_held_is_one_line_too(monkeypatch, capsys):
    """A Ctrl-C landing in main before SIGINT is blocked (seen once in CI: at the construction of the
    holder, right after the CLI module loaded) exits 130 with one line, not a traceback."""
    from onnxtrain import cli

    def interrupted(self) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli._SigintHeld, "__init__", interrupted)
    assert cli.main(["info", "x.onnx"]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "onnxtrain: interrupted"


# the console script with an exit-time callback registered before main() runs, as the modules it imports
# register theirs: it stands for the interpreter's teardown after the command is done (about 0.1 s of it)
_TEARDOWN_ENTRY = r"""
import atexit, sys, time
atexit.register(lambda: (print("teardown", flush=True), time.sleep(1)))
from onnxtrain.cli import main
sys.argv[0] = "onnxtrain"
sys.exit(main())
"""


@pytest.mark.skipif(not hasattr(signal, "pthread_sigmask"), reason="POSIX signals")
def test_ctrl_c_once_the_command_is_done_keeps_its_exit_code(tmp_path):
    """A Ctrl-C after the run's summary, while Python tears the interpreter down: it raised in exit-time
    code (a traceback) or, once Python had put SIGINT's default action back, killed the finished run (exit
    status -2 instead of 0)."""
    argv = [sys.executable, "-c", _TEARDOWN_ENTRY, "train", config_path("digits_mlp"), "-q", "--output-dir",
            str(tmp_path / "run"), "--set", "training.steps=2"]
    proc = subprocess.Popen(argv, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line == "teardown\n":
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert lines[-1] == "teardown\n" and lines[0].startswith("trained digits_mlp for 2 steps"), lines
    assert proc.returncode == 0 and err == "", (proc.returncode, err)
    assert os.path.isfile(tmp_path / "run" / "model.onnx")

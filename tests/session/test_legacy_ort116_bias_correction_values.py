"""``do_bias_correction`` in ``optimizer_int_attributes_map`` is a switch, 0 or 1. onnxruntime-training
1.16.3's AdamOptimizer kernel refuses any other value when the session is made ("do_bias_correction must be
either 0 or 1"), as it refuses a ``weight_decay_mode`` other than 0 or 1; onnxtrain refused the latter but
took 2 or -1 as "on" without a word. The two valid values train as 1.16.3 does.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tests.session.legacy_peer import Case, Step
from tests.session.test_legacy_ort116_numerics import LRS, MLP_WEIGHTS, mlp, mlp_feeds, params

VALUES = (2, -1, 0, 1)


@pytest.fixture(scope="module")
def traces():
    from tests.session.legacy_peer import run_cases

    steps = [Step(f) for f in mlp_feeds(3, LRS)]
    cases = [Case(mlp(), params("AdamOptimizer", ints=dict.fromkeys(MLP_WEIGHTS, {"do_bias_correction": v})),
                  steps, ours={"legacy_cpu_adam": True}) for v in VALUES]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(cases)
    return dict(zip(VALUES, zip(peer, ours)))


@pytest.mark.parametrize("value", [2, -1])
def test_a_value_other_than_0_or_1_is_refused_as_116_refuses_it(traces, value: int) -> None:
    peer, ours = traces[value]
    assert peer.error is not None and "do_bias_correction must be either 0 or 1" in peer.error, peer.error
    assert ours.error is not None, f"onnxtrain trained with do_bias_correction={value}"
    # (a FailValueError and 1.16.3's RuntimeException: test_legacy_ort116_review checks the classes)
    assert ours.error.startswith("SwitchRefused"), ours.error
    assert "['do_bias_correction'] must be 0 or 1" in ours.error and f"got {value}" in ours.error, ours.error


@pytest.mark.parametrize("value", [0, 1])
def test_0_and_1_train_as_116_does(traces, value: int) -> None:
    peer, ours = traces[value]
    assert peer.error is None and ours.error is None, (peer.error, ours.error)
    for k in range(len(peer.state)):
        for n, v in peer.state[k].items():
            np.testing.assert_allclose(ours.state[k][n], v, rtol=2e-5, atol=2e-6, err_msg=f"step {k} {n}")


def test_lamb_refuses_it_too() -> None:
    """Lamb reads the same switch (one for all weights; 1.16.3's CPU build has no Lamb kernel to ask)."""
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    for k, v in params("LambOptimizer", ints=dict.fromkeys(MLP_WEIGHTS, {"do_bias_correction": 3})).items():
        setattr(p, k, v)
    with pytest.raises(ValueError, match=r"\['do_bias_correction'\] must be 0 or 1, got 3"):
        onnxtrain.TrainingSession(mlp().SerializeToString(), p)


def test_pipeline_and_horizontal_sessions_refuse_it_too() -> None:
    """The sessions that cut the model (pipeline stages, horizontal shards over mpiexec -n 2) check their
    maps apart from the single-process session: a value of 2 is refused there too, naming the weight, and
    1 is taken (the control)."""
    import json
    import os
    import shutil

    from tests.parallel.conftest import run_mpi

    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bias_correction_cut_worker.py")
    r = run_mpi(n=2, worker=worker)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    for mode in ("pipeline", "horizontal"):
        assert got[f"{mode} 1"] is None, (mode, got[f"{mode} 1"])
        refused = got[f"{mode} 2"]
        assert refused is not None, f"the {mode} session took do_bias_correction=2"
        assert "['do_bias_correction'] must be 0 or 1, got 2" in refused, refused
        assert any(f"optimizer_int_attributes_map[{w!r}]" in refused for w in ("W", "G")), refused

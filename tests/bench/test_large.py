"""bench.large: every peer trains the same small model (the on-device peers to the same losses: one AdamW
graph on the numpy engine, on the onnxruntime backend and in onnxruntime-training; the legacy session to the
same loss on both backends), and the table has a row of figures for each peer."""

from __future__ import annotations

import pytest

from bench import large
from tests.ortt import ensure_ortt

ARGS = large.argparse.Namespace(size=64, layers=2, steps=3)


def _figures(r: dict) -> None:
    assert "skipped" not in r, r
    assert r["peak"] >= r["held"] >= 0 and r["build_peak"] >= r["built"] >= 0


def test_onnxtrains_peers_run_and_its_backends_agree(tmp_path, capsys, monkeypatch) -> None:
    rows = {peer: large._run_peer(peer, ARGS, str(tmp_path)) for peer in large.PEERS if "onnxtrain" in peer}
    for r in rows.values():
        _figures(r)
    assert rows["onnxtrain-backend"]["loss"] == pytest.approx(rows["onnxtrain"]["loss"], rel=1e-5)
    legacy = rows["onnxtrain-legacy"]["loss"]
    assert rows["onnxtrain-legacy-backend"]["loss"] == pytest.approx(legacy, rel=1e-5)
    assert all(r["step_ms"] > 0 for r in rows.values())
    monkeypatch.setattr(large, "ORTT_PYTHON", str(tmp_path / "no-such-python"))
    assert large.main(["--size", "32", "--layers", "1", "--steps", "1"]) == 0
    table = capsys.readouterr().out
    assert all(f"| {peer} |" in table for peer in large.PEERS)
    assert "| onnxruntime-training | skipped: no onnxruntime-training environment" in table


def test_onnxruntime_training_trains_to_the_same_loss(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(large, "ORTT_PYTHON", ensure_ortt())
    theirs = large._run_peer("onnxruntime-training", ARGS, str(tmp_path))
    ours = large._run_peer("onnxtrain", ARGS, str(tmp_path))
    _figures(theirs)
    assert theirs["loss"] == pytest.approx(ours["loss"], rel=1e-5)

"""Writers saving one checkpoint path at once (threads here, the ranks of a job alike): every save succeeds
and the file holds one writer's whole checkpoint. A commit's clean-up of killed writes' temporaries took
another writer's temporary before it was locked, and a side file another commit had just removed failed the
next one's removal or backup."""

from __future__ import annotations

import os
import threading
import traceback

import numpy as np

from onnxtrain.checkpoint import format as fmt


def test_concurrent_saves_of_one_path(tmp_path) -> None:
    path = str(tmp_path / "c.ckpt")

    def checkpoint(v: int) -> fmt.Checkpoint:
        weights = {f"w{i}": np.full((64, 64), v, np.float32) for i in range(3)}
        return fmt.Checkpoint(weights, {}, [], {"tag": v})

    errors: list[str] = []

    def saver(v: int) -> None:
        external = v % 2 == 0  # half the writers with a .data side file, half without (removing it)
        for _ in range(25):
            try:
                fmt.save_checkpoint(checkpoint(v), path, external_threshold=0 if external else 1 << 40)
            except Exception:  # noqa: BLE001 - collected for the assertion
                errors.append(traceback.format_exc())

    threads = [threading.Thread(target=saver, args=(v,)) for v in (1, 2, 3, 4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[0]
    got = fmt.load_checkpoint(path)
    v = got.properties["tag"]
    for i in range(3):
        np.testing.assert_array_equal(got.trainable[f"w{i}"], np.full((64, 64), v, np.float32))
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".tmp", ".new"))]

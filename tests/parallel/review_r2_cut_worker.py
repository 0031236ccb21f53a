"""Run under ``mpiexec -n 2``: review R2's checks of the cut sessions (pipeline stages, a horizontal split)
for what one process's legacy session refuses or warns of. ``python review_r2_cut_worker.py OUT CASE`` (CASE a
case of ``pipeline_worker.CASES`` of two ranks) writes ``OUT.<rank>.json``: per check, the error (class and
message) the session's construction raised, or None, and the warnings it gave.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from onnxtrain import SessionOptions, TrainingSession  # noqa: E402
from onnxtrain.parallel import world  # noqa: E402
from tests.parallel import pipeline_worker as pw  # noqa: E402


def _checks(case: str) -> dict:
    """name → (changes to the case's TrainingParameters, session config entries, run one step)."""
    model = pw.CASES[case][0]()
    weights = [t.name for t in model.graph.initializer if t.dims]
    clip = {w: {"max_norm_clip": 0.5} for w in weights}
    return {
        # the loss scale input taken as the learning rate too (mixed precision)
        "lr_is_loss_scale": ({"use_mixed_precision": True, "lr_params_feed_name": "loss_scale",
                              "training_optimizer_name": "SGDOptimizer"}, {}, True),
        "lr_named_otherwise": ({"use_mixed_precision": True, "lr_params_feed_name": "lr",
                                "training_optimizer_name": "SGDOptimizer"}, {}, True),
        # max_norm_clip given, and nothing clips by it
        "clip_without_norm_clip": ({"training_optimizer_name": "AdamOptimizer",
                                    "enable_grad_norm_clip": False, "optimizer_attributes_map": clip}, {},
                                   False),
        "clip_under_cpu_adam": ({"training_optimizer_name": "AdamOptimizer", "enable_grad_norm_clip": True,
                                 "legacy_cpu_adam": True, "optimizer_attributes_map": clip}, {}, False),
        "clip_used": ({"training_optimizer_name": "AdamOptimizer", "enable_grad_norm_clip": True,
                       "optimizer_attributes_map": clip}, {}, False),
        # session config entries the numpy engine cannot honour (as one process's session: d4e8aa4b)
        "denormal_as_zero": ({}, {"session.set_denormal_as_zero": "1"}, False),
        "no_cpu_fallback": ({}, {"session.disable_cpu_ep_fallback": "1"}, False),
    }


def main(out: str, case: str) -> None:
    rank = world().rank
    results = {}
    for name, (changes, entries, step) in _checks(case).items():
        model = pw.CASES[case][0]()
        p = pw.parameters(case, model, True)
        for k, v in changes.items():
            setattr(p, k, v)
        p.optimizer_attributes_map = changes.get("optimizer_attributes_map", {})
        so = SessionOptions()
        for k, v in entries.items():
            so.add_session_config_entry(k, v)
        error, change = None, None
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                sess = TrainingSession(model.SerializeToString(), p, so)
                if step:  # one SGD step at learning rate 0.05 under loss scale 256
                    before = {k: v.astype(np.float64) for k, v in sess.get_state().items()}
                    feeds = {**pw.case_feeds(case, 1)[0], "loss_scale": np.array([256.0], np.float32),
                             p.lr_params_feed_name: np.array([0.05], np.float32)}
                    sess.run(["loss"], feeds)
                    after = sess.get_state()
                    change = max(float(np.abs(after[k] - v).max()) for k, v in before.items()
                                 if k in after and v.dtype.kind == "f")
            except Exception as e:  # noqa: BLE001 - the result checked
                error = f"{type(e).__name__}: {e}"
        results[name] = {"error": error, "change": change,
                         "warnings": [str(w.message) for w in caught]}
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

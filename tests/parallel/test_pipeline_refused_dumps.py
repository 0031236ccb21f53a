"""A pipeline session refused for its optimizer maps or its initial optimizer state writes no file: its stage
dumps (model_after_graph_transforms_path, model_with_gradient_graph_path, model_with_training_graph_path and
SessionOptions.optimized_model_filepath, each as ``<root>.stage<k>.onnx``) come after both are checked, as one
process's session writes its dumps only once they are (TrainingSession._build). A map entry or an initial
state at fault for a weight of one stage refuses the session on every rank, as one process refuses the whole
model: a rank that took it would go on to run alone. (onnxruntime-training 1.16.3 itself wrote its gradient
dump before refusing a missing map entry, and both dumps before refusing a do_bias_correction of 2:
onnxtrain's sessions check first.)"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "refused_dumps_worker.py")

# case → what each rank's refusal names
REFUSED = {
    "bias_correction_2": ["SwitchRefused", "['do_bias_correction'] must be 0 or 1, got 2",
                          "optimizer_int_attributes_map["],
    "bias_correction_2_on_stage_1s_weight": ["SwitchRefused", "optimizer_int_attributes_map['G']",
                                             "must be 0 or 1, got -1"],
    "no_entry_for_stage_1s_weight": ["ValueError", "optimizer_attributes_map has no entry", "'G'"],
    "int_attribute_in_the_float_map": ["InvalidGraph", "'do_bias_correction' of weight 'W'",
                                       "optimizer_int_attributes_map"],
    "initial_state_key_unknown_for_stage_1s_weight": ["ValueError", "set_optimizer_initial_state",
                                                      "'Moment_3'", "'G'"],
    "initial_state_of_another_shape_for_stage_1s_weight": ["ValueError", "Moment_1_G", "[12]", "[5]"],
    "initial_state_count_of_another_type_for_stage_0s_weight": ["TypeError", "Update_Count_W", "int64",
                                                                "int32"],
}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict:
    r = run_mpi(str(tmp_path_factory.mktemp("refused_dumps")), n=2, worker=WORKER, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.mpi
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_refused_pipeline_session_writes_no_dump(outcome: dict, case: str) -> None:
    got = outcome[case]
    for rank, refusal in enumerate(got["refusals"]):
        assert refusal is not None, f"{case}: rank {rank} made its session"
        for word in REFUSED[case]:
            assert word in refusal, f"{case}: rank {rank}: {word!r} not in {refusal!r}"
    assert got["files"] == [], f"{case}: a refused session wrote {got['files']}"


@pytest.mark.mpi
def test_the_control_writes_every_stages_dumps(outcome: dict) -> None:
    """The same maps without a fault: both ranks make their sessions, each writes its stage's four dumps."""
    for case in ("control", "initial_state_control"):
        assert outcome[case]["refusals"] == [None, None], (case, outcome[case]["refusals"])
        assert outcome[case]["files"] == outcome["control"]["files"], case
    got = outcome["control"]
    assert got["files"] == sorted(f"{root}.stage{k}.onnx" for root in ("gradient", "optimized", "training",
                                                                      "transformed") for k in (0, 1))

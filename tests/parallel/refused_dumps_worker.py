"""``mpiexec -n 2 python refused_dumps_worker.py FOLDER`` (run by test_pipeline_refused_dumps): for each case,
every rank makes a two-stage pipeline session (cut "a": W on stage 0, G on stage 1) of
test_legacy_ort116_unlisted_loss's model with its three model dumps and
SessionOptions.optimized_model_filepath asked for under FOLDER/<case>/, with the optimizer maps the case
gives; prints, on rank 0, one JSON line: per case, each rank's refusal ("Class: message", or null when the
session was made) and the files in the case's folder once every rank is done."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.session.test_legacy_ort116_unlisted_loss import _model  # noqa: E402

# case → (optimizer_attributes_map, optimizer_int_attributes_map) of Adam
CASES = {
    "bias_correction_2": ({"W": {}, "G": {}},
                          {"W": {"do_bias_correction": 2}, "G": {"do_bias_correction": 2}}),
    "bias_correction_2_on_stage_1s_weight": ({"W": {}, "G": {}}, {"W": {}, "G": {"do_bias_correction": -1}}),
    "no_entry_for_stage_1s_weight": ({"W": {}}, {"W": {}, "G": {}}),
    "int_attribute_in_the_float_map": ({"W": {"do_bias_correction": 1.0}, "G": {}}, {"W": {}, "G": {}}),
    "control": ({"W": {}, "G": {"lambda": 0.01}}, {"W": {"do_bias_correction": 0}, "G": {}}),
}
MAPS = ({"W": {}, "G": {}}, {"W": {}, "G": {}})
# case → set_optimizer_initial_state's argument (with MAPS), built on each rank (G has 12 values, W 12 × 12)
INITIAL = {
    "initial_state_key_unknown_for_stage_1s_weight": lambda np: {"G": {"Moment_3": np.zeros(12, np.float32)}},
    "initial_state_of_another_shape_for_stage_1s_weight": lambda np: {
        "G": {"Moment_1": np.zeros(5, np.float32)}},
    "initial_state_count_of_another_type_for_stage_0s_weight": lambda np: {
        "W": {"Update_Count": np.array([3], np.int32)}},
    "initial_state_control": lambda np: {"W": {"Update_Count": np.array([3], np.int64)},
                                         "G": {"Moment_1": np.ones(12, np.float32)}},
}


def attempt(folder: str, floats: dict, ints: dict, initial: dict | None = None) -> str | None:
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "AdamOptimizer"
    p.optimizer_attributes_map, p.optimizer_int_attributes_map = floats, ints
    p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, "a"
    if initial is not None:
        p.set_optimizer_initial_state(initial)
    p.model_after_graph_transforms_path = os.path.join(folder, "transformed.onnx")
    p.model_with_gradient_graph_path = os.path.join(folder, "gradient.onnx")
    p.model_with_training_graph_path = os.path.join(folder, "training.onnx")
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onnxtrain.TrainingSession(_model().SerializeToString(), p, so)
    except Exception as e:  # noqa: BLE001 (the class is part of the answer)
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    result = {}
    import numpy as np

    cases = {k: (*maps, None) for k, maps in CASES.items()}
    cases.update({k: (*MAPS, f(np)) for k, f in INITIAL.items()})
    for case, (floats, ints, initial) in cases.items():
        folder = os.path.join(sys.argv[1], case)
        if comm.rank == 0:
            os.makedirs(folder)
        comm.Barrier()
        refusals = comm.gather(attempt(folder, floats, ints, initial), root=0)
        comm.Barrier()  # (every rank's session made or refused before the folder is listed)
        if comm.rank == 0:
            result[case] = {"refusals": refusals, "files": sorted(os.listdir(folder))}
    if comm.rank == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()

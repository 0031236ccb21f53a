"""``mpiexec -n 2 python review_r5_stage_dumps_worker.py FOLDER`` (run by test_review_r5_stage_dump_producer):
every rank makes its stage of a two-stage pipeline session (cut "a") of test_legacy_ort116_unlisted_loss's
model, its producer set to "pytorch" 2.13.0, with the three model dumps and
SessionOptions.optimized_model_filepath under FOLDER; rank 0 prints one JSON line: each dump file's
[producer_name, producer_version]."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.session.test_legacy_ort116_unlisted_loss import _model  # noqa: E402


def main() -> None:
    import onnx
    from mpi4py import MPI

    import onnxtrain

    folder = sys.argv[1]
    p = onnxtrain.TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, "a"
    p.model_after_graph_transforms_path = os.path.join(folder, "transformed.onnx")
    p.model_with_gradient_graph_path = os.path.join(folder, "gradient.onnx")
    p.model_with_training_graph_path = os.path.join(folder, "training.onnx")
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = os.path.join(folder, "optimized.onnx")
    model = _model()
    model.producer_name, model.producer_version = "pytorch", "2.13.0"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onnxtrain.TrainingSession(model.SerializeToString(), p, so)
    comm = MPI.COMM_WORLD
    comm.Barrier()
    if comm.rank == 0:
        found = {}
        for name in sorted(os.listdir(folder)):
            m = onnx.load(os.path.join(folder, name), load_external_data=False)
            found[name] = [m.producer_name, m.producer_version]
        print(json.dumps(found))


if __name__ == "__main__":
    main()

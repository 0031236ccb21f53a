"""Module.get_contiguous_parameters() answers the OrtValue calls of scripts written for onnxruntime-training.

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) on artifacts it generates: what ``.shape()``,
``.data_type()``, ``.element_type()``, ``.device_name()``, ``.is_tensor()``, ``.has_value()`` and
``.numpy()`` give there. The numpy side keeps working: ``.shape`` is still the tuple.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx

from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp

_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
base, folder = json.loads(sys.argv[1])
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc2.weight", "fc2.bias"],
                             frozen_params=["fc1.weight", "fc1.bias"], loss=artifacts.LossType.MSELoss,
                             artifact_directory=folder)
""" + r"""
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
m = Module(folder + "/training_model.onnx", state)
out = {}
for trainable_only in (False, True):
    b = m.get_contiguous_parameters(trainable_only)
    out[str(trainable_only)] = [b.shape(), b.data_type(), b.element_type(), b.device_name(), b.is_tensor(),
                                b.has_value(), b.numpy().tolist()]
print(json.dumps(out))
"""


def test_contiguous_buffer_answers_ortvalue_calls(tmp_path):
    python = ensure_ortt()
    base = str(tmp_path / "mlp.onnx")
    onnx.save(small_mlp(), base)
    folder = str(tmp_path / "art")
    os.makedirs(folder)
    ref = run_script(_ORT_SCRIPT, json.dumps([base, folder]), python=python)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = Module(os.path.join(folder, "training_model.onnx"), state)
    for trainable_only in (False, True):
        b = m.get_contiguous_parameters(trainable_only)
        shape, data_type, element_type, device, is_tensor, has_value, values = ref[str(trainable_only)]
        assert b.shape() == shape
        assert b.data_type() == data_type
        assert b.element_type() == element_type
        assert b.device_name().lower() == device.lower()
        assert b.is_tensor() is is_tensor and b.has_value() is has_value
        np.testing.assert_array_equal(b.numpy(), np.array(values, np.float32))
        # what numpy code did with it keeps working
        assert b.shape == (len(values),) and isinstance(b.shape, tuple)
        assert b.reshape(1, -1).shape == (1, len(values))
        assert type(b.numpy()) is np.ndarray
        assert b.data_ptr() == b.numpy().ctypes.data
        np.testing.assert_allclose(b * 2, np.array(values, np.float32) * 2)
    b = m.get_contiguous_parameters()
    m.copy_buffer_to_parameters(b * 0, trainable_only=False)
    assert not state.parameters["fc1.weight"].data.any()

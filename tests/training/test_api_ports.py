"""What scripts written for onnxruntime-training's on-device API do that onnxtrain must take too (from
onnxruntime's own tests, orttraining_test_ort_apis_py_bindings.py and _onnxblock.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxtrain.training.onnxblock as onnxblock
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module


class _CastLinear(onnxblock.ForwardBlock):
    """Strings cast to floats, then a linear layer (onnxruntime's test_string_inputs model)."""

    def __init__(self) -> None:
        super().__init__()
        self.cast = onnxblock.blocks.Cast(to=onnx.TensorProto.FLOAT)
        self.linear = onnxblock.blocks.Linear(4, 2)

    def build(self, x: str) -> str:
        return self.linear(self.cast(x))


def _string_model() -> onnx.ModelProto:
    """:class:`_CastLinear` over a STRING input [1, 4]."""
    block = _CastLinear()
    with onnxblock.empty_base() as acc:
        acc.model.graph.input.extend([onnx.helper.make_tensor_value_info("input", onnx.TensorProto.STRING,
                                                                         [1, 4])])
        block("input")
    return block.to_model_proto()


def test_numpy_string_arrays_feed_a_string_input(tmp_path) -> None:
    """A ``dtype=str`` array for a STRING input (onnxruntime takes it) gives the loss of the same strings
    as Python objects; it was refused ("unexpected data type. Actual: <U3, expected: object")."""
    model = _string_model()
    artifacts.generate_artifacts(model, optimizer=artifacts.OptimType.AdamW,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 requires_grad=[p.name for p in model.graph.initializer],
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    labels = np.zeros(1, np.int64)
    words = [["1.0", "2.0", "3.0", "4.0"]]
    as_objects = module(np.array(words, dtype=object), labels)
    as_str = module(np.array(words, dtype=str), labels)
    assert np.isfinite(as_objects) and as_str == as_objects
    module.eval()
    assert module(np.array(words, dtype=str), labels) == module(np.array(words, dtype=object), labels)


def test_api_errors_are_runtime_errors_as_onnxruntimes(tmp_path) -> None:
    """onnxruntime-training raised a RuntimeError for each of these (its C++ status); onnxtrain's are that
    (onnxruntime's class of the kind) and the Python class the spec names (ValueError, TypeError,
    FileNotFoundError), so ``except RuntimeError`` in a ported script and ``except ValueError`` both work."""
    import pytest

    from onnxtrain.capi import _pybind_state as C

    model = _string_model()
    trained = [p.name for p in model.graph.initializer]
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, requires_grad=trained,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    name = trained[0]
    shape = state.parameters[name].data.shape
    cases = [
        (lambda: setattr(state.parameters[name], "data", np.zeros((7,), np.float32)), C.Fail, ValueError),
        (lambda: setattr(state.parameters[name], "data", np.zeros(shape, np.float64)), C.Fail, TypeError),
        (lambda: state.parameters.__setitem__(name, np.zeros((7,), np.float32)), C.Fail, ValueError),
        (lambda: CheckpointState.load_checkpoint(tmp_path / "nope"), C.NoSuchFile, FileNotFoundError),
        (lambda: CheckpointState.save_checkpoint(state, tmp_path / "no" / "ckpt"), C.NoSuchFile,
         FileNotFoundError),
        (lambda: Module(str(tmp_path / "nope.onnx"), state), C.NoSuchFile, FileNotFoundError),
    ]
    for call, ort_class, py_class in cases:
        with pytest.raises(ort_class) as e:
            call()
        assert isinstance(e.value, py_class) and isinstance(e.value, RuntimeError), e.value


def test_clip_grad_norm_over_a_tensor_sequence_says_what_to_pass() -> None:
    """onnxruntime's blocks took the gradients as one tensor sequence; onnxtrain's take them as tensors:
    a sequence input is refused naming it and the form to use (it failed inside ReduceSumSquare)."""
    import pytest

    from onnxtrain.training.onnxblock import BlockError

    base = onnx.ModelProto()
    base.ir_version = 10
    base.graph.name = "ClipGradNorm Model"
    base.opset_import.extend([onnx.helper.make_opsetid("", 17)])
    base.graph.input.append(onnx.helper.make_tensor_sequence_value_info("gradients", onnx.TensorProto.FLOAT,
                                                                        None))

    class Clip(onnxblock.ForwardBlock):
        def __init__(self) -> None:
            super().__init__()
            self.clip = onnxblock.optim.ClipGradNorm(2.5)

        def build(self, g: str) -> str:
            return self.clip(g)

    with pytest.raises(BlockError, match=r"ClipGradNorm: 'gradients' is a tensor sequence; .* take the "
                                         r"gradients as separate tensors"), onnxblock.base(base):
        Clip()("gradients")


def test_clip_grad_norm_of_mixed_float_types_is_computed_in_float64() -> None:
    """One rule for the global norm in the on-device blocks and the legacy session: float64 when a gradient
    is float64 (the blocks used float32 unless all were). The clipped float64 gradient equals numpy's
    float64 result to float64 precision (onnx.reference runs the block's graph)."""
    from onnx.reference import ReferenceEvaluator

    base = onnx.ModelProto()
    base.ir_version = 10
    base.opset_import.extend([onnx.helper.make_opsetid("", 17)])
    base.graph.name = "clip"
    base.graph.input.extend([onnx.helper.make_tensor_value_info("g32", onnx.TensorProto.FLOAT, [1]),
                             onnx.helper.make_tensor_value_info("g64", onnx.TensorProto.DOUBLE, [2])])

    class Clip(onnxblock.ForwardBlock):
        def __init__(self) -> None:
            super().__init__()
            self.clip = onnxblock.optim.ClipGradNorm(0.05)

        def build(self, a: str, b: str) -> tuple[str, ...]:
            return self.clip(a, b)

    block = Clip()
    with onnxblock.base(base):
        outs = block("g32", "g64")
    model = block.to_model_proto()
    del model.graph.output[:]
    model.graph.output.extend([onnx.helper.make_empty_tensor_value_info(n) for n in outs])
    g32, g64 = np.array([0.3], np.float32), np.array([0.1, 0.2])
    c32, c64 = ReferenceEvaluator(model).run(None, {"g32": g32, "g64": g64})
    part32 = np.float64((g32 * g32).sum(dtype=np.float32))  # each tensor's sum of squares in its own type
    norm = np.sqrt(part32 + (g64 ** 2).sum())
    want = g64 * min(0.05 / (norm + 1e-6), 1.0)
    np.testing.assert_allclose(c64, want, rtol=1e-15)
    assert c32.dtype == np.float32


def test_errors_made_onnxruntimes_keep_their_details_and_subclasses(tmp_path) -> None:
    """A missing checkpoint's error keeps the OSError details (``[Errno 2] ...: 'path'``, errno, filename);
    a ValueError subclass of onnxtrain's own (a training model's op without translation) keeps its class."""
    import errno

    import pytest

    from onnxtrain.training.ort_artifacts.common import TranslationError

    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as e:
        CheckpointState.load_checkpoint(missing)
    assert e.value.errno == errno.ENOENT and e.value.filename == str(missing)
    assert str(e.value).startswith("[Errno 2] ") and str(missing) in str(e.value)
    h, f = onnx.helper, onnx.TensorProto.FLOAT
    fused = h.make_node("SomeFusion", ["x"], ["y"], domain="com.microsoft")
    model = h.make_model(h.make_graph([fused], "g", [h.make_tensor_value_info("x", f, [2])],
                                      [h.make_tensor_value_info("y", f, [2])]),
                         opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    onnx.save(model, tmp_path / "fused.onnx")
    state = CheckpointState.__new__(CheckpointState)  # the translation comes first: no state is read
    with pytest.raises(TranslationError, match="SomeFusion"):
        Module(str(tmp_path / "fused.onnx"), state)


def test_a_parameter_the_checkpoint_freezes_stays_frozen_through_the_optimizer(tmp_path) -> None:
    """Artifacts that train W and b, a checkpoint that freezes b: the Module warns and drops b's gradient,
    and the Optimizer (which refused the optimizer model's b before) steps W exactly as the artifacts that
    train W alone do, and leaves b as it was."""
    import warnings

    from onnx import numpy_helper

    from onnxtrain.training.api import Optimizer

    rng = np.random.default_rng(0)
    w, b = rng.standard_normal((4, 3)).astype(np.float32), rng.standard_normal(3).astype(np.float32)
    h = onnx.helper
    nodes = [h.make_node("MatMul", ["x", "W"], ["xw"]), h.make_node("Add", ["xw", "b"], ["y"])]
    g = h.make_graph(nodes, "lin",
                     [h.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 4])],
                     [h.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 3])],
                     [numpy_helper.from_array(w, "W"), numpy_helper.from_array(b, "b")])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)])
    x, target = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    steps = {}
    for label, trained in (("both", ["W", "b"]), ("W only", ["W"])):
        out = tmp_path / label.replace(" ", "_")
        out.mkdir()
        artifacts.generate_artifacts(model, requires_grad=trained, loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.AdamW, artifact_directory=out)
        if label == "both":  # the checkpoint freezes b
            onnxblock.save_checkpoint(([numpy_helper.from_array(w, "W")], [numpy_helper.from_array(b, "b")]),
                                      out / "checkpoint")
        state = CheckpointState.load_checkpoint(out / "checkpoint")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = Module(str(out / "training_model.onnx"), state, str(out / "eval_model.onnx"))
        assert any("stay frozen" in str(c.message) for c in caught) == (label == "both")
        opt = Optimizer(str(out / "optimizer_model.onnx"), module)
        for _ in range(2):
            module(x, target)
            opt.step()
            module.lazy_reset_grad()
        steps[label] = state.parameters["W"].data.copy()
        if label == "both":
            np.testing.assert_array_equal(state.parameters["b"].data, b)  # frozen
    np.testing.assert_array_equal(steps["both"], steps["W only"])
    assert not np.array_equal(steps["both"], w)


def test_onnxblock_submodules_import_under_onnxruntime_trainings_names():
    """``onnxblock.model_accessor`` and ``onnxblock.onnxblock`` are modules there; ported imports of them
    find the same objects here."""
    from onnxtrain.training.onnxblock.model_accessor import ModelAccessor, base, custom_op_library, empty_base
    from onnxtrain.training.onnxblock.onnxblock import ForwardBlock, TrainingBlock

    assert (base, empty_base, custom_op_library) == (onnxblock.base, onnxblock.empty_base,
                                                     onnxblock.custom_op_library)
    assert (ForwardBlock, TrainingBlock) == (onnxblock.ForwardBlock, onnxblock.TrainingBlock)
    with empty_base() as acc:
        assert isinstance(acc, ModelAccessor) and not acc.has_path and acc.model.graph is not None


def test_artifacts_module_gives_onnxruntimes_converter_names():
    """onnxruntime-training's ``artifacts`` imports onnxruntime's ORT-format converter, and ported scripts
    may import ``OptimizationStyle`` and ``convert_onnx_models_to_ort`` from it: the same objects here."""
    tool = pytest.importorskip("onnxruntime.tools.convert_onnx_models_to_ort")
    from onnxtrain.training.artifacts import OptimizationStyle, convert_onnx_models_to_ort

    assert OptimizationStyle is tool.OptimizationStyle
    assert convert_onnx_models_to_ort is tool.convert_onnx_models_to_ort
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        artifacts.no_such_name  # noqa: B018


def test_onnxblock_submodules_are_attributes_of_the_package() -> None:
    """A custom loss copied from onnxruntime-training's blocks reaches ``onnxblock._graph_utils`` (and
    ``onnxblock.onnxblock``) through the package after ``from ... import onnxblock``, as
    onnxruntime-training's package allows: it was an AttributeError unless some other import had loaded them
    (a fresh process)."""
    import subprocess
    import sys

    script = ("from onnxtrain.training import onnxblock\n"
              "assert onnxblock._graph_utils.generate_graph_name('loss').startswith('onnx::loss::')\n"
              "assert onnxblock.onnxblock.TrainingBlock is onnxblock.TrainingBlock\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]

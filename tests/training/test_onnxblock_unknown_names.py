"""A block handed, or returning, a name that is no value of the model is refused with a LookupError naming
it, as onnxruntime-training 1.19.2 refuses it.

There, a ForwardBlock's or TrainingBlock's result is registered as graph outputs (``LookupError: The
provided name ... is not a graph value info or a graph output``), and the loss blocks and ``InputLike`` look
their input up among the graph's inputs and outputs (``LookupError``). A ported ``except LookupError``
must still catch these; onnxtrain's errors stay ``BlockError``s (RuntimeError, ValueError) too. Before,
onnxtrain raised a BlockError that was no LookupError, and for a TrainingBlock (or a custom loss block of
``generate_artifacts``) returning an unknown name, an onnx.checker failure of the eval model that did not
name it ("Field 'type' of 'value_info' is required but missing").

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) runs the same cases; the test checks that it raises a
LookupError in each, then that onnxtrain does too, naming the value.
"""

from __future__ import annotations

import os

import pytest

from onnxtrain.training import artifacts, onnxblock
from tests.ortt import PREAMBLE, run_script, small_mlp

# each case builds on small_mlp (output "output"); the name "zzz" is no value of it
CASES = r"""
from onnx import helper, numpy_helper
import numpy as np

def mlp():
    rng = np.random.default_rng(0)
    shapes = {"fc1.weight": (4, 8), "fc1.bias": (8,), "fc2.weight": (8, 3), "fc2.bias": (3,)}
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n) for n, s in shapes.items()]
    nodes = [helper.make_node("MatMul", ["input", "fc1.weight"], ["a"]),
             helper.make_node("Add", ["a", "fc1.bias"], ["b"]), helper.make_node("Relu", ["b"], ["c"]),
             helper.make_node("MatMul", ["c", "fc2.weight"], ["d"]),
             helper.make_node("Add", ["d", "fc2.bias"], ["output"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", 1, ["b", 4])],
                          [helper.make_tensor_value_info("output", 1, ["b", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m

def training(fn):
    class T(onnxblock.TrainingBlock):
        def build(self, o):
            return fn(o)
    block = T()
    block.requires_grad("fc1.weight")
    with onnxblock.base(mlp()):
        block("output")

def forward(fn):
    class F(onnxblock.ForwardBlock):
        def build(self, o):
            return fn(o)
    with onnxblock.base(mlp()):
        F()("output")

def custom_loss(fn, folder):
    class L(onnxblock.Block):
        def build(self, o):
            return fn(o)
    artifacts.generate_artifacts(mlp(), requires_grad=["fc1.weight"], loss=L(), artifact_directory=folder)

L = onnxblock.loss
CASES = {
    "training_block_returns_unknown_loss": lambda d: training(lambda o: "zzz"),
    "training_block_returns_unknown_extra": lambda d: training(lambda o: (L.MSELoss()(o), "zzz")),
    "forward_block_returns_unknown": lambda d: forward(lambda o: "zzz"),
    "custom_loss_returns_unknown": lambda d: custom_loss(lambda o: "zzz", d),
    "custom_loss_returns_unknown_extra": lambda d: custom_loss(lambda o: (L.L1Loss()(o), "zzz"), d),
    "mse_of_unknown": lambda d: forward(lambda o: L.MSELoss()("zzz")),
    "l1_of_unknown": lambda d: forward(lambda o: L.L1Loss()("zzz")),
    "bce_of_unknown": lambda d: forward(lambda o: L.BCEWithLogitsLoss()("zzz")),
    "cross_entropy_of_unknown": lambda d: forward(lambda o: L.CrossEntropyLoss()("zzz")),
    "input_like_unknown": lambda d: forward(lambda o: onnxblock.blocks.InputLike("zzz")("new_input")),
}
"""

_ORT_SCRIPT = PREAMBLE + r"""
import tempfile
from onnxruntime.training import artifacts, onnxblock
""" + CASES + r"""
out = {}
for name, case in CASES.items():
    try:
        case(tempfile.mkdtemp())
        out[name] = None
    except Exception as e:
        out[name] = [type(e).__name__, isinstance(e, LookupError), str(e)]
print(json.dumps(out))
"""

_namespace: dict = {"onnxblock": onnxblock, "artifacts": artifacts}
exec(CASES, _namespace)  # the same cases on onnxtrain's onnxblock
OURS = _namespace["CASES"]


@pytest.fixture(scope="module")
def reference():
    return run_script(_ORT_SCRIPT)


@pytest.mark.parametrize("case", list(OURS))
def test_an_unknown_name_is_a_lookup_error_naming_it(reference, case, tmp_path):
    theirs = reference[case]
    assert theirs is not None and theirs[1], theirs  # onnxruntime-training raises a LookupError
    with pytest.raises(LookupError) as info:
        OURS[case](str(tmp_path))
    assert isinstance(info.value, RuntimeError)  # still one of onnxtrain's BlockErrors
    assert "'zzz'" in str(info.value) or " zzz " in str(info.value), str(info.value)
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".onnx")]  # nothing written


def test_the_cases_model_is_the_peer_model():
    assert _namespace["mlp"]().SerializeToString() == small_mlp().SerializeToString()

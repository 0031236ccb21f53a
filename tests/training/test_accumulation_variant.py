"""The training model without gradient accumulators (onnxtrain/training/api/_accumulation.py): what the
onnxruntime backend runs on steps that overwrite the gradients."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain.engine.plan import Plan
from onnxtrain.training import artifacts
from onnxtrain.training.api._accumulation import (
    ACCUMULATED_SUFFIX,
    BUFFER_SUFFIX,
    RESET_INPUT,
    overwrite_variant,
)
from tests.session.helpers import batches, mlp_model


@pytest.fixture(scope="module", params=[None, "float16"])
def generated(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("acc"))
    model = mlp_model(din=8, dh=32, dout=4)
    trainable = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(model, requires_grad=trainable, loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder,
                                 mixed_precision=request.param)
    return onnx.load(os.path.join(folder, "training_model.onnx")), trainable


def test_variant_is_valid_and_returns_the_reset_steps_gradients_bit_for_bit(generated) -> None:
    full, trainable = generated
    variant = overwrite_variant(full, trainable)
    assert variant is not None
    onnx.checker.check_model(variant, full_check=True)
    names = {v.name for v in variant.graph.input}
    assert RESET_INPUT not in names and not any(n.endswith(BUFFER_SUFFIX) for n in names)
    assert [o.name for o in variant.graph.output] == [o.name for o in full.graph.output]
    wheres = [sum(n.op_type == "Where" for n in m.graph.node) for m in (variant, full)]
    assert wheres[0] < wheres[1]
    rng = np.random.default_rng(0)
    (x, y), = batches(1, 16)
    feeds = {"x": x, "y": y}
    for v in full.graph.input:
        if v.name not in feeds and v.name != RESET_INPUT:
            shape = [d.dim_value for d in v.type.tensor_type.shape.dim]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)
            feeds[v.name] = (rng.standard_normal(shape) * 0.3).astype(dtype)
    feeds = {k: v for k, v in feeds.items() if k in {i.name for i in full.graph.input}}
    want = Plan(full, fuse=False).run({**feeds, RESET_INPUT: np.array([True])})
    got = Plan(variant, fuse=False).run({k: v for k, v in feeds.items() if k in names})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_other_graphs_have_no_variant(generated) -> None:
    full, trainable = generated
    assert overwrite_variant(full, []) is None
    # a buffer read by a node other than its accumulator: not the generated pattern
    read = onnx.ModelProto()
    read.CopyFrom(full)
    buf = trainable[0] + BUFFER_SUFFIX
    read.graph.node.add().CopyFrom(onnx.helper.make_node("Identity", [buf], ["buf_copy"]))
    out = onnx.helper.make_tensor_value_info("buf_copy", onnx.TensorProto.FLOAT, None)
    read.graph.output.add().CopyFrom(out)
    assert overwrite_variant(read, trainable) is None
    # an accumulator that is not Where(reset, g, buffer + g)
    odd = onnx.ModelProto()
    odd.CopyFrom(full)
    for n in odd.graph.node:
        if n.op_type == "Where" and n.output[0] == trainable[0] + ACCUMULATED_SUFFIX:
            n.input[1], n.input[2] = n.input[2], n.input[1]
    assert overwrite_variant(odd, trainable) is None

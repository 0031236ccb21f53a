"""`onnxtrain export` of a model torch exported without ``dynamic_axes`` (a fixed batch of 16): the exported
model takes any batch size when its ops allow it (it kept the fixed 16, so onnxruntime refused 1 or 7 rows),
a Reshape to a constant [16, ...] included (its 16 becomes 0, the input's rows), and keeps the fixed size
with a warning when they do not (the rows flattened into one axis, then reshaped to [16, 12]). Oracles:
onnxruntime's inference package runs the file at 1, 7 and 16 rows; onnx.checker's full check; the numpy
engine on the same rows. The file keeps the torch model's producer (name and version), as
onnxruntime-training 1.19.2's export_model_for_inferencing keeps the base model's; a built-in model's export
names onnxtrain and its version (the version was empty)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import onnxtrain
from onnxtrain.cli import main
from tests.tiers import extended
from tests.train.conftest import config_path

BATCH = 16


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(12, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class _BakedReshape(_Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the batch size as a Python int: a constant shape
        return self.fc2(torch.relu(self.fc1(x.reshape(BATCH, 3, 4).reshape(BATCH, 12))))


class _FlatReshape(_Mlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # rows flattened together, then [16, 12] again
        return self.fc2(torch.relu(self.fc1(x.reshape(-1).reshape(BATCH, 12))))


def _export(net: nn.Module, path: str) -> None:
    torch.manual_seed(0)
    buf = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(BATCH, 12),), buf, dynamo=False, opset_version=17,
                          input_names=["x"], output_names=["logits"])
    m = onnx.load_from_string(buf.getvalue())
    assert [d.dim_value for d in m.graph.input[0].type.tensor_type.shape.dim] == [BATCH, 12]
    onnx.save(m, path)


def _train_and_export(tmp_path, net: nn.Module) -> str:
    torch.manual_seed(0)
    _export(net, str(tmp_path / "net.onnx"))
    r = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=r.standard_normal((160, 12)).astype(np.float32), y=r.integers(0, 3, 160))
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(
        f"model: {{path: {tmp_path / 'net.onnx'}, add_loss: cross_entropy, labels: labels}}\n"
        f"data: {{source: files, path: {tmp_path / 'd.npz'}, feeds: {{x: x, labels: y}}, "
        "eval_fraction: 0.2}\n"
        "optimizer: {name: adam, lr: 1.0e-2}\n"
        f"training: {{batch_size: {BATCH}, eval_batch_size: {BATCH}, steps: 3, eval_every: 3, seed: 3}}\n")
    out = str(tmp_path / "run")
    assert main(["train", str(cfg), "-q", "--output-dir", out]) == 0
    exported = str(tmp_path / "exported.onnx")
    assert main(["export", str(cfg), "--checkpoint", out, "-o", exported]) == 0
    return exported


def _first_dim(m: onnx.ModelProto) -> onnx.TensorShapeProto.Dimension:
    return m.graph.input[0].type.tensor_type.shape.dim[0]


def _same_as_engine(path: str, rows: int) -> None:
    x = np.random.default_rng(rows).standard_normal((rows, 12)).astype(np.float32)
    want = onnxtrain.InferenceSession(path).run(None, {"x": x})[0]
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert got.shape == (rows, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("net", [_Mlp, _BakedReshape], ids=["mlp", "reshape_to_batch"])
def test_fixed_batch_export_takes_any_batch(net, tmp_path, capsys) -> None:
    path = _train_and_export(tmp_path, net())
    assert "keeps the model's fixed batch size" not in capsys.readouterr().err
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert _first_dim(m).dim_param and not _first_dim(m).HasField("dim_value")
    assert m.graph.output[0].type.tensor_type.shape.dim[0].dim_param == _first_dim(m).dim_param
    given = onnx.load(str(tmp_path / "net.onnx"), load_external_data=False)
    assert (m.producer_name, m.producer_version) == ("pytorch", given.producer_version) != ("pytorch", "")
    for rows in (1, 7, BATCH):
        _same_as_engine(path, rows)


def test_rows_flattened_together_keep_fixed_batch_and_say_why(tmp_path, capsys) -> None:
    path = _train_and_export(tmp_path, _FlatReshape())
    err = capsys.readouterr().err
    assert "keeps the model's fixed batch size" in err and "at 1 rows instead of 16" in err, err
    m = onnx.load(path)
    onnx.checker.check_model(m, full_check=True)
    assert _first_dim(m).dim_value == BATCH
    _same_as_engine(path, BATCH)
    with pytest.raises(Exception, match="(?i)dimension|shape"):  # onnxruntime refuses other sizes too
        ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(
            None, {"x": np.zeros((7, 12), np.float32)})


def test_built_in_model_export_names_onnxtrain_and_its_version(tmp_path) -> None:
    out, exported = str(tmp_path / "run"), str(tmp_path / "mlp.onnx")
    small = ["--set", "training.steps=2", "--set", "training.epochs=null", "--set",
             "model.args.sizes=[64,8,10]", "--set", "output.plot=false"]
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, *small]) == 0
    assert main(["export", config_path("digits_mlp"), "--checkpoint", out, "-o", exported, *small]) == 0
    for path in (exported, str(tmp_path / "run" / "model.onnx")):
        m = onnx.load(path)
        assert (m.producer_name, m.producer_version) == ("onnxtrain", onnxtrain.__version__), path


def _tiny(nodes: list, inputs: list, outputs: list, inits: tuple = ()) -> onnx.ModelProto:
    from onnx import helper

    g = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_any_batch_export_cases() -> None:
    """The symbol avoids a name the model uses; inputs of two batch sizes, a batch summed away, and an
    Expand to a constant shape keep the fixed size with the reason; onnxruntime runs the freed one at 3
    rows."""
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain.train.free_batch import any_batch_export

    f = TensorProto.FLOAT
    vi = helper.make_tensor_value_info
    named = _tiny([helper.make_node("Relu", ["x"], ["y"])], [vi("x", f, [4, "batch"])],
                  [vi("y", f, [4, "batch"])])
    free, why = any_batch_export(named)
    assert why is None
    assert [d.dim_param for d in free.graph.input[0].type.tensor_type.shape.dim] == ["batch_1", "batch"]
    x = np.ones((3, 5), np.float32)
    assert ort.InferenceSession(free.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0].shape == (3, 5)
    two = _tiny([helper.make_node("Add", ["a", "b"], ["y"])], [vi("a", f, [4, 2]), vi("b", f, [1, 2])],
                [vi("y", f, [4, 2])])
    assert any_batch_export(two)[1].startswith("its inputs' first axes are not one batch axis")
    summed = _tiny([helper.make_node("ReduceSum", ["x"], ["y"], keepdims=1)], [vi("x", f, [4, 2])],
                   [vi("y", f, [1, 1])])
    assert "first axis is not its batch axis" in any_batch_export(summed)[1]
    shape = numpy_helper.from_array(np.array([4, 2], np.int64), "shape")
    expanded = _tiny([helper.make_node("Expand", ["x", "shape"], ["y"])], [vi("x", f, [4, 1])],
                     [vi("y", f, [4, 2])], (shape,))
    kept, why = any_batch_export(expanded)
    assert kept is expanded and "rows instead of 4" in why


class _Cnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.fc = nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.Linear(4 * 6 * 6, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.relu(self.bn(self.conv(x))).view(x.size(0), -1))


@pytest.mark.parametrize("dynamo", [extended(True, id="dynamo"), pytest.param(False, id="torchscript")])
def test_static_cnn_export_takes_any_batch(dynamo: bool) -> None:
    """A CNN whose flatten torch exports as a Reshape to [16, 144] (allowzero = 1 from dynamo; dynamo's case
    takes a few seconds: full suite): freed, and onnxruntime at 7 rows gives torch's outputs."""
    from onnxtrain.train.free_batch import any_batch_export

    torch.manual_seed(0)
    net = _Cnn().eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            m = torch.onnx.export(net, (torch.randn(BATCH, 1, 8, 8),), dynamo=True, input_names=["x"],
                                  output_names=["logits"], verbose=False).model_proto
        else:
            buf = io.BytesIO()
            torch.onnx.export(net, (torch.randn(BATCH, 1, 8, 8),), buf, dynamo=False, input_names=["x"],
                              output_names=["logits"])
            m = onnx.load_from_string(buf.getvalue())
    assert any(n.op_type == "Reshape" for n in m.graph.node)
    free, why = any_batch_export(m)
    assert why is None, why
    onnx.checker.check_model(free, full_check=True)
    x = np.random.default_rng(1).standard_normal((7, 1, 8, 8)).astype(np.float32)
    sess = ort.InferenceSession(free.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"x": x})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, net(torch.from_numpy(x)).numpy(), rtol=1e-5, atol=1e-5)

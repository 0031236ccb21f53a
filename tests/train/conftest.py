"""Fixtures for the ``onnxtrain train`` tests: the repository's configs and a config writer."""

from __future__ import annotations

import os

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = os.path.join(REPO, "configs")


@pytest.fixture
def write_config(tmp_path):
    """write_config(mapping, name="run") → path of a YAML file holding it, in tmp_path."""

    def write(raw: dict, name: str = "run") -> str:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return str(path)

    return write


def config_path(name: str) -> str:
    return os.path.join(CONFIGS, f"{name}.yaml")


def save_dropout_mlp(path: str, sizes: tuple[int, ...] = (64, 32, 10)) -> str:
    """zoo.mlp with a Dropout (ratio 0.5, training mode, no ``seed`` attribute: it draws from the engine's
    seed sequence, as a torch export's does) after the first ReLU; saved to ``path``."""
    import onnx
    from onnx import TensorProto, helper

    from onnxtrain import zoo

    model = zoo.mlp(list(sizes))
    g = model.graph
    at = next(i for i, n in enumerate(g.node) if n.output[0] == "h0_relu") + 1
    g.node.insert(at, helper.make_node("Constant", [], ["drop.ratio"], value=helper.make_tensor(
        "ratio", TensorProto.FLOAT, [], [0.5])))
    g.node.insert(at + 1, helper.make_node("Constant", [], ["drop.training"], value=helper.make_tensor(
        "training", TensorProto.BOOL, [], [True])))
    g.node.insert(at + 2, helper.make_node("Dropout", ["h0_relu", "drop.ratio", "drop.training"], ["h0_drop"],
                                           name="drop"))
    for n in g.node[at + 3:]:
        n.input[:] = ["h0_drop" if i == "h0_relu" else i for i in n.input]
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path

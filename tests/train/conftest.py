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

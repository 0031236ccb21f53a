"""Fixtures shared by the on-device training tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def bn_cnn_exported(tmp_path_factory):
    """The BatchNorm CNN of ``tests/training/bn_cnn.py`` exported in training mode: (folder, the torch net
    with the exported values, the exported model)."""
    from tests.training.bn_cnn import export_cnn  # skips without torch

    folder = tmp_path_factory.mktemp("bn_cnn")
    net, model = export_cnn(folder)
    return folder, net, model

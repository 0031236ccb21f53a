"""``import onnxtrain`` loads its public names on first use: the on-device API skips the legacy session."""

from __future__ import annotations

import subprocess
import sys

import pytest

import onnxtrain


def _run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


def test_import_loads_only_the_package():
    code = "import sys, onnxtrain; print(sorted(m for m in sys.modules if m.startswith('onnxtrain')))"
    assert _run(code) == "['onnxtrain']"


def test_on_device_api_does_not_load_the_legacy_session():
    code = (
        "import sys\n"
        "from onnxtrain import SessionOptions\n"
        "from onnxtrain.training import api, artifacts\n"
        "legacy = ('onnxtrain.session', 'onnxtrain.training_graph', 'onnxtrain.optim',\n"
        "          'onnxtrain.parallel.zero', 'onnxtrain.parallel.adasum', 'onnxtrain.inference')\n"
        "print([m for m in legacy if m in sys.modules], api.Module.__name__, SessionOptions.__name__)"
    )
    assert _run(code) == "[] Module SessionOptions"


def test_sessions_do_not_load_hashlib():
    """hashlib maps OpenSSL's libcrypto (about 4 MiB of RSS, seen in the bench's peak RSS): the sessions,
    the on-device API and checkpoints do without it (the file writer's random names come from os.urandom)."""
    code = (
        "import sys\n"
        "import onnxtrain.session, onnxtrain.inference, onnxtrain.checkpoint, onnxtrain.ir.io\n"
        "from onnxtrain.training import api, artifacts\n"
        "print([m for m in ('hashlib', '_hashlib', 'secrets') if m in sys.modules])"
    )
    assert _run(code) == "[]"


def test_every_public_name_resolves_to_its_defining_object():
    from onnxtrain.capi.options import SessionOptions
    from onnxtrain.session import TrainingSession

    for name in onnxtrain.__all__:
        assert getattr(onnxtrain, name) is not None, name
        assert name in dir(onnxtrain), name
    assert onnxtrain.TrainingSession is TrainingSession
    assert onnxtrain.SessionOptions is SessionOptions
    namespace: dict = {}
    exec("from onnxtrain import *", namespace)
    assert set(onnxtrain.__all__) <= set(namespace)


def test_subpackages_are_attributes_and_unknown_names_raise():
    import onnxtrain.training.api as api

    assert onnxtrain.training.api is api
    assert onnxtrain.checkpoint.__name__ == "onnxtrain.checkpoint"
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = onnxtrain.no_such_name

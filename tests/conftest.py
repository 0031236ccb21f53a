import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The suite starts several hundred Python processes (MPI ranks, bench workers, the CLI), each importing
# onnxtrain: with PYTHONDONTWRITEBYTECODE set (as on some CI images) every one compiled its modules again
# (0.4 s of each start). Compiled modules are cached for this run and the processes it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long or needs an optional environment (e.g. /tmp/ortt)")


@pytest.fixture(scope="session", autouse=True)
def _torchlib_registry_once():  # noqa: ANN202
    """torch's dynamo exporter rebuilds its registry of torchlib functions at every export (about 0.7 s of
    the 1.1 s a small export takes, and 5 s the first time in a process): built once per opset for the
    whole run. No custom translation table is given anywhere in the suite, so the registry stays as built."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    cls = _registration.ONNXRegistry
    original = cls.__dict__.get("from_torchlib")
    if not isinstance(original, classmethod):
        yield
        return
    built: dict = {}

    def from_torchlib(klass, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        key = (args, tuple(sorted(kwargs.items())))
        if key not in built:
            built[key] = original.__func__(klass, *args, **kwargs)
        return built[key]

    cls.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        cls.from_torchlib = original

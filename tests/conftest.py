import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The suite starts several hundred Python processes (MPI ranks, bench workers, the CLI), each importing
# onnxtrain: with PYTHONDONTWRITEBYTECODE set (as on some CI images) every one compiled its modules again
# (0.4 s of each start). Compiled modules are cached for this run and the processes it starts.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long or needs an optional environment (e.g. /tmp/ortt)")

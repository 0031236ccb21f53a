import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: long or needs an optional environment (e.g. /tmp/ortt)")

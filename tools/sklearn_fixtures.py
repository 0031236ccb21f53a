"""What the ``make_sklearn_*`` fixture scripts share: where the fixtures go and how a model is written."""

from __future__ import annotations

import os
from typing import Any

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")
OPSETS = {"": 17, "ai.onnx.ml": 3}  # what the fixtures are exported at


def save_model(model: Any, path: str) -> None:
    """Write an exported ``onnx.ModelProto`` to ``path`` (through a temporary name, renamed when whole) and
    print its size."""
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        f.write(model.SerializeToString())
    os.replace(tmp, path)
    print(f"{os.path.relpath(path)}: {os.path.getsize(path)} bytes")


def out_dir(doc: str, folder: str) -> str:
    """The directory a fixture script writes (``--out``, by default ``tests/data/<folder>``), made if new."""
    import argparse

    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(DATA, folder),
                        help="the directory to write (default: %(default)s)")
    out = parser.parse_args().out
    os.makedirs(out, exist_ok=True)
    return out

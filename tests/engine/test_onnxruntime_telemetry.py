"""The onnxruntime backend imports onnxruntime with its telemetry off (``ORT_DISABLE_TELEMETRY``) unless the
environment sets that variable, and leaves the environment as it was.

onnxruntime 1.32 starts a OneDS event uploader when it is imported on Linux: a thread at once, and from time
to time three more sending its events (about 2 MiB of peak RSS in the bench's LeNet peers). The oracle is
onnxruntime's own import with the variable set by the test: the process then holds the threads onnxtrain's
import must leave it with."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")

VAR = "ORT_DISABLE_TELEMETRY"
_REPORT = ("\nimport json, os\n"
           "print(json.dumps({'threads': len(os.listdir('/proc/self/task')), 'env': os.environ.get("
           f"{VAR!r}), 'loaded': 'onnxruntime' in __import__('sys').modules}}))")
_PLAIN = "import onnxruntime"
_OURS = "from onnxtrain.engine.backends import import_onnxruntime\nimport_onnxruntime()"


def _run(code: str, value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != VAR}
    if value is not None:
        env[VAR] = value
    out = subprocess.run([sys.executable, "-c", code + _REPORT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def threads() -> dict[str, int]:
    """onnxruntime's own thread count after its import, with its telemetry on and off."""
    on, off = _run(_PLAIN, None)["threads"], _run(_PLAIN, "1")["threads"]
    if on == off:
        pytest.skip("this onnxruntime starts no telemetry thread when imported")
    return {"on": on, "off": off}


def test_backend_imports_onnxruntime_without_telemetry(threads):
    got = _run(_OURS, None)
    assert got["loaded"]
    assert got["threads"] == threads["off"]
    assert got["env"] is None  # the variable was set for the import only


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_environment_decides_when_it_sets_the_variable(threads, value):
    got = _run(_OURS, value)
    assert got["threads"] == threads["on" if value == "0" else "off"]
    assert got["env"] == value


def test_an_onnxruntime_imported_before_is_left_as_it_is(threads):
    got = _run(_PLAIN + "\n" + _OURS, None)
    assert got["threads"] == threads["on"]
    assert got["env"] is None

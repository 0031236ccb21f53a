"""The allocator tuning: on by default on glibc, off with ONNXTRAIN_ALLOCATOR=system."""

import platform
import subprocess
import sys

import pytest

CHECK = (
    "import onnxtrain.engine.allocator as a, onnxtrain.engine as e, numpy as np, onnx\n"
    "from onnx import helper, TensorProto as T\n"
    "g = helper.make_graph([helper.make_node('Relu', ['x'], ['y'])], 'g',\n"
    "    [helper.make_tensor_value_info('x', T.FLOAT, [None])],\n"
    "    [helper.make_tensor_value_info('y', T.FLOAT, [None])])\n"
    "p = e.Plan(helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)]))\n"
    "x = np.linspace(-1, 1, 1 << 20, dtype=np.float32)\n"
    "assert (p.run({'x': x})[0] == np.maximum(x, 0)).all()\n"
    "assert a.tune_allocator.cache_info().currsize == 1  # the plan's compile ran it\n"
    "print(a.tune_allocator())  # cached: the value that compile got\n"
)


def _tuned(env_value: str | None) -> str:
    import os

    env = dict(os.environ)
    env.pop("ONNXTRAIN_ALLOCATOR", None)
    if env_value is not None:
        env["ONNXTRAIN_ALLOCATOR"] = env_value
    out = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tuning applies to glibc only")
def test_compiling_a_plan_tunes_glibc_once():
    assert _tuned(None) == "True"


def test_system_allocator_is_left_alone_when_asked():
    assert _tuned("system") == "False"

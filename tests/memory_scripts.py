"""Code shared by the memory tests' scripts, which run in fresh processes (``python -c``)."""

MATMUL_CHAIN = r'''
import numpy as np
from onnx import TensorProto, helper, numpy_helper


def matmul_chain(n, size, batch, loss):
    """n MatMuls by size x size weights W0... (normal * 0.05, seed 0) from x [batch, size]: the squared sum
    as output "loss" when loss, else the last product."""
    rng = np.random.default_rng(0)
    inits, nodes, prev = [], [], "x"
    for i in range(n):
        inits.append(numpy_helper.from_array(rng.standard_normal((size, size), np.float32) * 0.05, f"W{i}"))
        nodes.append(helper.make_node("MatMul", [prev, f"W{i}"], [f"h{i}"]))
        prev = f"h{i}"
    if loss:
        nodes.append(helper.make_node("ReduceSumSquare", [prev], ["loss"], keepdims=0))
        out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    else:
        out = helper.make_tensor_value_info(prev, TensorProto.FLOAT, [batch, size])
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, size])],
                          [out], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
'''


def run_measured(script: str, *args: str) -> dict:
    """Run ``script`` in a fresh process (glibc's allocator as it is, one BLAS thread) with ``args``; the
    JSON object its last output line prints."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "ONNXTRAIN_ALLOCATOR": "system", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

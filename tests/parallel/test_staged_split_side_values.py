"""Pipeline stages over horizontally split blocks (``mpiexec -n 4``: 2 stages × 2 shares) when a value
computed beside a split block crosses the stage cut: ``s = Sigmoid(x)`` sits between the block's nodes in
graph order and is read after the block (``q = o · s``). The cut ``"o:s"`` (the block's output and that value,
as the one-process pipeline takes it) and the cut ``"s"`` alone (the block then stays in the first stage, as a
plain pipeline puts it) were refused by :func:`onnxtrain.parallel.pipeline.merge_cuts`: ``"s"`` as falling
"inside the split block" (its node lies between the block's by position, but it reads nothing of the block),
``"o:s"`` with "'o' is computed in stage 1 (list the cuts in graph order)" (a second cut on the block's output
after its G cut). A cut on a value of the block itself is still refused. Oracle: one process accumulating the
same micro-batches (float64, Adam)."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.parallel.megatron import find_mlp_blocks, shard_blocks
from onnxtrain.parallel.pipeline import merge_cuts, parse_cut_info, partition
from tests.parallel.conftest import run_mpi


def side_model(bias: bool = False) -> onnx.ModelProto:
    """x → MatMul W1 → h1 → Relu → r → MatMul W2 → o (a block of 16 hidden units; with ``bias``, o = o0 + b2
    after it), s = Sigmoid(x) between the block's nodes, q = o · s → MatMul W3 → z; loss = mean(z²)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s) * 0.4, n)
             for n, s in (("W1", (8, 16)), ("W2", (16, 8)), ("W3", (8, 4)), ("b2", (8,)))]
    product = (
        [helper.make_node("MatMul", ["r", "W2"], ["o0"]), helper.make_node("Add", ["o0", "b2"], ["o"])]
        if bias else [helper.make_node("MatMul", ["r", "W2"], ["o"])]
    )
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h1"]),
        helper.make_node("Sigmoid", ["x"], ["s"]),
        helper.make_node("Relu", ["h1"], ["r"]),
        *product,
        helper.make_node("Mul", ["o", "s"], ["q"]),
        helper.make_node("MatMul", ["q", "W3"], ["z"]),
        helper.make_node("Mul", ["z", "z"], ["zz"]),
        helper.make_node("ReduceMean", ["zz"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "side", [helper.make_tensor_value_info("x", T.DOUBLE, ["N", 8])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])], inits if bias else inits[:3])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("cut", ["o:s", "s"])
def test_the_stage_cut_ends_after_the_block(cut: str) -> None:
    m = side_model()
    blocks = find_mlp_blocks(m, ["W1", "W2", "W3"], 2)
    assert [b.w1 for b in blocks] == ["W1"]
    sharded, cuts, _ = shard_blocks(m, blocks, 0, 2)
    merged = merge_cuts(sharded, parse_cut_info(cut, 2), cuts)
    # F, then the G cut (the ranks' sum of o) ending the first stage; s crosses it as a value read later
    assert [(mc.block_cut, mc.ends_stage) for mc in merged] == [(0, False), (1, True)]
    assert [e.tensor for e in merged[1].edges] == ["o"]
    part = partition(sharded, [mc.edges for mc in merged], "loss")
    piece = {n.output[0]: part.stage_of[k] for k, n in enumerate(sharded.graph.node)}
    assert piece["o"] == 1 and piece["r"] == 1 and piece["q"] == 2 and piece["loss"] == 2
    assert 2 in part.runs(next(k for k, n in enumerate(sharded.graph.node) if n.output[0] == "s"))


def test_a_cut_after_the_blocks_bias_takes_the_value_beside_it_across() -> None:
    """With the block's bias added after its G cut, ``"o:s"`` is a cut of its own after that cut: s, computed
    before the G cut, crosses it as a value read later (it failed with "'s' is computed in stage 0")."""
    m = side_model(bias=True)
    sharded, cuts, _ = shard_blocks(m, find_mlp_blocks(m, ["W1", "W2", "W3", "b2"], 2), 0, 2)
    merged = merge_cuts(sharded, parse_cut_info("o:s", 2), cuts)
    assert [(mc.block_cut, mc.ends_stage) for mc in merged] == [(0, False), (1, False), (None, True)]
    assert [e.tensor for e in merged[2].edges] == ["o"]
    part = partition(sharded, [mc.edges for mc in merged], "loss")
    piece = {n.output[0]: part.stage_of[k] for k, n in enumerate(sharded.graph.node)}
    assert piece["o"] == 2 and piece["q"] == 3 and piece["loss"] == 3


def test_a_cut_on_a_value_of_the_block_is_still_refused() -> None:
    m = side_model()
    sharded, cuts, _ = shard_blocks(m, find_mlp_blocks(m, ["W1", "W2", "W3"], 2), 0, 2)
    with pytest.raises(ValueError, match="falls inside the split block"):
        merge_cuts(sharded, parse_cut_info("r:s", 2), cuts)
    # two stage cuts that both end at the block's G cut would leave the stage between them empty
    with pytest.raises(ValueError, match=r"cut 1 \(o\) ends its stage where the cut before it does"):
        merge_cuts(sharded, parse_cut_info("s,o", 3), cuts)


_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import numpy as np
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.parallel import world
from tests.parallel.test_staged_split_side_values import side_model

rng = np.random.default_rng(1)
batches = [rng.standard_normal((8, 8)) for _ in range(3)]
lr = np.array([0.05], np.float32)
p = TrainingParameters()
p.loss_output_name = "loss"
p.training_optimizer_name = "AdamOptimizer"
if world().size == 1:
    p.gradient_accumulation_steps, p.gradient_accumulation_mode = 2, "auto"
else:
    p.horizontal_parallel_size = 2
    p.pipeline_parallel_size, p.pipeline_cut_info_string, p.num_pipeline_micro_batches = 2, sys.argv[3], 2
sess = TrainingSession(side_model(sys.argv[4] == "bias").SerializeToString(), p)
losses = []
for x in batches:
    if world().size == 1:
        for half in (x[:4], x[4:]):
            (loss,) = sess.run(["loss"], {"x": half, "Learning_Rate": lr})
    else:
        (loss,) = sess.run(["loss"], {"x": x, "Learning_Rate": lr})
    losses.append(float(loss))
state = sess.gather_state() if world().size > 1 else sess.get_state()
if world().rank == 0:
    with open(sys.argv[2], "w") as f:
        json.dump({"losses": losses, **{w: state[w].tolist() for w in ("W1", "W2", "W3")}}, f)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("cut,bias", [("o:s", ""), ("s", ""), ("o:s", "bias")])
def test_two_stages_of_two_shares_train_as_one_process(tmp_path, cut: str, bias: str) -> None:
    script = tmp_path / "side.py"
    script.write_text(_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    got = {}
    for n in (1, 4):
        out = tmp_path / f"out{n}.json"
        r = run_mpi(root, str(out), cut, bias or "none", n=n, timeout=300, worker=str(script),
                    env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        got[n] = json.loads(out.read_text())
    one, split = got[1], got[4]
    np.testing.assert_allclose(split["losses"], one["losses"], rtol=1e-12)
    first = {t.name: numpy_helper.to_array(t) for t in side_model(bool(bias)).graph.initializer}
    for w in ("W1", "W2", "W3"):
        np.testing.assert_allclose(split[w], one[w], rtol=1e-11, atol=1e-13, err_msg=w)
        assert np.abs(np.asarray(one[w]) - first[w]).max() > 1e-3, w  # the weights moved

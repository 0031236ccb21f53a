"""Execution-time fusions (onnxtrain/engine/fusion/): same results as the unfused plan, fewer steps."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.engine.plan import EngineError, Plan
from tests.engine.graphs import model, on_device_mlp
from tests.session.helpers import batches, mlp_model

F = TensorProto.FLOAT


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def const(name: str, value) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))


# ---- elementwise clusters --------------------------------------------------------------------------------
def adam_like() -> onnx.ModelProto:
    """An Adam-style update: moments, sqrt, division; m1n escapes twice (output and Identity)."""
    n = [
        const("a", np.float32(0.9)),
        const("oma", np.float32(0.1)),
        const("eps", np.float32(1e-8)),
        helper.make_node("Mul", ["m", "a"], ["t0"]),
        helper.make_node("Mul", ["g", "oma"], ["t1"]),
        helper.make_node("Add", ["t0", "t1"], ["m_new"]),
        helper.make_node("Mul", ["g", "g"], ["gg"]),
        helper.make_node("Sqrt", ["gg"], ["r"]),
        helper.make_node("Add", ["r", "eps"], ["den"]),
        helper.make_node("Div", ["m_new", "den"], ["u"]),
        helper.make_node("Sub", ["w", "u"], ["w_new"]),
        helper.make_node("Identity", ["m_new"], ["m_out"]),
    ]
    return model(n, ["w", "g", "m"], ["w_new", "m_out", "m_new"])


def test_cluster_is_one_step_and_bit_identical_across_runs_and_shapes() -> None:
    fused, plain = Plan(adam_like()), Plan(adam_like(), fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    rng = np.random.default_rng(0)
    held = None
    for shape in [(64, 48), (64, 48), (64, 48), (7,), (300, 5)]:
        feeds = {k: rng.standard_normal(shape).astype(np.float32) for k in ("w", "g", "m")}
        got, want = fused.run(feeds), plain.run(feeds)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        assert got[1] is not got[0]
        if held is None:
            held = [a.copy() for a in got], got  # outputs of a run must survive later runs
    copies, arrays = held
    for c, a in zip(copies, arrays):
        np.testing.assert_array_equal(c, a)


def test_cluster_does_not_write_into_inputs() -> None:
    plan = Plan(adam_like())
    rng = np.random.default_rng(1)
    feeds = {k: rng.standard_normal((32, 32)).astype(np.float32) for k in ("w", "g", "m")}
    before = {k: v.copy() for k, v in feeds.items()}
    for _ in range(3):
        plan.run(feeds)
    for k in feeds:
        np.testing.assert_array_equal(feeds[k], before[k])


def test_chain_runs_in_place_without_scratch() -> None:
    n = [
        helper.make_node("Add", ["x" if i == 0 else f"t{i - 1}", "x"], [f"t{i}" if i < 9 else "y"])
        for i in range(10)
    ]
    plan = Plan(model(n, ["x"], ["y"]))
    x = np.arange(2048, dtype=np.float32).reshape(32, 64)
    for _ in range(2):
        (y,) = plan.run({"x": x})
        np.testing.assert_array_equal(y, x * 11)
    assert plan.scratch.nbytes == 0  # every intermediate was written over by the next Add


def test_outside_consumer_between_members_keeps_order() -> None:
    """``t`` is read by a ReduceSum placed between two elementwise steps: the first may not join the second
    if that would delay ``t`` past its reader."""
    n = [
        helper.make_node("Mul", ["x", "x"], ["t"]),
        helper.make_node("Add", ["t", "x"], ["t2"]),
        helper.make_node("ReduceSum", ["t2"], ["s"], keepdims=1),
        helper.make_node("Sub", ["t2", "s"], ["u"]),
        helper.make_node("Mul", ["u", "u"], ["y"]),
    ]
    m = model(n, ["x"], ["y"])
    x = np.random.default_rng(2).standard_normal((4, 5)).astype(np.float32)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert len(fused.steps) == 3
    np.testing.assert_array_equal(fused.run({"x": x})[0], plain.run({"x": x})[0])


def test_cluster_errors_name_the_member_node() -> None:
    n = [
        helper.make_node("Mul", ["x", "x"], ["t"], name="square"),
        helper.make_node("Add", ["t", "b"], ["y"], name="add_b"),
    ]
    plan = Plan(model(n, ["x", "b"], ["y"]))
    with pytest.raises(EngineError, match="add_b"):
        plan.run({"x": np.ones((3, 4), np.float32), "b": np.ones((5,), np.float32)})


def blockable() -> onnx.ModelProto:
    """Scalar-only members (Cast, Pow: own kernels), blocked ufuncs with a (1, 1) broadcast operand and
    transcendental ones, an Identity of a blocked value and a ufunc reading that Identity (whole arrays)."""
    n = [
        const("beta", np.float32(0.9)),
        const("one", np.float32(1.0)),
        helper.make_node("Cast", ["t"], ["tf"], to=F),
        helper.make_node("Pow", ["beta", "tf"], ["bp"]),
        helper.make_node("Sub", ["one", "bp"], ["bc"]),
        helper.make_node("Mul", ["g", "s"], ["gs"]),
        helper.make_node("Tanh", ["gs"], ["th"]),
        helper.make_node("Exp", ["m"], ["e"]),
        helper.make_node("Add", ["th", "e"], ["a"]),
        helper.make_node("Log", ["a"], ["la"]),
        helper.make_node("Relu", ["w"], ["r"]),
        helper.make_node("Mul", ["la", "r"], ["lr"]),
        helper.make_node("Div", ["lr", "bc"], ["u"]),
        helper.make_node("Sqrt", ["e"], ["se"]),
        helper.make_node("Add", ["u", "se"], ["u2"]),
        helper.make_node("Sub", ["w", "u2"], ["w_new"]),
        helper.make_node("Identity", ["a"], ["a_out"]),
        helper.make_node("Mul", ["a_out", "bc"], ["y"]),
    ]
    g = helper.make_graph(
        n,
        "g",
        [helper.make_tensor_value_info(k, F, None) for k in ("w", "g", "m", "s")]
        + [helper.make_tensor_value_info("t", TensorProto.INT64, [])],
        [helper.make_tensor_value_info(k, F, None) for k in ("w_new", "a_out", "y", "bc")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_blocked_cluster_is_bit_identical_and_keeps_block_sized_scratch(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)  # 64-element blocks: many blocks and a short tail
    fused, plain = Plan(blockable()), Plan(blockable(), fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    cluster = fused.steps[0].fn
    rng = np.random.default_rng(6)
    held = None
    for shape, s_shape, transposed in [
        ((300, 7), (1, 1), False),
        ((300, 7), (1, 1), False),
        ((50, 41), (), True),  # a non-contiguous input
        ((30,), (1,), False),  # below two blocks: not blocked
        ((20, 9), (9,), False),  # a broadcast that is not size 1: that op runs first, on whole arrays
    ]:
        feeds = {k: rng.standard_normal(shape).astype(np.float32) for k in ("w", "g", "m")}
        if transposed:
            feeds["w"] = np.ascontiguousarray(feeds["w"].T).T
        feeds["s"] = rng.standard_normal(s_shape).astype(np.float32)
        feeds["t"] = np.array(3, np.int64)
        got, want = fused.run(feeds), plain.run(feeds)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
        if held is None:
            held = [a.copy() for a in got], got
    copies, arrays = held
    for c, a in zip(copies, arrays):
        np.testing.assert_array_equal(c, a)  # outputs of a run survive later runs
    blocked = {b.segments[0].n: b for p in cluster.programs.values() if (b := p[5]) is not None}
    assert sorted(blocked) == [180, 2050, 2100]  # (20, 9), (50, 41) and (300, 7)
    for n, b in blocked.items():
        (seg,) = b.segments
        assert seg.block <= 128 and seg.n % seg.block and len(b.post) == 2
        assert len(b.pre) == (4 if n == 180 else 3)  # + the (20, 9) * (9,) Mul
    # a plan that only ran blocked: its scratch pool (counted in peak_bytes) holds block-sized buffers
    only = Plan(blockable())
    only.run(feeds_of((300, 7), rng))
    (prog,) = only.steps[0].fn.programs.values()
    (seg,) = prog[5].segments
    # value groups share buffers by liveness; the chain computing w's step keeps a buffer of its own rather
    # than running in w's output slice before w is read, so that the output can take w's memory when donated
    n_bufs = len({(dt, i) for _, dt, i in seg.scratch})
    assert 0 < n_bufs <= 3
    assert only.scratch.nbytes == n_bufs * seg.block * 4
    assert only.peak_bytes >= only.scratch.nbytes


def two_weight_update() -> onnx.ModelProto:
    """An optimizer graph over two weights of different shapes, tied together by one shared step size
    computed in the graph (as the on-device AdamW's): one cluster, one blocked segment per weight."""
    n = [
        const("half", np.float32(0.5)),
        const("eps", np.float32(1e-8)),
        helper.make_node("Mul", ["lr", "half"], ["step"]),
        helper.make_node("Sqrt", ["step"], ["root"]),
    ]
    for w in ("a", "b"):
        n += [
            helper.make_node("Mul", [f"g_{w}", f"g_{w}"], [f"gg_{w}"]),
            helper.make_node("Sqrt", [f"gg_{w}"], [f"r_{w}"]),
            helper.make_node("Add", [f"r_{w}", "eps"], [f"d_{w}"]),
            helper.make_node("Div", [f"g_{w}", f"d_{w}"], [f"u_{w}"]),
            helper.make_node("Mul", [f"u_{w}", "root"], [f"s_{w}"]),
            helper.make_node("Sub", [f"w_{w}", f"s_{w}"], [f"new_{w}"]),
        ]
    return model(n, ["lr", "w_a", "g_a", "w_b", "g_b"], ["new_a", "new_b"])


def test_cluster_over_weights_of_several_shapes_blocks_each_shape(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 4096)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    fused, plain = Plan(two_weight_update()), Plan(two_weight_update(), fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    rng = np.random.default_rng(11)
    feeds = {"lr": np.array([0.01], np.float32)}
    for w, shape in (("a", (96, 40)), ("b", (10,))):  # a: blocked; b: too small, one block
        feeds[f"w_{w}"], feeds[f"g_{w}"] = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    for _ in range(2):
        for got, want in zip(fused.run(feeds), plain.run(feeds)):
            assert got.tobytes() == want.tobytes()
    (prog,) = fused.steps[0].fn.programs.values()
    segs = {seg.n: seg for seg in prog[5].segments}
    assert sorted(segs) == [10, 3840] and segs[10].block == 10 and segs[3840].block < 3840
    assert len(prog[5].pre) == 2  # the shared step size, once


def feeds_of(shape: tuple[int, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    feeds = {k: rng.standard_normal(shape).astype(np.float32) for k in ("w", "g", "m")}
    return {**feeds, "s": np.full((1, 1), 0.5, np.float32), "t": np.array(3, np.int64)}


def test_blocked_cluster_does_not_write_into_inputs(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    plan = Plan(adam_like())
    rng = np.random.default_rng(7)
    feeds = {k: rng.standard_normal((64, 33)).astype(np.float32) for k in ("w", "g", "m")}
    before = {k: v.copy() for k, v in feeds.items()}
    want = Plan(adam_like(), fuse=False).run(feeds)
    for _ in range(3):
        for a, b in zip(plan.run(feeds), want):
            np.testing.assert_array_equal(a, b)
    assert any(p[5] is not None for p in plan.steps[0].fn.programs.values())
    for k in feeds:
        np.testing.assert_array_equal(feeds[k], before[k])


def gelu_nodes(h: str, y: str) -> list[onnx.NodeProto]:
    """torch's exported exact GELU of ``h`` into ``y``: h/√2 → Erf → +1 → ·h → ·0.5."""
    return [
        const("r2", np.float32(np.sqrt(2.0))),
        const("one", np.float32(1.0)),
        const("half", np.float32(0.5)),
        helper.make_node("Div", [h, "r2"], ["d"]),
        helper.make_node("Erf", ["d"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["p1"]),
        helper.make_node("Mul", [h, "p1"], ["q"]),
        helper.make_node("Mul", ["q", "half"], [y]),
    ]


def gelu_chain() -> onnx.ModelProto:
    """The exported exact GELU after a bias Add."""
    return model([helper.make_node("Add", ["x", "b"], ["h"]), *gelu_nodes("h", "y")], ["x", "b"], ["y"])


@pytest.mark.parametrize("blocked", [False, True])
def test_gelu_chain_with_erf_is_one_cluster_and_bit_identical(monkeypatch, blocked) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    if blocked:
        monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
        monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    fused, plain = Plan(gelu_chain()), Plan(gelu_chain(), fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    rng = np.random.default_rng(3)
    for shape in [(64, 48), (64, 48), (7, 5)]:
        feeds = {"x": (3 * rng.standard_normal(shape)).astype(np.float32),
                 "b": rng.standard_normal(1).astype(np.float32)}  # size 1: the blocks take it whole
        feeds["x"][0, :2] = [np.nan, np.inf]
        got, want = fused.run(feeds)[0], plain.run(feeds)[0]
        assert got.tobytes() == want.tobytes()
    programs = fused.steps[0].fn.programs.values()
    assert any(p[5] is not None for p in programs) == blocked


# ---- common subexpressions -------------------------------------------------------------------------------
def test_repeated_steps_run_once() -> None:
    n = [
        helper.make_node("Sub", ["a", "b"], ["d1"]),
        helper.make_node("Sub", ["a", "b"], ["d2"]),
        helper.make_node("MatMul", ["d1", "d2"], ["y"]),
    ]
    m = model(n, ["a", "b"], ["y"])
    plan = Plan(m)
    assert ops(plan).count("Sub") == 1
    a, b = np.eye(3, dtype=np.float32), np.ones((3, 3), np.float32)
    np.testing.assert_array_equal(plan.run({"a": a, "b": b})[0], (a - b) @ (a - b))


# ---- weight gradient of a batched MatMul -----------------------------------------------------------------
def matmul_grad_model() -> onnx.ModelProto:
    n = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["xt", "dy"], ["p"]),
        const("axes", np.array([0, 1], np.int64)),
        helper.make_node("ReduceSum", ["p", "axes"], ["dw"], keepdims=0),
    ]
    return model(n, ["x", "dy"], ["dw"])


def test_matmul_weight_grad_is_one_gemm() -> None:
    fused, plain = Plan(matmul_grad_model()), Plan(matmul_grad_model(), fuse=False)
    assert ops(fused) == ["FusedMatMulWeightGrad"]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 7, 5)).astype(np.float32)
    dy = rng.standard_normal((2, 3, 7, 4)).astype(np.float32)
    np.testing.assert_allclose(
        fused.run({"x": x, "dy": dy})[0], plain.run({"x": x, "dy": dy})[0], rtol=1e-5, atol=1e-5
    )
    # broadcast batch axes: not the pattern's case, the original steps run
    dy1 = dy[:1]
    np.testing.assert_array_equal(fused.run({"x": x, "dy": dy1})[0], plain.run({"x": x, "dy": dy1})[0])


# ---- weight gradient of a Conv ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "strides,dilations,pads",
    [([1, 1], [1, 1], [0, 0, 0, 0]), ([1, 1], [1, 1], [2, 2, 2, 2]), ([2, 1], [1, 2], [1, 0, 2, 1]),
     ([1, 1], [2, 1], [1, 0, 2, 1])],
)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-gemm", "per-sample-gemms"])
@pytest.mark.parametrize("path", ["im2col", "patches", "shifted"])
def test_conv_weight_grad_matches_the_conv_form(strides, dilations, pads, chunked, path, monkeypatch) -> None:
    """dW of Conv(X, W; strides s, dilations d, pads p) as the autodiff writes it: a Conv of the transposed
    input with the transposed output gradient, strides and dilations swapped. Two input channels take the
    im2col GEMMs, eight the shifted GEMMs at stride 1 and else (or when those are off) the channels-last
    patches."""
    from onnxtrain.engine.fusion import gemm

    channels = 2 if path == "im2col" else 8
    if chunked:
        monkeypatch.setattr(gemm, "COLS_BYTES", 1)  # one sample per GEMM, the partial products summed
        monkeypatch.setattr(gemm, "PATCH_POSITIONS", 1)
    if path != "shifted":
        monkeypatch.setattr(gemm, "SHIFTED_MAX_GEMMS", 0)
    calls: list[int] = []
    shifted: list[int] = []
    real, real_shifted = gemm._weight_grad_patches, gemm._weight_grad_shifted
    monkeypatch.setattr(gemm, "_weight_grad_patches", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(gemm, "_weight_grad_shifted", lambda *a: shifted.append(1) or real_shifted(*a))
    n = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
        helper.make_node("Conv", ["xt", "dyt"], ["c"], strides=dilations, dilations=strides, pads=pads),
        helper.make_node("Transpose", ["c"], ["dw"], perm=[1, 0, 2, 3]),
    ]
    m = model(n, ["x", "dy"], ["dw"])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["FusedConvWeightGrad"]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, channels, 11, 10)).astype(np.float32)
    k = (3, 3)
    h = (11 + pads[0] + pads[2] - dilations[0] * (k[0] - 1) - 1) // strides[0] + 1
    w = (10 + pads[1] + pads[3] - dilations[1] * (k[1] - 1) - 1) // strides[1] + 1
    dy = rng.standard_normal((3, 4, h, w)).astype(np.float32)
    got, want = fused.run({"x": x, "dy": dy})[0], plain.run({"x": x, "dy": dy})[0]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    took_shifted = path == "shifted" and strides == [1, 1]
    assert len(shifted) == took_shifted
    assert len(calls) == (channels >= gemm.PATCHES_MIN_CHANNELS and not took_shifted)


@pytest.mark.parametrize("size, pointwise", [(12, True), (8, False)], ids=["144-positions", "64-positions"])
@pytest.mark.parametrize("strides", [[1, 1], [2, 2]])
@pytest.mark.parametrize("ci, co", [(7, 5), (5, 7)], ids=["more-inputs", "more-outputs"])
def test_pointwise_conv_weight_grad_matches_float64(size: int, pointwise: bool, strides, ci: int, co: int,
                                                    monkeypatch) -> None:
    """A 1×1 Conv's weight gradient over many output positions is one GEMM per sample on the tensors as they
    are (strided: on every stride-th position), its rows the side with more channels; against the float64
    sum and the unfused steps."""
    from onnxtrain.engine.fusion import gemm

    calls: list[int] = []
    real = gemm._pointwise_weight_grad
    monkeypatch.setattr(gemm, "_pointwise_weight_grad", lambda *a: calls.append(1) or real(*a))
    n = [
        helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2, 3]),
        helper.make_node("Transpose", ["dy"], ["dyt"], perm=[1, 0, 2, 3]),
        helper.make_node("Conv", ["xt", "dyt"], ["c"], dilations=strides),
        helper.make_node("Transpose", ["c"], ["dw"], perm=[1, 0, 2, 3]),
    ]
    m = model(n, ["x", "dy"], ["dw"])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["FusedConvWeightGrad"]
    rng = np.random.default_rng(5)
    side = (size - 1) * strides[0] + 1  # a 1×1 kernel exactly
    x = rng.standard_normal((3, ci, side, side)).astype(np.float32)
    dy = rng.standard_normal((3, co, size, size)).astype(np.float32)
    got = fused.run({"x": x, "dy": dy})[0]
    assert got.shape == (co, ci, 1, 1) and got.flags.c_contiguous
    xs = x[:, :, ::strides[0], ::strides[1]].astype(np.float64)
    want = np.einsum("nohw,nchw->oc", dy.astype(np.float64), xs)[:, :, None, None]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    np.testing.assert_allclose(got, plain.run({"x": x, "dy": dy})[0], rtol=1e-5, atol=1e-5)
    assert len(calls) == pointwise


# ---- whole training steps --------------------------------------------------------------------------------
@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer", "LambOptimizer"])
def test_training_session_is_bit_identical_with_and_without_fusion(opt: str, monkeypatch) -> None:
    def session() -> TrainingSession:
        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = opt
        if opt == "AdamOptimizer":
            names = ["W1", "b1", "W2", "b2"]
            p.optimizer_attributes_map = {n: {"lambda": 0.01} for n in names}
            p.optimizer_int_attributes_map = {n: {"weight_decay_mode": 1} for n in names}
        return TrainingSession(mlp_model(din=8, dh=300, dout=4).SerializeToString(), p)

    fused = session()
    monkeypatch.setenv("ONNXTRAIN_FUSION", "0")
    plain = session()
    assert len(fused._plan.steps) < len(plain._plan.steps)
    lr = np.array([0.01], np.float32)
    for x, y in batches(6, 16):
        a = fused.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]
        b = plain.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0]
        assert a == b
    sa, sb = fused.get_state(), plain.get_state()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_on_device_api_is_bit_identical_with_and_without_fusion(tmp_path, monkeypatch) -> None:
    open_ = on_device_mlp(tmp_path)
    fused = open_()[1:]
    monkeypatch.setenv("ONNXTRAIN_FUSION", "0")
    plain = open_()[1:]
    for x, y in batches(6, 16):
        losses = []
        for module, opt in (fused, plain):
            losses.append(module(x, y))
            opt.step()
            module.lazy_reset_grad()
        assert losses[0] == losses[1]
    np.testing.assert_array_equal(fused[0].get_contiguous_parameters(), plain[0].get_contiguous_parameters())


def test_matmul_bias_add_runs_in_place_and_is_bit_identical() -> None:
    from onnx import TensorProto, helper, numpy_helper

    from onnxtrain.ir.builder import make_model

    rng = np.random.default_rng(3)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["b", "p"], ["y"])]
    g = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 5, 8])], [w, b])
    model = make_model(g, 17)
    fused, plain = Plan(model), Plan(model, fuse=False)
    assert ops(fused) == ["FusedMatMulAdd"]
    x = rng.standard_normal((4, 5, 16)).astype(np.float32)
    a1, a2 = fused.run({"x": x})[0], fused.run({"x": x})[0]
    want = plain.run({"x": x})[0]
    assert a1.tobytes() == want.tobytes() and a2.tobytes() == want.tobytes()
    assert not np.shares_memory(a1, a2)  # a fresh product every run


def linear_gelu(bias_shape: list[int], product_read_elsewhere: bool = False) -> onnx.ModelProto:
    """x·W + b, then the exported exact GELU; W an initializer, b an input of the given declared shape;
    optionally the product is a graph output too."""
    rng = np.random.default_rng(5)
    w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]), helper.make_node("Add", ["p", "b"], ["h"]),
             *gelu_nodes("h", "y")]
    outs = [helper.make_tensor_value_info("y", F, None)]
    if product_read_elsewhere:
        outs.append(helper.make_tensor_value_info("p", F, None))
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["n", 16]),
                                       helper.make_tensor_value_info("b", F, bias_shape)], outs, [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_bias_add_of_a_product_stays_out_of_the_cluster_and_adds_in_place() -> None:
    """A Linear layer's bias Add is left to the MatMul, which adds it into its product; the GELU after it is
    one cluster; the bits are those of the unfused graph."""
    fused, plain = Plan(linear_gelu([8])), Plan(linear_gelu([8]), fuse=False)
    assert ops(fused) == ["FusedMatMulAdd", "FusedElementwise"]
    rng = np.random.default_rng(6)
    for rows in (64, 3):
        feeds = {"x": (2 * rng.standard_normal((rows, 16))).astype(np.float32),
                 "b": rng.standard_normal(8).astype(np.float32)}
        assert fused.run(feeds)[0].tobytes() == plain.run(feeds)[0].tobytes()


@pytest.mark.parametrize("bias_shape, elsewhere", [([64, 8], False), (None, False), ([1], False), ([], False),
                                                   ([8], True)])
def test_add_of_a_product_joins_the_cluster_unless_it_is_a_bias(bias_shape, elsewhere) -> None:
    """A same-shape operand (a residual), one of unknown rank, one element, or a product that is read
    elsewhere keep the Add in the cluster, as before."""
    m = linear_gelu(bias_shape, product_read_elsewhere=elsewhere)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["MatMul", "FusedElementwise"]
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal((64, 16)).astype(np.float32),
             "b": rng.standard_normal([64, 8] if bias_shape is None else bias_shape).astype(np.float32)}
    for got, want in zip(fused.run(feeds), plain.run(feeds)):
        assert got.tobytes() == want.tobytes()


# ---- shape arithmetic: folded or memoised ------------------------------------------------------------------
def dynamic_reshape(extra_inits=()) -> onnx.ModelProto:
    """y = Reshape(x, [N, 2, 3]) with N read from x's shape at run time, as torch exports it."""
    n = [
        const("zero", np.array(0, np.int64)),
        const("axes", np.array([0], np.int64)),
        const("tail", np.array([2, 3], np.int64)),
        helper.make_node("Unsqueeze", ["tail", "axes"], ["tail2"]),  # constants only: folded
        helper.make_node("Squeeze", ["tail2", "axes"], ["tail1"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "tail1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    return model(n, ["x"], ["y"], extra_inits)


def test_shape_steps_are_memoised_and_constant_steps_folded() -> None:
    from onnxtrain.engine.fusion.shapes import is_memoized

    p = Plan(dynamic_reshape())
    kinds = {st.node.op_type: is_memoized(st) for st in p.steps}
    assert "Unsqueeze" in kinds and "Squeeze" not in kinds  # the constant pair was folded at compile time
    assert kinds == {"Shape": True, "Gather": True, "Unsqueeze": True, "Concat": True, "Reshape": False}
    rng = np.random.default_rng(0)
    for batch in (4, 7, 4, 1, 7):  # revisits a shape seen before: the remembered result must be the right one
        x = rng.standard_normal((batch, 6)).astype(np.float32)
        (y,) = p.run({"x": x})
        np.testing.assert_array_equal(y, x.reshape(batch, 2, 3))
    concat = next(st for st in p.steps if st.node.op_type == "Concat")
    held = [outs for _, outs in concat.fn.entries.values()]
    assert len(held) == 3 and all(not o[0].flags.writeable for o in held)  # read-only: cannot be corrupted


def test_shape_memo_leaves_graph_outputs_large_results_and_random_ops_alone() -> None:
    from onnxtrain.engine.fusion import shapes
    from onnxtrain.engine.fusion.shapes import is_memoized

    n = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["zeros"], value=helper.make_tensor("v", F, [1], [2.0])),
        const("ratio", np.float32(0.5)),
        const("train", np.array(True)),
        helper.make_node("Dropout", ["zeros", "ratio", "train"], ["drop"], seed=1),
        helper.make_node("Add", ["drop", "x"], ["r"]),
        helper.make_node("Add", ["zeros", "x"], ["y"]),
        helper.make_node("Shape", ["y"], ["sy"]),
    ]
    g = helper.make_graph(
        n, "g", [helper.make_tensor_value_info("x", F, None)],
        [helper.make_tensor_value_info("y", F, None), helper.make_tensor_value_info("r", F, None),
         helper.make_tensor_value_info("sy", TensorProto.INT64, None)],
    )
    p = Plan(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), fuse=True)
    memo = {st.node.output[0]: is_memoized(st) for st in p.steps}
    assert memo == {"s": True, "zeros": True, "drop": False, "r": False, "y": False, "sy": False}
    big = np.ones(shapes.MAX_ELEMENTS + 1, np.float32)
    for x in (np.ones(3, np.float32), big, big):
        y, r, sy = p.run({"x": x})
        np.testing.assert_array_equal(y, x + 2)
        assert set(np.unique(r - x).tolist()) <= {0.0, 4.0}
        assert sy.flags.writeable and sy.tolist() == [x.size]
    fill = next(st for st in p.steps if st.node.op_type == "ConstantOfShape")
    assert [o[0].size for _, o in fill.fn.entries.values()] == [3]  # the large result was not kept


def test_shape_memo_follows_a_fed_integer_initializer() -> None:
    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "tail")]
    n = [
        const("zero", np.array(0, np.int64)),
        const("axes", np.array([0], np.int64)),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"]),
        helper.make_node("Unsqueeze", ["n", "axes"], ["n1"]),
        helper.make_node("Concat", ["n1", "tail"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    p = Plan(model(n, ["x"], ["y"], inits))
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert p.run({"x": x})[0].shape == (2, 2, 3)
    assert p.run({"x": x, "tail": np.array([3, 2], np.int64)})[0].shape == (2, 3, 2)
    assert p.run({"x": x})[0].shape == (2, 2, 3)


# ---- Sum as a chain of Adds ------------------------------------------------------------------------------
def test_sum_of_gradient_contributions_joins_their_cluster_bit_identically() -> None:
    """The gradient of a tensor used three times is a Sum of three products: with the Sum as Adds, the
    products and their sum are one cluster; broadcasting and a two-input Sum keep the Sum kernel's order."""
    n = [
        helper.make_node("Mul", ["g", "a"], ["p1"]),
        helper.make_node("Mul", ["g", "b"], ["p2"]),
        helper.make_node("Mul", ["p1", "b"], ["p3"]),
        helper.make_node("Sum", ["p1", "p2", "p3", "row"], ["dx"]),  # row broadcasts onto (N, C)
        helper.make_node("Sum", ["dx", "a"], ["y"]),
    ]
    m = model(n, ["g", "a", "b", "row"], ["y"])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["FusedElementwise"] and "Sum" in ops(plain)
    rng = np.random.default_rng(5)
    feeds = {k: rng.standard_normal((6, 7)).astype(np.float32) for k in ("g", "a", "b")}
    feeds["row"] = rng.standard_normal(7).astype(np.float32)
    assert fused.run(feeds)[0].tobytes() == plain.run(feeds)[0].tobytes()
    feeds["row"] = rng.standard_normal((3, 1, 7)).astype(np.float32)  # now Sum broadcasts to (3, 6, 7)
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    assert got.shape == (3, 6, 7) and got.tobytes() == want.tobytes()


def test_first_run_of_a_cluster_needs_no_more_memory_than_later_runs() -> None:
    """The first run traces the cluster with the original kernels; values that die inside it are dropped as
    they die, so the first step's memory peak (a process's peak RSS) is that of the later ones."""
    import tracemalloc

    n = [helper.make_node("Mul", ["x", "x"], ["t0"])]
    n += [helper.make_node("Add" if i % 2 else "Mul", [f"t{i}", "x"], [f"t{i + 1}"]) for i in range(10)]
    plan = Plan(model(n, ["x"], ["t10"]))
    x = np.full(1 << 18, 0.5, np.float32)  # 1 MiB per value
    peaks = []
    for _ in range(2):
        tracemalloc.start()
        plan.run({"x": x})
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[0] <= peaks[1] + 2 * x.nbytes, peaks  # not eleven values held at once


# ---- lazy selects ----------------------------------------------------------------------------------------
def select_model(lazy_side: int, op: str = "Add") -> onnx.ModelProto:
    """out = Where(c, x, op(b, x)) (lazy_side 2) or Where(c, op(b, x), x) (lazy_side 1); c a bool input."""
    lazy = helper.make_node(op, ["b", "x"], ["y"])
    pair = ["x", "y"] if lazy_side == 2 else ["y", "x"]
    nodes = [lazy, helper.make_node("Where", ["c", *pair], ["out"])]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, None),
         helper.make_tensor_value_info("x", F, None), helper.make_tensor_value_info("b", F, None)],
        [helper.make_tensor_value_info("out", F, None)],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("side", [1, 2])
@pytest.mark.parametrize("op", ["Add", "Mul"])
def test_where_on_one_flag_runs_only_the_branch_it_returns(side: int, op: str) -> None:
    from onnx.reference import ReferenceEvaluator

    m = select_model(side, op)
    fused, ref = Plan(m), ReferenceEvaluator(m)
    assert ops(fused) == ["LazySelect"]
    rng = np.random.default_rng(3)
    x, b = rng.standard_normal((5, 6)).astype(np.float32), rng.standard_normal((5, 6)).astype(np.float32)
    cases = [
        np.array([True]), np.array(False), np.array([[False]]),
        np.array([True, False, True, True, False, False]),  # not one element: both branches, as unfused
    ]
    for c in cases:
        for bb in (b, b[0], rng.standard_normal((2, 5, 6)).astype(np.float32)):  # b may broadcast x up
            feeds = {"c": c, "x": x, "b": bb}
            got = fused.run(feeds)[0]
            want = ref.run(None, feeds)[0]
            assert got.shape == want.shape and got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)
    # a flag that picks x returns x itself: the branch was not computed
    picks_x = np.array([side == 2])
    assert fused.run({"c": picks_x, "x": x, "b": b})[0] is x


def test_select_branch_that_is_read_elsewhere_is_not_made_lazy() -> None:
    m = select_model(2)
    m.graph.output.append(helper.make_tensor_value_info("y", F, None))
    assert "LazySelect" not in ops(Plan(m))


def test_on_device_gradient_accumulation_is_bit_identical_unfused(tmp_path, monkeypatch) -> None:
    """The accumulator Where(reset, g, buffer + g) is a lazy select: over accumulating and resetting calls
    the gradients and the weights are the unfused plan's, bit for bit."""
    open_ = on_device_mlp(tmp_path)
    fused = open_()[1:]
    assert "LazySelect" in ops(fused[0]._train_plan)
    monkeypatch.setenv("ONNXTRAIN_FUSION", "0")
    plain = open_()[1:]
    assert "LazySelect" not in ops(plain[0]._train_plan)
    data = batches(6, 16)
    for k, (x, y) in enumerate(data):
        for module, opt in (fused, plain):
            module(x, y)
            if k % 3 == 2:  # two calls accumulate into the third's gradients, then a step and a reset
                opt.step()
                module.lazy_reset_grad()
        grads = [{n: p.grad.copy() for n, p in m.state.parameters} for m, _ in (fused, plain)]
        for n in grads[0]:
            np.testing.assert_array_equal(grads[0][n], grads[1][n])
    np.testing.assert_array_equal(fused[0].get_contiguous_parameters(), plain[0].get_contiguous_parameters())


# ---- masked softmax --------------------------------------------------------------------------------------
def masked_softmax_model(fill: float, fill_side: int = 1, dtype: int = F, axis: int = -1,
                         where_is_output: bool = False) -> onnx.ModelProto:
    """out = Softmax(Where(c, fill, x)) (fill_side 1) or Softmax(Where(c, x, fill)) (fill_side 2)."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    pair = ["fill", "x"] if fill_side == 1 else ["x", "fill"]
    nodes = [
        const("fill", np.array(fill, np_dt)),
        helper.make_node("Where", ["c", *pair], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["out"], axis=axis),
    ]
    outs = [helper.make_tensor_value_info("out", dtype, None)]
    if where_is_output:
        outs.append(helper.make_tensor_value_info("masked", dtype, None))
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, None),
         helper.make_tensor_value_info("x", dtype, None)],
        outs,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def causal(s: int, fill_side: int) -> np.ndarray:
    """The (1, 1, s, s) mask whose true entries are where ``fill_side`` puts the fill: above the diagonal."""
    above = np.triu(np.ones((s, s), bool), 1).reshape(1, 1, s, s)
    return above if fill_side == 1 else ~above


@pytest.mark.parametrize("fill_side", [1, 2])
@pytest.mark.parametrize("dtype", [F, TensorProto.DOUBLE])
def test_causal_masked_softmax_is_one_step_bit_identical_to_unfused(fill_side, dtype) -> None:
    ort = pytest.importorskip("onnxruntime")
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    m = masked_softmax_model(-np.inf, fill_side, dtype)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["MaskedSoftmax"]
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(11)
    c = causal(16, fill_side)
    for shape in [(3, 2, 16, 16), (1, 4, 16, 16)]:
        feeds = {"c": c, "x": (rng.standard_normal(shape) * 3).astype(np_dt)}
        got = fused.run(feeds)[0]
        assert got.dtype == np_dt and got.shape == shape
        masked = np.broadcast_to(causal(16, 1), shape)
        assert (got[masked] == 0).all()  # exactly 0, as unfused
        np.testing.assert_array_equal(got, plain.run(feeds)[0])  # the unfused softmax also skips the shift
        tol = dict(rtol=1e-6, atol=1e-7) if np_dt == np.float32 else dict(rtol=1e-14, atol=1e-15)
        np.testing.assert_allclose(got, sess.run(None, feeds)[0], **tol)


def test_masked_softmax_with_unsafe_scores_or_another_axis_runs_the_original_steps() -> None:
    rng = np.random.default_rng(12)
    c = causal(8, 1)
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    x[1, 2, 5, 3] = 500.0  # exp overflows: the shifted softmax is needed
    x[0, 0, 7, 7] = np.nan
    for axis in (-1, 1):
        m = masked_softmax_model(-np.inf, axis=axis)
        fused, plain = Plan(m), Plan(m, fuse=False)
        assert ops(fused) == ["MaskedSoftmax"]
        for feeds in ({"c": c, "x": x}, {"c": c, "x": x[:, :, :, :1].copy()}):
            with np.errstate(invalid="ignore"):  # the NaN score, and rows with every score masked
                got, want = fused.run(feeds)[0], plain.run(feeds)[0]
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axis", [-5, 4, 7])
def test_masked_softmax_over_an_axis_out_of_range_fails_as_unfused(axis: int) -> None:
    m = masked_softmax_model(-np.inf, axis=axis)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["MaskedSoftmax"]
    feeds = {"c": causal(4, 1), "x": np.arange(96, dtype=np.float32).reshape(2, 3, 4, 4) / 10}
    errors = []
    for plan in (fused, plain):
        with pytest.raises(Exception, match="out of range") as e:
            plan.run(feeds)
        errors.append(str(e.value))
    assert errors[0] == errors[1]


def test_masked_softmax_per_sample_masks_and_split_rows_are_bit_identical_to_unfused() -> None:
    """A mask per sample (B, 1, S, S), a fully masked row (NaN, as unfused), and rows split over threads."""
    from onnxtrain.engine.parallel import running_with

    m = masked_softmax_model(-np.inf)
    fused, plain = Plan(m), Plan(m, fuse=False)
    rng = np.random.default_rng(13)
    for shape in [(3, 2, 8, 8), (8, 4, 128, 128)]:  # the second is large enough to split
        b, _, s, _ = shape
        c = rng.random((b, 1, s, s)) < 0.3
        c[0, 0, 2, :] = True  # every score of one row masked
        feeds = {"c": c, "x": rng.standard_normal(shape).astype(np.float32)}
        with np.errstate(invalid="ignore"):  # 0 / 0 in the masked row
            want = plain.run(feeds)[0]
            with running_with(2):
                got = fused.run(feeds)[0]
        assert np.isnan(got[0, :, 2]).all()
        np.testing.assert_array_equal(got, want)
        assert (got[np.broadcast_to(c, shape)] == 0)[~np.isnan(got[np.broadcast_to(c, shape)])].all()


def test_where_that_is_not_a_softmax_mask_is_left_alone() -> None:
    assert "MaskedSoftmax" not in ops(Plan(masked_softmax_model(-5.0)))  # exp(-5) is not 0
    # finite but as low as it gets: the unfused softmax shifts, so the fused one could not match its bits
    assert "MaskedSoftmax" not in ops(Plan(masked_softmax_model(float(np.finfo(np.float32).min))))
    assert "MaskedSoftmax" not in ops(Plan(masked_softmax_model(-np.inf, where_is_output=True)))


# ---- Sum of padded pieces --------------------------------------------------------------------------------
def padded_sum_model(order: tuple[int, ...] = (0, 1, 2), axis: int = 0,
                     fed_pads: bool = False, elem: int = F) -> onnx.ModelProto:
    """out = Sum(Pad(p_i, pads_i)) over pieces p0, p1, p2 of shape (1, 4, 5) moved to the axis; the pads put
    piece i at index i of ``axis`` (length 3) unless fed at run time (inputs pads0..pads2)."""
    nodes, ins = [], []
    for i in range(3):
        if not fed_pads:
            pads = np.zeros(6, np.int64)
            pads[axis], pads[3 + axis] = i, 2 - i
            nodes.append(const(f"pads{i}", pads))
        else:
            ins.append(helper.make_tensor_value_info(f"pads{i}", TensorProto.INT64, [6]))
        nodes.append(helper.make_node("Pad", [f"p{i}", f"pads{i}"], [f"padded{i}"]))
    nodes.append(helper.make_node("Sum", [f"padded{i}" for i in order], ["out"]))
    inputs = [helper.make_tensor_value_info(f"p{i}", elem, None) for i in range(3)] + ins
    g = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("out", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def pieces(axis: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    shape = [3, 4, 5]
    shape[axis] = 1
    feeds = {f"p{i}": rng.standard_normal(shape).astype(np.float32) for i in range(3)}
    feeds["p1"].reshape(-1)[:3] = -0.0  # the Sum's additions of zeros turn -0.0 into +0.0
    return feeds


def assert_same_bits(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("axis", [0, 2])
@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_sum_of_pads_tiling_an_axis_is_one_step_with_the_same_bits(axis: int, order) -> None:
    m = padded_sum_model(order, axis)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["PadsConcat"]
    feeds = pieces(axis, np.random.default_rng(21))
    got = fused.run(feeds)[0]
    assert_same_bits(got, plain.run(feeds)[0])
    assert not np.signbit(got[got == 0]).any()


def test_float16_sum_of_pads_has_the_sums_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 pieces (the Sum adds in float32 and rounds once) written by a lookup in numpy's x + 0."""
    from onnxtrain.engine.kernels import half_cast

    looked_up = []
    by_table = half_cast.by_table

    def counted(fn, x, out=None):
        looked_up.append(x.size)
        return by_table(fn, x, out)

    monkeypatch.setattr(half_cast, "by_table", counted)
    m = padded_sum_model(elem=TensorProto.FLOAT16)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["PadsConcat"]
    every = np.arange(1 << 16, dtype=np.uint16).view(np.float16)  # -0.0, NaN payloads, inf, subnormals
    feeds = {f"p{i}": np.roll(every, 999 * i)[: 64 * 256].reshape(1, 64, 256) for i in range(3)}
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    assert got.dtype == want.dtype == np.float16 and got.shape == (3, 64, 256)
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    assert looked_up == [64 * 256] * 3  # the fused step's route, not the original Pads and Sum


def test_sum_of_pads_that_do_not_tile_runs_the_original_steps() -> None:
    m = padded_sum_model(fed_pads=True)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["PadsConcat"]
    feeds = pieces(0, np.random.default_rng(22))

    def pads(*per_piece: tuple[int, ...]) -> dict[str, np.ndarray]:
        return {f"pads{i}": np.array(p, np.int64) for i, p in enumerate(per_piece)}

    for ps in [
        pads((0, 0, 0, 2, 0, 0), (1, 0, 0, 1, 0, 0), (2, 0, 0, 0, 0, 0)),  # tiles: concatenated
        pads((0, 0, 0, 3, 0, 0), (1, 0, 0, 2, 0, 0), (2, 0, 0, 1, 0, 0)),  # a gap at the end
        pads((0, 0, 0, 2, 0, 0), (0, 0, 0, 2, 0, 0), (2, 0, 0, 0, 0, 0)),  # two pieces overlap
        pads((0, 0, 0, 2, 1, 0), (1, 0, 0, 1, 1, 0), (2, 0, 0, 0, 1, 0)),  # a second axis padded too
    ]:
        f = {**feeds, **ps}
        assert_same_bits(fused.run(f)[0], plain.run(f)[0])


def test_pads_read_elsewhere_are_left_alone() -> None:
    m = padded_sum_model()
    m.graph.output.append(helper.make_tensor_value_info("padded1", F, None))
    assert "PadsConcat" not in ops(Plan(m))


@pytest.mark.parametrize("name", ["transformer_encoder", "gpt_block"])
def test_torch_attention_training_is_bit_identical_with_and_without_fusion(name: str, monkeypatch) -> None:
    """The exported attentions' fusions (the q, k, v gradients joined by PadsConcat, the causal
    MaskedSoftmax) leave a legacy training run's losses and weights bit for bit as unfused."""
    from tests import models

    model, feeds, _ = models.export(name, training=True, with_loss=True, dropout=0.0)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    fused = TrainingSession(model.SerializeToString(), p)
    monkeypatch.setenv("ONNXTRAIN_FUSION", "0")
    plain = TrainingSession(model.SerializeToString(), p)
    expected = {"transformer_encoder": "PadsConcat", "gpt_block": "MaskedSoftmax"}[name]
    assert expected in ops(fused._plan) and expected not in ops(plain._plan)
    lr = np.array([1e-3], np.float32)
    for _ in range(3):
        a = fused.run(["loss"], {**feeds, "Learning_Rate": lr})[0]
        b = plain.run(["loss"], {**feeds, "Learning_Rate": lr})[0]
        assert a == b
    sa, sb = fused.get_state(), plain.get_state()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)


def test_shape_steps_reading_an_initializer_the_caller_handed_in_are_not_memoized() -> None:
    # the caller's array may be rewritten between runs (it is not the model's own read-only copy)
    from onnx import numpy_helper

    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "zero1"], ["n1"]),
             helper.make_node("Concat", ["n1", "tail"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"])]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"),
             numpy_helper.from_array(np.array([0], np.int64), "zero1"),
             numpy_helper.from_array(np.array([2, 3], np.int64), "tail")]
    m = model(nodes, ["x"], ["y"], inits)
    tail = np.array([2, 3], np.int64)
    fused, plain = Plan(m, initializers={"tail": tail}), Plan(m, fuse=False, initializers={"tail": tail})
    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert fused.run({"x": x})[0].shape == plain.run({"x": x})[0].shape == (2, 2, 3)
    tail[:] = [3, 2]
    assert fused.run({"x": x})[0].shape == plain.run({"x": x})[0].shape == (2, 3, 2)
    assert tail.flags.writeable
    assert Plan(m).run({"x": x})[0].shape == (2, 2, 3)  # the model's own initializer: memoized as before


def test_a_cluster_fed_ndarray_subclasses_runs_on_their_shapes_and_dtypes(tmp_path) -> None:
    # a cluster keys its compiled programs on its inputs' shapes and dtypes: a subclass (np.memmap, a data
    # set read from disk) fed straight to a plan must not reuse the program of another shape or dtype
    nodes = [helper.make_node("Mul", ["x", "y"], ["a"]), helper.make_node("Add", ["a", "x"], ["b"]),
             helper.make_node("Tanh", ["b"], ["c"]), helper.make_node("Sub", ["c", "y"], ["o"])]
    m = model(nodes, ["x", "y"], ["o"])
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert ops(fused) == ["FusedElementwise"]
    rng = np.random.default_rng(0)
    for i, (shape, dt) in enumerate([((30, 40), np.float32), ((1, 40), np.float32), ((30, 40), np.float64),
                                     ((50, 60), np.float32), ((300, 1000), np.float32)]):
        feeds = {}
        for name in ("x", "y"):
            mm = np.memmap(tmp_path / f"{name}{i}.bin", dtype=dt, mode="w+", shape=shape)
            mm[:] = rng.standard_normal(shape)
            feeds[name] = mm
        got, want = fused.run(feeds)[0], plain.run({k: np.array(v) for k, v in feeds.items()})[0]
        assert type(got) is np.ndarray and got.shape == shape and got.dtype == dt
        np.testing.assert_array_equal(got, want)

"""The legacy TrainingSession: optimizers against torch and float64 references, accumulation, state."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

import onnxtrain
from onnxtrain import RunOptions, SessionOptions, TrainingParameters, TrainingSession
from tests.session.helpers import adam_ref, batches, lamb_ref, mlp_model, params, weights_of

LR = np.array([0.05], np.float32)


def assert_rel(actual, desired, rel: float, name: str) -> None:
    """‖actual − desired‖ / ‖desired‖ ≤ rel (tensor-wise relative error, robust to single-ulp flips)."""
    err = np.linalg.norm(np.asarray(actual, np.float64) - desired) / max(np.linalg.norm(desired), 1e-30)
    assert err <= rel, f"{name}: relative error {err:.3g} > {rel}"


def feeds(x, y, lr=LR):
    return {"x": x, "y": y, "Learning_Rate": lr}


def torch_mlp(model: onnx.ModelProto):
    torch = pytest.importorskip("torch")
    w = weights_of(model)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        net[0].weight.copy_(torch.from_numpy(w["W1"]))
        net[0].bias.copy_(torch.from_numpy(w["b1"]))
        net[2].weight.copy_(torch.from_numpy(w["W2"]))
        net[2].bias.copy_(torch.from_numpy(w["b2"]))
    return torch, net


def torch_state(net) -> dict[str, np.ndarray]:
    return {
        "W1": net[0].weight.detach().numpy(),
        "b1": net[0].bias.detach().numpy(),
        "W2": net[2].weight.detach().numpy(),
        "b2": net[2].bias.detach().numpy(),
    }


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_matches_torch_for_20_steps(opt: str) -> None:
    model = mlp_model()
    torch, net = torch_mlp(model)
    p = params(opt, enable_grad_norm_clip=False)
    sess = TrainingSession(model.SerializeToString(), p)
    topt = (
        torch.optim.SGD(net.parameters(), lr=float(LR[0]))
        if opt == "SGDOptimizer"
        else torch.optim.Adam(net.parameters(), lr=float(LR[0]), betas=(0.9, 0.999), eps=1e-8)
    )
    for x, y in batches(20, 16):
        ours = sess.run(["loss"], feeds(x, y))[0]
        topt.zero_grad()
        tl = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
        tl.backward()
        topt.step()
        np.testing.assert_allclose(ours, tl.item(), rtol=1e-5)
    state = sess.get_state()
    for k, v in torch_state(net).items():
        assert_rel(state[k], v, 1e-5, k)


def _grads(model: onnx.ModelProto, w: dict[str, np.ndarray], x, y) -> dict[str, np.ndarray]:
    """Exact gradients from a no-optimizer session exposing them."""
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.set_gradients_as_graph_outputs = True
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in m.graph.initializer:
        t.CopyFrom(onnx.numpy_helper.from_array(w[t.name].astype(np.float32), t.name))
    s = TrainingSession(m.SerializeToString(), p)
    names = [f"{k}_grad" for k in sorted(w)]
    return dict(zip(sorted(w), [g.astype(np.float64) for g in s.run(names, {"x": x, "y": y})]))


def follow(model: onnx.ModelProto, p: TrainingParameters, update, steps: int = 20,
           keep=lambda m: m, keep_second=None) -> tuple[TrainingSession, dict, dict, dict]:
    """``steps`` steps of the session next to ``update(w, g, m1, m2, t) -> (w, m1, m2)`` in float64 (each
    reference step uses the exact gradient at the reference weights; ``keep`` is applied to the moments
    the reference stores, ``keep_second`` instead to the second ones when given). Returns the session and
    the reference weights and moments."""
    keep_second = keep if keep_second is None else keep_second
    sess = TrainingSession(model.SerializeToString(), p)
    w = {k: v.astype(np.float64) for k, v in weights_of(model).items()}
    m1 = {k: np.zeros_like(v) for k, v in w.items()}
    m2 = {k: np.zeros_like(v) for k, v in w.items()}
    for t, (x, y) in enumerate(batches(steps, 16), start=1):
        g = _grads(model, w, x, y)
        sess.run(["loss"], feeds(x, y))
        for k in w:
            w[k], a, b = update(w[k], g[k], m1[k], m2[k], t)
            m1[k], m2[k] = keep(a), keep_second(b)
    return sess, w, m1, m2


def _follow_reference(model: onnx.ModelProto, p: TrainingParameters, update) -> TrainingSession:
    """20 steps of the session next to the float64 reference ``update`` (:func:`follow`); the weights must
    agree."""
    sess, w, _, _ = follow(model, p, update)
    state = sess.get_state()
    for k in w:
        assert_rel(state[k], w[k], 1e-5, k)
    return sess


@pytest.mark.parametrize("mode,bias,lam", [(1, 1, 0.01), (1, 0, 0.0), (0, 0, 0.01)])
def test_adam_modes_against_float64_reference(mode: int, bias: int, lam: float) -> None:
    model = mlp_model(act="Tanh")  # smooth: float32 and float64 trajectories cannot part at a ReLU kink
    names = ["W1", "W2", "b1", "b2"]
    p = params(
        "AdamOptimizer",
        enable_grad_norm_clip=False,
        optimizer_attributes_map={n: {"lambda": lam} for n in names},
        optimizer_int_attributes_map={
            n: {"weight_decay_mode": mode, "do_bias_correction": bias} for n in names
        },
    )
    sess = _follow_reference(
        model,
        p,
        lambda w, g, m1, m2, t: adam_ref(w, g, m1, m2, t, float(LR[0]), lam=lam, bias=bool(bias), mode=mode),
    )
    assert sess.get_optimizer_state()["W1"]["Update_Count"].tolist() == [21]


def test_adam_per_weight_attributes_and_counts_against_float64_reference() -> None:
    """The bias corrections of all weights are computed as one vector: each weight must still get its own
    α, β, do_bias_correction and Update_Count."""
    model = mlp_model(act="Tanh")
    attrs = {  # alpha, beta, do_bias_correction, first Update_Count
        "W1": (0.8, 0.99, 1, 4), "W2": (0.9, 0.999, 0, 1), "b1": (0.95, 0.9, 1, 1), "b2": (0.9, 0.98, 1, 9)
    }
    modes = {"W1": 1, "W2": 0, "b1": 0, "b2": 1}  # weight decay mode 1 takes its step size from the vector
    p = params(
        "AdamOptimizer",
        enable_grad_norm_clip=False,
        optimizer_attributes_map={
            n: {"alpha": a, "beta": b, "lambda": 0.01} for n, (a, b, _, _) in attrs.items()
        },
        optimizer_int_attributes_map={
            n: {"do_bias_correction": c, "weight_decay_mode": modes[n]} for n, (_, _, c, _) in attrs.items()
        },
    )
    sess = TrainingSession(model.SerializeToString(), p)
    sess.load_state({f"Update_Count_{n}": np.array([t0], np.int64) for n, (_, _, _, t0) in attrs.items()})
    w = {k: v.astype(np.float64) for k, v in weights_of(model).items()}
    m1 = {k: np.zeros_like(v) for k, v in w.items()}
    m2 = {k: np.zeros_like(v) for k, v in w.items()}
    for step, (x, y) in enumerate(batches(6, 16)):
        g = _grads(model, w, x, y)
        sess.run(["loss"], feeds(x, y))
        for k, (a, b, c, t0) in attrs.items():
            w[k], m1[k], m2[k] = adam_ref(
                w[k], g[k], m1[k], m2[k], t0 + step, float(LR[0]), a, b, lam=0.01, bias=c > 0, mode=modes[k]
            )
    state = sess.get_state()
    for k, (_, _, _, t0) in attrs.items():
        assert_rel(state[k], w[k], 1e-5, k)
        assert state[f"Update_Count_{k}"].tolist() == [t0 + 6]


def test_lamb_against_float64_reference() -> None:
    model = mlp_model(act="Tanh")
    names = ["W1", "W2", "b1", "b2"]
    p = params(
        "LambOptimizer",
        enable_grad_norm_clip=False,
        optimizer_attributes_map={n: {"lambda": 0.01, "ratio_min": 0.05, "ratio_max": 5.0} for n in names},
    )
    sess = _follow_reference(
        model,
        p,
        lambda w, g, m1, m2, t: lamb_ref(w, g, m1, m2, t, float(LR[0]), lam=0.01, rmin=0.05, rmax=5.0),
    )
    assert sess.get_optimizer_state()["shared_optimizer_state"]["Step"].tolist() == [21]


def test_lamb_ratio_min_above_ratio_max_wins() -> None:
    """onnxruntime's kernel takes max(ratio_min, min(ratio_max, r)): with ratio_min > ratio_max the trust
    ratio is ratio_min (ONNX's Clip would give ratio_max)."""
    model = mlp_model(act="Tanh")
    names = ["W1", "W2", "b1", "b2"]
    p = params("LambOptimizer", enable_grad_norm_clip=False,
               optimizer_attributes_map={n: {"ratio_min": 2.0, "ratio_max": 0.5} for n in names})
    _follow_reference(model, p, lambda w, g, m1, m2, t: lamb_ref(w, g, m1, m2, t, float(LR[0]), rmin=2.0,
                                                                   rmax=0.5))


@pytest.mark.parametrize("maps", [
    {"optimizer_attributes_map": {"W1": {}, "W2": {"ratio_max": 0.01}, "b1": {}, "b2": {}}},
    {"optimizer_int_attributes_map": {"W1": {}, "W2": {}, "b1": {}, "b2": {"do_bias_correction": 1}}},
    {"optimizer_attributes_map": {"W1": {"ratio_min": 0.5}, "W2": {"ratio_min": 0.25}, "b1": {}, "b2": {}}},
])
def test_lamb_shared_options_must_repeat_the_first_weights(maps: dict) -> None:
    """Lamb's ratio_min, ratio_max and do_bias_correction are the first weight's (sorted by name), and a
    weight that sets one to another value is refused, as onnxruntime's LambOptimizerBuilder::Build enforces
    (lamb_optimizer_builder.cc): a value set on a later weight alone was taken for every weight."""
    p = params("LambOptimizer", enable_grad_norm_clip=False, **maps)
    key = next(k for m in maps.values() for d in m.values() for k in d)
    with pytest.raises(ValueError, match=f"{key} is shared by all weights and taken from the first, 'W1'"):
        TrainingSession(mlp_model(act="Tanh").SerializeToString(), p)


def test_lamb_shared_float_options_agree_as_float32() -> None:
    """0.1 and np.float32(0.1) are one attribute value in the graph (float32), as in onnxruntime: accepted."""
    fmap = {"W1": {"ratio_min": 0.1}, "W2": {"ratio_min": float(np.float32(0.1))}, "b1": {}, "b2": {}}
    p = params("LambOptimizer", enable_grad_norm_clip=False, optimizer_attributes_map=fmap)
    TrainingSession(mlp_model(act="Tanh").SerializeToString(), p)


def test_lamb_shared_option_of_the_first_weight_applies_to_all() -> None:
    """Set on the first weight only (the others leave it out), the shared value applies to every weight."""
    model = mlp_model(act="Tanh")
    p = params("LambOptimizer", enable_grad_norm_clip=False,
               optimizer_attributes_map={"W1": {"ratio_max": 0.5}, "W2": {}, "b1": {}, "b2": {}})
    _follow_reference(model, p, lambda w, g, m1, m2, t: lamb_ref(w, g, m1, m2, t, float(LR[0]), rmax=0.5))


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_bias_correction_at_count_zero_is_one(opt: str) -> None:
    """A step count of 0 loaded into the state steps uncorrected, as onnxruntime's
    compute_bias_correction_coefficient gives 1 for counts ≤ 0 (1 − α⁰ = 0 gave NaN weights)."""
    model = mlp_model(act="Tanh")
    names = ["W1", "W2", "b1", "b2"]
    p = params(opt, enable_grad_norm_clip=False,
               optimizer_int_attributes_map={n: {"do_bias_correction": 1} for n in names})
    sess = TrainingSession(model.SerializeToString(), p)
    counts = ["Step"] if opt == "LambOptimizer" else [f"Update_Count_{n}" for n in names]
    sess.load_state({c: np.array([0], np.int64) for c in counts}, strict=False)
    w = {k: v.astype(np.float64) for k, v in weights_of(model).items()}
    x, y = batches(1, 16)[0]
    g = _grads(model, w, x, y)
    sess.run(["loss"], feeds(x, y))
    ref = lamb_ref if opt == "LambOptimizer" else adam_ref
    eps = 1e-6 if opt == "LambOptimizer" else 1e-8
    for k in names:
        want, _, _ = ref(w[k], g[k], 0 * g[k], 0 * g[k], 0, float(LR[0]), eps=eps, bias=True)
        assert np.isfinite(want).all()
        assert_rel(sess.get_state()[k], want, 1e-5, k)


def test_clipping_limits_the_global_norm() -> None:
    model = mlp_model()
    x, y = batches(1, 16)[0]
    g = _grads(model, {k: v.astype(np.float64) for k, v in weights_of(model).items()}, x, y)
    norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
    p = params("AdamOptimizer", optimizer_attributes_map={n: {"max_norm_clip": norm / 10} for n in g})
    sess = TrainingSession(model.SerializeToString(), p)
    out = sess.run(["global_gradient_norm"], feeds(x, y))[0]
    np.testing.assert_allclose(out, norm, rtol=1e-5)
    # the first Adam step with a clipped gradient g/s: m1 = 0.1·g/s, m2 = 0.001·(g/s)², update = lr·sign-ish
    w0 = weights_of(model)
    s = norm / (norm / 10)
    for k in g:
        w, _, _ = adam_ref(w0[k].astype(np.float64), g[k] / s, 0 * g[k], 0 * g[k], 1, float(LR[0]))
        np.testing.assert_allclose(sess.get_state()[k], w, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_legacy_cpu_adam_turns_off_adams_clipping_only(opt: str) -> None:
    """``legacy_cpu_adam`` copies onnxruntime's CPU Adam kernel, which ignored clipping; Lamb had no CPU
    kernel and keeps clipping (it stopped clipping too). Oracle: one float64 step of the spec's update on g/s,
    s = ‖g‖ / max_norm_clip for Lamb, s = 1 for Adam (an epsilon of 0.1 makes Lamb's step depend on s)."""
    model = mlp_model()
    x, y = batches(1, 16)[0]
    g = _grads(model, {k: v.astype(np.float64) for k, v in weights_of(model).items()}, x, y)
    norm = np.sqrt(sum(np.sum(v * v) for v in g.values()))
    p = params(opt, legacy_cpu_adam=True,
               optimizer_attributes_map={n: {"max_norm_clip": norm / 10, "epsilon": 0.1} for n in g})
    sess = TrainingSession(model.SerializeToString(), p)
    sess.run(["loss"], feeds(x, y))
    w0 = weights_of(model)
    s, ref = (1.0, adam_ref) if opt == "AdamOptimizer" else (10.0, lamb_ref)
    for k in g:
        w, _, _ = ref(w0[k].astype(np.float64), g[k] / s, 0 * g[k], 0 * g[k], 1, float(LR[0]), eps=0.1)
        np.testing.assert_allclose(sess.get_state()[k], w, rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_lamb_trains_a_float16_model(backend: str) -> None:
    """Lamb's finiteness guards take float16 at opset 17, where IsInf does not (the node check refused the
    update graph). Oracle: one float64 Lamb step from the float64 gradient of the float16 weights."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w0, b0 = rng.standard_normal((2, 3)).astype(np.float16), np.full(2, 0.5, np.float16)
    g = helper.make_graph([helper.make_node("Gemm", ["x", "W", "b"], ["lo"], transB=1),
                           helper.make_node("Mul", ["lo", "lo"], ["l2"]),
                           helper.make_node("ReduceMean", ["l2"], ["loss"], keepdims=0)], "t",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["N", 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT16, [])],
                          [numpy_helper.from_array(w0, "W"), numpy_helper.from_array(b0, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    so = SessionOptions()
    if backend == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    p = params("LambOptimizer", enable_grad_norm_clip=False)
    sess = TrainingSession(model.SerializeToString(), p, so)
    x = rng.standard_normal((8, 3)).astype(np.float16)
    sess.run(["loss"], {"x": x, "Learning_Rate": LR})
    x64, w64, b64 = x.astype(np.float64), w0.astype(np.float64), b0.astype(np.float64)
    lo = x64 @ w64.T + b64
    grads = {"W": (2 * lo / lo.size).T @ x64, "b": (2 * lo / lo.size).sum(0)}
    for k, w in (("W", w64), ("b", b64)):
        want, _, _ = lamb_ref(w, grads[k], 0 * w, 0 * w, 1, float(LR[0]))
        got = sess.get_state()[k]
        assert got.dtype == np.float16
        np.testing.assert_allclose(got.astype(np.float64), want, rtol=2e-3, atol=2e-3, err_msg=k)


@pytest.mark.parametrize("limit", [0.0, -1.0])
def test_a_clipping_limit_that_is_not_positive_is_refused_by_name(limit: float) -> None:
    model = mlp_model()
    attrs = {w: {"max_norm_clip": limit} if w == "W2" else {} for w in ("W1", "b1", "W2", "b2")}
    p = params("AdamOptimizer", optimizer_attributes_map=attrs)
    with pytest.raises(ValueError, match=r"optimizer_attributes_map\['W2'\]\['max_norm_clip'\] must be > 0"):
        TrainingSession(model.SerializeToString(), p)
    p.enable_grad_norm_clip = False  # not clipping: the value is not used
    TrainingSession(model.SerializeToString(), p)


@pytest.mark.parametrize("mode", ["legacy", "auto"])
def test_accumulation_equals_one_big_batch(mode: str) -> None:
    model = mlp_model(loss="mse")
    data = batches(4, 8, loss="mse")
    p = params("SGDOptimizer", gradient_accumulation_steps=4, gradient_accumulation_mode=mode)
    acc = TrainingSession(model.SerializeToString(), p)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for k, (x, y) in enumerate(data):
        if mode == "legacy" and k < 3:
            acc.run(["loss", "Group_Accumulated_Gradients"], feeds(x, y), ro)
        else:
            acc.run(["loss"], feeds(x, y))
    big = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))
    big.run(["loss"], feeds(np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data])))
    a, b = acc.get_state(), big.get_state()
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert all(not np.any(v) for k, v in acc._store.items() if k.endswith("_accumulate_buffer"))


@pytest.mark.parametrize("with_group", [False, True])
def test_micro_step_fetching_the_norm_accumulates(with_group: bool) -> None:
    """A legacy-mode micro-step that fetches the global norm (path to fetches), with or without
    Group_Accumulated_Gradients (with it, it was an error), still adds its gradients to the buffers, as
    onnxruntime's in-place accumulators did on that path: the update then equals one big batch's (clipped by
    the same norm)."""
    model = mlp_model(loss="mse")
    data = batches(3, 8, loss="mse")
    p = params("SGDOptimizer", gradient_accumulation_steps=3)
    acc = TrainingSession(model.SerializeToString(), p)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    (x0, y0), (x1, y1), (x2, y2) = data
    fetch = ["Group_Accumulated_Gradients"] if with_group else []
    norm = acc.run([*fetch, "global_gradient_norm"], feeds(x0, y0), ro)[-1]
    acc.run(["loss", "Group_Accumulated_Gradients"], feeds(x1, y1), ro)
    acc.run(["loss"], feeds(x2, y2))
    w = {k: v.astype(np.float64) for k, v in weights_of(model).items()}
    g0 = _grads(model, w, x0, y0)
    np.testing.assert_allclose(norm, np.sqrt(sum(np.sum((v / 3) ** 2) for v in g0.values())), rtol=1e-5)
    big = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))
    big.run(["loss"], feeds(np.concatenate([d[0] for d in data]), np.concatenate([d[1] for d in data])))
    a, b = acc.get_state(), big.get_state()
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-6, atol=1e-7, err_msg=k)


def test_state_round_trip_is_bit_identical() -> None:
    model = mlp_model()
    data = batches(4, 16)
    s1 = TrainingSession(model.SerializeToString(), params("AdamOptimizer"))
    for x, y in data[:3]:
        s1.run(["loss"], feeds(x, y))
    s2 = TrainingSession(model.SerializeToString(), params("AdamOptimizer"))
    s2.load_state(s1.get_state())
    x, y = data[3]
    assert s1.run(["loss"], feeds(x, y))[0].tobytes() == s2.run(["loss"], feeds(x, y))[0].tobytes()
    with pytest.raises(KeyError, match="nope"):
        s2.load_state({"nope": np.zeros(1)}, strict=True)
    s2.load_state({"nope": np.zeros(1)})  # ignored when not strict
    with pytest.raises(ValueError, match="W1"):
        s2.load_state({"W1": np.zeros((2, 2), np.float32)})
    with pytest.raises(TypeError, match="W1"):
        s2.load_state({"W1": np.zeros((16, 8), np.float64)})


@pytest.mark.parametrize(
    "kw",
    [{}, {"training_optimizer_name": "AdamOptimizer", "gradient_accumulation_steps": 2},
     {"use_mixed_precision": True}, {"training_optimizer_name": "", "set_gradients_as_graph_outputs": True}],
    ids=["sgd", "adam-accumulation", "mixed-precision", "gradients"],
)
def test_outputs_keep_the_model_order(kw: dict) -> None:
    """A model whose loss is its last output: run(None) returns the outputs in the model's order (the
    session's additions after them), as onnxruntime's session did; the loss came first before."""
    import onnxruntime

    model = mlp_model()
    outs = list(model.graph.output)
    del model.graph.output[:]
    model.graph.output.extend(outs[::-1])  # logits, loss
    sess = TrainingSession(model.SerializeToString(), params(**kw))
    names = [o.name for o in sess.get_outputs()]
    assert names[:2] == ["logits", "loss"], names
    x, y = batches(1, 4)[0]
    ref = onnxruntime.InferenceSession(model.SerializeToString()).run(None, {"x": x, "y": y})
    one = np.ones(1, np.float32)
    feeds = {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32), "loss_scale": one}
    got = sess.run(None, {i.name: feeds[i.name] for i in sess.get_inputs()})
    assert len(got) == len(names)
    tol = 2e-2 if kw.get("use_mixed_precision") else 1e-5
    np.testing.assert_allclose(got[0], ref[0], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[1], ref[1], rtol=tol, atol=tol)


def test_interface_and_errors() -> None:
    model = mlp_model()
    sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))
    assert [i.name for i in sess.get_inputs()] == ["x", "y", "Learning_Rate"]
    assert [o.name for o in sess.get_outputs()] == ["loss", "logits", "global_gradient_norm"]
    x, y = batches(1, 4)[0]
    with pytest.raises(ValueError, match="Learning_Rate"):
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.float32(0.1)})
    with pytest.raises(ValueError, match="SGDOptim"):
        TrainingSession(model.SerializeToString(), params("SGDOptim"))
    with pytest.raises(ValueError, match="'x' is a graph input or node output of the model, not an init"):
        TrainingSession(model.SerializeToString(), params(weights_to_train={"x"}))
    with pytest.raises(ValueError, match="no entry for trained weight 'b1'"):
        TrainingSession(
            model.SerializeToString(), params(optimizer_attributes_map={"W1": {}, "W2": {}, "b2": {}})
        )
    with pytest.raises(ValueError, match="horizontal_parallel_size=2 needs a multiple of 2 MPI ranks"):
        TrainingSession(model.SerializeToString(), params(horizontal_parallel_size=2))
    with pytest.raises(AttributeError, match="no property"):
        params().not_a_property = 1


def test_weights_to_train_and_not_to_train() -> None:
    model = mlp_model()
    x, y = batches(1, 8)[0]
    s = TrainingSession(model.SerializeToString(), params(weights_to_train={"W2", "b2"}))
    assert sorted(s.get_state()) == ["W2", "b2"]
    s = TrainingSession(model.SerializeToString(), params(weights_not_to_train={"W1"}))
    assert sorted(s.get_state()) == ["W2", "b1", "b2"]
    before = weights_of(model)["W1"]
    s.run(["loss"], feeds(x, y))
    np.testing.assert_array_equal(s._plan.initializers["W1"], before)


def test_dumps_pass_the_checker_and_run_on_onnxruntime(tmp_path) -> None:
    ort = pytest.importorskip("onnxruntime")
    model = mlp_model()
    paths = {k: str(tmp_path / f"{k}.onnx") for k in ("after", "grad", "train")}
    p = params(
        "AdamOptimizer",
        model_after_graph_transforms_path=paths["after"],
        model_with_gradient_graph_path=paths["grad"],
        model_with_training_graph_path=paths["train"],
    )
    sess = TrainingSession(model.SerializeToString(), p)
    for path in paths.values():
        onnx.checker.check_model(onnx.load(path), full_check=True)
    x, y = batches(1, 16)[0]
    train = onnx.load(paths["train"])
    # the state's values are in the dumps (as onnxruntime's held them): the training graph runs on the feeds
    # alone, and takes a fed weight still
    state_inputs = {i.name for i in train.graph.input if i.name in sess._store}
    assert state_inputs and state_inputs <= {t.name for t in train.graph.initializer}
    for path in (paths["after"], paths["grad"]):
        dumped = onnx.load(path)
        assert {i.name for i in dumped.graph.input if i.name in sess._store} <= {
            t.name for t in dumped.graph.initializer}
    names = [o.name for o in train.graph.output]
    run = ort.InferenceSession(train.SerializeToString()).run
    want = dict(zip(names, run(None, feeds(x, y))))
    w = next(n for n in state_inputs if n.endswith("weight") or n.startswith("W"))
    fed = dict(zip(names, run(None, {**feeds(x, y), w: np.zeros_like(sess._store[w])})))
    assert fed["loss"] != want["loss"]
    loss = sess.run(["loss"], feeds(x, y))[0]
    np.testing.assert_allclose(loss, want["loss"], rtol=1e-6)
    for k, v in sess.get_state().items():
        out = sess._graphs.updates["full"][k]
        np.testing.assert_allclose(v, want[out], rtol=1e-5, atol=1e-7, err_msg=k)


def test_importable_where_onnxruntime_had_it() -> None:
    from onnxtrain.capi._pybind_state import GradientGraphBuilder
    from onnxtrain.capi._pybind_state import TrainingParameters as TP
    from onnxtrain.capi._pybind_state import TrainingSession as TS

    assert TS is onnxtrain.TrainingSession and TP is onnxtrain.TrainingParameters
    assert GradientGraphBuilder is onnxtrain.GradientGraphBuilder
    from onnxtrain.capi._pybind_state import PropagateCastOpsStrategy as S
    from onnxtrain.capi.training import TrainingParameters as TP3  # onnxruntime's deprecated package's names
    from onnxtrain.capi.training import TrainingSession as TS3
    from onnxtrain.capi.training.training_session import TrainingSession as TS2
    from onnxtrain.training import PropagateCastOpsStrategy, TrainingParameters, TrainingSession

    assert TS2 is TrainingSession is TS is TS3 and TrainingParameters is TP is TP3
    assert S is PropagateCastOpsStrategy is onnxtrain.PropagateCastOpsStrategy
    assert int(S.INSERT_AND_REDUCE | S.FLOOD_FILL) == 3 and S.NONE == 0
    sess = TS(mlp_model().SerializeToString(), params())
    sess.finalize()  # the legacy wrapper's MPI shutdown hook: nothing to do here


@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer", "LambOptimizer"])
def test_split_step_equals_fused_step(opt: str) -> None:
    """gradients graph → update graph (the data-parallel path) gives what one fused run gives."""
    from onnxtrain.engine import compile_model

    model = mlp_model()
    x, y = batches(1, 16)[0]
    fused = TrainingSession(model.SerializeToString(), params(opt))
    split = TrainingSession(model.SerializeToString(), params(opt))
    g = split._graphs
    assert g._halves is None and "update" not in g.updates  # one process: built only when asked for
    for m in (g.gradients_graph, g.update_graph):
        onnx.checker.check_model(m, full_check=True)
    fused.run(["loss"], feeds(x, y))
    store = split._store
    gp = compile_model(g.gradients_graph)
    names = [f"{w}_grad" for w in g.trainable]
    grads = dict(zip(names, gp.run({"x": x, "y": y, **{w: store[w] for w in g.trainable}}, names)))
    up = compile_model(g.update_graph)
    feed = {"Learning_Rate": LR, **grads, **{n: store[n] for n in up.all_input_names if n in store}}
    outs = g.updates["update"]
    new = dict(zip(outs, up.run(feed, list(outs.values()))))
    for k, v in fused.get_state().items():
        np.testing.assert_array_equal(new[k], v, err_msg=k)


def test_optimizer_state_is_held_once() -> None:
    """The optimizer's initial state arrays are the session's state (no second copy kept in the specs: a
    moment's spec holds a broadcast zero, no memory), and training them leaves the Adam moments
    zero-initialised as torch's are (first step: m1 = 0.1·g)."""
    sess = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    g = sess._graphs
    assert g.state_specs
    for sp in g.state_specs:
        state = g.initial_state[sp.name]
        same_layout = state.shape == sp.initial.shape and state.dtype == sp.initial.dtype
        assert sp.initial is state or (not any(sp.initial.strides) and state.flags.writeable and same_layout)
    assert all(not np.any(g.initial_state[sp.name]) for sp in g.state_specs if sp.key.startswith("Moment"))
    x, y = batches(1, 16)[0]
    p = params("AdamOptimizer")
    p.set_gradients_as_graph_outputs = True
    probe = TrainingSession(mlp_model().SerializeToString(), p)
    grads = dict(zip([o.name for o in probe.get_outputs()], probe.run(None, feeds(x, y))))
    sess.run(["loss"], feeds(x, y))
    for w, moments in sess.get_optimizer_state().items():
        np.testing.assert_allclose(moments["Moment_1"], 0.1 * grads[f"{w}_grad"], rtol=1e-6, atol=1e-9)


def test_all_outputs_on_accumulation_micro_steps() -> None:
    """run(None, ...) on an "auto" micro-step returns every output, the norm being that of the sums so far
    (divided by N): the same batch twice gives half the update step's norm first."""
    model = mlp_model(loss="mse")
    p = params("AdamOptimizer", gradient_accumulation_steps=2, gradient_accumulation_mode="auto")
    sess = TrainingSession(model.SerializeToString(), p)
    x, y = batches(1, 4, loss="mse")[0]
    first = sess.run(None, feeds(x, y))
    second = sess.run(None, feeds(x, y))
    names = [o.name for o in sess.get_outputs()]
    assert len(first) == len(second) == len(names)
    k = names.index("global_gradient_norm")
    np.testing.assert_allclose(second[k], 2 * first[k], rtol=1e-6)


def test_update_outputs_are_written_by_the_nodes_computing_them() -> None:
    """No Identity merely names a new weight or moment: a runtime that cannot alias graph outputs would
    copy each of them once more per step. The state still arrives under its names, with its values."""
    model = mlp_model(act="Tanh")
    p = params("AdamOptimizer", enable_grad_norm_clip=False)
    sess = TrainingSession(model.SerializeToString(), p)
    g = sess._graphs.full.graph
    outputs = {o.name for o in g.output}
    made = {o for n in g.node for o in n.output}
    naming = [
        n.name for n in g.node if n.op_type == "Identity" and n.output[0] in outputs and n.input[0] in made
    ]
    assert not naming, naming
    assert {"W1_Adam_out", "Moment_1_W1_Out", "Moment_2_W1_Out"} <= outputs
    onnx.checker.check_model(sess._graphs.full, full_check=True)
    _follow_reference(model, p, lambda w, g_, m1, m2, t: adam_ref(w, g_, m1, m2, t, float(LR[0])))


def test_path_to_fetched_gradients_stops_before_the_optimizer() -> None:
    """``only_execute_path_to_fetches`` with gradients and their norm fetched: torch's gradients, no
    learning rate needed, and the weights and optimizer state untouched (the optimizer is not on the path)."""
    model = mlp_model()
    torch, net = torch_mlp(model)
    p = params("AdamOptimizer", set_gradients_as_graph_outputs=True)
    sess = TrainingSession(model.SerializeToString(), p)
    before = sess.get_state()
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    (x, y), = batches(1, 16)
    names = ["W1_grad", "b1_grad", "W2_grad", "b2_grad"]
    *grads, norm = sess.run([*names, "global_gradient_norm"], {"x": x, "y": y}, ro)
    torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    want = [net[0].weight.grad, net[0].bias.grad, net[2].weight.grad, net[2].bias.grad]
    for name, g, w in zip(names, grads, want):
        np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(norm, np.sqrt(sum(float((w.double() ** 2).sum()) for w in want)), rtol=1e-5)
    for k, v in sess.get_state().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    sess.run(["loss"], feeds(x, y))  # a step as usual afterwards
    assert not np.array_equal(sess.get_state()["W1"], before["W1"])


def test_modelmeta_is_the_users_model() -> None:
    """get_modelmeta describes the model given, as InferenceSession's does, not the generated step graph."""
    model = mlp_model()
    model.producer_name, model.model_version, model.doc_string = "my-exporter", 7, "an mlp"
    onnx.helper.set_model_props(model, {"author": "me"})
    meta = TrainingSession(model.SerializeToString(), params()).get_modelmeta()
    want = onnxtrain.InferenceSession(model.SerializeToString()).get_modelmeta()
    assert meta == want
    assert (meta.producer_name, meta.graph_name, meta.version) == ("my-exporter", "mlp", 7)
    assert meta.custom_metadata_map == {"author": "me"} and meta.description == "an mlp"


def test_an_optional_input_may_be_left_out_of_a_path_only_run() -> None:
    """A full run takes an optional input left out; a path-only run refused it as missing (naming inputs
    without it): it is left out there too, and the forward equals the full run's before its update."""
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.full((3, 2), 0.5, np.float32), "W")
    has = helper.make_graph([helper.make_node("OptionalGetElement", ["extra"], ["e"]),
                             helper.make_node("Add", ["x", "e"], ["xe"])], "has", [],
                            [helper.make_tensor_value_info("xe", TensorProto.FLOAT, ["N", 3])])
    no = helper.make_graph([helper.make_node("Identity", ["x"], ["xn"])], "no", [],
                           [helper.make_tensor_value_info("xn", TensorProto.FLOAT, ["N", 3])])
    nodes = [helper.make_node("OptionalHasElement", ["extra"], ["h"]),
             helper.make_node("If", ["h"], ["xx"], then_branch=has, else_branch=no),
             helper.make_node("MatMul", ["xx", "W"], ["logits"]),
             helper.make_node("ReduceSum", ["logits"], ["loss"], keepdims=0)]
    extra = helper.make_value_info("extra", helper.make_optional_type_proto(
        helper.make_tensor_type_proto(TensorProto.FLOAT, ["N", 3])))
    x_in = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])
    g = helper.make_graph(nodes, "g", [x_in, extra],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                           helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 2])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
    sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer"))
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    path = sess.run(["logits"], {"x": x}, ro)[0]
    np.testing.assert_allclose(path, x @ np.full((3, 2), 0.5, np.float32), rtol=1e-6)
    full = sess.run(["logits"], {"x": x, "Learning_Rate": LR})[0]
    np.testing.assert_array_equal(full, path)

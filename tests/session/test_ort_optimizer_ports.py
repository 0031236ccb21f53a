"""onnxruntime's optimizer kernel tests, ported to the legacy TrainingSession and the on-device AdamW and SGD.

onnxruntime tested its SGDOptimizer, AdamOptimizer and LambOptimizer kernels one call at a time: chosen
weights, gradients, moments and step counts in, expected weights, moments and counts out. The legacy session
runs the same update inside its training graph, so each case here feeds the gradient directly: the model's
loss is Σ W·G over weights W and graph inputs G of W's shape, whose gradient with respect to W is G exactly.
The moments and counts come in through ``set_optimizer_initial_state``. Expected values are onnxruntime's
where its tests list them (facts from its test files, named per test), else a float64 reference written from
the documented formulas (``tests.session.helpers.adam_ref`` / ``lamb_ref``), or torch.

Left out: the Lamb cases with α or β ≥ 1 (LambOptimizerTest5DTensorMixPrecision32_16 takes 1.5,
LambOptimizerTestSimpleBaselineMixPrecision32_16 takes 1.0; onnxtrain refuses decay rates outside [0, 1) by
name), the "output the gradient instead of the weight" variants (the kernels' optional G_Out output, which no
session exposes), the CUDA-only fp16 learning-rate input and the on-device torch-mode AdamW (``adam_mode`` 0:
onnxtrain's AdamW block is the Hugging Face variant that onnxruntime-training's generate_artifacts writes;
that mode's data are ported to the legacy AdamOptimizer's weight_decay_mode 0 instead).
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingSession
from onnxtrain.ir.builder import make_model
from tests.session.helpers import adam_ref, backend_options, lamb_ref, params
from tests.tiers import extended

BACKENDS = ["numpy", "onnxruntime"]
F16, F32, F64 = np.float16, np.float32, np.float64


# ---------------------------------------------------------------------------------------------------- helpers
def fed_gradient_model(weights: dict[str, np.ndarray], dtype=F32) -> onnx.ModelProto:
    """loss = Σ_w ReduceSum(w · G_w): the gradient of each weight w is the graph input ``G_<w>``."""
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inputs, parts = [], [], []
    for n, w in weights.items():
        nodes += [helper.make_node("Mul", [n, f"G_{n}"], [f"prod_{n}"]),
                  helper.make_node("ReduceSum", [f"prod_{n}"], [f"sum_{n}"], keepdims=0)]
        inputs.append(helper.make_tensor_value_info(f"G_{n}", et, list(w.shape)))
        parts.append(f"sum_{n}")
    total = parts[0]
    for i, part in enumerate(parts[1:]):  # Adds, not one Sum: onnxruntime-training has no gradient for Sum
        nodes.append(helper.make_node("Add", [total, part], [f"total_{i}"]))
        total = f"total_{i}"
    nodes.append(helper.make_node("Identity", [total], ["loss"]))
    g = helper.make_graph(nodes, "fed_gradients", inputs, [helper.make_tensor_value_info("loss", et, [])],
                          [numpy_helper.from_array(np.asarray(w, dtype), n) for n, w in weights.items()])
    return make_model(g, 17)

def _hugging_face_case(tmp_path, steps: int) -> tuple[list[str], onnx.ModelProto, str, dict, str]:
    """The fed-gradient model of the Hugging Face data's first weights saved as ``base.onnx``, its first
    ``steps`` gradients saved as ``data.npz``, and an empty ``theirs`` folder for onnxruntime-training's
    artifacts: (the weights' names, the model, its path, the gradients by ``<name>_<step>``, their path)."""
    names = list(HF_SHAPES)
    model = fed_gradient_model({n: np.reshape(HF_FIRST[n], HF_SHAPES[n]) for n in names})
    base = str(tmp_path / "base.onnx")
    onnx.save(model, base)
    data = {f"{n}_{t}": np.reshape(np.array(HF_GRADIENTS[n][t], F32), HF_SHAPES[n])
            for n in names for t in range(steps)}
    np.savez(tmp_path / "data.npz", **data)
    (tmp_path / "theirs").mkdir()
    return names, model, base, data, str(tmp_path / "data.npz")



def session(opt: str, weights: dict[str, np.ndarray], backend: str = "numpy", dtype=F32,
            state: dict | None = None, **kw) -> TrainingSession:
    """A legacy session of ``opt`` over :func:`fed_gradient_model` (clipping off unless asked), its optimizer
    state starting at ``state`` (set_optimizer_initial_state's layout)."""
    kw.setdefault("enable_grad_norm_clip", False)
    p = params(opt, **kw)
    if state:
        p.set_optimizer_initial_state(state)
    model = fed_gradient_model(weights, dtype).SerializeToString()
    return TrainingSession(model, p, backend_options(backend))


def step(sess: TrainingSession, grads: dict[str, np.ndarray], lr: float, loss_scale: float | None = None,
         dtype=F32) -> list:
    """One run of ``sess`` whose gradients are ``grads`` (times the loss scale, under mixed precision)."""
    feeds = {f"G_{n}": np.asarray(g, dtype) for n, g in grads.items()}
    feeds["Learning_Rate"] = np.array([lr], F32)
    if loss_scale is not None:
        feeds[sess.loss_scale_input_name] = np.array([loss_scale], F32)
    return sess.run(None, feeds)


def moments(m1, m2, dtype=F32, **extra) -> dict:
    """One weight's entry of set_optimizer_initial_state: its moments in ``dtype`` and ``extra`` states."""
    return {"Moment_1": np.asarray(m1, dtype), "Moment_2": np.asarray(m2, dtype), **extra}


def close(actual, desired, rtol: float = 1e-6, atol: float = 1e-7, what: str = "") -> None:
    np.testing.assert_allclose(np.asarray(actual, F64), np.asarray(desired, F64), rtol=rtol, atol=atol,
                               err_msg=what)


# ------------------------------------------------------------------------------------------------------- SGD
@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_kernel_case(backend: str) -> None:
    """SGDOptimizerTest (orttraining/orttraining/test/gradient/optimizer_ops_test.cc, earlier in
    gradient_ops_test.cc): η = 0.5, w = [1, 2, 3], g = [4, 5, 6] → w = [-1, -0.5, 0]."""
    sess = session("SGDOptimizer", {"W": np.array([1.0, 2.0, 3.0])}, backend)
    step(sess, {"W": [4.0, 5.0, 6.0]}, 0.5)
    np.testing.assert_array_equal(sess.get_state()["W"], np.array([-1.0, -0.5, 0.0], F32))


# ------------------------------------------------------------------------------------------------------ Adam
# AdamOptimizerInputOutput (optimizer_ops_test.cc): one step from Update_Count 3 with the default α, β, ε
ADAM_CASE = dict(lr=0.5, w=[1.0, 2.0, 3.0], g=[4.0, 5.0, 6.0], m1=[0.1, 0.2, 0.3], m2=[0.4, 0.5, 0.6])
# its expected outputs, without bias correction (the test sets do_bias_correction 0)
ADAM_CASE_OUT = dict(w=[0.6199609, 1.5305318, 2.4542853], m1=[0.49, 0.68, 0.87], m2=[0.4156, 0.5245, 0.6354])


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_kernel_case_without_bias_correction(backend: str) -> None:
    """AdamOptimizerTest (optimizer_ops_test.cc): Update_Count 3 in, 4 out, and onnxruntime's expected
    weights and moments, do_bias_correction = 0."""
    c = ADAM_CASE
    sess = session("AdamOptimizer", {"W": np.array(c["w"])}, backend,
                   state={"W": moments(c["m1"], c["m2"], Update_Count=np.array([3], np.int64))},
                   optimizer_int_attributes_map={"W": {"do_bias_correction": 0}})
    step(sess, {"W": c["g"]}, c["lr"])
    state = sess.get_optimizer_state()["W"]
    close(sess.get_state()["W"], ADAM_CASE_OUT["w"], rtol=1e-6, what="W")
    close(state["Moment_1"], ADAM_CASE_OUT["m1"], rtol=1e-6, what="Moment_1")
    close(state["Moment_2"], ADAM_CASE_OUT["m2"], rtol=1e-6, what="Moment_2")
    assert state["Update_Count"].tolist() == [4]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("lam", [0.0, 0.25])
def test_adam_kernel_case_with_bias_correction_and_decay(backend: str, mode: int, lam: float) -> None:
    """AdamOptimizerTest's inputs through today's kernel (adam.cu's _AdamOptimizer_mode0/_mode1): bias
    corrections 1 − α³ and 1 − β³ of the loaded count 3, each weight decay mode, with and without λ; then a
    second step at another learning rate, from the count 4 the first one left."""
    c = ADAM_CASE
    sess = session("AdamOptimizer", {"W": np.array(c["w"])}, backend,
                   state={"W": moments(c["m1"], c["m2"], Update_Count=np.array([3], np.int64))},
                   optimizer_attributes_map={"W": {"lambda": lam}},
                   optimizer_int_attributes_map={"W": {"weight_decay_mode": mode}})
    w, m1, m2 = (np.array(c[k], F32).astype(F64) for k in ("w", "m1", "m2"))
    for t, (lr, g) in enumerate([(c["lr"], c["g"]), (0.125, [-1.0, 0.5, 2.0])], start=3):
        step(sess, {"W": g}, lr)
        w, m1, m2 = adam_ref(w, np.array(g, F64), m1, m2, t, lr, lam=lam, mode=mode)
        state = sess.get_optimizer_state()["W"]
        close(sess.get_state()["W"], w, rtol=1e-6, atol=1e-7, what=f"W after count {t}")
        close(state["Moment_1"], m1, rtol=1e-6, what=f"Moment_1 after count {t}")
        close(state["Moment_2"], m2, rtol=1e-6, what=f"Moment_2 after count {t}")
        assert state["Update_Count"].tolist() == [t + 1]


# AdamBiasCorrection and AdamWeightDecayMode{0,1}{No,With}BiasCorrection (optimizer_ops_test.cc): η 1,
# Update_Count 1, zero moments; name: (do_bias_correction, λ, weight_decay_mode, expected weights)
ADAM_DECAY_IN = dict(w=[-0.4634, 0.3584, -0.2121], g=[0.4171, 0.9485, 1.2289])
ADAM_DECAY_MOMENTS = dict(m1=[0.0417, 0.0949, 0.1229], m2=[1.7400e-04, 8.9966e-04, 1.5102e-03])
ADAM_DECAY_CASES = {
    "AdamBiasCorrection": (1, 0.0, 0, [-1.4634, -0.6416, -1.2121]),
    "AdamWeightDecayMode0NoBiasCorrection": (0, 0.01, 0, [-3.6210, -2.8075, -3.3723]),
    "AdamWeightDecayMode0WithBiasCorrection": (1, 0.01, 0, [-1.4587, -0.6452, -1.2099]),
    "AdamWeightDecayMode1NoBiasCorrection": (0, 0.01, 1, [-3.5894, -2.7758, -3.3406]),
    "AdamWeightDecayMode1WithBiasCorrection": (1, 0.01, 1, [-1.4488, -0.6352, -1.1999]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(ADAM_DECAY_CASES))
def test_adam_decay_mode_and_bias_correction_cases(case: str, backend: str) -> None:
    """The AdamOptimizer cases of optimizer_ops_test.cc with expected values to four decimals: bias
    correction on and off, λ 0.01 in weight decay modes 0 and 1, from Update_Count 1 (then 2)."""
    bias, lam, mode, expected = ADAM_DECAY_CASES[case]
    sess = session("AdamOptimizer", {"W": np.array(ADAM_DECAY_IN["w"])}, backend,
                   optimizer_attributes_map={"W": {"lambda": lam}},
                   optimizer_int_attributes_map={"W": {"do_bias_correction": bias,
                                                       "weight_decay_mode": mode}})
    step(sess, {"W": ADAM_DECAY_IN["g"]}, 1.0)
    state = sess.get_optimizer_state()["W"]
    close(sess.get_state()["W"], expected, rtol=0, atol=1e-4, what="W")
    close(state["Moment_1"], ADAM_DECAY_MOMENTS["m1"], rtol=0, atol=1e-4, what="Moment_1")
    close(state["Moment_2"], ADAM_DECAY_MOMENTS["m2"], rtol=1e-3, what="Moment_2")
    assert state["Update_Count"].tolist() == [2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_adam_mixed_precision_clip_norm_case(backend: str) -> None:
    """AdamOptimizerMixPrecision_FP16Weight_ClipNorm_Test (optimizer_ops_test.cc): float16 moments, loss scale
    1, a gradient norm ten times max_norm_clip (there a fed norm of 0.01 with max_norm_clip 0.001; here
    max_norm_clip is a tenth of the gradient's own norm), so the gradient is divided by 10. The float64
    formula from the float16 moments; onnxruntime's expected weights agree within 5e-4 (they are listed
    rounded: 1.8369141 where its kernel's float arithmetic gives 1.837354)."""
    c = ADAM_CASE
    limit = float(np.float32(np.sqrt(77.0) / 10))  # |[4, 5, 6]| = sqrt(77)
    sess = session("AdamOptimizer", {"W": np.array(c["w"])}, backend, enable_grad_norm_clip=True,
                   state={"W": moments(c["m1"], c["m2"], F16, Update_Count=np.array([3], np.int64))},
                   use_mixed_precision=True, use_fp16_moments=True,
                   optimizer_attributes_map={"W": {"max_norm_clip": limit}},
                   optimizer_int_attributes_map={"W": {"do_bias_correction": 0}})
    assert step(sess, {"W": c["g"]}, c["lr"], loss_scale=1.0)[-1].all()
    state = sess.get_optimizer_state()["W"]
    m1, m2 = (np.array(c[k], F16).astype(F64) for k in ("m1", "m2"))
    want, m1, m2 = adam_ref(np.array(c["w"], F64), np.array(c["g"], F64) / 10, m1, m2, 3, c["lr"], bias=False)
    close(sess.get_state()["W"], want, rtol=1e-5, what="W")
    close(sess.get_state()["W"], [0.8972168, 1.8369141, 2.7871094], rtol=0, atol=5e-4,
          what="W (onnxruntime's)")
    close(state["Moment_1"], np.array([0.13, 0.23, 0.33], F16), rtol=1e-3, what="Moment_1")
    close(state["Moment_2"], np.array([0.3997, 0.4998, 0.6001], F16), rtol=1e-3, what="Moment_2")
    half = sess.get_model_state(include_mixed_precision_weights=True)["mixed_precision"]["W"]
    np.testing.assert_array_equal(half, sess.get_state()["W"].astype(F16))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fp16_moments", [False, True])
def test_adam_mixed_precision_kernel_cases(backend: str, fp16_moments: bool) -> None:
    """AdamOptimizerMixPrecisionTest, AdamOptimizerMixPrecision_FP16Weight_Test and
    AdamOptimizerMixPrecision_FP16Weight_SkipUpdate_Test (optimizer_ops_test.cc): float32 master weights
    with a float16 copy, float16 gradients (here loss-scaled by 4, unscaled by the update) and float16 or
    float32 moments give the float32 weights of the float32 case, the copy being them rounded; a step
    whose gradients are not all finite (the kernel's update signal false) changes nothing, the count
    included."""
    c, out = ADAM_CASE, ADAM_CASE_OUT
    dt = F16 if fp16_moments else F32
    sess = session("AdamOptimizer", {"W": np.array(c["w"])}, backend,
                   state={"W": moments(c["m1"], c["m2"], dt, Update_Count=np.array([3], np.int64))},
                   use_mixed_precision=True, use_fp16_moments=fp16_moments,
                   optimizer_int_attributes_map={"W": {"do_bias_correction": 0}})
    finite = step(sess, {"W": c["g"]}, c["lr"], loss_scale=4.0)[-1]
    assert finite.all()
    # the float16 moments in: the step reads them rounded
    m1, m2 = (np.array(c[k], dt).astype(F64) for k in ("m1", "m2"))
    want, m1, m2 = adam_ref(np.array(c["w"], F64), np.array(c["g"], F64), m1, m2, 3, c["lr"], bias=False)
    tol = 1e-3 if fp16_moments else 1e-6
    close(sess.get_state()["W"], out["w"] if not fp16_moments else want, rtol=tol, what="W")
    state = sess.get_optimizer_state()["W"]
    assert state["Moment_1"].dtype == dt and state["Update_Count"].tolist() == [4]
    close(state["Moment_1"], m1.astype(dt), rtol=tol, what="Moment_1")
    close(state["Moment_2"], m2.astype(dt), rtol=tol, what="Moment_2")
    half = sess.get_model_state(include_mixed_precision_weights=True)["mixed_precision"]["W"]
    np.testing.assert_array_equal(half, sess.get_state()["W"].astype(F16))
    before = {k: v.copy() for k, v in sess.get_state().items()}
    finite = step(sess, {"W": [4.0, np.inf, 6.0]}, c["lr"], loss_scale=4.0)[-1]
    assert not finite.any()
    for k, v in sess.get_state().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    np.testing.assert_array_equal(
        sess.get_model_state(include_mixed_precision_weights=True)["mixed_precision"]["W"], half)


# ------------------------------------------------------------------------------------------------------ Lamb
LAMB_ATTRS = {"alpha": 0.2, "beta": 0.8, "lambda": 0.5, "epsilon": 1e-6}
# name: (shape, w, g, m, v, Step or None, other options) of the small cases of optimizer_ops_test.cc (η 0.5,
# LAMB_ATTRS); their gradient norm input is 1, which clips nothing, unless a max_norm_clip is named
LAMB_CASES = {
    "LambOptimizerTestVector": ([2], [1, 2], [3, 4], [-1, -2], [2, 1], None, {}),
    "LambOptimizerTestVectorWithZeroWeight": ([2], [0, 0], [1, -1], [-1, -2], [2, 1], None, {}),
    "LambOptimizerRatioMin": ([2], [-1, 1], [1, -1], [-1, -2], [2, 1], None, {"ratio_max": 0.1}),
    "LambOptimizerRatioMax": ([2], [1e-4, -1e-4], [1, -1], [-1, -2], [2, 1], None, {"ratio_min": 1.0}),
    "LambOptimizerTestBiasCorrectionFirst": ([2], [1, 2], [3, 4], [-1, -2], [2, 1], 1, {}),
    "LambOptimizerTestBiasCorrectionThird": ([2], [1, 2], [3, 4], [-1, -2], [2, 1], 3, {}),
    "LambOptimizerTest4DTensor": ([2, 1, 1, 1], [1, 2], [3, 4], [-1, -2], [2, 1], None, {}),
    "LambOptimizerTest2by3Tensor": ([2, 3], [1, 2, 1, 1, 2, 2], [3, 4, 3, 3, 4, 4], [-1, -2, 2, 1, 1, -2],
                                    [1, 1, 5, 5, 6, 6], None, {}),
    "LambOptimizerTestScalar": ([1], [1], [3], [-10], [1], None, {}),
    "LambOptimizerTestScalar_NonDefaultMaxNormClipping": ([1], [1], [3], [-10], [1], None,
                                                          {"max_norm_clip": 0.1}),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LAMB_CASES))
def test_lamb_kernel_cases(case: str, backend: str) -> None:
    """The small LambOptimizer cases of optimizer_ops_test.cc, against compute_lamb's formula (float64): a
    zero weight steps by η·d (trust ratio 1); ratio_max 0.1 and ratio_min 1 bound the trust ratio; a loaded
    Step t > 0 corrects by 1 − α^t, 1 − β^t (do_bias_correction = 1; the cases without a Step input run
    uncorrected) and comes out as t + 1; max_norm_clip 0.1 under a gradient norm of 3 divides the gradient
    by 30."""
    shape, w, g, m, v, t, extra = LAMB_CASES[case]
    arr = [np.array(x, F64).reshape(shape) for x in (w, g, m, v)]
    state = {"W": moments(arr[2], arr[3])}
    if t is not None:
        state["shared_optimizer_state"] = {"Step": np.array([t], np.int64)}
    clip = extra.get("max_norm_clip")
    sess = session("LambOptimizer", {"W": arr[0]}, backend, state=state,
                   enable_grad_norm_clip=clip is not None,
                   optimizer_attributes_map={"W": {**LAMB_ATTRS, **extra}},
                   optimizer_int_attributes_map={"W": {"do_bias_correction": int(t is not None)}})
    step(sess, {"W": arr[1]}, 0.5)
    norm = float(np.linalg.norm(arr[1]))
    divisor = norm / clip if clip is not None and norm > clip else 1.0
    a = LAMB_ATTRS
    want, m1, m2 = lamb_ref(arr[0], arr[1] / divisor, arr[2], arr[3], t or 1, 0.5, a["alpha"], a["beta"],
                            a["lambda"], a["epsilon"], bias=t is not None,
                            rmin=extra.get("ratio_min", -np.inf), rmax=extra.get("ratio_max", np.inf))
    got = sess.get_optimizer_state()
    close(sess.get_state()["W"], want, rtol=1e-6, atol=1e-7, what="W")
    close(got["W"]["Moment_1"], m1, rtol=1e-6, what="Moment_1")
    close(got["W"]["Moment_2"], m2, rtol=1e-6, what="Moment_2")
    assert got["shared_optimizer_state"]["Step"].tolist() == [(t or 1) + 1]


# LambOptimizerTestExternalBaseline (optimizer_ops_test.cc): η 0.1, λ 0.1, α 0.1, β 0.01, ε 0.1, no Step
LAMB_EXTERNAL = dict(
    w=[0.01379026, 0.15308191, -0.24356517, -0.21798165, -0.13770047, 0.09694599, -0.02223516, 0.2664228,
       -0.01177993, 0.06832688],
    g=[-6.048543, 10.569487, -9.207029, -0.57407373, 5.884985, -0.21047728, 3.539946, -5.957566, -9.343748,
       1.1502024],
    m=[-5.9078765, 9.673933, -8.731428, -0.6227454, 5.284312, -0.27138948, 3.443532, -5.681713, -8.72421,
       1.1441823],
    v=[4.2659229e+01, 1.1438165e+02, 9.3179581e+01, 4.7399229e-01, 3.4129276e+01, 9.0019435e-02,
       1.4493006e+01, 3.9455612e+01, 9.3025581e+01, 1.6000764e+0],
    w_new=[0.02979828, 0.13677707, -0.22708717, -0.20361158, -0.15338624, 0.1081504, -0.03804127, 0.28198114,
           0.00430069, 0.05319814],
    m_new=[-6.0344763, 10.479931, -9.15947, -0.57894087, 5.824918, -0.2165685, 3.5303047, -5.9299808,
           -9.281795, 1.1496004],
    v_new=[3.6645618e+01, 1.1174072e+02, 8.4853485e+01, 3.3100498e-01, 3.4628010e+01, 4.4757873e-02,
           1.2550836e+01, 3.5532223e+01, 8.7362823e+01, 1.3257366e+00],
)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [F32, F64])
def test_lamb_external_baseline(dtype, backend: str) -> None:
    """LambOptimizerTestExternalBaseline and ...ExternalBaselineDouble (optimizer_ops_test.cc): a [2, 5]
    weight with an external implementation's expected weights and moments, in float32 and float64."""
    c = LAMB_EXTERNAL
    shape = (2, 5)
    attrs = {"alpha": 0.1, "beta": 0.01, "lambda": 0.1, "epsilon": 0.1}
    sess = session("LambOptimizer", {"W": np.reshape(c["w"], shape)}, backend, dtype,
                   state={"W": moments(np.reshape(c["m"], shape), np.reshape(c["v"], shape), dtype)},
                   optimizer_attributes_map={"W": attrs})
    step(sess, {"W": np.reshape(c["g"], shape)}, 0.1, dtype=dtype)
    state = sess.get_optimizer_state()["W"]
    assert sess.get_state()["W"].dtype == dtype and state["Moment_1"].dtype == dtype
    # the expected values carry 7-8 digits
    close(sess.get_state()["W"].ravel(), c["w_new"], rtol=1e-6, atol=2e-8, what="W")
    close(state["Moment_1"].ravel(), c["m_new"], rtol=1e-6, what="Moment_1")
    close(state["Moment_2"].ravel(), c["v_new"], rtol=1e-6, what="Moment_2")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fed,clipped", [(0.375, False), (3.0, True)])
def test_lamb_gradient_scaling(backend: str, fed: float, clipped: bool) -> None:
    """LambOptimizerTestScalarScaling (optimizer_ops_test.cc; compute_lamb's g_scale): under mixed precision
    the loss-scaled gradient is divided by the loss scale L = 8 while its norm N is at most L·max_norm_clip,
    else by N / max_norm_clip. The session computes N from the gradient: a fed 0.375 makes it 3 (divided by
    8), a fed 3 makes it 24 (divided by 24)."""
    scale = 8.0
    sess = session("LambOptimizer", {"W": np.array([1.0])}, backend, enable_grad_norm_clip=True,
                   use_mixed_precision=True, state={"W": moments([-10.0], [1.0])},
                   optimizer_attributes_map={"W": LAMB_ATTRS})
    outs = step(sess, {"W": [fed]}, 0.5, loss_scale=scale)
    norm = fed * scale
    assert float(outs[1]) == norm
    divisor = norm if clipped else scale
    want, m1, m2 = lamb_ref(np.array([1.0]), np.array([norm / divisor]), np.array([-10.0]), np.array([1.0]),
                            1, 0.5, LAMB_ATTRS["alpha"], LAMB_ATTRS["beta"], LAMB_ATTRS["lambda"],
                            LAMB_ATTRS["epsilon"])
    close(sess.get_state()["W"], want, rtol=1e-6, what="W")
    close(sess.get_optimizer_state()["W"]["Moment_1"], m1, rtol=1e-6, what="Moment_1")


# LambOptimizerTestBaselineMixPrecision32_16 and ...ScalarMixPrecision32_16 (optimizer_ops_test.cc):
# η 0.1, λ 0.25, α 0.9, β 0.95, ε 0.33
LAMB_MP_ATTRS = {"alpha": 0.9, "beta": 0.95, "lambda": 0.25, "epsilon": 0.33}
LAMB_MP_CASES = {
    "LambOptimizerTestBaselineMixPrecision32_16": ([2, 1], [-1.5, 2.4], [-0.75, 1.2], [0.87, -0.94],
                                                   [0.12, 0.28]),
    "LambOptimizerTestScalarMixPrecision32_16": ([1], [-1.5], [-0.75], [0.87], [0.12]),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(LAMB_MP_CASES))
@pytest.mark.parametrize("t", [None, 2])
@pytest.mark.parametrize("fp16_moments", [False, True])
def test_lamb_mixed_precision_cases(case: str, t: int | None, fp16_moments: bool, backend: str) -> None:
    """run_lamb_mix_precision_test's variants (optimizer_ops_test.cc): float16 or float32 moments, a float16
    weight copy, float16 gradients, no Step or Step 2 (bias-corrected), then a skipped update (not all
    gradients finite) that leaves weights, copy, moments and Step as they were."""
    shape, *values = LAMB_MP_CASES[case]
    w, g, m, v = (np.array(x, F64).reshape(shape) for x in values)
    dt = F16 if fp16_moments else F32
    state = {"W": moments(m, v, dt)}
    if t is not None:
        state["shared_optimizer_state"] = {"Step": np.array([t], np.int64)}
    sess = session("LambOptimizer", {"W": w}, backend, state=state, use_mixed_precision=True,
                   use_fp16_moments=fp16_moments, optimizer_attributes_map={"W": LAMB_MP_ATTRS},
                   optimizer_int_attributes_map={"W": {"do_bias_correction": int(t is not None)}})
    assert step(sess, {"W": g}, 0.1, loss_scale=1.0)[-1].all()
    # the inputs as the update reads them: the moments in their kept type, the gradient in float16 (1.2 is
    # 1.2001953), but on the onnxruntime backend, whose CPU provider drops the cast of a float32 input to
    # float16 (test_loss_scaling_sequences.test_onnxruntime_backend_warns_that_half_inputs_do_not_overflow)
    gt = F16 if backend == "numpy" else F32
    w32, g16, m_in, v_in = (x.astype(d).astype(F64) for x, d in ((w, F32), (g, gt), (m, dt), (v, dt)))
    a = LAMB_MP_ATTRS
    want, m1, m2 = lamb_ref(w32, g16, m_in, v_in, t or 1, 0.1, a["alpha"], a["beta"], a["lambda"],
                            a["epsilon"], bias=t is not None)
    got = sess.get_optimizer_state()
    close(sess.get_state()["W"], want, rtol=1e-6, atol=1e-7, what="W")
    tol = 1e-3 if fp16_moments else 1e-6
    close(got["W"]["Moment_1"], m1.astype(dt), rtol=tol, what="Moment_1")
    close(got["W"]["Moment_2"], m2.astype(dt), rtol=tol, what="Moment_2")
    assert got["W"]["Moment_1"].dtype == dt
    assert got["shared_optimizer_state"]["Step"].tolist() == [(t or 1) + 1]
    half = sess.get_model_state(include_mixed_precision_weights=True)["mixed_precision"]["W"]
    np.testing.assert_array_equal(half, sess.get_state()["W"].astype(F16))
    before = {k: v.copy() for k, v in sess.get_state().items()}
    assert not step(sess, {"W": np.full(shape, np.nan)}, 0.1, loss_scale=1.0)[-1].any()
    for k, v in sess.get_state().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)
    np.testing.assert_array_equal(
        sess.get_model_state(include_mixed_precision_weights=True)["mixed_precision"]["W"], half)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("count", [9, extended(127, id="127")])
def test_lamb_multi_tensor_per_weight_attributes(backend: str, count: int) -> None:
    """LambOptimizerMultiTensor6 (optimizer_ops_test.cc): many weights of random sizes (1 to 1228 values),
    each with its own α, β, λ and ε drawn from [0.1, 1), weights, gradients and moments from [0.1, 1); each
    weight steps by its own trust ratio. By default 9 weights, the full tier the test's 127."""
    rng = np.random.default_rng(0)
    names = [f"W{i:03d}" for i in range(count)]
    sizes = rng.integers(1, 1229, count)
    w, g, m, v = ({n: rng.uniform(0.1, 1.0, s) for n, s in zip(names, sizes)} for _ in range(4))
    attrs = {n: dict(zip(("alpha", "beta", "lambda", "epsilon"), rng.uniform(0.1, 1.0, 4))) for n in names}
    lr = float(rng.uniform(0.1, 1.0))
    sess = session("LambOptimizer", w, backend, state={n: moments(m[n], v[n]) for n in names},
                   optimizer_attributes_map=attrs)
    step(sess, g, lr)
    state = sess.get_state()
    for n in names:
        a = attrs[n]
        want, m1, _ = lamb_ref(*(x[n].astype(F32).astype(F64) for x in (w, g, m, v)), 1, lr, a["alpha"],
                               a["beta"], a["lambda"], a["epsilon"])
        close(state[n], want, rtol=2e-6, atol=1e-7, what=n)
        close(state[f"Moment_1_{n}"], m1, rtol=1e-6, what=f"Moment_1_{n}")


@pytest.mark.parametrize("size", [55667, extended(1944006, id="1944006"), extended(3907584, id="3907584")])
def test_lamb_large_weight(size: int) -> None:
    """LambOptimizerTestLarge (optimizer_ops_test.cc): one weight of 55667 values (the full tier also the
    test's 1944006 and 3907584), every input drawn from [0.1, 1): the norms of the trust ratio sum that
    many squares."""
    rng = np.random.default_rng(0)
    w, g, m, v = (rng.uniform(0.1, 1.0, size) for _ in range(4))
    sess = session("LambOptimizer", {"W": w}, state={"W": moments(m, v)},
                   optimizer_attributes_map={"W": LAMB_ATTRS})
    step(sess, {"W": g}, 0.5)
    want, _, _ = lamb_ref(*(x.astype(F32).astype(F64) for x in (w, g, m, v)), 1, 0.5, LAMB_ATTRS["alpha"],
                          LAMB_ATTRS["beta"], LAMB_ATTRS["lambda"], LAMB_ATTRS["epsilon"])
    close(sess.get_state()["W"], want, rtol=1e-5, atol=1e-6, what="W")


# ---------------------------------------------------------------------------------------- AdamW, 10 steps
# TorchAdamWSingleWeightTest_Loop10Steps (orttraining/orttraining/test/training_ops/cuda/optimizer/
# adamw_test.cc, data from torch.optim.AdamW): lr 1e-3, α 0.9, β 0.999, ε 1e-8, weight decay 1e-2
TORCH_ADAMW_WEIGHTS = [  # before each step, and after the last
    [-0.18330415, 0.6739549, 0.3117089, 0.42830977, -0.39579117, 0.07424858],
    [-0.18230231, 0.6729482, 0.31270576, 0.4273055, -0.39478722, 0.073247835],
    [-0.18131775, 0.67253, 0.31352443, 0.42674997, -0.39517558, 0.072352484],
    [-0.18059653, 0.6721751, 0.3133565, 0.42615423, -0.39525184, 0.071778126],
    [-0.17977662, 0.6717074, 0.31389162, 0.42545584, -0.39562652, 0.07182311],
    [-0.17979622, 0.6710587, 0.31389156, 0.4246631, -0.39521962, 0.07233689],
    [-0.17989334, 0.67029196, 0.31416565, 0.42445076, -0.3947013, 0.07293851],
    [-0.179972, 0.66955495, 0.31445312, 0.4242259, -0.39403903, 0.07336583],
    [-0.17965378, 0.66875094, 0.31469414, 0.42395133, -0.3932723, 0.07322361],
    [-0.1792204, 0.6680363, 0.3151285, 0.4236793, -0.3924334, 0.0730921],
    [-0.17886575, 0.66727906, 0.31523493, 0.42340374, -0.39180413, 0.07277241],
]
TORCH_ADAMW_GRADIENTS = [
    [-0.18660535, 1.0501877, -0.06538727, 0.78924006, -0.06989894, 0.08311288],
    [-0.14019422, -0.33581918, -0.015272594, -0.11933345, 0.15028854, 0.3035297],
    [0.014209908, 0.052604817, 0.0971713, 0.2388823, -0.056654222, -0.053932328],
    [-0.31329307, 0.3852916, -0.5335826, 0.41899508, 0.117559165, -0.29191104],
    [0.52060837, 0.90293646, 0.45157418, 1.2402161, -0.57814085, -0.977114],
    [0.101783685, 1.272549, -0.43885383, -1.2290779, -0.24205326, -0.41463307],
    [-0.0077258185, 0.28624183, -0.08212745, 0.15442972, -0.4620122, 0.2059978],
    [-0.71347064, 0.98037124, 0.02016977, 0.3170175, -0.6400585, 1.4056847],
    [-0.35443836, 0.0006996552, -0.5025327, 0.11614283, -0.77054685, 0.019379474],
    [0.06727458, 0.71261775, 0.5345064, 0.13658585, 0.27908903, 0.8989311],
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_legacy_adam_mode_0_follows_torch_adamw_for_10_steps(backend: str) -> None:
    """TorchAdamWSingleWeightTest_Loop10Steps (cuda/optimizer/adamw_test.cc) on the legacy AdamOptimizer's
    weight_decay_mode 0 (PyTorch's AdamW, as adam.cu's mode 0 says): its weights after each of 10 steps (the
    test's tolerance), and torch.optim.AdamW itself run on the same gradients."""
    torch = pytest.importorskip("torch")
    w0 = np.array(TORCH_ADAMW_WEIGHTS[0]).reshape(2, 3)
    sess = session("AdamOptimizer", {"W": w0}, backend, optimizer_attributes_map={"W": {"lambda": 1e-2}})
    wt = torch.tensor(w0.astype(F32).astype(F64), requires_grad=True)
    opt = torch.optim.AdamW([wt], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2)
    for t, g in enumerate(TORCH_ADAMW_GRADIENTS):
        grad = np.array(g, F32).reshape(2, 3)
        step(sess, {"W": grad}, 1e-3)
        wt.grad = torch.tensor(grad.astype(F64))
        opt.step()
        got = sess.get_state()["W"]
        close(got.ravel(), TORCH_ADAMW_WEIGHTS[t + 1], rtol=1e-4, atol=1e-5,
              what=f"step {t + 1} (onnxruntime's)")
        close(got, wt.detach().numpy(), rtol=1e-5, atol=1e-7, what=f"step {t + 1} (torch)")
    assert sess.get_optimizer_state()["W"]["Update_Count"].tolist() == [11]


# HFAdamWMultipleWeightsTest_Loop10Steps (cuda/optimizer/adamw_test.cc, data from Hugging Face's AdamW):
# lr 1e-3, α 0.9, β 0.999, ε 1e-6, no weight decay, bias-corrected step size
HF_SHAPES = {"fc1.weight": (2, 3), "fc1.bias": (3,), "fc2.weight": (3, 2), "fc2.bias": (2,)}
HF_FIRST = {
    "fc1.weight": [0.039699044, -0.1405438, 0.6361624, 0.3636222, -0.21526536, 0.3459897],
    "fc1.bias": [0.5179555, -0.43510795, -0.12118204],
    "fc2.weight": [-0.5107945, 0.045720927, 0.21493156, -0.03950736, -0.35901335, 0.30300942],
    "fc2.bias": [0.023823332, 0.53758854],
}
HF_LAST = {  # after the 10th step
    "fc1.weight": [0.041278224, -0.14465518, 0.6394301, 0.36230576, -0.21250115, 0.339393],
    "fc1.bias": [0.512943, -0.43183872, -0.12807268],
    "fc2.weight": [-0.5049375, 0.046578184, 0.2189004, -0.047778137, -0.36093533, 0.29767692],
    "fc2.bias": [0.029835783, 0.52934104],
}
HF_GRADIENTS = {
    "fc1.weight": [
        [-0.09586181, 0.17629345, 0.0, 0.0, -0.32529348, 0.04030715],
        [0.06834118, 0.08454809, -0.03257603, 0.003821307, 0.11912338, 0.22665249],
        [0.14587241, 0.061909888, -0.048467256, -0.08001699, 0.01010122, 0.019008288],
        [-0.13795517, -0.046709955, 0.0, 0.0, 0.0, 0.0],
        [0.17391214, 0.5486637, 0.0, 0.0, 0.0, 0.0],
        [-0.5883157, -0.7570428, 0.17399102, 0.22668226, 0.05208155, 0.06785387],
        [0.1634007, -0.054908697, 0.0, 0.0, -0.07045339, 0.042855613],
        [-0.04708763, 0.18948916, -0.50407434, 0.18441166, -0.01673333, 0.1734673],
        [-0.08061128, 0.06998594, 0.0, 0.0, 0.0, 0.0],
        [0.022378631, 0.07342364, 0.0, 0.0, 0.0, 0.0],
    ],
    "fc1.bias": [
        [0.30900255, 0.0, 0.36434337],
        [0.16206324, -0.025315944, 0.37580276],
        [0.13361552, -0.077632844, 0.01748341],
        [0.30953294, 0.0, 0.0],
        [-0.287035, 0.0, 0.0],
        [0.075108826, 0.16361739, 0.04897636],
        [-0.38378465, 0.0, 0.18684858],
        [0.17582831, -0.4588748, 0.19721851],
        [-0.050648615, 0.0, 0.0],
        [0.11546661, 0.0, 0.0],
    ],
    "fc2.weight": [
        [-0.31826627, 0.0, -0.10227942, 0.7872374, 0.0, 0.2039589],
        [-0.2035816, -0.012988876, -0.0072859353, 0.72063875, 0.021517584, 0.02756824],
        [-0.13538884, -0.11738108, -0.022565873, 0.06767718, 0.057625376, 0.023622716],
        [-0.34125668, 0.0, 0.0, 0.3015144, 0.0, 0.0],
        [0.30986175, 0.0, 0.0, 1.4481032, 0.0, 0.0],
        [-0.2343559, 0.5371115, 0.087428816, -0.1303899, -0.26854572, -0.04371277],
        [0.30305678, 0.0, 0.01286526, 0.6520397, 0.0, 0.011255648],
        [-0.22533442, -0.007282924, -0.09457447, 1.1683875, 0.15443821, 0.19560373],
        [0.02437459, 0.0, 0.0, 0.5862967, 0.0, 0.0],
        [-0.11917039, 0.0, 0.0, 0.22678037, 0.0, 0.0],
    ],
    "fc2.bias": [
        [-0.73845947, 1.7262223],
        [-0.44501105, 1.5997354],
        [-0.2772748, 0.17998222],
        [-0.65890837, 0.5939946],
        [0.39519566, 2.0108397],
        [-0.11681646, -0.36257744],
        [0.6392148, 1.3514249],
        [-0.55234224, 2.2824335],
        [0.025046706, 0.8225188],
        [-0.22959742, 0.0114171505],
    ],
}


def hf_adamw_reference() -> list[dict[str, np.ndarray]]:
    """The weights after each of the 10 steps in float64: Hugging Face's AdamW as adam.cu's mode 1 writes
    it (step size lr·sqrt(1 − β^t)/(1 − α^t), ε on the uncorrected sqrt(m2))."""
    w = {n: np.array(v, F32).astype(F64).reshape(HF_SHAPES[n]) for n, v in HF_FIRST.items()}
    m1 = {n: np.zeros(s) for n, s in HF_SHAPES.items()}
    m2 = {n: np.zeros(s) for n, s in HF_SHAPES.items()}
    out = []
    for t in range(10):
        for n in w:
            g = np.array(HF_GRADIENTS[n][t], F32).astype(F64).reshape(HF_SHAPES[n])
            w[n], m1[n], m2[n] = adam_ref(w[n], g, m1[n], m2[n], t + 1, 1e-3, eps=1e-6, mode=1)
        out.append({n: v.copy() for n, v in w.items()})
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_legacy_adam_mode_1_follows_hugging_face_adamw_for_10_steps(backend: str) -> None:
    """HFAdamWMultipleWeightsTest_Loop10Steps (cuda/optimizer/adamw_test.cc) on the legacy AdamOptimizer's
    weight_decay_mode 1 over four weights (one flat update: same dtype and attributes), whose gradients hold
    zeros (their moments stay 0, the step 0/(0 + ε)): the float64 formula after each step, and onnxruntime's
    weights after the 10th (the test's tolerance)."""
    names = list(HF_SHAPES)
    first = {n: np.reshape(HF_FIRST[n], HF_SHAPES[n]) for n in names}
    sess = session("AdamOptimizer", first, backend,
                   optimizer_attributes_map={n: {"epsilon": 1e-6} for n in names},
                   optimizer_int_attributes_map={n: {"weight_decay_mode": 1} for n in names})
    for t, want in enumerate(hf_adamw_reference()):
        step(sess, {n: np.reshape(HF_GRADIENTS[n][t], HF_SHAPES[n]) for n in names}, 1e-3)
        state = sess.get_state()
        for n in names:
            close(state[n], want[n], rtol=1e-6, atol=1e-7, what=f"{n}, step {t + 1}")
    for n in names:
        close(sess.get_state()[n].ravel(), HF_LAST[n], rtol=1e-4, atol=1e-5, what=f"{n} (onnxruntime's)")
        assert sess.get_optimizer_state()[n]["Update_Count"].tolist() == [11]


@pytest.mark.parametrize("runner", BACKENDS)
@pytest.mark.parametrize("flat", [False, True])
def test_ondevice_adamw_follows_hugging_face_adamw_for_10_steps(runner: str, flat: bool) -> None:
    """HFAdamWMultipleWeightsTest_Loop10Steps (cuda/optimizer/adamw_test.cc) on the on-device AdamW
    optimizer model (onnxblock.optim.AdamW(eps=1e-6)), run by the numpy engine and by onnxruntime with the
    step count fed as the Optimizer feeds it (1 at the first step), one input per parameter or, as the
    Optimizer's flat update runs it, one for all four laid end to end."""
    from onnxtrain.engine import compile_model
    from onnxtrain.training import onnxblock
    from onnxtrain.training.optimizer_model import build_optimizer_model

    names = list(HF_SHAPES)
    sizes = [int(np.prod(HF_SHAPES[n])) for n in names]
    shapes = {"flat": (sum(sizes),)} if flat else HF_SHAPES
    model = build_optimizer_model(
        onnxblock.optim.AdamW(eps=1e-6),
        [(p, helper.make_tensor_type_proto(TensorProto.FLOAT, list(s))) for p, s in shapes.items()], 17)
    if runner == "numpy":
        plan = compile_model(model)
        run = plan.run
    else:
        import onnxruntime as ort

        ort_sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

        def run(feeds: dict) -> list:
            return ort_sess.run(None, feeds)

    def pack(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not flat:
            return {n: np.asarray(values[n], F32).reshape(HF_SHAPES[n]) for n in names}
        return {"flat": np.concatenate([np.asarray(values[n], F32).ravel() for n in names])}

    state = pack(HF_FIRST)
    moments_ = {p: (np.zeros(s, F32), np.zeros(s, F32)) for p, s in shapes.items()}
    outputs = [o.name for o in model.graph.output]
    for t, want in enumerate(hf_adamw_reference()):
        grads = pack({n: HF_GRADIENTS[n][t] for n in names})
        feeds = {"learning_rate": np.array([1e-3], F32), "step": np.array([t + 1], np.int64)}
        for p in shapes:
            feeds.update({p: state[p], f"{p}_grad": grads[p], f"{p}.momentum0": moments_[p][0],
                          f"{p}.momentum1": moments_[p][1]})
        out = dict(zip(outputs, run(feeds)))
        state = {p: out[f"{p}.out"] for p in shapes}
        moments_ = {p: (out[f"{p}.momentum0.out"], out[f"{p}.momentum1.out"]) for p in shapes}
        for p in shapes:
            close(state[p], _packed64(want, names, shapes, p, flat), rtol=1e-6, atol=1e-7,
                  what=f"{p}, step {t + 1}")
    for p, v in pack(HF_LAST).items():
        close(state[p], v, rtol=1e-4, atol=1e-5, what=f"{p} (onnxruntime's)")


def _packed64(values: dict[str, np.ndarray], names: list[str], shapes: dict, p: str,
              flat: bool) -> np.ndarray:
    """Float64 ``values`` laid out as input ``p`` takes them."""
    if flat:
        return np.concatenate([values[n].ravel() for n in names])
    return values[p].reshape(shapes[p])


@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
@pytest.mark.parametrize("mixed_precision", [False, True])
def test_initial_states_are_what_the_graph_starts_from(opt: str, mixed_precision: bool) -> None:
    """LoadOptimState_FullPrecision_Adam / _Lamb (orttraining/orttraining/test/graph/
    optimizer_graph_builder_test.cc): moments of 4 and a count of 3 given for two [1] weights are the state
    before the first step (Adam's Update_Count per weight, Lamb's shared Step), and the first step reads
    them (count 3 in, 4 out), with and without mixed precision."""
    weights = {"weight_1": np.array([1.0]), "weight_2": np.array([1.0])}
    four, three = np.array([4.0], F32), np.array([3], np.int64)
    if opt == "AdamOptimizer":
        state = {n: moments(four, four, Update_Count=three) for n in weights}
    else:
        state = {**{n: moments(four, four) for n in weights}, "shared_optimizer_state": {"Step": three}}
    sess = session(opt, weights, state=state, use_mixed_precision=mixed_precision,
                   optimizer_int_attributes_map={n: {"do_bias_correction": 1} for n in weights})
    got = sess.get_optimizer_state()
    for n in weights:
        for key in ("Moment_1", "Moment_2"):
            np.testing.assert_array_equal(got[n][key], four, err_msg=f"{n} {key}")
        if opt == "AdamOptimizer":
            assert got[n]["Update_Count"].tolist() == [3]
    if opt == "LambOptimizer":
        assert got["shared_optimizer_state"]["Step"].tolist() == [3]
    # the gradient 2 of optimizer_graph_builder_test's base graph, one step at η 0.1
    step(sess, {n: [2.0] for n in weights}, 0.1, loss_scale=1.0 if mixed_precision else None)
    ref = adam_ref if opt == "AdamOptimizer" else lamb_ref
    eps = 1e-8 if opt == "AdamOptimizer" else 1e-6
    want, m1, m2 = ref(np.array([1.0]), np.array([2.0]), np.array([4.0]), np.array([4.0]), 3, 0.1, eps=eps,
                       bias=True)
    got = sess.get_optimizer_state()
    for n in weights:
        close(sess.get_state()[n], want, rtol=1e-6, what=n)
        close(got[n]["Moment_1"], m1, rtol=1e-6, what=f"{n} Moment_1")
        if opt == "AdamOptimizer":
            assert got[n]["Update_Count"].tolist() == [4]
    if opt == "LambOptimizer":
        assert got["shared_optimizer_state"]["Step"].tolist() == [4]


# the end of the onnxruntime-training scripts below: `count` steps at `lr` over the artifacts in `folder`,
# the weights after each printed as JSON
_ORTT_TRAIN = r"""
state, m, o = open_artifacts(folder, lr)
steps = []
for t in range(count):
    m(*[data[f"{n}_{t}"] for n in names]); o.step(); m.lazy_reset_grad()
    steps.append({n: state.parameters[n].data.ravel().tolist() for n in names})
print(json.dumps(steps))
"""


_ORTT_STEPS = r"""
import json

import numpy as np
from onnxruntime.training import artifacts

base, folder, optimizer, data = sys.argv[1], sys.argv[2], sys.argv[3], np.load(sys.argv[4])
names = json.loads(sys.argv[5])
artifacts.generate_artifacts(onnx.load(base), requires_grad=names, loss=None,
                             optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=folder)
lr, count = 1e-3, 10
"""


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_ondevice_artifacts_step_as_onnxruntime_training_on_the_hugging_face_data(optimizer: str,
                                                                                  tmp_path) -> None:
    """HFAdamWMultipleWeightsTest_Loop10Steps and SGDMultipleWeightsTest_Loop10Steps (cuda/optimizer/
    adamw_test.cc, sgd_test.cc: the same four weights, 10 steps at lr 1e-3): generate_artifacts with
    OptimType.AdamW or OptimType.SGD on a model whose gradients are its inputs, trained by onnxtrain's
    Module and Optimizer and by onnxruntime-training 1.19.2's on its own artifacts; after every step both
    hold the float64 formula's weights (Hugging Face's AdamW; w − lr·g), and at the end onnxruntime's
    expected AdamW weights."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer
    from tests.ortt import PREAMBLE, run_script

    names, model, base, data, data_path = _hugging_face_case(tmp_path, 10)
    theirs = run_script(PREAMBLE + _ORTT_STEPS + _ORTT_TRAIN, base, str(tmp_path / "theirs"), optimizer,
                        data_path, json.dumps(names))

    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    artifacts.generate_artifacts(model, requires_grad=names, loss=None,
                                 optimizer=getattr(artifacts.OptimType, optimizer),
                                 artifact_directory=ours_dir)
    state = CheckpointState.load_checkpoint(ours_dir / "checkpoint")
    module = Module(str(ours_dir / "training_model.onnx"), state)
    opt = Optimizer(str(ours_dir / "optimizer_model.onnx"), module)
    opt.set_learning_rate(1e-3)
    if optimizer == "AdamW":
        reference = hf_adamw_reference()
    else:
        w = {n: np.array(HF_FIRST[n], F32).astype(F64).reshape(HF_SHAPES[n]) for n in names}
        reference = []
        for t in range(10):
            w = {n: w[n] - 1e-3 * data[f"{n}_{t}"].astype(F64) for n in names}
            reference.append(w)
    for t in range(10):
        module(*[data[f"{n}_{t}"] for n in names])
        opt.step()
        module.lazy_reset_grad()
        for n in names:
            ours = state.parameters[n].data
            close(ours, reference[t][n], rtol=1e-6, atol=1e-7, what=f"{n}, step {t + 1} (float64)")
            close(ours.ravel(), theirs[t][n], rtol=1e-6, atol=1e-7,
                  what=f"{n}, step {t + 1} (onnxruntime-training)")
    if optimizer == "AdamW":
        for n in names:
            close(state.parameters[n].data.ravel(), HF_LAST[n], rtol=1e-4, atol=1e-5,
                  what=f"{n} (onnxruntime's)")
    assert opt.step_count == 10


_ORTT_DEFAULT_ATTRIBUTES = r"""
import numpy as np
from onnxruntime.training import artifacts

base, folder, data = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
names = json.loads(sys.argv[4])
artifacts.generate_artifacts(onnx.load(base), requires_grad=names, loss=None,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
opt_model = onnx.load(folder + "/optimizer_model.onnx")
for node in opt_model.graph.node:
    if node.op_type == "AdamWOptimizer":  # all but adam_mode left to the operator's defaults
        kept = [a for a in node.attribute if a.name == "adam_mode"]
        del node.attribute[:]
        node.attribute.extend(kept)
onnx.save(opt_model, folder + "/optimizer_model.onnx")
lr, count = 0.05, 3
"""


def test_translated_adamw_node_takes_the_operator_defaults(tmp_path) -> None:
    """An AdamWOptimizer node of onnxruntime-training that leaves its attributes out (an onnxblock AdamW given
    weight_decay=None writes none) runs with the operator schema's defaults (orttraining/orttraining/core/
    graph/training_op_defs.cc: α 0.9, β 0.999, ε 1e-8, weight_decay 1e-2, correct_bias 1): onnxtrain's
    Optimizer, translating that model, steps as onnxruntime-training 1.19.2 does on it (3 steps at lr
    0.05). The translation took weight_decay 0: no decay, 3e-4 off per step here."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer
    from tests.ortt import PREAMBLE, run_script

    names, model, base, data, data_path = _hugging_face_case(tmp_path, 3)
    folder = tmp_path / "theirs"
    theirs = run_script(PREAMBLE + _ORTT_DEFAULT_ATTRIBUTES + _ORTT_TRAIN, base, str(folder), data_path,
                        json.dumps(names))
    state = CheckpointState.load_checkpoint(folder / "checkpoint")
    module = Module(str(folder / "training_model.onnx"), state)
    opt = Optimizer(str(folder / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    w = {n: np.array(HF_FIRST[n], F32).astype(F64).reshape(HF_SHAPES[n]) for n in names}
    m1 = {n: np.zeros(s) for n, s in HF_SHAPES.items()}
    m2 = {n: np.zeros(s) for n, s in HF_SHAPES.items()}
    for t in range(3):
        module(*[data[f"{n}_{t}"] for n in names])
        opt.step()
        module.lazy_reset_grad()
        for n in names:
            w[n], m1[n], m2[n] = adam_ref(w[n], data[f"{n}_{t}"].astype(F64), m1[n], m2[n], t + 1, 0.05,
                                          lam=1e-2, eps=1e-8, mode=1)
            ours = state.parameters[n].data
            close(ours.ravel(), theirs[t][n], rtol=1e-6, atol=1e-7, what=f"{n}, step {t + 1}")
            close(ours, w[n], rtol=1e-6, atol=1e-7, what=f"{n}, step {t + 1} (float64)")


_ORTT_BLOCK_STEPS = r"""
import numpy as np
from onnxruntime.training import artifacts, onnxblock

base, folder, data = sys.argv[1], sys.argv[2], np.load(sys.argv[3])
names, kwargs = json.loads(sys.argv[4]), json.loads(sys.argv[5])
artifacts.generate_artifacts(onnx.load(base), requires_grad=names, loss=None,
                             optimizer=onnxblock.optim.AdamW(**kwargs), artifact_directory=folder)
lr, count = 0.05, 3
"""


@pytest.mark.parametrize("kwargs", [{"weight_decay": None}, {"eps": None}, {"bias_correction": None}],
                         ids=["weight_decay", "eps", "bias_correction"])
def test_adamw_block_options_of_none_step_as_onnxruntime_training(kwargs: dict, tmp_path) -> None:
    """onnxruntime-training's onnxblock AdamW takes None for eps and weight_decay (typed Optional) and then
    writes no such attribute, so its AdamWOptimizer runs with the operator's defaults, ε 1e-8 and weight
    decay 1e-2 (training_op_defs.cc); None for bias_correction turns the correction off. onnxtrain's block,
    given the same, steps as onnxruntime-training 1.19.2's artifacts (3 steps at lr 0.05 on the Hugging Face
    data's weights) and records the values it ran with."""
    from onnxtrain.training import artifacts, onnxblock
    from onnxtrain.training.api import CheckpointState, Module, Optimizer
    from tests.ortt import PREAMBLE, run_script

    names, model, base, data, data_path = _hugging_face_case(tmp_path, 3)
    theirs = run_script(PREAMBLE + _ORTT_BLOCK_STEPS + _ORTT_TRAIN, base, str(tmp_path / "theirs"),
                        data_path, json.dumps(names), json.dumps(kwargs))
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    block = onnxblock.optim.AdamW(**kwargs)
    want = {"eps": 1e-8 if "eps" in kwargs else 1e-6, "bias_correction": "bias_correction" not in kwargs,
            "weight_decay": 1e-2 if "weight_decay" in kwargs else 0.0}
    assert {k: block.hyperparameters()[k] for k in want} == want
    artifacts.generate_artifacts(model, requires_grad=names, loss=None, optimizer=block,
                                 artifact_directory=ours_dir)
    state = CheckpointState.load_checkpoint(ours_dir / "checkpoint")
    module = Module(str(ours_dir / "training_model.onnx"), state)
    opt = Optimizer(str(ours_dir / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    for t in range(3):
        module(*[data[f"{n}_{t}"] for n in names])
        opt.step()
        module.lazy_reset_grad()
        for n in names:
            close(state.parameters[n].data.ravel(), theirs[t][n], rtol=1e-6, atol=1e-7,
                  what=f"{n}, step {t + 1}")

"""``ai.onnx.ml`` SVMRegressor (scikit-learn's SVR, NuSVR, LinearSVR and OneClassSVM; inference only).

Y = Σ coefficientᵢ · K(X, support vectorᵢ) + rho, one column of float32 per row, with K one of LINEAR
(X·v), POLY ((γ·X·v + c)^d), RBF (exp(−γ·|X − v|²)) and SIGMOID (tanh(γ·X·v + c)), ``kernel_params``
being (γ, c, d). With no support vectors the coefficients are a linear model's weights (LIBLINEAR's form),
and ``one_class`` turns each value into 1 or −1 by its sign, as onnxruntime does.
"""

from __future__ import annotations

import numpy as np

from onnxtrain.engine.kernels.ml import ML
from onnxtrain.engine.kernels.ml_linear import _rows, _text
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel


def _kernel_matrix(x: np.ndarray, sv: np.ndarray, kind: str, params: list[float], op: str) -> np.ndarray:
    """K(xᵢ, svⱼ) for every row and support vector, float32."""
    if len(params) not in (0, 3):
        raise ValueError(f"{op}: kernel_params holds {len(params)} values; give none or three (gamma, coef0, "
                         "degree)")
    gamma, coef0, degree = list(params) if params else (0.0, 0.0, 0.0)
    if kind == "RBF":
        d = x[:, None, :] - sv[None, :, :]
        return np.exp(np.float32(-gamma) * np.einsum("nsc,nsc->ns", d, d))
    dot = x @ sv.T
    if kind == "LINEAR":
        return dot
    if kind == "POLY":
        return (np.float32(gamma) * dot + np.float32(coef0)) ** np.float32(degree)
    if kind == "SIGMOID":
        return np.tanh(np.float32(gamma) * dot + np.float32(coef0))
    raise ValueError(f"{op}: kernel_type must be LINEAR, POLY, RBF or SIGMOID, got {kind!r}")


@kernel("SVMRegressor", domain=ML)
def svm_regressor(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = f"SVMRegressor {attrs.name!r}"
    x = _rows(np.asarray(inputs[0]), op).astype(np.float32)
    c = x.shape[1]
    coef = np.asarray(attrs.get("coefficients") or [], np.float32)
    rho = np.asarray(attrs.get("rho") or [0.0], np.float32)
    n = int(attrs.get("n_supports") or 0)
    if n:
        sv = np.asarray(attrs.get("support_vectors") or [], np.float32)
        if sv.size != n * c or coef.size != n:
            raise ValueError(f"{op}: {n} support vectors need {n * c} support_vectors values for {c} "
                             f"features and {n} coefficients; got {sv.size} and {coef.size}")
        kind = _text(attrs.get("kernel_type") or "LINEAR")
        k = _kernel_matrix(x, sv.reshape(n, c), kind, attrs.get("kernel_params") or [], op)
        y = k @ coef + rho[0]
    else:
        if coef.size != c:
            raise ValueError(f"{op}: {coef.size} coefficients for {c} features (without support vectors: one "
                             "each)")
        y = x @ coef + rho[0]
    if attrs.get("one_class"):
        y = np.where(y > 0, np.float32(1), np.float32(-1))
    post = _text(attrs.get("post_transform") or "NONE")
    if post != "NONE":
        raise ValueError(f"{op}: post_transform {post!r} is not supported (NONE)")
    return (np.asarray(y, np.float32).reshape(-1, 1),)

"""Op table rows for the ops ONNX defines by a function body and onnxtrain runs and differentiates as that
body (onnxtrain/ir/functions.py): those introduced after opset 21, e.g. torch's opset-23 exports of
``nn.RMSNorm`` and ``scaled_dot_product_attention``."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

# stash_type / softmax_precision: compute in float64, so that the float64 checks stay exact (the default
# stash_type, float32, is checked by ONNX's conformance cases and against torch in float32)
_F64 = 11
# why onnx.reference's own kernels cannot check these rows (the rows compare with it running the ONNX body)
_RMS_STASH = "onnx.reference's RMSNormalization computes in float32 only (stash_type 1)"
_SCALE_F32 = ("the ONNX body takes the scale's square root in float32 (it scales Q and K by it); "
              "onnx.reference's kernel scales in float64")
_STATE_F32 = "the ONNX body keeps the recurrent state in float32; onnx.reference's kernel keeps float64"


def _rope(shape: tuple[int, ...], rot: int, positions: bool):
    """x, cos and sin caches for RotaryEmbedding (``rot``: the rotated width), then position ids."""

    def make(rng: np.random.Generator, dt) -> list:
        x = rng.uniform(-2, 2, shape).astype(dt)
        seq = shape[-2] if len(shape) == 4 else shape[1]
        angles = rng.uniform(0, 2 * np.pi, (8 if positions else shape[0], *(() if positions else (seq,)),
                                            rot // 2))
        out = [x, np.cos(angles).astype(dt), np.sin(angles).astype(dt)]
        if positions:
            out.append(rng.integers(0, 8, (shape[0], seq)).astype(np.int64))
        return out

    return make


def _attention_case(variant: str, make, **kw) -> OpCase:
    return OpCase("Attention", make_inputs=make, opset=kw.pop("opset", 23), variant=variant,
                  body_oracle=_SCALE_F32, **kw)


def _attention(q: tuple[int, ...], kv: tuple[int, ...], mask: tuple[int, ...] | None = None,
               boolean: bool = False, past: tuple[int, ...] | None = None):
    """Q, K, V, an optional mask (additive, or boolean with every row keeping a value), optional past K/V."""

    def make(rng: np.random.Generator, dt) -> list:
        out: list = [rng.uniform(-1, 1, s).astype(dt) for s in (q, kv, kv)]
        if mask is not None:
            if boolean:
                m = rng.uniform(0, 1, mask) < 0.7
                m[..., 0] = True
                out.append(m)
            else:
                out.append(rng.uniform(-1, 0, mask).astype(dt))
        elif past is not None:
            out.append(None)
        if past is not None:
            out += [rng.uniform(-1, 1, past).astype(dt) for _ in range(2)]
        return out

    return make


def _conv_state(rng: np.random.Generator, dt) -> list:
    """CausalConvWithState: input (2, 3, 5), depthwise weight (3, 1, 3), bias, past state (2, 3, 2)."""
    return [rng.uniform(-1, 1, s).astype(dt) for s in ((2, 3, 5), (3, 1, 3), (3,), (2, 3, 2))]


def _linear_attention(rule: str):
    """query, key, value (B=2, T=3, 2 heads of 4), zero past state, decay (log gates) and beta."""

    def make(rng: np.random.Generator, dt) -> list:
        q, k, v = (rng.uniform(-1, 1, (2, 3, 8)).astype(dt) for _ in range(3))
        state = rng.uniform(-0.5, 0.5, (2, 2, 4, 4)).astype(dt)
        decay = rng.uniform(-0.5, -0.05, (2, 3, 2)).astype(dt) if "gated" in rule else None
        beta = rng.uniform(0.2, 0.9, (2, 3, 2)).astype(dt) if "delta" in rule else None
        return [q, k, v, state, decay, beta]

    return make


CASES = [
    OpCase("RMSNormalization", [(2, 3, 8), (8,)], attrs={"stash_type": _F64}, opset=23,
           body_oracle=_RMS_STASH),
    OpCase("RMSNormalization", [(2, 3, 4), (3, 4)], attrs={"axis": 1, "epsilon": 1e-3, "stash_type": _F64},
           opset=23, variant="axis1", body_oracle=_RMS_STASH),
    OpCase("RotaryEmbedding", make_inputs=_rope((2, 2, 3, 8), 8, positions=True), opset=23, wrt=(0, 1, 2)),
    OpCase("RotaryEmbedding", make_inputs=_rope((2, 3, 12), 4, positions=False),
           attrs={"num_heads": 2, "rotary_embedding_dim": 4, "interleaved": 1}, opset=23,
           variant="3d_interleaved_partial", wrt=(0, 1, 2)),
    _attention_case("", _attention((2, 2, 3, 4), (2, 2, 5, 4))),
    _attention_case("3d", _attention((2, 3, 8), (2, 4, 8)), attrs={"q_num_heads": 2, "kv_num_heads": 2}),
    _attention_case("causal_gqa", _attention((1, 4, 3, 4), (1, 2, 3, 4)), attrs={"is_causal": 1}),
    _attention_case("mask_scale_softcap", _attention((2, 2, 3, 4), (2, 2, 4, 4), mask=(3, 4)),
                    attrs={"scale": 0.3, "softcap": 2.0}, wrt=(0, 1, 2)),
    _attention_case("bool_mask", _attention((2, 2, 3, 4), (2, 2, 4, 4), mask=(2, 1, 3, 4), boolean=True),
                    attrs={"softmax_precision": _F64}),
    _attention_case("past_kv", _attention((1, 2, 2, 4), (1, 2, 2, 4), past=(1, 2, 3, 4)), n_outputs=3,
                    attrs={"is_causal": 1}),
    _attention_case("qk_output", _attention((1, 2, 3, 4), (1, 2, 3, 4)), n_outputs=4,
                    attrs={"qk_matmul_output_mode": 2}, grad_outputs=(0, 3)),
    _attention_case("v24", _attention((2, 2, 3, 4), (2, 2, 4, 4)), opset=24),
    OpCase("Swish", [(3, 5)], opset=24),
    OpCase("Swish", [(2, 3, 4)], attrs={"alpha": 1.702}, opset=24, variant="alpha"),
    OpCase("SwiGLU", [(3, 5), (3, 5)], opset=28),
    OpCase("SwiGLU", [(2, 3, 4), (2, 3, 4)], attrs={"alpha": 0.5}, opset=28, variant="alpha"),
    OpCase("CausalConvWithState", make_inputs=_conv_state, n_outputs=2, opset=27),
    # the body computes the SiLU in float32: float64 finite differences would see float32 steps
    OpCase("CausalConvWithState", make_inputs=_conv_state, n_outputs=2, attrs={"activation": "silu"},
           opset=27, variant="silu", grad=False),
    # gradients: against torch (test_function_ops_vs_torch); the body's float32 state hides them from float64
    # finite differences
    OpCase("LinearAttention", make_inputs=_linear_attention("linear"), n_outputs=2,
           attrs={"q_num_heads": 2, "kv_num_heads": 2, "update_rule": "linear"}, opset=27, variant="linear",
           grad=False, body_oracle=_STATE_F32),
    OpCase("LinearAttention", make_inputs=_linear_attention("gated_delta"), n_outputs=2,
           attrs={"q_num_heads": 2, "kv_num_heads": 2}, opset=27, variant="gated_delta", grad=False,
           body_oracle=_STATE_F32),
]

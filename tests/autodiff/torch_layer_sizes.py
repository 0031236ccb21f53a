"""Input sizes of the dynamic layer audit (``test_torch_layers_dynamic.py``), and the dynamic exports that
are torch's function only at the export's size; the static audit reads them too (its dynamo variant
leaves out the cases the dynamic one runs)."""

from __future__ import annotations

from tests.tiers import full

# case → (input shapes at the export's size, input shapes at a second size): dims the layer fixes
# (channels, features, class counts, a mask's or a loop's length) are kept, the others grow
SIZES: dict[str, tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]] = {
    # ---- convolutions
    "Conv3d": (((2, 2, 4, 5, 4),), ((3, 2, 5, 7, 3),)),
    "Conv1d_groups_no_bias": (((2, 4, 6),), ((3, 4, 9),)),
    "Conv2d_circular": (((2, 2, 4, 5),), ((3, 2, 6, 7),)),
    "Conv1d_reflect_same": (((2, 2, 7),), ((3, 2, 10),)),
    "Conv2d_same_dilation_even": (((2, 2, 5, 6),), ((3, 2, 8, 7),)),
    "ConvTranspose1d": (((2, 3, 5),), ((3, 3, 8),)),
    "ConvTranspose3d_groups_output_padding": (((2, 4, 2, 3, 2),), ((3, 4, 3, 4, 3),)),
    # ---- pools
    "MaxPool1d_ceil_dilation": (((2, 3, 10),), ((3, 3, 13),)),
    "MaxPool2d_dilation_pad_ceil": (((2, 2, 7, 8),), ((3, 2, 10, 11),)),
    "MaxPool3d_pad_ceil": (((2, 2, 4, 5, 5),), ((3, 2, 5, 6, 7),)),
    "AvgPool1d_no_pad_count_ceil": (((2, 3, 8),), ((3, 3, 11),)),
    "AvgPool3d_pad_ceil": (((2, 2, 4, 5, 6),), ((3, 2, 5, 7, 6),)),
    "LPPool1d": (((2, 3, 7),), ((3, 3, 10),)),
    "AdaptiveAvgPool1d": (((2, 3, 8),), ((3, 3, 12),)),
    "AdaptiveMaxPool2d": (((2, 2, 4, 6),), ((3, 2, 6, 9),)),
    "AdaptiveMaxPool2d_global": (((2, 3, 4, 5),), ((3, 3, 6, 7),)),
    "MaxUnpool2d": (((2, 2, 4, 6),), ((3, 2, 6, 9),)),
    # ---- resizes and rearrangements
    "Upsample_nearest": (((2, 2, 3, 4),), ((3, 2, 5, 6),)),
    "Upsample_bilinear": (((2, 2, 3, 4),), ((3, 2, 5, 6),)),
    "Upsample_linear_align": (((2, 2, 5),), ((3, 2, 7),)),
    "Upsample_bicubic_align": (((2, 2, 3, 4),), ((3, 2, 4, 7),)),
    "Upsample_trilinear": (((2, 2, 2, 3, 2),), ((3, 2, 3, 2, 4),)),
    "PixelShuffle": (((2, 8, 2, 3),), ((3, 8, 3, 4),)),
    "Unfold": (((2, 3, 4, 5),), ((3, 3, 6, 7),)),
    # ---- normalization
    "BatchNorm3d": (((2, 2, 3, 2, 2),), ((3, 2, 4, 3, 2),)),
    "GroupNorm": (((2, 4, 3, 3),), ((3, 4, 5, 4),)),
    "InstanceNorm3d_affine": (((2, 2, 3, 3, 2),), ((3, 2, 4, 3, 5),)),
    "LayerNorm_no_bias": (((2, 3, 4),), ((3, 5, 4),)),
    # ---- padding
    "ZeroPad2d": (((2, 2, 3, 4),), ((3, 2, 5, 6),)),
    "ConstantPad2d_negative": (((2, 2, 3, 4),), ((3, 2, 5, 6),)),
    "ReflectionPad2d": (((2, 2, 3, 4),), ((3, 2, 5, 6),)),
    "ReplicationPad3d": (((2, 2, 2, 3, 3),), ((3, 2, 3, 4, 5),)),
    "CircularPad1d": (((2, 3, 4),), ((3, 3, 6),)),
    # ---- activations
    "Hardswish": (((4, 7),), ((5, 9),)),
    "PReLU_per_channel": (((2, 3, 4),), ((3, 3, 7),)),
    "GLU": (((3, 6, 2),), ((4, 8, 5),)),
    "LogSoftmax": (((2, 3, 5),), ((3, 4, 7),)),
    # ---- distances, bilinear, embedding, recurrent, attention
    "Bilinear": (((5, 3), (5, 4)), ((7, 3), (7, 4))),
    "Embedding_max_norm": (((2, 3),), ((3, 4),)),
    "LSTMCell_GRUCell_RNNCell": (((3, 2, 3),), ((3, 4, 3),)),
    "LSTM_proj_size": (((2, 3, 3),), ((3, 5, 3),)),
    "MultiheadAttention_float_mask_no_weights": (((2, 3, 8), (2, 4, 8)), ((3, 3, 8), (3, 4, 8))),
    "TransformerEncoderLayer_norm_first_gelu": (((2, 3, 8),), ((3, 5, 8),)),
    "TransformerDecoderLayer": (((2, 3, 8), (2, 4, 8)), ((3, 5, 8), (3, 2, 8))),
    # ---- losses
    "SmoothL1Loss_sum": (((3, 4), (3, 4)), ((5, 6), (5, 6))),
    "KLDivLoss": (((3, 4), (3, 4)), ((5, 6), (5, 6))),
    "NLLLoss": (((5, 4), (5,)), ((7, 6), (7,))),
    "NLLLoss_2d": (((2, 3, 2, 2), (2, 2, 2)), ((3, 3, 4, 5), (3, 4, 5))),
    "CrossEntropy_weight": (((5, 4), (5,)), ((8, 4), (8,))),
    "CrossEntropy_2d_sum": (((2, 3, 2, 2), (2, 2, 2)), ((3, 3, 4, 5), (3, 4, 5))),
    "BCEWithLogits_pos_weight": (((4, 3), (4, 3)), ((6, 3), (6, 3))),
    "MarginRankingLoss": (((6,), (6,), (6,)), ((9,), (9,), (9,))),
    "GaussianNLLLoss_full_shared_var": (((4, 3), (4, 3), (4, 1)), ((6, 5), (6, 5), (6, 1))),
    "MultiMarginLoss": (((5, 4), (5,)), ((7, 6), (7,))),
    "PoissonNLLLoss": (((4, 3), (4, 3)), ((6, 5), (6, 5))),
}

# (case, exporter) → why the dynamic export is not torch's function at another size (the static one is):
# skipped, as the audit's EXPORT_WRONG
EXPORT_WRONG_DYNAMIC: dict[tuple[str, str], str] = {
    **{(c, "dynamo"): f"writes the adaptive pool as {op} whose kernel and strides are the export size's "
       "(8 → 4, 4×6 → 2×3: 2 and 2×2): 6 outputs at 12, 3×4 at 6×9 (onnxruntime gives the same)"
       for c, op in (("AdaptiveAvgPool1d", "an AveragePool"), ("AdaptiveMaxPool2d", "a MaxPool"))},
    **{(c, "torchscript"): "writes the export's sequence length as a constant in MultiheadAttention's "
       "Reshape to heads (onnxruntime fails the same at another length)"
       for c in ("TransformerEncoderLayer_norm_first_gelu", "TransformerDecoderLayer")},
}


# the cases whose dynamo export with every dim dynamic the default suite runs, one or two of each family (an
# export with dynamic dims takes about 2.5 s, a static one 0.6 s); the full suite (tests/tiers.py) runs every
# case of SIZES, and in the default one the static audit runs the others' static dynamo export
DEFAULT_DYNAMO = frozenset({
    "Conv2d_same_dilation_even", "ConvTranspose1d", "MaxPool2d_dilation_pad_ceil",
    "AvgPool1d_no_pad_count_ceil", "Upsample_bilinear", "LayerNorm_no_bias", "ReflectionPad2d", "LogSoftmax",
    "Embedding_max_norm", "TransformerEncoderLayer_norm_first_gelu", "NLLLoss", "CrossEntropy_2d_sum",
})
assert SIZES.keys() >= DEFAULT_DYNAMO, sorted(DEFAULT_DYNAMO - SIZES.keys())


def dynamic_dynamo_cases() -> frozenset[str]:
    """The cases whose dynamic dynamo export the dynamic audit runs in this suite (its first size is the
    static audit's): those of DEFAULT_DYNAMO, or every one in the full suite."""
    return frozenset(c for c in SIZES if (c, "dynamo") not in EXPORT_WRONG_DYNAMIC
                     and (c in DEFAULT_DYNAMO or full()))

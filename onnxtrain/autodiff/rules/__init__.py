"""Gradient rules, one module per op family, each registering its rules with
:func:`onnxtrain.autodiff.registry.gradient` and :func:`~onnxtrain.autodiff.registry.no_gradient`.

``MODULES`` names the ops that each module registers something for (a rule, a variant or a declaration
that the op has no gradient), so that the registry imports only the modules of the ops a graph holds:
a LeNet training graph imports 9 of the 20 modules listed (peak RSS of a session: see the registry's
docstring). The modules that only hold helpers of the RNN rules (``rnn_loop``, ``rnn_unroll``) and of the
control-flow rules (``body_draws``) are not listed.
``tests/autodiff/test_rule_index.py`` checks the table against what the modules register.
"""

from __future__ import annotations

MODULES: dict[str, tuple[str, ...]] = {
    "activation": (
        "Celu", "Clip", "Elu", "Gelu", "HardSigmoid", "HardSwish", "Hardmax", "LeakyRelu", "Mish", "PRelu",
        "Relu", "Selu", "Shrink", "Sigmoid", "Softplus", "Softsign", "Tanh", "ThresholdedRelu",
    ),
    "control_flow": ("If", "Loop", "Scan", "SequenceMap"),
    "conv": ("Col2Im", "Conv", "ConvTranspose"),
    "detection": ("MaxRoiPool", "NonMaxSuppression", "RoiAlign"),
    "elementwise": (
        "Abs", "Acos", "Acosh", "Add", "And", "Asin", "Asinh", "Atan", "Atanh", "BitCast", "BitShift",
        "BitwiseAnd", "BitwiseNot", "BitwiseOr", "BitwiseXor", "Cast", "CastLike", "Ceil", "Cos", "Cosh",
        "Div", "Equal", "Erf", "Exp", "Floor", "Greater", "GreaterOrEqual", "Identity", "IsInf", "IsNaN",
        "Less", "LessOrEqual", "Log", "Max", "Mean", "Min", "Mod", "Mul", "Neg", "Not", "Or", "Pow",
        "Reciprocal", "Round", "Sign", "Sin", "Sinh", "Sqrt", "Sub", "Sum", "Tan", "Where", "Xor",
    ),
    "indexing": (
        "ArgMax", "ArgMin", "Compress", "CumProd", "CumSum", "Gather", "GatherElements", "GatherND",
        "NonZero", "OneHot", "Scatter", "ScatterElements", "ScatterND", "TensorScatter", "TopK", "Unique",
    ),
    "loss": ("Dropout", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"),
    "matmul": ("Det", "Einsum", "Gemm", "MatMul"),
    "normalization": (
        "BatchNormalization", "GroupNormalization", "InstanceNormalization", "LRN", "LayerNormalization",
        "LogSoftmax", "LpNormalization", "MeanVarianceNormalization", "Softmax",
    ),
    "pool": (
        "AveragePool", "GlobalAveragePool", "GlobalLpPool", "GlobalMaxPool", "LpPool", "MaxPool",
        "MaxUnpool",
    ),
    "quantize": (
        "ConvInteger", "DequantizeLinear", "DynamicQuantizeLinear", "MatMulInteger", "QLinearConv",
        "QLinearMatMul", "QuantizeLinear",
    ),
    "random": (
        "Bernoulli", "Multinomial", "RandomNormal", "RandomNormalLike", "RandomUniform",
        "RandomUniformLike",
    ),
    "reduce": (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
        "ReduceProd", "ReduceSum", "ReduceSumSquare",
    ),
    "resize": ("Resize",),
    "rnn": ("GRU", "LSTM", "RNN"),
    "sampling": ("AffineGrid", "DeformConv", "GridSample"),
    "sequence": (
        "ConcatFromSequence", "Optional", "OptionalGetElement", "OptionalHasElement", "SequenceAt",
        "SequenceConstruct", "SequenceEmpty", "SequenceErase", "SequenceInsert", "SequenceLength",
        "SplitToSequence",
    ),
    "shape": (
        "CenterCropPad", "Concat", "Constant", "ConstantOfShape", "DepthToSpace", "Expand", "EyeLike",
        "Flatten", "Pad", "Range", "Reshape", "ReverseSequence", "Shape", "Size", "Slice", "SpaceToDepth",
        "Split", "Squeeze", "Tile", "Transpose", "Trilu", "Unsqueeze",
    ),
    "signal": ("BlackmanWindow", "DFT", "HammingWindow", "HannWindow", "MelWeightMatrix", "STFT"),
    "text": ("RegexFullMatch", "StringConcat", "StringNormalizer", "StringSplit", "TfIdfVectorizer"),
}

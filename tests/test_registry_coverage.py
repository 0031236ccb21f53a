"""Every kernel has a row in the op table, every gradient rule a gradient row, and the kernel and
rule family files mirror each other (STYLE.md §9: `grep '"Relu"'` finds kernel, rule and test row)."""

from __future__ import annotations

from onnxtrain.autodiff import registry as rules
from onnxtrain.engine import registry as kernels
from tests.op_cases import ALL_CASES

# ops without a row, each with its reason
NO_ROW = {
    "Constant": "no inputs: covered by the shape tests and every exported model",
    "Scatter": "deprecated alias of ScatterElements; checked by the conformance suite",
    "Upsample": "deprecated; checked by the conformance suite",
    "Unique": "dynamic output shapes; tests/engine/test_shape_indexing.py",
    "MaxUnpool": "needs MaxPool indices; tests/engine/test_conv_pool_resize.py",
    "GlobalLpPool": "onnx.reference lacks it; tests/engine/test_conv_pool_resize.py",
    "BitShift": "integer only; tests/engine/test_elementwise.py",
    "If": "branches, not arrays: tests/autodiff/test_control_flow_grad.py, tests/engine/test_control_flow.py",
    "Loop": "a body, not arrays: tests/autodiff/test_control_flow_grad.py, tests/engine/test_control_flow.py",
    "Scan": "a body, not arrays: tests/autodiff/test_control_flow_grad.py, tests/engine/test_control_flow.py",
    "SequenceMap": "a body over sequences: tests/autodiff/test_control_flow_grad.py",
}
NO_ROW.update({op: "string outputs; tests/engine/test_text.py (onnxruntime) and the conformance suite"
               for op in ("StringConcat", "StringNormalizer", "StringSplit")})
NO_ROW.update({op: "random outputs; statistical tests in tests/engine/test_random.py"
               for op in ("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
                          "Bernoulli", "Multinomial")})
# sequence and optional values are lists and None, which the op table's rows (arrays) cannot hold
SEQUENCE_OPS = ("SequenceEmpty", "SequenceConstruct", "SequenceInsert", "SequenceAt", "SequenceErase",
                "SequenceLength", "ConcatFromSequence", "SplitToSequence", "Optional", "OptionalHasElement",
                "OptionalGetElement")
NO_ROW.update({op: "sequence/optional values; tests/engine/test_control_flow.py, the conformance suite and "
                   "(gradients) tests/autodiff/test_control_flow_grad.py" for op in SEQUENCE_OPS})


# rules without a float64 gradient row
NO_GRAD_ROW = {
    "Celu": "its schema allows float32 only; checked in float32 against torch in the rule's tests",
    "MeanVarianceNormalization": (
        "onnx.reference cannot run its float64 forward; tests/autodiff/test_mvn_grad.py"
    ),
}
# kernels with neither a rule nor a no_gradient mark
UNDECIDED = {
    "Upsample": "deprecated: autodiff upgrades models to opset >= 17 first, which makes it a Resize",
}


def _family(fn) -> str:
    return fn.__module__.rsplit(".", 1)[-1]


def test_every_kernel_has_a_row() -> None:
    with_rows = {c.op for c in ALL_CASES}
    missing = sorted(set(kernels.available_ops()) - with_rows - set(NO_ROW))
    assert not missing, f"kernels without an op-table row: {missing}"


def test_every_rule_has_a_gradient_row() -> None:
    with_grad_rows = {c.op for c in ALL_CASES if c.grad}
    missing = sorted(set(rules.ops_with_rules()) - with_grad_rows - set(NO_ROW) - set(NO_GRAD_ROW))
    assert not missing, f"gradient rules without a gradient row: {missing}"


def test_every_float_kernel_has_a_rule_or_a_no_gradient_mark() -> None:
    decided = set(rules.ops_with_rules()) | set(rules.ops_without_gradient())
    undecided = sorted(set(kernels.available_ops()) - decided - set(UNDECIDED))
    assert not undecided, f"kernels with neither a gradient rule nor no_gradient(...): {undecided}"


def test_kernel_and_rule_families_mirror() -> None:
    kernels.available_ops()
    rules.ops_with_rules()
    k = {op: _family(versions[-1][1]) for op, versions in kernels._KERNELS.items()}
    r = {op: _family(versions[-1].fn) for op, versions in rules._RULES.items()}
    moved = sorted(
        f"{op}: kernels/{k[op]}.py vs rules/{r[op]}.py" for op in set(k) & set(r) if k[op] != r[op]
    )
    assert not moved, f"ops whose kernel and rule live in differently named families: {moved}"

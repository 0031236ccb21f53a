"""Op table rows for the loss and Dropout kernels (onnxtrain/engine/kernels/loss.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase


def _scores(shape: tuple[int, ...], weight: bool = False, ignore: int | None = None):
    """Scores (N, C, d...), int64 targets (N, d...) with some set to ``ignore``, optional weights (C)."""

    def make(rng: np.random.Generator, dt) -> list:
        c = shape[1]
        x = rng.uniform(-2, 2, shape).astype(dt)
        t = rng.integers(0, c, (shape[0], *shape[2:])).astype(np.int64)
        if ignore is not None:
            t.reshape(-1)[::3] = ignore
        ins = [x, t]
        if weight:
            ins.append(rng.uniform(0.2, 1.5, c).astype(dt))
        return ins

    return make


def _dropout_inputs(shape: tuple[int, ...], ratio: float | None, training: bool | None):
    def make(rng: np.random.Generator, dt) -> list:
        ins = [rng.uniform(-2, 2, shape).astype(dt)]
        if ratio is not None or training is not None:
            ins.append(None if ratio is None else np.array(ratio, dtype=dt))
        if training is not None:
            ins.append(np.array(training))
        return ins

    return make


def _loss_rows(op: str) -> list[OpCase]:
    return [
        OpCase(op, make_inputs=_scores((4, 5)), wrt=(0,), opset=13),
        OpCase(
            op, make_inputs=_scores((4, 5)), attrs={"reduction": "sum"}, wrt=(0,), opset=13, variant="sum"
        ),
        OpCase(
            op,
            make_inputs=_scores((3, 4, 2)),
            attrs={"reduction": "none"},
            wrt=(0,),
            opset=13,
            variant="none_3d",
        ),
        OpCase(op, make_inputs=_scores((3, 4, 2, 2), weight=True), wrt=(0,), opset=13, variant="weight_4d"),
        OpCase(
            op,
            make_inputs=_scores((6, 3), weight=True, ignore=1),
            attrs={"ignore_index": 1},
            wrt=(0,),
            opset=13,
            variant="weight_ii",
        ),
        OpCase(
            op,
            make_inputs=_scores((6, 3, 2), ignore=-7),
            attrs={"ignore_index": -7},
            wrt=(0,),
            opset=13,
            variant="negative_ii",
        ),
        OpCase(
            op,
            make_inputs=_scores((6, 3), ignore=9),
            attrs={"ignore_index": 9, "reduction": "sum"},
            wrt=(0,),
            opset=13,
            variant="high_ii_sum",
        ),
    ]


CASES = [
    *_loss_rows("SoftmaxCrossEntropyLoss"),
    *_loss_rows("NegativeLogLikelihoodLoss"),
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((4, 5, 2)),
        n_outputs=2,
        wrt=(0,),
        opset=13,
        variant="log_prob",
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((4, 5), weight=True, ignore=2),
        attrs={"ignore_index": 2, "reduction": "none"},
        n_outputs=2,
        wrt=(0,),
        opset=13,
        variant="log_prob_none_ii",
    ),
    OpCase("Dropout", make_inputs=_dropout_inputs((3, 4), None, None), opset=13),
    OpCase(
        "Dropout",
        make_inputs=_dropout_inputs((3, 4), 0.3, False),
        n_outputs=2,
        wrt=(0,),
        grad_outputs=(0,),
        opset=13,
        variant="inference_mask",
    ),
    OpCase(
        "Dropout",
        make_inputs=_dropout_inputs((3, 4), 0.0, True),
        n_outputs=2,
        wrt=(0,),
        grad_outputs=(0,),
        opset=13,
        variant="train_ratio0",
    ),
    # seeded: the first run draws the same mask as onnx.reference (numpy's legacy seeding); later
    # runs draw new masks, so a finite-difference check cannot use this row
    OpCase(
        "Dropout",
        make_inputs=_dropout_inputs((4, 5), 0.4, True),
        attrs={"seed": 3},
        n_outputs=2,
        grad=False,
        opset=13,
        variant="train_seeded",
    ),
    OpCase(
        "Dropout", [(3, 4)], attrs={"ratio": 0.2}, n_outputs=2, grad_outputs=(0,), opset=10, variant="v10"
    ),
]


# gradient rows (autodiff/rules/loss.py)
def _scores_i32(shape: tuple[int, ...], ignore: int):
    """As ``_scores`` with weights, int32 targets."""

    def make(rng: np.random.Generator, dt) -> list:
        x, t, w = _scores(shape, weight=True, ignore=ignore)(rng, dt)
        return [x, t.astype(np.int32), w]

    return make


CASES += [
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores_i32((4, 3, 2, 2), ignore=0),
        attrs={"ignore_index": 0},
        wrt=(0,),
        variant="grad_i32_weight_ii_4d",
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((5, 4), weight=True),
        attrs={"reduction": "sum"},
        wrt=(0,),
        variant="grad_weight_sum",
    ),
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((3, 4, 3), weight=True),
        attrs={"reduction": "none"},
        wrt=(0,),
        variant="grad_weight_none_3d",
    ),
    # an opset-13 model: the gradient graph is upgraded to opset 17 first
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((5, 4), weight=True),
        opset=13,
        wrt=(0,),
        variant="grad_opset13_one_hot",
    ),
    # the loss reads only log_prob: the LogSoftmax part of the rule alone
    OpCase(
        "SoftmaxCrossEntropyLoss",
        make_inputs=_scores((3, 4)),
        n_outputs=2,
        grad_outputs=(1,),
        wrt=(0,),
        variant="grad_log_prob_only",
    ),
    OpCase(
        "NegativeLogLikelihoodLoss",
        make_inputs=_scores_i32((5, 3, 2), ignore=2),
        attrs={"ignore_index": 2, "reduction": "none"},
        wrt=(0,),
        variant="grad_i32_weight_ii_none",
    ),
    OpCase(
        "NegativeLogLikelihoodLoss",
        make_inputs=_scores((4, 3, 3), weight=True, ignore=-1),
        attrs={"ignore_index": -1, "reduction": "sum"},
        wrt=(0,),
        variant="grad_weight_ii_sum_3d",
    ),
    # seeded training Dropout: the engine draws the same mask in every fresh session (and onnx.reference
    # the same one), so finite differences see one fixed mask; only the data output feeds the loss
    OpCase(
        "Dropout",
        make_inputs=_dropout_inputs((4, 5), 0.4, True),
        attrs={"seed": 3},
        n_outputs=2,
        wrt=(0,),
        grad_outputs=(0,),
        variant="grad_train_seeded",
        ort_skip="onnxruntime draws its own dropout mask",
    ),
    OpCase(
        "Dropout",
        make_inputs=_dropout_inputs((3, 2, 4), 0.25, True),
        attrs={"seed": 11},
        wrt=(0,),
        variant="grad_train_seeded_no_mask",
        ort_skip="onnxruntime draws its own dropout mask",
    ),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    # SoftmaxCrossEntropyLoss-12 (upgraded first): two classes, a class ignored, per-element losses
    OpCase("SoftmaxCrossEntropyLoss", make_inputs=_scores((2, 2, 3, 2), weight=True, ignore=0),
           attrs={"reduction": "none", "ignore_index": 0}, opset=12, wrt=(0,),
           variant="grad_ort_v12_none_ii0"),
    OpCase("SoftmaxCrossEntropyLoss", make_inputs=_scores((5, 2), ignore=-1),
           attrs={"reduction": "sum", "ignore_index": -1}, opset=12, wrt=(0,),
           variant="grad_ort_v12_sum_ii_neg"),
]

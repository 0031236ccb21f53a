"""The loss scalers' arguments: a window of clean steps that is no whole number, a start scale that is not
finite and an argument that is no number are refused when the scaler is made, naming the argument (the
window was truncated, the scale accepted and refused by the first run that fed it, a string compared with an
int)."""

from __future__ import annotations

import math

import pytest

from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler


def _doublings(window: float, steps: int) -> list[float]:
    """onnxruntime-training's DynamicLossScaler.update (amp/loss_scaler.py), clean steps only: the count
    goes up by one and reaching the window (count >= window) doubles the scale and restarts the count."""
    scale, count, out = 4.0, 0, []
    for _ in range(steps):
        count += 1
        if count >= window:
            scale, count = scale * 2, 0
        out.append(scale)
    return out


def test_a_whole_window_given_as_a_float_counts_as_onnxruntime_counts() -> None:
    ours = DynamicLossScaler(loss_scale=4.0, up_scale_window=3.0)
    assert [ours.update(True) for _ in range(7)] == _doublings(3.0, 7)


@pytest.mark.parametrize("window", [2.5, 0.5, math.inf, math.nan])
def test_a_window_that_is_no_whole_number_is_refused(window: float) -> None:
    """2.5 was truncated to 2 (doubling after 2 clean steps, where onnxruntime's count doubles after 3)."""
    assert _doublings(2.5, 3) == [4.0, 4.0, 8.0]
    with pytest.raises(ValueError, match="up_scale_window"):
        DynamicLossScaler(up_scale_window=window)


@pytest.mark.parametrize("cls", [LossScaler, DynamicLossScaler])
@pytest.mark.parametrize("scale", [math.inf, math.nan, 0.0, -2.0])
def test_a_start_scale_that_is_not_positive_and_finite_is_refused(cls: type, scale: float) -> None:
    with pytest.raises(ValueError, match="loss_scale"):
        cls(loss_scale=scale)


@pytest.mark.parametrize("kw", [{"loss_scale": "loss_scale"}, {"up_scale_window": "2000"},
                                {"min_loss_scale": None}, {"max_loss_scale": [2.0]}])
def test_an_argument_that_is_no_number_is_named(kw: dict) -> None:
    """(a TypeError comparing a str with an int, naming nothing; onnxruntime's older LossScaler took the
    input's name first: LossScaler("loss_scale", True))"""
    with pytest.raises(TypeError, match=f"{next(iter(kw))} must be a number"):
        DynamicLossScaler(**kw)
    if "loss_scale" in kw:
        with pytest.raises(TypeError, match="loss_scale must be a number"):
            LossScaler("loss_scale", True)

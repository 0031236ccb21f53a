"""The step FLOPs behind the bench's "% GEMM peak" (bench/flops.py) against counts made without it.

bench/flops.py counts MatMul, Gemm and Conv of the exported graph, 2 FLOPs a multiply-add: each product once
forward and, backward, once per operand whose gradient the step needs (so not a model's first-layer input
gradient). The oracles: torch's ``FlopCounterMode`` over the torch module's forward, cross entropy and
backward (matrix products and convolutions; attention by the math kernel, whose batched products it counts,
where its fused CPU kernel is not counted at all); for grouped convolutions its weight-gradient formula
multiplies by the groups (it takes the whole input's channels), which the oracle here divides back out. And
for the MLP a hand count.
"""

from __future__ import annotations

import onnx
import pytest

torch = pytest.importorskip("torch")

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils import flop_counter  # noqa: E402

from bench import models  # noqa: E402
from bench.flops import step_flops  # noqa: E402

aten = torch.ops.aten


def _conv_backward(grad_out_shape, x_shape, w_shape, bias, stride, padding, dilation, transposed,
                   output_padding, groups, output_mask, out_shape=None, **kwargs) -> int:
    """torch's convolution_backward count, with the weight gradient of a grouped convolution divided by the
    groups (each group's weight sees its own input channels only)."""
    def part(mask: list[bool]) -> int:
        return flop_counter.conv_backward_flop(grad_out_shape, x_shape, w_shape, bias, stride, padding,
                                               dilation, transposed, output_padding, groups, mask,
                                               out_val=out_shape)

    return part([output_mask[0], False, False]) + part([False, output_mask[1], False]) // groups


def _torch_counts(case: models.Case, x, y) -> tuple[int, int]:
    """(forward, forward + backward) FLOPs of ``case``'s torch module on one batch, by FlopCounterMode."""
    module = case.build()
    module.train()
    mapping = {aten.convolution_backward: _conv_backward}
    with sdpa_kernel(SDPBackend.MATH):
        with flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as fwd:
            module(torch.from_numpy(x))
        with flop_counter.FlopCounterMode(display=False, custom_mapping=mapping) as step:
            loss = models.FlatCrossEntropy()(module(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
    return fwd.get_total_flops(), step.get_total_flops()


@pytest.mark.parametrize("case", models.ALL_CASES, ids=lambda c: c.key)
def test_step_flops_equal_torchs_count(case: models.Case, tmp_path) -> None:
    paths = models.prepare(case, str(tmp_path / case.key))
    batch = case.batches(1)
    x, y = batch["x0"], batch["y0"]
    ours = step_flops(onnx.load(paths["model"]), {case.input_name: x})
    forward, step = _torch_counts(case, x, y)
    assert ours["forward"] == forward
    assert ours["step"] == step
    assert ours["forward"] + ours["backward"] == ours["step"]


@pytest.mark.parametrize("batch", [64, 256])
def test_mlp_step_flops_by_hand(batch: int, tmp_path) -> None:
    case = next(c for c in models.CASES if c.key == f"mlp{batch}")
    paths = models.prepare(case, str(tmp_path / case.key))
    ours = step_flops(onnx.load(paths["model"]), {"x": case.batches(1)["x0"]})
    forward = 2 * batch * (784 * 512 + 512 * 512 + 512 * 10)
    first_input_gradient = 2 * batch * 784 * 512  # d(loss)/d(x): no step computes it
    assert ours["forward"] == forward
    assert ours["step"] == 3 * forward - first_input_gradient  # 20 % below 3× forward

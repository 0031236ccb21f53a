r"""Execution-time rewrites of a plan's steps: fewer, faster steps; the graph itself stays standard ONNX.

``fuse(plan)`` is called by :class:`~onnxtrain.engine.plan.Plan` after constant folding (disable with
``Plan(model, fuse=False)`` or ``ONNXTRAIN_FUSION=0``). The passes, in order:

* **common subexpressions**: a deterministic step with the same kernel, inputs and attributes as an earlier
  one whose outputs are still in use is dropped and its consumers read the earlier outputs (Adam with
  weight decay computes ``w − u`` twice); recomputed copies of long-freed values (checkpointing) stay;
* **shape arithmetic** (:mod:`~onnxtrain.engine.fusion.shapes`): a step of constants only is run once, now,
  and becomes a constant; steps computing from ``Shape``/``Size`` results keep their (read-only) results
  per input shape;
* **weight gradient of a batched MatMul**: ``ReduceSum(MatMul(Transpose(A), B), leading axes)`` — what the
  gradient of ``X[..., T, K] @ W[K, N]`` is made of — becomes one 2-D GEMM ``A_flat^T @ B_flat`` instead of
  one small GEMM per batch entry and a reduction;
* **weight gradient of a Conv**: ``Transpose(Conv(Transpose(X), Transpose(dY)))`` (each swapping the batch
  and channel axes) becomes one GEMM of ``dY`` with a strided im2col view of ``X``;
* **weight gradient of a depthwise Conv** (:mod:`~onnxtrain.engine.fusion.grouped_weight_grad`): the
  Reshapes and Transposes that lay X and dY out as one image of the batch's planes (copying both) go, and
  the depthwise kernels read X and dY as views in that order; the same sums;
* **padded pieces as a Concat** (:mod:`~onnxtrain.engine.fusion.pads`): a ``Sum`` of zero ``Pad``\ s that
  place their pieces side by side along one axis (the gradients of q, k and v gathered from one
  projection) concatenates the pieces, checked at run time; the same bits;
* **Sum as Adds**: a ``Sum`` becomes a chain of ``Add`` steps in the kernel's order (bit-identical), so that
  summing a tensor's gradient contributions joins the cluster that computes them;
* **batch statistics handed over** (:mod:`~onnxtrain.engine.fusion.batch_stats`): a training-mode
  ``BatchNormalization`` also writes its batch mean and variance into the slots of the gradient's
  ``ReduceMean(X)`` and ``ReduceMean((X − mean)²)``, which are dropped: the same sums of the same arrays,
  the same bits;
* **per-channel sums of products** (:mod:`~onnxtrain.engine.fusion.products`): ``ReduceSum(Mul(a, b))`` or
  ``ReduceMean`` over every axis but 1 (BatchNorm's gradient) sums a·b per channel by BLAS dot products,
  without writing the product;
* **masked softmax** (:mod:`~onnxtrain.engine.fusion.masked_softmax`): ``Softmax(Where(mask, -inf, scores))``
  (causal attention) takes exp of the scores themselves and zeroes the masked entries, without building the
  masked copy or shifting by the row maxima;
* **NaN selects** (:mod:`~onnxtrain.engine.fusion.nan_select`): ``Where(IsNaN(x), a, b)`` (torch's export of
  masked ``scaled_dot_product_attention``, and its gradient) returns ``b`` itself when ``x.max()`` is not
  NaN, without the boolean mask or the select's copy;
* **ReLU gradients under a max pool** (:mod:`~onnxtrain.engine.fusion.pooled_relu_grad`):
  ``Where(R > c, MaxUnpool(dP, I), 0)`` below a ``MaxPool(R)`` of disjoint windows, or the scatter-add the
  builder writes for other pools, masks ``dP`` by the pooled values and puts that back, without the
  activation-sized mask and select; the same bits;
* **lazy selects** (:mod:`~onnxtrain.engine.fusion.select`): ``Where(c, x, a + b)`` with a one-element ``c``
  runs the Add (Sub, Mul, Div) only when ``c`` picks it and otherwise returns ``x`` itself: the on-device
  gradient accumulator ``Where(reset, g, buffer + g)`` costs nothing on a step that resets;
* **products with a concatenation** (:mod:`~onnxtrain.engine.fusion.concat_mul`): ``Mul(Concat(pieces),
  c)`` (a recurrent gradient's per-step gate coefficients) is one step that multiplies the new
  concatenation by ``c`` in place when ``c`` has its shape and dtype; the same bits;
* **a cross-entropy gradient's ignore mask** (:mod:`~onnxtrain.engine.fusion.ignore_mask`): the eight
  small steps that set ignored labels to 0 and make the mean's per-sample factor are one step, which (when
  no label is ignored) returns the labels and fills the factor ``dL / max(count, 1)``; the same bits;
* **elementwise clusters**: connected Add/Sub/Mul/Div/Sqrt/Erf/... steps (an optimizer update is ~13 of
  them per weight, torch's exported GELU five) run as one step: the same ufuncs in the same order, so
  results are bit-identical, but values used only inside the cluster are written into scratch buffers
  kept across runs (a pool keyed by shape and dtype, shared by every cluster of the plan) instead of
  being allocated every time. The ufuncs of a cluster over large arrays run block by block over their
  flattened elements, one shape after the other (cache blocking, see
  :mod:`~onnxtrain.engine.fusion.blocked`), with block-sized scratch buffers;
* **sibling clusters**: consecutive clusters none of which reads another's outputs (a legacy optimizer
  graph's per-weight updates) run as one step, their split segments' pieces as one job on the threads
  (:func:`~onnxtrain.engine.fusion.blocked.run_group`);
* **MatMul + bias**: an ``Add`` of a MatMul's product (that nothing else reads) adds into the product
  in place instead of allocating a second array. It runs after the clusters, which leave out such an Add
  when its other operand is a declared vector (a Linear layer's bias) and may take any other;
* **activations in place** (:mod:`~onnxtrain.engine.fusion.inplace`): a ``Relu``, or a ReLU gradient
  ``Where(mask, dX, 0)``, of a product that nothing else reads writes into the product;
* **bias sums early** (:mod:`~onnxtrain.engine.fusion.early_sums`): a ``Gemm`` layer's bias gradient, a
  ``ReduceSum`` over axis 0 of dY that only products separate from the step making dY, moves up to just
  after that step, ahead of the layer's weight and input gradients, while dY is still in cache; the same
  bits.

Every fused step checks the shapes and dtypes it was specialised for and otherwise runs the original
steps, so a fusion never changes what a graph computes beyond float summation order (the two GEMM
rewrites, float32/float64 only) and the rounding of products that are summed at once (the per-channel dot
products: a·b is not rounded before its sum, about 1 ulp per channel, float32/float64 only), and never
turns a working graph into a failing one. Half-precision steps are never rewritten in ways that round
differently.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from onnxtrain.engine.fusion.batch_stats import share_batch_statistics
from onnxtrain.engine.fusion.blocked import ScratchPool
from onnxtrain.engine.fusion.common import forget_step_maps
from onnxtrain.engine.fusion.concat_mul import fuse_concat_products
from onnxtrain.engine.fusion.cse import eliminate_common_steps
from onnxtrain.engine.fusion.early_sums import sum_early
from onnxtrain.engine.fusion.elementwise import expand_sums, fuse_elementwise, group_sibling_clusters
from onnxtrain.engine.fusion.gemm import fuse_conv_weight_grads, fuse_matmul_bias, fuse_matmul_weight_grads
from onnxtrain.engine.fusion.grouped_weight_grad import fuse_grouped_weight_grads
from onnxtrain.engine.fusion.ignore_mask import fuse_ignore_masks
from onnxtrain.engine.fusion.inplace import fuse_inplace_activations
from onnxtrain.engine.fusion.masked_softmax import fuse_masked_softmax
from onnxtrain.engine.fusion.nan_select import fuse_nan_selects
from onnxtrain.engine.fusion.pads import fuse_pad_sums
from onnxtrain.engine.fusion.pooled_relu_grad import fuse_pooled_relu_grads
from onnxtrain.engine.fusion.products import fuse_channel_dots
from onnxtrain.engine.fusion.select import fuse_lazy_selects
from onnxtrain.engine.fusion.shapes import memoize_shape_steps

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan

__all__ = ["ScratchPool", "enabled", "fuse"]


def enabled() -> bool:
    """False when the environment says ``ONNXTRAIN_FUSION=0`` (for A/B benchmarks)."""
    return os.environ.get("ONNXTRAIN_FUSION", "1") not in ("0", "false", "no", "off")


def fuse(plan: Plan) -> None:
    """Rewrite ``plan.steps`` in place (frees are recomputed by the plan afterwards)."""
    steps = list(plan.steps)
    try:
        steps = eliminate_common_steps(plan, steps)
        steps = memoize_shape_steps(plan, steps)
        steps = fuse_matmul_weight_grads(plan, steps)
        steps = fuse_conv_weight_grads(plan, steps)
        steps = fuse_grouped_weight_grads(plan, steps)
        steps = fuse_pad_sums(plan, steps)
        steps = expand_sums(plan, steps)
        steps = share_batch_statistics(plan, steps)
        steps = fuse_channel_dots(plan, steps)
        steps = fuse_masked_softmax(plan, steps)
        steps = fuse_nan_selects(plan, steps)
        steps = fuse_pooled_relu_grads(plan, steps)
        steps = fuse_lazy_selects(plan, steps)
        steps = fuse_concat_products(plan, steps)
        steps = fuse_ignore_masks(plan, steps)
        steps = fuse_elementwise(plan, steps)
        steps = group_sibling_clusters(plan, steps)
        steps = fuse_matmul_bias(plan, steps)
        steps = fuse_inplace_activations(plan, steps)
        steps = sum_early(plan, steps)
    finally:
        forget_step_maps()  # the plan's steps are not held past its build
    plan.steps = steps

"""Gradient marks of the random ops (same names as engine/kernels/random.py).

Their outputs are samples: RandomNormalLike and RandomUniformLike read only their input's shape and
dtype, Bernoulli and Multinomial give piecewise-constant draws, so no gradient flows to any input.
A reparameterised sample (``mean + scale * RandomNormalLike(mean)``) still carries the gradients of
its mean and scale through the Add and Mul around it.
"""

from __future__ import annotations

from onnxtrain.autodiff.registry import no_gradient

no_gradient("RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike")
no_gradient("Bernoulli", "Multinomial")

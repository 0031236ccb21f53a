"""The on-device training API of onnxruntime-training (``onnxruntime.training.api``), on numpy.

``CheckpointState`` owns the training state; ``Module`` runs the training and eval models over it;
``Optimizer`` runs the optimizer model; ``LinearLRScheduler`` sets the learning rate;
``TrainingSession`` is the C#-style facade over all of them.
"""

from __future__ import annotations

from onnxtrain.training.api.checkpoint_state import CheckpointState, Parameter, Parameters, Properties
from onnxtrain.training.api.lr_scheduler import LinearLRScheduler
from onnxtrain.training.api.module import Module
from onnxtrain.training.api.optimizer import Optimizer
from onnxtrain.training.api.session import TrainingSession

__all__ = ["CheckpointState", "LinearLRScheduler", "Module", "Optimizer", "Parameter", "Parameters",
           "Properties", "TrainingSession"]

"""``onnxtrain train``: YAML-configured training runs on the legacy TrainingSession.

``load_config`` reads and checks a configuration; ``Trainer(cfg).run()`` trains, logs, evaluates,
checkpoints and exports; ``evaluate_checkpoint`` and ``load_for_inference`` serve ``eval``/``export``.
"""

from __future__ import annotations

from onnxtrain.train.config import Config, ConfigError, config_from_dict, load_config
from onnxtrain.train.evaluate import evaluate_checkpoint, load_for_inference
from onnxtrain.train.loop import EXIT_INTERRUPTED, RunResult, Trainer
from onnxtrain.train.outputs import export_model, find_checkpoint

__all__ = [
    "EXIT_INTERRUPTED", "Config", "ConfigError", "RunResult", "Trainer", "config_from_dict",
    "evaluate_checkpoint", "export_model", "find_checkpoint", "load_config", "load_for_inference",
]

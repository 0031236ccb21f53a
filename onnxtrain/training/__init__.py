"""The on-device training API of onnxruntime-training: ``api`` (CheckpointState, Module, Optimizer,
LinearLRScheduler), ``artifacts`` (generate_artifacts) and ``onnxblock`` (loss and optimizer blocks)."""

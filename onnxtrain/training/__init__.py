"""The on-device training API of onnxruntime-training: ``api`` (CheckpointState, Module, Optimizer,
LinearLRScheduler), ``artifacts`` (generate_artifacts) and ``onnxblock`` (loss and optimizer blocks)."""


def __getattr__(name: str):  # onnxruntime.training also held the legacy names; import them lazily
    if name in ("TrainingSession", "TrainingParameters", "PropagateCastOpsStrategy", "GradientGraphBuilder"):
        import onnxtrain

        return getattr(onnxtrain, name)
    raise AttributeError(f"module 'onnxtrain.training' has no attribute {name!r}")

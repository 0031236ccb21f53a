"""``onnxblock.onnxblock``: where onnxruntime-training defines ``ForwardBlock`` and ``TrainingBlock``, so
that ported imports of that module work (they live in :mod:`onnxtrain.training.onnxblock.model_blocks`)."""

from onnxtrain.training.onnxblock.model_blocks import ForwardBlock, TrainingBlock

__all__ = ["ForwardBlock", "TrainingBlock"]

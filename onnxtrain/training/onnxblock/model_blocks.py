"""Blocks that turn the base model into whole models (spec §1.9): ``TrainingBlock`` (training and eval
models, the parameters to checkpoint) and ``ForwardBlock`` (the base with the block's outputs registered),
as onnxruntime-training's offline API writes them::

    class MyTrainingBlock(onnxblock.TrainingBlock):
        def __init__(self):
            super().__init__()
            self.loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, output_name):
            return self.loss(output_name)

    block = MyTrainingBlock()
    for p in ("fc1.weight", "fc1.bias"):
        block.requires_grad(p)
    with onnxblock.base(model):
        block(*[o.name for o in model.graph.output])
    training_model, eval_model = block.to_model_proto()
    onnxblock.save_checkpoint(block.parameters(), "checkpoint")

The models are those ``generate_artifacts`` writes for the same loss and parameters.
"""

from __future__ import annotations

import abc
from typing import Any

import onnx

from onnxtrain.training.onnxblock.blocks import Block
from onnxtrain.training.onnxblock.model_accessor import BlockError, UnknownValue, detached, value_info

_NOT_BUILT_PARAMS = "Please build the training model first before trying to retrieve the parameters."
_NOT_BUILT_MODELS = "Please build the training and eval models first before trying to retrieve them."
NOT_BUILT_FORWARD = "Please build the forward models first before trying to retrieve it."


def _output_names(result: Any, block: Block) -> list[str]:
    names = [result] if isinstance(result, str) else list(result) if isinstance(result, (tuple, list)) else []
    if not names or not all(isinstance(n, str) for n in names):
        raise BlockError(f"{type(block).__name__}.build() must return a tensor name or a tuple of names, "
                         f"got {result!r}")
    return names


class ForwardBlock(Block):
    """A block whose ``build`` result names become the base model's graph outputs (replacing those it had);
    ``to_model_proto()`` returns that model."""

    def __init__(self) -> None:
        super().__init__()
        self._model: onnx.ModelProto | None = None

    @abc.abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append the block's nodes; return the name(s) of the model's outputs."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = super().__call__(*args, **kwargs)
        with detached() as acc:
            names = _output_names(result, self)
            types = acc.types()
            have = {o.name: o for o in acc.graph.output}
            for n in names:
                if not acc.has_value(n):
                    raise UnknownValue(f"{type(self).__name__}.build() returned {n!r}, which is not a value "
                                       "of the model")
            outputs = [have.get(n) or value_info(n, types) for n in names]
            del acc.graph.output[:]  # the block's outputs replace the base's, as onnxruntime-training's do
            acc.graph.output.extend(outputs)
            model = onnx.ModelProto()
            model.CopyFrom(acc.model)
            acc.replace(model)
        self._model = model
        return result

    def to_model_proto(self) -> onnx.ModelProto:
        """The model built by the last call; RuntimeError before any."""
        if self._model is None:
            raise BlockError(NOT_BUILT_FORWARD)
        return self._model


class TrainingBlock(Block):
    """A block whose ``build`` returns the value to differentiate (the loss, first of its names): calling it
    inside ``onnxblock.base(model)`` builds the training model (gradients of the parameters marked with
    :meth:`requires_grad`, accumulation buffers) and the eval model, and the base becomes the training
    model."""

    def __init__(self) -> None:
        super().__init__()
        self._requires_grad: list[str] = []
        self._frozen: list[str] = []
        self._parameters: tuple[list[onnx.TensorProto], list[onnx.TensorProto]] | None = None
        self._models: tuple[onnx.ModelProto, onnx.ModelProto] | None = None

    @abc.abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append the loss; return its name (or the loss first, then other outputs)."""

    def requires_grad(self, argument_name: str, value: bool = True) -> None:
        """Mark initializer ``argument_name`` as trained (``value``) or as a frozen parameter (kept in the
        checkpoint, no gradient). Unmarked initializers stay constants of the models. A graph input marked
        trained gets its gradient output (``<input>_grad.accumulation.out``) but is no parameter."""
        if not isinstance(argument_name, str):
            raise BlockError("requires_grad: the argument name must be a str, got "
                             f"{type(argument_name).__name__}")
        add, drop = (self._requires_grad, self._frozen) if value else (self._frozen, self._requires_grad)
        if argument_name in drop:
            drop.remove(argument_name)
        if argument_name not in add:
            add.append(argument_name)

    def parameters(self) -> tuple[list[onnx.TensorProto], list[onnx.TensorProto]]:
        """(trainable, frozen) parameters as TensorProtos, in the model's initializer order; RuntimeError
        before the block was called."""
        if self._parameters is None:
            raise BlockError(_NOT_BUILT_PARAMS)
        return self._parameters

    def to_model_proto(self) -> tuple[onnx.ModelProto, onnx.ModelProto]:
        """(training model, eval model); RuntimeError before the block was called."""
        if self._models is None:
            raise BlockError(_NOT_BUILT_MODELS)
        return self._models

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from onnxtrain.training.artifacts import build_training_models  # it imports this package

        outer = self
        result: list[Any] = []

        class _Build(Block):  # the user's build, run by the artifact pipeline on its copy of the base
            def build(self, *_names: str) -> Any:
                outer.base = self.base  # the model being built: what the user's build edits through self.base
                result.append(outer.build(*args, **kwargs))
                return result[0]

        with detached() as acc:
            base = onnx.ModelProto()
            base.CopyFrom(acc.model)
            names = [a for a in args if isinstance(a, str) and acc.has_value(a)]
            training, evaluation, (trainable, frozen) = build_training_models(
                base, list(self._requires_grad), list(self._frozen), _Build(), [], names)
            acc.replace(training)
        self.base = acc.model
        _output_names(result[0], self)
        self._parameters = ([onnx.numpy_helper.from_array(v, n) for n, v in trainable.items()],
                            [onnx.numpy_helper.from_array(v, n) for n, v in frozen.items()])
        self._models = (training, evaluation)
        return result[0]

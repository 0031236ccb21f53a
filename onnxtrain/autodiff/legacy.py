"""``GradientGraphBuilder``: the API of onnxruntime's legacy class, over ``build_gradient_model``."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any

import onnx

from onnxtrain.autodiff.builder import GradientError, build_gradient_model
from onnxtrain.engine.ort_half_scatters import half_scatters_in_float32
from onnxtrain.errors import FailValueError, program_hint, raises_as_onnxruntime
from onnxtrain.ir.builder import loadable_model
from onnxtrain.ir.graphs import graph_values, path_to


def _ordered(names: Iterable[str], what: str) -> list[str]:
    """``names`` as a list; a set has no order: sorted, so the gradient outputs come out in a stable order.
    A string, or a name that is no string, is refused (a TypeError, as onnxruntime's binding raised)."""
    if isinstance(names, (str, bytes)):
        raise TypeError(f"{what} must be a set or list of names, got {type(names).__name__} {names!r}")
    listed = list(names)
    odd = [n for n in listed if not isinstance(n, str)]
    if odd:
        raise TypeError(f"{what} must hold names (str), got {type(odd[0]).__name__} {odd[0]!r}")
    return sorted(listed) if isinstance(names, (set, frozenset)) else listed


class GradientGraphBuilder:
    """Build the gradient graph of a model; the result stays standard ONNX.

    ``x_node_arg_names`` are the values to differentiate with respect to (initializers or graph
    inputs); the built model keeps the model's outputs in their order and appends ``<x>_grad`` for each,
    in the order given (sorted when a set is given), as onnxruntime's builder did (a loss that is no
    output of the model does not become one). The backward pass starts from ``y_node_arg_names``:
    the one named ``loss_node_arg_name`` is seeded with ones, the others get their incoming gradient
    ``<y>_grad`` as a graph input (all of them when the loss name is empty or names no y, as
    onnxruntime seeded only a y of that name), but for a y the loss is computed from: it takes the loss's
    gradient alone, as there. An ``x`` the ys do not depend on is an error. Example::

        b = GradientGraphBuilder(model_bytes, {"loss"}, {"fc.weight", "fc.bias"}, "loss")
        b.build()
        b.save("with_grads.onnx")
    """

    def __init__(self, serialized_model: bytes | str | os.PathLike | onnx.ModelProto,
                 y_node_arg_names: Iterable[str],
                 x_node_arg_names: Iterable[str], loss_node_arg_name: str, options: Any = None):
        from onnxtrain.engine.interface import load_model  # (read and refused as the sessions read them)

        if options is not None and isinstance(options, (str, bytes, dict, list, tuple, int, float)):
            raise TypeError(f"options must be a SessionOptions (or an object with the option as attribute), "
                            f"got {type(options).__name__}")
        if not isinstance(loss_node_arg_name, str):
            raise TypeError(f"loss_node_arg_name must be a str, got {type(loss_node_arg_name).__name__}")
        folder = _external_folder(options)
        if isinstance(serialized_model, (bytes, bytearray)):
            self._model = load_model(bytes(serialized_model), folder)
        elif isinstance(serialized_model, (str, os.PathLike)):
            self._model = load_model(os.fspath(serialized_model), folder)
        elif isinstance(serialized_model, onnx.ModelProto):  # also taken (onnxruntime's took bytes or a path)
            self._model = onnx.ModelProto()
            self._model.CopyFrom(serialized_model)
        else:
            raise TypeError(f"serialized_model must be the model's bytes, its path or an onnx.ModelProto, "
                            f"got {type(serialized_model).__name__}{program_hint(serialized_model)}")
        self._model = loadable_model(self._model)
        self._ys = _ordered(y_node_arg_names, "y_node_arg_names")
        self._xs = _ordered(x_node_arg_names, "x_node_arg_names")
        if not self._ys:
            raise GradientError("y_node_arg_names is empty: give the values to differentiate")
        twice = sorted({x for x in self._xs if self._xs.count(x) > 1})
        if twice:
            raise GradientError(f"x_node_arg_names lists {twice[0]!r} twice")
        g = self._model.graph  # names checked here, as onnxruntime's constructor checked them
        known = graph_values(g)
        for what, names in (("y_node_arg_names", self._ys), ("x_node_arg_names", self._xs)):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise GradientError(f"{what}: {unknown} are not values of the graph; graph outputs: "
                                    f"{[o.name for o in g.output]}")
        self._loss = loss_node_arg_name
        self._options = options
        self._built: onnx.ModelProto | None = None

    def build(self) -> None:
        """Build the gradient graph (once: the model given is released then, a second call keeps the
        result)."""
        if self._built is not None:
            return
        seeded = self._loss in self._ys
        first = self._loss if seeded else self._ys[0]
        # a y that a node makes and the seeded loss is computed from takes the loss's gradient alone, with no
        # '<y>_grad' input: onnxruntime's builder named its internal gradient so (a script feeds nothing)
        feeds_loss: set[str] = set()
        if seeded:  # (the nodes are in topological order: loadable_model sorted them)
            path, read = path_to(self._model.graph.node, [first])
            feeds_loss = read.intersection(o for n in path for o in n.output)
        others = [y for y in self._ys if y != first and y not in feeds_loss]
        # the one option of onnxruntime's GradientGraphConfiguration the builder has (invertible LayerNorm
        # gradients); read from the options object as TrainingParameters names it, or as the config did
        memory_efficient = any(bool(getattr(self._options, k, False)) for k in
                               ("use_memory_efficient_gradient", "use_invertible_layernorm_grad"))
        built = build_gradient_model(
            self._model, first, self._xs, other_ys=others, zero_unreachable=False, seed_loss=seeded,
            memory_efficient=memory_efficient, drop_non_differentiable_ys=True,
        )
        # as onnxruntime's builder: a loss that was no output of the model stays none
        outputs_in_model_order(built, self._model, self._xs, keep_others=False)
        # float16 scatters that add (a Gather's, a MaxPool's, a cross-entropy's gradient) in float32, Casts
        # around them: onnxruntime's CPU provider has no float16 kernel for them, so the graph would not run
        # there (standard ops either way; repeated indices are then summed in float32 and rounded once)
        self._built = half_scatters_in_float32(built)
        self._model = None  # (its weights are in the result too: the builder held them twice)

    def _result(self) -> onnx.ModelProto:
        return self._model if self._built is None else self._built

    def get_model(self) -> bytes:
        """The built model (forward + backward), serialized; before ``build()``, the model as given."""
        from onnxtrain.ir.large import is_large

        model = self._result()
        if is_large(model):
            raise FailValueError("the model's tensors pass protobuf's 2 GiB, so it cannot be serialized: "
                                 "save() it instead (its tensors go to an external-data file)")
        return model.SerializeToString()

    @raises_as_onnxruntime
    def save(self, path: str | os.PathLike) -> None:
        """Write the built model to ``path`` (through a temporary file, then renamed; past protobuf's 2 GiB
        its tensors go to ``<file name>.data`` beside it); its folder must exist, as for onnx.save."""
        from onnxtrain.ir.io import save_model_sized

        save_model_sized(self._result(), path, make_folders=False)


def outputs_in_model_order(built: onnx.ModelProto, model: onnx.ModelProto, wrt: Sequence[str],
                           keep_others: bool) -> None:
    """Order ``built``'s outputs (in place) as ``model``'s outputs where they were, then ``<x>_grad`` per x of
    ``wrt``; its other outputs (a loss that was no output of the model) first when ``keep_others``, else
    dropped."""
    outputs = {o.name: o for o in built.graph.output}
    kept = [outputs[o.name] for o in model.graph.output if o.name in outputs]
    grads = [outputs[f"{x}_grad"] for x in wrt]
    named = {o.name for o in (*kept, *grads)}
    others = [o for o in built.graph.output if o.name not in named] if keep_others else []
    del built.graph.output[:]
    built.graph.output.extend([*others, *kept, *grads])


def _external_folder(options: Any) -> str | None:
    """The folder of a SessionOptions' ``session.model_external_initializers_file_folder_path``, if set."""
    get = getattr(options, "get_session_config_entry", None)
    if get is None:
        return None
    try:
        return get("session.model_external_initializers_file_folder_path") or None
    except Exception:  # noqa: BLE001 - an entry not set (onnxruntime's options raise there)
        return None

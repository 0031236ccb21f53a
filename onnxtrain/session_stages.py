"""What the legacy sessions with pipeline stages share (one stage per rank, whole or with its layers split):
the micro-batches a run is cut into, the weights several stages read, and the outputs gathered from the
stages.

* :class:`MicroBatching` — ``num_pipeline_micro_batches`` and the slicing options (``sliced_tensor_names``,
  ``sliced_axes``, ``sliced_schema``): which inputs are cut, along which axis, and how a stage's graphs
  declare them;
* :func:`tied_weights` and :func:`sum_tied_gradients` — a trained weight read in several stages takes the
  sum of their gradients on each of them, so that its copies stay equal;
* :func:`gather_stage_outputs` — a run's outputs from the stages that computed them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

from onnxtrain.ir.graphs import node_reads
from onnxtrain.parallel import Communicator


class MicroBatching:
    """Cutting a run's batch into ``num_pipeline_micro_batches`` micro-batches (see the module docstring);
    the session sets ``self._params``."""

    def _setup_micro_batches(self, model: onnx.ModelProto, loss_scale: str | None) -> None:
        """Check the options against ``model``'s inputs; ``loss_scale``: the mixed-precision input every
        micro-batch reads whole."""
        p = self._params
        self._micro = p.num_pipeline_micro_batches
        if isinstance(self._micro, bool) or not isinstance(self._micro, int) or self._micro < 1:
            raise ValueError(f"num_pipeline_micro_batches must be an int >= 1, got {self._micro!r}")
        inits = {t.name for t in model.graph.initializer}
        inputs = [v.name for v in model.graph.input if v.name not in inits]
        sliced = set(p.sliced_tensor_names) or set(inputs) - {loss_scale}
        unknown = sorted(set(p.sliced_tensor_names) - set(inputs))
        if unknown:
            raise ValueError(f"sliced_tensor_names: {unknown} are not inputs of the model; inputs: {inputs}")
        unknown = sorted(set(p.sliced_axes) - set(inputs))
        if unknown:
            raise ValueError(f"sliced_axes: {unknown} are not inputs of the model; inputs: {inputs}")
        declared = {v.name: v.type.tensor_type for v in model.graph.input}
        for n, axis in p.sliced_axes.items():  # (here, on every rank: a stage may not hold the input)
            rank = len(declared[n].shape.dim)
            if declared[n].HasField("shape") and not -rank <= int(axis) < rank:
                raise ValueError(f"sliced_axes[{n!r}] = {axis} is out of range for its rank {rank}")
        self._sliced = {n: int(p.sliced_axes.get(n, 0)) for n in inputs if n in sliced}
        unknown = sorted(set(p.sliced_schema) - set(inputs))
        if unknown:
            raise ValueError(f"sliced_schema: {unknown} are not inputs of the model; inputs: {inputs}")
        self._schema = {n: [int(d) for d in shape] for n, shape in p.sliced_schema.items()}

    def _micro_input(self, v: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
        """A user input as one micro-batch of it: ``sliced_schema``'s shape, else the sliced axis unnamed."""
        out = onnx.ValueInfoProto()
        out.CopyFrom(v)
        p = self._params
        if v.name in p.sliced_schema:
            shape = [int(d) for d in p.sliced_schema[v.name]]
            del out.type.tensor_type.shape.dim[:]
            for d in shape:
                out.type.tensor_type.shape.dim.add().dim_value = d
        elif v.name in self._sliced and self._micro > 1 and out.type.tensor_type.HasField("shape"):
            dims = out.type.tensor_type.shape.dim
            axis = self._sliced[v.name]
            if not -len(dims) <= axis < len(dims):
                raise ValueError(f"sliced_axes[{v.name!r}] = {axis} is out of range for its rank {len(dims)}")
            dims[axis].Clear()
            dims[axis].dim_param = "micro_batch"
        return out

    def _micro_feeds(self, feeds: dict[str, np.ndarray], count: int) -> list[dict[str, np.ndarray]]:
        """``feeds`` cut into ``count`` micro-batches (the sliced inputs; the others go to every one)."""
        parts: list[dict[str, np.ndarray]] = [dict(feeds) for _ in range(count)]
        if count > 1:
            self._slice(feeds, parts, count)
        for name, shape in self._schema.items():  # the declared micro-batch shapes, as the stages read them
            if name in feeds and list(parts[0][name].shape) != shape:
                raise ValueError(f"sliced_schema[{name!r}] = {shape}, but a micro-batch of {name!r} has "
                                 f"shape {list(parts[0][name].shape)} (fed {list(np.shape(feeds[name]))}, "
                                 f"num_pipeline_micro_batches={count})")
        return parts

    def _slice(self, feeds: dict[str, np.ndarray], parts: list[dict[str, np.ndarray]], count: int) -> None:
        for name, axis in self._sliced.items():
            a = feeds[name]
            if a.ndim and not -a.ndim <= axis < a.ndim:  # (an input without a declared shape)
                raise ValueError(f"sliced_axes[{name!r}] = {axis} is out of range for the fed rank {a.ndim} "
                                 f"(shape {list(a.shape)})")
            if a.ndim == 0 or a.shape[axis] % count:
                raise ValueError(
                    f"input {name!r}: its axis {axis} (shape {list(a.shape)}) does not divide into "
                    f"num_pipeline_micro_batches={count} equal micro-batches"
                )
            for k, piece in enumerate(np.split(a, count, axis=axis)):
                parts[k][name] = np.ascontiguousarray(piece)


def tied_weights(
    model: onnx.ModelProto, stages_of: Callable[[int], set[int]], trainable: list[str]
) -> dict[str, tuple[int, ...]]:
    """Trained weights read in more than one stage → the stages reading them, in order; ``stages_of(k)``:
    the stages running node ``k``."""
    stages: dict[str, set[int]] = {}
    wanted = set(trainable)
    for k, n in enumerate(model.graph.node):
        for i in node_reads(n):
            if i in wanted:
                stages.setdefault(i, set()).update(stages_of(k))
    return {w: tuple(sorted(v)) for w, v in sorted(stages.items()) if len(v) > 1}


def counts_in_norm(weight: str, tied: Mapping[str, tuple[int, ...]], stage: int) -> bool:
    """Whether ``stage`` adds ``weight``'s gradient to the global norm: a weight several stages read
    (``tied``: weight → its stages) counts once, on the first of them."""
    return tied.get(weight, (stage,))[0] == stage


def sum_tied_gradients(
    comm: Communicator, grads: dict[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]
) -> None:
    """Replace the gradient (``<w>_grad`` in ``grads``) of each weight of ``shapes`` by its sum over the
    stages of ``comm`` (a stage without the weight adds nothing): one collective over all of them, summed in
    float64."""
    sizes = {w: int(np.prod(s)) for w, s in shapes.items()}
    flat = np.zeros(sum(sizes.values()), np.float64)
    at = 0
    for w, n in sizes.items():
        g = grads.get(f"{w}_grad")
        if g is not None:
            flat[at : at + n] = g.reshape(-1)
        at += n
    comm.allreduce_(flat, "pipeline: gradients of weights read in several stages")
    at = 0
    for w, n in sizes.items():
        g = grads.get(f"{w}_grad")
        if g is not None:
            grads[f"{w}_grad"] = flat[at : at + n].reshape(g.shape).astype(g.dtype)
        at += n


def gather_stage_outputs(
    comm: Communicator, mine: Mapping[str, Any], names: list[str], summed: set[str]
) -> dict[str, Any]:
    """The outputs ``names`` of the whole pipeline, on every stage of ``comm``: each stage gives those it
    computed; an output of ``summed`` (the gradient of a weight several stages read) is the stages' sum."""
    got: dict[str, Any] = {}
    given = {n: v for n, v in mine.items() if n in names}
    for part in comm.allgather_object(given, "gathering the pipeline's outputs"):
        for n, v in part.items():
            got[n] = got[n] + v if n in got and n in summed else v
    return got

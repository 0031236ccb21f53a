"""The plain ONNX graphs one stage of a cut model runs, and what it exchanges with its neighbours.

For stage ``s`` of a :class:`~onnxtrain.parallel.pipeline.Partition` (:func:`build_stage_graphs`):

* ``forward``: the stage's inputs (graph inputs it reads, tensors received from the stage before, its
  trained weights) → the tensors later stages read and the user outputs it computes;
* ``forward_train`` (every stage but the last): the same, plus the activations its backward reads
  (:func:`~onnxtrain.autodiff.split.split_gradient_model`) and the new running statistics of its
  training-mode BatchNormalizations;
* ``backward``: those activations and the gradients of what the stage sent (``<t>_grad``, the seeds) → its
  weights' gradients and those of the float tensors it received; the last stage's backward also runs its
  forward, from the loss (the scaled loss under mixed precision), and returns its running statistics;
* ``update`` (when the stage trains weights): the optimizer over them, reading the whole model's gradient
  norm as the input ``global_gradient_norm`` when it clips or checks for overflow.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.builder import GradientError, build_gradient_model, expand_for_gradient
from onnxtrain.autodiff.split import split_gradient_model
from onnxtrain.graph_transforms.mixed_precision import MixedPrecisionInfo
from onnxtrain.graph_transforms.recompute import recompute, transformer_layer_values
from onnxtrain.ir.builder import NameGen, value_types
from onnxtrain.ir.graphs import drop_unread, node_reads, train_batch_norms
from onnxtrain.optim import Optimizer, StateSpec, WeightSlot
from onnxtrain.parallel.pipeline import Partition
from onnxtrain.parameters import TrainingParameters
from onnxtrain.training_graph import (
    TRAINING_MODE,
    _inits_to_inputs,
    build_update_graph,
    running_stats,
    update_clips,
)

NORM = "global_gradient_norm"
_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16)


@dataclass
class StageGraphs:
    """One stage's graphs (by kind: see the module docstring) and its interface."""

    stage: int
    last: bool
    graphs: dict[str, onnx.ModelProto]
    trainable: list[str]  # trained weights the stage reads (graph inputs of its graphs)
    received: list[str]  # tensors of the stage before that the stage reads
    diff_received: list[str]  # the float ones: their gradients go back
    sends: list[str]  # tensors the next stage receives (some only passed through)
    seeded: list[str]  # the float tensors of ``sends`` computed here: their gradients seed the backward
    saved: list[str]  # activations ``forward_train`` returns for ``backward``
    outputs: list[str]  # user outputs computed here (the last stage: with the loss)
    initial: dict[str, np.ndarray]  # weights, running statistics and optimizer state
    bn_stats: dict[str, str]  # a training-mode BatchNormalization's running statistic → its new value
    specs: list[StateSpec] = field(default_factory=list)
    update_outputs: dict[str, str] = field(default_factory=dict)  # state name → the update's output

    @property
    def base(self) -> onnx.ModelProto:
        """The stage's nodes as a model (weights as initializers)."""
        return self.graphs["stage"]


@contextlib.contextmanager
def _naming_the_cut(stage: int, params: TrainingParameters, integer_inputs: list[str]) -> Iterator[None]:
    """A GradientError of stage ``stage``'s backward names the stage and the cut; with values of other
    than float type received from the stage before (``integer_inputs``: a Reshape's shape, say), it says
    that such a cut hides their values from this stage's shape inference, which one process has."""
    try:
        yield
    except GradientError as e:
        hint = (f"; the stage receives {integer_inputs}, not float activations: their values (shapes, say) "
                "are unknown to its shape inference, so cut at float activations instead"
                if integer_inputs else "")
        raise GradientError(f"pipeline stage {stage} (pipeline_cut_info_string "
                            f"{params.pipeline_cut_info_string!r}): {e}{hint}") from None


def build_stage_graphs(
    model: onnx.ModelProto,
    part: Partition,
    stage: int,
    trainable: list[str],
    params: TrainingParameters,
    opt: Optimizer,
    mp: MixedPrecisionInfo | None = None,
    declare_input: Callable[[onnx.ValueInfoProto], onnx.ValueInfoProto] = lambda v: v,
    with_update: bool = True,
    layers: set[str] | None = None,
    adasum: bool = False,
) -> StageGraphs:
    """Stage ``stage``'s graphs and initial state; ``trainable`` lists the whole model's trained weights,
    ``declare_input`` rewrites a user input's declaration (a micro-batch's shape) and ``with_update=False``
    leaves the optimizer to the caller; ``layers``: :func:`layer_activations` of the model when the caller
    builds several stages (found here when None); ``adasum``: the replicas' mode (:func:`update_clips`)."""
    last = stage == part.stages - 1
    layers = layer_activations(model, params) if layers is None else layers
    nodes = [_copy(n) for n in part.nodes(model, stage)]
    g = model.graph
    # as the one-process session: every BatchNormalization in training mode (names from the whole model, so
    # that every stage and rank names the new outputs alike)
    names = NameGen.for_model(model)
    train_batch_norms(nodes, names)
    types = value_types(model)
    reads = {i for n in nodes for i in node_reads(n) if i}
    produced = {o for n in nodes for o in n.output if o}
    inits = {t.name: t for t in g.initializer}
    mine = [w for w in trainable if w in reads]
    stats = running_stats(nodes, set(inits), names)
    held = [*mine, *stats]  # graph inputs the session feeds from its state
    received = [r for r in part.received(stage) if r in reads]
    sends = [] if last else list(part.sends[stage])
    inputs = [declare_input(v) for v in g.input if v.name in reads and v.name not in inits]
    inputs += [boundary_value(r, types) for r in received]
    dropouts = [n for n in nodes if n.op_type == "Dropout" and len(n.input) >= 3 and n.input[2]]
    for n in dropouts:  # one training_mode input, as the single-process session has
        n.input[2] = TRAINING_MODE
    if dropouts:
        inputs.append(helper.make_tensor_value_info(TRAINING_MODE, TensorProto.BOOL, []))
    outputs = [o.name for o in g.output if o.name in produced]
    if last and params.loss_output_name not in outputs:
        outputs.append(params.loss_output_name)
    seeded = [t for t in sends if t in produced and _elem(types, t) in _FLOATS]
    diff_received = [r for r in received if _elem(types, r) in _FLOATS]
    declared = dict.fromkeys([*(t for t in sends if t in produced), *outputs])
    base = helper.make_model(
        helper.make_graph(
            nodes,
            f"{g.name or 'model'}_stage{stage}",
            inputs,
            [boundary_value(o, types) for o in declared],
            initializer=[inits[i] for i in sorted(reads & set(inits))],
            # the ranks one process's shape inference finds for the stage's own values: a Reshape whose
            # shape comes from another stage (a head count computed at run time) has none in the stage
            value_info=[boundary_value(v, types) for v in sorted(produced - set(declared))
                        if _ranked(types, v)],
        ),
        opset_imports=list(model.opset_import),
        ir_version=model.ir_version,
    )
    # the running statistics stay constants of the forward-only graph: a training-mode normalization's output
    # does not read them, and onnxruntime writes their new values into the buffer it is given for them
    graphs = {"stage": base, "forward": _with_weights_as_inputs(base, mine)[0]}
    wrt = [*mine, *diff_received]
    integer_received = [r for r in received if r not in diff_received]  # named by a failing backward
    stat_outputs = [helper.make_tensor_value_info(o, inits[x].data_type, list(inits[x].dims))
                    for x, o in stats.items()]
    if not last:
        # a loss that does not depend on anything: the backward starts from the seeds alone
        loss = f"pipeline_stage{stage}_loss"
        bw = onnx.ModelProto()
        bw.CopyFrom(base)
        zero = numpy_helper.from_array(np.array(0, np.float32))
        bw.graph.node.append(helper.make_node("Constant", [], [loss], value=zero))
        bw.graph.output.extend(stat_outputs)  # forward_train returns them
        bw = expand_for_gradient(bw)  # the forward the gradient model holds: split_gradient_model finds it
        forward_outputs = [*declared, *stats.values()]
        with _naming_the_cut(stage, params, integer_received):
            full = build_gradient_model(bw, loss, wrt, outputs=forward_outputs, other_ys=seeded)
        full = _recomputed(full, loss, params, model, layers, forward_outputs)
        full, initial = _with_weights_as_inputs(full, held)
        graphs["forward_train"], graphs["backward"], saved = split_gradient_model(full, bw)
    else:
        loss = mp.scaled_loss if mp is not None else params.loss_output_name
        with _naming_the_cut(stage, params, integer_received):
            grad = build_gradient_model(base, loss, wrt, outputs=outputs, extra_outputs=list(stats.values()))
        full = _recomputed(grad, loss, params, model, layers)
        graphs["backward"], initial = _with_weights_as_inputs(full, held)
        saved = []
    for graph in graphs.values():
        # what the split left unread in a part (the stand-in loss above, constants of nodes in another part):
        # onnxruntime warned of each on every rank
        g = graph.graph
        drop_unread(g, {t.name for t in g.initializer} | {o for n in g.node if n.op_type == "Constant"
                                                           for o in n.output})
    sg = StageGraphs(
        stage, last, graphs, mine, received, diff_received, sends, seeded, saved, outputs, initial, stats
    )
    if mine and with_update:
        slots = [
            WeightSlot(
                w,
                f"{w}_grad",
                tuple(initial[w].shape),
                inits[w].data_type,
                dict(params.optimizer_attributes_map.get(w, {})),
                dict(params.optimizer_int_attributes_map.get(w, {})),
            )
            for w in mine
        ]
        clip = update_clips(params, adasum)
        # mixed precision always reads the norm: whether every gradient is finite comes from it
        norm = NORM if clip or mp is not None else None
        graphs["update"], sg.update_outputs, _, sg.specs = build_update_graph(
            graphs["backward"], slots, params, opt, clip=clip, norm_input=norm, mp=mp
        )
        for sp in sg.specs:
            initial[sp.name] = sp.initial.copy()
    return sg


def layer_activations(model: onnx.ModelProto, params: TrainingParameters) -> set[str]:
    """The activations ``transformer_layer_recompute`` rebuilds, found on the whole ``model`` from its loss
    (none when the option is off)."""
    if not params.transformer_layer_recompute:
        return set()
    return transformer_layer_values(model, params.loss_output_name, params.number_recompute_layers)


def _recomputed(
    grad: onnx.ModelProto,
    loss: str,
    params: TrainingParameters,
    model: onnx.ModelProto,
    layers: set[str],
    forward_outputs: Sequence[str] = (),
) -> onnx.ModelProto:
    """A stage's gradient graph with the recompute options of ``params`` applied (GELU, attention dropout,
    checkpoints, and the transformer layers' ``layers``: the stage recomputes its activations from its
    inputs and the values it keeps); ``model`` is the whole model, where every checkpoint must be a value."""
    mine = {o for n in grad.graph.node for o in n.output} | {v.name for v in grad.graph.input}
    ckpts = params.recompute_checkpoints
    if ckpts:
        values = {o for n in model.graph.node for o in n.output} | {v.name for v in model.graph.input}
        unknown = sorted(set(ckpts) - values)
        if unknown:
            raise ValueError(f"recompute_checkpoints: {unknown} are not values of the model")
        ckpts = [c for c in ckpts if c in mine]
    return recompute(
        grad,
        loss,
        gelu=params.gelu_recompute,
        attn_dropout=params.attn_dropout_recompute,
        checkpoints=ckpts if params.recompute_checkpoints else None,
        forward_outputs=forward_outputs,
        values=layers & mine,
    )


def _ranked(types: Mapping[str, onnx.TypeProto], name: str) -> bool:
    """Whether ``name`` is a tensor of known element type and rank."""
    return bool(_elem(types, name)) and types[name].tensor_type.HasField("shape")


def boundary_value(name: str, types: Mapping[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    """A stage graph's input or output: its element type and rank, every dimension unnamed (a micro-batch's
    shape differs from the batch's)."""
    t = types.get(name)
    if t is None or not t.HasField("tensor_type") or not t.tensor_type.elem_type:
        raise ValueError(
            f"pipeline parallel: the type of {name!r}, which crosses a stage boundary, is unknown "
            "(ONNX shape inference could not find it)"
        )
    rank = len(t.tensor_type.shape.dim) if t.tensor_type.HasField("shape") else None
    return helper.make_tensor_value_info(
        name, t.tensor_type.elem_type, [None] * rank if rank is not None else None
    )


def _with_weights_as_inputs(
    model: onnx.ModelProto, weights: list[str]
) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A copy of ``model`` whose initializers ``weights`` are graph inputs, and their values."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out, _inits_to_inputs(out, weights)


def _copy(n: onnx.NodeProto) -> onnx.NodeProto:
    c = onnx.NodeProto()
    c.CopyFrom(n)
    return c


def _elem(types: Mapping[str, onnx.TypeProto], name: str) -> int:
    t = types.get(name)
    return t.tensor_type.elem_type if t is not None and t.HasField("tensor_type") else 0

"""Data parallelism over MPI (mpi4py, imported only when the process runs under ``mpiexec``).

* :func:`world` — rank and size of this process (``World(0, 1, 0, 1)`` without MPI);
* :func:`shard`, :func:`shard_range`, :func:`split_batch` — each rank's part of the data;
* :func:`allreduce_gradients` — average a list of gradient arrays across ranks, in place;
* :func:`abort_on_error` — wrap a program's main so a failing rank ends the whole job;
* :func:`resolve` — the data-parallel settings of a ``TrainingParameters`` (checked against MPI).

The legacy ``TrainingSession`` uses all of this by itself when ``mpiexec`` starts more than one rank.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

from onnxtrain.parallel.buckets import BucketReducer, allreduce_gradients
from onnxtrain.parallel.comm import (
    Communicator,
    World,
    abort_on_error,
    get_communicator,
    launched_by_mpi,
    world,
)
from onnxtrain.parallel.data import shard, shard_range, split_batch
from onnxtrain.user_warning import warn

__all__ = ["BucketReducer", "Communicator", "DataParallel", "World", "abort_on_error", "allreduce_gradients",
           "check_world_options", "get_communicator", "is_main_process", "launched_by_mpi", "resolve",
           "shard", "shard_range", "split_batch", "world"]


def is_main_process() -> bool:
    """True on rank 0 (the rank that prints progress and writes metrics, plots and checkpoints)."""
    return world().rank == 0


@dataclass
class DataParallel:
    """What a session does across ranks: ``mode`` is ``"allreduce"``, ``"adasum"`` or ``"zero1"``."""

    comm: Communicator
    rank: int
    size: int
    mode: str


def exchange_mode(p: Any, replicas: int, what: str) -> str | None:
    """How ``replicas`` copies of a model (``what`` names one in messages) combine their updates under
    ``TrainingParameters`` ``p``: "allreduce", "zero1" or "adasum"; None for one, with a warning for each
    exchange option that then does nothing."""
    if replicas == 1:
        for name in ("enable_adasum", "deepspeed_zero_stage"):
            if getattr(p, name):
                warn(f"TrainingParameters.{name} has no effect with one {what}")
        return None
    if p.deepspeed_zero_stage == 1:
        if p.enable_adasum:
            warn("deepspeed_zero_stage=1 and enable_adasum are both set: ZeRO is used, as in the "
                 "legacy (Adasum is ignored)")
        return "zero1"
    if p.enable_adasum:
        from onnxtrain.parallel.adasum import is_power_of_two

        if not is_power_of_two(replicas):
            raise ValueError(f"enable_adasum needs a power-of-two number of {what}s, got {replicas}")
        return "adasum"
    return "allreduce"


def launch_hint(n: int) -> str:
    """The command this process ran, under ``mpiexec -n n`` (how to start it on n ranks)."""
    prog, *args = list(sys.argv) or ["script.py"]
    if os.path.basename(prog) == "__main__.py":  # python -m <package>
        cmd = ["python", "-m", os.path.basename(os.path.dirname(prog))]
    elif prog.endswith(".py"):
        cmd = ["python", prog]
    else:  # a console script, e.g. onnxtrain
        cmd = [os.path.basename(prog)]
    import shlex  # here: only a hint's command line needs it

    return f"mpiexec -n {n} " + shlex.join([*cmd, *args])


def check_sizes(p: Any) -> None:
    """ValueError naming the ``TrainingParameters`` property whose rank count (< 1) or rank (< -1) is
    impossible."""
    for key in ("world_size", "data_parallel_size", "horizontal_parallel_size", "pipeline_parallel_size"):
        if getattr(p, key) < 1:
            raise ValueError(f"TrainingParameters.{key}={getattr(p, key)}: a number of ranks must be >= 1")
    if p.world_rank < -1:
        raise ValueError(f"TrainingParameters.world_rank={p.world_rank}: a rank must be >= 0 (or -1, as "
                         "onnxruntime's ort_trainer passed it, for the one MPI gives)")


def _assigned(p: Any, name: str) -> bool:
    """Whether ``TrainingParameters`` ``p`` had property ``name`` assigned (even to its default)."""
    return bool(getattr(p, "is_set", lambda _: False)(name))


def check_world_options(p: Any, w: World) -> None:
    """Explicit ``world_size`` / ``world_rank`` of ``TrainingParameters`` ``p`` must agree with MPI's ``w``
    (an assigned ``world_rank = 0`` too: it is told from the default by ``p.is_set``)."""
    # -1 (ort_trainer's create_ort_training_session_with_optimizer default) means unset, as 0 unassigned does
    given = p.world_rank > 0 or (p.world_rank == 0 and _assigned(p, "world_rank"))
    if w.size > 1:
        if p.world_size not in (1, w.size):
            raise ValueError(f"TrainingParameters.world_size={p.world_size} but mpiexec started {w.size} "
                             "ranks")
        if given and p.world_rank != w.rank:
            raise ValueError(f"TrainingParameters.world_rank={p.world_rank} but MPI says this is rank "
                             f"{w.rank} of {w.size} (leave world_rank unset: each rank takes its own "
                             "from MPI)")
        return
    if p.world_size > 1:
        raise ValueError(f"TrainingParameters.world_size={p.world_size}, but this process was not started "
                         f"by mpiexec (MPI world size 1); launch with: {launch_hint(p.world_size)}")
    if p.world_rank > 0:
        n = max(p.world_size, p.world_rank + 1)
        raise ValueError(f"TrainingParameters.world_rank={p.world_rank}, but this process was not started "
                         f"by mpiexec (it is rank 0 of 1); launch with: {launch_hint(n)}, and leave "
                         "world_rank unset (each rank takes its own from MPI)")


def resolve(p: Any) -> DataParallel | None:
    """Ranks and sizes for a ``TrainingParameters``: from MPI under ``mpiexec``; explicit values must agree.
    Its warnings point at the caller of ``TrainingSession(...)``, two frames above this function's caller.

    Returns None when the session runs alone (one data-parallel rank).
    """
    if p.horizontal_parallel_size > 1:
        raise NotImplementedError("TrainingParameters.horizontal_parallel_size > 1 (Megatron tensor "
                                  "parallel) is not implemented; only data parallelism is")
    if p.pipeline_parallel_size > 1:
        raise NotImplementedError("TrainingParameters.pipeline_parallel_size > 1 (pipeline parallel) is not "
                                  "implemented; only data parallelism is")
    if p.deepspeed_zero_stage not in (0, 1):
        raise NotImplementedError(f"deepspeed_zero_stage={p.deepspeed_zero_stage}: only stages 0 and 1 exist")
    w = world()
    if w.size > 1:  # MPI first: a rank raising below then aborts the job instead of leaving the others in
        get_communicator()  # MPI_Init
    check_world_options(p, w)
    if w.size > 1 and p.world_size == 1 and _assigned(p, "world_size"):
        warn(f"TrainingParameters.world_size=1 under mpiexec with {w.size} ranks: each rank trains alone, "
             "as in onnxruntime (leave world_size unset, or set it to the number of ranks, for data "
             "parallelism)")
        return None
    size = w.size
    d = p.data_parallel_size
    if d > size:
        hint = f"; launch with: {launch_hint(d)}" if size == 1 else ""
        raise ValueError(f"TrainingParameters.data_parallel_size={d} exceeds the world size {size}{hint}")
    if d != size and (d != 1 or _assigned(p, "data_parallel_size")):
        warn(f"data_parallel_size={d} does not equal world_size {size} (horizontal and pipeline "
             f"sizes are 1); using {size}")
    mode = exchange_mode(p, size, "data-parallel rank")
    if mode is None:
        return None
    comm = get_communicator()
    return DataParallel(comm, comm.rank, comm.size, mode)

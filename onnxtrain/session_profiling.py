"""A session's profile: its own events (loading, initialization, runs) and its plans' node events, written as
a chrome-trace file named as onnxruntime names its traces."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import time
from collections.abc import Sequence
from typing import Any

from onnxtrain.engine.interface import GraphInterface, ProfileEvent
from onnxtrain.ir.io import write_atomic


def end_profiling(session: Any, plans: Sequence[GraphInterface]) -> str:
    """A session's ``end_profiling``: the trace of ``plans``, then no more profiling by them ('' when the
    session does not profile, or has ended)."""
    if not session._sess_options.enable_profiling or getattr(session, "_profiling_ended", False):
        return ""
    events, session._session_events = session._session_events or [], None
    try:
        return write_chrome_trace(plans, session._sess_options.profile_file_prefix, events,
                                  session._profile_origin)
    finally:
        session._profiling_ended = True
        for plan in plans:
            plan.profiling = False


def profile_session_start(session: Any, begin: int, loaded: int) -> None:
    """Start a session's own profile events, when its options ask for a profile: the model's loading
    (``begin`` to ``loaded``, ``perf_counter_ns``) and the session's initialization (from ``loaded`` to
    now), as onnxruntime's trace begins; each run adds a ``model_run``. Their times count from ``begin``."""
    session._profile_origin = begin
    session._session_events = None
    if session._sess_options.enable_profiling:
        what = "model_loading_uri" if getattr(session, "_model_path", None) else "model_loading_array"
        session._session_events = [
            ProfileEvent(what, "", begin, loaded - begin, cat="Session"),
            ProfileEvent("session_initialization", "", loaded, time.perf_counter_ns() - loaded,
                         cat="Session"),
        ]


def claim_trace_path(prefix: str) -> str:
    """``<prefix>_<date>_<time>_<milliseconds>.json``, as onnxruntime names its traces, claimed (created
    empty) so that another session ending its profile in the same millisecond takes the next name
    (``…_2.json``) instead of overwriting it."""
    now = datetime.datetime.now()
    stem = f"{prefix}_{now.strftime('%Y-%m-%d_%H-%M-%S')}_{now.microsecond // 1000:03d}"
    for k in range(1, 10_000):
        path = f"{stem}.json" if k == 1 else f"{stem}_{k}.json"
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free profile file name after {stem}_9999.json")


def write_chrome_trace(plans: Sequence[GraphInterface], prefix: str,
                       session_events: Sequence[ProfileEvent] = (), origin: int | None = None,
                       path: str | None = None) -> str:
    """Write the profile events of ``plans``' runs (their ``profile``, and those their backend kept) and
    the session's own (``session_events``: its loading, initialization and runs), in time order, as a
    chrome-trace file named ``<prefix><timestamp>.json`` (or into ``path``, a name
    :func:`claim_trace_path` gave earlier); returns the path. Times count from ``origin``
    (``perf_counter_ns``; default the first event's start). The plans' events are handed over: the next
    trace holds the runs after this one."""
    profile = list(session_events)
    for plan in {id(p): p for p in plans}.values():
        profile += plan.profile
        plan.profile.clear()
        profile += plan.drained_profile()
    profile.sort(key=lambda e: e.start_ns)
    path = path or claim_trace_path(prefix)
    t0 = origin if origin is not None else profile[0].start_ns if profile else 0
    pid = os.getpid()
    events = [
        {"cat": "Session", "pid": pid, "tid": 0, "ph": "X", "name": e.name,
         "ts": (e.start_ns - t0) / 1000.0, "dur": e.dur_ns / 1000.0, "args": {}}
        if e.cat == "Session" else
        {
            "cat": "Node",
            "pid": pid,
            "tid": 0,
            "ph": "X",
            "name": f"{e.name}_kernel_time",
            "ts": (e.start_ns - t0) / 1000.0,
            "dur": e.dur_ns / 1000.0,
            "args": {"op_name": e.op, "input_type_shape": e.shapes, "output_type_shape": e.outputs,
                     "output_size": str(e.output_bytes), "provider": "CPUExecutionProvider",
                     **({} if e.index is None else {"node_index": str(e.index)}), **e.stats},
        }
        for e in profile
    ]
    try:
        # one event a line, as onnxruntime writes its traces (tools that read them line by line)
        text = "[\n" + ",\n".join(json.dumps(e) for e in events) + "\n]\n"
        write_atomic(path, lambda f: f.write(text.encode()))
    except BaseException:
        with contextlib.suppress(OSError):  # the empty file that claimed the name
            os.remove(path)
        raise
    return path

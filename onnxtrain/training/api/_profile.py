"""``SessionOptions.enable_profiling`` and ``optimized_model_filepath`` for the on-device API, as
onnxruntime-training 1.19.2 applies them.

There, the ``Module`` makes one onnxruntime ``InferenceSession`` for the training model and one for the eval
model, and the ``Optimizer`` one for the optimizer model, all with the user's options. Each session names
its trace when it is made (``<prefix>_<date>_<time>.json``, created empty) and writes it when it is
destroyed (the ``Module`` or ``Optimizer`` collected); each writes its optimized model to the one
``optimized_model_filepath`` while it is made, so the file holds the last session's: the eval model (the
training model without one) after the ``Module``, the optimizer model after the ``Optimizer``.

Here each such session is a :class:`SessionProfile`: its trace name is claimed when the object is made
(with milliseconds and a ``_2``… suffix, as the ``InferenceSession``'s, so that sessions made in the same
second do not overwrite each other's traces as onnxruntime-training's do) and the trace is written by a
finalizer of its owner. Its plans' runs are timed by :class:`ProfiledPlan`, which only profiled sessions
use: a step without profiling runs the plain plan. On the onnxruntime backend the trace takes the node
events of onnxruntime's own traces (whose files it removes), as an ``InferenceSession``'s does.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import onnx

from onnxtrain.engine.interface import MAX_PROFILE_EVENTS, GraphInterface, ProfileEvent
from onnxtrain.user_warning import warn

OPTION = "SessionOptions.optimized_model_filepath"


def session_option(options: Any, name: str) -> Any:
    """The value of option ``name`` of ``options`` (None when unset, or there are no options)."""
    return None if options is None else getattr(options, name, None) or None


def write_optimized_model(options: Any, model: onnx.ModelProto) -> None:
    """Write ``model`` to the options' ``optimized_model_filepath`` when set, as a session of
    onnxruntime-training writes its optimized graph while it is made."""
    if session_option(options, "optimized_model_filepath"):
        from onnxtrain.errors import NoFolderForOutput
        from onnxtrain.ir.io import save_dump
        from onnxtrain.session_loading import optimized_model_path

        save_dump(model, optimized_model_path(options), OPTION, missing_folder=NoFolderForOutput)


class ProfiledPlan:
    """A plan whose runs add a ``model_run`` event to a session's profile; everything else is the plan's."""

    __slots__ = ("plan", "_events")

    def __init__(self, plan: GraphInterface, events: list[ProfileEvent]) -> None:
        self.plan = plan
        self._events = events

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The plan's run, timed as onnxruntime's ``model_run``."""
        begin = time.perf_counter_ns()
        out = self.plan.run(*args, **kwargs)
        if len(self._events) < MAX_PROFILE_EVENTS:
            self._events.append(ProfileEvent("model_run", "", begin, time.perf_counter_ns() - begin,
                                             cat="Session"))
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.plan, name)


class SessionProfile:
    """The trace of one session of the on-device API (``what``: training, eval or optimizer): its loading
    and initialization, its runs and its plans' node events."""

    def __init__(self, options: Any, what: str, from_file: bool, loading: tuple[int, int]) -> None:
        from onnxtrain.session_profiling import claim_trace_path  # (only profiled sessions load the module)

        self.what = what
        self.ended = False
        try:
            self.path = claim_trace_path(options.profile_file_prefix)
        except OSError as e:  # (onnxruntime-training goes on without a word, and writes no trace)
            warn(f"SessionOptions.profile_file_prefix {options.profile_file_prefix!r}: the {what} model's "
                 f"trace cannot be created ({e}); it is not profiled")
            self.path = ""
            self.ended = True
        self.origin = loading[0]
        self.events = [ProfileEvent("model_loading_uri" if from_file else "model_loading_array", "",
                                    loading[0], loading[1] - loading[0], cat="Session")]
        self.plans: list[GraphInterface] = []

    def watch(self, plan: GraphInterface, initialization: tuple[int, int] | None = None
              ) -> GraphInterface | ProfiledPlan:
        """Profile ``plan``'s runs in this trace (``initialization``: when it was compiled, the session's
        ``session_initialization`` span); ``plan`` itself when the trace has ended."""
        if self.ended:
            return plan
        if initialization is not None:
            self.events.append(ProfileEvent("session_initialization", "", initialization[0],
                                            initialization[1] - initialization[0], cat="Session"))
        plan.profiling = True
        self.plans.append(plan)
        return ProfiledPlan(plan, self.events)

    def end(self) -> str:
        """Write the trace (once; '' afterwards) and stop profiling the plans; returns its path. A write that
        fails warns, naming the file: this runs as the owner is collected, where nothing could catch it."""
        if self.ended:
            return ""
        self.ended = True
        for plan in self.plans:
            plan.profiling = False
        from onnxtrain.session_profiling import write_chrome_trace

        try:
            return write_chrome_trace(self.plans, "", self.events, self.origin, path=self.path)
        except OSError as e:
            warn(f"SessionOptions.enable_profiling: the {self.what} model's profile {self.path!r} could not "
                 f"be written: {e}")
            return ""

    def discard(self) -> None:
        """Give up the claimed name (its owner failed to be made)."""
        if self.ended:
            return
        self.ended = True
        with contextlib.suppress(OSError):
            os.remove(self.path)


def profiles_written_at_collection(owner: object, profiles: list[SessionProfile]) -> Callable[[], None]:
    """Write ``profiles`` when ``owner`` is collected or the interpreter exits, whichever comes first, as
    onnxruntime-training's sessions write theirs when they are destroyed; returns the finalizer."""

    def end_all() -> None:
        for p in profiles:
            p.end()

    return weakref.finalize(owner, end_all)

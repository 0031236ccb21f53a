"""A process forked by one thread while another is inside onnxtrain: state the other thread would have put
back (the garbage collector paused by a build, the SIGINT handler held by a training step) is put back in
the child, where that thread does not exist."""

from __future__ import annotations

import gc
import os
import signal
import threading

import pytest

from onnxtrain.interrupts import sigint_deferred
from onnxtrain.ir.builder import gc_paused

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


def _child_status(child) -> int:
    """Fork, run ``child()`` (an exit code) in the child, and return that code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = child()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _in_other_thread(fn) -> int:
    """``fn()`` run by a second thread; its result."""
    out: list[int] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(60)
    assert out, "the forking thread did not finish"
    return out[0]


def test_a_child_forked_during_another_threads_build_collects_garbage() -> None:
    assert gc.isenabled()
    inside, leave = threading.Event(), threading.Event()

    def build() -> None:
        with gc_paused():
            inside.set()
            leave.wait(60)

    builder = threading.Thread(target=build)
    builder.start()
    assert inside.wait(60)
    try:
        assert not gc.isenabled()  # paused in the parent while the build runs

        def child() -> int:
            if not gc.isenabled():
                return 1
            with gc_paused():  # the child's own build pauses it and gives it back
                if gc.isenabled():
                    return 2
            return 0 if gc.isenabled() else 3

        assert _child_status(child) == 0
    finally:
        leave.set()
        builder.join(60)
    assert gc.isenabled()


def test_a_child_forked_inside_its_own_build_keeps_the_pause_until_it_ends() -> None:
    build = gc_paused()

    def child() -> int:
        if gc.isenabled():
            return 1  # the build it is part of has not ended
        build.__exit__(None, None, None)
        return 0 if gc.isenabled() else 2

    build.__enter__()
    try:
        assert _child_status(child) == 0
    finally:
        build.__exit__(None, None, None)
    assert gc.isenabled()


def _interrupted() -> int:
    """In a child: 0 when its own SIGINT raises KeyboardInterrupt, 1 when it is swallowed."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        for _ in range(1000):  # (the handler runs at the next bytecode boundary)
            pass
    except KeyboardInterrupt:
        return 0
    return 1


def test_a_child_forked_by_another_thread_during_a_step_stops_at_ctrl_c() -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler in this process")
    with sigint_deferred():
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # held by the step
        status = _in_other_thread(lambda: _child_status(_interrupted))
    assert status == 0
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_child_forked_by_the_stepping_thread_still_defers_ctrl_c_to_the_steps_end() -> None:
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("SIGINT has another handler in this process")

    def step_then_fork() -> int:
        deferred = sigint_deferred()
        deferred.__enter__()

        def in_child() -> int:
            if _interrupted() == 0:
                return 1  # raised inside the step: not deferred
            try:
                deferred.__exit__(None, None, None)
            except KeyboardInterrupt:
                return 0  # raised when the step ended
            return 2

        status = _child_status(in_child)
        deferred.__exit__(None, None, None)
        return status

    assert step_then_fork() == 0


def test_a_child_forked_with_no_build_under_way_keeps_the_programs_collector_setting() -> None:
    with gc_paused():
        pass
    gc.disable()  # the program's own choice, after a build
    try:
        assert _child_status(lambda: 0 if not gc.isenabled() else 1) == 0
    finally:
        gc.enable()

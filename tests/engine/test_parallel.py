"""Intra-op threads: the worker pool, a plan's width, and kernels split over threads giving the same bits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine import blas, parallel
from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model


def test_parallel_for_runs_every_index_once_over_several_threads() -> None:
    seen: list[tuple[int, int]] = []
    lock = threading.Lock()
    started = threading.Barrier(2, timeout=10)

    def fn(i: int) -> None:
        if i < 2:
            started.wait()  # both threads must be in here at once: the job really runs on two
        with lock:
            seen.append((i, threading.get_ident()))

    with parallel.running_with(2):
        parallel.parallel_for(9, fn)
        assert parallel.width() == 2  # restored after the job
    assert sorted(i for i, _ in seen) == list(range(9))
    assert len({t for _, t in seen}) == 2
    assert parallel.width() == 1


def test_parallel_for_raises_the_error_of_a_part_and_parts_do_not_split_again() -> None:
    widths: list[int] = []

    def fn(i: int) -> None:
        widths.append(parallel.width())
        if i == 3:
            raise KeyError("part 3")

    with parallel.running_with(2), pytest.raises(KeyError, match="part 3"):
        parallel.parallel_for(6, fn)
    assert len(widths) == 6 and set(widths) == {1}
    with parallel.running_with(2):  # the pool still works after a failed job
        out = np.zeros(4)
        parallel.parallel_for(4, lambda i: out.__setitem__(i, i))
    np.testing.assert_array_equal(out, [0, 1, 2, 3])


@pytest.mark.parametrize("n,parts,align", [(10, 2, 1), (1000, 3, 64), (5, 8, 1), (130, 2, 64), (1, 2, 64)])
def test_split_covers_the_range_with_aligned_starts(n: int, parts: int, align: int) -> None:
    ranges = parallel.split(n, parts, align)
    assert len(ranges) <= parts
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo % align == 0 and hi > lo for lo, hi in ranges)


def test_split_of_nothing_is_no_ranges() -> None:
    assert parallel.split(0, 2) == [] and parallel.split(5, 0) == [(0, 5)]


def test_default_width_reads_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("ONNXTRAIN_NUM_THREADS", "3")
    assert parallel.default_width() == 3
    assert Plan(_gelu_model()).threads == 3
    assert Plan(_gelu_model(), threads=1).threads == 1
    for bad in ("0", "two"):
        monkeypatch.setenv("ONNXTRAIN_NUM_THREADS", bad)
        with pytest.raises(
            ValueError, match=f"ONNXTRAIN_NUM_THREADS must be a positive integer, got '{bad}'"
        ):
            parallel.default_width()
    with pytest.raises(ValueError, match="threads must be a non-negative integer"):
        Plan(_gelu_model(), threads=-2)


def _gelu_model() -> onnx.ModelProto:
    """torch's exported exact GELU after a bias: one elementwise cluster with Erf in it."""
    f = TensorProto.FLOAT
    nodes = [
        helper.make_node("Add", ["h", "bias"], ["x"]),
        helper.make_node("Div", ["x", "root2"], ["xs"]),
        helper.make_node("Erf", ["xs"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["e1"]),
        helper.make_node("Mul", ["x", "e1"], ["m"]),
        helper.make_node("Mul", ["m", "half"], ["y"]),
    ]
    inits = [
        helper.make_tensor("root2", f, [], [1.4142135381698608]),
        helper.make_tensor("one", f, [], [1.0]),
        helper.make_tensor("half", f, [], [0.5]),
    ]
    return model(nodes, ["h", "bias"], ["y"], inits)


def test_a_cluster_split_over_threads_gives_the_same_bits(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 0)
    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)  # several blocks per part, and a short tail
    rng = np.random.default_rng(3)
    serial, split, plain = (
        Plan(_gelu_model(), threads=1),
        Plan(_gelu_model(), threads=2),
        Plan(_gelu_model(), fuse=False),
    )
    assert [s.node.op_type for s in split.steps] == ["FusedElementwise"]
    for shape in [(37, 50), (37, 50), (4, 1000), (3,)]:
        feeds = {
            "h": (3 * rng.standard_normal(shape)).astype(np.float32),
            "bias": rng.standard_normal(shape[-1:]).astype(np.float32),
        }
        want = plain.run(feeds)[0]
        np.testing.assert_array_equal(serial.run(feeds)[0], want)
        np.testing.assert_array_equal(split.run(feeds)[0], want)
    (seg,) = next(p[5] for p in split.steps[0].fn.programs.values() if p[5] is not None).segments
    assert seg.par and len(seg.views) == 2  # both threads took scratch views of their own


def test_split_segments_of_one_cluster_run_as_one_job_with_the_same_bits(monkeypatch) -> None:
    """An update over two weights (one cluster, a segment per weight), both segments split: the threads take
    their piece of each in one job, and the bits are those of one thread and of the unfused graph."""
    from onnxtrain.engine.fusion import blocked as fusion
    from tests.engine.test_fusion import two_weight_update

    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 0)
    monkeypatch.setattr(fusion, "UPDATE_PAR_MIN_WORK", 0)  # the new weights may be written into the old
    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    jobs = []
    real = fusion.parallel_for
    monkeypatch.setattr(fusion, "parallel_for", lambda n, fn: (jobs.append(n), real(n, fn)))
    rng = np.random.default_rng(12)
    feeds = {"lr": np.array([0.01], np.float32)}
    for w, shape in (("a", (96, 40)), ("b", (300, 7))):
        feeds[f"w_{w}"], feeds[f"g_{w}"] = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    serial, split, plain = (Plan(two_weight_update(), threads=1), Plan(two_weight_update(), threads=2),
                            Plan(two_weight_update(), fuse=False))
    want = plain.run(feeds)
    for plan in (serial, split, split):
        for got, ref in zip(plan.run(feeds), want):
            assert got.tobytes() == ref.tobytes()
    (prog,) = split.steps[0].fn.programs.values()
    assert len(prog[5].segments) == 2 and all(seg.par for seg in prog[5].segments)
    jobs.clear()
    split.run(feeds)
    assert jobs == [2]  # one job of two pieces for both segments, not one per segment


@pytest.mark.parametrize(("loads", "work", "want"), [
    ([0.0, 0.0], 10.0, [0.5, 0.5]),  # nothing else to run: halves
    ([6.0, 0.0], 10.0, [0.2, 0.8]),  # the loaded thread takes less: both end at 8
    ([12.0, 0.0], 10.0, [0.0, 1.0]),  # more than the work on one thread: all of it on the other
    ([3.0, 1.0, 0.0], 2.0, [0.0, 0.25, 0.75]),  # level 1.5: the most loaded thread gets none
    ([1.0, 1.0], 0.0, [0.5, 0.5]),  # no work: any shares
])
def test_water_fill_evens_out_the_threads_loads(loads: list[float], work: float, want: list[float]) -> None:
    from onnxtrain.engine.fusion.blocked import water_fill

    got = water_fill(loads, work)
    np.testing.assert_allclose(got, want, atol=1e-12)
    assert sum(got) == pytest.approx(1.0)


@pytest.mark.parametrize(("n", "shares", "align"), [
    (1000, [0.5, 0.5], 64), (1000, [0.0, 1.0], 64), (1000, [0.3, 0.3, 0.4], 8), (5, [0.9, 0.1], 64),
])
def test_cut_covers_the_range_in_order_on_aligned_boundaries(n: int, shares: list[float], align: int) -> None:
    from onnxtrain.engine.fusion.blocked import _cut

    ranges = _cut(n, shares, align)
    assert len(ranges) == len(shares) and ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(lo <= hi and (lo % align == 0 or lo == n) for lo, hi in ranges)
    for k, (_, hi) in enumerate(ranges[:-1]):  # each boundary within one alignment step of its share
        assert abs(hi - sum(shares[:k + 1]) * n) <= align


def _weight_feeds(seed: int, shapes: tuple, own_lr: bool) -> dict[str, np.ndarray]:
    """Feeds of a two-weight update (``two_weight_update``: one ``lr``; ``sibling_updates``: one a weight)."""
    rng = np.random.default_rng(seed)
    feeds = {} if own_lr else {"lr": np.array([0.01], np.float32)}
    for w, shape in zip("ab", shapes):
        if own_lr:
            feeds[f"lr_{w}"] = np.array([0.01], np.float32)
        feeds[f"w_{w}"], feeds[f"g_{w}"] = (rng.standard_normal(shape).astype(np.float32) for _ in range(2))
    return feeds


def _threaded_plan_with_the_same_bits(make, feeds: dict[str, np.ndarray]) -> Plan:
    """A two-thread plan of ``make()``, checked (twice) to give the bits of a one-thread one and of the
    unfused graph."""
    serial, threaded, plain = Plan(make(), threads=1), Plan(make(), threads=2), Plan(make(), fuse=False)
    want = plain.run(feeds)
    for plan in (serial, threaded, threaded):
        for got, ref in zip(plan.run(feeds), want):
            assert got.tobytes() == ref.tobytes()
    return threaded


def _recorded_parts(monkeypatch, fusion) -> list[tuple[int, int, int, int]]:
    """From now on, jobs run their parts in order on the calling thread (which thread takes a part is the
    scheduler's choice; what each part holds is the plan's), recording (part, segment size, start, stop) of
    each Segment._run_range call (part −1: outside a job)."""
    calls: list[tuple[int, int, int, int]] = []
    part = [-1]
    real = fusion.Segment._run_range

    def spy(self, bv, slots, start, stop, block, views):
        calls.append((part[0], self.n, start, stop))
        return real(self, bv, slots, start, stop, block, views)

    def in_order(n, fn):
        for i in range(n):
            part[0] = i
            fn(i)
        part[0] = -1  # outside a job

    monkeypatch.setattr(fusion.Segment, "_run_range", spy)
    monkeypatch.setattr(fusion, "parallel_for", in_order)
    return calls


def test_whole_segments_are_dealt_out_to_the_threads_with_the_same_bits(monkeypatch) -> None:
    """An update over two weights, neither split: each weight's segment runs whole on a thread of its own in
    one job, and the bits are those of one thread and of the unfused graph."""
    from onnxtrain.engine.fusion import blocked as fusion
    from tests.engine.test_fusion import two_weight_update

    monkeypatch.setattr(fusion, "RIDE_MIN", 0)
    monkeypatch.setattr(fusion, "JOB_MIN_WORK", 0)
    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)  # several blocks each, in each thread's own scratch
    feeds = _weight_feeds(21, ((96, 40), (300, 7)), own_lr=False)
    dealt = _threaded_plan_with_the_same_bits(two_weight_update, feeds)
    (prog,) = dealt.steps[0].fn.programs.values()
    assert not any(seg.par for seg in prog[5].segments)
    calls = _recorded_parts(monkeypatch, fusion)
    dealt.run(feeds)
    assert sorted(calls) == [(0, 3840, 0, 3840), (1, 2100, 0, 2100)]  # the larger first, one per thread
    monkeypatch.setattr(fusion, "JOB_MIN_WORK", 1 << 40)  # too little work to share: no job at all
    calls.clear()
    dealt.run(feeds)
    assert sorted(calls) == [(-1, 2100, 0, 2100), (-1, 3840, 0, 3840)]


def test_split_work_fills_up_the_thread_that_runs_no_whole_segment(monkeypatch) -> None:
    """One weight split, one run whole: the whole segment's thread takes the smaller piece of the split one
    (equal loads), with the same bits as one thread and the unfused graph."""
    from onnxtrain.engine.fusion import blocked as fusion
    from tests.engine.test_fusion import two_weight_update

    monkeypatch.setattr(fusion, "RIDE_MIN", 0)
    monkeypatch.setattr(fusion, "UPDATE_PAR_MIN_WORK", 6 * 10_000)  # a (10,000 values × 6 ufuncs) splits
    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 6 * 10_000)
    monkeypatch.setattr(fusion, "CALL_COST", 0)
    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    feeds = _weight_feeds(22, ((100, 100), (50, 60)), own_lr=False)
    split = _threaded_plan_with_the_same_bits(two_weight_update, feeds)
    (prog,) = split.steps[0].fn.programs.values()
    assert [seg.par for seg in prog[5].segments] == [True, False]
    calls = _recorded_parts(monkeypatch, fusion)
    split.run(feeds)
    (whole_part,) = {t for t, n, *_ in calls if n == 3000}
    pieces = {t: hi - lo for t, n, lo, hi in calls if n == 10_000}
    # equal loads: 3,000 + x = 10,000 − x, so x = 3,500 (to a 64-value boundary) with the whole segment
    assert abs(pieces[whole_part] - 3500) <= 64 and sum(pieces.values()) == 10_000


def test_split_pieces_below_the_blocking_size_run_as_one_block(monkeypatch) -> None:
    """A split segment's pieces are cut into blocks only when a piece's working set is at least
    BLOCK_MIN_BYTES (as a whole segment would be): a blocked segment whose halves fall below it runs each
    half in one block, with the same bits as one thread and the unfused graph."""
    from onnxtrain.engine.fusion import blocked as fusion
    from tests.engine.test_fusion import two_weight_update

    monkeypatch.setattr(fusion, "RIDE_MIN", 0)
    monkeypatch.setattr(fusion, "UPDATE_PAR_MIN_WORK", 6 * 10_000)
    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 6 * 10_000)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    feeds = _weight_feeds(23, ((100, 100), (50, 60)), own_lr=False)
    blocks: list[tuple[int, int, int]] = []  # (segment size, piece length, block)
    real = fusion.Segment._run_range

    def spy(self, bv, slots, start, stop, block, views):
        blocks.append((self.n, stop - start, block))
        return real(self, bv, slots, start, stop, block, views)

    for whole_limit, cut in ((10_000, False), (2_000, True)):
        blocks.clear()
        monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 1)  # the segment itself is blocked
        plan = Plan(two_weight_update(), threads=2)
        plan.run(feeds)
        (prog,) = plan.steps[0].fn.programs.values()
        seg = next(s for s in prog[5].segments if s.n == 10_000)
        assert seg.par and seg.block < 5_000
        seg_bytes = seg.bytes_per_element
        # pieces of under 7,000 values (the other thread also runs the small weight whole): under the limit
        # of ``whole_limit`` values' bytes unless ``cut``
        monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", whole_limit * seg_bytes)
        monkeypatch.setattr(fusion.Segment, "_run_range", spy)
        for got, want in zip(plan.run(feeds), Plan(two_weight_update(), fuse=False).run(feeds)):
            assert got.tobytes() == want.tobytes()
        monkeypatch.setattr(fusion.Segment, "_run_range", real)
        pieces = [(length, block) for n, length, block in blocks if n == 10_000]
        assert len(pieces) == 2 and sum(length for length, _ in pieces) == 10_000
        if cut:
            assert all(block == seg.block for _, block in pieces)
        else:
            assert all(block >= length for length, block in pieces)  # one block each


def sibling_updates() -> onnx.ModelProto:
    """Two weights updated by chains that share no computed value (a legacy optimizer graph's per-weight
    updates, each with its own step size input): two clusters side by side."""
    n = []
    for w in ("a", "b"):
        n += [
            helper.make_node("Mul", [f"g_{w}", f"g_{w}"], [f"gg_{w}"]),
            helper.make_node("Add", [f"gg_{w}", "eps"], [f"d_{w}"]),
            helper.make_node("Div", [f"g_{w}", f"d_{w}"], [f"u_{w}"]),
            helper.make_node("Mul", [f"u_{w}", f"lr_{w}"], [f"s_{w}"]),
            helper.make_node("Sub", [f"w_{w}", f"s_{w}"], [f"new_{w}"]),
        ]
    inits = [helper.make_tensor("eps", TensorProto.FLOAT, [], [1e-3])]
    return model(n, ["lr_a", "w_a", "g_a", "lr_b", "w_b", "g_b"], ["new_a", "new_b"], inits)


def test_sibling_clusters_run_as_one_step_and_their_split_pieces_as_one_job(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    for limit in ("PAR_MIN_WORK", "UPDATE_PAR_MIN_WORK", "BLOCK_MIN_BYTES"):
        monkeypatch.setattr(fusion, limit, 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    jobs = []
    real = fusion.parallel_for
    monkeypatch.setattr(fusion, "parallel_for", lambda n, fn: (jobs.append(n), real(n, fn)))
    feeds = _weight_feeds(13, ((96, 40), (300, 7)), own_lr=True)
    split = _threaded_plan_with_the_same_bits(sibling_updates, feeds)
    assert [st.node.op_type for st in split.steps] == ["FusedElementwiseGroup"]
    jobs.clear()
    split.run(feeds)
    assert jobs == [2]  # both clusters' split segments in one job of two pieces


def test_sibling_clusters_too_small_to_block_deal_their_loops_out_in_the_groups_job(monkeypatch) -> None:
    """A legacy optimizer's per-weight updates (a group of clusters), each too small for blocks or a split:
    with two threads each weight's loop runs whole on a thread of its own, in the group's one job, with the
    bits of one thread and of the unfused graph."""
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "RIDE_MIN", 0)
    monkeypatch.setattr(fusion, "JOB_MIN_WORK", 0)
    feeds = _weight_feeds(23, ((96, 40), (300, 7)), own_lr=True)
    dealt = _threaded_plan_with_the_same_bits(sibling_updates, feeds)
    assert [st.node.op_type for st in dealt.steps] == ["FusedElementwiseGroup"]
    calls = _recorded_parts(monkeypatch, fusion)
    dealt.run(feeds)
    assert sorted(calls) == [(0, 3840, 0, 3840), (1, 2100, 0, 2100)]


def test_an_input_two_sibling_clusters_read_is_donated_to_neither(monkeypatch) -> None:
    """A donated input that both clusters of a group read must reach the second one unchanged (blocked
    clusters write into donated inputs they alone read)."""
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 4096)
    n = [
        helper.make_node("Mul", ["x", "two"], ["p"]), helper.make_node("Mul", ["p", "two"], ["ya"]),
        helper.make_node("Add", ["x", "two"], ["q"]), helper.make_node("Add", ["q", "two"], ["yb"]),
    ]
    inits = [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    m = model(n, ["x"], ["ya", "yb"], inits)
    fused, plain = Plan(m), Plan(m, fuse=False)
    assert [st.node.op_type for st in fused.steps] == ["FusedElementwiseGroup"]
    x = np.arange(1000, dtype=np.float32)
    want = plain.run({"x": x.copy()})
    for _ in range(2):
        given = x.copy()
        got = fused.run({"x": given}, donate=["x"])
        for a, b in zip(got, want):
            assert a.tobytes() == b.tobytes()
        assert not any(np.shares_memory(a, given) for a in got)


def _python(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter without a THREAD_TIMEOUT of its own; its printed words."""
    env = {k: v for k, v in os.environ.items() if "THREAD_TIMEOUT" not in k}
    env["OPENBLAS_NUM_THREADS"] = "2"
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_shortened_blas_spin_frees_the_cores_after_a_gemm() -> None:
    for _ in range(3):  # (a busy host can keep the spinning thread off its core: measured again)
        applied, before, after = _python("""
            import time, numpy as np
            from onnxtrain.engine.blas import shorten_blas_spin
            a = np.ones((1024, 1024), np.float32)
            def idle_cpu():
                a @ a
                c = time.process_time()
                time.sleep(0.3)
                return time.process_time() - c
            before = idle_cpu()
            print(shorten_blas_spin(), before, idle_cpu())
        """)
        if applied != "True":
            pytest.skip("numpy's BLAS is not an OpenBLAS with a pthreads server")
        if float(before) > 0.05:  # OpenBLAS's idle thread spun through most of the 0.3 s
            break
    else:  # (another test process kept the spinning thread off its core each time: no spin to shorten)
        pytest.skip(f"OpenBLAS's idle spin did not show here (last {float(before):.3f} s of CPU in 0.3 s)")
    assert float(after) < 0.03


def test_the_blas_spin_waits_while_other_python_threads_run() -> None:
    waiting, later = _python("""
        import threading
        from onnxtrain.engine import blas
        stop = threading.Event()
        other = threading.Thread(target=stop.wait)  # a user's thread: it might be inside a GEMM
        other.start()
        first = blas.shorten_blas_spin(), list(blas._done)
        stop.set()
        other.join()
        print(first == (False, []), blas.shorten_blas_spin() == bool(blas._done[0]))
    """)
    assert waiting == "True" and later == "True"


def test_the_blas_spin_is_shortened_when_a_kernel_first_splits() -> None:
    small, split, timeout = _python("""
        import os, numpy as np
        from onnxtrain.engine import blas, parallel
        with parallel.running_with(2):
            parallel.parallel_for(1, lambda i: None)  # one part: runs here, nothing splits
            small = list(blas._done)
            parallel.parallel_for(2, lambda i: None)
        print(small, blas._done, os.environ.get("OPENBLAS_THREAD_TIMEOUT"))
    """)
    assert small == "[]" and split in ("[True]", "[False]")
    assert timeout == (str(blas.SPIN_LOG2) if split == "[True]" else "None")


def test_split_parts_keep_the_callers_numpy_error_state(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 0)
    nodes = [helper.make_node("Log", ["x"], ["l"]), helper.make_node("Div", ["l", "x"], ["y"])]
    plan = Plan(model(nodes, ["x"], ["y"]), threads=2)
    x = np.zeros(1 << 22, np.float32)  # log(0) / 0 everywhere, which the engine runs quietly; parts of
    # milliseconds each, so the worker takes one
    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        for _ in range(2):  # the tracing run, then the split one
            y = plan.run({"x": x})[0]
    assert np.isneginf(y).all()


def _attention_model() -> onnx.ModelProto:
    """Attention's kernels: batched MatMuls, Softmax (which splits by rows) and LayerNormalization."""
    nodes = [
        helper.make_node("MatMul", ["q", "k"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "v"], ["o"]),
        helper.make_node("LayerNormalization", ["o", "gamma", "beta"], ["y", "mean", "inv"], axis=-1),
    ]
    return model(nodes, ["q", "k", "v", "gamma", "beta"], ["s", "p", "o", "y", "mean", "inv"])


@pytest.mark.parametrize("scale", [1.0, 40.0])  # softmax without and with the shift by the row maximum
def test_softmax_split_by_rows_gives_the_same_bits(monkeypatch, scale: float) -> None:
    monkeypatch.setattr(parallel, "MIN_ROWS_WORK", 16)
    calls: list[int] = []
    real = parallel.parallel_for

    def counting(n: int, fn) -> None:
        calls.append(n)
        real(n, fn)

    monkeypatch.setattr(parallel, "parallel_for", counting)  # for_rows calls it from its module
    rng = np.random.default_rng(5)
    feeds = {
        "q": (scale * rng.standard_normal((3, 2, 7, 5))).astype(np.float32),
        "k": rng.standard_normal((2, 5, 7)).astype(np.float32),
        "v": rng.standard_normal((3, 2, 7, 6)).astype(np.float32),
        "gamma": rng.standard_normal(6).astype(np.float32),
        "beta": rng.standard_normal(6).astype(np.float32),
    }
    serial = Plan(_attention_model(), threads=1).run(feeds)
    assert not calls
    split = Plan(_attention_model(), threads=2).run(feeds)
    assert calls == [2]  # Softmax's 42 rows in two parts; the others did not pay when measured
    for a, b in zip(serial, split):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    ref = ReferenceEvaluator(_attention_model()).run(None, feeds)
    for a, b in zip(split, ref):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def test_mpi_ranks_on_one_host_share_its_cpus(monkeypatch) -> None:
    monkeypatch.delenv("ONNXTRAIN_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.delenv("MPI_LOCALNRANKS", raising=False)
    assert parallel.default_width() == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "3")
    assert parallel.default_width() == 2
    monkeypatch.setenv("MPI_LOCALNRANKS", "16")
    assert parallel.default_width() == 1


def test_a_forked_child_splits_with_workers_of_its_own() -> None:
    (out,) = _python("""
        import os
        import numpy as np
        from onnxtrain.engine import parallel
        with parallel.running_with(2):
            parallel.parallel_for(2, lambda i: None)  # the parent's worker exists now
            pid = os.fork()
            if pid == 0:
                seen = []
                parallel.parallel_for(4, seen.append)
                os._exit(0 if sorted(seen) == [0, 1, 2, 3] and parallel._workers.count == 1 else 3)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status))
    """)
    assert out == "0"


def test_plans_run_from_several_threads_at_once_split_correctly(monkeypatch) -> None:
    from onnxtrain.engine.fusion import blocked as fusion

    monkeypatch.setattr(fusion, "PAR_MIN_WORK", 0)
    monkeypatch.setattr(fusion, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fusion, "BLOCK_BYTES", 8192)
    rng = np.random.default_rng(9)
    feeds = [
        {"h": (3 * rng.standard_normal((64, 300))).astype(np.float32),
         "bias": rng.standard_normal(300).astype(np.float32)}
        for _ in range(4)
    ]
    want = [Plan(_gelu_model(), fuse=False).run(f)[0] for f in feeds]
    shared, own = Plan(_gelu_model(), threads=2), [Plan(_gelu_model(), threads=2) for _ in feeds]
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            for _ in range(20):  # the shared plan's pool is busy at times: those runs take the plain steps
                for plan in (shared, own[i]):
                    np.testing.assert_array_equal(plan.run(feeds[i])[0], want[i])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_softmax_cross_entropy_split_by_rows_gives_the_same_bits(monkeypatch, reduction: str) -> None:
    monkeypatch.setattr(parallel, "MIN_ROWS_WORK", 16)
    calls: list[int] = []
    real = parallel.parallel_for
    monkeypatch.setattr(parallel, "parallel_for", lambda n, fn: (calls.append(n), real(n, fn)))
    node = helper.make_node("SoftmaxCrossEntropyLoss", ["x", "y"], ["loss", "logp"], reduction=reduction,
                            ignore_index=-100)  # as torch exports it
    f = TensorProto.FLOAT
    graph = helper.make_graph(
        [node], "sce",
        [helper.make_tensor_value_info("x", f, [45, 300]),
         helper.make_tensor_value_info("y", TensorProto.INT64, [45])],
        [helper.make_tensor_value_info("loss", f, [] if reduction == "mean" else [45]),
         helper.make_tensor_value_info("logp", f, [45, 300])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(m, full_check=True)
    rng = np.random.default_rng(8)
    feeds = {"x": (4 * rng.standard_normal((45, 300))).astype(np.float32),
             "y": rng.integers(0, 300, 45).astype(np.int64)}
    serial = Plan(m, threads=1).run(feeds)
    assert not calls
    split = Plan(m, threads=2).run(feeds)
    assert calls == [2]  # the rows in two parts
    for a, b in zip(serial, split):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    for a, b in zip(split, ReferenceEvaluator(m).run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_large_transcendental_ops_split_over_threads_with_the_same_bits(monkeypatch) -> None:
    """Exp and Log of 300,000 values run in two parts (Log quiet on its zeros and negatives in both parts);
    a small input stays in one piece."""
    from onnxtrain.engine.kernels import elementwise

    monkeypatch.setattr(elementwise, "SPLIT_MIN", 1 << 16)  # the test's sizes, not the measured threshold
    calls: list[int] = []
    real = parallel.parallel_for
    monkeypatch.setattr(parallel, "parallel_for", lambda n, fn: (calls.append(n), real(n, fn)))
    nodes = [helper.make_node("Exp", ["x"], ["e"]), helper.make_node("Log", ["x"], ["l"])]
    m = model(nodes, ["x"], ["e", "l"])
    rng = np.random.default_rng(9)
    x = (4 * rng.standard_normal((600, 500))).astype(np.float32)
    x[0, :3] = [0.0, -1.0, np.inf]
    serial = Plan(m, threads=1, fuse=False).run({"x": x})
    assert not calls
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # log(0) and log(-1) stay quiet in the worker's part too
        split = Plan(m, threads=2, fuse=False).run({"x": x})
    assert calls == [2, 2]
    for a, b in zip(serial, split):
        np.testing.assert_array_equal(a, b)
    with np.errstate(all="ignore"):  # the reference's log(0) and log(-1)
        ref = ReferenceEvaluator(m).run(None, {"x": x})
    np.testing.assert_allclose(split[0], ref[0], rtol=1e-6)
    np.testing.assert_allclose(split[1], ref[1], rtol=1e-6)
    calls.clear()
    Plan(m, threads=2, fuse=False).run({"x": x[:100]})
    assert not calls

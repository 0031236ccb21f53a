"""Donated feeds: a blocked elementwise step writes its outputs into inputs the caller gave up, only when
nothing reads their old contents afterwards, and with the same bits as into fresh arrays."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper
from onnx.reference import ReferenceEvaluator

import onnxtrain.engine.fusion.blocked as fe
from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.engine.parallel import running_with
from onnxtrain.engine.plan import Plan
from tests.engine.graphs import model, on_device_mlp
from tests.session.helpers import batches, mlp_model

N = 50_000


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch) -> None:
    """Block every cluster, in slices of a few thousand elements (so several blocks run in order)."""
    monkeypatch.setattr(fe, "BLOCK_MIN_BYTES", 0)
    monkeypatch.setattr(fe, "BLOCK_BYTES", 1 << 16)


def momentum_model(extra_nodes=(), extra_outputs=()):
    """M' = 0.9·M + 0.1·G,  W' = W − 0.01·M' (one cluster)."""
    consts = (("a", 0.9), ("b", 0.1), ("lr", 0.01))
    c = [helper.make_node("Constant", [], [n], value_float=v) for n, v in consts]
    nodes = c + [
        helper.make_node("Mul", ["M", "a"], ["ma"]),
        helper.make_node("Mul", ["G", "b"], ["gb"]),
        helper.make_node("Add", ["ma", "gb"], ["M_new"]),
        helper.make_node("Mul", ["M_new", "lr"], ["step"]),
        helper.make_node("Sub", ["W", "step"], ["W_new"]),
        *extra_nodes,
    ]
    return model(nodes, ["W", "M", "G"], ["W_new", "M_new", *extra_outputs])


def feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(N).astype(np.float32) for k in ("W", "M", "G")}


def reference(m, f) -> list[np.ndarray]:
    return ReferenceEvaluator(m).run(None, f)


def test_donated_inputs_take_the_outputs_with_the_same_bits() -> None:
    m = momentum_model()
    plan = Plan(m)
    f = feeds()
    want = [a.copy() for a in plan.run({k: v.copy() for k, v in f.items()})]
    for a, r in zip(want, reference(m, f)):
        np.testing.assert_array_equal(a, r)
    given = {k: v.copy() for k, v in f.items()}
    w_new, m_new = plan.run(given, donate=["W", "M"])
    assert w_new is given["W"] and m_new is given["M"]  # written into the donated arrays
    np.testing.assert_array_equal(w_new, want[0])
    np.testing.assert_array_equal(m_new, want[1])
    np.testing.assert_array_equal(given["G"], f["G"])  # not donated: untouched
    # without donation the feeds stay as they were
    kept = {k: v.copy() for k, v in f.items()}
    out = plan.run(kept)
    assert not any(np.shares_memory(o, v) for o in out for v in kept.values())
    for k in kept:
        np.testing.assert_array_equal(kept[k], f[k])


def test_split_over_threads_with_donation(monkeypatch) -> None:
    monkeypatch.setattr(fe, "PAR_MIN_WORK", 0)
    plan = Plan(momentum_model(), threads=2)
    f = feeds(1)
    want = reference(momentum_model(), f)
    given = {k: v.copy() for k, v in f.items()}
    with running_with(2):
        plan.run(feeds(9))  # the first run traces the cluster, with the original kernels
        out = plan.run(given, donate=["W", "M"])
    assert out[0] is given["W"]
    for a, r in zip(out, want):
        np.testing.assert_array_equal(a, r)


@pytest.mark.parametrize(
    "extra_nodes, extra_outputs",
    [
        ([helper.make_node("Identity", ["W"], ["W_old"])], ["W_old"]),  # a view of W is a graph output
        ([helper.make_node("Constant", [], ["shape"], value_ints=[N // 2, 2]),
          helper.make_node("Reshape", ["W", "shape"], ["W2"]), helper.make_node("ReduceSum", ["W2"], ["s"])],
         ["s"]),  # read after the update
    ],
)
def test_an_input_read_after_the_update_is_not_overwritten(extra_nodes, extra_outputs) -> None:
    m = momentum_model(extra_nodes, extra_outputs)
    plan = Plan(m)
    f = feeds(2)
    want = reference(m, f)
    plan.run(feeds(9))
    given = {k: v.copy() for k, v in f.items()}
    out = plan.run(given, donate=["W", "M"])
    assert not np.shares_memory(out[0], given["W"])
    np.testing.assert_array_equal(given["W"], f["W"])
    assert out[1] is given["M"]  # M is still free to take
    for a, r in zip(out, want):
        np.testing.assert_allclose(a, r, rtol=1e-5)


def test_an_input_read_after_an_output_is_written_is_not_taken_by_that_output() -> None:
    """Y1 = 2·X is written before X + Y1 reads X again: Y1 must not go into X's memory; Y2 may."""
    two = helper.make_node("Constant", [], ["two"], value_float=2.0)
    nodes = [two, helper.make_node("Mul", ["X", "two"], ["Y1"]), helper.make_node("Add", ["X", "Y1"], ["Y2"])]
    m = model(nodes, ["X"], ["Y1", "Y2"])
    x = np.random.default_rng(3).standard_normal(N).astype(np.float32)
    given = {"X": x.copy()}
    plan = Plan(m)
    plan.run({"X": x.copy()})
    y1, y2 = plan.run(given, donate=["X"])
    assert y2 is given["X"] and not np.shares_memory(y1, given["X"])
    np.testing.assert_array_equal(y1, x * np.float32(2))
    np.testing.assert_array_equal(y2, x + x * np.float32(2))


def test_arrays_the_caller_may_still_see_are_never_taken() -> None:
    plan = Plan(momentum_model())
    plan.run(feeds(9))
    f = feeds(4)
    want = reference(momentum_model(), f)
    same = f["W"].copy()
    cases = [
        {"W": same, "M": same, "G": f["G"]},  # one array under two names
        {"W": f["W"][::-1].copy()[::-1], "M": f["M"].copy(), "G": f["G"]},  # not C-contiguous
        {"W": np.concatenate([f["W"], f["W"]])[:N], "M": f["M"].copy(), "G": f["G"]},  # a view
    ]
    ro = f["W"].copy()
    ro.flags.writeable = False
    cases.append({"W": ro, "M": f["M"].copy(), "G": f["G"]})
    for given in cases:
        before = {k: v.copy() for k, v in given.items()}
        out = plan.run(given, donate=["W"])
        assert not np.shares_memory(out[0], given["W"])
        np.testing.assert_array_equal(given["W"], before["W"])
    np.testing.assert_array_equal(plan.run(cases[-1])[0], want[0])


def test_an_override_of_a_donated_feed_is_not_overwritten() -> None:
    plan = Plan(momentum_model())
    plan.run(feeds(9))
    f = feeds(6)
    given = {k: v.copy() for k, v in f.items()}
    override = {"W": f["W"].copy()}
    out = plan.run(given, donate=["W", "M"], overrides=override)
    np.testing.assert_array_equal(override["W"], f["W"])
    np.testing.assert_array_equal(out[0], reference(momentum_model(), f)[0])
    assert out[1] is given["M"]


def test_donating_a_name_that_is_not_fed_is_an_error() -> None:
    with pytest.raises(ValueError, match="'V'"):
        Plan(momentum_model()).run(feeds(), donate=["V"])


@pytest.mark.parametrize(
    "opt, extra",
    [
        ("AdamOptimizer", {}),
        ("AdamOptimizer", {"gradient_accumulation_steps": 2}),  # micro-steps, then updates in place
        ("AdamOptimizer", {"use_mixed_precision": True}),  # a step with non-finite gradients changes nothing
    ],
)
@pytest.mark.filterwarnings("error::RuntimeWarning")  # the mixed-precision overflow is silent
def test_training_session_with_donation_matches_one_without(opt: str, extra: dict) -> None:
    def session() -> TrainingSession:
        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = opt
        for k, v in extra.items():
            setattr(p, k, v)
        return TrainingSession(mlp_model(din=8, dh=300, dout=4).SerializeToString(), p)

    donating, plain = session(), session()
    for sess in (donating, plain):
        sess._get_plan("full")
        if "gradient_accumulation_steps" in extra:
            sess._get_plan("accumulate")
    for p in plain._plans.values():
        p._reusable = frozenset()
    mixed = extra.get("use_mixed_precision")
    full = donating._plans["full"]
    # the update may take the weights and moments, except with loss scaling, where a skipped step
    # selects the old values after computing the new ones
    assert (full.slot["W1"] in full._reusable) != bool(mixed)
    feeds = {"Learning_Rate": np.array([0.01], np.float32)}
    held = snapshot = None
    for i, (x, y) in enumerate(batches(7, 16)):
        if mixed:  # step 4 overflows: its update is skipped
            feeds["loss_scale"] = np.array([2.0**40 if i == 4 else 128.0], np.float32)
        before = donating.get_state()
        a = donating.run(["loss"], {"x": x, "y": y, **feeds})[0]
        b = plain.run(["loss"], {"x": x, "y": y, **feeds})[0]
        assert a == b
        if mixed and i == 4:
            after = donating.get_state()
            assert all(np.array_equal(before[k], after[k]) for k in before)
        if i == 1:  # the first runs traced the clusters; from then on, updates go in place
            held, snapshot = donating._store["W1"], donating.get_state()
    assert (donating._store["W1"] is held) != bool(mixed)
    sa, sb = donating.get_state(), plain.get_state()
    for k in sa:
        np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
    assert not np.array_equal(snapshot["W1"], sa["W1"])  # get_state() gave a copy: it kept its values
    assert not np.shares_memory(snapshot["W1"], held)


def test_on_device_weights_keep_their_arrays_across_steps(tmp_path) -> None:
    """Parameter.data aliases the live weights (as onnxruntime's): an array taken before the optimizer steps
    holds the trained values after them, whether the update went in place (large weights) or was copied."""
    state, module, opt = on_device_mlp(tmp_path)()
    held = {n: state.parameters[n].data for n in ("W1", "b1", "W2")}
    first = {n: a.copy() for n, a in held.items()}
    for x, y in batches(3, 16):
        module(x, y.astype(np.int64))
        opt.step()
        module.lazy_reset_grad()
    for n, a in held.items():
        assert state.parameters[n].data is a, n
        assert not np.array_equal(a, first[n]), n  # trained, in the array taken before


def test_the_onnxruntime_backend_takes_donate_and_keeps_the_feeds() -> None:
    pytest.importorskip("onnxruntime")
    from onnxtrain.engine.backends import make_plan

    plan = make_plan(momentum_model(), "onnxruntime")
    f = feeds(5)
    given = {k: v.copy() for k, v in f.items()}
    out = plan.run(given, donate=["W", "M"])
    for a, r in zip(out, reference(momentum_model(), f)):
        np.testing.assert_allclose(a, r, rtol=1e-6)
    for k in f:
        np.testing.assert_array_equal(given[k], f[k])  # onnxruntime writes its own outputs
    with pytest.raises(ValueError, match="'V'"):
        plan.run(given, donate=["V"])


def test_an_update_splits_over_threads_from_a_lower_threshold(monkeypatch) -> None:
    """A segment that may write into donated inputs (an optimizer update) splits from UPDATE_PAR_MIN_WORK,
    any other from PAR_MIN_WORK; both give the reference's bits."""
    work = N * 4  # elements × ufuncs of the momentum update, about
    monkeypatch.setattr(fe, "UPDATE_PAR_MIN_WORK", work // 2)
    monkeypatch.setattr(fe, "PAR_MIN_WORK", work * 4)
    monkeypatch.setattr(fe, "BLOCK_MIN_BYTES", 0)  # blocked, so that the cluster runs as segments

    def split_of(plan: Plan) -> bool:
        (prog,) = [p for p in plan.steps[-1].fn.programs.values() if p[5] is not None]
        return any(seg.par for seg in prog[5].segments)

    f = feeds(3)
    want = reference(momentum_model(), f)
    # the update itself: W and M are graph inputs it may write into
    update = Plan(momentum_model(), threads=2)
    # the same arithmetic on values another step made (a Transpose of each input): nothing to donate
    m = momentum_model()
    for node in m.graph.node:
        names = [f"{n}_t" if n in ("W", "M", "G") else n for n in node.input]
        del node.input[:]
        node.input.extend(names)
    nodes = [helper.make_node("Transpose", [n], [f"{n}_t"]) for n in ("W", "M", "G")] + list(m.graph.node)
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    other = Plan(m, threads=2)
    assert [st.node.op_type for st in other.steps][-1] == "FusedElementwise"
    with running_with(2):
        for plan, split in ((update, True), (other, False)):
            plan.run(feeds(9))  # the first run traces the cluster
            out = plan.run({k: v.copy() for k, v in f.items()}, donate=["W", "M"])
            assert split_of(plan) == split
            for a, r in zip(out, want):
                np.testing.assert_array_equal(a, r)


def test_peak_counts_an_update_written_into_its_donated_inputs_once() -> None:
    """The new W and M written into the donated W and M are not new memory: the run's peak is the feeds'
    bytes; into fresh arrays it is the feeds' and the two results' (the folded constants aside)."""
    plan = Plan(momentum_model())
    rng = np.random.default_rng(5)
    feeds = {k: rng.standard_normal(N).astype(np.float32) for k in ("W", "M", "G")}
    plan.run({k: v.copy() for k, v in feeds.items()})  # the first run traces the cluster
    for donate, arrays in ((["W", "M"], 3), ([], 5), (["W", "M"], 3)):
        fresh = {k: v.copy() for k, v in feeds.items()}
        w_new, _ = plan.run(fresh, donate=donate)
        assert np.shares_memory(w_new, fresh["W"]) == bool(donate)
        assert 0 <= plan.peak_bytes - plan.scratch.nbytes - arrays * N * 4 < 64


def test_an_update_with_no_need_of_blocks_or_threads_still_writes_into_donated_inputs(monkeypatch) -> None:
    """Small weights (a transformer's biases and norms): the cluster runs its whole-array program when
    nothing is donated, and a blocked program of its own, writing into the arrays, when the run donates."""
    monkeypatch.setattr(fe, "BLOCK_MIN_BYTES", 1 << 40)  # no segment needs blocks
    monkeypatch.setattr(fe, "PAR_MIN_WORK", 1 << 40)
    monkeypatch.setattr(fe, "UPDATE_PAR_MIN_WORK", 1 << 40)  # nor threads
    monkeypatch.setattr(fe, "DONATE_MIN", N)  # the model's 50,000 values are enough
    m = momentum_model()
    plan = Plan(m, threads=2)
    f = feeds(7)
    want = reference(m, f)
    kept = {k: v.copy() for k, v in f.items()}
    out = plan.run(kept)
    assert not any(np.shares_memory(o, v) for o in out for v in kept.values())
    (prog,) = plan.steps[-1].fn.programs.values()
    assert prog[5] is None and prog[6] is not None and prog[6].for_donation
    for _ in range(2):
        given = {k: v.copy() for k, v in f.items()}
        w_new, m_new = plan.run(given, donate=["W", "M"])
        assert w_new is given["W"] and m_new is given["M"]
        np.testing.assert_array_equal(w_new, want[0])
        np.testing.assert_array_equal(m_new, want[1])
        np.testing.assert_array_equal(given["G"], f["G"])
    for o, r in zip(plan.run(kept), want):  # and without donation again: new arrays, the same bits
        np.testing.assert_array_equal(o, r)
    for k in kept:
        np.testing.assert_array_equal(kept[k], f[k])
    # below DONATE_MIN values the whole-array program runs, donation or not
    monkeypatch.setattr(fe, "DONATE_MIN", N + 1)
    small = Plan(m, threads=2)
    given = {k: v.copy() for k, v in f.items()}
    w_new, _ = small.run(given, donate=["W", "M"])
    (prog,) = small.steps[-1].fn.programs.values()
    assert prog[5] is None and prog[6] is None and w_new is not given["W"]
    np.testing.assert_array_equal(w_new, want[0])


def test_which_donated_feeds_a_run_may_overwrite() -> None:
    """donatable / donated_slots keep a donated array only when it is a writeable, C-contiguous array owning
    its memory, fed once, and no other feed is a view of it; in the order of ``donate``; a missing name is a
    ValueError naming every missing one."""
    from onnxtrain.engine.donation import donatable, donated_slots

    rng = np.random.default_rng(0)
    a, b, c, d, e = (rng.standard_normal(6).astype(np.float32) for _ in range(5))
    ro = rng.standard_normal(6).astype(np.float32)
    ro.flags.writeable = False
    feeds = {"a": a, "b": b, "b2": b, "c": c, "cv": c[1:], "d": d, "e": e, "ro": ro, "v": d[::2],
             "f": np.asfortranarray(np.ones((3, 2))), "s": np.float32(2), "n": 3}
    donate = ["e", "a", "b", "c", "f", "ro", "v", "s", "n", "a"]
    got = donatable(feeds, donate)
    assert list(got) == ["e", "a"] and got["e"] is e and got["a"] is a
    assert donatable(feeds, ["d"]) == {}  # the base of another feed (v)
    assert donatable({"d": d}, ["d"])["d"] is d
    assert donatable(feeds, ["b2"]) == {}  # one array under two names, either donated

    class _Plan:
        slot = {n: i for i, n in enumerate(feeds)}

    slots = donated_slots(_Plan, feeds, donate)
    assert list(slots) == [_Plan.slot["e"], 0] and slots[_Plan.slot["e"]] is e and slots[0] is a
    with pytest.raises(ValueError, match=r"\['x', 'y'\]"):
        donated_slots(_Plan, feeds, ["a", "x", "y"])

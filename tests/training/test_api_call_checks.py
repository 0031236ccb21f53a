"""The per-call checks of ``Module.__call__`` after their facts were derived once at build time.

An input spec decides from facts taken when it is made (a declared dtype, the fixed dims) whether a plain
row-major array can pass as it is; anything else (another dtype, shape, rank, layout or kind of value) goes
through the full check. A Module called with a good batch, then bad ones, then good ones again must raise
each time with the message it always gave, and train as torch does. The mismatch check of symbolic dims runs
only where inputs that share a dim name (``feed_sizes.shared_dim_slots``) were fed different sizes of it.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest

from onnxtrain.capi.ortvalue import OrtValue
from onnxtrain.engine.feed_sizes import shared_dim_slots as shared_dims
from onnxtrain.engine.feed_sizes import sizes_agree as _sizes_agree
from onnxtrain.errors import InvalidFeed, InvalidFeedType
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from onnxtrain.training.api._graph import InputSpec

torch = pytest.importorskip("torch")

F32 = np.dtype(np.float32)


def _artifacts(folder: str, dynamic: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    path = os.path.join(folder, "mlp.onnx")
    axes = {"input": {0: "batch"}, "output": {0: "batch"}} if dynamic else None
    torch.onnx.export(net, torch.randn(2, 4), path, input_names=["input"], output_names=["output"],
                      dynamic_axes=axes, dynamo=False, opset_version=17)
    model = onnx.load(path)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, artifact_directory=folder)
    return net


@pytest.fixture(scope="module", params=[False, True], ids=["static", "batch"])
def setup(request, tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("calls"))
    return folder, _artifacts(folder, request.param), request.param


def _module(folder: str) -> Module:
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    return Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))


def _torch_loss(net: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        out = net(torch.tensor(x))
        return float(torch.nn.functional.mse_loss(out, torch.tensor(np.asarray(y, np.float32))))


def test_changed_inputs_between_calls_raise_as_before(setup):
    """One Module's calls: good, then another dtype, a wrong fixed dim, a wrong rank (input and target),
    then good ones in other layouts and kinds; the errors keep their messages, the losses are torch's."""
    folder, net, dynamic = setup
    m = _module(folder)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    y = rng.standard_normal((2, 3)).astype(np.float32)
    for mode in (m.train, m.eval):
        mode()
        first = float(m(x, y))
        assert first == pytest.approx(_torch_loss(net, x, y), rel=1e-6)
        with pytest.raises(InvalidFeedType) as e:
            m(x.astype(np.float64), y)
        assert str(e.value) == ("input 'input': unexpected data type. Actual: float64, expected: float32")
        with pytest.raises(InvalidFeedType) as e:
            m(x, y.astype(np.float16))
        assert str(e.value) == ("input 'target': unexpected data type. Actual: float16, expected: float32")
        with pytest.raises(InvalidFeed) as e:
            m(np.zeros((2, 5), np.float32), y)
        batch = "batch" if dynamic else "2"
        assert str(e.value) == ("input 'input': invalid dimension at index 1. Got: 5, Expected: 4 (shape "
                                f"(2, 5), expected [{batch}, 4])")
        with pytest.raises(InvalidFeed) as e:
            m(x.reshape(8), y)
        assert str(e.value) == ("input 'input': invalid rank. Got: 1 (shape (8,)), Expected: 2 "
                                f"([{batch}, 4])")
        with pytest.raises(InvalidFeed) as e:
            m(x, y[:, :, None])
        assert str(e.value).startswith("input 'target': invalid rank. Got: 3 (shape (2, 3, 1)), Expected: 2")
        if not dynamic:
            with pytest.raises(InvalidFeed) as e:
                m(np.zeros((3, 4), np.float32), np.zeros((3, 3), np.float32))
            assert str(e.value) == ("input 'input': invalid dimension at index 0. Got: 3, Expected: 2 "
                                    "(shape (3, 4), expected [2, 4])")
        # the same values in a Fortran-ordered array, a strided view, a list and a matrix: the same loss
        fortran = np.asfortranarray(x)
        strided = np.repeat(x, 2, axis=1)[:, ::2]
        assert not fortran.flags.c_contiguous and not strided.flags.c_contiguous
        for value in (fortran, strided, x.tolist(), np.asmatrix(x)):
            assert float(m(value, y)) == first  # (no step between the calls: the same weights)
        if dynamic:  # another batch size of the symbolic dim
            x5 = rng.standard_normal((5, 4)).astype(np.float32)
            y5 = rng.standard_normal((5, 3)).astype(np.float32)
            assert float(m(x5, y5)) == pytest.approx(_torch_loss(net, x5, y5), rel=1e-6)


def test_training_losses_unchanged_by_interleaved_bad_calls(setup):
    """Bad calls between steps change nothing: the losses of a run with them equal those of one without."""
    folder, _, _ = setup
    rng = np.random.default_rng(2)
    f32 = np.float32
    batches = [(rng.standard_normal((2, 4)).astype(f32), rng.standard_normal((2, 3)).astype(f32))
               for _ in range(4)]
    plain, mixed = _module(folder), _module(folder)
    got_plain, got_mixed = [], []
    for x, y in batches:
        got_plain.append(float(plain(x, y)))
        with pytest.raises(InvalidFeedType):
            mixed(x.astype(np.int32), y)
        got_mixed.append(float(mixed(x, y)))
        with pytest.raises(InvalidFeed):
            mixed(x[:, :3].copy(), y)
    assert got_plain == got_mixed


def test_spec_quick_check_returns_plain_arrays_as_they_are():
    spec = InputSpec("x", F32, ("batch", 3))
    a = np.ones((5, 3), np.float32)
    assert spec.check(a) is a
    f = np.asfortranarray(np.ones((2, 3), np.float32))
    got = spec.check(f)
    assert got is not f and got.flags.c_contiguous and np.array_equal(got, f)
    with pytest.raises(InvalidFeed, match=r"invalid dimension at index 1. Got: 4, Expected: 3"):
        spec.check(np.ones((5, 4), np.float32))
    with pytest.raises(InvalidFeedType, match="Actual: float64, expected: float32"):
        spec.check(np.ones((5, 3)))
    assert spec.check(np.ones((5, 3), np.float32).view(np.ndarray)) is not None
    assert type(spec.check(np.ones((5, 3), np.float32).view(np.ma.MaskedArray))) is np.ndarray
    o = OrtValue.ortvalue_from_numpy(a)
    assert np.array_equal(spec.check(o), a)
    # no declared dtype, any shape, a string input: the full check (a list of str becomes objects)
    free = InputSpec("x", None, None)
    assert free.check(a) is a
    assert InputSpec("x", F32, None).check(a[0]) is not None
    s = InputSpec("s", np.dtype(object), (2,))
    assert s.check(np.array(["a", "b"])).dtype == np.dtype(object)
    # the derived facts do not take part in equality
    assert InputSpec("x", F32, ("batch", 3)) == spec
    assert InputSpec("x", F32, (2, 3)) != spec


def test_shared_dims_and_their_sizes():
    def specs(*shapes):
        return [InputSpec(f"i{k}", F32, s) for k, s in enumerate(shapes)]

    assert shared_dims(specs(("batch", 4), ("batch", 3))) == [[("i0", 0), ("i1", 0)]]
    assert shared_dims(specs(("n", "n"))) == [[("i0", 0), ("i0", 1)]]
    assert shared_dims(specs(("batch", 4), ("rows", 3))) == []
    assert shared_dims(specs((2, 4), (2, 3))) == []
    assert shared_dims(specs(("", 4), ("", 3), None)) == []
    assert shared_dims(specs(None, ("batch", None))) == []
    shared = shared_dims(specs(("b", "s", 4), ("b",), ("s", "b")))
    assert shared == [[("i0", 0), ("i1", 0), ("i2", 1)], [("i0", 1), ("i2", 0)]]
    feeds = {"i0": np.zeros((2, 3, 4)), "i1": np.zeros(2), "i2": np.zeros((3, 2))}
    assert _sizes_agree(shared, feeds)
    assert not _sizes_agree(shared, {**feeds, "i1": np.zeros(5)})
    assert not _sizes_agree(shared, {**feeds, "i2": np.zeros((2, 3))})
    assert not _sizes_agree(shared, {**feeds, "i2": np.zeros(3)})  # (no axis 1: the full check decides)
    assert not _sizes_agree(shared, {"i0": feeds["i0"], "i1": feeds["i1"]})


def test_agreeing_batches_do_not_warn(setup, recwarn):
    folder, _, dynamic = setup
    m = _module(folder)
    if dynamic:
        assert m._train_shared_dims == [[("input", 0), ("target", 0)]]
    for n in (2, 5, 1) if dynamic else (2,):
        m(np.ones((n, 4), np.float32), np.zeros((n, 3), np.float32))
    assert not [w for w in recwarn if "share dimension" in str(w.message)]


def test_mixed_ortvalue_and_array_inputs(setup):
    """Outputs are OrtValues only when every input is one of one class; arrays otherwise."""
    folder, _, _ = setup
    m = _module(folder)
    m.eval()
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    assert type(m(x, OrtValue.ortvalue_from_numpy(y))) is np.ndarray
    assert type(m(OrtValue.ortvalue_from_numpy(x), y)) is np.ndarray
    assert isinstance(m(OrtValue.ortvalue_from_numpy(x), OrtValue.ortvalue_from_numpy(y)), OrtValue)


def test_unshared_copies_the_state_arrays_and_their_views_only():
    """``_unshared``: an output that is a parameter's value or gradient array, or a view of one, becomes a
    copy; an array of its own is kept as it is (so is a non-array)."""
    from onnxtrain.training.api.checkpoint_state import _Param
    from onnxtrain.training.api.module import _unshared

    params = [_Param("a", F32, True, np.ones((2, 3), np.float32), np.full((2, 3), 2, np.float32)),
              _Param("b", F32, False, np.zeros(4, np.float32))]
    fresh = np.full(3, 7, np.float32)
    outs = [params[0].data, fresh, params[0].grad[1], params[1].data, params[0].grad, "text"]
    got = _unshared(list(outs), params)
    assert got[1] is fresh and got[5] == "text"
    for k in (0, 2, 3, 4):
        assert got[k] is not outs[k] and np.array_equal(got[k], outs[k]), k
        assert not any(np.shares_memory(got[k], a) for p in params for a in (p.data, p.grad) if a is not None)
    assert _unshared([fresh], []) == [fresh] and _unshared([], params) == []


def test_an_identity_of_a_weight_is_an_array_of_its_own(tmp_path):
    """A model whose extra output is Identity(P): in training and eval mode not P's array, nor changed by the
    next update."""
    from onnx import helper

    from onnxtrain.training.api import Optimizer
    from tests.training.test_module_outputs_unshared import _model_of
    from tests.training.test_module_outputs_unshared import _module as module_of

    nodes = [helper.make_node("Gemm", ["x", "P"], ["logits"], transB=1),
             helper.make_node("Identity", ["P"], ["same"])]
    state, module = module_of(_model_of(nodes, ["N", 4], {"logits": ["N", 3], "same": [3, 4]}), tmp_path,
                              ["same"])
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.5)
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    before = state.parameters["P"].data.copy()
    same = module(x, y)[1]
    module.eval()
    eval_same = module(x, y)[1]
    opt.step()
    after = state.parameters["P"].data
    assert not np.array_equal(after, before)
    for out in (same, eval_same):
        assert not np.shares_memory(out, after)
        np.testing.assert_array_equal(out, before)

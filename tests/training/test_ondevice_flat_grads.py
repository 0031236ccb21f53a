"""On the onnxruntime backend the on-device Optimizer's flat update reads the gradients where onnxruntime
wrote them: ``Parameter.grad`` is a view of the flat gradient buffer, bound as the training run's output
(onnxtrain/training/api/flat_update.py, ``grads_in_place``). Oracles: torch autograd for the gradients, and
the same run with the gradients gathered into the buffer each step (the copying update) for the bits."""

from __future__ import annotations

import os

import numpy as np
import pytest

from onnxtrain import SessionOptions
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.api.checkpoint_state import _Param, replace_grads

torch = pytest.importorskip("torch")

from tests.training.torch_mlp import export_mlp  # noqa: E402

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    root = tmp_path_factory.mktemp("flat_grads")
    _, model, net = export_mlp(root)
    folder = str(root / "artifacts")
    os.makedirs(folder)
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=artifacts.LossType.MSELoss,
                                 optimizer=onnxblock.optim.AdamW(), artifact_directory=folder)
    return folder, net


def _batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(40 + i)
    return rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32)


def _torch_grads(net, weights: dict[str, np.ndarray], batches: list[int]) -> dict[str, np.ndarray]:
    """torch's gradients of the MSE loss at ``weights``, summed over ``batches`` (an accumulation)."""
    with torch.no_grad():
        for n, p in net.named_parameters():
            p.copy_(torch.from_numpy(weights[n]))
    net.zero_grad()
    for i in batches:
        x, y = _batch(i)
        torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    return {n: p.grad.numpy().copy() for n, p in net.named_parameters()}


def _open(folder: str, in_place: bool) -> tuple[CheckpointState, Module, Optimizer]:
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state, session_options=so)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    assert opt._flat is not None and opt._flat.grads_in_place  # the backend's default
    opt._flat.grads_in_place = in_place  # False: the copying update (gathered each step)
    return state, module, opt


def test_gradients_are_written_into_the_flat_buffer(mlp) -> None:
    folder, net = mlp
    runs = {k: _open(folder, k == "in_place") for k in ("in_place", "copying")}
    # calls (batches) between optimizer steps: overwrite, overwrite, accumulate two, overwrite
    schedule = [[0], [1], [2, 3], [4]]
    for k, batches in enumerate(schedule):
        seen = {}
        for name, (state, module, opt) in runs.items():
            weights = {p: state.parameters[p].data.copy() for p in PARAMS}
            for i in batches:
                module(*_batch(i))
            seen[name] = {p: state.parameters[p].grad.copy() for p in PARAMS}
            if name == "in_place" and k == 0:  # the flat buffers are made by the first optimizer step
                assert opt._flat.groups[0].grad is None
            elif name == "in_place":
                (group,) = opt._flat.groups
                # onnxruntime wrote this call's gradients into the flat buffer the update reads: no gathering
                # is left to do (the copying update's buffer still holds the last step's)
                np.testing.assert_array_equal(group.grad, np.concatenate([seen[name][p] for p in PARAMS],
                                                                         axis=None))
                at = group.grad.ctypes.data
                for p, shape in zip(group.params, group.shapes):
                    g = state.parameters[p].grad
                    assert g.ctypes.data == at and g.shape == shape, p  # .grad is its slice of the buffer
                    at += g.nbytes
                if len(batches) == 1:  # onnxruntime's output bound at those addresses
                    kept = module._overwrite_plan._kept.outputs
                    bound = {n.split("_grad")[0]: v[0] for n, v in kept.items()}
                    for p in PARAMS:
                        assert bound[p] is state.parameters[p].grad, p
            if name == "in_place":
                want = _torch_grads(net, weights, batches)
                for p in PARAMS:
                    np.testing.assert_allclose(seen[name][p], want[p], rtol=1e-5, atol=1e-6, err_msg=p)
            opt.step()
            module.lazy_reset_grad()
        for p in PARAMS:
            np.testing.assert_array_equal(seen["in_place"][p], seen["copying"][p], err_msg=f"call {k} {p}")
        np.testing.assert_array_equal(runs["in_place"][1].get_contiguous_parameters(trainable_only=True),
                                      runs["copying"][1].get_contiguous_parameters(trainable_only=True))
    # the flat buffer stays the gradients' home from step to step (a held .grad, too, sees each step's)
    state, module, opt = runs["in_place"]
    held = state.parameters["fc2.weight"].grad
    module(*_batch(7))
    weights = {p: state.parameters[p].data.copy() for p in PARAMS}
    assert held is state.parameters["fc2.weight"].grad
    np.testing.assert_allclose(held, _torch_grads(net, weights, [7])["fc2.weight"], rtol=1e-5, atol=1e-6)


def test_replace_grads_keeps_disjoint_views_of_one_buffer() -> None:
    buf = np.arange(10, dtype=np.float32)
    params = [_Param(n, np.dtype(np.float32), True, np.zeros(s, np.float32)) for n, s in
              [("a", (2, 2)), ("b", (3,)), ("c", (3,)), ("d", (0,))]]
    disjoint = [buf[0:4].reshape(2, 2), buf[4:7], buf[7:10], buf[10:10]]
    replace_grads(params, disjoint)
    assert all(p.grad is v for p, v in zip(params, disjoint))
    for p in params:  # (the test's arrays would count as a caller's: their values would be copied in)
        p.grad = None
    overlapping = [buf[0:4].reshape(2, 2), buf[2:5], buf[5:8], buf[::3][:0]]
    replace_grads(params, overlapping)
    got = [p.grad for p in params]
    assert got[0] is overlapping[0] and got[2] is overlapping[2]
    assert not np.shares_memory(got[1], buf)  # overlaps the first: a copy, same values
    np.testing.assert_array_equal(got[1], [2, 3, 4])
    for i in range(len(got)):
        for j in range(i):
            assert not np.shares_memory(got[i], got[j]), (i, j)


def test_a_held_grad_is_copied_in_and_keeps_the_binding(mlp) -> None:
    """A ``.grad`` the caller holds from before the first step keeps its identity (and sees each call's
    gradient) while the update reads the flat buffer; the training run's binding is not dropped each step."""
    folder, net = mlp
    state, module, opt = _open(folder, True)
    held = state.parameters["fc1.bias"].grad
    released = []
    release = opt._flat._release_bindings
    opt._flat._release_bindings = lambda: (released.append(1), release())
    for i in range(4):
        weights = {p: state.parameters[p].data.copy() for p in PARAMS}
        module(*_batch(i))
        assert state.parameters["fc1.bias"].grad is held
        np.testing.assert_allclose(held, _torch_grads(net, weights, [i])["fc1.bias"], rtol=1e-5, atol=1e-6)
        opt.step()
        module.lazy_reset_grad()
        (group,) = opt._flat.groups
        at = group.params.index("fc1.bias")
        start = sum(int(np.prod(s)) for s in group.shapes[:at])
        np.testing.assert_array_equal(group.grad[start:start + held.size], held)  # copied in for the update
    assert len(released) == 1  # the first step's only (the weights and the unheld gradients moved then)

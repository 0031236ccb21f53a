"""Checkpoint format: round trips, layout, atomic writes, errors, and independent FlatBuffers oracles.

The oracles are the FlatBuffers readers and builders that the onnxruntime wheel generates from
``ort_training_checkpoint.fbs`` (they need the ``flatbuffers`` package), and, in the slow test,
onnxruntime-training 1.19.2 itself from the virtualenv ``/tmp/ortt``.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import textwrap
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.checkpoint import (
    Checkpoint,
    OptimizerGroup,
    checkpoint_from_bytes,
    checkpoint_to_bytes,
    load_checkpoint,
    save_checkpoint,
)
from onnxtrain.checkpoint import format as fmt
from tests.ortt import ensure_ortt

NUMERIC = [t for t in range(1, 25) if t not in (8, 21, 22, 23)]  # every whole-byte non-string type
ORT_VENV = os.path.join(os.environ.get("ONNXTRAIN_ORTT_DIR", "/tmp/ortt"), "bin", "python")


def _array(elem: int, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random bytes of the given ONNX type (bit patterns cover NaNs, negatives, extremes)."""
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(elem))
    rng = np.random.default_rng(seed + elem)
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equality with dtype and shape."""
    return (a.dtype == b.dtype and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes())


def _sample() -> Checkpoint:
    moments = {"momentum0": np.full((2, 3), 0.25, np.float32), "momentum1": np.full((2, 3), 0.5, np.float32)}
    return Checkpoint(
        trainable={"fc2.weight": _array(1, (2, 3)), "fc1.bias": _array(11, (4,)), "scalar": _array(1, ())},
        frozen={"emb": _array(16, (3, 2)), "mask": _array(9, (5,)), "empty": _array(7, (0, 3))},
        optimizer_groups=[
            OptimizerGroup("group0", 7, 0.01, {"fc2.weight": moments,
                                               "fc1.bias": {"momentum0": _array(11, (4,), 1),
                                                            "momentum1": _array(11, (4,), 2)}}),
            OptimizerGroup("aux", 2**40, 1e-3),
        ],
        properties={"epoch": 3, "big": 2**40, "neg": -5, "loss": 0.125, "pi": 3.141592653589793,
                    "tag": "résumé ✓", "empty": "", "flag": True, "np_int": np.int64(9),
                    "np_f": np.float32(1.5)},
    )


def _expected_props(props: dict) -> dict:
    """Properties as they read back: ints as int, floats through float32, str unchanged."""
    out = {}
    for k, v in props.items():
        if isinstance(v, (bool, int, np.integer)):
            out[k] = int(v)
        elif isinstance(v, (float, np.floating)):
            out[k] = float(np.float32(v))
        else:
            out[k] = v
    return dict(sorted(out.items()))


def _assert_equal(got: Checkpoint, want: Checkpoint) -> None:
    assert got.nominal == want.nominal
    for g_dict, w_dict in ((got.trainable, want.trainable), (got.frozen, want.frozen)):
        assert list(g_dict) == sorted(w_dict)
        for k in w_dict:
            assert _same(g_dict[k], w_dict[k]), k
    assert [g.name for g in got.optimizer_groups] == sorted(g.name for g in want.optimizer_groups)
    for w in want.optimizer_groups:
        g = next(g for g in got.optimizer_groups if g.name == w.name)
        assert g.step == w.step
        assert g.initial_lr == float(np.float32(w.initial_lr))
        assert list(g.states) == sorted(w.states)
        for p, ms in w.states.items():
            assert list(g.states[p]) == sorted(ms)
            for m, arr in ms.items():
                assert _same(g.states[p][m], arr), (p, m)
    assert got.properties == _expected_props(want.properties)
    assert list(got.properties) == sorted(got.properties)


# ---------------------------------------------------------------- round trips

def test_round_trip_bytes():
    ckpt = _sample()
    data = checkpoint_to_bytes(ckpt)
    assert data[4:8] == b"ODTC"
    back = checkpoint_from_bytes(data)
    _assert_equal(back, ckpt)
    assert isinstance(back.properties["pi"], float) and back.properties["pi"] == 3.1415927410125732
    assert back.properties["np_f"] == 1.5 and isinstance(back.properties["np_f"], float)
    assert checkpoint_to_bytes(back) == data  # deterministic, and sorted input gives the same bytes


def test_round_trip_file(tmp_path):
    ckpt = _sample()
    path = tmp_path / "ckpt"
    save_checkpoint(ckpt, path)
    back = load_checkpoint(path)
    _assert_equal(back, ckpt)
    save_checkpoint(ckpt, str(path))  # str paths too, overwriting
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]


@pytest.mark.parametrize("elem", NUMERIC, ids=[TensorProto.DataType.Name(t) for t in NUMERIC])
def test_every_dtype(elem):
    arrays = {"a": _array(elem, (3, 4)), "s": _array(elem, ()), "z": _array(elem, (2, 0))}
    ckpt = Checkpoint(trainable=arrays, frozen={"f": _array(elem, (5,), 1)},
                      optimizer_groups=[OptimizerGroup(states={"a": {"momentum0": _array(elem, (3, 4), 2)}})])
    _assert_equal(checkpoint_from_bytes(checkpoint_to_bytes(ckpt)), ckpt)


def test_loaded_arrays_are_writable_copies():
    ckpt = checkpoint_from_bytes(checkpoint_to_bytes(_sample()))
    arr = ckpt.trainable["fc2.weight"]
    arr[...] = 0  # must not fail or alias the buffer
    assert arr.base is None or arr.base.flags.writeable


def test_big_endian_and_noncontiguous_inputs():
    a = np.arange(12, dtype=">f4").reshape(3, 4)
    ckpt = Checkpoint(trainable={"t": a.T, "b": a})
    back = checkpoint_from_bytes(checkpoint_to_bytes(ckpt))
    np.testing.assert_array_equal(back.trainable["t"], a.T)
    np.testing.assert_array_equal(back.trainable["b"], a)
    assert back.trainable["b"].dtype == np.float32


def test_empty_checkpoint():
    back = checkpoint_from_bytes(checkpoint_to_bytes(Checkpoint()))
    assert back == Checkpoint()


# ---------------------------------------------------------------- layout (our reader and the oracle)

@pytest.fixture(scope="module")
def fbs():
    """The generated FlatBuffers modules that ship in the onnxruntime wheel."""
    pytest.importorskip("flatbuffers")
    pytest.importorskip("onnxruntime.tools.ort_format_model")  # puts ort_flatbuffers_py on sys.path
    from ort_flatbuffers_py.fbs import (
        Checkpoint,
        FloatProperty,
        IntProperty,
        ModuleState,
        OptimizerGroup,
        ParameterOptimizerState,
        PropertyBag,
        StringProperty,
        Tensor,
    )
    return SimpleNamespace(CheckpointFb=Checkpoint, GroupFb=OptimizerGroup, FloatProperty=FloatProperty,
                           IntProperty=IntProperty, ModuleState=ModuleState,
                           ParameterOptimizerState=ParameterOptimizerState, PropertyBag=PropertyBag,
                           StringProperty=StringProperty, Tensor=Tensor)


def _oracle_read(fbs, data: bytes, data_file: bytes | None = None) -> dict:
    """Everything in a checkpoint file, read with onnxruntime's generated readers."""
    assert fbs.CheckpointFb.Checkpoint.CheckpointBufferHasIdentifier(data, 0)
    root = fbs.CheckpointFb.Checkpoint.GetRootAs(data, 0)

    def tensor(t):
        assert t.DocString() is None and t.StringDataIsNone()
        elem = t.DataType()
        dims = None if t.DimsIsNone() else [int(d) for d in t.DimsAsNumpy()] if t.DimsLength() else []
        raw = None if t.RawDataIsNone() else t.RawDataAsNumpy().tobytes() if t.RawDataLength() else b""
        return {"name": t.Name().decode(), "type": elem, "dims": dims, "raw": raw,
                "offset": t.ExternalDataOffset()}

    out: dict = {"version": root.Version(), "groups": [], "props": None}
    ms = root.ModuleState()
    out["module"] = None if ms is None else {
        "trainable": [tensor(ms.RequiresGradParams(i)) for i in range(ms.RequiresGradParamsLength())],
        "frozen": [tensor(ms.FrozenParams(i)) for i in range(ms.FrozenParamsLength())],
        "nominal": ms.IsNominalState(), "external": ms.HasExternalData(),
        "vectors_present": not ms.RequiresGradParamsIsNone() and not ms.FrozenParamsIsNone()}
    for i in range(root.OptimizerGroupsLength()):
        g = root.OptimizerGroups(i)
        states = []
        for j in range(g.OptimizerStatesLength()):
            s = g.OptimizerStates(j)
            moments = [tensor(s.Momentums(k)) for k in range(s.MomentumsLength())]
            states.append((s.ParamName().decode(), moments))
        out["groups"].append((g.GroupName().decode(), g.Step(), g.InitialLearningRate(), states))
    pb = root.PropertyBag()
    if pb is not None:
        out["props"] = {
            "ints": [(pb.Ints(i).Name().decode(), pb.Ints(i).Value()) for i in range(pb.IntsLength())],
            "floats": [(pb.Floats(i).Name().decode(), pb.Floats(i).Value())
                       for i in range(pb.FloatsLength())],
            "strings": [(pb.Strings(i).Name().decode(), pb.Strings(i).Value().decode())
                        for i in range(pb.StringsLength())]}
    return out


def _tensor_bytes(t: dict, data_file: bytes | None) -> bytes:
    if t["offset"] >= 0:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t["type"]))
        n = int(np.prod(t["dims"])) * dtype.itemsize
        return data_file[t["offset"]:t["offset"] + n]
    return t["raw"]


def _check_tensor(t: dict, name: str, arr: np.ndarray, data_file: bytes | None = None) -> None:
    assert t["name"] == name
    assert t["type"] == helper.np_dtype_to_tensor_dtype(arr.dtype)
    assert t["dims"] == list(arr.shape)
    assert _tensor_bytes(t, data_file) == np.ascontiguousarray(arr).tobytes()


def _check_against_oracle(o: dict, ckpt: Checkpoint, data_file: bytes | None = None) -> None:
    assert o["version"] == 2
    m = o["module"]
    assert m["vectors_present"] and m["nominal"] is False
    for got, want in ((m["trainable"], ckpt.trainable), (m["frozen"], ckpt.frozen)):
        assert [t["name"] for t in got] == sorted(want)
        for t in got:
            _check_tensor(t, t["name"], want[t["name"]], data_file)
    assert [g[0] for g in o["groups"]] == sorted(g.name for g in ckpt.optimizer_groups)
    for name, step, lr, states in o["groups"]:
        want = next(g for g in ckpt.optimizer_groups if g.name == name)
        assert step == want.step and lr == float(np.float32(want.initial_lr))
        assert [p for p, _ in states] == sorted(want.states)
        for p, moments in states:
            assert [t["name"] for t in moments] == sorted(want.states[p])
            for t in moments:
                _check_tensor(t, t["name"], want.states[p][t["name"]], data_file)
    props = _expected_props(ckpt.properties)
    assert o["props"]["ints"] == [(k, v) for k, v in props.items() if isinstance(v, int)]
    assert o["props"]["floats"] == [(k, v) for k, v in props.items() if isinstance(v, float)]
    assert o["props"]["strings"] == [(k, v) for k, v in props.items() if isinstance(v, str)]


def test_oracle_reads_our_file(fbs, tmp_path):
    ckpt = _sample()
    save_checkpoint(ckpt, tmp_path / "c")
    o = _oracle_read(fbs, (tmp_path / "c").read_bytes())
    _check_against_oracle(o, ckpt)
    assert o["module"]["external"] is False
    assert all(t["offset"] == -1 for t in o["module"]["trainable"] + o["module"]["frozen"])


def test_oracle_sorted_order(fbs):
    names = ["z", "b", "a10", "a2", "B", "_x"]
    ckpt = Checkpoint(trainable={n: np.zeros(1, np.float32) for n in names},
                      frozen={n + "f": np.zeros(1, np.int8) for n in reversed(names)},
                      optimizer_groups=[OptimizerGroup("g2"), OptimizerGroup("g1", states={
                          n: {"momentum1": np.ones(1, np.float32), "momentum0": np.zeros(1, np.float32)}
                          for n in names})],
                      properties={"zz": 1, "aa": 2, "mm": 0.5, "bb": "s", "ab": "t", "ba": 1.0})
    o = _oracle_read(fbs, checkpoint_to_bytes(ckpt))
    assert [t["name"] for t in o["module"]["trainable"]] == sorted(names)
    assert [t["name"] for t in o["module"]["frozen"]] == sorted(n + "f" for n in names)
    assert [g[0] for g in o["groups"]] == ["g1", "g2"]
    assert [p for p, _ in o["groups"][0][3]] == sorted(names)
    assert all([t["name"] for t in ms] == ["momentum0", "momentum1"] for _, ms in o["groups"][0][3])
    assert [k for k, _ in o["props"]["ints"]] == ["aa", "zz"]
    assert [k for k, _ in o["props"]["floats"]] == ["ba", "mm"]
    assert [k for k, _ in o["props"]["strings"]] == ["ab", "bb"]
    assert list(checkpoint_from_bytes(checkpoint_to_bytes(ckpt)).trainable) == sorted(names)


def test_nominal(fbs, tmp_path):
    full = _sample()
    nominal = Checkpoint(trainable=full.trainable, frozen=full.frozen, nominal=True)
    save_checkpoint(nominal, tmp_path / "n", external_threshold=0)  # nominal never goes external
    assert sorted(os.listdir(tmp_path)) == ["n"]
    data = (tmp_path / "n").read_bytes()
    assert len(data) < len(checkpoint_to_bytes(Checkpoint(trainable=full.trainable, frozen=full.frozen)))
    o = _oracle_read(fbs, data)
    m = o["module"]
    assert m["nominal"] is True and m["external"] is False
    for got, want in ((m["trainable"], full.trainable), (m["frozen"], full.frozen)):
        assert [t["name"] for t in got] == sorted(want)
        for t in got:  # as onnxruntime writes them: name and type, empty dims, empty raw data
            assert t["type"] == helper.np_dtype_to_tensor_dtype(want[t["name"]].dtype)
            assert t["dims"] == [] and t["raw"] == b"" and t["offset"] == -1
    back = load_checkpoint(tmp_path / "n")
    assert back.nominal is True
    for got, want in ((back.trainable, full.trainable), (back.frozen, full.frozen)):
        assert list(got) == sorted(want)
        assert all(got[k].size == 0 and got[k].dtype == want[k].dtype for k in want)


# ---------------------------------------------------------------- external data

def test_external_data_layout_and_round_trip(fbs, tmp_path):
    ckpt = _sample()
    path = tmp_path / "big"
    save_checkpoint(ckpt, path, external_threshold=16)
    assert sorted(os.listdir(tmp_path)) == ["big", "big.data"]
    main, data_file = path.read_bytes(), (tmp_path / "big.data").read_bytes()
    o = _oracle_read(fbs, main, data_file)
    assert o["module"]["external"] is True
    token = dict(o["props"]["strings"])[fmt.DATA_TOKEN]  # the save's token, also ending the .data file
    assert data_file.endswith(b"ONNXTRN1" + bytes.fromhex(token))
    with_token = Checkpoint(ckpt.trainable, ckpt.frozen, ckpt.optimizer_groups,
                            {**ckpt.properties, fmt.DATA_TOKEN: token})
    _check_against_oracle(o, with_token, data_file)
    tensors = o["module"]["trainable"] + o["module"]["frozen"] + [
        t for g in o["groups"] for _, ms in g[3] for t in ms]
    assert all(t["raw"] is None for t in tensors)  # the main file holds metadata only
    # Offsets follow the saved order, each the previous end rounded up to the tensor's itemsize.
    end = 0
    for t in tensors:
        itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t["type"])).itemsize
        assert t["offset"] == -(-end // itemsize) * itemsize
        end = t["offset"] + int(np.prod(t["dims"])) * itemsize
    assert len(data_file) == end + 24  # the token after the tensors
    assert len(main) < 2000 and sum(np.asarray(a).nbytes for a in ckpt.trainable.values()) > 0
    _assert_equal(load_checkpoint(path), ckpt)

    with pytest.raises(ValueError, match="checkpoint path is not provided"):
        checkpoint_from_bytes(main)
    # Re-saving below the threshold writes inline and removes the stale data file.
    save_checkpoint(load_checkpoint(path), path)
    assert sorted(os.listdir(tmp_path)) == ["big"]
    _assert_equal(load_checkpoint(path), ckpt)


def test_external_threshold_is_exclusive(tmp_path):
    ckpt = Checkpoint(trainable={"w": np.zeros(10, np.float32)})
    save_checkpoint(ckpt, tmp_path / "c", external_threshold=40)
    assert not (tmp_path / "c.data").exists()
    save_checkpoint(ckpt, tmp_path / "c", external_threshold=39)
    assert (tmp_path / "c.data").stat().st_size == 40 + 24  # the tensor, then the save's token


def test_external_data_errors(tmp_path):
    path = tmp_path / "c"
    save_checkpoint(_sample(), path, external_threshold=0)
    data = (tmp_path / "c.data").read_bytes()
    (tmp_path / "c.data").write_bytes(data[:-3 - 24])  # into the last tensor, before the token
    with pytest.raises(ValueError, match="ends before"):
        load_checkpoint(path)
    os.unlink(tmp_path / "c.data")
    with pytest.raises(FileNotFoundError, match="c.data"):
        load_checkpoint(path)


# ---------------------------------------------------------------- the oracle writes, we read

def _build_with_oracle(fbs, trainable, frozen, groups, props, external=None, nominal=False):
    """A checkpoint built with onnxruntime's generated builders, in the order given (not sorted)."""
    import flatbuffers

    F = fbs
    b = flatbuffers.Builder(1024)

    def tensor(name, arr):
        n, doc = b.CreateString(name), b.CreateString("a doc string")
        dims = b.CreateNumpyVector(np.array(arr.shape, np.int64))
        raw = None
        if external is None:
            raw = b.CreateNumpyVector(np.frombuffer(np.ascontiguousarray(arr).tobytes(), np.uint8))
        F.Tensor.TensorStart(b)
        F.Tensor.TensorAddName(b, n)
        F.Tensor.TensorAddDocString(b, doc)
        F.Tensor.TensorAddDims(b, dims)
        F.Tensor.TensorAddDataType(b, helper.np_dtype_to_tensor_dtype(arr.dtype))
        if raw is not None:
            F.Tensor.TensorAddRawData(b, raw)
        else:
            F.Tensor.TensorAddExternalDataOffset(b, external[name])
        return F.Tensor.TensorEnd(b)

    def vector(offsets):
        b.StartVector(4, len(offsets), 4)
        for off in reversed(offsets):
            b.PrependUOffsetTRelative(off)
        return b.EndVector()

    t = vector([tensor(k, v) for k, v in trainable.items()])
    f = vector([tensor(k, v) for k, v in frozen.items()])
    F.ModuleState.ModuleStateStart(b)
    F.ModuleState.ModuleStateAddRequiresGradParams(b, t)
    F.ModuleState.ModuleStateAddFrozenParams(b, f)
    F.ModuleState.ModuleStateAddIsNominalState(b, nominal)
    F.ModuleState.ModuleStateAddHasExternalData(b, external is not None)
    ms = F.ModuleState.ModuleStateEnd(b)

    group_offsets = []
    for name, step, lr, states in groups:
        state_offsets = []
        for p, moments in states.items():
            mvec = vector([tensor(k, v) for k, v in moments.items()])
            pn = b.CreateString(p)
            F.ParameterOptimizerState.ParameterOptimizerStateStart(b)
            F.ParameterOptimizerState.ParameterOptimizerStateAddParamName(b, pn)
            F.ParameterOptimizerState.ParameterOptimizerStateAddMomentums(b, mvec)
            state_offsets.append(F.ParameterOptimizerState.ParameterOptimizerStateEnd(b))
        svec, gn = vector(state_offsets), b.CreateString(name)
        F.GroupFb.OptimizerGroupStart(b)
        F.GroupFb.OptimizerGroupAddGroupName(b, gn)
        F.GroupFb.OptimizerGroupAddStep(b, step)
        F.GroupFb.OptimizerGroupAddInitialLearningRate(b, lr)
        F.GroupFb.OptimizerGroupAddOptimizerStates(b, svec)
        group_offsets.append(F.GroupFb.OptimizerGroupEnd(b))
    gvec = vector(group_offsets) if groups else None

    bag = None
    if props:
        kinds = []
        for mod, start, add_name, add_value, end, items in (
            (F.IntProperty, "IntPropertyStart", "IntPropertyAddName", "IntPropertyAddValue", "IntPropertyEnd",
             [(k, v) for k, v in props.items() if isinstance(v, int)]),
            (F.FloatProperty, "FloatPropertyStart", "FloatPropertyAddName", "FloatPropertyAddValue",
             "FloatPropertyEnd", [(k, v) for k, v in props.items() if isinstance(v, float)]),
            (F.StringProperty, "StringPropertyStart", "StringPropertyAddName", "StringPropertyAddValue",
             "StringPropertyEnd", [(k, v) for k, v in props.items() if isinstance(v, str)]),
        ):
            offs = []
            for k, v in items:
                kn = b.CreateString(k)
                val = b.CreateString(v) if isinstance(v, str) else v
                getattr(mod, start)(b)
                getattr(mod, add_name)(b, kn)
                getattr(mod, add_value)(b, val)
                offs.append(getattr(mod, end)(b))
            kinds.append(vector(offs))
        F.PropertyBag.PropertyBagStart(b)
        F.PropertyBag.PropertyBagAddInts(b, kinds[0])
        F.PropertyBag.PropertyBagAddFloats(b, kinds[1])
        F.PropertyBag.PropertyBagAddStrings(b, kinds[2])
        bag = F.PropertyBag.PropertyBagEnd(b)

    F.CheckpointFb.CheckpointStart(b)
    F.CheckpointFb.CheckpointAddVersion(b, 2)
    F.CheckpointFb.CheckpointAddModuleState(b, ms)
    if gvec is not None:
        F.CheckpointFb.CheckpointAddOptimizerGroups(b, gvec)
    if bag is not None:
        F.CheckpointFb.CheckpointAddPropertyBag(b, bag)
    b.Finish(F.CheckpointFb.CheckpointEnd(b), b"ODTC")
    return bytes(b.Output())


def test_we_read_oracle_built_file(fbs):
    trainable = {"w": _array(1, (3, 2)), "a": _array(11, (2,)), "s": _array(6, ())}
    frozen = {"m": _array(9, (4,)), "h": _array(10, (2, 2)), "u": _array(13, (1,))}
    states = {"w": {"momentum0": _array(1, (3, 2), 1), "momentum1": _array(1, (3, 2), 2)}}
    props = {"step": 12, "lr": 0.5, "name": "run-1"}
    data = _build_with_oracle(fbs, trainable, frozen, [("group0", 12, 0.25, states)], props)
    got = checkpoint_from_bytes(data)
    assert list(got.trainable) == ["w", "a", "s"]  # file order is kept (generator output is unsorted)
    want = Checkpoint(trainable, frozen, [OptimizerGroup("group0", 12, 0.25, states)], props)
    _assert_equal(Checkpoint({k: got.trainable[k] for k in sorted(got.trainable)},
                             {k: got.frozen[k] for k in sorted(got.frozen)},
                             got.optimizer_groups, got.properties), want)


def test_we_read_oracle_built_minimal_and_nominal(fbs):
    got = checkpoint_from_bytes(_build_with_oracle(fbs, {"w": _array(1, (2,))}, {}, [], {}))
    assert got.optimizer_groups == [] and got.properties == {} and _same(got.trainable["w"], _array(1, (2,)))
    nominal = checkpoint_from_bytes(_build_with_oracle(fbs, {"w": np.zeros(0, np.float32)},
                                                       {"i": np.zeros(0, np.int64)}, [], {}, nominal=True))
    assert nominal.nominal
    assert nominal.trainable["w"].dtype == np.float32 and nominal.frozen["i"].dtype == np.int64


def test_we_read_oracle_built_external(fbs, tmp_path):
    trainable = {"w": _array(1, (3, 2)), "b": _array(7, (3,))}
    blob, offsets = b"", {}
    for k, v in trainable.items():
        offsets[k] = len(blob) + 8  # a gap at the start and between tensors: offsets decide
        blob += bytes(8) + v.tobytes()
    (tmp_path / "c").write_bytes(_build_with_oracle(fbs, trainable, {}, [], {}, external=offsets))
    (tmp_path / "c.data").write_bytes(blob)
    got = load_checkpoint(tmp_path / "c")
    assert all(_same(got.trainable[k], v) for k, v in trainable.items())


# ---------------------------------------------------------------- atomic writes

def test_failed_write_keeps_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "c"
    save_checkpoint(_sample(), path)
    before = path.read_bytes()

    def boom(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(Checkpoint(trainable={"x": np.ones(3, np.float32)}), path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_failed_external_write_keeps_previous_files(tmp_path, monkeypatch):
    path = tmp_path / "c"
    save_checkpoint(_sample(), path, external_threshold=0)
    before = path.read_bytes(), (tmp_path / "c.data").read_bytes()

    def half_then_fail(f, arrays):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(fmt, "_write_arrays", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(Checkpoint(trainable={"x": np.ones(3, np.float32)}), path, external_threshold=0)
    assert (path.read_bytes(), (tmp_path / "c.data").read_bytes()) == before
    assert sorted(os.listdir(tmp_path)) == ["c", "c.data"]
    _assert_equal(load_checkpoint(path), _sample())


# ---------------------------------------------------------------- errors

def test_load_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(missing)
    with pytest.raises(IsADirectoryError, match=str(tmp_path.name)):
        load_checkpoint(tmp_path)
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"not a checkpoint at all, just text")
    with pytest.raises(ValueError, match="garbage"):
        load_checkpoint(garbage)
    model = tmp_path / "model.onnx"
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    onnx.save(helper.make_model(graph), model)
    with pytest.raises(ValueError, match="model.onnx"):
        load_checkpoint(model)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_checkpoint(empty)


def test_corrupt_buffers_raise_value_error():
    data = checkpoint_to_bytes(_sample())
    for cut in (9, 40, len(data) // 2, len(data) - 9):
        with pytest.raises(ValueError):
            checkpoint_from_bytes(data[:cut])
    rng = np.random.default_rng(0)
    for _ in range(200):  # random byte flips: a ValueError or a (possibly different) checkpoint, no crash
        buf = bytearray(data)
        for i in rng.integers(0, len(buf), 4):
            buf[i] = rng.integers(0, 256)
        with contextlib.suppress(ValueError):
            checkpoint_from_bytes(bytes(buf))
    bad_version = bytearray(data)
    root = int.from_bytes(data[:4], "little")
    vt = root - int.from_bytes(data[root:root + 4], "little", signed=True)
    field = root + int.from_bytes(data[vt + 4:vt + 6], "little")
    bad_version[field:field + 4] = (7).to_bytes(4, "little")
    with pytest.raises(ValueError, match="version 7"):
        checkpoint_from_bytes(bytes(bad_version))


def test_save_errors(tmp_path):
    ckpt = _sample()
    with pytest.raises(FileNotFoundError, match="no_such_dir"):
        save_checkpoint(ckpt, tmp_path / "no_such_dir" / "c")
    with pytest.raises(IsADirectoryError, match=str(tmp_path.name)):
        save_checkpoint(ckpt, tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", [None, [1, 2], b"bytes", {"a": 1}, 1 + 2j])
def test_bad_property_type(value):
    with pytest.raises(TypeError, match="'bad'"):
        checkpoint_to_bytes(Checkpoint(properties={"ok": 1, "bad": value}))


def test_bad_tensors():
    with pytest.raises(TypeError, match="'s'"):
        checkpoint_to_bytes(Checkpoint(trainable={"s": np.array(["a", "b"])}))
    with pytest.raises(TypeError, match="'o'"):
        checkpoint_to_bytes(Checkpoint(frozen={"o": np.array([object()])}))
    with pytest.raises(ValueError, match="both trainable and frozen"):
        checkpoint_to_bytes(Checkpoint(trainable={"w": np.zeros(1)}, frozen={"w": np.zeros(1)}))
    with pytest.raises(ValueError, match="int64"):
        checkpoint_to_bytes(Checkpoint(properties={"huge": 2**63}))
    with pytest.raises(ValueError, match="repeat"):
        checkpoint_to_bytes(Checkpoint(optimizer_groups=[OptimizerGroup(), OptimizerGroup()]))


# ---------------------------------------------------------------- onnxruntime-training itself

_ORT_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from onnx import numpy_helper
    from onnxruntime.capi import _pybind_state as C

    out = {}
    for name in sys.argv[1:]:
        if name.startswith("save:"):  # onnxruntime writes a checkpoint from TensorProtos
            _, path, nominal = name.split(":")
            arrays = dict(np.load(path + ".npz"))
            protos = lambda prefix: [numpy_helper.from_array(v, k[2:]).SerializeToString()
                                     for k, v in arrays.items() if k.startswith(prefix)]
            C.save_checkpoint(protos("T:"), protos("F:"), path, nominal == "1")
            continue
        state = C.load_checkpoint(name)
        params = {}
        if name.endswith("nominal"):  # parameters of a nominal state cannot be read
            params = {p: None for p in state.parameter_names()}
        else:
            for p in state.parameter_names():
                par = state.get_parameter(p)
                params[("T:" if par.requires_grad else "F:") + p] = par.data.numpy()
            np.savez(name + ".ort.npz", **params)
        props = {k: state.get_property(k) for k in state.property_names()}
        out[name] = {"params": sorted(params), "props": props}
        C.save_checkpoint(state, name + ".ort", True)
    print(json.dumps(out))
""")

_ORT_DTYPES = [1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13]  # what onnxruntime-training 1.19 loads


@pytest.mark.slow
def test_onnxruntime_training_interop(tmp_path):
    """onnxruntime-training 1.19.2 loads our files (inline, external, nominal) and re-saves them
    with optimizer state; we load its files and its re-saves."""
    ensure_ortt()
    trainable = {f"t{e}": _array(e, (2, 3)) for e in _ORT_DTYPES} | {"scalar": _array(1, ())}
    frozen = {f"f{e}": _array(e, (4,), 5) for e in _ORT_DTYPES}
    ours = Checkpoint(trainable, frozen, [OptimizerGroup("group0", 42, 0.0125, {
        k: {"momentum0": _array(1, (2, 3), 1), "momentum1": _array(1, (2, 3), 2)} for k in trainable})],
        {"epoch": 3, "big": 2**40, "loss": 0.125, "tag": "résumé"})
    save_checkpoint(ours, tmp_path / "inline")
    save_checkpoint(ours, tmp_path / "external", external_threshold=0)
    save_checkpoint(Checkpoint(trainable, frozen, nominal=True), tmp_path / "nominal")
    np.savez(tmp_path / "gen.npz", **{"T:" + k: v for k, v in trainable.items()},
             **{"F:" + k: v for k, v in frozen.items()})
    np.savez(tmp_path / "gennom.npz", **{"T:" + k: v for k, v in trainable.items()})

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    names = [str(tmp_path / n) for n in ("inline", "external", "nominal")]
    saves = [f"save:{tmp_path / 'gen'}:0", f"save:{tmp_path / 'gennom'}:1"]
    run = subprocess.run([ORT_VENV, "-c", _ORT_SCRIPT, *saves, *names, str(tmp_path / "gen")],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])

    everything = sorted(["T:" + k for k in trainable] + ["F:" + k for k in frozen])
    for n in ("inline", "external"):
        r = report[str(tmp_path / n)]
        assert r["params"] == everything
        shown = dict(r["props"])
        token = shown.pop(fmt.DATA_TOKEN, None)  # a user property to onnxruntime-training: external data only
        assert (token is not None) == (n == "external")
        assert shown == _expected_props(ours.properties)
        loaded = dict(np.load(str(tmp_path / n) + ".ort.npz"))
        for k in everything:
            want = trainable[k[2:]] if k[0] == "T" else frozen[k[2:]]
            assert _same(loaded[k], want), (n, k)
        # onnxruntime's re-save (with the optimizer state it read from our file) reads back equal.
        _assert_equal(load_checkpoint(str(tmp_path / n) + ".ort"), ours)
    assert report[str(tmp_path / "nominal")]["params"] == sorted([*trainable, *frozen])
    resaved_nominal = load_checkpoint(str(tmp_path / "nominal") + ".ort")
    assert resaved_nominal.nominal and list(resaved_nominal.trainable) == sorted(trainable)

    gen = load_checkpoint(tmp_path / "gen")  # written by onnxruntime from TensorProtos
    assert list(gen.trainable) == list(trainable) and list(gen.frozen) == list(frozen)  # initializer order
    assert all(_same(gen.trainable[k], v) for k, v in trainable.items())
    assert all(_same(gen.frozen[k], v) for k, v in frozen.items())
    gennom = load_checkpoint(tmp_path / "gennom")
    assert gennom.nominal and all(gennom.trainable[k].dtype == v.dtype for k, v in trainable.items())
    regen = load_checkpoint(str(tmp_path / "gen") + ".ort")
    assert list(regen.trainable) == sorted(trainable)
    assert all(_same(regen.trainable[k], v) for k, v in trainable.items())


def test_structural_corruptions_are_refused_as_flatbuffers_verifier_refuses_them():
    """One flipped bit could make a string one byte shorter (a property or parameter renamed) or move a field
    onto a misaligned offset (an int64 property read across two fields): onnxtrain loaded such files with
    other names or values where onnxruntime-training's FlatBuffers verifier refuses them. Strings must end in
    NUL and values sit at multiples of their size, as the verifier checks."""
    ckpt = Checkpoint(trainable={"fc.weight": np.ones((2, 2), np.float32)}, properties={"epoch": 3})
    data = bytearray(checkpoint_to_bytes(ckpt))
    assert checkpoint_from_bytes(bytes(data)).properties == {"epoch": 3}
    for name in (b"epoch", b"fc.weight"):
        at = data.index(name + b"\0")
        shorter = bytearray(data)
        shorter[at - 4] -= 1  # the string's length: "epoc", "fc.weigh"
        with pytest.raises(ValueError, match="not NUL-terminated"):
            checkpoint_from_bytes(bytes(shorter))
    misaligned = bytearray(data)
    misaligned[0] ^= 1  # the root table's offset, odd
    with pytest.raises(ValueError, match="aligned"):
        checkpoint_from_bytes(bytes(misaligned))


@pytest.mark.parametrize("shorter", [False, True])
def test_a_data_file_of_another_save_is_refused(tmp_path, monkeypatch, shorter):
    """Two saves: the second's .data under the first's main file was loaded silently when of the same size
    (the format has no checksum), and a shorter one failed at once as a cut file (a save without the
    optimizer state after one with it): the save's token, checked as the .data opens, tells them apart."""
    monkeypatch.setattr(fmt, "_TORN_RETRIES", 1)
    moments = [OptimizerGroup("group0", 1, 0.1, {"w": {"momentum0": np.zeros(8, np.float32)}})]
    first = Checkpoint(trainable={"w": np.zeros(8, np.float32)}, properties={"run": 1},
                       optimizer_groups=moments)
    second = Checkpoint(trainable={"w": np.ones(8, np.float32)}, properties={"run": 2},
                        optimizer_groups=[] if shorter else moments)
    save_checkpoint(first, tmp_path / "a", external_threshold=0)
    save_checkpoint(second, tmp_path / "b", external_threshold=0)
    assert load_checkpoint(tmp_path / "a").properties == {"run": 1}  # the token is not shown
    os.replace(tmp_path / "b.data", tmp_path / "a.data")
    with pytest.raises(ValueError, match="its .data file is not the one saved with it"):
        load_checkpoint(tmp_path / "a")


def test_a_reader_during_saves_over_the_path_gets_one_save_whole(tmp_path):
    """A load running while another thread saves external-data checkpoints over the same path read the new
    .data with the old main file (the two renames follow each other): every load now gets one save's
    values, step and property together."""
    import threading

    path = tmp_path / "c"

    def ckpt(k: int) -> Checkpoint:
        return Checkpoint(trainable={"w": np.full(64, k, np.float32)},
                          optimizer_groups=[OptimizerGroup("group0", k, 0.1, {"w": {
                              "momentum0": np.full(64, k, np.float32)}})],
                          properties={"k": k})

    save_checkpoint(ckpt(0), path, external_threshold=0)
    stop, mixed, loads = threading.Event(), [], [0]

    def read() -> None:
        while not stop.is_set():
            c = load_checkpoint(path)
            k = c.properties["k"]
            if {int(c.trainable["w"][0]), c.optimizer_groups[0].step,
                    int(c.optimizer_groups[0].states["w"]["momentum0"][0])} != {k}:
                mixed.append(k)
            loads[0] += 1

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for k in range(1, 200):
            save_checkpoint(ckpt(k), path, external_threshold=0)
    finally:
        stop.set()
        reader.join()
    assert loads[0] > 0 and not mixed, (loads[0], mixed[:5])

"""Edge values across onnxruntime-training 1.19.2 (its own virtualenv, see tests/ortt.py), both ways: 0-d
and empty tensors, unicode, NUL-holding and 70,000-character names, int64 extremes, NaN, infinities, -0.0
and subnormal float properties, empty and long strings, an empty property name, a step near int64's end;
inline and external. (An empty parameter name onnxruntime-training refuses: onnxtrain does not write one.)"""

from __future__ import annotations

import json
import math
import os
import textwrap

import numpy as np
import pytest

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup, load_checkpoint, save_checkpoint
from onnxtrain.checkpoint import format as fmt
from onnxtrain.training.api import CheckpointState
from tests.checkpoint.test_checkpoint import _array, _same
from tests.ortt import ensure_ortt, run_script

ORT_TYPES = [1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 13]  # what onnxruntime-training 1.19 loads (no half types)
LONG = "n" * 70000
NAMES = ["日本語🚀", "a\0b", LONG]


def _trainable() -> dict[str, np.ndarray]:
    arrays = {f"t{e}": _array(e, (2, 3)) for e in ORT_TYPES}
    arrays |= {"scalar": _array(1, ()), "empty": _array(7, (0, 3)), "bool0d": _array(9, ())}
    return arrays | {n: _array(1, (i + 1,), i) for i, n in enumerate(NAMES)}


def _frozen() -> dict[str, np.ndarray]:
    return {"f_u64": np.array([0, 2**64 - 1], np.uint64), "f_empty": _array(11, (0,)), "f_0d": _array(5, ())}


PROPS = {"imax": 2**63 - 1, "imin": -(2**63), "zero": 0, "nan": math.nan, "inf": math.inf, "ninf": -math.inf,
         "nzero": -0.0, "tiny": 1e-45, "big": 3.0e38, "es": "", "": "empty name", "uni✓": "résumé ✓🚀",
         "long": "x" * 100000, "nul": "a\0b"}


def _encode_value(v: object) -> object:
    return {"float": v.hex()} if isinstance(v, float) else v


def _decode_value(v: object) -> object:
    return float.fromhex(v["float"]) if isinstance(v, dict) else v


def _float32(v: float) -> float:
    return float(np.float32(v))


def _same_property(got: object, want: object) -> bool:
    if isinstance(want, float):
        want = _float32(want)
        return isinstance(got, float) and (got == want or (math.isnan(got) and math.isnan(want)))
    return type(got) is type(want) and got == want


# Reads each file with onnxruntime-training (parameters as hex bytes, floats as hex), then re-saves it with
# its optimizer state to <file>.ort.
_READ = textwrap.dedent("""
    import json, sys
    from onnxruntime.capi import _pybind_state as C
    enc = lambda v: {"float": v.hex()} if isinstance(v, float) else v
    out = {}
    for path in sys.argv[1:]:
        s = C.load_checkpoint(path)
        params = {}
        for n in s.parameter_names():
            p = s.get_parameter(n)
            a = p.data.numpy()
            params[n] = [str(a.dtype), list(a.shape), a.tobytes().hex(), p.requires_grad]
        out[path] = {"params": params, "props": {k: enc(s.get_property(k)) for k in s.property_names()}}
        C.save_checkpoint(s, path + ".ort", True)
    print(json.dumps(out))
""")

# Writes a checkpoint from TensorProtos (as its artifact generator does), adds properties, saves it again.
_WRITE = textwrap.dedent("""
    import json, sys
    import numpy as np
    from onnx import numpy_helper
    from onnxruntime.capi import _pybind_state as C
    path, spec = sys.argv[1], json.load(open(sys.argv[2], encoding="utf-8"))
    def protos(part):
        arrays = {n: np.frombuffer(bytes.fromhex(h), d).reshape(s).copy()
                  for n, (d, s, h) in spec[part].items()}
        return [numpy_helper.from_array(a, n).SerializeToString() for n, a in arrays.items()]
    C.save_checkpoint(protos("trainable"), protos("frozen"), path + ".gen", False)
    s = C.load_checkpoint(path + ".gen")
    for k, v in spec["props"].items():
        s.add_property(k, float.fromhex(v["float"]) if isinstance(v, dict) else v)
    C.save_checkpoint(s, path, False)
    print(json.dumps("ok"))
""")


@pytest.mark.slow
def test_onnxruntime_training_reads_our_edge_values_and_we_read_its_resave(tmp_path):
    ensure_ortt()
    trainable, frozen = _trainable(), _frozen()
    moments = {n: {"momentum0": _array(1, a.shape, 3), "momentum1": _array(1, a.shape, 4)}
               for n, a in trainable.items() if a.dtype == np.float32}
    ours = Checkpoint(trainable, frozen, [OptimizerGroup("group0", 2**62 + 1, 0.0125, moments)], dict(PROPS))
    paths = [str(tmp_path / "inline"), str(tmp_path / "external")]
    save_checkpoint(ours, paths[0])
    save_checkpoint(ours, paths[1], external_threshold=0)
    report = run_script(_READ, *paths)
    for path in paths:
        got = report[path]
        assert sorted(got["params"]) == sorted([*trainable, *frozen])
        for name, (dtype, shape, data, requires_grad) in got["params"].items():
            want = trainable.get(name, frozen.get(name))
            assert (dtype, tuple(shape)) == (str(want.dtype), want.shape), name
            assert bytes.fromhex(data) == want.tobytes(), name
            assert requires_grad == (name in trainable), name
        props = {k: _decode_value(v) for k, v in got["props"].items()}
        assert (props.pop(fmt.DATA_TOKEN, None) is not None) == path.endswith("external")
        assert sorted(props) == sorted(PROPS)
        for k, want in PROPS.items():
            assert _same_property(props[k], want), (k, props[k], want)
        assert math.copysign(1.0, props["nzero"]) < 0  # read from our file with its sign

        back = load_checkpoint(path + ".ort")  # onnxruntime's re-save, with the optimizer state it read
        for name, want in {**trainable, **frozen}.items():
            assert _same({**back.trainable, **back.frozen}[name], want), name
        group = back.optimizer_groups[0]
        assert (group.name, group.step, group.initial_lr) == ("group0", 2**62 + 1, _float32(0.0125))
        for name, ms in moments.items():
            for m, arr in ms.items():
                assert _same(group.states[name][m], arr), (name, m)
        for k, want in PROPS.items():
            assert _same_property(back.properties[k], want), (k, back.properties[k], want)


@pytest.mark.slow
def test_we_read_onnxruntime_training_edge_values(tmp_path):
    ensure_ortt()
    trainable, frozen = _trainable(), _frozen()
    spec = {"trainable": {n: [str(a.dtype), list(a.shape), a.tobytes().hex()] for n, a in trainable.items()},
            "frozen": {n: [str(a.dtype), list(a.shape), a.tobytes().hex()] for n, a in frozen.items()},
            "props": {k: _encode_value(v) for k, v in PROPS.items()}}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec), encoding="utf-8")
    path = str(tmp_path / "theirs")
    assert run_script(_WRITE, path, str(spec_path)) == "ok"
    assert os.path.exists(path)
    ckpt = load_checkpoint(path)
    assert list(ckpt.trainable) == sorted(trainable) and list(ckpt.frozen) == sorted(frozen)
    assert all(_same(ckpt.trainable[n], a) for n, a in trainable.items())
    assert all(_same(ckpt.frozen[n], a) for n, a in frozen.items())
    assert sorted(ckpt.properties) == sorted(PROPS)
    for k, want in PROPS.items():
        if k != "nzero":  # onnxruntime's FlatBuffers builder leaves out a float equal to its default 0.0
            assert _same_property(ckpt.properties[k], want), (k, ckpt.properties[k], want)
    assert ckpt.properties["nzero"] == 0.0
    state = CheckpointState.load_checkpoint(path)
    assert dict(state.properties)[LONG[:0] + "long"] == PROPS["long"]
    for name, want in trainable.items():
        assert _same(state.parameters[name].data, want), name


_LOAD = textwrap.dedent("""
    import json, sys
    from onnxruntime.capi import _pybind_state as C
    try:
        C.load_checkpoint(sys.argv[1])
        print(json.dumps("loaded"))
    except Exception as e:
        print(json.dumps(str(e)))
""")


@pytest.mark.slow
def test_onnxruntime_training_refuses_an_empty_parameter_name(tmp_path, monkeypatch):
    """Why onnxtrain refuses to save one (tests/checkpoint/test_checkpoint_edges.py): written with that
    check switched off, onnxruntime-training cannot load the file."""
    ensure_ortt()
    monkeypatch.setattr(fmt, "_check_parameter_names", lambda ckpt: None)
    save_checkpoint(Checkpoint(trainable={"": np.zeros(2, np.float32), "w": np.ones(2, np.float32)}),
                    tmp_path / "c")
    assert "non-empty name" in run_script(_LOAD, str(tmp_path / "c"))

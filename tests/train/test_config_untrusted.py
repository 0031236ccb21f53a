"""Configs and data files that would make ``onnxtrain train`` expand, recurse or allocate without bound: a
YAML "billion laughs", deep nesting, a recursive alias, a list for ``data.source``, array headers that
declare more data than their file holds. Each is one stderr line naming the key, exit 2, within seconds and
2 GB of address space; ordinary anchors and aliases still load as PyYAML's SafeLoader reads them."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import pytest
import yaml

from onnxtrain.train.config import MAX_ALIAS_VALUES, ConfigError, load_config, parse_yaml
from onnxtrain.train.data import load_data

MEMORY = 2 << 30  # RLIMIT_AS of each command
QUICK = 5.0  # CPU seconds a refusal may take (the interpreter's start included; CPU time, not wall time,
# so that a loaded host does not fail it: an expansion of the aliases would take minutes or the memory)


def _child_cpu() -> float:
    """CPU seconds of this process's finished children so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY, MEMORY))


def _cli(*args: str) -> tuple[int, list[str], float]:
    """``python -m onnxtrain train *args`` under the memory limit: exit code, stderr lines, CPU seconds."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    env.pop("ONNXTRAIN_DEBUG", None)
    start = _child_cpu()
    proc = subprocess.run([sys.executable, "-m", "onnxtrain", "train", *args, "-q"], capture_output=True,
                          text=True, timeout=60, env=env, preexec_fn=_limit_memory)
    return proc.returncode, proc.stderr.strip().splitlines(), _child_cpu() - start


def _config(tmp_path, **values: str) -> str:
    """The digits MLP config (2 steps) with ``values`` replacing some of its YAML values; its path."""
    v = {"sizes": "[64, 16, 10]", "logits": "logits", "labels": "y", "source": "digits", "parameters": "{}",
         "dir": str(tmp_path / "out"), **values}
    text = textwrap.dedent(f"""\
        model:
          builder: mlp
          args:
            sizes: {v['sizes']}
          logits: {v['logits']}
          loss: loss
          labels: {v['labels']}
        data:
          source: {v['source']}
        training:
          batch_size: 32
          steps: 2
          parameters: {v['parameters']}
        output:
          dir: {v['dir']}
        """)
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def _laughs(levels: int = 8) -> str:
    """A flow list whose aliases expand it to 9 ** (levels + 1) strings, in under 600 characters."""
    text = "&a0 [" + ",".join(['"xxxxxxxx"'] * 9) + "]"
    for level in range(1, levels + 1):
        text = f"&a{level} [{text}," + ",".join([f"*a{level - 1}"] * 8) + "]"
    return text


def _assert_refused(result: tuple[int, list[str], float], *words: str) -> str:
    code, err, seconds = result
    assert code == 2, (code, err[-3:])
    assert len(err) == 1, err[-3:]
    for w in words:
        assert w in err[0], err[0]
    assert seconds < QUICK, (seconds, err[0])
    return err[0]


@pytest.mark.parametrize("key, values", [
    ("model.labels", {"labels": _laughs()}),
    ("model.logits", {"logits": _laughs()}),
    ("output.dir", {"dir": _laughs()}),
    ("training.parameters.junk", {"parameters": "{junk: " + _laughs() + "}"}),
    ("model.args.sizes", {"sizes": "[" + _laughs() + ", 16, 10]"}),
])
def test_billion_laughs_is_refused_naming_its_key(tmp_path, key, values):
    """Aliases repeating ~400 million strings: refused while the YAML is read, not expanded by a repr."""
    path = _config(tmp_path, **values)
    assert os.path.getsize(path) < 1000
    line = _assert_refused(_cli(path), f"{key}: aliases repeat more than {MAX_ALIAS_VALUES} values")
    assert "out of memory" not in line


def test_recursive_alias_is_refused_naming_its_key(tmp_path):
    line = _assert_refused(_cli(_config(tmp_path, dir="&d [1, *d]")), "output.dir: alias *d")
    assert "recursive" in line


def test_deep_nesting_in_the_file_and_in_set_is_one_line(tmp_path):
    """20000 '[' in the file, 5000 in a --set value: Python's recursion limit before (a 3000-line traceback,
    exit 1)."""
    path = _config(tmp_path, sizes="[" * 20000 + "]" * 20000)
    line = _assert_refused(_cli(path), "run.yaml: model.args.sizes: ", "nested more than")
    assert "Recursion" not in line
    deep = "[" * 5000 + "]" * 5000
    _assert_refused(_cli(_config(tmp_path), "--set", f"model.args.sizes={deep}"),
                    "model.args.sizes: --set value: ", "nested more than")


@pytest.mark.parametrize("value", ["[a]", "{a: 1}", "!!set {a}"])
def test_data_source_of_the_wrong_type_names_the_key(tmp_path, value):
    _assert_refused(_cli(_config(tmp_path), "--set", f"data.source={value}"),
                    "data.source: expected one of 'digits', 'files', 'sequence', got ")


def _huge_header_npy(rows: int = 10**9) -> bytes:
    """An .npy header declaring ``rows`` × 64 float32, followed by 100 bytes of data."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (rows, 64)})
    return buf.getvalue() + b"\0" * 100


def test_array_header_larger_than_its_file_is_refused(tmp_path):
    """10^9 rows declared, 100 bytes present: numpy would allocate 238 GiB first ('out of memory', exit 1)."""
    (tmp_path / "x.npy").write_bytes(_huge_header_npy())
    np.save(tmp_path / "y.npy", np.zeros(100, np.int64))
    feeds = f"{{x: {tmp_path / 'x.npy'}, y: {tmp_path / 'y.npy'}}}"
    line = _assert_refused(_cli(_config(tmp_path), "--set", f"data={{source: files, feeds: {feeds}}}"),
                           f"data.feeds.x: {tmp_path / 'x.npy'}", "truncated")
    assert "out of memory" not in line
    with zipfile.ZipFile(tmp_path / "d.npz", "w") as z:
        z.writestr("x.npy", _huge_header_npy())
        z.writestr("y.npy", (tmp_path / "y.npy").read_bytes())
    data = f"{{source: files, path: {tmp_path / 'd.npz'}, feeds: {{x: x, y: y}}}}"
    line = _assert_refused(_cli(_config(tmp_path), "--set", f"data={data}"),
                           f"data.path: {tmp_path / 'd.npz'}", "array 'x'", "truncated")


@pytest.mark.parametrize("save", [np.savez, np.savez_compressed])
def test_whole_array_files_still_load(tmp_path, save):
    """.npy and .npz (stored or deflated) arrays that fill their files: loaded as np.load reads them."""
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((50, 64)).astype(np.float32), rng.integers(0, 10, 50)
    np.save(tmp_path / "x.npy", x)
    save(tmp_path / "d.npz", x=x, y=y)
    base = yaml.safe_load(open(_config(tmp_path)).read())  # noqa: SIM115 - read at once
    for feeds in ({"x": "x.npy", "y": "y"}, {"x": "x", "y": "y"}):
        raw = dict(base, data={"source": "files", "path": "d.npz", "feeds": feeds, "eval_fraction": 0.2})
        (tmp_path / "files.yaml").write_text(yaml.safe_dump(raw))
        ds = load_data(load_config(tmp_path / "files.yaml"))
        got = {k: np.concatenate([ds.train[k], ds.eval[k]]) for k in ("x", "y")}
        with np.load(tmp_path / "d.npz") as z:
            for k in ("x", "y"):
                np.testing.assert_array_equal(np.sort(got[k], axis=0), np.sort(z[k], axis=0))


def test_ordinary_anchors_and_aliases_still_load(tmp_path):
    """Anchors, aliases and merge keys in a valid config: the values PyYAML's SafeLoader reads."""
    text = textwrap.dedent(f"""\
        model:
          builder: mlp
          args: {{sizes: &sizes [64, 16, 10]}}
          logits: &name logits
          labels: y
        data: {{source: digits}}
        optimizer: &opt {{name: adam, lr: 0.01}}
        schedule: {{kind: linear, warmup_steps: &warm 3}}
        training: {{<<: {{batch_size: &bs 16, seed: *warm}}, eval_batch_size: *bs, steps: 4}}
        output: {{dir: {tmp_path / 'out'}}}
        """)
    (tmp_path / "anchors.yaml").write_text(text)
    cfg, oracle = load_config(tmp_path / "anchors.yaml"), yaml.safe_load(text)
    assert cfg.model.args["sizes"] == oracle["model"]["args"]["sizes"]
    assert cfg.model.logits == oracle["model"]["logits"]
    assert (cfg.optimizer.name, cfg.optimizer.lr) == (oracle["optimizer"]["name"], oracle["optimizer"]["lr"])
    assert cfg.schedule.warmup_steps == oracle["schedule"]["warmup_steps"]
    for k in ("batch_size", "seed", "eval_batch_size", "steps"):
        assert getattr(cfg.training, k) == oracle["training"][k]


def test_aliases_under_the_limit_read_as_pyyaml_reads_them():
    """Aliases repeating ~75000 values in all (under MAX_ALIAS_VALUES) read as SafeLoader reads them; one
    level more is refused, naming the key."""
    doc = "k: " + _laughs(4)
    assert parse_yaml(doc) == yaml.safe_load(doc)
    with pytest.raises(ConfigError, match=r"^k: aliases repeat more than"):
        parse_yaml("k: " + _laughs(5))


def test_recursion_limit_while_reading_is_a_config_error():
    """Nesting under MAX_DEPTH read from an already deep stack: a ConfigError naming the key, not a
    RecursionError."""
    import inspect

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 120)
    try:
        with pytest.raises(ConfigError, match=r"^model\.args\.sizes: .*nested too deeply"):
            parse_yaml("[" * 90 + "]" * 90, "model.args.sizes")
    finally:
        sys.setrecursionlimit(limit)


def test_a_message_shows_a_bounded_part_of_a_huge_shared_value():
    """A value repeating one list 9^9 times (shared, a few KB) in a message: its first characters, at once
    and in little memory (the whole repr took > 3 GB before)."""
    code = textwrap.dedent("""\
        from onnxtrain.train.config import ConfigError, coerce
        v = ["xxxxxxxx"] * 9
        for _ in range(8):
            v = [v] * 9
        try:
            coerce(v, str, "model.labels")
        except ConfigError as e:
            print(e)
        """)
    start = _child_cpu()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          preexec_fn=_limit_memory, env=dict(os.environ, OPENBLAS_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr[-500:]
    assert _child_cpu() - start < QUICK
    line = proc.stdout.strip()
    assert line.startswith("model.labels: expected a string, got [[[[") and len(line) < 120, line

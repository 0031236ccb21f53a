"""Facts the README states that the code or the repository can check cheaply: the names it gives exist,
its counts match the code's, and its benchmark table is the one bench/RESULTS.md holds."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def section(title: str) -> str:
    """The README's text under the heading ``title`` (any level), up to the next heading."""
    m = re.search(rf"^#+ {re.escape(title)}\n(.*?)(?=^#+ |\Z)", README, flags=re.S | re.M)
    assert m, f"no README section {title!r}"
    return m.group(1)


def test_named_paths_exist() -> None:
    names = set(re.findall(r"`((?:onnxtrain|tests|bench|tools|configs|examples)/[^`<>\s]+)`", README))
    missing = sorted(n for n in names if not (ROOT / n).exists())
    assert names and not missing, missing


def test_file_names_given_without_their_folder_exist() -> None:
    """A file the README names by its name alone or a partial path (`ml.py`, `fusion/gemm.py`,
    `tiny_transformer.yaml`) is a file of the repository."""
    known = ("onnxtrain/", "tests/", "bench/", "tools/", "configs/", "examples/", "../")
    names = {n for n in re.findall(r"`([\w./-]+\.(?:py|yaml|json|md))`", README) if not n.startswith(known)}
    names.discard("config.yaml")  # what a run writes, not a file of the repository
    folders = [ROOT / d for d in ("onnxtrain", "tests", "bench", "tools", "configs", "examples")]
    files = [p.relative_to(ROOT).as_posix() for d in folders for p in d.rglob("*") if p.is_file()]
    files += [p.name for p in ROOT.iterdir() if p.is_file()]
    missing = sorted(n for n in names if not any(f == n or f.endswith("/" + n) for f in files))
    assert names and not missing, missing


def test_environment_variables_are_read() -> None:
    code = "\n".join(p.read_text(encoding="utf-8") for d in ("onnxtrain", "bench", "tests")
                     for p in (ROOT / d).rglob("*.py"))
    names = set(re.findall(r"\b(ONNXTRAIN_[A-Z_]+)\b", README))
    unread = sorted(n for n in names if f'"{n}"' not in code and f"'{n}'" not in code)
    assert names and not unread, unread


def test_conformance_expected_failures_count() -> None:
    from onnxtrain.conformance import EXPECTED_FAILURES

    m = re.search(r"The (\d+) cases it does not pass are listed", README)
    assert m and int(m.group(1)) == len(EXPECTED_FAILURES)
    m = re.search(r"python -m onnxtrain\.conformance +# (\d+) of (\d+) passed", README)
    assert m and int(m.group(2)) - int(m.group(1)) == len(EXPECTED_FAILURES)


def test_conformance_counts_per_tier() -> None:
    """Each ``python -m onnxtrain.conformance`` line's "N of M" (and the tiers 1 and 2 note): M is the count
    of onnx's cases of those tiers' ops in the suite's case index, N that less the expected failures among
    them."""
    import json

    import onnx

    from onnxtrain.conformance import EXPECTED_FAILURES, TIERS

    index = json.loads((ROOT / "tests" / "engine" / "conformance_index.json").read_text(encoding="utf-8"))
    if index["onnx"] != onnx.__version__:
        pytest.skip(f"the case index is for onnx {index['onnx']}, not {onnx.__version__}")

    def counts(tiers: list[str]) -> tuple[int, int]:
        ops = {op for t in tiers for op in TIERS[t]}
        cases = [c for c, (op, _) in index["cases"].items() if op in ops]
        return len(cases) - sum(c in EXPECTED_FAILURES for c in cases), len(cases)

    lines = re.findall(r"^python -m onnxtrain\.conformance(.*?)# (\d+) of (\d+)", README, flags=re.M)
    assert len(lines) == 3, lines
    for args, passed, total in lines:
        m = re.search(r"--tier (\S+)", args)
        tiers = m.group(1).split(",") if m else sorted(TIERS)
        assert counts(tiers) == (int(passed), int(total)), (args, counts(tiers))
    m = re.search(r"\(tiers 1 and 2: (\d+) of (\d+)\)", README)
    assert m and counts(["1", "2"]) == (int(m.group(1)), int(m.group(2)))


def test_speed_table_equals_bench_results() -> None:
    """The README's table: the legacy session's row of each model in bench/RESULTS.md's first table, with
    onnxruntime-training's peak RSS."""
    results = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    first = results.split("\n\n| model |", 1)[1].split("\n\n", 1)[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in first.splitlines()[2:]]
    want = []
    for r in rows:
        if r[1] in ("onnxtrain TrainingSession [native]", "onnxtrain TrainingSession"):  # (one BLAS setting)
            ort_rss = next(o[7] for o in rows if o[0] == r[0] and o[1].startswith("onnxruntime-training"))
            want.append([r[2], r[4], r[5], r[6], f"{r[7]} / {ort_rss}"])
    table = section("Speed and memory").split("| model | onnxtrain ms/step", 1)[1].split("\n\n", 1)[0]
    got = [[c.strip() for c in line.strip("|").split("|")][1:] for line in table.splitlines()[2:]]
    assert len(want) == 5 and got == want


def test_digits_data() -> None:
    from onnxtrain.data import load_digits

    train, test = load_digits()
    assert len(train.y) + len(test.y) == 1797 and set(train.y.tolist()) == set(range(10))
    assert "1,797 images, 10 classes" in section("Data")


def test_cli_commands_and_flags_exist(capsys) -> None:
    """Every ``onnxtrain <command>`` the README shows is a subcommand, and the flags it gives them exist."""
    from onnxtrain.cli import main

    bash = "\n".join(re.findall(r"```bash\n(.*?)```", README, flags=re.S))
    shown = set(re.findall(r"^(?:mpiexec -n \d+ )?onnxtrain (\w[\w-]*)", bash, flags=re.M))
    shown |= set(re.findall(r"`(?:mpiexec -n \d+ )?onnxtrain (\w[\w-]*) ", README))
    helps = {}
    for cmd in sorted(shown):
        with pytest.raises(SystemExit) as e:
            main([cmd, "--help"])
        out = capsys.readouterr()
        assert e.value.code == 0, (cmd, out.err)
        helps[cmd] = out.out
    assert {"train", "eval", "export", "info", "gradient-graph", "artifacts"} <= set(helps)
    for cmd, flags in {"train": ["--set", "--output-dir", "--resume", "--overwrite"],
                       "eval": ["--checkpoint"], "export": ["--checkpoint", "-o"],
                       "gradient-graph": ["--loss", "--wrt", "--memory-efficient", "-o"],
                       "artifacts": ["-o", "--loss", "--optimizer", "--frozen", "--requires-grad",
                                     "--loss-output", "--mixed-precision", "--recompute"]}.items():
        for f in flags:
            assert re.search(rf"(^|[\s\[(]){re.escape(f)}\b", helps[cmd]), (cmd, f)


@pytest.mark.parametrize("key", ["loss_output_name", "training_optimizer_name", "gradient_accumulation_steps",
                                 "lr_params_feed_name"])
def test_config_refuses_properties_it_sets_itself(key: str) -> None:
    from onnxtrain.train.config import ConfigError, load_config

    cfg = ROOT / "configs" / "digits_mlp.yaml"
    with pytest.raises(ConfigError, match=f"training.parameters.{key}"):
        load_config(str(cfg), [f"training.parameters.{key}=1"])


def test_dotted_onnxtrain_names_resolve() -> None:
    """Every `onnxtrain.a.b` the README names is a module or an attribute, but the session config entries and
    checkpoint properties, which are strings."""
    import importlib

    strings = {"onnxtrain.backend", "onnxtrain.batch_split", "onnxtrain.flat_update",
               "onnxtrain.learning_rate", "onnxtrain.loss_scaler", "onnxtrain.data_token"}
    names = set(re.findall(r"`(onnxtrain(?:\.[A-Za-z_]\w*)+)", README)) - strings

    def resolves(name: str) -> bool:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
        return False

    assert names and not [n for n in sorted(names) if not resolves(n)]


def test_ci_runs_the_readmes_test_command() -> None:
    """.ci/run calls exactly the README's test command (a missing install step fails CI), and the test extra
    installs what it uses (pytest-timeout for --timeout, pytest-xdist for -n)."""
    commands = re.findall(r"^pip install -e '\.\[test\]' && (.+)$", README, flags=re.M)
    assert len(commands) == 1, commands
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert f"pip install -e '.[test]' && {commands[0]}\n" in run
    setup = (ROOT / "setup.py").read_text(encoding="utf-8")
    for flag, package in (("--timeout", "pytest-timeout"), ("-n ", "pytest-xdist")):
        if flag in commands[0]:
            assert f'"{package}"' in setup, package


def test_the_config_table_lists_every_key() -> None:
    """Each config section's row in "The main job" names every key the config accepts there, with the
    default the dataclass has where the row gives one."""
    import dataclasses

    from onnxtrain.train import config as c

    text = section("The main job: `onnxtrain train`")
    rows = dict(re.findall(r"^\| `(\w+)` \| (.*) \|$", text, flags=re.M))
    classes = {"model": [c.ModelConfig], "data": list(c.DATA_SOURCES.values()),
               "optimizer": [c.OptimizerConfig], "schedule": [c.ScheduleConfig],
               "training": [c.TrainingConfig], "output": [c.OutputConfig]}
    assert set(rows) == set(classes)
    for name, kinds in classes.items():
        keys = {f.name for k in kinds for f in dataclasses.fields(k)}
        missing = sorted(k for k in keys if f"`{k}" not in rows[name] and k != "source")
        assert not missing, f"config section {name!r}: keys not in the README's table: {missing}"
    defaults = (("batch_size", 32), ("keep_checkpoints", 3), ("log_every", 10), ("eval_batch_size", 1024))
    for key, value in defaults:
        assert f"`{key}` ({value}" in rows["training"]
        assert getattr(c.TrainingConfig(), key) == value
    # the other defaults the rows state, as written there
    stated = (("model", c.ModelConfig, "logits", "`logits` (`logits`)", "logits"),
              ("model", c.ModelConfig, "loss", "`loss` (`loss`)", "loss"),
              ("model", c.ModelConfig, "labels", "`labels` (`y`)", "y"),
              ("model", c.ModelConfig, "add_loss", "`mse`; `none`)", "none"),
              ("data", c.DATA_SOURCES["files"], "eval_fraction", "`eval_fraction` (0.1)", 0.1),
              ("data", c.DATA_SOURCES["sequence"], "task", "`task` (`reverse`,", "reverse"),
              ("data", c.DATA_SOURCES["sequence"], "vocab", "`vocab` (10)", 10),
              ("data", c.DATA_SOURCES["sequence"], "length", "`length` (8)", 8),
              ("data", c.DATA_SOURCES["sequence"], "train_size", "`train_size` (20000)", 20000),
              ("data", c.DATA_SOURCES["sequence"], "eval_size", "`eval_size` (1000)", 1000),
              ("optimizer", c.OptimizerConfig, "name", "`lamb`; `adam`)", "adam"),
              ("optimizer", c.OptimizerConfig, "lr", "`lr` (1e-3)", 1e-3),
              ("optimizer", c.OptimizerConfig, "clip_grad_norm", "`clip_grad_norm` (null: off)", None),
              ("schedule", c.ScheduleConfig, "kind", "`cosine`; `constant`)", "constant"),
              ("schedule", c.ScheduleConfig, "warmup_steps", "`warmup_steps` (0)", 0),
              ("schedule", c.ScheduleConfig, "final_lr_ratio", "`final_lr_ratio` (0;", 0),
              ("training", c.TrainingConfig, "seed", "`seed` (0)", 0),
              ("training", c.TrainingConfig, "backend", "`onnxruntime`; `numpy`)", "numpy"),
              ("training", c.TrainingConfig, "gradient_accumulation_steps",
               "`gradient_accumulation_steps` (1)", 1),
              ("training", c.TrainingConfig, "data_parallel_size", "`data_parallel_size` (1)", 1),
              ("output", c.OutputConfig, "plot", "`plot` (true)", True),
              ("output", c.OutputConfig, "export", "`export` (true)", True))
    for name, kind, key, text, value in stated:
        assert text in rows[name], (name, text)
        field = next(f for f in dataclasses.fields(kind) if f.name == key)
        assert field.default == value, (name, key, field.default)
    minimal = {"model": {"builder": "mlp", "args": {"sizes": [64, 8, 10]}}, "training": {"steps": 1}}
    assert c.config_from_dict(minimal).data.source == "digits"


def test_sweep_sizes() -> None:
    """The breadth sweeps' sizes the README gives: the default suite's share of the dynamic dynamo layer
    audit and of the control-flow fuzzes, and their full sizes."""
    from tests.autodiff import test_control_flow_fuzz as grad_fuzz
    from tests.autodiff.torch_layer_sizes import DEFAULT_DYNAMO, SIZES
    from tests.engine import test_control_flow_fuzz as forward_fuzz

    text = " ".join(README.split())
    assert f"{len(DEFAULT_DYNAMO)} of the {len(SIZES)} layers of the dynamic-shape dynamo audit" in text
    total = sum(len(s) for s in grad_fuzz.SEEDS.values())
    assert all(grad_fuzz.DEFAULT_SEEDS[f] == len(s) // 3 for f, s in grad_fuzz.SEEDS.items())
    assert f"{total} float64 models over opsets 9–21, a third of them in the default test suite" in text
    bodies = f"{grad_fuzz.RANDOM_SEEDS} float64 models go through the same checks ({grad_fuzz.RANDOM_DEFAULT}"
    assert f"{bodies} by default), and {forward_fuzz.SEEDS} float32/float64 ones" in text
    assert f"(`tests/engine/test_control_flow_fuzz.py`, {forward_fuzz.DEFAULT} by default)" in text

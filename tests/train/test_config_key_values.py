"""Values of single config keys that were taken silently or refused naming another key than theirs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain import zoo
from onnxtrain.cli import main
from onnxtrain.train import Trainer, load_config
from onnxtrain.train.config import ConfigError
from onnxtrain.train.data import load_data
from tests.train.conftest import config_path

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("builder", ["digits_cnn", "digits_stn"])
@pytest.mark.parametrize("image", ["[1, 8]", "[1, 8, 8, 8]"])
def test_an_image_shape_of_another_length_names_model_args_image(tmp_path, capsys, builder, image):
    code = main(["train", config_path(builder), "--output-dir", str(tmp_path / "out"), "-q",
                 "--set", "training.steps=1", "--set", f"model.args.image={image}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert ": model.args.image: " in err[0] and "[channels, height, width]" in err[0], err[0]
    assert "unpack" not in err[0], err[0]


@pytest.mark.parametrize("value", ["''", "' '"])
def test_an_empty_output_dir_is_refused_as_the_option_is(value):
    """--output-dir '' is a usage error; output.dir: '' went to runs/<config name> as if it were unset."""
    with pytest.raises(ConfigError, match=r"^output.dir: an empty path"):
        load_config(config_path("digits_mlp"), [f"output.dir={value}"])


def test_a_changed_training_parameter_is_named_alone(tmp_path, capsys):
    """The keys a --resume names as changed are the leaves that changed, not also their section (the
    training.parameters mapping was listed beside its one new key)."""
    out = str(tmp_path)
    sets = ["training.steps=4", "training.checkpoint_every=2", "output.plot=false", "output.export=false"]
    first = Trainer(load_config(config_path("digits_mlp"), sets), out, progress=False)
    first.run()
    capsys.readouterr()
    more = [*sets, "training.steps=6", "training.parameters.use_fp16_moments=true"]
    with pytest.raises(ConfigError) as e:  # the checkpoint's float32 moments do not fit
        Trainer(load_config(config_path("digits_mlp"), more), out, progress=False).run(resume=True)
    changed = "training.parameters.use_fp16_moments, training.steps"
    assert str(e.value).endswith(f"config keys changed since it was written: {changed}"), str(e.value)
    Trainer(load_config(config_path("digits_mlp"), [*sets, "training.steps=6",
                                                    "training.parameters.use_mixed_precision=false"]),
            out, progress=False).run(resume=True)
    err = capsys.readouterr().err
    assert "warning: resuming with a changed config (training.steps);" in err, err


def test_adam_refuses_eps_0_naming_it():
    """Adam's step is m / (sqrt(v) + eps): with eps 0 a weight whose gradient is 0 (a digit pixel that is
    always 0) steps by 0/0, as torch's Adam does, and the run ended 'diverged' blaming the learning rate.
    Lamb replaces a step that is not finite by 0, so eps 0 stays allowed there."""
    w = torch.zeros(3, requires_grad=True)
    opt = torch.optim.Adam([w], lr=0.1, eps=0.0)
    w.grad = torch.zeros(3)
    opt.step()
    assert torch.isnan(w).all()  # what eps 0 does to a weight that gets no gradient
    with pytest.raises(ConfigError, match=r"^optimizer.eps: expected a number > 0 with adam"):
        load_config(config_path("digits_mlp"), ["optimizer.eps=0"])
    lamb = load_config(config_path("digits_mlp"), ["optimizer.eps=0", "optimizer.name=lamb"])
    assert lamb.optimizer.eps == 0


@pytest.mark.parametrize("arrays, words", [
    ({"feat": np.zeros((0, 4)), "lab": np.zeros(0, np.int64)}, "eval arrays are empty"),
    ({"feat": np.zeros((5, 4)), "lab": np.zeros(4, np.int64)}, "eval arrays differ in length"),
])
def test_an_eval_file_with_no_or_uneven_rows_names_data_eval_path(tmp_path, write_config, arrays, words):
    """An eval file whose arrays are empty or differ in length was reported as data.feeds, the key of the
    training arrays' names, not as the file at fault."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", feat=rng.standard_normal((40, 4)), lab=rng.integers(0, 3, 40))
    np.savez(tmp_path / "eval.npz", **arrays)
    onnx.save(zoo.mlp([4, 3], loss=False), tmp_path / "net.onnx")
    cfg = load_config(write_config({"model": {"path": "net.onnx", "add_loss": "cross_entropy"},
                                    "data": {"source": "files", "path": "train.npz", "eval_path": "eval.npz",
                                             "feeds": {"x": "feat", "y": "lab"}},
                                    "training": {"steps": 1, "batch_size": 8}}))
    with pytest.raises(ConfigError, match=rf"^data.eval_path: {words}"):
        load_data(cfg)


def test_a_data_path_that_no_feed_reads_is_refused(tmp_path, write_config):
    """data.path with every feed a .npy file was silently not read (the arrays came from the .npy files)."""
    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((40, 4)))
    np.save(tmp_path / "y.npy", rng.integers(0, 3, 40))
    np.savez(tmp_path / "other.npz", x=np.zeros((40, 4)), y=np.zeros(40, np.int64))
    onnx.save(zoo.mlp([4, 3], loss=False), tmp_path / "net.onnx")
    raw = {"model": {"path": "net.onnx", "add_loss": "cross_entropy"},
           "data": {"source": "files", "path": "other.npz", "feeds": {"x": "x.npy", "y": "y.npy"}},
           "training": {"steps": 1, "batch_size": 8}}
    with pytest.raises(ConfigError, match=r"^data.path: no feed reads it \(every feed is a .npy file\)"):
        load_config(write_config(raw))
    raw["data"]["feeds"]["y"] = "y"  # one array from the .npz: read
    assert load_config(write_config(raw)).data.path.endswith("other.npz")


def test_legacy_cpu_adam_with_clip_grad_norm_is_refused_naming_both():
    """training.parameters.legacy_cpu_adam makes Adam ignore clipping (as onnxruntime's CPU kernel did): with
    optimizer.clip_grad_norm set the run trained unclipped, bit for bit as without that key, silently."""
    key = "training.parameters.legacy_cpu_adam"
    with pytest.raises(ConfigError, match=rf"^{key}: .* optimizer.clip_grad_norm \(0.01\) would have no"):
        load_config(config_path("digits_mlp"), ["optimizer.clip_grad_norm=0.01",
                                                "training.parameters.legacy_cpu_adam=true"])
    load_config(config_path("digits_mlp"), ["training.parameters.legacy_cpu_adam=true"])  # alone: allowed

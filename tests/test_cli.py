"""The lightning-dvi CLI: recipes parse, data-to-model links, end-to-end runs, clean config errors."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.cli import cli
from lightning_dvi.nn import BayesLinear

REPO = Path(__file__).resolve().parents[1]
TOY, UCI, DIGITS = (
    REPO / "recipes" / f"{n}.yaml"
    for n in ("toy_heteroscedastic", "uci_regression", "digits_classification")
)


pytestmark = pytest.mark.usefixtures("cli_isolated")


def test_toy_recipe_links_data_to_model():
    run = cli(["--config", str(TOY)], run=False)
    model, dm = run.model, run.datamodule
    assert isinstance(model, DVIRegressor)
    assert model.hparams.in_features == 1
    assert model.num_data == dm.num_train == 500
    assert (float(model.target_loc), float(model.target_scale)) == (0.0, 1.0)


def test_uci_recipe_links_target_statistics(uci_dir):
    run = cli(
        ["--config", str(UCI), "--data.data_dir", str(uci_dir), "--data.dataset", "boston"],
        run=False,
    )
    model, dm = run.model, run.datamodule
    assert model.hparams.in_features == dm.in_features == 13
    assert model.num_data == dm.num_train
    assert float(model.target_loc) == pytest.approx(dm.target_loc)
    assert float(model.target_scale) == pytest.approx(dm.target_scale)
    assert dm.target_scale > 1  # a non-trivial standardisation really was linked


def test_digits_recipe_links_num_classes_and_skips_regression_links():
    run = cli(["--config", str(DIGITS)], run=False)
    model = run.model
    assert isinstance(model, DVIClassifier)
    assert (model.num_classes, model.hparams.in_features, model.num_data) == (
        10,
        64,
        run.datamodule.num_train,
    )
    assert "target_loc" not in model.hparams


def test_toy_recipe_end_to_end_and_resume(capsys):
    args = ["--config", str(TOY), "--trainer.max_epochs", "2", "--data.init_args.num_train", "100"]
    first = cli(["fit", *args])
    out = capsys.readouterr().out
    assert "true noise model test NLL" in out and "test/nll" in out
    assert "metrics (regression: original units of y):" in out  # a classifier's differs
    log_dir = Path(first.trainer.log_dir)
    for name in ("metrics.csv", "config.yaml", "predictive_band.png", "calibration_test.png"):
        assert (log_dir / name).is_file(), name
    last = log_dir / "checkpoints" / "last.ckpt"  # in the run's own directory
    assert last.is_file() and f"checkpoint:  {last}" in out
    assert first.trainer.global_step == 2  # one full-batch L-BFGS step per epoch

    resumed = cli(
        [
            "fit",
            *args[:2],
            "--trainer.max_epochs",
            "3",
            "--data.init_args.num_train",
            "100",
            "--ckpt_path",
            "last",
        ]
    )
    assert resumed.trainer.global_step == 3
    assert f"resuming the newest run's checkpoint, {last.resolve()}" in capsys.readouterr().out

    tested = cli(["test", "--config", str(TOY), "--ckpt_path", str(last)])
    assert "test/nll" in tested.trainer.callback_metrics

    predicted = cli(["predict", "--config", str(TOY), "--ckpt_path", str(last)])
    saved = torch.load(Path(predicted.trainer.log_dir) / "predictions.pt", weights_only=True)
    assert saved["mean"].shape == saved["var"].shape == (200,)  # the toy's plotting grid


def test_digits_recipe_end_to_end():
    run = cli(["fit", "--config", str(DIGITS), "--trainer.max_epochs", "1"])
    assert 0.0 <= float(run.trainer.callback_metrics["test/acc"]) <= 1.0
    assert (Path(run.trainer.log_dir) / "reliability_test.png").is_file()


def test_uci_recipe_end_to_end(uci_dir):
    """The whole recipe, not a capped run: warm start, L-BFGS, early stopping, in seconds."""
    args = ["--config", str(UCI), "--data.data_dir", str(uci_dir), "--data.dataset", "boston"]
    run = cli(["fit", *args])
    metrics = run.trainer.callback_metrics
    (warm,) = [c for c in run.trainer.callbacks if type(c).__name__ == "PointEstimateWarmStart"]
    assert warm.result is not None and warm.result.stopped == "patience"
    assert run.trainer.should_stop and run.trainer.current_epoch < 100  # early stopping, not 300
    # boston split 0, original units: the published DVI test LL is -2.41 +- 0.02 over splits
    assert 2.0 < float(metrics["test/nll"]) < 3.0 and float(metrics["test/rmse"]) < 4.5
    assert float(run.model.target_scale) == pytest.approx(run.datamodule.target_scale)


def test_injected_network_from_yaml(tmp_path):
    config = yaml.safe_load(TOY.read_text())
    config["model"]["init_args"]["net"] = {
        "class_path": "lightning_dvi.nn.BayesLinear",
        "init_args": {"in_features": 1, "out_features": 2},
    }
    config["trainer"].update(max_epochs=1, logger=False, default_root_dir=str(tmp_path))
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path), "save_on_train_epoch_end": True},
        }
    ]
    config["test_after_fit"] = False
    path = tmp_path / "net.yaml"
    path.write_text(yaml.safe_dump(config))
    run = cli(["fit", "--config", str(path)])
    assert type(run.model.net).__name__ == "BayesLinear"
    ckpt = next(tmp_path.rglob("*.ckpt"))
    # An injected network is not a hyper-parameter (it is ignored, so they stay primitive):
    # pass a fresh one of the same architecture and the checkpoint fills in its weights.
    loaded = DVIRegressor.load_from_checkpoint(ckpt, net=BayesLinear(1, 2))
    assert type(loaded.net).__name__ == "BayesLinear"
    torch.testing.assert_close(loaded.net.weight_loc, run.model.net.weight_loc)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (["--model.init_args.lr", "-1"], "lr must be"),
        (["--model.init_args.hidden", "[8, 0]"], "hidden"),
        (["--model.init_args.mode", "exact"], "mode"),
        (["--trainer.max_epochs", "many"], "max_epochs"),
    ],
)
def test_invalid_values_exit_with_the_key_named(override, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli(["fit", "--config", str(TOY), *override])
    assert info.value.code != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_uci_data_is_a_clean_error(capsys):
    with pytest.raises(SystemExit):
        cli(["fit", "--config", str(UCI)])
    assert "UCI data directory not found" in capsys.readouterr().err


def test_console_script_reports_bad_yaml_value_without_traceback(tmp_path):
    config = yaml.safe_load(TOY.read_text())
    config["model"]["init_args"]["activation"] = "swish"  # not a registered activation
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    script = Path(sys.executable).with_name("lightning-dvi")
    result = subprocess.run(
        [str(script), "fit", "--config", str(bad)], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert "registered activation" in result.stderr and "'swish'" in result.stderr
    assert "Traceback" not in result.stderr

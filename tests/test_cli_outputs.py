"""CLI outputs and refusals: the predict CSV, a missing last checkpoint, an empty split, and
injected networks that checkpoints rebuild."""

import csv
import inspect
import re
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.cli import cli, write_predictions_csv
from lightning_dvi.lightning._base import DVIModule
from lightning_dvi.nn import describe_torch, save_torch_network

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "toy_heteroscedastic.yaml"
QUICK = ["--trainer.max_epochs", "1", "--data.init_args.num_train", "64"]


pytestmark = pytest.mark.usefixtures("cli_isolated")


def _rows(path):
    with path.open() as handle:
        return list(csv.DictReader(handle))


def test_predict_writes_a_csv_matching_predictive(capsys):
    cli(["fit", "--config", str(TOY), *QUICK, "--test_after_fit", "false"])
    last = Path("runs/toy_heteroscedastic/lightning_logs/version_0/checkpoints/last.ckpt")
    run = cli(["predict", "--config", str(TOY), "--ckpt_path", str(last)])
    path = Path(run.trainer.log_dir) / "predictions.csv"
    assert f"predictions: {path.resolve()}" in capsys.readouterr().out.replace(
        str(path), str(path.resolve())
    )
    rows = _rows(path)
    x = run.datamodule.grid()[0]
    model = DVIRegressor.load_from_checkpoint(last)
    mean, var = model.predictive(x)
    aleatoric, epistemic = model.variance_decomposition(x)
    assert len(rows) == x.shape[0]
    column = {k: torch.tensor([float(r[k]) for r in rows], dtype=torch.float64) for k in rows[0]}
    std = var.double().sqrt()
    torch.testing.assert_close(column["mean"], mean.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(column["std"], std, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        column["lower_95"], mean.double() - 1.959963984540054 * std, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        column["upper_95"], mean.double() + 1.959963984540054 * std, atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        column["aleatoric_std"], aleatoric.double().sqrt(), atol=1e-6, rtol=0
    )
    torch.testing.assert_close(
        column["epistemic_std"], epistemic.double().sqrt(), atol=1e-6, rtol=0
    )


def test_classification_csv_has_probabilities_class_and_entropy(tmp_path):
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8]])
    rows = _rows(write_predictions_csv(probs, tmp_path / "p.csv"))
    assert list(rows[0]) == ["prob_0", "prob_1", "prob_2", "predicted_class", "entropy"]
    assert [r["predicted_class"] for r in rows] == ["0", "2"]
    entropy = -(probs.double() * probs.double().log()).sum(-1)
    assert [float(r["entropy"]) for r in rows] == pytest.approx(entropy.tolist(), abs=1e-12)
    assert float(rows[1]["prob_2"]) == pytest.approx(0.8, abs=1e-7)


@pytest.mark.parametrize("subcommand", ["test", "validate", "predict"])
def test_ckpt_path_last_without_a_last_checkpoint_fails(subcommand):
    with pytest.raises(SystemExit, match="no last checkpoint"):
        cli([subcommand, "--config", str(TOY), "--ckpt_path", "last"])


def test_validate_without_validation_data_fails():
    with pytest.raises(SystemExit, match="no validation data"):
        cli(["validate", "--config", str(TOY), "--data.init_args.num_val", "0"])


def _fit_toy_with_net(tmp_path, net):
    """One epoch of the toy recipe with ``model.init_args.net`` set; last.ckpt in tmp_path."""
    config = yaml.safe_load(TOY.read_text())
    config["model"]["init_args"]["net"] = net
    config["trainer"].update(max_epochs=1, logger=False, default_root_dir=str(tmp_path))
    config["trainer"]["callbacks"] = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(tmp_path), "save_last": True, "save_top_k": 0},
        }
    ]
    config["test_after_fit"] = False
    path = tmp_path / "net.yaml"
    path.write_text(yaml.safe_dump(config))
    run = cli(["fit", "--config", str(path), "--data.init_args.num_train", "32"])
    return run


def test_injected_network_from_the_cli_is_rebuilt_from_its_checkpoint(tmp_path):
    net = {
        "class_path": "lightning_dvi.nn.BayesLinear",
        "init_args": {"in_features": 1, "out_features": 2, "init_scale": 0.05},
    }
    run = _fit_toy_with_net(tmp_path, net)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["hyper_parameters"]
    assert "hidden" not in saved  # the injected network never had the default [128, 128]
    assert saved["net"]["class_path"] == "lightning_dvi.nn.BayesLinear"
    loaded = DVIRegressor.load_from_checkpoint(tmp_path / "last.ckpt")  # no net= needed
    assert loaded.net.init_scale == 0.05
    torch.testing.assert_close(loaded.net.weight_loc, run.model.net.weight_loc)


def test_cli_trains_a_converted_torch_network_and_reloads_it(tmp_path):
    """Issue 15: a saved torch network, converted by from_torch, from YAML via TorchNetwork."""
    torch.manual_seed(0)
    torch_net = torch.nn.Sequential(
        torch.nn.Linear(1, 16), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(16, 2)
    )
    save_torch_network(torch_net, tmp_path / "mlp.pt")  # layer list + state_dict, no pickle
    net = {
        "class_path": "lightning_dvi.nn.TorchNetwork",
        "init_args": {"path": str(tmp_path / "mlp.pt"), "scale_fraction": 0.05},
    }
    run = _fit_toy_with_net(tmp_path, net)
    assert [type(m).__name__ for m in run.model.net] == ["BayesLinear", "GELU", "BayesLinear"]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["hyper_parameters"]["net"]
    assert saved["init_args"] == {
        "layers": describe_torch(torch_net),
        "init": "fresh",
        "rules": {"layers.1": {"rule": "quadrature"}},  # the GELU's moment rule, recorded too
    }
    (tmp_path / "mlp.pt").unlink()  # the checkpoint describes the network itself
    loaded = DVIRegressor.load_from_checkpoint(tmp_path / "last.ckpt")  # no net= needed
    for a, b in zip(loaded.net.parameters(), run.model.net.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("model", [DVIRegressor, DVIClassifier])
def test_help_lists_every_argument_once_forwarded(model, capsys):
    """Shared arguments are forwarded with **kwargs, yet --model.help shows all of them."""
    expected = {
        name
        for cls in (model, DVIModule)
        for name in inspect.signature(cls.__init__).parameters
        if name not in ("self", "kwargs", "out_features")
    }
    with pytest.raises(SystemExit):
        cli(["fit", "--model.help", model.__name__])
    shown = set(re.findall(r"--model\.([a-z_]+) ", capsys.readouterr().out))
    assert expected <= shown, expected - shown
    assert "out_features" not in shown
    # and every one of them is a saved hyper-parameter
    kwargs = {"in_features": 2} | ({"num_classes": 3} if model is DVIClassifier else {})
    assert expected - {"net"} <= set(model(**kwargs).hparams)

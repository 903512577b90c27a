"""Issue 24: a checkpoint or weights file is data; loading one never runs code it names.

Each crafted file would create a marker file if anything imported, called or unpickled what it
names; every test asserts the marker is absent and the refusal names the culprit.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import cpu_trainer
from torch import nn

from lightning_dvi import DVIRegressor
from lightning_dvi.cli import cli
from lightning_dvi.lightning import register_network
from lightning_dvi.lightning._network import instantiate_net
from lightning_dvi.nn import (
    BayesLinear,
    TorchNetwork,
    describe_torch,
    from_torch,
    mlp,
    save_torch_network,
)

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "toy_heteroscedastic.yaml"


class Payload:
    """Unpickling this creates ``path`` (what a malicious ``.pt`` or ``.ckpt`` would do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


@pytest.fixture
def marker(tmp_path):
    path = tmp_path / "PWNED"
    yield path
    assert not path.exists(), "a crafted file ran code"


@pytest.fixture(autouse=True)
def _in_a_workdir(cli_workdir):
    return cli_workdir


def _checkpoint(tmp_path: Path, **hparams: object) -> Path:
    """A real DVIRegressor checkpoint, its hyper-parameters updated with ``hparams``."""
    model = DVIRegressor(in_features=1, hidden=[4], num_data=10)
    trainer = cpu_trainer(default_root_dir=tmp_path)
    trainer.strategy.connect(model)
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["hyper_parameters"].update(hparams)
    torch.save(checkpoint, path)
    return path


def _touch(marker: Path) -> dict[str, object]:
    return {"class_path": "subprocess.run", "init_args": {"args": ["touch", str(marker)]}}


@pytest.mark.parametrize(
    "extra",
    [
        {},
        # LightningCLI's record: Lightning would let jsonargparse import and build `net`
        {"_instantiator": "lightning.pytorch.cli.instantiate_module",
         "_class_path": "lightning_dvi.DVIRegressor"},
    ],
    ids=["plain", "cli_instantiator"],
)  # fmt: skip
def test_a_crafted_checkpoint_network_is_refused_naming_it(tmp_path, marker, extra):
    path = _checkpoint(tmp_path, net=_touch(marker), **extra)
    with pytest.raises(ValueError, match=r"refusing to build 'subprocess\.run'.*load_state_dict"):
        DVIRegressor.load_from_checkpoint(path)
    # the same file through the CLI: refused before LightningCLI reads its hyper-parameters
    with pytest.raises(SystemExit, match=r"lightning-dvi test: refusing to build 'subprocess"):
        cli(["test", "--config", str(TOY), "--ckpt_path", str(path)])


def test_a_network_nested_in_an_allowed_one_is_checked_too(tmp_path, marker):
    net = {"class_path": "lightning_dvi.nn.CNN", "init_args": {"channels": [_touch(marker)]}}
    with pytest.raises(ValueError, match=r"refusing to build 'subprocess\.run'"):
        DVIRegressor.load_from_checkpoint(_checkpoint(tmp_path, net=net))


def test_a_checkpoint_never_imports_a_module_it_names(tmp_path, marker, monkeypatch):
    # a module that would create the marker when imported, on the import path
    (tmp_path / "evil_i24.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\nclass Model: pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    model_path = _checkpoint(tmp_path, _class_path="evil_i24.Model")
    with pytest.raises(ValueError, match=r"model class 'evil_i24\.Model'.*never imported"):
        DVIRegressor.load_from_checkpoint(model_path)
    with pytest.raises(SystemExit, match=r"refusing checkpoint .*'evil_i24\.Model'"):
        cli(["test", "--config", str(TOY), "--ckpt_path", str(model_path)])
    net_path = _checkpoint(tmp_path, net={"class_path": "evil_i24.Net", "init_args": {}})
    with pytest.raises(SystemExit, match=r"refusing to build 'evil_i24\.Net'"):
        cli(["validate", "--config", str(TOY), "--ckpt_path", str(net_path)])
    assert "evil_i24" not in sys.modules


def test_a_pickled_checkpoint_is_refused_and_not_unpickled(tmp_path, marker):
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "hyper_parameters": {"payload": Payload(marker)}}, path)
    with pytest.raises(ValueError, match=r"refusing checkpoint .*evil\.ckpt.*never unpickles"):
        DVIRegressor.load_from_checkpoint(path)
    for subcommand in ("fit", "test"):
        with pytest.raises(SystemExit, match=r"refusing checkpoint .*weights_only=True"):
            cli([subcommand, "--config", str(TOY), "--ckpt_path", str(path)])
    with pytest.raises(ValueError, match="weights_only=False is not supported"):
        DVIRegressor.load_from_checkpoint(path, weights_only=False)


def test_a_crafted_pt_is_refused_by_torch_network_and_the_cli(tmp_path, marker):
    path = tmp_path / "evil.pt"
    torch.save(Payload(marker), path)
    with pytest.raises(ValueError, match=r"refusing weights file .*evil\.pt.*save_torch_network"):
        TorchNetwork(str(path))
    config = yaml.safe_load(TOY.read_text())
    config["model"]["init_args"]["net"] = {
        "class_path": "lightning_dvi.nn.TorchNetwork",
        "init_args": {"path": str(path)},
    }
    (tmp_path / "net.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        cli(["fit", "--config", str(tmp_path / "net.yaml"), "--trainer.max_epochs", "1"])
    assert exit_info.value.code == 2  # a configuration error, reported without a traceback


def test_an_old_pickled_torch_module_names_the_migration(tmp_path):
    torch_net = nn.Sequential(nn.Linear(1, 4), nn.ReLU(), nn.Linear(4, 2))
    torch.save(torch_net, tmp_path / "old.pt")  # the format TorchNetwork used to unpickle
    with pytest.raises(ValueError, match=r"torch\.load\(path, weights_only=False\); "):
        TorchNetwork(str(tmp_path / "old.pt"))
    # the documented one-off migration of a file you trust
    trusted = torch.load(tmp_path / "old.pt", weights_only=False)
    save_torch_network(trusted, tmp_path / "net.pt")
    converted = TorchNetwork(str(tmp_path / "net.pt"), scale_fraction=0.0)
    x = torch.randn(5, 1)
    torch.testing.assert_close(converted(x, mode="diag").mean, torch_net(x))


def test_torch_network_from_a_state_dict_and_a_layer_list(tmp_path):
    torch.manual_seed(0)
    torch_net = nn.Sequential(
        nn.Linear(3, 8), nn.GELU(), nn.Dropout(0.1), nn.Sequential(nn.Linear(8, 8), nn.SiLU()),
        nn.Linear(8, 2),
    ).double()  # fmt: skip
    torch.save(torch_net.state_dict(), tmp_path / "weights.pt")
    layers = describe_torch(torch_net)
    assert yaml.safe_load(yaml.safe_dump(layers)) == layers  # plain data, YAML-friendly
    net = TorchNetwork(str(tmp_path / "weights.pt"), layers=layers, scale_fraction=0.0)
    reference = from_torch(torch_net, scale_fraction=0.0)
    for a, b in zip(net.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="holds only a state_dict; give its layer list"):
        TorchNetwork(str(tmp_path / "weights.pt"))
    with pytest.raises(ValueError, match="the weights do not fit the layer list"):
        TorchNetwork(str(tmp_path / "weights.pt"), layers=layers[:1])
    with pytest.raises(ValueError, match=r"layers\[0\]: unknown layer type 'os\.system'"):
        TorchNetwork(str(tmp_path / "weights.pt"), layers=[{"type": "os.system"}])
    with pytest.raises(ValueError, match="InstanceNorm1d cannot be described as data"):
        describe_torch(nn.Sequential(nn.Linear(2, 2), nn.InstanceNorm1d(2)))


def test_your_own_network_class_loads_once_registered(tmp_path):
    class Wide(BayesLinear):
        """A user's network class, defined in their code."""

    net = {
        "class_path": f"{Wide.__module__}.{Wide.__qualname__}",
        "init_args": {"in_features": 1, "out_features": 2},
    }
    with pytest.raises(ValueError, match=r"refusing to build .*Wide.*register_network"):
        instantiate_net(net)
    register_network(Wide)
    assert type(instantiate_net(net)) is Wide
    with pytest.raises(ValueError, match=r"takes a lightning_dvi\.nn\.BayesModule subclass"):
        register_network(os.PathLike)  # type: ignore[type-var]
    with pytest.raises(ValueError, match="arguments must be plain values"):
        instantiate_net({**net, "init_args": {"in_features": object(), "out_features": 2}})
    # a checkpoint naming a class nobody registered loads its weights into a network built in
    # code, as the refusal says
    unknown = {"class_path": "my_code.Net", "init_args": {}}
    path = _checkpoint(tmp_path, net=unknown)
    with pytest.raises(ValueError, match=r"refusing to build 'my_code\.Net'.*net=MyNet"):
        DVIRegressor.load_from_checkpoint(path)
    loaded = DVIRegressor.load_from_checkpoint(path, net=mlp(1, [4], 2))
    saved = torch.load(path, weights_only=True)["state_dict"]
    torch.testing.assert_close(loaded.net.layers[0].weight_loc, saved["net.layers.0.weight_loc"])

"""DVIClassifier(net=from_torch(model, last_layers=1)): training, predictive, export, OOD, checkpoints."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch import Trainer
from torch import nn

from lightning_dvi import DVIClassifier
from lightning_dvi.callbacks import OODEvaluation
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.nn import export_predictive, from_torch


def _torch_model(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(256, 16),
        nn.ReLU(),
        nn.Linear(16, 10),
    )
    model.train()
    with torch.no_grad():
        model(torch.randn(32, 64))  # non-trivial BatchNorm statistics
    return model.eval()


def _trainer(tmp_path, **kwargs):
    return Trainer(
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=1,
        limit_test_batches=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
        **kwargs,
    )


@pytest.mark.parametrize("head_covariance", ["diag", "full"])
def test_only_the_head_posterior_is_optimised(head_covariance):
    net = from_torch(_torch_model(), last_layers=1, head_covariance=head_covariance)
    clf = DVIClassifier(net=net, num_classes=10, num_data=100)
    optimiser = clf.configure_optimizers()
    optimised = {id(p) for group in optimiser.param_groups for p in group["params"]}
    assert optimised == {id(p) for p in net.head.parameters()}


@pytest.mark.parametrize(("head_covariance", "last_layers"), [("diag", 2), ("full", 2)])
def test_training_moves_only_the_head_and_predicts(tmp_path, head_covariance, last_layers):
    net = from_torch(_torch_model(), last_layers=last_layers, head_covariance=head_covariance)
    backbone_before = {k: v.clone() for k, v in net.backbone.state_dict().items()}
    clf = DVIClassifier(net=net, mode="full", lr=1e-2)
    assert clf.num_classes == 10
    head_before = [p.detach().clone() for p in net.head.parameters()]
    dm = DigitsDataModule(batch_size=64)
    trainer = _trainer(tmp_path, callbacks=[OODEvaluation()])
    trainer.fit(clf, datamodule=dm)
    for k, v in net.backbone.state_dict().items():  # BatchNorm statistics included
        torch.testing.assert_close(v, backbone_before[k], rtol=0, atol=0)
    assert any((a != b).any() for a, b in zip(net.head.parameters(), head_before, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # OODEvaluation's predict_proba
        results = trainer.test(clf, datamodule=dm, verbose=False)[0]
    assert 0 <= results["test/ood_auroc"] <= 1 and 0 <= results["test/ood_auroc_mi"] <= 1
    x = torch.randn(5, 64)
    probs = clf.predictive(x)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    exported = export_predictive(clf, mode="full")
    torch.testing.assert_close(exported(x), probs)
    traced = exported.export(x).module()(x)
    torch.testing.assert_close(traced, probs)


def test_a_checkpoint_restores_the_backbone_and_head_exactly(tmp_path):
    net = from_torch(_torch_model(), last_layers=1, head_covariance="full")
    clf = DVIClassifier(net=net, mode="full", lr=1e-2)
    dm = DigitsDataModule(batch_size=64)
    trainer = _trainer(tmp_path)
    trainer.fit(clf, datamodule=dm)
    path = tmp_path / "head.ckpt"
    trainer.save_checkpoint(path)
    x = torch.randn(7, 64)
    want = clf.eval().predictive(x)
    # a backbone of the same architecture with other weights: the file's tensors replace them
    other = from_torch(_torch_model(seed=1), last_layers=1, head_covariance="full")
    loaded = DVIClassifier.load_from_checkpoint(path, net=other)
    assert torch.equal(loaded.eval().predictive(x), want)
    with pytest.raises(ValueError, match="pass net= with the same architecture"):
        DVIClassifier.load_from_checkpoint(path)
    # the file is data: it loads with weights_only=True (no pickled torch code)
    state = torch.load(path, weights_only=True)
    assert any(k.startswith("net.backbone.") for k in state["state_dict"])


class _FlatResNet(nn.Module):
    """A ResNet-18 on digits given as 64 features: the last two weight layers cut a block."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        from lightning_dvi_benchmarks.torch_resnet import resnet18

        torch.manual_seed(seed)
        self.resnet = resnet18(num_classes=10, in_channels=1, small_input=True, width=4)

    def forward(self, x):
        return self.resnet(x.unflatten(1, (1, 8, 8)))


def _flat_resnet(seed=0):
    model = _FlatResNet(seed).train()
    with torch.no_grad():
        model(torch.randn(32, 64))  # non-trivial BatchNorm statistics
    return model.eval()


def _dense_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    with torch.no_grad():
        model(torch.randn(32, 64))  # non-trivial BatchNorm statistics
    return model.eval()


def test_a_two_input_head_trains_exports_and_restores_from_a_checkpoint(tmp_path):
    net = from_torch(_flat_resnet(), last_layers=2)
    assert net.head.num_inputs == 2
    backbone_before = {k: v.clone() for k, v in net.backbone.state_dict().items()}
    head_before = [p.detach().clone() for p in net.head.parameters()]
    clf = DVIClassifier(net=net, mode="full", lr=1e-2)
    trainer = _trainer(tmp_path)
    trainer.fit(clf, datamodule=DigitsDataModule(batch_size=64))
    for k, v in net.backbone.state_dict().items():
        torch.testing.assert_close(v, backbone_before[k], rtol=0, atol=0)
    assert any((a != b).any() for a, b in zip(net.head.parameters(), head_before, strict=True))
    x = torch.randn(5, 64)
    probs = clf.eval().predictive(x)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5))
    exported = export_predictive(clf, mode="full")
    torch.testing.assert_close(exported(x), probs)
    path = tmp_path / "two.ckpt"
    trainer.save_checkpoint(path)
    loaded = DVIClassifier.load_from_checkpoint(
        path, net=from_torch(_flat_resnet(seed=1), last_layers=2), weights_only=True
    )
    assert torch.equal(loaded.eval().predictive(x), probs)
    state = torch.load(path, weights_only=True)
    assert any(k.startswith("net.head.layers.resnet_layer4_1_conv2.") for k in state["state_dict"])


def _fit_one_step(tmp_path, net):
    clf = DVIClassifier(net=net, num_classes=10, lr=1e-3)
    _trainer(tmp_path, max_steps=1).fit(clf, datamodule=DigitsDataModule(batch_size=32))
    return clf


def test_a_network_converted_from_an_eval_model_trains_its_batch_norm(tmp_path):
    """Lightning 2.x keeps modes at fit start: the fit puts the converted net in train mode."""
    net = from_torch(_dense_model())  # the torch model is in eval mode, and so is its copy
    bn = net[1]
    assert not bn.training
    before, count = bn.running_mean.clone(), int(bn.num_batches_tracked)
    with pytest.warns(UserWarning, match=r"train mode.*: net\.layers\.1 \(BatchNorm1d\)"):
        _fit_one_step(tmp_path, net)
    assert bn.training and int(bn.num_batches_tracked) == count + 1
    assert not torch.equal(bn.running_mean, before)  # batch statistics, as a fit does
    # freeze_statistics=True trains on the running statistics on purpose: no warning
    net = from_torch(_dense_model())
    net[1].freeze_statistics = True
    before = net[1].running_mean.clone()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fit put batch normalization.*")
        _fit_one_step(tmp_path, net)
    assert torch.equal(net[1].running_mean, before)


def test_a_frozen_backbone_stays_in_eval_mode_through_fit(tmp_path):
    net = from_torch(_torch_model(), last_layers=1)
    net.eval()  # even from eval mode: the fit trains the head, the backbone stays frozen
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*fit put batch normalization.*")
        clf = _fit_one_step(tmp_path, net)
    assert clf.training and net.head.training and not net.backbone.training
    unfrozen = from_torch(_torch_model(), last_layers=1, freeze_backbone=False)
    unfrozen.eval()
    with pytest.warns(UserWarning, match="fit put batch normalization in train mode"):
        _fit_one_step(tmp_path, unfrozen)
    assert unfrozen.backbone.training

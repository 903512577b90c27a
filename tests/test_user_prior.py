"""Priors given to the front ends as objects (issue 40 item 3), and a prior defined here.

``FanInPrior`` gives each weight group the variance :math:`c/\\mathrm{fan_{in}}` (biases ``c``):
not in the library, so training, the KL, the hyper-parameters and a ``weights_only`` checkpoint
reload all go through the :class:`~lightning_dvi.priors.Prior` interface and
:func:`~lightning_dvi.priors.register_prior` alone. Its KL is checked against the closed form
written out here with ``torch.distributions``.
"""

from __future__ import annotations

import re

import pytest
import torch
from helpers import cpu_trainer
from torch import Tensor
from torch.distributions import Normal, kl_divergence
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.nn import ParameterGroup, mlp, parameter_groups
from lightning_dvi.priors import (
    SHORTHANDS,
    EmpiricalBayes,
    GaussianPrior,
    Prior,
    prior_config,
    register_prior,
    resolve_prior,
)


@register_prior
class FanInPrior(Prior):
    r""":math:`w\sim\mathcal N(0, c/\mathrm{fan_{in}})` for weights, :math:`\mathcal N(0, c)` for biases."""

    def __init__(self, c: float = 2.0) -> None:
        super().__init__()
        self.c = float(c)

    def variance(self, group: ParameterGroup) -> Tensor:
        fan_in = group.loc.shape[-1] if group.loc.dim() > 1 else 1
        return torch.tensor(self.c / fan_in, dtype=group.loc.dtype)


class Unregistered(GaussianPrior):
    pass


def _data(n: int = 48) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 2, generator=g)
    y = x[:, :1].sin() + 0.1 * torch.randn(n, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=16)


def test_a_user_prior_has_the_closed_form_kl():
    net = mlp(3, [5], 2)
    expected = torch.zeros(())
    for group in parameter_groups(net):
        fan_in = group.loc.shape[-1] if group.loc.dim() > 1 else 1
        prior = Normal(0.0, (2.0 / fan_in) ** 0.5)
        expected = expected + kl_divergence(Normal(group.loc, group.scale), prior).sum()
    torch.testing.assert_close(FanInPrior().kl(net), expected)


def test_gaussian_object_equals_the_gaussian_shorthand():
    torch.manual_seed(0)
    by_name = DVIRegressor(1, [4], prior="gaussian", prior_variance=0.1)
    torch.manual_seed(0)
    by_object = DVIRegressor(1, [4], prior=GaussianPrior(0.1))
    torch.testing.assert_close(by_object.prior.kl(by_object.net), by_name.prior.kl(by_name.net))
    for a, b in zip(by_name.net.buffers(), by_object.net.buffers(), strict=True):
        assert torch.equal(a, b)  # the layers start at the prior's variance either way
    assert by_object.hparams["prior"] == {
        "class_path": "lightning_dvi.priors.GaussianPrior",
        "init_args": {"variance": 0.1},
    }
    assert by_name.hparams["prior"] == "gaussian"


def test_empirical_bayes_object_equals_its_shorthand():
    torch.manual_seed(0)
    by_name = DVIRegressor(1, [4], prior_alpha=2.0, eb_mode="buffer")
    torch.manual_seed(0)
    by_object = DVIRegressor(1, [4], prior=EmpiricalBayes(alpha=2.0, mode="buffer"))
    assert by_object.prior.init_args == {"alpha": 2.0, "beta": 10.0, "mode": "buffer"}
    torch.testing.assert_close(by_object.prior.kl(by_object.net), by_name.prior.kl(by_name.net))


def test_a_user_prior_trains_and_reloads_weights_only(tmp_path):
    torch.manual_seed(0)
    model = DVIRegressor(2, [8], prior=FanInPrior(c=1.5), lr=1e-2)
    trainer = cpu_trainer(max_epochs=2, default_root_dir=tmp_path)
    trainer.fit(model, _data())
    assert trainer.global_step == 6
    assert all(torch.isfinite(p).all() for p in model.parameters())
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    assert model.hparams["prior"] == {
        "class_path": f"{__name__}.FanInPrior",
        "init_args": {"c": 1.5},
    }
    loaded = DVIRegressor.load_from_checkpoint(path)
    assert isinstance(loaded.prior, FanInPrior) and loaded.prior.c == 1.5
    torch.testing.assert_close(loaded.prior.kl(loaded.net), model.prior.kl(model.net))


def test_a_classifier_takes_a_prior_object():
    model = DVIClassifier(2, 3, [4], prior=FanInPrior())
    assert isinstance(model.prior, FanInPrior)
    assert model.hparams["prior"]["class_path"].endswith("FanInPrior")


def test_an_unregistered_prior_class_is_refused_from_a_configuration(tmp_path):
    model = DVIRegressor(2, [4], prior=Unregistered(0.5))
    trainer = cpu_trainer(max_epochs=1, default_root_dir=tmp_path)
    trainer.fit(model, _data(16))
    path = tmp_path / "model.ckpt"
    trainer.save_checkpoint(path)
    with pytest.raises(
        ValueError, match=r"refusing to build the prior .*Unregistered.*register_prior"
    ):
        DVIRegressor.load_from_checkpoint(path)
    with pytest.raises(ValueError, match=r"refusing to build the prior 'os\.system'"):
        resolve_prior({"class_path": "os.system", "init_args": {}}, {}, "test")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [  # the messages, escaped as regular expressions
        ({"prior": "laplace"}, "prior must be 'empirical_bayes' or 'gaussian', got 'laplace'"),
        ({"prior": 3}, "a Prior or a {'class_path', 'init_args'} configuration, got 3"),
        ({"prior": GaussianPrior(0.1), "prior_alpha": 2.0}, "prior_alpha configure the prior"),
        ({"prior": EmpiricalBayes(), "eb_mode": "buffer"}, "eb_mode configure the prior"),
        ({"prior": GaussianPrior(0.1), "prior_variance": 0.5}, "contradicts the GaussianPrior"),
        ({"prior": FanInPrior(), "prior_variance": -1.0}, "prior_variance"),
    ],
)
def test_bad_prior_arguments_fail_clearly(kwargs, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        DVIRegressor(1, [4], **kwargs)


def test_the_shorthand_table_builds_the_library_priors():
    options = {"prior_alpha": 3.0, "prior_beta": 4.0, "eb_mode": "buffer", "prior_variance": 0.2}
    eb = SHORTHANDS["empirical_bayes"](options)
    assert isinstance(eb, EmpiricalBayes) and (eb.alpha, eb.beta, eb.mode) == (3.0, 4.0, "buffer")
    gaussian = SHORTHANDS["gaussian"](options)
    assert isinstance(gaussian, GaussianPrior) and gaussian.prior_variance == 0.2
    assert prior_config(gaussian) == {
        "class_path": "lightning_dvi.priors.GaussianPrior",
        "init_args": {"variance": 0.2},
    }

"""The cheaper validation and loss assembly give the same values and the same errors."""

import math

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian, HomoscedasticGaussian
from lightning_dvi.likelihoods import functional as LF
from lightning_dvi.nn import mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes


@pytest.mark.parametrize("kl_weight", [1.0, 0.25, 0.0])
@pytest.mark.parametrize("mode", ["diag", "full"])
def test_loss_and_elbo_are_the_documented_expressions(kl_weight: float, mode: str) -> None:
    torch.manual_seed(0)
    net, lik, prior = mlp(3, [6], 2).double(), HeteroscedasticGaussian(), EmpiricalBayes()
    x, y = torch.randn(9, 3, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    terms = elbo(net, lik, prior, x, y, 50, mode=mode, kl_weight=kl_weight)
    ell, kl = terms.expected_log_likelihood.detach(), terms.kl.detach()
    assert terms.loss.item() == -(ell - kl_weight * kl / 50).item()
    assert terms.elbo.item() == (ell - kl / 50).item()
    assert not terms.elbo.requires_grad and terms.loss.requires_grad


def test_finite_check_survives_an_overflowing_sum() -> None:
    # float32 targets whose sum overflows but whose entries are finite are valid
    y = torch.full((4,), 3e38)
    out = Gaussian(torch.zeros(4, 2), var=torch.ones(4, 2))
    assert torch.isinf(y.sum())
    assert HeteroscedasticGaussian().validate_target(y, out) is y
    with pytest.raises(ValueError, match="NaN or Inf"):
        HeteroscedasticGaussian().validate_target(torch.tensor([3e38, 3e38, -math.inf, 0]), out)
    with pytest.raises(ValueError, match="NaN or Inf"):
        HomoscedasticGaussian().validate_target(torch.tensor([math.inf, -math.inf]), 2)


def test_diag_and_full_parts_match_the_selects() -> None:
    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(5, 2, generator=gen, dtype=torch.float64)
    a = torch.randn(5, 2, 2, generator=gen, dtype=torch.float64)
    cov = a @ a.transpose(-1, -2)
    y = torch.randn(5, generator=gen, dtype=torch.float64)
    lik = HeteroscedasticGaussian()
    for out in (Gaussian(mean, cov=cov), Gaussian(mean, var=cov.diagonal(dim1=-2, dim2=-1))):
        cov_ml = cov[:, 0, 1] if out.is_full else torch.zeros(5, dtype=torch.float64)
        want = LF.heteroscedastic_expected_log_prob(
            mean[:, 0], cov[:, 0, 0], mean[:, 1], cov[:, 1, 1], cov_ml, y
        )
        # the module runs the packed one-node form (eab61fb): the same formula, a last-bit
        # rounding apart; selecting the wrong covariance part moves the value by 48-93 %
        torch.testing.assert_close(lik.expected_log_prob(out, y), want, rtol=1e-14, atol=0.0)


@pytest.mark.parametrize(
    ("y", "match"),
    [
        (torch.tensor([0, 3, 1]), r"out of range \[0, 3\): min 0, max 3"),
        (torch.tensor([-2, 1, 1]), r"out of range \[0, 3\): min -2, max 1"),
        (torch.tensor([0.0, 1.5, 1.0]), "non-integer"),
        (torch.tensor([0.0, math.inf, 1.0]), "NaN or Inf"),
    ],
)
def test_categorical_label_errors_keep_their_messages(y: torch.Tensor, match: str) -> None:
    out = Gaussian(torch.zeros(3, 3), var=torch.ones(3, 3))
    with pytest.raises(ValueError, match=match):
        Categorical(3).expected_log_prob(out, y)


def test_categorical_accepts_integral_float_labels_and_empty_batches() -> None:
    lik = Categorical(3)
    assert lik.validate_target(torch.tensor([0.0, 2.0]), 2).dtype == torch.long
    assert lik.validate_target(torch.zeros(0, dtype=torch.long), 0).shape == (0,)

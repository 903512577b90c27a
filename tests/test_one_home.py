"""One home per concept: modes, parameter groups, the renamed callback, deprecated names."""

from __future__ import annotations

import warnings

import pytest

from lightning_dvi import gaussian
from lightning_dvi.nn import mlp, named_parameter_groups, parameter_groups


def test_modes_have_one_definition():
    from lightning_dvi import propagation
    from lightning_dvi.lightning import _base

    assert propagation.MODES == ("full", "diag", "sample", "local")
    assert gaussian.MODES is propagation.MODES and gaussian.Mode is propagation.Mode
    assert _base.Mode is propagation.Mode
    # every mode string is resolved by the one table (issue 40 item 2)
    assert [propagation.propagation(m, 2 if m in ("sample", "local") else None).name
            for m in propagation.MODES] == list(propagation.MODES)  # fmt: skip


def test_parameter_groups_have_one_walk():
    from lightning_dvi import priors

    net = mlp(2, [3], 1)
    named = named_parameter_groups(net)
    assert [n for n, _ in named][:2] == ["layers.0.weight", "layers.0.bias"]
    assert [g.loc for _, g in named] == [g.loc for g in parameter_groups(net)]
    assert priors.named_parameter_groups is named_parameter_groups


def test_empirical_bayes_callback_is_renamed_with_a_deprecated_alias():
    from lightning_dvi.callbacks import EmpiricalBayes, EmpiricalBayesRefresh

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        new = EmpiricalBayesRefresh(every_n_steps=4)  # no warning
    with pytest.warns(FutureWarning, match="EmpiricalBayesRefresh"):
        old = EmpiricalBayes(every_n_steps=4)
    assert isinstance(old, EmpiricalBayesRefresh)
    # checkpoints written under the old name restore into the new one
    assert old.state_key == new.state_key
    assert new.state_key.startswith("EmpiricalBayes{")


def test_reliability_bins_live_in_metrics_and_reproduce_the_ece():
    import numpy as np
    import torch

    from lightning_dvi.metrics import ClassificationMetrics
    from lightning_dvi.metrics.functional import reliability_bins

    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(500, 4, generator=gen), -1).double()
    target = torch.randint(0, 4, (500,), generator=gen)
    metrics = ClassificationMetrics(4, n_bins=10).set_dtype(torch.float64)
    metrics.update(probs, target)
    bins = metrics["ece"].reliability_bins()
    conf, hit = probs.max(-1).values, (probs.argmax(-1) == target).double()
    index = np.minimum((conf.numpy() * 10).astype(int), 9)  # [b/10, (b+1)/10)
    count = np.bincount(index, minlength=10)
    np.testing.assert_array_equal(bins["count"].numpy(), count)
    mean_conf = np.bincount(index, conf.numpy(), 10) / np.maximum(count, 1)
    np.testing.assert_allclose(bins["confidence"].numpy(), mean_conf, rtol=1e-12)
    ece = (bins["count"] / 500 * (bins["accuracy"] - bins["confidence"]).abs()).sum()
    assert ece.item() == pytest.approx(metrics.compute()["ece"].item(), abs=1e-6)  # float32 ECE
    again = reliability_bins(conf, hit, 10)
    torch.testing.assert_close(again["accuracy"], bins["accuracy"])


def test_dead_public_names_are_deprecated_not_deleted():
    import numpy as np
    import torch
    from scipy import stats

    from lightning_dvi import metrics, moments

    x = torch.linspace(-5, 5, 11, dtype=torch.float64)
    with pytest.warns(DeprecationWarning, match="soft_relu"):
        sr = moments.soft_relu(x)
    ref = stats.norm.pdf(x.numpy()) + x.numpy() * stats.norm.cdf(x.numpy())
    np.testing.assert_allclose(sr.numpy(), ref, rtol=1e-10, atol=1e-300)
    with pytest.warns(DeprecationWarning, match="min_variance"):
        assert moments.min_variance(torch.float64) == 1e-30
    with pytest.warns(DeprecationWarning, match="RegressionMetrics"):
        assert isinstance(metrics.regression_metrics(), metrics.RegressionMetrics)
    with pytest.warns(DeprecationWarning, match="ClassificationMetrics"):
        assert isinstance(metrics.classification_metrics(3), metrics.ClassificationMetrics)


def test_elementwise_gaussian_kl_lives_in_priors_and_matches_torch():
    import torch

    from lightning_dvi.priors.functional import gaussian_kl_elementwise

    g = torch.Generator().manual_seed(0)
    q_loc, p_loc = (
        torch.randn(5, generator=g, dtype=torch.float64),
        torch.randn(5, dtype=torch.float64, generator=g),
    )
    q_var = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    p_var = torch.rand(5, generator=g, dtype=torch.float64) + 0.1
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(q_loc, q_var.sqrt()),
        torch.distributions.Normal(p_loc, p_var.sqrt()),
    )
    torch.testing.assert_close(gaussian_kl_elementwise(q_loc, q_var, p_loc, p_var), ref)

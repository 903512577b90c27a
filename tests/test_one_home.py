"""One home per concept: modes, parameter groups, the renamed callback, deprecated names."""

from __future__ import annotations

import warnings

import pytest

from lightning_dvi import gaussian
from lightning_dvi.nn import mlp, named_parameter_groups, parameter_groups


def test_modes_have_one_definition():
    from lightning_dvi.lightning import _base
    from lightning_dvi.pyro import guide

    assert gaussian.MODES == ("full", "diag", "sample", "local")
    assert _base.Mode is gaussian.Mode
    assert _base._MODES is gaussian.MODES and _base._MC_MODES is gaussian.MONTE_CARLO_MODES
    assert guide.MOMENT_MODES is gaussian.MOMENT_MODES


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

"""Transformer blocks' skip rules (lightning_dvi.moments.skip), the diag TokenWise linear and
frozen weight moments: Monte Carlo over inputs and weights as the oracle of what the
independent rule drops, consistency with the carried rule where the cross term vanishes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dvi.gaussian import Gaussian
from lightning_dvi.moments.skip import SKIP_RULES, check_skip_rule, skip_independent
from lightning_dvi.nn import BayesLinear, TransformerEncoderLayer, from_torch
from lightning_dvi.nn.attention import TokenWise, _independent_skip
from lightning_dvi.nn.posterior import frozen_moments
from lightning_dvi.nn.posthoc import from_torch_posterior, set_rules
from lightning_dvi.propagation import DIAG, FULL, propagation


def _block(norm_first: bool = True, dtype: torch.dtype = torch.float64) -> TransformerEncoderLayer:
    torch.manual_seed(0)
    torch_layer = nn.TransformerEncoderLayer(
        8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
    )
    with torch.no_grad():  # LayerNorm gains away from 1 so the branch Jacobian is generic
        for name, p in torch_layer.named_parameters():
            if name.startswith("norm"):
                p.add_(0.3 * torch.randn_like(p))
    net = from_torch(torch_layer.to(dtype).eval(), scale_fraction=0.1)
    layer = net[0] if not isinstance(net, TransformerEncoderLayer) else net
    assert isinstance(layer, TransformerEncoderLayer)
    return layer


def _input(var: float, dtype: torch.dtype = torch.float64) -> Gaussian:
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(3, 4, 8, generator=gen, dtype=dtype)
    return Gaussian(mean, var=torch.full_like(mean, var))


def test_skip_independent_adds_moments_and_refuses_mismatches():
    m, v = torch.randn(2, 5), torch.rand(2, 5)
    dm, dv = torch.randn(2, 5), torch.rand(2, 5)
    mean, var = skip_independent(m, v, dm, dv)
    torch.testing.assert_close(mean, m + dm)
    torch.testing.assert_close(var, v + dv)
    with pytest.raises(ValueError, match="equal widths"):
        skip_independent(m, v, dm[:, :4], dv[:, :4])
    with pytest.raises(ValueError, match="same storage"):
        skip_independent(m, v, dm, torch.diag_embed(dv))
    assert check_skip_rule("independent") == "independent"
    with pytest.raises(ValueError, match="skip_rule"):
        check_skip_rule("none")
    assert SKIP_RULES == ("carried", "independent")


@pytest.mark.parametrize("mode", [DIAG, FULL])
@torch.no_grad()
def test_rules_agree_where_the_skip_input_is_deterministic(mode):
    """Zero input variance: Cov(x, f(x)) = 0 in the first skip, so dropping it is exact.

    (The second skip's input already carries the attention weights' variance, which its
    branch shares: there the rules differ, as the whole layer's outputs show.)
    """
    layer = _block()
    x = _input(0.0)
    block = layer[0]
    carried = block.propagate(x, mode)
    independent = _independent_skip(block, x, mode)
    assert isinstance(carried, Gaussian)
    assert float(independent.var.min()) > 0
    torch.testing.assert_close(independent.mean, carried.mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(independent.var, carried.var, rtol=1e-10, atol=1e-14)
    if mode.full:
        assert independent.cov is not None and carried.cov is not None
        torch.testing.assert_close(independent.cov, carried.cov, rtol=1e-10, atol=1e-14)
    whole = layer.propagate(x, mode)
    layer.skip_rule = "independent"
    whole_independent = layer.propagate(x, mode)
    assert isinstance(whole, Gaussian) and isinstance(whole_independent, Gaussian)
    torch.testing.assert_close(whole_independent.mean, whole.mean, rtol=0, atol=1e-12)
    assert not torch.allclose(whole_independent.var, whole.var, rtol=1e-6, atol=0)


def _monte_carlo(block, x: Gaussian, draws: int = 20_000) -> tuple[torch.Tensor, torch.Tensor]:
    """Monte Carlo over inputs and weights: ``(Cov(x_i, f_i(x)), Var(x_i + f_i(x)))``."""
    torch.manual_seed(2)
    xs = x.mean + x.var.sqrt() * torch.randn(draws, *x.mean.shape, dtype=x.mean.dtype)
    fs = block.branch.propagate(xs, propagation("sample", num_samples=draws))
    cross = ((xs - xs.mean(0)) * (fs - fs.mean(0))).mean(0)
    return cross, (xs + fs).var(0)


@pytest.mark.parametrize("norm_first", [True, False])
@torch.no_grad()
def test_what_the_independent_rule_drops_is_the_monte_carlo_cross_covariance(norm_first):
    """The MLP skip: carried minus independent variance is 2 Cov(x_i, f_i(x)) of Monte Carlo.

    Its input is the attention skip's output (input variance and the attention weights'),
    20,000 draws of inputs and weights; the carried rule's cross-covariance is exact up to
    the first-order LayerNorm there, so it matches Monte Carlo closely, and the independent
    rule's variance is off by that amount.
    """
    layer = _block(norm_first)
    first, mlp = (layer[0], layer[1]) if norm_first else (layer[0], layer[2])
    x = first.propagate(_input(0.05), DIAG)
    if not norm_first:
        x = layer[1].propagate(x, DIAG)  # norm1
    assert isinstance(x, Gaussian)
    carried = mlp.propagate(x, DIAG)
    independent = _independent_skip(mlp, x, DIAG)
    torch.testing.assert_close(independent.mean, carried.mean, rtol=0, atol=1e-12)
    dropped = (carried.var - independent.var) / 2
    cross, total_var = _monte_carlo(mlp, x)
    size = float(cross.abs().mean())
    assert size > 1e-4  # not a trivial case: the cross-covariance is there
    assert float((dropped - cross).abs().mean()) < 0.1 * size
    assert float((dropped - cross).abs().max()) < 0.1 * float(cross.abs().max())
    # the independent rule is off from Monte Carlo by -2 Cov; the carried rule is closer
    off = independent.var - total_var
    assert float((off + 2 * cross).abs().mean()) < 0.5 * float((2 * cross).abs().mean())
    err_carried = float((carried.var.sqrt() / total_var.sqrt() - 1).abs().mean())
    err_independent = float((independent.var.sqrt() / total_var.sqrt() - 1).abs().mean())
    assert err_carried < err_independent < 0.1  # within docs/transformers.md's skip table


@pytest.mark.parametrize("norm_first", [True, False])
@torch.no_grad()
def test_independent_attention_skip_against_monte_carlo(norm_first):
    """The attention skip at input variance 0.05: both rules' std within 20 % of Monte Carlo.

    (There the carried rule takes each token's own share of its value path only, not the
    path through the attention weights, so it is not the Monte Carlo cross-covariance
    either; docs/transformers.md tabulates both.)
    """
    block = _block(norm_first)[0]
    x = _input(0.05)
    _, total_var = _monte_carlo(block, x)
    for got in (block.propagate(x, DIAG), _independent_skip(block, x, DIAG)):
        assert isinstance(got, Gaussian)
        rel = (got.var.sqrt() / total_var.sqrt() - 1).abs()
        assert float(rel.mean()) < 0.06 and float(rel.max()) < 0.2


def test_skip_rule_through_set_rules_and_the_description():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    ).eval()
    net = from_torch_posterior(model, 0.05, skip_rule="independent")
    layer = next(m for m in net.modules() if isinstance(m, TransformerEncoderLayer))
    assert layer.skip_rule == "independent" and layer.options["skip_rule"] == "independent"
    assert set_rules(net, skip_rule="carried") == 1 and layer.skip_rule == "carried"
    with pytest.raises(ValueError, match="skip_rule"):
        set_rules(net, skip_rule="dropped")  # type: ignore[arg-type]  # the refused value
    layer.skip_rule = "independent"
    rebuilt = TransformerEncoderLayer(**layer.options)
    assert rebuilt.skip_rule == "independent"
    x = Gaussian(torch.randn(2, 3, 8), var=torch.full((2, 3, 8), 0.1))
    one = net(x, mode="diag")
    set_rules(net, skip_rule="carried")
    two = net(x, mode="diag")
    # the input carries variance: the rules differ (the second skip's input variance, and so
    # the moments after it)
    assert not torch.allclose(one.var, two.var)


@pytest.mark.parametrize("width", [4, 16, 24])
def test_tokenwise_diag_linear_equals_the_layers_variances(width):
    torch.manual_seed(0)
    linear = BayesLinear(6, width, init_scale=0.1).double()
    x = Gaussian(torch.randn(2, 5, 6, dtype=torch.float64), var=torch.rand(2, 5, 6).double())
    got = TokenWise(linear).propagate(x, DIAG)
    want = linear.propagate(x, DIAG)
    assert isinstance(got, Gaussian) and isinstance(want, Gaussian)
    assert got.cov is None  # per-token variances, not a head's covariance
    torch.testing.assert_close(got.mean, want.mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.var, want.var, rtol=1e-12, atol=1e-12)
    full = TokenWise(linear).propagate(x, FULL)  # other modes unchanged
    assert isinstance(full, Gaussian) and full.cov is not None


@torch.no_grad()
def test_frozen_moments_reproduce_the_pass_and_are_a_snapshot():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    ).eval()
    net = from_torch_posterior(model, 0.05)
    x = torch.randn(2, 3, 8)
    want = net(x, mode="diag")
    frozen = frozen_moments(net)
    for _ in range(2):  # reusable
        with frozen:
            got = net(x, mode="diag")
        torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=0)
        torch.testing.assert_close(got.var, want.var, rtol=0, atol=0)
    from lightning_dvi.nn.posthoc import scale_posterior

    scale_posterior(net, 3.0)
    with frozen:  # the snapshot does not see the change
        torch.testing.assert_close(net(x, mode="diag").var, want.var, rtol=0, atol=0)
    assert float(net(x, mode="diag").var.mean()) > 2 * float(want.var.mean())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_first_order_in_one_pass_equals_the_routed_form(dtype, affine):
    """layer_norm_first_order_diag = normalize_diag(route="first_order") then the affine map."""
    from lightning_dvi.moments.layer_norm import layer_norm_first_order_diag, normalize_diag

    gen = torch.Generator().manual_seed(0)
    mean = torch.randn(4, 5, 16, generator=gen, dtype=torch.float64).to(dtype)
    var = (0.1 * torch.rand(4, 5, 16, generator=gen, dtype=torch.float64)).to(dtype)
    weight = (1 + 0.3 * torch.randn(16, generator=gen, dtype=torch.float64)).to(dtype)
    bias = (0.2 * torch.randn(16, generator=gen, dtype=torch.float64)).to(dtype)
    got = layer_norm_first_order_diag(
        mean, var, 1e-5, weight if affine else None, bias if affine else None
    )
    m, v = normalize_diag(mean, var, 1e-5, "first_order")
    want = (weight * m + bias, weight**2 * v) if affine else (m, v)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got[0], want[0], rtol=tol, atol=tol)
    torch.testing.assert_close(got[1], want[1], rtol=tol, atol=tol * float(want[1].max()))

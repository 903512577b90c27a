"""Declared modules in all four modes, against Monte Carlo over whole weight draws."""

import math

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo, monte_carlo_moments
from lightning_dvi.moments import HEAD_WIDTH
from lightning_dvi.nn import (
    BayesLinear,
    Heaviside,
    ReLU,
    Residual,
    Sequential,
    bayes_layers,
    mlp,
    parameter_groups,
)
from lightning_dvi.nn.registry import activation_specs


def test_paper_toy_net_full_mode_matches_20k_weight_draws():
    # Paper Fig. 3 setting: 1-128-128-2 ReLU net at initialisation, input x = 0.25.
    torch.manual_seed(0)
    net = mlp(1, [128, 128], 2)
    x = torch.tensor([[0.25], [-0.4]])
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000, chunk_size=2_000)
    assert res.mean_error <= 0.05, res
    assert res.std_rel_error <= 0.05, res


def test_residual_net_matches_monte_carlo():
    torch.manual_seed(1)
    net = mlp(1, [25] * 5, 2, residual=True)
    assert sum(isinstance(m, Residual) for m in net) == 4
    res = compare_with_monte_carlo(
        net, torch.tensor([[0.25]]), num_samples=20_000, chunk_size=4_000
    )
    assert res.mean_error <= 0.05 and res.std_rel_error <= 0.05, res


def test_local_mode_has_exact_marginals_for_one_layer():
    torch.manual_seed(2)
    layer = BayesLinear(3, 2, init_scale=0.5)
    x = torch.randn(4, 3)
    g = layer(x, mode="diag")
    with torch.no_grad():
        s = layer(x, mode="local", num_samples=100_000)
    se = s.std(0) / math.sqrt(s.shape[0])
    assert ((s.mean(0) - g.mean).abs() <= 4 * se).all()
    torch.testing.assert_close(s.var(0), g.var.detach(), rtol=0.03, atol=1e-6)


def test_sample_mode_shares_weights_across_the_batch():
    # Whole weight draws: two identical inputs in one batch get identical outputs per sample.
    net = mlp(2, [8], 1)
    x = torch.ones(2, 2)
    out = net(x, mode="sample", num_samples=5)
    assert out.shape == (5, 2, 1)
    torch.testing.assert_close(out[:, 0], out[:, 1])
    assert out[:, 0].std() > 0


@pytest.mark.parametrize("mode", ["full", "diag"])
@pytest.mark.parametrize("outputs", [2, HEAD_WIDTH + 1])
def test_shapes_and_kinds(mode, outputs):
    # diag mode keeps the covariance of a narrow head's outputs only (moments.HEAD_WIDTH)
    net = mlp(3, [16, 16], outputs, residual=True)
    out = net(torch.randn(7, 3), mode=mode)
    assert isinstance(out, Gaussian) and out.mean.shape == (7, outputs)
    assert out.is_full == (mode == "full" or outputs <= HEAD_WIDTH)
    if out.is_full:
        torch.testing.assert_close(out.cov, out.cov.transpose(-1, -2))


def test_diag_mode_equals_full_mode_fed_diagonal_covariances():
    torch.manual_seed(3)
    net = mlp(3, [10, 10], 2)
    x = torch.randn(5, 3, dtype=torch.float64)
    net = net.double()
    h = x
    g = None
    for layer in net:
        g = layer(g if g is not None else h, mode="full")
        g = g.to_diag().to_full() if isinstance(g, Gaussian) else g
    diag = net(x, mode="diag")
    torch.testing.assert_close(diag.mean, g.mean)
    torch.testing.assert_close(diag.var, g.var)


def test_activation_on_gaussian_returns_gaussian_of_same_kind():
    g = Gaussian(torch.randn(4, 3), cov=torch.eye(3).expand(4, 3, 3).clone())
    for act in (ReLU(), Heaviside()):
        out = act(g, mode="full")
        assert isinstance(out, Gaussian) and out.is_full
        out_d = act(g.to_diag(), mode="diag")
        assert not out_d.is_full
        torch.testing.assert_close(out.var, out_d.var)
    torch.testing.assert_close(ReLU()(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))


def test_parameter_groups_and_positive_scales():
    net = mlp(2, [4], 1, scale_transform="exp", init_scale=0.05)
    groups = parameter_groups(net)
    assert [g.name for g in groups] == ["weight", "bias", "weight", "bias"]
    assert all((g.scale > 0).all() for g in groups)
    assert groups[0].scale.flatten()[0].item() == pytest.approx(0.05)
    assert len(list(bayes_layers(net))) == 2
    assert any(k.endswith("weight_prior_variance") for k in net.state_dict())


def test_has_posterior_and_parameter_groups_fast_paths_equal_the_protocol_walk():
    """has_posterior's direct attribute check answers as isinstance(m, HasPosterior) does;
    parameter_groups (no names) returns named_parameter_groups' groups in the same order."""
    from lightning_dvi.nn import HasPosterior, has_posterior, named_parameter_groups

    class WithGroups(torch.nn.Module):
        def parameter_groups(self):
            return []

    class Disabled(torch.nn.Module):
        parameter_groups = None

    class NotAModule:
        def parameter_groups(self):
            return []

    per_instance = torch.nn.Module()
    per_instance.parameter_groups = lambda: []
    net = mlp(3, [5, 4], 2, residual=True)
    candidates = [*net.modules(), torch.nn.Linear(2, 2), WithGroups(), Disabled(), NotAModule()]
    for m in [*candidates, per_instance, object()]:
        protocol = isinstance(m, torch.nn.Module) and isinstance(m, HasPosterior)
        assert has_posterior(m) == protocol, type(m).__name__
    assert sum(has_posterior(m) for m in net.modules()) == 3
    named = named_parameter_groups(net)
    fast = parameter_groups(net)
    assert [g.name for g in fast] == [g.name for _, g in named]
    assert all(
        a.loc is b.loc and a.module is b.module for a, (_, b) in zip(fast, named, strict=True)
    )


def test_gradients_flow_in_every_mode():
    net = mlp(2, [6, 6], 2, residual=True)
    x = torch.randn(3, 2)
    for mode in ("full", "diag", "sample", "local"):
        net.zero_grad()
        out = net(x, mode=mode, num_samples=2) if mode in ("sample", "local") else net(x, mode=mode)
        loss = out.sum() if isinstance(out, torch.Tensor) else out.mean.sum() + out.var.sum()
        loss.backward()
        grads = [p.grad for p in net.parameters()]
        assert all(g is not None and torch.isfinite(g).all() for g in grads), mode


def test_monte_carlo_moments_is_unbiased_for_linear_model():
    layer = BayesLinear(2, 1, init_scale=0.3).double()
    x = torch.tensor([[1.0, -2.0]], dtype=torch.float64)
    mean, cov = monte_carlo_moments(layer, x, num_samples=50_000, chunk_size=10_000)
    g = layer(x, mode="diag")
    assert abs(mean.item() - g.mean.item()) < 4 * math.sqrt(g.var.item() / 50_000)
    assert cov.item() == pytest.approx(g.var.item(), rel=0.03)


# ------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda n: n(torch.randn(4, 5)), "last dimension 3"),
        (lambda n: n(torch.tensor([[float("nan"), 0.0, 0.0]])), "NaN"),
        (lambda n: n(torch.randn(2, 3), mode="bogus"), "unknown mode 'bogus'"),
        (lambda n: n(torch.randn(2, 3), mode="sample", num_samples=0), "num_samples"),
        (lambda n: n(torch.randn(2, 3), mode="full", num_samples=3), "num_samples"),
        (lambda n: n(torch.zeros(2, 3, dtype=torch.long)), "floating"),
        (
            lambda n: n(Gaussian(torch.zeros(2, 3), var=torch.ones(2, 3)), mode="sample"),
            "tensor input",
        ),
    ],
)
def test_bad_inputs_raise_value_error(call, match):
    net = mlp(3, [4], 1)
    with pytest.raises(ValueError, match=match):
        call(net)


def test_bad_construction():
    with pytest.raises(ValueError, match="equal widths"):
        Residual(ReLU(), BayesLinear(3, 4))(Gaussian(torch.zeros(1, 3), var=torch.ones(1, 3)))
    with pytest.raises(TypeError, match=r"lightning_dvi\.nn modules"):
        Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"registered activation, one of \[.*'tanh'"):
        mlp(1, [2], 1, activation="swish")
    with pytest.raises(ValueError, match="init_scale"):
        BayesLinear(2, 2, init_scale=-1.0)
    with pytest.raises(ValueError, match="scale_transform"):
        BayesLinear(2, 2, scale_transform="square")
    # the same checks as BayesLinearFullCov (posterior_init_settings): finite and positive
    with pytest.raises(ValueError, match="init_loc_std must be finite and positive"):
        BayesLinear(2, 2, init_loc_std=float("nan"))
    with pytest.raises(ValueError, match="init_bias_scale must be finite and positive"):
        BayesLinear(2, 2, init_bias_scale=float("inf"))
    with pytest.raises(ValueError, match="prior_variance must be finite and positive"):
        BayesLinear(2, 2, prior_variance=float("nan"))


def test_full_mode_keeps_exactly_diagonal_stages_cheap_but_equal():
    # Internally the first layer and its activation stay in diag storage; the result must equal
    # propagation with explicit full covariances everywhere.
    from lightning_dvi.moments import linear_full, relu_full

    torch.manual_seed(4)
    net = mlp(2, [5, 5], 2).double()
    x = torch.randn(3, 2, dtype=torch.float64)
    out = net(x, mode="full")
    g_mean, g_cov = x, None
    for layer in net:
        if isinstance(layer, BayesLinear):
            w_loc, w_var, b_loc, b_var = layer._moments()
            if g_cov is None:
                g_cov = torch.zeros(3, 2, 2, dtype=torch.float64)
            g_mean, g_cov = linear_full(g_mean, g_cov, w_loc, w_var, b_loc, b_var)
        else:
            g_mean, g_cov = relu_full(g_mean, g_cov)
    torch.testing.assert_close(out.mean, g_mean)
    torch.testing.assert_close(out.cov, g_cov)


def test_dtype_mismatch_names_both_dtypes():
    with pytest.raises(ValueError, match=r"torch\.float32 but the input is torch\.float64"):
        mlp(3, [4], 1)(torch.zeros(2, 3, dtype=torch.float64))


def test_module_apply_walks_a_network_with_activations():
    # nn.Module.apply(fn) recurses into children; an activation's apply must not shadow it
    # (found by the type checker: the elementwise function was named apply)
    net = mlp(2, [3], 1, activation="relu")
    visited = []
    assert net.apply(lambda m: visited.append(type(m).__name__)) is net
    assert visited.count("ReLU") == 1 and visited.count("BayesLinear") == 2
    x = torch.linspace(-1.0, 1.0, 6).reshape(3, 2)
    relu = next(m for m in net.modules() if type(m).__name__ == "ReLU")
    assert torch.equal(relu.apply(x), torch.relu(x))  # on a tensor: the activation itself


@pytest.mark.parametrize("spec", activation_specs(), ids=lambda s: s.name)
def test_mlp_takes_every_registered_activation_by_name(spec):
    """``mlp(activation=NAME)`` builds the registered class, and its moments stay finite."""
    net = mlp(2, [3, 3], 1, activation=spec.name)
    assert [type(m) for m in net][1::2] == [spec.cls, spec.cls]
    out = net(Gaussian(torch.randn(4, 2), var=torch.full((4, 2), 0.1)), mode="diag")
    assert out.mean.shape == (4, 1) and torch.isfinite(out.mean).all()
    assert torch.isfinite(out.var).all() and (out.var > 0).all()


def test_the_lightning_modules_take_a_registered_activation_by_name():
    from lightning_dvi import DVIRegressor

    model = DVIRegressor(hidden=[4], activation="gelu", in_features=2, num_data=10)
    assert type(model.net[1]).__name__ == "GELU"
    with pytest.raises(ValueError, match="registered activation"):
        DVIRegressor(hidden=[4], activation="swish", in_features=2, num_data=10)


def test_sample_mode_draws_one_weight_matrix_per_sample_for_token_inputs():
    """A sequence ``x [B, T, in]``: every token of sample s goes through sample s's draw, the
    same map as the flattened ``[B*T, in]`` with the same random stream."""
    from lightning_dvi.nn.linear import _affine_values

    layer = BayesLinear(3, 2, init_scale=0.5)
    x = torch.randn(5, 7, 3)
    torch.manual_seed(1)
    tokens = layer(x, mode="sample", num_samples=6)
    torch.manual_seed(1)
    flat = layer(x.reshape(35, 3), mode="sample", num_samples=6)
    assert tokens.shape == (6, 5, 7, 2)
    torch.testing.assert_close(tokens.reshape(6, 35, 2), flat)
    # the given-weights path (a Pyro-style sampled weight [S, out, in]) does the same
    w, b, xs = torch.randn(6, 2, 3), torch.randn(6, 2), x.expand(6, -1, -1, -1)
    expected = torch.einsum("sbti,soi->sbto", xs, w) + b[:, None, None]
    torch.testing.assert_close(_affine_values(xs, w, b), expected)

"""A posterior from elsewhere (issue 42 item 3): per-parameter scales onto converted networks,
IVON and Laplace sources, post-hoc calibration of the scales, Monte Carlo of the same posterior,
and export of the result."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformer_models import TinyGPT2, TinyViT, randomize_norms

from lightning_dvi.likelihoods import Categorical, HomoscedasticGaussian
from lightning_dvi.nn import (
    BayesLinear,
    export_predictive,
    from_torch,
    posthoc,
)
from lightning_dvi.nn.posthoc import (
    calibrate_scales,
    from_torch_posterior,
    ivon_std,
    laplace_std,
    monte_carlo_nll,
    monte_carlo_predictive,
    posterior_parameters,
    predictive_nll,
    prior_std,
    scale_posterior,
)


def _random_std(model: nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        n: torch.rand(p.shape, generator=g, dtype=p.dtype) * 0.1 + 0.01
        for n, p in model.named_parameters()
    }


# --------------------------------------------------------------------------- scales land right
def test_zero_scale_reproduces_torch_exactly_float64():
    torch.manual_seed(0)
    model = randomize_norms(TinyViT()).double().eval()
    net = from_torch_posterior(model, 0.0)
    x = torch.randn(5, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        for mode in ("diag", "full"):
            out = net(x, mode=mode)
            torch.testing.assert_close(out.mean, model(x), rtol=0, atol=1e-12)
            assert out.var.abs().max() == 0


def test_scales_land_on_the_right_layers_of_a_sequential_with_dropped_layers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Dropout(0.1), nn.ReLU(), nn.Linear(5, 2)).double()
    std = _random_std(model)
    net = from_torch_posterior(model, std)
    first, last = net[0], net[2]
    assert isinstance(first, BayesLinear) and isinstance(last, BayesLinear)
    for ours, name in ((first, "0"), (last, "3")):
        torch.testing.assert_close(ours.weight_scale, std[f"{name}.weight"], rtol=1e-12, atol=0)
        torch.testing.assert_close(ours.bias_scale, std[f"{name}.bias"], rtol=1e-12, atol=0)
        torch.testing.assert_close(ours.weight_loc, model.get_submodule(name).weight)


def test_attention_scales_follow_the_in_projection_slices():
    torch.manual_seed(0)
    model = randomize_norms(TinyViT()).double().eval()
    std = _random_std(model)
    net = from_torch_posterior(model, std)
    reference = from_torch(model, scale_fraction=0.0)
    e = 8
    found = {}
    for name, layer in net.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj")) and "blocks_1" in name:
            found[name[-6]] = layer
    whole = std["blocks.1.self_attn.in_proj_weight"]
    bias = std["blocks.1.self_attn.in_proj_bias"]
    for i, key in enumerate("qkv"):
        torch.testing.assert_close(
            found[key].weight_scale, whole[i * e : (i + 1) * e], rtol=1e-12, atol=0
        )
        torch.testing.assert_close(
            found[key].bias_scale, bias[i * e : (i + 1) * e], rtol=1e-12, atol=0
        )
    # the means are those of a plain conversion: only the scales differ
    for (n1, p1), (n2, p2) in zip(
        net.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert n1 == n2
        if "raw_scale" not in n1:
            assert torch.equal(p1, p2), n1
    # LayerNorm gains and the positional table stay point values
    names = posterior_parameters(model)
    assert "blocks.0.norm1.weight" not in names and "pos_embed" not in names
    assert "blocks.0.self_attn.in_proj_weight" in names and "head.bias" in names


def test_gpt2_tied_shapes_and_last_layers():
    torch.manual_seed(0)
    model = TinyGPT2().eval()
    std = _random_std(model)
    net = from_torch_posterior(model, std)
    table = next(m for n, m in net.named_modules() if n.endswith("wte"))
    torch.testing.assert_close(table.weight_scale, std["wte.weight"])
    head = from_torch_posterior(model, std, last_layers=1)
    assert posterior_parameters(model, last_layers=1) == ["lm_head.weight"]
    torch.testing.assert_close(head.head.weight_scale, std["lm_head.weight"])


def test_a_full_covariance_head_gets_the_scales_and_scales_with_its_factor():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
    std = _random_std(model)
    net = from_torch_posterior(model, std, last_layers=1, head_covariance="full")
    weight, bias = net.head.parameter_groups()
    torch.testing.assert_close(weight.scale, std["2.weight"], rtol=1e-10, atol=0)
    torch.testing.assert_close(bias.scale, std["2.bias"], rtol=1e-10, atol=0)
    with torch.no_grad():
        net.head.tril.normal_()  # correlations: the factor scales the whole covariance
    before = net.head.covariance.detach().clone()
    scale_posterior(net, 1.7)
    torch.testing.assert_close(net.head.covariance, 1.7**2 * before)


def test_bad_scale_sources_are_refused():
    model = nn.Sequential(nn.Linear(3, 2))
    with pytest.raises(ValueError, match="not parameters"):
        from_torch_posterior(model, {"0.wieght": torch.ones(2, 3)})
    with pytest.raises(ValueError, match="shape"):
        from_torch_posterior(model, {"0.weight": torch.ones(3, 2), "0.bias": torch.ones(2)})
    with pytest.raises(ValueError, match=r"0\.bias"):
        from_torch_posterior(model, {"0.weight": torch.ones(2, 3)})
    net = from_torch_posterior(model, {"0.weight": torch.ones(2, 3)}, strict=False)
    assert net[0].bias_scale.abs().max() == 0
    with pytest.raises(ValueError, match=">= 0"):
        from_torch_posterior(model, -1.0)


# --------------------------------------------------------------------------- sources
def _hand_built_ivon_state(model: nn.Module) -> tuple[dict, dict[str, torch.Tensor]]:
    """A state_dict of IVON's layout: two groups, flat 'hess', 'ess', 'weight_decay'."""
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    split = [names[:2], names[2:]]
    groups, expected, index = [], {}, 0
    for k, group_names in enumerate(split):
        numel = sum(params[n].numel() for n in group_names)
        hess = torch.rand(numel, dtype=torch.float64) + 0.1
        ess, wd = 1000.0 * (k + 1), 1e-4 * (k + 1)
        groups.append(
            {
                "hess": hess,
                "ess": ess,
                "weight_decay": wd,
                "numel": numel,
                "params": list(range(index, index + len(group_names))),
            }
        )
        offset = 0
        for n in group_names:
            m = params[n].numel()
            expected[n] = (1 / (ess * (hess[offset : offset + m] + wd)).sqrt()).view(
                params[n].shape
            )
            offset += m
        index += len(group_names)
    return {"state": {}, "param_groups": groups}, expected


def test_ivon_std_from_a_hand_built_state_dict():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    state, expected = _hand_built_ivon_state(model)
    got = ivon_std(state, model)
    assert set(got) == set(expected)
    for n, v in expected.items():
        torch.testing.assert_close(got[n], v, rtol=1e-12, atol=0)
    state["param_groups"][0]["hess"] = state["param_groups"][0]["hess"][:-1]
    with pytest.raises(ValueError, match="Hessian"):
        ivon_std(state, model)
    with pytest.raises(ValueError, match="not an IVON"):
        ivon_std({"param_groups": [{"params": [0], "lr": 0.1}]}, model)


def test_ivon_std_matches_ivons_own_sampling():
    ivon = pytest.importorskip("ivon")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = ivon.IVON(model.parameters(), lr=0.05, ess=200.0, weight_decay=1e-3)
    x, y = torch.randn(64, 3), torch.randint(0, 2, (64,))
    for _ in range(20):
        with opt.sampled_params(train=True):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    std = ivon_std(opt, model)
    torch.testing.assert_close(ivon_std(opt.state_dict(), model)["2.weight"], std["2.weight"])
    means = {n: p.detach().clone() for n, p in model.named_parameters()}
    # the same draw, reproduced from the scales: IVON adds randn(numel) / sqrt(ess (h + wd))
    torch.manual_seed(7)
    with opt.sampled_params():
        drawn = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(7)
    eps = torch.randn(sum(p.numel() for p in means.values()))
    offset = 0
    for n, mean in means.items():
        k = mean.numel()
        want = mean + eps[offset : offset + k].view(mean.shape) * std[n]
        torch.testing.assert_close(drawn[n], want, rtol=1e-5, atol=1e-6)
        offset += k
    # and statistically: the spread of 2000 draws is the scale (3 % at 2000 draws, 5 % bound)
    draws = []
    for _ in range(2000):
        with opt.sampled_params():
            draws.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    spread = torch.stack(draws).std(0)
    want = torch.cat([std[n].flatten() for n in means])
    assert ((spread / want - 1).abs().mean()) < 0.05
    net = from_torch_posterior(model, std)
    torch.testing.assert_close(net[2].weight_scale, std["2.weight"])


def test_laplace_std_from_precisions_variances_and_a_last_layer_vector():
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1)).double()
    params = dict(model.named_parameters())
    sizes = [p.numel() for p in params.values()]
    h = torch.rand(sum(sizes), dtype=torch.float64)
    std = laplace_std(model, h, prior_precision=2.0)
    flat = torch.cat([std[n].flatten() for n in params])
    torch.testing.assert_close(flat, (h + 2.0) ** -0.5)
    var = laplace_std(model, variance=1 / (h + 2.0))
    for n in params:
        torch.testing.assert_close(var[n], std[n])
    last = laplace_std(model, torch.full((4,), 4.0), names=["2.weight", "2.bias"])
    assert set(last) == {"2.weight", "2.bias"} and float(last["2.bias"]) == 0.5
    with pytest.raises(ValueError, match="flat vector"):
        laplace_std(model, torch.ones(3))
    with pytest.raises(ValueError, match="exactly one"):
        laplace_std(model)
    with pytest.raises(ValueError, match="positive"):
        laplace_std(model, torch.zeros(sum(sizes)))
    prior = prior_std(model, variance=0.25)
    assert all(bool((v == 0.5).all()) for v in prior.values())


# --------------------------------------------------------------------------- calibration
def _linear_regression_from_a_known_posterior(n: int, seed: int):
    """y = w.x + b + noise with a fresh weight draw w ~ N(mu, s^2) per datum: the predictive is
    exactly the DVI predictive of a linear layer at posterior std s (and noise var 0.01)."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.tensor([[1.0, -2.0, 0.5, 0.0]], dtype=torch.float64)
    s = torch.tensor([[0.3, 0.2, 0.5, 0.4]], dtype=torch.float64)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64) * 2
    w = mu + s * torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = (w * x).sum(-1) + 0.3 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    model = nn.Linear(4, 1).double()
    with torch.no_grad():
        model.weight.copy_(mu)
        model.bias.fill_(0.3)
    return model, s, x, y


@pytest.mark.parametrize("true_factor", [0.25, 3.0])
def test_calibration_recovers_a_known_scale_factor(true_factor):
    model, s, x, y = _linear_regression_from_a_known_posterior(4000, seed=0)
    # the posterior handed in is the true one divided by the factor; bias std 0 (fixed)
    net = from_torch_posterior(model, {"weight": s / true_factor, "bias": torch.zeros(1)})
    lik = HomoscedasticGaussian(init_log_variance=math.log(0.01))
    result = calibrate_scales(net, lik, x, y)
    assert result.factor == pytest.approx(true_factor, rel=0.08)
    assert result.nll_after < result.nll_before
    torch.testing.assert_close(net.layers[0].weight_scale, s / true_factor * result.factor)
    assert predictive_nll(net, lik, x, y) == pytest.approx(result.nll_after, rel=1e-9)


def _classifier_and_data(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))
    x = torch.randn(600, 2)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    noisy = torch.rand(600) < 0.15
    y[noisy] = torch.randint(0, 3, (int(noisy.sum()),))
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(200):  # overfits the first 100 points: over-confident on the rest
        opt.zero_grad()
        nn.functional.cross_entropy(model(x[:100]), y[:100]).backward()
        opt.step()
    return model, x[100:350], y[100:350], x[350:], y[350:]


def test_calibrated_classifier_sits_at_a_validation_nll_minimum():
    model, x_val, y_val, _, _ = _classifier_and_data()
    net = from_torch_posterior(model, prior_std(model, 0.01))
    lik = Categorical(3)
    result = calibrate_scales(net, lik, x_val, y_val)
    assert result.nll_after < result.nll_before - 0.01
    at = predictive_nll(net, lik, x_val, y_val)
    assert at == pytest.approx(result.nll_after, rel=1e-6)
    for step in (1.02, 1 / 1.02):  # a finite-difference neighbourhood in log factor
        scale_posterior(net, step)
        assert predictive_nll(net, lik, x_val, y_val) >= at - 1e-6
        scale_posterior(net, 1 / step)
    layered = calibrate_scales(net, lik, x_val, y_val, per="layer")
    assert layered.nll_after <= at + 1e-9
    assert set(layered.factors) == {"layers.0", "layers.2"}


def test_scale_posterior_multiplies_the_scales():
    model = nn.Sequential(nn.Linear(3, 2)).double()
    std = _random_std(model)
    net = from_torch_posterior(model, std)
    scale_posterior(net, {"layers.0": 2.5})
    torch.testing.assert_close(net[0].weight_scale, 2.5 * std["0.weight"])
    with pytest.raises(ValueError, match="no posterior layer"):
        scale_posterior(net, {"layers.9": 2.0})


# --------------------------------------------------------------------------- Monte Carlo
def test_monte_carlo_of_the_same_posterior_matches_the_exact_linear_predictive():
    model, s, x, _ = _linear_regression_from_a_known_posterior(3, seed=1)
    net = from_torch_posterior(model, {"weight": s, "bias": torch.zeros(1)})
    lik = HomoscedasticGaussian(init_log_variance=math.log(0.01))
    torch.manual_seed(0)
    mean, var = monte_carlo_predictive(net, lik, x, 20_000)
    exact = lik.predictive(net(x, mode="diag"))
    want_var = exact.variance.detach()
    # mean within 4 MC standard errors, variance within 4 (chi-square) standard errors
    assert ((mean - exact.mean.detach()).abs() < 4 * (want_var / 20_000).sqrt()).all()
    assert ((var / want_var - 1).abs() < 4 * math.sqrt(2 / 20_000)).all()
    probs = monte_carlo_predictive(
        from_torch_posterior(nn.Linear(4, 3).double(), 0.1), Categorical(3), x, 16
    )
    assert probs.shape == (3, 3) and torch.allclose(
        probs.sum(-1), torch.ones(3, dtype=torch.float64)
    )


def test_monte_carlo_nll_approaches_the_closed_form_on_a_linear_classifier():
    torch.manual_seed(0)
    model, x_val, y_val, _, _ = _classifier_and_data()
    net = from_torch_posterior(model, 0.02)
    lik = Categorical(3)
    closed = predictive_nll(net, lik, x_val, y_val)
    mc = monte_carlo_nll(net, lik, x_val, y_val, 4000, batch_size=50)
    assert mc == pytest.approx(closed, rel=0.05)
    assert closed > 1.6  # torch's Categorical floors p at 1.2e-7: 1.45 nats here


# --------------------------------------------------------------------------- export
def test_calibrated_transformer_exports_its_eager_predictive():
    torch.manual_seed(0)
    model = randomize_norms(TinyViT()).eval()
    x_val, y_val = torch.randn(64, 4, 16), torch.randint(0, 3, (64,))
    net = from_torch_posterior(model, prior_std(model, 0.02))
    lik = Categorical(3)
    result = calibrate_scales(net, lik, x_val, y_val)
    assert result.nll_after <= result.nll_before
    x = torch.randn(6, 4, 16)
    with torch.no_grad():
        eager = lik.predictive_probs(net(x, mode="diag"))
        torch.testing.assert_close(
            export_predictive(net, lik, mode="diag")(x), eager, rtol=0, atol=1e-6
        )


def test_calibrated_network_onnx_file_equals_the_eager_predictive(tmp_path):
    # ONNX export of a converted pre-norm transformer is refused at HEAD (LayerNorm's skip
    # cross-covariance calls torch.linalg.eigh, which has no ONNX lowering): an MLP here.
    pytest.importorskip("onnx")
    pytest.importorskip("onnxscript")
    ort = pytest.importorskip("onnxruntime")
    model, x_val, y_val, x_test, _ = _classifier_and_data()
    net = from_torch_posterior(model, prior_std(model, 0.01))
    lik = Categorical(3)
    calibrate_scales(net, lik, x_val, y_val, per="layer")
    predictive = export_predictive(net, lik, mode="diag")
    predictive.save(tmp_path / "posthoc.onnx", x_test[:5])
    session = ort.InferenceSession(str(tmp_path / "posthoc.onnx"))
    x = x_test[:9]
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        eager = lik.predictive_probs(net(x, mode="diag"))
    torch.testing.assert_close(torch.from_numpy(got), eager, rtol=0, atol=1e-5)


def test_the_module_namespace_exports_the_api():
    assert posthoc.from_torch_posterior is from_torch_posterior
    for name in posthoc.__all__:
        assert hasattr(posthoc, name)

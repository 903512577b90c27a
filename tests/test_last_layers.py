"""Last-layer DVI: from_torch(model, last_layers=k) on trained torch networks (issue 29, item 3)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dvi.nn import (
    BayesLinear,
    BayesLinearFullCov,
    GraphNetwork,
    LastLayerNetwork,
    Sequential,
    bayes_layers,
    from_torch,
    parameter_groups,
)
from lightning_dvi.nn.last_layers import split
from lightning_dvi_benchmarks.torch_resnet import resnet18


def _resnet(dtype=torch.float64, width=8):
    torch.manual_seed(0)
    model = resnet18(num_classes=10, in_channels=1, small_input=True, width=width)
    model.train()
    with torch.no_grad():  # non-trivial BatchNorm running statistics
        for _ in range(3):
            model(torch.randn(16, 1, 8, 8) * 2 + 0.5)
    return model.to(dtype).eval()


class _FunctionalMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(5, 8), nn.Linear(8, 6), nn.Linear(6, 3)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(torch.tanh(self.fc1(x)))))


def test_resnet18_last_layer_leaves_only_the_head_posterior_trainable():
    model = _resnet()
    net = from_torch(model, last_layers=1)
    assert isinstance(net, LastLayerNetwork) and isinstance(net.head, BayesLinear)
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {
        "head.weight_loc", "head.weight_raw_scale", "head.bias_loc", "head.bias_raw_scale"
    }  # fmt: skip
    assert [id(g.module) for g in parameter_groups(net)] == [id(net.head)] * 2
    assert not any(True for _ in bayes_layers(net.backbone))


def _assert_is_torch(net, model, x):
    """Zero posterior scale: every mode gives torch's output (float64, <= 1e-6 relative)."""
    with torch.no_grad():
        want = model(x)
        for mode in ("full", "diag"):
            out = net(x, mode=mode)
            rel = (out.mean - want).abs().max() / want.abs().max()
            assert rel <= 1e-6 and out.var.abs().max() <= 1e-20, (mode, rel)
        for mode in ("sample", "local"):
            draws = net(x, mode=mode, num_samples=2)
            torch.testing.assert_close(draws, want.expand(2, -1, -1), rtol=1e-6, atol=1e-9)


def test_resnet18_at_zero_scale_is_the_torch_network_in_every_mode():
    model = _resnet()
    net = from_torch(model, last_layers=1, scale_fraction=0.0)
    _assert_is_torch(net, model, torch.randn(6, 1, 8, 8, dtype=torch.float64))


def test_a_frozen_backbone_keeps_its_batchnorm_statistics_in_training_mode():
    model = _resnet()
    net = from_torch(model, last_layers=1)
    before = model.bn1.running_mean.clone()
    net.train()
    assert net.head.training and not net.backbone.training
    net(torch.randn(8, 1, 8, 8, dtype=torch.float64) + 3.0, mode="diag")
    torch.testing.assert_close(net.backbone.bn1.running_mean, before, rtol=0, atol=0)


def test_an_unfrozen_backbone_trains():
    model = _resnet()
    net = from_torch(model, last_layers=1, freeze_backbone=False)
    net.train()
    assert net.backbone.training
    out = net(torch.randn(8, 1, 8, 8, dtype=torch.float64), mode="diag")
    out.mean.sum().backward()
    assert net.backbone.conv1.weight.grad is not None
    assert model.conv1.weight.grad is None  # a copy: the caller's model is untouched


def test_conversion_leaves_the_torch_model_as_it_was():
    model = _resnet().train()
    net = from_torch(model, last_layers=1)
    assert model.training and model.bn1.training
    assert all(p.requires_grad for p in model.parameters())
    assert net.backbone.conv1.weight is not model.conv1.weight


def test_the_backbone_runs_once_in_the_sampling_modes():
    model = _resnet()
    net = from_torch(model, last_layers=1)
    calls = []
    net.backbone.register_forward_hook(lambda *args: calls.append(1))
    for mode in ("sample", "local"):
        calls.clear()
        out = net(torch.randn(4, 1, 8, 8, dtype=torch.float64), mode=mode, num_samples=7)
        assert out.shape == (7, 4, 10) and len(calls) == 1


def test_a_linear_head_is_exact_against_monte_carlo_over_its_weights():
    model = _resnet()
    net = from_torch(model, last_layers=1, scale_fraction=0.3)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    head = net.head
    with torch.no_grad():
        out = net(x, mode="full")
        h = net.features(x)
        n = 40_000
        w = head.weight_loc + head.weight_scale * torch.randn(n, *head.weight_loc.shape).double()
        b = head.bias_loc + head.bias_scale * torch.randn(n, 1, 10).double()
        logits = h @ w.transpose(-1, -2) + b
    std = out.var.sqrt()
    # 40,000 draws: 6 standard errors are 0.030 std (mean) and 0.021 (relative std)
    assert ((logits.mean(0) - out.mean).abs() / std).max() < 0.03
    assert ((logits.std(0) / std) - 1).abs().max() < 0.021
    assert out.cov.diagonal(dim1=-2, dim2=-1).sub(out.var).abs().max() == 0
    assert (out.cov - torch.diag_embed(out.var)).abs().max() == 0  # independent classes


def test_a_full_covariance_head_gives_correlated_logits():
    net = from_torch(_resnet(), last_layers=1, head_covariance="full")
    assert isinstance(net.head, BayesLinearFullCov)
    with torch.no_grad():
        net.head.tril.normal_(0.0, 1e-3)
    out = net(torch.randn(3, 1, 8, 8, dtype=torch.float64), mode="full")
    assert (out.cov - torch.diag_embed(out.var)).abs().max() > 0
    trainable = {n for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {"head.weight_loc", "head.bias_loc", "head.tril", "head.raw_diag"}


def test_last_k_layers_of_a_functional_mlp_form_a_chain():
    torch.manual_seed(0)
    model = _FunctionalMLP().double()
    net = from_torch(model, last_layers=2, scale_fraction=0.0)
    assert isinstance(net.head, Sequential)
    assert [type(m).__name__ for m in net.head] == ["BayesLinear", "ReLU", "BayesLinear"]
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(net(x, mode="full").mean, model(x))
    everything = from_torch(model, last_layers=3, scale_fraction=0.0)
    torch.testing.assert_close(everything(x, mode="diag").mean, model(x))


def test_a_cut_inside_a_residual_block_gives_a_head_of_two_deterministic_inputs():
    """last_layers=2 on ResNet-18: layer4.1.conv2 and fc; the skip and conv1's output cross."""
    model = _resnet()
    cut = split(model, 2)
    assert cut.live == ("layer4_0_relu_1", "layer4_1_relu")
    assert cut.bayesian == ("layer4.1.conv2", "fc")
    net = from_torch(model, last_layers=2, scale_fraction=0.0)
    assert isinstance(net.head, GraphNetwork) and net.head.num_inputs == 2
    x = torch.randn(6, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        feats = net.features(x)
    assert isinstance(feats, tuple) and len(feats) == 2  # plain tensors from plain torch
    _assert_is_torch(net, model, x)


def test_a_two_input_head_trains_only_its_two_layers():
    model = _resnet()
    net = from_torch(model, last_layers=2)
    assert {n.split(".")[0] for n, p in net.named_parameters() if p.requires_grad} == {"head"}
    layers = {id(g.module) for g in parameter_groups(net)}
    assert layers == {id(net.head.layers["layer4_1_conv2"]), id(net.head.layers["fc"])}
    out = net.train()(torch.randn(4, 1, 8, 8, dtype=torch.float64), mode="diag")
    out.var.sum().backward()
    assert all(p.grad is None for p in net.backbone.parameters())
    assert net.head.layers["layer4_1_conv2"].weight_raw_scale.grad.abs().sum() > 0


def test_a_two_input_head_matches_monte_carlo_over_its_weights():
    """The skip is deterministic: the sum adds its value, no variance and no cross term."""
    from lightning_dvi.diagnostics import compare_with_monte_carlo

    net = from_torch(_resnet(width=4), last_layers=2, scale_fraction=0.3)
    x = torch.randn(3, 1, 8, 8, dtype=torch.float64)
    torch.manual_seed(2)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=8_000, chunk_size=2_000)
    # 8,000 weight draws: 6 standard errors are 0.067 MC std (mean), 0.047 (relative std) and
    # about 0.07 (correlation); the rest is the ReLU moment matching over per-pixel moments
    assert res.mean_error < 0.1 and res.std_rel_error < 0.1 and res.corr_error < 0.1, res


def test_a_two_input_head_with_a_full_covariance_output_layer():
    net = from_torch(_resnet(), last_layers=2, head_covariance="full")
    assert isinstance(net.head.layers["fc"], BayesLinearFullCov)
    with torch.no_grad():
        net.head.layers["fc"].tril.normal_(0.0, 1e-3)
        out = net(torch.randn(3, 1, 8, 8, dtype=torch.float64), mode="full")
    assert (out.cov - torch.diag_embed(out.var)).abs().max() > 0
    with pytest.raises(ValueError, match="cannot be stored as data"):
        net.head.architecture()


def test_a_graph_of_two_inputs_is_called_with_a_tuple():
    net = from_torch(_resnet(), last_layers=2, scale_fraction=0.0).head
    a, b = torch.randn(2, 64, 1, 1, dtype=torch.float64), torch.randn(2, 64, 1, 1).double()
    with torch.no_grad():
        moments, draws = net((a, b), mode="diag"), net((a, b), mode="sample", num_samples=2)
    torch.testing.assert_close(draws, moments.mean.expand(2, -1, -1))
    with pytest.raises(ValueError, match=r"takes 2 input\(s\) \(layer4_0_relu_1, layer4_1_relu\)"):
        net(a, mode="diag")
    with pytest.raises(ValueError, match="input contains NaN"):
        net((a, b * float("nan")), mode="diag")


def test_a_cut_between_blocks_converts_the_block_and_the_head_by_graph():
    """last_layers=3 on ResNet-18: the head is layer4.1 (a residual block) and fc, one input."""
    model = _resnet()
    cut = split(model, 3)
    assert len(cut.live) == 1 and cut.bayesian == ("layer4.1.conv1", "layer4.1.conv2", "fc")
    net = from_torch(model, last_layers=3, scale_fraction=0.0)
    assert isinstance(net.head, GraphNetwork)
    x = torch.randn(4, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        want = model(x)
        out = net(x, mode="diag")
        torch.testing.assert_close(out.mean, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(net(x, mode="sample", num_samples=2)[1], want)
    net = from_torch(model, last_layers=3)
    trainable = {n.split(".")[0] for n, p in net.named_parameters() if p.requires_grad}
    assert trainable == {"head"}
    assert {id(g.module) for g in parameter_groups(net)} <= {id(m) for m in net.head.modules()}
    assert len({id(g.module) for g in parameter_groups(net)}) == 3  # two convs and fc
    with torch.no_grad():
        out = net(x, mode="diag")
    assert torch.isfinite(out.mean).all() and (out.var > 0).all()


def test_bad_last_layers_are_refused():
    model = _FunctionalMLP()
    with pytest.raises(ValueError, match="last_layers must be a positive int"):
        from_torch(model, last_layers=0)
    with pytest.raises(ValueError, match="has 3 weight layers"):
        from_torch(model, last_layers=4)
    with pytest.raises(ValueError, match="head_covariance"):
        from_torch(model, last_layers=1, head_covariance="low_rank")

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x) if x.sum() > 0 else x

    with pytest.raises(NotImplementedError, match=r"torch\.fx cannot trace Branchy"):
        from_torch(Branchy(), last_layers=1)


def test_a_gaussian_input_is_refused():
    from lightning_dvi import Gaussian

    net = from_torch(_FunctionalMLP(), last_layers=1)
    with pytest.raises(ValueError, match="needs a tensor input"):
        net(Gaussian(torch.zeros(2, 5), var=torch.ones(2, 5)), mode="diag")


def test_a_full_covariance_head_covers_the_output_layer_only():
    torch.manual_seed(0)
    model = _FunctionalMLP()
    net = from_torch(model, last_layers=2, head_covariance="full")
    assert [type(m).__name__ for m in net.head] == ["BayesLinear", "ReLU", "BayesLinearFullCov"]
    x = torch.randn(4, 5)
    factorised = from_torch(model, last_layers=2)
    for mode in ("full", "diag"):  # the same posterior, independent weights at the start
        a, b = net(x, mode=mode), factorised(x, mode=mode)
        torch.testing.assert_close(a.mean, b.mean)
        torch.testing.assert_close(a.var, b.var)


def test_a_flatten_call_inside_the_head_converts():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(5, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.fc2(torch.flatten(torch.relu(self.fc1(x)), 1))

    torch.manual_seed(0)
    model = Flat().double()
    net = from_torch(model, last_layers=2, scale_fraction=0.0)
    assert [type(m).__name__ for m in net.head] == [
        "BayesLinear", "ReLU", "TorchFlatten", "BayesLinear"
    ]  # fmt: skip
    x = torch.randn(4, 5, dtype=torch.float64)
    torch.testing.assert_close(net(x, mode="diag").mean, model(x))


class _MeanPooledEmbedding(nn.Module):
    """Token ids ``[B, T]`` -> embedding -> mean over tokens -> a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.fc = nn.Embedding(20, 8), nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(self.emb(ids).mean(1))


class _RecurrentClassifier(nn.Module):
    """Token ids -> embedding -> LSTM -> the last step's state -> a linear classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.lstm = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, ids):
        return self.fc(self.lstm(self.emb(ids))[0][:, -1])


@pytest.mark.parametrize("build", [_MeanPooledEmbedding, _RecurrentClassifier])
def test_token_ids_go_to_the_plain_torch_backbone(build):
    torch.manual_seed(0)
    model = build().eval()
    ids = torch.randint(0, 20, (4, 6))
    net = from_torch(model, last_layers=1)
    with torch.no_grad():
        logits = model(ids)
        for mode in ("diag", "full"):
            out = net(ids, mode=mode)
            # a Linear head on deterministic features: its mean is the torch model's logits
            torch.testing.assert_close(out.mean, logits, rtol=0, atol=1e-6)
            var = out.var if mode == "diag" else out.cov.diagonal(dim1=-2, dim2=-1)
            assert bool((var > 0).all())
        assert net(ids, mode="sample", num_samples=3).shape == (3, 4, 3)
    if build is _RecurrentClassifier:  # the whole-network conversion refuses the LSTM
        with pytest.raises(NotImplementedError, match=r"from_torch\(model, last_layers=k\)"):
            from_torch(model)
    else:  # an embedding converts (a Bayesian table): at zero scale it is the torch model
        with torch.no_grad():
            whole = from_torch(model, scale_fraction=0.0)(ids, mode="diag")
        torch.testing.assert_close(whole.mean, logits, rtol=0, atol=1e-6)


def test_unsupported_layers_suggest_last_layers():
    torch.manual_seed(0)
    model = nn.Sequential(  # batch_first=False: converted encoder layers take [B, T, D]
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=False), nn.Flatten(), nn.Linear(32, 2)
    ).eval()
    with pytest.raises(NotImplementedError, match=r"last_layers=k"):
        from_torch(model)
    x = torch.randn(3, 4, 8)
    out = from_torch(model, last_layers=1)(x, mode="diag")
    torch.testing.assert_close(out.mean, model(x), rtol=0, atol=1e-5)


def test_integer_inputs_to_a_whole_bayesian_network_are_refused_naming_last_layers():
    net = from_torch(nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)))
    with pytest.raises(ValueError, match=r"floating tensor.*last_layers=k"):
        net(torch.tensor([[1, 2, 3]]), mode="diag")
    with pytest.raises(ValueError, match="NaN or Inf"):  # the last-layers path still checks
        from_torch(_FunctionalMLP(), last_layers=1)(torch.full((2, 5), float("nan")), mode="diag")


def test_a_token_model_exports_and_its_program_takes_token_ids(tmp_path):
    from lightning_dvi.likelihoods import Categorical
    from lightning_dvi.nn import export_predictive

    torch.manual_seed(0)
    net = from_torch(_MeanPooledEmbedding().eval(), last_layers=1)
    predictive = export_predictive(net, Categorical(3), "diag")
    ids = torch.randint(0, 20, (5, 6))
    probs = predictive(ids)
    torch.testing.assert_close(probs, Categorical(3).predictive_probs(net(ids, mode="diag")))
    predictive.save(tmp_path / "tokens.pt2", ids)
    program = torch.export.load(tmp_path / "tokens.pt2").module()
    more = torch.randint(0, 20, (7, 6))  # another batch size
    torch.testing.assert_close(program(more), predictive(more), rtol=0, atol=1e-6)

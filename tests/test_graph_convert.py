"""from_torch by torch.fx graph: GraphNetwork, sums with cross-covariances, refusals, plain data."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.nn import (
    ELU,
    BayesLinear,
    GraphNetwork,
    ReLU,
    Residual,
    Sequential,
    Tanh,
    from_torch,
)

F64 = torch.float64


class TanhSkip(nn.Module):
    """Issue 28's acceptance module: functional ReLU, a tanh residual branch, an nn.ELU."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(3, 6), nn.Linear(6, 6), nn.Linear(6, 2)
        self.act = nn.ELU()

    def forward(self, x):
        h = F.relu(self.l1(x))
        h = h + torch.tanh(self.l2(h))
        return self.l3(self.act(h))


def _tanh_skip():
    torch.manual_seed(0)
    return TanhSkip().to(F64).eval()


def _x(*shape):
    torch.manual_seed(1)
    return torch.randn(*shape, dtype=F64)


def _declared_twin(torch_net, scale_fraction):
    """The same network declared by hand with Residual (an independent construction)."""
    net = Sequential(
        BayesLinear(3, 6), ReLU(), Residual(BayesLinear(6, 6), Tanh()), ELU(), BayesLinear(6, 2)
    ).to(F64)
    converted = from_torch(torch_net, scale_fraction=scale_fraction)
    weights = [m for m in converted.modules() if isinstance(m, BayesLinear)]
    mine = [m for m in net.modules() if isinstance(m, BayesLinear)]
    for target, source in zip(mine, weights, strict=True):
        target.load_state_dict(source.state_dict())
    return converted, net


@pytest.mark.parametrize("mode", ["full", "diag", "sample", "local"])
def test_custom_module_with_functional_relu_tanh_skip_and_elu_matches_torch(mode):
    torch_net, x = _tanh_skip(), _x(7, 3)
    net = from_torch(torch_net, scale_fraction=0.0)
    assert isinstance(net, GraphNetwork)
    with torch.no_grad():
        want = torch_net(x)
        if mode in ("full", "diag"):
            out = net(x, mode=mode)
            got = out.mean
            assert float(out.var.abs().max()) <= 1e-20
        else:
            got = net(x, mode=mode, num_samples=3)
            assert got.shape == (3, 7, 2)
    torch.testing.assert_close(
        got.expand(*got.shape[:-2], 7, 2), want.expand_as(got), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_tanh_skip_moments_equal_the_declared_residual_network(mode):
    converted, declared = _declared_twin(_tanh_skip(), scale_fraction=0.3)
    x = _x(5, 3)
    with torch.no_grad():
        got, want = converted(x, mode=mode), declared(x, mode=mode)
    torch.testing.assert_close(got.mean, want.mean)
    torch.testing.assert_close(got.var, want.var)
    if mode == "full":
        torch.testing.assert_close(got.cov, want.cov)


def test_tanh_skip_moments_match_monte_carlo():
    net = from_torch(_tanh_skip(), scale_fraction=0.3)
    x = _x(5, 3)
    torch.manual_seed(2)
    full = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000)
    assert full.mean_error < 0.05 and full.std_rel_error < 0.05 and full.corr_error < 0.05, full
    # diag mode drops the covariances between units (the dDVI approximation; the same network
    # declared with Residual measures the same): means stay within 5 % of an MC std, stds 30 %
    diag = compare_with_monte_carlo(net, x, mode="diag", num_samples=20_000)
    assert diag.mean_error < 0.05 and diag.std_rel_error < 0.3, diag


class SkipSum(nn.Module):
    """TanhSkip up to its sum: ``h + tanh(l2(h))`` with ``h = relu(l1(x))``."""

    def __init__(self, full: TanhSkip) -> None:
        super().__init__()
        self.l1, self.l2 = full.l1, full.l2

    def forward(self, x):
        h = F.relu(self.l1(x))
        return h + torch.tanh(self.l2(h))


def test_the_skip_sums_cross_term_matters_and_matches_monte_carlo():
    net = from_torch(SkipSum(_tanh_skip()), scale_fraction=0.3)
    x = _x(5, 3)
    with torch.no_grad():
        got = net(x, mode="full")
        h = net.layers["relu"](net.layers["l1"](x, mode="full"), mode="full")
        t = net.layers["tanh"](net.layers["l2"](h, mode="full"), mode="full")
        torch.manual_seed(2)
        draws = net(x, mode="sample", num_samples=40_000)
    mc_std = draws.std(0)
    independent = (h.var + t.var).sqrt()
    assert float(((got.var.sqrt() - mc_std).abs() / mc_std).max()) < 0.03
    assert float(((independent - mc_std).abs() / mc_std).max()) > 0.1  # what X + X^T adds


class Fork(nn.Module):
    """A fork into two heads concatenated along features, a constant shift and x.relu()."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.a, self.b, self.out = (
            nn.Linear(3, 5), nn.Linear(5, 3), nn.Linear(5, 2), nn.Linear(5, 2)
        )  # fmt: skip

    def forward(self, x):
        h = self.l1(x).relu()
        z = torch.cat([self.a(h), F.gelu(self.b(h))], dim=1) + 0.5
        return self.out(z)


def test_cat_of_a_fork_keeps_the_cross_covariance_in_full_mode():
    torch.manual_seed(0)
    torch_net = Fork().to(F64).eval()
    x = _x(4, 3)
    zero = from_torch(torch_net, scale_fraction=0.0)
    with torch.no_grad():
        torch.testing.assert_close(zero(x, mode="full").mean, torch_net(x), rtol=1e-10, atol=0)
    net = from_torch(torch_net, scale_fraction=0.3)
    torch.manual_seed(2)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000)
    assert res.mean_error < 0.05 and res.std_rel_error < 0.05 and res.corr_error < 0.05, res


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 4), nn.Linear(3, 4)

    def forward(self, x):
        return torch.add(self.a(x), self.b(x))


def test_sum_of_independent_operands_is_the_plain_sum():
    torch.manual_seed(0)
    net = from_torch(TwoHeads().to(F64), scale_fraction=0.3)
    x = _x(4, 3)
    with torch.no_grad():
        out = net(x, mode="full")
        a, b = net.layers["a"](x, mode="full"), net.layers["b"](x, mode="full")
    torch.testing.assert_close(out.cov, a.cov + b.cov)
    torch.manual_seed(2)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000)
    assert res.mean_error < 0.05 and res.std_rel_error < 0.05, res


class Flattening(nn.Module):
    """Conv stem, reused ReLU module, max pool with padding, three flattening idioms."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.conv = nn.Conv2d(1, 3, 3, stride=2, padding=1, bias=False)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.avg = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(3, 2)

    def forward(self, x):
        h = self.relu(self.pool(self.relu(self.conv(x))))
        h = self.avg(h)
        if self.how == "view":
            h = h.view(h.size(0), -1)
        elif self.how == "reshape":
            h = h.reshape(h.shape[0], -1)
        else:
            h = torch.flatten(h, 1)
        return self.fc(h)


@pytest.mark.parametrize("how", ["view", "reshape", "flatten"])
@pytest.mark.parametrize("mode", ["full", "diag", "sample"])
def test_flattening_idioms_reused_relu_and_padded_pool_match_torch(how, mode):
    torch.manual_seed(0)
    torch_net = Flattening(how).to(F64).eval()
    x = _x(2, 1, 8, 8)
    net = from_torch(torch_net, scale_fraction=0.0)
    assert sum(1 for n in net.nodes if n.get("module") == "relu") == 2  # one module, two calls
    with torch.no_grad():
        out = net(x, mode=mode) if mode != "sample" else net(x, mode=mode, num_samples=2)
    got = out.mean if isinstance(out, Gaussian) else out[1]
    torch.testing.assert_close(got, torch_net(x), rtol=1e-10, atol=1e-12)


def test_sequential_subclass_goes_by_graph_and_plain_sequential_keeps_its_path():
    class MySequential(nn.Sequential):
        pass

    torch.manual_seed(0)
    layers = [nn.Linear(3, 4).double(), nn.ReLU(), nn.Linear(4, 2).double()]
    assert type(from_torch(nn.Sequential(*layers))) is Sequential
    converted = from_torch(MySequential(*layers), scale_fraction=0.0)
    assert isinstance(converted, GraphNetwork)
    x = _x(3, 3)
    with torch.no_grad():
        want = nn.Sequential(*layers)(x)
        torch.testing.assert_close(converted(x, mode="diag").mean, want, rtol=1e-10, atol=0)


class Sine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(2, 2)

    def forward(self, x):
        return torch.sin(self.l1(x))


def test_unsupported_op_is_named_with_its_module_and_source_line():
    with pytest.raises(NotImplementedError) as info:
        from_torch(nn.Sequential(nn.Linear(2, 2), Sine()))
    text = str(info.value)
    assert "node 'sin' (call_function sin) in 1" in text
    assert "test_graph_convert.py:" in text and "return torch.sin(self.l1(x))" in text
    assert "graph conversion supports" in text and "torch.cat" in text


def test_untraceable_module_says_fx_could_not_trace_it():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(2, 2)

        def forward(self, x):
            return self.l1(x) if x.sum() > 0 else x

    with pytest.raises(NotImplementedError, match=r"torch.fx could not trace Branchy \(TraceError"):
        from_torch(Branchy())


def test_refusals_name_the_node():
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(2, 2)

        def forward(self, x):
            return self.l1(self.l1(x))

    with pytest.raises(NotImplementedError, match=r"'l1_1'.*weight sharing"):
        from_torch(Shared())

    class BatchCat(nn.Module):
        def forward(self, x):
            return torch.cat([x, x], 0)

    net = from_torch(nn.Sequential(BatchCat(), nn.Linear(2, 2)))
    with pytest.raises(ValueError, match=r"graph node 'cat': torch\.cat along dim=0"):
        net(_x(2, 2).float(), mode="diag")

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(2, 2)

        def forward(self, x):
            return self.l1(x) * 2

    with pytest.raises(NotImplementedError, match=r"node 'mul' \(call_function mul\)"):
        from_torch(Scaled())


class ImageFork(nn.Module):
    """A fork on an image whose two flattened paths are concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)
        self.fa, self.fb = nn.Linear(32, 2), nn.Linear(32, 3)

    def forward(self, x):
        h = self.conv(x)
        return torch.cat([self.fa(torch.flatten(h, 1)), self.fb(torch.flatten(F.relu(h), 1))], 1)


def test_full_mode_cat_of_correlated_image_paths_is_refused_diag_runs():
    net = from_torch(ImageFork().double(), scale_fraction=0.1)
    x = _x(2, 1, 4, 4)
    with pytest.raises(ValueError, match=r"graph node 'cat'.*cross-covariance.*mode='diag'"):
        net(x, mode="full")
    assert net(x, mode="diag").mean.shape == (2, 5)


def test_graph_network_is_stored_as_plain_data_and_rebuilt():
    from lightning_dvi.lightning._network import instantiate_net

    torch.manual_seed(0)
    torch_net = Flattening("view").to(F64).eval()
    net = from_torch(torch_net, scale_fraction=0.2)
    arch = json.loads(json.dumps(net.architecture()))  # plain data: survives JSON
    rebuilt = instantiate_net({"class_path": "lightning_dvi.nn.GraphNetwork", "init_args": arch})
    rebuilt = rebuilt.to(F64)
    rebuilt.load_state_dict(net.state_dict())
    x = _x(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(rebuilt(x, mode="diag").mean, net(x, mode="diag").mean)
        torch.testing.assert_close(rebuilt(x, mode="diag").var, net(x, mode="diag").var)
    assert all(isinstance(k, str) for k in net.state_dict())


def test_bad_node_lists_are_refused():
    with pytest.raises(ValueError, match="starts with its 'input' nodes"):
        GraphNetwork([{"name": "output", "op": "output", "inputs": ["x"]}], {})
    with pytest.raises(ValueError, match="input 'y' is not an earlier node"):
        GraphNetwork(
            [{"name": "x", "op": "input"}, {"name": "output", "op": "output", "inputs": ["y"]}], {}
        )
    with pytest.raises(ValueError, match="unknown layer kind 'nope'"):
        GraphNetwork(
            [
                {"name": "x", "op": "input"},
                {"name": "m", "op": "call", "module": "m", "inputs": ["x"]},
                {"name": "output", "op": "output", "inputs": ["m"]},
            ],
            {"m": {"kind": "nope"}},
        )


def test_converted_resnet_checkpoint_round_trip_without_the_torch_file(tmp_path):
    from helpers import cpu_trainer

    from lightning_dvi import DVIClassifier
    from lightning_dvi_benchmarks.torch_resnet import resnet18

    torch.manual_seed(0)
    torch_net = resnet18(num_classes=3, in_channels=1, small_input=True, width=2).eval()
    net = from_torch(torch_net, scale_fraction=0.1)
    config = {"class_path": "lightning_dvi.nn.GraphNetwork", "init_args": net.architecture()}
    model = DVIClassifier(net=config, num_classes=3, num_data=10)
    model.net.load_state_dict(net.state_dict())
    trainer = cpu_trainer(default_root_dir=tmp_path)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    del torch_net, net
    loaded = DVIClassifier.load_from_checkpoint(tmp_path / "c.ckpt", weights_only=True)
    assert isinstance(loaded.net, GraphNetwork)
    x = _x(2, 1, 8, 8).float()
    with torch.no_grad():
        want, got = model.net(x, mode="diag"), loaded.net(x, mode="diag")
    torch.testing.assert_close(got.mean, want.mean)
    torch.testing.assert_close(got.var, want.var)


class DenseInput(nn.Module):
    """The input concatenated with a feature (a deterministic operand of torch.cat)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(3, 4), nn.Linear(7, 2)

    def forward(self, x):
        return self.l2(torch.cat([x, F.relu(self.l1(x))], -1))


def test_cat_with_the_deterministic_input_matches_torch_and_monte_carlo():
    torch.manual_seed(0)
    torch_net = DenseInput().to(F64)
    x = _x(4, 3)
    with torch.no_grad():
        zero = from_torch(torch_net, scale_fraction=0.0)
        torch.testing.assert_close(zero(x, mode="full").mean, torch_net(x))
    net = from_torch(torch_net, scale_fraction=0.3)
    torch.manual_seed(2)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000)
    assert res.mean_error < 0.05 and res.std_rel_error < 0.05, res

"""The conformance test base every declared layer kind runs through (cf. torchmetrics' MetricTester).

Subclass :class:`LayerConformance`, set :attr:`~LayerConformance.case` to a :class:`LayerCase`
(a small network around the kind, an input, optionally the torch twin the kind stands for), and
pytest collects the shared checks for it:

* moments (``full`` and ``diag``) against Monte Carlo over whole weight draws;
* the Monte Carlo modes (``sample``, ``local``) against the moments;
* finite, non-zero gradients of the moments w.r.t. every parameter;
* float32 against float64;
* export round trip: :func:`~lightning_dvi.nn.export_predictive` eager and under
  ``torch.export`` equal the network's own propagation;
* conversion from the torch twin (:func:`~lightning_dvi.nn.from_torch` at zero posterior
  scale is the torch network);
* the Pyro pass (:class:`~lightning_dvi.pyro.PyroBayesNet` equals the network holding the
  guide's posterior), and the torch twin written as a Pyro model (``PyroModule`` layers with
  ``PyroSample`` priors, as Pyro's tutorials write it) gives, through the moment pass, the
  moments of the network ``from_torch`` converts it to;
* every weight layer (:class:`~lightning_dvi.nn.HasPosterior`) has a KL term with gradient;
* no subnormal floats in the output moments, for inputs far in the tails.

``tests/test_conformance.py`` builds one subclass per registered kind from the registry, and
fails for a registered kind that has none; ``tests/test_user_layer.py`` runs a user's layer
through the same base.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Literal

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.nn import PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.nn import (
    BayesModule,
    bayes_layers,
    export_predictive,
    from_torch,
    given_weights,
    has_posterior,
    parameter_groups,
)
from lightning_dvi.nn.registry import spec_for_module
from lightning_dvi.priors import GaussianPrior


@dataclasses.dataclass
class LayerCase:
    """A declared kind in a small network, and what to check it with.

    Attributes:
        net: builds the declared network (float64) around the kind.
        x: builds an input batch (float64).
        torch_twin: builds the torch network the kind stands for (``None``: no twin).
        exact_diag: whether ``diag`` mode is exact for :attr:`net` (no dropped covariance).
        tol: Monte Carlo tolerance, in MC standard deviations (means) and relative (stds).
        pyro: whether :class:`~lightning_dvi.pyro.PyroBayesNet` supports the network (every
            registered kind does; a user's layer may not).
        pyro_twin_refused: per mode, for a torch twin the moment pass refuses by design, a
            regex of the refusal (the test checks that it is raised and says what to use).
        smooth: whether the moments are differentiable everywhere (gradients are checked).
        sample_mode: the Monte Carlo oracle's draws: ``"sample"`` (whole weights, shared by
            the batch) or ``"local"`` (independent per example: the semantics of per-example
            moments through a layer that couples the examples, train-mode batch norm).
        export: whether the eval-mode predictive export describes :attr:`net` (not for a
            network in train mode).
    """

    net: Callable[[], BayesModule]
    x: Callable[[], torch.Tensor]
    torch_twin: Callable[[], nn.Module] | None = None
    exact_diag: bool = True
    tol: float = 0.08
    pyro: bool = True
    smooth: bool = True
    sample_mode: Literal["sample", "local"] = "sample"
    export: bool = True
    pyro_twin_refused: dict[str, str] = dataclasses.field(default_factory=dict)


def _seeded(build, seed=0):
    torch.manual_seed(seed)
    return build()


def _pyro_model(twin: nn.Module) -> tuple[nn.Module, list[str]]:
    """The torch network as a Pyro user writes it: every weight layer's parameters get Normal
    priors (``PyroSample``); other parameters (normalization gains) stay ``pyro.param``s.

    Returns the model and the site-name prefix of each weight layer, in module order.
    """
    weight_layers = [
        path
        for path, m in twin.named_modules()
        if (spec := spec_for_module(m)) is not None and spec.kind == "weight"
    ]
    model = copy.deepcopy(twin)
    to_pyro_module_(model)
    for path in weight_layers:
        m = model.get_submodule(path)
        for name, p in list(m.named_parameters(recurse=False)):
            prior = dist.Normal(torch.zeros((), dtype=p.dtype), 1.0)
            setattr(m, name, PyroSample(prior.expand(list(p.shape)).to_event(p.dim())))
    return model, [f"{path}." if path else "" for path in weight_layers]


class LayerConformance:
    """Subclass with ``case = LayerCase(...)``; every ``test_*`` below runs for it."""

    case: LayerCase
    num_samples = 8_000

    def _net_and_x(self):
        net = _seeded(self.case.net)
        x = _seeded(self.case.x, seed=1)
        return net, x

    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_moments_agree_with_monte_carlo(self, mode):
        if mode == "diag" and not self.case.exact_diag:
            pytest.skip("diag mode drops covariances of this network by design")
        net, x = self._net_and_x()
        torch.manual_seed(2)
        res = compare_with_monte_carlo(
            net, x, mode=mode, num_samples=self.num_samples, sample_mode=self.case.sample_mode
        )
        assert res.mean_error < self.case.tol and res.std_rel_error < self.case.tol, res

    @pytest.mark.parametrize("mode", ["sample", "local"])
    def test_monte_carlo_modes_agree_with_the_moments(self, mode):
        if mode != self.case.sample_mode == "local":
            pytest.skip("the moments are per example; whole-weight draws couple the batch")
        net, x = self._net_and_x()
        with torch.no_grad():
            ref = net(x, mode="full")
            torch.manual_seed(3)
            draws = net(x, mode=mode, num_samples=self.num_samples)
        ref_mean = ref.mean.reshape(draws.shape[1:])
        ref_std = ref.var.sqrt().reshape(draws.shape[1:])
        mc_mean, mc_std = draws.mean(0), draws.std(0)
        scale = mc_std.clamp_min(1e-6)
        assert ((mc_mean - ref_mean).abs() / scale).max() < self.case.tol * 1.5
        assert ((mc_std - ref_std).abs() / scale).max() < self.case.tol * 1.5

    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_gradients_are_finite_and_reach_every_parameter(self, mode):
        net, x = self._net_and_x()
        out = net(x, mode=mode)
        (out.mean.sum() + out.var.sum()).backward()
        for name, p in net.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
        grads = [p.grad for p in net.parameters()]
        if self.case.smooth and grads:
            assert any(g.abs().sum() > 0 for g in grads)

    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_float32_agrees_with_float64(self, mode):
        net, x = self._net_and_x()
        with torch.no_grad():
            ref = net(x, mode=mode)
            out = net.float()(x.float(), mode=mode)
        assert out.mean.dtype == torch.float32
        scale = ref.var.sqrt().max() + ref.mean.abs().max()
        torch.testing.assert_close(out.mean.double(), ref.mean, rtol=0, atol=1e-4 * scale)
        torch.testing.assert_close(out.var.double(), ref.var, rtol=1e-3, atol=1e-5 * scale**2)

    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_export_round_trip(self, mode):
        if not self.case.export:
            pytest.skip("the export is an eval-mode predictive; the network is in train mode")
        net, x = self._net_and_x()
        predictive = export_predictive(net, mode=mode)
        mean, var = predictive(x)
        with torch.no_grad():
            ref = net(x, mode=mode)
        torch.testing.assert_close(mean, ref.mean.reshape(mean.shape))
        torch.testing.assert_close(var, ref.var.reshape(var.shape))
        if mode == "diag":  # one traced program per kind (tracing costs ~1 s)
            traced = predictive.export(x).module()(x)
            torch.testing.assert_close(traced[0], mean)
            torch.testing.assert_close(traced[1], var)

    def test_conversion_from_the_torch_twin(self):
        if self.case.torch_twin is None:
            pytest.skip("the kind stands for no torch module")
        twin = _seeded(self.case.torch_twin).double().eval()
        x = _seeded(self.case.x, seed=1)
        net = from_torch(twin, scale_fraction=0.0)
        with torch.no_grad():
            out = net(x, mode="diag")
            want = twin(x)
        torch.testing.assert_close(out.mean.reshape(want.shape), want)
        assert out.var.abs().max() <= 1e-12

    @pytest.mark.usefixtures("pyro_state")
    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_pyro_pass_equals_the_network(self, mode):
        if not self.case.pyro:
            pytest.skip("PyroBayesNet does not support this network")
        from lightning_dvi.pyro import DeterministicGuide, PyroBayesNet
        from lightning_dvi.pyro.messenger import MomentPassMessenger

        net, x = self._net_and_x()
        pnet = PyroBayesNet(net)
        guide = DeterministicGuide(pnet, mode=mode, init_scale=0.2)
        weights = poutine.trace(guide.moment_posteriors).get_trace(x).nodes["_RETURN"]["value"]
        with pyro.validation_enabled(False):
            out = MomentPassMessenger(weights)(pnet)(x)
        given = {}
        for path, layer in pnet._layers:
            given[layer] = {}
            for g in layer.parameter_groups():
                loc, scale = guide._get_loc_and_scale(f"net.{path}.{g.name}")
                given[layer][g.name] = (loc.detach(), scale.detach() ** 2)

        with torch.no_grad(), given_weights(given):
            ref = net(x, mode=mode)
        torch.testing.assert_close(out.dvi_mean, ref.mean)
        torch.testing.assert_close(out.dvi_var, ref.var)

    @pytest.mark.usefixtures("pyro_state")
    @pytest.mark.parametrize("mode", ["full", "diag"])
    def test_pyro_model_of_the_torch_twin_equals_the_converted_network(self, mode):
        if self.case.torch_twin is None:
            pytest.skip("the kind stands for no torch module")
        from lightning_dvi.pyro import DeterministicGuide
        from lightning_dvi.pyro.messenger import MomentPassMessenger

        twin = _seeded(self.case.torch_twin).double().eval()
        x = _seeded(self.case.x, seed=1)
        net = from_torch(twin, scale_fraction=0.0)
        model, sites = _pyro_model(twin)
        guide = DeterministicGuide(model, mode=mode, init_scale=0.2)
        weights = poutine.trace(guide.moment_posteriors).get_trace(x).nodes["_RETURN"]["value"]
        if mode in self.case.pyro_twin_refused:
            refused = pytest.raises(NotImplementedError, match=self.case.pyro_twin_refused[mode])
            with refused as err, pyro.validation_enabled(False):
                MomentPassMessenger(weights)(model)(x)
            assert "PyroBayesNet" in str(err.value)  # says what works instead
            return
        with pyro.validation_enabled(False):
            out = MomentPassMessenger(weights)(model)(x)
        layers = list(bayes_layers(net))  # conversion keeps the twin's order of weight layers
        assert len(layers) == len(sites)
        given = {}
        for layer, prefix in zip(layers, sites, strict=True):
            given[layer] = {}
            for g in layer.parameter_groups():
                loc, scale = guide._get_loc_and_scale(f"{prefix}{g.name}")
                given[layer][g.name] = (loc.detach(), scale.detach() ** 2)
        with torch.no_grad(), given_weights(given):
            ref = net(x, mode=mode)
        torch.testing.assert_close(out.dvi_mean, ref.mean.reshape(out.shape))
        torch.testing.assert_close(out.dvi_var, ref.var.reshape(out.shape))

    def test_every_weight_layer_has_a_kl_term(self):
        net, _ = self._net_and_x()
        layers = list(bayes_layers(net))
        groups = parameter_groups(net)
        assert {id(g.module) for g in groups} == {id(m) for m in layers}
        GaussianPrior(1.0).kl(net).backward()
        for layer in layers:
            for g in layer.parameter_groups():
                assert g.loc.grad is not None, g.name  # every group is in the KL
            grads = [p.grad for p in layer.parameters() if p.grad is not None]
            assert any(g.abs().sum() > 0 for g in grads), type(layer).__name__
        for m in net.modules():  # any other parameter belongs to a posterior
            point = set(getattr(m, "point_parameters", ()))
            if any(name not in point for name, _ in m.named_parameters(recurse=False)):
                assert has_posterior(m), type(m).__name__

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
    def test_no_subnormal_floats_in_the_moments(self, dtype):
        net, x = self._net_and_x()
        net = net.to(dtype)
        tiny = torch.finfo(dtype).tiny
        for scale in (1.0, 30.0):
            with torch.no_grad():
                for mode in ("full", "diag"):
                    out = net((x * scale).to(dtype), mode=mode)
                    assert isinstance(out, Gaussian)
                    for t in (out.mean, out.var, out.cov):
                        if t is not None:
                            sub = (t != 0) & (t.abs() < tiny)
                            assert not sub.any(), (mode, scale, t[sub][:5])

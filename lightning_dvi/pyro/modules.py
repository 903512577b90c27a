r"""Declared networks (``lightning_dvi.nn``) as Pyro model components, for full-covariance DVI.

A :class:`PyroBayesNet` turns every layer of a declared network that holds a weight posterior
(:class:`~lightning_dvi.nn.HasPosterior`: :class:`~lightning_dvi.nn.BayesLinear`, or a user's own
layer) into ``pyro.sample`` sites, one per parameter group (``<name>.<path>.weight`` and
``.bias``), with Normal priors, the
way a Pyro user attaches ``PyroSample`` priors to ``PyroModule[nn.Linear]`` layers. Called on
sampled weights (``Predictive``, Trace_ELBO) it computes the ordinary network output; called in a
DVI moment pass it propagates moments through the declared structure, including the
skip-connection cross-covariance of :class:`~lightning_dvi.nn.Residual` blocks, which arbitrary
user code cannot express. Both are the declared network's own ``propagate`` with the site values
(or moments) substituted for its weights (:func:`lightning_dvi.nn.given_weights`): no
Pyro-side copy of any layer rule.

The declared modules describe the architecture only; their own posterior parameters are not
used (in Pyro the guide holds the posterior).
"""

from __future__ import annotations

from typing import cast

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..nn import BayesModule, HasPosterior, bayes_layers, given_weights, has_posterior
from ..nn.posterior import GroupMoments
from .dispatch import unsupported
from .moment_tensor import MomentTensor, SampledTensor, union_sources

__all__ = ["PyroBayesNet"]


class PyroBayesNet(PyroModule):
    r"""A declared network whose weights are Pyro sample sites with Normal priors.

    Args:
        net: a ``lightning_dvi.nn`` network whose only parameterised layers hold a weight
            posterior (:class:`~lightning_dvi.nn.HasPosterior`: ``BayesLinear`` or a user's
            layer; with ``Sequential``, ``Residual`` and any registered activation; e.g. from
            :func:`lightning_dvi.nn.mlp`).
        prior_scale: standard deviation :math:`s` of the zero-mean Normal prior on every weight
            and bias, :math:`w \sim \mathcal N(0, s^2)`.
        name: prefix of the site names (replaced by the attribute name when this module is a
            submodule of a ``PyroModule``).

    Examples:
        >>> from lightning_dvi.nn import mlp
        >>> net = PyroBayesNet(mlp(1, [8], 2))
        >>> tuple(net(torch.randn(5, 1)).shape)  # one draw from the prior
        (5, 2)
    """

    def __init__(self, net: BayesModule, prior_scale: float = 1.0, name: str = "net") -> None:
        super().__init__(name=name)
        if not isinstance(net, BayesModule):
            raise TypeError(
                f"PyroBayesNet wraps lightning_dvi.nn modules, got {type(net).__name__}"
            )
        if not prior_scale > 0:
            raise ValueError(f"prior_scale must be positive, got {prior_scale}")
        for m in net.modules():
            if not has_posterior(m) and any(True for _ in m.parameters(recurse=False)):
                raise unsupported(f"declared module {type(m).__name__} in a Pyro network")
        self._net = (net,)  # not a submodule: its own posterior parameters are not Pyro's
        self.prior_scale = float(prior_scale)
        layers = set(bayes_layers(net))
        self._layers = [(p, m) for p, m in net.named_modules() if m in layers]
        if not self._layers:
            raise ValueError("PyroBayesNet: the network has no BayesLinear layer")

    @property
    def net(self) -> BayesModule:
        """The wrapped declared network (architecture only)."""
        return self._net[0]

    def _sample_weights(self, x: Tensor) -> dict[nn.Module, dict[str, Tensor]]:
        # one site per parameter group, shaped like its posterior means (all event dims)
        prefix = f"{self._pyro_name}." if self._pyro_name else ""
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        weights: dict[nn.Module, dict[str, Tensor]] = {}
        for path, layer in self._layers:
            site = f"{prefix}{path}." if path else prefix
            prior = dist.Normal(zero, self.prior_scale)
            weights[layer] = {
                g.name: pyro.sample(
                    site + g.name, prior.expand(list(g.loc.shape)).to_event(g.loc.dim())
                )
                for g in cast(HasPosterior, layer).parameter_groups()
            }
        return weights

    def forward(self, x: Tensor) -> Tensor:
        """Network output ``[..., D_out]``: a tensor, or a MomentTensor in a moment pass."""
        weights = self._sample_weights(x)
        values = [t for groups in weights.values() for t in groups.values()]
        if any(isinstance(t, SampledTensor) for t in values):
            raise unsupported(
                "PyroBayesNet weights drawn from a non-Normal prior (or listed in sampled_sites)",
                "DVI integrates weights with Normal priors only",
            )
        moments = [t for t in (x, *values) if isinstance(t, MomentTensor)]
        if not moments:  # sampled weights (Predictive, Trace_ELBO): the plain network
            given = {layer: _values(groups) for layer, groups in weights.items()}
            with given_weights(given):
                return cast(Tensor, self.net.propagate(x, "sample"))
        if len(moments) != len(values) + isinstance(x, MomentTensor):
            raise unsupported("a PyroBayesNet with some weights given as values, not moments")
        mode = moments[0].dvi_mode
        sources = union_sources("PyroBayesNet", x, *values)
        with given_weights({layer: _moments(groups) for layer, groups in weights.items()}):
            h = x.gaussian("PyroBayesNet") if isinstance(x, MomentTensor) else x
            out = self.net.propagate(h, mode)
        return MomentTensor.of(cast(Gaussian, out), mode, sources)  # moments in, moments out


def _values(groups: dict[str, Tensor]) -> GroupMoments:
    return {name: (value, None) for name, value in groups.items()}


def _moments(groups: dict[str, Tensor]) -> GroupMoments:
    # forward checked: every weight carries moments
    return {
        name: (cast(MomentTensor, t).dvi_mean, cast(MomentTensor, t).dvi_var)
        for name, t in groups.items()
    }

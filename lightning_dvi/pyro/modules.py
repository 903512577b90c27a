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
used (in Pyro the guide holds the posterior). Point parameters of layers without a posterior
(the gains and shifts of batch, layer and group normalization, listed in a module's
``point_parameters``) are ``pyro.param`` sites of the model, as a ``PyroModule``'s parameters
are, so ``SVI`` trains them; the network's own tensors are the stored values. Batch
normalization's running statistics stay buffers of the declared network.
"""

from __future__ import annotations

from typing import cast

import pyro
import pyro.distributions as dist
import torch
from pyro.nn import PyroModule
from torch import Tensor, nn
from torch.func import functional_call

from ..gaussian import Gaussian
from ..nn import BayesModule, HasPosterior, bayes_layers, given_weights, has_posterior
from ..nn.posterior import GroupMoments
from ..propagation import Propagation, SamplePass
from .dispatch import supported_ops_text, unsupported
from .moment_tensor import MomentTensor, SampledTensor, union_sources

__all__ = ["PyroBayesNet"]


class PyroBayesNet(PyroModule):
    r"""A declared network whose weights are Pyro sample sites with Normal priors.

    Any declared network runs: every kind of the layer registry (dense and convolutional
    layers, pooling, batch/layer/group normalization, shape ops, ``Sequential``, ``Residual``
    and the graph networks :func:`~lightning_dvi.nn.from_torch` builds) and a user's own layer.

    Args:
        net: a ``lightning_dvi.nn`` network whose parameters either hold a weight posterior
            (:class:`~lightning_dvi.nn.HasPosterior`: ``BayesLinear``, ``BayesConv2d`` or a
            user's layer) or are a module's ``point_parameters`` (normalization gains and
            shifts, which become ``pyro.param`` sites); e.g. from
            :func:`lightning_dvi.nn.mlp` or :func:`lightning_dvi.nn.from_torch`.
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
        self._point: list[tuple[str, nn.Parameter]] = []
        for path, m in net.named_modules():
            if has_posterior(m):
                continue
            point = set(getattr(m, "point_parameters", ()))
            for name, p in m.named_parameters(recurse=False):
                if name not in point:
                    raise unsupported(
                        f"declared module {type(m).__name__} in a Pyro network (its parameter "
                        f"{name!r} holds no weight posterior and is not one of its "
                        "point_parameters)",
                        "PyroBayesNet makes sample sites for layers implementing "
                        "lightning_dvi.nn.HasPosterior and pyro.param sites for "
                        "point_parameters; " + supported_ops_text(),
                    )
                self._point.append((f"{path}.{name}" if path else name, p))
        self._net = (net,)  # not a submodule: its own posterior parameters are not Pyro's
        self.prior_scale = float(prior_scale)
        layers = set(bayes_layers(net))
        self._layers = [(p, m) for p, m in net.named_modules() if m in layers]
        if not self._layers:
            raise ValueError("PyroBayesNet: the network has no layer with a weight posterior")

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

    def _point_values(self) -> dict[str, Tensor]:
        """The point parameters as ``pyro.param`` sites (the network's tensors are the store's)."""
        prefix = f"{self._pyro_name}." if self._pyro_name else ""
        return {path: pyro.param(prefix + path, p) for path, p in self._point}

    def _propagate(self, x: Tensor | Gaussian, mode: Propagation) -> Tensor | Gaussian:
        """``net.propagate(x, mode)`` with the point parameters' ``pyro.param`` values."""
        point = self._point_values()
        if not point:
            return self.net.propagate(x, mode)
        return cast(
            "Tensor | Gaussian",
            functional_call(_Propagate(self.net), {f"net.{k}": v for k, v in point.items()},
                            (x, mode)),
        )  # fmt: skip

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
            # The Monte Carlo modes take a leading sample dimension [S, ...] (S = 1 here;
            # draws batched by a vectorized Predictive broadcast against it and are kept).
            batched = any(
                t.dim() > g.loc.dim()
                for (_, layer), groups in zip(self._layers, weights.values(), strict=True)
                for g, t in zip(cast(HasPosterior, layer).parameter_groups(), groups.values(),
                                strict=True)
            )  # fmt: skip
            with given_weights(given):
                drawn = cast(Tensor, self._propagate(x.unsqueeze(0), SamplePass(1)))
            return drawn if batched else drawn.squeeze(0)
        if len(moments) != len(values) + isinstance(x, MomentTensor):
            raise unsupported("a PyroBayesNet with some weights given as values, not moments")
        mode = moments[0].dvi_mode
        sources = union_sources("PyroBayesNet", x, *values)
        with given_weights({layer: _moments(groups) for layer, groups in weights.items()}):
            h = x.gaussian("PyroBayesNet") if isinstance(x, MomentTensor) else x
            out = self._propagate(h, mode)
        return MomentTensor.of(cast(Gaussian, out), mode, sources)  # moments in, moments out


class _Propagate(nn.Module):
    """``net.propagate`` as a module's ``forward``, for :func:`torch.func.functional_call`."""

    def __init__(self, net: BayesModule) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: Tensor | Gaussian, mode: Propagation) -> Tensor | Gaussian:
        """The declared network's propagation of ``x``."""
        return self.net.propagate(x, mode)


def _values(groups: dict[str, Tensor]) -> GroupMoments:
    return {name: (value, None) for name, value in groups.items()}


def _moments(groups: dict[str, Tensor]) -> GroupMoments:
    # forward checked: every weight carries moments
    return {
        name: (cast(MomentTensor, t).dvi_mean, cast(MomentTensor, t).dvi_var)
        for name, t in groups.items()
    }

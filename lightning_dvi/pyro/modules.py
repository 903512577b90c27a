r"""Declared networks (``lightning_dvi.nn``) as Pyro model components, for full-covariance DVI.

A :class:`PyroBayesNet` turns every :class:`~lightning_dvi.nn.BayesLinear` of a declared network
into two ``pyro.sample`` sites (``<name>.<path>.weight`` and ``.bias``) with Normal priors, the
way a Pyro user attaches ``PyroSample`` priors to ``PyroModule[nn.Linear]`` layers. Called on
sampled weights (``Predictive``, Trace_ELBO) it computes the ordinary network output; called in a
DVI moment pass it propagates moments through the declared structure, including the
skip-connection cross-covariance of :class:`~lightning_dvi.nn.Residual` blocks, which arbitrary
user code cannot express.

The declared modules describe the architecture only; their own posterior parameters are not
used (in Pyro the guide holds the posterior).
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import torch
import torch.nn.functional as F
from pyro.nn import PyroModule
from torch import Tensor

from .. import moments as M
from ..nn import BayesLinear, BayesModule, Heaviside, ReLU, Residual, Sequential
from .moment_tensor import MomentTensor, unsupported

__all__ = ["PyroBayesNet"]

_Weights = dict[BayesLinear, tuple[Tensor, Tensor | None]]


class PyroBayesNet(PyroModule):
    r"""A declared network whose weights are Pyro sample sites with Normal priors.

    Args:
        net: a ``lightning_dvi.nn`` network (``Sequential``, ``Residual``, ``BayesLinear``,
            ``ReLU``, ``Heaviside``; e.g. from :func:`lightning_dvi.nn.mlp`).
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
        self._net = (net,)  # not a submodule: its own posterior parameters are not Pyro's
        self.prior_scale = float(prior_scale)
        self._layers = [(p, m) for p, m in net.named_modules() if isinstance(m, BayesLinear)]
        if not self._layers:
            raise ValueError("PyroBayesNet: the network has no BayesLinear layer")

    @property
    def net(self) -> BayesModule:
        """The wrapped declared network (architecture only)."""
        return self._net[0]

    def _sample_weights(self, x: Tensor) -> _Weights:
        prefix = f"{self._pyro_name}." if self._pyro_name else ""
        zero = torch.zeros((), dtype=x.dtype, device=x.device)
        weights: _Weights = {}
        for path, layer in self._layers:
            site = f"{prefix}{path}." if path else prefix
            prior = dist.Normal(zero, self.prior_scale)
            w = pyro.sample(
                site + "weight",
                prior.expand([layer.out_features, layer.in_features]).to_event(2),
            )
            b = None
            if layer.bias_loc is not None:
                b = pyro.sample(site + "bias", prior.expand([layer.out_features]).to_event(1))
            weights[layer] = (w, b)
        return weights

    def forward(self, x: Tensor) -> Tensor:
        """Network output ``[..., D_out]``: a tensor, or a MomentTensor in a moment pass."""
        return _run(self.net, x, self._sample_weights(x))


def _run(module: BayesModule, h: Tensor, w: _Weights) -> Tensor:
    if isinstance(module, BayesLinear):
        weight, bias = w[module]
        if isinstance(weight, MomentTensor) or isinstance(h, MomentTensor):
            return F.linear(h, weight, bias)
        out = h @ weight.transpose(-1, -2)  # batched weights (Predictive, vectorised particles)
        return out if bias is None else out + bias.unsqueeze(-2)
    if isinstance(module, Sequential):
        for layer in module:
            h = _run(layer, h, w)
        return h
    if isinstance(module, ReLU):
        return torch.relu(h)
    if isinstance(module, Heaviside):
        return _heaviside(h)
    if isinstance(module, Residual):
        if isinstance(h, MomentTensor):
            return _residual(module, h, w)
        return h + _run(module.branch, h, w)  # deterministic skip input: no cross term
    raise unsupported(f"declared module {type(module).__name__} in a Pyro network")


def _heaviside(h: Tensor) -> Tensor:
    if not isinstance(h, MomentTensor):
        return (h > 0).to(h.dtype)
    if h.dvi_cov is None:
        mean, var = M.heaviside_diag(h.dvi_mean, h.dvi_var)
        return MomentTensor(mean, var, mode=h.dvi_mode, sources=h.dvi_sources)
    mean, cov = M.heaviside_full(h.dvi_mean, h.dvi_cov)
    return MomentTensor(mean, cov=cov, mode=h.dvi_mode, sources=h.dvi_sources)


def _input_cov(x: MomentTensor) -> Tensor:
    if x.dvi_cov is not None:
        return x.dvi_cov
    if x.dvi_mode == "full" and x.dvi_marginal:
        raise unsupported("a Residual block after an op that dropped the covariance")
    return torch.diag_embed(x.dvi_var)


def _cross(module: BayesModule, cross: Tensor, h: MomentTensor, w: _Weights) -> Tensor:
    r"""Map :math:`\operatorname{Cov}(r, h)` to :math:`\operatorname{Cov}(r, \text{module}(h))`."""
    if isinstance(module, BayesLinear):
        weight = w[module][0]
        w_mean = weight.dvi_mean if isinstance(weight, MomentTensor) else weight
        return M.cross_through_linear(cross, w_mean)
    if isinstance(module, (ReLU, Heaviside)):
        slope = M.relu_slope if isinstance(module, ReLU) else M.heaviside_slope
        return M.cross_through_activation(cross, slope(h.dvi_mean, h.dvi_var))
    if isinstance(module, Sequential):
        for layer in module:
            cross, h = _cross(layer, cross, h, w), _run(layer, h, w)  # type: ignore[assignment]
        return cross
    if isinstance(module, Residual):
        return cross + _cross(module.branch, cross, h, w)
    raise unsupported(f"declared module {type(module).__name__} inside a Residual block")


def _residual(block: Residual, x: MomentTensor, w: _Weights) -> MomentTensor:
    r"""Moments of :math:`x + \delta(x)` with the cross-covariance carried through the branch."""
    cross = _input_cov(x)
    h: Tensor = x
    for layer in block.branch:
        cross, h = _cross(layer, cross, h, w), _run(layer, h, w)  # type: ignore[arg-type]
    if not isinstance(h, MomentTensor) or h.shape[-1] != x.shape[-1]:
        raise ValueError("a Residual branch must map moments of width d to width d")
    if x.dvi_mode == "full":
        delta_cov = _input_cov(h)
        mean, cov = M.residual_full(x.dvi_mean, _input_cov(x), h.dvi_mean, delta_cov, cross)
        return MomentTensor(mean, cov=cov, mode="full", sources=h.dvi_sources)
    mean, var = M.residual_diag(x.dvi_mean, x.dvi_var, h.dvi_mean, h.dvi_var, cross)
    return MomentTensor(mean, var, mode="diag", sources=h.dvi_sources)

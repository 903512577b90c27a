"""Counts with a Gaussian log-rate: the Poisson likelihood and its log-normal mixture predictive."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.distributions import constraints

from ..gaussian import Gaussian
from ..moments._quadrature import constant, fixed_rule
from ..moments.special import lambert_w_of_exp
from . import functional as F
from .base import ExportOptions, Likelihood, PredictiveHead, RegressionHead

__all__ = ["Poisson", "PoissonLogNormal"]

#: Gauss–Hermite nodes of the :class:`PoissonLogNormal` probability mass (around its mode).
HERMITE_NODES = 32


@fixed_rule
def _hermite_rule(n: int) -> tuple[Tensor, Tensor]:
    r"""Nodes :math:`z_i` and log-weights of :math:`\mathbb E g(z) \approx \sum_i w_i g(z_i)`, :math:`z\sim\mathcal N(0, 1)`.

    Golub–Welsch for the probabilists' Hermite polynomials (float64, torch only), computed
    once per ``n`` outside any tracing and kept as Python floats (:func:`fixed_rule`).
    """
    k = torch.arange(1, n, dtype=torch.float64)
    jacobi = torch.diag(k.sqrt(), 1) + torch.diag(k.sqrt(), -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return nodes, 2 * vectors[0].abs().log()


class PoissonLogNormal(torch.distributions.Distribution):
    r"""The Poisson log-normal distribution: :math:`y\mid f \sim \operatorname{Poisson}(e^f)`, :math:`f\sim\mathcal N(\mu, v)`.

    The posterior predictive of :class:`Poisson`. Mean and variance are exact,
    :math:`\mathbb E y = e^{\mu + v/2}` and :math:`\operatorname{Var} y = \mathbb E y +
    (e^v - 1)(\mathbb E y)^2` (over-dispersed); ``sample`` draws :math:`f`, then :math:`y`.

    ``log_prob`` integrates :math:`e^{H(f)}`, :math:`H(f) = yf - e^f - \log y! +
    \log\mathcal N(f; \mu, v)`, by adaptive Gauss–Hermite quadrature: :math:`H` is concave
    with its mode at :math:`f^* = \mu + vy - W(ve^{\mu + vy})` (:math:`W` the Lambert
    function, by Newton's method on :math:`w + \log w = \log v + \mu + vy`) and curvature
    :math:`c = e^{f^*} + 1/v`, so with :math:`f = f^* + z/\sqrt c` the integrand divided by
    :math:`\mathcal N(z; 0, 1)` is smooth and close to constant, and :data:`HERMITE_NODES`
    nodes integrate it to :math:`4\cdot10^{-6}` in the log mass (measured against
    ``scipy.integrate.quad`` for :math:`\mu \in [-2, 3]`, :math:`v \in [0.01, 4]`,
    :math:`y \le 40`). Exact at :math:`v = 0`.

    Args:
        loc: :math:`\mu`, the mean log-rate.
        var: :math:`v \ge 0`, the variance of the log-rate (broadcast with ``loc``).
    """

    arg_constraints = {"loc": constraints.real, "var": constraints.nonnegative}  # noqa: RUF012
    support = constraints.nonnegative_integer

    def __init__(self, loc: Tensor, var: Tensor, validate_args: bool | None = None) -> None:
        self.loc, self.var = torch.broadcast_tensors(loc, var)
        super().__init__(self.loc.shape, validate_args=validate_args)

    @property
    def mean(self) -> Tensor:
        r""":math:`e^{\mu + v/2}`."""
        return torch.exp(self.loc + 0.5 * self.var)

    @property
    def variance(self) -> Tensor:
        r""":math:`\mathbb E y + (e^v - 1)(\mathbb E y)^2`."""
        mean = self.mean
        return mean + torch.expm1(self.var) * mean.square()

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log\int\operatorname{Poisson}(y; e^f)\,\mathcal N(f; \mu, v)\,df` by quadrature."""
        if self._validate_args:
            self._validate_sample(value)
        y = value.to(self.loc.dtype)
        loc, var = torch.broadcast_tensors(self.loc, self.var)
        exact = var <= 0
        v = torch.where(exact, torch.ones_like(var), var)
        mode = loc + v * y - lambert_w_of_exp(v.log() + loc + v * y)
        scale = torch.rsqrt(mode.exp() + 1.0 / v)
        nodes, log_w = (
            constant(t, loc.dtype, loc.device).reshape(-1, *[1] * mode.dim())
            for t in _hermite_rule(HERMITE_NODES)
        )
        f = mode + scale * nodes  # [n, ...]
        log_joint = (
            y * f - f.exp() - torch.lgamma(y + 1)
            - 0.5 * ((f - loc) ** 2 / v + math.log(2 * math.pi) + v.log())
        )  # fmt: skip
        shifted = log_w + log_joint + 0.5 * nodes.square()  # divided by the N(z; 0, 1) weight
        integral = scale.log() + 0.5 * math.log(2 * math.pi) + torch.logsumexp(shifted, 0)
        plain = y * loc - loc.exp() - torch.lgamma(y + 1)
        return torch.where(exact, plain, integral)

    def sample(
        self,
        sample_shape: torch.Size | list[int] | tuple[int, ...] = torch.Size(),  # noqa: B008
    ) -> Tensor:
        """Draw ``f`` from its Gaussian, then ``y`` from the Poisson of rate ``e^f``."""
        shape = self._extended_shape(torch.Size(sample_shape))
        with torch.no_grad():
            f = self.loc.expand(shape) + self.var.sqrt().expand(shape) * torch.randn(
                shape, dtype=self.loc.dtype, device=self.loc.device
            )
            return torch.poisson(f.exp())


class Poisson(Likelihood):
    r"""Counts from one output :math:`f`, the log-rate: :math:`y\sim\operatorname{Poisson}(e^f)`.

    The expected log-likelihood is exact in closed form,
    :math:`\mathbb E\log p(y\mid f) = y\langle f\rangle - e^{\langle f\rangle + v/2} - \log y!`
    (:func:`~lightning_dvi.likelihoods.functional.poisson_expected_log_prob`), and so is the
    predictive's mean and variance (:class:`PoissonLogNormal`). Targets are non-negative integer
    counts (any dtype), ``[B]`` or ``[B, 1]``, in their own units (never standardised).

    Args:
        mc_samples: draws for the base-class Monte Carlo estimate.

    Examples:
        >>> lik = Poisson()
        >>> out = Gaussian(torch.zeros(2, 1), var=torch.zeros(2, 1))
        >>> lik.expected_log_prob(out, torch.tensor([0, 2])).tolist()  # log Poisson(y; 1)
        [-1.0, -1.6931471824645996]
        >>> lik.predictive(out).mean
        tensor([1., 1.])
    """

    num_outputs = 1
    standardizes_targets = False  # counts, in their own units
    target_units = "counts"

    def _check_values(self, y: Tensor) -> Tensor:
        what = (
            "counts must be non-negative integers (targets in their own units: a DVIRegressor "
            "with likelihood='poisson' needs standardize_targets=False)"
        )
        if y.dtype == torch.bool:
            raise ValueError(f"Poisson: {what}, got dtype {y.dtype}")
        return self._check_discrete(y, lambda t: (t >= 0) & (t == t.round()), what)

    def conditional(self, f: Tensor) -> torch.distributions.Poisson:
        r""":math:`\operatorname{Poisson}(e^f)` with ``f = f[..., 0]``."""
        return torch.distributions.Poisson(torch.exp(f[..., 0]), validate_args=False)

    def _log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        return y * f[..., 0] - torch.exp(f[..., 0]) - torch.lgamma(y + 1)  # no exp/log round trip

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r"""Exact :math:`\mathbb E\log\operatorname{Poisson}(y; e^f)` per datum, ``[B]``.

        ``mc_samples`` is ignored (kept for the base-class signature).
        """
        y = self.validate_target(y, self.validate_output(out))
        return F.poisson_expected_log_prob(out.mean[..., 0], out.var[..., 0], y)

    def predictive(self, out: Gaussian) -> PoissonLogNormal:
        """The Poisson log-normal predictive, batch shape ``[B]``."""
        self.validate_output(out)
        return PoissonLogNormal(out.mean[..., 0], out.var[..., 0])

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""The exported predictive: :class:`PoissonLogNormal`'s exact ``(mean, var)``, ``[B]`` each.

        :math:`\mathbb E y = e^{\mu + v/2}` and
        :math:`\operatorname{Var} y = \mathbb E y + (e^v - 1)(\mathbb E y)^2`, in the counts' own
        units.
        """
        return _PoissonHead(options)

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        r""":math:`\operatorname{Var}_q[e^f] = (e^v - 1)e^{2\langle f\rangle + v}`: the part of the predictive variance due to the weights."""
        self.validate_output(out)
        mean, var = out.mean[..., 0], out.var[..., 0]
        return torch.expm1(var) * torch.exp(2 * mean + var)


class _PoissonHead(RegressionHead):
    name = "poisson"

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        loc, var = out.mean[..., 0], out.var[..., 0]
        mean = torch.exp(loc + 0.5 * var)  # PoissonLogNormal's mean and variance, no validation
        return mean, mean + torch.expm1(var) * mean.square()

r"""Likelihoods for ``pyro.sample("obs", ..., obs=y)`` that also know their DVI expectation.

Outside a moment pass these are ordinary Pyro distributions (sample, ``log_prob``,
``Predictive``): the conditional :math:`p(y\mid f)` of the matching
:mod:`lightning_dvi.likelihoods` class. When their parameters are
:class:`~lightning_dvi.pyro.MomentTensor` outputs of a moment pass, :meth:`expected_log_prob`
gives the closed-form :math:`\mathbb E_q\log p(y\mid f)` of
:mod:`lightning_dvi.likelihoods.functional`, which the DeterministicELBO uses in place of
``log_prob``. Plain ``dist.Normal(f, sigma)`` and ``dist.Categorical(logits=f)`` need no wrapper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pyro.distributions as dist
import torch
from pyro.distributions import TorchDistribution, constraints
from torch import Tensor

from .. import likelihoods
from ..likelihoods.functional import categorical_delta_expected_log_prob
from .moment_tensor import MomentTensor, unsupported

__all__ = [
    "Categorical",
    "HeteroscedasticGaussian",
    "LikelihoodSite",
    "categorical_expected_log_prob",
    "unwrap_independent",
]


def unwrap_independent(fn: Any) -> tuple[Any, int]:
    """Strip ``Independent`` wrappers; return the base distribution and the dims they added."""
    dims = 0
    while isinstance(fn, torch.distributions.Independent):
        dims += fn.reinterpreted_batch_ndims
        fn = fn.base_dist
    return fn, dims


def categorical_expected_log_prob(what: str, logits: MomentTensor) -> Callable[[Tensor], Tensor]:
    """``y -> `` the delta-method expected log-likelihood of Gaussian logits (appendix B.4)."""
    g = logits.gaussian(what, link="log_softmax")
    return lambda y: categorical_delta_expected_log_prob(
        g.mean, g.cov if g.cov is not None else g.var, y
    )


class LikelihoodSite(TorchDistribution):
    r"""A :mod:`lightning_dvi.likelihoods` likelihood as the distribution of an observed site.

    Outside a moment pass it is the likelihood's conditional :math:`p(y\mid f)`
    (:meth:`~lightning_dvi.likelihoods.Likelihood.conditional`: sampling, ``log_prob``,
    ``Predictive``); on moment-tensor outputs, :meth:`expected_log_prob` is the likelihood's
    closed form on their Gaussian. Subclasses set :attr:`likelihood`.

    Args:
        outputs: network outputs ``[..., D]``; batch shape ``outputs.shape[:-1]``.
        validate_args: as for torch distributions.
    """

    arg_constraints = {"outputs": constraints.real}  # noqa: RUF012
    support = constraints.real
    has_rsample = True
    likelihood: likelihoods.Likelihood

    def __init__(self, outputs: Tensor, validate_args: bool | None = None) -> None:
        d = self.likelihood.num_outputs
        if outputs.dim() < 1 or outputs.shape[-1] != d:
            raise ValueError(
                f"{type(self).__name__} needs outputs [..., {d}], got {tuple(outputs.shape)}"
            )
        self.outputs = outputs
        if isinstance(outputs, MomentTensor):
            validate_args = False
        super().__init__(outputs.shape[:-1], torch.Size(), validate_args=validate_args)

    def _conditional(self) -> torch.distributions.Distribution:
        if isinstance(self.outputs, MomentTensor):
            raise unsupported("sampling or log_prob of a likelihood whose outputs are moments")
        return self.likelihood.conditional(self.outputs)

    @property
    def mean(self) -> Tensor:
        """Mean of the conditional."""
        return self._conditional().mean

    @property
    def variance(self) -> Tensor:
        """Variance of the conditional."""
        return self._conditional().variance

    def rsample(
        self,
        sample_shape: torch.Size | list[int] | tuple[int, ...] = torch.Size(),  # noqa: B008
    ) -> Tensor:
        """Reparameterised draws of ``y``."""
        return self._conditional().rsample(sample_shape)

    def log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\log p(y\mid f)`."""
        return self._conditional().log_prob(value)

    def expand(
        self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: object = None
    ) -> LikelihoodSite:
        """Broadcast the outputs (moment tensors keep their covariance)."""
        shape = torch.Size(batch_shape)
        if shape == self.batch_shape:
            return self
        outputs = self.outputs.expand((*shape, self.outputs.shape[-1]))
        return type(self)(outputs, validate_args=False)

    def expected_log_prob(self, value: Tensor) -> Tensor:
        r""":math:`\mathbb E_q\log p(y\mid f)` in closed form (``log_prob`` for plain outputs)."""
        if not isinstance(self.outputs, MomentTensor):
            return self.log_prob(value)
        out = self.outputs.gaussian(type(self).__name__)
        return self.likelihood.expected_log_prob(out, value)


class HeteroscedasticGaussian(LikelihoodSite):
    r"""Gaussian observation with a learned noise: :math:`y \sim \mathcal N(m, e^{\ell})`.

    ``outputs[..., 0]`` is the mean :math:`m` and ``outputs[..., 1]`` the log noise variance
    :math:`\ell`, i.e. a network with two outputs, as in the paper's heteroscedastic regression.
    In a moment pass, with :math:`(m, \ell)` Gaussian, the expected log-likelihood is
    :meth:`lightning_dvi.likelihoods.HeteroscedasticGaussian.expected_log_prob`,

    .. math::
        \mathbb E\log p(y) = -\tfrac12\Big[\log 2\pi + \langle\ell\rangle
        + \big(\Sigma_{mm} + (\langle m\rangle - \Sigma_{m\ell} - y)^2\big)
        e^{-\langle\ell\rangle + \Sigma_{\ell\ell}/2}\Big]

    (:math:`\Sigma_{m\ell} = 0` in ``diag`` mode).

    Args:
        outputs: ``[..., 2]`` (mean, log variance); batch shape ``outputs.shape[:-1]``.
        validate_args: as for torch distributions.

    Examples:
        >>> d = HeteroscedasticGaussian(torch.tensor([[0.0, 0.0]]))
        >>> round(d.log_prob(torch.zeros(1)).item(), 4)
        -0.9189
    """

    likelihood = likelihoods.HeteroscedasticGaussian()


class Categorical(dist.Categorical):
    r"""Pyro's Categorical, with :meth:`expected_log_prob` for moment-tensor ``logits``.

    A plain ``dist.Categorical(logits=...)`` works in a moment pass as well; this class adds
    the method for direct use. The logits :math:`a \sim \mathcal N(\mu, C)` and the softmax
    likelihood is integrated by the second-order delta method (paper appendix B.4):

    .. math::
        \mathbb E\log\operatorname{softmax}(a)_y \approx \mu_y - \operatorname{logsumexp}\mu
        - \tfrac12\big(p^\top\operatorname{diag}C - p^\top C p\big),\quad
        p = \operatorname{softmax}\mu,

    with the full :math:`C` in ``full`` mode and its diagonal in ``diag`` mode.

    Args:
        probs: as for ``pyro.distributions.Categorical`` (not in a moment pass).
        logits: ``[..., K]``, a tensor or a moment tensor.
        validate_args: as for torch distributions.
    """

    def __init__(
        self,
        probs: Tensor | None = None,
        logits: Tensor | None = None,
        validate_args: bool | None = None,
    ) -> None:
        if isinstance(probs, MomentTensor):
            raise unsupported("Categorical(probs=...) on moments", "pass logits=network output")
        if isinstance(logits, MomentTensor):
            validate_args = False  # support checks are comparisons, which moments refuse
        super().__init__(probs=probs, logits=logits, validate_args=validate_args)

    def expand(
        self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: Any = None
    ) -> Categorical:
        """Broadcast the batch shape (moment logits keep their covariance)."""
        new = type(self).__new__(type(self)) if _instance is None else _instance
        return cast(Categorical, super().expand(batch_shape, _instance=new))

    def expected_log_prob(self, value: Tensor) -> Tensor:
        r"""Delta-method :math:`\mathbb E_q\log p(y\mid a)` (``log_prob`` for plain logits)."""
        logits = self.__dict__.get("logits")
        if not isinstance(logits, MomentTensor):
            return cast(Tensor, self.log_prob(value))
        return categorical_expected_log_prob("Categorical", logits)(value)

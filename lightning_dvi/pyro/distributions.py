r"""Likelihoods for ``pyro.sample("obs", ..., obs=y)`` that also know their DVI expectation.

Outside a moment pass these are ordinary Pyro distributions (sample, ``log_prob``,
``Predictive``): the conditional :math:`p(y\mid f)` of the matching
:mod:`lightning_dvi.likelihoods` class. When their parameters are
:class:`~lightning_dvi.pyro.MomentTensor` outputs of a moment pass, :meth:`expected_log_prob`
gives the closed-form :math:`\mathbb E_q\log p(y\mid f)` of
:mod:`lightning_dvi.likelihoods.functional`, which the DeterministicELBO uses in place of
``log_prob``. Plain ``dist.Normal(f, sigma)``, ``dist.Categorical(logits=f)``,
``dist.Bernoulli(logits=f)`` and ``dist.Poisson(rate=f.exp())`` need no wrapper: each observed
site calls the expected log-likelihood of its :mod:`lightning_dvi.likelihoods` class
(:func:`likelihood_term`), the one the Lightning modules train with.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pyro.distributions as dist
import torch
from pyro.distributions import TorchDistribution, constraints
from torch import Tensor

from .. import likelihoods
from ..gaussian import Gaussian
from .moment_tensor import MomentTensor, unsupported

__all__ = [
    "Categorical",
    "HeteroscedasticGaussian",
    "LikelihoodSite",
    "categorical_expected_log_prob",
    "elementwise_expected_log_prob",
    "likelihood_term",
    "unwrap_independent",
]


def unwrap_independent(fn: Any) -> tuple[Any, int]:
    """Strip ``Independent`` wrappers; return the base distribution and the dims they added."""
    dims = 0
    while isinstance(fn, torch.distributions.Independent):
        dims += fn.reinterpreted_batch_ndims
        fn = fn.base_dist
    return fn, dims


def likelihood_term(likelihood: likelihoods.Likelihood, g: Gaussian) -> Callable[[Tensor], Tensor]:
    """``y -> likelihood.expected_log_prob(g, y)``, the observation broadcast to the batch shape.

    The one route from a Pyro observed site to the library's expected log-likelihoods: the same
    method, with the same checks, as the Lightning modules' training loss.
    """
    batch = g.mean.shape[:-1]
    return lambda y: likelihood.expected_log_prob(g, y.expand(batch))


def categorical_expected_log_prob(
    what: str, logits: MomentTensor, link: str = "log_softmax"
) -> Callable[[Tensor], Tensor]:
    """``y ->`` :class:`lightning_dvi.likelihoods.Categorical`'s expected log-likelihood.

    With the class's default method (``"tight"``, as :class:`~lightning_dvi.DVIClassifier`):
    never above the true expected log-likelihood. ``link``: what ``logits`` stands for
    (``"log_softmax"`` of the logits, as ``Categorical(logits=f)`` normalises them, or
    ``"softmax"``, the ``probs`` of ``Categorical(probs=softmax(f))``); either way the
    Gaussian of the logits is integrated.
    """
    g = logits.gaussian(what, link=link)
    return likelihood_term(likelihoods.Categorical(g.mean.shape[-1]), g)


def elementwise_expected_log_prob(
    what: str, f: MomentTensor, likelihood: likelihoods.Likelihood, link: str | None = None
) -> Callable[[Tensor], Tensor]:
    """``y ->`` the expected log-likelihood of a one-output likelihood applied to every element.

    Only marginals matter (the expectation of a sum of per-element terms), so a full-mode
    tensor whose covariance a shape op dropped is fine here.
    """
    if f.dvi_link != link:
        f.check_unlinked(what)
    mean, var = f.dvi_mean, f.dvi_var
    g = Gaussian(mean.unsqueeze(-1), var=var.unsqueeze(-1), validate=False)
    return likelihood_term(likelihood, g)


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
    the method for direct use. The logits :math:`a \sim \mathcal N(\mu, C)` (the full
    :math:`C` in ``full`` mode, its diagonal in ``diag`` mode), and the expected log-likelihood
    is :class:`lightning_dvi.likelihoods.Categorical`'s, with its default method: the lower
    bound :func:`~lightning_dvi.likelihoods.functional.categorical_tight_expected_log_prob`,
    never above :math:`\mathbb E\log\operatorname{softmax}(a)_y` and the objective
    :class:`~lightning_dvi.DVIClassifier` trains with.

    Args:
        probs: as for ``pyro.distributions.Categorical``; in a moment pass only
            ``torch.softmax(f, -1)`` of the network output (the logits form is used).
        logits: ``[..., K]``, a tensor or a moment tensor.
        validate_args: as for torch distributions.
    """

    def __init__(
        self,
        probs: Tensor | None = None,
        logits: Tensor | None = None,
        validate_args: bool | None = None,
    ) -> None:
        if isinstance(probs, MomentTensor) and probs.dvi_link != "softmax":
            raise unsupported(
                "Categorical(probs=p) on moments, p not the softmax of the network output",
                "pass probs=torch.softmax(f, -1) or logits=f",
            )
        if isinstance(logits, MomentTensor) or isinstance(probs, MomentTensor):
            validate_args = False  # support checks are comparisons, which moments refuse
        super().__init__(probs=probs, logits=logits, validate_args=validate_args)

    def expand(
        self, batch_shape: torch.Size | list[int] | tuple[int, ...], _instance: Any = None
    ) -> Categorical:
        """Broadcast the batch shape (moment logits keep their covariance)."""
        new = type(self).__new__(type(self)) if _instance is None else _instance
        return cast(Categorical, super().expand(batch_shape, _instance=new))

    def expected_log_prob(self, value: Tensor) -> Tensor:
        r"""Lower bound on :math:`\mathbb E_q\log p(y\mid a)` (``log_prob`` for plain logits)."""
        logits, probs = self.__dict__.get("logits"), self.__dict__.get("probs")
        if isinstance(logits, MomentTensor):
            return categorical_expected_log_prob("Categorical", logits)(value)
        if isinstance(probs, MomentTensor):
            return categorical_expected_log_prob("Categorical", probs, link="softmax")(value)
        return cast(Tensor, self.log_prob(value))

"""Binary classification with a single Gaussian logit."""

from __future__ import annotations

import torch
from torch import Tensor

from ..gaussian import Gaussian
from . import functional as F
from .base import ExportOptions, Likelihood, PredictiveHead
from .categorical import tempered

__all__ = ["Bernoulli"]


class Bernoulli(Likelihood):
    r"""Two classes from one logit :math:`f`: :math:`p(y = 1\mid f) = \sigma(f)`.

    Expected log-likelihood (the training objective): a lower bound on
    :math:`\mathbb E\log p(y\mid f) = -\mathbb E\operatorname{softplus}(-(2y - 1)f)`, never
    above the truth and within a relative :math:`4\cdot10^{-4}` of it for every mean and
    variance (:func:`~lightning_dvi.likelihoods.functional.bernoulli_expected_log_prob`).
    Predictive: :math:`\mathbb E\,\sigma(f)` to :math:`3\cdot10^{-5}`
    (:func:`~lightning_dvi.likelihoods.functional.sigmoid_normal_mean`), a
    ``torch.distributions.Bernoulli``. The same objective as a two-logit
    :class:`~lightning_dvi.likelihoods.Categorical` on the logit difference, with one output
    instead of two.

    Labels are ``0``/``1`` (integers, booleans, or floats holding those values), shape ``[B]``
    (``[B, 1]`` is accepted).

    Args:
        mc_samples: draws for the base-class Monte Carlo estimate.

    Examples:
        >>> lik = Bernoulli()
        >>> out = Gaussian(torch.tensor([[0.0], [2.0]]), var=torch.tensor([[1.0], [1.0]]))
        >>> lik.predictive(out).probs
        tensor([0.5000, 0.8445])
    """

    num_outputs = 1
    task = "classification"
    num_classes = 2  # from one logit

    def _check_values(self, y: Tensor) -> Tensor:
        return self._check_discrete(y, lambda t: (t == 0) | (t == 1), "labels must be 0 or 1")

    def conditional(self, f: Tensor) -> torch.distributions.Bernoulli:
        r""":math:`\operatorname{Bern}(\sigma(f))` with ``f = f[..., 0]``."""
        return torch.distributions.Bernoulli(logits=f[..., 0], validate_args=False)

    def _log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        log_p: Tensor = self.conditional(f).log_prob(y.to(f.dtype))
        return log_p

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r"""Lower bound on :math:`\mathbb E\log\operatorname{Bern}(y\mid\sigma(f))` per datum, ``[B]``.

        ``mc_samples`` is ignored (kept for the base-class signature).
        """
        y = self.validate_target(y, self.validate_output(out))
        return F.bernoulli_expected_log_prob(out.mean[..., 0], out.var[..., 0], y)

    def class_probs(self, f: Tensor) -> Tensor:
        r"""Class probabilities :math:`(1 - \sigma(f), \sigma(f))` at sampled logits, ``[..., 2]``."""
        p = torch.sigmoid(f[..., 0])
        return torch.stack([1 - p, p], -1)

    def predictive_probs(self, out: Gaussian) -> Tensor:
        r"""Class probabilities :math:`(1 - \bar p, \bar p)`, :math:`\bar p = \mathbb E\,\sigma(f)`, ``[B, 2]``."""
        p = self.predictive(out).probs
        return torch.stack([1 - p, p], -1)

    def predictive(self, out: Gaussian) -> torch.distributions.Bernoulli:
        r""":math:`\operatorname{Bern}(\mathbb E\,\sigma(f))`, batch shape ``[B]``."""
        self.validate_output(out)
        return torch.distributions.Bernoulli(
            probs=F.sigmoid_normal_mean(out.mean[..., 0], out.var[..., 0])
        )

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""Class probabilities ``[B, 2]``, :math:`(1 - \bar p, \bar p)`, as :meth:`predictive_probs`.

        Tempered, :math:`\operatorname{softmax}(\log p / T)`, when ``options.temperature`` is
        not 1 (as ``DVIClassifier(likelihood="bernoulli")``'s temperature scaling).
        """
        return _BernoulliHead(options.temperature, options.dtype)


class _BernoulliHead(PredictiveHead):
    name = "bernoulli"
    temperature: Tensor

    def __init__(self, temperature: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.tempered = temperature != 1.0  # decided here: no data-dependent branch when traced
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=dtype))

    def forward(self, out: Gaussian) -> Tensor:
        p = F.sigmoid_normal_mean(out.mean[..., 0], out.var[..., 0])
        probs = torch.stack([1 - p, p], -1)
        return tempered(probs, self.temperature) if self.tempered else probs

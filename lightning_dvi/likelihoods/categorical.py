"""Softmax classification on Gaussian logits: a certified bound, closed forms (Clark, delta) or Monte Carlo."""

from __future__ import annotations

import torch
from torch import Tensor

from ..gaussian import Gaussian
from ..moments import policy
from . import functional as F
from .base import ExportOptions, Likelihood, PredictiveHead, _all_finite
from .predictive import categorical_predictive

__all__ = ["Categorical"]

_EXPECTED_LOG_PROBS = {
    "bound": F.categorical_bound_expected_log_prob,
    "clark": F.categorical_clark_expected_log_prob,
    "delta": F.categorical_delta_expected_log_prob,
    "tight": F.categorical_tight_expected_log_prob,
}

_METHODS = ("tight", "bound", "clark", "delta", "mc")


class Categorical(Likelihood):
    r"""Classification with logits :math:`a`: :math:`p(y\mid a) = \operatorname{softmax}(a)_y`.

    Five ways to integrate the expected log-likelihood over the logit Gaussian
    :math:`\mathcal N(\langle a\rangle, C)`:

    * ``"tight"`` (default, the training objective): a lower bound that is never above the
      true :math:`\mathbb E\log\operatorname{softmax}(a)_y`, for any means and variances
      (:func:`~lightning_dvi.likelihoods.functional.categorical_tight_expected_log_prob`): the
      best of tempered Jensen at the reference :math:`\operatorname{softmax}\langle a\rangle`
      (exact to second order in :math:`C`), one-vs-each and Bouchard's bound at the mean
      logit. An optimiser cannot gain by inflating the logit variances, as it can with
      ``"delta"``, and it charges them little more than they cost: a mean gap to Monte Carlo
      of 0.0003 nats at logit variance 0.1, 0.05 at 1, 0.95 at 10, 2.0 at 100 (10 classes).
    * ``"bound"``: the library's earlier certified bound
      (:func:`~lightning_dvi.likelihoods.functional.categorical_bound_expected_log_prob`), as
      safe but looser at logit variances of 1 and more (mean gap 0.21 at 1, 2.1 at 10, 9.4 at
      100); kept for comparison and for models trained with it.
    * ``"clark"``: the smoothed-max closed form
      (:func:`~lightning_dvi.likelihoods.functional.categorical_clark_expected_log_prob`); close
      to Monte Carlo but up to 1.1 nats above it at large variances (an approximation, not a
      bound), kept for analysis.
    * ``"delta"``: the second-order delta method of appendix B.4
      (:func:`~lightning_dvi.likelihoods.functional.categorical_delta_expected_log_prob`); the
      most accurate for variances below 0.1, but its variance penalty vanishes on confidently
      classified points while the truth falls like :math:`\sqrt v`, so there it is up to 40
      nats above Monte Carlo (at :math:`v = 10^3`) and a model trained on it inflates its
      weight variances; for analysis only.
    * ``"mc"``: the paper's "DVI-MC", ``mc_samples`` reparameterised draws of the logits only
      (the network itself is still propagated deterministically).

    The predictive of every closed-form method is
    :func:`~lightning_dvi.likelihoods.predictive.categorical_predictive` (deterministic, within
    0.03 total variation of Monte Carlo at any logit variance; issue 26), not the paper's B.5
    delta predictive, which inverts the class ranking and gives exact zeros once logit
    variances reach about 1 (issue 17); ``"mc"`` averages softmax over logit draws.
    Measured errors of all of them: docs/likelihoods_and_priors.md.

    Full and diag logit covariances are both accepted.

    Args:
        num_classes: :math:`K`, the number of logits and of classes.
        method: ``"tight"``, ``"bound"``, ``"clark"``, ``"delta"`` or ``"mc"``.
        mc_samples: logit draws for ``"mc"`` (and for the base-class Monte Carlo estimate).

    Examples:
        >>> lik = Categorical(3)
        >>> out = Gaussian(torch.zeros(4, 3), var=torch.full((4, 3), 0.01))
        >>> lik.predictive(out).probs.sum(-1)
        tensor([1., 1., 1., 1.])
    """

    _accepts_trailing_one = False

    task = "classification"
    num_classes: int  # set by the constructor

    def __init__(self, num_classes: int, method: str = "tight", mc_samples: int = 32) -> None:
        super().__init__(mc_samples)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
            raise ValueError(f"num_classes must be an int >= 2, got {num_classes!r}")
        if method not in _METHODS:
            raise ValueError(f"method must be one of {', '.join(_METHODS)}, got {method!r}")
        self.num_classes = num_classes
        self.num_outputs = num_classes
        self.method = method

    def _check_values(self, y: Tensor) -> Tensor:
        if y.dtype == torch.bool or y.is_complex():
            raise ValueError(f"Categorical: labels must be integers, got dtype {y.dtype}")
        if policy.tracing():  # value checks are host reads: done by the caller
            return y.long()
        if y.dtype.is_floating_point:
            if not _all_finite(y):
                raise ValueError("Categorical: labels contain NaN or Inf")
            if not torch.equal(y, y.round()):
                raise ValueError("Categorical: labels must be integers, got non-integer values")
        y = y.long()
        if y.numel():
            lo, hi = torch.aminmax(y)  # one pass, then one host read each
            low, high = int(lo), int(hi)
            if low < 0 or high >= self.num_classes:
                raise ValueError(
                    f"Categorical: labels out of range [0, {self.num_classes}): "
                    f"min {low}, max {high}"
                )
        return y

    @staticmethod
    def _cov(out: Gaussian) -> Tensor:
        return out.cov if out.cov is not None else out.var

    def conditional(self, f: Tensor) -> torch.distributions.Categorical:
        r""":math:`\operatorname{Cat}(\operatorname{softmax} f)` over the last dimension."""
        return torch.distributions.Categorical(logits=f, validate_args=False)

    def _log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        index = y.expand(f.shape[:-1]).unsqueeze(-1)
        return torch.log_softmax(f, dim=-1).gather(-1, index).squeeze(-1)

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r""":math:`\mathbb E\log\operatorname{softmax}(a)_y` per datum ``[B]``, by ``method``.

        ``mc_samples`` overrides the sample count of ``"mc"``; the closed forms ignore it.
        """
        if self.method == "mc":
            return super().expected_log_prob(out, y, mc_samples)
        y = self.validate_target(y, self.validate_output(out))
        return _EXPECTED_LOG_PROBS[self.method](out.mean, self._cov(out), y)

    def class_probs(self, f: Tensor) -> Tensor:
        r""":math:`\operatorname{softmax}(f)` at sampled logits, ``[..., K]``."""
        return torch.softmax(f, dim=-1)

    def predictive_probs(self, out: Gaussian, mc_samples: int | None = None) -> Tensor:
        r""":math:`\mathbb E\operatorname{softmax}(a)`, ``[B, K]``, by ``method``."""
        self.validate_output(out)
        if self.method != "mc":
            return _closed_form_probs(out)
        s = self.mc_samples if mc_samples is None else mc_samples
        return torch.softmax(out.sample((s,)), dim=-1).mean(0)

    def predictive(self, out: Gaussian) -> torch.distributions.Categorical:
        """``torch.distributions.Categorical`` over the :meth:`predictive_probs`."""
        return torch.distributions.Categorical(probs=self.predictive_probs(out))

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""The closed-form class probabilities ``[B, K]`` of :meth:`predictive_probs`.

        Tempered, :math:`\operatorname{softmax}(\log p / T)`, when ``options.temperature`` is not 1
        (as ``DVIClassifier``'s temperature scaling).

        Raises:
            ValueError: for ``method="mc"``, whose predictive samples.
        """
        if self.method == "mc":
            raise ValueError(
                "a Categorical(method='mc') predictive samples logits; export needs "
                "a deterministic method: method='tight' (the default), method='bound', "
                "method='clark' or method='delta'"
            )
        return _CategoricalHead(options.temperature, options.dtype)

    def extra_repr(self) -> str:
        """Class count and integration method."""
        return (
            f"num_classes={self.num_classes}, method={self.method!r}, mc_samples={self.mc_samples}"
        )


def _closed_form_probs(out: Gaussian) -> Tensor:
    """The deterministic predictive of every closed-form method (one place for both users)."""
    return categorical_predictive(out.mean, Categorical._cov(out))


class _CategoricalHead(PredictiveHead):
    name = "categorical"
    temperature: Tensor

    def __init__(self, temperature: float, dtype: torch.dtype) -> None:
        super().__init__()
        # decided once here, so the traced graph has no data-dependent branch
        self.tempered = temperature != 1.0
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=dtype))

    def forward(self, out: Gaussian) -> Tensor:
        probs = _closed_form_probs(out)
        return tempered(probs, self.temperature) if self.tempered else probs


def tempered(probs: Tensor, temperature: Tensor) -> Tensor:
    r""":math:`\operatorname{softmax}(\log p / T)`, as DVIClassifier's TemperatureScaling (exported heads)."""
    return torch.softmax(probs.clamp_min(1e-30).log() / temperature, dim=-1)

r"""Out-of-distribution detection and selective prediction, as torchmetrics ``Metric`` classes.

**OOD detection.** An uncertainty score :math:`u(x)` (higher means "more likely out of
distribution") separates in-distribution inputs (label 0) from OOD inputs (label 1).
:class:`OODAUROC` is the area under the ROC curve of that detector (the probability that a
random OOD input scores above a random in-distribution one, ties counting one half);
:class:`OODAUPR` is the area under the precision-recall curve with OOD as the positive class
(average precision, :math:`\sum_n (R_n - R_{n-1}) P_n`). The usual scores are the predictive
entropy :math:`H[\bar p] = -\sum_k \bar p_k\log\bar p_k` (:func:`predictive_entropy`) and, when
the model gives samples of class probabilities (weight samples in ``sample``/``local`` mode,
or logit draws from the DVI logit Gaussian), the mutual information between label and
weights :math:`I = H[\bar p] - \frac1S\sum_s H[p_s]` (:func:`mutual_information`).

**Selective prediction.** Sorting test points by confidence :math:`\max_k \bar p_k` and keeping
the :math:`n` most confident gives the accuracy-rejection curve
(:func:`accuracy_rejection_curve`); its risk counterpart integrated over coverage is the AURC,
:math:`\frac1N\sum_{n=1}^N \frac1n\sum_{i\le n}\mathbb 1[\hat y_{(i)} \ne y_{(i)}]`
(:class:`AURC`, lower is better).

All states are concatenated per point (``dist_reduce_fx="cat"``), so under DDP every process
computes the metric of the whole evaluation set.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.functional.classification import binary_auroc, binary_average_precision
from torchmetrics.utilities import dim_zero_cat

from ..gaussian import Gaussian
from .functional import check_probabilities

__all__ = [
    "AURC",
    "OODAUPR",
    "OODAUROC",
    "accuracy_rejection_curve",
    "aurc",
    "class_probability_samples",
    "classification_summary",
    "mutual_information",
    "predictive_entropy",
]


def predictive_entropy(probs: Tensor, eps: float = 1e-12) -> Tensor:
    r"""Entropy :math:`-\sum_k p_k \log p_k` of each row of ``probs [..., K]`` (nats)."""
    return -(probs * probs.clamp_min(eps).log()).sum(-1)


def mutual_information(sample_probs: Tensor, eps: float = 1e-12) -> Tensor:
    r"""Mutual information :math:`H[\bar p] - \overline{H[p_s]}` from ``sample_probs [S, B, K]``.

    Non-negative by the concavity of entropy (clamped at 0 against round-off); returns ``[B]``.
    """
    if sample_probs.dim() != 3:
        raise ValueError(f"sample_probs must have shape [S, B, K], got {tuple(sample_probs.shape)}")
    mean_entropy = predictive_entropy(sample_probs, eps).mean(0)
    return (predictive_entropy(sample_probs.mean(0), eps) - mean_entropy).clamp_min(0)


def class_probability_samples(
    out: Gaussian | Tensor, num_samples: int = 64, generator: torch.Generator | None = None
) -> Tensor:
    r"""Samples of class probabilities ``[S, B, K]`` from a network output.

    A Gaussian over logits (``full``/``diag`` mode) is sampled ``num_samples`` times; a tensor
    of logit samples ``[S, B, K]`` (``sample``/``local`` mode) is used as it is. A single logit
    (``K = 1``, a Bernoulli classifier) gives the two class probabilities
    :math:`(1 - \sigma(f), \sigma(f))`.
    """
    if isinstance(out, Gaussian):
        eps = torch.randn(
            (num_samples, *out.mean.shape), dtype=out.dtype, device=out.device, generator=generator
        )
        if out.cov is not None:
            d = out.mean.shape[-1]
            jitter = 1e-6 * out.var.mean(-1, keepdim=True).clamp_min(1e-12).unsqueeze(-1)
            eye = torch.eye(d, dtype=out.dtype, device=out.device)
            chol = torch.linalg.cholesky(out.cov + jitter * eye)
            logits = out.mean + (chol @ eps.unsqueeze(-1)).squeeze(-1)
        else:
            logits = out.mean + out.stddev * eps
        return _class_probs(logits)
    if out.dim() != 3:
        raise ValueError(f"logit samples must have shape [S, B, K], got {tuple(out.shape)}")
    return _class_probs(out)


def _class_probs(logits: Tensor) -> Tensor:
    if logits.shape[-1] == 1:  # one logit for two classes
        p = torch.sigmoid(logits)
        return torch.cat([1 - p, p], -1)
    return torch.softmax(logits, dim=-1)


def accuracy_rejection_curve(confidence: Tensor, correct: Tensor) -> tuple[Tensor, Tensor]:
    """Accuracy of the ``n`` most confident points, for ``n = N, ..., 1``.

    Args:
        confidence: ``[N]`` confidence of each prediction (e.g. the top class probability).
        correct: ``[N]`` whether each prediction is right (bool or 0/1).

    Returns:
        ``(rejection, accuracy)``: the fraction of points rejected, ``(N - n) / N`` (from 0
        up), and the accuracy on the kept ones. Ties in confidence keep the input order.
    """
    order = torch.argsort(confidence, descending=True, stable=True)
    hits = correct[order].to(torch.float64)
    n = torch.arange(1, hits.numel() + 1, dtype=torch.float64, device=hits.device)
    accuracy = hits.cumsum(0) / n
    rejection = 1.0 - n / hits.numel()
    return rejection.flip(0), accuracy.flip(0)


def aurc(confidence: Tensor, correct: Tensor) -> Tensor:
    r"""Area under the risk-coverage curve, :math:`\frac1N\sum_n \text{risk}(n)` (float64)."""
    _, accuracy = accuracy_rejection_curve(confidence, correct)
    return (1.0 - accuracy).mean()


def _check_scores(score: Tensor, is_ood: Tensor) -> None:
    if score.dim() != 1 or is_ood.shape != score.shape:
        raise ValueError(
            f"score and is_ood must be 1-D of the same length, got {tuple(score.shape)} and "
            f"{tuple(is_ood.shape)}"
        )
    if not score.is_floating_point() or not torch.isfinite(score).all():
        raise ValueError("score must be a finite floating-point tensor")
    if is_ood.is_floating_point() or not ((is_ood == 0) | (is_ood == 1)).all():
        raise ValueError("is_ood must hold 0/1 (or bool) labels: 1 marks an OOD input")


class _OODMetric(Metric):
    full_state_update = False
    is_differentiable = False
    higher_is_better = True
    scores: list[Tensor]  # metric states (add_state below)
    labels: list[Tensor]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.add_state("scores", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")

    def update(self, score: Tensor, is_ood: Tensor) -> None:
        """Accumulate scores ``[B]`` (higher: more likely OOD) and 0/1 OOD labels ``[B]``."""
        _check_scores(score, is_ood)
        self.scores.append(score.detach().double())
        self.labels.append(is_ood.long())

    def _area(self, score: Tensor, label: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def compute(self) -> Tensor:
        """The area over every point seen (all processes)."""
        score, label = dim_zero_cat(self.scores), dim_zero_cat(self.labels)
        positives = int(label.sum())
        if positives == 0 or positives == label.numel():
            raise ValueError(
                f"{type(self).__name__} needs both in-distribution (0) and OOD (1) inputs, got "
                f"{label.numel() - positives} and {positives}"
            )
        return self._area(score, label)


class OODAUROC(_OODMetric):
    """AUROC of an uncertainty score separating OOD (label 1) from in-distribution inputs.

    Examples:
        >>> m = OODAUROC()
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> m.compute().item()
        0.75
    """

    def _area(self, score: Tensor, label: Tensor) -> Tensor:
        return binary_auroc(score, label)


class OODAUPR(_OODMetric):
    """Average precision of an uncertainty score with OOD inputs as the positive class.

    Examples:
        >>> m = OODAUPR()
        >>> m.update(torch.tensor([0.1, 0.4, 0.35, 0.8]), torch.tensor([0, 0, 1, 1]))
        >>> round(m.compute().item(), 4)
        0.8333
    """

    def _area(self, score: Tensor, label: Tensor) -> Tensor:
        return binary_average_precision(score, label)


class AURC(Metric):
    """Area under the risk-coverage curve of predictive class probabilities (lower is better).

    Updated with ``(probs [B, K], target [B])``; confidence is the top probability. The
    accuracy-rejection curve of the same points is :meth:`curve`.

    Examples:
        >>> m = AURC()
        >>> m.update(torch.tensor([[0.9, 0.1], [0.4, 0.6], [0.7, 0.3]]), torch.tensor([0, 0, 1]))
        >>> round(m.compute().item(), 4)  # risks 0, 1/2, 2/3 at coverage 1/3, 2/3, 1
        0.3889
    """

    full_state_update = False
    is_differentiable = False
    higher_is_better = False
    confidences: list[Tensor]  # metric states (add_state below)
    hits: list[Tensor]

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_args = validate_args
        self.add_state("confidences", default=[], dist_reduce_fx="cat")
        self.add_state("hits", default=[], dist_reduce_fx="cat")

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Accumulate a batch of class probabilities and labels."""
        if self.validate_args:
            check_probabilities(probs, target)
        confidence, predicted = probs.detach().max(-1)
        self.confidences.append(confidence.double())
        self.hits.append((predicted == target).long())

    def curve(self) -> tuple[Tensor, Tensor]:
        """``(rejection, accuracy)`` of :func:`accuracy_rejection_curve` on the points seen."""
        return accuracy_rejection_curve(dim_zero_cat(self.confidences), dim_zero_cat(self.hits))

    def compute(self) -> Tensor:
        """AURC over every point seen (all processes)."""
        return aurc(dim_zero_cat(self.confidences), dim_zero_cat(self.hits))


def classification_summary(
    probs: Tensor,
    target: Tensor,
    ood_probs: Tensor | None = None,
    sample_probs: Tensor | None = None,
    ood_sample_probs: Tensor | None = None,
    n_bins: int = 15,
) -> dict[str, float]:
    """Every number of a classification benchmark row, from predictive probabilities.

    Args:
        probs: predictive class probabilities on the test inputs ``[N, K]``.
        target: test labels ``[N]``.
        ood_probs: predictive probabilities on OOD inputs ``[M, K]`` (optional).
        sample_probs: class-probability samples on the test inputs ``[S, N, K]`` (optional,
            for the mutual-information detector).
        ood_sample_probs: the same on the OOD inputs ``[S, M, K]``.
        n_bins: ECE bins.

    Returns:
        ``acc``, ``nll``, ``brier``, ``ece`` (:class:`~lightning_dvi.metrics.ClassificationMetrics`)
        and ``aurc``; with ``ood_probs`` also ``ood_auroc`` and ``ood_aupr`` of the predictive
        entropy; with both sample tensors also ``ood_auroc_mi`` and ``ood_aupr_mi``.
    """
    from .classification import ClassificationMetrics

    k = probs.shape[-1]
    metrics = ClassificationMetrics(k, n_bins=n_bins)
    metrics.update(probs, target)
    out = {name: float(v) for name, v in metrics.compute().items()}
    selective = AURC()
    selective.update(probs, target)
    out["aurc"] = float(selective.compute())
    scores: dict[str, tuple[Tensor, Tensor]] = {}
    if ood_probs is not None:
        scores[""] = (predictive_entropy(probs), predictive_entropy(ood_probs))
    if sample_probs is not None and ood_sample_probs is not None:
        scores["_mi"] = (mutual_information(sample_probs), mutual_information(ood_sample_probs))
    for suffix, (s_in, s_ood) in scores.items():
        score = torch.cat([s_in, s_ood]).double()
        label = torch.cat([torch.zeros_like(s_in), torch.ones_like(s_ood)]).long()
        for name, metric in (("ood_auroc", OODAUROC()), ("ood_aupr", OODAUPR())):
            metric.update(score, label)
            out[name + suffix] = float(metric.compute())
    return out

r"""Post-hoc calibration of a classifier's predictive, fitted on validation data.

Temperature scaling (Guo et al., 2017) rescales the predictive log-probabilities by one scalar
:math:`T > 0`,

.. math::
    p_T(y\mid x) = \frac{p(y\mid x)^{1/T}}{\sum_k p(k\mid x)^{1/T}}
    = \operatorname{softmax}\big(\log p(\cdot\mid x) / T\big)_y,

with :math:`T` minimising the negative log-likelihood on held-out (validation) data. It keeps
the arg-max (so accuracy) and only changes the confidence. It is *not* part of the Bayesian
model: report tempered and untempered numbers separately (docs/calibration.md).

A *floor* :math:`\varepsilon \in [0, 1)` mixes the (tempered) predictive with the uniform
distribution over the :math:`K` classes,

.. math::
    p_{T,\varepsilon}(y\mid x) = (1 - \varepsilon)\, p_T(y\mid x) + \varepsilon / K,

the predictive of labels that are replaced at random with probability :math:`\varepsilon`.
A temperature alone can only give the unlikely classes mass by flattening the top class too;
with the floor, :math:`T < 1` can sharpen the top class while :math:`\varepsilon` keeps the
tails (fitted jointly on the validation NLL, :func:`fit_temperature_floor`).

A *scale factor* :math:`c` instead multiplies the posterior standard deviations,
:math:`\sigma \leftarrow c\,\sigma` (:func:`~lightning_dvi.nn.calibrate_scales`): it changes
the logit variances and leaves their means alone. :func:`calibrate_classifier` fits both on
the validation rows and keeps one only on evidence (:func:`paired_choice`: a paired gain in
validation log-likelihood of ``z`` standard errors over the predictive as trained);
:func:`select_classifier` makes the same choice among several trained candidates.
``DVIClassifier(calibrate=True)``, the default, runs :func:`calibrate_classifier` at the end of
every ``fit`` that has validation data.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

from ..gaussian import Gaussian
from ..likelihoods.base import ExportOptions, Likelihood, PredictiveHead

if TYPE_CHECKING:
    from .classifier import DVIClassifier

__all__ = [
    "CalibrationChoice",
    "CalibrationVariant",
    "FlooredExport",
    "PredictiveCalibration",
    "TemperatureScaling",
    "calibrate_classifier",
    "fit_temperature",
    "fit_temperature_floor",
    "floor_probs",
    "paired_choice",
    "rewrite_last_checkpoints",
    "select_classifier",
    "temper_probs",
]

#: A predictive :func:`select_classifier` scores (:class:`CalibrationVariant`).
VariantKind = Literal[
    "trained",
    "scale",
    "temperature",
    "scale+temperature",
    "temperature+floor",
    "scale+temperature+floor",
]
#: The post-hoc variants :func:`calibrate_classifier` fits (besides the predictive as trained).
DEFAULT_KINDS: tuple[VariantKind, ...] = (
    "scale",
    "temperature",
    "scale+temperature",
    "temperature+floor",
    "scale+temperature+floor",
)

_TINY = 1e-30


class _Calibrated(Protocol):
    """What :class:`TemperatureScaling` needs of the module (a ``DVIClassifier``)."""

    predictive_temperature: Tensor

    def predictive(self, x: Tensor) -> Tensor: ...


def temper_probs(probs: Tensor, temperature: Tensor | float) -> Tensor:
    r""":math:`\operatorname{softmax}(\log p / T)` along the last dimension.

    Args:
        probs: class probabilities ``[..., K]`` (floored at 1e-30 before the log).
        temperature: :math:`T > 0`.

    Returns:
        The tempered probabilities, same shape.

    Examples:
        >>> p = torch.tensor([0.7, 0.2, 0.1])
        >>> torch.allclose(temper_probs(p, 1.0), p)
        True
        >>> bool(temper_probs(p, 0.5)[0] > 0.7)
        True
    """
    t = torch.as_tensor(temperature, dtype=probs.dtype, device=probs.device)
    return torch.softmax(probs.clamp_min(_TINY).log() / t, dim=-1)


def fit_temperature(probs: Tensor, target: Tensor, max_iter: int = 100) -> float:
    r"""The :math:`T` minimising the mean NLL of :func:`temper_probs` on ``(probs, target)``.

    One-dimensional and convex in :math:`1/T`; optimised over :math:`\log T` by L-BFGS in
    float64.

    Args:
        probs: class probabilities ``[N, K]``.
        target: integer labels ``[N]``.
        max_iter: L-BFGS iterations.

    Returns:
        :math:`T > 0`.

    Raises:
        ValueError: on empty or mismatched inputs.

    Examples:
        >>> probs = torch.tensor([[0.6, 0.4], [0.6, 0.4], [0.6, 0.4], [0.4, 0.6]])
        >>> t = fit_temperature(probs, torch.tensor([0, 0, 0, 1]))
        >>> t < 1  # always right: sharpen
        True
    """
    if probs.dim() != 2 or target.shape != probs.shape[:1] or probs.shape[0] == 0:
        raise ValueError(
            f"fit_temperature needs probs [N, K] and target [N] with N > 0, got "
            f"{tuple(probs.shape)} and {tuple(target.shape)}"
        )
    log_p = probs.detach().double().clamp_min(_TINY).log()
    target = target.long()
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(log_p / log_t.exp(), target)
        loss.backward()
        return loss

    opt.step(closure)
    t = float(log_t.detach().exp())
    if not math.isfinite(t) or t <= 0:
        raise FloatingPointError(f"temperature fit diverged (T = {t})")
    return t


def floor_probs(probs: Tensor, floor: Tensor | float) -> Tensor:
    r""":math:`(1 - \varepsilon)\,p + \varepsilon / K` along the last dimension.

    Args:
        probs: class probabilities ``[..., K]``.
        floor: :math:`\varepsilon \in [0, 1)`.

    Returns:
        The mixture with the uniform distribution, same shape.

    Examples:
        >>> floor_probs(torch.tensor([1.0, 0.0]), 0.2)
        tensor([0.9000, 0.1000])
    """
    eps = torch.as_tensor(floor, dtype=probs.dtype, device=probs.device)
    return (1 - eps) * probs + eps / probs.shape[-1]


def fit_temperature_floor(
    probs: Tensor, target: Tensor, max_iter: int = 200
) -> tuple[float, float]:
    r"""The :math:`(T, \varepsilon)` minimising the mean NLL of :func:`floor_probs` of :func:`temper_probs`.

    .. math::
        (T^\star, \varepsilon^\star) = \arg\min_{T > 0,\ 0 \le \varepsilon < 1}
        -\frac1N \sum_n \log\Big((1 - \varepsilon)
        \operatorname{softmax}\big(\log p_n / T\big)_{y_n} + \frac{\varepsilon}{K}\Big),

    by L-BFGS over :math:`(\log T, \operatorname{logit}\varepsilon)` in float64, started at
    :math:`T = 1, \varepsilon = 0.01`; when the temperature alone (:func:`fit_temperature`,
    :math:`\varepsilon = 0`) scores at least as well, that is returned.

    Args:
        probs: class probabilities ``[N, K]``.
        target: integer labels ``[N]``.
        max_iter: L-BFGS iterations.

    Returns:
        :math:`(T, \varepsilon)`.

    Examples:
        >>> gen = torch.Generator().manual_seed(0)
        >>> sharp = torch.softmax(4 * torch.randn(2000, 5, generator=gen), -1)
        >>> noisy = torch.where(torch.rand(2000, generator=gen) < 0.2,
        ...                     torch.randint(0, 5, (2000,), generator=gen), sharp.argmax(-1))
        >>> t, eps = fit_temperature_floor(sharp, noisy)
        >>> 0.1 < eps < 0.3
        True
    """
    t_only = fit_temperature(probs, target)
    log_p = probs.detach().double().clamp_min(_TINY).log()
    target = target.long().reshape(-1, 1)

    def nll(u: Tensor) -> Tensor:
        mixed = floor_probs(torch.softmax(log_p / u[0].exp(), -1), torch.sigmoid(u[1]))
        return -mixed.gather(-1, target).clamp_min(_TINY).log().mean()

    u = torch.tensor([0.0, math.log(0.01 / 0.99)], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([u], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = nll(u)
        loss.backward()
        return loss

    opt.step(closure)
    found = u.detach()
    with torch.no_grad():
        joint = float(nll(found))
        alone = float(nll(torch.tensor([math.log(t_only), -math.inf], dtype=torch.float64)))
    if not math.isfinite(joint) or joint >= alone:
        return t_only, 0.0
    return float(found[0].exp()), float(torch.sigmoid(found[1]))


class _FlooredHead(PredictiveHead):
    """An exported classification head mixed with the uniform floor: :func:`floor_probs`."""

    name = "floored"
    floor: Tensor

    def __init__(self, inner: PredictiveHead, floor: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("floor", torch.tensor(float(floor), dtype=dtype))

    def forward(self, out: Gaussian) -> Tensor:
        """The inner head's class probabilities ``[B, K]``, mixed with the floor."""
        return floor_probs(cast(Tensor, self.inner(out)), self.floor)


class FlooredExport(Likelihood):
    r"""For export only: a classification likelihood whose exported head carries a uniform floor.

    What ``DVIClassifier.predictive_parts`` hands to :func:`~lightning_dvi.nn.export_predictive`
    when its ``predictive_floor`` is not 0, so the exported predictive is the classifier's.

    Args:
        likelihood: the classifier's likelihood (it builds the inner head: tempered as usual).
        floor: :math:`\varepsilon`.
    """

    task = "classification"

    def __init__(self, likelihood: Likelihood, floor: float) -> None:
        super().__init__()
        self.likelihood, self.floor = likelihood, float(floor)
        self.num_outputs = likelihood.num_outputs

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        """The inner likelihood's head, then :func:`floor_probs`."""
        return _FlooredHead(self.likelihood.export_head(options), self.floor, options.dtype)


class TemperatureScaling(Callback):
    """Fit a predictive temperature on the validation data at the end of ``fit``.

    After training, runs the model's ``predictive`` over ``trainer.datamodule``'s
    validation loader (or the ``val_dataloaders`` given to ``fit``), fits :math:`T` by
    :func:`fit_temperature` and writes it into the module's ``predictive_temperature`` buffer
    (saved in checkpoints), so later ``test``/``predict`` use the tempered predictive. The
    fitted value and the validation NLL before and after are kept in :attr:`result`. Under
    DDP the validation predictions of all processes are gathered first, so every process fits
    the same :math:`T`.

    Works with :class:`~lightning_dvi.DVIClassifier` (any module with ``predictive`` and a
    ``predictive_temperature`` buffer).

    Attributes:
        result: ``{"temperature", "val_nll_before", "val_nll_after"}`` after fitting.

    Examples:
        >>> TemperatureScaling()
        TemperatureScaling()
    """

    def __init__(self) -> None:
        self.result: dict[str, float] = {}

    def __repr__(self) -> str:
        return "TemperatureScaling()"

    def _val_loader(self, trainer: Trainer) -> Any:
        loaders = trainer.val_dataloaders
        datamodule = getattr(trainer, "datamodule", None)  # set by Lightning, not declared
        if loaders is None and datamodule is not None:
            loaders = datamodule.val_dataloader()
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        return loaders

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Fit :math:`T` on the validation rows and store it in the module."""
        if not hasattr(pl_module, "predictive_temperature") or not hasattr(pl_module, "predictive"):
            raise ValueError(
                "TemperatureScaling needs a classifier with predictive() and a "
                f"predictive_temperature buffer, got {type(pl_module).__name__}"
            )
        classifier = cast(_Calibrated, pl_module)  # checked above
        loader = self._val_loader(trainer)
        if loader is None:
            raise ValueError("TemperatureScaling needs validation data (val_fraction > 0)")
        was_training = pl_module.training
        pl_module.eval()
        classifier.predictive_temperature.fill_(1.0)
        if isinstance(getattr(pl_module, "predictive_floor", None), Tensor):  # T alone
            cast(Tensor, pl_module.predictive_floor).fill_(0.0)
        probs, target = [], []
        with torch.no_grad():
            for batch in loader:
                x, y = batch[0], batch[1]
                probs.append(classifier.predictive(x.to(pl_module.device)).cpu())
                target.append(y.cpu())
        p, y = torch.cat(probs), torch.cat(target)
        if trainer.world_size > 1:
            # all_gather of a tensor is a tensor
            p = cast(Tensor, pl_module.all_gather(p.to(pl_module.device)))
            y = cast(Tensor, pl_module.all_gather(y.to(pl_module.device)))
            p, y = p.reshape(-1, p.shape[-1]).cpu(), y.reshape(-1).cpu()
        t = fit_temperature(p, y)
        nll = torch.nn.functional.nll_loss
        before = float(nll(p.double().clamp_min(_TINY).log(), y.long()))
        after = float(nll(temper_probs(p.double(), t).clamp_min(_TINY).log(), y.long()))
        classifier.predictive_temperature.fill_(t)
        self.result = {"temperature": t, "val_nll_before": before, "val_nll_after": after}
        pl_module.train(was_training)


def paired_choice(
    log_probs: Sequence[Tensor], z: float = 2.0
) -> tuple[int, list[tuple[float, float, float]]]:
    r"""Which of several predictives to keep, from their log-likelihoods on the same rows.

    With :math:`\ell_{v,n} = \log p_v(y_n \mid x_n)` for variant :math:`v` on :math:`N`
    validation rows and variant 0 the reference, a variant *beats* the reference when its
    mean paired gain clears ``z`` standard errors of the per-row differences,

    .. math::
        \bar d_v = \frac1N\sum_n (\ell_{v,n} - \ell_{0,n}) > z\,
        \frac{\operatorname{sd}_n(\ell_{v,n} - \ell_{0,n})}{\sqrt N},

    (:math:`\operatorname{sd}` with Bessel's correction; infinite for :math:`N = 1`), and the
    kept variant is the one with the lowest NLL :math:`-\frac1N\sum_n \ell_{v,n}` among those
    that beat the reference, else the reference: it leaves the reference only on evidence, not
    on a few confidently misclassified rows.

    Args:
        log_probs: per variant, the log-probability of each row's label ``[N]``; the first is
            the reference.
        z: the gate in standard errors (0: any mean gain will do).

    Returns:
        The kept variant's index and, per variant, ``(nll, gain, gain_se)``.

    Raises:
        ValueError: without variants, or on rows of different lengths.

    Examples:
        >>> ref = torch.log(torch.full((100,), 0.5))
        >>> better = torch.log(torch.full((100,), 0.6)) + 0.01 * torch.randn(100)
        >>> paired_choice([ref, better])[0], paired_choice([ref, better], z=1e9)[0]
        (1, 0)
    """
    if not log_probs or any(lp.shape != log_probs[0].shape for lp in log_probs):
        raise ValueError("paired_choice needs one or more log-probability vectors of one length")
    reference = log_probs[0].double()
    n = reference.numel()
    table = []
    for lp in log_probs:
        diff = lp.double() - reference
        se = float(diff.std() / math.sqrt(n)) if n > 1 else math.inf
        table.append((float(-lp.double().mean()), float(diff.mean()), se))
    winners = [v for v in range(1, len(table)) if table[v][1] > z * table[v][2]]
    return min([0, *winners], key=lambda v: table[v][0]), table


@dataclass(frozen=True)
class CalibrationVariant:
    r"""One predictive :func:`select_classifier` scored on the validation rows.

    Attributes:
        candidate: index of the trained model it comes from.
        kind: ``"trained"`` (as trained, temperature 1), ``"scale"`` (posterior standard
            deviations times :attr:`scale`), ``"temperature"`` (:func:`temper_probs` with
            :attr:`temperature`), ``"temperature+floor"`` (:func:`floor_probs` of that, with
            :attr:`floor`; the two fitted jointly, :func:`fit_temperature_floor`), or either
            after the scale (``"scale+temperature"``, ``"scale+temperature+floor"``).
        scale: the factor :math:`c` on the posterior standard deviations (1: untouched).
        temperature: the predictive temperature :math:`T` (1: untouched).
        floor: the uniform floor :math:`\varepsilon` (0: none).
        val_nll: validation NLL.
        gain: mean paired gain in validation log-likelihood over the reference.
        gain_se: that gain's standard error.
    """

    candidate: int
    kind: VariantKind
    scale: float
    temperature: float
    floor: float
    val_nll: float
    gain: float
    gain_se: float


@dataclass(frozen=True)
class CalibrationChoice:
    """What :func:`select_classifier` (or :func:`calibrate_classifier`) scored and kept.

    Attributes:
        variants: every variant scored; the first is the reference (candidate 0 as trained).
        chosen: the index of the kept variant in :attr:`variants`.
        z: the gate in standard errors.
    """

    variants: tuple[CalibrationVariant, ...]
    chosen: int
    z: float

    @property
    def kept(self) -> CalibrationVariant:
        """The kept variant."""
        return self.variants[self.chosen]

    def as_dict(self) -> dict[str, Any]:
        """Plain data: ``{"chosen", "z", "kept", "variants"}`` (JSON-serialisable)."""
        rows = [vars(v).copy() for v in self.variants]
        return {"chosen": self.chosen, "z": self.z, "kept": rows[self.chosen], "variants": rows}


def _label_log_probs(probs: Tensor, y: Tensor) -> Tensor:
    return probs.double().gather(-1, y.long().reshape(-1, 1)).squeeze(-1).clamp_min(_TINY).log()


_Row = tuple[int, VariantKind, float, float, float, Tensor]  # candidate, kind, c, T, eps, log p


def _post_hoc(
    candidate: int, scaled: bool, probs: Tensor, y: Tensor, c: float, kinds: Sequence[str]
) -> list[_Row]:
    """The temperature (and floor) variants of one predictive."""
    prefix = "scale+" if scaled else ""
    out: list[_Row] = []
    if scaled and "scale" in kinds:
        out.append((candidate, "scale", c, 1.0, 0.0, _label_log_probs(probs, y)))
    if f"{prefix}temperature" in kinds:
        t = fit_temperature(probs, y)
        lp = _label_log_probs(temper_probs(probs, t), y)
        out.append((candidate, cast(VariantKind, f"{prefix}temperature"), c, t, 0.0, lp))
    if f"{prefix}temperature+floor" in kinds:
        t, eps = fit_temperature_floor(probs, y)
        lp = _label_log_probs(floor_probs(temper_probs(probs, t), eps), y)
        out.append((candidate, cast(VariantKind, f"{prefix}temperature+floor"), c, t, eps, lp))
    return out


def _model_variants(
    model: DVIClassifier, candidate: int, x: Tensor, y: Tensor, kinds: Sequence[VariantKind]
) -> list[_Row]:
    """Every variant of one model on the validation rows; restores ``model`` as trained."""
    from ..nn.posthoc import calibrate_scales

    model.predictive_temperature.fill_(1.0)
    model.predictive_floor.fill_(0.0)
    probs = model.predictive(x).double()
    out: list[_Row] = [(candidate, "trained", 1.0, 1.0, 0.0, _label_log_probs(probs, y))]
    out += _post_hoc(candidate, False, probs, y, 1.0, kinds)
    # sample/local models predict by Monte Carlo over weights: no closed form to scale
    if not any(k.startswith("scale") for k in kinds) or model.mode not in ("diag", "full"):
        return out
    state = copy.deepcopy(model.net.state_dict())
    try:
        found = calibrate_scales(model.net, model.likelihood, x, y, mode=model.mode)
        scaled = model.predictive(x).double()
    except NotImplementedError:  # a posterior layer whose scales calibrate_scales cannot set
        return out
    finally:
        model.net.load_state_dict(state)
    return out + _post_hoc(candidate, True, scaled, y, next(iter(found.factors.values())), kinds)


@torch.no_grad()
def select_classifier(
    models: Sequence[DVIClassifier],
    x: Tensor,
    y: Tensor,
    *,
    z: float = 2.0,
    kinds: Sequence[VariantKind] = DEFAULT_KINDS,
) -> CalibrationChoice:
    r"""Choose among trained classifiers and their post-hoc variants on validation rows; apply it.

    Every model :math:`m` is scored as trained (temperature 1) and, per ``kinds``, with a
    factor :math:`c_m` on its posterior standard deviations
    (:func:`~lightning_dvi.nn.calibrate_scales`: the closed-form predictive's validation NLL;
    only for ``diag``/``full`` models), with a predictive temperature :math:`T_m`
    (:func:`fit_temperature`), with a temperature and a uniform floor :math:`(T_m,
    \varepsilon_m)` (:func:`fit_temperature_floor`), and with either after the factor (fitted
    after :math:`c`). The reference is ``models[0]`` as trained; :func:`paired_choice` keeps
    another variant only when it beats the reference's validation log-likelihood by ``z``
    paired standard errors. The kept variant is written into its model (the factor into the
    posterior scales, :math:`T` into ``predictive_temperature``, :math:`\varepsilon` into
    ``predictive_floor``: all in the ``state_dict``, so checkpoints keep them); every other
    model is left as trained with temperature 1 and no floor. Pass only rows the models were
    not trained on (the validation rows): the choice is fitted on them.

    Args:
        models: trained :class:`~lightning_dvi.DVIClassifier` candidates, the reference first.
        x: validation inputs (on any device; moved to each model's).
        y: validation labels ``[N]``.
        z: the gate in standard errors.
        kinds: the post-hoc variants to fit, any of :data:`DEFAULT_KINDS` (all of them).

    Returns:
        The :class:`CalibrationChoice`; the kept model is ``models[choice.kept.candidate]``.

    Raises:
        ValueError: without models, or with an unknown kind.
    """
    from ..nn.posthoc import scale_posterior

    unknown = sorted(set(kinds) - set(DEFAULT_KINDS))
    if not models or unknown:
        raise ValueError(
            f"select_classifier needs one or more models and kinds among {DEFAULT_KINDS}, "
            f"got {len(models)} models and {unknown}"
        )
    rows: list[_Row] = []
    for m, model in enumerate(models):
        was_training = model.training
        model.eval()
        try:
            rows += _model_variants(model, m, x.to(model.device), y.to(model.device), kinds)
        finally:
            model.train(was_training)
    chosen, table = paired_choice([r[5].cpu() for r in rows], z)
    variants = tuple(
        CalibrationVariant(m, kind, c, t, eps, nll, gain, se)
        for (m, kind, c, t, eps, _), (nll, gain, se) in zip(rows, table, strict=True)
    )
    kept = variants[chosen]
    model = models[kept.candidate]
    if kept.scale != 1.0:
        scale_posterior(model.net, kept.scale)
    model.predictive_temperature.fill_(kept.temperature)
    model.predictive_floor.fill_(kept.floor)
    return CalibrationChoice(variants, chosen, float(z))


def calibrate_classifier(
    model: DVIClassifier,
    x: Tensor,
    y: Tensor,
    *,
    z: float = 2.0,
    kinds: Sequence[VariantKind] = DEFAULT_KINDS,
) -> CalibrationChoice:
    r"""Keep a posterior-scale factor and/or a predictive temperature only if it helps; apply it.

    :func:`select_classifier` with one model: the reference is ``model`` as trained
    (temperature 1), and a fitted factor :math:`c` on its posterior standard deviations, a
    temperature :math:`T`, or both, replace it only when they beat its validation
    log-likelihood by ``z`` paired standard errors (:func:`paired_choice`). When none does,
    the model is left exactly as trained. ``DVIClassifier(calibrate=True)`` (the default) runs
    this on the validation rows at the end of ``fit``.

    Args:
        model: a trained :class:`~lightning_dvi.DVIClassifier`.
        x: validation inputs.
        y: validation labels ``[N]``.
        z: the gate in standard errors.
        kinds: the post-hoc variants to fit.

    Returns:
        The :class:`CalibrationChoice`.
    """
    return select_classifier([model], x, y, z=z, kinds=kinds)


def _validation_rows(trainer: Trainer) -> tuple[Tensor, Tensor] | None:
    """All validation inputs and labels, or ``None`` without them.

    The loaders the fit validated on (``None`` if it validated on none), read through
    :class:`~lightning_dvi.lightning._data.DataView`, the one reader of the trainer's data:
    under DDP every process reads the whole split, so every process makes the same choice.
    """
    from ._data import DataView

    if trainer.val_dataloaders is None:  # the fit ran no validation: no rows to read
        return None
    rows = DataView(trainer, "validate").examples()  # the fit's validation loaders
    if rows is None or rows[1] is None or len(rows[0]) == 0:
        return None
    return rows[0].cpu(), rows[1].cpu()


def calibrate_on_validation(
    trainer: Trainer,
    module: LightningModule,
    z: float = 2.0,
    kinds: Sequence[VariantKind] = DEFAULT_KINDS,
    strict: bool = True,
) -> CalibrationChoice | None:
    """:func:`calibrate_classifier` on the trainer's validation rows (``None`` without, unless ``strict``)."""
    # a DVIClassifier (its predictive buffers): checked by duck type, as the classifier module
    # imports this one
    if not all(hasattr(module, n) for n in ("predictive_temperature", "predictive_floor")):
        raise ValueError(
            f"PredictiveCalibration needs a DVIClassifier, got {type(module).__name__}"
        )
    rows = _validation_rows(trainer)
    if rows is None:
        if strict:
            raise ValueError("PredictiveCalibration needs validation data (val_fraction > 0)")
        return None
    return calibrate_classifier(cast("DVIClassifier", module), *rows, z=z, kinds=kinds)


def rewrite_last_checkpoints(trainer: Trainer, choice: CalibrationChoice | None) -> list[str]:
    """Rewrite the ``last`` checkpoints written during ``fit`` when a calibration changed the model.

    ``last.ckpt`` (:class:`~lightning_dvi.callbacks.RunCheckpoint`, or any ``ModelCheckpoint``
    with ``save_last``) is written during training, before the calibration at the end of
    ``fit``; without a rewrite, ``predict --ckpt_path last`` would give other probabilities than
    the fitted model and its test metrics. The run is finished, so the rewritten file still
    resumes as a spent run. Top-k checkpoints of earlier epochs keep the posterior as trained.
    Collective under DDP: every process calls it.

    Args:
        trainer: the trainer at the end of ``fit``.
        choice: what the calibration kept (``None`` or index 0: nothing changed, nothing
            written).

    Returns:
        The paths rewritten.
    """
    if choice is None or choice.chosen == 0:
        return []
    written = []
    for callback in trainer.checkpoint_callbacks:
        path = str(getattr(callback, "last_model_path", "") or "")
        if path and trainer.strategy.broadcast(os.path.isfile(path)):
            trainer.save_checkpoint(path, weights_only=False)
            written.append(path)
    return written


class PredictiveCalibration(Callback):
    """Run :func:`calibrate_classifier` on the validation rows at the end of ``fit``.

    What ``DVIClassifier(calibrate=True)`` (the default) does by itself; as a callback it takes
    a different gate ``z`` or set of ``kinds``, and raises without validation data. The choice
    is kept in :attr:`choice`. Under DDP every process reads the whole validation split, so
    every process makes the same choice. When the calibration changes the model, the
    ``last`` checkpoint written during training is rewritten (:func:`rewrite_last_checkpoints`);
    top-k checkpoints of earlier epochs hold the posterior as trained.

    Args:
        z: the gate in paired standard errors.
        kinds: the post-hoc variants to fit.

    Attributes:
        choice: the :class:`CalibrationChoice` after fitting.

    Examples:
        >>> PredictiveCalibration()
        PredictiveCalibration(z=2.0)
    """

    def __init__(self, z: float = 2.0, kinds: Sequence[VariantKind] = DEFAULT_KINDS) -> None:
        self.z, self.kinds = float(z), tuple(kinds)
        self.choice: CalibrationChoice | None = None

    def __repr__(self) -> str:
        return f"PredictiveCalibration(z={self.z})"

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Fit and keep (or not) the factor and temperature on the validation rows."""
        self.choice = calibrate_on_validation(trainer, pl_module, self.z, self.kinds)
        rewrite_last_checkpoints(trainer, self.choice)

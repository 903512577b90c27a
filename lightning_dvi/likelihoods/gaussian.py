"""Gaussian regression likelihoods: heteroscedastic (m, ℓ) outputs and a learned global noise."""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor, nn
from torch.distributions import constraints

from ..gaussian import Gaussian
from ..moments import policy
from ..moments._quadrature import constant, gauss_hermite
from . import functional as F
from .base import ExportOptions, Likelihood, PredictiveHead, RegressionHead

__all__ = [
    "HeteroscedasticGaussian",
    "HeteroscedasticPredictive",
    "HomoscedasticGaussian",
    "NoiseBound",
    "NoiseBoundWarning",
    "dequantisation_variance",
]

#: How :class:`HeteroscedasticGaussian`'s predictive bounds the noise variance's growth.
NoiseBound = Literal["training_range", "none"]
#: How far past the recorded range :meth:`HeteroscedasticGaussian.bounded_log_noise` lets the
#: log-variance's mean and variance go (each by :math:`\log 2`): a smooth network's extremes
#: fall between training inputs too, and those inputs should keep their exact predictive.
NOISE_BOUND_MARGIN = math.log(2)


class NoiseBoundWarning(UserWarning):
    r"""A heteroscedastic predictive's noise variance :math:`\mathbb E[e^\ell]` was bounded.

    Either to the range recorded on the training inputs (``noise_bound="training_range"``), or,
    for any setting, because :math:`e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}` would overflow
    the dtype. The message names the rows.
    """


#: True inside :func:`noise_bound_warned`.
_BOUND_WARNED: ContextVar[bool] = ContextVar("noise_bound_warned", default=False)


@contextlib.contextmanager
def noise_bound_warned() -> Iterator[None]:
    """Inside, :meth:`HeteroscedasticGaussian.predictive` does not warn about bounded rows again.

    For a caller that builds the predictive of the same rows a second time (``DVIRegressor``'s
    metrics: the moments in the network's dtype, then the density in float64) and has warned
    with the first. ``warnings.catch_warnings`` would silence it too, but leaving that context
    resets the registry that shows a repeated warning only once.
    """
    token = _BOUND_WARNED.set(True)
    try:
        yield
    finally:
        _BOUND_WARNED.reset(token)


def _overflow_exponent(dtype: torch.dtype) -> float:
    r"""The largest exponent whose ``exp`` leaves room below the dtype's largest number (88.7 - 1 in float32)."""
    return math.log(torch.finfo(dtype).max) - 1.0


def _row_list(mask: Tensor) -> str:
    """``"3 rows (0, 5, 7)"`` for the true entries of ``mask`` (flattened), at most ten named."""
    rows = mask.reshape(-1).nonzero().reshape(-1).tolist()
    shown = ", ".join(str(i) for i in rows[:10]) + (", ..." if len(rows) > 10 else "")
    return f"{len(rows)} row{'s' if len(rows) != 1 else ''} ({shown})"


def dequantisation_variance(resolution: float) -> float:
    r"""The variance :math:`\Delta^2/12` that dequantised targets add to :math:`\Sigma_{mm}`.

    Targets recorded on a grid of step :math:`\Delta` (integer scores, values rounded to a few
    decimals) are read as :math:`y + u`, :math:`u\sim\mathcal U(-\Delta/2, \Delta/2)`
    independent of the network. A Gaussian likelihood's expected log-density then averages over
    :math:`u` too, and since :math:`\mathbb E_u[(y + u - m)^2] = (y - m)^2 + \Delta^2/12`, the
    closed forms stay the same with :math:`\Sigma_{mm} + \Delta^2/12` in place of
    :math:`\Sigma_{mm}`. Without it, many equal targets let the fitted noise variance shrink
    towards zero wherever they cluster (the likelihood is unbounded there), and one test target
    one grid step away scores thousands of nats below the rest (UCI wine, docs/benchmarks.md).

    Args:
        resolution: :math:`\Delta\ge 0` in the units the likelihood sees ``y``; 0 is none.

    Raises:
        ValueError: for a negative or non-finite resolution.
    """
    if not (math.isfinite(resolution) and resolution >= 0):
        raise ValueError(f"resolution must be finite and >= 0, got {resolution}")
    return resolution * resolution / 12.0


class HeteroscedasticPredictive(torch.distributions.Distribution):
    r"""The predictive of :class:`HeteroscedasticGaussian`: :math:`\int\mathcal N(y; m, e^\ell)\,q(m, \ell)\,dm\,d\ell`.

    :math:`(m, \ell)` is the network's bivariate Gaussian output (moments
    :math:`\langle m\rangle, \langle\ell\rangle, \Sigma_{mm}, \Sigma_{\ell\ell}, \Sigma_{m\ell}`).
    ``mean`` and ``variance`` are exact, :math:`\langle m\rangle` and
    :math:`\Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}` (appendix B.3, the
    exponent capped one below the dtype's overflow); ``log_prob`` is the exact density of the
    scale mixture, not that of the Gaussian with those moments
    (:func:`~lightning_dvi.likelihoods.functional.heteroscedastic_predictive_log_prob`, adaptive
    Gauss–Hermite quadrature over :math:`\ell`): its tails are heavier, so a target many
    predicted noise deviations away costs fewer nats. ``cdf`` integrates the conditional
    Gaussian CDFs over :math:`\ell` by Gauss–Hermite quadrature; ``sample`` draws
    :math:`\ell`, then :math:`m\mid\ell`, then :math:`y`.

    Args:
        mean_m: :math:`\langle m\rangle`. All tensors broadcast.
        var_m: :math:`\Sigma_{mm} \ge 0`.
        mean_l: :math:`\langle\ell\rangle`.
        var_l: :math:`\Sigma_{\ell\ell} \ge 0`.
        cov_ml: :math:`\Sigma_{m\ell}`, or ``None`` (a diag output: zero).

    Examples:
        >>> z = torch.zeros(2)
        >>> p = HeteroscedasticPredictive(z, z, z, torch.ones(2))
        >>> p.variance  # e^{0 + 1/2}
        tensor([1.6487, 1.6487])
        >>> p.log_prob(torch.full((2,), 8.0))  # the Gaussian with these moments: -20.58
        tensor([-8.5772, -8.5772])
    """

    arg_constraints = {  # noqa: RUF012
        "mean_m": constraints.real,
        "var_m": constraints.nonnegative,
        "mean_l": constraints.real,
        "var_l": constraints.nonnegative,
    }
    support = constraints.real
    has_rsample = False
    mean_m: Tensor
    var_m: Tensor
    mean_l: Tensor
    var_l: Tensor
    cov_ml: Tensor

    def __init__(
        self,
        mean_m: Tensor,
        var_m: Tensor,
        mean_l: Tensor,
        var_l: Tensor,
        cov_ml: Tensor | None = None,
        validate_args: bool | None = None,
    ) -> None:
        zero = torch.zeros_like(mean_m) if cov_ml is None else cov_ml
        self.mean_m, self.var_m, self.mean_l, self.var_l, self.cov_ml = torch.broadcast_tensors(
            mean_m, var_m, mean_l, var_l, zero
        )
        super().__init__(self.mean_m.shape, validate_args=validate_args)

    @property
    def mean(self) -> Tensor:
        r""":math:`\langle m\rangle`."""
        return self.mean_m

    @property
    def variance(self) -> Tensor:
        r""":math:`\Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}`, finite."""
        exponent = self.mean_l + 0.5 * self.var_l
        return self.var_m + exponent.clamp(max=_overflow_exponent(exponent.dtype)).exp()

    def log_prob(self, value: Tensor) -> Tensor:
        r"""The exact log density (quadrature over :math:`\ell`)."""
        if self._validate_args:
            self._validate_sample(value)
        return F.heteroscedastic_predictive_log_prob(
            self.mean_m, self.var_m, self.mean_l, self.var_l, self.cov_ml, value
        )

    def _conditional(self, ell: Tensor, last: bool = False) -> tuple[Tensor, Tensor]:
        r"""Mean and variance of :math:`y\mid\ell`; ``last``: ``ell`` has one more (last) dimension."""
        beta, rest = F.heteroscedastic_conditional(self.var_m, self.var_l, self.cov_ml)
        mean_m, mean_l = self.mean_m, self.mean_l
        if last:
            mean_m, mean_l, beta, rest = (p.unsqueeze(-1) for p in (mean_m, mean_l, beta, rest))
        limit = _overflow_exponent(ell.dtype)
        return mean_m + beta * (ell - mean_l), rest + ell.clamp(max=limit).exp()

    def cdf(self, value: Tensor) -> Tensor:
        r""":math:`P(y \le \text{value}) = \mathbb E_\ell\,\Phi\big((\text{value} - \mu_{y\mid\ell}) / \sigma_{y\mid\ell}\big)`, 32 Gauss–Hermite nodes."""
        if self._validate_args:
            self._validate_sample(value)
        nodes, weights = gauss_hermite(F.PREDICTIVE_NODES)
        dtype, device = self.mean_m.dtype, self.mean_m.device
        t, w = constant(nodes, dtype, device), constant(weights, dtype, device)
        ell = self.mean_l.unsqueeze(-1) + self.var_l.sqrt().unsqueeze(-1) * t  # [..., n]
        loc, var = self._conditional(ell, last=True)
        z = (value.to(dtype).unsqueeze(-1) - loc) * var.rsqrt()
        probability: Tensor = (w * torch.special.ndtr(z)).sum(-1)
        return probability

    def sample(
        self,
        sample_shape: torch.Size | list[int] | tuple[int, ...] = torch.Size(),  # noqa: B008
    ) -> Tensor:
        r"""Draw :math:`\ell`, then :math:`y` from the Gaussian of :math:`y\mid\ell` (``m`` integrated)."""
        shape = self._extended_shape(torch.Size(sample_shape))
        with torch.no_grad():
            eps = torch.randn(shape, dtype=self.mean_m.dtype, device=self.mean_m.device)
            ell = self.mean_l + self.var_l.sqrt() * eps
            loc, var = self._conditional(ell)
            return loc + var.sqrt() * torch.randn_like(loc)


class _DequantisedTargets(nn.Module):
    r"""The ``resolution`` of a Gaussian likelihood's targets (see :func:`dequantisation_variance`).

    :math:`\Delta^2/12` is held twice: as a Python float, which the eager code adds (and skips
    for :math:`\Delta = 0`), and as the non-persistent buffer ``extra_variance``, which a traced
    step reads instead. A buffer is an input of a recorded graph (:class:`~lightning_dvi.
    compile.CompiledStep`), so one graph serves every resolution: the fits of other splits or
    data sets of one network shape find it in inductor's cache, and a resolution set after the
    recording (a second ``fit``) is seen, where a float would be a constant of the graph. The
    buffer follows the module's device but stays float64 (float32 on MPS, which has no
    float64): it is made again after every cast (``to``, ``float``, ...), and the traced step
    rounds it once to the dtype of :math:`\Sigma_{mm}`, as the eager float is rounded.
    """

    _resolution: float = 0.0
    _extra_variance: float = 0.0
    accepts_resolution: ClassVar[bool] = True

    def set_target_resolution(self, step: float) -> None:
        r"""Set :attr:`resolution`, the grid step :math:`\Delta` in the units the likelihood sees."""
        self.resolution = step

    @property
    def resolution(self) -> float:
        r"""The targets' grid step :math:`\Delta` (0: continuous); see :func:`dequantisation_variance`."""
        return self._resolution

    @resolution.setter
    def resolution(self, value: float) -> None:
        self._extra_variance = dequantisation_variance(float(value))
        self._resolution = float(value)
        self._fill_extra_variance()

    def _fill_extra_variance(self, device: torch.device | None = None) -> None:
        r"""Make the ``extra_variance`` buffer :math:`\Delta^2/12` (on ``device``, or where it is)."""
        buffer = self._buffers.get("extra_variance")
        if buffer is not None and device is None:
            with torch.no_grad():  # in place: a recorded step holds the tensor it reads
                buffer.fill_(self._extra_variance)
            return
        device = device or torch.device("cpu")
        dtype = torch.float32 if device.type == "mps" else torch.float64
        value = torch.tensor(self._extra_variance, dtype=dtype, device=device)
        self.register_buffer("extra_variance", value, persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``nn.Module._apply`` (``to``, ``double``, ...), then the buffer made again in float64."""
        out = super()._apply(fn, recurse)
        buffer = self._buffers.get("extra_variance")
        if buffer is not None:
            self._fill_extra_variance(buffer.device)
        return out

    def _dequantised(self, var_m: Tensor) -> Tensor:
        r""":math:`\Sigma_{mm} + \Delta^2/12` (``var_m`` itself, no op, when :math:`\Delta = 0`).

        While a graph is traced the term is the buffer, added whatever its value, so that the
        graph holds no resolution of its own (adding an exact 0 leaves ``var_m`` unchanged).
        """
        buffer = self._buffers.get("extra_variance")
        if buffer is not None and policy.tracing():
            return var_m + buffer.to(var_m.dtype)
        return var_m + self._extra_variance if self._extra_variance else var_m


class _GaussianRegression(Likelihood):
    """What the two Gaussian likelihoods share beyond dequantisation: the mean is output 0."""

    def point_fit_loss(self, f: Tensor, y: Tensor) -> Tensor:
        r"""Squared error of the mean output, :math:`(y - m)^2` with :math:`m = f_0`, ``[B]``.

        The warm start fits the mean function only, as least squares would: with the noise
        level free (:math:`-\log\mathcal N(y; m, e^\ell)`) a point-estimate fit raises
        :math:`e^\ell` to explain its residuals, which scales the mean's gradient by
        :math:`e^{-\ell}` and stalls on almost noiseless targets (UCI energy: test RMSE 0.83
        against 0.50 from least squares, docs/benchmarks.md). The noise is left to the
        variational fit that follows.
        """
        y = self.validate_target(y, f)
        return (y - f[..., 0]).square()


class HeteroscedasticGaussian(_DequantisedTargets, _GaussianRegression):
    r"""Regression with a predicted noise level: outputs :math:`(m, \ell)`, :math:`y\sim\mathcal N(m, e^\ell)`.

    The closed-form expected log-likelihood uses the full 2x2 output covariance, including
    :math:`\Sigma_{m\ell}`; a diag output (dDVI) has :math:`\Sigma_{m\ell} = 0`. See
    :func:`~lightning_dvi.likelihoods.functional.heteroscedastic_expected_log_prob`.

    Args:
        require_full: reject diag outputs, for when dropping :math:`\Sigma_{m\ell}` would be a
            mistake (e.g. a DVI run that must not silently fall back to dDVI).
        mc_samples: draws for the Monte Carlo fallback :meth:`Likelihood.expected_log_prob`.
        resolution: the grid step :math:`\Delta` of the targets in the units this likelihood
            sees them (0: continuous); the expected log-likelihood is that of dequantised targets
            (:func:`dequantisation_variance`). The predictive is unchanged.
        noise_bound: ``"none"`` (default): the predictive's noise variance is the exact
            :math:`\mathbb E[e^\ell] = e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}`, capped
            only below the dtype's overflow; ``"training_range"``: the log-variance's moments
            are clamped to the range recorded on the training inputs
            (:meth:`bounded_log_noise`, :meth:`record_noise_range`).

    Examples:
        >>> lik = HeteroscedasticGaussian()
        >>> out = Gaussian(torch.zeros(3, 2), var=torch.full((3, 2), 0.1))
        >>> tuple(lik.expected_log_prob(out, torch.zeros(3)).shape)
        (3,)
        >>> type(lik.predictive(out)).__name__
        'HeteroscedasticPredictive'
    """

    num_outputs = 2
    noise_range: Tensor  # buffer: [lowest <l>, highest <l>, highest S_ll] on the training inputs

    def __init__(
        self,
        require_full: bool = False,
        mc_samples: int = 256,
        resolution: float = 0.0,
        noise_bound: NoiseBound = "none",
    ) -> None:
        super().__init__(mc_samples)
        if noise_bound not in get_args(NoiseBound):
            raise ValueError(
                f"noise_bound must be one of {get_args(NoiseBound)}, got {noise_bound!r}"
            )
        self.require_full = bool(require_full)
        self.resolution = resolution
        self.noise_bound: NoiseBound = noise_bound
        self.register_buffer("noise_range", _unrecorded_range())

    # ------------------------------------------------------------------ the noise bound
    @property
    def bounds_noise(self) -> bool:
        """Whether the predictive bounds the noise (``noise_bound`` is not ``"none"``)."""
        return self.noise_bound != "none"

    def set_noise_range(self, found: Tensor) -> None:
        """Store a range from :meth:`noise_range_of` in the :attr:`noise_range` buffer."""
        self.noise_range.copy_(found.to(self.noise_range))

    def initial_output_bias(self, init_log_noise: float) -> dict[int, float]:
        r"""The log-variance output :math:`\ell` (index 1) starts at ``init_log_noise``."""
        return {1: float(init_log_noise)}

    def sampled_variance(self, f: Tensor, conditional: torch.distributions.Distribution) -> Tensor:
        """:meth:`sampled_noise_variance` of the draws, float64: finite far from the data."""
        # float64: the mean of S capped draws would overflow float32 again
        return self.sampled_noise_variance(f[..., 1]).double()

    @property
    def noise_range_recorded(self) -> bool:
        """Whether :attr:`noise_range` holds a recorded range (until then nothing is bounded)."""
        return bool(torch.isfinite(self.noise_range).all())

    @staticmethod
    def noise_range_of(outs: Gaussian | Iterable[Gaussian]) -> Tensor:
        r"""The range of the log-variance output's moments over the outputs ``outs``.

        Args:
            outs: the network's output Gaussians (mean ``[..., 2]``) on the training inputs,
                one or an iterable of batches.

        Returns:
            ``[min⟨ℓ⟩, max⟨ℓ⟩, max Σ_ℓℓ]``, float64, shape ``[3]``.

        Raises:
            ValueError: for no rows, or non-finite moments.
        """
        batches = [outs] if isinstance(outs, Gaussian) else list(outs)
        lows, highs, variances = [], [], []
        for out in batches:
            mean_l, var_l = out.mean[..., 1].detach(), out.var[..., 1].detach()
            if mean_l.numel():
                lows.append(mean_l.min().double())
                highs.append(mean_l.max().double())
                variances.append(var_l.max().double())
        if not lows:
            raise ValueError("HeteroscedasticGaussian.noise_range_of: no rows to record a range on")
        found = torch.stack(
            [torch.stack(lows).min(), torch.stack(highs).max(), torch.stack(variances).max()]
        ).cpu()
        if not bool(torch.isfinite(found).all()):
            raise ValueError(
                "HeteroscedasticGaussian: the log-variance output is not finite on the training "
                f"inputs (range {found.tolist()}); no noise bound can be recorded"
            )
        return found

    def record_noise_range(self, outs: Gaussian | Iterable[Gaussian]) -> None:
        r"""Record the range of :math:`\langle\ell\rangle` and :math:`\Sigma_{\ell\ell}` on the training inputs.

        :class:`~lightning_dvi.DVIRegressor` calls it at the end of ``fit`` (and each checkpoint
        it writes during ``fit`` holds the range of the weights it holds); with a network
        trained in code, pass the outputs on the training inputs, e.g.
        ``lik.record_noise_range(net(x_train, mode="full"))``. See :meth:`bounded_log_noise`.
        """
        found = self.noise_range_of(outs)
        self.noise_range.copy_(found.to(self.noise_range))

    def forget_noise_range(self) -> None:
        """Drop the recorded range: the predictive is unbounded until the next record."""
        self.noise_range.copy_(_unrecorded_range().to(self.noise_range))

    def bounded_log_noise(self, mean_l: Tensor, var_l: Tensor) -> tuple[Tensor, Tensor]:
        r"""The log-variance moments the predictive uses: clamped to the training range, if asked.

        With ``noise_bound="training_range"`` and a recorded range,

        .. math::
            \langle\ell\rangle \mapsto \operatorname{clamp}(\langle\ell\rangle,
                \ell_{\min}, \ell_{\max}),\qquad
            \Sigma_{\ell\ell} \mapsto \min(\Sigma_{\ell\ell}, v_{\max}),

        with :math:`\ell_{\min}, \ell_{\max}` the extremes of :math:`\langle\ell\rangle` and
        :math:`v_{\max}` the largest :math:`\Sigma_{\ell\ell}` on the training inputs
        (:attr:`noise_range`), each widened by :data:`NOISE_BOUND_MARGIN` (:math:`\log 2`), so the noise variance :math:`e^{\langle\ell\rangle +
        \Sigma_{\ell\ell}/2}` stays within what the data showed: a ReLU network's
        :math:`\langle\ell\rangle` grows linearly and :math:`\Sigma_{\ell\ell}` quadratically
        away from the data, which made a model trained on :math:`x\in[-1, 1]` claim a noise
        standard deviation of 1e14 at :math:`x = 10`. On the training inputs nothing changes.
        The epistemic part :math:`\Sigma_{mm}` is never bounded: far from the data the
        predictive still widens through it. ``noise_bound="none"`` or no recorded range: the
        moments as given.
        """
        if self.noise_bound == "none" or not self.noise_range_recorded:
            return mean_l, var_l
        bound = _with_margin(self.noise_range).to(dtype=mean_l.dtype, device=mean_l.device)
        return mean_l.clamp(bound[0], bound[1]), var_l.clamp(max=bound[2])

    def predictive_moments(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        r"""``(mean, var)`` of :meth:`predictive`, finite, with a :class:`NoiseBoundWarning` naming bounded rows.

        :math:`\operatorname{Var}[y] = \Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2}`
        after :meth:`bounded_log_noise`; an exponent past the dtype's range (88.7 in float32,
        709.8 in float64) is capped one below it (a warning names those rows too), never
        ``inf``.
        """
        mean_m, var_m, mean_l, var_l, _ = self._predictive_parts(out)
        exponent = mean_l + 0.5 * var_l
        limit = _overflow_exponent(exponent.dtype)
        mean, var = F.heteroscedastic_predictive_moments(
            mean_m, var_m, exponent.clamp(max=limit), torch.zeros_like(exponent)
        )
        return mean, var

    def _predictive_parts(
        self, out: Gaussian
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """``(m, Σ_mm, ℓ, Σ_ℓℓ, Σ_mℓ)`` with the log-noise bounded (:meth:`bounded_log_noise`), warning on bounded rows."""
        self.validate_output(out)
        mean_m, var_m, mean_l, var_l, cov_ml = self._parts(out)
        bounded_mean, bounded_var = self.bounded_log_noise(mean_l, var_l)
        if not policy.tracing() and not _BOUND_WARNED.get():
            exponent = bounded_mean + 0.5 * bounded_var
            self._warn_bounded(mean_l + 0.5 * var_l, exponent, _overflow_exponent(exponent.dtype))
        return mean_m, var_m, bounded_mean, bounded_var, cov_ml

    def sampled_noise_variance(self, log_noise: Tensor) -> Tensor:
        r""":math:`e^{\ell_s}` of sampled log-variances ``[S, B]``, capped below the dtype's overflow.

        For the Monte Carlo predictive (not bounded to the training range); a
        :class:`NoiseBoundWarning` names the rows ``B`` with a capped draw.
        """
        limit = _overflow_exponent(log_noise.dtype)
        if not policy.tracing():
            capped = (log_noise > limit).reshape(-1, log_noise.shape[-1]).any(0)
            if bool(capped.any()):
                warnings.warn(
                    f"HeteroscedasticGaussian: sampled noise variances e^l of "
                    f"{_row_list(capped)} overflow {log_noise.dtype} and were capped at "
                    f"exp({limit:.4g}); these rows are far outside the training data",
                    NoiseBoundWarning,
                    stacklevel=3,
                )
        return log_noise.clamp(max=limit).exp()

    def _warn_bounded(self, exponent: Tensor, bounded: Tensor, limit: float) -> None:
        """Warn naming the rows whose noise exponent was bounded or capped at the dtype's range."""
        with torch.no_grad():
            capped = bounded > limit
            changed = (bounded != exponent) & ~capped  # NaN compares unequal: excluded below
            changed &= ~exponent.isnan()
            if bool(changed.any()):
                widest = _with_margin(self.noise_range)
                hi = float(widest[1] + 0.5 * widest[2])
                warnings.warn(
                    f"HeteroscedasticGaussian: the noise variance E[exp(l)] of "
                    f"{_row_list(changed)} is outside the training range and was bounded to it "
                    f"(noise_bound='training_range': noise std at most {math.exp(0.5 * hi):.4g} "
                    "in the likelihood's units); the epistemic variance is not bounded. "
                    "noise_bound='none' gives the unbounded model",
                    NoiseBoundWarning,
                    stacklevel=5,
                )
            if bool(capped.any()):
                warnings.warn(
                    f"HeteroscedasticGaussian: the noise variance E[exp(l)] = exp(<l> + S_ll/2) "
                    f"of {_row_list(capped)} overflows {bounded.dtype} (exponent up to "
                    f"{float(bounded.max()):.4g}) and was capped at exp({limit:.4g}); these rows "
                    "are far outside the training data. noise_bound='training_range' bounds the "
                    "noise to what the training data showed",
                    NoiseBoundWarning,
                    stacklevel=5,
                )

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # checkpoints from before the bound have no range: load them as "not recorded"
        state_dict.setdefault(prefix + "noise_range", _unrecorded_range().to(self.noise_range))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def validate_output(self, out: Gaussian) -> Gaussian:
        """As :meth:`Likelihood.validate_output`; also rejects diag outputs if ``require_full``."""
        super().validate_output(out)
        if self.require_full and not out.is_full:
            raise ValueError(
                "HeteroscedasticGaussian(require_full=True) got a diag output; run the network "
                "with mode='full' so the covariance of (m, l) is kept"
            )
        return out

    @staticmethod
    def _parts(out: Gaussian) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
        """``(m, Σ_mm, ℓ, Σ_ℓℓ, Σ_mℓ)``; ``Σ_mℓ`` is ``None`` (zero) for a diag output.

        ``unbind`` instead of four ``[..., k]`` selects: one op forward and one backward
        (a ``stack``) per tensor instead of two selects and two zero-filled scatters plus an add.
        """
        mean_m, mean_l = out.mean.unbind(-1)
        if out.cov is not None:  # one unbind of the flattened 2x2 covariance
            var_m, cov_ml, _, var_l = out.cov.flatten(-2).unbind(-1)
            return mean_m, var_m, mean_l, var_l, cov_ml
        var_m, var_l = out.var.unbind(-1)
        return mean_m, var_m, mean_l, var_l, None

    def conditional(self, f: Tensor) -> torch.distributions.Normal:
        r""":math:`\mathcal N(m, e^\ell)` with ``m = f[..., 0]``, ``ℓ = f[..., 1]``."""
        return torch.distributions.Normal(f[..., 0], (0.5 * f[..., 1]).exp(), validate_args=False)

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r"""Closed form :math:`\mathbb E\log\mathcal N(y; m, e^\ell)` per datum, ``[B]``.

        ``mc_samples`` is ignored (kept for the base-class signature).
        """
        y = self.validate_target(y, self.validate_output(out))
        packed = out.cov if out.cov is not None else out.var
        if (
            not y.requires_grad
            and y.shape == out.mean.shape[:-1] == packed.shape[: out.mean.dim() - 1]
            and policy.use_fused(out.mean, packed, y)
        ):
            # one autograd node with its closed-form backward (the eager training step)
            return F.heteroscedastic_expected_log_prob_packed(
                out.mean, packed, y, self._extra_variance
            )
        mean_m, var_m, mean_l, var_l, cov_ml = self._parts(out)
        var_m = self._dequantised(var_m)
        return F.heteroscedastic_expected_log_prob(mean_m, var_m, mean_l, var_l, cov_ml, y)

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        r""":math:`\Sigma_{mm}`: the part of the predictive variance due to the weights, ``[B]``."""
        return self.validate_output(out).var[..., 0]

    def predictive(self, out: Gaussian) -> HeteroscedasticPredictive:
        r"""The exact predictive :class:`HeteroscedasticPredictive`, its log-noise bounded as :meth:`predictive_moments` says.

        Mean :math:`\langle m\rangle` and variance :math:`\Sigma_{mm} + e^{\langle\ell\rangle +
        \Sigma_{\ell\ell}/2}` (:meth:`predictive_moments`); ``log_prob`` integrates over
        :math:`(m, \ell)` instead of scoring the Gaussian with those moments (its tails are
        heavier).
        """
        return HeteroscedasticPredictive(*self._predictive_parts(out))

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""``mean = ⟨m⟩``, ``var = Σ_mm + exp(⟨ℓ⟩ + Σ_ℓℓ/2)``, in the original units of ``y``.

        The noise bound (:meth:`bounded_log_noise`) travels with the head as buffers when it
        is on and recorded; the exponent is capped below the dtype's overflow either way.
        """
        bound = self.noise_bound != "none" and self.noise_range_recorded
        return _HeteroscedasticHead(options, _with_margin(self.noise_range) if bound else None)

    def extra_repr(self) -> str:
        """The noise bound and whether its range is recorded."""
        recorded = "recorded" if self.noise_range_recorded else "not recorded"
        return f"noise_bound={self.noise_bound!r} ({recorded})"


def _with_margin(noise_range: Tensor) -> Tensor:
    """``noise_range`` widened by :data:`NOISE_BOUND_MARGIN`: lower mean, upper mean, upper variance."""
    margin = torch.tensor([-NOISE_BOUND_MARGIN, NOISE_BOUND_MARGIN, NOISE_BOUND_MARGIN])
    return noise_range + margin.to(noise_range)


def _unrecorded_range() -> Tensor:
    """The :attr:`HeteroscedasticGaussian.noise_range` of no record: bounds that bound nothing."""
    return torch.tensor([-math.inf, math.inf, math.inf])


class _HeteroscedasticHead(RegressionHead):
    name = "heteroscedastic"
    noise_range: Tensor

    def __init__(self, options: ExportOptions, noise_range: Tensor | None) -> None:
        super().__init__(options)
        self.bounded = noise_range is not None  # decided at export: no branch in the graph
        if noise_range is not None:
            self.register_buffer("noise_range", noise_range.detach().to(dtype=options.dtype))
        self.limit = _overflow_exponent(options.dtype)

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        mean_m, var_m, mean_l, var_l, _ = HeteroscedasticGaussian._parts(out)
        if self.bounded:
            bound = self.noise_range
            mean_l = torch.minimum(torch.maximum(mean_l, bound[0]), bound[1])
            var_l = torch.minimum(var_l, bound[2])
        exponent = (mean_l + 0.5 * var_l).clamp(max=self.limit)
        return F.heteroscedastic_predictive_moments(
            mean_m, var_m, exponent, torch.zeros_like(exponent)
        )


class HomoscedasticGaussian(_DequantisedTargets, _GaussianRegression):
    r"""Regression with one output :math:`m` and a learned noise variance: :math:`y\sim\mathcal N(m, e^{\lambda})`.

    :math:`\lambda` (``log_variance``) is a point-estimated ``nn.Parameter``, so pass the
    likelihood's parameters to the optimiser along with the network's.

    Args:
        init_log_variance: initial :math:`\lambda` (a low value lets the mean fit first).
        mc_samples: draws for the Monte Carlo fallback.
        resolution: the targets' grid step :math:`\Delta` (0: continuous), as for
            :class:`HeteroscedasticGaussian`.

    Examples:
        >>> lik = HomoscedasticGaussian(init_log_variance=0.0)
        >>> out = Gaussian(torch.zeros(2, 1), var=torch.zeros(2, 1))
        >>> lik.expected_log_prob(out, torch.zeros(2)).tolist()  # log N(0; 0, 1)
        [-0.9189385175704956, -0.9189385175704956]
    """

    num_outputs = 1

    def __init__(
        self, init_log_variance: float = -3.0, mc_samples: int = 256, resolution: float = 0.0
    ) -> None:
        super().__init__(mc_samples)
        if not math.isfinite(init_log_variance):
            raise ValueError(f"init_log_variance must be finite, got {init_log_variance}")
        self.log_variance = nn.Parameter(torch.tensor(float(init_log_variance)))
        self.resolution = resolution

    @property
    def noise_variance(self) -> Tensor:
        r"""The observation variance :math:`e^\lambda`."""
        return self.log_variance.exp()

    def _log_var(self, like: Tensor) -> Tensor:
        return self.log_variance.to(dtype=like.dtype, device=like.device)

    def conditional(self, f: Tensor) -> torch.distributions.Normal:
        r""":math:`\mathcal N(m, e^\lambda)` with ``m = f[..., 0]``."""
        scale = (0.5 * self._log_var(f)).exp()
        return torch.distributions.Normal(f[..., 0], scale, validate_args=False)

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r"""Closed form :math:`-\tfrac12[\log 2\pi e^\lambda + ((y-\langle m\rangle)^2 + \Sigma_{mm})e^{-\lambda}]`, ``[B]``."""
        y = self.validate_target(y, self.validate_output(out))
        noise_var = self._log_var(out.mean).exp()
        var_m = self._dequantised(out.var[..., 0])
        return F.normal_expected_log_prob(out.mean[..., 0], var_m, y, noise_var)

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        r""":math:`\Sigma_{mm}`: the part of the predictive variance due to the weights, ``[B]``."""
        return self.validate_output(out).var[..., 0]

    def predictive(self, out: Gaussian) -> torch.distributions.Normal:
        r""":math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + e^\lambda)`."""
        self.validate_output(out)
        var = out.var[..., 0] + self._log_var(out.mean).exp()
        return torch.distributions.Normal(out.mean[..., 0], var.sqrt())

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""``mean = m``, ``var = Σ_mm + e^λ`` (λ frozen at its current value), original units."""
        return _HomoscedasticHead(float(self.log_variance.detach()), options)

    def extra_repr(self) -> str:
        """The current log noise variance."""
        return f"log_variance={self.log_variance.item():.4g}"


class _HomoscedasticHead(RegressionHead):
    name = "homoscedastic"
    log_noise_variance: Tensor

    def __init__(self, log_noise_variance: float, options: ExportOptions) -> None:
        super().__init__(options)
        noise = torch.tensor(log_noise_variance, dtype=options.dtype)
        self.register_buffer("log_noise_variance", noise)

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        return out.mean[..., 0], out.var[..., 0] + self.log_noise_variance.exp()

"""Gaussian regression likelihoods: heteroscedastic (m, ℓ) outputs and a learned global noise."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian
from . import functional as F
from .base import ExportOptions, Likelihood, PredictiveHead, RegressionHead

__all__ = ["HeteroscedasticGaussian", "HomoscedasticGaussian", "dequantisation_variance"]


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


class _DequantisedTargets:
    """The ``resolution`` of a Gaussian likelihood's targets (see :func:`dequantisation_variance`)."""

    _resolution: float = 0.0
    _extra_variance: float = 0.0

    @property
    def resolution(self) -> float:
        r"""The targets' grid step :math:`\Delta` (0: continuous); see :func:`dequantisation_variance`."""
        return self._resolution

    @resolution.setter
    def resolution(self, value: float) -> None:
        self._extra_variance = dequantisation_variance(float(value))
        self._resolution = float(value)

    def _dequantised(self, var_m: Tensor) -> Tensor:
        r""":math:`\Sigma_{mm} + \Delta^2/12` (``var_m`` itself, no op, when :math:`\Delta = 0`)."""
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

    Examples:
        >>> lik = HeteroscedasticGaussian()
        >>> out = Gaussian(torch.zeros(3, 2), var=torch.full((3, 2), 0.1))
        >>> tuple(lik.expected_log_prob(out, torch.zeros(3)).shape)
        (3,)
        >>> type(lik.predictive(out)).__name__
        'Normal'
    """

    num_outputs = 2

    def __init__(
        self, require_full: bool = False, mc_samples: int = 256, resolution: float = 0.0
    ) -> None:
        super().__init__(mc_samples)
        self.require_full = bool(require_full)
        self.resolution = resolution

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
        mean_m, var_m, mean_l, var_l, cov_ml = self._parts(out)
        var_m = self._dequantised(var_m)
        return F.heteroscedastic_expected_log_prob(mean_m, var_m, mean_l, var_l, cov_ml, y)

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        r""":math:`\Sigma_{mm}`: the part of the predictive variance due to the weights, ``[B]``."""
        return self.validate_output(out).var[..., 0]

    def predictive(self, out: Gaussian) -> torch.distributions.Normal:
        r""":math:`\mathcal N(\langle m\rangle, \Sigma_{mm} + e^{\langle\ell\rangle + \Sigma_{\ell\ell}/2})`."""
        self.validate_output(out)
        mean_m, var_m, mean_l, var_l, _ = self._parts(out)
        mean, var = F.heteroscedastic_predictive_moments(mean_m, var_m, mean_l, var_l)
        return torch.distributions.Normal(mean, var.sqrt())

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        r"""``mean = ⟨m⟩``, ``var = Σ_mm + exp(⟨ℓ⟩ + Σ_ℓℓ/2)``, in the original units of ``y``."""
        return _HeteroscedasticHead(options)


class _HeteroscedasticHead(RegressionHead):
    name = "heteroscedastic"

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        mean_m, var_m, mean_l, var_l, _ = HeteroscedasticGaussian._parts(out)
        return F.heteroscedastic_predictive_moments(mean_m, var_m, mean_l, var_l)


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

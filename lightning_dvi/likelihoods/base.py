"""The likelihood base class: generic Monte Carlo expected log-likelihood over network outputs."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from .._checks import value_checks_enabled
from ..configurable import RecordsInitArgs
from ..gaussian import Gaussian
from ..gaussian import all_finite as _all_finite
from ..moments import policy

__all__ = ["ExportOptions", "Likelihood", "PredictiveHead", "RegressionHead"]


@dataclass(frozen=True)
class ExportOptions:
    """What an exported predictive is asked for (:meth:`Likelihood.export_head`).

    Attributes:
        target_loc: regression targets' mean (original units).
        target_scale: regression targets' std.
        temperature: a classifier's predictive temperature (1: untempered).
        dtype: the network's dtype (the head's buffers use it).
    """

    target_loc: float = 0.0
    target_scale: float = 1.0
    temperature: float = 1.0
    dtype: torch.dtype = torch.float32


class PredictiveHead(nn.Module):
    """What an exported predictive computes from the network's output moments.

    A likelihood builds its head with :meth:`Likelihood.export_head`;
    :class:`~lightning_dvi.nn.PredictiveModule` runs ``head(net.propagate(x, mode))``. A head
    is traced by ``torch.export``/ONNX, so its ``forward`` has no data-dependent branch and no
    host read; its constants are buffers in the network's dtype.

    Attributes:
        name: a short name for ``repr`` (``"homoscedastic"``, ``"categorical"``, ...).
    """

    name: str = "head"

    def forward(self, out: Gaussian) -> Tensor | tuple[Tensor, Tensor]:  # pragma: no cover
        """The served predictive of the output Gaussian ``out``."""
        raise NotImplementedError

    def extra_repr(self) -> str:
        """The head's name."""
        return self.name


class RegressionHead(PredictiveHead):
    r"""A head that returns ``(mean, var)`` of :math:`y` in its original units.

    Subclasses implement :meth:`standardized` (the predictive moments of the standardised
    target); this maps them back, ``mean * target_scale + target_loc`` and
    ``var * target_scale**2``.
    """

    target_loc: Tensor
    target_scale: Tensor

    def __init__(self, options: ExportOptions) -> None:
        super().__init__()
        loc, scale, dtype = options.target_loc, options.target_scale, options.dtype
        self.register_buffer("target_loc", torch.tensor(float(loc), dtype=dtype))
        self.register_buffer("target_scale", torch.tensor(float(scale), dtype=dtype))

    def standardized(self, out: Gaussian) -> tuple[Tensor, Tensor]:  # pragma: no cover
        """Predictive ``(mean, var)`` of the standardised target, ``[B]`` each."""
        raise NotImplementedError

    def forward(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        """Predictive ``(mean, var)`` in the original units of ``y``."""
        mean, var = self.standardized(out)
        return mean * self.target_scale + self.target_loc, var * self.target_scale.square()


class Likelihood(RecordsInitArgs, nn.Module):
    r"""Base class for observation models :math:`p(y\mid a^L)` on the network's last activations.

    In the style of GPyTorch likelihoods: a subclass states the conditional
    :math:`p(y\mid f)` (:meth:`conditional`, a ``torch.distributions`` object), and everything
    that needs a density at given outputs derives from it: :meth:`log_prob`, the generic Monte
    Carlo :meth:`expected_log_prob` (which subclasses override in closed form, and the tests
    compare the two), the Monte Carlo predictive density :meth:`mixture_log_prob` of the
    sampling modes, and the Pyro sites.

    Subclasses set :attr:`num_outputs` and implement :meth:`conditional`, :meth:`predictive`
    and, where the targets are not real numbers, :meth:`_check_values`.

    Args:
        mc_samples: samples of the output Gaussian used by the Monte Carlo estimates.

    Front ends (:class:`~lightning_dvi.DVIRegressor`, :class:`~lightning_dvi.DVIClassifier`)
    take a likelihood object and ask it, never its type, what differs between likelihoods:
    the class attributes below, :attr:`bounds_noise` and its noise-range methods,
    :meth:`set_target_resolution`, :meth:`initial_output_bias`, :meth:`sampled_variance`,
    :meth:`epistemic_variance` and :meth:`export_head` (docs/adding_a_likelihood.md).

    Attributes:
        num_outputs: how many network outputs the likelihood consumes (the size of ``D``).
        mc_samples: default Monte Carlo sample count.
        task: ``"regression"`` (taken by ``DVIRegressor``) or ``"classification"``
            (``DVIClassifier``).
        standardizes_targets: whether the regressor may standardise the targets,
            :math:`(y - m)/s`; ``False`` for targets in their own units (Poisson counts), whose
            closed-form predictive log-density is then ``predictive(out).log_prob(y)``.
        accepts_resolution: whether :meth:`set_target_resolution` takes the targets' grid step.
        target_units: what the targets are called in messages (``"counts"``).
        num_classes: the classes a classification likelihood fixes (``None``: from the data).
        init_args: the arguments the constructor was called with (recorded for every
            subclass), what a checkpoint stores of the object.
    """

    num_outputs: int = 1
    task: ClassVar[Literal["regression", "classification"]] = "regression"
    standardizes_targets: ClassVar[bool] = True
    accepts_resolution: ClassVar[bool] = False
    target_units: ClassVar[str] = "targets"
    init_args: dict[str, Any]
    num_classes: int | None = None

    def __init__(self, mc_samples: int = 256) -> None:
        super().__init__()
        if isinstance(mc_samples, bool) or not isinstance(mc_samples, int) or mc_samples < 1:
            raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
        self.mc_samples = mc_samples

    # ------------------------------------------------------------------ what front ends ask
    @property
    def bounds_noise(self) -> bool:
        """Whether the predictive bounds the noise by a range recorded on the training inputs.

        ``True`` makes :class:`~lightning_dvi.DVIRegressor` record that range at the end of
        ``fit`` (:meth:`noise_range_of`, :meth:`set_noise_range`) and forget it at the start
        (:meth:`forget_noise_range`). The base class: ``False``.
        """
        return False

    def forget_noise_range(self) -> None:
        """Drop a recorded noise range (the base class has none: nothing to do)."""

    def noise_range_of(self, outs: Iterable[Gaussian]) -> Tensor:
        """The noise range to record from the outputs on the training inputs (see :attr:`bounds_noise`).

        Raises:
            NotImplementedError: in the base class, which bounds nothing.
        """
        raise NotImplementedError(f"{type(self).__name__} records no noise range")

    def set_noise_range(self, found: Tensor) -> None:
        """Store a range from :meth:`noise_range_of` (see :attr:`bounds_noise`).

        Raises:
            NotImplementedError: in the base class, which bounds nothing.
        """
        raise NotImplementedError(f"{type(self).__name__} records no noise range")

    def set_target_resolution(self, step: float) -> None:
        r"""The targets' grid step :math:`\Delta` in the units this likelihood sees (0: none).

        Only likelihoods with :attr:`accepts_resolution` take one.

        Raises:
            ValueError: for a likelihood that does not.
        """
        raise ValueError(f"{type(self).__name__} takes no target resolution")

    def initial_output_bias(self, init_log_noise: float) -> dict[int, float]:
        """Biases to give the built-in MLP's head, by output index, from the regressor's ``init_log_noise``.

        The base class: none. :class:`~lightning_dvi.likelihoods.HeteroscedasticGaussian`
        starts its log-variance output (index 1) at ``init_log_noise``.
        """
        return {}

    def epistemic_variance(self, out: Gaussian) -> Tensor:
        r"""The part of the predictive variance due to the weights, :math:`\operatorname{Var}_q[\mathbb E[y\mid f]]`, ``[B]``.

        Regression likelihoods implement it (the regressor's variance decomposition).

        Raises:
            NotImplementedError: in the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement epistemic_variance")

    def class_probs(self, f: Tensor) -> Tensor:
        """Class probabilities ``[..., B, K]`` at network outputs ``f`` (classification likelihoods).

        Raises:
            NotImplementedError: in the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement class_probs")

    def predictive_probs(self, out: Gaussian) -> Tensor:
        """Predictive class probabilities ``[B, K]`` of the output Gaussian (classification likelihoods).

        Raises:
            NotImplementedError: in the base class.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement predictive_probs")

    def sampled_variance(self, f: Tensor, conditional: torch.distributions.Distribution) -> Tensor:
        r"""The variance of :math:`p(y\mid f_s)` per weight draw, ``[S, B]``, for the Monte Carlo predictive.

        Args:
            f: network outputs under ``S`` weight draws, ``[S, B, D]``.
            conditional: :meth:`conditional` at ``f``.

        Returns:
            The base class: ``conditional.variance``.
        """
        return conditional.variance

    # ------------------------------------------------------------------ interface
    def log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        """Log-likelihood of targets under sampled network outputs (validated).

        Args:
            f: network outputs ``[..., B, D]`` (e.g. ``[S, B, D]`` from the sampling modes).
            y: targets ``[B]`` (regression also accepts ``[B, 1]``).

        Returns:
            ``log p(y | f)`` of shape ``[..., B]``.
        """
        return self._log_prob(f, self.validate_target(y, f))

    def _log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        """:meth:`log_prob` on already validated targets ``[B]``: the :meth:`conditional`'s."""
        return self.conditional(f).log_prob(y)

    def point_fit_loss(self, f: Tensor, y: Tensor) -> Tensor:
        r"""Per-datum loss of a point-estimate network, for the warm start before (D)VI.

        :func:`lightning_dvi.warm_start.fit_point_estimate` fits the network with every weight
        at its posterior mean on this loss. The base class uses the plug-in negative
        log-likelihood :math:`-\log p(y\mid f)` (cross-entropy for
        :class:`~lightning_dvi.likelihoods.Categorical`); the two Gaussians override it with
        the squared error of the mean output, :math:`(y - f_0)^2`, and leave the noise to the
        variational fit.

        Args:
            f: network outputs ``[B, D]`` at the posterior means.
            y: targets ``[B]`` (regression also accepts ``[B, 1]``).

        Returns:
            ``[B]``.
        """
        return -self.log_prob(f, y)

    def conditional(self, f: Tensor) -> torch.distributions.Distribution:
        r"""The observation model :math:`p(y\mid f)` at network outputs ``f [..., B, D]``.

        Returns:
            A ``torch.distributions.Distribution`` with batch shape ``[..., B]`` (no checks on
            ``f``: it is called on samples inside the hot loop).
        """
        raise NotImplementedError

    def mixture_log_prob(self, f: Tensor, y: Tensor) -> Tensor:
        r"""Monte Carlo predictive log-density :math:`\log\frac1S\sum_s p(y\mid f_s)` per datum.

        The predictive score of the sampling modes (MCVI): ``f [S, B, D]`` are network outputs
        under ``S`` weight draws (``net(x, mode="sample", num_samples=S)``). This is the
        log-density of the mixture itself, not of a Gaussian matched to its moments.

        Returns:
            ``[B]`` log-densities, in the units of ``y``.
        """
        if f.dim() < 3:
            raise ValueError(f"mixture_log_prob needs samples [S, B, D], got {tuple(f.shape)}")
        return torch.logsumexp(self.log_prob(f, y), 0) - math.log(f.shape[0])

    def predictive(self, out: Gaussian) -> torch.distributions.Distribution:
        """The (approximate) posterior predictive distribution, batch shape ``[B]``."""
        raise NotImplementedError

    def export_head(self, options: ExportOptions) -> PredictiveHead:
        """The deterministic, traceable predictive this likelihood exports.

        Each likelihood owns its exported predictive as it owns :meth:`predictive`; the
        exporter (:func:`~lightning_dvi.nn.export_predictive`) only asks for it.

        Args:
            options: target scaling, temperature and dtype (:class:`ExportOptions`).

        Raises:
            ValueError: if the likelihood has no deterministic predictive to export.
        """
        raise ValueError(f"no exportable predictive for {type(self).__name__}")

    def expected_log_prob(self, out: Gaussian, y: Tensor, mc_samples: int | None = None) -> Tensor:
        r"""Monte Carlo :math:`\mathbb E_{a\sim\mathcal N(\mu,\Sigma)}\log p(y\mid a)` per datum.

        Averages :meth:`log_prob` over ``mc_samples`` reparameterised draws of ``out``, so it is
        differentiable and serves both as a fallback and as the oracle the closed forms are
        tested against.

        Args:
            out: the Gaussian over network outputs, mean ``[B, D]``.
            y: targets ``[B]``.
            mc_samples: number of draws (default :attr:`mc_samples`).

        Returns:
            ``[B]`` expected log-likelihoods.
        """
        y = self.validate_target(y, self.validate_output(out))
        s = self.mc_samples if mc_samples is None else mc_samples
        if isinstance(s, bool) or not isinstance(s, int) or s < 1:
            raise ValueError(f"mc_samples must be a positive int, got {mc_samples!r}")
        return self._log_prob(out.sample((s,)), y).mean(0)

    def forward(self, out: Gaussian) -> torch.distributions.Distribution:
        """Calling the likelihood on an output Gaussian returns :meth:`predictive`."""
        return self.predictive(out)

    # ------------------------------------------------------------------ validation
    def validate_output(self, out: Gaussian) -> Gaussian:
        """Check that ``out`` is a Gaussian with :attr:`num_outputs` outputs.

        Raises:
            ValueError: naming the problem.
        """
        if not isinstance(out, Gaussian):
            raise ValueError(
                f"{type(self).__name__} needs a Gaussian over network outputs (run the net in "
                f"mode='full' or 'diag'), got {type(out).__name__}"
            )
        self._check_width(out.mean.shape[-1])
        return out

    def _check_width(self, d: int) -> None:
        if d != self.num_outputs:
            raise ValueError(
                f"{type(self).__name__} consumes {self.num_outputs} network output(s) but the "
                f"network has {d}"
            )

    def validate_target(self, y: Tensor, out_or_batch_size: Gaussian | Tensor | int) -> Tensor:
        """Check targets against the output (or batch size) and return them in canonical form.

        Args:
            y: targets.
            out_or_batch_size: the output Gaussian (mean ``[B, D]``), sampled outputs
                ``[..., B, D]``, or the batch size ``B``.

        Returns:
            ``y`` of shape ``[B]`` (a regression ``[B, 1]`` is flattened; labels become long).

        Raises:
            ValueError: on a non-tensor, a batch-shape mismatch, NaN/Inf targets, or (for
                classification) non-integer or out-of-range labels.
        """
        name = type(self).__name__
        if isinstance(out_or_batch_size, Gaussian):
            self.validate_output(out_or_batch_size)
            batch = tuple(out_or_batch_size.mean.shape[:-1])
        elif isinstance(out_or_batch_size, Tensor):
            if out_or_batch_size.dim() < 2:
                raise ValueError(
                    f"{name}: sampled outputs must be [..., B, D], got "
                    f"{tuple(out_or_batch_size.shape)}"
                )
            self._check_width(out_or_batch_size.shape[-1])
            batch = (out_or_batch_size.shape[-2],)
        else:
            batch = (int(out_or_batch_size),)
        if not isinstance(y, Tensor):
            raise ValueError(f"{name}: targets must be a torch.Tensor, got {type(y).__name__}")
        shape = tuple(y.shape)
        if shape != batch:
            if self._accepts_trailing_one and shape == (*batch, 1):
                y = y.squeeze(-1)
            else:
                raise ValueError(
                    f"{name}: target shape {shape} does not match the output batch shape {batch}"
                )
        return self._check_values(y)

    _accepts_trailing_one: bool = True

    def _check_values(self, y: Tensor) -> Tensor:
        if not y.dtype.is_floating_point:
            y = y.to(torch.get_default_dtype())
        # deferred inside the ELBO, whose finite loss check covers it (lightning_dvi._checks)
        if value_checks_enabled() and not _all_finite(y):
            raise ValueError(f"{type(self).__name__}: targets contain NaN or Inf")
        return y

    def _check_discrete(self, y: Tensor, valid: Callable[[Tensor], Tensor], what: str) -> Tensor:
        """Floating targets, finite and with ``valid(y)`` everywhere, else a ValueError ``what``."""
        if y.is_complex():
            raise ValueError(f"{type(self).__name__}: {what}, got dtype {y.dtype}")
        y = y if y.dtype.is_floating_point else y.to(torch.get_default_dtype())
        if policy.tracing():  # value checks are host reads: done by the caller
            return y
        if not _all_finite(y):
            raise ValueError(f"{type(self).__name__}: targets contain NaN or Inf")
        if y.numel() and not bool(valid(y).all()):
            raise ValueError(f"{type(self).__name__}: {what}")
        return y

r"""Normalization modules: ``BatchNorm1d``, ``BatchNorm2d``.

Thin modules over :mod:`lightning_dvi.moments.normalization`. Their affine parameters
:math:`\gamma, \beta` are *point* parameters (trained by the optimizer like any torch
parameter, with no posterior, no prior and no KL term); they are named in
``point_parameters``, which is how the checks that every other parameter holds a posterior
tell them apart.

**Batch normalization** is the per-channel affine map :math:`y = s_c a + t_c` with
:math:`s_c = \gamma_c/\sqrt{\sigma^2_c + \epsilon}` and :math:`t_c = \beta_c - s_c\mu_c`, exact
on a Gaussian once the statistics :math:`(\mu_c, \sigma^2_c)` are fixed:

* eval mode (or ``freeze_statistics=True``): the running statistics;
* train mode: batch normalization of the propagated moments (``batch_rule``, see
  :mod:`lightning_dvi.moments.normalization`; the default ``"delta"`` accounts for the
  draw-to-draw fluctuation of the batch statistics), with torch's running-statistic update
  (momentum, or the cumulative average for ``momentum=None``; the unbiased batch variance);
  in the Monte Carlo modes each draw of ``[S, B, ...]`` is normalized by its own batch
  statistics, as the sampled network would be, and the running statistics take their average
  over the draws;
* ``track_running_stats=False``: batch statistics in both modes, as in torch.

A deterministic input in a moment mode runs ``torch.nn.functional.batch_norm`` itself, so with
zero input variance the module is torch's ``BatchNorm`` (outputs and running statistics).
"""

from __future__ import annotations

from typing import Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..moments import normalization as N
from ..moments.normalization import BatchRule
from ..propagation import Propagation
from .base import BayesModule, Moments
from .registry import ConversionOptions, register_layer

__all__ = ["BatchNorm1d", "BatchNorm2d"]


def _check_features(name: str, num_features: int) -> int:
    if isinstance(num_features, bool) or not isinstance(num_features, int) or num_features < 1:
        raise ValueError(f"{name}: num_features must be a positive int, got {num_features!r}")
    return num_features


class _BatchNorm(BayesModule):
    _name: str
    _ranks: tuple[int, ...]  # accepted input ranks, without a sample dimension
    _shapes: str
    image_output = None  # shape-preserving: the output is stored as the input was
    point_parameters = ("weight", "bias")

    running_mean: Tensor | None
    running_var: Tensor | None
    num_batches_tracked: Tensor | None

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        *,
        batch_rule: BatchRule = "delta",
        freeze_statistics: bool = False,
    ) -> None:
        super().__init__()
        self.num_features = _check_features(self._name, num_features)
        if not eps > 0:
            raise ValueError(f"{self._name}: eps must be positive, got {eps!r}")
        if momentum is not None and not 0 <= momentum <= 1:
            raise ValueError(f"{self._name}: momentum must be None or in [0, 1], got {momentum!r}")
        if batch_rule not in ("delta", "total", "independent", "means"):
            raise ValueError(
                f"{self._name}: batch_rule must be 'delta', 'total', 'independent' or 'means', "
                f"got {batch_rule!r}"
            )
        if freeze_statistics and not track_running_stats:
            raise ValueError(f"{self._name}: freeze_statistics needs track_running_stats=True")
        self.eps = float(eps)
        self.momentum = momentum
        self.affine = affine
        self.track_running_stats = track_running_stats
        self.batch_rule: BatchRule = batch_rule
        self.freeze_statistics = freeze_statistics
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if affine:
            self.weight = nn.Parameter(torch.ones(num_features))
            self.bias = nn.Parameter(torch.zeros(num_features))
        if track_running_stats:
            self.register_buffer("running_mean", torch.zeros(num_features))
            self.register_buffer("running_var", torch.ones(num_features))
            self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))
        else:
            self.running_mean = self.running_var = self.num_batches_tracked = None

    # ------------------------------------------------------------------ helpers
    def _uses_batch_statistics(self) -> bool:
        return not self.track_running_stats or (self.training and not self.freeze_statistics)

    def _updates_running_statistics(self) -> bool:
        return self.track_running_stats and self.training and not self.freeze_statistics

    def _momentum(self) -> float:
        """Torch's exponential-average factor; counts the batch (train mode only)."""
        assert self.num_batches_tracked is not None
        self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            return 1.0 / float(self.num_batches_tracked)
        return float(self.momentum)

    def _check(self, x: Moments, mode: Propagation) -> tuple[int, ...]:
        shape = tuple(x.shape)
        user = shape[1:] if mode.samples and isinstance(x, Tensor) else shape
        if len(user) not in self._ranks or user[1] != self.num_features:
            raise ValueError(
                f"{self._name}({self.num_features}) expects input of shape {self._shapes} with "
                f"C = {self.num_features}, got shape {user}"
            )
        if isinstance(x, Gaussian) and x.is_full and len(user) != 2:
            raise ValueError(
                f"{self._name}: a full-covariance input must be flat [B, C], got shape {user}"
            )
        dtype = self._dtype()
        if dtype is not None and x.dtype != dtype:
            raise ValueError(
                f"{self._name} parameters are {dtype} but the input is {x.dtype}; "
                "convert one of them (e.g. net.double() or x.float())"
            )
        return user

    def _dtype(self) -> torch.dtype | None:
        for t in (self.weight, self.running_mean):
            if t is not None:
                return t.dtype
        return None

    @staticmethod
    def _channel(param: Tensor | None, rank: int) -> Tensor | None:
        """``[C]`` as ``[C, 1, ...]`` against inputs ``[..., C, *spatial]`` of ``rank`` dims."""
        return None if param is None else param.reshape(-1, *([1] * (rank - 2)))

    def _affine(self, mu: Tensor, sigma2: Tensor, rank: int) -> tuple[Tensor, Tensor]:
        return N.normalization_scale_shift(
            mu, sigma2, self._channel(self.weight, rank), self._channel(self.bias, rank), self.eps
        )

    def _running(self, rank: int) -> tuple[Tensor, Tensor]:
        assert self.running_mean is not None and self.running_var is not None
        return (
            cast(Tensor, self._channel(self.running_mean, rank)),
            cast(Tensor, self._channel(self.running_var, rank)),
        )

    def _update(self, mu: Tensor, sigma2: Tensor, n: int) -> None:
        """Torch's update: the batch mean and the *unbiased* batch variance, ``n`` values each."""
        if not self._updates_running_statistics():
            return
        assert self.running_mean is not None and self.running_var is not None
        factor = self._momentum()
        with torch.no_grad():
            unbiased = sigma2.detach() * (n / (n - 1))
            self.running_mean.lerp_(mu.detach().reshape(-1), factor)
            self.running_var.lerp_(unbiased.reshape(-1), factor)

    def _batch_size(self, user: tuple[int, ...]) -> int:
        n = user[0] * int(torch.Size(user[2:]).numel())
        if n < 2:
            raise ValueError(
                f"{self._name} in training mode needs more than 1 value per channel (batch "
                f"statistics), got input shape {user}; use eval mode or a larger batch"
            )
        return n

    # ------------------------------------------------------------------ propagation
    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Normalize a tensor (any mode) or a Gaussian (``full``/``diag``), per channel."""
        user = self._check(x, mode)
        rank = len(user)
        batch = self._uses_batch_statistics()
        n = self._batch_size(user) if batch else 0
        if isinstance(x, Tensor) and not mode.samples:  # deterministic: torch's own op
            factor = self._momentum() if self._updates_running_statistics() else 0.0
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias,
                batch, factor, self.eps,
            )  # fmt: skip
        if isinstance(x, Tensor):  # [S, B, C, ...]: each draw by its own batch statistics
            if not batch:
                scale, shift = self._affine(*self._running(rank), rank)
                return scale * x + shift
            dims = (1, *range(3, rank + 1))
            mu, sigma2 = N.batch_norm_statistics(x, None, dims)
            self._update(mu.mean(0), sigma2.mean(0), n)
            scale, shift = self._affine(mu, sigma2, rank)
            return scale * x + shift
        g = x.to_diag() if mode.diag else x
        if batch:
            dims = (0, *range(2, rank))
            mu, sigma2 = N.batch_norm_statistics(g.mean, g.var, dims, self.batch_rule)
            self._update(mu, sigma2, n)
            if self.batch_rule in ("delta", "independent"):
                return self._normalized(g, rank)
        else:
            if g.cov is None:  # fixed statistics: one fused node where the policy allows
                assert self.running_mean is not None and self.running_var is not None
                mean, var = N.running_affine_diag(
                    g.mean, g.var, self.running_mean, self.running_var,
                    self.weight, self.bias, self.eps,
                )  # fmt: skip
                return Gaussian(mean, var=var, validate=False)
            mu, sigma2 = self._running(rank)
        scale, shift = self._affine(mu, sigma2, rank)
        if g.cov is not None:
            mean, cov = N.affine_full(g.mean, g.cov, scale.reshape(-1), shift.reshape(-1))
            return Gaussian(mean, cov=cov, validate=False)
        mean, var = N.affine_diag(g.mean, g.var, scale, shift)
        return Gaussian(mean, var=var, validate=False)

    def _normalized(self, g: Gaussian, rank: int) -> Gaussian:
        """The ``"delta"``/``"independent"`` train rules: moments of per-draw batch normalization."""
        mean, var, slope = self._rule_moments(g, rank)
        if g.cov is None:
            return Gaussian(mean, var=var, validate=False)
        return Gaussian(mean, cov=N.batch_normalize_cov(g.cov, var, slope), validate=False)

    def _rule_moments(self, g: Gaussian, rank: int) -> tuple[Tensor, Tensor, Tensor]:
        """Mean, variance and expected self-derivative after the rule and the affine part."""
        rule: Literal["delta", "independent"] = (
            "independent" if self.batch_rule == "independent" else "delta"
        )
        mean, var, slope = N.batch_normalize(g.mean, g.var, self.eps, rule)
        gain = self._channel(self.weight, rank)
        shift = self._channel(self.bias, rank)
        if gain is not None:
            mean, var, slope = gain * mean, var * (gain * gain), slope * gain
        if shift is not None:
            mean = mean + shift
        return mean, var, slope

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        r""":math:`\operatorname{Cov}(r, y_k) = \operatorname{Cov}(r, a_k)\,g_k` (Stein's lemma).

        :math:`g_k = E[\partial y_k/\partial a_k]` per example and channel: the constant gain
        :math:`s` of the affine map (eval mode, ``freeze_statistics``, the ``"total"`` and
        ``"means"`` rules), or the expected self-derivative of the ``"delta"`` and
        ``"independent"`` rules (:func:`~lightning_dvi.moments.batch_normalize`), the same
        :math:`g` that forms the covariance across channels in full mode.
        :meth:`propagate` runs after this and updates the running statistics, once per batch.
        """
        user = self._check(x, mode)
        if len(user) != 2:
            raise ValueError(f"{self._name} inside a Residual block needs a flat [B, C] input")
        batch = self._uses_batch_statistics()
        if batch and self.batch_rule in ("delta", "independent"):
            self._batch_size(user)
            slope = self._rule_moments(x.to_diag(), 2)[2]
            return M.cross_through_activation(cross, slope)
        if batch:
            mu, sigma2 = N.batch_norm_statistics(x.mean, x.var, (0,), self.batch_rule)
        else:
            mu, sigma2 = self._running(2)
        scale, _ = self._affine(mu, sigma2, 2)
        return M.cross_through_activation(cross, scale.reshape(-1).expand_as(x.mean))

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        extra = "" if self.batch_rule == "delta" else f", batch_rule={self.batch_rule!r}"
        if self.freeze_statistics:
            extra += ", freeze_statistics=True"
        return (
            f"{self.num_features}, eps={self.eps}, momentum={self.momentum}, "
            f"affine={self.affine}, track_running_stats={self.track_running_stats}{extra}"
        )


def _from_torch_batch_norm(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d))  # the registry's torch_modules
    cls = BatchNorm1d if isinstance(module, nn.BatchNorm1d) else BatchNorm2d
    layer = cls(
        module.num_features,
        module.eps,
        module.momentum,
        module.affine,
        module.track_running_stats,
    )
    ref = module.weight if module.weight is not None else module.running_mean
    if ref is not None:
        layer = layer.to(device=ref.device, dtype=ref.dtype)
    with torch.no_grad():
        for name in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            theirs, ours = getattr(module, name), getattr(layer, name)
            if theirs is not None and ours is not None:
                ours.copy_(theirs)
    layer.train(module.training)
    return layer


class _FunctionalBatchNorm(_BatchNorm):
    """``F.batch_norm(x, ...)`` on moments (the Pyro pass): the caller's tensors, its factor."""

    _name = "batch_norm"
    _ranks = (2, 3, 4, 5)
    _shapes = "[B, C, *]"

    def __init__(
        self,
        num_features: int,
        running: tuple[Tensor | None, Tensor | None],
        affine: tuple[Tensor | None, Tensor | None],
        training: bool,
        factor: float,
        eps: float,
    ) -> None:
        super().__init__(num_features, eps, factor, affine=False, track_running_stats=False)
        self.running_mean, self.running_var = running  # updated in place, as torch does
        self.weight, self.bias = affine  # type: ignore[assignment]  # the caller's tensors
        self.track_running_stats = running[0] is not None
        self.training = training
        self._factor = factor

    def _momentum(self) -> float:
        return self._factor  # the torch module computed it (and counted the batch)


def _batch_norm_from_call(
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> BayesModule:
    known = [t for t in (running_mean, weight, bias) if t is not None]
    if not known:
        raise NotImplementedError(
            "F.batch_norm without running statistics or affine parameters (the channel count "
            "is unknown)"
        )
    return _FunctionalBatchNorm(
        known[0].numel(), (running_mean, running_var), (weight, bias), training, momentum, eps
    )


@register_layer(
    "batch_norm1d",
    kind="normalization",
    torch_modules=(nn.BatchNorm1d,),
    torch_functions=(F.batch_norm,),
    convert=_from_torch_batch_norm,
    from_call=_batch_norm_from_call,
)
class BatchNorm1d(_BatchNorm):
    r"""Batch normalization of ``[B, C]`` or ``[B, C, L]`` inputs (moments, module docstring).

    Args:
        num_features: channels :math:`C`.
        eps: :math:`\epsilon` added to the variance.
        momentum: running-statistics factor (``None``: cumulative average), as in torch.
        affine: learn :math:`\gamma, \beta` (point parameters).
        track_running_stats: keep running statistics (eval mode uses them).
        batch_rule: the train-mode rule on moments: ``"delta"`` (second-order delta method in
            the fluctuation of the batch statistics, :math:`O(n)`; the exact route below 16
            values per channel), ``"total"`` (constant statistics, the mean variance added to
            the variance of the means), ``"independent"`` (each channel layer-normalized over
            its batch: exact for independent examples, 81 times the activations' memory) or
            ``"means"`` (see :mod:`lightning_dvi.moments.normalization`).
        freeze_statistics: use (and keep) the running statistics in train mode too, e.g. to
            fine-tune a converted network with small batches (an attribute: set it on the
            converted modules, ``for m in net.modules(): ...``).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> bn = BatchNorm1d(2).eval()
        >>> out = bn(Gaussian(torch.ones(3, 2), var=torch.full((3, 2), 4.0)), mode="diag")
        >>> [round(v, 3) for v in out.var[0].tolist()]  # 4 / (1 + 1e-5)
        [4.0, 4.0]
    """

    _name = "BatchNorm1d"
    _ranks = (2, 3)
    _shapes = "[B, C] or [B, C, L]"


@register_layer(
    "batch_norm2d",
    kind="normalization",
    torch_modules=(nn.BatchNorm2d,),
    convert=_from_torch_batch_norm,
)
class BatchNorm2d(_BatchNorm):
    r"""Batch normalization of images ``[B, C, H, W]`` (per-pixel moments, module docstring).

    Args are those of :class:`BatchNorm1d`.

    Examples:
        >>> bn = BatchNorm2d(3)
        >>> tuple(bn(torch.randn(4, 3, 5, 5), mode="diag").shape)
        (4, 3, 5, 5)
    """

    _name = "BatchNorm2d"
    _ranks = (4,)
    _shapes = "[B, C, H, W]"

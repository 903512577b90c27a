r"""Token-sequence layers: ``Embedding``, ``FixedEmbedding``, ``RMSNorm``, ``PositionalEncoding``, ``MeanTokens``.

Sequences flow as ``[B, T, D]`` (see :mod:`lightning_dvi.nn.attention`: per-token moments,
tokens independent).

* :class:`Embedding` is a Bayesian table: row :math:`e_v \sim \mathcal N(\mu_v,
  \operatorname{diag}\sigma_v^2)`, so a token's embedding has exactly those moments (diag:
  independent units). Two positions holding the *same* token share their row, which makes them
  perfectly correlated; that correlation between tokens is not kept (as for every token pair).
  :class:`FixedEmbedding` is the deterministic table (point parameters).
* :class:`RMSNorm`: :math:`y = \gamma\circ a/\sqrt{\lVert a\rVert^2/D + \epsilon}`, moments
  by :mod:`lightning_dvi.moments.rms_norm` (exact up to quadrature).
* :class:`PositionalEncoding` adds a deterministic table ``[T_max, D]`` (learned, or the
  sinusoidal one of Vaswani et al.) to the first ``T`` positions: the means shift, variances
  and covariances are unchanged.
* :class:`MeanTokens` averages the tokens (``x.mean(dim=1)``): the mean of the means and, the
  tokens being independent, :math:`\sum_t\Sigma_t/T^2`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..moments import normalization as N
from ..moments import policy
from ..moments import rms_norm as R
from ..propagation import Mode, Propagation, propagation
from .base import BayesModule, Moments, finish, prepare_input
from .linear import FactorisedLayer, init_factorised_posterior
from .registry import ConversionOptions, register_layer

__all__ = ["Embedding", "FixedEmbedding", "MeanTokens", "PositionalEncoding", "RMSNorm"]


def _check_ids(name: str, ids: Tensor, rows: int) -> None:
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.is_complex():
        raise ValueError(f"{name} takes integer token ids, got {ids.dtype}")
    if policy.tracing():  # a host read would break torch.export's trace
        return
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= rows):
        raise ValueError(
            f"{name}: token ids must lie in [0, {rows}), got {int(ids.min())}..{int(ids.max())}"
        )


class _TokenInput(BayesModule):
    """A first layer that takes integer ids (``[B, T]``) rather than floats."""

    accepts_integer_input = True
    image_output = False

    def forward(
        self, x: Moments, mode: Mode | Propagation = "full", num_samples: int | None = None
    ) -> Moments:
        """As :meth:`BayesModule.forward`, for integer token ids ``[B, T]``."""
        how = propagation(mode, num_samples)
        out = self.propagate(prepare_input(x, how, integer_ok=True), how)
        return finish(out, how, self)


def _from_torch_embedding(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Embedding)
    if module.max_norm is not None or module.sparse or module.scale_grad_by_freq:
        raise NotImplementedError("Embedding with max_norm, sparse or scale_grad_by_freq")
    weight = module.weight.detach()
    layer = Embedding(module.num_embeddings, module.embedding_dim, **options.layer_kwargs).to(
        device=weight.device, dtype=weight.dtype
    )
    if options.init == "torch":
        from .posterior import set_posterior

        scale = (options.scale_fraction * weight.abs()).clamp_min(options.min_scale)
        set_posterior(layer, weight, scale if options.scale_fraction else torch.zeros_like(weight))
    return layer


def _describe_embedding(layer: BayesModule) -> dict[str, Any]:
    assert isinstance(layer, Embedding)
    return {
        "num_embeddings": layer.num_embeddings,
        "embedding_dim": layer.embedding_dim,
        "scale_transform": layer.scale_transform,
    }


@register_layer(
    "embedding",
    kind="weight",
    torch_modules=(nn.Embedding,),
    convert=_from_torch_embedding,
    describe=_describe_embedding,
)
class Embedding(FactorisedLayer, _TokenInput):
    r"""A Bayesian embedding table: ids ``[B, T]`` to Gaussians ``[B, T, D]``.

    :math:`q(E_{vc}) = \mathcal N(\mu_{vc}, \sigma_{vc}^2)`; the output of token :math:`v` has
    mean :math:`\mu_v` and variances :math:`\sigma_v^2` (exact, independent units). ``sample``
    mode draws a whole table per draw; ``local`` draws each looked-up row independently (the
    same marginals).

    Args:
        num_embeddings: the vocabulary size.
        embedding_dim: :math:`D`.
        init_loc_std: std of the initial means (torch's default 1).
        init_scale: initial posterior std (default :math:`0.1`).
        prior_variance: initial prior variance buffer.
        scale_transform: ``"softplus"`` or ``"exp"``.

    Examples:
        >>> emb = Embedding(10, 4)
        >>> out = emb(torch.tensor([[1, 2, 2]]), mode="diag")
        >>> tuple(out.mean.shape), bool((out.var > 0).all())
        ((1, 3, 4), True)
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_loc_std: float = 1.0,
        init_scale: float = 0.1,
        prior_variance: float = 1.0,
        scale_transform: str = "softplus",
        **unused: Any,
    ) -> None:
        super().__init__()
        if num_embeddings < 1 or embedding_dim < 1:
            raise ValueError(
                f"Embedding sizes must be positive, got {num_embeddings}, {embedding_dim}"
            )
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        init_factorised_posterior(
            self, (num_embeddings, embedding_dim), embedding_dim, False,
            init_loc_std, init_scale, None, prior_variance, scale_transform,
        )  # fmt: skip
        self.reset_parameters()

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Look up the rows' moments (or draws) of integer ids."""
        if isinstance(x, Gaussian):
            raise ValueError("Embedding takes integer token ids, got a Gaussian")
        _check_ids("Embedding", x, self.num_embeddings)
        w_loc, w_var, _, _ = self._moments()
        if w_var is None:
            return F.embedding(x, w_loc)
        if mode.samples and not mode.local:
            s = x.shape[0]
            eps = torch.randn(s, *w_loc.shape, dtype=w_loc.dtype, device=w_loc.device)
            tables = w_loc + w_var.sqrt() * eps  # [S, V, D]
            flat = x.reshape(s, -1)
            rows = torch.gather(tables, 1, flat.unsqueeze(-1).expand(-1, -1, tables.shape[-1]))
            return rows.reshape(*x.shape, -1)
        mean, var = F.embedding(x, w_loc), F.embedding(x, w_var)
        if mode.local:
            return mean + var.sqrt() * torch.randn_like(mean)
        return Gaussian(mean, var=var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Not defined: an embedding's input is integer ids, never a Gaussian."""
        raise NotImplementedError("Embedding takes integer ids; it has no cross-covariance rule")

    def extra_repr(self) -> str:
        """Sizes for ``repr``."""
        return f"{self.num_embeddings}, {self.embedding_dim}"


@register_layer("fixed_embedding", kind="shape")
class FixedEmbedding(_TokenInput):
    """A deterministic embedding table (a point parameter): ids ``[B, T]`` to tensors ``[B, T, D]``.

    Args:
        num_embeddings: the vocabulary size.
        embedding_dim: :math:`D`.

    Examples:
        >>> tuple(FixedEmbedding(10, 4)(torch.tensor([[1, 2]]), mode="diag").shape)
        (1, 2, 4)
    """

    point_parameters = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.weight = nn.Parameter(torch.randn(num_embeddings, embedding_dim))

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Look up the rows (a tensor in every mode: no variance)."""
        if isinstance(x, Gaussian):
            raise ValueError("FixedEmbedding takes integer token ids, got a Gaussian")
        _check_ids("FixedEmbedding", x, self.num_embeddings)
        return F.embedding(x, self.weight)

    def extra_repr(self) -> str:
        """Sizes for ``repr``."""
        return f"{self.num_embeddings}, {self.embedding_dim}"


def _from_torch_rms_norm(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.RMSNorm)
    shape = tuple(module.normalized_shape)
    if len(shape) != 1:
        raise NotImplementedError("RMSNorm over more than the last dimension is not supported")
    layer = RMSNorm(shape[0], module.eps, module.elementwise_affine)
    if module.weight is not None:
        layer = layer.to(device=module.weight.device, dtype=module.weight.dtype)
        if layer.weight is not None:
            with torch.no_grad():
                layer.weight.copy_(module.weight)
    return layer


def _rms_norm_from_call(
    normalized_shape: int | list[int], weight: Tensor | None = None, eps: float | None = None
) -> BayesModule:
    """``F.rms_norm(x, ...)`` in a Pyro model: an RMSNorm holding the caller's own gain."""
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    layer = RMSNorm(shape[0] if len(shape) == 1 else shape, eps, elementwise_affine=False)  # type: ignore[arg-type]  # checked there
    layer.weight = weight  # type: ignore[assignment]  # the caller's tensor: gradients reach it
    return layer


@register_layer(
    "rms_norm",
    kind="normalization",
    torch_modules=(nn.RMSNorm,),
    torch_functions=(F.rms_norm,),
    convert=_from_torch_rms_norm,
    from_call=_rms_norm_from_call,
)
class RMSNorm(BayesModule):
    r"""RMS normalization over the last dimension, :math:`y = \gamma\circ a/\sqrt{\lVert a\rVert^2/D + \epsilon}`.

    Args:
        normalized_shape: :math:`D`.
        eps: :math:`\epsilon`; ``None`` uses ``torch.finfo(dtype).eps`` as torch does.
        elementwise_affine: learn :math:`\gamma` (a point parameter).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = RMSNorm(2)(Gaussian(torch.tensor([[3.0, 4.0]]), var=torch.zeros(1, 2)))
        >>> [round(v, 3) for v in out.mean[0].tolist()]
        [0.849, 1.131]
    """

    image_output = None
    point_parameters = ("weight",)

    def __init__(
        self, normalized_shape: int, eps: float | None = None, elementwise_affine: bool = True
    ) -> None:
        super().__init__()
        if isinstance(normalized_shape, (tuple, list)):
            if len(normalized_shape) != 1:
                raise ValueError("RMSNorm normalizes over the last dimension only")
            normalized_shape = normalized_shape[0]
        self.normalized_shape = int(normalized_shape)
        self.eps = eps
        self.weight: nn.Parameter | None = (
            nn.Parameter(torch.ones(self.normalized_shape)) if elementwise_affine else None
        )

    def _eps(self, x: Moments) -> float:
        return torch.finfo(x.dtype).eps if self.eps is None else float(self.eps)

    def _check(self, x: Moments) -> None:
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(
                f"RMSNorm({self.normalized_shape}) expects [..., {self.normalized_shape}], got "
                f"shape {tuple(x.shape)}"
            )

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Normalize a tensor (any mode) or a Gaussian (``full``/``diag``)."""
        self._check(x)
        eps = self._eps(x)
        if isinstance(x, Tensor):
            return F.rms_norm(x, (self.normalized_shape,), self.weight, eps)
        gain = x.mean.new_ones(self.normalized_shape) if self.weight is None else self.weight
        zero = torch.zeros_like(gain)
        if mode.full and x.cov is not None:
            mean, cov = R.rms_normalize_full(x.mean, x.cov, eps)
            mean, cov = N.affine_full(mean, cov, gain, zero)
            return Gaussian(mean, cov=cov, validate=False)
        mean, var = R.rms_normalize_diag(x.mean, x.var, eps)
        mean, var = N.affine_diag(mean, var, gain, zero)
        return Gaussian(mean, var=var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        r""":math:`\operatorname{Cov}(r, y) = \operatorname{Cov}(r, a)E[\nabla y]^\top\operatorname{diag}(\gamma)`."""
        cov = x.cov if x.cov is not None else torch.diag_embed(x.var)
        out = cross @ R.rms_normalize_jacobian(x.mean, cov, self._eps(x)).transpose(-1, -2)
        return out if self.weight is None else out * self.weight

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return f"{self.normalized_shape}, eps={self.eps}, affine={self.weight is not None}"


def sinusoidal_table(num_positions: int, dim: int) -> Tensor:
    r"""Vaswani et al.'s :math:`PE_{t,2i} = \sin(t/10000^{2i/D})`, :math:`PE_{t,2i+1} = \cos(\cdot)`."""
    position = torch.arange(num_positions, dtype=torch.float64).unsqueeze(1)
    freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    table = torch.zeros(num_positions, dim, dtype=torch.float64)
    table[:, 0::2] = torch.sin(position * freq)
    table[:, 1::2] = torch.cos(position * freq)[:, : dim // 2]
    return table.float()


def _describe_positional(layer: BayesModule) -> dict[str, Any]:
    assert isinstance(layer, PositionalEncoding)
    return {
        "num_positions": layer.num_positions,
        "embedding_dim": layer.embedding_dim,
        "learned": layer.learned,
    }


@register_layer(
    "positional_encoding",
    kind="shape",
    describe=_describe_positional,
)
class PositionalEncoding(BayesModule):
    r"""Adds a deterministic table ``[T_max, D]`` to the first ``T`` positions of ``[B, T, D]``.

    Args:
        num_positions: :math:`T_{\max}`.
        embedding_dim: :math:`D`.
        learned: a trained table (a point parameter, zeros initially) or the fixed sinusoidal
            one (a buffer).

    Examples:
        >>> pe = PositionalEncoding(8, 4, learned=False)
        >>> bool(torch.equal(pe(torch.zeros(1, 3, 4), mode="diag")[0], pe.table[:3]))
        True
    """

    image_output = None
    point_parameters = ("table",)

    def __init__(self, num_positions: int, embedding_dim: int, learned: bool = True) -> None:
        super().__init__()
        self.num_positions, self.embedding_dim = int(num_positions), int(embedding_dim)
        self.learned = bool(learned)
        self.table: Tensor
        if learned:
            self.table = nn.Parameter(torch.zeros(num_positions, embedding_dim))
        else:
            self.register_buffer("table", sinusoidal_table(num_positions, embedding_dim))

    def _rows(self, x: Moments) -> Tensor:
        t = x.shape[-2]
        if t > self.num_positions or x.shape[-1] != self.embedding_dim:
            raise ValueError(
                f"PositionalEncoding({self.num_positions}, {self.embedding_dim}) got a sequence "
                f"of shape {tuple(x.shape)}"
            )
        return self.table[:t].to(x.dtype)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Shift the means (or values) by the table; the variances are unchanged."""
        rows = self._rows(x)
        if isinstance(x, Tensor):
            return x + rows
        if x.cov is not None:
            return Gaussian(x.mean + rows, cov=x.cov, validate=False)
        return Gaussian(x.mean + rows, var=x.var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """A deterministic shift: the cross-covariance is unchanged."""
        return cross

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return f"{self.num_positions}, {self.embedding_dim}, learned={self.learned}"


def _mean_tokens_call(dim: int = 1, keepdim: bool = False, **kwargs: Any) -> BayesModule:
    if dim not in (1, -2) or keepdim or kwargs:
        raise NotImplementedError("only x.mean(dim=1) of a [B, T, D] sequence is supported")
    return MeanTokens()


# Not a torch_functions entry: the Pyro moment pass keeps its own handling of torch.mean;
# graph conversion maps x.mean(dim=1) here by name (nn/trace.py).
@register_layer("mean_tokens", kind="pooling", from_call=_mean_tokens_call)
class MeanTokens(BayesModule):
    r"""The mean over tokens, ``[B, T, D] -> [B, D]`` (``x.mean(dim=1)``; tokens independent).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = MeanTokens()(Gaussian(torch.zeros(1, 4, 2), var=torch.ones(1, 4, 2)), mode="diag")
        >>> out.var.tolist()
        [[0.25, 0.25]]
    """

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Average the token dimension (``-2``)."""
        if x.dim() < 3 if isinstance(x, Tensor) else x.mean.dim() < 3:
            raise ValueError(f"MeanTokens expects [B, T, D], got shape {tuple(x.shape)}")
        if isinstance(x, Tensor):
            return x.mean(-2)
        t = x.mean.shape[-2]
        if x.cov is not None:
            return Gaussian(x.mean.mean(-2), cov=x.cov.sum(-3) / t**2, validate=False)
        return Gaussian(x.mean.mean(-2), var=x.var.sum(-2) / t**2, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Not supported: the tokens' cross-covariances with ``r`` are per token."""
        raise NotImplementedError("MeanTokens inside a Residual block is not supported")

r"""A tensor that stands for a Gaussian random tensor during a DVI moment pass.

During a moment pass every weight site of the model yields a :class:`MomentTensor` carrying the
posterior's (mean, variance) instead of a sample. Ordinary model code (``F.linear``,
``torch.relu``, ``x @ w``, ``+``, shape ops) then propagates moments with the closed forms of
:mod:`lightning_dvi.moments`, so an unchanged Pyro model yields the Gaussian of its output.

The subclass **refuses** every op it does not know (``__torch_function__`` raises
``NotImplementedError`` naming the op): a silent fallback that computed on the mean alone would
drop the variance and give a wrong loss without any sign of it.

Correlations are tracked conservatively. Each moment tensor records the weight sites it depends
on (``dvi_sources``); two moment tensors are independent exactly when those sets are disjoint
(all randomness comes from the weights). An op combining dependent operands (a weight used twice,
a hand-written skip connection ``h + layer(h)``) is refused, since its result depends on a
correlation that is not tracked. Declared :class:`lightning_dvi.nn.Residual` blocks carry that
correlation explicitly (see :mod:`lightning_dvi.pyro.modules`).

Storage: ``dvi_var`` (independent units, or marginals) or ``dvi_cov`` (a full covariance over
the last dimension, guide mode ``"full"``). In ``full`` mode a shape op that mixes the last
dimension with batch dimensions keeps only marginals and marks the result ``dvi_marginal``; a
later ``F.linear``/``relu`` on such a tensor is refused instead of silently dropping covariance.

The rules live in :mod:`lightning_dvi.pyro.moment_rules` and register themselves in the op
table of :mod:`lightning_dvi.pyro.dispatch` (the package imports them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeGuard

import torch
from torch import Tensor

from ..gaussian import Gaussian
from ..propagation import Mode, MomentPass, Propagation, moment_propagation
from .dispatch import LAYER_OPS, handler_for, op_name, unsupported

__all__ = ["MomentTensor", "SampledTensor", "unsupported"]

# The likelihood that integrates each link (for error messages).
_LINK_SITES = {
    "log_softmax": "dist.Categorical(logits=...)",
    "softmax": "dist.Categorical(probs=...)",
    "exp": "dist.Poisson(rate=...)",
}

_Op = Callable[..., Any]
_Kw = dict[str, Any] | None


class MomentTensor(Tensor):
    """Gaussian moments disguised as a tensor (the tensor data is a detached copy of the mean).

    Attributes:
        dvi_mean: mean (differentiable).
        dvi_var: per-element variances (always set; the diagonal of ``dvi_cov`` in full storage).
        dvi_cov: full covariance over the last dimension ``[..., D, D]`` or ``None``.
        dvi_mode: the guide's moment propagation (``full`` or ``diag`` storage).
        dvi_sources: names of the weight sites this tensor depends on.
        dvi_marginal: in full mode, whether only marginals are known (covariance dropped).
        dvi_link: ``None``, ``"log_softmax"``, ``"softmax"`` or ``"exp"``: the tensor stands
            for that function of the carried Gaussian (``dist.Categorical`` normalises its
            logits so; ``dist.Categorical(probs=softmax(f))`` takes its probabilities;
            ``dist.Poisson(rate=f.exp())`` takes a log-normal rate). A linked tensor only goes
            through shape ops, into the likelihood that integrates the link.
        dvi_logits: for the output of ``torch.sigmoid`` (and the shape ops after it), the
            moment tensor it is the sigmoid of, else ``None``. The tensor itself carries the
            moments of the sigmoid (it may feed further layers); a
            ``dist.Bernoulli(probs=...)`` site observes through these logits instead, exactly
            as ``dist.Bernoulli(logits=f)`` does.
    """

    dvi_mean: Tensor
    dvi_var: Tensor
    dvi_cov: Tensor | None
    dvi_mode: MomentPass
    dvi_sources: frozenset[str]
    dvi_marginal: bool
    dvi_link: str | None
    dvi_logits: MomentTensor | None

    @staticmethod
    def __new__(
        cls,
        mean: Tensor,
        var: Tensor | None = None,
        cov: Tensor | None = None,
        *,
        mode: Mode | Propagation = "diag",
        sources: Iterable[str] = (),
        marginal: bool = False,
        link: str | None = None,
    ) -> MomentTensor:
        """Wrap ``mean`` with its variances (or full covariance) and provenance."""
        mean, var, cov = (
            plain(mean),
            None if var is None else plain(var),
            None if cov is None else plain(cov),
        )
        obj = Tensor._make_subclass(cls, mean.detach(), False)
        if cov is not None:
            var = cov.diagonal(dim1=-2, dim2=-1)
        if var is None:
            raise ValueError("MomentTensor needs `var` or `cov`")
        if var.shape != mean.shape:
            var = var.expand(mean.shape)
        obj.dvi_mean, obj.dvi_var, obj.dvi_cov = mean, var, cov
        how = moment_propagation(mode, " (a MomentTensor carries moments)")
        obj.dvi_mode, obj.dvi_sources, obj.dvi_marginal = how, frozenset(sources), marginal
        obj.dvi_link = link
        obj.dvi_logits = None
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything happens in __new__; Tensor.__init__ takes no arguments

    def __repr__(self) -> str:  # type: ignore[override]  # a summary: no tensor_contents keyword
        kind = "cov" if self.dvi_cov is not None else "var"
        link = f", link={self.dvi_link!r}" if self.dvi_link else ""
        return f"MomentTensor(shape={tuple(self.shape)}, {kind}, mode={self.dvi_mode.name!r}{link})"

    @classmethod
    def __torch_function__(cls, func: _Op, types: Any, args: tuple = (), kwargs: _Kw = None) -> Any:
        """Dispatch ``func`` to its moment rule, answer metadata queries, refuse the rest."""
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        return handler_for(func)(func, *args, **kwargs)

    def gaussian(self, op: str, link: str | None = None) -> Gaussian:
        """The :class:`~lightning_dvi.Gaussian` these moments stand for, as input to ``op``.

        Diag storage for independent units (``diag`` mode, or exactly diagonal in ``full``).
        ``link`` names the link ``op`` integrates (a likelihood): a tensor with that link gives
        the Gaussian of its argument.

        Raises:
            NotImplementedError: in ``full`` mode after a shape op dropped the covariance, or
                on a tensor with another link (see :meth:`check_unlinked`).
        """
        if self.dvi_link != link:
            self.check_unlinked(op)
        if self.dvi_mode.full and self.dvi_marginal:
            raise unsupported(
                f"`{op}` on a tensor whose covariance an earlier shape op dropped",
                "in mode='full' only ops on batch dimensions may come between the layer that "
                "made it and a layer or likelihood (pass the network's output on directly)",
            )
        return self.moments()

    def moments(self) -> Gaussian:
        """The stored moments as a :class:`~lightning_dvi.Gaussian`, whatever they stand for."""
        if self.dvi_cov is not None:
            return Gaussian(self.dvi_mean, cov=self.dvi_cov, validate=False)
        return Gaussian(self.dvi_mean, var=self.dvi_var, validate=False)

    def check_unlinked(self, op: str) -> None:
        """Refuse ``op`` on a tensor that stands for a link (``log_softmax``, ``exp``) of moments."""
        if self.dvi_link is not None:
            raise unsupported(
                f"`{op}` on {self.dvi_link}(network output)",
                f"{self.dvi_link} is integrated only by the "
                f"{_LINK_SITES.get(self.dvi_link, 'likelihood')} it is passed to",
            )

    @classmethod
    def of(cls, g: Gaussian, mode: MomentPass, sources: Iterable[str]) -> MomentTensor:
        """The moment tensor carrying the Gaussian ``g`` (all of its covariance is known)."""
        return cls(g.mean, var=None if g.is_full else g.var, cov=g.cov, mode=mode, sources=sources)


_T = Tensor
# Queries answered from the tensor data (a detached copy of the mean), not moment rules.
_METADATA = {
    *(getattr(_T, n).__get__ for n in ("shape", "dtype", "device", "ndim", "layout", "is_cuda")),
    _T.requires_grad.__get__,  # type: ignore[attr-defined]  # a C property, stubbed as a bool
    *(getattr(_T, n) for n in ("size", "dim", "ndimension", "numel", "nelement", "__len__")),
    *(getattr(_T, n) for n in ("__hash__", "is_floating_point", "is_complex", "get_device")),
}


def is_moment(x: object) -> TypeGuard[MomentTensor]:
    return isinstance(x, MomentTensor)


def new_like(
    like: MomentTensor,
    g: Gaussian,
    sources: frozenset[str] | None = None,
    marginal: bool | None = None,
) -> MomentTensor:
    """The moment tensor carrying ``g``, with the mode, link and (by default) provenance of ``like``."""
    return MomentTensor(
        g.mean,
        None if g.is_full else g.var,
        g.cov,
        mode=like.dvi_mode,
        sources=like.dvi_sources if sources is None else sources,
        marginal=like.dvi_marginal if marginal is None else marginal,
        link=like.dvi_link,
    )


def union_sources(op: str, *xs: object) -> frozenset[str]:
    seen: frozenset[str] = frozenset()
    for x in xs:
        if is_moment(x):
            overlap = seen & x.dvi_sources
            if overlap:
                raise unsupported(
                    f"`{op}` on operands that both depend on weight site(s) {sorted(overlap)}",
                    "their correlation is not tracked (a weight used twice, or a hand-written "
                    "skip connection; use lightning_dvi.nn.Residual in a declared network)",
                )
            seen = seen | x.dvi_sources
    return seen


class SampledTensor(Tensor):
    """A latent drawn once per moment pass (non-Normal prior, or listed in ``sampled_sites``).

    It behaves as an ordinary tensor (one reparameterised sample, as in Trace_ELBO) except that
    it is refused as the weight or bias of a layer: the moment pass integrates weights only when
    their prior and posterior are Normal, and a layer of sampled weights would quietly turn a
    deterministic objective back into a Monte Carlo one.
    """

    @classmethod
    def __torch_function__(cls, func: _Op, types: Any, args: tuple = (), kwargs: _Kw = None) -> Any:
        """Refuse layer ops whose weight is sampled; everything else as for a plain tensor."""
        if func in LAYER_OPS and any(isinstance(a, SampledTensor) for a in args[1:3]):
            raise sampled_weight_error(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def sampled_weight_error(func: Callable[..., Any]) -> NotImplementedError:
    """The error for a layer whose weight or bias is a sampled (non-Normal prior) latent."""
    return unsupported(
        f"`{op_name(func)}` with a weight or bias drawn from a non-Normal prior (or listed in "
        "sampled_sites)",
        "DVI integrates weights with Normal priors only; give the weights Normal priors",
    )


def plain(x: Tensor) -> Tensor:
    """Strip the SampledTensor marker (moments derived from a sample are ordinary numbers)."""
    if not isinstance(x, SampledTensor):
        return x
    with torch._C.DisableTorchFunctionSubclass():
        return x.as_subclass(Tensor)

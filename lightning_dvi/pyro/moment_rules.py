r"""The moment rules of :class:`~lightning_dvi.pyro.moment_tensor.MomentTensor`.

Each rule maps the moments of its inputs to the moments of its output with the closed forms of
:mod:`lightning_dvi.moments` (one implementation of each formula serves every front-end):
shape ops and broadcasting, addition of independent terms, scaling by constants, ``F.linear`` /
``matmul`` (a linear layer with factorised Gaussian weights, through
:func:`lightning_dvi.moments.linear_moments`) and every activation of the registry
(:mod:`lightning_dvi.nn.registry`), through its declared module's own ``propagate``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import moments as M
from ..gaussian import Gaussian, Mode
from ..nn.conv import unsupported_conv2d_options, unsupported_pool2d_options
from ..nn.registry import spec_for_function
from .dispatch import Handler, op_name, register, register_resolver, unsupported
from .moment_tensor import (
    MomentTensor,
    SampledTensor,
    is_moment,
    new_like,
    sampled_weight_error,
    union_sources,
)

__all__ = ["expand_to"]

_T = Tensor


def _only_moment_operand(func: Callable[..., Any], x: Any, *rest: Any) -> None:
    """Refuse ``func`` unless ``x`` is its only moment-carrying operand."""
    if not is_moment(x) or any(is_moment(a) for a in rest):
        raise unsupported(f"`{op_name(func)}` with a moment-carrying tensor as an argument")


# ------------------------------------------------------------------------------- shape ops
_SHAPE_OPS = (
    *(getattr(_T, n) for n in ("expand", "view", "__getitem__", "contiguous", "clone", "t")),
    *(getattr(m, n) for m in (_T, torch) for n in ("reshape", "squeeze", "unsqueeze", "flatten")),
    *(getattr(m, n) for m in (_T, torch) for n in ("permute", "transpose")),
    *(getattr(torch, n) for n in ("t", "clone")),
    _T.mT.__get__,  # type: ignore[attr-defined]  # a C property, stubbed as a Tensor
    _T.T.__get__,  # type: ignore[attr-defined]  # a C property, stubbed as a Tensor
)


@register(*_SHAPE_OPS)
def _shape_op(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    """Gather the moments (:func:`lightning_dvi.moments.reindex_gaussian`).

    In ``full`` mode an op that mixes the last dimension with batch dimensions (or repeats a
    unit of independent ones) keeps only marginals and marks the result ``dvi_marginal``.
    """
    _only_moment_operand(func, x, *args, *kwargs.values())
    full = x.dvi_mode == "full"
    joint = (full or x.dvi_cov is not None) and not x.dvi_marginal  # diag mode: a head's cov
    g, exact = M.reindex_gaussian(x.moments(), func, *args, joint=joint, **kwargs)
    return new_like(x, g, marginal=full and not exact)


@register(_T.expand_as, _T.reshape_as, _T.view_as)
def _shape_as(func: Callable[..., Any], x: Any, other: Any) -> MomentTensor:
    to: dict[Any, Handler] = {
        _T.expand_as: _T.expand,
        _T.reshape_as: _T.reshape,
        _T.view_as: _T.view,
    }
    return _shape_op(to[func], x, tuple(other.shape))


def expand_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Broadcast ``x`` (moment tensor or not) to ``shape``."""
    return x if tuple(x.shape) == tuple(shape) else x.expand(shape)


@register(torch.broadcast_tensors)
def _broadcast_tensors(func: Callable[..., Any], *tensors: Tensor) -> tuple[Tensor, ...]:
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(expand_to(t, shape) for t in tensors)


@register(_T.to, _T.float, _T.double, _T.type_as)
def _cast(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    _only_moment_operand(func, x, *args, *kwargs.values())
    cov = None if x.dvi_cov is None else func(x.dvi_cov, *args, **kwargs)
    var = None if cov is not None else func(x.dvi_var, *args, **kwargs)
    return new_like(x, Gaussian(func(x.dvi_mean, *args, **kwargs), cov, var, validate=False))


# ------------------------------------------------------------------------------ arithmetic
# Sums and constant factors of independent moments: lightning_dvi.moments.algebra. Operands are
# broadcast first by the shape rule above, which keeps the covariance or marks marginals.
def _add_moments(op: str, a: Any, b: Any) -> MomentTensor:
    for t in (a, b):
        if is_moment(t):
            t.check_unlinked(op)
    sources = union_sources(op, a, b)
    like = a if is_moment(a) else b
    a, b = (
        t if isinstance(t, Tensor) else torch.as_tensor(t, dtype=like.dtype, device=like.device)
        for t in (a, b)
    )
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = expand_to(a, shape), expand_to(b, shape)
    marginal = like.dvi_mode == "full" and any(is_moment(t) and t.dvi_marginal for t in (a, b))
    marginals_only = like.dvi_mode == "diag" or marginal
    a, b = (
        (t.moments().to_diag() if marginals_only else t.moments()) if is_moment(t) else t
        for t in (a, b)
    )
    return new_like(like, M.add_independent(a, b), sources=sources, marginal=marginal)


def _scale_moments(x: MomentTensor, c: Tensor | float, op: str) -> MomentTensor:
    x.check_unlinked(op)
    c = torch.as_tensor(c)
    x = cast(MomentTensor, expand_to(x, torch.broadcast_shapes(x.shape, c.shape)))
    return new_like(x, M.scale_gaussian(x.moments(), c))


@register(_T.__add__, _T.__radd__, _T.add, torch.add)
def _add(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if alpha != 1:
        b = _scale_moments(b, alpha, "scaling") if is_moment(b) else b * alpha
    return _add_moments(op_name(func), a, b)


@register(_T.__sub__, _T.sub, torch.sub)
def _sub(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if isinstance(b, _LogSumExp):  # logits - logits.logsumexp(-1, keepdim=True): Categorical
        return b.normalise(a, alpha)
    b = _scale_moments(b, -1.0, "negation") if is_moment(b) else -torch.as_tensor(b)
    return _add(func, a, b, alpha=alpha)


@register(_T.__rsub__)
def _rsub(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    return _add_moments(op_name(func), _scale_moments(a, -1.0, "negation"), b)  # b - a


@register(_T.__neg__, _T.neg, torch.neg)
def _neg_op(func: Callable[..., Any], x: MomentTensor) -> MomentTensor:
    return _scale_moments(x, -1.0, "negation")


@register(_T.__mul__, _T.__rmul__, _T.mul, torch.mul)
def _mul(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    if is_moment(a) and is_moment(b):
        raise unsupported(f"`{op_name(func)}` of two moment-carrying tensors", "not Gaussian")
    return _scale_moments(a, b, "scaling") if is_moment(a) else _scale_moments(b, a, "scaling")


@register(_T.__truediv__, _T.div, torch.div)
def _div(func: Callable[..., Any], a: Any, b: Any, **kwargs: Any) -> MomentTensor:
    if is_moment(b) or kwargs:
        raise unsupported(f"`{op_name(func)}` by a moment-carrying tensor or with rounding")
    return _scale_moments(a, 1.0 / torch.as_tensor(b), "scaling")


# ------------------------------------------------------------------ layers with weights
def _param_moments(p: Any) -> tuple[Tensor, Tensor | None]:
    if p is None or not is_moment(p):
        return p, None
    if p.dvi_cov is not None:
        raise unsupported("a weight argument with a full covariance", "weights must be factorised")
    return p.dvi_mean, p.dvi_var


#: In ``diag`` mode, a linear layer of at most this many outputs fed a moment tensor keeps the
#: exact covariance of its outputs (:func:`lightning_dvi.moments.linear_full_from_diag`; the
#: outputs share their inputs, so they are correlated even when the inputs are independent).
#: A likelihood reading the network output then sees it (for a softmax it matters: dropping it
#: made a digits classifier's loss 7 % optimistic); the next activation or layer drops it again.
HEAD_WIDTH = 16


def _layer(
    func: Callable[..., Any],
    x: Any,
    weight: Any,
    bias: Any,
    moments: Any,
    head: Literal["linear", "matmul"] | None = None,
) -> MomentTensor:
    """Convert the operands to (weight moments, input moments) and call ``moments`` on them.

    ``moments(h, w_loc, w_var, b_loc, b_var, *, mode) -> Gaussian`` is a function of
    :mod:`lightning_dvi.moments.layers`; a deterministic weight has zero variance. ``head``: the
    layout of a dense layer's weight (``[out, in]`` for ``F.linear``, ``[in, out]`` for
    ``matmul``), whose outputs keep their covariance in ``diag`` mode up to :data:`HEAD_WIDTH`.
    """
    if isinstance(weight, SampledTensor) or isinstance(bias, SampledTensor):
        raise sampled_weight_error(func)
    op = op_name(func)
    sources = union_sources(op, x, weight, bias)
    mode = next(t for t in (weight, x, bias) if is_moment(t)).dvi_mode
    w_mean, w_var = _param_moments(weight)
    b_mean, b_var = _param_moments(bias)
    w_var = torch.zeros_like(w_mean) if w_var is None else w_var
    h = x.gaussian(op) if is_moment(x) else x
    dense = None if head is None else (w_mean if head == "linear" else w_mean.mT)  # [out, in]
    if dense is not None and mode == "diag" and is_moment(x) and dense.shape[0] <= HEAD_WIDTH:
        if h.cov is not None:  # correlated inputs (a head fed a head): the general full form
            out = moments(h, w_mean, w_var, b_mean, b_var, mode="full")
        else:
            out = _with_head_covariance(
                moments(h, w_mean, w_var, b_mean, b_var, mode=mode), h, dense
            )
        return MomentTensor.of(out, mode, sources)
    return MomentTensor.of(moments(h, w_mean, w_var, b_mean, b_var, mode=mode), mode, sources)


def _with_head_covariance(out: Gaussian, h: Gaussian, m: Tensor) -> Gaussian:
    r"""``out`` (diag) with the covariances of a dense layer's outputs on independent inputs.

    :math:`\operatorname{Cov}(a_k, a_l) = \sum_d M_{kd}M_{ld}\,v_d` for :math:`k \ne l` (the
    off-diagonal of :func:`lightning_dvi.moments.linear_full_from_diag`'s
    :math:`M\operatorname{diag}(v)M^\top`; its diagonal is ``out``'s exact variances), evaluated
    as one ``[B, D] x [D, K^2]`` product: forward and backward about 6x faster than the
    per-example ``[K, D] x [D, K]`` products at ``B = 1401, D = 64, K = 10`` (one CPU thread).
    ``m``: the mean weights ``[K, D]``.
    """
    k, d = m.shape
    pairs = (m.mT.unsqueeze(-1) * m.mT.unsqueeze(-2)).reshape(d, k * k)
    cross = (h.var @ pairs).reshape(*h.var.shape[:-1], k, k)
    off = cross - torch.diag_embed(cross.diagonal(dim1=-2, dim2=-1))
    return Gaussian(out.mean, cov=off + torch.diag_embed(out.var), validate=False)


@register(F.linear)
def _linear(func: Callable[..., Any], x: Any, weight: Any, bias: Any = None) -> MomentTensor:
    return _layer(func, x, weight, bias, M.linear_moments, head="linear")


@register(torch.matmul, _T.matmul, _T.__matmul__)
def _matmul(func: Callable[..., Any], x: Any, weight: Any) -> MomentTensor:
    """``x @ w`` with an ``[in, out]`` matrix ``w``: the linear layer of ``w.mT``."""
    if weight.dim() != 2 or (is_moment(weight) and weight.dvi_cov is not None):
        raise unsupported(f"`{op_name(func)}` unless the right operand is a [in, out] matrix")

    def moments(h: Any, w_loc: Tensor, w_var: Tensor, *bias: Any, mode: Mode) -> Gaussian:
        return M.linear_moments(h, w_loc.mT, w_var.mT, *bias, mode=mode)

    return _layer(func, x, weight, None, moments, head="matmul")


@register(F.conv2d)
def _conv2d(
    func: Callable[..., Any], x: Any, weight: Any, bias: Any = None, stride: Any = 1,
    padding: Any = 0, dilation: Any = 1, groups: int = 1,
) -> MomentTensor:  # fmt: skip
    """``PyroModule[nn.Conv2d]``: diag moments (:func:`lightning_dvi.moments.conv2d_moments`)."""
    required = unsupported_conv2d_options(groups, dilation, padding)
    if required is not None:
        raise unsupported(f"`{op_name(func)}`", f"only {required}")

    def moments(h: Any, *weights: Any, mode: Mode) -> Gaussian:
        if mode != "diag":
            raise unsupported(
                f"`{op_name(func)}` in mode='full'", "convolutions propagate diag moments"
            )
        return M.conv2d_moments(h, *weights, stride=stride, padding=padding)

    return _layer(func, x, weight, bias, moments)


@register(F.avg_pool2d)
def _avg_pool2d(
    func: Callable[..., Any], x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
    ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None,
) -> MomentTensor:  # fmt: skip
    """``nn.AvgPool2d`` on independent units: exact diag moments."""
    op = op_name(func)
    required = unsupported_pool2d_options(padding, ceil_mode, divisor_override=divisor_override)
    if required is not None:
        raise unsupported(f"`{op}`", f"only {required}")
    h = x.gaussian(op)
    stride = kernel_size if stride in (None, []) else stride
    mean, var = M.avg_pool2d_diag(h.mean, h.var, kernel_size, stride)
    return MomentTensor(mean, var=var, mode=x.dvi_mode, sources=x.dvi_sources)


def _out_of_place(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``torch.relu`` for ``torch.relu_`` (and the ``Tensor`` and ``F`` variants), else ``None``."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    for owner in (torch, _T, F):
        if getattr(owner, name, None) is func:
            return cast(Callable[..., Any] | None, getattr(owner, name[:-1], None))
    return None


def _registered_activation(func: Callable[..., Any]) -> Handler | None:
    """The rule for a torch function that a declared activation stands for (else ``None``).

    In-place forms (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``,
    TyXe's and torchvision's idiom) have the moments of the out-of-place op and update the
    moment tensor they were given, as the in-place op updates its input.
    """
    spec = spec_for_function(func)
    variant = spec is None
    if spec is None:
        base = _out_of_place(func)
        spec = None if base is None else spec_for_function(base)
        if spec is None:
            return None
    if spec.kind != "activation":  # shape ops and pools registered for from_torch have own rules
        return None
    found = spec

    def activation(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
        op = op_name(func)
        inplace = bool(kwargs.pop("inplace", False)) or variant
        _only_moment_operand(func, x, *args, *kwargs.values())
        module = found.build_from_call(*args, **kwargs)
        out = module.propagate(x.gaussian(op), x.dvi_mode)
        result = MomentTensor.of(cast(Gaussian, out), x.dvi_mode, x.dvi_sources)  # Gaussian in
        if not inplace:
            return result
        x.dvi_mean, x.dvi_var, x.dvi_cov = result.dvi_mean, result.dvi_var, result.dvi_cov
        x.dvi_marginal = False
        return cast(MomentTensor, x)

    return activation


register_resolver(_registered_activation)


# ------------------------------------------------------------------- likelihood links
# log_softmax of logits (dist.Categorical normalises its logits) and exp of a log-rate
# (dist.Poisson(rate=f.exp())) are not Gaussian: the result stands for link(a) (``dvi_link``),
# passes through shape ops only, and the likelihood site integrates it (pyro.messenger).
def _link(func: Callable[..., Any], x: Any, link: str) -> MomentTensor:
    _only_moment_operand(func, x)
    x.check_unlinked(op_name(func))
    out = new_like(x, x.moments())
    out.dvi_link = link
    return out


@register(torch.exp, _T.exp)
def _exp_link(func: Callable[..., Any], x: Any) -> MomentTensor:
    """``exp(f)``: stands for the log-normal rate of ``dist.Poisson(rate=f.exp())``."""
    return _link(func, x, "exp")


# F.softplus is a registered activation (lightning_dvi.nn.Softplus); a network-dependent Normal
# scale built from it is refused at the observed site instead (messenger._normal).
@register(torch.sqrt, _T.sqrt)
def _positive_link(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    raise unsupported(
        f"`{op_name(func)}` on a moment-carrying tensor",
        "a count rate is dist.Poisson(rate=f.exp()); for a learned observation noise, let the "
        "network output (mean, log variance) and observe with "
        "lightning_dvi.pyro.HeteroscedasticGaussian(outputs) instead of "
        "dist.Normal(mean, exp/softplus(...)): its expected log-likelihood is in closed form",
    )


def _last_dim(func: Callable[..., Any], x: Any, dim: Any) -> None:
    if dim not in (-1, x.dim() - 1):
        raise unsupported(f"`{op_name(func)}` over dim={dim!r}", "only the last (class) dimension")


@register(F.log_softmax, _T.log_softmax, torch.log_softmax)
def _log_softmax(
    func: Callable[..., Any], x: Any, dim: Any = None, *args: Any, **kw: Any
) -> MomentTensor:
    _last_dim(func, x, kw.pop("dim", dim))
    if x.dvi_link == "log_softmax":
        return cast(MomentTensor, x)
    return _link(func, x, "log_softmax")


class _LogSumExp(MomentTensor):
    """``x.logsumexp(-1, keepdim=True)``, only ever subtracted from ``x`` (Categorical's init)."""

    dvi_of: MomentTensor

    def normalise(self, a: Any, alpha: float) -> MomentTensor:
        if a is not self.dvi_of or alpha != 1:
            raise unsupported("`logsumexp` of moments other than in logits - logits.logsumexp(-1)")
        return a if a.dvi_link == "log_softmax" else _link(_T.logsumexp, a, "log_softmax")


@register(torch.logsumexp, _T.logsumexp)
def _logsumexp(func: Callable[..., Any], x: Any, dim: Any, keepdim: bool = False) -> _LogSumExp:
    _last_dim(func, x, dim)
    if not keepdim:
        raise unsupported(
            "`logsumexp(keepdim=False)` of moments", "pass the logits to dist.Categorical"
        )
    with torch.no_grad():
        mean = x.dvi_mean.logsumexp(-1, keepdim=True)
    lse = _LogSumExp(mean, torch.zeros_like(mean), mode=x.dvi_mode, link="logsumexp")
    lse.dvi_of = x
    return lse

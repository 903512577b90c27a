r"""The moment rules of :class:`~lightning_dvi.pyro.moment_tensor.MomentTensor`.

Each rule maps the moments of its inputs to the moments of its output with the closed forms of
:mod:`lightning_dvi.moments` (one implementation of each formula serves every front-end):
shape ops and broadcasting, addition of independent terms, scaling by constants, ``F.linear`` /
``matmul`` (a linear layer with factorised Gaussian weights, through
:func:`lightning_dvi.moments.linear_moments`) and every activation of the registry
(:mod:`lightning_dvi.nn.registry`), through its declared module's own ``propagate``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import moments as M
from ..gaussian import Gaussian
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


# ------------------------------------------------------------------------------- shape ops
def _probe_gather(
    func: Callable[..., Any], x: MomentTensor, args: tuple, kwargs: dict
) -> MomentTensor:
    """Apply a shape op to a full-mode moment tensor, keeping exactly what it can.

    The op is applied to two index probes (source row and source column of every element). If
    each output row comes from one source row, the covariance is gathered exactly; otherwise
    the output's last dimension mixes data rows and only marginals survive.
    """
    mean = func(x.dvi_mean, *args, **kwargs)
    var = func(x.dvi_var, *args, **kwargs)
    if x.dim() == 0 or x.dvi_marginal:
        return new_like(x, mean, var, marginal=True)
    batch, d = x.shape[:-1], x.shape[-1]
    n = math.prod(batch)
    rows = torch.arange(n, device=x.device).reshape(*batch, 1).expand(*batch, d)
    cols = torch.arange(d, device=x.device).expand(*batch, d)
    r, c = func(rows, *args, **kwargs), func(cols, *args, **kwargs)
    if r.dim() == 0 or not bool((r == r[..., :1]).all()):
        return new_like(x, mean, var, marginal=True)
    if x.dvi_cov is None:
        # Independent units stay independent only if no unit is duplicated within a row.
        distinct = c.shape[-1] <= 1 or bool((c.sort(-1).values.diff(dim=-1) > 0).all())
        return new_like(x, mean, var, marginal=not distinct)
    out_d = c.shape[-1]
    cov = x.dvi_cov.reshape(n, d, d)[r[..., 0]]
    cov = cov.gather(-2, c.unsqueeze(-1).expand(*c.shape, d))
    cov = cov.gather(-1, c.unsqueeze(-2).expand(*c.shape[:-1], out_d, out_d))
    return new_like(x, mean, cov=cov)


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
    if not is_moment(x) or any(is_moment(a) for a in (*args, *kwargs.values())):
        raise unsupported(f"`{op_name(func)}` with a moment-carrying tensor as an argument")
    if x.dvi_mode == "diag":
        return new_like(x, func(x.dvi_mean, *args, **kwargs), func(x.dvi_var, *args, **kwargs))
    return _probe_gather(func, x, args, kwargs)


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
    if not is_moment(x) or any(is_moment(a) for a in args):
        raise unsupported(f"`{op_name(func)}` with a moment-carrying tensor as an argument")
    cov = None if x.dvi_cov is None else func(x.dvi_cov, *args, **kwargs)
    return new_like(x, func(x.dvi_mean, *args, **kwargs), func(x.dvi_var, *args, **kwargs), cov)


# ------------------------------------------------------------------------------ arithmetic
def _needs_full_input(op: str, x: MomentTensor) -> Tensor:
    """The full covariance of a full-mode input (exactly diagonal for independent units)."""
    return M.skip_covariance(x.gaussian(op))


def _as_tensor(x: Any, like: MomentTensor) -> Any:
    if isinstance(x, Tensor):
        return x
    return torch.as_tensor(x, dtype=like.dvi_mean.dtype, device=like.dvi_mean.device)


def _add_moments(op: str, a: Any, b: Any) -> MomentTensor:
    for t in (a, b):
        if is_moment(t):
            t.check_unlinked(op)
    sources = union_sources(op, a, b)
    like = a if is_moment(a) else b
    a, b = _as_tensor(a, like), _as_tensor(b, like)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = expand_to(a, shape), expand_to(b, shape)
    if not (is_moment(a) and is_moment(b)):
        x, c = (a, b) if is_moment(a) else (b, a)
        return new_like(x, x.dvi_mean + c, x.dvi_var, x.dvi_cov)
    mean = a.dvi_mean + b.dvi_mean
    if like.dvi_mode == "diag" or a.dvi_marginal or b.dvi_marginal:
        return new_like(
            like, mean, a.dvi_var + b.dvi_var, sources=sources, marginal=like.dvi_mode == "full"
        )
    if a.dvi_cov is None and b.dvi_cov is None:
        return new_like(like, mean, a.dvi_var + b.dvi_var, sources=sources)
    cov = _needs_full_input(op, a) + _needs_full_input(op, b)
    return new_like(like, mean, cov=cov, sources=sources, marginal=False)


def _scale_moments(x: MomentTensor, c: Tensor | float) -> MomentTensor:
    x.check_unlinked("scaling")
    c = torch.as_tensor(c, dtype=x.dvi_mean.dtype, device=x.dvi_mean.device)
    shape = torch.broadcast_shapes(x.shape, c.shape)
    x, c = expand_to(x, shape), c.expand(shape)  # type: ignore[assignment]  # expanding keeps a MomentTensor
    cov = None if x.dvi_cov is None else x.dvi_cov * c.unsqueeze(-1) * c.unsqueeze(-2)
    return new_like(x, x.dvi_mean * c, x.dvi_var * c * c, cov)


def _neg(x: MomentTensor) -> MomentTensor:
    x.check_unlinked("negation")
    return new_like(x, -x.dvi_mean, x.dvi_var, x.dvi_cov)


@register(_T.__add__, _T.__radd__, _T.add, torch.add)
def _add(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if alpha != 1:
        b = _scale_moments(b, alpha) if is_moment(b) else b * alpha
    return _add_moments(op_name(func), a, b)


@register(_T.__sub__, _T.sub, torch.sub)
def _sub(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if isinstance(b, _LogSumExp):  # logits - logits.logsumexp(-1, keepdim=True): Categorical
        return b.normalise(a, alpha)
    b = _neg(b) if is_moment(b) else -torch.as_tensor(b)
    return _add(func, a, b, alpha=alpha)


@register(_T.__rsub__)
def _rsub(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    return _add_moments(op_name(func), _neg(a), b)  # b - a


@register(_T.__neg__, _T.neg, torch.neg)
def _neg_op(func: Callable[..., Any], x: MomentTensor) -> MomentTensor:
    return _neg(x)


@register(_T.__mul__, _T.__rmul__, _T.mul, torch.mul)
def _mul(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    if is_moment(a) and is_moment(b):
        raise unsupported(f"`{op_name(func)}` of two moment-carrying tensors", "not Gaussian")
    return _scale_moments(a, b) if is_moment(a) else _scale_moments(b, a)


@register(_T.__truediv__, _T.div, torch.div)
def _div(func: Callable[..., Any], a: Any, b: Any, **kwargs: Any) -> MomentTensor:
    if is_moment(b) or kwargs:
        raise unsupported(f"`{op_name(func)}` by a moment-carrying tensor or with rounding")
    return _scale_moments(a, 1.0 / torch.as_tensor(b))


# ---------------------------------------------------------------------------- linear, relu
def _param_moments(p: Any) -> tuple[Tensor, Tensor | None]:
    if p is None or not is_moment(p):
        return p, None
    if p.dvi_cov is not None:
        raise unsupported("a weight argument with a full covariance", "weights must be factorised")
    return p.dvi_mean, p.dvi_var


def _linear_core(op: Any, x: Any, weight: Any, bias: Any, transpose: bool) -> MomentTensor:
    if isinstance(weight, SampledTensor) or isinstance(bias, SampledTensor):
        raise sampled_weight_error(op)
    op = op_name(op)
    sources = union_sources(op, x, weight, bias)
    like: MomentTensor = next(t for t in (weight, x, bias) if is_moment(t))
    w_mean, w_var = _param_moments(weight)
    if transpose:
        w_mean = w_mean.transpose(-1, -2)
        w_var = None if w_var is None else w_var.transpose(-1, -2)
    if w_var is None:
        w_var = torch.zeros_like(w_mean)
    b_mean, b_var = _param_moments(bias)
    h = x.gaussian(op) if is_moment(x) else x
    out = M.linear_moments(h, w_mean, w_var, b_mean, b_var, mode=like.dvi_mode)
    return MomentTensor.of(out, like.dvi_mode, sources)


@register(F.linear)
def _linear(func: Callable[..., Any], x: Any, weight: Any, bias: Any = None) -> MomentTensor:
    return _linear_core(func, x, weight, bias, transpose=False)


@register(torch.matmul, _T.matmul, _T.__matmul__)
def _matmul(func: Callable[..., Any], x: Any, weight: Any) -> MomentTensor:
    if weight.dim() != 2 or (is_moment(weight) and weight.dvi_cov is not None):
        raise unsupported(f"`{op_name(func)}` unless the right operand is a [in, out] matrix")
    return _linear_core(func, x, weight, None, transpose=True)


@register(F.conv2d)
def _conv2d(
    func: Callable[..., Any],
    x: Any,
    weight: Any,
    bias: Any = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> MomentTensor:
    """``PyroModule[nn.Conv2d]``: diag moments through :mod:`lightning_dvi.moments.conv`."""
    op = op_name(func)
    if isinstance(weight, SampledTensor) or isinstance(bias, SampledTensor):
        raise sampled_weight_error(func)
    if groups != 1 or isinstance(padding, str) or dilation not in (1, (1, 1)):
        raise unsupported(f"`{op}` with groups, dilation or string padding")
    sources = union_sources(op, x, weight, bias)
    like: MomentTensor = next(t for t in (weight, x, bias) if is_moment(t))
    if like.dvi_mode != "diag":
        raise unsupported(f"`{op}` in mode='full'", "convolutions propagate diag moments")
    w_mean, w_var = _param_moments(weight)
    w_var = torch.zeros_like(w_mean) if w_var is None else w_var
    b_mean, b_var = _param_moments(bias)
    if is_moment(x):
        h = x.gaussian(op)
        mean, var = M.conv2d_diag(h.mean, h.var, w_mean, w_var, b_mean, b_var, stride, padding)
    else:
        mean, var = M.conv2d_deterministic(x, w_mean, w_var, b_mean, b_var, stride, padding)
    return MomentTensor(mean, var=var, mode="diag", sources=sources)


@register(F.avg_pool2d)
def _avg_pool2d(
    func: Callable[..., Any], x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
    ceil_mode: bool = False, count_include_pad: bool = True, divisor_override: Any = None,
) -> MomentTensor:  # fmt: skip
    """``nn.AvgPool2d`` on independent units: exact diag moments."""
    op = op_name(func)
    if padding not in (0, (0, 0)) or ceil_mode or divisor_override is not None:
        raise unsupported(f"`{op}` with padding, ceil_mode or divisor_override")
    h = x.gaussian(op)
    stride = kernel_size if stride in (None, []) else stride
    mean, var = M.avg_pool2d_diag(h.mean, h.var, kernel_size, stride)
    return MomentTensor(mean, var=var, mode=x.dvi_mode, sources=x.dvi_sources)


def _registered_activation(func: Callable[..., Any]) -> Handler | None:
    """The rule for a torch function that a declared activation stands for (else ``None``)."""
    spec = spec_for_function(func)
    if spec is None:
        return None

    def activation(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
        op = op_name(func)
        if kwargs.pop("inplace", False):
            raise unsupported(f"in-place `{op}`", "use f(x), not f_(x) or inplace=True")
        if not is_moment(x) or any(is_moment(a) for a in (*args, *kwargs.values())):
            raise unsupported(f"`{op}` with a moment-carrying tensor as an argument")
        module = spec.build_from_call(*args, **kwargs)
        out = module.propagate(x.gaussian(op), x.dvi_mode)
        return MomentTensor.of(cast(Gaussian, out), x.dvi_mode, x.dvi_sources)  # Gaussian in

    return activation


register_resolver(_registered_activation)


# ------------------------------------------------------------------- likelihood links
# log_softmax of logits (dist.Categorical normalises its logits) is not Gaussian: the result
# stands for log_softmax(a) (``dvi_link``), passes through shape ops only, and the Categorical
# site integrates it (lightning_dvi.pyro.messenger).
def _link(func: Callable[..., Any], x: Any, link: str) -> MomentTensor:
    if not is_moment(x):
        raise unsupported(f"`{op_name(func)}` with a moment-carrying tensor as an argument")
    x.check_unlinked(op_name(func))
    out = new_like(x, x.dvi_mean, x.dvi_var, x.dvi_cov)
    out.dvi_link = link
    return out


@register(torch.exp, _T.exp, F.softplus, torch.sqrt, _T.sqrt)
def _positive_link(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    raise unsupported(
        f"`{op_name(func)}` on a moment-carrying tensor",
        "for a learned observation noise, let the network output (mean, log variance) and "
        "observe with lightning_dvi.pyro.HeteroscedasticGaussian(outputs) instead of "
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

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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import resolve_name

from .. import moments as M

__all__ = ["MomentTensor", "unsupported"]

_Handler = Callable[..., Any]
_HANDLERS: dict[Callable[..., Any], _Handler] = {}
_HINT = (
    "The DVI moment pass propagates (mean, variance) only through F.linear / nn.Linear, "
    "matmul, relu, addition, scaling by constants and shape ops. Rewrite the model with these "
    "(or with lightning_dvi.nn modules), or train it with pyro.infer.Trace_ELBO."
)


def unsupported(what: str, detail: str = "") -> NotImplementedError:
    """The error raised for anything the moment pass cannot do exactly."""
    text = f"{what} is not supported in a DVI moment pass"
    return NotImplementedError(f"{text}{': ' + detail if detail else ''}. {_HINT}")


class MomentTensor(Tensor):
    """Gaussian moments disguised as a tensor (the tensor data is a detached copy of the mean).

    Attributes:
        dvi_mean: mean (differentiable).
        dvi_var: per-element variances (always set; the diagonal of ``dvi_cov`` in full storage).
        dvi_cov: full covariance over the last dimension ``[..., D, D]`` or ``None``.
        dvi_mode: ``"diag"`` or ``"full"``, the guide's mode.
        dvi_sources: names of the weight sites this tensor depends on.
        dvi_marginal: in full mode, whether only marginals are known (covariance dropped).
    """

    dvi_mean: Tensor
    dvi_var: Tensor
    dvi_cov: Tensor | None
    dvi_mode: str
    dvi_sources: frozenset[str]
    dvi_marginal: bool

    @staticmethod
    def __new__(
        cls,
        mean: Tensor,
        var: Tensor | None = None,
        cov: Tensor | None = None,
        *,
        mode: str = "diag",
        sources: Iterable[str] = (),
        marginal: bool = False,
    ) -> MomentTensor:
        """Wrap ``mean`` with its variances (or full covariance) and provenance."""
        obj = Tensor._make_subclass(cls, mean.detach(), False)
        if cov is not None:
            var = cov.diagonal(dim1=-2, dim2=-1)
        if var is None:
            raise ValueError("MomentTensor needs `var` or `cov`")
        if var.shape != mean.shape:
            var = var.expand(mean.shape)
        obj.dvi_mean, obj.dvi_var, obj.dvi_cov = mean, var, cov
        obj.dvi_mode, obj.dvi_sources, obj.dvi_marginal = mode, frozenset(sources), marginal
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass  # everything happens in __new__; Tensor.__init__ takes no arguments

    def __repr__(self) -> str:
        kind = "cov" if self.dvi_cov is not None else "var"
        return f"MomentTensor(shape={tuple(self.shape)}, {kind}, mode={self.dvi_mode!r})"

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Iterable[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Dispatch ``func`` to its moment rule, answer metadata queries, refuse the rest."""
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        handler = _HANDLERS.get(func)
        if handler is None:
            raise unsupported(f"`{_name(func)}` on a moment-carrying tensor")
        return handler(func, *args, **kwargs)


def _name(func: Callable[..., Any]) -> str:
    try:
        return resolve_name(func) or repr(func)
    except Exception:  # pragma: no cover - resolve_name is best effort
        return repr(func)


_T = Tensor
_METADATA = {
    _T.shape.__get__,  # type: ignore[attr-defined]
    _T.dtype.__get__,  # type: ignore[attr-defined]
    _T.device.__get__,  # type: ignore[attr-defined]
    _T.ndim.__get__,  # type: ignore[attr-defined]
    _T.layout.__get__,  # type: ignore[attr-defined]
    _T.is_cuda.__get__,  # type: ignore[attr-defined]
    _T.requires_grad.__get__,  # type: ignore[attr-defined]
    _T.size,
    _T.dim,
    _T.ndimension,
    _T.numel,
    _T.nelement,
    _T.__len__,
    _T.__hash__,
    _T.is_floating_point,
    _T.is_complex,
    _T.get_device,
}


def _register(*funcs: Callable[..., Any]) -> Callable[[_Handler], _Handler]:
    def deco(handler: _Handler) -> _Handler:
        for f in funcs:
            _HANDLERS[f] = handler
        return handler

    return deco


def _is_mt(x: object) -> bool:
    return isinstance(x, MomentTensor)


def _new(
    like: MomentTensor,
    mean: Tensor,
    var: Tensor | None = None,
    cov: Tensor | None = None,
    sources: frozenset[str] | None = None,
    marginal: bool | None = None,
) -> MomentTensor:
    return MomentTensor(
        mean,
        var,
        cov,
        mode=like.dvi_mode,
        sources=like.dvi_sources if sources is None else sources,
        marginal=like.dvi_marginal if marginal is None else marginal,
    )


def _union_sources(op: str, *xs: object) -> frozenset[str]:
    seen: frozenset[str] = frozenset()
    for x in xs:
        if _is_mt(x):
            overlap = seen & x.dvi_sources  # type: ignore[union-attr]
            if overlap:
                raise unsupported(
                    f"`{op}` on operands that both depend on weight site(s) {sorted(overlap)}",
                    "their correlation is not tracked (a weight used twice, or a hand-written "
                    "skip connection; use lightning_dvi.nn.Residual in a declared network)",
                )
            seen = seen | x.dvi_sources  # type: ignore[union-attr]
    return seen


# ------------------------------------------------------------------------------- shape ops
def _probe_gather(func: Callable[..., Any], x: MomentTensor, args: tuple, kwargs: dict) -> Any:
    """Apply a shape op to a full-mode moment tensor, keeping exactly what it can.

    The op is applied to two index probes (source row and source column of every element). If
    each output row comes from one source row, the covariance is gathered exactly; otherwise
    the output's last dimension mixes data rows and only marginals survive.
    """
    mean = func(x.dvi_mean, *args, **kwargs)
    var = func(x.dvi_var, *args, **kwargs)
    if x.dim() == 0 or x.dvi_marginal:
        return _new(x, mean, var, marginal=True)
    batch, d = x.shape[:-1], x.shape[-1]
    n = math.prod(batch)
    rows = torch.arange(n, device=x.device).reshape(*batch, 1).expand(*batch, d)
    cols = torch.arange(d, device=x.device).expand(*batch, d)
    r, c = func(rows, *args, **kwargs), func(cols, *args, **kwargs)
    if r.dim() == 0 or not bool((r == r[..., :1]).all()):
        return _new(x, mean, var, marginal=True)
    if x.dvi_cov is None:
        # Independent units stay independent only if no unit is duplicated within a row.
        distinct = c.shape[-1] <= 1 or bool((c.sort(-1).values.diff(dim=-1) > 0).all())
        return _new(x, mean, var, marginal=not distinct)
    out_d = c.shape[-1]
    cov = x.dvi_cov.reshape(n, d, d)[r[..., 0]]
    cov = cov.gather(-2, c.unsqueeze(-1).expand(*c.shape, d))
    cov = cov.gather(-1, c.unsqueeze(-2).expand(*c.shape[:-1], out_d, out_d))
    return _new(x, mean, cov=cov)


_SHAPE_OPS = (
    _T.expand,
    _T.reshape,
    torch.reshape,
    _T.view,
    _T.squeeze,
    torch.squeeze,
    _T.unsqueeze,
    torch.unsqueeze,
    _T.__getitem__,
    _T.flatten,
    torch.flatten,
    _T.permute,
    torch.permute,
    _T.transpose,
    torch.transpose,
    _T.t,
    torch.t,
    _T.mT.__get__,  # type: ignore[attr-defined]
    _T.T.__get__,  # type: ignore[attr-defined]
    _T.contiguous,
    _T.clone,
    torch.clone,
)


@_register(*_SHAPE_OPS)
def _shape_op(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    if not _is_mt(x) or any(_is_mt(a) for a in (*args, *kwargs.values())):
        raise unsupported(f"`{_name(func)}` with a moment-carrying tensor as an argument")
    if x.dvi_mode == "diag":
        return _new(x, func(x.dvi_mean, *args, **kwargs), func(x.dvi_var, *args, **kwargs))
    return _probe_gather(func, x, args, kwargs)


@_register(_T.expand_as, _T.reshape_as, _T.view_as)
def _shape_as(func: Callable[..., Any], x: Any, other: Any) -> MomentTensor:
    target = {_T.expand_as: _T.expand, _T.reshape_as: _T.reshape, _T.view_as: _T.view}[func]
    return _shape_op(target, x, tuple(other.shape))


def expand_to(x: Tensor, shape: torch.Size) -> Tensor:
    """Broadcast ``x`` (moment tensor or not) to ``shape``."""
    return x if tuple(x.shape) == tuple(shape) else x.expand(shape)


@_register(torch.broadcast_tensors)
def _broadcast_tensors(func: Callable[..., Any], *tensors: Tensor) -> tuple[Tensor, ...]:
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(expand_to(t, shape) for t in tensors)


@_register(_T.to, _T.float, _T.double, _T.type_as)
def _cast(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    if not _is_mt(x) or any(_is_mt(a) for a in args):
        raise unsupported(f"`{_name(func)}` with a moment-carrying tensor as an argument")
    cov = None if x.dvi_cov is None else func(x.dvi_cov, *args, **kwargs)
    return _new(x, func(x.dvi_mean, *args, **kwargs), func(x.dvi_var, *args, **kwargs), cov)


# ------------------------------------------------------------------------------ arithmetic
def _needs_full_input(op: str, x: MomentTensor) -> Tensor:
    """The full covariance of a full-mode layer input (exactly diagonal for independent units)."""
    if x.dvi_cov is not None:
        return x.dvi_cov
    if x.dvi_marginal:
        raise unsupported(
            f"`{op}` on a tensor whose covariance an earlier shape op dropped",
            "in mode='full' only ops on batch dimensions may precede a layer",
        )
    return torch.diag_embed(x.dvi_var)


def _as_tensor(x: Any, like: MomentTensor) -> Any:
    if isinstance(x, Tensor):
        return x
    return torch.as_tensor(x, dtype=like.dvi_mean.dtype, device=like.dvi_mean.device)


def _add_moments(op: str, a: Any, b: Any) -> MomentTensor:
    sources = _union_sources(op, a, b)
    like = a if _is_mt(a) else b
    a, b = _as_tensor(a, like), _as_tensor(b, like)
    shape = torch.broadcast_shapes(a.shape, b.shape)
    a, b = expand_to(a, shape), expand_to(b, shape)
    if not (_is_mt(a) and _is_mt(b)):
        x, c = (a, b) if _is_mt(a) else (b, a)
        return _new(x, x.dvi_mean + c, x.dvi_var, x.dvi_cov)
    mean = a.dvi_mean + b.dvi_mean
    if like.dvi_mode == "diag" or a.dvi_marginal or b.dvi_marginal:
        return _new(
            like, mean, a.dvi_var + b.dvi_var, sources=sources, marginal=like.dvi_mode == "full"
        )
    if a.dvi_cov is None and b.dvi_cov is None:
        return _new(like, mean, a.dvi_var + b.dvi_var, sources=sources)
    cov = _needs_full_input(op, a) + _needs_full_input(op, b)
    return _new(like, mean, cov=cov, sources=sources, marginal=False)


def _scale_moments(x: MomentTensor, c: Tensor | float) -> MomentTensor:
    c = torch.as_tensor(c, dtype=x.dvi_mean.dtype, device=x.dvi_mean.device)
    shape = torch.broadcast_shapes(x.shape, c.shape)
    x, c = expand_to(x, shape), c.expand(shape)  # type: ignore[assignment]
    cov = None if x.dvi_cov is None else x.dvi_cov * c.unsqueeze(-1) * c.unsqueeze(-2)
    return _new(x, x.dvi_mean * c, x.dvi_var * c * c, cov)


def _neg(x: MomentTensor) -> MomentTensor:
    return _new(x, -x.dvi_mean, x.dvi_var, x.dvi_cov)


@_register(_T.__add__, _T.__radd__, _T.add, torch.add)
def _add(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if alpha != 1:
        b = _scale_moments(b, alpha) if _is_mt(b) else b * alpha
    return _add_moments(_name(func), a, b)


@_register(_T.__sub__, _T.sub, torch.sub)
def _sub(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    b = _neg(b) if _is_mt(b) else -torch.as_tensor(b)
    return _add(func, a, b, alpha=alpha)


@_register(_T.__rsub__)
def _rsub(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    return _add_moments(_name(func), _neg(a), b)  # b - a


@_register(_T.__neg__, _T.neg, torch.neg)
def _neg_op(func: Callable[..., Any], x: MomentTensor) -> MomentTensor:
    return _neg(x)


@_register(_T.__mul__, _T.__rmul__, _T.mul, torch.mul)
def _mul(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    if _is_mt(a) and _is_mt(b):
        raise unsupported(f"`{_name(func)}` of two moment-carrying tensors", "not Gaussian")
    return _scale_moments(a, b) if _is_mt(a) else _scale_moments(b, a)


@_register(_T.__truediv__, _T.div, torch.div)
def _div(func: Callable[..., Any], a: Any, b: Any, **kwargs: Any) -> MomentTensor:
    if _is_mt(b) or kwargs:
        raise unsupported(f"`{_name(func)}` by a moment-carrying tensor or with rounding")
    return _scale_moments(a, 1.0 / torch.as_tensor(b))


# ---------------------------------------------------------------------------- linear, relu
def _param_moments(p: Any) -> tuple[Tensor, Tensor | None]:
    if p is None or not _is_mt(p):
        return p, None
    if p.dvi_cov is not None:
        raise unsupported("a weight argument with a full covariance", "weights must be factorised")
    return p.dvi_mean, p.dvi_var


def _linear_core(op: str, x: Any, weight: Any, bias: Any, transpose: bool) -> MomentTensor:
    sources = _union_sources(op, x, weight, bias)
    like: MomentTensor = next(t for t in (weight, x, bias) if _is_mt(t))
    w_mean, w_var = _param_moments(weight)
    if transpose:
        w_mean = w_mean.transpose(-1, -2)
        w_var = None if w_var is None else w_var.transpose(-1, -2)
    if w_var is None:
        w_var = torch.zeros_like(w_mean)
    b_mean, b_var = _param_moments(bias)
    if not _is_mt(x):
        mean, var = M.linear_deterministic(x, w_mean, w_var, b_mean, b_var)
        return _new(like, mean, var, sources=sources, marginal=False)
    if x.dvi_mode == "diag":
        mean, var = M.linear_diag(x.dvi_mean, x.dvi_var, w_mean, w_var, b_mean, b_var)
        return _new(like, mean, var, sources=sources)
    cov_in = _needs_full_input(op, x)
    mean, cov = M.linear_full(x.dvi_mean, cov_in, w_mean, w_var, b_mean, b_var)
    return _new(like, mean, cov=cov, sources=sources, marginal=False)


@_register(F.linear)
def _linear(func: Callable[..., Any], x: Any, weight: Any, bias: Any = None) -> MomentTensor:
    return _linear_core("torch.nn.functional.linear", x, weight, bias, transpose=False)


@_register(torch.matmul, _T.matmul, _T.__matmul__)
def _matmul(func: Callable[..., Any], x: Any, weight: Any) -> MomentTensor:
    if weight.dim() != 2 or (_is_mt(weight) and weight.dvi_cov is not None):
        raise unsupported(f"`{_name(func)}` unless the right operand is a [in, out] matrix")
    return _linear_core(_name(func), x, weight, None, transpose=True)


@_register(torch.relu, F.relu, _T.relu)
def _relu(func: Callable[..., Any], x: Any, inplace: bool = False) -> MomentTensor:
    if inplace:
        raise unsupported("in-place relu", "use relu(x), not relu_(x) or inplace=True")
    if x.dvi_mode == "diag" or (x.dvi_cov is None and not x.dvi_marginal):
        mean, var = M.relu_diag(x.dvi_mean, x.dvi_var)  # exact; independent units stay so
        return _new(x, mean, var)
    mean, cov = M.relu_full(x.dvi_mean, _needs_full_input(_name(func), x))
    return _new(x, mean, cov=cov)

r"""The moment rules of :class:`~lightning_dvi.pyro.moment_tensor.MomentTensor`.

Each rule maps the moments of its inputs to the moments of its output with the closed forms of
:mod:`lightning_dvi.moments` (one implementation of each formula serves every front-end):
shape ops and broadcasting, addition of independent terms, scaling by constants, ``F.linear`` /
``matmul`` (a linear layer with factorised Gaussian weights, through
:func:`lightning_dvi.moments.linear_moments`), ``conv2d``, pooling, normalization, ``torch.cat``
and every activation of the registry (:mod:`lightning_dvi.nn.registry`). Whatever a declared
module does is done by that module: ``F.max_pool2d``, ``F.group_norm`` and every registered
torch function (activations, ``F.batch_norm``, ``F.layer_norm``, ``F.adaptive_avg_pool2d``)
build the declared module and call its own ``propagate``, so no formula has a Pyro-side copy.

Likelihood links: ``log_softmax``/``softmax`` of logits and ``exp`` of a log-rate stand for the
link of the Gaussian (``dvi_link``) and reach the likelihood site, which integrates it. The
output of ``torch.sigmoid`` remembers its argument (``dvi_logits``), so that
``dist.Bernoulli(probs=torch.sigmoid(f))`` observes with the logits form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import moments as M
from ..gaussian import Gaussian
from ..moments.special import row_logsumexp
from ..nn.activations import Sigmoid
from ..nn.conv import MaxPool2d, unsupported_conv2d_options, unsupported_pool2d_options
from ..nn.layer_norm import GroupNorm
from ..nn.registry import spec_for_function
from ..propagation import DIAG, FULL, MomentPass
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


@register(*_SHAPE_OPS, kind="shape ops")
def _shape_op(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    """Gather the moments (:func:`lightning_dvi.moments.reindex_gaussian`).

    In ``full`` mode an op that mixes the last dimension with batch dimensions (or repeats a
    unit of independent ones) keeps only marginals and marks the result ``dvi_marginal``.
    """
    _only_moment_operand(func, x, *args, *kwargs.values())
    if (
        func in _IDENTITY_IF_SAME_SHAPE
        and not x.dvi_marginal
        and _same_shape(func, x, args, kwargs)
    ):
        # e.g. the plate's `dist.expand(batch_shape)` of a site already of that shape: every
        # element stays where it is, so the moments (a head's [N, K, K] covariance included)
        # are the input's, without gathering them through index probes.
        out = new_like(x, x.moments())
        out.dvi_logits = x.dvi_logits
        return out
    full = x.dvi_mode.full
    joint = (full or x.dvi_cov is not None) and not x.dvi_marginal  # diag mode: a head's cov
    g, exact = M.reindex_gaussian(x.moments(), func, *args, joint=joint, **kwargs)
    out = new_like(x, g, marginal=full and not exact)
    if x.dvi_logits is not None:  # sigmoid(f) reshaped: its logits are reshaped alike
        out.dvi_logits = _shape_op(func, x.dvi_logits, *args, **kwargs)
    return out


#: Shape ops that move no element when the output has the input's shape (``view``/``reshape``
#: keep the row-major order, ``expand`` to the same shape repeats nothing), and the copies.
_IDENTITY_IF_SAME_SHAPE = frozenset(
    (_T.expand, _T.view, _T.reshape, torch.reshape, _T.contiguous, _T.clone, torch.clone)
)


def _same_shape(func: Callable[..., Any], x: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(x, *args, **kwargs)`` has the shape of ``x`` (found on the plain mean)."""
    try:
        return bool(func(x.dvi_mean, *args, **kwargs).shape == x.shape)
    except (RuntimeError, TypeError, ValueError):  # the general rule raises the op's own error
        return False


@register(_T.expand_as, _T.reshape_as, _T.view_as, kind="shape ops")
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


@register(torch.broadcast_tensors, kind="shape ops")
def _broadcast_tensors(func: Callable[..., Any], *tensors: Tensor) -> tuple[Tensor, ...]:
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(expand_to(t, shape) for t in tensors)


@register(_T.to, _T.float, _T.double, _T.type_as, kind="shape ops")
def _cast(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
    _only_moment_operand(func, x, *args, *kwargs.values())
    cov = None if x.dvi_cov is None else func(x.dvi_cov, *args, **kwargs)
    var = None if cov is not None else func(x.dvi_var, *args, **kwargs)
    out = new_like(x, Gaussian(func(x.dvi_mean, *args, **kwargs), cov, var, validate=False))
    if x.dvi_logits is not None:
        out.dvi_logits = _cast(func, x.dvi_logits, *args, **kwargs)
    return out


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
    marginal = like.dvi_mode.full and any(is_moment(t) and t.dvi_marginal for t in (a, b))
    marginals_only = like.dvi_mode.diag or marginal
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


@register(_T.__add__, _T.__radd__, _T.add, torch.add, kind="arithmetic")
def _add(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if alpha != 1:
        b = _scale_moments(b, alpha, "scaling") if is_moment(b) else b * alpha
    return _add_moments(op_name(func), a, b)


@register(_T.__sub__, _T.sub, torch.sub, kind="arithmetic")
def _sub(func: Callable[..., Any], a: Any, b: Any, *, alpha: float = 1) -> MomentTensor:
    if isinstance(b, _LogSumExp):  # logits - logits.logsumexp(-1, keepdim=True): Categorical
        return b.normalise(a, alpha)
    b = _scale_moments(b, -1.0, "negation") if is_moment(b) else -torch.as_tensor(b)
    return _add(func, a, b, alpha=alpha)


@register(_T.__rsub__, kind="arithmetic")
def _rsub(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    return _add_moments(op_name(func), _scale_moments(a, -1.0, "negation"), b)  # b - a


@register(_T.__neg__, _T.neg, torch.neg, kind="arithmetic")
def _neg_op(func: Callable[..., Any], x: MomentTensor) -> MomentTensor:
    return _scale_moments(x, -1.0, "negation")


@register(_T.__mul__, _T.__rmul__, _T.mul, torch.mul, kind="arithmetic")
def _mul(func: Callable[..., Any], a: Any, b: Any) -> MomentTensor:
    if is_moment(a) and is_moment(b):
        raise unsupported(f"`{op_name(func)}` of two moment-carrying tensors", "not Gaussian")
    return _scale_moments(a, b, "scaling") if is_moment(a) else _scale_moments(b, a, "scaling")


@register(_T.__truediv__, _T.div, torch.div, kind="arithmetic")
def _div(func: Callable[..., Any], a: Any, b: Any, **kwargs: Any) -> MomentTensor:
    if isinstance(b, _SoftmaxSum) and not kwargs:  # probs / probs.sum(-1, keepdim=True)
        return b.normalise(a)
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


#: In ``diag`` mode a linear layer of at most this many outputs keeps their covariance
#: (:data:`lightning_dvi.moments.layers.HEAD_WIDTH`, the rule of every front end; for a softmax
#: it matters: dropping it made a digits classifier's loss 7 % optimistic).
HEAD_WIDTH = M.HEAD_WIDTH


def _layer(
    func: Callable[..., Any],
    x: Any,
    weight: Any,
    bias: Any,
    moments: Any,
) -> MomentTensor:
    """Convert the operands to (weight moments, input moments) and call ``moments`` on them.

    ``moments(h, w_loc, w_var, b_loc, b_var, *, mode) -> Gaussian`` is a function of
    :mod:`lightning_dvi.moments.layers` (a dense layer's outputs keep their covariance in
    ``diag`` mode up to :data:`HEAD_WIDTH` there); a deterministic weight has zero variance.
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
    return MomentTensor.of(moments(h, w_mean, w_var, b_mean, b_var, mode=mode), mode, sources)


@register(F.linear, kind="layers")
def _linear(func: Callable[..., Any], x: Any, weight: Any, bias: Any = None) -> MomentTensor:
    return _layer(func, x, weight, bias, M.linear_moments)


@register(torch.matmul, _T.matmul, _T.__matmul__, kind="layers")
def _matmul(func: Callable[..., Any], x: Any, weight: Any) -> MomentTensor:
    """``x @ w`` with an ``[in, out]`` matrix ``w``: the linear layer of ``w.mT``."""
    if weight.dim() != 2 or (is_moment(weight) and weight.dvi_cov is not None):
        raise unsupported(f"`{op_name(func)}` unless the right operand is a [in, out] matrix")

    def moments(h: Any, w_loc: Tensor, w_var: Tensor, *bias: Any, mode: MomentPass) -> Gaussian:
        return M.linear_moments(h, w_loc.mT, w_var.mT, *bias, mode=mode)

    return _layer(func, x, weight, None, moments)


@register(F.conv2d, kind="layers")
def _conv2d(
    func: Callable[..., Any], x: Any, weight: Any, bias: Any = None, stride: Any = 1,
    padding: Any = 0, dilation: Any = 1, groups: int = 1,
) -> MomentTensor:  # fmt: skip
    """``PyroModule[nn.Conv2d]``: diag moments (:func:`lightning_dvi.moments.conv2d_moments`).

    ``mode="diag"`` only: per-pixel moments are what image stages keep, and which pixels of a
    flattened image a dense layer may treat as independent (the declared networks' full-mode
    rule, :mod:`lightning_dvi.nn.conv`) is known only to a declared network.
    """
    required = unsupported_conv2d_options(groups, dilation, padding)
    if required is not None:
        raise unsupported(f"`{op_name(func)}`", f"only {required}")

    def moments(h: Any, *weights: Any, mode: MomentPass) -> Gaussian:
        if not mode.diag:
            raise unsupported(
                f"`{op_name(func)}` in mode='full'",
                "convolutions propagate per-pixel (diag) moments: use "
                "DeterministicGuide(model, mode='diag'), or PyroBayesNet(from_torch(net)) for "
                "full covariance in the dense layers after the convolutions",
            )
        return M.conv2d_moments(h, *weights, stride=stride, padding=padding)

    return _layer(func, x, weight, bias, moments)


@register(F.avg_pool2d, kind="pooling")
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


def _declared(module: Any, x: Any, op: str) -> MomentTensor:
    """The moments of the declared ``module`` (its own ``propagate``) on the moments of ``x``."""
    out = module.propagate(x.gaussian(op), x.dvi_mode)
    return MomentTensor.of(cast(Gaussian, out), x.dvi_mode, x.dvi_sources)


@register(F.max_pool2d, kind="pooling")
def _max_pool2d(
    func: Callable[..., Any], x: Any, kernel_size: Any, stride: Any = None, padding: Any = 0,
    dilation: Any = 1, ceil_mode: bool = False, return_indices: bool = False,
) -> MomentTensor:  # fmt: skip
    """``nn.MaxPool2d``: :class:`lightning_dvi.nn.MaxPool2d` (moment-matched maximum)."""
    op = op_name(func)
    _only_moment_operand(func, x)
    required = unsupported_pool2d_options(
        padding, ceil_mode, dilation, return_indices=return_indices, allow_padding=True
    )
    if required is not None:
        raise unsupported(f"`{op}`", f"only {required}")
    stride = None if stride in (None, [], ()) else stride
    return _declared(MaxPool2d(kernel_size, stride, padding=padding), x, op)


@register(F.group_norm, kind="normalization")
def _group_norm(
    func: Callable[..., Any], x: Any, num_groups: int, weight: Any = None, bias: Any = None,
    eps: float = 1e-5,
) -> MomentTensor:  # fmt: skip
    """``nn.GroupNorm``: :class:`lightning_dvi.nn.GroupNorm` holding the caller's own tensors."""
    op = op_name(func)
    _only_moment_operand(func, x, weight, bias)
    if x.dim() < 2:
        raise unsupported(f"`{op}` of a {x.dim()}-D tensor", "the input is [B, C, *]")
    layer = GroupNorm(num_groups, x.shape[1], eps, affine=False)
    if weight is not None or bias is not None:  # the affine map needs both: fill the other
        like = weight if weight is not None else bias
        # the caller's tensors (gradients reach them), as F.layer_norm's from_call does
        layer.weight = torch.ones_like(like) if weight is None else weight  # type: ignore[assignment]  # a plain tensor in place of the Parameter
        layer.bias = torch.zeros_like(like) if bias is None else bias  # type: ignore[assignment]  # a plain tensor in place of the Parameter
    return _declared(layer, x, op)


@register(torch.cat, torch.concat, torch.concatenate, kind="shape ops")
def _cat(func: Callable[..., Any], tensors: Any, dim: int = 0, **kwargs: Any) -> MomentTensor:
    r"""Concatenate moment tensors (and constants, of zero variance).

    Means and variances concatenate. In ``full`` mode the covariance over the last dimension
    is exact when the operands are independent (disjoint weight sites: the block-diagonal
    :math:`\operatorname{diag}(\Sigma_1, \Sigma_2, \dots)` along the last dimension; the
    per-row covariances along a batch dimension); two operands that depend on the same
    weights along the last dimension need their cross-covariance, which is not tracked, and
    are refused. ``diag`` mode keeps marginals only, as everywhere.
    """
    op = op_name(func)
    dim = kwargs.pop("axis", dim)
    if kwargs:
        raise unsupported(f"`{op}` with {sorted(kwargs)}")
    moments = [t for t in tensors if is_moment(t)]
    like = moments[0]
    for t in moments:
        t.check_unlinked(op)
    d = dim % like.dim()
    last = d == like.dim() - 1
    full = like.dvi_mode.full
    sources = frozenset().union(*(t.dvi_sources for t in moments))
    if full and last and len(moments) > 1:
        union_sources(op, *moments)  # refuses operands that depend on the same weights
    marginal = full and any(t.dvi_marginal for t in moments)
    gs = [
        t.moments() if is_moment(t) else Gaussian(t, var=torch.zeros_like(t), validate=False)
        for t in tensors
    ]
    mean = torch.cat([g.mean for g in gs], d)
    joint = full and not marginal and any(g.cov is not None for g in gs)
    if not joint:  # independent units (exact), or marginals
        var = torch.cat([g.var for g in gs], d)
        out = MomentTensor(mean, var, mode=like.dvi_mode, sources=sources, marginal=marginal)
        return out
    covs = [cast(Tensor, g.to_full().cov) for g in gs]
    if last:  # block-diagonal: independent operands
        batch = mean.shape[:-1]
        rows = []
        for i, c in enumerate(covs):
            row = [
                c.expand(*batch, *c.shape[-2:])
                if i == j
                else c.new_zeros(*batch, c.shape[-1], o.shape[-1])
                for j, o in enumerate(covs)
            ]
            rows.append(torch.cat(row, -1))
        cov = torch.cat(rows, -2)
    else:
        cov = torch.cat(covs, d)
    return MomentTensor(mean, cov=cov, mode=like.dvi_mode, sources=sources)


def _out_of_place(func: Callable[..., Any]) -> Callable[..., Any] | None:
    """``torch.relu`` for ``torch.relu_`` (and the ``Tensor`` and ``F`` variants), else ``None``."""
    name = getattr(func, "__name__", "")
    if not name.endswith("_") or name.startswith("_"):
        return None
    for owner in (torch, _T, F):
        if getattr(owner, name, None) is func:
            return cast(Callable[..., Any] | None, getattr(owner, name[:-1], None))
    return None


def marginals_only(x: Any) -> bool:
    """Whether ``x`` is a full-mode moment tensor whose covariance a shape op dropped."""
    return bool(x.dvi_mode.full and x.dvi_marginal)


def _registered_activation(func: Callable[..., Any]) -> Handler | None:
    """The rule for a torch function that a declared activation stands for (else ``None``).

    In-place forms (``nn.ReLU(inplace=True)``, ``F.relu(x, inplace=True)``, ``x.relu_()``,
    TyXe's and torchvision's idiom) have the moments of the out-of-place op and update the
    moment tensor they were given, as the in-place op updates its input. An elementwise
    activation of a full-mode tensor that holds marginals only (after a shape op that mixed
    rows into units) maps the marginals, and its output holds marginals only.
    """
    spec = spec_for_function(func)
    variant = spec is None
    if spec is None:
        base = _out_of_place(func)
        spec = None if base is None else spec_for_function(base)
        if spec is None:
            return None
    if spec.kind == "shape":  # torch.flatten keeps its own rule (a reshape of the moments)
        return None
    found = spec

    def activation(func: Callable[..., Any], x: Any, *args: Any, **kwargs: Any) -> MomentTensor:
        op = op_name(func)
        inplace = bool(kwargs.pop("inplace", False)) or variant
        _only_moment_operand(func, x, *args, *kwargs.values())
        module = found.build_from_call(*args, **kwargs)
        if marginals_only(x) and found.kind == "activation":
            # elementwise: marginals in, marginals out (e.g. sigmoid(f.squeeze(-1)) in full mode)
            out = module.propagate(x.moments().to_diag(), DIAG)
            result = MomentTensor(out.mean, out.var, mode=FULL, sources=x.dvi_sources,
                                  marginal=True)  # fmt: skip
        else:
            out = module.propagate(x.gaussian(op), x.dvi_mode)
            result = MomentTensor.of(cast(Gaussian, out), x.dvi_mode, x.dvi_sources)
        if isinstance(module, Sigmoid):  # what dist.Bernoulli(probs=...) observes through
            result.dvi_logits = new_like(x, x.moments())
        if not inplace:
            return result
        x.dvi_mean, x.dvi_var, x.dvi_cov = result.dvi_mean, result.dvi_var, result.dvi_cov
        x.dvi_marginal, x.dvi_logits = result.dvi_marginal, result.dvi_logits
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


@register(torch.exp, _T.exp, kind="likelihood links")
def _exp_link(func: Callable[..., Any], x: Any) -> MomentTensor:
    """``exp(f)``: stands for the log-normal rate of ``dist.Poisson(rate=f.exp())``."""
    return _link(func, x, "exp")


# F.softplus is a registered activation (lightning_dvi.nn.Softplus); a network-dependent Normal
# scale built from it is refused at the observed site instead (messenger._normal).
@register(torch.sqrt, _T.sqrt, kind="")
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


@register(F.log_softmax, _T.log_softmax, torch.log_softmax, kind="likelihood links")
def _log_softmax(
    func: Callable[..., Any], x: Any, dim: Any = None, *args: Any, **kw: Any
) -> MomentTensor:
    _last_dim(func, x, kw.pop("dim", dim))
    if x.dvi_link == "log_softmax":
        return cast(MomentTensor, x)
    return _link(func, x, "log_softmax")


@register(F.softmax, _T.softmax, torch.softmax, kind="likelihood links")
def _softmax(
    func: Callable[..., Any], x: Any, dim: Any = None, *args: Any, **kw: Any
) -> MomentTensor:
    """``softmax(f)``: stands for the class probabilities of ``dist.Categorical(probs=...)``."""
    _last_dim(func, x, kw.pop("dim", dim))
    if x.dvi_link == "softmax":
        return cast(MomentTensor, x)
    return _link(func, x, "softmax")


class _SoftmaxSum(MomentTensor):
    """``p.sum(-1, keepdim=True)`` of ``p = softmax(f)`` (ones), only ever dividing ``p``.

    ``dist.Categorical(probs=p)`` normalises ``p / p.sum(-1, keepdim=True)``.
    """

    dvi_of: MomentTensor

    def normalise(self, a: MomentTensor) -> MomentTensor:
        if a is not self.dvi_of:
            raise unsupported("`sum` of moments other than in probs / probs.sum(-1)")
        return a


@register(torch.sum, _T.sum, kind="")
def _sum(func: Callable[..., Any], x: Any, dim: Any = None, keepdim: bool = False,
         **kwargs: Any) -> _SoftmaxSum:  # fmt: skip
    if x.dvi_link != "softmax" or kwargs or not keepdim or dim not in (-1, x.dim() - 1, [-1]):
        raise unsupported(
            f"`{op_name(func)}` on a moment-carrying tensor",
            "a sum of correlated units is not tracked (only a Categorical's own normalisation "
            "of probs=softmax(f) is answered)",
        )
    with torch.no_grad():
        ones = torch.ones_like(x.dvi_mean[..., :1])
    total = _SoftmaxSum(ones, torch.zeros_like(ones), mode=x.dvi_mode, link="sum")
    total.dvi_of = x
    return total


class _LogSumExp(MomentTensor):
    """``x.logsumexp(-1, keepdim=True)``, only ever subtracted from ``x`` (Categorical's init)."""

    dvi_of: MomentTensor

    def normalise(self, a: Any, alpha: float) -> MomentTensor:
        if a is not self.dvi_of or alpha != 1:
            raise unsupported("`logsumexp` of moments other than in logits - logits.logsumexp(-1)")
        return a if a.dvi_link == "log_softmax" else _link(_T.logsumexp, a, "log_softmax")


@register(torch.logsumexp, _T.logsumexp, kind="")
def _logsumexp(func: Callable[..., Any], x: Any, dim: Any, keepdim: bool = False) -> _LogSumExp:
    _last_dim(func, x, dim)
    if not keepdim:
        raise unsupported(
            "`logsumexp(keepdim=False)` of moments", "pass the logits to dist.Categorical"
        )
    with torch.no_grad():  # off the CPU's slow exp path for spread-out logits
        mean = row_logsumexp(x.dvi_mean)
    lse = _LogSumExp(mean, torch.zeros_like(mean), mode=x.dvi_mode, link="logsumexp")
    lse.dvi_of = x
    return lse

r"""Affine algebra of Gaussians: sums of independent terms, constant factors, shape and index ops.

For independent :math:`a \sim \mathcal N(\mu_a, \Sigma_a)`, :math:`b \sim \mathcal N(\mu_b,
\Sigma_b)` and constants :math:`c`,

.. math::
    a + b \sim \mathcal N(\mu_a + \mu_b,\ \Sigma_a + \Sigma_b),\qquad
    a + c \sim \mathcal N(\mu_a + c,\ \Sigma_a),\qquad
    c \circ a \sim \mathcal N(c \circ \mu_a,\ \Sigma_a \circ cc^\top),

all exact. A shape or index op (``view``, ``expand``, indexing, ``transpose``, ...) only moves
elements, so the moments of its output are gathered from those of its input
(:func:`reindex_gaussian`). Covariances are over the last dimension (the storage rule of
:class:`~lightning_dvi.Gaussian`: a diag Gaussian has independent units); an op whose output's
last dimension mixes elements of different input rows leaves only the marginal variances known.
The Pyro moment pass runs model code (``h + b``, ``3 * h``, ``h[..., 0]``, ``.expand``) on
these functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .._tracing import recording, untraced
from ..gaussian import Gaussian
from .layers import skip_covariance

__all__ = ["add_independent", "reindex_gaussian", "scale_gaussian"]


def _as_constant(c: Tensor | float, g: Gaussian, what: str) -> Tensor:
    c = torch.as_tensor(c, dtype=g.dtype, device=g.device)
    if torch.broadcast_shapes(c.shape, g.shape) != g.shape:
        raise ValueError(
            f"{what}: a constant of shape {tuple(c.shape)} would broadcast the Gaussian of shape "
            f"{tuple(g.shape)}; expand the Gaussian first (reindex_gaussian)"
        )
    return c


def add_independent(a: Gaussian | Tensor | float, b: Gaussian | Tensor | float) -> Gaussian:
    r"""The Gaussian of :math:`a + b` for independent :math:`a` and :math:`b`.

    :math:`\mu = \mu_a + \mu_b`, :math:`\Sigma = \Sigma_a + \Sigma_b`. One of the two may be a
    constant (a tensor or a number broadcastable to the other's shape), which shifts the mean
    only. Two diag Gaussians give a diag one (independent units stay independent); if either is
    full, the result is full. Batch dimensions broadcast.

    Args:
        a: a Gaussian ``[..., D]`` or a constant.
        b: a Gaussian ``[..., D]`` or a constant.

    Raises:
        ValueError: when neither is a Gaussian, when the last dimensions differ (broadcasting a
            unit over the last dimension would make its copies perfectly correlated, not
            independent: expand it with :func:`reindex_gaussian` first), or when a constant
            would broadcast the Gaussian.

    Examples:
        >>> a = Gaussian(torch.zeros(2), var=torch.ones(2))
        >>> add_independent(a, Gaussian(torch.ones(2), var=torch.ones(2))).var.tolist()
        [2.0, 2.0]
    """
    if not isinstance(a, Gaussian):
        a, b = b, a
    if not isinstance(a, Gaussian):
        raise ValueError("add_independent needs at least one Gaussian")
    if not isinstance(b, Gaussian):
        c = _as_constant(b, a, "add_independent")
        return Gaussian(a.mean + c, a.cov, None if a.is_full else a.var, validate=False)
    if a.shape[-1:] != b.shape[-1:]:
        raise ValueError(
            f"add_independent: last dimensions differ ({tuple(a.shape)} and {tuple(b.shape)}); "
            "expand the Gaussian first (reindex_gaussian)"
        )
    mean = a.mean + b.mean
    if a.is_full or b.is_full:
        return Gaussian(mean, cov=skip_covariance(a) + skip_covariance(b), validate=False)
    return Gaussian(mean, var=a.var + b.var, validate=False)


def scale_gaussian(g: Gaussian, c: Tensor | float) -> Gaussian:
    r"""The Gaussian of :math:`c \circ a` for a constant :math:`c` (elementwise).

    :math:`\mu = c \circ \mu_a`, :math:`\Sigma_{jk} = c_j c_k (\Sigma_a)_{jk}` (diag storage:
    :math:`\sigma^2 = c^2 \sigma_a^2`).

    Args:
        g: the Gaussian ``[..., D]``.
        c: a number or a tensor broadcastable to ``g.shape`` (it may not enlarge it).

    Raises:
        ValueError: when ``c`` would broadcast ``g`` to a larger shape.

    Examples:
        >>> g = Gaussian(torch.ones(2), var=torch.ones(2))
        >>> scale_gaussian(g, torch.tensor([2.0, -1.0])).var.tolist()
        [4.0, 1.0]
    """
    c = _as_constant(c, g, "scale_gaussian").expand(g.shape)
    if g.cov is not None:
        cov = g.cov * c.unsqueeze(-1) * c.unsqueeze(-2)
        return Gaussian(g.mean * c, cov=cov, validate=False)
    return Gaussian(g.mean * c, var=g.var * c * c, validate=False)


def reindex_gaussian(
    g: Gaussian, op: Callable[..., Any], *args: Any, joint: bool = True, **kwargs: Any
) -> tuple[Gaussian, bool]:
    r"""The Gaussian of ``op(a, *args, **kwargs)`` for a shape or index op ``op``.

    ``op`` must only move (select, repeat, reorder) elements, as ``view``, ``reshape``,
    ``expand``, indexing, ``transpose`` and ``squeeze`` do; it is applied to the mean and to the
    variances. The covariance of the output is found by applying ``op`` to two index probes,
    the flat source row :math:`r` and the source column :math:`c` of every element: if every
    output row comes from one source row, the output covariance is exactly
    :math:`\Sigma'_{jk} = \Sigma_{r,\,c_j c_k}` (a gather). Otherwise the output's last
    dimension mixes different rows, whose covariances are not stored, and only the marginals
    :math:`\sigma'^2_j = \sigma^2_{r_j c_j}` are known. A diag input (independent units) stays
    exactly diag unless a row repeats a unit (then two output units are perfectly correlated).

    Args:
        g: the input Gaussian (a 0-dim mean is allowed: a single unit).
        op: the shape or index op, called as ``op(tensor, *args, **kwargs)``.
        *args: the op's further arguments.
        joint: whether to find the joint (the probes); ``False`` maps the marginals only.
        **kwargs: the op's keyword arguments.

    Returns:
        ``(out, exact)``: the output Gaussian and whether its storage is its exact joint (a
        full covariance, or diag storage of independent units); when ``exact`` is ``False``,
        ``out`` holds the marginal variances only.

    Examples:
        >>> cov = torch.tensor([[[2.0, 1.0], [1.0, 3.0]]])
        >>> out, exact = reindex_gaussian(Gaussian(torch.zeros(1, 2), cov=cov), torch.flip, [-1])
        >>> out.cov.tolist(), exact
        ([[[3.0, 1.0], [1.0, 2.0]]], True)
    """
    mean = op(g.mean, *args, **kwargs)
    marginals = Gaussian(mean, var=op(g.var, *args, **kwargs), validate=False)
    if not joint or g.mean.dim() == 0:
        return marginals, False
    batch, d = g.shape[:-1], g.shape[-1]
    n = math.prod(batch)
    if recording() and any(isinstance(a, Tensor) for a in (*args, *kwargs.values())):
        raise RuntimeError(  # the probes would hold this call's index values in the graph
            f"reindex_gaussian: {getattr(op, '__name__', op)} with a tensor index cannot be "
            "recorded as part of a step graph"
        )
    with untraced():  # the probes depend on the op and the shape only: host values
        rows = torch.arange(n, device=g.device).reshape(*batch, 1).expand(*batch, d)
        cols = torch.arange(d, device=g.device).expand(*batch, d)
        r, c = op(rows, *args, **kwargs), op(cols, *args, **kwargs)
        if r.dim() == 0 or not bool((r == r[..., :1]).all()):
            return marginals, False
        if g.cov is None:
            # Independent units stay independent only if no unit is repeated within a row.
            distinct = c.shape[-1] <= 1 or bool((c.sort(-1).values.diff(dim=-1) > 0).all())
            return marginals, distinct
    out_d = c.shape[-1]
    cov = g.cov.reshape(n, d, d)[r[..., 0]]
    cov = cov.gather(-2, c.unsqueeze(-1).expand(*c.shape, d))
    cov = cov.gather(-1, c.unsqueeze(-2).expand(*c.shape[:-1], out_d, out_d))
    return Gaussian(mean, cov=cov, validate=False), True

r"""Full covariance of a smooth activation by the truncated Mehler series, in bounded memory.

Mehler's expansion of the bivariate normal density gives, exactly,
:math:`\operatorname{Cov}(f(a_j), f(a_l)) = \sum_{k\ge1}\Sigma_{jl}^k e_{jk}e_{lk}/k!` with
:math:`e_{jk} = E f^{(k)}(a_j)` (the correlation form
:math:`\sum_k \rho^k c_{jk}c_{lk}/k!`, :math:`c_k = s^k e_k`, with the powers of :math:`s`
moved onto :math:`\Sigma`). Keeping :math:`K = 3` terms off the diagonal and the exact variance
:math:`V_j` on it,

.. math::
    C_{jl} = \Sigma_{jl}\big(e_{j1}e_{l1} + \Sigma_{jl}\big(\tfrac12 e_{j2}e_{l2}
        + \tfrac16\Sigma_{jl}e_{j3}e_{l3}\big)\big)\quad (j \ne l),\qquad C_{jj} = V_j,

each term a Hadamard product of PSD matrices (Schur), PSD as long as
:math:`V_j \ge P_j = \sum_k \Sigma_{jj}^k e_{jk}^2/k!` (Parseval's partial sum; the caller scales
:math:`e_j` down where a quadrature error would break it).

**Backward**, closed form: :math:`\partial L/\partial\Sigma_{jl} = G_{jl}\,(e_{j1}e_{l1} +
\Sigma_{jl}e_{j2}e_{l2} + \tfrac12\Sigma_{jl}^2e_{j3}e_{l3})` off the diagonal and
:math:`\partial L/\partial e_{jk} = \frac1{k!}\sum_{l\ne j}(G_{jl} + G_{lj})\Sigma_{jl}^ke_{lk}`,
matrix-vector products of :math:`G\circ\Sigma^{\circ k}`.

**Execution.** Horner's scheme in place on the output (no ``[B, D, D]`` temporaries in the
forward pass), exactly symmetric (the upper triangle mirrored), and the backward pass in
chunks of at most :data:`CHUNK` elements, so the peak memory of a full-mode step with a
smooth activation is that of its output, as for the ReLU covariance.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from .special import flush, tail_cutoff

__all__ = ["CHUNK", "mehler_cov", "parseval_sum"]

CHUNK = 1 << 20
"""Elements of ``[n, D, D]`` processed at once in the backward pass (4 MiB in float32)."""


def _chunks(n: int, d: int) -> list[tuple[int, int]]:
    size = max(1, CHUNK // (d * d))
    return [(i, min(n, i + size)) for i in range(0, n, size)]


def _mirror_upper(out: Tensor) -> None:
    """Copy the strict upper triangle of each matrix into its lower triangle, in place."""
    for a, b in _chunks(out.shape[0], out.shape[-1]):
        block = out[a:b]
        upper = block.triu(1)
        block.triu_().add_(upper.mT)


def _forward(cov: Tensor, e1: Tensor, e2: Tensor, e3: Tensor, var: Tensor) -> Tensor:
    """The series by Horner's scheme in place on the output, mirrored, ``var`` on the diagonal."""
    j, l = (lambda x: x[..., :, None]), (lambda x: x[..., None, :])  # noqa: E741
    out = torch.mul(cov, j(e3)).mul_(l(e3 / 6))
    out.addcmul_(j(e2), l(e2), value=0.5).mul_(cov)
    out.addcmul_(j(e1), l(e1)).mul_(cov)
    if torch.compiler.is_exporting():  # functional ops only: the exporters cannot take views
        eye = torch.eye(out.shape[-1], dtype=torch.bool, device=out.device)
        out = torch.where(eye, var[..., :, None], 0.5 * (out + out.mT))
        return flush(out)
    _mirror_upper(out)
    out.diagonal(dim1=-2, dim2=-1).copy_(var)
    return torch.hardshrink(out, tail_cutoff(out.dtype), out=out)


class _MehlerCov(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, cov: Tensor, e1: Tensor, e2: Tensor, e3: Tensor, var: Tensor
    ) -> Tensor:
        ctx.save_for_backward(cov, e1, e2, e3)
        return _forward(cov, e1, e2, e3, var)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, ...]:
        cov, e1, e2, e3 = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        g_cov = torch.empty_like(cov)
        es = (e1, e2, e3)
        g_es = [torch.empty_like(e) for e in es]
        for a, b in _chunks(cov.shape[0], cov.shape[-1]):
            s, g = cov[a:b], grad[a:b]
            ea = [e[a:b] for e in es]
            t = g * s  # G o Sigma^k, k = 1, 2, 3
            for k, (e, out) in enumerate(zip(ea, g_es, strict=True), start=1):
                if k > 1:
                    t.mul_(s)
                rows = (t @ e[..., None]).squeeze(-1) + (e[..., None, :] @ t).squeeze(-2)
                diag = t.diagonal(dim1=-2, dim2=-1)
                out[a:b] = rows.sub_(2 * diag * e).div_(math.factorial(k))
            gc = torch.mul(s, ea[2][..., :, None]).mul_(ea[2][..., None, :] / 2)
            gc.addcmul_(ea[1][..., :, None], ea[1][..., None, :]).mul_(s)
            gc.addcmul_(ea[0][..., :, None], ea[0][..., None, :]).mul_(g)
            gc.diagonal(dim1=-2, dim2=-1).zero_()
            g_cov[a:b] = gc
        g_var = grad.diagonal(dim1=-2, dim2=-1)
        return flush(g_cov), *(flush(g) for g in g_es), flush(g_var.contiguous())


def parseval_sum(var_in: Tensor, derivs: Tensor) -> Tensor:
    r""":math:`P_j = \sum_{k\le K}\Sigma_{jj}^k e_{jk}^2/k!`, the variance the kept terms explain."""
    k = derivs.shape[-1]
    powers = torch.stack([var_in**i for i in range(1, k + 1)], -1)
    fact = torch.tensor([math.factorial(i) for i in range(1, k + 1)], dtype=derivs.dtype)
    return (powers * derivs.square() / fact.to(derivs.device)).sum(-1)


def mehler_cov(cov: Tensor, derivs: Tensor, out_var: Tensor) -> Tensor:
    r"""Output covariance from the input covariance and :math:`e_k = E f^{(k)}` (module docstring).

    Args:
        cov: input covariance ``[..., D, D]`` (symmetric).
        derivs: :math:`e_{jk}`, ``[..., D, 3]``.
        out_var: the exact output variances ``[..., D]`` (the diagonal).

    Returns:
        ``[..., D, D]``, exactly symmetric, PSD up to round-off: where quadrature error makes
        :math:`V_j < P_j` the unit's coefficients are scaled by :math:`\sqrt{V_j/P_j}`.
    """
    if derivs.shape[-1] != 3:
        raise ValueError(f"mehler_cov keeps 3 terms, got {derivs.shape[-1]} coefficients")
    var_in = cov.diagonal(dim1=-2, dim2=-1)
    parseval = flush(parseval_sum(var_in, derivs))  # squares of tail values: no subnormals
    # a no-op (factor 1) unless quadrature error put V below P; safe arguments on both branches
    # (the unselected branch divides by 1, not by a floored parseval: its backward would form
    # 0 * tiny / tiny**2 = 0 * inf = NaN at a zero input variance)
    tiny = torch.finfo(cov.dtype).tiny
    shrinks = parseval > out_var
    ratio = out_var.clamp_min(tiny) / torch.where(shrinks, parseval, torch.ones_like(parseval))
    shrink = torch.where(shrinks, ratio.clamp(max=1).sqrt(), 1.0)
    derivs = derivs * shrink[..., None]
    d = cov.shape[-1]
    lead = torch.broadcast_shapes(cov.shape[:-2], derivs.shape[:-2], out_var.shape[:-1])
    flat_cov = cov.expand(*lead, d, d).reshape(-1, d, d)
    flat_e = derivs.expand(*lead, d, 3).reshape(-1, d, 3)
    flat_v = out_var.expand(*lead, d).reshape(-1, d)
    e = flat_e.unbind(-1)
    out = _MehlerCov.apply(flat_cov, e[0], e[1], e[2], flat_v)
    return out.reshape(*lead, d, d)  # type: ignore[no-any-return]  # Function.apply returns Any

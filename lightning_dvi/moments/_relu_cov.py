r"""The full ReLU covariance, computed block by block on the upper triangle.

Forward, for :math:`j < l` (the diagonal is the exact variance, the lower triangle a copy):

.. math::
    C_{jl} = \operatorname{clamp}\Big(\Sigma_{jl}\Phi_j\Phi_l + \sigma_j\sigma_l K(\rho_{jl},
    \mu_j, \mu_l),\ \pm\sqrt{V_jV_l}\Big),

with :math:`K` and its derivatives as in :mod:`lightning_dvi.moments._relu` and :math:`V` the
exact output variances (the Cauchy-Schwarz clamp of
:func:`~lightning_dvi.moments.activations.relu_full`).

Why blocks: the formula is ~30 elementwise passes over ``[B, D, D]``. Done on whole tensors
each pass streams the array through memory and allocates a fresh output (for tensors above
glibc's mmap threshold every allocation page-faults its memory in again); done on blocks of
:data:`BLOCK` elements the temporaries stay in cache and are reused. The triangle halves the
work and makes the output exactly symmetric without averaging. The backward recomputes each
block instead of storing ~10 full-size intermediates, so the peak memory of the full mode is
a few blocks on top of the output.

The same formula is also written once as whole-tensor functions, :func:`relu_cov_forward` and
:func:`relu_cov_backward` on ``[n, D, D]``: a fixed sequence of kernels with no host
synchronisation and no Python loop over matrices, which is what a GPU wants (and what
``torch.compile`` fuses). :mod:`lightning_dvi.moments.policy` chooses between the two: the
blocked loop on a CPU, the whole-tensor functions (eager or compiled, chunked over the batch to
a memory budget) on CUDA and while an outer ``torch.compile`` traces. The tests hold both to
1e-6 relative in float64, values and gradients.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy
from ._relu import INV_2PI, big, clip_eps, floors

__all__ = ["BLOCK", "relu_cov", "relu_cov_backward", "relu_cov_forward"]

BLOCK = 1 << 16
"""Target elements per block (256 KiB in float32); ~20 scratch buffers of this size."""


def _row_bands(n: int, d: int, target: int) -> list[tuple[int, int, int, int]]:
    """Blocks ``(n0, n1, r0, r1)``: matrices ``n0:n1``, rows ``r0:r1``, columns ``r0:d``.

    Matrices smaller than ``target`` are grouped whole (a block per group, no triangle: at
    these sizes the per-block dispatch cost outweighs the halved arithmetic); a larger matrix
    is cut into row bands of about ``target`` elements of its upper triangle each.
    """
    if n * d * d <= 2 * target or d * d <= target:
        nb = max(1, min(n, target // (d * d)))
        return [(n0, min(n, n0 + nb), 0, d) for n0 in range(0, n, nb)]
    tri = d * (d + 1) // 2
    bands = max(2, round(tri / target))
    bounds, r = [0], 0
    for i in range(1, bands):
        goal = tri * i / bands  # rows r with r*d - r(r-1)/2 ~ goal
        r = max(r + 1, int(d + 0.5 - math.sqrt((d + 0.5) ** 2 - 2 * goal)))
        if r >= d:
            break
        bounds.append(r)
    bounds.append(d)
    return [(n0, n0 + 1, r0, r1) for n0 in range(n) for r0, r1 in itertools.pairwise(bounds)]


class _Workspace:
    """Scratch tensors of one block size, handed out in order and reused by every block.

    Writing every intermediate with ``out=`` into these keeps the loops allocation-free:
    glibc hands freed blocks of a few hundred KiB back to the OS and page-faults them in again
    on the next allocation, which made each out-of-place pass ~10x slower than an in-place one.
    """

    def __init__(self, like: Tensor, size: int) -> None:
        self.bufs = torch.empty(_BUFFERS * size, dtype=like.dtype, device=like.device)
        self.size = size
        self.shape: tuple[int, ...] = ()
        self.stride: tuple[int, ...] = ()
        self.next = 0

    def start(self, shape: tuple[int, ...]) -> None:
        """Begin a block of this shape; all buffers become free again."""
        self.shape, self.next = shape, 0
        self.stride = (shape[1] * shape[2], shape[2], 1)

    def take(self) -> Tensor:
        """A free contiguous buffer of the block's shape (one view op: dispatch costs here)."""
        self.next += 1
        return self.bufs.as_strided(self.shape, self.stride, (self.next - 1) * self.size)


_BUFFERS = 20


class _Block:
    """Intermediates of one block ``[nb, rows, cols]`` of the upper triangle."""

    def __init__(
        self, ws: _Workspace, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, sl: tuple
    ) -> None:
        n0, n1, r0, r1 = sl
        ws.start((n1 - n0, r1 - r0, cov.shape[-1] - r0))
        self.ws = ws
        self.cov = cov[n0:n1, r0:r1, r0:]
        self.sd_j, self.sd_l = sd[n0:n1, r0:r1, None], sd[n0:n1, None, r0:]
        self.mu_j, self.mu_l = mu[n0:n1, r0:r1, None], mu[n0:n1, None, r0:]
        self.cdf_j, self.cdf_l = cdf[n0:n1, r0:r1, None], cdf[n0:n1, None, r0:]
        eps = clip_eps(cov.dtype)
        self.scale = torch.mul(self.sd_j, self.sd_l, out=ws.take())
        self.rho = torch.div(self.cov, self.scale, out=ws.take()).clamp_(-1 + eps, 1 - eps)
        self.asin = torch.asin(self.rho, out=ws.take())
        rho2 = torch.mul(self.rho, self.rho, out=ws.take())
        self.rho_bar = torch.neg(rho2, out=ws.take()).add_(1).sqrt_()
        self.inv = torch.add(self.rho_bar, 1, out=ws.take()).reciprocal_()  # 1 / (1 + rho_bar)
        self.p = torch.mul(self.rho, self.inv, out=ws.take())
        self.p.neg_().add_(self.asin).mul_(self.rho)  # P = rho (asin rho - rho / (1 + rho_bar))
        p_safe = torch.clamp(self.p, min=floors(cov.dtype)[3], out=ws.take())
        self.beta = rho2.mul_(self.inv).div_(p_safe).mul_(0.5)
        self.gamma = torch.sub(self.asin, self.rho, out=ws.take()).div_(p_safe)
        sq = mu[n0:n1] * mu[n0:n1]
        self.sum_sq = torch.add(sq[:, r0:r1, None], sq[:, None, r0:], out=ws.take())
        self.prod = torch.mul(self.mu_j, self.mu_l, out=ws.take())
        quad = torch.mul(self.beta, self.sum_sq, out=ws.take())
        self.gauss = quad.addcmul_(self.gamma, self.prod, value=-1).neg_().exp_()  # e^{-Q}

    def raw(self) -> Tensor:
        """Unclamped covariance of the block."""
        out = torch.mul(self.p, self.gauss, out=self.ws.take()).mul_(self.scale).mul_(INV_2PI)
        return out.addcmul_(self.cov, torch.mul(self.cdf_j, self.cdf_l, out=self.ws.take()))


def _sym_sum(ws: _Workspace, grad: Tensor, sl: tuple) -> Tensor:
    """``G_jl + G_lj`` on the block, zero on and below the diagonal of its square part."""
    n0, n1, r0, r1 = sl
    g = torch.add(grad[n0:n1, r0:r1, r0:], grad[n0:n1, r0:, r0:r1].transpose(-1, -2), out=ws.take())
    rows = r1 - r0
    g[..., :rows].mul_(torch.ones(rows, rows, dtype=g.dtype, device=g.device).triu_(1))
    return g


class _ReluCov(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: FunctionCtx, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor
    ) -> Tensor:
        osd = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()  # Cauchy-Schwarz bound factors
        out = torch.empty_like(cov, memory_format=torch.contiguous_format)
        blocks = _row_bands(cov.shape[0], cov.shape[-1], BLOCK)
        ws = _Workspace(
            cov, max((n1 - n0) * (r1 - r0) * (cov.shape[-1] - r0) for n0, n1, r0, r1 in blocks)
        )
        for sl in blocks:
            n0, n1, r0, r1 = sl
            raw = _Block(ws, cov, sd, mu, cdf, sl).raw()
            bound = torch.mul(osd[n0:n1, r0:r1, None], osd[n0:n1, None, r0:], out=ws.take())
            torch.minimum(raw, bound, out=raw)
            torch.maximum(raw, bound.neg_(), out=raw)
            # the lower part, mirrored (a single matrix uses the blocked 2-D transpose kernel)
            mirror = raw[0].t().contiguous() if n1 - n0 == 1 else raw.transpose(-1, -2)
            out[n0:n1, r0:, r0:r1] = mirror
            out[n0:n1, r0:r1, r0:] = raw
            square = out[n0:n1, r0:r1, r0:r1]  # its own lower triangle: mirror the upper
            square.copy_(square.triu(1) + square.triu().transpose(-1, -2))
        out.diagonal(dim1=-2, dim2=-1).copy_(var)
        ctx.save_for_backward(cov, sd, mu, cdf, var, osd)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, ...]:
        cov, sd, mu, cdf, var, osd = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        g_cov = torch.zeros_like(cov, memory_format=torch.contiguous_format)
        g_sd, g_mu, g_cdf, g_osd = (torch.zeros_like(sd) for _ in range(4))
        unclipped, huge = 1 - clip_eps(cov.dtype), big(cov.dtype)
        blocks = _row_bands(cov.shape[0], cov.shape[-1], BLOCK)
        ws = _Workspace(
            cov, max((n1 - n0) * (r1 - r0) * (cov.shape[-1] - r0) for n0, n1, r0, r1 in blocks)
        )
        for sl in blocks:
            n0, n1, r0, r1 = sl
            b = _Block(ws, cov, sd, mu, cdf, sl)
            g = _sym_sum(ws, grad, sl)
            raw = b.raw()
            osd_j, osd_l = osd[n0:n1, r0:r1, None], osd[n0:n1, None, r0:]
            excess = torch.abs(raw, out=ws.take()).sub_(osd_j * osd_l)
            if excess.amax() > 0:  # the Cauchy-Schwarz clamp bit: route those to the bound
                inside = excess.mul_(-huge).clamp_(0, 1)
                g_bound = (1 - inside).mul_(g).mul_(raw.sign())
                g_osd[n0:n1, r0:r1] += (g_bound * osd_l).sum(-1)
                g_osd[n0:n1, r0:] += (g_bound * osd_j).sum(-2)
                g.mul_(inside)
            # dK/drho (module docstring of _relu), zero where rho was clipped
            inv_q = torch.div(b.inv, b.rho_bar, out=ws.take())
            tmp = torch.mul(b.p, b.rho, out=ws.take())
            p_beta = torch.mul(b.rho, b.inv, out=ws.take()).mul_(-2).add_(b.asin)
            p_beta.addcmul_(tmp, inv_q).mul_(b.beta)
            p_gamma = (
                torch.mul(b.rho, b.rho, out=tmp).mul_(inv_q).addcmul_(b.gamma, b.asin, value=-1)
            )
            d_rho = torch.mul(p_beta, b.sum_sq, out=ws.take()).neg_().add_(b.asin)
            d_rho.addcmul_(p_gamma, b.prod).mul_(b.gauss).mul_(INV_2PI)
            d_rho.mul_(torch.abs(b.rho, out=inv_q).neg_().add_(unclipped).mul_(huge).clamp_(0, 1))
            gc = torch.mul(b.cdf_j, b.cdf_l, out=tmp).add_(d_rho).mul_(g)
            g_cov[n0:n1, r0:r1, r0:] = gc
            h = torch.mul(g, b.cov, out=tmp)
            g_cdf[n0:n1, r0:r1] += (h @ cdf[n0:n1, r0:, None]).squeeze(-1)
            g_cdf[n0:n1, r0:] += (cdf[n0:n1, None, r0:r1] @ h).squeeze(-2)
            sk = b.p.mul_(b.gauss).mul_(b.scale).mul_(INV_2PI)  # S K
            u = torch.mul(sk, g, out=tmp)  # dC/dmu_j = S K (gamma mu_l - 2 beta mu_j)
            ub = torch.mul(u, b.beta, out=p_beta)
            ug = u.mul_(b.gamma)
            g_mu[n0:n1, r0:r1] += (ug @ mu[n0:n1, r0:, None]).squeeze(-1)
            g_mu[n0:n1, r0:r1] -= 2 * mu[n0:n1, r0:r1] * ub.sum(-1)
            g_mu[n0:n1, r0:] += (mu[n0:n1, None, r0:r1] @ ug).squeeze(-2)
            g_mu[n0:n1, r0:] -= 2 * mu[n0:n1, r0:] * ub.sum(-2)
            v = sk.sub_(d_rho.mul_(b.cov)).mul_(g)  # s_j dC/ds_j
            g_sd[n0:n1, r0:r1] += v.sum(-1)
            g_sd[n0:n1, r0:] += v.sum(-2)
        g_var = grad.diagonal(dim1=-2, dim2=-1) + g_osd * 0.5 / osd * (
            var >= torch.finfo(var.dtype).tiny
        )
        return g_cov, g_sd / sd, g_mu, g_cdf, g_var


# ------------------------------------------------------------------- whole-tensor formula
def _masks(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``[d, d]`` bools: strictly upper triangle, and the diagonal."""
    idx = torch.arange(d, device=device)
    return idx[:, None] < idx[None, :], idx[:, None] == idx[None, :]


def _terms(cov: Tensor, sd: Tensor, mu: Tensor) -> tuple[Tensor, ...]:
    """Shared intermediates of the correction term on whole ``[n, D, D]`` tensors."""
    eps = clip_eps(cov.dtype)
    sd_j, sd_l = sd[..., :, None], sd[..., None, :]
    mu_j, mu_l = mu[..., :, None], mu[..., None, :]
    scale = sd_j * sd_l
    rho = (cov / scale).clamp(-1 + eps, 1 - eps)
    asin = torch.asin(rho)
    rho2 = rho * rho
    rho_bar = torch.sqrt(1 - rho2)
    inv = 1 / (1 + rho_bar)
    p = (asin - rho * inv) * rho  # P = rho (asin rho - rho / (1 + rho_bar))
    p_safe = p.clamp_min(floors(cov.dtype)[3])
    beta = rho2 * inv / p_safe * 0.5
    gamma = (asin - rho) / p_safe
    sq = mu * mu
    sum_sq = sq[..., :, None] + sq[..., None, :]
    prod = mu_j * mu_l
    gauss = torch.exp(-(beta * sum_sq - gamma * prod))  # e^{-Q}
    sk = p * gauss * scale * INV_2PI  # S K
    return scale, rho, asin, rho_bar, inv, p, beta, gamma, sum_sq, prod, gauss, sk


def relu_cov_forward(cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor) -> Tensor:
    r"""The clamped ReLU covariance on whole ``[n, D, D]`` tensors (the formula of the module).

    Reads the upper triangle of ``cov`` only and returns an exactly symmetric matrix with
    ``var`` on its diagonal; the arguments are those of :func:`relu_cov`, flattened to one
    batch dimension.
    """
    upper, eye = _masks(cov.shape[-1], cov.device)
    cov = torch.where(upper.mT, cov.mT, cov)  # the lower triangle mirrors the upper
    sk = _terms(cov, sd, mu)[-1]
    raw = sk + cov * (cdf[..., :, None] * cdf[..., None, :])
    osd = var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()
    bound = osd[..., :, None] * osd[..., None, :]
    out = torch.maximum(torch.minimum(raw, bound), -bound)
    # exact symmetry (kernels may round (j, l) and (l, j) differently) and the exact diagonal
    return torch.where(upper, out, torch.where(eye, var[..., :, None], out.mT))


def relu_cov_backward(
    grad: Tensor, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""Closed-form vector-Jacobian product of :func:`relu_cov_forward` (module docstring).

    With :math:`G = g + g^\top` off the diagonal (the output is symmetric and only the upper
    triangle of ``cov`` is read), every per-unit gradient is one row sum over the symmetric
    matrices, so the backward is a fixed set of whole-tensor kernels.

    Returns:
        Gradients for ``(cov, sd, mu, cdf, var)``; the one for ``cov`` lives on the strict
        upper triangle.
    """
    upper, eye = _masks(cov.shape[-1], cov.device)
    unclipped, huge, tiny = 1 - clip_eps(cov.dtype), big(cov.dtype), torch.finfo(var.dtype).tiny
    cov = torch.where(upper.mT, cov.mT, cov)
    _, rho, asin, rho_bar, inv, p, beta, gamma, sum_sq, prod, gauss, sk = _terms(cov, sd, mu)
    g = torch.where(eye, 0, grad + grad.mT)
    cdf_j, cdf_l = cdf[..., :, None], cdf[..., None, :]
    raw = sk + cov * (cdf_j * cdf_l)
    osd = var.clamp_min(tiny).sqrt()
    excess = raw.abs() - osd[..., :, None] * osd[..., None, :]
    inside = (excess * -huge).clamp(0, 1)  # 0 where the Cauchy-Schwarz clamp bit
    g_osd = ((1 - inside) * g * raw.sign() * osd[..., None, :]).sum(-1)
    g = g * inside
    # dK/drho, zero where rho was clipped
    inv_q = inv / rho_bar
    p_beta = (asin - 2 * rho * inv + p * rho * inv_q) * beta
    p_gamma = rho * rho * inv_q - gamma * asin
    d_rho = (asin - p_beta * sum_sq + p_gamma * prod) * gauss * INV_2PI
    d_rho = d_rho * ((unclipped - rho.abs()) * huge).clamp(0, 1)
    g_cov = torch.where(upper, (cdf_j * cdf_l + d_rho) * g, 0)
    g_cdf = (g * cov * cdf_l).sum(-1)
    u = sk * g  # dC/dmu_j = S K (gamma mu_l - 2 beta mu_j)
    g_mu = (u * gamma * mu[..., None, :]).sum(-1) - 2 * mu * (u * beta).sum(-1)
    g_sd = ((sk - d_rho * cov) * g).sum(-1) / sd  # s_j dC/ds_j, over s_j
    g_var = grad.diagonal(dim1=-2, dim2=-1) + g_osd * 0.5 / osd * (var >= tiny)
    return g_cov, g_sd, g_mu, g_cdf, g_var


def _run_forward(path: str, cov: Tensor, *vecs: Tensor) -> Tensor:
    fn = policy.compiled("relu_cov_forward", relu_cov_forward) if path == "compiled" else None
    fwd = fn or relu_cov_forward
    n, d = cov.shape[0], cov.shape[-1]
    size = policy.chunk_size(n, d, cov.dtype, path)
    if size >= n:
        return fwd(cov, *vecs)
    out = torch.empty_like(cov, memory_format=torch.contiguous_format)
    for a, b in policy.chunks(n, size):
        out[a:b] = fwd(cov[a:b], *(v[a:b] for v in vecs))
    return out


def _run_backward(path: str, grad: Tensor, cov: Tensor, *vecs: Tensor) -> tuple[Tensor, ...]:
    fn = policy.compiled("relu_cov_backward", relu_cov_backward) if path == "compiled" else None
    bwd = fn or relu_cov_backward
    n, d = cov.shape[0], cov.shape[-1]
    size = policy.chunk_size(n, d, cov.dtype, path)
    if size >= n:
        return bwd(grad, cov, *vecs)
    parts = [bwd(grad[a:b], cov[a:b], *(v[a:b] for v in vecs)) for a, b in policy.chunks(n, size)]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


class _ReluCovWhole(torch.autograd.Function):
    """:func:`relu_cov_forward` with :func:`relu_cov_backward`, chunked over the batch."""

    @staticmethod
    def forward(
        ctx: FunctionCtx, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, path: str
    ) -> Tensor:
        ctx.save_for_backward(cov, sd, mu, cdf, var)
        ctx.path = path  # type: ignore[attr-defined]  # ctx carries the path to backward
        return _run_forward(path, cov, sd, mu, cdf, var)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        return (*_run_backward(ctx.path, grad, *saved), None)  # type: ignore[attr-defined]  # set in forward


def relu_cov(cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor) -> Tensor:
    r"""ReLU output covariance ``[..., D, D]`` from the input's statistics, closed-form backward.

    Runs the blocked loop or the whole-tensor kernels as
    :func:`lightning_dvi.moments.policy.resolve` decides for the tensors' device.

    Args:
        cov: input covariance ``[..., D, D]`` (symmetric; only the upper triangle is read).
        sd: input standard deviations ``[..., D]`` (floored).
        mu: standardised input means ``[..., D]`` (clamped).
        cdf: :math:`\Phi(\mu)`, ``[..., D]``.
        var: exact output variances ``[..., D]``: the diagonal and the Cauchy-Schwarz bound.
    """
    d = cov.shape[-1]
    lead = cov.shape[:-2]
    flat = [t.reshape(-1, d) for t in (sd, mu, cdf, var)]
    path = policy.resolve(cov.device)
    if path == "blocked":
        out = _ReluCov.apply(cov.reshape(-1, d, d), *flat)
    else:
        out = _ReluCovWhole.apply(cov.reshape(-1, d, d), *flat, path)
    return out.reshape(*lead, d, d)  # type: ignore[no-any-return]  # Function.apply returns Any

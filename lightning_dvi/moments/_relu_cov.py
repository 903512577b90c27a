r"""The full ReLU covariance: one formula, executed block by block (CPU) or whole (GPU).

Forward, for :math:`j < l` (the diagonal is the exact variance, the lower triangle a copy):

.. math::
    C_{jl} = \operatorname{clamp}\Big(\Sigma_{jl}\Phi_j\Phi_l + \sigma_j\sigma_l K(\rho_{jl},
    \mu_j, \mu_l),\ \pm\sqrt{V_jV_l}\Big),

with :math:`K` and its derivatives as in :mod:`lightning_dvi.moments._relu` and :math:`V` the
exact output variances (the Cauchy-Schwarz clamp of
:func:`~lightning_dvi.moments.activations.relu_full`).

**The formula, once.** :class:`_Terms`, :func:`_raw`, :func:`_clamp`, :func:`_coefficients`
and :func:`_apply` write the forward and its closed-form backward elementwise over
*broadcastable operands*: a column of the row units' statistics (``sd_j``, ``mu_j``, ``cdf_j``,
``osd_j``, ``[n, r, 1]``), a row of the column units' (``sd_l``, ... ``[n, 1, c]``) and the
matching ``[n, r, c]`` entries of the covariance and of the output gradient. Every intermediate
is written with ``out=`` into a buffer from a *scratch allocator*: :class:`_Workspace` hands out
reused block-sized buffers, :data:`_FRESH` hands out ``None`` (torch allocates the result; what
the whole-tensor path and ``torch.compile`` want). The in-place updates that follow are safe
either way, every buffer being private to the call. The backward is linear in the output
gradient: :func:`_coefficients` computes its per-pair factors from the forward's terms alone
(:class:`_Coefficients`), and :func:`_apply` multiplies them by :math:`G` and hands each piece
to an ``emit`` callback. The per-unit gradients are contractions of those pieces
:math:`A_{jl}` over the pairs that contain the unit,

.. math::
    \bar\Phi_j = \sum_l h_{jl}\Phi_l,\quad
    \bar\mu_j = \sum_l u_{jl}\gamma_{jl}\mu_l - 2\mu_j\sum_l u_{jl}\beta_{jl},\quad
    \bar\sigma_j = \frac1{\sigma_j}\sum_l v_{jl},\quad
    \bar V_j = G_{jj} + \frac{[V_j \ge \text{tiny}]}{2\sqrt{V_j}}\sum_l b_{jl}\sqrt{V_l},

assembled once by :func:`_unit_grads` (:math:`h = G\Sigma`, :math:`u = GSK`,
:math:`v = G(SK - \Sigma\,\partial_\rho K)`, :math:`b` the gradient routed to the clamp bound,
:math:`G = g + g^\top` the symmetrised output gradient).

**Two executors** (:mod:`lightning_dvi.moments.policy` chooses):

* *blocked* (the CPU): the formula on blocks of each pair :math:`j < l` once (the symmetric
  pairs halve the work), with one :class:`_Workspace` reused by every block. Small matrices
  (:math:`D^2 \le` :data:`BLOCK`, :class:`_ReluCovBand`) are laid out as circulant bands:
  unit :math:`j`'s pairs are :math:`(j, (j + o) \bmod D)` for the offsets
  :math:`o = 1 \dots \lfloor D/2\rfloor`, a ``[n, K, D]`` tensor whose covariance is
  gathered from the upper triangle while the units' statistics are strided views (the row
  unit a broadcast row, the partner a window of the doubled vector); groups of rows of about
  ``2 * BLOCK`` band elements per block (each op of the formula costs a dispatch per block).
  A larger matrix (:class:`_ReluCov`) is cut into row bands of about :data:`BLOCK` elements
  of its upper triangle. The forward computes each block's terms once and, when the
  backward will run and :func:`policy.keep_factors` allows (a quarter of the memory budget),
  the backward's factors from the same terms: the backward is then a few products with
  :math:`G` and the contractions, with nothing recomputed. Past that budget the backward
  computes the terms and factors again, block by block (the peak memory stays a few blocks on
  top of the output). Each pair's piece is contracted for both of its units: on circulant
  bands a sum over the offsets (row unit) and one along the anti-diagonals of the doubled
  band (partner), on row bands matrix-vector products. A host read per block skips the
  clamp and its gradient where no entry binds (free on a CPU). Why blocks: the formula is
  ~70 elementwise passes; whole tensors would allocate a fresh output per pass (for tensors
  above glibc's mmap threshold every allocation page-faults its memory in again), blocks
  reuse their buffers.
* *whole* (:func:`relu_cov_forward`, :func:`relu_cov_backward`, chunked over the batch by
  :class:`_ReluCovWhole`; CUDA, and anything ``torch.compile`` traces): the same functions on
  the whole ``[n, D, D]``, with the covariance mirrored to a symmetric matrix, fresh
  allocations and the contractions as row sums of symmetric matrices (which inductor fuses
  into the elementwise kernels): a fixed sequence of kernels with no host synchronisation and
  no Python loop over matrices.

The tests hold the two executors to 1e-6 relative in float64, values and gradients.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy
from ._relu import INV_2PI, big, clip_eps, floors
from .special import flush, tail_cutoff

__all__ = ["BLOCK", "relu_cov", "relu_cov_backward", "relu_cov_forward"]

BLOCK = 1 << 16
"""Target elements per block (256 KiB in float32); ~20 scratch buffers of this size."""


def _row_bands(n: int, d: int, target: int) -> list[tuple[int, int, int, int]]:
    """Blocks ``(n0, n0 + 1, r0, r1)``: matrix ``n0``, rows ``r0:r1``, columns ``r0:d``.

    Each matrix is cut into row bands of about ``target`` elements of its upper triangle
    (the executor of matrices larger than ``target``; smaller ones go to :class:`_ReluCovBand`).
    """
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


# ------------------------------------------------------------------- scratch allocators
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
        if self.next > _BUFFERS:  # more than the formula is known to need: a fresh one
            return self.bufs.new_empty(self.shape)
        return self.bufs.as_strided(self.shape, self.stride, (self.next - 1) * self.size)

    def take_many(self, k: int) -> Tensor:
        """``k`` consecutive free buffers as one ``[k, *shape]`` tensor."""
        self.next += k
        if self.next > _BUFFERS:  # more than the formula is known to need: a fresh one
            return self.bufs.new_empty((k, *self.shape))
        return self.bufs.as_strided(
            (k, *self.shape), (self.size, *self.stride), (self.next - k) * self.size
        )

    def reuse(self, buf: Tensor) -> Tensor:
        """``buf`` itself: its value is dead, its memory takes the next result."""
        return buf


_BUFFERS = 30


class _Fresh:
    """The whole-tensor path's allocator: no buffers, every op allocates its own result."""

    def take(self) -> Tensor | None:
        """``None``: as ``out=``, torch allocates a fresh tensor."""
        return None

    def reuse(self, buf: Tensor) -> Tensor | None:
        """``None`` as well (``torch.compile`` rejects ``out=`` tensors of unknown layout)."""
        return None


_FRESH = _Fresh()
_Scratch = _Workspace | _Fresh
_Emit = Callable[[str, Tensor], None]

_PARTNERS = {"osd": "osd", "cdf": "cdf", "mu": "mu", "ub": None, "sd": None}
"""Per-pair pieces emitted by :func:`_apply` and the per-unit vector each is contracted with."""


# ------------------------------------------------------------------------ the formula
class _Terms:
    r"""Intermediates of :math:`K` on one set of operands (a block, or the whole matrices).

    ``cov`` is ``[n, r, c]``; ``sd_j``, ``mu_j`` are ``[n, r, 1]`` and ``sd_l``, ``mu_l``
    ``[n, 1, c]`` (module docstring). The buffers hold, in the notation of
    :mod:`lightning_dvi.moments._relu`: :math:`S = \sigma_j\sigma_l`, :math:`\rho` (clipped),
    :math:`\arcsin\rho`, :math:`\bar\rho`, :math:`1/(1+\bar\rho)`, :math:`P`, :math:`\beta`,
    :math:`\gamma`, :math:`\mu_j^2+\mu_l^2`, :math:`\mu_j\mu_l` and :math:`e^{-Q}`.
    """

    def __init__(
        self,
        ws: _Scratch,
        cov: Tensor,
        sd_j: Tensor,
        sd_l: Tensor,
        mu_j: Tensor,
        mu_l: Tensor,
        gain: float = 1.0,
    ) -> None:
        eps = clip_eps(cov.dtype)
        self.cov = cov
        self.scale = torch.mul(sd_j, sd_l, out=ws.take())
        self.rho = torch.div(cov, self.scale, out=ws.take()).clamp_(-1 + eps, 1 - eps)
        self.asin = torch.asin(self.rho, out=ws.take())
        rho2 = torch.mul(self.rho, self.rho, out=ws.take())
        self.rho_bar = torch.neg(rho2, out=ws.take()).add_(1).sqrt_()
        self.inv = torch.add(self.rho_bar, 1, out=ws.take()).reciprocal_()  # 1 / (1 + rho_bar)
        self.p = torch.mul(self.rho, self.inv, out=ws.take())
        self.p.neg_().add_(self.asin).mul_(self.rho)  # P = rho (asin rho - rho / (1 + rho_bar))
        p_safe = torch.clamp(self.p, min=floors(cov.dtype)[3], out=ws.take())
        self.beta = rho2.mul_(self.inv).div_(p_safe).mul_(0.5)
        self.gamma = torch.sub(self.asin, self.rho, out=ws.take()).div_(p_safe)
        self.sum_sq = torch.add(mu_j * mu_j, mu_l * mu_l, out=ws.take())
        self.prod = torch.mul(mu_j, mu_l, out=ws.take())
        quad = torch.mul(self.beta, self.sum_sq, out=ws.take())
        quad.addcmul_(self.gamma, self.prod, value=-1).clamp_(max=_q_max(cov.dtype))
        # e^{-Q} (times the gain), exactly 0 where it would be below the tail cutoff
        self.gauss = F.threshold(quad.neg_().exp_(), tail_cutoff(cov.dtype), 0.0, inplace=True)
        if gain != 1.0:
            self.gauss.mul_(gain)


def _q_max(dtype: torch.dtype) -> float:
    """A bound on :math:`Q` past which :math:`e^{-Q}` is below the tail cutoff (then flushed)."""
    return 1.0 - math.log(tail_cutoff(dtype))


def _raw(ws: _Scratch, t: _Terms, cdf_j: Tensor, cdf_l: Tensor) -> tuple[Tensor, Tensor]:
    r"""``(S K, C)``: the correction :math:`\sigma_j\sigma_l K` and the unclamped covariance."""
    sk = torch.mul(t.p, t.gauss, out=ws.take()).mul_(t.scale).mul_(INV_2PI)
    cdf_prod = torch.mul(cdf_j, cdf_l, out=ws.take())
    return sk, torch.addcmul(sk, t.cov, cdf_prod, out=ws.reuse(cdf_prod))


def _clamp(ws: _Scratch, raw: Tensor, osd_j: Tensor, osd_l: Tensor) -> Tensor:
    r"""``raw`` clamped to :math:`\pm\sqrt{V_jV_l}` in place (``osd`` = :math:`\sqrt V`)."""
    bound = torch.mul(osd_j, osd_l, out=ws.take())
    raw = torch.minimum(raw, bound, out=ws.reuse(raw))
    return torch.maximum(raw, bound.neg_(), out=ws.reuse(raw))


def _bound_factors(var: Tensor) -> Tensor:
    r""":math:`\sqrt V`, floored so that its derivative stays finite (the clamp's factors)."""
    return var.clamp_min(torch.finfo(var.dtype).tiny).sqrt()


class _Coefficients:
    r"""The backward's per-pair factors, linear in nothing but :math:`G` (forward-computable).

    The closed-form backward is linear in the symmetrised output gradient :math:`G`: each
    per-pair piece of the module docstring is a factor of the forward's intermediates times
    :math:`G`. These are those factors (all ``[n, r, c]``, on the operands of one
    :class:`_Terms`):

    * ``dcov`` = :math:`\Phi_j\Phi_l + \partial_\rho K`: the gradient of :math:`\Sigma_{jl}`
      per unit of :math:`G`;
    * ``ub`` = :math:`SK\beta` and ``mu`` = :math:`SK\gamma`: the mean pieces;
    * ``sd`` = :math:`SK - \Sigma\,\partial_\rho K`: :math:`\sigma_j\,\partial C/\partial\sigma_j`;
    * ``clamp``: ``None`` where no entry's Cauchy-Schwarz clamp binds, else ``(inside,
      outside)``: 0/1 weights of the formula and :math:`\pm1` (the sign of the unclamped
      value) where the clamp routed the entry to its bound.

    The ``cdf`` piece's factor is :math:`\Sigma` itself (``t.cov``).
    """

    __slots__ = ("clamp", "dcov", "mu", "sd", "ub")

    def __init__(
        self, dcov: Tensor, ub: Tensor, mu: Tensor, sd: Tensor, clamp: tuple[Tensor, Tensor] | None
    ) -> None:
        self.dcov, self.ub, self.mu, self.sd, self.clamp = dcov, ub, mu, sd, clamp


def _coefficients(
    ws: _Scratch,
    keep: _Scratch | _Kept,
    t: _Terms,
    sk: Tensor,
    raw: Tensor,
    cdf: tuple[Tensor, Tensor],
    excess: Tensor | None,
) -> _Coefficients:
    r"""The :class:`_Coefficients` of the operands of ``t``: the formula of the backward.

    ``sk`` and ``raw`` are :func:`_raw`'s (read, not modified), ``cdf`` ``(cdf_j, cdf_l)``,
    ``excess`` :math:`|C| - \sqrt{V_jV_l}` (modified in place) or ``None`` when no entry binds.
    Temporaries come from ``ws``; the factors that the caller keeps from ``keep`` (the same
    allocator when they die with the block, a longer-lived one when the forward saves them).
    """
    unclipped, huge = 1 - clip_eps(t.cov.dtype), big(t.cov.dtype)
    # dK/drho (module docstring of _relu), zero where rho was clipped
    inv_q = torch.div(t.inv, t.rho_bar, out=ws.take())
    tmp = torch.mul(t.p, t.rho, out=ws.take())
    p_beta = torch.mul(t.rho, t.inv, out=ws.take()).mul_(-2).add_(t.asin)
    p_beta.addcmul_(tmp, inv_q).mul_(t.beta)
    p_gamma = (
        torch.mul(t.rho, t.rho, out=ws.reuse(tmp)).mul_(inv_q).addcmul_(t.gamma, t.asin, value=-1)
    )
    d_rho = torch.addcmul(t.asin, p_beta, t.sum_sq, value=-1, out=ws.take())
    d_rho.addcmul_(p_gamma, t.prod).mul_(t.gauss)
    # times 1/2pi where rho was not clipped, 0 where it was
    clip = torch.abs(t.rho, out=ws.reuse(inv_q)).neg_().add_(unclipped).mul_(huge)
    d_rho.mul_(clip.clamp_(0, INV_2PI))
    dcov = torch.mul(cdf[0], cdf[1], out=keep.take()).add_(d_rho)  # dC/dSigma
    ub = torch.mul(sk, t.beta, out=keep.take())  # dC/dmu_j = S K (gamma mu_l - 2 beta mu_j)
    mu = torch.mul(sk, t.gamma, out=keep.take())
    sd = torch.sub(sk, d_rho.mul_(t.cov), out=keep.take())  # s_j dC/ds_j
    clamp = None
    if excess is not None:  # the Cauchy-Schwarz clamp: route to the bound
        inside = torch.mul(excess, -huge, out=keep.take()).clamp_(0, 1)  # 0 where it bit
        outside = torch.sign(raw, out=keep.take()).mul_(torch.sub(1, inside, out=ws.take()))
        clamp = (inside, outside)
    return _Coefficients(dcov, ub, mu, sd, clamp)


def _apply(
    ws: _Scratch, c: _Coefficients, cov: Tensor, g: Tensor, emit: _Emit, out: Tensor | None = None
) -> Tensor:
    r"""The backward given :math:`G` and the factors: returns the gradient of :math:`\Sigma`.

    ``g`` is :math:`G` on these entries (zero where an entry is not to count; modified in
    place), ``cov`` :math:`\Sigma` on them. Each per-pair piece is handed to
    ``emit(name, piece)`` as soon as it is complete (its buffer is reused afterwards); the names
    and the vectors they are contracted with are :data:`_PARTNERS`. The gradient of
    :math:`\Sigma` is written into ``out`` when given.
    """
    if c.clamp is not None:
        inside, outside = c.clamp
        emit("osd", torch.mul(outside, g, out=ws.take()))
        g.mul_(inside)
    g_cov = torch.mul(c.dcov, g, out=out)
    piece = torch.mul(g, cov, out=ws.take())
    emit("cdf", piece)  # dC/dPhi_j = Sigma Phi_l
    emit("ub", torch.mul(c.ub, g, out=ws.reuse(piece)))
    emit("mu", torch.mul(c.mu, g, out=ws.reuse(piece)))
    emit("sd", torch.mul(c.sd, g, out=ws.reuse(piece)))
    return g_cov


def _excess(ws: _Scratch, raw: Tensor, osd: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    r"""``(bound, excess)``: :math:`\sqrt{V_jV_l}` and :math:`|C| - \sqrt{V_jV_l}`."""
    bound = torch.mul(osd[0], osd[1], out=ws.take())
    return bound, torch.abs(raw, out=ws.take()).sub_(bound)


def _unit_grads(
    sums: dict[str, Tensor], grad: Tensor, sd: Tensor, mu: Tensor, var: Tensor, osd: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Gradients for ``(sd, mu, cdf, var)`` from the contracted pieces (module docstring)."""
    g_mu = sums["mu"].sub_(2 * mu * sums["ub"])
    g_var = grad.diagonal(dim1=-2, dim2=-1) + sums["osd"] * 0.5 / osd * (
        var >= torch.finfo(var.dtype).tiny
    )
    return sums["sd"] / sd, g_mu, sums["cdf"], g_var


# ------------------------------------------------------------- executor 1: CPU blocks
def _slices(x: Tensor, sl: tuple[int, int, int, int]) -> tuple[Tensor, Tensor]:
    """Row operand ``[nb, rows, 1]`` and column operand ``[nb, 1, cols]`` of ``x`` on a block."""
    n0, n1, r0, r1 = sl
    return x[n0:n1, r0:r1, None], x[n0:n1, None, r0:]


def _block_terms(
    ws: _Workspace,
    cov: Tensor,
    sd: Tensor,
    mu: Tensor,
    sl: tuple[int, int, int, int],
    gain: float,
) -> _Terms:
    """The terms on a block (a row band of one matrix's upper triangle)."""
    n0, n1, r0, r1 = sl
    ws.start((n1 - n0, r1 - r0, cov.shape[-1] - r0))
    block = cov[n0:n1, r0:r1, r0:]
    return _Terms(ws, block, *_slices(sd, sl), *_slices(mu, sl), gain)


def _workspace(cov: Tensor, blocks: list[tuple[int, int, int, int]]) -> _Workspace:
    d = cov.shape[-1]
    return _Workspace(cov, max((n1 - n0) * (r1 - r0) * (d - r0) for n0, n1, r0, r1 in blocks))


def _sym_sum(ws: _Workspace, grad: Tensor, sl: tuple[int, int, int, int]) -> Tensor:
    """``G_jl + G_lj`` on the block, zero on and below the diagonal of its square part."""
    n0, n1, r0, r1 = sl
    g = torch.add(grad[n0:n1, r0:r1, r0:], grad[n0:n1, r0:, r0:r1].transpose(-1, -2), out=ws.take())
    rows = r1 - r0
    g[..., :rows].mul_(torch.ones(rows, rows, dtype=g.dtype, device=g.device).triu_(1))
    return g


def _keep_factors(ctx: FunctionCtx, cov: Tensor) -> bool:
    """Whether the forward keeps the backward's factors (:func:`policy.keep_factors`)."""
    needs = ctx.needs_input_grad  # type: ignore[attr-defined]  # set by Function.apply
    return any(needs[:4]) and policy.keep_factors(cov.numel() * _KEPT, cov.dtype)


_KEPT = 4
"""Full-size factors a forward keeps for its backward (:class:`_Coefficients` but the clamp)."""


class _Kept:
    """An allocator over ``stack`` (``[_KEPT, *block]``): its buffers in order, then fresh ones.

    The forward's kept factors live in one fresh stack per block; the clamp's two rare factors
    are allocated apart.
    """

    def __init__(self, stack: Tensor) -> None:
        self.stack, self.bufs, self.next = stack, stack.unbind(0), 0

    def take(self) -> Tensor:
        """The next buffer of the stack, or a fresh one past its end."""
        self.next += 1
        if self.next > len(self.bufs):
            return torch.empty_like(self.bufs[0])
        return self.bufs[self.next - 1]

    def reuse(self, buf: Tensor) -> Tensor:
        """Not used for kept factors (each is alive until the backward)."""
        return buf


def _factors(
    ws: _Workspace,
    keep: _Scratch | _Kept | None,
    t: _Terms,
    cdf: tuple[Tensor, Tensor],
    osd: tuple[Tensor, Tensor],
) -> tuple[Tensor, Tensor | None, _Coefficients | None]:
    """A block's unclamped covariance, the clamp's bound where it binds, and the factors.

    ``cdf`` and ``osd`` are the ``(row unit, partner)`` operands of the block; the factors are
    written through ``keep`` (``None``: not computed). The host read (does any entry bind?)
    skips the clamp in the forward and its gradient in the backward where no entry binds: free
    on a CPU. Both executors (row bands and circulant bands) call this.
    """
    sk, raw = _raw(ws, t, *cdf)
    bound, excess = _excess(ws, raw, osd)
    binds = bool(excess.amax() > 0)
    coefs = None
    if keep is not None:
        coefs = _coefficients(ws, keep, t, sk, raw, cdf, excess if binds else None)
    return raw, bound if binds else None, coefs


def _clamp_to(raw: Tensor, bound: Tensor) -> None:
    r"""``raw`` clamped to :math:`\pm` ``bound`` in place (``bound`` is negated in place)."""
    torch.maximum(torch.minimum(raw, bound, out=raw), bound.neg_(), out=raw)


class _ReluCov(torch.autograd.Function):
    """The row-band executor: the formula on row bands of each matrix's upper triangle.

    For matrices larger than :data:`BLOCK` (smaller ones: :class:`_ReluCovBand`). The forward
    computes each block's terms once; when the policy lets it keep them
    (:func:`policy.keep_factors`), it also computes the backward's factors
    (:class:`_Coefficients`) from the same terms and keeps them, so the backward is a few
    products with the output gradient and the contractions. Otherwise the backward computes
    the terms and factors again, block by block (the peak memory then stays a few blocks on top
    of the output). The per-pair pieces are contracted for both units of each pair.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, gain: float
    ) -> Tensor:
        osd = _bound_factors(var)
        out = torch.empty_like(cov, memory_format=torch.contiguous_format)
        n, d = cov.shape[0], cov.shape[-1]
        blocks = _row_bands(n, d, BLOCK)
        ws = _workspace(cov, blocks)
        keep = _keep_factors(ctx, cov)
        kept: list[_Coefficients] = []
        for sl in blocks:
            n0, n1, r0, r1 = sl
            t = _block_terms(ws, cov, sd, mu, sl, gain)
            if keep:
                stack = torch.empty(_KEPT, *ws.shape, dtype=cov.dtype, device=cov.device)
                raw, bound, coefs = _factors(
                    ws, _Kept(stack), t, _slices(cdf, sl), _slices(osd, sl)
                )
                kept.append(cast(_Coefficients, coefs))
                if bound is not None:  # clamp to +-sqrt(V_j V_l) in place
                    _clamp_to(raw, bound)
            else:
                raw = _clamp(ws, _raw(ws, t, *_slices(cdf, sl))[1], *_slices(osd, sl))
            torch.hardshrink(raw, tail_cutoff(raw.dtype), out=raw)
            # the band's lower part, mirrored (the blocked 2-D transpose kernel)
            out[n0:n1, r0:, r0:r1] = raw[0].t().contiguous()
            out[n0:n1, r0:r1, r0:] = raw
            square = out[n0:n1, r0:r1, r0:r1]  # its own lower triangle: mirror the upper
            square.copy_(square.triu(1) + square.triu().transpose(-1, -2))
        out.diagonal(dim1=-2, dim2=-1).copy_(var)
        ctx.save_for_backward(cov, sd, mu, cdf, var, osd)
        ctx.gain, ctx.kept = gain, kept  # type: ignore[attr-defined]  # carried to backward
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        cov, sd, mu, cdf, var, osd = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        kept: list[_Coefficients] = ctx.kept  # type: ignore[attr-defined]  # set in forward
        ctx.kept = []  # type: ignore[attr-defined]  # the factors die with this backward
        n, d = cov.shape[0], cov.shape[-1]
        g_cov = torch.zeros_like(cov, memory_format=torch.contiguous_format)
        sums = {key: torch.zeros_like(sd) for key in _PARTNERS}
        vectors = {"osd": osd, "cdf": cdf, "mu": mu}
        blocks = _row_bands(n, d, BLOCK)
        ws = _workspace(cov, blocks)
        for i, sl in enumerate(blocks):
            n0, n1, r0, r1 = sl
            if kept:
                ws.start((n1 - n0, r1 - r0, d - r0))
                coefs = kept[i]
                block = cov[n0:n1, r0:r1, r0:]
            else:
                t = _block_terms(ws, cov, sd, mu, sl, ctx.gain)  # type: ignore[attr-defined]  # set in forward
                stack = ws.take_many(_KEPT)
                coefs = cast(
                    _Coefficients,
                    _factors(ws, _Kept(stack), t, _slices(cdf, sl), _slices(osd, sl))[2],
                )
                block = t.cov

            def emit(key: str, piece: Tensor, sl: tuple[int, int, int, int] = sl) -> None:
                # each pair j < l of the block counts for its row unit and its column unit
                n0, n1, r0, r1 = sl
                acc, partner = sums[key], _PARTNERS[key]
                if partner is None:
                    acc[n0:n1, r0:r1] += piece.sum(-1)
                    acc[n0:n1, r0:] += piece.sum(-2)
                else:
                    x = vectors[partner]
                    acc[n0:n1, r0:r1] += (piece @ x[n0:n1, r0:, None]).squeeze(-1)
                    acc[n0:n1, r0:] += (x[n0:n1, None, r0:r1] @ piece).squeeze(-2)

            g = _sym_sum(ws, grad, sl)
            _apply(ws, coefs, block, g, emit, out=g_cov[n0:n1, r0:r1, r0:])
        grads = (g_cov, *_unit_grads(sums, grad, sd, mu, var, osd))
        return *(flush(g) for g in grads), None


# -------------------------------------------- executor 1b: circulant bands (small, CPU)
def _band_rows(n: int, band: int, target: int) -> list[tuple[int, int]]:
    """Row blocks ``(n0, n1)`` of about ``2 * target`` band elements each (none if empty)."""
    if band == 0:
        return []
    nb = max(1, min(n, 2 * target // band))
    return [(n0, min(n, n0 + nb)) for n0 in range(0, n, nb)]


def _band_index(d: int, device: torch.device) -> tuple[Tensor, Tensor, int]:
    r"""``(upper, lower, pairs)`` for the circulant band of ``d x d`` matrices.

    Band entry ``[o, j]`` (flattened ``o D + j``) is the pair of unit :math:`j` and its
    partner :math:`l = (j + o + 1) \bmod D`, :math:`o < \lfloor D/2 \rfloor`: ``upper`` is its
    flat index in the upper triangle, :math:`\min(j,l) D + \max(j,l)`, ``lower`` the mirrored
    one. For even :math:`D` the last offset's second half repeats its first half: the first
    ``pairs`` = :math:`D(D-1)/2` entries hold every pair once.
    """
    k = d // 2
    j = torch.arange(d, device=device).repeat(k)
    partner = (j + torch.arange(1, k + 1, device=device).repeat_interleave(d)) % d
    lo, hi = torch.minimum(j, partner), torch.maximum(j, partner)
    return lo * d + hi, hi * d + lo, d * (d - 1) // 2


def _partner_of(v: Tensor, k: int) -> Tensor:
    """``[n, K, D]`` view of ``v`` (``[n, D]``): entry ``[i, o, j]`` is ``v[i, (j + o + 1) % D]``."""
    n, d = v.shape
    doubled = torch.cat([v, v], -1)
    return doubled.as_strided((n, k, d), (2 * d, 1, 1), 1)


def _to_partner(a: Tensor) -> Tensor:
    r"""``[n, D]``: for each unit :math:`l`, the sum of the band entries whose partner is :math:`l`.

    ``a[i, o, j]`` belongs to the pair ``(j, (j + o + 1) % D)``; unit :math:`l` collects
    ``a[i, o, (l - o - 1) % D]`` over the offsets ``o`` (anti-diagonals of the doubled band).
    """
    n, k, d = a.shape
    doubled = torch.cat([a, a], -1)  # [n, K, 2D]
    return doubled.as_strided((n, k, d), (2 * k * d, 2 * d - 1, 1), d - 1).sum(1)


def _band_factors(
    ws: _Workspace,
    keep: _Scratch | _Kept,
    c: Tensor,
    ops: dict[str, tuple[Tensor, Tensor]],
    gain: float,
    factors: bool,
) -> tuple[Tensor, _Coefficients | None]:
    """One row block's clamped band and (``factors``) the backward's factors.

    ``c`` is the covariance on the band (``[nb, K, D]``); ``ops`` maps ``sd``, ``mu``, ``cdf``
    and ``osd`` to their ``(row unit, partner)`` operands (``[nb, 1, D]``, ``[nb, K, D]``).
    """
    t = _Terms(ws, c, *ops["sd"], *ops["mu"], gain)
    raw, bound, coefs = _factors(ws, keep if factors else None, t, ops["cdf"], ops["osd"])
    if bound is not None:  # clamp to +-sqrt(V_j V_l) in place
        _clamp_to(raw, bound)
    return raw, coefs


def _band_block(
    ws: _Workspace, m: Tensor, index: Tensor, vectors: dict[str, Tensor], n0: int, n1: int
) -> tuple[Tensor, dict[str, tuple[Tensor, Tensor]]]:
    """A row block's covariance band (gathered into ``ws``) and its operands (strided views)."""
    k, d = ws.shape[1], ws.shape[2]
    flat = m[n0:n1].reshape(n1 - n0, d * d)
    c = torch.gather(flat, 1, index.expand(n1 - n0, -1), out=ws.take().view(n1 - n0, k * d))
    ops = {key: (v[n0:n1, None, :], _partner_of(v[n0:n1], k)) for key, v in vectors.items()}
    return c.view(n1 - n0, k, d), ops


class _ReluCovBand(torch.autograd.Function):
    r"""The formula on circulant bands: each pair ``j < l`` once (small matrices, CPU).

    Unit :math:`j`'s pairs are :math:`(j, (j + o) \bmod D)` for the offsets
    :math:`o = 1 \dots \lfloor D/2 \rfloor`: every unordered pair appears once (for even
    :math:`D` the last offset's second half repeats its first and gets a zero gradient
    weight), about half the elements of whole matrices. The covariance is gathered from the
    upper triangle; the units' statistics are strided views (the row unit a broadcast row,
    the partner a window of the doubled vector). Each per-unit contraction is a sum over the
    offsets (the row unit's) or along the anti-diagonals of the doubled band (the partner's).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, gain: float
    ) -> Tensor:
        n, d = cov.shape[0], cov.shape[-1]
        k = d // 2
        upper, lower, pairs = _band_index(d, cov.device)
        osd = _bound_factors(var)
        vectors = {"sd": sd, "mu": mu, "cdf": cdf, "osd": osd}
        blocks = _band_rows(n, k * d, BLOCK)
        ws = _Workspace(cov, max([(b - a) * k * d for a, b in blocks], default=0))
        keep = _band_keep(ctx, n * k * d, cov.dtype)
        kept: list[_Coefficients] = []
        band = cov.new_empty(n, k * d)
        for n0, n1 in blocks:
            ws.start((n1 - n0, k, d))
            c, ops = _band_block(ws, cov, upper, vectors, n0, n1)
            stack = cov.new_empty(_KEPT, *ws.shape) if keep else None
            raw, coefs = _band_factors(
                ws, _Kept(stack) if stack is not None else ws, c, ops, gain, keep
            )
            if coefs is not None:
                kept.append(coefs)
            torch.hardshrink(raw.view(n1 - n0, k * d), tail_cutoff(raw.dtype), out=band[n0:n1])
        once = band[:, :pairs]
        out = cov.new_empty(n, d * d)
        out.scatter_(1, upper[:pairs].expand(n, -1), once)
        out.scatter_(1, lower[:pairs].expand(n, -1), once)
        out = out.view(n, d, d)
        out.diagonal(dim1=-2, dim2=-1).copy_(var)
        ctx.save_for_backward(cov, sd, mu, cdf, var, osd)
        ctx.gain, ctx.kept = gain, kept  # type: ignore[attr-defined]  # carried to backward
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        cov, sd, mu, cdf, var, osd = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        kept: list[_Coefficients] = ctx.kept  # type: ignore[attr-defined]  # set in forward
        ctx.kept = []  # type: ignore[attr-defined]  # the factors die with this backward
        n, d = cov.shape[0], cov.shape[-1]
        k = d // 2
        upper, lower, pairs = _band_index(d, cov.device)
        vectors = {"sd": sd, "mu": mu, "cdf": cdf, "osd": osd}
        sums = {key: torch.zeros_like(sd) for key in _PARTNERS}
        g_band = cov.new_empty(n, k * d)
        g_flat = grad.reshape(n, d * d)
        blocks = _band_rows(n, k * d, BLOCK)
        ws = _Workspace(cov, max([(b - a) * k * d for a, b in blocks], default=0))
        for i, (n0, n1) in enumerate(blocks):
            ws.start((n1 - n0, k, d))
            c, ops = _band_block(ws, cov, upper, vectors, n0, n1)
            gain: float = ctx.gain  # type: ignore[attr-defined]  # set in forward
            recomputed = None if kept else _band_factors(ws, ws, c, ops, gain, True)[1]
            coefs = kept[i] if kept else recomputed
            assert coefs is not None  # kept, or just recomputed
            nb = n1 - n0
            g = torch.gather(g_flat[n0:n1], 1, upper.expand(nb, -1), out=ws.take().view(nb, -1))
            g.add_(torch.gather(g_flat[n0:n1], 1, lower.expand(nb, -1)))  # G = g + g^T
            g[:, pairs:] = 0  # each pair counts once
            g = g.view(nb, k, d)

            def emit(
                key: str,
                piece: Tensor,
                n0: int = n0,
                n1: int = n1,
                ops: dict[str, tuple[Tensor, Tensor]] = ops,
            ) -> None:
                acc, partner = sums[key][n0:n1], _PARTNERS[key]
                if partner is None:
                    acc += piece.sum(1)
                    acc += _to_partner(piece)
                else:
                    x_j, x_l = ops[partner]
                    acc += torch.mul(piece, x_l).sum(1)
                    acc += _to_partner(piece.mul_(x_j))

            _apply(ws, coefs, c, g, emit, out=g_band[n0:n1].view(nb, k, d))
        g_cov = torch.zeros_like(g_flat)
        g_cov.scatter_(1, upper[:pairs].expand(n, -1), g_band[:, :pairs])
        grads = (g_cov.view(n, d, d), *_unit_grads(sums, grad, sd, mu, var, osd))
        return *(flush(g) for g in grads), None


def _band_keep(ctx: FunctionCtx, numel: int, dtype: torch.dtype) -> bool:
    needs = ctx.needs_input_grad  # type: ignore[attr-defined]  # set by Function.apply
    return any(needs[:4]) and policy.keep_factors(numel * _KEPT, dtype)


# ------------------------------------------------ executor 2: whole tensors (GPU, compile)
def _masks(d: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``[d, d]`` bools: strictly upper triangle, and the diagonal."""
    idx = torch.arange(d, device=device)
    return idx[:, None] < idx[None, :], idx[:, None] == idx[None, :]


def _whole_terms(cov: Tensor, sd: Tensor, mu: Tensor, gain: float) -> tuple[Tensor, Tensor, _Terms]:
    upper, eye = _masks(cov.shape[-1], cov.device)
    cov = torch.where(upper.mT, cov.mT, cov)  # the lower triangle mirrors the upper
    terms = _Terms(
        _FRESH, cov, sd[..., :, None], sd[..., None, :], mu[..., :, None], mu[..., None, :], gain
    )
    return upper, eye, terms


def relu_cov_forward(
    cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, gain: float = 1.0
) -> Tensor:
    r"""The clamped ReLU covariance on whole ``[n, D, D]`` tensors (the formula of the module).

    Reads the upper triangle of ``cov`` only and returns an exactly symmetric matrix with
    ``var`` on its diagonal; the arguments are those of :func:`relu_cov`, flattened to one
    batch dimension.
    """
    upper, eye, t = _whole_terms(cov, sd, mu, gain)
    osd = _bound_factors(var)
    raw = _raw(_FRESH, t, cdf[..., :, None], cdf[..., None, :])[1]
    out = flush(_clamp(_FRESH, raw, osd[..., :, None], osd[..., None, :]))
    # exact symmetry (kernels may round (j, l) and (l, j) differently) and the exact diagonal
    return torch.where(upper, out, torch.where(eye, var[..., :, None], out.mT))


def relu_cov_backward(
    grad: Tensor, cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, gain: float = 1.0
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    r"""Closed-form vector-Jacobian product of :func:`relu_cov_forward` (module docstring).

    With :math:`G = g + g^\top` off the diagonal (the output is symmetric and only the upper
    triangle of ``cov`` is read) and the covariance mirrored, every piece of :func:`_apply` is a
    symmetric matrix and each per-unit contraction one row sum, so the backward is a fixed
    set of whole-tensor kernels.

    Returns:
        Gradients for ``(cov, sd, mu, cdf, var)``; the one for ``cov`` lives on the strict
        upper triangle.
    """
    upper, eye, t = _whole_terms(cov, sd, mu, gain)
    osd = _bound_factors(var)
    vectors = {"osd": osd, "cdf": cdf, "mu": mu}
    sums: dict[str, Tensor] = {}

    def emit(key: str, piece: Tensor) -> None:
        partner = _PARTNERS[key]
        x = None if partner is None else vectors[partner]
        sums[key] = piece.sum(-1) if x is None else (piece * x[..., None, :]).sum(-1)

    g = torch.where(eye, 0, grad + grad.mT)
    cdf_jl = (cdf[..., :, None], cdf[..., None, :])
    sk, raw = _raw(_FRESH, t, *cdf_jl)
    excess = _excess(_FRESH, raw, (osd[..., :, None], osd[..., None, :]))[1]
    coefs = _coefficients(_FRESH, _FRESH, t, sk, raw, cdf_jl, excess)
    g_cov = _apply(_FRESH, coefs, t.cov, g, emit)
    grads = (torch.where(upper, g_cov, 0), *_unit_grads(sums, grad, sd, mu, var, osd))
    return tuple(flush(g) for g in grads)  # type: ignore[return-value]  # five tensors


def _run_forward(path: str, gain: float, cov: Tensor, *vecs: Tensor) -> Tensor:
    fn = policy.compiled("relu_cov_forward", relu_cov_forward) if path == "compiled" else None
    fwd: Callable[..., Tensor] = fn or relu_cov_forward
    n, d = cov.shape[0], cov.shape[-1]
    size = policy.chunk_size(n, d, cov.dtype, path)
    if size >= n:
        return fwd(cov, *vecs, gain)
    out = torch.empty_like(cov, memory_format=torch.contiguous_format)
    for a, b in policy.chunks(n, size):
        out[a:b] = fwd(cov[a:b], *(v[a:b] for v in vecs), gain)
    return out


def _run_backward(
    path: str, gain: float, grad: Tensor, cov: Tensor, *vecs: Tensor
) -> tuple[Tensor, ...]:
    fn = policy.compiled("relu_cov_backward", relu_cov_backward) if path == "compiled" else None
    bwd: Callable[..., tuple[Tensor, ...]] = fn or relu_cov_backward
    n, d = cov.shape[0], cov.shape[-1]
    size = policy.chunk_size(n, d, cov.dtype, path)
    if size >= n:
        return bwd(grad, cov, *vecs, gain)
    parts = [
        bwd(grad[a:b], cov[a:b], *(v[a:b] for v in vecs), gain) for a, b in policy.chunks(n, size)
    ]
    return tuple(torch.cat(p) for p in zip(*parts, strict=True))


class _ReluCovWhole(torch.autograd.Function):
    """:func:`relu_cov_forward` with :func:`relu_cov_backward`, chunked over the batch."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        cov: Tensor,
        sd: Tensor,
        mu: Tensor,
        cdf: Tensor,
        var: Tensor,
        path: str,
        gain: float,
    ) -> Tensor:
        ctx.save_for_backward(cov, sd, mu, cdf, var)
        ctx.path, ctx.gain = path, gain  # type: ignore[attr-defined]  # carried to backward
        return _run_forward(path, gain, cov, sd, mu, cdf, var)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        return (*_run_backward(ctx.path, ctx.gain, grad, *saved), None, None)  # type: ignore[attr-defined]  # set in forward


def relu_cov(
    cov: Tensor, sd: Tensor, mu: Tensor, cdf: Tensor, var: Tensor, gain: float = 1.0
) -> Tensor:
    r"""ReLU output covariance ``[..., D, D]`` from the input's statistics, closed-form backward.

    Runs the blocked loop or the whole-tensor kernels as
    :func:`lightning_dvi.moments.policy.resolve` decides for the tensors' device.

    Args:
        cov: input covariance ``[..., D, D]`` (symmetric; only the upper triangle is read).
        sd: input standard deviations ``[..., D]`` (floored).
        mu: standardised input means ``[..., D]`` (clamped).
        cdf: :math:`\Phi(\mu)`, ``[..., D]`` (LeakyReLU: its slope
            :math:`\alpha + (1-\alpha)\Phi(\mu)`).
        var: exact output variances ``[..., D]``: the diagonal and the Cauchy-Schwarz bound.
        gain: factor on the correction :math:`K` (LeakyReLU: :math:`(1-\alpha)^2`).
    """
    d = cov.shape[-1]
    lead = cov.shape[:-2]
    flat = [t.reshape(-1, d) for t in (sd, mu, cdf, var)]
    path = policy.resolve(cov.device)
    if path == "blocked" and d * d <= BLOCK:
        out = _ReluCovBand.apply(cov.reshape(-1, d, d), *flat, float(gain))
    elif path == "blocked":
        out = _ReluCov.apply(cov.reshape(-1, d, d), *flat, float(gain))
    else:
        out = _ReluCovWhole.apply(cov.reshape(-1, d, d), *flat, path, float(gain))
    return out.reshape(*lead, d, d)  # type: ignore[no-any-return]  # Function.apply returns Any

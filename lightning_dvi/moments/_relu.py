r"""ReLU moments as custom autograd functions with closed-form backward passes.

Autograd through the ~50 elementwise operations of the moment formulas costs about twice their
forward time again and keeps every intermediate alive. The derivatives have short closed forms
(derived below and checked against finite differences in ``tests/test_compile.py`` and against
the formulas' autograd in the oracle tests), so these functions compute the forward without a
graph and evaluate only those.

**Diagonal.** With :math:`\Phi = \Phi(\mu)`, :math:`\phi = \phi(\mu)`, :math:`\mu = m/\sigma`,
:math:`v = \sigma^2` (Stein's lemma: :math:`\partial_v E f(a) = \tfrac12 E f''(a)`):

.. math::
    \partial_m E h = \Phi,\quad \partial_v E h = \frac{\phi}{2\sigma},\quad
    \partial_m \operatorname{Var} h = 2 E[h]\,(1-\Phi),\quad
    \partial_v \operatorname{Var} h = \Phi - E[h]\frac{\phi}{\sigma}.

**Off-diagonal.** :math:`C_{jl} = \Sigma_{jl}\Phi_j\Phi_l + \sigma_j\sigma_l K(\rho, \mu_j, \mu_l)`
with :math:`K = P(\rho)e^{-Q}/2\pi`, :math:`P = \rho g_r = \rho\arcsin\rho + \bar\rho - 1`,
:math:`Q = \beta(\mu_j^2+\mu_l^2) - \gamma\mu_j\mu_l`, :math:`\beta = \rho^2/(2P(1+\bar\rho))`,
:math:`\gamma = (\arcsin\rho - \rho)/P`. Then :math:`P' = \arcsin\rho` and

.. math::
    P\beta' = \beta\Big[\arcsin\rho - \frac{2\rho}{1+\bar\rho}
        + \frac{P\rho}{\bar\rho(1+\bar\rho)}\Big],\qquad
    P\gamma' = \frac{\rho^2}{\bar\rho(1+\bar\rho)} - \gamma\arcsin\rho,

.. math::
    \partial_\rho K = \frac{e^{-Q}}{2\pi}\big[\arcsin\rho - P\beta'(\mu_j^2+\mu_l^2)
        + P\gamma'\mu_j\mu_l\big],

free of the :math:`0/0` at :math:`\rho = 0` that made the series for
:math:`(\arcsin\rho-\rho)/\rho^3` necessary under autograd. Only :math:`P` is floored before
dividing; where that floor bites (:math:`|\rho| \lesssim 10^{-15}`) :math:`K \le P/2\pi` is below
any float's resolution of :math:`\sigma_j\sigma_l`, and :math:`\beta, \gamma` shrink together, so
:math:`Q` stays a positive-definite form and :math:`e^{-Q} \le 1`. The cancellation in
:math:`\arcsin\rho - \rho` only perturbs :math:`K` by :math:`O(\epsilon|\rho|)\sigma_j\sigma_l`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy
from .special import flush, tail_cutoff

__all__ = ["INV_2PI", "big", "clip_eps", "floors", "relu_diag_fn"]

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
INV_2PI = 1.0 / (2.0 * math.pi)


def floors(dtype: torch.dtype) -> tuple[float, float, float, float]:
    """Variance floor, smallest safe exp(-x^2), Dekker split factor, floor of P."""
    if dtype == torch.float64:
        return 1e-30, 1e-285, 134217729.0, 1e-200  # split 2^27 + 1
    # exp(-x^2) >= 1e-28: phi(a) times the Mills-ratio factors (>= 1/a^3) stays normal
    return 1e-24, 1e-28, 4097.0, 1e-30  # split 2^12 + 1


def big(dtype: torch.dtype) -> float:
    """A factor that turns any difference above the float resolution into a 0/1 weight."""
    return 1e300 if dtype == torch.float64 else 1e38


def clip_eps(dtype: torch.dtype) -> float:
    """The margin :func:`~lightning_dvi.moments.special.clip_correlation` uses by default."""
    return 1e-6 if dtype == torch.float64 else 1e-4


def _neg_square_error(x: Tensor, sq: Tensor, split: float) -> Tensor:
    """The rounding error ``fl(x*x) - x*x``, exactly (Dekker's product; no FMA needed).

    ``x = hi + lo`` with ``hi`` of half the mantissa, so ``hi*hi`` is exact and so is
    ``fl(x*x) - hi*hi`` (Sterbenz); then ``2 hi lo + lo^2`` are subtracted.
    """
    hi = x * split
    hi.sub_(hi - x)
    lo = x - hi
    err = torch.addcmul(sq, hi, hi, value=-1)
    return err.addcmul_(hi, lo, value=-2).addcmul_(lo, lo, value=-1)


# ---------------------------------------------------------------------------- diagonal
def _relu_diag_forward(mean: Tensor, var: Tensor) -> tuple[Tensor, ...]:
    """ReLU mean and variance, and ``(Phi, phi/sigma, 2 E[h])`` for the backward (elementwise)."""
    floor, e_min, split, _ = floors(var.dtype)
    var_c = var.clamp_min(floor)
    sd = var_c.sqrt()
    mu = mean / sd
    # Everything is written with a = |mu| and the upper-tail Mills ratio
    # M = Phi(-a)/phi(a) = sqrt(pi/2) erfcx(a/sqrt2), evaluated as erfc(x) exp(x^2) with the
    # rounding of x^2 corrected (otherwise its relative error x^2 eps is amplified by a^4 in
    # the variance's cancellation): erfcx's accuracy at a tenth of its cost. x is clamped
    # where phi underflows anyway; CPU exp/erfc are ~10x slower on arguments that underflow.
    x = mu.abs().mul_(_SQRT_HALF).clamp_max_(math.sqrt(-math.log(e_min)))
    half = policy.erfc(x).mul_(0.5)  # Phi(-a), full relative precision in the tail
    if x.dtype == torch.float32 and x.device.type == "cpu" and not policy.tracing():
        # the square of a float32 is exact in float64: phi(a) to float32's rounding from one
        # float64 exp (6 aten ops fewer than the product's exact error below, and as fast);
        # a traced graph fuses the float32 ops below instead (inductor's float64 exp on a CPU
        # costs about twice ATen's, and the float32 chain is one kernel there)
        x64 = x.double()
        pdf = x64.mul(x64).neg_().exp_().mul_(_INV_SQRT_2PI).float()
        mills = half / pdf
    else:
        sq = x * x
        # phi(a) = fl(pdf) (1 - err) with err = x^2 - fl(x^2), so M = Phi(-a) (1 + err) / pdf
        mills = torch.addcmul(half, half, _neg_square_error(x, sq, split), value=-1)
        pdf = sq.neg_().exp_().mul_(_INV_SQRT_2PI)  # phi(a), up to the rounding of x^2
        mills.div_(pdf)
    a = x.mul_(math.sqrt(2.0))  # in place: x is no longer needed
    u = 1 - a * mills  # 1 - a M
    w = torch.addcmul(mills, a, u, value=-1)  # (1 + a^2) M - a
    pu = pdf * u
    relu = mu.clamp_min(0)
    # E[h]/sd = relu(mu) + phi u for either sign of mu; Var[h]/var = phi w - (phi u)^2 for
    # mu < 0 and 1 - phi w - phi u (2 a + phi u) for mu >= 0 (no cancellation on that side).
    # threshold: clamp at 0 and flush the tails below the cutoff to exact zeros in one op
    # (torch.threshold_ directly: the same kernel without F.threshold's Python wrapper)
    cut = tail_cutoff(mean.dtype)
    out_mean = torch.threshold_((relu + pu).mul_(sd), cut, 0.0)
    pw = w.mul_(pdf)
    # 1 where mu > 0, else 0, as a float weight: lerp(x, y, 0/1) selects x or y exactly, at a
    # tenth of the cost of torch.where with a bool mask on a CPU
    pos = mu.sign().clamp_min_(0)
    # (phi u)^2 only matters where it is above ~eps * phi w: below, it would be subnormal
    pu_sq = torch.threshold(pu, 1e-18 if mean.dtype == torch.float32 else 1e-150, 0.0)
    out_var = torch.lerp(pw, 1 - pw, pos).sub_(pu_sq * torch.add(pu, relu, alpha=2))
    out_var = torch.threshold_(out_var.mul_(var_c), cut, 0.0)
    cdf = torch.threshold_(torch.lerp(half, 1 - half, pos), cut, 0.0)
    # 2 E[h], not the output E[h] itself: a saved output costs a detach when saved and when
    # unpacked, and the backward wants the doubled value
    dens = torch.threshold_(pdf.div_(sd), cut, 0.0)
    return out_mean, out_var, cdf, dens, out_mean * 2


def _relu_diag_backward(
    g_mean: Tensor, g_var: Tensor, cdf: Tensor, dens: Tensor, mean2: Tensor, var: Tensor
) -> tuple[Tensor, Tensor]:
    """The input gradients of :func:`_relu_diag_forward` for both output gradients."""
    # the module docstring's four derivatives, contracted with (g_mean, g_var) in few ops:
    # grad_m = g_mean Phi + 2 t (1 - Phi) = 2t + Phi (g_mean - 2t),
    # grad_v = g_var Phi + dens (g_mean - 2t) / 2, t = g_var E[h], dens = phi / sigma
    t2 = g_var * mean2
    s = g_mean - t2
    grad_m = torch.addcmul(t2, cdf, s)
    grad_v = torch.addcmul(g_var * cdf, dens, s, value=0.5)
    # the variance floor has zero derivative below it
    return flush(grad_m), flush(grad_v.mul_(var >= floors(var.dtype)[0]))


class _ReluDiag(torch.autograd.Function):
    @staticmethod
    def forward(ctx: FunctionCtx, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        ctx.set_materialize_grads(False)
        # on CUDA one compiled kernel for the ~45 elementwise ops (policy.elementwise)
        forward = policy.elementwise("relu_diag_forward", _relu_diag_forward, mean.device)
        out_mean, out_var, cdf, dens, mean2 = forward(mean, var)
        ctx.save_for_backward(cdf, dens, mean2, var)
        return out_mean, out_var

    @staticmethod
    @once_differentiable
    def backward(
        ctx: FunctionCtx, g_mean: Tensor | None, g_var: Tensor | None
    ) -> tuple[Tensor | None, Tensor | None]:
        cdf, dens, mean2, var = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        if g_var is not None and g_mean is not None:
            backward = policy.elementwise("relu_diag_backward", _relu_diag_backward, var.device)
            return backward(g_mean, g_var, cdf, dens, mean2, var)  # type: ignore[no-any-return]  # two tensors
        # one output unused: the same derivatives with its gradient zero
        if g_var is None:
            if g_mean is None:
                return None, None
            grad_m, grad_v = g_mean * cdf, torch.mul(g_mean, dens).mul_(0.5)
        else:
            t2 = g_var * mean2
            grad_m = (1 - cdf).mul_(t2)
            grad_v = (g_var * cdf).addcmul_(dens, t2, value=-0.5)
        # the variance floor has zero derivative below it
        return flush(grad_m), flush(grad_v.mul_(var >= floors(var.dtype)[0]))


def relu_diag_fn(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    """Exact ReLU mean and variance with a closed-form backward (see the module docstring)."""
    if mean.shape != var.shape:
        mean, var = torch.broadcast_tensors(mean, var)
    return _ReluDiag.apply(mean, var)  # type: ignore[no-any-return]  # Function.apply returns Any

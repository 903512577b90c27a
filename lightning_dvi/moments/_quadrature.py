r"""Gaussian expectations of a smooth activation: one formula, two fixed rules, thin executors.

For :math:`a \sim \mathcal N(m, v)`, :math:`s = \sqrt v`, an activation :math:`f` needs, per
unit, :math:`E f`, :math:`\operatorname{Var} f` and :math:`e_k = E f^{(k)}` (the slope
:math:`e_1` and the Mehler coefficients of full mode), and for the backward pass
:math:`c_1 = \operatorname{Cov}(f, f') = \tfrac12\partial_m\operatorname{Var} f` and
:math:`c_2 = E f'^2 + \operatorname{Cov}(f, f'') = \partial_v\operatorname{Var} f`
(Stein's lemma: :math:`\partial_m E g = E g'`, :math:`\partial_v E g = \tfrac12 E g''`). So the
backward pass is closed form: no autograd graph through the quadrature.

**Narrow inputs** (:math:`s \le` :data:`SWITCH_SD`): ``num_nodes``-point Gauss–Hermite,
:math:`E g \approx \sum_i w_i g(m + s z_i)`, with the two-pass variance
:math:`\sum_i w_i (f_i - \bar f)^2` and covariances (no cancellation at small :math:`s`); below
:math:`s = 10^{-3}` (float32; :math:`10^{-6}` float64) the delta method
:math:`\operatorname{Var} f = v e_1^2`, exact to working precision where the two-pass sum is
rounding noise, and exactly 0 for a deterministic input.

**Wide inputs** (:math:`s >` :data:`SWITCH_SD`), where Gauss–Hermite would need ever more nodes
(the activation bends on a scale of 1, the Gaussian on a scale of :math:`s`): each function
:math:`g` (:math:`f`, :math:`f^2`, their derivatives) is split into its asymptote, a
polynomial :math:`P_g` of degree :math:`\le 2` on :math:`x > 0` and zero on :math:`x < 0`
(:math:`\sigma \to 1`, :math:`\mathrm{silu} \to x`), whose truncated Gaussian moments are closed
forms (:math:`T_0 = \Phi(\mu)`, :math:`T_1 = m\Phi + s\phi`,
:math:`T_2 = (m^2+v)\Phi + ms\phi`), plus a *bump* :math:`b_g = g - P_g` that decays at least
like :math:`e^{-|x|}`. The bump is integrated against the Gaussian density by a fixed
:data:`LAGUERRE_NODES`-point Gauss–Laguerre rule on each half-line,
:math:`E b_g(a) = \int_0^\infty [b_g(x)N(x) + b_g(-x)N(-x)]dx
\approx \sum_i W_ie^{x_i}[b_g(x_i)N(x_i) + b_g(-x_i)N(-x_i)]`, accurate because
:math:`N(x; m, v)` is smooth on the bump's scale once :math:`s` is. The bump values are a table
built once in float64, so a wide input costs one ``exp`` of ``2 * LAGUERRE_NODES`` arguments and
one matrix product for all of :math:`E f, E f^2, e_k, \ldots` together.

**Reflection.** Each kernel satisfies :math:`f(x) = c + \kappa x + \eta f(-x)` (sigmoid:
:math:`1 - \sigma(-x)`; SiLU, softplus, GELU: :math:`x + f(-x)`). Everything is computed at
:math:`-|m|`, where :math:`f` is small, and mapped back:
:math:`E f = c + \kappa m + \eta E f(b)`,
:math:`\operatorname{Var} f = \kappa^2 v + \operatorname{Var} f(b) - 2\kappa\eta v\,E f'(b)`,
:math:`e_1 = \kappa - \eta e_1(b)`, :math:`e_k = \eta(-1)^k e_k(b)`,
:math:`c_1 = \kappa\eta v e_2(b) - c_1(b)`,
:math:`c_2 = \kappa^2 + c_2(b) - 2\kappa\eta e_1(b) - \kappa\eta v e_3(b)`, with
:math:`b = -a`. The linear part's variance is then exact (a SiLU far in its linear regime has
variance :math:`v`, not a float32 difference of two numbers near :math:`m^2`).

**Scaling.** ``tanh(x) = 2 sigmoid(2x) - 1`` and ``softplus(x; beta) = softplus(beta x) / beta``
run the kernel at :math:`(\lambda m, \lambda^2 v)` and map :math:`E f \to \alpha E f + \beta`,
:math:`\operatorname{Var} \to \alpha^2\operatorname{Var}`, :math:`e_k \to \alpha\lambda^k e_k`,
:math:`c_1 \to \alpha^2\lambda c_1`, :math:`c_2 \to \alpha^2\lambda^2 c_2`.

**Execution** (the math above is written once; :mod:`.policy` chooses): on a CPU the units are
partitioned, each evaluated by its own rule only (one host read); on other devices, and while
traced, both rules run on every unit and a ``where`` selects (no synchronisation). Every output
and gradient is flushed below :func:`~lightning_dvi.moments.special.tail_cutoff`.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy
from ._cache import cached
from ._relu import floors
from .special import flush, normal_cdf, normal_pdf

__all__ = [
    "DEFAULT_NODES",
    "LAGUERRE_NODES",
    "SWITCH_SD",
    "Kernel",
    "StatsFn",
    "constant",
    "fixed_rule",
    "gauss_hermite",
    "gauss_laguerre",
    "moments_from_stats",
    "smooth_moments",
]

DEFAULT_NODES = 16
"""Gauss–Hermite nodes for narrow inputs, unless a kernel sets its own."""
LAGUERRE_NODES = 16
"""Gauss–Laguerre nodes per half-line for wide inputs, unless a kernel sets its own."""
SWITCH_SD = 1.5
"""Standard deviation (after the kernel's input scale) where the rules switch, by default."""

_Take = Callable[[], Tensor]
_Derivs = Callable[[Tensor, int, _Take], list[Tensor]]
_Buckets = tuple[tuple[float, int], ...]
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_MAX_ORDER = 6  # derivatives tabulated: e_1..e_6 serve full mode (3 coefficients + backward)


@dataclass(frozen=True)
class Kernel:
    r"""An activation, as the engine needs it.

    Attributes:
        name: a key for cached tables.
        derivs: ``derivs(x, k, take)`` returns ``[f(x), f'(x), ..., f^(k)(x)]`` elementwise,
            accurate in float64 (it also builds the tables) for ``k <=`` 6; it may overwrite
            ``x`` and writes its results into buffers from ``take()`` (shaped like ``x``).
        reflection: ``(c, kappa, eta)`` with :math:`f(x) = c + \kappa x + \eta f(-x)`.
        asymptote: ``(r0, r1)``: :math:`f(x) - (r_0 + r_1 x) \to 0` as :math:`x \to \infty`
            (and :math:`f \to 0` as :math:`x \to -\infty`), both at least as fast as
            :math:`e^{-|x|}`.
        buckets: ``((s_1, n_1), ..., (s_k, n_k))``: Gauss–Hermite with ``n_i`` nodes for
            standard deviations in :math:`(s_{i-1}, s_i]`, the wide rule above :math:`s_k`
            (the switch). Chosen, per kernel, as the fewest nodes that keep the relative
            error of mean and variance within :math:`10^{-5}` (:math:`10^{-4}` at the switch;
            ``docs/moments.md``).
        lg_nodes: Gauss–Laguerre nodes per half-line (wide inputs).
    """

    name: str
    derivs: _Derivs
    reflection: tuple[float, float, float]
    asymptote: tuple[float, float]
    buckets: tuple[tuple[float, int], ...] = ((SWITCH_SD, DEFAULT_NODES),)
    lg_nodes: int = LAGUERRE_NODES

    @property
    def switch(self) -> float:
        """The standard deviation above which the wide rule runs."""
        return self.buckets[-1][0]

    def __post_init__(self) -> None:
        # the rules and the float64 table, built now: tracing must find them cached
        for _, n in self.buckets:
            gauss_hermite(n)
        _laguerre_table(self)


# ------------------------------------------------------------ fixed rules, never traced
FloatRows = tuple[tuple[float, ...], ...]
"""Rows of Python floats: a fixed rule's nodes, weights, ... (no tensor, so no tracer's)."""


def _untraced(build: Callable[[int], tuple[Tensor, ...]], n: int) -> FloatRows:
    """``build(n)`` run in a fresh thread, its tensors returned as rows of Python floats.

    Tracing (``torch.export``'s fake and proxy modes, inference mode, ``vmap``) is thread-local
    state, so a fresh thread runs ``build`` on real float64 CPU tensors whatever the caller is
    doing: nothing of it (e.g. the ``eigh`` of a Golub-Welsch matrix) reaches a traced graph,
    and a fake tensor never reaches a cache. ``torch.compile`` does not trace into it (it graph
    breaks once, at the first call of a rule not yet built).
    """
    out: list[FloatRows] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(tuple(tuple(t.tolist()) for t in build(n)))
        except BaseException as err:  # re-raised in the caller's thread
            error.append(err)

    worker = threading.Thread(target=run, name="lightning_dvi-quadrature-rule")
    worker.start()
    worker.join()
    if error:
        raise error[0]
    return out[0]


_untraced_call = torch.compiler.disable(_untraced)


def fixed_rule(build: Callable[[int], tuple[Tensor, ...]]) -> Callable[[int], FloatRows]:
    """A per-``n`` cache of ``build(n)`` (float64 tensors) as Python floats, filled untraced.

    The cache is a plain dict of floats: a hit is a constant to ``torch.compile`` and
    ``torch.export``, and a miss (even inside a traced forward pass) computes the rule outside
    any tracing (:func:`_untraced`). Tensors are made from the floats per call, by
    :func:`constant`.
    """
    cache: dict[int, FloatRows] = {}

    @functools.wraps(build)
    def rule(n: int) -> FloatRows:
        hit = cache.get(n)
        if hit is None:
            hit = cache[n] = _untraced_call(build, n)
        return hit

    return rule


_CONSTANTS: dict[tuple[tuple[float, ...], torch.dtype, torch.device], Tensor] = {}


def constant(values: tuple[float, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """``torch.tensor(values, dtype, device)``, cached per dtype and device (:func:`._cache.cached`).

    While traced (``torch.compile``, ``torch.export``) it is built fresh, a constant of the
    graph; a tracer's fake tensor is never cached; cached tensors are built outside inference
    mode (usable under autograd after a first call in Lightning's validation or predict loop).
    """
    key = (values, dtype, torch.device(device))
    return cached(_CONSTANTS, key, lambda: torch.tensor(values, dtype=dtype, device=device))


# ---------------------------------------------------------------------------------- rules
@fixed_rule
def _hermite_rule(n: int) -> tuple[Tensor, Tensor]:
    off = torch.sqrt(torch.arange(1, n, dtype=torch.float64))
    nodes, vecs = torch.linalg.eigh(torch.diag(off, 1) + torch.diag(off, -1))
    weights = vecs[0] ** 2
    return nodes, weights / weights.sum()


def gauss_hermite(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Probabilists' Gauss–Hermite nodes and weights (weights sum to one), Golub–Welsch.

    Computed once per ``n`` in float64, outside any tracing (:func:`fixed_rule`).
    """
    if n < 2:
        raise ValueError(f"num_nodes must be >= 2, got {n}")
    nodes, weights = _hermite_rule(n)
    return nodes, weights


@fixed_rule
def _laguerre_rule(n: int) -> tuple[Tensor, Tensor]:
    k = torch.arange(n, dtype=torch.float64)
    off = torch.arange(1, n, dtype=torch.float64)
    nodes, vecs = torch.linalg.eigh(
        torch.diag(2 * k + 1) + torch.diag(off, 1) + torch.diag(off, -1)
    )
    return nodes, vecs[0] ** 2


def gauss_laguerre(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    r"""Nodes :math:`x_i` and weights :math:`W_i` of :math:`\int_0^\infty e^{-x}g(x)dx \approx \sum_i W_i g(x_i)`.

    Computed once per ``n`` in float64, outside any tracing (:func:`fixed_rule`).
    """
    nodes, weights = _laguerre_rule(n)
    return nodes, weights


gauss_hermite(DEFAULT_NODES)  # built eagerly


def _poly_rows(r0: float, r1: float, order: int) -> list[tuple[float, float, float]]:
    """Asymptotic polynomials (coefficients of 1, x, x^2) of the wide rule's functions.

    Rows: ``f, f^2, (f^2)', (f^2)'', f', f'', ..., f^(order)`` (:func:`_wide_values`).
    """
    rows = [(r0, r1, 0.0), (r0 * r0, 2 * r0 * r1, r1 * r1), (2 * r0 * r1, 2 * r1 * r1, 0.0)]
    rows += [(2 * r1 * r1, 0.0, 0.0), (r1, 0.0, 0.0)]
    return rows + [(0.0, 0.0, 0.0)] * (order - 1)


def _wide_values(kernel: Kernel, x: Tensor, order: int) -> Tensor:
    """The wide rule's functions at ``x``, float64: ``[order + 4, len(x)]``."""
    d = kernel.derivs(x.clone(), max(order, 2), lambda: torch.empty_like(x))
    f, f1, f2 = d[0], d[1], d[2]
    rows = [f, f * f, 2 * f * f1, 2 * (f1 * f1 + f * f2), *d[1 : order + 1]]
    return torch.stack(rows)


@functools.lru_cache(maxsize=64)
def _laguerre_table(kernel: Kernel) -> tuple[Tensor, Tensor]:
    """``(nodes [2L], table [rows, 2L + 3])`` in float64 (see :func:`_wide_stats`)."""
    x, w = (torch.tensor(t, dtype=torch.float64) for t in gauss_laguerre(kernel.lg_nodes))
    signed = torch.cat([x, -x])
    poly = torch.tensor(_poly_rows(*kernel.asymptote, _MAX_ORDER), dtype=torch.float64)
    values = _wide_values(kernel, signed, _MAX_ORDER)
    right = (signed > 0).to(torch.float64)
    asym = poly[:, :1] + poly[:, 1:2] * signed + poly[:, 2:] * signed * signed
    bump = values - asym * right
    weight = torch.cat([w, w]) * torch.exp(torch.cat([x, x])) * _INV_SQRT_2PI
    return signed, torch.cat([bump * weight, poly], dim=1)


def _build_tables(
    kernel: Kernel, num_nodes: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    """GH nodes ``[n, 1]``, weights, weights times nodes, signed Laguerre nodes, the table."""
    z, w = (torch.tensor(t, dtype=torch.float64) for t in gauss_hermite(num_nodes))
    signed, table = _laguerre_table(kernel)
    out = (z[:, None], w, w * z, signed[:, None], table)
    # constants below the cutoff would be subnormal (or zero) in the working dtype
    return tuple(flush(t.to(dtype)).to(device) for t in out)


_cast_tables = functools.lru_cache(maxsize=64)(_build_tables)


def _tables(
    kernel: Kernel, num_nodes: int, dtype: torch.dtype, device: torch.device
) -> tuple[Tensor, ...]:
    tracing = policy.tracing() or torch.compiler.is_exporting()
    return (_build_tables if tracing else _cast_tables)(kernel, num_nodes, dtype, device)


# ------------------------------------------------------------------------- scratch memory
_POOL = threading.local()
POOL_LIMIT = 1 << 22
"""Elements of node-major scratch kept between calls, per thread, dtype and device (CPU only).

The rules' temporaries are ``[nodes, N]`` arrays of a few hundred KiB: freshly allocated, each
is above glibc's mmap threshold, and a process that never freed a larger block page-faults them
in again on every call (measured: a GELU dDVI step 30-50 % slower). One reused buffer avoids it.
"""


class _Scratch:
    """Hands out ``[rows, cols]`` buffers carved from one reused array (a fresh tensor when off)."""

    def __init__(self, like: Tensor, cols: int) -> None:
        self.like, self.cols, self.offset = like, cols, 0
        tracing = policy.tracing() or torch.compiler.is_exporting()
        self.pooled = like.device.type == "cpu" and not tracing
        key = (like.dtype, like.device)
        cache = _POOL.__dict__.setdefault("buffers", {})
        self.buf: Tensor | None = cache.get(key) if self.pooled else None
        self.key, self.cache = key, cache

    def take(self, rows: int) -> Tensor:
        """An uninitialised ``[rows, cols]`` tensor, valid until the next ``_Scratch`` call."""
        size = rows * self.cols
        if not self.pooled or size > POOL_LIMIT:
            return self.like.new_empty(rows, self.cols)
        if self.buf is None or self.offset + size > self.buf.numel():
            # grow (earlier views keep their storage alive); keep the largest for the next call
            need = max(2 * self.offset + size, size, 0 if self.buf is None else self.buf.numel())
            self.buf, self.offset = self.like.new_empty(min(need, POOL_LIMIT)), 0
            if self.buf.numel() < size:
                return self.like.new_empty(rows, self.cols)
            self.cache[self.key] = self.buf
        out = self.buf[self.offset : self.offset + size].view(rows, self.cols)
        self.offset += size
        return out


# ------------------------------------------------------------------------------ the rules
# Stats rows of both rules: mean, var, c1, c2, v E[f^(3)] (for the reflection), e_1 .. e_order.
def _narrow_stats(
    kernel: Kernel, m: Tensor, v: Tensor, order: int, tables: tuple[Tensor, ...]
) -> Tensor:
    """Gauss–Hermite statistics at ``(m, v)`` (``[N]`` each): ``[5 + order, N]``."""
    z, w, wz = tables[:3]
    s = v.sqrt()
    scratch = _Scratch(m, m.numel())

    def take() -> Tensor:
        return scratch.take(len(w))

    x = torch.addcmul(m, z, s, out=take())
    d = kernel.derivs(x, order, take)  # node-major [n, N]; f .. f^(order)
    mean = w @ d[0]
    e = [w @ dk for dk in d[1:]]
    ve3 = s * (wz @ d[2])  # Stein: v E[f^(3)] = s E[f'' z]
    dev = d[0].sub_(mean)  # two-pass sums: no cancellation at small s
    tmp = torch.mul(dev, dev, out=take())
    var = w @ tmp
    c1 = w @ torch.mul(dev, d[1], out=tmp)
    c2 = w @ torch.mul(d[1], d[1], out=tmp).addcmul_(dev, d[2])
    # below ~sqrt(eps) the two-pass sums are rounding noise: the delta method is exact there
    tiny = s < (1e-6 if m.dtype == torch.float64 else 1e-3)
    e1_sq = e[0] * e[0]
    var = torch.where(tiny, v * e1_sq, var)
    c1 = torch.where(tiny, v * e[0] * e[1], c1)
    c2 = torch.where(tiny, e1_sq, c2)
    return torch.stack([mean, var, c1, c2, ve3, *e])


def _wide_stats(m: Tensor, v: Tensor, order: int, tables: tuple[Tensor, ...]) -> Tensor:
    """Asymptote plus Gauss–Laguerre bump statistics at ``(m, v)``: ``[5 + order, N]``."""
    nodes, table = tables[3:]
    s = v.sqrt()
    inv_s = 1 / s
    mu = m * inv_s
    cdf, pdf = normal_cdf(mu), normal_pdf(mu)
    t1 = torch.addcmul(m * cdf, s, pdf)
    t2 = torch.addcmul(torch.addcmul(v, m, m) * cdf, m * s, pdf)
    gauss = torch.sub(nodes, m, out=_Scratch(m, m.numel()).take(len(nodes))).mul_(inv_s)
    gauss.square_().mul_(-0.5).exp_().mul_(inv_s)  # sqrt(2 pi) N(x_i; m, v), [2L, N]
    rows = table[: max(order, 3) + 4]
    raw = torch.addmm(rows[:, -3:] @ torch.stack([cdf, t1, t2]), rows[:, :-3], gauss)
    mean, second, d1, d2, e = raw[0], raw[1], raw[2], raw[3], raw[4:]
    var = torch.addcmul(second, mean, mean, value=-1)
    c1 = torch.addcmul(0.5 * d1, mean, e[0], value=-1)
    c2 = torch.addcmul(0.5 * d2, mean, e[1], value=-1)
    return torch.cat([torch.stack([mean, var, c1, c2, v * e[2]]), e[:order]])


def _stats(kernel: Kernel, m: Tensor, v: Tensor, order: int, buckets: _Buckets) -> Tensor:
    """Statistics at ``(m <= 0, v)`` by the rule each unit needs (module docstring).

    ``buckets``: ``((s_1, n_1), ..., (switch, n_k))``: Gauss–Hermite with ``n_i`` nodes is
    accurate up to :math:`s_i`; the wide rule runs above the switch.
    """
    dtype, device = m.dtype, m.device
    cap = buckets[-1][0] ** 2
    path = "whole" if torch.compiler.is_exporting() else policy.resolve(device)
    if path != "blocked":  # no host reads: the finest rule and the wide rule, selected
        narrow = _narrow_stats(
            kernel, m, v.clamp_max(cap), order, _tables(kernel, buckets[-1][1], dtype, device)
        )
        wide = _wide_stats(
            m, v.clamp_min(cap), order, _tables(kernel, buckets[-1][1], dtype, device)
        )
        return torch.where(v > cap, wide, narrow)
    # a CPU: the fewest nodes the batch's largest narrow spread needs (a host read, free here),
    # and the wide rule only for the units above the switch
    # one comparison, in the tensor's dtype, decides both the split and the recursion's end
    # (a float32 spread equal to the rounded cap is narrow, though float(v) > cap in float64)
    wide = v > cap
    if not bool(wide.any()):
        top = float(v.max()) if v.numel() else 0.0
        nodes = next((n for b, n in buckets if top <= b * b), buckets[-1][1])
        return _narrow_stats(kernel, m, v, order, _tables(kernel, nodes, dtype, device))
    out = m.new_empty(5 + order, m.numel())
    idx = wide.nonzero().squeeze(-1)
    out[:, idx] = _wide_stats(m[idx], v[idx], order, _tables(kernel, buckets[-1][1], dtype, device))
    idx = (~wide).nonzero().squeeze(-1)
    if idx.numel():
        out[:, idx] = _stats(kernel, m[idx], v[idx], order, buckets)
    return out


def _reflect(kernel: Kernel, stats: Tensor, m: Tensor, v: Tensor) -> Tensor:
    """Statistics of :math:`f(a)` from those of :math:`f(b)`, :math:`b = -a`, where ``m > 0``.

    Drops the :math:`vE[f^{(3)}]` row: ``[4 + order, N]``.
    """
    c, kappa, eta = kernel.reflection
    mean, var, c1, c2, ve3, e = stats[0], stats[1], stats[2], stats[3], stats[4], stats[5:]
    ke = kappa * eta
    signs = torch.tensor(
        [eta * (-1) ** k for k in range(1, len(e) + 1)], dtype=m.dtype, device=m.device
    )
    shift = torch.tensor([kappa] + [0.0] * (len(e) - 1), dtype=m.dtype, device=m.device)
    e_r = torch.addcmul(shift[:, None], e, signs[:, None])  # e_1 -> kappa - eta e_1
    if kappa:
        mean_r = (c + kappa * m) + eta * mean
        var_r = kappa * kappa * v + var - 2 * ke * v * e[0]
        c1_r = ke * v * e[1] - c1
        c2_r = (kappa * kappa + c2) - ke * (2 * e[0] + ve3)
    else:
        mean_r, var_r, c1_r, c2_r = c + eta * mean, var, -c1, c2
    mapped = torch.cat([torch.stack([mean_r, var_r, c1_r, c2_r]), e_r])
    return torch.where(m > 0, mapped, torch.cat([stats[:4], e]))


StatsFn = Callable[[Tensor, Tensor, int], Tensor]
"""``(m, v, order) -> [4 + order, N]`` rows ``mean, var, c1, c2, e_1..e_order`` (flat ``m, v``)."""


class _Moments(torch.autograd.Function):
    r"""Mean, variance and ``e_1..e_k`` from a statistics function, closed-form backward.

    The backward pass needs only the statistics (module docstring): for ``g`` = ``f`` (the
    mean) and ``f^(k)`` (the ``e_k``), :math:`\partial_m E g = E g'` and
    :math:`\partial_v E g = \tfrac12 E g''`; for the variance :math:`2c_1` and :math:`c_2`.
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx, mean: Tensor, var: Tensor, stats_fn: StatsFn, coeffs: int
    ) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        # e_{k+2} for the backward of e_k
        stats = flush(stats_fn(mean.reshape(-1), var.reshape(-1), coeffs + 2))
        stats = torch.cat([stats[:1], stats[1:2].clamp(min=0), stats[2:]])
        ctx.save_for_backward(stats[1 : coeffs + 6], var)  # var, c1, c2, e_1..e_{k+2}
        ctx.coeffs = coeffs  # type: ignore[attr-defined]  # carried to backward
        return tuple(stats[i].reshape(mean.shape) for i in (0, 1, *range(4, 4 + coeffs)))

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        saved, var = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        coeffs: int = ctx.coeffs  # type: ignore[attr-defined]  # set in forward
        c1, c2, e = saved[1], saved[2], saved[3:]
        g_mean, g_var, g_e = grads[0], grads[1], grads[2:]
        grad_m = torch.zeros_like(c1)
        grad_v = torch.zeros_like(c1)
        pairs = [(g_mean, e[0], 0.5 * e[1]), (g_var, 2 * c1, c2)]
        pairs += [(g_e[k], e[k + 1], 0.5 * e[k + 2]) for k in range(coeffs)]
        for g, dm, dv in pairs:
            if g is not None:
                g = g.reshape(-1)
                grad_m.addcmul_(g, dm)
                grad_v.addcmul_(g, dv)
        grad_v.mul_(var.reshape(-1) >= floors(var.dtype)[0])  # the floor has zero derivative
        shape = var.shape
        return flush(grad_m).reshape(shape), flush(grad_v).reshape(shape), None, None


def moments_from_stats(
    stats_fn: StatsFn, mean: Tensor, var: Tensor, coeffs: int = 0
) -> tuple[Tensor, ...]:
    """``(E f, Var f, e_1, ..., e_coeffs)`` from ``stats_fn``, differentiable (closed form)."""
    if mean.shape != var.shape:
        mean, var = torch.broadcast_tensors(mean, var)
    return tuple(_Moments.apply(mean, var, stats_fn, coeffs))


def _kernel_stats(
    kernel: Kernel, num_nodes: int | None, scale: tuple[float, float, float]
) -> StatsFn:
    buckets = kernel.buckets if num_nodes is None else ((kernel.switch, int(num_nodes)),)
    lam, alpha, beta = scale

    def stats_fn(mean: Tensor, var: Tensor, order: int) -> Tensor:
        m = mean * lam
        v = var.clamp_min(floors(var.dtype)[0]) * (lam * lam)
        v = torch.where(var > 0, v, torch.zeros_like(v))  # a deterministic input: exact
        stats = _reflect(kernel, _stats(kernel, -m.abs(), v, order, buckets), m, v)
        if (lam, alpha, beta) == (1.0, 1.0, 0.0):
            return stats
        factors = [alpha, alpha * alpha, alpha * alpha * lam, (alpha * lam) ** 2]
        factors += [alpha * lam**k for k in range(1, order + 1)]
        shift = [beta] + [0.0] * (len(factors) - 1)
        add = torch.tensor(shift, dtype=m.dtype, device=m.device)[:, None]
        mul = torch.tensor(factors, dtype=m.dtype, device=m.device)[:, None]
        return torch.addcmul(add, stats, mul)

    return stats_fn


def smooth_moments(
    kernel: Kernel,
    mean: Tensor,
    var: Tensor,
    coeffs: int = 0,
    num_nodes: int | None = None,
    scale: tuple[float, float, float] = (1.0, 1.0, 0.0),
) -> tuple[Tensor, ...]:
    r"""``(E f, Var f, e_1, ..., e_coeffs)`` of :math:`f(a) = \alpha g(\lambda a) + \beta`.

    Args:
        kernel: :math:`g`.
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, same shape (broadcast).
        coeffs: how many :math:`e_k = E f^{(k)}(a)` to return.
        num_nodes: Gauss–Hermite nodes for narrow inputs (default: the kernel's).
        scale: ``(lambda, alpha, beta)``.

    Returns:
        Tensors of the broadcast shape, differentiable in ``mean`` and ``var``.
    """
    return moments_from_stats(_kernel_stats(kernel, num_nodes, scale), mean, var, coeffs)

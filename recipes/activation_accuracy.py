"""Error table of the activation moments (docs/moments.md): quadrature and Monte Carlo oracles.

For every registered smooth activation and a grid of pre-activation ``N(m, s^2)``, the library's
mean, variance and slope ``E f'`` against an independent float64 reference (composite
Gauss-Legendre on ``[m - 14 s, m + 14 s]``, 16 panels of 200 nodes, split at the kink 0), in
float64 and float32 (mean errors relative to the RMS of ``f``: means cross zero),
and against Monte Carlo (``--draws`` samples): errors in Monte Carlo standard errors, and the
variance's relative error where Monte Carlo itself is within 1 % (in far tails a few draws carry
the variance). The issue-28 criterion: mean error <= 2e-2, variance within 10 % of Monte Carlo.

Run:  python recipes/activation_accuracy.py [--draws 200000]
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from lightning_dvi.moments import elu as E
from lightning_dvi.moments import smooth as S

SDS = (1e-3, 0.1, 0.3, 0.7, 1.0, 1.2, 1.5, 2.0, 3.0, 6.0, 10.0)
RATIOS = tuple(-4 + 0.5 * i for i in range(15))  # m / max(s, 1) in [-4, 3]
ACTS = {  # name -> (f, f', diag, slope)
    "LeakyReLU(0.1)": (lambda x: F.leaky_relu(x, 0.1), lambda x: torch.where(x > 0, 1.0, 0.1),
                       lambda m, v: S.leaky_relu_diag(m, v, 0.1), lambda m, v: S.leaky_relu_slope(m, v, 0.1)),
    "ELU": (F.elu, lambda x: torch.where(x > 0, 1.0, torch.exp(x.clamp(max=0))), E.elu_diag, E.elu_slope),
    "GELU": (F.gelu, lambda x: torch.special.ndtr(x) + x * torch.exp(-x * x / 2) / math.sqrt(2 * math.pi),
             S.gelu_diag, S.gelu_slope),
    "GELU tanh": (lambda x: F.gelu(x, approximate="tanh"), None, S.gelu_tanh_diag, S.gelu_tanh_slope),
    "SiLU": (F.silu, lambda x: torch.sigmoid(x) * (1 + x * (1 - torch.sigmoid(x))), S.silu_diag, S.silu_slope),
    "Softplus": (F.softplus, torch.sigmoid, S.softplus_diag, S.softplus_slope),
    "Sigmoid": (torch.sigmoid, lambda x: torch.sigmoid(x) * (1 - torch.sigmoid(x)), S.sigmoid_diag,
                S.sigmoid_slope),
    "Tanh": (torch.tanh, lambda x: 1 - torch.tanh(x) ** 2, S.tanh_diag, S.tanh_slope),
}  # fmt: skip


def _legendre(n: int = 200) -> tuple[torch.Tensor, torch.Tensor]:
    k = torch.arange(1, n, dtype=torch.float64)
    off = k / torch.sqrt(4 * k * k - 1)
    nodes, vecs = torch.linalg.eigh(torch.diag(off, 1) + torch.diag(off, -1))
    return nodes, 2 * vecs[0] ** 2


def reference(g, m: float, s: float) -> float:
    """``E g(a)``, ``a ~ N(m, s^2)``, by composite Gauss-Legendre (float64)."""
    nodes, weights = _legendre()
    edges = torch.linspace(m - 14 * s, m + 14 * s, 17, dtype=torch.float64)
    if edges[0] < 0 < edges[-1]:
        edges = torch.sort(torch.cat([edges, torch.zeros(1, dtype=torch.float64)])).values
    total = 0.0
    for a, b in itertools.pairwise(edges.tolist()):
        x = (a + b) / 2 + (b - a) / 2 * nodes
        dens = torch.exp(-0.5 * ((x - m) / s) ** 2) / (s * math.sqrt(2 * math.pi))
        total += float(((b - a) / 2 * weights * g(x) * dens).sum())
    return total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--draws", type=int, default=200_000, help="Monte Carlo samples per cell")
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(args.draws, generator=gen, dtype=torch.float64)
    grid = [(r * max(s, 1.0), s) for s in SDS for r in RATIOS]
    print("| activation | mean err / RMS f64 | var rel. err f64 | slope rel. err f64 "
          "| mean/var rel. err f32 | MC: mean err / s.e. | MC: var err / s.e. | MC: var rel. err |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for name, (f, df, diag, slope) in ACTS.items():
        err = {"m": 0.0, "v": 0.0, "d": 0.0, "f32": 0.0, "mc_m": 0.0, "mc_z": 0.0, "mc_v": 0.0}
        m_t = torch.tensor([m for m, _ in grid], dtype=torch.float64)
        v_t = torch.tensor([s * s for _, s in grid], dtype=torch.float64)
        mean, var = diag(m_t, v_t)
        sl = slope(m_t, v_t)
        mean32, var32 = diag(m_t.float(), v_t.float())
        for i, (m, s) in enumerate(grid):
            e1 = reference(f, m, s)
            e2 = reference(lambda x, e1=e1, f=f: (f(x) - e1) ** 2, m, s)
            rms = math.sqrt(e1 * e1 + e2)  # mean errors relative to the RMS of f (means cross 0)
            err["m"] = max(err["m"], abs(mean[i].item() - e1) / rms)
            err["v"] = max(err["v"], abs(var[i].item() / e2 - 1))
            if df is not None:
                ed = reference(df, m, s)
                err["d"] = max(err["d"], abs(sl[i].item() - ed) / (abs(ed) + 1e-12))
            if e2 > 1e-20:  # float32 relative errors where the variance is representable
                err["f32"] = max(err["f32"], abs(mean32[i].item() - e1) / rms,
                                 abs(var32[i].item() / e2 - 1))  # fmt: skip
            sample = f(m + s * z)
            mc_var, dev = sample.var().item(), sample - sample.mean()
            se = math.sqrt(mc_var / args.draws) + 1e-300  # the MC standard errors
            se_v = math.sqrt(max((dev**4).mean().item() - mc_var**2, 0.0) / args.draws) + 1e-300
            err["mc_m"] = max(err["mc_m"], abs(mean[i].item() - sample.mean().item()) / se)
            err["mc_z"] = max(err["mc_z"], abs(var[i].item() - mc_var) / se_v)
            if se_v < 1e-2 * mc_var:
                err["mc_v"] = max(err["mc_v"], abs(var[i].item() / mc_var - 1))
        slope_err = f"{err['d']:.0e}" if df is not None else "-"
        print(f"| {name} | {err['m']:.0e} | {err['v']:.0e} | {slope_err} | {err['f32']:.0e} | "
              f"{err['mc_m']:.1f} | {err['mc_z']:.1f} | {err['mc_v']:.1e} |")  # fmt: skip


if __name__ == "__main__":
    main()

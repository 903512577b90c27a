"""No moment function returns a subnormal float, in a value or a gradient (issue 28, item 1).

Subnormals stall many x86 CPUs (a microcode assist per operand), so the formulas flush tail
values below ``tail_cutoff`` to exact zeros. The sweep: means ``r * s`` for mean/std ratios
``r`` in [-40, 40] (161 values) and standard deviations ``s`` from 1e-3 to 1e2, float32 and
float64; every output and, separately for each output, the gradient of its sum with respect to
every input. ``test_every_moment_function_is_swept`` keeps the list complete.
"""

import inspect

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi import moments as M
from lightning_dvi.moments import _mehler
from lightning_dvi.moments import elu as E
from lightning_dvi.moments import smooth as S
from lightning_dvi.moments.special import flush, tail_cutoff

RATIOS = torch.linspace(-40, 40, 161, dtype=torch.float64)
SDS = (1e-3, 0.1, 1.0, 10.0, 100.0)
DTYPES = (torch.float32, torch.float64)


def _diag_inputs(dtype):
    """Means and variances ``[len(SDS) * 161]`` over the ratio grid."""
    mean = torch.cat([RATIOS * s for s in SDS])
    var = torch.cat([torch.full_like(RATIOS, s * s) for s in SDS])
    return mean.to(dtype), var.to(dtype)


def _full_inputs(dtype, d=4):
    """``[805, d]`` means around each grid point and covariances with correlation 0.6."""
    mean, var = _diag_inputs(torch.float64)
    offsets = torch.tensor([0.0, 0.5, -1.0, 2.0], dtype=torch.float64)[:d]
    means = mean[:, None] + offsets * var.sqrt()[:, None]
    corr = 0.4 * torch.eye(d, dtype=torch.float64) + 0.6
    return means.to(dtype), (var[:, None, None] * corr).to(dtype)


def _weights(dtype, d_in=4, d_out=3):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(d_out, d_in, generator=gen, dtype=torch.float64) / d_in**0.5
    return w.to(dtype), (0.01 * torch.rand(d_out, d_in, generator=gen, dtype=torch.float64)).to(
        dtype
    )


def _pairs(mean, var):
    return mean, var


def _window(mean, var):
    """Four-unit windows around each grid point (pooling and the maximum of Gaussians)."""
    offsets = torch.tensor([0.0, 0.5, -1.0, 2.0], dtype=mean.dtype)
    return mean[:, None] + offsets * var.sqrt()[:, None], var[:, None].expand(-1, 4)


def _image(mean, var):
    """A ``[5, 1, 7, 23]`` image (805 pixels) for the convolution and pooling moments."""
    return mean.reshape(5, 1, 7, 23), var.reshape(5, 1, 7, 23)


# name -> (kind, fn(inputs...) -> tuple of outputs); kind picks the inputs
DIAG = {
    "relu_diag": M.relu_diag,
    "relu_slope": M.relu_slope,
    "heaviside_diag": M.heaviside_diag,
    "heaviside_slope": M.heaviside_slope,
    "leaky_relu_diag": lambda m, v: S.leaky_relu_diag(m, v, 0.1),
    "leaky_relu_slope": lambda m, v: S.leaky_relu_slope(m, v, 0.1),
    "elu_diag": E.elu_diag,
    "elu_slope": E.elu_slope,
    "softplus_diag": S.softplus_diag,
    "softplus_slope": S.softplus_slope,
    **{
        f"{k}_{w}": getattr(S, f"{k}_{w}")
        for k in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh")
        for w in ("diag", "slope")
    },
    "gelu_closed_diag": S.gelu_closed_diag,
    "gelu_closed_slope": S.gelu_closed_slope,
    "gelu_slope_diag": S.gelu_slope_diag,
    "normal_cdf": lambda m, v: M.normal_cdf(m / v.sqrt()),
    "normal_pdf": lambda m, v: M.normal_pdf(m / v.sqrt()),
    "max_of_gaussians": lambda m, v: M.max_of_gaussians(m, v, torch.zeros_like(m), v),
    "max_of_gaussians_quadrature": lambda m, v: M.max_of_gaussians_quadrature(*_window(m, v)),
    "max_pool2d_diag": lambda m, v: M.max_pool2d_diag(*_image(m, v), 2),
    "max_pool2d_diag (clark)": lambda m, v: M.max_pool2d_diag(*_image(m, v), 2, method="clark"),
    "avg_pool2d_diag": lambda m, v: M.avg_pool2d_diag(*_image(m, v), 2),
    "add_independent": lambda m, v: _moments_of(
        M.add_independent(Gaussian(m, var=v), Gaussian(-m, var=v))
    ),
    "scale_gaussian": lambda m, v: _moments_of(M.scale_gaussian(Gaussian(m, var=v), 0.5)),
    "batch_norm_statistics": lambda m, v: M.batch_norm_statistics(*_image(m, v), (0, 2, 3)),
    "batch_normalize_diag": lambda m, v: M.batch_normalize_diag(*_image(m, v), 1e-5),
    "batch_normalize": lambda m, v: M.batch_normalize(*_image(m, v), 1e-5),
    "normalization_scale_shift": lambda m, v: M.normalization_scale_shift(
        m, v, 0.5 * v.sqrt(), m, 1e-5
    ),
    "affine_diag": lambda m, v: M.affine_diag(m, v, 1e-3 * v.sqrt(), m),
    "normalize_diag": lambda m, v: M.normalize_diag(m.reshape(35, 23), v.reshape(35, 23)),
    "normalize_diag_with_slope": lambda m, v: M.normalize_diag_with_slope(
        m.reshape(35, 23), v.reshape(35, 23)
    ),
}
FULL = {
    "relu_full": M.relu_full,
    "heaviside_full": M.heaviside_full,
    "heaviside_cov": lambda m, c: (
        M.heaviside_cov(m, c, M.heaviside_diag(m, c.diagonal(0, -2, -1))[1]),
    ),
    "leaky_relu_full": lambda m, c: S.leaky_relu_full(m, c, 0.1),
    "elu_full": E.elu_full,
    "softplus_full": S.softplus_full,
    **{
        f"{k}_full": getattr(S, f"{k}_full")
        for k in ("gelu", "gelu_tanh", "silu", "sigmoid", "tanh")
    },
    "gelu_closed_full": S.gelu_closed_full,
    "gelu_slope_full": S.gelu_slope_full,
    "mehler_cov": lambda m, c: (
        _mehler.mehler_cov(c, torch.stack([m, m, m], -1).tanh(), c.diagonal(0, -2, -1)),
    ),
    "residual_full": lambda m, c: M.residual_full(m, c, m, c, 0.5 * c),
    "residual_diag": lambda m, c: M.residual_diag(
        m, c.diagonal(0, -2, -1), m, c.diagonal(0, -2, -1), 0.5 * c
    ),
    "cross_through_activation": lambda m, c: (
        M.cross_through_activation(c, M.relu_slope(m, c.diagonal(0, -2, -1))),
    ),
    "affine_full": lambda m, c: M.affine_full(m, c, 1e-3 * m.abs(), m),
    "normalize_full": M.normalize_full,
    "batch_normalize_cov": lambda m, c: (
        M.batch_normalize_cov(c, c.diagonal(0, -2, -1), 1e-3 * m.abs()),
    ),
    "normalize_jacobian": lambda m, c: (M.normalize_jacobian(m, c),),
    "skip_covariance": lambda m, c: (M.skip_covariance(Gaussian(m, cov=c, validate=False)),),
    "as_storage": lambda m, c: _moments_of(
        M.as_storage(Gaussian(m, cov=c, validate=False), "diag")
    ),
}
WEIGHTED = {  # (mean, var, w_loc, w_var) -> outputs
    "linear_deterministic": lambda m, v, w, wv: M.linear_deterministic(m, w, wv, w[:, 0], wv[:, 0]),
    "linear_diag": lambda m, v, w, wv: M.linear_diag(m, v, w, wv, w[:, 0], wv[:, 0]),
    "linear_full_from_diag": lambda m, v, w, wv: M.linear_full_from_diag(m, v, w, wv),
    "linear_full": lambda m, v, w, wv: M.linear_full(m, torch.diag_embed(v), w, wv),
    "cross_through_linear": lambda m, v, w, wv: (M.cross_through_linear(torch.diag_embed(v), w),),
    "conv2d_deterministic": lambda m, v, w, wv: M.conv2d_deterministic(
        _conv_in(m), _kernel(w), _kernel(wv)
    ),
    "conv2d_diag": lambda m, v, w, wv: M.conv2d_diag(
        _conv_in(m), _conv_in(v), _kernel(w), _kernel(wv)
    ),
    "conv2d_sample": lambda m, v, w, wv: (
        M.conv2d_sample(_conv_in(m)[None], _kernel(w)[None], wv[None, :, 0]),
    ),
    "linear_moments": lambda m, v, w, wv: _moments_of(
        M.linear_moments(Gaussian(m, var=v), w, wv, mode="diag")
    ),
    "conv2d_moments": lambda m, v, w, wv: _moments_of(
        M.conv2d_moments(Gaussian(_conv_in(m), var=_conv_in(v)), _kernel(w), _kernel(wv))
    ),
    "activation_moments": lambda m, v, w, wv: _moments_of(
        M.activation_moments(Gaussian(m, var=v), M.relu_full, M.relu_diag, mode="diag")
    ),
    "residual_moments": lambda m, v, w, wv: _moments_of(
        M.residual_moments(Gaussian(m, var=v), Gaussian(m, var=v), torch.diag_embed(v))
    ),
}
# Not moment formulas of means and variances (or no outputs of their own): knobs, shape ops,
# helpers applied inside the functions above, constants.
EXEMPT = {
    "chunk_size", "chunks", "compiled", "get_kernel_backend", "get_memory_budget",
    "kernel_backend", "memory_budget", "policy", "set_kernel_backend", "set_memory_budget",
    "reindex_gaussian", "symmetrize", "clip_correlation", "asin_over_x", "asin_residual_over_x3",
    "soft_relu", "min_variance", "quadrature_rule", "mehler_tail_bound", "DEFAULT_NODES",
    "flush", "tail_cutoff", "tail_argument",
    "smooth_moments",  # the engine behind every smooth *_diag/_full/_slope swept above
    "GeluRule",  # a typing alias (Literal), not a function
}  # fmt: skip


def _moments_of(g):
    return (g.mean, g.var) if g.cov is None else (g.mean, g.cov)


def _conv_in(x):
    return x.reshape(-1, 4)[:, :, None, None].expand(-1, 4, 2, 2)


def _kernel(w):
    return w[:, :, None, None].expand(-1, -1, 1, 1).contiguous()


def _subnormal(t):
    tiny = torch.finfo(t.dtype).tiny
    return int(((t != 0) & (t.abs() < tiny)).sum())


def _check(name, fn, inputs):
    leaves = [x.clone().requires_grad_() for x in inputs]
    outs = [o for o in fn(*leaves) if isinstance(o, torch.Tensor)]
    bad = {f"output {i}": _subnormal(o) for i, o in enumerate(outs)}
    for i, out in enumerate(outs):
        if not out.requires_grad:
            continue
        grads = torch.autograd.grad(out.sum(), leaves, retain_graph=True, allow_unused=True)
        bad |= {f"d output {i} / input {j}": _subnormal(g) for j, g in enumerate(grads)
                if g is not None}  # fmt: skip
    bad = {k: n for k, n in bad.items() if n}
    assert not bad, f"{name}: subnormal values {bad}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(DIAG))
def test_diag_moments_have_no_subnormal_values_or_gradients(name, dtype):
    mean, var = _diag_inputs(dtype)
    _check(name, DIAG[name], (mean, var))


_KNOWN_SUBNORMAL = {
    # the closed-form Mehler coefficients' backward (products with phi(h)/r in the tail) leaves
    # a few subnormal gradient entries; the rule is opt-in (GELU(rule="closed")), the default
    # quadrature passes. strict: the mark must go once it is fixed.
    "gelu_closed_full": "closed-form GELU Mehler coefficients: subnormal gradients in the tail",
}
_FULL_PARAMS = [
    pytest.param(n, marks=pytest.mark.xfail(strict=True, reason=_KNOWN_SUBNORMAL[n]))
    if n in _KNOWN_SUBNORMAL
    else n
    for n in FULL
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _FULL_PARAMS)
def test_full_moments_have_no_subnormal_values_or_gradients(name, dtype):
    mean, cov = _full_inputs(dtype)
    _check(name, FULL[name], (mean, cov))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(WEIGHTED))
def test_layer_moments_have_no_subnormal_values_or_gradients(name, dtype):
    mean, var = _full_inputs(dtype)[0], _full_inputs(dtype)[1].diagonal(0, -2, -1)
    _check(name, WEIGHTED[name], (mean, var, *_weights(dtype)))


def test_every_moment_function_is_swept():
    """Each public function of lightning_dvi.moments (and .smooth, .elu) is in a sweep above."""
    swept = set(DIAG) | set(FULL) | set(WEIGHTED)
    swept = {n.split(" ")[0] for n in swept}
    public = set()
    for module in (M, S, E):
        for name in module.__all__:
            obj = getattr(module, name)
            if callable(obj) and not inspect.isclass(obj) and not name.isupper():
                public.add(name)
    missing = public - swept - EXEMPT
    assert not missing, f"moment functions without a subnormal sweep: {sorted(missing)}"


def test_the_sweep_can_fail():
    """The check itself sees subnormals (a guard against a test that cannot fail)."""
    tiny = torch.finfo(torch.float32).tiny
    with pytest.raises(AssertionError, match="subnormal"):
        _check("x * tiny / 4", lambda m, v: (m * tiny / 4,), (torch.ones(3), torch.ones(3)))
    assert _subnormal(flush(torch.tensor([tiny / 4, -tiny / 4, tail_cutoff(torch.float32)]))) == 0

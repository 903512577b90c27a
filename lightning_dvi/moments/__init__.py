"""Pure moment-propagation functions on tensors (no state; imports only torch and the Gaussian).

The closed forms (:mod:`.linear`, :mod:`.activations`, :mod:`.residual`) take and return
tensors; :mod:`.algebra` adds, scales and reindexes Gaussians; :mod:`.layers` wraps them as
weight moments plus input moments in, a :class:`~lightning_dvi.Gaussian` out, which every
front-end calls. :mod:`.policy` holds the only settings (how the full-covariance kernels
execute: blocked, whole-tensor or compiled, and their memory budget).
"""

from . import policy
from .activations import (
    heaviside_cov,
    heaviside_diag,
    heaviside_full,
    heaviside_slope,
    min_variance,
    relu_diag,
    relu_full,
    relu_slope,
    soft_relu,
)
from .algebra import add_independent, reindex_gaussian, scale_gaussian
from .conv import conv2d_deterministic, conv2d_diag, conv2d_sample
from .layer_norm import (
    normalize_diag,
    normalize_diag_with_slope,
    normalize_full,
    normalize_jacobian,
)
from .layers import (
    HEAD_WIDTH,
    activation_moments,
    as_storage,
    conv2d_moments,
    linear_moments,
    residual_moments,
    skip_covariance,
)
from .linear import (
    linear_deterministic,
    linear_diag,
    linear_full,
    linear_full_from_diag,
    symmetrize,
)
from .normalization import (
    DELTA_MIN_VALUES,
    affine_diag,
    affine_full,
    batch_norm_statistics,
    batch_normalize,
    batch_normalize_cov,
    batch_normalize_diag,
    normalization_scale_shift,
)
from .policy import (
    get_kernel_backend,
    get_memory_budget,
    kernel_backend,
    memory_budget,
    set_kernel_backend,
    set_memory_budget,
)
from .pooling import (
    avg_pool2d_diag,
    max_of_gaussians,
    max_of_gaussians_quadrature,
    max_pool2d_diag,
)
from .residual import cross_through_activation, cross_through_linear, residual_diag, residual_full
from .special import (
    asin_over_x,
    asin_residual_over_x3,
    clip_correlation,
    normal_cdf,
    normal_pdf,
)

__all__ = [
    "DELTA_MIN_VALUES",
    "HEAD_WIDTH",
    "activation_moments",
    "add_independent",
    "affine_diag",
    "affine_full",
    "as_storage",
    "asin_over_x",
    "asin_residual_over_x3",
    "avg_pool2d_diag",
    "batch_norm_statistics",
    "batch_normalize",
    "batch_normalize_cov",
    "batch_normalize_diag",
    "clip_correlation",
    "conv2d_deterministic",
    "conv2d_diag",
    "conv2d_moments",
    "conv2d_sample",
    "cross_through_activation",
    "cross_through_linear",
    "get_kernel_backend",
    "get_memory_budget",
    "heaviside_cov",
    "heaviside_diag",
    "heaviside_full",
    "heaviside_slope",
    "kernel_backend",
    "linear_deterministic",
    "linear_diag",
    "linear_full",
    "linear_full_from_diag",
    "linear_moments",
    "max_of_gaussians",
    "max_of_gaussians_quadrature",
    "max_pool2d_diag",
    "memory_budget",
    "min_variance",
    "normal_cdf",
    "normal_pdf",
    "normalization_scale_shift",
    "normalize_diag",
    "normalize_diag_with_slope",
    "normalize_full",
    "normalize_jacobian",
    "policy",
    "reindex_gaussian",
    "relu_diag",
    "relu_full",
    "relu_slope",
    "residual_diag",
    "residual_full",
    "residual_moments",
    "scale_gaussian",
    "set_kernel_backend",
    "set_memory_budget",
    "skip_covariance",
    "soft_relu",
    "symmetrize",
]

"""Pure moment-propagation functions on tensors (no state; imports only torch)."""

from .activations import (
    heaviside_diag,
    heaviside_full,
    heaviside_slope,
    min_variance,
    relu_diag,
    relu_full,
    relu_slope,
)
from .conv import conv2d_deterministic, conv2d_diag, conv2d_sample
from .linear import (
    linear_deterministic,
    linear_diag,
    linear_full,
    linear_full_from_diag,
    symmetrize,
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
    soft_relu,
)

__all__ = [
    "asin_over_x",
    "asin_residual_over_x3",
    "avg_pool2d_diag",
    "clip_correlation",
    "conv2d_deterministic",
    "conv2d_diag",
    "conv2d_sample",
    "cross_through_activation",
    "cross_through_linear",
    "heaviside_diag",
    "heaviside_full",
    "heaviside_slope",
    "linear_deterministic",
    "linear_diag",
    "linear_full",
    "linear_full_from_diag",
    "max_of_gaussians",
    "max_of_gaussians_quadrature",
    "max_pool2d_diag",
    "min_variance",
    "normal_cdf",
    "normal_pdf",
    "relu_diag",
    "relu_full",
    "relu_slope",
    "residual_diag",
    "residual_full",
    "soft_relu",
    "symmetrize",
]

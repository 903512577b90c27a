"""Pure moment-propagation functions on tensors (no state; imports only torch and the Gaussian).

The closed forms (:mod:`.linear`, :mod:`.activations`, :mod:`.residual`) take and return
tensors; :mod:`.layers` wraps them as weight moments plus input moments in, a
:class:`~lightning_dvi.Gaussian` out, which every front-end calls.
"""

from .activations import (
    heaviside_diag,
    heaviside_full,
    heaviside_slope,
    min_variance,
    relu_diag,
    relu_full,
    relu_slope,
)
from .layers import activation_moments, linear_moments, residual_moments, skip_covariance
from .linear import (
    linear_deterministic,
    linear_diag,
    linear_full,
    linear_full_from_diag,
    symmetrize,
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
    "activation_moments",
    "asin_over_x",
    "asin_residual_over_x3",
    "clip_correlation",
    "cross_through_activation",
    "cross_through_linear",
    "heaviside_diag",
    "heaviside_full",
    "heaviside_slope",
    "linear_deterministic",
    "linear_diag",
    "linear_full",
    "linear_full_from_diag",
    "linear_moments",
    "min_variance",
    "normal_cdf",
    "normal_pdf",
    "relu_diag",
    "relu_full",
    "relu_slope",
    "residual_diag",
    "residual_full",
    "residual_moments",
    "skip_covariance",
    "soft_relu",
    "symmetrize",
]

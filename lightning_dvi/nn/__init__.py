"""Declared BNN modules: each runs in ``full``, ``diag``, ``sample`` and ``local`` mode."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

from torch import nn

from .activations import ELU, GELU, Heaviside, LeakyReLU, ReLU, Sigmoid, SiLU, Softplus, Tanh
from .attention import MultiheadAttention, TransformerEncoderLayer, key_padding
from .base import BayesModule, Moments, WeightLayer
from .builders import CNN, cnn, mlp
from .container import Residual, Sequential
from .conv import AvgPool2d, BayesConv2d, Flatten, MaxPool2d
from .convert import from_torch, register_converter, set_posterior
from .export import PredictiveModule, export_predictive
from .full_cov import BayesLinearFullCov
from .graph import GraphNetwork
from .last_layers import LastLayerNetwork
from .layer_norm import GroupNorm, LayerNorm
from .linear import BayesLinear, FactorisedLayer
from .normalization import BatchNorm1d, BatchNorm2d
from .pooling import AdaptiveAvgPool2d
from .posterior import (
    HasPosterior,
    ParameterGroup,
    PosteriorContext,
    given_weights,
    has_posterior,
    posterior_moments,
    shared_scales,
)
from .posthoc import (
    Calibration,
    calibrate_scales,
    from_torch_posterior,
    ivon_std,
    laplace_std,
    monte_carlo_nll,
    monte_carlo_predictive,
    posterior_parameters,
    predictive_nll,
    prior_std,
    scale_posterior,
)
from .registry import (
    ActivationSpec,
    LayerSpec,
    activation_specs,
    layer_specs,
    register_activation,
    register_layer,
)
from .sequence import Embedding, FixedEmbedding, MeanTokens, PositionalEncoding, RMSNorm
from .torch_file import TorchNetwork, describe_torch, save_torch_network

__all__ = [
    "CNN",
    "ELU",
    "GELU",
    "ActivationSpec",
    "AdaptiveAvgPool2d",
    "AvgPool2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BayesConv2d",
    "BayesLinear",
    "BayesLinearFullCov",
    "BayesModule",
    "Calibration",
    "Embedding",
    "FactorisedLayer",
    "FixedEmbedding",
    "Flatten",
    "GraphNetwork",
    "GroupNorm",
    "HasPosterior",
    "Heaviside",
    "LastLayerNetwork",
    "LayerNorm",
    "LayerSpec",
    "LeakyReLU",
    "MaxPool2d",
    "MeanTokens",
    "Moments",
    "MultiheadAttention",
    "ParameterGroup",
    "PositionalEncoding",
    "PosteriorContext",
    "PredictiveModule",
    "RMSNorm",
    "ReLU",
    "Residual",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Tanh",
    "TorchNetwork",
    "TransformerEncoderLayer",
    "WeightLayer",
    "activation_specs",
    "bayes_layers",
    "calibrate_scales",
    "cnn",
    "describe_torch",
    "export_predictive",
    "from_torch",
    "from_torch_posterior",
    "given_weights",
    "has_posterior",
    "ivon_std",
    "key_padding",
    "laplace_std",
    "layer_specs",
    "mlp",
    "monte_carlo_nll",
    "monte_carlo_predictive",
    "named_parameter_groups",
    "parameter_groups",
    "posterior_moments",
    "posterior_parameters",
    "predictive_nll",
    "prior_std",
    "register_activation",
    "register_converter",
    "register_layer",
    "save_torch_network",
    "scale_posterior",
    "set_posterior",
    "shared_scales",
]


def bayes_layers(module: nn.Module) -> Iterator[HasPosterior]:
    """Every layer in ``module`` that holds a weight posterior (:class:`HasPosterior`), in order.

    Found by protocol, not by type: :class:`BayesLinear`, :class:`BayesConv2d` and any user
    layer with ``parameter_groups()``.
    """
    for m in module.modules():
        if has_posterior(m):
            yield cast(HasPosterior, m)


def named_parameter_groups(module: nn.Module) -> list[tuple[str, ParameterGroup]]:
    """Every prior group in ``module`` with a dotted name such as ``"layers.0.weight"``.

    The one walk over parameter groups, over every layer with a posterior
    (:class:`HasPosterior`). Names follow ``module.named_modules()``, so they match the
    state-dict keys of the layers.
    """
    return [
        (f"{prefix}.{group.name}" if prefix else group.name, group)
        for prefix, layer in module.named_modules()
        if has_posterior(layer)
        for group in cast(HasPosterior, layer).parameter_groups()
    ]


def parameter_groups(module: nn.Module) -> list[ParameterGroup]:
    """Every prior group (one per weight matrix, one per bias vector) inside ``module``.

    The groups of :func:`named_parameter_groups`, in its order, without building the names
    (the KL's walk in every ELBO evaluation).
    """
    return [
        group
        for layer in module.modules()
        if has_posterior(layer)
        for group in cast(HasPosterior, layer).parameter_groups()
    ]

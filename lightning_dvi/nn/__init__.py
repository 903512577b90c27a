"""Declared BNN modules: each runs in ``full``, ``diag``, ``sample`` and ``local`` mode."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .activations import ELU, GELU, Heaviside, LeakyReLU, ReLU, Sigmoid, SiLU, Softplus, Tanh
from .base import BayesModule, Moments
from .builders import CNN, cnn, mlp
from .container import Residual, Sequential
from .conv import AvgPool2d, BayesConv2d, Flatten, MaxPool2d
from .convert import from_torch, register_converter, set_posterior
from .export import PredictiveModule, export_predictive
from .linear import BayesLinear, ParameterGroup
from .registry import ActivationSpec, activation_specs, register_activation
from .torch_file import TorchNetwork, describe_torch, save_torch_network

__all__ = [
    "BAYES_LAYER_TYPES",
    "CNN",
    "ELU",
    "GELU",
    "ActivationSpec",
    "AvgPool2d",
    "BayesConv2d",
    "BayesLinear",
    "BayesModule",
    "Flatten",
    "Heaviside",
    "LeakyReLU",
    "MaxPool2d",
    "Moments",
    "ParameterGroup",
    "PredictiveModule",
    "ReLU",
    "Residual",
    "Sequential",
    "SiLU",
    "Sigmoid",
    "Softplus",
    "Tanh",
    "TorchNetwork",
    "activation_specs",
    "bayes_layers",
    "cnn",
    "describe_torch",
    "export_predictive",
    "from_torch",
    "mlp",
    "named_parameter_groups",
    "parameter_groups",
    "register_activation",
    "register_converter",
    "save_torch_network",
    "set_posterior",
]


BAYES_LAYER_TYPES: tuple[type[BayesLinear], type[BayesConv2d]] = (BayesLinear, BayesConv2d)
"""The layer types that own weight posteriors (and so prior groups)."""


def bayes_layers(module: nn.Module) -> Iterator[BayesLinear | BayesConv2d]:
    """All weight layers (:class:`BayesLinear`, :class:`BayesConv2d`) in ``module``, in order."""
    for m in module.modules():
        if isinstance(m, BAYES_LAYER_TYPES):
            yield m


def named_parameter_groups(module: nn.Module) -> list[tuple[str, ParameterGroup]]:
    """Every prior group in ``module`` with a dotted name such as ``"layers.0.weight"``.

    The one walk over parameter groups. Names follow ``module.named_modules()``, so they match
    the state-dict keys of the layers.
    """
    return [
        (f"{prefix}.{group.name}" if prefix else group.name, group)
        for prefix, layer in module.named_modules()
        if isinstance(layer, BAYES_LAYER_TYPES)
        for group in layer.parameter_groups()
    ]


def parameter_groups(module: nn.Module) -> list[ParameterGroup]:
    """Every prior group (one per weight matrix, one per bias vector) inside ``module``."""
    return [group for _, group in named_parameter_groups(module)]

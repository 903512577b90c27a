"""Declared BNN modules: each runs in ``full``, ``diag``, ``sample`` and ``local`` mode."""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn

from .activations import Heaviside, ReLU
from .base import BayesModule, Moments
from .builders import CNN, cnn, mlp
from .container import Residual, Sequential
from .conv import AvgPool2d, BayesConv2d, Flatten, MaxPool2d
from .linear import BayesLinear, ParameterGroup
from .registry import ActivationSpec, activation_specs, register_activation

__all__ = [
    "BAYES_LAYER_TYPES",
    "CNN",
    "ActivationSpec",
    "AvgPool2d",
    "BayesConv2d",
    "BayesLinear",
    "BayesModule",
    "Flatten",
    "Heaviside",
    "MaxPool2d",
    "Moments",
    "ParameterGroup",
    "ReLU",
    "Residual",
    "Sequential",
    "activation_specs",
    "bayes_layers",
    "cnn",
    "mlp",
    "parameter_groups",
    "register_activation",
]


BAYES_LAYER_TYPES: tuple[type[BayesModule], ...] = (BayesLinear, BayesConv2d)
"""The layer types that own weight posteriors (and so prior groups)."""


def bayes_layers(module: nn.Module) -> Iterator[BayesLinear | BayesConv2d]:
    """All weight layers (:class:`BayesLinear`, :class:`BayesConv2d`) in ``module``, in order."""
    for m in module.modules():
        if isinstance(m, BAYES_LAYER_TYPES):
            yield m  # type: ignore[misc]


def parameter_groups(module: nn.Module) -> list[ParameterGroup]:
    """Every prior group (one per weight matrix, one per bias vector) inside ``module``."""
    return [g for layer in bayes_layers(module) for g in layer.parameter_groups()]

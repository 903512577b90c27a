"""Builders for the standard architectures used by the front-ends and recipes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal

from . import activations as _activations  # noqa: F401  (registers the built-in activations)
from .base import BayesModule
from .container import Residual, Sequential
from .conv import AvgPool2d, BayesConv2d, Flatten, MaxPool2d
from .linear import BayesLinear
from .registry import activation_specs

__all__ = ["CNN", "activation_class", "cnn", "mlp"]

Activation = str
"""The registry name of an activation (:func:`~lightning_dvi.nn.registry.activation_specs`):
``"relu"``, ``"heaviside"``, ``"leaky_relu"``, ``"gelu"``, ``"silu"``, ``"tanh"``,
``"sigmoid"``, ``"elu"``, ``"softplus"``, or one registered with
:func:`~lightning_dvi.nn.register_activation`."""


def activation_class(name: Activation) -> type[BayesModule]:
    """The declared activation registered as ``name``, built with its defaults by the builders.

    Raises:
        ValueError: no activation of that name is registered (the message lists those that are).
    """
    classes = {spec.name: spec.cls for spec in activation_specs() if spec.cls is not None}
    if not isinstance(name, str) or name not in classes:
        raise ValueError(
            f"activation must be the name of a registered activation, one of {sorted(classes)}; "
            f"got {name!r}"
        )
    return classes[name]


def mlp(
    in_features: int,
    hidden: Sequence[int],
    out_features: int,
    activation: Activation = "relu",
    residual: bool = False,
    **layer_kwargs: Any,
) -> Sequential:
    """A Bayesian MLP ``in -> hidden[0] -> ... -> hidden[-1] -> out``.

    Args:
        in_features: input size.
        hidden: hidden widths (may be empty: a Bayesian linear model).
        out_features: output size.
        activation: the name of a registered activation (:data:`Activation`), e.g. ``"relu"``,
            ``"gelu"`` or ``"tanh"``; built with its default parameters.
        residual: wrap each hidden layer whose width equals the previous one in a skip
            connection, ``a = a' + W f(a') + b`` (paper appendix C).
        **layer_kwargs: forwarded to every :class:`BayesLinear` (e.g. ``init_scale``).

    Examples:
        >>> net = mlp(1, [128, 128], 2)
        >>> [type(m).__name__ for m in net]
        ['BayesLinear', 'ReLU', 'BayesLinear', 'ReLU', 'BayesLinear']
    """
    act = activation_class(activation)
    widths = [int(h) for h in hidden]
    if any(h < 1 for h in widths):
        raise ValueError(f"hidden widths must be positive, got {list(hidden)}")
    if not widths:
        return Sequential(BayesLinear(in_features, out_features, **layer_kwargs))
    layers: list[BayesModule] = [BayesLinear(in_features, widths[0], **layer_kwargs)]
    for prev, width in itertools.pairwise(widths):
        if residual and prev == width:
            layers.append(Residual(act(), BayesLinear(prev, width, **layer_kwargs)))
        else:
            layers += [act(), BayesLinear(prev, width, **layer_kwargs)]
    layers += [act(), BayesLinear(widths[-1], out_features, **layer_kwargs)]
    return Sequential(*layers)


Pool = Literal["avg", "max", "none"]
_POOLS: dict[str, type[BayesModule]] = {"avg": AvgPool2d, "max": MaxPool2d}


class CNN(Sequential):
    r"""A Bayesian convolutional network: conv blocks, :class:`Flatten`, then a dense head.

    Each entry of ``channels`` adds ``BayesConv2d(k, padding=k // 2)`` (size-preserving for odd
    ``k``), the activation and, unless ``pool="none"``, a 2x2 pooling that halves the image.
    The dense head is :func:`mlp`-shaped: ``hidden`` widths, then ``num_classes`` outputs. In
    ``mode="full"`` the conv blocks run diagonal and the first dense layer lifts to full
    covariance (the rule in :mod:`lightning_dvi.nn.conv`).

    A class (not only the :func:`cnn` function) so that a LightningCLI config can build it with
    ``class_path: lightning_dvi.nn.CNN``.

    Args:
        in_channels: image channels :math:`C`.
        num_classes: outputs of the last layer.
        image_size: ``H`` (square) or ``(H, W)`` of the input images.
        channels: output channels of each conv block.
        hidden: widths of the dense hidden layers after :class:`Flatten`.
        kernel_size: odd kernel size of every convolution.
        pool: ``"avg"`` (exact), ``"max"`` (moment-matched) or ``"none"``.
        activation: the name of a registered activation (:data:`Activation`), e.g. ``"relu"``,
            ``"gelu"`` or ``"tanh"``; built with its default parameters.
        init_scale: initial posterior std of every layer (default: each layer's own).
        prior_variance: initial prior-variance buffers of every layer.

    Examples:
        >>> import torch
        >>> net = CNN(1, 10, image_size=8, channels=[4], hidden=[16])
        >>> [type(m).__name__ for m in net]
        ['BayesConv2d', 'ReLU', 'AvgPool2d', 'Flatten', 'BayesLinear', 'ReLU', 'BayesLinear']
        >>> tuple(net(torch.zeros(2, 1, 8, 8), mode="full").cov.shape)
        (2, 10, 10)
    """

    def __init__(
        self,
        in_channels: int = 1,
        num_classes: int = 10,
        image_size: int | tuple[int, int] = 8,
        channels: Sequence[int] = (16, 32),
        hidden: Sequence[int] = (64,),
        kernel_size: int = 3,
        pool: Pool = "avg",
        activation: Activation = "relu",
        init_scale: float | None = None,
        prior_variance: float = 1.0,
    ) -> None:
        if pool not in ("avg", "max", "none"):
            raise ValueError(f"pool must be 'avg', 'max' or 'none', got {pool!r}")
        act = activation_class(activation)
        if kernel_size < 1 or kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be a positive odd int, got {kernel_size}")
        widths = [int(c) for c in channels]
        if not widths or any(c < 1 for c in widths):
            raise ValueError(f"channels must be a non-empty list of positive ints, got {channels}")
        h, w = (image_size, image_size) if isinstance(image_size, int) else image_size
        kwargs: dict[str, Any] = {"prior_variance": prior_variance}
        if init_scale is not None:
            kwargs["init_scale"] = init_scale
        layers: list[BayesModule] = []
        prev = in_channels
        for c in widths:
            layers += [BayesConv2d(prev, c, kernel_size, padding=kernel_size // 2, **kwargs), act()]
            if pool != "none":
                if h < 2 or w < 2:
                    raise ValueError(
                        f"image_size {image_size} is too small for {len(widths)} pooled blocks"
                    )
                layers.append(_POOLS[pool](2))
                h, w = h // 2, w // 2
            prev = c
        layers.append(Flatten())
        head = mlp(prev * h * w, list(hidden), num_classes, activation, **kwargs)
        super().__init__(*layers, *head)


def cnn(
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: int | tuple[int, int] = 8,
    channels: Sequence[int] = (16, 32),
    hidden: Sequence[int] = (64,),
    **kwargs: Any,
) -> CNN:
    """Build a :class:`CNN` (the functional spelling, like :func:`mlp`).

    Examples:
        >>> import torch
        >>> net = cnn(1, 10, channels=[8, 16], hidden=[32])
        >>> tuple(net(torch.zeros(3, 1, 8, 8), mode="diag").mean.shape)
        (3, 10)
    """
    return CNN(in_channels, num_classes, image_size, channels, hidden, **kwargs)

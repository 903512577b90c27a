"""Builders for the standard architectures used by the front-ends and recipes."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Literal

from .activations import Heaviside, ReLU
from .base import BayesModule
from .container import Residual, Sequential
from .linear import BayesLinear

__all__ = ["mlp"]

Activation = Literal["relu", "heaviside"]
_ACTIVATIONS: dict[str, type[BayesModule]] = {"relu": ReLU, "heaviside": Heaviside}


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
        activation: ``"relu"`` or ``"heaviside"``.
        residual: wrap each hidden layer whose width equals the previous one in a skip
            connection, ``a = a' + W f(a') + b`` (paper appendix C).
        **layer_kwargs: forwarded to every :class:`BayesLinear` (e.g. ``init_scale``).

    Examples:
        >>> net = mlp(1, [128, 128], 2)
        >>> [type(m).__name__ for m in net]
        ['BayesLinear', 'ReLU', 'BayesLinear', 'ReLU', 'BayesLinear']
    """
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
    widths = [int(h) for h in hidden]
    if any(h < 1 for h in widths):
        raise ValueError(f"hidden widths must be positive, got {list(hidden)}")
    act = _ACTIVATIONS[activation]
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

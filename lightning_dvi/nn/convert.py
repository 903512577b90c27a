r"""Convert a torch ``nn.Sequential`` into a declared DVI network (:func:`from_torch`).

Each torch layer maps to a declared module: ``nn.Linear`` to :class:`BayesLinear`, activations
through the registry (:mod:`lightning_dvi.nn.registry`: ``nn.ReLU``, ``nn.LeakyReLU``,
``nn.GELU``, ``nn.SiLU``, ``nn.Tanh``, ``nn.Sigmoid``, ...), ``nn.Flatten`` to a flatten module,
and ``nn.Dropout``/``nn.Identity`` are dropped (DVI's weight posterior replaces dropout's noise).
Nested ``nn.Sequential`` containers are flattened in order. Anything else raises an error naming
the layer and its position. ``nn.Conv2d`` becomes :class:`~lightning_dvi.nn.BayesConv2d`
(``groups=1``, no dilation), ``nn.AvgPool2d``/``nn.MaxPool2d`` the moment-propagating pools;
converters for further layer types plug in through :func:`register_converter`.

**Posterior initialisation** (``init="torch"``, in the spirit of MOPED, Krishnan et al. 2020):
the posterior means are the torch weights and biases, and the posterior standard deviations are
a fraction of their magnitude,

.. math::
    q(w) = \mathcal N\big(w_{\text{torch}},\ (\delta\,|w_{\text{torch}}|)^2\big),
    \qquad \delta = \texttt{scale\_fraction},

floored at ``min_scale`` (so that a weight that is exactly zero still gets a positive scale and a
finite KL). ``scale_fraction=0`` sets every scale to exactly zero (the raw parameter is
:math:`-\infty` under either scale transform): the network is then the deterministic torch
network, in every mode, which is what export and round-trip checks want, but its KL is infinite,
so do not train it. The prior stays the library's zero-mean prior (MOPED's prior centred on the
pretrained weights is not implemented). ``init="fresh"`` keeps only the architecture.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..propagation import Propagation
from .base import BayesModule, Moments
from .container import Sequential
from .graph import GraphNetwork
from .posterior import set_posterior
from .registry import (
    ConversionOptions,
    Init,
    register_converter,
    register_layer,
    spec_for_module,
)
from .trace import graph_from_torch

if TYPE_CHECKING:
    from .last_layers import LastLayerNetwork

__all__ = [
    "ConversionOptions",
    "TorchFlatten",
    "from_torch",
    "register_converter",
    "set_posterior",
]


# Torch layers that conversion removes: DVI's weight posterior replaces dropout's noise.
@register_converter(
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity,
    kind="dropped",
)  # fmt: skip
def _drop(module: nn.Module, options: ConversionOptions) -> None:
    return None


def _convert_flatten(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Flatten)
    return TorchFlatten(module.start_dim, module.end_dim)


def _flatten_call(
    start_dim: int = 0, end_dim: int = -1, features: int | None = None
) -> BayesModule:
    if start_dim == 0:
        raise NotImplementedError(
            "torch.flatten(x) with start_dim=0 merges the batch dimension; use torch.flatten(x, 1)"
        )
    return TorchFlatten(start_dim, end_dim, features)


@register_layer(
    "torch_flatten",
    kind="shape",
    torch_modules=(nn.Flatten,),
    torch_functions=(torch.flatten, Tensor.flatten),
    convert=_convert_flatten,
    from_call=_flatten_call,
)
class TorchFlatten(BayesModule):
    """``torch.nn.Flatten`` for converted networks: flattens tensors (any mode) and diag Gaussians.

    Unlike :class:`lightning_dvi.nn.Flatten` (images ``[B, C, H, W]`` only, for declared CNNs)
    it keeps ``torch.nn.Flatten``'s ``start_dim``/``end_dim`` and lets flat inputs through, as
    the torch module does, so a converted network accepts what the torch one accepted.

    In the Monte Carlo modes the leading sample dimension is kept out of the flattened range.
    A full-covariance Gaussian is already flat (``[B, D]``) and passes through unchanged.

    Args:
        start_dim: first dimension to flatten (counted without the sample dimension).
        end_dim: last dimension to flatten.
        features: the size the flattened dimension must have (``x.view(-1, N)``, converted
            as ``flatten(1, -1)``: it keeps the batch only if a row has ``N`` values);
            ``None``: no check.

    Raises:
        ValueError: at run time, for an input whose flattened size is not ``features``.
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1, features: int | None = None) -> None:
        super().__init__()
        self.start_dim, self.end_dim = int(start_dim), int(end_dim)
        self.features = None if features is None else int(features)

    def _dims(self, offset: int) -> tuple[int, int]:
        start = self.start_dim + offset if self.start_dim >= 0 else self.start_dim
        end = self.end_dim + offset if self.end_dim >= 0 else self.end_dim
        return start, end

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Flatten the tensor (or the diag Gaussian's mean and variance)."""
        if isinstance(x, Gaussian):
            if x.is_full:
                if x.mean.dim() != 2:
                    raise ValueError("Flatten: a full-covariance Gaussian must be [B, D]")
                return self._checked(x, x.mean, mode)
            start, end = self._dims(0)
            flat = x.mean.flatten(start, end)
            return self._checked(Gaussian(flat, var=x.var.flatten(start, end)), flat, mode)
        start, end = self._dims(1 if mode.samples else 0)
        out = x.flatten(start, end)
        return self._checked(out, out, mode)

    def _checked(self, out: Moments, values: Tensor, mode: Propagation) -> Moments:
        if self.features is not None and values.shape[-1] != self.features:
            batch = values.shape[1 if mode.samples else 0]
            raise ValueError(
                f"x.view(-1, {self.features}) of a batch of {batch} rows of "
                f"{values.shape[-1]} values would change the batch size; converted networks "
                "keep the batch (only a view that flattens each row is supported)"
            )
        return out

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Identity on flat inputs (Residual branches carry ``[B, D]`` moments)."""
        if x.mean.dim() != 2:
            raise ValueError("Flatten inside a Residual block needs a flat [B, D] input")
        return cross

    def extra_repr(self) -> str:
        """The flattened dimensions."""
        text = f"start_dim={self.start_dim}, end_dim={self.end_dim}"
        return text if self.features is None else f"{text}, features={self.features}"


def _leaves(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    if type(module) is nn.Sequential:
        for name, child in module.named_children():
            yield from _leaves(child, f"{path}.{name}" if path else name)
    else:
        yield path or type(module).__name__, module


_SUPPORTED = (
    "Linear, Conv2d, AvgPool2d, MaxPool2d, Flatten, Dropout (dropped), Identity (dropped), "
    "MultiheadAttention and TransformerEncoderLayer (batch_first), Embedding, LayerNorm, "
    "RMSNorm, nested Sequential, and the registered activations"
)


@overload
def from_torch(
    module: nn.Module,
    init: Init = ...,
    scale_fraction: float = ...,
    min_scale: float = ...,
    *,
    last_layers: None = None,
    freeze_backbone: bool = ...,
    head_covariance: Literal["diag", "full"] = ...,
    **layer_kwargs: Any,
) -> Sequential | GraphNetwork: ...


@overload
def from_torch(
    module: nn.Module,
    init: Init = ...,
    scale_fraction: float = ...,
    min_scale: float = ...,
    *,
    last_layers: int,
    freeze_backbone: bool = ...,
    head_covariance: Literal["diag", "full"] = ...,
    **layer_kwargs: Any,
) -> LastLayerNetwork: ...


def from_torch(
    module: nn.Module,
    init: Init = "torch",
    scale_fraction: float = 0.1,
    min_scale: float = 1e-8,
    *,
    last_layers: int | None = None,
    freeze_backbone: bool = True,
    head_covariance: Literal["diag", "full"] = "diag",
    **layer_kwargs: Any,
) -> Sequential | GraphNetwork | LastLayerNetwork:
    r"""Convert a torch network into a declared DVI network.

    A plain ``nn.Sequential`` of registered layers (or a single layer) converts layer by layer
    into a :class:`~lightning_dvi.nn.Sequential`. Any other module (a subclass of
    ``nn.Sequential``, a module with its own ``forward`` calling ``F.relu``, adding skip
    connections, concatenating, flattening, ...) is traced with ``torch.fx`` and converted into
    a :class:`~lightning_dvi.nn.GraphNetwork` that follows the same graph
    (:mod:`lightning_dvi.nn.trace`; docs/byo_network.md lists the supported operations).

    Args:
        module: a torch ``nn.Sequential`` (nested ones are flattened), a single layer, or any
            module ``torch.fx`` can trace that takes one tensor and returns one.
        init: ``"torch"``: posterior means from the torch weights, scales
            ``max(scale_fraction * |w|, min_scale)`` (MOPED-style); ``"fresh"``: the declared
            layers' own initialisation (only the architecture is kept).
        scale_fraction: :math:`\delta \ge 0`; ``0`` gives exactly zero posterior scales, a
            deterministic copy of the torch network (infinite KL: for export and checks).
        min_scale: floor of the posterior std when ``scale_fraction > 0``.
        last_layers: make only the last ``k`` weight layers Bayesian: the network is traced
            with ``torch.fx`` and cut before them; the rest stays a plain-torch backbone
            (:mod:`lightning_dvi.nn.last_layers`). ``None``: convert the whole network.
        freeze_backbone: with ``last_layers``: freeze the backbone (no gradients, eval mode).
        head_covariance: with ``last_layers``: ``"diag"`` (factorised posterior) or
            ``"full"`` (a full-covariance posterior over the weights and bias of the head's
            output Linear layer, :class:`~lightning_dvi.nn.BayesLinearFullCov`: correlated
            logits).
        **layer_kwargs: forwarded to every :class:`BayesLinear` (e.g. ``prior_variance``,
            ``scale_transform``, and ``init_scale`` for ``init="fresh"``).

    Returns:
        A :class:`~lightning_dvi.nn.Sequential` (layer path) or a
        :class:`~lightning_dvi.nn.GraphNetwork` (graph path) of declared modules, on the torch
        weights' device and dtype; with ``last_layers``, a
        :class:`~lightning_dvi.nn.LastLayerNetwork` (backbone and head).

    Raises:
        NotImplementedError: for a layer that cannot be converted, naming its position and
            path, e.g. ``layer 3 (2.1): BatchNorm1d is not supported``; on the graph path, for
            a module fx cannot trace (saying why) or a node without a declared equivalent
            (naming the node, its op and target, its module and source line).
        ValueError: on bad options or a network with nothing left to convert.

    Examples:
        >>> import torch
        >>> torch_net = torch.nn.Sequential(
        ...     torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)
        ... )
        >>> net = from_torch(torch_net, scale_fraction=0.0)
        >>> [type(m).__name__ for m in net]
        ['BayesLinear', 'GELU', 'BayesLinear']
        >>> x = torch.randn(4, 3)
        >>> out = net(x, mode="diag")
        >>> torch.allclose(out.mean, torch_net.eval()(x), atol=1e-6), out.var.abs().max().item()
        (True, 0.0)
    """
    if init not in ("torch", "fresh"):
        raise ValueError(f"init must be 'torch' or 'fresh', got {init!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    for name, value in (("scale_fraction", scale_fraction), ("min_scale", min_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if scale_fraction > 0 and min_scale <= 0:
        raise ValueError("min_scale must be > 0 when scale_fraction > 0 (finite KL)")
    options = ConversionOptions(init, float(scale_fraction), float(min_scale), dict(layer_kwargs))
    if last_layers is not None:
        from .last_layers import last_layer_network

        return last_layer_network(module, last_layers, options, freeze_backbone, head_covariance)
    try:
        if _by_graph(module):
            return graph_from_torch(module, options)
        layers: list[BayesModule] = []
        for position, (path, leaf) in enumerate(_leaves(module, ""), start=1):
            converted = _convert_leaf(leaf, options, position, path)
            if converted is not None:
                layers.append(converted)
    except NotImplementedError as err:
        raise NotImplementedError(f"{err}{_LAST_LAYERS_HINT}") from err
    if not layers:
        raise ValueError("from_torch: nothing left to convert (only dropped layers)")
    return Sequential(*layers)


_LAST_LAYERS_HINT = (
    ". To keep such a network's body as plain torch (embeddings, recurrent or attention layers, "
    "any torch code) and make only its last k weight layers Bayesian, convert it with "
    "from_torch(model, last_layers=k)"
)


def _by_graph(module: nn.Module) -> bool:
    """Whether ``module`` goes through ``torch.fx``.

    Anything but a plain ``nn.Sequential`` (or a single layer) of registered torch layers, which
    keeps the layer-by-layer path.
    """
    for _, leaf in _leaves(module, ""):
        if spec_for_module(leaf) is None and not isinstance(leaf, BayesModule):
            # torch's own layers are leaves for fx too: the layer path names them by position
            return not type(leaf).__module__.startswith("torch.nn")
    return False


def _convert_leaf(
    leaf: nn.Module, options: ConversionOptions, position: int, path: str
) -> BayesModule | None:
    where = f"layer {position} ({path}): {type(leaf).__name__}"
    if isinstance(leaf, BayesModule):
        raise NotImplementedError(f"{where} is already a lightning_dvi module")
    spec = spec_for_module(leaf)
    try:
        if spec is not None:
            return spec.convert_module(leaf, options)
    except (NotImplementedError, ValueError) as err:
        raise NotImplementedError(f"{where} cannot be converted: {err}") from err
    raise NotImplementedError(f"{where} is not supported; from_torch converts {_SUPPORTED}")

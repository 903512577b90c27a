r"""A posterior from elsewhere: a one-pass Bayesian predictive for a network trained elsewhere.

A trained torch network (deterministic, or with a diagonal Gaussian posterior fitted by another
method) becomes a declared DVI network without retraining: the posterior means are its weights,
the posterior standard deviations come from a source given per parameter, and a post-hoc
calibration fits one multiplicative factor on those standard deviations (per network or per
layer) on validation NLL, as SUQ (Li et al., ICLR 2025) and CVP do. The result runs in every
mode and exports like any other network (:func:`~lightning_dvi.nn.export_predictive`).

Usage::

    from lightning_dvi.nn import posthoc
    from lightning_dvi.likelihoods import Categorical

    std = posthoc.ivon_std(optimizer, model)          # or laplace_std / prior_std / a dict
    net = posthoc.from_torch_posterior(model, std)    # means = weights, stds = std
    lik = Categorical(num_classes)
    result = posthoc.calibrate_scales(net, lik, x_val, y_val)       # per="network" or "layer"
    probs = lik.predictive_probs(net(x_test, mode="diag"))         # one pass
    mc = posthoc.monte_carlo_predictive(net, lik, x_test, 32)       # same posterior, 32 draws
    exported = export_predictive(net, lik)                          # .save("model.onnx", x)

**Sources of standard deviations** (each a ``{torch parameter name: std tensor}`` dict, the
shapes of ``model.state_dict()``'s parameters):

* :func:`ivon_std`: an IVON optimiser's state (``ivon-opt``):
  :math:`\sigma = 1/\sqrt{\lambda(h + \delta)}` with :math:`h` its Hessian estimate,
  :math:`\lambda` the effective sample size ``ess`` and :math:`\delta` the weight decay;
* :func:`laplace_std`: a diagonal Laplace approximation's precisions or variances,
  :math:`\sigma = (h + \tau)^{-1/2}`;
* :func:`prior_std`: one standard deviation (or prior variance) for every parameter;
* a dict of your own (e.g. a mean-field VI posterior's scales), or a float.

**Where a standard deviation lands.** Conversion copies, slices and reshapes torch tensors into
the declared layers (``in_proj_weight`` into three projections, a torch ``nn.Linear`` into a
:class:`~lightning_dvi.nn.BayesLinear`, ...). :func:`from_torch_posterior` finds where every
element went by converting a copy of the model whose parameters hold their own flat indices,
so a standard deviation follows its weight through any conversion that moves values without
arithmetic. Parameters that stay point values in the converted network (LayerNorm gains,
positional tables, a ``last_layers`` backbone) ignore their standard deviations;
:func:`posterior_parameters` lists the ones that get a posterior.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian, NonFiniteMomentsError
from ..likelihoods import Likelihood
from ..moments.attention import AttentionRule
from ..moments.layer_norm import LayerNormRoute
from ..moments.skip import SkipRule, check_skip_rule
from ..moments.smooth import GeluRule
from ..propagation import moment_propagation
from .base import BayesModule
from .convert import from_torch
from .posterior import HasPosterior, has_posterior, set_posterior

__all__ = [
    "Calibration",
    "calibrate_scales",
    "from_torch_posterior",
    "ivon_std",
    "laplace_std",
    "monte_carlo_nll",
    "monte_carlo_predictive",
    "posterior_parameters",
    "predictive_nll",
    "prior_std",
    "scale_posterior",
    "set_rules",
]

StdSource = Mapping[str, Tensor] | float
"""Posterior standard deviations: ``{torch parameter name: tensor of its shape}``, or one float."""


# --------------------------------------------------------------------------- where weights land
def _convert(module: nn.Module, options: Mapping[str, Any]) -> BayesModule:
    return cast(BayesModule, from_torch(module, scale_fraction=0.0, **options))


def _marked(module: nn.Module) -> tuple[nn.Module, list[tuple[str, int, int]]]:
    """A float64 copy of ``module`` whose parameter elements hold their flat index plus one."""
    marked = copy.deepcopy(module).double()
    spans: list[tuple[str, int, int]] = []
    offset = 0
    with torch.no_grad():
        for name, p in marked.named_parameters():
            n = p.numel()
            p.copy_(torch.arange(offset + 1, offset + n + 1, dtype=torch.float64).view(p.shape))
            spans.append((name, offset, n))
            offset += n
    return marked, spans


def _posterior_layers(net: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, layer in net.named_modules():
        if has_posterior(layer):
            yield name, layer


def _index(loc: Tensor, total: int, where: str) -> Tensor:
    """Flat source indices of a marked group's means (``-1``: no torch parameter behind it)."""
    index = loc.detach().round()
    if not torch.equal(index, loc.detach()) or bool((index < 0).any() | (index > total).any()):
        raise NotImplementedError(
            f"{where}: the conversion computed these weights from the torch parameters (not a "
            "copy), so their posterior standard deviations cannot be mapped"
        )
    return index.long().cpu() - 1


def _sources(
    module: nn.Module, options: Mapping[str, Any]
) -> tuple[list[tuple[str, int, int]], dict[str, dict[str, Tensor]]]:
    """Per posterior layer of the converted network, per group, the flat source indices."""
    marked, spans = _marked(module)
    total = sum(n for _, _, n in spans)
    marked_net = _convert(marked, options)
    found: dict[str, dict[str, Tensor]] = {}
    for name, layer in _posterior_layers(marked_net):
        found[name] = {
            g.name: _index(g.loc, total, f"{name}.{g.name}")
            for g in cast(HasPosterior, layer).parameter_groups()
        }
    return spans, found


def _flat_std(module: nn.Module, std: StdSource, spans: list[tuple[str, int, int]]) -> Tensor:
    """The standard deviations as one float64 vector over ``named_parameters`` (NaN: not given)."""
    total = sum(n for _, _, n in spans)
    if not isinstance(std, Mapping):
        value = float(std)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"a posterior standard deviation must be finite and >= 0, got {std}")
        return torch.full((total,), value, dtype=torch.float64)
    params = dict(module.named_parameters())
    unknown = sorted(set(std) - set(params))
    if unknown:
        raise ValueError(f"standard deviations given for names that are not parameters: {unknown}")
    flat = torch.full((total,), math.nan, dtype=torch.float64)
    for name, offset, n in spans:
        if name not in std:
            continue
        given = torch.as_tensor(std[name]).detach().to(device="cpu", dtype=torch.float64)
        if given.shape != params[name].shape:
            raise ValueError(
                f"{name}: standard deviations of shape {tuple(given.shape)}, the parameter is "
                f"{tuple(params[name].shape)}"
            )
        if not bool(torch.isfinite(given).all()) or bool((given < 0).any()):
            raise ValueError(f"{name}: standard deviations must be finite and >= 0")
        flat[offset : offset + n] = given.flatten()
    return flat


def _write(layer: nn.Module, scales: Mapping[str, Tensor], where: str) -> None:
    """Set ``layer``'s posterior standard deviations per group (means unchanged)."""
    groups = {g.name: g for g in cast(HasPosterior, layer).parameter_groups()}
    loc = {k: g.loc.detach() for k, g in groups.items()}
    std = {k: scales[k].to(loc[k]) for k in groups}
    setter = getattr(layer, "set_posterior", None)  # BayesLinearFullCov: a diagonal L
    if hasattr(layer, "weight_raw_scale"):
        set_posterior(layer, loc["weight"], std["weight"], loc.get("bias"), std.get("bias"))
    elif callable(setter) and set(groups) == {"weight", "bias"}:
        setter(loc["weight"], std["weight"], loc["bias"], std["bias"])
    else:
        raise NotImplementedError(
            f"{where}: {type(layer).__name__} has no known way to set its posterior scales"
        )


def from_torch_posterior(
    module: nn.Module,
    std: StdSource,
    *,
    strict: bool = True,
    last_layers: int | None = None,
    head_covariance: Literal["diag", "full"] = "diag",
    attention_rule: AttentionRule | None = None,
    layer_norm_route: LayerNormRoute | None = None,
    gelu_rule: GeluRule | None = None,
    skip_rule: SkipRule | None = None,
    **layer_kwargs: Any,
) -> BayesModule:
    r"""Convert a trained torch network with a diagonal Gaussian posterior :math:`\mathcal N(w, \sigma^2)`.

    The posterior means are the torch weights (as :func:`~lightning_dvi.nn.from_torch`) and the
    standard deviations are ``std``, element by element: the converted layer's
    :math:`q(\theta_i) = \mathcal N(w_{j(i)}, \sigma_{j(i)}^2)` where :math:`j(i)` is the torch
    parameter element that conversion copied into :math:`\theta_i` (see the module docstring).

    Args:
        module: the trained torch network (anything :func:`~lightning_dvi.nn.from_torch`
            converts).
        std: ``{name: std}`` with the names and shapes of ``module.named_parameters()`` (a
            ``state_dict``-shaped mapping; :func:`ivon_std`, :func:`laplace_std`,
            :func:`prior_std` build one), or one float for every parameter.
        strict: a parameter that gets a posterior but has no entry in ``std`` raises; with
            ``strict=False`` its standard deviation is 0 (a point value).
        last_layers: as :func:`~lightning_dvi.nn.from_torch` (only the last ``k`` weight
            layers get a posterior).
        head_covariance: as :func:`~lightning_dvi.nn.from_torch` (``"full"``: a diagonal
            :math:`L` at these standard deviations, for training further).
        attention_rule: the moment rule of every attention layer (:func:`set_rules`;
            ``None``: the default, :data:`~lightning_dvi.nn.DEFAULT_ATTENTION_RULE`).
        layer_norm_route: the route of every LayerNorm (:func:`set_rules`; ``None``:
            ``"auto"``, the exact moments). ``attention_rule="mean"`` with
            ``layer_norm_route="first_order"`` is the cheap one-pass predictive measured in
            ``docs/transformer_benchmark.md`` (with ``gelu_rule="closed"``).
        gelu_rule: the moment rule of every exact GELU (:func:`set_rules`; ``None``:
            ``"quadrature"``).
        skip_rule: the skip connections' rule of every transformer block (:func:`set_rules`;
            ``None``: ``"carried"``).
        **layer_kwargs: forwarded to every declared weight layer (``prior_variance``, ...).

    Returns:
        The converted network, on the torch weights' device and dtype.

    Raises:
        ValueError: for a name that is not a parameter, a shape mismatch, a negative or
            non-finite standard deviation, or (``strict``) a missing one.
        NotImplementedError: when a conversion computes weights (not copies), or a layer
            cannot have its scales set.

    Examples:
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> net = from_torch_posterior(model, {n: 0.01 * p.abs() for n, p in model.named_parameters()})
        >>> round(float(net[0].weight_scale[0, 0] / model[0].weight[0, 0].abs()), 6)
        0.01
    """
    options: dict[str, Any] = {
        "last_layers": last_layers,
        "head_covariance": head_covariance,
        **layer_kwargs,
    }
    if last_layers is None:
        del options["head_covariance"]
    net = _convert(module, options)
    spans, found = _sources(module, options)
    flat = _flat_std(module, std, spans)
    layers = dict(_posterior_layers(net))
    if set(layers) != set(found):  # pragma: no cover - conversion is deterministic
        raise RuntimeError("from_torch_posterior: two conversions of the model differ")
    missing: set[str] = set()
    for name, layer in layers.items():
        scales: dict[str, Tensor] = {}
        for group, index in found[name].items():
            value = torch.zeros(index.shape, dtype=torch.float64)
            has_source = index >= 0
            value[has_source] = flat[index[has_source]]
            gap = torch.isnan(value)
            if bool(gap.any()):
                missing.update(_names_of(index[gap], spans))
                value[gap] = 0.0
            scales[group] = value
        _write(layer, scales, name)
    if missing and strict:
        raise ValueError(
            f"no standard deviation given for {sorted(missing)}, which get a posterior "
            "(give them, or strict=False for point values)"
        )
    set_rules(
        net,
        attention_rule=attention_rule,
        layer_norm_route=layer_norm_route,
        gelu_rule=gelu_rule,
        skip_rule=skip_rule,
    )
    return net


def set_rules(
    net: nn.Module,
    *,
    attention_rule: AttentionRule | None = None,
    layer_norm_route: LayerNormRoute | None = None,
    gelu_rule: GeluRule | None = None,
    skip_rule: SkipRule | None = None,
) -> int:
    r"""Set the moment rules of every attention layer, LayerNorm and GELU of a converted network.

    The rules trade accuracy for cost in the one-pass predictive (measured in
    ``docs/transformer_benchmark.md``): ``attention_rule="mean"`` (SUQ's: attention weights
    from the query and key means, the variance carried by the values; about two extra batched
    matrix products over the mean pass) and ``layer_norm_route="first_order"`` (the
    linearization :math:`y \approx \hat m + J(a - \mu)`, :math:`O(D)` per token, no
    quadrature) and ``gelu_rule="closed"`` (GELU's mean and slope in closed form, its variance
    through one 10-node Gauss–Legendre integral, within 1e-7 of the quadrature's oracle:
    :func:`lightning_dvi.moments.smooth.gelu_closed_diag`) and ``skip_rule="independent"``
    (SUQ's: a transformer block's skip connections add the variances of skip and branch,
    without the cross-covariance that ``"carried"`` carries through every branch layer,
    :mod:`lightning_dvi.moments.skip`). ``gelu_rule="slope"`` is cheaper still: GELU's exact
    mean and only the part of its variance linear in the input variance,
    :math:`E[\mathrm{GELU}'(a)]^2v` (:func:`lightning_dvi.moments.smooth.gelu_slope_diag`, a
    lower bound short by :math:`O(v^2)`; SUQ linearises its activations in the same spirit).
    ``None`` leaves a kind as it is.

    Args:
        net: a declared network (e.g. from :func:`from_torch_posterior`), changed in place.
        attention_rule: for every :class:`~lightning_dvi.nn.MultiheadAttention`
            (:data:`lightning_dvi.moments.attention.ATTENTION_RULES`).
        layer_norm_route: for every :class:`~lightning_dvi.nn.LayerNorm`
            (:data:`lightning_dvi.moments.layer_norm.ROUTES`).
        gelu_rule: for every :class:`~lightning_dvi.nn.GELU` with ``approximate="none"``
            (:data:`lightning_dvi.moments.smooth.GELU_RULES`); GELUs in torch's tanh form have
            no closed form and keep the quadrature (they are not counted).
        skip_rule: for every :class:`~lightning_dvi.nn.TransformerEncoderLayer`
            (:data:`lightning_dvi.moments.skip.SKIP_RULES`).

    Returns:
        The number of modules changed.

    Raises:
        ValueError: for an unknown rule or route.

    Examples:
        >>> from lightning_dvi.nn import LayerNorm
        >>> net = nn.Sequential(LayerNorm(4), LayerNorm(4))
        >>> set_rules(net, layer_norm_route="first_order"), net[1].route
        (2, 'first_order')
    """
    from ..moments.attention import ATTENTION_RULES
    from ..moments.layer_norm import ROUTES
    from .activations import GELU, check_gelu_rule
    from .attention import TransformerEncoderLayer
    from .rules import rule_keywords

    if attention_rule is not None and attention_rule not in ATTENTION_RULES:
        raise ValueError(f"attention_rule must be one of {ATTENTION_RULES}, got {attention_rule!r}")
    if layer_norm_route is not None and layer_norm_route not in ROUTES:
        raise ValueError(f"layer_norm_route must be one of {ROUTES}, got {layer_norm_route!r}")
    if gelu_rule is not None:
        check_gelu_rule(gelu_rule)
    if skip_rule is not None:
        check_skip_rule(skip_rule)
    given = {
        "attention_rule": attention_rule,
        "layer_norm_route": layer_norm_route,
        "gelu_rule": gelu_rule,
        "skip_rule": skip_rule,
    }
    # the attributes are lightning_dvi.nn.rules' table, which checkpoints record as well
    targets = [(cls, attr, given[keyword]) for keyword, (cls, attr) in rule_keywords().items()]
    changed = 0
    for module in net.modules():
        if attention_rule is not None and isinstance(module, TransformerEncoderLayer):
            module.options["rule"] = attention_rule  # its description; the layer is a child
        for cls, attr, value in targets:
            if value is None or not isinstance(module, cls):
                continue
            if isinstance(module, GELU) and module.approximate != "none":
                continue  # the tanh form has no closed form: it keeps the quadrature
            setattr(module, attr, value)
            changed += 1
    return changed


def _names_of(index: Tensor, spans: list[tuple[str, int, int]]) -> set[str]:
    return {
        name for name, offset, n in spans if bool(((index >= offset) & (index < offset + n)).any())
    }


def posterior_parameters(
    module: nn.Module, *, last_layers: int | None = None, **layer_kwargs: Any
) -> list[str]:
    """The names of ``module``'s parameters that get a posterior when converted.

    The others (LayerNorm gains, positional tables, a ``last_layers`` backbone) stay point
    values and ignore a standard deviation given to them.

    Examples:
        >>> posterior_parameters(nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4)))
        ['0.weight', '0.bias']
    """
    options: dict[str, Any] = {"last_layers": last_layers, **layer_kwargs}
    spans, found = _sources(module, options)
    used = torch.cat([i.flatten() for groups in found.values() for i in groups.values()])
    names = _names_of(used[used >= 0], spans)
    return [name for name, _, _ in spans if name in names]


# --------------------------------------------------------------------------- sources of stds
def ivon_std(
    optimizer: Any, module: nn.Module, names: Sequence[str] | None = None
) -> dict[str, Tensor]:
    r"""Posterior standard deviations held by an IVON optimiser (``ivon.IVON``, ``ivon-opt``).

    IVON (Shen et al., 2024) keeps, per parameter group, a Hessian estimate :math:`h` (flat,
    ``group["hess"]``), the effective sample size :math:`\lambda` (``ess``) and the weight
    decay :math:`\delta`; its posterior is :math:`\mathcal N(m, \sigma^2)` with the parameters
    :math:`m` as means and

    .. math::
        \sigma = \frac{1}{\sqrt{\lambda\,(h + \delta)}},

    exactly the noise ``IVON.sampled_params()`` adds. ``ivon`` is not imported: this reads
    the optimiser's ``param_groups`` (or its ``state_dict()``).

    Args:
        optimizer: an ``ivon.IVON`` instance, or its ``state_dict()`` (a mapping with
            ``"param_groups"``).
        module: the network the optimiser trains (to name the parameters).
        names: for a ``state_dict``: the names of the parameters in the order given to the
            optimiser (default: ``module.named_parameters()``'s order, the order of
            ``IVON(model.parameters(), ...)``). Ignored for an optimiser instance (its
            parameters are matched to ``module``'s by identity).

    Returns:
        ``{parameter name: std}`` in the parameters' shapes, dtype and device.

    Raises:
        ValueError: when the optimiser's groups do not match ``module``'s parameters.
    """
    params = dict(module.named_parameters())
    live = hasattr(optimizer, "param_groups") and not isinstance(optimizer, Mapping)
    groups = optimizer.param_groups if live else optimizer["param_groups"]
    by_id = {id(p): n for n, p in params.items()}
    order = list(params) if names is None else list(names)
    out: dict[str, Tensor] = {}
    for group in groups:
        if "hess" not in group or "ess" not in group:
            raise ValueError("not an IVON optimiser: its parameter groups have no 'hess'/'ess'")
        hess = torch.as_tensor(group["hess"]).detach().to(torch.float64).flatten()
        sigma = 1.0 / (float(group["ess"]) * (hess + float(group["weight_decay"]))).sqrt()
        offset = 0
        for p in group["params"]:
            if p is None:
                continue
            if live:
                name = by_id.get(id(p))
                if name is None:
                    raise ValueError("the optimiser holds a parameter that is not module's")
            else:
                if not 0 <= int(p) < len(order):
                    raise ValueError(f"parameter index {p} beyond the {len(order)} names")
                name = order[int(p)]
            target = params[name]
            n = target.numel()
            if offset + n > sigma.numel():
                raise ValueError(f"{name}: the optimiser's Hessian is shorter than the parameters")
            out[name] = sigma[offset : offset + n].view(target.shape).to(target)
            offset += n
        if offset != sigma.numel():
            raise ValueError(
                f"the optimiser's Hessian has {sigma.numel()} entries, its parameters {offset}"
            )
    return out


def laplace_std(
    module: nn.Module,
    precision: Tensor | Mapping[str, Tensor] | None = None,
    *,
    variance: Tensor | Mapping[str, Tensor] | None = None,
    prior_precision: float = 0.0,
    names: Sequence[str] | None = None,
) -> dict[str, Tensor]:
    r"""Posterior standard deviations of a diagonal Laplace approximation.

    With the diagonal of the Hessian (or GGN / Fisher) of the negative log-likelihood
    :math:`h` and a prior precision :math:`\tau`, the Laplace posterior is
    :math:`\mathcal N(w_{\text{MAP}}, \operatorname{diag}(h + \tau)^{-1})`:

    .. math::
        \sigma = (h + \tau)^{-1/2}\quad\text{(from precisions)},\qquad
        \sigma = \sqrt{v}\quad\text{(from variances)}.

    laplace-torch's ``DiagLaplace`` gives ``la.posterior_precision`` (which already holds
    :math:`\tau`: keep ``prior_precision=0``) and ``la.posterior_variance``, flat over the
    parameters it covers.

    Args:
        module: the network.
        precision: :math:`h` (plus whatever prior precision it already holds): a flat vector
            over ``names`` (concatenated, flattened row-major) or ``{name: tensor}``.
        variance: posterior variances :math:`v` instead of ``precision`` (same layouts).
        prior_precision: :math:`\tau` added to ``precision`` (not with ``variance``).
        names: the parameters a flat vector covers, in order (default: every parameter with
            ``requires_grad``, in ``module.named_parameters()`` order; laplace-torch's
            ``subset_of_weights="last_layer"`` covers the last ``nn.Linear``'s
            ``["<name>.weight", "<name>.bias"]``).

    Returns:
        ``{parameter name: std}`` for the covered parameters.

    Raises:
        ValueError: without exactly one of ``precision``/``variance``, on a length mismatch,
            or a non-positive precision / negative variance.

    Examples:
        >>> model = nn.Linear(2, 1)
        >>> std = laplace_std(model, torch.tensor([3.0, 8.0, 0.0]), prior_precision=1.0)
        >>> [round(float(v), 4) for v in std["weight"].flatten()], round(float(std["bias"]), 4)
        ([0.5, 0.3333], 1.0)
    """
    if (precision is None) == (variance is None):
        raise ValueError("give exactly one of precision and variance")
    if variance is not None and prior_precision != 0.0:
        raise ValueError("prior_precision adds to precisions, not to variances")
    given = precision if precision is not None else variance
    assert given is not None
    params = dict(module.named_parameters())
    values = _per_parameter(given, params, names)
    out: dict[str, Tensor] = {}
    for name, value in values.items():
        value = value.detach().to(torch.float64)
        if precision is not None:
            value = value + prior_precision
            if not bool((value > 0).all()):
                raise ValueError(f"{name}: precisions (plus prior_precision) must be positive")
            std = value.rsqrt()
        else:
            if not bool((value >= 0).all()):
                raise ValueError(f"{name}: variances must be >= 0")
            std = value.sqrt()
        out[name] = std.to(params[name])
    return out


def _per_parameter(
    given: Tensor | Mapping[str, Tensor],
    params: Mapping[str, nn.Parameter],
    names: Sequence[str] | None,
) -> dict[str, Tensor]:
    if isinstance(given, Mapping):
        return {n: torch.as_tensor(v).reshape(params[n].shape) for n, v in given.items()}
    order = [n for n, p in params.items() if p.requires_grad] if names is None else list(names)
    sizes = [params[n].numel() for n in order]
    flat = torch.as_tensor(given).flatten()
    if flat.numel() != sum(sizes):
        raise ValueError(
            f"a flat vector of {flat.numel()} values for parameters of {sum(sizes)} elements"
        )
    return {n: v.view(params[n].shape) for n, v in zip(order, flat.split(sizes), strict=True)}


def prior_std(
    module: nn.Module, std: float | None = None, *, variance: float | None = None
) -> dict[str, Tensor]:
    r"""One standard deviation for every parameter: :math:`\sigma = s` or :math:`\sigma = \sqrt{s^2}`.

    The posterior set from a prior :math:`\mathcal N(0, s^2)` of the weights' scale (then
    calibrated by :func:`calibrate_scales`). A float passed as ``std`` to
    :func:`from_torch_posterior` does the same.

    Examples:
        >>> prior_std(nn.Linear(2, 1).double(), variance=0.04)["bias"].tolist()
        [0.2]
    """
    if (std is None) == (variance is None):
        raise ValueError("give exactly one of std and variance")
    value = math.sqrt(variance) if variance is not None else float(std)  # type: ignore[arg-type]  # std is set when variance is not
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"a standard deviation must be finite and >= 0, got {value}")
    return {n: torch.full_like(p.detach(), value) for n, p in module.named_parameters()}


# --------------------------------------------------------------------------- calibration
def _scaled_raws(net: nn.Module) -> tuple[list[str], Callable[[Tensor], dict[str, Tensor]]]:
    """Layer names, and ``factors [L] -> {raw parameter name: raw value}`` with stds x factor."""
    entries: list[tuple[int, str, Callable[[Tensor], Tensor]]] = []
    layer_names: list[str] = []
    for i, (name, layer) in enumerate(_posterior_layers(net)):
        layer_names.append(name)
        prefix = f"{name}." if name else ""
        transform = str(getattr(layer, "scale_transform", "softplus"))
        if hasattr(layer, "weight_raw_scale"):
            for group in ("weight", "bias"):
                raw = getattr(layer, f"{group}_raw_scale", None)
                if raw is not None:
                    base = _positive(raw.detach(), transform)
                    entries.append((i, f"{prefix}{group}_raw_scale", _raw_of(base, transform)))
        elif hasattr(layer, "raw_diag") and hasattr(layer, "tril"):
            base = _positive(cast(Tensor, layer.raw_diag).detach(), transform)
            entries.append((i, f"{prefix}raw_diag", _raw_of(base, transform)))
            entries.append((i, f"{prefix}tril", _times(cast(Tensor, layer.tril).detach())))
        else:
            raise NotImplementedError(
                f"calibrate_scales: {name} ({type(layer).__name__}) has no known scale parameters"
            )

    def raws(factors: Tensor) -> dict[str, Tensor]:
        return {key: fn(factors[i]) for i, key, fn in entries}

    return layer_names, raws


def _positive(raw: Tensor, transform: str) -> Tensor:
    return torch.nn.functional.softplus(raw) if transform == "softplus" else raw.exp()


def _times(tril: Tensor) -> Callable[[Tensor], Tensor]:
    """``f -> f L``: a full-covariance layer's strict lower factor scales with its stds."""
    return lambda f: f.to(tril) * tril


def _raw_of(base: Tensor, transform: str) -> Callable[[Tensor], Tensor]:
    """``f -> raw(f * base)`` with finite gradients where ``base`` is 0 (raw stays -inf there)."""
    zero = base == 0
    safe = torch.where(zero, torch.ones_like(base), base)
    minus_inf = torch.full_like(base, -math.inf)

    def raw(f: Tensor) -> Tensor:
        s = f.to(base) * safe
        value = s.log() if transform == "exp" else s + torch.log(-torch.expm1(-s))
        return torch.where(zero, minus_inf, value)

    return raw


def _flat_out(out: Gaussian) -> Gaussian:
    """Sequence outputs ``[B, T, D]`` as ``[B*T, D]`` (one datum per token)."""
    if out.mean.dim() == 2:
        return out
    d = out.mean.shape[-1]
    if out.cov is not None:
        return Gaussian(out.mean.reshape(-1, d), cov=out.cov.reshape(-1, d, d))
    return Gaussian(out.mean.reshape(-1, d), var=out.var.reshape(-1, d))


def _batches(n: int, batch_size: int | None) -> list[slice]:
    step = n if batch_size is None else max(int(batch_size), 1)
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def predictive_nll(
    net: nn.Module,
    likelihood: Likelihood,
    x: Tensor,
    y: Tensor,
    mode: Literal["diag", "full"] = "diag",
    *,
    batch_size: int | None = None,
) -> float:
    r"""Mean negative log predictive density of the one-pass predictive, :math:`-\frac1N\sum_n \log p(y_n\mid x_n)`.

    :math:`p(y\mid x)` is ``likelihood.predictive(net(x, mode))`` (the closed-form predictive
    that :func:`~lightning_dvi.nn.export_predictive` exports), in the units of ``y``; class
    probabilities are floored at 1e-12, as ``lightning_dvi.metrics`` floors them. A sequence
    output ``[B, T, D]`` counts each token as one datum (``y [B, T]``).
    """
    with torch.no_grad():
        total = sum(
            _nll_sum(net, likelihood, x[s], y[s], mode) for s in _batches(len(x), batch_size)
        )
    return float(total) / y.numel()


def _nll_sum(net: nn.Module, likelihood: Likelihood, x: Tensor, y: Tensor, mode: str) -> Tensor:
    return _nll_of(likelihood.predictive(_flat_out(net(x, mode=mode))), y.reshape(-1)).sum()


_PROB_FLOOR = 1e-12  # as lightning_dvi.metrics' categorical NLL


def _nll_of(predictive: torch.distributions.Distribution, y: Tensor) -> Tensor:
    r"""Per-datum :math:`-\log p(y)`; class probabilities floored at 1e-12 (as the metrics).

    ``torch.distributions.Categorical(probs=...).log_prob`` floors them at the dtype's
    epsilon (1.2e-7 in float32, 15.9 nats), which caps over-confident mistakes and would
    change the calibrated factor.
    """
    if isinstance(predictive, torch.distributions.Categorical):
        picked = predictive.probs.gather(-1, y.long().unsqueeze(-1)).squeeze(-1)
        return -picked.clamp_min(_PROB_FLOOR).log()
    if isinstance(predictive, torch.distributions.Bernoulli):  # labels may be integers
        p = predictive.probs
        return -torch.where(y.to(torch.bool), p, 1.0 - p).clamp_min(_PROB_FLOOR).log()
    return -predictive.log_prob(y)


@dataclass(frozen=True)
class Calibration:
    """What :func:`calibrate_scales` found.

    Attributes:
        factors: the multiplicative factor on the posterior standard deviations, per posterior
            layer (by module name; ``per="network"``: the same for every layer).
        factor: the network-wide factor (the per-layer search starts from it).
        nll_before: validation NLL at factor 1.
        nll_after: validation NLL at the factors found (now written into the network).
        evaluations: predictive passes over the validation set.
    """

    factors: dict[str, float]
    factor: float
    nll_before: float
    nll_after: float
    evaluations: int = field(default=0)


def calibrate_scales(
    net: nn.Module,
    likelihood: Likelihood,
    x: Tensor,
    y: Tensor,
    *,
    per: Literal["network", "layer"] = "network",
    mode: Literal["diag", "full"] = "diag",
    bounds: tuple[float, float] = (1e-3, 1e3),
    grid: int = 13,
    tol: float = 1e-2,
    batch_size: int | None = None,
    max_iter: int = 50,
) -> Calibration:
    r"""Fit a multiplicative factor on the posterior standard deviations on validation NLL; write it.

    The posterior :math:`\mathcal N(\mu, \sigma^2)` becomes :math:`\mathcal N(\mu, (c\,\sigma)^2)`
    with :math:`c` minimising the closed-form predictive's validation NLL
    (:func:`predictive_nll`),

    .. math::
        c^\star = \arg\min_{c \in [c_-, c_+]} -\frac1N \sum_n \log p_c(y_n \mid x_n),

    one :math:`c` per network (``per="network"``: a grid of ``grid`` points on
    :math:`\log c` over ``bounds``, then golden-section search in the bracket of the best
    point to ``tol`` in :math:`\log c`) or one per posterior layer (``per="layer"``: L-BFGS on the vector of
    :math:`\log c_l`, started from the network's :math:`c^\star`, kept only if it lowers the
    NLL). The means are not touched. Classification and regression: any likelihood with a
    ``predictive`` (for :class:`~lightning_dvi.likelihoods.HomoscedasticGaussian`, set its
    noise first, e.g. from the validation residuals).

    Args:
        net: a declared network (e.g. from :func:`from_torch_posterior`); modified in place.
        likelihood: the observation model (its predictive scores the factors).
        x: validation inputs.
        y: validation targets (class indices or values).
        per: ``"network"`` or ``"layer"``.
        mode: the moment mode of the predictive (``"diag"`` or ``"full"``).
        bounds: the search interval :math:`[c_-, c_+]` of every factor.
        grid: points of the log-spaced grid (at least 3).
        tol: the golden-section tolerance on :math:`\log c` (``1e-2``: 1 % in :math:`c`).
        batch_size: validation examples per pass (``None``: all at once).
        max_iter: L-BFGS iterations (``per="layer"``).

    Returns:
        The :class:`Calibration` (factors and NLL before and after).

    Raises:
        ValueError: on a bad ``per``, ``mode`` or ``bounds``.
        NotImplementedError: for a posterior layer whose scale parameters are unknown.
    """
    if per not in ("network", "layer"):
        raise ValueError(f"per must be 'network' or 'layer', got {per!r}")
    moment_propagation(mode)
    lo, hi = (float(b) for b in bounds)
    if not (0 < lo < 1 < hi < math.inf):
        raise ValueError(f"bounds must satisfy 0 < low < 1 < high, got {bounds}")
    if grid < 3 or not tol > 0:
        raise ValueError(f"grid must be >= 3 and tol > 0, got {grid} and {tol}")
    names, raws = _scaled_raws(net)
    if not names:
        raise ValueError("calibrate_scales: the network has no posterior layer")
    dtype = next(net.parameters()).dtype
    evaluations = 0
    slices = _batches(len(x), batch_size)

    def nll(log_factors: Tensor, grad: bool = False) -> Tensor:
        nonlocal evaluations
        evaluations += 1
        total = torch.zeros((), dtype=torch.float64)
        for s in slices:
            with torch.set_grad_enabled(grad):
                replaced = raws(log_factors.exp())
                part = torch.func.functional_call(
                    net, replaced, (x[s],), {"mode": mode}, strict=False
                )
                value = _nll_of(likelihood.predictive(_flat_out(part)), y[s].reshape(-1)).sum()
                if grad:
                    (value / y.numel()).backward()
            total = total + value.detach().to(torch.float64)
        return total / y.numel()

    def network(t: float) -> float:
        try:
            return float(nll(torch.full((len(names),), t, dtype=dtype)))
        except NonFiniteMomentsError:  # the moments overflow at this factor: worst possible
            return math.inf

    before = network(0.0)
    t_best, f_best = _search(network, math.log(lo), math.log(hi), grid, tol)
    factors = torch.full((len(names),), t_best, dtype=dtype)
    after = f_best
    if per == "layer":
        u = factors.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([u], max_iter=max_iter, line_search_fn="strong_wolfe")
        t_lo, t_hi = math.log(lo), math.log(hi)

        def closure() -> Tensor:
            opt.zero_grad()
            return nll(u.clamp(t_lo, t_hi), grad=True)

        try:
            opt.step(closure)
            candidate = u.detach().clamp(t_lo, t_hi)
            value = float(nll(candidate)) if bool(torch.isfinite(candidate).all()) else math.inf
        except NonFiniteMomentsError:  # a step overflowed the moments: keep the grid's factor
            candidate, value = factors, math.inf
        if value < after:
            factors, after = candidate, value
    if after > before:  # the grid misses factor 1 exactly; never make it worse
        factors, after = torch.zeros_like(factors), before
    with torch.no_grad():
        params = dict(net.named_parameters())
        for key, raw in raws(factors.exp()).items():
            params[key].copy_(raw)
    result = {n: float(f) for n, f in zip(names, factors.exp(), strict=True)}
    return Calibration(result, math.exp(t_best), before, after, evaluations)


_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def _search(
    f: Callable[[float], float], a: float, b: float, points: int, tol: float
) -> tuple[float, float]:
    """Minimise ``f`` on ``[a, b]``: a grid of ``points``, then golden section around its best."""
    grid = [a + (b - a) * i / (points - 1) for i in range(points)]
    values = [f(t) for t in grid]
    finite = [(v, i) for i, v in enumerate(values) if math.isfinite(v)]
    if not finite:
        raise ValueError("calibrate_scales: the validation NLL is not finite at any factor")
    best_value, i = min(finite)
    lo, hi = grid[max(i - 1, 0)], grid[min(i + 1, points - 1)]
    best = (grid[i], best_value)
    c, d = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
    fc, fd = f(c), f(d)
    while hi - lo > tol:
        if fc < fd:
            hi, d, fd = d, c, fc
            c = hi - _GOLDEN * (hi - lo)
            fc = f(c)
        else:
            lo, c, fc = c, d, fd
            d = lo + _GOLDEN * (hi - lo)
            fd = f(d)
    for t, v in ((c, fc), (d, fd)):
        if v < best[1]:
            best = (t, v)
    return best


@torch.no_grad()
def scale_posterior(net: nn.Module, factor: float | Mapping[str, float]) -> None:
    r"""Multiply the posterior standard deviations in place: :math:`\sigma \leftarrow c\,\sigma`.

    Args:
        net: a declared network.
        factor: one :math:`c > 0` for every posterior layer, or ``{layer name: c}`` (the
            :attr:`Calibration.factors` layout; layers not named keep their scales).
    """
    names, raws = _scaled_raws(net)
    given = {n: float(factor) for n in names} if not isinstance(factor, Mapping) else factor
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise ValueError(f"no posterior layer named {unknown}; the layers are {names}")
    values = torch.tensor([given.get(n, 1.0) for n in names], dtype=torch.float64)
    if not bool(((values > 0) & torch.isfinite(values)).all()):
        raise ValueError("scale factors must be finite and positive")
    params = dict(net.named_parameters())
    for key, value in raws(values).items():
        params[key].copy_(value)


# --------------------------------------------------------------------------- Monte Carlo
@torch.no_grad()
def monte_carlo_predictive(
    net: nn.Module,
    likelihood: Likelihood,
    x: Tensor,
    num_samples: int,
    *,
    batch_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""The Monte Carlo predictive of the same posterior: ``S`` whole-weight draws (``mode="sample"``).

    Classification: :math:`\frac1S\sum_s \operatorname{softmax}(f_s)` (``likelihood.class_probs``),
    ``[B, K]``. Regression: the mixture's mean and variance,
    :math:`\bar m = \frac1S\sum_s m_s` and :math:`\frac1S\sum_s (v_s + m_s^2) - \bar m^2`, ``[B]``
    each. A sequence output keeps its token dimension.
    """
    parts = [_mc_part(net, likelihood, x[s], num_samples) for s in _batches(len(x), batch_size)]
    if isinstance(parts[0], Tensor):
        return torch.cat([p for p in parts if isinstance(p, Tensor)])
    means, variances = zip(*parts, strict=True)
    return torch.cat(means), torch.cat(variances)


def _mc_part(
    net: nn.Module, likelihood: Likelihood, x: Tensor, num_samples: int
) -> Tensor | tuple[Tensor, Tensor]:
    f = net(x, mode="sample", num_samples=num_samples)
    try:
        return likelihood.class_probs(f).mean(0)
    except NotImplementedError:
        pass
    conditional = likelihood.conditional(f)
    m = conditional.mean
    v = likelihood.sampled_variance(f, conditional)
    mean = m.mean(0)
    return mean, (v + m * m).mean(0) - mean * mean


@torch.no_grad()
def monte_carlo_nll(
    net: nn.Module,
    likelihood: Likelihood,
    x: Tensor,
    y: Tensor,
    num_samples: int,
    *,
    batch_size: int | None = None,
) -> float:
    r"""Mean NLL of the Monte Carlo predictive, :math:`-\frac1N\sum_n\log\frac1S\sum_s p(y_n\mid f_s(x_n))`.

    The mixture's own density (``likelihood.mixture_log_prob``; classification: the averaged
    class probabilities, floored at 1e-12 as :func:`predictive_nll` floors them),
    ``S = num_samples`` whole-weight draws shared by the examples of a batch.
    """
    total = 0.0
    for s in _batches(len(x), batch_size):
        f = net(x[s], mode="sample", num_samples=num_samples)
        f = f.reshape(f.shape[0], -1, f.shape[-1])
        target = y[s].reshape(-1)
        try:
            probs = likelihood.class_probs(f).mean(0)
        except NotImplementedError:
            total += float(-likelihood.mixture_log_prob(f, target).sum())
            continue
        total += float(_nll_of(torch.distributions.Categorical(probs=probs), target).sum())
    return total / y.numel()

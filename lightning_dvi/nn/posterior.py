r"""What holds a weight posterior, found by protocol; and the explicit context of a pass.

**The protocol.** A layer *has a posterior* when it implements :class:`HasPosterior`: one
method, :meth:`~HasPosterior.parameter_groups`, listing its blocks of weights that share a prior
variance (a weight matrix, a bias vector), each with its posterior means ``loc``, standard
deviations ``scale`` and persistent prior-variance buffer. Everything that needs the posterior
finds layers by this protocol, never by a list of types: the KL term and both empirical-Bayes
modes (:func:`lightning_dvi.nn.parameter_groups`), :func:`lightning_dvi.nn.bayes_layers`, the
Pyro pass (:class:`lightning_dvi.pyro.PyroBayesNet` makes one sample site per group), export
and conversion. A user's own weight layer that implements it gets all of them with no edit to
the library.

**The context.** A pass through declared layers may run inside a :class:`PosteriorContext`, an
explicit object pushed on a stack for the duration of a ``with`` block, as Pyro's messengers
are. It carries two things a layer consults, both optional:

* ``weights``: per layer, substituted moments (or values) of its groups, which a front-end that
  holds the posterior elsewhere hands to the declared network (:func:`given_weights`, used by
  the Pyro pass);
* ``scales``: a cache of ``softplus(raw_scale)`` per raw parameter (and of each group's
  variance ``scale**2``), so the network pass and the prior's KL of one ELBO step compute each
  once (:func:`shared_scales`); given the network, the block computes every layer's softplus
  scales and variances up front in one :class:`SoftplusScales` node with a closed-form
  backward.

Layers read them with :func:`posterior_moments` and :func:`cached_scale`. Nothing is stored
per thread or per layer; leaving the block pops the context and drops its cache, so no graph
outlives a step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Protocol, cast, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ..moments import policy

__all__ = [
    "GroupMoments",
    "HasPosterior",
    "ParameterGroup",
    "PosteriorContext",
    "SoftplusScales",
    "WeightMoments",
    "cached_scale",
    "frozen_moments",
    "given_weights",
    "has_posterior",
    "posterior_moments",
    "set_posterior",
    "shared_scales",
]


@dataclass(frozen=True)
class ParameterGroup:
    r"""One block of weights sharing a prior variance (a weight matrix or a bias vector).

    Attributes:
        name: the group's name within its layer (``"weight"``, ``"bias"``); also the last part
            of its Pyro site name.
        loc: posterior means (differentiable).
        scale: posterior standard deviations (differentiable, positive).
        prior_variance: the layer's persistent prior-variance buffer for this group (0-dim).
        module: the owning layer.
        correlation_kl: for a posterior whose weights are correlated (not factorised), the
            part of its KL that the factorised KL of the marginals (``loc``, ``scale``) misses,
            :math:`\tfrac12(\sum_i\log\Sigma_{ii} - \log\det\Sigma) \ge 0` (0-dim; it does
            not depend on the prior, which is factorised). ``None`` for a factorised group. A
            layer whose correlations span several groups puts it on one of them.
    """

    name: str
    loc: Tensor
    scale: Tensor
    prior_variance: Tensor
    module: nn.Module
    correlation_kl: Tensor | None = None


@runtime_checkable
class HasPosterior(Protocol):
    r"""A layer with a factorised Gaussian posterior :math:`q(w) = \prod_i \mathcal N(\mu_i, \sigma_i^2)`.

    The KL term :math:`\sum_g \mathrm{KL}(q_g \,\|\, \mathcal N(0, s_g))`, the empirical-Bayes
    optimum of each :math:`s_g` (from the group's :math:`\mu, \sigma`) and its persistent buffer,
    the Pyro sample sites (one per group, shaped like ``loc``) and the posterior scales all come
    from :meth:`parameter_groups`. A layer that also wants the Pyro pass reads its weight moments
    through :func:`posterior_moments`, which honours substitutions.
    """

    def parameter_groups(self) -> list[ParameterGroup]:
        """The layer's prior groups, in a fixed order (weight before bias)."""
        ...


def has_posterior(module: object) -> bool:
    """Whether ``module`` holds a weight posterior (implements :class:`HasPosterior`).

    The protocol's one member checked directly: ``isinstance(module, HasPosterior)`` on a
    ``runtime_checkable`` protocol walks the protocol's attributes through :mod:`typing` on
    every call (tens of microseconds per network walk, twice per ELBO evaluation), for the same
    answer (a ``parameter_groups`` attribute that is not ``None``).
    """
    return isinstance(module, nn.Module) and getattr(module, "parameter_groups", None) is not None


GroupMoments = Mapping[str, tuple[Tensor, Tensor | None]]
"""Per group name, ``(loc, var)`` moments, or ``(value, None)`` when the weights are values."""

WeightMoments = tuple[Tensor, Tensor | None, Tensor | None, Tensor | None]
"""``(w_loc, w_var, b_loc, b_var)``; ``w_var`` is ``None`` when the weights are values, not moments."""


def _as_groups(given: WeightMoments | GroupMoments) -> GroupMoments:
    if isinstance(given, Mapping):
        return given
    w_loc, w_var, b_loc, b_var = given
    groups: dict[str, tuple[Tensor, Tensor | None]] = {"weight": (w_loc, w_var)}
    if b_loc is not None:
        groups["bias"] = (b_loc, b_var)
    return groups


_STACK: list[PosteriorContext] = []
# The active contexts, innermost last (one stack for the process, as Pyro's _PYRO_STACK).


class PosteriorContext:
    """An explicit context for passes through declared layers; see the module docstring.

    Args:
        weights: per layer, its groups' substituted moments (``{"weight": (loc, var), ...}``)
            or the ``(w_loc, w_var, b_loc, b_var)`` tuple of a weight-and-bias layer; a ``None``
            variance means the ``loc`` entries are weight *values*.
        share_scales: cache each layer's posterior scales for the duration of the block.

    Contexts nest: a layer's substitution is looked up innermost first, and the outermost
    scale cache serves nested blocks.
    """

    def __init__(
        self,
        weights: Mapping[nn.Module, WeightMoments | GroupMoments] | None = None,
        share_scales: bool = False,
    ) -> None:
        self.weights: dict[nn.Module, GroupMoments] = {
            layer: _as_groups(given) for layer, given in (weights or {}).items()
        }
        self.scales: dict[tuple[int, int, bool, str], Tensor] | None = {} if share_scales else None
        # id(scale) -> (scale, scale**2): the variance of a cached scale, computed once
        self.variances: dict[int, tuple[Tensor, Tensor]] = {}

    def __enter__(self) -> PosteriorContext:
        _STACK.append(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not _STACK or _STACK[-1] is not self:  # pragma: no cover - misuse of the protocol
            raise RuntimeError("PosteriorContext exited out of order")
        _STACK.pop()
        self.scales = None
        self.variances = {}


def _active() -> Iterator[PosteriorContext]:
    """The open blocks, innermost first, as far as their scale caches go.

    None while a graph is traced: the compiler deduplicates the scale ops itself, and a cache
    of eager tensors must not leak into a graph. Substitutions are read by
    :func:`substituted`.
    """
    if policy.tracing():
        return iter(())
    return reversed(_STACK)


def given_weights(weights: Mapping[nn.Module, WeightMoments | GroupMoments]) -> PosteriorContext:
    """Within the block, the listed layers use these weights instead of their own posterior.

    How a front-end that holds the posterior elsewhere (the Pyro guide) runs a declared network
    through the modules' own ``propagate``: ``(w_loc, w_var, b_loc, b_var)`` (or
    ``{group name: (loc, var)}``) are weight moments; with ``w_var = None``, ``w_loc``/``b_loc``
    are weight *values* (``[..., out, in]``, e.g. a batch of Pyro samples) and the layer is the
    plain affine map. Nests.
    """
    return PosteriorContext(weights=weights)


def frozen_moments(net: nn.Module) -> PosteriorContext:
    r"""A reusable block in which every layer of ``net`` uses its weight moments as of now.

    Computes :math:`(\mu, \sigma^2)` of every group of every layer with a posterior once
    (:func:`posterior_moments`, detached, no graph) and hands them to the layers as a
    substitution (:func:`given_weights`) whenever the returned context is entered, so repeated
    predictions of a fixed posterior skip the ``softplus`` and square of every scale on every
    pass (a trained torch network holds its weights ready in the same way). The values are a
    snapshot: a later change of ``net``'s parameters (training, a calibration) is not seen;
    take a new one.

    Examples:
        >>> from lightning_dvi.nn import BayesLinear, ReLU, Sequential
        >>> net = Sequential(BayesLinear(3, 4), ReLU(), BayesLinear(4, 2))
        >>> frozen = frozen_moments(net)
        >>> x = torch.randn(5, 3)
        >>> with frozen:
        ...     out = net(x, mode="diag")
        >>> bool(torch.allclose(out.var, net(x, mode="diag").var))
        True
    """
    with torch.no_grad():
        weights: dict[nn.Module, GroupMoments] = {}
        for layer in net.modules():
            if has_posterior(layer):
                groups = posterior_moments(cast(HasPosterior, layer))
                weights[layer] = {
                    name: (loc.detach(), None if var is None else var.detach())
                    for name, (loc, var) in groups.items()
                }
    return PosteriorContext(weights=weights)


def shared_scales(net: nn.Module | None = None) -> PosteriorContext:
    """Within the block, each layer computes its posterior scales once and reuses them.

    :func:`lightning_dvi.objective.elbo` opens it around the network pass and the prior's KL,
    which both need ``softplus(raw_scale)`` of every layer: one ``softplus`` (and one
    ``softplus_backward``) per tensor instead of two. A cached scale is reused only while its
    raw parameter is unmodified (same version counter) and the grad mode is the same; the cache
    is dropped when the block exits, so no graph outlives the step. Nested blocks share the
    outer cache. Not used while ``torch.compile`` traces (the compiler deduplicates the ops
    itself).

    Args:
        net: if given, the block computes the softplus scales and variances of all of its
            layers that declare them (:meth:`raw_scales`, e.g.
            :class:`~lightning_dvi.nn.BayesLinear`) up front, in one :class:`SoftplusScales`
            node: one ``softplus`` per tensor, one batched square, and a backward of a few
            batched ops for all of them, instead of autograd's per-tensor nodes.
    """
    nested = any(ctx.scales is not None for ctx in _active())
    ctx = PosteriorContext(share_scales=not nested and not policy.tracing())
    if net is not None and ctx.scales is not None:
        _prefill(ctx, net)
    return ctx


class SoftplusScales(torch.autograd.Function):
    r"""``softplus`` of several raw tensors and the squares of the results, in one node.

    Forward: :math:`s_i = \log(1 + e^{r_i})` (``F.softplus``, the same values as each layer's
    own transform) and :math:`v_i = s_i^2` (one batched ``_foreach_mul``). Backward, with
    :math:`\partial s/\partial r = \operatorname{sigmoid}(r)`:

    .. math::
        \bar r_i = (\bar s_i + 2 s_i \bar v_i)\,\operatorname{sigmoid}(r_i),

    two batched ``_foreach`` ops for all tensors when every output got a gradient (the
    training step; :math:`\operatorname{sigmoid}(r_i)` and :math:`s_i\operatorname{sigmoid}(r_i)`
    are kept from the forward), a per-tensor loop otherwise.
    The slope is :math:`\operatorname{sigmoid}(r)` everywhere, also past ``F.softplus``'s
    linear threshold (:math:`r > 20`, where autograd's slope of the returned :math:`r` is 1):
    a relative difference below :math:`2\cdot 10^{-9}` there, at posterior scales above 20. Inputs: the ``k`` raw tensors; outputs: the
    ``k`` scales, then the ``k`` variances.
    """

    @staticmethod
    def forward(ctx: Any, *raws: Tensor) -> tuple[Tensor, ...]:
        """The ``k`` scales ``softplus(r_i)``, then their ``k`` squares."""
        ctx.set_materialize_grads(False)
        scales = [F.softplus(r) for r in raws]
        variances = torch._foreach_mul(scales, scales)
        # sigmoid(r) and 2 s sigmoid(r), not the raw inputs: saved inputs cost a detach each
        slopes = torch._foreach_sigmoid(list(raws))
        ctx.save_for_backward(*slopes, *torch._foreach_mul(scales, slopes))
        return (*scales, *variances)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        """``(g_s + 2 s g_v) sigmoid(r)`` per raw tensor (``None`` where neither output is used)."""
        saved = ctx.saved_tensors
        k = len(saved) // 2
        slopes, half_dv = list(saved[:k]), list(saved[k:])  # sigmoid(r), s sigmoid(r)
        g_s, g_v = list(grads[:k]), list(grads[k:])
        if all(g is not None for g in grads):
            out = torch._foreach_mul(cast(list[Tensor], g_s), slopes)
            torch._foreach_addcmul_(out, cast(list[Tensor], g_v), half_dv, value=2)
            return tuple(out)
        result: list[Tensor | None] = []
        for slope, q, gsi, gvi in zip(slopes, half_dv, g_s, g_v, strict=True):
            if gvi is None:
                result.append(None if gsi is None else gsi * slope)
            else:
                result.append(
                    torch.mul(gvi, q).mul_(2)
                    if gsi is None
                    else torch.addcmul(gsi * slope, gvi, q, value=2)
                )
        return tuple(result)


def _prefill(ctx: PosteriorContext, net: nn.Module) -> None:
    """Put every softplus scale of ``net`` (and its square) into ``ctx``'s caches at once."""
    assert ctx.scales is not None
    entries: list[tuple[nn.Module, str, Tensor]] = []
    for layer in net.modules():
        raw_scales = getattr(layer, "raw_scales", None)
        if raw_scales is None:
            continue
        entries.extend((layer, which, raw) for which, raw in raw_scales())
    if not entries:
        return
    grad = torch.is_grad_enabled()
    raws = [raw for _, _, raw in entries]
    if grad and any(r.requires_grad for r in raws):
        out = SoftplusScales.apply(*raws)
    else:
        scales = [F.softplus(r) for r in raws]
        out = (*scales, *torch._foreach_mul(scales, scales))
    k = len(entries)
    for (layer, which, raw), scale, var in zip(entries, out[:k], out[k:], strict=True):
        ctx.scales[(id(layer), raw._version, grad, which)] = scale
        ctx.variances[id(scale)] = (scale, var)


def cached_scale(
    layer: nn.Module, raw: Tensor, which: str, positive: Callable[[Tensor], Tensor]
) -> Tensor:
    """``positive(raw)``, computed once per active :func:`shared_scales` block.

    Args:
        layer: the owning layer (part of the cache key).
        raw: the unconstrained parameter (its version counter is part of the key, so an
            in-place update invalidates the entry).
        which: the group's name.
        positive: the transform to a positive scale (``softplus`` or ``exp``).
    """
    cache = next((ctx.scales for ctx in _active() if ctx.scales is not None), None)
    if cache is None:
        return positive(raw)
    key = (id(layer), raw._version, torch.is_grad_enabled(), which)
    scale = cache.get(key)
    if scale is None:
        scale = cache[key] = positive(raw)
    return scale


def substituted(layer: nn.Module) -> GroupMoments | None:
    """The innermost active substitution of ``layer``'s weights, or ``None``.

    Read while a whole step is recorded too (:class:`~lightning_dvi.pyro.
    CompiledDeterministicELBO` records a :class:`~lightning_dvi.pyro.PyroBayesNet`, whose
    weights are the guide's moments: without them the recording would take the network's own
    posterior). Not under ``torch.compile``'s Dynamo, which never runs inside one.
    """
    if torch.compiler.is_compiling():
        return None
    for ctx in reversed(_STACK):
        given = ctx.weights.get(layer)
        if given is not None:
            return given
    return None


def posterior_moments(layer: HasPosterior) -> GroupMoments:
    r"""``{group name: (loc, var)}`` of ``layer``'s weights, as the current pass should see them.

    The posterior's own :math:`(\mu, \sigma^2)` from :meth:`HasPosterior.parameter_groups`,
    unless a front-end substituted the layer's weights (:func:`given_weights`): then those
    moments, or ``(value, None)`` for weight values.
    """
    given = substituted(layer) if isinstance(layer, nn.Module) else None
    if given is not None:
        return given
    return {g.name: (g.loc, _variance(g.scale)) for g in layer.parameter_groups()}


def _variance(scale: Tensor) -> Tensor:
    """``scale * scale``, computed once per scale tensor within a :func:`shared_scales` block."""
    ctx = next((c for c in _active() if c.scales is not None), None)
    if ctx is None:
        return scale * scale
    hit = ctx.variances.get(id(scale))
    if hit is not None and hit[0] is scale:
        return hit[1]
    var = scale * scale
    ctx.variances[id(scale)] = (scale, var)
    return var


def _scale_from_raw(raw: Tensor, transform: str) -> Tensor:
    """A layer's positive transform of its unconstrained scale parameter (``softplus``/``exp``)."""
    return F.softplus(raw) if transform == "softplus" else raw.exp()


def _raw_from_scale(scale: Tensor, transform: str) -> Tensor:
    """Inverse of the layer's positive transform; a zero scale maps to ``-inf`` exactly."""
    if transform == "exp":
        return scale.log()
    # softplus^{-1}(s) = s + log(-expm1(-s)); equals log(0) = -inf at s = 0
    return scale + torch.log(-torch.expm1(-scale))


@torch.no_grad()
def set_posterior(
    layer: nn.Module,
    weight_loc: Tensor,
    weight_scale: Tensor,
    bias_loc: Tensor | None = None,
    bias_scale: Tensor | None = None,
) -> None:
    """Write posterior means and standard deviations into a Bayesian layer in place.

    Works for any layer with ``weight_loc``, ``weight_raw_scale`` (and ``bias_loc``,
    ``bias_raw_scale``) parameters and a ``scale_transform`` attribute, such as
    :class:`BayesLinear`. Scales must be non-negative; zero is represented exactly.

    Raises:
        ValueError: on shape mismatches or negative / non-finite values.
    """
    pairs: list[tuple[str, Tensor | None, Tensor | None]] = [("weight", weight_loc, weight_scale)]
    if bias_loc is not None or bias_scale is not None:
        if getattr(layer, "bias_loc", None) is None:
            raise ValueError(f"{type(layer).__name__} has no bias to set")
        pairs.append(("bias", bias_loc, bias_scale))
    for name, loc, scale in pairs:
        param_loc = getattr(layer, f"{name}_loc")
        param_raw = getattr(layer, f"{name}_raw_scale")
        if loc is None or scale is None:
            raise ValueError(f"{name}: give both the mean and the scale")
        if loc.shape != param_loc.shape or scale.shape != param_loc.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(param_loc.shape)}, got mean "
                f"{tuple(loc.shape)} and scale {tuple(scale.shape)}"
            )
        if not torch.isfinite(loc).all() or not torch.isfinite(scale).all() or (scale < 0).any():
            raise ValueError(f"{name}: means must be finite and scales finite and >= 0")
        param_loc.copy_(loc)
        transform = cast(str, layer.scale_transform)  # an attribute such layers have (above)
        param_raw.copy_(_raw_from_scale(scale.to(param_raw), transform))

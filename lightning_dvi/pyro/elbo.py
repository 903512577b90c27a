r"""DeterministicELBO: the DVI objective as a ``pyro.infer.ELBO``."""

from __future__ import annotations

from typing import Any, cast

import pyro
import pyro.poutine as poutine
import torch
from pyro.infer.elbo import ELBO
from pyro.infer.util import is_validation_enabled, torch_item
from pyro.poutine.util import prune_subsample_sites
from pyro.util import check_site_shape, warn_if_nan
from torch import Tensor

from ..moments.allocator import reuse_large_allocations
from ..priors import EmpiricalBayes
from .guide import DeterministicGuide
from .messenger import MomentPassMessenger

__all__ = ["DeterministicELBO"]


class DeterministicELBO(ELBO):
    r"""Deterministic variational inference (Wu et al., ICLR 2019) as a Pyro ELBO.

    With a :class:`~lightning_dvi.pyro.DeterministicGuide`, one pass estimates

    .. math::
        \mathcal L = \sum_{\text{obs}} s\,\mathbb E_q\log p(y\mid f)
            - \sum_{\text{weights}} s\,\mathrm{KL}(q(w)\,\|\,p(w))
            + \sum_{\text{other latents}} s\,[\log p(z) - \log q(z)]_{z\sim q},

    where :math:`s` is each site's plate scale (``N / batch`` under subsampling, exactly as in
    Trace_ELBO), the expected log-likelihood is the closed form on the output moments of the
    moment pass, the KL is analytic, and the last sum uses one reparameterised sample per
    particle. With no non-weight latents the estimate has zero variance. The returned loss is
    :math:`-\mathcal L`, in the same units as Trace_ELBO's.

    Use it as ``SVI(model, guide, optim, loss=DeterministicELBO())`` or, Lightning style,
    ``DeterministicELBO()(model, guide)`` (an ``ELBOModule``).

    With Pyro's validation on (the default), every sample site of the model passes Pyro's own
    site-shape check against its plates before the loss is returned, as in ``Trace_ELBO``: a
    network output left as ``[N, 1]`` under ``pyro.plate("data", N)`` (which broadcasts the
    site to ``[N, N]``) is refused before the first step, naming the site and the fix. Site
    shapes depend only on the model and the shapes of its arguments, so the check runs once
    per *call signature* (the model, the guide, and the shape, dtype and device of every tensor
    argument, the value of every other): a new batch size or input shape is checked again, an
    unchanged one is not (``validate_every_step=True`` checks every call, as ``Trace_ELBO``
    does). The observed values themselves (NaN/Inf, a shape that would broadcast the
    likelihood) are checked on every call while validation is on; with
    ``pyro.enable_validation(False)`` nothing is checked.

    On a CPU the first call lets glibc keep large freed buffers for reuse, as the Lightning
    modules do when a fit starts (:func:`~lightning_dvi.moments.allocator.
    reuse_large_allocations`; env ``LIGHTNING_DVI_MALLOC=system`` leaves the allocator alone):
    the objective's temporaries are otherwise mapped and faulted in afresh at every step.

    Args:
        num_particles: samples of the non-weight latents averaged per step.
        prior: ``None`` for the model's priors, or an
            :class:`~lightning_dvi.priors.EmpiricalBayes` whose closed-form optimum
            :math:`s^* = (\sum(\sigma^2+\mu^2) + 2\beta)/(n+2\alpha+2)` replaces the variance of
            every zero-mean Normal weight prior, per site (in-graph, gradients flow through it).
        retain_graph: passed to ``backward`` in :meth:`loss_and_grads`.
        max_plate_nesting: as for ``Trace_ELBO``: dimensions left of it are not checked
            against the plates (default: all are).
        validate_every_step: with Pyro's validation on, run the site-shape check on every
            call instead of once per call signature.

    Raises:
        ValueError: (with validation on) an observed site whose log-likelihood shape does not
            match its plates, naming the site, both shapes and the fix.
        NotImplementedError: (at the first call) with a guide that is not a
            DeterministicGuide, or a model using an op or likelihood the moment pass cannot
            handle exactly, naming it.
    """

    def __init__(
        self,
        num_particles: int = 1,
        prior: EmpiricalBayes | None = None,
        retain_graph: bool | None = None,
        max_plate_nesting: float = float("inf"),
        validate_every_step: bool = False,
    ) -> None:
        super().__init__(
            num_particles=num_particles,
            max_plate_nesting=max_plate_nesting,
            retain_graph=retain_graph,
        )
        if prior is not None and not isinstance(prior, EmpiricalBayes):
            raise TypeError(f"prior must be None or an EmpiricalBayes, got {type(prior).__name__}")
        if prior is not None and prior.mode != "in_graph":
            raise ValueError("DeterministicELBO uses EmpiricalBayes in 'in_graph' mode only")
        self.prior = prior
        self.validate_every_step = bool(validate_every_step)
        self._checked_signatures: set[Any] = set()
        self._checked_for: tuple[Any, Any] | None = None  # the (model, guide) they belong to
        self._allocator_checked = False

    def _needs_shape_check(self, model: Any, guide: Any, args: tuple, kwargs: dict) -> bool:
        """Whether this call's site shapes must be checked (validation on, signature new)."""
        if not is_validation_enabled():
            return False
        if self.validate_every_step:
            return True
        checked = self._checked_for
        if checked is None or checked[0] is not model or checked[1] is not guide:
            self._checked_signatures.clear()
            self._checked_for = (model, guide)
        return _signature_of((args, kwargs)) not in self._checked_signatures

    def _get_trace(self, model: Any, guide: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        r"""One moment pass: ``(model_trace, guide_trace)`` whose log-prob sums form the ELBO.

        In the model trace, weight sites carry :math:`-\mathrm{KL}` and observed sites the
        expected log-likelihood as their ``log_prob``; subsample sites are pruned.
        """
        guide_trace = poutine.trace(guide.moment_posteriors).get_trace(*args, **kwargs)
        weights = guide_trace.nodes["_RETURN"]["value"]
        hyper = None if self.prior is None else (self.prior.alpha, self.prior.beta)
        messenger = MomentPassMessenger(weights, hyper, validate=is_validation_enabled())
        # Validation is off while moment tensors flow: distribution constructors would otherwise
        # run support checks (comparisons) on them, which they rightly refuse.
        with pyro.validation_enabled(False):
            model_trace = poutine.trace(
                messenger(poutine.replay(model, trace=guide_trace))
            ).get_trace(*args, **kwargs)
        missing = set(weights) - messenger.visited
        if missing:
            raise RuntimeError(
                f"weight sites {sorted(missing)} of the guide were not sampled by the model "
                "in this call; DeterministicGuide needs a static model structure"
            )
        model_trace = prune_subsample_sites(model_trace)
        if self._needs_shape_check(model, guide, args, kwargs):
            self._check_site_shapes(model_trace)
            if len(self._checked_signatures) >= _MAX_SIGNATURES:  # e.g. ever-changing shapes
                self._checked_signatures.clear()
            self._checked_signatures.add(_signature_of((args, kwargs)))
        return model_trace, prune_subsample_sites(guide_trace)

    def _check_site_shapes(self, model_trace: Any) -> None:
        """Pyro's ``check_site_shape`` on every sample site (log-probs are memoised for the sum)."""
        with pyro.validation_enabled(False):
            model_trace.compute_log_prob()
        for site in model_trace.nodes.values():
            if site["type"] != "sample":
                continue
            try:
                check_site_shape(site, self.max_plate_nesting)
            except ValueError as error:
                raise ValueError(_shape_error(site, error)) from None

    def _particle_loss(self, model: Any, guide: Any, args: tuple, kwargs: dict) -> Tensor:
        model_trace, guide_trace = self._get_trace(model, guide, args, kwargs)
        with pyro.validation_enabled(False):
            elbo = model_trace.log_prob_sum() - guide_trace.log_prob_sum()
        return -torch.as_tensor(elbo)

    def differentiable_loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The negative ELBO as a differentiable 0-dim tensor."""
        if not isinstance(guide, DeterministicGuide):
            raise NotImplementedError(
                f"DeterministicELBO needs a lightning_dvi.pyro.DeterministicGuide, got "
                f"{type(guide).__name__}; other guides (AutoNormal emits Delta sites) carry no "
                "weight moments. Use pyro.infer.Trace_ELBO with them."
            )
        if not self._allocator_checked:
            self._allocator_checked = True
            if _first_device((args, kwargs)) == torch.device("cpu"):
                reuse_large_allocations()
        loss = sum(
            self._particle_loss(model, guide, args, kwargs) for _ in range(self.num_particles)
        )
        loss = loss / self.num_particles
        warn_if_nan(loss, "loss")
        return cast(Tensor, loss)

    def loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        """The negative ELBO as a float (no gradients)."""
        with torch.no_grad():
            return float(torch_item(self.differentiable_loss(model, guide, *args, **kwargs)))

    def loss_and_grads(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> float:
        """The negative ELBO as a float; backpropagates it into the parameters."""
        loss = self.differentiable_loss(model, guide, *args, **kwargs)
        if loss.requires_grad:
            loss.backward(retain_graph=self.retain_graph)
        return float(torch_item(loss))


#: Call signatures whose site shapes were checked that a DeterministicELBO remembers.
_MAX_SIGNATURES = 64


def _first_device(value: Any) -> torch.device | None:
    """The device of the first tensor in nested tuples, lists and dicts (``None`` if none)."""
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        for item in value:
            device = _first_device(item)
            if device is not None:
                return device
    return None


def _signature_of(value: Any) -> Any:
    """What the site shapes can depend on: a tensor's shape, dtype and device, else the value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, *(_signature_of(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _signature_of(v)) for k, v in sorted(value.items(), key=repr)))
    return object()  # anything else: never equal to a remembered signature, checked each call


def _shape_error(site: dict, error: ValueError) -> str:
    """Pyro's site-shape message, with the usual cause and its one-line fix."""
    shape = tuple(site["log_prob"].shape)
    plates = {f.dim: f.size for f in site["cond_indep_stack"] if f.vectorized and f.dim}
    text = (
        f"site {site['name']!r}: its log-likelihood has shape {shape}, but its plates "
        f"({', '.join(f'dim {d}: size {n}' for d, n in sorted(plates.items())) or 'none'}) "
        f"allow only those dimensions (Pyro's site-shape check; Trace_ELBO refuses this model "
        f"too). The likelihood's batch shape is {tuple(site['fn'].batch_shape)}"
    )
    if len(shape) >= 2 and shape[-1] == shape[-2] and plates.get(-1) == shape[-1]:
        n = shape[-1]
        text += (
            f": a network output of shape [{n}, 1] under pyro.plate(..., {n}) broadcasts the "
            f"site to [{n}, {n}]. Fix: pass the output as `out.squeeze(-1)`, or declare its "
            "last dimension an event with `.to_event(1)` (observing y of shape "
            f"[{n}, 1])"
        )
    return f"{text}.\nPyro's check: {error}"

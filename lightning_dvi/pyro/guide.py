r"""DeterministicGuide: a mean-field Normal guide whose weight sites support a DVI moment pass."""

from __future__ import annotations

import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from typing import Any, cast

import pyro
import pyro.distributions as dist
import torch
from pyro.distributions.util import sum_rightmost
from pyro.infer.autoguide import AutoNormal
from pyro.infer.autoguide.initialization import init_to_feasible
from pyro.nn.module import pyro_method
from pyro.poutine import get_mask
from torch import Tensor
from torch.distributions import biject_to

from ..propagation import Mode, MomentPass, Propagation, moment_propagation
from .distributions import unwrap_independent
from .moment_tensor import MomentTensor

__all__ = ["DeterministicGuide", "init_to_he", "is_weight_prior"]


def is_weight_prior(fn: Any) -> bool:
    """A site is a *weight site* when its prior is a (batched, ``to_event``'d) Normal."""
    base, _ = unwrap_independent(fn)
    return isinstance(base, torch.distributions.Normal)


def init_to_he(site: dict) -> Tensor:
    r"""The guide's default initial posterior mean of a site, as a Pyro ``init_loc_fn``.

    Weight matrices (Normal-prior sites of 2 or more dimensions) start at
    :math:`\mathcal N(0, 2/\text{fan\_in})` (He; zero means would make every hidden unit
    identical in a deterministic pass, with no sampling noise to break the symmetry), other
    Normal-prior sites (biases) at zero, every other latent at ``init_to_feasible``. Use it as
    the ``fallback`` of Pyro's ``init_to_value`` to set some sites (e.g. pretrained weights)
    and keep this default for the rest.
    """
    if not is_weight_prior(site["fn"]):
        return cast(Tensor, init_to_feasible(site))
    value = torch.zeros_like(site["fn"].sample())
    if value.dim() >= 2:
        value.normal_(0.0, math.sqrt(2.0 / value.shape[-1]))
    return value


#: Every DeterministicGuide whose parameters exist (set up), to warn when two share a prefix.
_SET_UP: weakref.WeakSet[DeterministicGuide] = weakref.WeakSet()


def _warn_if_shared(guide: DeterministicGuide) -> None:
    """Warn when another live, set-up guide's parameters hold ``guide``'s param-store prefix."""
    prefix = guide._pyro_name
    stored = any(key.startswith(prefix + ".") for key in pyro.get_param_store())
    if stored and any(other is not guide and other._pyro_name == prefix for other in _SET_UP):
        warnings.warn(
            f"another DeterministicGuide already uses the param-store prefix {prefix!r}: the "
            "two guides share their parameters (pyro.param returns the stored values), so "
            "training one changes the other. Give each guide its own name, e.g. "
            "DeterministicGuide(model, name='guide_full'), or call pyro.clear_param_store() "
            "before building a replacement.",
            UserWarning,
            stacklevel=4,
        )


class DeterministicGuide(AutoNormal):
    r"""Mean-field Normal guide that also runs a deterministic (DVI) moment pass of the model.

    Sites are found by tracing the model once, as :class:`~pyro.infer.autoguide.AutoNormal`
    does. Two kinds are distinguished:

    * **weight sites** (prior a ``Normal``, possibly ``.expand(...).to_event(k)``): the guide
      samples :math:`q(w) = \mathcal N(\mu, \sigma^2)` *directly at the site*, so KL terms stay
      analytic and ``Predictive`` sees ordinary samples. In a moment pass
      (:meth:`moment_posteriors`) the site yields a :class:`MomentTensor` carrying
      :math:`(\mu, \sigma^2)` instead, and the model propagates moments;
    * **other latents** (noise scales with Uniform/Gamma/LogNormal/HalfNormal priors, and any
      site listed in ``sampled_sites``): an AutoNormal-style Normal in unconstrained space pushed
      through ``biject_to(support)``, estimated by one reparameterised sample per pass.

    ``median()``, ``quantiles()``, ``pyro.clear_param_store()`` and Pyro's
    ``module_local_params`` setting behave as for AutoNormal.

    Args:
        model: the Pyro model (unchanged; a callable or PyroModule).
        mode: ``"diag"`` (dDVI: per-unit variances) or ``"full"`` (DVI: full covariance of each
            layer's units per data point).
        init_scale: initial posterior standard deviation of every site (unconstrained space for
            non-weight latents), as AutoNormal's ``init_scale``.
        init_loc_fn: initial posterior means, a Pyro ``init_loc_fn`` called for **every**
            latent site, weight sites included, as for AutoNormal: e.g. ``init_to_value(values=
            {"net.0.weight": w, ...}, fallback=init_to_he)`` or TyXe's
            ``PretrainedInitializer.from_net(net)`` start the posterior means at pretrained
            weights. Default :func:`init_to_he`: He-normal weight matrices, zero biases,
            ``init_to_feasible`` for other latents. A sampled weight site (see
            ``sampled_sites``) is initialised in unconstrained space as by AutoNormal.
        sampled_sites: names of Normal-prior sites to treat by one sample rather than by moments
            (e.g. a log noise scale that the model exponentiates).
        create_plates: as for AutoNormal (e.g. to share a subsampling plate with the model).
        name: the prefix of the guide's parameters in Pyro's param store
            (``"<name>.locs.<site>"``, ``"<name>.scales.<site>"``). Default: the class name,
            as Pyro's autoguides do, so that a saved param store loads into a new guide. Two
            guides with the same prefix *share* their parameters (Pyro's ``pyro.param`` returns
            the stored value): give each guide of one session its own ``name``, e.g. a diag and
            a full guide compared side by side. Setting up a guide whose prefix a live,
            already set-up DeterministicGuide uses warns.

    Examples:
        >>> # guide = DeterministicGuide(model); svi = SVI(model, guide, optim, DeterministicELBO())
    """

    def __init__(
        self,
        model: Callable[..., Any],
        mode: Mode | Propagation = "diag",
        *,
        init_scale: float = 0.05,
        init_loc_fn: Callable[[dict], Tensor] = init_to_he,
        sampled_sites: Iterable[str] = (),
        create_plates: Callable[..., Any] | None = None,
        name: str | None = None,
    ) -> None:
        self.mode: MomentPass = moment_propagation(mode)
        self.sampled_sites = frozenset(sampled_sites)
        self.weight_sites: tuple[str, ...] = ()
        super().__init__(
            model,
            init_loc_fn=init_loc_fn,
            init_scale=float(init_scale),
            create_plates=create_plates,
        )
        if name is not None:
            if not isinstance(name, str) or not name:
                raise ValueError(f"name must be a non-empty string, got {name!r}")
            self._pyro_name = name  # the prefix of every parameter created at setup

    # ------------------------------------------------------------------ setup
    def _is_weight_site(self, site: dict) -> bool:
        return site["name"] not in self.sampled_sites and is_weight_prior(site["fn"])

    def _setup_prototype(self, *args: Any, **kwargs: Any) -> None:
        # AutoNormal already refuses discrete latents (ValueError with Pyro's own advice).
        _warn_if_shared(self)
        super()._setup_prototype(*args, **kwargs)
        assert self.prototype_trace is not None  # set by AutoNormal._setup_prototype
        self.weight_sites = tuple(
            name
            for name, site in self.prototype_trace.iter_stochastic_nodes()
            if self._is_weight_site(site)
        )
        unknown = self.sampled_sites - set(self.prototype_trace.nodes)
        if unknown:
            raise ValueError(f"sampled_sites not found in the model: {sorted(unknown)}")
        _SET_UP.add(self)

    # ------------------------------------------------------------------ sampling
    def _sample_transformed(self, name: str, site: dict) -> Tensor:
        """AutoNormal's treatment of one latent: a Normal pushed through ``biject_to``."""
        transform = biject_to(site["fn"].support)
        loc, scale = self._get_loc_and_scale(name)
        unconstrained = pyro.sample(
            name + "_unconstrained",
            dist.Normal(loc, scale).to_event(self._event_dims[name]),
            infer={"is_auxiliary": True},
        )
        value = transform(unconstrained)
        if get_mask() is False:
            log_density: Tensor | float = 0.0
        else:
            ladj: Tensor = transform.inv.log_abs_det_jacobian(value, unconstrained)
            log_density = sum_rightmost(ladj, ladj.dim() - value.dim() + site["fn"].event_dim)
        delta = dist.Delta(value, log_density=log_density, event_dim=site["fn"].event_dim)
        return pyro.sample(name, delta)

    def _each_site(
        self, weight: Callable[[str, Tensor, Tensor], Tensor], args: tuple, kwargs: dict
    ) -> dict[str, Tensor]:
        """Every latent site's value, inside the site's plates.

        A weight site's value is ``weight(name, loc, scale)`` of its Normal posterior; other
        latents get AutoNormal's transformed Normal sample.
        """
        if self.prototype_trace is None:
            self._setup_prototype(*args, **kwargs)
        plates = self._create_plates(*args, **kwargs)
        values: dict[str, Tensor] = {}
        assert self.prototype_trace is not None  # set up just above
        for name, site in self.prototype_trace.iter_stochastic_nodes():
            with ExitStack() as stack:
                for frame in site["cond_indep_stack"]:
                    if frame.vectorized:
                        stack.enter_context(plates[frame.name])
                if name in self.weight_sites:
                    values[name] = weight(name, *self._get_loc_and_scale(name))
                else:
                    values[name] = self._sample_transformed(name, site)
        return values

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Tensor]:
        """Sample every latent site (weights from their Normal posterior); used by Predictive."""

        def sample(name: str, loc: Tensor, scale: Tensor) -> Tensor:
            return pyro.sample(name, dist.Normal(loc, scale).to_event(self._event_dims[name]))

        return self._each_site(sample, args, kwargs)

    @pyro_method
    def moment_posteriors(self, *args: Any, **kwargs: Any) -> dict[str, MomentTensor]:
        r"""The guide's side of a moment pass.

        Samples the non-weight latents (one reparameterised draw each, recorded by any enclosing
        trace) and returns every weight site's posterior as a :class:`MomentTensor` holding
        :math:`(\mu, \sigma^2)`. Runs as a ``pyro_method`` so the guide's parameters are
        registered with ``pyro.param`` (``SVI.step`` only updates parameters seen that way).
        """
        weights: dict[str, MomentTensor] = {}

        def moments(name: str, loc: Tensor, scale: Tensor) -> Tensor:
            weights[name] = MomentTensor(loc, var=scale * scale, mode=self.mode, sources=(name,))
            return weights[name]

        self._each_site(moments, args, kwargs)
        return weights

    def extra_repr(self) -> str:
        """Mode and site counts for ``repr``."""
        return f"mode={self.mode.name!r}, weight_sites={len(self.weight_sites)}"

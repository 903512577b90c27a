r"""The poutine Messenger that turns a model run into a DVI moment pass.

At each site of the model it does one of three things:

* **weight site** (in the guide's ``weight_sites``): the value becomes the guide's
  :class:`~lightning_dvi.pyro.moment_tensor.MomentTensor` and the site's distribution is replaced
  by a term whose ``log_prob`` is :math:`-\mathrm{KL}(q\,\|\,p)` (analytic, Normal prior;
  optionally the empirical-Bayes optimum replaces a zero-mean prior);
* **observed site** whose distribution depends on the network: the distribution is replaced by a
  term whose ``log_prob(y)`` is the closed-form :math:`\mathbb E_q\log p(y\mid f)`;
* anything else is left alone (replayed non-weight latents keep their prior ``log_prob``).

Because the replacement terms are ordinary sites of an ordinary trace, Pyro's own
``scale_and_mask`` applies plate subsampling scales and masks exactly as for Trace_ELBO.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, cast

import torch
from pyro.distributions import Delta, MaskedDistribution, TorchDistribution
from pyro.distributions.util import sum_rightmost
from pyro.poutine.messenger import Messenger
from torch import Tensor

from .. import likelihoods
from .._tracing import recording, untraced
from ..likelihoods.functional import normal_expected_log_prob
from ..priors.functional import gaussian_kl_elementwise, optimal_variance
from .distributions import (
    categorical_expected_log_prob,
    elementwise_expected_log_prob,
    unwrap_independent,
)
from .moment_tensor import MomentTensor, SampledTensor, unsupported

__all__ = ["MomentPassMessenger", "carries_moments"]


class _SiteTerm(TorchDistribution):
    """A stand-in distribution whose ``log_prob`` is a precomputed ELBO term (never sampled)."""

    arg_constraints: dict = {}  # noqa: RUF012 - torch's class-level convention

    def __init__(
        self, term: Callable[[Any], Tensor], batch_shape: torch.Size, event_shape: torch.Size
    ) -> None:
        self._term = term
        super().__init__(batch_shape, event_shape, validate_args=False)

    def log_prob(self, value: Any) -> Tensor:
        """The ELBO term of this site (a KL with minus sign, or an expected log-likelihood)."""
        return self._term(value)

    def sample(
        self,
        sample_shape: torch.Size | list[int] | tuple[int, ...] = torch.Size(),  # noqa: B008
    ) -> Tensor:
        """Not samplable: this object exists only inside a moment pass."""
        raise RuntimeError("a DVI moment-pass site term cannot be sampled")


def carries_moments(obj: Any, _depth: int = 0) -> bool:
    """Whether a distribution (or any distribution it wraps) has moment-tensor parameters."""
    if isinstance(obj, MomentTensor):
        return True
    if _depth > 4 or not isinstance(obj, torch.distributions.Distribution):
        return False
    return any(carries_moments(v, _depth + 1) for v in vars(obj).values())


def _plain(x: Any, what: str) -> Any:
    if isinstance(x, MomentTensor):
        raise unsupported(what)
    return x


class MomentPassMessenger(Messenger):
    """Run a model as a DVI moment pass (see the module docstring).

    Args:
        weights: ``{site name: MomentTensor}`` from
            :meth:`~lightning_dvi.pyro.DeterministicGuide.moment_posteriors`.
        eb_hyper: ``(alpha, beta)`` of the empirical-Bayes inverse-gamma hyper-prior, or ``None``
            for the model's own priors.
        validate: check observed values as Pyro's validation does (NaN/Inf, and a shape that
            would broadcast the likelihood's batch shape), naming the site.
    """

    def __init__(
        self,
        weights: Mapping[str, MomentTensor],
        eb_hyper: tuple[float, float] | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__()
        self.weights = dict(weights)
        self.eb_hyper = eb_hyper
        self.validate = validate
        self.visited: set[str] = set()

    def _pyro_sample(self, msg: dict) -> None:
        name = msg["name"]
        if name in self.weights:
            self._weight_site(msg)
        elif msg["is_observed"]:
            term = self._observed_term(name, msg["fn"], msg["value"])
            if term is not None:
                msg["fn"] = term
        elif carries_moments(msg["fn"]):
            raise unsupported(f"latent site {name!r}, whose prior depends on network weights")
        elif isinstance(msg["value"], Tensor) and not recording():  # a replayed sample
            # The marker refuses a sampled latent as a layer's weight. A step is recorded
            # (CompiledDeterministicELBO) only after the eager step with the same signature
            # passed that check, and make_fx's tracing refuses tensor subclasses.
            msg["value"] = msg["value"].as_subclass(SampledTensor)

    # ------------------------------------------------------------------ weight sites
    def _weight_site(self, msg: dict) -> None:
        name, prior = msg["name"], msg["fn"]
        if name in self.visited:
            raise unsupported(f"weight site {name!r} sampled twice in one model run")
        if msg["is_observed"]:
            raise unsupported(f"observing weight site {name!r}")
        self.visited.add(name)
        q = self.weights[name]
        base, _ = unwrap_independent(prior)
        if not isinstance(base, torch.distributions.Normal):
            raise unsupported(
                f"weight site {name!r} with a {type(base).__name__} prior",
                "the analytic KL needs a Normal prior (mark the site in sampled_sites)",
            )
        p_loc = _plain(base.loc, f"the prior of weight site {name!r} depending on other weights")
        p_var = _plain(base.scale, f"the prior of weight site {name!r} depending on weights") ** 2
        if self.eb_hyper is not None and _all_zero(p_loc):
            # Empirical Bayes: the zero-mean prior's variance becomes its closed-form optimum.
            p_var = optimal_variance(q.dvi_mean, q.dvi_var.sqrt(), *self.eb_hyper)
        event_dim = prior.event_dim

        def neg_kl(value: Any) -> Tensor:
            kl = gaussian_kl_elementwise(q.dvi_mean, q.dvi_var, p_loc, p_var)
            kl = kl.expand(torch.broadcast_shapes(kl.shape, prior.shape()))
            return cast(Tensor, -sum_rightmost(kl, event_dim))

        msg["value"] = q
        msg["fn"] = _SiteTerm(neg_kl, prior.batch_shape, prior.event_shape)
        msg["done"] = True

    # ------------------------------------------------------------------ observed sites
    def _observed_term(self, name: str, fn: Any, value: Any) -> _SiteTerm | None:
        if not carries_moments(fn):
            return None
        if self.validate:
            _check_observed(name, fn, value)
        expected = _expected_log_prob(name, fn)
        return _SiteTerm(expected, fn.batch_shape, fn.event_shape)


def _all_zero(loc: Tensor | float) -> bool:
    """Whether a prior's mean is zero everywhere: a property of the model, read on the host.

    The prior's constants are not inputs of a recorded step
    (:class:`~lightning_dvi.pyro.CompiledDeterministicELBO`), so the answer is read from their
    values even while the step is being recorded.
    """
    if not isinstance(loc, Tensor):
        return bool(loc == 0)
    with untraced():
        return not bool((loc != 0).any())


def _check_observed(name: str, fn: Any, value: Any) -> None:
    """What Trace_ELBO's validation would reject in ``log_prob``, named by site."""
    if isinstance(value, MomentTensor):  # pyro.deterministic of the network output
        return
    where = f"Error while computing the expected log-likelihood at site {name!r}"
    if not isinstance(value, Tensor):
        raise ValueError(f"{where}: obs must be a tensor, got {type(value).__name__}")
    expected = fn.batch_shape + fn.event_shape
    try:
        broadcast = torch.broadcast_shapes(value.shape, expected)
    except RuntimeError:
        broadcast = None
    if broadcast != expected:
        raise ValueError(
            f"{where}: invalid obs shape {tuple(value.shape)} for a likelihood of batch shape "
            f"{tuple(fn.batch_shape)} and event shape {tuple(fn.event_shape)}; it would "
            f"broadcast to {broadcast and tuple(broadcast)} (e.g. y of shape [N, 1] against a "
            "mean of shape [N]: pass y.squeeze(-1))"
        )
    if value.dtype.is_floating_point and not bool(torch.isfinite(value).all()):
        raise ValueError(f"{where}: obs contains NaN or Inf")


def _expected_log_prob(name: str, fn: Any) -> Callable[[Tensor], Tensor]:
    """``y -> E_q log p(y | f)`` for a likelihood whose parameters are moment tensors."""
    if isinstance(fn, torch.distributions.Independent):
        inner = _expected_log_prob(name, fn.base_dist)
        k = fn.reinterpreted_batch_ndims
        return lambda y: sum_rightmost(inner(y), k)
    if isinstance(fn, MaskedDistribution):
        inner, mask = _expected_log_prob(name, fn.base_dist), fn._mask
        if isinstance(mask, bool):
            return inner if mask else lambda y: inner(y) * 0.0
        return lambda y: torch.where(mask, inner(y), torch.zeros((), dtype=y.dtype))
    if isinstance(fn, Delta):  # pyro.deterministic: contributes nothing to the ELBO
        return lambda y: torch.zeros(fn.batch_shape, dtype=y.dtype, device=y.device)
    expected = getattr(fn, "expected_log_prob", None)
    if expected is not None:  # the library's moment-aware likelihoods
        return cast(Callable[[Tensor], Tensor], expected)
    if isinstance(fn, torch.distributions.Categorical):
        return _categorical(name, fn)
    if isinstance(fn, torch.distributions.Bernoulli):
        return _bernoulli(name, fn)
    if isinstance(fn, torch.distributions.Poisson) and isinstance(fn.rate, MomentTensor):
        if fn.rate.dvi_link != "exp":
            raise unsupported(
                f"observed site {name!r}: a Poisson rate other than exp(network output)",
                "let the network output the log-rate f and write dist.Poisson(rate=f.exp())",
            )
        what = f"observed site {name!r}: Poisson"
        return elementwise_expected_log_prob(what, fn.rate, likelihoods.Poisson(), link="exp")
    if isinstance(fn, torch.distributions.Normal):
        return _normal(name, fn.loc, fn.scale)
    raise unsupported(
        f"observed site {name!r} with a {type(fn).__name__} likelihood depending on the network",
        "supported: Normal (fixed or latent scale), Categorical(logits=f), "
        "Categorical(probs=softmax(f)), Bernoulli(logits=f), Bernoulli(probs=sigmoid(f)), "
        "Poisson(rate=f.exp()), lightning_dvi.pyro.HeteroscedasticGaussian",
    )


def _categorical(name: str, fn: Any) -> Callable[[Tensor], Tensor]:
    """``Categorical(logits=f)`` or ``Categorical(probs=softmax(f))``: the same logits form."""
    given = fn.__dict__  # probs/logits are lazy: read what was given
    what = f"observed site {name!r}: Categorical"
    logits, probs = given.get("logits"), given.get("probs")
    if isinstance(logits, MomentTensor):
        return categorical_expected_log_prob(what, logits)
    if isinstance(probs, MomentTensor) and probs.dvi_link == "softmax":
        return categorical_expected_log_prob(what, probs, link="softmax")
    raise unsupported(
        f"{what}(probs=p) whose p is not the softmax of the network output",
        "write probs=torch.softmax(f, -1) (or nn.Softmax(-1) as the last layer) or logits=f: "
        "both observe with the expected log-likelihood of the logits f",
    )


def _bernoulli(name: str, fn: Any) -> Callable[[Tensor], Tensor]:
    r"""``Bernoulli(logits=f)`` or ``Bernoulli(probs=sigmoid(f))``: the same logits form.

    ``probs = torch.sigmoid(f)`` (``nn.Sigmoid``, TyXe's ``logit_predictions=False``) is the
    same model as ``logits = f``; the sigmoid's output remembers ``f`` (``dvi_logits``), and
    the site integrates :math:`\log p(y\mid f)` over the Gaussian of ``f`` exactly as the
    logits form does (the moments of the sigmoid itself are not what the likelihood needs).
    """
    given = fn.__dict__  # probs/logits are lazy: read what was given
    what = f"observed site {name!r}: Bernoulli"
    logits, probs = given.get("logits"), given.get("probs")
    if isinstance(probs, MomentTensor):
        logits = probs.dvi_logits
        if logits is None:
            raise unsupported(
                f"{what}(probs=p) whose p is not torch.sigmoid of the network output",
                "write probs=torch.sigmoid(f) (or nn.Sigmoid as the last layer) or logits=f: "
                "both observe with the expected log-likelihood of the logits f",
            )
    if not isinstance(logits, MomentTensor):  # pragma: no cover - carries_moments said so
        raise unsupported(f"{what} with parameters that are not the network output")
    return elementwise_expected_log_prob(what, logits, likelihoods.Bernoulli())


def _normal(name: str, loc: Any, scale: Any) -> Callable[[Tensor], Tensor]:
    if isinstance(loc, MomentTensor):
        loc.check_unlinked(f"the mean of observed site {name!r}")
    if isinstance(scale, MomentTensor):
        raise unsupported(
            f"observed site {name!r}: a Normal whose scale depends on the network",
            "use lightning_dvi.pyro.HeteroscedasticGaussian(outputs) for a learned noise",
        )
    m_mean, m_var = (loc.dvi_mean, loc.dvi_var) if isinstance(loc, MomentTensor) else (loc, 0.0)
    return lambda y: normal_expected_log_prob(m_mean, m_var, y, scale * scale)

r"""Compiled training steps: a bare network or the ELBO through :func:`torch.compile`.

The hot path of a step (network moments, likelihood, KL) is pure tensor work; what is not are
the checks that read tensor values (NaN/Inf inputs and targets, label ranges, a finite loss).
Inside a compiled region each of them would be a host synchronisation and a graph break, so
while :func:`torch.compile` traces, the library skips them, and the wrappers here run them
**once per call, eagerly, outside the compiled region** (on by default). The compiled graph is
then free of graph breaks and host reads, which is what CUDA graphs
(``mode="reduce-overhead"``) need. The full-covariance kernels take their whole-tensor form
while traced (:mod:`lightning_dvi.moments.policy`), so inductor fuses them into the step.

A bare ``torch.compile(net)`` or ``torch.compile(elbo)`` also traces without graph breaks, but
then performs no value checks at all; prefer these wrappers.

**A second run loads the compile from disk.** Inductor caches its compiled graphs
(``TORCHINDUCTOR_CACHE_DIR``), and AOTAutograd caches the traced and partitioned joint
forward/backward graph, but by default it refuses graphs that contain a custom
:class:`torch.autograd.Function` (the ReLU moments, the fused head and the KL are such
Functions), so every run re-traced the joint graph. The wrappers here turn on
``torch._functorch.config.autograd_cache_allow_custom_autograd_functions`` (process-wide: it
only lets such graphs into the cache; their forward and backward bodies are part of the cache
key). What a second run still pays is Dynamo's tracing of the Python, guard building and
loading the compiled kernels: docs/speed_current.md, ``recipes/compile_cache.py``.

Examples:
    >>> import torch
    >>> from lightning_dvi.compile import compile_elbo, compile_network
    >>> from lightning_dvi.likelihoods import HeteroscedasticGaussian
    >>> from lightning_dvi.nn import mlp
    >>> from lightning_dvi.priors import EmpiricalBayes
    >>> net = mlp(3, [8], 2)
    >>> step = compile_elbo(net, HeteroscedasticGaussian(), EmpiricalBayes(), mode="diag",
    ...                     backend="eager")  # default: inductor; "eager" keeps the doctest fast
    >>> x, y = torch.randn(16, 3), torch.randn(16)
    >>> terms = step(x, y, num_data=100)
    >>> terms.loss.backward()
    >>> forward = compile_network(net, backend="eager")
    >>> forward(x, mode="full").cov.shape
    torch.Size([16, 2, 2])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .likelihoods import Likelihood
from .nn.base import Moments
from .objective import ELBOTerms, check_arguments, elbo_terms, expected_log_likelihood_and_kl
from .priors import Prior
from .propagation import Mode, Propagation, propagation

__all__ = ["COMPILE_MODES", "CompiledELBO", "compile_elbo", "compile_network", "compile_options"]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``mode`` values of :func:`torch.compile` accepted by ``compile=`` of the Lightning modules."""


def compile_options(compile: bool | str | dict[str, Any]) -> dict[str, Any] | None:
    """Normalise a ``compile`` setting to :func:`torch.compile` keyword arguments.

    ``False`` -> ``None`` (eager); ``True`` -> ``{}`` (inductor, default mode); a string -> a
    ``mode`` of :data:`COMPILE_MODES`; a dict -> passed through.

    Raises:
        ValueError: on anything else.
    """
    if compile is False:
        return None
    if compile is True:
        return {}
    if isinstance(compile, str) and compile in COMPILE_MODES:
        return {"mode": compile}
    if isinstance(compile, dict) and all(isinstance(k, str) for k in compile):
        return dict(compile)
    raise ValueError(
        f"compile must be a bool, one of {', '.join(COMPILE_MODES)}, or a dict of torch.compile "
        f"arguments, got {compile!r}"
    )


def _cache_friendly(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for :func:`torch.compile`, after letting AOTAutograd cache our graphs.

    Turns on ``torch._functorch.config.autograd_cache_allow_custom_autograd_functions``
    (process-wide; see the module docstring) and returns ``options`` unchanged.
    """
    torch._functorch.config.autograd_cache_allow_custom_autograd_functions = True
    return dict(options)


def _check_input(x: Tensor) -> None:
    if not isinstance(x, Tensor) or x.dim() < 1 or not x.dtype.is_floating_point:
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"input must be a floating tensor [..., D], got {shape}")
    if not torch.isfinite(x).all():  # the one host read on the input, outside the graph
        raise ValueError("input contains NaN or Inf")


def compile_network(net: nn.Module, **options: Any) -> Callable[..., Moments]:
    """``net(x, mode=..., num_samples=...)`` compiled, with the input's value check outside.

    Args:
        net: a :mod:`lightning_dvi.nn` network.
        **options: keyword arguments of :func:`torch.compile` (``mode``, ``backend``, ...).

    Returns:
        A callable with the signature of ``net.forward`` for tensor inputs.
    """
    compiled = torch.compile(net, **_cache_friendly(options))

    def forward(
        x: Tensor, mode: Mode | Propagation = "full", num_samples: int | None = None
    ) -> Moments:
        how = propagation(mode, num_samples)
        _check_input(x)
        out: Moments = compiled(x, mode=how)
        return out

    return forward


class CompiledELBO:
    r"""The per-datum ELBO of :func:`~lightning_dvi.objective.elbo` with a compiled hot path.

    The compiled function maps a batch to :math:`(\bar\ell, \mathrm{KL})`; the KL weight and
    :math:`N` are applied outside it (so a KL schedule never triggers a recompilation), as are
    the value checks: the input and targets before the call, the loss's finiteness after it
    (one host read each, as in eager :func:`~lightning_dvi.objective.elbo`).

    With ``mode="reduce-overhead"`` (CUDA graphs) the returned ``expected_log_likelihood`` and
    ``kl`` live in memory the next call overwrites: clone them to keep them across steps.

    Args:
        net: a :mod:`lightning_dvi.nn` network.
        likelihood: the observation model.
        prior: the weight prior.
        mode: propagation mode (fixed per compiled function).
        num_samples: network samples for ``sample``/``local``.
        **options: keyword arguments of :func:`torch.compile`.
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior: Prior,
        mode: Mode | Propagation = "full",
        num_samples: int | None = None,
        **options: Any,
    ) -> None:
        self.propagation = propagation(mode, num_samples)
        self.net, self.likelihood, self.prior = net, likelihood, prior
        self.mode, self.num_samples = self.propagation.name, num_samples
        self.options = options
        self._compiled = torch.compile(self._parts, **_cache_friendly(options))

    def _parts(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return expected_log_likelihood_and_kl(
            self.net, self.likelihood, self.prior, x, y, self.propagation
        )

    def __call__(
        self,
        x: Tensor,
        y: Tensor,
        num_data: int,
        kl_weight: float = 1.0,
        check_finite: bool = True,
    ) -> ELBOTerms:
        """Arguments and result as :func:`~lightning_dvi.objective.elbo`."""
        check_arguments(num_data, kl_weight, x, y)
        _check_input(x)
        y = self.likelihood.validate_target(y, x.shape[0])
        ell, kl = self._compiled(x, y)
        return elbo_terms(ell, kl, num_data, kl_weight, self.propagation, check_finite)


def compile_elbo(
    net: nn.Module,
    likelihood: Likelihood,
    prior: Prior,
    *,
    mode: Mode | Propagation = "full",
    num_samples: int | None = None,
    **options: Any,
) -> CompiledELBO:
    """A :class:`CompiledELBO` (see there); ``options`` go to :func:`torch.compile`."""
    return CompiledELBO(net, likelihood, prior, mode, num_samples, **options)

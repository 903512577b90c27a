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

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from ._checks import deferred_value_checks
from ._tracing import step_trace
from .likelihoods import Likelihood
from .nn.base import Moments
from .objective import (
    ELBOTerms,
    _name_bad_values,
    check_arguments,
    elbo,
    elbo_terms,
    expected_log_likelihood_and_kl,
)
from .priors import Prior
from .propagation import Mode, Propagation, propagation

__all__ = [
    "COMPILE_MODES",
    "CUDA_GRAPH_MODES",
    "CompiledELBO",
    "CompiledStep",
    "StepTraceError",
    "compile_elbo",
    "compile_network",
    "compile_options",
    "compile_step",
    "records_whole_step",
]

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""The ``mode`` values of :func:`torch.compile` accepted by ``compile=`` of the Lightning modules."""

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The ``mode`` values that replay CUDA graphs, whose outputs live in memory the next replay
overwrites: a front end keeps :class:`CompiledELBO` for them (its autograd owns the gradients)."""


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
        compile_mode: :func:`torch.compile`'s own ``mode`` (``"reduce-overhead"``, ...), which
            ``mode`` above (the propagation) leaves no room for among ``options``.
        **options: keyword arguments of :func:`torch.compile`.
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior: Prior,
        mode: Mode | Propagation = "full",
        num_samples: int | None = None,
        *,
        compile_mode: str | None = None,
        **options: Any,
    ) -> None:
        self.propagation = propagation(mode, num_samples)
        self.net, self.likelihood, self.prior = net, likelihood, prior
        self.mode, self.num_samples = self.propagation.name, num_samples
        if compile_mode is not None:
            options["mode"] = compile_mode
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


# ---------------------------------------------------------------------------- whole step
class _ELBOParts(nn.Module):
    """The network, likelihood and prior as one module: one list of parameters and buffers."""

    def __init__(self, net: nn.Module, likelihood: Likelihood, prior: Prior, how: Propagation):
        super().__init__()
        self.net, self.likelihood, self.prior = net, likelihood, prior
        self.how = how

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return expected_log_likelihood_and_kl(self.net, self.likelihood, self.prior, x, y, self.how)


class _StepGradients(torch.autograd.Function):
    r"""The loss as an autograd node whose backward hands out gradients computed beforehand.

    Forward: a copy of the loss. Backward: the precomputed :math:`\nabla_\theta` loss of
    every parameter, times the incoming gradient (``None`` for parameters the step does not
    use), so ``loss.backward()`` accumulates them into ``.grad`` with autograd's own
    accumulation and hooks (gradient clipping, L-BFGS closures, DDP).
    """

    @staticmethod
    def forward(
        ctx: Any, loss: Tensor, grads: tuple[Tensor | None, ...], *params: Tensor
    ) -> Tensor:
        ctx.grads = grads
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        # handed over, not kept: autograd then moves each into .grad instead of copying it
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError(
                "a CompiledStep loss hands out its gradients once; for a second backward "
                "(retain_graph=True) call the step again"
            )
        # loss.backward() seeds a gradient of 1: on a CPU one cheap read of it saves a multiply
        # per tensor (a 0-dim tensor factor takes _foreach_mul's per-tensor slow path)
        if grad.device.type == "cpu" and grad.item() == 1.0:
            return (None, None, *grads)
        used = [g for g in grads if g is not None]
        scaled = iter(torch._foreach_mul(used, grad))
        return (None, None, *(None if g is None else next(scaled) for g in grads))


def _inductor(graph: torch.fx.GraphModule, args: list[Tensor]) -> Callable[..., Any]:
    """Inductor on a recorded graph, without Dynamo: one compiled call, no guards (the key is ours).

    The example inputs are fake tensors of a mode with a shape environment: without one,
    inductor and AOTAutograd bypass their on-disk caches (13-15 CPU s on every run instead of
    about 2 from the caches, docs/speed_current.md). ``torch.compile`` of the graph would supply
    one too, but its frame and guards cost 0.1-0.25 ms a call on a small network.

    Inductor runs with ``realize_reads_threshold=1``: an intermediate read by more than one
    kernel is stored once instead of recomputed in each reader. A recorded step holds long
    chains (a categorical objective's series, Newton steps and their backward) that the
    default threshold recomputed: the Pyro digits classifier's step took 11.1 ms at the default
    and 8.5 ms at 1, while the regression steps of the speed benchmark's cost table did not move
    (docs/speed_current.md). With ``fallback_random``, a random op of the graph (a Pyro guide's
    one-sample latent) draws from torch's generator through ATen, as the eager step does.
    Without ``size_asserts``: the generated code would check every input's size and stride on
    every call, which the callers' keys already fix (:class:`CompiledStep` and
    :class:`~lightning_dvi.pyro.CompiledDeterministicELBO` look a graph up by each input's
    shape, stride, dtype and device), about 10 us of a 0.35 ms step.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    fake: list[Any] = [mode.from_tensor(a.detach(), static_shapes=True) for a in args]
    with (
        torch.no_grad(),  # an inference graph: the recorded step is already differentiated
        torch._inductor.config.patch(
            realize_reads_threshold=1, fallback_random=True, size_asserts=False
        ),
    ):
        compiled: Callable[..., Any] = torch._inductor.compile(graph, fake)
    return compiled


def records_whole_step(how: Propagation, compile_mode: str | None = None) -> bool:
    """Whether a front end's ``compile=`` runs the step as one recorded graph.

    :class:`CompiledStep` for the deterministic modes; :class:`CompiledELBO` for the sampled
    modes and the CUDA-graph modes (:data:`CUDA_GRAPH_MODES`, ``compile_mode`` being
    :func:`torch.compile`'s own ``mode``).
    """
    return not how.samples and compile_mode not in CUDA_GRAPH_MODES


class StepTraceError(RuntimeError):
    """The step could not be recorded as one graph (a layer reads tensor values in Python)."""


# What the two recorded steps share: CompiledStep here, lightning_dvi.pyro.CompiledDeterministicELBO
def _recorded_options(compile_mode: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """:func:`torch.compile` options for a recorded graph, ``{}`` for inductor directly.

    The user's options, whole-graph and static unless given; ``compile_mode`` is their ``mode``.
    """
    if compile_mode is not None:
        options = {**options, "mode": compile_mode}
    return {"fullgraph": True, "dynamic": False, **options} if options else {}


def _record(
    step: Callable[..., Any], inputs: list[Tensor], what: str, instead: str
) -> torch.fx.GraphModule:
    """``step(*inputs)``, its autograd included, recorded by ``make_fx`` under :func:`step_trace`.

    Raises:
        StepTraceError: naming ``what`` and the way out (``instead``) when ``make_fx`` cannot
            record it (e.g. a data-dependent branch).
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        with step_trace(), torch.enable_grad():
            graph: torch.fx.GraphModule = make_fx(step)(*inputs)
    except RuntimeError as err:
        raise StepTraceError(
            f"the {what} step could not be recorded as one graph ({type(err).__name__}: {err}); "
            f"{instead}"
        ) from err
    return graph


def _compile_recorded(
    graph: torch.fx.GraphModule, examples: list[Tensor], options: dict[str, Any]
) -> Callable[..., Any]:
    """A recorded graph compiled: through :func:`torch.compile` with ``options``, else :func:`_inductor`."""
    if options:
        return torch.compile(graph, **_cache_friendly(options))
    return _inductor(graph, examples)


def _with_gradients(
    loss: Tensor, grads: list[Tensor], used: list[bool], params: list[Tensor]
) -> Tensor:
    """``loss`` as the :class:`_StepGradients` node that hands out a recorded step's gradients.

    ``grads`` are the graph's gradient outputs, one for each of ``params`` that ``used`` marks
    (the step reaches it); the others get none.
    """
    it = iter(grads)
    full = tuple(next(it) if u else None for u in used)
    out: Tensor = _StepGradients.apply(loss, full, *params)
    return out


class CompiledStep:
    r"""The ELBO step, its value and its gradient, as one compiled graph.

    The same objective as :func:`~lightning_dvi.objective.elbo`,

    .. math::
        \text{loss}(\theta) = c\,\mathrm{KL}(q_\theta\,\|\,p) - \bar\ell(\theta),
        \qquad c = \beta_{KL}/N,

    and its gradient :math:`\nabla_\theta\,\text{loss}`, computed together. The first call
    for an input signature (shapes, dtypes, device, which parameters take gradients, train or
    eval) records the whole step, the network's moments, the expected log-likelihood, the KL
    and autograd's backward through them (the library's closed-form backward Functions
    included), as **one** aten graph (:func:`torch.fx.experimental.proxy_tensor.make_fx`, with
    :func:`lightning_dvi.moments.policy.step_trace` on, so that the code takes the same
    trace-safe paths as under ``torch.compile``), and compiles that graph with inductor. Every
    later call is one compiled call: no autograd graph is built and no Python runs per op,
    which is what an eager step of a small network spends most of its time on
    (docs/speed_current.md). :math:`c` is an input of the graph, so a KL schedule never
    recompiles.

    The returned ``loss`` carries the gradients: an autograd node whose backward hands them
    out, so ``loss.backward()`` fills ``.grad`` as the eager step's would (to rounding), and
    Lightning's automatic optimisation, gradient clipping and L-BFGS closures work unchanged.
    ``expected_log_likelihood`` and ``kl`` come without gradient. The value checks run once per
    call, outside the graph, as in :class:`CompiledELBO`: the input and targets before, the
    loss's finiteness after (``check_finite``). Buffers the step writes (the empirical-Bayes
    prior's fitted variances, normalization statistics) are written as in the eager step.

    Deterministic modes only (``"full"``, ``"diag"``): a sampled step draws random numbers,
    which a traced graph would replay with inductor's generator; use :class:`CompiledELBO`
    there. With grad mode off (validation) the call runs the eager :func:`elbo`: there is no
    gradient to compute, and a second graph would cost a second compile.

    The graph is traced for the network, likelihood and prior as they are at the first call:
    their parameters and buffers are inputs (so training, ``load_state_dict`` and in-place
    changes are seen), but a changed Python setting (another likelihood, a layer added) needs a
    new :class:`CompiledStep`.

    Args:
        net: a :mod:`lightning_dvi.nn` network.
        likelihood: the observation model.
        prior: the weight prior.
        mode: ``"full"`` or ``"diag"`` (or their :class:`~lightning_dvi.propagation.Propagation`).
        compile_mode: :func:`torch.compile`'s own ``mode``, as for :class:`CompiledELBO`.
        **options: keyword arguments of :func:`torch.compile` for the traced graph (``backend``,
            ``mode``, ...), then compiled through :func:`torch.compile` (``fullgraph=True`` and
            ``dynamic=False`` unless given); without options, inductor compiles the graph
            directly (no Dynamo frame or guards per call).

    Raises:
        ValueError: for a sampled mode.

    Examples:
        >>> import torch
        >>> from lightning_dvi.compile import compile_step
        >>> from lightning_dvi.likelihoods import HeteroscedasticGaussian
        >>> from lightning_dvi.nn import mlp
        >>> from lightning_dvi.priors import EmpiricalBayes
        >>> net = mlp(3, [8], 2)
        >>> step = compile_step(net, HeteroscedasticGaussian(), EmpiricalBayes(), mode="diag",
        ...                     backend="eager")  # default: inductor; "eager" keeps it fast
        >>> x, y = torch.randn(16, 3), torch.randn(16)
        >>> step(x, y, num_data=100).loss.backward()
        >>> net[0].weight_loc.grad.shape
        torch.Size([8, 3])
    """

    def __init__(
        self,
        net: nn.Module,
        likelihood: Likelihood,
        prior: Prior,
        mode: Mode | Propagation = "full",
        *,
        compile_mode: str | None = None,
        **options: Any,
    ) -> None:
        self.propagation = propagation(mode, None)
        if self.propagation.samples:
            raise ValueError(
                f"CompiledStep traces the deterministic modes (full, diag), got mode "
                f"{self.propagation.name!r}; compile a sampled step with compile_elbo"
            )
        self.net, self.likelihood, self.prior = net, likelihood, prior
        self.mode = self.propagation.name
        self.options = _recorded_options(compile_mode, options)
        self._parts = _ELBOParts(net, likelihood, prior, self.propagation)
        self._slots: list[tuple[nn.Module, str, bool]] | None = None
        self._modules: list[nn.Module] = []
        self._graphs: dict[Hashable, tuple[Callable[..., Any], list[bool]]] = {}

    @property
    def graphs(self) -> int:
        """How many input signatures have been traced and compiled so far."""
        return len(self._graphs)

    def _tensors(self) -> list[Tensor]:
        """The parameters, then the buffers, of the network, likelihood and prior, as of now."""
        if self._slots is None:
            slots: list[tuple[nn.Module, str, bool]] = []
            for kind in ("_parameters", "_buffers"):
                seen: set[int] = set()
                for module in self._parts.modules():
                    for name, t in getattr(module, kind).items():
                        if t is not None and id(t) not in seen:
                            seen.add(id(t))
                            slots.append((module, name, kind == "_parameters"))
            self._slots = slots
            self._modules = list(self._parts.modules())
        return [
            (m._parameters if param else m._buffers)[name]  # type: ignore[misc]  # slots hold tensors
            for m, name, param in self._slots
        ]

    def _names(self) -> list[str]:
        assert self._slots is not None
        prefix = {id(m): n for n, m in self._parts.named_modules(remove_duplicate=False)}
        return [f"{prefix[id(m)]}.{name}" if prefix[id(m)] else name for m, name, _ in self._slots]

    def _trace(
        self, tensors: list[Tensor], x: Tensor, y: Tensor, coef: Tensor
    ) -> tuple[Callable[..., Any], list[bool]]:
        from torch.func import functional_call

        assert self._slots is not None
        names = self._names()
        wanted = [
            param and t.requires_grad for t, (_, _, param) in zip(tensors, self._slots, strict=True)
        ]
        used: list[bool] = []

        def step(*args: Tensor) -> tuple[Tensor, ...]:
            *flat, x, y, coef = args
            ell, kl = functional_call(self._parts, dict(zip(names, flat, strict=True)), (x, y))
            leaves = [t for t, w in zip(flat, wanted, strict=True) if w]
            grads = torch.autograd.grad(coef * kl - ell, leaves, allow_unused=True)
            used[:] = [g is not None for g in grads]
            return (ell.detach(), kl.detach(), *(g for g in grads if g is not None))

        leaves = [t.detach().requires_grad_(w) for t, w in zip(tensors, wanted, strict=True)]
        graph = _record(
            step, [*leaves, x, y, coef], "ELBO",
            "compile_elbo compiles it through torch.compile instead",
        )  # fmt: skip
        return _compile_recorded(graph, [*tensors, x, y, coef], self.options), used

    def __call__(
        self,
        x: Tensor,
        y: Tensor,
        num_data: int,
        kl_weight: float = 1.0,
        check_finite: bool = True,
    ) -> ELBOTerms:
        """Arguments and result as :func:`~lightning_dvi.objective.elbo` (see the class)."""
        tensors = self._tensors()
        if not torch.is_grad_enabled() or not any(
            param and t.requires_grad
            for t, (_, _, param) in zip(tensors, self._slots or [], strict=True)
        ):  # nothing to differentiate: the eager objective, without a second graph to compile
            return elbo(
                self.net, self.likelihood, self.prior, x, y, num_data, self.propagation,
                kl_weight=kl_weight, check_finite=check_finite,
            )  # fmt: skip
        check_arguments(num_data, kl_weight, x, y)
        if not isinstance(x, Tensor) or x.dim() < 1 or not x.dtype.is_floating_point:
            _check_input(x)  # raises
        # as in eager elbo: with check_finite, the loss's finite check stands in for the value
        # checks of x and y, which run only to name the cause of a non-finite loss
        with deferred_value_checks(check_finite):
            if not check_finite:
                _check_input(x)
            y = self.likelihood.validate_target(y, x.shape[0])
        dtype = next((t.dtype for t in tensors if t.is_floating_point()), x.dtype)
        coef = torch.full((), kl_weight / num_data, dtype=dtype, device=x.device)
        key = (
            x.shape, x.stride(), x.dtype, x.device, y.shape, y.stride(), y.dtype,
            tuple((t.shape, t.stride(), t.dtype, t.device, t.requires_grad) for t in tensors),
            tuple(m.training for m in self._modules),
        )  # fmt: skip
        compiled = self._graphs.get(key)
        if compiled is None:
            compiled = self._graphs[key] = self._trace(tensors, x, y, coef)
        fn, used = compiled
        with torch.no_grad():
            ell, kl, *grads = fn(*tensors, x, y, coef)
        try:
            terms = elbo_terms(ell, kl, num_data, kl_weight, self.propagation, check_finite)
        except FloatingPointError:
            _name_bad_values(self.likelihood, x, y)
            raise
        params = [
            t
            for t, (_, _, p) in zip(tensors, self._slots or [], strict=True)
            if p and t.requires_grad
        ]
        loss = _with_gradients(terms.loss, grads, used, params)
        return ELBOTerms(loss, terms.elbo, ell, kl, terms.kl_weight)


def compile_step(
    net: nn.Module,
    likelihood: Likelihood,
    prior: Prior,
    *,
    mode: Mode | Propagation = "full",
    **options: Any,
) -> CompiledStep:
    """A :class:`CompiledStep` (see there); ``options`` go to :func:`torch.compile`."""
    return CompiledStep(net, likelihood, prior, mode, **options)

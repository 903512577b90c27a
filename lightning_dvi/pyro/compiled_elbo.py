r"""CompiledDeterministicELBO: the DVI objective's value and gradient as one compiled graph.

The Pyro counterpart of :class:`lightning_dvi.compile.CompiledStep`, as Pyro's own
``JitTrace_ELBO`` is of ``Trace_ELBO``: the same objective as
:class:`~lightning_dvi.pyro.DeterministicELBO`, with the step recorded once per call signature
and compiled.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Hashable
from typing import Any

import pyro
import pyro.poutine as poutine
import torch
from pyro.poutine.messenger import Messenger
from pyro.poutine.runtime import _PYRO_STACK
from torch import Tensor, nn
from torch.distributions import transform_to
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..compile import (
    StepTraceError,
    _compile_recorded,
    _record,
    _recorded_options,
    _with_gradients,
)
from ..priors import EmpiricalBayes
from .elbo import DeterministicELBO
from .guide import DeterministicGuide

__all__ = ["CompiledDeterministicELBO"]

#: Python values a call signature may hold besides tensors (compared by value, baked into a graph).
_CONSTANTS = (type(None), bool, int, float, str)

#: At this many recorded signatures a CompiledDeterministicELBO warns (once) about recompiles.
_MANY_GRAPHS = 8


class _ParamValues(Messenger):
    """Answer ``pyro.param`` statements for the named parameters with the given values.

    ``values`` maps a param-store name to an *unconstrained* tensor; the statement returns
    ``transform_to(constraint)(value)``, as the param store does for its own tensors. The
    statement stops here: handlers outside the recording never see a traced value.
    """

    def __init__(self, values: dict[str, Tensor], constraints: dict[str, Any]) -> None:
        super().__init__()
        self.values, self.constraints = values, constraints

    def _pyro_param(self, msg: dict) -> None:
        name = msg["name"]
        if name in self.values:
            msg["value"] = transform_to(self.constraints[name])(self.values[name])
            msg["done"] = msg["stop"] = True


class CompiledDeterministicELBO(DeterministicELBO):
    r""":class:`~lightning_dvi.pyro.DeterministicELBO` with each step run as one compiled graph.

    The objective is DeterministicELBO's,

    .. math::
        \text{loss}(\phi) = -\Big(\sum_{\text{obs}} s\,\mathbb E_q\log p(y\mid f)
            - \sum_{\text{weights}} s\,\mathrm{KL}(q_\phi(w)\,\|\,p(w))\Big),

    and its gradient :math:`\nabla_\phi` loss with respect to the guide's unconstrained
    parameters :math:`\phi` (the param store's tensors, which the optimiser updates) is computed
    with it. The guide's first call sets it up, eagerly. After that, the first call of each
    *call signature* (the model and guide, the shape, dtype, stride and device of every tensor
    argument, the value of every other, and the modules' train/eval flags) runs the eager
    DeterministicELBO with every check and then records the step: the guide's moment pass, the
    model's moment pass, the expected log-likelihoods, the KL and autograd's backward through
    them, as **one** aten graph (:func:`torch.fx.experimental.proxy_tensor.make_fx` under
    :func:`lightning_dvi.moments.policy.step_trace`, with the parameters and tensor arguments
    as its inputs). Inductor compiles it. Every later call with that signature is one compiled
    call: no Pyro trace is built and no Python runs per op. A parameter that changed shape,
    dtype, device or ``requires_grad`` (or left the param store) makes the call record anew.

    The returned loss carries the gradients (the node of :class:`lightning_dvi.compile.
    CompiledStep`), so ``SVI(model, guide, optim, loss=CompiledDeterministicELBO())``, an
    L-BFGS closure over :meth:`differentiable_loss` and ``loss.backward()`` work as with the
    eager ELBO, to rounding. Inside an effect handler (``SVI.step``'s parameter capture) every
    parameter is announced with its ``pyro.param`` statement, as the eager step does.

    What is checked: the first call of a signature runs the eager ELBO, with all its checks
    (Pyro's site shapes, observed values). Later calls check the loss: when it is not finite
    the call returns the eager ELBO's result on the same arguments, which raises naming the
    site with a NaN or Inf observation when Pyro's validation is on, and otherwise warns as
    the eager ELBO does. An index the compiled graph finds out of range (a label) is named the
    same way. Each new signature costs a compile; at 8 of them a warning says so.

    Latents that are not weight sites (a noise scale with a Uniform or HalfNormal prior) are
    estimated by one reparameterised draw per step, as by the eager ELBO: the random op is part
    of the graph and draws from torch's generator at every call (inductor runs it through ATen,
    so from the same generator state a compiled and an eager step draw the same numbers; the
    recording itself consumes one draw).

    Limits, each refused with an error naming it:

    * parameters must be read through ``pyro.param`` statements (the guide's and
      ``PyroParam`` attributes of a ``PyroModule`` model are); a tensor that requires
      gradients read any other way (a plain ``nn.Parameter`` of the model, a ``pyro.module``
      network) would be baked into the graph as a constant, so it is refused;
    * Pyro's ``module_local_params`` setting is not supported.

    Arguments other than tensors and plain Python values (``None``, numbers, strings) make a
    call signature that cannot be compared: such calls run the eager ELBO (with a warning).

    One particle: the weights' part of the objective is exact, and a non-weight latent takes
    one draw per step (``DeterministicELBO(num_particles=...)`` averages several).

    Args:
        prior: as for :class:`~lightning_dvi.pyro.DeterministicELBO`.
        max_plate_nesting: as for :class:`~lightning_dvi.pyro.DeterministicELBO`.
        validate_every_step: as for :class:`~lightning_dvi.pyro.DeterministicELBO` (the
            eager call of a new signature).
        compile_mode: :func:`torch.compile`'s own ``mode``.
        **options: keyword arguments of :func:`torch.compile` (``backend``, ``mode``, ...);
            with any, the recorded graph is compiled through :func:`torch.compile`, else
            inductor compiles it directly (no Dynamo frame or guards per call).

    Raises:
        StepTraceError: (at the call that records) a step that cannot be recorded as one
            graph, or a model reading a trainable tensor without a ``pyro.param`` statement.
        NotImplementedError: with Pyro's ``module_local_params`` setting on.

    Examples:
        >>> # svi = SVI(model, DeterministicGuide(model), optim, CompiledDeterministicELBO())
    """

    def __init__(
        self,
        prior: EmpiricalBayes | None = None,
        max_plate_nesting: float = float("inf"),
        validate_every_step: bool = False,
        *,
        compile_mode: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            num_particles=1,
            prior=prior,
            max_plate_nesting=max_plate_nesting,
            validate_every_step=validate_every_step,
        )
        self.options = _recorded_options(compile_mode, options)
        self._graphs: dict[Hashable, _Recorded] = {}
        self._uncomparable_warned = False

    @property
    def graphs(self) -> int:
        """How many call signatures have been recorded and compiled so far."""
        return len(self._graphs)

    # ------------------------------------------------------------------ the call
    def differentiable_loss(self, model: Any, guide: Any, *args: Any, **kwargs: Any) -> Tensor:
        """The negative ELBO as a 0-dim tensor whose backward fills the parameters' ``.grad``."""
        if (
            not isinstance(guide, DeterministicGuide)
            or not torch.is_grad_enabled()
            or guide.prototype_trace is None  # the first call sets the guide (its modules) up
        ):
            return super().differentiable_loss(model, guide, *args, **kwargs)
        if pyro.settings.get("module_local_params"):
            raise NotImplementedError(
                "CompiledDeterministicELBO reads the guide's parameters from Pyro's param "
                "store; with pyro.settings module_local_params=True use DeterministicELBO"
            )
        leaves, spec = tree_flatten((args, kwargs))
        key = self._key(model, guide, leaves, spec)
        if key is None:
            return super().differentiable_loss(model, guide, *args, **kwargs)
        store = dict(pyro.get_param_store().named_parameters())
        recorded = self._graphs.get(key)
        params = None if recorded is None else recorded.current(store)
        if recorded is None or params is None:
            # the eager step sets the guide up, checks, and names the parameters it reads
            with poutine.trace(param_only=True) as trace:
                loss = super().differentiable_loss(model, guide, *args, **kwargs)
            names = [name for name, site in trace.trace.nodes.items() if site["type"] == "param"]
            self._graphs[key] = self._record(model, guide, names, leaves, spec)
            if len(self._graphs) == _MANY_GRAPHS:
                warnings.warn(
                    f"CompiledDeterministicELBO has recorded and compiled {_MANY_GRAPHS} call "
                    "signatures, each at the cost of a compile: the model, the guide or the "
                    "shapes of the arguments change from call to call (pad batches to one "
                    "size, or use DeterministicELBO)",
                    UserWarning,
                    stacklevel=2,
                )
            return loss
        return self._compiled_loss(recorded, params, model, guide, leaves, args, kwargs)

    def _key(self, model: Any, guide: Any, leaves: list[Any], spec: Any) -> Hashable | None:
        """The call signature, or ``None`` (with a warning, once) when it cannot be compared."""
        sig: list[Any] = []
        for leaf in leaves:
            if isinstance(leaf, Tensor):
                sig.append((leaf.shape, leaf.stride(), leaf.dtype, leaf.device, leaf.requires_grad))
            elif type(leaf) in _CONSTANTS:
                sig.append((type(leaf), leaf))
            else:
                if not self._uncomparable_warned:
                    self._uncomparable_warned = True
                    warnings.warn(
                        f"CompiledDeterministicELBO: an argument of type {type(leaf).__name__} "
                        "cannot be part of a compiled call signature; these calls run the eager "
                        "DeterministicELBO (pass tensors and plain Python values to compile)",
                        UserWarning,
                        stacklevel=3,
                    )
                return None
        flags = tuple(
            m.training for owner in (model, guide) if isinstance(owner, nn.Module)
            for m in owner.modules()
        )  # fmt: skip
        return (id(model), id(guide), str(spec), tuple(sig), flags)

    def _compiled_loss(
        self,
        recorded: _Recorded,
        params: list[Tensor],
        model: Any,
        guide: Any,
        leaves: list[Any],
        args: tuple,
        kwargs: dict,
    ) -> Tensor:
        tensors = [leaf for leaf in leaves if isinstance(leaf, Tensor)]
        try:
            with torch.no_grad():
                loss, *grads = recorded.fn(*params, *tensors)
        except RuntimeError:  # e.g. inductor's bounds check on an out-of-range label
            with torch.no_grad():
                super().differentiable_loss(model, guide, *args, **kwargs)  # names the cause
            raise
        if _PYRO_STACK:  # announce the parameters to the handlers (SVI's parameter capture)
            for name in recorded.names:
                pyro.param(name)
        if not math.isfinite(float(loss)):  # the eager step: with validation on it raises,
            return super().differentiable_loss(model, guide, *args, **kwargs)  # naming the site
        wanted = [p for p, w in zip(params, recorded.wanted, strict=True) if w]
        return _with_gradients(loss, grads, recorded.used, wanted)

    # ------------------------------------------------------------------ recording
    def _record(
        self, model: Any, guide: DeterministicGuide, names: list[str], leaves: list[Any], spec: Any
    ) -> _Recorded:
        store = pyro.get_param_store()
        # the store's own table (get_state() would also strip the live parameters' weakrefs)
        constraints = {name: store._constraints[name] for name in names}
        current = dict(store.named_parameters())
        params = [current[name] for name in names]
        wanted = [p.requires_grad for p in params]
        tensor_at = [i for i, leaf in enumerate(leaves) if isinstance(leaf, Tensor)]
        used: list[bool] = []

        def step(*inputs: Tensor) -> tuple[Tensor, ...]:
            values, tensors = inputs[: len(names)], inputs[len(names) :]
            call = list(leaves)
            for i, t in zip(tensor_at, tensors, strict=True):
                call[i] = t
            args, kwargs = tree_unflatten(call, spec)
            with (
                _ParamValues(dict(zip(names, values, strict=True)), constraints),
                pyro.validation_enabled(False),
            ):
                loss = DeterministicELBO._particle_loss(self, model, guide, args, kwargs)
            leaves_ = [v for v, w in zip(values, wanted, strict=True) if w]
            grads = torch.autograd.grad(loss, leaves_, allow_unused=True)
            used[:] = [g is not None for g in grads]
            return (loss.detach(), *(g for g in grads if g is not None))

        inputs = [p.detach().requires_grad_(w) for p, w in zip(params, wanted, strict=True)]
        tensors = [leaves[i] for i in tensor_at]
        graph = _record(step, [*inputs, *tensors], "DeterministicELBO", "use DeterministicELBO")
        _refuse_trainable_constants(graph)
        return _Recorded(_compile_recorded(graph, [*params, *tensors], self.options), names,
                         params, used)  # fmt: skip


class _Recorded:
    """One compiled step: the function, the parameters it takes, and which gradients it returns.

    ``wanted``: which parameters take gradients; ``used``: which of those the step reaches.
    """

    def __init__(
        self, fn: Callable[..., Any], names: list[str], params: list[Tensor], used: list[bool]
    ) -> None:
        self.fn, self.names, self.used = fn, names, used
        self.wanted = [p.requires_grad for p in params]
        self._meta = [_meta(p) for p in params]

    def current(self, store: dict[str, Tensor]) -> list[Tensor] | None:
        """The param store's tensors for this graph, or ``None`` if one is gone or changed."""
        params = [store.get(name) for name in self.names]
        if any(p is None or _meta(p) != m for p, m in zip(params, self._meta, strict=True)):
            return None
        return params  # type: ignore[return-value]  # no None left


def _meta(t: Tensor) -> tuple[Any, ...]:
    """What a graph input's tensor must keep: shape, stride, dtype, device, requires_grad."""
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _refuse_trainable_constants(graph: torch.fx.GraphModule) -> None:
    """Refuse a graph whose results depend on a tensor requiring gradients held as a constant.

    Dead code goes first (inductor would drop it too): a declared network's own posterior
    scales, computed but unused while a :class:`~lightning_dvi.pyro.PyroBayesNet` takes the
    guide's moments, are no reason to refuse.
    """
    graph.graph.eliminate_dead_code()
    graph.recompile()
    for node in graph.graph.nodes:
        if node.op == "get_attr":
            value = getattr(graph, node.target)
            if isinstance(value, Tensor) and (
                value.requires_grad or isinstance(value, nn.Parameter)
            ):
                raise StepTraceError(
                    f"the model reads a tensor of shape {tuple(value.shape)} that requires "
                    "gradients without a pyro.param statement (a plain nn.Parameter or a "
                    "pyro.module network): the recorded step would hold it as a constant and "
                    "never train it. Declare it as a PyroParam, or use DeterministicELBO"
                )

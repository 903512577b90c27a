r"""Export the one-pass predictive of a declared network as a plain torch module (and a file).

:func:`export_predictive` wraps a trained network and its likelihood in a
:class:`PredictiveModule`: ``x -> (mean, var)`` (regression, in the original units of ``y``) or
``x -> probs`` (classification), one deterministic moment pass in ``diag`` or ``full`` mode,
no sampling. :meth:`PredictiveModule.save` writes it with ``torch.export`` (``.pt2``) or the
ONNX exporter (``.onnx``, ``torch.onnx.export(..., dynamo=True)``; needs the ``export`` extra:
``onnx``, ``onnxruntime``, ``onnxscript``). The saved file is a traced graph of torch (or ONNX)
operators: loading and running it needs torch (``torch.export.load``) or onnxruntime only, not
lightning_dvi.

Heads (``likelihood``): each likelihood owns its exported predictive
(:meth:`~lightning_dvi.likelihoods.Likelihood.export_head`, as it owns ``predictive``); this
module only asks for it. ``None`` gives the network's output moments ``(mean [B, D], var [B, D])``.
The built-in heads:

* :class:`~lightning_dvi.likelihoods.HomoscedasticGaussian`: ``mean = m``,
  ``var = Σ_mm + e^λ`` (``[B]`` each).
* :class:`~lightning_dvi.likelihoods.HeteroscedasticGaussian`: ``mean = ⟨m⟩``,
  ``var = Σ_mm + exp(⟨ℓ⟩ + Σ_ℓℓ/2)``: the moments of
  :class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive`, whose density has heavier
  tails than the Gaussian with these moments. The exported module serves the moments only;
  the exact log density is ``DVIRegressor.predictive_log_prob`` (or
  :func:`~lightning_dvi.likelihoods.functional.heteroscedastic_predictive_log_prob` on the
  network's output).
* :class:`~lightning_dvi.likelihoods.Categorical` (any method but ``"mc"``): the
  closed-form class probabilities ``[B, K]`` of
  :func:`~lightning_dvi.likelihoods.predictive.categorical_predictive` (the library's
  predictive), tempered by a classifier's ``predictive_temperature`` when it is not 1.

* :class:`~lightning_dvi.likelihoods.Bernoulli`: class probabilities ``[B, 2]``,
  :math:`(1 - \bar p, \bar p)` with :math:`\bar p = \mathbb E\,\sigma(f)`, tempered likewise.
* :class:`~lightning_dvi.likelihoods.Poisson`: ``mean = e^{⟨f⟩ + Σ_ff/2}``,
  ``var = mean + (e^{Σ_ff} - 1) mean²`` (the Poisson log-normal predictive, in counts).

A likelihood without a deterministic predictive raises the base class's ``ValueError``.

The ``.onnx`` file lowers ``erfc``, ``ndtr``, ``log_ndtr`` and ``erfcx`` by tail-safe formulas
(:func:`onnx_translations`): the exporter's own lowerings lose the tails, and onnxruntime
returned NaN for a confident classifier's ``log Φ``.

Regression moments are mapped to the original units with ``target_loc``/``target_scale``
(``mean * scale + loc``, ``var * scale²``), read from the outcome transform
(:class:`~lightning_dvi.transforms.Standardize`) of a model that hands over its parts
(:class:`ProvidesPredictive`, as ``DVIRegressor`` and ``DVIClassifier`` do).
"""

from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..likelihoods import ExportOptions, Likelihood, PredictiveHead
from ..propagation import moment_propagation
from ..transforms import Standardize
from .base import BayesModule

__all__ = [
    "PredictiveModule",
    "PredictiveParts",
    "ProvidesPredictive",
    "export_predictive",
    "onnx_translations",
]

ExportMode = Literal["diag", "full"]


@dataclass(frozen=True)
class PredictiveParts:
    """What a trained model hands to :func:`export_predictive`.

    Attributes:
        net: the declared network.
        likelihood: its observation model (it builds the exported head).
        outcome_transform: the map of regression targets back to their original units, or
            ``None`` (the network's units are the targets').
        temperature: a classifier's predictive temperature (1: untempered).
    """

    net: nn.Module
    likelihood: Likelihood
    outcome_transform: Standardize | None = None
    temperature: float = 1.0


@runtime_checkable
class ProvidesPredictive(Protocol):
    """A model over a declared network that hands its parts to :func:`export_predictive`."""

    def predictive_parts(self) -> PredictiveParts:
        """The network, likelihood, outcome transform and temperature to export."""
        ...


class _MomentsHead(PredictiveHead):
    """No likelihood: the network's output moments ``(mean [B, D], var [B, D])``."""

    name = "moments"

    def forward(self, out: Gaussian) -> tuple[Tensor, Tensor]:
        return out.mean, out.var


class PredictiveModule(nn.Module):
    """A frozen network plus likelihood head: ``forward(x)`` is the one-pass predictive.

    Built by :func:`export_predictive`; see there. Parameters are frozen copies (later training
    of the source network does not change it).

    Args:
        net: the declared network (frozen).
        head: the likelihood's exported predictive
            (:meth:`~lightning_dvi.likelihoods.Likelihood.export_head`).
        mode: ``"diag"`` or ``"full"``.
        input_loc: subtracted from ``x`` before the network.
        input_scale: divides ``x - input_loc``. With neither, ``x`` goes to the network as
            it is (a :class:`~lightning_dvi.nn.LastLayerNetwork` takes integer token ids).

    Attributes:
        head: the :class:`~lightning_dvi.likelihoods.PredictiveHead` (its ``name``:
            ``"moments"``, ``"homoscedastic"``, ``"heteroscedastic"``, ``"categorical"``, ...).
        mode: ``"diag"`` or ``"full"``.
    """

    input_loc: Tensor
    input_scale: Tensor

    def __init__(
        self,
        net: BayesModule,
        head: PredictiveHead,
        mode: ExportMode,
        input_loc: Tensor | None = None,
        input_scale: Tensor | None = None,
    ) -> None:
        super().__init__()
        self.net = net
        self.head = head
        self.mode = mode
        dtype = next(net.parameters()).dtype
        # no standardisation asked: x goes in untouched (integer token ids stay integers for a
        # last-layers network's plain-torch backbone)
        self.standardize = input_loc is not None or input_scale is not None
        loc = torch.zeros((), dtype=dtype) if input_loc is None else input_loc
        scale = torch.ones((), dtype=dtype) if input_scale is None else input_scale
        self.register_buffer("input_loc", torch.as_tensor(loc).detach().clone().to(dtype))
        self.register_buffer("input_scale", torch.as_tensor(scale).detach().clone().to(dtype))

    def forward(self, x: Tensor) -> Any:
        """Predictive of ``x [B, D_in]``: ``(mean, var)`` or class probabilities ``[B, K]``."""
        if self.standardize:
            x = (x - self.input_loc) / self.input_scale
        out = self.net.propagate(x, moment_propagation(self.mode))
        if not isinstance(out, Gaussian):
            raise ValueError("the network output is deterministic: it has no BayesLinear layer")
        return self.head(out)

    def export(self, example: Tensor) -> torch.export.ExportedProgram:
        """Trace with ``torch.export`` (batch dimension dynamic where the kernels allow it).

        Full mode with ReLU layers specialises the batch size (the ReLU covariance kernel picks
        its block sizes from it): the program then accepts that batch size only.
        """
        dims = {"x": {0: torch.export.Dim.AUTO}}
        with torch.no_grad():
            return torch.export.export(self, (example,), dynamic_shapes=dims)

    def save(self, path: str | os.PathLike[str], example: Tensor) -> None:
        """Write ``path``: ``.pt2`` (``torch.export.save``) or ``.onnx`` (ONNX, dynamo exporter).

        Raises:
            ValueError: on another suffix.
            ImportError: for ``.onnx`` without ``onnx``/``onnxscript`` installed.
        """
        path = os.fspath(path)
        if path.endswith(".pt2"):
            torch.export.save(self.export(example), path)
        elif path.endswith(".onnx"):
            try:
                import onnx  # noqa: F401
                import onnxscript  # noqa: F401
            except ImportError as err:
                raise ImportError(
                    "ONNX export needs the optional `export` extra: "
                    "pip install 'lightning_dvi[export]' (onnx, onnxruntime, onnxscript)"
                ) from err
            dims = {"x": {0: torch.export.Dim.AUTO}}
            with torch.no_grad():
                torch.onnx.export(
                    self,
                    (example,),
                    path,
                    dynamo=True,
                    dynamic_shapes=dims,
                    verbose=False,
                    custom_translation_table=onnx_translations(),
                )
        else:
            raise ValueError(f"unknown export format for {path!r}: use a .pt2 or .onnx suffix")

    def extra_repr(self) -> str:
        """Head and mode."""
        return f"head={self.head.name!r}, mode={self.mode!r}"


# Numerical Recipes' erfc (``erfcc``): erfcx(a) = tau exp(P(tau)), tau = 1 / (1 + a/2), a >= 0,
# relative error below 1.2e-7 for every a (measured: 1.07e-7 against scipy's erfcx).
_ERFCX_COEFFS = (
    -1.26551223,
    1.00002368,
    0.37409196,
    0.09678418,
    -0.18628806,
    0.27886807,
    -1.13520398,
    1.48851587,
    -0.82215223,
    0.17087277,
)


def onnx_translations() -> dict[Any, Any]:
    r"""Numerically safe ONNX lowerings of the normal tail functions, for ``torch.onnx.export``.

    The ONNX exporter lowers ``erfc`` to ``1 - Erf`` (zero beyond :math:`x\approx 4` in
    float32: no tail) and ``special_log_ndtr`` by a decomposition whose ``erfcx`` overflows
    (``inf * 0``): onnxruntime returns NaN for :math:`\log\Phi(x)` below :math:`x\approx -13`,
    the logit gaps of every confident classifier. :meth:`PredictiveModule.save` passes these
    instead (``custom_translation_table``). Each is written in the tail's own scale, with
    :math:`a = |x|/\sqrt2`, :math:`\tau = 1/(1 + a/2)` and the scaled complementary error
    function :math:`\operatorname{erfcx}(a) = e^{a^2}\operatorname{erfc}(a) \approx
    \tau e^{P(\tau)}` (Numerical Recipes' ``erfcc``: a degree-9 polynomial :math:`P`, relative
    error below :math:`1.2\cdot10^{-7}` for every :math:`a \ge 0`):

    * :math:`\log\Phi(x) = \log(\tau/2) + P(\tau) - a^2` for :math:`x < 0` (no exponential:
      finite down to :math:`-\sqrt{2\cdot\text{max}}`), and
      :math:`\operatorname{log1p}(-q)`, :math:`q = \tfrac\tau2 e^{P(\tau) - a^2}`, for
      :math:`x \ge 0` (``log1p`` by :math:`\log(w)\,(-q)/(w - 1)`, :math:`w = 1 - q`: full
      relative precision at small :math:`q`, and ONNX has no ``Log1p``);
    * :math:`\operatorname{erfc}(x) = \tau e^{P(\tau) - x^2}` for :math:`x \ge 0`, :math:`2 -`
      that of :math:`-x` below; :math:`\Phi(x) = \tfrac12\operatorname{erfc}(-x/\sqrt2)`;
      :math:`\operatorname{erfcx}(x) = \tau e^{P(\tau)}` for :math:`x \ge 0`,
      :math:`2e^{x^2} - \operatorname{erfcx}(-x)` below.

    The math is unchanged (the same functions, to the polynomial's :math:`1.2\cdot10^{-7}`, far
    below float32's :math:`10^{-5}`-level agreement with torch); constants are float64 cast to
    the input's dtype.

    Returns:
        ``{torch op overload: onnxscript trace function}`` for ``custom_translation_table``.

    Raises:
        ImportError: without ``onnxscript`` (the ``export`` extra).
    """
    import numpy as np
    import onnx_ir as ir
    import onnxscript

    # trace functions: the exporter calls them with its graph values, not typed onnxscript tensors
    op: Any = onnxscript.opset18

    def const(value: float, like: Any) -> Any:
        return op.CastLike(op.Constant(value=ir.tensor(np.array(value, dtype=np.float64))), like)

    def tail(x: Any, scale: float) -> tuple[Any, Any]:
        """``a = |x| * scale`` and ``log erfcx(a)``."""
        a = op.Mul(op.Abs(x), const(scale, x))
        tau = op.Reciprocal(op.Add(op.Mul(a, const(0.5, x)), const(1.0, x)))
        poly = const(_ERFCX_COEFFS[-1], x)
        for c in reversed(_ERFCX_COEFFS[:-1]):
            poly = op.Add(op.Mul(poly, tau), const(c, x))
        return a, op.Add(op.Log(tau), poly)

    def erfc_of_abs(x: Any, scale: float) -> Any:
        """``erfc(|x| * scale)``, full relative precision in the tail."""
        a, log_erfcx = tail(x, scale)
        return op.Exp(op.Sub(log_erfcx, op.Mul(a, a)))

    def erfc(x: Any) -> Any:
        upper = erfc_of_abs(x, 1.0)
        return op.Where(op.Less(x, const(0.0, x)), op.Sub(const(2.0, x), upper), upper)

    def ndtr(x: Any) -> Any:
        tail_half = op.Mul(erfc_of_abs(x, math.sqrt(0.5)), const(0.5, x))  # Phi(-|x|)
        upper = op.Sub(const(1.0, x), tail_half)
        return op.Where(op.Less(x, const(0.0, x)), tail_half, upper)

    def log_ndtr(x: Any) -> Any:
        a, log_erfcx = tail(x, math.sqrt(0.5))
        log_tail = op.Sub(op.Add(log_erfcx, const(math.log(0.5), x)), op.Mul(a, a))
        q = op.Exp(log_tail)  # Phi(-|x|)
        w = op.Sub(const(1.0, x), q)
        rounds_to_one = op.Equal(w, const(1.0, x))
        denom = op.Where(rounds_to_one, const(-1.0, x), op.Sub(w, const(1.0, x)))
        log1p = op.Div(op.Mul(op.Log(w), op.Neg(q)), denom)
        upper = op.Where(rounds_to_one, op.Neg(q), log1p)
        return op.Where(op.Less(x, const(0.0, x)), log_tail, upper)

    def erfcx(x: Any) -> Any:
        a, log_erfcx = tail(x, 1.0)
        upper = op.Exp(log_erfcx)
        lower = op.Sub(op.Mul(const(2.0, x), op.Exp(op.Mul(a, a))), upper)
        return op.Where(op.Less(x, const(0.0, x)), lower, upper)

    aten = torch.ops.aten
    return {
        aten.erfc.default: erfc,
        aten.special_erfc.default: erfc,
        aten.special_ndtr.default: ndtr,
        aten.special_log_ndtr.default: log_ndtr,
        aten.special_erfcx.default: erfcx,
    }


def export_predictive(
    net: nn.Module,
    likelihood: Likelihood | None = None,
    mode: ExportMode = "diag",
    *,
    target_loc: float | None = None,
    target_scale: float | None = None,
    input_loc: Tensor | None = None,
    input_scale: Tensor | None = None,
) -> PredictiveModule:
    r"""The one-pass predictive of ``net`` (and ``likelihood``) as a plain torch module.

    Args:
        net: a declared network (:class:`~lightning_dvi.nn.BayesModule`), or a model that
            hands over its parts (:class:`ProvidesPredictive`: ``DVIRegressor``,
            ``DVIClassifier``); its outcome transform's location and scale are used unless
            given here.
        likelihood: the observation model giving the head (see the module docstring); ``None``
            returns the output moments. Ignored when ``net`` carries its own.
        mode: ``"diag"`` (dDVI, two matmuls a layer) or ``"full"`` (full covariance).
        target_loc: regression targets' mean (original units), default 0.
        target_scale: regression targets' std, default 1.
        input_loc: subtracted from ``x`` before the network (e.g. the training features'
            means, so the served model takes raw features); default 0.
        input_scale: divides ``x - input_loc`` (e.g. the features' stds); default 1.

    Returns:
        A :class:`PredictiveModule` in eval mode with frozen parameters.

    Raises:
        ValueError: on a bad mode, a non-declared network, a Monte Carlo categorical likelihood
            or an unknown likelihood.

    Examples:
        >>> from lightning_dvi.nn import mlp
        >>> from lightning_dvi.likelihoods import HeteroscedasticGaussian
        >>> predictive = export_predictive(mlp(3, [8], 2), HeteroscedasticGaussian(), mode="full")
        >>> mean, var = predictive(torch.randn(4, 3))
        >>> tuple(mean.shape), bool((var > 0).all())
        ((4,), True)
    """
    moment_propagation(mode, " for a one-pass predictive")
    temperature = 1.0
    if isinstance(net, ProvidesPredictive):
        parts = net.predictive_parts()
        likelihood, temperature = parts.likelihood, float(parts.temperature)
        transform = parts.outcome_transform
        if transform is not None:
            target_loc = float(transform.loc) if target_loc is None else target_loc
            target_scale = float(transform.scale) if target_scale is None else target_scale
        net = parts.net
    if not isinstance(net, BayesModule):
        raise ValueError(
            f"export_predictive needs a lightning_dvi.nn network, got {type(net).__name__} "
            "(convert a torch network with lightning_dvi.nn.from_torch first)"
        )
    frozen = copy.deepcopy(net).eval()
    for p in frozen.parameters():
        p.requires_grad_(False)
    dtype = next(frozen.parameters()).dtype
    head = (
        _MomentsHead()
        if likelihood is None
        else likelihood.export_head(
            ExportOptions(
                target_loc=0.0 if target_loc is None else float(target_loc),
                target_scale=1.0 if target_scale is None else float(target_scale),
                temperature=temperature,
                dtype=dtype,
            )
        )
    )
    module = PredictiveModule(frozen, head, mode, input_loc, input_scale)
    return module.eval()

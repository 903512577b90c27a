"""Base class shared by every declared BNN module."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian, Mode, all_finite, validate_mode
from ..moments.layers import as_storage

__all__ = ["BayesModule", "Moments"]

Moments = Tensor | Gaussian
"""What flows between modules: a tensor (deterministic input or samples) or a Gaussian."""


class BayesModule(nn.Module):
    """A module that propagates moments (``full``/``diag``) or samples (``sample``/``local``).

    Subclasses implement :meth:`propagate` and :meth:`propagate_cross`. Users call the module:

    * ``net(x, mode="full" | "diag")`` returns a :class:`~lightning_dvi.Gaussian` (or a tensor if
      the module is deterministic, e.g. an activation applied to a tensor);
    * ``net(x, mode="sample" | "local", num_samples=S)`` returns a tensor ``[S, B, D_out]``.

    In the Monte Carlo modes the input ``x [B, D]`` is expanded to ``[S, B, D]`` once, at the
    outermost call, and every nested module works on the sample dimension in one batched op.

    In ``full`` mode a Gaussian whose covariance is exactly diagonal travels between modules in
    diag storage (a first layer fed a deterministic input, and the activation after it), which
    skips the :math:`O(D^3)` work on zeros; the outermost call returns full storage, except
    from modules whose output is per-pixel (``image_output``: convolutions and pooling, whose
    full covariance is never formed; see :mod:`lightning_dvi.nn.conv`).
    """

    @property
    def image_output(self) -> bool | None:
        """Whether the output is an image Gaussian ``[B, C, H, W]``, kept diag in full mode.

        ``None``: elementwise, the output is whatever the input was. A subclass overrides it
        with a class attribute (convolutions and pooling: ``True``) or a property (containers).
        """
        return False

    accepts_integer_input: bool = False
    """Whether the module's input may be integer ids (a network whose first layer is an
    embedding table); integer inputs are refused otherwise."""

    def forward(self, x: Moments, mode: Mode = "full", num_samples: int | None = None) -> Moments:
        """Propagate ``x`` through the module.

        Args:
            x: input tensor ``[B, D_in]`` (or ``[..., D_in]``), or a :class:`Gaussian` in the
                moment modes.
            mode: ``"full"``, ``"diag"``, ``"sample"`` or ``"local"``.
            num_samples: number of weight samples S for ``sample``/``local`` (default 1).

        Raises:
            ValueError: on an unknown mode, NaN/Inf inputs, a Gaussian input to a Monte Carlo
                mode, or a non-positive ``num_samples``.
        """
        validate_mode(mode)
        integer_ok = self.accepts_integer_input
        out = self.propagate(prepare_input(x, mode, num_samples, integer_ok), mode)
        return out if mode in ("sample", "local") else finish(out, mode, self)

    def propagate(self, x: Moments, mode: Mode) -> Moments:  # pragma: no cover - abstract
        """Propagate without input checks; ``x`` is ``[S, B, D]`` in the Monte Carlo modes."""
        raise NotImplementedError

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Mode) -> Tensor:
        r"""Map :math:`\operatorname{Cov}(r, \text{input})` to :math:`\operatorname{Cov}(r, \text{output})`.

        Used by :class:`~lightning_dvi.nn.Residual` for the skip-connection cross-covariance.
        ``cross`` is ``[..., D_r, D_in]`` and ``x`` is this module's input Gaussian.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot be used inside a Residual block (no cross-covariance rule)"
        )

    def propagate_with_cross(
        self, cross: Tensor, x: Gaussian, mode: Mode
    ) -> tuple[Tensor, Moments]:
        r"""``(Cov(r, output), output)`` in one pass: :meth:`propagate_cross` and :meth:`propagate`.

        Containers override it so that a branch is walked once however deeply skip
        connections nest; a layer needs only the two methods above.
        """
        return self.propagate_cross(cross, x, mode), self.propagate(x, mode)


def prepare_input(
    x: Moments, mode: Mode, num_samples: int | None, integer_ok: bool = False
) -> Moments:
    """Check an input of :meth:`BayesModule.forward`; in the Monte Carlo modes expand it to ``[S, ...]``.

    Args:
        x: the input.
        mode: the (validated) mode.
        num_samples: ``S`` of the Monte Carlo modes.
        integer_ok: also accept integer tensors (token ids, indices): for a network whose
            first stage is plain torch (``from_torch(model, last_layers=k)``'s backbone), which
            takes whatever the torch model took.

    Raises:
        ValueError: as :meth:`BayesModule.forward` (``mode`` is already validated).
    """
    if isinstance(x, Gaussian):
        if mode in ("sample", "local"):
            raise ValueError(f"mode={mode!r} needs a tensor input, got a Gaussian")
        return x
    if not isinstance(x, Tensor):
        raise ValueError(f"input must be a tensor or a Gaussian, got {type(x).__name__}")
    integer = not x.dtype.is_floating_point and not x.is_complex() and x.dtype != torch.bool
    if x.dim() < 1 or not (x.dtype.is_floating_point or (integer_ok and integer)):
        hint = (
            " (integer inputs such as token ids need a plain-torch first stage: convert the "
            "model with from_torch(model, last_layers=k), which keeps an nn.Embedding in its "
            "backbone)"
            if integer
            else ""
        )
        raise ValueError(
            f"input must be a floating tensor [..., D], got {x.dtype} {tuple(x.shape)}{hint}"
        )
    # A host read: skipped while torch.compile traces (it would split the graph);
    # lightning_dvi.compile runs it once per call outside the compiled region.
    if not integer and not all_finite(x):
        raise ValueError("input contains NaN or Inf")
    if mode in ("sample", "local"):
        s = 1 if num_samples is None else num_samples
        if not isinstance(s, int) or s < 1:
            raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")
        return x.unsqueeze(0).expand(s, *x.shape)
    if num_samples is not None:
        raise ValueError(f"num_samples is only used by mode='sample'/'local', not {mode!r}")
    return x


def as_mode(g: Gaussian, mode: Mode) -> Gaussian:
    """Convert ``g`` to the storage kind that ``mode`` asks for (:func:`moments.as_storage`)."""
    return as_storage(g, mode)


def finish(out: Moments, mode: Mode, module: BayesModule) -> Moments:
    """The outermost call's output: full storage in ``full`` mode (see :class:`BayesModule`)."""
    # In full mode, modules pass a diag Gaussian along while its covariance is *exactly*
    # diagonal (deterministic input -> first linear layer -> activation); users asked for
    # mode="full" get a full covariance back.
    if mode == "full" and isinstance(out, Gaussian) and not module.image_output:
        return out.to_full()
    return out

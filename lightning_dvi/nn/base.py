"""Base class shared by every declared BNN module."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from .._checks import value_checks_enabled
from ..gaussian import Gaussian, all_finite
from ..moments.layers import as_storage
from ..propagation import DIAG, Mode, MomentPass, Propagation, SamplePass, propagation
from .posterior import ParameterGroup, substituted

__all__ = ["BayesModule", "Moments", "WeightLayer"]

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

    def forward(
        self, x: Moments, mode: Mode | Propagation = "full", num_samples: int | None = None
    ) -> Moments:
        """Propagate ``x`` through the module.

        Args:
            x: input tensor ``[B, D_in]`` (or ``[..., D_in]``), or a :class:`Gaussian` in the
                moment modes.
            mode: ``"full"``, ``"diag"``, ``"sample"`` or ``"local"``, or a
                :class:`~lightning_dvi.propagation.Propagation` value (resolved once here by
                :func:`~lightning_dvi.propagation.propagation`; nested modules get the value).
            num_samples: number of weight samples S for ``sample``/``local`` (default 1).

        Raises:
            ValueError: on an unknown mode, NaN/Inf inputs, a Gaussian input to a Monte Carlo
                mode, or a non-positive ``num_samples``.
        """
        how = propagation(mode, num_samples)
        out = self.propagate(prepare_input(x, how, self.accepts_integer_input), how)
        return finish(out, how, self)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:  # pragma: no cover - abstract
        """Propagate without input checks; ``x`` is ``[S, B, D]`` in the Monte Carlo modes."""
        raise NotImplementedError

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        r"""Map :math:`\operatorname{Cov}(r, \text{input})` to :math:`\operatorname{Cov}(r, \text{output})`.

        Used by :class:`~lightning_dvi.nn.Residual` for the skip-connection cross-covariance.
        ``cross`` is ``[..., D_r, D_in]`` and ``x`` is this module's input Gaussian.
        """
        raise NotImplementedError(
            f"{type(self).__name__} cannot be used inside a Residual block (no cross-covariance rule)"
        )

    def propagate_with_cross(
        self, cross: Tensor, x: Gaussian, mode: Propagation
    ) -> tuple[Tensor, Moments]:
        r"""``(Cov(r, output), output)`` in one pass: :meth:`propagate_cross` and :meth:`propagate`.

        Containers override it so that a branch is walked once however deeply skip
        connections nest; a layer needs only the two methods above.
        """
        return self.propagate_cross(cross, x, mode), self.propagate(x, mode)


class WeightLayer(BayesModule):
    r"""A layer with a weight posterior: it writes its moments and its given-weights path.

    A subclass implements three things:

    * :meth:`parameter_groups` (:class:`~lightning_dvi.nn.HasPosterior`): its weight groups'
      posterior means and scales, which the KL, empirical Bayes and the Pyro guide read;
    * :meth:`propagate_moments`: the output Gaussian over :math:`q(w)` for a deterministic
      input ``[B, ...]`` or an input Gaussian, in ``full`` or ``diag`` storage, reading the
      weights' moments through :func:`~lightning_dvi.nn.posterior_moments` (which honours a
      front-end's substitution);
    * :meth:`propagate_given`: the output for given weight *values*, ``{group: tensor}``.

    This class derives the rest (:meth:`propagate`):

    * ``sample``: draw the weights, :math:`w_s = \mu + \sigma\varepsilon_s` per sample
      (:meth:`draw_weights`), then the given-weights path;
    * ``local`` (local reparameterisation): the moments given each input row (the ``S`` draws
      of the input folded into the batch), then one draw :math:`m + \sqrt{v}\,\varepsilon`
      per output unit;
    * weights substituted by a front-end (a Pyro pass): values run the given-weights path in
      every mode, moments run the paths above with the substituted moments.

    A layer whose draws are not independent per weight (a full-covariance posterior) overrides
    :meth:`propagate_samples` or :meth:`propagate_local`; :meth:`check_input` may refuse an
    input before any path runs.
    """

    def parameter_groups(self) -> list[ParameterGroup]:  # pragma: no cover - abstract
        """The weight groups of the posterior (:class:`~lightning_dvi.nn.HasPosterior`)."""
        raise NotImplementedError

    def propagate_moments(self, x: Tensor | Gaussian, mode: MomentPass) -> Gaussian:
        """The output Gaussian over the weight posterior (``x [B, ...]`` a tensor or a Gaussian)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def propagate_given(self, x: Tensor, weights: Mapping[str, Tensor]) -> Tensor:
        """The output for weight values: ``x [S, B, ...]``, each ``weights[g]`` ``[*shape]`` or ``[S, *shape]``."""
        raise NotImplementedError  # pragma: no cover - abstract

    def check_input(self, x: Moments, mode: Propagation) -> None:
        """Refuse an input the layer cannot take (default: accept; called once per pass)."""

    def draw_weights(self, num_samples: int, like: Tensor) -> dict[str, Tensor]:
        r"""``num_samples`` independent draws of each group, ``{group: [S, *shape]}``.

        :math:`\mu + \sigma\varepsilon` with the posterior's scales, or the substituted
        moments' :math:`\sqrt{v}`; the noise is drawn group by group in their order.
        """
        given = substituted(self)
        if given is not None:
            pairs = {
                name: (loc, var.sqrt()) for name, (loc, var) in given.items() if var is not None
            }
        else:
            pairs = {g.name: (g.loc, g.scale) for g in self.parameter_groups()}
        return {
            name: loc
            + scale * torch.randn(num_samples, *loc.shape, dtype=like.dtype, device=like.device)
            for name, (loc, scale) in pairs.items()
        }

    def propagate_samples(self, x: Tensor) -> Tensor:
        """``sample``: one draw of the whole weights per sample, then the given-weights path."""
        return self.propagate_given(x, self.draw_weights(x.shape[0], x))

    def propagate_local(self, x: Tensor) -> Tensor:
        """``local``: the output moments given each row of ``x [S, B, ...]``, then one draw."""
        g = self.propagate_moments(x.flatten(0, 1), DIAG)
        # a unit with no variance (a zero input to a gain) draws its mean with a finite gradient
        std = g.var.clamp_min(torch.finfo(g.var.dtype).tiny).sqrt()
        out: Tensor = (g.mean + std * torch.randn_like(g.mean)).unflatten(0, x.shape[:2])
        return out

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """The output in ``mode``, derived from the layer's two paths (see the class docstring)."""
        self.check_input(x, mode)
        # only weights a front-end substituted can be values (no variance): the posterior's own
        # moments are read once, by the path below, not here as well
        moments = substituted(self)
        if moments is not None and any(var is None for _, var in moments.values()):
            if isinstance(x, Gaussian):
                raise ValueError("weight values (not moments) need a tensor input, got a Gaussian")
            values = {name: loc for name, (loc, _) in moments.items()}
            if mode.samples:
                return self.propagate_given(x, values)
            return self.propagate_given(x.unsqueeze(0), values).squeeze(0)
        if isinstance(mode, SamplePass):  # BayesModule.forward hands these modes a tensor
            assert isinstance(x, Tensor)
            return self.propagate_local(x) if mode.local else self.propagate_samples(x)
        assert isinstance(mode, MomentPass)
        return self.propagate_moments(x, mode)


def prepare_input(x: Moments, mode: Propagation, integer_ok: bool = False) -> Moments:
    """Check an input of :meth:`BayesModule.forward`; in the Monte Carlo modes expand it to ``[S, ...]``.

    Args:
        x: the input.
        mode: the propagation (checked, with its ``num_samples``, when it was built).
        integer_ok: also accept integer tensors (token ids, indices): for a network whose
            first stage is plain torch (``from_torch(model, last_layers=k)``'s backbone), which
            takes whatever the torch model took.

    Raises:
        ValueError: as :meth:`BayesModule.forward`.
    """
    if isinstance(x, Gaussian):
        if mode.samples:
            raise ValueError(f"mode={mode.name!r} needs a tensor input, got a Gaussian")
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
    # lightning_dvi.compile runs it once per call outside the compiled region. Inside the ELBO
    # (lightning_dvi._checks) the loss's finite check covers it, and names it on failure.
    if not integer and value_checks_enabled() and not all_finite(x):
        raise ValueError("input contains NaN or Inf")
    if isinstance(mode, SamplePass):
        return x.unsqueeze(0).expand(mode.num_samples, *x.shape)
    return x


def as_mode(g: Gaussian, mode: Propagation) -> Gaussian:
    """Convert ``g`` to the storage kind that ``mode`` asks for (:func:`moments.as_storage`)."""
    return as_storage(g, mode)


def finish(out: Moments, mode: Propagation, module: BayesModule) -> Moments:
    """The outermost call's output: full storage in ``full`` mode (see :class:`BayesModule`)."""
    # In full mode, modules pass a diag Gaussian along while its covariance is *exactly*
    # diagonal (deterministic input -> first linear layer -> activation); users asked for
    # mode="full" get a full covariance back.
    if mode.full and isinstance(out, Gaussian) and not module.image_output:
        return out.to_full()
    return out

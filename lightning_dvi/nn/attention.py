r"""Self-attention on token sequences: ``MultiheadAttention``, ``TransformerEncoderLayer``.

Thin modules over :mod:`lightning_dvi.moments.attention`. A sequence flows as ``[B, T, D]``
(a tensor, or a Gaussian with per-token variances ``[B, T, D]`` in ``diag`` mode and per-token
feature covariances ``[B, T, D, D]`` in ``full`` mode). **The covariance between tokens is not
kept** in either mode: a full ``[TD, TD]`` covariance per example is out of reach at useful
sizes, so every attention layer treats its input tokens as independent. What that drops is
measured in ``docs/transformers.md``; inside the layer the covariance the shared projection
weights induce between tokens is accounted for exactly (mix the tokens, then project).

The projections are :class:`~lightning_dvi.nn.BayesLinear` children (their own KL terms, EB
groups and Pyro sites). In ``sample`` mode every draw has its own whole projection weights;
``local`` mode draws them the same way, because local reparameterisation does not apply inside
attention (per-token pre-activation noise would make tokens that share the weights
independent); the per-example marginals are those of whole-weight draws either way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..moments import attention as A
from ..moments import policy
from ..moments.linear import linear_diag
from ..moments.skip import SkipRule, check_skip_rule, skip_independent
from ..propagation import Propagation
from .base import BayesModule, Moments
from .container import Residual, Sequential
from .layer_norm import LayerNorm
from .linear import BayesLinear
from .posterior import posterior_moments
from .registry import ConversionOptions, copy_torch_posterior, register_layer, spec_for_module

__all__ = [
    "DEFAULT_ATTENTION_RULE",
    "MultiheadAttention",
    "TokenWise",
    "TransformerEncoderLayer",
    "key_padding",
]

DEFAULT_ATTENTION_RULE: A.AttentionRule = "unscented"
"""The attention-weight rule used unless one is given (chosen by the table in ``docs/transformers.md``)."""

_PADDING: ContextVar[Tensor | None] = ContextVar("lightning_dvi_key_padding", default=None)
# The masks of the open ``key_padding`` blocks, innermost last, for ``torch.compile`` only: its
# tracer cannot read a ContextVar but reads (and guards on) a module list, so a trace under a
# new mask, or none, compiles anew. Eager code reads the ContextVar (per thread and task).
_OPEN_MASKS: list[Tensor | None] = []


def _padding() -> Tensor | None:
    """The key padding mask in force (:func:`key_padding`), ``None`` outside every block."""
    if policy.tracing():
        return _OPEN_MASKS[-1] if _OPEN_MASKS else None
    return _PADDING.get()


@contextmanager
def key_padding(mask: Tensor | None) -> Iterator[None]:
    """Every attention layer run inside the block ignores the keys where ``mask`` is ``True``.

    Args:
        mask: ``[B, T]`` bool, ``True`` at padding tokens (torch's ``key_padding_mask``).

    Examples:
        >>> layer = MultiheadAttention(4, 2)
        >>> x = torch.randn(2, 3, 4)
        >>> with key_padding(torch.tensor([[False, False, True], [False, False, False]])):
        ...     out = layer(x, mode="diag")
        >>> tuple(out.mean.shape)
        (2, 3, 4)
    """
    token = _PADDING.set(mask)
    _OPEN_MASKS.append(mask)
    try:
        yield
    finally:
        # this block's own entry (blocks in other threads may have opened since)
        del _OPEN_MASKS[max(i for i, m in enumerate(_OPEN_MASKS) if m is mask)]
        _PADDING.reset(token)


def _projection(layer: BayesLinear) -> A.ProjectionMoments:
    groups = posterior_moments(layer)
    w_loc, w_var = groups["weight"]
    b_loc, b_var = groups.get("bias", (None, None))
    return A.ProjectionMoments(w_loc, w_var, b_loc, b_var)


def _draw(p: A.ProjectionMoments, s: int, like: Tensor) -> tuple[Tensor, Tensor | None]:
    """Whole weights per draw ``([S, out, in], [S, out])``, or the values given."""
    if p.w_var is None:
        return p.w_loc, p.b_loc
    eps = torch.randn(s, *p.w_loc.shape, dtype=like.dtype, device=like.device)
    weight = p.w_loc + p.w_var.sqrt() * eps
    bias = None
    if p.b_loc is not None:
        b_var = torch.zeros_like(p.b_loc) if p.b_var is None else p.b_var
        b_eps = torch.randn(s, *p.b_loc.shape, dtype=like.dtype, device=like.device)
        bias = p.b_loc + b_var.sqrt() * b_eps
    return weight, bias


def _copy_projection(
    layer: BayesLinear, w: Tensor, b: Tensor | None, options: ConversionOptions
) -> None:
    source = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        source.weight.copy_(w)
        if b is not None and source.bias is not None:
            source.bias.copy_(b)
    copy_torch_posterior(layer, source, options)


def _from_torch_mha(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.MultiheadAttention)
    if not module._qkv_same_embed_dim or module.bias_k is not None or module.add_zero_attn:
        raise NotImplementedError(
            "MultiheadAttention with kdim/vdim, add_bias_kv or add_zero_attn is not supported"
        )
    if not module.batch_first:
        raise NotImplementedError(
            "MultiheadAttention(batch_first=False) is not supported; build it with "
            "batch_first=True (inputs [B, T, D])"
        )
    weight = cast(Tensor, module.in_proj_weight).detach()
    bias = None if module.in_proj_bias is None else module.in_proj_bias.detach()
    layer = MultiheadAttention(
        module.embed_dim, module.num_heads, bias=bias is not None, **options.layer_kwargs
    ).to(device=weight.device, dtype=weight.dtype)
    e = module.embed_dim
    for i, proj in enumerate((layer.q_proj, layer.k_proj, layer.v_proj)):
        part = None if bias is None else bias[i * e : (i + 1) * e]
        _copy_projection(proj, weight[i * e : (i + 1) * e], part, options)
    out_bias = module.out_proj.bias
    _copy_projection(
        layer.out_proj,
        module.out_proj.weight.detach(),
        None if out_bias is None else out_bias.detach(),
        options,
    )
    return layer


def _describe_mha(layer: BayesModule) -> dict[str, Any]:
    assert isinstance(layer, MultiheadAttention)
    return {
        "embed_dim": layer.embed_dim,
        "num_heads": layer.num_heads,
        "bias": layer.q_proj.bias_loc is not None,
        "causal": layer.causal,
        "rule": layer.rule,
        "scale_transform": layer.q_proj.scale_transform,
    }


@register_layer(
    "multihead_attention",
    kind="weight",
    torch_modules=(nn.MultiheadAttention,),
    convert=_from_torch_mha,
    describe=_describe_mha,
)
class MultiheadAttention(BayesModule):
    r"""Multi-head scaled dot-product self-attention with Bayesian projections.

    :math:`\operatorname{MHA}(x) = W_o\,[\operatorname{softmax}(q^hk^{h\top}/\sqrt d)\,v^h]_h + b_o`
    with :math:`q = W_qx + b_q` etc. on inputs ``[B, T, D]``; moments by
    :func:`~lightning_dvi.moments.attention.self_attention_moments` (``rule``: ``"mean"`` is
    SUQ's; ``"unscented"``, the default, ``"mean_field"`` and ``"delta"`` carry the attention
    weights' uncertainty).

    Args:
        embed_dim: :math:`D`.
        num_heads: :math:`H`, dividing ``embed_dim``.
        bias: Gaussian biases in the four projections.
        causal: each token attends to itself and earlier tokens only.
        rule: the attention-weight rule (default :data:`DEFAULT_ATTENTION_RULE`).
        **layer_kwargs: forwarded to the four :class:`~lightning_dvi.nn.BayesLinear`
            projections (``init_scale``, ``prior_variance``, ``scale_transform``, ...).

    A key padding mask applies through :func:`key_padding`.

    Examples:
        >>> attn = MultiheadAttention(8, 2, causal=True)
        >>> out = attn(torch.randn(3, 5, 8), mode="full")
        >>> tuple(out.mean.shape), tuple(out.cov.shape)
        ((3, 5, 8), (3, 5, 8, 8))
    """

    image_output = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        bias: bool = True,
        *,
        causal: bool = False,
        rule: A.AttentionRule | None = None,
        **layer_kwargs: Any,
    ) -> None:
        super().__init__()
        if embed_dim < 1 or num_heads < 1 or embed_dim % num_heads:
            raise ValueError(
                f"MultiheadAttention: embed_dim ({embed_dim}) must be a positive multiple of "
                f"num_heads ({num_heads})"
            )
        rule = DEFAULT_ATTENTION_RULE if rule is None else rule
        if rule not in A.ATTENTION_RULES:
            raise ValueError(f"rule must be one of {A.ATTENTION_RULES}, got {rule!r}")
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.causal, self.rule = bool(causal), rule
        self.q_proj = BayesLinear(embed_dim, embed_dim, bias, **layer_kwargs)
        self.k_proj = BayesLinear(embed_dim, embed_dim, bias, **layer_kwargs)
        self.v_proj = BayesLinear(embed_dim, embed_dim, bias, **layer_kwargs)
        self.out_proj = BayesLinear(embed_dim, embed_dim, bias, **layer_kwargs)

    def _projections(self) -> tuple[A.ProjectionMoments, ...]:
        return tuple(_projection(p) for p in (self.q_proj, self.k_proj, self.v_proj, self.out_proj))

    def _check(self, x: Moments, mode: Propagation) -> None:
        shape = tuple(x.shape)
        rank = 4 if mode.samples and isinstance(x, Tensor) else 3
        if len(shape) != rank or shape[-1] != self.embed_dim:
            want = "[S, B, T, D]" if rank == 4 else "[B, T, D]"
            raise ValueError(
                f"MultiheadAttention({self.embed_dim}, {self.num_heads}) expects {want} with "
                f"D = {self.embed_dim}, got shape {shape}"
            )
        if x.dtype != self.q_proj.weight_loc.dtype:
            raise ValueError(
                f"MultiheadAttention parameters are {self.q_proj.weight_loc.dtype} but the "
                f"input is {x.dtype}; convert one of them"
            )

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Moments (``full``/``diag``) or samples (``sample``/``local``) of the attention output."""
        self._check(x, mode)
        q, k, v, o = self._projections()
        heads, causal, padding = self.num_heads, self.causal, _padding()
        given = q.w_var is None
        if isinstance(x, Tensor) and (mode.samples or given):
            s = x.shape[0]
            draws = [_draw(p, s, x) for p in (q, k, v, o)]
            return A.attention_sample(
                x, *draws, heads=heads, causal=causal, key_padding_mask=padding
            )
        if isinstance(x, Tensor):
            mean = x
            second = None if mode.diag else x.new_zeros(*x.shape, x.shape[-1])
        else:
            g = x.to_diag() if mode.diag else x
            mean, second = g.mean, (g.cov if g.cov is not None else g.var)
        out_mean, out_second = A.self_attention_moments(
            mean, second, q, k, v, o, heads=heads, rule=self.rule, causal=causal,
            key_padding_mask=padding,
        )  # fmt: skip
        if out_second.dim() == out_mean.dim() + 1:
            return Gaussian(out_mean, cov=out_second, validate=False)
        return Gaussian(out_mean, var=out_second, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        r"""Per token, :math:`\operatorname{Cov}(r_i, y_i) = \operatorname{Cov}(r_i, x_i)\,B_i^\top`.

        :math:`B_i = \bar W_o\operatorname{blockdiag}_h(\bar A^h_{ii}\bar W_v^h)`: the token's
        own share of its mixed value (the other tokens are independent of :math:`r_i`), with the
        attention weights at their mean. ``cross`` is ``[B, T, D_r, D]``.
        """
        q, k, v, o = self._projections()
        g = x.to_diag() if mode.diag else x
        second = g.cov if g.cov is not None else g.var
        weights = A.self_attention_weights(
            g.mean, second, q, k, heads=self.num_heads, rule=self.rule, causal=self.causal,
            key_padding_mask=_padding(),
        )  # fmt: skip
        own = weights.mean.diagonal(0, -2, -1).transpose(1, 2)  # [B, T, H]
        d = self.embed_dim // self.num_heads
        # Cov(r, x) W_v^T, each head's block scaled by its own weight A_ii, then W_o^T
        per_head = (cross @ v.w_loc.transpose(-1, -2)).unflatten(-1, (self.num_heads, d))
        through_v: Tensor = (per_head * own.unsqueeze(-2).unsqueeze(-1)).flatten(-2)
        return through_v @ o.w_loc.transpose(-1, -2)

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return (
            f"{self.embed_dim}, num_heads={self.num_heads}, causal={self.causal}, "
            f"rule={self.rule!r}"
        )


class TokenWise(BayesModule):
    """Runs a declared layer on every token of ``[S, B, T, D]`` draws as on ``[S, B*T, D]``.

    In ``sample`` mode :class:`~lightning_dvi.nn.BayesLinear` draws one weight matrix per draw
    for inputs ``[S, N, D]``; folding the tokens into ``N`` keeps that layout for sequences.
    Moments and the other modes pass through unchanged.
    """

    image_output = None

    def __init__(self, module: BayesModule) -> None:
        super().__init__()
        self.module = module

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """The module's output, tokens folded into the batch for ``sample`` draws.

        In ``diag`` mode a :class:`~lightning_dvi.nn.BayesLinear` on per-token variances gives
        per-token variances (:func:`~lightning_dvi.moments.linear_diag`), also at widths up
        to :data:`~lightning_dvi.moments.layers.HEAD_WIDTH`, where the layer alone returns a
        network head's full covariance: inside a block the next skip connection keeps only
        its diagonal, so the ``[D, D]`` per token would be computed for nothing (the same
        variances up to rounding).
        """
        if (mode.samples and not mode.local) and isinstance(x, Tensor) and x.dim() == 4:
            out = self.module.propagate(x.flatten(1, 2), mode)
            assert isinstance(out, Tensor)
            folded: Tensor = out.unflatten(1, x.shape[1:3])
            return folded
        diag_input = mode.diag and isinstance(x, Gaussian) and x.cov is None
        if diag_input and isinstance(self.module, BayesLinear):
            assert isinstance(x, Gaussian)
            self.module.check_input(x, mode)
            p = _projection(self.module)
            if p.w_var is not None:
                mean, var = linear_diag(x.mean, x.var, p.w_loc, p.w_var, p.b_loc, p.b_var)
                return Gaussian(mean, var=var, validate=False)
        result: Moments = self.module.propagate(x, mode)
        return result

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """The module's rule."""
        return self.module.propagate_cross(cross, x, mode)


def _independent_skip(block: Residual, x: Gaussian, mode: Propagation) -> Gaussian:
    """``x + block.branch(x)`` by :func:`~lightning_dvi.moments.skip.skip_independent`."""
    x = x.to_full() if mode.full else x.to_diag()
    delta = block.branch.propagate(x, mode)
    if not isinstance(delta, Gaussian):  # pragma: no cover - every branch holds a weight layer
        raise ValueError("Residual branch must contain a BayesLinear layer")
    if mode.full:
        mean, cov = skip_independent(
            x.mean, cast(Tensor, x.cov), delta.mean, cast(Tensor, delta.to_full().cov)
        )
        return Gaussian(mean, cov=cov, validate=False)
    delta = delta.to_diag()
    mean, var = skip_independent(x.mean, x.var, delta.mean, delta.var)
    return Gaussian(mean, var=var, validate=False)


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


def _activation_name(module: nn.TransformerEncoderLayer) -> str:
    act = module.activation
    if isinstance(act, nn.Module):
        for name, cls in _ACTIVATIONS.items():
            if type(act) is cls and getattr(act, "approximate", "none") == "none":
                return name
    elif act is torch.nn.functional.relu:
        return "relu"
    elif act is torch.nn.functional.gelu:
        return "gelu"
    raise NotImplementedError(f"TransformerEncoderLayer activation {act!r} is not supported")


def _from_torch_encoder_layer(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.TransformerEncoderLayer)
    attn = _from_torch_mha(module.self_attn, options)
    lin1, lin2 = module.linear1, module.linear2
    layer = TransformerEncoderLayer(
        lin1.in_features,
        module.self_attn.num_heads,
        lin1.out_features,
        activation=_activation_name(module),
        layer_norm_eps=module.norm1.eps,
        norm_first=module.norm_first,
        bias=lin1.bias is not None,
        **options.layer_kwargs,
    ).to(device=lin1.weight.device, dtype=lin1.weight.dtype)
    with torch.no_grad():
        layer.self_attn.load_state_dict(attn.state_dict())
    for ours, theirs in ((layer.linear1, lin1), (layer.linear2, lin2)):
        copy_torch_posterior(ours, theirs, options)
    for ours_norm, theirs_norm in ((layer.norm1, module.norm1), (layer.norm2, module.norm2)):
        spec = spec_for_module(theirs_norm)
        assert spec is not None
        converted = spec.convert_module(theirs_norm, options)
        assert converted is not None
        ours_norm.load_state_dict(converted.state_dict())
    return layer


def _describe_encoder_layer(layer: BayesModule) -> dict[str, Any]:
    assert isinstance(layer, TransformerEncoderLayer)
    return dict(layer.options)


@register_layer(
    "transformer_encoder_layer",
    kind="weight",
    torch_modules=(nn.TransformerEncoderLayer,),
    convert=_from_torch_encoder_layer,
    describe=_describe_encoder_layer,
)
class TransformerEncoderLayer(Sequential):
    r"""``torch.nn.TransformerEncoderLayer`` (``batch_first``) as declared modules.

    ``norm_first=False``: :math:`x \leftarrow \operatorname{LN}_1(x + \operatorname{SA}(x))`,
    :math:`x \leftarrow \operatorname{LN}_2(x + \operatorname{FF}(x))`; ``norm_first=True``:
    :math:`x \leftarrow x + \operatorname{SA}(\operatorname{LN}_1(x))`,
    :math:`x \leftarrow x + \operatorname{FF}(\operatorname{LN}_2(x))`, with
    :math:`\operatorname{FF} = W_2\,\mathrm{act}(W_1x + b_1) + b_2`. The skip connections are
    :class:`~lightning_dvi.nn.Residual` blocks (cross-covariance carried per token); dropout is
    dropped, as everywhere in conversion.

    Args:
        d_model: :math:`D`.
        nhead: heads.
        dim_feedforward: the hidden width of FF.
        activation: ``"relu"`` or ``"gelu"``.
        layer_norm_eps: the LayerNorms' :math:`\epsilon`.
        norm_first: pre-norm (``True``) or post-norm.
        bias: biases in the linear layers and LayerNorms.
        causal: causal self-attention.
        rule: the attention-weight rule.
        skip_rule: the skip connections' moment rule in the moment modes
            (:data:`~lightning_dvi.moments.skip.SKIP_RULES`): ``"carried"`` (the default)
            carries :math:`\operatorname{Cov}(x, f(x))` through each branch;
            ``"independent"`` (SUQ's) drops it, :math:`\operatorname{Var}(x + f(x)) =
            \operatorname{Var}(x) + \operatorname{Var}(f(x))`
            (:func:`~lightning_dvi.moments.skip.skip_independent`; its error against Monte
            Carlo is tabulated in ``docs/transformers.md``). It applies to the block's own
            skips; a cross-covariance asked of the whole block (the block inside an outer
            skip connection) is still carried.
        **layer_kwargs: forwarded to every Bayesian linear layer.
    """

    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        *,
        activation: str = "relu",
        layer_norm_eps: float = 1e-5,
        norm_first: bool = False,
        bias: bool = True,
        causal: bool = False,
        rule: A.AttentionRule | None = None,
        skip_rule: SkipRule = "carried",
        **layer_kwargs: Any,
    ) -> None:
        from .activations import GELU, ReLU

        check_skip_rule(skip_rule)

        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation must be 'relu' or 'gelu', got {activation!r}")
        attn = MultiheadAttention(d_model, nhead, bias, causal=causal, rule=rule, **layer_kwargs)
        act = ReLU() if activation == "relu" else GELU()
        lin1 = BayesLinear(d_model, dim_feedforward, bias, **layer_kwargs)
        lin2 = BayesLinear(dim_feedforward, d_model, bias, **layer_kwargs)
        norm1 = LayerNorm(d_model, layer_norm_eps, bias=bias)
        norm2 = LayerNorm(d_model, layer_norm_eps, bias=bias)
        ff1, ff2 = TokenWise(lin1), TokenWise(lin2)
        if norm_first:
            blocks: list[BayesModule] = [
                Residual(norm1, attn),
                Residual(norm2, ff1, act, ff2),
            ]
        else:
            blocks = [Residual(attn), norm1, Residual(ff1, act, ff2), norm2]
        super().__init__(*blocks)
        self.options: dict[str, Any] = {
            "d_model": d_model,
            "nhead": nhead,
            "dim_feedforward": dim_feedforward,
            "activation": activation,
            "layer_norm_eps": layer_norm_eps,
            "norm_first": norm_first,
            "bias": bias,
            "causal": causal,
            "rule": attn.rule,
            "skip_rule": skip_rule,
            "scale_transform": lin1.scale_transform,
        }

    @property
    def skip_rule(self) -> SkipRule:
        """The skip connections' moment rule (``"carried"`` or ``"independent"``; settable)."""
        rule: SkipRule = self.options.get("skip_rule", "carried")
        return rule

    @skip_rule.setter
    def skip_rule(self, rule: SkipRule) -> None:
        self.options["skip_rule"] = check_skip_rule(rule)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """The blocks in order; with ``skip_rule="independent"`` each skip by that rule."""
        if self.skip_rule == "carried" or not isinstance(x, Gaussian) or mode.samples:
            return super().propagate(x, mode)
        h: Moments = x
        for block in self:
            if isinstance(block, Residual) and isinstance(h, Gaussian):
                h = _independent_skip(block, h, mode)
            else:
                h = block.propagate(h, mode)
        return h

    def _part(self, pre: tuple[int, ...], post: tuple[int, ...]) -> BayesModule:
        module: nn.Module = self
        for i in pre if self.options["norm_first"] else post:
            module = module.branch[i] if isinstance(module, Residual) else module[i]  # type: ignore[index]  # a Sequential of the parts
        return cast(BayesModule, module)

    @property
    def self_attn(self) -> MultiheadAttention:
        """The attention layer."""
        return cast(MultiheadAttention, self._part((0, 1), (0, 0)))

    @property
    def linear1(self) -> BayesLinear:
        """The first feed-forward layer."""
        return cast(BayesLinear, cast(TokenWise, self._part((1, 1), (2, 0))).module)

    @property
    def linear2(self) -> BayesLinear:
        """The second feed-forward layer."""
        return cast(BayesLinear, cast(TokenWise, self._part((1, 3), (2, 2))).module)

    @property
    def norm1(self) -> LayerNorm:
        """The LayerNorm before (pre-norm) or after (post-norm) the attention."""
        return cast(LayerNorm, self._part((0, 0), (1,)))

    @property
    def norm2(self) -> LayerNorm:
        """The LayerNorm of the feed-forward block."""
        return cast(LayerNorm, self._part((1, 0), (3,)))

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return ", ".join(f"{k}={v!r}" for k, v in self.options.items())

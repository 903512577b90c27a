"""from_torch on transformers: nn.MultiheadAttention, nn.TransformerEncoderLayer, a GPT-2-shaped
decoder stack and a ViT-tiny-shaped encoder (tests/transformer_models.py), at zero posterior
scale equal to torch; last_layers=k; a checkpoint that reloads with weights_only=True."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn
from transformer_models import TinyGPT2, TinyViT, randomize_norms

from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.nn import (
    GraphNetwork,
    LastLayerNetwork,
    MultiheadAttention,
    TransformerEncoderLayer,
    from_torch,
    key_padding,
)

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
DTYPES = [torch.float64, torch.float32]


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _check_zero_scale(net, model, x, dtype):
    with torch.no_grad():
        want = model(x)
        for mode in ("diag", "full"):
            out = net(x, mode=mode)
            assert _relative(out.mean.reshape(want.shape), want) < TOL[dtype], mode
            assert out.var.abs().max().item() <= 1e-12


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` as self-attention, optionally causal (a constant mask)."""

    def __init__(self, causal: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.causal = causal
        self.register_buffer("mask", torch.ones(5, 5, dtype=torch.bool).triu(1))

    def forward(self, x):
        if self.causal:
            return self.attn(x, x, x, attn_mask=self.mask, need_weights=False)[0]
        return self.attn(x, x, x)[0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_multihead_attention(dtype, causal):
    torch.manual_seed(0)
    model = SelfAttention(causal).to(dtype).eval()
    net = from_torch(model, scale_fraction=0.0)
    assert isinstance(net, GraphNetwork)
    layer = next(m for m in net.modules() if isinstance(m, MultiheadAttention))
    assert layer.causal is causal
    _check_zero_scale(net, model, torch.randn(3, 5, 8, dtype=dtype), dtype)


def test_key_padding_is_given_at_run_time():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).double().eval()
    net = from_torch(mha, scale_fraction=0.0)
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[0, 3:] = True
    with torch.no_grad(), key_padding(padding):
        out = net(x, mode="diag")
        want = mha(x, x, x, key_padding_mask=padding)[0]
    assert _relative(out.mean, want) < 1e-12


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_encoder_layer(dtype, norm_first, activation):
    torch.manual_seed(0)
    model = randomize_norms(
        nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.1, activation=activation, batch_first=True, norm_first=norm_first
        )
    ).to(dtype)
    model.eval()
    net = from_torch(model, scale_fraction=0.0)
    assert isinstance(net[0], TransformerEncoderLayer)
    _check_zero_scale(net, model, torch.randn(3, 5, 8, dtype=dtype), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpt2_shaped_decoder_stack(dtype):
    torch.manual_seed(0)
    model = randomize_norms(TinyGPT2()).to(dtype).eval()
    net = from_torch(model, scale_fraction=0.0)
    attn = [m for m in net.modules() if isinstance(m, MultiheadAttention)]
    assert len(attn) == 2 and all(m.causal for m in attn)
    _check_zero_scale(net, model, torch.randint(0, 11, (3, 6)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vit_tiny_shaped_encoder(dtype):
    torch.manual_seed(0)
    model = randomize_norms(TinyViT()).to(dtype).eval()
    net = from_torch(model, scale_fraction=0.0)
    assert sum(isinstance(m, TransformerEncoderLayer) for m in net.modules()) == 2
    _check_zero_scale(net, model, torch.randn(3, 4, 16, dtype=dtype), dtype)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_last_layers_on_both(k):
    torch.manual_seed(0)
    gpt = randomize_norms(TinyGPT2()).double().eval()
    vit = randomize_norms(TinyViT()).double().eval()
    ids, patches = torch.randint(0, 11, (3, 6)), torch.randn(3, 4, 16, dtype=torch.float64)
    for model, x in ((gpt, ids), (vit, patches)):
        net = from_torch(model, last_layers=k, scale_fraction=0.0)
        assert isinstance(net, LastLayerNetwork)
        _check_zero_scale(net, model, x, torch.float64)
        moments = from_torch(model, last_layers=k, scale_fraction=0.1)(x, mode="diag")
        assert bool((moments.var > 0).all())


def test_gpt2_checkpoint_reloads_with_weights_only():
    torch.manual_seed(0)
    model = randomize_norms(TinyGPT2()).double().eval()
    net = from_torch(model, scale_fraction=0.1)
    buffer = io.BytesIO()
    torch.save({"architecture": net.architecture(), "state_dict": net.state_dict()}, buffer)
    buffer.seek(0)
    del model
    saved = torch.load(buffer, weights_only=True)
    rebuilt = GraphNetwork(**saved["architecture"]).double()
    rebuilt.load_state_dict(saved["state_dict"])
    ids = torch.randint(0, 11, (2, 6))
    with torch.no_grad():
        for mode in ("diag", "full"):
            a, b = net(ids, mode=mode), rebuilt(ids, mode=mode)
            torch.testing.assert_close(b.mean, a.mean, rtol=0, atol=0)
            torch.testing.assert_close(b.var, a.var, rtol=0, atol=0)


def test_vit_classifier_checkpoint_reloads_with_weights_only(tmp_path):
    from helpers import cpu_trainer

    from lightning_dvi import DVIClassifier

    torch.manual_seed(0)
    net = from_torch(randomize_norms(TinyViT()).eval(), scale_fraction=0.1)
    config = {"class_path": "lightning_dvi.nn.GraphNetwork", "init_args": net.architecture()}
    model = DVIClassifier(net=config, num_classes=3, num_data=10)
    model.net.load_state_dict(net.state_dict())
    trainer = cpu_trainer(default_root_dir=tmp_path)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    loaded = DVIClassifier.load_from_checkpoint(tmp_path / "c.ckpt", weights_only=True)
    x = torch.randn(2, 4, 16)
    with torch.no_grad():
        want, got = model.net(x, mode="diag"), loaded.net(x, mode="diag")
    torch.testing.assert_close(got.mean, want.mean)
    torch.testing.assert_close(got.var, want.var)


def test_converted_vit_against_monte_carlo():
    """Non-zero scale: diag and full moments against whole-weight draws (the tokens are treated
    as independent after each attention layer, which is the error measured here)."""
    torch.manual_seed(0)
    net = from_torch(randomize_norms(TinyViT()).double().eval(), scale_fraction=0.1)
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    for mode in ("diag", "full"):
        res = compare_with_monte_carlo(net, x, mode=mode, num_samples=4_000, sample_mode="local")
        assert res.mean_error < 0.25 and res.std_rel_error < 0.5, (mode, res)


def test_refusals_name_the_way_out():
    class Cross(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.key = nn.Linear(8, 8)

        def forward(self, x):
            return self.attn(x, self.key(x), x)[0]

    with pytest.raises(NotImplementedError, match="self-attention"):
        from_torch(Cross())
    with pytest.raises(NotImplementedError, match="batch_first=True"):
        from_torch(nn.MultiheadAttention(8, 2))
    with pytest.raises(NotImplementedError, match="kdim"):
        from_torch(nn.MultiheadAttention(8, 2, kdim=4, vdim=4, batch_first=True))

    class Padded(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, padding):
            return self.attn(x, x, x, key_padding_mask=padding)[0]

    with pytest.raises(NotImplementedError):
        from_torch(Padded())

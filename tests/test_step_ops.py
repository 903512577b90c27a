"""Issue 39 item 1: fewer ops per ELBO step, same values.

* :class:`lightning_dvi.nn.posterior.SoftplusScales` (every layer's softplus scale and its
  square in one node, closed-form backward) against autograd through ``softplus`` and ``s * s``
  (the unfused formula) in float64: values, gradients and ``gradcheck``, with all, some and no
  outputs used;
* ``elbo`` with the node against the per-layer path (no network given to ``shared_scales``),
  in every mode;
* the input and target NaN checks that ``elbo`` defers to its loss check still name the cause.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import mlp
from lightning_dvi.nn.posterior import SoftplusScales
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes

F64 = torch.float64


def _raws(seed: int = 0, beyond: bool = False) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # raw scales on both sides of 0
    shapes = [(4, 3), (4,), (2, 4)]
    raws = [3 * torch.randn(s, dtype=F64, generator=gen) for s in shapes]
    if beyond:
        # past softplus's linear threshold (20), where F.softplus returns r itself and its
        # autograd slope is 1; the node's slope is sigmoid(r) = 1 - 1.4e-11 there
        raws[1][0] = 25.0
    return [r.requires_grad_() for r in raws]


@pytest.mark.parametrize("beyond", [False, True])
def test_softplus_scales_gradcheck(beyond: bool) -> None:
    assert torch.autograd.gradcheck(lambda *r: SoftplusScales.apply(*r), _raws(0, beyond))


@pytest.mark.parametrize("used", ["all", "scales", "variances", "some"])
def test_softplus_scales_match_the_formula(used: str) -> None:
    raws = _raws(1)
    out = SoftplusScales.apply(*raws)
    k = len(raws)
    ref = [F.softplus(r) for r in raws] + [F.softplus(r) * F.softplus(r) for r in raws]
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-15, atol=0)
    gen = torch.Generator().manual_seed(2)
    pick = {
        "all": range(2 * k),
        "scales": range(k),
        "variances": range(k, 2 * k),
        "some": [0, k + 2],  # the second raw tensor gets no gradient at all
    }[used]
    weights = [torch.randn(out[i].shape, dtype=F64, generator=gen) for i in pick]
    fused = torch.autograd.grad(
        sum((w * out[i]).sum() for w, i in zip(weights, pick, strict=True)),
        raws,
        allow_unused=True,
    )
    unfused = torch.autograd.grad(
        sum((w * ref[i]).sum() for w, i in zip(weights, pick, strict=True)),
        raws,
        allow_unused=True,
    )
    for g, h in zip(fused, unfused, strict=True):
        if h is None:
            assert g is None
        else:
            torch.testing.assert_close(g, h, rtol=1e-13, atol=1e-300)


@pytest.mark.parametrize("mode", ["full", "diag", "sample", "local"])
def test_elbo_with_the_batched_scales_matches_the_per_layer_path(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    net = mlp(3, [6, 5], 2).double()
    x, y = torch.randn(7, 3, dtype=F64), torch.randn(7, dtype=F64)
    lik, prior = HeteroscedasticGaussian(), EmpiricalBayes()

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        net.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = elbo(net, lik, prior, x, y, num_data=50, mode=mode).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in net.parameters()]

    fused = run()
    import lightning_dvi.nn.posterior as posterior

    monkeypatch.setattr(posterior, "_prefill", lambda ctx, net: None)  # the per-layer path
    unfused = run()
    torch.testing.assert_close(fused[0], unfused[0], rtol=1e-14, atol=0)
    for g, h in zip(fused[1], unfused[1], strict=True):
        torch.testing.assert_close(g, h, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("check_finite", [True, False])
@pytest.mark.parametrize("bad", ["nan_input", "inf_input", "nan_target"])
def test_deferred_value_checks_still_name_the_cause(bad: str, check_finite: bool) -> None:
    net, lik, prior = mlp(3, [4], 2), HeteroscedasticGaussian(), EmpiricalBayes()
    x, y = torch.zeros(2, 3), torch.zeros(2)
    if bad == "nan_target":
        y[1] = float("nan")
        message = "targets contain NaN or Inf"
    else:
        x[0, 1] = float("nan") if bad == "nan_input" else float("inf")
        message = "input contains NaN or Inf"
    with pytest.raises(ValueError, match=message):
        elbo(net, lik, prior, x, y, num_data=10, check_finite=check_finite)
    # outside the ELBO the network checks its input on every call
    if bad != "nan_target":
        with pytest.raises(ValueError, match=message):
            net(x)

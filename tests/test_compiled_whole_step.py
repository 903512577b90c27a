"""The whole ELBO step as one compiled graph (``lightning_dvi.compile.CompiledStep``, issue 39).

The step is recorded (forward, likelihood, KL and autograd's backward) as one aten graph and
compiled; its gradients reach ``.grad`` through the returned loss. It must give the eager
step's loss, gradients and written buffers, keep every value check, retrace only for a new
input signature, hand gradients to autograd like any loss (accumulation, scaling, frozen
parameters), and the Lightning modules must train with it as they do eagerly. Most tests
compile with ``backend="eager"`` (the recorded graph run as it is: what is tested is the
recording); one runs inductor itself.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dvi import DVIRegressor
from lightning_dvi.compile import CompiledELBO, CompiledStep, StepTraceError, compile_step
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian, HomoscedasticGaussian
from lightning_dvi.nn import mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior
from tests.helpers import cpu_trainer, load_recipe

FAST = {"backend": "eager"}


def _problem(kind: str):
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64)
    if kind == "heteroscedastic":
        return mlp(3, [5, 4], 2).double(), HeteroscedasticGaussian(), x, torch.randn(6).double()
    if kind == "homoscedastic":  # a likelihood with a parameter of its own
        return mlp(3, [5], 1).double(), HomoscedasticGaussian().double(), x, torch.randn(6).double()
    return mlp(3, [5, 4], 3).double(), Categorical(3), x, torch.randint(0, 3, (6,))


def _grads(module):
    return [None if p.grad is None else p.grad.clone() for p in module.parameters()]


def _eager(net, lik, prior, x, y, mode, kl_weight=0.3):
    for m in (net, lik):
        m.zero_grad(set_to_none=True)
    terms = elbo(net, lik, prior, x, y, num_data=50, mode=mode, kl_weight=kl_weight)
    terms.loss.backward()
    return terms, _grads(net) + _grads(lik), [b.clone() for b in prior.buffers()]


@pytest.mark.parametrize(
    ("kind", "mode"),
    [("heteroscedastic", "full"), ("heteroscedastic", "diag"), ("classification", "diag"),
     ("classification", "full"), ("homoscedastic", "diag")],
)  # fmt: skip
def test_whole_step_matches_the_eager_step(kind, mode):
    net, lik, x, y = _problem(kind)
    prior = EmpiricalBayes(mode="in_graph")
    eager, want, want_buffers = _eager(net, lik, prior, x, y, mode)
    for b in prior.buffers():
        b.fill_(-1.0)  # the compiled step must write them again
    for m in (net, lik):
        m.zero_grad(set_to_none=True)
    step = compile_step(net, lik, prior, mode=mode, **FAST)
    terms = step(x, y, num_data=50, kl_weight=0.3)
    terms.loss.backward()
    torch.testing.assert_close(terms.loss, eager.loss, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(terms.elbo, eager.elbo, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(terms.kl, eager.kl.detach(), rtol=1e-12, atol=0)
    got = _grads(net) + _grads(lik)
    assert len(got) == len(want) and all(g is not None for g in want)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)
    for b, w in zip(prior.buffers(), want_buffers, strict=True):
        torch.testing.assert_close(b, w, rtol=1e-12, atol=0)


def test_inductor_compiles_the_recorded_step():
    """The default path: inductor on the recorded graph (C++ kernels on a CPU)."""
    net, lik, x, y = _problem("heteroscedastic")
    prior = EmpiricalBayes()
    _, want, _ = _eager(net, lik, prior, x, y, "diag")
    net.zero_grad(set_to_none=True)
    step = compile_step(net, lik, prior, mode="diag")
    step(x, y, num_data=50, kl_weight=0.3).loss.backward()
    for g, w in zip(_grads(net), want, strict=False):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-12)


def test_a_kl_schedule_reuses_the_graph_and_a_new_signature_records_another():
    net, lik, x, y = _problem("heteroscedastic")
    step = CompiledStep(net, lik, EmpiricalBayes(), "diag", **FAST)
    for w in (0.0, 0.5, 1.0):
        net.zero_grad(set_to_none=True)
        step(x, y, num_data=50, kl_weight=w).loss.backward()
    assert step.graphs == 1
    step(x[:4], y[:4], num_data=50).loss.backward()  # a smaller last batch
    net.eval()
    step(x, y, num_data=50).loss.backward()
    assert step.graphs == 3
    net.train()
    step(x, y, num_data=50, kl_weight=0.7).loss.backward()
    assert step.graphs == 3


@pytest.mark.parametrize("kind", ["heteroscedastic", "homoscedastic"])
def test_one_graph_serves_every_target_resolution_and_sees_a_new_one(kind):
    """The resolution's variance is a graph input (a buffer), not a constant of the graph.

    So a resolution set after the recording (a second fit) is used, where a constant would
    silently keep the old one, and the fits of other splits share one compiled graph.
    """
    net, lik, x, y = _problem(kind)
    prior = GaussianPrior()
    step = CompiledStep(net, lik, prior, "diag", **FAST)
    for resolution in (0.0, 0.5, 2.0, 0.0):  # from none to some: no new graph either
        lik.set_target_resolution(resolution)
        eager, want, _ = _eager(net, lik, prior, x, y, "diag", kl_weight=1.0)
        for m in (net, lik):
            m.zero_grad(set_to_none=True)
        terms = step(x, y, num_data=50)
        terms.loss.backward()
        torch.testing.assert_close(terms.loss, eager.loss, rtol=1e-12, atol=1e-14)
        for g, w in zip(_grads(net) + _grads(lik), want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-14)
    assert step.graphs == 1


def test_the_resolution_buffer_holds_the_float_in_every_dtype_and_is_not_saved():
    from lightning_dvi.likelihoods.gaussian import dequantisation_variance

    lik = HeteroscedasticGaussian(resolution=0.1)
    exact = dequantisation_variance(0.1)
    for cast in (
        lambda m: m,
        lambda m: m.float(),
        lambda m: m.half().double(),
        lambda m: m.to("cpu"),
    ):
        lik = cast(lik)  # made again after each cast, never rounded through another dtype
        assert lik.extra_variance.dtype == torch.float64 and lik.extra_variance.item() == exact
    lik.set_target_resolution(0.3)
    assert lik.extra_variance.item() == dequantisation_variance(0.3)
    assert "extra_variance" not in lik.state_dict()


def test_gradients_accumulate_scale_and_skip_frozen_parameters():
    net, lik, x, y = _problem("heteroscedastic")
    prior = GaussianPrior()
    _, want, _ = _eager(net, lik, prior, x, y, "full", kl_weight=1.0)
    step = compile_step(net, lik, prior, mode="full", **FAST)
    net.zero_grad(set_to_none=True)
    step(x, y, num_data=50).loss.backward()
    (2.5 * step(x, y, num_data=50).loss).backward()  # accumulated, and scaled by 2.5
    for g, w in zip(_grads(net), want, strict=False):
        torch.testing.assert_close(g, 3.5 * w, rtol=1e-10, atol=1e-14)
    loss = step(x, y, num_data=50).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="hands out its gradients once"):
        loss.backward()
    first = list(net[0].parameters())
    for p in first:
        p.requires_grad_(False)
    net.zero_grad(set_to_none=True)
    step(x, y, num_data=50).loss.backward()
    assert all(p.grad is None for p in first)
    rest = [p for p in net.parameters() if p.requires_grad]
    for p, w in zip(rest, want[len(first) :], strict=True):
        torch.testing.assert_close(p.grad, w, rtol=1e-10, atol=1e-14)
    assert step.graphs == 2  # which parameters take gradients is part of the signature


def test_value_checks_before_the_graph_and_no_grad_runs_eagerly():
    """The checks both compiled objectives share are in tests/test_compile_step.py."""
    net, lik, x, y = _problem("classification")
    step = compile_step(net, lik, EmpiricalBayes(), mode="diag", **FAST)
    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="input must be a floating tensor"):
        step(x.long(), y, num_data=50)
    with pytest.raises(ValueError, match="input contains NaN or Inf"):
        step(bad_x, y, num_data=50, check_finite=False)  # checked up front then
    step(x, y, num_data=50).loss.backward()
    recorded = step.graphs
    with torch.no_grad():
        terms = step(x[:5], y[:5], num_data=50)
        want = elbo(net, lik, EmpiricalBayes(), x[:5], y[:5], num_data=50, mode="diag")
    torch.testing.assert_close(terms.loss, want.loss)
    assert step.graphs == recorded == 1  # nothing to differentiate: no graph for the new shape


def test_sampled_modes_are_refused():
    net, lik, _, _ = _problem("heteroscedastic")
    with pytest.raises(ValueError, match="deterministic modes"):
        CompiledStep(net, lik, EmpiricalBayes(), "sample")


def _data(rows: int = 48):
    torch.manual_seed(1)
    x = torch.randn(rows, 3)
    y = x[:, 0] + 0.3 * torch.randn(rows)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


@pytest.mark.parametrize("optimizer", ["adam", "lbfgs"])
def test_lightning_fit_with_the_whole_step_follows_the_eager_fit(optimizer):
    fitted = {}
    for compile in (False, dict(FAST)):
        torch.manual_seed(0)
        model = DVIRegressor(
            in_features=3, hidden=[8], num_data=48, mode="diag", optimizer=optimizer,
            compile=compile, lr=1e-2,
        )  # fmt: skip
        data = _data()
        if optimizer == "lbfgs":  # full batch
            data = torch.utils.data.DataLoader(data.dataset, batch_size=48)
        # float64, and two L-BFGS steps: an L-BFGS path amplifies rounding about 1000-fold per
        # step on this problem (1e-14, 2e-11, 3e-9, ... between the two)
        steps = 2 if optimizer == "lbfgs" else 6
        cpu_trainer(max_steps=steps, enable_checkpointing=False, precision="64-true").fit(
            model, data
        )
        fitted[bool(compile)] = torch.cat([p.detach().flatten() for p in model.parameters()])
        if compile:
            assert isinstance(model.__dict__["_compiled_elbo_fn"], CompiledStep)
    torch.testing.assert_close(fitted[True], fitted[False], rtol=1e-7, atol=1e-8)


def test_lightning_keeps_the_forward_compile_for_samples_and_untraceable_steps(monkeypatch):
    sampled = DVIRegressor(in_features=3, hidden=[4], num_data=48, mode="sample", compile=FAST)
    assert isinstance(sampled._compiled_elbo(), CompiledELBO)
    cuda_graphs = DVIRegressor(in_features=3, hidden=[4], num_data=48, compile="reduce-overhead")
    assert isinstance(cuda_graphs._compiled_elbo(), CompiledELBO)

    def fail(self, *args):
        raise StepTraceError("cannot record this step")

    monkeypatch.setattr(CompiledStep, "_trace", fail)
    model = DVIRegressor(in_features=3, hidden=[4], num_data=48, mode="diag", compile=dict(FAST))
    with pytest.warns(UserWarning, match="falling back to compile_elbo"):
        cpu_trainer(max_steps=2, enable_checkpointing=False).fit(model, _data())
    assert isinstance(model.__dict__["_compiled_elbo_fn"], CompiledELBO)


def test_a_traced_cpu_erfc_is_one_opaque_aten_call_with_erfcs_values_and_gradient():
    from torch.fx.experimental.proxy_tensor import make_fx

    from lightning_dvi.moments import policy

    x = torch.linspace(-3.0, 9.0, policy.OPAQUE_ERFC_NUMEL, dtype=torch.float64)
    with policy.step_trace():
        graph = make_fx(policy.erfc)(x)
        small = make_fx(policy.erfc)(x[:100])
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets == ["lightning_dvi.erfc.default"]
    assert [str(n.target) for n in small.graph.nodes if n.op == "call_function"] == [
        "aten.erfc.default"
    ]  # below the threshold inductor fuses its own erfc
    torch.testing.assert_close(graph(x), torch.special.erfc(x), rtol=0, atol=0)
    leaf = x[::997].clone().requires_grad_()
    assert torch.autograd.gradcheck(torch.ops.lightning_dvi.erfc, (leaf,))
    assert policy.erfc(x) is not None and not policy.tracing()  # eager: torch.special.erfc


def test_a_traced_elementwise_bound_runs_on_flat_buffers_with_the_same_values_and_gradient():
    """softplus_normal_bound on [N, 10] while traced: on 1-D buffers (opaque copies), same numbers."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lightning_dvi.likelihoods.functional import softplus_normal_bound
    from lightning_dvi.moments import policy

    gen = torch.Generator().manual_seed(0)
    rows = policy.FLAT_BUFFER_NUMEL // 10 + 1
    mean = 6 * torch.randn(rows, 10, generator=gen, dtype=torch.float64)
    var = torch.rand(rows, 10, generator=gen, dtype=torch.float64) * 40  # every branch

    def value_and_grad(m, v):
        out = softplus_normal_bound(m, v)
        return (out, *torch.autograd.grad(out.sum(), [m, v]))

    leaves = [mean.clone().requires_grad_(), var.clone().requires_grad_()]
    eager = value_and_grad(*leaves)
    with policy.step_trace(), torch.enable_grad():
        graph = make_fx(value_and_grad)(*leaves)
        small = make_fx(value_and_grad)(leaves[0][:8].detach().requires_grad_(),
                                        leaves[1][:8].detach().requires_grad_())  # fmt: skip
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("lightning_dvi.flat_buffer.default") == 2
    assert not any("flat_buffer" in str(n.target) for n in small.graph.nodes)  # below the size
    for got, want in zip(graph(mean, var), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # element by element the same
    leaf = mean[:2].clone().requires_grad_()
    assert torch.autograd.gradcheck(torch.ops.lightning_dvi.flat_buffer, (leaf,))
    assert policy.flat_elementwise(softplus_normal_bound, mean, var) is None  # eager: None


def test_the_traced_bouchard_shift_runs_classes_first_with_the_eager_root():
    """While traced on a CPU the shift's Newton steps run on [K, N] copies: the same root."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from lightning_dvi.likelihoods import logistic_normal as ln
    from lightning_dvi.moments import policy

    gen = torch.Generator().manual_seed(3)
    rows = policy.FLAT_BUFFER_NUMEL // 10 + 1
    mean = 8 * torch.randn(rows, 10, generator=gen, dtype=torch.float64)
    var = 5 * torch.rand(rows, 10, generator=gen, dtype=torch.float64)

    def shift_and_grad(m, v):
        c = ln._bouchard_shift(m, v)
        return (c, *torch.autograd.grad(c.sum(), [m, v]))

    leaves = [mean.clone().requires_grad_(), var.clone().requires_grad_()]
    eager = shift_and_grad(*leaves)
    with policy.step_trace(), torch.enable_grad():
        graph = make_fx(shift_and_grad)(*leaves)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert targets.count("lightning_dvi.flat_buffer.default") == 2  # mean and var, [K, N]
    # the eager steps stop at their fixed point, the traced ones run all 16: the same root
    for got, want in zip(graph(mean, var), eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert policy.classes_first(mean) is None  # eager: the rows as they are


def test_the_traced_float32_relu_moments_match_the_eager_ones():
    """While traced on a CPU, float32 takes the all-float32 (Dekker) path for phi(a)."""
    from lightning_dvi.moments import policy
    from lightning_dvi.moments._relu import _relu_diag_forward

    mean = torch.linspace(-40.0, 40.0, 4001).repeat(3)
    var = torch.cat([torch.full((4001,), v) for v in (1e-3, 1.0, 30.0)])
    eager = _relu_diag_forward(mean, var)
    with policy.step_trace():
        traced = _relu_diag_forward(mean, var)
    reference = _relu_diag_forward(mean.double(), var.double())
    for e, t, r in zip(eager, traced, reference, strict=True):
        normal = r.abs() > 1e-25  # where float32 holds the value
        err_eager = ((e.double() - r).abs() / r.abs())[normal].max()
        err_traced = ((t.double() - r).abs() / r.abs())[normal].max()
        # float32 accuracy either way (the far tail of the variance: about 1e-3 for both)
        assert err_traced <= 2 * err_eager + 1e-6


def test_an_export_keeps_erfc_a_plain_aten_op():
    """An exported file must run without this package: no lightning_dvi op in its graph."""
    from lightning_dvi.moments import policy

    class Erfc(torch.nn.Module):
        def forward(self, x):
            return policy.erfc(x)

    x = torch.rand(policy.OPAQUE_ERFC_NUMEL)
    exported = torch.export.export(Erfc(), (x,))
    targets = [str(n.target) for n in exported.graph.nodes if n.op == "call_function"]
    assert targets and not any("lightning_dvi" in t for t in targets)

    class Bound(torch.nn.Module):  # nor the flat buffers of an elementwise formula
        def forward(self, m, v):
            from lightning_dvi.likelihoods.functional import softplus_normal_bound

            return softplus_normal_bound(m, v)

    m = torch.randn(policy.FLAT_BUFFER_NUMEL // 10 + 1, 10)
    exported = torch.export.export(Bound(), (m, m.abs()))
    assert not any("lightning_dvi" in str(n.target) for n in exported.graph.nodes)


def _transformer():
    class Encoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = torch.nn.TransformerEncoderLayer(
                d_model=8, nhead=2, dim_feedforward=16, batch_first=True, dropout=0.0
            )
            self.head = torch.nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.enc(x).mean(1))

    return Encoder()


@pytest.mark.parametrize("kind", ["cnn", "converted", "transformer"])
def test_convolutions_normalisations_and_attention_record_as_one_graph(kind):
    from torch import nn

    from lightning_dvi.nn import cnn, from_torch

    torch.manual_seed(0)
    if kind == "cnn":
        net, lik = cnn(1, 10, channels=[4, 8], hidden=[16]), Categorical(10)
        x, y = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    elif kind == "converted":
        torch_net = nn.Sequential(
            nn.Linear(4, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 16),
            nn.BatchNorm1d(16), nn.SiLU(), nn.Linear(16, 2),
        )  # fmt: skip
        net, lik = from_torch(torch_net), HeteroscedasticGaussian()
        x, y = torch.randn(6, 4), torch.randn(6)
    else:
        net, lik = from_torch(_transformer()), Categorical(3)
        x, y = torch.randn(6, 5, 8), torch.randint(0, 3, (6,))
    net, x = net.double(), x.double()
    if y.is_floating_point():
        y = y.double()
    _, want, _ = _eager(net, lik, EmpiricalBayes(), x, y, "diag")
    net.zero_grad(set_to_none=True)
    compile_step(net, lik, EmpiricalBayes(), mode="diag", **FAST)(x, y, 50, 0.3).loss.backward()
    # converted: the trace-safe paths (autograd through the formulas where eager runs fused
    # backward Functions, e.g. BatchNorm's) agree with eager to 8e-9 of a gradient's largest
    # entry in this stack of layers (1e-7 relative on small entries), even run eagerly under
    # step_trace(); each layer kind alone agrees to 1e-11 or better (scratch checks)
    rtol = 1e-6 if kind == "converted" else 1e-9
    for g, w in zip(_grads(net), want, strict=False):
        torch.testing.assert_close(g, w, rtol=rtol, atol=1e-12)


def test_traced_objective_recipe_times_the_compiled_objective_against_eager():
    """recipes/traced_objective.py (docs/speed_current.md's objective table) on a small head."""
    recipe = load_recipe("traced_objective")
    results = recipe.main(["--rows", "120", "--methods", "softplus,series", "--repeats", "1"])
    assert set(results) == {"softplus", "series"}
    for r in results.values():
        assert r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] > 0
        assert r["value_rel_diff"] < 1e-6  # the compiled graph computes the eager values


def test_classifier_step_recipe_times_eager_and_compiled_steps():
    """recipes/classifier_step.py (docs/speed_current.md), on a small budget."""
    recipe = load_recipe("classifier_step")
    out = recipe.main(["--batch", "32", "--warmup", "2", "--rounds", "2", "--backend", "eager"])
    assert set(out) == {"compile_s", "eager_ms", "compiled_ms"}
    assert all(v > 0 for v in out.values())

"""CompiledDeterministicELBO: the Pyro step as one recorded graph, against the eager ELBO."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.compile import StepTraceError
from lightning_dvi.priors import EmpiricalBayes
from lightning_dvi.pyro import CompiledDeterministicELBO, DeterministicELBO, DeterministicGuide

pytestmark = pytest.mark.usefixtures("pyro_state", "float64")


@pytest.fixture
def float64():
    """Float64 models (the priors' constants too): eager and compiled agree to rounding."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


# torch.compile of the recorded graph with the eager backend: the recording is what is tested
# here, quickly; one test below compiles through inductor.
FAST = {"backend": "eager"}


class Net(PyroModule):
    def __init__(self, d_in: int = 3, hidden: int = 6, d_out: int = 4) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](d_in, hidden)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([hidden, d_in]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([hidden]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](hidden, d_out)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, hidden]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


class Classifier(Net):
    def forward(self, x, y=None):  # type: ignore[override]
        logits = super().forward(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=logits), obs=y)
        return logits


class Regressor(Net):
    def __init__(self) -> None:
        super().__init__(d_out=1)

    def forward(self, x, y=None, scale=0.5):  # type: ignore[override]
        mean = super().forward(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, scale), obs=y)
        return mean


def _data(kind: str, rows: int = 24, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 3, generator=gen, dtype=dtype)
    if kind == "classifier":
        return x, torch.randint(4, (rows,), generator=gen)
    return x, torch.randn(rows, generator=gen, dtype=dtype)


def _svi_runs(kind: str, mode: str, prior=None, steps: int = 4, **options):
    """Eager and compiled SVI from the same start; their losses and final parameters."""
    x, y = _data(kind)
    out = {}
    for name, elbo in (
        ("eager", DeterministicELBO(prior=prior)),
        ("compiled", CompiledDeterministicELBO(prior=prior, **options)),
    ):
        model = Classifier() if kind == "classifier" else Regressor()
        guide = DeterministicGuide(model, mode=mode, name=name)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), elbo)
        pyro.set_rng_seed(0)  # the same initial parameters for both
        losses = [svi.step(x, y) for _ in range(steps)]
        store = pyro.get_param_store()
        params = {k.split(".", 1)[1]: v.detach().clone() for k, v in store.named_parameters()
                  if k.startswith(name + ".")}  # fmt: skip
        out[name] = (losses, params, elbo)
    return out


@pytest.mark.parametrize(
    ("kind", "mode", "eb"),
    [("classifier", "diag", False), ("classifier", "full", False), ("regression", "diag", True),
     ("regression", "full", False)],
)  # fmt: skip
def test_svi_with_the_compiled_step_follows_the_eager_svi(kind, mode, eb):
    prior = EmpiricalBayes() if eb else None
    runs = _svi_runs(kind, mode, prior=prior, **FAST)
    (eager, p_eager, _), (compiled, p_compiled, elbo) = runs["eager"], runs["compiled"]
    assert compiled == pytest.approx(eager, rel=1e-12)
    assert p_compiled.keys() == p_eager.keys() and len(p_eager) == 8
    for name, value in p_eager.items():
        torch.testing.assert_close(p_compiled[name], value, rtol=1e-10, atol=1e-12)
    assert elbo.graphs == 1  # recorded once, at the second step (the first sets the guide up)


def test_a_sampled_noise_latent_draws_anew_at_every_call_as_the_eager_step_draws():
    """The Pyro tutorial's model: a Uniform noise scale, one reparameterised draw per step."""
    x, y = _data("regression")
    net = Regressor()

    def model(x, y=None):
        return net(x, y, scale=pyro.sample("sigma", dist.Uniform(0.0, 1.0)))

    guide = DeterministicGuide(model)
    eager, compiled = DeterministicELBO(), CompiledDeterministicELBO()  # inductor
    compiled.differentiable_loss(model, guide, x, y)  # sets the guide up
    compiled.differentiable_loss(model, guide, x, y)  # records and compiles
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    losses = []
    for seed in (1, 2, 1):
        got = []
        for elbo in (eager, compiled):
            for p in params:
                p.grad = None
            pyro.set_rng_seed(seed)
            loss = elbo.differentiable_loss(model, guide, x, y)
            loss.backward()
            got.append((float(loss), [p.grad.clone() for p in params]))
        (want, want_grads), (value, grads) = got
        assert value == pytest.approx(want, rel=1e-12)  # the same draw from the same state
        for g, w in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
        losses.append(value)
    assert losses[0] != losses[1] and losses[0] == losses[2]  # a new draw at every call
    assert compiled.graphs == 1


class Subsampled(Net):
    """Mini-batches drawn inside the model: a random index per step, as in Pyro's tutorials."""

    def __init__(self) -> None:
        super().__init__(d_out=1)

    def forward(self, x, y=None):  # type: ignore[override]
        idx = torch.randperm(x.shape[0])[:8]
        mean = super().forward(x[idx]).squeeze(-1)
        with pyro.plate("data", x.shape[0], subsample=idx):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=None if y is None else y[idx])


class Declared(PyroModule):
    """A declared network in a Pyro model (PyroBayesNet): the guide's moments are substituted."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_dvi.nn import mlp
        from lightning_dvi.pyro import PyroBayesNet

        self.net = PyroBayesNet(mlp(3, [6], 1))

    def forward(self, x, y=None):
        mean = self.net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)


@pytest.mark.parametrize(("kind", "mode"), [("subsampled", "diag"), ("declared", "diag"),
                                            ("declared", "full")])  # fmt: skip
def test_subsampling_models_and_declared_networks_record_as_the_eager_step(kind, mode):
    x, y = _data("regression")
    model = Subsampled() if kind == "subsampled" else Declared()
    guide = DeterministicGuide(model, mode=mode)
    eager, compiled = DeterministicELBO(), CompiledDeterministicELBO(**FAST)
    for _ in range(2):  # sets the guide up; records
        compiled.differentiable_loss(model, guide, x, y)
    params = [p for _, p in pyro.get_param_store().named_parameters()]
    for seed in (1, 2):
        got = []
        for elbo in (eager, compiled):
            for p in params:
                p.grad = None
            pyro.set_rng_seed(seed)  # the same mini-batch for both
            loss = elbo.differentiable_loss(model, guide, x, y)
            loss.backward()
            got.append((float(loss), [p.grad.clone() for p in params]))
        assert got[1][0] == pytest.approx(got[0][0], rel=1e-12)
        for g, w in zip(got[1][1], got[0][1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert compiled.graphs == 1


def test_an_lbfgs_closure_and_a_new_batch_size():
    x, y = _data("classifier", rows=40)
    model = Classifier()
    guide = DeterministicGuide(model)
    eager, compiled = DeterministicELBO(), CompiledDeterministicELBO(**FAST)
    eager.loss(model, guide, x, y)  # sets the guide up
    params = [p for _, p in pyro.get_param_store().named_parameters()]

    def grads(elbo, x, y):
        for p in params:
            p.grad = None
        loss = elbo.differentiable_loss(model, guide, x, y)
        loss.backward()
        return float(loss), [p.grad.clone() for p in params]

    for rows in (40, 40, 17):  # the second call runs the graph; 17 rows records another
        want = grads(eager, x[:rows], y[:rows])
        got = grads(compiled, x[:rows], y[:rows])
        assert got[0] == pytest.approx(want[0], rel=1e-12)
        for g, w in zip(got[1], want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)
    assert compiled.graphs == 2

    optimizer = torch.optim.LBFGS(params, max_iter=5, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = compiled.differentiable_loss(model, guide, x, y)
        loss.backward()
        return loss

    start = eager.loss(model, guide, x, y)
    optimizer.step(closure)
    assert eager.loss(model, guide, x, y) < start
    # a second backward through one loss is refused, with the way out
    loss = compiled.differentiable_loss(model, guide, x, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="call the step again"):
        loss.backward()


def test_values_are_checked_at_compiled_calls_and_no_grad_runs_eagerly():
    x, y = _data("regression")
    model = Regressor()
    guide = DeterministicGuide(model)
    elbo = CompiledDeterministicELBO(**FAST)
    for _ in range(2):
        elbo.differentiable_loss(model, guide, x, y).backward()
    bad = y.clone()
    bad[3] = float("nan")
    with pytest.raises(ValueError, match=r"site 'obs'.*NaN"):
        elbo.differentiable_loss(model, guide, x, bad)
    labels = Classifier()
    guide2 = DeterministicGuide(labels, name="labels")
    xc, yc = _data("classifier")
    for _ in range(2):
        elbo.differentiable_loss(labels, guide2, xc, yc).backward()
    yc = yc.clone()
    yc[0] = 7  # 4 classes
    with pytest.raises(ValueError, match="site 'obs'"):
        elbo.differentiable_loss(labels, guide2, xc, yc)
    graphs = elbo.graphs
    assert elbo.loss(model, guide, x, y) == pytest.approx(
        DeterministicELBO().loss(model, guide, x, y)
    )
    assert elbo.graphs == graphs  # loss() has no gradient to compute: the eager ELBO


def test_a_new_python_argument_records_a_new_graph():
    x, y = _data("regression")
    model = Regressor()
    guide = DeterministicGuide(model)
    elbo = CompiledDeterministicELBO(**FAST)
    for scale in (0.5, 0.5, 2.0, 2.0):
        got = elbo.differentiable_loss(model, guide, x, y, scale=scale).detach()
        assert float(got) == pytest.approx(
            DeterministicELBO().loss(model, guide, x, y, scale=scale)
        )
    assert elbo.graphs == 2
    with pytest.warns(UserWarning, match="recorded and compiled 8 call signatures"):
        for scale in (3.0, 4.0, 5.0, 6.0, 7.0, 8.0):  # a value that changes at every call
            elbo.differentiable_loss(model, guide, x, y, scale=scale)
    # with Pyro's validation off a NaN observation is not named: the call warns and returns
    # the eager step's NaN loss, as DeterministicELBO does
    bad = y.clone()
    bad[0] = float("nan")
    with pyro.validation_enabled(False):
        elbo.differentiable_loss(model, guide, x, y)  # records this signature
        graphs = elbo.graphs
        with pytest.warns(UserWarning, match="Encountered NaN"):
            loss = elbo.differentiable_loss(model, guide, x, bad)
    assert loss.isnan() and loss.requires_grad and elbo.graphs == graphs


def test_what_cannot_be_recorded_is_refused_by_name():
    x, y = _data("regression")

    class Scaled(Regressor):  # a plain nn.Parameter: read without a pyro.param statement
        def __init__(self) -> None:
            super().__init__()
            self.gain = nn.Parameter(torch.ones(()))

        def forward(self, x, y=None, scale=0.5):  # type: ignore[override]
            mean = Net.forward(self, x).squeeze(-1) * self.gain
            with pyro.plate("data", x.shape[0]):
                pyro.sample("obs", dist.Normal(mean, scale), obs=y)

    model, elbo = Scaled(), CompiledDeterministicELBO(**FAST)
    guide = DeterministicGuide(model, name="gain")
    elbo.differentiable_loss(model, guide, x, y)
    with pytest.raises(StepTraceError, match=r"requires gradients without a pyro\.param"):
        elbo.differentiable_loss(model, guide, x, y)

    class Opaque:  # not a tensor or a plain value: cannot be part of a call signature
        pass

    def model_with(x, y=None, extra=None):
        return Regressor.forward(plain, x, y)

    plain = Regressor()
    guide = DeterministicGuide(model_with, name="opaque")
    elbo = CompiledDeterministicELBO(**FAST)
    elbo.differentiable_loss(model_with, guide, x, y, extra=Opaque())
    with pytest.warns(UserWarning, match="cannot be part of a compiled call signature"):
        loss = elbo.differentiable_loss(model_with, guide, x, y, extra=Opaque())
    assert float(loss) == pytest.approx(DeterministicELBO().loss(model_with, guide, x, y))
    assert elbo.graphs == 0

    pyro.settings.set(module_local_params=True)
    try:
        with pytest.raises(NotImplementedError, match="module_local_params"):
            elbo.differentiable_loss(model_with, guide, x, y)
    finally:
        pyro.settings.set(module_local_params=False)

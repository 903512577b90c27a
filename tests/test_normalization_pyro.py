"""A user's Pyro model with ``nn.LayerNorm``/``nn.BatchNorm1d`` in the DVI moment pass."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.nn import BatchNorm1d, LayerNorm
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, MomentTensor


class _Classifier(PyroModule):
    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](4, 16)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([16, 4]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([16]).to_event(1))
        self.norm = norm
        self.fc2 = PyroModule[nn.Linear](16, 3)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([3, 16]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([3]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(torch.relu(self.norm(self.fc1(x))))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Categorical(logits=out), obs=y)
        return out


@pytest.mark.parametrize(("norm", "mode"), [(nn.LayerNorm, "full"), (nn.BatchNorm1d, "diag")])
def test_a_pyro_model_with_a_normalization_layer_trains_by_the_moment_pass(
    pyro_state, norm, mode
) -> None:
    gen = torch.Generator().manual_seed(0)
    y = torch.randint(3, (120,), generator=gen)
    x = 3 * torch.randn(3, 4, generator=gen)[y] + torch.randn(120, 4, generator=gen)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = _Classifier(norm(16))
    svi = SVI(model, DeterministicGuide(model, mode=mode), pyro.optim.Adam({"lr": 0.02}),
              DeterministicELBO())  # fmt: skip
    losses = [svi.step(x, y) for _ in range(20)]
    assert losses[-1] < 0.7 * losses[0], losses
    if norm is nn.BatchNorm1d:  # torch's module counts the batches (one more: the guide's
        # setup runs the model once), the moment pass updates the statistics
        assert int(model.norm.num_batches_tracked) == 21
        assert model.norm.running_mean.abs().sum() > 0


def test_the_moment_pass_runs_the_declared_modules() -> None:
    torch.manual_seed(0)
    x = MomentTensor(torch.randn(6, 5), var=torch.rand(6, 5), sources=("w",))
    ln = nn.LayerNorm(5)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    ref = LayerNorm(5)
    ref.load_state_dict(ln.state_dict())
    out, want = ln(x), ref(Gaussian(x.dvi_mean, var=x.dvi_var), mode="diag")
    torch.testing.assert_close((out.dvi_mean, out.dvi_var), (want.mean, want.var))
    bn = nn.BatchNorm1d(5).eval()
    ref_bn = BatchNorm1d(5).eval()
    out, want = (
        F.batch_norm(x, bn.running_mean, bn.running_var, eps=1e-5),
        ref_bn(Gaussian(x.dvi_mean, var=x.dvi_var), mode="diag"),
    )
    torch.testing.assert_close((out.dvi_mean, out.dvi_var), (want.mean, want.var))

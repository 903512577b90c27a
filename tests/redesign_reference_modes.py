"""Fixed-seed reference of the propagation modes (issue 40, item 2).

Run before and after a change that must not alter behaviour:

    python tests/redesign_reference_modes.py capture /tmp/ref_modes.pt
    python tests/redesign_reference_modes.py compare /tmp/ref_modes.pt

``capture`` records, in float64 at fixed seeds and one torch thread: the forward output and the
parameter gradients of a dense stack (``BayesLinear``), a convolutional stack (``BayesConv2d``,
pooling, ``Flatten``) and a stack with a full-covariance head (``BayesLinearFullCov``) in every
mode (``full``, ``diag``, ``sample`` and ``local`` with 3 seeded draws); their KL under a fixed
prior and empirical Bayes; the ELBO of :func:`~lightning_dvi.objective.elbo` in every mode; two
Pyro SVI steps of a ``DeterministicGuide`` + ``DeterministicELBO`` (a ``PyroModule`` model and a
declared network through ``PyroBayesNet``, full and diag) and a ``Predictive`` draw (weights
substituted as values, dense and convolutional); and the forward of networks converted by
``from_torch`` (a small ResNet and a small transformer encoder) in every mode. ``compare``
recomputes everything and reports each entry that is not bit-identical, with the comparison of
``tests/redesign_reference_supervision.py``. Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI, Predictive
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import (
    AvgPool2d,
    BayesConv2d,
    BayesLinear,
    BayesLinearFullCov,
    Flatten,
    ReLU,
    Sequential,
    from_torch,
)
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, PyroBayesNet

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from redesign_reference_supervision import main

F64 = torch.float64
MODES: tuple[tuple[str, int | None], ...] = (
    ("full", None),
    ("diag", None),
    ("sample", 3),
    ("local", 3),
)


def _dense() -> nn.Module:
    return Sequential(BayesLinear(3, 5, init_scale=0.3), ReLU(), BayesLinear(5, 2, init_scale=0.2))


def _conv() -> nn.Module:
    return Sequential(
        BayesConv2d(1, 2, 3, padding=1, init_scale=0.2),
        ReLU(),
        AvgPool2d(2),
        Flatten(),
        BayesLinear(2 * 4 * 4, 2, init_scale=0.1),
    )


def _full_cov() -> nn.Module:
    net = Sequential(BayesLinear(3, 4, init_scale=0.3), ReLU(), BayesLinearFullCov(4, 2))
    with torch.no_grad():
        net[2].tril.normal_(0.0, 0.1)
    return net


STACKS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "dense": (_dense, (4, 3)),
    "conv": (_conv, (2, 1, 8, 8)),
    "full_cov": (_full_cov, (4, 3)),
}


def _flat(out: Any) -> dict[str, torch.Tensor]:
    if isinstance(out, Gaussian):
        got = {"mean": out.mean, "var": out.var}
        if out.cov is not None:
            got["cov"] = out.cov
        return got
    return {"value": out}


def _forward(net: nn.Module, x: torch.Tensor, mode: str, s: int | None) -> dict[str, Any]:
    net.zero_grad()
    torch.manual_seed(7)
    out = net(x, mode=mode) if s is None else net(x, mode=mode, num_samples=s)
    flat = _flat(out)
    sum(t.sum() for t in flat.values()).backward()  # type: ignore[union-attr]
    grads = {k: p.grad.detach().clone() for k, p in net.named_parameters() if p.grad is not None}
    return {"out": {k: v.detach().clone() for k, v in flat.items()}, "grads": grads}


def _stacks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (build, shape) in STACKS.items():
        torch.manual_seed(0)
        net = build().double()
        x = torch.randn(*shape, dtype=F64)
        for mode, s in MODES:
            out[f"{name}/{mode}"] = _forward(net, x, mode, s)
        out[f"{name}/kl"] = {
            "fixed": GaussianPrior(0.5).kl(net).detach(),
            "eb": EmpiricalBayes().kl(net).detach(),
        }
        if name != "conv":
            y = torch.randn(shape[0], dtype=F64)
            for mode, s in MODES:
                torch.manual_seed(3)
                terms = elbo(
                    net, HeteroscedasticGaussian(), EmpiricalBayes(), x, y, num_data=50,
                    mode=mode, num_samples=s,  # type: ignore[arg-type]
                )  # fmt: skip
                out[f"{name}/elbo/{mode}"] = {"loss": terms.loss.detach(), "kl": terms.kl.detach()}
    return out


class _PyroModel(PyroModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = PyroModule[nn.Linear](3, 6)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([6, 3]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([6]).to_event(1))
        self.fc2 = PyroModule[nn.Linear](6, 1)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 6]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        mean = self.fc2(torch.relu(self.fc1(x))).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mean, 0.5), obs=y)
        return mean


class _Declared(PyroModule):
    def __init__(self, net: nn.Module, classes: int | None = None) -> None:
        super().__init__()
        self.net = PyroBayesNet(net)
        self.classes = classes

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.net(x)
        with pyro.plate("data", x.shape[0]):
            if self.classes is None:
                pyro.sample("obs", dist.Normal(out[..., 0], 0.5), obs=y)
            else:
                pyro.sample("obs", dist.Categorical(logits=out), obs=y)
        return out


def _svi(model: PyroModule, x: torch.Tensor, y: torch.Tensor, mode: str) -> dict[str, Any]:
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    guide = DeterministicGuide(model, mode=mode)  # type: ignore[arg-type]
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), DeterministicELBO())
    losses = torch.tensor([svi.step(x, y) for _ in range(2)], dtype=F64)
    params = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    pyro.set_rng_seed(1)
    draws = Predictive(model, guide=guide, num_samples=3, return_sites=["obs", "_RETURN"])(x)
    return {
        "losses": losses,
        "params": params,
        "predictive": {k: v.detach() for k, v in draws.items()},
    }


def _pyro() -> dict[str, Any]:
    out: dict[str, Any] = {}
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(8, 3, generator=gen, dtype=F64)
    y = torch.randn(8, generator=gen, dtype=F64)
    images = torch.randn(4, 1, 8, 8, generator=gen, dtype=F64)
    labels = torch.tensor([0, 1, 1, 0])
    for mode in ("full", "diag"):
        torch.manual_seed(0)
        out[f"pyro/model/{mode}"] = _svi(_PyroModel().double(), x, y, mode)
        torch.manual_seed(0)
        out[f"pyro/declared/{mode}"] = _svi(_Declared(_dense().double()).double(), x, y, mode)
        torch.manual_seed(0)
        model = _Declared(_conv().double(), classes=2).double()
        out[f"pyro/declared_conv/{mode}"] = _svi(model, images, labels, mode)
    return out


class _Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


class _ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU())
        self.block = _Block(3)
        self.pool = nn.AvgPool2d(2)
        self.head = nn.Linear(3 * 4 * 4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.pool(self.block(self.stem(x))), 1))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 8)
        self.layer = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=True
        )
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.embed(x)).mean(dim=1))


def _converted() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, build, shape in (
        ("resnet", _ResNet, (2, 1, 8, 8)),
        ("transformer", _Encoder, (2, 4, 5)),
    ):
        torch.manual_seed(0)
        torch_net = build().double().eval()
        net = from_torch(torch_net, scale_fraction=0.1)
        x = torch.randn(*shape, dtype=F64)
        for mode, s in MODES:
            out[f"converted/{name}/{mode}"] = _forward(net, x, mode, s)
    return out


def capture() -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.set_default_dtype(F64)  # the Pyro models' priors too
    return {**_stacks(), **_pyro(), **_converted()}


if __name__ == "__main__":
    sys.exit(main(sys.argv, capture, __doc__ or ""))

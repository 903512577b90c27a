"""Runs one documentation example for ``tests/test_docs_examples.py``, in its own process.

Usage (the harness builds these commands; see docs/contributing.md)::

    python tests/docs_runner.py block FILE.json     # a ```python block (+ its named setup)
    python tests/docs_runner.py chain FILE.json     # a page's blocks in order (``continue``)
    python tests/docs_runner.py cli ARGS...         # what `lightning-dvi ARGS...` runs
    python tests/docs_runner.py python ARGS...      # what `python ARGS...` runs (script or -m)

With ``LIGHTNING_DVI_DOCS_FAST=1`` (the harness sets it) every Lightning ``Trainer`` built in the
process is clamped to at most ``FAST_EPOCHS`` epochs and ``FAST_STEPS`` optimisation steps, so a
documented 300-epoch run, in Python or through the CLI and its YAML recipes, takes seconds, and
torch runs on one thread. The clamp wraps ``Trainer.__init__`` (``functools.wraps`` keeps its
signature for LightningCLI).

``SETUPS`` holds the hidden preambles a page can ask for with ``<!-- docs-test: setup=NAME -->``
before a block that shows only part of a program (e.g. the two swapped lines of a Pyro model).
"""

from __future__ import annotations

import functools
import json
import os
import runpy
import sys
from typing import Any

FAST_ENV = "LIGHTNING_DVI_DOCS_FAST"
FAST_EPOCHS = 2
FAST_STEPS = 20

_PYRO_TUTORIAL = """
import pyro
import pyro.distributions as dist
import torch
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample
from torch import nn


class BNN(PyroModule):
    def __init__(self, hidden=16):
        super().__init__()
        sizes = [(1, hidden), (hidden, 1)]
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](i, o) for i, o in sizes])
        for layer, (i, o) in zip(self.layers, sizes):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))

    def forward(self, x, y=None):
        mu = self.layers[1](torch.relu(self.layers[0](x))).squeeze(-1)
        sigma = pyro.sample("sigma", dist.Uniform(0.0, 1.0))
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mu, sigma), obs=y)
        return mu


pyro.clear_param_store()
pyro.set_rng_seed(0)
model = BNN()
x = torch.linspace(-1, 1, 32).unsqueeze(-1)
y = torch.sin(3 * x[:, 0]) + 0.1 * torch.randn(32)
x_test = torch.linspace(-1, 1, 8).unsqueeze(-1)
optim = pyro.optim.Adam({"lr": 1e-2})
"""

SETUPS: dict[str, str] = {
    # A tutorial-style Pyro BNN class BNN (PyroModule[nn.Linear], PyroSample priors, a Uniform
    # noise scale), an instance `model`, toy data x, y, x_test and an optimiser `optim`: what
    # the Pyro snippets take as given.
    "pyro_tutorial": _PYRO_TUTORIAL,
    # Imports a later snippet of docs/pyro.md relies on.
    "pyro_imports": "import pyro\nfrom lightning_dvi.pyro import DeterministicGuide\n",
    # The callback whose signature docs/lightning.md shows.
    "empirical_bayes": "from lightning_dvi.callbacks import EmpiricalBayesRefresh\n",
    # A last.ckpt where the toy recipe leaves it (a short run), for the checkpoint snippet.
    "toy_checkpoint": (
        "from lightning_dvi import DVIRegressor\n"
        "from lightning_dvi.cli import cli\n"
        "cli(['fit', '--config', 'recipes/toy_heteroscedastic.yaml',"
        " '--trainer.max_epochs', '1', '--test_after_fit', 'false'])\n"
    ),
}


def fast_mode() -> bool:
    """Whether small sizes were asked for (``LIGHTNING_DVI_DOCS_FAST`` set and not ``0``)."""
    return os.environ.get(FAST_ENV, "0") not in ("", "0")


def clamp_trainer(max_epochs: int = FAST_EPOCHS, max_steps: int = FAST_STEPS) -> None:
    """Make every ``Trainer`` stop after ``max_epochs`` epochs or ``max_steps`` steps at most."""
    from lightning.pytorch import Trainer

    original = Trainer.__init__
    if getattr(original, "_docs_fast", False):
        return

    @functools.wraps(original)
    def clamped_init(self: Trainer, *args: Any, **kwargs: Any) -> None:
        epochs = kwargs.get("max_epochs")
        steps = kwargs.get("max_steps")
        kwargs["max_epochs"] = (
            max_epochs if epochs is None or epochs < 0 else min(epochs, max_epochs)
        )
        kwargs["max_steps"] = max_steps if steps is None or steps < 0 else min(steps, max_steps)
        original(self, *args, **kwargs)

    clamped_init._docs_fast = True  # type: ignore[attr-defined]
    Trainer.__init__ = clamped_init  # type: ignore[method-assign]


def _run_block(spec_path: str) -> None:
    with open(spec_path) as handle:
        spec = json.load(handle)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    if spec.get("setup"):
        exec(
            compile(SETUPS[spec["setup"]], f"<docs-test setup {spec['setup']}>", "exec"), namespace
        )
    # Padding with blank lines makes tracebacks point at the page's own line numbers.
    for first_line, code in [*spec.get("earlier", []), [spec["first_line"], spec["code"]]]:
        exec(compile("\n" * first_line + code, spec["page"], "exec"), namespace)


def _run_chain(spec_path: str) -> None:
    """Run a tutorial page's python blocks in order in one namespace (``continue`` blocks).

    After each block listed in ``checkpoints`` ends, its line goes to the ``done`` file: that
    block's test passes, since everything before it ran as its own run would have run it
    (every earlier python block of the page, in order, in one namespace). The first exception
    ends the run with its traceback (page line numbers) and exit status 1.
    """
    with open(spec_path) as handle:
        spec = json.load(handle)
    namespace: dict[str, Any] = {"__name__": "__main__"}
    checkpoints = set(spec["checkpoints"])
    with open(spec["done"], "a") as done:
        for first_line, code in spec["blocks"]:
            exec(compile("\n" * first_line + code, spec["page"], "exec"), namespace)
            if first_line in checkpoints:
                done.write(f"{first_line}\n")
                done.flush()


def main(argv: list[str]) -> None:
    """Dispatch ``block`` / ``cli`` / ``python`` (see the module docstring)."""
    if fast_mode():
        kind_args = argv[1:]
        if any(arg.startswith("--ckpt_path") for arg in kind_args):
            # a resumed run trains on from an earlier (clamped) run's checkpoint: clamping it to
            # the same limits would leave nothing to train, which the CLI refuses
            clamp_trainer(2 * FAST_EPOCHS, 2 * FAST_STEPS)
        else:
            clamp_trainer()
        # Small examples run fastest on one thread; extra intra-op threads spin on shared CPUs.
        import torch

        torch.set_num_threads(1)
    kind, rest = argv[0], argv[1:]
    if kind == "block":
        _run_block(rest[0])
    elif kind == "chain":
        _run_chain(rest[0])
    elif kind == "cli":
        from lightning_dvi.cli import main as cli_main

        # sys.argv keeps this script first, so DDP's re-launch of sys.argv comes back here.
        cli_main(rest)
    elif kind == "python":
        if rest[:1] == ["-m"]:
            sys.argv = [rest[1], *rest[2:]]
            runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(rest)
            runpy.run_path(rest[0], run_name="__main__")
    else:
        raise SystemExit(f"unknown kind {kind!r}: expected block, chain, cli or python")


if __name__ == "__main__":
    main(sys.argv[1:])

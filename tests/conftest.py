import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
UCI_DIR = REPO.parent / "shared" / "data" / "uci"

# The suite runs as two xdist workers on two cores: one intra-op thread per worker (and per
# subprocess it starts), instead of two threads each spinning against the other worker's. The
# networks under test are tiny, so a second thread buys nothing and oversubscription costs a lot
# (a diabetes fit: 232 s with 2 threads on a loaded machine, 2.6 s with one).
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread():
    """Tiny networks: one torch thread (two spin against each other on shared cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def uci_dir() -> Path:
    """The shared UCI data; under CI its absence is an error, not a skip."""
    if not UCI_DIR.is_dir():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"UCI data expected at {UCI_DIR} under CI")
        pytest.skip(f"UCI data not found at {UCI_DIR}")
    return UCI_DIR


@pytest.fixture
def pyro_state():
    """Fresh Pyro param store and seed; one torch thread (tiny ops contend on 2 shared cores)."""
    import pyro

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli_workdir(tmp_path, monkeypatch):
    """For in-process ``lightning_dvi.cli.cli`` runs: recipes write ``runs/`` under ``tmp_path``,
    pytest's own argv does not look like CLI arguments, and the recipes' ``num_threads`` is undone.
    """
    import sys

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dvi"])
    threads = torch.get_num_threads()
    yield tmp_path
    torch.set_num_threads(threads)


@pytest.fixture
def cli_isolated(tmp_path, monkeypatch):
    """Run a recipe in ``tmp_path`` as the CLI would: its ``runs/`` stay out of the checkout,
    pytest's argv does not look like CLI arguments, and the recipes' ``num_threads`` is undone."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dvi"])
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)

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


# The longest tests (a few to tens of seconds each, measured on the 2-core CI machine), started
# first when the suite runs on xdist workers: with ``--dist worksteal`` (make test) the first
# worker runs them while the other drains the rest, and the suite ends on short tests instead of
# one worker finishing a long one while the other idles. Node-id prefixes, longest first (the
# 2-core CI at 713603c); a stale entry matches nothing and changes no result, only the order:
# tests/test_long_first.py fails on one.
LONG_FIRST = (
    "tests/test_export.py::test_onnx_files_match_torch_in_onnxruntime",
    "tests/test_docs_examples.py::test_documented_example_runs[README.md:167]",
    "tests/test_resume_cli.py::test_a_killed_fit_resumes",
    "tests/test_export_fresh_process.py::",
    "tests/test_transformer_benchmark.py::test_quick_recipe_run",
    "tests/test_docs_examples.py::test_documented_example_runs[docs/byo_network.md:69]",
    "tests/test_tables.py::test_ddp_predict_writes_one_file",
    "tests/test_docs_examples.py::test_documented_example_runs[docs/pyro.md:7]",
    "tests/test_docs_examples.py::test_documented_example_runs[docs/pyro.md:126]",
    "tests/test_compile_step.py::test_compiled_elbo_matches_eager_values_and_gradients",
    "tests/test_ddp.py::test_two_process_ddp_matches_one_process[cold]",
    "tests/test_docs_examples.py::test_documented_example_runs[docs/lightning.md:453]",
    "tests/test_cli_user_files.py::test_a_classifier_run_summary",
    "tests/test_noise_bound.py::test_the_bound_travels_with_the_exported_predictive",
    "tests/test_export.py::test_pt2_file_runs_without_lightning_dvi",
    "tests/test_warm_start_large.py::test_a_real_cli_run",
    "tests/test_cli.py::test_console_script_reports_bad_yaml_value",
    "tests/test_benchmarks_resnet_digits.py::test_quick_mode_writes_every_row",
    "tests/test_cli_user_files.py::test_a_label_only_in_the_test_file",
)


def long_first(items: list, prefixes: tuple[str, ...] = LONG_FIRST) -> list:
    """``items`` with those whose node id starts with one of ``prefixes`` first, in the order of
    ``prefixes``; the others after them in their collected order."""

    def rank(item) -> int:
        return next((i for i, p in enumerate(prefixes) if item.nodeid.startswith(p)), len(prefixes))

    return sorted(items, key=rank)  # stable: ties keep the collected order


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    """Under xdist only (every worker sorts its identical collection the same way)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items[:] = long_first(items)


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

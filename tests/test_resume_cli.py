"""Issue 24, the real thing: ``lightning-dvi fit`` subprocesses, one killed with SIGKILL.

Three runs of the toy recipe in one directory (each a real console-script process). The recipe
trains by the fast protocol (issue 39): a point-estimate warm start, then one full-batch L-BFGS
step per epoch, a checkpoint after every step, early stopping and best-weight restoring on
val/nll.

1. an uninterrupted run, its standard error on a pseudo-terminal (a person watching): it shows
   Lightning's progress bar with the loss, and still prints where the log, plots and
   checkpoint are;
2. a fresh run of the same recipe and seed, held inside an L-BFGS step (its line search
   half done, after a few checkpoints) by a test callback and killed with SIGKILL, its output
   piped (plain progress lines, no bar);
3. ``--ckpt_path last``, which must pick run 2's checkpoint, say so, skip the warm start, and
   finish with the same weights, L-BFGS memory, empirical-Bayes, early-stopping and best-weight
   state and the same test metrics as run 1, bit for bit.

Every byte of run 1's and run 2's checkpoints must be as it was after the later runs.
"""

from __future__ import annotations

import csv
import fcntl
import os
import pty
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "toy_heteroscedastic.yaml"
RUNS = Path("runs/toy_heteroscedastic/lightning_logs")
# 6 epochs of one full-batch L-BFGS step on 200 rows, validated after each: a few seconds per run
EPOCHS = 6
ARGS = [
    "fit", "--config", str(TOY), "--trainer.max_epochs", str(EPOCHS),
    "--data.init_args.num_train", "200",
]  # fmt: skip
# held before the backward pass of the 4th loss evaluation of epoch 3's L-BFGS step (its line
# search under way); last.ckpt holds epoch 2, i.e. global step 3
KILL_EPOCH, KILL_EVALUATION = 3, 4
# the callbacks whose state must come back bit for bit (RunCheckpoint's names its own directory)
RESUMED_STATE = ("EmpiricalBayes", "EarlyStopping", "RestoreBestWeights")


def _command() -> list[str]:
    script = Path(sys.executable).with_name("lightning-dvi")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "lightning_dvi.cli"]


def _env(tty: bool = False) -> dict[str, str]:
    paths = [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    if tty:
        env.pop("CI", None)  # a person at a terminal, even when the suite runs under CI
        env["TERM"] = "xterm"
    return env


def _run_on_a_terminal(cwd: Path) -> tuple[str, str]:
    """Run with standard error on a pseudo-terminal; returns (stdout, terminal output)."""
    leader, follower = pty.openpty()
    # a terminal of 24 rows and 120 columns (a fresh pseudo-terminal has 0 of each)
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the terminal closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    proc = subprocess.Popen(
        [*_command(), *ARGS], cwd=cwd, env=_env(tty=True), stdout=subprocess.PIPE,
        stderr=follower, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    os.close(follower)
    stdout, _ = proc.communicate(timeout=300)
    reader.join(timeout=10)
    os.close(leader)
    terminal = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, terminal[-3000:]
    return stdout.decode(), terminal


def _metrics(stdout: str) -> dict[str, str]:
    """The summary's metric lines, as printed."""
    return dict(line.split()[:2] for line in stdout.splitlines() if line.startswith("  test/"))


def _last_csv_row(run_dir: Path) -> dict[str, str]:
    with (run_dir / "metrics.csv").open() as handle:
        rows = [r for r in csv.DictReader(handle) if r.get("test/nll")]
    return rows[-1]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((run_dir / "checkpoints").iterdir())}


def _assert_identical(a: Any, b: Any, where: str) -> None:
    """Nested checkpoint state (dicts, lists, tensors, numbers) equal bit for bit."""
    if isinstance(a, torch.Tensor):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=where)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            _assert_identical(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, type(a)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_a_killed_fit_resumes_to_the_uninterrupted_result_and_no_run_overwrites_another(
    tmp_path,
):
    # 1. uninterrupted, watched on a terminal
    stdout, terminal = _run_on_a_terminal(tmp_path)
    full_dir = tmp_path / RUNS / "version_0"
    bar = terminal.replace("\r\n", "\n")  # the terminal's own line ends
    assert "\r" in bar and f"Epoch {EPOCHS - 1}: 100%" in bar, terminal[-2000:]  # TQDM, redrawn
    assert "loss=" in bar and "val/nll=" in bar  # with the loss and the key metric
    assert "Epoch" not in stdout  # standard output stays clean for the summary
    for where in ("metrics csv: ", "plot:        ", "checkpoint:  "):
        assert where in stdout, stdout[-2000:]
    assert "version_0/checkpoints/last.ckpt" in stdout
    full_metrics = _metrics(stdout)
    assert "test/nll" in full_metrics

    assert "warm start: done" in terminal  # the fast protocol's point-estimate warm start
    first = _snapshot(full_dir)

    # 2. the same run again, killed with SIGKILL inside an L-BFGS step
    flag = tmp_path / "held"
    pause = (
        '{"class_path": "resume_helpers.PauseMidStep", "init_args": '
        f'{{"epoch": {KILL_EPOCH}, "evaluation": {KILL_EVALUATION}, "flag": "{flag}"}}}}'
    )
    killed = subprocess.Popen(
        [*_command(), *ARGS, f"--trainer.callbacks+={pause}"], cwd=tmp_path, env=_env(),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    deadline = time.monotonic() + 240
    while not flag.exists():
        assert killed.poll() is None, killed.communicate()[1].decode()[-3000:]
        assert time.monotonic() < deadline, "the run never reached the kill point"
        time.sleep(0.05)
    killed.send_signal(signal.SIGKILL)
    _, killed_err = killed.communicate(timeout=60)
    assert killed.returncode == -signal.SIGKILL
    killed_dir = tmp_path / RUNS / "version_1"
    saved = torch.load(killed_dir / "checkpoints" / "last.ckpt", weights_only=True)
    held_step = int(flag.read_text())
    assert (saved["epoch"], saved["global_step"]) == (KILL_EPOCH - 1, KILL_EPOCH)
    assert held_step == saved["global_step"]  # the step under way never finished
    piped = killed_err.decode()
    assert "\r" not in piped and "warm start: done" in piped  # plain lines
    assert re.search(r"fit: training, 1 batch(es)? per epoch", piped), piped[-2000:]
    killed_files = _snapshot(killed_dir)
    assert _snapshot(full_dir) == first  # the second run left the first one's files alone

    # 3. resume the newest run
    resumed = subprocess.run(
        [*_command(), *ARGS, "--ckpt_path", "last"], cwd=tmp_path, env=_env(),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    resumed_from = (killed_dir / "checkpoints" / "last.ckpt").resolve()
    assert (
        f"lightning-dvi fit: resuming the newest run's checkpoint, {resumed_from} "
        f"(epoch {KILL_EPOCH - 1}, global step {KILL_EPOCH})"
    ) in resumed.stdout
    training = rf"fit: training, 1 batch(es)? per epoch, resuming at step {KILL_EPOCH}\b"
    assert re.search(training, resumed.stderr), resumed.stderr[-2000:]
    assert "warm start: done" not in resumed.stderr  # the checkpoint's weights, not a new start
    resumed_dir = tmp_path / RUNS / "version_2"

    # the same final metrics, as printed and as logged (full precision), and the same state
    assert _metrics(resumed.stdout) == full_metrics
    assert _last_csv_row(resumed_dir) == _last_csv_row(full_dir)
    full = torch.load(full_dir / "checkpoints" / "last.ckpt", weights_only=True)
    again = torch.load(resumed_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert (again["epoch"], again["global_step"]) == (full["epoch"], full["global_step"])
    assert (full["epoch"], full["global_step"]) == (EPOCHS - 1, EPOCHS)  # one step per epoch
    _assert_identical(again["state_dict"], full["state_dict"], "state_dict")
    # L-BFGS's memory: curvature pairs (S, Y), last direction and step length, counters
    (lbfgs,) = full["optimizer_states"][0]["state"].values()
    assert {"S", "Y", "d", "t", "n_iter"} <= lbfgs.keys() and lbfgs["k"] >= 1, list(lbfgs)
    _assert_identical(again["optimizer_states"], full["optimizer_states"], "optimizer_states")
    _assert_identical(again["loops"], full["loops"], "loops")  # the progress counters
    for name in RESUMED_STATE:
        keys = [k for k in full["callbacks"] if name in k]
        assert keys, (name, list(full["callbacks"]))
        for key in keys:
            _assert_identical(again["callbacks"][key], full["callbacks"][key], key)

    # no run rewrote another run's checkpoint
    assert _snapshot(full_dir) == first
    assert _snapshot(killed_dir) == killed_files


@pytest.mark.parametrize("environ", [{"CI": "true"}, {}])
def test_progress_is_a_bar_on_a_terminal_and_lines_otherwise(environ):
    from lightning_dvi.callbacks import DVIProgressBar, ProgressLog
    from lightning_dvi.lightning.progress import progress_callback

    class Terminal:
        def isatty(self) -> bool:
            return True

    class Pipe:
        def isatty(self) -> bool:
            return False

    on_terminal = progress_callback(Terminal(), environ)  # type: ignore[arg-type]
    assert isinstance(on_terminal, ProgressLog if environ else DVIProgressBar)
    assert isinstance(progress_callback(Pipe(), environ), ProgressLog)  # type: ignore[arg-type]

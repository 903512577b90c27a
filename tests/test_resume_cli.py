"""Issue 24, the real thing: ``lightning-dvi fit`` subprocesses, one killed with SIGKILL.

Three runs of the toy recipe in one directory (each a real console-script process):

1. an uninterrupted run, its standard error on a pseudo-terminal (a person watching): it shows
   Lightning's progress bar with the loss, and still prints where the log, plots and
   checkpoint are;
2. a fresh run of the same recipe and seed, held mid-epoch (after a few checkpoints) by a test
   callback and killed with SIGKILL, its output piped (plain progress lines, no bar);
3. ``--ckpt_path last``, which must pick run 2's checkpoint, say so, and finish with the same
   weights, optimiser and empirical-Bayes state and the same test metrics as run 1, bit for bit.

Every byte of run 1's and run 2's checkpoints must be as it was after the later runs.
"""

from __future__ import annotations

import csv
import fcntl
import os
import pty
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "toy_heteroscedastic.yaml"
RUNS = Path("runs/toy_heteroscedastic/lightning_logs")
# 6 epochs of 4 batches, validation every 2 epochs: 24 steps, a few seconds per run
ARGS = [
    "fit", "--config", str(TOY), "--trainer.max_epochs", "6",
    "--data.init_args.num_train", "200", "--trainer.check_val_every_n_epoch", "2",
]  # fmt: skip
KILL_EPOCH, KILL_BATCH = 3, 1  # held after 2 of epoch 3's 4 batches; last.ckpt holds epoch 2


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


def test_a_killed_fit_resumes_to_the_uninterrupted_result_and_no_run_overwrites_another(
    tmp_path,
):
    # 1. uninterrupted, watched on a terminal
    stdout, terminal = _run_on_a_terminal(tmp_path)
    full_dir = tmp_path / RUNS / "version_0"
    bar = terminal.replace("\r\n", "\n")  # the terminal's own line ends
    assert "\r" in bar and "Epoch 5: 100%" in bar, terminal[-2000:]  # the TQDM bar, redrawn
    assert "loss=" in bar and "val/nll=" in bar  # with the loss and the key metric
    assert "Epoch" not in stdout  # standard output stays clean for the summary
    for where in ("metrics csv: ", "plot:        ", "checkpoint:  "):
        assert where in stdout, stdout[-2000:]
    assert "version_0/checkpoints/last.ckpt" in stdout
    full_metrics = _metrics(stdout)
    assert "test/nll" in full_metrics
    first = _snapshot(full_dir)

    # 2. the same run again, killed with SIGKILL mid-epoch
    flag = tmp_path / "held"
    pause = (
        '{"class_path": "resume_helpers.PauseMidEpoch", "init_args": '
        f'{{"epoch": {KILL_EPOCH}, "batch": {KILL_BATCH}, "flag": "{flag}"}}}}'
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
    assert (saved["epoch"], saved["global_step"]) == (KILL_EPOCH - 1, 4 * KILL_EPOCH)
    assert held_step == saved["global_step"] + KILL_BATCH + 1  # steps done, never saved
    piped = killed_err.decode()
    assert "\r" not in piped and "fit: training, 4 batches per epoch" in piped  # plain lines
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
        f"(epoch {KILL_EPOCH - 1}, global step {4 * KILL_EPOCH})"
    ) in resumed.stdout
    assert f"fit: training, 4 batches per epoch, resuming at step {4 * KILL_EPOCH}" in (
        resumed.stderr
    )
    resumed_dir = tmp_path / RUNS / "version_2"

    # the same final metrics, as printed and as logged (full precision), and the same state
    assert _metrics(resumed.stdout) == full_metrics
    assert _last_csv_row(resumed_dir) == _last_csv_row(full_dir)
    full = torch.load(full_dir / "checkpoints" / "last.ckpt", weights_only=True)
    again = torch.load(resumed_dir / "checkpoints" / "last.ckpt", weights_only=True)
    assert (again["epoch"], again["global_step"]) == (full["epoch"], full["global_step"]) == (5, 24)
    for key, value in full["state_dict"].items():
        torch.testing.assert_close(again["state_dict"][key], value, rtol=0, atol=0, msg=key)
    for a, b in zip(
        again["optimizer_states"][0]["state"].values(),
        full["optimizer_states"][0]["state"].values(),
        strict=True,
    ):
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)
    assert again["loops"] == full["loops"]  # the loops' progress counters
    eb = [k for k in full["callbacks"] if "EmpiricalBayes" in k]
    assert eb and all(again["callbacks"][k] == full["callbacks"][k] for k in eb)

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

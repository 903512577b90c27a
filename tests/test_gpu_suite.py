"""The GPU suite (lightning_dvi_benchmarks.gpu_suite, issue 43): its dry run on the CPU, budgets.

The dry run is every section at tiny sizes, each in its own forked process, as the device run
does it; the budget tests check that a slow section is killed (with what it started) at its
budget, keeps what it recorded, and does not eat the next section's time.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_dvi_benchmarks import gpu_suite as G

REPO = Path(__file__).resolve().parents[1]


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _strings(value):
    if isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)
    elif isinstance(value, str):
        yield value


def test_dry_run_writes_every_section_with_finite_numbers(tmp_path, capsys):
    assert G.main(["--dry-run", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / G.JSON_NAME).read_text())
    sections = result["sections"]
    assert list(sections) == list(G.SECTIONS)
    statuses = {name: entry["status"] for name, entry in sections.items()}
    assert statuses == {**dict.fromkeys(G.SECTIONS, "ok"), "cli_ddp": "skipped"}, sections
    assert all(_finite(e["section s"]) and _finite(e["budget_s"]) for e in sections.values())
    # non-finite floats are written as strings: none may appear anywhere
    assert not {s for s in _strings(result) if s.lower() in ("nan", "inf", "-inf")}
    assert result["dry_run"] and len(result["commit"]["commit"]) >= 7
    assert "float32_matmul_precision" in result["tf32 at start"]

    env = sections["environment"]
    assert env["torch"] and env["gpu_count"] == 0 and "tf32 in the sections" in env

    (row,) = sections["speed"]["rows"]
    assert row["d"] == G.DRY.widths[0]
    for method in (*G.SPEED_METHODS, "DVI tf32"):
        assert _finite(row[method]) and row[method] > 0, method
        assert _finite(row[method + " peak MiB"]) and row[method + " peak MiB"] >= 0, method
        ops = row[method + " ops"]
        assert ops["aten ops"] >= ops["non-view ops"] > 0, method
    assert row["DVI ops"]["aten ops"] > row["plain MLP ops"]["aten ops"]

    uci = sections["uci_fit"]
    assert uci["accelerator"] == "cpu" and 1 <= uci["steps"] <= G.DRY.uci_steps_cap
    assert _finite(uci["test_ll"]) and _finite(uci["rmse"]) and uci["rmse"] > 0

    resnet = sections["resnet"]
    assert resnet["plain images"] == resnet["dDVI images"] == G.DRY.resnet_images
    for key in ("plain epoch s", "dDVI epoch s", "dDVI / plain", "dDVI s per 50,000 images"):
        assert _finite(resnet[key]) and resnet[key] > 0, key
    assert resnet["dDVI ops"]["aten ops"] > resnet["plain ops"]["aten ops"]

    cli = sections["cli"]
    assert cli["returncode"] == 0 and cli["launched"] == "in-process"
    assert "--trainer.accelerator cpu" in cli["command"]
    assert _finite(cli["metrics"]["test/nll"]) and _finite(cli["metrics"]["val/nll"])
    assert "DDP needs two" in sections["cli_ddp"]["reason"]

    assert set(result["acceptance"]) >= {"ResNet-18 dDVI / plain epoch (target <= 3)"}
    printed = capsys.readouterr().out
    assert "| speed | ok |" in printed and "## Acceptance (issue 43)" in printed


def _slow(plan, rec):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    rec.set("grandchild", child.pid)
    time.sleep(60)


def _next(plan, rec):
    rec.set("ran", True)


def _boom(plan, rec):
    rec.set("before", 1)
    raise ValueError("a planted error")


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie nobody has reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_slow_section_is_killed_at_its_budget_and_the_next_one_runs(tmp_path):
    plan = replace(G.DRY, budgets={"slow": 2.0, "next": 30.0}, deadline_s=60.0)
    out = tmp_path / "suite.json"
    start = time.monotonic()
    result = G.run_sections({"slow": _slow, "next": _next}, plan, {}, out)
    assert time.monotonic() - start < 20
    slow, nxt = result["sections"]["slow"], result["sections"]["next"]
    assert slow["status"] == "timed out" and slow["section s"] < 10
    assert slow["grandchild"] > 0  # what it recorded before the budget ran out is kept
    deadline = time.monotonic() + 5
    while not _gone(slow["grandchild"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _gone(slow["grandchild"]), "a process the section started outlived its budget"
    assert nxt["status"] == "ok" and nxt["ran"] is True
    assert json.loads(out.read_text())["sections"] == result["sections"]


def test_a_failing_section_and_the_global_deadline(tmp_path):
    plan = replace(G.DRY, budgets={"boom": 30.0, "slow": 30.0, "next": 30.0}, deadline_s=5.0)
    result = G.run_sections(
        {"boom": _boom, "slow": _slow, "next": _next}, plan, {}, tmp_path / "suite.json"
    )
    boom, slow, nxt = (result["sections"][k] for k in ("boom", "slow", "next"))
    assert boom["status"] == "failed" and boom["before"] == 1
    assert boom["error"] == "ValueError: a planted error" and "_boom" in boom["traceback"]
    assert slow["status"] == "timed out" and slow["budget_s"] < 5.0
    assert nxt == {"status": "skipped", "budget_s": nxt["budget_s"],
                   "reason": "global deadline reached"}  # fmt: skip


def test_speed_cells_run_the_acceptance_pairs_before_the_other_compiled_cells():
    cells = G._speed_cells(G.FULL)
    eager = [(m, d) for m, d, kind in cells if kind == "eager"]
    assert eager == [(m, d) for d in G.FULL.widths for m in G.SPEED_METHODS]
    assert cells[len(eager)] == ("DVI", 1024, "tf32")
    compiled = [(m, d) for m, d, kind in cells if kind == "compiled"]
    assert compiled[: len(G.FULL.first_compiled)] == list(G.FULL.first_compiled)
    assert sorted(compiled) == sorted((m, d) for d in G.FULL.widths for m in G.SPEED_METHODS)
    assert {m for m, _ in G.FULL.first_compiled} == {"plain MLP", "dDVI"}
    graphs = [(m, d) for m, d, kind in cells if kind == "cudagraphs"]
    assert graphs == list(G.FULL.cudagraph_cells) and {m for m, _ in graphs} == {
        "plain MLP",
        "dDVI",
    }
    # CUDA-graph pairs come right after the compiled acceptance pairs
    start = len(eager) + 1 + len(G.FULL.first_compiled)
    assert [(m, d) for m, d, _ in cells[start : start + len(graphs)]] == graphs


def test_cells_and_widths_keep_a_subset_in_the_same_order():
    cells = G._speed_cells(G.FULL, ("eager", "cudagraphs"), (128, 1024))
    assert {kind for _, _, kind in cells} == {"eager", "cudagraphs"}
    assert {d for _, d, _ in cells} == {128, 1024}
    full = G._speed_cells(G.FULL)
    assert cells == [c for c in full if c in cells]
    assert G._speed_cells(G.FULL, ("tf32",)) == [("DVI", 1024, "tf32")]


def test_a_second_run_of_chosen_cells_labels_them_by_kind(tmp_path):
    argv = ["--dry-run", "--out", str(tmp_path), "--sections", "speed", "--cells",
            "cudagraphs,tf32", "--isolate", "none"]  # fmt: skip
    assert G.main(argv) == 0
    (row,) = json.loads((tmp_path / G.JSON_NAME).read_text())["sections"]["speed"]["rows"]
    assert _finite(row["dDVI cudagraphs"]) and _finite(row["DVI tf32"])
    assert "dDVI compiled" not in row and "dDVI" not in row and "DVI" not in row
    assert "dDVI cudagraphs peak MiB" in row and "DVI tf32 peak MiB" in row


def test_estimates_scale_from_the_previous_width():
    assert G._estimate(None, 512, "DVI") == 0.0
    assert G._estimate((256, 10.0, 1.0), 512, "DVI") == pytest.approx(18.0)  # d^3
    assert G._estimate((256, 10.0, 1.0), 512, "dDVI") == pytest.approx(14.0)  # d^2


def test_cli_arguments_and_command():
    argv = G.cli_argv(Path("t.csv"), Path("r.yaml"), "gpu", 4, 5, ddp=True)
    pairs = dict(zip(argv[1::2], argv[2::2], strict=True))
    assert argv[0] == "fit" and pairs["--trainer.strategy"] == "ddp"
    assert pairs["--trainer.accelerator"] == "gpu" and pairs["--trainer.devices"] == "4"
    assert "--trainer.strategy" not in G.cli_argv(Path("t"), Path("r"), "gpu", 1, 5)
    command = G._cli_command()
    assert Path(command[0]).exists() or command[1:] == ["-m", "lightning_dvi.cli"]
    assert G._recipe("csv_regression.yaml") == REPO / "recipes" / "csv_regression.yaml"


@pytest.mark.parametrize("argv, message", [
    (["--sections", "speed,bogus"], "unknown section(s) bogus"),
    (["--budget", "speed"], "expected SECTION=SECONDS"),
    (["--budget", "speed=fast"], "is not a number"),
    (["--budget", "speed=0"], "must be positive"),
    (["--deadline-s", "-1"], "--deadline-s must be positive"),
    (["--cells", "eager,warp"], "--cells 'eager,warp': choose from"),
    (["--widths", "128,x"], "expected comma-separated integers"),
    (["--widths", "0"], "expected positive widths"),
])  # fmt: skip
def test_bad_arguments_are_clear_errors(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        G.main(["--dry-run", "--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err
    assert not (tmp_path / G.JSON_NAME).exists()


def test_the_shell_scripts_parse_and_the_wheels_folder_is_ignored():
    for script in ("recipes/gpu_suite.sh", "recipes/gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(REPO / script)], check=True)
        assert os.access(REPO / script, os.X_OK), script
    ignored = subprocess.run(
        ["git", "-C", str(REPO), "check-ignore", "-q", "wheels/x.whl"], check=False
    )
    assert ignored.returncode == 0


def test_every_compiled_speed_cell_is_compiled_past_dynamos_recompile_limit():
    # The suite compiles the same forward ~35 times (7 methods x 5 widths); Dynamo stops
    # compiling a code object after torch._dynamo.config.recompile_limit (8) compilations and
    # silently runs it eagerly, so without a fresh Dynamo state per cell the later "compiled"
    # columns would be eager times.
    import torch

    from lightning_dvi_benchmarks import speed_net

    compiled = []

    def backend(gm, example_inputs):
        compiled.append(gm)
        return gm.forward

    cells = torch._dynamo.config.recompile_limit + 2
    for d in range(2, 2 + cells):
        speed_net.net_cell("plain MLP", d, 3, 1, {"backend": backend})
    assert len(compiled) == cells


def test_the_commit_of_a_copy_inside_another_repository_is_its_wheels_stamp(tmp_path):
    # A device call that carries a `git archive` copy runs it inside the device's copy of this
    # repository: git would name that outer repository's HEAD, not the copied tree's commit.
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    copy = tmp_path / "gpuhead"
    (copy / "wheels").mkdir(parents=True)
    (copy / "wheels" / "COMMIT").write_text("abc1234\n")
    assert G._git_commit(copy) == {"commit": "abc1234", "source": str(copy / "wheels" / "COMMIT")}
    here = G._git_commit(REPO)
    assert here["source"] == "git" and len(here["commit"]) == 40


def test_a_cells_first_call_is_not_scaled_with_the_width():
    # eager DVI's first call at d=128 autotunes its Triton kernels (25 s on an H200): scaled by
    # (1024/128)^3 it would skip every wider DVI cell
    assert G._estimate((128, 25.0, 0.5), 1024, "DVI") == pytest.approx(25.0 + 0.5 * 512)

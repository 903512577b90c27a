"""The "Bring your own network" page and recipe run as written."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_docs_code_blocks_run_in_order():
    text = (REPO / "docs" / "byo_network.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 4
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "byo_network.md", "exec"), namespace)
    assert namespace["served_mean"].shape == (7,)


def test_recipe_runs_quickly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "recipes" / "bring_your_own_network.py"),
            "--quick",
            "--no-onnx",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "max |served - library| mean gap" in result.stdout
    assert (tmp_path / "diabetes_dvi.pt2").is_file()

"""The "Bring your own network" recipe runs as written.

The page's python blocks run in order, in one namespace, in ``tests/test_docs_examples.py``
(its ``continue`` blocks share one run of the page); this file used to run them a second time.
"""

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_recipe_runs_quickly(tmp_path, monkeypatch, capsys):
    # in this process (the script as `python recipes/...` runs it), not a fresh interpreter that
    # would spend most of the test importing torch and Lightning again
    recipe = REPO / "recipes" / "bring_your_own_network.py"
    argv = [str(recipe), "--quick", "--no-onnx", "--output-dir", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.syspath_prepend(str(recipe.parent))
    runpy.run_path(str(recipe), run_name="__main__")
    assert "max |served - library| mean gap" in capsys.readouterr().out
    assert (tmp_path / "diabetes_dvi.pt2").is_file()

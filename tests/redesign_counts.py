"""Issue 40's counts of the Lightning front end, measured with ``ast`` (run: ``python tests/redesign_counts.py``).

- ``constructor lines``: the lines of ``__init__`` of :class:`~lightning_dvi.DVIRegressor`,
  :class:`~lightning_dvi.DVIClassifier` and their base ``DVIModule``, signature and body, the
  docstring excluded (blank and comment lines inside count); the issue's target is <= 136.
- ``L-BFGS mentions in _base.py``: lines of ``lightning/_base.py`` that name L-BFGS (``lbfgs``,
  ``L-BFGS``, any case).
- ``hidden _lbfgs_ attributes``: distinct ``self._lbfgs_*`` names in ``lightning/``.

Not collected by pytest (no ``test_`` prefix); prints one ``name: value`` line per count.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dvi"
CONSTRUCTORS = {
    "DVIModule": "lightning/_base.py",
    "DVIRegressor": "lightning/regressor.py",
    "DVIClassifier": "lightning/classifier.py",
}


def constructor_lines(path: Path, cls: str) -> int:
    """Lines of ``cls.__init__`` in ``path``: signature and body, without the docstring."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    init = next(n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert init.end_lineno is not None
    lines = set(range(init.lineno, init.end_lineno + 1))
    first = init.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str) and first.end_lineno is not None:
            lines -= set(range(first.lineno, first.end_lineno + 1))
    return len(lines)


def counts() -> dict[str, int]:
    """Every count, by name."""
    result = {
        f"constructor lines {cls}": constructor_lines(PACKAGE / path, cls)
        for cls, path in CONSTRUCTORS.items()
    }
    result["constructor lines (total, target <= 136)"] = sum(result.values())
    base = (PACKAGE / "lightning/_base.py").read_text()
    result["L-BFGS mentions in _base.py"] = sum(
        bool(re.search(r"lbfgs|l-bfgs", line, re.IGNORECASE)) for line in base.splitlines()
    )
    hidden = {
        name
        for path in (PACKAGE / "lightning").glob("*.py")
        for name in re.findall(r"self\._lbfgs_\w+", path.read_text())
    }
    result["hidden _lbfgs_ attributes"] = len(hidden)
    return result


if __name__ == "__main__":
    for name, value in counts().items():
        print(f"{name}: {value}")

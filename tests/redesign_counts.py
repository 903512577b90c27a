"""Issue 40's counts of the Lightning front end, measured with ``ast`` (run: ``python tests/redesign_counts.py``).

- ``constructor lines``: the lines of ``__init__`` of :class:`~lightning_dvi.DVIRegressor`,
  :class:`~lightning_dvi.DVIClassifier` and their base ``DVIModule``, signature and body, the
  docstring excluded (blank and comment lines inside count); the issue's target is <= 136.
- ``L-BFGS mentions in _base.py``: lines of ``lightning/_base.py`` that name L-BFGS (``lbfgs``,
  ``L-BFGS``, any case).
- ``hidden _lbfgs_ attributes``: distinct ``self._lbfgs_*`` names in ``lightning/``.
- ``isinstance on likelihood classes outside likelihoods/``: ``isinstance`` calls anywhere in
  the package outside ``likelihoods/`` whose class argument names one of the likelihood
  classes (:class:`~lightning_dvi.likelihoods.Likelihood` and its subclasses in
  ``lightning_dvi.likelihoods``); the issue's target is 0.

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
    if (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
        and first.end_lineno is not None
    ):
        lines -= set(range(first.lineno, first.end_lineno + 1))
    return len(lines)


def _likelihood_class_names() -> set[str]:
    """Names of the classes defined in ``likelihoods/`` that derive from ``Likelihood`` (by ``ast``)."""
    bases: dict[str, set[str]] = {}
    for path in (PACKAGE / "likelihoods").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases[node.name] = {ast.unparse(b).rpartition(".")[2] for b in node.bases}
    found = {"Likelihood"}
    while True:
        more = {name for name, parents in bases.items() if parents & found} - found
        if not more:
            return found
        found |= more


def likelihood_isinstance(package: Path = PACKAGE) -> list[str]:
    """``path:line`` of each ``isinstance(x, C)`` outside ``likelihoods/`` with ``C`` a likelihood class.

    ``C`` counts when it is a name imported from a ``likelihoods`` module or an attribute path
    through ``likelihoods.`` (``torch.distributions.Categorical`` is not one of ours).
    """
    names = _likelihood_class_names()
    hits = []
    for path in sorted(package.rglob("*.py")):
        if (package / "likelihoods") in path.parents:
            continue
        tree = ast.parse(path.read_text())
        imported = {  # names bound by `from ...likelihoods... import C`
            alias.asname or alias.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and "likelihoods" in (node.module or "")
            for alias in node.names
        }

        def ours(c: ast.expr, imported: set[str] = imported) -> bool:
            text = ast.unparse(c)  # a bare imported name, or likelihoods.C / lightning_dvi...C
            short = text.rpartition(".")[2]
            return short in names and (text in imported or "likelihoods." in text)

        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "isinstance"
                and len(node.args) == 2
            ):
                continue
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(ours(c) for c in classes):
                hits.append(f"{path.relative_to(package)}:{node.lineno}")
    return hits


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
    result["isinstance on likelihood classes outside likelihoods/ (target 0)"] = len(
        likelihood_isinstance()
    )
    return result


if __name__ == "__main__":
    for name, value in counts().items():
        print(f"{name}: {value}")

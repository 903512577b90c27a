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
- ``mode string comparisons outside the one entry point``: ``ast.Compare`` nodes anywhere in the
  package except ``propagation.py`` (the entry point: the table from shorthand strings to
  :class:`~lightning_dvi.propagation.Propagation` values) and ``benchmarks/`` (leaving the
  package), where one operand is mode-like (its source's last name contains ``mode``:
  ``mode``, ``self.mode``, ``x.dvi_mode``, ``sample_mode``, ``mode.name``) and another is a
  propagation shorthand (``"full"``, ``"diag"``, ``"sample"``, ``"local"``), a tuple/list/set of
  them, or a name bound to such a tuple (``_MC_MODES``, ``MONTE_CARLO_MODES``, ...); other
  ``mode`` arguments (``"in_graph"``, ``"min"``, ``"auto"``) do not count. The issue's target
  is 0.
- ``(mode, num_samples) validated in``: the functions, outside ``propagation.py``, that check
  ``num_samples`` for a propagation: a ``raise`` or a call of ``check``/``positive_int`` whose
  string constants name ``num_samples`` together with ``mode`` or ``positive int``. Printed as
  ``1 + k``: the entry point, plus ``k`` other functions (the issue's target: ``k = 0``).
- ``private Lightning attributes read``: attribute reads ``x._name`` (not dunders) and
  ``getattr(x, "_name", ...)`` anywhere in the package whose object's source names a Lightning
  object (``trainer``, ``loop``, ``strategy``, ``connector``); the issue's target is 0.
- ``modules under lightning_dvi/benchmarks``: the benchmarks left the installed package (the
  ``lightning_dvi_benchmarks`` distribution in ``benchmarks/``); the issue's target is 0.

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


MODE_STRINGS = {"full", "diag", "sample", "local"}


def _mode_strings(node: ast.expr, constants: set[str]) -> bool:
    """A shorthand, a tuple/list/set of shorthands, or a name bound to one."""
    if isinstance(node, ast.Constant):
        return node.value in MODE_STRINGS
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return bool(node.elts) and all(_mode_strings(e, constants) for e in node.elts)
    return isinstance(node, ast.Name) and node.id in constants


def _mode_like(node: ast.expr) -> bool:
    text = ast.unparse(node)
    last = re.findall(r"[A-Za-z_]\w*", text)
    return (bool(last) and "mode" in last[-1].lower()) or text.endswith("mode.name")


def _sources(package: Path) -> list[Path]:
    return [
        p
        for p in sorted(package.rglob("*.py"))
        if p.name != "propagation.py" and (package / "benchmarks") not in p.parents
    ]


def mode_string_comparisons(package: Path | None = None) -> list[str]:
    """``path:line`` of each comparison of a mode-like value with propagation shorthands."""
    package = package or PACKAGE
    hits = []
    for path in _sources(package):
        tree = ast.parse(path.read_text())
        constants = {"MODES", "MOMENT_MODES", "MONTE_CARLO_MODES"} | {
            t.id
            for node in tree.body
            if isinstance(node, ast.Assign) and _mode_strings(node.value, set())
            for t in node.targets
            if isinstance(t, ast.Name)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                if any(_mode_like(o) for o in operands) and any(
                    _mode_strings(o, constants) for o in operands
                ):
                    hits.append(f"{path.relative_to(package)}:{node.lineno}")
    return hits


def _strings(node: ast.AST) -> str:
    return " ".join(
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    )


def _checks_num_samples(node: ast.AST) -> bool:
    if isinstance(node, ast.Raise) and node.exc is not None:
        text = _strings(node.exc)
    elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("check", "positive_int"):
        text = _strings(node)
    else:
        return False
    return "num_samples" in text and (
        "mode" in text or "positive int" in text or text == "num_samples"
    )


def num_samples_checks(package: Path | None = None) -> list[str]:
    """``path:function`` of each function outside ``propagation.py`` that checks ``num_samples``."""
    package = package or PACKAGE
    hits = []
    for path in _sources(package):
        for fn in ast.walk(ast.parse(path.read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _checks_num_samples(n) for n in ast.walk(fn)
            ):
                hits.append(f"{path.relative_to(package)}:{fn.name}")
    return hits


_LIGHTNING_OBJECTS = re.compile(r"trainer|loop|strategy|connector", re.IGNORECASE)


def private_lightning_attributes(package: Path | None = None) -> list[str]:
    """``path:line`` of each read of a private attribute of a Lightning object."""
    package = package or PACKAGE
    hits = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):
                owner, name = node.value, node.attr
            elif (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("getattr", "hasattr", "setattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
            ):
                owner, name = node.args[0], node.args[1].value
            else:
                continue
            private = name.startswith("_") and not name.startswith("__")
            if private and _LIGHTNING_OBJECTS.search(ast.unparse(owner)):
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
    result["mode string comparisons outside the one entry point (target 0)"] = len(
        mode_string_comparisons()
    )
    entry = int((PACKAGE / "propagation.py").exists())
    result[f"(mode, num_samples) validated in {entry} + k places: k (target 0)"] = len(
        num_samples_checks()
    )
    result["private Lightning attributes read (target 0)"] = len(private_lightning_attributes())
    result["modules under lightning_dvi/benchmarks (target 0)"] = len(
        list((PACKAGE / "benchmarks").rglob("*.py"))
    )
    return result


if __name__ == "__main__":
    import sys

    paths = [a for a in sys.argv[1:] if not a.startswith("-")]
    if paths:  # another checkout's package, e.g. a worktree of an earlier commit
        PACKAGE = Path(paths[0]).resolve()
    for name, value in counts().items():
        print(f"{name}: {value}")
    if "-v" in sys.argv:
        print("mode comparisons:", ", ".join(mode_string_comparisons(PACKAGE)))
        print("num_samples checks:", ", ".join(num_samples_checks(PACKAGE)))
        print("private Lightning attributes:", ", ".join(private_lightning_attributes(PACKAGE)))

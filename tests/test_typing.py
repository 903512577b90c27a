"""The type-check rules that mypy cannot enforce itself (``make test`` runs mypy; see pyproject)."""

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
# The library and the benchmarks' own distribution (benchmarks/), both type-checked by `mypy`.
PACKAGES = (ROOT / "lightning_dvi", ROOT / "benchmarks" / "lightning_dvi_benchmarks")
# `# type: ignore[code, ...]`, two spaces, `# ` and a reason of at least two words
JUSTIFIED = re.compile(r"# type: ignore\[[a-z-]+(, [a-z-]+)*\]  # \S+ \S+")


def _ignores() -> list[tuple[str, str]]:
    found = []
    for path in sorted(p for package in PACKAGES for p in package.rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "type: ignore" in line:
                found.append((f"{path.relative_to(ROOT)}:{number}", line.strip()))
    return found


def test_every_type_ignore_names_its_code_and_says_why():
    bad = [f"{where}: {line}" for where, line in _ignores() if not JUSTIFIED.search(line)]
    assert not bad, (
        "each `# type: ignore[code]` needs its error code and a reason on the same line, "
        "e.g. `# type: ignore[override]  # Metric.update takes *args`:\n" + "\n".join(bad)
    )


def test_the_rule_rejects_bare_and_unexplained_ignores():
    assert JUSTIFIED.search("x = f()  # type: ignore[arg-type]  # checked above")
    assert JUSTIFIED.search("x = f()  # type: ignore[arg-type, union-attr]  # checked above")
    assert not JUSTIFIED.search("x = f()  # type: ignore")
    assert not JUSTIFIED.search("x = f()  # type: ignore[arg-type]")
    assert not JUSTIFIED.search("x = f()  # type: ignore[arg-type]  # why")


def test_mypy_configuration_is_strict_on_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    for option in (
        "disallow_untyped_defs",
        "check_untyped_defs",
        "warn_unused_ignores",
        "warn_redundant_casts",
    ):
        assert config[option] is True, option
    overrides = config.get("overrides", [])
    assert not any(o.get("ignore_errors") for o in overrides), "no module may skip the check"
    for override in overrides:  # missing stubs may be excused for third-party packages only
        assert not any(m.startswith("lightning_dvi") for m in override["module"]), override
    assert "mypy" in (ROOT / "Makefile").read_text()
    assert [str(p.relative_to(ROOT)) for p in PACKAGES] == config["files"]

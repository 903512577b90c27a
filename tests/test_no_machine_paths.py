"""No machine-specific absolute paths in the package, recipes, docs or tests.

A path like ``/home/alice/data`` or ``C:\\Users\\bob`` works on one machine only; examples and
defaults name paths relative to the checkout (``../shared/data/uci``) or take them as arguments.
The check reads every tracked text file (``git ls-files``; without git, the files under the
checkout minus build and virtual-environment folders).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Absolute home/work folders (POSIX, macOS) and Windows drive paths.
MACHINE_PATH = re.compile(r"(?<![\w.~-])(?:/work/|/root/|/home/|/Users/|[A-Za-z]:\\\\?[A-Za-z])")

# path -> why it may keep such a path for now.
ALLOWED = {
    # This file spells the patterns out.
    "tests/test_no_machine_paths.py": "the patterns themselves",
}
SKIPPED_DIRS = {".git", ".venv", "venv", "site", "runs", "__pycache__", "build", "dist"}


def tracked_files() -> list[str]:
    """Tracked files relative to the checkout (git), or every file outside build folders."""
    if shutil.which("git") and (REPO / ".git").exists():
        result = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        )
        return [name for name in result.stdout.decode().split("\0") if name]
    return [
        p.relative_to(REPO).as_posix()
        for p in REPO.rglob("*")
        if p.is_file() and not SKIPPED_DIRS.intersection(p.relative_to(REPO).parts)
        and not any(part.startswith(".") for part in p.relative_to(REPO).parts)
    ]  # fmt: skip


def machine_paths(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line naming a machine-specific absolute path."""
    return [
        (number, line.strip())
        for number, line in enumerate(text.splitlines(), start=1)
        if MACHINE_PATH.search(line)
    ]


def test_no_tracked_text_file_names_a_machine_specific_path():
    files = tracked_files()
    assert len(files) > 50 and "README.md" in files  # the listing really saw the checkout
    found = []
    for name in files:
        if name in ALLOWED:
            continue
        path = REPO / name
        if not path.is_file():
            continue  # deleted in the working tree
        data = path.read_bytes()
        if b"\0" in data[:8192]:
            continue  # binary
        text = data.decode("utf-8", errors="replace")
        found += [f"{name}:{number}: {line}" for number, line in machine_paths(text)]
    assert not found, "machine-specific absolute paths:\n" + "\n".join(found)


def test_the_pattern_catches_home_work_and_drive_paths_but_not_relative_ones():
    bad = [
        'default="/work/shared/data/uci"',
        "see /home/alice/runs",
        "cd /root/project",
        "open('/Users/bob/data.csv')",
        r"C:\Users\bob\data.csv",
        r"'D:\\data\\uci'",
    ]
    good = [
        "--data.data_dir ../shared/data/uci",
        "runs/csv_regression/checkpoints/last.ckpt",
        "https://example.org/home/page",
        "~/home/data",
        "lightning_dvi/work/x.py",
        "a ratio 3:\\n",
    ]
    assert all(MACHINE_PATH.search(line) for line in bad), [
        line for line in bad if not MACHINE_PATH.search(line)
    ]
    assert not any(MACHINE_PATH.search(line) for line in good), [
        line for line in good if MACHINE_PATH.search(line)
    ]
    assert machine_paths("ok\nx = '/home/me'\n") == [(2, "x = '/home/me'")]


def test_allowed_files_exist():
    stale = [name for name in ALLOWED if not (REPO / name).is_file()]
    assert not stale, f"remove these from ALLOWED, they no longer exist: {stale}"

"""Every fenced example in README.md, docs/*.md and docs/archive/*.md runs (docs/contributing.md).

* ```python blocks run in a fresh process, each block on its own (a fresh namespace), after
  the named hidden setup a page may ask for with ``<!-- docs-test: setup=NAME -->``
  (``tests/docs_runner.py`` holds the setups).
* ```bash blocks run through ``bash -euo pipefail``, every command must succeed;
  ``lightning-dvi``/``.venv/bin/lightning-dvi`` and ``python``/``.venv/bin/python`` become the
  interpreter running the tests (through ``tests/docs_runner.py``).
* Every such process is a fork of a warm interpreter that has imported torch, Lightning and the
  library but run nothing (``tests/docs_zygote.py``, one per test process): the command's own
  work, without ~8 s of imports each time.
* ```yaml blocks must parse. ```text blocks (formulas, output) are not run; every fence must
  name its language, so a shell command cannot hide in an untagged block.
* Each block runs in a fresh temporary directory holding a link to ``recipes/``, with
  ``LIGHTNING_DVI_DOCS_FAST=1``: every Lightning ``Trainer`` stops after 2 epochs or 20 steps.
* ``../shared/data/uci`` (and the ``path/to/uci`` placeholder) name the shared UCI data next to
  the checkout; without it such a block is skipped, except under ``CI``, where that is an error.
* ``<!-- docs-test: continue -->`` before a python block runs the page's earlier python blocks
  first, in the same namespace (a tutorial page that builds on itself). A page's ``continue``
  blocks share one run per test process: the page's python blocks in order, in one namespace,
  up to its last ``continue`` block; each such block passes when that run got past its end, so
  an expensive early block (an export, a fit) runs once, not once per later block.
* ``<!-- docs-test: skip REASON -->`` before a block (a GPU, a long benchmark, recursion)
  replaces running by parsing: ``compile`` for Python, ``bash -n`` for shell.

Test ids are ``page:line`` of the opening fence, so a failure names the block.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from docs_runner import FAST_ENV, SETUPS
from docs_zygote import READY, ZYGOTE_ENV

REPO = Path(__file__).resolve().parents[1]
# Commands go through the zygote's client: a fork of one warm interpreter per test process
# (tests/docs_zygote.py), instead of a fresh interpreter importing torch and Lightning each time.
RUNNER = Path(__file__).resolve().parent / "docs_zygote.py"
UCI_DIR = REPO.parent / "shared" / "data" / "uci"
UCI_PLACEHOLDERS = ("../shared/data/uci", "path/to/uci")
LANGUAGES = {"python", "bash", "yaml", "text"}
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+|~~~+)[ \t]*(?P<lang>[^\s`]*)[^`]*$")
TIMEOUT_S = 300
ARCHIVE = "docs/archive/"  # pages that keep earlier passes verbatim (records, not examples)

# Blocks known to fail for a reason tracked elsewhere: a substring of the block -> (the reason,
# a substring of the expected error output). The block still runs: it is reported as xfail only
# when it fails with that error; a different failure fails the test, and so does a pass (then
# the entry must go).
XFAIL: dict[str, tuple[str, str]] = {}


@dataclass(frozen=True)
class Block:
    page: str  # path relative to the repository, e.g. "docs/lightning.md"
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: tuple[str, ...] = field(default=())

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def skip_reason(self) -> str | None:
        for directive in self.directives:
            if directive == "skip" or directive.startswith("skip "):
                return directive[4:].strip()
        return None

    @property
    def setup(self) -> str | None:
        for directive in self.directives:
            if directive.startswith("setup="):
                return directive.removeprefix("setup=")
        return None

    @property
    def continues(self) -> bool:
        return "continue" in self.directives

    @property
    def needs_uci(self) -> bool:
        return any(p in self.code for p in UCI_PLACEHOLDERS)


def pages() -> list[Path]:
    """README.md, every docs/*.md and every archived page, docs/archive/*.md."""
    docs = REPO / "docs"
    return [REPO / "README.md", *sorted(docs.glob("*.md")), *sorted(docs.glob("archive/*.md"))]


def extract(path: Path) -> list[Block]:
    """The fenced blocks of a page, with the ``docs-test`` directives just above each."""
    lines = path.read_text().splitlines()
    page = path.relative_to(REPO).as_posix()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence, lang = match["indent"], match["fence"], match["lang"]
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not (
            lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""
        ):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"{page}:{start + 1}: unclosed code fence")
        i += 1
        directives: list[str] = []
        j = start - 1
        while j >= 0 and (not lines[j].strip() or DIRECTIVE.fullmatch(lines[j].strip())):
            found = DIRECTIVE.fullmatch(lines[j].strip())
            if found:
                directives.insert(0, found[1])
            j -= 1
        blocks.append(Block(page, start + 1, lang, "\n".join(body) + "\n", tuple(directives)))
    return blocks


BLOCKS = [block for path in pages() for block in extract(path)]
RUNNABLE = [b for b in BLOCKS if b.lang in ("python", "bash", "yaml")]


def _uci_dir() -> Path:
    if not UCI_DIR.is_dir():
        if os.environ.get("CI"):
            raise FileNotFoundError(f"UCI data expected at {UCI_DIR} under CI")
        pytest.skip(f"UCI data not found at {UCI_DIR}")
    return UCI_DIR


def _with_data(code: str) -> str:
    for placeholder in UCI_PLACEHOLDERS:
        code = code.replace(placeholder, str(_uci_dir()))
    return code


def _bash_script(code: str) -> str:
    """Commands mapped onto this interpreter, through the runner (which applies fast mode)."""
    runner = f"{shlex.quote(sys.executable)} {shlex.quote(str(RUNNER))}"
    start = r"(?:^|(?<=[\s;&|(]))"
    code = re.sub(
        start + r"(?:\.venv/bin/)?lightning-dvi(?=\s|$)", f"{runner} cli", code, flags=re.M
    )
    code = re.sub(start + r"(?:\.venv/bin/)?python3?(?=\s)", f"{runner} python", code, flags=re.M)
    return code


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    env[FAST_ENV] = env.get(FAST_ENV, "1")  # LIGHTNING_DVI_DOCS_FAST=0 runs the full sizes
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    return env


@pytest.fixture(scope="session")
def zygote() -> Iterator[str]:
    """The socket of this test process's warm interpreter (``tests/docs_zygote.py``)."""
    folder = tempfile.mkdtemp(prefix="docs-zygote-")
    path = os.path.join(folder, "socket")
    server = subprocess.Popen(
        [sys.executable, str(RUNNER), "serve", path], env=_environment(),
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None
        line = server.stdout.readline().strip()
        assert line == READY, f"the docs zygote did not start (said {line!r})"
        yield path
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _check(result: subprocess.CompletedProcess, block: Block) -> None:
    if result.returncode != 0:
        pytest.fail(
            f"{block.id} ({block.lang}) failed with exit code {result.returncode}\n"
            f"--- stdout (tail)\n{result.stdout[-4000:]}\n--- stderr (tail)\n{result.stderr[-6000:]}",
            pytrace=False,
        )


def _parse_only(block: Block, workdir: Path) -> None:
    if block.lang == "python":
        compile(block.code, block.id, "exec")
    elif block.lang == "bash":
        result = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
        _check(result, block)


def _chained(block: Block) -> bool:
    """A ``continue`` block covered by its page's one chained run (``_page_chain``)."""
    return (
        block.lang == "python"
        and block.continues
        and block.setup is None
        and block.skip_reason is None
        and not any(snippet in block.code for snippet in XFAIL)
    )


@dataclass(frozen=True)
class _Chain:
    done: frozenset[int]  # the lines of the chained blocks the run got past
    result: subprocess.CompletedProcess


_CHAINS: dict[str, _Chain] = {}


def _page_chain(page: str, workdir: Path, zygote: str) -> _Chain:
    """Run ``page``'s python blocks in order in one namespace, up to its last chained block,
    once per test process; which chained blocks it got past and its output."""
    if page not in _CHAINS:
        checkpoints = [b.line for b in BLOCKS if b.page == page and _chained(b)]
        blocks = [
            [b.line, _with_data(b.code) if b.needs_uci else b.code]
            for b in BLOCKS
            if b.page == page and b.lang == "python" and b.line <= max(checkpoints)
        ]
        spec, done = workdir / "chain.json", workdir / "chain.done"
        spec.write_text(
            json.dumps(
                {"page": str(REPO / page), "blocks": blocks, "checkpoints": checkpoints,
                 "done": str(done)}
            )
        )  # fmt: skip
        done.touch()
        result = subprocess.run(
            [sys.executable, str(RUNNER), "chain", str(spec)], cwd=workdir,
            env={**_environment(), ZYGOTE_ENV: zygote}, capture_output=True, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
        finished = frozenset(int(line) for line in done.read_text().split())
        _CHAINS[page] = _Chain(finished, result)
    return _CHAINS[page]


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.id for b in RUNNABLE])
def test_documented_example_runs(block: Block, tmp_path: Path, zygote: str) -> None:
    if block.lang == "yaml":
        yaml.safe_load(block.code)
        return
    if block.skip_reason is not None:
        _parse_only(block, tmp_path)
        return
    (tmp_path / "recipes").symlink_to(REPO / "recipes", target_is_directory=True)
    code = _with_data(block.code) if block.needs_uci else block.code
    if _chained(block):
        chain = _page_chain(block.page, tmp_path, zygote)
        if block.line not in chain.done:
            _check(chain.result, block)  # names the block (page:line) that raised
            pytest.fail(f"{block.id}: the page's chained run ended before it", pytrace=False)
        return
    if block.lang == "python":
        earlier = [
            [b.line, b.code]
            for b in BLOCKS
            if block.continues
            and b.page == block.page
            and b.lang == "python"
            and b.line < block.line
        ]
        spec = tmp_path / "block.json"
        spec.write_text(
            json.dumps(
                {"page": str(REPO / block.page), "first_line": block.line, "code": code,
                 "setup": block.setup, "earlier": earlier}
            )
        )  # fmt: skip
        command = [sys.executable, str(RUNNER), "block", str(spec)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", _bash_script(code)]
    result = subprocess.run(
        command, cwd=tmp_path, env={**_environment(), ZYGOTE_ENV: zygote}, capture_output=True, text=True,
        timeout=TIMEOUT_S,
    )  # fmt: skip
    known = [entry for snippet, entry in XFAIL.items() if snippet in block.code]
    if known:
        reason, expected = known[0]
        if result.returncode == 0:
            pytest.fail(f"{block.id} passes now: remove its XFAIL entry ({reason})")
        if expected in result.stderr + result.stdout:
            pytest.xfail(reason)
    _check(result, block)


# ---------------------------------------------------------------------------- meta-tests
def test_the_harness_finds_the_documented_examples():
    by_lang: dict[str, int] = {}
    for block in BLOCKS:
        by_lang[block.lang] = by_lang.get(block.lang, 0) + 1
    assert {b.page for b in RUNNABLE} >= {"README.md", "docs/lightning.md", "docs/pyro.md"}
    assert by_lang.get("python", 0) >= 8, by_lang
    assert by_lang.get("bash", 0) >= 6, by_lang
    # Most examples really run: skipped ones are the exception (the archive's records aside).
    live = [b for b in RUNNABLE if not b.page.startswith(ARCHIVE)]
    skipped = [b for b in live if b.skip_reason is not None]
    assert len(skipped) <= len(live) // 2, [b.id for b in skipped]


def test_archived_pages_run_nothing():
    """docs/archive/ keeps past passes verbatim: their commands are parsed, never run."""
    archived = [b for b in RUNNABLE if b.page.startswith(ARCHIVE) and b.lang != "yaml"]
    assert archived, "no archived page found"
    assert not [b.id for b in archived if b.skip_reason is None]


def test_every_fence_names_a_known_language():
    unknown = [f"{b.id}: {b.lang or '(none)'}" for b in BLOCKS if b.lang not in LANGUAGES]
    assert not unknown, f"tag these fences with one of {sorted(LANGUAGES)}: {unknown}"


def test_directives_are_known_attached_and_give_reasons():
    for block in BLOCKS:
        for directive in block.directives:
            if directive.startswith("skip"):
                assert block.skip_reason, f"{block.id}: a skip needs a reason"
                assert block.lang in ("python", "bash"), f"{block.id}: skip on {block.lang}"
            elif directive == "continue":
                assert block.lang == "python", f"{block.id}: continue is for python blocks"
            elif directive.startswith("setup="):
                assert block.setup in SETUPS, f"{block.id}: unknown setup {block.setup!r}"
                assert block.lang == "python", f"{block.id}: setups are for python blocks"
            else:
                raise AssertionError(f"{block.id}: unknown docs-test directive {directive!r}")
    attached = sum(len(b.directives) for b in BLOCKS)
    written = sum(_directive_lines(p) for p in pages())
    assert attached == written, "a docs-test directive is not directly above a code fence"


def test_a_block_skipped_as_a_duplicate_runs_elsewhere():
    """``skip the same command runs in PAGE ...``: every line of the block is in a block of PAGE
    that runs (a duplicate is skipped, never lost)."""
    prefix = "the same command runs in "
    duplicates = [b for b in RUNNABLE if (b.skip_reason or "").startswith(prefix)]
    for block in duplicates:
        page = block.skip_reason.removeprefix(prefix).split()[0]  # type: ignore[union-attr]
        running = "".join(b.code for b in RUNNABLE if b.page == page and b.skip_reason is None)
        missing = [line for line in block.code.splitlines() if line.strip() not in running]
        assert not missing, f"{block.id}: not run on {page}: {missing}"


def _directive_lines(path: Path) -> int:
    """Lines outside code fences that are a ``docs-test`` directive and nothing else."""
    count, fence = 0, None
    for line in path.read_text().splitlines():
        match = FENCE.match(line)
        if fence is None and match:
            fence = match["fence"]
        elif (
            fence is not None
            and line.strip().startswith(fence)
            and not line.strip().strip(fence[0])
        ):
            fence = None
        elif fence is None and DIRECTIVE.fullmatch(line.strip()):
            count += 1
    return count


def test_bash_commands_are_mapped_to_this_interpreter():
    script = _bash_script(
        ".venv/bin/lightning-dvi fit --config x.yaml\nlightning-dvi test\n"
        "python recipes/a.py && .venv/bin/python -m mod\necho lightning-dvi-ish\n"
    )
    runner = f"{shlex.quote(sys.executable)} {shlex.quote(str(RUNNER))}"
    assert script.splitlines() == [
        f"{runner} cli fit --config x.yaml",
        f"{runner} cli test",
        f"{runner} python recipes/a.py && {runner} python -m mod",
        "echo lightning-dvi-ish",
    ]


def test_extract_reads_fences_directives_and_indentation(tmp_path, monkeypatch):
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- docs-test: skip needs a GPU -->\n\n```python\nx = 1\n```\n\n"
        "- item\n\n  ```bash\n  echo hi\n  ```\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    first, second = extract(page)
    assert (first.line, first.lang, first.code, first.skip_reason) == (
        5,
        "python",
        "x = 1\n",
        "needs a GPU",
    )
    assert (second.line, second.lang, second.code, second.directives) == (
        11,
        "bash",
        "echo hi\n",
        (),
    )


def test_the_zygote_runs_a_command_as_a_fresh_interpreter_would(tmp_path, zygote):
    """A forked command sees the client's directory, environment and streams; its exit status,
    an uncaught exception's traceback (status 1) and its ``atexit`` handlers are an interpreter's.
    """
    script = tmp_path / "probe.py"
    script.write_text(
        "import atexit, os, sys\n"
        "atexit.register(lambda: print('atexit ran', flush=True))\n"
        "print(os.getcwd(), os.environ['PROBE'], sys.argv[1:], sys.stdin.read().strip())\n"
        "print('to stderr', file=sys.stderr)\n"
        "if sys.argv[1] == 'raise':\n"
        "    raise RuntimeError('boom')\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    env = {**_environment(), ZYGOTE_ENV: zygote, "PROBE": "from-the-client"}
    for arg, status in (("3", 3), ("0", 0), ("raise", 1)):
        result = subprocess.run(
            [sys.executable, str(RUNNER), "python", str(script), arg], cwd=tmp_path, env=env,
            input="stdin-line\n", capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == status, result.stderr
        assert result.stdout.splitlines() == [
            f"{tmp_path} from-the-client {[arg]} stdin-line",
            "atexit ran",
        ]
        assert "to stderr" in result.stderr
        assert ("RuntimeError: boom" in result.stderr) == (arg == "raise")


def test_a_page_chain_runs_once_and_reports_the_blocks_it_got_past(tmp_path, zygote, monkeypatch):
    """The chained run stops at the first exception: the blocks before it pass, the rest fail."""
    page = str(tmp_path / "page.md")
    counter = tmp_path / "runs.txt"
    blocks = [
        Block(page, 1, "python", f"open({str(counter)!r}, 'a').write('x')\nx = 1\n"),
        Block(page, 5, "python", "y = x + 1\n", ("continue",)),
        Block(page, 9, "python", "z = y + 1\nraise ValueError(z)\n", ("continue",)),
        Block(page, 14, "python", "print(z)\n", ("continue",)),
    ]
    monkeypatch.setattr(sys.modules[__name__], "BLOCKS", blocks)
    monkeypatch.setattr(sys.modules[__name__], "_CHAINS", {})
    chain = _page_chain(page, tmp_path, zygote)
    assert chain.done == {5}
    assert chain.result.returncode == 1
    assert (
        f'File "{page}", line 11' in chain.result.stderr and "ValueError: 3" in chain.result.stderr
    )
    assert _page_chain(page, tmp_path, zygote) is chain  # one run per test process
    assert counter.read_text() == "x"
    assert [_chained(b) for b in blocks] == [False, True, True, True]

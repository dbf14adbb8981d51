"""The documentation runs as written: every ```python block of README.md and docs/*.md is
executed, every dotted ``bik.`` name the pages mention exists, and every path of the tree
that a page names (its own folder's, or the repository's) exists.

A page's blocks run in order as one script (later blocks may use earlier ones' names), in a
fresh process (``__name__ == "__main__"``, so a guarded script runs its main; from a file,
so that it may start processes) with the repository on the path and a scratch directory as
the working directory. A block may be left out only with a reason, on the line just before
it: ``<!-- docs-test: skip (REASON) -->``.
"""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
SKIP = re.compile(r"<!-- docs-test: skip \((.+)\) -->\s*$")
NAME = re.compile(r"(?<![\w.])bik(?:\.[A-Za-z_]\w*)+")
# the prose that names paths: the pages above, the layout map, the harness's and benchmarks'
PATH_PAGES = [
    *PAGES,
    ROOT / "CONTRIBUTING.md",
    ROOT / "rl_harness/README.md",
    ROOT / "benchmarks/README.md",
]
# a path of the tree: a top folder, then names, globs (*) and brace lists ({json,md})
PATH = re.compile(
    r"(?<![\w/.-])((?:bik|rl_harness|tests|benchmarks|csrc|docs|results|\.ci)/[\w./*{},-]*[\w/*}])"
)


def python_blocks(text: str) -> list[tuple[int, str, str | None]]:
    """(first line, code, skip reason or None) of each ```python block of a page."""
    blocks = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        reason = SKIP.match(before)
        line = text.count("\n", 0, match.start()) + 2
        blocks.append((line, match.group(1), reason.group(1) if reason else None))
    return blocks


def script_of(page: Path) -> str:
    """The page's runnable blocks as one script; each block starts at its line in the page,
    so a traceback's line number points into the page."""
    lines: list[str] = []
    for line, code, reason in python_blocks(page.read_text()):
        if reason is None:
            lines += [""] * (line - 1 - len(lines))
            lines += code.splitlines()
    return "\n".join(lines) + "\n"


def test_blocks_are_found_and_skips_need_a_reason():
    text = "a\n```python\nx = 1\n```\n<!-- docs-test: skip (needs a GPU) -->\n```python\ny\n```\n"
    assert python_blocks(text) == [(3, "x = 1\n", None), (7, "y\n", "needs a GPU")]
    text = "<!-- docs-test: skip () -->\n```python\ny\n```\n"
    assert python_blocks(text)[0][2] is None  # no reason, no skip


def _page_params() -> list:
    """A page whose blocks build a vLLM engine is `slow` (minutes on a CPU): make test runs
    it, make test-fast leaves it out."""
    return [
        pytest.param(page, marks=[pytest.mark.slow] if "vllm" in script_of(page) else [])
        for page in PAGES
    ]


@pytest.mark.parametrize("page", _page_params(), ids=lambda p: p.name)
def test_python_blocks_run(page, tmp_path, request):
    script = script_of(page)
    if not script.strip():
        pytest.skip(f"{page.name} has no runnable python block")
    if "models.path(" in script:  # the real model: skipped only where BIK_OFFLINE=1
        request.getfixturevalue("smollm2")
    # a file, not -c: a page may start processes (multiprocessing's spawn re-imports the
    # main module from its file), and tracebacks then name the page's lines in it
    path = tmp_path / f"{page.stem}_page.py"
    path.write_text(script)
    done = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, f"{page.name}:\n{done.stderr[-3000:]}"


# modules whose requirements live in a venv of their own (bik.verl: make install-verl)
OPTIONAL = ("bik.verl.",)


def resolves(name: str) -> bool:
    """Whether ``bik.a.b...`` names a module or an attribute reachable from one (an
    :data:`OPTIONAL` module that does not import here counts by its file, its attributes
    unchecked)."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            module = ".".join(parts[:cut])
            if (
                module.startswith(OPTIONAL)
                and ROOT.joinpath(*parts[:cut]).with_suffix(".py").is_file()
            ):
                return True
            continue
        try:
            for attribute in parts[cut:]:
                found = getattr(found, attribute)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_bik_name_exists(page):
    names = sorted(set(NAME.findall(page.read_text())))
    missing = [n for n in names if not resolves(n)]
    assert not missing, f"{page.name} names what bik does not have: {missing}"


def expanded(token: str) -> list[str]:
    """A path with its first brace list expanded ("a.{json,md}": a.json, a.md), recursively."""
    match = re.search(r"\{([^{}]*)\}", token)
    if match is None:
        return [token]
    head, tail = token[: match.start()], token[match.end() :]
    return [p for part in match.group(1).split(",") for p in expanded(head + part + tail)]


@pytest.mark.parametrize("page", PATH_PAGES, ids=lambda p: p.name)
def test_every_path_a_page_names_exists(page):
    text = page.read_text()
    missing = []
    for match in PATH.finditer(text):
        rest = re.match(r"[^\s`]*", text[match.end() :])
        if rest is not None and "<" in rest.group():  # a pattern: tests/ops/test_<op>.py
            continue
        for path in expanded(match.group(1)):
            if not any(any(base.glob(path)) for base in (ROOT, page.parent)):
                missing.append(path)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"

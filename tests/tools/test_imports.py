"""The import rules, at module level, inside a function or for the type checker alone:

- no two modules of bik or rl_harness import each other, directly or around a circle: a module
  can be read after the modules it imports (package ``__init__`` files, which gather their
  submodules, are left out);
- ``bik.tools`` is the command line only: nothing imports it but itself, ``python -m bik``
  (``bik/__main__.py``, ``bik/bench.py``) and the command line's own tests; what tests,
  benchmarks and the harness share lives in ``bik.testing``.
"""

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("bik", "rl_harness")
COMMAND_LINE = "bik.tools"
# Outside bik/tools, the files that may import the command line: its entry points and tests.
COMMAND_LINE_USERS = {
    "bik/__main__.py",
    "bik/bench.py",
    "tests/tools/test_cli.py",
    "tests/tools/test_bench.py",
    "tests/tools/test_bench_vllm.py",
    "tests/tools/test_verify_vllm.py",
}
# Every Python file of the repository that the rule covers (virtual environments aside).
CHECKED = ("bik", "rl_harness", "tests", "benchmarks")


def _modules() -> dict[str, Path]:
    """Every module of PACKAGES by its dotted name (a package by its own name)."""
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The modules of ``modules`` that module ``name`` (at ``path``; "" for a script outside
    PACKAGES) imports anywhere."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            source = ".".join([*base, *([node.module] if node.module else [])])
            targets = [f"{source}.{alias.name}" for alias in node.names] + [source]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if target:
                yield target


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``: its strongly connected parts of two modules or more
    (Tarjan's algorithm)."""
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for other in graph.get(node, ()):
            if other not in order:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], order[other])
        if low[node] == order[node]:
            part = []
            while not part or part[-1] != node:
                part.append(stack.pop())
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    modules = _modules()
    graph = {
        name: {
            target
            for target in _imported(name, path, modules)
            if target != name and modules[target].name != "__init__.py"
        }
        for name, path in modules.items()
        if path.name != "__init__.py"
    }
    assert _cycles(graph) == []


def test_a_circle_is_found():
    """The control: the search finds a circle of three and ignores a chain."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def _command_line_importers(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    """The files under ``root`` outside bik/tools, other than COMMAND_LINE_USERS, that import
    bik.tools."""
    names = {path: name for name, path in modules.items()}
    found = []
    for folder in CHECKED:
        for path in sorted((root / folder).rglob("*.py")):
            relative = path.relative_to(root).as_posix()
            if relative.startswith("bik/tools/") or relative in COMMAND_LINE_USERS:
                continue
            targets = _imported(names.get(path, ""), path, modules)
            if any(t == COMMAND_LINE or t.startswith(f"{COMMAND_LINE}.") for t in targets):
                found.append(relative)
    return found


def test_only_the_command_line_and_its_tests_import_bik_tools():
    assert _command_line_importers(_modules()) == []


def test_an_import_of_the_command_line_is_found(tmp_path):
    """The control: a benchmark that imports a tool is named."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "probe.py").write_text("from bik.tools import demo\n")
    (tmp_path / "benchmarks" / "fine.py").write_text("from bik.testing import rollouts\n")
    assert _command_line_importers(_modules(), tmp_path) == ["benchmarks/probe.py"]

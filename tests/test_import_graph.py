"""The import graph of job/ and adapters/, read from the code's own ``import`` statements with the
ast module: those inside functions and under ``TYPE_CHECKING`` count (they are the same dependency,
only later). It has no circle between files, none between parts (a folder of job/ is one part, as
are adapters/ and each file directly in job/: an arrow back up into a part that imports this one
closes a circle there), and the production command line (job/cli.py) reaches no benchmark code.
"""

from __future__ import annotations

import ast
import graphlib
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("job", "adapters")
CLI = "job/cli.py"
BENCHMARKS = "job/benchmarks/"

# A module's file -> {imported file: the first line importing it}
Graph = dict[str, dict[str, int]]


def module_files(root: Path) -> dict[str, str]:
    """Dotted module name -> its file, relative to ``root``, for every module of the packages."""
    files = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            files[name] = path.relative_to(root).as_posix()
    return files


def _imported_files(node: ast.Import | ast.ImportFrom, package: str, files: dict[str, str]) -> Iterator[str]:
    """The files of the packages an import statement loads (``package``: the importing module's)."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:  # relative: up from the importing module's package
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        # ``from a import b``: module a.b where b is one, else a itself (b a name defined in it)
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
    for name in names:
        while name and name not in files:  # ``import a.b`` where only a is one of ours, or none
            name = name.rpartition(".")[0]
        if name:
            yield files[name]


def import_graph(root: Path) -> Graph:
    files = module_files(root)
    graph: Graph = {}
    for name, file in files.items():
        package = name if file.endswith("__init__.py") else name.rpartition(".")[0]
        edges = graph.setdefault(file, {})
        for node in ast.walk(ast.parse((root / file).read_text(), file)):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _imported_files(node, package, files):
                    if target != file:
                        edges.setdefault(target, node.lineno)
    return graph


def part(file: str) -> str:
    """A folder below job/ is one part, as is adapters/; a file directly in job/ is its own."""
    top, *rest = file.split("/")
    if top != "job":
        return top + "/"
    return f"job/{rest[0]}/" if len(rest) > 1 else file


def parts_graph(graph: Graph) -> Graph:
    parts: Graph = {}
    for file, edges in graph.items():
        mine = parts.setdefault(part(file), {})
        for target in edges:
            if part(target) != part(file):
                mine.setdefault(part(target), 0)
    return parts


def circle(graph: Graph) -> list[str]:
    """One circle of the graph (its first node again at its end), or none."""
    try:
        graphlib.TopologicalSorter({node: set(edges) for node, edges in graph.items()}).prepare()
    except graphlib.CycleError as exc:
        return list(exc.args[1])
    return []


def reached_from(graph: Graph, start: str) -> dict[str, list[str]]:
    """Every file ``start`` imports, straight or through others, with one path to it."""
    paths = {start: [start]}
    todo = [start]
    while todo:
        file = todo.pop()
        for target in graph.get(file, {}):
            if target not in paths:
                paths[target] = [*paths[file], target]
                todo.append(target)
    return paths


def _arrows(cycle: list[str], where: Callable[[str, str], str]) -> str:
    """A circle as its arrows, each with where it is imported."""
    # TopologicalSorter lists a circle against the arrows: each node is imported by the next one
    steps = list(reversed(cycle))
    return "; ".join(f"{a} -> {b} ({where(a, b)})" for a, b in itertools.pairwise(steps))


def test_the_reader_sees_lazy_and_type_checking_imports() -> None:
    """The graph holds the imports inside functions and under TYPE_CHECKING, not only those at
    a module's top: job/backends/__init__.py imports the vLLM backend inside create_backend, and
    job/shards/format.py imports job/data/encode.py only under TYPE_CHECKING."""
    graph = import_graph(ROOT)
    assert "job/backends/vllm.py" in graph["job/backends/__init__.py"]
    assert "job/data/encode.py" in graph["job/shards/format.py"]


def test_no_circle_between_files() -> None:
    graph = import_graph(ROOT)
    cycle = circle(graph)
    assert not cycle, "import circle: " + _arrows(cycle, lambda a, b: f"line {graph[a][b]}")


def test_no_arrow_back_up_between_parts() -> None:
    files = import_graph(ROOT)
    cycle = circle(parts_graph(files))

    def where(a: str, b: str) -> str:
        return ", ".join(
            f"{file}:{line}"
            for file, edges in files.items()
            if part(file) == a
            for target, line in edges.items()
            if part(target) == b
        )

    assert not cycle, "a circle between parts (an arrow back up): " + _arrows(cycle, where)


def test_the_command_line_reaches_no_benchmark() -> None:
    reached = reached_from(import_graph(ROOT), CLI)
    into_benchmarks = [path for file, path in reached.items() if file.startswith(BENCHMARKS)]
    assert not into_benchmarks, f"{CLI} imports benchmark code: {' -> '.join(into_benchmarks[0])}"


def _tree(root: Path, files: dict[str, str]) -> Graph:
    for name, text in {"job/__init__.py": "", "adapters/__init__.py": "", **files}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return import_graph(root)


def test_what_the_checks_find(tmp_path: Path) -> None:
    """What the checks above rely on, on small trees: a circle closed by a relative import inside
    a function; the command line reaching a benchmark through two other files; a circle between
    parts whose files import no circle."""
    graph = _tree(
        tmp_path / "files",
        {
            "job/cli.py": "def main():\n    from job import run\n",
            "job/run.py": "from .stage import go\n",
            "job/stage.py": "def go():\n    from . import run\n    from .benchmarks.speed import x\n",
            "job/benchmarks/__init__.py": "",
            "job/benchmarks/speed.py": "x = 1\n",
        },
    )
    assert set(circle(graph)) == {"job/run.py", "job/stage.py"}
    assert reached_from(graph, CLI)["job/benchmarks/speed.py"] == [
        "job/cli.py",
        "job/run.py",
        "job/stage.py",
        "job/benchmarks/speed.py",
    ]
    graph = _tree(
        tmp_path / "parts",
        {
            "job/pipeline/__init__.py": "",
            "job/pipeline/a.py": "import job.plan\n",
            "job/pipeline/b.py": "",
            "job/plan.py": "from job.pipeline import b\n",
        },
    )
    assert not circle(graph)
    assert set(circle(parts_graph(graph))) == {"job/pipeline/", "job/plan.py"}

"""The import graph of the package: no circles, and the layers point one way (services -> shared -> kernels).

Read from the source with `ast`, never by importing it, so the test costs no torch and sees every import a
module can run: at the top, inside functions (lazy imports, the usual way a circle is hidden), in `try`
blocks and class bodies. The modules are those the package-dir mapping of pyproject.toml installs as
`pdserve.*` (every .py under each mapped folder, new subpackages included), plus the scripts of
`benchmarks/`, which import the package and each other (`from bench_serving import ...`).
"""
from __future__ import annotations

import ast
import tomllib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = "benchmarks"  # not installed; named benchmarks.<script> here


@dataclass(frozen=True)
class Edge:
    source: str  # the importing module
    target: str  # the imported module (a submodule when `from package import submodule`)
    where: str  # path:line of the import
    lazy: bool  # inside a function: runs when called, not when the module loads
    type_only: bool  # under `if TYPE_CHECKING:`: never runs


def package_dirs() -> dict[str, Path]:
    mapping = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: REPO / folder for package, folder in mapping.items()}


def find_modules() -> dict[str, Path]:
    """Module name -> file, for every module of the package and every benchmark script."""
    modules: dict[str, Path] = {}
    roots = {**package_dirs(), SCRIPTS: REPO / SCRIPTS}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if "__pycache__" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class ImportCollector(ast.NodeVisitor):
    """Every import statement of one module, each with whether it is lazy and whether it only serves typing."""

    def __init__(self) -> None:
        self.found: list[tuple[ast.Import | ast.ImportFrom, bool, bool]] = []
        self._depth = 0  # functions we are inside
        self._type_only = 0  # `if TYPE_CHECKING:` bodies we are inside

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if not is_type_checking(node.test):
            self.generic_visit(node)
            return
        self._type_only += 1
        for child in node.body:
            self.visit(child)
        self._type_only -= 1
        for child in node.orelse:  # the `else:` of TYPE_CHECKING runs
            self.visit(child)

    def _import(self, node: ast.Import | ast.ImportFrom) -> None:
        self.found.append((node, self._depth > 0, self._type_only > 0))

    visit_Import = visit_ImportFrom = _import


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The module `name` loads: itself if it is one of ours, else its longest prefix that is (an attribute of a
    module, e.g. `pdserve.shared.config.Role`, resolves to the module); None for names outside the package."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def imported_names(module: str, node: ast.Import | ast.ImportFrom, modules: dict[str, Path]) -> list[str]:
    """Our modules that one import statement loads (parent packages aside); names outside the package dropped."""
    script = module.startswith(SCRIPTS + ".")
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
        if script:  # a script's folder is on sys.path: `import bench_serving`
            names += [f"{SCRIPTS}.{name}" for name in names]
        targets = [resolve(name, modules) for name in names]
    else:
        if node.level:  # relative: counted from the importing module's package
            package = module.split(".")
            if modules[module].name != "__init__.py":
                package = package[:-1]
            stems = [".".join([*package[:len(package) - node.level + 1], *filter(None, [node.module])])]
        else:
            stems = [node.module or ""] + ([f"{SCRIPTS}.{node.module}"] if script else [])
        targets = []
        for stem in stems:
            base = resolve(stem, modules)
            if base is None:
                continue
            # `from package import name`: the submodule package.name when there is one, else package itself.
            for alias in node.names:
                sub = resolve(f"{stem}.{alias.name}", modules)
                targets.append(sub if sub is not None and sub.startswith(base + ".") else base)
    return list(dict.fromkeys(t for t in targets if t is not None))


def import_edges() -> list[Edge]:
    modules = find_modules()
    edges = []
    for module, path in modules.items():
        collector = ImportCollector()
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        for node, lazy, type_only in collector.found:
            for target in imported_names(module, node, modules):
                if target != module:
                    edges.append(Edge(module, target, f"{path.relative_to(REPO)}:{node.lineno}", lazy, type_only))
    return edges


def graph(edges: list[Edge]) -> dict[str, dict[str, Edge]]:
    adjacency: dict[str, dict[str, Edge]] = {}
    for edge in edges:
        adjacency.setdefault(edge.source, {}).setdefault(edge.target, edge)
    return adjacency


def cycles(adjacency: dict[str, dict[str, Edge]]) -> list[list[str]]:
    """One shortest circle through each module that lies on one, without repeats: [a, b, a], ..."""
    found: list[list[str]] = []
    seen: set[frozenset[tuple[str, str]]] = set()
    for start in sorted(adjacency):
        back = {start: None}  # breadth first from start's successors back to start
        queue = deque([start])
        path = None
        while queue and path is None:
            node = queue.popleft()
            for successor in sorted(adjacency.get(node, {})):
                if successor == start:
                    path = [node]
                    while back[path[-1]] is not None:
                        path.append(back[path[-1]])
                    path = [*reversed(path), start]
                    break
                if successor not in back:
                    back[successor] = node
                    queue.append(successor)
        if path is None:
            continue
        key = frozenset(zip(path, path[1:]))
        if key not in seen:
            seen.add(key)
            found.append(path)
    return found


def describe(cycle: list[str], adjacency: dict[str, dict[str, Edge]]) -> str:
    arrows = " -> ".join(name.removeprefix("pdserve.") for name in cycle)
    steps = [adjacency[a][b] for a, b in zip(cycle, cycle[1:])]
    where = ", ".join(f"{e.where}{' (lazy)' if e.lazy else ''}" for e in steps)
    return f"{arrows}    [{where}]"


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges()


def test_the_scan_sees_the_package(edges):
    """Guards the scan itself: a test that found no modules or no imports would pass whatever the code did."""
    modules = find_modules()
    assert {"pdserve.cli", "pdserve.shared.engine", "pdserve.services.worker.front.app", "pdserve.kernels.rmsnorm",
            "pdserve.proto.codec", "benchmarks.bench_serving"} <= set(modules)
    pairs = {(e.source, e.target) for e in edges}
    assert ("pdserve.services.worker.engine.engine_worker", "pdserve.shared.engine") in pairs  # a plain top-level import
    assert ("pdserve.services.worker.front.app", "pdserve.proto.worker_pb2") in pairs  # `from package import module`
    assert ("benchmarks.bench_lora", "benchmarks.servers") in pairs  # a script importing its sibling
    assert any(e.lazy for e in edges) and any(e.type_only for e in edges)


def test_a_circle_closed_by_a_lazy_import_is_found():
    """The checker itself on a made-up pair: a imports b at the top, b imports a inside a function (the way the
    worker's app and cli hid theirs); a typing-only import is told apart."""
    source = ("from pdserve.x import b\n"
              "if TYPE_CHECKING:\n    from pdserve.y import c\n"
              "def later():\n    from pdserve.x import a\n")
    collector = ImportCollector()
    collector.visit(ast.parse(source))
    assert [(n.module, lazy, type_only) for n, lazy, type_only in collector.found] == [
        ("pdserve.x", False, False), ("pdserve.y", False, True), ("pdserve.x", True, False)]
    modules = {name: Path(f"{name}.py") for name in ("pdserve.x", "pdserve.x.a", "pdserve.x.b", "pdserve.y")}
    assert imported_names("pdserve.x.b", collector.found[2][0], modules) == ["pdserve.x.a"]
    edge = Edge("", "", "", False, False)
    adjacency = {"pdserve.x.a": {"pdserve.x.b": edge}, "pdserve.x.b": {"pdserve.x.a": edge, "pdserve.y": edge}}
    assert cycles(adjacency) == [["pdserve.x.a", "pdserve.x.b", "pdserve.x.a"]]
    assert cycles({"pdserve.x.a": {"pdserve.x.b": edge}}) == []


def test_no_import_circles(edges):
    """No module imports, even lazily inside a function or only for typing, a module that imports it back.

    Lazy imports count: they run, and a lazy import is exactly how a circle is hidden. Imports under
    `if TYPE_CHECKING:` count too: they never run, but a part that names the type of the whole above it (an
    engine a role is given) depends on all of it, and reading either means reading both. A lower part states
    what it needs as a narrow type of its own (the runtime's helpers hold shared/step_ops.py's `StepOps`)."""
    adjacency = graph(edges)
    found = cycles(adjacency)
    assert not found, "import circles (break them by moving the shared part into a module both import):\n" + \
        "\n".join(describe(c, adjacency) for c in found)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else parts[0]


@pytest.mark.parametrize("lower, upper", [
    ("shared", "services"), ("kernels", "services"), ("proto", "services"), ("kernels", "shared"),
])
def test_lower_layers_never_import_upper_ones(edges, lower, upper):
    """Direction services -> shared -> kernels. Typing-only imports count too: a lower layer that names an
    upper one's types depends on it just the same."""
    wrong = [f"{e.source} -> {e.target}  [{e.where}]" for e in edges
             if layer(e.source) == lower and layer(e.target) == upper]
    assert not wrong, f"{lower} imports {upper}:\n" + "\n".join(wrong)


SERVER = ("shared", "services", "kernels", "proto")


def test_the_bench_client_and_the_server_stand_apart(edges):
    """`pdserve bench` measures any OpenAI-compatible server: it speaks HTTP only, so none of the runtime, the
    services or the wire format loads with it, and the server never needs the client."""
    client = [e for e in edges if layer(e.source) == "benchclient"]
    assert client, "the scan saw no import in the bench client"
    wrong = [f"{e.source} -> {e.target}  [{e.where}]" for e in edges
             if {layer(e.source), layer(e.target)} in ({"benchclient", s} for s in SERVER)]
    assert not wrong, "the bench client and the server import each other:\n" + "\n".join(wrong)


WORKER_ROOMS = ("front", "engine", "channel")  # services/worker/<room>/; the modules beside them: cli, encoder_*


def worker_room(module: str) -> str | None:
    """The room of a module of the worker ("top": cli.py and the encoder worker, which assemble the rooms)."""
    prefix = "pdserve.services.worker."
    if not module.startswith(prefix):
        return None
    first = module[len(prefix):].split(".")[0]
    return first if first in WORKER_ROOMS else "top"


def test_the_workers_rooms_import_one_way(edges):
    """The worker's front (gRPC, HTTP, peers, the link) and its engine process (the engine, each role's
    handlers) meet only in the channel room (the wire, the message types, the start settings): neither imports
    the other, the channel neither, and no room imports the modules that assemble them (cli, the encoder
    worker). Lazy and typing-only imports count: the front must never load the engine's torch."""
    assert {worker_room(e.source) for e in edges} >= set(WORKER_ROOMS), "the scan saw no worker room"
    allowed = {"front": {"front", "channel"}, "engine": {"engine", "channel"}, "channel": {"channel"}}
    wrong = [f"{e.source} -> {e.target}  [{e.where}]" for e in edges
             if worker_room(e.source) in allowed and worker_room(e.target) is not None
             and worker_room(e.target) not in allowed[worker_room(e.source)]]
    assert not wrong, "the worker's rooms import against their direction:\n" + "\n".join(wrong)

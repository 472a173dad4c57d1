"""The gateway's three rooms and the way their imports point: apis -> intake -> workers -> the plain modules at
the top (errors, metrics, limits, tokenization, ...), which import no room; app.py, cli.py and processes.py put
it all together. Only `workers/` speaks to a worker: nothing else imports gRPC or the worker stubs, or touches a
worker's stub."""
from __future__ import annotations

import ast
from pathlib import Path

import pdserve.services.gateway as gateway

ROOT = Path(gateway.__file__).parent
ASSEMBLY = {"app", "cli", "processes"}
ORDER = ["base", "workers", "intake", "apis"]  # each may import itself and what comes before it


def room(module: str) -> str | None:
    """The room of a dotted module under the gateway package, else None (a module outside the gateway)."""
    prefix = "pdserve.services.gateway."
    if not module.startswith(prefix):
        return None
    first = module[len(prefix):].split(".")[0]
    if first in ASSEMBLY:
        return "assembly"
    return first if first in ORDER else "base"


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        parts = [p for p in relative.parts if p != "__init__"]
        yield path, "pdserve.services.gateway." + ".".join(parts) if parts else "pdserve.services.gateway"


def imports(path: Path, module: str):
    """Every module `path` imports, function-level imports included (`from x import y` counts x and x.y)."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            yield base
            yield from (f"{base}.{a.name}" for a in node.names)


def test_imports_point_one_way():
    assert {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()} == {"apis", "intake", "workers"}
    wrong = []
    for path, module in modules():
        mine = room(module)
        if mine in (None, "assembly"):
            continue
        for target in imports(path, module):
            theirs = room(target)
            if theirs in (None, "base") or theirs == mine:
                continue
            if theirs == "assembly" or ORDER.index(theirs) > ORDER.index(mine):
                wrong.append(f"{module} ({mine}) imports {target} ({theirs})")
    assert not wrong, "\n".join(wrong)


def test_only_the_workers_room_speaks_to_workers():
    wrong = []
    for path, module in modules():
        if room(module) == "workers":
            continue
        tree = ast.parse(path.read_text())
        for target in imports(path, module):
            if target.split(".")[0] == "grpc" or target.startswith("pdserve.proto"):
                wrong.append(f"{module} imports {target}")
        wrong += [f"{module}:{n.lineno} touches a worker's stub" for n in ast.walk(tree)
                  if isinstance(n, ast.Attribute) and n.attr == "stub"]
    assert not wrong, "\n".join(wrong)



# Inside apis/: the modules every route family may use (the shared state, the served-model table, OpenAI's
# output shapes, the native logprob fields), and openapi.py, which documents every family's request types.
APIS_SHARED = {"context", "served_models", "openai_format", "native_logprobs"}
APIS_INDEX = {"openapi"}


def family(module: str) -> str | None:
    """The route family of a module under apis/ (its module or subpackage there), else None."""
    prefix = "pdserve.services.gateway.apis."
    return module[len(prefix):].split(".")[0] if module.startswith(prefix) else None


def test_route_families_import_no_other_family():
    """A route family (a module or subpackage of apis/) builds on the shared modules and the rooms below, never on
    another family: what two families share moves into a shared module (or they are one family, one package)."""
    wrong = []
    for path, module in modules():
        mine = family(module)
        if mine is None or mine in APIS_SHARED | APIS_INDEX:
            continue
        for target in imports(path, module):
            theirs = family(target)
            if theirs in (None, mine) or theirs in APIS_SHARED:
                continue
            if (ROOT / "apis" / theirs).is_dir() or (ROOT / "apis" / f"{theirs}.py").exists():
                wrong.append(f"{module} imports {target}")
    assert not wrong, "\n".join(wrong)

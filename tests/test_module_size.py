"""No module of the package grows past 400 lines: past that a module is asking to be split by the resource or
the lifecycle stage it owns (docs/architecture.md). Generated gRPC stubs are not written by hand and do not count.
"""
from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pdserve", "shared", "services", "kernels", "proto", "benchclient", "benchmarks")
LIMIT = 400


def test_no_module_is_over_the_limit():
    sizes = {path.relative_to(ROOT): len(path.read_text().splitlines())
             for folder in SOURCES for path in (ROOT / folder).rglob("*.py") if not path.stem.endswith("_pb2_grpc")
             and not path.stem.endswith("_pb2")}
    assert sizes, "no sources found"
    over = sorted((str(path), n) for path, n in sizes.items() if n > LIMIT)
    assert not over, f"modules over {LIMIT} lines:\n" + "\n".join(f"  {path}: {n}" for path, n in over)

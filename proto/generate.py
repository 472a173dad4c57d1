"""Regenerate the gRPC stubs from the .proto files in this folder.

Run `python -m pdserve.proto.generate` after editing a .proto; a test runs
`python -m pdserve.proto.generate --check` to prove the committed stubs match, so
they are never edited by hand.
"""
from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROTOS = ["worker.proto"]


def render() -> dict[str, str]:
    """Return {file name: text} of the stubs protoc generates for PROTOS."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        for name in PROTOS:
            rc = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out}", f"--grpc_python_out={out}", str(HERE / name)])
            if rc != 0:
                raise RuntimeError(f"protoc failed on {name}")
        stubs = {}
        for path in sorted(Path(out).glob("*.py")):
            text = path.read_text()
            # protoc writes absolute imports; the stubs live inside pdserve.proto.
            text = re.sub(r"^import (\w+_pb2) as", r"from . import \1 as", text, flags=re.M)
            stubs[path.name] = text
        return stubs


def stale() -> list[str]:
    """Names of the committed stubs that differ from what protoc generates now."""
    return [name for name, text in render().items()
            if not (HERE / name).exists() or (HERE / name).read_text() != text]


def main() -> int:
    if sys.argv[1:] == ["--check"]:
        names = stale()
        for name in names:
            print(f"{name} is stale: run `python -m pdserve.proto.generate`", file=sys.stderr)
        return 1 if names else 0
    for name, text in render().items():
        (HERE / name).write_text(text)
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

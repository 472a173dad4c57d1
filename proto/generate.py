"""Regenerate the gRPC stubs from the .proto files in this folder.

Run `python -m pdserve.proto.generate` after editing a .proto; a test runs
`python -m pdserve.proto.generate --check` to prove the committed stubs match, so
they are never edited by hand. The check compares what the stubs define, not the
version of grpcio-tools that wrote them: each release stamps its own version into
the text (the lock, requirements.lock, decides which one is installed).
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


# The lines where protoc and its gRPC plugin stamp their own versions.
_STAMPS = [re.compile(r"^GRPC_GENERATED_VERSION = '[^']*'$", re.M),
           re.compile(r"^# Protobuf Python Version: .*$", re.M),
           re.compile(r"^_runtime_version\.ValidateProtobufRuntimeVersion\(\n(?:    .*\n)*?\)$", re.M)]


def definitions(text: str) -> str:
    """A stub's text without the generators' version stamps: what its services and messages are."""
    for stamp in _STAMPS:
        text = stamp.sub("<version>", text)
    return text


def stale() -> list[str]:
    """Names of the committed stubs whose definitions differ from what protoc generates now."""
    return [name for name, text in render().items()
            if not (HERE / name).exists() or definitions((HERE / name).read_text()) != definitions(text)]


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

"""The committed gRPC stubs are exactly what protoc generates from the .proto files."""
from __future__ import annotations

from pathlib import Path

from pdserve.proto import generate


def test_committed_stubs_match_the_proto_files():
    for name, text in generate.render().items():
        committed = (Path(generate.__file__).parent / name).read_text()
        assert committed == text, f"{name} is stale: run `python -m pdserve.proto.generate`"

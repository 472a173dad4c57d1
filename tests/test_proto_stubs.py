"""The committed gRPC stubs are exactly what protoc generates from the .proto files."""
from __future__ import annotations

import subprocess
import sys


def test_committed_stubs_match_the_proto_files():
    # In a process of its own: grpc_tools' bundled protoc extension can crash a process that already
    # loaded torch, NIXL and the protobuf runtime (as the test session has).
    run = subprocess.run([sys.executable, "-m", "pdserve.proto.generate", "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr

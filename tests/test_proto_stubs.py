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


def test_the_check_ignores_the_generators_versions_but_not_a_definition():
    from pdserve.proto import generate

    committed = (generate.HERE / "worker_pb2_grpc.py").read_text()
    other_release = committed.replace("GRPC_GENERATED_VERSION = '", "GRPC_GENERATED_VERSION = '9.99.9")
    assert other_release != committed
    assert generate.definitions(other_release) == generate.definitions(committed)
    renamed = committed.replace("class WorkerStub", "class WorkerStubRenamed")
    assert generate.definitions(renamed) != generate.definitions(committed)
    messages = (generate.HERE / "worker_pb2.py").read_text()
    assert generate.definitions(messages.replace("Protobuf Python Version: ", "Protobuf Python Version: 0.")) \
        == generate.definitions(messages)

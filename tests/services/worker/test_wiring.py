"""Each worker role is wired in one module (`services/worker/colocated.py`, `prefill.py`, `decode.py`): what it
serves, how it takes a Generate call, which side of KV transfers its engine holds. The modules every role runs
through keep no role checks of their own."""
from __future__ import annotations

import ast
from pathlib import Path

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.settings import wiring_for
from pdserve.shared.config import Role

WORKER = Path(__file__).resolve().parents[3] / "services" / "worker"
ROLE_FREE = ("app.py", "rpc.py", "admin_rpc.py", "weights_rpc.py", "pooling.py", "engine_calls.py",
             "engine_admin_calls.py", "engine_process.py", "engine_link.py", "multiplex.py")


def test_each_role_says_what_it_serves_and_which_transfer_side_it_holds():
    colocated, prefill, decode = (wiring_for(r) for r in (Role.COLOCATED, Role.PREFILL, Role.DECODE))
    assert (colocated.transfer, prefill.transfer, decode.transfer) == (None, "sender", "receiver")
    assert (colocated.serves_pooling_models, prefill.serves_pooling_models, decode.serves_pooling_models) == \
        (True, False, False)
    plain, named = pb.GenerateRequest(rid="a"), pb.GenerateRequest(rid="b", prefill_addr="10.0.0.1:50051")
    assert colocated.refuses_generate(plain) is None
    assert prefill.refuses_generate(named)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert decode.refuses_generate(plain) == (grpc.StatusCode.INVALID_ARGUMENT, "a decode worker needs prefill_addr")
    assert decode.refuses_generate(named) is None
    assert (colocated.refuses_pooling, prefill.refuses_pooling) == (None, None) and "decode" in decode.refuses_pooling
    # A decode worker's first output waits for its prompt to be filled elsewhere as well; a failure there migrates.
    assert decode.first_output_wait(120, 60) == 180 and colocated.first_output_wait(120, 60) == 120
    assert (colocated.failure_code, decode.failure_code) == (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)


def test_the_modules_every_role_runs_through_hold_no_role_checks():
    for name in ROLE_FREE:
        tree = ast.parse((WORKER / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Role":
                assert node.attr not in ("COLOCATED", "PREFILL", "DECODE"), f"{name}:{node.lineno} checks Role.{node.attr}"
            if isinstance(node, ast.Compare) and any(isinstance(n, ast.Attribute) and n.attr in ("role", "kv_pull", "peers")
                                                     for n in [node.left, *node.comparators]):
                raise AssertionError(f"{name}:{node.lineno} compares a role (or what only one role has)")

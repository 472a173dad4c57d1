"""Each worker role is said in its own modules: its front's wiring (`services/worker/front/colocated_wiring.py`,
`prefill_wiring.py`, `decode_wiring.py`: what it serves, how it takes a Generate call) and, beside it in the engine room, its
engine side (`engine/colocated_engine.py`, `prefill_engine.py`, `decode_engine.py`: which side of KV transfers it
holds, the calls only it serves). Every call across the engine channel is a declared type with one handler marked
with that type. The modules every role runs through keep no role checks, and nothing finds a handler by a name
string."""
from __future__ import annotations

import argparse
import ast
import inspect
from pathlib import Path

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.services.worker.channel import messages
from pdserve.services.worker.front.app import wiring_for
from pdserve.services.worker.engine.engine_admin_calls import AdminCalls
from pdserve.services.worker.engine.engine_calls import GenerationCalls
from pdserve.services.worker.channel.messages import (AddPeer, Fence, Freeze, KVAnswered, KVSettle, MoveOut, Prefill,
                                                     RemovePeer, TransferMetadata)
from pdserve.services.worker.engine.engine_process import engine_role
from pdserve.services.worker.engine.engine_worker import handlers_of
from pdserve.shared.config import Role

WORKER = Path(__file__).resolve().parents[3] / "services" / "worker"
# Where a role may be told apart: its own modules, and the CLI's flags per command.
ROLE_MODULES = {"colocated_wiring.py", "prefill_wiring.py", "decode_wiring.py", "wiring.py", "colocated_engine.py", "prefill_engine.py",
                "decode_engine.py", "encoder_app.py", "cli.py"}  # encoder_app: the embedding worker, colocated only
ROLES = (Role.COLOCATED, Role.PREFILL, Role.DECODE)
ONLY = {Role.COLOCATED: set(), Role.PREFILL: {Prefill, Fence, AddPeer, RemovePeer},
        # a decode worker is a sender too, of the generations it moves out live (kv_sender.py)
        Role.DECODE: {TransferMetadata, KVAnswered, KVSettle, Fence, AddPeer, RemovePeer, Freeze, MoveOut}}


def test_each_role_says_what_it_serves_and_which_transfer_side_it_holds():
    colocated, prefill, decode = (wiring_for(r) for r in ROLES)
    args = argparse.Namespace(transfer_backend="tcp", worker_name="w", host="127.0.0.1", port=50052,
                              transfer_port=None)
    sides = [engine_role(r) for r in ROLES]
    assert sides[0].transfer_spec(args) is None  # colocated: no KV transfer
    sender, receiver = sides[1].transfer_spec(args), sides[2].transfer_spec(args)
    assert (sender.backend, sender.name, sender.receiver_host) == ("tcp", "w", None)
    assert (receiver.receiver_host, receiver.receiver_port) == ("127.0.0.1", 52052)  # TCP's receiving side listens
    assert [s.serves_pooling_models for s in sides] == [True, False, False]
    assert [s.ends_at_prefill for s in sides] == [False, True, False]  # a prefill worker's work ends there
    plain, named = pb.GenerateRequest(rid="a"), pb.GenerateRequest(rid="b", prefill_addr="10.0.0.1:50051")
    assert colocated.refuses_generate(plain) is None
    assert prefill.refuses_generate(named)[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert decode.refuses_generate(plain) == (grpc.StatusCode.INVALID_ARGUMENT, "a decode worker needs prefill_addr")
    assert decode.refuses_generate(named) is None
    assert (colocated.refuses_pooling, prefill.refuses_pooling) == (None, None) and "decode" in decode.refuses_pooling
    # A decode worker's first output waits for its prompt to be filled elsewhere as well; a failure there migrates.
    assert decode.first_output_wait(120, 60) == 180 and colocated.first_output_wait(120, 60) == 120
    assert (colocated.failure_code, decode.failure_code) == (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE)


def test_every_call_has_one_handler_marked_with_its_type_and_each_role_serves_its_own():
    tables = {r: handlers_of(GenerationCalls(None), AdminCalls(None), engine_role(r)(None)) for r in ROLES}
    calls = set(messages.KNOWN["call"].values())
    common = set.intersection(*(set(t) for t in tables.values()))
    for role, table in tables.items():
        assert set(table) == common | ONLY[role], role
        for call, handler in table.items():  # the handler takes the very type it is found by
            assert list(inspect.signature(handler).parameters.values())[0].annotation == call.__name__
    assert set().union(*tables.values()) == calls  # no call declared that nothing serves


def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def test_no_handler_is_found_by_a_name_string():
    for path in sorted(WORKER.rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) > 1 and \
                    isinstance(node.args[1], (ast.JoinedStr, ast.BinOp)):  # getattr(self, f"call_{name}")
                raise AssertionError(f"{path.name}:{node.lineno}: a method found by a name made of strings")
            if isinstance(func, ast.Attribute) and func.attr in ("call", "cast", "_engine", "_call_or_abort") and \
                    any(isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args):
                raise AssertionError(f"{path.name}:{node.lineno}: an engine call named by a string")


def test_no_role_branch_outside_the_role_modules():
    for path in sorted(WORKER.rglob("*.py")):
        if path.name in ROLE_MODULES:
            continue
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "Role":
                assert node.attr not in ("COLOCATED", "PREFILL", "DECODE"), \
                    f"{path.name}:{node.lineno} names Role.{node.attr}"
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(n, ast.Attribute) and n.attr in ("role", "kv_pull", "peers", "transfer")
                       for n in sides):
                    raise AssertionError(f"{path.name}:{node.lineno} compares a role (or what only one role has)")
                if any(isinstance(n, ast.Constant) and n.value in ("sender", "receiver", "prefill", "decode",
                                                                    "colocated") for n in sides):
                    raise AssertionError(f"{path.name}:{node.lineno} compares with a role's name")

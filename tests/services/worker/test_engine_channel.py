"""The local channel between a worker's front and its engine process: what crosses it, what is refused, and what
the front never loads."""
from __future__ import annotations

import dataclasses
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.services.worker.channel import wire
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import Load, OutputRecord
from pdserve.shared.outputs import ReqOutput, TokenLogprobs

ROOT = Path(__file__).resolve().parents[3]
KINDS = frozenset({"step", "reply"})


def test_frames_that_are_too_large_malformed_or_of_no_known_kind_are_refused_and_logged(monkeypatch, caplog):
    caplog.set_level(logging.ERROR)
    assert wire.unpack(wire.pack(("reply", 1, True, [1, 2])), KINDS, "front") == ["reply", 1, True, [1, 2]]
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64)
    for frame in (wire.pack(("reply", 1, True, list(range(100)))), b"\xc1\xc1 not msgpack",
                  wire.pack(("hello", 1)), wire.pack({"reply": 1}), wire.pack([]), b""):
        assert wire.unpack(frame, KINDS, "front") is None
    assert len(caplog.records) == 6
    assert "-byte frame" in caplog.records[0].getMessage() and "limit 64" in caplog.records[0].getMessage()


def test_an_output_crosses_the_channel_unchanged():
    out = ReqOutput("r1", 2, [5, 6], [TokenLogprobs(-0.5, [5, 7], [-0.5, -1.25]), TokenLogprobs(-0.1)], "stop", 6,
                    prompt_tokens=9, cached_tokens=4, input_logprobs=[TokenLogprobs(-2.0, [3], [-2.0])], queue_s=0.25,
                    compute_s=0.5, first_token_time=12.5, arrival=11.0)
    message = wire.unpack(wire.pack(("step", [OutputRecord.of(out)], [])), KINDS, "front")
    assert OutputRecord.output(message[1][0]) == out
    assert OutputRecord.of(out)._fields == tuple(f.name for f in dataclasses.fields(ReqOutput))  # by name


WORKER = ROOT / "services" / "worker"


def test_a_workers_front_loads_neither_torch_nor_the_runtime():
    """Every module of the front room and the channel room, and the CLI that starts them."""
    modules = ["pdserve.services.worker.cli"] + [
        f"pdserve.services.worker.{room}.{path.stem}" for room in ("front", "channel")
        for path in sorted((WORKER / room).glob("*.py")) if path.stem != "__init__"]
    assert len(modules) > 20
    heavy = ("torch", "pdserve.shared.engine", "pdserve.shared.model_runner", "pdserve.services.worker.engine")
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n" \
           f"print(' '.join(m for m in {heavy!r} if m in sys.modules) or 'none')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "none", f"the front loaded {out.stdout.split()}"


@pytest.mark.slow
async def test_the_engine_process_refuses_what_it_cannot_read_and_keeps_serving(tiny_models, capfd):
    from pdserve.cli import build_parser

    argv = ["colocated", "--model-path", str(tiny_models["llama"]), "--dtype", "float32", "--threads", "1",
            "--max-total-tokens", "4096"]
    parser, _ = build_parser(argv)
    link = EngineLink("colocated", {**vars(parser.parse_args(argv)), "worker_name": "channel-test"})
    info = await link.start()
    try:
        assert info["generates"] and link._dir is None  # the socket files went once the engine connected
        for frame in (b"\xc1 not msgpack", wire.pack(("hello",)),
                      wire.pack(("batch", [("call", 1, "no_such_call", {}), ("bogus",), 5,
                                              ("call", 2, "Load", "not a dict")]))):
            await link._to_engine.send(frame)
        load = await link.call(Load(), 30)
        assert load["running"] == 0 and link.alive
    finally:
        await link.stop()
    err = capfd.readouterr().err
    assert "refused a malformed frame" in err and "refused a frame of unknown kind" in err
    assert "unknown call 'no_such_call'" in err and err.count("refused an item") == 4


def test_a_batch_too_large_for_one_frame_is_split_and_a_call_too_large_for_any_is_handed_back(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 200)
    items = [["call", i, "x", {"a": "y" * 60}] for i in range(5)] + [["call", 9, "big", {"a": "z" * 300}]]
    frames, too_large = wire.pack_batches(items)
    assert len(frames) > 1 and all(len(frame) <= 200 for frame in frames)
    unpacked = [wire.unpack(frame, frozenset({"batch"}), "engine") for frame in frames]
    assert [item for message in unpacked for item in message[1]] == items[:5]  # in order, none lost
    assert too_large == items[5:]


def test_the_gate_admits_one_process_of_this_user_only():
    import os

    import zmq

    context = zmq.Context()
    gate = wire.PeerGate(context, "test", pid=4242)
    try:
        uid = os.getuid()
        assert gate.admits(f"localhost:{uid}:0:4242")
        assert not gate.admits(f"localhost:{uid}:0:4243")  # another process of this user
        assert not gate.admits(f"localhost:{uid + 1}:0:4242")  # another user
        assert not gate.admits("127.0.0.1")  # no credentials: not a Unix socket's peer
    finally:
        context.term()

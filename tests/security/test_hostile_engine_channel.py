"""The local channel between a worker's front and its engine process, under hostile frames and foreign peers.

Real processes on a tiny model: this test is the front (the real `EngineLink`, which starts the real engine
process). While the channel's directory exists, another process of the same user connects to both sockets,
trying to read the front's frames and to pass for the engine: refused. Then every kind of malformed frame goes to
the engine, and a call too large for a frame to the front (refused there, with the reason), each followed by a
request the engine must still serve. A frame over the limit that reaches the engine all the same ends it (its
connection cannot come back). A front that is not the engine's parent is refused by the engine itself.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import msgpack
import pytest

from fixtures import make_tiny_model
from pdserve.services.worker.channel import wire
from pdserve.services.worker.channel.wire import RemoteError
from pdserve.services.worker.cli import add_arguments
from pdserve.services.worker.front.engine_link import EngineLink
from pdserve.services.worker.channel.messages import Generate, PoolStats
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
SAMPLING = params_to_proto(SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)).SerializeToString()
OVERSIZED = wire.MAX_FRAME_BYTES + (1 << 20)

# Connects to the front's two sockets as soon as they exist: takes what the front sends its engine, and sends
# what an engine would (a forged "ready", a forged reply). Prints each frame it took.
FOREIGN = """
import sys, time, zmq, msgpack
directory = sys.argv[1]
context = zmq.Context()
steal = context.socket(zmq.PULL)
steal.connect(f"ipc://{directory}/to-engine")
forge = context.socket(zmq.PUSH)
forge.connect(f"ipc://{directory}/to-front")
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    for message in (["ready", {"forged": True}], ["reply", 0, True, "forged"]):
        try:
            forge.send(msgpack.packb(message), zmq.NOBLOCK)
        except zmq.Again:
            pass
    if steal.poll(50):
        print("took", steal.recv()[:40], flush=True)
"""

MALFORMED = {
    "wrong type: an int": msgpack.packb(5),
    "wrong type: a map": msgpack.packb({"batch": []}),
    "wrong type: a string": msgpack.packb("batch"),
    "wrong arity: a bare batch": msgpack.packb(["batch"]),
    "wrong arity: a batch and more": msgpack.packb(["batch", [], 1]),
    "wrong arity: a call without its name": msgpack.packb(["batch", [["call", 1]]]),
    "wrong arity: a cast without kwargs": msgpack.packb(["batch", [["cast", "Load"]]]),
    "unknown call": msgpack.packb(["batch", [["call", 10**6, "no_such_call", {}]]]),
    "unknown item kind": msgpack.packb(["batch", [["zap", "Load", {}]]]),
    "kwargs not a map": msgpack.packb(["batch", [["call", 10**6, "Load", 5]]]),
    "kwargs the call does not take": msgpack.packb(["batch", [["call", 10**6, "Load", {"x": 1}]]]),
    "an item that is a map": msgpack.packb(["batch", [{"call": 1}]]),
    "an item that is an int": msgpack.packb(["batch", [5]]),
    "non-list batch: an int": msgpack.packb(["batch", 5]),
    "non-list batch: a map": msgpack.packb(["batch", {"call": 1}]),
    "non-list batch: a string": msgpack.packb(["batch", "calls"]),
    "a start frame while serving": msgpack.packb(["start", "colocated", {}]),
    "undecodable: a reserved byte": b"\xc1",
    "undecodable: truncated": msgpack.packb(["batch", [["call", 1, "Load", {}]]])[:-3],
    "undecodable: empty": b"",
}


@pytest.fixture(scope="module")
def flags(tmp_path_factory) -> dict:
    model = str(make_tiny_model("llama", tmp_path_factory.mktemp("engine-channel") / "llama"))
    parser = argparse.ArgumentParser()
    add_arguments(parser, "colocated")
    args = parser.parse_args(["--model-path", model, "--dtype", "float32", "--threads", "1",
                              "--max-total-tokens", "2048"])
    return {**vars(args), "model_path": model, "worker_name": "channel-test"}


async def served(link: EngineLink, rid: str) -> list[int]:
    """A generation through the channel, as the front runs one: its tokens."""
    outputs, done = [], asyncio.Event()

    def sink(batch) -> None:
        outputs.extend(batch)
        if any(o.finish_reason for o in batch):
            done.set()

    link.watch(rid, sink)
    try:
        await link.call(Generate(rid, PROMPT, SAMPLING, time.monotonic()), 30.0)
        await asyncio.wait_for(done.wait(), 30)
    finally:
        link.unwatch(rid)
    assert not any(o.error for o in outputs), outputs
    return [t for o in outputs for t in o.token_ids]


async def test_foreign_peers_oversized_and_malformed_frames_leave_the_engine_serving(flags, caplog, capfd):
    link = EngineLink("colocated", flags)
    starting = asyncio.create_task(link.start())
    while link._dir is None:  # the sockets are bound: the directory exists until the engine is ready
        await asyncio.sleep(0)
    foreign = subprocess.Popen([sys.executable, "-c", FOREIGN, link._dir, "20"], stdout=subprocess.PIPE, text=True)
    try:
        info = await asyncio.wait_for(starting, 300)
        assert "compat" in info and "forged" not in info
        first = await served(link, "first")
        assert len(first) == 4

        front_log = caplog.text
        assert f":{foreign.pid} (uid:gid:pid), not process {link.pid}" in front_log, front_log

        for n, (kind, frame) in enumerate(MALFORMED.items()):
            await link._to_engine.send(frame)
            assert await served(link, f"after-{n}") == first, kind

        # A call too large for a frame is refused by the front with the reason; the engine never sees it.
        with pytest.raises(RemoteError, match="frame limit") as refused:
            await link.call(Generate("huge", PROMPT, SAMPLING, time.monotonic(), lora="x" * OVERSIZED), 30.0)
        assert refused.value.kind == "invalid"
        assert await served(link, "after-huge") == first
        assert link.alive and (await link.call(PoolStats()))["integrity_ok"]

        # A frame over the limit all the same: ZMQ drops the connection before reading it, and with the directory
        # gone it cannot come back, so the engine ends (its front then stops, for the worker to start again).
        await link._to_engine.send(b"\x00" * OVERSIZED, copy=False)
        deadline = time.monotonic() + 15
        while link.alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not link.alive, "the engine went on without its channel"
    finally:
        foreign.kill()
        taken = foreign.communicate()[0]
        await link.stop()
    assert taken == "", taken  # nothing of the front's reached it
    engine_log = capfd.readouterr().err
    # Each malformed frame logged, the call with arguments its type does not declare among them.
    assert engine_log.count("on the engine channel") == len(MALFORMED), engine_log[-3000:]
    assert "unexpected keyword argument 'x'" in engine_log
    assert "the engine channel lost its connection to the front" in engine_log, engine_log[-3000:]


def test_the_engine_refuses_a_front_that_is_not_its_parent(tmp_path):
    """An impostor front (another process of this user bound where the engine connects): the engine takes no frame
    of it, says so, and never starts."""
    directory = tmp_path / "channel"
    directory.mkdir(mode=0o700)
    impostor = subprocess.Popen([sys.executable, "-c", f"""
import time, zmq, msgpack
context = zmq.Context()
out = context.socket(zmq.PUSH); out.bind("ipc://{directory}/to-engine")
back = context.socket(zmq.PULL); back.bind("ipc://{directory}/to-front")
out.setsockopt(zmq.LINGER, 0)
out.send(msgpack.packb(["start", "colocated", {{"log_level": "info"}}]))  # waits for a peer it may send to
print("sent", flush=True)
print("heard", back.poll(1000), flush=True)
"""], stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)  # bound
    engine = subprocess.Popen([sys.executable, "-m", "pdserve.services.worker.engine.engine_process"], text=True,
                              env={**os.environ, wire.CHANNEL_ENV: str(directory)}, stderr=subprocess.PIPE)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = engine.stderr.readline()
            lines.append(line)
            if "refused a connection to the engine channel" in line or not line:
                break
        assert f":{impostor.pid} (uid:gid:pid), not process {os.getpid()}" in "".join(lines), lines
    finally:
        engine.kill()
        engine.wait()
        impostor.kill()
    assert impostor.communicate(timeout=30)[0] == ""  # its start frame found no peer to go to

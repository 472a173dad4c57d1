"""Real service processes on loopback for integration tests: start, wait until healthy, stop."""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports for test processes come from below the kernel's ephemeral range: there no outgoing connection can take one
# as its local port between this check and the process binding it (which failed a run now and then), and none is
# handed out twice in a session. Test processes running side by side (pytest-xdist's gw0, gw1, ...) each take
# their own share, so that two never hand out the same port.
_WORKER, _WORKERS = (int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:]),
                     int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
PORTS = range(20000 + _WORKER, min(32000, _ephemeral_start()), _WORKERS)
_handed: set[int] = set()


def free_port() -> int:
    for _ in range(2000):
        port = random.choice(PORTS)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    raise RuntimeError(f"no free port left in {PORTS.start}-{PORTS.stop - 1}")


@dataclass
class Proc:
    name: str
    args: list[str]
    health_url: str | None = None
    popen: subprocess.Popen | None = None
    log_path: Path = field(default_factory=lambda: Path(tempfile.mkstemp(prefix="pdserve-", suffix=".log")[1]))
    env: dict = field(default_factory=dict)  # what the first start added to the environment; restarts add it too

    def start(self, env: dict | None = None) -> Proc:
        if env is not None:
            self.env = env
        full_env = {**os.environ, **self.env}
        full_env.pop("TRITON_INTERPRET", None)
        self.popen = subprocess.Popen([sys.executable, "-m", "pdserve", *self.args], stdout=open(self.log_path, "w"),
                                      stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        return self

    def wait_healthy(self, timeout: float = 120.0) -> Proc:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.health_url, timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not healthy after {timeout} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(10)

    def stop(self) -> None:
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (a worker's front has one: its engine process)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def start_worker(role: str, model: str | None = None, *extra: str, threads: int = 1,
                 env: dict | None = None) -> tuple[Proc, str]:
    """Start a runtime worker; returns (process, gRPC address). Call .wait_healthy() on it."""
    port, http_port = free_port(), free_port()
    args = [role, "--port", str(port), "--http-port", str(http_port), "--threads", str(threads),
            "--max-total-tokens", "8192", *extra]
    if model:
        args += ["--model-path", model]
    if role in ("prefill", "decode") and "--transfer-port" not in extra:
        args += ["--transfer-port", str(free_port())]
    proc = Proc(f"{role}:{port}", args, health_url=f"http://127.0.0.1:{http_port}/health").start(env)
    return proc, f"127.0.0.1:{port}"


# ------------------------------------------------------------------------------------------------ under load
def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def channel_dir(pid: int) -> str:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)["PDSERVE_ENGINE_CHANNEL"]


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as r:
            return r.status == 200
    except OSError:
        return False


STREAMS = 8


class Streams:
    """STREAMS long greedy generations on one worker (gRPC), each noting its tokens and how it ended."""

    def __init__(self, addr: str, prefill: str = "") -> None:
        """`prefill`: the prefill worker's address, for streams to a decode worker."""
        import grpc

        from pdserve.proto import worker_pb2_grpc as pb_grpc
        from pdserve.proto.codec import params_to_proto
        from pdserve.shared.sampling_params import SamplingParams

        self.tokens = [0] * STREAMS
        self.ended: list[str | None] = [None] * STREAMS
        self.channel = grpc.insecure_channel(addr)
        stub = pb_grpc.WorkerStub(self.channel)
        params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=480, ignore_eos=True))
        self.prefill = prefill
        self.threads = [threading.Thread(target=self._run, args=(stub, i, params), daemon=True)
                        for i in range(STREAMS)]
        for t in self.threads:
            t.start()

    def _run(self, stub, i: int, params) -> None:
        import grpc

        from pdserve.proto import worker_pb2 as pb

        try:
            for msg in stub.Generate(pb.GenerateRequest(rid=f"s{i}", input_ids=[1, 5, 9, 13], sampling=params,
                                                             prefill_addr=self.prefill),
                                     timeout=120):
                self.tokens[i] += sum(len(c.token_ids) for c in msg.choices)
            self.ended[i] = "finished"
        except grpc.RpcError as exc:
            self.ended[i] = exc.code().name

    def wait_flowing(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.tokens) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(self.tokens), f"streams did not start: {self.tokens} {self.ended}"

    def wait_ended(self, timeout: float) -> list[str | None]:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self.channel.close()
        return self.ended




def greedy_in_one_process(model_dir, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy tokens of the whole model in this process (fp32, every prompt batched): what the workers under
    test must match token for token."""
    from pdserve.shared.config import CacheConfig, Role, RuntimeConfig
    from pdserve.shared.engine import Engine
    from pdserve.shared.req import Req
    from pdserve.shared.sampling_params import SamplingParams

    engine = Engine(RuntimeConfig(model_path=str(model_dir), dtype="float32",
                                  cache=CacheConfig(page_size=16, max_total_tokens=4096)), Role.COLOCATED)
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(Req(rid=str(i), input_ids=ids, params=SamplingParams(temperature=0,
                                                                                max_new_tokens=new_tokens),
                               on_output=lambda out: tokens.setdefault(out.rid, []).extend(out.token_ids)))
    while engine.has_work():
        engine.step()
    return [tokens[str(i)] for i in range(len(prompts))]

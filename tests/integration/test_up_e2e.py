"""`pdserve up` end to end: the real services, the default model, the official openai client.

Each test starts the whole system the way a user does (`pdserve up`, on free ports, with its own state
dir), talks to it, and stops it with a signal; nothing may outlive `up`.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

from procs import children

pytestmark = pytest.mark.slow

READY_TIMEOUT_S = 600  # first use converts the default model; two cores are shared with other tests


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_ports(workers: int) -> list[str]:
    flags = []
    for flag in ("--port", "--jobs-port", "--redis-port"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            flags += [flag, str(s.getsockname()[1])]
    for _ in range(200):
        base = random.randrange(20000, 26900)
        if all(port_free(base + i + off) for i in range(workers) for off in (0, 1000, 2000)):
            return flags + ["--worker-port", str(base)]
    raise RuntimeError("no free block of worker ports")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Up:
    """A running `pdserve up`, its output collected line by line."""

    def __init__(self, tmp_path: Path, *extra: str) -> None:
        argv = [sys.executable, "-m", "pdserve", "up", "--state-dir", str(tmp_path / "state"),
                *free_ports(3), *extra]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.lines: list[str] = []
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self._reader = threading.Thread(target=lambda: self.lines.extend(x.rstrip("\n") for x in self.proc.stdout),
                                        daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_ready(self) -> tuple[str, str]:
        """(base URL, model name) from the banner."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            text = self.output
            base = re.search(r"OpenAI base URL: (\S+)", text)
            model = re.search(r'"model": "([^"]+)"', text)
            if base and model:
                return base.group(1), model.group(1)
            time.sleep(0.2)
        raise AssertionError(f"pdserve up did not become ready:\n{self.output[-6000:]}")

    def pids(self) -> list[int]:
        return [int(m.group(1)) for m in re.finditer(r"^\[up\] started \S+ \(pid (\d+)\)", self.output, re.M)]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        os.kill(self.proc.pid, sig)
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.pids():
            if alive(pid):
                os.killpg(pid, signal.SIGKILL)


@pytest.fixture
def start_up(tmp_path):
    runs: list[Up] = []

    def start(*extra: str) -> Up:
        runs.append(Up(tmp_path, *extra))
        return runs[-1]

    yield start
    for run in runs:
        run.close()


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in entries if b"=" in e)


def test_up_serves_chat_streaming_and_files_over_prefill_decode(start_up):
    up = start_up()
    base_url, model = up.wait_ready()
    assert {"redis", "prefill", "decode", "jobs", "gateway"} <= set(
        m.group(1) for m in re.finditer(r"^\[up\] started (\S+)", up.output, re.M))
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=120)
    # As in the README's example: "default" names the served model.
    reply = client.chat.completions.create(model="default", messages=QUESTION, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content
    stream = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16,
                                            stream=True)
    assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    # No --served-model-name: the model is listed by its path, and any name (the banner's too) is served
    assert [m.id for m in client.models.list()][0].endswith("/" + model)
    curl = re.search(r"^  (curl .*\\\n    -d '.*')$", up.output, re.M).group(1)  # the banner's example, as printed
    answer = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert "Paris" in json.loads(answer.stdout)["choices"][0]["message"]["content"]
    line = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "m", "messages": []}}\n'
    uploaded = client.files.create(file=("batch.jsonl", line), purpose="batch")
    assert client.files.retrieve(uploaded.id).bytes == len(line)

    pids = up.pids()
    assert up.stop(signal.SIGTERM) == 0
    assert [p for p in pids if alive(p)] == []


# Not the defaults: each must reach its service and be read back from the running system.
PASSED_FLAGS = ("--context-length", "1024", "--max-running-requests", "6", "--page-size", "32",
                "--chunked-prefill-size", "256", "--schedule-policy", "lpm", "--max-total-tokens", "12288",
                "--random-seed", "3", "--max-queued-requests", "50", "--log-level", "debug", "--log-format", "json",
                "--log-requests", "--log-stats-interval", "1")


def json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(errors="replace").splitlines() if line.startswith("{")]


def wait_for_line(path: Path, test, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [e for e in json_lines(path) if test(e)]
        if found:
            return found[0]
        time.sleep(0.2)
    raise AssertionError(f"no such line in {path}:\n{path.read_text()[-4000:]}")


def test_up_colocated_with_api_key(start_up, tmp_path):
    up = start_up("--colocated", "--api-key", "sk-up-test", *PASSED_FLAGS)
    base_url, model = up.wait_ready()
    assert "[up] started colocated" in up.output and "[up] started prefill" not in up.output
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", timeout=60).chat.completions.create(
            model=model, messages=QUESTION, max_tokens=4)
    client = openai.OpenAI(base_url=base_url, api_key="sk-up-test", timeout=120)
    reply = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
    assert "Paris" in reply.choices[0].message.content

    # The flags given to `up`, read back from the gateway and the worker.
    import requests

    root, auth = base_url.removesuffix("/v1"), {"Authorization": "Bearer sk-up-test"}
    info = requests.get(root + "/get_server_info", headers=auth, timeout=30).json()
    assert (info["max_queued_requests"], info["log_requests"], info["log_format"], info["log_level"]) == \
        (50, True, "json", "debug")
    worker, = info["workers"]
    assert (worker["context_length"], worker["max_running_requests"], worker["max_total_tokens"]) == (1024, 6, 12288)
    host, port = worker["address"].rsplit(":", 1)
    worker_metrics = requests.get(f"http://{host}:{int(port) + 1000}/metrics", timeout=30).text
    assert re.search(r'^sglang:cache_config_info\{[^}]*page_size="32"', worker_metrics, re.M)

    # The request id: the client's kept, returned, and on the gateway's JSON access and body lines.
    answer = requests.post(base_url + "/chat/completions", headers={**auth, "X-Request-Id": "e2e-trace-1"},
                           json={"model": model, "messages": QUESTION, "max_tokens": 4}, timeout=120)
    assert answer.status_code == 200 and answer.headers["X-Request-Id"] == "e2e-trace-1"
    logs = tmp_path / "state" / "logs"
    access = wait_for_line(logs / "gateway.log", lambda e: e["logger"] == "pdserve.access"
                           and e.get("request_id") == "e2e-trace-1")
    assert (access["method"], access["path"], access["status"]) == ("POST", "/v1/chat/completions", 200)
    body = wait_for_line(logs / "gateway.log", lambda e: e["logger"] == "pdserve.requests"
                         and e.get("request_id") == "e2e-trace-1")
    assert "What is the capital of France?" in body["message"]
    # The worker's periodic line counts the tokens it made.
    stats = wait_for_line(logs / "colocated.log", lambda e: e.get("gen_throughput", 0) > 0)
    assert "#running-req" in stats["message"] and 0 <= stats["token_usage"] <= 1
    # A call that carries a request id in its gRPC metadata and fails: the worker's line names the id.
    import grpc

    from pdserve.proto import worker_pb2 as pb
    from pdserve.proto import worker_pb2_grpc as pb_grpc

    # The worker takes calls only with the cluster token `up` made for this run (in its environment).
    [token] = {environ(pid).get("PDSERVE_CLUSTER_TOKEN") for pid in up.pids() if "colocated" in cmdline(pid)}
    assert token and len(token) >= 32
    with grpc.insecure_channel(worker["address"]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.WorkerStub(channel).Health(pb.Empty(), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError):
            list(pb_grpc.WorkerStub(channel).Generate(
                pb.GenerateRequest(rid="e2e-x", input_ids=[1] * 1100), timeout=60,
                metadata=[("x-request-id", "e2e-trace-2"), ("x-pdserve-cluster-token", token)]))
    failed = wait_for_line(logs / "colocated.log", lambda e: e.get("request_id") == "e2e-trace-2")
    assert failed["level"] == "WARNING" and "Generate failed: INVALID_ARGUMENT" in failed["message"]

    pids = up.pids()
    assert up.stop(signal.SIGINT) == 0
    assert [p for p in pids if alive(p)] == []
    for log in logs.iterdir():  # --log-requests at debug level, and the key in no log
        assert "sk-up-test" not in log.read_text(errors="replace"), log.name


def test_up_serves_again_after_a_workers_engine_process_dies(start_up):
    """SIGKILL the engine process of a worker: the worker's front exits, `up` starts the worker again, and the same
    system serves; nothing of the first worker stays behind."""
    up = start_up("--colocated")
    base_url, model = up.wait_ready()
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=60, max_retries=0)
    assert "Paris" in client.chat.completions.create(model=model, messages=QUESTION, temperature=0,
                                                     max_tokens=16).choices[0].message.content
    front = next(pid for pid in up.pids() if "colocated" in cmdline(pid))
    engine, = children(front)
    os.kill(engine, signal.SIGKILL)
    deadline, answer = time.monotonic() + 240, None
    while answer is None and time.monotonic() < deadline:
        time.sleep(1)
        try:
            answer = client.chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16)
        except openai.APIError:
            continue
    assert answer is not None and "Paris" in answer.choices[0].message.content, up.output[-3000:]
    assert not alive(front) and not alive(engine) and "[up] restarted colocated" in up.output
    fronts = [pid for pid in up.pids() + [int(m) for m in re.findall(r"^\[up\] restarted colocated \(pid (\d+)\)",
                                                                       up.output, re.M)] if alive(pid)]
    engines = [child for pid in fronts if "colocated" in cmdline(pid) for child in children(pid)]
    assert up.stop(signal.SIGTERM) == 0
    time.sleep(2)  # an engine process follows its front within a second or two
    assert [p for p in fronts + engines if alive(p)] == []


def test_up_stops_the_real_services_when_one_fails(start_up):
    failing = f"{sys.executable} -c \"import sys; print('jobs cannot start: test failure'); sys.exit(4)\""
    up = start_up("--substitute", f"jobs={failing}")
    code = up.proc.wait(READY_TIMEOUT_S)
    up._reader.join(5)
    assert code == 1
    assert "error: jobs exited with code 4 before the system was ready" in up.output
    assert "  | jobs cannot start: test failure" in up.output
    assert "[up] started prefill" in up.output and "OpenAI base URL" not in up.output
    assert [p for p in up.pids() if alive(p)] == []


def test_up_serves_a_moe_model_and_records_its_expert_distribution(start_up, tiny_models, tmp_path):
    dumps = tmp_path / "dumps"
    up = start_up("--model-path", str(tiny_models["qwen2-moe"]), "--expert-distribution-recorder-mode", "stat",
                  "--expert-distribution-recorder-dir", str(dumps))
    base_url, _ = up.wait_ready()
    root = base_url.removesuffix("/v1")
    import requests

    # Admin routes take the key `up` made for this run, which only this user can read; never the inference key.
    key_file = tmp_path / "state" / "admin-api-key"
    assert key_file.stat().st_mode & 0o777 == 0o600
    admin = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
    assert requests.post(root + "/start_expert_distribution_record", timeout=60).status_code == 401
    assert requests.post(root + "/start_expert_distribution_record", headers=admin, timeout=60).status_code == 200
    client = openai.OpenAI(base_url=base_url, api_key="EMPTY", timeout=120)
    reply = client.completions.create(model="default", prompt="one two three", temperature=0, max_tokens=4)
    assert reply.usage.completion_tokens == 4
    assert requests.post(root + "/stop_expert_distribution_record", headers=admin, timeout=60).status_code == 200
    answer = requests.post(root + "/dump_expert_distribution_record", headers=admin, timeout=60)
    assert answer.status_code == 200, answer.text
    merged = re.search(r"^file: (.+)$", answer.text, re.M).group(1)
    assert Path(merged).is_file() and Path(merged).parent == dumps
    info = requests.get(root + "/get_model_info", timeout=30).json()
    assert info["architectures"] == ["Qwen2MoeForCausalLM"] and info["model_type"] == "qwen2_moe"
    assert up.stop() == 0

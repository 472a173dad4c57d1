"""POST /update_weights_from_disk with real processes: a prefill and a decode worker behind one gateway, and a
colocated worker behind another, serving tiny Qwen3 checkpoints (fp32) whose greedy answers transformers gives.

What a user must see: SGLang's request and answers, requests in flight finishing on the old weights (or
aborted with the reason), every later request served by the new weights on both sides of the PD pair,
/get_model_info reporting the new path, and a wrong path or a checkpoint of another architecture refused
with the old weights still serving. A prefill and a decode worker on different weights refuse to pair. A worker
that restarts on its start-up checkpoint, and a gateway that restarts, go on with the updated weights.
"""
from __future__ import annotations

import json
import threading
import time

import grpc
import pytest
import requests
import torch

from fixtures import make_tiny_model
from harness import System, start_gateway, start_worker

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc

PROMPT = [5, 17, 99, 3, 250, 8, 8, 41, 300, 7, 66, 12, 13, 14]
SHORT, LONG = 12, 300  # new tokens of a quick request, and of one that is still running during an update
WRONG = "qwen/qwen2.5-0.5b-instruct-wrong"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("update-weights")
    # Qwen3 because its tiny checkpoints are drawn with weights large enough to decide the greedy tokens.
    return {"old": make_tiny_model("qwen3", root / "old", seed=0),
            "new": make_tiny_model("qwen3", root / "new", seed=1),
            "llama": make_tiny_model("llama", root / "llama")}


@pytest.fixture(scope="module")
def greedy(ckpts) -> dict:
    """{checkpoint: transformers' greedy LONG tokens after PROMPT}."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name in ("old", "new"):
        model = AutoModelForCausalLM.from_pretrained(ckpts[name], dtype=torch.float32).eval()
        with torch.no_grad():
            ids = model.generate(torch.tensor([PROMPT]), max_new_tokens=LONG, min_new_tokens=LONG, do_sample=False,
                                 pad_token_id=0)
        out[name] = ids[0, len(PROMPT):].tolist()
    assert out["old"][:SHORT] != out["new"][:SHORT]
    return out


@pytest.fixture(scope="module")
def system(ckpts):
    procs = System()
    try:
        common = ("--dtype", "float32", "--transfer-backend", "tcp")
        prefill, paddr = start_worker("prefill", str(ckpts["old"]), *common)
        decode, daddr = start_worker("decode", str(ckpts["old"]), *common, "--prefill", paddr)
        colocated, caddr = start_worker("colocated", str(ckpts["old"]), "--dtype", "float32")
        procs.workers.update({paddr: prefill, daddr: decode, caddr: colocated})
        pd = start_gateway(ckpts["old"], "--prefill", paddr, "--decode", daddr)
        co = start_gateway(ckpts["old"], "--worker", caddr)
        procs.gateways += [pd, co]
        for proc in (prefill, decode, colocated, pd.proc, co.proc):
            proc.wait_healthy(180)
        yield {"pd": pd, "colocated": co, "prefill": paddr, "decode": daddr, "colocated_worker": (colocated, caddr)}
    finally:
        procs.stop()


def generate(gw, max_new: int = SHORT) -> requests.Response:
    return requests.post(gw.url + "/generate", timeout=120, json={
        "input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}})


def output_ids(gw, max_new: int = SHORT) -> list[int]:
    r = generate(gw, max_new)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def update(gw, model_path, **fields) -> requests.Response:
    return requests.post(gw.url + "/update_weights_from_disk", json={"model_path": str(model_path), **fields},
                         headers=gw.admin_headers(), timeout=300)


class Streaming:
    """A LONG streamed /generate in a thread; `started` is set once its first tokens arrived."""

    def __init__(self, gw) -> None:
        self.gw, self.started, self.ids, self.events, self.status = gw, threading.Event(), [], [], None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        with requests.post(self.gw.url + "/generate", stream=True, timeout=300, json={
                "input_ids": PROMPT, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": LONG, "ignore_eos": True}}) as r:
            self.status = r.status_code
            for line in r.iter_lines():
                if line.startswith(b"data: {"):
                    event = json.loads(line[6:])
                    self.events.append(event)
                    self.ids = event.get("output_ids", self.ids)
                    self.started.set()
        self.started.set()

    def join(self) -> Streaming:
        self.thread.join(120)
        assert not self.thread.is_alive()
        return self


def running_streams(gw, count: int) -> list[Streaming]:
    """`count` streams that have begun and are still running. A stream takes a fraction of a second with these
    tiny models: on a busy machine it may end before the test goes on, and then new ones are started."""
    for _ in range(5):
        streams = [Streaming(gw) for _ in range(count)]
        assert all(s.started.wait(60) for s in streams)
        if all(len(s.ids) < LONG for s in streams):
            return streams
        for s in streams:
            s.join()
    raise AssertionError("every stream ended before the test could go on, five times")


def model_path(gw) -> str:
    return requests.get(gw.url + "/get_model_info", timeout=30).json()["model_path"]


def worker_info(addr: str) -> pb.InfoReply:
    with grpc.insecure_channel(addr) as channel:
        return pb_grpc.WorkerStub(channel).Info(pb.Empty(), timeout=30)


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_update_while_requests_run_then_refusals_keep_the_new_weights(system, ckpts, greedy, mode):
    gw = system[mode]
    assert output_ids(gw) == greedy["old"][:SHORT]
    running = running_streams(gw, 2)  # still running when the update comes
    meanwhile = []  # requests sent while the update is under way: all on one version, whichever it is
    senders = [threading.Thread(target=lambda: meanwhile.append(output_ids(gw))) for _ in range(4)]
    for sender in senders:
        sender.start()
    r = update(gw, ckpts["new"], weight_version="v1")
    assert r.status_code == 200 and r.json() == {
        "success": True, "message": "Succeeded to update model weights. Weight version updated to v1.",
        "num_paused_requests": 0}
    for stream in running:  # began before the update: finished on the old weights, to the last token
        assert stream.join().status == 200 and stream.ids == greedy["old"]
    for sender in senders:
        sender.join(60)
    assert len(meanwhile) == 4 and all(ids in (greedy["old"][:SHORT], greedy["new"][:SHORT]) for ids in meanwhile)
    assert output_ids(gw) == greedy["new"][:SHORT]
    info = requests.get(gw.url + "/get_model_info", timeout=30).json()
    assert info["model_path"] == str(ckpts["new"]) and info["weight_version"] == "v1"

    r = update(gw, ckpts["old"], load_format="pt")
    assert r.status_code == 400 and r.json()["message"].startswith("Failed to get model loader: load_format 'pt'")
    r = update(gw, WRONG)
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"] == f"Failed to get weights iterator: {WRONG} (repository not found)."
    r = update(gw, ckpts["llama"])
    assert r.status_code == 400 and r.json()["success"] is False
    assert r.json()["message"] == ("Failed to update weights: the checkpoint's architecture is 'LlamaForCausalLM', the "
                                   "running model's is 'Qwen3ForCausalLM': only a checkpoint of the same architecture "
                                   "and size can replace the running weights.\nRolling back to original weights.")
    assert output_ids(gw) == greedy["new"][:SHORT] and model_path(gw) == str(ckpts["new"])

    r = update(gw, ckpts["old"])  # back, for the next test
    assert r.json()["success"] is True and output_ids(gw) == greedy["old"][:SHORT]


def test_abort_all_requests_ends_running_requests_with_the_reason(system, ckpts, greedy):
    gw = system["pd"]
    [stream] = running_streams(gw, 1)
    r = update(gw, ckpts["new"], abort_all_requests=True)
    assert r.json()["success"] is True
    stream.join()
    assert len(stream.ids) < LONG and stream.ids == greedy["old"][:len(stream.ids)]
    assert "the model weights are being updated" in json.dumps(stream.events[-1])
    assert output_ids(gw) == greedy["new"][:SHORT]
    prefill, decode = worker_info(system["prefill"]), worker_info(system["decode"])
    assert prefill.weights == decode.weights and prefill.weights.path == str(ckpts["new"])
    label = f"{prefill.weights.number} ({ckpts['new']})"
    assert prefill.compat.weights_version == decode.compat.weights_version == label


def test_a_pair_on_different_weights_refuses_kv_until_the_gateway_updates_both(system, ckpts, greedy):
    gw = system["pd"]
    with grpc.insecure_channel(system["prefill"]) as channel:  # behind the gateway's back: prefill alone
        reply = pb_grpc.WorkerStub(channel).UpdateWeights(pb.UpdateWeightsRequest(
            step=pb.WEIGHTS_COMMIT, model_path=str(ckpts["old"]), version=99), timeout=120)
    assert reply.ok and reply.weights.number == 99
    r = generate(gw)
    assert r.status_code == 503 and "this prefill worker version 99" in r.json()["message"]
    r = update(gw, ckpts["old"])
    assert r.json()["success"] is True
    assert worker_info(system["decode"]).weights.number == 100
    assert output_ids(gw) == greedy["old"][:SHORT]


def answers_after_restart(gw, timeout: float = 120.0) -> list[list[int]]:
    """Greedy answers from the first moment the gateway serves again: 503s until then, nothing else."""
    deadline, answers = time.monotonic() + timeout, []
    while time.monotonic() < deadline and len(answers) < 3:
        r = generate(gw)
        assert r.status_code in (200, 503), r.text
        if r.status_code == 200:
            answers.append(r.json()["output_ids"])
        else:
            time.sleep(0.2)
    return answers


def test_restarted_processes_go_on_with_the_updated_weights(system, ckpts, greedy):
    gw, (worker, addr) = system["colocated"], system["colocated_worker"]
    assert update(gw, ckpts["new"], weight_version="v7").json()["success"] is True
    updated = worker_info(addr).weights
    assert updated.path == str(ckpts["new"]) and updated.number > 0 and updated.tag == "v7"
    worker.kill()
    worker.start()  # on its start-up checkpoint: the old weights
    worker.wait_healthy(180)
    answers = answers_after_restart(gw)  # never an answer of the old weights, not even the first
    assert answers and all(ids == greedy["new"][:SHORT] for ids in answers), answers
    assert worker_info(addr).weights == updated

    gw.proc.kill()  # a new gateway process learns the deployment's weights from its worker
    gw.proc.start()
    gw.proc.wait_healthy(120)
    assert model_path(gw) == str(ckpts["new"]) and output_ids(gw) == greedy["new"][:SHORT]
    assert requests.get(gw.url + "/get_model_info", timeout=30).json()["weight_version"] == "v7"
    assert update(gw, ckpts["old"]).json()["success"] is True
    assert worker_info(addr).weights.number == updated.number + 1 and output_ids(gw) == greedy["old"][:SHORT]

"""A worker's request metrics per role: queue time counts every prompt computed here, a decode worker's short
next turns among them (it prefills those itself), and a prefill worker's requests count as done once prefilled."""
from __future__ import annotations

from pdserve.services.worker.engine.decode_engine import DecodeEngine
from pdserve.services.worker.engine.worker_metrics import WorkerMetrics
from pdserve.services.worker.engine.prefill_engine import PrefillEngine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams


def _metrics(side) -> WorkerMetrics:
    return WorkerMetrics("m", page_size=4, num_pages=8, counts_at_prefill=side.ends_at_prefill)


def _value(metrics: WorkerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(name, {"model_name": "m"}) or 0.0


def _req(rid: str, waited: float, output_ids: list[int]) -> Req:
    req = Req(rid=rid, input_ids=[1, 2, 3], params=SamplingParams(), arrival=10.0, output_ids=output_ids)
    req.first_scheduled = 10.0 + waited
    return req


def test_a_decode_worker_counts_the_queue_time_of_the_prompts_it_computes_itself():
    metrics = _metrics(DecodeEngine)
    metrics.scheduled(_req("next-turn", 0.25, []))  # a conversation's next turn, prefilled here
    assert _value(metrics, "sglang:queue_time_seconds_count") == 1
    assert _value(metrics, "sglang:queue_time_seconds_sum") == 0.25
    # A request whose KV a prefill worker wrote, recomputed here after a retraction: no queue of its prompt here.
    metrics.scheduled(_req("pulled", 5.0, [7]))
    assert _value(metrics, "sglang:queue_time_seconds_count") == 1


def test_a_prefill_worker_counts_a_request_done_once_prefilled_a_decode_worker_once_finished():
    prefill, decode = _metrics(PrefillEngine), _metrics(DecodeEngine)
    for metrics in (prefill, decode):
        metrics.prefilled(_req("r", 0.0, []))
    assert (_value(prefill, "sglang:num_requests_total"), _value(decode, "sglang:num_requests_total")) == (1, 0)

"""Streams straight to one worker's gRPC port, no gateway in between: what the worker alone delivers.

    python benchmarks/bench_worker_streams.py --addr 127.0.0.1:50051 [--streams 1,64,256] [--tokens 256]
                                              [--json OUT.json]

For each level, that many greedy generations of `--tokens` tokens (ignore_eos, 64-token prompts) start at once on
the worker's Generate stream, each from its own thread. Reports the inter-token gap p50 (each stream's mean over the
middle half of it (past the ramp of everyone's prefill, before the tail where streams finish) and the output tokens per
second of the whole level. Beside a gateway's figures for the same worker this splits the cost between them.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import grpc

from pdserve.proto import worker_pb2 as pb
from pdserve.proto import worker_pb2_grpc as pb_grpc
from pdserve.proto.codec import params_to_proto
from pdserve.shared.sampling_params import SamplingParams

PROMPT = list(range(100, 164))


def stream(stub, rid: str, tokens: int) -> list[float]:
    """Arrival time of each token of one greedy stream."""
    params = params_to_proto(SamplingParams(temperature=0, max_new_tokens=tokens, ignore_eos=True))
    times: list[float] = []
    for msg in stub.Generate(pb.GenerateRequest(rid=rid, input_ids=PROMPT, sampling=params), timeout=600):
        now = time.perf_counter()
        times += [now] * sum(len(c.token_ids) for c in msg.choices)
    return times


def level(addr: str, streams: int, tokens: int, tag: str) -> dict:
    results: list[list[float]] = [[] for _ in range(streams)]
    with grpc.insecure_channel(addr, options=[("grpc.max_receive_message_length", 64 << 20)]) as channel:
        stub = pb_grpc.WorkerStub(channel)

        def run(i: int) -> None:
            results[i] = stream(stub, f"{tag}-{i}", tokens)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        seconds = time.perf_counter() - t0
    gaps = []  # each stream's mean gap over its middle half (tokens of one message share an arrival time)
    for times in results:
        middle = times[len(times) // 4: 3 * len(times) // 4]
        if len(middle) > 1 and middle[-1] > middle[0]:
            gaps.append((middle[-1] - middle[0]) / (len(middle) - 1))
    produced = sum(len(t) for t in results)
    return {"streams": streams, "tokens": produced, "seconds": seconds, "tok_s": produced / seconds,
            "itl_ms_p50": statistics.median(gaps) * 1000 if gaps else None,
            "steady_tok_s": streams / statistics.median(gaps) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--addr", required=True, help="the worker's gRPC address")
    ap.add_argument("--streams", default="1,64,256", help="levels, comma-separated")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    level(args.addr, 4, 16, "warm")
    out = []
    print(f"{'streams':>7} {'tok/s':>10} {'ITL p50 ms':>11} {'steady tok/s':>13}  (straight to {args.addr})")
    for n in (int(x) for x in args.streams.split(",")):
        r = level(args.addr, n, args.tokens, f"s{n}")
        out.append(r)
        print(f"{n:>7} {r['tok_s']:>10,.0f} {r['itl_ms_p50']:>11.2f} {r['steady_tok_s']:>13,.0f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"addr": args.addr, "results": out}, indent=2))


if __name__ == "__main__":
    main()

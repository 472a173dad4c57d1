"""Soak test of OpenAI Batches against a running system: 5,000 chat requests (max_tokens 8) in one batch.

    pdserve up &                                   # or any gateway with the jobs service behind it
    .venv/bin/python benchmarks/soak_batches.py [--base-url http://127.0.0.1:30000/v1] [--requests 5000]

Uploads the input file, creates the batch, polls it (printing progress and the running rate), then reads
the output and error files and checks that every custom_id appears exactly once. Reports items per second
over the whole batch (creation to completion) and over the running phase, plus the time spent validating
and finalizing. Exits non-zero if the batch does not complete or any request is missing or duplicated.
Not part of the test suite: it needs a real model behind the gateway and takes minutes on a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import openai

PROMPTS = ["What is the capital of France?", "Name a prime number.", "Say hello.", "What colour is the sky?",
           "Count to three.", "Give me a synonym for fast.", "What is 2 + 2?", "Name an ocean."]


def build_input(n: int, model: str, max_tokens: int) -> bytes:
    lines = []
    for i in range(n):
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"{PROMPTS[i % len(PROMPTS)]} (#{i})"}]}
        lines.append(json.dumps({"custom_id": f"soak-{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": body}))
    return ("\n".join(lines) + "\n").encode()


def read_lines(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if not file_id:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000/v1", help="the gateway's OpenAI base URL")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY", "EMPTY"))
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=3600.0, help="give up after this many seconds")
    parser.add_argument("--poll", type=float, default=2.0, help="seconds between status checks")
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=3, timeout=120)
    model = args.model or client.models.list().data[0].id
    content = build_input(args.requests, model, args.max_tokens)
    t0 = time.monotonic()
    f = client.files.create(file=("soak.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                  metadata={"benchmark": "soak_batches"})
    t_created = time.monotonic()
    print(f"batch {batch.id}: {args.requests} requests, {len(content) / 1e6:.1f} MB input, model {model}", flush=True)
    last_print = 0.0
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        if time.monotonic() - t0 > args.timeout:
            print(f"timed out after {args.timeout:.0f} s in status {batch.status}; cancelling", flush=True)
            client.batches.cancel(batch.id)
            return 1
        time.sleep(args.poll)
        batch = client.batches.retrieve(batch.id)
        now = time.monotonic()
        counts = batch.request_counts
        if now - last_print >= 10 or batch.status != "in_progress":
            done = counts.completed + counts.failed
            rate = done / (now - t_created)
            print(f"{now - t0:7.1f} s  {batch.status:<11} {done:>6}/{counts.total} done ({counts.failed} failed)  "
                  f"{rate:6.1f} items/s", flush=True)
            last_print = now
    t_end = time.monotonic()

    if batch.status != "completed":
        print(f"batch ended as {batch.status}: {batch.errors}", flush=True)
        return 1
    out, err = read_lines(client, batch.output_file_id), read_lines(client, batch.error_file_id)
    ids = [line["custom_id"] for line in out + err]
    missing = args.requests - len(set(ids))
    duplicated = len(ids) - len(set(ids))
    total_s = t_end - t0
    # The server's timestamps (whole seconds) bound the running phase: validation and finalizing excluded.
    running_s = max(1, (batch.finalizing_at or batch.completed_at) - (batch.in_progress_at or batch.created_at))
    print(f"\nrequests {args.requests}: {len(out)} succeeded, {len(err)} failed, {missing} missing, "
          f"{duplicated} duplicated")
    print(f"wall time {total_s:.1f} s (upload+create {t_created - t0:.2f} s, in progress ~{running_s} s, "
          f"finalizing ~{batch.completed_at - (batch.finalizing_at or batch.completed_at)} s); "
          f"poll interval {args.poll:g} s")
    print(f"throughput: {args.requests / total_s:.1f} items/s end to end, ~{args.requests / running_s:.0f} items/s "
          "while in progress")
    if err:
        print(f"first error: {json.dumps(err[0])[:400]}")
    return 0 if missing == 0 and duplicated == 0 else 1


if __name__ == "__main__":
    sys.exit(main())

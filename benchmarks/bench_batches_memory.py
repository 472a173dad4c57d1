"""Memory of the jobs service with large files and batches: a ~100 MiB upload and download, and a 50,000-request
batch run and finalized, with the RSS of the jobs process and of its batch workers sampled throughout.

    .venv/bin/python benchmarks/bench_batches_memory.py [--requests 50000] [--line-bytes 2000]

Runs a real redis-server (append-only, fsync on every write), `pdserve jobs` with its batch workers, and the
test upstream that stands in for the gateway (tests/services/jobs/upstream.py: it answers at once, echoing
each prompt, so the output file is as large as the input). What it measures is the jobs service alone. The
baseline in the same run is the file itself: a process that held the upload, the download or the output file
whole would grow by at least its size. Targets: upload and download each grow RSS by < 50 MB; the batch
finalizes with every jobs process under 300 MB. Exits 1 when a target is missed or an item is lost or repeated.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests" / "services" / "jobs"))
sys.path.insert(0, str(HERE / "tests"))
from jobs_harness import API_KEY, RedisServer, Upstream, start_jobs  # noqa: E402

MB = 1e6


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


class Sampler:
    """Peak RSS of the jobs process and, separately, of each of its child processes (the batch workers)."""

    def __init__(self, pid: int, every_s: float = 0.05) -> None:
        self.pid, self.every_s = pid, every_s
        self.peak_main, self.peak_child = 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_main = max(self.peak_main, rss_bytes(self.pid))
            for child in children(self.pid):
                self.peak_child = max(self.peak_child, rss_bytes(child))
            time.sleep(self.every_s)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def batch_input(n: int, line_bytes: int) -> bytes:
    lines = []
    for i in range(n):
        pad = ("lorem ipsum dolor sit amet " * (line_bytes // 27 + 1))[:max(0, line_bytes - 200)]
        lines.append(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "m", "max_tokens": 8,
                                          "messages": [{"role": "user", "content": f"{i} {pad}"}]}}))
    return ("\n".join(lines) + "\n").encode()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--line-bytes", type=int, default=2000, help="bytes per input line (2000: ~100 MiB)")
    parser.add_argument("--batch-workers", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=64)
    args = parser.parse_args()

    content = batch_input(args.requests, args.line_bytes)
    size = len(content)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-bench-batches-"))
    redis = RedisServer(workdir / "redis").start()
    subprocess.run(["redis-cli", "-p", str(redis.port), "config", "set", "appendfsync", "always"], check=True,
                   capture_output=True)
    upstream = Upstream(delay=0.0).start()
    jobs, base = start_jobs(redis.url(), upstream.url, "--batch-workers", str(args.batch_workers), "--concurrency",
                            str(args.concurrency), "--max-file-size", str(size + (1 << 20)))
    client = openai.OpenAI(base_url=base + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
    report: dict = {"file_mb": round(size / MB, 1), "requests": args.requests}
    try:
        pid = jobs.popen.pid
        time.sleep(1.0)
        idle = rss_bytes(pid)
        with Sampler(pid) as up:
            t0 = time.monotonic()
            created = client.files.create(file=("big.jsonl", content), purpose="batch")
            report["upload_s"] = round(time.monotonic() - t0, 1)
        report["upload_rss_growth_mb"] = round((up.peak_main - idle) / MB, 1)
        with Sampler(pid) as down:
            t0 = time.monotonic()
            got = 0
            with client.files.with_streaming_response.content(created.id) as reply:
                for chunk in reply.iter_bytes(1 << 20):
                    got += len(chunk)
            report["download_s"] = round(time.monotonic() - t0, 1)
        assert got == size, (got, size)
        report["download_rss_growth_mb"] = round((down.peak_main - idle) / MB, 1)

        with Sampler(pid) as run:
            t0 = time.monotonic()
            batch = client.batches.create(input_file_id=created.id, endpoint="/v1/chat/completions",
                                          completion_window="24h")
            while batch.status not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(1.0)
                batch = client.batches.retrieve(batch.id)
            report["batch_s"] = round(time.monotonic() - t0, 1)
        report["batch_status"] = batch.status
        report["batch_peak_rss_mb"] = {"jobs": round(run.peak_main / MB, 1),
                                       "batch_worker": round(run.peak_child / MB, 1)}
        out_ids: list[str] = []
        out_bytes = 0
        with client.files.with_streaming_response.content(batch.output_file_id) as reply:
            for line in reply.iter_lines():
                if line:
                    out_ids.append(json.loads(line)["custom_id"])
                    out_bytes += len(line) + 1
        report["output_mb"] = round(out_bytes / MB, 1)
        report["output_in_order_once_each"] = out_ids == [f"r{i}" for i in range(args.requests)]
    finally:
        jobs.stop()
        upstream.stop()
        redis.stop()

    report["upload_growth_over_file"] = round(report["upload_rss_growth_mb"] / report["file_mb"], 3)
    report["download_growth_over_file"] = round(report["download_rss_growth_mb"] / report["file_mb"], 3)
    print(json.dumps(report, indent=1))
    ok = (report["upload_rss_growth_mb"] < 50 and report["download_rss_growth_mb"] < 50
          and max(report["batch_peak_rss_mb"].values()) < 300 and report["output_in_order_once_each"]
          and report["batch_status"] == "completed")
    print("targets met" if ok else "TARGET MISSED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

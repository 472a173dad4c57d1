"""`pdserve jobs` (Files/Batches HTTP service, plus its batch workers) and `pdserve batch-worker`.

Both run until SIGTERM/SIGINT. All state is in Redis (`--redis-url`), so either may be restarted at any
time; a batch worker that dies mid-batch has its items finished by another (or by its replacement).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from urllib.parse import urlsplit

from pdserve.services.signals import install_signal_handlers
from pdserve.shared.logs import add_log_arguments, setup_logging
from pdserve.services.tracing import add_trace_flags, setup_tracing, shutdown_tracing, trace_flags

DEFAULT_MAX_FILE_SIZE = 100 << 20
# Sized for the chart's Redis (1 GiB of memory and of disk): files, plus a running batch's results beside them,
# plus the append-only file's rewrite, stay within it.
DEFAULT_FILES_QUOTA = 256 << 20
DEFAULT_MAX_UNFINISHED = 16
DEFAULT_MAX_FILES = 10_000
SWEEP_EVERY_S = 1.0
log = logging.getLogger("pdserve.jobs")


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    parser.add_argument("--redis-url", default=os.environ.get("PDSERVE_REDIS_URL") or "redis://127.0.0.1:6379/0",
                        help="Redis holding all jobs state (default: $PDSERVE_REDIS_URL, else "
                             "redis://127.0.0.1:6379/0); give a URL with a password in the variable: a flag shows "
                             "in `ps`")
    parser.add_argument("--gateway-url", default="http://127.0.0.1:30000",
                        help="gateway that batch items are sent to ({gateway-url}{endpoint})")
    parser.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY"),
                        help="required as 'Authorization: Bearer KEY' on every route but /health, and sent to the "
                             "gateway (default: $PDSERVE_API_KEY)")
    parser.add_argument("--concurrency", type=int, default=32, help="batch items in flight per batch worker")
    parser.add_argument("--lease-seconds", type=float, default=30.0,
                        help="a dead batch worker's items are taken over this long after its last renewal")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds per batch item request")
    parser.add_argument("--retries", type=int, default=3,
                        help="retries of a batch item on connection errors and 5xx replies, with backoff")
    add_log_arguments(parser)
    add_trace_flags(parser)
    if command == "jobs":
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30010)
        parser.add_argument("--batch-workers", type=int, default=1,
                            help="batch worker processes to run as children (0: run them separately)")
        parser.add_argument("--max-file-size", type=int, default=DEFAULT_MAX_FILE_SIZE,
                            help="largest file upload in bytes (larger ones get 413)")
        parser.add_argument("--files-quota-bytes", type=int, default=DEFAULT_FILES_QUOTA,
                            help="bytes all files together may take in Redis, batch output files included "
                                 f"(default {DEFAULT_FILES_QUOTA >> 20} MiB; an upload that would pass it gets "
                                 "507; 0: no quota)")
        parser.add_argument("--max-files", type=int, default=DEFAULT_MAX_FILES,
                            help=f"files stored at once (default {DEFAULT_MAX_FILES}): one more upload gets 507, so "
                                 "empty or tiny files cannot fill Redis under the byte quota; a batch's output "
                                 "and error files are never refused (0: no limit)")
        parser.add_argument("--max-unfinished-batches", type=int, default=DEFAULT_MAX_UNFINISHED,
                            help="batches that may be validating, in progress or finalizing at once: each queues "
                                 "its input file's requests in Redis (up to --max-file-size each), so this bounds "
                                 f"what they hold (default {DEFAULT_MAX_UNFINISHED}; more are refused with 429; "
                                 "0: no limit)")
        # Shortens every batch's completion window (tests of expiry); not a user setting.
        parser.add_argument("--completion-window-seconds", type=int, default=None, help=argparse.SUPPRESS)
        # Shortens the wait for an upload's next bytes (tests of stalled uploads); not a user setting.
        parser.add_argument("--body-idle-seconds", type=float, default=None, help=argparse.SUPPRESS)
        # Lowers the least expires_after[seconds] below OpenAI's 3600 (tests of file expiry); not a user setting.
        parser.add_argument("--min-file-expiry-seconds", type=int, default=None, help=argparse.SUPPRESS)
    else:
        parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def main(args: argparse.Namespace, command: str) -> int:
    setup_logging(args.log_level, args.log_format == "json")
    for name, value, low in (("--concurrency", args.concurrency, 1), ("--lease-seconds", args.lease_seconds, 0.5),
                             ("--request-timeout", args.request_timeout, 0.1)):
        if value < low:
            print(f"error: {name} must be at least {low}", file=sys.stderr, flush=True)
            return 2
    if command == "jobs":
        if args.batch_workers < 0 or args.max_file_size < 1 or args.files_quota_bytes < 0:
            print("error: --batch-workers must be >= 0, --max-file-size >= 1 and --files-quota-bytes >= 0",
                  file=sys.stderr, flush=True)
            return 2
    setup_tracing(args, f"pdserve-{command}")
    try:
        return asyncio.run(serve_jobs(args) if command == "jobs" else serve_worker(args))
    finally:
        shutdown_tracing()


def worker_flags(args: argparse.Namespace) -> list[str]:
    """The batch workers' flags; the secrets (API key, Redis URL) go in their environment (`worker_env`)."""
    return ["--gateway-url", args.gateway_url, "--concurrency", str(args.concurrency),
            "--lease-seconds", str(args.lease_seconds), "--request-timeout", str(args.request_timeout),
            "--retries", str(args.retries),
            "--log-level", args.log_level, "--log-format", args.log_format, *trace_flags(args)]


def worker_env(args: argparse.Namespace) -> dict[str, str]:
    return {"PDSERVE_REDIS_URL": args.redis_url, **({"PDSERVE_API_KEY": args.api_key} if args.api_key else {})}


def without_password(url: str) -> str:
    """`url` as it may be logged: a password in it is replaced by ***."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)).geturl()


async def serve_jobs(args: argparse.Namespace) -> int:
    from aiohttp import web

    from pdserve.services.jobs.app import Settings, build_app
    from pdserve.services.jobs.children import WorkerChildren
    from pdserve.services.jobs.store import Store

    from pdserve.services.jobs import files
    from pdserve.services.jobs.files import MIN_EXPIRY_S

    store = Store(args.redis_url)
    app = build_app(store, Settings(args.api_key, args.max_file_size, args.completion_window_seconds,
                                    args.files_quota_bytes, args.min_file_expiry_seconds or MIN_EXPIRY_S,
                                    args.max_unfinished_batches, args.body_idle_seconds or files.BODY_IDLE_S,
                                    args.max_files))
    if 0 < args.files_quota_bytes < args.max_file_size:
        log.warning("--files-quota-bytes %d is below --max-file-size %d: the largest files cannot be stored",
                    args.files_quota_bytes, args.max_file_size)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, args.host, args.port).start()
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr, flush=True)
        await runner.cleanup()
        return 1
    log.info("jobs service on http://%s:%d (redis %s, gateway %s)", args.host, args.port,
             without_password(args.redis_url), args.gateway_url)
    stop = asyncio.Event()
    install_signal_handlers(stop)
    children = WorkerChildren(args.batch_workers, worker_flags(args), worker_env(args)).start()
    sweeper = asyncio.create_task(sweep_files(store, stop))
    try:
        await children.supervise(stop)
    finally:
        sweeper.cancel()
        children.stop()
        await runner.cleanup()
        await store.close()
    return 0


async def sweep_files(store, stop: asyncio.Event) -> None:
    """Count the storage of files kept from before the quota (once), then remove expired files and release
    abandoned uploads every SWEEP_EVERY_S, riding out Redis restarts. Every jobs process may run it: each
    removal is one script."""
    from redis.exceptions import RedisError

    counted = False
    while not stop.is_set():
        try:
            if not counted:
                log.info("files use %d bytes of storage", await store.count_usage())
                counted = True
            removed, released = await store.sweep_files()
            if removed or released:
                log.info("removed %d expired files, released %d abandoned uploads", removed, released)
        except RedisError as exc:
            log.debug("file sweep: %s", exc)
        except Exception:
            log.exception("file sweep failed")
        await asyncio.sleep(SWEEP_EVERY_S)


async def watch_parent(parent_pid: int, stop: asyncio.Event) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            log.warning("parent process %d is gone; stopping", parent_pid)
            stop.set()
            return
        await asyncio.sleep(1.0)


async def serve_worker(args: argparse.Namespace) -> int:
    from pdserve.services.jobs.batch_runner import BatchRunner, RunnerSettings
    from pdserve.services.jobs.executor import Executor, ExecutorSettings
    from pdserve.services.jobs.store import Store

    store = Store(args.redis_url, retries=1)  # the worker's loops do their own retrying
    executor = Executor(ExecutorSettings(args.gateway_url, args.api_key, args.concurrency, args.request_timeout,
                                         retries=max(0, args.retries)))
    runner = BatchRunner(store, executor, RunnerSettings(concurrency=args.concurrency, lease_s=args.lease_seconds))
    install_signal_handlers(runner.stop)
    watcher = asyncio.create_task(watch_parent(args.parent_pid, runner.stop)) if args.parent_pid else None
    try:
        await runner.run()
    finally:
        if watcher is not None:
            watcher.cancel()
        await store.close()
    return 0

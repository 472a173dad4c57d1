"""`pdserve debug`: talk to workers directly, without a gateway.

    pdserve debug ping HOST:PORT            health and role of a worker
    pdserve debug info HOST:PORT            model, KV layout and limits of a worker
    pdserve debug stats HOST:PORT           KV pool and radix cache statistics, integrity check
    pdserve debug generate --decode D [--prefill P] "prompt"   one request straight to a worker pair
    pdserve debug bench-transfer [--backend nixl|tcp]          KV transfer throughput between two processes
    pdserve debug trace ID [--gateway URL]  where one request's time went (the gateway's flight recorder; the
                                            API key, if any, from $PDSERVE_API_KEY)
    pdserve debug workers [--gateway URL]   every worker behind a gateway: its type (prefill, decode, regular),
                                            health and load (the admin key from $PDSERVE_ADMIN_API_KEY)
    pdserve debug switch-role URL TYPE [--gateway URL]   switch a worker's role live (prefill or decode) and
                                            print the seconds it took, or the reason it was refused
    pdserve debug migrate URL (--count N | --rid ID) [--to URL] [--gateway URL]   move running generations of
                                            a decode worker live, with their KV, to another (or where the router
                                            sends them)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid

from google.protobuf.json_format import MessageToDict


def add_arguments(parser: argparse.ArgumentParser, command: str) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_text in (("ping", "health and role"), ("info", "model and KV layout"),
                            ("stats", "KV pool / radix cache stats and integrity")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("addr", metavar="HOST:PORT", help="worker gRPC address")
        p.add_argument("--timeout", type=float, default=5.0)
    gen = sub.add_parser("generate", help="send one request to a decode (+prefill) or colocated worker")
    gen.add_argument("prompt")
    gen.add_argument("--decode", required=True, metavar="HOST:PORT", help="decode or colocated worker")
    gen.add_argument("--prefill", default="", metavar="HOST:PORT", help="prefill worker (PD mode)")
    gen.add_argument("--model-path", default=None, help="for the tokenizer (default: the default model)")
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="apply the chat template")
    gen.add_argument("--timeout", type=float, default=120.0)
    trace = sub.add_parser("trace", help="where one request's time went, from the gateway's flight recorder")
    trace.add_argument("id", help="its X-Request-Id (or its id, the client's rid, its trace id)")
    trace.add_argument("--gateway", default="http://127.0.0.1:30000", metavar="URL")
    trace.add_argument("--timeout", type=float, default=10.0)
    listing = sub.add_parser("workers", help="every worker behind a gateway, with its type and load")
    switch = sub.add_parser("switch-role", help="switch a worker's role live, through the gateway")
    switch.add_argument("url", metavar="HOST:PORT", help="the worker's gRPC address, as `workers` lists it")
    switch.add_argument("worker_type", choices=["prefill", "decode"])
    move = sub.add_parser("migrate", help="move a decode worker's running generations live, through the gateway")
    move.add_argument("url", metavar="HOST:PORT", help="the decode worker's gRPC address, as `workers` lists it")
    which = move.add_mutually_exclusive_group(required=True)
    which.add_argument("--count", type=int, help="how many of its generations (the latest started first)")
    which.add_argument("--rid", help="one generation, by its request id")
    move.add_argument("--to", metavar="HOST:PORT", help="the decode worker to move to (default: the router's pick)")
    for p in (listing, switch, move):
        p.add_argument("--gateway", default="http://127.0.0.1:30000", metavar="URL")
        p.add_argument("--timeout", type=float, default=90.0)
    bench = sub.add_parser("bench-transfer", help="KV transfer throughput between two processes")
    bench.add_argument("--backend", default="nixl", choices=["nixl", "tcp"])
    bench.add_argument("--tokens", type=int, default=2048)


def main(args: argparse.Namespace, command: str) -> int:
    if args.action == "bench-transfer":
        from pdserve.shared.transfer.bench import run_benchmark

        run_benchmark(args.backend, args.tokens)
        return 0
    if args.action == "trace":
        return _trace(args)
    if args.action in ("workers", "switch-role"):
        return _workers(args)
    if args.action == "migrate":
        return _migrate(args)
    try:
        return asyncio.run(_run(args))
    except Exception as exc:  # a debugging tool: one clear line
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _workers(args: argparse.Namespace) -> int:
    """GET /workers as a table, or POST /workers/switch_role and the seconds it took."""
    if args.action == "workers":
        answer = _gateway_json(args, "/workers")
        if answer is None:
            return 1
        print(f"{'URL':<24} {'TYPE':<8} {'HEALTHY':<8} {'LOAD':>5} {'FREE PAGES':>11}")
        for w in answer["workers"]:
            print(f"{w['url']:<24} {w['worker_type']:<8} {str(w['is_healthy']).lower():<8} {w['load']:>5} "
                  f"{w['free_pages'] if w['free_pages'] is not None else '-':>11}")
        return 0
    answer = _gateway_json(args, "/workers/switch_role", {"url": args.url, "worker_type": args.worker_type})
    if answer is None:
        return 1
    print(f"{answer['url']} is a {answer['worker_type']} worker now ({answer['seconds']:.2f} s)")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    """POST /workers/migrate: the generations frozen to move, and those refused with why."""
    body = {"url": args.url, **({"count": args.count} if args.count else {"rid": args.rid}),
            **({"to": args.to} if args.to else {})}
    answer = _gateway_json(args, "/workers/migrate", body)
    if answer is None:
        return 1
    print(f"{len(answer['frozen'])} generation(s) of {answer['url']} moving live"
          + "".join(f"\n  not moved: {why}" for why in answer["refused"]))
    return 0 if answer["frozen"] else 1


def _gateway_json(args: argparse.Namespace, path: str, body: dict | None = None,
                  key: str | None = None) -> dict | None:
    """The gateway's JSON answer (with `key`, else the admin key from the environment), or None with the error
    printed. Keys come from the environment, never a flag: a command line shows in `ps`."""
    import os
    import urllib.error
    import urllib.request

    key = key or os.environ.get("PDSERVE_ADMIN_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None if body is None else json.dumps(body).encode()
    if data is not None:
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(f"{args.gateway.rstrip('/')}{path}", data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=args.timeout) as r:
            return json.load(r)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["message"]  # the gateway's error shape
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        print(f"error: {args.gateway} answered {exc.code}: {message}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"error: cannot reach {args.gateway}: {exc}", file=sys.stderr)
    return None


def _trace(args: argparse.Namespace) -> int:
    """Print the request's timelines as the gateway kept them."""
    import os
    import urllib.parse

    # The admin key where there is one: with an API key beside it, other clients' requests are the admin key's.
    key = os.environ.get("PDSERVE_ADMIN_API_KEY") or os.environ.get("PDSERVE_API_KEY")
    answer = _gateway_json(args, f"/debug/requests/{urllib.parse.quote(args.id, safe='')}", key=key)
    if answer is None:
        return 1
    for t in answer["timelines"]:
        print(format_timeline(t))
    return 0


def format_timeline(t: dict) -> str:
    """One timeline as the lines `pdserve debug trace` prints."""
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t["started"]))
    lines = [f"request {t['request_id']} (id {t['rid']}{', trace ' + t['trace_id'] if t['trace_id'] else ''})",
             f"  started {started} on {t['workers'] or 'no worker'}; {t['prompt_tokens']} prompt tokens "
             f"({t['cached_tokens']} cached), {t['output_tokens']} out, finish {', '.join(t['finish_reasons']) or '-'}"]
    if t["ttft_s"] is not None:
        lines.append(f"  time to first token {1000 * t['ttft_s']:.1f} ms:")
        for part, seconds in t["ttft_parts"].items():
            share = seconds / t["ttft_s"] if t["ttft_s"] else 0.0
            lines.append(f"    {part:16} {1000 * seconds:9.1f} ms  {100 * share:5.1f} %")
    lines.append(f"  total {1000 * t['total_s']:.1f} ms")
    lines += [f"  event: {e}" for e in t["events"]]
    return "\n".join(lines)


async def _run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.proto import worker_pb2 as pb
    from pdserve.proto import worker_pb2_grpc as pb_grpc

    addr = args.decode if args.action == "generate" else args.addr
    from pdserve.shared.cluster_auth import worker_channel

    async with worker_channel(addr) as channel:
        stub = pb_grpc.WorkerStub(channel)
        try:
            if args.action == "ping":
                t0 = time.perf_counter()
                reply = await stub.Health(pb.Empty(), timeout=args.timeout)
                print(f"{addr}: {'ok' if reply.ok else 'NOT OK'} role={reply.role} "
                      f"rtt={1000 * (time.perf_counter() - t0):.1f} ms")
                return 0 if reply.ok else 1
            if args.action in ("info", "stats"):
                rpc = stub.Info if args.action == "info" else stub.Stats
                reply = await rpc(pb.Empty(), timeout=args.timeout)
                print(json.dumps(MessageToDict(reply, always_print_fields_with_no_presence=True), indent=2))
                return 0
            return await _generate(args, stub, pb)
        except grpc.aio.AioRpcError as exc:
            print(f"error: {addr}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1


async def _generate(args: argparse.Namespace, stub, pb) -> int:
    from transformers import AutoTokenizer

    from pdserve.shared.model_files import resolve_model_path
    from pdserve.proto.codec import params_to_proto
    from pdserve.shared.sampling_params import SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
    else:
        ids = tokenizer.encode(args.prompt)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    request = pb.GenerateRequest(rid=uuid.uuid4().hex, input_ids=ids, sampling=params_to_proto(params),
                                 prefill_addr=args.prefill)
    t0 = time.perf_counter()
    first = None
    tokens: list[int] = []
    async for msg in stub.Generate(request, timeout=args.timeout):
        for choice in msg.choices:
            if first is None and choice.token_ids:
                first = time.perf_counter() - t0
            tokens.extend(choice.token_ids)
            if choice.finish_reason:
                total = time.perf_counter() - t0
                print(tokenizer.decode(tokens, skip_special_tokens=True))
                print(f"[{len(ids)} prompt tokens, {msg.cached_tokens or 0} cached; {len(tokens)} generated; "
                      f"finish={choice.finish_reason}; ttft={1000 * (first or total):.0f} ms; total={total:.2f} s]",
                      file=sys.stderr)
    return 0

"""KV-transfer throughput between two processes: the interface against the raw transport.

One prompt's KV (default model: 30 layers, 3 KV heads, head_dim 64, bf16, 16-token
pages) moves from this process's pool into a target process's pool through
`write_pages` (pages contiguous, then scattered), and the same number of bytes moves
as one buffer through the bare transport (one NIXL WRITE descriptor, or one socket
`sendall`). Timed iterations alternate between the cases; the median counts.
"""
from __future__ import annotations

import multiprocessing as mp
import random
import socket
import statistics
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

PAGE_SHAPE = (30, 2, 16, 3, 64)  # [layers, K/V, page_size, kv_heads, head_dim]
PAGE_SIZE = PAGE_SHAPE[2]
DTYPE = torch.bfloat16


@dataclass
class Row:
    case: str
    nbytes: int
    seconds: float  # median of the timed iterations

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9


def make_pool(num_pages: int, device: str = "cpu") -> torch.Tensor:
    return torch.randn((num_pages, *PAGE_SHAPE), device=device).to(DTYPE)


def _raw_tcp_server(listener: socket.socket, sink: memoryview) -> None:
    """The bare-socket baseline: read length-prefixed blobs into `sink`, ack each with one byte."""
    conn, _ = listener.accept()
    with conn:
        while True:
            head = conn.recv(8, socket.MSG_WAITALL)
            if len(head) < 8:
                return
            view = sink[: struct.unpack("!Q", head)[0]]
            while view:
                n = conn.recv_into(view)
                if n == 0:
                    return
                view = view[n:]
            conn.sendall(b"\x00")


def _target(backend: str, num_pages: int, device: str, conn) -> None:
    torch.set_num_threads(1)
    from pdserve.shared.transfer import create_transfer

    transfer = create_transfer(backend, "bench-target", make_pool(num_pages, device))
    transfer.open_window(list(range(transfer.num_pages)))  # a stand-in receiver: any page may be written
    listener = socket.create_server(("127.0.0.1", 0))
    sink = memoryview(torch.empty(num_pages * transfer.page_bytes, dtype=torch.uint8).numpy())
    threading.Thread(target=_raw_tcp_server, args=(listener, sink), daemon=True).start()
    conn.send((transfer.metadata(), listener.getsockname()[1]))
    while not conn.poll(0.0005):  # keep the NIXL target progressing until told to stop
        transfer.poll()
    transfer.close()


def _raw_nixl(metadata: bytes, src: torch.Tensor) -> Callable[[], None]:
    """One WRITE descriptor of all of `src` to the start of the target's pool, with plain NIXL calls."""
    import json

    from nixl._api import nixl_agent, nixl_agent_config

    from pdserve.shared.transfer.base import unb64

    md = json.loads(metadata)
    agent = nixl_agent("bench-raw", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent.register_memory(src)
    peer = agent.add_remote_agent(unb64(md["agent"]))
    nbytes = src.numel() * src.element_size()
    local = agent.get_xfer_descs(src)
    remote = agent.get_xfer_descs([(md["base"], nbytes, md["device"])], md["mem"])

    def write() -> None:
        handle = agent.initialize_xfer("WRITE", local, remote, peer)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        handle.release()
        if state != "DONE":
            raise RuntimeError("raw NIXL write failed")

    write._agent = agent  # keep the agent alive as long as the closure
    return write


def _raw_tcp(port: int, src: torch.Tensor) -> Callable[[], None]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    data = memoryview(src.reshape(-1).view(torch.uint8).numpy())

    def write() -> None:
        sock.sendall(struct.pack("!Q", len(data)))
        sock.sendall(data)
        if sock.recv(1) != b"\x00":
            raise RuntimeError("raw TCP write failed")

    write._sock = sock
    return write


def _time(cases: dict[str, Callable[[], None]], iters: int) -> dict[str, float]:
    for fn in cases.values():  # warm-up: connection set-up, page faults
        fn()
        fn()
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(iters):
        for name, fn in cases.items():  # interleaved, so background noise hits every case alike
            t0 = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - t0)
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(backend: str, tokens: int = 2048, iters: int = 20, device: str = "cpu", seed: int = 0) -> list[Row]:
    """Raw transport vs `write_pages` (contiguous, scattered) for one prompt of `tokens` tokens.

    With a CUDA `device` both pools live there; the raw TCP baseline still sends from host memory.
    """
    from pdserve.shared.transfer import create_transfer

    pages = -(-tokens // PAGE_SIZE)
    num_pages = 2 * pages + 8
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(backend, num_pages, device, child), daemon=True)
    proc.start()
    try:
        if not parent.poll(60):
            raise RuntimeError("benchmark target did not start")
        metadata, raw_port = parent.recv()
        source = create_transfer(backend, "bench-source", make_pool(num_pages, device))
        source.add_peer("target", metadata)
        rng = random.Random(seed)
        scattered_src = rng.sample(range(num_pages), pages)
        scattered_dst = rng.sample(range(num_pages), pages)
        contiguous = list(range(pages))
        raw_src = source.pool[:pages]
        cases = {
            "raw": _raw_nixl(metadata, raw_src) if backend == "nixl" else _raw_tcp(raw_port, raw_src.cpu()),
            "contiguous": lambda: source.write_pages("target", contiguous, [p + 4 for p in contiguous]),
            "scattered": lambda: source.write_pages("target", scattered_src, scattered_dst),
        }
        times = _time(cases, iters)
        source.close()
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    nbytes = raw_src.numel() * raw_src.element_size()
    labels = {"raw": "raw NIXL WRITE, 1 descriptor" if backend == "nixl" else "raw socket sendall",
              "contiguous": "write_pages, 1 run", "scattered": f"write_pages, {pages} scattered runs"}
    return [Row(f"{backend}: {labels[k]}", nbytes, times[k]) for k in cases]


def measure_memcpy(tokens: int = 2048, iters: int = 20, device: str = "cpu") -> Row:
    pages = -(-tokens // PAGE_SIZE)
    src, dst = make_pool(pages, device), make_pool(pages, device)
    sync = torch.cuda.synchronize if src.is_cuda else (lambda: None)
    seconds = _time({"copy": lambda: (dst.copy_(src), sync())}, iters)["copy"]
    return Row(f"in-process copy_ ({device})", src.numel() * src.element_size(), seconds)


def print_rows(rows: list[Row]) -> None:
    """One line per case; each `write_pages` row as a share of its own backend's raw transport."""
    raw = {row.case.split(":")[0]: row for row in rows if "raw" in row.case}
    print(f"{'case':<48} {'MB':>7} {'ms':>8} {'GB/s':>7} {'of raw':>7}")
    for row in rows:
        base = raw.get(row.case.split(":")[0])
        ratio = f"{row.gbps / base.gbps:6.0%}" if base is not None and base is not row else ""
        print(f"{row.case:<48} {row.nbytes / 1e6:7.1f} {row.seconds * 1e3:8.2f} {row.gbps:7.2f} {ratio:>7}")


def run_benchmark(backend: str, tokens: int = 2048, iters: int = 20, device: str = "cpu") -> list[Row]:
    torch.set_num_threads(1)
    rows = measure(backend, tokens, iters, device)
    print(f"KV of a {tokens}-token prompt, page = {PAGE_SHAPE} bf16 ({rows[0].nbytes // -(-tokens // PAGE_SIZE)} "
          f"bytes), median of {iters}:")
    print_rows(rows)
    return rows

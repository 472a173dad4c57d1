"""A KV-transfer target in its own process, for the transfer tests and the benchmark.

The child builds a pool, sends its transfer metadata over a pipe, then polls its
transfer until told to dump its pool or stop; the parent may also SIGKILL/SIGSTOP it.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import torch

PAGE_SHAPE = (2, 2, 4, 2, 16)  # [layers, K/V, page_size, kv_heads, head_dim] -> 1 KiB pages in bf16


def make_pool(num_pages: int, seed: int, page_shape: tuple[int, ...] = PAGE_SHAPE) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((num_pages, *page_shape), generator=g).to(torch.bfloat16)


def _serve(backend: str, name: str, num_pages: int, seed: int, device: str, page_shape: tuple[int, ...],
           conn) -> None:
    torch.set_num_threads(1)
    from pdserve.shared.transfer import create_transfer

    transfer = create_transfer(backend, name, make_pool(num_pages, seed, page_shape).to(device))
    transfer.open_window(list(range(transfer.num_pages)))  # a stand-in receiver: any page may be written
    conn.send(transfer.metadata())
    held: list[int] = []
    while True:
        if conn.poll(0.001):
            cmd = conn.recv()
            if cmd == "dump":
                conn.send(transfer.pool.to("cpu", copy=True))  # a copy: pickling shares (moves) storage
            elif cmd == "exhaust_fds":  # open files until the process has no descriptor left
                conn.send(_exhaust_fds(held))
            elif cmd == "release_fds":
                while held:
                    os.close(held.pop())
                conn.send(True)
            elif cmd == "healthy":
                conn.send(transfer.healthy())
            elif cmd == "stop":
                break
        transfer.poll()
    transfer.close()


def _exhaust_fds(held: list[int]) -> int:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 1024), hard))  # a bounded number to fill
    try:
        while True:
            held.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        return len(held)


class PeerProcess:
    def __init__(self, backend: str, name: str, num_pages: int = 32, seed: int = 1, device: str = "cpu",
                 page_shape: tuple[int, ...] = PAGE_SHAPE) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(backend, name, num_pages, seed, device, page_shape, child),
                                daemon=True)
        self.proc.start()
        self.initial = make_pool(num_pages, seed, page_shape)
        self.metadata: bytes = self._recv(60)

    def _recv(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError("the peer process did not answer")
        return self.conn.recv()

    def dump(self) -> torch.Tensor:
        self.conn.send("dump")
        return self._recv(10)

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
            except OSError:
                pass
            self.proc.join(5)
        if self.proc.is_alive():
            self.signal(signal.SIGKILL)
            self.proc.join(5)

"""The ranks of one tensor-parallel worker on one machine, and what they say to each other.

Two kinds of talk:
- the leader's **mailbox**: rank 0 schedules, and before each step it posts what the step is (a kind, a few
  integers, a payload of int64s) for every other rank to read. A follower waits on it for as long as the worker
  is idle, checking that the leader is alive, so an idle worker costs no collective timeout;
- **collectives** inside the forward: all-reduce of a layer's partial sums, all-gather of the vocabulary shards
  of the logits. On CPUs they run through the same shared memory (`ShmGroup`): gloo's all-reduce took 1.3-2.5 ms
  per call between two processes on this 2-core machine (a [1, 576] fp32 tensor, loopback TCP), against tens of
  microseconds here, and a step makes two per layer. On GPUs they are NCCL's, through torch.distributed
  (`TorchGroup`, which also carries the step's tensors device to device), with the mailbox still here.

Every rank sums the shards in rank order, in fp32, so every rank holds the same bits and a bf16 model rounds once.
Every wait has a deadline and checks that the other ranks' processes are alive: a rank killed or hung ends its
peers' waits with `RankGone` within `timeout_s`, and the worker goes down with it rather than hanging.

Memory order: a rank writes its data, then its sequence number, with plain stores, and readers read the number
before the data; x86's total store order keeps the two in that order, which is why tensor parallelism on a CPU
requires x86-64 (`check_platform`).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import platform
import secrets
import time
from pathlib import Path

import numpy as np
import torch

from pdserve.shared.tp_bytes import gather_bytes

SLOT_BYTES = 8 << 20  # one rank's share of one collective round; larger tensors go in several rounds
PAYLOAD_BYTES = 16 << 20  # the leader's step payload
_LINE = 8  # int64s per cache line: each rank's counters sit on lines of their own
_HEADER_INTS = 32
_CTRL_INTS = _LINE * (4 + 2 * 16)  # mailbox seq, kind, header; then per rank: round seq, pid
_MAX_RANKS = 16
_SPIN_S = 0.002  # spin this long before sleeping between checks (inside a step, where the ranks meet often)
_NEXT_STEP_SPIN_S = 0.0001


class RankGone(RuntimeError):
    """Another rank of this worker died or stopped answering: the worker cannot step without it."""


def check_platform() -> None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise ValueError(f"--tp-size on a CPU needs x86-64 (its shared-memory all-reduce relies on x86's store "
                         f"order); this machine is {platform.machine()}")


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


def _running(pid: int) -> bool:
    """Whether `pid` still runs: a rank that died is a zombie until its parent reaps it, and counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


class Mailbox:
    """Shared memory mapped by every rank: the leader's mailbox, the per-rank round counters and the slots."""

    def __init__(self, path: str, rank: int, size: int, create: bool) -> None:
        if not 1 <= size <= _MAX_RANKS:
            raise ValueError(f"--tp-size must be between 1 and {_MAX_RANKS}, got {size}")
        self.rank, self.size, self.path = rank, size, path
        total = _CTRL_INTS * 8 + PAYLOAD_BYTES + 2 * size * SLOT_BYTES
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self.ctrl = np.frombuffer(self.map, dtype=np.int64, count=_CTRL_INTS)
        self.payload = torch.frombuffer(self.map, dtype=torch.int64, count=PAYLOAD_BYTES // 8, offset=_CTRL_INTS * 8)
        self.slots = torch.frombuffer(self.map, dtype=torch.uint8, count=2 * size * SLOT_BYTES,
                                      offset=_CTRL_INTS * 8 + PAYLOAD_BYTES).view(2, size, SLOT_BYTES)
        self.round = 0  # this rank's collective rounds so far
        self._seqs = np.array([self._seq_at(r) for r in range(size)])
        self._others = [r for r in range(size) if r != rank]
        self.seen = 0  # the mailbox posts read (follower) or made (leader)
        self.ctrl[self._pid_at(rank)] = os.getpid()

    @classmethod
    def create(cls, size: int) -> Mailbox:
        path = str(shm_dir() / f"pdserve-tp-{secrets.token_hex(8)}")
        return cls(path, 0, size, create=True)

    def unlink(self) -> None:
        """Once every rank has mapped it: the memory lives on with the mappings, and no file outlives them."""
        Path(self.path).unlink(missing_ok=True)

    @staticmethod
    def _seq_at(rank: int) -> int:
        return _LINE * (4 + 2 * rank)

    @staticmethod
    def _pid_at(rank: int) -> int:
        return _LINE * (5 + 2 * rank)

    def pids(self) -> list[int]:
        return [int(self.ctrl[self._pid_at(r)]) for r in range(self.size)]

    # ------------------------------------------------------------------ waiting
    def _wait(self, ready, timeout_s: float | None, what: str, watch: list[int], idle=None,
              spin_s: float = _SPIN_S) -> None:
        """Until `ready()`; spins briefly, then sleeps between checks (longer the longer it waits) and checks
        that the ranks in `watch` are alive. timeout_s None: as long as they are. `idle()`: called at each
        check while it sleeps (a KV agent's progress)."""
        if ready():
            return
        start = time.monotonic()
        naps = 0
        while not ready():
            waited = time.monotonic() - start
            if waited < spin_s:
                continue
            if timeout_s is not None and waited > timeout_s:
                raise RankGone(f"tensor-parallel rank {self.rank}: no answer from the other ranks for {timeout_s:g} s "
                               f"while {what}")
            naps += 1
            if naps % 64 == 0:
                self._check_alive(watch, what)
            if idle is not None:
                idle()
            time.sleep(0.0001 if waited < 0.1 else 0.001 if waited < 1 else 0.005)

    def _check_alive(self, ranks: list[int], what: str) -> None:
        for r in ranks:
            pid = int(self.ctrl[self._pid_at(r)])
            if pid > 0 and not _running(pid):  # (0: not attached yet)
                raise RankGone(f"tensor-parallel rank {r} (pid {pid}) is gone; rank {self.rank} stops while {what}")

    def wait_attached(self, timeout_s: float, alive=lambda: None) -> None:
        """Leader: until every rank has mapped the memory (then the file can go). `alive()` raises if a rank's
        process ended before it got there."""
        def ready():
            alive()
            return all(p > 0 for p in self.pids())
        self._wait(ready, timeout_s, "waiting for the ranks to start", [])

    # ------------------------------------------------------------------ the mailbox
    def post(self, kind: int, header: list[int], payload: torch.Tensor | None = None) -> None:
        """Leader: the next step. Followers read it before their first collective of the step, and the leader
        posts again only after that collective, so a post is never overwritten unread."""
        if len(header) > _HEADER_INTS:
            raise ValueError(f"a tensor-parallel step header holds {_HEADER_INTS} integers, got {len(header)}")
        if payload is not None:
            n = payload.numel()
            if n > self.payload.numel():
                raise ValueError(f"a tensor-parallel step payload holds {self.payload.numel()} integers, got {n}")
            self.payload[:n].copy_(payload.reshape(-1))
        self.ctrl[8:8 + len(header)] = header
        self.ctrl[1] = kind
        self.seen += 1
        self.ctrl[0] = self.seen

    def fetch(self, timeout_s: float | None, idle=None) -> tuple[int, list[int]]:
        """Follower: (kind, header) of the leader's next post; its payload is `self.payload` until the next."""
        want = self.seen + 1
        # Between steps rank 0 samples, schedules and answers: a follower sleeps almost at once rather than spin
        # through it on a core the worker's other processes (its front, the gateway) may need meanwhile.
        self._wait(lambda: self.ctrl[0] >= want, timeout_s, "waiting for the next step", [0], idle, _NEXT_STEP_SPIN_S)
        self.seen = want
        return int(self.ctrl[1]), self.ctrl[8:8 + _HEADER_INTS].tolist()

    # ------------------------------------------------------------------ collective rounds
    def own_slot(self) -> torch.Tensor:
        """This rank's slot of the next round (uint8 [SLOT_BYTES]): write into it, then `publish`."""
        return self.slots[(self.round + 1) & 1, self.rank]

    def publish(self, timeout_s: float) -> torch.Tensor:
        """End this rank's part of a round (its slot written) and wait for every rank's; returns the round's slots
        [size, SLOT_BYTES]. Two parities: a rank reuses a parity only after every rank finished the round before,
        which it has read the other parity's slots before joining."""
        self.round += 1
        self.ctrl[self._seq_at(self.rank)] = self.round
        self.wait_round(timeout_s)
        return self.slots[self.round & 1]

    def wait_round(self, timeout_s: float) -> None:
        """Until every rank has published round `self.round`."""
        want, seqs = self.round, self._seqs
        self._wait(lambda: self.ctrl[seqs].min() >= want, timeout_s, "summing a layer", self._others)

    @property
    def seq_addresses(self) -> list[int]:
        """Where each rank's round number lives in this process (for the native round)."""
        base = self.ctrl.ctypes.data
        return [base + 8 * int(i) for i in self._seqs]

    def exchange(self, data: torch.Tensor, timeout_s: float) -> torch.Tensor:
        """One round with `data` (uint8, at most SLOT_BYTES) as this rank's part."""
        self.own_slot()[:data.numel()].copy_(data)
        return self.publish(timeout_s)


_NATIVE_SPINS = 50_000  # checks (with a pause each) before the native round hands the wait back: ~1-2 ms


def _native_round():
    """The native CPU kernels' module where it builds here (it holds the round in C++), else None."""
    from pdserve.kernels import native

    try:
        return native.load()
    except native.NativeUnavailable:
        return None


class ShmGroup:
    """The collectives of a forward step between CPU ranks, through the mailbox's slots."""

    def __init__(self, mailbox: Mailbox, timeout_s: float) -> None:
        self.box = mailbox
        self.rank, self.size = mailbox.rank, mailbox.size
        self.timeout_s = timeout_s
        self._native = _native_round()
        self._seq_addresses = mailbox.seq_addresses

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of x (any float dtype), in place and returned: summed in fp32 in rank order."""
        flat = x.view(-1)  # (a view: the sums land in x)
        per_round = SLOT_BYTES // 4
        box = self.box
        for lo in range(0, flat.numel(), per_round):
            part = flat[lo:lo + per_round]
            n = part.numel()
            if self._native is not None and part.dtype in (torch.float32, torch.bfloat16):
                # The round in C++ (the same protocol): it spins a while; past that, wait here, checking liveness.
                own = box.own_slot()[:n * 4].view(torch.float32)
                box.round += 1
                values = box.slots[box.round & 1][:, :n * 4].view(torch.float32)
                if not self._native.shm_all_reduce(part, own, values, self._seq_addresses, self.rank, box.round,
                                                   _NATIVE_SPINS):
                    box.wait_round(self.timeout_s)
                    self._native.shm_sum(part, values)
                continue
            self.box.own_slot()[:n * 4].view(torch.float32).copy_(part)  # widened to fp32 on the way in
            values = self.box.publish(self.timeout_s)[:, :n * 4].view(torch.float32)  # [size, n]
            total = values[0] + values[1]
            for r in range(2, self.size):
                total += values[r]
            part.copy_(total)
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        """[R, C] on every rank (the same R and C) -> [R, size * C], rank 0's columns first."""
        rows, cols = x.shape
        row_bytes = cols * x.element_size()
        per_round = max(1, SLOT_BYTES // row_bytes)
        out = torch.empty(rows, self.size * cols, dtype=x.dtype)
        for lo in range(0, rows, per_round):
            part = x[lo:lo + per_round].contiguous()
            n = part.numel() * x.element_size()
            slots = self.box.exchange(part.view(-1).view(torch.uint8), self.timeout_s)
            shards = slots[:, :n].view(x.dtype).view(self.size, part.shape[0], cols)
            out[lo:lo + part.shape[0]] = shards.permute(1, 0, 2).reshape(part.shape[0], self.size * cols)
        return out

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """A CPU step's tensors travel in the mailbox's payload already."""
        return x

    def barrier(self, timeout_s: float) -> None:
        self.box.exchange(torch.zeros(1, dtype=torch.uint8), timeout_s)

    def failed_ranks(self, failed: bool, timeout_s: float) -> list[int]:
        """Every rank says whether it failed; all learn which did."""
        slots = self.box.exchange(torch.tensor([int(failed)], dtype=torch.uint8), timeout_s)
        return [r for r in range(self.size) if slots[r, 0]]

    def all_gather_bytes(self, data: bytes, timeout_s: float) -> list[bytes]:
        """Every rank's `data` (at most a slot, less 8 bytes), in rank order."""
        raw = len(data).to_bytes(8, "little") + data
        slots = self.box.exchange(torch.frombuffer(bytearray(raw), dtype=torch.uint8), timeout_s)
        out = []
        for r in range(self.size):
            n = int.from_bytes(slots[r, :8].numpy().tobytes(), "little")
            out.append(slots[r, 8:8 + n].numpy().tobytes())
        return out


class TorchGroup:
    """The collectives of a forward step through torch.distributed: NCCL between GPU ranks (the step's tensors
    go device to device too), or gloo between CPU ranks (slower than ShmGroup on one machine; the way between
    machines). A collective that fails (a peer's connection closed, or nothing from it for `timeout_s`) leaves
    the ranks out of step for good: it raises RankGone. A CPU rank widens a bf16/fp16 sum to fp32, so a layer
    rounds once, and adds the ranks' parts in rank order, as under ShmGroup: past 2 ranks it gathers them and adds
    them itself, since gloo's ring starts each chunk's sum at another rank and the chunks fall by the tensor's
    size, so a row got other bits in a batch of another size (which deterministic mode cannot have)."""

    def __init__(self, rank: int, size: int, init_method: str, timeout_s: float, device: torch.device,
                 store=None) -> None:
        """`store`: meet there (a worker across machines, shared/tp_nodes.py) rather than at `init_method`."""
        import datetime

        import torch.distributed as dist

        self.dist = dist
        self.rank, self.size, self.device = rank, size, device
        self.timeout_s = timeout_s
        where = {"store": store} if store is not None else {"init_method": init_method}
        with self._gone_if_failed("forming the group"):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=size,
                                    timeout=datetime.timedelta(seconds=timeout_s), **where)

    @contextlib.contextmanager
    def _gone_if_failed(self, what: str, timeout_s: float | None = None):
        """Any failure of a collective as RankGone; `timeout_s` longer than the group's: for this one only (a
        vote while the ranks load a model or move KV)."""
        longer = timeout_s is not None and timeout_s > self.timeout_s
        if longer:
            self._set_timeout(timeout_s)
        try:
            yield
        except RankGone:
            raise
        except Exception as exc:
            raise RankGone(f"tensor-parallel rank {self.rank}: a collective failed while {what}: {exc}") from None
        finally:
            if longer:
                self._set_timeout(self.timeout_s)

    def _set_timeout(self, seconds: float) -> None:
        import datetime

        from torch.distributed import distributed_c10d

        try:
            distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))
        except (AttributeError, ValueError):  # an older torch: the group's own timeout holds
            pass

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:  # (no context manager on the hottest call: two per layer)
            if self.device.type == "cpu" and self.size > 2:
                parts = [torch.empty(x.numel(), dtype=torch.float32) for _ in range(self.size)]
                self.dist.all_gather(parts, x.reshape(-1).float())
                total = parts[0] + parts[1]
                for part in parts[2:]:
                    total += part
                x.copy_(total.view(x.shape))
            elif self.device.type == "cpu" and x.dtype != torch.float32:
                wide = x.float()
                self.dist.all_reduce(wide)
                x.copy_(wide)
            else:
                self.dist.all_reduce(x)
        except Exception as exc:
            raise RankGone(f"tensor-parallel rank {self.rank}: a collective failed while summing a layer: {exc}") \
                from None
        return x

    def all_gather_columns(self, x: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self.size)]
        with self._gone_if_failed("gathering the logits"):
            self.dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        with self._gone_if_failed("sending a step"):
            self.dist.broadcast(x, src=0)
        return x

    def barrier(self, timeout_s: float) -> None:
        self.failed_ranks(False, timeout_s)

    def all_gather_bytes(self, data: bytes, timeout_s: float) -> list[bytes]:
        """Every rank's `data`, as tensors (shared/tp_bytes.py): nothing a peer sends is unpickled."""
        with self._gone_if_failed("exchanging metadata", timeout_s):
            return gather_bytes(self.dist, data, self.size, self.device)

    def failed_ranks(self, failed: bool, timeout_s: float) -> list[int]:
        flags = [torch.zeros(1, dtype=torch.int32, device=self.device) for _ in range(self.size)]
        with self._gone_if_failed("agreeing on an outcome", timeout_s):
            self.dist.all_gather(flags, torch.tensor([int(failed)], dtype=torch.int32, device=self.device))
        return [r for r, f in enumerate(flags) if f.item()]

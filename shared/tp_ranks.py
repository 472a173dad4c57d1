"""A tensor-parallel worker's rank processes: the cores each one runs on, the processes rank 0 starts, and the
life of a follower rank (`follow`: the leader's posts, shared/tp_step.py, until it says stop or is gone).

On one machine the ranks talk through shared memory (shared/tp_group.py), or meet for torch.distributed's
collectives at a store rank 0 serves on loopback. Over several (`Launch.nodes`) rank 0 serves the rendezvous store
behind its gate (shared/tp_nodes.py, shared/tp_gate.py), posts through it (shared/tp_channel.py), sums through
torch.distributed and watches the other nodes' processes (shared/tp_link.py); each starts its own ranks
(shared/tp_remote.py). A rank's store is always reached on loopback: rank 0's own, or its node's tunnel.
"""
from __future__ import annotations

import ctypes
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from pdserve.shared.config import ModelConfig, RuntimeConfig
from pdserve.shared.tp_channel import StoreBox
from pdserve.shared.tp_gate import loopback_store
from pdserve.shared.tp_group import Mailbox, RankGone, ShmGroup, TorchGroup, check_platform
from pdserve.shared.tp_link import Link
from pdserve.shared.tp_nodes import (LINK, Nodes, check_settings, client_store, form, join, master_store,
                                     settings_of)
from pdserve.shared.tp_shards import Shards
from pdserve.shared.tp_step import (DISCARD, KV, LORA, POOL, START_TIMEOUT_S, STEP, STOP, SWAP, TIER, WEIGHTS,
                                    TPRank, read_bytes, read_step)
from pdserve.shared.tp_transfer import TransferSpec, rank_transfers

log = logging.getLogger(__name__)


def follow(rank: TPRank, runner, transfer: TransferSpec | None = None) -> None:
    """A follower's life after its model is loaded: the pool's size from the leader (and this rank's KV
    transfer agent, in a disaggregated worker), then the leader's steps until it says stop (or is gone:
    RankGone)."""
    kind, header = rank.box.fetch(START_TIMEOUT_S)
    if kind != POOL:
        raise RankGone(f"tensor-parallel rank {rank.shards.rank}: expected the pool's size first, got kind {kind}")
    runner.build_pool(header[0])
    kv = rank_transfers(transfer, rank, runner) if transfer is not None else None
    store = _rank_store(rank, runner)
    log.info("tensor-parallel rank %d of %d: %d KV pages, following rank 0", rank.shards.rank, rank.shards.size,
             header[0])
    staged = None  # the weights rank 0 had every rank build, until it swaps or drops them
    while True:
        kind, header = rank.box.fetch(None, kv.poll if kv is not None else None)
        if kind == STOP:
            return
        if kind == STEP:
            fb, copies = read_step(rank, header, runner.device)
            runner.run_step(fb, copies)
        elif kind == WEIGHTS:
            staged = _build_weights(runner, read_bytes(rank.box.payload).decode())
        elif kind == SWAP:
            runner.swap_weights(staged)
            staged = None
        elif kind == DISCARD:
            staged = None
            rank.group.barrier(START_TIMEOUT_S)
        elif kind == KV and kv is not None:
            kv.apply()
        elif kind == LORA:
            _put_adapter(rank, runner, header)
        elif kind == TIER and store is not None:
            store.apply()
        else:
            raise RankGone(f"tensor-parallel rank {rank.shards.rank}: unknown step kind {kind}")


def _rank_store(rank: TPRank, runner):
    """This rank's part of the storage tier (shared/kv_tier_ranks.py), when the worker has one."""
    tiers = runner.config.tiers
    if tiers is None or tiers.storage_dir is None:
        return None
    from pdserve.shared.kv_keys import kv_identity
    from pdserve.shared.kv_tier_ranks import RankStore

    return RankStore(rank, tiers, runner.pool, kv_identity(runner.config, runner), runner.config.model_path)


def _put_adapter(rank: TPRank, runner, header: list[int]) -> None:
    """A follower: the adapter rank 0 put in a slot (read from the same files, cut to this rank's shards)."""
    from pdserve.shared.lora import LoraError
    from pdserve.shared.lora_checkpoint import load_adapter

    slot, write = header[:2]
    pool = runner.lora.pool
    if not write:
        pool.put(slot, None)
        rank.group.barrier(START_TIMEOUT_S)
        return
    failed = False
    try:
        info = json.loads(read_bytes(rank.box.payload))
        adapter = load_adapter(info["name"], info["path"], pool.model_config, max_rank=pool.max_rank,
                               target_modules=pool.target_modules, dtype=pool.dtype, device=pool.device)
        if adapter.version != info["version"]:
            raise LoraError(f"adapter {info['name']!r}: its files changed since rank 0 loaded them")
        pool.put(slot, adapter)
    except LoraError as exc:
        log.error("tensor-parallel rank %d: %s", rank.shards.rank, exc)
        pool.put(slot, None)
        failed = True
    rank.group.failed_ranks(failed, START_TIMEOUT_S)


def _build_weights(runner, path: str):
    from pdserve.shared.weights import WeightsError

    try:
        checkpoint = runner.read_weights(path)
    except WeightsError as exc:
        checkpoint = None
        log.error("tensor-parallel rank %d cannot read the new weights: %s", runner.tp.shards.rank, exc)
    if checkpoint is None:  # still meets rank 0 in its vote
        runner.tp.group.failed_ranks(True, START_TIMEOUT_S)
        return None
    try:
        return runner.build_weights(checkpoint)
    except WeightsError as exc:
        log.error("tensor-parallel rank %d cannot build the new weights: %s", runner.tp.shards.rank, exc)
        return None


# ------------------------------------------------------------------------------------------------ the ranks' processes
def cpu_sets(size: int, binding: str | None) -> list[set[int]]:
    """The cores of each rank. `binding` ("0-3|4-7", SGLang's --cpu-binding syntax in spirit): given per rank;
    otherwise one NUMA node per rank where the machine has as many nodes, else this process's cores split in
    contiguous equal groups. A ValueError names the numbers when there are not enough cores."""
    allowed = sorted(os.sched_getaffinity(0))
    if binding:
        sets = [_parse_cpus(part) for part in binding.split("|")]
        if len(sets) != size:
            raise ValueError(f"--cpu-binding {binding!r} names {len(sets)} core sets for --tp-size {size}")
        if any(not s or not s <= set(allowed) for s in sets):
            raise ValueError(f"--cpu-binding {binding!r}: each rank needs cores among this process's {allowed}")
        return sets
    if size > len(allowed):
        raise ValueError(f"--tp-size {size} needs a core per rank; this process may run on {len(allowed)} "
                         f"({allowed})")
    nodes = [s & set(allowed) for s in _numa_nodes()]
    nodes = [s for s in nodes if s]
    if len(nodes) >= size:
        return nodes[:size]
    per = len(allowed) // size
    return [set(allowed[r * per:(r + 1) * per]) for r in range(size)]


def _parse_cpus(text: str) -> set[int]:
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        lo, _, hi = item.partition("-")
        try:
            cpus.update(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise ValueError(f"--cpu-binding: {item!r} is not a core number or range") from None
    return cpus


def _numa_nodes() -> list[set[int]]:
    nodes = []
    for path in sorted(Path("/sys/devices/system/node").glob("node[0-9]*/cpulist")):
        nodes.append(_parse_cpus(path.read_text().strip()))
    return nodes


@dataclass
class Launch:
    """What rank 0 needs to start and stop the other ranks."""

    size: int
    cpus: list[set[int]]
    timeout_s: float
    base_gpu_id: int = 0
    transfer: TransferSpec | None = None  # a disaggregated worker's: every rank makes its own agent
    threads: int | None = None  # compute threads per CPU rank (--threads); None: one per core of the rank
    collectives: str = "shm"  # on CPUs: "shm" (ShmGroup), or "torch" (gloo); GPUs always use NCCL
    nodes: Nodes | None = None  # a worker over several machines: torch.distributed for everything

    def local(self, rank: int) -> int:
        """`rank`'s place among this machine's ranks (its cores, its GPU): cpus and GPUs are per machine."""
        return rank - (self.nodes.local[0] if self.nodes is not None else 0)


class Ranks:
    """Rank 0's side of a tensor-parallel worker: the mailbox it creates and the follower processes it starts
    (on a worker over several machines: this machine's followers, the rendezvous and the other nodes' links).
    Build it on the thread that outlives the worker (the followers die with that thread: PR_SET_PDEATHSIG)."""

    def __init__(self, config: RuntimeConfig, launch: Launch) -> None:
        self.config, self.launch = config, launch
        self.cuda = config.device.startswith("cuda")
        here = len(launch.nodes.local) if launch.nodes is not None else launch.size
        if self.cuda:
            import torch.cuda

            have = torch.cuda.device_count() - launch.base_gpu_id
            if here > have:
                raise ValueError(f"--tp-size {launch.size} needs {here} GPUs on this machine from --base-gpu-id "
                                 f"{launch.base_gpu_id}; it shows {have}")
        elif launch.nodes is None:
            check_platform()
        if launch.collectives not in ("shm", "torch"):
            raise ValueError(f"tensor-parallel collectives must be shm or torch, got {launch.collectives!r}")
        self.procs: list[subprocess.Popen] = []
        self.link: Link | None = None
        self.gate = None
        self.store = None
        if launch.nodes is None:
            self._start_here()
        else:
            self._start_across(launch.nodes)
        if not self.cuda:
            _pin(launch.cpus[0], launch.threads)

    def _start_here(self) -> None:
        launch = self.launch
        if self.cuda or launch.collectives == "torch":
            self.store = loopback_store(START_TIMEOUT_S)
        port = self.store.port if self.store is not None else 0
        self.box = Mailbox.create(launch.size)
        try:
            for r in range(1, launch.size):
                self.procs.append(start_follower(self.config, r, launch, self.box.path, port))
            self.box.wait_attached(START_TIMEOUT_S, self.check_alive)
        except BaseException:
            self.close()
            raise
        finally:
            self.box.unlink()

    def _start_across(self, nodes: Nodes) -> None:
        """Serve the rendezvous, start this machine's other ranks, and return once every rank of every node has
        joined (each node's process linked)."""
        self.store, self.gate = master_store(nodes, START_TIMEOUT_S)
        self.link = Link.listen(self.launch.timeout_s, nodes.host, range(1, nodes.count))
        self.store.set(LINK, str(self.link.port).encode())
        self.link.start()
        self.box = StoreBox(self.store, 0, self.launch.size)
        log.info("tensor-parallel rank 0: %s", nodes.describe())
        try:
            for r in nodes.local[1:]:
                self.procs.append(start_follower(self.config, r, self.launch, store_port=self.store.port))
            mine = settings_of(self.config, _backend(self.launch))
            form(self.store, self.launch.size, lambda: self.link.linked(range(1, nodes.count)), self.check_alive,
                 START_TIMEOUT_S, lambda: check_settings(self.store, nodes, mine))
        except BaseException as exc:
            self.link.say(f"rank 0 could not start: {exc}")  # (the other nodes' logs say it too)
            self.close()
            raise

    def check_alive(self) -> None:
        """RankGone when one of the other ranks (or another node) is gone; any thread may ask."""
        for r, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                raise RankGone(f"tensor-parallel rank {r} exited (code {proc.returncode}); see its log above")
        if self.link is not None:
            self.link.check()

    def rank0(self, model_config: ModelConfig) -> TPRank:
        """Rank 0's TPRank (call on the thread that will step: the GPU group binds to it)."""
        store = None if self.store is None else _group_store(self.store)
        box = self.box if isinstance(self.box, Mailbox) else None
        return TPRank(Shards.plan(model_config, 0, self.launch.size), self.box,
                      _group(0, self.launch, self.cuda, box, store))

    def close(self, timeout_s: float = 5.0) -> None:
        """The followers leave (told by a STOP post before this, or by rank 0's exit); any still there after
        `timeout_s` are killed."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        if self.link is not None:
            self.link.say("the worker stopped")
            self.link.close()
        if self.gate is not None:
            self.gate.close()


def _group(rank: int, launch: Launch, cuda: bool, box: Mailbox | None, store=None) -> ShmGroup | TorchGroup:
    """This rank's collectives: shared memory between CPU ranks of one machine, else torch.distributed, meeting at
    `store` (rank 0's)."""
    if cuda:
        device = torch.device("cuda", launch.base_gpu_id + launch.local(rank))
        torch.cuda.set_device(device)
        return TorchGroup(rank, launch.size, "", launch.timeout_s, device, store)
    if launch.collectives == "torch" or box is None:
        return TorchGroup(rank, launch.size, "", launch.timeout_s, torch.device("cpu"), store)
    return ShmGroup(box, launch.timeout_s)


def _backend(launch: Launch) -> str | None:
    return launch.transfer.backend if launch.transfer is not None else None


def _group_store(store):
    """The process group's keys apart from the posts and the rendezvous."""
    import torch.distributed as dist

    return dist.PrefixStore("group/", store)


def _pin(cpus: set[int], threads: int | None) -> None:
    """This process on `cpus`, with `threads` compute threads (at most one per core; a container's CPU quota is
    not a core set, so --threads is how to stay within it)."""
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(min(threads, len(cpus)) if threads else len(cpus))


_FOLLOWER_ENTRY = "from pdserve.shared.tp_ranks import follower_entry; follower_entry()"


def start_follower(config: RuntimeConfig, rank: int, launch: Launch, path: str = "",
                   store_port: int = 0) -> subprocess.Popen:
    """A follower rank's process: a fresh interpreter, its arguments pickled down a pipe (this process's own
    data, nothing a client or a peer sent). `path`: the mailbox on this machine; none for a worker over several
    machines. `store_port`: where rank 0's store is on loopback (0: none)."""
    env = None
    if launch.nodes is not None:  # quiet the store's notes on each wait that times out while the worker is idle
        env = {**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    proc = subprocess.Popen([sys.executable, "-c", _FOLLOWER_ENTRY], stdin=subprocess.PIPE, env=env)
    try:
        proc.stdin.write(pickle.dumps((config, rank, launch, path, store_port, logging.getLogger().level)))
        proc.stdin.close()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def follower_entry() -> None:
    _die_with_parent()
    _follower_main(*pickle.load(sys.stdin.buffer))


def _follower_main(config: RuntimeConfig, rank: int, launch: Launch, path: str, store_port: int,
                   log_level: int) -> None:
    """A follower rank's process: attach, load this rank's shards, follow rank 0 until it stops or is gone."""
    from pdserve.shared.logs import setup_logging
    from pdserve.shared.model_runner import ModelRunner

    setup_logging(logging.getLevelName(log_level).lower(), with_pid=True)
    cuda = config.device.startswith("cuda")
    if cuda:
        config = replace(config, device=f"cuda:{launch.base_gpu_id + launch.local(rank)}")
    else:
        _pin(launch.cpus[launch.local(rank)], launch.threads)
    try:
        box, group = _attach(rank, launch, cuda, path, store_port)
        mc = ModelConfig.from_dir(config.model_path)
        tp = TPRank(Shards.plan(mc, rank, launch.size), box, group)
        runner = ModelRunner(config, mc, tp=tp)
        follow(tp, runner, launch.transfer)
    except RankGone as exc:
        log.error("%s", exc)
        os._exit(1)
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)
    os._exit(0)


def _attach(rank: int, launch: Launch, cuda: bool, path: str, store_port: int):
    """A follower's mailbox and group: rank 0's shared memory (and its store, for torch.distributed's
    collectives), or across machines its store."""
    store = client_store(store_port, START_TIMEOUT_S, f"127.0.0.1:{store_port}") if store_port else None
    if launch.nodes is None:
        box = Mailbox(path, rank, launch.size, create=False)
        return box, _group(rank, launch, cuda, box, None if store is None else _group_store(store))
    join(store, rank, lambda: None, START_TIMEOUT_S)
    return StoreBox(store, rank, launch.size), _group(rank, launch, cuda, None, _group_store(store))


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # the mailbox's liveness checks still end it

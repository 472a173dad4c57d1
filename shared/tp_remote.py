"""A node other than 0 of a tensor-parallel worker over several machines: `pdserve <role> --nnodes K --node-rank R
--dist-init-addr HOST:PORT` with R > 0 runs no endpoint, only its ranks.

Its life: reach rank 0's rendezvous store through a loopback tunnel to the gate at HOST:PORT (shared/tp_gate.py;
waiting for it to come up), refuse a group already formed without it, link to rank 0's node (shared/tp_link.py:
rank 0 grants its node number), tell its settings, start its ranks as followers (shared/tp_ranks.py, reaching the
store through the same tunnel), then watch both sides. It exits non-zero once the group is gone, so that its supervisor starts it again for the next
one: when rank 0's node is gone (its link closed or silent), when one of its ranks exits (it tells rank 0's node
why, which stops the worker), or when rank 0 stopped the worker. SIGTERM stops its ranks and it exits 0.
"""
from __future__ import annotations

import logging
import signal
import subprocess

from pdserve.shared.config import RuntimeConfig
from pdserve.shared.tp_gate import Tunnel
from pdserve.shared.tp_group import RankGone
from pdserve.shared.tp_link import BEAT_S, Link
from pdserve.shared.tp_nodes import LINK, client_store, refuse_late_node, settings_of, tell_settings
from pdserve.shared.tp_ranks import Launch, start_follower
from pdserve.shared.tp_step import START_TIMEOUT_S

log = logging.getLogger("pdserve.worker")


class _Stop:
    asked = False

    def __call__(self, signum, frame) -> None:
        self.asked = True


def serve_node(config: RuntimeConfig, launch: Launch) -> int:
    """Node launch.nodes.rank's ranks, until the group is gone: the process's exit code."""
    nodes = launch.nodes
    log.info("tensor-parallel %s: this process runs those ranks and serves no endpoint (node 0's worker does)",
             nodes.describe())
    stop = _Stop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    tunnel = None
    try:
        tunnel = Tunnel(nodes.host, nodes.port)
        if (why := tunnel.reach(START_TIMEOUT_S)) is not None:
            raise RankGone(why)
        store = client_store(tunnel.port, START_TIMEOUT_S, f"{nodes.host}:{nodes.port}", lambda: tunnel.refused)
        refuse_late_node(store, nodes)
        link = Link.connect(nodes.host, int(store.get(LINK)), nodes.rank, launch.timeout_s)
        backend = launch.transfer.backend if launch.transfer is not None else None
        tell_settings(store, nodes.rank, settings_of(config, backend))  # rank 0 checks them against its own
    except (RankGone, RuntimeError, ValueError) as exc:  # (torch.distributed's errors are RuntimeErrors)
        log.error("node %d: %s", nodes.rank, exc)
        if tunnel is not None:
            tunnel.close()
        return 1
    procs: dict[int, subprocess.Popen] = {}
    try:
        for r in nodes.local:
            procs[r] = start_follower(config, r, launch, store_port=tunnel.port)
        return _watch(link, procs, stop, nodes.rank)
    finally:
        _end(procs)
        link.close()
        tunnel.close()


def _watch(link: Link, procs: dict[int, subprocess.Popen], stop: _Stop, node: int) -> int:
    while True:
        link.poll(BEAT_S)
        if stop.asked:
            link.say(f"node {node} was asked to stop")
            log.info("node %d: stopping its ranks", node)
            return 0
        for r, proc in procs.items():
            if proc.poll() is None:
                continue
            if proc.returncode == 0:
                log.info("tensor-parallel rank %d left: rank 0 stopped the worker; node %d exits for the next start",
                         r, node)
            else:
                link.say(f"tensor-parallel rank {r} exited (code {proc.returncode}); see node {node}'s log")
                log.error("tensor-parallel rank %d exited (code %d): node %d stops", r, proc.returncode, node)
            return 1
        if link.lost is not None:
            log.error("%s: node %d's ranks stop, for its supervisor to start it again", link.lost, node)
            return 1


def _end(procs: dict[int, subprocess.Popen], timeout_s: float = 5.0) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)

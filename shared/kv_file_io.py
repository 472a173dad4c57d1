"""NixlFileIO: the storage tier's page files moved by NIXL's POSIX plugin, a run of pages per transfer.

Lifecycle: one NIXL agent per process, with the POSIX backend alone (kernel AIO underneath), created by the first
`nixl_file_io()` and shared by every KVFiles of the process (each agent takes a kernel AIO context of its own, and
a host has a few hundred). A transfer registers a staging buffer (DRAM) and the run's open files (FILE: offset 0,
one page file's length, the descriptor), moves every file's bytes to or from its slice of the buffer in one request,
waits for it with a deadline, then releases the request, deregisters both and closes the descriptors.

A transfer that fails or is late raises NixlIOError and the caller does that run with plain file I/O. One that
cannot even be released (the kernel may still write into its buffer) leaves its buffer and descriptors here,
never freed, and turns this object off (`usable` False): every later run is plain file I/O.

Invariant: every NIXL call goes through `self._lock` (the agent is created without internal locking) and the lock
is never held while waiting, so the tier's reader threads and its writer interleave their transfers.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
import uuid
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

NAME = "nixl-posix"
DEADLINE_S = 10.0  # a transfer gets this long, plus its size at SLOWEST_BYTES_PER_S, before it is given up
SLOWEST_BYTES_PER_S = 50e6
SPIN_S = 0.0005  # poll without sleeping this long (a run of pages on a page-cached disk takes ~1-5 ms)


class NixlIOError(Exception):
    """A transfer failed or was late: the run is done with plain file I/O."""


class NixlFileIO:
    name = NAME

    def __init__(self, agent) -> None:
        self._agent = agent
        self._lock = threading.Lock()
        self._stuck: list[tuple[object, list[int]]] = []  # (buffer, descriptors) of requests never released
        self.usable = True

    def read(self, fds: list[int], size: int) -> memoryview:
        """The first `size` bytes of each file, file i at [i * size, (i + 1) * size). Takes the descriptors: they
        are closed when it returns or raises."""
        staging = np.empty(len(fds) * size, dtype=np.uint8)
        self._transfer("READ", fds, staging, size)
        return memoryview(staging)

    def write(self, fds: list[int], data: bytearray, size: int) -> None:
        """Each file's first `size` bytes from `data`, file i from [i * size, (i + 1) * size). Takes the
        descriptors: they are closed when it returns or raises."""
        if len(data) != len(fds) * size:
            raise ValueError(f"{len(fds)} files of {size} bytes, got {len(data)} bytes")
        self._transfer("WRITE", fds, np.frombuffer(data, dtype=np.uint8), size)

    def _transfer(self, op: str, fds: list[int], staging: np.ndarray, size: int) -> None:
        agent, base = self._agent, staging.ctypes.data
        deadline = time.monotonic() + DEADLINE_S + staging.nbytes / SLOWEST_BYTES_PER_S
        dram = files = handle = None
        try:
            with self._lock:
                dram = agent.register_memory([(base, staging.nbytes, 0, "")], "DRAM")
                files = agent.register_memory([(0, size, fd, "") for fd in fds], "FILE")
                local = agent.get_xfer_descs([(base + i * size, size, 0) for i in range(len(fds))], "DRAM")
                handle = agent.initialize_xfer(op, local, files.trim(), agent.name)
                state = agent.transfer(handle)
            spin_until = time.monotonic() + SPIN_S
            while state == "PROC":
                now = time.monotonic()
                if now > deadline:
                    raise NixlIOError(f"{op} of {len(fds)} page files not done in {DEADLINE_S:.0f}+ s")
                if now > spin_until:
                    time.sleep(0.0002)
                with self._lock:
                    state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise NixlIOError(f"{op} of {len(fds)} page files ended in state {state}")
        except NixlIOError:
            raise
        except Exception as exc:  # the bindings raise their own types (nixlBackendError, ...)
            raise NixlIOError(f"{op} of {len(fds)} page files failed: {type(exc).__name__} {exc}") from None
        finally:
            self._release(handle, dram, files, staging, fds)

    def _release(self, handle, dram, files, staging: np.ndarray, fds: list[int]) -> None:
        try:
            with self._lock:
                if handle is not None:
                    handle.release()
                for reg in (files, dram):
                    if reg is not None:
                        self._agent.deregister_memory(reg)
        except Exception as exc:
            self.usable = False
            self._stuck.append((staging, fds))
            log.error("a NIXL file transfer could not be released (%s): its buffer and %d files stay open, and "
                      "the KV storage tier uses plain file I/O from now on", exc, len(fds))
            return
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


class Loaded(NamedTuple):
    io: NixlFileIO | None
    reason: str  # why `io` is None


@functools.cache
def nixl_file_io() -> Loaded:
    """The process's NIXL file I/O, created on the first call; `io` None (and why) when NIXL cannot be imported or
    its POSIX plugin cannot be started."""
    try:
        from nixl._api import nixl_agent, nixl_agent_config
    except ImportError as exc:
        return Loaded(None, f"nixl cannot be imported ({exc})")
    try:
        agent = nixl_agent(f"kv-files-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                           nixl_agent_config(enable_prog_thread=False, backends=[]))
        if "POSIX" not in agent.get_plugin_list():
            return Loaded(None, "NIXL has no POSIX plugin")
        agent.create_backend("POSIX")
    except Exception as exc:
        return Loaded(None, f"NIXL's POSIX backend cannot be started ({type(exc).__name__} {exc})")
    return Loaded(NixlFileIO(agent), "")

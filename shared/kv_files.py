"""KVFiles: the storage tier's directory, where page runs of KV outlive a worker's pool, shared by every worker of
one model that mounts it.

One file per page, named by the page's key (kv_keys.py): a hash chained over the tokens of every page before it
and its own, starting from the identity of what the KV was computed with (`identity`: the model's weights, dtype,
page layout, and the cache namespace: a LoRA adapter's). Two pages share a key only when the same tokens, after the same
prefix, went through the same weights the same way, so a stored page can never answer for another prompt, model
or adapter. Files sit under a directory per identity: a weight update starts a new one, and `flush` makes the old
one unreachable at once (renamed away, deleted in the background).

A file is a header (magic, format version, payload size, a MAC, the key) and the page's bytes. The MAC is keyed
BLAKE3 over the header and payload with the deployment's secret (kv_file_access.py: from the cluster token, else a
key file only the worker's user reads), so a page another user or deployment wrote, or one altered since, is
refused (`refused`), as is anything under a page's name that is not a regular file of this user (a link, a FIFO:
opened without following or blocking). Files are 0600 in 0700 directories (group mode: 0640 and 02770). A file
is written under a temporary name and renamed, so a reader sees a whole file or none; one that is short, torn or
written for another key fails its check on read (`corrupt`). Either way it is deleted and counts as a miss: the
page is computed again, never read wrong. Every I/O error (a full disk, a vanished directory) is a miss or a
skipped write, and a counter, never an exception for the caller. Identities are recorded in the directory, and
one nobody uses any more is deleted whole (kv_identities.py: the pages that go first when the disk is full).

Runs of pages (`read_run`, `write_run`, what the tier uses) go through NIXL's POSIX plugin when NIXL loads
(kv_file_io.py): one transfer per run, every page file's header and payload, the same format, temporary names and
checks as one page at a time. Without NIXL, and for a run whose transfer fails (counted in `io_fallbacks`), plain
file I/O. `io` says which is in use ("nixl-posix" or "file"); `KVFiles(..., io="file")`, or the environment
variable PDSERVE_KV_FILE_IO=file, forces plain file I/O.

The methods do blocking I/O: the engine calls them from its tier threads (kv_tiers.py), never its own.
"""
from __future__ import annotations

import contextlib
import errno
import hmac
import logging
import os
import shutil
import stat
import struct
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.shared.kv_file_access import MAC_BYTES, Access, Refused
from pdserve.shared.kv_file_capacity import Capacity, Limits
from pdserve.shared.kv_file_io import NAME as NIXL, NixlFileIO, NixlIOError, nixl_file_io
from pdserve.shared.kv_identities import IdentityRecords

log = logging.getLogger(__name__)

MAGIC = b"PDKV"
FORMAT = 3  # 1: a BLAKE2b digest, 2: an unkeyed XXH3-128 (such files fail the check: computed again)
HEADER = struct.Struct(f"<4sHxxQ{MAC_BYTES}s32s")  # magic, format, payload bytes, MAC, key (hex)
AUTHENTICATED = struct.Struct("<4sHxxQ32s")  # what the MAC covers of the header: all but itself
REFUSED = "its MAC is not this deployment's"


@dataclass
class FileCounts:
    """What the directory did, for the tier's metrics (read by the engine thread; plain ints, no lock needed)."""

    pages_read: int = 0
    bytes_read: int = 0
    pages_written: int = 0
    bytes_written: int = 0
    corrupt: int = 0  # files that failed their check (deleted)
    refused: int = 0  # files not written by this deployment: a wrong MAC, not a regular file, not ours (deleted)
    errors: int = 0  # reads or writes that failed with an OSError
    io_fallbacks: int = 0  # runs whose NIXL transfer failed, done again with plain file I/O
    by_reason: dict[str, int] = field(default_factory=dict)


class KVFiles:
    def __init__(self, directory: str, page_bytes: int, io: str | None = None, group: bool = False,
                 limits: Limits | None = None) -> None:
        """`io`: "nixl-posix" (the default when NIXL loads) or "file"; None reads PDSERVE_KV_FILE_IO. `group`:
        files shared with the directory's group (kv_file_access.py). `limits`: its size (kv_file_capacity.py)."""
        self.root = Path(directory)
        self.access = Access(self.root, group)
        self.page_bytes = page_bytes
        self.file_bytes = HEADER.size + page_bytes
        self.counts = FileCounts()
        self._nixl: NixlFileIO | None = None
        io = io or os.environ.get("PDSERVE_KV_FILE_IO") or NIXL
        if io not in (NIXL, "file"):
            raise ValueError(f"KV file I/O (PDSERVE_KV_FILE_IO) is {NIXL!r} or 'file', got {io!r}")
        why = "io='file' or PDSERVE_KV_FILE_IO=file"
        if io == NIXL:
            self._nixl, why = nixl_file_io()
        if self._nixl is not None:
            log.info("KV storage tier %s: page runs through NIXL's POSIX plugin, one transfer per run", directory)
        else:
            log.info("KV storage tier %s: plain file I/O (%s)", directory, why)
        self._identity = ""
        self._lock = threading.Lock()  # guards `_identity` against a flush renaming its directory
        self.capacity = Capacity(self.root, self.file_bytes, limits or Limits())
        self.records = IdentityRecords(self.root, self.access)  # a start error when PDSERVE_KV_RETAIN_HOURS is not a number

    @classmethod
    def for_tier(cls, config, page_bytes: int) -> KVFiles:
        """The storage tier of a TierConfig (config.py): its directory, modes and limits."""
        return cls(config.storage_dir, page_bytes, group=config.storage_group_access,
                   limits=Limits(config.storage_max_bytes, config.storage_min_free_bytes, config.storage_eviction_ratio))

    @staticmethod
    def check_directory(directory: str) -> None:
        """Raise ValueError naming the problem when `directory` cannot be created or written (a start error)."""
        root = Path(directory)
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
            probe = root / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"ok")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"--hicache-storage-dir {directory!r} cannot be used: {exc.strerror or exc}") from None

    def use(self, identity: str, about: dict | None = None, model_path: str = "") -> None:
        """Read and write under `identity` from now on (at start, and after a weight update); what it was computed
        from (`about`, kv_keys.py) and `model_path` go into its record."""
        with self._lock:
            self._identity = identity
        self.access.tighten(self.root / identity)
        self.capacity.use(identity)
        self.records.use(identity, about or {}, model_path)

    @property
    def identity(self) -> str:
        return self._identity

    def _path(self, key: str) -> Path:
        return self.root / self._identity / key[:2] / f"{key}.kv"

    def contains(self, key: str) -> bool:
        try:
            return stat.S_ISREG(self._path(key).lstat().st_mode)
        except OSError:
            return False

    @property
    def io(self) -> str:
        """Which I/O moves page runs: "nixl-posix" or "file"."""
        return NIXL if self._nixl is not None and self._nixl.usable else "file"

    def read(self, key: str) -> bytes | None:
        """The page stored under `key`, or None (absent, or failed its check: then deleted)."""
        path = self._path(key)
        try:
            fd, _ = self.access.open_checked(path)
        except FileNotFoundError:
            return None
        except Refused as exc:
            self._refuse(path, str(exc))
            return None
        except OSError as exc:
            self._count_error("read", exc)
            return None
        try:
            with open(fd, "rb", closefd=True) as f:
                data = f.read(self.file_bytes + 1)
        except OSError as exc:
            self._count_error("read", exc)
            return None
        return self._accept(data, key, path)

    def _refuse(self, path: Path, why: str) -> None:
        self.counts.refused += 1
        if self.counts.refused in (1, 100, 10000):
            log.warning("stored KV page %s refused (%s; x%d): not written by this deployment, deleted", path, why,
                        self.counts.refused)
        self.capacity.removed(path)
        with contextlib.suppress(OSError):
            path.unlink()

    def _accept(self, data: bytes | memoryview, key: str, path: Path) -> bytes | None:
        """The page in `data` (a whole file's bytes), or None when it fails its check (then the file is deleted)."""
        try:
            problem = self._check(data, key)
        except OSError as exc:  # the MAC's key file cannot be had
            self._count_error("read", exc)
            return None
        if problem == REFUSED:
            self._refuse(path, problem)
            return None
        if problem is not None:
            self.counts.corrupt += 1
            log.warning("stored KV page %s is unusable (%s): deleted, the page is computed again", path, problem)
            self.capacity.removed(path)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        self.counts.pages_read += 1
        self.counts.bytes_read += self.page_bytes
        self.capacity.used(path)
        return bytes(data[HEADER.size:])

    def _check(self, data: bytes | memoryview, key: str) -> str | None:
        if len(data) < HEADER.size:
            return "truncated header"
        magic, fmt, size, mac, stored_key = HEADER.unpack_from(data)
        if magic != MAGIC or fmt != FORMAT:
            return "not a page file of this format"
        if size != self.page_bytes or len(data) != HEADER.size + size:
            return f"{len(data) - HEADER.size} bytes where {self.page_bytes} belong"
        if stored_key.decode("ascii", "replace") != key:
            return "written for another key"
        auth = AUTHENTICATED.pack(magic, fmt, size, stored_key)
        if not hmac.compare_digest(self.access.mac(auth, data[HEADER.size:]), mac):
            return REFUSED
        return None

    def read_run(self, keys: list[str]) -> list[bytes]:
        """The pages stored under `keys`, in order, up to the first one absent or failing its check (that file is
        deleted, as by `read`). With NIXL, one transfer reads every file of the run of the right length."""
        self.records.touch()
        if self._nixl is None or not self._nixl.usable:
            return self._read_plain(keys)
        opened: list[tuple[str, Path, int]] = []
        tail = None  # a file of the wrong length ending the run: `read` checks, counts and deletes it
        for key in keys:
            path = self._path(key)
            try:
                fd, size = self.access.open_checked(path)
            except FileNotFoundError:
                break
            except Refused as exc:
                self._refuse(path, str(exc))
                break
            except OSError as exc:
                self._count_error("read", exc)
                break
            if size != self.file_bytes:
                os.close(fd)
                tail = key
                break
            opened.append((key, path, fd))
        pages: list[bytes] = []
        if opened:
            try:
                data = self._nixl.read([fd for _, _, fd in opened], self.file_bytes)
            except NixlIOError as exc:
                self._fell_back(exc)
                return self._read_plain(keys)
            size = self.file_bytes
            for i, (key, path, _) in enumerate(opened):
                page = self._accept(data[i * size:(i + 1) * size], key, path)
                if page is None:
                    return pages
                pages.append(page)
        if tail is not None:
            page = self.read(tail)
            pages += [page] if page is not None else []
        return pages

    def _read_plain(self, keys: list[str]) -> list[bytes]:
        pages = []
        for key in keys:
            page = self.read(key)
            if page is None:
                break
            pages.append(page)
        return pages

    def write_run(self, keys: list[str], payloads: list[bytes | memoryview]) -> list[bool]:
        """Store each page under its key (`write`, for a run); whether each was. With NIXL, one transfer writes
        every page not stored yet, each under a temporary name renamed once written."""
        self.records.touch()
        for payload in payloads:
            if len(payload) != self.page_bytes:
                raise ValueError(f"a page is {self.page_bytes} bytes, got {len(payload)}")
        if self._nixl is None or not self._nixl.usable:
            return [self.write(key, payload) for key, payload in zip(keys, payloads)]
        ok = [True] * len(keys)
        todo: list[tuple[int, Path, Path, int]] = []  # (index, path, temporary path, descriptor)
        for i, key in enumerate(keys):
            path = self._path(key)
            if self.contains(key):
                continue
            tmp = self._temporary(path)
            try:
                self.access.makedirs(path.parent)
                todo.append((i, path, tmp, self.access.create(tmp)))
            except OSError as exc:
                self._count_error("write", exc)
                ok[i] = False
        if not todo:
            return ok
        size = self.file_bytes
        data = bytearray(len(todo) * size)
        view = memoryview(data)
        try:
            for n, (i, _, _, _) in enumerate(todo):
                view[n * size:n * size + HEADER.size] = self._header(keys[i], payloads[i])
                view[n * size + HEADER.size:(n + 1) * size] = memoryview(payloads[i]).cast("B")
            self._nixl.write([fd for _, _, _, fd in todo], data, size)
        except OSError as exc:  # the MAC's key file cannot be had: every page of the run is a skipped write
            self._count_error("write", exc)
            for i, _, tmp, fd in todo:
                with contextlib.suppress(OSError):
                    os.close(fd)
                    tmp.unlink()
                ok[i] = False
            return ok
        except NixlIOError as exc:
            self._fell_back(exc)
            for i, _, tmp, _ in todo:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                ok[i] = self.write(keys[i], payloads[i])
            return ok
        for i, path, tmp, _ in todo:
            try:
                os.replace(tmp, path)
            except OSError as exc:
                self._count_error("write", exc)
                with contextlib.suppress(OSError):
                    tmp.unlink()
                ok[i] = False
                continue
            self.counts.pages_written += 1
            self.counts.bytes_written += self.page_bytes
            self.capacity.added(path)
        return ok

    def _header(self, key: str, payload: bytes | memoryview) -> bytes:
        stored_key = key.encode("ascii")
        mac = self.access.mac(AUTHENTICATED.pack(MAGIC, FORMAT, len(payload), stored_key), payload)
        return HEADER.pack(MAGIC, FORMAT, len(payload), mac, stored_key)

    @staticmethod
    def _temporary(path: Path) -> Path:
        return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")

    def _fell_back(self, exc: NixlIOError) -> None:
        self.counts.io_fallbacks += 1
        if self.counts.io_fallbacks in (1, 100, 10000):
            log.warning("KV storage tier: a NIXL transfer failed (x%d), the run is done with plain file I/O: %s",
                        self.counts.io_fallbacks, exc)

    def write(self, key: str, payload: bytes | memoryview) -> bool:
        """Store one page under `key` (skipped when a file is there already); False when it could not be."""
        if len(payload) != self.page_bytes:
            raise ValueError(f"a page is {self.page_bytes} bytes, got {len(payload)}")
        path = self._path(key)
        if self.contains(key):
            return True
        tmp = self._temporary(path)
        try:
            header = self._header(key, payload)  # an OSError when the MAC's key file cannot be had
            self.access.makedirs(path.parent)
            with open(self.access.create(tmp), "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as exc:
            self._count_error("write", exc)
            with contextlib.suppress(OSError):
                tmp.unlink()
            return False
        self.counts.pages_written += 1
        self.counts.bytes_written += len(payload)
        self.capacity.added(path)
        return True

    def flush(self) -> None:
        """Make every page stored under the current identity unreachable now; the files go in the background."""
        with self._lock:
            current = self.root / self._identity
            if not self._identity or not current.exists():
                return
            trash = self.root / f".flushed-{uuid.uuid4().hex}"
            try:
                os.replace(current, trash)
            except OSError as exc:
                self._count_error("flush", exc)
                return
        self.capacity.use(self._identity)
        threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                         name="kv-files-flush", daemon=True).start()

    def occupancy(self) -> tuple[int, int]:
        """(pages, bytes) stored under the current identity: counted by a walk of the directory on a thread of its
        own (the caller, the engine thread or a scrape, never waits on one), and by every write and eviction since.
        (0, 0) until the first walk is in, and right after a flush."""
        self.records.touch()
        return self.capacity.occupancy()

    def _count_error(self, what: str, exc: OSError) -> None:
        self.counts.errors += 1
        if exc.errno == errno.ENOSPC:
            self.records.make_room()
        reason = f"{what}: {exc.strerror or type(exc).__name__}"
        self.counts.by_reason[reason] = self.counts.by_reason.get(reason, 0) + 1
        if self.counts.by_reason[reason] in (1, 100, 10000):  # the first of each kind, then rarely
            log.warning("KV storage tier %s failed (%s x%d): %s", what, self.root, self.counts.by_reason[reason], exc)


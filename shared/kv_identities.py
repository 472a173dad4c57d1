"""The storage directory's record of the KV identities stored in it, and how long an unused one's pages stay.

Every identity (kv_keys.py: the weights' digest, the kernels as resolved, the page layout ...) has its pages under
`<directory>/<key>/` and a record in `<directory>/identities/<key>.json`, for an operator sharing one directory
among deployments to read: the identity itself, the model paths it was served from, the hosts (pod names) that
used it and when, its first and last use. Each worker using an identity rewrites its record at start, on a
weight update and every TOUCH_EVERY_S while it reads, writes or is scraped (a whole file renamed into place:
two workers at once lose at most one of their updates, and the next rewrite restores it).

An identity nobody used for PDSERVE_KV_RETAIN_HOURS (default a week; `0` keeps every identity) is deleted whole,
pages and record, by any worker on the directory (at start, on a weight update, then hourly). When the disk is
full, identities other than the worker's own that nobody used for PRESSED_UNUSED_S go at once, least recently
used first: a deployment's live pages are never deleted to make room for another's. A directory of pages with
no record (written before records were kept) counts as used when a page was last added to it. Deleting is a
rename (the pages become unreachable at once) and a removal in the background, as a flush does (kv_files.py).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path

log = logging.getLogger(__name__)

RECORDS = "identities"
TOUCH_EVERY_S = 600.0  # a worker using an identity rewrites its record at most this often
SWEEP_EVERY_S = 3600.0
PRESSED_UNUSED_S = 3600.0  # with the disk full, identities unused this long go, whoever's they are
KEEP_PATHS = 8  # model paths and hosts kept in a record (the most recent)
_KEY = re.compile(r"[0-9a-f]{32}")


def retain_s() -> float:
    """How long an unused identity's pages stay: PDSERVE_KV_RETAIN_HOURS (default 168; 0: forever)."""
    raw = os.environ.get("PDSERVE_KV_RETAIN_HOURS", "168")
    try:
        hours = float(raw)
    except ValueError:
        hours = -1.0
    if not hours >= 0:
        raise ValueError(f"PDSERVE_KV_RETAIN_HOURS must be a number of hours >= 0 (0: forever), got {raw!r}")
    return hours * 3600.0


class IdentityRecords:
    """One worker's upkeep of the records (kv_files.py holds one per directory): its identity recorded at `use`
    and again at most every TOUCH_EVERY_S (`touch`, from its reads, writes and counts: on a thread of its own),
    a sweep of identities past the retention time at `use` and at most every SWEEP_EVERY_S, and one of those
    unused for PRESSED_UNUSED_S when the disk is full (`make_room`, at most once a minute)."""

    def __init__(self, root: Path, access=None) -> None:
        self.root = root
        self.access = access  # kv_file_access.Access: the records' modes (None: the umask's)
        self.retain_s = retain_s()
        self._current: tuple[str, dict, str] = ("", {}, "")  # key, identity, model path: replaced whole
        self._touched = self._swept = self._pressed = -SWEEP_EVERY_S  # monotonic

    def use(self, key: str, about: dict, model_path: str) -> None:
        self._current = (key, dict(about), model_path)
        self._keep(sweep_too=True)

    def touch(self) -> None:
        now = time.monotonic()
        if now - self._touched >= TOUCH_EVERY_S:
            self._touched = now
            threading.Thread(target=self._keep, args=(now - self._swept >= SWEEP_EVERY_S,),
                             name="kv-files-records", daemon=True).start()

    def make_room(self) -> None:
        if time.monotonic() - self._pressed >= 60.0:
            self._pressed = time.monotonic()
            sweep(self.root, self._current[0], PRESSED_UNUSED_S)

    def _keep(self, sweep_too: bool) -> None:
        self._touched = time.monotonic()
        key, about, model_path = self._current
        record_use(self.root, key, about, model_path, self.access)
        if sweep_too:
            self._swept = time.monotonic()
            sweep(self.root, key, self.retain_s)


def record_use(root: Path, key: str, identity: dict, model_path: str = "", access=None) -> None:
    """Say in the directory that this host uses `identity` (under `key`) now, from `model_path`."""
    path = root / RECORDS / f"{key}.json"
    now = _stamp(time.time())
    record = read_record(path) or {"key": key, "first_used": now}
    paths = [p for p in record.get("model_paths", []) if p != model_path] + ([model_path] if model_path else [])
    hosts = {h: t for h, t in record.get("hosts", {}).items() if h != socket.gethostname()}
    hosts[socket.gethostname()] = now
    record.update(key=key, weights=identity.get("weights"), kernels=identity.get("kernels"), identity=identity,
                  model_paths=paths[-KEEP_PATHS:], hosts=dict(sorted(hosts.items(), key=lambda h: h[1])[-KEEP_PATHS:]),
                  last_used=now)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        text = json.dumps(record, indent=1, sort_keys=True) + "\n"
        if access is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(text)
        else:  # the records name model paths and hosts: as private as the pages
            access.makedirs(path.parent)
            with open(access.create(tmp), "w") as f:
                f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        log.info("KV storage tier: the record of identity %s could not be written: %s", key, exc)
        with contextlib.suppress(OSError):
            tmp.unlink()


def read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def records(root: Path) -> list[dict]:
    """Every identity's record in the directory, least recently used first (what an operator reads)."""
    found = [read_record(p) for p in (root / RECORDS).glob("*.json")]
    return sorted((r for r in found if r is not None), key=lambda r: r.get("last_used", ""))


def last_used(root: Path, key: str) -> float:
    """When `key` was last used (epoch seconds): its record's, else when a page was last added under it."""
    record = read_record(root / RECORDS / f"{key}.json")
    with contextlib.suppress(KeyError, TypeError, ValueError):
        return datetime.fromisoformat(record["last_used"]).timestamp()
    newest = 0.0
    with contextlib.suppress(OSError):
        directory = root / key
        newest = directory.stat().st_mtime
        for sub in directory.iterdir():
            with contextlib.suppress(OSError):
                newest = max(newest, sub.stat().st_mtime)
    return newest


def sweep(root: Path, keep: str, unused_s: float) -> list[str]:
    """Delete every identity but `keep` unused for `unused_s` seconds, least recently used first; the keys
    deleted. Its pages become unreachable at once; the files go on a thread of their own."""
    if unused_s <= 0:
        return []
    try:
        keys = {p.name for p in root.iterdir() if _KEY.fullmatch(p.name)}
        keys |= {p.stem for p in (root / RECORDS).glob("*.json") if _KEY.fullmatch(p.stem)}
    except OSError:
        return []
    now = time.time()
    stale = sorted((used, key) for key in keys - {keep} if now - (used := last_used(root, key)) >= unused_s)
    removed, trashed = [], set()
    for _, key in stale:
        trash = root / f".flushed-{uuid.uuid4().hex}"
        try:
            if (root / key).exists():
                os.replace(root / key, trash)
            (root / RECORDS / f"{key}.json").unlink(missing_ok=True)
        except OSError as exc:
            log.info("KV storage tier: identity %s could not be removed: %s", key, exc)
            continue
        removed.append(key)
        if trash.exists():
            trashed.add(trash.name)
            threading.Thread(target=shutil.rmtree, args=(trash,), kwargs={"ignore_errors": True},
                             name="kv-files-sweep", daemon=True).start()
    for leftover in root.glob(".flushed-*"):  # a worker that died deleting them left these behind
        with contextlib.suppress(OSError):
            if leftover.name not in trashed and now - leftover.stat().st_mtime >= PRESSED_UNUSED_S:
                threading.Thread(target=shutil.rmtree, args=(leftover,), kwargs={"ignore_errors": True},
                                 name="kv-files-sweep", daemon=True).start()
    if removed:
        log.info("KV storage tier %s: removed %d identities nobody used for %.0f h: %s", root, len(removed),
                 unused_s / 3600, ", ".join(removed))
    return removed


def _stamp(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def directory_id(root: Path, access=None) -> str:
    """The storage directory's id, from the file the first worker there wrote (linked into place, so two workers
    starting at once agree; with `access`, kv_file_access.Access, in the tier's file mode); its path where the
    file cannot be had."""
    marker = root / ".pdserve-directory"
    try:
        root.mkdir(parents=True, exist_ok=True)
        if not marker.exists():
            tmp = root / f".pdserve-directory.{uuid.uuid4().hex}"
            if access is None:
                tmp.write_text(uuid.uuid4().hex)
            else:
                with open(access.create(tmp), "w") as f:
                    f.write(uuid.uuid4().hex)
            try:
                os.link(tmp, marker)
            except FileExistsError:
                pass  # another worker's is there first
            finally:
                tmp.unlink()
        return marker.read_text().strip()
    except OSError:
        return str(root.resolve())

"""The digest of a checkpoint's weights: a hash of every byte the loader reads (config.json and each
*.safetensors file), so two checkpoints share a digest only when they hold the same weights, wherever they are
mounted and whatever they are called.

Each file is hashed once with XXH3-128 (memory speed: the default model's 260 MB take a fraction of a second
from the page cache) and its digest cached under the file's name, size, mtime, ctime and inode: a file
rewritten, replaced or copied in changes at least one of them and is hashed again; an unchanged one costs a
`stat`. A file changed less than RACY_S before it was hashed is not cached (its next change could fall in the
same tick of the file system's clock and leave the stat as it was). The cache is a small JSON file beside the
model (`.pdserve-weights.json`) where that can be written, else under the user's cache directory
(PDSERVE_CACHE_DIR, ~/.cache/pdserve/weights/), so a model mounted read-only is hashed once per machine. Both are
read: a cache that a writable copy left beside a model mounted read-only counts too, entry by entry, where an
entry matches its file's stat. A cache that cannot be read or written is skipped: the files are hashed again,
never trusted unhashed.

No content hash a checkpoint carries is taken instead (a hub cache's blob names, a shard index): nothing checks
that the bytes still match it, and hashing them costs about as much as reading them once.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
import uuid
from pathlib import Path

import xxhash

log = logging.getLogger(__name__)

CACHE_NAME = ".pdserve-weights.json"
FORMAT = 1
CHUNK = 16 << 20  # bytes read per call while hashing a file
RACY_S = 2.0


def weight_files(model_path: Path) -> list[Path]:
    """What the loader reads (shared/models/llama.py, shared/weights.py): config.json and every *.safetensors
    file, in a fixed order. A single file (a GGUF checkpoint given as such) is its own list."""
    if not model_path.is_dir():
        return [model_path]
    config = model_path / "config.json"
    return ([config] if config.is_file() else []) + sorted(model_path.glob("*.safetensors"))


def weights_digest(model_path: str | os.PathLike) -> str:
    """32 hex digits naming every byte of the checkpoint's weights (see the module docstring). A path that does
    not exist is a name, which is all there is to go by."""
    root = Path(model_path)
    if not root.exists():
        return hashlib.blake2b(f"name:{model_path}".encode(), digest_size=16).hexdigest()
    files = weight_files(root)
    directory = root if root.is_dir() else root.parent
    cache = _Cache(directory)
    whole = hashlib.blake2b(digest_size=16)
    hashed, started = 0, time.monotonic()
    for path in files:
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        digest = cache.get(path.name, stamp)
        if digest is None:
            digest = file_digest(path)
            if time.time() - max(st.st_mtime, st.st_ctime) >= RACY_S:
                cache.put(path.name, stamp, digest)
            hashed += st.st_size
        whole.update(f"{path.name}\0{st.st_size}\0{digest}\n".encode())
    if hashed:
        log.info("weights of %s hashed: %.0f MB in %.2f s", model_path, hashed / 1e6, time.monotonic() - started)
    cache.save()
    return whole.hexdigest()


def file_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


class _Cache:
    """The digests known for the files of one directory: read from beside it, else the user's cache."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory.resolve()
        self.paths = [self.directory / CACHE_NAME, _user_cache(self.directory)]  # where to write, in order
        self.entries: dict[str, dict] = {}
        self.changed = False
        for path in reversed(self.paths):
            self.entries.update(_read(path))

    def get(self, name: str, stamp: list[int]) -> str | None:
        entry = self.entries.get(name)
        return entry["xxh3_128"] if entry is not None and entry.get("stat") == stamp else None

    def put(self, name: str, stamp: list[int], digest: str) -> None:
        self.entries[name] = {"stat": stamp, "xxh3_128": digest}
        self.changed = True

    def save(self) -> None:
        if not self.changed:
            return
        data = {"format": FORMAT, "directory": str(self.directory), "stat": ["size", "mtime_ns", "ctime_ns", "inode"],
                "files": self.entries}
        for path in self.paths:
            tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, path)
                return
            except OSError as exc:  # a read-only model: the next place; none: hashed again next time
                log.info("the weights' digests could not be cached at %s: %s", path, exc)
                with contextlib.suppress(OSError):
                    tmp.unlink()


def _user_cache(directory: Path) -> Path:
    from pdserve.shared.model_files import cache_root

    name = hashlib.blake2b(str(directory).encode(), digest_size=8).hexdigest()
    return cache_root() / "weights" / f"{directory.name}-{name}.json"


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("files"), dict):
        return {}
    return {name: entry for name, entry in data["files"].items() if isinstance(entry, dict)}

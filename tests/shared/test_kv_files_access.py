"""The storage tier's files under a hostile local user: private modes, planted pages, FIFOs, links, other owners."""
from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from pdserve.shared.kv_files import HEADER, KVFiles
from pdserve.shared.kv_keys import chain_keys, identity_key

PAGE = 4096
try:
    import nixl._api  # noqa: F401
    IO_PATHS = ["file", "nixl-posix"]
except ImportError:
    IO_PATHS = ["file"]


def stored(directory: Path, io: str = "file", pages: int = 3, **kwargs) -> tuple[KVFiles, list[str], list[bytes]]:
    files = KVFiles(str(directory), page_bytes=PAGE, io=io, **kwargs)
    files.use(identity_key({"model": "m"}), {"model": "m"})
    keys = chain_keys(files.identity, [(i, i + 1) for i in range(pages)])
    payloads = [os.urandom(PAGE) for _ in keys]
    assert files.write_run(keys, payloads) == [True] * pages
    return files, keys, payloads


def modes(root: Path) -> set[tuple[str, int]]:
    return {("d" if p.is_dir() else "f", stat.S_IMODE(p.stat().st_mode)) for p in root.rglob("*")}


@pytest.mark.parametrize("io", IO_PATHS)
def test_files_are_private_to_the_user_whatever_the_umask(tmp_path, io):
    old = os.umask(0o000)
    try:
        stored(tmp_path / "kv", io)
    finally:
        os.umask(old)
    assert modes(tmp_path / "kv") == {("d", 0o700), ("f", 0o600)}  # pages, records, the MAC key alike
    assert stat.S_IMODE((tmp_path / "kv").stat().st_mode) == 0o700


def test_group_mode_shares_with_the_group_only(tmp_path):
    old = os.umask(0o077)
    try:
        stored(tmp_path / "kv", group=True)
    finally:
        os.umask(old)
    assert modes(tmp_path / "kv") == {("d", 0o2770), ("f", 0o640)}


@pytest.mark.parametrize("io", IO_PATHS)
def test_a_page_written_without_the_deployments_key_is_refused_and_counted(tmp_path, io, monkeypatch):
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "ours")
    files, keys, payloads = stored(tmp_path, io)
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "theirs")
    forger, _, _ = stored(tmp_path / "elsewhere", io)  # a well-formed page file, with another key
    forged = bytearray(forger._path(keys[1]).read_bytes()) if forger.identity == files.identity else None
    assert forged is not None
    forged[HEADER.size:] = bytes(PAGE)  # zeroed pages, as an attacker would plant
    forged[:HEADER.size] = forger._header(keys[1], bytes(PAGE))
    files._path(keys[1]).write_bytes(forged)
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN", "ours")
    assert files.read_run(keys) == payloads[:1]
    assert files.counts.refused == 1 and files.counts.corrupt == 0 and not files._path(keys[1]).exists()
    assert files.read(keys[2]) == payloads[2]


def test_without_a_token_the_directorys_key_file_is_the_secret(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN_FILE", raising=False)
    files, keys, payloads = stored(tmp_path)
    other = KVFiles(str(tmp_path), page_bytes=PAGE, io="file")  # a second worker on the directory: same key
    other.use(files.identity)
    assert other.read_run(keys) == payloads
    (tmp_path / ".pdserve-storage-key").unlink()  # a new key: what was written before is another deployment's
    fresh = KVFiles(str(tmp_path), page_bytes=PAGE, io="file")
    fresh.use(files.identity)
    assert fresh.read_run(keys) == [] and fresh.counts.refused == 1


def read_within(files: KVFiles, keys: list[str], seconds: float = 10.0) -> list[bytes]:
    got: list = []
    reader = threading.Thread(target=lambda: got.append(files.read_run(keys)), daemon=True)
    reader.start()
    reader.join(seconds)
    assert not reader.is_alive(), "the read blocked"
    return got[0]


@pytest.mark.parametrize("io", IO_PATHS)
@pytest.mark.parametrize("plant", ["fifo", "symlink", "directory"])
def test_a_planted_fifo_or_link_is_skipped_without_blocking(tmp_path, io, plant):
    files, keys, payloads = stored(tmp_path, io)
    target = files._path(keys[1])
    target.unlink()
    if plant == "fifo":
        os.mkfifo(target, 0o600)
    elif plant == "symlink":
        os.symlink(files._path(keys[2]), target)  # a valid page file, reached through a link
    else:
        target.mkdir()
    assert read_within(files, keys) == payloads[:1]
    assert files.counts.refused == 1
    assert not files.contains(keys[1])
    assert read_within(files, keys[2:]) == payloads[2:]


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_page_file_of_another_user_is_refused(tmp_path):
    files, keys, payloads = stored(tmp_path)
    os.chown(files._path(keys[0]), 4321, 4321)
    assert files.read(keys[0]) is None and files.counts.refused == 1
    os.chmod(files._path(keys[1]), 0o602)  # ours, but anyone may write it
    assert files.read(keys[1]) is None and files.counts.refused == 2
    assert files.read(keys[2]) == payloads[2]


def test_directories_an_earlier_version_left_open_are_made_private_at_start(tmp_path):
    files, keys, _ = stored(tmp_path)
    opened = [tmp_path, tmp_path / "identities", tmp_path / files.identity, files._path(keys[0]).parent]
    for path in opened:
        path.chmod(0o755)  # what the umask gave before
    stored(tmp_path)
    assert {stat.S_IMODE(p.stat().st_mode) for p in opened} == {0o700}


def test_a_token_file_that_cannot_be_read_skips_writes_and_misses_reads(tmp_path, monkeypatch):
    monkeypatch.delenv("PDSERVE_CLUSTER_TOKEN", raising=False)
    monkeypatch.setenv("PDSERVE_CLUSTER_TOKEN_FILE", str(tmp_path / "no-such-token"))
    files = KVFiles(str(tmp_path / "kv"), page_bytes=PAGE, io="file")
    files.use(identity_key({"model": "m"}))
    [key] = chain_keys(files.identity, [(1,)])
    assert files.write(key, bytes(PAGE)) is False and files.read(key) is None
    assert files.counts.errors == 1 and not files.contains(key)


@pytest.mark.parametrize("plant", ["symlink", "foreign"])
def test_an_identity_directory_planted_by_someone_else_is_moved_aside(tmp_path, plant):
    if plant == "foreign" and os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    identity = identity_key({"model": "m"})
    elsewhere = tmp_path / "attacker"
    elsewhere.mkdir()
    (tmp_path / "kv").mkdir()
    if plant == "symlink":
        os.symlink(elsewhere, tmp_path / "kv" / identity)
    else:
        (tmp_path / "kv" / identity).mkdir(mode=0o777)
        os.chown(tmp_path / "kv" / identity, 4321, 4321)
    files, keys, payloads = stored(tmp_path / "kv")
    assert files.identity == identity and not list(elsewhere.iterdir())  # nothing written through the link
    target = tmp_path / "kv" / identity
    assert not target.is_symlink() and target.stat().st_uid == os.geteuid()
    assert files.read_run(keys) == payloads

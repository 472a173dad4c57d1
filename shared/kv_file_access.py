"""Who may read the storage tier's files, and how a page file proves this deployment wrote it.

Modes: by default every directory the tier creates is 0700 and every file 0600, whatever the umask: pages hold
the KV of other clients' prompts (and whether a prompt is stored says it was sent). `group=True`
(--hicache-storage-group-access) is for workers of one deployment running as different users of one group:
directories 02770 (setgid, so what is created inside keeps the group), files 0640; nothing is ever given to
others.

Reading: a page file is opened without following links and without blocking (O_NOFOLLOW | O_NONBLOCK: a FIFO
planted under a key opens at once and is refused, never waited on), then must be a regular file owned by this
user (in group mode: or by the group), not writable by others. Anything else is `Refused`.

The MAC: every page file carries keyed BLAKE3 over its header (magic, format, size, key) and payload, so a page
written by anyone without the deployment's secret is refused, however well formed. BLAKE3 is a cryptographic
hash (XXH3, the checksum of format 2, is not collision-resistant: a MAC over it is forgeable) and runs at a few
GB/s per core, about the speed of the page I/O it guards. The secret is derived from the cluster token
(cluster_auth.py) when the deployment has one: every worker of the deployment holds it, and no file in the
directory reveals it. Without a token, a random 32-byte key in `<directory>/.pdserve-storage-key`, created 0600
(0640 in group mode) by the first worker and linked into place so that workers starting together agree. That key
is as private as the pages themselves: a user who cannot read the pages cannot read it either, so cannot forge
one; a user who can read it can already read the pages (and is the worker's own user or group). A directory
shared by two deployments with different tokens or keys refuses each other's pages.
"""
from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import uuid
from pathlib import Path

import blake3

from pdserve.shared.cluster_auth import TokenError, cluster_token

log = logging.getLogger(__name__)
KEY_FILE = ".pdserve-storage-key"
MAC_BYTES = 32
_DERIVE = "pdserve 2026 KV storage tier page MAC"  # BLAKE3 key-derivation context: this use of the token only


class Refused(OSError):
    """A file under a page's name that the tier does not read (a link, a FIFO, another user's file, ...)."""


class Access:
    """The modes a directory's files are created with, the checks they are read under and the MAC key."""

    def __init__(self, root: Path, group: bool = False) -> None:
        self.root = root
        self.group = group
        self.dir_mode = 0o2770 if group else 0o700
        self.file_mode = 0o640 if group else 0o600
        self._key: bytes | None = None

    @property
    def key(self) -> bytes:
        """The MAC key: from the cluster token, else the directory's key file (created at first use)."""
        if self._key is None:
            try:
                token = cluster_token()
            except TokenError as exc:  # an I/O error like the others: the write skipped, the read a miss
                raise OSError(str(exc)) from None
            self._key = blake3.blake3(token.encode(), derive_key_context=_DERIVE).digest() if token \
                else self._key_file()
        return self._key

    def _key_file(self) -> bytes:
        path = self.root / KEY_FILE
        self.makedirs(self.root)
        try:
            return self._read_key(path)
        except FileNotFoundError:
            pass
        tmp = self.root / f".{KEY_FILE}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self.file_mode)
        try:
            os.fchmod(fd, self.file_mode)
            os.write(fd, os.urandom(MAC_BYTES))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another worker's key is there first: every worker uses that one
        finally:
            tmp.unlink()
        return self._read_key(path)

    def _read_key(self, path: Path) -> bytes:
        fd, _ = self.open_checked(path)
        try:
            key = os.read(fd, MAC_BYTES + 1)
        finally:
            os.close(fd)
        if len(key) != MAC_BYTES:
            raise Refused(f"{path} is not a key of {MAC_BYTES} bytes")
        return key

    def mac(self, auth: bytes, payload: bytes | memoryview) -> bytes:
        """Keyed BLAKE3 of a header's authenticated fields and the payload."""
        h = blake3.blake3(auth, key=self.key)
        h.update(payload)
        return h.digest()

    def open_checked(self, path: Path) -> tuple[int, int]:
        """A descriptor of `path` for reading and the file's size; Refused when it is not a regular file this
        deployment owns (FileNotFoundError when absent)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise Refused("a symbolic link") from None
            raise
        try:
            st = os.fstat(fd)
            self.check(st)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def check(self, st: os.stat_result) -> None:
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file")
        ours = st.st_uid == os.geteuid() or (self.group and st.st_gid in {os.getegid(), *os.getgroups()})
        if not ours:
            raise Refused(f"owned by uid {st.st_uid}")
        if st.st_mode & 0o002:
            raise Refused("writable by other users")

    def makedirs(self, path: Path) -> None:
        """Create `path` and its missing parents below the root with the tier's directory mode (the umask
        cannot widen or narrow it)."""
        missing = []
        while not path.is_dir():
            missing.append(path)
            if path == self.root or path.parent == path:
                break
            path = path.parent
        for directory in reversed(missing):
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, self.dir_mode)
                os.chmod(directory, self.dir_mode)

    def tighten(self, directory: Path) -> None:
        """Give the root, the records and `directory` (an identity's) with its subdirectories the tier's mode
        where this user owns them: a directory an earlier version created whatever the umask gave (0755: its
        listing, the pages' keys, for anyone to read) is private from the next start on."""
        self._claim(directory)
        subdirs = []
        with contextlib.suppress(OSError):
            subdirs = [p for p in directory.iterdir() if p.is_dir() and not p.is_symlink()]
        for path in (self.root, self.root / "identities", directory, *subdirs):
            with contextlib.suppress(OSError):
                st = path.lstat()
                if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and \
                        stat.S_IMODE(st.st_mode) != self.dir_mode:
                    os.chmod(path, self.dir_mode)

    def _claim(self, directory: Path) -> None:
        """Move aside a `directory` that is a link or another user's (planted before this worker first wrote
        there: the pages it would write inside would be listed, renamed or deleted by that user); the next write
        creates it afresh."""
        try:
            st = directory.lstat()
        except OSError:
            return
        ours = st.st_uid == os.geteuid() or (self.group and st.st_gid in {os.getegid(), *os.getgroups()})
        if stat.S_ISDIR(st.st_mode) and ours:
            return
        aside = self.root / f".flushed-{uuid.uuid4().hex}"
        try:
            os.replace(directory, aside)
        except OSError as exc:
            log.error("KV storage tier: %s is not this user's directory and cannot be moved aside (%s)", directory,
                      exc)
            return
        log.warning("KV storage tier: %s was not this user's directory (uid %d%s): moved aside to %s", directory,
                    st.st_uid, ", a link" if stat.S_ISLNK(st.st_mode) else "", aside.name)

    def create(self, path: Path) -> int:
        """A new file at `path` (never an existing one, never through a link) with the tier's file mode."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, self.file_mode)
        if self.group:
            os.fchmod(fd, self.file_mode)  # the umask may have taken the group's read away
        return fd

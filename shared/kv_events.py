"""Cache events: what a worker's prefix cache holds, in which tier, told to the routers as it changes.

A full page of a prompt has one name, the same in a worker and in every router: a hash chained over the token ids of
each page from the first (`page_hash`; Python hashes ints and tuples of them alike in every process, with no
per-process seed). The radix cache names each full page it adds outside a namespace (an adapter's or a salted
prompt's pages answer only requests that a router cannot tell apart by their tokens, so it is told nothing of them)
and records here, on the engine thread, the pages each tier gained and lost since the engine's last loop iteration:
`device` (the pool), `host` (the host-memory tier) and `storage` (the storage tier's directory). The engine process
sends them with the iteration's outputs; the worker's front adds them up (`HeldPages`) and streams them to every
router that asks: all it holds first, then the changes (services/worker/front/kv_events_rpc.py).

No torch here: the gateway imports this module.
"""
from __future__ import annotations

from collections import OrderedDict

DEVICE, HOST, STORAGE = "device", "host", "storage"
TIERS = (DEVICE, HOST, STORAGE)
ROOT = 0  # the hash "before" a prompt's first page
STORAGE_LIMIT = 200_000  # stored pages a front remembers (the directory may hold more): the least recently told go


def cached_by_tier(cached: int, lower: dict[str, int]) -> dict[str, int]:
    """A request's cached tokens by tier: those a lower tier put back into the pool for it (`lower`, by tier), the
    rest found in the pool."""
    return {DEVICE: max(0, cached - sum(lower.values())), HOST: lower.get(HOST, 0), STORAGE: lower.get(STORAGE, 0)}


def page_hash(prev: int, tokens: tuple) -> int:
    return hash((prev, tokens))


def prefix_hashes(input_ids: list[int], page_size: int, max_pages: int, root: int = ROOT) -> list[int]:
    """The name of each of the first full pages of a prompt (at most `max_pages`), chained from `root` (a router
    names a salted prompt's pages from a root of the salt's own, so that they meet no other salt's)."""
    hashes: list[int] = []
    h = root
    for i in range(min(len(input_ids) // page_size, max_pages)):
        h = page_hash(h, tuple(input_ids[i * page_size:(i + 1) * page_size]))
        hashes.append(h)
    return hashes


class CacheEvents:
    """The changes of one engine loop iteration, per tier (engine thread only). A page added and removed in one
    iteration (or the reverse) counts once, as it ended: its latest state wins."""

    def __init__(self) -> None:
        self._changes: dict[str, dict[int, bool]] = {tier: {} for tier in TIERS}  # hash -> held
        self._cleared: set[str] = set()

    def added(self, tier: str, hashes: list[int]) -> None:
        self._changes[tier].update(dict.fromkeys(hashes, True))

    def removed(self, tier: str, hashes: list[int]) -> None:
        self._changes[tier].update(dict.fromkeys(hashes, False))

    def cleared(self, tier: str) -> None:
        """Every page of `tier` is gone (a flush): what came before in this iteration no longer matters."""
        self._cleared.add(tier)
        self._changes[tier].clear()

    def drain(self) -> tuple | None:
        """("kv", cleared tiers, {tier: added}, {tier: removed}) since the last drain, or None if nothing
        changed; cleared applies first, and no page is both added and removed."""
        if not self._cleared and not any(self._changes.values()):
            return None
        added = {t: [h for h, held in c.items() if held] for t, c in self._changes.items()}
        removed = {t: [h for h, held in c.items() if not held] for t, c in self._changes.items()}
        event = ("kv", sorted(self._cleared), {t: h for t, h in added.items() if h},
                 {t: h for t, h in removed.items() if h})
        self._changes = {tier: {} for tier in TIERS}
        self._cleared = set()
        return event


class HeldPages:
    """The sum of a worker's cache events: the pages each tier holds now, as the worker's front keeps it for the
    routers that subscribe. Device and host pages are bounded by their tiers; stored pages by STORAGE_LIMIT."""

    def __init__(self, storage_limit: int = STORAGE_LIMIT) -> None:
        self.device: set[int] = set()
        self.host: set[int] = set()
        self.storage: OrderedDict[int, None] = OrderedDict()
        self.storage_limit = storage_limit

    def apply(self, cleared: list[str], added: dict[str, list[int]], removed: dict[str, list[int]]) -> None:
        if DEVICE in cleared:
            self.device.clear()
        if HOST in cleared:
            self.host.clear()
        if STORAGE in cleared:
            self.storage.clear()
        for tier, held in ((DEVICE, self.device), (HOST, self.host)):
            held.update(added.get(tier, ()))
            held.difference_update(removed.get(tier, ()))
        for h in added.get(STORAGE, ()):
            self.storage[h] = None
            self.storage.move_to_end(h)
        for h in removed.get(STORAGE, ()):
            self.storage.pop(h, None)
        while len(self.storage) > self.storage_limit:
            self.storage.popitem(last=False)

"""LoraRegistry: every adapter the server has loaded, by name.

Loading validates an adapter in full (see `load_adapter`) before it is registered, so a failed load leaves
the registry as it was. Unloading is refused while running requests use the adapter, and empties its slot.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.shared.config import LoraConfig, ModelConfig
from pdserve.shared.lora import LoraAdapter, LoraError, LoraPool
from pdserve.shared.lora_checkpoint import load_adapter

DEFAULT_MAX_RANK = 16  # --max-lora-rank when no start-up adapter says otherwise


class LoraRegistry:
    def __init__(self, pool: LoraPool) -> None:
        self.pool = pool  # its rank, allowed targets, dtype and device bound what may be loaded
        self._adapters: dict[str, LoraAdapter] = {}

    @classmethod
    def from_config(cls, config: LoraConfig, model_config: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str, shards=None) -> LoraRegistry:
        """The pool sized by `config` (its unset limits taken from the start-up adapters) with them loaded."""
        found = [load_adapter(name, path, model_config, max_rank=config.max_rank or 1 << 20,
                              target_modules=config.target_modules, dtype=dtype, device=device)
                 for name, path in config.paths]
        max_rank = config.max_rank or max((a.rank for a in found), default=DEFAULT_MAX_RANK)
        targets = config.target_modules
        if targets is None and found:
            targets = tuple(sorted({m for a in found for m in a.target_modules}))
        pool = LoraPool(model_config, max_loras=config.max_loras_per_batch, max_rank=max_rank,
                        target_modules=targets, dtype=dtype, device=device, shards=shards)
        registry = cls(pool)
        for adapter in found:
            registry._adapters[adapter.name] = adapter
        return registry

    def __contains__(self, name: str) -> bool:
        return name in self._adapters

    def names(self) -> list[str]:
        return sorted(self._adapters)

    def get(self, name: str) -> LoraAdapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            raise LoraError(f"adapter {name!r} is not loaded (loaded: {', '.join(self.names()) or 'none'})")
        return adapter

    def resolve(self, ref: str, version: str | None = None) -> LoraAdapter:
        """The adapter a request names: by name, or by the path it was loaded from. With `version` (what the
        other half of a PD pair runs), refuse a different one: its KV and tokens would not match."""
        adapter = self._adapters.get(ref)
        if adapter is None:
            by_path = [a for a in self._adapters.values() if _same_path(a.path, ref)]
            adapter = by_path[0] if by_path else self.get(ref)
        if version and version != adapter.version:
            raise LoraError(f"adapter {adapter.name!r}: the peer worker runs version {version}, this one "
                            f"{adapter.version}; load the same files on both")
        return adapter

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Load adapter `name` from `path`. Loading a loaded name again from the same path returns the loaded
        adapter while its files are unchanged; from another path, or changed, it is refused: unload first."""
        old = self._adapters.get(name)
        if old is not None and not _same_path(old.path, path):
            raise LoraError(f"adapter {name!r} is already loaded from {old.path}; unload it first")
        pool = self.pool
        adapter = load_adapter(name, path, pool.model_config, max_rank=pool.max_rank,
                               target_modules=pool.target_modules, dtype=pool.dtype, device=pool.device)
        if old is not None:
            if old.version != adapter.version:
                raise LoraError(f"adapter {name!r}: its files in {path} changed since it was loaded "
                                f"(version {old.version}, now {adapter.version}); unload it first")
            return old
        self._adapters[name] = adapter
        return adapter

    def unload(self, name: str) -> None:
        self.get(name)
        uses = self.pool.in_use(name)
        if uses:
            raise LoraError(f"adapter {name!r}: cannot unload it while {uses} running requests use it")
        self.pool.evict(name)
        del self._adapters[name]


def _same_path(a: str | Path, b: str | Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except (OSError, RuntimeError, ValueError):
        return False

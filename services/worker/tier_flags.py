"""The KV tier flags of a generative worker, with SGLang's names (`--enable-hierarchical-cache`, `--hicache-*`), and
the TierConfig they build (`shared/kv_tiers.py` is the tier itself).

What is built is one tier under the pool: page files in a directory (`--hicache-storage-backend file`). SGLang's
host-memory tier (`--hicache-ratio`, `--hicache-size`) is not: on a CPU worker the pool already lives in host
memory, on a GPU the tier is not written yet; both are start errors, never flags silently ignored.
"""
from __future__ import annotations

import argparse

from pdserve.shared.config import PREFETCH_POLICIES, WRITE_POLICIES, TierConfig

STORAGE_BACKENDS = ("file",)
# SGLang's other storage backends, named in the refusal so that a command line copied from SGLang says what to do.
NOT_BUILT_BACKENDS = ("mooncake", "hf3fs", "nixl", "aibrix", "eic", "dynamic")
DEFAULT_PREFETCH_TIMEOUT_S = TierConfig.prefetch_timeout_s


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults of None: a flag given without --enable-hierarchical-cache is an error, not a no-op.
    parser.add_argument("--enable-hierarchical-cache", action="store_true",
                        help="keep KV pages beyond the pool in a tier below the prefix cache: page files in "
                             "--hicache-storage-dir, which outlive the worker and may be shared by the workers "
                             "of one model (needs --hicache-storage-backend file)")
    parser.add_argument("--hicache-storage-backend", default=None, metavar="BACKEND",
                        help="where the tier keeps pages: file (one file per page, plain file I/O); SGLang's "
                             "other backends are not built")
    parser.add_argument("--hicache-storage-dir", default=None, metavar="DIR",
                        help="the file backend's directory, created if missing; must be writable (checked at start)")
    parser.add_argument("--hicache-write-policy", default=None, choices=WRITE_POLICIES,
                        help="when a page is written: write_through once cached (default), "
                             "write_through_selective once a second request reads it, write_back when evicted")
    parser.add_argument("--hicache-storage-prefetch-policy", default=None, choices=PREFETCH_POLICIES,
                        help="how long a request with a stored prefix waits for it: best_effort (default; what "
                             "has been read by the timeout, the rest computed), timeout (all by the timeout or "
                             "none), wait_complete (all of it)")
    parser.add_argument("--hicache-storage-prefetch-timeout", type=float, default=None, metavar="SECONDS",
                        help=f"the wait of best_effort and timeout (default: {DEFAULT_PREFETCH_TIMEOUT_S:g})")
    parser.add_argument("--hicache-ratio", type=float, default=None, metavar="RATIO",
                        help="SGLang's host-memory tier, sized against the pool: not built (a start error)")
    parser.add_argument("--hicache-size", type=int, default=None, metavar="GB",
                        help="SGLang's host-memory tier, in GB: not built (a start error)")


def tier_config(args: argparse.Namespace) -> TierConfig | None:
    """The tier the flags ask for, None when off; ValueError naming the flag for what cannot be served."""
    if not hasattr(args, "enable_hierarchical_cache"):
        return None  # a command without the tier flags
    host_tier = [flag for flag, value in (("--hicache-ratio", args.hicache_ratio),
                                          ("--hicache-size", args.hicache_size)) if value is not None]
    if host_tier:
        why = ("which a CPU worker has no use for: its KV pool already lives in host memory, so only the storage "
               "tier applies" if not args.device.startswith("cuda")
               else "which is not built yet: on a GPU worker only the storage tier is")
        raise ValueError(f"{host_tier[0]} sizes SGLang's host-memory KV tier, {why} (--enable-hierarchical-cache "
                         "--hicache-storage-backend file --hicache-storage-dir DIR)")
    given = {"--hicache-storage-backend": args.hicache_storage_backend,
             "--hicache-storage-dir": args.hicache_storage_dir,
             "--hicache-write-policy": args.hicache_write_policy,
             "--hicache-storage-prefetch-policy": args.hicache_storage_prefetch_policy,
             "--hicache-storage-prefetch-timeout": args.hicache_storage_prefetch_timeout}
    if not args.enable_hierarchical_cache:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:
            raise ValueError(f"{stray[0]} needs --enable-hierarchical-cache")
        return None
    backend = args.hicache_storage_backend
    if backend is None:
        raise ValueError("--enable-hierarchical-cache: only the storage tier is built, so it needs "
                         "--hicache-storage-backend file and --hicache-storage-dir DIR")
    if backend not in STORAGE_BACKENDS:
        later = f" ({backend} is not built)" if backend in NOT_BUILT_BACKENDS else ""
        raise ValueError(f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}, "
                         f"got {backend!r}{later}")
    if not args.hicache_storage_dir:
        raise ValueError(f"--hicache-storage-backend {backend} needs --hicache-storage-dir: the directory its page "
                         "files live in")
    defaults = TierConfig(args.hicache_storage_dir)
    return TierConfig(args.hicache_storage_dir,
                      write_policy=args.hicache_write_policy or defaults.write_policy,
                      prefetch_policy=args.hicache_storage_prefetch_policy or defaults.prefetch_policy,
                      prefetch_timeout_s=(defaults.prefetch_timeout_s
                                          if args.hicache_storage_prefetch_timeout is None
                                          else args.hicache_storage_prefetch_timeout))

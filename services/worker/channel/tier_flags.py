"""The KV tier flags of a generative worker, with SGLang's names (`--enable-hierarchical-cache`, `--hicache-*`), and
the TierConfig they build (`shared/kv_tiers.py` is the tiers themselves).

Two tiers under the pool: on a GPU, host memory (`--hicache-ratio`, `--hicache-size`; on by default with
--enable-hierarchical-cache, as in SGLang); on every machine, page files in a directory (`--hicache-storage-backend
file`). A CPU worker's pool already lives in host memory, so there the host-tier flags are a start error, never
flags silently ignored.
"""
from __future__ import annotations

import argparse
import os

from pdserve.shared.config import PREFETCH_POLICIES, WRITE_POLICIES, TierConfig
from pdserve.shared.kv_file_capacity import parse_size

STORAGE_BACKENDS = ("file",)
# SGLang's other storage backends, named in the refusal so that a command line copied from SGLang says what to do.
NOT_BUILT_BACKENDS = ("mooncake", "hf3fs", "nixl", "aibrix", "eic", "dynamic")
DEFAULT_PREFETCH_TIMEOUT_S = TierConfig.prefetch_timeout_s
DEFAULT_HOST_RATIO = 2.0  # SGLang's default
# The storage tier's bounds: flag -> SGLang's environment variable for its file backend, read when the flag is absent.
SGLANG_ENV = {"--hicache-storage-max-size": "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE",
              "--hicache-storage-min-free-space": "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE",
              "--hicache-storage-eviction-ratio": "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO"}


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    # Defaults of None: a flag given without --enable-hierarchical-cache is an error, not a no-op.
    parser.add_argument("--enable-hierarchical-cache", action="store_true",
                        help="keep KV pages beyond the pool in tiers below the prefix cache: on a GPU, host memory "
                             "(--hicache-ratio); page files in --hicache-storage-dir, which outlive the worker and "
                             "may be shared by the workers of one model (--hicache-storage-backend file)")
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
    parser.add_argument("--hicache-storage-max-size", default=None, metavar="SIZE",
                        help="the storage directory's cap (200GB, 500MB, 2GiB or bytes; default: "
                             "SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, else none): past it, unused identities' pages "
                             "then this worker's least recently used go, down to --hicache-storage-eviction-ratio "
                             "of it")
    parser.add_argument("--hicache-storage-min-free-space", default=None, metavar="SIZE",
                        help="free space kept on the directory's volume, evicting as past the cap (default: "
                             "SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE, else none)")
    parser.add_argument("--hicache-storage-eviction-ratio", default=None, metavar="RATIO",
                        help="what eviction leaves, times the cap, in (0, 1] (default: "
                             "SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO, else 0.9)")
    parser.add_argument("--hicache-storage-group-access", action="store_true", default=None,
                        help="share the page files with the directory's group (files 0640, directories 02770) "
                             "for workers running as different users; default: the user's only (0600, 0700)")
    parser.add_argument("--hicache-ratio", type=float, default=None, metavar="RATIO",
                        help=f"GPU workers: the host-memory tier's size, times the pool's (default: "
                             f"{DEFAULT_HOST_RATIO:g}; at least 1); pinned host memory the pool evicts into")
    parser.add_argument("--hicache-size", type=float, default=None, metavar="GB",
                        help="GPU workers: the host-memory tier's size in GB (instead of --hicache-ratio)")


def tier_config(args: argparse.Namespace) -> TierConfig | None:
    """The tier the flags ask for, None when off; ValueError naming the flag for what cannot be served."""
    if not hasattr(args, "enable_hierarchical_cache"):
        return None  # a command without the tier flags
    host_flags = {"--hicache-ratio": args.hicache_ratio, "--hicache-size": args.hicache_size}
    on_gpu = args.device.startswith("cuda")
    host_given = [flag for flag, value in host_flags.items() if value is not None]
    if host_given and not on_gpu:
        raise ValueError(f"{host_given[0]} sizes the host-memory KV tier, which a CPU worker has no use for: its KV "
                         "pool already lives in host memory, so only the storage tier applies "
                         "(--enable-hierarchical-cache --hicache-storage-backend file --hicache-storage-dir DIR)")
    if len(host_given) == 2:
        raise ValueError("--hicache-ratio and --hicache-size both size the host-memory tier: give one")
    given = {"--hicache-storage-backend": args.hicache_storage_backend,
             "--hicache-storage-dir": args.hicache_storage_dir,
             "--hicache-write-policy": args.hicache_write_policy,
             "--hicache-storage-prefetch-policy": args.hicache_storage_prefetch_policy,
             "--hicache-storage-prefetch-timeout": args.hicache_storage_prefetch_timeout,
             "--hicache-storage-max-size": args.hicache_storage_max_size,
             "--hicache-storage-min-free-space": args.hicache_storage_min_free_space,
             "--hicache-storage-eviction-ratio": args.hicache_storage_eviction_ratio,
             "--hicache-storage-group-access": args.hicache_storage_group_access}
    if not args.enable_hierarchical_cache:
        stray = [flag for flag, value in {**given, **host_flags}.items() if value is not None]
        if stray:
            raise ValueError(f"{stray[0]} needs --enable-hierarchical-cache")
        return None
    backend = args.hicache_storage_backend
    if backend is None:
        stray = [flag for flag, value in given.items() if value is not None]
        if stray:  # the host tier takes what the pool evicts: there is nothing for these to choose
            raise ValueError(f"{stray[0]} applies to the storage tier, which needs --hicache-storage-backend file "
                             "and --hicache-storage-dir DIR")
        if not on_gpu:
            raise ValueError("--enable-hierarchical-cache on a CPU worker: its tier is storage, so it needs "
                             "--hicache-storage-backend file and --hicache-storage-dir DIR")
    elif backend not in STORAGE_BACKENDS:
        later = f" ({backend} is not built)" if backend in NOT_BUILT_BACKENDS else ""
        raise ValueError(f"--hicache-storage-backend must be one of {', '.join(STORAGE_BACKENDS)}, "
                         f"got {backend!r}{later}")
    elif not args.hicache_storage_dir:
        raise ValueError(f"--hicache-storage-backend {backend} needs --hicache-storage-dir: the directory its page "
                         "files live in")
    host_ratio = (args.hicache_ratio if args.hicache_ratio is not None
                  else DEFAULT_HOST_RATIO if on_gpu and args.hicache_size is None else None)
    bounds = storage_bounds(args) if backend is not None else {}
    return TierConfig(args.hicache_storage_dir, host_ratio=host_ratio, host_gb=args.hicache_size, **bounds,
                      write_policy=args.hicache_write_policy or TierConfig.write_policy,
                      prefetch_policy=args.hicache_storage_prefetch_policy or TierConfig.prefetch_policy,
                      prefetch_timeout_s=(DEFAULT_PREFETCH_TIMEOUT_S if args.hicache_storage_prefetch_timeout is None
                                          else args.hicache_storage_prefetch_timeout))


def storage_bounds(args: argparse.Namespace) -> dict:
    """TierConfig's storage bounds from the flags, else SGLang's environment variables; ValueError naming either."""
    def given(flag: str) -> tuple[str | None, str]:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            return value, flag
        env = SGLANG_ENV[flag]
        return (os.environ.get(env) or None), env

    bounds = {"storage_group_access": bool(args.hicache_storage_group_access)}
    for flag, field in (("--hicache-storage-max-size", "storage_max_bytes"),
                        ("--hicache-storage-min-free-space", "storage_min_free_bytes")):
        value, source = given(flag)
        if value is not None:
            bounds[field] = parse_size(value, source)
    value, source = given("--hicache-storage-eviction-ratio")
    if value is not None:
        try:
            ratio = float(value)
        except ValueError:
            ratio = -1.0
        if not 0 < ratio <= 1:
            raise ValueError(f"{source} must be a number in (0, 1], got {value!r}")
        bounds["storage_eviction_ratio"] = ratio
    return bounds

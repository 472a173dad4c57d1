"""Native CPU kernels: C++ ops compiled once per machine with `torch.utils.cpp_extension`.

They implement the same contracts as the Triton kernels and torch twins beside them (rmsnorm, silu_and_mul,
rotary_store_kv, decode and extend attention, the grammar token mask, the multi-LoRA delta, the int8
quantization around an int8 matmul) and are tested against the same torch reference. They are built for the CPU
they run on (`-march=native`: AVX-512 and its bf16 dot products where present, else AVX2 with FMA, else scalar
loops; `isa()` of the module names which), into a cache folder keyed by the sources, torch's version, the CPU's
flags and the compiler flags, so a second machine or a changed source builds anew.

`PDSERVE_NATIVE_MARCH` replaces `native` in `-march=` (e.g. `x86-64-v3`, AVX2 + FMA without AVX-512): a build
for CPUs other than this one, which is how the AVX2 paths are tested and measured on an AVX-512 machine. Each
-march is a module of its own name (`load(march)`), so two builds load side by side in one process.
`scripts/setup` builds them (`python -m pdserve.kernels.native`); a worker that finds no build compiles
them on first use, and where that is impossible (no C++ compiler) the runtime falls back to the torch twins
and says so in its log.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

SOURCES = ("norm.cpp", "activation.cpp", "rotary_kv.cpp", "attention.cpp", "extend_tiled.cpp", "gemv.cpp",
           "dense.cpp", "rows.cpp", "token_mask.cpp", "lora.cpp", "int8.cpp", "allreduce.cpp", "gguf.cpp",
           "bindings.cpp")
_HEADERS = ("common.h", "attention.h")
_HERE = Path(__file__).resolve().parent
CXX_STD = "c++20"  # what torch's extension build compiles the sources with (torch 2.13)


@functools.cache  # read once: every native op asks for its module, and a process keeps one build
def default_march() -> str:
    """The -march of the build the runtime loads: `$PDSERVE_NATIVE_MARCH`, else native."""
    return os.environ.get("PDSERVE_NATIVE_MARCH", "").strip() or "native"


def _flags(march: str) -> list[str]:
    # -fopenmp: at::parallel_for is inlined into our code and runs on torch's OpenMP pool only when compiled with
    # it (the library resolves to the libgomp torch has already loaded, by its soname).
    return ["-O3", f"-march={march}", "-fopenmp"]


def _module_name(march: str) -> str:
    return "pdserve_native" if march == "native" else "pdserve_native_" + re.sub(r"\W", "_", march)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return ""


def build_dir(march: str | None = None) -> Path:
    """Where this machine's build lives: `$PDSERVE_KERNEL_CACHE` or ~/.cache/pdserve/kernels, then a key of the
    sources (their bytes and folder), torch, Python, the CPU's flags and the compiler flags."""
    import torch

    march = march or default_march()
    digest = hashlib.sha1()
    for name in SOURCES + _HEADERS:
        digest.update((_HERE / name).read_bytes())
    # The sources' folder too: the build names them by path, so two checkouts sharing one cache would
    # otherwise rebuild each other's module back and forth.
    digest.update(" ".join([torch.__version__, sys.version, _cpu_flags(), *_flags(march), str(_HERE)]).encode())
    root = Path(os.environ.get("PDSERVE_KERNEL_CACHE") or Path.home() / ".cache" / "pdserve" / "kernels")
    return root / digest.hexdigest()[:16]


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def load(march: str | None = None) -> ModuleType:
    """The compiled module for `march` (default: `default_march()`), built first if this machine has no build
    of it yet. Raises NativeUnavailable."""
    return _load(march or default_march())


BUILD_WAIT_S = 900  # another process's build of the same kernels: far longer than one takes on 2 cores


@contextlib.contextmanager
def _build_lock(out: Path):
    """One build at a time in `out`, across processes. torch's own lock is a file that a build killed midway
    leaves behind, and every later load then waits for it forever; this one is an flock, which the kernel
    releases when its holder dies, so while it is held a torch lock file in `out` can only be such a leftover."""
    with open(out / "build.flock", "w") as handle:
        deadline = time.monotonic() + BUILD_WAIT_S
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {out} for {BUILD_WAIT_S} s") from None
                time.sleep(0.5)
        try:
            (out / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def _load(march: str) -> ModuleType:
    if os.environ.get("PDSERVE_NATIVE_KERNELS", "1") == "0":
        raise NativeUnavailable("disabled by PDSERVE_NATIVE_KERNELS=0")
    try:
        from torch.utils import cpp_extension

        out = build_dir(march)
        out.mkdir(parents=True, exist_ok=True)
        name = _module_name(march)
        with _build_lock(out):
            return cpp_extension.load(name=name, sources=[str(_HERE / s) for s in SOURCES],
                                      extra_cflags=_flags(march) + _precompiled(out, name, march),
                                      extra_ldflags=["-fopenmp"], build_directory=str(out), verbose=False)
    except Exception as exc:  # compiler missing, build failure, import failure: all mean "use the twins"
        raise NativeUnavailable(f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc) else ''}") \
            from exc


def _precompiled(out: Path, name: str, march: str) -> list[str]:
    """The flags that make every source start from common.h precompiled (ATen's headers are most of each
    source's compile time: about 6 of 8 s), building it into `out` first; none where it cannot be built. The
    header is compiled with the flags torch's build gives the sources; were any to differ, the compiler would
    ignore the precompiled one and read the header itself: slower, never different."""
    pch = out / "pch"
    header = pch / "common.h"
    if (pch / "common.h.gch").exists():
        return ["-include", str(header)]
    import sysconfig

    from torch.utils import cpp_extension

    pch.mkdir(exist_ok=True)
    header.write_bytes((_HERE / "common.h").read_bytes())
    compiler = os.environ.get("CXX") or "c++"
    flags = [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H"]
    for path in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]:
        flags += ["-isystem", path]
    flags += ["-fPIC", f"-std={CXX_STD}", *_flags(march)]
    done = subprocess.run([compiler, *flags, "-x", "c++-header", str(header), "-o", str(pch / "common.h.gch.tmp")],
                          capture_output=True, text=True)
    if done.returncode != 0:
        log.info("native kernels: no precompiled header (%s); building without", done.stderr.strip()[-300:])
        return []
    os.replace(pch / "common.h.gch.tmp", pch / "common.h.gch")
    return ["-include", str(header)]


def available() -> bool:
    try:
        load()
    except NativeUnavailable:
        return False
    return True


"""The native kernels as an AVX2-only CPU builds them (-march=x86-64-v3: AVX2 and FMA, no AVX-512).

On an AVX-512 machine those paths never run in the product, so this runs the native kernel tests (and
deterministic mode's start check over a model's every op) a second time in a child pytest against that build
(PDSERVE_NATIVE_MARCH), with oneDNN held to AVX2 as well
(ONEDNN_MAX_CPU_ISA: it then refuses bf16 weights, as on an AVX2-only CPU). What it cannot imitate is the CPU's
own probes (torch.cpu._is_avx512_bf16_supported, AMX): tests/shared/test_linear.py simulates those. torch's own
kernels stay on this CPU's capability: under ATEN_CPU_CAPABILITY=avx2 the torch twin of quantize_rows gave other
int8 codes than under AVX-512 for smoothed rows of 1,100 (to be checked on an AVX2-only machine). One build per run (about a minute, cached by the sources like every build). On a machine whose
own build is already AVX2 the main run covers it and this is skipped.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pdserve.kernels import native

MARCH = "x86-64-v3"
ROOT = Path(__file__).resolve().parents[2]
# The tests of every native op (each against its torch twin), and the layer that picks the native GEMV.
MODULES = ["test_rmsnorm.py", "test_silu_mul.py", "test_rotary_kv.py", "test_decode_attention.py",
           "test_extend_attention.py", "test_token_mask.py", "test_int8_matmul.py", "test_lora.py", "test_dense.py",
           "test_gguf_matmul.py"]


def _compiler_refuses() -> str | None:
    """Why this machine cannot build or run x86-64-v3 code, or None."""
    if os.uname().machine not in ("x86_64", "AMD64"):
        return f"x86-64-v3 is an x86 target; this is {os.uname().machine}"
    flags = native._cpu_flags().split()
    missing = [f for f in ("avx2", "fma", "bmi2", "f16c", "movbe") if f not in flags]
    if missing:
        return f"this CPU cannot run an x86-64-v3 build (no {', '.join(missing)})"
    compiler = os.environ.get("CXX") or shutil.which("c++")
    if compiler is None:
        return "no C++ compiler"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("#include <immintrin.h>\nint main() { return _mm256_cvtss_f32(_mm256_setzero_ps()); }\n")
        done = subprocess.run([compiler, f"-march={MARCH}", "-c", str(src), "-o", str(Path(tmp) / "probe.o")],
                              capture_output=True, text=True)
        if done.returncode != 0:
            return f"{compiler} cannot target -march={MARCH}: {done.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.mark.skipif(native.default_march() != "native", reason="this run already tests a chosen -march build")
def test_native_kernels_pass_their_tests_on_the_avx2_build():
    refusal = _compiler_refuses()
    if refusal:
        pytest.skip(refusal)
    if native.available() and native.load().isa() == "avx2":
        pytest.skip("this machine's own build is the AVX2 one: the main run tests it")
    env = dict(os.environ, PDSERVE_NATIVE_MARCH=MARCH, ONEDNN_MAX_CPU_ISA="AVX2")
    # Built first, on its own, so that a build error reads as one (the kernel tests would skip without a build).
    build = subprocess.run([sys.executable, "-c", "from pdserve.kernels import native; print(native.load().isa())"],
                           env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert build.returncode == 0 and build.stdout.strip() == "avx2", build.stdout + build.stderr
    here = Path(__file__).parent
    # The bad-input checks come before any vector path: they run once, in the main run.
    # And deterministic mode's start check over every op of a model's step, on this build's vector paths.
    tests = "(native and not refuses) or test_linear or int8_mm or test_dense or test_the_check_passes_here"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-rs", "-k", tests,
                          *(str(here / m) for m in MODULES),
                          str(ROOT / "tests/shared/test_linear.py"),
                          str(ROOT / "tests/shared/test_deterministic_check.py")],
                         env=env, capture_output=True, text=True, cwd=ROOT, timeout=1200)
    report = run.stdout[-6000:] + run.stderr[-2000:]
    assert run.returncode == 0, report
    assert " passed" in run.stdout and "native CPU kernels unavailable" not in run.stdout, report

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run only in the interpreter; it must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

ROOT = Path(__file__).resolve().parent.parent
# Tests that scripts/test runs alone, after the rest runs in two processes: each asserts a bound on time (a probe
# answered within a fraction of a second, a refusal within a deadline) that a second test process beside it on two
# cores would stretch, or counts a machine-wide resource (/dev/shm files) that another test's processes share, or
# kills a worker at a point timed by what its client has seen (on a busier machine the worker may be done by then).
SERIAL = ("tests/security/", "tests/benchclient/test_bench.py", "tests/integration/test_tensor_parallel_worker.py",
          "tests/integration/test_migration_chaos.py",
          "tests/services/gateway/test_cpu_pool.py", "tests/services/gateway/test_hostile_input.py",
          "tests/services/gateway/test_overload_drain.py", "tests/services/gateway/test_sse_end.py",
          "tests/services/gateway/test_generation.py", "tests/services/gateway/test_live_move.py",
          "tests/services/worker/test_prefill_peers.py",
          "tests/shared/test_kv_tiers.py", "tests/shared/test_tp_nodes.py",
          "tests/shared/transfer/test_transfer_backends.py")


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.resolve().relative_to(ROOT).as_posix().startswith(SERIAL):
            item.add_marker(pytest.mark.serial)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """{arch: HF directory} of tiny random checkpoints (see fixtures.py)."""
    from fixtures import ARCHS, make_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def default_model_dir():
    from pdserve.shared.model_files import resolve_model_path

    return resolve_model_path(None, quiet=True)


@pytest.fixture(scope="session")
def minilm_dir():
    """all-MiniLM-L6-v2, prepared by scripts/setup: missing, it fails the tests that need it (never skips)."""
    from pdserve.shared.model_files import resolve_model_path

    return resolve_model_path("all-MiniLM-L6-v2")


# Seeded PEFT adapters for the default model: ranks, target sets and scalings that differ on purpose.
DEFAULT_MODEL_ADAPTERS = {
    "sql": dict(rank=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], alpha=16, seed=1),
    "poet": dict(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                          "down_proj"], alpha=16, seed=2, use_rslora=True, std=0.02),
    "terse": dict(rank=4, target_modules=["v_proj", "up_proj", "down_proj"], alpha=8, seed=3),
}


@pytest.fixture(scope="session")
def default_model_adapters(default_model_dir, tmp_path_factory) -> dict[str, Path]:
    """{name: PEFT directory} of DEFAULT_MODEL_ADAPTERS, saved by PEFT itself."""
    from lora_adapters import make_peft_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    return {name: make_peft_adapter(default_model_dir, root / name, **spec)
            for name, spec in DEFAULT_MODEL_ADAPTERS.items()}


def pytest_report_header(config) -> list[str]:
    """The CPU and the paths the product picks on it, at the top of a run (at its end under -q, which CI uses and
    which hides the header): a failure names the machine."""
    return _machine_lines()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if config.get_verbosity() < 0:
        terminalreporter.write_sep("-", "machine")
        for line in _machine_lines():
            terminalreporter.write_line(line)


@functools.cache
def _machine_lines() -> list[str]:
    from pdserve.kernels import native
    from pdserve.shared import linear
    from pdserve.shared.model_runner import resolve_dtype

    cpu_flags = native._cpu_flags().split()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown") if Path("/proc/cpuinfo").exists() else "unknown"
    vnni = [f for f in ("avx512_vnni", "avx_vnni", "amx_int8") if f in cpu_flags]
    try:
        lib = native.load()
        int8 = "fused native" if lib.int8_linear_supported() else "two passes around int8_mm"
        kernels = f"native kernels -march={native.default_march()} ({lib.isa()} paths); int8 matmuls {int8}"
    except native.NativeUnavailable as exc:
        kernels = f"native kernels unavailable ({exc}): torch twins"
    return [f"cpu: {model}, {os.cpu_count()} cores; torch {torch.__version__} capability "
            f"{torch.backends.cpu.get_cpu_capability()}; AVX512-BF16 {linear._has_avx512_bf16()}, "
            f"AMX {linear.amx_usable()}, VNNI {'/'.join(vnni) or 'none'}",
            f"paths: oneDNN packs bf16 {linear._packs_bf16()}; bf16 layers on "
            f"{'the fixed-order kernel' if linear.fixed_order_pays() else 'oneDNN'}, the LM head on "
            f"{'the fixed-order kernel' if linear.fixed_order_head_pays() else 'oneDNN'} "
            f"({linear._choice_here().source}); {kernels}; "
            f"--dtype auto serves a bf16 checkpoint as {str(resolve_dtype('auto', 'bfloat16', 'cpu'))[6:]}"]

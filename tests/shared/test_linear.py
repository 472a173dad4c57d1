"""Linear: the model's weight matmuls, packed once on CPU, give what F.linear gives.

Which path a layer takes depends on the CPU: oneDNN packs bf16 weights only with AVX512-BW/VL/DQ or
AVX-NE-CONVERT (an AVX2-only CPU refuses, and the layer falls back to F.linear), the native GEMV exists where the
native build has a path for the dtype. Tests of a CPU-specific path skip naming what is missing; each fallback
has a test that runs everywhere, with the CPU's answers simulated."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.shared import linear
from pdserve.shared.linear import Linear
from pdserve.shared.matmul_choice import MatmulChoice, Timing

ONEDNN_REFUSAL = ("mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, "
                  "avx512vl and avx512dq")  # what torch 2.13 says on an AVX2-only CPU
needs_bf16_packing = pytest.mark.skipif(
    not linear._packs_bf16(),
    reason="oneDNN packs no bf16 weights on this CPU (it needs AVX512-BW/VL/DQ or AVX-NE-CONVERT); the product "
           "falls back to F.linear, tested by test_a_bf16_weight_onednn_refuses_falls_back_to_f_linear")


def native_available() -> bool:
    from pdserve.kernels import native

    return native.available()



@pytest.fixture
def onednn_refuses_bf16(monkeypatch):
    """oneDNN as an AVX2-only CPU has it: packing an fp32 weight works, a bf16 one raises."""
    real = torch.ops.mkldnn._reorder_linear_weight

    def reorder(weight, *args):
        if weight.dtype == torch.bfloat16:
            raise RuntimeError(ONEDNN_REFUSAL)
        return real(weight, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", reorder)


@pytest.fixture(autouse=True)
def onednn_layers(monkeypatch):
    """The oneDNN and GEMV paths under test, wherever this CPU would run bf16 layers on the fixed-order kernel
    (tests/kernels/test_dense.py tests that one)."""
    monkeypatch.setattr(linear, "_matmul_choice", MatmulChoice(False, False, (), "test"))


@pytest.fixture
def wide_matmuls(monkeypatch):
    """Choose how wide bf16 steps compute, instead of this CPU's measured choice."""
    from pdserve.shared import linear

    return lambda f32: monkeypatch.setattr(linear, "_wide_f32", f32)


@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_bf16_on_cpu_is_packed_and_bit_identical_to_f_linear(bias, tokens, wide_matmuls):
    wide_matmuls(False)
    torch.manual_seed(tokens)
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    x = torch.randn(tokens, 48, dtype=torch.bfloat16)
    lin = Linear(weight, b)
    assert lin.is_packed  # the fast path is taken, not silently skipped
    assert torch.equal(lin(x), F.linear(x, weight, b))


@pytest.mark.parametrize("bias", [False, True])
def test_a_bf16_weight_onednn_refuses_falls_back_to_f_linear(bias, onednn_refuses_bf16, wide_matmuls, monkeypatch):
    wide_matmuls(True)  # even where wide steps would run in fp32, there is no packed weight to widen
    monkeypatch.setattr(linear, "_gemv_weight", lambda weight: None)  # F.linear at every row count
    torch.manual_seed(2)
    weight = torch.randn(96, 48, dtype=torch.bfloat16)
    b = torch.randn(96, dtype=torch.bfloat16) if bias else None
    lin = Linear(weight, b)
    assert not lin.is_packed and lin._packed_f32 is None
    for tokens in (1, 7, 64):
        x = torch.randn(tokens, 48, dtype=torch.bfloat16)
        assert torch.equal(lin(x), F.linear(x, weight, b))
    assert torch.equal(lin.dense_weight(), weight)
    assert not linear._packs_bf16()
    monkeypatch.setattr(linear, "_bf16_matmul", None)
    monkeypatch.setenv("PDSERVE_CPU_FP32_MATMUL", "bf16")  # even when asked: fp32 layers keep fp32 matmuls
    assert linear.bf16_matmul_pays() is False


def test_fp32_matches_f_linear_and_the_weight_reads_back_exactly():
    torch.manual_seed(0)
    weight, x = torch.randn(64, 32), torch.randn(5, 32)
    lin = Linear(weight)
    torch.testing.assert_close(lin(x), F.linear(x, weight))
    assert torch.equal(lin.dense_weight(), weight)
    assert lin.shape == (64, 32) and lin.nbytes == 64 * 32 * 4


def test_fp16_works_whether_or_not_this_cpu_can_pack_it():
    torch.manual_seed(1)
    weight, x = torch.randn(32, 16, dtype=torch.float16), torch.randn(3, 16, dtype=torch.float16)
    lin = Linear(weight)
    torch.testing.assert_close(lin(x), F.linear(x, weight))
    assert torch.equal(lin.dense_weight(), weight)


def gemv_runs(dtype: torch.dtype) -> bool:
    return Linear(torch.zeros(16, 32, dtype=dtype))._gemv_weight is not None


needs_gemv = pytest.mark.skipif(not gemv_runs(torch.bfloat16),
                                reason="the native bf16 GEMV needs the native kernels and AVX512-BF16 or an AVX2 "
                                       "build (PDSERVE_NATIVE_MARCH=x86-64-v3)")
GEMV_TOL = {torch.bfloat16: dict(rtol=1e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("out_f, in_f", [(40, 576), (960, 576), (576, 1536)])  # 40: a partial 16-row block
def test_few_rows_take_the_native_gemv_and_match_a_float64_reference(dtype, bias, rows, out_f, in_f):
    if not gemv_runs(dtype):
        pytest.skip(f"this native build has no {dtype} GEMV (bf16: AVX512-BF16 or AVX2; fp32: AVX2 builds); "
                    "those layers run oneDNN's kernel, as test_fp32_matches_f_linear checks")
    torch.manual_seed(rows * out_f)
    weight = (torch.randn(out_f, in_f) * 0.05).to(dtype)
    b = torch.randn(out_f, dtype=dtype) if bias else None
    x = torch.randn(rows + 1, in_f, dtype=dtype)[1:]  # a view that does not start at the storage's start
    want = x.double() @ weight.double().T + (b.double() if bias else 0)
    got = Linear(weight, b)(x)
    assert got.dtype == dtype and got.shape == (rows, out_f)
    # one rounding of the fp32 sum (and of the bias add), as F.linear has
    torch.testing.assert_close(got.double(), want, **GEMV_TOL[dtype])
    torch.testing.assert_close(got, F.linear(x, weight, b), **GEMV_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_the_other_rows_or_threads(dtype):
    if not gemv_runs(dtype):
        pytest.skip(f"this native build has no {dtype} GEMV")
    from pdserve.shared.linear import GEMV_MAX_ROWS

    torch.manual_seed(3)
    weight = (torch.randn(200, 576) * 0.05).to(dtype)
    rows = GEMV_MAX_ROWS[dtype]  # as many as the GEMV takes together
    x = torch.randn(rows, 576, dtype=dtype)
    lin = Linear(weight)
    together = lin(x)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = torch.cat([lin(x[i:i + 1]) for i in range(rows)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(together, alone)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_gemv_takes_the_rows_where_it_measured_faster(dtype):
    from pdserve.shared import linear

    if not gemv_runs(dtype):
        pytest.skip(f"this native build has no {dtype} GEMV")
    lin = Linear((torch.randn(64, 576) * 0.05).to(dtype))
    called: list[int] = []
    gemv = lin._gemv
    lin._gemv = lambda x, w: called.append(x.shape[0]) or gemv(x, w)
    for rows in range(1, 7):
        lin(torch.randn(rows, 576, dtype=dtype))
    assert called == list(range(1, linear.GEMV_MAX_ROWS[dtype] + 1))  # fp32: 1-2 rows, bf16: 1-4


def test_batch_invariant_layers_run_one_kernel_at_every_row_count():
    lin = Linear(torch.zeros(16, 32, dtype=torch.bfloat16), batch_invariant=True)
    assert lin._fixed is not None and lin._gemv_weight is None and lin._packed is None and lin._packed_f32 is None


@pytest.mark.parametrize("bias", [False, True])
def test_wide_bf16_steps_may_compute_in_fp32_with_one_rounding(bias, wide_matmuls):
    from pdserve.shared.linear import WIDE_MIN_ROWS

    wide_matmuls(True)
    torch.manual_seed(7)
    weight = (torch.randn(192, 576) * 0.05).bfloat16()
    b = torch.randn(192, dtype=torch.bfloat16) if bias else None
    lin = Linear(weight, b)
    for rows in (WIDE_MIN_ROWS - 1, WIDE_MIN_ROWS, 300):
        x = torch.randn(rows, 576, dtype=torch.bfloat16)
        got = lin(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
        if rows < WIDE_MIN_ROWS:  # narrow steps keep the bf16 kernel, bit for bit
            assert torch.equal(got, F.linear(x, weight, b))
            continue
        exact = x.double() @ weight.double().T  # fp32 sums of exactly widened inputs: within one bf16 rounding
        want = (exact.float().bfloat16().double() + (b.double() if bias else 0))
        torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2)


# Bf16MatmulLinear runs only where oneDNN packs bf16 (bf16_matmul_pays requires it): elsewhere fp32 layers keep
# fp32 matmuls, which test_a_bf16_weight_onednn_refuses_falls_back_to_f_linear checks.
@needs_bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_fp32_layers_may_multiply_in_bf16_and_stay_within_bf16_rounding(bias):
    from pdserve.shared.linear import Bf16MatmulLinear

    torch.manual_seed(3)
    weight, x, residual = torch.randn(96, 48), torch.randn(40, 48), torch.randn(40, 96)
    b = torch.randn(96) if bias else None
    layer = Bf16MatmulLinear(weight, b)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (40, 96)
    err = ((got.double() - want).norm() / want.norm()).item()
    assert 1e-5 < err < 1e-2  # rounded to bf16 (so not fp32), but only that
    # The residual is added in fp32, after the matmul's rounding.
    assert torch.equal(layer(x, residual=residual), got + residual)
    # Rounded once, at packing: what the layer multiplies by is the bf16 weight.
    assert torch.equal(layer.dense_weight(), weight.bfloat16().float())


@needs_bf16_packing
@pytest.mark.parametrize("activation,fn", [("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh")),
                                           ("relu", F.relu), (None, lambda t: t)])
def test_a_bf16_output_takes_its_bias_and_activation_in_the_matmul(activation, fn):
    from pdserve.shared.linear import Bf16MatmulLinear

    torch.manual_seed(4)
    weight, bias, x = torch.randn(64, 32) * 0.2, torch.randn(64), torch.randn(24, 32)
    got = Bf16MatmulLinear(weight, bias, activation=activation, bf16_output=activation is None)(x)
    want = fn(F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias.bfloat16().float()))
    assert got.dtype == torch.bfloat16  # it feeds the next bf16 matmul as it is
    assert torch.allclose(got.float(), want, atol=2e-2, rtol=1e-2)
    with pytest.raises(ValueError, match="swish"):
        Bf16MatmulLinear(weight, bias, activation="swish")


def test_the_fp32_matmul_choice_can_be_forced(monkeypatch):
    from pdserve.shared import linear

    for choice, expected in [("f32", False), ("bf16", linear._packs_bf16())]:
        monkeypatch.setattr(linear, "_bf16_matmul", None)
        monkeypatch.setenv("PDSERVE_CPU_FP32_MATMUL", choice)
        assert linear.bf16_matmul_pays() is expected
    monkeypatch.setattr(linear, "_bf16_matmul", None)
    monkeypatch.setenv("PDSERVE_CPU_FP32_MATMUL", "tf32")
    with pytest.raises(ValueError, match="auto, bf16 or f32"):
        linear.bf16_matmul_pays()


@pytest.mark.parametrize("packs", [True, False])  # False: oneDNN refuses bf16 weights (AVX2-only CPUs)
@pytest.mark.parametrize("amx,vendor,avx512_bf16,faster", [
    (True, "GenuineIntel", True, True),       # AMX tiles
    (False, "GenuineIntel", True, False),     # AVX512-BF16 dot products only: slower than fp32 on Xeons
    (False, "AuthenticAMD", True, True),      # Zen 4 and later: twice fp32's rate
    (False, "AuthenticAMD", False, False),    # no bf16 instructions: emulated (Zen 2/3, AVX2 only)
])
def test_bf16_or_fp32_is_chosen_from_the_cpu(monkeypatch, amx, vendor, avx512_bf16, faster, packs):
    monkeypatch.setattr(linear, "amx_usable", lambda: amx)
    monkeypatch.setattr(linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(linear, "_has_avx512_bf16", lambda: avx512_bf16)
    monkeypatch.setattr(linear, "_packs_bf16", lambda: packs)
    monkeypatch.delenv("PDSERVE_CPU_FP32_MATMUL", raising=False)
    monkeypatch.delenv("PDSERVE_CPU_WIDE_MATMUL", raising=False)
    monkeypatch.setattr(linear, "_bf16_matmul", None)
    monkeypatch.setattr(linear, "_wide_f32", None)
    assert linear.bf16_computes_faster() is faster
    assert linear.cpu_has_bf16() is (amx or avx512_bf16)
    assert linear.bf16_matmul_pays() is (faster and packs)
    assert linear.wide_f32_pays() is (not faster and torch.backends.mkldnn.is_available())


def test_the_matmul_kernel_choice_can_be_forced_and_a_bf16_layer_follows_it(monkeypatch):
    weight = torch.randn(40, 64, dtype=torch.bfloat16)
    for choice, fixed in [("fixed", True), ("onednn", False)]:
        monkeypatch.setattr(linear, "_matmul_choice", None)
        monkeypatch.setenv("PDSERVE_CPU_MATMUL", choice)
        assert linear.fixed_order_pays() is fixed and linear.fixed_order_head_pays() is fixed
        assert (Linear(weight)._fixed is not None) is (fixed and native_available())
        head = Linear(weight, fp32_output=True)  # past HEAD_FIXED_ROWS rows: as forced; decode rows read bf16
        assert (head._fixed is not None and head._fixed_rows is None) is (fixed and native_available())
        assert Linear(weight.float())._fixed is None  # fp32 layers keep oneDNN: the probe times bf16 only
    monkeypatch.setattr(linear, "_matmul_choice", None)
    monkeypatch.setenv("PDSERVE_CPU_MATMUL", "mkl")
    with pytest.raises(ValueError, match="auto, fixed or onednn"):
        linear.fixed_order_pays()


def timings(layers: float, head: float) -> list[Timing]:
    """Probe timings in which the fixed-order kernel takes `layers` (bf16 layers) and `head` (the LM head) times
    oneDNN's time, at every row count of the probe."""
    from pdserve.shared.matmul_choice import PROBE_ROWS, PROBE_SHAPES

    return [Timing(name, r, 100.0 * r * (head if fp32 else layers), 100.0 * r)
            for name, _, fp32 in PROBE_SHAPES for r in PROBE_ROWS]


@pytest.mark.parametrize("layers,head", [(0.8, 0.9), (1.04, 1.2), (1.2, 0.5), (1.3, 1.06)])
def test_the_faster_kernel_is_chosen_with_a_small_allowance_for_the_fixed_order_one(layers, head):
    from pdserve.shared.matmul_choice import TOLERANCE, decide

    choice = decide(timings(layers, head), "test")
    assert choice.layers is (layers <= TOLERANCE) and choice.head is (head <= TOLERANCE)
    assert choice.ratio(False) == pytest.approx(layers) and choice.ratio(True) == pytest.approx(head)
    # One slow row count does not outvote the others: a geometric mean over the row counts.
    mixed = [Timing(t.shape, t.rows, t.onednn_us * (3.0 if t.rows == 1 else 0.8), t.onednn_us)
             for t in timings(1, 1)]
    assert decide(mixed, "test").layers is False  # 3 x 0.8^3 = 1.54


@pytest.fixture
def probe_here(monkeypatch, tmp_path):
    """The start-up probe on a fake machine: a CPU model and native build of the test's choosing, a cache in
    tmp_path, and a probe that answers `timings(...)` and counts its calls."""
    from pdserve.kernels import native

    calls = []
    machine = {"cpu": "Test CPU 1", "build": "build-a", "timings": timings(0.8, 1.5)}
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_CPU_MATMUL", raising=False)
    monkeypatch.setattr(native, "available", lambda: True)
    monkeypatch.setattr(native, "build_dir", lambda march=None: tmp_path / "kernels" / machine["build"])
    monkeypatch.setattr(linear, "_cpu_model", lambda: machine["cpu"])
    monkeypatch.setattr(linear, "probe", lambda: calls.append(1) or machine["timings"])

    def start() -> tuple[bool, bool]:
        monkeypatch.setattr(linear, "_matmul_choice", None)  # as a new process finds it
        return linear.fixed_order_pays(), linear.fixed_order_head_pays()

    return start, calls, machine


def test_the_choice_is_timed_once_per_cpu_model_and_build_then_read_back(probe_here, tmp_path):
    import json

    start, calls, machine = probe_here
    assert start() == (True, False) and len(calls) == 1  # measured: layers 0.8x, the head 1.5x oneDNN's time
    (cached,) = (tmp_path / "matmul").glob("*.json")
    record = json.loads(cached.read_text())
    assert record["cpu"] == "Test CPU 1" and record["native_build"] == "build-a" and len(record["timings"]) == 20
    machine["timings"] = timings(1.5, 0.8)  # a busy machine would time otherwise now: the cached choice holds
    assert start() == (True, False) and len(calls) == 1
    machine["build"] = "build-b"  # another native build (sources, torch, -march): timed again
    assert start() == (False, True) and len(calls) == 2
    machine["cpu"] = "Test CPU 2"
    assert start() == (False, True) and len(calls) == 3
    assert len(list((tmp_path / "matmul").glob("*.json"))) == 3
    cached.write_text("{not json")  # a damaged file costs one probe, not the start
    machine.update(cpu="Test CPU 1", build="build-a")
    assert start() == (False, True) and len(calls) == 4
    assert json.loads(cached.read_text())["layers_ratio"] == pytest.approx(1.5)


def test_the_choice_still_starts_where_the_cache_cannot_be_written(probe_here, tmp_path):
    start, calls, _ = probe_here
    (tmp_path / "matmul").write_text("a file where the cache's folder should be")
    assert start() == (True, False) and len(calls) == 1


@pytest.mark.skipif(not native_available(), reason="no native build: every layer runs oneDNN, nothing to time")
def test_the_probe_times_both_kernels_on_this_cpu_and_leaves_the_threads_as_they_were():
    threads = torch.get_num_threads()
    shapes = (("small", (64, 96), False), ("head", (128, 96), True))
    got = linear.probe(reps=2, rows=(1, 5), shapes=shapes, threads=1)
    assert [(t.shape, t.rows) for t in got] == [("small", 1), ("small", 5), ("head", 1), ("head", 5)]
    assert all(t.fixed_us > 0 and t.onednn_us > 0 for t in got)
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("head_fixed", [True, False])  # False: oneDNN over an fp32 copy (AMX until measured)
def test_the_lm_head_takes_its_own_choice_and_deterministic_mode_keeps_the_fixed_order_kernel(monkeypatch,
                                                                                            head_fixed):
    monkeypatch.setattr(linear, "_matmul_choice", MatmulChoice(True, head_fixed, (), "test"))
    torch.manual_seed(5)
    weight = (torch.randn(200, 96) * 0.1).bfloat16()
    x = torch.randn(12, 96).bfloat16()  # past HEAD_FIXED_ROWS: the measured choice's kernel
    want = x.double() @ weight.double().T
    head = Linear(weight, fp32_output=True)
    assert (head._fixed is not None and head._fixed_rows is None) is (head_fixed and native_available())
    got = head(x)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)  # fp32 sums, not rounded to bf16
    if native_available():
        assert Linear(weight, fp32_output=True, batch_invariant=True)._fixed is not None
        assert Linear(weight.float(), fp32_output=True)._fixed is not None  # fp32 weights: as before the probe


@pytest.mark.skipif(not native_available(), reason="no native build: the LM head multiplies an fp32 copy")
def test_a_bf16_lm_head_decodes_from_its_bf16_weight_with_the_bits_of_deterministic_mode(monkeypatch):
    """Where wide steps take oneDNN over an fp32 copy, a decode step's few rows still read the bf16 weight (half
    the bytes) on the fixed-order kernel: fp32 logits within fp32 rounding of exact sums, and bit for bit what
    deterministic mode's batch-invariant head gives at every row count up to HEAD_FIXED_ROWS."""
    monkeypatch.setattr(linear, "_matmul_choice", MatmulChoice(True, False, (), "test"))
    torch.manual_seed(6)
    weight, bias = (torch.randn(300, 160) * 0.1).bfloat16(), torch.randn(300).bfloat16()
    head = Linear(weight, bias, fp32_output=True)
    exact = Linear(weight, bias, fp32_output=True, batch_invariant=True)
    x = torch.randn(linear.HEAD_FIXED_ROWS + 1, 160).bfloat16()
    want = x.double() @ weight.double().T + bias.double()
    called: list[int] = []
    fixed = head._fixed
    monkeypatch.setattr(head, "_fixed", lambda x, *a: called.append(x.shape[0]) or fixed(x, *a))
    for rows in range(1, linear.HEAD_FIXED_ROWS + 2):
        got = head(x[:rows])
        assert got.dtype == torch.float32 and got.shape == (rows, 300)
        torch.testing.assert_close(got.double(), want[:rows], rtol=1e-5, atol=1e-5)
        if rows <= linear.HEAD_FIXED_ROWS:
            assert torch.equal(got, exact(x[:rows])) and torch.equal(got[:1], exact(x[:1]))
    assert called == list(range(1, linear.HEAD_FIXED_ROWS + 1))  # past them: oneDNN over the fp32 copy
    assert Linear(weight, fp32_output=True, fixed=False)._fixed is None  # the probe's oneDNN side stays oneDNN




def test_dtype_auto_serves_bf16_checkpoints_in_fp32_on_a_cpu_without_bf16_instructions(monkeypatch):
    from pdserve.shared.model_runner import resolve_dtype

    # torch's own probes answering as on an AVX2-only AMD EPYC
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not linear.cpu_has_bf16()
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.float32
    assert resolve_dtype("auto", "float16", "cpu") == torch.float32
    assert resolve_dtype("bfloat16", "bfloat16", "cpu") == torch.bfloat16  # asked for: served as asked
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert resolve_dtype("auto", "bfloat16", "cpu") == torch.bfloat16

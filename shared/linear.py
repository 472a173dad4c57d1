"""Linear: one weight matmul of the model, prepared once at load time for the device it runs on.

On CPU the weight is packed once into oneDNN's blocked layout, so a forward pass skips the re-layout
that `F.linear` does on every call. Measured on the default model's shapes in bf16: 2x faster at
batch 1, 1.1-1.3x at 32-64 tokens, results bit-identical to `F.linear`. Elsewhere (CUDA, fp16, or a
CPU whose oneDNN cannot pack the dtype) it is a plain `F.linear`.

A step of at most GEMV_MAX_ROWS[dtype] tokens (decoding one or a few sequences) only streams the weights once,
and there the native GEMV (kernels/native/gemv.cpp) reads them faster than oneDNN: bf16 1.5-2.7x at 1-4 rows
(AVX512-BF16), fp32 1.6-1.7x at one row on an AVX2 build, which loses to oneDNN's AVX2 kernel at four (0.8-1.3x,
docs/performance/runtime.md, "Native kernels on AVX2-only CPUs"), so fp32 takes it up to two rows. The layer keeps
the plain weight for it beside the packed one.

Wide steps (prefill, at least WIDE_MIN_ROWS tokens) are bound by arithmetic, and how bf16 compares with fp32
there depends on the CPU. With AMX tiles bf16 multiplies 4-10x faster than fp32; on AMD's AVX512-BF16 cores
(Zen 4 and later) oneDNN's bf16 kernels run 2.0x faster than its fp32 ones at every MiniLM and SmolLM2 shape
from 256 to 2,048 rows; on an Intel Xeon with AVX512-BF16 but no AMX they measured 1.45x slower (256 rows of
the default model's shapes), and a CPU without bf16 instructions emulates them. `bf16_computes_faster` holds
that table, decided from the CPU rather than by timing: a timing taken while other processes load the two
cores could flip the choice, and with it the numerics, from one start to the next.

Where bf16 is the slower one, a bf16 layer also keeps an fp32 packed copy of its weight and computes wide steps
in fp32 (inputs widened exactly, fp32 accumulation as in the bf16 kernel, output rounded back to bf16:
`wide_f32_pays`, PDSERVE_CPU_WIDE_MATMUL=bf16|f32 overrides it). Where bf16 is the faster one, an fp32 layer
of an embedding model keeps its activations, bias and residual in fp32 and runs only the matmul in bf16 (inputs
rounded, fp32 accumulation): Bf16MatmulLinear, `bf16_matmul_pays`, PDSERVE_CPU_FP32_MATMUL=bf16|f32 overrides it.

Deterministic mode's layers (`batch_invariant`) never take oneDNN, whose kernel (and with it the order in which a
row's products are summed) changes with the number of rows and with the CPU (AMX tiles at some row counts,
AVX-512 at others): they run the native fixed-order matmul (FixedOrderMatmul, kernels/native/dense.cpp), which
sums every output in one lane from the first k to the last, so a row has the same bits at every row count by
construction. In the default mode the bf16 layers and the layers with fp32 output (the LM head, whose fp32 sums
are the logits) run on whichever kernel measured faster on this machine (shared/matmul_choice.py: timed once
per CPU model and native build, then read back; `fixed_order_pays`, `fixed_order_head_pays`); but a bf16 LM head
decoding (up to HEAD_FIXED_ROWS rows) reads its bf16 weight: oneDNN's fp32 copy is twice the bytes (1.3 vs 5.7 ms).
"""
from __future__ import annotations

import logging
import os
import platform

import torch
import torch.nn.functional as F

from pdserve.kernels import native
from pdserve.shared.huge_pages import place
from pdserve.shared.matmul_choice import (PROBE_ROWS, PROBE_SHAPES, MatmulChoice, Timing, cache_key,
                                          load_or_measure, time_pair)

log = logging.getLogger(__name__)


GEMV_MAX_ROWS = {torch.bfloat16: 4, torch.float32: 2}  # where the native GEMV runs, when the build has it
# From this many rows a step may run its bf16 matmuls in fp32 (see above); below, bf16 measured as fast or
# faster (0.74x at 8 rows, 1.05x at 32, 1.24x at 64, 1.45x at 256 on the 2-core Xeon).
WIDE_MIN_ROWS = 64
HEAD_FIXED_ROWS = 8  # one register tile of the fixed-order kernel: its rows read the weight once


class Linear:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_invariant: bool = False,
                 fp32_output: bool = False, fixed: bool | None = None) -> None:
        """`batch_invariant`: a row's result does not depend on the other rows computed with it (deterministic
        mode): every row count runs the fixed-order kernel (FixedOrderMatmul), never oneDNN, whose kernel and
        summation order change with the row count and the CPU. `fp32_output`: return fp32 whatever the weight's
        dtype (the LM head: logits are sampled in fp32, not rounded to bf16 first). `fixed`: whether a CPU layer
        runs the fixed-order kernel where it can (None: as measured on this CPU, `fixed_order_pays` for bf16
        layers, `fixed_order_head_pays` for fp32 outputs of bf16 weights; the probe times bf16 weights only, so
        fp32 weights keep what they ran before it: oneDNN, or the fixed-order kernel for an fp32 output)."""
        self.shape = weight.shape  # [out_features, in_features]
        self.dtype = weight.dtype
        self.bias = bias
        self.fp32_output = fp32_output
        narrow = fixed is None and fp32_output and weight.dtype == torch.bfloat16  # see HEAD_FIXED_ROWS above
        if fixed is None and weight.device.type == "cpu":
            bf16 = weight.dtype == torch.bfloat16
            fixed = (not bf16 or fixed_order_head_pays()) if fp32_output else bf16 and fixed_order_pays()
        self._fixed = FixedOrderMatmul.make(weight, bias) if batch_invariant or fixed or narrow else None
        if batch_invariant and self._fixed is None:
            raise ValueError("a batch-invariant layer needs the native CPU kernels' fixed-order matmul (a CPU "
                             "weight in float32 or bfloat16 and a native build)")
        self._fixed_rows = HEAD_FIXED_ROWS if narrow and not (fixed or batch_invariant) else None  # None: any
        fixed = self._fixed is not None and self._fixed_rows is None
        # On CUDA, and on a CPU without the native build, an fp32 output comes from fp32 arithmetic: cuBLAS writes
        # fp32 from bf16 operands; the CPU fallback keeps an fp32 copy of the weight.
        cpu_f32 = fp32_output and not fixed and weight.device.type == "cpu" and weight.dtype != torch.float32
        self._packed = None if fixed else _pack(weight.float() if cpu_f32 else weight)
        self._weight = None if fixed or self._packed is not None else (weight.float() if cpu_f32 else weight)
        self._gemv_weight = None if fixed or fp32_output else _gemv_weight(weight)
        self._gemv = native.load().gemv if self._gemv_weight is not None else None
        self._gemv_rows = GEMV_MAX_ROWS.get(weight.dtype, 0)
        wide = (not fixed and not fp32_output and self._packed is not None and weight.dtype == torch.bfloat16
                and wide_f32_pays())
        self._packed_f32 = _pack(weight.float()) if wide else None

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in_features] -> [T, out_features], plus `residual` [T, out_features] when given."""
        if self._fixed is not None and (self._fixed_rows is None or x.shape[0] <= self._fixed_rows):
            return self._fixed(x, residual, self.fp32_output)
        out = self._matmul(x)
        return out if residual is None else out.add_(residual)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.fp32_output:
            return self._matmul_f32(x)
        if self._gemv_weight is not None and 0 < rows <= self._gemv_rows:
            out = self._gemv(x.contiguous(), self._gemv_weight)
            return out if self.bias is None else out.add_(self.bias)
        if self._packed_f32 is not None and rows >= WIDE_MIN_ROWS:
            out = torch.ops.mkldnn._linear_pointwise(x.float(), self._packed_f32, None, "none", [], "")
            out = out.to(x.dtype)
            return out if self.bias is None else out.add_(self.bias)
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self._weight, self.bias)

    def _matmul_f32(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.float()
        if x.device.type == "cuda":
            out = torch.mm(x, self._weight.t(), out_dtype=torch.float32)
            return out if bias is None else out.add_(bias)
        if self._packed is not None:  # an fp32 copy (see __init__)
            return torch.ops.mkldnn._linear_pointwise(x.float(), self._packed, bias, "none", [], "")
        return F.linear(x.float(), self._weight.float(), bias)

    @property
    def is_packed(self) -> bool:
        return self._packed is not None or self._fixed is not None

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()

    def dense_weight(self) -> torch.Tensor:
        """The weight in its plain [out, in] layout (a copy when packed): for inspection, not the hot path."""
        if self._fixed is not None:
            return self._fixed.dense_weight()
        weight = self._weight if self._packed is None else self._packed.to_dense()
        return weight.to(self.dtype)


class FixedOrderMatmul:
    """x W^T (+ bias) (+ residual) by the native kernel that sums every output in one fixed order
    (kernels/native/dense.cpp): a row gets the same bits at every row count, on every CPU the build runs on, by
    construction. Its weight is packed once in the kernel's layout; bf16 or fp32 results, or fp32 from bf16."""

    def __init__(self, lib, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        (n, k), self._kernel, pair = weight.shape, lib.dense_linear, lib.dense_pair(weight)
        pn, pk = -(-n // DENSE_BLOCK) * DENSE_BLOCK, -(-k // pair) * pair
        padded = weight.new_zeros(pn, pk)
        padded[:n, :k] = weight
        self.shape = (n, k)
        blocked = padded.view(pn // DENSE_BLOCK, DENSE_BLOCK, pk // pair, pair).permute(0, 2, 1, 3)
        self.packed = place(blocked.contiguous())  # in 2 MiB pages (shared/huge_pages.py)
        self.bias = None if bias is None else F.pad(bias.float(), (0, pn - n)).contiguous()

    @classmethod
    def make(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> FixedOrderMatmul | None:
        """The layer, where the kernel can compute it: a CPU weight in fp32 or bf16 and a native build."""
        if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
            return None
        try:
            lib = native.load()
        except native.NativeUnavailable:
            return None
        return cls(lib, weight.contiguous(), bias)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None, fp32_output: bool = False):
        if x.stride(-1) != 1:
            x = x.contiguous()
        out_dtype = torch.float32 if fp32_output else x.dtype
        fused = residual if residual is not None and residual.dtype == out_dtype and residual.stride(-1) == 1 else None
        out = self._kernel(x, self.packed, self.shape[0], self.bias, fused, fp32_output)
        return out if residual is None or fused is not None else out.add_(residual)

    def dense_weight(self) -> torch.Tensor:
        blocks, groups, _, pair = self.packed.shape
        n, k = self.shape
        return self.packed.permute(0, 2, 1, 3).reshape(blocks * DENSE_BLOCK, groups * pair)[:n, :k].clone()


DENSE_BLOCK = 32  # output channels per block of the fixed-order kernel's packed weight


def _pack(weight: torch.Tensor) -> torch.Tensor | None:
    if weight.device.type != "cpu" or weight.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError:  # this CPU or build lacks the instructions oneDNN needs for the dtype
        return None


def _gemv_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The plain weight the native GEMV reads, in 2 MiB pages, where this build has a path for it (gemv_supported)."""
    if weight.device.type != "cpu" or weight.dtype not in GEMV_MAX_ROWS:
        return None
    try:
        lib = native.load()
    except native.NativeUnavailable:
        return None
    weight = weight.contiguous()
    return place(weight) if lib.gemv_supported(weight) else None


class Bf16MatmulLinear:
    """An fp32 layer whose matmul runs in bf16 on the CPU: x [T, in] -> [T, out] float32. The weight is rounded
    to bf16 once and packed; each call rounds the input to bf16, multiplies with fp32 accumulation, and adds
    bias and residual in fp32. Against the fp32 layer: relative error about 3e-3 per matmul; on
    all-MiniLM-L6-v2 the embeddings stay at cosine 0.9999 or more from fp32's.

    With `bf16_output` the layer returns x W + b in bf16, the bias added in the matmul's epilogue, and with
    `activation` (a oneDNN post-op: "gelu", "gelu_tanh" or "relu") activation(x W + b): meant for outputs that
    only feed more bf16 arithmetic, such as attention's q, k and v or an MLP's up-projection (on MiniLM those
    two save a third of the forward)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str | None = None,
                 bf16_output: bool = False) -> None:
        if activation not in POST_OPS:
            raise ValueError(f"activation {activation!r} has no oneDNN post-op here")
        self.shape = weight.shape
        self.dtype = torch.float32
        self.bias = None if bias is None else bias.float()
        self._epilogue = POST_OPS[activation] if activation is not None or bf16_output else None
        self._bias_bf16 = None if bias is None or self._epilogue is None else bias.to(torch.bfloat16)
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16).contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        x = x.to(torch.bfloat16)
        if self._epilogue is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self._bias_bf16, *self._epilogue)
        out = torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "").float()
        if self.bias is not None:
            out.add_(self.bias)
        return out if residual is None else out.add_(residual)

    def dense_weight(self) -> torch.Tensor:
        return self._packed.to_dense().float()


# Activation name -> the (attr, scalars, algorithm) that torch's oneDNN linear takes as its fused post-op.
POST_OPS = {None: ("none", [], ""), "gelu": ("gelu", [], "none"), "gelu_tanh": ("gelu", [], "tanh"),
            "relu": ("relu", [], "")}


_bf16_matmul: bool | None = None


def bf16_matmul_pays() -> bool:
    """Whether fp32 layers on the CPU should multiply in bf16 (Bf16MatmulLinear): where bf16 computes faster
    on this CPU (`bf16_computes_faster`), or as PDSERVE_CPU_FP32_MATMUL says."""
    global _bf16_matmul
    if _bf16_matmul is None:
        choice = _choice("PDSERVE_CPU_FP32_MATMUL")
        _bf16_matmul = _packs_bf16() and (choice == "bf16" or (choice == "auto" and bf16_computes_faster()))
        log.info("fp32 CPU matmuls run in %s", "bf16" if _bf16_matmul else "fp32")
    return _bf16_matmul


def bf16_computes_faster() -> bool:
    """Whether oneDNN's wide bf16 matmuls beat its fp32 ones on this CPU (measured: see the module's text)."""
    return amx_usable() or (_cpu_vendor() == "AuthenticAMD" and _has_avx512_bf16())


def cpu_has_bf16() -> bool:
    """The CPU multiplies bf16 with instructions of its own (AVX512-BF16 or AMX) rather than emulating them."""
    return amx_usable() or _has_avx512_bf16()


def amx_usable() -> bool:
    """The CPU has AMX tiles and the kernel lets this process use them."""
    cpu = torch.cpu
    try:
        return bool(cpu._is_amx_tile_supported() and cpu._init_amx())
    except AttributeError:  # a torch without these probes: assume none
        return False


def _has_avx512_bf16() -> bool:
    try:
        return bool(torch.cpu._is_avx512_bf16_supported())
    except AttributeError:
        return False


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _choice(variable: str) -> str:
    choice = os.environ.get(variable, "auto")
    if choice not in ("auto", "bf16", "f32"):
        raise ValueError(f"{variable} must be auto, bf16 or f32, got {choice!r}")
    return choice


def _packs_bf16() -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16))
        return True
    except RuntimeError:
        return False


_matmul_choice: MatmulChoice | None = None


def fixed_order_pays() -> bool:
    """Whether the bf16 layers of the default mode run the fixed-order kernel on this CPU rather than oneDNN and
    the GEMV: as timed on this CPU model and native build (shared/matmul_choice.py), or as PDSERVE_CPU_MATMUL=
    fixed|onednn says. A layer on it also gives a row the same bits at every row count, though only deterministic
    mode promises that."""
    return _choice_here().layers


def fixed_order_head_pays() -> bool:
    """Whether the layers with fp32 output (the LM head) run the fixed-order kernel on this CPU rather than oneDNN
    over an fp32 copy of the weight: as timed (shared/matmul_choice.py), or as PDSERVE_CPU_MATMUL says."""
    return _choice_here().head


def _choice_here() -> MatmulChoice:
    global _matmul_choice
    if _matmul_choice is None:
        choice = os.environ.get("PDSERVE_CPU_MATMUL", "auto")
        if choice not in ("auto", "fixed", "onednn"):
            raise ValueError(f"PDSERVE_CPU_MATMUL must be auto, fixed or onednn, got {choice!r}")
        if choice != "auto":
            _matmul_choice = MatmulChoice(choice == "fixed", choice == "fixed", (), f"PDSERVE_CPU_MATMUL={choice}")
        elif not native.available():
            _matmul_choice = MatmulChoice(False, False, (), "no native build")
        else:
            build = native.build_dir().name
            model = _cpu_model()
            _matmul_choice = load_or_measure(cache_key(model, build), probe,
                                             {"cpu": model, "native_build": build, "torch": torch.__version__})
        log.info("bf16 CPU matmuls run on %s, fp32-output ones (the LM head) on %s (%s)",
                 *("the fixed-order kernel" if c else "oneDNN" for c in (_matmul_choice.layers, _matmul_choice.head)),
                 _matmul_choice.source)
    return _matmul_choice


def probe(reps: int = 9, rows: tuple[int, ...] = PROBE_ROWS, shapes=PROBE_SHAPES, threads: int = 1) -> list[Timing]:
    """Both kernels at each of `shapes` and `rows` (shared/matmul_choice.py) on `threads` threads, as the layers
    of the default mode run them (oneDNN's side with the GEMV at its rows, and over an fp32 copy for fp32
    outputs)."""
    before = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    timings = []
    torch.set_num_threads(threads)
    try:
        for name, (n, k), fp32 in shapes:
            weight = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
            fixed, onednn = Linear(weight, fp32_output=fp32, fixed=True), Linear(weight, fp32_output=fp32, fixed=False)
            for r in rows:
                x = torch.randn(r, k, generator=gen).bfloat16()
                timings.append(Timing(name, r, *time_pair(lambda: fixed(x), lambda: onednn(x), reps)))
    finally:
        torch.set_num_threads(before)
    return timings


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_wide_f32: bool | None = None


def wide_f32_pays() -> bool:
    """Whether wide bf16 matmuls should run in fp32 on this CPU: where bf16 computes slower
    (`bf16_computes_faster`), or as PDSERVE_CPU_WIDE_MATMUL says."""
    global _wide_f32
    if _wide_f32 is None:
        choice = _choice("PDSERVE_CPU_WIDE_MATMUL")
        auto = torch.backends.mkldnn.is_available() and not bf16_computes_faster()
        _wide_f32 = auto if choice == "auto" else choice == "f32"
        log.info("wide CPU matmuls of bf16 weights run in %s", "fp32" if _wide_f32 else "bf16")
    return _wide_f32

"""Time each native CPU kernel's builds against its torch twin, on the default model's shapes, in one table.

    python benchmarks/bench_native.py                       # this CPU's build, the AVX2 build, torch
    python benchmarks/bench_native.py --marches native      # one build only

Each -march is built once (kernels/native: `load(march)`) and loaded side by side in this process, so on an
AVX-512 machine the AVX2 paths (x86-64-v3) run on the same core as the AVX-512 ones. The torch twins run twice:
as this CPU runs them, and in a child process with ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2, which is
how torch runs on an AVX2-only CPU (oneDNN then refuses bf16 weights, as it does there). GEMV rows compare with
the layer the product would otherwise use: oneDNN's packed weight where it packs the dtype, else F.linear.
Medians of --reps calls, microseconds, --threads threads.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 576, 1536, 9, 3, 64, 49152  # SmolLM2-135M
PAGE = 16


def timed(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2] * 1e6


def paged(lens: list[int], dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    pages = [math.ceil(n / PAGE) for n in lens]
    pool = torch.randn(sum(pages) + 1, 2, PAGE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    order = torch.randperm(sum(pages), generator=gen).tolist()
    table, i = [], 0
    for p in pages:
        table.append(order[i:i + p] + [0] * (max(pages) - p))
        i += p
    return pool[:, 0], pool[:, 1], torch.tensor(table, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)


def cases(dtype: torch.dtype) -> dict[str, tuple[Callable, Callable[[object], Callable]]]:
    """{name: (torch twin thunk, lib -> native thunk)} on the default model's shapes."""
    from pdserve.kernels.decode_attention import decode_attention_torch
    from pdserve.kernels.extend_attention import extend_attention_torch
    from pdserve.kernels.rmsnorm import rmsnorm_torch
    from pdserve.kernels.rotary_kv import rotary_store_kv_torch
    from pdserve.kernels.silu_mul import silu_and_mul_torch
    from pdserve.kernels.token_mask import apply_token_mask_torch

    gen = torch.Generator().manual_seed(1)
    out: dict[str, tuple[Callable, Callable[[object], Callable]]] = {}
    for rows in (1, 32):
        x, r = torch.randn(rows, HIDDEN, generator=gen).to(dtype), torch.randn(rows, HIDDEN, generator=gen).to(dtype)
        w = torch.ones(HIDDEN, dtype=dtype)
        out[f"rmsnorm+residual [{rows} x {HIDDEN}]"] = (
            lambda x=x, w=w, r=r: rmsnorm_torch(x, w, 1e-5, r),
            lambda lib, x=x, w=w, r=r: lambda: lib.rmsnorm(x, w, 1e-5, r))
        gu = torch.randn(rows, 2 * INTER, generator=gen).to(dtype)
        out[f"silu_mul [{rows} x {2 * INTER}]"] = (lambda gu=gu: silu_and_mul_torch(gu),
                                                   lambda lib, gu=gu: lambda: lib.silu_and_mul(gu))
        qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
        cs = torch.randn(rows, HEAD_DIM, generator=gen)
        k_cache, v_cache, _, _ = paged([rows + PAGE], dtype)
        slots = torch.arange(rows, dtype=torch.int64)
        out[f"rotary + KV store [{rows} tokens]"] = (
            lambda a=(qkv, cs, k_cache, v_cache, slots): rotary_store_kv_torch(*a, HEADS, KV_HEADS),
            lambda lib, a=(qkv, cs, k_cache, v_cache, slots): lambda: lib.rotary_store_kv(*a, HEADS, KV_HEADS))
    for batch, ctx in ((1, 512), (32, 256)):
        kc, vc, table, lens = paged([ctx] * batch, dtype)
        q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)
        out[f"decode attention [{batch} x {ctx} ctx]"] = (
            lambda a=(q, kc, vc, table, lens): decode_attention_torch(*a, 0.125),
            lambda lib, a=(q, kc, vc, table, lens): lambda: lib.decode_attention(*a, 0.125))
    for ext, ctx in ((128, 128), (32, 512), (66, 530), (2048, 2048)):
        kc, vc, table, lens = paged([ctx], dtype)
        q = torch.randn(ext, HEADS, HEAD_DIM, generator=gen).to(dtype)
        e, s = torch.tensor([ext], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
        a = (q, kc, vc, table, lens, e, s)
        out[f"extend attention [{ext} new of {ctx}]"] = (
            lambda a=a: extend_attention_torch(*a, 0.125), lambda lib, a=a: lambda: lib.extend_attention(*a, 0.125))
        # The tiled kernel: bf16 on AVX512-BF16 builds only.
        out[f"extend attention, tiled [{ext} new of {ctx}]"] = (
            lambda a=a: extend_attention_torch(*a, 0.125),
            lambda lib, a=a: ((lambda: lib.extend_attention_tiled(*a, 0.125))
                              if a[0].dtype == torch.bfloat16 and lib.tiled_extend_supported(HEAD_DIM) else None))
    logits = torch.randn(4, VOCAB, generator=gen).to(dtype)
    mask = torch.randint(-2**31, 2**31 - 1, (4, VOCAB // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    out[f"token mask [4 x {VOCAB}]"] = (lambda: apply_token_mask_torch(logits.clone(), mask),
                                        lambda lib: lambda: lib.apply_token_mask(logits.clone(), mask))
    for rows in (1, 4):
        for name, (o, i) in {"qkv": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "gate_up": (2 * INTER, HIDDEN),
                             "down": (HIDDEN, INTER)}.items():
            weight = (torch.randn(o, i, generator=gen) * 0.05).to(dtype)
            x = torch.randn(rows, i, generator=gen).to(dtype)
            out[f"gemv {name} [{rows} x {i}] x [{i} x {o}]"] = (
                _torch_linear(weight, x),
                lambda lib, x=x, w=weight: (lambda: lib.gemv(x, w)) if lib.gemv_supported(w) else None)
    return out


def _torch_linear(weight: torch.Tensor, x: torch.Tensor) -> Callable:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        return lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except RuntimeError:  # oneDNN packs no bf16 here: the layer's F.linear
        return lambda: F.linear(x, weight)


def time_torch(dtype: torch.dtype, reps: int) -> dict[str, float]:
    return {name: timed(twin, reps) for name, (twin, _) in cases(dtype).items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marches", default="native,x86-64-v3")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the AVX2 child
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = [getattr(torch, d) for d in args.dtypes.split(",")]
    if args.torch_only:
        print(json.dumps({str(d): time_torch(d, args.reps) for d in dtypes}))
        return

    from pdserve.kernels import native

    env = dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2", ATEN_CPU_CAPABILITY="avx2")
    child = subprocess.run([sys.executable, __file__, "--torch-only", "--dtypes", args.dtypes, "--reps",
                            str(args.reps), "--threads", str(args.threads)], env=env, capture_output=True,
                           text=True, check=True)
    torch_avx2 = json.loads(child.stdout.strip().splitlines()[-1])
    libs = {m: native.load(m) for m in args.marches.split(",")}
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"{cpu}, torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), {args.threads} thread(s), "
          f"median of {args.reps}, microseconds")
    heads = ["torch", "torch AVX2"] + [f"native {lib.isa()}" for lib in libs.values()]
    print("| op | dtype | " + " | ".join(heads) + " | AVX2 / AVX-512 | AVX2 vs torch AVX2 |")
    print("|---|---|" + "---:|" * (len(heads) + 2))
    for dtype in dtypes:
        here = time_torch(dtype, args.reps)
        for name, (_, make) in cases(dtype).items():
            cells = [here[name], torch_avx2[str(dtype)][name]]
            for lib in libs.values():
                fn = make(lib)
                cells.append(timed(fn, args.reps) if fn is not None else float("nan"))
            ratio = cells[-1] / cells[-2] if len(libs) > 1 else float("nan")
            speedup = cells[1] / cells[-1]
            print(f"| {name} | {str(dtype).replace('torch.', '')} | "
                  + " | ".join("-" if math.isnan(c) else f"{c:.1f}" for c in cells)
                  + f" | {'-' if math.isnan(ratio) else f'{ratio:.2f}x'} | {'-' if math.isnan(speedup) else f'{speedup:.1f}x'} |",
                  flush=True)


if __name__ == "__main__":
    main()

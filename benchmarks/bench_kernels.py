"""Time each Triton kernel against its torch twin and report the bf16 error against an fp32 oracle.

    python benchmarks/bench_kernels.py              # CUDA: realistic shapes
    python benchmarks/bench_kernels.py --small      # smaller shapes (CPU: torch twins only)

Errors are max |out - oracle| where the oracle is the torch twin run in fp32 on the same
(bf16-rounded) inputs. Decode reports the KV bytes read per second.
"""
from __future__ import annotations

import argparse
import time

import torch

from pdserve.kernels import (build_cos_sin_cache, cos_sin_rows, decode_attention_torch, decode_attention_triton,
                             extend_attention_torch, extend_attention_triton, rmsnorm_torch, rmsnorm_triton,
                             rotary_torch, rotary_triton, silu_and_mul_torch, silu_and_mul_triton, store_kv_torch,
                             store_kv_triton)


def timed(fn, device: str, reps: int) -> float:
    """Median milliseconds of fn()."""
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def fp32(args):
    return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)


def max_err(out, ref) -> float:
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref if isinstance(ref, tuple) else (ref,)
    return max((o.float() - r.float()).abs().max().item() for o, r in zip(outs, refs))


def paged_batch(lens, page_size, hk, d, dtype, device, layers=2):
    pages = [-(-n // page_size) for n in lens]
    num_pages = sum(pages) + 1
    pool = torch.randn(num_pages, layers, 2, page_size, hk, d, dtype=dtype, device=device)
    order = torch.randperm(num_pages)[:sum(pages)].tolist()
    table, i = [], 0
    for p in pages:
        table.append(order[i:i + p] + [0] * (max(pages) - p))
        i += p
    page_table = torch.tensor(table, dtype=torch.int32, device=device)
    return pool[:, 1, 0], pool[:, 1, 1], page_table, torch.tensor(lens, dtype=torch.int32, device=device)


def cases(device: str, small: bool, dtype: torch.dtype):
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    T, H, I = (64, 576, 1536) if small else (4096, 4096, 11008)
    hq, hk, d = (9, 3, 64) if small else (32, 8, 128)
    yield "rmsnorm+residual", (rmsnorm_torch, rmsnorm_triton), (rnd(T, H), rnd(H), 1e-5, rnd(T, H)), T * H * 2 * 4
    yield "silu_and_mul", (silu_and_mul_torch, silu_and_mul_triton), (rnd(T, 2 * I),), T * I * 2 * 3
    cache = build_cos_sin_cache(d, 8192, 500000.0, None, device)
    rows = cos_sin_rows(cache, torch.randint(0, 8192, (T,), device=device))
    yield "rotary", (rotary_torch, rotary_triton), (rnd(T, hq + hk, d), rows), T * (hq + hk) * d * 4
    k_cache, v_cache, _, _ = paged_batch([T], 16, hk, d, dtype, device)
    slots = torch.randperm(k_cache.shape[0] * 16, device=device)[:T]
    yield "store_kv", (store_kv_torch, store_kv_triton), (rnd(T, hk, d), rnd(T, hk, d), k_cache, v_cache, slots), \
        T * hk * d * 2 * 4
    for hq_, hk_, d_ in [(9, 3, 64)] + ([] if small else [(32, 8, 128)]):
        for bs, lo, hi in ([(8, 100, 600)] if small else [(1, 4096, 4096), (64, 512, 4096), (256, 256, 2048)]):
            lens = torch.randint(lo, hi + 1, (bs,), generator=g).tolist()
            kc, vc, table, seq_lens = paged_batch(lens, 16, hk_, d_, dtype, device)
            yield (f"decode B={bs} len {lo}-{hi} Hq/Hk/D={hq_}/{hk_}/{d_}",
                   (decode_attention_torch, decode_attention_triton),
                   (rnd(bs, hq_, d_), kc, vc, table, seq_lens, d_ ** -0.5), sum(lens) * hk_ * d_ * 2 * 2)
        for prefix, new, bs in ([(0, 256, 1), (100, 30, 4)] if small else [(0, 2048, 1), (1024, 1024, 4), (0, 128, 32)]):
            lens = [prefix + new] * bs
            kc, vc, table, seq_lens = paged_batch(lens, 16, hk_, d_, dtype, device)
            ext = torch.full((bs,), new, dtype=torch.int32, device=device)
            starts = torch.arange(bs, dtype=torch.int32, device=device) * new
            yield (f"extend B={bs} prefix {prefix} new {new} Hq/Hk/D={hq_}/{hk_}/{d_}",
                   (extend_attention_torch, extend_attention_triton),
                   (rnd(bs * new, hq_, d_), kc, vc, table, seq_lens, ext, starts, d_ ** -0.5), 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--small", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    print(f"device {device} ({torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}), dtype {dtype}")
    print(f"{'op':58s} {'torch ms':>9s} {'triton ms':>9s} {'GB/s':>7s} {'err':>8s}")
    for name, (ref_fn, tri_fn), inputs, nbytes in cases(device, args.small, dtype):
        oracle_in = fp32(inputs)
        t_ref = timed(lambda: ref_fn(*inputs), device, args.reps)
        if device == "cuda":
            t_tri = timed(lambda: tri_fn(*inputs), device, args.reps)
            if name == "store_kv":  # in place: clear the caches, write once, compare what each wrote
                for t in (inputs[2], inputs[3], oracle_in[2], oracle_in[3]):
                    t.zero_()
                tri_fn(*inputs)
                ref_fn(*oracle_in)
                out, ref = (inputs[2], inputs[3]), (oracle_in[2], oracle_in[3])
            else:
                out, ref = tri_fn(*inputs), ref_fn(*oracle_in)
            err = f"{max_err(out, ref):8.4f}"
            gbs = f"{nbytes / t_tri / 1e6:7.0f}" if nbytes else "-"
            print(f"{name:58s} {t_ref:9.3f} {t_tri:9.3f} {gbs:>7s} {err}")
        else:
            print(f"{name:58s} {t_ref:9.3f} {'-':>9s}")


if __name__ == "__main__":
    main()

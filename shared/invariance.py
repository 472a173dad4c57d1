"""The start-time check of deterministic mode: every reduction of the model's step gives a row the same bits
alone and inside batches of several sizes, on this machine, before the first request.

Deterministic mode is batch-invariant by construction (a fixed-order matmul, row-wise norms, attention that
reads each query's keys in one order), but the construction rests on the compiler, the native build and the
CPU's arithmetic; a change in any of them shows here, on the machine where it happens, as a refusal to start
that names the op and the row count, never as a user's answers that change with the traffic around them.
"""
from __future__ import annotations

import torch

# Rows a probe computes alone, and the batch sizes it is compared inside: below, at and across the register
# tiles, chunks and thread splits of the kernels.
PROBE_ROWS = 3
BATCH_ROWS = (2, 5, 8, 17, 67)


class NotBatchInvariant(RuntimeError):
    """An op of the deterministic path gave a row other bits inside a batch than alone."""


def check_batch_invariance(model, ops, page_size: int) -> int:
    """Raise NotBatchInvariant unless every distinct matmul of `model` (a loaded LlamaForCausalLM), its norm and
    `ops`' attention give the probe rows the same bits in every batch; returns the number of checks made."""
    gen = torch.Generator().manual_seed(0)
    checks = 0
    seen: set[tuple] = set()
    linears = [lin for layer in model.layers for lin in layer.linears()]
    if model.lm_head is not None:
        linears.append(model.lm_head)
    for lin in linears:
        key = (type(lin).__name__, tuple(lin.shape), getattr(lin, "fp32_output", False))
        if key in seen:
            continue
        seen.add(key)
        x = torch.randn(max(BATCH_ROWS), lin.shape[1], generator=gen).to(model.dtype)
        checks += _rows(f"{key[0]} {key[1][0]}x{key[1][1]}", lin, x)
    hidden = model.config.hidden_size
    x = torch.randn(max(BATCH_ROWS), hidden, generator=gen).to(model.dtype) * 4
    checks += _rows(f"rmsnorm {hidden}", lambda t: ops.rmsnorm(t, model.norm, model.config.rms_norm_eps), x)
    checks += _attention(model, ops, page_size, gen)
    return checks


def _rows(name: str, fn, x: torch.Tensor) -> int:
    alone = torch.cat([fn(x[r:r + 1]) for r in range(PROBE_ROWS)])
    for rows in BATCH_ROWS:
        got = fn(x[:rows])[:PROBE_ROWS]
        if not torch.equal(got, alone[:min(rows, PROBE_ROWS)]):
            raise NotBatchInvariant(
                f"deterministic mode cannot run on this machine: {name} gives a row other bits when computed "
                f"with {rows} rows than alone (native build {_isa()}); refusing --enable-deterministic-inference")
    return len(BATCH_ROWS)


def _attention(model, ops, page_size: int, gen: torch.Generator) -> int:
    """Decode attention of one sequence alone and beside others; the last rows of a prompt computed in one
    extend and as the second chunk over a cached first one."""
    cfg, dtype = model.config, model.dtype
    lengths = [37, 5, 70, 16, 1]
    pages = -(-max(lengths) // page_size)
    cache = torch.randn(len(lengths) * pages, 2, page_size, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    table = torch.arange(len(lengths) * pages, dtype=torch.int32).view(len(lengths), pages)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
    scale = cfg.head_dim ** -0.5

    def decode(b: int) -> torch.Tensor:
        plan = ops.plan_decode(table[:b], lens[:b], page_size)
        return ops.decode_attention(q[:b], k_cache, v_cache, table[:b], lens[:b], scale, plan)

    alone = decode(1)
    if not torch.equal(decode(len(lengths))[:1], alone):
        raise NotBatchInvariant("deterministic mode cannot run on this machine: decode attention gives a sequence "
                                f"other bits beside {len(lengths) - 1} others than alone (native build {_isa()})")
    length, cut = lengths[2], 29  # a prompt computed whole, and as a cached first chunk plus the rest
    qp = torch.randn(length, cfg.num_heads, cfg.head_dim, generator=gen).to(dtype)
    row = table[2:3]

    def extend(start: int) -> torch.Tensor:
        ext = torch.tensor([length - start], dtype=torch.int32)
        return ops.extend_attention(qp[start:], k_cache, v_cache, row, lens[2:3], ext,
                                    torch.zeros(1, dtype=torch.int32), scale)

    if not torch.equal(extend(0)[cut:], extend(cut)):
        raise NotBatchInvariant("deterministic mode cannot run on this machine: extend attention gives a prompt's "
                                f"rows other bits after a cached prefix than computed whole (native build {_isa()})")
    return 2


def _isa() -> str:
    from pdserve.kernels import native

    try:
        return native.load().isa()
    except native.NativeUnavailable as exc:
        return f"unavailable: {exc}"

"""The start-time check of deterministic mode: every reduction of the model's step gives a row the same bits
alone and inside batches of several sizes and make-ups, on this machine, before the first request.

Deterministic mode is batch-invariant by construction: each reduction sums a row in an order fixed by the shapes
alone (the fixed-order matmul, row-wise norms, attention that reads each query's keys in one order, the experts'
weighted sum in expert order, the LoRA op's grouped passes, the sampler's native row sums, the ranks' sum in rank
order). The construction rests on the compiler, the native build and the CPU's arithmetic; a change in any of them
shows here, on the machine where it happens, as a refusal to start that names the op and the row count, never as
a user's answers that change with the traffic around them.

What is checked, each at the model's own shapes: every distinct dense matmul (the LM head and int8 included),
RMSNorm alone and fused with the residual add, Qwen3's q/k head norms, an expert block (router, top-k, experts,
shared expert), the LoRA op over rows of several adapters and base rows, decode and extend attention, the
sampler (greedy, seeded top-k/top-p/min-p draws, penalties, logprobs) and its row sums, and under tensor
parallelism the ranks' all-reduce. Every rank of a tensor-parallel worker runs the check and they refuse together.
"""
from __future__ import annotations

from typing import Callable

import torch

from pdserve.shared.models.moe import SparseMoE
from pdserve.shared.sampler import Sampler, make_generator, row_sums
from pdserve.shared.sampling_params import SamplingParams

# Rows a probe computes alone, and the batch sizes it is compared inside: below, at and across the register
# tiles, chunks and thread splits of the kernels.
PROBE_ROWS = 3
BATCH_ROWS = (2, 5, 8, 17, 67)


class NotBatchInvariant(RuntimeError):
    """An op of the deterministic path gave a row other bits inside a batch than alone."""


def check_batch_invariance(model, ops, page_size: int) -> int:
    """Raise NotBatchInvariant unless every reduction of `model` (a loaded LlamaForCausalLM, with its LoRA pool
    and tensor-parallel group when it has them) and of `ops` gives the probe rows the same bits in every batch;
    returns the number of checks made. A tensor-parallel rank must be called with its peers (collectives)."""
    gen = torch.Generator().manual_seed(0)
    error: NotBatchInvariant | None = None
    checks = 0
    try:
        checks += _model_checks(model, ops, page_size, gen)
    except NotBatchInvariant as exc:  # a rank still takes part in the all-reduce check and the vote below
        error = exc
    if model.group is not None:
        try:
            checks += _all_reduce(model)
        except NotBatchInvariant as exc:
            error = error or exc
        failed = model.group.failed_ranks(error is not None, model.group.timeout_s)
        if failed and error is None:
            raise NotBatchInvariant(f"deterministic mode cannot run on this machine: tensor-parallel rank(s) "
                                    f"{failed} failed the batch-invariance check (their logs name the op); "
                                    "refusing --enable-deterministic-inference")
    if error is not None:
        raise error
    return checks


def _model_checks(model, ops, page_size: int, gen: torch.Generator) -> int:
    cfg, dtype = model.config, model.dtype
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
        x = _rand(gen, lin.shape[1]).to(dtype)
        checks += _rows(f"{key[0]} {key[1][0]}x{key[1][1]}", lambda s, lin=lin, x=x: lin(x[s]))
    hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
    x = _rand(gen, hidden).to(dtype) * 4
    checks += _rows(f"rmsnorm {hidden}", lambda s: ops.rmsnorm(x[s], model.norm, eps))
    residual = _rand(gen, hidden).to(dtype) * 4

    def fused(s: slice) -> torch.Tensor:
        return torch.cat(ops.rmsnorm(x[s], model.layers[0].input_norm, eps, residual[s]), dim=1)

    checks += _rows(f"rmsnorm {hidden} fused with the residual add", fused)
    layer = model.layers[0]
    if layer.q_norm is not None:
        qkv = _rand(gen, layer.qkv.shape[0]).to(dtype) * 4  # [rows, (Hq + 2 Hk) * D] of this rank's heads

        def head_norms(s: slice) -> torch.Tensor:
            t = qkv[s].clone()
            model._norm_qk_heads(t, layer, ops)
            return t

        checks += _rows(f"q/k head norms {cfg.head_dim}", head_norms)
    sparse = next((lay.mlp for lay in model.layers if isinstance(lay.mlp, SparseMoE)), None)
    if sparse is not None:
        h = _rand(gen, hidden).to(dtype)
        checks += _rows(f"expert block ({sparse.config.num_experts} experts, top {sparse.config.top_k})",
                        lambda s: sparse(h[s], ops))
    if model.lora is not None:
        checks += _lora(model, ops, gen)
    checks += _attention(model, ops, page_size, gen)
    if model.lm_head is not None and not cfg.is_classifier and not model.hidden_output:
        checks += _sampler(cfg.vocab_size, gen)
    return checks


def _rand(gen: torch.Generator, width: int) -> torch.Tensor:
    return torch.randn(max(BATCH_ROWS), width, generator=gen)


def _rows(name: str, fn: Callable[[slice], torch.Tensor]) -> int:
    """fn(rows) computes the op over the rows `rows` of its inputs: each probe row's bits inside every batch must
    be those it gets alone. Rows past the probes differ from batch to batch, so a probe also meets other
    neighbours (adapters, experts, draws) as the batch grows."""
    alone = torch.cat([fn(slice(r, r + 1)) for r in range(PROBE_ROWS)])
    for rows in BATCH_ROWS:
        got = fn(slice(0, rows))[:PROBE_ROWS]
        if not torch.equal(got, alone[:min(rows, PROBE_ROWS)]):
            raise NotBatchInvariant(
                f"deterministic mode cannot run on this machine: {name} gives a row other bits when computed "
                f"with {rows} rows than alone (native build {_isa()}); refusing --enable-deterministic-inference")
    return len(BATCH_ROWS)


def _lora(model, ops, gen: torch.Generator) -> int:
    """The LoRA op at the pool's shapes, on random slots of unequal ranks: the rows of a batch cycle through
    every slot and the base model, so a probe row's adapter meets other adapters' rows and more of its own."""
    pool, dtype, n = model.lora, model.dtype, max(BATCH_ROWS)
    slots = pool.num_slots
    ranks = torch.tensor([max(1, pool.max_rank >> (s % 3)) for s in range(slots)], dtype=torch.int32)
    row_slots = torch.tensor([r % (slots + 1) - 1 for r in range(n)], dtype=torch.int32)
    row_slots[:PROBE_ROWS] = torch.arange(PROBE_ROWS) % slots  # every probe row on an adapter
    checks, seen = 0, set()
    for (_, linear), lay in pool.covered.items():
        a_shape, b_shape = tuple(lay.lora_a.shape), tuple(lay.lora_b.shape)  # [S, n_sub R, in], [S, out, R]
        if (linear, a_shape, b_shape) in seen:
            continue
        seen.add((linear, a_shape, b_shape))
        a = torch.randn(a_shape, generator=gen).to(dtype) * 0.1
        b = torch.randn(b_shape, generator=gen).to(dtype) * 0.1
        x = torch.randn(n, a_shape[2], generator=gen).to(dtype)
        base = torch.randn(n, b_shape[1], generator=gen).to(dtype)  # the base layer's output the deltas add to

        def apply(s: slice, a=a, b=b, x=x, base=base, offsets=lay.out_offsets) -> torch.Tensor:
            y = base[s].clone()
            ops.lora_apply(y, x[s], a, b, offsets, row_slots[s], ranks)
            return y

        checks += _rows(f"LoRA {linear} (rank {pool.max_rank}, {slots} slots)", apply)
    return checks


def _sampler(vocab: int, gen: torch.Generator) -> int:
    """The sampler's rows at the model's vocabulary: greedy with logprobs and top logprobs, and seeded draws
    through top-k, top-p (the rejection draw's sums), min-p and penalties, each row with its own generator."""
    sampler = Sampler()
    kinds = [dict(temperature=0), dict(temperature=0.7, top_p=0.9, top_k=40),
             dict(temperature=1.0, top_p=0.6, min_p=0.01, frequency_penalty=0.5, repetition_penalty=1.2)]
    logits = _rand(gen, vocab) * 3

    def sample(s: slice) -> torch.Tensor:
        rows = range(s.start, s.stop)
        params = [SamplingParams(**kinds[r % 3], seed=r, return_logprob=True, top_logprobs_num=4) for r in rows]
        out = sampler.sample(logits[s], params, [[r, 7] for r in rows], [[r % 5, 11] for r in rows],
                             [make_generator(p.seed) for p in params], (0,))
        return torch.cat([out.token_ids[:, None].double(), out.logprobs[:, None].double(),
                          out.top_ids.double(), out.top_logprobs.double()], dim=1)

    e = logits.exp()
    return _rows(f"sampler row sums ({vocab} tokens)", lambda s: row_sums(e[s])) + \
        _rows(f"sampler ({vocab} tokens)", sample)


def _all_reduce(model) -> int:
    """The ranks' sum of a row-parallel layer's partials (fp32 in deterministic mode) and of the embedding rows
    (the model's dtype): each rank adds its own partial rows; a row's sum must not depend on the rows with it."""
    group = model.group
    own = torch.Generator().manual_seed(1000 + group.rank)  # each rank's partials differ
    checks = 0
    for dtype in dict.fromkeys((torch.float32, model.dtype)):
        x = _rand(own, model.config.hidden_size).to(dtype)
        checks += _rows(f"tensor-parallel all-reduce ({dtype}, {group.size} ranks)",
                        lambda s, x=x: group.all_reduce(x[s].clone()))
    return checks


def _attention(model, ops, page_size: int, gen: torch.Generator) -> int:
    """Decode attention of one sequence alone and beside others; the last rows of a prompt computed in one
    extend and as the second chunk over a cached first one."""
    cfg, dtype = model.config, model.dtype
    lengths = [37, 5, 70, 16, 1]
    pages = -(-max(lengths) // page_size)
    num_kv_heads, num_heads = model.num_kv_heads, model.num_heads  # this rank's heads
    cache = torch.randn(len(lengths) * pages, 2, page_size, num_kv_heads, cfg.head_dim, generator=gen).to(dtype)
    k_cache, v_cache = cache[:, 0], cache[:, 1]
    table = torch.arange(len(lengths) * pages, dtype=torch.int32).view(len(lengths), pages)
    lens = torch.tensor(lengths, dtype=torch.int32)
    q = torch.randn(len(lengths), num_heads, cfg.head_dim, generator=gen).to(dtype)
    scale = cfg.head_dim ** -0.5

    def decode(b: int) -> torch.Tensor:
        plan = ops.plan_decode(table[:b], lens[:b], page_size)
        return ops.decode_attention(q[:b], k_cache, v_cache, table[:b], lens[:b], scale, plan)

    alone = decode(1)
    if not torch.equal(decode(len(lengths))[:1], alone):
        raise NotBatchInvariant("deterministic mode cannot run on this machine: decode attention gives a sequence "
                                f"other bits beside {len(lengths) - 1} others than alone (native build {_isa()})")
    length, cut = lengths[2], 29  # a prompt computed whole, and as a cached first chunk plus the rest
    qp = torch.randn(length, num_heads, cfg.head_dim, generator=gen).to(dtype)
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

"""Sampler: the next token of every row of a batch, each row with its own SamplingParams.

Stateless between calls: each call brings every row's params, prompt and output so far, and generator.
Per row, in this order (a grammar's mask, when the request has one, is applied by the engine beforehand):
  0. logit_bias added to the logits of the tokens it names (OpenAI's logit_bias);
  1. penalties on the logits: repetition over prompt + output tokens (positive logits divided, negative
     multiplied, as in HF and vLLM), then frequency (count in output * frequency_penalty) and presence
     ((count > 0) * presence_penalty) subtracted;
  2. bans (`BANS`: each parameter that forbids tokens brings its rule): while the output is shorter than
     min_new_tokens, stop_token_ids and eos (unless ignore_eos, where eos ends nothing);
  3. greedy rows take the argmax. Other rows sample from p = softmax(logits / temperature) over the tokens
     that pass top_k, top_p and min_p, each judged on p itself (SGLang's joint filtering, so the filters
     commute): top_k keeps a token when fewer than k tokens are more likely; top_p when the more likely
     tokens hold less than top_p of the mass; min_p when p >= min_p * max(p). Ties at a cutoff are all kept.

Logprobs describe the model, not the sampling settings: log_softmax of the raw logits, before penalties and
temperature (vLLM's default). Rows that asked for none hold NaN (token ids -1).

Randomness: each draw takes one uniform number per row, from the row's own generator when the request has a
seed (the global torch generator otherwise), seeded for each output position (shared/seeded_draws.py). A seeded
row's draws thus depend only on its seed, position and logits, never on its neighbours or on the worker.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from pdserve.kernels import native
from pdserve.shared.host_memory import upload
from pdserve.shared.logprobs import HostCopy, SampleOutput, id_logprobs
from pdserve.shared.sampling_params import SamplingParams


def make_generator(seed: int | None) -> torch.Generator | None:
    """The per-request generator of a seeded request (None: the request draws from the global generator)."""
    if seed is None:
        return None
    return torch.Generator().manual_seed(seed & 0xFFFF_FFFF_FFFF_FFFF)


class Sampler:
    def __init__(self, sync_free: bool | None = None) -> None:
        """`sync_free`: sample rows with temperature by `_draw_nucleus`, which never waits for the device (default:
        on a GPU, where a wait would stall the overlapped step; the CPU's rejection draw is faster there)."""
        self.sync_free = sync_free

    def sample(self, logits: torch.Tensor, params: list[SamplingParams], prompt_ids: list[list[int]],
               output_ids: list[list[int]], generators: list[torch.Generator | None],
               eos_token_ids: tuple[int, ...]) -> SampleOutput:
        """Next token per row of `logits` [B, V] (any float dtype; computed in fp32; never modified)."""
        batch = logits.shape[0]
        x = logits
        penalised = [i for i, p in enumerate(params) if p.has_penalty]
        biased = [i for i, p in enumerate(params) if p.logit_bias]
        bans = _bans(params, prompt_ids, output_ids, eos_token_ids)
        if penalised or bans or biased:
            x = logits.to(torch.float32, copy=True)  # [B, V]
            if biased:
                entries = [_bias_entries(params[i]) for i in biased]
                ids = upload(torch.cat([e[0] for e in entries]), torch.int64, x.device)
                # Rows repeated on the host: repeat_interleave by a device tensor waits for the device.
                rows = _index(torch.tensor(biased).repeat_interleave(torch.tensor([len(e[0]) for e in entries])),
                              x.device)
                x.index_put_((rows, ids), upload(torch.cat([e[1] for e in entries]), torch.float32, x.device),
                             accumulate=True)
            if penalised:
                _apply_penalties(x, penalised, params, prompt_ids, output_ids)
            if bans:  # filled through flat indices: assigning a Python scalar by index copies it and waits
                x.view(-1).index_fill_(0, _index([r * x.shape[1] + t for r, t in bans], x.device), float("-inf"))
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        sync_free = self.sync_free if self.sync_free is not None else x.device.type == "cuda"
        if not sampled:
            tokens = _argmax(x)  # the common fast path: no copy, no softmax
        elif len(sampled) == batch:
            tokens = _sample_rows(x, params, generators, sync_free)
        else:
            greedy = [i for i, p in enumerate(params) if p.is_greedy]
            tokens = torch.empty(batch, dtype=torch.int64, device=x.device)
            g, s = _index(greedy, x.device), _index(sampled, x.device)
            tokens[g] = _argmax(x[g])
            tokens[s] = _sample_rows(x[s], [params[i] for i in sampled], [generators[i] for i in sampled], sync_free)
        return _with_logprobs(logits, tokens, params)


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1) for x [R, V] fp32, each row summed in one order whatever R (the native kernel on the CPU: torch
    splits a lone row across threads, so its logprobs would change with the rows beside it)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and native.available():
        return native.load().row_sums(x if x.stride(-1) == 1 else x.contiguous())
    return x.sum(-1)


def _block_size(vocab: int) -> int | None:
    """A block length dividing the vocabulary, for two-level scans; None when the vocabulary has none useful."""
    block = min(vocab & -vocab, 256)  # largest power of two dividing vocab, at most 256
    return block if block >= 32 else None


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) for x [R, V] (first index on ties), via block maxima: torch's argmax is not vectorised
    on CPU, its max reductions are (5x faster here)."""
    rows, vocab = x.shape
    block = _block_size(vocab)
    if block is None:
        return x.argmax(-1)
    blocks = x.reshape(rows, vocab // block, block)
    best = blocks.amax(-1).argmax(-1)  # [R] first block holding the maximum
    inner = blocks[torch.arange(rows, device=x.device), best].argmax(-1)  # [R]
    return best * block + inner


def _bias_entries(p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """p.logit_bias as (token ids [E] int64, biases [E] fp32), built once per params object: a request keeps its
    params for every step, and rebuilding them from Python pairs each step made a step's cost grow with the
    entries (16 requests biasing the whole vocabulary: 0.7 s a step)."""
    cached = p.__dict__.get("_bias_tensors")
    if cached is None:
        cached = (torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64),
                  torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32))
        object.__setattr__(p, "_bias_tensors", cached)  # a cache beside the frozen fields, not one of them
    return cached


def _index(values, device: torch.device) -> torch.Tensor:
    return upload(values, torch.int64, device)


@dataclass(frozen=True)
class Ban:
    """A rule that forbids a row some tokens at its next output position, from its params and its tokens so far.

    `tokens(params, prompt_ids, output_ids, eos_token_ids)`: the ids forbidden now. `steady(params, output_ids)`:
    True when the rule forbids the same ids whatever the row samples next (for any number of tokens), so that
    positions can be sampled side by side as if the output had one length (speculative.py samples a greedy
    draft ahead that way). A parameter that forbids tokens adds its rule to BANS, and nothing else in the runtime
    changes for it."""

    tokens: Callable[[SamplingParams, list[int], list[int], tuple[int, ...]], Iterable[int]]
    steady: Callable[[SamplingParams, list[int]], bool]


def _min_new_tokens(p: SamplingParams, prompt: list[int], out: list[int],
                    eos_token_ids: tuple[int, ...]) -> Iterable[int]:
    if len(out) >= p.min_new_tokens:
        return ()
    return set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | set(eos_token_ids)


BANS: list[Ban] = [
    Ban(_min_new_tokens, steady=lambda p, out: len(out) >= p.min_new_tokens),  # no end before min_new_tokens
]


def row_wise(p: SamplingParams, output_ids: list[int]) -> bool:
    """The row's token at each of its next positions is a function of that position's logits alone: greedy, no
    penalty (penalties read the tokens before), and every ban steady. Speculative verification asks this."""
    return p.is_greedy and not p.has_penalty and all(ban.steady(p, output_ids) for ban in BANS)


def _bans(params: list[SamplingParams], prompt_ids: list[list[int]], output_ids: list[list[int]],
          eos_token_ids: tuple[int, ...]) -> list[tuple[int, int]]:
    """(row, token) pairs that the rules of BANS forbid this step."""
    bans = []
    for row, (p, prompt, out) in enumerate(zip(params, prompt_ids, output_ids)):
        for ban in BANS:
            banned = ban.tokens(p, prompt, out, eos_token_ids)
            if banned:  # most rows: nothing, and no sort or list is built for them (this runs every step)
                bans.extend((row, t) for t in sorted(banned))
    return bans


def _apply_penalties(x: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     prompt_ids: list[list[int]], output_ids: list[list[int]]) -> None:
    """Penalise x [B, V] in place; only the entries of tokens seen are touched, so the cost is O(tokens)."""
    device = x.device
    rep_rows = [r for r in rows if params[r].repetition_penalty != 1.0]
    if rep_rows:  # index tensors built on the host from each row's ids at once, then one upload each
        seen = [torch.tensor(prompt_ids[r] + output_ids[r], dtype=torch.int64) for r in rep_rows]
        row_idx = upload(torch.cat([torch.full_like(t, r) for r, t in zip(rep_rows, seen)]), torch.int64, device)
        tok_idx = upload(torch.cat(seen), torch.int64, device)
        pen = torch.tensor([params[r].repetition_penalty for r in rep_rows])
        pen = upload(pen.repeat_interleave(torch.tensor([len(t) for t in seen])), torch.float32, device)
        vals = x[row_idx, tok_idx]  # duplicates read the same value and write the same result
        x[row_idx, tok_idx] = torch.where(vals > 0, vals / pen, vals * pen)
    add_rows = [r for r in rows if output_ids[r] and (params[r].frequency_penalty or params[r].presence_penalty)]
    if add_rows:
        outs = [torch.tensor(output_ids[r], dtype=torch.int64) for r in add_rows]
        row_idx = upload(torch.cat([torch.full_like(t, r) for r, t in zip(add_rows, outs)]), torch.int64, device)
        tok_idx = upload(torch.cat(outs), torch.int64, device)
        freq = torch.tensor([params[r].frequency_penalty for r in add_rows])
        freq = upload(freq.repeat_interleave(torch.tensor([len(t) for t in outs])), torch.float32, device)
        x.index_put_((row_idx, tok_idx), -freq, accumulate=True)
        # Presence: once per distinct (row, token).
        flat = torch.unique(row_idx * x.shape[1] + tok_idx)
        u_rows, u_toks = flat // x.shape[1], flat % x.shape[1]
        pres = torch.zeros(x.shape[0], device=device)
        pres[_index(add_rows, device)] = upload([params[r].presence_penalty for r in add_rows], torch.float32, device)
        x.index_put_((u_rows, u_toks), -pres[u_rows], accumulate=True)


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k) over x [R, V] (values most likely first; which of equal values wins is unspecified),
    looking only at the k blocks with the largest maxima: they hold every top-k value. 3-10x faster for small k."""
    rows, vocab = x.shape
    block = _block_size(vocab)
    if block is None or 2 * k * min(block, 64) > vocab:
        return torch.topk(x, k, dim=-1)
    block = min(block, 64)  # smaller blocks, fewer candidates: 64 measured best for k in 5..50
    blocks = x.reshape(rows, vocab // block, block)
    best = torch.topk(blocks.amax(-1), k, dim=-1).indices  # [R, k]
    candidates = blocks.gather(1, best[..., None].expand(-1, -1, block)).reshape(rows, k * block)
    values, pos = torch.topk(candidates, k, dim=-1)
    return values, best.gather(1, pos // block) * block + pos % block


def _sample_rows(x: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
                 sync_free: bool = False) -> torch.Tensor:
    """One token per row of x [R, V] (read only) under each row's temperature and filters."""
    device = x.device
    # Unnormalised probabilities with the top one exactly 1: e = exp((x - max) / T); min_p compares with e directly.
    if x.dtype == torch.float32:
        e = torch.sub(x, x.amax(-1, keepdim=True))  # [R, V], a new tensor: x stays untouched
    else:
        e = x.float()  # converting first is faster than reducing and subtracting in half precision
        e.sub_(e.amax(-1, keepdim=True))
    temps = [p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        e.div_(upload(temps, torch.float32, device)[:, None])
    e.exp_()
    mass = row_sums(e)  # [R] total mass before any filter: top_p is a share of it
    e = _apply_thresholds(e, params, sync_free)
    top_p = upload([p.top_p for p in params], torch.float32, device)
    return (_draw_nucleus if sync_free else _draw)(e, mass, top_p, generators)


def _keep_above(e: torch.Tensor, threshold: torch.Tensor, strict: bool) -> torch.Tensor:
    """e where e > threshold (or >=), 0 elsewhere. Comparing into a float tensor skips torch's slow bool path."""
    compare = torch.gt if strict else torch.ge
    return compare(e, threshold, out=torch.empty_like(e)).mul_(e)


def _apply_thresholds(e: torch.Tensor, params: list[SamplingParams], every_row: bool = False) -> torch.Tensor:
    """e with the tokens below each row's top_k / min_p cutoff zeroed (both are thresholds on e). `every_row`:
    compare every row, without asking the device which rows have a cutoff (a row with none keeps all of e)."""
    vocab = e.shape[1]
    thresholds = upload([p.min_p for p in params], torch.float32, e.device)
    k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab]
    if k_rows:
        ks = _index([params[i].top_k for i in k_rows], e.device)
        k_idx = _index(k_rows, e.device)
        k_e = e if len(k_rows) == e.shape[0] else e[k_idx]
        kth = _topk(k_e, max(params[i].top_k for i in k_rows))[0].gather(1, ks[:, None] - 1).squeeze(1)
        thresholds[k_idx] = torch.maximum(thresholds[k_idx], kth)
    if every_row:
        return _keep_above(e, thresholds[:, None], strict=False)
    cut = [i for i, t in enumerate(thresholds.tolist()) if t > 0]
    if len(cut) == e.shape[0]:
        return _keep_above(e, thresholds[:, None], strict=False)
    if cut:
        c = _index(cut, e.device)
        e[c] = _keep_above(e[c], thresholds[c, None], strict=False)
    return e


_MAX_DRAWS = 64


def _draw(e: torch.Tensor, mass: torch.Tensor, top_p: torch.Tensor,
          generators: list[torch.Generator | None]) -> torch.Tensor:
    """Sample each row of e [R, V] in proportion to e, restricted to its top_p nucleus.

    The nucleus is found by rejection instead of a sort over the vocabulary (a sort costs ~20x more here):
    draw a token from what is left; it belongs to the nucleus when the tokens more likely than it hold less
    than top_p of the mass. If not, neither does any token as likely or less, so those are dropped and the
    row draws again. Every draw that is kept comes from e restricted to the nucleus, as required. A rejection
    drops half of the remaining mass on average and the top token always passes: at top_p = 0.9 about one
    row in ten draws twice; a tiny top_p over a flat 49152-token distribution takes ~10 draws. The bound
    only guards against non-finite logits; a row still drawing then takes its top token.
    """
    tokens = torch.empty(e.shape[0], dtype=torch.int64, device=e.device)
    todo = torch.arange(e.shape[0], device=e.device)  # rows of the call still drawing
    for _ in range(_MAX_DRAWS):
        tok = _inverse_cdf(e, _uniforms(generators).to(e.device))
        tokens[todo] = tok
        check = [i for i, p in enumerate(top_p.tolist()) if p < 1.0]
        if not check:
            return tokens
        c = _index(check, e.device)
        rows = e if len(check) == e.shape[0] else e[c]
        above = _keep_above(rows, rows.gather(1, tok[c, None]), strict=True)  # tokens more likely than the draw
        reject = row_sums(above) >= top_p[c] * mass[c]  # [C]; summed as `mass` was, whatever C
        if not bool(reject.any()):
            return tokens
        r = reject.nonzero().squeeze(1)
        redo = c[r]
        e, mass, top_p, todo = above[r], mass[redo], top_p[redo], todo[redo]
        generators = [generators[i] for i in redo.tolist()]
    tokens[todo] = _argmax(e)
    return tokens


def _draw_nucleus(e: torch.Tensor, mass: torch.Tensor, top_p: torch.Tensor,
                  generators: list[torch.Generator | None]) -> torch.Tensor:
    """`_draw`'s distribution in a fixed sequence of device operations, none of which waits for the device.

    Each row's nucleus is cut after a sort: with e in descending order, a token is in the nucleus when the mass
    sorted ahead of it is below top_p * mass; the smallest such value is the cutoff, and every token at least as
    likely is kept (so ties at the cutoff are all kept, and the nucleus is `_draw`'s). Then one uniform per row
    picks a token from what is kept. A sort of the vocabulary costs more than `_draw`'s rejections on a CPU, not
    on a GPU, where `_draw`'s checks would each wait for the device.
    """
    ordered = torch.sort(e, dim=-1, descending=True).values  # [R, V]
    ahead = ordered.cumsum(-1).sub_(ordered)  # mass sorted ahead of each position
    limit = torch.where(top_p < 1.0, top_p * mass, torch.full_like(mass, float("inf")))
    kept = (ahead < limit[:, None]).sum(-1, keepdim=True)  # >= 1: nothing is ahead of the top token
    cutoff = ordered.gather(1, kept - 1)  # [R, 1]
    return _inverse_cdf(_keep_above(e, cutoff, strict=False), upload(_uniforms(generators), torch.float32, e.device))


def _inverse_cdf(e: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of e [R, V] (>= 0, some > 0), the token where the running sum of e passes u * sum(e).

    Two levels (block sums, then one block) because a cumsum over the whole vocabulary costs 5x more.
    """
    rows, vocab = e.shape
    block = _block_size(vocab)
    if block is None:
        cdf = torch.cumsum(e, dim=-1)
        return _search(cdf, u[:, None] * cdf[:, -1:])
    blocks = e.reshape(rows, vocab // block, block)
    cdf = row_sums(e.reshape(rows * (vocab // block), block)).view(rows, -1).cumsum(-1)  # [R, V / block]
    target = u[:, None] * cdf[:, -1:]
    b = _search(cdf, target)  # [R] the block where the running sum passes the target
    before = torch.where(b > 0, cdf.gather(1, (b - 1).clamp(min=0)[:, None]).squeeze(1), 0.0)
    inner = blocks[torch.arange(rows, device=e.device), b].cumsum(-1)  # [R, block]
    return b * block + _search(inner, (target.squeeze(1) - before).clamp(min=0.0)[:, None])


def _search(cdf: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """First index where cdf [R, N] exceeds target [R, 1]; the target is kept below cdf's end, so the index
    found always has a positive increment, even when rounding pushed the target up to the total."""
    total = cdf[:, -1:]
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(1)


def _uniforms(generators: list[torch.Generator | None]) -> torch.Tensor:
    """[R] uniforms in [0, 1) on the CPU: from each row's generator, or the global one for rows without."""
    u = torch.empty(len(generators))
    shared = [i for i, g in enumerate(generators) if g is None]
    if shared:
        u[shared] = torch.rand(len(shared))
    for i, g in enumerate(generators):
        if g is not None:
            u[i] = torch.rand(1, generator=g)
    return u


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> SampleOutput:
    rows = [i for i, p in enumerate(params) if p.return_logprob or p.top_logprobs_num > 0]
    if not rows:
        return SampleOutput(tokens, None, None, None)
    batch, vocab = logits.shape
    idx = _index(rows, logits.device)
    raw = logits.float() if len(rows) == batch else logits[idx].float()  # [L, V], read only
    top = raw.amax(-1, keepdim=True)  # exact in any order
    lse = top + row_sums(torch.exp(raw - top)).log()[:, None]  # [L, 1]
    logprobs = torch.full((batch,), float("nan"), device=logits.device)
    logprobs[idx] = (raw.gather(1, tokens[idx, None]) - lse).squeeze(1)
    out = SampleOutput(tokens, logprobs, None, None)
    named = id_logprobs(raw, lse, [params[i] for i in rows])
    if named is not None:
        out.id_logprobs = torch.full((batch, named.shape[1]), float("nan"), device=logits.device)
        out.id_logprobs[idx] = named
    k = min(max(p.top_logprobs_num for p in params), vocab)
    if k:
        top_values, top_indices = _topk(raw, k)
        out.top_ids = torch.full((batch, k), -1, dtype=torch.int64, device=logits.device)
        out.top_logprobs = torch.full((batch, k), float("nan"), device=logits.device)
        out.top_ids[idx] = top_indices
        out.top_logprobs[idx] = top_values - lse
    return out

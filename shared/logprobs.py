"""The logprobs a step reports: each sampled row's (SampleOutput, carried to the host by HostCopy) and each
prompt row's (`prompt_logprobs`).

Every position reports log_softmax of the raw logits at three kinds of token: the one sampled (or, in the prompt,
the one that follows), the `top_logprobs_num` most likely, and the ids the request names in `token_ids_logprob`,
in its order (SGLang's token_ids_logprob), whether likely or not.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pdserve.shared.host_memory import upload
from pdserve.shared.outputs import TokenLogprobs
from pdserve.shared.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] fp32: log_softmax(raw logits) at token_ids; None when no row asked
    top_ids: torch.Tensor | None  # [B, K] int64, most likely first; K = max top_logprobs_num, None when 0
    top_logprobs: torch.Tensor | None  # [B, K] fp32
    id_logprobs: torch.Tensor | None = None  # [B, M] fp32 at each row's token_ids_logprob (NaN past its own)


def id_logprobs(raw: torch.Tensor, lse: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    """[L, M] logprobs of each row's token_ids_logprob, from raw logits [L, V] and their logsumexp [L, 1]; None
    when no row names ids. Rows pad their ids with token 0 to the longest list (its values are cut on the host)."""
    longest = max(len(p.token_ids_logprob) for p in params)
    if longest == 0:
        return None
    ids = [list(p.token_ids_logprob) + [0] * (longest - len(p.token_ids_logprob)) for p in params]
    return raw.gather(1, upload(ids, torch.int64, raw.device)) - lse  # [L, M]


class HostCopy:
    """A SampleOutput on its way to the host in one transfer, started at once; `read` waits for it.

    On a GPU the tensors are packed into one float64 buffer (token ids are exact there) and copied without
    blocking into pinned memory, with an event behind the copy: the host goes on scheduling and launching the
    next step while the device finishes this one, and the single copy replaces a synchronising `tolist()` per
    tensor. On the CPU the tensors are already on the host.
    """

    def __init__(self, out: SampleOutput) -> None:
        self.out = out
        self.packed: torch.Tensor | None = None
        self.event = None
        if out.token_ids.device.type == "cuda":
            parts = [t.reshape(-1).double() for t in _tensors(out) if t is not None]
            flat = torch.cat(parts)
            self.packed = torch.empty(flat.shape, dtype=torch.float64, pin_memory=True)
            self.packed.copy_(flat, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def read(self, params: list[SamplingParams]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Each row's token and, for rows whose params ask for them, its logprobs (top `top_logprobs_num`, and
        those of its token_ids_logprob)."""
        out = self.out
        if self.packed is not None:
            self.event.synchronize()
            host, at, parts = self.packed, 0, []
            for t in _tensors(out):
                parts.append(None if t is None else host[at:at + t.numel()].reshape(t.shape))
                at += 0 if t is None else t.numel()
            out = SampleOutput(parts[0].long(), parts[1], None if parts[2] is None else parts[2].long(), *parts[3:])
        tokens = out.token_ids.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(tokens)
        if out.logprobs is not None:
            lps = out.logprobs.tolist()
            top_ids = out.top_ids.tolist() if out.top_ids is not None else None
            top_lps = out.top_logprobs.tolist() if out.top_logprobs is not None else None
            by_id = out.id_logprobs.tolist() if out.id_logprobs is not None else None
            for i, p in enumerate(params):
                if p.return_logprob or p.top_logprobs_num:
                    k, m = p.top_logprobs_num, len(p.token_ids_logprob)
                    logprobs[i] = TokenLogprobs(lps[i], top_ids[i][:k] if top_ids and k else [],
                                                top_lps[i][:k] if top_lps and k else [],
                                                by_id[i][:m] if by_id and m else [])
        return tokens, logprobs


def _tensors(out: SampleOutput) -> list[torch.Tensor | None]:
    return [getattr(out, f.name) for f in fields(out)]


def prompt_logprobs(prompt_logits: torch.Tensor, prompt_rows: list[tuple]) -> None:
    """Append to each request the logprobs of the prompt tokens that a chunk's logits [rows, V] predict;
    `prompt_rows`: (request, its first position there, how many rows)."""
    logprobs = torch.log_softmax(prompt_logits.float(), dim=-1)
    offset = 0
    for req, first, count in prompt_rows:
        rows = logprobs[offset:offset + count]
        offset += count
        targets = torch.tensor(req.input_ids[first + 1:first + 1 + count], device=rows.device)
        chosen = rows.gather(1, targets[:, None])[:, 0].tolist()
        k, named = req.params.top_logprobs_num, req.params.token_ids_logprob
        top_lps, top_ids = rows.topk(k, dim=-1) if k else (None, None)
        by_id = rows[:, list(named)].tolist() if named else None
        for i, lp in enumerate(chosen):
            req.input_logprobs.append(TokenLogprobs(lp, top_ids[i].tolist() if k else [],
                                                    top_lps[i].tolist() if k else [], by_id[i] if named else []))

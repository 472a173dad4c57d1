"""StepOps: what a step does with its logits and its tokens, and all of the engine its helpers hold.

The engine owns the loop; the roles, the overlapped step, speculative verification and the admin classes hold
this object instead of the engine, so none of them imports the engine and the runtime's imports point one way.
It owns the path of a sampled token, written once:

    account(batch)  book what the step computed; which requests sample now, from which logit rows
    sample(...)     their tokens (`launch_sample`: left on their way to the host)
    commit(...)     each request joins the running batch, takes its token (`append`: the stop and length
                    rules), and its output leaves (`emit`)

Every caller goes through `commit`: a step read at once, decode's first tokens from its prefill worker, an
overlapped step when it settles (`join=False`: a request retracted since its launch must not join again) and a
verify step, one position at a time (`send=False`, then `emit_all` after its last position: a request's output
leaves once per step, whatever it accepted). Everything here runs on the engine thread.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from pdserve.shared.grammar import apply_masks
from pdserve.shared.host_memory import upload
from pdserve.shared.logprobs import HostCopy
from pdserve.shared.observer import RequestObserver, StepStats
from pdserve.shared.outputs import ReqOutput, TokenLogprobs
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.sampler import Sampler
from pdserve.shared.scheduler import Batch, Scheduler
from pdserve.shared.seeded_draws import position_generator

if TYPE_CHECKING:
    from pdserve.shared.model_runner import ModelRunner

Sampled = list[tuple[Req, int, TokenLogprobs | None]]  # (request, token, its logprobs) of one step
# The engine's abort: (rid, reason, error) -> whether it held the request. It settles an overlapped step first
# and tells the role, which is why it stays the engine's.
AbortFn = Callable[..., bool]


class StepOps:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, sampler: Sampler, observer: RequestObserver,
                 eos_token_ids: tuple[int, ...], abort: AbortFn) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.observer = observer
        self.eos_token_ids = eos_token_ids
        self.abort = abort
        self.stats = StepStats()
        # A sequence ends ("length") at the context length, or at what the pool can ever hold where that is less
        # (SGLang's max_req_len): past it, it would be aborted for want of pages.
        self.max_seq_len = min(runner.context_length, scheduler.allocator.num_pages * scheduler.page_size)

    # ------------------------------------------------------------ before sampling
    def account(self, batch: Batch, compute_s: float,
                family: Callable[[Req], list[Req]]) -> tuple[list[int], list[Req]]:
        """Book what the step computed; returns the requests that sample a token now and their logit rows.
        `family`: the choices of a fresh prompt just computed (the role's: n > 1 forks)."""
        rows: list[int] = []
        reqs: list[Req] = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            if req.status == ReqStatus.FINISHED:  # it ended with the overlapped step before (overlap.py)
                continue
            req.num_computed += n
            if batch.is_decode or req.status == ReqStatus.RUNNING:  # a decode, alone or beside prefills
                self.stats.decode_tokens += 1
                req.decode_steps += 1
                rows.append(i)
                reqs.append(req)
                continue
            self.stats.prefill_tokens += n
            ended = time.monotonic()
            req.prefill_chunks.append((ended - compute_s, ended, n))
            if req.first_scheduled is None:  # its first chunk: it left the queue when this step began
                req.first_scheduled = ended - compute_s
                self.observer.scheduled(req)
            if req.num_computed < req.seq_len:
                req.status = ReqStatus.PREFILLING
                self.scheduler.chunked = req
                continue
            if self.scheduler.chunked is req:
                self.scheduler.chunked = None
            self.scheduler.cache_pages(req, lock=True)
            fresh = not req.output_ids and req.resumed is None  # not a retracted or resumed choice's recompute
            if fresh:
                self.observer.prefilled(req)
            # A fresh prompt with n > 1 becomes n choices; a retracted or resumed request is one already.
            for member in (family(req) if fresh else [req]):
                rows.append(i)
                reqs.append(member)
        return rows, reqs

    def sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]):
        """The next token (and its logprobs, where asked) of each of `reqs`, from `logits[rows]`."""
        return self.launch_sample(logits, rows, reqs).read([r.params for r in reqs])

    def launch_sample(self, logits: torch.Tensor, rows: list[int], reqs: list[Req]) -> HostCopy:
        """`sample`, with the tokens left on their way to the host (read them with `.read(params)`)."""
        if rows != list(range(logits.shape[0])):
            logits = logits[upload(rows, torch.int64, logits.device)]  # a mixed step, or n > 1 choices
        if any(r.grammar is not None for r in reqs):
            apply_masks(logits, [r.grammar for r in reqs])
        # A seeded choice's draws at output position i come from (seed + choice index, i), whichever worker
        # samples it (len(output_ids) counts an overlapped step's placeholders: it is the position).
        generators = [position_generator(r.generator, None if r.params.seed is None else r.params.seed + r.index,
                                         len(r.output_ids)) for r in reqs]
        return HostCopy(self.sampler.sample(logits, [r.params for r in reqs], [r.input_ids for r in reqs],
                                            [r.output_ids for r in reqs], generators, self.eos_token_ids))

    # ------------------------------------------------------------ the commit path
    def commit(self, decoding: Sampled, join: bool = True, send: bool = True) -> None:
        """Each request's sampled token: it joins the running batch (`join`), takes the token, and its output
        leaves (`send`)."""
        for req, token, logprob in decoding:
            if join:
                self.join(req)
            self.append(req, token, logprob)
        if send:
            self.emit_all([req for req, _, _ in decoding])

    def join(self, req: Req) -> None:
        """A request whose prompt is computed decodes from the next step on."""
        if req.status != ReqStatus.RUNNING:
            req.status = ReqStatus.RUNNING
            self.scheduler.running.append(req)

    def append(self, req: Req, token: int, logprob: TokenLogprobs | None) -> None:
        """`req` takes `token`, finishing by the stop and length rules (then its pages go)."""
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        if req.params.max_new_tokens == 0:  # computed for its prompt's logprobs only: the token is not output
            if logprob is not None:  # but the next position's logprobs are (SGLang's scoring of token ids)
                req.output_logprobs.append(logprob)
            req.finish_reason = "length"
            self.scheduler.remove(req, cache=True)
            return
        if req.grammar is not None and not req.grammar.accept(token):
            # Only when the grammar left nothing to sample (e.g. it must end but min_new_tokens bans eos).
            req.finish_reason = "stop"
            self.scheduler.remove(req, cache=True)
            return
        req.output_ids.append(token)
        if logprob is not None:
            req.output_logprobs.append(logprob)
        p = req.params
        if not p.ignore_eos and token in self.eos_token_ids:
            req.finish_reason, req.matched_stop_token = "stop", token
        elif token in p.stop_token_ids:
            req.finish_reason, req.matched_stop_token = "stop", token
        elif req.grammar is not None and req.grammar.terminated:  # complete, and its end accepted (ignore_eos)
            req.finish_reason, req.matched_stop_token = "stop", token
        elif len(req.output_ids) >= p.max_new_tokens or req.seq_len >= self.max_seq_len:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.remove(req, cache=True)

    # ------------------------------------------------------------ outputs
    def emit_all(self, reqs: list[Req]) -> None:
        for req in reqs:
            self.emit(req, finish_reason=req.finish_reason, matched=req.matched_stop_token)

    def emit(self, req: Req, finish_reason: str | None = None, matched: int | None = None,
             error: str | None = None) -> None:
        """What `req` has not sent yet leaves through its `on_output` (nothing when there is nothing new)."""
        if req.on_output is None:
            return
        new_ids = req.output_ids[req.num_sent:]
        # A resumed choice holds the logprobs of its new tokens only.
        new_lps = req.output_logprobs[req.num_sent - (req.resumed or 0):] if req.output_logprobs else []
        if not new_ids and finish_reason is None:
            return
        first = req.num_sent == 0
        req.num_sent = len(req.output_ids)
        self.observer.output(req, len(new_ids), finish_reason)
        prompt_lps = None
        if req.input_logprobs and not req.input_logprobs_sent and req.index == 0:
            prompt_lps, req.input_logprobs_sent = req.input_logprobs, True
        out = ReqOutput(req.rid, req.index, new_ids, new_lps, finish_reason, matched,
                        prompt_tokens=len(req.input_ids), cached_tokens=req.cached_tokens, error=error,
                        input_logprobs=prompt_lps)
        if first:
            out.first_token_time, out.arrival, out.tier_tokens = req.first_token_time, req.arrival, req.tier_tokens
            started = req.first_scheduled if req.first_scheduled is not None else req.pages_reserved
            if started is not None:
                out.queue_s = started - req.arrival
                if req.first_scheduled is not None and req.first_token_time is not None:
                    out.compute_s = req.first_token_time - req.first_scheduled
        req.on_output(out)

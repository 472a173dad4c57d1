"""Speculative decoding with n-gram drafts (prompt lookup): several tokens of a request per step, each exactly
the token plain decoding would give.

Drafts. Each request keeps an index of its own tokens, prompt and output (`NgramIndex`). The draft continues the
latest earlier occurrence of the sequence's suffix: occurrences share its last `min_match` tokens, the one whose
match reaches furthest back (up to `max_match`) wins, the latest among equals, and the draft is what followed it.
Copying a passage, quoting a source, repeating a JSON key or a line of code: the text says what comes next.

Verification. A decode batch whose requests have drafts runs as an extend batch: each request's newest token and
its drafts, with logits at every position. Tokens are then sampled one position at a time as a plain decode step
samples them (grammar mask, penalties, bans, logit_bias, the request's own generator), each appended before the
next position is sampled, and a request goes on to its next position only while the token sampled there equals
the draft fed after it: only then are the next logits the ones plain decoding would compute. Greedy output is
therefore unchanged, and a sampled token is drawn from the very distribution plain decoding draws from (for a
draft token d this is rejection sampling with a point-mass proposal: d is kept with probability p(d), and a
rejection draws from p without d); a seeded request even draws the same uniforms. KV written for rejected drafts
lies past the request's computed length; its pages beyond the next token go back to the pool at once.

When to draft. A draft token costs a row of the verify step and pays only if it is accepted. Each request keeps
a running acceptance rate a (accepted over tried, starting from a prior and drifting back to it while it does not
draft); its j-th draft token is accepted with probability about a^j. `StepCost` fits the step time to the tokens
of a step, t = fixed + per_token * tokens, over recent steps: a draft token is worth drafting when a^j exceeds
per_token / (t(B) / B), the cost of one more row against what a token costs in a plain step of B requests. At
batch 1 on a CPU the weights dominate and nearly every draft pays; at large batches only drafts that are nearly
always accepted do, so high concurrency keeps its throughput.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.shared.config import SpeculativeConfig
from pdserve.shared.outputs import acceptance
from pdserve.shared.req import Req, ReqStatus
from pdserve.shared.sampler import row_wise
from pdserve.shared.scheduler import Batch
from pdserve.shared.step_ops import StepOps

if TYPE_CHECKING:
    import torch

CANDIDATES = 8  # latest occurrences of each anchor kept: the longest match among them wins
PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0  # a request's acceptance rate before any evidence, worth this many tries
DECAY = 0.9  # per step, on a request's evidence and on the step-cost fit
WINDOW = 128  # verify steps the reported acceptance figures cover


class NgramIndex:
    """Where each `min_match`-token n-gram of one sequence ended, for the positions whose next token is known."""

    def __init__(self, tokens: list[int], min_match: int, max_match: int) -> None:
        self.min_match, self.max_match = min_match, max_match
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        t, n = self.tokens, self.min_match
        first = max(len(t) - 1, n - 1)
        t.extend(tokens)
        for end in range(first, len(t) - 1):  # the n-gram ending at `end`, now that t[end + 1] is known
            ends = self.ends.setdefault(tuple(t[end - n + 1:end + 1]), [])
            ends.append(end)
            if len(ends) > CANDIDATES:
                del ends[0]

    def draft(self, k: int) -> list[int]:
        """Up to k tokens that followed the best earlier match of the sequence's suffix ([] when none)."""
        t, n = self.tokens, len(self.tokens)
        if n <= self.min_match:
            return []
        ends = self.ends.get(tuple(t[n - self.min_match:]))
        if not ends:
            return []
        best, best_len = -1, 0
        for end in reversed(ends):
            length = self.min_match
            while length < self.max_match and end - length >= 0 and t[end - length] == t[n - 1 - length]:
                length += 1
            if length > best_len:
                best, best_len = end, length
                if length == self.max_match:
                    break
        return t[best + 1:best + 1 + k]


@dataclass
class Drafting:
    """One request's index and its recent acceptance."""

    index: NgramIndex
    accepted: float = 0.0  # decayed sums: draft tokens accepted, and tried (accepted + the first rejected)
    tried: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)

    def record(self, drafted: int, accepted: int) -> None:
        self.accepted = self.accepted * DECAY + accepted
        self.tried = self.tried * DECAY + min(drafted, accepted + 1)

    def idle(self) -> None:
        self.accepted *= DECAY
        self.tried *= DECAY


class StepCost:
    """A least-squares fit of step seconds = fixed + per_token * tokens over recent decode and verify steps."""

    def __init__(self) -> None:
        self.w = self.st = self.stt = self.sy = self.sty = 0.0
        self.fixed, self.per_token = 1.0, 0.0  # until fitted: rows are free, so drafting starts at once

    def observe(self, tokens: int, seconds: float) -> None:
        d = DECAY
        self.w, self.st, self.stt = self.w * d + 1, self.st * d + tokens, self.stt * d + tokens * tokens
        self.sy, self.sty = self.sy * d + seconds, self.sty * d + tokens * seconds
        var = self.stt / self.w - (self.st / self.w) ** 2
        if var < 0.5:  # steps of one size say nothing of the slope: keep the last fit
            return
        slope = (self.sty / self.w - self.st * self.sy / self.w ** 2) / var
        self.per_token = max(slope, 0.0)
        self.fixed = max(self.sy / self.w - self.per_token * self.st / self.w, 1e-6)

    def threshold(self, batch: int) -> float:
        """The acceptance probability a draft token needs to pay in a step of `batch` requests."""
        per_request = (self.fixed + self.per_token * batch) / batch
        return self.per_token / per_request


class Speculator:
    def __init__(self, ops: StepOps, config: SpeculativeConfig) -> None:
        self.ops = ops
        self.config = config
        self.scheduler = ops.scheduler
        self.cost = StepCost()
        self.drafting: dict[Req, Drafting] = {}
        # Totals since start: verify steps, requests that drafted in them, draft tokens, draft tokens accepted.
        self.verify_steps = 0
        self.drafting_reqs = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.recent: deque[tuple[int, int, int]] = deque(maxlen=WINDOW)  # per verify step: drafting reqs, drafted, accepted

    # ------------------------------------------------------------ before the forward
    def propose(self, batch: Batch) -> Batch:
        """`batch` (a decode batch) with drafts for the requests where they pay, as a verify batch; unchanged when
        no request drafts."""
        for req in [r for r in self.drafting if r.status == ReqStatus.FINISHED]:
            del self.drafting[req]
        theta = self.cost.threshold(len(batch.reqs))
        drafts = [self._draft(req, theta) for req in batch.reqs]
        if not any(drafts):
            return batch
        return Batch(batch.reqs, is_decode=False, extend_lens=[1 + len(d) for d in drafts], drafts=drafts)

    def _draft(self, req: Req, theta: float) -> list[int]:
        state = self.drafting.get(req)
        if state is None:
            c = self.config
            state = self.drafting[req] = Drafting(NgramIndex(req.input_ids + req.output_ids, c.min_match, c.max_match))
        else:
            state.index.extend(req.output_ids[len(state.index.tokens) - len(req.input_ids):])
        k = min(self.config.num_draft_tokens, self._room(req))
        rate = state.rate
        if theta > 0:  # the j-th draft is accepted with probability about rate ** j (0 < rate < 1): while it beats theta
            k = min(k, int(math.log(theta) / math.log(rate)))
        draft = state.index.draft(k) if k > 0 else []
        if not draft:
            state.idle()
            return []
        if req.grammar is not None:
            draft = draft[:req.grammar.acceptable_prefix(draft)]
        if draft and not self._grow(req, req.seq_len + len(draft)):
            return []
        return draft

    def _room(self, req: Req) -> int:
        """Draft tokens the request may still take: the step adds up to k + 1 tokens."""
        p = req.params
        left = min(p.max_new_tokens - len(req.output_ids), self.ops.runner.context_length - req.seq_len)
        return max(left - 1, 0)

    def _grow(self, req: Req, num_tokens: int) -> bool:
        """Pages for `num_tokens` from the free pages only: a draft never evicts the prefix cache."""
        s = self.scheduler
        need = -(-num_tokens // s.page_size) - len(req.pages)
        if need <= 0:
            return True
        if need > s.allocator.num_free:
            return False
        req.pages.extend(s.allocator.allocate(need))
        return True

    # ------------------------------------------------------------ after the forward
    def observe(self, batch: Batch, seconds: float) -> None:
        """A decode or verify step took `seconds`, from drafting to its tokens sampled: refit the step cost. The
        host's part counts: a verify step samples position by position, and with int8 matmuls (cheap rows) the
        forward alone made drafts look cheaper than they were (speculation lost 12 % at 32 streams)."""
        self.cost.observe(sum(batch.extend_lens), seconds)

    def verify(self, batch: Batch, logits: torch.Tensor) -> None:
        """Sample the verify batch's tokens position by position (see the module's docstring) and emit them."""
        ops, reqs, drafts = self.ops, batch.reqs, batch.drafts
        offsets, row = [], 0
        for n in batch.extend_lens:
            offsets.append(row)
            row += n
        accepted = [0] * len(reqs)
        drafting = sum(1 for d in drafts if d)
        ahead = self._sample_ahead(batch, logits, offsets)
        live, pos = list(range(len(reqs))), 0
        while live:
            now = [i for i in live if i not in ahead]
            sampled = dict(zip(now, zip(*ops.sample(logits, [offsets[i] + pos for i in now],
                                                     [reqs[i] for i in now])))) if now else {}
            position = [(reqs[i], *((ahead[i][pos], None) if i in ahead else sampled[i])) for i in live]
            for req, _, _ in position:
                req.num_computed += 1  # the KV of the token fed at this position holds
            ops.commit(position, join=False, send=False)  # sent once, after the last position
            ops.stats.decode_tokens += len(position)
            going = [i for i, (req, token, _) in zip(live, position)
                     if req.status == ReqStatus.RUNNING and pos < len(drafts[i]) and token == drafts[i][pos]]
            for i in going:
                accepted[i] += 1
            live, pos = going, pos + 1
        for req, draft, n in zip(reqs, drafts, accepted):
            req.decode_steps += 1
            if draft:
                self.drafting[req].record(len(draft), n)
                req.drafted_tokens, req.accepted_tokens = req.drafted_tokens + len(draft), req.accepted_tokens + n
            if req.status == ReqStatus.RUNNING:  # pages past its next token held only rejected drafts
                keep = -(-req.seq_len // self.scheduler.page_size)
                self.scheduler.allocator.free(req.pages[keep:])
                del req.pages[keep:]
        drafted, gained = sum(len(d) for d in drafts), sum(accepted)
        self.verify_steps += 1
        self.drafting_reqs += drafting
        self.drafted_tokens += drafted
        self.accepted_tokens += gained
        self.recent.append((drafting, drafted, gained))
        ops.emit_all(reqs)

    def _sample_ahead(self, batch: Batch, logits: torch.Tensor, offsets: list[int]) -> dict[int, list[int]]:
        """The tokens of every position at once (by batch index) for the requests whose choice at a position does
        not depend on the tokens chosen before it in this step (`_ahead`). One sampler call for all their rows,
        where position by position took one per position; the same function of each row's logits either way."""
        chosen = [i for i, (req, draft) in enumerate(zip(batch.reqs, batch.drafts)) if draft and _ahead(req)]
        if not chosen:
            return {}
        rows = [offsets[i] + j for i in chosen for j in range(batch.extend_lens[i])]
        owners = [batch.reqs[i] for i in chosen for _ in range(batch.extend_lens[i])]
        tokens, _ = self.ops.sample(logits, rows, owners)
        ahead, at = {}, 0
        for i in chosen:
            ahead[i], at = tokens[at:at + batch.extend_lens[i]], at + batch.extend_lens[i]
        return ahead

    def figures(self) -> tuple[float, float]:
        """SGLang's figures over the latest verify steps (see `acceptance`)."""
        return acceptance(*(sum(column) for column in zip(*self.recent))) if self.recent else (1.0, 0.0)

    def totals(self) -> dict[str, int]:
        return {"spec_drafting_reqs": self.drafting_reqs, "spec_draft_tokens": self.drafted_tokens,
                "spec_accepted_tokens": self.accepted_tokens}


def _ahead(req: Req) -> bool:
    """Its draft's positions can be sampled at once (see `_sample_ahead`): the sampler says its token at a position
    depends on that position's logits alone, no grammar's state moves between them, and no logprobs are asked
    (tokens sampled ahead come without)."""
    p = req.params
    return (req.grammar is None and row_wise(p, req.output_ids) and not p.return_logprob
            and not p.top_logprobs_num)

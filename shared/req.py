"""Req: one sequence being generated, and the status enum of its lifecycle.

The status order is the lifecycle. Colocated: WAITING -> PREFILLING -> RUNNING
-> FINISHED. Prefill role: WAITING -> PREFILLING -> TRANSFERRING -> FINISHED.
Decode role: WAITING_FOR_PAGES -> WAITING_FOR_KV -> RUNNING -> FINISHED.
A retracted request goes back to WAITING with its output so far.
"""
from __future__ import annotations

import enum
import hashlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from pdserve.shared.grammar import Constraint
from pdserve.shared.lora import LoraAdapter
from pdserve.shared.outputs import ReqOutput, TokenLogprobs
from pdserve.shared.radix_cache import Node
from pdserve.shared.sampling_params import SamplingParams


class ReqStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_PAGES = 1  # decode role: pages for the prompt not reserved yet
    WAITING_FOR_KV = 2  # decode role: pages reserved, prefill is filling them
    PREFILLING = 3  # some prompt chunks computed, more to go
    TRANSFERRING = 4  # prefill role: KV is being written to the decode worker
    RUNNING = 5
    FINISHED = 6


@dataclass
class TransferTarget:
    """Prefill role: where the request's KV pages go."""

    peer_name: str
    dst_pages: list[int]
    # The reservation's fence, which every write into those pages carries, and the deadline (this worker's
    # monotonic clock) after which none may start (shared/transfer/fence.py); 0: unfenced.
    fence: int = 0
    fence_deadline: float = float("inf")


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_output: Callable[[ReqOutput], None] | None = None
    index: int = 0  # choice index among the n children of one prompt
    transfer: TransferTarget | None = None  # prefill role only
    on_pages_reserved: Callable[[Req], None] | None = None  # decode role only

    status: ReqStatus = ReqStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # pages holding this sequence's KV, in order
    prefix_node: Node | None = None  # locked radix node covering pages[:num_cached_pages]
    num_cached_pages: int = 0  # leading pages owned by the radix cache, not by this request
    num_computed: int = 0  # tokens of `fill_ids` whose KV is in `pages`
    # (cached tail page, own page) when the prompt continues a cached partly filled page: the copy its first
    # step makes (Scheduler._match_prefix)
    tail_copy: tuple[int, int] | None = None
    # The radix node of that cached page, locked until the request is released: the copy may run after the step
    # is issued (a GPU's stream, the overlap schedule), so its page must not be evicted and refilled (by a peer's
    # KV write, which no stream orders) in between.
    copy_source: Node | None = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (reported to users)
    # Of those, the tokens a lower tier put back into the pool for this request: {"host": n, "storage": m}
    # (kv_tiers.py); the rest were in the pool already.
    tier_tokens: dict[str, int] = field(default_factory=dict)
    generator: torch.Generator | None = None
    grammar: Constraint | None = None  # where the output stands in its grammar, for constrained requests
    finish_reason: str | None = None
    matched_stop_token: int | None = None
    num_sent: int = 0  # output tokens already reported through on_output
    # A choice continued here where it stopped on another worker (migration): the output tokens it came with,
    # already streamed (None: it started here). Its sampler state is what those tokens make it (resume.py).
    resumed: int | None = None
    moved_in: bool = False  # decode role, a live move: its KV (prompt and output so far) is written here by the
    # decode worker it froze on (roles/move_out.py), not computed
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None  # when its first prompt chunk ran: the end of its queue time
    first_token_time: float | None = None
    pages_reserved: float | None = None  # decode role: when its prompt's pages were reserved (its prefill asked for)
    # (step start, step end, tokens) of each step that computed part of its prompt here (what a trace shows)
    prefill_chunks: list[tuple[float, float, int]] = field(default_factory=list)
    decode_steps: int = 0  # engine steps that gave it tokens after the first
    drafted_tokens: int = 0  # speculative decoding: its draft tokens verified, and accepted
    accepted_tokens: int = 0
    last_output: float | None = None  # when its latest tokens left through on_output (inter-token latency)
    input_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens from max(start, 1) on
    input_logprobs_sent: bool = False
    lora: LoraAdapter | None = None  # the adapter the request runs with (None: the base model)
    lora_slot: int = -1  # its slot in the LoRA pool while the request holds one (scheduler-owned)

    @property
    def first_logit_row(self) -> int | None:
        """The first prompt position whose logits the request needs for its prompt logprobs (None: none)."""
        if not self.params.wants_prompt_logprobs or self.output_ids or self.resumed is not None:
            return None
        return max(self.params.logprob_start_len, 1) - 1

    @property
    def cache_namespace(self) -> str | None:
        """Prefix-cache namespace: KV computed under an adapter is only ever reused under the same adapter, and KV
        of a salted prompt (`cache_salt`) only by prompts of the same salt (named by a digest: a salt is a secret
        and the namespace reaches the storage tier's keys)."""
        parts = [] if self.lora is None else [f"{self.lora.name}@{self.lora.version}"]
        if self.params.cache_salt is not None:
            parts.append("salt:" + hashlib.blake2b(self.params.cache_salt.encode(), digest_size=16).hexdigest())
        return "|".join(parts) or None

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the sequence needs: prompt plus generated output."""
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status == ReqStatus.FINISHED

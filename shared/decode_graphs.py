"""Decode steps on static buffers, one bucket of batch sizes at a time: what CUDA graphs capture and replay.

A decode batch of B sequences runs as the smallest bucket b >= B: its inputs are copied into buffers made once
(token ids, positions, KV slots, page table, sequence lengths), rows B..b are padding, and the model runs on the
first b rows of those buffers. On CUDA each bucket's forward was captured at start-up as a graph, so a step is
a few copies and one replay instead of hundreds of kernel launches; on the CPU (`capture=False`) the same padded
path runs eagerly, which is how it is tested against the dynamic path without a GPU.

Padding rows read and write only the pool's scratch page (KVPool(scratch_page=True)): one token of context,
their KV slot on that page, so they never touch a request's KV. Their logits are dropped.

What runs eagerly instead, and why (`why_not`): prompts (a prefill's shape is the prompt's), a batch above the
largest bucket, a batch with LoRA rows (the adapter kernels read per-row slots the graph lacks), and, set at
construction, models with expert layers (routing sizes its work on the host).
"""
from __future__ import annotations

import bisect
import logging

import torch

from pdserve.shared.kernel_ops import KernelOps
from pdserve.shared.kv_pool import KVPool
from pdserve.shared.models.llama import ForwardBatch, LlamaForCausalLM
from pdserve.shared.models.moe import SparseMoE

log = logging.getLogger(__name__)


def bucket_sizes(max_bs: int, given: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The batch sizes to capture: `given` (SGLang's --cuda-graph-bs), else 1, 2, 4, 8, then every 8 up to 64,
    every 16 up to 128 and every 32 beyond, up to `max_bs` (which is always one)."""
    if given:
        if any(b < 1 for b in given):
            raise ValueError(f"--cuda-graph-bs takes batch sizes >= 1, got {list(given)}")
        return tuple(sorted(set(given)))
    if max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    sizes = [1, 2, 4, 8] + list(range(16, 65, 8)) + list(range(80, 129, 16)) + list(range(160, max_bs + 1, 32))
    return tuple(sorted({b for b in sizes if b < max_bs} | {max_bs}))


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool, ops: KernelOps, buckets: tuple[int, ...],
                 max_pages: int, capture: bool) -> None:
        """`max_pages`: pages of the longest sequence the context allows (the page table's static width)."""
        if pool.scratch_page is None:
            raise ValueError("decode graphs need a KV pool with a scratch page for their padding rows")
        self.model, self.pool, self.ops = model, pool, ops
        self.buckets = buckets
        self.max_pages = max_pages
        self.scratch_slot = pool.scratch_page * pool.page_size
        max_bs, dev = buckets[-1], pool.buffer.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slots = torch.full((max_bs,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.page_table = torch.zeros((max_bs, max_pages), dtype=torch.int32, device=dev)
        self.page_table[:, 0] = pool.scratch_page
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.ones = torch.ones(max_bs, dtype=torch.int32, device=dev)  # extend_lens: one new token each
        self.rows = torch.arange(max_bs, dtype=torch.int64, device=dev)  # last_rows: one row per sequence
        self.q_start = self.rows.to(torch.int32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's logits [b, V], overwritten by every replay
        self.skip_all = "expert layers" if any(isinstance(layer.mlp, SparseMoE) for layer in model.layers) else None
        self._told: set[str] = set()
        if capture and self.skip_all is None:
            self.capture()

    # ---------------------------------------------------------------- which path
    def bucket_for(self, batch_size: int) -> int | None:
        i = bisect.bisect_left(self.buckets, batch_size)
        return self.buckets[i] if i < len(self.buckets) else None

    def why_not(self, fb: ForwardBatch) -> str | None:
        """Why this batch runs eagerly (None: it runs on the buffers). Prompts are not worth a word; the other
        reasons are logged once each."""
        if not fb.is_decode:
            return "prefill"
        reason = self.skip_all
        if reason is None and fb.lora_slots is not None:
            reason = "LoRA adapters in the batch"
        if reason is None and self.bucket_for(fb.seq_lens.shape[0]) is None:
            reason = f"batches above {self.buckets[-1]} sequences (--cuda-graph-max-bs)"
        if reason is not None and reason not in self._told:
            self._told.add(reason)
            log.info("decode steps run without graphs for %s", reason)
        return reason

    # ---------------------------------------------------------------- running
    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits [B, V] of a decode batch that `why_not` let through."""
        n = fb.seq_lens.shape[0]
        b = self.bucket_for(n)
        width = fb.page_table.shape[1]
        self.input_ids[:n].copy_(fb.input_ids)
        self.positions[:n].copy_(fb.positions)
        self.slots[:n].copy_(fb.slots)
        self.page_table[:n, :width].copy_(fb.page_table)
        self.page_table[:n, width:].zero_()
        self.seq_lens[:n].copy_(fb.seq_lens)
        self._pad(n, b)
        if b in self.graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        return self.model.forward(self._batch(b), self.pool, self.ops)[:n]

    def _pad(self, n: int, b: int) -> None:
        """Rows n..b: one token of context on the scratch page (a previous, larger batch left real rows there)."""
        if n == b:
            return
        self.input_ids[n:b].zero_()
        self.positions[n:b].zero_()
        self.slots[n:b].fill_(self.scratch_slot)
        self.page_table[n:b].zero_()
        self.page_table[n:b, 0] = self.pool.scratch_page
        self.seq_lens[n:b].fill_(1)

    def _batch(self, b: int) -> ForwardBatch:
        return ForwardBatch(is_decode=True, input_ids=self.input_ids[:b], positions=self.positions[:b],
                            slots=self.slots[:b], page_table=self.page_table[:b], seq_lens=self.seq_lens[:b],
                            extend_lens=self.ones[:b], q_start=self.q_start[:b],
                            last_rows=self.rows[:b])

    # ---------------------------------------------------------------- capture (CUDA)
    def capture(self) -> None:
        """Capture every bucket's forward, largest first so that the smaller ones reuse its memory pool. Again
        after new weights are swapped in: a graph holds the addresses of the tensors it read."""
        self.graphs.clear()
        self.outputs.clear()
        self._pad(0, self.buckets[-1])  # every row on the scratch page while warming up and capturing
        stream = torch.cuda.Stream(device=self.pool.buffer.device)
        mempool = None
        for b in reversed(self.buckets):
            batch = self._batch(b)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compiles and tunes the kernels outside the capture
                    self.model.forward(batch, self.pool, self.ops)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool, stream=stream):
                self.outputs[b] = self.model.forward(batch, self.pool, self.ops)
            mempool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode graphs for batch sizes %s", ", ".join(map(str, self.buckets)))

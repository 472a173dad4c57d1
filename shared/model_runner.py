"""ModelRunner: owns the model weights and the KV pool, and runs one forward step.

It turns a scheduler Batch into flat tensors (ForwardBatch) and returns the
logits of each sequence's last new token. It knows nothing of queues or limits.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import torch

from pdserve.shared.config import ModelConfig, RuntimeConfig
from pdserve.shared.decode_graphs import DecodeGraphs, bucket_sizes
from pdserve.shared.host_memory import keep_freed_memory, upload
from pdserve.shared.invariance import check_batch_invariance
from pdserve.shared.kernel_ops import get_kernel_ops, resolve_kernel_set
from pdserve.shared.kv_pool import KVLayout, KVPool
from pdserve.shared.linear import cpu_has_bf16
from pdserve.shared.lora_registry import LoraRegistry
from pdserve.shared.models.llama import ForwardBatch, LlamaForCausalLM
from pdserve.shared.scheduler import Batch
from pdserve.shared.tp_step import (DISCARD, POOL, START_TIMEOUT_S, SWAP, WEIGHTS, LoraMirror, TPRank,
                                    bytes_payload, lead_step)
from pdserve.shared.weights import Checkpoint, WeightsError, check_finite, read_checkpoint

log = logging.getLogger(__name__)
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(requested: str, checkpoint: str, device: str) -> torch.dtype:
    """`--dtype auto`: the checkpoint's dtype, unless this device computes another faster. On a CPU fp16 becomes
    bf16 (same size, more range, fast matmuls), and bf16 becomes fp32 where the CPU has no bf16 instructions (no
    AVX512-BF16, no AMX): there bf16 is emulated, and a [32 x 576] x [576 x 1536] matmul ran at 4.3 GFLOPS
    against fp32's 21 on an AVX2-only AMD EPYC."""
    if requested != "auto":
        return _DTYPES[requested]
    dtype = _DTYPES.get(checkpoint.replace("torch.", ""), torch.float32)
    if device.startswith("cuda"):
        return dtype
    if dtype == torch.float16:
        dtype = torch.bfloat16
    if dtype == torch.bfloat16 and not cpu_has_bf16():
        return torch.float32
    return dtype


def _check_tp_features(config: RuntimeConfig) -> None:
    """What a tensor-parallel worker does not do yet, refused at start with the reason."""
    refused = []
    if config.tiers is not None and (config.tiers.host_ratio is not None or config.tiers.host_gb is not None):
        # the storage tier works across ranks (kv_tier_ranks.py); the host tier's copies are rank 0's alone
        refused.append("--hicache-ratio / --hicache-size (the host tier keeps rank 0's KV heads only; use the "
                       "storage tier, --hicache-storage-backend file, whose pages every rank stores its part of)")
    if config.decode_graphs == "static":
        refused.append("static decode graphs (a captured step cannot wait on the other ranks' all-reduce)")
    if refused:
        raise ValueError("--tp-size > 1 does not work with " + "; ".join(refused))


def free_memory_bytes(device: torch.device) -> int:
    """Memory still free for the KV pool: on CUDA the device's, on CPU the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ValueError("cannot read MemAvailable from /proc/meminfo; pass --max-total-tokens instead")


class ModelRunner:
    def __init__(self, config: RuntimeConfig, model_config: ModelConfig | None = None,
                 tp: TPRank | None = None) -> None:
        """`tp`: this process is one rank of a tensor-parallel worker (shared/tp_step.py); rank 0's
        runner leads every step, a follower's builds its pool when rank 0 says how large (`build_pool`)."""
        self.config = config
        self.model_config = model_config or ModelConfig.from_dir(config.model_path)
        mc = self.model_config
        self.tp = tp if tp is not None and tp.shards.size > 1 else None
        if self.tp is not None:
            _check_tp_features(config)
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations are re-allocated every layer: reuse warm pages, not fresh mmaps
        self.dtype = resolve_dtype(config.dtype, mc.torch_dtype, config.device)
        if config.dtype == "auto" and self.dtype == torch.float32 and "bfloat16" in mc.torch_dtype:
            log.info("--dtype auto: float32, since this CPU has no bf16 instructions (bf16 would be emulated)")
        self.context_length = config.context_length or mc.max_position_embeddings
        if self.context_length > mc.max_position_embeddings and not mc.rope_scaling:
            raise ValueError(f"--context-length {self.context_length} exceeds the model's "
                             f"max_position_embeddings {mc.max_position_embeddings}")
        kernel_set = resolve_kernel_set("native" if config.deterministic else config.kernels,
                                        self.device, self.dtype)
        self.ops = get_kernel_ops(kernel_set, deterministic=config.deterministic)
        self.hidden_output = config.is_embedding or mc.is_bare  # an embedding model: no LM head
        self.model = LlamaForCausalLM(mc, self.dtype, self.device, self.context_length,
                                     batch_invariant=config.deterministic, hidden_output=self.hidden_output,
                                     quantization=config.quantization, **self._tp_parts())
        self.model.load(config.model_path)
        self.lora: LoraRegistry | None = None  # the adapters requests may name, when LoRA is enabled
        if config.lora is not None:
            self.lora = LoraRegistry.from_config(config.lora, mc, self.dtype, self.device,
                                                 self.tp.shards if self.tp else None)
            self.model.lora = self.lora.pool
            if self.tp is not None and self.tp.leads:  # every rank's slots follow rank 0's
                self.lora.pool.mirror = LoraMirror(self.tp)
        if config.deterministic:  # before the first request: a machine that breaks the promise refuses to start
            started = time.perf_counter()
            checks = check_batch_invariance(self.model, self.ops, config.cache.page_size)
            log.info("deterministic mode: %d batch-invariance checks passed on this machine in %.2f s", checks,
                     time.perf_counter() - started)
        self.layout = KVLayout(1, config.cache.page_size, mc.num_layers, self.model.num_kv_heads, mc.head_dim,
                               self.dtype)  # this rank's KV heads
        self.graphs: DecodeGraphs | None = None
        self.pool: KVPool | None = None
        if self.tp is None or self.tp.leads:
            self.build_pool(self._num_pages())

    def _tp_parts(self) -> dict:
        return {} if self.tp is None else {"shards": self.tp.shards, "group": self.tp.group}

    def _num_pages(self) -> int:
        config, mc = self.config, self.model_config
        if config.cache.mem_fraction is None:
            return config.cache.num_pages
        # Under tensor parallelism on one CPU every rank's pool comes out of the same memory: the pages are sized
        # for the whole model's KV heads, so the ranks together take the fraction asked for.
        whole = KVLayout(1, config.cache.page_size, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype)
        page_bytes = whole.page_bytes if self.device.type == "cpu" else self.layout.page_bytes
        num_pages = int(free_memory_bytes(self.device) * config.cache.mem_fraction) // page_bytes
        if num_pages < 1:
            raise ValueError(f"--mem-fraction {config.cache.mem_fraction} leaves no room for one KV page")
        return num_pages

    def build_pool(self, num_pages: int) -> None:
        """The KV pool, of `num_pages` pages of this rank's heads (rank 0 tells the followers how many)."""
        config = self.config
        if self.tp is not None and self.tp.leads:
            self.tp.box.post(POOL, [num_pages])
        graphs = self.tp is None and (config.decode_graphs == "static"
                                      or (config.decode_graphs == "auto" and self.device.type == "cuda"))
        self.pool = KVPool(replace(self.layout, num_pages=num_pages), self.device, scratch_page=graphs)
        if self.tp is not None:  # every rank loaded and has its pool before the first step
            self.tp.group.barrier(START_TIMEOUT_S)
        if graphs:
            self.graphs = DecodeGraphs(self.model, self.pool, self.ops,
                                       bucket_sizes(config.cuda_graph_max_bs, config.cuda_graph_bs),
                                       max_pages=-(-self.context_length // self.pool.page_size),
                                       capture=self.device.type == "cuda")

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    # ---------------------------------------------------------------- live weight updates (shared/weights.py)
    def read_weights(self, model_path: str) -> Checkpoint:
        """The checkpoint at `model_path`, checked against the running model; file I/O only, any thread."""
        return read_checkpoint(model_path, self.model_config, self.model.checkpoint_shapes)

    def build_weights(self, checkpoint: Checkpoint) -> LlamaForCausalLM:
        """A model holding `checkpoint`'s weights, prepared exactly as the running one was (dtype, device, packed
        matmuls); the running model is not touched. Consumes checkpoint.tensors, so each raw tensor is freed once
        converted. Compute: call it on the engine thread. Raises WeightsError.

        Tensor-parallel: rank 0 has every other rank read the same directory and build its own shards, and
        raises unless all of them could."""
        if self.tp is not None and self.tp.leads:
            self.tp.box.post(WEIGHTS, [], bytes_payload(str(checkpoint.directory).encode()))
        staged, error = None, None
        try:
            check_finite(checkpoint.tensors)
            staged = LlamaForCausalLM(self.model_config, self.dtype, self.device, self.context_length,
                                      batch_invariant=self.config.deterministic, hidden_output=self.hidden_output,
                                      quantization=self.config.quantization, **self._tp_parts())
            try:
                staged.load(checkpoint.directory, checkpoint.tensors)
            except (RuntimeError, ValueError) as exc:  # out of memory, or a tensor the checks could not foresee
                raise WeightsError(f"cannot build the new weights: {exc}") from None
        except WeightsError as exc:
            staged, error = None, exc
        if self.tp is not None:
            failed = self.tp.group.failed_ranks(error is not None, START_TIMEOUT_S)
            if failed and error is None:
                staged, error = None, WeightsError(f"tensor-parallel rank(s) {failed} could not build the new "
                                                   "weights (their logs say why); nothing changed")
        if error is not None:
            raise error
        return staged

    def swap_weights(self, staged: LlamaForCausalLM) -> None:
        """Serve `staged`'s weights from the next forward on (engine thread, between two steps); every rank of a
        tensor-parallel worker swaps to the shards it staged."""
        if self.tp is not None and self.tp.leads:
            self.tp.box.post(SWAP, [])
        self.model.take_weights(staged)
        if self.graphs is not None and self.graphs.graphs:
            self.graphs.capture()  # the graphs read the old weights' addresses
        if self.tp is not None:
            self.tp.group.barrier(START_TIMEOUT_S)

    def discard_weights(self) -> None:
        """The weights staged are dropped: a tensor-parallel worker's other ranks drop theirs."""
        if self.tp is not None and self.tp.leads:
            self.tp.box.post(DISCARD, [])
            self.tp.group.barrier(START_TIMEOUT_S)

    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B, V] (model dtype) for the last new token of every request in the batch (of a verify batch:
        for each of its new tokens, [sum(extend_lens), V]); the logits of the prompt positions whose logprobs are
        asked for go to batch.prompt_logits."""
        fb = self.prepare(batch)
        if self.tp is not None:
            lead_step(self.tp, fb, batch.page_copies)
        logits = self.run_step(fb, batch.page_copies)
        if not batch.prompt_rows:
            return logits
        batch.prompt_logits = logits[len(batch.reqs):]
        return logits[:len(batch.reqs)]

    def run_step(self, fb: ForwardBatch, page_copies: list[tuple[int, int]]) -> torch.Tensor:
        """The step's page copies, then its forward (every rank of a tensor-parallel worker runs this)."""
        for src, dst in page_copies:
            self.pool.copy_page(src, dst)
        if self.graphs is not None and self.graphs.why_not(fb) is None:
            return self.graphs.run(fb)  # a decode batch: no prompt rows
        return self.model.forward(fb, self.pool, self.ops)

    def close(self) -> None:
        """The followers of a tensor-parallel worker leave their loops."""
        if self.tp is not None and self.tp.leads:
            self.tp.stop()

    def prepare(self, batch: Batch) -> ForwardBatch:
        s = self.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens, q_start, last_rows, prompt_rows, lora_slots = [], [], [], [], []
        batch.prompt_rows = []
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            start = req.num_computed
            if batch.drafts is not None:  # a verify batch: the newest token and its drafts, logits at each
                new = [req.output_ids[-1]] + batch.drafts[i]
            else:
                new = req.fill_ids[start:start + n]
                first = req.first_logit_row if not batch.is_decode else None
                if first is not None:  # positions in this chunk that predict a prompt token from `first` on
                    lo, hi = max(start, first), min(start + n, len(req.input_ids) - 1)
                    if hi > lo:
                        prompt_rows.extend(range(len(ids) + lo - start, len(ids) + hi - start))
                        batch.prompt_rows.append((req, lo, hi - lo))
            q_start.append(len(ids))
            ids.extend(new)
            for pos in range(start, start + n):
                positions.append(pos)
                slots.append(req.pages[pos // s] * s + pos % s)
            seq_lens.append(start + n)
            if batch.drafts is not None:
                last_rows.extend(range(len(ids) - n, len(ids)))
            else:
                last_rows.append(len(ids) - 1)
            lora_slots.extend([req.lora_slot] * n)
        max_pages = max(len(r.pages) for r in batch.reqs)
        table = [r.pages + [0] * (max_pages - len(r.pages)) for r in batch.reqs]
        extend_lens, is_decode = batch.extend_lens, batch.is_decode
        if batch.drafts is not None:
            # A verify batch runs as a decode batch of one row per token: the token at position p attends to the
            # request's first p + 1 positions (its drafts' KV is stored before attention, as a decode row's is).
            # Decode attention does this in one pass where extend attention cost 3x more at these sizes.
            table = [row for row, n in zip(table, extend_lens) for _ in range(n)]
            seq_lens = [p + 1 for p in positions]
            q_start = list(range(len(ids)))
            extend_lens, is_decode = [1] * len(ids), True
        # Two host-to-device copies, one per integer width: on a GPU from pinned memory without blocking, so that
        # building a step never waits for the step still running on the device (see shared/overlap.py).
        n, b, w = len(ids), len(seq_lens), len(table[0])
        longs = upload(ids + positions + slots + last_rows + prompt_rows, torch.int64, self.device)
        has_lora = any(slot >= 0 for slot in lora_slots)
        ints = upload([p for row in table for p in row] + seq_lens + list(extend_lens) + q_start
                      + (lora_slots if has_lora else []), torch.int32, self.device)
        input_ids = longs[:n]
        if batch.in_flight is not None and min(ids) < 0:  # a token still on the device: its row of in_flight
            input_ids = torch.where(input_ids >= 0, input_ids, batch.in_flight[(-1 - input_ids).clamp(min=0)])
        at = b * w
        return ForwardBatch(
            is_decode=is_decode,
            input_ids=input_ids,
            positions=longs[n:2 * n],
            slots=longs[2 * n:3 * n],
            page_table=ints[:at].view(b, w),
            seq_lens=ints[at:at + b],
            extend_lens=ints[at + b:at + 2 * b],
            q_start=ints[at + 2 * b:at + 3 * b],
            last_rows=longs[3 * n:],
            lora_slots=ints[at + 3 * b:] if has_lora else None,
        )

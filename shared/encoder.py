"""Encoder: serves an encoder-only model (embeddings, cross-encoder scores) from one thread that batches.

Lifecycle of a request: `submit(seqs)` queues it and returns a Future -> the thread takes everything queued,
sorts the sequences by length and cuts them into padded batches of at most `max_batch_tokens` (padding
included) -> one bidirectional forward per batch -> pooled vectors (or classifier logits) go back to their
requests -> each Future completes when all its sequences are done. There is no KV cache: nothing outlives
a forward, so there are no pages to account for.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pdserve.shared.host_memory import keep_freed_memory
from pdserve.shared.linear import bf16_matmul_pays
from pdserve.shared.models.bert import BertConfig, BertModel
from pdserve.shared.pooling import PoolingConfig, pool

log = logging.getLogger(__name__)

QUANTIZATIONS = (None, "w8a8_int8")
# On a CPU, forwards of about a thousand tokens keep each layer's activations in cache: all-MiniLM-L6-v2 over
# 64 x 128 tokens ran 1.1-1.25x faster in fp32 and 1.4-1.9x in int8 cut into batches of 512-1,024 tokens than
# as one batch of 8,192 (more than 2,048 measured slower, 128 too). With bf16 matmuls (half the bytes in the
# matmuls' inputs) 2,048 measured 1.08x faster than 1,024 and as fast as 4,096 or 8,192.
CPU_BATCH_TOKENS = 1024
CPU_BATCH_TOKENS_BF16 = 2048


@dataclass
class _Job:
    seqs: list[list[int]]
    future: Future
    types: list[list[int]] | None = None  # segment ids per token (cross-encoder pairs); None: all 0
    outputs: list[list[float] | None] = field(default_factory=list)
    left: int = 0
    arrival: float = field(default_factory=time.monotonic)


class Encoder:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype | None = None, device: str = "cpu",
                 context_length: int | None = None, max_batch_tokens: int = 8192,
                 quantization: str | None = None) -> None:
        """`quantization`: None, or "w8a8_int8" to run the layers' matmuls in int8 (see quantize)."""
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantization!r} is not supported for encoder models "
                             f"(choose {', '.join(q for q in QUANTIZATIONS if q)})")
        self.config = BertConfig.from_dir(model_dir)
        self.pooling = PoolingConfig.from_dir(model_dir)
        self.dtype = dtype or _checkpoint_dtype(self.config.torch_dtype)
        # dtype auto on an fp32 embedding checkpoint: activations stay fp32 and the matmuls run in bf16 where the
        # CPU computes bf16 faster (AMX, AMD's AVX512-BF16). Embeddings are compared by cosine, which that leaves
        # at 0.9999 or more;
        # a classifier's scores are read as numbers (bf16 matmuls move a cross-encoder's logits by ~5e-3),
        # so classifiers, and an explicit float32, keep every matmul in fp32.
        bf16_matmuls = (dtype is None and self.dtype == torch.float32 and torch.device(device).type == "cpu"
                        and quantization is None and self.config.num_labels == 0 and bf16_matmul_pays())
        self.matmul_dtype = torch.bfloat16 if bf16_matmuls else self.dtype
        self.model = BertModel(self.config, self.dtype, device, bf16_matmuls)
        self.model.load(model_dir)
        if self.model.device.type == "cpu":
            keep_freed_memory()  # a forward's activations are tens of MB, every batch: reuse them warm
        self.quantization = quantization
        if quantization == "w8a8_int8":
            self.model.quantize_int8(calibration_batches(self.config.vocab_size))
        limit = self.config.max_tokens
        if context_length is not None and context_length > limit:
            raise ValueError(f"--context-length {context_length} exceeds the model's {limit} positions")
        self.context_length = context_length or limit
        if self.model.device.type == "cpu":
            max_batch_tokens = min(max_batch_tokens, CPU_BATCH_TOKENS_BF16 if bf16_matmuls else CPU_BATCH_TOKENS)
        self.max_batch_tokens = max(max_batch_tokens, self.context_length)
        self.is_classifier = self.config.num_labels > 0
        self.output_dim = self.config.num_labels if self.is_classifier else self.config.hidden_size
        # Told of each forward and each request completed or failed, on the encoder's thread
        # (services/worker/encoder_metrics.EncoderMetrics); None: nobody is.
        self.observer = None
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.running = 0  # sequences in the forward now
        self.waiting = 0  # sequences queued

    # ------------------------------------------------------------ thread API
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="encoder", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def check(self, seqs: list[list[int]], type_ids: list[list[int]] | None = None) -> None:
        """ValueError for inputs the model cannot take."""
        if not seqs:
            raise ValueError("no input")
        if type_ids is not None:
            if [len(t) for t in type_ids] != [len(s) for s in seqs]:
                raise ValueError("type_ids must hold one segment id per token of each input")
            if any(not 0 <= t < self.config.type_vocab_size for types in type_ids for t in types):
                raise ValueError(f"segment ids must lie in [0, {self.config.type_vocab_size})")
        for seq in seqs:
            if not seq:
                raise ValueError("an input is empty")
            if len(seq) > self.context_length:
                raise ValueError(f"an input has {len(seq)} tokens, more than the context length of "
                                 f"{self.context_length}")
            bad = next((t for t in seq if not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise ValueError(f"token id {bad} is outside the vocabulary (size {self.config.vocab_size})")

    def submit(self, seqs: list[list[int]], type_ids: list[list[int]] | None = None) -> Future:
        """Queue `seqs`; the Future yields one output vector (list of floats) per sequence, in order."""
        self.check(seqs, type_ids)
        job = _Job(seqs, Future(), type_ids, [None] * len(seqs), len(seqs))
        self.waiting += len(seqs)
        self._queue.put(job)
        return job.future

    def encode(self, seqs: list[list[int]], type_ids: list[list[int]] | None = None) -> list[list[float]]:
        """Synchronous forward in the caller's thread (tests and benchmarks; the server uses submit)."""
        self.check(seqs, type_ids)
        job = _Job(seqs, Future(), type_ids, [None] * len(seqs), len(seqs))
        self._process([job])
        return job.future.result()

    # ------------------------------------------------------------ the loop
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            jobs = [job]
            while True:  # everything queued meanwhile joins this round, so concurrent requests share batches
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                jobs.append(more)
            count = sum(len(j.seqs) for j in jobs)
            self.waiting -= count
            self.running = count
            try:
                self._process(jobs)
            except Exception as exc:  # a failed forward fails its requests, never the thread
                log.exception("encoder forward failed")
                failed = [j for j in jobs if not j.future.done()]
                for j in failed:
                    j.future.set_exception(RuntimeError(f"internal error: {exc}"))
                if self.observer is not None:
                    self.observer.failed_requests(len(failed))
            finally:
                self.running = 0

    def _process(self, jobs: list[_Job]) -> None:
        items = [(j, i) for j in jobs for i in range(len(j.seqs))]
        items.sort(key=lambda item: len(item[0].seqs[item[1]]), reverse=True)  # little padding per batch
        start = 0
        while start < len(items):
            longest = len(items[start][0].seqs[items[start][1]])
            end = min(len(items), start + max(1, self.max_batch_tokens // longest))
            batch = items[start:end]
            began = time.monotonic()
            vectors = self._forward([j.seqs[i] for j, i in batch],
                                    [j.types[i] if j.types is not None else None for j, i in batch])
            done = time.monotonic()
            if self.observer is not None:
                self.observer.forwarded(done - began)
            for (j, i), vec in zip(batch, vectors):
                j.outputs[i] = vec
                j.left -= 1
                if j.left == 0:
                    j.future.set_result(j.outputs)
                    if self.observer is not None:
                        self.observer.finished(len(j.seqs), sum(map(len, j.seqs)), done - j.arrival)
            start = end

    def _forward(self, seqs: list[list[int]], types: list[list[int] | None]) -> list[list[float]]:
        device = self.model.device
        longest = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), longest), self.config.pad_token_id, dtype=torch.int64)
        mask = torch.zeros(len(seqs), longest, dtype=torch.bool)
        segments = torch.zeros(len(seqs), longest, dtype=torch.int64) if any(t for t in types) else None
        for row, (seq, seg) in enumerate(zip(seqs, types)):
            ids[row, :len(seq)] = torch.tensor(seq)
            mask[row, :len(seq)] = True
            if segments is not None and seg:
                segments[row, :len(seg)] = torch.tensor(seg)
        ids, mask = ids.to(device), mask.to(device)
        hidden = self.model.forward(ids, mask, None if segments is None else segments.to(device))  # [B, T, H]
        out = self.model.classify(hidden).float() if self.is_classifier else pool(hidden, mask, self.pooling)
        return out.tolist()


def calibration_batches(vocab_size: int, count: int = 16, tokens: int = 64, seed: int = 0) -> list[torch.Tensor]:
    """Inputs that int8 smoothing observes activation maxima on: seeded random token ids. The outlier channels
    smoothing exists for belong to the model, not the text: on all-MiniLM-L6-v2, embeddings smoothed from these
    and from real sentences came out equally close to fp32's."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (count, tokens), generator=gen)]


def _checkpoint_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.replace("torch.", ""), torch.float32)
    # fp16 matmuls are slow on CPU; encoders are small, so keep them in fp32 rather than round to bf16.
    return torch.float32 if dtype == torch.float16 else dtype

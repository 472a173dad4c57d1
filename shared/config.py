"""Typed, frozen configuration for the runtime, one dataclass per domain.

Every field has a default and a docstring-like comment; CLI flags in
`pdserve.cli` default to these values. Validation raises ValueError with a
message a user can act on.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DTYPES = ("auto", "bfloat16", "float16", "float32")
# config.json model types served by the encoder runtime (embeddings, cross-encoders), not the paged decoder.
ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta")


class Role(str, enum.Enum):
    """What a runtime process does: both halves of serving, or one of them."""

    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"


# Decoder architectures the paged runtime serves: config.json "architectures" entry -> its model_type.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    # Sequence classifiers (reward models): the same decoder, a `score` head on the last token's hidden state.
    "LlamaForSequenceClassification": "llama",
    "Qwen2ForSequenceClassification": "qwen2",
    "Qwen3ForSequenceClassification": "qwen3",
    # Bare decoders, saved without any head (embedding checkpoints): served only for their embeddings.
    "LlamaModel": "llama",
    "Qwen2Model": "qwen2",
    "Qwen3Model": "qwen3",
}


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a Mixture-of-Experts decoder."""

    num_experts: int
    top_k: int  # experts each token is routed to
    intermediate_size: int  # of one routed expert
    # Renormalise the top-k routing weights to sum to one (Mixtral always; Qwen MoE per checkpoint).
    norm_topk_prob: bool
    # Qwen2-MoE's always-on expert, scaled by a sigmoid gate; 0 where the model has none.
    shared_expert_intermediate_size: int
    sparse_layers: tuple[int, ...]  # layers whose MLP is the expert block; the others are dense

    @classmethod
    def from_raw(cls, raw: dict[str, Any], model_type: str, num_layers: int) -> MoeConfig:
        if model_type == "mixtral":
            num_experts, inter, norm = raw["num_local_experts"], raw["intermediate_size"], True
            sparse = tuple(range(num_layers))
        else:
            # transformers 5 saves Qwen3-MoE's expert count as num_local_experts; older files say num_experts.
            num_experts = raw.get("num_experts") or raw["num_local_experts"]
            inter, norm = raw["moe_intermediate_size"], bool(raw.get("norm_topk_prob", False))
            step, dense = raw.get("decoder_sparse_step", 1) or 1, set(raw.get("mlp_only_layers") or ())
            sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        top_k = raw["num_experts_per_tok"]
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in 1..{num_experts} (the number of experts)")
        shared = raw.get("shared_expert_intermediate_size", 0) if model_type == "qwen2_moe" else 0
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=inter, norm_topk_prob=norm,
                   shared_expert_intermediate_size=shared or 0, sparse_layers=sparse)


@dataclass(frozen=True)
class ModelConfig:
    """The decoder architecture, read from an HF config.json."""

    path: str
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # one of SUPPORTED_ARCHITECTURES' values
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2 has a bias on q, k and v
    torch_dtype: str  # dtype the checkpoint was saved in
    eos_token_ids: tuple[int, ...]
    qk_norm: bool = False  # Qwen3: RMSNorm over each q and k head before rotary
    moe: MoeConfig | None = None  # the expert block of a Mixture-of-Experts model
    num_labels: int = 0  # a sequence classifier's outputs; 0 for a language model

    @property
    def is_classifier(self) -> bool:
        return self.num_labels > 0

    @property
    def is_bare(self) -> bool:
        """A decoder without a head: its hidden states are all it gives (an embedding model)."""
        return not self.architecture.endswith(("ForCausalLM", "ForSequenceClassification"))

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        raw = json.loads((path / "config.json").read_text())
        archs = raw.get("architectures")
        if archs:
            architecture = archs[0]
        else:  # an old config.json without "architectures": its model_type names the family
            by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
            architecture = by_type.get(raw.get("model_type", "llama"), str(raw.get("model_type")))
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {architecture!r} in {path}/config.json "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        model_type = SUPPORTED_ARCHITECTURES[architecture]
        num_heads = raw["num_attention_heads"]
        head_dim = raw.get("head_dim") or raw["hidden_size"] // num_heads
        # transformers 5 keeps rope settings under rope_parameters; older files use rope_theta/rope_scaling.
        rope = raw.get("rope_parameters") or {}
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        rope_scaling = raw.get("rope_scaling")
        if rope.get("rope_type", "default") != "default":
            rope_scaling = dict(rope)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gen_path = path / "generation_config.json"
        if gen_path.exists():
            geos = json.loads(gen_path.read_text()).get("eos_token_id")
            if geos is not None:
                eos_ids = tuple(dict.fromkeys(eos_ids + (tuple(geos) if isinstance(geos, list) else (geos,))))
        return cls(
            path=str(path),
            architecture=architecture,
            model_type=model_type,
            num_layers=raw["num_hidden_layers"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has a bias on q, k and v; Qwen2-MoE says so in qkv_bias; others in attention_bias.
            attention_bias=(model_type == "qwen2" or bool(raw.get("attention_bias", False))
                            or (model_type == "qwen2_moe" and bool(raw.get("qkv_bias", True)))),
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            eos_token_ids=eos_ids,
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            moe=(MoeConfig.from_raw(raw, model_type, raw["num_hidden_layers"])
                 if model_type in ("qwen2_moe", "qwen3_moe", "mixtral") else None),
            num_labels=(len(raw.get("id2label") or {}) or int(raw.get("num_labels", 2))
                        if architecture.endswith("ForSequenceClassification") else 0),
        )

    def identity(self) -> str:
        """A short fingerprint of everything that shapes the KV cache and logits."""
        keys = (self.architecture, self.num_layers, self.hidden_size, self.num_heads, self.num_kv_heads,
                self.head_dim, self.vocab_size, self.rope_theta)
        if self.moe is not None:  # a dense model's fingerprint stays what it was
            keys += (self.moe.num_experts, self.moe.top_k)
        return f"{self.architecture}-{hashlib.sha1(repr(keys).encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool."""

    page_size: int = 16  # tokens per page
    max_total_tokens: int = 65536  # pool capacity in tokens (rounded down to whole pages)
    mem_fraction: float | None = None  # if set: size the pool to this fraction of the memory free after loading

    def __post_init__(self) -> None:
        if self.mem_fraction is not None and not 0 < self.mem_fraction < 1:
            raise ValueError(f"--mem-fraction must be in (0, 1), got {self.mem_fraction}")
        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_total_tokens < self.page_size:
            raise ValueError(f"--max-total-tokens ({self.max_total_tokens}) must hold at least one page of {self.page_size}")

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits and policy."""

    max_running_requests: int = 64
    max_prefill_tokens: int = 8192  # new tokens per prefill batch
    chunked_prefill_size: int = 2048  # longest chunk of one prompt per step; <= 0 disables chunking
    policy: str = "fcfs"  # "fcfs" | "lpm" (longest prefix match first)
    # Colocated: a step that prefills new prompts also decodes the running requests, so arrivals do not stall
    # them (SGLang's --enable-mixed-chunk). Off by default: it lowers TTFT but measured 2-3 % less throughput.
    mixed_prefill: bool = False
    # Decode role: a prompt whose uncached rest is at most this many tokens is computed on the decode worker after
    # the prefix its cache holds (a conversation's next turn: the earlier turns' prompt and output are there),
    # instead of by a prefill worker, which would compute the earlier output again and send the whole KV. 0: never.
    local_prefill_max_tokens: int = 128

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"--schedule-policy must be fcfs or lpm, got {self.policy!r}")
        if self.max_running_requests < 1:
            raise ValueError(f"--max-running-requests must be >= 1, got {self.max_running_requests}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"--max-prefill-tokens must be >= 1, got {self.max_prefill_tokens}")


WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
# The tiers of cached KV that /flush_cache may name (`?tiers=`): the pool's prefix cache, the host-memory tier and
# the storage tier.
CACHE_TIERS = ("device", "host", "storage")


@dataclass(frozen=True)
class TierConfig:
    """KV tiers under the radix cache (--enable-hierarchical-cache): host memory, a storage tier in a directory,
    or both (host above storage)."""

    storage_dir: str | None = None  # None: no storage tier
    # write_through: a page goes to storage once cached; write_through_selective: once a second request reads it
    # from the pool; write_back: when the pool evicts it.
    write_policy: str = "write_through"
    # How long a request whose prefix is stored waits for its pages: best_effort (what has been read by the
    # deadline, the rest computed), timeout (all of it by the deadline, or none), wait_complete (all of it).
    prefetch_policy: str = "best_effort"
    prefetch_timeout_s: float = 2.0
    # The host tier's size: `host_ratio` times the pool's pages, or `host_gb` GB when given; neither: no host tier.
    host_ratio: float | None = None
    host_gb: float | None = None
    # The storage directory's bounds (kv_file_capacity.py; 0: none) and who shares its files (kv_file_access.py).
    storage_max_bytes: int = 0
    storage_min_free_bytes: int = 0
    storage_eviction_ratio: float = 0.9
    storage_group_access: bool = False

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"--hicache-write-policy must be one of {', '.join(WRITE_POLICIES)}, "
                             f"got {self.write_policy!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"--hicache-storage-prefetch-policy must be one of {', '.join(PREFETCH_POLICIES)}, "
                             f"got {self.prefetch_policy!r}")
        if not 0 < self.storage_eviction_ratio <= 1:
            raise ValueError(f"--hicache-storage-eviction-ratio must be in (0, 1], got {self.storage_eviction_ratio}")
        if self.storage_max_bytes < 0 or self.storage_min_free_bytes < 0:
            raise ValueError("--hicache-storage-max-size and --hicache-storage-min-free-space must be >= 0")
        if not self.prefetch_timeout_s > 0:
            raise ValueError(f"--hicache-storage-prefetch-timeout must be > 0, got {self.prefetch_timeout_s}")
        if self.host_ratio is not None and not self.host_ratio >= 1:
            # a host tier smaller than the pool could not take one eviction of the pool's size whole
            raise ValueError(f"--hicache-ratio must be >= 1 (the host tier is at least the pool's size), "
                             f"got {self.host_ratio:g}")
        if self.host_gb is not None and not self.host_gb > 0:
            raise ValueError(f"--hicache-size must be > 0 GB, got {self.host_gb:g}")
        if self.storage_dir is None and self.host_ratio is None and self.host_gb is None:
            raise ValueError("--enable-hierarchical-cache needs a tier: --hicache-storage-backend file with "
                             "--hicache-storage-dir, or (on a GPU) --hicache-ratio / --hicache-size")


@dataclass(frozen=True)
class LoraConfig:
    """Multi-LoRA serving (--enable-lora): adapters over the base model, mixed in one batch."""

    paths: tuple[tuple[str, str], ...] = ()  # (name, PEFT directory) of the adapters loaded at start-up
    max_loras_per_batch: int = 8  # adapter slots: the distinct adapters one batch may mix
    max_rank: int | None = None  # largest rank a slot holds (default: the start-up adapters' largest, else 16)
    # Modules adapters may change (default: those the start-up adapters change, else all seven).
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_loras_per_batch < 1:
            raise ValueError(f"--max-loras-per-batch must be >= 1, got {self.max_loras_per_batch}")
        if self.max_rank is not None and self.max_rank < 1:
            raise ValueError(f"--max-lora-rank must be >= 1, got {self.max_rank}")
        names = [name for name, _ in self.paths]
        for name in names:
            if not name or ":" in name or "/" in name:
                raise ValueError(f"--lora-paths: adapter name {name!r} must be non-empty, without ':' or '/'")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"--lora-paths names {', '.join(duplicates)} more than once")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (--speculative-algorithm ngram): drafts from n-grams of a request's own prompt and
    output, verified several at a time by one forward of the model (shared/speculative.py)."""

    num_draft_tokens: int = 6  # the most draft tokens one request verifies in one step
    min_match: int = 2  # shortest suffix of the sequence matched against its earlier tokens
    max_match: int = 8  # longest suffix compared; the longest match wins, the latest among equals

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"--speculative-num-draft-tokens must be >= 1, got {self.num_draft_tokens}")
        if not 1 <= self.min_match <= self.max_match:
            raise ValueError("--speculative-ngram-min-match-window-size must be >= 1 and at most "
                             f"--speculative-ngram-max-match-window-size, got {self.min_match} and {self.max_match}")


@dataclass(frozen=True)
class RuntimeConfig:
    """Everything a runtime process needs to load a model and serve it."""

    model_path: str
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32
    device: str = "cpu"
    # The kernel set every layer runs on (`--kernels`, alias `--attention-backend`): auto | native | torch | triton
    # (auto: triton on CUDA, native on CPU).
    kernels: str = "auto"
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    # Same prompt, same greedy tokens, bit for bit, whatever else is batched, cached or chunked with it.
    deterministic: bool = False
    lora: LoraConfig | None = None  # None: LoRA disabled (no slots allocated, adapter requests refused)
    # --is-embedding on a decoder: the model's last hidden state is the output (pooled by the caller), no LM head.
    is_embedding: bool = False
    # Decode steps on static buffers bucketed by batch size (shared/decode_graphs.py): "auto" captures them as
    # CUDA graphs on a GPU and is off on the CPU; "static" runs the same padded path without capture (the CPU mode
    # it is tested in); "off" (--disable-cuda-graph) runs every step as it comes.
    decode_graphs: str = "auto"
    cuda_graph_max_bs: int = 256  # the largest bucket; larger decode batches run without a graph
    cuda_graph_bs: tuple[int, ...] = ()  # the buckets themselves (default: shared/decode_graphs.bucket_sizes)
    speculative: SpeculativeConfig | None = None  # None: one token per request and step
    # Overlapped decode steps (shared/overlap.py): step i+1 is scheduled and launched before step i's tokens are
    # read. "auto": on a GPU, where the device computes while the host schedules; off on the CPU, which computes
    # the step itself, so reading late would only delay each token. "on" runs it anywhere (the CPU mode it is
    # tested in); "off" is --disable-overlap-schedule. Speculative decoding reads its tokens at once: off there.
    overlap_schedule: str = "auto"
    # None | "w8a8_int8": the dense layers' matmuls in int8 (shared/int8_linear.py) | "gguf": over a GGUF file's own
    # quantized blocks (shared/gguf_linear.py)
    quantization: str | None = None
    tiers: TierConfig | None = None  # None: the KV cache lives in the pool only

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantization not in (None, "w8a8_int8", "gguf"):
            raise ValueError(f"quantization must be w8a8_int8, gguf or None, got {self.quantization!r}")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, got {self.overlap_schedule!r}")
        if self.decode_graphs not in ("auto", "static", "off"):
            raise ValueError(f"decode_graphs must be auto, static or off, got {self.decode_graphs!r}")
        if self.kernels not in ("auto", "native", "torch", "triton"):
            raise ValueError("--kernels (--attention-backend) must be auto, native, torch or triton, "
                             f"got {self.kernels!r}")
        if self.tiers is not None and self.is_embedding:
            raise ValueError("--enable-hierarchical-cache does not apply to an embedding worker: it keeps no KV "
                             "cache between requests")
        if self.deterministic and (self.device.startswith("cuda") or self.kernels in ("torch", "triton")):
            raise ValueError("--enable-deterministic-inference needs the CPU's native kernels "
                             "(--device cpu, --kernels auto or native)")

"""Llama-family decoder (Llama 2/3, SmolLM2, Qwen2, Qwen3 and their MoE variants, Mixtral) over the paged KV pool.

One class covers every architecture: Qwen2 is Llama with a bias on the q, k and v
projections, Qwen3 normalises each q and k head before rotary, and the MoE models swap
some layers' MLP for an expert block (moe.py). Weights are fused at load time (q|k|v into
one matrix, gate|up into another) so a dense layer is four matmuls, each a `Linear`
prepared for the device.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from pdserve.kernels.rotary import build_cos_sin_cache, cos_sin_rows
from pdserve.shared.config import ModelConfig
from pdserve.shared.kernel_ops import KernelOps
from pdserve.shared.kv_pool import KVPool
from pdserve.shared.gguf_linear import GGUFLinear
from pdserve.shared.gguf_weights import TIED_HEAD, BlockWeight, gguf_blocks
from pdserve.shared.int8_linear import Int8Linear
from pdserve.shared.linear import Linear
from pdserve.shared.lora import LoraPool
from pdserve.shared.models.moe import DenseMLP, RouteHook, SparseMoE, load_sparse_moe
from pdserve.shared.tp_shards import Shards


@dataclass
class ForwardBatch:
    """The flattened inputs of one forward step over B sequences and T new tokens."""

    is_decode: bool
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slots: torch.Tensor  # [T] int64, page * page_size + offset of each new token's KV
    page_table: torch.Tensor  # [B, max_pages] int32
    seq_lens: torch.Tensor  # [B] int32, tokens in cache after this step
    extend_lens: torch.Tensor  # [B] int32, new tokens per sequence
    q_start: torch.Tensor  # [B] int32, first row of each sequence in the T rows
    last_rows: torch.Tensor  # [B] int64, row whose logits each sequence needs
    lora_slots: torch.Tensor | None = None  # [T] int32, each row's LoRA slot (-1: base model); None: no adapter


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [H]
    qkv: Linear  # [(Hq + 2 Hk) * D, H], with Qwen2's bias
    o: Linear  # [H, Hq * D]
    post_norm: torch.Tensor  # [H]
    mlp: DenseMLP | SparseMoE
    q_norm: torch.Tensor | None = None  # [D], Qwen3's per-head RMSNorm weights
    k_norm: torch.Tensor | None = None

    def linears(self) -> list[Linear]:
        return [self.qkv, self.o] + self.mlp.linears()


class LlamaForCausalLM:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device | str, max_positions: int,
                 batch_invariant: bool = False, hidden_output: bool = False, quantization: str | None = None,
                 shards: Shards | None = None, group=None) -> None:
        """`batch_invariant`: every row's result independent of the rows computed with it (deterministic mode).
        `hidden_output`: an embedding model: forward returns the final hidden states, and no LM head is loaded.
        `quantization` "w8a8_int8": the attention, dense MLP and LM head matmuls in int8 (Int8Linear, whose rows
        are independent of each other, so it is batch-invariant too); a classifier's score head, MoE routers and
        experts stay in `dtype`.
        `shards` and `group`: one rank of a tensor-parallel model (shared/tp_shards.py, shared/tp_group.py): it
        loads its shards, and each attention and MLP block ends in one all-reduce over the group."""
        self.config = config
        self.shards = shards if shards is not None and shards.size > 1 else None
        self.group = group if self.shards is not None else None
        # The heads this rank computes (all of them without tensor parallelism).
        self.num_heads = self.shards.num_heads if self.shards else config.num_heads
        self.num_kv_heads = self.shards.num_kv_heads if self.shards else config.num_kv_heads
        self.quantization = quantization
        self.batch_invariant = batch_invariant
        self.hidden_output = hidden_output
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers: list[LayerWeights] = []
        self.embed: torch.Tensor | None = None
        self.norm: torch.Tensor | None = None
        self.lm_head: Linear | None = None
        self.cos_sin = build_cos_sin_cache(config.head_dim, max_positions, config.rope_theta,
                                           config.rope_scaling, self.device)  # [max_pos, D] fp32
        self.scale = config.head_dim ** -0.5
        self.lora: LoraPool | None = None  # the adapter slots a batch's rows may name (ForwardBatch.lora_slots)
        self.checkpoint_shapes: dict[str, tuple[int, ...]] = {}  # of the tensors the weights were loaded from

    # ---------------------------------------------------------------- loading
    def load(self, model_dir: str | Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
        """Load the checkpoint in `model_dir`, or `tensors` already read from it (a live update checks them first).

        Records in `checkpoint_shapes` the name and shape of every tensor taken: a checkpoint that is to replace
        these weights must hold the same (shared/weights.py)."""
        if tensors is None:
            tensors = _read_safetensors(Path(model_dir))
        cfg = self.config
        if self.quantization == "gguf":  # the matrices as the GGUF file stores them (shared/gguf_weights.py)
            tensors = gguf_blocks(tensors, Path(model_dir), cfg)
        self.checkpoint_shapes = {}
        if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
            # A bare decoder (saved from e.g. Qwen2Model, as embedding checkpoints often are): no "model." prefix.
            tensors = {f"model.{name}": t for name, t in tensors.items()}

        def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
            return Linear(weight, bias, batch_invariant=self.batch_invariant)

        def dense(weight: torch.Tensor | BlockWeight, bias: torch.Tensor | None = None,
                  fp32_output: bool = False) -> Linear | Int8Linear | GGUFLinear:
            """An attention, MLP or LM head matmul, in int8 when the model is quantized, over a GGUF's blocks."""
            if isinstance(weight, BlockWeight):
                return GGUFLinear(weight, bias, self.dtype, fp32_output, self.batch_invariant)
            if self.quantization == "w8a8_int8":
                return Int8Linear(weight, bias, fp32_output=fp32_output)
            return Linear(weight, bias, batch_invariant=self.batch_invariant, fp32_output=fp32_output)

        sh = self.shards
        D = cfg.head_dim

        def take(name: str, cut=None) -> torch.Tensor:
            """The tensor `name`, cut to this rank's shard by `cut` (when tensor-parallel) before it is converted."""
            if name not in tensors:
                raise ValueError(f"weight {name!r} missing from {model_dir}")
            tensor = tensors.pop(name)
            self.checkpoint_shapes[name] = tuple(tensor.shape)
            if sh is not None and cut is not None:
                tensor = cut(tensor)
            return tensor.to(device=self.device, dtype=self.dtype)

        def qkv(names: list[str]) -> torch.Tensor:
            parts = [take(name) for name in names]
            return sh.qkv_rows(*parts, D) if sh is not None else torch.cat(parts)

        def columns(span):  # column-parallel: this rank's output rows
            return lambda w: Shards.rows(w, span)

        def row_parallel(span):  # row-parallel: this rank's input columns
            return lambda w: Shards.rows(w, span, dim=1)

        sparse = set(cfg.moe.sparse_layers) if cfg.moe is not None else set()
        vocab = (lambda w: sh.vocab_rows(w)) if sh is not None else None
        self.embed = take("model.embed_tokens.weight", vocab)
        inter = sh.intermediate if sh is not None else (0, cfg.intermediate_size)
        # Deterministic mode splits a row-parallel layer's sums but rounds them once: each rank's partial stays in
        # fp32 until the all-reduce has added them (on the fixed-order kernel the layers run on there anyway).
        partial32 = sh is not None and self.batch_invariant
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_bias = None
            if cfg.attention_bias:
                qkv_bias = qkv([p + f"self_attn.{x}_proj.bias" for x in "qkv"])
            if i in sparse:
                mlp = load_sparse_moe(i, p, cfg.moe, cfg.hidden_size, take, tensors.__contains__, linear, sh)
            else:
                mlp = DenseMLP(dense(torch.cat([take(p + "mlp.gate_proj.weight", columns(inter)),
                                                take(p + "mlp.up_proj.weight", columns(inter))])),
                               dense(take(p + "mlp.down_proj.weight", row_parallel(inter)), fp32_output=partial32))
            self.layers.append(LayerWeights(
                input_norm=take(p + "input_layernorm.weight"),
                qkv=dense(qkv([p + f"self_attn.{x}_proj.weight" for x in "qkv"]), qkv_bias),
                o=dense(take(p + "self_attn.o_proj.weight", (lambda w: sh.o_columns(w, D)) if sh else None),
                        fp32_output=partial32),
                post_norm=take(p + "post_attention_layernorm.weight"),
                mlp=mlp,
                q_norm=take(p + "self_attn.q_norm.weight") if cfg.qk_norm else None,
                k_norm=take(p + "self_attn.k_norm.weight") if cfg.qk_norm else None,
            ))
        self.norm = take("model.norm.weight")
        if cfg.is_classifier:  # a reward model or classifier: its score head reads the last hidden state
            self.lm_head = linear(take("score.weight"))
        elif self.hidden_output:  # the caller pools the hidden state itself
            self.lm_head = None
        elif cfg.tie_word_embeddings or "lm_head.weight" not in tensors:
            # Tied: the embedding stays plain for lookups; on CPU the head gets its own packed (or int8) copy.
            head = take(TIED_HEAD, vocab) if TIED_HEAD in tensors else self.embed  # a GGUF's: its own blocks
            self.lm_head = dense(head, fp32_output=True)
        else:
            self.lm_head = dense(take("lm_head.weight", vocab), fp32_output=True)

    def take_weights(self, other: LlamaForCausalLM) -> None:
        """Serve `other`'s weights from the next forward on; `other` has this model's config and was loaded from
        another checkpoint. Call between two forwards.

        Tensors and `Linear`s are taken whole rather than copied into: a Linear's packed oneDNN weight and GEMV
        copy were made from its new weight by its own constructor, so they cannot disagree with it, and nothing
        keeps a reference to the old ones (every forward reads them from here). What belongs to this model rather
        than to a checkpoint stays: LoRA slots, the rotary table, the expert-routing hooks."""
        for old, new in zip(self.layers, other.layers):
            if isinstance(old.mlp, SparseMoE) and isinstance(new.mlp, SparseMoE):
                new.mlp.on_route = old.mlp.on_route
        self.embed, self.norm, self.lm_head, self.layers = other.embed, other.norm, other.lm_head, other.layers
        self.checkpoint_shapes = other.checkpoint_shapes

    def set_route_hook(self, hook: RouteHook | None) -> None:
        """Hand every expert block's routing choice to `hook(layer_id, topk_ids)` (None: stop); dense models
        have no expert blocks and ignore it."""
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.on_route = hook

    # ---------------------------------------------------------------- forward
    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pool: KVPool, ops: KernelOps) -> torch.Tensor:
        """Run the new tokens through the model; return the logits [B, V] of each sequence's last row, in fp32:
        the LM head sums in fp32 and keeps its sums, so sampling and logprobs never see logits rounded to bf16
        (at logits of 16-32 one bf16 step is 0.125, enough to flip a near tie). A classifier's scores or an
        embedding model's hidden states stay in the model's dtype."""
        cfg = self.config
        q_size = self.num_heads * cfg.head_dim
        hidden = self._embed(batch.input_ids)  # [T, H]
        residual = None
        # What every layer of the step shares is computed once: rotary rows, and the decode attention plan.
        cos_sin = cos_sin_rows(self.cos_sin, batch.positions)  # [T, D]
        plan = ops.plan_decode(batch.page_table, batch.seq_lens, pool.page_size) if batch.is_decode else None
        for i, layer in enumerate(self.layers):
            if residual is None:
                residual = hidden
                x = ops.rmsnorm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.rmsnorm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
            qkv = self._project(i, "qkv", layer.qkv, x, batch, ops)  # [T, (Hq + 2 Hk) * D]
            if layer.q_norm is not None:
                self._norm_qk_heads(qkv, layer, ops)
            k_cache, v_cache = pool.k_cache(i), pool.v_cache(i)
            q = ops.rotary_store_kv(qkv, cos_sin, k_cache, v_cache, batch.slots, self.num_heads,
                                    self.num_kv_heads)  # [T, Hq, D]; k and v are in the cache now
            if batch.is_decode:
                attn = ops.decode_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens, self.scale, plan)
            else:
                attn = ops.extend_attention(q, k_cache, v_cache, batch.page_table, batch.seq_lens,
                                            batch.extend_lens, batch.q_start, self.scale)
            hidden = self._reduce(self._project(i, "o", layer.o, attn.reshape(-1, q_size), batch, ops))  # [T, H]
            x, residual = ops.rmsnorm(hidden, layer.post_norm, cfg.rms_norm_eps, residual)
            if batch.lora_slots is not None and isinstance(layer.mlp, DenseMLP):
                gate_up = self._project(i, "gate_up", layer.mlp.gate_up, x, batch, ops)  # [T, 2 I]
                hidden = self._project(i, "down", layer.mlp.down, ops.silu_and_mul(gate_up), batch, ops)
            else:
                hidden = layer.mlp(x, ops)
            hidden = self._reduce(hidden)
        last = (hidden + residual).index_select(0, batch.last_rows)  # [B, H]
        last = ops.rmsnorm(last, self.norm, cfg.rms_norm_eps)
        if self.lm_head is None:
            return last  # an embedding model's [B, H]
        logits = self.lm_head(last)  # [B, V] logits, or a classifier's [B, labels]
        if self.shards is not None and not cfg.is_classifier:  # each rank holds a slice of the vocabulary
            logits = self.group.all_gather_columns(logits)[:, :self.shards.vocab_size]
        return logits

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shards is None:
            return F.embedding(ids, self.embed)
        local = ids - self.shards.vocab[0]  # this rank's rows; the others' ids give zeros, summed over ranks
        outside = (local < 0) | (local >= self.embed.shape[0])
        hidden = F.embedding(local.masked_fill(outside, 0), self.embed)
        return self.group.all_reduce(hidden.masked_fill_(outside[:, None], 0))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """A row-parallel block's output: the sum of every rank's partial."""
        return partial if self.group is None else self.group.all_reduce(partial).to(self.dtype)

    def _project(self, i: int, name: str, linear: Linear, x: torch.Tensor, batch: ForwardBatch,
                 ops: KernelOps) -> torch.Tensor:
        """Layer i's fused linear `name`, plus each row's LoRA delta when the batch has adapter rows."""
        y = linear(x)
        if batch.lora_slots is None or self.lora is None:
            return y
        slots = self.lora.layer(i, name)
        if slots is not None:
            ops.lora_apply(y, x, slots.lora_a, slots.lora_b, slots.out_offsets, batch.lora_slots, self.lora.ranks)
        return y

    def _norm_qk_heads(self, qkv: torch.Tensor, layer: LayerWeights, ops: KernelOps) -> None:
        """Qwen3: RMSNorm over every q and k head of the fused projection, in place, before rotary."""
        cfg = self.config
        T, D = qkv.shape[0], cfg.head_dim
        q_end, k_end = self.num_heads * D, (self.num_heads + self.num_kv_heads) * D
        for lo, hi, weight in ((0, q_end, layer.q_norm), (q_end, k_end, layer.k_norm)):
            heads = qkv[:, lo:hi].reshape(-1, D)  # [T * heads, D]
            qkv[:, lo:hi] = ops.rmsnorm(heads, weight, cfg.rms_norm_eps).view(T, hi - lo)


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ValueError(f"cannot read weights from {path}: {exc}") from None
    return tensors

"""BERT-family encoder (BERT, MiniLM, sentence-transformers checkpoints; RoBERTa and XLM-RoBERTa, as in the
bge-reranker cross-encoders) in plain torch.

Bidirectional attention over each whole input, so there is no KV cache: a batch is padded to its longest
sequence, padded keys are masked out, and the output is the last hidden state of every position [B, T, H].
What becomes of it (pooling, normalisation, a classifier head) is decided by `pdserve.shared.pooling`.
Checkpoints saved from `BertModel` name weights `embeddings.*`/`encoder.*`; from `Bert*For*` heads they carry
a `bert.` prefix (`roberta.` for the RoBERTa family), which is dropped on load.

The RoBERTa family differs in two places: positions are numbered from the padding id + 1, skipping
padding tokens (as transformers' `create_position_ids_from_input_ids`), so its `max_position_embeddings`
holds padding id + 1 more rows than it has usable positions; and its classification head is
`classifier.dense` (dense + tanh on the first token, the part BERT calls its pooler) then
`classifier.out_proj`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.shared.config import ENCODER_MODEL_TYPES
from pdserve.shared.int8_linear import AbsMaxObserver, Int8Linear
from pdserve.shared.linear import Bf16MatmulLinear, Linear
from pdserve.shared.models.llama import _read_safetensors


@dataclass(frozen=True)
class BertConfig:
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    vocab_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    num_labels: int  # classifier outputs (sequence classification checkpoints), else 0
    torch_dtype: str
    model_type: str = "bert"
    pad_token_id: int = 0

    @property
    def roberta_positions(self) -> bool:
        return self.model_type in ("roberta", "xlm-roberta")

    @property
    def max_tokens(self) -> int:
        """The longest input the position table covers."""
        if self.roberta_positions:
            return self.max_position_embeddings - self.pad_token_id - 1
        return self.max_position_embeddings

    @classmethod
    def from_dir(cls, path: str | Path) -> BertConfig:
        raw = json.loads((Path(path) / "config.json").read_text())
        if raw.get("model_type") not in ENCODER_MODEL_TYPES:
            raise ValueError(f"{path}/config.json: model_type {raw.get('model_type')!r} is not a BERT encoder")
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"position_embedding_type {raw['position_embedding_type']!r} is not supported")
        arch = (raw.get("architectures") or ["BertModel"])[0]
        labels = (len(raw.get("id2label") or {}) or raw.get("num_labels", 0)) if "ForSequence" in arch else 0
        return cls(architecture=arch, num_layers=raw["num_hidden_layers"], hidden_size=raw["hidden_size"],
                   intermediate_size=raw["intermediate_size"], num_heads=raw["num_attention_heads"],
                   vocab_size=raw["vocab_size"], max_position_embeddings=raw.get("max_position_embeddings", 512),
                   type_vocab_size=raw.get("type_vocab_size", 2), layer_norm_eps=raw.get("layer_norm_eps", 1e-12),
                   hidden_act=raw.get("hidden_act", "gelu"), num_labels=int(labels),
                   torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
                   model_type=raw["model_type"], pad_token_id=int(raw.get("pad_token_id") or 0))


@dataclass
class BertLayer:  # the four matmuls are Linear, Bf16MatmulLinear, or Int8Linear once quantized
    qkv: Linear  # [3H, H] with bias: query, key and value in one matmul
    o: Linear  # [H, H]
    attn_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias [H]
    up: Linear  # [I, H]
    down: Linear  # [H, I]
    out_norm: tuple[torch.Tensor, torch.Tensor]


_ACTIVATIONS = {"gelu": F.gelu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
# The same activations as oneDNN post-ops (pdserve.shared.linear.POST_OPS), fused into a bf16 up-projection.
_POST_OPS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "relu": "relu"}


class BertModel:
    def __init__(self, config: BertConfig, dtype: torch.dtype, device: torch.device | str,
                 bf16_matmuls: bool = False) -> None:
        """`bf16_matmuls`: an fp32 model's layers multiply in bf16 (pdserve.shared.linear.Bf16MatmulLinear)."""
        if bf16_matmuls and dtype != torch.float32:
            raise ValueError("bf16 matmuls are for an fp32 model")
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported")
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.head_dim = config.hidden_size // config.num_heads
        self.act = _ACTIVATIONS[config.hidden_act]
        self.linear = Bf16MatmulLinear if bf16_matmuls else Linear
        # A bf16 up-projection applies the activation itself (see Bf16MatmulLinear).
        self.fused_act = _POST_OPS[config.hidden_act] if bf16_matmuls else None
        self.layers: list[BertLayer] = []
        self.pooler: tuple[torch.Tensor, torch.Tensor] | None = None  # dense on the [CLS] row, then tanh
        self.classifier: tuple[torch.Tensor, torch.Tensor] | None = None  # [num_labels, H], [num_labels]

    def load(self, model_dir: str | Path) -> None:
        tensors = {k.removeprefix("bert.").removeprefix("roberta."): v
                   for k, v in _read_safetensors(Path(model_dir)).items()}

        def take(name: str) -> torch.Tensor:
            if name not in tensors:
                raise ValueError(f"weight {name!r} missing from {model_dir}")
            return tensors.pop(name).to(device=self.device, dtype=self.dtype)

        def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
            return take(prefix + ".weight"), take(prefix + ".bias")

        e = "embeddings."
        self.word = take(e + "word_embeddings.weight")  # [V, H]
        self.position = take(e + "position_embeddings.weight")  # [P, H]
        self.token_type = take(e + "token_type_embeddings.weight")  # [types, H]
        self.embed_norm = norm(e + "LayerNorm")
        for i in range(self.config.num_layers):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            linear = self.linear
            qkv = (torch.cat([take(a + f"self.{x}.weight") for x in ("query", "key", "value")]),
                   torch.cat([take(a + f"self.{x}.bias") for x in ("query", "key", "value")]))
            self.layers.append(BertLayer(
                # With bf16 matmuls, attention runs on bf16 q, k and v too (fp32 accumulation in its kernel):
                # the embeddings stay as close to fp32's, and the forward is 1.25x faster than with fp32 ones.
                qkv=Bf16MatmulLinear(*qkv, bf16_output=True) if self.linear is Bf16MatmulLinear else linear(*qkv),
                o=linear(take(a + "output.dense.weight"), take(a + "output.dense.bias")),
                attn_norm=norm(a + "output.LayerNorm"),
                up=self._up_projection(take(p + "intermediate.dense.weight"), take(p + "intermediate.dense.bias")),
                down=linear(take(p + "output.dense.weight"), take(p + "output.dense.bias")),
                out_norm=norm(p + "output.LayerNorm")))
        if "classifier.out_proj.weight" in tensors:  # RoBERTa's head: its dense layer is BERT's pooler
            self.pooler = (take("classifier.dense.weight"), take("classifier.dense.bias"))
            self.classifier = (take("classifier.out_proj.weight"), take("classifier.out_proj.bias"))
            return
        if "pooler.dense.weight" in tensors:
            self.pooler = (take("pooler.dense.weight"), take("pooler.dense.bias"))
        if self.config.num_labels:
            self.classifier = (take("classifier.weight"), take("classifier.bias"))

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states [B, T, H] of a padded batch; `mask` [B, T] is True on real tokens, and padding
        holds the config's pad_token_id."""
        cfg = self.config
        B, T = input_ids.shape
        if cfg.roberta_positions:
            real = (input_ids != cfg.pad_token_id).long()
            positions = torch.cumsum(real, dim=1) * real + cfg.pad_token_id  # [B, T]
        else:
            positions = torch.arange(T, device=self.device)
        types = self.token_type[0] if token_type_ids is None else F.embedding(token_type_ids, self.token_type)
        x = F.embedding(input_ids, self.word) + self.position[positions] + types  # [B, T, H]
        x = F.layer_norm(x, (cfg.hidden_size,), *self.embed_norm, cfg.layer_norm_eps)
        # Padded keys get no attention; padded query rows compute garbage that pooling ignores.
        attn_mask = mask[:, None, None, :]  # [B, 1, 1, T]
        x = x.reshape(B * T, cfg.hidden_size)  # the matmuls see one row per token
        for layer in self.layers:
            qkv = layer.qkv(x)  # [B T, 3H]
            q, k, v = qkv.view(B, T, 3, cfg.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # [B, heads, T, D]
            attn = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # [B, heads, T, D]
            attn = attn.transpose(1, 2).reshape(B * T, cfg.hidden_size)
            x = F.layer_norm(layer.o(attn, residual=x), (cfg.hidden_size,), *layer.attn_norm, cfg.layer_norm_eps)
            h = layer.up(x) if self.fused_act else self.act(layer.up(x))  # [B T, I]
            x = F.layer_norm(layer.down(h, residual=x), (cfg.hidden_size,), *layer.out_norm, cfg.layer_norm_eps)
        return x.view(B, T, cfg.hidden_size)

    def _up_projection(self, weight: torch.Tensor, bias: torch.Tensor):
        if self.fused_act:
            return Bf16MatmulLinear(weight, bias, activation=self.fused_act)
        return self.linear(weight, bias)

    def quantize_int8(self, calibration: list[torch.Tensor]) -> None:
        """Swap every layer's matmuls for w8a8 int8 ones (pdserve.shared.int8_linear), smoothed with the input
        maxima each sees while `calibration` batches ([B, T] token ids, no padding) run through the model as it
        is. The embeddings, the classifier head and every LayerNorm keep the model's dtype."""
        if self.dtype != torch.float32 or self.linear is not Linear:
            raise ValueError(f"w8a8_int8 quantizes an fp32 model, not {str(self.dtype).replace('torch.', '')}")
        names = ("qkv", "o", "up", "down")
        observers = [{name: AbsMaxObserver(getattr(layer, name)) for name in names} for layer in self.layers]
        for layer, seen in zip(self.layers, observers):
            for name, observer in seen.items():
                setattr(layer, name, observer)
        try:
            for ids in calibration:
                self.forward(ids.to(self.device), torch.ones(ids.shape, dtype=torch.bool, device=self.device))
        finally:
            for layer, seen in zip(self.layers, observers):
                for name, observer in seen.items():
                    setattr(layer, name, observer.linear)
        for layer, seen in zip(self.layers, observers):
            for name, observer in seen.items():
                linear = observer.linear
                setattr(layer, name, Int8Linear(linear.dense_weight(), linear.bias, observer.absmax, batched=True))

    def classify(self, hidden: torch.Tensor) -> torch.Tensor:
        """Classifier logits [B, num_labels] from the [CLS] row, as BERT sequence classification heads do."""
        if self.classifier is None or self.pooler is None:
            raise ValueError("this checkpoint has no classification head")
        pooled = torch.tanh(F.linear(hidden[:, 0], *self.pooler))  # [B, H]
        return F.linear(pooled, *self.classifier)

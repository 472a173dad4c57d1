"""A GGUF file's weight matrices as its own quantized blocks (`--quantization gguf`, vLLM's name).

A GGUF model is served through the HF directory it was converted into (shared/model_files.py): config and
tokenizer come from there. With `--quantization gguf` the weights come from the GGUF file itself: the norms and
the embedding table for lookups as its fp32 values, the attention and MLP matrices and the LM head as stored
(Q4_0, Q4_1 or Q8_0 blocks of 32 weights), multiplied without being widened in memory (shared/gguf_linear.py).

Invariant: a BlockWeight's rows are the HF checkpoint's rows in the HF order (llama.cpp's interleaving of the q
and k rows undone, as transformers undoes it), each row a whole number of blocks. It answers the few tensor
operations the loader applies to a weight (row slices, torch.cat of rows, column cuts at block boundaries for
tensor parallelism, `.to` on the CPU), so the loader cuts, fuses and shards it as it does a plain tensor.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pdserve.shared.config import ModelConfig

# ggml type id -> (name, weights per block, bytes per block): the types the native kernel multiplies.
BLOCK_TYPES = {2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 8: ("Q8_0", 32, 34)}
PLAIN_TYPES = {0, 1, 30}  # F32, F16, BF16: read from the converted directory like any plain weight
TIED_HEAD = "gguf.token_embd.blocks"  # a tied LM head: the embedding's blocks, read as stored
_LAYER = re.compile(r"blk\.(\d+)\.(attn_q|attn_k|attn_v|attn_output|ffn_gate|ffn_up|ffn_down)\.weight")
_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}


@dataclass(frozen=True)
class BlockWeight:
    qtype: int  # ggml's type id (BLOCK_TYPES)
    cols: int  # in_features
    data: torch.Tensor  # uint8 [rows, cols / 32 * block bytes]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.cols))

    @property
    def type_name(self) -> str:
        return BLOCK_TYPES[self.qtype][0]

    def _cols(self, start: int, length: int) -> BlockWeight:
        _, per_block, nbytes = BLOCK_TYPES[self.qtype]
        if start % per_block or length % per_block:
            raise ValueError(f"a {self.type_name} weight splits only at {per_block}-column block boundaries, "
                             f"not at columns {start}..{start + length}: use fewer tensor-parallel ranks")
        lo, n = start // per_block * nbytes, length // per_block * nbytes
        return BlockWeight(self.qtype, length, self.data[:, lo:lo + n])

    def narrow(self, dim: int, start: int, length: int) -> BlockWeight:
        if dim == 0:
            return BlockWeight(self.qtype, self.cols, self.data[start:start + length])
        return self._cols(start, length)

    def __getitem__(self, index) -> BlockWeight:
        rows, cols = (index, slice(None)) if not isinstance(index, tuple) else index
        part = BlockWeight(self.qtype, self.cols, self.data[rows])
        if cols == slice(None):
            return part
        start, stop, _ = cols.indices(self.cols)
        return part._cols(start, stop - start)

    def contiguous(self) -> BlockWeight:
        return BlockWeight(self.qtype, self.cols, self.data.contiguous())

    def to(self, device=None, dtype=None) -> BlockWeight:
        """The blocks stay as stored whatever the model's dtype; they live on the CPU, where their kernel runs."""
        if device is not None and torch.device(device).type != "cpu":
            raise ValueError("--quantization gguf runs on the CPU only")
        return self

    def new_zeros(self, rows: int, cols: int) -> BlockWeight:
        """Rows of zero weights (zero blocks: scale 0, offset 0), to pad a vocabulary shard."""
        return BlockWeight(self.qtype, cols, self.data.new_zeros(rows, self.data.shape[1] * cols // self.cols))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.cat and not (kwargs or {}).get("dim") and len(args) == 1:
            parts = list(args[0])
            if len({(p.qtype, p.cols) for p in parts}) == 1:
                return BlockWeight(parts[0].qtype, parts[0].cols, torch.cat([p.data for p in parts]))
        raise TypeError(f"{getattr(func, '__name__', func)} is not defined on GGUF blocks")

    def dequantize(self) -> torch.Tensor:
        """[rows, cols] fp32, by the gguf package's own reference: the oracle of the native kernel."""
        from gguf import GGMLQuantizationType, quants

        data = self.data.contiguous().numpy()
        return torch.from_numpy(np.ascontiguousarray(quants.dequantize(data, GGMLQuantizationType(self.qtype))))


def gguf_source(model_dir: Path) -> Path:
    """The GGUF file `model_dir` was converted from (its completion mark names it)."""
    mark = Path(model_dir) / ".complete"
    origin = Path(mark.read_text().strip()) if mark.exists() else None
    if origin is None or origin.suffix != ".gguf":
        raise ValueError(f"--quantization gguf serves a .gguf --model-path; {model_dir} was not converted from one")
    if not origin.is_file():
        raise ValueError(f"--quantization gguf: {origin}, the file {model_dir} was converted from, is gone")
    return origin


def _unpermute(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers' _reverse_permute_weights)."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def gguf_blocks(tensors: dict[str, torch.Tensor], model_dir: Path, config: ModelConfig) -> dict:
    """`tensors` (read from the converted directory) with every attention and MLP matrix and the LM head
    replaced by its blocks in the GGUF file; the head of a tied model under TIED_HEAD. Raises ValueError for
    what the kernel cannot multiply, naming it."""
    from gguf import GGUFReader

    if config.moe is not None:
        raise ValueError("--quantization gguf serves dense models; the experts of a mixture-of-experts model are "
                         "not supported (serve it without --quantization)")
    path = gguf_source(model_dir)
    out = dict(tensors)
    for t in GGUFReader(path).tensors:
        norm = re.fullmatch(r"blk\.(\d+)\.(attn_norm|ffn_norm)\.weight", t.name)
        if norm or t.name == "output_norm.weight":  # fp32 in the file, rounded to bf16 in the converted checkpoint
            name = f"model.layers.{norm[1]}.{_NORMS[norm[2]]}.weight" if norm else "model.norm.weight"
            out[name] = torch.from_numpy(np.array(t.data, dtype=np.float32))
            continue
        match = _LAYER.fullmatch(t.name)
        if match:
            name = f"model.layers.{match[1]}.{_HF[match[2]]}.weight"
        elif t.name in ("output.weight", "token_embd.weight"):
            name = "lm_head.weight" if t.name == "output.weight" else TIED_HEAD
        else:
            continue
        qtype = int(t.tensor_type)
        if qtype in PLAIN_TYPES:
            continue
        if qtype not in BLOCK_TYPES:
            raise ValueError(f"--quantization gguf: {t.name} is {t.tensor_type.name}, which is not supported "
                             f"(supported: {', '.join(n for n, _, _ in BLOCK_TYPES.values())}); serve "
                             f"{path.name} without --quantization to run it dequantized")
        data = torch.from_numpy(np.array(t.data, dtype=np.uint8))  # [rows, row bytes], a copy off the map
        weight = BlockWeight(qtype, int(t.shape[0]), data)
        if match and match[2] in ("attn_q", "attn_k"):
            heads = config.num_heads if match[2] == "attn_q" else config.num_kv_heads
            weight = BlockWeight(qtype, weight.cols, data[_unpermute(data.shape[0], heads)])
        expected = tensors.get(name if name != TIED_HEAD else "model.embed_tokens.weight")
        if expected is not None and tuple(expected.shape) != tuple(weight.shape):
            raise ValueError(f"--quantization gguf: {t.name} is {tuple(weight.shape)} in {path.name} but "
                             f"{tuple(expected.shape)} in its converted checkpoint")
        out[name] = weight
        if name == TIED_HEAD:  # the lookup table: the file's values, not their bf16 rounding
            out["model.embed_tokens.weight"] = weight.dequantize()
    return out

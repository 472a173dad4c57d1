"""Which part of a decoder one tensor-parallel rank holds, and the checks that say whether a model can be split.

- Attention by KV-head groups: each rank holds whole groups (a KV head and the query heads that read it), as
  evenly as the groups allow; where the groups do not divide by the ranks, the first ranks take one more (the
  default model's 3 groups over 2 ranks: 2 + 1). With fewer KV heads than ranks, each KV head is replicated on
  size / kv_heads ranks, which split its query heads (SGLang's rule; it needs both counts to divide).
- The MLP (and each expert's) by its intermediate size, column-parallel then row-parallel: as evenly as it goes.
- The embedding and LM head by vocabulary, in equal shards (the last one padded with zero rows, whose logits
  are cut off), so the logits gather in one round of equal parts.
Norms, the router of an expert block and a classifier's score head are replicated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.shared.config import ModelConfig


def even_split(n: int, size: int, rank: int) -> tuple[int, int]:
    """[lo, hi) of rank's share of n items over size ranks; the first n % size ranks take one more."""
    base, extra = divmod(n, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def check_tp_size(config: ModelConfig, size: int) -> None:
    """A ValueError naming the numbers when `config` cannot be split over `size` ranks."""
    heads, kv = config.num_heads, config.num_kv_heads
    if size < 1:
        raise ValueError(f"--tp-size must be at least 1, got {size}")
    if size == 1:
        return
    if kv < size and (size % kv or heads % size):
        raise ValueError(f"--tp-size {size} cannot split {config.architecture}'s {heads} query heads in {kv} KV-head "
                         f"groups: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and "
                         f"divide the query heads")
    if config.intermediate_size < size or (config.moe is not None and config.moe.intermediate_size < size):
        raise ValueError(f"--tp-size {size} exceeds the MLP's intermediate size")


@dataclass(frozen=True)
class Shards:
    """One rank's part of the model."""

    rank: int
    size: int
    heads: tuple[int, int]  # [lo, hi) of the query heads
    kv_heads: tuple[int, int]  # [lo, hi) of the KV heads
    intermediate: tuple[int, int]  # of the dense MLP
    expert_intermediate: tuple[int, int]  # of each routed expert, and of the shared expert's own
    shared_intermediate: tuple[int, int]
    vocab: tuple[int, int]  # [lo, hi) of the (padded) vocabulary
    vocab_size: int  # the model's, before padding

    @classmethod
    def plan(cls, config: ModelConfig, rank: int, size: int) -> Shards:
        check_tp_size(config, size)
        heads, kv = config.num_heads, config.num_kv_heads
        group = heads // kv
        if kv >= size:
            kv_lo, kv_hi = even_split(kv, size, rank)
            head_range = (kv_lo * group, kv_hi * group)
        else:
            per = heads // size
            head_range = (rank * per, (rank + 1) * per)
            kv_lo = head_range[0] // group
            kv_hi = kv_lo + 1
        shard = -(-config.vocab_size // size)
        moe = config.moe
        return cls(rank, size, head_range, (kv_lo, kv_hi),
                   even_split(config.intermediate_size, size, rank),
                   even_split(moe.intermediate_size, size, rank) if moe else (0, 0),
                   even_split(moe.shared_expert_intermediate_size, size, rank) if moe else (0, 0),
                   (rank * shard, (rank + 1) * shard), config.vocab_size)

    @property
    def num_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    # ---------------------------------------------------------------- slicing a checkpoint's tensors
    def qkv_rows(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int) -> torch.Tensor:
        """This rank's rows of the fused q|k|v projection (weights [out, in] or biases [out])."""
        (h0, h1), (k0, k1) = self.heads, self.kv_heads
        return torch.cat([q[h0 * head_dim:h1 * head_dim], k[k0 * head_dim:k1 * head_dim],
                          v[k0 * head_dim:k1 * head_dim]])

    def o_columns(self, o: torch.Tensor, head_dim: int) -> torch.Tensor:
        h0, h1 = self.heads
        return o[:, h0 * head_dim:h1 * head_dim].contiguous()

    @staticmethod
    def rows(w: torch.Tensor, span: tuple[int, int], dim: int = 0) -> torch.Tensor:
        return w.narrow(dim, span[0], span[1] - span[0]).contiguous()

    def vocab_rows(self, w: torch.Tensor) -> torch.Tensor:
        """This rank's rows of an embedding or LM head [V, H], zero rows past the vocabulary."""
        lo, hi = self.vocab
        part = w[lo:min(hi, self.vocab_size)]
        if part.shape[0] < hi - lo:
            part = torch.cat([part, part.new_zeros(hi - lo - part.shape[0], w.shape[1])])
        return part.contiguous()

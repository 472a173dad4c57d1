"""The MLP half of a decoder layer: dense SwiGLU, or a Mixture-of-Experts block (Qwen2-MoE, Qwen3-MoE, Mixtral).

An expert block routes each token to its top-k experts by the router's softmax, optionally renormalised over
the k chosen (`norm_topk_prob`; Mixtral always, which is the softmax over the top-k logits), runs the chosen
experts grouped by expert (kernels/fused_moe.py), and adds Qwen2-MoE's shared expert scaled by its sigmoid
gate. The shared gate is one more row of the router's matmul.

`on_route`, when set, sees every step's choice `(layer_id, topk_ids [T, k])` before the experts run: the hook
an expert-distribution recorder counts per layer and expert selections with.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.kernels.fused_moe import ExpertWeights
from pdserve.shared.config import MoeConfig
from pdserve.shared.kernel_ops import KernelOps
from pdserve.shared.linear import Linear

RouteHook = Callable[[int, torch.Tensor], None]


@dataclass
class DenseMLP:
    gate_up: Linear  # [2 I, H]
    down: Linear  # [H, I]

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        return self.down(ops.silu_and_mul(self.gate_up(x)))

    def linears(self) -> list[Linear]:
        return [self.gate_up, self.down]


@dataclass
class Routing:
    weights: torch.Tensor  # [T, k] fp32
    ids: torch.Tensor  # [T, k] int64


def select_experts(logits: torch.Tensor, top_k: int, renormalize: bool) -> Routing:
    """logits: [T, E]. The top-k experts of each token by softmax probability, in fp32 as transformers does."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(weights, ids)


@dataclass
class SparseMoE:
    layer_id: int
    config: MoeConfig
    router: Linear  # [E (+1 for the shared expert's gate), H]
    experts: ExpertWeights  # w13 [E, 2 I, H] (each expert's gate rows, then its up rows), w2 [E, H, I]
    shared: DenseMLP | None = None
    on_route: RouteHook | None = None

    def __call__(self, x: torch.Tensor, ops: KernelOps) -> torch.Tensor:
        E = self.config.num_experts
        logits = self.router(x)  # [T, E (+1)]
        routing = select_experts(logits[:, :E], self.config.top_k, self.config.norm_topk_prob)
        if self.on_route is not None:
            self.on_route(self.layer_id, routing.ids)
        out = ops.fused_moe(x, self.experts, routing.weights, routing.ids)  # [T, H]
        if self.shared is not None:
            out = out + torch.sigmoid(logits[:, E:]) * self.shared(x, ops)
        return out

    def linears(self) -> list[Linear]:
        return [self.router] + (self.shared.linears() if self.shared is not None else [])


# Checkpoint names of a layer's expert block: transformers' Qwen MoE names, then Mixtral's hub names.
_BLOCK_PREFIXES = ("mlp", "block_sparse_moe")
_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_sparse_moe(layer_id: int, prefix: str, config: MoeConfig, hidden_size: int,
                    take: Callable[[str], torch.Tensor], has: Callable[[str], bool],
                    linear: Callable[[torch.Tensor], Linear], shards=None) -> SparseMoE:
    """The expert block of layer `layer_id`, whose tensors are named `{prefix}{mlp|block_sparse_moe}.…`.
    `shards` (tensor parallelism): every expert, and the shared expert, keeps this rank's slice of its
    intermediate size (SGLang's TP split of experts: every rank computes every token's experts on its slice, and
    the block's output is a partial sum the model all-reduces); the router is replicated.

    Experts come per expert (`experts.{i}.gate_proj.weight`, or Mixtral's `w1`/`w3`/`w2`), as transformers
    writes and hub checkpoints hold them, or already stacked (`experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I], transformers' in-memory layout)."""
    block = next((prefix + b for b in _BLOCK_PREFIXES if has(f"{prefix}{b}.gate.weight")), prefix + "mlp")
    E, inter = config.num_experts, config.intermediate_size
    fused = f"{block}.experts.gate_up_proj"
    if has(fused):
        w13, w2 = take(fused), take(f"{block}.experts.down_proj")
    else:
        names = next((n for n in _EXPERT_NAMES if has(f"{block}.experts.0.{n[0]}.weight")), _EXPERT_NAMES[0])
        expert = [[take(f"{block}.experts.{e}.{n}.weight") for n in names] for e in range(E)]
        _expect_shape(f"{block}.experts.*.{names[0]}.weight", expert[0][0], (inter, hidden_size))
        w13 = torch.stack([torch.cat([gate, up]) for gate, up, _ in expert])
        w2 = torch.stack([down for _, _, down in expert])
    _expect_shape(fused, w13, (E, 2 * inter, hidden_size))
    _expect_shape(f"{block}.experts.down_proj", w2, (E, hidden_size, inter))
    if shards is not None:
        lo, hi = shards.expert_intermediate
        w13 = torch.cat([w13[:, lo:hi], w13[:, inter + lo:inter + hi]], dim=1)
        w2 = w2[:, :, lo:hi]
    router = take(f"{block}.gate.weight")
    _expect_shape(f"{block}.gate.weight", router, (E, hidden_size))
    shared = None
    if config.shared_expert_intermediate_size:
        p = f"{block}.shared_expert."
        span = shards.shared_intermediate if shards is not None else None
        rows = (lambda w: w[span[0]:span[1]]) if span else None
        cols = (lambda w: w[:, span[0]:span[1]]) if span else None
        shared = DenseMLP(linear(torch.cat([take(p + "gate_proj.weight", rows), take(p + "up_proj.weight", rows)])),
                          linear(take(p + "down_proj.weight", cols)))
        router = torch.cat([router, take(f"{block}.shared_expert_gate.weight")])  # [E + 1, H]
    experts = ExpertWeights(w13.contiguous(), w2.contiguous())
    if w13.device.type == "cpu":
        # Each expert's matmuls packed for oneDNN like the dense layers' (the bf16 GEMV reads the stacked
        # tensor itself, so bf16 keeps one plain copy): see kernels/fused_moe.py for what it buys.
        experts.gate_up = [linear(w) for w in experts.w13]
        experts.down = [linear(w) for w in experts.w2]
    return SparseMoE(layer_id, config, linear(router), experts, shared)


def _expect_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the config implies {shape}")

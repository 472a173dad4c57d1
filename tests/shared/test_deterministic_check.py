"""The start-time check of deterministic mode covers every reduction of the step: an op made to give a row other
bits in a bigger batch (as a kernel choosing its blocking by the row count would) is refused at start, and the
refusal names it: the fused residual norm, Qwen3's head norms, an expert block, the LoRA op, the sampler, the
tensor-parallel all-reduce; and a rank that fails the check makes every rank of its worker refuse.

A tiny Qwen3-MoE (q/k head norms, experts, one dense layer) in bf16 with LoRA slots carries every op at once.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.kernels import native
from pdserve.shared import sampler as sampler_module
from pdserve.shared.config import CacheConfig, LoraConfig, RuntimeConfig
from pdserve.shared.invariance import BATCH_ROWS, NotBatchInvariant, check_batch_invariance
from pdserve.shared.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not native.available(), reason="needs the native CPU kernels")

SPOILED_FROM = 9  # rows from which a spoiled op changes its output (the op's own rows: a head norm's are heads)


@pytest.fixture(scope="module")
def runner(tiny_models) -> ModelRunner:
    return ModelRunner(RuntimeConfig(model_path=str(tiny_models["qwen3-moe"]), dtype="bfloat16", deterministic=True,
                                     lora=LoraConfig(max_loras_per_batch=3),
                                     cache=CacheConfig(page_size=16, max_total_tokens=16 * 32)))


def bump(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t + (rows >= SPOILED_FROM) * 0.125


def spoil_rmsnorm(when):
    def rmsnorm(x, weight, eps, residual=None):
        out = native.load().rmsnorm(x, weight, eps, residual)
        if when(x, residual):
            out[0] = bump(out[0], x.shape[0])
        return out[0] if residual is None else (out[0], out[1])
    return rmsnorm


def spoiled_fused_moe(x, experts, weights, ids):
    from pdserve.kernels.fused_moe import fused_moe_native
    return bump(fused_moe_native(x, experts, weights, ids), x.shape[0])


def spoiled_lora_apply(y, x, *args):
    from pdserve.kernels.lora import lora_apply_native
    lora_apply_native(y, x, *args)
    y.copy_(bump(y, x.shape[0]))


SPOILED_OPS = {
    "rmsnorm 64 fused with the residual add": dict(rmsnorm=spoil_rmsnorm(lambda x, res: res is not None)),
    "q/k head norms 32": dict(rmsnorm=spoil_rmsnorm(lambda x, res: x.shape[1] == 32)),
    r"expert block \(8 experts, top 2\)": dict(fused_moe=spoiled_fused_moe),
    r"LoRA qkv \(rank 16, 3 slots\)": dict(lora_apply=spoiled_lora_apply),
}


# The row-wise checks on the tiny model: 4 distinct matmuls (qkv, o, router, LM head; the dense layer's share the
# attention's shapes), 2 norms, the head norms, an expert block, LoRA on qkv and o, the sampler and its row sums.
ROW_CHECKS = 12


def test_the_check_passes_here_over_every_op(runner):
    assert check_batch_invariance(runner.model, runner.ops, 16) == ROW_CHECKS * len(BATCH_ROWS) + 2  # + attention


@pytest.mark.parametrize("name", list(SPOILED_OPS))
def test_an_op_whose_rows_depend_on_the_batch_is_refused_by_name(runner, name):
    ops = replace(runner.ops, **SPOILED_OPS[name])
    with pytest.raises(NotBatchInvariant, match=rf"{name} gives a row other bits when computed with \d+ rows "
                                                r"than alone .*refusing --enable-deterministic-inference"):
        check_batch_invariance(runner.model, ops, 16)


def test_a_sampler_whose_sums_depend_on_the_batch_is_refused(runner, monkeypatch):
    honest = sampler_module.row_sums
    monkeypatch.setattr(sampler_module, "row_sums", lambda x: bump(honest(x), x.shape[0]))
    with pytest.raises(NotBatchInvariant, match=r"sampler \(512 tokens\) gives a row other bits when computed with"):
        check_batch_invariance(runner.model, runner.ops, 16)


class Group:
    """Two ranks' collectives as seen by rank 0: the other rank's partials are this rank's, doubled."""

    rank, size, timeout_s = 0, 2, 5.0

    def __init__(self, spoiled: bool = False, failed_elsewhere: bool = False) -> None:
        self.spoiled, self.failed_elsewhere = spoiled, failed_elsewhere
        self.votes: list[bool] = []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        total = x.float() * 3
        return x.copy_(bump(total, x.shape[0]) if self.spoiled else total)

    def failed_ranks(self, failed: bool, timeout_s: float) -> list[int]:
        self.votes.append(failed)
        return [r for r, f in enumerate([failed, self.failed_elsewhere]) if f]


@pytest.fixture
def with_group(runner):
    def attach(group: Group) -> Group:
        runner.model.group = group
        return group
    yield attach
    runner.model.group = None


def test_an_all_reduce_whose_rows_depend_on_the_batch_is_refused(runner, with_group):
    group = with_group(Group(spoiled=True))
    with pytest.raises(NotBatchInvariant, match=r"tensor-parallel all-reduce \(torch.float32, 2 ranks\) gives a "
                                                r"row other bits when computed with 17 rows"):
        check_batch_invariance(runner.model, runner.ops, 16)
    assert group.votes == [True]  # the other ranks learn it and refuse too


def test_a_rank_that_fails_the_check_makes_every_rank_refuse(runner, with_group):
    honest = with_group(Group())
    checks = check_batch_invariance(runner.model, runner.ops, 16)
    assert checks == (ROW_CHECKS + 2) * len(BATCH_ROWS) + 2  # the ranks' sums of fp32 and bf16 rows too
    assert honest.votes == [False]
    with_group(Group(failed_elsewhere=True))
    with pytest.raises(NotBatchInvariant, match=r"tensor-parallel rank\(s\) \[1\] failed the batch-invariance "
                                                r"check \(their logs name the op\)"):
        check_batch_invariance(runner.model, runner.ops, 16)

"""Which heads each rank of a prefill worker writes to which rank of a decode worker of another tensor-parallel
size (shared/tp_transfer.py `plan`): every decode rank gets exactly the KV heads it holds, each once, straight from
a prefill rank that holds them; a layout that cannot be mapped is refused naming the heads."""
from __future__ import annotations

import pytest

from pdserve.shared.tp_transfer import check_layouts, plan
from pdserve.shared.transfer.base import TransferError


def received(mine, theirs) -> list[list[int]]:
    """The model's heads each peer rank receives, in the order written, from the writes `plan` gives."""
    got: list[list[int]] = [[] for _ in theirs]
    for r, writes in enumerate(plan(mine, theirs)):
        for d, (l0, l1), (p0, p1) in writes:
            assert l1 - l0 == p1 - p0 > 0
            heads = [mine[r][0] + h for h in range(l0, l1)]
            assert heads == [theirs[d][0] + h for h in range(p0, p1)]  # the same heads on both sides
            got[d] += heads
    return [sorted(g) for g in got]


@pytest.mark.parametrize("mine,theirs", [
    ([(0, 8)], [(0, 4), (4, 8)]),  # 1 -> 2
    ([(0, 4), (4, 8)], [(0, 8)]),  # 2 -> 1
    ([(0, 4), (4, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)]),  # 2 -> 4
    ([(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 4), (4, 8)]),  # 4 -> 2
    ([(0, 2), (2, 3)], [(0, 3)]),  # the default model's 3 groups split 2 + 1, into one rank
    ([(0, 3)], [(0, 1), (0, 1), (1, 2), (1, 2)]),  # fewer KV heads than ranks: replicated on the peer's side
    ([(0, 1), (0, 1), (1, 2), (1, 2)], [(0, 2)]),  # ... and on this side: each head once
])
def test_every_peer_rank_gets_exactly_its_heads_once(mine, theirs):
    assert received(mine, theirs) == [list(range(a, b)) for a, b in theirs]


def test_a_rank_writes_only_to_the_peer_ranks_that_hold_its_heads():
    writes = plan([(0, 4), (4, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)])
    assert [[d for d, _, _ in w] for w in writes] == [[0, 1], [2, 3]]  # no gather through one rank


def test_layouts_of_different_models_are_refused_naming_the_heads():
    with pytest.raises(TransferError, match="KV heads"):
        check_layouts([(0, 4), (4, 8)], [(0, 3), (3, 6)])
    with pytest.raises(TransferError, match="heads 4..7"):
        plan([(0, 4)], [(0, 8)])

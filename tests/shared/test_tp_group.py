"""The CPU ranks' shared-memory collectives, both ways a round runs (in C++ where the native build is there, in
Python where it is not): every rank gets the same sum of every rank's part, in fp32 and bf16, over several rounds
when a tensor exceeds a slot; the gather puts each rank's columns in rank order. Between machines (gloo), three
ranks sum a row in rank order too, whatever the rows summed with it."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading

import pytest
import torch

from pdserve.shared.tp_group import SLOT_BYTES, Mailbox, ShmGroup, TorchGroup


def ranks(native: bool, size: int = 2) -> list[ShmGroup]:
    first = Mailbox.create(size)
    boxes = [first] + [Mailbox(first.path, r, size, create=False) for r in range(1, size)]
    first.unlink()
    groups = [ShmGroup(box, timeout_s=30) for box in boxes]
    if not native:
        for g in groups:
            g._native = None
    elif groups[0]._native is None:
        pytest.skip("the native kernels do not build here (no C++ compiler): the product runs the Python round, "
                    "tested beside")
    return groups


def together(groups: list[ShmGroup], fn) -> list:
    """fn(group) on every rank at once, each rank a thread."""
    out: list = [None] * len(groups)

    def run(r: int) -> None:
        out[r] = fn(groups[r])
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(groups))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_rank_gets_the_sum_of_every_part(native, dtype):
    groups = ranks(native, size=3)
    parts = [torch.randn(5, 64, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(3)]
    want = (parts[0].float() + parts[1].float() + parts[2].float()).to(dtype)
    for _ in range(3):  # rounds alternate between the two parities
        got = together(groups, lambda g: g.all_reduce(parts[g.rank].clone()))
        for x in got:
            assert torch.equal(x, want)


@pytest.mark.parametrize("native", [True, False])
def test_a_tensor_larger_than_a_slot_goes_in_several_rounds(native):
    groups = ranks(native)
    n = SLOT_BYTES // 4 + 1000
    got = together(groups, lambda g: g.all_reduce(torch.full((n,), float(g.rank + 1))))
    assert all(torch.equal(x, torch.full((n,), 3.0)) for x in got)


def test_the_gather_puts_each_ranks_columns_in_rank_order():
    groups = ranks(native=False)
    got = together(groups, lambda g: g.all_gather_columns(torch.full((4, 3), float(g.rank))))
    want = torch.tensor([[0.0] * 3 + [1.0] * 3] * 4)
    assert all(torch.equal(x, want) for x in got)


# One gloo rank in its own process: its sums of 3 rows alone and inside batches of 2, 17 and 67 rows.
GLOO_RANK = """
import sys, torch
from pdserve.shared.tp_group import TorchGroup
rank, size, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
group = TorchGroup(rank, size, init_method, 60.0, torch.device("cpu"))
part = torch.randn(67, 576, generator=torch.Generator().manual_seed(rank)) * 10
alone = torch.cat([group.all_reduce(part[r:r + 1].clone()) for r in range(3)])
torch.save([alone] + [group.all_reduce(part[:n].clone())[:3] for n in (2, 17, 67)], out)
group.dist.destroy_process_group()
"""


def test_three_gloo_ranks_sum_a_row_in_rank_order_whatever_the_batch(tmp_path):
    """gloo's own ring started each chunk's sum at another rank, and a row's chunk moved with the batch's size:
    its bits changed with the batch (deterministic mode's start check refused it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-c", GLOO_RANK, str(r), "3", init, str(tmp_path / f"{r}.pt")])
             for r in range(3)]
    try:
        assert [p.wait(120) for p in procs] == [0, 0, 0]
    finally:
        for p in procs:
            p.kill()
    parts = [torch.randn(67, 576, generator=torch.Generator().manual_seed(r)) * 10 for r in range(3)]
    want = parts[0] + parts[1] + parts[2]
    for r in range(3):
        for got in torch.load(tmp_path / f"{r}.pt"):
            assert torch.equal(got, want[:len(got)])

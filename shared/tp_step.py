"""The step protocol of a tensor-parallel worker's ranks: rank 0 leads, the others follow its posts.

Rank 0 is the worker everyone else sees: it schedules, samples and answers. Before each forward it posts the
step (`lead_step`: the flattened ForwardBatch and the page copies) in the mailbox (shared/tp_group.py); each
follower (shared/tp_ranks.py `follow`) reads it, makes the same page copies in its own pool (every rank's pool has
the same pages, each holding its own KV heads), and runs the same forward on its shards, meeting rank 0 in every
all-reduce. Only rank 0 reads the logits. Other posts say what else every rank does together: build, swap or drop
new weights, put an adapter in a LoRA slot (`LoraMirror`), a KV transfer operation (shared/tp_transfer.py), a
storage tier operation (shared/kv_tier_ranks.py). Only
rank 0's engine thread posts, and each post is followed by a collective of all ranks before the next one, so no
post is overwritten unread.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from pdserve.shared.models.llama import ForwardBatch
from pdserve.shared.tp_group import Mailbox, ShmGroup, TorchGroup
from pdserve.shared.tp_shards import Shards

STEP, STOP, POOL, WEIGHTS, SWAP, DISCARD, KV, LORA, TIER = 1, 2, 3, 4, 5, 6, 7, 8, 9
START_TIMEOUT_S = 600.0  # for the other ranks to load their shards (or a checkpoint, or an adapter)


@dataclass
class TPRank:
    """One rank of a tensor-parallel worker: its part of the model, and how it talks to the others."""

    shards: Shards
    box: Mailbox
    group: ShmGroup | TorchGroup

    @property
    def leads(self) -> bool:
        return self.shards.rank == 0

    def stop(self) -> None:
        """Leader: the followers exit their loops."""
        self.box.post(STOP, [])


# ------------------------------------------------------------------------------------------------ the step
def lead_step(rank: TPRank, fb: ForwardBatch, page_copies: list[tuple[int, int]]) -> None:
    """Leader: post `fb` and the step's page copies for the followers."""
    parts = [fb.input_ids, fb.positions, fb.slots, fb.last_rows, fb.page_table.reshape(-1), fb.seq_lens,
             fb.extend_lens, fb.q_start]
    if fb.lora_slots is not None:
        parts.append(fb.lora_slots)
    payload = torch.cat([p.to(torch.int64) for p in parts])
    copies = [x for pair in page_copies for x in pair]
    header = [int(fb.is_decode), fb.input_ids.numel(), fb.seq_lens.numel(), fb.page_table.shape[1],
              fb.last_rows.numel(), int(fb.lora_slots is not None), len(page_copies), payload.numel()]
    if not isinstance(rank.group, TorchGroup):
        rank.box.post(STEP, header, torch.cat([payload, torch.tensor(copies, dtype=torch.int64)]))
    else:  # the mailbox says what comes; the tensors go through the group (device to device on GPUs)
        rank.box.post(STEP, header, torch.tensor(copies, dtype=torch.int64))
        rank.group.broadcast(payload)


def read_step(rank: TPRank, header: list[int], device: torch.device) -> tuple[ForwardBatch, list[tuple[int, int]]]:
    is_decode, T, B, W, n_last, has_lora, n_copies, n = header[:8]
    if not isinstance(rank.group, TorchGroup):
        raw = rank.box.payload[:n + 2 * n_copies].clone()
        payload, copies = raw[:n], raw[n:].tolist()
    else:
        copies = rank.box.payload[:2 * n_copies].tolist()
        payload = rank.group.broadcast(torch.empty(n, dtype=torch.int64, device=device))
    sizes = [T, T, T, n_last, B * W, B, B, B] + ([T] if has_lora else [])
    pieces = list(payload.split(sizes))
    i32 = [p.to(torch.int32) for p in pieces[4:]]
    fb = ForwardBatch(is_decode=bool(is_decode), input_ids=pieces[0], positions=pieces[1], slots=pieces[2],
                      last_rows=pieces[3], page_table=i32[0].view(B, W), seq_lens=i32[1], extend_lens=i32[2],
                      q_start=i32[3], lora_slots=i32[4] if has_lora else None)
    return fb, list(zip(copies[0::2], copies[1::2]))



class LoraMirror:
    """Rank 0's LoRA slots, told to every other rank as they change (on the engine thread, which schedules)."""

    def __init__(self, rank: TPRank) -> None:
        self.rank = rank

    def wrote(self, slot: int, adapter) -> None:
        from pdserve.shared.lora import LoraError  # (lora.py is below this module; imported where it is used)

        info = {"name": adapter.name, "path": adapter.path, "version": adapter.version}
        self.rank.box.post(LORA, [slot, 1], bytes_payload(json.dumps(info).encode()))
        failed = self.rank.group.failed_ranks(False, START_TIMEOUT_S)
        if failed:
            raise LoraError(f"adapter {adapter.name!r}: tensor-parallel rank(s) {failed} could not load it (their "
                            "logs say why)")

    def cleared(self, slot: int) -> None:
        self.rank.box.post(LORA, [slot, 0])
        self.rank.group.barrier(START_TIMEOUT_S)


def bytes_payload(raw: bytes) -> torch.Tensor:
    """Bytes as a mailbox payload (its length first)."""
    padded = len(raw).to_bytes(8, "little") + raw + b"\0" * (-len(raw) % 8)
    return torch.frombuffer(bytearray(padded), dtype=torch.int64)


def read_bytes(payload: torch.Tensor) -> bytes:
    n = int(payload[0])
    return payload[1:1 + -(-n // 8)].numpy().tobytes()[:n]

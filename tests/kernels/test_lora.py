from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest
import torch
from kernel_cases import (DEVICES, NATIVE_DTYPES, TRITON_DEVICE, TRITON_DTYPES, assert_close, error_in_child,
                          needs_native, torch_threads)

from pdserve.kernels.lora import lora_apply_native, lora_apply_torch, lora_apply_triton

# name: (in_features, sub-module sizes, R, the ranks of the S = 4 slots). Slot 3 never gets a row.
SHAPES = {
    "down": (100, (20,), 8, (8, 3, 5, 2)),  # in not a multiple of 32, R below 16
    "gate_up": (72, (36, 36), 16, (16, 7, 1, 16)),
    "qkv": (64, (40, 24, 24), 40, (40, 17, 3, 33)),  # GQA: q wider than k and v; ranks past 16 and 32
}
FP = (torch.float32, torch.bfloat16)
IMPLS = ([pytest.param(lora_apply_torch, device, dtype, id=f"torch-{device}-{dtype}") for device in DEVICES
          for dtype in FP]
         + [pytest.param(lora_apply_triton, TRITON_DEVICE, dtype, id=f"triton-{dtype}") for dtype in TRITON_DTYPES]
         + [pytest.param(lora_apply_native, "cpu", dtype, id=f"native-{dtype}", marks=needs_native)
            for dtype in NATIVE_DTYPES])


@dataclass
class Case:
    buffer: torch.Tensor  # [T, out + 8]: y and 8 spare columns that must not change
    y: torch.Tensor  # [T, out], a view of buffer
    x: torch.Tensor  # [T, in], a view with strided rows
    lora_a: torch.Tensor  # [S, n_sub * R, in]
    lora_b: torch.Tensor  # [S, out, R]
    out_offsets: list[int]
    row_slots: torch.Tensor  # [T] int32
    ranks: torch.Tensor  # [S] int32

    def apply(self, impl) -> None:
        impl(self.y, self.x, self.lora_a, self.lora_b, self.out_offsets, self.row_slots, self.ranks)


def make_case(rows: int, shape: str, dtype: torch.dtype, device: str, slots: list[int] | None = None,
              seed: int = 0) -> Case:
    """A pool whose adapters have ranks below R (zero padding past them), and `rows` rows whose slots (by
    default 0, 1, 2 and -1 interleaved in random order) leave slot 3 unused."""
    in_f, sizes, R, ranks = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    offsets = [0, *itertools.accumulate(sizes)]
    out = offsets[-1]
    a = torch.zeros(len(ranks), len(sizes) * R, in_f)
    b = torch.zeros(len(ranks), out, R)
    for s, r in enumerate(ranks):
        for j, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
            a[s, j * R:j * R + r] = torch.randn(r, in_f, generator=gen) / in_f ** 0.5
            b[s, lo:hi, :r] = torch.randn(hi - lo, r, generator=gen) / r ** 0.5
    if slots is None:
        pattern = [1, -1, 2, 0] * rows
        slots = [pattern[i] for i in torch.randperm(rows, generator=gen).tolist()] if rows > 1 else pattern[:rows]
    x = torch.randn(rows, in_f + 8, generator=gen)[:, :in_f]
    buffer = torch.randn(rows, out + 8, generator=gen).to(dtype=dtype, device=device)
    return Case(buffer, buffer[:, :out], x.to(dtype=dtype, device=device), a.to(dtype=dtype, device=device),
                b.to(dtype=dtype, device=device), offsets, torch.tensor(slots, dtype=torch.int32, device=device),
                torch.tensor(ranks, dtype=torch.int32, device=device))


def per_row_reference(case: Case) -> torch.Tensor:
    """y after the call, row by row and sub-module by sub-module in float64 over the full padded R, rounded to
    the model dtype where the contract rounds (h, the delta, the sum)."""
    dtype, R = case.y.dtype, case.lora_b.shape[2]
    y = case.y.double().cpu()
    for t, s in enumerate(case.row_slots.tolist()):
        if s < 0:
            continue
        for j, (lo, hi) in enumerate(zip(case.out_offsets, case.out_offsets[1:])):
            h = (case.lora_a[s, j * R:(j + 1) * R].double().cpu() @ case.x[t].double().cpu()).to(dtype)  # [R]
            delta = (case.lora_b[s, lo:hi].double().cpu() @ h.double()).to(dtype)  # [hi - lo]
            y[t, lo:hi] = (y[t, lo:hi] + delta.double()).to(dtype).double()
    return y.to(dtype)


@pytest.mark.parametrize("impl,device,dtype", IMPLS)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_matches_per_row_reference(impl, device, dtype, shape, rows):
    case = make_case(rows, shape, dtype, device, seed=rows)
    before = case.buffer.clone()
    expected = per_row_reference(case)
    case.apply(impl)
    assert_close(case.y.cpu(), expected, dtype)
    base = case.row_slots < 0
    assert torch.equal(case.y[base], before[base, :case.y.shape[1]])  # rows on the base model keep their bits
    assert torch.equal(case.buffer[:, case.y.shape[1]:], before[:, case.y.shape[1]:])  # no write past out


@pytest.mark.parametrize("impl,device,dtype", IMPLS)
@pytest.mark.parametrize("rows", [0, 6])
def test_batch_on_the_base_model_is_untouched(impl, device, dtype, rows):
    case = make_case(rows, "qkv", dtype, device, slots=[-1] * rows)
    before = case.buffer.clone()
    case.apply(impl)
    assert torch.equal(case.buffer, before)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_prompt_of_one_adapter(dtype):
    # A prefill: one slot's rows span several of the kernel's 64-row chunks, a few rows of others among them.
    slots = [0] * 150
    slots[3], slots[70], slots[71], slots[149] = 2, -1, 1, 2
    case = make_case(len(slots), "qkv", dtype, "cpu", slots=slots)
    expected = per_row_reference(case)
    case.apply(lora_apply_native)
    assert_close(case.y, expected, dtype)


@needs_native
@pytest.mark.parametrize("dtype", NATIVE_DTYPES)
def test_native_row_does_not_depend_on_batch_or_threads(dtype):
    batch = make_case(37, "qkv", dtype, "cpu")
    original = batch.y.clone()
    batch.apply(lora_apply_native)
    for t in (0, 11, 36):
        alone = make_case(37, "qkv", dtype, "cpu")  # the same tensors: same seed
        alone.y, alone.x, alone.row_slots = original[t:t + 1].clone(), alone.x[t:t + 1], alone.row_slots[t:t + 1]
        with torch_threads(1):
            alone.apply(lora_apply_native)
        assert torch.equal(alone.y[0], batch.y[t]), t


@pytest.mark.parametrize("impl", [lora_apply_torch, lora_apply_triton], ids=["torch", "triton"])
def test_python_impls_refuse_mismatched_offsets(impl):
    case = make_case(3, "qkv", torch.float32, TRITON_DEVICE)
    with pytest.raises(ValueError, match="out_offsets"):
        impl(case.y, case.x, case.lora_a, case.lora_b, [0, 40, 64, 80], case.row_slots, case.ranks)


def _bad(case: Case, **changes) -> Case:
    fields = dict(case.__dict__, **changes)
    return Case(**fields)


BAD_INPUTS = {  # case: (changes to a good bf16 case, what the error says)
    "slot out of range": (lambda c: _bad(c, row_slots=torch.tensor([0, 4, -1], dtype=torch.int32)), "row_slots"),
    "slot below -1": (lambda c: _bad(c, row_slots=torch.tensor([0, -2, -1], dtype=torch.int32)), "row_slots"),
    "rank above R": (lambda c: _bad(c, ranks=torch.tensor([41, 0, 0, 0], dtype=torch.int32)), "ranks"),
    "int64 slots": (lambda c: _bad(c, row_slots=c.row_slots.long()), "int32"),
    "offsets short of out": (lambda c: _bad(c, out_offsets=[0, 40, 64, 80]), "out_offsets"),
    "two sub-modules for three": (lambda c: _bad(c, out_offsets=[0, 40, 88]), "n_sub"),
    "mixed dtypes": (lambda c: _bad(c, lora_b=c.lora_b.float()), "dtype"),
    "fp16": (lambda c: _bad(c, x=c.x.half(), y=c.y.half(), lora_a=c.lora_a.half(), lora_b=c.lora_b.half()),
             "float32 or bfloat16"),
    "strided pool": (lambda c: _bad(c, lora_b=c.lora_b.transpose(1, 2).contiguous().transpose(1, 2)),
                     "contiguous"),
}


@needs_native
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_native_refuses_bad_inputs(name):
    change, match = BAD_INPUTS[name]
    case = change(make_case(3, "qkv", torch.bfloat16, "cpu"))
    message = error_in_child(lambda: case.apply(lora_apply_native))
    assert message.startswith(("RuntimeError", "ValueError")) and match in message, message

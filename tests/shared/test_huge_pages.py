"""Packed weights live in 2 MiB pages where Linux gives them, with the values they were given."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pdserve.shared import huge_pages
from pdserve.shared.huge_pages import place
from pdserve.shared.int8_linear import Int8Linear
from pdserve.shared.linear import Linear

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


needs_thp = pytest.mark.skipif(thp_mode() not in ("always", "madvise"),
                               reason=f"transparent huge pages are {thp_mode() or 'absent'} here: nothing to ask for")


def huge_kib_at(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return 0


def test_a_placed_tensor_keeps_its_values_dtype_and_shape():
    for t in (torch.randn(700, 300).bfloat16(), torch.randint(-127, 128, (70, 4100), dtype=torch.int8),
              torch.randn(3, 65536)):
        got = place(t)
        assert got.dtype == t.dtype and got.shape == t.shape and got.is_contiguous() and torch.equal(got, t)
        assert got.data_ptr() != t.data_ptr() and got.data_ptr() % huge_pages.ALIGN == 0
    small = torch.randn(16, 16)
    assert place(small) is small  # a few 4 KiB pages hold it anyway


def test_huge_pages_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(huge_pages, "_disabled", True)
    t = torch.randn(1024, 1024)
    assert place(t) is t


@needs_thp
def test_the_layers_packed_weights_sit_in_huge_pages():
    torch.manual_seed(0)
    weight = (torch.randn(3072, 576) * 0.05).bfloat16()  # the default model's gate_up
    x = torch.randn(3, 576).bfloat16()
    for layer in (Linear(weight, fixed=True), Int8Linear(weight)):
        packed = layer._fixed.packed if isinstance(layer, Linear) else layer.packed
        if packed is None:
            pytest.skip("no native build: no packed weight")
        assert huge_kib_at(packed.data_ptr()) >= 2048, "the weight's mapping has no 2 MiB page"
    lin = Linear(weight, fixed=True)
    torch.testing.assert_close(lin(x).double(), (x.double() @ weight.double().T).bfloat16().double(), rtol=1e-2,
                               atol=1e-2)

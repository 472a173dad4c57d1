"""Large bodies are scanned a slice at a time (json_codec.SLICE): what straddles two slices is still seen."""
from __future__ import annotations

import pytest

from pdserve.services.gateway.json_codec import SLICE, decode


@pytest.mark.parametrize("cut", [1, 9, 18])
def test_a_long_integer_across_a_slice_boundary_keeps_every_digit(cut):
    seed = 2**64 + 1  # 20 digits: orjson would read it as a float
    head = b'{"pad": "' + b"x" * (SLICE - cut - 20) + b'", "seed": '
    raw = head + str(seed).encode() + b"}"
    assert len(head) < SLICE < len(head) + 20
    assert decode(raw).value["seed"] == seed


@pytest.mark.parametrize("cut", [1, 3, 5])
def test_a_lone_surrogate_across_a_slice_boundary_is_found(cut):
    head = b'{"pad": "' + b"x" * (SLICE - cut - 18) + b'", "t": "'
    raw = head + b'\\ud800"}'
    assert len(head) < SLICE < len(head) + 6
    assert decode(raw).surrogate_at == "t"

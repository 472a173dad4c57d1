"""Seeded draws: a seeded choice's uniforms at an output position depend on its seed and that position only."""
from __future__ import annotations

import torch

from pdserve.shared.sampler import make_generator
from pdserve.shared.seeded_draws import position_generator


def test_a_seeded_position_draws_from_its_seed_and_position_only():
    def uniforms(gen, seed, position):
        return torch.rand(4, generator=position_generator(gen, seed, position))

    fresh = uniforms(make_generator(7), 7, 3)
    used = make_generator(7)
    torch.rand(100, generator=used)  # a generator that drew before, as a worker's does at earlier positions
    assert torch.equal(uniforms(used, 7, 3), fresh)
    others = [uniforms(make_generator(7), 7, 4), uniforms(make_generator(8), 8, 3),
              uniforms(make_generator(7), 7 + 2**32, 3)]  # torch keeps 32 bits of a seed: the high ones count too
    assert all(not torch.equal(o, fresh) for o in others)
    assert position_generator(None, None, 3) is None

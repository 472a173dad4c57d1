"""Seeded draws: the uniforms a seeded choice samples with at each output position, whichever worker samples it.

A seeded request's generator is seeded afresh for every output position from (seed + choice index, position), so
the uniforms of position i do not depend on where positions 0..i-1 were sampled: in PD the prefill worker samples
the first token and the decode worker the rest; a decode worker that finds the prompt cached samples them all; a
colocated worker, a retracted and recomputed request and speculative verification sample them one by one. With
one generator advancing per step, the decode worker's fresh generator gave the second token the first token's
uniform, and the seeds' multi-turn example answered differently through a prefill worker than from decode's
cache, with identical logprobs.
"""
from __future__ import annotations

import torch

_MASK64 = 0xFFFF_FFFF_FFFF_FFFF


def position_generator(generator: torch.Generator | None, seed: int | None,
                       position: int) -> torch.Generator | None:
    """`generator` seeded for the draws of output position `position` of a choice seeded with `seed` (unchanged
    when the choice draws from the global generator). torch's CPU generator keeps only 32 bits of a seed, so seed
    and position are mixed into those 32 (SplitMix64's finaliser): nearby seeds and positions get unrelated
    streams, and seeds that differ only in their high bits differ too."""
    if generator is None or seed is None:
        return generator
    x = ((seed & _MASK64) * 0x9E3779B97F4A7C15 + position) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return generator.manual_seed((x ^ (x >> 32)) & 0xFFFF_FFFF)

"""Step costs from a profile: the measured points of `pdserve profile` fitted to the shapes a step's time takes.

A profile (JSON, written by `profile.py`) holds raw measurements; this module owns how they become times:

- prefill of `new` tokens after `cached` ones: a + b * new + c * new * (cached + new / 2) (the matmuls grow with
  the new tokens, attention with the tokens each attends to); a batch of prompts pays `a` once.
- a decode step of `batch` requests holding `context` tokens in all: a + b * batch + c * context.
- a KV transfer of `nbytes`: a + nbytes / bandwidth.
- per request and per token overheads of the gateway and the worker's front, added to what a client sees.

Coefficients are least squares, none below zero (a negative one is dropped and the rest refitted), so a noisy
profile never yields a step that gets cheaper as it grows.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PROFILE_VERSION = 1


class ProfileError(ValueError):
    pass


def fit_nonnegative(rows: list[list[float]], target: list[float]) -> list[float]:
    """Least-squares coefficients (each >= 0) of the terms in `rows`, one row per measured point, for `target`."""
    a, y = np.array(rows, dtype=float), np.array(target, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


@dataclass(frozen=True)
class Costs:
    prefill: tuple[float, float, float]
    decode: tuple[float, float, float]
    transfer: tuple[float, float]  # (seconds fixed, seconds per byte)
    kv_bytes_per_token: int
    request_s: float  # gateway + front, once per request, before its first token
    token_s: float  # gateway + front, per output token
    page_size: int
    max_total_tokens: int

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill step over (new tokens, cached tokens before them) of each prompt in it."""
        a, b, c = self.prefill
        return a + sum(b * new + c * new * (cached + new / 2) for new, cached in chunks)

    def decode_s(self, batch: int, context: int) -> float:
        a, b, c = self.decode
        return a + b * batch + c * context

    def decode_extra_s(self, batch: int, context: int) -> float:
        """What `batch` decoding requests add to a step that runs anyway (a mixed prefill step)."""
        _, b, c = self.decode
        return b * batch + c * context

    def transfer_s(self, tokens: int) -> float:
        a, per_byte = self.transfer
        return a + per_byte * tokens * self.kv_bytes_per_token


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    try:
        profile = json.loads(path.read_text())
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(profile, dict) or profile.get("version") != PROFILE_VERSION:
        raise ProfileError(f"{path}: not a pdserve profile of version {PROFILE_VERSION} (write one with "
                           f"`pdserve profile --out {path.name}`)")
    for key in ("prefill", "decode", "transfer", "overheads", "kv_bytes_per_token", "page_size"):
        if key not in profile:
            raise ProfileError(f"{path}: missing {key!r}")
    for key, least in (("prefill", 3), ("decode", 3), ("transfer", 2)):
        if len(profile[key]) < least:
            raise ProfileError(f"{path}: {key} needs at least {least} measured points, has {len(profile[key])}")
    return profile


def costs_of(profile: dict) -> Costs:
    pre = profile["prefill"]
    prefill = fit_nonnegative([[1.0, p["tokens"] - p["cached"],
                                (p["tokens"] - p["cached"]) * (p["cached"] + (p["tokens"] - p["cached"]) / 2)]
                               for p in pre], [p["seconds"] for p in pre])
    dec = profile["decode"]
    decode = fit_nonnegative([[1.0, d["batch"], d["batch"] * d["context"]] for d in dec], [d["seconds"] for d in dec])
    tra = profile["transfer"]
    transfer = fit_nonnegative([[1.0, t["bytes"]] for t in tra], [t["seconds"] for t in tra])
    o = profile["overheads"]
    return Costs(tuple(prefill), tuple(decode), (transfer[0], transfer[1]), int(profile["kv_bytes_per_token"]),
                 o.get("gateway_request_s", 0.0) + o.get("front_request_s", 0.0),
                 o.get("gateway_token_s", 0.0) + o.get("front_token_s", 0.0),
                 int(profile["page_size"]), int(profile.get("max_total_tokens", 65536)))

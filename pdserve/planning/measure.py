"""The single measurements `pdserve profile` is made of, each through the runtime's own engine or backend.

Every function returns one point of the profile (see costs.py for how points become step costs). Token ids stay
inside the model's vocabulary and differ from point to point, so no measurement finds another's prefix cached.
"""
from __future__ import annotations

import time
from pathlib import Path

from pdserve.shared.engine import Engine
from pdserve.shared.req import Req
from pdserve.shared.sampling_params import SamplingParams


def _ids(engine: Engine, n: int, salt: int) -> list[int]:
    vocab = engine.model_config.vocab_size - 16
    return [8 + (31 * k + 7919 * salt) % vocab for k in range(n)]


def _run(engine: Engine, reqs: list[Req]) -> float:
    for req in reqs:
        engine.add_request(req)
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def measure_prefill(engine: Engine, tokens: int, cached: int, reps: int = 2) -> dict:
    """Seconds to a first token for a `tokens`-long prompt whose first `cached` tokens are in the prefix cache."""
    best, got = float("inf"), 0
    for rep in range(reps):
        engine.flush_cache()
        ids = _ids(engine, tokens, tokens * 100 + rep)
        if cached:
            _run(engine, [Req(rid=f"prefix-{rep}", input_ids=ids[:cached], params=SamplingParams(max_new_tokens=1))])
        req = Req(rid=f"prefill-{rep}", input_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=1))
        best = min(best, _run(engine, [req]))
        got = req.cached_tokens
    engine.flush_cache()
    return {"tokens": tokens, "cached": got, "seconds": best}


def measure_decode(engine: Engine, batch: int, context: int, steps: int = 6) -> dict:
    """Shortest decode step of `batch` requests holding about `context` tokens each (a shared prefix, then their own)."""
    engine.flush_cache()
    shared = _ids(engine, max(1, context - 8), 10_000 + context)
    params = SamplingParams(temperature=0, max_new_tokens=steps + 2, ignore_eos=True)
    # The prefix computed once and cached first: added together, every request of the batch would compute it.
    _run(engine, [Req(rid=f"decode-prefix-{batch}", input_ids=shared, params=SamplingParams(max_new_tokens=1))])
    for i in range(batch):
        engine.add_request(Req(rid=f"decode-{batch}-{i}", input_ids=shared + _ids(engine, 8, 20_000 + i),
                               params=params))
    seen = []
    s = engine.scheduler
    while engine.has_work():
        decoding = not s.waiting and s.chunked is None
        engine.step()
        if decoding and len(s.running) == batch:
            seen.append(engine.stats.last_step_s)
    engine.flush_cache()
    return {"batch": batch, "context": context + steps // 2,
            "seconds": min(seen[1:] or seen or [0.0])}


def measure_transfer(backend: str, tokens: int, page_size: int, iters: int) -> dict:
    """One prompt's KV pages written to another process through the backend (`pdserve debug bench-transfer`)."""
    from pdserve.shared.transfer.bench import measure

    row = next(r for r in measure(backend, tokens, iters) if "1 run" in r.case)
    return {"bytes": row.nbytes, "seconds": row.seconds, "tokens": tokens}


def measure_overheads(model_dir: Path) -> dict:
    """The gateway's own work: a chat prompt templated and tokenized (per request), a token detokenized (per token).
    The gRPC hops between gateway and workers are not measured (they are well under a millisecond on loopback)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    message = [{"role": "user", "content": " ".join(["the quick brown fox jumps over the lazy dog"] * 40)}]

    def template() -> list[int]:
        return tok.apply_chat_template(message, tokenize=True, add_generation_prompt=True)

    ids = list(template())
    if isinstance(ids, dict) or (ids and not isinstance(ids[0], int)):
        ids = list(tok(message[0]["content"])["input_ids"])
    request = min(_timed(template) for _ in range(5))
    t0 = time.perf_counter()
    for i in range(1, min(len(ids), 200)):
        tok.decode(ids[max(0, i - 6):i])
    per_token = (time.perf_counter() - t0) / max(1, min(len(ids), 200) - 1)
    return {"gateway_request_s": request, "gateway_token_s": per_token, "front_request_s": 0.0, "front_token_s": 0.0}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0

"""`/v1/completions` as the load: a prompt given as token ids, so that a replayed trace's prompts have exactly the
lengths it names (replay.py), streamed back as completion chunks `load.StreamTally` reads (`choices[].text`)."""
from __future__ import annotations


def completions_body(model: str, prompt: str | list[int], output_len: int, temperature: float, extra: dict) -> dict:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "ignore_eos": True,  # every request produces exactly output_len tokens
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        **extra,
    }

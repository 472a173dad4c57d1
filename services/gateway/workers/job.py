"""What a generation is asked (`Job`: one tokenized prompt and how to sample and shape it) and what it gives
back (`Update`s as the output grows, `ChoiceResult`s whole), for the APIs that build the one and read the others.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.shared.sampling_params import SamplingParams


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob), best first
    ids: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob) of the job's token_ids_logprob


@dataclass
class Job:
    """What to generate for one prompt.

    Two ids: `rid` is the gateway's own (`context.new_id`, never taken from a client), the one workers key the
    request's pages and aborts by, so no client can collide with another request there. `public_id` is the id
    the client knows the request by: the `rid` it sent, or else the id of the answer; /abort_request finds
    requests by it.
    """

    rid: str
    input_ids: list[int]
    params: SamplingParams
    stops: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    spaces_between_special_tokens: bool = True
    lora: str | None = None  # LoRA adapter name (None: the base model)
    public_id: str = ""  # empty: the same as rid
    stop_regex: list[str] = field(default_factory=list)  # checked, as StopMatcher's regexes (SGLang's stop_regex)

    def __post_init__(self) -> None:
        self.public_id = self.public_id or self.rid


@dataclass
class Update:
    """New output of one choice. `text` may be empty while text is held back (stop strings, partial UTF-8)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    matched_stop: int | str | None = None  # stop token id or stop string


@dataclass
class ChoiceResult:
    """A whole choice, for responses that are not streamed."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: int | str | None = None

    def add(self, u: Update) -> None:
        self.text += u.text
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs
        if u.finish_reason is not None:
            self.finish_reason, self.matched_stop = u.finish_reason, u.matched_stop

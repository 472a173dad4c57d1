"""A request's inputs checked against the served model: prompts turned into token ids within the context,
chat messages rendered by the model's template, grammars compiled. Every dialect's intake goes through one
`Inputs` (the gateway holds it); large inputs are tokenized and rendered on the gateway's thread pool, never on
the event loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pdserve.services import tracing
from pdserve.services.gateway.cpu_pool import CpuPool
from pdserve.services.gateway.errors import ApiError
from pdserve.services.gateway.intake.grammar_check import CompileTimeout, GrammarChecker, GrammarSource
from pdserve.services.gateway.limits import Limits
from pdserve.services.gateway.tokenization import ModelConfigInfo, ModelTokenizer
from pdserve.shared.sampling_params import SamplingParams

GRAMMAR_COMPILE_TIMEOUT_S = 30.0


@dataclass
class Inputs:
    tokenizer: ModelTokenizer
    model_config: ModelConfigInfo
    tokenizer_path: str
    context_length: Callable[[], int]  # the workers' context length (known once one has joined)
    limits: Limits = field(default_factory=Limits)
    cpu: CpuPool = field(default_factory=CpuPool)
    grammar_timeout_s: float = GRAMMAR_COMPILE_TIMEOUT_S  # budget of one grammar's compile (400 past it)
    _grammars: GrammarChecker | None = field(default=None, init=False, repr=False)  # started at first use

    def prompt_ids(self, prompt: str | list[int], param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of one prompt, given as text or ids; checked against the vocabulary and the context."""
        if isinstance(prompt, str):
            self.check_text_size(prompt, param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        else:
            ids = list(prompt)
            bad = next((t for t in ids if not 0 <= t < self.tokenizer.vocab_size), None)
            if bad is not None:
                raise ApiError(400, f"Token id {bad} in {param!r} is outside the vocabulary "
                                    f"(size {self.tokenizer.vocab_size}).", param)
        self.check_length(ids, param)
        return ids

    async def prompts_ids(self, prompts: list[str | list[int]], params: list[str], list_param: str,
                          add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each prompt of a request (`params`: the field of each), with the request's total held to
        --max-request-tokens. Sizes are checked first, in characters and ids; large inputs are tokenized on the
        gateway's thread pool, never on the event loop."""
        size = 0
        for prompt, param in zip(prompts, params):
            if isinstance(prompt, str):
                self.check_text_size(prompt, param)
            size += len(prompt)
        self.limits.text_total(prompts, list_param, self.tokenizer.max_token_chars)
        self.limits.tokens_total([p for p in prompts if not isinstance(p, str)], list_param)
        with tracing.section("tokenize", prompts=len(prompts)):
            ids = await self.cpu.run(size, lambda: [self.prompt_ids(p, param, add_special_tokens)
                                                    for p, param in zip(prompts, params)])
        self.limits.tokens_total(ids, list_param)
        return ids

    def check_text_size(self, text: str, param: str, hint: str = "") -> None:
        """400 for a text with more characters than the context holds even in the vocabulary's longest tokens:
        it cannot fit, and tokenizing megabytes would stall every other request on the event loop."""
        self.check_chars(len(text), param, hint)

    def check_chars(self, chars: int, param: str, hint: str = "") -> None:
        """`hint`: what the caller may do about it, said after the limit."""
        limit = self.context_length()
        max_chars = limit * self.tokenizer.max_token_chars
        if chars > max_chars:
            # SGLang's words for a prompt past the context ("is longer than the model's context length")
            raise ApiError(400, f"The input ({chars} characters) is longer than the model's context length ({limit} "
                                f"tokens) can hold: the prompt ({param!r}) may have at most {max_chars} characters"
                                f"{hint}.", param)

    def check_length(self, ids: list[int], param: str) -> None:
        limit = self.context_length()
        if not ids:
            raise ApiError(400, f"The prompt ({param!r}) is empty.", param)
        if len(ids) >= limit:
            raise ApiError(400, f"The input ({len(ids)} tokens) is longer than the model's context length ({limit} "
                                f"tokens); the prompt ({param!r}) must be shorter, to leave room for the answer.",
                           param)

    async def check_constraint(self, params: SamplingParams, names: dict[str, str], prefix: str = "") -> None:
        """Compile params' grammar, in a child process (grammar_check.py): one that does not compile, or not
        within the budget, is a 400 here, before any worker is asked."""
        if params.constraint is None:
            return
        if self._grammars is None:
            vocab = self.model_config.vocab_size or self.tokenizer.vocab_size
            source = GrammarSource(self.tokenizer_path, vocab, tuple(self.tokenizer.eos_token_ids) or None)
            self._grammars = GrammarChecker(source, self.grammar_timeout_s)
        try:
            refused = await self._grammars.check(params)
        except CompileTimeout:
            name = prefix + names.get(params.constraint[0], params.constraint[0])
            raise ApiError(400, f"The grammar of {name!r} did not compile within "
                                f"{self.grammar_timeout_s:g} s.", name) from None
        if refused is not None:
            field, reason = refused
            name = prefix + names.get(field, field)
            raise ApiError(400, f"Invalid value for {name!r}: {reason}", name)

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

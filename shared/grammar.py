"""Constrained decoding: a request's grammar compiled once, and one matcher per sequence that masks its logits.

The grammar engine is xgrammar. `Grammars` compiles the constraint a SamplingParams carries (json_schema, regex,
ebnf or structural_tag) for one tokenizer; xgrammar's compiler caches by constraint text, so the same schema
compiles once per process. Compiling is thread-safe and releases the GIL: the gateway compiles to refuse a bad
constraint with a 400 before any worker sees it, and the workers compile off their step loop.

A `Constraint` is one sequence's position in its grammar. Each step the engine asks every constrained row
which tokens the grammar allows next (`fill_masks`), bans the rest (`apply_masks`) before sampling, and
advances the matcher with the chosen token (`accept`). A prefill worker masks the first token; the decode
worker replays it into a fresh matcher, so both roles apply the same grammar at every position.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.shared.sampling_params import SamplingParams


class GrammarError(ValueError):
    """A constraint that does not compile; `field` is the SamplingParams attribute at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class Grammars:
    """The grammar compiler of one tokenizer, for vocabularies of `vocab_size` (the model's logits width)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: tuple[int, ...] | None = None) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) if stop_token_ids else None)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1)

    def compile(self, params: SamplingParams) -> Any | None:
        """The compiled grammar of params' constraint (None without one). Raises GrammarError."""
        constraint = params.constraint
        if constraint is None:
            return None
        field, text = constraint
        try:
            if field == "json_schema":
                # Compact JSON: a small model allowed free whitespace can fill max_tokens with newlines.
                return self._compiler.compile_json_schema(_json_text(field, text), any_whitespace=False)
            if field == "regex":
                return self._compiler.compile_regex(text)
            if field == "ebnf":
                return self._compiler.compile_grammar(text)
            return self._compile_structural_tag(text)
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar reports every kind of bad grammar as a RuntimeError or ValueError
            raise GrammarError(field, f"{field} is not valid: {_reason(exc)}") from None

    def _compile_structural_tag(self, text: str) -> Any:
        tag = json.loads(_json_text("structural_tag", text))
        if isinstance(tag, dict) and "structures" in tag:  # SGLang's form: begin/schema/end items and triggers
            xgr = self._xgr
            structures, triggers = tag.get("structures"), tag.get("triggers")
            if not isinstance(structures, list) or not isinstance(triggers, list) or not triggers:
                raise GrammarError("structural_tag", "structural_tag needs a list of 'structures' and a non-empty "
                                                     "list of 'triggers'")
            try:
                items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                         for s in structures]
            except (KeyError, TypeError):
                raise GrammarError("structural_tag", "every structural_tag structure needs 'begin', 'schema' and "
                                                     "'end'") from None
            return self._compiler.compile_structural_tag(items, triggers)
        return self._compiler.compile_structural_tag(text)


def _json_text(field: str, text: str) -> str:
    try:
        json.loads(text)
    except ValueError as exc:
        raise GrammarError(field, f"{field} is not valid JSON: {exc}") from None
    return text


def _reason(exc: Exception) -> str:
    """xgrammar's message without its source location prefix ("[time] /path/file.cc:123: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
        if ".cc:" in text.split(": ", 1)[0] and ": " in text:
            text = text.split(": ", 1)[1]
    return text


@dataclass(eq=False)
class Constraint:
    """One sequence's state in its grammar, and in the reasoning section that may come before it.

    phase: "grammar" (every token obeys the grammar); "reasoning" (free until `think_end` appears, as SGLang
    applies a grammar after a reasoning model's thinking); "opening" (the output may open with `think_start`,
    matched so far by `opened` tokens; any other token starts the grammar at once).
    """

    compiled: Any
    matcher: Any = None
    think_start: tuple[int, ...] = ()
    think_end: tuple[int, ...] = ()
    phase: str = ""
    opened: int = 0
    tail: tuple[int, ...] = ()  # reasoning phase: the last tokens, to spot think_end across steps

    def __post_init__(self) -> None:
        if self.matcher is None:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled)
        if not self.phase:
            self.phase = "grammar" if not self.think_end else "opening" if self.think_start else "reasoning"

    @classmethod
    def for_params(cls, compiled: Any, params: SamplingParams) -> Constraint:
        return cls(compiled, think_start=params.think_start_ids, think_end=params.think_end_ids)

    def fork(self) -> Constraint:
        """A sibling at the same position (n > 1 choices share the compiled grammar, not the state)."""
        return Constraint(self.compiled, self.matcher.fork(), self.think_start, self.think_end, self.phase,
                          self.opened, self.tail)

    @property
    def masks(self) -> bool:
        return self.phase != "reasoning"

    @property
    def allowed_extra(self) -> int | None:
        """A token allowed beside the grammar's: the next one of think_start while the output may open with it."""
        return self.think_start[self.opened] if self.phase == "opening" else None

    def accept(self, token: int) -> bool:
        """Advance past `token`; False when the grammar does not allow it (the state is then unchanged)."""
        if self.phase == "opening":
            if token == self.think_start[self.opened]:
                self.opened += 1
                if self.opened == len(self.think_start):
                    self.phase = "reasoning"
                return True
            self.phase = "grammar"
        if self.phase == "reasoning":
            self.tail = (self.tail + (token,))[-len(self.think_end):]
            if self.tail == self.think_end:
                self.phase = "grammar"
            return True
        return bool(self.matcher.accept_token(token))

    def acceptable_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the grammar accepts in a row from here, the state left as it is (drafts of
        speculative decoding: the rest could never be accepted). Outside the grammar phase: all of them."""
        if self.phase != "grammar":
            return len(tokens)
        n = 0
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token was accepted: nothing more may be generated."""
        return self.phase == "grammar" and bool(self.matcher.is_terminated())


@functools.cache
def _batch_matcher():
    import xgrammar as xgr

    # One thread: filling 32 rows' masks takes tens of microseconds, less than waking a pool would.
    return xgr.BatchGrammarMatcher(max_threads=1)


def apply_masks(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """Ban, in place, every token row i's grammar does not allow next; rows without a constraint are left as is.

    `logits` is [B, V] with B == len(constraints); V may exceed the grammar's vocabulary (padding), whose
    extra columns are banned on constrained rows.
    """
    import xgrammar as xgr

    from pdserve.kernels.token_mask import apply_token_mask

    rows = [i for i, c in enumerate(constraints) if c is not None and c.masks and not c.terminated]
    if not rows:
        return logits
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    _batch_matcher().batch_fill_next_token_bitmask([constraints[i].matcher for i in rows], bitmask)
    for r, i in enumerate(rows):
        extra = constraints[i].allowed_extra
        if extra is not None:  # set one bit of an int32 word, read and written as signed
            word = (int(bitmask[r, extra // 32]) & 0xFFFFFFFF) | (1 << (extra % 32))
            bitmask[r, extra // 32] = word - (1 << 32) if word >= 1 << 31 else word
    # A grammar at a dead end (it allows no token, e.g. a pattern of characters no token spells) bans nothing:
    # a row of only banned tokens has nothing to draw from. The token drawn is then refused (Constraint.accept)
    # and the engine ends the request (Engine.append_token).
    live = [r for r in range(len(rows)) if bool(bitmask[r].any())]
    if len(live) < len(rows):
        rows, bitmask = [rows[r] for r in live], bitmask[live]
        if not rows:
            return logits
    with torch.inference_mode():  # the model's logits are inference tensors
        if len(rows) == logits.shape[0]:
            apply_token_mask(logits, bitmask)
        else:
            index = torch.tensor(rows, device=logits.device)
            part = logits[index]
            apply_token_mask(part, bitmask)
            logits[index] = part
    return logits

"""Text <-> tokens for the gateway: the model's tokenizer and chat template, incremental detokenization.

`ModelTokenizer` is loaded once at start-up and only read afterwards. `Detokenizer` owns the text of one
choice as it grows: it emits a piece of text only once the bytes behind it are complete, so a multi-byte
UTF-8 character split over several tokens never reaches a client as replacement characters.
"""
from __future__ import annotations

import inspect
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True)
class ModelConfigInfo:
    """What the gateway reports about the model, read from its config.json."""

    model_type: str | None
    architectures: list[str]
    max_position_embeddings: int | None
    vocab_size: int | None


def read_model_config(model_dir: Path) -> ModelConfigInfo:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return ModelConfigInfo(config.get("model_type"), list(config.get("architectures") or []),
                           config.get("max_position_embeddings"), config.get("vocab_size"))


class ReservedTemplateKwarg(ValueError):
    """A request's template variables tried to set `name`, which is not a template variable of its own."""

    def __init__(self, name: str) -> None:
        super().__init__(f"{name!r} cannot be set through chat_template_kwargs: it may hold template variables "
                         "only (such as 'enable_thinking').")
        self.name = name


# Names apply_chat_template hands its renderer besides its own arguments, and the functions templates may call
# (Jinja's own globals and those transformers adds; `template_names` adds any others the environment defines).
RENDER_NAMES = frozenset({"conversations", "messages", "raise_exception", "strftime_now", "dict", "namespace",
                          "range", "lipsum", "cycler", "joiner"})


@dataclass(frozen=True)
class TemplateNames:
    variables: frozenset[str]  # what the templates read from their context (enable_thinking, messages, ...)
    functions: frozenset[str]  # the globals of the environment they render in (raise_exception, range, ...)


def template_names(template: str | dict | None) -> TemplateNames:
    """The names the model's chat template(s) use, read from their syntax tree in the Jinja environment
    transformers renders them with. A template that does not parse reads nothing (rendering it fails anyway)."""
    from jinja2 import TemplateError, meta
    from transformers.utils.chat_template_utils import _compile_jinja_template

    templates = list(template.values()) if isinstance(template, dict) else [template] if template else []
    variables: set[str] = set()
    functions: set[str] = set()
    for text in templates:
        try:
            env = _compile_jinja_template(text).environment
            variables |= meta.find_undeclared_variables(env.parse(text))
        except TemplateError:
            continue
        functions |= set(env.globals)
    return TemplateNames(frozenset(variables), frozenset(functions))


def load_tokenizer(path: str | Path):
    """The tokenizer AutoTokenizer would load, without torch: AutoTokenizer's module imports the models'
    configuration code, which imports torch, while the class that tokenizer_config.json names needs only
    `tokenizers`. A directory that names no class known to transformers goes through AutoTokenizer."""
    import transformers

    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and hasattr(cls, "from_pretrained")):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(str(path))


class ModelTokenizer:
    """The model's tokenizer and chat template (transformers), with helpers the APIs share."""

    def __init__(self, path: str | Path, chat_template_file: str | Path | None = None) -> None:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        self.tok = load_tokenizer(path)
        if chat_template_file is not None:
            self.tok.chat_template = Path(chat_template_file).read_text()
        self.eos_token_ids: frozenset[int] = frozenset(
            i for i in (self.tok.eos_token_id,) if isinstance(i, int))
        self.special_ids: frozenset[int] = frozenset(self.tok.all_special_ids)
        self.vocab_size = len(self.tok)
        self._byte_decoder = _byte_decoder()
        # What a request's template variables may not replace: which template runs and with what (the
        # arguments of apply_chat_template), what the renderer passes it, and the tokenizer's special tokens.
        params = inspect.signature(self.tok.apply_chat_template).parameters.values()
        names = template_names(self.tok.chat_template)
        self.reserved_template_kwargs: frozenset[str] = RENDER_NAMES | names.functions \
            | frozenset(self.tok.special_tokens_map) \
            | {p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
        # The only request variables that reach the template: those it reads. Any other name could matter only
        # to apply_chat_template itself (its arguments, today's or a later version's), never to the prompt.
        self.template_variables: frozenset[str] = names.variables - self.reserved_template_kwargs
        # Characters of the vocabulary's longest token: a text longer than the context times this cannot fit.
        self.max_token_chars = max((len(t) for t in self.tok.get_vocab()), default=1)
        # Each token alone, as logprobs show it, worked out once per id of the vocabulary: an 8k-token echo with
        # 20 top logprobs asks for ~170k of them, a second of decode calls, a few milliseconds of look-ups.
        self._token_texts: dict[int, str] = {}
        self._token_bytes: dict[int, tuple[int, ...]] = {}

    @property
    def has_chat_template(self) -> bool:
        return bool(self.tok.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True) -> str:
        # spaces_between_special_tokens changes the text of tokenizers that decode token by token (the "slow"
        # ones); fast tokenizers join special tokens without spaces either way, as in SGLang.
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False,
                               spaces_between_special_tokens=spaces_between_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> str:
        """The prompt text for `messages`; raises ValueError when the template rejects them, and its subclass
        ReservedTemplateKwarg when `template_kwargs` names more than template variables."""
        reserved = next((k for k in template_kwargs or {} if k in self.reserved_template_kwargs), None)
        if reserved is not None:
            raise ReservedTemplateKwarg(reserved)
        if not self.has_chat_template:
            raise ValueError("the model has no chat template; pass --chat-template FILE to the gateway")
        variables = {k: v for k, v in (template_kwargs or {}).items() if k in self.template_variables}
        try:
            return self.tok.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message, tools=tools or None, **variables)
        except Exception as exc:  # jinja errors (e.g. raise_exception in the template) are user input problems
            raise ValueError(f"the chat template cannot render these messages: {exc}") from None

    def encode_chat(self, messages: list[dict], **kwargs) -> list[int]:
        # The rendered template already holds any special tokens it wants (BOS included): add none.
        return self.encode(self.render_chat(messages, **kwargs), add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's text, decoded alone (safe from any thread: the cache is a dict)."""
        text = self._token_texts.get(token_id)
        if text is None:
            text = self.decode([token_id], skip_special_tokens=False)
            if 0 <= token_id < self.vocab_size:
                self._token_texts[token_id] = text
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The raw bytes of one token (byte-level BPE tokens may hold part of a UTF-8 character)."""
        raw = self._token_bytes.get(token_id)
        if raw is None:
            raw = self._raw_bytes(token_id)
            if 0 <= token_id < self.vocab_size:
                self._token_bytes[token_id] = raw
        return list(raw)

    def _raw_bytes(self, token_id: int) -> tuple[int, ...]:
        piece = self.tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return ()
        if all(ch in self._byte_decoder for ch in piece):
            return tuple(self._byte_decoder[ch] for ch in piece)
        return tuple(piece.replace("\u2581", " ").encode("utf-8"))


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte -> printable character map of byte-level BPE (GPT-2 style) vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars)}


@dataclass
class Detokenizer:
    """Incremental decoding of one choice: push token ids, get the new text that is final.

    Keeps two offsets into the ids: text up to `read_offset` has been emitted; each step decodes from
    `prefix_offset` (the start of the previous step's tokens), because a token decoded alone loses its
    context (a leading space, the first bytes of a character). New text is held back
    while it ends in an incomplete character (U+FFFD), and released by `flush()` when the choice ends.
    """

    tokenizer: ModelTokenizer
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0

    def push(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # nothing new yet, or the last character is still missing bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special_tokens, self.spaces_between_special_tokens)

    def flush(self) -> str:
        """Whatever text is still held back (an incomplete character at the very end becomes U+FFFD)."""
        if self.read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):] if full.startswith(prefix) else full

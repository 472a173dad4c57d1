"""The bounds on one request's work, in one place: what a single client may ask of the gateway and the workers.

Every limit is checked on the parsed JSON body before any work starts (before pydantic builds the request,
before the chat template renders, before anything is tokenized or compiled): counting a list or measuring a
string costs microseconds, while the work they would start (rendering 400k messages, tokenizing a 30 MB query,
an items x labels array on the engine thread) costs seconds of the event loop or gigabytes of a worker. A
request over a limit is a 400 in the API's error shape naming the field and the limit (and the flag that sets
it). Each field is a `pdserve gateway` flag (`add_arguments`), its help text the field's docstring.

The workers enforce at their own edge the limits that protect their memory (`MAX_STOP_TOKEN_IDS`,
`MAX_SCORE_LABELS` and `MAX_SCORE_VALUES` in shared/sampling_params.py): gRPC clients with the cluster token reach
them without the gateway. The gateway's flags for those may only lower them.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import json
from dataclasses import dataclass, fields

from pdserve.services.gateway.errors import ApiError
from pdserve.shared.sampling_params import MAX_SCORE_LABELS, MAX_STOP_TOKEN_IDS

KIB = 1 << 10
MIB = 1 << 20


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 32 * MIB
    """Bytes of a JSON request body, as it arrives or as it inflates (--inflate-request-bodies): 413 past them,
    as soon as they are passed. It holds a full context of token ids many times over; file uploads stream through
    to the jobs service, which has its own limit (--max-file-size)."""
    max_inflation_ratio: int = 100
    """With --inflate-request-bodies: how many times its compressed size a body may grow as it inflates, once
    past 1 MiB (413 beyond): JSON compresses 5-20 times; a body of padding, thousands of times."""
    max_messages: int = 2048
    """Messages in one chat completion (OpenAI's limit); checked before the chat template renders them."""
    max_list_items: int = 2048
    """Prompts or inputs in one list: completion and /generate prompts, embedding, /encode, /classify and /tokenize
    inputs, /v1/score items, /v1/rerank documents (OpenAI's 2048 embedding inputs)."""
    max_request_tokens: int = 300_000
    """Prompt tokens of one request, summed over its list (OpenAI's 300k tokens per embeddings request); texts
    are first measured in characters, so a list that cannot fit is refused without tokenizing it."""
    max_new_tokens: int | None = None
    """Most tokens one choice may generate. A request asking more (or nothing) gets what the context leaves after
    its prompt, capped here: as SGLang's --allow-auto-truncate, not a refusal. Default: the context alone."""
    max_score_labels: int = 256
    """label_token_ids of one /v1/score call (the worker builds an items x labels array); at most the workers'
    own limit of 1024."""
    max_stop_strings: int = 64
    """Stop strings of one request, matched against every piece of text it generates (OpenAI allows 4)."""
    max_stop_regex: int = 16
    """stop_regex patterns of one request, each searched in the end of its text at every piece it generates."""
    max_stop_regex_chars: int = 256
    """Characters of one stop_regex pattern (checked before it is compiled)."""
    max_stop_token_ids: int = MAX_STOP_TOKEN_IDS
    """stop_token_ids of one request, checked at every generated token; at most the workers' own limit."""
    max_logit_bias: int = 300
    """logit_bias entries of one request (OpenAI's historical 300)."""
    max_tools: int = 128
    """Tools (or functions) of one chat completion (OpenAI's 128)."""
    max_tools_bytes: int = 256 * KIB
    """Bytes of all tool definitions of one chat completion, as JSON: the template renders them into the prompt
    and tool_choice 'required' compiles them into one grammar."""
    max_grammar_bytes: int = 128 * KIB
    """Bytes of a request's grammar: json_schema, regex, ebnf, structural_tag or response_format's schema."""
    max_schema_depth: int = 64
    """Nesting depth of a JSON schema (objects and arrays, tool parameters included): compile time grows
    steeply with it (64: ~0.15 s; 128: ~1.2 s; 900: ~56 s on a 2-core CPU). Checked before compiling."""
    header_timeout_s: float = 15.0
    """Seconds a connection may take to send a request's head, and stay idle between requests (a half-sent
    request is dropped after it; aiohttp's default is an hour)."""
    body_timeout_s: float = 60.0
    """Seconds a request's body may take to arrive once its head is in (408 after)."""
    stream_write_timeout_s: float = 30.0
    """Seconds a streamed answer may wait for its client to read: a client that stops reading is cut off, its
    generation aborted and its admission place freed."""

    def check(self) -> None:
        """ValueError for settings a gateway cannot start with."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value <= 0:
                raise ValueError(f"--{_flag(f.name)} must be positive, got {value}")
        if self.max_stop_token_ids > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"--max-stop-token-ids must be at most the workers' limit of {MAX_STOP_TOKEN_IDS}")
        if self.max_score_labels > MAX_SCORE_LABELS:
            raise ValueError(f"--max-score-labels must be at most the workers' limit of {MAX_SCORE_LABELS}")

    # ------------------------------------------------------------ checks on a raw body
    def count(self, value: object, name: str, param: str) -> None:
        """400 when the list or object `value` holds more entries than the limit `name`."""
        limit = getattr(self, name)
        if isinstance(value, (list, dict)) and len(value) > limit:
            raise over(param, f"has {len(value)} entries", limit, name)

    def stop_regex(self, value: object, param: str) -> None:
        """How many stop_regex patterns, and how long each (a string or a list of them)."""
        self.count(value, "max_stop_regex", param)
        for k, pattern in enumerate([value] if isinstance(value, str) else value if isinstance(value, list) else []):
            if isinstance(pattern, str) and len(pattern) > self.max_stop_regex_chars:
                name = param if isinstance(value, str) else f"{param}.{k}"
                raise over(name, f"has {len(pattern)} characters", self.max_stop_regex_chars, "max_stop_regex_chars")

    def list_of_prompts(self, value: object, param: str) -> None:
        """A prompt field that may be one prompt or a list of them (text, or token ids)."""
        if isinstance(value, list) and value and not isinstance(value[0], int):
            self.count(value, "max_list_items", param)

    def text_total(self, texts: list, param: str, max_token_chars: int) -> None:
        """400 when texts hold more characters than max_request_tokens tokens could: they cannot fit."""
        self.chars_total(sum(len(t) for t in texts if isinstance(t, str)), param, max_token_chars)

    def chars_total(self, chars: int, param: str, max_token_chars: int) -> None:
        cap = self.max_request_tokens * max_token_chars
        if chars > cap:
            raise over(param, f"holds {chars} characters, more than {self.max_request_tokens} tokens can hold "
                              f"({cap})", self.max_request_tokens, "max_request_tokens", unit="tokens")

    def tokens_total(self, seqs: list[list[int]], param: str) -> None:
        self.tokens_count(sum(len(s) for s in seqs), param)

    def tokens_count(self, total: int, param: str) -> None:
        if total > self.max_request_tokens:
            raise over(param, f"holds {total} tokens in all", self.max_request_tokens, "max_request_tokens",
                       unit="tokens")

    def sampling(self, body: object, prefix: str = "") -> None:
        """The sampling fields a body (an OpenAI request, or native sampling_params) carries."""
        if not isinstance(body, dict):
            return
        self.count(body.get("stop"), "max_stop_strings", prefix + "stop")
        self.count(body.get("stop_token_ids"), "max_stop_token_ids", prefix + "stop_token_ids")
        self.stop_regex(body.get("stop_regex"), prefix + "stop_regex")
        self.count(body.get("logit_bias"), "max_logit_bias", prefix + "logit_bias")
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            self.grammar(body.get(name), prefix + name, parse=name == "json_schema")
        rf = body.get("response_format")
        if isinstance(rf, dict):
            schema = rf.get("json_schema")
            if isinstance(schema, dict):
                self.grammar(schema.get("schema"), prefix + "response_format.json_schema.schema")
            self.grammar({k: v for k, v in rf.items() if k in ("structures", "format")} or None,
                         prefix + "response_format")

    def grammar(self, value: object, param: str, parse: bool = False) -> None:
        """Size, and for a JSON schema its depth: a grammar given as text, or as parsed JSON."""
        if value is None:
            return
        text = value if isinstance(value, str) else json.dumps(value)
        if len(text.encode()) > self.max_grammar_bytes:
            raise over(param, f"has {len(text.encode())} bytes", self.max_grammar_bytes, "max_grammar_bytes",
                       unit="bytes")
        if isinstance(value, str) and parse:
            try:
                value = json.loads(value)
            except (ValueError, RecursionError):
                return  # not JSON: the compiler names the problem
        self.depth(value, param)

    def depth(self, value: object, param: str) -> None:
        deepest = nesting(value, self.max_schema_depth)
        if deepest > self.max_schema_depth:
            raise over(param, f"is nested more than {self.max_schema_depth} levels deep", self.max_schema_depth,
                       "max_schema_depth", unit="levels")

    def chat(self, body: dict) -> None:
        """Everything a chat completion's body asks for, before it is parsed or rendered."""
        self.count(body.get("messages"), "max_messages", "messages")
        self.sampling(body)
        for name in ("tools", "functions"):
            self.tools(body.get(name), name)

    def messages(self, body: dict) -> None:
        """An Anthropic Messages body, before it is parsed or rendered: its messages, stop sequences, tools and
        the sampling extensions it shares with chat (grammars, logit_bias)."""
        self.count(body.get("messages"), "max_messages", "messages")
        self.count(body.get("stop_sequences"), "max_stop_strings", "stop_sequences")
        self.sampling(body)
        self.tools(body.get("tools"), "tools")

    def responses(self, body: dict) -> None:
        """An OpenAI Responses body: its input items, tools, output format and the sampling extensions it shares
        with chat (stop strings, grammars, logit_bias)."""
        self.count(body.get("input") if isinstance(body.get("input"), list) else None, "max_messages", "input")
        self.sampling(body)
        self.tools(body.get("tools"), "tools")
        text = body.get("text")
        if isinstance(text, dict) and isinstance(text.get("format"), dict):
            self.grammar(text["format"].get("schema"), "text.format.schema")

    def tools(self, tools: object, name: str) -> None:
        self.count(tools, "max_tools", name)
        if isinstance(tools, list) and tools:
            size = len(json.dumps(tools).encode())
            if size > self.max_tools_bytes:
                raise over(name, f"has {size} bytes of definitions", self.max_tools_bytes, "max_tools_bytes",
                           unit="bytes")
            self.depth(tools, name)

    def new_tokens(self, asked: object, prompt_tokens: int, context: int) -> object:
        """max_new_tokens for a prompt: what was asked (None: as many as possible), capped at what the context
        leaves after the prompt and at the limit. A value that is not a count stays, for SamplingParams to
        refuse in its own words."""
        room = max(0, context - prompt_tokens)
        cap = room if self.max_new_tokens is None else min(room, self.max_new_tokens)
        if asked is None:
            return cap
        if not isinstance(asked, int) or isinstance(asked, bool) or asked < 0:
            return asked
        return min(asked, cap)


def text_chars(value: object) -> int:
    """Characters of every string in `value` (nested lists and objects walked without recursion): at least what
    a rendered prompt holds of them, so messages over the context's characters cannot fit."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return total


def over(param: str, what: str, limit: int | float, name: str, unit: str = "") -> ApiError:
    unit = f" {unit}" if unit else ""
    return ApiError(400, f"{param!r} {what}: the limit is {limit}{unit} (--{_flag(name)}).", param)


def nesting(value: object, stop: int) -> int:
    """Depth of nested lists and objects in `value` (a scalar is 0), counted no further than stop + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            item = list(item.values())
        if not isinstance(item, list):
            continue
        deepest = max(deepest, level)
        if deepest > stop:
            return deepest
        stack.extend((sub, level + 1) for sub in item if isinstance(sub, (list, dict)))
    return deepest


# ---------------------------------------------------------------- flags
def _flag(name: str) -> str:
    return name.removesuffix("_s").replace("_", "-")


def _docstrings() -> dict[str, str]:
    """Each field's docstring, read from the class's source (the help text of its flag)."""
    tree = ast.parse(inspect.getsource(Limits))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("request limits (a request over one is a 400 naming the field)")
    docs = _docstrings()
    for f in fields(Limits):
        kind = float if f.name.endswith("_s") else int
        metavar = "SECONDS" if kind is float else "N"
        group.add_argument(f"--{_flag(f.name)}", dest=f"limit_{f.name}", type=kind, default=f.default,
                           metavar=metavar, help=f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%"))


def from_args(args: argparse.Namespace) -> Limits:
    limits = Limits(**{f.name: getattr(args, f"limit_{f.name}", f.default) for f in fields(Limits)})
    limits.check()
    return limits

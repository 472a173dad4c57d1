"""Request schemas of the OpenAI-compatible and native APIs (pydantic), and their validation.

Unknown fields are ignored, as OpenAI does, except fields that name features this server does not offer
yet: those are refused with a 400 naming the field, never silently dropped (`refuse_unsupported`).
Value ranges are checked once, by the runtime's SamplingParams; these schemas check shapes and types. The
sampling fields of each API are built from SamplingParams through the API's dialect table (dialects.py).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, create_model, field_validator

from pdserve.services.gateway.errors import ApiError, from_validation_error, unsupported
from pdserve.services.gateway.intake.dialects import NATIVE, OPENAI_CHAT, sampling_fields
from pdserve.services.gateway.limits import Limits

StopField = Union[str, list[str], None]
# How many stop strings a request may give is a limit (limits.py, --max-stop-strings), checked on the raw body
# of chat, completions and /generate. `check_stop_count` holds a schema to the default for other request types.
MAX_STOP_STRINGS = Limits.max_stop_strings


def check_stop_count(v: StopField) -> StopField:
    if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are accepted, not {len(v)}")
    return v

# Fields that belong to later work, with the feature they stand for. A field is refused when present with a
# value that asks for something (None, empty containers and the neutral values below are accepted).
UNSUPPORTED_OPENAI = {
    "suffix": "suffix",
    "best_of": "best_of",
    "audio": "audio output",
    "modalities": "modalities other than text",
    "image_data": "image input",
    "audio_data": "audio input",
    "video_data": "video input",
    "input_embeds": "input_embeds",
    "return_hidden_states": "return_hidden_states",
    "custom_logit_processor": "custom logit processors",
}
NEUTRAL_VALUES: dict[str, tuple] = {
    "modalities": (["text"],),
    "best_of": (1,),
}


def refuse_unsupported(body: dict, fields: dict[str, str] = UNSUPPORTED_OPENAI, prefix: str = "") -> None:
    for name, what in fields.items():
        value = body.get(name)
        if value is None or value == [] or value == {} or value is False or value in NEUTRAL_VALUES.get(name, ()):
            continue
        raise unsupported(prefix + name, what)


def per_prompt(value, count: int, name: str) -> list:
    """A request field given once for every prompt, or as a list of one value per prompt."""
    if isinstance(value, list):
        if len(value) != count:
            raise ApiError(400, f"'{name}' has {len(value)} entries for {count} prompts.", name)
        return value
    return [value] * count


def parse(model: type[BaseModel], body: dict, prefix: str = "") -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc, prefix) from None


class RequestModel(BaseModel):
    """The base of every request body's model, in every room: fields it does not know are ignored (as SGLang)."""

    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# ---------------------------------------------------------------- shared sampling fields
_OpenAISamplingFields = create_model("_OpenAISamplingFields", __base__=RequestModel, **sampling_fields(OPENAI_CHAT))


class OpenAISampling(_OpenAISamplingFields):
    """Fields common to /v1/chat/completions and /v1/completions (SGLang's extensions included): SamplingParams'
    under their OpenAI names (generated), and what shapes the text."""

    model: str | None = None
    lora_path: str | list[str | None] | None = None  # LoRA adapter by name or loaded path (a list: one per prompt)
    stop: StopField = None
    stop_regex: StopField = None  # SGLang's: the output ends at the first match of one of these
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    rid: str | None = None
    user: str | None = None
    return_cached_tokens_details: bool = False
    # Structured output: OpenAI's response_format, or one of SGLang's constraint fields (constraints.py).
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: StopField) -> StopField:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every streamed chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        return bool(self.stream_options and self.stream_options.include_usage
                    and self.stream_options.continuous_usage_stats)


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: SGLang's begin/schema/end structures with their triggers, or xgrammar's `format` object.
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None
    format: dict[str, Any] | None = None


class StreamOptions(RequestModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# ---------------------------------------------------------------- chat
class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict] | None = None
    reasoning_content: str | None = None

    def text(self, where: str) -> str | None:
        """The content as one string; content parts other than text are refused."""
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for i, part in enumerate(self.content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                if kind in ("image_url", "input_image", "input_audio", "audio_url", "video_url", "file"):
                    raise unsupported(f"{where}.content.{i}.type", f"{kind} content (multimodal input)")
                raise ApiError(400, f"Content part type {kind!r} is not valid; use 'text'.",
                               f"{where}.content.{i}.type")
            texts.append(parse(TextPart, part, f"{where}.content.{i}.").text)
        return " ".join(texts)


class ChatCompletionRequest(OpenAISampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    continue_final_message: bool = False
    add_generation_prompt: bool = True
    parallel_tool_calls: bool | None = None
    # Shapes are checked by tool_calls.plan_tools, which names the exact field at fault.
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None

    def template_messages(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": m.text(f"messages.{i}") or ""}
            for key in ("name", "tool_call_id", "tool_calls", "reasoning_content"):
                value = getattr(m, key)
                if value is not None:
                    msg[key] = value
            out.append(msg)
        return out


# ---------------------------------------------------------------- completions
PromptField = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(OpenAISampling):
    prompt: PromptField
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: PromptField) -> PromptField:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("the prompt must not be empty")
        return v

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


# ---------------------------------------------------------------- native /generate
UNSUPPORTED_NATIVE_SAMPLING = {
    "custom_params": "custom_params (custom logit processors)",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_NativeSamplingFields = create_model("_NativeSamplingFields", __base__=_Strict, **sampling_fields(NATIVE))


class NativeSampling(_NativeSamplingFields):
    """SGLang's sampling_params: SamplingParams' fields under their native names (generated), and what shapes the
    text. Unknown names are refused (they are most likely typos)."""

    stop: StopField = None
    stop_regex: StopField = None  # the output ends at the first match of one of these
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = Field(None, ge=1)  # new tokens per streamed event
    custom_params: Any = None  # accepted by name so that the refusal above can name it

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


# sampling_params are validated per prompt (NativeSampling, naming the prompt in errors); the API document
# shows what they hold.
_SAMPLING_SCHEMA = NativeSampling.model_json_schema()
SamplingParamsField = Annotated[dict[str, Any] | list[dict[str, Any]] | None, WithJsonSchema(
    {"anyOf": [_SAMPLING_SCHEMA, {"type": "array", "items": _SAMPLING_SCHEMA}, {"type": "null"}]})]


class GenerateRequest(RequestModel):
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsField = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    token_ids_logprob: Any = None  # a list of token ids (a batch: or one list per prompt); native.py checks it
    return_text_in_logprobs: bool = False
    rid: str | list[str] | None = None
    model: str | None = None
    lora_path: str | list[str | None] | None = None  # LoRA adapter by name or loaded path (a list: one per prompt)
    cache_salt: str | None = None  # the prompts' cache namespace (SamplingParams.cache_salt), for all of them

    def prompts(self) -> tuple[list[str | list[int]], bool]:
        """(one entry per prompt, whether the request is a batch)."""
        if (self.text is None) == (self.input_ids is None):
            raise ApiError(400, "Give exactly one of 'text' and 'input_ids'.", "text")
        if self.text is not None:
            return ([self.text], False) if isinstance(self.text, str) else (list(self.text), True)
        ids = self.input_ids
        if ids and isinstance(ids[0], list):
            return [list(x) for x in ids], True
        return [list(ids)], False


class TokenizeRequest(RequestModel):
    """SGLang's /tokenize: a `prompt` (text or texts), or chat `messages` (with the chat request's `tools`,
    `tool_choice` and template options, read by ChatCompletionRequest) rendered by the chat template."""
    prompt: str | list[str] | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool = True
    model: str | None = None


class DetokenizeRequest(RequestModel):
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True
    model: str | None = None


class AbortRequestBody(RequestModel):
    rid: str = ""
    abort_all: bool = False


OpenAISampling.model_rebuild()
ChatCompletionRequest.model_rebuild()
CompletionRequest.model_rebuild()

"""The OpenAI API's request and response bodies (pydantic), with vLLM's extensions.

Requests check types and shapes only; the *values* (a negative temperature, ``max_tokens`` of
0, a prompt beyond the context) are checked by the serving code and ``SamplingParams``, as vLLM
does. Either violation is a 400 naming the field, as OpenAI answers; so is a parameter of
OpenAI's API or a vLLM extension that this server does not implement (``UNSUPPORTED_FIELDS``);
a field neither defines is accepted and its name logged once, as vLLM does
(``serving_common.check_undeclared_fields``). The chat messages (OpenAI's content parts,
vLLM's ``video_url`` part) and tool-calling shapes are here too.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)


class _Open(BaseModel):
    """A request object that keeps its undeclared keys for
    ``serving_common.check_undeclared_fields`` to judge: those in ``unsupported_fields`` (an
    OpenAI or vLLM field this server does not implement) are a 400 (in a nested object only
    when not null), any other is accepted and logged once."""

    model_config = ConfigDict(extra="allow")
    unsupported_fields: ClassVar[frozenset[str]] = frozenset()


class FunctionDefinition(_Open):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the arguments always follow the schema exactly when enforced


class ChatTool(_Open):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionName(_Open):
    name: str


class NamedToolChoice(_Open):
    type: Literal["function"] = "function"
    function: FunctionName


class FunctionCall(_Open):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Open):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitNone(BaseModel):
    """Serialised without its fields that are None (OpenAI's stream deltas)."""

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNone):
    """A streamed call: its first delta has ``id``, ``type`` and the function's name, later
    ones add text to its ``arguments`` (clients concatenate them by ``index``)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ImageURL(_Open):
    url: str  # data:image/...;base64,..., http(s)://... (allowed hosts), file://... (allowed root)
    # OpenAI's: "low" preprocesses the image with a smaller pixel budget (Qwen2-VL: at most
    # 448 x 448 pixels, 256 tokens; mm_processor.IMAGE_DETAILS); "high" and "auto" as the server.
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ImageURLPart(_Open):
    type: Literal["image_url"]
    image_url: ImageURL
    # vLLM's extension: identifies the image in place of its content in the caches.
    uuid: str | None = None


class VideoURL(_Open):
    url: str  # data:video/...;base64,..., http(s)://... (allowed hosts), file://... (allowed root)


class VideoURLPart(_Open):
    """vLLM's video part: a video file (any container and codec FFmpeg decodes)."""

    type: Literal["video_url"]
    video_url: VideoURL
    uuid: str | None = None  # identifies the video in place of its content in the caches


ContentPart = Annotated[TextPart | ImageURLPart | VideoURLPart, Field(discriminator="type")]


class ChatMessage(_Open):
    # OpenAI's, refused unless null (the OpenAI SDK's dump of an earlier reply, which clients
    # send back as it is, carries them as null).
    unsupported_fields = frozenset({"audio", "function_call"})

    role: str  # "system", "user", "assistant", "tool", ...: what the chat template accepts
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer: to which call

    @model_validator(mode="after")
    def _content_unless_assistant(self) -> ChatMessage:
        # OpenAI's: only an assistant's message (e.g. one of tool calls) may have no content.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content is required in a {self.role!r} message (null given)")
        return self


# ---- requests ----------------------------------------------------------------------------

# Parameters of OpenAI's chat-completions and completions APIs, and vLLM extensions, that this
# server does not implement: a request setting one gets a 400 naming it. (README: "API fields".)
# A request model that declares one of these names takes it (it is then no extra field) and
# the others refuse it: e.g. echo is chat's and completions', not /tokenize's.
UNSUPPORTED_FIELDS = frozenset(
    {
        # OpenAI
        "audio", "best_of", "function_call", "functions", "metadata",
        "modalities", "parallel_tool_calls", "prediction", "prompt_cache_retention",
        "reasoning_effort", "service_tier", "store", "tool_choice", "tools", "verbosity",
        "web_search_options",
        # vLLM's extensions
        "add_generation_prompt", "add_special_tokens", "allowed_token_ids", "bad_words",
        "chat_template", "chat_template_kwargs", "continue_final_message", "documents",
        "ec_transfer_params", "guided_choice", "guided_decoding_backend", "guided_grammar",
        "guided_json", "guided_regex", "guided_whitespace_pattern", "include_reasoning",
        "kv_transfer_params", "logits_processors", "logprob_token_ids", "media_io_kwargs",
        "mm_processor_kwargs", "prompt_embeds", "repetition_detection", "request_id",
        "echo", "return_mm_kwargs", "return_prompt_text", "return_token_offsets",
        "routed_experts_prompt_start", "suffix", "spaces_between_special_tokens",
        "stream_interval", "thinking_token_budget", "truncate_prompt_tokens",
        "truncation_side", "vllm_xargs", "watermarking",
    }
)  # fmt: skip


class _Request(_Open):
    # Strict types at the top level, as OpenAI checks them: ``max_tokens: true`` or ``"10"``
    # is a 400 naming the field, not 1 or 10 (an int still passes for a float).
    model_config = ConfigDict(extra="allow", strict=True)
    unsupported_fields = UNSUPPORTED_FIELDS


class JSONSchemaFormat(_Open):
    name: str
    description: str | None = None
    json_schema: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced exactly (xgrammar's strict mode)


class ResponseFormat(_Open):
    """OpenAI's ``response_format``: ``text``, ``json_object``, or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsRequest(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these
    (``mm_serve.messages.structured_outputs``)."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF), rule "root"
    json_object: bool | None = None


class StreamOptions(_Open):
    # One last chunk with the usage and no choices; null means false (OpenAI's reading).
    include_usage: bool | None = False
    # vLLM's: with include_usage, every chunk has the usage so far too.
    continuous_usage_stats: bool | None = False


class SamplingRequest(_Request):
    """Fields shared by chat and text completions. None means "the default": the checkpoint's
    ``generation_config.json`` where it sets one, else vLLM's (OpenAI's) default."""

    model: str | None = None  # None: the served model
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # OpenAI's end-user id, for abuse monitoring upstream: accepted for compatibility and
    # otherwise ignored. It does not salt the prefix cache; send cache_salt for that.
    user: str | None = None
    # The same for OpenAI's successor of ``user``, OpenAI's prompt-cache routing hint (the
    # prefix cache finds shared prefixes without one) and vLLM's session id (for routers).
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    session_id: str | None = None
    # vLLM's extensions.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    # Keeps this request's KV blocks from being shared with requests of another salt.
    cache_salt: str | None = None
    # Logprob entries name tokens as "token_id:<id>" (exact, also for partial UTF-8 tokens).
    return_tokens_as_token_ids: bool = False
    # The prompt's token ids (images expanded) and each choice's generated ids in the response.
    return_token_ids: bool = False
    # Each prompt token's logprob and its top-k (the first token has none); not with stream.
    prompt_logprobs: int | None = None
    # OpenAI's: token id (a string) -> bias in [-100, 100] added to its logit.
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None  # vLLM's
    # Beam search (mm_serve.frontend.beam_search): n beams, the n best sequences as choices,
    # best first; length_penalty weighs a finished sequence's length in its score.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # vLLM's: lower runs first, with --scheduling-policy priority.
    priority: int = 0


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # vLLM's extensions. The template's opening of the assistant's turn; with it off, the
    # reply continues in the role of the last message.
    add_generation_prompt: bool = True
    # The last message (the assistant's) left open, to be continued; not with the above.
    continue_final_message: bool = False
    # The reply's content starts with the last message's, when that message has its role.
    echo: bool = False
    # Image processor settings for this request's images (Qwen2-VL: min_pixels, max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
    # Further variables of the chat template (e.g. Qwen3's enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None
    # The tokenizer's special tokens (BOS) added to the rendered text even where the template
    # wrote them (vLLM's); false: BOS only where the template did not (as HF's processors).
    add_special_tokens: bool = False


class CompletionRequest(SamplingRequest):
    # One prompt or a batch: text, or token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    # vLLM's: the tokenizer's special tokens (BOS) added to a text prompt.
    add_special_tokens: bool = True


class TokenizeCompletionRequest(_Request):
    """vLLM's ``/tokenize`` of a text prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Request):
    """vLLM's ``/tokenize`` of chat messages, rendered by the chat template, images expanded."""

    model: str | None = None
    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # mm_serve's extension: prompt images not encoded for this request (their embeddings were
    # in the encoder cache, or their whole placeholder range in the prefix cache).
    cached_images: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0  # image placeholder tokens included
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # with add_generation_prompt false: the last message's role
    content: str | None = None
    tool_calls: list[ToolCall] | None = None  # left out of the JSON when there are none

    @model_serializer(mode="wrap")
    def _omit_no_calls(self, handler: SerializerFunctionWrapHandler) -> dict:
        message = handler(self)
        if message.get("tool_calls") is None:
            message.pop("tool_calls", None)
        return message


def _now() -> int:
    return int(time.time())


L = TypeVar("L", bound=BaseModel)  # a choice's logprobs
C = TypeVar("C", bound=BaseModel)  # a response's choice


class _Choice(BaseModel, Generic[L]):
    index: int
    logprobs: L | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it
    token_ids: list[int] | None = None  # vLLM's return_token_ids: this choice's (chunk's) ids


class _Response(BaseModel, Generic[C]):
    """A response or chunk; subclasses narrow ``object`` (a field redeclared keeps its place
    in the JSON)."""

    id: str
    object: str
    created: int = Field(default_factory=_now)
    model: str
    choices: list[C]
    usage: UsageInfo | None = None


class ChatCompletionChoice(_Choice[ChatLogprobs]):
    message: ChatResponseMessage


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token, None for the first, else {token id: its logprob}.
PromptLogprobList = list[dict[int, PromptLogprob] | None]


class ChatCompletionResponse(_Response[ChatCompletionChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids
    prompt_logprobs: PromptLogprobList | None = None


class DeltaMessage(OmitNone):
    """What one chunk adds to a choice's message; fields it does not set are left out of the
    JSON (``role`` only in a choice's first chunk, ``content`` absent from a bare finish), as
    OpenAI sends it: clients tell a token chunk by ``content`` without ``role``."""

    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(_Choice[ChatLogprobs]):
    delta: DeltaMessage


class ChatCompletionChunk(_Response[ChatCompletionStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Choice[CompletionLogprobs]):
    text: str
    prompt_token_ids: list[int] | None = None  # return_token_ids (a stream: its first chunk)
    prompt_logprobs: PromptLogprobList | None = None


class CompletionResponse(_Response[CompletionChoice]):
    """A text completion, or (streaming) one chunk of it: the same object."""

    object: Literal["text_completion"] = "text_completion"


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "mm_serve"
    root: str  # the checkpoint as given on the command line; a LoRA adapter's folder
    parent: str | None = None  # a LoRA adapter's base model (its served name)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str  # "invalid_request_error", "authentication_error", "rate_limit_error", ...
    param: str | None = None  # the request field at fault, when one is
    code: str | None = None  # e.g. "model_not_found", "context_length_exceeded"


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    """The JSON-ready dict of an ``ErrorResponse``."""
    info = ErrorInfo(message=message, type=type, param=param, code=code)
    return ErrorResponse(error=info).model_dump()

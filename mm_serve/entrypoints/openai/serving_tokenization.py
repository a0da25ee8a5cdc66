"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extensions): the served model's tokenizer
and chat template, without generating.

A chat is tokenized exactly as ``/v1/chat/completions`` would send it to the engine: rendered
by the chat template, its images fetched, preprocessed and expanded to their placeholder
tokens, so that ``count`` is the prompt length a completion would be charged for.
"""

from __future__ import annotations

from mm_serve.entrypoints.openai.errors import bad_request, user_errors
from mm_serve.entrypoints.openai.media import MediaResolver
from mm_serve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from mm_serve.entrypoints.openai.serving_chat import check_chat_template_options
from mm_serve.entrypoints.openai.serving_common import ModelInfo, check_request_fields
from mm_serve.frontend.async_llm import AsyncLLM


class ServingTokenization:
    """The two endpoints over one ``AsyncLLM`` (no admission limit: nothing is generated)."""

    def __init__(self, llm: AsyncLLM, model: ModelInfo, media: MediaResolver) -> None:
        self.llm = llm
        self.model = model
        self.media = media

    async def tokenize(
        self, request: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> TokenizeResponse:
        """The prompt's token ids (and, with ``return_token_strs``, the tokens' strings).

        Raises:
            APIError: 404 for a model not served; 400 for an undeclared field, invalid text,
                messages the chat template rejects, or an image that cannot be used.
        """
        check_request_fields(request)
        self.model.name_for(request.model)
        if isinstance(request, TokenizeChatRequest):
            tokens = await self._chat_tokens(request)
        else:
            text, special = request.prompt, request.add_special_tokens
            tokens = await self.llm.with_tokenizer(
                lambda tokenizer: tokenizer(text, add_special_tokens=special).input_ids
            )
        token_strs = None
        if request.return_token_strs:
            token_strs = await self.llm.with_tokenizer(
                lambda tokenizer: tokenizer.convert_ids_to_tokens(tokens)
            )
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.llm.max_model_len,
            tokens=tokens,
            token_strs=token_strs,
        )

    async def _chat_tokens(self, request: TokenizeChatRequest) -> list[int]:
        check_chat_template_options(
            request.messages, request.add_generation_prompt, request.continue_final_message
        )
        messages = [m.model_dump(exclude_none=True) for m in request.messages]
        messages = await self.media.resolve(messages)
        with user_errors():
            processed = await self.llm.process_chat(
                messages,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
            )
        return processed.token_ids

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of ``tokens``, special tokens included (as vLLM's ``/detokenize``).

        Raises:
            APIError: 404 for a model not served; 400 for an undeclared field or a token id
                outside the vocabulary.
        """
        check_request_fields(request)
        self.model.name_for(request.model)
        vocab_size = self.llm.config.model.vocab_size
        if any(not 0 <= t < vocab_size for t in request.tokens):
            raise bad_request(f"tokens must be in [0, {vocab_size}).", param="tokens")
        tokens = request.tokens
        text = await self.llm.with_tokenizer(lambda tokenizer: tokenizer.decode(tokens))
        return DetokenizeResponse(prompt=text)
